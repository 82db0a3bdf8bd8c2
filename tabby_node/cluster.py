"""What the datastore says about the cluster, read for routing: a pure module.

``Cluster.from_documents(docs, me)`` turns the documents tabby-node watches (Nodes,
heartbeats, pools, blocks, the BGP configuration and peers: already parsed, once per
revision, by ``resources.index``) into the facts routing needs:

- which nodes are alive (their Node exists and their heartbeat has not expired; a node
  always counts itself), with their underlay and tunnel addresses, AS and labels;
- every block and the node it is affine to (the block document is the authority: a claim
  is one CAS on it, so there is no "pending" affinity to advertise);
- every borrowed address: an allocation held by a node other than its block's;
- the pools' encapsulation modes and natOutgoing.

``vxlan_state(cluster, me, ...)`` is the kernel state the vxlan backend wants on node ``me``
(felix's VXLAN manager): tabby's VXLAN device, per remote node a permanent neighbour and FDB
entry, per remote block a route through the tunnel (or directly within the subnet for
CrossSubnet pools), a blackhole per own block, a /32 (/128) per address held by another node
than its block's owner. Nothing here does I/O.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING

from bundle.types import IPAddress, IPNetwork
from dataplane.overlay_model import (
    VXLAN_V4_DEVICE,
    VXLAN_V6_DEVICE,
    DesiredState,
    FdbEntry,
    NeighbourEntry,
    OverlayRoute,
    VxlanDevice,
    normalise_mac,
)
from resources.index import (
    BGP_CONFIGURATIONS,
    BGP_PEERS,
    BLOCKS,
    HEARTBEATS,
    NODES,
    POOLS,
    Documents,
)

if TYPE_CHECKING:
    from ipam.core.block import Block
    from resources.tabby import BGPPeer, IPPool, Node

DEFAULT_AS = 64512  # the BGPConfiguration model's default; a cluster without one uses it

log = logging.getLogger("tabby.node")


@dataclasses.dataclass(frozen=True)
class NodeInfo:
    name: str
    ipv4: ipaddress.IPv4Interface | None = None
    ipv6: ipaddress.IPv6Interface | None = None
    as_number: int | None = None
    rr_cluster_id: str | None = None
    labels: Mapping[str, str] = dataclasses.field(default_factory=dict)
    backend: str | None = None
    vxlan_v4: ipaddress.IPv4Address | None = None
    vxlan_mac: str | None = None
    vxlan_v6: ipaddress.IPv6Address | None = None
    vxlan_mac_v6: str | None = None
    ipip_v4: ipaddress.IPv4Address | None = None
    alive: bool = True


@dataclasses.dataclass(frozen=True)
class PoolInfo:
    cidr: IPNetwork
    block_size: int
    vxlan_mode: str | None = None  # None: the backend decides
    ipip_mode: str | None = None
    nat_outgoing: bool = False
    disabled: bool = False
    name: str = ""

    def encap(self, backend: str) -> tuple[str, str]:
        """(kind, mode): ("vxlan"|"ipip"|"none", "Always"|"CrossSubnet"|"Never")."""
        if self.vxlan_mode not in (None, "Never"):
            return "vxlan", str(self.vxlan_mode)
        if self.ipip_mode not in (None, "Never"):
            return "ipip", str(self.ipip_mode)
        if self.vxlan_mode is None and backend == "vxlan":
            # vxlanMode unset: the backend decides, also next to an explicit ipipMode:
            # Never (under --backend vxlan nothing else would route the pool at all).
            return "vxlan", "Always"
        return "none", "Never"


def encap_of(pool: PoolInfo | None, backend: str) -> tuple[str, str]:
    """``pool.encap(backend)``; a block without a pool (its pool was deleted while it still
    held addresses) is routed as a pool without modes would be, so the vxlan state and
    BIRD never both claim it."""
    if pool is not None:
        return pool.encap(backend)
    return ("vxlan", "Always") if backend == "vxlan" else ("none", "Never")


@dataclasses.dataclass(frozen=True)
class BlockInfo:
    cidr: IPNetwork
    pool: str
    node: str | None


@dataclasses.dataclass(frozen=True)
class Borrowed:
    """An address held by ``holder`` inside a block affine to ``owner`` (or to nobody)."""

    address: IPAddress
    block: IPNetwork
    holder: str
    owner: str | None

    @property
    def prefix(self) -> IPNetwork:
        return ipaddress.ip_network(self.address)


@dataclasses.dataclass(frozen=True)
class PeerSpec:
    """A BGPPeer resource, as routing needs it."""

    name: str
    node: str | None
    node_selector: str | None
    peer_ip: str | None
    as_number: int | None
    peer_selector: str | None


@dataclasses.dataclass(frozen=True)
class Cluster:
    nodes: Mapping[str, NodeInfo]
    pools: tuple[PoolInfo, ...]
    blocks: tuple[BlockInfo, ...]
    borrowed: tuple[Borrowed, ...]
    as_number: int = DEFAULT_AS
    mesh: bool = True
    log_severity: str = "Info"
    peers: tuple[PeerSpec, ...] = ()

    @classmethod
    def from_documents(cls, docs: Documents, me: str) -> Cluster:
        """The cluster view from the watched documents (those that did not parse are left
        out: ``resources.index`` logged them). The resources' defaults, such as AS 64512
        and the mesh on, are their models'."""
        live = set(docs.raw(HEARTBEATS.name)) | {me}  # alive while the document exists
        nodes = {
            name: _node(name, e.value, alive=name in live)
            for name, e in sorted(docs.of(NODES).items())
        }
        pools = tuple(pool_info(e.value) for _, e in sorted(docs.of(POOLS).items()))
        blocks: list[BlockInfo] = []
        borrowed: list[Borrowed] = []
        for _, entry in sorted(docs.of(BLOCKS).items()):
            block, held = _block(entry.value)
            blocks.append(block)
            borrowed.extend(held)
        from resources.tabby import BGPConfigurationSpec

        config = docs.get(BGP_CONFIGURATIONS, "default")
        bgp = config.spec if config is not None else BGPConfigurationSpec()
        peers = tuple(_peer(k, e.value) for k, e in sorted(docs.of(BGP_PEERS).items()))
        return cls(
            nodes=nodes,
            pools=tuple(sorted(pools, key=lambda p: (p.cidr.version, p.cidr))),
            blocks=tuple(sorted(blocks, key=lambda b: (b.cidr.version, b.cidr))),
            borrowed=tuple(sorted(borrowed, key=lambda b: (b.address.version, b.address))),
            as_number=bgp.asNumber,
            mesh=bgp.nodeToNodeMeshEnabled,
            log_severity=bgp.logSeverityScreen,
            peers=tuple(sorted(peers, key=lambda p: p.name)),
        )

    def pool_of(self, net: IPNetwork) -> PoolInfo | None:
        for p in self.pools:
            if p.cidr.version == net.version and net.subnet_of(p.cidr):  # type: ignore[arg-type]
                return p
        return None

    def alive(self) -> list[NodeInfo]:
        return [n for n in self.nodes.values() if n.alive]

    def blocks_of(self, node: str) -> list[BlockInfo]:
        return [b for b in self.blocks if b.node == node]


def _node(name: str, node: Node, *, alive: bool) -> NodeInfo:
    spec = node.spec
    bgp = spec.bgp
    return NodeInfo(
        name=name,
        ipv4=ipaddress.IPv4Interface(spec.ipv4Address) if spec.ipv4Address else None,
        ipv6=ipaddress.IPv6Interface(spec.ipv6Address) if spec.ipv6Address else None,
        as_number=bgp.asNumber if bgp else None,
        rr_cluster_id=(bgp.routeReflectorClusterID or None) if bgp else None,
        labels=dict(node.metadata.labels or {}),
        backend=spec.backend,
        vxlan_v4=ipaddress.IPv4Address(spec.ipv4VXLANTunnelAddr)
        if spec.ipv4VXLANTunnelAddr
        else None,
        vxlan_mac=spec.vxlanTunnelMACAddr,
        vxlan_v6=ipaddress.IPv6Address(spec.ipv6VXLANTunnelAddr)
        if spec.ipv6VXLANTunnelAddr
        else None,
        vxlan_mac_v6=spec.vxlanTunnelMACAddrV6,
        ipip_v4=ipaddress.IPv4Address(bgp.ipv4IPIPTunnelAddr)
        if bgp and bgp.ipv4IPIPTunnelAddr
        else None,
        alive=alive,
    )


def pool_info(pool: IPPool) -> PoolInfo:
    """A pool as routing reads it."""
    spec = pool.spec
    return PoolInfo(
        cidr=ipaddress.ip_network(spec.cidr),
        block_size=spec.block_size,
        vxlan_mode=spec.vxlanMode,
        ipip_mode=spec.ipipMode,
        nat_outgoing=spec.natOutgoing,
        disabled=spec.disabled,
        name=pool.metadata.name or "",
    )


def _block(blk: Block) -> tuple[BlockInfo, list[Borrowed]]:
    """A block (the IPAM core's document: the one authority on its affinity) and the
    addresses other nodes than its owner hold in it."""
    owner = blk.node
    held = []
    for ordinal, alloc in enumerate(blk.allocations):
        if alloc is None:
            continue
        holder = (alloc.get("attrs") or {}).get("node")
        if isinstance(holder, str) and holder and holder != owner:
            held.append(Borrowed(blk.ip(ordinal), blk.network, holder, owner))
    return BlockInfo(blk.network, blk.pool, owner), held


def _peer(name: str, peer: BGPPeer) -> PeerSpec:
    spec = peer.spec
    return PeerSpec(
        name=name,
        node=spec.node,
        node_selector=spec.nodeSelector,
        peer_ip=spec.peerIP,
        as_number=spec.asNumber,
        peer_selector=spec.peerSelector,
    )


# -- the vxlan backend's kernel state ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Underlay:
    """This node's side of the underlay: its address(es), the interface carrying each, and
    the MTU its VXLAN devices get."""

    ipv4: ipaddress.IPv4Interface | None
    ipv6: ipaddress.IPv6Interface | None
    uplink_v4: str | None
    uplink_v6: str | None
    mtu: int


def vxlan_state(
    cluster: Cluster, me: str, underlay: Underlay, backend: str = "vxlan"
) -> DesiredState:
    """The kernel state the vxlan backend wants on node ``me`` (see the module docstring).

    Blocks of pools without VXLAN (a bird cluster's plain pools) get nothing here; a remote
    node that is not alive, or that has not published its tunnel address and MAC yet, gets
    no routes (its blocks are unreachable until it does).

    This is the reference: the whole state from the whole cluster. tabby-node keeps the
    same state up to date per changed document (:mod:`tabby_node.vxlan_table`, built from
    the same pieces: :class:`VxlanLocal`, :func:`vtep_claim`, :func:`accept_vteps`) and
    checks it against this one periodically."""
    local = VxlanLocal.of(
        cluster.nodes.get(me), underlay, backend, lambda v: _vxlan_wanted(cluster, v, backend)
    )
    fdb: set[FdbEntry] = set()
    neighbours: set[NeighbourEntry] = set()
    routes: dict[IPNetwork, OverlayRoute] = {}
    vteps = _vteps(cluster, me, local.devices)

    def route_to(node: NodeInfo, net: IPNetwork, pool: PoolInfo | None) -> OverlayRoute | None:
        return local.route(node, net, pool, vteps.get((node.name, net.version)))

    for vtep in vteps.values():
        fdb.add(vtep.fdb)
        neighbours.add(vtep.neighbour)
    alive = {n.name: n for n in cluster.alive()}
    for block in cluster.blocks:
        if block.node == me:
            if encap_of(cluster.pool_of(block.cidr), backend)[0] == "vxlan":
                routes[block.cidr] = OverlayRoute.blackhole(block.cidr)
            continue
        owner = alive.get(block.node) if block.node else None
        if owner is None:
            continue
        r = route_to(owner, block.cidr, cluster.pool_of(block.cidr))
        if r is not None:
            routes[block.cidr] = r
    for b in cluster.borrowed:
        if b.holder == me:
            # The pod's own route on its veth (the CNI plugin's) serves it. A one-address
            # block (blockSize 32 or 128) is that very prefix: its route to the block's
            # owner would collide with the pod's route, so it goes.
            if b.prefix == b.block:
                routes.pop(b.prefix, None)
            continue
        holder = alive.get(b.holder)
        if holder is None:
            continue
        r = route_to(holder, b.prefix, cluster.pool_of(b.block))
        if r is not None:
            routes[b.prefix] = r
    return DesiredState(
        vxlan_v4=local.devices.get(4),
        vxlan_v6=local.devices.get(6),
        fdb=frozenset(fdb),
        neighbours=frozenset(neighbours),
        routes=frozenset(routes.values()),
    )


@dataclasses.dataclass(frozen=True)
class Vtep:
    """A remote node's VXLAN endpoint on one of this node's devices: the FDB entry (its
    MAC -> its underlay address) and the neighbour (its tunnel address -> its MAC)."""

    fdb: FdbEntry
    neighbour: NeighbourEntry


@dataclasses.dataclass(frozen=True)
class VxlanLocal:
    """This node's side of the vxlan state: its underlay, the backend, and the VXLAN
    devices it wants (by IP version)."""

    underlay: Underlay
    backend: str
    devices: Mapping[int, VxlanDevice]

    @classmethod
    def of(
        cls,
        mine: NodeInfo | None,
        underlay: Underlay,
        backend: str,
        wanted: Callable[[int], bool],
    ) -> VxlanLocal:
        """The devices of node ``mine`` (its tunnel addresses and MACs): one per family
        with an underlay address, a MAC, and a pool that uses VXLAN (``wanted``).
        ValueError when its MAC or tunnel address cannot make a device."""
        devices: dict[int, VxlanDevice] = {}
        for version, ip, tunnel, mac in (
            (4, underlay.ipv4, mine.vxlan_v4 if mine else None, mine.vxlan_mac if mine else None),
            (
                6,
                underlay.ipv6,
                mine.vxlan_v6 if mine else None,
                mine.vxlan_mac_v6 if mine else None,
            ),
        ):
            if ip is not None and mac and wanted(version):
                mtu = max(underlay.mtu - (50 if version == 4 else 70), 1280 if version == 6 else 68)
                devices[version] = VxlanDevice(ip.ip, mac, mtu, tunnel)
        return cls(underlay, backend, devices)

    def route(
        self, node: NodeInfo, net: IPNetwork, pool: PoolInfo | None, vtep: Vtep | None
    ) -> OverlayRoute | None:
        """The route to ``net`` held by ``node`` (whose endpoint on this family's device is
        ``vtep``): directly over the uplink for a CrossSubnet pool when the node shares
        this node's subnet, else through the tunnel; None when the pool does not use VXLAN,
        this node has no device of the family, or the node has no usable endpoint."""
        version = net.version
        kind, mode = encap_of(pool, self.backend)
        if kind != "vxlan" or version not in self.devices:
            return None
        underlay = self.underlay
        local = underlay.ipv4 if version == 4 else underlay.ipv6
        remote = node.ipv4 if version == 4 else node.ipv6
        uplink = underlay.uplink_v4 if version == 4 else underlay.uplink_v6
        if (
            mode == "CrossSubnet"
            and local is not None
            and remote is not None
            and uplink
            and remote.ip in local.network
        ):
            return OverlayRoute.via(net, remote.ip, uplink)
        if vtep is None:
            return None  # no complete VTEP (underlay, tunnel address, MAC): no route into a void
        return OverlayRoute.via(net, vtep.neighbour.address, self.devices[version].name)


@dataclasses.dataclass(frozen=True)
class VtepClaim:
    """What a remote node asks for on this family's device: its (normalised) MAC, its
    tunnel address and its underlay address."""

    mac: str
    tunnel: IPAddress
    remote: IPAddress


def vtep_claim(node: NodeInfo, version: int) -> VtepClaim | None:
    """The endpoint ``node`` publishes for IP ``version``; None when it lacks its underlay
    address, tunnel address or MAC, or its MAC is not a unicast one (logged)."""
    remote = node.ipv4 if version == 4 else node.ipv6
    tunnel = node.vxlan_v4 if version == 4 else node.vxlan_v6
    mac = node.vxlan_mac if version == 4 else node.vxlan_mac_v6
    if remote is None or tunnel is None or not mac:
        return None
    try:
        mac = normalise_mac(mac)
    except ValueError as e:
        log.warning("node %s: ignoring its VXLAN endpoint: %s", node.name, e)
        return None
    return VtepClaim(mac, tunnel, remote.ip)


def accept_vteps(device: VxlanDevice, claims: Iterable[tuple[str, VtepClaim]]) -> dict[str, Vtep]:
    """The endpoints ``device`` gets, by node name, from ``claims`` in node name order: a
    claim whose MAC or tunnel address the device or an endpoint accepted before already
    uses is left out, with a warning (the first node in name order keeps the entry)."""
    used_macs = {device.mac}
    used_tunnels = {device.address} if device.address is not None else set()
    out: dict[str, Vtep] = {}
    for name, claim in claims:
        if claim.mac in used_macs or claim.tunnel in used_tunnels:
            log.warning(
                "node %s: ignoring its VXLAN endpoint: MAC %s or tunnel address %s is "
                "another node's",
                name,
                claim.mac,
                claim.tunnel,
            )
            continue
        used_macs.add(claim.mac)
        used_tunnels.add(claim.tunnel)
        out[name] = Vtep(
            FdbEntry(device.name, claim.mac, claim.remote),
            NeighbourEntry(device.name, claim.tunnel, claim.mac),
        )
    return out


def _vteps(
    cluster: Cluster, me: str, devices: Mapping[int, VxlanDevice]
) -> dict[tuple[str, int], Vtep]:
    """The remote VXLAN endpoints, per (live node, IP version) of a local device: a node
    needs its underlay address, tunnel address and a unicast MAC of its own. A Node whose
    MAC or tunnel address another node (or this one) already uses is left out, with a
    warning: one bad document must not make the whole kernel state invalid (the first
    node in name order keeps the entry)."""
    out: dict[tuple[str, int], Vtep] = {}
    for version, device in sorted(devices.items()):
        claims = []
        for node in cluster.alive():
            if node.name == me:
                continue
            claim = vtep_claim(node, version)
            if claim is not None:
                claims.append((node.name, claim))
        for name, vtep in accept_vteps(device, claims).items():
            out[(name, version)] = vtep
    return out


def vxlan_wanted(pools: Iterable[PoolInfo], version: int, backend: str) -> bool:
    """A VXLAN device of this family is wanted when some pool of it uses VXLAN (or, under
    ``--backend vxlan``, when there is no pool at all yet)."""
    empty = True
    for p in pools:
        empty = False
        if p.cidr.version == version and p.encap(backend)[0] == "vxlan":
            return True
    return empty and backend == "vxlan"


def _vxlan_wanted(cluster: Cluster, version: int, backend: str) -> bool:
    return vxlan_wanted(cluster.pools, version, backend)


def device_names() -> Iterable[str]:
    return (VXLAN_V4_DEVICE, VXLAN_V6_DEVICE)
