"""In-memory Store with the same semantics as the file store (tests, dry runs).

Documents are kept JSON-encoded, so every ``get`` returns a fresh copy and a non-JSON value
fails at ``put`` exactly as it would on disk. Revisions come from one counter for the whole
store (as etcd's mod_revision does), so they are never reused for a key.
"""

from __future__ import annotations

import json
import threading
from types import TracebackType
from typing import Any

from ipam.core.errors import LockTimeout, RevisionConflict, StoreCorrupt
from ipam.store.base import KINDS, Doc, check_key, check_kind


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

    def __init__(self, *, lock_timeout: float = 30.0) -> None:
        self.lock_timeout = lock_timeout
        self._mutex = threading.Lock()
        self._guard = threading.Lock()  # protects _docs/_rev for callers without lock()
        self._docs: dict[str, dict[str, tuple[str, int]]] = {k: {} for k in KINDS}
        self._rev = 0
        self._corrupt: set[tuple[str, str]] = set()
        self.unusable: str | None = None  # tests: set a reason to make check_usable fail

    def lock(self) -> _MemoryLock:
        return _MemoryLock(self)

    def location(self, kind: str, key: str) -> str:
        return f"memory:{kind}/{key}"

    def get(self, kind: str, key: str) -> Doc | None:
        check_kind(kind)
        check_key(key)
        with self._guard:
            if (kind, key) in self._corrupt:
                raise StoreCorrupt(self.location(kind, key), "corrupt (injected)")
            entry = self._docs[kind].get(key)
        if entry is None:
            return None
        return Doc(json.loads(entry[0]), entry[1])

    def list_keys(self, kind: str) -> list[str]:
        check_kind(kind)
        with self._guard:
            keys = set(self._docs[kind])
            keys.update(k for (c, k) in self._corrupt if c == kind)
        return sorted(keys)

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        check_kind(kind)
        check_key(key)
        text = json.dumps(data, separators=(",", ":"), allow_nan=False)
        with self._guard:
            if (kind, key) in self._corrupt:
                raise StoreCorrupt(self.location(kind, key), "corrupt (injected)")
            current = self._docs[kind].get(key)
            _check_revision(self.location(kind, key), current, expected_revision)
            self._rev += 1
            self._docs[kind][key] = (text, self._rev)
            return self._rev

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        check_kind(kind)
        check_key(key)
        with self._guard:
            if (kind, key) in self._corrupt:
                raise StoreCorrupt(self.location(kind, key), "corrupt (injected)")
            current = self._docs[kind].get(key)
            if current is None:
                raise RevisionConflict("document vanished", self.location(kind, key))
            _check_revision(self.location(kind, key), current, expected_revision)
            del self._docs[kind][key]

    def check_usable(self) -> None:
        if self.unusable is not None:
            raise StoreCorrupt("memory:", self.unusable)

    # -- test helpers ------------------------------------------------------------------

    def corrupt(self, kind: str, key: str) -> None:
        """Make the document unreadable, as a truncated file would be (tests)."""
        with self._guard:
            self._docs[kind].pop(key, None)
            self._corrupt.add((kind, key))

    def repair(self, kind: str, key: str) -> None:
        """Forget an injected corruption (the document is then missing)."""
        with self._guard:
            self._corrupt.discard((kind, key))


def _check_revision(where: str, current: tuple[str, int] | None, expected: int | None) -> None:
    if expected is None:
        if current is not None:
            raise RevisionConflict("document already exists", where)
    elif current is None:
        raise RevisionConflict("document vanished", where)
    elif current[1] != expected:
        raise RevisionConflict(
            "document changed", f"{where}: revision {current[1]}, expected {expected}"
        )
