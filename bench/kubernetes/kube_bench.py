#!/usr/bin/env python3
"""Benchmark (not a test): tabby on a real Kubernetes 1.20 (lab.kubernetes.cluster.KubeLab:
3 nodes in network namespaces, kubelet + containerd + tabby-node on each, the control plane
on node-1, a 3-member etcd; BIRD backend) with tabby-kube-controllers (2 replicas, the
manifest's service account and RBAC). Prints numbers; asserts nothing.

    policy        ``kubectl apply`` of a NetworkPolicy isolating a target pod on every node
                  -> enforced everywhere: the last echo reply each node's target sends to a
                  client on another node (a raw ICMP socket in the client pod's namespace,
                  one echo every 10 ms). p50/p90 of the slowest node over -n rounds, of
                  kubectl's own duration, and of the steps between (the policy seen by a
                  watch on the API server; its mirror seen by a watch on tabby's etcd)
    pod-start     pod created through the API -> Running with an address (a watch on the
                  API server), the real kubelet and containerd on one node, tabby vs Debian's
                  ptp + host-local, pod by pod (A B A B ...): the node's conflist is
                  swapped atomically between pods (containerd 1.6 reloads it), --pairs pairs
                  after --warmup pairs; p50/p90 of each and the ratios tabby/ptp; each step
                  of a start from containerd's CRI log (kubelet asks for the sandbox, the
                  pod's route, the sandbox back, the container started, Running), the ADD
                  inside tabby-node per pod; --py-spy profiles tabby-node meanwhile
    controllers   tabby-kube-controllers' CPU and RSS (leader and standby) at rest, while a
                  Deployment of --pods busybox pods comes up (until every pod is mirrored
                  into tabby's datastore with its address), while it is deleted (until
                  nothing of it is left in the API or the datastore), and at rest again

Every case brings up a lab of its own (``KubeLab(backend="bird", node_args=["--node-ttl",
"15"])``), starts the controllers, runs, and tears the lab down (every process by PID, the
namespaces, cgroups and files; also on Ctrl-C), then prints what the teardown reported
left behind (nothing, normally).

Needs root, the installed bundle (/opt/tabby, /usr/local/bin/tabby-node,
tabby-kube-controllers, /opt/cni/bin/tabby), Kubernetes built (``python3 -m
lab.kubernetes.build``), Debian's containerd, runc, etcd, bird2, nftables and
containernetworking-plugins (ptp, host-local, loopback in /usr/lib/cni). See
bench/README.md.

    .venv/bin/python -m bench.kubernetes.kube_bench                       # every case, ~10 min
    .venv/bin/python -m bench.kubernetes.kube_bench --cases policy -n 40
    .venv/bin/python -m bench.kubernetes.kube_bench --cases pod-start --pairs 30 --warmup 3 \
        --py-spy /path/to/py-spy --logs /tmp/kube-bench-logs
    .venv/bin/python -m bench.kubernetes.kube_bench --cases controllers --pods 100 --rest 60
    .venv/bin/python -m bench.kubernetes.kube_bench --json /tmp/kube-bench.json
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import ipaddress
import json
import os
import platform
import re
import secrets
import signal
import socket
import statistics
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from bench import record
from bench.stats import pct
from bundle.types import JSON as Doc
from kube_controllers.options import ControllerOptions
from lab.kubernetes import node as knode
from lab.kubernetes.cluster import KubeLab
from lab.kubernetes.controllers import Controllers
from tabbyctl.demo.lab import http_get
from tabbyctl.demo.proc import INTERRUPTS, LabError, run

T = TypeVar("T")
CASES = ("policy", "pod-start", "controllers", "burst")
CLK_TCK = os.sysconf("SC_CLK_TCK")
TABBY_POOL = ipaddress.ip_network("10.244.0.0/16")
#: busybox's sh as PID 1 exits on SIGTERM (sleep as PID 1 would wait out the grace period).
#: --controllers-bin: the tabby-kube-controllers every case runs (the installed one by default)
CONTROLLERS_BIN = "/usr/local/bin/tabby-kube-controllers"
NODE_METRICS = 9091  # tabby-node's /metrics (its default port) in each node's namespace


# -- small helpers -----------------------------------------------------------------------------


def echo(text: str) -> None:
    print(text, flush=True)


def load() -> str:
    one, five, fifteen = os.getloadavg()
    return f"{one:.2f} {five:.2f} {fifteen:.2f}"


def summary(values: list[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
    }


def ms(values: list[float]) -> str:
    if not values:
        return "      -           -"
    return f"{pct(values, 50) * 1000:7.0f} ms  {pct(values, 90) * 1000:7.0f} ms"


def secs(values: list[float]) -> str:
    if not values:
        return "     -          -"
    return f"{pct(values, 50):7.2f} s  {pct(values, 90):7.2f} s"


def parse_metrics(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            with contextlib.suppress(ValueError):
                out[name] = float(value)
    return out


def node_metrics(lab: KubeLab, node: str) -> dict[str, float]:
    code, body = http_get(lab.node(node).netns, f"http://127.0.0.1:{NODE_METRICS}/metrics", 5)
    return parse_metrics(body.decode(errors="replace")) if code == 200 else {}


def hist_delta(
    before: dict[str, float], after: dict[str, float], name: str, labels: str = ""
) -> tuple[int, float]:
    """(count, mean seconds) of histogram ``name`` (``labels``: ``{verb="ADD"}``) between two
    scrapes."""
    count = after.get(f"{name}_count{labels}", 0.0) - before.get(f"{name}_count{labels}", 0.0)
    total = after.get(f"{name}_sum{labels}", 0.0) - before.get(f"{name}_sum{labels}", 0.0)
    return int(count), (total / count if count else float("nan"))


# -- threads inside a network namespace ----------------------------------------------------------


def _enter(path: str) -> None:
    from dataplane.netns import setns

    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd)
    finally:
        os.close(fd)


def netns_pool(path: str, workers: int = 1) -> ThreadPoolExecutor:
    """Threads that live in the network namespace at ``path`` (``/run/netns/<name>`` or a pod's
    through its node: what they connect to is that namespace's)."""
    return ThreadPoolExecutor(
        workers, thread_name_prefix="netns", initializer=_enter, initargs=(path,)
    )


def netns_thread(path: str, fn: Callable[[], None], name: str) -> threading.Thread:
    """``fn`` in a daemon thread that entered the namespace first."""

    def body() -> None:
        _enter(path)
        fn()

    t = threading.Thread(target=body, name=name, daemon=True)
    t.start()
    return t


# -- the probes --------------------------------------------------------------------------------


def _checksum(data: bytes) -> int:
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return ~total & 0xFFFF


class Pinger:
    """An echo request to ``target`` every ``interval`` s from the namespace at ``netns``; the
    time of every reply. Each request carries an ICMP identifier of its own: tabby's rules
    accept ``ct state established`` first, and an echo that reused an identifier (the same
    conntrack entry, kept 30 s) would pass as established after the policy denied it."""

    def __init__(self, netns: str, target: str, interval: float = 0.01) -> None:
        self.netns = netns
        self.target = target
        self.interval = interval
        self.replies: list[float] = []
        self.sent = 0
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._next_id = secrets.randbelow(30000) + 1
        self._thread = netns_thread(netns, self._loop, f"ping {target}")

    def _packet(self) -> bytes:
        ident = self._next_id
        self._next_id = self._next_id % 0xFFFE + 1  # 1..65535: no reuse for ~10 minutes
        payload = b"tabby-kube-bench"
        head = struct.pack("!BBHHH", 8, 0, 0, ident, 1)
        return struct.pack("!BBHHH", 8, 0, _checksum(head + payload), ident, 1) + payload

    def _loop(self) -> None:
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
                next_send = time.monotonic()
                while not self._stop.is_set():
                    now = time.monotonic()
                    if now >= next_send:
                        with contextlib.suppress(OSError):
                            s.sendto(self._packet(), (self.target, 0))
                        self.sent += 1
                        next_send = max(next_send + self.interval, now)
                    s.settimeout(max(0.0005, next_send - time.monotonic()))
                    try:
                        data, (src, _) = s.recvfrom(2048)
                    except (TimeoutError, BlockingIOError):
                        continue
                    ihl = (data[0] & 0x0F) * 4
                    if len(data) >= ihl + 8 and data[ihl] == 0 and src == self.target:
                        self.replies.append(time.monotonic())
        except BaseException as e:
            self.error = e

    def last(self) -> float:
        return self.replies[-1] if self.replies else float("-inf")

    def first_after(self, t: float) -> float | None:
        """The first reply at or after ``t`` (None: none yet)."""
        found = None
        for r in reversed(self.replies):  # the recent ones are at the end
            if r < t:
                break
            found = r
        return found

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


class ApiWatch:
    """A watch on one API collection from node-1 (KubeClient, the controllers' own client):
    ``on_event(type, object, monotonic time)`` for every event, the list's objects first as
    ADDED. Opened again from the last resourceVersion when the server ends it; listed again
    on 410."""

    def __init__(
        self, lab: KubeLab, path: str, on_event: Callable[[str, Doc, float], None]
    ) -> None:
        from stores.kube.client import KubeClient, KubeConfig

        self.api = KubeClient(KubeConfig.load(str(lab.admin_kubeconfig)))
        self.path = path
        self.on_event = on_event
        self.stop_event = threading.Event()
        self.listed = threading.Event()
        self.error = ""
        self.thread = netns_thread(f"/run/netns/{lab.nodes[0].netns}", self._loop, f"watch {path}")
        if not self.listed.wait(30):
            self.close()
            raise LabError(f"watch {path}: no list within 30 s ({self.error})")

    def _loop(self) -> None:
        from stores.kube.client import ApiError, Gone

        rv = ""
        known: dict[str, Doc] = {}  # name -> the last object seen
        while not self.stop_event.is_set():
            try:
                if not rv:  # (again after a 410: what went in the gap is reported deleted)
                    items, rv = self.api.list(self.path)
                    now = time.monotonic()
                    listed = {str(i["metadata"]["name"]): i for i in items}
                    for name in set(known) - set(listed):
                        self.on_event("DELETED", known.pop(name), now)
                    for name, item in listed.items():
                        known[name] = item
                        self.on_event("ADDED", item, now)
                    self.listed.set()
                for event in self.api.watch(self.path, rv, self.stop_event, timeout_seconds=240):
                    now = time.monotonic()
                    obj = event.get("object") or {}
                    meta = obj.get("metadata") or {}
                    rv = str(meta.get("resourceVersion") or rv)
                    kind = str(event.get("type"))
                    if kind == "BOOKMARK":
                        continue
                    if kind == "DELETED":
                        known.pop(str(meta.get("name")), None)
                    else:
                        known[str(meta.get("name"))] = obj
                    self.on_event(kind, obj, now)
            except Gone:
                rv = ""
            except ApiError as e:
                self.error = str(e)
                self.stop_event.wait(0.5)

    def close(self) -> None:
        self.stop_event.set()
        self.api.close()
        self.thread.join(5)


class StoreWatch:
    """tabby's datastore watched from node-1 (the etcd store's ``sync``, as tabby-node
    watches it): ``on_event(SyncEvent, monotonic time)``."""

    def __init__(
        self, lab: KubeLab, kinds: list[str], on_event: Callable[[Any, float], None]
    ) -> None:
        from datastore.etcd.store import EtcdStore

        self.store = EtcdStore(
            lab.endpoints(),
            prefix=lab.etcd_prefix,
            lock_timeout=30,
            lock_dir=os.path.join(lab.workdir, "bench-locks"),
        )
        self.kinds = kinds
        self.on_event = on_event
        self.stop_event = threading.Event()
        self.synced = threading.Event()
        self.thread = netns_thread(f"/run/netns/{lab.nodes[0].netns}", self._loop, "store sync")
        if not self.synced.wait(30):
            self.close()
            raise LabError("tabby's datastore: no snapshot within 30 s")

    def _loop(self) -> None:
        for event in self.store.sync(self.kinds, self.stop_event):
            self.on_event(event, time.monotonic())
            if event.type == "snapshot":
                self.synced.set()

    def close(self) -> None:
        self.stop_event.set()
        self.thread.join(10)
        with contextlib.suppress(Exception):
            self.store.close()


# -- processes: CPU and memory from /proc -------------------------------------------------------


def proc_cpu(pid: int) -> float | None:
    """utime + stime of every thread of ``pid``, seconds."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def proc_status(pid: int, key: str) -> float | None:
    """A kB field of /proc/<pid>/status (VmRSS, VmHWM) in MB."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(f"{key}:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def children(pid: int) -> list[int]:
    out: list[int] = []
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/children", encoding="ascii") as f:
                out += [int(c) for c in f.read().split()]
    return out


def proc_switches(pid: int) -> int:
    """Context switches (voluntary + not) of every thread of ``pid``: its wake-ups."""
    total = 0
    with contextlib.suppress(OSError):
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError), open(f"/proc/{pid}/task/{task}/status") as f:
                for line in f:
                    if line.startswith(("voluntary_ctxt_switches:", "nonvoluntary_ctxt_switches:")):
                        total += int(line.split()[1])
    return total


class Sampler:
    """CPU seconds and RSS of some processes every ``period`` s (and their context switches
    at the edges of a window: ``mark``)."""

    def __init__(self, pids: dict[str, int], period: float = 0.25) -> None:
        self.pids = pids
        self.period = period
        self.samples: list[tuple[float, dict[str, tuple[float, float]]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="sampler", daemon=True)
        self._thread.start()

    def read(self) -> tuple[float, dict[str, tuple[float, float]]]:
        got = {}
        for name, pid in self.pids.items():
            cpu, rss = proc_cpu(pid), proc_status(pid, "VmRSS")
            if cpu is not None and rss is not None:
                got[name] = (cpu, rss)
        return time.monotonic(), got

    def _loop(self) -> None:
        while True:
            self.samples.append(self.read())
            if self._stop.wait(self.period):
                return

    def mark(self) -> tuple[float, dict[str, tuple[float, float]], dict[str, int]]:
        """A sample now (exact window edges), kept with the periodic ones."""
        sample = self.read()
        self.samples.append(sample)
        return sample[0], sample[1], {n: proc_switches(p) for n, p in self.pids.items()}

    def window(
        self,
        start: tuple[float, dict[str, tuple[float, float]], dict[str, int]],
        end: tuple[float, dict[str, tuple[float, float]], dict[str, int]],
    ) -> dict[str, dict[str, float]]:
        t0, first, sw0 = start
        t1, last, sw1 = end
        inside = [d for t, d in self.samples if t0 <= t <= t1]
        out = {}
        for name in self.pids:
            if name not in first or name not in last:
                continue
            rss = [d[name][1] for d in inside if name in d]
            cpu = last[name][0] - first[name][0]
            out[name] = {
                "seconds": t1 - t0,
                "cpu_s": cpu,
                "cpu_pct": 100 * cpu / (t1 - t0) if t1 > t0 else 0.0,
                "rss_mb": last[name][1],
                "rss_mean_mb": statistics.fmean(rss) if rss else last[name][1],
                "rss_peak_mb": max(rss) if rss else last[name][1],
                "wakeups_per_s": (sw1[name] - sw0[name]) / (t1 - t0) if t1 > t0 else 0.0,
            }
        return out

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)


# -- resources -------------------------------------------------------------------------------


def namespace(name: str) -> Doc:
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}


def isolate_targets(ns: str, name: str) -> Doc:
    """Every pod labelled role=target isolated for ingress, nothing allowed in."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"role": "target"}}, "policyTypes": ["Ingress"]},
    }


def status_ip(obj: Doc) -> str:
    status = obj.get("status") or {}
    ips = [p.get("ip") for p in status.get("podIPs") or [] if p.get("ip")]
    return str(ips[0]) if ips else str(status.get("podIP") or "")


# -- the lab ---------------------------------------------------------------------------------


@contextlib.contextmanager
def kube_lab_with_controllers(
    case: str, args: argparse.Namespace
) -> Iterator[tuple[KubeLab, Controllers, dict[str, Any]]]:
    """A bird KubeLab (nodes' tabby-node with --node-ttl 15) and two controller replicas
    (node-1, node-2), one leading; torn down afterwards, also on Ctrl-C. ``info`` gets the
    bring-up time and what the teardown left (an empty list: nothing)."""
    info: dict[str, Any] = {"load_before": load()}
    lab = KubeLab(
        backend="bird",
        datastore=args.datastore,
        node_args=["--node-ttl", "15"],
        progress=lambda m: echo(f"    {m}"),
        containerd_log_level="info",  # every CRI call with its time: where a pod start goes
    )
    echo(
        f"== {case}: a 3-node Kubernetes lab ({lab.prefix}), tabby on {args.datastore}, "
        f"load {load()} =="
    )
    try:
        with INTERRUPTS.installed():
            lab.build()
            info["bring_up_s"] = lab.timings.get("ready")
            # at the log level and with the graces an operator runs them (the tests' debug
            # lines cost CPU; their short graces make the IPAM pass list blocks every second)
            shipped = ControllerOptions.model_fields
            controllers = Controllers(
                lab,
                log_level="info",
                binary=args.controllers_bin,
                node_grace=shipped["node_grace"].default,
                leak_grace=shipped["leak_grace"].default,
            )
            controllers.install()
            controllers.start("replica-1", "node-1")
            controllers.start("replica-2", "node-2")
            info["leader"] = controllers.wait_leader()
            controllers.wait_ready()
            echo(f"  controllers: replica-1 (node-1), replica-2 (node-2); {info['leader']} leads")
            yield lab, controllers, info
    finally:
        info["load_after"] = load()
        problems = lab.teardown()
        info["teardown_s"] = lab.timings.get("teardown")
        info["teardown_left"] = problems
        if problems:
            echo(f"  teardown LEFT: {problems}")
        else:
            echo(f"  torn down in {info['teardown_s']} s; lab.teardown() reported no problems")


# == policy ========================================================================================


def make_namespace(lab: KubeLab, ns: str) -> None:
    """A namespace whose default service account has its token (pods may be created)."""
    lab.apply(namespace(ns))
    lab.wait_for(
        f"the default service account of {ns}",
        lambda: bool(lab.kubectl_json("get", "serviceaccount", "-n", ns, "default").get("secrets")),
        60,
    )


def case_policy(args: argparse.Namespace) -> dict[str, Any]:
    with kube_lab_with_controllers("policy", args) as (lab, _controllers, info):
        ns, policy_name = "kb-policy", "isolate-targets"
        nodes = [n.name for n in lab.nodes]
        make_namespace(lab, ns)
        pods: list[Doc] = []
        for i, node in enumerate(nodes):
            other = nodes[(i + 1) % len(nodes)]  # the client of node-i's target runs there
            labels = {"app": f"target-{node}", "role": "target"}
            pods.append(lab.sleeper_pod(f"t-{node}", ns, labels, nodeName=node))
            pods.append(
                lab.sleeper_pod(f"c-{node}", ns, {"app": f"client-of-{node}"}, nodeName=other)
            )
        lab.apply(pods)
        ready = {p.name: p for p in lab.wait_pods(ns, "", len(pods), timeout=180)}
        echo(
            "  targets "
            + ", ".join(f"{ready[f't-{n}'].ip}@{n} <- c-{n}@{ready[f'c-{n}'].node}" for n in nodes)
        )
        api_seen: list[tuple[str, float]] = []  # (ADDED|DELETED, time) of the policy
        store_seen: list[tuple[str, float]] = []  # (put|delete, time) of its mirror
        key = f"{ns}/{policy_name}"

        def on_api(kind: str, obj: Doc, t: float) -> None:
            if (obj.get("metadata") or {}).get("name") == policy_name:
                api_seen.append((kind, t))

        def on_store(event: Any, t: float) -> None:
            if event.key == key:
                store_seen.append((event.type, t))

        doc = json.dumps(isolate_targets(ns, policy_name))
        rows: list[dict[str, Any]] = []
        pingers: dict[str, Pinger] = {}
        with contextlib.ExitStack() as stack:
            for node in nodes:
                pingers[node] = Pinger(lab.pod_netns(ns, f"c-{node}"), ready[f"t-{node}"].ip)
                stack.callback(pingers[node].stop)
            path = f"/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies"
            stack.callback(ApiWatch(lab, path, on_api).close)
            if lab.datastore != "kubernetes":  # nothing is mirrored on the Kubernetes API
                stack.callback(StoreWatch(lab, ["networkpolicy"], on_store).close)
            before = {n: node_metrics(lab, n) for n in nodes}
            wait_replies(pingers, time.monotonic(), 60, "every client reaching its target")
            for r in range(-1, args.n):  # round 0: warm-up (kubectl's discovery cache)
                row = policy_round(lab, pingers, doc, ns, policy_name, api_seen, store_seen)
                if r < 0:
                    continue
                rows.append(row)
                echo(
                    f"  round {r + 1:2d}: every node {_ms(row['every_node_s'])}"
                    f"  kubectl {_ms(row['kubectl_s'])}  API {_ms(row['api_s'])}"
                    f"  etcd {_ms(row['datastore_s'])}"
                    f"  replies again {_ms(row['allow_every_node_s'])}"
                    + (f"  SUSPECT: {row['suspect']}" if row["suspect"] else "")
                    + f"  load {load()}"
                )
            labels = label_rounds(lab, pingers, ns, nodes, args.label_rounds)
            after = {n: node_metrics(lab, n) for n in nodes}
        result = policy_report(rows, nodes, before, after, args.n)
        result["labels"] = labels
        result["pinger_errors"] = [f"{n}: {p.error!r}" for n, p in pingers.items() if p.error]
        result["echo_requests"] = {n: p.sent for n, p in pingers.items()}
    result.update(info)
    return result


def allow_from_labelled_namespaces(ns: str, name: str) -> Doc:
    """role=target pods open to every pod of a namespace labelled allow=yes."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": {
            "podSelector": {"matchLabels": {"role": "target"}},
            "ingress": [{"from": [{"namespaceSelector": {"matchLabels": {"allow": "yes"}}}]}],
        },
    }


def stopped_everywhere(
    pingers: dict[str, Pinger], t0: float, quiet: float = 1.0, timeout: float = 30.0
) -> float | None:
    """Seconds from ``t0`` to the last reply of the slowest pinger, once every pinger has
    been quiet for ``quiet`` s (None: one still answers after ``timeout``)."""
    deadline = t0 + timeout
    while True:
        now = time.monotonic()
        if all(now - p.last() >= quiet for p in pingers.values()):
            return max(p.last() for p in pingers.values()) - t0
        if now > deadline:
            return None
        time.sleep(0.05)


def label_rounds(
    lab: KubeLab, pingers: dict[str, Pinger], ns: str, nodes: list[str], rounds: int
) -> dict[str, Any]:
    """A pod label and a namespace label changed with kubectl -> in force on every node.
    With the targets isolated: the targets relabelled out of the policy (role=free: replies
    again everywhere) and back (role=target: no reply); then, with a second policy opening
    the targets to namespaces labelled allow=yes, the clients' namespace labelled so
    (replies again) and unlabelled (none). Seconds from kubectl's start to the first reply,
    or to the last one, on the slowest node."""
    targets = [f"t-{n}" for n in nodes]
    lab.apply(isolate_targets(ns, "label-isolate"))
    stopped_everywhere(pingers, time.monotonic())
    out: dict[str, list[float]] = {k: [] for k in ("pod_out", "pod_in", "ns_allow", "ns_deny")}

    def resumed(action: Callable[[], object]) -> float | None:
        t0 = time.monotonic()
        action()
        try:
            return max(wait_replies(pingers, t0, 30, "replies after a label").values()) - t0
        except LabError as e:
            echo(f"  {e}")
            return None

    def stopped(action: Callable[[], object]) -> float | None:
        t0 = time.monotonic()
        action()
        return stopped_everywhere(pingers, t0)

    def label_pods(value: str) -> object:
        return lab.kubectl("label", "pod", "-n", ns, *targets, f"role={value}", "--overwrite")

    for r in range(-1, rounds):  # round 0: warm-up
        got = {
            "pod_out": resumed(lambda: label_pods("free")),
            "pod_in": stopped(lambda: label_pods("target")),
        }
        if r >= 0:
            for k, v in got.items():
                if v is not None:
                    out[k].append(v)
    lab.apply(allow_from_labelled_namespaces(ns, "label-allow"))
    for r in range(-1, rounds):
        got = {
            "ns_allow": resumed(lambda: lab.kubectl("label", "namespace", ns, "allow=yes")),
            "ns_deny": stopped(lambda: lab.kubectl("label", "namespace", ns, "allow-")),
        }
        if r >= 0:
            for k, v in got.items():
                if v is not None:
                    out[k].append(v)
    lab.kubectl("delete", "networkpolicy", "-n", ns, "label-isolate", "label-allow")
    labels = {
        "pod_out": "pod relabelled out of an isolating policy -> replies everywhere",
        "pod_in": "pod relabelled into it -> no reply anywhere",
        "ns_allow": "namespace labelled into an allow rule -> replies everywhere",
        "ns_deny": "namespace unlabelled -> no reply anywhere",
    }
    echo(f"  labels, kubectl label -> in force on every node ({rounds} rounds each)")
    echo(f"  {'':62s}      p50         p90      p99")
    for k, label in labels.items():
        values = out[k]
        p99 = f"{pct(values, 99) * 1000:5.0f} ms" if values else "-"
        echo(f"  {label:62s} {ms(values)}  {p99}")
    every = [x for xs in out.values() for x in xs]
    return {
        **{k: {**summary(v), "p99": pct(v, 99) if v else None} for k, v in out.items()},
        "all": {**summary(every), "p99": pct(every, 99) if every else None},
    }


def _ms(value: float | None) -> str:
    return "    -   " if value is None else f"{value * 1000:5.0f} ms"


def wait_replies(
    pingers: dict[str, Pinger], after: float, timeout: float, what: str
) -> dict[str, float]:
    """The first reply after ``after`` of every pinger."""
    deadline = time.monotonic() + timeout
    while True:
        firsts = {n: p.first_after(after) for n, p in pingers.items()}
        if all(v is not None for v in firsts.values()):
            return {n: v for n, v in firsts.items() if v is not None}
        if time.monotonic() > deadline:
            missing = [n for n, v in firsts.items() if v is None]
            raise LabError(f"{what}: no echo reply on {missing} within {timeout:.0f} s")
        time.sleep(0.02)


def policy_round(
    lab: KubeLab,
    pingers: dict[str, Pinger],
    doc: str,
    ns: str,
    name: str,
    api_seen: list[tuple[str, float]],
    store_seen: list[tuple[str, float]],
    quiet: float = 1.0,
    timeout: float = 30.0,
) -> dict[str, Any]:
    """One apply (until every pinger's replies have stopped for ``quiet`` s) and one delete
    (until every pinger has a reply again)."""
    # replies flowing everywhere right now: the moment they stop means something
    wait_replies(pingers, time.monotonic() - 0.05, 10, "replies before the apply")
    w0, t0 = time.time(), time.monotonic()
    proc = lab.kubectl("apply", "-f", "-", "-v=6", input=doc)
    t_kubectl = time.monotonic()
    inside = kubectl_trace(proc.stderr, w0, t_kubectl - t0)
    deadline = t0 + timeout
    while True:
        now = time.monotonic()
        stopped = {n: p.last() for n, p in pingers.items() if now - p.last() >= quiet}
        if len(stopped) == len(pingers) or now > deadline:
            break
        time.sleep(0.05)
    per_node = {
        n: (stopped[n] - t0 if n in stopped else None) for n in pingers
    }  # the last reply, from t0
    t_api = next((t for k, t in api_seen if k == "ADDED" and t >= t0), None)
    t_store = next((t for k, t in store_seen if k == "put" and t >= t0), None)
    t1 = time.monotonic()
    lab.kubectl("delete", "networkpolicy", "-n", ns, name)
    t_delete = time.monotonic()
    try:
        firsts = wait_replies(pingers, t1, timeout, "replies after the delete")
        allow = {n: t - t1 for n, t in firsts.items()}
    except LabError as e:
        echo(f"  {e}")
        allow = {}
    values = [v for v in per_node.values() if v is not None]
    # Replies that stopped before the mirror was even in etcd were a gap of the machine's
    # (1 s without a reply, not the policy): the round is shown, and flagged.
    suspect = [n for n, t in stopped.items() if t_store is not None and t < t_store - 0.05] + [
        n for n in pingers if n not in stopped
    ]
    return {
        "suspect": suspect,
        "kubectl_s": t_kubectl - t0,
        "kubectl_inside": inside,
        "api_s": None if t_api is None else t_api - t0,
        "datastore_s": None if t_store is None else t_store - t0,
        "per_node_s": per_node,
        "every_node_s": max(values) if len(values) == len(per_node) else None,
        "load1": os.getloadavg()[0],
        "kubectl_delete_s": t_delete - t1,
        "allow_per_node_s": allow,
        "allow_every_node_s": max(allow.values()) if len(allow) == len(pingers) else None,
    }


GLOG = re.compile(r"^I(\d\d)(\d\d) (\d\d):(\d\d):(\d\d)\.(\d{6})\s+\d+ \S+\] (.*)$")
REQUEST = re.compile(
    r"^(GET|POST|PUT|PATCH|DELETE) https://[^/]+(\S*) (\d+) .* in (\d+) milliseconds$"
)


def kubectl_trace(stderr: str, started: float, took: float) -> dict[str, Any]:
    """Where a ``kubectl -v=6`` run spent its time, from its log (glog: local wall-clock time,
    microseconds; a request is logged when its answer is in, with its duration): from the
    exec (``started``, wall clock) to its first request; the requests themselves (the API
    server's part, over the lab's network); the time between them (kubectl's own work:
    decoding the OpenAPI document, building the patch); from the last answer to the exit."""
    year = datetime.datetime.now().year
    requests: list[tuple[float, float, str]] = []  # (began, seconds, "METHOD path code")
    for line in stderr.splitlines():
        m = GLOG.match(line)
        r = REQUEST.match(m.group(7)) if m else None
        if m is None or r is None:
            continue
        month, day, hh, mm, ss, us = (int(x) for x in m.groups()[:6])
        at = datetime.datetime(year, month, day, hh, mm, ss, us).timestamp()  # local time
        seconds = int(r.group(4)) / 1000
        path = r.group(2).split("?")[0]
        requests.append((at - seconds - started, seconds, f"{r.group(1)} {path} {r.group(3)}"))
    if not requests:
        return {}
    first = requests[0][0]
    last_end = max(b + s for b, s, _ in requests)
    in_requests = sum(s for _, s, _ in requests)
    return {
        "before_first_request_s": first,
        "requests_s": in_requests,
        "between_requests_s": last_end - first - in_requests,
        "after_last_answer_s": took - last_end,
        "requests": [(what, s) for _, s, what in requests],
    }


def policy_report(
    rows: list[dict[str, Any]],
    nodes: list[str],
    before: dict[str, dict[str, float]],
    after: dict[str, dict[str, float]],
    n: int,
) -> dict[str, Any]:
    def col(key: str) -> list[float]:
        return [r[key] for r in rows if r.get(key) is not None]

    every, kubectl, api, ds = (
        col("every_node_s"),
        col("kubectl_s"),
        col("api_s"),
        col("datastore_s"),
    )
    per_node = {
        m: [r["per_node_s"][m] for r in rows if r["per_node_s"].get(m) is not None] for m in nodes
    }
    steps = {
        "kubectl start -> object in the API (watch)": [
            r["api_s"] for r in rows if r["api_s"] is not None
        ],
        "API -> mirror in tabby's etcd (controllers)": [
            r["datastore_s"] - r["api_s"]
            for r in rows
            if r["datastore_s"] is not None and r["api_s"] is not None
        ],
        "etcd -> last reply, slowest node (tabby-node)": [
            r["every_node_s"] - r["datastore_s"]
            for r in rows
            if r["every_node_s"] is not None and r["datastore_s"] is not None
        ],
        "kubectl exit -> last reply, slowest node": [
            r["every_node_s"] - r["kubectl_s"] for r in rows if r["every_node_s"] is not None
        ],
    }
    inside: dict[str, list[float]] = {}
    for r in rows:
        for k, v in (r.get("kubectl_inside") or {}).items():
            if k.endswith("_s"):
                inside.setdefault(k, []).append(v)
    applies = {}
    for m in nodes:
        count, mean = hist_delta(before[m], after[m], "tabby_policy_apply_duration_seconds")
        rc, rmean = hist_delta(before[m], after[m], "tabby_reconcile_duration_seconds")
        applies[m] = {
            "policy_applies": count,
            "apply_mean_s": mean,
            "reconciles": rc,
            "reconcile_mean_s": rmean,
        }
    echo(
        "\npolicy: kubectl apply of an isolating NetworkPolicy -> enforced on every node "
        f"({len(rows)} of {n} rounds)"
    )
    echo(f"  {'':46s}      p50         p90")
    echo(f"  {'kubectl apply (its own duration)':46s} {ms(kubectl)}")
    echo(f"  {'the policy seen by a watch on the API server':46s} {ms(api)}")
    echo(f"  {'its mirror seen by a watch on tabby etcd':46s} {ms(ds)}")
    for m in nodes:
        echo(f"  {'enforced on ' + m + ' (last reply)':46s} {ms(per_node[m])}")
    echo(f"  {'ENFORCED ON EVERY NODE (target p50 <= 500 ms)':46s} {ms(every)}")
    echo(f"  {'deleted -> replies again on every node':46s} {ms(col('allow_every_node_s'))}")
    echo("  where the time goes (per-round differences):")
    for label, values in steps.items():
        echo(f"    {label:44s} {ms(values)}")
    labels = {
        "before_first_request_s": "exec, start-up, until its first request",
        "requests_s": "its requests (the API server's answers)",
        "between_requests_s": "between them (kubectl's own work)",
        "after_last_answer_s": "after the last answer, until it exited",
    }
    echo("  inside kubectl apply (its -v=6 log):")
    for k, label in labels.items():
        echo(f"    {label:44s} {ms(inside.get(k, []))}")
    if rows and rows[-1].get("kubectl_inside"):
        echo(
            "    the last round's requests: "
            + ", ".join(f"{w} {s * 1000:.0f} ms" for w, s in rows[-1]["kubectl_inside"]["requests"])
        )
    echo(
        "  tabby-node over the run: "
        + "; ".join(
            f"{m} {a['policy_applies']} policy applies x {a['apply_mean_s'] * 1000:.1f} ms, "
            f"{a['reconciles']} passes x {a['reconcile_mean_s'] * 1000:.1f} ms"
            for m, a in applies.items()
        )
    )
    return {
        "rounds": rows,
        "every_node": summary(every),
        "kubectl": summary(kubectl),
        "api": summary(api),
        "datastore": summary(ds),
        "per_node": {m: summary(v) for m, v in per_node.items()},
        "allow_every_node": summary(col("allow_every_node_s")),
        "steps": {k: summary(v) for k, v in steps.items()},
        "kubectl_inside": {k: summary(v) for k, v in inside.items()},
        "tabby_node": applies,
    }


# == pod start =====================================================================================


def ptp_conflist(index: int) -> tuple[Doc, ipaddress.IPv4Network]:
    """Debian's ptp + host-local for node ``index`` (0-based): a /24 of its own in
    10.250.0.0/16 (tabby's pool is 10.244.0.0/16), no masquerade (like tabby)."""
    subnet = ipaddress.IPv4Network(f"10.250.{index + 1}.0/24")
    doc: Doc = {
        "cniVersion": "1.0.0",
        "name": "bench-ptp",
        "plugins": [
            {
                "type": "ptp",
                "ipMasq": False,
                "mtu": 1500,
                "ipam": {
                    "type": "host-local",
                    "dataDir": "/var/lib/cni/bench-host-local",
                    "ranges": [[{"subnet": str(subnet)}]],
                    "routes": [{"dst": "0.0.0.0/0"}],
                },
            }
        ],
    }
    return doc, subnet


class PodWatch:
    """Pods of a namespace through an ApiWatch: when each was first Running with an address,
    and when it was deleted."""

    def __init__(self, lab: KubeLab, ns: str) -> None:
        self.running: dict[str, tuple[float, str]] = {}
        self.deleted: dict[str, float] = {}
        self.lock = threading.Condition()
        self.watch = ApiWatch(lab, f"/api/v1/namespaces/{ns}/pods", self._event)

    def _event(self, kind: str, obj: Doc, t: float) -> None:
        name = str((obj.get("metadata") or {}).get("name"))
        with self.lock:
            if kind == "DELETED":
                self.deleted[name] = t
            elif (
                name not in self.running
                and (obj.get("status") or {}).get("phase") == "Running"
                and status_ip(obj)
            ):
                self.running[name] = (t, status_ip(obj))
            self.lock.notify_all()

    def wait(self, what: Callable[[], T | None], timeout: float, label: str) -> T:
        deadline = time.monotonic() + timeout
        with self.lock:
            while (value := what()) is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise LabError(f"timed out after {timeout:.0f} s waiting for {label}")
                self.lock.wait(min(left, 0.5))
            return value

    def close(self) -> None:
        self.watch.close()


class RouteMonitor:
    """``ip -4 monitor route`` in a node's namespace: when each host route (a pod's /32 to
    its host-side veth, what both tabby and ptp add at the end of an ADD) appeared. Started
    in a session of its own, stopped by PID."""

    def __init__(self, netns: str) -> None:
        self.appeared: dict[str, list[float]] = {}
        self.lock = threading.Lock()
        self.proc = subprocess.Popen(
            ["ip", "-n", netns, "-4", "monitor", "route"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.thread = threading.Thread(target=self._read, name="route monitor", daemon=True)
        self.thread.start()
        time.sleep(0.2)  # subscribed before anything is measured

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            now = time.monotonic()
            words = line.split()
            if not words or words[0] == "Deleted":
                continue
            dst = words[0].removesuffix("/32")
            try:
                ipaddress.IPv4Address(dst)
            except ValueError:
                continue
            with self.lock:
                self.appeared.setdefault(dst, []).append(now)

    def first(self, ip: str, since: float) -> float | None:
        with self.lock:
            later = [t for t in self.appeared.get(ip, []) if t >= since]
        return min(later) if later else None

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.thread.join(2)


def case_pod_start(args: argparse.Namespace) -> dict[str, Any]:
    with kube_lab_with_controllers("pod-start", args) as (lab, _controllers, info):
        node = args.node
        index = [n.name for n in lab.nodes].index(node)
        kn = lab.kube_node(node)
        conf_path = kn.path(knode.CONFLIST)
        tabby_text = conf_path.read_text()
        ptp_doc, ptp_net = ptp_conflist(index)
        texts = {"tabby": tabby_text, "ptp": json.dumps(ptp_doc, indent=2) + "\n"}
        expected: dict[str, Any] = {"tabby": TABBY_POOL, "ptp": ptp_net}
        links = [kn.path(f"{knode.CNI_BIN}/{p}") for p in ("ptp", "host-local")]
        ns = "kb-start"
        make_namespace(lab, ns)
        watch = PodWatch(lab, ns)
        from stores.kube.client import KubeClient, KubeConfig

        api = KubeClient(KubeConfig.load(str(lab.admin_kubeconfig)))
        pool = netns_pool(f"/run/netns/{lab.nodes[0].netns}")
        current = "tabby"
        pairs: list[dict[str, Any]] = []
        discarded: list[str] = []
        before = node_metrics(lab, node)
        routes = RouteMonitor(lab.node(node).netns)
        spy = PySpy(args.py_spy, agent_pid(lab, node), args.py_spy_out) if args.py_spy else None
        try:
            for link, name in zip(links, ("ptp", "host-local"), strict=True):
                os.symlink(f"/usr/lib/cni/{name}", link)

            def switch(to: str) -> None:
                nonlocal current
                if to == current:
                    return
                tmp = conf_path.with_name(".kube-bench.tmp")  # no .conf*: libcni skips it
                tmp.write_text(texts[to])
                os.replace(tmp, conf_path)
                current = to
                time.sleep(args.settle)  # containerd's CRI reloads the directory on change

            def one(label: str, name: str) -> dict[str, Any]:
                switch(label)
                doc = lab.sleeper_pod(name, ns, {"bench": "pod-start", "cni": label}, nodeName=node)
                # kubelet learns that a container runs from its PLEG relist, once a second:
                # create -> Running is quantized by it. A random phase (0-1 s) before each
                # create makes every pod's offset to that tick independent of the last one.
                time.sleep(secrets.randbelow(1000) / 1000)
                scraped = node_metrics(lab, node) if label == "tabby" else {}

                def create() -> float:
                    t0 = time.monotonic()
                    api.create(f"/api/v1/namespaces/{ns}/pods", doc)
                    return t0

                t0 = pool.submit(create).result()
                t_run, ip = watch.wait(lambda: watch.running.get(name), 180, f"{name} Running")
                # Not grace 0: the object would go at once, and kubelet, not yet knowing, may
                # start a second sandbox for it (Attempt 1) after the conflist was swapped:
                # an ADD of the other plugin for a pod the API no longer has (seen here).
                pool.submit(
                    api.request,
                    "DELETE",
                    f"/api/v1/namespaces/{ns}/pods/{name}",
                    body={"gracePeriodSeconds": 5},
                ).result()
                watch.wait(lambda: watch.deleted.get(name), 120, f"{name} deleted")
                t_net = routes.first(ip, t0)
                wait_route_gone(lab, node, ip, 60)  # the CNI DEL ran: the config may change
                add = (
                    hist_delta(
                        scraped,
                        node_metrics(lab, node),
                        "tabby_cni_request_duration_seconds",
                        '{verb="ADD"}',
                    )
                    if scraped
                    else (0, float("nan"))
                )
                return {
                    "": t_run - t0,
                    "_net": None if t_net is None else t_net - t0,
                    "_ip": ip,
                    "_t0": t0,
                    "_run_at": t_run,
                    "_net_at": t_net,
                    "_add_in_node": add[1] if add[0] == 1 else None,
                    "_cycle": time.monotonic() - t0,
                }

            total = args.warmup + args.pairs
            i = attempts = 0
            while i < total and attempts < total + 10:
                attempts += 1
                pair: dict[str, Any] = {"warmup": i < args.warmup, "load": load()}
                for label in ("tabby", "ptp"):
                    pair["names"] = {**pair.get("names", {}), label: f"{label}-{attempts}"}
                    for suffix, value in one(label, f"{label}-{attempts}").items():
                        pair[f"{label}{suffix}"] = value
                wrong = [
                    f"{label} pod got {pair[f'{label}_ip']}"
                    for label in ("tabby", "ptp")
                    if ipaddress.ip_address(pair[f"{label}_ip"]) not in expected[label]
                ]
                if wrong:
                    discarded.append(", ".join(wrong))
                    echo(f"  pair {attempts}: discarded ({', '.join(wrong)}): raise --settle")
                    continue
                i += 1
                pairs.append(pair)
                node_add = pair["tabby_add_in_node"]
                echo(
                    f"  pair {i:2d}{' (warm-up)' if pair['warmup'] else '          '}: "
                    f"tabby {pair['tabby']:.2f} s (network {_ms(pair['tabby_net'])}, ADD in "
                    f"tabby-node {_ms(node_add)}, {pair['tabby_ip']})  ptp {pair['ptp']:.2f} s"
                    f" (network {_ms(pair['ptp_net'])}, {pair['ptp_ip']})  cycle "
                    f"{pair['tabby_cycle'] + pair['ptp_cycle']:.0f} s  load {pair['load']}"
                )
        finally:
            after = node_metrics(lab, node)
            # tabby's conflist back (atomically, like the swaps), the extra plugins unlinked
            tmp = conf_path.with_name(".kube-bench.tmp")
            tmp.write_text(tabby_text)
            os.replace(tmp, conf_path)
            for link in links:
                with contextlib.suppress(FileNotFoundError):
                    link.unlink()
            routes.close()
            if spy is not None:
                spy.stop()
            pool.shutdown()
            api.close()
            watch.close()
        restored = conf_path.read_text() == tabby_text
        # tabby-node holds an ADD until the controllers have mirrored the pod's labels (no
        # window for a policy): it logs every wait over 50 ms
        node_log = kn.read("/var/log/tabby/node.log", limit=5_000_000)
        waits = {
            m.group(1): int(m.group(2)) / 1000
            for m in re.finditer(rf"pod {ns}/(\S+): waited (\d+) ms", node_log)
        }
        result = pod_start_report(pairs, before, after, node, args)
        result["label_waits"] = waits
        if args.logs:
            keep_logs(lab, node, args.logs)
        cri = cri_times(Path(lab.node(node).workdir, "containerd.log").read_text(), ns)
        result["steps"] = pod_start_steps(pairs, cri, time.time() - time.monotonic())
        if spy is not None:
            result["py_spy"] = spy.report()
        if waits:
            echo(
                f"  ADDs held for the pod's labels (over 50 ms, warm-up included): {len(waits)}"
                f" of {len(pairs) + len(discarded)} tabby pods: "
                + ", ".join(f"{n} {w * 1000:.0f} ms" for n, w in sorted(waits.items()))
            )
        else:
            echo("  no ADD was held over 50 ms for the pod's labels")
        result.update(discarded=discarded, conflist_restored=restored)
        echo(f"  tabby's conflist put back on {node}: {'yes' if restored else 'NO'}")
    result.update(info)
    return result


CRI_LINE = re.compile(r'^time="([^"]+)" level=\w+ msg="(.*)"\s*$')
SANDBOX_META = re.compile(
    r"PodSandboxMetadata\{Name:([^,]+),Uid:[^,]*,Namespace:([^,]+),Attempt:(\d+),"
)


def _rfc3339(text: str) -> float | None:
    """containerd's time (RFC 3339, nanoseconds) as epoch seconds."""
    m = re.match(r"(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:\.(\d+))?(Z|[+-]\d\d:\d\d)$", text)
    if m is None:
        return None
    zone = "+00:00" if m.group(3) == "Z" else m.group(3)
    whole = datetime.datetime.fromisoformat(m.group(1) + zone).timestamp()
    return whole + float("0." + (m.group(2) or "0"))


def cri_times(text: str, ns: str) -> dict[str, dict[str, float]]:
    """Per pod of ``ns``, from containerd's log (level info: every CRI call, logged when it
    is asked and when it returns): when kubelet asked for its sandbox (``sandbox_start``),
    when the sandbox was there (``sandbox_end``: runc's pause and the CNI ADD done), when
    its container was created and started (epoch seconds)."""
    out: dict[str, dict[str, float]] = {}
    sandboxes: dict[str, str] = {}  # sandbox id -> pod
    containers: dict[str, str] = {}  # container id -> pod
    for line in text.splitlines():
        m = CRI_LINE.match(line)
        at = _rfc3339(m.group(1)) if m else None
        if m is None or at is None:
            continue
        msg = m.group(2).replace('\\"', '"')
        if msg.startswith("RunPodSandbox for "):
            meta = SANDBOX_META.search(msg)
            if meta is None or meta.group(2) != ns or meta.group(3) != "0":
                continue  # a later attempt is not the pod's start
            times = out.setdefault(meta.group(1), {})
            returned = re.search(r'returns sandbox id "([0-9a-f]+)"', msg)
            if returned:
                times["sandbox_end"] = at
                sandboxes[returned.group(1)] = meta.group(1)
            elif " returns " not in msg and "failed" not in msg:
                times.setdefault("sandbox_start", at)
        elif msg.startswith("CreateContainer within sandbox "):
            made = re.search(r'sandbox "([0-9a-f]+)".* returns container id "([0-9a-f]+)"', msg)
            if made and made.group(1) in sandboxes:
                containers[made.group(2)] = sandboxes[made.group(1)]
                out[sandboxes[made.group(1)]]["created"] = at
        elif msg.startswith("StartContainer for "):
            started = re.search(r'StartContainer for "([0-9a-f]+)" returns successfully', msg)
            if started and started.group(1) in containers:
                out[containers[started.group(1)]]["started"] = at
    return out


STEPS = (
    ("created -> kubelet asks containerd for the sandbox", "_t0", "sandbox_start"),
    ("-> the pod's route on the node (pause, CNI ADD)", "sandbox_start", "_net_at"),
    ("-> the sandbox returned (rest of ADD, containerd)", "_net_at", "sandbox_end"),
    ("-> its container created and started", "sandbox_end", "started"),
    ("-> Running with an address in the API (PLEG)", "started", "_run_at"),
)


def pod_start_steps(
    pairs: list[dict[str, Any]], cri: dict[str, dict[str, float]], wall_minus_mono: float
) -> dict[str, Any]:
    """Where each measured pod's start went, step by step (p50 per plugin): the bench's own
    times (monotonic) and containerd's (wall clock, moved to monotonic)."""
    steps: dict[str, dict[str, list[float]]] = {label: {} for label, _, _ in STEPS}
    for pair in pairs:
        if pair["warmup"]:
            continue
        for cni in ("tabby", "ptp"):
            times = {k: v - wall_minus_mono for k, v in cri.get(pair["names"][cni], {}).items()}
            times.update({k: pair[f"{cni}{k}"] for k in ("_t0", "_net_at", "_run_at")})
            for label, a, b in STEPS:
                if times.get(a) is not None and times.get(b) is not None:
                    steps[label].setdefault(cni, []).append(times[b] - times[a])
    echo("  where a pod start goes (containerd's CRI log; p50 of each step):")
    echo(f"    {'':52s}  tabby      ptp   tabby-ptp")
    out: dict[str, Any] = {}
    for label, values in steps.items():
        t, p = values.get("tabby", []), values.get("ptp", [])
        if not t or not p:
            echo(f"    {label:52s}  (not in containerd's log)")
            continue
        echo(
            f"    {label:52s} {pct(t, 50) * 1000:5.0f} ms {pct(p, 50) * 1000:5.0f} ms"
            f" {(pct(t, 50) - pct(p, 50)) * 1000:+6.0f} ms"
        )
        out[label] = {"tabby": summary(t), "ptp": summary(p)}
    # create -> container started: the start without kubelet's PLEG relist (1 s period),
    # whose quantization is most of the noise of create -> Running
    started = steps.get("created -> kubelet asks containerd for the sandbox", {})
    before_pleg = {
        cni: [
            sum(parts)
            for parts in zip(
                *(steps[label].get(cni, []) for label, _, _ in STEPS[:4]), strict=False
            )
        ]
        for cni in ("tabby", "ptp")
    }
    if started and all(len(v) == len(started.get(k, [])) for k, v in before_pleg.items()):
        t, p = before_pleg["tabby"], before_pleg["ptp"]
        if t and p:
            echo(
                f"    {'create -> container started (no PLEG): ratio of the p50s':52s}"
                f" {pct(t, 50) * 1000:5.0f} ms {pct(p, 50) * 1000:5.0f} ms"
                f"  {pct(t, 50) / pct(p, 50):.2f}x"
            )
            out["before_pleg"] = {
                "tabby": summary(t),
                "ptp": summary(p),
                "ratio_p50": pct(t, 50) / pct(p, 50),
            }
    adds = [p["tabby_add_in_node"] for p in pairs if not p["warmup"] and p["tabby_add_in_node"]]
    echo(f"    of which the ADD inside tabby-node (its histogram, per pod): {ms(adds)}")
    out["add_in_tabby_node"] = summary(adds)
    return out


def keep_logs(lab: KubeLab, node: str, where: str) -> None:
    """The node's containerd, kubelet, tabby-node and CNI logs copied to ``where``."""
    out = Path(where)
    out.mkdir(parents=True, exist_ok=True)
    kn = lab.kube_node(node)
    sources = {
        "containerd.log": Path(lab.node(node).workdir, "containerd.log"),
        "kubelet.log": Path(lab.node(node).workdir, "kubelet.log"),
        "tabby-node.log": kn.path("/var/log/tabby/node.log"),
        "tabby-cni.log": kn.path("/var/log/tabby/cni.log"),
    }
    for name, path in sources.items():
        try:
            (out / f"{node}-{name}").write_bytes(path.read_bytes())
        except OSError as e:
            echo(f"  {name}: not kept ({e})")
    echo(f"  {node}'s logs kept in {out}")


def agent_pid(lab: KubeLab, node: str) -> int:
    """tabby-node's PID on ``node`` (nsenter execs it: the lab's process is tabby-node)."""
    agent = lab.node(node).agent
    if agent is None:
        raise LabError(f"no tabby-node on {node}")
    return agent.pid


class PySpy:
    """``py-spy record`` of a process while the pods start (raw collapsed stacks, active
    threads only: the samples are where its threads were busy); stopped by PID (SIGINT:
    py-spy writes its file then)."""

    def __init__(self, binary: str, pid: int, out: str) -> None:
        self.out = out
        self.proc = subprocess.Popen(
            [
                *(binary, "record", "--pid", str(pid), "--rate", "200", "--format", "raw"),
                *("--output", out, "--nonblocking"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        time.sleep(0.5)
        if self.proc.poll() is not None:
            err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
            raise LabError(f"py-spy exited at once: {err.strip()[-400:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def report(self, top: int = 12) -> dict[str, Any]:
        """Samples per function (inclusive: once per stack it is on), the busiest first."""
        total = 0
        inclusive: dict[str, int] = {}
        try:
            text = Path(self.out).read_text(errors="replace")
        except OSError as e:
            echo(f"  py-spy: no profile ({e})")
            return {}
        for line in text.splitlines():
            stack, _, count = line.rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = {re.sub(r":\d+\)$", ")", f) for f in stack.split(";")[1:]}
            for f in frames:
                inclusive[f] = inclusive.get(f, 0) + n
        busiest = sorted(inclusive.items(), key=lambda kv: -kv[1])[:top]
        echo(f"  py-spy on tabby-node ({self.out}): {total} samples of busy threads at 200/s")
        for frame, n in busiest:
            echo(f"    {n * 100 / max(total, 1):5.1f} %  {frame[:110]}")
        return {"samples": total, "inclusive": dict(busiest)}


def wait_route_gone(lab: KubeLab, node: str, ip: str, timeout: float) -> None:
    """Until the node has no route to ``ip`` (both plugins route a pod's /32 to its host-side
    veth; the DEL removes the veth and the route with it)."""
    netns = lab.node(node).netns

    def gone() -> bool:
        proc = run(
            ["ip", "-n", netns, "-4", "route", "show", "exact", f"{ip}/32"],
            capture_output=True,
            text=True,
        )
        return proc.returncode == 0 and not proc.stdout.strip()

    lab.wait_for(f"the route to {ip} on {node} gone (CNI DEL)", gone, timeout, interval=0.1)


def pod_start_report(
    pairs: list[dict[str, Any]],
    before: dict[str, float],
    after: dict[str, float],
    node: str,
    args: argparse.Namespace,
) -> dict[str, Any]:
    measured = [p for p in pairs if not p["warmup"]]
    adds, add_mean = hist_delta(before, after, "tabby_cni_request_duration_seconds", '{verb="ADD"}')
    dels, del_mean = hist_delta(before, after, "tabby_cni_request_duration_seconds", '{verb="DEL"}')
    echo(
        f"\npod-start: created through the API -> Running with an address, on {node}, "
        f"{len(measured)} pairs (+{args.warmup} warm-up), A B A B"
    )
    echo(f"  {'':52s}      p50        p90")
    out: dict[str, Any] = {"node": node, "pairs": pairs}
    for suffix, what in (("", "Running with an address"), ("_net", "its route on the node")):
        times = {
            label: [p[f"{label}{suffix}"] for p in measured if p[f"{label}{suffix}"] is not None]
            for label in ("tabby", "ptp")
        }
        ratios = [
            p[f"tabby{suffix}"] / p[f"ptp{suffix}"]
            for p in measured
            if p[f"tabby{suffix}"] is not None and p[f"ptp{suffix}"]
        ]
        ratio = pct(times["tabby"], 50) / pct(times["ptp"], 50) if times["ptp"] else float("nan")
        echo(f"  {'create -> ' + what + ', tabby':52s} {secs(times['tabby'])}")
        echo(f"  {'create -> ' + what + ', ptp + host-local':52s} {secs(times['ptp'])}")
        echo(
            f"    tabby/ptp: ratio of the p50s {ratio:.2f}, p50 of the per-pair ratios "
            f"{pct(ratios, 50):.2f}" + ("  (target <= 1.1)" if not suffix else "")
        )
        key = "running" if not suffix else "network"
        out[key] = {
            "tabby": summary(times["tabby"]),
            "ptp": summary(times["ptp"]),
            "ratio_p50": ratio,
            "pair_ratio": summary(ratios),
        }
    echo(
        f"  tabby-node on {node} during the run: {adds} ADDs served x {add_mean * 1000:.0f} ms "
        f"(mean), {dels} DELs x {del_mean * 1000:.0f} ms (warm-up included)"
    )
    out["tabby_node_add"] = {"count": adds, "mean_s": add_mean}
    out["tabby_node_del"] = {"count": dels, "mean_s": del_mean}
    return out


# == controllers ===================================================================================


class Mirror:
    """What of a namespace's pods the API and tabby's datastore hold. Conditions registered
    with ``expect`` are checked on every event, so the time one first held is the time of
    the event that made it true (not of whoever asked later); per pod, when the API first
    showed its address and when the mirror did, when each was deleted."""

    def __init__(self, ns: str) -> None:
        self.ns = ns
        self.api_pods: dict[str, str] = {}  # name -> address ("" until Running with one)
        self.store_pods: dict[str, str] = {}  # name -> address in the mirror
        self.weps: set[str] = set()
        self.created: dict[str, float] = {}  # name -> when the API first showed the pod
        self.terminating: dict[str, float] = {}  # name -> when it first had a deletionTimestamp
        self.gone: dict[str, float] = {}  # name -> when the API deleted it
        self.api_ip: dict[str, float] = {}  # name -> when the API first showed it Running + IP
        self.store_ip: dict[str, float] = {}  # name -> when its mirror first had the address
        self.store_gone: dict[str, float] = {}  # name -> when its mirror was deleted
        self.lock = threading.Condition()
        self._expected: dict[str, Callable[[], bool]] = {}
        self.reached: dict[str, float] = {}

    def expect(self, name: str, condition: Callable[[], bool]) -> None:
        with self.lock:
            self._expected[name] = condition
            self._check(time.monotonic())

    def _check(self, t: float) -> None:
        for name, condition in list(self._expected.items()):
            if condition():
                self.reached[name] = t
                del self._expected[name]
        self.lock.notify_all()

    def on_api(self, kind: str, obj: Doc, t: float) -> None:
        meta = obj.get("metadata") or {}
        name = str(meta.get("name"))
        with self.lock:
            self.created.setdefault(name, t)
            if meta.get("deletionTimestamp"):
                self.terminating.setdefault(name, t)
            if kind == "DELETED":
                self.api_pods.pop(name, None)
                self.gone[name] = t
            else:
                running = (obj.get("status") or {}).get("phase") == "Running"
                self.api_pods[name] = status_ip(obj) if running else ""
                if self.api_pods[name]:
                    self.api_ip.setdefault(name, t)
            self._check(t)

    def on_store(self, event: Any, t: float) -> None:
        prefix = f"{self.ns}/"
        with self.lock:
            if event.type == "snapshot":
                snap = event.snapshot or {}
                self.store_pods = {
                    k.removeprefix(prefix): _mirror_ip(d.data)
                    for k, d in snap.get("pod", {}).items()
                    if k.startswith(prefix)
                }
                self.weps = {k for k in snap.get("workloadendpoint", {}) if k.startswith(prefix)}
            elif event.key.startswith(prefix):
                name = event.key.removeprefix(prefix)
                if event.kind == "pod":
                    if event.type == "put" and event.doc is not None:
                        self.store_pods[name] = _mirror_ip(event.doc.data)
                        if self.store_pods[name]:
                            self.store_ip.setdefault(name, t)
                    else:
                        self.store_pods.pop(name, None)
                        self.store_gone[name] = t
                elif event.kind == "workloadendpoint":
                    if event.type == "put":
                        self.weps.add(event.key)
                    else:
                        self.weps.discard(event.key)
            self._check(t)

    def wait(self, name: str, timeout: float) -> float | None:
        """When the condition ``name`` first held (None: not within ``timeout``)."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while name not in self.reached:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.lock.wait(min(left, 0.5))
            return self.reached[name]

    def lags(self, api: dict[str, float], store: dict[str, float]) -> list[float]:
        """Per pod: from the API's event to the mirror's (the controllers' part)."""
        with self.lock:
            return [store[n] - t for n, t in api.items() if n in store]

    def counts(self) -> str:
        with self.lock:
            running = sum(1 for ip in self.api_pods.values() if ip)
            mirrored = sum(1 for ip in self.store_pods.values() if ip)
            return (
                f"API {len(self.api_pods)} pods ({running} Running), datastore "
                f"{len(self.store_pods)} mirrored ({mirrored} with address), "
                f"{len(self.weps)} endpoints"
            )


def _since(t: float | None, since: float) -> float | None:
    return None if t is None else t - since


def _first(times: dict[str, float], since: float) -> float | None:
    after = [t - since for t in times.values() if t >= since]
    return min(after) if after else None


def _last(times: dict[str, float], since: float) -> float | None:
    after = [t - since for t in times.values() if t >= since]
    return max(after) if after else None


def _mirror_ip(data: Doc) -> str:
    ips = ((data.get("status") or {}).get("podIPs")) or []
    return str(ips[0].get("ip", "")) if ips and isinstance(ips[0], dict) else ""


def case_controllers(args: argparse.Namespace) -> dict[str, Any]:
    if args.datastore == "kubernetes":
        echo("controllers: their work is the mirror into etcd (--datastore etcdv3); skipped")
        return {"skipped": "the Kubernetes datastore mirrors nothing"}
    with kube_lab_with_controllers("controllers", args) as (lab, controllers, info):
        ns, count = "kb-load", args.pods
        leader = controllers.wait_leader()
        pids: dict[str, int] = {}
        identities: dict[str, str] = {}
        for identity, replica in controllers.replicas.items():
            assert replica.proc is not None
            pid = replica.proc.pid
            extra = children(pid)
            if extra:
                echo(f"  note: {identity} (PID {pid}) has children {extra}: not counted")
            name = f"{'leader' if identity == leader else 'standby'} ({identity})"
            pids[name], identities[name] = pid, identity
        make_namespace(lab, ns)
        mirror = Mirror(ns)
        phases: dict[str, Any] = {}
        loads: dict[str, float] = {}  # the 1-minute load at the end of each phase
        metrics: dict[str, dict[str, float]] = {}
        with contextlib.ExitStack() as stack:
            sampler = Sampler(pids)
            stack.callback(sampler.close)
            stack.callback(ApiWatch(lab, f"/api/v1/namespaces/{ns}/pods", mirror.on_api).close)
            watch = StoreWatch(lab, ["pod", "workloadendpoint"], mirror.on_store)
            stack.callback(watch.close)

            def phase(name: str, start: Any) -> dict[str, Any]:
                """The window from ``start`` to now, with each replica's work queue now."""
                window: dict[str, Any] = sampler.window(start, sampler.mark())
                for replica, values in window.items():
                    m = controllers.metrics(identities[replica])
                    values["queue"] = m.get("tabby_controllers_queue")
                phases[name] = window
                loads[name] = os.getloadavg()[0]
                return window

            echo(f"  at rest: {args.rest:.0f} s")
            start = sampler.mark()
            time.sleep(args.rest)
            phase("rest", start)
            metrics["before"] = controllers.metrics(leader)

            echo(f"  a Deployment of {count} busybox pods over 3 nodes; load {load()}")
            deployment = lab.web_deployment("load", ns, count)
            m = mirror
            m.expect("mirrored", lambda: len(m.store_pods) >= count)
            m.expect("api", lambda: sum(1 for ip in m.api_pods.values() if ip) >= count)
            m.expect("done", lambda: sum(1 for ip in m.store_pods.values() if ip) >= count)
            start = sampler.mark()
            t0 = start[0]
            lab.apply(deployment)
            for what in ("mirrored", "api", "done"):
                m.wait(what, max(1.0, t0 + args.timeout - time.monotonic()))
            phase("create", start)["times"] = {
                "every_pod_object_created_s": _last(m.created, t0),
                "all_mirrored_s": _since(m.reached.get("mirrored"), t0),
                "all_running_with_address_in_the_api_s": _since(m.reached.get("api"), t0),
                "all_mirrored_with_address_s": _since(m.reached.get("done"), t0),
            }
            created_lags = m.lags(m.api_ip, m.store_ip)
            phases["create"]["mirror_lag"] = summary(created_lags)
            echo(f"    {m.counts()}")
            metrics["created"] = controllers.metrics(leader)

            echo(f"  deleting the Deployment; load {load()}")
            m.expect("api_gone", lambda: not m.api_pods)
            m.expect("gone", lambda: not m.api_pods and not m.store_pods and not m.weps)
            start = sampler.mark()
            t0 = start[0]
            lab.kubectl("delete", "deployment", "-n", ns, "load", "--wait=false")
            for what in ("api_gone", "gone"):
                m.wait(what, max(1.0, t0 + args.timeout - time.monotonic()))
            phase("delete", start)["times"] = {
                "first_pod_terminating_s": _first(m.terminating, t0),
                "every_pod_terminating_s": _last(m.terminating, t0),
                "first_pod_gone_s": _first(m.gone, t0),
                "all_gone_from_the_api_s": _since(m.reached.get("api_gone"), t0),
                "everything_gone_s": _since(m.reached.get("gone"), t0),
            }
            phases["delete"]["mirror_lag"] = summary(m.lags(m.gone, m.store_gone))
            echo(f"    {m.counts()}")
            metrics["deleted"] = controllers.metrics(leader)

            echo(f"  at rest again: {args.rest:.0f} s")
            start = sampler.mark()
            time.sleep(args.rest)
            phase("rest_after", start)
            hwm = {name: proc_status(pid, "VmHWM") for name, pid in pids.items()}
            still_leads = controllers.leader()
        result = controllers_report(phases, metrics, hwm, count, leader, still_leads)
        result.update({f"load_{k}": f"{v:.1f}" for k, v in loads.items()})
    result.update(info)
    return result


def _writes(before: dict[str, float], after: dict[str, float]) -> str:
    out = []
    for k, v in sorted(after.items()):
        if k.startswith("tabby_controllers_writes_total") and v - before.get(k, 0) > 0:
            labels = k.partition("{")[2].rstrip("}").replace('"', "")
            out.append(f"{labels} {v - before.get(k, 0):.0f}")
    requests = after.get("tabby_controllers_api_requests_total", 0) - before.get(
        "tabby_controllers_api_requests_total", 0
    )
    return ", ".join(out) + f"; API requests {requests:.0f}"


def controllers_report(
    phases: dict[str, Any],
    metrics: dict[str, dict[str, float]],
    hwm: dict[str, float | None],
    count: int,
    leader: str,
    still_leads: str | None,
) -> dict[str, Any]:
    echo(
        f"\ncontrollers: tabby-kube-controllers' CPU and RSS ({leader} led; "
        f"at the end: {still_leads})"
    )
    titles = {
        "rest": "at rest",
        "create": f"{count} pods created",
        "delete": "Deployment deleted",
        "rest_after": "at rest again",
    }
    for phase, title in titles.items():
        window = phases.get(phase) or {}
        for name, v in window.items():
            if name in ("times", "mirror_lag"):
                continue
            echo(
                f"  {title:20s} {name:22s} {v['seconds']:6.1f} s  CPU {v['cpu_s']:6.2f} s "
                f"({v['cpu_pct']:5.1f} % of a core)  RSS {v['rss_mb']:5.1f} MB "
                f"(peak {v['rss_peak_mb']:.1f})  {v['wakeups_per_s']:5.0f} wake-ups/s"
                + (f"  queue {v['queue']:.0f}" if v.get("queue") is not None else "")
            )
        lag = window.get("mirror_lag")
        if lag and lag["n"]:
            echo(
                f"  {'':20s} per pod, the API's event -> the mirror's: p50 "
                f"{lag['p50'] * 1000:.0f} ms, p90 {lag['p90'] * 1000:.0f} ms, "
                f"max {lag['max'] * 1000:.0f} ms ({lag['n']} pods)"
            )
        for k, t in (window.get("times") or {}).items():
            echo(
                f"  {'':20s} {k.removesuffix('_s').replace('_', ' ')}: "
                + ("-" if t is None else f"{t:.1f} s")
            )
    if "before" in metrics and "created" in metrics:
        echo(f"  leader's writes while creating: {_writes(metrics['before'], metrics['created'])}")
    if "created" in metrics and "deleted" in metrics:
        echo(f"  leader's writes while deleting: {_writes(metrics['created'], metrics['deleted'])}")
    echo(
        "  VmHWM (the process's peak RSS): "
        + ", ".join(f"{k} {v:.1f} MB" for k, v in hwm.items() if v)
    )
    return {"phases": phases, "vm_hwm_mb": hwm, "leader": leader, "leader_at_end": still_leads}


# == the summary ===================================================================================


def _loads(values: list[float]) -> str:
    """The 1-minute load average over a measurement: its range."""
    if not values:
        return "-"
    return f"{min(values):.1f}-{max(values):.1f}"


def _ctl(window: dict[str, Any], role: str) -> str:
    for name, v in window.items():
        if name.startswith(role) and isinstance(v, dict) and "cpu_pct" in v:
            return (
                f"CPU {v['cpu_s']:.2f} s in {v['seconds']:.0f} s ({v['cpu_pct']:.1f} % of a core),"
                f" RSS {v['rss_mb']:.1f} MB (peak {v['rss_peak_mb']:.1f})"
            )
    return "-"


def print_summary(results: dict[str, Any]) -> None:
    """One table of the issue's numbers, each with the load average while it was measured
    (1-minute, the range over its rounds): on a shared machine a number means little
    without it."""
    rows: list[tuple[str, str, str, str]] = []
    policy = results.get("policy") or {}
    if "every_node" in policy:
        e = policy["every_node"]
        loads = [r["load1"] for r in policy["rounds"] if "load1" in r]
        tabby = (policy.get("steps") or {}).get("etcd -> last reply, slowest node (tabby-node)")
        api = (policy.get("steps") or {}).get("API -> mirror in tabby's etcd (controllers)")
        rows.append(
            (
                "policy: kubectl apply -> enforced on every node",
                f"p50 {e['p50'] * 1000:.0f} ms, p90 {e['p90'] * 1000:.0f} ms",
                "p50 <= 500 ms",
                _loads(loads),
            )
        )
        k = policy["kubectl"]
        rows.append(("  of which kubectl apply itself", f"p50 {k['p50'] * 1000:.0f} ms", "", ""))
        every_change = [r["every_node_s"] for r in policy["rounds"] if r.get("every_node_s")]
        labels_all = ((policy.get("labels") or {}).get("all")) or {}
        if labels_all.get("n"):
            rows.append(
                (
                    "policy, pod or namespace label -> in force on every node",
                    f"p99 {labels_all['p99'] * 1000:.0f} ms (policy apply p99 "
                    f"{pct(every_change, 99) * 1000:.0f} ms)",
                    "p99 <= 1 s",
                    "",
                )
            )
        if api and tabby and api["n"] and tabby["n"]:
            rows.append(
                (
                    "  API -> mirror (controllers) + -> enforced (tabby-node)",
                    f"p50 {api['p50'] * 1000:.0f} + {tabby['p50'] * 1000:.0f} ms",
                    "",
                    "",
                )
            )
    start = results.get("pod-start") or {}
    if "running" in start:
        r = start["running"]
        loads = [float(p["load"].split()[0]) for p in start["pairs"] if not p["warmup"]]
        rows.append(
            (
                "pod-start: create -> Running, tabby / ptp+host-local",
                f"{r['ratio_p50']:.2f}x (p50 {r['tabby']['p50']:.2f} s / {r['ptp']['p50']:.2f} s,"
                f" {r['tabby']['n']} pairs)",
                "<= 1.1x",
                _loads(loads),
            )
        )
        b = (start.get("steps") or {}).get("before_pleg") or {}
        if b:
            rows.append(
                (
                    "  create -> container started (before kubelet's PLEG)",
                    f"{b['ratio_p50']:.2f}x (p50 {b['tabby']['p50'] * 1000:.0f} ms / "
                    f"{b['ptp']['p50'] * 1000:.0f} ms)",
                    "",
                    "",
                )
            )
        n = start.get("network") or {}
        if n:
            rows.append(
                (
                    "  create -> the pod's route on the node",
                    f"{n['ratio_p50']:.2f}x (p50 {n['tabby']['p50'] * 1000:.0f} ms / "
                    f"{n['ptp']['p50'] * 1000:.0f} ms)",
                    "",
                    "",
                )
            )
    ctl = results.get("controllers") or {}
    phases = ctl.get("phases") or {}
    for phase, label in (("rest", "at rest"), ("create", "while 100 pods are created")):
        window = phases.get(phase) or {}
        if window:
            rows.append(
                (
                    f"controllers {label}: leader",
                    _ctl(window, "leader"),
                    "",
                    ctl.get("load_" + phase, "-"),
                )
            )
            rows.append(("  standby", _ctl(window, "standby"), "", ""))
    burst = results.get("burst") or {}
    if "pods" in burst:
        last = burst.get("last_add_after_first_add_s")
        asked = burst.get("last_add_after_first_s")
        rows.append(
            (
                f"burst: {burst['pods']} pods on one node, last ADD answered",
                "-"
                if last is None or asked is None
                else f"{last:.2f} s after the first ({asked:.2f} s after the first sandbox asked)",
                "<= 5 s",
                str(burst.get("load_after", "-")),
            )
        )
        if burst.get("served_add_mean_s") is not None:
            rows.append(
                (
                    "  of which inside tabby-node, per ADD (mean)",
                    f"{burst['served_add_mean_s'] * 1000:.0f} ms ({burst['adds_served']} served)",
                    "",
                    "",
                )
            )
        rows.append(
            (
                f"  tabby's datastore writes ({burst['datastore']}), reads per ADD",
                f"{burst['tabby_node_store_writes']:.0f} writes, "
                f"{burst['reads_per_add']:.2f} reads/ADD",
                "< pods, 0",
                "",
            )
        )
        rows.append(
            (
                "  API server requests of group tabby.io",
                f"{burst['api_tabby_writes']:.0f} writes, {burst['api_tabby_reads']:.0f} reads",
                "",
                "",
            )
        )
    if not rows:
        return
    echo("\nkube_bench summary (load: the 1-minute load average while measured; 2 cores)")
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    head = ("", "measured", "target", "load")
    widths = [max(w, len(h)) for w, h in zip(widths, head, strict=True)]
    for row in (head, *rows):
        echo("  " + "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip())


# == burst =========================================================================================

WRITE_VERBS = ("POST", "PUT", "PATCH", "DELETE")
READ_VERBS = ("GET", "LIST")
LABEL = re.compile(r'(\w+)="([^"]*)"')
#: the plugin's "added" line (cni_protocol.log's format: time, pid, level, logger, [the call])
CNI_ADDED = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*\[ADD [^\]]*\] added ")


def labelled(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of counter ``name`` in a Prometheus text: its labels -> value."""
    out: dict[tuple[tuple[str, str], ...], float] = {}
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        labels, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[tuple(sorted(LABEL.findall(labels)))] = float(value)
    return out


def api_requests(lab: KubeLab) -> dict[tuple[str, str, str], float]:
    """The API server's apiserver_request_total by (verb, group, resource)."""
    text = str(lab.kubectl("get", "--raw", "/metrics").stdout)
    out: dict[tuple[str, str, str], float] = {}
    for labels, value in labelled(text, "apiserver_request_total").items():
        d = dict(labels)
        key = (d.get("verb", ""), d.get("group", ""), d.get("resource", ""))
        out[key] = out.get(key, 0.0) + value
    return out


def api_seconds(lab: KubeLab) -> dict[tuple[str, str, str], float]:
    """The API server's time spent answering (apiserver_request_duration_seconds_sum) by
    (verb, group, resource); with :func:`api_requests`, the mean time per request."""
    text = str(lab.kubectl("get", "--raw", "/metrics").stdout)
    out: dict[tuple[str, str, str], float] = {}
    for labels, value in labelled(text, "apiserver_request_duration_seconds_sum").items():
        d = dict(labels)
        key = (d.get("verb", ""), d.get("group", ""), d.get("resource", ""))
        out[key] = out.get(key, 0.0) + value
    return out


def store_requests(lab: KubeLab, node: str) -> dict[tuple[str, str], float]:
    """tabby-node's tabby_datastore_requests_total by (op, kind) on ``node``."""
    code, body = http_get(lab.node(node).netns, f"http://127.0.0.1:{NODE_METRICS}/metrics", 5)
    if code != 200:
        return {}
    out: dict[tuple[str, str], float] = {}
    for labels, value in labelled(
        body.decode(errors="replace"), "tabby_datastore_requests_total"
    ).items():
        d = dict(labels)
        out[(d.get("op", ""), d.get("kind", ""))] = value
    return out


def delta(after: dict[Any, float], before: dict[Any, float]) -> dict[Any, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0) > 0}


def cni_added_times(lab: KubeLab, node: str, since_wall: float) -> list[float]:
    """When each ADD on ``node`` since ``since_wall`` answered (wall clock): the plugin's
    "added" line in the node's CNI log (local time, milliseconds)."""
    return added_times(
        lab.kube_node(node).read("/var/log/tabby/cni.log", limit=20_000_000), since_wall
    )


def added_times(text: str, since_wall: float) -> list[float]:
    """The times of the "added" lines of a CNI log ``text`` at or after ``since_wall``."""
    out = []
    for line in text.splitlines():
        m = CNI_ADDED.match(line)
        if m is None:
            continue
        at = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S")) + int(m.group(2)) / 1000
        if at >= since_wall - 0.001:
            out.append(at)
    return sorted(out)


def by_verb(requests: dict[tuple[str, str, str], float], group: str | None) -> dict[str, float]:
    out: dict[str, float] = {}
    for (verb, g, _resource), n in requests.items():
        if group is None or g == group:
            out[verb] = out.get(verb, 0.0) + n
    return out


def case_burst(args: argparse.Namespace) -> dict[str, Any]:
    """``--burst`` pods created at once on ``--node`` (a Deployment bound to it), tabby-node
    warm (one pod started and deleted first): when every CNI ADD answered, counted from the
    first sandbox kubelet asked containerd for; the API server's requests during the burst
    by verb, group and resource (apiserver_request_total), tabby's among them (group
    tabby.io); tabby-node's calls of its datastore by op and kind; the same for the
    deletion."""
    with kube_lab_with_controllers("burst", args) as (lab, _controllers, info):
        ns, node, count = "kb-burst", args.node, args.burst
        make_namespace(lab, ns)
        lab.apply(lab.sleeper_deployment("warm", ns, 1, node))
        lab.wait_pods(ns, "app=warm", 1, timeout=180)
        lab.kubectl("delete", "deployment", "-n", ns, "warm", "--wait=true", timeout=120)
        lab.wait_for("the warm-up pod gone", lambda: not lab.get_pods(ns, "app=warm"), 120)
        time.sleep(2)
        api0, store0 = api_requests(lab), store_requests(lab, node)
        served0, seconds0 = node_metrics(lab, node), api_seconds(lab)
        wall0, t0 = time.time(), time.monotonic()
        lab.apply(lab.sleeper_deployment("burst", ns, count, node))
        pods = lab.wait_pods(ns, "app=burst", count, timeout=args.timeout)
        running_s = time.monotonic() - t0
        time.sleep(2)  # the last status updates
        api1, store1 = api_requests(lab), store_requests(lab, node)
        seconds = delta(api_seconds(lab), seconds0)
        served, served_mean = hist_delta(
            served0, node_metrics(lab, node), "tabby_cni_request_duration_seconds", '{verb="ADD"}'
        )
        log = Path(lab.node(node).workdir, "containerd.log").read_text(errors="replace")
        cri = cri_times(log, ns)
        asked = [t["sandbox_start"] for t in cri.values() if "sandbox_start" in t]
        added = cni_added_times(lab, node, wall0)
        first_asked = min(asked) if asked else wall0
        answered = [a - first_asked for a in added]
        ips = [ip for p in pods for ip in p.ips]
        burst_api, burst_store = delta(api1, api0), delta(store1, store0)
        t1 = time.monotonic()
        lab.kubectl("delete", "deployment", "-n", ns, "burst", "--wait=false")
        lab.wait_for("every burst pod gone", lambda: not lab.get_pods(ns, "app=burst"), 600)
        deleted_s = time.monotonic() - t1
        time.sleep(2)
        api2, store2 = api_requests(lab), store_requests(lab, node)
        del_api, del_store = delta(api2, api1), delta(store2, store1)
    tabby_api = {f"{v} {r}": n for (v, g, r), n in burst_api.items() if g == "tabby.io"}
    writes = sum(n for (op, _k), n in burst_store.items() if op in ("put", "delete"))
    reads = sum(n for (op, _k), n in burst_store.items() if op in ("get", "list"))
    api_writes = sum(
        n for (v, g, _r), n in burst_api.items() if g == "tabby.io" and v in WRITE_VERBS
    )
    api_reads = sum(n for (v, g, _r), n in burst_api.items() if g == "tabby.io" and v in READ_VERBS)
    result: dict[str, Any] = {
        "datastore": args.datastore,
        "pods": count,
        "distinct_ips": len(set(ips)),
        "running_s": running_s,
        "adds_logged": len(added),
        "add_answered_after_first_s": summary(answered),
        "last_add_after_first_s": max(answered) if answered else None,
        "last_add_after_first_add_s": max(answered) - min(answered) if answered else None,
        "adds_served": served,
        "served_add_mean_s": served_mean if served else None,
        "tabby_node_store_requests": {f"{op} {k}": n for (op, k), n in sorted(burst_store.items())},
        "tabby_node_store_writes": writes,
        "tabby_node_store_reads": reads,
        "reads_per_add": reads / count,
        "api_tabby_requests": tabby_api,
        "api_tabby_writes": api_writes,
        "api_tabby_reads": api_reads,
        "api_by_verb": by_verb(burst_api, None),
        "api_tabby_mean_ms": {
            f"{v} {r}": 1000 * seconds.get((v, g, r), 0.0) / n
            for (v, g, r), n in sorted(burst_api.items())
            if g == "tabby.io" and n and v != "WATCH"  # a watch's time is its whole life
        },
        "api_requests": {f"{v} {g or 'core'}/{r}": n for (v, g, r), n in sorted(burst_api.items())},
        "delete_s": deleted_s,
        "delete_store_requests": {f"{op} {k}": n for (op, k), n in sorted(del_store.items())},
        "delete_api_tabby": {f"{v} {r}": n for (v, g, r), n in del_api.items() if g == "tabby.io"},
    }
    echo(f"\nburst: {count} pods at once on {node}, tabby on {args.datastore}")
    echo(f"  every pod Running with an address    {running_s:6.1f} s ({len(set(ips))} addresses)")
    if answered:
        echo(
            f"  CNI ADD answered, from the first sandbox asked: first {min(answered):.2f} s, "
            f"p50 {pct(answered, 50):.2f} s, last {max(answered):.2f} s "
            f"({len(added)} ADDs logged); last {max(answered) - min(answered):.2f} s after "
            "the first answered (target <= 5 s)"
        )
    if served:
        echo(
            f"  of which inside tabby-node (its histogram): {served} ADDs served, "
            f"{served_mean * 1000:.0f} ms each on average"
        )
    echo(
        f"  tabby-node's datastore calls: {writes:.0f} writes, {reads:.0f} reads "
        f"({reads / count:.2f} per ADD): "
        + ", ".join(f"{k} {n:.0f}" for k, n in result["tabby_node_store_requests"].items())
    )
    echo(
        f"  API server, group tabby.io: {api_writes:.0f} writes, {api_reads:.0f} reads: "
        + (", ".join(f"{k} {n:.0f}" for k, n in sorted(tabby_api.items())) or "none")
    )
    echo(
        "  API server, its mean time per tabby.io request: "
        + (", ".join(f"{k} {ms:.0f} ms" for k, ms in result["api_tabby_mean_ms"].items()) or "none")
    )
    echo(
        "  API server, every request by verb: "
        + ", ".join(f"{v} {n:.0f}" for v, n in sorted(result["api_by_verb"].items()))
    )
    echo(
        f"  deleted: every pod gone in {deleted_s:.1f} s; tabby-node's datastore calls: "
        + (", ".join(f"{k} {n:.0f}" for k, n in result["delete_store_requests"].items()) or "none")
    )
    result.update(info)
    return result


# == main ==========================================================================================


def main() -> int:
    ap = argparse.ArgumentParser(
        description="tabby on a real Kubernetes: a NetworkPolicy applied -> enforced on every "
        "node, pod start against ptp + host-local, the controllers' CPU and RSS (bench/README.md)"
    )
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated: {', '.join(CASES)}")
    ap.add_argument("-n", type=int, default=20, help="policy: rounds (20)")
    ap.add_argument(
        "--label-rounds", type=int, default=10, help="policy: rounds of each label change (10)"
    )
    ap.add_argument(
        "--pairs", type=int, default=12, help="pod-start: measured pairs, ~17 s each (12)"
    )
    ap.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    ap.add_argument("--warmup", type=int, default=2, help="pod-start: unmeasured pairs first (2)")
    ap.add_argument("--node", default="node-2", help="pod-start: the node (node-2)")
    ap.add_argument(
        "--settle", type=float, default=1.0, help="pod-start: seconds after a conflist swap (1.0)"
    )
    ap.add_argument(
        "--py-spy",
        metavar="BIN",
        help="pod-start: profile tabby-node on --node with this py-spy while the pods start",
    )
    ap.add_argument(
        "--py-spy-out",
        default="/tmp/kube-bench-tabby-node.txt",
        metavar="FILE",
        help="pod-start: where py-spy writes its raw stacks (/tmp/kube-bench-tabby-node.txt)",
    )
    ap.add_argument(
        "--logs", metavar="DIR", help="pod-start: keep the node's containerd/kubelet/tabby logs"
    )
    ap.add_argument(
        "--controllers-bin",
        default=CONTROLLERS_BIN,
        metavar="PATH",
        help=f"the tabby-kube-controllers to run, e.g. a private build's ({CONTROLLERS_BIN})",
    )
    ap.add_argument(
        "--datastore",
        choices=("kubernetes", "etcdv3"),
        default="kubernetes",
        help="tabby's datastore: the Kubernetes API, as the manifest ships (default), or etcd",
    )
    ap.add_argument(
        "--burst", type=int, default=100, help="burst: pods created at once on --node (100)"
    )
    ap.add_argument("--pods", type=int, default=100, help="controllers: Deployment replicas (100)")
    ap.add_argument("--rest", type=float, default=30, help="controllers: seconds at rest (30)")
    ap.add_argument(
        "--timeout", type=float, default=600, help="controllers: give up a phase after (600 s)"
    )
    record.add_argument(ap, "kube_bench")
    args = ap.parse_args()
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES]
    if unknown or not cases:
        ap.error(f"unknown case(s) {unknown}: choose from {', '.join(CASES)}")
    if os.geteuid() != 0:
        print("kube_bench: must run as root (namespaces, mounts, cgroups)", file=sys.stderr)
        return 2
    run_case = {
        "policy": case_policy,
        "pod-start": case_pod_start,
        "controllers": case_controllers,
        "burst": case_burst,
    }
    echo(f"kube_bench: {platform.node()}, {os.cpu_count()} CPUs, load {load()} (1/5/15 min)")
    results: dict[str, Any] = {
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "load_start": load(),
    }
    status = 0
    try:
        for case in cases:
            started = time.monotonic()
            try:
                results[case] = run_case[case](args)
            except LabError as e:
                echo(f"kube_bench {case}: {e}")
                results[case] = {"error": str(e)}
                status = 1
            results[case]["took_s"] = round(time.monotonic() - started)
            echo(f"  ({case}: {time.monotonic() - started:.0f} s, load now {load()})\n")
    except KeyboardInterrupt:
        print("kube_bench: interrupted (the lab was torn down)", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    results["load_end"] = load()
    print_summary(results)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(results, f, indent=1, default=str)
    return status


if __name__ == "__main__":
    sys.exit(record.run(main, "kube_bench"))
