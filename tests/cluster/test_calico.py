"""Calico's policy model across a cluster (issue 30): Calico's documents applied unchanged
(``projectcalico.org/v3``) with ``tabbyctl apply``, real traffic between pods on different
nodes, and every verdict checked against ``tabbyctl policy explain``.

One lab for the module (BIRD, 3 nodes, IPv4): the truth table's pods x/a .. z/c
(tests/cluster/policy_lab.py; x/a, y/c, z/b on node-1; x/b, y/a, z/c on node-2; x/c, y/b,
z/a on node-3; labelled ``pod=a|b|c``, their namespaces ``ns=x|y|z``) and a namespace
``shop`` with ``frontend`` (node-1), ``backend`` (node-2) and ``db`` (node-3), labelled
``app=...``, each pod serving TCP and UDP on 80 and 81 and declaring the named ports
``serve-<port>-<protocol>``.

Each case of :data:`CASES` applies its documents in one ``tabbyctl apply`` (some of them
the files of conf-examples/calico/ as they are), probes the whole matrix (12 x 11 pods x
TCP/UDP x 80/81) until it is the case's expectation (at most 10 s), asks ``policy explain``
about a few connections (its verdict must be the expectation's and name the rule or the
tier's end that decided), runs the case's own checks (pings, the policy log, the staged
counters), then deletes its documents: the matrix must be all open again. The cases: tiers
with Pass and defaultAction Deny and Pass; an order tie broken by name and Deny before
Allow; Log (the policy log names the rule); a staged policy (counted with staged="true",
logged as would-deny, never enforced); a GlobalNetworkPolicy with namespaceSelector and
network sets matched by labels (the nets of pods on another node); port ranges, named
ports, notPorts, notNets, notSelector, protocol, notProtocol and icmp.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from bundle.types import JSON as Doc
from tabbyctl.demo.lab import Lab, LabNode, LabPod, http_get
from tests import REPO_ROOT
from tests import policy_truth_table as tt
from tests.cluster import policy_lab as pl
from tests.cluster.conftest import new_lab
from tests.policy_probes import Job, start_server, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

V3 = "projectcalico.org/v3"
EXAMPLES = REPO_ROOT / "conf-examples" / "calico"
SETTLE_SECONDS = 10.0
SHOP = {"shop/frontend": 0, "shop/backend": 1, "shop/db": 2}  # pod -> node index
PODS = (*tt.PODS, *SHOP)
PROBED = (("TCP", 80), ("TCP", 81), ("UDP", 80), ("UDP", 81))
Key = tuple[str, str, str, int]
Expect = Callable[[str, str, str, int], bool]


def ns(pod: str) -> str:
    return pod.split("/")[0]


def name(pod: str) -> str:
    return pod.split("/")[1]


def example(file: str) -> list[Doc]:
    """A file of conf-examples/calico/, as it is."""
    return [d for d in yaml.safe_load_all((EXAMPLES / file).read_text()) if d]


def doc(kind: str, name_: str, spec: Doc, namespace: str | None = None, **meta: Any) -> Doc:
    metadata: Doc = {"name": name_, **meta}
    if namespace is not None:
        metadata["namespace"] = namespace
    return {"apiVersion": V3, "kind": kind, "metadata": metadata, "spec": spec}


def net(pod: str) -> str:
    return tt.address(pod) + "/32"


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    docs: tuple[Doc, ...]
    expect: Expect
    #: (source, destination, port/PROTO, allowed, text the explanation must contain)
    explain: tuple[tuple[str, str, str, bool, str], ...]
    #: applied before the policies, and after their deletion (labels a case needs)
    before: tuple[Doc, ...] = ()
    after: tuple[Doc, ...] = ()
    check: Callable[[World], None] | None = None


# -- the world ---------------------------------------------------------------------------------


@dataclasses.dataclass
class World:
    harness: pl.TruthTableLab
    shop: dict[str, LabPod]
    servers: list[Any]

    @property
    def lab(self) -> Lab:
        return self.harness.lab

    def address(self, pod: str) -> str:
        if pod in self.shop:
            return self.shop[pod].addresses()[0]
        return tt.address(pod)

    def netns(self, pod: str) -> str:
        return (self.shop.get(pod) or self.harness.pods[pod]).netns

    def node_of(self, pod: str) -> LabNode:
        return self.lab.node((self.shop.get(pod) or self.harness.pods[pod]).node)

    def probe(self, keys: list[Key], timeout: float) -> dict[Key, bool]:
        jobs: dict[str, list[Job]] = {}
        for s, d, pr, po in keys:
            jobs.setdefault(self.netns(s), []).append((self.address(d), pr, po))
        got = pl.probe_from(jobs, timeout)
        return {k: got[(self.netns(k[0]), (self.address(k[1]), k[2], k[3]))] for k in keys}

    def check(self, expected: Mapping[Key, bool], careful: bool) -> list[str]:
        got = self.probe(list(expected), 0.4)
        if careful:  # a slow machine must not fake a denial
            again = [k for k, ok in expected.items() if ok and not got[k]]
            if again:
                got.update(self.probe(again, 3.0))
        return [
            f"{s} -> {d} {pr}/{po}: expected {'allow' if want else 'deny'}"
            for (s, d, pr, po), want in expected.items()
            if got[(s, d, pr, po)] != want
        ]

    def settle(self, expected: Mapping[Key, bool]) -> list[str]:
        start = time.monotonic()
        while True:
            bad = self.check(expected, careful=False)
            if not bad:
                return []
            if time.monotonic() - start > SETTLE_SECONDS:
                return self.check(expected, careful=True)
            time.sleep(0.2)

    def explain(self, src: str, dst: str, port: str, direction: str = "--to") -> list[str]:
        proc = self.lab.tabbyctl("policy", "explain", src, direction, dst, "--port", port)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout.splitlines()

    def policy_log(self, node: LabNode) -> list[dict[str, Any]]:
        proc = self.lab.tabbyctl("policy", "log", "-o", "json", node=node)
        assert proc.returncode == 0, proc.stderr
        return [json.loads(line) for line in proc.stdout.splitlines()]

    def ping(self, src: str, dst: str) -> bool:
        return self.lab.ping(self.netns(src), self.address(dst), count=1, wait=1.0)


def matrix(expect: Expect) -> dict[Key, bool]:
    return {
        (s, d, pr, po): expect(s, d, pr, po)
        for s in PODS
        for d in PODS
        if s != d
        for pr, po in PROBED
    }


def everything(s: str, d: str, pr: str, po: int) -> bool:
    return True


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    lab = new_lab(nodes_wanted=3, backend="bird", ipv6=False, echo=lambda _: None)
    harness = None
    servers: list[Any] = []
    try:
        lab.build()
        lab.wait_ready(90)
        harness = pl.TruthTableLab.build(lab)
        shop_docs: list[Doc] = [tt.namespace_doc("shop", {"ns": "shop"})]
        shop_docs += [tt.pod_doc(pod, {"app": name(pod)}) for pod in SHOP]
        pl.must(pl.apply_docs(lab, shop_docs))
        shop = {pod: lab.add_pod(lab.nodes[i], "shop", name(pod)) for pod, i in SHOP.items()}
        for p in shop.values():
            servers.append(start_server(p.netns))
        w = World(harness, shop, servers)
        bad = w.settle(matrix(everything))
        assert not bad, f"the pods do not reach each other: {bad[:10]}"
        yield w
    finally:
        try:
            for proc in servers:
                stop_process(proc)
            if harness is not None:
                harness.close()
        finally:
            problems = lab.teardown()
            assert not problems, problems


# -- the cases ---------------------------------------------------------------------------------

IN_X = "projectcalico.org/namespace == 'x'"


def _tiers(s: str, d: str, pr: str, po: int) -> bool:
    if ns(d) != "x":
        return True
    if ns(s) == "z" and pr == "UDP":
        return False  # security: Deny
    if ns(s) == "y":  # security: Pass; platform: TCP 80, else its defaultAction Pass
        return (pr, po) == ("TCP", 80) or pr == "UDP"  # default: x-udp
    return name(s) == "b"  # security: Allow, else the tier's end (Deny)


TIERS = Case(
    "tiers-pass-default-action",
    (
        doc("Tier", "security", {"order": 100}),
        doc("Tier", "platform", {"order": 200, "defaultAction": "Pass"}),
        doc(
            "GlobalNetworkPolicy",
            "security.guard-x",
            {
                "tier": "security",
                "order": 10,
                "selector": IN_X,
                "ingress": [
                    {
                        "action": "Deny",
                        "protocol": "UDP",
                        "source": {"namespaceSelector": "ns == 'z'"},
                    },
                    {"action": "Pass", "source": {"namespaceSelector": "ns == 'y'"}},
                    {"action": "Allow", "source": {"selector": "pod == 'b'"}},
                ],
            },
        ),
        doc(
            "GlobalNetworkPolicy",
            "platform.y-web",
            {
                "tier": "platform",
                "order": 10,
                "selector": IN_X,
                "ingress": [
                    {
                        "action": "Allow",
                        "protocol": "TCP",
                        "source": {"namespaceSelector": "ns == 'y'"},
                        "destination": {"ports": [80]},
                    }
                ],
            },
        ),
        doc(
            "NetworkPolicy",
            "x-udp",
            {"selector": "all()", "ingress": [{"action": "Allow", "protocol": "UDP"}]},
            "x",
        ),
    ),
    _tiers,
    (
        ("y/a", "x/b", "80/TCP", True, "platform.y-web ingress[0]"),
        ("y/c", "x/c", "81/UDP", True, "x-udp ingress[0]"),
        ("y/a", "x/a", "81/TCP", False, "none of their"),
        ("z/c", "x/c", "80/UDP", False, "security.guard-x ingress[0] (Deny)"),
        ("z/b", "x/a", "81/TCP", True, "security.guard-x ingress[2]"),
        ("shop/db", "x/b", "80/TCP", False, "in tier security"),
    ),
)


def _tie(s: str, d: str, pr: str, po: int) -> bool:
    if d != "x/a":
        return True
    if (pr, po) == ("UDP", 81):
        return False  # early (order 50) before the others
    if ns(s) == "y" and pr == "TCP":
        return True  # tie-a before tie-b: order 100 both, by name
    return ns(s) not in ("y", "z")  # tie-b: Deny before its Allow


def _x_a(name_: str, order: int, ingress: list[Doc]) -> Doc:
    return doc(
        "NetworkPolicy", name_, {"order": order, "selector": "pod == 'a'", "ingress": ingress}, "x"
    )


TIE = Case(
    "order-tie-by-name-deny-first",
    (
        _x_a(
            "tie-b",
            100,
            [
                {"action": "Deny", "source": {"namespaceSelector": "ns in {'y', 'z'}"}},
                {"action": "Allow"},
            ],
        ),
        _x_a(
            "tie-a",
            100,
            [{"action": "Allow", "protocol": "TCP", "source": {"namespaceSelector": "ns == 'y'"}}],
        ),
        _x_a("early", 50, [{"action": "Deny", "protocol": "UDP", "destination": {"ports": [81]}}]),
    ),
    _tie,
    (
        ("y/b", "x/a", "81/TCP", True, "tie-a ingress[0]"),
        ("y/b", "x/a", "80/UDP", False, "tie-b ingress[0] (Deny)"),
        ("x/c", "x/a", "81/UDP", False, "early ingress[0] (Deny)"),
        ("shop/db", "x/a", "80/UDP", True, "tie-b ingress[1]"),
    ),
)


def _check_log(w: World) -> None:
    """Connections from z to x/a met the Log rule: node-1's policy log has them with the
    rule named (verdict ``log``)."""
    deadline = time.monotonic() + 5
    while True:
        entries = [
            e
            for e in w.policy_log(w.node_of("x/a"))
            if e["verdict"] == "log" and e["dst_pod"] == "x/a" and ns(e["src_pod"] or "") == "z"
        ]
        if entries or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert entries, "no Log rule entry in node-1's policy log"
    assert all(
        any("security.block-untrusted ingress[0]" in p for p in e["policies"]) for e in entries
    ), entries


LOG = Case(
    "log-deny-pass-examples",
    (*example("03-security-tier.yaml"), *example("04-deny-egress-to-nets.yaml")),
    lambda s, d, pr, po: ns(s) != "z",
    (
        ("z/a", "x/a", "80/TCP", False, "security.block-untrusted ingress[1] (Deny)"),
        ("z/a", "x/a", "80/TCP", False, "logged by"),
        ("y/a", "x/a", "80/TCP", True, "passed"),
        ("x/a", "192.0.2.7", "80/TCP", False, "security.deny-blocked-egress egress[0] (Deny)"),
    ),
    before=(tt.namespace_doc("z", {"ns": "z", "trust": "untrusted"}),),
    after=(tt.namespace_doc("z", {"ns": "z", "trust": None}),),
    check=_check_log,
)


def _check_staged(w: World) -> None:
    """The staged policy counted what it would have decided on shop/db's node (node-3),
    with staged="true", and logged the connections it would have denied."""
    node = w.node_of("shop/db")
    code, body = http_get(node.netns, "http://127.0.0.1:9091/metrics", timeout=10)
    assert code == 200, body[:300]
    staged = [
        line
        for line in body.decode().splitlines()
        if line.startswith("tabby_policy_packets_total{")
        and 'staged="true"' in line
        and "db-lockdown" in line
        and float(line.rsplit(" ", 1)[1]) > 0
    ]
    assert any('rule="ingress[0]"' in x and 'verdict="allow"' in x for x in staged), staged
    assert any('rule="ingress[1]"' in x and 'verdict="deny"' in x for x in staged), staged
    would = [
        e for e in w.policy_log(node) if e["verdict"] == "would-deny" and e["dst_pod"] == "shop/db"
    ]
    assert would, "no would-deny entry in node-3's policy log"
    assert all(any("db-lockdown ingress[1]" in p for p in e["policies"]) for e in would), would


STAGED = Case(
    "staged-never-enforced",
    tuple(example("05-staged-lockdown.yaml")),
    everything,
    (
        ("x/a", "shop/db", "80/TCP", True, "staged: would have denied: by"),
        ("x/a", "shop/db", "80/TCP", True, "db-lockdown ingress[1] (Deny)"),
        ("shop/backend", "shop/db", "80/TCP", True, "staged: would have allowed"),
    ),
    check=_check_staged,
)


def _shop(s: str, d: str, pr: str, po: int) -> bool:
    if ns(d) != "shop":
        return True
    return (s, d, pr, po) == ("shop/frontend", "shop/backend", "TCP", 80)


SHOP_EXAMPLES = Case(
    "default-deny-allow-frontend-examples",
    (*example("01-default-deny.yaml"), *example("02-allow-from-frontend.yaml")),
    _shop,
    (
        ("shop/frontend", "shop/backend", "80/TCP", True, "backend-from-frontend ingress[0]"),
        ("shop/frontend", "shop/backend", "81/TCP", False, "none of their"),
        ("x/a", "shop/backend", "80/TCP", False, "none of their"),
        ("shop/frontend", "shop/db", "80/TCP", False, "isolated by 1 policy"),
    ),
)

FAR = ("z/c", "y/a", "x/c")  # the network sets' pods: z/c and y/a on node-2, x/c on node-3


def _netsets(s: str, d: str, pr: str, po: int) -> bool:
    return d not in ("x/a", "x/b") or s in FAR


NETSETS = Case(
    "gnp-namespace-selector-network-sets",
    (
        doc(
            "GlobalNetworkSet",
            "far-pods",
            {"nets": [net("z/c"), net("y/a")]},
            labels={"role": "far"},
        ),
        doc("NetworkSet", "near", {"nets": [net("x/c")]}, "x", labels={"role": "near"}),
        doc(
            "GlobalNetworkPolicy",
            "from-sets",
            {
                "namespaceSelector": "ns == 'x'",
                "selector": "pod in {'a', 'b'}",
                "ingress": [
                    {"action": "Allow", "source": {"selector": "role == 'far'"}},
                    {"action": "Allow", "source": {"selector": "role == 'near'"}},
                    {
                        "action": "Allow",
                        "protocol": "TCP",
                        "source": {"selector": "role == 'node'"},
                        "destination": {"ports": [80]},
                    },
                ],
            },
        ),
    ),
    _netsets,
    (
        ("z/c", "x/a", "80/TCP", True, "from-sets ingress[0]"),
        ("x/c", "x/b", "81/UDP", True, "from-sets ingress[1]"),
        ("y/b", "x/a", "80/TCP", False, "none of their"),
        ("y/b", "x/c", "80/TCP", True, "no policy selects the pod for ingress"),
    ),
    check=lambda w: _check_node_set(w),
)


def _check_node_set(w: World) -> None:
    """Traffic from nodes: x/a (node-1) is isolated, so node-2 and node-3 do not reach it;
    a GlobalNetworkSet labelled role=node holding node-2's address, applied now, lets
    node-2 in on TCP 80 (and only there), node-3 still not."""
    lab = w.lab
    n2, n3 = lab.nodes[1], lab.nodes[2]
    xa = tt.address("x/a")
    jobs = [(xa, "TCP", 80), (xa, "TCP", 81)]

    def probe() -> dict[tuple[str, int, str], bool]:
        got = pl.probe_from({n2.netns: jobs, n3.netns: jobs}, 0.5)
        return {(ns_, port, pr): ok for (ns_, (_, pr, port)), ok in got.items()}

    closed = {(n.netns, port, "TCP"): False for n in (n2, n3) for port in (80, 81)}
    assert probe() == closed
    nodes = doc(
        "GlobalNetworkSet", "nodes", {"nets": [f"{n2.ipv4.ip}/32"]}, labels={"role": "node"}
    )
    pl.must(pl.apply_docs(lab, [nodes]))
    try:
        want = {**closed, (n2.netns, 80, "TCP"): True}
        deadline = time.monotonic() + SETTLE_SECONDS
        while (got := probe()) != want and time.monotonic() < deadline:
            time.sleep(0.2)
        assert got == want
        lines = w.explain("x/a", str(n2.ipv4.ip), "80/TCP", direction="--from")
        assert lines[-1].strip() == "allowed: by default/from-sets ingress[2]", lines
    finally:
        pl.must(pl.delete_docs(lab, [nodes]))


def _fields(s: str, d: str, pr: str, po: int) -> bool:
    if ns(d) == "y":  # TCP "79:80" (a range), UDP serve-81-udp (a named port)
        return (pr, po) in (("TCP", 80), ("UDP", 81))
    if ns(d) == "z":
        if pr == "TCP":  # notNets x/a, notPorts 81
            return po != 81 and s != "x/a"
        # UDP 80 from a source not labelled pod=b; any UDP from the frontend (notProtocol TCP)
        return (po == 80 and name(s) != "b") or s == "shop/frontend"
    if ns(d) == "x":  # TCP from anyone; ICMP echo from y only (checked by ping)
        return pr == "TCP"
    return True


def _check_icmp(w: World) -> None:
    got = {
        (s, d): w.ping(s, d)
        for s, d in (("y/a", "x/a"), ("y/c", "x/c"), ("z/a", "x/a"), ("shop/db", "x/b"))
    }
    assert got == {
        ("y/a", "x/a"): True,
        ("y/c", "x/c"): True,
        ("z/a", "x/a"): False,
        ("shop/db", "x/b"): False,
    }, got


FIELDS = Case(
    "rule-fields",
    (
        doc(
            "NetworkPolicy",
            "y-ports",
            {
                "selector": "all()",
                "ingress": [
                    {"action": "Allow", "protocol": "TCP", "destination": {"ports": ["79:80"]}},
                    {
                        "action": "Allow",
                        "protocol": "UDP",
                        "destination": {"ports": ["serve-81-udp"]},
                    },
                ],
            },
            "y",
        ),
        doc(
            "GlobalNetworkPolicy",
            "z-not",
            {
                "namespaceSelector": "ns == 'z'",
                "selector": "all()",
                "ingress": [
                    {
                        "action": "Allow",
                        "protocol": "TCP",
                        "source": {"notNets": [net("x/a")]},
                        "destination": {"notPorts": [81]},
                    },
                    {
                        "action": "Allow",
                        "protocol": "UDP",
                        "source": {"notSelector": "pod == 'b'"},
                        "destination": {"ports": [80]},
                    },
                    {
                        "action": "Allow",
                        "notProtocol": "TCP",
                        "source": {"selector": "app == 'frontend'"},
                    },
                ],
            },
        ),
        doc(
            "GlobalNetworkPolicy",
            "x-icmp",
            {
                "namespaceSelector": "ns == 'x'",
                "selector": "all()",
                "ingress": [
                    {
                        "action": "Allow",
                        "protocol": "ICMP",
                        "icmp": {"type": 8},
                        "source": {"namespaceSelector": "ns == 'y'"},
                    },
                    {"action": "Allow", "protocol": "TCP"},
                ],
            },
        ),
    ),
    _fields,
    (
        ("x/b", "y/a", "80/TCP", True, "y-ports ingress[0]"),
        ("x/b", "y/a", "serve-81-udp/UDP", True, "y-ports ingress[1]"),
        ("x/b", "y/a", "81/TCP", False, "none of their"),
        ("x/a", "z/b", "80/TCP", False, "none of their"),
        ("x/b", "z/b", "80/TCP", True, "z-not ingress[0]"),
        ("y/b", "z/a", "80/UDP", False, "none of their"),
        ("shop/frontend", "z/b", "81/UDP", True, "z-not ingress[2]"),
        ("y/c", "x/c", "80/UDP", False, "none of their"),
    ),
    check=_check_icmp,
)

CASES = (TIERS, TIE, LOG, STAGED, SHOP_EXAMPLES, NETSETS, FIELDS)
ALL_OPEN = matrix(everything)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_calico_policies_on_real_traffic(world: World, case: Case) -> None:
    lab = world.lab
    try:
        if case.before:
            pl.must(pl.apply_docs(lab, list(case.before)))
        pl.must(pl.apply_docs(lab, list(case.docs)))
        bad = world.settle(matrix(case.expect))
        assert not bad, f"{len(bad)} mismatches:\n" + "\n".join(bad[:30])
        for src, dst, port, allowed, text in case.explain:
            lines = world.explain(src, dst, port)
            verdict = "ALLOWED" if allowed else "DENIED"
            (summary,) = [line for line in lines if line.startswith(f"{src} -> ")]
            assert summary.endswith(verdict), (src, dst, port, lines)
            assert text in "\n".join(lines), (src, dst, port, lines)
            if "/" in dst and port.split("/")[0].isdigit():
                number, proto = port.split("/")
                key = (src, dst, proto, int(number))
                if key[2:] in PROBED:  # the explanation is the traffic's
                    assert case.expect(*key) == allowed, key
        if case.check is not None:
            case.check(world)
    finally:
        pl.must(pl.delete_docs(lab, list(case.docs)))
        if case.after:
            pl.must(pl.apply_docs(lab, list(case.after)))
    bad = world.settle(ALL_OPEN)
    assert not bad, "after deleting the case's documents:\n" + "\n".join(bad[:30])
