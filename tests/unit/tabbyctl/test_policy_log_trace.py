"""``tabbyctl policy log`` and ``policy trace`` without a kernel: the log read from real
tabby-node HTTP routes (two nodes, merged by time, filtered, followed), the trace's plan
(where the probe leaves from, whom to ask) and its comparison with ``policy explain``, and
the datastore documents a trace across nodes is made of.

The kernel and the cluster tiers (tests/privileged/test_policy_visibility.py,
tests/cluster/test_policy_visibility.py) run the real probes.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from daemon.http import Endpoints, serve
from datastore.errors import StoreCorrupt
from resources import trace as rtrace
from tabby_node import policylog
from tabbyctl import policy_log, policy_trace
from tabbyctl.policy import PolicyCluster
from tests import policy_truth_table as tt

# -- policy log ----------------------------------------------------------------------------------


class Node:
    """A node's ring served as tabby-node serves it (``/policy/log``) on 127.0.0.1."""

    def __init__(self, name: str) -> None:
        self.flows = policylog.DeniedFlows(name)
        routes = {"/policy/log": policylog.http_route(self.flows)}
        self.server = serve("127.0.0.1", 0, Endpoints(list, list, None, routes), "t")
        port = self.server.server_address[1]
        self.source = policy_log.Source("127.0.0.1", port, f"tabby-node of {name}")

    def deny(self, t: float, src: str, dst: str, port: int = 80) -> None:
        self.flows.add(
            time=t,
            src=tt.address(src),
            dst=tt.address(dst),
            src_pod=src,
            dst_pod=dst,
            protocol="TCP",
            dport=port,
            direction="ingress",
            policies=(f"{tt.ns_of(dst)}/deny-all",),
        )

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def nodes() -> Iterator[tuple[Node, Node]]:
    a, b = Node("node-1"), Node("node-2")
    yield a, b
    a.close()
    b.close()


def _show(sources: list[policy_log.Source], output: str = "json", **kw: Any) -> list[str]:
    out: list[str] = []
    keep = policy_log.pod_filter(kw.pop("namespace", None), kw.pop("pod", None))
    policy_log.show(sources, follow=False, keep=keep, output=output, echo=out.append)
    return out


def test_two_nodes_merged_by_time_as_json_lines(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    a.deny(1_700_000_002.0, "y/a", "x/a")
    b.deny(1_700_000_001.0, "z/b", "x/b", 81)
    a.deny(1_700_000_003.0, "y/b", "x/c")
    lines = _show([a.source, b.source])
    got = [json.loads(line) for line in lines]
    assert [(e["node"], e["src_pod"]) for e in got] == [
        ("node-2", "z/b"),
        ("node-1", "y/a"),
        ("node-1", "y/b"),
    ]
    assert list(got[0]) == list(policy_log.FIELDS)  # the contract's fields, in order
    assert got[0] == {
        "time": "2023-11-14T22:13:21.000Z",
        "node": "node-2",
        "src": tt.address("z/b"),
        "dst": tt.address("x/b"),
        "src_pod": "z/b",
        "dst_pod": "x/b",
        "protocol": "TCP",
        "dport": 81,
        "direction": "ingress",
        "verdict": "deny",
        "policies": ["x/deny-all"],
    }


def test_filters_and_the_table(nodes: tuple[Node, Node]) -> None:
    a, _ = nodes
    a.deny(1_700_000_001.0, "y/a", "x/a")
    a.deny(1_700_000_002.0, "z/b", "x/b", 81)
    assert [json.loads(x)["src_pod"] for x in _show([a.source], pod="x/b")] == ["z/b"]
    assert [json.loads(x)["src_pod"] for x in _show([a.source], namespace="y")] == ["y/a"]
    assert _show([a.source], pod="b", namespace="x") == _show([a.source], pod="x/b")
    table = _show([a.source], output="table")
    assert table[0].split() == list(policy_log.HEADER)
    assert f"z/b ({tt.address('z/b')})" in table[2]
    assert "TCP/81" in table[2]
    assert table[2].endswith("x/deny-all")


def test_follow_prints_new_entries_of_every_node_as_they_come(nodes: tuple[Node, Node]) -> None:
    a, b = nodes
    a.deny(1_700_000_000.0, "y/a", "x/a")  # in the ring before: printed first
    out: list[tuple[float, str]] = []
    keep = policy_log.pod_filter(None, None)
    stop = threading.Event()

    def follow() -> None:
        policy_log.show(
            [a.source, b.source],
            follow=True,
            keep=keep,
            output="json",
            echo=lambda s: out.append((time.monotonic(), s)),
            until=stop,
        )

    thread = threading.Thread(target=follow)
    thread.start()
    try:
        deadline = time.monotonic() + 5
        while not out and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.2)  # both followers wait for more
        t0 = time.monotonic()
        b.deny(time.time(), "z/c", "x/b")
        while len(out) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        stop.set()
        thread.join(10)
    assert not thread.is_alive()
    assert [json.loads(s)["src_pod"] for _, s in out] == ["y/a", "z/c"]
    print(f"followed entry printed {out[1][0] - t0:.3f} s after it was added")


def test_errors_are_one_line(nodes: tuple[Node, Node]) -> None:
    a, _ = nodes
    free = a.source.port
    a.close()
    with pytest.raises(policy_log.LogError, match=r"no answer from tabby-node of node-1 \("):
        _show([policy_log.Source("127.0.0.1", free, "tabby-node of node-1")])
    off = serve("127.0.0.1", 0, Endpoints(list, list), "t")  # visibility off
    try:
        source = policy_log.local(off.server_address[1])
        with pytest.raises(policy_log.LogError, match="keeps no policy log"):
            _show([source])
    finally:
        off.shutdown()
        off.server_close()


# -- policy trace: the documents -----------------------------------------------------------------

REQUEST = {
    "id": "0123456789abcdef",
    "node": "node-1",
    "family": 4,
    "src": "10.244.2.11",
    "dst": "10.244.1.10",
    "protocol": "TCP",
    "sport": 40000,
    "dport": 80,
    "icmp_id": None,
    "seconds": 6.0,
}


def test_a_request_and_an_answer_round_trip() -> None:
    req = rtrace.parse(REQUEST["id"], REQUEST, "t")  # type: ignore[arg-type]
    assert isinstance(req, rtrace.TraceRequest)
    assert req.to_data() == REQUEST
    ans = rtrace.TraceAnswer(req.id, "node-1", "done", ({"direction": "ingress"},), (), 4)
    back = rtrace.parse(rtrace.answer_key(req.id, "node-1"), ans.to_data(), "t")
    assert back == ans


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"id": "0123456789ABCDEF"}, "id"),
        ({"src": "fd00::1"}, "src is not IPv4"),
        ({"dst": "10.0.0.0/8"}, "dst"),
        ({"protocol": "SCTP"}, "protocol"),
        ({"dport": None}, "both ports"),
        ({"dport": 70000}, "dport"),
        ({"protocol": "ICMP", "sport": None, "dport": None}, "icmp_id"),
        ({"seconds": 3600}, "seconds"),
        ({"seconds": True}, "seconds"),
    ],
)
def test_a_malformed_request_is_refused(change: dict[str, Any], message: str) -> None:
    data = {**REQUEST, **change}
    with pytest.raises(StoreCorrupt, match=message):
        rtrace.parse(str(data["id"]), data, "trace t")
    assert rtrace.TraceRequest.from_data(REQUEST, "t").id == REQUEST["id"]


def test_a_request_under_another_key_is_refused() -> None:
    with pytest.raises(StoreCorrupt, match="not its key"):
        rtrace.parse("fedcba9876543210", REQUEST, "t")


# -- policy trace: the plan and the comparison ---------------------------------------------------

#: x/a on node-1 only from pods labelled pod=b on TCP 80; z/c without egress
FROM_B = tt.pol(
    "a-from-b",
    tt.sel(pod="a"),
    ingress=(tt.rule(tt.peer(pods=tt.sel(pod="b"), nss=tt.sel()), ports=(tt.tcp(80),)),),
)
NO_EGRESS = tt.pol("c-no-egress", tt.sel(pod="c"), types=("Egress",), ns="z")
NODE_OF = {"x/a": "node-1", "y/b": "node-1", "z/c": "node-1"}


def _cluster() -> PolicyCluster:
    state = tt.build_state(
        tt.Step((FROM_B, NO_EGRESS), tt.everything),
        node_of=lambda pod: NODE_OF.get(pod, "node-2"),
    )
    return PolicyCluster(state, {"node-1": ("192.168.7.1",), "node-2": ("192.168.7.2",)})


def _plan(tmp_path: Path, src: str, dst: str, port: str | None) -> policy_trace.Plan:
    netns = tmp_path / "netns"
    netns.touch()
    here = {tt.default_iface(p) for p, n in NODE_OF.items()}
    return policy_trace.plan(
        _cluster(), src, dst, port, lambda addr: str(netns), lambda iface: iface in here
    )


def test_the_plan_sends_from_the_source_pod_and_asks_the_destinations_node(
    tmp_path: Path,
) -> None:
    p = _plan(tmp_path, "y/b", "x/b", "81/UDP")
    assert (p.src, p.dst, p.protocol, p.port) == (("y", "b"), ("x", "b"), "UDP", 81)
    assert (p.src_addr, p.dst_addr) == (tt.address("y/b"), tt.address("x/b"))
    assert (p.src_node, p.dst_node, p.dst_remote) == ("node-1", "node-2", True)
    assert p.netns == str(tmp_path / "netns")
    icmp = _plan(tmp_path, "y/b", "x/a", None)
    assert (icmp.protocol, icmp.port, icmp.dst_remote) == ("ICMP", None, False)
    named = _plan(tmp_path, "y/b", "x/a", "serve-80-udp/UDP")  # the truth table's names
    assert (named.protocol, named.port, named.port_name) == ("UDP", 80, "serve-80-udp")
    assert not named.prediction.allowed


@pytest.mark.parametrize(
    ("src", "dst", "port", "message"),
    [
        ("x/b", "x/a", "80", "runs on node node-2, not here: run tabbyctl policy trace on"),
        ("y/b", "10.0.0.0/8", "80", "give an address, not a network"),
        ("y/b", "x/a", "80/SCTP", "trace sends TCP, UDP or ICMP probes"),
        ("y/b", "x/nope", "80", "nope"),
    ],
)
def test_a_plan_that_cannot_be_made_says_why(
    tmp_path: Path, src: str, dst: str, port: str, message: str
) -> None:
    with pytest.raises(policy_trace.ExplainError, match=message):
        _plan(tmp_path, src, dst, port)


class Probe:
    src, dst, sport, dport, icmp_id = "10.244.2.11", "10.244.1.10", 40000, 80, None


def _decision(direction: str, verdict: str, chain: str, comment: str) -> dict[str, Any]:
    return {
        "base_chain": "fwd-" + direction,
        "direction": direction,
        "verdict": verdict,
        "chain": chain,
        "handle": 7,
        "rule": f"... {verdict}",
        "comment": comment,
        "path": [f"fwd-{direction}", chain],
    }


class Ds:
    """A ``policy.trace.Decision`` as ``compose`` reads it (``to_json``)."""

    def __init__(self, d: dict[str, Any]) -> None:
        self.d = d

    def to_json(self) -> dict[str, Any]:
        return self.d


NOT_ISOLATED = _decision("egress", "accept", "from-caliyb", "y/b-eth0: no egress policy")


def test_kernel_and_explain_agree(tmp_path: Path) -> None:
    p = _plan(tmp_path, "y/b", "x/a", "80")  # same node, allowed by a-from-b
    here = [Ds(NOT_ISOLATED), Ds(_decision("ingress", "accept", "pi-1", "x/a-from-b ingress[0]"))]
    a = policy_trace.compose(p, Probe(), "connected", here, [], None, "not asked")
    assert a["agree"], a
    assert a["kernel"]["verdict"] == "allowed"
    assert a["kernel"]["ingress"]["comment"] == "x/a-from-b ingress[0]"
    text = "\n".join(policy_trace.lines(a))
    assert "kernel: ALLOWED; explain: ALLOWED: they agree" in text
    assert "ingress of x/a on node-1: allowed in chain pi-1, rule 7" in text


def test_a_disagreement_is_said(tmp_path: Path) -> None:
    p = _plan(tmp_path, "y/b", "x/a", "80")  # explain: allowed
    denied = _decision("ingress", "drop", "to-calixa", "x/a-eth0: ingress not allowed")
    a = policy_trace.compose(p, Probe(), "no answer", [Ds(NOT_ISOLATED), Ds(denied)], [], None, "")
    assert not a["agree"]
    assert a["disagreements"] == ["ingress: the kernel denied it, explain predicts allowed"]
    assert "THEY DISAGREE" in "\n".join(policy_trace.lines(a))
    # allowed, but by another policy than explain names
    other = _decision("ingress", "accept", "pi-2", "x/other ingress[0]")
    a = policy_trace.compose(p, Probe(), "connected", [Ds(NOT_ISOLATED), Ds(other)], [], None, "")
    assert a["disagreements"] == [
        "ingress: the kernel allowed it by 'x/other ingress[0]', explain by x/a-from-b ingress[0]"
    ]


def test_the_other_nodes_answer_decides_the_ingress(tmp_path: Path) -> None:
    p = _plan(tmp_path, "y/b", "x/b", "80")  # x/b on node-2: not isolated, allowed
    remote = rtrace.TraceAnswer(
        "0123456789abcdef",
        "node-2",
        "done",
        (_decision("ingress", "accept", "to-calixb", "x/b-eth0: no ingress policy"),),
    )
    a = policy_trace.compose(p, Probe(), "connected", [Ds(NOT_ISOLATED)], [], remote, "done")
    assert a["agree"], a
    assert a["kernel"]["ingress"]["node"] == "node-2"
    # no answer from there: unknown, not a disagreement
    a = policy_trace.compose(p, Probe(), "connected", [Ds(NOT_ISOLATED)], [], None, "no answer")
    assert a["kernel"]["verdict"] == "unknown"
    assert a["kernel"]["ingress"]["why"] == "node node-2: no answer"
    assert a["agree"]
    # denied on egress here: the other node is not reached
    p = _plan(tmp_path, "z/c", "x/b", "80")
    drop = _decision("egress", "drop", "from-calizc", "z/c-eth0: egress not allowed")
    a = policy_trace.compose(p, Probe(), "no answer", [Ds(drop)], [], None, "armed")
    assert a["agree"], a
    assert (a["kernel"]["verdict"], a["kernel"]["ingress"]["verdict"]) == ("denied", "not reached")
