"""NetworkPolicy across a cluster (issue 13): the e2e truth table with pods spread over 3
nodes, for the BIRD and the VXLAN backend; no window at a pod's ADD; no window while
tabby-node restarts; hostile policies.

Each backend gets one lab (3 nodes, etcd, tabby-node per node, IPv4) shared by its tests:
pods x/a .. z/c made through the installed binaries at the truth table's addresses (each
namespace's pods on three different nodes, so pods a claim their namespace's block and
pods b and c borrow from it), their Namespace and Pod resources applied with ``tabbyctl
apply``, a TCP and UDP server on 80 and 81 in each. A case step becomes NetworkPolicy,
Namespace and Pod documents (tests/policy_truth_table.py), applied with ``tabbyctl apply``;
the matrix (9 x 8 pods x TCP/UDP x 80/81) is probed until it matches the step's expectation
or 10 s passed, then compared; between cases everything is deleted and the matrix must be
all open again. Every case runs on BIRD, a representative subset on VXLAN.
"""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from tabbyctl.demo.lab import Lab, LabNode, LabPod
from tests import policy_truth_table as tt
from tests.cluster import policy_lab as pl
from tests.cluster.conftest import new_lab

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

#: On VXLAN: UDP (1, 40, d3), named ports (17, 19, d3), ipBlock except (35), egress (19,
#: 28, d3), cross-namespace selectors (10, 21, 28), live label changes (21, 22), ports (14).
VXLAN_CASES = {1, 2, 10, 14, 17, 19, 21, 22, 28, 35, 40, "d3"}
SETTLE_SECONDS = 10.0


class Labs:
    """At most one lab at a time (two would share the 2 cores): asking for another backend
    tears the current lab down first. The tests are ordered by backend in this file."""

    def __init__(self) -> None:
        self.backend: str | None = None
        self.lab: Lab | None = None
        self.harness: pl.TruthTableLab | None = None

    def get(self, backend: str) -> pl.TruthTableLab:
        if self.backend == backend and self.harness is not None:
            return self.harness
        self.close()
        self.backend = backend
        self.lab = lab = new_lab(nodes_wanted=3, backend=backend, ipv6=False, echo=lambda _: None)
        lab.build()
        lab.wait_ready(90)
        self.harness = harness = pl.TruthTableLab.build(lab)
        bad, _ = harness.settle(pl.ALL_OPEN, 30)
        assert not bad, f"the pods do not reach each other: {bad[:10]}"
        return harness

    def close(self) -> None:
        harness, lab = self.harness, self.lab
        self.backend, self.harness, self.lab = None, None, None
        try:
            if harness is not None:
                harness.close()
        finally:
            if lab is not None:
                problems = lab.teardown()
                assert not problems, problems


@pytest.fixture(scope="module")
def labs() -> Iterator[Labs]:
    labs = Labs()
    try:
        yield labs
    finally:
        labs.close()


@pytest.fixture
def bird(labs: Labs) -> pl.TruthTableLab:
    """The BIRD lab (3 nodes, full mesh) with the truth table's pods serving."""
    return labs.get("bird")


@pytest.fixture
def vxlan(labs: Labs) -> pl.TruthTableLab:
    """The VXLAN lab (3 nodes) with the truth table's pods serving."""
    return labs.get("vxlan")


def _run_steps(netpol: pl.TruthTableLab, steps: tuple[tt.Step, ...]) -> None:
    for i, step in enumerate(steps):
        netpol.apply_step(step)
        bad, _ = netpol.settle(pl.expected_matrix(step), SETTLE_SECONDS)
        assert not bad, f"step {i}: {len(bad)} mismatches:\n" + "\n".join(bad[:30])


def _reset(netpol: pl.TruthTableLab) -> None:
    """Every policy deleted, labels back: the matrix is all open again (a deleted policy
    stops being enforced)."""
    netpol.reset()
    bad, _ = netpol.settle(pl.ALL_OPEN, SETTLE_SECONDS)
    assert not bad, "after deleting the case's policies:\n" + "\n".join(bad[:30])


@pytest.mark.parametrize("case", tt.CASES, ids=lambda c: c.id)
def test_e2e_netpol_bird(bird: pl.TruthTableLab, case: tt.Case) -> None:
    try:
        _run_steps(bird, case.steps)
    finally:
        _reset(bird)


# -- no window at a pod's ADD ------------------------------------------------------------------


def _add_serving_pod(
    netpol: pl.TruthTableLab, node: LabNode, namespace: str, name: str
) -> tuple[LabPod, Any]:
    """A pod whose server listens before its ADD (its namespace exists, not yet wired), so
    that the first packet that could reach it would be answered."""
    pod = netpol.lab.new_pod(node, namespace, name)
    server = pl.start_server(pod.netns)
    return pod, server


def _add(netpol: pl.TruthTableLab, pod: LabPod, ip: str) -> None:
    lab = netpol.lab
    rc, out = lab.cni(lab.node(pod.node), "ADD", pod, extra_args=f"IP={ip}")
    assert rc == 0, out
    assert out is not None
    pod.result = out


def _jobs(address: str) -> list[pl.Job]:
    return [(address, "TCP", 80), (address, "UDP", 81), (address, "TCP", 81), (address, "UDP", 80)]


def test_new_pod_under_default_deny_is_never_reachable(bird: pl.TruthTableLab) -> None:
    """Default-deny ingress in x; x/d is added on node-1 (through node-1's tabby-node) while
    pods on all three nodes probe its address continuously, from before the ADD until 2 s
    after it: not one probe is answered. Then the policy goes and the same probes pass
    (the server and the routes were there all along). A pod in a namespace without policy
    answers the first probe sent after its ADD."""
    netpol = bird
    lab = netpol.lab
    node = lab.nodes[0]  # x/a's node: it owns 10.244.1.0/26, every node routes it already
    address, open_address = "10.244.1.20", "10.244.1.21"
    deny = tt.Step((tt.DENY_INGRESS,), lambda s, d, pr, po: not tt.in_x(d))
    servers = []
    made: list[LabPod] = []
    try:
        netpol.apply_step(deny)
        bad, _ = netpol.settle(pl.expected_matrix(deny), SETTLE_SECONDS)
        assert not bad, bad[:10]
        pl.must(pl.apply_docs(lab, [tt.pod_doc("x/d", {"pod": "d"})]))
        pod, server = _add_serving_pod(netpol, node, "x", "d")
        servers.append(server)
        made.append(pod)
        sources = [netpol.pods[p].netns for p in ("y/c", "y/a", "y/b")]  # node-1, -2, -3
        probers = [pl.Prober(ns, _jobs(address)).start() for ns in sources]
        try:
            time.sleep(0.5)
            t_add = time.monotonic()
            _add(netpol, pod, address)
            t_done = time.monotonic()
            time.sleep(2.0)
            # control: without the policy the very same probers get answers
            t_open = time.monotonic()
            netpol.apply_step(tt.Step((), tt.everything))
            deadline = time.monotonic() + SETTLE_SECONDS
            while time.monotonic() < deadline and not all(p.answered for p in probers):
                time.sleep(0.1)
        finally:
            for p in probers:
                p.stop()
        assert pod.addresses() == [address]
        after = sum(1 for p in probers for sent, _ in p.rounds if t_done <= sent < t_open)
        assert after >= 30, f"too few probe rounds after the ADD: {after}"
        early = [(round(t - t_add, 3), j) for p in probers for t, j in p.answered if t < t_open]
        assert early == [], f"x/d answered under default deny (s after the ADD began): {early}"
        assert all(p.answered for p in probers), "x/d never answered, even without the policy"

        # a namespace without policy: reachable right after the ADD
        pl.must(pl.apply_docs(lab, [tt.namespace_doc("open", {"ns": "open"})]))
        netpol.apply_step(deny)  # x is isolated again: "open" must not care
        bad, _ = netpol.settle(pl.expected_matrix(deny), SETTLE_SECONDS)
        assert not bad, bad[:10]
        opened, server = _add_serving_pod(netpol, node, "open", "q")
        servers.append(server)
        made.append(opened)
        _add(netpol, opened, open_address)
        got = pl.probe_from({ns: _jobs(open_address) for ns in sources}, 3.0)
        assert all(got.values()), got
    finally:
        for server in servers:
            pl.stop_process(server)
        for pod in made:
            lab.del_pod(pod)  # also after a failed ADD, as runtimes do
        pl.delete_docs(lab, [tt.pod_doc("x/d", {}), tt.namespace_doc("open", {})])
        _reset(netpol)


# -- no window while tabby-node restarts ----------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_restart_under_default_deny_lets_nothing_through(
    bird: pl.TruthTableLab, sig: signal.Signals
) -> None:
    """tabby-node on node-1 is stopped (SIGTERM, or SIGKILL) and started again under a
    default-deny ingress policy while y/c and z/b (node-1) and y/a (node-2) probe node-1's
    x/a continuously, from before the stop until the new tabby-node is ready and beyond:
    not one probe is answered. Each prober also probes a path the policy allows through
    node-1 (a control): it answers again after the restart, and then the whole matrix is
    as the policy says."""
    netpol = bird
    lab = netpol.lab
    node = lab.nodes[0]
    deny = tt.Step((tt.DENY_INGRESS,), lambda s, d, pr, po: not tt.in_x(d))
    try:
        netpol.apply_step(deny)
        bad, _ = netpol.settle(pl.expected_matrix(deny), SETTLE_SECONDS)
        assert not bad, bad[:10]
        xa = tt.address("x/a")
        denied = _jobs(xa)
        # every prober also has a path that the policy allows, through node-1
        allowed = {"y/c": tt.address("z/b"), "z/b": tt.address("y/c"), "y/a": tt.address("z/b")}
        probers = {
            src: pl.Prober(netpol.pods[src].netns, [*denied, (dst, "TCP", 80)]).start()
            for src, dst in allowed.items()  # y/c, z/b on node-1; y/a on node-2
        }
        try:
            time.sleep(0.3)
            t_stop = time.monotonic()
            lab.stop_agent(node, sig)
            time.sleep(0.5)
            lab.start_agent(node)
            lab.wait_agent(node)
            lab.wait_ready(90)
            t_ready = time.monotonic()
            deadline = t_ready + 30
            while time.monotonic() < deadline and not all(
                any(t > t_ready for t, _ in p.answered) for p in probers.values()
            ):
                time.sleep(0.1)
        finally:
            for p in probers.values():
                p.stop()
        through = [
            (src, round(t - t_stop, 3), j)
            for src, p in probers.items()
            for t, j in p.answered
            if j in denied
        ]
        assert through == [], f"x/a answered during the restart: {through}"
        rounds = sum(
            1 for p in probers.values() for sent, _ in p.rounds if t_stop <= sent <= t_ready
        )
        assert rounds >= 20, f"too few probe rounds during the restart: {rounds}"
        for src, p in probers.items():
            assert any(t > t_ready for t, _ in p.answered), f"{src}: allowed path still closed"
        bad, _ = netpol.settle(pl.expected_matrix(deny), 30)
        assert not bad, "after the restart:\n" + "\n".join(bad[:30])
    finally:
        _reset(netpol)


# -- hostile input ----------------------------------------------------------------------


def _np(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": "x"},
        "spec": spec,
    }


ALL_PORTS_80 = [{"ports": [{"port": "serve-80-tcp", "endPort": 81}]}]
HOSTILE = [
    (_np("named-endport", {"ingress": ALL_PORTS_80}), "spec.ingress[0].ports[0].endPort"),
    (
        _np(
            "except-outside",
            {
                "egress": [
                    {"to": [{"ipBlock": {"cidr": "10.244.1.0/24", "except": ["10.244.2.0/25"]}}]}
                ]
            },
        ),
        "spec.egress[0].to[0].ipBlock.except[0]",
    ),
    (
        _np(
            "block-and-pods",
            {"ingress": [{"from": [{"ipBlock": {"cidr": "10.0.0.0/8"}, "podSelector": {}}]}]},
        ),
        "spec.ingress[0].from[0]",
    ),
    (
        _np("icmp", {"ingress": [{"ports": [{"protocol": "ICMP", "port": 80}]}]}),
        "spec.ingress[0].ports[0].protocol",
    ),
    (
        _np(
            "bad-operator",
            {
                "podSelector": {
                    "matchExpressions": [{"key": "pod", "operator": "Equals", "values": ["a"]}]
                }
            },
        ),
        "spec.podSelector.matchExpressions[0].operator",
    ),
    (
        _np("port-range", {"ingress": [{"ports": [{"port": 70000}]}]}),
        "spec.ingress[0].ports[0].port",
    ),
    (
        _np(
            "in-no-values",
            {"podSelector": {"matchExpressions": [{"key": "pod", "operator": "In"}]}},
        ),
        "spec.podSelector.matchExpressions[0].values",
    ),
    (_np("sideways", {"policyTypes": ["Ingress", "Sideways"]}), "spec.policyTypes[1]"),
    (
        _np("cidr-33", {"egress": [{"to": [{"ipBlock": {"cidr": "10.0.0.0/33"}}]}]}),
        "spec.egress[0].to[0].ipBlock.cidr",
    ),
    (_np("empty-peer", {"ingress": [{"from": [{}]}]}), "spec.ingress[0].from[0]"),
    (_np("typo", {"podSelector": {}, "ingres": [{}]}), "spec.ingres"),
]


def test_invalid_policies_are_refused_with_their_field_path(bird: pl.TruthTableLab) -> None:
    """Each invalid policy, after a valid deny-all in the same file: exit 1, one line on
    stderr naming the policy and the field path, nothing on stdout, nothing written (the
    valid policy neither), and the matrix stays all open."""
    netpol = bird
    lab = netpol.lab
    fine = tt.network_policy(tt.DENY_ALL)
    for i, (doc, path) in enumerate(HOSTILE):
        proc = pl.apply_docs(lab, [fine, doc], fmt="yaml" if i % 2 else "json")
        name = doc["metadata"]["name"]
        assert proc.returncode == 1, (name, proc.returncode, proc.stderr)
        assert proc.stdout == "", (name, proc.stdout)
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1, (name, lines)
        assert f"NetworkPolicy/{name}: {path}:" in lines[0], (name, lines[0])
    listed = lab.tabbyctl("get", "networkpolicies", "-n", "x", "-o", "json")
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["items"] == []
    bad = netpol.check(pl.ALL_OPEN)
    assert not bad, bad[:10]


def test_policy_that_selects_nothing_changes_nothing(bird: pl.TruthTableLab) -> None:
    """Deny-all policies that select no pod (a label no pod has; a namespace without pods)
    change nothing. Proven after they are in force: a later sentinel policy (deny ingress
    to z/c), applied after them through the same watch, is enforced, and the matrix is
    all open but for z/c."""
    netpol = bird
    lab = netpol.lab
    nobody = tt.pol("nobody", tt.sel(pod="nobody"), types=("Ingress", "Egress"))
    elsewhere = tt.pol("deny-all", types=("Ingress", "Egress"), ns="empty")
    sentinel = tt.pol("sentinel", tt.sel(pod="c"), types=("Ingress",), ns="z")
    docs = [tt.network_policy(p) for p in (nobody, elsewhere)]
    try:
        pl.must(pl.apply_docs(lab, docs))
        pl.must(pl.apply_docs(lab, [tt.network_policy(sentinel)]))
        want = pl.expected_matrix(tt.Step((), lambda s, d, pr, po: d != "z/c"))
        bad, _ = netpol.settle(want, SETTLE_SECONDS)
        assert not bad, "\n".join(bad[:30])
    finally:
        pl.must(pl.delete_docs(lab, [*docs, tt.network_policy(sentinel)]))
        _reset(netpol)


# -- VXLAN: a representative subset (last: the BIRD lab is gone by then) -------------------------


@pytest.mark.parametrize(
    "case", [c for c in tt.CASES if c.number in VXLAN_CASES], ids=lambda c: c.id
)
def test_e2e_netpol_vxlan(vxlan: pl.TruthTableLab, case: tt.Case) -> None:
    try:
        _run_steps(vxlan, case.steps)
    finally:
        _reset(vxlan)
