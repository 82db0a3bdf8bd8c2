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
from policy.engine import ClusterState
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
