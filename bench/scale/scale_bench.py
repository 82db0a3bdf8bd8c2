#!/usr/bin/env python3
"""Benchmark (not a test): tabby's control plane as the cluster grows (issue 20).

One real etcd pinned to one core; a few real tabby-nodes (VXLAN) as probes, each in a node
namespace of the lab (``tabbyctl.demo.lab``); many simulated nodes in one process
(bench/scale/scale_sim.py: tabby-node's own watch and heartbeat loops over tabby's own store,
with the stream reading done by one asyncio loop); a writer (bench/scale/scale_writer.py) that
fills the datastore as the simulated nodes' registrations and CNI ADDs would, then churns
it at Kubernetes' steady-state rate (20 pod changes/s) with a new block every few seconds
and a policy change every 10 s. For each cluster size N (probes included) and each
fan-out engine of the simulated nodes' watches (the JSON gateway tabby uses; native gRPC;
gRPC through ``etcd grpc-proxy``), it prints a table with the issue's targets next to the
numbers: watch events at rest and under churn by kind, etcd's CPU, write -> last watcher,
the probes' CPU per remote event, at rest and RSS, write -> route and policy change ->
enforced on every probe, the CPU of a CNI ADD served by a probe, and recovery after an etcd
restart and after compactions (time until every node is back in sync, etcd's peak CPU,
how many full re-reads and how many started in the same second).

Needs root, the installed binaries (./build.sh; or --tabby-node .venv/bin/tabby-node to
run the probes from this checkout), etcd (Debian's etcd-server, which also has
``etcd grpc-proxy``), nftables, and for the gRPC engines grpcio (``pip install
'.[bench]'``). Everything it starts is stopped by PID, every namespace and directory it
made removed, also on Ctrl-C. Prints numbers; asserts nothing. See bench/README.md.

    .venv/bin/python -m bench.scale.scale_bench --quick                  # a smoke run, ~6 min
    .venv/bin/python -m bench.scale.scale_bench --sizes 100,300          # gateway, grpc, proxy
    .venv/bin/python -m bench.scale.scale_bench --sizes 1000 --engines gateway,proxy --json r.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench import record
from bench.scale import scale_wire as wire
from bench.stats import percentile
from tabbyctl.demo.lab import Lab, LabError, LabNode, http_get
from tabbyctl.demo.proc import INTERRUPTS, stop_process

ROOT = Path(__file__).resolve().parents[2]

CLK_TCK = os.sysconf("SC_CLK_TCK")
ENGINES = ("gateway", "grpc", "proxy")
SCENARIOS = ("restart", "compaction", "outage")
POOL = "10.128.0.0/14"  # 4096 blocks of /26: a block per node up to N = 1000, and churn
SIM_UNDERLAY = "172.30.0.1"  # the simulated nodes' underlay addresses (nobody answers)
CLIENT_PORT = 2379
PEER_PORT = 2380
SIDE_PORT = 2399  # the outage scenario: etcd answers here only, nobody else knows it
LANE_PORT = 24001  # the writer's lanes (one node-local store lock each)
PROXY_PORT = 23790
PROBE_NAMESPACE = "bench-probe"

TARGETS = {
    "rest_events": "0 from liveness",
    "probe_event_ms": "<= 2 ms, flat 100..1000",
    "probe_rest": "<= 1 % of a core",
    "probe_rss": "<= 120 MB at 1000/20k",
    "etcd_churn": "<= 1 core at 1000 nodes",
    "route_p99": "p99 <= 1 s",
    "policy_p99": "p99 <= 1 s",
    "cni_cpu": "flat from 10 to 1000 nodes",
    "sync": "<= 30 s, no re-read storm",
}


class BenchError(Exception):
    """A step of the benchmark that failed (one line for the operator)."""


def now() -> float:
    return time.monotonic()


def echo(text: str = "") -> None:
    print(text, flush=True)


def loadavg() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


# == processes ============================================================================


def proc_cpu(pid: int) -> float | None:
    """utime + stime of ``pid`` in seconds."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_mem(pid: int, field: str = "VmRSS") -> float | None:
    """A ``/proc/<pid>/status`` memory field in MB."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class Sampler:
    """CPU time of some processes every 0.1 s, for peaks (the averages are read directly
    at the edges of each phase)."""

    def __init__(self) -> None:
        self.pids: dict[str, int] = {}
        self.samples: list[tuple[float, dict[str, float]]] = []
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="sampler")
        self.thread.start()

    def watch(self, name: str, pid: int) -> None:
        with self.lock:
            self.pids[name] = pid

    def _loop(self) -> None:
        while not self.stop.wait(0.1):
            with self.lock:
                pids = dict(self.pids)
            got = {}
            for name, pid in pids.items():
                cpu = proc_cpu(pid)
                if cpu is not None:
                    got[name] = cpu
            self.samples.append((now(), got))
            if len(self.samples) > 200_000:
                del self.samples[:100_000]

    def peak(self, name: str, t0: float, t1: float, window: float = 1.0) -> float | None:
        """The highest CPU (% of a core) of ``name`` over any ``window`` s in [t0, t1]; a
        process restarted meanwhile (etcd) counts from its new start."""
        points = [(t, d[name]) for t, d in self.samples if t0 <= t <= t1 and name in d]
        best: float | None = None
        j = 0
        for i in range(len(points)):
            while j < len(points) and points[j][0] - points[i][0] < window:
                j += 1
            if j >= len(points):
                break
            (ta, ca), (tb, cb) = points[i], points[j]
            if cb >= ca and tb > ta:
                pct = 100 * (cb - ca) / (tb - ta)
                best = pct if best is None else max(best, pct)
        return best


class Child:
    """A bench process speaking JSON lines (the simulator, the writer), started inside a
    namespace, recorded in the lab before an interrupt can lose it."""

    def __init__(self, lab: Lab, netns: str, argv: list[str], log: str, name: str) -> None:
        self.name = name
        self.lock = threading.Lock()
        with INTERRUPTS.deferred(), open(log, "ab") as err:
            self.proc: subprocess.Popen[str] = subprocess.Popen(
                ["ip", "netns", "exec", netns, *argv],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
                start_new_session=True,
                cwd=str(ROOT),
            )
            lab.processes.append(self.proc)  # type: ignore[arg-type]
        self.log = log

    @property
    def pid(self) -> int:
        return self.proc.pid

    def call(self, op: str, timeout: float = 600, **kw: Any) -> dict[str, Any]:
        assert self.proc.stdin is not None
        assert self.proc.stdout is not None
        with self.lock:
            try:
                self.proc.stdin.write(json.dumps({"op": op, **kw}) + "\n")
                self.proc.stdin.flush()
            except OSError:
                raise BenchError(f"the {self.name} died: {tail(self.log)}") from None
            line = _readline(self.proc, timeout)
        if not line:
            raise BenchError(f"the {self.name} died: {tail(self.log)}")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise BenchError(f"{self.name} {op}: {reply['error']}")
        return reply

    def stop(self) -> None:
        if self.proc.poll() is not None:
            return
        with contextlib.suppress(OSError):
            assert self.proc.stdin is not None
            self.proc.stdin.write('{"op":"stop"}\n')
            self.proc.stdin.flush()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            stop_process(self.proc, signal.SIGKILL, 5)  # type: ignore[arg-type]


def _readline(proc: subprocess.Popen[str], timeout: float) -> str:
    """One line of ``proc``'s stdout within ``timeout`` s (interrupts still work)."""
    assert proc.stdout is not None
    out: list[str] = []
    reader = threading.Thread(target=lambda: out.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout)
    if reader.is_alive():
        raise BenchError(f"no answer within {timeout:.0f} s")
    return out[0] if out else ""


def tail(path: str, limit: int = 800) -> str:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()[-limit:].strip()
    except OSError:
        return ""


class Monitor:
    """A monitor command inside a namespace (``ip monitor route``, ``nft monitor``): every
    line with the monotonic time it was read."""

    def __init__(self, lab: Lab, netns: str, argv: list[str], log: str) -> None:
        self.lines: list[tuple[float, str]] = []
        self.lock = threading.Lock()
        self.log = open(log, "a", encoding="utf-8", buffering=1)  # noqa: SIM115 (the reader closes it)
        with INTERRUPTS.deferred():
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", netns, *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.DEVNULL,
                stdin=subprocess.DEVNULL,
                text=True,
                start_new_session=True,
            )
            lab.processes.append(self.proc)  # type: ignore[arg-type]
        self.thread = threading.Thread(target=self._read, daemon=True, name="monitor")
        self.thread.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        with self.log:
            for line in self.proc.stdout:
                t = now()
                with self.lock:
                    self.lines.append((t, line))
                self.log.write(f"{t:.3f} {line}")

    def first(self, pattern: re.Pattern[str], since: float) -> float | None:
        with self.lock:
            lines = list(self.lines)
        for t, line in lines:
            if t >= since and pattern.search(line):
                return t
        return None

    def trim(self, before: float) -> None:
        with self.lock:
            self.lines = [x for x in self.lines if x[0] >= before]


# == the lab =================================================================================


class ScaleLab(Lab):
    """The cluster lab with one etcd, on the control node (node-1), pinned to one core;
    node-1 runs no tabby-node (it is where etcd, the simulator and the writer live); the
    other nodes are the probes."""

    etcd_cpus: str = "1"
    lanes: int = 8
    etcd_proc: subprocess.Popen[bytes] | None = None
    etcd_tmpfs: bool = True

    @property
    def control(self) -> LabNode:
        return self.nodes[0]

    @property
    def probes(self) -> list[LabNode]:
        return self.nodes[1:]

    def etcd_data(self) -> str:
        """etcd's data: on tmpfs by default (this shared VM's disk adds 1-100 ms of fsync
        to every commit, which is not what the bench studies), else in the lab."""
        if self.etcd_tmpfs:
            return f"/dev/shm/{self.prefix}-etcd"
        return os.path.join(self.control.workdir, "etcd")

    def teardown(self) -> list[str]:
        problems = super().teardown()
        if self.etcd_tmpfs and self.nodes:
            shutil.rmtree(self.etcd_data(), ignore_errors=True)
            if os.path.exists(self.etcd_data()):
                problems.append(f"directory {self.etcd_data()}")
        return problems

    def lane_urls(self) -> list[str]:
        return [f"http://127.0.0.1:{LANE_PORT + i}" for i in range(self.lanes)]

    def endpoints(self) -> list[str]:
        return [f"http://{self.control.ipv4.ip}:{CLIENT_PORT}"]

    def start_etcd(self, side: bool = False) -> None:
        """etcd on node-1, on its client port, loopback and the writer's lanes (``side``:
        only on a side port nobody else knows)."""
        if shutil.which("etcd") is None:
            raise LabError("etcd is missing: apt-get install etcd-server")
        node = self.control
        os.makedirs(self.etcd_data(), mode=0o700, exist_ok=True)
        if side:
            urls = [f"http://127.0.0.1:{SIDE_PORT}"]
        else:
            urls = [
                f"http://{node.ipv4.ip}:{CLIENT_PORT}",
                f"http://127.0.0.1:{CLIENT_PORT}",
                *self.lane_urls(),
            ]
        peer = f"http://127.0.0.1:{PEER_PORT}"
        argv = [
            *("ip", "netns", "exec", node.netns, "taskset", "-c", self.etcd_cpus, "etcd"),
            *("--name", "m1", "--data-dir", self.etcd_data()),
            *("--listen-client-urls", ",".join(urls), "--advertise-client-urls", urls[0]),
            *("--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer),
            *("--initial-cluster", f"m1={peer}", "--initial-cluster-state", "new"),
            *("--initial-cluster-token", self.prefix),
            *("--quota-backend-bytes", str(8 << 30)),
            "--logger=zap",
            "--log-level=warn",
        ]
        self.etcd_proc = node.etcd = self.spawn(argv, os.path.join(node.workdir, "etcd.log"))
        port = SIDE_PORT if side else CLIENT_PORT
        deadline = now() + 60
        while not self.etcd_ok(port):
            if self.etcd_proc.poll() is not None or now() > deadline:
                raise LabError(f"etcd did not start: {self._tail(node, 'etcd.log')}")
            time.sleep(0.05)

    def etcd_ok(self, port: int = CLIENT_PORT) -> bool:
        code, body = http_get(self.control.netns, f"http://127.0.0.1:{port}/health", 1)
        return code == 200 and b'"health":"true"' in body.replace(b" ", b"")

    def stop_etcd(self) -> None:
        if self.etcd_proc is not None:
            stop_process(self.etcd_proc, signal.SIGTERM, 30)  # type: ignore[arg-type]

    def wait_probes_ready(self, timeout: float) -> None:
        deadline = now() + timeout
        pending = list(self.probes)
        while pending:
            pending = [n for n in pending if self.health(n)[0] != 200]
            if not pending:
                return
            if now() > deadline:
                reasons = {n.name: self.health(n)[1].get("reasons") for n in pending}
                raise LabError(f"probes not ready: {reasons}")
            time.sleep(0.5)


def probe_metric(lab: Lab, node: LabNode, name: str) -> float | None:
    code, body = http_get(node.netns, "http://127.0.0.1:9091/metrics", 3)
    if code != 200:
        return None
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", body.decode(), re.M)
    return float(m.group(1)) if m else None


# == one run: a cluster of N nodes ===============================================================


class Run:
    def __init__(self, args: argparse.Namespace, size: int) -> None:
        self.args = args
        self.size = size
        self.sims = [f"sim-{i:04d}" for i in range(size - args.probes)]
        self.lab = ScaleLab(
            nodes_wanted=args.probes + 1,
            backend="vxlan",
            ipv6=False,
            echo=echo,
            etcd_members=1,
            tabby_node=[args.tabby_node],
            cni_bin=args.cni_bin,
            node_args=[
                *("--node-ttl", str(args.node_ttl)),
                *("--etcd-watch-transport", args.probe_watch),
            ],
        )
        self.lab.etcd_cpus = args.etcd_cpu
        self.lab.lanes = args.lanes
        self.lab.etcd_tmpfs = not args.etcd_disk
        self.sampler = Sampler()
        self.writer: Child | None = None
        self.sim: Child | None = None
        self.proxy: subprocess.Popen[bytes] | None = None
        self.routes: dict[str, Monitor] = {}
        self.nft: dict[str, Monitor] = {}
        self.results: dict[str, Any] = {"size": size, "sims": len(self.sims), "engines": {}}

    # -- bring-up ------------------------------------------------------------------------------

    def node_argv(self, endpoint: str) -> list[str]:
        """How a simulated node is configured: tabby-node's own flags (the probes run with
        the same ttl)."""
        return [
            *("--nodename", "{node}", "--backend", "vxlan"),
            *("--node-ttl", str(self.args.node_ttl), "--log-file", ""),
            *("--datastore-type", "etcdv3", "--etcd-endpoints", endpoint),
            *("--etcd-prefix", self.lab.etcd_prefix),
        ]

    def python(self) -> str:
        return sys.executable

    def build(self) -> None:
        lab = self.lab
        t0 = now()
        lab.build_underlay()
        assert lab.etcd_proc is not None
        self.sampler.watch("etcd", lab.etcd_proc.pid)
        echo(
            f"  lab {lab.prefix}: etcd on {lab.control.name} pinned to CPU {lab.etcd_cpus}, "
            f"{len(lab.probes)} probe namespaces ({time.monotonic() - t0:.1f} s)"
        )
        cfg = {
            "prefix": lab.etcd_prefix,
            "pool": POOL,
            "kubernetes": self.args.kubernetes,
            "lanes": lab.lane_urls(),
            "endpoint": f"http://127.0.0.1:{CLIENT_PORT}",
            "cni_log": os.path.join(lab.workdir, "sim-cni.log"),
            "node_argv": self.node_argv("{endpoint}"),
            "sim_underlay": SIM_UNDERLAY,
            "namespaces": self.args.namespaces,
        }
        path = os.path.join(lab.workdir, "writer.json")
        Path(path).write_text(json.dumps(cfg))
        self.writer = Child(
            lab,
            lab.control.netns,
            [self.python(), "-m", "bench.scale.scale_writer", path],
            os.path.join(lab.workdir, "writer.log"),
            "writer",
        )
        self.sampler.watch("writer", self.writer.pid)
        t0 = now()
        setup = self.writer.call(
            "setup",
            timeout=7200,
            sims=self.sims,
            pods_per_node=self.args.pods_per_node,
            namespaces=self.args.namespaces,
            populate=self.args.populate,
        )
        echo(
            f"  datastore: {len(self.sims)} simulated nodes with {self.args.pods_per_node} pods "
            f"each written in {now() - t0:.0f} s (revision {setup['revision']})"
        )
        self.results["setup_s"] = setup["setup_s"]
        t0 = now()
        for node in lab.probes:
            lab.start_agent(node)
        for node in lab.probes:
            lab.wait_agent(node, 600)
            assert node.agent is not None
            self.sampler.watch(node.name, node.agent.pid)
            self.routes[node.name] = Monitor(
                lab,
                node.netns,
                ["ip", "monitor", "route"],
                os.path.join(node.workdir, "routes.log"),
            )
            self.nft[node.name] = Monitor(
                lab, node.netns, ["nft", "monitor"], os.path.join(node.workdir, "nft.log")
            )
        lab.wait_probes_ready(600)
        for node in lab.probes:
            self.probe_pod(node)
        echo(f"  probes: {len(lab.probes)} tabby-nodes ready in {now() - t0:.0f} s")
        if self.args.baseline:
            self.results["baseline"] = self.baseline()

    def probe_pod(self, node: LabNode) -> None:
        """The probe's own pod (labelled role=probe: the standing policies select it)."""
        assert self.writer is not None
        name = f"probe-{node.name}"
        uid = secrets.token_hex(16)
        self.writer.call("probe_pod", node=node.name, name=name, uid=uid)
        pod = self.lab.new_pod(node, PROBE_NAMESPACE, name)
        rc, out = self.lab.cni(node, "ADD", pod, extra_args=f"K8S_POD_UID={uid}")
        if rc != 0 or out is None:
            raise BenchError(f"ADD of the probe pod on {node.name} failed: {out}")
        pod.result = out
        if self.args.kubernetes:
            self.writer.call("probe_pod", node=node.name, name=name, uid=uid, ips=pod.addresses())

    def start_proxy(self) -> None:
        lab = self.lab
        data = os.path.join(lab.workdir, "grpc-proxy")
        os.makedirs(data, mode=0o700, exist_ok=True)
        argv = [
            *("ip", "netns", "exec", lab.control.netns, "etcd", "grpc-proxy", "start"),
            f"--endpoints=127.0.0.1:{CLIENT_PORT}",
            f"--listen-addr=127.0.0.1:{PROXY_PORT}",
            f"--data-dir={data}",
        ]
        self.proxy = lab.spawn(argv, os.path.join(lab.workdir, "grpc-proxy.log"))
        self.sampler.watch("proxy", self.proxy.pid)
        deadline = now() + 30
        while not _listening(lab.control.netns, PROXY_PORT):
            if self.proxy.poll() is not None or now() > deadline:
                log = tail(os.path.join(lab.workdir, "grpc-proxy.log"))
                raise BenchError(f"etcd grpc-proxy did not start: {log}")
            time.sleep(0.1)

    def start_sim(self, engine: str) -> dict[str, Any]:
        lab = self.lab
        target = f"127.0.0.1:{PROXY_PORT if engine == 'proxy' else CLIENT_PORT}"
        cfg = {
            "prefix": lab.etcd_prefix,
            "engine": "gateway" if engine == "gateway" else "grpc",
            "grpc_target": target,
            "nodes": self.sims,
            "node_argv": self.node_argv("{endpoint}"),
            # etcd serves each client listener's JSON gateway through one gRPC connection
            # to itself: --sim-listeners spreads the simulated nodes over several
            "endpoints": [
                f"http://127.0.0.1:{CLIENT_PORT}",
                *lab.lane_urls()[: max(self.args.sim_listeners, 1) - 1],
            ],
            "log_file": os.path.join(lab.workdir, f"sim-{engine}.log"),
            "boot_rate": self.args.boot_rate,
            "boot_timeout": 1800,
        }
        path = os.path.join(lab.workdir, f"sim-{engine}.json")
        Path(path).write_text(json.dumps(cfg))
        self.sim = Child(
            lab,
            lab.control.netns,
            [self.python(), "-m", "bench.scale.scale_sim", path],
            os.path.join(lab.workdir, f"sim-{engine}.err"),
            "simulator",
        )
        self.sampler.watch("sim", self.sim.pid)
        return self.sim.call("boot", timeout=3600)

    def stop_sim(self) -> None:
        if self.sim is not None:
            self.sim.stop()
            self.sim = None
        if self.proxy is not None:
            stop_process(self.proxy, signal.SIGTERM, 10)  # type: ignore[arg-type]
            self.proxy = None

    # -- measuring -----------------------------------------------------------------------------

    def pids(self) -> dict[str, int]:
        lab = self.lab
        out = {}
        if lab.etcd_proc is not None:
            out["etcd"] = lab.etcd_proc.pid
        if self.proxy is not None:
            out["proxy"] = self.proxy.pid
        if self.sim is not None:
            out["sim"] = self.sim.pid
        if self.writer is not None:
            out["writer"] = self.writer.pid
        for node in lab.probes:
            if node.agent is not None:
                out[node.name] = node.agent.pid
        return out

    def snapshot(self) -> dict[str, Any]:
        """Everything counted so far (CPU times, the simulator's counters)."""
        snap: dict[str, Any] = {"t": now(), "cpu": {}, "load": os.getloadavg()[0]}
        for name, pid in self.pids().items():
            snap["cpu"][name] = proc_cpu(pid)
        if self.sim is not None:
            snap["sim"] = self.sim.call("counters")
        return snap

    @staticmethod
    def delta(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
        """CPU (% of a core) of each process, and the simulator's counts, between two
        snapshots."""
        dt = b["t"] - a["t"]
        cpu = {}
        for name, end in b["cpu"].items():
            start = a["cpu"].get(name)
            if start is not None and end is not None and end >= start:
                cpu[name] = 100 * (end - start) / dt
        out: dict[str, Any] = {"seconds": dt, "cpu": cpu}
        if "sim" in a and "sim" in b:
            sa, sb = a["sim"], b["sim"]
            out["events"] = {k: v - sa["events"].get(k, 0) for k, v in sb["events"].items()}
            out["events"] = {k: v for k, v in out["events"].items() if v}
            for k in ("messages", "bytes", "snapshots", "range_reads", "range_bytes"):
                out[k] = sb[k] - sa[k]
            out["sim_cpu"] = 100 * (sb["cpu"] - sa["cpu"]) / dt
        return out

    def probe_rss(self) -> dict[str, float]:
        out = {}
        for node in self.lab.probes:
            if node.agent is not None:
                rss = proc_mem(node.agent.pid)
                if rss is not None:
                    out[node.name] = rss
        return out

    def wait_converged(self, timeout: float) -> float | None:
        """Until every probe routes every simulated node's block (the routes tabby-node
        programs carry protocol 116): seconds, None on timeout."""
        t0 = now()
        want = len(self.sims)
        while now() - t0 < timeout:
            counts = []
            for node in self.lab.probes:
                out = self.lab.in_ns(
                    node.netns, "ip", "-4", "route", "show", "proto", "116", "dev", "vxlan.tabby"
                ).stdout
                counts.append(sum(1 for line in out.splitlines() if "/26" in line))
            if min(counts) >= want:
                return now() - t0
            time.sleep(1.0)
        return None

    def cni_calls(self, count: int) -> dict[str, Any]:
        """ADD and DEL of ``count`` pods on the first probe, through its tabby-node: the CPU
        tabby-node spends per call (the serving node's cost)."""
        lab = self.lab
        node = lab.probes[0]
        assert node.agent is not None
        pid = node.agent.pid
        adds: list[float] = []
        dels: list[float] = []
        walls: list[float] = []
        for i in range(count):
            pod = lab.new_pod(node, "bench-cni", f"cni-{secrets.token_hex(3)}-{i}")
            c0, t0 = proc_cpu(pid), now()
            rc, out = lab.cni(node, "ADD", pod)
            c1, t1 = proc_cpu(pid), now()
            if rc != 0 or out is None:
                raise BenchError(f"ADD on {node.name} failed: {out}")
            pod.result = out
            time.sleep(0.3)  # the watch echo of its own writes arrives
            c2 = proc_cpu(pid)
            lab.del_pod(pod)
            c3 = proc_cpu(pid)
            time.sleep(0.3)
            c4 = proc_cpu(pid)
            if None in (c0, c1, c2, c3, c4):
                raise BenchError(f"tabby-node on {node.name} is gone")
            adds.append((c2 - c0) * 1000)  # type: ignore[operator]
            dels.append((c4 - c2) * 1000)  # type: ignore[operator]
            walls.append((t1 - t0) * 1000)
        return {
            "add_cpu_ms": percentile(adds, 50),
            "del_cpu_ms": percentile(dels, 50),
            "add_wall_ms": percentile(walls, 50),
            "calls": count,
        }

    def baseline(self) -> dict[str, Any]:
        """The churn with no simulated node watching: etcd's CPU for the writes themselves
        (and the probes' few watches), subtracted from each engine's to get the cost of
        delivering events."""
        assert self.writer is not None
        args = self.args
        time.sleep(args.settle)
        a = self.snapshot()
        time.sleep(min(args.rest, 10))
        b = self.snapshot()
        log = self.writer.call(
            "churn",
            timeout=args.baseline * 10 + 600,
            rate=args.rate,
            duration=args.baseline,
            block_every=args.block_every,
            policy_every=args.policy_every,
        )
        time.sleep(2.0)
        c = self.snapshot()
        rest, churn = self.delta(a, b), self.delta(b, c)
        changes = sum(1 for o in log["ops"] if o["op"] in ("add", "del") and "error" not in o)
        e_rest, e_churn = rest["cpu"].get("etcd"), churn["cpu"].get("etcd")
        out: dict[str, Any] = {"changes": changes, "seconds": churn["seconds"]}
        if e_rest is not None and e_churn is not None and changes:
            out["etcd_ms_per_change"] = (
                max(e_churn - e_rest, 0.0) / 100 * churn["seconds"] / changes * 1000
            )
        echo(
            f"  baseline: {changes} pod changes with the probes alone, etcd "
            f"{wire.fmt(out.get('etcd_ms_per_change'), ' ms', 2)} CPU per change"
        )
        return out

    def churn(self) -> dict[str, Any]:
        assert self.writer is not None
        assert self.sim is not None
        args = self.args
        self.sim.call("arrivals")  # drop what arrived before
        a = self.snapshot()
        rss0 = self.probe_rss()
        log = self.writer.call(
            "churn",
            timeout=args.churn * 10 + 600,
            rate=args.rate,
            duration=args.churn,
            block_every=args.block_every,
            policy_every=args.policy_every,
        )
        time.sleep(2.0)  # the last writes' deliveries
        b = self.snapshot()
        arrivals = self.sim.call("arrivals", timeout=120)
        out = self.delta(a, b)
        out["rss_before"] = rss0
        out["rss"] = self.probe_rss()
        out["late_s"] = log["late_s"]
        pod_ops = [o for o in log["ops"] if o["op"] in ("add", "del") and "t1" in o]
        if pod_ops:
            span = max(o["t1"] for o in pod_ops) - log["t0"]
            out["achieved_rate"] = len(pod_ops) / span if span > 0 else None
        out["op_wall_ms"] = {
            k: (
                percentile(
                    [(o["t1"] - o["t0"]) * 1000 for o in log["ops"] if o["op"] == k and "t1" in o],
                    50,
                ),
                percentile(
                    [(o["t1"] - o["t0"]) * 1000 for o in log["ops"] if o["op"] == k and "t1" in o],
                    99,
                ),
            )
            for k in ("add", "del", "block", "policy")
        }
        ops = log["ops"]
        out["ops"] = {
            k: sum(1 for o in ops if o["op"] == k) for k in ("add", "del", "block", "policy")
        }
        out["errors"] = [o["error"] for o in ops if "error" in o][:5]
        out["op_lag_ms"] = percentile(
            [(o["t0"] - o["scheduled"]) * 1000 for o in ops if "t0" in o], 99
        )
        out.update(self.latencies(ops, log["writes"], arrivals, a["t"]))
        return out

    def latencies(
        self,
        ops: list[dict[str, Any]],
        writes: list[list[Any]],
        arrivals: dict[str, Any],
        since: float,
    ) -> dict[str, Any]:
        """write -> last watcher (per revision the writer made), write -> route on every
        probe (new blocks), policy change -> nft element on every probe, pod ADD -> its
        address in every probe's sets."""
        nodes = arrivals["nodes"]
        got = arrivals["arrivals"]
        last: list[float] = []
        partial = 0
        watched = 0
        per_kind: dict[str, list[float]] = {}
        wep_writes: dict[str, float] = {}
        for kind, key, _rev, t0 in writes:
            if kind == "workloadendpoint":
                wep_writes.setdefault(key, t0)
        seen: set[int] = set()
        for kind, _key, rev, t0 in writes:
            a = got.get(str(rev))
            if a is None or rev in seen:
                continue
            seen.add(rev)
            watched += 1
            if a[0] < nodes:
                partial += 1
                continue
            ms = (a[2] - t0) * 1000
            last.append(ms)
            per_kind.setdefault(kind, []).append(ms)
        out: dict[str, Any] = {
            "last_watcher_ms": (percentile(last, 50), percentile(last, 99)),
            "last_watcher_by_kind": {
                k: (percentile(v, 50), percentile(v, 99)) for k, v in per_kind.items()
            },
            "writes_watched": watched,
            "writes_not_everywhere": partial,
        }
        routes: list[float] = []
        routes_missing = 0
        policies: list[float] = []
        policies_missing = 0
        sets: list[float] = []
        sets_missing = 0
        for op in ops:
            if "error" in op or not op.get("writes"):
                continue
            if op["op"] == "block":
                t0 = min(w[3] for w in op["writes"] if w[0] == "block")
                pat = re.compile(rf"^{re.escape(op['block'])} ")
                ts = [m.first(pat, t0) for m in self.routes.values()]
                if None in ts:
                    routes_missing += 1
                else:
                    routes.append((max(ts) - t0) * 1000)  # type: ignore[type-var]
            elif op["op"] == "policy":
                t0 = min(w[3] for w in op["writes"] if w[0] == "networkpolicy")
                pat = re.compile(rf"add element .*{re.escape(op['cidr'])}")
                ts = [m.first(pat, t0) for m in self.nft.values()]
                if None in ts:
                    policies_missing += 1
                else:
                    policies.append((max(ts) - t0) * 1000)  # type: ignore[type-var]
            elif op["op"] == "add" and op.get("ips"):
                t0 = wep_writes.get(op.get("wep_key", ""))
                if t0 is None:
                    continue
                ip = re.escape(op["ips"][0])
                pat = re.compile(rf"add element .*[{{ ,]{ip}[ ,}}]")
                ts = [m.first(pat, t0) for m in self.nft.values()]
                if None in ts:
                    sets_missing += 1
                else:
                    sets.append((max(ts) - t0) * 1000)  # type: ignore[type-var]
        out["route_ms"] = (percentile(routes, 50), percentile(routes, 99))
        out["route_n"] = (len(routes), routes_missing)
        out["policy_ms"] = (percentile(policies, 50), percentile(policies, 99))
        out["policy_n"] = (len(policies), policies_missing)
        out["podset_ms"] = (percentile(sets, 50), percentile(sets, 99))
        out["podset_n"] = (len(sets), sets_missing)
        for m in (*self.routes.values(), *self.nft.values()):
            m.trim(since)
        return out

    # -- recovery --------------------------------------------------------------------------------

    def recovery(self, scenario: str) -> dict[str, Any]:
        """etcd restarted (SIGTERM, started again on the same data); its history compacted
        while every watch runs; or an outage in which the history is compacted past every
        watcher's revision (etcd answers on a side port meanwhile: a marker written and
        compacted there). Then a marker write (a new block): back in sync is when every
        simulated node's streams are open again and it saw the marker (or started after
        it), and every probe routes the marker's block."""
        assert self.writer is not None
        assert self.sim is not None
        lab = self.lab
        resyncs0 = [probe_metric(lab, n, "tabby_datastore_watch_resyncs_total") for n in lab.probes]
        c0 = self.sim.call("counters")
        t_start = now()
        if scenario == "restart":
            lab.stop_etcd()
            lab.start_etcd()
        elif scenario == "compaction":
            self.writer.call("compact")
        else:
            lab.stop_etcd()
            lab.start_etcd(side=True)
            side = f"http://127.0.0.1:{SIDE_PORT}"
            self.writer.call("marker", endpoint=side, timeout=120)
            self.writer.call("compact", endpoint=side, timeout=120)
            lab.stop_etcd()
            lab.start_etcd()
        assert lab.etcd_proc is not None
        self.sampler.watch("etcd", lab.etcd_proc.pid)
        t_up = now()
        marker = self.writer.call("marker", timeout=300)
        block_writes = [w for w in marker.get("writes", []) if w[0] == "block"]
        if not block_writes:
            raise BenchError(f"the marker write failed: {marker.get('error')}")
        _kind, key, rev, _t = block_writes[-1]
        t_marker = block_writes[0][3]  # a probe may route the block after its first write
        self.sim.call("expect", key=key, rev=rev)
        pattern = re.compile(rf"^{re.escape(marker['block'])} ")
        deadline = t_up + self.args.sync_timeout
        probes_at: dict[str, float] = {}
        report: dict[str, Any] = {}
        while True:
            for name, m in self.routes.items():
                if name not in probes_at:
                    t = m.first(pattern, t_marker)
                    if t is not None:
                        probes_at[name] = t
            report = self.sim.call("sync_report", since=t_start)
            if (report["pending"] == 0 and len(probes_at) == len(self.routes)) or now() > deadline:
                break
            time.sleep(0.5)
        t_end = now()
        time.sleep(2.0)
        c1 = self.sim.call("counters")
        resyncs1 = [probe_metric(lab, n, "tabby_datastore_watch_resyncs_total") for n in lab.probes]
        sims = [t - t_up for t in report["synced"]]
        snaps = report["snapshot_times"]
        per_second: dict[int, int] = {}
        for t in snaps:
            per_second[int(t - t_start)] = per_second.get(int(t - t_start), 0) + 1
        probe_resyncs = sum(
            (b - a)
            for a, b in zip(resyncs0, resyncs1, strict=True)
            if a is not None and b is not None
        )
        return {
            "down_s": t_up - t_start,
            "sims_synced": len(sims),
            "sims_pending": report["pending"],
            "sims_sync_s": (percentile(sims, 50), max(sims) if sims else None),
            "probes_sync_s": max((t - t_up for t in probes_at.values()), default=None),
            "probes_pending": len(self.routes) - len(probes_at),
            "etcd_peak_pct": self.sampler.peak("etcd", t_start, t_end + 2.0),
            "sim_rereads": len(snaps),
            "rereads_max_per_s": max(per_second.values(), default=0),
            "probe_resyncs": probe_resyncs,
            "range_mb": (c1["range_bytes"] - c0["range_bytes"]) / 1e6,
            "streams_reopened": c1["streams_opened"] - c0["streams_opened"],
        }

    # -- everything for one engine -----------------------------------------------------------------

    def engine(self, engine: str, first: bool) -> dict[str, Any]:
        args = self.args
        res: dict[str, Any] = {"engine": engine, "load_start": loadavg()}
        if engine == "proxy":
            self.start_proxy()
        t0 = now()
        boot = self.start_sim(engine)
        res["boot"] = boot
        echo(
            f"  [{engine}] {boot['booted']} simulated nodes booted in {boot['boot_s']:.0f} s "
            f"({boot['streams_per_node'][1]} watch stream(s) each)"
        )
        if first:
            res["converged_s"] = self.wait_converged(args.converge_timeout)
            echo(f"  [{engine}] probes route every simulated node after {now() - t0:.0f} s")
        time.sleep(args.settle)
        a = self.snapshot()
        time.sleep(args.rest)
        b = self.snapshot()
        res["rest"] = self.delta(a, b)
        res["rest"]["rss"] = self.probe_rss()
        echo(f"  [{engine}] rest {args.rest:.0f} s measured (load {loadavg()})")
        if first and args.cni_calls:
            res["cni"] = self.cni_calls(args.cni_calls)
            time.sleep(args.settle)
        res["churn"] = self.churn()
        echo(f"  [{engine}] churn {args.churn:.0f} s measured (load {loadavg()})")
        res["recovery"] = {}
        if engine in args.recovery_engines:
            for scenario in args.recovery:
                time.sleep(args.settle)
                res["recovery"][scenario] = self.recovery(scenario)
                echo(f"  [{engine}] recovery after {scenario} measured (load {loadavg()})")
        res["load_end"] = loadavg()
        for name, pid in self.pids().items():
            if name.startswith("node-") or name in ("etcd", "proxy", "sim"):
                res.setdefault("hwm_mb", {})[name] = proc_mem(pid, "VmHWM")
        self.stop_sim()
        return res

    def run(self) -> dict[str, Any]:
        lab = self.lab
        try:
            with INTERRUPTS.installed():
                self.build()
                first = True
                for engine in self.args.engines:
                    self.results["engines"][engine] = self.engine(engine, first)
                    report(self.args, self.results, engine)
                    first = False
        finally:
            self.sampler.stop.set()
            with contextlib.suppress(Exception):
                self.stop_sim()
            if self.writer is not None:
                with contextlib.suppress(Exception):
                    self.writer.stop()
            if self.args.keep_logs:
                keep_logs(lab, self.args.keep_logs, self.size)
            t0 = now()
            problems = lab.teardown()
            echo(f"  lab removed in {now() - t0:.1f} s" + (f": {problems}" if problems else ""))
        return self.results


def _listening(netns: str, port: int) -> bool:
    """Whether 127.0.0.1:``port`` accepts a connection inside ``netns``."""
    result: list[bool] = []

    def work() -> None:
        from dataplane.netns import setns

        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(fd)
        finally:
            os.close(fd)
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                result.append(True)
        except OSError:
            result.append(False)

    t = threading.Thread(target=work, daemon=True)
    t.start()
    t.join(5)
    return bool(result and result[0])


def keep_logs(lab: Lab, dest: str, size: int) -> None:
    target = os.path.join(dest, f"n{size}")
    os.makedirs(target, exist_ok=True)
    for root, _dirs, files in os.walk(lab.workdir):
        for name in files:
            if name.endswith((".log", ".err")):
                src = os.path.join(root, name)
                rel = os.path.relpath(src, lab.workdir).replace(os.sep, "_")
                with contextlib.suppress(OSError):
                    shutil.copyfile(src, os.path.join(target, rel))


# == the table =====================================================================================


def per_s(count: float, seconds: float) -> float:
    return count / seconds if seconds else 0.0


def derived(results: dict[str, Any], engine: str) -> dict[str, Any]:
    """The numbers the tables show, computed from one (size, engine)'s measurements."""
    sims = max(results["sims"], 1)
    res = results["engines"][engine]
    rest, churn = res["rest"], res["churn"]
    probe_names = [n for n in churn["cpu"] if n.startswith("node-")]
    d: dict[str, Any] = {}
    d["rest_events"] = sum(rest.get("events", {}).values())
    d["rest_per_node_s"] = per_s(d["rest_events"], rest["seconds"]) / sims
    deliveries = sum(churn.get("events", {}).values())
    d["deliveries"] = deliveries
    d["deliveries_s"] = per_s(deliveries, churn["seconds"])
    d["churn_per_node_s"] = d["deliveries_s"] / sims
    changes = churn["ops"]["add"] + churn["ops"]["del"]
    d["events_per_change"] = deliveries / sims / changes if changes else None
    d["rate"] = churn.get("achieved_rate")
    e_rest, e_churn = rest["cpu"].get("etcd"), churn["cpu"].get("etcd")
    d["etcd_rest"], d["etcd_churn"] = e_rest, e_churn
    d["etcd_us"] = None
    d["n_at_1_core"] = None
    base = (results.get("baseline") or {}).get("etcd_ms_per_change")
    d["etcd_write_ms"] = base
    d["proxy_us"] = None
    p_rest, p_churn = rest["cpu"].get("proxy"), churn["cpu"].get("proxy")
    if engine == "proxy" and p_rest is not None and p_churn is not None and deliveries:
        # through grpc-proxy etcd sends each event once (to the proxy): what grows with
        # the watchers is the proxy's CPU, and one core of it is full at this N
        us = max(p_churn - p_rest, 0.0) / 100 * churn["seconds"] / deliveries * 1e6
        d["proxy_us"] = us
        if us > 0 and d["events_per_change"]:
            d["n_at_1_core"] = 1e6 / (us * d["events_per_change"] * 20)
    elif e_churn is not None and e_rest is not None and deliveries:
        cpu = max(e_churn - e_rest, 0.0) / 100 * churn["seconds"]
        if base is not None:
            cpu = max(cpu - base / 1000 * changes, 0.0)  # the writes' own cost
        us = cpu / deliveries * 1e6
        d["etcd_us"] = us
        if us > 0 and d["events_per_change"]:
            # at 20 pod changes/s etcd is full when the writes (20 x base) and the
            # deliveries (N x events per change x 20 x us) take one second a second
            left = 1.0 - 20 * (base or 0.0) / 1000
            d["n_at_1_core"] = max(left, 0.0) * 1e6 / (us * d["events_per_change"] * 20)
    pr = [rest["cpu"][n] for n in probe_names if n in rest["cpu"]]
    pc = [churn["cpu"][n] for n in probe_names if n in churn["cpu"]]
    d["probe_rest"] = max(pr, default=None)
    d["probe_churn"] = max(pc, default=None)
    d["probe_ms_per_event"] = d["probe_ms_per_change"] = None
    # events per node as the simulated nodes counted them: short of what the probes got
    # when the simulator falls behind (then the per-event figure is an upper bound, and
    # the per-change one, which needs no count of events, is the one to read)
    per_node = deliveries / sims
    if pr and pc and per_node:
        net = (sum(pc) / len(pc) - sum(pr) / len(pr)) / 100 * churn["seconds"]
        d["probe_ms_per_event"] = net / per_node * 1000
        if changes:
            d["probe_ms_per_change"] = net / changes * 1000
    d["probe_rss"] = max((churn.get("rss") or {}).values(), default=None)
    return d


def report(args: argparse.Namespace, results: dict[str, Any], engine: str) -> None:
    """The table of one (size, engine), the issue's targets next to the numbers."""
    size, sims = results["size"], results["sims"]
    res = results["engines"][engine]
    rest, churn = res["rest"], res["churn"]
    d = derived(results, engine)
    f = wire.fmt
    rows: list[list[str]] = []

    def row(what: str, value: str, target: str = "") -> None:
        rows.append([what, value, target])

    def kinds(events: dict[str, int], seconds: float) -> str:
        per_node = {k: per_s(v, seconds) / max(sims, 1) for k, v in events.items()}
        return ", ".join(f"{k} {v:.2f}" for k, v in sorted(per_node.items(), key=lambda x: -x[1]))

    row("watch events/s per node at rest", f"{d['rest_per_node_s']:.2f}", TARGETS["rest_events"])
    if rest.get("events"):
        row("  by kind", kinds(rest["events"], rest["seconds"]))
    row(
        "pod changes/s (target rate)",
        f"{f(d['rate'], '', 1)} ({args.rate:g}), writer lag p99 {f(churn['op_lag_ms'], ' ms', 0)}",
    )
    row(
        "watch events/s per node under churn",
        f"{d['churn_per_node_s']:.2f}, {f(d['events_per_change'], '', 2)} per pod change",
    )
    row("  by kind", kinds(churn.get("events", {}), churn["seconds"]))
    row("deliveries/s to the simulated nodes", f"{d['deliveries_s']:.0f}")
    row("etcd CPU at rest", f(d["etcd_rest"], " %"))
    if engine == "proxy":
        row(
            "etcd CPU under churn",
            f"{f(d['etcd_churn'], ' %')} (every event sent once, to the proxy; "
            f"{f(d['etcd_write_ms'], ' ms', 2)} per pod change without watchers)",
            TARGETS["etcd_churn"],
        )
        row(
            "grpc-proxy CPU rest / churn",
            f"{f(rest['cpu'].get('proxy'), ' %')} / {f(churn['cpu'].get('proxy'), ' %')}: "
            f"{f(d['proxy_us'], ' us', 0)} per delivered event",
        )
        row("  one proxy core full of deliveries at N =", f(d["n_at_1_core"], "", 0))
    else:
        row(
            "etcd CPU under churn",
            f"{f(d['etcd_churn'], ' %')}: {f(d['etcd_write_ms'], ' ms', 2)} per pod change "
            f"(without watchers) + {f(d['etcd_us'], ' us', 0)} per delivered event",
            TARGETS["etcd_churn"],
        )
        row("  one etcd core full of deliveries at N =", f(d["n_at_1_core"], "", 0))
    sim_churn = churn.get("sim_cpu")
    row(
        "simulator CPU rest / churn",
        f"{f(rest.get('sim_cpu'), ' %')} / {f(sim_churn, ' %')}"
        + ("  (reader-bound: lower bounds)" if (sim_churn or 0) > 85 else ""),
    )
    p50, p99 = churn["last_watcher_ms"]
    missed = churn["writes_not_everywhere"]
    row(
        "write -> last watcher p50 / p99",
        f"{f(p50, ' ms', 0)} / {f(p99, ' ms', 0)}"
        + (f" ({missed} of {churn['writes_watched']} writes not everywhere)" if missed else ""),
    )
    row(
        "probe CPU per remote event",
        f"{f(d['probe_ms_per_event'], ' ms', 2)} (net of rest; probes {f(d['probe_churn'], ' %')}"
        f"; {f(d['probe_ms_per_change'], ' ms', 2)} per pod change anywhere)",
        TARGETS["probe_event_ms"],
    )
    row("probe CPU at rest", f(d["probe_rest"], " %", 2), TARGETS["probe_rest"])
    row("probe RSS", f(d["probe_rss"], " MB"), TARGETS["probe_rss"])
    for label, key, nkey, target in (
        ("write -> route, every probe p50 / p99", "route_ms", "route_n", TARGETS["route_p99"]),
        ("policy -> enforced, every probe", "policy_ms", "policy_n", TARGETS["policy_p99"]),
        ("pod ADD -> in every probe's sets", "podset_ms", "podset_n", ""),
    ):
        a, b = churn[key]
        n, missing = churn[nkey]
        never = f", {missing} never" if missing else ""
        row(label, f"{f(a, ' ms', 0)} / {f(b, ' ms', 0)} (n={n}{never})", target)
    if "cni" in res:
        cni = res["cni"]
        row(
            "CNI ADD served by a probe: CPU, wall",
            f"{f(cni['add_cpu_ms'], ' ms')}, {f(cni['add_wall_ms'], ' ms', 0)} "
            f"(DEL CPU {f(cni['del_cpu_ms'], ' ms')})",
            TARGETS["cni_cpu"],
        )
    if churn.get("errors"):
        row("writer errors", "; ".join(churn["errors"])[:120])
    for scenario, rec in res.get("recovery", {}).items():
        sims_p50, sims_max = rec["sims_sync_s"]
        pending = ""
        if rec["sims_pending"] or rec["probes_pending"]:
            pending = (
                f"; NOT in sync after {args.sync_timeout:.0f} s: "
                f"{rec['sims_pending']} sims, {rec['probes_pending']} probes"
            )
        row(
            f"{scenario}: back in sync, sims p50/max, probes",
            f"{f(sims_p50, ' s')} / {f(sims_max, ' s')}, {f(rec['probes_sync_s'], ' s')} "
            f"(etcd away {rec['down_s']:.1f} s){pending}",
            TARGETS["sync"],
        )
        row(
            f"{scenario}: etcd peak CPU, full re-reads",
            f"{f(rec['etcd_peak_pct'], ' %', 0)}; sims {rec['sim_rereads']} "
            f"(at most {rec['rereads_max_per_s']} in one second, {rec['range_mb']:.0f} MB), "
            f"probes {rec['probe_resyncs']:.0f}",
        )
    echo()
    echo(
        f"scale_bench N={size}: {sims} simulated nodes + {args.probes} probes, "
        f"{args.pods_per_node} pods per node, "
        f"{'Kubernetes' if args.kubernetes else 'plain CNI'} mode; engine {engine}; "
        f"load {res['load_start']} -> {res['load_end']}"
    )
    echo(wire.table(rows, ["", "measured", "target"]))
    echo()


def summary(args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    """One line per (N, engine): the numbers that decide where direct watches stop."""
    f = wire.fmt
    rows = []
    for r in runs:
        for engine, res in r["engines"].items():
            d = derived(r, engine)
            churn = res["churn"]
            rec = res.get("recovery", {})
            sync = [x["sims_sync_s"][1] for x in rec.values() if x["sims_sync_s"][1] is not None]
            rows.append(
                [
                    str(r["size"]),
                    engine,
                    f(d["rate"], "", 1),
                    f"{d['deliveries_s']:.0f}",
                    f(d["etcd_churn"], " %", 0),
                    f(churn["cpu"].get("proxy"), " %", 0) if engine == "proxy" else "-",
                    f(d["proxy_us"] if engine == "proxy" else d["etcd_us"], "", 0),
                    f(d["n_at_1_core"], "", 0),
                    f(churn["last_watcher_ms"][1], "", 0),
                    f(d["probe_ms_per_event"], "", 2),
                    f(churn["route_ms"][1], "", 0),
                    f(churn["policy_ms"][1], "", 0),
                    f(max(sync), "", 1) if sync else "-",
                    f(churn.get("sim_cpu"), " %", 0),
                ]
            )
    echo("summary (targets: etcd <= 1 core at N=1000, p99s <= 1000 ms, probe <= 2 ms per event):")
    echo(
        wire.table(
            rows,
            [
                "N",
                "engine",
                "changes/s",
                "deliveries/s",
                "etcd",
                "proxy",
                "us/delivery (etcd; proxy)",
                "N at 1 core",
                "last watcher p99 ms",
                "probe ms/event",
                "route p99 ms",
                "policy p99 ms",
                "resync max s",
                "simulator",
            ],
        )
    )


# == main ==========================================================================================


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="tabby's control plane at 100-1000 nodes: real etcd, real tabby-node "
        "probes, simulated nodes (see bench/README.md)"
    )
    ap.add_argument("--sizes", default="100,300", help="cluster sizes N, probes included (100,300)")
    ap.add_argument("--probes", type=int, default=3, help="real tabby-nodes (3)")
    ap.add_argument("--pods-per-node", type=int, default=20, help="pods per simulated node (20)")
    ap.add_argument("--namespaces", type=int, default=50, help="pod namespaces (50)")
    ap.add_argument(
        "--populate",
        choices=("cni", "bulk"),
        default="cni",
        help="how the simulated nodes' documents are written: through the CNI handlers, one "
        "pod at a time (cni), or made in memory by the same code and written in bulk "
        "transactions (bulk: N=1000 in about a minute instead of 18)",
    )
    ap.add_argument(
        "--engines", default="gateway,grpc,proxy", help="fan-out of the simulated nodes' watches"
    )
    ap.add_argument(
        "--probe-watch",
        choices=("grpc", "gateway"),
        default="grpc",
        help="the probes' (real tabby-nodes') watch transport (tabby-node's default: grpc)",
    )
    ap.add_argument(
        "--recovery", default="restart,compaction,outage", help="recovery scenarios ('' none)"
    )
    ap.add_argument(
        "--recovery-engines", default="gateway", help="engines to run the recovery with (gateway)"
    )
    ap.add_argument("--rest", type=float, default=30, help="seconds at rest (30)")
    ap.add_argument("--churn", type=float, default=60, help="seconds of churn (60)")
    ap.add_argument("--rate", type=float, default=20, help="pod changes per second (20)")
    ap.add_argument("--block-every", type=float, default=5, help="a new block every S s (5)")
    ap.add_argument("--policy-every", type=float, default=10, help="a policy change every S s (10)")
    ap.add_argument("--sync-timeout", type=float, default=120, help="recovery: give up after S s")
    ap.add_argument("--converge-timeout", type=float, default=600, help="probes' first routes")
    ap.add_argument("--settle", type=float, default=5, help="quiet seconds between phases (5)")
    ap.add_argument("--cni-calls", type=int, default=10, help="ADD+DEL on a probe (10; 0 off)")
    ap.add_argument("--etcd-cpu", default="1", help="the CPU etcd is pinned to (1)")
    ap.add_argument("--etcd-disk", action="store_true", help="etcd's data on disk (default: tmpfs)")
    ap.add_argument(
        "--baseline",
        type=float,
        default=None,
        help="seconds of churn with the probes alone: etcd's cost of the writes (churn/3)",
    )
    ap.add_argument("--boot-rate", type=float, default=100, help="simulated nodes started per s")
    ap.add_argument("--lanes", type=int, default=16, help="the writer's concurrent lanes (16)")
    ap.add_argument(
        "--sim-listeners",
        type=int,
        default=1,
        help="etcd client listeners the simulated nodes are spread over (1; at most --lanes + 1)",
    )
    ap.add_argument(
        "--node-ttl", type=float, default=None, help="tabby-node's --node-ttl (its default)"
    )
    ap.add_argument(
        "--no-kubernetes",
        dest="kubernetes",
        action="store_false",
        help="no Pod mirror writes (a plain CNI cluster)",
    )
    ap.add_argument(
        "--binaries",
        choices=("installed", "checkout"),
        default="installed",
        help="the probes' tabby-node and the CNI binaries: the installed bundle "
        "(/usr/local/bin, /opt/cni/bin; ./build.sh) or this checkout's (.venv/bin)",
    )
    ap.add_argument("--quick", action="store_true", help="a smoke run: N=20, short phases")
    ap.add_argument("--json", metavar="FILE", help="also write every result as JSON")
    ap.add_argument("--keep-logs", metavar="DIR", help="copy every log here before teardown")
    record.add_argument(ap, "scale_bench")
    args = ap.parse_args(argv)
    if args.quick:
        args.sizes = "20"
        args.probes = min(args.probes, 2)
        args.pods_per_node = min(args.pods_per_node, 5)
        args.namespaces = min(args.namespaces, 5)
        args.rest, args.churn, args.settle = 5.0, 10.0, 2.0
        args.sync_timeout = min(args.sync_timeout, 60)
        args.cni_calls = min(args.cni_calls, 2)
    if args.baseline is None:
        args.baseline = args.churn / 3
    if args.binaries == "checkout":
        venv = Path(sys.executable).parent
        args.tabby_node, args.cni_bin = str(venv / "tabby-node"), str(venv)
    else:
        args.tabby_node = shutil.which("tabby-node") or "/usr/local/bin/tabby-node"
        args.cni_bin = "/opt/cni/bin"
    args.sizes = [int(x) for x in str(args.sizes).split(",") if x.strip()]
    args.engines = [x for x in args.engines.split(",") if x.strip()]
    args.recovery = [x for x in args.recovery.split(",") if x.strip()]
    args.recovery_engines = [x for x in args.recovery_engines.split(",") if x.strip()]
    if args.node_ttl is None:
        from tabby_node.options import NodeOptions

        args.node_ttl = NodeOptions.model_fields["node_ttl"].default
    bad = [e for e in args.engines + args.recovery_engines if e not in ENGINES]
    bad += [s for s in args.recovery if s not in SCENARIOS]
    if bad:
        ap.error(f"unknown engine or scenario: {', '.join(bad)}")
    for size in args.sizes:
        if size <= args.probes:
            ap.error(f"--sizes: {size} nodes leave no simulated node beside {args.probes} probes")
    return args


def preflight(args: argparse.Namespace) -> str | None:
    if os.geteuid() != 0:
        return "must run as root (network namespaces, etcd, tabby-node)"
    for tool in ("etcd", "taskset", "nft", "ip"):
        if shutil.which(tool) is None:
            return f"{tool} is missing"
    for binary in (args.tabby_node, os.path.join(args.cni_bin, "tabby")):
        if not os.access(binary, os.X_OK):
            return f"{binary} is missing: ./build.sh --no-demo (or --binaries checkout)"
    if any(e != "gateway" for e in args.engines):
        try:
            import grpc  # noqa: F401
        except ImportError:
            return (
                "the gRPC engines need grpcio: .venv/bin/pip install -e '.[bench]' "
                "(or --engines gateway)"
            )
    if int(args.etcd_cpu.split(",")[0].split("-")[0]) >= (os.cpu_count() or 1):
        return f"--etcd-cpu {args.etcd_cpu}: this machine has {os.cpu_count()} CPUs"
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    problem = preflight(args)
    if problem:
        print(f"scale_bench: {problem}", file=sys.stderr)
        return 2
    echo(
        f"scale_bench: {platform.node()}, {os.cpu_count()} CPUs, load {loadavg()}; sizes "
        f"{args.sizes}, engines {args.engines}, probes {args.tabby_node}"
    )
    runs = []
    code = 0
    try:
        for size in args.sizes:
            echo(f"== N = {size} ==")
            runs.append(Run(args, size).run())
    except KeyboardInterrupt:
        print("scale_bench: interrupted (everything was removed)", file=sys.stderr)
        code = 130
    except (BenchError, LabError) as e:
        print(f"scale_bench: {e}", file=sys.stderr)
        code = 1
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if runs:
        summary(args, runs)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"args": {k: v for k, v in vars(args).items()}, "runs": runs}, f, indent=1)
    return code


if __name__ == "__main__":
    sys.exit(record.run(main, "scale_bench"))
