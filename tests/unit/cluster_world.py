"""A datastore filled by tabby's own writers, for the cluster-view and routing unit tests.

Nothing here is hand-written JSON: Nodes and heartbeats come from ``Liveness.register`` and
``Tunnels.ensure`` (what tabby-node writes at start), resources from
``ResourceClient.apply`` (what ``tabbyctl apply`` writes, merging into the Node as it does
for an operator's labels and BGP fields), pools created from configuration from the IPAM
core (what the plugin does on the first ADD), pod addresses from ``Ipam.assign`` with the
plugin's attributes (borrowing included: a specific address inside another node's block).
The store is an in-memory one on a clock the test moves, so a heartbeat expires through
its real lease.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import itertools
import threading
from collections.abc import Mapping
from typing import Any, Literal

from bundle.types import IPAddress, IPNetwork
from dataplane.nodeinfo import NodeAddress
from datastore.base import Doc, SyncEvent
from datastore.memory import MemoryStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from ipam.core.block import Block
from resources.client import ResourceClient
from resources.index import ROUTING, Documents
from tabby_node.cache import Cache
from tabby_node.cluster import Cluster, Underlay
from tabby_node.facts import Facts
from tabby_node.registration import Liveness
from tabby_node.tunnels import Tunnels

Backend = Literal["bird", "vxlan", "none"]
NODE_TTL = 90.0
API = "tabby.io/v1"


def ip(text: str) -> IPAddress:
    return ipaddress.ip_address(text)


def net(text: str) -> IPNetwork:
    return ipaddress.ip_network(text)


@dataclasses.dataclass
class NodeParts:
    """One tabby-node's parts that write into the datastore."""

    facts: Facts
    backend: Backend
    cache: Cache
    tunnels: Tunnels
    liveness: Liveness


class World:
    """One cluster's datastore and the tabby-nodes that wrote into it."""

    def __init__(self, backend: Backend = "vxlan") -> None:
        self.backend = backend
        self.now = 1000.0
        self.store = MemoryStore(clock=lambda: self.now)
        self.client = ResourceClient(self.store)
        self.nodes: dict[str, NodeParts] = {}
        self._pods = itertools.count(1)

    # -- resources (tabbyctl apply) --------------------------------------------------------

    def apply(self, *docs: Mapping[str, Any]) -> None:
        self.client.apply([dict(d) for d in docs])

    def pool(self, name: str, cidr: str, **spec: Any) -> None:
        self.apply(
            {
                "apiVersion": API,
                "kind": "IPPool",
                "metadata": {"name": name},
                "spec": {"cidr": cidr, **spec},
            }
        )

    def config_pool(self, cidr: str, block_size: int | None = None) -> None:
        """A pool as the IPAM plugin creates it from the conflist (no name, no modes)."""
        Ipam(self.store, "plugin").ensure_pools([PoolSpec(cidr, block_size)])

    def bgp_configuration(self, **spec: Any) -> None:
        self.apply(
            {
                "apiVersion": API,
                "kind": "BGPConfiguration",
                "metadata": {"name": "default"},
                "spec": spec,
            }
        )

    def bgp_peer(self, name: str, **spec: Any) -> None:
        self.apply({"apiVersion": API, "kind": "BGPPeer", "metadata": {"name": name}, "spec": spec})

    def label(self, node: str, **labels: str) -> None:
        self.apply(
            {"apiVersion": API, "kind": "Node", "metadata": {"name": node, "labels": labels}}
        )

    def node_bgp(self, node: str, **bgp: Any) -> None:
        """An operator's ``spec.bgp`` fields (asNumber, routeReflectorClusterID)."""
        self.apply(
            {"apiVersion": API, "kind": "Node", "metadata": {"name": node}, "spec": {"bgp": bgp}}
        )

    def delete(self, kind: str, name: str) -> None:
        self.client.delete(kind, name)

    # -- tabby-node ----------------------------------------------------------------------

    def node(
        self,
        name: str,
        ipv4: str | None,
        ipv6: str | None = None,
        *,
        backend: Backend | None = None,
        uplink: str = "eth0",
        tunnels: bool = True,
        mtu: int = 1500,
    ) -> NodeParts:
        """Start tabby-node ``name`` as far as the datastore sees it: register (Node and
        heartbeat), then, with ``tunnels``, the VXLAN tunnel addresses and MACs. A node
        started again keeps its backend and its cache."""
        before = self.nodes.get(name)
        facts = Facts(
            name=name,
            ipv4=_address(ipv4, uplink),
            ipv6=_address(ipv6, uplink),
            uplink_mtu=mtu,
            ipip_available=False,
            ipip_reason="not probed in unit tests",
        )
        chosen = before.backend if before is not None else (backend or self.backend)
        cache = before.cache if before is not None else Cache(name)
        parts_tunnels = Tunnels(facts, chosen, self.store, cache)
        liveness = Liveness(
            facts,
            chosen,
            self.store,
            node_ttl=NODE_TTL,
            cache=cache,
            ensure_tunnels=parts_tunnels.ensure,
            stopping=threading.Event(),
            beats={},
            problems={},
        )
        parts = NodeParts(facts, chosen, cache, parts_tunnels, liveness)
        self.nodes[name] = parts
        liveness.register()
        if tunnels:
            self.tunnels(name)
        return parts

    def tunnels(self, name: str) -> None:
        parts = self.nodes[name]
        parts.cache.apply(SyncEvent("snapshot", "", "", None, self.docs()))
        parts.tunnels.ensure()

    def lease_expires(self, *names: str) -> None:
        """Time passes beyond the heartbeat TTL; every other node beats meanwhile."""
        self.now += NODE_TTL + 1
        for name, parts in self.nodes.items():
            if name not in names:
                parts.liveness.beat()

    def underlay(self, name: str) -> Underlay:
        return self.nodes[name].facts.underlay()

    # -- IPAM (the plugin's ADD) ---------------------------------------------------------

    def pod(
        self, node: str, address: str | None = None, *, v6: bool = False, pool: str | None = None
    ) -> IPAddress:
        """One pod address for a pod on ``node`` (``address``: that one, wherever it is;
        ``pool``: from that pool)."""
        n = next(self._pods)
        attrs = {"node": node, "network": "k8s-pod-network", "container_id": f"c{n}"}
        (alloc,) = Ipam(self.store, node).assign(
            AssignRequest(
                handle_id=handle_id("k8s-pod-network", f"c{n}", "eth0"),
                attrs=attrs,
                want_v4=not v6,
                want_v6=v6,
                specific_ips=[address] if address else (),
                v4_pools=[pool] if pool else self._pools(4),
                v6_pools=[pool] if pool else self._pools(6),
            )
        )
        return alloc.ip

    def _pools(self, version: int) -> list[str]:
        """The pools a conflist would name: every pool of that family."""
        return [key for key in self.store.list_keys("pool") if net(key).version == version]

    def free_address(self, block: IPNetwork) -> str:
        """An address of ``block`` (not its first) that no allocation holds yet."""
        doc = self.store.get("block", str(block))
        assert doc is not None, f"no block {block}"
        allocations = doc.data["allocations"]
        for ordinal, address in enumerate(block):
            if ordinal > 0 and allocations[ordinal] is None:
                return str(address)
        raise AssertionError(f"{block} is full")

    def block_doc(self, block: Block) -> None:
        """A block document written as the IPAM core writes it."""
        self.store.put("block", block.cidr, block.to_data(), None)

    # -- reading -------------------------------------------------------------------------

    def docs(self) -> dict[str, dict[str, Doc]]:
        return {k.name: dict(self.store.list(k.name)) for k in ROUTING}

    def cluster(self, me: str) -> Cluster:
        return cluster_of(self.docs(), me)

    def block_of(self, node: str, version: int = 4, *, pool: str | None = None) -> IPNetwork:
        """The (first) block affine to ``node`` of IP ``version`` (in ``pool``)."""
        for key, doc in sorted(self.store.list("block")):
            if doc.data.get("affinity") != f"host:{node}" or net(key).version != version:
                continue
            if pool is None or doc.data.get("pool") == pool:
                return net(key)
        raise AssertionError(f"no IPv{version} block is affine to {node}")

    def tunnel(self, node: str, version: int = 4) -> IPAddress:
        spec = self.store.get("node", node)
        assert spec is not None
        key = "ipv4VXLANTunnelAddr" if version == 4 else "ipv6VXLANTunnelAddr"
        return ip(spec.data["spec"][key])

    def mac(self, node: str, version: int = 4) -> str:
        spec = self.store.get("node", node)
        assert spec is not None
        key = "vxlanTunnelMACAddr" if version == 4 else "vxlanTunnelMACAddrV6"
        return str(spec.data["spec"][key])


def cluster_of(docs: Mapping[str, Mapping[str, Doc]], me: str) -> Cluster:
    """The cluster view of stored documents, as tabby-node's cache would give it."""
    return Cluster.from_documents(Documents.from_raw(docs), me)


def _address(text: str | None, uplink: str) -> NodeAddress | None:
    if text is None:
        return None
    iface = ipaddress.ip_interface(text)
    return NodeAddress(iface.ip, iface.network.prefixlen, uplink)
