"""tabby.io/v1 kinds: IPPool, BGPConfiguration, BGPPeer, Node, WorkloadEndpoint.

Calico's semantics, with tabby's names. Selectors (``nodeSelector``, ``peerSelector``) are
Calico selector expressions (``resources.selector``); block-size limits and the pool
CIDR rules come from the IPAM core, so they are written once.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable
from typing import ClassVar, Literal

from pydantic import Field, model_validator

from datastore.errors import InvalidConfig
from ipam.core.model import DEFAULT_BLOCK_SIZE, Pool
from resources import names
from resources.meta import FieldError, Resource, StrictModel
from resources.selector import SelectorError, parse_selector

EncapMode = Literal["Never", "Always", "CrossSubnet"]
DEFAULT_AS_NUMBER = 64512
AS_NUMBER_MAX = 4294967295
_MAC = re.compile(r"^[0-9a-fA-F]{2}(:[0-9a-fA-F]{2}){5}$")


def _as_number(value: int | None, *path: str) -> None:
    if value is not None and not 1 <= value <= AS_NUMBER_MAX:
        raise FieldError(f"must be between 1 and {AS_NUMBER_MAX}", *path, value=value)


def check_selector(text: str | None, *path: str | int, allow_global: bool = False) -> None:
    """A selector field in Calico's language (``global()`` only where ``allow_global``: a
    rule's namespaceSelector), refused with the offset of its error."""
    if text is not None:
        try:
            parse_selector(text, allow_global=allow_global)
        except SelectorError as e:
            raise FieldError(
                f"invalid selector at offset {e.offset}: {e.reason}", *path, value=text
            ) from None


def _address(text: str | None, version: int | None, *path: str) -> None:
    if text is None:
        return
    try:
        ip = ipaddress.ip_address(text)
    except ValueError:
        ip = None
    if ip is None or (version is not None and ip.version != version):
        raise FieldError(f"must be an IPv{version or '4 or IPv6'} address", *path, value=text)


def _interface(text: str | None, version: int, *path: str) -> None:
    """An address with its prefix length (``10.0.0.5/24``)."""
    if text is None:
        return
    try:
        iface = ipaddress.ip_interface(text) if "/" in text else None
    except ValueError:
        iface = None
    if iface is None or iface.version != version:
        raise FieldError(
            f"must be an IPv{version} address with its prefix length (e.g. "
            f"{'10.0.0.5/24' if version == 4 else 'fd00::5/64'})",
            *path,
            value=text,
        )


# -- IPPool ------------------------------------------------------------------------------------


class IPPoolSpec(StrictModel):
    """``blockSize`` defaults to 26 (IPv4) / 122 (IPv6). ``ipipMode``/``vxlanMode`` unset
    means: tabby-node's backend decides (vxlan: Always VXLAN; bird: no encapsulation)."""

    cidr: str
    blockSize: int | None = None
    ipipMode: EncapMode | None = None
    vxlanMode: EncapMode | None = None
    natOutgoing: bool = False
    disabled: bool = False
    nodeSelector: str = "all()"

    @model_validator(mode="after")
    def _rules(self) -> IPPoolSpec:
        try:
            net = ipaddress.ip_network(self.cidr, strict=True)
        except ValueError as e:
            raise FieldError(str(e), "cidr", value=self.cidr) from None
        if "/" not in self.cidr:
            raise FieldError("must be a CIDR (e.g. 10.244.0.0/16)", "cidr", value=self.cidr)
        self.cidr = str(net)
        if self.blockSize is None:
            self.blockSize = DEFAULT_BLOCK_SIZE[net.version]
        try:
            Pool.from_spec(self.cidr, self.blockSize)
        except InvalidConfig as e:
            raise FieldError(f"{e.msg}: {e.details}", "blockSize") from None
        encap = [m for m in (self.ipipMode, self.vxlanMode) if m not in (None, "Never")]
        if len(encap) > 1:
            raise FieldError(
                "Forbidden: ipipMode and vxlanMode cannot both be enabled", "vxlanMode"
            )
        if net.version == 6 and self.ipipMode not in (None, "Never"):
            raise FieldError("Forbidden: IP-in-IP is not supported on an IPv6 pool", "ipipMode")
        check_selector(self.nodeSelector, "nodeSelector")
        return self

    @property
    def network(self) -> ipaddress.IPv4Network | ipaddress.IPv6Network:
        return ipaddress.ip_network(self.cidr)

    @property
    def block_size(self) -> int:
        """``blockSize``, defaulted by validation (never None on a validated model)."""
        return self.blockSize or DEFAULT_BLOCK_SIZE[self.network.version]


class IPPool(Resource):
    """Stored as the IPAM ``pool`` document keyed by its CIDR (``resources.storage``)."""

    API_VERSION: ClassVar[str] = "tabby.io/v1"
    KIND: ClassVar[str] = "IPPool"

    spec: IPPoolSpec


# -- BGP ---------------------------------------------------------------------------------------


def _default_only(name: str) -> str | None:
    return None if name == "default" else 'must be "default" (there is one BGP configuration)'


class BGPConfigurationSpec(StrictModel):
    asNumber: int = DEFAULT_AS_NUMBER
    nodeToNodeMeshEnabled: bool = True
    logSeverityScreen: Literal["Debug", "Info", "Warning", "Error", "Fatal"] = "Info"

    @model_validator(mode="after")
    def _rules(self) -> BGPConfigurationSpec:
        _as_number(self.asNumber, "asNumber")
        return self


class BGPConfiguration(Resource):
    API_VERSION: ClassVar[str] = "tabby.io/v1"
    KIND: ClassVar[str] = "BGPConfiguration"
    NAME_RULE: ClassVar[Callable[[str], str | None]] = staticmethod(_default_only)

    spec: BGPConfigurationSpec = Field(default_factory=BGPConfigurationSpec)


class BGPPeerSpec(StrictModel):
    """Who peers: ``node`` (one node) or ``nodeSelector`` (unset: every node). With whom:
    ``peerIP`` + ``asNumber`` (a router outside the cluster), or ``peerSelector`` (the nodes
    it selects, at their own AS)."""

    node: str | None = None
    nodeSelector: str | None = None
    peerIP: str | None = None
    asNumber: int | None = None
    peerSelector: str | None = None

    @model_validator(mode="after")
    def _rules(self) -> BGPPeerSpec:
        if self.node is not None:
            why = names.dns1123_subdomain(self.node)
            if why is not None:
                raise FieldError(why, "node", value=self.node)
            if self.nodeSelector is not None:
                raise FieldError(
                    "Forbidden: node and nodeSelector cannot both be specified", "nodeSelector"
                )
        check_selector(self.nodeSelector, "nodeSelector")
        check_selector(self.peerSelector, "peerSelector")
        _address(self.peerIP, None, "peerIP")
        _as_number(self.asNumber, "asNumber")
        if self.peerSelector is not None:
            if self.peerIP is not None:
                raise FieldError(
                    "Forbidden: peerIP and peerSelector cannot both be specified", "peerIP"
                )
            if self.asNumber is not None:
                raise FieldError(
                    "Forbidden: may not be specified with peerSelector (the selected nodes "
                    "peer at their own AS number)",
                    "asNumber",
                )
        elif self.peerIP is None:
            raise FieldError("Required value: peerIP (with asNumber) or peerSelector", "peerIP")
        elif self.asNumber is None:
            raise FieldError("Required value: the peer's AS number", "asNumber")
        return self


class BGPPeer(Resource):
    API_VERSION: ClassVar[str] = "tabby.io/v1"
    KIND: ClassVar[str] = "BGPPeer"

    spec: BGPPeerSpec


# -- Node --------------------------------------------------------------------------------------


class NodeBGPSpec(StrictModel):
    """Set by an operator: ``asNumber`` (else the BGPConfiguration's), and
    ``routeReflectorClusterID`` (an IPv4-formatted id: the node is a route reflector).
    Set by tabby-node: ``ipv4IPIPTunnelAddr`` (tunl0's address)."""

    asNumber: int | None = None
    routeReflectorClusterID: str | None = None
    ipv4IPIPTunnelAddr: str | None = None

    @model_validator(mode="after")
    def _rules(self) -> NodeBGPSpec:
        _as_number(self.asNumber, "asNumber")
        _address(self.routeReflectorClusterID, 4, "routeReflectorClusterID")
        _address(self.ipv4IPIPTunnelAddr, 4, "ipv4IPIPTunnelAddr")
        return self


class NodeSpec(StrictModel):
    """Written by tabby-node: ``backend``, the underlay addresses with their prefix
    (``ipv4Address: 192.168.1.5/24``), the VXLAN tunnel addresses and MACs. An operator
    sets ``metadata.labels`` and ``bgp.asNumber`` / ``bgp.routeReflectorClusterID``."""

    bgp: NodeBGPSpec | None = None
    backend: Literal["bird", "vxlan", "none"] | None = None
    ipv4Address: str | None = None
    ipv6Address: str | None = None
    ipv4VXLANTunnelAddr: str | None = None
    ipv6VXLANTunnelAddr: str | None = None
    vxlanTunnelMACAddr: str | None = None
    vxlanTunnelMACAddrV6: str | None = None

    @model_validator(mode="after")
    def _rules(self) -> NodeSpec:
        _interface(self.ipv4Address, 4, "ipv4Address")
        _interface(self.ipv6Address, 6, "ipv6Address")
        _address(self.ipv4VXLANTunnelAddr, 4, "ipv4VXLANTunnelAddr")
        _address(self.ipv6VXLANTunnelAddr, 6, "ipv6VXLANTunnelAddr")
        for field in ("vxlanTunnelMACAddr", "vxlanTunnelMACAddrV6"):
            mac = getattr(self, field)
            if mac is not None and not _MAC.match(mac):
                raise FieldError("must be a MAC address (xx:xx:xx:xx:xx:xx)", field, value=mac)
        return self


class Node(Resource):
    API_VERSION: ClassVar[str] = "tabby.io/v1"
    KIND: ClassVar[str] = "Node"

    spec: NodeSpec = Field(default_factory=NodeSpec)


# -- WorkloadEndpoint ----------------------------------------------------------------------------


class WorkloadEndpointSpec(StrictModel):
    node: str
    pod: str
    containerID: str
    interface: str
    hostInterface: str | None = None
    ipNetworks: list[str] = Field(default_factory=list)

    @model_validator(mode="after")
    def _rules(self) -> WorkloadEndpointSpec:
        for field in ("node", "pod"):
            why = names.dns1123_subdomain(getattr(self, field))
            if why is not None:
                raise FieldError(why, field, value=getattr(self, field))
        for field in ("containerID", "interface"):
            if not getattr(self, field):
                raise FieldError("Required value", field)
        if self.hostInterface:
            why = names.interface_name(self.hostInterface)
            if why is not None:
                raise FieldError(why, "hostInterface", value=self.hostInterface)
        for i, text in enumerate(self.ipNetworks):
            try:
                ipaddress.ip_network(text)
            except ValueError:
                raise FieldError(
                    "must be a CIDR without host bits (e.g. 10.244.0.5/32)",
                    "ipNetworks",
                    i,
                    value=text,
                ) from None
        return self


class WorkloadEndpoint(Resource):
    """One CNI attachment (written by ADD, removed by DEL; see ``resources.wep``).
    ``metadata.labels`` are the pod's: those of the v1 Pod of the same namespace/name."""

    API_VERSION: ClassVar[str] = "tabby.io/v1"
    KIND: ClassVar[str] = "WorkloadEndpoint"
    NAMESPACED: ClassVar[bool] = True

    spec: WorkloadEndpointSpec
