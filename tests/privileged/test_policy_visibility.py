"""Seeing what policy does, in the kernel (one node, the truth table's nine pods as in
tests/privileged/test_policy_nft.py): the per-policy and default-deny counters count what
the probes did, exactly; the denied packets reach an NFLOG listener once per flow, named
by direction and endpoint; a traced probe shows which chain and rule decided it, and the
trace table is gone afterwards.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator

import pytest

from dataplane import nfnetlink, nfttrace
from dataplane.netns import open_netns, run_in_netns
from policy.counters import CounterKey
from policy.render import LOG_BURST, LOG_GROUP, LOG_RATE
from policy.trace import decisions, verdict_of
from tests import policy_truth_table as tt
from tests.policy_probes import probe_many
from tests.privileged.netns_util import run_in_thread_netns
from tests.privileged.test_policy_nft import Cluster, _cluster

pytestmark = pytest.mark.privileged

FROM_B = tt.Step(tt.CASES[2].steps[0].policies, tt.CASES[2].steps[0].expect)  # x/a from x/b
ALLOW = CounterKey("x", "x-a-from-b", "ingress", "allow")
DENY = CounterKey("x", "default-deny", "ingress", "deny")


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with _cluster() as c:
        c.apply(c.state(FROM_B))
        yield c


def _probe(c: Cluster, src: str, dst: str, proto: str = "TCP", port: int = 80) -> bool:
    job = (tt.address(dst), proto, port)
    return c.probe({src: [job]})[(src, job)]


def _counts(c: Cluster) -> dict[CounterKey, int]:
    return {k: p for k, (p, _b) in c.node.run(c.dp.packet_counts).items()}


def test_counters_count_each_new_connection_once(cluster: Cluster) -> None:
    before = _counts(cluster)
    assert set(before) == {ALLOW, DENY}
    for _ in range(3):
        assert _probe(cluster, "x/b", "x/a")
    for src in ("y/a", "z/b"):
        assert not _probe(cluster, src, "x/a")
    assert not _probe(cluster, "y/a", "x/a", "UDP", 81)
    after = _counts(cluster)
    # one SYN per allowed connection (the rest of it is established); one SYN per denied
    # connection (the probe gives up before TCP retransmits); one datagram
    assert after[ALLOW] - before[ALLOW] == 3
    assert after[DENY] - before[DENY] == 3
    # a full replacement (a restart's, the 30 s resync's) loses nothing already counted
    cluster.apply(cluster.state(FROM_B), full=True)
    assert _counts(cluster)[ALLOW] == after[ALLOW]
    assert _probe(cluster, "x/b", "x/a")
    assert _counts(cluster)[ALLOW] == after[ALLOW] + 1


def test_counters_survive_the_incremental_path(cluster: Cluster) -> None:
    """Deltas (``update``, the periodic check's ``sync``, the CNI path's ``add_endpoint`` /
    ``remove_endpoint``) change chains around the counters: an edited policy's chain is
    flushed and refilled (its counter stays, counting on), a new policy brings its counter,
    a removed one is read before its counter goes, a new endpoint brings its own."""
    from dataclasses import replace

    from policy.engine import Endpoint
    from policy.incremental import Update

    c = cluster
    before = _counts(c)
    (from_b,) = FROM_B.policies
    # edited: the same chain, flushed and refilled with one more port
    wider = replace(from_b, ingress=(replace(from_b.ingress[0], ports=(tt.tcp(80), tt.tcp(81))),))
    res = c.node.run(c.dp.update, [Update("policy", "x/x-a-from-b", wider)])
    assert res.changed
    assert not res.full
    assert _counts(c) == before
    assert _probe(c, "x/b", "x/a", "TCP", 81)
    assert _counts(c)[ALLOW] == before[ALLOW] + 1
    # a second policy for x/a, through the periodic check's difference
    extra = tt.pol("a-from-c", tt.sel(pod="a"), ingress=(tt.rule(tt.peer(tt.sel(pod="c"))),))
    step = tt.Step((wider, extra), tt.everything)
    res = c.apply(c.state(step))
    assert res.changed
    assert not res.full
    assert _probe(c, "x/c", "x/a")
    extra_key = CounterKey("x", "a-from-c", "ingress", "allow")
    assert _counts(c)[extra_key] == 1
    assert _probe(c, "x/c", "x/a")
    # removed: its counter deleted (read first), its series gone; the others unchanged
    res = c.node.run(c.dp.update, [Update("policy", "x/a-from-c", None)])
    assert res.changed
    assert not res.full
    now = _counts(c)
    assert extra_key not in now
    assert now[ALLOW] == before[ALLOW] + 1
    assert not _probe(c, "x/c", "x/a")
    assert _counts(c)[DENY] == now[DENY] + 1
    # the CNI path: a new endpoint of x/a's pod (a second interface), isolated at once
    ep = Endpoint("x", "a", "node1", "calixa2", ("10.244.9.9/32",), "a-eth1")
    deny = c.node.run(c.dp.backend.run, "list table inet tabby")
    c.node.run(c.dp.add_endpoint, ep)
    listing = c.node.run(c.dp.backend.run, "list table inet tabby")
    assert "counter deny-in-calixa2" in listing
    assert "counter deny-in-calixa2" not in deny
    c.node.run(c.dp.remove_endpoint, "x", "a-eth1")
    assert "deny-in-calixa2" not in c.node.run(c.dp.backend.run, "list table inet tabby")
    assert _counts(c)[DENY] == now[DENY] + 1
    # back to the module's state (a difference again)
    c.node.run(c.dp.update, [Update("policy", "x/x-a-from-b", from_b)])
    assert _counts(c)[ALLOW] == before[ALLOW] + 1


def test_named_counters_are_read_and_zeroed_alone(cluster: Cluster) -> None:
    """What a DEL reads before its endpoint's counters go: only those (a missing one is
    no error), the others left counting; without names, every counter."""
    run = cluster.dp.backend.run
    cluster.node.run(
        run,
        "add table inet tbcount\n"
        "add counter inet tbcount a { packets 5 bytes 300 }\n"
        "add counter inet tbcount b { packets 7 bytes 420 }\n",
    )
    try:
        some = cluster.node.run(nfnetlink.reset_counters, "tbcount", ["a", "nosuch"])
        every = cluster.node.run(nfnetlink.reset_counters, "tbcount", None)
    finally:
        cluster.node.run(run, "delete table inet tbcount\n")
    assert some == [("a", 5, 300)]
    assert sorted(every) == [("a", 0, 0), ("b", 7, 420)]


class Log:
    """An NFLOG listener on the node, reading on a thread of its own."""

    def __init__(self, c: Cluster) -> None:
        self.packets: list[nfnetlink.LoggedPacket] = []
        self.stop = threading.Event()
        ready = threading.Event()

        def read() -> None:
            with nfnetlink.NflogListener(LOG_GROUP) as listener:
                ready.set()
                while not self.stop.is_set():
                    self.packets += listener.read(0.1)

        path = c.node.path
        self.thread = threading.Thread(target=run_in_thread_netns, args=(path, read))
        self.thread.start()
        assert ready.wait(5)

    def close(self) -> list[nfnetlink.LoggedPacket]:
        time.sleep(0.5)  # the kernel sends what it queued within 0.1 s
        self.stop.set()
        self.thread.join(5)
        return self.packets


def _ifindex(c: Cluster, pod: str) -> int:
    return c.node.run(socket.if_nametoindex, c.ifaces[pod])


def test_denied_flows_reach_nflog_once_per_flow(cluster: Cluster) -> None:
    log = Log(cluster)
    try:
        src = "z/c"  # not used by the other tests: no flow of it remembered yet
        for _ in range(3):
            assert not _probe(cluster, src, "x/a", "TCP", 81)  # one flow, three SYNs
        assert not _probe(cluster, src, "x/a", "UDP", 80)
        assert _probe(cluster, "x/b", "x/a", "TCP", 81)  # allowed: not logged
    finally:
        got = log.close()
    flows = [(p.packet.protocol_name, p.packet.dport) for p in got if p.packet is not None]
    assert sorted(flows) == [("TCP", 81), ("UDP", 80)]
    for p in got:
        assert p.prefix == "tabby-deny ingress"
        assert p.packet is not None
        assert (p.packet.src, p.packet.dst) == (tt.address(src), tt.address("x/a"))
        assert p.outdev == _ifindex(cluster, "x/a")  # ingress: the endpoint is the out-interface


def test_the_log_is_rate_limited_node_wide(cluster: Cluster) -> None:
    """A burst of new flows (UDP to 2,000 ports) reaches the listener at most LOG_BURST +
    LOG_RATE a second; every packet is counted all the same."""
    before = _counts(cluster)
    log = Log(cluster)
    ports = range(20000, 22000)
    t0 = time.monotonic()
    try:
        jobs = [(tt.address("x/a"), "UDP", p) for p in ports]
        run_in_thread_netns(cluster.pods["y/c"].path, lambda: probe_many(jobs, 0.05))
    finally:
        got = log.close()
    seconds = time.monotonic() - t0
    assert len(got) <= LOG_BURST + LOG_RATE * seconds + 5
    assert len(got) >= min(LOG_BURST, len(ports)) // 2
    assert _counts(cluster)[DENY] - before[DENY] == len(ports)


def _trace(c: Cluster, src: str, dst: str, proto: nfttrace.ProbeProtocol, port: int | None):  # type: ignore[no-untyped-def]
    """A probe from pod ``src`` to pod ``dst``, traced on the node: (answer, decisions,
    foreign drops, tables after)."""
    with open_netns(c.pods[src].path) as handle:
        sock = run_in_netns(
            handle.fd, lambda: nfttrace.ProbeSocket(4, tt.address(src), tt.address(dst), proto)
        )

    def on_node():  # type: ignore[no-untyped-def]
        probe = sock.probe(port)
        with nfttrace.Trace(probe) as trace:
            sock.send(port)
            answer = sock.answer(1.0)
            events = trace.collect(0.5)
        rules = nfttrace.table_rules()
        tables = c.dp.backend.run("list tables")
        return answer, *decisions(events, rules), tables

    try:
        return c.node.run(on_node)
    finally:
        sock.close()


def test_a_traced_probe_shows_the_rule_that_allowed_it(cluster: Cluster) -> None:
    answer, ds, foreign, tables = _trace(cluster, "x/b", "x/a", "TCP", 80)
    assert answer == "connected"
    assert foreign == []
    egress = verdict_of(ds, "egress")
    ingress = verdict_of(ds, "ingress")
    assert egress is not None
    assert ingress is not None
    assert egress.verdict == "accept"  # x/b is not isolated: its chain accepts
    assert egress.rule is not None
    assert egress.rule.comment == "x/b-eth0: no egress policy"
    assert ingress.verdict == "accept"
    assert ingress.rule is not None
    assert ingress.rule.comment == "x/x-a-from-b ingress[0]"
    assert ingress.path[:2] == ("fwd-ingress", f"to-{cluster.ifaces['x/a']}")
    assert ingress.chain.startswith("pi-")
    assert "tabby-trace" not in tables


@pytest.mark.parametrize(("proto", "port"), [("TCP", 81), ("UDP", 80), ("ICMP", None)])
def test_a_traced_probe_shows_the_default_deny(
    cluster: Cluster, proto: nfttrace.ProbeProtocol, port: int | None
) -> None:
    answer, ds, _foreign, tables = _trace(cluster, "y/b", "x/a", proto, port)
    assert answer == "no answer"
    ingress = verdict_of(ds, "ingress")
    assert ingress is not None
    assert ingress.verdict == "drop"
    assert ingress.chain == f"to-{cluster.ifaces['x/a']}"
    assert ingress.rule is not None
    assert ingress.rule.comment == "x/a-eth0: ingress not allowed"
    assert "log-ingress" in ingress.path
    assert "tabby-trace" not in tables


def test_a_trace_table_of_a_dead_process_is_swept(cluster: Cluster) -> None:
    backend = cluster.dp.backend
    cluster.node.run(backend.run, "add table inet tabby-trace-999999999-1\n")
    probe = nfttrace.Probe(4, "10.1.1.1", "10.1.1.2", "TCP", 1, 2)

    def arm_and_list() -> str:
        with nfttrace.Trace(probe, backend):
            return backend.run("list tables")

    listing = cluster.node.run(arm_and_list)
    assert "tabby-trace-999999999-1" not in listing
    assert "tabby-trace-" in listing  # its own, while armed
    assert "tabby-trace-" not in cluster.node.run(backend.run, "list tables")
