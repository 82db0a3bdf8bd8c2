"""The store contract: generic JSON documents by kind and key, every write compare-and-swap.

The core talks only to this protocol, so a store over etcd (put = txn comparing the key's
mod_revision, lock = lease) can be added without touching the allocator.

Rules every implementation keeps (checked by ``tests/unit/ipam/test_ipam_store_contract.py``):

- ``get`` returns a fresh copy of the data (the caller may mutate it) and its revision, or
  ``None`` when the document does not exist. An unreadable, truncated or malformed document
  raises ``StoreCorrupt`` naming its location; other documents stay usable.
- ``put(kind, key, data, None)`` creates and fails with ``RevisionConflict`` if the document
  exists; ``put(..., rev)`` replaces only if the current revision is ``rev``. It returns the
  new revision. Revisions are positive ints, never reused for one key (not even after a delete
  and re-create), so a stale revision can never match again.
- ``delete(kind, key, rev)`` removes only if the current revision is ``rev``; a missing
  document is a ``RevisionConflict`` too.
- ``lock()`` is exclusive across every process sharing the store and not re-entrant; it raises
  ``LockTimeout`` when not had in time. The core holds it around every read-modify-write
  sequence, and enforces CAS anyway.
- ``check_usable()`` is read-only and cheap (for STATUS); it raises a ``StoreError`` subclass.
- Data must be JSON-serialisable (``str`` keys; no NaN); anything else is a programming error
  (``TypeError``/``ValueError``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

KINDS = ("pool", "block", "handle", "affinity")


class Doc(NamedTuple):
    """One document as read: its data and the revision to pass back to ``put``/``delete``."""

    data: dict[str, Any]
    revision: int


class Store(Protocol):
    def lock(self) -> AbstractContextManager[None]: ...

    def get(self, kind: str, key: str) -> Doc | None: ...

    def list_keys(self, kind: str) -> list[str]: ...

    def put(
        self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None
    ) -> int: ...

    def delete(self, kind: str, key: str, expected_revision: int) -> None: ...

    def check_usable(self) -> None: ...

    def location(self, kind: str, key: str) -> str:
        """Where the document lives (a path for the file store), for error messages."""
        ...


def check_kind(kind: str) -> None:
    if kind not in KINDS:
        raise ValueError(f"unknown document kind {kind!r}")


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid document key {key!r}")
