"""The datastore's resources (``resources``) -> the policy engine's inputs.

The models already carry the API server's defaulting and validation (``policyTypes``, a
port's protocol, ``except`` inside ``cidr``, ...); this module only changes representation.
It takes the models typed but imports them only for type checking: the engine's side
(``policy.engine``) stays free of pydantic.

:class:`PolicyInputs` turns a snapshot of the datastore (``resources.index.Documents``) into
the engine's :class:`~policy.engine.ClusterState`, converting each document once per revision.

Calico's kinds (``resources.calico``) become :mod:`policy.calico`'s inputs: a policy's and a
rule side's selectors are compiled here, folded with their namespace, namespaceSelector and
service accounts (``resources.selector.policy_selector`` / ``rule_selector``), so the engine
matches the labels Calico gives endpoints and network sets and nothing else.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, TypeVar, cast

from bundle.calico import DEFAULT_TIER, KUBERNETES_POLICY_ORDER, KUBERNETES_POLICY_PREFIX
from policy import calico, engine
from policy.incremental import Update, UpdateKind, Value
from resources.index import (
    CALICO_POLICIES,
    ENDPOINTS,
    GLOBAL_NETWORK_SETS,
    GLOBAL_POLICIES,
    HOST_ENDPOINTS,
    NAMESPACES,
    NETWORK_SETS,
    PODS,
    POLICIES,
    POOLS,
    SERVICE_ACCOUNTS,
    STAGED_GLOBAL_POLICIES,
    STAGED_KUBERNETES_POLICIES,
    STAGED_POLICIES,
    TIERS,
    Change,
    Documents,
    Kind,
)
from resources.remote import RemoteEndpoint, RemotePod
from resources.selector import (
    Compare,
    Has,
    In,
    Node,
    Not,
    conjunction,
    parse_selector,
    policy_selector,
    rule_selector,
)

if TYPE_CHECKING:
    from resources.calico import CalicoPolicy as CalicoPolicyModel
    from resources.calico import (
        EntityRule,
        GlobalNetworkSet,
        HostEndpoint,
        ICMPFields,
        NetworkSet,
        Rule,
        StagedKubernetesNetworkPolicy,
        Tier,
    )
    from resources.k8s import (
        LabelSelector,
        Namespace,
        NetworkPolicy,
        NetworkPolicyPeer,
        NetworkPolicyPort,
        Pod,
        ServiceAccount,
    )
    from resources.tabby import IPPool, WorkloadEndpoint

M = TypeVar("M")
V = TypeVar("V")


def selector(sel: LabelSelector) -> engine.LabelSelector:
    exprs = tuple(
        engine.Requirement(e.key, e.operator, tuple(e.values or ()))
        for e in sel.matchExpressions or ()
    )
    return engine.LabelSelector(tuple((sel.matchLabels or {}).items()), exprs)


def _peer(p: NetworkPolicyPeer) -> engine.Peer:
    if p.ipBlock is not None:
        block = engine.IPBlock(p.ipBlock.cidr, tuple(p.ipBlock.except_ or ()))
        return engine.Peer(ip_block=block)
    return engine.Peer(
        selector(p.podSelector) if p.podSelector is not None else None,
        selector(p.namespaceSelector) if p.namespaceSelector is not None else None,
    )


def _port(p: NetworkPolicyPort) -> engine.PortSpec:
    return engine.PortSpec(p.protocol, p.port, p.endPort)


def policy(np: NetworkPolicy | StagedKubernetesNetworkPolicy) -> engine.Policy:
    """A Kubernetes NetworkPolicy (or a staged one's spec, as the policy it stages)."""
    spec = np.spec
    ingress = tuple(
        engine.Rule(tuple(_peer(x) for x in r.from_ or ()), tuple(_port(x) for x in r.ports or ()))
        for r in spec.ingress or ()
    )
    egress = tuple(
        engine.Rule(tuple(_peer(x) for x in r.to or ()), tuple(_port(x) for x in r.ports or ()))
        for r in spec.egress or ()
    )
    return engine.Policy(
        np.metadata.namespace or "default",
        np.metadata.name or "",
        selector(spec.podSelector),
        ingress,
        egress,
        tuple(spec.policyTypes or ()),
    )


def staged_kubernetes_policy(p: StagedKubernetesNetworkPolicy) -> calico.CalicoPolicy:
    """A StagedKubernetesNetworkPolicy: the Kubernetes policy it stages in Calico's form
    (:func:`as_calico`), staged; a staged ``Delete`` as :func:`staged_delete`."""
    if p.spec.stagedAction == "Delete":
        name = f"{KUBERNETES_POLICY_PREFIX}{p.metadata.name or ''}"
        return staged_delete(name, p.metadata.namespace or "default", DEFAULT_TIER)
    return as_calico(policy(p), staged=True)


#: What a staged Delete selects: nothing (it only hides its enforced namesake from explain's
#: "would"; no endpoint program ever holds it).
_NOTHING = parse_selector("!all()")


def staged_delete(name: str, namespace: str | None, tier: str) -> calico.CalicoPolicy:
    """A staged ``Delete`` of the enforced policy ``namespace/name`` (``knp.default.<name>``:
    a Kubernetes NetworkPolicy's): no rules, selecting nothing."""
    return calico.CalicoPolicy(
        name, namespace, _NOTHING, tier, None, frozenset(), staged=True, staged_delete=True
    )


def as_calico(pol: engine.Policy, *, staged: bool = False) -> calico.CalicoPolicy:
    """A Kubernetes NetworkPolicy as Calico converts one: a NetworkPolicy of its namespace
    named ``knp.default.<name>`` in tier ``default`` at order 1000, its pod selector as the
    selector, each (peer, protocol) of a rule an ``Allow`` rule (the peer on the remote
    side: its pod selector scoped to the policy's namespace or to its namespace selector, or
    its ipBlock as ``nets``/``notNets``; the rule's ports of that protocol on the
    destination), so that it decides in the walk exactly as the policy itself does."""
    rules = {d: tuple(_calico_rules(pol, d)) for d in ("ingress", "egress")}
    return calico.CalicoPolicy(
        f"{KUBERNETES_POLICY_PREFIX}{pol.name}",
        pol.namespace,
        policy_selector(_selector_text(pol.pod_selector), namespace=pol.namespace),
        DEFAULT_TIER,
        KUBERNETES_POLICY_ORDER,
        pol.types,
        rules["ingress"],
        rules["egress"],
        staged,
    )


def _selector_text(sel: engine.LabelSelector) -> str:
    """A Kubernetes label selector in Calico's language (the empty one: ``all()``)."""
    nodes: list[Node] = [Compare(k, "==", v) for k, v in sel.match_labels]
    for r in sel.match_expressions:
        if r.operator in ("In", "NotIn"):
            nodes.append(In(r.key, frozenset(r.values), r.operator == "NotIn"))
        else:
            nodes.append(Has(r.key) if r.operator == "Exists" else Not(Has(r.key)))
    return str(conjunction(nodes))


def _calico_rules(pol: engine.Policy, direction: calico.Direction) -> list[calico.CalicoRule]:
    out = []
    for rule in pol.rules(direction):
        # per protocol (None: no ports, any protocol) its ports; none: every port of it
        by_protocol: dict[int | None, list[calico.PortMatch]] = {}
        every: set[int | None] = set() if rule.ports else {None}
        for spec in rule.ports:
            number: int | None = calico.protocol_number(spec.protocol)
            ports = by_protocol.setdefault(number, [])
            if spec.port is None:
                every.add(number)
            elif isinstance(spec.port, str):
                ports.append(calico.PortMatch(name=spec.port))
            else:
                ports.append(calico.PortMatch(spec.port, spec.end_port or spec.port))
        if not rule.ports:
            by_protocol[None] = []
        for peer in rule.peers or (None,):
            remote = _calico_peer(pol, peer)
            for number, ports in by_protocol.items():
                where = () if number in every else tuple(ports)
                if direction == "ingress":
                    src, dst = remote, calico.EntityMatch(ports=where)
                else:
                    src, dst = calico.ANY, dataclasses.replace(remote, ports=where)
                out.append(calico.CalicoRule("Allow", number, source=src, destination=dst))
    return out


def _calico_peer(pol: engine.Policy, peer: engine.Peer | None) -> calico.EntityMatch:
    if peer is None:
        return calico.ANY
    if peer.ip_block is not None:
        return calico.EntityMatch(nets=(peer.ip_block.cidr,), not_nets=peer.ip_block.except_)
    pods = peer.pod_selector
    spaces = peer.namespace_selector
    return calico.EntityMatch(
        selector=rule_selector(
            _selector_text(pods) if pods is not None else "all()",
            namespace_selector=_selector_text(spaces) if spaces is not None else None,
            policy_namespace=pol.namespace,
        )
    )


def namespace(ns: Namespace) -> engine.Namespace:
    return engine.Namespace(ns.metadata.name or "", tuple((ns.metadata.labels or {}).items()))


def service_account(sa: ServiceAccount) -> engine.ServiceAccount:
    return engine.ServiceAccount(
        sa.metadata.namespace or "default",
        sa.metadata.name or "",
        tuple((sa.metadata.labels or {}).items()),
    )


#: The engine's named ports of another node's records, by their (shared) ports: the pods
#: of one workload have the same (a cache, emptied when it grows past 10k).
_ports: dict[tuple[tuple[str, str, int], ...], tuple[engine.ContainerPort, ...]] = {}


def pod(p: Pod | RemotePod) -> engine.Pod:
    """A Pod, whole or as another node's record (the same values: ``resources.remote``)."""
    if isinstance(p, RemotePod):
        ports = _ports.get(p.ports)
        if ports is None:
            if len(_ports) >= 10_000:
                _ports.clear()
            ports = _ports[p.ports] = tuple(
                engine.ContainerPort(name, number, proto) for name, proto, number in p.ports
            )
        return engine.Pod(p.namespace, p.name, p.labels, ports, p.service_account)
    ports = tuple(
        engine.ContainerPort(name, number, proto) for name, proto, number in p.named_ports()
    )
    return engine.Pod(
        p.metadata.namespace or "default",
        p.metadata.name or "",
        tuple((p.metadata.labels or {}).items()),
        ports,
        p.spec.serviceAccountName or "",
    )


def endpoint(wep: WorkloadEndpoint | RemoteEndpoint) -> engine.Endpoint:
    """One without ``hostInterface`` gets an empty interface: its addresses count for
    selectors, but no chain is made for it. Another node's record has the same values
    (``resources.remote``), and its strings are shared with the engine's input."""
    if isinstance(wep, RemoteEndpoint):
        return engine.Endpoint(
            wep.namespace,
            wep.pod,
            wep.node,
            wep.interface,
            wep.addresses,
            wep.name,
            wep.labels,
        )
    return engine.Endpoint(
        wep.metadata.namespace or "default",
        wep.spec.pod,
        wep.spec.node,
        wep.spec.hostInterface or "",
        tuple(wep.spec.ipNetworks),
        wep.metadata.name or "",
        tuple((wep.metadata.labels or {}).items()),
    )


def _icmp(fields: ICMPFields | None) -> calico.IcmpMatch | None:
    if fields is None or fields.type is None:
        return None  # no type: any message (a code needs a type)
    return calico.IcmpMatch(fields.type, fields.code)


def _side(e: EntityRule, namespace: str | None) -> calico.EntityMatch:
    accounts = e.serviceAccounts
    return calico.EntityMatch(
        tuple(e.nets or ()),
        tuple(e.notNets or ()),
        rule_selector(
            e.selector,
            not_selector=e.notSelector,
            namespace_selector=e.namespaceSelector,
            service_account_selector=accounts.selector if accounts else None,
            service_account_names=(accounts.names or ()) if accounts else (),
            policy_namespace=namespace,
        ),
        parse_selector(e.notSelector) if e.notSelector else None,
        tuple(calico.PortMatch.parse(p) for p in e.ports or ()),
        tuple(calico.PortMatch.parse(p) for p in e.notPorts or ()),
    )


def _rule(r: Rule, namespace: str | None) -> calico.CalicoRule:
    return calico.CalicoRule(
        r.action,
        r.protocol_number,
        r.not_protocol_number,
        _icmp(r.icmp),
        _icmp(r.notICMP),
        r.ipVersion,
        _side(r.source, namespace),
        _side(r.destination, namespace),
    )


def calico_policy(p: CalicoPolicyModel) -> calico.CalicoPolicy:
    """A Calico policy kind (NetworkPolicy, GlobalNetworkPolicy, their staged kinds; a
    staged ``Delete`` as :func:`staged_delete`)."""
    spec = p.spec
    namespace = p.metadata.namespace if p.NAMESPACED else None
    if p.NAMESPACED and namespace is None:
        namespace = "default"
    if getattr(spec, "stagedAction", "Set") == "Delete":
        return staged_delete(p.name, namespace, spec.tier)
    selector = policy_selector(
        spec.selector,
        namespace=namespace,
        namespace_selector=getattr(spec, "namespaceSelector", None),
        service_account_selector=spec.serviceAccountSelector,
    )
    types = frozenset(cast("calico.Direction", t.lower()) for t in spec.types or ("Ingress",))
    return calico.CalicoPolicy(
        p.name,
        namespace,
        selector,
        spec.tier,
        spec.order,
        types,
        tuple(_rule(r, namespace) for r in spec.ingress or ()),
        tuple(_rule(r, namespace) for r in spec.egress or ()),
        p.KIND.startswith("Staged"),
        getattr(spec, "preDNAT", False),
        getattr(spec, "doNotTrack", False),
        getattr(spec, "applyOnForward", False),
    )


def host_endpoint(h: HostEndpoint) -> calico.HostEndpoint:
    spec = h.spec
    labels = tuple((h.metadata.labels or {}).items())
    return calico.HostEndpoint(
        h.name, spec.node, spec.interfaceName, tuple(spec.expectedIPs or ()), labels
    )


def network_set(s: NetworkSet | GlobalNetworkSet) -> calico.NetworkSet:
    namespace = (s.metadata.namespace or "default") if s.NAMESPACED else None
    nets = tuple(str(n) for n in s.spec.networks())
    return calico.NetworkSet(s.name, namespace, tuple((s.metadata.labels or {}).items()), nets)


def tier(t: Tier) -> calico.Tier:
    return calico.Tier(t.name, t.spec.order, t.spec.defaultAction)


def cluster_state(
    policies: Iterable[NetworkPolicy],
    namespaces: Iterable[Namespace],
    pods: Iterable[Pod | RemotePod],
    endpoints: Iterable[WorkloadEndpoint | RemoteEndpoint],
) -> engine.ClusterState:
    return engine.ClusterState(
        tuple(policy(p) for p in policies),
        tuple(namespace(n) for n in namespaces),
        tuple(pod(p) for p in pods),
        tuple(endpoint(e) for e in endpoints),
    )


def nat(pools: Iterable[IPPool]) -> engine.NatConfig:
    """NAT input from the IP pools (disabled pools still count as pool space)."""
    return engine.NatConfig(tuple((p.spec.cidr, p.spec.natOutgoing) for p in pools))


def pod_key(wep: WorkloadEndpoint | RemoteEndpoint) -> str:
    """The key (``<namespace>/<name>``) of the Pod an endpoint belongs to."""
    if isinstance(wep, RemoteEndpoint):
        return f"{wep.namespace}/{wep.pod}"
    return f"{wep.metadata.namespace or 'default'}/{wep.spec.pod}"


def _engine_key(value: object) -> str:
    """The key an engine input is known by in :class:`~policy.incremental.Update`."""
    if isinstance(value, engine.Namespace):
        return value.name
    if isinstance(value, engine.Policy | engine.Pod | engine.Endpoint | engine.ServiceAccount):
        return f"{value.namespace}/{value.name}"
    if isinstance(value, calico.CalicoPolicy | calico.NetworkSet | calico.HostEndpoint):
        return value.key
    if isinstance(value, calico.Tier):
        return value.name
    raise TypeError(f"not an engine input: {value!r}")


#: The update kinds whose engine key is their document's store key (not Calico's: a staged
#: policy's engine key is ``staged:<key>``).
_SAME_KEYS: frozenset[UpdateKind] = frozenset(
    {"policy", "namespace", "service-account", "pod", "endpoint"}
)

#: store kind -> (engine update kind, conversion)
_UPDATES: dict[str, tuple[UpdateKind, Callable[[Any], object]]] = {
    POLICIES.name: ("policy", lambda m: policy(m)),
    NAMESPACES.name: ("namespace", lambda m: namespace(m)),
    SERVICE_ACCOUNTS.name: ("service-account", lambda m: service_account(m)),
    PODS.name: ("pod", lambda m: pod(m)),
    ENDPOINTS.name: ("endpoint", lambda m: endpoint(m)),
    **{
        k.name: ("calico-policy", lambda m: calico_policy(m))
        for k in (CALICO_POLICIES, GLOBAL_POLICIES, STAGED_POLICIES, STAGED_GLOBAL_POLICIES)
    },
    STAGED_KUBERNETES_POLICIES.name: ("calico-policy", lambda m: staged_kubernetes_policy(m)),
    NETWORK_SETS.name: ("network-set", lambda m: network_set(m)),
    GLOBAL_NETWORK_SETS.name: ("network-set", lambda m: network_set(m)),
    TIERS.name: ("tier", lambda m: tier(m)),
    HOST_ENDPOINTS.name: ("host-endpoint", lambda m: host_endpoint(m)),
}


class PolicyInputs:
    """The policy engine's inputs from a snapshot of the datastore, converted document by
    document and kept per (kind, key, revision): a pass converts only what changed since the
    last one (a revision is never reused for a key). Converting every policy on every watch
    event cost ~35 ms per pass at 200 policies, on every node, for every pod added anywhere.
    A fresh object converts everything (``tabbyctl policy explain`` does that).

    :meth:`updates` converts only the documents that changed (``Index.drain``) into the
    incremental engine's :class:`~policy.incremental.Update` s; it relies on the last
    :meth:`convert` (or :meth:`updates`) for what each store key held before (a deletion
    names the engine input to remove; the NAT update needs every pool)."""

    def __init__(self) -> None:
        self._memo: dict[str, dict[str, tuple[int, object]]] = {}
        self._pools: dict[str, tuple[str, bool]] = {}

    def convert(self, docs: Documents) -> tuple[engine.ClusterState, engine.NatConfig]:
        policies = [
            p
            for kind in (CALICO_POLICIES, GLOBAL_POLICIES, STAGED_POLICIES, STAGED_GLOBAL_POLICIES)
            for p in self._each(docs, kind, calico_policy)
        ]
        policies += self._each(docs, STAGED_KUBERNETES_POLICIES, staged_kubernetes_policy)
        sets = self._each(docs, NETWORK_SETS, network_set)
        sets += self._each(docs, GLOBAL_NETWORK_SETS, network_set)
        state = engine.ClusterState(
            tuple(self._each(docs, POLICIES, policy)),
            tuple(self._each(docs, NAMESPACES, namespace)),
            tuple(self._each(docs, PODS, pod)),
            tuple(self._each(docs, ENDPOINTS, endpoint)),
            tuple(policies),
            tuple(sets),
            tuple(self._each(docs, TIERS, tier)),
            tuple(self._each(docs, HOST_ENDPOINTS, host_endpoint)),
            tuple(self._each(docs, SERVICE_ACCOUNTS, service_account)),
        )
        pools = [e.value for _, e in sorted(docs.of(POOLS).items())]
        self._pools = {
            k: (e.value.spec.cidr, e.value.spec.natOutgoing) for k, e in docs.of(POOLS).items()
        }
        return state, nat(pools)

    def updates(self, changes: Iterable[Change]) -> list[Update]:
        """The engine updates for changed documents, in their order (a pool change: one
        NAT update, last). Kinds the policy engine does not read are skipped. A document
        whose engine identity (namespace/name) changed under the same store key gives a
        removal of the old one first."""
        converted: list[tuple[Change, UpdateKind, object | None]] = []
        pools = dict(self._pools)
        nat_changed = False
        for ch in changes:
            if ch.kind == POOLS.name:
                if ch.value is None:
                    pools.pop(ch.key, None)
                else:
                    spec = cast("IPPool", ch.value).spec
                    pools[ch.key] = (spec.cidr, spec.natOutgoing)
                nat_changed = True
                continue
            how = _UPDATES.get(ch.kind)
            if how is None:
                continue
            kind, fn = how
            converted.append((ch, kind, None if ch.value is None else fn(ch.value)))
        out: list[Update] = []
        for ch, kind, value in converted:  # every conversion succeeded: now record them
            memo = self._memo.setdefault(ch.kind, {})
            held = memo.get(ch.key)
            old_key = _engine_key(held[1]) if held is not None else None
            if value is None:  # deleted
                memo.pop(ch.key, None)
                if old_key is not None:
                    out.append(Update(kind, old_key, None))
                elif kind in _SAME_KEYS:  # not held: its store key is the engine's
                    out.append(Update(kind, ch.key, None))
                continue
            memo[ch.key] = (-1, value)  # no revision: the next convert converts it again
            key = _engine_key(value)
            if old_key is not None and old_key != key:
                out.append(Update(kind, old_key, None))
            out.append(Update(kind, key, cast("Value", value)))
        if nat_changed:
            self._pools = pools
            out.append(Update("nat", "", engine.NatConfig(tuple(pools.values()))))
        return out

    def _each(self, docs: Documents, kind: Kind[M], fn: Callable[[M], V]) -> list[V]:
        old = self._memo.get(kind.name, {})
        memo: dict[str, tuple[int, object]] = {}
        out: list[V] = []
        for key, entry in sorted(docs.of(kind).items()):
            hit = old.get(key)
            if hit is not None and hit[0] == entry.revision:
                value = cast("V", hit[1])  # converted by this very function
            else:
                value = fn(entry.value)
            memo[key] = (entry.revision, value)
            out.append(value)
        self._memo[kind.name] = memo
        return out
