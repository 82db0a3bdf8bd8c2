"""In-memory Store with the same semantics as the file and etcd stores (tests, dry runs).

What is common to every store (argument checks, encoding, compare-and-swap, listing order,
the lock session, sync bookkeeping) is ``datastore.engine``; this module keeps dicts and
subscribers.

Documents are kept JSON-encoded (``engine.encode``), so every ``get`` returns a fresh copy
and a non-JSON value fails at ``put`` exactly as it would on disk. Revisions come from one
counter for the whole store (as etcd's revision is), so they are never reused for a key.
A document written with a ttl (``put_leased``) expires on the
store's clock (``time.monotonic`` unless given); expired documents are dropped, and their
deletion published to ``sync`` iterators, by the next operation that looks (or by the
iterators themselves, which wake at least every 0.2 s). A ``sync`` iterator's queue is
unbounded: it never overflows, so an iterator reads again only when ``resync`` says so.
``lock()`` is a ``threading.Lock`` of the store object with the lock timeout; taking it
again in the same thread waits, then raises ``LockTimeout`` (tests use that to stand for
another holder).
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator

from datastore.base import KINDS, Doc, SyncEvent
from datastore.engine import Engine, Reported, Write
from datastore.errors import StoreCorrupt

POLL = 0.2  # longest sleep of a sync iterator between looks at ``stop`` and expiries


class _Entry:
    __slots__ = ("expires", "revision", "ttl", "value")

    def __init__(
        self, value: bytes, revision: int, expires: float | None, ttl: float | None = None
    ) -> None:
        self.value = value
        self.revision = revision
        self.expires = expires
        self.ttl = ttl


class _Sub:
    """One ``sync`` iterator: the kinds it watches and the changes not yet taken."""

    __slots__ = ("events", "kinds", "resync")

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = frozenset(kinds)
        self.events: deque[tuple[str, str, _Entry | None]] = deque()
        self.resync = False


class MemoryStore(Engine):
    """Dict-backed store; thread-safe; its lock is a ``threading.Lock`` with a timeout."""

    def __init__(
        self, *, lock_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        super().__init__()
        self.lock_timeout = lock_timeout
        self.lock_path = "memory:lock"
        self.clock = clock
        self._mutex = threading.Lock()
        self._guard = threading.Lock()  # protects everything below; lock() is separate
        self._cond = threading.Condition(self._guard)
        self._docs: dict[str, dict[str, _Entry]] = {k: {} for k in KINDS}
        self._expiring: dict[tuple[str, str], float] = {}
        self._rev = 0
        self._corrupt: set[tuple[str, str]] = set()
        self._subs: list[_Sub] = []
        self.unusable: str | None = None  # tests: set a reason to make check_usable fail

    def _thread_lock(self) -> threading.Lock:
        return self._mutex  # this object's own: two memory stores are two stores

    def location(self, kind: str, key: str) -> str:
        return f"memory:{kind}/{key}"

    # -- reads ----------------------------------------------------------------------------

    def _get(self, kind: str, key: str) -> Doc | None:
        with self._guard:
            self._purge()
            self._check_corrupt(kind, key)
            entry = self._docs[kind].get(key)
        return None if entry is None else _doc(entry)

    def _keys(self, kind: str) -> builtins.list[str]:
        with self._guard:
            self._purge()
            keys = set(self._docs[kind])
            keys.update(k for (c, k) in self._corrupt if c == kind)
        return builtins.list(keys)

    def _items(self, kind: str, prefix: str) -> builtins.list[tuple[str, Doc]]:
        with self._guard:
            self._purge()
            bad = sorted(k for (c, k) in self._corrupt if c == kind and k.startswith(prefix))
            if bad:
                raise StoreCorrupt(self.location(kind, bad[0]), "corrupt (injected)")
            items = [(k, e) for k, e in self._docs[kind].items() if k.startswith(prefix)]
        return [(k, _doc(e)) for k, e in items]

    # -- writes ---------------------------------------------------------------------------

    def _apply(self, write: Write) -> int:
        with self._guard:
            self._purge()
            self._check_corrupt(write.kind, write.key)
            self._compare(write, _revision(self._docs[write.kind].get(write.key)))
            self._rev += 1
            if write.value is not None:
                self._set(write.kind, write.key, write.value, write.ttl)
                return self._rev
            self._remove(write.kind, write.key)
            return 0

    def _set(self, kind: str, key: str, value: bytes, ttl: float | None) -> None:
        expires = None if ttl is None else self.clock() + ttl
        entry = _Entry(value, self._rev, expires, ttl)
        self._docs[kind][key] = entry
        if expires is None:
            self._expiring.pop((kind, key), None)
        else:
            self._expiring[(kind, key)] = expires
        self._publish(kind, key, entry)

    def _keepalive(self, kind: str, key: str) -> bool:
        with self._guard:
            self._purge()
            entry = self._docs[kind].get(key)
            if entry is None or entry.ttl is None:
                return False
            entry.expires = self.clock() + entry.ttl
            self._expiring[(kind, key)] = entry.expires
            return True

    def _remove(self, kind: str, key: str) -> None:
        del self._docs[kind][key]
        self._expiring.pop((kind, key), None)
        self._publish(kind, key, None)

    def _purge(self) -> None:
        """Drop expired documents (caller holds ``_guard``)."""
        if not self._expiring:
            return
        now = self.clock()
        for (kind, key), expires in list(self._expiring.items()):
            if expires <= now:
                self._remove(kind, key)

    def _publish(self, kind: str, key: str, entry: _Entry | None) -> None:
        for sub in self._subs:
            if kind in sub.kinds:
                sub.events.append((kind, key, entry))
        if self._subs:
            self._cond.notify_all()

    def _check_corrupt(self, kind: str, key: str) -> None:
        if (kind, key) in self._corrupt:
            raise StoreCorrupt(self.location(kind, key), "corrupt (injected)")

    # -- sync -----------------------------------------------------------------------------

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        sub = _Sub(kinds)
        reported = Reported()
        with self._guard:
            self._purge()
            first = reported.snapshot(self._snapshot(kinds))
            self._subs.append(sub)
        self.count_sync("snapshots")
        try:
            yield first
            while not stop.is_set():
                with self._guard:
                    self._purge()
                    if not sub.events and not sub.resync:
                        self._cond.wait(self._wait_time())
                        self._purge()
                    if sub.resync:  # read again: only what differs from what was reported
                        sub.resync = False
                        sub.events.clear()
                        now = self._snapshot(kinds)
                        pending: list[SyncEvent | None] = [
                            event for kind in kinds for event in reported.changes(kind, now[kind])
                        ]
                        self.count_sync("rereads")
                    else:
                        pending = [
                            reported.change(kind, key, None if e is None else _doc(e))
                            for kind, key, e in sub.events
                        ]
                        sub.events.clear()
                for event in pending:
                    if event is not None:
                        yield event
        finally:
            with self._guard:
                self._subs.remove(sub)

    def _wait_time(self) -> float:
        if not self._expiring:
            return POLL
        return max(0.0, min(POLL, min(self._expiring.values()) - self.clock()))

    def _snapshot(self, kinds: tuple[str, ...]) -> dict[str, dict[str, Doc]]:
        return {
            kind: {key: _doc(e) for key, e in sorted(self._docs[kind].items())} for kind in kinds
        }

    # -- health ---------------------------------------------------------------------------

    def check_usable(self) -> None:
        if self.unusable is not None:
            raise StoreCorrupt("memory:", self.unusable)

    # -- test helpers ---------------------------------------------------------------------

    def corrupt(self, kind: str, key: str) -> None:
        """Make the document unreadable, as a truncated file would be (tests)."""
        with self._guard:
            if key in self._docs[kind]:
                self._remove(kind, key)
            self._corrupt.add((kind, key))

    def repair(self, kind: str, key: str) -> None:
        """Forget an injected corruption (the document is then missing)."""
        with self._guard:
            self._corrupt.discard((kind, key))

    def resync(self) -> None:
        """Make every running ``sync`` iterator read everything again and report the
        differences, as etcd's store does when its history was compacted (tests)."""
        with self._guard:
            for sub in self._subs:
                sub.resync = True
            self._cond.notify_all()


def _doc(entry: _Entry) -> Doc:
    """A fresh copy (the value was encoded by this store: no need to check it)."""
    return Doc(json.loads(entry.value), entry.revision)


def _revision(entry: _Entry | None) -> int | None:
    return None if entry is None else entry.revision
