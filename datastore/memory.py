"""In-memory Store with the same semantics as the file and etcd stores (tests, dry runs).

Documents are kept JSON-encoded, so every ``get`` returns a fresh copy and a non-JSON value
fails at ``put`` exactly as it would on disk. Revisions come from one counter for the whole
store (as etcd's revision does: every op of one ``commit`` gets the same one), so they are
never reused for a key. A document written with a ttl expires on the store's clock
(``time.monotonic`` unless given); expired documents are dropped, and their deletion
published to ``sync`` iterators, by the next operation that looks (or by the iterators
themselves, which wake at least every 0.2 s).
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from datastore.base import (
    KINDS,
    Doc,
    Op,
    SyncEvent,
    check_key,
    check_kind,
    check_ops,
    check_ttl,
    sync_kinds,
)
from datastore.errors import LockTimeout, RevisionConflict, StoreCorrupt

if TYPE_CHECKING:
    from datastore.base import Store

POLL = 0.2  # longest sleep of a sync iterator between looks at ``stop`` and expiries


class _Entry:
    __slots__ = ("expires", "revision", "text")

    def __init__(self, text: str, revision: int, expires: float | None) -> None:
        self.text = text
        self.revision = revision
        self.expires = expires


class _Sub:
    """One ``sync`` iterator: the kinds it watches and the events not yet taken."""

    __slots__ = ("events", "kinds", "resync")

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = frozenset(kinds)
        self.events: deque[tuple[str, str, _Entry | None]] = deque()
        self.resync = False


class _MemoryLock:
    def __init__(self, store: MemoryStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        if not self._store._mutex.acquire(timeout=self._store.lock_timeout):
            raise LockTimeout("memory:lock", f"not acquired within {self._store.lock_timeout} s")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._store._mutex.release()


class MemoryStore:
    """Dict-backed store; thread-safe; its lock is a ``threading.Lock`` with a timeout."""

    def __init__(
        self, *, lock_timeout: float = 30.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.lock_timeout = lock_timeout
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

    def lock(self) -> _MemoryLock:
        return _MemoryLock(self)

    def location(self, kind: str, key: str) -> str:
        return f"memory:{kind}/{key}"

    # -- reads ----------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Doc | None:
        check_kind(kind)
        check_key(key)
        with self._guard:
            self._purge()
            self._check_corrupt(kind, key)
            entry = self._docs[kind].get(key)
        return None if entry is None else _doc(entry)

    def list_keys(self, kind: str) -> list[str]:
        check_kind(kind)
        with self._guard:
            self._purge()
            keys = set(self._docs[kind])
            keys.update(k for (c, k) in self._corrupt if c == kind)
        return sorted(keys)

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]:
        check_kind(kind)
        with self._guard:
            self._purge()
            bad = sorted(k for (c, k) in self._corrupt if c == kind and k.startswith(prefix))
            if bad:
                raise StoreCorrupt(self.location(kind, bad[0]), "corrupt (injected)")
            items = [(k, e) for k, e in self._docs[kind].items() if k.startswith(prefix)]
        items.sort(key=lambda item: item[0])
        return [(k, _doc(e)) for k, e in items]

    # -- writes ---------------------------------------------------------------------------

    def put(
        self,
        kind: str,
        key: str,
        data: dict[str, Any],
        expected_revision: int | None,
        *,
        ttl: float | None = None,
    ) -> int:
        check_kind(kind)
        check_key(key)
        check_ttl(ttl)
        text = _encode(data)
        with self._guard:
            self._purge()
            self._check_corrupt(kind, key)
            current = self._docs[kind].get(key)
            _check_revision(self.location(kind, key), current, expected_revision)
            self._rev += 1
            self._set(kind, key, text, ttl)
            return self._rev

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        check_kind(kind)
        check_key(key)
        with self._guard:
            self._purge()
            self._check_corrupt(kind, key)
            current = self._docs[kind].get(key)
            if current is None:
                raise RevisionConflict("document vanished", self.location(kind, key))
            _check_revision(self.location(kind, key), current, expected_revision)
            self._remove(kind, key)

    def commit(self, ops: Sequence[Op]) -> builtins.list[int]:
        check_ops(ops)
        texts = [None if op.data is None else _encode(op.data) for op in ops]
        with self._guard:
            self._purge()
            for op in ops:
                self._check_corrupt(op.kind, op.key)
            for op in ops:
                current = self._docs[op.kind].get(op.key)
                _check_revision(self.location(op.kind, op.key), current, op.expected_revision)
            if not any(op.data is not None or op.expected_revision is not None for op in ops):
                return [0] * len(ops)
            self._rev += 1
            out = []
            for op, text in zip(ops, texts, strict=True):
                if text is not None:
                    self._set(op.kind, op.key, text, None)
                    out.append(self._rev)
                else:
                    if op.expected_revision is not None:
                        self._remove(op.kind, op.key)
                    out.append(0)
            return out

    def _set(self, kind: str, key: str, text: str, ttl: float | None) -> None:
        expires = None if ttl is None else self.clock() + ttl
        entry = _Entry(text, self._rev, expires)
        self._docs[kind][key] = entry
        if expires is None:
            self._expiring.pop((kind, key), None)
        else:
            self._expiring[(kind, key)] = expires
        self._publish(kind, key, entry)

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

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        wanted = sync_kinds(kinds)
        return self._sync(wanted, stop)

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        sub = _Sub(kinds)
        with self._guard:
            self._purge()
            snap = self._snapshot(kinds)
            self._subs.append(sub)
        try:
            yield snap
            while not stop.is_set():
                with self._guard:
                    self._purge()
                    if not sub.events and not sub.resync:
                        self._cond.wait(self._wait_time())
                        self._purge()
                    if sub.resync:
                        sub.resync = False
                        sub.events.clear()
                        pending: list[SyncEvent] = [self._snapshot(kinds)]
                    else:
                        pending = [_event(k, key, e) for k, key, e in sub.events]
                        sub.events.clear()
                yield from pending
        finally:
            with self._guard:
                self._subs.remove(sub)

    def _wait_time(self) -> float:
        if not self._expiring:
            return POLL
        return max(0.0, min(POLL, min(self._expiring.values()) - self.clock()))

    def _snapshot(self, kinds: tuple[str, ...]) -> SyncEvent:
        snap = {
            kind: {key: _doc(e) for key, e in sorted(self._docs[kind].items())} for kind in kinds
        }
        return SyncEvent("snapshot", "", "", None, snap)

    # -- health, life cycle ---------------------------------------------------------------

    def check_usable(self) -> None:
        if self.unusable is not None:
            raise StoreCorrupt("memory:", self.unusable)

    def close(self) -> None:
        """Nothing to release (iterators end on their ``stop``)."""

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
        """Make every running ``sync`` iterator start over with a snapshot, as a broken watch
        does (tests of consumers)."""
        with self._guard:
            for sub in self._subs:
                sub.resync = True
            self._cond.notify_all()


def _encode(data: dict[str, Any]) -> str:
    if not isinstance(data, dict):
        raise TypeError(f"document data must be a dict, not {type(data).__name__}")
    return json.dumps(data, separators=(",", ":"), allow_nan=False)


def _doc(entry: _Entry) -> Doc:
    data: dict[str, Any] = json.loads(entry.text)
    return Doc(data, entry.revision)


def _event(kind: str, key: str, entry: _Entry | None) -> SyncEvent:
    if entry is None:
        return SyncEvent("delete", kind, key, None, None)
    return SyncEvent("put", kind, key, _doc(entry), None)


def _check_revision(where: str, current: _Entry | None, expected: int | None) -> None:
    if expected is None:
        if current is not None:
            raise RevisionConflict("document already exists", where)
    elif current is None:
        raise RevisionConflict("document vanished", where)
    elif current.revision != expected:
        raise RevisionConflict(
            "document changed", f"{where}: revision {current.revision}, expected {expected}"
        )


if TYPE_CHECKING:  # mypy checks that this store keeps the protocol (file and etcd: open_store)

    def _conforms(store: MemoryStore) -> Store:
        return store
