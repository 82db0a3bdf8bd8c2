"""tabby-node's mirror of the datastore: the documents it watches, fed by ``store.sync``."""

from __future__ import annotations

import threading
from typing import Any

from datastore.base import Doc
from tabby_node.cluster import WATCHED_KINDS


class Cache:
    """A mirror of the watched documents, fed by ``store.sync``; ``version`` grows with
    every change and ``changed`` wakes the dataplane thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.docs: dict[str, dict[str, Doc]] = {k: {} for k in WATCHED_KINDS}
        self.version = 0
        self.synced = threading.Event()
        #: Set when a document changed that the dataplane depends on (a reconcile is due).
        self.changed = threading.Event()
        #: Wakes the dataplane loop: a change, or a CNI call waiting for its pod's rules.
        self.wake = threading.Event()
        self.resyncs = 0
        self.last_error: str | None = None

    def apply(self, event: Any) -> None:
        with self.lock:
            if event.type == "snapshot":
                self.docs = {k: dict(event.snapshot.get(k, {})) for k in WATCHED_KINDS}
                self.resyncs += 1
            elif event.type == "put" and event.doc is not None:
                docs = self.docs.setdefault(event.kind, {})
                refresh = event.kind == "heartbeat" and event.key in docs
                docs[event.key] = event.doc
                if refresh:
                    # A live node's heartbeat renewed: nothing the dataplane depends on
                    # changed (a node appearing or expiring does). No reconcile for it:
                    # with many nodes these are most of the watch events.
                    self.last_error = None
                    self.synced.set()
                    return
            elif event.type == "delete":
                self.docs.setdefault(event.kind, {}).pop(event.key, None)
            self.version += 1
            self.last_error = None
        self.synced.set()
        self.changed.set()
        self.wake.set()

    def put_local(self, kind: str, key: str, doc: Doc | None) -> None:
        """What this node just wrote, ahead of the watch (which will say the same)."""
        with self.lock:
            if doc is None:
                self.docs.setdefault(kind, {}).pop(key, None)
            else:
                current = self.docs.setdefault(kind, {}).get(key)
                if current is None or current.revision <= doc.revision:
                    self.docs[kind][key] = doc
            self.version += 1

    def view(self) -> dict[str, dict[str, Doc]]:
        with self.lock:
            return {k: dict(v) for k, v in self.docs.items()}
