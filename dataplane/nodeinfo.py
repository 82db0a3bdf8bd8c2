"""Facts about the node that tabby-node needs before it routes: its underlay address (with
prefix length and interface), the uplink MTU, whether IP-in-IP is available, and the VXLAN
MAC derived from the node name.

Everything is read in the network namespace of the calling thread (netlink and a UDP
socket made by that thread; never ``/sys/class/net``, which shows the namespace of
whoever mounted sysfs).

Address autodetection methods (the ``--node-ip``/``--node-ip6`` values):

``first-found``
    The first global address (in interface index order) on an interface that is up and
    whose name is not one of :data:`EXCLUDED_INTERFACES` (``lo``, ``cali*``, ``vxlan*``,
    ``tunl*``, ``docker*``, ``veth*``, ``br-*`` and the other interfaces that containers,
    VMs, CNIs and tunnels make).
``interface=REGEX[,REGEX...]``
    The first global address on an up interface whose *whole* name matches one of the
    regular expressions (``eth0`` does not match ``veth0``); no exclusions.
``skip-interface=REGEX[,REGEX...]``
    ``first-found`` that also skips interfaces whose whole name matches.
``cidr=CIDR[,CIDR...]``
    The first global address inside one of the networks (exclusions apply).
``can-reach=DEST``
    The source address the kernel picks for a UDP socket connected to ``DEST`` (an address
    or a host name; no packet is sent).
an address, optionally with ``/prefix``
    That address; its interface and prefix length are looked up (an address that is on no
    interface keeps the given prefix, else the full length).
"""

from __future__ import annotations

import dataclasses
import hashlib
import ipaddress
import re
import secrets
import socket
from collections.abc import Sequence

from bundle.types import IPAddress, IPNetwork
from dataplane.errors import DataplaneError, NetlinkFailure
from dataplane.model import SCOPE_UNIVERSE
from dataplane.overlay_model import IPIP_DEVICE, KernelAddress, LinkState
from dataplane.rtnl_routing import RoutingRtnl

__all__ = [
    "EXCLUDED_INTERFACES",
    "FALLBACK_MTU",
    "OVERHEAD_IPIP",
    "OVERHEAD_VXLAN",
    "OVERHEAD_VXLAN_V6",
    "AutodetectError",
    "AutodetectMethod",
    "IpipSupport",
    "NodeAddress",
    "detect_address",
    "ipip_support",
    "parse_method",
    "pod_mtu",
    "select_address",
    "select_uplink_mtu",
    "uplink_mtu",
    "vxlan_mac",
]

#: Interfaces ``first-found`` never picks (whole-name regular expressions): loopback,
#: pod veths, tunnels and overlays, and the bridges and veths of container engines and VMs.
EXCLUDED_INTERFACES: tuple[str, ...] = (
    r"lo",
    r"cali.*",
    r"tabby.*",
    r"vxlan.*",
    r"tunl.*",
    r"docker.*",
    r"veth.*",
    r"br-.*",
    r"cbr.*",
    r"cni.*",
    r"dummy.*",
    r"podman.*",
    r"virbr.*",
    r"lxcbr.*",
    r"lxdbr.*",
    r"flannel.*",
    r"kube-ipvs.*",
    r"kube-bridge",
    r"nodelocaldns.*",
    r"wireguard.*",
    r"wg-.*",
    r"weave.*",
    r"cilium.*",
    r"genev.*",
    r"gre.*",
    r"sit.*",
    r"ip6tnl.*",
)

#: Encapsulation overheads (bytes) subtracted from the uplink MTU for the pods' MTU.
OVERHEAD_VXLAN = 50
OVERHEAD_VXLAN_V6 = 70
OVERHEAD_IPIP = 20
#: When no interface carries a node address and no uplink-like interface is up.
FALLBACK_MTU = 1500

IFA_F_SECONDARY_OR_TEMPORARY = 0x01  # IPv6: a temporary (privacy) address
IFA_F_DADFAILED = 0x08
IFA_F_DEPRECATED = 0x20


class AutodetectError(DataplaneError):
    """No node address could be found with the given method (the message says why)."""


@dataclasses.dataclass(frozen=True)
class NodeAddress:
    """A node's underlay address: ``interface`` carries it (None: on no interface)."""

    address: IPAddress
    prefixlen: int
    interface: str | None

    @property
    def network(self) -> IPNetwork:
        """The subnet the address is in (CrossSubnet: nodes in it are routed directly)."""
        return ipaddress.ip_network(f"{self.address}/{self.prefixlen}", strict=False)

    @property
    def version(self) -> int:
        return self.address.version

    def __str__(self) -> str:
        return f"{self.address}/{self.prefixlen}"


@dataclasses.dataclass(frozen=True)
class AutodetectMethod:
    """A parsed autodetection method (see the module docstring)."""

    kind: str  # first-found, interface, skip-interface, cidr, can-reach, address
    patterns: tuple[str, ...] = ()
    networks: tuple[IPNetwork, ...] = ()
    target: str = ""
    address: IPAddress | None = None
    prefixlen: int | None = None


def parse_method(method: str, version: int = 4) -> AutodetectMethod:
    """Parse a method string; ValueError with a readable message if it is not one."""
    text = method.strip()
    if version not in (4, 6):
        raise ValueError(f"IP version must be 4 or 6, not {version}")
    if text in ("", "first-found"):
        return AutodetectMethod("first-found")
    key, sep, arg = text.partition("=")
    if sep:
        items = tuple(i.strip() for i in arg.split(",") if i.strip())
        if key in ("interface", "skip-interface"):
            if not items:
                raise ValueError(f"{key}= needs at least one regular expression")
            for pattern in items:
                try:
                    re.compile(pattern)
                except re.error as exc:
                    raise ValueError(f"{key}={pattern}: bad regular expression: {exc}") from None
            return AutodetectMethod(key, patterns=items)
        if key == "cidr":
            try:
                networks = tuple(ipaddress.ip_network(i, strict=False) for i in items)
            except ValueError as exc:
                raise ValueError(f"cidr={arg}: {exc}") from None
            if not networks or any(n.version != version for n in networks):
                raise ValueError(f"cidr={arg}: needs IPv{version} networks")
            return AutodetectMethod("cidr", networks=networks)
        if key == "can-reach":
            if not arg.strip():
                raise ValueError("can-reach= needs an address or a host name")
            return AutodetectMethod("can-reach", target=arg.strip())
        raise ValueError(
            f"unknown autodetection method {method!r} (first-found, interface=, "
            "skip-interface=, cidr=, can-reach=, or an address)"
        )
    try:
        iface = ipaddress.ip_interface(text)
    except ValueError:
        raise ValueError(f"not an autodetection method nor an address: {method!r}") from None
    if iface.version != version:
        raise ValueError(f"{text} is not an IPv{version} address")
    prefix = iface.network.prefixlen if "/" in text else None
    return AutodetectMethod("address", address=iface.ip, prefixlen=prefix)


def _fullmatch_any(patterns: Sequence[str], name: str) -> bool:
    return any(re.fullmatch(p, name) for p in patterns)


def _usable(address: KernelAddress, version: int) -> bool:
    if address.address.version != version or address.scope != SCOPE_UNIVERSE:
        return False
    ip = address.address
    if ip.is_loopback or ip.is_link_local or ip.is_multicast or ip.is_unspecified:
        return False
    bad = IFA_F_DADFAILED | IFA_F_DEPRECATED
    if version == 6:
        bad |= IFA_F_SECONDARY_OR_TEMPORARY
    return not address.flags & bad


def _candidates(
    links: Sequence[LinkState], addresses: Sequence[KernelAddress], version: int
) -> list[tuple[LinkState, KernelAddress]]:
    """(link, address) for every usable address on an up link, in interface order."""
    by_index: dict[int, list[KernelAddress]] = {}
    for address in addresses:
        if _usable(address, version):
            by_index.setdefault(address.index, []).append(address)
    out = []
    for link in sorted(links, key=lambda lk: lk.index):
        if link.up:
            out += [(link, a) for a in by_index.get(link.index, [])]
    return out


def select_address(
    method: AutodetectMethod,
    version: int,
    links: Sequence[LinkState],
    addresses: Sequence[KernelAddress],
) -> NodeAddress:
    """Apply a (non ``can-reach``) method to a snapshot of links and addresses. Pure."""
    found = _candidates(links, addresses, version)
    if method.kind == "address":
        assert method.address is not None
        names = {lk.index: lk.name for lk in links}
        for address in addresses:
            if address.address == method.address:
                return NodeAddress(address.address, address.prefixlen, names.get(address.index))
        plen = method.prefixlen if method.prefixlen is not None else method.address.max_prefixlen
        return NodeAddress(method.address, plen, None)
    if method.kind == "interface":
        found = [(lk, a) for lk, a in found if _fullmatch_any(method.patterns, lk.name)]
        what = f"on an up interface matching {','.join(method.patterns)}"
    else:
        skip = EXCLUDED_INTERFACES + method.patterns
        found = [(lk, a) for lk, a in found if not _fullmatch_any(skip, lk.name)]
        what = "on an up interface that is not excluded (lo, cali*, vxlan*, tunl*, docker*...)"
        if method.kind == "cidr":
            found = [(lk, a) for lk, a in found if any(a.address in n for n in method.networks)]
            what += f" inside {','.join(str(n) for n in method.networks)}"
    if not found:
        raise AutodetectError(f"no global IPv{version} address {what}")
    link, address = found[0]
    return NodeAddress(address.address, address.prefixlen, link.name)


def _source_towards(target: str, version: int) -> IPAddress:
    """The source address a UDP socket connected to ``target`` gets (nothing is sent)."""
    fam = socket.AF_INET if version == 4 else socket.AF_INET6
    try:
        infos = socket.getaddrinfo(target, 9, fam, socket.SOCK_DGRAM)
    except socket.gaierror as exc:
        raise AutodetectError(
            f"can-reach={target}: not an IPv{version} destination: {exc}"
        ) from None
    sockaddr = infos[0][4]
    with socket.socket(fam, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect(sockaddr)
        except OSError as exc:
            raise AutodetectError(f"can-reach={target}: no route: {exc.strerror}") from None
        return ipaddress.ip_address(sock.getsockname()[0])


def detect_address(method: str = "first-found", version: int = 4) -> NodeAddress:
    """The node's IPv4 (``version`` 4) or IPv6 underlay address by ``method``.

    Raises ValueError for a malformed method and :class:`AutodetectError` when nothing
    fits."""
    parsed = parse_method(method, version)
    with RoutingRtnl.here("node") as nl:
        links = nl.link_states()
        addresses = nl.address_states()
    if parsed.kind == "can-reach":
        source = _source_towards(parsed.target, version)
        return select_address(
            AutodetectMethod("address", address=source), version, links, addresses
        )
    return select_address(parsed, version, links, addresses)


def uplink_mtu(node_addresses: Sequence[NodeAddress] = ()) -> int:
    """The MTU pods' traffic leaves the node with: the smallest MTU among the interfaces
    carrying ``node_addresses`` (IPv4 and IPv6 may use different uplinks); when none of
    them is on an interface, the smallest among the up, non-excluded interfaces that have a
    global address; else :data:`FALLBACK_MTU`."""
    with RoutingRtnl.here("node") as nl:
        links = nl.link_states()
        addresses = nl.address_states()
    return select_uplink_mtu(node_addresses, links, addresses)


def select_uplink_mtu(
    node_addresses: Sequence[NodeAddress],
    links: Sequence[LinkState],
    addresses: Sequence[KernelAddress],
) -> int:
    """:func:`uplink_mtu` on a snapshot. Pure."""
    by_name = {lk.name: lk for lk in links}
    carrying = [by_name[a.interface].mtu for a in node_addresses if a.interface in by_name]
    if carrying:
        return min(carrying)
    uplinks = {
        lk.index: lk.mtu
        for version in (4, 6)
        for lk, _ in _candidates(links, addresses, version)
        if not _fullmatch_any(EXCLUDED_INTERFACES, lk.name)
    }
    return min(uplinks.values()) if uplinks else FALLBACK_MTU


def pod_mtu(uplink: int, *, vxlan: bool = False, vxlan_v6: bool = False, ipip: bool = False) -> int:
    """``uplink`` minus the largest overhead of the encapsulations in use."""
    overhead = max(
        [0] + [OVERHEAD_VXLAN] * vxlan + [OVERHEAD_VXLAN_V6] * vxlan_v6 + [OVERHEAD_IPIP] * ipip
    )
    return uplink - overhead


def vxlan_mac(nodename: str, version: int = 4) -> str:
    """A stable MAC for the node's VXLAN device of IP ``version``: 5 bytes of a SHA-256 of
    the node name after a first byte with the locally administered bit set and the
    multicast bit clear (so never a vendor's address, never multicast)."""
    if not nodename:
        raise ValueError("a node name is needed to derive a MAC")
    digest = hashlib.sha256(f"tabby/vxlan/v{version}/{nodename}".encode()).digest()
    first = (digest[0] & 0xFC) | 0x02
    return ":".join(f"{b:02x}" for b in (first, *digest[1:6]))


@dataclasses.dataclass(frozen=True)
class IpipSupport:
    """Whether IP-in-IP can be used here; ``reason`` says how that was found (or why
    not) in words an operator can act on."""

    available: bool
    reason: str
    #: ``tunl0`` exists already (the ipip module creates it in each namespace).
    tunl0: bool = False


def ipip_support() -> IpipSupport:
    """Find out whether this kernel can do IP-in-IP, leaving nothing behind.

    ``tunl0`` present means yes. Otherwise the kernel is asked to create an ``ipip`` link
    with data its validation rejects: a kernel that knows the kind (loading the module on
    demand, as ``ip link add`` would) answers "invalid argument" and creates nothing; one
    without it answers "unknown device type". (Loading the module makes the kernel create
    ``tunl0`` itself: that is the module's doing and is what IP-in-IP needs anyway.)"""
    with RoutingRtnl.here("node") as nl:
        tunl0 = nl.link_state(IPIP_DEVICE)
        if tunl0 is not None and tunl0.kind == "ipip":
            return IpipSupport(True, f"{IPIP_DEVICE} exists", tunl0=True)
        probe = f"tbyprobe{secrets.token_hex(3)}"
        try:
            supported, answer = nl.link_kind_supported("ipip", probe)
        except NetlinkFailure as exc:
            return IpipSupport(False, f"could not ask the kernel about ipip: {exc.details}")
        if not supported:
            return IpipSupport(
                False,
                "the kernel has no ipip support (module not loaded and cannot be loaded: "
                f"{answer})",
            )
        again = nl.link_state(IPIP_DEVICE)
        return IpipSupport(True, f"the kernel supports ipip ({answer})", tunl0=again is not None)
