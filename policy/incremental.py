"""The policy IR kept up to date change by change: work per event for what the event touched.

:func:`policy.engine.compute` derives a node's :class:`~policy.engine.DesiredState` from the
whole cluster; at 20,000 endpoints and 200 policies that is half a second, and tabby-node
would pay it on every node for every pod started anywhere. :class:`IncrementalPolicy` holds
the same inputs indexed and the same IR in mutable form, and turns each input change into
the IR change it causes:

* an endpoint (a WorkloadEndpoint) put or removed: its addresses join or leave the pod sets
  whose selectors match it and the named-port sets of its pod's port names, i.e. work in the
  number of sets, not of endpoints; when it is local, its program (and the chains of the
  policies that start or stop selecting something here);
* a pod relabelled (or its named ports changed): the same for each of its endpoints;
* a namespace relabelled: the namespace-selector sets whose verdict on it flips, for the
  endpoints of that namespace;
* a policy put or removed: its chains, the sets they use (a new pod set is filled by
  scanning the endpoints of the namespaces in its scope, a new named-port set those of the
  pods declaring the port name), the programs of the local endpoints it selects; chains no
  local endpoint needs and sets no chain uses go;
* the IP pools (NAT);
* Calico's model (:mod:`policy.calico`), followed the same way: a rule selector's sets hold
  the addresses of the endpoints (and host endpoints' expected IPs) it matches, counted, and
  the nets of the network sets it matches (computed again for the selectors a changed
  network set matches); a policy's chains are built once per revision and exist while a
  local endpoint it applies to or a host endpoint's program uses them; per local endpoint
  the Calico policies whose selector selects it are kept, so that its tiered program is
  built from its own policies (:func:`~policy.engine.tier_entries`,
  :func:`~policy.engine.tiered_program`). A Calico policy put or removed tests its selector
  against the local endpoints; a local endpoint (or its pod, or its namespace's labels)
  tests its labels against every Calico policy; a tier rebuilds the programs of the local
  endpoints with a policy in it; this node's host endpoints' programs are made again on any
  change of Calico's policies, tiers or of this node's host endpoints (a few per node).
  Entering or leaving the model, or the node's first host endpoint or its last, replaces
  the table (:attr:`Delta.replace`); no change is a full computation.

A program touched by a batch of changes is made once, when next read.

Set membership is reference-counted per element: two endpoints with one address, an address
in several sets, an endpoint moving between sets on a relabel all leave each set exactly
what :func:`~policy.engine.compute` would put in it.

Every change is also accumulated into a :class:`Delta` (set elements added and removed,
sets, chains and endpoint programs created, changed and deleted, the NAT pools), net over
the changes since the last :meth:`IncrementalPolicy.take_delta`: what the dataplane must
send to the kernel and nothing else. :meth:`IncrementalPolicy.desired` materialises the IR;
it equals ``compute(state(), node, families)`` after any sequence of changes (the unit tests
replay random sequences and compare after every one). Pure, no I/O, not thread-safe (the
dataplane holds its lock around it).
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import Literal, TypeVar

from bundle.calico import endpoint_labels
from policy import engine
from policy.calico import DEFAULT_TIER, CalicoPolicy, HostEndpoint, Matcher, NetworkSet, Tier
from policy.counters import chain_counters
from policy.engine import (
    NAMESPACE_NAME_LABEL,
    ClusterState,
    ContainerPort,
    DesiredState,
    Direction,
    Element,
    Endpoint,
    EndpointProgram,
    Family,
    HostProgram,
    Labels,
    LabelSelector,
    Namespace,
    NatConfig,
    Pod,
    Policy,
    PolicyChain,
    ServiceAccount,
    SetDef,
)

UpdateKind = Literal[
    "policy",
    "namespace",
    "pod",
    "endpoint",
    "nat",
    "calico-policy",
    "network-set",
    "tier",
    "host-endpoint",
    "service-account",
]
Value = (
    Policy
    | Namespace
    | Pod
    | Endpoint
    | NatConfig
    | CalicoPolicy
    | NetworkSet
    | Tier
    | HostEndpoint
    | ServiceAccount
)
_Key = tuple[str, str]
_DIRECTIONS: tuple[Direction, Direction] = ("ingress", "egress")
K = TypeVar("K")
V = TypeVar("V")


@dataclasses.dataclass(frozen=True, slots=True)
class Update:
    """One input as it is now (``value``), or gone (``None``). ``key``: ``namespace/name``
    of a policy, pod or endpoint (the endpoint's own name, not its pod's), the name of a
    namespace, ``""`` for the NAT pools (whose value is never None); a Calico policy's or
    network set's ``key`` (:attr:`~policy.calico.CalicoPolicy.key`), a tier's name."""

    kind: UpdateKind
    key: str
    value: Value | None


@dataclasses.dataclass(frozen=True)
class Delta:
    """What changed in the IR since the last :meth:`IncrementalPolicy.take_delta`, net.

    Sets: ``new_sets`` (with all their elements in ``new_elements``) and ``gone_sets``;
    ``added`` / ``removed`` elements of sets that existed before and still do. Chains and
    endpoint programs (by interface): created, changed (programs with their old value: a
    change of addresses alone changes no rule), deleted. ``nat``: (before, now) when the
    pools changed."""

    new_sets: Mapping[str, SetDef] = dataclasses.field(default_factory=dict)
    new_elements: Mapping[str, frozenset[Element]] = dataclasses.field(default_factory=dict)
    gone_sets: tuple[str, ...] = ()
    added: Mapping[str, frozenset[Element]] = dataclasses.field(default_factory=dict)
    removed: Mapping[str, frozenset[Element]] = dataclasses.field(default_factory=dict)
    new_chains: Mapping[str, PolicyChain] = dataclasses.field(default_factory=dict)
    changed_chains: Mapping[str, PolicyChain] = dataclasses.field(default_factory=dict)
    gone_chains: tuple[str, ...] = ()
    new_endpoints: Mapping[str, EndpointProgram] = dataclasses.field(default_factory=dict)
    changed_endpoints: Mapping[str, tuple[EndpointProgram, EndpointProgram]] = dataclasses.field(
        default_factory=dict
    )
    gone_endpoints: tuple[str, ...] = ()
    nat: tuple[NatConfig, NatConfig] | None = None
    #: the per-rule counters of the gone chains of Calico policies, by chain (a Kubernetes
    #: policy's chain has one, ``pkt-<chain>``)
    gone_rule_counters: Mapping[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    #: only a whole new table can do it: the engine entered or left Calico's model
    replace: bool = False
    #: this node's host endpoints' programs (before, now) when they changed (the host
    #: chains are few: the renderer writes them all again)
    hosts: tuple[Mapping[str, HostProgram], Mapping[str, HostProgram]] | None = None

    @property
    def empty(self) -> bool:
        return not self.size and not self.replace

    @property
    def size(self) -> int:
        """How many things changed: sets, elements, chains, programs, NAT pools."""
        n = len(self.new_sets) + len(self.gone_sets) + len(self.new_chains)
        n += len(self.changed_chains) + len(self.gone_chains) + len(self.new_endpoints)
        n += len(self.changed_endpoints) + len(self.gone_endpoints)
        n += sum(len(e) for e in self.added.values()) + sum(len(e) for e in self.removed.values())
        if self.nat is not None:
            n += len(set(self.nat[0].pools) ^ set(self.nat[1].pools))
        if self.hosts is not None:
            was, now = self.hosts
            n += len(was.keys() ^ now.keys())
            n += sum(1 for k in was.keys() & now.keys() if was[k] != now[k])
        return n


def differences(
    a: DesiredState, b: DesiredState, nat_a: NatConfig | None = None, nat_b: NatConfig | None = None
) -> int:
    """How many things differ between two IRs (and NAT pools), counted as :attr:`Delta.size`
    counts them: what the periodic full check reports it had to fix."""
    n = len(a.sets.keys() ^ b.sets.keys())
    for name in a.sets.keys() & b.sets.keys():
        ea, eb = a.elements[name], b.elements[name]
        if ea is not eb and ea != eb:
            n += len(ea ^ eb)
    n += len(a.chains.keys() ^ b.chains.keys())
    n += sum(1 for c in a.chains.keys() & b.chains.keys() if a.chains[c] != b.chains[c])
    n += len(a.endpoints.keys() ^ b.endpoints.keys())
    n += sum(1 for i in a.endpoints.keys() & b.endpoints.keys() if a.endpoints[i] != b.endpoints[i])
    if nat_a is not None and nat_b is not None:
        n += len(set(nat_a.pools) ^ set(nat_b.pools))
    n += len(a.hosts.keys() ^ b.hosts.keys())
    n += sum(1 for h in a.hosts.keys() & b.hosts.keys() if a.hosts[h] != b.hosts[h])
    return n


@functools.lru_cache(maxsize=8192)
def _label_view(raw: Labels) -> tuple[Mapping[str, str], frozenset[tuple[str, str]]]:
    """A label tuple as the selectors read it; shared by every endpoint with these labels."""
    return dict(raw), frozenset(raw)


@functools.lru_cache(maxsize=65536)
def _calico_view(
    items: frozenset[tuple[str, str]],
    ns: str,
    namespace: Namespace | None,
    account: str,
    service_account: ServiceAccount | None,
) -> Mapping[str, str]:
    """The labels Calico's selectors read on an endpoint (its own, its namespace's under
    ``pcns.``, its service account's under ``pcsa.``), as :mod:`policy.engine` gives them
    (never to be changed)."""
    return endpoint_labels(
        dict(items),
        namespace=ns,
        namespace_labels=_ns_view(namespace, ns)[0],
        service_account=account or None,
        service_account_labels=dict(service_account.labels) if service_account else None,
    )


def _ns_view(ns: Namespace | None, name: str) -> tuple[dict[str, str], frozenset[tuple[str, str]]]:
    labels = ns.effective_labels if ns is not None else {NAMESPACE_NAME_LABEL: name}
    return labels, frozenset(labels.items())


@dataclasses.dataclass(slots=True, eq=False)
class _Member:
    """An endpoint with what selectors read resolved: its pod's labels and named ports (its
    own labels and no ports when the pod is unknown), its addresses by family."""

    ep: Endpoint
    labels: Mapping[str, str]
    items: frozenset[tuple[str, str]]
    ports: tuple[ContainerPort, ...]
    #: IPv4 and IPv6 addresses, each once
    v4: tuple[str, ...]
    v6: tuple[str, ...]
    #: on this node with a host interface: it gets a program
    local: bool
    #: its pod's service account ("" when none is known; Calico's labels name it)
    account: str = ""
    #: the policies selecting it (local endpoints only: the others have none)
    selected: set[_Key] | None = None
    #: the Calico policies whose selector selects it (local endpoints only)
    calico: set[str] | None = None
    #: the labels Calico's selectors read on it (:func:`_calico_view`), once asked
    clabels: Mapping[str, str] | None = None

    @property
    def ns(self) -> str:
        return self.ep.namespace

    def addrs(self, fam: int) -> tuple[str, ...]:
        return self.v4 if fam == 4 else self.v6

    def policies(self) -> set[_Key]:
        assert self.selected is not None, "a remote endpoint has no policies"
        return self.selected

    def calico_of(self) -> set[str]:
        assert self.calico is not None, "a remote endpoint has no policies"
        return self.calico

    def same_for_sets(self, other: _Member) -> bool:
        return (
            self.ep.namespace == other.ep.namespace
            and self.items == other.items
            and self.ports == other.ports
            and self.v4 == other.v4
            and self.v6 == other.v6
            and self.account == other.account
        )


@dataclasses.dataclass(slots=True, eq=False)
class _Group:
    """The sets of one selector (one per family): a pod selector in a namespace scope (the
    policy's namespace, or a namespace selector), or a container-port name."""

    scope: str | LabelSelector | None
    pods: LabelSelector | None
    port: str | None
    names: dict[int, str]
    #: a Calico rule's selector: the endpoints' addresses (``sel``) or the network sets'
    #: nets (``selnet``) it matches
    selector: Matcher | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class _Template:
    """A policy's chain for one direction, the sets it uses and their fixed elements."""

    chain: PolicyChain
    sets: dict[str, SetDef]
    fixed: dict[str, frozenset[Element]]


def _group_id(name: str) -> str:
    """The sets of one selector differ only by the family digit after the kind letter."""
    return name[:1] + name[2:]


class IncrementalPolicy:
    """The inputs of :func:`policy.engine.compute` for one node, indexed, and the IR they
    give, kept up to date by ``put_*`` / ``remove_*`` / :meth:`set_nat` (or
    :meth:`apply` of :class:`Update` s, or :meth:`load` of a whole state).
    :meth:`take_delta` returns what changed since it was last called."""

    def __init__(self, node: str, families: Iterable[Family] = (4, 6)) -> None:
        self.node = node
        self.families: tuple[Family, ...] = tuple(sorted(set(families)))
        # inputs
        self._policies: dict[_Key, Policy] = {}
        self._policies_by_ns: dict[str, dict[_Key, Policy]] = {}
        self._namespaces: dict[str, Namespace] = {}
        self._pods: dict[_Key, Pod] = {}
        self._endpoints: dict[_Key, _Member] = {}
        self._nat = NatConfig()
        # indexes of the endpoints
        self._eps_by_ns: dict[str, set[_Key]] = {}
        self._eps_by_pod: dict[_Key, list[_Key]] = {}
        self._local_by_ns: dict[str, set[_Key]] = {}
        self._iface_eps: dict[str, set[_Key]] = {}
        # policy -> how many local endpoints it selects (its chains exist while > 0)
        self._selects: dict[_Key, int] = {}
        self._templates: dict[tuple[_Key, Direction], _Template] = {}
        # the IR
        self._chains: dict[str, PolicyChain] = {}
        self._chain_sets: dict[str, tuple[str, ...]] = {}
        self._sets: dict[str, SetDef] = {}
        self._set_refs: dict[str, int] = {}
        self._members: dict[str, dict[Element, int]] = {}
        self._groups: dict[str, _Group] = {}
        self._groups_by_scope: dict[str, set[str]] = {}
        self._groups_nssel: set[str] = set()
        self._groups_by_port: dict[str, str] = {}
        self._programs: dict[str, EndpointProgram] = {}
        self._dirty: set[str] = set()  # interfaces whose program is to be made again
        # counts (metrics) kept as the IR changes
        self._n_elements = 0
        self._n_chain_rules = 0
        self._n_program_rules = 0
        # what changed since the last take_delta: set -> existed at its start; net elements
        self._d_sets: dict[str, bool] = {}
        self._d_added: dict[str, set[Element]] = {}
        self._d_removed: dict[str, set[Element]] = {}
        self._d_chains: dict[str, PolicyChain | None] = {}
        self._d_programs: dict[str, EndpointProgram | None] = {}
        self._d_nat: NatConfig | None = None
        self._state: ClusterState | None = None
        # Calico's kinds, followed change by change as well (see the module docstring)
        self._calico: dict[str, CalicoPolicy] = {}
        self._network_sets: dict[str, NetworkSet] = {}
        self._tiers: dict[str, Tier] = {}
        self._host_endpoints: dict[str, HostEndpoint] = {}
        #: service accounts by ``namespace/name``: their labels are Calico's (``pcsa.``)
        self._accounts: dict[str, ServiceAccount] = {}
        self._c_templates: dict[tuple[str, Direction], _Template] = {}
        # Calico policy -> the local endpoints its selector selects
        self._c_local: dict[str, set[_Key]] = {}
        # Calico policy -> its chains now, by direction
        self._c_chains: dict[str, dict[Direction, str]] = {}
        # Calico policy -> the directions the node's host endpoints' programs use it in
        self._c_host_dirs: dict[str, set[Direction]] = {}
        self._hosts: dict[str, HostProgram] = {}
        self._groups_sel: set[str] = set()
        self._groups_selnet: set[str] = set()
        # what the last take_delta sent: Calico's model or not, the host programs
        self._sent_calico = False
        self._sent_hosts: dict[str, HostProgram] = {}

    # -- reading ----------------------------------------------------------------------------

    @property
    def nat(self) -> NatConfig:
        return self._nat

    def state(self) -> ClusterState:
        """The inputs as a :class:`ClusterState` (explain and trace read it)."""
        if self._state is None:
            self._state = ClusterState(
                tuple(self._policies.values()),
                tuple(self._namespaces.values()),
                tuple(self._pods.values()),
                tuple(m.ep for m in self._endpoints.values()),
                tuple(self._calico.values()),
                tuple(self._network_sets.values()),
                tuple(self._tiers.values()),
                tuple(self._host_endpoints.values()),
                tuple(self._accounts.values()),
            )
        return self._state

    @property
    def calico(self) -> bool:
        """Whether a Calico policy (staged or not) or a host endpoint of this node exists:
        the table is then in Calico's model (entering or leaving it replaces the table)."""
        return bool(self._calico) or any(
            h.node == self.node and h.interface for h in self._host_endpoints.values()
        )

    @property
    def calico_policies(self) -> Mapping[str, CalicoPolicy]:
        """The Calico policies by key (read-only, live)."""
        return MappingProxyType(self._calico)

    def desired(self) -> DesiredState:
        """The IR, materialised: equal to ``compute(self.state(), node, families)``."""
        self._flush()
        return DesiredState(
            dict(self._sets),
            {name: frozenset(elems) for name, elems in self._members.items()},
            dict(self._chains),
            dict(self._programs),
            len(self._policies) + len(self._calico),
            dict(self._hosts),
        )

    @property
    def policies(self) -> Mapping[tuple[str, str], Policy]:
        """The policies by (namespace, name) (read-only, live)."""
        return MappingProxyType(self._policies)

    @property
    def chains(self) -> Mapping[str, PolicyChain]:
        """The policy chains now (read-only, live: no copy): what ``desired().chains`` holds."""
        return MappingProxyType(self._chains)

    @property
    def programs(self) -> Mapping[str, EndpointProgram]:
        """The endpoint programs by interface now (read-only, live): ``desired().endpoints``."""
        self._flush()
        return MappingProxyType(self._programs)

    def stats(self) -> tuple[int, int, int, int, int]:
        """(endpoint programs, policies, rules, sets, set elements) of the IR, without
        materialising it; rules as the dataplane counts them (policy chains' rules, and per
        endpoint and direction its jumps and final verdict)."""
        self._flush()
        rules = self._n_chain_rules + self._n_program_rules
        policies = len(self._policies) + len(self._calico)
        return len(self._programs), policies, rules, len(self._sets), self._n_elements

    # -- changes ----------------------------------------------------------------------------

    def apply(self, updates: Iterable[Update]) -> int:
        """Apply updates in order; returns how many changed an input."""
        n = 0
        for u in updates:
            n += self._apply_one(u)
        return n

    def _apply_one(self, u: Update) -> bool:
        v = u.value
        if u.kind == "nat":
            return self.set_nat(v if isinstance(v, NatConfig) else NatConfig())
        if u.kind == "namespace":
            if isinstance(v, Namespace):
                return self.put_namespace(v)
            return self.remove_namespace(u.key)
        if u.kind == "calico-policy":
            return self.put_calico_policy(u.key, v if isinstance(v, CalicoPolicy) else None)
        if u.kind == "network-set":
            return self.put_network_set(u.key, v if isinstance(v, NetworkSet) else None)
        if u.kind == "tier":
            return self.put_tier(u.key, v if isinstance(v, Tier) else None)
        if u.kind == "host-endpoint":
            return self.put_host_endpoint(u.key, v if isinstance(v, HostEndpoint) else None)
        if u.kind == "service-account":
            return self.put_service_account(u.key, v if isinstance(v, ServiceAccount) else None)
        ns, _, name = u.key.partition("/")
        if u.kind == "policy":
            if isinstance(v, Policy):
                return self.put_policy(v)
            return self.remove_policy(ns, name)
        if u.kind == "pod":
            if isinstance(v, Pod):
                return self.put_pod(v)
            return self.remove_pod(ns, name)
        if u.kind == "endpoint":
            if isinstance(v, Endpoint):
                return self.put_endpoint(v)
            return self.remove_endpoint(ns, name)
        raise ValueError(f"unknown update kind {u.kind!r}")

    def load(self, state: ClusterState, nat: NatConfig | None = None) -> int:
        """Make the inputs equal to ``state`` (and ``nat``) by applying their differences as
        changes; returns how many inputs differed. Removals first, then what selectors read
        (namespaces, pods, endpoints, Calico's tiers, network sets and host endpoints),
        policies last: on an empty engine that fills every set once, by scanning, as
        :func:`~policy.engine.compute` does."""
        want_pol = {(p.namespace, p.name): p for p in state.policies}
        want_ns = {n.name: n for n in state.namespaces}
        want_pods = {(p.namespace, p.name): p for p in state.pods}
        want_eps = {e.key: e for e in state.endpoints}
        want_calico = {c.key: c for c in state.calico_policies}
        n = 0
        for ck in [k for k in self._calico if k not in want_calico]:
            n += self.put_calico_policy(ck, None)
        for pk in [k for k in self._policies if k not in want_pol]:
            n += self.remove_policy(*pk)
        for ek in [k for k in self._endpoints if k not in want_eps]:
            n += self.remove_endpoint(*ek)
        for name in [k for k in self._namespaces if k not in want_ns]:
            n += self.remove_namespace(name)
        for ns in want_ns.values():
            n += self.put_namespace(ns)
        accounts = {a.key: a for a in state.service_accounts}
        n += _load_kind(self._accounts, accounts, self.put_service_account)
        for pk in [k for k in self._pods if k not in want_pods]:
            n += self.remove_pod(*pk)
        for pod in want_pods.values():
            n += self.put_pod(pod)
        for ep in want_eps.values():
            n += self.put_endpoint(ep)
        n += _load_kind(self._tiers, {t.name: t for t in state.tiers}, self.put_tier)
        n += _load_kind(
            self._network_sets, {s.key: s for s in state.network_sets}, self.put_network_set
        )
        hosts = {h.key: h for h in state.host_endpoints}
        n += _load_kind(self._host_endpoints, hosts, self.put_host_endpoint)
        for pol in want_pol.values():
            n += self.put_policy(pol)
        for ck, c in want_calico.items():
            n += self.put_calico_policy(ck, c)
        if nat is not None:
            n += self.set_nat(nat)
        return n

    def set_nat(self, nat: NatConfig) -> bool:
        if nat == self._nat:
            return False
        if self._d_nat is None:
            self._d_nat = self._nat
        self._nat = nat
        return True

    def put_namespace(self, ns: Namespace) -> bool:
        old = self._namespaces.get(ns.name)
        if old == ns:
            return False
        self._namespaces[ns.name] = ns
        self._relabel_namespace(ns.name, old, ns)
        return True

    def remove_namespace(self, name: str) -> bool:
        old = self._namespaces.pop(name, None)
        if old is None:
            return False
        self._relabel_namespace(name, old, None)
        return True

    def put_pod(self, pod: Pod) -> bool:
        key = (pod.namespace, pod.name)
        old = self._pods.get(key)
        if old == pod:
            return False
        self._pods[key] = pod
        self._state = None
        self._repod(key)
        return True

    def remove_pod(self, namespace: str, name: str) -> bool:
        key = (namespace, name)
        old = self._pods.pop(key, None)
        if old is None:
            return False
        self._state = None
        self._repod(key)
        return True

    def put_endpoint(self, ep: Endpoint) -> bool:
        old = self._endpoints.get(ep.key)
        if old is not None and old.ep == ep:
            return False
        self._replace(ep.key, old, self._member(ep))
        return True

    def remove_endpoint(self, namespace: str, name: str) -> bool:
        """``name`` is the endpoint's (the WorkloadEndpoint's) name."""
        old = self._endpoints.get((namespace, name))
        if old is None:
            return False
        self._replace((namespace, name), old, None)
        return True

    def put_policy(self, pol: Policy) -> bool:
        key = (pol.namespace, pol.name)
        old = self._policies.get(key)
        if old == pol:
            return False
        self._repolicy(key, old, pol)
        return True

    def remove_policy(self, namespace: str, name: str) -> bool:
        key = (namespace, name)
        old = self._policies.get(key)
        if old is None:
            return False
        self._repolicy(key, old, None)
        return True

    # -- Calico's kinds ----------------------------------------------------------------------

    def _swap(self, inputs: dict[str, V], key: str, value: V | None) -> bool:
        """``value`` put at ``key`` of one of Calico's inputs (None: removed); whether that
        changed anything."""
        if inputs.get(key) == value:
            return False
        self._state = None
        if value is None:
            del inputs[key]
        else:
            inputs[key] = value
        return True

    def put_calico_policy(self, key: str, pol: CalicoPolicy | None) -> bool:
        """A Calico policy (namespaced, global, staged) put, or removed (``None``): the
        local endpoints its old or new selector selects (one selector test per local
        endpoint), its chains, the sets they use, those endpoints' programs; the host
        endpoints' programs (all of this node's, recomputed)."""
        if not self._swap(self._calico, key, pol):
            return False
        for d in _DIRECTIONS:
            self._c_templates.pop((key, d), None)
        was = self._c_local.pop(key, set())
        now: set[_Key] = set()
        if pol is not None:
            for keys in self._iface_eps.values():
                for ek in keys:
                    if pol.selector.matches(self._clabels(self._endpoints[ek])):
                        now.add(ek)
        for ek in was - now:
            self._endpoints[ek].calico_of().discard(key)
        for ek in now - was:
            self._endpoints[ek].calico_of().add(key)
        if now:
            self._c_local[key] = now
        if self._hosts:
            self._rehost()
        self._c_sync(key)
        for iface in sorted({self._endpoints[ek].ep.interface for ek in was | now}):
            self._reprogram(iface)
        return True

    def put_tier(self, name: str, tier: Tier | None) -> bool:
        """A tier put or removed: the programs of the local endpoints with a policy in it
        (for ``default``, of every local endpoint a Calico policy selects: the Kubernetes
        policies are in it), the chains of its staged policies (they end in its
        defaultAction), the host endpoints' programs."""
        if not self._swap(self._tiers, name, tier):
            return False
        ifaces: set[str] = set()
        for ck, keys in self._c_local.items():
            if name == DEFAULT_TIER or self._calico[ck].tier == name:
                ifaces.update(self._endpoints[ek].ep.interface for ek in keys)
        # a staged policy's chain ends in its tier's defaultAction: a new chain
        for ck, c in self._calico.items():
            if c.staged and c.tier == name:
                for d in _DIRECTIONS:
                    self._c_templates.pop((ck, d), None)
                self._c_sync(ck)
        if self._hosts:
            self._rehost()
        for iface in sorted(ifaces):
            self._reprogram(iface)
        return True

    def put_network_set(self, key: str, nset: NetworkSet | None) -> bool:
        """A network set put or removed: the nets of the selectors that match it, before
        or after, computed again."""
        old = self._network_sets.get(key)
        if not self._swap(self._network_sets, key, nset):
            return False
        labels = [self._netset_labels(s) for s in (old, nset) if s is not None]
        for gid in sorted(self._groups_selnet):
            g = self._groups[gid]
            assert g.selector is not None
            if any(g.selector.matches(x) for x in labels):
                self._refill_nets(g)
        return True

    def put_host_endpoint(self, key: str, host: HostEndpoint | None) -> bool:
        """A host endpoint put or removed (any node's): its expected IPs in and out of the
        selector sets; when it is (or was) one of this node's, the host programs."""
        old = self._host_endpoints.get(key)
        if not self._swap(self._host_endpoints, key, host):
            return False
        for gid in self._groups_sel:
            g = self._groups[gid]
            for fam, name in g.names.items():
                for a in self._host_ips(g, old, fam):
                    self._dec(name, a)
                for a in self._host_ips(g, host, fam):
                    self._inc(name, a)
        if any(h is not None and h.node == self.node and h.interface for h in (old, host)):
            self._rehost()
        return True

    def _clabels(self, m: _Member) -> Mapping[str, str]:
        got = m.clabels
        if got is None:
            got = _calico_view(
                m.items, m.ns, self._namespaces.get(m.ns), m.account, self._account_of(m)
            )
            m.clabels = got
        return got

    def _netset_labels(self, s: NetworkSet) -> Mapping[str, str]:
        ns = s.namespace
        scope = {ns: _ns_view(self._namespaces.get(ns), ns)[0]} if ns is not None else {}
        return engine.network_set_labels(s, scope)

    def _host_ips(self, g: _Group, h: HostEndpoint | None, fam: int) -> list[str]:
        """The addresses host endpoint ``h`` puts in the ``sel`` set of family ``fam`` of
        ``g``: its expected IPs of that family, when the selector selects it."""
        if h is None or not h.expected_ips:
            return []
        assert g.selector is not None
        if not g.selector.matches(engine.host_labels(h)):
            return []
        return [a for a in h.expected_ips if ipaddress.ip_address(a).version == fam]

    def _refill_nets(self, g: _Group) -> None:
        """A ``selnet`` group's sets: the nets of the network sets its selector matches,
        as disjoint prefixes (computed whole: a union of nets is not counted per net)."""
        assert g.selector is not None
        nets = [
            n
            for s in self._network_sets.values()
            if g.selector.matches(self._netset_labels(s))
            for n in s.networks()
        ]
        for fam, name in g.names.items():
            want = set(engine.collapsed(n for n in nets if n.version == fam))
            have = self._members[name]
            for e in [e for e in have if e not in want]:
                self._dec(name, e)
            for e in want - have.keys():
                self._inc(name, e)

    def _tier_of(self, name: str) -> Tier:
        return engine.resolve_tier(self._tiers, name)

    def _chain_of(self, pol: CalicoPolicy, direction: Direction) -> PolicyChain:
        return self._c_template(pol.key, direction).chain

    def _c_template(self, key: str, direction: Direction) -> _Template:
        t = self._c_templates.get((key, direction))
        if t is None:
            pol = self._calico[key]
            tier = self._tiers.get(pol.tier)
            chain, sets = engine.calico_policy_chain(pol, direction, self.families, tier)
            t = _Template(chain, sets, {})
            self._c_templates[(key, direction)] = t
        return t

    def _c_sync(self, key: str) -> None:
        """The chains of Calico policy ``key`` as they must be now: per direction, while it
        applies to a local endpoint selected (stage normal, of the direction) or a host
        program uses it. New ones are put before old ones go (their common sets stay)."""
        pol = self._calico.get(key)
        want: list[_Template] = []
        if pol is not None:
            local = bool(self._c_local.get(key)) and pol.stage == "normal"
            host = self._c_host_dirs.get(key, set())
            want = [
                self._c_template(key, d)
                for d in _DIRECTIONS
                if (local and d in pol.types) or d in host
            ]
        for t in want:
            self._put_chain(t)
        names = {t.chain.name for t in want}
        for name in self._c_chains.pop(key, {}).values():
            if name not in names:
                self._drop_chain(name)
        if want:
            self._c_chains[key] = {t.chain.direction: t.chain.name for t in want}

    def _rehost(self) -> None:
        """This node's host endpoints' programs, computed again (few: all of them), and the
        chains whose use by them changed."""
        hosts = sorted(self._host_endpoints.values(), key=lambda h: h.key)
        mine = engine.node_hosts(((h, engine.host_labels(h)) for h in hosts), self.node)
        used: dict[str, set[Direction]] = {}

        def chain_of(pol: CalicoPolicy, direction: Direction) -> PolicyChain:
            used.setdefault(pol.key, set()).add(direction)
            return self._chain_of(pol, direction)

        policies = tuple(self._calico.values())
        self._hosts = {
            h.name: engine.host_program(h, labels, policies, chain_of, self._tier_of)
            for h, labels in mine
        }
        was, self._c_host_dirs = self._c_host_dirs, used
        for key in sorted(was.keys() | used.keys()):
            if was.get(key) != used.get(key):
                self._c_sync(key)

    # -- the delta --------------------------------------------------------------------------

    def take_delta(self) -> Delta:
        """What changed in the IR since the last call (net), and start anew. Entering or
        leaving Calico's model (the first Calico policy or host endpoint of this node, the
        last gone), or the node's first host endpoint or its last gone, replaces the table
        (``Delta.replace``)."""
        self._flush()
        d = self._take_k8s_delta()
        calico = self.calico
        replace = calico != self._sent_calico or bool(self._hosts) != bool(self._sent_hosts)
        hosts = (self._sent_hosts, self._hosts) if self._hosts != self._sent_hosts else None
        self._sent_calico, self._sent_hosts = calico, self._hosts
        if replace:
            return Delta(nat=d.nat, replace=True)
        return dataclasses.replace(d, hosts=hosts) if hosts is not None else d

    def _take_k8s_delta(self) -> Delta:
        new_sets: dict[str, SetDef] = {}
        new_elements: dict[str, frozenset[Element]] = {}
        gone_sets: list[str] = []
        for name, existed in self._d_sets.items():
            now = name in self._sets
            if now and not existed:
                new_sets[name] = self._sets[name]
                new_elements[name] = frozenset(self._members[name])
            elif existed and not now:
                gone_sets.append(name)
        added = {
            n: frozenset(e)
            for n, e in self._d_added.items()
            if e and n in self._sets and self._d_sets.get(n, True)
        }
        removed = {
            n: frozenset(e)
            for n, e in self._d_removed.items()
            if e and n in self._sets and self._d_sets.get(n, True)
        }
        new_chains: dict[str, PolicyChain] = {}
        changed_chains: dict[str, PolicyChain] = {}
        gone_chains: list[str] = []
        for name, before in self._d_chains.items():
            chain = self._chains.get(name)
            if before is None and chain is not None:
                new_chains[name] = chain
            elif before is not None and chain is None:
                gone_chains.append(name)
            elif before is not None and chain is not None and before != chain:
                changed_chains[name] = chain
        new_eps: dict[str, EndpointProgram] = {}
        changed_eps: dict[str, tuple[EndpointProgram, EndpointProgram]] = {}
        gone_eps: list[str] = []
        for iface, old in self._d_programs.items():
            prog = self._programs.get(iface)
            if old is None and prog is not None:
                new_eps[iface] = prog
            elif old is not None and prog is None:
                gone_eps.append(iface)
            elif old is not None and prog is not None and old != prog:
                changed_eps[iface] = (old, prog)
        nat = None
        if self._d_nat is not None and self._d_nat != self._nat:
            nat = (self._d_nat, self._nat)
        counters = {
            name: tuple(sorted(chain_counters(before)))
            for name, before in self._d_chains.items()
            if name in gone_chains and before is not None and before.tier
        }
        self._d_sets, self._d_added, self._d_removed = {}, {}, {}
        self._d_chains, self._d_programs, self._d_nat = {}, {}, None
        return Delta(
            new_sets,
            new_elements,
            tuple(sorted(gone_sets)),
            added,
            removed,
            new_chains,
            changed_chains,
            tuple(sorted(gone_chains)),
            new_eps,
            changed_eps,
            tuple(sorted(gone_eps)),
            nat,
            counters,
        )

    # -- endpoints ----------------------------------------------------------------------------

    def _member(self, ep: Endpoint) -> _Member:
        pod = self._pods.get((ep.namespace, ep.pod))
        labels, items = _label_view(pod.labels if pod is not None else ep.labels)
        unique = dict.fromkeys(ep.addresses)
        v4 = tuple(a for a in unique if ":" not in a)
        if v4 == ep.addresses:
            v4 = ep.addresses  # shared with the input, not a copy
        v6 = tuple(a for a in unique if ":" in a)
        return _Member(
            ep,
            labels,
            items,
            pod.ports if pod is not None else (),
            v4,
            v6,
            ep.node == self.node and bool(ep.interface),
            pod.service_account if pod is not None else "",
        )

    def _index(self, key: _Key, m: _Member) -> None:
        self._eps_by_ns.setdefault(m.ns, set()).add(key)
        self._eps_by_pod.setdefault((m.ns, m.ep.pod), []).append(key)
        if m.local:
            self._local_by_ns.setdefault(m.ns, set()).add(key)
            self._iface_eps.setdefault(m.ep.interface, set()).add(key)

    def _unindex(self, key: _Key, m: _Member) -> None:
        _discard(self._eps_by_ns, m.ns, key)
        pod = (m.ns, m.ep.pod)
        same_pod = self._eps_by_pod[pod]
        same_pod.remove(key)
        if not same_pod:
            del self._eps_by_pod[pod]
        if m.local:
            _discard(self._local_by_ns, m.ns, key)
            _discard(self._iface_eps, m.ep.interface, key)

    def _repod(self, key: _Key) -> None:
        """A pod changed or went: its endpoints' labels and ports are read anew."""
        for ek in sorted(self._eps_by_pod.get(key, ())):
            old = self._endpoints[ek]
            new = self._member(old.ep)
            if (new.items, new.ports, new.account) != (old.items, old.ports, old.account):
                self._replace(ek, old, new)

    def _replace(
        self, key: _Key, old: _Member | None, new: _Member | None, *, relabelled: bool = False
    ) -> None:
        """One endpoint changes from ``old`` to ``new`` (either may be None); ``relabelled``:
        only its namespace's labels changed (what Calico's selectors read)."""
        self._state = None
        if old is not None:
            self._unindex(key, old)
        if new is not None:
            self._endpoints[key] = new
            self._index(key, new)
        else:
            del self._endpoints[key]
        # 1. its elements in the sets that exist now
        if relabelled:
            self._move_elements(old, new, self._groups_sel)
        elif old is None or new is None or not old.same_for_sets(new):
            self._move_elements(old, new)
        # 2. local: which policies select it, their chains (and new sets, filled by scanning
        #    the indexes, which already hold ``new``), the programs of its interfaces
        counts: dict[_Key, int] = {}
        ifaces: set[str] = set()
        was: set[str] = set()
        now: set[str] = set()
        if old is not None and old.local:
            for pk in old.policies():
                counts[pk] = counts.get(pk, 0) - 1
            ifaces.add(old.ep.interface)
            was = old.calico_of()
        if new is not None and new.local:
            self._select(old, new)
            for pk in new.policies():
                counts[pk] = counts.get(pk, 0) + 1
            ifaces.add(new.ep.interface)
            now = new.calico_of()
        for pk, n in sorted(counts.items()):
            if n:
                self._count_selected(pk, n)
        self._c_reselect(key, was, now)
        for iface in sorted(ifaces):
            self._reprogram(iface)

    def _c_reselect(self, key: _Key, was: set[str], now: set[str]) -> None:
        """Local endpoint ``key`` was selected by the Calico policies ``was``, now by
        ``now``: a policy's chains come with its first local endpoint, go with its last."""
        for ck in sorted(was ^ now):
            selected = self._c_local.setdefault(ck, set())
            if ck in now:
                selected.add(key)
            else:
                selected.discard(key)
            if len(selected) == (1 if ck in now else 0):  # the first, or the last gone
                if not selected:
                    del self._c_local[ck]
                self._c_sync(ck)

    def _move_elements(
        self, old: _Member | None, new: _Member | None, only: Iterable[str] | None = None
    ) -> None:
        """An endpoint's elements out of (``old``) and into (``new``) every set that exists
        now and may hold them (or the groups ``only``): those of namespace selectors, of its
        namespace, of its named ports, of Calico's selectors."""
        if only is not None:
            gids = set(only)
        else:
            gids = self._groups_nssel | self._groups_sel
            for m in (old, new):
                if m is None:
                    continue
                gids.update(self._groups_by_scope.get(m.ns, ()))
                for cp in m.ports:
                    gid = self._groups_by_port.get(cp.name)
                    if gid is not None:
                        gids.add(gid)
        for gid in gids:
            g = self._groups[gid]
            for fam, name in g.names.items():
                was = self._contribution(g, old, fam)
                now = self._contribution(g, new, fam)
                if was == now:
                    continue
                for e in was - now:
                    self._dec(name, e)
                for e in now - was:
                    self._inc(name, e)

    def _select(self, old: _Member | None, new: _Member) -> None:
        """The policies that select local endpoint ``new``, Kubernetes' and Calico's:
        ``old``'s when what their selectors read is the same, else found again (one
        selector test per policy of its namespace, per Calico policy)."""
        same = old is not None and old.local
        if same and old is not None and (old.ns, old.items) == (new.ns, new.items):
            new.selected = set(old.policies())
        else:
            new.selected = {
                pk
                for pk, p in self._policies_by_ns.get(new.ns, {}).items()
                if p.pod_selector.matches(new.labels, new.items)
            }
        if not self._calico:
            new.calico = set()
        elif same and old is not None and self._clabels(old) == self._clabels(new):
            new.calico = set(old.calico_of())
        else:
            labels = self._clabels(new)
            new.calico = {k for k, c in self._calico.items() if c.selector.matches(labels)}

    def _contribution(self, g: _Group, m: _Member | None, fam: int) -> frozenset[Element]:
        """The elements ``m`` puts into the set of family ``fam`` of group ``g``."""
        if m is None:
            return frozenset()
        addrs = m.addrs(fam)
        if not addrs:
            return frozenset()
        if g.selector is not None:
            return frozenset(addrs) if g.selector.matches(self._clabels(m)) else frozenset()
        if g.port is not None:
            return frozenset(
                (a, cp.protocol.lower(), cp.port)
                for cp in m.ports
                if cp.name == g.port
                for a in addrs
            )
        return frozenset(addrs) if self._in_group(g, m) else frozenset()

    def _in_group(
        self,
        g: _Group,
        m: _Member,
        ns_view: tuple[Mapping[str, str], frozenset[tuple[str, str]]] | None = None,
    ) -> bool:
        scope = g.scope
        if isinstance(scope, str):
            if scope != m.ns:
                return False
        elif scope is not None:
            if ns_view is None:
                ns_view = _ns_view(self._namespaces.get(m.ns), m.ns)
            if not scope.matches(*ns_view):
                return False
        return g.pods is None or g.pods.matches(m.labels, m.items)

    # -- namespaces and service accounts -----------------------------------------------------

    def _relabel_namespace(self, name: str, old: Namespace | None, new: Namespace | None) -> None:
        self._state = None
        was, now = _ns_view(old, name), _ns_view(new, name)
        if was[1] == now[1]:
            return
        keys = sorted(self._eps_by_ns.get(name, ()))
        flips: list[tuple[_Group, bool]] = []
        for gid in sorted(self._groups_nssel):
            g = self._groups[gid]
            assert isinstance(g.scope, LabelSelector)
            before, after = g.scope.matches(*was), g.scope.matches(*now)
            if before != after:
                flips.append((g, after))
        members = [self._endpoints[k] for k in keys]
        for g, after in flips:
            for m in members:
                if g.pods is not None and not g.pods.matches(m.labels, m.items):
                    continue
                for fam, sname in g.names.items():
                    for a in m.addrs(fam):
                        if after:
                            self._inc(sname, a)
                        else:
                            self._dec(sname, a)
        # Calico's labels of its endpoints (``pcns.*``) changed: each re-tested against the
        # selector sets and, when local, the Calico policies
        if self._groups_sel or self._calico:
            for k, m in zip(keys, members, strict=True):
                m.clabels = _calico_view(m.items, name, old, m.account, self._account_of(m))
                self._replace(k, m, self._member(m.ep), relabelled=True)
        else:
            for m in members:
                m.clabels = None
        if any(s.namespace == name for s in self._network_sets.values()):
            for gid in sorted(self._groups_selnet):
                self._refill_nets(self._groups[gid])

    def put_service_account(self, key: str, account: ServiceAccount | None) -> bool:
        """A service account put or removed (``None``): its labels are Calico's ``pcsa.``
        labels of the endpoints of its pods, each re-tested as a namespace relabel's
        (only while Calico's selectors exist: nothing else reads them)."""
        if self._accounts.get(key) == account:
            return False
        ns, _, name = key.partition("/")
        keys = sorted(k for k in self._eps_by_ns.get(ns, ()) if self._endpoints[k].account == name)
        before = [self._endpoints[k] for k in keys]
        for m in before:  # what they read until now, for the re-test
            m.clabels = self._clabels(m) if (self._groups_sel or self._calico) else None
        self._swap(self._accounts, key, account)
        if self._groups_sel or self._calico:
            for k, m in zip(keys, before, strict=True):
                self._replace(k, m, self._member(m.ep), relabelled=True)
        return True

    def _account_of(self, m: _Member) -> ServiceAccount | None:
        return self._accounts.get(f"{m.ns}/{m.account}") if m.account else None

    # -- policies ---------------------------------------------------------------------------

    def _template(self, key: _Key, direction: Direction) -> _Template:
        t = self._templates.get((key, direction))
        if t is None:
            chain, sets, elements = engine.policy_chain(
                self._policies[key], direction, self.families
            )
            fixed = {n: elements[n] for n, d in sets.items() if d.kind == "cidr"}
            t = _Template(chain, sets, fixed)
            self._templates[(key, direction)] = t
        return t

    def _repolicy(self, key: _Key, old: Policy | None, new: Policy | None) -> None:
        self._state = None
        ns = key[0]
        old_names: dict[Direction, str] = {}
        for d in _DIRECTIONS:
            t = self._templates.pop((key, d), None)
            if t is not None:
                old_names[d] = t.chain.name
        if new is not None:
            self._policies[key] = new
            self._policies_by_ns.setdefault(ns, {})[key] = new
        else:
            del self._policies[key]
            _discard_key(self._policies_by_ns, ns, key)
        # which local endpoints it selects now; whose programs change
        ifaces: set[str] = set()
        count = 0
        types_changed = old is None or new is None or old.types != new.types
        for ek in sorted(self._local_by_ns.get(ns, ())):
            m = self._endpoints[ek]
            selected = m.policies()
            was = key in selected
            now = new is not None and new.pod_selector.matches(m.labels, m.items)
            if was != now:
                if now:
                    selected.add(key)
                else:
                    selected.discard(key)
                ifaces.add(m.ep.interface)
            elif now and types_changed:
                ifaces.add(m.ep.interface)
            count += now
        before = self._selects.get(key, 0)
        if count:
            self._selects[key] = count
        else:
            self._selects.pop(key, None)
        for d in _DIRECTIONS:
            had = before > 0 and old is not None and d in old.types
            has = count > 0 and new is not None and d in new.types
            if has:
                self._put_chain(self._template(key, d))
            elif had:
                self._drop_chain(old_names[d])
        for iface in sorted(ifaces):
            self._reprogram(iface)

    def _count_selected(self, key: _Key, n: int) -> None:
        """``n`` more (or fewer) local endpoints are selected by the policy ``key``."""
        before = self._selects.get(key, 0)
        after = before + n
        if after:
            self._selects[key] = after
        else:
            self._selects.pop(key, None)
        pol = self._policies[key]
        if before == 0 and after > 0:
            for d in _DIRECTIONS:
                if d in pol.types:
                    self._put_chain(self._template(key, d))
        elif before > 0 and after == 0:
            for d in _DIRECTIONS:
                if d in pol.types:
                    self._drop_chain(self._template(key, d).chain.name)

    def _put_chain(self, t: _Template) -> None:
        """Create or replace a chain: the sets it uses are referenced before the old
        version's are released, so a set both use stays (and keeps its elements)."""
        name = t.chain.name
        old = self._chains.get(name)
        if old == t.chain and self._chain_sets.get(name) == tuple(t.sets):
            return
        if name not in self._d_chains:
            self._d_chains[name] = old
        for sname, d in t.sets.items():
            self._ref_set(d, t.fixed.get(sname, frozenset()))
        if old is not None:
            self._n_chain_rules -= len(old.rules)
            for sname in self._chain_sets[name]:
                self._unref_set(sname)
        self._chains[name] = t.chain
        self._chain_sets[name] = tuple(t.sets)
        self._n_chain_rules += len(t.chain.rules)

    def _drop_chain(self, name: str) -> None:
        old = self._chains.pop(name, None)
        if old is None:
            return
        if name not in self._d_chains:
            self._d_chains[name] = old
        self._n_chain_rules -= len(old.rules)
        for sname in self._chain_sets.pop(name):
            self._unref_set(sname)

    # -- sets -------------------------------------------------------------------------------

    def _ref_set(self, d: SetDef, fixed: frozenset[Element]) -> None:
        name = d.name
        refs = self._set_refs.get(name, 0)
        self._set_refs[name] = refs + 1
        if refs:
            return
        if name not in self._d_sets:
            self._d_sets[name] = False
        self._sets[name] = d
        self._members[name] = {}
        for e in fixed:
            self._inc(name, e)
        if d.kind == "cidr":
            return
        gid = _group_id(name)
        if d.kind in ("sel", "selnet"):
            self._ref_calico_set(gid, d)
            return
        g = self._groups.get(gid)
        if g is None:
            scope = d.scope if d.kind == "addr" else None
            g = _Group(scope, d.pods if d.kind == "addr" else None, d.port_name, {})
            self._groups[gid] = g
            if isinstance(scope, str):
                self._groups_by_scope.setdefault(scope, set()).add(gid)
            elif scope is not None:
                self._groups_nssel.add(gid)
            if g.port is not None:
                self._groups_by_port[g.port] = gid
        g.names[d.family] = name
        self._fill(g, d)

    def _fill(self, g: _Group, d: SetDef) -> None:
        """A new pod or named-port set filled from the endpoints it can hold."""
        name = d.name
        if g.port is not None:
            port = g.port
            keys: Iterable[_Key] = [
                k for k, m in self._endpoints.items() if any(cp.name == port for cp in m.ports)
            ]
        elif isinstance(g.scope, str):
            keys = self._eps_by_ns.get(g.scope, ())
        else:
            assert isinstance(g.scope, LabelSelector)
            keys = [
                k
                for ns, ks in self._eps_by_ns.items()
                if g.scope.matches(*_ns_view(self._namespaces.get(ns), ns))
                for k in ks
            ]
            g_any = dataclasses.replace(g, scope=None)  # the scope is decided: pods only
            for k in keys:
                for e in self._contribution(g_any, self._endpoints[k], d.family):
                    self._inc(name, e)
            return
        for k in keys:
            for e in self._contribution(g, self._endpoints[k], d.family):
                self._inc(name, e)

    def _ref_calico_set(self, gid: str, d: SetDef) -> None:
        """A Calico selector's new set, filled: by one scan of every endpoint and host
        endpoint (``sel``), from the network sets (``selnet``)."""
        g = self._groups.get(gid)
        if g is None:
            g = _Group(None, None, None, {}, d.selector)
            self._groups[gid] = g
            (self._groups_sel if d.kind == "sel" else self._groups_selnet).add(gid)
        g.names[d.family] = d.name
        if d.kind == "selnet":
            self._refill_nets(g)
            return
        for m in self._endpoints.values():
            for e in self._contribution(g, m, d.family):
                self._inc(d.name, e)
        for h in self._host_endpoints.values():
            for a in self._host_ips(g, h, d.family):
                self._inc(d.name, a)

    def _unref_set(self, name: str) -> None:
        refs = self._set_refs[name] - 1
        if refs:
            self._set_refs[name] = refs
            return
        del self._set_refs[name]
        d = self._sets.pop(name)
        members = self._members.pop(name)
        self._n_elements -= len(members)
        if self._d_sets.get(name, True):
            for e in members:
                self._absent(name, e)
        if name not in self._d_sets:
            self._d_sets[name] = True
        if d.kind == "cidr":
            return
        gid = _group_id(name)
        g = self._groups[gid]
        del g.names[d.family]
        if g.names:
            return
        del self._groups[gid]
        self._groups_sel.discard(gid)
        self._groups_selnet.discard(gid)
        if isinstance(g.scope, str):
            _discard(self._groups_by_scope, g.scope, gid)
        elif g.scope is not None:
            self._groups_nssel.discard(gid)
        if g.port is not None:
            del self._groups_by_port[g.port]

    def _inc(self, name: str, e: Element) -> None:
        c = self._members[name]
        n = c.get(e, 0)
        c[e] = n + 1
        if n == 0:
            self._n_elements += 1
            if self._d_sets.get(name, True):
                removed = self._d_removed.get(name)
                if removed is not None and e in removed:
                    removed.discard(e)
                else:
                    self._d_added.setdefault(name, set()).add(e)

    def _dec(self, name: str, e: Element) -> None:
        c = self._members[name]
        n = c[e]
        if n > 1:
            c[e] = n - 1
            return
        del c[e]
        self._n_elements -= 1
        if self._d_sets.get(name, True):
            self._absent(name, e)

    def _absent(self, name: str, e: Element) -> None:
        added = self._d_added.get(name)
        if added is not None and e in added:
            added.discard(e)
        else:
            self._d_removed.setdefault(name, set()).add(e)

    # -- programs ---------------------------------------------------------------------------

    def _reprogram(self, iface: str) -> None:
        """The program of ``iface`` is to be made again: once, when next read (a batch of
        changes, a load, touches a program once)."""
        self._dirty.add(iface)

    def _flush(self) -> None:
        for iface in sorted(self._dirty):
            self._program_of(iface)
        self._dirty.clear()

    def _program_of(self, iface: str) -> None:
        """An interface's program from the local endpoints on it (one, unless two endpoints
        claim one interface: then as :func:`~policy.engine.compute` merges them)."""
        old = self._programs.get(iface)
        keys = self._iface_eps.get(iface)
        prog = None
        if keys:
            members = [self._endpoints[k] for k in sorted(keys)]
            times: dict[_Key, int] = {}
            for m in members:
                for pk in m.policies():
                    times[pk] = times.get(pk, 0) + 1
            jumps: dict[Direction, list[str]] = {"ingress": [], "egress": []}
            for pk in sorted(times):
                pol = self._policies[pk]
                for d in _DIRECTIONS:
                    if d in pol.types:
                        jumps[d].extend([self._template(pk, d).chain.name] * times[pk])
            last = members[-1]
            prog = EndpointProgram(
                iface,
                f"{last.ep.namespace}/{last.ep.name}",
                last.ep.addresses,
                tuple(jumps["ingress"]) or None,
                tuple(jumps["egress"]) or None,
            )
            if last.calico_of():
                # tiered as compute does it, from the last endpoint's policies alone
                k8s = [self._policies[pk] for pk in last.policies()]
                calico = [self._calico[ck] for ck in last.calico_of()]
                entries = {
                    d: engine.tier_entries(k8s, calico, d, self._tier_of, staged=True)
                    for d in _DIRECTIONS
                }
                prog = engine.tiered_program(prog, entries, self._chain_of, self._tier_of)
        if prog == old:
            return
        if iface not in self._d_programs:
            self._d_programs[iface] = old
        if old is not None:
            self._n_program_rules -= _program_rules(old)
            del self._programs[iface]
        if prog is not None:
            self._programs[iface] = prog
            self._n_program_rules += _program_rules(prog)


def _load_kind(
    have: Mapping[str, V], want: Mapping[str, V], put: Callable[[str, V | None], bool]
) -> int:
    """Make inputs of one of Calico's kinds ``want`` by ``put`` (None: removed)."""
    n = 0
    for k in [k for k in have if k not in want]:
        n += put(k, None)
    for k, v in want.items():
        n += put(k, v)
    return n


def _program_rules(p: EndpointProgram) -> int:
    return sum(1 if jumps is None else len(jumps) + 1 for jumps in (p.ingress, p.egress))


def _discard(index: dict[K, set[V]], key: K, value: V) -> None:
    """Remove ``value`` from the set at ``key``, and the set when it is left empty."""
    members = index.get(key)
    if members is not None:
        members.discard(value)
        if not members:
            del index[key]


def _discard_key(index: dict[str, dict[V, Policy]], key: str, value: V) -> None:
    inner = index.get(key)
    if inner is not None:
        inner.pop(value, None)
        if not inner:
            del index[key]
