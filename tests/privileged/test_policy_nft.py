"""NetworkPolicy in the kernel: the truth table probed through real nftables, single node.

One "node" namespace and nine pod namespaces (x/a .. z/c) built by the project's dataplane
(``cali*`` host veths, /32 routes, proxy ARP), each pod running a small Python server on TCP
and UDP 80 and 81 (started by PID, stopped by PID). For each case of a representative
subset of the e2e truth table: apply through :class:`PolicyDataplane` (in the node
namespace), probe the whole matrix (9 x 8 pods x TCP/UDP x 80/81, all probes of a pod in
parallel, short timeouts; an expected-allowed probe that failed is retried once with a long
timeout so a slow machine cannot fake a denial), compare with the engine's decision and the
table's expectation, remove. Then: unknown interfaces, replies, host -> pod, idempotent
re-sync, and a restart-style full replacement under default deny probed continuously.
"""

from __future__ import annotations

import contextlib
import dataclasses
import ipaddress
import json
import os
import subprocess
import threading
import time
from collections.abc import Iterator

import pytest

import dataplane
from dataplane import nft
from policy import engine
from policy.engine import ClusterState, Endpoint, NatConfig
from policy.state import ApplyResult, PolicyDataplane
from tests import policy_truth_table as tt
from tests.policy_probes import Job, probe_many, start_server, stop_process
from tests.privileged.netns_util import Netns, NetnsPool, Node, netns_pool, run_in_thread_netns

pytestmark = pytest.mark.privileged

KERNEL_CASES = {1, 2, 9, 10, 13, 14, 17, 19, 21, 22, 25, 27, 28, 30, 35, 36, 38, 40, "d1", "d3"}
PROBE_PROTOCOLS = ("TCP", "UDP")


@dataclasses.dataclass
class Cluster:
    node: Node
    pods: dict[str, Netns]
    ifaces: dict[str, str]
    dp: PolicyDataplane
    servers: list[subprocess.Popen[str]]

    def state(self, step: tt.Step) -> ClusterState:
        return tt.build_state(step, iface=self.ifaces.__getitem__)

    def apply(self, state: ClusterState, *, full: bool = False) -> ApplyResult:
        return self.node.run(self.dp.sync, state, None, full=full)

    def probe(
        self, jobs: dict[str, list[Job]], timeout: float = 0.4
    ) -> dict[tuple[str, Job], bool]:
        """Jobs per source pod, every pod in parallel."""
        out: dict[tuple[str, Job], bool] = {}
        errors: list[BaseException] = []

        def one(src: str) -> None:
            try:
                res = run_in_thread_netns(
                    self.pods[src].path, lambda: probe_many(jobs[src], timeout)
                )
                out.update({(src, j): ok for j, ok in res.items()})
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=one, args=(s,)) for s in jobs if jobs[s]]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        if errors:
            raise errors[0]
        return out

    def matrix(self, expected: dict[tuple[str, str, str, int], bool]) -> list[str]:
        """Probe every (src, dst, proto, port) of ``expected``; return the mismatches."""
        keys = list(expected)
        jobs: dict[str, list[Job]] = {s: [] for s in tt.PODS}
        for s, d, pr, po in keys:
            jobs[s].append((tt.address(d), pr, po))
        got = self.probe(jobs)
        retry: dict[str, list[Job]] = {s: [] for s in tt.PODS}
        for s, d, pr, po in keys:
            job = (tt.address(d), pr, po)
            if expected[(s, d, pr, po)] and not got[(s, job)]:
                retry[s].append(job)
        if any(retry.values()):
            got.update(self.probe(retry, timeout=3.0))
        return [
            f"{s} -> {d} {pr}/{po}: expected {'allow' if expected[(s, d, pr, po)] else 'deny'}"
            for s, d, pr, po in keys
            if got[(s, (tt.address(d), pr, po))] != expected[(s, d, pr, po)]
        ]


@contextlib.contextmanager
def _cluster() -> Iterator[Cluster]:
    servers: list[subprocess.Popen[str]] = []
    with netns_pool() as pool:
        try:
            node = pool.node()
            pods: dict[str, Netns] = {}
            ifaces: dict[str, str] = {}
            for name in tt.PODS:
                pod = pool.pod()
                host = dataplane.host_veth_name("cali", "k8s-pod-network", pod.name, "eth0")
                spec = dataplane.SetupSpec(
                    netns_path=pod.path,
                    ifname="eth0",
                    host_ifname=host,
                    addresses=[ipaddress.IPv4Address(tt.address(name))],
                )
                node.run(dataplane.setup, spec)
                pods[name], ifaces[name] = pod, host
                servers.append(start_server(pod.name))
            dp = PolicyDataplane("node1", families=(4,))
            yield Cluster(node, pods, ifaces, dp, servers)
        finally:
            for proc in servers:
                stop_process(proc)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    with _cluster() as c:
        yield c


def _kernel_matrix(step: tt.Step) -> dict[tuple[str, str, str, int], bool]:
    return {k: v for k, v in tt.matrix(step.expect).items() if k[2] in PROBE_PROTOCOLS}


def _listing(c: Cluster) -> str:
    """The table as nft lists it (text)."""
    return c.node.run(c.dp.ruleset)


def _canonical(c: Cluster) -> dict[str, object]:
    """The table's content independent of creation order: sets and maps (elements sorted),
    chains with their rules in order, no handles. What traffic changes is left out: the
    counters' values and the flows the denied-flow log remembers (dynamic sets)."""
    raw = json.loads(c.node.exec("nft", "-j", "list", "table", "inet", "tabby").stdout)
    objects: dict[str, object] = {}
    rules: dict[str, list[object]] = {}
    for obj in raw["nftables"]:
        ((kind, body),) = obj.items()
        if kind == "metainfo":
            continue
        body.pop("handle", None)
        if kind == "counter":
            body.pop("packets", None)
            body.pop("bytes", None)
        if kind == "set" and "timeout" in body.get("flags", ()):
            body.pop("elem", None)
        if kind == "rule":
            rules.setdefault(body["chain"], []).append(body)
            continue
        if "elem" in body:
            body["elem"] = sorted(body["elem"], key=json.dumps)
        objects[f"{kind} {body.get('name', '')}"] = body
    objects["rules"] = rules
    return objects


@pytest.mark.parametrize(
    "case", [c for c in tt.CASES if c.number in KERNEL_CASES], ids=lambda c: c.id
)
def test_e2e_netpol_in_the_kernel(cluster: Cluster, case: tt.Case) -> None:
    try:
        for i, step in enumerate(case.steps):
            state = cluster.state(step)
            cluster.apply(state)
            want = _kernel_matrix(step)
            for (s, d, pr, po), ok in want.items():  # the engine agrees with the table
                src, dst = s.split("/"), d.split("/")
                assert engine.allowed(state, (src[0], src[1]), (dst[0], dst[1]), pr, po) == ok
            bad = cluster.matrix(want)
            assert not bad, f"step {i}: {len(bad)} mismatches:\n" + "\n".join(bad[:30])
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_policy_removed_everything_flows_again(cluster: Cluster) -> None:
    cluster.apply(cluster.state(tt.Step((tt.DENY_ALL,), tt.everything)))
    cluster.apply(cluster.state(tt.Step((), tt.everything)))
    assert not cluster.matrix(_kernel_matrix(tt.Step((), tt.everything)))
    c = cluster.dp.counters
    assert c.endpoints == 9
    assert c.policies == 0
    assert c.applies >= 2
    assert c.last_apply_seconds > 0


def test_unknown_cali_interface_is_dropped(cluster: Cluster) -> None:
    """A pod whose veth exists but whose rules do not: nothing reaches it or leaves it."""
    pool = NetnsPool()
    try:
        stray = pool.pod()
        host = dataplane.host_veth_name("cali", "k8s-pod-network", stray.name, "eth0")
        spec = dataplane.SetupSpec(
            netns_path=stray.path,
            ifname="eth0",
            host_ifname=host,
            addresses=[ipaddress.IPv4Address("10.244.9.9")],
        )
        cluster.node.run(dataplane.setup, spec)
        server = start_server(stray.name)
        try:
            cluster.apply(cluster.state(tt.Step((), tt.everything)))
            got = cluster.probe({"x/a": [("10.244.9.9", "TCP", 80), ("10.244.9.9", "UDP", 81)]})
            assert not any(got.values()), got
            back = run_in_thread_netns(
                stray.path, lambda: probe_many([(tt.address("x/a"), "TCP", 80)], 0.4)
            )
            assert not any(back.values())
            # once the endpoint is added (the ADD path), it is reachable
            ep = Endpoint("x", "stray", "node1", host, ("10.244.9.9",), "stray-eth0")
            res = cluster.node.run(cluster.dp.add_endpoint, ep, None)
            assert res.changed
            assert not res.full
            got = cluster.probe({"x/a": [("10.244.9.9", "TCP", 80)]}, timeout=3.0)
            assert all(got.values())
            res = cluster.node.run(cluster.dp.remove_endpoint, "x", "stray-eth0")
            assert not res.full
            got = cluster.probe({"x/a": [("10.244.9.9", "TCP", 80)]})
            assert not any(got.values())
        finally:
            stop_process(server)
    finally:
        pool.close()
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_replies_of_allowed_connections_pass(cluster: Cluster) -> None:
    """x/b may send nothing (egress []), yet answers x/a's connections (conntrack)."""
    deny_b_out = tt.pol("b-no-egress", tt.sel(pod="b"), types=("Egress",))
    cluster.apply(cluster.state(tt.Step((deny_b_out,), tt.everything)))
    try:
        xb = tt.address("x/b")
        got = cluster.probe(
            {"x/a": [(xb, "TCP", 80), (xb, "UDP", 81)], "x/b": [(tt.address("x/a"), "TCP", 80)]}
        )
        assert got[("x/a", (xb, "TCP", 80))]
        assert got[("x/a", (xb, "UDP", 81))]
        assert not got[("x/b", (tt.address("x/a"), "TCP", 80))]
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_host_reaches_pods_under_default_deny_and_pods_reach_host_by_egress(
    cluster: Cluster,
) -> None:
    cluster.apply(cluster.state(tt.Step((tt.DENY_ALL,), tt.everything)))
    try:
        got = cluster.node.run(probe_many, [(tt.address(p), "TCP", 80) for p in tt.PODS], 3.0)
        assert all(got.values()), got
        # a pod's traffic to its node passes its egress policy: x/* egress denied, y/* not
        with _node_server(cluster.node):
            got2 = cluster.probe(
                {"x/a": [("10.99.0.1", "TCP", 80)], "y/a": [("10.99.0.1", "TCP", 80)]},
                timeout=1.0,
            )
        assert not got2[("x/a", ("10.99.0.1", "TCP", 80))]
        assert got2[("y/a", ("10.99.0.1", "TCP", 80))]
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


@contextlib.contextmanager
def _node_server(node: Node) -> Iterator[None]:
    proc = start_server(node.name)
    try:
        yield
    finally:
        stop_process(proc)


def test_resync_with_identical_state_changes_nothing(cluster: Cluster) -> None:
    st = cluster.state(tt.CASES[13].steps[0])  # 14: ports
    cluster.apply(st)
    try:
        before = _canonical(cluster)
        res = cluster.apply(st)
        assert not res.changed
        assert res.commands == 0
        assert _canonical(cluster) == before
        # a full replacement builds what the differences built
        res = cluster.apply(st, full=True)
        assert res.full
        assert _canonical(cluster) == before
        # and so does the CLI mechanism
        cli = PolicyDataplane("node1", families=(4,), backend=nft.NftCli())
        cluster.node.run(cli.sync, st)
        assert _canonical(cluster) == before
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_only_table_inet_tabby_is_touched(cluster: Cluster) -> None:
    cluster.node.exec("nft", "add", "table", "ip", "bystander")
    cluster.node.exec("nft", "add", "chain", "ip", "bystander", "c")
    try:
        cluster.apply(cluster.state(tt.Step((tt.DENY_ALL,), tt.everything)), full=True)
        cluster.apply(cluster.state(tt.Step((), tt.everything)))
        tables = cluster.node.exec("nft", "list", "tables").stdout.split("\n")
        assert sorted(t.strip() for t in tables if t.strip()) == [
            "table inet tabby",
            "table ip bystander",
        ]
    finally:
        cluster.node.exec("nft", "delete", "table", "ip", "bystander", check=False)


def test_nat_outgoing_masquerades_to_outside_the_pools(cluster: Cluster) -> None:
    nat = NatConfig((("10.244.0.0/16", True), ("10.250.0.0/16", False)))
    cluster.node.run(cluster.dp.sync, cluster.state(tt.Step((), tt.everything)), nat)
    try:
        text = _listing(cluster)
        assert "ip saddr @nat-src4 ip daddr != @pools4 masquerade" in text
        assert "10.244.0.0/16" in text
        assert "10.250.0.0/16" in text
        # pod-to-pod inside the pools is not translated: x/b sees x/a's own address
        got = cluster.probe({"x/a": [(tt.address("x/b"), "TCP", 80)]}, timeout=3.0)
        assert all(got.values())
    finally:
        cluster.node.run(cluster.dp.sync, cluster.state(tt.Step((), tt.everything)), NatConfig())
    assert "masquerade" not in _listing(cluster)


def test_restart_under_default_deny_opens_no_window(cluster: Cluster) -> None:
    """A new PolicyDataplane (a restarted tabby-node) replaces the table atomically, over
    and over, while y/a probes x/a continuously: not one probe may get through."""
    deny = cluster.state(tt.Step((tt.DENY_INGRESS,), tt.everything))
    cluster.apply(deny)
    stop = threading.Event()
    counts = {"tried": 0, "passed": 0}
    jobs = [(tt.address("x/a"), "TCP", 80), (tt.address("x/a"), "UDP", 81)]

    def prober() -> None:
        while not stop.is_set():
            got = probe_many(jobs, 0.02)
            counts["tried"] += len(got)
            counts["passed"] += sum(got.values())

    t = threading.Thread(
        target=run_in_thread_netns, args=(cluster.pods["y/a"].path, prober), daemon=True
    )
    t.start()
    try:
        replaced = 0
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            fresh = PolicyDataplane("node1", families=(4,))
            res = cluster.node.run(fresh.sync, deny)
            assert res.full
            replaced += 1
    finally:
        stop.set()
        t.join(timeout=10)
    try:
        assert replaced >= 5
        assert counts["tried"] >= 50
        assert counts["passed"] == 0, counts
        # control: the same probe passes once the policy is gone
        cluster.apply(cluster.state(tt.Step((), tt.everything)))
        got = cluster.probe({"y/a": jobs}, timeout=3.0)
        assert all(got.values()), got
    finally:
        cluster.apply(cluster.state(tt.Step((), tt.everything)))


def test_ipv6_policy_and_neighbour_discovery(netns_pool: NetnsPool) -> None:
    """Dual-stack pods on their own node: IPv6 rules use the a6-/ip6 sets, and the
    neighbour discovery of an egress-isolated pod towards its node passes the input chain
    (else that pod's IPv6 breaks entirely)."""
    node = netns_pool.node()
    v6 = {p: f"fd00:10:244::{i + 10:x}" for i, p in enumerate(("x/a", "x/b", "x/c"))}
    endpoints, pods, servers = [], {}, []
    try:
        for name, addr6 in v6.items():
            pod = netns_pool.pod()
            host = dataplane.host_veth_name("cali", "k8s-pod-network", pod.name, "eth0")
            addrs: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = [
                ipaddress.IPv4Address(tt.address(name)),
                ipaddress.IPv6Address(addr6),
            ]
            spec = dataplane.SetupSpec(
                netns_path=pod.path, ifname="eth0", host_ifname=host, addresses=addrs
            )
            node.run(dataplane.setup, spec)
            ns, pod_name = name.split("/")
            endpoints.append(
                Endpoint(ns, pod_name, "node1", host, (tt.address(name), addr6), f"{pod_name}-eth0")
            )
            pods[name] = pod
            servers.append(start_server(pod.name))
        base = tt.build_state(tt.Step((), tt.everything))
        policy = tt.pol("x-a-from-b", tt.A, ingress=(tt.rule(tt.peer(tt.sel(pod="b"))),))
        # x/b may only send to x/a: its neighbour discovery towards the node must still pass
        b_out = tt.pol(
            "x-b-to-a", tt.sel(pod="b"), egress=(tt.rule(tt.peer(tt.A)),), types=("Egress",)
        )
        state = dataclasses.replace(base, policies=(policy, b_out), endpoints=tuple(endpoints))
        dp = PolicyDataplane("node1")
        node.run(dp.sync, state)

        def probe(src: str, jobs: list[Job], timeout: float) -> dict[Job, bool]:
            return run_in_thread_netns(pods[src].path, lambda: probe_many(jobs, timeout))

        to_a = [(v6["x/a"], "TCP", 80), (v6["x/a"], "UDP", 81)]
        assert all(probe("x/b", to_a, 3.0).values())
        assert not any(probe("x/c", to_a, 0.5).values())
        assert all(probe("x/c", [(v6["x/b"], "TCP", 81)], 3.0).values())
        assert not any(probe("x/b", [(v6["x/c"], "TCP", 81)], 0.5).values())
        assert "ip6 saddr @a6-" in node.run(dp.ruleset)
    finally:
        for proc in servers:
            stop_process(proc)


def test_libnftables_survives_many_open_descriptors(node: Node) -> None:
    """With every descriptor below 1024 taken, a new context would get a socket libnftables
    cannot select() on (glibc aborts the process): the backend uses the CLI instead."""
    import resource

    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        pytest.skip("RLIMIT_NOFILE too low to fill the select() range")
    fds: list[int] = []
    try:
        while len(fds) < 1100:
            fds.append(os.open(os.devnull, os.O_RDONLY))
        lib = nft.LibNftables()
        node.run(lib.run, "add table inet tabby_fdtest\n")
        assert "tabby_fdtest" in node.exec("nft", "list", "tables").stdout
        assert list(lib._ctx.values()) == [None]
        lib.close()
    finally:
        for fd in fds:
            os.close(fd)
