"""Calico's policy kinds, as ``tabby.io/v1`` (the same documents are accepted unchanged with
``apiVersion: projectcalico.org/v3`` and stored as ``tabby.io/v1``).

=============================  ==========  ====================================================
kind                           scope       what
=============================  ==========  ====================================================
``NetworkPolicy``              namespaced  Calico's namespaced policy (class
                                           :class:`CalicoNetworkPolicy`; Kubernetes'
                                           ``networking.k8s.io/v1`` NetworkPolicy is
                                           ``resources.k8s.NetworkPolicy``)
``GlobalNetworkPolicy``        cluster     the same, for every namespace and host endpoints,
                                           with ``namespaceSelector``, ``doNotTrack``,
                                           ``preDNAT``, ``applyOnForward``
``StagedNetworkPolicy``,       as above    a policy evaluated and counted, never enforced:
``StagedGlobalNetworkPolicy``              the enforced spec plus ``stagedAction``
``StagedKubernetesNetworkPolicy`` namespaced  a staged Kubernetes NetworkPolicy
``Tier``                       cluster     ``order`` and ``defaultAction`` of a group of
                                           policies
``NetworkSet``                 namespaced  ``nets`` that rules select by the set's labels
``GlobalNetworkSet``           cluster     the same, global
``HostEndpoint``               cluster     one of a node's own interfaces (or all: ``*``)
=============================  ==========  ====================================================

Validation is Calico's (libcalico-go's v3 validator and its API types), with the field path
named: ports only with TCP, UDP or SCTP; ``icmp``/``notICMP`` only with ICMP or ICMPv6 (and
``ipVersion`` 4 resp. 6); a rule's CIDRs of one IP version, matching ``ipVersion``; ICMP
``code`` only with ``type``; ``preDNAT`` not with ``doNotTrack`` nor with egress;
``applyOnForward`` required by either; ``global()`` only as the whole of a rule's
``namespaceSelector``; no ``types`` twice; a policy in a tier other than ``default`` named
``<tier>.<name>``. Selectors are parsed by ``resources.selector`` (the one implementation),
a bad one refused with its offset.

Defaults are applied when a model is built (``tier: default``; ``types`` as Calico defaults
them: egress rules alone make ``[Egress]``, both kinds ``[Ingress, Egress]``, otherwise
``[Ingress]``), so a stored document keeps what was applied and every reader sees the
defaulted resource. What tabby does not enforce (application-layer ``http`` matches and
Kubernetes ``services`` in rules, which need a service mesh or Services tabby does not
read) is refused, naming the field, rather than accepted and ignored.
"""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from typing import ClassVar, Literal, NamedTuple

from pydantic import Field, model_validator

from bundle.calico import DEFAULT_TIER as DEFAULT_TIER
from bundle.calico import DEFAULT_TIER_ORDER as DEFAULT_TIER_ORDER
from bundle.calico import KUBERNETES_POLICY_ORDER as KUBERNETES_POLICY_ORDER
from bundle.calico import KUBERNETES_POLICY_PREFIX
from bundle.calico import PROTOCOLS as PROTOCOLS
from bundle.types import IPNetwork
from resources import names
from resources.k8s import IntOrString
from resources.k8s import NetworkPolicySpec as KubernetesNetworkPolicySpec
from resources.meta import Annotations, FieldError, PathPart, Resource, StrictModel, show
from resources.selector import NAMESPACE_LABEL
from resources.tabby import check_selector as _selector

#: the apiVersion Calico's own documents carry; ``tabbyctl apply`` takes them unchanged
CALICO_API_VERSION = "projectcalico.org/v3"
TABBY_API_VERSION = "tabby.io/v1"

#: name prefixes Calico keeps for the policies it derives (Kubernetes NetworkPolicies)
RESERVED_PREFIXES = (KUBERNETES_POLICY_PREFIX, "ossg.default.")

Action = Literal["Allow", "Deny", "Log", "Pass"]
PolicyType = Literal["Ingress", "Egress"]
TierAction = Literal["Deny", "Pass"]
StagedAction = Literal["Set", "Delete"]

#: the protocols a rule may name ports with (by number too)
PORT_PROTOCOLS = frozenset({6, 17, 132})
ICMP_VERSION = {1: 4, 58: 6}  # protocol number -> the only ipVersion it goes with
ICMP_TYPE_MAX, ICMP_CODE_MAX = 254, 255
INTERFACE = re.compile(r"[a-zA-Z0-9_.-]{1,15}")
_NUMBER = re.compile(r"[0-9]{1,5}")


# -- scalars -----------------------------------------------------------------------------------


#: Calico's NumOrString: a JSON number or a string, never a bool (Kubernetes' IntOrString)
NumOrString = IntOrString


def protocol_number(value: int | str) -> int:
    """A validated ``protocol`` as its IP protocol number."""
    return value if isinstance(value, int) else PROTOCOLS[value]


def _check_protocol(value: int | str | None, *path: PathPart) -> None:
    if value is None:
        return
    if isinstance(value, int):
        if not 1 <= value <= 255:
            raise FieldError("protocol number must be between 1 and 255", *path, value=value)
    elif value not in PROTOCOLS:
        raise FieldError(
            f"must be a protocol number (1-255) or one of {', '.join(PROTOCOLS)}",
            *path,
            value=value,
        )


class PortMatch(NamedTuple):
    """One entry of ``ports``/``notPorts``: a range ``first``-``last`` (inclusive; one port:
    both equal), or a named port (``name``, resolved per endpoint)."""

    first: int = 0
    last: int = 0
    name: str | None = None


def parse_port(value: int | str) -> PortMatch:
    """``80``, ``"80"``, ``"8000:8080"`` or a port name (raises ``ValueError``, its message
    the reason)."""
    if isinstance(value, int):
        first = last = value
    elif _NUMBER.fullmatch(value):
        first = last = int(value)
    elif ":" in value:
        head, _, tail = value.partition(":")
        if not (_NUMBER.fullmatch(head) and _NUMBER.fullmatch(tail)):
            raise ValueError('a port range is "first:last", two numbers')
        first, last = int(head), int(tail)
        if first > last:
            raise ValueError("port range invalid: the first port is after the last")
    else:
        why = names.port_name(value)
        if why is not None:
            raise ValueError(f"not a port number, range or name: {why}")
        return PortMatch(name=value)
    if not (1 <= first <= 65535 and 1 <= last <= 65535):
        raise ValueError("port number must be between 1 and 65535")
    return PortMatch(first, last)


def _check_ports(ports: list[int | str] | None, *path: PathPart) -> None:
    for i, port in enumerate(ports or ()):
        try:
            parse_port(port)
        except ValueError as e:
            raise FieldError(str(e), *path, i, value=port) from None


def _network(text: str, *path: PathPart) -> IPNetwork:
    """A CIDR without host bits, or an address alone (a /32 or /128), as Calico takes
    ``nets``."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError:
        raise FieldError(
            "must be a CIDR without host bits (e.g. 10.0.0.0/8, fd00::/8) or an IP address",
            *path,
            value=text,
        ) from None


def _unsupported(value: object, what: str, *path: PathPart) -> None:
    if value is not None:
        raise FieldError(f"Forbidden: {what} (tabby does not enforce it)", *path)


# -- rules -------------------------------------------------------------------------------------


class ICMPFields(StrictModel):
    """``type`` (0-254) and ``code`` (0-255) of an ICMP or ICMPv6 message; ``code`` needs
    ``type`` (Calico's rule: the kernel matches a code only with its type)."""

    type: int | None = None
    code: int | None = None

    @model_validator(mode="after")
    def _rules(self) -> ICMPFields:
        if self.type is not None and not 0 <= self.type <= ICMP_TYPE_MAX:
            raise FieldError(f"must be between 0 and {ICMP_TYPE_MAX}", "type", value=self.type)
        if self.code is not None:
            if self.type is None:
                raise FieldError("Forbidden: ICMP code specified without an ICMP type", "code")
            if not 0 <= self.code <= ICMP_CODE_MAX:
                raise FieldError(f"must be between 0 and {ICMP_CODE_MAX}", "code", value=self.code)
        return self


class ServiceAccountMatch(StrictModel):
    """Endpoints by service account: ``names`` (any of them) and/or a ``selector`` over the
    accounts' labels; both given: both must hold."""

    names: list[str] | None = None
    selector: str | None = None

    @model_validator(mode="after")
    def _rules(self) -> ServiceAccountMatch:
        for i, name in enumerate(self.names or ()):
            why = names.dns1123_subdomain(name)
            if why is not None:
                raise FieldError(why, "names", i, value=name)
        _selector(self.selector, "selector")
        return self


class EntityRule(StrictModel):
    """A rule's ``source`` or ``destination``: all given fields must match.

    ``nets``/``notNets``: CIDRs (or addresses) the peer is / is not in; ``selector``/
    ``notSelector``: endpoints and network sets by label; ``namespaceSelector``: their
    namespaces (``global()`` alone: only global objects, host endpoints and global network
    sets; without it a namespaced policy's selectors stay in its own namespace);
    ``ports``/``notPorts``: numbers, ``"first:last"`` ranges or named ports (only with
    protocol TCP, UDP or SCTP); ``serviceAccounts``: by service account.
    """

    nets: list[str] | None = None
    notNets: list[str] | None = None
    selector: str | None = None
    notSelector: str | None = None
    namespaceSelector: str | None = None
    ports: list[NumOrString] | None = None
    notPorts: list[NumOrString] | None = None
    serviceAccounts: ServiceAccountMatch | None = None
    services: dict[str, object] | None = None

    @model_validator(mode="after")
    def _rules(self) -> EntityRule:
        for field in ("nets", "notNets"):
            for i, text in enumerate(getattr(self, field) or ()):
                _network(text, field, i)
        _selector(self.selector, "selector")
        _selector(self.notSelector, "notSelector")
        ns = self.namespaceSelector
        _selector(ns, "namespaceSelector", allow_global=True)
        if ns is not None and "global()" in ns and ns.strip() != "global()":
            raise FieldError(
                "global() cannot be combined with other selectors", "namespaceSelector", value=ns
            )
        _check_ports(self.ports, "ports")
        _check_ports(self.notPorts, "notPorts")
        _unsupported(self.services, "Kubernetes Service matches", "services")
        return self

    def networks(self, field: str = "nets") -> list[IPNetwork]:
        """``nets`` or ``notNets`` as networks (an address alone: its /32 or /128)."""
        return [ipaddress.ip_network(t) for t in getattr(self, field) or ()]


class RuleMetadata(StrictModel):
    """Annotations of a rule (carried, not interpreted)."""

    annotations: Annotations | None = None


class Rule(StrictModel):
    """One ingress or egress rule: ``action`` when everything given matches.

    ``Allow``/``Deny`` decide; ``Log`` logs to the policy log and goes on to the next rule;
    ``Pass`` skips the rest of the tier (on to the next tier, as Calico).
    ``protocol``/``notProtocol``: a name (TCP, UDP, ICMP, ICMPv6, SCTP, UDPLite) or a
    number 1-255; ``icmp``/``notICMP``: type and code (with ICMP/ICMPv6); ``ipVersion``: 4
    or 6; ``metadata``: annotations, carried.
    """

    action: Action
    ipVersion: Literal[4, 6] | None = None
    protocol: NumOrString | None = None
    notProtocol: NumOrString | None = None
    icmp: ICMPFields | None = None
    notICMP: ICMPFields | None = None
    source: EntityRule = Field(default_factory=EntityRule)
    destination: EntityRule = Field(default_factory=EntityRule)
    metadata: RuleMetadata | None = None
    http: dict[str, object] | None = None

    @model_validator(mode="after")
    def _rules(self) -> Rule:
        _check_protocol(self.protocol, "protocol")
        _check_protocol(self.notProtocol, "notProtocol")
        _unsupported(self.http, "application-layer (HTTP) matches", "http")
        proto = None if self.protocol is None else protocol_number(self.protocol)
        if proto not in PORT_PROTOCOLS:
            for side in ("source", "destination"):
                entity: EntityRule = getattr(self, side)
                for field in ("ports", "notPorts"):
                    if getattr(entity, field):
                        raise FieldError(
                            "Forbidden: rules that specify ports must set protocol to TCP, "
                            "UDP or SCTP",
                            side,
                            field,
                        )
        for field in ("icmp", "notICMP"):
            if getattr(self, field) is not None and proto not in ICMP_VERSION:
                raise FieldError(
                    "Forbidden: rules that specify ICMP fields must set protocol to ICMP or ICMPv6",
                    field,
                )
        for field in ("protocol", "notProtocol"):
            value = getattr(self, field)
            version = None if value is None else ICMP_VERSION.get(protocol_number(value))
            if version is not None and self.ipVersion not in (None, version):
                raise FieldError(
                    f"must be {version} with protocol {show(value)}",
                    "ipVersion",
                    value=self.ipVersion,
                )
        self._check_nets()
        return self

    def _check_nets(self) -> None:
        """Every CIDR of the rule of one IP version, ``ipVersion``'s when given."""
        seen: set[int] = set()
        for side in ("source", "destination"):
            entity: EntityRule = getattr(self, side)
            for field in ("nets", "notNets"):
                versions = {n.version for n in entity.networks(field)}
                if self.ipVersion is not None and versions - {self.ipVersion}:
                    raise FieldError(
                        f"rule IP version doesn't match CIDR version (ipVersion is "
                        f"{self.ipVersion})",
                        side,
                        field,
                    )
                seen |= versions
                if len(seen) > 1:
                    raise FieldError("rule contains both IPv4 and IPv6 CIDRs", side, field)

    @property
    def protocol_number(self) -> int | None:
        return None if self.protocol is None else protocol_number(self.protocol)

    @property
    def not_protocol_number(self) -> int | None:
        return None if self.notProtocol is None else protocol_number(self.notProtocol)


# -- policies ----------------------------------------------------------------------------------


def default_types(
    types: list[PolicyType] | None, ingress: list[Rule] | None, egress: list[Rule] | None
) -> list[PolicyType]:
    """Calico's defaulting of ``types``: as given, else ``[Egress]`` for egress rules alone,
    ``[Ingress, Egress]`` for both, ``[Ingress]`` otherwise (also with no rules at all)."""
    if types:
        return types
    if not egress:
        return ["Ingress"]
    if not ingress:
        return ["Egress"]
    return ["Ingress", "Egress"]


class PolicySpec(StrictModel):
    """What every Calico policy kind has.

    ``tier`` (default ``default``); ``order``: lower first, none = after every ordered one
    (then by name); ``selector``: the endpoints it applies to (empty: all); ``types``:
    ``Ingress``/``Egress`` (defaulted, see :func:`default_types`); ``ingress``/``egress``:
    the rules, in order; ``serviceAccountSelector``: only endpoints whose service account
    it selects; ``performanceHints``: accepted, no effect in tabby.
    """

    tier: str = DEFAULT_TIER
    order: float | None = None
    selector: str | None = None
    types: list[PolicyType] | None = None
    ingress: list[Rule] | None = None
    egress: list[Rule] | None = None
    serviceAccountSelector: str | None = None
    performanceHints: list[Literal["AssumeNeededOnEveryNode"]] | None = None

    @model_validator(mode="after")
    def _policy(self) -> PolicySpec:
        why = names.dns1123_label(self.tier)
        if why is not None:
            raise FieldError(why, "tier", value=self.tier)
        if self.order is not None and not math.isfinite(self.order):
            raise FieldError("must be a finite number", "order", value=self.order)
        _selector(self.selector, "selector")
        _selector(self.serviceAccountSelector, "serviceAccountSelector")
        seen: set[str] = set()
        for i, t in enumerate(self.types or ()):
            if t in seen:
                raise FieldError(f"'{t}' type specified more than once", "types", i, value=t)
            seen.add(t)
        self.types = default_types(self.types, self.ingress, self.egress)
        return self

    @property
    def sort_order(self) -> float:
        """``order``, none as infinity (last)."""
        return math.inf if self.order is None else self.order


class NetworkPolicySpec(PolicySpec):
    """A namespaced policy: applies to the endpoints of its namespace its selector selects."""


class GlobalNetworkPolicySpec(PolicySpec):
    """Cluster-wide: ``namespaceSelector`` limits it to the namespaces it selects (then it
    applies to no host endpoint); ``doNotTrack`` (rules before connection tracking, both
    directions of a flow need their own rule), ``preDNAT`` (ingress rules before DNAT, for
    host endpoints) and ``applyOnForward`` (also traffic the host forwards) as Calico
    defines them: ``preDNAT`` not with ``doNotTrack`` nor with egress, and either needs
    ``applyOnForward``."""

    namespaceSelector: str | None = None
    doNotTrack: bool = False
    preDNAT: bool = False
    applyOnForward: bool = False

    @model_validator(mode="after")
    def _global(self) -> GlobalNetworkPolicySpec:
        _selector(self.namespaceSelector, "namespaceSelector")
        if self.preDNAT:
            if self.doNotTrack:
                raise FieldError("Forbidden: preDNAT and doNotTrack cannot both be true", "preDNAT")
            if self.egress:
                raise FieldError("Forbidden: a preDNAT policy cannot have egress rules", "egress")
            if "Egress" in (self.types or ()):
                raise FieldError("Forbidden: a preDNAT policy cannot have type Egress", "types")
        if (self.preDNAT or self.doNotTrack) and not self.applyOnForward:
            # named at the field set, as the API server's schema names it
            flag = "preDNAT" if self.preDNAT else "doNotTrack"
            raise FieldError(f"Forbidden: {flag} requires applyOnForward: true", flag)
        return self


def policy_name(name: str) -> str | None:
    """A policy name (Calico's): a DNS-1123 label, or two joined by one ``.`` (the first
    the tier's name), at most 253 characters; not one of the prefixes Calico keeps."""
    if len(name) > names.DNS1123_SUBDOMAIN_MAX:
        return f"must be no more than {names.DNS1123_SUBDOMAIN_MAX} characters"
    if any(name.startswith(p) for p in RESERVED_PREFIXES):
        return "the prefixes knp.default. and ossg.default. are reserved for derived policies"
    parts = name.split(".")
    if len(parts) > 2 or any(names.dns1123_label(p) is not None for p in parts):
        return (
            "must be a lowercase RFC 1123 label (lower case alphanumeric characters or '-', "
            "alphanumeric ends), optionally prefixed by its tier's name and '.'"
        )
    return None


def _check_tier_prefix(name: str, tier: str) -> None:
    """Calico's rule: a policy in a tier other than ``default`` is named ``<tier>.<name>``;
    one in ``default`` may be prefixed ``default.`` only."""
    head, dot, _ = name.partition(".")
    if tier != DEFAULT_TIER and head != tier:
        raise FieldError(
            f"a policy in tier {show(tier)} must be named {tier}.<name>",
            "metadata",
            "name",
            value=name,
        )
    if tier == DEFAULT_TIER and dot and head != DEFAULT_TIER:
        raise FieldError(
            f"the prefix {show(head)} names another tier than the policy's ({DEFAULT_TIER}); "
            f"set spec.tier: {head}",
            "metadata",
            "name",
            value=name,
        )


class CalicoPolicy(Resource):
    """The base of Calico's policy kinds (NetworkPolicy, GlobalNetworkPolicy and their staged
    kinds): the name rule, the tier prefix, and where a policy comes in its tier."""

    API_VERSION: ClassVar[str] = TABBY_API_VERSION
    ACCEPTED_API_VERSIONS: ClassVar[tuple[str, ...]] = (CALICO_API_VERSION,)
    NAME_RULE: ClassVar[Callable[[str], str | None]] = staticmethod(policy_name)

    spec: PolicySpec

    @model_validator(mode="after")
    def _tier_prefix(self) -> CalicoPolicy:
        _check_tier_prefix(self.name, self.spec.tier)
        return self

    @property
    def sort_key(self) -> tuple[float, str]:
        """Where the policy comes in its tier: by ``order`` (none last), then by name."""
        return (self.spec.sort_order, self.name)


class CalicoNetworkPolicy(CalicoPolicy):
    """Calico's namespaced NetworkPolicy (``tabby.io/v1`` or ``projectcalico.org/v3``)."""

    KIND: ClassVar[str] = "NetworkPolicy"
    NAMESPACED: ClassVar[bool] = True

    spec: NetworkPolicySpec = Field(default_factory=NetworkPolicySpec)


class GlobalNetworkPolicy(CalicoPolicy):
    KIND: ClassVar[str] = "GlobalNetworkPolicy"

    spec: GlobalNetworkPolicySpec = Field(default_factory=GlobalNetworkPolicySpec)


# -- staged policies ---------------------------------------------------------------------------


def _staged_delete(data: object, keep: tuple[str, ...]) -> object:
    """A staged ``Delete`` says only which policy it would delete: its spec holds nothing but
    ``stagedAction`` and the fields in ``keep`` (its tier, and the fields defaulting fills
    in, so that the defaulted form reads back)."""
    if isinstance(data, dict) and data.get("stagedAction") == "Delete":
        extra = sorted(k for k in data if k not in ("stagedAction", *keep))
        if extra:
            raise FieldError(
                f"Forbidden: with stagedAction Delete the spec holds only "
                f"{', '.join(('stagedAction', *keep))}",
                extra[0],
            )
    return data


class StagedNetworkPolicySpec(NetworkPolicySpec):
    """A NetworkPolicy's spec plus ``stagedAction``: ``Set`` (what the policy would do) or
    ``Delete`` (what deleting the enforced policy of the same name would do; the spec then
    holds only ``tier``)."""

    stagedAction: StagedAction = "Set"

    @model_validator(mode="before")
    @classmethod
    def _delete(cls, data: object) -> object:
        return _staged_delete(data, ("tier", "types"))


class StagedGlobalNetworkPolicySpec(GlobalNetworkPolicySpec):
    """A GlobalNetworkPolicy's spec plus ``stagedAction`` (as StagedNetworkPolicy's)."""

    stagedAction: StagedAction = "Set"

    @model_validator(mode="before")
    @classmethod
    def _delete(cls, data: object) -> object:
        return _staged_delete(data, ("tier", "types"))


class StagedNetworkPolicy(CalicoPolicy):
    KIND: ClassVar[str] = "StagedNetworkPolicy"
    NAMESPACED: ClassVar[bool] = True

    spec: StagedNetworkPolicySpec = Field(default_factory=StagedNetworkPolicySpec)


class StagedGlobalNetworkPolicy(CalicoPolicy):
    KIND: ClassVar[str] = "StagedGlobalNetworkPolicy"

    spec: StagedGlobalNetworkPolicySpec = Field(default_factory=StagedGlobalNetworkPolicySpec)


class StagedKubernetesNetworkPolicySpec(KubernetesNetworkPolicySpec):
    """A Kubernetes NetworkPolicy's spec (its defaulting and validation) plus
    ``stagedAction``; with ``Delete`` the spec holds nothing else."""

    stagedAction: StagedAction = "Set"

    @model_validator(mode="before")
    @classmethod
    def _delete(cls, data: object) -> object:
        return _staged_delete(data, ("podSelector", "policyTypes"))


class StagedKubernetesNetworkPolicy(Resource):
    """A staged Kubernetes NetworkPolicy: evaluated like one in tier ``default`` at order
    1000, never enforced."""

    API_VERSION: ClassVar[str] = TABBY_API_VERSION
    ACCEPTED_API_VERSIONS: ClassVar[tuple[str, ...]] = (CALICO_API_VERSION,)
    KIND: ClassVar[str] = "StagedKubernetesNetworkPolicy"
    NAMESPACED: ClassVar[bool] = True

    spec: StagedKubernetesNetworkPolicySpec = Field(
        default_factory=StagedKubernetesNetworkPolicySpec
    )


# -- tiers -------------------------------------------------------------------------------------


class TierSpec(StrictModel):
    """``order``: lower first (none: after every ordered tier); ``defaultAction``: what
    becomes of traffic to or from an endpoint some policy of the tier selects when no rule
    of the tier decides it: ``Deny`` (default) or ``Pass`` (on to the next tier)."""

    order: float | None = None
    defaultAction: TierAction = "Deny"

    @model_validator(mode="after")
    def _rules(self) -> TierSpec:
        if self.order is not None and not math.isfinite(self.order):
            raise FieldError("must be a finite number", "order", value=self.order)
        return self


class Tier(Resource):
    """A tier of policies. Its name is a DNS-1123 label (no dot: it prefixes its policies'
    names). Tier ``default`` always exists (order 1000000, which it must keep if applied)."""

    API_VERSION: ClassVar[str] = TABBY_API_VERSION
    ACCEPTED_API_VERSIONS: ClassVar[tuple[str, ...]] = (CALICO_API_VERSION,)
    KIND: ClassVar[str] = "Tier"
    NAME_RULE: ClassVar[Callable[[str], str | None]] = staticmethod(names.dns1123_label)

    spec: TierSpec = Field(default_factory=TierSpec)

    @model_validator(mode="after")
    def _default_tier(self) -> Tier:
        if self.metadata.name == DEFAULT_TIER:
            if self.spec.order is None:
                self.spec.order = DEFAULT_TIER_ORDER
            elif self.spec.order != DEFAULT_TIER_ORDER:
                raise FieldError(
                    f"the default tier's order must be {DEFAULT_TIER_ORDER:g}",
                    "spec",
                    "order",
                    value=self.spec.order,
                )
        return self

    @property
    def sort_key(self) -> tuple[float, str]:
        """Where the tier comes: by ``order`` (none last), then by name."""
        order = self.spec.order
        return (math.inf if order is None else order, self.name)


def default_tier() -> Tier:
    """Tier ``default`` as it is when nobody applied one."""
    return Tier.model_validate(
        {"apiVersion": TABBY_API_VERSION, "kind": "Tier", "metadata": {"name": DEFAULT_TIER}}
    )


# -- network sets ------------------------------------------------------------------------------


class NetworkSetSpec(StrictModel):
    """``nets``: CIDRs or addresses (host bits allowed, as Calico takes them); a rule's
    ``selector`` matching the set's labels matches these addresses."""

    nets: list[str] | None = None

    @model_validator(mode="after")
    def _rules(self) -> NetworkSetSpec:
        for i, text in enumerate(self.nets or ()):
            try:
                ipaddress.ip_network(text, strict=False)
            except ValueError:
                raise FieldError(
                    "must be a CIDR (e.g. 10.0.0.0/8, fd00::/8) or an IP address",
                    "nets",
                    i,
                    value=text,
                ) from None
        return self

    def networks(self) -> list[IPNetwork]:
        """``nets`` as networks (host bits dropped)."""
        return [ipaddress.ip_network(t, strict=False) for t in self.nets or ()]


class _NetworkSet(Resource):
    API_VERSION: ClassVar[str] = TABBY_API_VERSION
    ACCEPTED_API_VERSIONS: ClassVar[tuple[str, ...]] = (CALICO_API_VERSION,)

    spec: NetworkSetSpec = Field(default_factory=NetworkSetSpec)

    @model_validator(mode="after")
    def _labels(self) -> _NetworkSet:
        if NAMESPACE_LABEL in (self.metadata.labels or {}):
            raise FieldError(
                f"{NAMESPACE_LABEL} is not a valid label name (it is derived from the namespace)",
                "metadata",
                "labels",
            )
        return self


class NetworkSet(_NetworkSet):
    """A namespaced set of networks, selected by the rules of its namespace's policies
    (and by global policies whose rule's namespaceSelector selects its namespace)."""

    KIND: ClassVar[str] = "NetworkSet"
    NAMESPACED: ClassVar[bool] = True


class GlobalNetworkSet(_NetworkSet):
    """A cluster-wide set of networks (``global()`` in a rule's namespaceSelector selects
    it)."""

    KIND: ClassVar[str] = "GlobalNetworkSet"


# -- host endpoints ----------------------------------------------------------------------------


class EndpointPort(StrictModel):
    """A named port of a host endpoint (what a rule's named port resolves to on it)."""

    name: str
    protocol: Literal["TCP", "UDP", "SCTP"]
    port: int

    @model_validator(mode="after")
    def _rules(self) -> EndpointPort:
        why = names.port_name(self.name)
        if why is not None:
            raise FieldError(why, "name", value=self.name)
        if not 1 <= self.port <= 65535:
            raise FieldError("must be between 1 and 65535", "port", value=self.port)
        return self


class HostEndpointSpec(StrictModel):
    """``node``: the node it is on; ``interfaceName``: the interface (``*``: all of the
    node's interfaces, then policy applies to traffic to and from the host itself);
    ``expectedIPs``: its addresses (policy peers match on them; one of the two fields at
    least); ``profiles``: profile names (carried); ``ports``: named ports."""

    node: str
    interfaceName: str | None = None
    expectedIPs: list[str] | None = None
    profiles: list[str] | None = None
    ports: list[EndpointPort] | None = None

    @model_validator(mode="after")
    def _rules(self) -> HostEndpointSpec:
        why = names.dns1123_subdomain(self.node)
        if why is not None:
            raise FieldError(why, "node", value=self.node)
        iface = self.interfaceName
        if iface is not None and iface != "*" and not INTERFACE.fullmatch(iface):
            raise FieldError(
                'must be "*" or an interface name (at most 15 of [a-zA-Z0-9_.-])',
                "interfaceName",
                value=iface,
            )
        if not iface and not self.expectedIPs:
            raise FieldError(
                "Required value: no interface or expected IPs have been specified",
                "interfaceName",
            )
        for i, text in enumerate(self.expectedIPs or ()):
            try:
                ipaddress.ip_address(text)
            except ValueError:
                raise FieldError("must be an IP address", "expectedIPs", i, value=text) from None
        seen: set[str] = set()
        for i, port in enumerate(self.ports or ()):
            if port.name in seen:
                raise FieldError("Duplicate value", "ports", i, "name", value=port.name)
            seen.add(port.name)
        return self

    @property
    def all_interfaces(self) -> bool:
        return self.interfaceName == "*"


class HostEndpoint(Resource):
    API_VERSION: ClassVar[str] = TABBY_API_VERSION
    ACCEPTED_API_VERSIONS: ClassVar[tuple[str, ...]] = (CALICO_API_VERSION,)
    KIND: ClassVar[str] = "HostEndpoint"

    spec: HostEndpointSpec


#: every Calico kind's model (what ``resources.storage`` registers)
CALICO_MODELS: tuple[type[Resource], ...] = (
    CalicoNetworkPolicy,
    GlobalNetworkPolicy,
    StagedNetworkPolicy,
    StagedGlobalNetworkPolicy,
    StagedKubernetesNetworkPolicy,
    Tier,
    NetworkSet,
    GlobalNetworkSet,
    HostEndpoint,
)
