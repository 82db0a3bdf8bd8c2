"""The typed inputs of the BIRD backend: what the node agent computed from the datastore.

Every type is a frozen dataclass that checks itself on construction, so a mistake in the
agent (an IPv6 peer for a node without an IPv6 underlay address, a peer twice, a route
reflector client without a cluster id) fails where it is made, not as a BIRD parse error.
Collections are normalised (sorted, duplicates dropped), so two configs built from the same
facts in any order compare equal and render byte-identical text.
"""

from __future__ import annotations

import dataclasses
import enum
import ipaddress
from typing import Literal, TypeAlias

from bundle.types import IPAddress, IPNetwork

LogSeverity: TypeAlias = Literal["debug", "info", "warning", "error"]

#: Calico's default AS number for a cluster (private range, RFC 6996).
DEFAULT_AS = 64512
LOG_SEVERITIES: tuple[LogSeverity, ...] = ("debug", "info", "warning", "error")


class PeerType(enum.Enum):
    """Why a BGP session exists (``tabbyctl node status`` shows the value)."""

    MESH = "mesh"  # node-to-node mesh: one session per other node
    RR = "rr"  # either side is a route reflector
    GLOBAL = "global"  # a BGPPeer that applies to every node
    NODE = "node"  # a BGPPeer that applies to selected nodes


def _sort_key(item: IPAddress | IPNetwork) -> tuple[int, IPAddress | IPNetwork]:
    return (item.version, item)


def _check_as(value: int, what: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 0xFFFFFFFF:
        raise ValueError(f"{what}: AS number must be an integer in 1..4294967295, got {value!r}")


def _unsafe_name(name: str) -> bool:
    """A name the text cannot carry as it is: a quote or a backslash (the end of a BIRD
    string), or anything not printable (line ends, controls, and the lone surrogates of
    undecodable bytes, which the configuration file cannot be written with)."""
    return not name.isprintable() or '"' in name or "\\" in name


def _check_address(value: object, what: str) -> None:
    if not isinstance(value, ipaddress.IPv4Address | ipaddress.IPv6Address):
        raise TypeError(f"{what}: expected an ipaddress address, got {value!r}")
    if value.is_unspecified or value.is_multicast or value.is_loopback:
        raise ValueError(f"{what}: {value} is not a usable unicast address")


@dataclasses.dataclass(frozen=True)
class BirdNode:
    """This node: its name, underlay addresses and AS number.

    ``ipv4`` is the BGP router id and the source of IPv4 sessions; ``ipv6``, when set, turns on
    the IPv6 half (sessions to IPv6 peers, IPv6 blocks and borrowed addresses). A node that
    is a route reflector has ``rr_cluster_id`` (Calico's ``routeReflectorClusterID``).
    """

    name: str
    ipv4: ipaddress.IPv4Address
    ipv6: ipaddress.IPv6Address | None = None
    as_number: int = DEFAULT_AS
    rr_cluster_id: ipaddress.IPv4Address | None = None

    def __post_init__(self) -> None:
        if not self.name or _unsafe_name(self.name):
            raise ValueError(f"node name {self.name!r} is empty, has quotes or is not printable")
        _check_address(self.ipv4, "node ipv4")
        if not isinstance(self.ipv4, ipaddress.IPv4Address):
            raise TypeError(f"node ipv4 must be an IPv4Address, got {self.ipv4!r}")
        if self.ipv6 is not None:
            _check_address(self.ipv6, "node ipv6")
            if not isinstance(self.ipv6, ipaddress.IPv6Address) or self.ipv6.is_link_local:
                raise ValueError(f"node ipv6 must be a global IPv6Address, got {self.ipv6!r}")
        _check_as(self.as_number, "node")
        if self.rr_cluster_id is not None and not isinstance(
            self.rr_cluster_id, ipaddress.IPv4Address
        ):
            raise TypeError(f"rr_cluster_id must be an IPv4Address, got {self.rr_cluster_id!r}")

    def address(self, version: int) -> IPAddress | None:
        """The underlay address of IP ``version`` (4 or 6), None if the node has none."""
        return self.ipv4 if version == 4 else self.ipv6


@dataclasses.dataclass(frozen=True)
class Peer:
    """One BGP session. The session's address family is the family of ``address``: an IPv4
    peer carries IPv4 routes, an IPv6 peer IPv6 routes (a dual-stack neighbour is two peers).

    ``as_number`` equal to the node's makes an iBGP session, anything else eBGP.
    ``rr_client``: this node reflects routes to the peer (only on a route reflector, i.e. a
    node with ``rr_cluster_id``, and only over iBGP). ``name`` is informational (the peer
    node's or BGPPeer's name) and shows up as the protocol's description.
    """

    address: IPAddress
    type: PeerType
    as_number: int = DEFAULT_AS
    rr_client: bool = False
    name: str = ""

    def __post_init__(self) -> None:
        _check_address(self.address, "peer")
        if not isinstance(self.type, PeerType):
            raise TypeError(f"peer {self.address}: type must be a PeerType, got {self.type!r}")
        _check_as(self.as_number, f"peer {self.address}")
        if _unsafe_name(self.name):
            raise ValueError(
                f"peer {self.address}: name {self.name!r} has quotes or is not printable"
            )
        if self.address.version == 6 and self.address.is_link_local:
            raise ValueError(f"peer {self.address}: link-local peers are not supported")


@dataclasses.dataclass(frozen=True)
class Pool:
    """An IP pool. Routes learned from peers are accepted only inside some pool (a peer can
    never move the node's default route); ``ipip`` sends learned routes of the pool's blocks
    through ``tunl0`` (IPv4 only; the agent sets it only when the kernel has ipip)."""

    cidr: IPNetwork
    ipip: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.cidr, ipaddress.IPv4Network | ipaddress.IPv6Network):
            raise TypeError(f"pool cidr must be an ipaddress network, got {self.cidr!r}")
        if self.ipip and self.cidr.version != 4:
            raise ValueError(f"pool {self.cidr}: IP-in-IP is IPv4 only")


@dataclasses.dataclass(frozen=True)
class BirdConfig:
    """Everything the rendered configuration depends on.

    ``blocks``: the blocks affine to this node (confirmed affinities only, never pending
    ones): exported to peers, and installed locally as blackholes so that an address of the
    block without a pod route is dropped here instead of bouncing. ``borrowed``: addresses
    this node holds inside other nodes' blocks, exported as /32 (/128) so traffic for them
    comes here instead of to the block's owner; BIRD never installs them locally (the pod's
    own ``dev cali…`` route, made by the CNI plugin, is what delivers). IPv6 blocks, borrowed
    addresses and pools are left out when the node has no IPv6 underlay address.
    """

    node: BirdNode
    peers: tuple[Peer, ...] = ()
    pools: tuple[Pool, ...] = ()
    blocks: tuple[IPNetwork, ...] = ()
    borrowed: tuple[IPAddress, ...] = ()
    log_severity: LogSeverity = "info"

    def __post_init__(self) -> None:
        node = self.node
        if not isinstance(node, BirdNode):
            raise TypeError(f"node must be a BirdNode, got {node!r}")
        if self.log_severity not in LOG_SEVERITIES:
            raise ValueError(f"log_severity must be one of {LOG_SEVERITIES}")
        peers = _checked_peers(node, self.peers)
        pools = _checked_pools(self.pools)
        for net in self.blocks:
            if not isinstance(net, ipaddress.IPv4Network | ipaddress.IPv6Network):
                raise TypeError(f"blocks must hold ipaddress networks, got {net!r}")
        for addr in self.borrowed:
            _check_address(addr, "borrowed")

        object.__setattr__(self, "peers", peers)
        object.__setattr__(self, "pools", pools)
        object.__setattr__(self, "blocks", tuple(sorted(set(self.blocks), key=_sort_key)))
        object.__setattr__(self, "borrowed", tuple(sorted(set(self.borrowed), key=_sort_key)))

    @property
    def versions(self) -> tuple[int, ...]:
        """The IP versions rendered: 4, and 6 when the node has an IPv6 underlay address."""
        return (4, 6) if self.node.ipv6 is not None else (4,)


def _checked_peers(node: BirdNode, peers: tuple[Peer, ...]) -> tuple[Peer, ...]:
    """BirdConfig's peers checked against its node, each once, in rendering order (by type,
    then IP version, then address)."""
    seen: dict[IPAddress, Peer] = {}
    for peer in tuple(peers):
        if not isinstance(peer, Peer):
            raise TypeError(f"peers must hold Peer objects, got {peer!r}")
        if peer.address in (node.ipv4, node.ipv6):
            raise ValueError(f"peer {peer.address} is this node's own address")
        if peer.address in seen and seen[peer.address] != peer:
            raise ValueError(
                f"peer {peer.address} given twice ({seen[peer.address].type.value} and "
                f"{peer.type.value}): the agent must pick one session per address"
            )
        seen[peer.address] = peer
        if node.address(peer.address.version) is None:
            raise ValueError(
                f"peer {peer.address}: the node has no IPv6 underlay address to peer from"
            )
        if peer.rr_client:
            if node.rr_cluster_id is None:
                raise ValueError(f"peer {peer.address}: rr_client needs the node's rr_cluster_id")
            if peer.as_number != node.as_number:
                raise ValueError(f"peer {peer.address}: a route reflector client is iBGP")
    order = list(PeerType)
    return tuple(
        sorted(seen.values(), key=lambda p: (order.index(p.type), p.address.version, p.address))
    )


def _checked_pools(pools: tuple[Pool, ...]) -> tuple[Pool, ...]:
    """BirdConfig's pools, each once, in address order."""
    by_cidr: dict[IPNetwork, Pool] = {}
    for pool in pools:
        if not isinstance(pool, Pool):
            raise TypeError(f"pools must hold Pool objects, got {pool!r}")
        if pool.cidr in by_cidr and by_cidr[pool.cidr] != pool:
            raise ValueError(f"pool {pool.cidr} given twice with different modes")
        by_cidr[pool.cidr] = pool
    return tuple(by_cidr[c] for c in sorted(by_cidr, key=_sort_key))
