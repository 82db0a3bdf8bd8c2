"""Calico's policy model for the engine: tiers, ordered policies, rules with actions. Pure.

The engine's inputs for Calico's kinds (``policy.inputs`` converts the resource models):

* :class:`Tier`: a name, an ``order`` (lower first; None: after every ordered tier) and the
  ``default_action`` a tier ends in for an endpoint one of its policies selects when no rule
  decided (``Deny``, or ``Pass``: on to the next tier);
* :class:`CalicoPolicy`: a NetworkPolicy (namespaced) or GlobalNetworkPolicy (``namespace``
  None), staged or not, in a tier at an ``order``, with ingress and egress :class:`CalicoRule`s;
* :class:`NetworkSet`: a (Global)NetworkSet, whose ``nets`` are matched by a rule selector
  exactly when its labels are.

Selectors are taken compiled (:class:`Matcher`: anything with ``matches(labels)`` and a
canonical ``str()``, i.e. ``resources.selector.Selector``) and read the combined labels
Calico gives an endpoint or network set (``bundle.calico.endpoint_labels``): a
policy's ``selector`` here is the whole of which endpoints it applies to (its own selector,
its namespace, its ``namespaceSelector`` and ``serviceAccountSelector`` folded in by
``resources.selector.policy_selector``), a rule side's ``selector`` likewise
(``resources.selector.rule_selector``: ``namespaceSelector``, ``serviceAccounts``, the
policy's namespace), and ``not_selector`` the side's ``notSelector`` alone.

:func:`rule_matches` is the definition of a rule's match on one packet (:class:`Packet`,
whose two ends are :class:`Party`: an address, the labels of the endpoint that has it if
any, the labels of the network sets whose nets hold it, the endpoint's named ports). The
tier walk itself is :func:`policy.engine.explain`'s (the Kubernetes NetworkPolicies take
part in it as Allow-only policies in tier ``default`` at order 1000, as in Calico).
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable, Mapping
from typing import Literal, Protocol

from bundle.calico import DEFAULT_TIER as DEFAULT_TIER
from bundle.calico import DEFAULT_TIER_ORDER as DEFAULT_TIER_ORDER
from bundle.calico import PROTOCOLS
from bundle.types import IPAddress, IPNetwork

Action = Literal["Allow", "Deny", "Log", "Pass"]
ACTIONS: tuple[Action, ...] = ("Allow", "Deny", "Log", "Pass")
TierAction = Literal["Deny", "Pass"]
Direction = Literal["ingress", "egress"]
PolicyStage = Literal["untracked", "prednat", "normal"]

#: Calico's protocol names (any case here: ``explain`` takes a user's) and their numbers.
PROTOCOL_NUMBERS: Mapping[str, int] = {name.upper(): n for name, n in PROTOCOLS.items()}
#: The protocols with ports (``ports`` / ``notPorts`` need one of them).
PORTED = frozenset({6, 17, 132, 136})
ICMP_NUMBERS = frozenset({1, 58})


def protocol_number(value: str | int) -> int:
    """A protocol given by name (any case) or number as its number; ValueError otherwise."""
    if isinstance(value, int) or value.isdigit():
        number = int(value)
        if not 0 <= number <= 255:
            raise ValueError(f"protocol number {number} out of range")
        return number
    try:
        return PROTOCOL_NUMBERS[value.upper()]
    except KeyError:
        raise ValueError(f"unknown protocol {value!r}") from None


class Matcher(Protocol):
    """A compiled selector: ``resources.selector.Selector`` is one."""

    def matches(self, labels: Mapping[str, str], /) -> bool: ...


@dataclasses.dataclass(frozen=True)
class PortMatch:
    """One entry of ``ports`` / ``notPorts``: an inclusive range, or a named port."""

    first: int = 0
    last: int = 0
    name: str | None = None

    def __post_init__(self) -> None:
        if self.name is None and not 0 <= self.first <= self.last <= 65535:
            raise ValueError(f"bad port range {self.first}:{self.last}")
        if self.name is not None and not self.name:
            raise ValueError("empty port name")

    @classmethod
    def parse(cls, value: int | str) -> PortMatch:
        """``80``, ``"80"``, ``"8000:8080"``, or a port name."""
        if isinstance(value, int):
            return cls(value, value)
        lo, sep, hi = value.partition(":")
        if lo.isdigit() and (not sep or hi.isdigit()):
            return cls(int(lo), int(hi) if sep else int(lo))
        return cls(name=value)

    def text(self) -> str:
        if self.name is not None:
            return self.name
        return str(self.first) if self.first == self.last else f"{self.first}:{self.last}"


@dataclasses.dataclass(frozen=True)
class IcmpMatch:
    """``icmp`` / ``notICMP``: a type, and a code (None: any code)."""

    type: int
    code: int | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.type <= 254 or (self.code is not None and not 0 <= self.code <= 255):
            raise ValueError(f"bad ICMP type/code {self.type}/{self.code}")
        # (Calico: type 255 is reserved, a code needs a type.)

    def matches(self, icmp_type: int | None, icmp_code: int | None) -> bool:
        if icmp_type != self.type:
            return False
        return self.code is None or icmp_code == self.code


@dataclasses.dataclass(frozen=True)
class EntityMatch:
    """A rule's ``source`` or ``destination``: every given part must hold."""

    nets: tuple[str, ...] = ()
    not_nets: tuple[str, ...] = ()
    selector: Matcher | None = None
    not_selector: Matcher | None = None
    ports: tuple[PortMatch, ...] = ()
    not_ports: tuple[PortMatch, ...] = ()

    def __post_init__(self) -> None:
        for field in ("nets", "not_nets"):
            nets = tuple(str(ipaddress.ip_network(n, strict=False)) for n in getattr(self, field))
            object.__setattr__(self, field, nets)

    @property
    def empty(self) -> bool:
        return self == EntityMatch()

    def text(self) -> str:
        parts = []
        if self.nets:
            parts.append(f"nets {','.join(self.nets)}")
        if self.not_nets:
            parts.append(f"notNets {','.join(self.not_nets)}")
        if self.selector is not None:
            parts.append(f"selector [{self.selector}]")
        if self.not_selector is not None:
            parts.append(f"notSelector [{self.not_selector}]")
        if self.ports:
            parts.append(f"ports {','.join(p.text() for p in self.ports)}")
        if self.not_ports:
            parts.append(f"notPorts {','.join(p.text() for p in self.not_ports)}")
        return " ".join(parts) or "any"


ANY = EntityMatch()


@dataclasses.dataclass(frozen=True)
class CalicoRule:
    """One rule: its ``action`` when every given part matches."""

    action: Action
    protocol: int | None = None
    not_protocol: int | None = None
    icmp: IcmpMatch | None = None
    not_icmp: IcmpMatch | None = None
    ip_version: Literal[4, 6] | None = None
    source: EntityMatch = ANY
    destination: EntityMatch = ANY

    def __post_init__(self) -> None:
        if self.action not in ACTIONS:
            raise ValueError(f"unknown action {self.action!r}")
        if self.ip_version not in (None, 4, 6):
            raise ValueError(f"bad ipVersion {self.ip_version!r}")
        has_ports = any(e.ports or e.not_ports for e in (self.source, self.destination))
        if has_ports and self.protocol not in PORTED:
            raise ValueError("ports need protocol TCP, UDP, SCTP or UDPLite")
        if (self.icmp or self.not_icmp) and self.protocol not in ICMP_NUMBERS:
            raise ValueError("icmp / notICMP need protocol ICMP or ICMPv6")


@dataclasses.dataclass(frozen=True)
class CalicoPolicy:
    """A (Staged)(Global)NetworkPolicy. ``namespace`` None: global. ``order`` None: after
    every ordered policy of its tier. ``types``: the directions it applies to (the resource's
    default already resolved: ingress, plus egress when it has egress rules)."""

    name: str
    namespace: str | None
    selector: Matcher
    tier: str = DEFAULT_TIER
    order: float | None = None
    types: frozenset[Direction] = frozenset({"ingress"})
    ingress: tuple[CalicoRule, ...] = ()
    egress: tuple[CalicoRule, ...] = ()
    staged: bool = False
    #: a GlobalNetworkPolicy's host-endpoint flags, as Calico defines them: ``pre_dnat``
    #: (ingress before DNAT), ``do_not_track`` (before connection tracking, Allow means
    #: untracked), ``apply_on_forward`` (also traffic the host forwards); the first two
    #: apply to host endpoints only and need the third
    pre_dnat: bool = False
    do_not_track: bool = False
    apply_on_forward: bool = False
    #: a staged ``Delete``: it stages deleting the enforced policy of its name (explain's
    #: "would" leaves that policy out); it has no rules and selects nothing
    staged_delete: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "types", frozenset(self.types))
        if self.staged_delete and not self.staged:
            raise ValueError("a staged Delete is staged")
        if not self.types <= {"ingress", "egress"}:
            raise ValueError(f"unknown policy types {sorted(self.types)}")
        if (self.pre_dnat or self.do_not_track) and not self.apply_on_forward:
            raise ValueError("preDNAT and doNotTrack need applyOnForward")
        if self.pre_dnat and (self.do_not_track or "egress" in self.types):
            raise ValueError("a preDNAT policy is ingress only and not doNotTrack")
        if (self.pre_dnat or self.do_not_track) and self.namespace is not None:
            raise ValueError("only a GlobalNetworkPolicy can be preDNAT or doNotTrack")

    @property
    def stage(self) -> PolicyStage:
        """Where it is enforced on a host endpoint: before connection tracking
        (``untracked``), before DNAT (``prednat``), or with the filter (``normal``; the
        only one that applies to workload endpoints too)."""
        if self.do_not_track:
            return "untracked"
        return "prednat" if self.pre_dnat else "normal"

    @property
    def key(self) -> str:
        """``namespace/name``, or the name of a global policy: what explain and counters show,
        and what breaks ties of ``order`` within a tier."""
        base = self.name if self.namespace is None else f"{self.namespace}/{self.name}"
        return f"staged:{base}" if self.staged else base

    @property
    def kind(self) -> str:
        kind = "NetworkPolicy" if self.namespace is not None else "GlobalNetworkPolicy"
        return f"Staged{kind}" if self.staged else kind

    def rules(self, direction: Direction) -> tuple[CalicoRule, ...]:
        return self.ingress if direction == "ingress" else self.egress


@dataclasses.dataclass(frozen=True)
class Tier:
    name: str
    order: float | None = None
    default_action: TierAction = "Deny"

    def __post_init__(self) -> None:
        if self.default_action not in ("Deny", "Pass"):
            raise ValueError(f"unknown tier defaultAction {self.default_action!r}")


def tier_sort_key(t: Tier) -> tuple[bool, float, str]:
    return (t.order is None, t.order if t.order is not None else 0.0, t.name)


def policy_sort_key(order: float | None, key: str) -> tuple[bool, float, str]:
    """Within a tier: by ``order`` (None last), then by name."""
    return (order is None, order if order is not None else 0.0, key)


@dataclasses.dataclass(frozen=True)
class NetworkSet:
    """A NetworkSet (``namespace`` given) or GlobalNetworkSet: labels and nets."""

    name: str
    namespace: str | None
    labels: tuple[tuple[str, str], ...] = ()
    nets: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(sorted(dict(self.labels).items())))
        nets = tuple(str(ipaddress.ip_network(n, strict=False)) for n in self.nets)
        object.__setattr__(self, "nets", nets)

    @property
    def key(self) -> str:
        return self.name if self.namespace is None else f"{self.namespace}/{self.name}"

    def networks(self) -> tuple[IPNetwork, ...]:
        return tuple(ipaddress.ip_network(n) for n in self.nets)


@dataclasses.dataclass(frozen=True)
class HostEndpoint:
    """A HostEndpoint: the node ``node``'s interface ``interface`` (``"*"``: all of its
    interfaces but the workloads' and ``lo``; None: none, only ``expected_ips`` for peers'
    selectors), its ``labels`` (what policy selectors read; a host endpoint is global: no
    namespace) and ``expected_ips`` (what a rule selector that selects it matches)."""

    name: str
    node: str
    interface: str | None
    expected_ips: tuple[str, ...] = ()
    labels: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", tuple(sorted(dict(self.labels).items())))
        ips = tuple(str(ipaddress.ip_address(a)) for a in self.expected_ips)
        object.__setattr__(self, "expected_ips", ips)

    @property
    def key(self) -> str:
        return self.name

    @property
    def all_interfaces(self) -> bool:
        return self.interface == "*"


#: A failsafe's protocol: Calico's failsafe ports are TCP or UDP.
FailsafeProtocol = Literal["tcp", "udp"]


@dataclasses.dataclass(frozen=True)
class FailsafePort:
    """One failsafe port: ``protocol`` and ``port``; ``net`` (None: any) the remote end's
    addresses (the source of an inbound connection, the destination of an outbound one).
    Text: ``tcp:22``, ``udp:68``, ``tcp:10.0.0.0/8:2379``, ``tcp:[fd00::/64]:179``."""

    protocol: FailsafeProtocol
    port: int
    net: str | None = None

    def __post_init__(self) -> None:
        if self.protocol not in ("tcp", "udp"):
            raise ValueError(f"failsafe protocol must be tcp or udp, not {self.protocol!r}")
        if not 1 <= self.port <= 65535:
            raise ValueError(f"failsafe port {self.port} out of range")
        if self.net is not None:
            object.__setattr__(self, "net", str(ipaddress.ip_network(self.net, strict=False)))

    @classmethod
    def parse(cls, text: str) -> FailsafePort:
        proto, sep, rest = text.strip().partition(":")
        net, _, port = rest.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"failsafe port {text!r} is not PROTOCOL:[NET:]PORT")
        net = net.strip("[]")
        return cls(proto.lower(), int(port), net or None)  # type: ignore[arg-type]

    def text(self) -> str:
        if self.net is None:
            return f"{self.protocol}:{self.port}"
        net = f"[{self.net}]" if ":" in self.net else self.net
        return f"{self.protocol}:{net}:{self.port}"

    def matches(self, protocol: int, port: int | None, remote: IPAddress) -> bool:
        if protocol != PROTOCOL_NUMBERS[self.protocol.upper()] or port != self.port:
            return False
        return self.net is None or remote in ipaddress.ip_network(self.net)


def _failsafe_ports(text: str) -> tuple[FailsafePort, ...]:
    return tuple(FailsafePort.parse(w) for w in text.split(","))


#: Calico's default failsafe ports (felix's FailsafeInboundHostPorts / Outbound...): SSH,
#: BGP, etcd, typha, the API server, the kube-proxy health/metrics ports, DHCP; DNS out.
FAILSAFE_INBOUND_TEXT = (
    "tcp:22,tcp:179,tcp:2379,tcp:2380,tcp:5473,tcp:6443,tcp:6666,tcp:6667,udp:68"
)
FAILSAFE_OUTBOUND_TEXT = "tcp:53,tcp:179,tcp:2379,tcp:2380,tcp:6443,tcp:6666,tcp:6667,udp:53,udp:67"
DEFAULT_FAILSAFE_INBOUND = _failsafe_ports(FAILSAFE_INBOUND_TEXT)
DEFAULT_FAILSAFE_OUTBOUND = _failsafe_ports(FAILSAFE_OUTBOUND_TEXT)


def parse_failsafe_ports(text: str) -> tuple[FailsafePort, ...]:
    """A comma-separated list of ``PROTOCOL:[NET:]PORT``; ``none`` (or nothing): no port."""
    if text.strip().lower() in ("", "none"):
        return ()
    return _failsafe_ports(text)


def _failsafe_key(f: FailsafePort) -> tuple[str, int, str]:
    """The order failsafe ports are kept and rendered in (any remote end, ``net`` None,
    before a given one of the same port)."""
    return (f.protocol, f.port, f.net or "")


@dataclasses.dataclass(frozen=True)
class Failsafes:
    """What no host-endpoint policy can close: ``inbound`` connections to the host,
    ``outbound`` ones from it (each checked before any host-endpoint policy, in every
    stage: before connection tracking, before DNAT, and with the filter)."""

    inbound: tuple[FailsafePort, ...] = DEFAULT_FAILSAFE_INBOUND
    outbound: tuple[FailsafePort, ...] = DEFAULT_FAILSAFE_OUTBOUND

    def __post_init__(self) -> None:
        object.__setattr__(self, "inbound", tuple(sorted(set(self.inbound), key=_failsafe_key)))
        object.__setattr__(self, "outbound", tuple(sorted(set(self.outbound), key=_failsafe_key)))

    def match(
        self, direction: Direction, protocol: int, port: int | None, remote: IPAddress
    ) -> FailsafePort | None:
        """The failsafe port a new connection of the host's (``ingress``: to it, from
        ``remote``; ``egress``: from it, to ``remote``) is let through by, if any."""
        ports = self.inbound if direction == "ingress" else self.outbound
        return next((f for f in ports if f.matches(protocol, port, remote)), None)

    def plus(self, inbound: Iterable[FailsafePort], outbound: Iterable[FailsafePort]) -> Failsafes:
        return Failsafes((*self.inbound, *inbound), (*self.outbound, *outbound))


@dataclasses.dataclass(frozen=True)
class Party:
    """One end of a packet: its address; the combined labels of the endpoint that has it
    (None: no endpoint); those of every network set whose nets hold it; the endpoint's
    named ports as ``(name, protocol number, port)``."""

    address: IPAddress
    labels: Mapping[str, str] | None = None
    set_labels: tuple[Mapping[str, str], ...] = ()
    named_ports: tuple[tuple[str, int, int], ...] = ()

    def selected_by(self, sel: Matcher) -> bool:
        """Whether a rule selector names this address: the endpoint's labels match, or a
        network set's that holds it (Calico puts both into the selector's IP set)."""
        if self.labels is not None and sel.matches(self.labels):
            return True
        return any(sel.matches(labels) for labels in self.set_labels)


@dataclasses.dataclass(frozen=True)
class Packet:
    """The first packet of a connection: its ends, protocol (number), ports or ICMP."""

    src: Party
    dst: Party
    protocol: int
    sport: int | None = None
    dport: int | None = None
    icmp_type: int | None = None
    icmp_code: int | None = None


def _in_nets(addr: IPAddress, nets: tuple[str, ...]) -> bool:
    return any(addr in ipaddress.ip_network(n) for n in nets)


def _port_in(p: PortMatch, port: int, protocol: int, party: Party) -> bool:
    if p.name is None:
        return p.first <= port <= p.last
    return (p.name, protocol, port) in party.named_ports


def _entity_matches(e: EntityMatch, party: Party, port: int | None, protocol: int) -> bool:
    addr = party.address
    if e.nets and not _in_nets(addr, e.nets):
        return False
    if e.not_nets and _in_nets(addr, e.not_nets):
        return False
    if e.selector is not None and not party.selected_by(e.selector):
        return False
    if e.not_selector is not None and party.selected_by(e.not_selector):
        return False
    if e.ports and (port is None or not any(_port_in(p, port, protocol, party) for p in e.ports)):
        return False
    return not (
        e.not_ports
        and (port is None or any(_port_in(p, port, protocol, party) for p in e.not_ports))
    )


def rule_matches(rule: CalicoRule, pkt: Packet) -> bool:
    """Whether every part of ``rule`` holds for ``pkt`` (the action is the caller's)."""
    if rule.ip_version is not None and pkt.src.address.version != rule.ip_version:
        return False
    if rule.protocol is not None and pkt.protocol != rule.protocol:
        return False
    if rule.not_protocol is not None and pkt.protocol == rule.not_protocol:
        return False
    if rule.icmp is not None and not rule.icmp.matches(pkt.icmp_type, pkt.icmp_code):
        return False
    if rule.not_icmp is not None and (
        pkt.protocol in ICMP_NUMBERS and rule.not_icmp.matches(pkt.icmp_type, pkt.icmp_code)
    ):
        return False
    if not _entity_matches(rule.source, pkt.src, pkt.sport, pkt.protocol):
        return False
    return _entity_matches(rule.destination, pkt.dst, pkt.dport, pkt.protocol)


__all__ = [
    "ACTIONS",
    "ANY",
    "DEFAULT_FAILSAFE_INBOUND",
    "DEFAULT_FAILSAFE_OUTBOUND",
    "DEFAULT_TIER",
    "DEFAULT_TIER_ORDER",
    "FAILSAFE_INBOUND_TEXT",
    "FAILSAFE_OUTBOUND_TEXT",
    "PROTOCOL_NUMBERS",
    "Action",
    "CalicoPolicy",
    "CalicoRule",
    "EntityMatch",
    "FailsafePort",
    "Failsafes",
    "HostEndpoint",
    "IcmpMatch",
    "Matcher",
    "NetworkSet",
    "Packet",
    "Party",
    "PolicyStage",
    "PortMatch",
    "Tier",
    "TierAction",
    "parse_failsafe_ports",
    "policy_sort_key",
    "protocol_number",
    "rule_matches",
    "tier_sort_key",
]
