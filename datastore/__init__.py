"""Stores: the contract (``base``), ``memory`` for tests, ``file`` (the default), ``etcd``,
and ``engine``, what the three share.

``open_store(settings)`` is the one place a store is built. This package re-exports only the
contract and imports the implementation the settings name when it is called, so importing
it stays cheap (the CNI binaries import it on every call).

``attempt(settings, fn)`` is how a CNI call's datastore work runs: on a store of its own,
opened and closed around it (the binaries); or, in a process that ``serve``s those settings
(tabby-node), on that process's long-lived store, and when it also knows the documents
(its watch), as one optimistic commit (``datastore.optimistic``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar

from datastore.base import KINDS, Doc, Op, Store, StoreSettings, SyncEvent

if TYPE_CHECKING:
    from datastore.optimistic import Counts, Known

__all__ = [
    "KINDS",
    "Doc",
    "Op",
    "Served",
    "Store",
    "StoreSettings",
    "SyncEvent",
    "attempt",
    "attempt_landed",
    "open_store",
    "opened",
    "serve",
]

T = TypeVar("T")

DATASTORE_TYPES = ("file", "etcdv3")


def open_store(settings: StoreSettings) -> Store:
    """Build the store ``settings.datastore_type`` names (``InvalidConfig`` otherwise).

    An etcd store connects lazily: building it does no I/O. Its node-local lock files live
    under ``settings.run_dir`` when the object has that attribute, else ``/run/tabby``.
    """
    kind = settings.datastore_type
    if kind == "file":
        from datastore.file import FileStore

        return FileStore(settings.data_dir, lock_timeout=settings.lock_timeout_seconds)
    if kind == "etcdv3":
        from datastore.etcd import EtcdStore

        return EtcdStore.from_settings(settings)
    from datastore.errors import InvalidConfig

    raise InvalidConfig(
        "unknown datastore_type", f"{kind!r} (expected one of {', '.join(DATASTORE_TYPES)})"
    )


class opened:
    """``open_store(settings)`` for one use, closed afterwards (a call served by tabby-node
    must not leave an etcd store's connections behind)."""

    def __init__(self, settings: StoreSettings) -> None:
        self.store = open_store(settings)

    def __enter__(self) -> Store:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


# -- served stores (tabby-node) ----------------------------------------------------------------


def identity(settings: StoreSettings) -> tuple[object, ...]:
    """What makes two settings name the same store (the lock timeout does not)."""
    kind = settings.datastore_type
    if kind == "file":
        return (kind, settings.data_dir)
    return (
        kind,
        tuple(settings.etcd_endpoints),
        settings.etcd_prefix,
        settings.etcd_ca_cert_file,
        settings.etcd_cert_file,
        settings.etcd_key_file,
    )


class Served:
    """A long-lived store a process offers the calls it serves, and what it knows."""

    def __init__(self, store: Store, known: Known | None) -> None:
        from datastore.optimistic import Counts

        self.store = store
        self.known = known
        self.counts: Counts = Counts()


#: settings identity -> what is served (read and written whole under the GIL: no lock, so
#: that importing this package stays cheap for the CNI binaries)
_served: dict[tuple[object, ...], Served] = {}


def serve(settings: StoreSettings, store: Store, known: Known | None = None) -> Served:
    """Offer ``store`` (and ``known``) to every ``attempt`` on the same settings in this
    process, until ``unserve``. The caller keeps owning the store (and closes it)."""
    served = Served(store, known)
    _served[identity(settings)] = served
    return served


def unserve(settings: StoreSettings) -> None:
    _served.pop(identity(settings), None)


def attempt(
    settings: StoreSettings,
    fn: Callable[[Store], T],
    *,
    optimistic: bool = True,
    absent: Iterable[str] = (),
    creatable: Iterable[str] = (),
) -> T:
    """``fn(store)`` on the store ``settings`` name: the served one if this process serves
    it (optimistically when it knows the documents and ``optimistic``; ``absent`` and
    ``creatable`` as ``optimistic.Optimistic`` takes them), else one opened for this call
    and closed after it."""
    return attempt_landed(settings, fn, optimistic=optimistic, absent=absent, creatable=creatable)[
        0
    ]


def attempt_landed(
    settings: StoreSettings,
    fn: Callable[[Store], T],
    *,
    optimistic: bool = True,
    absent: Iterable[str] = (),
    creatable: Iterable[str] = (),
) -> tuple[T, bool]:
    """``attempt``, and whether it landed as one optimistic commit (then what it wrote is
    what the serving process knows now, with the store's revisions)."""
    served = _served.get(identity(settings)) if _served else None
    if served is None:
        with opened(settings) as store:
            return fn(store), False
    if served.known is None or not optimistic:
        return fn(served.store), False
    from datastore.optimistic import attempt as optimistic_attempt

    return optimistic_attempt(
        served.store,
        served.known,
        fn,
        absent=absent,
        creatable=creatable,
        counts=served.counts,
    )
