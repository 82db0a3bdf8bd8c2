#!/usr/bin/env python3
"""Benchmark (not a test): CNI ADD/CHECK/DEL of tabby per datastore, each case interleaved
pod by pod against Debian's ptp + host-local by ``bench/cni/cni_bench.py`` (the runtime-faithful
harness; this script only prepares what each case needs and runs it).

Cases (``--cases``, comma-separated):

    node-file         tabby-node serves the calls; file store
    node-etcd1        tabby-node serves the calls; etcd, 1 member
    node-etcd3        tabby-node serves the calls; etcd, 3 members
    standalone-etcd1  no tabby-node (TABBY_NODE_SOCKET=off): every call opens etcd itself
    standalone-etcd3  the same against 3 members
    standalone-file   no tabby-node, file store

Per case: one network namespace is the node (``cni_bench --node-netns``); the etcd members
(``tests/etcd_cluster.py``: 127.0.0.1, free ports, private data dir) and tabby-node
(``--backend none``, its datastore flags pointing at the same store as the conflist, no
HTTP ports) are started inside it by a thread that entered it, so they share the plugins'
loopback and mount namespace, as on a node. The conflist is bench/cni/conf/tabby.conflist with
the case's datastore in its ``ipam`` section. Everything is stopped by PID and the namespace
and temp dir removed afterwards, also on Ctrl-C.

    .venv/bin/python -m bench.cni.datastore_cni_bench -n 100 --repeat 2
    .venv/bin/python -m bench.cni.datastore_cni_bench --table      # issue 21's table, one command
    .venv/bin/python -m bench.cni.datastore_cni_bench --cases node-etcd3 --mode concurrent -k 8
    .venv/bin/python -m bench.cni.datastore_cni_bench --throughput       # issue 32's table

``--throughput``: for each k of ``--ks`` (8,32), k pods started at once until all are
answered (pods/s of the ADD phase), ptp+host-local alone, then each case of ``--cases``
(default node-file,node-etcd1) alone, in the same run: tabby's rate over the reference's
(the target: >= 1.5), tabby-node's CPU per pod (ADD+CHECK+DEL, from its /proc stat), and
the load average after each run (the machine is shared).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from bench import record
from dataplane.netns import open_netns, run_in_netns
from tests.etcd_cluster import EtcdCluster
from tests.node_agent import agent_argv

ROOT = Path(__file__).resolve().parents[2]

T = TypeVar("T")
CONF = Path(__file__).resolve().parent / "conf"
REFERENCE = CONF / "ptp-host-local.conflist"
TABBY_CONF = CONF / "tabby.conflist"
CASES = (
    "node-file",
    "node-etcd1",
    "node-etcd3",
    "standalone-etcd1",
    "standalone-etcd3",
    "standalone-file",
)
DEFAULT_CASES = "node-file,node-etcd1,node-etcd3,standalone-etcd1"
NODENAME = "bench-node"
#: tabby-node's /metrics in the case's namespace (private: any port is free there)
METRICS_PORT = 9191
#: The phases of a served call tabby-node times (``cni_protocol.phases``), as the table
#: names them: the phases on the call's path (netlink and the endpoint are only their
#: waits: an ADD makes the veth pair beside the IPAM call and records the endpoint beside
#: the pair's configuration, a DEL releases the addresses beside the veth's deletion).
PHASE_COLUMNS = (
    ("ipam", "ipam"),
    ("netlink_wait", "nl"),
    ("endpoint_wait", "ep"),
    ("server", "srv"),
)
#: tabby-node's CPU per served call (ms, all its threads), the issue's targets.
CPU_TARGETS = {"ADD": 12.0, "DEL": 8.0}
#: ``--tabby-node checkout``: the program the checkout's tabby-node runs as
CHECKOUT_NODE = "from bundle.entry import main_node; main_node()"


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread that entered ``netns`` (children it forks start there)."""
    with open_netns(f"/run/netns/{netns}") as handle:
        return run_in_netns(handle.fd, fn)


class Case:
    """The node namespace, etcd and tabby-node of one case; ``close()`` removes them."""

    def __init__(self, name: str, tabby_node: str) -> None:
        self.name = name
        self.node = name.startswith("node-")
        self.members = int(name[-1]) if name.endswith(("etcd1", "etcd3")) else 0
        self.netns = f"tbdsb{os.getpid()}-{secrets.token_hex(3)}"
        self.workdir = tempfile.mkdtemp(prefix=f"tabby-dsbench-{os.getpid()}-")
        self.etcd: EtcdCluster | None = None
        self.agent: subprocess.Popen[bytes] | None = None
        self.socket = os.path.join(self.workdir, "run", "node.sock")
        self.prefix = f"/bench-{secrets.token_hex(4)}"
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        try:
            subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)
            if self.members:
                self.etcd = in_netns(self.netns, lambda: EtcdCluster(self.members))
            if self.node:
                self._start_agent(tabby_node)
        except BaseException:
            self.close()
            raise

    def ipam(self) -> dict[str, Any]:
        if self.etcd is not None:
            return {
                "datastore_type": "etcdv3",
                "etcd_endpoints": self.etcd.endpoints,
                "etcd_prefix": self.prefix,
            }
        return {"datastore_type": "file", "data_dir": os.path.join(self.workdir, "store")}

    def datastore_flags(self) -> list[str]:
        ipam = self.ipam()
        if self.etcd is not None:
            return [
                *("--datastore-type", "etcdv3"),
                *("--etcd-endpoints", ",".join(ipam["etcd_endpoints"])),
                *("--etcd-prefix", ipam["etcd_prefix"]),
            ]
        return ["--datastore-type", "file", "--data-dir", ipam["data_dir"]]

    def _start_agent(self, binary: str) -> None:
        # "checkout": this checkout's tabby-node, run from source by this interpreter (the
        # plugins stay the installed ones: through tabby-node they only forward the call)
        program = [sys.executable, "-c", CHECKOUT_NODE] if binary == "checkout" else [binary]
        extra = {"PYTHONPATH": str(ROOT)} if binary == "checkout" else {}
        argv = agent_argv(
            program, self.workdir, self.socket, os.path.join(self.workdir, "node.log"), NODENAME
        )
        argv += self.datastore_flags()  # after agent_argv's --data-dir: these win
        argv += ["--metrics-port", str(METRICS_PORT)]  # after agent_argv's 0: this wins
        os.makedirs(os.path.dirname(self.socket), mode=0o700, exist_ok=True)
        err = open(os.path.join(self.workdir, "node.err"), "wb")  # noqa: SIM115
        try:
            self.agent = in_netns(
                self.netns,
                lambda: subprocess.Popen(
                    argv,
                    stdin=subprocess.DEVNULL,
                    stdout=err,
                    stderr=err,
                    start_new_session=True,
                    env={**os.environ, "TABBY_CONFIG_CACHE": self.cache(), **extra},
                ),
            )
        finally:
            err.close()
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.agent.poll() is not None or time.monotonic() > deadline:
                tail = Path(self.workdir, "node.err").read_text(errors="replace")[-800:]
                raise RuntimeError(f"tabby-node did not start: {tail}")
            time.sleep(0.05)

    def conflist(self) -> str:
        doc = json.loads(TABBY_CONF.read_text())
        plugin = doc["plugins"][0]
        plugin["nodename"] = NODENAME
        plugin["log_file_path"] = os.path.join(self.workdir, "cni.log")
        plugin["ipam"].pop("data_dir", None)
        plugin["ipam"].update(self.ipam())
        path = os.path.join(self.workdir, f"{self.name}.conflist")
        Path(path).write_text(json.dumps(doc, indent=2))
        return path

    def cache(self) -> str:
        """Where the case's calls (and its tabby-node) keep validated configurations
        (``cni_config.known``): the case's own, filled by its first calls (the warm-up)."""
        return os.path.join(self.workdir, "config-cache")

    def env(self) -> list[str]:
        return [
            f"TABBY_NODE_SOCKET={self.socket if self.node else 'off'}",
            f"TABBY_CONFIG_CACHE={self.cache()}",
        ]

    def close(self) -> None:
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C: still clean up
        try:
            self._close()
        finally:
            signal.signal(signal.SIGINT, old)

    def _close(self) -> None:
        if self.agent is not None and self.agent.poll() is None:
            self.agent.send_signal(signal.SIGTERM)
            try:
                self.agent.wait(30)
            except subprocess.TimeoutExpired:
                self.agent.kill()
                self.agent.wait()
        if self.etcd is not None:
            self.etcd.stop()
        subprocess.run(["ip", "netns", "delete", self.netns], check=False, capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


def node_calls(case: Case) -> dict[str, dict[str, float]]:
    """What tabby-node says of the calls it served so far, per verb (its /metrics): ``n``
    calls, ``cpu`` ms of its CPU per call, and per phase (``PHASE_COLUMNS``) the mean ms
    (each only when tabby-node exports it).
    Empty without tabby-node (standalone cases)."""
    if case.agent is None:
        return {}
    import urllib.request

    def scrape() -> str:
        url = f"http://127.0.0.1:{METRICS_PORT}/metrics"
        with urllib.request.urlopen(url, timeout=10) as resp:
            return str(resp.read().decode())

    return parse_node_calls(in_netns(case.netns, scrape))


def parse_node_calls(text: str) -> dict[str, dict[str, float]]:
    """:func:`node_calls` from tabby-node's Prometheus text."""
    from prometheus_client.parser import text_string_to_metric_families

    count: dict[str, float] = {}
    cpu: dict[str, float] = {}
    phase_sum: dict[tuple[str, str], float] = {}
    phase_n: dict[tuple[str, str], float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            verb = sample.labels.get("verb", "")
            if sample.name == "tabby_cni_requests_total":
                count[verb] = count.get(verb, 0.0) + sample.value
            elif sample.name == "tabby_cni_cpu_seconds_total":
                cpu[verb] = sample.value
            elif sample.name == "tabby_cni_phase_duration_seconds_sum":
                phase_sum[verb, sample.labels["phase"]] = sample.value
            elif sample.name == "tabby_cni_phase_duration_seconds_count":
                phase_n[verb, sample.labels["phase"]] = sample.value
    out: dict[str, dict[str, float]] = {}
    for verb, n in count.items():
        if not n:
            continue
        row = {"n": n}
        if verb in cpu:  # a tabby-node without the counter (an older one): no number
            row["cpu"] = cpu[verb] * 1000 / n
        for phase, _ in PHASE_COLUMNS:
            if phase_n.get((verb, phase)):
                row[phase] = phase_sum[verb, phase] * 1000 / phase_n[verb, phase]
        out[verb] = row
    return out


def etcd_requests(case: Case) -> dict[str, float]:
    """etcd's gRPC requests handled so far, by method, summed over the members (its
    ``/metrics``: the JSON gateway's calls pass through gRPC too). Empty without etcd."""
    if case.etcd is None:
        return {}
    import urllib.request

    def scrape() -> dict[str, float]:
        out: dict[str, float] = {}
        assert case.etcd is not None
        for url in case.etcd.endpoints:
            with urllib.request.urlopen(f"{url}/metrics", timeout=10) as resp:  # noqa: S310
                text = resp.read().decode()
            for line in text.splitlines():
                if not line.startswith("grpc_server_handled_total{"):
                    continue
                labels, _, value = line.rpartition(" ")
                method = labels.split('grpc_method="', 1)[1].split('"', 1)[0]
                out[method] = out.get(method, 0.0) + float(value)
        return out

    return in_netns(case.netns, scrape)


@contextlib.contextmanager
def case_env(name: str, tabby_node: str) -> Iterator[Case]:
    case = Case(name, tabby_node)
    try:
        yield case
    finally:
        case.close()


def run_case(
    case: Case | None,
    args: argparse.Namespace,
    keep: str | None,
    *,
    mode: str | None = None,
    alone: bool = False,
    floor: str | None = None,
) -> dict[str, Any]:
    """One cni_bench run: the case interleaved with ptp+host-local (``alone``: the case by
    itself; no case: ptp+host-local by itself, in a namespace of cni_bench's own)."""
    workdir = case.workdir if case is not None else tempfile.mkdtemp(prefix="tabby-dsbench-")
    out = os.path.join(workdir, "report.json")
    name = case.name if case is not None else "ptp"
    argv = [sys.executable, "-m", "bench.cni.cni_bench"]
    if case is None:
        argv += ["--conf", str(REFERENCE), "--cni-path", args.ref_cni_path, "--label-a", "ptp"]
    elif alone:
        argv += ["--conf", case.conflist(), "--cni-path", args.cni_path, "--label-a", name]
    else:
        argv += [
            *("--conf", str(REFERENCE), "--cni-path", args.ref_cni_path),
            *("--compare", case.conflist(), "--cni-path-b", args.cni_path),
            *("--label-a", "ptp", "--label-b", name),
        ]
    argv += [
        *("-n", str(args.pods), "--warmup", str(args.warmup)),
        *("--mode", mode or args.mode, "-k", str(args.k)),
        *("--output", out, "-q"),
    ]
    if case is not None:
        argv += ["--node-netns", case.netns]
        for assignment in case.env():
            argv += ["--env", assignment]
    if floor:
        argv += ["--client-floor", floor]
    try:
        return _cni_bench(argv, out, name, args, keep)
    finally:
        if case is None:
            shutil.rmtree(workdir, ignore_errors=True)


def _cni_bench(
    argv: list[str], out: str, name: str, args: argparse.Namespace, keep: str | None
) -> dict[str, Any]:
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=ROOT)
    try:
        text, _ = proc.communicate()
    except BaseException:  # Ctrl-C: cni_bench got it too and cleans up; wait for it
        with contextlib.suppress(BaseException):
            proc.wait(120)
        raise
    if args.verbose:
        print(text.decode(errors="replace"))
    try:
        report: dict[str, Any] = json.loads(Path(out).read_text())
    except (OSError, ValueError) as e:
        raise RuntimeError(f"cni_bench gave no report ({e}): {text.decode()[-1500:]}") from None
    if keep:
        shutil.copy(out, os.path.join(keep, f"{name}-{int(time.time())}.json"))
    report["exit_status"] = proc.returncode
    return report


def row(report: dict[str, Any], case: str) -> dict[str, Any]:
    stats, cmp_ = report["stats"], (report.get("compare") or {}).get("verbs", {})
    out: dict[str, Any] = {
        "failures": len(report.get("failures") or []),
        "phases": {p["verb"]: p["calls_per_s"] for p in report.get("phases", [])},
    }
    for verb in ("ADD", "CHECK", "DEL"):
        a, b = stats.get("ptp", {}).get(verb), stats.get(case, {}).get(verb)
        if not a or not b:
            continue
        out[verb] = {
            "ref_p50": a["p50"],
            "p50": b["p50"],
            "p90": b["p90"],
            "cpu_p50": b["cpu_p50"],
            "p50_ratio": cmp_.get(verb, {}).get("p50_ratio"),
            "paired": cmp_.get(verb, {}).get("paired_median"),
        }
    return out


def fmt(v: float | None, digits: int = 1) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# -- issue 21's table: every path in one command ------------------------------------------------

#: (case, the path as the table names it, the targets per verb: p50 over ptp+host-local's;
#: issue 21's, with issue 32's for the file store and etcd of 1 member)
TABLE_ROWS: list[tuple[str, str, dict[str, float]]] = [
    ("node-file", "through tabby-node, file store", {"ADD": 2.0, "CHECK": 2.0, "DEL": 1.2}),
    ("node-etcd1", "through tabby-node, etcd 1 member", {"ADD": 2.2, "DEL": 1.3}),
    ("node-etcd3", "through tabby-node, etcd 3 members", {"ADD": 2.3, "DEL": 1.3}),
    ("standalone-file", "standalone, file store", {"ADD": 10.0, "CHECK": 10.0, "DEL": 10.0}),
]
#: Cases whose throughput is measured: 8 ADDs at a time, against ptp+host-local's rate.
TABLE_CONCURRENT = ("node-file", "node-etcd1")
RATE_TARGET = 0.7


def floor_text(report: dict[str, Any]) -> str:
    floor = report.get("client_floor") or {}
    if floor.get("wall_ms_p50") is None:
        return "-"
    return f"{floor['wall_ms_p50']:.1f}/{floor['cpu_ms_p50']:.1f}"


def table(args: argparse.Namespace) -> int:
    """Issue 21's table: each path one interleaved run against ptp+host-local (sequential),
    then 8 concurrent ADDs of ptp+host-local alone and of each TABLE_CONCURRENT case alone;
    the client floor (a frozen Python process that does nothing) measured in every run."""
    floor: str | None = None
    if not args.no_client_floor:
        from bench.cni.client_floor import build

        floor = build()
    print(
        f"datastore_cni_bench --table: {args.pods} pods per config, p50 ms (x: over "
        f"ptp+host-local's p50 in the same run; paired: median of pod-by-pod ratios); "
        f"node cpu: tabby-node's CPU per served call, ms (all its threads; target "
        f"ADD <= {CPU_TARGETS['ADD']:.0f}, DEL <= {CPU_TARGETS['DEL']:.0f}); ipam, nl "
        f"(the kernel side: what the call waited of it), ep (the endpoint and its policy: "
        f"what the call waited of it), srv "
        f"(tabby-node's own work: framing, namespace entry, hand-offs, parsing): mean ms "
        f"of the served call, from tabby-node's metrics; floor: the client floor, wall/cpu "
        f"p50 ms (a frozen Python process that does nothing); load at the end of each run",
        flush=True,
    )
    head = (
        f"{'path':35} {'verb':5} {'ptp':>6} {'tabby':>7} {'x':>6} {'paired':>6} "
        f"{'target':>7} {'met':>3} {'node cpu':>10} "
        + " ".join(f"{label:>5}" for _, label in PHASE_COLUMNS)
        + f" {'floor':>9} {'load':>5}"
    )
    print(head, flush=True)
    failures = 0
    for name, path, targets in TABLE_ROWS:
        with case_env(name, args.tabby_node) as case:
            cpu0 = agent_cpu_s(case)
            report = run_case(case, args, args.keep, mode="sequential", floor=floor)
            served = node_calls(case)
            cpu1 = agent_cpu_s(case)
        failures += len(report.get("failures") or [])
        r, load = row(report, name), os.getloadavg()[0]
        for verb in ("ADD", "CHECK", "DEL"):
            v = r.get(verb)
            if v is None:
                continue
            target = targets.get(verb)
            ratio = v["p50_ratio"]
            met = "-" if target is None or ratio is None else ("yes" if ratio <= target else "no")
            print(
                f"{path:35} {verb:5} {fmt(v['ref_p50']):>6} {fmt(v['p50']):>7} "
                f"{fmt(ratio, 2) + 'x':>6} {fmt(v['paired'], 2):>6} "
                f"{'<= ' + fmt(target, 1) if target else '':>7} {met:>3} "
                f"{cpu_text(served.get(verb), verb):>10} "
                + " ".join(f"{fmt((served.get(verb) or {}).get(p)):>5}" for p, _ in PHASE_COLUMNS)
                + f" {floor_text(report):>9} {load:5.2f}",
                flush=True,
            )
        calls = sum(v["n"] for v in served.values())
        if cpu0 is not None and cpu1 is not None and calls:
            per_call = (cpu1 - cpu0) * 1000 / calls
            print(
                f"{path:35} tabby-node's CPU over the whole run (/proc/<pid>/stat, its idle "
                f"work included): {per_call:.1f} ms per call served ({calls:.0f} calls)",
                flush=True,
            )
    reference = run_case(None, args, args.keep, mode="concurrent", floor=floor)
    failures += len(reference.get("failures") or [])
    ref_rate = phase_rate(reference, "ADD")
    print(
        f"{'8 concurrent ADDs, ptp+host-local':35} {'ADD':5} {fmt(ref_rate, 0):>6} calls/s"
        f"{'':25} {floor_text(reference):>9} {os.getloadavg()[0]:5.2f}",
        flush=True,
    )
    for name in TABLE_CONCURRENT:
        with case_env(name, args.tabby_node) as case:
            report = run_case(case, args, args.keep, mode="concurrent", alone=True, floor=floor)
        failures += len(report.get("failures") or [])
        rate = phase_rate(report, "ADD")
        share = rate / ref_rate if rate and ref_rate else None
        met = "-" if share is None else ("yes" if share >= RATE_TARGET else "no")
        print(
            f"{'8 concurrent ADDs, ' + name:35} {'ADD':5} {fmt(rate, 0):>6} calls/s "
            f"{fmt(share, 2) + ' of ptp':>10} {'>= ' + fmt(RATE_TARGET, 1):>7} {met:>3} "
            f"{floor_text(report):>9} {os.getloadavg()[0]:5.2f}",
            flush=True,
        )
    if failures:
        print(f"{failures} failed call(s) or check(s): see --keep", flush=True)
    return 1 if failures else 0


def cpu_text(served: dict[str, float] | None, verb: str) -> str:
    """tabby-node's CPU per call of ``verb`` and whether it meets its target."""
    if not served or "cpu" not in served:
        return "-"
    target = CPU_TARGETS.get(verb)
    met = "" if target is None else (" ok" if served["cpu"] <= target else " no")
    return f"{served['cpu']:.1f}{met}"


# -- issue 32's table: k ADDs at once, pods/s against the reference --------------------------

THROUGHPUT_CASES = "node-file,node-etcd1"
THROUGHPUT_TARGET = 1.5


def agent_cpu_s(case: Case) -> float | None:
    """tabby-node's CPU seconds so far (user + system, its /proc stat); None without one."""
    if case.agent is None:
        return None
    try:
        fields = Path(f"/proc/{case.agent.pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_cpu() -> tuple[float, float]:
    """(busy, total) jiffies of all CPUs so far (/proc/stat's first line; busy: all but
    idle and iowait)."""
    fields = [int(v) for v in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    total = float(sum(fields))
    return total - fields[3] - fields[4], total


def busy_share(before: tuple[float, float], after: tuple[float, float]) -> float | None:
    """The share of the machine's CPU time that was busy between two :func:`machine_cpu`."""
    total = after[1] - before[1]
    return (after[0] - before[0]) / total if total > 0 else None


def busy_text(busy: float | None) -> str:
    return "-" if busy is None else f"{busy * 100:.0f}%"


def client_cpu(report: dict[str, Any], label: str) -> float | None:
    """The CPU p50 of ``label``'s ADD processes (cni_bench: wait4's rusage of the plugin
    processes of one pod's ADD)."""
    add = (report.get("stats") or {}).get(label, {}).get("ADD") or {}
    cpu: float | None = add.get("cpu_p50")
    return cpu


def throughput(args: argparse.Namespace, cases: list[str]) -> int:
    """Issue 32's table: per k, the reference alone, then each case alone, k at once."""
    ks = [int(k) for k in args.ks.split(",") if k.strip()]
    print(
        f"datastore_cni_bench --throughput: {args.pods} pods per run, k started at once until "
        f"all are answered (pods/s of the ADD phase); x: tabby's rate over ptp+host-local's "
        f"(target >= {THROUGHPUT_TARGET}); client cpu: CPU ms of one pod's ADD processes "
        f"(p50: ptp and host-local, or the tabby plugin forwarding to tabby-node); node cpu: "
        f"tabby-node's CPU ms per pod (ADD+CHECK+DEL, warm-up included); busy: the share of "
        f"the machine's {os.cpu_count()} CPUs in use over the run (every process: the "
        f"machine is shared); load at the end of each run",
        flush=True,
    )
    print(
        f"{'k':>3} {'path':22} {'pods/s':>7} {'x':>6} {'met':>3} {'client cpu':>10} "
        f"{'node cpu':>8} {'busy':>5} {'load':>5}",
        flush=True,
    )
    failures = 0
    for k in ks:
        args.k = k
        cpu_before = machine_cpu()
        reference = run_case(None, args, args.keep, mode="concurrent")
        busy = busy_share(cpu_before, machine_cpu())
        failures += len(reference.get("failures") or [])
        ref_rate = phase_rate(reference, "ADD")
        print(
            f"{k:3} {'ptp+host-local':22} {fmt(ref_rate, 0):>7} {'':>6} {'':>3} "
            f"{fmt(client_cpu(reference, 'ptp')):>10} {'':>8} {busy_text(busy):>5} "
            f"{os.getloadavg()[0]:5.2f}",
            flush=True,
        )
        for name in cases:
            with case_env(name, args.tabby_node) as case:
                cpu0 = agent_cpu_s(case)
                cpu_before = machine_cpu()
                report = run_case(case, args, args.keep, mode="concurrent", alone=True)
                busy = busy_share(cpu_before, machine_cpu())
                cpu1 = agent_cpu_s(case)
            failures += len(report.get("failures") or [])
            rate = phase_rate(report, "ADD")
            share = rate / ref_rate if rate and ref_rate else None
            met = "-" if share is None else ("yes" if share >= THROUGHPUT_TARGET else "no")
            cpu = (
                None
                if cpu0 is None or cpu1 is None
                else (cpu1 - cpu0) * 1000 / (args.pods + args.warmup)
            )
            print(
                f"{k:3} {name:22} {fmt(rate, 0):>7} {fmt(share, 2) + 'x':>6} {met:>3} "
                f"{fmt(client_cpu(report, name)):>10} {fmt(cpu):>8} "
                f"{busy_text(busy):>5} {os.getloadavg()[0]:5.2f}",
                flush=True,
            )
    if failures:
        print(f"{failures} failed call(s) or check(s): see --keep", flush=True)
    return 1 if failures else 0


def phase_rate(report: dict[str, Any], verb: str) -> float | None:
    for p in report.get("phases", []):
        if p["verb"] == verb:
            rate: float | None = p["calls_per_s"]
            return rate
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=None, help=f"comma-separated of {CASES}")
    ap.add_argument(
        "-n", "--pods", type=int, default=None, help="measured pods per config (100; --table: 40)"
    )
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=1, help="rounds over all cases (1)")
    ap.add_argument("--mode", choices=("sequential", "concurrent"), default="sequential")
    ap.add_argument("-k", type=int, default=8, help="calls in flight in concurrent mode (8)")
    ap.add_argument("--cni-path", default="/opt/cni/bin", help="tabby's plugins")
    ap.add_argument("--ref-cni-path", default="/usr/lib/cni", help="ptp and host-local")
    ap.add_argument(
        "--tabby-node",
        default=shutil.which("tabby-node") or "/usr/local/bin/tabby-node",
        help="tabby-node's binary, or 'checkout': this checkout's, run from source",
    )
    ap.add_argument("--keep", metavar="DIR", help="copy every cni_bench JSON report into DIR")
    ap.add_argument("--json", metavar="FILE", help="write the summary rows as JSON")
    ap.add_argument("-v", "--verbose", action="store_true", help="show cni_bench's own tables")
    ap.add_argument(
        "--table",
        action="store_true",
        help="issue 21's table in one run per path: tabby-node with the file store and etcd "
        "1 and 3 members, standalone with the file store, and 8 concurrent ADDs through "
        "tabby-node (file, etcd) against ptp+host-local's rate; -n defaults to 40",
    )
    ap.add_argument(
        "--throughput",
        action="store_true",
        help="issue 32's table: for each k of --ks, k pods at once, ptp+host-local alone and "
        f"each case alone (--cases, default {THROUGHPUT_CASES}): pods/s and the ratio",
    )
    ap.add_argument("--ks", default="8,32", help="--throughput's k values (8,32)")
    ap.add_argument(
        "--no-client-floor",
        action="store_true",
        help="--table without the client floor (which bench/cni/client_floor.py builds once)",
    )
    record.add_argument(
        ap,
        "datastore_cni_table with --table, datastore_cni_throughput with --throughput, "
        "else datastore_cni_bench",
    )
    args = ap.parse_args()
    if args.pods is None:
        args.pods = 40 if args.table else 100
    # Ctrl-C as KeyboardInterrupt even when started with SIGINT ignored (a background job);
    # cni_bench, exec'd from here, then gets the default disposition and cleans up too.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.cases is None:
        args.cases = THROUGHPUT_CASES if args.throughput else DEFAULT_CASES
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    bad = [c for c in cases if c not in CASES]
    if bad or os.geteuid() != 0:
        print(f"datastore_cni_bench: unknown case(s) {bad} or not root", file=sys.stderr)
        return 2
    if args.keep:
        os.makedirs(args.keep, exist_ok=True)
    if args.throughput:
        try:
            return throughput(args, cases)
        except KeyboardInterrupt:
            print("datastore_cni_bench: interrupted (everything was removed)", file=sys.stderr)
            return 130
    if args.table:
        try:
            return table(args)
        except KeyboardInterrupt:
            print("datastore_cni_bench: interrupted (everything was removed)", file=sys.stderr)
            return 130
    print(
        f"datastore_cni_bench: {args.mode}{f' -k {args.k}' if args.mode == 'concurrent' else ''},"
        f" {args.pods} pods per config, each case interleaved with ptp+host-local; "
        f"load {os.getloadavg()[0]:.2f}",
        flush=True,
    )
    head = (
        f"{'case':17} {'verb':5} {'ptp p50':>8} {'p50':>7} {'p90':>7} {'cpu p50':>7} "
        f"{'p50 B/A':>7} {'paired':>6} {'calls/s':>7}   load"
    )
    results: list[dict[str, Any]] = []
    try:
        for rnd in range(args.repeat):
            print(
                f"-- round {rnd + 1}/{args.repeat} (ms; B/A: the case over ptp)\n{head}", flush=True
            )
            for name in cases:
                with case_env(name, args.tabby_node) as case:
                    before = etcd_requests(case)
                    report = run_case(case, args, args.keep)
                    after = etcd_requests(case)
                    served = node_calls(case)
                r = row(report, name)
                pods = args.pods + args.warmup
                per_pod = {
                    m: (after[m] - before.get(m, 0.0)) / pods
                    for m in sorted(after)
                    if after[m] - before.get(m, 0.0) > 0 and m not in ("Watch", "LeaseKeepAlive")
                }
                r["etcd_requests_per_pod"] = per_pod
                load = os.getloadavg()[0]
                results.append({"round": rnd, "case": name, "load": load, **r})
                for verb in ("ADD", "CHECK", "DEL"):
                    v = r.get(verb)
                    if v is None:
                        continue
                    rate = r["phases"].get(verb)
                    print(
                        f"{name:17} {verb:5} {fmt(v['ref_p50']):>8} {fmt(v['p50']):>7} "
                        f"{fmt(v['p90']):>7} {fmt(v['cpu_p50']):>7} {fmt(v['p50_ratio'], 2):>7} "
                        f"{fmt(v['paired'], 2):>6} {fmt(rate, 0):>7}   {load:.2f}",
                        flush=True,
                    )
                for verb, v in served.items():
                    phases = ", ".join(f"{label} {fmt(v.get(p))}" for p, label in PHASE_COLUMNS)
                    print(
                        f"{name:17} {verb:5} tabby-node per call (mean ms): {phases}; "
                        f"cpu {cpu_text(v, verb)} ({v['n']:.0f} calls)",
                        flush=True,
                    )
                r["node_calls"] = served
                if per_pod:
                    total = sum(per_pod.values())
                    parts = ", ".join(f"{m} {v:.1f}" for m, v in per_pod.items())
                    print(
                        f"{name:17} etcd requests per pod (ADD+CHECK+DEL, both plugins "
                        f"and tabby-node): {total:.1f} ({parts})",
                        flush=True,
                    )
                if r["failures"]:
                    print(f"{name:17} {r['failures']} failure(s): see --keep/-v", flush=True)
    except KeyboardInterrupt:
        print("datastore_cni_bench: interrupted (everything was removed)", file=sys.stderr)
        return 130
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 1 if any(r["failures"] for r in results) else 0


def record_name(argv: list[str]) -> str:
    """``--record``'s default: the table and the cases are recorded apart."""
    if "--throughput" in argv:
        return "datastore_cni_throughput"
    return "datastore_cni_table" if "--table" in argv else "datastore_cni_bench"


if __name__ == "__main__":
    sys.exit(record.run(main, record_name))
