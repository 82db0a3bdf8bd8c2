"""Plain data that goes in and out of the dataplane: no netlink, no CNI result types.

Nothing here needs pyroute2 (only dataclasses, ipaddress, typing); pyroute2 is loaded by
:mod:`dataplane.linux` when a kernel operation actually runs.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Callable, Sequence
from typing import Protocol

from bundle.types import IPAddress, IPNetwork
from dataplane.names import DEFAULT_VETH_PREFIX as DEFAULT_VETH_PREFIX

#: Host side of every pod veth (as Calico): one well-known MAC, so the host's IPv6 link-local
#: address (EUI-64 of this MAC) is the same on every veth and can be the pod's IPv6 gateway.
HOST_VETH_MAC = "ee:ee:ee:ee:ee:ee"
#: The pod's IPv4 gateway: a link-local address nobody owns; the host answers ARP for it by proxy.
IPV4_GATEWAY = ipaddress.IPv4Address("169.254.1.1")
#: EUI-64 link-local address derived from :data:`HOST_VETH_MAC`.
IPV6_GATEWAY = ipaddress.IPv6Address("fe80::ecee:eeff:feee:eeee")

#: Route scopes (``rtm_scope``), as the CNI 1.1.0 ``routes[].scope`` field carries them.
SCOPE_UNIVERSE = 0
SCOPE_LINK = 253


@dataclasses.dataclass(frozen=True)
class PodRoute:
    """One route inside the pod, on the pod interface."""

    dst: IPNetwork
    gw: IPAddress | None = None
    scope: int = SCOPE_UNIVERSE

    def __str__(self) -> str:
        via = f" via {self.gw}" if self.gw is not None else ""
        scope = " scope link" if self.scope == SCOPE_LINK else ""
        return f"{self.dst}{via}{scope}"


@dataclasses.dataclass(frozen=True)
class SetupSpec:
    """What one attachment needs on the node and in the pod.

    ``addresses`` are bare addresses: the pod gets each as /32 (IPv4) or /128 (IPv6).
    ``mac`` is the container-side MAC (the ``mac`` capability), ``None`` for a random one.
    ``allow_ip_forwarding`` sets ``ip_forward``/IPv6 ``forwarding`` to 1 inside the pod.
    ``alias`` is recorded on the host veth (IFLA_IFALIAS, at most 255 bytes) so GC and
    operators can tell which attachment a veth belongs to.
    """

    netns_path: str
    ifname: str
    host_ifname: str
    addresses: Sequence[IPAddress]
    mtu: int = 1500
    mac: str | None = None
    allow_ip_forwarding: bool = False
    alias: str | None = None

    def __post_init__(self) -> None:
        # Accept any iterable (a list is the natural thing to pass) but store a tuple.
        object.__setattr__(self, "addresses", tuple(self.addresses))

    @property
    def has_ipv4(self) -> bool:
        return any(a.version == 4 for a in self.addresses)

    @property
    def has_ipv6(self) -> bool:
        return any(a.version == 6 for a in self.addresses)


@dataclasses.dataclass(frozen=True)
class SetupResult:
    """What :func:`setup` built: enough to fill the CNI result's interfaces and routes."""

    host_ifname: str
    host_mac: str
    host_index: int
    container_ifname: str
    container_mac: str
    container_index: int
    #: Routes actually programmed in the pod, in the order they were added.
    routes: tuple[PodRoute, ...]


@dataclasses.dataclass(frozen=True)
class ExpectedState:
    """What CHECK compares against (normally taken from ``prevResult``).

    ``container_mac``: the pod interface's final MAC (a later plugin may have changed it);
    ``None`` means "do not compare" unless :attr:`SetupSpec.mac` is set.
    ``routes``: routes that must exist on the pod interface; ``None`` means the routes
    :func:`setup` programs for the spec's address families.
    """

    container_mac: str | None = None
    routes: Sequence[PodRoute] | None = None

    def __post_init__(self) -> None:
        if self.routes is not None:
            object.__setattr__(self, "routes", tuple(self.routes))


@dataclasses.dataclass(frozen=True)
class HostVeth:
    """One host-side veth found by :func:`list_host_veths` (for GC)."""

    name: str
    index: int
    up: bool
    #: The alias :func:`setup` recorded (``SetupSpec.alias``); "" if none.
    alias: str
    #: Host routes (/32 and /128, main table) whose only next hop is this veth.
    routes: tuple[IPNetwork, ...]


def default_pod_routes(addresses: Sequence[IPAddress]) -> tuple[PodRoute, ...]:
    """The routes :func:`setup` programs in the pod for these address families."""
    routes: list[PodRoute] = []
    if any(a.version == 4 for a in addresses):
        routes.append(PodRoute(ipaddress.IPv4Network(f"{IPV4_GATEWAY}/32"), None, SCOPE_LINK))
        routes.append(PodRoute(ipaddress.IPv4Network("0.0.0.0/0"), IPV4_GATEWAY))
    if any(a.version == 6 for a in addresses):
        routes.append(PodRoute(ipaddress.IPv6Network("::/0"), IPV6_GATEWAY))
    return tuple(routes)


def host_prefix(address: IPAddress) -> IPNetwork:
    """``address`` as the /32 or /128 network the pod and the host route use."""
    return ipaddress.ip_network(address)


class Dataplane(Protocol):
    """What the plugin needs from a data path. :mod:`dataplane.linux` (the module
    itself) implements it; tests of the plugin can pass a fake."""

    def setup(
        self, spec: SetupSpec, addresses: Callable[[], Sequence[IPAddress]] | None = None
    ) -> SetupResult: ...

    def teardown(
        self,
        netns_path: str | None,
        ifname: str,
        host_ifname: str | None,
        addresses: Sequence[IPAddress] | None = None,
    ) -> None: ...

    def check(self, spec: SetupSpec, expected: ExpectedState | None = None) -> None: ...

    def list_host_veths(self, prefix: str) -> list[HostVeth]: ...

    def delete_host_veth(self, name: str) -> None: ...

    def pod_interface_present(self, netns_path: str, ifname: str) -> bool: ...
