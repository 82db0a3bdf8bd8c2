"""The ``watcher`` thread: ``store.sync()`` of the kinds tabby-node watches into its cache
(a fresh snapshot after a broken watch); with tabby-typha, its stream's ``sync`` (which
never breaks: it reconnects itself and yields only differences)."""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

from datastore.errors import StoreRemoved
from ipam.core.errors import DatastoreError
from tabby_node.cache import WATCHED_KINDS

if TYPE_CHECKING:
    from datastore.base import Store
    from fanout.client import TyphaSync
    from tabby_node.cache import Cache
    from tabby_node.view import DatastoreErrors

log = logging.getLogger("tabby.node")


class Watcher:
    def __init__(
        self,
        store: Store | TyphaSync,  # the datastore's watch, or tabby-typha's stream
        cache: Cache,
        *,
        stopping: threading.Event,
        beats: dict[str, float],
        metrics: DatastoreErrors | None = None,
    ) -> None:
        self.store = store
        self.cache = cache
        self.stopping = stopping
        self.beats = beats
        self.metrics = metrics
        #: what the store said when it saw its kinds being deleted (an uninstall), if it did
        self.removed: str | None = None

    def run(self) -> None:
        """The thread, until ``stopping``: a broken watch is opened again (after 0.2 s,
        doubling to 5 s while it keeps failing)."""
        delay = 0.2
        while not self.stopping.is_set():
            try:
                for event in self.store.sync(WATCHED_KINDS, self.stopping):
                    self.cache.apply(event)
                    self.beats["watcher"] = time.monotonic()
                    delay = 0.2
                    snapshot = event.type == "snapshot"
                    # not held until the next event (at rest: none for long): a snapshot
                    # holds every document the cache chose not to keep
                    del event
                    if snapshot:
                        release_freed_memory()
            except DatastoreError as e:
                if isinstance(e, StoreRemoved):
                    self.removed = str(e)
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error("watch")
                self.cache.last_error = str(e)
                log.warning("datastore watch: %s (again in %.1f s)", e, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, 5.0)


def release_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's ``malloc_trim``): the
    bytes a snapshot's documents were read into are freed once the cache has parsed them,
    but stay in this thread's malloc arena otherwise."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
