"""The store a configuration names, and where a CNI call's datastore work runs.

``open_store(settings)`` is the one place a store is built: the file or etcd store
(``datastore``), or the Kubernetes API (``stores.kube``: tabby's documents as Kubernetes
objects: CRDs of group ``tabby.io``, and what Kubernetes owns read where it lives). Importing
this package imports no store; the one the settings name is imported when it is opened.

A CNI call's datastore work runs through the ``Stores`` it is handed: ``STANDALONE`` (the
binaries: a store of the call's own, opened and closed around each operation) or tabby-node's
``Served`` (its long-lived store, read through its watch, for the calls whose configuration
names the same datastore). Nothing is found through globals.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, TypeVar

if TYPE_CHECKING:
    from datastore.base import Store, StoreSettings
    from datastore.cached import Counts, Known

__all__ = ["DATASTORE_TYPES", "STANDALONE", "Served", "Stores", "open_store", "opened"]

T = TypeVar("T")

DATASTORE_TYPES = ("file", "etcdv3", "kubernetes")


def open_store(settings: StoreSettings) -> Store:
    """Build the store ``settings.datastore_type`` names (``InvalidConfig`` otherwise).
    Building one does no I/O (etcd and the Kubernetes API are reached at the first
    operation)."""
    if settings.datastore_type == "kubernetes":
        from stores.kube.store import KubeStore

        return KubeStore.from_settings(settings)
    from datastore import GENERIC_TYPES, open_generic

    if settings.datastore_type in GENERIC_TYPES:
        return open_generic(settings)
    from datastore.errors import InvalidConfig

    raise InvalidConfig(
        "unknown datastore_type",
        f"{settings.datastore_type!r} (expected one of {', '.join(DATASTORE_TYPES)})",
    )


class opened:
    """``open_store(settings)`` for one use, closed afterwards."""

    def __init__(self, settings: StoreSettings) -> None:
        self.store = open_store(settings)

    def __enter__(self) -> Store:
        return self.store

    def __exit__(self, *exc: object) -> None:
        self.store.close()


def identity(settings: StoreSettings) -> tuple[object, ...]:
    """What makes two settings name the same store (the lock timeout does not)."""
    kind = settings.datastore_type
    if kind == "file":
        return (kind, settings.data_dir)
    if kind == "kubernetes":  # one API server, whoever's credentials name it
        return (kind, _api_server(settings.kubeconfig))
    return (
        kind,
        tuple(settings.etcd_endpoints),
        settings.etcd_prefix,
        settings.etcd_ca_cert_file,
        settings.etcd_cert_file,
        settings.etcd_key_file,
    )


#: kubeconfig path -> (its mtime, the API server it names)
_SERVERS: dict[str | None, tuple[int, str]] = {}


def _api_server(kubeconfig: str | None) -> str:
    """The API server a kubeconfig (None: ``$KUBECONFIG`` or the pod's service account)
    names: the plugins' kubeconfig and tabby-node's in-cluster account name the same one,
    and so the same store. Read again when the file changes."""
    import os

    from stores.kube.client import ApiError, KubeConfig

    try:
        mtime = os.stat(kubeconfig).st_mtime_ns if kubeconfig else 0
    except OSError:
        mtime = -1
    known = _SERVERS.get(kubeconfig)
    if known is not None and known[0] == mtime:
        return known[1]
    try:
        server = KubeConfig.load(kubeconfig).server
    except ApiError:
        return f"kubeconfig {kubeconfig}"  # opening it fails with the reason
    _SERVERS[kubeconfig] = (mtime, server)
    return server


class Stores(Protocol):
    """Where a CNI call's datastore work runs."""

    def run(self, settings: StoreSettings, fn: Callable[[Store], T], *, cached: bool = True) -> T:
        """``fn`` on the store ``settings`` name; ``cached``: it may read through what the
        process knows (``datastore.cached``), when it knows anything."""
        ...


class Standalone:
    """A store of the call's own for each operation, closed after it (the binaries)."""

    def run(self, settings: StoreSettings, fn: Callable[[Store], T], *, cached: bool = True) -> T:
        with opened(settings) as store:
            return fn(store)


STANDALONE = Standalone()


class Served:
    """tabby-node's stores for the calls it serves: its own long-lived ``store`` (read
    through ``known``, its watch, when given) for a call whose configuration names the same
    datastore as ``settings``; a store of the call's own otherwise."""

    def __init__(self, settings: StoreSettings, store: Store, known: Known | None = None) -> None:
        from datastore.cached import Counts

        self.identity = identity(settings)
        self.store = store
        self.known = known
        self.counts: Counts = Counts()

    def run(self, settings: StoreSettings, fn: Callable[[Store], T], *, cached: bool = True) -> T:
        if identity(settings) != self.identity:
            return STANDALONE.run(settings, fn)
        if self.known is None or not cached:
            return fn(self.store)
        from datastore.cached import run

        return run(self.store, self.known, fn, self.counts)
