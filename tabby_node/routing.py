"""tabby-node's routing backends: what reaches other nodes' pods (``--backend``).

* ``bird``: BIRD 2 speaks BGP (full mesh, route reflectors, explicit BGPPeers); the agent
  renders its configuration from the cluster view and reloads it on change (confd's role,
  :mod:`bird`). Pools with VXLAN get the vxlan state too.
* ``vxlan``: no BGP; the agent programs VXLAN devices, neighbours, FDB entries and routes
  itself (felix's role, :mod:`dataplane.overlay`).
* ``none``: one node; tabby's own routes, if an earlier backend left some, are removed.

Each backend reconciles: it computes the whole desired state and changes only the
difference, so running it twice, or after a restart, changes nothing.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from tabby_node.cluster import Cluster, NodeInfo, PeerSpec, encap_of

if TYPE_CHECKING:
    from bird import BirdConfig, Peer
    from dataplane.model import IPAddress, IPNetwork
    from dataplane.overlay_model import DesiredState
    from tabby_node.view import AgentView

log = logging.getLogger("tabby.node")

# BGPConfiguration.logSeverityScreen -> BIRD's log level (BIRD has no level above error).
_SEVERITY = {
    "Debug": "debug",
    "Info": "info",
    "Warning": "warning",
    "Error": "error",
    "Fatal": "error",
}


class _Overlay:
    """The kernel side of VXLAN (and of nothing, when no pool wants it)."""

    def __init__(self, agent: AgentView) -> None:
        from dataplane.overlay import Reconciler

        self.agent = agent
        self.reconciler = Reconciler()
        self.last: DesiredState | None = None
        self.programmed: dict[str, int] = {}
        self.problems: list[str] = []

    def reconcile(self, cluster: Cluster) -> None:
        desired = self.agent.vxlan_state(cluster)
        changes = self.reconciler.reconcile(desired)
        if changes:
            log.info("routing: %s", changes.summary())
        self.last = desired
        self.programmed = {
            "block": sum(1 for r in desired.routes if r.type == "unicast" and not _host(r.dst)),
            "borrowed": sum(1 for r in desired.routes if r.type == "unicast" and _host(r.dst)),
            "blackhole": sum(1 for r in desired.routes if r.type == "blackhole"),
            "tunnel": len(desired.neighbours),
            "fdb": len(desired.fdb),
        }
        self.problems = [str(p) for p in (*changes.conflicts, *changes.failures)]
        if self.agent.metrics is not None:
            self.agent.metrics.routes(self.programmed, changes)

    def vxlan_peers(self, cluster: Cluster) -> list[dict[str, Any]]:
        if self.last is None:
            return []
        macs = {(n.device, n.mac): n.address for n in self.last.neighbours}
        by_mac = {n.vxlan_mac: n.name for n in cluster.nodes.values() if n.vxlan_mac}
        by_mac.update({n.vxlan_mac_v6: n.name for n in cluster.nodes.values() if n.vxlan_mac_v6})
        out = []
        for f in sorted(self.last.fdb, key=lambda f: (f.device, str(f.dst))):
            out.append(
                {
                    "node": by_mac.get(f.mac, ""),
                    "address": str(f.dst),
                    "tunnel_address": str(macs.get((f.device, f.mac), "")),
                    "mac": f.mac,
                    "device": f.device,
                }
            )
        return out


def _host(net: IPNetwork) -> bool:
    return bool(net.prefixlen == net.max_prefixlen)


class NoRouting:
    def __init__(self, agent: AgentView) -> None:
        self.agent = agent
        self.overlay = _Overlay(agent)

    def start(self) -> None:
        pass

    def reconcile(self, cluster: Cluster, *, full: bool = False) -> None:
        self.overlay.reconcile(cluster)  # empty under --backend none: removes leftovers

    def status(self, cluster: Cluster) -> dict[str, Any]:
        return {"peers": [], "vxlan": [], "routing_problems": self.overlay.problems}

    def readiness(self) -> list[str]:
        return []

    def announced(self) -> dict[str, int]:
        return {"block": 0, "borrowed": 0}

    def stop(self, *, stop_bird: bool = True) -> None:
        pass


class VxlanRouting(NoRouting):
    def status(self, cluster: Cluster) -> dict[str, Any]:
        return {
            "peers": [],
            "vxlan": self.overlay.vxlan_peers(cluster),
            "routing_problems": self.overlay.problems,
        }

    def readiness(self) -> list[str]:
        if self.overlay.last is None:
            return ["vxlan: not programmed yet"]
        return [f"vxlan: {p}" for p in self.overlay.problems[:3]]


class BirdRouting(NoRouting):
    """BIRD for BGP; the vxlan state for pools that ask for VXLAN."""

    def __init__(self, agent: AgentView) -> None:
        super().__init__(agent)
        from bird import BirdSupervisor

        self.bird = BirdSupervisor(agent.options.run_dir)
        self.started = False
        self.config: BirdConfig | None = None

    def start(self) -> None:
        pass  # BIRD starts (or is adopted) with the first configuration

    def reconcile(self, cluster: Cluster, *, full: bool = False) -> None:
        self.overlay.reconcile(cluster)
        facts = self.agent.facts
        assert facts is not None
        config = bird_config(cluster, facts.name, ipip=facts.ipip_available)
        if config is None:
            raise RuntimeError("BIRD needs the node's IPv4 address (--node-ip)")
        if not self.started:
            self.bird.start(config)
            self.started = True
            if self.bird.adopted:
                log.warning("adopted the running BIRD (pid %s)", self.bird.pid)
        elif config != self.config:
            self.bird.apply(config)
        self.config = config
        if self.agent.metrics is not None:
            self.agent.metrics.bird(self.bird)

    def status(self, cluster: Cluster) -> dict[str, Any]:
        try:
            peers = [p.as_dict() for p in self.bird.peers()]
        except Exception as e:
            peers = []
            self.overlay.problems = [*self.overlay.problems, f"bird: {e}"]
        return {
            "peers": peers,
            "vxlan": self.overlay.vxlan_peers(cluster),
            "bird": {"pid": self.bird.pid, "restarts": self.bird.restarts},
            "routing_problems": self.overlay.problems,
        }

    def announced(self) -> dict[str, int]:
        if self.config is None:
            return super().announced()
        return {"block": len(self.config.blocks), "borrowed": len(self.config.borrowed)}

    def readiness(self) -> list[str]:
        if not self.started:
            return ["bird: not started yet"]
        return [f"bird: {r}" for r in self.bird.readiness()]

    def stop(self, *, stop_bird: bool = True) -> None:
        """tabby-node's SIGTERM: BIRD goes for a graceful restart (peers keep this node's
        routes until the next tabby-node's BIRD sent them again: a restart or an upgrade
        moves no traffic); ``stop_bird`` False leaves it running for a successor."""
        if stop_bird:
            self.bird.stop(graceful=True)
        else:
            self.bird.detach()


# -- the BIRD configuration from the cluster view (confd's role) --------------------------------


def _matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    from resources.selector import parse_selector

    if not selector:
        return True
    try:
        return parse_selector(selector).matches(labels)
    except ValueError:
        log.warning("ignoring an invalid selector %r", selector)
        return False


def _address(text: str | None) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text) if text else None
    except ValueError:
        return None


def _applies_to(peer: PeerSpec, me: NodeInfo) -> bool:
    if peer.node is not None:
        return peer.node == me.name
    return _matches(peer.node_selector, me.labels)


def bird_config(cluster: Cluster, me_name: str, *, ipip: bool = False) -> BirdConfig | None:
    """The BirdConfig of node ``me_name`` (None when it has no IPv4 underlay address).

    Sessions, as Calico's confd decides them: the node-to-node mesh (unless disabled or this
    node is a route reflector) towards every other live node that is not a reflector;
    BGPPeers that apply to this node (``node`` or ``nodeSelector``; neither: every node)
    towards ``peerIP`` or towards the live nodes ``peerSelector`` selects; and the reverse
    of every BGPPeer whose far side is this node (``peerSelector`` selects it, or ``peerIP``
    is its address at its AS): it peers back with the live nodes the BGPPeer applies to, so
    that both ends of a session exist (Calico's route reflector set-up is one BGPPeer,
    ``nodeSelector: all()``, ``peerSelector: route-reflector == 'true'``). A reflector has
    the nodes it peers with as clients unless they share its cluster id. One session per
    address, the first one wins: global BGPPeers, node-specific ones, reverse peerings, the
    mesh. A peer address BIRD cannot use (loopback, link-local, ...) is skipped and logged.
    Blocks and borrowed addresses of pools that use VXLAN are left to the vxlan state."""
    from bird import DEFAULT_AS, BirdConfig, BirdNode, Peer, PeerType, Pool

    me = cluster.nodes.get(me_name)
    if me is None or me.ipv4 is None:
        return None
    my_as = me.as_number or cluster.as_number or DEFAULT_AS
    rr = ipaddress.IPv4Address(me.rr_cluster_id) if me.rr_cluster_id else None
    node = BirdNode(
        me_name,
        me.ipv4.ip,
        me.ipv6.ip if me.ipv6 else None,
        as_number=my_as,
        rr_cluster_id=rr,
    )
    peers: dict[IPAddress, Peer] = {}
    others = [n for n in cluster.alive() if n.name != me_name]
    by_address = {i.ip: n for n in others for i in (n.ipv4, n.ipv6) if i is not None}

    def as_of(other: NodeInfo) -> int:
        return other.as_number or cluster.as_number or DEFAULT_AS

    def add(
        other: NodeInfo | None,
        address: IPAddress | None,
        kind: PeerType,
        as_number: int,
        name: str,
    ) -> None:
        if address is None or address in (node.ipv4, node.ipv6) or address in peers:
            return
        if address.version == 6 and node.ipv6 is None:
            return
        client = False
        if other is not None and rr is not None and as_number == my_as:
            client = other.rr_cluster_id != me.rr_cluster_id
        if other is not None and (rr is not None or other.rr_cluster_id):
            kind = PeerType.RR
        try:
            peers[address] = Peer(address, kind, as_number, client, name)
        except ValueError as e:  # one bad Node or BGPPeer must not stop every node's BGP
            log.warning("ignoring BGP peer %s (%s): %s", address, name, e)

    def add_node(other: NodeInfo, kind: PeerType, versions: tuple[int, ...] = (4, 6)) -> None:
        for iface in (other.ipv4, other.ipv6):
            if iface is not None and iface.version in versions:
                add(other, iface.ip, kind, as_of(other), other.name)

    # global BGPPeers before node-specific ones: for one address, the global one wins
    specs = sorted(cluster.peers, key=lambda p: bool(p.node or p.node_selector))
    for spec in specs:
        if not _applies_to(spec, me):
            continue
        kind = PeerType.NODE if (spec.node or spec.node_selector) else PeerType.GLOBAL
        if spec.peer_ip:
            addr = _address(spec.peer_ip)
            if addr is not None:
                add(by_address.get(addr), addr, kind, spec.as_number or my_as, spec.name)
        elif spec.peer_selector is not None:
            for other in others:
                if _matches(spec.peer_selector, other.labels):
                    add_node(other, kind)
    for spec in specs:  # the reverse peerings: this node is the BGPPeer's far side
        if spec.peer_selector is not None:
            if not _matches(spec.peer_selector, me.labels):
                continue
            versions: tuple[int, ...] = (4, 6)
        else:
            addr = _address(spec.peer_ip)
            if addr is None or addr not in (node.ipv4, node.ipv6) or spec.as_number != my_as:
                continue
            versions = (addr.version,)
        for other in others:
            if _applies_to(spec, other):
                add_node(other, PeerType.NODE, versions)
    if cluster.mesh and rr is None:
        for other in others:
            if not other.rr_cluster_id:
                add_node(other, PeerType.MESH)

    def routed_by_bird(net: IPNetwork) -> bool:
        return encap_of(cluster.pool_of(net), "bird")[0] != "vxlan"

    # A one-address block (blockSize 32/128) whose address another node holds is that
    # node's /32 to announce: the owner announcing the same prefix would split the traffic.
    lent_whole = {b.block for b in cluster.borrowed if b.holder != me_name and b.prefix == b.block}

    pools = tuple(
        Pool(p.cidr, ipip=ipip and p.encap("bird")[0] == "ipip" and p.cidr.version == 4)
        for p in cluster.pools
        if p.encap("bird")[0] != "vxlan" and (p.cidr.version == 4 or node.ipv6 is not None)
    )
    blocks = tuple(
        b.cidr
        for b in cluster.blocks_of(me_name)
        if routed_by_bird(b.cidr)
        and (b.cidr.version == 4 or node.ipv6 is not None)
        and b.cidr not in lent_whole
    )
    borrowed = tuple(
        b.address
        for b in cluster.borrowed
        if b.holder == me_name
        and routed_by_bird(b.block)
        and (b.address.version == 4 or node.ipv6 is not None)
    )
    return BirdConfig(
        node=node,
        peers=tuple(peers.values()),
        pools=pools,
        blocks=blocks,
        borrowed=borrowed,
        log_severity=_SEVERITY.get(cluster.log_severity, "info"),  # type: ignore[arg-type]
    )
