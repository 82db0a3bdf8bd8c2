"""Seeing what policy does, without a kernel: the counters and the denied-flow log in the
rendered nft text, the counters' bookkeeping across full replacements, and the netlink
messages NFLOG and the nftables trace send (bytes as a 6.x kernel sent them).

The kernel tier (tests/privileged/test_policy_visibility.py) runs the same through nftables.
"""

from __future__ import annotations

import json
import socket
import struct
import threading
import time
from collections.abc import Collection
from typing import Any

from dataplane import nfnetlink as nfl
from policy.counters import CounterKey, counters_of
from policy.engine import Endpoint
from policy.render import LOG_FLOW_SECONDS, LOG_GROUP, LOG_RATE, Renderer
from policy.state import PolicyDataplane
from policy.trace import Foreign, decisions, verdict_of
from tabby_node import policylog
from tests import policy_truth_table as tt


class Recorder:
    """A backend that records transactions, and a counter reader that answers with what
    the test put in ``counts`` (then zeroes them, as the kernel does)."""

    name = "recorder"

    def __init__(self) -> None:
        self.sent: list[str] = []
        self.counts: dict[str, tuple[int, int]] = {}
        #: what each read asked for: None (every counter) or the names
        self.resets: list[list[str] | None] = []

    def run(self, text: str) -> str:
        self.sent.append(text)
        return ""

    def reset_counters(
        self, table: str, names: Collection[str] | None
    ) -> list[tuple[str, int, int]]:
        assert table == "tabby"
        chosen = (
            dict(self.counts)
            if names is None
            else {n: self.counts[n] for n in names if n in self.counts}
        )
        out = [(n, p, b) for n, (p, b) in chosen.items()]
        self.counts.update(dict.fromkeys(chosen, (0, 0)))
        self.resets.append(None if names is None else sorted(names))
        return out


def _dp(visibility: bool = True) -> tuple[PolicyDataplane, Recorder]:
    rec = Recorder()
    dp = PolicyDataplane(
        "node1",
        backend=rec,
        families=(4,),
        visibility=visibility,
        counter_reader=rec.reset_counters,
    )
    return dp, rec


# -- the rendered table ---------------------------------------------------------------------------


def test_every_accept_counts_into_its_policy_and_every_deny_into_default_deny() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.CASES[2].steps[0]))  # 3: x/a only from x/b
    text = rec.sent[0]
    counters = counters_of(dp.desired())
    # shown: the policy, and the default deny where a pod is isolated (x/a's ingress)
    assert sorted(dp.packet_counts()) == [
        CounterKey("x", "default-deny", "ingress", "deny"),
        CounterKey("x", "x-a-from-b", "ingress", "allow"),
    ]
    # made: the policy's, and two per local endpoint (isolated or not)
    local = {e.interface for e in dp.desired().endpoints.values()}
    assert set(counters) == {f"deny-{d}-{i}" for i in local for d in ("in", "eg")} | {
        n for n, k in counters.items() if k.verdict == "allow"
    }
    for name in counters:
        assert f"add counter inet tabby {name} {{ comment " in text
    allow = next(n for n, k in counters.items() if k.verdict == "allow")
    deny = "deny-in-calixa"
    accepts = [line for line in text.splitlines() if " pi-" in line and "accept" in line]
    assert accepts
    assert all(f'counter name "{allow}" accept' in line for line in accepts)
    to_xa = [line for line in text.splitlines() if line.startswith("add rule inet tabby to-calixa")]
    assert to_xa[-2] == f'add rule inet tabby to-calixa counter name "{deny}" jump log-ingress'
    assert to_xa[-1].endswith('drop comment "x/a-eth0: ingress not allowed"')
    # counters and the log chains exist before the rules that use them
    assert text.index(f"add counter inet tabby {allow}") < text.index(f'name "{allow}"')
    assert text.index("add chain inet tabby log-ingress") < text.index("jump log-ingress")
    # not isolated: a plain accept, nothing counted
    assert "add rule inet tabby to-calixb accept comment" in text


def test_the_log_is_rate_limited_and_once_per_flow() -> None:
    lines = Renderer().log_objects()
    text = "\n".join(lines)
    assert f"add limit inet tabby log-denied {{ rate {LOG_RATE}/second" in text
    for fam in (4, 6):
        assert f"add set inet tabby flows-p{fam} {{ type " in text
        assert f"timeout {LOG_FLOW_SECONDS}s" in text
    ingress = [x for x in lines if x.startswith("add rule inet tabby log-ingress")]
    # a logged flow returns before the limit is consulted; the rest is logged within it
    returns = [i for i, x in enumerate(ingress) if x.endswith("return")]
    logs = [i for i, x in enumerate(ingress) if " log prefix " in x]
    assert (len(returns), len(logs)) == (4, 4)
    assert max(returns) < min(logs)
    assert all('limit name "log-denied" add @flows-' in ingress[i] for i in logs)
    assert all(f"group {LOG_GROUP}" in ingress[i] for i in logs)
    assert all('"tabby-deny ingress"' in ingress[i] for i in logs)
    assert not any(" drop" in x for x in lines)  # the endpoint chain drops, not the log


def test_without_visibility_the_table_is_as_before() -> None:
    dp, rec = _dp(visibility=False)
    dp.sync(tt.build_state(tt.CASES[2].steps[0]))
    text = rec.sent[0]
    assert "counter" not in text
    assert "log" not in text
    assert "flows-" not in text
    assert dp.packet_counts() == {}


def test_differences_add_counters_first_and_delete_them_last() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.Step((), tt.everything)))
    dp.sync(tt.build_state(tt.CASES[2].steps[0]))
    text = rec.sent[-1]
    assert text.index("add counter inet tabby pkt-pi-") < text.index('counter name "pkt-pi-')
    assert "add counter inet tabby deny-in-" not in text  # an endpoint's are made with it
    dp.sync(tt.build_state(tt.Step((), tt.everything)))
    lines = rec.sent[-1].splitlines()
    deletes = [i for i, x in enumerate(lines) if x.startswith("delete counter")]
    chains = [i for i, x in enumerate(lines) if x.startswith(("flush chain", "delete chain"))]
    assert len(deletes) == 1  # the policy's; x/a's deny counters stay with x/a
    assert min(deletes) > max(chains)


# -- the counters' bookkeeping --------------------------------------------------------------------


def _names(dp: PolicyDataplane) -> dict[str, str]:
    """x/a's counters: its policy's (allow) and its ingress default deny (deny)."""
    allow = [n for n, k in counters_of(dp.desired()).items() if k.verdict == "allow"]
    assert len(allow) == 1
    return {"allow": allow[0], "deny": "deny-in-calixa"}


def test_counts_add_up_across_reads_and_full_replacements() -> None:
    dp, rec = _dp()
    st = tt.build_state(tt.CASES[2].steps[0])
    dp.sync(st)
    names = _names(dp)
    rec.counts = {names["allow"]: (3, 180), names["deny"]: (5, 300), "stranger": (9, 9)}
    got = dp.packet_counts()
    allow = CounterKey("x", "x-a-from-b", "ingress", "allow")
    deny = CounterKey("x", "default-deny", "ingress", "deny")
    assert got == {allow: (3, 180), deny: (5, 300)}  # a counter it did not make: ignored
    rec.counts[names["allow"]] = (2, 120)
    dp.sync(st, full=True)  # read before the table (and its counters) is replaced
    rec.counts[names["allow"]] = (1, 60)
    assert dp.packet_counts()[allow] == (6, 360)


def test_a_removed_policy_is_read_before_its_counter_goes_then_forgotten() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.CASES[2].steps[0]))
    names = _names(dp)
    rec.counts = {names["allow"]: (4, 240)}
    # the policy stays but selects no local pod any more: its chain and counter go, the
    # count is read first and kept
    moved = tt.build_state(tt.CASES[2].steps[0])
    moved = moved.without_endpoint("x", "a-eth0")
    dp.sync(moved)
    allow = CounterKey("x", "x-a-from-b", "ingress", "allow")
    assert dp.packet_counts()[allow] == (4, 240)
    # the policy deleted: its series ends
    dp.sync(tt.build_state(tt.Step((), tt.everything)))
    assert dp.packet_counts() == {}


def test_a_new_local_endpoint_in_a_new_namespace_gets_its_deny_counter() -> None:
    dp, rec = _dp()
    dp.sync(tt.build_state(tt.Step((tt.DENY_INGRESS,), tt.everything)))
    ep = Endpoint("x", "new", "node1", "calinew", ("10.244.1.201",), "new-eth0")
    dp.add_endpoint(ep)
    text = rec.sent[-1]
    # its own two counters, made before its chains use them
    assert text.index("add counter inet tabby deny-in-calinew ") < text.index(
        'counter name "deny-in-calinew" jump log-ingress'
    )
    assert "add counter inet tabby deny-eg-calinew " in text
    names = _names(dp)
    rec.counts = {"deny-in-calinew": (2, 120), names["deny"]: (7, 420)}
    dp.remove_endpoint("x", "new-eth0")
    assert "delete counter inet tabby deny-in-calinew" in rec.sent[-1]
    # only the counters that go are read first (not the table's every counter: two per
    # pod, on every pod's DEL); the others keep counting in the kernel until read
    assert rec.resets == [["deny-eg-calinew", "deny-in-calinew"]]
    assert rec.counts[names["deny"]] == (7, 420)
    deny = CounterKey("x", "default-deny", "ingress", "deny")
    assert dp.packet_counts()[deny] == (9, 540)
    assert rec.resets[-1] is None


# -- netlink: NFLOG and the trace ---------------------------------------------------------------


def _nlmsg(subsys: int, mtype: int, family: int, res_id: int, attrs: bytes) -> bytes:
    body = struct.pack("=BBH", family, 0, socket.htons(res_id)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (subsys << 8) | mtype, 0, 0, 0) + body


def _attr(kind: int, value: bytes) -> bytes:
    length = 4 + len(value)
    return struct.pack("=HH", length, kind) + value + b"\0" * ((4 - length % 4) % 4)


#: A UDP datagram 127.0.0.1:48356 -> 127.0.0.2:7, as NFLOG copied it (Linux 6.18).
UDP_PACKET = bytes.fromhex("4500001d09144000401133b97f0000017f000002bce400070009fe1d78")


def test_an_nflog_message_is_read() -> None:
    msg = _nlmsg(
        nfl.NFNL_SUBSYS_ULOG,
        nfl.NFULNL_MSG_PACKET,
        socket.AF_INET,
        116,
        _attr(nfl.NFULA_PACKET_HDR, b"\x08\x00\x03\x00")
        + _attr(nfl.NFULA_PREFIX, b"tabby-deny ingress\0")
        + _attr(nfl.NFULA_IFINDEX_OUTDEV, struct.pack(">I", 7))
        + _attr(nfl.NFULA_PAYLOAD, UDP_PACKET),
    )
    (m,) = list(nfl.split_messages(msg))
    assert isinstance(m, nfl.Message)
    assert (m.subsystem, m.type, m.res_id) == (nfl.NFNL_SUBSYS_ULOG, 0, 116)
    assert m.attrs[nfl.NFULA_PREFIX] == b"tabby-deny ingress\0"
    p = nfl.parse_packet(m.attrs[nfl.NFULA_PAYLOAD])
    assert p == nfl.Packet(4, "127.0.0.1", "127.0.0.2", 17, 48356, 7)
    assert p.protocol_name == "UDP"


def test_an_ack_is_its_errno() -> None:
    ack = struct.pack("=IHHII", 36, nfl.NLMSG_ERROR, 0, 1, 0) + struct.pack("=i", -16) + b"\0" * 16
    assert list(nfl.split_messages(ack)) == [16]


def test_trace_events_are_read() -> None:
    # as Linux 6.18 sent them for `ping 127.0.0.3` with `meta nftrace set 1` in chain out
    rule = _nlmsg(
        nfl.NFNL_SUBSYS_NFTABLES,
        nfl.NFT_MSG_TRACE,
        socket.AF_INET,
        0,
        _attr(nfl.NFTA_TRACE_NFPROTO, b"\x00\x00\x00\x02")
        + _attr(nfl.NFTA_TRACE_TYPE, b"\x00\x00\x00\x03")
        + _attr(nfl.NFTA_TRACE_ID, b"<\x9d>\x15")
        + _attr(nfl.NFTA_TRACE_CHAIN, b"out\0")
        + _attr(nfl.NFTA_TRACE_TABLE, b"t\0")
        + _attr(nfl.NFTA_TRACE_RULE_HANDLE, b"\x00\x00\x00\x00\x00\x00\x00\x11")
        + _attr(nfl.NFTA_TRACE_VERDICT | 0x8000, b"\x08\x00\x01\x00\xff\xff\xff\xff")
        + _attr(nfl.NFTA_TRACE_OIF, b"\x00\x00\x00\x01")
        + _attr(
            nfl.NFTA_TRACE_NETWORK_HEADER, bytes.fromhex("45000054673c40004001d5687f0000017f000003")
        )
        + _attr(nfl.NFTA_TRACE_TRANSPORT_HEADER, bytes.fromhex("0800e190462e0001")),
    )
    policy = _nlmsg(
        nfl.NFNL_SUBSYS_NFTABLES,
        nfl.NFT_MSG_TRACE,
        socket.AF_INET,
        0,
        _attr(nfl.NFTA_TRACE_NFPROTO, b"\x00\x00\x00\x02")
        + _attr(nfl.NFTA_TRACE_TYPE, b"\x00\x00\x00\x01")
        + _attr(nfl.NFTA_TRACE_ID, b"<\x9d>\x15")
        + _attr(nfl.NFTA_TRACE_CHAIN, b"out\0")
        + _attr(nfl.NFTA_TRACE_TABLE, b"t\0")
        + _attr(nfl.NFTA_TRACE_POLICY, b"\x00\x00\x00\x01"),
    )
    drop = _nlmsg(
        nfl.NFNL_SUBSYS_NFTABLES,
        nfl.NFT_MSG_TRACE,
        socket.AF_INET,
        0,
        _attr(nfl.NFTA_TRACE_TYPE, b"\x00\x00\x00\x03")
        + _attr(nfl.NFTA_TRACE_CHAIN, b"to-calixa\0")
        + _attr(nfl.NFTA_TRACE_TABLE, b"tabby\0")
        + _attr(nfl.NFTA_TRACE_RULE_HANDLE, struct.pack(">Q", 42))
        + _attr(
            nfl.NFTA_TRACE_VERDICT | 0x8000, _attr(1, struct.pack(">i", -3)) + _attr(2, b"pi-1\0")
        ),
    )
    events = [nfl.trace_event(m) for m in nfl.split_messages(rule + policy + drop)]  # type: ignore[arg-type]
    assert None not in events
    first, end, jump = (e for e in events if e is not None)
    assert (first.table, first.chain, first.type, first.handle, first.verdict) == (
        "t",
        "out",
        "rule",
        17,
        "continue",
    )
    assert (first.family, first.oif, first.id) == (4, 1, 0x3C9D3E15)
    assert first.packet == nfl.Packet(4, "127.0.0.1", "127.0.0.3", 1, icmp_type=8, icmp_id=0x462E)
    assert (end.type, end.verdict, end.handle, end.packet) == ("policy", "accept", None, None)
    assert (jump.verdict, jump.target, jump.handle) == ("jump", "pi-1", 42)


def test_ipv6_headers_with_extension_headers() -> None:
    src, dst = (
        socket.inet_pton(socket.AF_INET6, "fd00::1"),
        socket.inet_pton(socket.AF_INET6, "fd00::2"),
    )
    hop = bytes([6, 0]) + b"\0" * 6  # hop-by-hop options, next: TCP
    tcp = struct.pack("!HH", 40000, 443) + b"\0" * 16
    head = struct.pack("!IHBB", 6 << 28, len(hop) + len(tcp), 0, 64) + src + dst
    p = nfl.parse_packet(head + hop + tcp)
    assert p == nfl.Packet(6, "fd00::1", "fd00::2", 6, 40000, 443)
    frag = bytes([17, 0]) + struct.pack("!H", 8 << 3) + b"\0" * 4  # a later fragment
    head = struct.pack("!IHBB", 6 << 28, 8, 44, 64) + src + dst
    assert nfl.parse_packet(head + frag) == nfl.Packet(6, "fd00::1", "fd00::2", 17)
    assert nfl.parse_packet(b"") is None
    assert nfl.parse_packet(b"\x45\x00") is None


# -- tabby-node: the ring, its HTTP route, the metrics -----------------------------------------


def _logged(prefix: str, packet: nfl.Packet | None, indev: int = 0, outdev: int = 0) -> Any:
    return nfl.LoggedPacket(prefix, indev, outdev, packet, 1_700_000_000.25)


def test_a_denied_packet_becomes_a_flow_with_both_pods_named() -> None:
    dp, _ = _dp()
    dp.sync(tt.build_state(tt.CASES[2].steps[0]))  # x/a only from x/b
    flows = policylog.DeniedFlows("node1", capacity=3)
    namer = policylog.Namer(dp)
    namer.policies = lambda ifindex, direction: dp.isolating("calixa", direction)  # type: ignore[method-assign]
    udp = nfl.Packet(4, tt.address("y/b"), tt.address("x/a"), 17, 40000, 81)
    flow = policylog.record(flows, namer, _logged("tabby-deny ingress", udp, outdev=9))
    assert flow is not None
    assert flow.to_json() == {
        "seq": 1,
        "time": "2023-11-14T22:13:20.250Z",
        "node": "node1",
        "src": "10.244.2.11",
        "dst": "10.244.1.10",
        "src_pod": "y/b",
        "dst_pod": "x/a",
        "protocol": "UDP",
        "dport": 81,
        "direction": "ingress",
        "verdict": "deny",
        "policies": ["x/x-a-from-b"],
    }
    outside = nfl.Packet(4, "192.0.2.1", tt.address("x/a"), 1, icmp_type=8, icmp_id=1)
    flow = policylog.record(flows, namer, _logged("tabby-deny egress", outside))
    assert flow is not None
    assert (flow.src_pod, flow.dst_pod, flow.protocol, flow.dport) == (None, "x/a", "ICMP", None)
    # not ours, or unreadable: ignored
    assert policylog.record(flows, namer, _logged("other", udp)) is None
    assert policylog.record(flows, namer, _logged("tabby-deny ingress", None)) is None
    assert policylog.record(flows, namer, _logged("tabby-deny sideways", udp)) is None


def test_the_ring_keeps_the_newest_and_readers_wait_for_more() -> None:
    flows = policylog.DeniedFlows("n", capacity=3)
    for i in range(5):
        flows.add(
            time=float(i),
            src="a",
            dst="b",
            src_pod=None,
            dst_pod=None,
            protocol="TCP",
            dport=i,
            direction="ingress",
            policies=(),
        )
    assert len(flows) == 3
    got = flows.since(0)
    assert [e["dport"] for e in got["entries"]] == [2, 3, 4]  # oldest first
    assert (got["first"], got["next"], got["capacity"]) == (3, 5, 3)
    assert flows.since(5)["entries"] == []
    waited: list[dict[str, Any]] = []
    reader = threading.Thread(target=lambda: waited.append(flows.since(5, wait=5)))
    reader.start()
    time.sleep(0.1)
    flows.add(
        time=9.0,
        src="a",
        dst="b",
        src_pod=None,
        dst_pod=None,
        protocol="UDP",
        dport=9,
        direction="egress",
        policies=("x/p",),
    )
    reader.join(5)
    assert [e["dport"] for e in waited[0]["entries"]] == [9]
    t0 = time.monotonic()
    assert flows.since(6, wait=0.2)["entries"] == []
    assert 0.15 < time.monotonic() - t0 < 2


def test_the_route_answers_json_and_refuses_nonsense() -> None:
    flows = policylog.DeniedFlows("n")
    route = policylog.http_route(flows)
    code, ctype, body = route({"since": "0"})
    assert (code, ctype) == (200, "application/json")
    assert json.loads(body) == {
        "node": "n",
        "capacity": 1000,
        "first": 1,
        "next": 0,
        "overruns": 0,
        "entries": [],
    }
    assert route({"since": "x"})[0] == 400


def test_the_counters_are_exported_per_policy_direction_and_verdict() -> None:
    from tabby_node.cache import Cache
    from tabby_node.metrics import Metrics, NodeCollector

    dp, rec = _dp()
    dp.sync(tt.build_state(tt.CASES[2].steps[0]))
    names = _names(dp)
    rec.counts = {names["allow"]: (3, 180), names["deny"]: (7, 420)}
    m = Metrics()

    class NoCalls:
        inflight: set[object] = set()

    m.registry.register(
        NodeCollector(
            node="node1",
            backend="bird",
            started=m.started,
            problems={},
            calls=NoCalls(),  # type: ignore[arg-type]
            cache=Cache("node1"),
            policy=dp,
            denied_flows=policylog.DeniedFlows("node1"),
        )
    )
    value = m.registry.get_sample_value
    labels = {"namespace": "x", "direction": "ingress", "tier": "", "rule": "", "staged": "false"}
    assert (
        value("tabby_policy_packets_total", {**labels, "policy": "x-a-from-b", "verdict": "allow"})
        == 3
    )
    assert (
        value("tabby_policy_packets_total", {**labels, "policy": "default-deny", "verdict": "deny"})
        == 7
    )
    rec.counts[names["deny"]] = (1, 60)
    assert (
        value("tabby_policy_packets_total", {**labels, "policy": "default-deny", "verdict": "deny"})
        == 8
    )
    assert value("tabby_policy_denied_flows_total", {}) == 0


# -- the trace: what the events say ---------------------------------------------------------------

LISTING = """table inet tabby { # handle 7
	chain fwd-ingress { # handle 3
		type filter hook forward priority filter + 1; policy accept;
		oifname != "cali*" return # handle 10
		ct state established,related accept # handle 11
		oifname vmap @wl-to # handle 13
	}

	chain to-calixa { # handle 20
		jump pi-1 # handle 21
		counter name "deny-in-1" jump log-ingress # handle 22
		drop comment "x/a-eth0: ingress not allowed" # handle 23
	}

	chain pi-1 { # handle 30
		ip saddr @a4-1 counter name "pkt-pi-1" accept comment "x/p ingress[0]" # handle 31
	}
}
"""


def _ev(chain: str, verdict: str, handle: int | None = None, **kw: Any) -> nfl.TraceEvent:
    fields: dict[str, Any] = {
        "id": 1,
        "family": 4,
        "table": "tabby",
        "chain": chain,
        "type": "rule",
        "handle": handle,
        "verdict": verdict,
        "target": None,
        "iif": 0,
        "oif": 0,
        "packet": None,
    }
    fields.update(kw)
    return nfl.TraceEvent(**fields)


def test_rules_are_found_by_chain_and_handle() -> None:
    from dataplane import nfttrace

    rules = nfttrace.parse_rules(LISTING)
    assert rules[("to-calixa", 23)].text == 'drop comment "x/a-eth0: ingress not allowed"'
    assert rules[("to-calixa", 23)].comment == "x/a-eth0: ingress not allowed"
    assert rules[("fwd-ingress", 13)].comment == ""
    assert ("fwd-ingress", 3) not in rules  # the chain's own handle
    assert len(rules) == 7


def test_the_decision_of_each_pass_through_a_base_chain() -> None:
    from dataplane import nfttrace

    rules = nfttrace.parse_rules(LISTING)
    allowed = [
        _ev("pre", "continue", 2, table="tabby-trace-1-1"),
        _ev("fwd-egress", "return", 9),  # not from a pod on this node
        _ev("fwd-egress", "accept", type="policy"),
        _ev("fwd-ingress", "jump", 13, target="to-calixa"),
        _ev("to-calixa", "jump", 21, target="pi-1"),
        _ev("pi-1", "accept", 31),
    ]
    ds, foreign = decisions(allowed, rules)
    assert foreign == []
    assert [(d.base, d.verdict) for d in ds] == [("fwd-egress", "none"), ("fwd-ingress", "accept")]
    ingress = verdict_of(ds, "ingress")
    assert ingress is not None
    assert ingress.rule is not None
    assert ingress.rule.comment == "x/p ingress[0]"
    assert ingress.path == ("fwd-ingress", "to-calixa", "pi-1")
    egress = verdict_of(ds, "egress")
    assert egress is not None
    assert not egress.decided
    denied = [
        _ev("fwd-ingress", "jump", 13, target="to-calixa"),
        _ev("to-calixa", "jump", 21, target="pi-1"),
        _ev("pi-1", "continue", type="return"),
        _ev("to-calixa", "jump", 22, target="log-ingress"),
        _ev("log-ingress", "continue", type="return"),
        _ev("to-calixa", "drop", 23),
        _ev("output", "drop", 5, table="bystander"),
    ]
    ds, foreign = decisions(denied, rules)
    (d,) = ds
    assert (d.verdict, d.chain, d.path) == (
        "drop",
        "to-calixa",
        ("fwd-ingress", "to-calixa", "pi-1", "log-ingress"),
    )
    assert d.to_json()["comment"] == "x/a-eth0: ingress not allowed"
    assert foreign == [Foreign("bystander", "output", 5)]


def test_a_probe_matches_only_its_first_packet() -> None:
    from dataplane import nfttrace

    tcp = nfttrace.Probe(4, "10.0.0.1", "10.0.0.2", "TCP", 40000, 80)
    assert tcp.nft_match() == (
        "ip saddr 10.0.0.1 ip daddr 10.0.0.2 tcp sport 40000 tcp dport 80"
        " tcp flags & (syn | ack) == syn"
    )
    assert tcp.matches(nfl.Packet(4, "10.0.0.1", "10.0.0.2", 6, 40000, 80))
    assert not tcp.matches(nfl.Packet(4, "10.0.0.1", "10.0.0.2", 6, 40001, 80))
    assert not tcp.matches(nfl.Packet(4, "10.0.0.2", "10.0.0.1", 6, 80, 40000))
    echo = nfttrace.Probe(6, "fd00::1", "fd00::2", "ICMP", icmp_id=7)
    assert echo.nft_match() == (
        "ip6 saddr fd00::1 ip6 daddr fd00::2 icmpv6 type echo-request icmpv6 id 7"
    )
    assert echo.matches(nfl.Packet(6, "fd00::1", "fd00::2", 58, icmp_type=128, icmp_id=7))
    assert not echo.matches(nfl.Packet(6, "fd00::1", "fd00::2", 58, icmp_type=129, icmp_id=7))
