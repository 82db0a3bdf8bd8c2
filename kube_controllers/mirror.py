"""What of a Kubernetes object the datastore holds, and the writer that keeps it so.

Projections (``project_*``): a Kubernetes object -> the tabby resource document mirroring it
(``resources``' models; PRODUCT "What is mirrored"), marked ``tabby.io/source: kubernetes``;
the first three are the Kubernetes datastore's own (``stores.kube.kinds``: what tabby reads
there is what the controllers mirror into etcd):

    v1 Namespace                 v1 Namespace: name, uid, labels
    v1 Pod (not hostNetwork)     v1 Pod: name, namespace, uid, labels, named container ports,
                                 spec.nodeName, status.podIPs
    networking.k8s.io/v1         the same, as the API server stores it (its defaults applied)
      NetworkPolicy
    v1 Node                      the tabby Node's metadata.labels (tabby-node owns the rest)

:class:`Mirror` writes the difference between the reflectors' objects and the datastore, one
key at a time (``sync(kind, key)``), through ``resources.client.ResourceClient`` as the owner
``kubernetes``: a Pod's WorkloadEndpoints take its labels in the same commit, and what an
operator made with tabbyctl is never touched (``resources.mirror``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

from datastore.base import Doc
from datastore.cas import update
from datastore.errors import DatastoreError, RevisionConflict
from resources import mirror
from resources.errors import NotFound, NotOwned, ResourceError
from resources.storage import BY_KIND, to_resource
from stores.kube.kinds import (
    project_namespace,
    project_pod,
    project_policy,
    project_service_account,
)

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import Store
    from resources.client import ResourceClient

log = logging.getLogger("tabby.controllers")

MARK = {mirror.SOURCE_ANNOTATION: mirror.KUBERNETES}
#: The mirrored kinds: (controller name, Kubernetes collection, tabby kind, store kind).
KINDS = {
    "namespace": ("/api/v1/namespaces", "Namespace", "namespace"),
    "serviceaccount": ("/api/v1/serviceaccounts", "ServiceAccount", "serviceaccount"),
    "pod": ("/api/v1/pods", "Pod", "pod"),
    "policy": ("/apis/networking.k8s.io/v1/networkpolicies", "NetworkPolicy", "networkpolicy"),
    "node": ("/api/v1/nodes", "Node", "node"),
}


def project_node(obj: JSON) -> JSON | None:
    meta = obj.get("metadata")
    labels = meta.get("labels") if isinstance(meta, Mapping) else None
    return {"labels": dict(labels) if isinstance(labels, Mapping) else {}}


PROJECTIONS: dict[str, Callable[[JSON], JSON | None]] = {
    "namespace": project_namespace,
    "serviceaccount": project_service_account,
    "pod": project_pod,
    "policy": project_policy,
    "node": project_node,
}


class Writer(Protocol):
    """What the controllers' worker drives, one key at a time: the etcd mode's ``Mirror``,
    or the Kubernetes datastore's ``collect.NodeCollector`` (nothing mirrored there)."""

    #: the controller kinds it handles (of ``KINDS``)
    kinds: tuple[str, ...]
    #: (kind, action) -> writes made
    writes: dict[tuple[str, str], int]

    def mirrored_keys(self, kind: str) -> list[str]: ...

    def sync(self, kind: str, key: str, desired: JSON | None) -> None: ...


class Mirror:
    """Writes one key's difference at a time; counts what it did (``writes``)."""

    kinds: tuple[str, ...] = tuple(KINDS)

    def __init__(self, store: Store, client: ResourceClient) -> None:
        self.store = store
        self.client = client
        self.writes: dict[tuple[str, str], int] = {}  # (kind, action) -> count
        self._refused: set[tuple[str, str]] = set()

    def _count(self, kind: str, action: str) -> None:
        self.writes[(kind, action)] = self.writes.get((kind, action), 0) + 1

    def mirrored_keys(self, kind: str) -> list[str]:
        """Keys of the datastore documents of ``kind`` that the controllers own."""
        store_kind = KINDS[kind][2]
        return [key for key, doc in self.store.list(store_kind) if mirror.is_mirrored(doc.data)]

    def sync(self, kind: str, key: str, desired: JSON | None) -> None:
        """Make the datastore hold ``desired`` for ``key`` (None: the object is gone).
        Raises DatastoreError (the caller retries later)."""
        if kind == "node":
            self._sync_node(key, desired)
            return
        tabby_kind = KINDS[kind][1]
        namespace, _, name = key.rpartition("/")
        try:
            if desired is None:
                stored = self.store.get(KINDS[kind][2], key)
                if stored is None or not mirror.is_mirrored(stored.data):
                    return
                self.client.delete(tabby_kind, name, namespace or None)
                self._count(kind, "deleted")
                return
            (done,) = self.client.apply([desired], replace=True)
            if done.action != "unchanged":
                self._count(kind, done.action)
            self._refused.discard((kind, key))
        except NotOwned as e:
            if (kind, key) not in self._refused:
                log.warning("%s", e)
                self._refused.add((kind, key))
        except NotFound:
            pass  # deleted meanwhile
        except ResourceError as e:
            log.warning("cannot mirror %s %s: %s", tabby_kind, key, e)
            self._count(kind, "invalid")

    def _sync_node(self, name: str, desired: JSON | None) -> None:
        """A Kubernetes Node's labels onto the tabby Node tabby-node registered (nothing
        until it has); a deleted Kubernetes Node's tabby Node deleted, if the controllers
        marked it (its routes are withdrawn everywhere when it goes)."""
        if desired is None:
            doc = self.store.get("node", name)
            if doc is not None and mirror.is_mirrored(doc.data):
                try:
                    self.client.delete("Node", name)
                    self._count("node", "deleted")
                except NotFound:
                    pass
            return
        labels = desired.get("labels") or {}
        outcome: list[str] = []

        def change(doc: Doc | None) -> dict[str, object] | None:
            outcome.clear()
            if doc is None:
                return None  # its tabby-node has not registered it yet: done when it does
            data = _relabelled(doc, labels)
            if data is None:
                return None
            to_resource(BY_KIND["Node"], name, Doc(data, doc.revision), f"node {name}")
            outcome.append("configured")
            return data

        try:
            update(self.store, "node", name, change)
        except RevisionConflict as e:
            log.warning("cannot mirror the labels of Node %s: %s", name, e)
            return
        except DatastoreError as e:
            log.warning("cannot mirror the labels of Node %s: %s", name, e)
            self._count("node", "invalid")
            return
        if outcome:
            self._count("node", "configured")


def _relabelled(doc: Doc, labels: Mapping[str, str]) -> dict[str, object] | None:
    """The Node document with ``labels`` and the mark, or None when it has them already."""
    data = dict(doc.data)
    meta = dict(data.get("metadata") or {})
    annotations = dict(meta.get("annotations") or {})
    if meta.get("labels", {}) == dict(labels) and annotations.get(mirror.SOURCE_ANNOTATION) == (
        mirror.KUBERNETES
    ):
        return None
    if labels:
        meta["labels"] = dict(labels)
    else:
        meta.pop("labels", None)
    annotations.update(MARK)
    meta["annotations"] = annotations
    data["metadata"] = meta
    return data
