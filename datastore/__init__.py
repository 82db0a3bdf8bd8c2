"""Stores: the contract (``base``), ``memory`` for tests, ``file`` (the default), ``etcd``,
and ``engine``, what the three share.

``open_store(settings)`` is the one place a store is built. This package re-exports only the
contract and imports the implementation the settings name when it is called, so importing
it stays cheap (the CNI binaries import it on every call).
"""

from __future__ import annotations

from datastore.base import KINDS, Doc, Op, Store, StoreSettings, SyncEvent

__all__ = ["KINDS", "Doc", "Op", "Store", "StoreSettings", "SyncEvent", "open_store", "opened"]

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
