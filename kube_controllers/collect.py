"""The Kubernetes datastore's ``node`` controller: nothing mirrored, a deleted node's tabby Node
collected.

On the Kubernetes datastore what Kubernetes owns is read where it lives (``stores.kube``):
Namespaces, Pods, NetworkPolicies and a Node's labels are never copied, and a node's liveness
is its Kubernetes Node's Ready condition (the kubelet's). What tabby keeps of a node of its
own is its tabby Node (``nodes.tabby.io``: addresses, tunnels, backend), which nothing
removes when Kubernetes deletes the node: :class:`NodeCollector` does, at once, as the mirror
does in etcd mode (its routes are withdrawn everywhere when it goes). Its blocks and
allocations wait for ``--node-grace`` (``ipamgc``, the same code in both modes).

It is the worker's writer (``mirror.Writer``) in that mode: ``sync("node", name, None)``
after the node's reflector lost the Kubernetes Node, which is read once more from the API
server before anything is deleted (a node deleted and registered again by its kubelet keeps
its tabby Node).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from datastore.cas import DELETE, Delete, update
from datastore.errors import StoreUnavailable
from stores.kube.client import ApiError, NotFound

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import Doc, Store
    from stores.kube.client import KubeClient

log = logging.getLogger("tabby.controllers")


class NodeCollector:
    """Deletes the tabby Node of a Kubernetes Node that is gone (``writes``: what it did)."""

    kinds: tuple[str, ...] = ("node",)

    def __init__(self, store: Store, api: KubeClient) -> None:
        self.store = store
        self.api = api
        self.writes: dict[tuple[str, str], int] = {}

    def mirrored_keys(self, kind: str) -> list[str]:
        """Every tabby Node: on taking over, each is compared with the Kubernetes Nodes."""
        return self.store.list_keys("node") if kind == "node" else []

    def sync(self, kind: str, key: str, desired: JSON | None) -> None:
        """The tabby Node ``key`` deleted when its Kubernetes Node is gone (``desired`` None,
        and the API server confirms). Raises DatastoreError (the caller retries later)."""
        if kind != "node" or desired is not None:
            return
        try:
            self.api.get(f"/api/v1/nodes/{key}")
            return  # back already (the reflector will say so)
        except NotFound:
            pass
        except ApiError as e:
            raise StoreUnavailable(f"Kubernetes Node {key}", str(e)) from None
        deleted: list[bool] = []

        def change(doc: Doc | None) -> Delete | None:
            deleted[:] = [doc is not None]
            return None if doc is None else DELETE

        update(self.store, "node", key, change)
        if deleted and deleted[0]:
            self.writes[("node", "deleted")] = self.writes.get(("node", "deleted"), 0) + 1
            log.warning("node %s: its Kubernetes Node is gone: its tabby Node deleted", key)
