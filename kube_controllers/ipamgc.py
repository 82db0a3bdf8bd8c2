"""The ``ipam`` controller: addresses and blocks nobody holds any more, released after a grace.

Two kinds of leftovers, each released only after it has stayed a leftover for its whole
grace period (a node or pod that comes back in between resets it):

- a gone node: blocks affine to a node that Kubernetes does not know, that has no tabby Node
  and no live heartbeat (its tabby-node is gone too), for ``--node-grace`` seconds: every
  allocation and block of it is released (``Ipam.release_node``, as ``tabbyctl ipam gc
  --node`` does). On the Kubernetes datastore (``kubernetes_datastore``) a node's liveness
  is its Kubernetes Node alone: there its heartbeat is that Node's readiness, and its tabby
  Node is what ``collect.NodeCollector`` deletes once the Kubernetes Node is gone;
- a leaked attachment: an allocation recorded for a pod (namespace/name) that no pod of
  that namespace and name holds any more (the pod is gone, is another incarnation, or
  reports other addresses), for ``--leak-grace`` seconds. Before it is released the pod is
  read once more from the API server itself, so an address a live pod holds is never
  released: the whole attachment (its handle) goes, and its WorkloadEndpoint with it (on the
  Kubernetes datastore the endpoint is made of the allocations: it goes with them).

The same pass serves both datastores: the pods and Kubernetes Nodes come from the
reflectors either way, the allocations from the store.

VXLAN tunnel addresses and allocations that name no pod are never touched.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from datastore.errors import DatastoreError
from ipam.core import Ipam
from ipam.core.model import split_handle_id
from stores.kube.client import ApiError, NotFound

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import Store
    from kube_controllers.reflector import Reflector
    from stores.kube.client import KubeClient

log = logging.getLogger("tabby.controllers")


@dataclass
class IpamGc:
    store: Store
    api: KubeClient
    nodes: Reflector  # Kubernetes Nodes
    pods: Reflector  # Kubernetes Pods (projected: stores.kube.kinds.project_pod)
    node_grace: float
    leak_grace: float
    clock: Callable[[], float] = time.monotonic
    #: the store is the Kubernetes datastore (liveness is the Kubernetes Node's alone)
    kubernetes_datastore: bool = False
    #: node -> when it was first seen gone; handle -> when first seen leaked
    gone_nodes: dict[str, float] = field(default_factory=dict)
    leaks: dict[str, float] = field(default_factory=dict)
    released: dict[str, int] = field(default_factory=lambda: {"node": 0, "leak": 0})

    def run_once(self) -> None:
        """One pass (the caller holds the leadership and the reflectors have listed)."""
        ipam = Ipam(self.store, "")
        self._gone_nodes(ipam)
        self._leaks(ipam)

    # -- gone nodes -------------------------------------------------------------------------

    def _gone_nodes(self, ipam: Ipam) -> None:
        with_blocks = {b.node for b in ipam.block_usage() if b.node}
        present = self._present_nodes()
        now = self.clock()
        gone = {n for n in with_blocks if n not in present}
        for node in list(self.gone_nodes):
            if node not in gone:
                del self.gone_nodes[node]  # back, or already released
        for node in sorted(gone):
            since = self.gone_nodes.setdefault(node, now)
            if now - since < self.node_grace:
                continue
            report = ipam.release_node(node)
            self.released["node"] += len(report.addresses)
            log.warning(
                "node %s is gone: released %d address(es) of %d handle(s), deleted %d "
                "block(s), %d block(s) left to no node%s",
                node,
                len(report.addresses),
                len(report.released),
                len(report.deleted_blocks),
                len(report.unaffined_blocks),
                f"; errors: {report.errors}" if report.errors else "",
            )
            del self.gone_nodes[node]

    def _present_nodes(self) -> set[str]:
        """The nodes that are not gone: those Kubernetes knows; in etcd mode also those with
        a tabby Node or a live heartbeat (a node tabby-node runs on, Kubernetes' or not)."""
        known = set(self.nodes.keys())
        if self.kubernetes_datastore:
            return known
        return known | set(self.store.list_keys("node")) | set(self.store.list_keys("heartbeat"))

    # -- leaked attachments -------------------------------------------------------------------

    def _leaks(self, ipam: Ipam) -> None:
        by_handle: dict[str, list[tuple[str, Mapping[str, object]]]] = {}
        for owner in ipam.allocations():
            attrs = owner.attrs or {}
            if attrs.get("purpose") == "vxlan-tunnel" or not attrs.get("pod_name"):
                continue
            by_handle.setdefault(owner.handle_id, []).append((str(owner.ip), attrs))
        now = self.clock()
        leaked = {h for h, held in by_handle.items() if self._leaked(held, self.pods.get)}
        for handle in list(self.leaks):
            if handle not in leaked:
                del self.leaks[handle]
        for handle in sorted(leaked):
            since = self.leaks.setdefault(handle, now)
            if now - since < self.leak_grace:
                continue
            held = by_handle[handle]
            if not self._leaked(held, self._live_pod):
                del self.leaks[handle]  # the API server says a live pod holds it
                continue
            try:
                freed = ipam.release_handle(handle)
            except DatastoreError as e:
                log.warning("cannot release leaked %s: %s", handle, e)
                continue
            self.released["leak"] += len(freed)
            if not self.kubernetes_datastore:  # there it is made of the allocations
                self._remove_endpoint(handle, held[0][1])
            log.warning(
                "released %s of %s/%s (%s): no pod holds it any more",
                ", ".join(ip for ip, _ in held),
                held[0][1].get("pod_namespace"),
                held[0][1].get("pod_name"),
                handle,
            )
            del self.leaks[handle]

    @staticmethod
    def _leaked(
        held: list[tuple[str, Mapping[str, object]]],
        pod_of: Callable[[str], JSON | None],
    ) -> bool:
        """Whether no pod holds any address of this attachment: its pod is gone, is
        another incarnation (another UID), or reports other addresses."""
        attrs = held[0][1]
        pod = pod_of(f"{attrs.get('pod_namespace') or 'default'}/{attrs.get('pod_name')}")
        if pod is None:
            return True
        meta = pod.get("metadata") or {}
        uid = attrs.get("pod_uid")
        if uid and meta.get("uid") and uid != meta.get("uid"):
            return True
        status = pod.get("status") or {}
        reported = {p.get("ip") for p in status.get("podIPs") or () if isinstance(p, dict)}
        return bool(reported) and not any(ip in reported for ip, _ in held)

    def _live_pod(self, key: str) -> JSON | None:
        """The pod as the API server has it now (a last look before releasing)."""
        from stores.kube.kinds import project_pod

        namespace, _, name = key.partition("/")
        try:
            return project_pod(self.api.get(f"/api/v1/namespaces/{namespace}/pods/{name}"))
        except NotFound:
            return None
        except ApiError as e:
            # Unsure: treat it as held (never release a live pod's address on a hunch).
            log.warning("cannot read pod %s: %s", key, e)
            return {"metadata": {}, "status": {}}

    def _remove_endpoint(self, handle: str, attrs: Mapping[str, object]) -> None:
        from resources.wep import endpoint_key, remove_endpoint

        try:
            _network, container_id, ifname = split_handle_id(handle)
            key = endpoint_key(
                str(attrs.get("pod_namespace") or "default"),
                str(attrs.get("node") or ""),
                str(attrs.get("pod_name") or ""),
                ifname,
            )
            with self.store.lock():
                remove_endpoint(self.store, key, container_id)
        except (DatastoreError, ValueError) as e:
            log.warning("cannot remove the WorkloadEndpoint of %s: %s", handle, e)
