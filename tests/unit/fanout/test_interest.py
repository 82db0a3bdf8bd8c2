"""tabby-typha's interest filter (``fanout.interest``): a node is sent another node's
workload only when it can change the node's policy, and what it is sent is enough.

The property: in random worlds (nodes, namespaces, pods with and without endpoints,
Kubernetes NetworkPolicies, Calico's policies, staged ones, tiers) changed in random order,
the policy IR ``engine.compute`` makes for every node's endpoints from what the hub sent
that node (applied change by change, and as a snapshot) equals the IR made from the whole
cluster. Then targeted cases: who receives a label change, and what a widening policy
delivers."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from datastore.base import Doc, SyncEvent
from fanout import wire
from fanout.hub import Hub, canonical
from policy.engine import DesiredState, compute
from policy.inputs import PolicyInputs
from resources.index import Documents
from tests.unit.fanout.docs import endpoint

NODES = ("n1", "n2", "n3")
NAMESPACES = ("a", "b")
APPS = ("web", "db", "api")
KINDS = (
    "pod",
    "workloadendpoint",
    "namespace",
    "networkpolicy",
    "globalnetworkpolicy",
    "calico-networkpolicy",
    "stagedglobalnetworkpolicy",
    "tier",
)


def pod(ns: str, name: str, node: str, labels: dict[str, str], port: str | None = None) -> Any:
    container: dict[str, Any] = {"name": "c"}
    if port:
        container["ports"] = [{"name": port, "containerPort": 8080}]
    return {
        "metadata": {"name": name, "namespace": ns, "uid": f"u-{name}", "labels": labels},
        "spec": {"nodeName": node, "containers": [container]},
    }


def wep(ns: str, name: str, node: str, address: str) -> Any:
    return endpoint(name, node, address, ns)


def namespace(name: str, team: str) -> Any:
    return {"metadata": {"name": name, "labels": {"team": team}}}


def knp(ns: str, name: str, app: str | None, peer: str | None, nssel: bool, port: str) -> Any:
    """A Kubernetes NetworkPolicy selecting ``app`` (None: every pod of ``ns``), allowing
    from/to ``peer`` (None: any pod of the namespace scope), in its namespace or (``nssel``)
    in namespaces of team x, on a named or numbered port."""
    peer_sel: dict[str, Any] = {"podSelector": {"matchLabels": {"app": peer} if peer else {}}}
    if nssel:
        peer_sel["namespaceSelector"] = {"matchLabels": {"team": "x"}}
    ports = [{"port": port}] if port == "http" else [{"port": 80}]
    rule = [{"from": [peer_sel], "ports": ports}]
    return {
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"app": app}} if app else {},
            "ingress": rule,
            "egress": [{"to": [peer_sel]}],
            "policyTypes": ["Ingress", "Egress"],
        },
    }


def gnp(name: str, app: str, peer: str, action: str, how: str, tier: str | None) -> Any:
    """A Calico (global) policy selecting ``app`` with one rule on ``peer``, its side given
    by ``how``: selector, namespaceSelector too, notSelector, or a named port."""
    side: dict[str, Any] = {"selector": f"app == '{peer}'"}
    if how == "ns":
        side["namespaceSelector"] = "team == 'x'"
    elif how == "not":
        side = {"notSelector": f"app == '{peer}'"}
    rule: dict[str, Any] = {"action": action, "source": side}
    if how == "port":
        rule = {"action": action, "protocol": "TCP", "destination": {"ports": ["http"]}}
    spec: dict[str, Any] = {"selector": f"app == '{app}'", "ingress": [rule], "order": 10}
    if tier:
        spec["tier"] = tier
    return {"metadata": {"name": f"{tier}.{name}" if tier else name}, "spec": spec}


TIER = {"metadata": {"name": "sec"}, "spec": {"order": 5, "defaultAction": "Pass"}}

# -- random worlds --------------------------------------------------------------------------

labels_st = st.fixed_dictionaries(
    {"app": st.sampled_from(APPS)}, optional={"tier": st.sampled_from(("1", "2"))}
)
pod_op = st.tuples(
    st.just("pod"),
    st.integers(0, 5),
    st.sampled_from(NAMESPACES),
    st.sampled_from(NODES),
    labels_st,
    st.sampled_from((None, "http", "metrics")),
    st.sampled_from((True, True, True, False)),  # with its endpoint
)
knp_op = st.tuples(
    st.just("knp"),
    st.integers(0, 2),
    st.sampled_from(NAMESPACES),
    st.sampled_from((None, *APPS)),
    st.sampled_from((None, *APPS)),
    st.booleans(),
    st.sampled_from(("http", "80")),
)
gnp_op = st.tuples(
    st.just("gnp"),
    st.integers(0, 2),
    st.sampled_from(APPS),
    st.sampled_from(APPS),
    st.sampled_from(("Allow", "Deny", "Pass", "Log")),
    st.sampled_from(("sel", "ns", "not", "port")),
    st.sampled_from((None, "sec")),
    st.sampled_from(("globalnetworkpolicy", "calico-networkpolicy", "stagedglobalnetworkpolicy")),
)
other_op = st.one_of(
    st.tuples(st.just("ns"), st.sampled_from(NAMESPACES), st.sampled_from(("x", "y"))),
    st.tuples(st.just("del"), st.sampled_from(("pod", "wep", "knp", "gnp")), st.integers(0, 5)),
    st.tuples(st.just("tier"), st.booleans()),
)
op_st = st.one_of(pod_op, pod_op, knp_op, gnp_op, other_op)


class World:
    """The datastore: kind -> key -> document, each write a new revision, each change also
    given to the hub as the store's watch gives it."""

    def __init__(self) -> None:
        self.docs: dict[str, dict[str, Doc]] = {k: {} for k in KINDS}
        self.rev = 0
        self.hub: Hub | None = None

    def put(self, kind: str, key: str, data: Any) -> None:
        self.rev += 1
        self.docs[kind][key] = Doc(data, self.rev)
        if self.hub is not None:
            self.hub.apply(SyncEvent("put", kind, key, Doc(data, self.rev), None))

    def delete(self, kind: str, key: str) -> None:
        if self.docs[kind].pop(key, None) is not None and self.hub is not None:
            self.hub.apply(SyncEvent("delete", kind, key, None, None))

    def start(self, hub: Hub) -> None:
        self.hub = hub
        hub.apply(SyncEvent("snapshot", "", "", None, {k: dict(v) for k, v in self.docs.items()}))

    def op(self, op: tuple[Any, ...]) -> None:
        what = op[0]
        if what == "pod":
            _, i, ns, node, labels, port, with_wep = op
            name = f"p{i}"
            for other in NAMESPACES:  # a pod name is in one namespace at a time here
                if other != ns:
                    self.delete("pod", f"{other}/{name}")
                    self.delete("workloadendpoint", f"{other}/{name}-eth0")
            self.put("pod", f"{ns}/{name}", pod(ns, name, node, labels, port))
            if with_wep:
                self.put(
                    "workloadendpoint",
                    f"{ns}/{name}-eth0",
                    wep(ns, name, node, f"10.244.0.{i + 1}"),
                )
            else:
                self.delete("workloadendpoint", f"{ns}/{name}-eth0")
        elif what == "knp":
            _, j, ns, app, peer, nssel, port = op
            self.put("networkpolicy", f"{ns}/k{j}", knp(ns, f"k{j}", app, peer, nssel, port))
        elif what == "gnp":
            _, j, app, peer, action, how, tier, kind = op
            data = gnp(f"g{j}", app, peer, action, how, tier)
            if kind == "calico-networkpolicy":
                data["metadata"]["namespace"] = "a"
                self.put(kind, f"a/{data['metadata']['name']}", data)
            else:
                self.put(kind, data["metadata"]["name"], data)
        elif what == "ns":
            self.put("namespace", op[1], namespace(op[1], op[2]))
        elif what == "tier":
            if op[1]:
                self.put("tier", "sec", TIER)
            else:
                self.delete("tier", "sec")
        else:
            _, which, i = op
            kinds = {
                "pod": ("pod", "workloadendpoint"),
                "wep": ("workloadendpoint",),
                "knp": ("networkpolicy",),
                "gnp": ("globalnetworkpolicy", "calico-networkpolicy", "stagedglobalnetworkpolicy"),
            }[which]
            for kind in kinds:
                for key in sorted(self.docs[kind]):
                    if key.split("/")[-1].split(".")[-1].startswith(f"{which[0]}{i}"):
                        self.delete(kind, key)


def ir(raw: dict[str, dict[str, Doc]], node: str) -> DesiredState:
    state, _ = PolicyInputs().convert(Documents.from_raw(raw))
    return compute(state, node)


def decode(fields: Iterable[bytes]) -> list[wire.Update]:
    message = wire.encode_server(wire.UPDATES, "", 0, b"".join(fields))
    return list(wire.decode_server(message).updates)


class View:
    """What one node holds: the hub's snapshot for it, then each change sent to it."""

    def __init__(self, hub: Hub, node: str) -> None:
        self.hub, self.node = hub, node
        self.docs: dict[str, dict[str, Doc]] = {k: {} for k in KINDS}
        for u in decode(hub.snapshot_fields(node)):
            self.docs.setdefault(u.kind, {})[u.key] = Doc(json.loads(u.data), u.revision)
        self.seq = hub.seq
        self.received = 0

    def catch_up(self) -> None:
        changes = self.hub.since(self.seq)
        assert changes is not None
        fields = [f for c in changes if (f := c.for_node(self.node)) is not None]
        self.seq = self.hub.seq
        self.received += len(fields)
        for u in decode(fields):
            if u.deleted:
                self.docs.setdefault(u.kind, {}).pop(u.key, None)
            else:
                self.docs.setdefault(u.kind, {})[u.key] = Doc(json.loads(u.data), u.revision)

    def keys(self, kind: str) -> set[str]:
        return set(self.docs.get(kind, {}))


def check(world: World, hub: Hub, views: dict[str, View]) -> None:
    for node, view in views.items():
        view.catch_up()
        assert ir(view.docs, node) == ir(world.docs, node), node
        # what the changes gave it is what a snapshot now gives it
        fresh = View(hub, node)
        assert {k: set(v) for k, v in fresh.docs.items() if v} == {
            k: set(v) for k, v in view.docs.items() if v
        }, node


@settings(
    max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow], database=None
)
@given(
    pods=st.lists(pod_op, min_size=3, max_size=7),
    policies=st.lists(st.one_of(knp_op, gnp_op), min_size=1, max_size=4),
    changes=st.lists(op_st, min_size=1, max_size=12),
)
def test_each_nodes_filtered_view_gives_the_policy_the_whole_cluster_gives(
    pods: list[tuple[Any, ...]], policies: list[tuple[Any, ...]], changes: list[tuple[Any, ...]]
) -> None:
    world = World()
    world.put("namespace", "a", namespace("a", "x"))
    world.put("namespace", "b", namespace("b", "y"))
    for op in (*pods, *policies):
        world.op(op)
    hub = Hub(epoch="e")
    world.start(hub)
    views = {node: View(hub, node) for node in NODES}
    check(world, hub, views)
    for op in changes:
        world.op(op)
        check(world, hub, views)


# -- targeted ---------------------------------------------------------------------------


def small_world() -> tuple[World, Hub, dict[str, View]]:
    """db-1 on n1 allows ingress from web pods; api-1 on n2 has no policy; web-1 on n3,
    other-1 (app=batch) on n3."""
    world = World()
    world.put("namespace", "a", namespace("a", "x"))
    for i, (name, node, app) in enumerate(
        (
            ("db-1", "n1", "db"),
            ("api-1", "n2", "api"),
            ("web-1", "n3", "web"),
            ("other-1", "n3", "batch"),
        )
    ):
        world.put("pod", f"a/{name}", pod("a", name, node, {"app": app}))
        world.put("workloadendpoint", f"a/{name}-eth0", wep("a", name, node, f"10.244.0.{i + 1}"))
    world.put("networkpolicy", "a/db", knp("a", "db", "db", "web", False, "80"))
    hub = Hub(epoch="e")
    world.start(hub)
    return world, hub, {node: View(hub, node) for node in NODES}


def sent(hub: Hub, views: dict[str, View], kind: str, key: str) -> set[str]:
    """The nodes other than its own that the last changes sent ``kind/key`` to."""
    before = {node: view.seq for node, view in views.items()}
    out = set()
    for node, view in views.items():
        changes = hub.since(before[node])
        assert changes is not None
        for c in changes:
            f = c.for_node(node)
            if f is not None and any((u.kind, u.key) == (kind, key) for u in decode([f])):
                out.add(node)
        view.catch_up()
    return out


def test_a_label_change_of_a_pod_no_policy_selects_reaches_no_other_node() -> None:
    world, hub, views = small_world()
    assert views["n2"].keys("pod") == {"a/api-1"}  # no policy on n2: nobody else's pods
    world.put("pod", "a/other-1", pod("a", "other-1", "n3", {"app": "batch", "v": "2"}))
    assert sent(hub, views, "pod", "a/other-1") == {"n3"}  # its own node only
    check(world, hub, views)


def test_a_label_change_of_a_selected_pod_reaches_the_nodes_whose_policy_selects_it() -> None:
    world, hub, views = small_world()
    assert "a/web-1" in views["n1"].keys("pod")  # db's policy allows web: n1 holds web-1
    world.put("pod", "a/web-1", pod("a", "web-1", "n3", {"app": "web", "v": "2"}))
    assert sent(hub, views, "pod", "a/web-1") == {"n1", "n3"}
    # it leaves the selector: n1 is told (deleted there), and no longer sent it
    world.put("pod", "a/web-1", pod("a", "web-1", "n3", {"app": "front"}))
    assert sent(hub, views, "pod", "a/web-1") == {"n1", "n3"}
    assert "a/web-1" not in views["n1"].keys("pod")
    assert "a/web-1-eth0" not in views["n1"].keys("workloadendpoint")
    world.put("pod", "a/web-1", pod("a", "web-1", "n3", {"app": "front", "v": "3"}))
    assert sent(hub, views, "pod", "a/web-1") == {"n3"}
    check(world, hub, views)


def test_a_policy_that_widens_a_nodes_interest_delivers_the_pods_now_relevant() -> None:
    world, hub, views = small_world()
    assert views["n2"].keys("workloadendpoint") == {"a/api-1-eth0"}
    # a policy on api (n2) allowing every pod of the namespace: n2 now needs them all
    world.put("networkpolicy", "a/api", knp("a", "api", "api", None, False, "80"))
    for view in views.values():
        view.catch_up()
    assert views["n2"].keys("pod") == {"a/db-1", "a/api-1", "a/web-1", "a/other-1"}
    assert len(views["n2"].keys("workloadendpoint")) == 4
    check(world, hub, views)
    # and a pod starting on n1 with a label db's policy allows widens nothing elsewhere
    world.put("pod", "a/web-2", pod("a", "web-2", "n1", {"app": "web"}))
    world.put("workloadendpoint", "a/web-2-eth0", wep("a", "web-2", "n1", "10.244.0.9"))
    assert sent(hub, views, "workloadendpoint", "a/web-2-eth0") == {"n1", "n2"}
    check(world, hub, views)


def test_a_pod_starting_on_a_node_brings_the_pods_its_policy_allows() -> None:
    world, hub, views = small_world()
    assert "a/web-1" not in views["n2"].keys("pod")
    # a db pod starts on n2: db's policy now selects a pod there, so n2 needs the web pods
    world.put("pod", "a/db-2", pod("a", "db-2", "n2", {"app": "db"}))
    world.put("workloadendpoint", "a/db-2-eth0", wep("a", "db-2", "n2", "10.244.0.8"))
    views["n2"].catch_up()
    assert "a/web-1" in views["n2"].keys("pod")
    check(world, hub, views)


def test_the_work_per_remote_change_is_one_evaluation_per_candidate_set() -> None:
    world, hub, _ = small_world()
    assert hub.interest is not None
    counts = hub.interest.counts
    before = (counts.evaluations, counts.computations)
    world.put("pod", "a/web-1", pod("a", "web-1", "n3", {"app": "web", "v": "2"}))
    # one set in the cluster's interest (db's peers: app=web in a): evaluated once; what
    # the pod brings to its own node's interest computed again (its labels changed)
    assert (counts.evaluations - before[0], counts.computations - before[1]) == (1, 1)


def test_another_replica_holds_each_nodes_filtered_view_as_it_is() -> None:
    """A node's view is a function of the cluster's state: a replica started later, after
    interests grew and shrank, finds by digests nothing to send any node."""
    world, hub, views = small_world()
    world.put("networkpolicy", "a/api", knp("a", "api", "api", None, False, "80"))
    world.put("pod", "a/web-1", pod("a", "web-1", "n3", {"app": "front"}))
    world.delete("networkpolicy", "a/api")
    other = Hub(epoch="e2")
    other.apply(SyncEvent("snapshot", "", "", None, {k: dict(v) for k, v in world.docs.items()}))
    for node, view in views.items():
        view.catch_up()
        contents = {
            kind: {key: wire.content(canonical(doc.data)) for key, doc in docs.items()}
            for kind, docs in view.docs.items()
        }
        hello = wire.ClientMessage(node, "e", 1, 0, KINDS, wire.digests(KINDS, contents))
        assert other.differing(node, hello) == [], node
        assert hub.differing(node, hello) == [], node
