"""The NetworkPolicy engine: Kubernetes ``networking.k8s.io/v1`` semantics, pure and typed.

Inputs are small frozen value types (:class:`Policy`, :class:`Namespace`, :class:`Pod`,
:class:`Endpoint`, gathered in a :class:`ClusterState`); the resource models are converted
into them by :mod:`policy.inputs`. Two outputs:

* :func:`compute` -> :class:`DesiredState`, the intermediate representation the nftables
  dataplane programs. It is built for incremental updates:

  - every distinct peer selector (namespace scope + pod selector) is one named *address set*
    per family whose elements are the matching pods' addresses, so pod churn and label
    changes change set elements, never rules;
  - every ``ipBlock`` is one interval set (``cidr`` minus its ``except`` entries);
  - every container-port name a policy uses is one set of ``address . protocol . port``
    tuples over all pods that declare it (ingress matches it against the destination, i.e.
    the selected local pod; egress against the destination too, i.e. the peer pod);
  - every policy has one chain per direction, shared by all local endpoints it selects;
  - every local endpoint has one ingress and one egress program: ``None`` (not isolated:
    everything allowed) or the tuple of policy chains to try before dropping.

  Names are derived from content (hash of the selector / of the policy's identity), so two
  computations of the same cluster give equal states and a difference is exactly the change.
* :func:`explain` (and :func:`allowed`): the decision for one (source, destination, port,
  protocol), evaluated directly from the policies, with which policies select each side and
  which rule allowed it, for ``tabbyctl policy explain``. :meth:`DesiredState.evaluate`
  evaluates the IR itself for the same question (tests compare both).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import ipaddress
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

from bundle.calico import KUBERNETES_POLICY_ORDER, KUBERNETES_POLICY_PREFIX, endpoint_labels
from bundle.types import IPAddress, IPNetwork
from policy.calico import (
    DEFAULT_TIER,
    DEFAULT_TIER_ORDER,
    Action,
    CalicoPolicy,
    CalicoRule,
    EntityMatch,
    FailsafePort,
    Failsafes,
    HostEndpoint,
    Matcher,
    NetworkSet,
    Packet,
    Party,
    PolicyStage,
    Tier,
    TierAction,
    policy_sort_key,
    protocol_number,
    rule_matches,
    tier_sort_key,
)

Protocol = Literal["TCP", "UDP", "SCTP"]
PROTOCOLS: tuple[Protocol, ...] = ("TCP", "UDP", "SCTP")
Direction = Literal["ingress", "egress"]
Operator = Literal["In", "NotIn", "Exists", "DoesNotExist"]
Family = Literal[4, 6]
Labels = tuple[tuple[str, str], ...]

_DIRECTIONS: tuple[Direction, Direction] = ("ingress", "egress")
_ICMP: Mapping[int, int] = {4: 1, 6: 58}

#: The label every namespace carries (Kubernetes sets it; tabby does too, applied or not).
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"


def _labels(value: Mapping[str, str] | Iterable[tuple[str, str]]) -> Labels:
    items = value.items() if isinstance(value, Mapping) else value
    labels = tuple(sorted((str(k), str(v)) for k, v in items))
    # already so (another node's records, ``resources.remote``): shared, not copied
    return value if isinstance(value, tuple) and value == labels else labels


def _digest(text: str) -> str:
    return hashlib.blake2s(text.encode(), digest_size=6).hexdigest()


# --- inputs ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Requirement:
    """One ``matchExpressions`` entry."""

    key: str
    operator: Operator
    values: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.operator not in ("In", "NotIn", "Exists", "DoesNotExist"):
            raise ValueError(f"unknown selector operator {self.operator!r}")
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        object.__setattr__(self, "values", tuple(sorted(set(self.values))))

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "In":
            return labels.get(self.key) in self.values
        if self.operator == "NotIn":
            # Kubernetes: NotIn also matches when the key is absent.
            return labels.get(self.key) not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels

    def text(self) -> str:
        if self.operator == "Exists":
            return self.key
        if self.operator == "DoesNotExist":
            return f"!{self.key}"
        op = "in" if self.operator == "In" else "notin"
        return f"{self.key} {op} ({','.join(self.values)})"


@dataclasses.dataclass(frozen=True)
class LabelSelector:
    """A Kubernetes label selector; the empty selector matches everything."""

    match_labels: Labels = ()
    match_expressions: tuple[Requirement, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "match_labels", _labels(self.match_labels))
        exprs = sorted(set(self.match_expressions), key=lambda r: (r.key, r.operator, r.values))
        object.__setattr__(self, "match_expressions", tuple(exprs))
        object.__setattr__(self, "_required", frozenset(self.match_labels))

    @classmethod
    def of(cls, labels: Mapping[str, str] | None = None, *exprs: Requirement) -> LabelSelector:
        return cls(_labels(labels or {}), tuple(exprs))

    @property
    def empty(self) -> bool:
        return not self.match_labels and not self.match_expressions

    def matches(self, labels: Mapping[str, str], items: frozenset[tuple[str, str]]) -> bool:
        """``labels`` and its ``items()`` as a frozenset (callers compute both once)."""
        required: frozenset[tuple[str, str]] = self._required  # type: ignore[attr-defined]
        if not required <= items:
            return False
        return all(r.matches(labels) for r in self.match_expressions)

    def text(self) -> str:
        """Canonical text (``kubectl``'s selector syntax); ``""`` for the empty selector."""
        parts = [f"{k}={v}" for k, v in self.match_labels]
        parts += [r.text() for r in self.match_expressions]
        return ",".join(parts)


EVERYTHING = LabelSelector()


@dataclasses.dataclass(frozen=True)
class IPBlock:
    cidr: str
    except_: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        net = ipaddress.ip_network(self.cidr, strict=False)
        excepts = [ipaddress.ip_network(e, strict=False) for e in self.except_]
        for e in excepts:
            if e.version != net.version:
                raise ValueError(f"ipBlock except {e} is not of the family of {net}")
        object.__setattr__(self, "cidr", str(net))
        object.__setattr__(self, "except_", tuple(sorted({str(e) for e in excepts})))

    @property
    def network(self) -> IPNetwork:
        return ipaddress.ip_network(self.cidr)

    @property
    def family(self) -> Family:
        return 4 if self.network.version == 4 else 6

    def contains(self, addr: IPAddress) -> bool:
        if addr not in self.network:
            return False
        return not any(addr in ipaddress.ip_network(e) for e in self.except_)

    def prefixes(self) -> tuple[IPNetwork, ...]:
        """``cidr`` minus every ``except``, as disjoint prefixes (an interval set's elements)."""
        nets: list[IPNetwork] = [self.network]
        for raw in self.except_:
            exc = ipaddress.ip_network(raw)
            out: list[IPNetwork] = []
            for n in nets:
                if not n.overlaps(exc):
                    out.append(n)
                elif exc.supernet_of(n):  # type: ignore[arg-type]
                    continue
                else:
                    out.extend(n.address_exclude(exc))  # type: ignore[arg-type]
            nets = out
        return tuple(sorted(nets, key=lambda n: (n.network_address, n.prefixlen)))

    def text(self) -> str:
        return self.cidr + (f" except {','.join(self.except_)}" if self.except_ else "")


@dataclasses.dataclass(frozen=True)
class Peer:
    """One entry of ``from``/``to``: selectors (AND when both are set) or an ``ipBlock``."""

    pod_selector: LabelSelector | None = None
    namespace_selector: LabelSelector | None = None
    ip_block: IPBlock | None = None

    def __post_init__(self) -> None:
        selectors = self.pod_selector is not None or self.namespace_selector is not None
        if self.ip_block is not None and selectors:
            raise ValueError("a peer with ipBlock may not have selectors")
        if self.ip_block is None and not selectors:
            raise ValueError("a peer needs podSelector, namespaceSelector or ipBlock")

    def text(self) -> str:
        if self.ip_block is not None:
            return f"ipBlock {self.ip_block.text()}"
        parts = []
        if self.namespace_selector is not None:
            parts.append(f"namespaces [{self.namespace_selector.text() or 'all'}]")
        if self.pod_selector is not None:
            parts.append(f"pods [{self.pod_selector.text() or 'all'}]")
        return " and ".join(parts)


@dataclasses.dataclass(frozen=True)
class PortSpec:
    """One entry of ``ports``: ``port`` is a number, a container-port name, or None (all)."""

    protocol: Protocol = "TCP"
    port: int | str | None = None
    end_port: int | None = None

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"unsupported protocol {self.protocol!r}")
        if isinstance(self.port, int) and not 1 <= self.port <= 65535:
            raise ValueError(f"port {self.port} out of range")
        if isinstance(self.port, str) and not self.port:
            raise ValueError("empty port name")
        if self.end_port is not None:
            if not isinstance(self.port, int):
                raise ValueError("endPort needs a numeric port")
            if not self.port <= self.end_port <= 65535:
                raise ValueError(f"endPort {self.end_port} must lie in [port, 65535]")

    def text(self) -> str:
        if self.port is None:
            return f"{self.protocol}/*"
        if self.end_port is not None and self.end_port != self.port:
            return f"{self.protocol}/{self.port}-{self.end_port}"
        return f"{self.protocol}/{self.port}"


@dataclasses.dataclass(frozen=True)
class Rule:
    """An ingress or egress rule: no peers = all peers, no ports = all ports and protocols."""

    peers: tuple[Peer, ...] = ()
    ports: tuple[PortSpec, ...] = ()


@dataclasses.dataclass(frozen=True)
class Policy:
    """A NetworkPolicy; ``policy_types`` empty means "not given": the API server's default
    (``Ingress``, plus ``Egress`` when there are egress rules) applies."""

    namespace: str
    name: str
    pod_selector: LabelSelector = EVERYTHING
    ingress: tuple[Rule, ...] = ()
    egress: tuple[Rule, ...] = ()
    policy_types: tuple[Literal["Ingress", "Egress"], ...] = ()

    def __post_init__(self) -> None:
        for t in self.policy_types:
            if t not in ("Ingress", "Egress"):
                raise ValueError(f"unknown policy type {t!r}")

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def types(self) -> frozenset[Direction]:
        if self.policy_types:
            return frozenset("ingress" if t == "Ingress" else "egress" for t in self.policy_types)
        return frozenset(("ingress", "egress") if self.egress else ("ingress",))

    def rules(self, direction: Direction) -> tuple[Rule, ...]:
        return self.ingress if direction == "ingress" else self.egress


@dataclasses.dataclass(frozen=True)
class Namespace:
    name: str
    labels: Labels = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _labels(self.labels))

    @property
    def effective_labels(self) -> dict[str, str]:
        out = dict(self.labels)
        out[NAMESPACE_NAME_LABEL] = self.name
        return out


@dataclasses.dataclass(frozen=True)
class ServiceAccount:
    """A Kubernetes ServiceAccount: its labels are what ``serviceAccountSelector`` and a
    rule's ``serviceAccounts.selector`` read on the endpoints of its pods (``pcsa.``)."""

    namespace: str
    name: str
    labels: Labels = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _labels(self.labels))

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


@dataclasses.dataclass(frozen=True, slots=True)
class ContainerPort:
    name: str
    port: int
    protocol: Protocol = "TCP"


@dataclasses.dataclass(frozen=True, slots=True)
class Pod:
    """The labels, named ports and service account a Kubernetes API server holds for a pod."""

    namespace: str
    name: str
    labels: Labels = ()
    ports: tuple[ContainerPort, ...] = ()
    service_account: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _labels(self.labels))


@dataclasses.dataclass(frozen=True, slots=True)
class Endpoint:
    """A WorkloadEndpoint: one attachment of a pod on some node. ``addresses`` are bare
    addresses or host CIDRs (``10.244.0.5`` or ``10.244.0.5/32``); ``labels`` are used when
    no :class:`Pod` with the same namespace and name is known."""

    namespace: str
    pod: str
    node: str
    interface: str
    addresses: tuple[str, ...]
    name: str = ""
    labels: Labels = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "labels", _labels(self.labels))
        addrs = tuple(str(ipaddress.ip_interface(a).ip) for a in self.addresses)
        if addrs != self.addresses:  # bare already: shared, not copied
            object.__setattr__(self, "addresses", addrs)
        if not self.name:
            object.__setattr__(self, "name", f"{self.pod}-{self.interface}")

    @property
    def key(self) -> tuple[str, str]:
        return (self.namespace, self.name)


@dataclasses.dataclass(frozen=True)
class ClusterState:
    """Everything the engine needs: all of the cluster's policies, namespaces, pods and
    endpoints (remote endpoints too: selectors resolve to their addresses); Calico's
    policies (namespaced, global, staged), network sets and tiers (:mod:`policy.calico`)."""

    policies: tuple[Policy, ...] = ()
    namespaces: tuple[Namespace, ...] = ()
    pods: tuple[Pod, ...] = ()
    endpoints: tuple[Endpoint, ...] = ()
    calico_policies: tuple[CalicoPolicy, ...] = ()
    network_sets: tuple[NetworkSet, ...] = ()
    tiers: tuple[Tier, ...] = ()
    host_endpoints: tuple[HostEndpoint, ...] = ()
    service_accounts: tuple[ServiceAccount, ...] = ()

    def with_endpoint(self, ep: Endpoint, pod: Pod | None = None) -> ClusterState:
        eps = (*(e for e in self.endpoints if e.key != ep.key), ep)
        pods = self.pods
        if pod is not None:
            pods = tuple(p for p in pods if (p.namespace, p.name) != (pod.namespace, pod.name))
            pods += (pod,)
        return dataclasses.replace(self, endpoints=eps, pods=pods)

    def without_endpoint(self, namespace: str, name: str) -> ClusterState:
        eps = tuple(e for e in self.endpoints if e.key != (namespace, name))
        return dataclasses.replace(self, endpoints=eps)


# --- resolved view ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Member:
    """An endpoint with its effective labels and named ports resolved."""

    ep: Endpoint
    labels: Mapping[str, str]
    items: frozenset[tuple[str, str]]
    ports: tuple[ContainerPort, ...]
    addresses: tuple[IPAddress, ...]
    service_account: str = ""

    @property
    def ident(self) -> str:
        return f"{self.ep.namespace}/{self.ep.pod}"


class _View:
    """The cluster indexed for selector evaluation."""

    def __init__(self, state: ClusterState) -> None:
        self.state = state
        self.ns_labels: dict[str, dict[str, str]] = {}
        for ns in state.namespaces:
            self.ns_labels[ns.name] = ns.effective_labels
        pods = {(p.namespace, p.name): p for p in state.pods}
        self.members: list[_Member] = []
        self.by_ns: dict[str, list[_Member]] = {}
        self.by_addr: dict[IPAddress, _Member] = {}
        cache: dict[Labels, tuple[dict[str, str], frozenset[tuple[str, str]]]] = {}
        for ep in sorted(state.endpoints, key=lambda e: e.key):
            pod = pods.get((ep.namespace, ep.pod))
            raw = pod.labels if pod is not None else ep.labels
            if raw not in cache:
                cache[raw] = (dict(raw), frozenset(raw))
            labels, items = cache[raw]
            addrs = tuple(ipaddress.ip_address(a) for a in ep.addresses)
            ports = pod.ports if pod is not None else ()
            account = pod.service_account if pod is not None else ""
            m = _Member(ep, labels, items, ports, addrs, account)
            self.members.append(m)
            self.by_ns.setdefault(ep.namespace, []).append(m)
            for a in addrs:
                self.by_addr[a] = m
            if ep.namespace not in self.ns_labels:
                self.ns_labels[ep.namespace] = {NAMESPACE_NAME_LABEL: ep.namespace}
        self._ns_items = {k: frozenset(v.items()) for k, v in self.ns_labels.items()}
        self.account_labels = {
            (a.namespace, a.name): dict(a.labels) for a in state.service_accounts
        }
        self._calico_labels: dict[int, dict[str, str]] = {}
        self.network_sets = [
            (s.networks(), network_set_labels(s, self.ns_labels))
            for s in sorted(state.network_sets, key=lambda s: s.key)
        ]
        self._tiers: dict[str, Tier] = {}
        for t in state.tiers:
            self._tiers.setdefault(t.name, t)
        #: every node's host endpoints, with the labels selectors read on them
        hosts = sorted(state.host_endpoints, key=lambda h: h.key)
        self.hosts = [(h, host_labels(h)) for h in hosts]
        self.host_by_addr: dict[IPAddress, tuple[HostEndpoint, Mapping[str, str]]] = {}
        for h, selected_by in self.hosts:
            for text in h.expected_ips:
                self.host_by_addr.setdefault(ipaddress.ip_address(text), (h, selected_by))

    def _scoped(
        self, labels: Mapping[str, str], ns: str | None, account: str | None
    ) -> dict[str, str]:
        ns_labels = self.ns_labels.get(ns, {NAMESPACE_NAME_LABEL: ns}) if ns is not None else None
        account_labels = (
            self.account_labels.get((ns, account)) if ns is not None and account else None
        )
        return endpoint_labels(
            labels,
            namespace=ns,
            namespace_labels=ns_labels,
            service_account=account,
            service_account_labels=account_labels,
        )

    def calico_labels(self, m: _Member) -> Mapping[str, str]:
        """The labels Calico's selectors read on an endpoint (its namespace's under
        ``pcns.``, its service account's under ``pcsa.``)."""
        got = self._calico_labels.get(id(m))
        if got is None:
            got = self._scoped(m.labels, m.ep.namespace, m.service_account or None)
            self._calico_labels[id(m)] = got
        return got

    def party(self, m: _Member | None, addr: IPAddress) -> Party:
        """One end of a packet as Calico's rules see it."""
        sets = tuple(labels for nets, labels in self.network_sets if any(addr in n for n in nets))
        if m is None:
            host = self.host_by_addr.get(addr)
            return Party(addr, host[1] if host is not None else None, sets)
        ports = tuple((cp.name, protocol_number(cp.protocol), cp.port) for cp in m.ports)
        return Party(addr, self.calico_labels(m), sets, ports)

    def tier(self, name: str) -> Tier:
        return resolve_tier(self._tiers, name)

    def ns_matches(self, sel: LabelSelector, ns: str) -> bool:
        labels = self.ns_labels.get(ns, {NAMESPACE_NAME_LABEL: ns})
        items = self._ns_items.get(ns, frozenset(labels.items()))
        return sel.matches(labels, items)

    def namespaces(self) -> list[str]:
        return sorted(self.by_ns)


def resolve_tier(tiers: Mapping[str, Tier], name: str) -> Tier:
    """A tier by name: a Tier resource's, ``default``'s defaults, or (a policy naming a
    tier that does not exist) last, ending in Deny: never open by a missing tier. The
    ``default`` tier always ends in Deny, as in Calico: what isolates a pod under a
    Kubernetes NetworkPolicy cannot be passed on by a Tier resource."""
    t = tiers.get(name)
    if t is not None:
        return t if name != DEFAULT_TIER else dataclasses.replace(t, default_action="Deny")
    return Tier(name, DEFAULT_TIER_ORDER if name == DEFAULT_TIER else None, "Deny")


def host_labels(h: HostEndpoint) -> Mapping[str, str]:
    """The labels Calico's selectors read on a host endpoint."""
    return endpoint_labels(dict(h.labels))


def network_set_labels(s: NetworkSet, ns_labels: Mapping[str, Mapping[str, str]]) -> dict[str, str]:
    """The labels Calico's selectors read on a network set (a namespaced one's namespace's
    under ``pcns.``; ``ns_labels``: the effective labels of the namespaces by name)."""
    ns = s.namespace
    scope = ns_labels.get(ns, {NAMESPACE_NAME_LABEL: ns}) if ns is not None else None
    return endpoint_labels(dict(s.labels), namespace=ns, namespace_labels=scope)


def _member_matches_peer(view: _View, pol: Policy, peer: Peer, m: _Member) -> bool:
    """Selector peers only (an ipBlock is matched by address)."""
    scope = pol.namespace if peer.namespace_selector is None else peer.namespace_selector
    sel = peer.pod_selector if peer.pod_selector is not None else EVERYTHING
    return _in_scope(view, scope, sel, m)


def _in_scope(view: _View, scope: str | LabelSelector, pods: LabelSelector, m: _Member) -> bool:
    """``m`` is a member of a peer selector's pods: in the namespace ``scope`` (a name, or a
    namespace selector) and matched by ``pods``."""
    if isinstance(scope, str):
        if m.ep.namespace != scope:
            return False
    elif not view.ns_matches(scope, m.ep.namespace):
        return False
    return pods.matches(m.labels, m.items)


def _contributes(view: _View, d: SetDef, m: _Member) -> bool:
    """``m`` gives elements to the set ``d`` (one with addresses: an ``addr`` or ``sel``
    set's selector matches it, or it declares a ``named-port`` set's port name). ``cidr``
    and ``selnet`` sets hold no endpoint."""
    if not m.addresses:
        return False
    if d.kind == "addr":
        assert d.scope is not None
        assert d.pods is not None
        return _in_scope(view, d.scope, d.pods, m)
    if d.kind == "sel":
        assert d.selector is not None
        return d.selector.matches(view.calico_labels(m))
    if d.kind == "named-port":
        return any(cp.name == d.port_name for cp in m.ports)
    return False


def _selects(pol: Policy, m: _Member) -> bool:
    return m.ep.namespace == pol.namespace and pol.pod_selector.matches(m.labels, m.items)


# --- intermediate representation -------------------------------------------------------------

SetKind = Literal["addr", "cidr", "named-port", "sel", "selnet"]
Element = str | tuple[str, str, int]
#: What a Calico rule does when it matches, in the IR: ``log`` logs and goes on to the next
#: rule, ``pass`` leaves the tier (a mark bit the endpoint's chain reads, then ``return``).
Verdict = Literal["accept", "drop", "log", "pass"]
VERDICTS: Mapping[Action, Verdict] = {
    "Allow": "accept",
    "Deny": "drop",
    "Log": "log",
    "Pass": "pass",
}


@dataclasses.dataclass(frozen=True)
class SetDef:
    """A named set: ``addr`` (pod addresses, plain set), ``cidr`` (interval set),
    ``named-port`` (``address . protocol . port``), or for a Calico selector ``sel`` (the
    addresses of the endpoints it matches, plain) and ``selnet`` (the nets of the network
    sets it matches, an interval set). ``comment`` says what it holds."""

    name: str
    family: Family
    kind: SetKind
    comment: str
    #: What decides membership, for incremental updates: ``addr`` sets the namespace scope
    #: (a namespace name or a namespace selector) and the pod selector; ``named-port`` sets
    #: the port name. Not part of equality (the name already encodes it).
    scope: str | LabelSelector | None = dataclasses.field(default=None, compare=False)
    pods: LabelSelector | None = dataclasses.field(default=None, compare=False)
    port_name: str | None = dataclasses.field(default=None, compare=False)
    #: ``sel`` / ``selnet`` sets: the Calico selector (not part of equality either).
    selector: Matcher | None = dataclasses.field(default=None, compare=False)


@dataclasses.dataclass(frozen=True)
class IRRule:
    """One accept rule of a policy chain. All given parts must match:

    ``peer_set``: the peer's address is in it (source for ingress, destination for egress);
    ``protocol`` (lower case) and ``ports`` (inclusive ranges; empty: any port);
    ``named_port_set``: ``destination . protocol . destination port`` is in it.
    ``family`` restricts the rule to IPv4 or IPv6 (None: both).
    """

    family: Family | None = None
    peer_set: str | None = None
    protocol: str | None = None
    ports: tuple[tuple[int, int], ...] = ()
    named_port_set: str | None = None
    comment: str = ""


@dataclasses.dataclass(frozen=True)
class SideMatch:
    """One side (source or destination address and port) of a :class:`TierRule`, in one
    family; every given part must hold. ``in_set``: the address is in it;
    ``not_in_sets``: in none of them; ``named_port_set``: ``address . protocol . port`` is
    in it; ``not_named_port_sets``: in none of them. Nets are disjoint prefixes."""

    nets: tuple[str, ...] = ()
    not_nets: tuple[str, ...] = ()
    in_set: str | None = None
    not_in_sets: tuple[str, ...] = ()
    ports: tuple[tuple[int, int], ...] = ()
    not_ports: tuple[tuple[int, int], ...] = ()
    named_port_set: str | None = None
    not_named_port_sets: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class TierRule:
    """One rule of a Calico policy's chain, in one family: its ``verdict`` when every part
    matches. ``rule`` is the index of the Calico rule it comes from (one Calico rule gives
    one TierRule per family and per alternative: a selector's endpoint and network-set
    sets, each named port); ``icmp`` / ``not_icmp``: (type, code or None)."""

    verdict: Verdict
    family: Family
    rule: int
    comment: str
    protocol: int | None = None
    not_protocol: int | None = None
    icmp: tuple[int, int | None] | None = None
    not_icmp: tuple[int, int | None] | None = None
    src: SideMatch = SideMatch()
    dst: SideMatch = SideMatch()


@dataclasses.dataclass(frozen=True)
class PolicyChain:
    """One policy's rules for one direction: a Kubernetes NetworkPolicy's accept rules
    (:class:`IRRule`), or a Calico policy's rules with their verdicts (:class:`TierRule`;
    ``tier`` set; ``staged``: counted, never enforced)."""

    name: str
    policy: str
    direction: Direction
    rules: tuple[IRRule | TierRule, ...]
    tier: str = ""
    staged: bool = False
    #: the kind of a Calico policy (``GlobalNetworkPolicy``, ...); "" for Kubernetes'
    kind: str = ""
    #: where a Calico policy is enforced (:attr:`~policy.calico.CalicoPolicy.stage`): an
    #: untracked policy's Allow is ``notrack`` and both it and a pre-DNAT policy's Allow
    #: mark the packet so that no later host-endpoint policy is tried
    stage: PolicyStage = "normal"
    #: a staged policy's: its tier's defaultAction, what ends the tier when none of its
    #: rules matched and no other policy of the tier decides (its ``-end`` counter's
    #: verdict); None for an enforced policy
    end_action: TierAction | None = None

    @functools.cached_property
    def can_pass(self) -> bool:
        return any(isinstance(r, TierRule) and r.verdict == "pass" for r in self.rules)


@dataclasses.dataclass(frozen=True)
class TierSpan:
    """One tier of an endpoint's program: its policy chains in order, whether each can
    Pass, and what ends the tier when none decided (``Deny``: drop; ``Pass``: on); and the
    chains of the tier's staged policies (tried first: they count what they would decide
    and return). A tier only staged policies of select the endpoint has no ``chains``: it
    decides nothing, and its end is counted (``pkt-<last staged chain>-end``) when none of
    its staged rules decided and no staged rule of an earlier tier did."""

    tier: str
    chains: tuple[str, ...]
    passing: tuple[bool, ...]
    default_action: TierAction
    staged: tuple[str, ...] = ()

    @property
    def enforced(self) -> bool:
        """Whether an enforced policy of the tier selects the endpoint (the tier decides)."""
        return bool(self.chains)


@dataclasses.dataclass(frozen=True)
class EndpointProgram:
    """What one local endpoint's two chains do: per direction ``None`` when no policy
    selects the pod for it (everything allowed), else the policy chains to try, in order,
    before the drop.

    When a Calico policy (staged or not) applies to the endpoint for a direction, that
    direction is *tiered*: ``<direction>_tiers`` holds the tiers in order, each with its
    staged policies' chains (``ingress`` / ``egress`` is then every tier's enforced chains,
    flat), and past the last tier the profile allows. Otherwise it is empty and the
    Kubernetes form applies."""

    interface: str
    endpoint: str
    addresses: tuple[str, ...]
    ingress: tuple[str, ...] | None
    egress: tuple[str, ...] | None
    ingress_tiers: tuple[TierSpan, ...] = ()
    egress_tiers: tuple[TierSpan, ...] = ()

    def tiers(self, direction: Direction) -> tuple[TierSpan, ...]:
        return self.ingress_tiers if direction == "ingress" else self.egress_tiers

    def staged(self, direction: Direction) -> tuple[str, ...]:
        """The staged policies' chains of every tier, in order."""
        return tuple(c for span in self.tiers(direction) for c in span.staged)

    def tiered(self, direction: Direction) -> bool:
        return bool(self.tiers(direction))

    def chains(self, direction: Direction) -> tuple[str, ...] | None:
        return self.ingress if direction == "ingress" else self.egress


#: A host endpoint's stages, in the order a packet meets them: before connection tracking
#: (``untracked-``: doNotTrack policies), before DNAT (``prednat-ingress``), then with the
#: filter, for the host's own traffic (``ingress``: to it, ``egress``: from it) or traffic
#: it forwards (``forward-``: applyOnForward policies).
HostStage = Literal[
    "untracked-ingress",
    "untracked-egress",
    "prednat-ingress",
    "ingress",
    "egress",
    "forward-ingress",
    "forward-egress",
]
#: stage -> (the policies' stage, direction, forwarded traffic)
HOST_STAGES: Mapping[HostStage, tuple[PolicyStage, Direction, bool]] = {
    "untracked-ingress": ("untracked", "ingress", False),
    "untracked-egress": ("untracked", "egress", False),
    "prednat-ingress": ("prednat", "ingress", False),
    "ingress": ("normal", "ingress", False),
    "egress": ("normal", "egress", False),
    "forward-ingress": ("normal", "ingress", True),
    "forward-egress": ("normal", "egress", True),
}


def host_policy_applies(c: CalicoPolicy, stage: HostStage) -> bool:
    """Whether policy ``c`` is one of a host endpoint's at ``stage`` (its selector aside):
    a GlobalNetworkPolicy (not staged) of the stage's kind and direction; for forwarded
    traffic, only with applyOnForward (which untracked and pre-DNAT policies have)."""
    kind, direction, forwarded = HOST_STAGES[stage]
    if c.namespace is not None or c.staged or direction not in c.types or c.stage != kind:
        return False
    return c.apply_on_forward or not forwarded


_HOST_CHAIN_CODE: Mapping[HostStage, str] = {
    "untracked-ingress": "hui",
    "untracked-egress": "hue",
    "prednat-ingress": "hpi",
    "ingress": "hni",
    "egress": "hne",
    "forward-ingress": "hfi",
    "forward-egress": "hfe",
}


def host_chain_name(name: str, stage: HostStage) -> str:
    """The chain of host endpoint ``name`` for ``stage`` (``hni-<h>``: normal ingress, ...)."""
    return f"{_HOST_CHAIN_CODE[stage]}-{_digest('hep|' + name)}"


@dataclasses.dataclass(frozen=True)
class HostProgram:
    """What one host endpoint of this node does (on ``interface``, ``"*"``: every interface
    but the workloads' and ``lo``): per stage the tiers of the policies that apply, in
    order. An untracked or pre-DNAT stage decides only by a rule's Allow or Deny (its tiers'
    ends pass: nothing there drops by default); the others end, past every tier, in a drop
    (a host endpoint has no profile). With no policy: the host's own traffic is denied
    (but for the failsafe ports), forwarded traffic allowed, the first two stages let the
    packet on."""

    name: str
    interface: str
    stages: tuple[tuple[HostStage, tuple[TierSpan, ...]], ...]

    def spans(self, stage: HostStage) -> tuple[TierSpan, ...]:
        return dict(self.stages).get(stage, ())


@dataclasses.dataclass(frozen=True)
class _IRPacket:
    src: str
    dst: str
    protocol: str
    sport: int | None
    dport: int | None
    icmp: tuple[int, int] | None


@dataclasses.dataclass(frozen=True)
class DesiredState:
    """The IR: what the dataplane programs for this node."""

    sets: Mapping[str, SetDef]
    elements: Mapping[str, frozenset[Element]]
    chains: Mapping[str, PolicyChain]
    endpoints: Mapping[str, EndpointProgram]
    policies: int = 0
    #: this node's host endpoints (by name) that have an interface
    hosts: Mapping[str, HostProgram] = dataclasses.field(default_factory=dict)

    @property
    def rule_count(self) -> int:
        return sum(len(c.rules) for c in self.chains.values())

    def evaluate(
        self,
        src: str,
        dst: str,
        protocol: str,
        port: int | None,
        src_iface: str | None,
        dst_iface: str | None,
        *,
        source_port: int | None = None,
        icmp: tuple[int, int] | None = None,
    ) -> bool:
        """Evaluate the IR for one new connection (as the dataplane would): the egress
        program of ``src_iface`` (when the source is a local endpoint) and the ingress
        program of ``dst_iface`` (when the destination is one). Unknown interfaces drop.
        ``source_port`` and ``icmp`` (type, code) are read by Calico's rules only."""
        sides: tuple[tuple[Direction, str | None], ...] = (
            ("egress", src_iface),
            ("ingress", dst_iface),
        )
        for direction, iface in sides:
            if iface is None:
                continue
            prog = self.endpoints.get(iface)
            if prog is None:
                return False
            if prog.tiered(direction):
                pkt = _IRPacket(src, dst, protocol, source_port, port, icmp)
                if not self._tiers_allow(prog.tiers(direction), direction, pkt):
                    return False
                continue
            chains = prog.egress if direction == "egress" else prog.ingress
            if chains is None:
                continue
            peer = dst if direction == "egress" else src
            if not any(self._chain_accepts(c, peer, dst, protocol, port) for c in chains):
                return False
        return True

    def _tiers_allow(self, tiers: Sequence[TierSpan], direction: Direction, pkt: _IRPacket) -> bool:
        for span in tiers:
            if not span.enforced:
                continue  # only staged policies: the tier decides nothing
            decided: Verdict | None = None
            for chain in span.chains:
                decided = self._chain_verdict(chain, direction, pkt)
                if decided is not None:
                    break
            if decided == "accept":
                return True
            if decided == "drop" or (decided is None and span.default_action == "Deny"):
                return False
        return True  # past every tier: the profile

    def _chain_verdict(self, chain: str, direction: Direction, pkt: _IRPacket) -> Verdict | None:
        """The verdict of a chain's first deciding rule (Log rules log and go on)."""
        c = self.chains[chain]
        if not c.tier:  # a Kubernetes policy's chain: accept rules
            peer = pkt.dst if direction == "egress" else pkt.src
            accepts = self._chain_accepts(chain, peer, pkt.dst, pkt.protocol, pkt.dport)
            return "accept" if accepts else None
        for r in c.rules:
            if isinstance(r, TierRule) and r.verdict != "log" and self._tier_rule_matches(r, pkt):
                return r.verdict
        return None

    def _tier_rule_matches(self, r: TierRule, pkt: _IRPacket) -> bool:
        if ipaddress.ip_address(pkt.src).version != r.family:
            return False
        try:
            number = protocol_number(pkt.protocol)
        except ValueError:
            number = -1
        if r.protocol is not None and number != r.protocol:
            return False
        if r.not_protocol is not None and number == r.not_protocol:
            return False
        icmp_type, icmp_code = pkt.icmp if pkt.icmp is not None else (None, None)
        for want, negated in ((r.icmp, False), (r.not_icmp, True)):
            if want is None:
                continue
            hit = icmp_type == want[0] and (want[1] is None or icmp_code == want[1])
            if hit is negated:
                return False
        name = pkt.protocol.lower()
        return self._side_matches(r.src, pkt.src, name, pkt.sport) and self._side_matches(
            r.dst, pkt.dst, name, pkt.dport
        )

    def _side_matches(self, m: SideMatch, addr: str, proto: str, port: int | None) -> bool:
        a = ipaddress.ip_address(addr)
        if m.nets and not any(a in ipaddress.ip_network(n) for n in m.nets):
            return False
        if any(a in ipaddress.ip_network(n) for n in m.not_nets):
            return False
        if m.in_set is not None and not self._in_set(m.in_set, addr):
            return False
        if any(self._in_set(name, addr) for name in m.not_in_sets):
            return False
        if m.ports and (port is None or not any(lo <= port <= hi for lo, hi in m.ports)):
            return False
        if m.not_ports and (port is None or any(lo <= port <= hi for lo, hi in m.not_ports)):
            return False
        if (
            m.named_port_set is not None
            and (addr, proto, port) not in self.elements[m.named_port_set]
        ):
            return False
        return not (
            m.not_named_port_sets
            and (
                port is None
                or any((addr, proto, port) in self.elements[n] for n in m.not_named_port_sets)
            )
        )

    def _in_set(self, name: str, addr: str) -> bool:
        if self.sets[name].kind in ("cidr", "selnet"):
            a = ipaddress.ip_address(addr)
            return any(a in ipaddress.ip_network(str(n)) for n in self.elements[name])
        return addr in self.elements[name]

    def _chain_accepts(
        self, chain: str, peer: str, dst: str, protocol: str, port: int | None
    ) -> bool:
        fam = ipaddress.ip_address(peer).version
        proto = protocol.lower()
        for r in self.chains[chain].rules:
            if not isinstance(r, IRRule) or (r.family is not None and r.family != fam):
                continue
            if (
                r.peer_set is not None
                and peer not in self.elements[r.peer_set]
                and not self._in_cidr_set(r.peer_set, peer)
            ):
                continue
            if r.protocol is not None and r.protocol != proto:
                continue
            if r.ports and (port is None or not any(lo <= port <= hi for lo, hi in r.ports)):
                continue
            if r.named_port_set is not None and (
                port is None or (dst, proto, port) not in self.elements[r.named_port_set]
            ):
                continue
            return True
        return False

    def _in_cidr_set(self, name: str, addr: str) -> bool:
        if self.sets[name].kind != "cidr":
            return False
        a = ipaddress.ip_address(addr)
        return any(a in ipaddress.ip_network(str(n)) for n in self.elements[name])


def _merge_ranges(ranges: Iterable[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for lo, hi in sorted(ranges):
        if out and lo <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], hi))
        else:
            out.append((lo, hi))
    return tuple(out)


def _selector_set_key(pol: Policy, peer: Peer) -> tuple[str, str]:
    """(canonical key, human comment) of a selector peer's address set."""
    pod = peer.pod_selector.text() if peer.pod_selector is not None else ""
    if peer.namespace_selector is None:
        scope = f"ns={pol.namespace}"
        comment = f"pods [{pod or 'all'}] in namespace {pol.namespace}"
    else:
        scope = f"nssel={peer.namespace_selector.text()}"
        comment = f"pods [{pod or 'all'}] in namespaces [{peer.namespace_selector.text() or 'all'}]"
    return f"{scope}|pod={pod}", comment


@functools.lru_cache(maxsize=4096)
def _block_elements(block: IPBlock) -> tuple[str, ...]:
    """An ipBlock's set elements (``cidr`` minus its ``except``s). Cached: every full
    compute needs every block's, and ``address_exclude`` was most of a compute's time at
    200 policies."""
    return tuple(str(n) for n in block.prefixes())


class _Builder:
    def __init__(self, view: _View, families: frozenset[Family]) -> None:
        self.view = view
        self.families = families
        self.sets: dict[str, SetDef] = {}
        self.elements: dict[str, frozenset[Element]] = {}
        # selector set key -> (names per family); members computed once per key
        self._selector_sets: dict[str, dict[Family, str]] = {}
        self._named_sets: dict[str, dict[Family, str]] = {}
        self._calico_sets: dict[str, dict[Family, tuple[str, str]]] = {}

    def _add_set(self, d: SetDef, elements: Iterable[Element]) -> None:
        self.sets[d.name] = d
        self.elements[d.name] = frozenset(elements)

    def selector_sets(self, pol: Policy, peer: Peer) -> dict[Family, str]:
        key, comment = _selector_set_key(pol, peer)
        if key in self._selector_sets:
            return self._selector_sets[key]
        view = self.view
        if peer.namespace_selector is None:
            namespaces = [pol.namespace]
        else:
            nssel = peer.namespace_selector
            namespaces = [ns for ns in view.namespaces() if view.ns_matches(nssel, ns)]
        podsel = peer.pod_selector if peer.pod_selector is not None else EVERYTHING
        addrs: dict[Family, list[str]] = {4: [], 6: []}
        scope: str | LabelSelector = (
            pol.namespace if peer.namespace_selector is None else peer.namespace_selector
        )
        for ns in namespaces:
            for m in view.by_ns.get(ns, ()):
                if _in_scope(view, scope, podsel, m):
                    for a in m.addresses:
                        addrs[4 if a.version == 4 else 6].append(str(a))
        digest = _digest(key)
        names: dict[Family, str] = {}
        for fam in sorted(self.families):
            name = f"a{fam}-{digest}"
            self._add_set(SetDef(name, fam, "addr", comment, scope, podsel), addrs[fam])
            names[fam] = name
        self._selector_sets[key] = names
        return names

    def block_set(self, block: IPBlock) -> str:
        name = f"b{block.family}-{_digest(block.text())}"
        if name not in self.sets:
            elems = list(_block_elements(block))
            self._add_set(SetDef(name, block.family, "cidr", f"ipBlock {block.text()}"), elems)
        return name

    def named_port_sets(self, port_name: str) -> dict[Family, str]:
        if port_name in self._named_sets:
            return self._named_sets[port_name]
        elems: dict[Family, list[Element]] = {4: [], 6: []}
        probe = SetDef("", 4, "named-port", "", port_name=port_name)
        for m in self.view.members:
            if not _contributes(self.view, probe, m):
                continue
            for cp in m.ports:
                if cp.name == port_name:
                    for a in m.addresses:
                        elems[4 if a.version == 4 else 6].append(
                            (str(a), cp.protocol.lower(), cp.port)
                        )
        names: dict[Family, str] = {}
        safe = "".join(c if c.isalnum() or c == "-" else "_" for c in port_name)[:32]
        for fam in sorted(self.families):
            name = f"n{fam}-{safe}-{_digest(port_name)[:4]}"
            d = SetDef(name, fam, "named-port", f"port name {port_name}", port_name=port_name)
            self._add_set(d, elems[fam])
            names[fam] = name
        self._named_sets[port_name] = names
        return names

    def policy_chain(self, pol: Policy, direction: Direction) -> PolicyChain:
        name = _policy_chain_name(pol, direction)
        out: list[IRRule] = []
        for ri, rule in enumerate(pol.rules(direction)):
            comment = f"{pol.key} {direction}[{ri}]"
            peers = self._rule_peers(pol, rule)
            ports = _rule_ports(rule)
            for fam, pset in peers:
                for lproto, rng, portname in ports:
                    if portname is None:
                        out.append(IRRule(fam, pset, lproto, rng, None, comment))
                        continue
                    for nfam, nset in self.named_port_sets(portname).items():
                        if fam is None or fam == nfam:
                            out.append(IRRule(nfam, pset, lproto, (), nset, comment))
        return PolicyChain(name, pol.key, direction, tuple(out))

    # -- Calico ---------------------------------------------------------------------------

    def calico_sets(self, sel: Matcher) -> dict[Family, tuple[str, str]]:
        """A Calico rule selector's two sets per family: the addresses of the endpoints it
        matches (``s4-``/``s6-``) and the nets of the network sets it matches (``w4-``/
        ``w6-``, disjoint prefixes)."""
        key = str(sel)
        if key in self._calico_sets:
            return self._calico_sets[key]
        view = self.view
        addrs: dict[int, list[str]] = {4: [], 6: []}
        probe = SetDef("", 4, "sel", "", selector=sel)
        for m in view.members:
            if _contributes(view, probe, m):
                for a in m.addresses:
                    addrs[a.version].append(str(a))
        for h, labels in view.hosts:  # a host endpoint is matched by its expected IPs
            if sel.matches(labels):
                for text in h.expected_ips:
                    addrs[ipaddress.ip_address(text).version].append(text)
        nets: dict[int, list[IPNetwork]] = {4: [], 6: []}
        for networks, labels in view.network_sets:
            if sel.matches(labels):
                for n in networks:
                    nets[n.version].append(n)
        digest = _digest("calico|" + key)
        names: dict[Family, tuple[str, str]] = {}
        for fam in sorted(self.families):
            a_name, n_name = f"s{fam}-{digest}", f"w{fam}-{digest}"
            what = f"selector [{key}]"
            sd = SetDef(a_name, fam, "sel", f"endpoints {what}", selector=sel)
            self._add_set(sd, sorted(set(addrs[fam])))
            self._add_set(
                SetDef(n_name, fam, "selnet", f"network sets {what}", selector=sel),
                collapsed(nets[fam]),
            )
            names[fam] = (a_name, n_name)
        self._calico_sets[key] = names
        return names

    def calico_chain(self, pol: CalicoPolicy, direction: Direction) -> PolicyChain:
        out: list[TierRule] = []
        for i, rule in enumerate(pol.rules(direction)):
            comment = f"{pol.tier}/{pol.key} {direction}[{i}]"
            for fam in sorted(self.families):
                out.extend(self._tier_rules(rule, fam, i, comment))
        end = self.view.tier(pol.tier).default_action if pol.staged else None
        name = calico_chain_name(pol, direction, end)
        return PolicyChain(
            name, pol.key, direction, tuple(out), pol.tier, pol.staged, pol.kind, pol.stage, end
        )

    def _tier_rules(self, rule: CalicoRule, fam: Family, i: int, comment: str) -> list[TierRule]:
        if rule.ip_version is not None and rule.ip_version != fam:
            return []
        if rule.protocol == _ICMP[6 if fam == 4 else 4]:
            return []  # ICMP is IPv4's, ICMPv6 IPv6's
        srcs = self._sides(rule.source, fam, rule.protocol)
        dsts = self._sides(rule.destination, fam, rule.protocol)
        icmp = (rule.icmp.type, rule.icmp.code) if rule.icmp is not None else None
        not_icmp = (rule.not_icmp.type, rule.not_icmp.code) if rule.not_icmp else None
        verdict = VERDICTS[rule.action]
        return [
            TierRule(
                verdict, fam, i, comment, rule.protocol, rule.not_protocol, icmp, not_icmp, a, b
            )
            for a in srcs
            for b in dsts
        ]

    def _sides(self, e: EntityMatch, fam: Family, protocol: int | None) -> list[SideMatch]:
        """The alternatives one side of a rule is, in one family (none: it cannot match)."""
        nets = [n for n in (ipaddress.ip_network(x) for x in e.nets) if n.version == fam]
        if e.nets and not nets:
            return []
        not_nets = [n for n in (ipaddress.ip_network(x) for x in e.not_nets) if n.version == fam]
        in_sets: list[str | None] = [None]
        if e.selector is not None:
            in_sets = list(self.calico_sets(e.selector)[fam])
        not_in: tuple[str, ...] = ()
        if e.not_selector is not None:
            not_in = self.calico_sets(e.not_selector)[fam]
        numbered = [(p.first, p.last) for p in e.ports if p.name is None]
        ports: list[tuple[tuple[tuple[int, int], ...], str | None]] = []
        if numbered:
            ports.append((_merge_ranges(numbered), None))
        for p in e.ports:
            if p.name is not None:
                ports.append(((), self.named_port_sets(p.name).get(fam)))
        if not e.ports:
            ports.append(((), None))
        not_numbered = _merge_ranges((p.first, p.last) for p in e.not_ports if p.name is None)
        not_named = tuple(
            self.named_port_sets(p.name)[fam] for p in e.not_ports if p.name is not None
        )
        base = SideMatch(
            tuple(str(n) for n in collapsed(nets)),
            tuple(str(n) for n in collapsed(not_nets)),
            None,
            not_in,
            (),
            not_numbered,
            None,
            not_named,
        )
        return [
            dataclasses.replace(base, in_set=s, ports=r, named_port_set=n)
            for s in in_sets
            for r, n in ports
        ]

    def _rule_peers(self, pol: Policy, rule: Rule) -> list[tuple[Family | None, str | None]]:
        """A rule's peer matches: (family, set) pairs; [(None, None)] = any peer."""
        peers: list[tuple[Family | None, str | None]] = []
        if not rule.peers:
            peers.append((None, None))
        for peer in rule.peers:
            if peer.ip_block is not None:
                peers.append((peer.ip_block.family, self.block_set(peer.ip_block)))
            else:
                peers.extend(self.selector_sets(pol, peer).items())
        return peers


def _rule_ports(rule: Rule) -> list[tuple[str | None, tuple[tuple[int, int], ...], str | None]]:
    """A rule's port matches: (protocol, ranges, port name); [(None, (), None)] = any port.
    A protocol allowed whole takes no ranges; ranges of one protocol are merged."""
    if not rule.ports:
        return [(None, (), None)]
    ports: list[tuple[str | None, tuple[tuple[int, int], ...], str | None]] = []
    whole = {p.protocol for p in rule.ports if p.port is None}
    ranges: dict[str, list[tuple[int, int]]] = {}
    named: set[tuple[str, str]] = set()
    for p in rule.ports:
        if p.protocol in whole:
            continue
        if isinstance(p.port, int):
            hi = p.end_port if p.end_port is not None else p.port
            ranges.setdefault(p.protocol, []).append((p.port, hi))
        elif isinstance(p.port, str):
            named.add((p.protocol, p.port))
    for proto in PROTOCOLS:
        if proto in whole:
            ports.append((proto.lower(), (), None))
        elif proto in ranges:
            ports.append((proto.lower(), _merge_ranges(ranges[proto]), None))
    for nproto, pname in sorted(named):
        ports.append((nproto.lower(), (), pname))
    return ports


def compute(state: ClusterState, node: str, families: Iterable[Family] = (4, 6)) -> DesiredState:
    """The desired policy state of ``node``'s endpoints (see the module docstring)."""
    view = _View(state)
    b = _Builder(view, frozenset(families))
    # An endpoint without a host interface (not written by tabby) cannot be dispatched to.
    local = [m for m in view.members if m.ep.node == node and m.ep.interface]
    policies = sorted(state.policies, key=lambda p: (p.namespace, p.name))
    chains: dict[str, PolicyChain] = {}
    selecting: dict[str, dict[Direction, list[str]]] = {m.ep.interface: {} for m in local}
    local_by_ns: dict[str, list[_Member]] = {}
    for m in local:
        local_by_ns.setdefault(m.ep.namespace, []).append(m)
    for pol in policies:
        chosen = [m for m in local_by_ns.get(pol.namespace, ()) if _selects(pol, m)]
        if not chosen:
            continue
        for direction in ("ingress", "egress"):
            if direction not in pol.types:
                continue
            chain = b.policy_chain(pol, direction)
            chains[chain.name] = chain
            for m in chosen:
                selecting[m.ep.interface].setdefault(direction, []).append(chain.name)
    endpoints: dict[str, EndpointProgram] = {}
    for m in local:
        sel = selecting[m.ep.interface]
        ing, egr = sel.get("ingress"), sel.get("egress")
        prog = EndpointProgram(
            m.ep.interface,
            f"{m.ep.namespace}/{m.ep.name}",
            m.ep.addresses,
            tuple(ing) if ing is not None else None,
            tuple(egr) if egr is not None else None,
        )
        if state.calico_policies:
            prog = _tiered_program(view, b, m, prog, chains)
        endpoints[m.ep.interface] = prog
    count = len(state.policies) + len(state.calico_policies)
    hosts = {
        h.name: _host_program(view, b, h, labels, chains) for h, labels in _my_hosts(view, node)
    }
    return DesiredState(b.sets, b.elements, chains, endpoints, count, hosts)


def _my_hosts(view: _View, node: str) -> list[tuple[HostEndpoint, Mapping[str, str]]]:
    return node_hosts(view.hosts, node)


def node_hosts(
    hosts: Iterable[tuple[HostEndpoint, Mapping[str, str]]], node: str
) -> list[tuple[HostEndpoint, Mapping[str, str]]]:
    """Of ``hosts`` (host endpoints with their labels, by key), ``node``'s with an
    interface, one per interface (the first by key: Calico allows one), by name."""
    out: dict[str, tuple[HostEndpoint, Mapping[str, str]]] = {}
    for h, labels in hosts:
        if h.node == node and h.interface and h.interface not in out:
            out[h.interface] = (h, labels)
    return sorted(out.values(), key=lambda x: x[0].name)


def _host_entries(
    view: _View, labels: Mapping[str, str], stage: HostStage
) -> dict[str, list[_Entry]]:
    return host_entries(view.state.calico_policies, labels, stage, view.tier)


def host_entries(
    calico: Iterable[CalicoPolicy],
    labels: Mapping[str, str],
    stage: HostStage,
    tier_of: Callable[[str], Tier],
) -> dict[str, list[_Entry]]:
    """The policies of one host endpoint (``labels``) at ``stage``, by tier, each tier in
    its order."""
    selecting = (c for c in calico if host_policy_applies(c, stage) and c.selector.matches(labels))
    return tier_entries(
        (), selecting, stage_direction(stage), tier_of, staged=False, workload=False
    )


def stage_direction(stage: HostStage) -> Direction:
    return HOST_STAGES[stage][1]


#: a policy's chain for one direction, as a program refers to it (:class:`_Builder`'s in
#: :func:`compute`; one kept per policy revision in :mod:`policy.incremental`)
ChainOf = Callable[[CalicoPolicy, Direction], PolicyChain]


def host_program(
    h: HostEndpoint,
    labels: Mapping[str, str],
    calico: Iterable[CalicoPolicy],
    chain_of: ChainOf,
    tier_of: Callable[[str], Tier],
) -> HostProgram:
    """One host endpoint's program: per stage the tiers of the policies among ``calico``
    that apply there."""
    assert h.interface is not None
    policies = tuple(calico)
    stages: list[tuple[HostStage, tuple[TierSpan, ...]]] = []
    for stage, (kind, direction, _) in HOST_STAGES.items():
        spans: list[TierSpan] = []
        for tier, entries in host_entries(policies, labels, stage, tier_of).items():
            names: list[str] = []
            passing: list[bool] = []
            for e in entries:
                assert e.calico is not None
                chain = chain_of(e.calico, direction)
                names.append(chain.name)
                passing.append(chain.can_pass)
            action = tier_of(tier).default_action if kind == "normal" else "Pass"
            spans.append(TierSpan(tier, tuple(names), tuple(passing), action))
        stages.append((stage, tuple(spans)))
    return HostProgram(h.name, h.interface, tuple(stages))


def _builder_chains(b: _Builder, chains: dict[str, PolicyChain]) -> ChainOf:
    """The builder's chain of a policy, recorded in ``chains``."""

    def chain_of(c: CalicoPolicy, direction: Direction) -> PolicyChain:
        chain = b.calico_chain(c, direction)
        chains[chain.name] = chain
        return chain

    return chain_of


def _host_program(
    view: _View,
    b: _Builder,
    h: HostEndpoint,
    labels: Mapping[str, str],
    chains: dict[str, PolicyChain],
) -> HostProgram:
    chain_of = _builder_chains(b, chains)
    return host_program(h, labels, view.state.calico_policies, chain_of, view.tier)


def _tiered_program(
    view: _View, b: _Builder, m: _Member, prog: EndpointProgram, chains: dict[str, PolicyChain]
) -> EndpointProgram:
    entries = {d: _entries(view, m, d, staged=True) for d in _DIRECTIONS}
    return tiered_program(prog, entries, _builder_chains(b, chains), view.tier)


def tiered_program(
    prog: EndpointProgram,
    entries: Mapping[Direction, Mapping[str, Sequence[_Entry]]],
    chain_of: ChainOf,
    tier_of: Callable[[str], Tier],
) -> EndpointProgram:
    """``prog`` with the directions a Calico policy (staged or not) applies to tiered:
    ``entries`` (per direction, :func:`tier_entries` of the endpoint, staged ones too), by
    tier as :func:`explain` walks them, each tier with its staged policies' chains."""
    out = prog
    for direction in _DIRECTIONS:
        by_tier = entries[direction]
        if not any(e.calico is not None for es in by_tier.values() for e in es):
            continue
        spans: list[TierSpan] = []
        for tier, in_tier in by_tier.items():
            names: list[str] = []
            passing: list[bool] = []
            staged: list[str] = []
            for e in in_tier:
                if e.k8s is not None:
                    names.append(_policy_chain_name(e.k8s, direction))
                    passing.append(False)
                    continue
                assert e.calico is not None
                chain = chain_of(e.calico, direction)
                if e.calico.staged:
                    staged.append(chain.name)
                else:
                    names.append(chain.name)
                    passing.append(chain.can_pass)
            action = tier_of(tier).default_action
            spans.append(TierSpan(tier, tuple(names), tuple(passing), action, tuple(staged)))
        flat = tuple(n for span in spans for n in span.chains)
        if direction == "ingress":
            out = dataclasses.replace(out, ingress=flat, ingress_tiers=tuple(spans))
        else:
            out = dataclasses.replace(out, egress=flat, egress_tiers=tuple(spans))
    return out


def calico_chain_name(
    pol: CalicoPolicy, direction: Direction, end: TierAction | None = None
) -> str:
    """``ci-<h>`` / ``ce-<h>``: ``<h>`` hashes the policy's whole content (and a staged
    policy's ``end``, its tier's defaultAction), so an edited policy is a new chain (and its
    per-rule counters new counters), never a changed one."""
    # (every part's text is canonical: no set's iteration order, so no hash seed, in it)
    content = (direction, pol.key, pol.tier, pol.order, sorted(pol.types), str(pol.selector))
    flags: tuple[object, ...] = (
        (pol.stage, pol.apply_on_forward) if pol.stage != "normal" or pol.apply_on_forward else ()
    )
    if end is not None:
        flags = (*flags, end)
    text = repr(((*content, *flags), pol.rules(direction)))
    return f"{'ci' if direction == 'ingress' else 'ce'}-{_digest(text)}"


def collapsed(nets: Iterable[IPNetwork]) -> list[str]:
    """Nets as the disjoint prefixes covering exactly their union (an interval set's
    elements: nft refuses overlapping ones)."""
    nets = list(nets)
    v4 = [n for n in nets if isinstance(n, ipaddress.IPv4Network)]
    v6 = [n for n in nets if isinstance(n, ipaddress.IPv6Network)]
    out = [str(n) for n in ipaddress.collapse_addresses(v4)]
    return out + [str(n) for n in ipaddress.collapse_addresses(v6)]


def _policy_chain_name(pol: Policy, direction: Direction) -> str:
    return f"{'pi' if direction == 'ingress' else 'pe'}-{_digest(pol.key)}"


def policy_chain(
    pol: Policy, direction: Direction, families: Iterable[Family] = (4, 6)
) -> tuple[PolicyChain, dict[str, SetDef], dict[str, frozenset[Element]]]:
    """One policy's chain for one direction exactly as :func:`compute` makes it, with every
    set :func:`compute` makes for it and their elements as far as they do not depend on the
    endpoints (an ipBlock's prefixes; the pod sets come back empty). A chain depends on its
    policy alone, so :mod:`policy.incremental` builds it once per policy revision."""
    b = _Builder(_View(ClusterState()), frozenset(families))
    chain = b.policy_chain(pol, direction)
    return chain, dict(b.sets), dict(b.elements)


def calico_policy_chain(
    pol: CalicoPolicy,
    direction: Direction,
    families: Iterable[Family] = (4, 6),
    tier: Tier | None = None,
) -> tuple[PolicyChain, dict[str, SetDef]]:
    """A Calico policy's chain for one direction exactly as :func:`compute` makes it, with
    the sets it uses (empty here: their elements depend on the endpoints, host endpoints
    and network sets). It depends on the policy alone, and a staged one's on its ``tier``
    too (the Tier resource, None when there is none: its defaultAction ends the chain);
    like :func:`policy_chain`, built once per revision of them."""
    tiers = (tier,) if tier is not None else ()
    b = _Builder(_View(ClusterState(tiers=tiers)), frozenset(families))
    chain = b.calico_chain(pol, direction)
    return chain, dict(b.sets)


# --- direct evaluation and explain ------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class DirectionVerdict:
    """One side of a connection: the source pod's egress or the destination pod's ingress."""

    pod: str
    direction: Direction
    selecting: tuple[str, ...]
    allowed: bool
    allowed_by: tuple[str, ...]
    reason: str
    #: the tier that decided: its rule, or its end (None: no policy selects the pod, or
    #: every tier passed the packet on to the profile)
    tier: str | None = None
    #: the rule that decided (``<policy> <direction>[<index>]``), whatever its action; ""
    #: when a tier's end, the profile or the absence of policy did
    decided_by: str = ""
    #: the Log rules the packet matched on its way, in order
    logged: tuple[str, ...] = ()
    #: what the staged policies that apply would have made of it ("" when none applies)
    staged: str = ""

    @property
    def isolated(self) -> bool:
        return bool(self.selecting)


@dataclasses.dataclass(frozen=True)
class Explanation:
    src: str
    dst: str
    protocol: str
    port: int | None
    egress: DirectionVerdict | None
    ingress: DirectionVerdict | None
    #: the host endpoints' stages the connection meets, in order, up to the one that
    #: decided (each ``pod`` names the host endpoint, each ``reason`` starts with the stage)
    host: tuple[DirectionVerdict, ...] = ()

    @property
    def allowed(self) -> bool:
        sides = (self.egress, self.ingress, *self.host)
        return all(v.allowed for v in sides if v is not None)

    def lines(self) -> list[str]:
        what = f"{self.protocol}/{self.port}" if self.port is not None else self.protocol
        out = [f"{self.src} -> {self.dst} {what}: {'ALLOWED' if self.allowed else 'DENIED'}"]
        for h in self.host:
            sel = ", ".join(h.selecting) if h.selecting else "none"
            out.append(f"  {h.pod}: selected by {sel}")
            out.extend(f"    logged by {rule}" for rule in h.logged)
            out.append(f"    {'allowed' if h.allowed else 'denied'}: {h.reason}")
        for v in (self.egress, self.ingress):
            if v is None:
                continue
            sel = ", ".join(v.selecting) if v.selecting else "none"
            out.append(f"  {v.direction} of {v.pod}: selected by {sel}")
            out.extend(f"    logged by {rule}" for rule in v.logged)
            out.append(f"    {'allowed' if v.allowed else 'denied'}: {v.reason}")
            if v.staged:
                out.append(f"    staged: {v.staged}")
        return out


Target = tuple[str, str] | str
"""A pod as ``(namespace, name)`` or an address (which may belong to a pod)."""


def _port_matches(
    spec: PortSpec, protocol: str, port: int | None, dst_ports: Sequence[ContainerPort]
) -> bool:
    if spec.protocol != protocol:
        return False
    if spec.port is None:
        return True
    if port is None:
        return False
    if isinstance(spec.port, int):
        hi = spec.end_port if spec.end_port is not None else spec.port
        return spec.port <= port <= hi
    return any(
        cp.name == spec.port and cp.protocol == protocol and cp.port == port for cp in dst_ports
    )


def _peer_matches(
    view: _View, pol: Policy, peer: Peer, remote: _Member | None, addr: IPAddress
) -> bool:
    if peer.ip_block is not None:
        return peer.ip_block.contains(addr)
    return remote is not None and _member_matches_peer(view, pol, peer, remote)


def _rule_matches(
    view: _View,
    pol: Policy,
    rule: Rule,
    remote: _Member | None,
    remote_addr: IPAddress,
    protocol: str,
    port: int | None,
    dst_ports: Sequence[ContainerPort],
) -> bool:
    if rule.peers and not any(_peer_matches(view, pol, p, remote, remote_addr) for p in rule.peers):
        return False
    return not rule.ports or any(_port_matches(p, protocol, port, dst_ports) for p in rule.ports)


@dataclasses.dataclass(frozen=True)
class _Entry:
    """A policy that applies to one endpoint in one direction, as a tier walk sees it: a
    Kubernetes NetworkPolicy (Allow rules, tier ``default``, order 1000, Calico's name
    ``knp.default.<name>`` for ties) or a Calico policy."""

    tier: str
    sort: tuple[bool, float, str]
    key: str
    k8s: Policy | None = None
    calico: CalicoPolicy | None = None

    def rules(self, direction: Direction) -> tuple[object, ...]:
        if self.k8s is not None:
            return self.k8s.rules(direction)
        assert self.calico is not None
        return self.calico.rules(direction)


@dataclasses.dataclass(frozen=True)
class _Context:
    """The packet as both kinds of rule read it."""

    remote: _Member | None
    remote_addr: IPAddress
    protocol: str
    port: int | None
    dst_ports: Sequence[ContainerPort]
    packet: Packet


def _entries(
    view: _View, me: _Member, direction: Direction, *, staged: bool
) -> dict[str, list[_Entry]]:
    """The policies that apply to ``me`` for ``direction``, by tier, each tier in its order
    (staged policies too when ``staged``: what they would do)."""
    k8s = (p for p in view.state.policies if _selects(p, me))
    calico: Iterable[CalicoPolicy] = ()
    if view.state.calico_policies:
        labels = view.calico_labels(me)
        calico = (c for c in view.state.calico_policies if c.selector.matches(labels))
    return tier_entries(k8s, calico, direction, view.tier, staged=staged)


def tier_entries(
    k8s: Iterable[Policy],
    calico: Iterable[CalicoPolicy],
    direction: Direction,
    tier_of: Callable[[str], Tier],
    *,
    staged: bool,
    workload: bool = True,
) -> dict[str, list[_Entry]]:
    """Of the policies that select an endpoint (``k8s``: by their pod selector in its
    namespace; ``calico``: by their selector over its Calico labels), those that apply to it
    for ``direction``, as a tier walk sees them: by tier (tiers by order), each tier by
    (order, name), staged policies too when ``staged``; a Kubernetes NetworkPolicy one of
    tier ``default`` at order 1000 named as Calico converts it. Untracked and pre-DNAT
    policies apply to host endpoints only: a ``workload`` endpoint's leave them out (a host
    endpoint's caller has decided their stage)."""
    if workload:
        calico = (c for c in calico if c.stage == "normal")
    out: dict[str, list[_Entry]] = {}
    for p in k8s:
        if direction in p.types:
            sort = policy_sort_key(
                KUBERNETES_POLICY_ORDER, f"{p.namespace}/{KUBERNETES_POLICY_PREFIX}{p.name}"
            )
            out.setdefault(DEFAULT_TIER, []).append(_Entry(DEFAULT_TIER, sort, p.key, k8s=p))
    for c in calico:
        if direction not in c.types or (c.staged and not staged):
            continue
        sort = policy_sort_key(c.order, c.key.removeprefix("staged:"))
        out.setdefault(c.tier, []).append(_Entry(c.tier, sort, c.key, calico=c))
    tiers = sorted((tier_of(t) for t in out), key=tier_sort_key)
    # (a staged policy and its enforced namesake sort alike: the key decides, whatever the
    # order the policies came in)
    return {t.name: sorted(out[t.name], key=lambda e: (e.sort, e.key)) for t in tiers}


def _staged_world(view: _View, tiers: dict[str, list[_Entry]]) -> dict[str, list[_Entry]]:
    """``tiers`` as they would be were the staged policies enforced: a staged policy (Set)
    replaces the enforced policy of its name (a StagedNetworkPolicy a NetworkPolicy, a
    StagedGlobalNetworkPolicy a GlobalNetworkPolicy, a StagedKubernetesNetworkPolicy,
    ``knp.default.<name>``, the Kubernetes NetworkPolicy ``<name>``), a staged Delete
    removes it (it selects nothing itself)."""
    staged = {c.key.removeprefix("staged:") for c in view.state.calico_policies if c.staged}
    if not staged:
        return tiers

    def hidden(e: _Entry) -> bool:
        if e.k8s is not None:
            return f"{e.k8s.namespace}/{KUBERNETES_POLICY_PREFIX}{e.k8s.name}" in staged
        return e.calico is not None and not e.calico.staged and e.key in staged

    out = {tier: [e for e in entries if not hidden(e)] for tier, entries in tiers.items()}
    return {tier: entries for tier, entries in out.items() if entries}


def _first_in_tier(
    view: _View, entries: Iterable[_Entry], direction: Direction, ctx: _Context, logged: list[str]
) -> tuple[Action, str] | None:
    """The first deciding rule of a tier's policies, in their order (None: none decides)."""
    for e in entries:
        decided = _first_match(view, e, direction, ctx, logged)
        if decided is not None:
            return decided
    return None


def _first_match(
    view: _View, e: _Entry, direction: Direction, ctx: _Context, logged: list[str]
) -> tuple[Action, str] | None:
    """The action and name of the first rule of ``e`` that decides (Log rules that match are
    appended to ``logged`` and passed over), or None."""
    if e.k8s is not None:
        for i, rule in enumerate(e.k8s.rules(direction)):
            if _rule_matches(
                view,
                e.k8s,
                rule,
                ctx.remote,
                ctx.remote_addr,
                ctx.protocol,
                ctx.port,
                ctx.dst_ports,
            ):
                return "Allow", f"{e.key} {direction}[{i}]"
        return None
    assert e.calico is not None
    for i, crule in enumerate(e.calico.rules(direction)):
        if rule_matches(crule, ctx.packet):
            name = f"{e.calico.tier}/{e.key} {direction}[{i}]"  # as the rule's nft comment
            if crule.action != "Log":
                return crule.action, name
            logged.append(name)
    return None


def _count(n: int, one: str, many: str) -> str:
    return f"{n} {one if n == 1 else many}"


def _walk(
    view: _View, me: _Member, direction: Direction, ctx: _Context, *, staged: bool
) -> DirectionVerdict:
    """The tiers in order: the first rule that decides in the first policy (order, then name)
    that applies decides; Pass leaves the tier; a tier that applies and decides nothing ends
    in its defaultAction; past every tier the profile allows. With ``staged`` (what the
    staged policies would do), each staged policy stands in for the enforced policy of its
    name, a staged Delete for its absence."""
    tiers = _entries(view, me, direction, staged=staged)
    if staged:
        tiers = _staged_world(view, tiers)
    names = tuple(e.key for entries in tiers.values() for e in entries)
    if not names:
        why = f"no policy selects the pod for {direction}"
        return DirectionVerdict(me.ident, direction, (), True, (), why)
    logged: list[str] = []
    passed: list[str] = []
    for tier, entries in tiers.items():
        decided = _first_in_tier(view, entries, direction, ctx, logged)
        where = "" if tier == DEFAULT_TIER else f" in tier {tier}"
        if decided is not None and decided[0] in ("Allow", "Deny"):
            action, rule = decided
            allowed = action == "Allow"
            reason = f"by {rule}" + ("" if allowed else " (Deny)")
            by = (rule,) if allowed else ()
            return DirectionVerdict(
                me.ident, direction, names, allowed, by, reason, tier, rule, tuple(logged)
            )
        if decided is not None:  # Pass: on to the next tier
            passed.append(f"{decided[1]} passed{where}")
            continue
        if view.tier(tier).default_action == "Pass":
            passed.append(f"tier {tier} passed by its defaultAction")
            continue
        count = sum(len(e.rules(direction)) for e in entries)
        reason = (
            f"isolated by {_count(len(entries), 'policy', 'policies')}{where} and none of their"
            f" {_count(count, direction + ' rule', direction + ' rules')} matches"
        )
        return DirectionVerdict(
            me.ident, direction, names, False, (), reason, tier, "", tuple(logged)
        )
    reason = "; ".join(passed) + ": past every tier, the profile allows"
    return DirectionVerdict(me.ident, direction, names, True, (), reason, None, "", tuple(logged))


def _direction_verdict(
    view: _View,
    me: _Member,
    direction: Direction,
    remote: _Member | None,
    remote_addr: IPAddress,
    protocol: str,
    port: int | None,
    packet: Packet,
) -> DirectionVerdict:
    # Named ports resolve on the destination: the selected pod on ingress, the peer on egress.
    if direction == "ingress":
        dst_ports: Sequence[ContainerPort] = me.ports
    else:
        dst_ports = remote.ports if remote is not None else ()
    ctx = _Context(remote, remote_addr, protocol, port, dst_ports, packet)
    verdict = _walk(view, me, direction, ctx, staged=False)
    if not any(c.staged for c in view.state.calico_policies):
        return verdict
    would = _walk(view, me, direction, ctx, staged=True)
    if would.selecting == verdict.selecting:
        return verdict
    said = f"would have {'allowed' if would.allowed else 'denied'}: {would.reason}"
    return dataclasses.replace(verdict, staged=said)


def _resolve(view: _View, t: Target, family: int | None) -> tuple[_Member | None, IPAddress, str]:
    if isinstance(t, tuple):
        ns, name = t
        for m in view.by_ns.get(ns, ()):
            if m.ep.pod == name and m.addresses:
                addrs = [a for a in m.addresses if family is None or a.version == family]
                if addrs:
                    return m, addrs[0], m.ident
        raise LookupError(f"no endpoint with an address for pod {ns}/{name}")
    addr = ipaddress.ip_interface(t).network.network_address
    owner = view.by_addr.get(addr)
    return owner, addr, (f"{owner.ident} ({addr})" if owner is not None else str(addr))


def explain(
    state: ClusterState,
    src: Target,
    dst: Target,
    protocol: str = "TCP",
    port: int | None = None,
    *,
    node: str | None = None,
    host_addresses: Iterable[str] = (),
    source_port: int | None = None,
    icmp_type: int | None = None,
    icmp_code: int | None = None,
    in_interface: str | None = None,
    out_interface: str | None = None,
    failsafes: Failsafes | None = None,
    workload_prefix: str | None = None,
) -> Explanation:
    """Why a new connection ``src -> dst`` (``protocol``/``port``) is allowed or not:
    the source pod's egress (when the source is a pod) and the destination pod's ingress
    (when it is one), each a walk of the tiers (:mod:`policy.calico`) naming the tier,
    policy and rule that decided. Addresses that belong to a pod are that pod; a CIDR
    stands for its first address. ``protocol`` is TCP, UDP, SCTP, or another name or number
    (e.g. ICMP, with ``icmp_type``/``icmp_code``: only rules without ports match it);
    ``source_port`` for Calico rules' source ports. With ``node`` and its
    ``host_addresses``, traffic from those addresses to a pod on that node is allowed
    unpoliced, as the dataplane does (kubelet probes).

    Host endpoints of ``node``: a connection to one of its addresses (``host_addresses``
    and its host endpoints' expected IPs) arriving on ``in_interface``, from one leaving on
    ``out_interface``, or forwarded between the two (either a workload's, i.e. a local
    endpoint's interface or one starting with ``workload_prefix``) meets the stages of the
    host endpoint of that interface (:func:`host_verdicts`); without an interface, that of
    the host endpoint whose expected IPs hold the host's address (else the ``"*"`` one).
    ``failsafes``: Calico's defaults when None."""
    view = _View(state)
    protocol = protocol.upper()
    try:
        number = protocol_number(protocol)
    except ValueError:
        number = -1  # a name no rule can give: only rules without a protocol match
    fam = None
    for t in (src, dst):
        if isinstance(t, str):
            fam = ipaddress.ip_interface(t).version
    s_m, s_addr, s_name = _resolve(view, src, fam)
    d_m, d_addr, d_name = _resolve(view, dst, s_addr.version)
    packet = Packet(
        view.party(s_m, s_addr),
        view.party(d_m, d_addr),
        number,
        source_port,
        port,
        icmp_type,
        icmp_code,
    )
    egress = ingress = None
    if s_m is not None:
        egress = _direction_verdict(view, s_m, "egress", d_m, d_addr, protocol, port, packet)
    hosts = {ipaddress.ip_address(a) for a in host_addresses}
    if d_m is not None and s_m is None and d_m.ep.node == node and s_addr in hosts:
        why = f"traffic from node {node} to its own pods is not policed"
        ingress = DirectionVerdict(d_m.ident, "ingress", (), True, (), why)
    elif d_m is not None:
        ingress = _direction_verdict(view, d_m, "ingress", s_m, s_addr, protocol, port, packet)
    host: tuple[DirectionVerdict, ...] = ()
    if node is not None:
        ends = _HostEnds(s_m, d_m, hosts, in_interface, out_interface, workload_prefix)
        ctx = _Context(None, s_addr, protocol, port, (), packet)
        host = host_verdicts(view, node, ends, ctx, failsafes or Failsafes())
    return Explanation(s_name, d_name, protocol, port, egress, ingress, host)


@dataclasses.dataclass(frozen=True)
class _HostEnds:
    """Where a connection meets the node ``explain`` is asked about."""

    src: _Member | None
    dst: _Member | None
    host_addresses: set[IPAddress]
    in_interface: str | None
    out_interface: str | None
    workload_prefix: str | None


def host_verdicts(
    view: _View, node: str, ends: _HostEnds, ctx: _Context, failsafes: Failsafes
) -> tuple[DirectionVerdict, ...]:
    """The host-endpoint stages of ``node`` one new connection meets, in the dataplane's
    order, up to the first that decides: to the host (untracked, pre-DNAT, then normal
    ingress policy of the arriving interface's endpoint), from it (untracked, then normal
    egress policy of the leaving interface's), or forwarded (untracked and pre-DNAT, then
    applyOnForward ingress policy of the arriving interface's; applyOnForward egress policy
    of the leaving one's). An Allow of untracked or pre-DNAT policy skips every later host
    stage; the failsafe ports are let through before any policy (to or from the host: at
    every stage; forwarded traffic to an inbound failsafe port: before untracked and
    pre-DNAT policy)."""
    pkt = ctx.packet
    sides, failsafe = _host_sides(view, node, ends, pkt, failsafes)
    early = failsafes.match("ingress", pkt.protocol, pkt.dport, pkt.src.address)
    out: list[DirectionVerdict] = []
    for target, stages in sides:
        if target is None:
            continue
        h, labels = target
        who = f"host endpoint {h.name} ({h.interface})"
        for stage in stages:
            kind, direction, _ = HOST_STAGES[stage]
            if failsafe is not None:
                why = f"{stage}: failsafe port {failsafe.text()}, before any policy"
                out.append(DirectionVerdict(who, direction, (), True, (), why))
                return tuple(out)
            if early is not None and kind != "normal":
                continue  # accepted before untracked and pre-DNAT policy; not marked
            verdict, what = _host_stage(view, who, labels, stage, ctx)
            out.append(verdict)
            if what == "deny" or (what == "allow" and kind != "normal"):
                return tuple(out)
            if what == "allow":
                break
    return tuple(out)


_HostOf = tuple[HostEndpoint, Mapping[str, str]]
_Sides = list[tuple[_HostOf | None, tuple[HostStage, ...]]]


def _host_sides(
    view: _View, node: str, ends: _HostEnds, pkt: Packet, failsafes: Failsafes
) -> tuple[_Sides, FailsafePort | None]:
    """The host endpoints a connection meets and their stages, and the failsafe port that
    lets it to or from the host (if any)."""
    mine = _my_hosts(view, node)
    here = set(ends.host_addresses)
    for h, _ in mine:
        here.update(ipaddress.ip_address(a) for a in h.expected_ips)
    local = {m.ep.interface for m in view.members if m.ep.node == node and m.ep.interface}

    def workload(m: _Member | None) -> bool:
        return m is not None and m.ep.node == node

    def hep(iface: str | None, addr: IPAddress | None) -> _HostOf | None:
        return _host_of(mine, local, ends.workload_prefix, iface, addr)

    src, dst = pkt.src.address, pkt.dst.address
    if ends.dst is None and dst in here and not workload(ends.src):
        stages: tuple[HostStage, ...] = ("untracked-ingress", "prednat-ingress", "ingress")
        fs = failsafes.match("ingress", pkt.protocol, pkt.dport, src)
        return [(hep(ends.in_interface, dst), stages)], fs
    if ends.src is None and src in here:
        target = None if workload(ends.dst) else hep(ends.out_interface, src)
        fs = failsafes.match("egress", pkt.protocol, pkt.dport, dst)
        return [(target, ("untracked-egress", "egress"))], fs
    in_hep = None if workload(ends.src) else hep(ends.in_interface, None)
    out_hep = None if workload(ends.dst) else hep(ends.out_interface, None)
    stages = ("untracked-ingress", "prednat-ingress", "forward-ingress")
    return [(in_hep, stages), (out_hep, ("forward-egress",))], None


def _host_of(
    mine: Sequence[_HostOf],
    local: set[str],
    prefix: str | None,
    iface: str | None,
    addr: IPAddress | None,
) -> _HostOf | None:
    """The host endpoint of interface ``iface`` (None for a workload's or ``lo``); without
    one, that whose expected IPs hold ``addr``; else the ``"*"`` one, if any."""
    if iface is None:
        if addr is None:
            return None
        by_ip = [x for x in mine if str(addr) in x[0].expected_ips]
        if by_ip:
            return by_ip[0]
    elif iface == "lo" or iface in local or (prefix and iface.startswith(prefix)):
        return None
    named = [x for x in mine if x[0].interface == iface]
    return named[0] if named else next((x for x in mine if x[0].all_interfaces), None)


def _host_stage(
    view: _View, who: str, labels: Mapping[str, str], stage: HostStage, ctx: _Context
) -> tuple[DirectionVerdict, Literal["allow", "deny", "on"]]:
    """One stage of a host endpoint: its verdict, and ``on`` when it let the packet on
    undecided (an untracked or pre-DNAT stage no rule decided)."""
    kind, direction, forwarded = HOST_STAGES[stage]
    tiers = _host_entries(view, labels, stage)
    names = tuple(e.key for entries in tiers.values() for e in entries)
    if not names:
        if kind != "normal":
            return DirectionVerdict(who, direction, (), True, (), f"{stage}: no policy"), "on"
        if forwarded:
            why = f"{stage}: no applyOnForward policy selects it: forwarded traffic allowed"
            return DirectionVerdict(who, direction, (), True, (), why), "allow"
        why = f"{stage}: no policy selects it: denied (a host endpoint's default)"
        return DirectionVerdict(who, direction, (), False, (), why), "deny"
    logged: list[str] = []
    for tier, entries in tiers.items():
        decided = _first_in_tier(view, entries, direction, ctx, logged)
        if decided is not None and decided[0] in ("Allow", "Deny"):
            action, rule = decided
            allowed = action == "Allow"
            why = f"{stage}: by {rule}" + ("" if allowed else " (Deny)")
            verdict = DirectionVerdict(
                who,
                direction,
                names,
                allowed,
                (rule,) if allowed else (),
                why,
                tier,
                rule,
                tuple(logged),
            )
            return verdict, "allow" if allowed else "deny"
        if decided is None and kind == "normal" and view.tier(tier).default_action == "Deny":
            why = f"{stage}: end of tier {tier}, no rule matched"
            verdict = DirectionVerdict(
                who, direction, names, False, (), why, tier, "", tuple(logged)
            )
            return verdict, "deny"
    if kind != "normal":
        why = f"{stage}: no rule decided, on to the next stage"
        return DirectionVerdict(who, direction, names, True, (), why, None, "", tuple(logged)), "on"
    why = f"{stage}: past every tier: a host endpoint has no profile, denied"
    return DirectionVerdict(who, direction, names, False, (), why, None, "", tuple(logged)), "deny"


def allowed(
    state: ClusterState, src: Target, dst: Target, protocol: str = "TCP", port: int | None = None
) -> bool:
    return explain(state, src, dst, protocol, port).allowed


def contributing(state: ClusterState, sets: Iterable[SetDef]) -> list[SetDef]:
    """The sets among ``sets`` (of a :class:`DesiredState`) that some endpoint of ``state``
    gives elements to, by the rules :func:`compute` fills them with: what tabby-typha asks
    of a workload on another node (``fanout.interest``). ``state`` needs the endpoints, their
    pods and their namespaces; policies play no part."""
    view = _View(state)
    return [d for d in sets if any(_contributes(view, d, m) for m in view.members)]


def selecting_policies(state: ClusterState, namespace: str, pod: str) -> dict[Direction, list[str]]:
    """Which policies select a pod, per direction (``tabbyctl policy explain POD``): by the
    labels of its Pod resource, else of its endpoints. With an endpoint, in the order the
    tiers are walked, a Calico policy as ``<tier>/<policy>`` (staged ones too, named
    ``staged:...``); a pod without one is matched by Kubernetes' policies alone."""
    view = _View(state)
    member = next((m for m in view.by_ns.get(namespace, ()) if m.ep.pod == pod), None)
    if member is not None:
        return {
            d: [
                e.key if e.k8s is not None else f"{e.tier}/{e.key}"
                for entries in _entries(view, member, d, staged=True).values()
                for e in entries
            ]
            for d in _DIRECTIONS
        }
    known = next((p for p in state.pods if (p.namespace, p.name) == (namespace, pod)), None)
    label_sets = [known.labels] if known is not None else []
    label_sets += [e.labels for e in state.endpoints if (e.namespace, e.pod) == (namespace, pod)]
    out: dict[Direction, list[str]] = {"ingress": [], "egress": []}
    for raw in label_sets[:1]:
        labels, items = dict(raw), frozenset(raw)
        for p in sorted(state.policies, key=lambda p: (p.namespace, p.name)):
            if p.namespace == namespace and p.pod_selector.matches(labels, items):
                for d in ("ingress", "egress"):
                    if d in p.types:
                        out[d].append(p.key)
    return out


# -- NAT: the pools, for natOutgoing -------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class NatConfig:
    """IP pools: ``(cidr, nat_outgoing)``. Traffic from a natOutgoing pool to a destination
    outside every pool is masqueraded."""

    pools: tuple[tuple[str, bool], ...] = ()

    def __post_init__(self) -> None:
        norm = sorted(
            {(str(ipaddress.ip_network(c, strict=False)), bool(n)) for c, n in self.pools}
        )
        object.__setattr__(self, "pools", tuple(norm))

    @property
    def enabled(self) -> bool:
        return any(n for _, n in self.pools)

    def elements(self) -> dict[str, frozenset[Element]]:
        out: dict[str, set[Element]] = {
            f"{k}{f}": set() for k in ("nat-src", "pools") for f in (4, 6)
        }
        for cidr, nat in self.pools:
            fam = ipaddress.ip_network(cidr).version
            out[f"pools{fam}"].add(cidr)
            if nat:
                out[f"nat-src{fam}"].add(cidr)
        return {k: frozenset(v) for k, v in out.items()}
