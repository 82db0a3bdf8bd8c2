"""A store read through what a long-lived process already knows: tabby-node's served calls.

tabby-node watches the datastore; the CNI calls it serves read their documents from that
knowledge (a ``Known``: the watch, and what the node itself last read or wrote) instead of
the datastore, and write to the datastore itself. Every write is a compare-and-swap of ONE
document at the revision that was read (the store protocol has nothing else), so a stale
read can never make a wrong write: it costs a ``RevisionConflict``, the stale document is
forgotten, and the operation's own compare-and-swap loop reads it again, from the store
this time (a view reads a document whose write it lost from the store for the rest of the
operation: the watch may not have delivered the change yet, and its stale copy would lose
every retry). An IPAM ADD served this way costs one write and no read (``ipam/DESIGN.md``).

What a stale read can still do is make an operation *refuse* (a pool the watch has not
delivered yet, a block that looked full): so ``run`` runs an operation that fails on the
view once more on ``Cached(store, known, fresh=True)``, which reads everything from the
store (and teaches ``known`` what it read); not when the store itself failed (unreachable,
or the node's lock not had in time: the call's deadline is spent). Decisions that must not
rest on the watch at all (the pool gate, which admits a block only while its pool exists
now) read the store directly: ``Cached.fresh_get``.

Lists, the lock, leases and the watch go to the store unchanged.
"""

from __future__ import annotations

import builtins
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol, TypeVar

from datastore.base import Doc
from datastore.errors import LockTimeout, RevisionConflict, StoreUnavailable

if TYPE_CHECKING:
    from contextlib import AbstractContextManager

    from bundle.types import JSON
    from datastore.base import Store, SyncEvent

T = TypeVar("T")


class Unknown:
    """``Known.lookup``'s answer "I do not know this document"."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "UNKNOWN"


UNKNOWN = Unknown()


def copy_json(data: JSON) -> JSON:
    """A copy of a JSON document (dicts, lists, scalars) that shares nothing mutable with
    ``data``: what the reader of a known document may change without changing what is
    known. A quarter of ``copy.deepcopy``'s time (no memo: a document has no cycles), which
    on a served ADD was most of the IPAM's CPU (every block of the node read is copied)."""
    return {k: _copy(v) if isinstance(v, _CONTAINERS) else v for k, v in data.items()}


def _copy(value: object) -> object:
    if isinstance(value, dict):
        return {k: _copy(v) if isinstance(v, _CONTAINERS) else v for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) if isinstance(v, _CONTAINERS) else v for v in value]
    return value


_CONTAINERS = (dict, list)


class Known(Protocol):
    """What a process believes the store holds."""

    def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
        """The document as last known (None: known not to exist), or ``UNKNOWN``."""

    def learn(self, kind: str, key: str, doc: Doc | None) -> None:
        """The document as the store holds it now (after a read or a write)."""

    def forget(self, kind: str, key: str) -> None:
        """What was known of the document proved stale."""


class Counts:
    """How the served operations went: ``cached`` (done on the view), ``retried`` (a write
    on the view lost its compare-and-swap and the operation read again: the view had been
    stale), ``fresh`` (failed on the view, run again on the store)."""

    __slots__ = ("cached", "fresh", "lock", "retried")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.cached = 0
        self.retried = 0
        self.fresh = 0

    def add(self, name: str) -> None:
        with self.lock:
            setattr(self, name, getattr(self, name) + 1)

    def as_dict(self) -> dict[str, int]:
        with self.lock:
            return {n: getattr(self, n) for n in ("cached", "retried", "fresh")}


class Cached:
    """A ``Store`` whose reads come from ``known`` first (``fresh``: never) and whose writes
    go to ``store`` and are learnt (see the module docstring)."""

    def __init__(self, store: Store, known: Known, *, fresh: bool = False) -> None:
        self.store = store
        self.known = known
        self.fresh = fresh
        self.conflicts = 0  #: writes of this view that lost their compare-and-swap
        #: documents whose write lost here: read from the store from now on (the watch may
        #: not have delivered the change yet, so ``known`` may still hold the stale one)
        self.stale: set[tuple[str, str]] = set()

    # -- reads ----------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Doc | None:
        if not self.fresh and (kind, key) not in self.stale:
            doc = self.known.lookup(kind, key)
            if not isinstance(doc, Unknown):
                return None if doc is None else Doc(copy_json(doc.data), doc.revision)
        return self.fresh_get(kind, key)

    def fresh_get(self, kind: str, key: str) -> Doc | None:
        """The document as the store holds it now (and ``known`` learns it)."""
        doc = self.store.get(kind, key)
        self.known.learn(kind, key, None if doc is None else Doc(copy_json(doc.data), doc.revision))
        return doc

    def list_keys(self, kind: str) -> builtins.list[str]:
        return self.store.list_keys(kind)

    def list(self, kind: str, prefix: str = "") -> builtins.list[tuple[str, Doc]]:
        return self.store.list(kind, prefix)

    # -- writes ---------------------------------------------------------------------------

    def put(self, kind: str, key: str, data: JSON, expected_revision: int | None) -> int:
        try:
            rev = self.store.put(kind, key, data, expected_revision)
        except RevisionConflict:
            self._stale(kind, key)
            raise
        self.known.learn(kind, key, Doc(copy_json(data), rev))
        return rev

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        try:
            self.store.delete(kind, key, expected_revision)
        except RevisionConflict:
            self._stale(kind, key)
            raise
        self.known.learn(kind, key, None)

    def _stale(self, kind: str, key: str) -> None:
        self.conflicts += 1
        self.stale.add((kind, key))
        self.known.forget(kind, key)

    # -- the rest of the protocol ---------------------------------------------------------

    def lock(self) -> AbstractContextManager[None]:
        return self.store.lock()

    def write_batch(self) -> AbstractContextManager[None]:
        from datastore.base import write_batch

        return write_batch(self.store)

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
        """The store is the serving process's: a view closes nothing."""


def run(store: Store, known: Known, fn: Callable[[Store], T], counts: Counts | None = None) -> T:
    """``fn`` on a ``Cached`` view of ``store``; if it fails there, once more on a fresh one
    (its failure may rest on a stale read: a refusal must come from the store itself)."""
    view = Cached(store, known)
    try:
        result = fn(view)
    except (StoreUnavailable, LockTimeout):
        raise  # the store itself failed, or the node's lock: trying again only doubles the wait
    except Exception:  # the store's answer decides: run again on what it holds now
        if counts is not None:
            counts.add("fresh")
        return fn(Cached(store, known, fresh=True))
    if counts is not None:
        counts.add("retried" if view.conflicts else "cached")
    return result
