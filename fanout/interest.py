"""Which nodes a workload on another node is sent to: the interest filter of tabby-typha's
per-node views (docs/typha.md "The interest filter").

A node's policy state (``policy.engine.compute`` for its endpoints) reads a workload of
another node (its Pod and WorkloadEndpoints: together a *workload*, keyed
``<namespace>/<pod>``) only through the sets its chains use: a peer selector's address set,
a Calico rule selector's endpoint set, a named port's set. Which sets a node's chains use
depends on the policies, tiers and namespaces (every node gets those whole) and on the
node's own workloads, never on another node's. So typha computes, per node, the sets of
``compute`` run on that node's own workloads alone (its *interest*: the union, counted per
set, of what ``compute`` of each of its workloads gives, a chain existing while its policy
selects one of the node's endpoints), and sends a workload
to the nodes it runs on and to the nodes one of whose sets it gives elements to
(``engine.contributing``: the engine's own membership rules, one definition). What a node
is sent of other nodes' workloads is then exactly what can change its rendered policy, and
the IR ``compute`` makes from it is the one it makes from the whole cluster.

Every set of every node's interest is one *item*, shared by the nodes whose interest holds
it (a Kubernetes policy's peer selector is one item for every node that runs a pod the
policy selects). A workload's change is evaluated once per candidate item (those of its
namespace, the namespace-selector and Calico ones, those of the port names it declares),
not once per node; the nodes it goes to are the union of the matched items' nodes.

The view is exact both ways: a workload that no longer matters to a node is removed from
it (a delete is sent), so what a node holds is a function of the cluster's state (what
resuming by digests needs). A document that does not parse (a node refuses it as well)
goes to every node.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import TYPE_CHECKING, cast

from datastore.base import Doc
from datastore.errors import StoreCorrupt
from fanout import views
from policy import engine
from policy.inputs import (
    calico_policy,
    endpoint,
    namespace,
    pod,
    policy,
    staged_kubernetes_policy,
    tier,
)
from resources.index import (
    BY_NAME,
    CALICO_POLICIES,
    GLOBAL_POLICIES,
    STAGED_GLOBAL_POLICIES,
    STAGED_KUBERNETES_POLICIES,
    STAGED_POLICIES,
)

if TYPE_CHECKING:
    from bundle.types import JSON
    from policy.calico import CalicoPolicy, Tier
    from resources.k8s import Namespace, NetworkPolicy, Pod
    from resources.tabby import WorkloadEndpoint

WORKLOAD_KINDS = frozenset({"pod", "workloadendpoint"})
CALICO_KINDS = frozenset(
    k.name
    for k in (
        CALICO_POLICIES,
        GLOBAL_POLICIES,
        STAGED_POLICIES,
        STAGED_GLOBAL_POLICIES,
        STAGED_KUBERNETES_POLICIES,
    )
)
#: the kinds whose documents the interest reads
KINDS = WORKLOAD_KINDS | CALICO_KINDS | {"networkpolicy", "namespace", "tier"}
#: the kinds of sets a workload of another node gives elements to
_ITEM_KINDS = frozenset({"addr", "sel", "named-port"})


class Nodes:
    """A set of node names, or (``but``) every node but those named."""

    __slots__ = ("but", "names")

    def __init__(self, names: Iterable[str] = (), but: bool = False) -> None:
        self.names = frozenset(names)
        self.but = but

    def has(self, node: str) -> bool:
        return (node in self.names) != self.but

    def empty(self) -> bool:
        return not self.but and not self.names

    def __and__(self, other: Nodes) -> Nodes:
        if self == other:
            return self  # (shared: the history holds many of one workload's)
        if not self.but and not other.but:
            return Nodes(self.names & other.names)
        if not self.but:
            return Nodes(self.names - other.names)
        if not other.but:
            return Nodes(other.names - self.names)
        return Nodes(self.names | other.names, True)

    def __sub__(self, other: Nodes) -> Nodes:
        return self & Nodes(other.names, not other.but)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Nodes) and (self.names, self.but) == (other.names, other.but)

    def __hash__(self) -> int:
        return hash((self.names, self.but))

    def __repr__(self) -> str:
        return f"Nodes({sorted(self.names)}{', but' if self.but else ''})"


EVERY = Nodes((), True)


class Workload:
    """A pod of the cluster as the engine reads it: its Pod (None: not stored, or refused)
    and its endpoints; the items it matches, and the nodes it is sent to (``holders``)."""

    __slots__ = (
        "endpoints",
        "holders",
        "key",
        "matched",
        "namespace",
        "own",
        "pod",
        "pod_key",
        "pod_node",
    )

    def __init__(self, key: str, namespace: str) -> None:
        self.key = key
        self.namespace = namespace
        self.pod: engine.Pod | None = None
        self.pod_key = ""
        self.pod_node = ""
        self.endpoints: dict[str, engine.Endpoint] = {}  #: by store key
        self.matched: frozenset[str] = frozenset()
        self.holders = Nodes()
        #: node -> the items its endpoints there bring to that node's interest
        self.own: dict[str, frozenset[str]] = {}

    def nodes(self) -> set[str]:
        """The nodes it runs on (they hold it in any case)."""
        out = {ep.node for ep in self.endpoints.values()}
        if self.pod_node:
            out.add(self.pod_node)
        out.discard("")
        return out

    def docs(self) -> list[tuple[str, str]]:
        out = [("workloadendpoint", k) for k in self.endpoints]
        if self.pod is not None:
            out.append(("pod", self.pod_key))
        return out

    def state(self, ns: engine.Namespace | None) -> engine.ClusterState:
        return engine.ClusterState(
            namespaces=(ns,) if ns is not None else (),
            pods=(self.pod,) if self.pod is not None else (),
            endpoints=tuple(self.endpoints.values()),
        )


@dataclasses.dataclass
class Item:
    """One set of some node's interest: the nodes whose interest holds it, the workloads
    that give it elements."""

    setdef: engine.SetDef
    nodes: set[str] = dataclasses.field(default_factory=set)
    members: set[str] = dataclasses.field(default_factory=set)


def item_key(d: engine.SetDef) -> str:
    """A set's name without its family (``a4-x``, ``a6-x``: ``a-x``): one item for both."""
    return d.name[0] + d.name[2:]


@dataclasses.dataclass
class Counts:
    """What the interest did (bench, ``/metrics``)."""

    evaluations: int = 0  #: item evaluations of a workload
    computations: int = 0  #: ``engine.compute`` of one workload's endpoints on one node


class Interest:
    """The interest of every node, and the nodes each workload goes to, kept up to date
    document by document (``put``, ``delete``); ``take_changed`` gives the workloads whose
    nodes changed, with the nodes they had (the hub sends them to the nodes they gained,
    deletes them from those they lost)."""

    def __init__(self) -> None:
        self._policies: dict[tuple[str, str], engine.Policy | CalicoPolicy] = {}
        self.tiers: dict[str, Tier] = {}
        self.namespaces: dict[str, engine.Namespace] = {}  #: by name
        self._ns_names: dict[str, str] = {}  #: store key -> name
        self.workloads: dict[str, Workload] = {}
        self._doc_workload: dict[tuple[str, str], str] = {}
        self._refused: set[tuple[str, str]] = set()
        self._by_ns: dict[str, set[str]] = {}  #: namespace -> workloads
        #: node -> item -> how many of its workloads bring it (its interest: those > 0)
        self._node_items: dict[str, dict[str, int]] = {}
        self.items: dict[str, Item] = {}
        self._by_scope: dict[str, set[str]] = {}  #: namespace -> its addr items
        self._wide: set[str] = set()  #: addr items with a namespace selector, Calico's
        self._by_port: dict[str, set[str]] = {}  #: port name -> its items
        self._dirty_own: set[str] = set()  #: workloads whose own interest to compute again
        self._dirty: set[str] = set()  #: workloads to evaluate again
        self._changed: dict[str, Nodes] = {}
        self._cluster: engine.ClusterState | None = None
        self.batch = False  #: a snapshot is being read: settle once, at its end
        self.counts = Counts()

    # -- documents ------------------------------------------------------------------------

    def put(self, kind: str, key: str, data: JSON) -> None:
        self._apply(kind, key, data)

    def delete(self, kind: str, key: str) -> None:
        self._apply(kind, key, None)

    def to(self, kind: str, key: str) -> Nodes:
        """The nodes a workload document goes to (every node: one that does not parse)."""
        name = self._doc_workload.get((kind, key))
        if name is None:
            return EVERY
        return self.workloads[name].holders

    def docs(self, name: str) -> list[tuple[str, str]]:
        w = self.workloads.get(name)
        return w.docs() if w is not None else []

    def take_changed(self) -> dict[str, Nodes]:
        """The workloads whose nodes changed since the last call, with their nodes then."""
        if not self.batch:
            self.settle()
        out, self._changed = self._changed, {}
        return out

    def _apply(self, kind: str, key: str, data: JSON | None) -> None:
        value = None if data is None else self._parse(kind, key, data)
        if data is not None and value is None:
            self._refused.add((kind, key))
        else:
            self._refused.discard((kind, key))
        if kind in WORKLOAD_KINDS:
            self._workload_doc(kind, key, value, views.owner(kind, data) or "")
        elif kind == "networkpolicy" or kind in CALICO_KINDS:
            self._policy(kind, key, cast("engine.Policy | CalicoPolicy | None", value))
        elif kind == "tier":
            old_t = self.tiers.pop(key, None)
            if value is not None:
                self.tiers[key] = cast("Tier", value)
            if old_t != value:
                self._cluster = None
                self._dirty_own.update(self.workloads)
        elif kind == "namespace":
            self._namespace(key, cast("engine.Namespace | None", value))
        if not self.batch:
            self.settle()

    def _policy(self, kind: str, key: str, value: engine.Policy | CalicoPolicy | None) -> None:
        """A policy changed: the nodes running a pod it may select compute their interest
        again (a namespaced one's namespace; a global one: every node)."""
        held = self._policies
        old = held.pop((kind, key), None)
        if value is not None:
            held[(kind, key)] = value
        if old == value:
            return
        self._cluster = None
        for p in (old, value):
            if p is None:
                continue
            ns = p.namespace
            if ns is None:
                self._dirty_own.update(self.workloads)
            else:
                self._dirty_own.update(self._by_ns.get(ns, ()))

    def _parse(self, kind: str, key: str, data: JSON) -> object | None:
        """The engine's input of a document, as a node makes it (None: refused)."""
        try:
            model = BY_NAME[kind].parse(key, Doc(data, 0))
            if kind == "pod":
                return pod(cast("Pod", model))
            if kind == "workloadendpoint":
                return endpoint(cast("WorkloadEndpoint", model))
            if kind == "networkpolicy":
                return policy(cast("NetworkPolicy", model))
            if kind == "namespace":
                return namespace(cast("Namespace", model))
            if kind == "tier":
                return tier(model)  # type: ignore[arg-type]
            if kind == STAGED_KUBERNETES_POLICIES.name:
                return staged_kubernetes_policy(model)  # type: ignore[arg-type]
            return calico_policy(model)  # type: ignore[arg-type]
        except (StoreCorrupt, ValueError, TypeError):
            return None

    def _workload_doc(self, kind: str, key: str, value: object | None, node: str) -> None:
        doc = (kind, key)
        name = self._doc_workload.pop(doc, None)
        if name is not None:
            w = self.workloads[name]
            if kind == "pod":
                w.pod, w.pod_key, w.pod_node = None, "", ""
            else:
                w.endpoints.pop(key, None)
            self._touched(w)
        if value is None:
            return
        if isinstance(value, engine.Pod):
            name = f"{value.namespace}/{value.name}"
        else:
            assert isinstance(value, engine.Endpoint)
            name = f"{value.namespace}/{value.pod}"
        found = self.workloads.get(name)
        if found is None:
            found = self.workloads[name] = Workload(name, name.split("/", 1)[0])
            self._by_ns.setdefault(found.namespace, set()).add(name)
        w = found
        if isinstance(value, engine.Pod):
            w.pod, w.pod_key = value, key
            w.pod_node = node  # ``spec.nodeName``: not an engine input
        else:
            assert isinstance(value, engine.Endpoint)
            w.endpoints[key] = value
        self._doc_workload[doc] = name
        self._touched(w)

    def _touched(self, w: Workload) -> None:
        """``w`` changed: what it brings to its nodes' interest, and what it matches of
        the others', are evaluated again."""
        self._dirty.add(w.key)
        self._dirty_own.add(w.key)

    def _namespace(self, key: str, value: engine.Namespace | None) -> None:
        old_name = self._ns_names.pop(key, None)
        old = self.namespaces.pop(old_name, None) if old_name is not None else None
        if value is not None:
            self._ns_names[key] = value.name
            self.namespaces[value.name] = value
        if old == value:
            return
        self._cluster = None
        for ns in {n.name for n in (old, value) if n is not None}:
            self._dirty_own.update(self._by_ns.get(ns, ()))
            self._dirty.update(self._by_ns.get(ns, ()))

    # -- evaluation -----------------------------------------------------------------------

    def settle(self) -> None:
        """Bring the interests and the workloads' nodes up to date with the documents."""
        holders_dirty: set[str] = set()
        for name in sorted(self._dirty_own):
            holders_dirty |= self._own(name)
        self._dirty_own.clear()
        for name in self._dirty:
            self._evaluate(name)
        holders_dirty |= self._dirty
        self._dirty = set()
        for name in holders_dirty:
            w = self.workloads.get(name)
            if w is None:
                continue
            nodes = w.nodes()
            for k in w.matched:
                nodes |= self.items[k].nodes
            holders = Nodes(nodes)
            if holders != w.holders:
                self._changed.setdefault(name, w.holders)
                w.holders = holders
            if not w.endpoints and w.pod is None:
                self._forget(w)

    def _forget(self, w: Workload) -> None:
        for k in w.matched:
            self.items[k].members.discard(w.key)
        del self.workloads[w.key]
        names = self._by_ns.get(w.namespace)
        if names is not None:
            names.discard(w.key)
            if not names:
                del self._by_ns[w.namespace]

    def _cluster_state(self) -> engine.ClusterState:
        if self._cluster is None:
            ps = self._policies.values()
            self._cluster = engine.ClusterState(
                policies=tuple(p for p in ps if isinstance(p, engine.Policy)),
                namespaces=tuple(self.namespaces.values()),
                calico_policies=tuple(p for p in ps if not isinstance(p, engine.Policy)),
                tiers=tuple(self.tiers.values()),
            )
        return self._cluster

    def _own(self, name: str) -> set[str]:
        """Compute again what ``name`` brings to the interest of the nodes it runs on: the
        sets of ``engine.compute`` of its endpoints there (a node's interest is the union
        over its workloads: a chain, and so its sets, exists while its policy selects one
        of the node's endpoints). The workloads whose nodes may change."""
        w = self.workloads.get(name)
        if w is None:
            return set()
        sets: dict[str, dict[str, engine.SetDef]] = {}
        local = sorted({ep.node for ep in w.endpoints.values() if ep.interface})
        if local:
            state = dataclasses.replace(
                self._cluster_state(),
                pods=(w.pod,) if w.pod is not None else (),
                endpoints=tuple(w.endpoints.values()),
            )
            for node in local:
                self.counts.computations += 1
                mine = {
                    item_key(d): d
                    for d in engine.compute(state, node).sets.values()
                    if d.kind in _ITEM_KINDS
                }
                if mine:
                    sets[node] = mine
        old, w.own = w.own, {node: frozenset(mine) for node, mine in sets.items()}
        touched: set[str] = set()
        for node in old.keys() | sets.keys():
            was, now = old.get(node, frozenset()), w.own.get(node, frozenset())
            counts = self._node_items.setdefault(node, {})
            for k in now - was:
                counts[k] = counts.get(k, 0) + 1
                if counts[k] == 1:  # the node's interest gained it
                    item = self.items.get(k)
                    if item is None:
                        item = self.items[k] = self._new_item(k, sets[node][k])
                    item.nodes.add(node)
                    touched |= item.members
            for k in was - now:
                counts[k] -= 1
                if not counts[k]:  # the node's interest lost it
                    del counts[k]
                    item = self.items[k]
                    item.nodes.discard(node)
                    touched |= item.members
                    if not item.nodes:
                        self._drop_item(k, item)
            if not counts:
                del self._node_items[node]
        return touched

    def interest_of(self, node: str) -> frozenset[str]:
        """The items of ``node``'s interest."""
        return frozenset(self._node_items.get(node, ()))

    def _new_item(self, k: str, d: engine.SetDef) -> Item:
        item = Item(d)
        if d.kind == "addr" and isinstance(d.scope, str):
            self._by_scope.setdefault(d.scope, set()).add(k)
            candidates: Iterable[str] = self._by_ns.get(d.scope, ())
        elif d.kind == "named-port":
            assert d.port_name is not None
            self._by_port.setdefault(d.port_name, set()).add(k)
            candidates = self.workloads
        else:
            self._wide.add(k)
            candidates = self.workloads
        # a new set is filled by scanning (the workloads evaluated anyway are left to that)
        for name in candidates:
            if name in self._dirty:
                continue
            w = self.workloads[name]
            self.counts.evaluations += 1
            if engine.contributing(w.state(self.namespaces.get(w.namespace)), [d]):
                item.members.add(name)
                w.matched = w.matched | {k}
        return item

    def _drop_item(self, k: str, item: Item) -> None:
        del self.items[k]
        d = item.setdef
        index = (
            self._by_scope.get(d.scope)
            if d.kind == "addr" and isinstance(d.scope, str)
            else self._by_port.get(d.port_name or "")
            if d.kind == "named-port"
            else self._wide
        )
        if index is not None:
            index.discard(k)
        for name in item.members:
            w = self.workloads.get(name)
            if w is not None:
                w.matched = w.matched - {k}

    def _evaluate(self, name: str) -> None:
        """Which items ``name`` gives elements to: each candidate item evaluated once."""
        w = self.workloads.get(name)
        if w is None:
            return
        candidates = set(self._by_scope.get(w.namespace, ())) | self._wide
        ports = {cp.name for cp in w.pod.ports} if w.pod is not None else set()
        for p in ports:
            candidates |= self._by_port.get(p, set())
        matched: frozenset[str] = frozenset()
        if candidates and w.endpoints:
            ordered = sorted(candidates)
            self.counts.evaluations += len(ordered)
            state = w.state(self.namespaces.get(w.namespace))
            hits = engine.contributing(state, [self.items[k].setdef for k in ordered])
            matched = frozenset(item_key(d) for d in hits)
        for k in w.matched - matched:
            item = self.items.get(k)
            if item is not None:
                item.members.discard(name)
        for k in matched - w.matched:
            self.items[k].members.add(name)
        w.matched = matched
