"""Plain data for the node agent's routing: what tabby wants in the kernel, what it found.

No netlink here (no pyroute2): the desired-state types are built by tabby-node from the
datastore and handed to :class:`dataplane.overlay.Reconciler`; the observed-state
types are what :mod:`dataplane.rtnl_routing` reads back from the kernel.

Ownership: tabby owns

* the devices named :data:`VXLAN_V4_DEVICE` and :data:`VXLAN_V6_DEVICE` (kind ``vxlan``),
  every address on them, and every *permanent* neighbour and FDB entry on them;
* every main-table route whose protocol is :data:`RTPROT_TABBY` (whatever its device).

Nothing else is ever changed or removed.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import socket
from collections.abc import Iterable
from typing import Literal, TypeAlias

from bundle.types import IPAddress, IPNetwork

#: The route protocol (``rtm_protocol``) that marks a route as tabby's. 116 is ASCII "t";
#: neither the kernel's ``linux/rtnetlink.h`` nor iproute2's ``rt_protos`` names it (named:
#: 0-4, 8-18, 42, 99, 186-192), BIRD uses 12 and Calico's felix 80, so routes of those
#: daemons are never mistaken for tabby's. ``ip route show proto 116`` lists tabby's routes.
RTPROT_TABBY = 116

VXLAN_V4_DEVICE = "vxlan.tabby"
VXLAN_V6_DEVICE = "vxlan-v6.tabby"
IPIP_DEVICE = "tunl0"
VXLAN_VNI = 4096
VXLAN_PORT = 4789

# Kernel ABI values the plain types carry (linux/rtnetlink.h, linux/neighbour.h).
RTN_UNICAST = 1
RTN_BLACKHOLE = 6
NUD_PERMANENT = 0x80
RT_TABLE_MAIN = 254

_MAC = re.compile(r"^[0-9a-f]{2}(:[0-9a-f]{2}){5}$")


def normalise_mac(mac: str) -> str:
    """``mac`` in lower case; ValueError unless it is a unicast 48-bit MAC."""
    out = mac.strip().lower()
    if not _MAC.match(out):
        raise ValueError(f"not a MAC address: {mac!r}")
    if int(out[:2], 16) & 0x01:
        raise ValueError(f"not a unicast MAC address: {mac!r}")
    if out == "00:00:00:00:00:00":
        raise ValueError("the all-zero MAC is not a usable address")
    return out


def vxlan_device_name(version: int) -> str:
    return VXLAN_V4_DEVICE if version == 4 else VXLAN_V6_DEVICE


def family(version: int) -> int:
    return socket.AF_INET if version == 4 else socket.AF_INET6


def default_metric(version: int) -> int:
    """The priority the kernel gives a route added without one (``ip route`` shows it)."""
    return 0 if version == 4 else 1024


# --- desired state -----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VxlanDevice:
    """One of tabby's VXLAN devices. The family of ``local`` (the node's underlay address)
    selects it: :data:`VXLAN_V4_DEVICE` or :data:`VXLAN_V6_DEVICE`. ``address`` is the
    node's tunnel address (put on the device as /32 or /128)."""

    local: IPAddress
    mac: str
    mtu: int
    address: IPAddress | None = None
    vni: int = VXLAN_VNI
    port: int = VXLAN_PORT
    learning: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "mac", normalise_mac(self.mac))
        if self.address is not None and self.address.version != self.local.version:
            raise ValueError(
                f"{self.name}: tunnel address {self.address} is not IPv{self.local.version}"
            )
        low = 68 if self.version == 4 else 1280
        if not low <= self.mtu <= 65535:
            raise ValueError(f"{self.name}: MTU {self.mtu} out of range ({low}-65535)")
        if not 0 < self.vni < 1 << 24:
            raise ValueError(f"{self.name}: VNI {self.vni} out of range (1-16777215)")
        if not 0 < self.port < 1 << 16:
            raise ValueError(f"{self.name}: port {self.port} out of range")

    @property
    def version(self) -> int:
        return self.local.version

    @property
    def name(self) -> str:
        return vxlan_device_name(self.local.version)


@dataclasses.dataclass(frozen=True)
class IpipDevice:
    """``tunl0`` (the kernel's IP-in-IP fallback device): up, this MTU, the node's tunnel
    address as /32. Every other address on it is removed."""

    mtu: int
    address: ipaddress.IPv4Address | None = None

    def __post_init__(self) -> None:
        if not 68 <= self.mtu <= 65535:
            raise ValueError(f"{IPIP_DEVICE}: MTU {self.mtu} out of range (68-65535)")

    @property
    def name(self) -> str:
        return IPIP_DEVICE


@dataclasses.dataclass(frozen=True)
class FdbEntry:
    """Permanent FDB entry on a tabby VXLAN device: frames for ``mac`` go to ``dst`` (the
    remote node's underlay address)."""

    device: str
    mac: str
    dst: IPAddress

    def __post_init__(self) -> None:
        object.__setattr__(self, "mac", normalise_mac(self.mac))

    def __str__(self) -> str:
        return f"fdb {self.mac} dst {self.dst} dev {self.device}"


@dataclasses.dataclass(frozen=True)
class NeighbourEntry:
    """Permanent neighbour (ARP/NDP) entry on a tabby VXLAN device: the remote node's
    tunnel address has that node's VXLAN MAC."""

    device: str
    address: IPAddress
    mac: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "mac", normalise_mac(self.mac))

    def __str__(self) -> str:
        return f"neigh {self.address} lladdr {self.mac} dev {self.device}"


RouteType: TypeAlias = Literal["unicast", "blackhole"]


@dataclasses.dataclass(frozen=True)
class OverlayRoute:
    """A main-table route tabby owns: ``<dst> via <gw> dev <device> [onlink]`` or
    ``blackhole <dst>``. Build them with :meth:`via` and :meth:`blackhole`."""

    dst: IPNetwork
    type: RouteType = "unicast"
    gw: IPAddress | None = None
    device: str | None = None
    onlink: bool = True

    def __post_init__(self) -> None:
        if self.type == "blackhole":
            if self.gw is not None or self.device is not None:
                raise ValueError(f"blackhole {self.dst}: no gateway or device allowed")
            object.__setattr__(self, "onlink", False)
            return
        if self.gw is None or not self.device:
            raise ValueError(f"route {self.dst}: a unicast route needs a gateway and a device")
        if self.gw.version != self.dst.version:
            raise ValueError(f"route {self.dst}: gateway {self.gw} of another family")

    @classmethod
    def via(
        cls, dst: IPNetwork | str, gw: IPAddress | str, device: str, *, onlink: bool = True
    ) -> OverlayRoute:
        return cls(
            ipaddress.ip_network(dst, strict=False),
            "unicast",
            ipaddress.ip_address(gw),
            device,
            onlink,
        )

    @classmethod
    def blackhole(cls, dst: IPNetwork | str) -> OverlayRoute:
        return cls(ipaddress.ip_network(dst, strict=False), "blackhole")

    @property
    def version(self) -> int:
        return self.dst.version

    def __str__(self) -> str:
        if self.type == "blackhole":
            return f"blackhole {self.dst}"
        onlink = " onlink" if self.onlink else ""
        return f"{self.dst} via {self.gw} dev {self.device}{onlink}"


@dataclasses.dataclass(frozen=True)
class DesiredState:
    """Everything tabby-node wants in the kernel. A device left ``None`` is removed if it
    exists (``tunl0`` is then left alone: it is the kernel's); an entry or route not listed
    is removed if tabby owns it. Construction validates the whole state (ValueError)."""

    vxlan_v4: VxlanDevice | None = None
    vxlan_v6: VxlanDevice | None = None
    ipip: IpipDevice | None = None
    fdb: frozenset[FdbEntry] = frozenset()
    neighbours: frozenset[NeighbourEntry] = frozenset()
    routes: frozenset[OverlayRoute] = frozenset()

    def __post_init__(self) -> None:
        for attr in ("fdb", "neighbours", "routes"):
            object.__setattr__(self, attr, frozenset(getattr(self, attr)))
        if self.vxlan_v4 is not None and self.vxlan_v4.version != 4:
            raise ValueError("vxlan_v4 needs an IPv4 underlay address")
        if self.vxlan_v6 is not None and self.vxlan_v6.version != 6:
            raise ValueError("vxlan_v6 needs an IPv6 underlay address")
        devices = {d.name: d.version for d in (self.vxlan_v4, self.vxlan_v6) if d is not None}
        seen_mac: dict[tuple[str, str], FdbEntry] = {}
        for fdb in self.fdb:
            if fdb.device not in devices:
                raise ValueError(f"{fdb}: {fdb.device} is not one of the desired VXLAN devices")
            if fdb.dst.version != devices[fdb.device]:
                raise ValueError(f"{fdb}: destination of the wrong family")
            other = seen_mac.setdefault((fdb.device, fdb.mac), fdb)
            if other != fdb:
                raise ValueError(f"{fdb} and {other}: one MAC, two destinations")
        seen_ip: dict[tuple[str, IPAddress], NeighbourEntry] = {}
        for neigh in self.neighbours:
            if neigh.device not in devices:
                raise ValueError(f"{neigh}: {neigh.device} is not one of the desired VXLAN devices")
            if neigh.address.version != devices[neigh.device]:
                raise ValueError(f"{neigh}: address of the wrong family")
            previous = seen_ip.setdefault((neigh.device, neigh.address), neigh)
            if previous != neigh:
                raise ValueError(f"{neigh} and {previous}: one address, two MACs")
        seen_dst: dict[IPNetwork, OverlayRoute] = {}
        for route in self.routes:
            known = seen_dst.setdefault(route.dst, route)
            if known != route:
                raise ValueError(f"two routes for {route.dst}: {known!s} and {route!s}")

    def vxlan_devices(self) -> dict[str, VxlanDevice | None]:
        """Both tabby VXLAN device names, with what is wanted for each (None: absent)."""
        return {VXLAN_V4_DEVICE: self.vxlan_v4, VXLAN_V6_DEVICE: self.vxlan_v6}


@dataclasses.dataclass(frozen=True)
class OverlayDelta:
    """How the desired state changed: per object (an FDB entry by device and MAC, a
    neighbour by device and address, a route by prefix) the entry before and after; None
    before is an object added, None after one removed. ``devices``: the VXLAN devices
    changed as well (a device is only ever reconciled whole: see
    :meth:`dataplane.overlay.Reconciler.apply`)."""

    devices: bool = False
    fdb: tuple[tuple[FdbEntry | None, FdbEntry | None], ...] = ()
    neighbours: tuple[tuple[NeighbourEntry | None, NeighbourEntry | None], ...] = ()
    routes: tuple[tuple[OverlayRoute | None, OverlayRoute | None], ...] = ()

    def __bool__(self) -> bool:
        return self.devices or bool(self.fdb or self.neighbours or self.routes)

    def __len__(self) -> int:
        """Objects changed (devices aside)."""
        return len(self.fdb) + len(self.neighbours) + len(self.routes)


@dataclasses.dataclass(frozen=True)
class VxlanPeer:
    """What one remote node contributes on one VXLAN device (see :func:`vxlan_peer`)."""

    fdb: FdbEntry
    neighbour: NeighbourEntry
    routes: tuple[OverlayRoute, ...]


def vxlan_peer(
    device: str,
    *,
    node_ip: IPAddress,
    tunnel_ip: IPAddress,
    mac: str,
    prefixes: Iterable[IPNetwork] = (),
) -> VxlanPeer:
    """The FDB entry (MAC -> node IP), the neighbour (tunnel IP -> MAC) and one route per
    prefix (the remote's blocks and the /32s or /128s it holds in other nodes' blocks)
    through the remote tunnel address."""
    return VxlanPeer(
        FdbEntry(device, mac, node_ip),
        NeighbourEntry(device, tunnel_ip, mac),
        tuple(OverlayRoute.via(p, tunnel_ip, device) for p in prefixes),
    )


# --- observed state (read from the kernel) -------------------------------------------------


@dataclasses.dataclass(frozen=True)
class VxlanAttrs:
    vni: int | None
    port: int | None
    local: IPAddress | None
    learning: bool


@dataclasses.dataclass(frozen=True)
class LinkState:
    index: int
    name: str
    kind: str | None
    mac: str | None
    mtu: int
    up: bool
    vxlan: VxlanAttrs | None = None


@dataclasses.dataclass(frozen=True)
class KernelAddress:
    index: int
    address: IPAddress
    prefixlen: int
    #: ``ifa_scope``: 0 global, 253 link, 254 host.
    scope: int
    #: ``IFA_F_*`` (the 32-bit IFA_FLAGS when the kernel sends it).
    flags: int


@dataclasses.dataclass(frozen=True)
class KernelRoute:
    dst: IPNetwork
    type: int
    proto: int
    gw: IPAddress | None
    oif: int | None
    onlink: bool
    metric: int
    table: int = RT_TABLE_MAIN
    multipath: bool = False

    def __str__(self) -> str:
        if self.type == RTN_BLACKHOLE:
            text = f"blackhole {self.dst}"
        else:
            via = f" via {self.gw}" if self.gw is not None else ""
            dev = f" dev #{self.oif}" if self.oif is not None else ""
            text = f"{self.dst}{via}{dev}{' onlink' if self.onlink else ''}"
            if self.type != RTN_UNICAST:
                text = f"type {self.type} {text}"
        return f"{text} proto {self.proto} metric {self.metric}"


@dataclasses.dataclass(frozen=True)
class KernelNeighbour:
    ifindex: int
    address: IPAddress
    mac: str | None
    state: int

    @property
    def permanent(self) -> bool:
        return bool(self.state & NUD_PERMANENT)


@dataclasses.dataclass(frozen=True)
class KernelFdb:
    ifindex: int
    mac: str
    dst: IPAddress | None
    state: int
    #: NDA_PORT / NDA_VNI: sent by the kernel only when they differ from the device's.
    port: int | None = None
    vni: int | None = None

    @property
    def permanent(self) -> bool:
        return bool(self.state & NUD_PERMANENT)
