"""One operation's reads and writes as one commit: tabby-node's fast path to the datastore.

An operation (an IPAM assign or release, an endpoint's record) runs unchanged against an
``Optimistic`` view of a store. Its reads come from what the caller already knows -- a
``Known``: tabby-node's watch of the datastore, and the documents it wrote itself -- and
only when that knows nothing, from the store. Its writes are held back. When the operation
returns, ONE ``commit`` carries every write and, for every document read and not written,
an ``Op.unchanged`` at the revision read. So the commit lands only if everything the
operation based its decisions on is still what it read: the outcome is exactly the one the
operation would have had, run alone against the store at the instant of the commit
(optimistic concurrency with read-set validation). On etcd that is one round trip where
the operation itself makes six to ten.

When the commit does not land (something changed since it was known), or the operation
asks for something one commit cannot express (see ``Speculation``), or it fails in any way
(a refusal decided on stale knowledge must not reach the caller), the operation runs again
against the store itself: nothing of the first attempt was written, so that is a clean
retry, and the store's own compare-and-swap rules hold as they always did. That run tells
``known`` what it reads and writes (``Learning``), so the next operation's view is right.
Each attempt's outcome is counted (``Counts``).

What a view refuses (``Speculation``): listing (``list``, ``list_keys``: a commit cannot prove
that no document appeared), a ttl, writing one document twice, and creating a document of a
kind the caller did not declare creatable (a new block's first sequence number comes from
the revision of its creation, which only the store itself can give).
"""

from __future__ import annotations

import builtins
import copy
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from datastore.base import Doc, Op
from datastore.errors import RevisionConflict

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from datastore.base import Store, SyncEvent

T = TypeVar("T")


class Unknown:
    """``Known.lookup``'s answer "I do not know this document"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = Unknown()
#: Provisional revision of a document written in a view (one write per document).
PROVISIONAL = -1


class Speculation(Exception):
    """The view cannot serve this operation as one commit; run it on the store."""


class Known(Protocol):
    """What a caller believes the store holds."""

    def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
        """The document as last known (None: known not to exist), or ``UNKNOWN``."""

    def learn(self, kind: str, key: str, doc: Doc | None) -> None:
        """The document as the store holds it now (after a read or a landed commit)."""

    def forget(self, kind: str, key: str) -> None:
        """What was known of the document proved stale."""


class Counts:
    """How the attempts went: ``committed`` (one commit), ``retried`` (run again on the
    store after a commit that did not land), ``declined`` (the view could not serve the
    operation), ``failed`` (the operation failed on the view and was run on the store)."""

    __slots__ = ("committed", "declined", "failed", "lock", "retried")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.committed = 0
        self.retried = 0
        self.declined = 0
        self.failed = 0

    def add(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {n: getattr(self, n) for n in ("committed", "retried", "declined", "failed")}


class _Write:
    __slots__ = ("data", "expected")

    def __init__(self, data: dict[str, Any] | None, expected: int | None) -> None:
        self.data = data
        self.expected = expected


class Optimistic:
    """A ``Store`` for one operation (see the module docstring). ``absent``: kinds whose
    documents, when unknown, are assumed not to exist instead of read (the commit then
    proves it); ``creatable``: kinds the operation may create."""

    def __init__(
        self,
        store: Store,
        known: Known,
        *,
        absent: Iterable[str] = (),
        creatable: Iterable[str] = (),
    ) -> None:
        self.store = store
        self.known = known
        self.absent = frozenset(absent)
        self.creatable = frozenset(creatable)
        self.reads: dict[tuple[str, str], Doc | None] = {}
        self.writes: dict[tuple[str, str], _Write] = {}

    # -- reads ----------------------------------------------------------------------------

    def _current(self, kind: str, key: str) -> Doc | None:
        """The document as this operation sees it (its own write, else as first read)."""
        w = self.writes.get((kind, key))
        if w is not None:
            return None if w.data is None else Doc(w.data, PROVISIONAL)
        if (kind, key) in self.reads:
            return self.reads[(kind, key)]
        doc = self.known.lookup(kind, key)
        if isinstance(doc, Unknown):
            if kind in self.absent:
                doc = None
            else:
                doc = self.store.get(kind, key)
                self.known.learn(kind, key, doc)
        self.reads[(kind, key)] = doc
        return doc

    def get(self, kind: str, key: str) -> Doc | None:
        doc = self._current(kind, key)
        return None if doc is None else Doc(copy.deepcopy(doc.data), doc.revision)

    def list_keys(self, kind: str) -> builtins.list[str]:
        raise Speculation(f"lists {kind}")

    def list(self, kind: str, prefix: str = "") -> builtins.list[tuple[str, Doc]]:
        raise Speculation(f"lists {kind}")

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
        if ttl is not None:
            raise Speculation(f"writes {kind} {key} with a ttl")
        self._hold(kind, key, copy.deepcopy(data), expected_revision)
        return PROVISIONAL

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        self._hold(kind, key, None, expected_revision)

    def commit(self, ops: Sequence[Op]) -> builtins.list[int]:
        raise Speculation("commits on its own")

    def _hold(self, kind: str, key: str, data: dict[str, Any] | None, expected: int | None) -> None:
        if (kind, key) in self.writes:
            raise Speculation(f"writes {kind} {key} twice")
        current = self._current(kind, key)
        revision = None if current is None else current.revision
        if revision != expected:
            # Not a RevisionConflict: the core would read again, from this same view.
            raise Speculation(f"{kind} {key} is not at the revision the write expects")
        if current is None and kind not in self.creatable:
            raise Speculation(f"creates {kind} {key}")
        self.writes[(kind, key)] = _Write(data, expected)

    # -- the rest of the Store protocol ---------------------------------------------------

    def lock(self) -> AbstractContextManager[None]:
        return self.store.lock()

    def keepalive(self, kind: str, key: str) -> bool:
        raise Speculation("keeps a document alive")

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        raise Speculation("watches")

    @property
    def sync_stats(self) -> Mapping[str, int]:
        return self.store.sync_stats  # a view has no sync of its own

    def check_usable(self) -> None:
        self.store.check_usable()

    def location(self, kind: str, key: str) -> str:
        return self.store.location(kind, key)

    def close(self) -> None:
        pass

    # -- the one commit -------------------------------------------------------------------

    def finish(self) -> None:
        """Commit every write, and every document read and not written as unchanged; then
        tell ``known`` what the store holds. ``RevisionConflict`` when it did not land."""
        ops = [Op(kind, key, w.data, w.expected) for (kind, key), w in self.writes.items()]
        ops += [
            Op.unchanged(kind, key, None if doc is None else doc.revision)
            for (kind, key), doc in self.reads.items()
            if (kind, key) not in self.writes
        ]
        if not ops:
            return
        revisions = self.store.commit(ops)
        for ((kind, key), w), rev in zip(self.writes.items(), revisions, strict=False):
            self.known.learn(kind, key, None if w.data is None else Doc(w.data, rev))

    def stale(self) -> None:
        """The commit did not land: forget what this operation relied on."""
        for kind, key in (*self.reads, *self.writes):
            self.known.forget(kind, key)


class Learning:
    """The store itself, telling ``known`` every document it reads or writes (the run on
    the store after a view that did not land: what it learns makes the next view right)."""

    def __init__(self, store: Store, known: Known) -> None:
        self.store = store
        self.known = known

    def get(self, kind: str, key: str) -> Doc | None:
        doc = self.store.get(kind, key)
        self.known.learn(
            kind, key, None if doc is None else Doc(copy.deepcopy(doc.data), doc.revision)
        )
        return doc

    def list_keys(self, kind: str) -> builtins.list[str]:
        return self.store.list_keys(kind)

    def list(self, kind: str, prefix: str = "") -> builtins.list[tuple[str, Doc]]:
        return self.store.list(kind, prefix)

    def put(
        self,
        kind: str,
        key: str,
        data: dict[str, Any],
        expected_revision: int | None,
        *,
        ttl: float | None = None,
    ) -> int:
        rev = self.store.put(kind, key, data, expected_revision, ttl=ttl)
        self.known.learn(kind, key, Doc(copy.deepcopy(data), rev))
        return rev

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        self.store.delete(kind, key, expected_revision)
        self.known.learn(kind, key, None)

    def commit(self, ops: Sequence[Op]) -> builtins.list[int]:
        from datastore.base import UNCHANGED

        revisions = self.store.commit(ops)
        for op, rev in zip(ops, revisions, strict=True):
            if op.data is UNCHANGED or (op.data is None and op.expected_revision is None):
                continue
            doc = None if op.data is None else Doc(copy.deepcopy(op.data), rev)
            self.known.learn(op.kind, op.key, doc)
        return revisions

    def lock(self) -> AbstractContextManager[None]:
        return self.store.lock()

    def keepalive(self, kind: str, key: str) -> bool:
        return self.store.keepalive(kind, key)

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        return self.store.sync(kinds, stop)

    @property
    def sync_stats(self) -> Mapping[str, int]:
        return self.store.sync_stats

    def check_usable(self) -> None:
        self.store.check_usable()

    def location(self, kind: str, key: str) -> str:
        return self.store.location(kind, key)

    def close(self) -> None:
        pass


def attempt(
    store: Store,
    known: Known,
    fn: Callable[[Store], T],
    *,
    absent: Iterable[str] = (),
    creatable: Iterable[str] = (),
    counts: Counts | None = None,
) -> tuple[T, bool]:
    """``fn`` on an ``Optimistic`` view of ``store`` and one commit, else ``fn(store)``;
    and whether it was the commit (then ``known`` holds what it wrote, as stored)."""
    view = Optimistic(store, known, absent=absent, creatable=creatable)
    outcome = "committed"
    try:
        result = fn(view)
        view.finish()
    except Speculation:
        outcome = "declined"
    except RevisionConflict:
        outcome = "retried"
        view.stale()
    except Exception:  # decided on stale knowledge, perhaps: the store decides
        outcome = "failed"
        view.stale()
    else:
        if counts is not None:
            counts.add(outcome)
        return result, True
    if counts is not None:
        counts.add(outcome)
    return fn(Learning(store, known)), False
