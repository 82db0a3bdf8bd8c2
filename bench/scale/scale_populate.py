"""A simulated cluster's documents written in bulk (bench/scale/scale_bench.py ``--populate bulk``,
bench/scale/call_cost_bench.py).

Populating N nodes through the CNI handlers (bench/scale/scale_writer.py's ``setup``) makes every
pod ADD pay its round trips to etcd: N = 1000 took 18 minutes. Here the same documents are
made by tabby's own code on an in-memory store, then copied to the target store in
transactions of up to ``MAX_TXN_OPS`` documents:

- a node's ``Node`` through tabby-node's ``registration.node_spec``, its VXLAN tunnel address
  and MAC through ``Tunnels.ensure`` (IPAM: the node's block claimed, its affinity), as
  bench/scale/scale_writer.py's ``register`` does;
- a pod's address through the IPAM core (``Ipam.assign`` with the request tabby-ipam builds
  from a CNI ADD: handle, allocation in the node's block), its ``WorkloadEndpoint`` through
  ``resources.wep.write_endpoint`` (the plugin's recorder), its ``Pod`` as
  tabby-kube-controllers mirror it with its address (``kube_controllers.mirror``), or in
  plain mode as ``tabbyctl apply`` writes it (labels only);
- the pool and the namespaces as the writer makes them (``ResourceClient``), unless the
  target has them already.

The keys and the shapes are the writer's; only the revisions differ (the target assigns
its own, and an allocation's sequence number comes from the in-memory store's revision).
A pod's Pod and WorkloadEndpoint are made on a store of their node's own, so that a Pod's
relabelling reads only that node's endpoints (the mirror lists the namespace's: with every
node's endpoints there, making them would grow with the cluster).
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import time
from collections.abc import Callable, Sequence
from typing import Any

from datastore.base import Op, Store

NETWORK = "k8s-pod-network"
STATIC_LABELS = {"app": "static"}
#: The kinds a simulated node owns (copied to the target); the pool and namespaces are
#: copied only when the target lacks them.
NODE_KINDS = ("node", "block", "affinity", "handle")
POD_KINDS = ("pod", "workloadendpoint")
MAX_TXN_OPS = 128  # etcd's --max-txn-ops default


def pool_doc(cidr: str, block_size: int = 26) -> dict[str, Any]:
    return {
        "apiVersion": "tabby.io/v1",
        "kind": "IPPool",
        "metadata": {"name": "bench-pool"},
        "spec": {"cidr": cidr, "blockSize": block_size},
    }


def k8s_pod(
    namespace: str, name: str, node: str, uid: str, labels: dict[str, str], ips: list[str]
) -> dict[str, Any]:
    """The Kubernetes Pod as bench/scale/scale_writer.py makes it (what the controllers mirror)."""
    obj: dict[str, Any] = {
        "metadata": {"name": name, "namespace": namespace, "uid": uid, "labels": labels},
        "spec": {
            "nodeName": node,
            "containers": [{"name": "web", "ports": [{"name": "http", "containerPort": 8080}]}],
        },
    }
    if ips:
        obj["status"] = {"podIPs": [{"ip": ip} for ip in ips]}
    return obj


class Builder:
    """The documents of simulated nodes, made on an in-memory store by tabby's own code."""

    def __init__(
        self,
        *,
        pool: str,
        node_argv: Sequence[str],
        underlay: str,
        kubernetes: bool,
        veth_prefix: str = "cali",
    ) -> None:
        from datastore.memory import MemoryStore
        from resources.client import ResourceClient

        self.mem = MemoryStore()
        self.pool = pool
        self.node_argv = list(node_argv)
        self.underlay = ipaddress.ip_address(underlay)
        self.kubernetes = kubernetes
        self.veth_prefix = veth_prefix
        ResourceClient(self.mem).apply([pool_doc(pool)])
        self.pod_ops: list[Op] = []

    def register(self, node: str, index: int) -> None:
        """The node's registration and tunnel address (bench/scale/scale_writer.py ``register``)."""
        from dataplane.nodeinfo import NodeAddress
        from tabby_node import options as node_options
        from tabby_node.cache import Cache
        from tabby_node.facts import Facts
        from tabby_node.registration import cas, node_spec
        from tabby_node.tunnels import Tunnels

        argv = [a.replace("{node}", node) for a in self.node_argv]
        options, _datastore = node_options.parse(argv)
        address = self.underlay + index
        facts = Facts(node, NodeAddress(address, 16, None), None, 1500, False, "")
        cache = Cache(node)
        cas(self.mem, "node", node, lambda existing: node_spec(facts, options.backend, existing))
        for key, doc in self.mem.list("pool"):
            cache.put_local("pool", key, doc)
        Tunnels(facts, options.backend, self.mem, cache).ensure()

    def pods(self, node: str, pods: Sequence[tuple[str, str]], labels: dict[str, str]) -> None:
        """``pods`` ((namespace, name) each) on ``node``: address, endpoint, Pod."""
        from dataplane.names import host_veth_name
        from datastore.memory import MemoryStore
        from ipam.core import AssignRequest, Ipam, handle_id
        from kube_controllers.mirror import Mirror, project_pod
        from resources.client import ResourceClient
        from resources.mirror import KUBERNETES
        from resources.wep import write_endpoint

        own = MemoryStore()  # this node's Pods and endpoints (see the module docstring)
        mirror = Mirror(own, ResourceClient(own, owner=KUBERNETES))
        operator = ResourceClient(own)
        ipam = Ipam(self.mem, node)
        for namespace, name in pods:
            cid = secrets.token_hex(32)
            uid = secrets.token_hex(16)
            if not self.kubernetes:
                doc = {
                    "apiVersion": "v1",
                    "kind": "Pod",
                    "metadata": {"name": name, "namespace": namespace, "labels": labels},
                }
                operator.apply([doc])
            hid = handle_id(NETWORK, cid, "eth0")
            (alloc,) = ipam.assign(
                AssignRequest(
                    handle_id=hid,
                    attrs={
                        "node": node,
                        "network": NETWORK,
                        "container_id": cid,
                        "ifname": "eth0",
                        "pod_namespace": namespace,
                        "pod_name": name,
                        "pod_uid": uid,
                        "netns": f"/run/netns/tbysim-{cid[:12]}",
                        "time": time.time(),
                    },
                    want_v4=True,
                    want_v6=False,
                    v4_pools=[self.pool],
                    v6_pools=[],
                )
            )
            ip = str(alloc.ip)
            if self.kubernetes:
                pod = k8s_pod(namespace, name, node, uid, labels, [ip])
                mirror.sync("pod", f"{namespace}/{name}", project_pod(pod))
            write_endpoint(
                own,
                namespace=namespace,
                node=node,
                pod=name,
                container_id=cid,
                interface="eth0",
                host_interface=host_veth_name(self.veth_prefix, NETWORK, cid, "eth0"),
                ip_networks=[f"{ip}/32"],
            )
        for kind in POD_KINDS:
            self.pod_ops += [Op(kind, key, doc.data, None) for key, doc in own.list(kind)]

    def ops(self) -> list[Op]:
        """Every document made, as creations."""
        out = [
            Op(kind, key, doc.data, None) for kind in NODE_KINDS for key, doc in self.mem.list(kind)
        ]
        return out + self.pod_ops


def write_bulk(store: Store, ops: Sequence[Op], batch: int = MAX_TXN_OPS) -> int:
    """``ops`` in commits of ``batch``; returns how many commits."""
    n = 0
    for start in range(0, len(ops), batch):
        store.commit(list(ops[start : start + batch]))
        n += 1
    return n


def ensure_base(store: Store, pool: str, namespaces: Sequence[str], kubernetes: bool) -> None:
    """The pool and the namespaces, as the writer makes them, when the target lacks them."""
    from kube_controllers.mirror import Mirror, project_namespace
    from resources.client import ResourceClient
    from resources.mirror import KUBERNETES

    if store.get("pool", pool) is None:
        ResourceClient(store).apply([pool_doc(pool)])
    mirror = Mirror(store, ResourceClient(store, owner=KUBERNETES))
    for ns in namespaces:
        if store.get("namespace", ns) is not None:
            continue
        if kubernetes:
            obj = {"metadata": {"name": ns, "uid": secrets.token_hex(8)}}
            mirror.sync("namespace", ns, project_namespace(obj))
        else:
            ResourceClient(store).apply(
                [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}}]
            )


def populate(
    store: Store,
    nodes: Sequence[str],
    *,
    pool: str,
    pods_per_node: int,
    namespaces: Sequence[str],
    node_argv: Sequence[str],
    underlay: str,
    kubernetes: bool,
    labels: dict[str, str] | None = None,
    progress: Callable[[str], None] | None = None,
    heartbeat_ttl: float | None = None,
) -> dict[str, Any]:
    """The documents of ``nodes`` (each with ``pods_per_node`` pods named
    ``<node>-p<j>``, spread over ``namespaces`` as bench/scale/scale_writer.py spreads them)
    written into ``store``; the pool and namespaces first when it lacks them. With
    ``heartbeat_ttl``, each node's heartbeat too, as tabby-node writes it (a lease of that
    ttl, never kept alive here: the nodes count as alive for that long). Returns counts and
    seconds."""
    t0 = time.monotonic()
    ensure_base(store, pool, namespaces, kubernetes)
    builder = Builder(pool=pool, node_argv=node_argv, underlay=underlay, kubernetes=kubernetes)
    for index, node in enumerate(nodes):
        builder.register(node, index)
        pods = [
            (namespaces[(index * pods_per_node + j) % len(namespaces)], f"{node}-p{j}")
            for j in range(pods_per_node)
        ]
        builder.pods(node, pods, dict(labels or STATIC_LABELS))
        if progress is not None and (index + 1) % 200 == 0:
            progress(f"{index + 1}/{len(nodes)} nodes made ({time.monotonic() - t0:.0f} s)")
    made = time.monotonic() - t0
    ops = builder.ops()
    commits = write_bulk(store, ops)
    if heartbeat_ttl is not None:
        from resources.heartbeat import KIND, Heartbeat

        for node in nodes:
            beat = Heartbeat(node, time.time(), os.getpid())
            store.put_leased(KIND, node, beat.to_data(), None, ttl=heartbeat_ttl)
    counts: dict[str, int] = {}
    for op in ops:
        counts[op.kind] = counts.get(op.kind, 0) + 1
    return {
        "documents": len(ops),
        "commits": commits,
        "kinds": counts,
        "made_s": round(made, 1),
        "written_s": round(time.monotonic() - t0 - made, 1),
    }
