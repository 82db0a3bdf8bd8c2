"""tabby-node's mirror of the datastore: the documents it watches, fed by ``store.sync`` and
parsed once per revision (``resources.index``)."""

from __future__ import annotations

import threading
from typing import TypeVar

from datastore.base import Doc, SyncEvent
from resources.index import HEARTBEATS, POLICY, ROUTING, Documents, Index, Kind

T = TypeVar("T")

#: The store kinds tabby-node watches: routing's, then policy's.
WATCHED_KINDS = tuple(k.name for k in (*ROUTING, *POLICY))


class Cache:
    """The watched documents, typed; ``version`` grows with every change, ``changed`` and
    ``wake`` wake the dataplane thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.index = Index((*ROUTING, *POLICY))
        self.version = 0
        self.synced = threading.Event()
        #: Set when a document changed that the dataplane depends on (a reconcile is due).
        self.changed = threading.Event()
        #: Wakes the dataplane loop: a change, or a CNI call waiting for its pod's rules.
        self.wake = threading.Event()
        self.resyncs = 0
        self.last_error: str | None = None

    def apply(self, event: SyncEvent) -> None:
        with self.lock:
            if event.type == "snapshot":
                self.resyncs += 1
            elif (
                event.type == "put"
                and event.kind == HEARTBEATS.name
                and self.index.has(event.kind, event.key)
            ):
                # A live node's heartbeat renewed: nothing the dataplane depends on changed
                # (a node appearing or expiring does). No reconcile for it: with many nodes
                # these are most of the watch events.
                self.index.apply(event)
                self.last_error = None
                self.synced.set()
                return
            changed = self.index.apply(event)
            if changed:
                self.version += 1
            self.last_error = None
        self.synced.set()
        if changed:
            self.changed.set()
            self.wake.set()

    def put_local(self, kind: str, key: str, doc: Doc | None) -> None:
        """What this node just wrote, ahead of the watch (which will say the same)."""
        with self.lock:
            if doc is None:
                changed = self.index.delete(kind, key)
            else:
                changed = self.index.put(kind, key, doc)
            if changed:
                self.version += 1

    def get(self, kind: Kind[T], key: str) -> T | None:
        """One document, typed (no snapshot of the rest)."""
        with self.lock:
            return self.index.get(kind, key)

    def view(self) -> Documents:
        with self.lock:
            return self.index.snapshot()
