"""Calico's policy model in the kernel: tiers, Pass, defaultAction, Deny, Log, staged policies
and network sets, probed through real nftables on one node.

The truth table's nine pods (``tests/privileged/test_policy_nft.py``'s cluster: pod
namespaces behind ``cali*`` veths, a server on TCP and UDP 80 and 81 in each). Each scenario
is applied through :class:`PolicyDataplane` and the whole matrix probed; what the kernel
lets through must be what ``engine.explain`` decides (which ``tests/unit/policy/test_calico.py``
holds to Calico's semantics), so a wrong rendering of Pass (the mark bit), a tier's end or a
staged policy shows here as a probe that disagrees.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator

import pytest

from policy import engine
from policy.calico import (
    CalicoPolicy,
    CalicoRule,
    EntityMatch,
    NetworkSet,
    PortMatch,
    Tier,
)
from policy.counters import END_OF_TIER
from policy.engine import ClusterState
from policy.incremental import Update
from tests import policy_truth_table as tt
from tests.privileged.test_policy_nft import PROBE_PROTOCOLS, Cluster, _cluster
from tests.unit.policy.test_calico import gnp, src

pytestmark = pytest.mark.privileged

TCP, UDP = 6, 17


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with _cluster() as c:
        yield c


def source(selector: str | None = None, namespaces: str | None = None) -> EntityMatch:
    return src(selector=selector, namespace_selector=namespaces)


SECURITY = Tier("security", 10)
PLATFORM = Tier("platform", 20, "Pass")

SCENARIOS: dict[str, tuple[tuple[CalicoPolicy, ...], tuple[tt.Policy, ...], tuple[Tier, ...]]] = {
    # security denies y -> x and passes z on; default: x admits only TCP 80 (a Kubernetes
    # policy isolating x, and a Calico policy at order 500 allowing TCP 80)
    "deny-pass-and-kubernetes": (
        (
            gnp(
                "guard",
                (
                    CalicoRule("Deny", source=source(namespaces="ns == 'y'")),
                    CalicoRule("Pass", source=source(namespaces="ns == 'z'")),
                ),
                namespace_selector="ns == 'x'",
                tier="security",
            ),
            gnp(
                "web",
                (
                    CalicoRule(
                        "Allow",
                        protocol=TCP,
                        destination=EntityMatch(ports=(PortMatch(80, 80),)),
                    ),
                ),
                namespace_selector="ns == 'x'",
                order=500,
            ),
        ),
        (tt.DENY_INGRESS,),
        (SECURITY,),
    ),
    # a tier whose end passes; Log then Allow UDP; a staged policy that would deny all
    "tier-end-pass-log-staged": (
        (
            gnp(
                "udp-only",
                (
                    CalicoRule("Log", protocol=UDP),
                    CalicoRule("Allow", protocol=UDP, source=source("pod == 'a'")),
                    CalicoRule("Deny", protocol=UDP),
                ),
                selector="pod in {'b', 'c'}",
                tier="platform",
            ),
            gnp("would-deny", (CalicoRule("Deny"),), tier="security", staged=True),
            gnp(
                "not-81",
                (
                    CalicoRule(
                        "Deny",
                        protocol=TCP,
                        destination=EntityMatch(ports=(PortMatch(81, 81),)),
                    ),
                ),
                selector="pod == 'c'",
            ),
        ),
        (),
        (SECURITY, PLATFORM),
    ),
    # Pass out of the last tier: the profile allows; the first policy by order decides
    "order-and-profile": (
        (
            gnp("b-deny", (CalicoRule("Deny", protocol=UDP),), order=5),
            gnp("a-pass", (CalicoRule("Pass", protocol=TCP),), order=5),
            gnp("late-deny", (CalicoRule("Deny"),), order=9),
        ),
        (),
        (),
    ),
}


def _state(cluster: Cluster, name: str) -> ClusterState:
    calico, k8s, tiers = SCENARIOS[name]
    base = cluster.state(tt.Step(k8s, tt.everything))
    return dataclasses.replace(base, calico_policies=calico, tiers=tiers)


def _expected(state: ClusterState) -> dict[tuple[str, str, str, int], bool]:
    out = {}
    for s in tt.PODS:
        for d in tt.PODS:
            if s == d:
                continue
            for proto in PROBE_PROTOCOLS:
                for port in tt.PORTS:
                    src, dst = s.split("/"), d.split("/")
                    ok = engine.allowed(state, (src[0], src[1]), (dst[0], dst[1]), proto, port)
                    out[(s, d, proto, port)] = ok
    return out


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_calicos_model_in_the_kernel(cluster: Cluster, name: str) -> None:
    state = _state(cluster, name)
    try:
        cluster.apply(state)
        want = _expected(state)
        assert any(want.values())
        assert not all(want.values())
        bad = cluster.matrix(want)
        assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:30])
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_network_sets_and_the_staged_counters(cluster: Cluster) -> None:
    """A network set's nets are matched by a rule selector; a staged policy's rules count
    what they would decide (named counters with ``staged``) and let everything through."""
    corp = NetworkSet("corp", None, (("role", "corp"),), (tt.address("y/a") + "/32",))
    state = dataclasses.replace(
        _state(cluster, "order-and-profile"),
        calico_policies=(
            gnp(
                "from-corp",
                (CalicoRule("Allow", source=source("role == 'corp'", "global()")),),
                selector="pod == 'b'",
                namespace_selector="ns == 'x'",
            ),
            gnp("would-deny", (CalicoRule("Deny"),), tier="security", staged=True),
        ),
        network_sets=(corp,),
        tiers=(SECURITY,),
    )
    try:
        cluster.apply(state)
        want = _expected(state)
        # y/a is in the set by its address: only it reaches x/b
        assert [k for k, ok in want.items() if k[1] == "x/b" and ok] == [
            ("y/a", "x/b", p, port) for p in PROBE_PROTOCOLS for port in tt.PORTS
        ]
        bad = cluster.matrix(want)
        assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:30])
        counts = cluster.node.run(cluster.dp.packet_counts)
        staged = {k: n for k, (n, _) in counts.items() if k.staged}
        assert staged, counts
        assert all(k.policy == "would-deny" and k.verdict == "deny" for k in staged)
        assert sum(staged.values()) > 0
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_a_staged_tier_end_counts_what_its_staged_policies_would_deny(cluster: Cluster) -> None:
    """A tier only a staged policy selects x/b in (``security``: Allow UDP) decides nothing:
    every probe passes. What none of its rules would have decided is counted at the tier's
    end (the staged policy's ``end-of-tier`` counter, verdict deny): TCP 80 is; UDP is the
    staged rule's; TCP 81, which an enforced tier before it allows, never reaches it."""
    to_b = {"selector": "pod == 'b'", "namespace_selector": "ns == 'x'"}
    port_81 = EntityMatch(ports=(PortMatch(81, 81),))
    first = gnp(
        "tcp-81", (CalicoRule("Allow", protocol=TCP, destination=port_81),), tier="first", **to_b
    )
    staged = gnp(
        "udp-only", (CalicoRule("Allow", protocol=UDP),), tier="security", staged=True, **to_b
    )
    base = cluster.state(tt.Step((), tt.everything))
    state = dataclasses.replace(
        base, calico_policies=(first, staged), tiers=(Tier("first", 5, "Pass"), SECURITY)
    )

    def counts() -> tuple[int, int]:
        got = cluster.node.run(cluster.dp.packet_counts)
        end = sum(n for k, (n, _) in got.items() if k.staged and k.rule == END_OF_TIER)
        rule = sum(n for k, (n, _) in got.items() if k.staged and k.rule == "ingress[0]")
        return end, rule

    def probe(proto: str, port: int) -> tuple[int, int]:
        before = counts()
        job = (tt.address("x/b"), proto, port)
        assert cluster.probe({"y/a": [job]}, timeout=3.0)[("y/a", job)], (proto, port)
        after = counts()
        return after[0] - before[0], after[1] - before[1]

    try:
        cluster.apply(state)
        ends = [k for k in cluster.node.run(cluster.dp.packet_counts) if k.rule == END_OF_TIER]
        assert [(k.policy, k.verdict, k.tier) for k in ends] == [("udp-only", "deny", "security")]
        end, rule = probe("TCP", 80)
        assert end > 0
        assert rule == 0
        end, rule = probe("UDP", 80)
        assert end == 0
        assert rule > 0
        assert probe("TCP", 81) == (0, 0)
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_changes_of_calicos_kinds_are_differences_in_the_kernel(cluster: Cluster) -> None:
    """Past the first Calico policy (a replacement), a policy edited, a tier's defaultAction
    flipped and a policy removed are each one difference nft takes (a refused one would
    replace the table: ``full``), and the kernel then decides as explain; the last Calico
    policy gone replaces the table again and the Kubernetes policies alone decide."""
    state = _state(cluster, "deny-pass-and-kubernetes")
    calico = state.calico_policies
    try:
        cluster.apply(state)
        steps = [
            dataclasses.replace(state, tiers=(Tier("security", 10, "Pass"),)),
            dataclasses.replace(
                state, calico_policies=(dataclasses.replace(calico[0], order=3.0), calico[1])
            ),
            dataclasses.replace(state, calico_policies=calico[1:]),
        ]
        for i, step in enumerate(steps):
            updates = cluster.node.run(_updates, cluster, step)
            res = cluster.node.run(cluster.dp.update, updates)
            assert not res.full, f"step {i}: a replacement"
            assert cluster.dp.counters.apply_errors == 0
            bad = cluster.matrix(_expected(step))
            assert not bad, f"step {i}: {len(bad)} mismatches:\n" + "\n".join(bad[:30])
        last = dataclasses.replace(state, calico_policies=())
        res = cluster.node.run(cluster.dp.update, cluster.node.run(_updates, cluster, last))
        assert res.full
        assert not cluster.matrix(_expected(last))
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def _updates(cluster: Cluster, want: ClusterState) -> list[Update]:
    """The updates that turn the dataplane's Calico inputs into ``want``'s."""
    have = cluster.dp.state
    assert have is not None
    out: list[Update] = []
    for kind, old, new, key in (
        ("calico-policy", have.calico_policies, want.calico_policies, lambda v: v.key),
        ("tier", have.tiers, want.tiers, lambda v: v.name),
        ("network-set", have.network_sets, want.network_sets, lambda v: v.key),
    ):
        olds = {key(v): v for v in old}
        news = {key(v): v for v in new}
        out += [Update(kind, k, None) for k in olds.keys() - news.keys()]  # type: ignore[arg-type]
        out += [Update(kind, k, v) for k, v in news.items() if olds.get(k) != v]  # type: ignore[arg-type]
    return out
