"""A consumer of ``store.sync`` for the datastore tests (the contract on every store, the
etcd store's own): it runs the iterator in a thread, keeps the state a consumer would, and
checks each event's shape as it comes (one snapshot, first; a put carries its document, a
delete removes something known)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence

import pytest

from datastore.base import Doc, Store, SyncEvent


class Mirror:
    """Consumes ``store.sync`` in a thread and keeps the state a consumer would."""

    def __init__(self, store: Store, kinds: Sequence[str]) -> None:
        self.store = store
        self.stop = threading.Event()
        self.events: list[SyncEvent] = []
        self.state: dict[str, dict[str, Doc]] = {}
        self.snapshots = 0
        self.error: BaseException | None = None
        self.ended = threading.Event()
        self._cond = threading.Condition()
        self._iter = store.sync(kinds, self.stop)  # argument errors surface here
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for ev in self._iter:
                with self._cond:
                    self.events.append(ev)
                    if ev.type == "snapshot":
                        assert ev.snapshot is not None
                        assert (ev.kind, ev.key, ev.doc) == ("", "", None)
                        assert len(self.events) == 1, "a snapshot after the first event"
                        self.state = {k: dict(v) for k, v in ev.snapshot.items()}
                        self.snapshots += 1
                    elif ev.type == "put":
                        assert ev.doc is not None
                        assert ev.snapshot is None
                        self.state[ev.kind][ev.key] = ev.doc
                    else:
                        assert ev.type == "delete"
                        assert ev.doc is None
                        assert ev.snapshot is None
                        self.state[ev.kind].pop(ev.key)  # a delete of something known
                    self._cond.notify_all()
        except BaseException as e:
            self.error = e
        finally:
            self.ended.set()
            with self._cond:
                self._cond.notify_all()

    def wait(self, cond: Callable[[], bool], timeout: float = 20.0, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not cond():
                if self.error is not None:
                    raise AssertionError("sync failed") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    stats = getattr(self.store, "sync_stats", "")
                    pytest.fail(f"sync never reached {what or 'the state'} {stats}: {self.state}")
                self._cond.wait(min(left, 0.1))

    def wait_matches(self, store: Store, timeout: float = 20.0) -> None:
        """Until the mirror equals what the store lists now."""

        def same() -> bool:
            want = {k: dict(store.list(k)) for k in self.state}
            return self.state == want

        self.wait(same, timeout, "the store's state")

    def close(self) -> float:
        """Set stop; the seconds until the iterator ended."""
        t0 = time.monotonic()
        self.stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive(), "sync did not end after stop"
        if self.error is not None:
            raise AssertionError("sync failed") from self.error
        return time.monotonic() - t0
