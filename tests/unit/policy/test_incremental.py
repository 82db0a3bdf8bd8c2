"""The incremental policy engine (``policy.incremental``) and the dataplane that applies its
deltas, against the full computation.

The core proof replays random change sequences (``tests/policy_fuzz.py``: policies with pod
and namespace selectors, ipBlocks, named ports, both families; namespaces and pods
relabelled; endpoints added, removed, moved between nodes, readdressed; duplicate addresses;
endpoints whose pod is missing; the NAT pools; with ``calico``, Calico's kinds too: policies
of every kind and stage, staged ones, tiers, network sets, host endpoints, service
accounts) and after EVERY change compares:

* the incrementally kept IR with ``engine.compute`` of the same inputs (kept independently);
* the delta's nft text with what ``Renderer.delta`` diffs out of the two computed states;
* a model of the nft table that received only the deltas with one freshly replaced from
  the computed state (``tests/nft_model.py``, strict where the kernel is).

``TABBY_POLICY_FUZZ_SEEDS`` (default 20) sets how many seeds the replay runs; a developer's
run replays the first two (the rest are marked slow: tests/selection.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import random
from collections.abc import Mapping

import pytest

from dataplane import nft
from datastore.base import Doc
from policy import engine, inputs
from policy.calico import CalicoPolicy, CalicoRule, Direction, EntityMatch, Tier
from policy.engine import (
    ClusterState,
    ContainerPort,
    DesiredState,
    Endpoint,
    LabelSelector,
    Namespace,
    NatConfig,
    Peer,
    Pod,
    Policy,
    PortSpec,
    Rule,
)
from policy.incremental import Delta, IncrementalPolicy, Update, differences
from policy.render import Renderer, Snapshot
from policy.state import PolicyDataplane
from resources.index import ENDPOINTS, POLICY, POOLS, Change, Index
from resources.selector import parse_selector
from tests import policy_fuzz as fz
from tests import policy_truth_table as tt
from tests.nft_model import NftModel
from tests.selection import quick_first
from tests.unit.policy.world import TWO_POLICIES, PolicyWorld, full_table

SEEDS = int(os.environ.get("TABBY_POLICY_FUZZ_SEEDS", "20"))
OPS = 300


def _rules(ir: DesiredState) -> int:
    n = ir.rule_count
    for p in ir.endpoints.values():
        n += sum(1 if j is None else len(j) + 1 for j in (p.ingress, p.egress))
    return n


# --- the replay -----------------------------------------------------------------------------


@pytest.mark.parametrize("calico", [False, True], ids=["k8s", "calico"])
@pytest.mark.parametrize("seed", quick_first(SEEDS, 2))
def test_random_changes_equal_a_full_computation_after_every_one(seed: int, calico: bool) -> None:
    """With ``calico``, Calico's kinds come and go too: entering and leaving their model
    replaces the table (``Delta.replace``), every other change is a difference."""
    r = random.Random(seed)
    fams = r.choice(((4,), (6,), (4, 6)))
    eng = IncrementalPolicy(fz.NODE, fams)
    world = fz.World()
    renderer = Renderer()
    model = NftModel()
    prev = engine.compute(ClusterState(), fz.NODE, fams)
    prev_nat = NatConfig()
    prev_calico = False
    model.run(renderer.full(Snapshot(prev, prev_nat)))
    for i in range(OPS):
        batch = [
            fz.random_update(r, world.state(), calico=calico)
            for _ in range(r.choice((1, 1, 1, 2, 5)))
        ]
        for u in batch:
            world.apply(u)
        eng.apply(batch)
        delta = eng.take_delta()
        want = engine.compute(world.state(), fz.NODE, fams)
        where = f"seed {seed} op {i}: {batch}"
        assert eng.desired() == want, where
        assert (dict(eng.chains), dict(eng.programs)) == (want.chains, want.endpoints)
        st = eng.state()
        assert sorted(map(repr, st.endpoints)) == sorted(map(repr, world.endpoints.values()))
        assert sorted(map(repr, st.pods)) == sorted(map(repr, world.pods.values()))
        assert sorted(map(repr, st.policies)) == sorted(map(repr, world.policies.values()))
        assert sorted(map(repr, st.calico_policies)) == sorted(map(repr, world.calico.values()))
        assert eng.nat == world.nat
        sets = len(want.sets)
        elements = sum(len(e) for e in want.elements.values())
        assert eng.stats() == (len(want.endpoints), want.policies, _rules(want), sets, elements)
        # the delta is exactly the difference, and renders as a diff of the two states would
        old, new = Snapshot(prev, prev_nat), Snapshot(want, world.nat)
        lines = renderer.incremental(delta)
        if delta.replace:
            assert lines is None
            mode = fz.calico_mode(world)
            assert eng.calico == mode, where
            # entering or leaving Calico's model, or the node's first host endpoint / last
            assert mode != prev_calico or bool(want.hosts) != bool(prev.hosts), where
        else:
            assert delta.size == differences(prev, want, prev_nat, world.nat), where
            assert lines == renderer.delta(old, new), where
        prev_calico = fz.calico_mode(world)
        model.run(renderer.full(new) if lines is None else "\n".join(lines) + "\n")
        assert model.canonical() == full_table(new), where
        prev, prev_nat = want, world.nat
    assert model.redundant == 0


@pytest.mark.parametrize("calico", [False, True], ids=["k8s", "calico"])
@pytest.mark.parametrize("seed", quick_first(max(1, SEEDS // 3), 1))
def test_the_dataplane_replayed_holds_what_a_fresh_full_apply_holds(
    seed: int, calico: bool
) -> None:
    """Through PolicyDataplane: ``update`` batches, the CNI path (``add_endpoint`` /
    ``remove_endpoint``) and the periodic check (``sync``, which must find nothing). With
    ``calico``, Calico's kinds too: entering or leaving their model replaces the table."""
    r = random.Random(10_000 + seed)
    fams = r.choice(((4,), (4, 6)))
    world = fz.World()
    for _ in range(80):
        world.apply(fz.random_update(r, world.state(), calico=calico))
    model = NftModel()
    dp = PolicyDataplane(fz.NODE, backend=model, families=fams, counter_reader=lambda t, names: [])
    assert dp.sync(world.state(), world.nat).full
    for i in range(OPS):
        u = fz.random_update(r, world.state(), calico=calico)
        before_calico = fz.calico_mode(world)
        before_hosts = bool(dp.desired().hosts)
        world.apply(u)
        before_nat = dp.state is not None and dp._engine.nat.enabled
        if u.kind == "endpoint" and isinstance(u.value, Endpoint) and r.random() < 0.5:
            res = dp.add_endpoint(u.value)
        elif u.kind == "endpoint" and u.value is None and r.random() < 0.5:
            ns, _, name = u.key.partition("/")
            res = dp.remove_endpoint(ns, name)
        else:
            res = dp.update([u])
        nat_flip = before_nat != world.nat.enabled
        calico_flip = before_calico != fz.calico_mode(world)
        want = Snapshot(engine.compute(world.state(), fz.NODE, fams), world.nat)
        hosts_flip = before_hosts != bool(want.ir.hosts)
        assert res.full == (nat_flip or calico_flip or hosts_flip), f"seed {seed} op {i}: {u}"
        assert model.canonical() == full_table(want), f"seed {seed} op {i}: {u}"
        if i % 50 == 49:
            check = dp.sync(world.state(), world.nat)
            assert (check.fixes, check.changed) == (0, False)
    c = dp.counters
    assert (c.check_fixes, c.apply_errors, model.redundant) == (0, 0, 0)
    assert c.checks == OPS // 50


# --- focused ----------------------------------------------------------------------------------


def _ep(name: str, addr: str, node: str = "n2", ns: str = "x", **labels: str) -> Endpoint:
    iface = f"cali{name}" if node == fz.NODE else f"remote{name}"
    return Endpoint(ns, name, node, iface, (addr,), f"{name}-eth0", tuple(labels.items()))


def _selecting(peer_labels: dict[str, str], name: str = "p") -> Policy:
    return Policy(
        "x",
        name,
        LabelSelector.of({"role": "server"}),
        (Rule((Peer(LabelSelector.of(peer_labels)),)),),
    )


def _engine(*policies: Policy) -> IncrementalPolicy:
    eng = IncrementalPolicy(fz.NODE, (4,))
    eng.put_endpoint(_ep("srv", "10.0.9.1", node=fz.NODE, role="server"))
    for p in policies:
        eng.put_policy(p)
    eng.take_delta()
    return eng


def _set_of(eng: IncrementalPolicy, policy: Policy) -> str:
    (chain,) = [c for c in eng.desired().chains.values() if c.policy == policy.key]
    (name,) = {r.peer_set for r in chain.rules if r.peer_set}
    return name


def test_two_endpoints_with_one_address_keep_it_until_both_are_gone() -> None:
    p = _selecting({"app": "x"})
    eng = _engine(p)
    s = _set_of(eng, p)
    eng.put_endpoint(_ep("e1", "10.0.0.1", app="x"))
    eng.put_endpoint(_ep("e2", "10.0.0.1", app="x"))
    assert eng.take_delta().added == {s: {"10.0.0.1"}}
    eng.remove_endpoint("x", "e1-eth0")
    assert eng.take_delta().empty  # e2 still holds it
    assert eng.desired().elements[s] == {"10.0.0.1"}
    eng.remove_endpoint("x", "e2-eth0")
    assert eng.take_delta().removed == {s: {"10.0.0.1"}}


def test_a_relabelled_pod_moves_its_address_between_sets_in_one_delta() -> None:
    px, py = _selecting({"app": "x"}, "px"), _selecting({"app": "y"}, "py")
    eng = _engine(px, py)
    sx, sy = _set_of(eng, px), _set_of(eng, py)
    eng.put_endpoint(Endpoint("x", "w", "n3", "caliw", ("10.0.0.7",), "w-eth0"))
    assert eng.take_delta().empty  # no labels of its own, no pod: in no set
    eng.put_pod(Pod("x", "w", (("app", "x"),)))
    assert eng.take_delta().added == {sx: {"10.0.0.7"}}
    eng.put_pod(Pod("x", "w", (("app", "y"),)))
    d = eng.take_delta()
    assert (d.removed, d.added) == ({sx: {"10.0.0.7"}}, {sy: {"10.0.0.7"}})
    eng.remove_pod("x", "w")  # back to the endpoint's own (no) labels
    assert eng.take_delta().removed == {sy: {"10.0.0.7"}}
    # a change and its reversal within one batch cancel out
    eng.put_pod(Pod("x", "w", (("app", "x"),)))
    eng.remove_pod("x", "w")
    assert eng.take_delta().empty


def test_a_new_policy_fills_its_sets_and_what_nothing_uses_goes() -> None:
    eng = _engine()
    for i in range(5):
        eng.put_endpoint(_ep(f"e{i}", f"10.0.0.{i}", app="x" if i % 2 else "y"))
    eng.take_delta()
    p = _selecting({"app": "x"})
    eng.put_policy(p)
    d = eng.take_delta()
    (s,) = d.new_sets
    assert d.new_elements[s] == {"10.0.0.1", "10.0.0.3"}
    assert list(d.new_chains) == [c for c in eng.desired().chains]
    assert list(d.changed_endpoints) == ["calisrv"]
    # the only selected local endpoint goes: the chain and its set go with it
    eng.remove_endpoint("x", "srv-eth0")
    d = eng.take_delta()
    assert d.gone_sets == (s,)
    assert len(d.gone_chains) == 1
    assert d.gone_endpoints == ("calisrv",)
    assert eng.desired() == engine.compute(eng.state(), fz.NODE, (4,))


def test_a_namespace_relabel_changes_only_the_namespace_selector_sets() -> None:
    p = Policy(
        "x",
        "from-blue",
        LabelSelector.of({"role": "server"}),
        (Rule((Peer(None, LabelSelector.of({"team": "blue"})),)),),
    )
    eng = _engine(p, _selecting({"app": "x"}))
    eng.put_endpoint(_ep("q", "10.0.5.1", ns="y", app="x"))
    eng.put_endpoint(_ep("r", "10.0.5.2", ns="y", app="z"))
    assert eng.take_delta().empty  # namespace y is not blue; app=x is in namespace x only
    eng.put_namespace(Namespace("y", (("team", "blue"),)))
    d = eng.take_delta()
    assert d.added == {_set_of(eng, p): {"10.0.5.1", "10.0.5.2"}}
    assert (d.new_chains, d.changed_chains, d.new_sets, d.changed_endpoints) == ({}, {}, {}, {})
    eng.remove_namespace("y")
    assert eng.take_delta().removed == {_set_of(eng, p): {"10.0.5.1", "10.0.5.2"}}


def test_named_ports_follow_the_pods_that_declare_them() -> None:
    p = Policy(
        "x", "web", LabelSelector.of({"role": "server"}), (Rule((), (PortSpec("TCP", "http"),)),)
    )
    eng = _engine(p)
    (named,) = [n for n, d in eng.desired().sets.items() if d.kind == "named-port"]
    eng.put_endpoint(_ep("w", "10.0.0.8", node="n2"))
    eng.put_pod(Pod("x", "w", (), (ContainerPort("http", 8080), ContainerPort("http", 8080))))
    assert eng.take_delta().added == {named: {("10.0.0.8", "tcp", 8080)}}
    eng.put_pod(Pod("x", "w", (), (ContainerPort("http", 9000, "UDP"),)))
    d = eng.take_delta()
    assert d.removed == {named: {("10.0.0.8", "tcp", 8080)}}
    assert d.added == {named: {("10.0.0.8", "udp", 9000)}}


def test_a_local_endpoint_moving_away_loses_its_program_and_a_remote_one_gains_it() -> None:
    p = _selecting({"app": "x"})
    eng = _engine(p)
    ep = _ep("m", "10.0.0.9", node=fz.NODE, role="server")
    eng.put_endpoint(ep)
    d = eng.take_delta()
    assert list(d.new_endpoints) == ["calim"]
    eng.put_endpoint(dataclasses.replace(ep, node="n2"))
    assert eng.take_delta().gone_endpoints == ("calim",)
    assert eng.desired() == engine.compute(eng.state(), fz.NODE, (4,))


def test_updates_by_key_and_their_kinds() -> None:
    eng = IncrementalPolicy(fz.NODE, (4,))
    p = _selecting({"app": "x"})
    ep = _ep("u", "10.0.0.3", app="x")
    n = eng.apply(
        [
            Update("policy", p.key, p),
            Update("endpoint", "x/u-eth0", ep),
            Update("endpoint", "x/u-eth0", ep),  # the same again: no change
            Update("namespace", "x", Namespace("x", (("a", "b"),))),
            Update("pod", "x/u", Pod("x", "u")),
            Update("nat", "", NatConfig((("10.0.0.0/16", True),))),
        ]
    )
    assert n == 5
    st = eng.state()
    assert (len(st.policies), len(st.endpoints), len(st.namespaces), len(st.pods)) == (1, 1, 1, 1)
    n = eng.apply(
        [
            Update("policy", p.key, None),
            Update("endpoint", "x/u-eth0", None),
            Update("namespace", "x", None),
            Update("pod", "x/u", None),
            Update("pod", "x/nobody", None),
            Update("nat", "", None),
        ]
    )
    assert n == 5
    assert eng.state() == ClusterState()
    with pytest.raises(ValueError, match="unknown update kind"):
        eng.apply([Update("node", "n", None)])  # type: ignore[arg-type]


def test_load_applies_only_the_differences() -> None:
    st = tt.build_state(tt.CASES[13].steps[0])
    eng = IncrementalPolicy("node1", (4,))
    assert eng.load(st) == len(st.policies) + len(st.namespaces) + len(st.pods) + len(st.endpoints)
    assert eng.desired() == engine.compute(st, "node1", (4,))
    eng.take_delta()
    assert eng.load(st) == 0
    assert eng.take_delta() == Delta()
    smaller = st.without_endpoint("x", "a-eth0")
    assert eng.load(dataclasses.replace(smaller, policies=())) == 1 + len(st.policies)
    assert eng.desired() == engine.compute(dataclasses.replace(smaller, policies=()), "node1", (4,))


NEWCOMERS = [
    Endpoint("x", "n1", "node1", "calin1", ("10.244.1.50", "fd00::50"), labels=(("pod", "b"),)),
    Endpoint("y", "n2", "node1", "calin2", ("10.244.2.50",), labels=(("pod", "a"),)),
    Endpoint("z", "n3", "node2", "calin3", ("10.244.3.50",), labels=(("pod", "c"),)),
    Endpoint("q", "n4", "node1", "calin4", ("10.244.9.50",), labels=()),
    Endpoint("x", "n5", "node1", "", ("10.244.1.51",), labels=(("pod", "a"),)),
    Endpoint("x", "b", "node1", "calixb2", ("10.244.1.77",), "b-net1"),  # a second one of x/b
]


@pytest.mark.parametrize("case", tt.CASES, ids=lambda c: c.id)
def test_one_endpoint_in_and_out_of_every_truth_table_step(case: tt.Case) -> None:
    """Every step of the e2e truth table, a newcomer of each kind (with its own labels, or
    a Pod with named ports, or an existing pod relabelled), added and removed again: equal
    to the full computation each time, and back to where it started."""
    for step in case.steps:
        state = tt.build_state(step)
        eng = IncrementalPolicy("node1")
        eng.load(state)
        before = eng.desired()
        assert before == engine.compute(state, "node1")
        for ep in NEWCOMERS:
            pods = [None, Pod(ep.namespace, ep.pod, ep.labels, tt.NAMED_PORTS[:2])]
            pods.append(Pod(ep.namespace, ep.pod, (("pod", "zz"),)))
            for pod in pods:
                known = next(
                    (p for p in state.pods if (p.namespace, p.name) == (ep.namespace, ep.pod)),
                    None,
                )
                grown = state.with_endpoint(ep, pod)
                if pod is not None:
                    eng.put_pod(pod)
                eng.put_endpoint(ep)
                assert eng.desired() == engine.compute(grown, "node1"), (ep, pod)
                eng.remove_endpoint(ep.namespace, ep.name)
                if pod is not None and known is not None:
                    eng.put_pod(known)
                elif pod is not None:
                    eng.remove_pod(pod.namespace, pod.name)
                assert eng.desired() == before
        for victim in ("x/a", "y/b"):
            ns, name = victim.split("/")
            eng.remove_endpoint(ns, f"{name}-eth0")
            assert eng.desired() == engine.compute(
                state.without_endpoint(ns, f"{name}-eth0"), "node1"
            )
            eng.load(state)


# --- cost: flat in the size of the cluster (counted, not timed) -------------------------------


def _cluster(n: int) -> ClusterState:
    pods, eps = [], []
    for i in range(n):
        ns, name = f"ns{i % 10}", f"p{i}"
        labels = (("app", f"app{i % 7}"), ("tier", ("web", "db")[i % 2]))
        pods.append(Pod(ns, name, labels, (ContainerPort("http", 8080),)))
        node = fz.NODE if i < 50 else f"n{2 + i % 50}"
        addr = f"10.{i // 65536}.{(i // 256) % 256}.{i % 256}"
        eps.append(Endpoint(ns, name, node, f"cali{i:06d}", (addr,), f"{name}-eth0"))
    policies = []
    for j in range(40):
        ns = f"ns{j % 10}"
        peers = (
            Peer(LabelSelector.of({"app": f"app{j % 7}"})),
            Peer(LabelSelector.of({"tier": "web"}), LabelSelector()),
        )
        ports = (PortSpec("TCP", "http"), PortSpec("TCP", 80 + j))
        policies.append(
            Policy(ns, f"pol{j}", LabelSelector.of({"app": f"app{j % 7}"}), (Rule(peers, ports),))
        )
    nss = tuple(Namespace(f"ns{k}", (("team", f"t{k % 3}"),)) for k in range(10))
    return ClusterState(tuple(policies), nss, tuple(pods), tuple(eps))


def test_work_per_remote_event_does_not_grow_with_the_cluster(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Selector evaluations and set-element operations for a remote pod's start and stop, a
    relabel and a namespace relabel: the same with 300 and with 3,000 endpoints."""
    calls = {"matches": 0}
    real = LabelSelector.matches

    def counting(self: LabelSelector, labels: object, items: frozenset[tuple[str, str]]) -> bool:
        calls["matches"] += 1
        return real(self, labels, items)  # type: ignore[arg-type]

    def work(n: int) -> list[int]:
        eng = IncrementalPolicy(fz.NODE, (4,))
        eng.load(_cluster(n))
        eng.take_delta()
        out = []
        ep = Endpoint("ns3", "new", "n9", "calinew", ("10.99.0.1",), "new-eth0")
        pod = Pod("ns3", "new", (("app", "app3"), ("tier", "web")), (ContainerPort("http", 80),))
        steps = (
            lambda: eng.put_pod(pod),
            lambda: eng.put_endpoint(ep),
            lambda: eng.put_pod(dataclasses.replace(pod, labels=(("app", "app4"),))),
            lambda: eng.put_namespace(Namespace("ns3", (("team", "t9"),))),
            lambda: eng.remove_endpoint("ns3", "new-eth0"),
        )
        for step in steps:
            calls["matches"] = 0
            step()
            d = eng.take_delta()
            out.append(calls["matches"] + d.size)
        return out

    monkeypatch.setattr(LabelSelector, "matches", counting)
    small, large = work(300), work(3000)
    assert small == large
    assert all(small[1:])  # it did something (a pod without endpoints is nothing)


class _Counted:
    """A Calico selector that counts its evaluations (the engine takes anything with
    ``matches``; equal and named by its text, as the real one)."""

    calls = 0

    def __init__(self, text: str) -> None:
        self.sel = parse_selector(text)

    def matches(self, labels: Mapping[str, str]) -> bool:
        _Counted.calls += 1
        return self.sel.matches(labels)

    def __str__(self) -> str:
        return str(self.sel)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Counted) and str(self) == str(other)

    def __hash__(self) -> int:
        return hash(str(self))


def _gnp(i: int, app: str, peer: str, proto: int = 6) -> CalicoPolicy:
    source = EntityMatch(selector=_Counted(f"app == '{peer}'"))
    rules = (
        CalicoRule("Deny", protocol=proto, source=source),
        CalicoRule("Pass"),
    )
    types: frozenset[Direction] = frozenset({"ingress"})
    return CalicoPolicy(f"g{i}", None, _Counted(f"app == '{app}'"), "security", i, types, rules)


def test_work_per_event_in_calicos_model_does_not_grow_with_the_calico_policies() -> None:
    """In Calico's model (GlobalNetworkPolicies in a tier) no change but entering it is a
    full computation: selector evaluations and the delta's size for a remote pod's start
    and relabel, a GlobalNetworkPolicy's change and a tier's are the same with 10 and 200
    Calico policies (the 190 more select no local endpoint); a local pod's start tests its
    labels against every Calico policy once (190 evaluations more), a namespace relabel
    its local endpoints' (5 in ns3)."""

    def work(extra: int) -> list[int]:
        state = dataclasses.replace(
            _cluster(300),
            calico_policies=(
                *(_gnp(i, f"app{i % 7}", f"app{(i + 1) % 7}") for i in range(10)),
                *(_gnp(10 + i, "nobody", "app1") for i in range(extra)),
            ),
            tiers=(Tier("security", 10),),
        )
        eng = IncrementalPolicy(fz.NODE, (4,))
        eng.load(state)
        assert eng.take_delta().replace
        pod = Pod("ns3", "new", (("app", "app3"), ("tier", "web")), (ContainerPort("http", 80),))
        remote = Endpoint("ns3", "new", "n9", "calinew", ("10.99.0.1",), "new-eth0")
        local_pod = dataclasses.replace(pod, name="mine")
        local = Endpoint("ns3", "mine", fz.NODE, "calimine", ("10.99.0.2",), "mine-eth0")
        steps = (
            lambda: eng.put_pod(pod),
            lambda: eng.put_endpoint(remote),
            lambda: eng.put_pod(dataclasses.replace(pod, labels=(("app", "app4"),))),
            lambda: eng.put_calico_policy("g3", _gnp(3, "app3", "app5", 17)),
            lambda: eng.put_tier("security", Tier("security", 20, "Pass")),
            lambda: eng.put_pod(local_pod) and eng.put_endpoint(local),
            lambda: eng.put_namespace(Namespace("ns3", (("team", "t9"),))),
        )
        out = []
        for step in steps:
            _Counted.calls = 0
            assert step()
            d = eng.take_delta()
            assert not d.replace
            out.append(_Counted.calls + d.size)
        assert eng.desired() == engine.compute(eng.state(), fz.NODE, (4,))
        return out

    small, large = work(0), work(190)
    assert small[:5] == large[:5]
    assert large[5] - small[5] == 190
    assert large[6] - small[6] == 6 * 190  # ns3's 5 local endpoints and the new one
    assert all(small[1:])


# --- the dataplane ------------------------------------------------------------------------------


def test_the_periodic_check_counts_and_fixes_what_the_updates_missed(
    caplog: pytest.LogCaptureFixture,
) -> None:
    model = NftModel()
    dp = PolicyDataplane("node1", backend=model, families=(4,), counter_reader=lambda t, names: [])
    st = tt.build_state(tt.CASES[2].steps[0])  # 3: x/a from x/b
    dp.sync(st)
    assert dp.counters.checks == 0
    # a pod elsewhere joins the selector, but nobody told the dataplane
    ep = Endpoint("x", "b2", "node2", "calib2", ("10.244.1.200",), "b2-eth0", (("pod", "b"),))
    grown = st.with_endpoint(ep)
    res = dp.sync(grown)
    assert (res.fixes, res.full, res.changed) == (1, False, True)
    assert model.canonical() == full_table(
        Snapshot(engine.compute(grown, "node1", (4,)), NatConfig())
    )
    assert (dp.counters.checks, dp.counters.check_fixes) == (1, 1)
    assert dp.sync(grown).fixes == 0
    # a fault inside the engine (its state no longer what its inputs give): rebuilt
    name = next(n for n, e in dp.desired().elements.items() if "10.244.1.200" in e)
    dp._engine._members[name].clear()
    with caplog.at_level(logging.ERROR, logger="tabby.node.policy"):
        res = dp.sync(grown)
    assert "rebuilding" in caplog.text
    assert res.full
    assert res.fixes >= 1
    assert dp.desired() == engine.compute(grown, "node1", (4,))
    assert model.canonical() == full_table(Snapshot(dp.desired(), NatConfig()))


def test_update_needs_a_first_sync_and_a_refused_delta_replaces_the_table() -> None:
    model = NftModel()
    dp = PolicyDataplane("node1", backend=model, families=(4,), counter_reader=lambda t, names: [])
    with pytest.raises(RuntimeError, match="first sync"):
        dp.update([])
    assert not dp.synced
    assert dp.state is None
    st = tt.build_state(tt.Step((tt.DENY_INGRESS,), tt.everything))
    dp.sync(st)
    assert dp.synced
    # someone deleted a chain behind our back: the next delta touching it is refused
    model.tables["inet tabby"].chains["to-calixa"][1].clear()
    del model.tables["inet tabby"].maps["wl-to"][1]['"calixa"']
    del model.tables["inet tabby"].chains["to-calixa"]
    res = dp.update([Update("policy", tt.DENY_INGRESS.key, None)])
    assert res.full
    assert dp.counters.apply_errors == 1
    assert model.canonical() == full_table(Snapshot(dp.desired(), NatConfig()))
    # a full replacement refused too: raised; the next change replaces the table again
    model.fail_next = 2
    with pytest.raises(nft.NftError):
        dp.update([fz.put(tt.DENY_ALL)])
    res = dp.update([fz.put(tt.DENY_INGRESS)])
    assert res.full
    want = dataclasses.replace(st, policies=(tt.DENY_ALL, tt.DENY_INGRESS))
    assert model.canonical() == full_table(
        Snapshot(engine.compute(want, "node1", (4,)), NatConfig())
    )
    assert dp.explain(("x", "b"), ("x", "a")).allowed is False


# --- documents -> updates (policy.inputs) -------------------------------------------------------


def test_document_changes_become_engine_updates() -> None:
    index = Index((*POLICY, POOLS))
    index.replace(PolicyWorld(TWO_POLICIES).docs)
    memo = inputs.PolicyInputs()
    state, nat = memo.convert(index.snapshot())
    index.drain()
    eng = IncrementalPolicy("node1", (4,))
    eng.load(state, nat)

    def check(*extra: Change) -> list[Update]:
        ups = memo.updates([*index.drain(), *extra])
        eng.apply(ups)
        fresh_state, fresh_nat = inputs.PolicyInputs().convert(index.snapshot())
        assert eng.desired() == engine.compute(fresh_state, "node1", (4,))
        assert eng.nat == fresh_nat
        assert sorted(map(repr, eng.state().endpoints)) == sorted(map(repr, fresh_state.endpoints))
        return ups

    docs = PolicyWorld(TWO_POLICIES).docs
    wep = docs["workloadendpoint"]["x/a-eth0"]
    index.delete("workloadendpoint", "x/a-eth0")
    assert check() == [Update("endpoint", "x/a-eth0", None)]
    index.put("workloadendpoint", "x/a-eth0", Doc(wep.data, 500))
    index.put("pod", "x/b", Doc({"metadata": {"name": "b", "namespace": "x"}}, 501))
    index.put("namespace", "y", Doc({"metadata": {"name": "y", "labels": {"ns": "blue"}}}, 502))
    index.delete("networkpolicy", tt.DENY_INGRESS.key)
    ups = check(Change("node", "n1", None))  # not a kind of the policy engine: skipped
    assert [(u.kind, u.key, u.value is None) for u in ups] == [
        ("endpoint", "x/a-eth0", False),
        ("pod", "x/b", False),
        ("namespace", "y", False),
        ("policy", tt.DENY_INGRESS.key, True),
    ]
    # a document whose identity changes under its key: the old input goes first
    moved = {**wep.data, "metadata": {**wep.data["metadata"], "name": "a-net1"}}
    index.put("workloadendpoint", "x/a-eth0", Doc(moved, 504))
    assert [(u.key, u.value is None) for u in check()] == [("x/a-eth0", True), ("x/a-net1", False)]
    # pools: one NAT update with all of them
    index.put("pool", "10.9.0.0/16", Doc({"cidr": "10.9.0.0/16", "block_size": 26}, 505))
    (nat_update,) = check()
    assert nat_update == Update(
        "nat", "", NatConfig((("10.244.0.0/16", True), ("10.9.0.0/16", False)))
    )
    index.delete("pool", "10.244.0.0/16")
    index.delete("pool", "10.9.0.0/16")
    assert check() == [Update("nat", "", NatConfig())]
    # deleted before it was ever seen: removed by its store key (a no-op here)
    index.put("pod", "z/ghost", Doc({"metadata": {"name": "ghost", "namespace": "z"}}, 506))
    index.delete("pod", "z/ghost")
    assert check() == [Update("pod", "z/ghost", None)]


def test_the_agents_flow_sends_a_cni_endpoint_once_and_the_check_finds_nothing() -> None:
    """As tabby-node runs it: a first sync from the documents; a CNI ADD programs its
    endpoint at once (``add_endpoint``); the next pass feeds the journal (which has that
    endpoint too: nothing to send); the periodic check finds nothing to fix."""
    index = Index((*POLICY, POOLS))
    index.replace(PolicyWorld(TWO_POLICIES).docs)
    memo = inputs.PolicyInputs()
    model = NftModel()
    dp = PolicyDataplane("node1", backend=model, families=(4,), counter_reader=lambda t, names: [])
    state, nat = memo.convert(index.snapshot())
    index.drain()
    assert dp.sync(state, nat).full
    meta = {"name": "new-eth0", "namespace": "x", "labels": {"pod": "b"}}
    spec = {
        "pod": "new",
        "node": "node1",
        "containerID": "c-new",
        "interface": "eth0",
        "hostInterface": "calinew0000000",
        "ipNetworks": ["10.244.1.99/32"],
    }
    index.put("workloadendpoint", "x/new-eth0", Doc({"metadata": meta, "spec": spec}, 900))
    wep = index.snapshot().get(ENDPOINTS, "x/new-eth0")
    assert wep is not None
    res = dp.add_endpoint(inputs.endpoint(wep), None)
    assert res.changed
    assert not res.full
    sent = len(model.transactions)
    res = dp.update(memo.updates(index.drain()))
    assert not res.changed
    assert len(model.transactions) == sent
    state, nat = memo.convert(index.snapshot())
    check = dp.sync(state, nat, full=True)
    assert (check.fixes, check.full) == (0, True)
    assert model.canonical() == full_table(Snapshot(engine.compute(state, "node1", (4,)), nat))
