"""Stores of JSON documents by kind and key: the contract (``base``), ``memory`` for tests,
``file`` (one node), ``etcd/`` (a cluster), ``engine`` (what they share), ``cas`` (the one
compare-and-swap loop every caller uses) and ``cached`` (a store read through what a
long-lived process knows). Standard library only.

``open_generic(settings)`` builds the file or etcd store the settings name. Which store a
configuration names, the Kubernetes one included, and how a CNI call's datastore work runs,
is ``stores`` (a layer up: the Kubernetes store maps tabby's documents onto Kubernetes
objects, which takes knowing them). This package re-exports only the contract, so importing
it stays cheap (the CNI binaries import it on every call).
"""

from __future__ import annotations

from datastore.base import KINDS, Doc, Leases, Store, StoreSettings, SyncEvent

__all__ = [
    "GENERIC_TYPES",
    "KINDS",
    "Doc",
    "Leases",
    "Store",
    "StoreSettings",
    "SyncEvent",
    "open_generic",
]

GENERIC_TYPES = ("file", "etcdv3")


def open_generic(settings: StoreSettings) -> Store:
    """Build the file or etcd store ``settings.datastore_type`` names (``InvalidConfig``
    otherwise).

    An etcd store connects lazily: building it does no I/O. Its node-local lock files live
    under ``settings.run_dir`` when the object has that attribute, else ``/run/tabby``.
    """
    kind = settings.datastore_type
    if kind == "file":
        from datastore.file import FileStore

        return FileStore(settings.data_dir, lock_timeout=settings.lock_timeout_seconds)
    if kind == "etcdv3":
        from datastore.etcd.store import EtcdStore

        return EtcdStore.from_settings(settings)
    from datastore.errors import InvalidConfig

    raise InvalidConfig(
        "unknown datastore_type", f"{kind!r} (expected one of {', '.join(GENERIC_TYPES)})"
    )
