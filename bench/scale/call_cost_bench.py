#!/usr/bin/env python3
"""Benchmark (not a test): what one pod's CNI calls cost as the cluster grows (issue 20).

For each cluster size N: a real etcd (Debian's etcd-server) on loopback, its data on tmpfs,
pinned to one CPU, filled in bulk with the documents of N nodes of ``--pods`` pods each
(scale_populate.py beside it: the keys and shapes scale_writer.py writes); then pod ADDs
and DELs through the path a call served by tabby-node takes, in this process: tabby's CNI
handlers (``cni_plugin.plugin.Plugin`` with tabby-ipam in-process and the endpoint
recorder; no kernel), the datastore work as one optimistic commit based on a warm watch
cache (``tabby_node.cache.Cache`` fed by ``store.sync`` of tabby-node's kinds, through
``tabby_node.knowledge.Knowledge``). Also, per pod, the writes scale_writer.py makes
besides the CNI calls (the controllers' Pod mirror: scheduled, with its address, deleted),
and the CNI calls as a process of their own makes them (no served store: the writer's path).

Per row and call: this process's CPU (the caller and the watch thread that takes the echo
of the call's writes), etcd's CPU (``/proc``), etcd requests by method and bytes sent and
received (counted in ``datastore.etcd.client``). Prints a table per N with the load
average; asserts nothing. Needs etcd on PATH; not root. See bench/README.md.

``--agent`` (root): a real tabby-node of this checkout in a lab namespace (``tabbyctl.demo.lab``)
serves the calls, through the installed ``tabby`` client; tabby-node's CPU per call as
scale_bench.py measures a probe's, and its RSS when ready (with its peak) and after the calls.

    .venv/bin/python -m bench.scale.call_cost_bench --sizes 10,100,300,1000
    .venv/bin/python -m bench.scale.call_cost_bench --sizes 300 --profile served-add
    sudo .venv/bin/python -m bench.scale.call_cost_bench --agent --sizes 10,1000 --calls 40
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import json
import os
import pstats
import resource
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench import record
from bench.scale import scale_populate
from bench.scale.scale_writer import NoKernel, cni_env
from bench.stats import percentile

ROOT = Path(__file__).resolve().parents[2]

CLK_TCK = os.sysconf("SC_CLK_TCK")
POOL = "10.128.0.0/14"
PREFIX = "/tabby"
ROWS = ("served ADD", "served DEL", "mirror", "own ADD", "own DEL")


def echo(text: str = "") -> None:
    print(text, flush=True)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def proc_cpu(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_memory(pid: int) -> tuple[float, float]:
    """A process's RSS and peak RSS (VmHWM), in MB."""
    found = {}
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "VmHWM"):
                found[name] = int(value.split()[0]) / 1024
    return found.get("VmRSS", 0.0), found.get("VmHWM", 0.0)


def self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# == counting etcd requests =======================================================================


class Requests:
    """Every request this process sends to etcd: count, bytes out and in, by method."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.count: collections.Counter[str] = collections.Counter()
        self.sent = 0
        self.received = 0

    def install(self) -> None:
        from datastore.etcd import client as etcd_client

        original = etcd_client._Conn.request
        me = self

        def counted(
            conn: Any, path: str, body: bytes, deadline: float
        ) -> tuple[int, dict[str, str], bytes]:
            answer = original(conn, path, body, deadline)
            with me.lock:
                me.count[path.rsplit("/", 1)[-1]] += 1
                me.sent += len(body)
                me.received += len(answer[2])
            return answer

        etcd_client._Conn.request = counted  # type: ignore[method-assign]

    def take(self) -> tuple[collections.Counter[str], int, int]:
        with self.lock:
            out = (self.count, self.sent, self.received)
            self.count, self.sent, self.received = collections.Counter(), 0, 0
        return out


REQUESTS = Requests()


# == etcd ==========================================================================================


class Etcd:
    """One etcd member on loopback, data on tmpfs, pinned to ``cpu``; stopped by PID."""

    def __init__(self, cpu: str) -> None:
        self.dir = tempfile.mkdtemp(prefix="tabby-callcost-", dir="/dev/shm")
        self.client = free_port()
        self.peer = free_port()
        self.url = f"http://127.0.0.1:{self.client}"
        peer = f"http://127.0.0.1:{self.peer}"
        argv = [
            *(["taskset", "-c", cpu] if cpu and shutil.which("taskset") else []),
            "etcd",
            *("--name", "m1", "--data-dir", os.path.join(self.dir, "data")),
            *("--listen-client-urls", self.url, "--advertise-client-urls", self.url),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"m1={peer}", "--initial-cluster-state", "new"),
            *("--quota-backend-bytes", str(8 << 30)),
            "--logger=zap",
            "--log-level=warn",
        ]
        self.log = open(os.path.join(self.dir, "etcd.log"), "wb")  # noqa: SIM115
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while not self.healthy():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("etcd did not start")
            time.sleep(0.05)

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=1) as r:  # noqa: S310
                return b"true" in r.read()
        except OSError:
            return False

    def cpu(self) -> float:
        return proc_cpu(self.proc.pid)

    def metrics(self) -> dict[str, float]:
        wanted = ("etcd_debugging_mvcc_keys_total", "etcd_mvcc_db_total_size_in_bytes")
        out: dict[str, float] = {}
        with urllib.request.urlopen(self.url + "/metrics", timeout=5) as r:  # noqa: S310
            for line in r.read().decode().splitlines():
                name, _, value = line.partition(" ")
                if name in wanted:
                    out[name] = float(value)
        return out

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


# == the served path ==============================================================================


class NodeEndpoints:
    """tabby-node's endpoint recorder without its policy dataplane: the WorkloadEndpoint
    written, and put in the cache as tabby-node does before it programs the pod."""

    def __init__(self, cache: Any) -> None:
        from cni_plugin.plugin import DatastoreEndpoints

        self.cache = cache
        self.inner = DatastoreEndpoints()

    def added(self, args: Any, conf: Any, addresses: Any, host_ifname: str) -> None:
        key, doc = self.inner.record(args, conf, addresses, host_ifname)
        if doc is not None:
            self.cache.put_local("workloadendpoint", key, doc)

    def removed(self, args: Any, conf: Any) -> None:
        key = self.inner.erase(args, conf)
        if key is not None:
            self.cache.put_local("workloadendpoint", key, None)


class Node:
    """The node the calls are made on: its handlers, and (``served``) tabby-node's store
    and watch cache offered to them."""

    def __init__(self, name: str, url: str, served: bool) -> None:
        from cni_plugin.plugin import DatastoreEndpoints, Plugin
        from datastore.etcd.store import EtcdStore
        from ipam.config import parse_plugin
        from stores import serve
        from tabby_node.cache import WATCHED_KINDS, Cache
        from tabby_node.knowledge import Knowledge
        from tabby_node.server import InProcessIpam

        self.name = name
        self.url = url
        self.served = served
        self.stop = threading.Event()
        self.cache = Cache()
        self.settings = parse_plugin(json.loads(self.conflist())).ipam
        self.store: EtcdStore | None = None
        self.thread: threading.Thread | None = None
        endpoints: Any = DatastoreEndpoints()
        if served:
            store = self.store = EtcdStore(url, prefix=PREFIX)

            def watch() -> None:
                for event in store.sync(WATCHED_KINDS, self.stop):
                    self.cache.apply(event)

            self.thread = threading.Thread(target=watch, daemon=True)
            self.thread.start()
            if not self.cache.synced.wait(120):
                raise RuntimeError("no snapshot from the watch")
            serve(self.settings, store, Knowledge(self.cache))
            endpoints = NodeEndpoints(self.cache)
        self.handlers = Plugin(
            dataplane=NoKernel, ipam=InProcessIpam(), endpoints=endpoints, validate_first=True
        ).handlers()

    def conflist(self, prev: dict[str, Any] | None = None) -> str:
        conf: dict[str, Any] = {
            "cniVersion": "1.0.0",
            "name": scale_populate.NETWORK,
            "type": "tabby",
            "nodename": self.name,
            "mtu": 1450,
            "log_level": "warning",
            "log_file_path": "/dev/null",
            "ipam": {
                "type": "tabby-ipam",
                "assign_ipv4": True,
                "assign_ipv6": False,
                "ipv4_pools": [POOL],
                "datastore_type": "etcdv3",
                "etcd_endpoints": [self.url],
                "etcd_prefix": PREFIX,
                "lock_timeout_seconds": 30,
            },
        }
        if prev is not None:
            conf["prevResult"] = prev
        return json.dumps(conf)

    def cni(self, verb: str, pod: dict[str, Any]) -> dict[str, Any] | None:
        from cni_protocol import skel

        env = cni_env(verb, pod)
        stdin = self.conflist(pod.get("result") if verb == "DEL" else None).encode()
        rc, out = skel.run(self.handlers, env, stdin)
        if rc != 0:
            raise RuntimeError(f"{verb} {pod['name']}: {out[:300]!r}")
        return json.loads(out) if out.strip() else None

    def close(self) -> None:
        from stores import unserve

        if self.served:
            unserve(self.settings)
        self.stop.set()
        if self.store is not None:
            self.store.close()
        if self.thread is not None:
            self.thread.join(5)


# == measuring =====================================================================================


class Meter:
    """CPU (this process, the calling thread, etcd) and etcd requests over a few calls."""

    def __init__(self, etcd: Etcd) -> None:
        self.etcd = etcd
        self.rows: dict[str, dict[str, Any]] = {}

    @contextlib.contextmanager
    def measure(self, row: str, calls: int, settle: float = 0.3) -> Iterator[None]:
        REQUESTS.take()
        p0, t0, e0 = self_cpu(), time.thread_time(), self.etcd.cpu()
        yield
        t1 = time.thread_time()
        time.sleep(settle)  # the watch's echo of the writes (tabby-node's cost too)
        p1, e1 = self_cpu(), self.etcd.cpu()
        count, sent, received = REQUESTS.take()
        rec = self.rows.setdefault(
            row,
            {"calls": 0, "proc": 0.0, "thread": 0.0, "etcd": 0.0, "req": collections.Counter()},
        )
        rec["calls"] += calls
        rec["proc"] += p1 - p0
        rec["thread"] += t1 - t0
        rec["etcd"] += e1 - e0
        rec["req"].update(count)
        rec["sent"] = rec.get("sent", 0) + sent
        rec["received"] = rec.get("received", 0) + received


def new_pod(node: str, i: int, namespaces: int) -> dict[str, Any]:
    """A churn pod as bench/scale/scale_writer.py makes them (spread over its namespaces)."""
    return {
        "node": node,
        "namespace": f"bench-ns-{i % namespaces}",
        "name": f"cni-{secrets.token_hex(3)}-{i}",
        "uid": secrets.token_hex(16),
        "cid": secrets.token_hex(32),
    }


def mirror_pod(store: Any, pod: dict[str, Any], ips: list[str] | None) -> None:
    """The Pod's mirror as the controllers write it (None: deleted)."""
    from kube_controllers.mirror import Mirror, project_pod
    from resources.client import ResourceClient
    from resources.mirror import KUBERNETES

    mirror = Mirror(store, ResourceClient(store, owner=KUBERNETES))
    key = f"{pod['namespace']}/{pod['name']}"
    if ips is None:
        mirror.sync("pod", key, None)
        return
    obj = scale_populate.k8s_pod(
        pod["namespace"], pod["name"], pod["node"], pod["uid"], {"app": "churn"}, ips
    )
    mirror.sync("pod", key, project_pod(obj))


def run_size(args: argparse.Namespace, size: int) -> dict[str, Any]:
    from datastore.etcd.store import EtcdStore

    etcd = Etcd(args.etcd_cpu)
    served: Node | None = None
    own: Node | None = None
    try:
        store = EtcdStore(etcd.url, prefix=PREFIX)
        nodes = [f"sim-{i:04d}" for i in range(size - 1)] + ["probe"]
        namespaces = [f"bench-ns-{i}" for i in range(args.namespaces)]
        node_argv = [
            *("--nodename", "{node}", "--backend", "vxlan", "--log-file", ""),
            *("--datastore-type", "etcdv3", "--etcd-endpoints", etcd.url),
            *("--etcd-prefix", PREFIX),
        ]
        e0 = etcd.cpu()
        made = scale_populate.populate(
            store,
            nodes,
            pool=POOL,
            pods_per_node=args.pods,
            namespaces=[*namespaces],
            node_argv=node_argv,
            underlay="172.30.0.1",
            kubernetes=True,
            progress=lambda t: echo(f"    {t}"),
        )
        meta = etcd.metrics()
        echo(
            f"  N={size}: {made['documents']} documents in {made['commits']} commits "
            f"(made in {made['made_s']} s, written in {made['written_s']} s, etcd "
            f"{etcd.cpu() - e0:.1f} s CPU); etcd keys "
            f"{meta.get('etcd_debugging_mvcc_keys_total', 0):.0f}, db "
            f"{meta.get('etcd_mvcc_db_total_size_in_bytes', 0) / 1e6:.1f} MB"
        )
        t0 = time.monotonic()
        served = Node("probe", etcd.url, served=True)
        snapshot_s = time.monotonic() - t0
        meter = Meter(etcd)
        for label in ("served", "own"):
            if label == "own":  # no served store: each call opens its own
                served.close()
                served = None
                node = own = Node("probe", etcd.url, served=False)
            else:
                node = served
            for i in range(args.warmup + args.calls):
                pod = new_pod("probe", i, args.namespaces)
                warm = i < args.warmup
                with contextlib.ExitStack() as stack:
                    if not warm and label == "served":
                        stack.enter_context(meter.measure("mirror", 1, settle=0.0))
                    mirror_pod(store, pod, [])
                with contextlib.ExitStack() as stack:
                    if not warm:
                        stack.enter_context(meter.measure(f"{label} ADD", 1))
                    if args.profile == f"{label}-add" and not warm:
                        stack.enter_context(profiled(args))
                    pod["result"] = node.cni("ADD", pod)
                ips = [ip["address"].split("/")[0] for ip in pod["result"]["ips"]]
                with contextlib.ExitStack() as stack:
                    if not warm and label == "served":
                        stack.enter_context(meter.measure("mirror", 0, settle=0.0))
                    mirror_pod(store, pod, ips)
                with contextlib.ExitStack() as stack:
                    if not warm:
                        stack.enter_context(meter.measure(f"{label} DEL", 1))
                    if args.profile == f"{label}-del" and not warm:
                        stack.enter_context(profiled(args))
                    node.cni("DEL", pod)
                with contextlib.ExitStack() as stack:
                    if not warm and label == "served":
                        stack.enter_context(meter.measure("mirror", 0, settle=0.0))
                    mirror_pod(store, pod, None)
        store.close()
        return {"size": size, "rows": meter.rows, "snapshot_s": snapshot_s, "load": loadavg()}
    finally:
        for node in (served, own):
            if node is not None:
                node.close()
        etcd.stop()


def run_agent(args: argparse.Namespace, size: int) -> dict[str, Any]:
    """``--agent``: a real tabby-node (this checkout's) in a lab node namespace
    (``tabbyctl.demo.lab``, etcd in it), its datastore filled as for the in-process rows, then pod
    ADDs and DELs through the installed ``tabby`` client and tabby-node's socket, as
    bench/scale/scale_bench.py measures a probe: tabby-node's CPU from the ADD until 0.3 s after
    it (the watch's echo and the dataplane pass it causes), and the same for the DEL."""
    from dataplane.netns import run_in_netns
    from datastore.etcd.store import EtcdStore
    from tabbyctl.demo.lab import CLIENT_PORT, V4_POOL, Lab

    lab = Lab(
        nodes_wanted=1,
        backend="vxlan",
        ipv6=False,
        echo=echo,
        etcd_members=1,
        tabby_node=[str(ROOT / ".venv" / "bin" / "tabby-node")],
        cni_bin=args.cni_bin,
    )
    try:
        lab.build_underlay()
        node = lab.nodes[0]
        url = f"http://127.0.0.1:{CLIENT_PORT}"
        fd = os.open(f"/run/netns/{node.netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:

            def fill() -> dict[str, Any]:
                store = EtcdStore(url, prefix=lab.etcd_prefix)
                try:
                    return scale_populate.populate(
                        store,
                        [f"sim-{i:04d}" for i in range(size - 1)],
                        pool=V4_POOL,
                        pods_per_node=args.pods,
                        namespaces=[f"bench-ns-{i}" for i in range(args.namespaces)],
                        node_argv=[
                            *("--nodename", "{node}", "--backend", "vxlan", "--log-file", ""),
                            *("--datastore-type", "etcdv3", "--etcd-endpoints", url),
                            *("--etcd-prefix", lab.etcd_prefix),
                        ],
                        underlay="172.30.0.1",
                        kubernetes=True,
                        heartbeat_ttl=3600,  # alive: the probe programs a VTEP for each
                    )
                finally:
                    store.close()

            made = run_in_netns(fd, fill)
        finally:
            os.close(fd)
        echo(f"  N={size} (agent): {made['documents']} documents in {made['commits']} commits")
        lab.start_agent(node)
        lab.wait_agent(node, 600)
        lab.wait_ready(600)
        assert node.agent is not None
        assert node.etcd is not None
        pid, etcd_pid = node.agent.pid, node.etcd.pid
        rss_ready, hwm_ready = proc_memory(pid)
        adds: list[float] = []
        dels: list[float] = []
        etcd_ms: list[float] = []
        for i in range(args.warmup + args.calls):
            pod = lab.new_pod(node, f"bench-ns-{i % args.namespaces}", f"cni-{i}")
            c0, e0 = proc_cpu(pid), proc_cpu(etcd_pid)
            rc, out = lab.cni(node, "ADD", pod)
            if rc != 0 or out is None:
                raise RuntimeError(f"ADD failed: {out}")
            pod.result = out
            time.sleep(0.3)
            c2 = proc_cpu(pid)
            lab.del_pod(pod)
            time.sleep(0.3)
            c4, e4 = proc_cpu(pid), proc_cpu(etcd_pid)
            if i >= args.warmup:
                adds.append((c2 - c0) * 1000)
                dels.append((c4 - c2) * 1000)
                etcd_ms.append((e4 - e0) * 1000)
        return {
            "size": size,
            "load": loadavg(),
            "add_ms": percentile(adds, 50),
            "del_ms": percentile(dels, 50),
            "add_mean": sum(adds) / len(adds),
            "del_mean": sum(dels) / len(dels),
            "etcd_ms": sum(etcd_ms) / len(etcd_ms),
            "calls": len(adds),
            "rss_ready": rss_ready,
            "hwm_ready": hwm_ready,
            "rss_after": proc_memory(pid)[0],
        }
    finally:
        problems = lab.teardown()
        if problems:
            echo(f"  cleanup left: {problems}")


def agent_table(r: dict[str, Any]) -> None:
    echo(
        f"N={r['size']:<5} tabby-node CPU per ADD p50 {r['add_ms']:.1f} ms (mean "
        f"{r['add_mean']:.1f}), per DEL p50 {r['del_ms']:.1f} ms (mean {r['del_mean']:.1f}); "
        f"etcd {r['etcd_ms']:.1f} ms per ADD+DEL; {r['calls']} pods (load {r['load']})"
    )
    echo(
        f"N={r['size']:<5} tabby-node RSS {r['rss_ready']:.1f} MB when ready (peak "
        f"{r['hwm_ready']:.1f} MB), {r['rss_after']:.1f} MB after the calls"
    )


PROFILE = cProfile.Profile()


@contextlib.contextmanager
def profiled(args: argparse.Namespace) -> Iterator[None]:
    PROFILE.enable()
    try:
        yield
    finally:
        PROFILE.disable()


def table(result: dict[str, Any]) -> None:
    echo(
        f"\nN={result['size']} (load {result['load']}; the served node's watch snapshot "
        f"{result['snapshot_s']:.1f} s)"
    )
    echo(
        f"{'row':<11} {'calls':>5} {'proc ms':>8} {'thread ms':>9} {'etcd ms':>8} "
        f"{'KB out':>7} {'KB in':>8}  requests per call"
    )
    for row in ROWS:
        rec = result["rows"].get(row)
        if rec is None:
            continue
        # "mirror" counts a pod (its three writes) per call of the served ADD
        n = rec["calls"] or 1
        reqs = ", ".join(f"{k} {v / n:.1f}" for k, v in sorted(rec["req"].items()))
        echo(
            f"{row:<11} {n:>5} {rec['proc'] / n * 1000:>8.2f} {rec['thread'] / n * 1000:>9.2f} "
            f"{rec['etcd'] / n * 1000:>8.2f} {rec['sent'] / n / 1024:>7.1f} "
            f"{rec['received'] / n / 1024:>8.1f}  {reqs}"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="10,100,300,1000", help="cluster sizes (10,100,300,1000)")
    ap.add_argument("--pods", type=int, default=20, help="pods per node (20)")
    ap.add_argument("--namespaces", type=int, default=50, help="pod namespaces (50)")
    ap.add_argument("--calls", type=int, default=30, help="measured pods per row (30)")
    ap.add_argument("--warmup", type=int, default=3, help="unmeasured pods first (3)")
    ap.add_argument("--etcd-cpu", default="1", help="CPU list etcd is pinned to (1; '' none)")
    ap.add_argument(
        "--profile",
        choices=("served-add", "served-del", "own-add", "own-del"),
        help="cProfile that row's calls and print the top functions",
    )
    ap.add_argument(
        "--agent",
        action="store_true",
        help="a real tabby-node in a lab namespace instead (root; the installed tabby client)",
    )
    ap.add_argument("--cni-bin", default="/opt/cni/bin", help="where the tabby client is")
    ap.add_argument("--json", help="write the results here")
    record.add_argument(ap, "call_cost_agent with --agent, else call_cost_bench")
    args = ap.parse_args(argv)
    if shutil.which("etcd") is None:
        echo("call_cost_bench: etcd is missing (apt-get install etcd-server)")
        return 2
    from cni_protocol import log as cni_log

    cni_log.setup_resident("warning", "")
    REQUESTS.install()
    echo(f"call_cost_bench: load {loadavg()}, etcd pinned to CPU {args.etcd_cpu or '-'}")
    results = []
    try:
        for size in [int(s) for s in args.sizes.split(",") if s.strip()]:
            if args.agent:
                result = run_agent(args, size)
                results.append(result)
                agent_table(result)
                continue
            result = run_size(args, size)
            results.append(result)
            table(result)
    except KeyboardInterrupt:
        echo("interrupted")
        return 130
    if args.profile:
        stats = pstats.Stats(PROFILE)
        stats.sort_stats("cumulative").print_stats(40)
    if args.json:
        for r in results:
            for rec in r.get("rows", {}).values():
                rec["req"] = dict(rec["req"])
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


def record_name(argv: list[str]) -> str:
    """``--record``'s default: the in-process rows and ``--agent`` are recorded apart."""
    return "call_cost_agent" if "--agent" in argv else "call_cost_bench"


if __name__ == "__main__":
    sys.exit(record.run(main, record_name))
