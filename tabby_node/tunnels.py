"""This node's VXLAN tunnel addresses and MACs on its Node (felix's role), and the pod MTU
they leave (``<state-dir>/mtu``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bundle.types import JSON
from tabby_node.cluster import Cluster
from tabby_node.facts import write_file
from tabby_node.registration import cas, node_spec

if TYPE_CHECKING:
    from datastore.base import Store
    from tabby_node.cache import Cache
    from tabby_node.facts import Facts

TUNNEL_NETWORK = "tabby-tunnel"


class Tunnels:
    """The tunnel addresses of the families whose pools use VXLAN (as the cache has the
    pools), allocated from IPAM in ``store`` and published on the Node."""

    def __init__(self, facts: Facts, backend: str, store: Store, cache: Cache) -> None:
        self.facts = facts
        self.backend = backend
        self.store = store
        self.cache = cache

    def _families(self, cluster: Cluster) -> list[int]:
        """The IP versions this node has an address of and some pool routes by VXLAN."""
        out = []
        for version, addr in ((4, self.facts.ipv4), (6, self.facts.ipv6)):
            if addr is None:
                continue
            if any(
                p.cidr.version == version and p.encap(self.backend)[0] == "vxlan"
                for p in cluster.pools
            ):
                out.append(version)
        return out

    def ensure(self) -> None:
        """The VXLAN tunnel address of each family in use (from IPAM, handle
        ``vxlan-tunnel-addr-<node>``, out of the node's own block) and the MAC, on the
        Node (felix's role)."""
        from dataplane.nodeinfo import vxlan_mac
        from ipam.core import AssignRequest, Ipam, handle_id

        name = self.facts.name
        cluster = Cluster.from_documents(self.cache.view(), name)
        families = self._families(cluster)
        if not families:
            return
        ipam = Ipam(self.store, name)
        tunnels: dict[int, str] = {}
        for version in families:
            device = "vxlan.tabby" if version == 4 else "vxlan-v6.tabby"
            pools = [
                str(p.cidr)
                for p in cluster.pools
                if p.cidr.version == version
                and not p.disabled
                and p.encap(self.backend)[0] == "vxlan"
            ]
            req = AssignRequest(
                handle_id=handle_id(TUNNEL_NETWORK, f"vxlan-tunnel-addr-{name}", device),
                attrs={"node": name, "network": TUNNEL_NETWORK, "purpose": "vxlan-tunnel"},
                want_v4=version == 4,
                want_v6=version == 6,
                v4_pools=pools if version == 4 else (),
                v6_pools=pools if version == 6 else (),
            )
            (alloc,) = ipam.assign(req)
            tunnels[version] = str(alloc.ip)

        def change(existing: JSON | None) -> JSON:
            data = node_spec(self.facts, self.backend, existing)
            spec = data["spec"]
            for version, (addr_key, mac_key) in {
                4: ("ipv4VXLANTunnelAddr", "vxlanTunnelMACAddr"),
                6: ("ipv6VXLANTunnelAddr", "vxlanTunnelMACAddrV6"),
            }.items():
                if version in tunnels:
                    spec[addr_key] = tunnels[version]
                    spec[mac_key] = vxlan_mac(name, version)
                else:
                    spec.pop(addr_key, None)
                    spec.pop(mac_key, None)
            return data

        doc = cas(self.store, "node", name, change)
        self.cache.put_local("node", name, doc)

    def write_mtu(self, path: str) -> int:
        """``path`` (``<state-dir>/mtu``): what a pod whose conflist says ``"mtu": 0`` gets;
        returns it."""
        from dataplane.nodeinfo import pod_mtu

        facts = self.facts
        cluster = Cluster.from_documents(self.cache.view(), facts.name)
        families = self._families(cluster)
        ipip = facts.ipip_available and any(
            p.encap(self.backend)[0] == "ipip" for p in cluster.pools
        )
        mtu = pod_mtu(facts.uplink_mtu, vxlan=4 in families, vxlan_v6=6 in families, ipip=ipip)
        write_file(path, f"{mtu}\n")
        return mtu
