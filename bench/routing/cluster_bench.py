#!/usr/bin/env python3
"""Benchmark (not a test): tabby as a cluster, on the throwaway lab of network namespaces
(``tabbyctl.demo.lab``: underlay bridge, node namespaces, etcd, tabby-node per node, pods
made by the installed binaries). Prints numbers; asserts nothing.

    convergence   the ADD that claims a new block on node A -> the first echo reply a pod
                  on node B gets from the new pod (p50/p90 over --samples, per backend)
    scale         --pods pods over 3 nodes, -k ADDs at a time per node: until every pod
                  answers every node; ADD latency percentiles
    agent         tabby-node's CPU and RSS at rest and while 1000 blocks affine to another
                  (fake) node arrive, and the time until their routes are in the kernel

Reachability is probed with raw ICMP sockets opened inside the source namespace (no ping
process per attempt): an echo request every --probe-interval ms to every target that has
not answered yet, the time of the first reply recorded. CPU and RSS come from
/proc/<pid>/stat and /proc/<pid>/status, sampled every 0.2 s.

Needs root, the installed binaries (/opt/cni/bin, /usr/local/bin/tabby-node), etcd, BIRD 2,
nftables. Everything is torn down by the lab (processes by PID, namespaces, work
directory), also on Ctrl-C. See bench/README.md.

    .venv/bin/python -m bench.routing.cluster_bench convergence --backend bird --samples 20
    .venv/bin/python -m bench.routing.cluster_bench scale --backend vxlan --pods 100 -k 8
    .venv/bin/python -m bench.routing.cluster_bench agent --backend vxlan --blocks 1000 --idle 20
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import json
import os
import platform
import secrets
import select
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from bench import record
from bench.stats import pct
from tabbyctl.demo.lab import SUBNETS, UNDERLAY_V4, V4_POOL, Lab, LabError, LabNode, LabPod
from tabbyctl.demo.proc import INTERRUPTS
from tests.policy_probes import icmp_echo

T = TypeVar("T")
CLK_TCK = os.sysconf("SC_CLK_TCK")
BENCH_POOL = "10.96.0.0/16"  # the fake node's blocks (agent): 1024 blocks of /26
FAKE_NODE = "bench-fake"
FAKE_MAC = "ee:ee:00:00:00:01"


# -- small helpers -----------------------------------------------------------------------------


def summary(values: list[float]) -> dict[str, float | int]:
    return {
        "n": len(values),
        "p50": pct(values, 50),
        "p90": pct(values, 90),
        "max": max(values) if values else float("nan"),
    }


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f}"


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.2f}/{five:.2f}"


def echo(text: str) -> None:
    print(text, flush=True)


def netns_worker(netns: str) -> ThreadPoolExecutor:
    """One thread living in network namespace ``netns``: sockets it opens (an etcd client's
    keep-alive connection, say) are that namespace's."""
    from dataplane.netns import setns

    def enter() -> None:
        fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
        try:
            setns(fd)
        finally:
            os.close(fd)

    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"ns-{netns}", initializer=enter)


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    with netns_worker(netns) as worker:
        return worker.submit(fn).result()


def cni_call(
    lab: Lab, node: LabNode, command: str, pod: LabPod, extra_args: str = ""
) -> tuple[int, dict[str, Any] | None]:
    """``lab.cni`` for worker threads: the same call (the installed ``tabby`` exec'd in the
    node's namespace, served by its tabby-node), in a session of its own so that a Ctrl-C
    never cuts an ADD in half (the main thread cleans up after the workers finish)."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": pod.container_id,
        "CNI_NETNS": f"/run/netns/{pod.netns}",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": lab.cni_bin,
        "CNI_ARGS": f"K8S_POD_NAMESPACE={pod.namespace};K8S_POD_NAME={pod.name}"
        + (f";{extra_args}" if extra_args else ""),
        "TABBY_NODE_SOCKET": node.socket,
    }
    proc = subprocess.run(
        ["ip", "netns", "exec", node.netns, os.path.join(lab.cni_bin, "tabby")],
        input=json.dumps(lab.conf(node)).encode(),
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
        start_new_session=True,
    )
    out = proc.stdout.decode().strip()
    try:
        parsed = json.loads(out) if out else None
    except ValueError:
        parsed = {"code": -1, "msg": out[:300]}
    return proc.returncode, parsed


def timed_add(lab: Lab, node: LabNode, pod: LabPod, ip: str | None = None) -> float:
    """ADD ``pod`` (asking for ``ip``); seconds the call took. Raises LabError."""
    t0 = time.monotonic()
    rc, out = cni_call(lab, node, "ADD", pod, f"IP={ip}" if ip else "")
    took = time.monotonic() - t0
    if rc != 0 or out is None:
        raise LabError(f"ADD of {pod.label} failed: {out}")
    pod.result = out
    return took


# -- reachability: raw ICMP sockets --------------------------------------------------------------


class Prober:
    """Echo requests from network namespaces to IPv4 targets until each answers once.

    ``watch(src, dst)`` starts probing (src: a namespace name); ``first(src, dst)`` is the
    monotonic time of the first echo reply, None until then. One raw socket per source
    namespace (made by a thread that entered it), one sender and one receiver thread."""

    def __init__(self, interval: float) -> None:
        self.interval = interval
        self.ident = secrets.randbelow(0xFFFF) + 1
        self.socks: dict[str, socket.socket] = {}
        self.pending: dict[tuple[str, str], int] = {}  # (src, dst) -> seq
        self.answered: dict[tuple[str, str], float] = {}
        self.started: dict[tuple[str, str], float] = {}
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.stop = threading.Event()
        self.threads = [
            threading.Thread(target=self._send_loop, daemon=True, name="probe-send"),
            threading.Thread(target=self._recv_loop, daemon=True, name="probe-recv"),
        ]
        for t in self.threads:
            t.start()

    def open(self, src: str) -> socket.socket:
        sock = self.socks.get(src)
        if sock is None:

            def make() -> socket.socket:
                s = socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP)
                s.setblocking(False)
                return s

            sock = self.socks[src] = in_netns(src, make)
        return sock

    def watch(self, src: str, dst: str) -> None:
        sock = self.open(src)
        with self.lock:
            key = (src, dst)
            if key in self.answered or key in self.pending:
                return
            self.pending[key] = 0
            self.started[key] = time.monotonic()
        self._send(sock, dst, 0)

    def first(self, src: str, dst: str) -> float | None:
        with self.lock:
            return self.answered.get((src, dst))

    def wait(self, keys: list[tuple[str, str]], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not all(k in self.answered for k in keys):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.changed.wait(min(left, 0.5))
        return True

    def forget(self) -> None:
        with self.lock:
            self.pending.clear()

    def _send(self, sock: socket.socket, dst: str, seq: int) -> None:
        packet = icmp_echo(self.ident, seq, b"tabby-bench-0123")
        with contextlib.suppress(OSError):  # no route yet, buffer full: the next round
            sock.sendto(packet, (dst, 0))

    def _send_loop(self) -> None:
        while not self.stop.wait(self.interval):
            with self.lock:
                work = list(self.pending.items())
                for key in self.pending:
                    self.pending[key] += 1
            for (src, dst), seq in work:
                self._send(self.socks[src], dst, seq + 1)

    def _recv_loop(self) -> None:
        while not self.stop.is_set():
            socks = list(self.socks.items())
            if not socks:
                time.sleep(0.01)
                continue
            ready, _, _ = select.select([s for _, s in socks], [], [], 0.05)
            now = time.monotonic()
            for src, sock in socks:
                if sock not in ready:
                    continue
                while True:
                    try:
                        data, addr = sock.recvfrom(2048)
                    except (BlockingIOError, InterruptedError):
                        break
                    except OSError:
                        break
                    ihl = (data[0] & 0x0F) * 4
                    if len(data) < ihl + 8:
                        continue
                    kind, _, _, ident, _ = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                    if kind != 0 or ident != self.ident:
                        continue
                    key = (src, addr[0])
                    with self.lock:
                        if key in self.pending:
                            del self.pending[key]
                            self.answered[key] = now
                            self.changed.notify_all()

    def close(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=2)
        for s in self.socks.values():
            s.close()


# -- kernel routes, watched with ip monitor -------------------------------------------------------


class RouteWatch:
    """The unicast routes inside ``within`` in a namespace's main table, followed with
    ``ip monitor route`` (the time of each change as it is read); ``wait`` until a count is
    reached. A real dump every second guards against a lost netlink message."""

    def __init__(self, netns: str, within: str) -> None:
        self.netns = netns
        self.within = ipaddress.ip_network(within)
        self.present: set[str] = set()
        self.seen: dict[str, float] = {}  # dst -> monotonic time it (last) appeared
        self.lock = threading.Lock()
        self.changed = threading.Condition(self.lock)
        self.proc = subprocess.Popen(
            ["ip", "-n", netns, "monitor", "route"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.reader = threading.Thread(target=self._read, daemon=True, name="route-watch")
        self.reader.start()
        time.sleep(0.2)  # monitor subscribed before the first dump
        self._resync()

    def _dst(self, words: list[str]) -> str | None:
        if not words:
            return None
        if words[0] in ("blackhole", "unreachable", "prohibit", "local", "broadcast"):
            return None
        try:
            net = ipaddress.ip_network(words[0], strict=False)
        except ValueError:
            return None
        if net.version != self.within.version or not net.subnet_of(self.within):  # type: ignore[arg-type]
            return None
        if "table" in words and words[words.index("table") + 1 : words.index("table") + 2] != [
            "main"
        ]:
            return None
        return str(net)

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            words = line.split()
            deleted = bool(words) and words[0] == "Deleted"
            dst = self._dst(words[1:] if deleted else words)
            if dst is None:
                continue
            now = time.monotonic()
            with self.lock:
                if deleted:
                    self.present.discard(dst)
                else:
                    if dst not in self.present:
                        self.seen[dst] = now
                    self.present.add(dst)
                self.changed.notify_all()

    def _resync(self) -> None:
        out = subprocess.run(
            ["ip", "-n", self.netns, "-4", "route", "show", "table", "main"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        now = {d for d in (self._dst(line.split()) for line in out.splitlines()) if d}
        with self.lock:
            self.present = now
            self.changed.notify_all()

    def appeared(self, dst: str, timeout: float = 0) -> float | None:
        """When ``dst`` appeared (it is there now), waiting up to ``timeout`` for it."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while dst not in self.present:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self.changed.wait(left)
            return self.seen.get(dst)

    def count(self) -> int:
        with self.lock:
            return len(self.present)

    def wait(self, want: Callable[[int], bool], timeout: float) -> float | None:
        """Monotonic time at which ``want(count)`` first held, None on timeout."""
        deadline = time.monotonic() + timeout
        next_dump = time.monotonic() + 1.0
        while True:
            with self.lock:
                if want(len(self.present)):
                    return time.monotonic()
                self.changed.wait(0.1)
            now = time.monotonic()
            if now > deadline:
                return None
            if now >= next_dump:
                self._resync()
                next_dump = now + 1.0

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


# -- CPU and memory from /proc ---------------------------------------------------------------------


class Sampler:
    """CPU time and RSS of some processes every ``period`` s; ``window(t0, t1)`` sums them."""

    def __init__(self, pids: dict[str, int], period: float = 0.1) -> None:
        self.pids = pids
        self.period = period
        self.samples: list[tuple[float, dict[str, tuple[float, int]]]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True, name="sampler")
        self.thread.start()

    @staticmethod
    def read(pid: int) -> tuple[float, int] | None:
        try:
            with open(f"/proc/{pid}/stat", encoding="ascii") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{pid}/status", encoding="ascii") as f:
                rss = next(int(x.split()[1]) for x in f if x.startswith("VmRSS:"))
        except (OSError, StopIteration, IndexError, ValueError):
            return None
        return (int(fields[11]) + int(fields[12])) / CLK_TCK, int(rss)

    def _loop(self) -> None:
        while True:
            now = time.monotonic()
            got = {}
            for name, pid in self.pids.items():
                r = self.read(pid)
                if r is not None:
                    got[name] = r
            self.samples.append((now, got))
            if self.stop.wait(self.period):
                return

    def window(self, t0: float, t1: float) -> dict[str, dict[str, float]]:
        inside = [s for s in self.samples if t0 - self.period <= s[0] <= t1 + self.period]
        out = {}
        for name in self.pids:
            points = [(t, d[name]) for t, d in inside if name in d]
            if len(points) < 2:
                continue
            (ta, (ca, _)), (tb, (cb, _)) = points[0], points[-1]
            rss = [r for _, (_, r) in points]
            out[name] = {
                "cpu_s": cb - ca,
                "cpu_pct": 100 * (cb - ca) / (tb - ta) if tb > ta else 0.0,
                "rss_mb": rss[-1] / 1024,
                "rss_max_mb": max(rss) / 1024,
            }
        return out

    def quiet(self, t_from: float, name: str, below_pct: float, timeout: float) -> float:
        """Wait until ``name`` used less than ``below_pct`` % of a CPU over a 1 s window
        that starts at or after ``t_from``: the window's start (monotonic). The window ends
        1 s later (windows include it, so that the sampling period cannot cut off work)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            pts = [(t, d[name][0]) for t, d in self.samples if t >= t_from and name in d]
            for i, (ta, ca) in enumerate(pts):
                later = [(t, c) for t, c in pts[i:] if t - ta >= 1.0]
                if later:
                    tb, cb = later[0]
                    if 100 * (cb - ca) / (tb - ta) < below_pct:
                        return ta
            time.sleep(0.2)
        return time.monotonic()

    def close(self) -> None:
        self.stop.set()
        self.thread.join(timeout=2)


def hwm_mb(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next(int(x.split()[1]) for x in f if x.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return None


# -- the lab -----------------------------------------------------------------------------------


@contextlib.contextmanager
def built_lab(nodes: int, backend: str) -> Iterator[Lab]:
    """A lab (IPv4 only), ready; torn down afterwards, also on Ctrl-C / SIGTERM."""
    lab = Lab(nodes_wanted=nodes, backend=backend, ipv6=False, echo=echo)
    try:
        with INTERRUPTS.installed():
            t0 = time.monotonic()
            lab.build()
            lab.wait_ready(120)
            echo(
                f"  lab {lab.prefix}: {nodes} node(s), {backend}, etcd x{lab.members()}, "
                f"ready in {time.monotonic() - t0:.1f} s"
            )
            yield lab
    finally:
        t0 = time.monotonic()
        problems = lab.teardown()
        echo(
            f"  lab removed in {time.monotonic() - t0:.1f} s"
            + (f": {problems}" if problems else "")
        )


def etcd_store(lab: Lab) -> Any:
    """An etcd store of the lab (use it only from a thread inside a node namespace)."""
    from datastore.etcd.store import EtcdStore

    return EtcdStore(
        lab.endpoints(),
        prefix=lab.etcd_prefix,
        lock_timeout=30,
        lock_dir=os.path.join(lab.workdir, "bench-locks"),
    )


def free_blocks(lab: Lab, count: int, pool: str = V4_POOL, size: int = 26) -> list[str]:
    """``count`` blocks of ``pool`` that no node has claimed, from the top of the pool
    down (nodes claim from elsewhere first)."""
    node = lab.nodes[0]

    def find() -> list[str]:
        store = etcd_store(lab)
        try:
            taken = {key for key, _ in store.list("block")}
        finally:
            store.close()
        blocks = list(ipaddress.ip_network(pool).subnets(new_prefix=size))
        return [str(b) for b in reversed(blocks) if str(b) not in taken][:count]

    return in_netns(node.netns, find)


def wait_matrix(lab: Lab, prober: Prober, sources: list[str], timeout: float) -> bool:
    keys = []
    for pod in lab.pods:
        for src in sources:
            for addr in pod.addresses(4):
                prober.watch(src, addr)
                keys.append((src, addr))
    return prober.wait(keys, timeout)


# -- convergence -------------------------------------------------------------------------------


def convergence(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    echo(f"== convergence, {backend}: {args.samples} samples, a new block each ==")
    with built_lab(3, backend) as lab:
        prober = Prober(args.probe_interval / 1000)
        watches = [RouteWatch(n.netns, V4_POOL) for n in lab.nodes]
        try:
            probes = {}
            for node in lab.nodes:
                pod = lab.new_pod(node, "bench", f"probe{node.index + 1}")
                timed_add(lab, node, pod)
                probes[node.name] = pod
            if not wait_matrix(lab, prober, [p.netns for p in probes.values()], 60):
                raise LabError("the probe pods do not reach each other")
            blocks = free_blocks(lab, args.samples)
            rows: list[dict[str, Any]] = []
            for i in range(args.samples):
                a, b = lab.nodes[i % 3], lab.nodes[(i + 1) % 3]
                block = ipaddress.ip_network(blocks[i])
                ip = str(block.network_address + 10)
                pod = lab.new_pod(a, "bench", f"c{i}")
                src = probes[b.name].netns
                time.sleep(args.settle)
                with INTERRUPTS.deferred():
                    prober.watch(src, ip)
                    t0 = time.monotonic()
                    add = timed_add(lab, a, pod, ip)
                t_add = t0 + add
                ok = prober.wait([(src, ip)], args.timeout)
                first = prober.first(src, ip)
                conv = first - t0 if ok and first is not None else None
                route = watches[b.index].appeared(str(block), timeout=2 if ok else 0)
                route_s = route - t0 if route is not None else None
                rows.append(
                    {
                        "sample": i,
                        "a": a.name,
                        "b": b.name,
                        "block": str(block),
                        "add_s": add,
                        "route_on_b_s": route_s,
                        "converge_s": conv,
                        "after_add_s": (first - t_add) if conv is not None and first else None,
                    }
                )
                echo(
                    f"  {i:2d} {a.name} -> {b.name} {block}: ADD {add * 1000:.0f} ms, "
                    f"route on {b.name} {fmt_ms(route_s)} ms, "
                    f"first reply {fmt_ms(conv)} ms after the ADD started"
                )
            prober.forget()
        finally:
            prober.close()
            for w in watches:
                w.close()
    conv_ok = [r["converge_s"] for r in rows if r["converge_s"] is not None]
    result: dict[str, Any] = {
        "backend": backend,
        "samples": rows,
        "converge_s": summary(conv_ok),
        "after_add_s": summary([r["after_add_s"] for r in rows if r["after_add_s"] is not None]),
        "add_s": summary([r["add_s"] for r in rows]),
        "route_on_b_s": summary([r["route_on_b_s"] for r in rows if r["route_on_b_s"] is not None]),
        "unconverged": sum(1 for r in rows if r["converge_s"] is None),
    }
    c, aa, ad = result["converge_s"], result["after_add_s"], result["add_s"]
    echo(
        f"  {backend}: convergence p50 {c['p50'] * 1000:.0f} ms, p90 {c['p90'] * 1000:.0f} ms, "
        f"max {c['max'] * 1000:.0f} ms (n={c['n']}, {result['unconverged']} never); "
        f"after the ADD returned p50 {aa['p50'] * 1000:.0f} ms; "
        f"ADD p50 {ad['p50'] * 1000:.0f} ms; route on B p50 "
        f"{result['route_on_b_s']['p50'] * 1000:.0f} ms p90 "
        f"{result['route_on_b_s']['p90'] * 1000:.0f} ms after the ADD started"
    )
    return result


# -- scale -------------------------------------------------------------------------------------


def scale(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    echo(f"== scale, {backend}: {args.pods} pods over 3 nodes, {args.k} ADDs at a time per node ==")
    with built_lab(3, backend) as lab:
        prober = Prober(args.probe_interval / 1000)
        pools: list[ThreadPoolExecutor] = []
        try:
            plan = []
            for i in range(args.pods):
                node = lab.nodes[i % 3]
                plan.append((node, lab.new_pod(node, "scale", f"s{i}")))
            sources = [n.netns for n in lab.nodes]
            for src in sources:
                prober.open(src)
            pools = [ThreadPoolExecutor(args.k, thread_name_prefix=n.name) for n in lab.nodes]
            add_times: dict[str, float] = {}
            done_at: dict[str, float] = {}
            errors: list[str] = []

            def one(node: LabNode, pod: LabPod) -> None:
                try:
                    add_times[pod.name] = timed_add(lab, node, pod)
                except Exception as e:
                    errors.append(str(e)[:300])
                    return
                done_at[pod.name] = time.monotonic()
                for src in sources:
                    prober.watch(src, pod.addresses(4)[0])

            time.sleep(args.settle)
            t0 = time.monotonic()
            futures: list[Future[None]] = [
                pools[node.index].submit(one, node, pod) for node, pod in plan
            ]
            for f in futures:
                f.result()
            t_adds = time.monotonic()
            keys = [(s, p.addresses(4)[0]) for _, p in plan if p.result for s in sources]
            ok = prober.wait(keys, args.timeout)
            answered = [prober.first(*k) for k in keys]
            t_all = max((a for a in answered if a is not None), default=None)
            per_pod = []
            for _, pod in plan:
                if not pod.result:
                    continue
                firsts = [prober.first(s, pod.addresses(4)[0]) for s in sources]
                if all(f is not None for f in firsts):
                    per_pod.append(max(f for f in firsts if f is not None) - done_at[pod.name])
            missing = [k for k, a in zip(keys, answered, strict=True) if a is None]
            prober.forget()
        finally:
            for p in pools:
                p.shutdown(wait=True, cancel_futures=True)
            prober.close()
    result = {
        "backend": backend,
        "pods": args.pods,
        "k_per_node": args.k,
        "adds_done_s": t_adds - t0,
        "all_reachable_s": (t_all - t0) if ok and t_all is not None else None,
        "after_last_add_s": (t_all - t_adds) if ok and t_all is not None else None,
        "add_s": summary(list(add_times.values())),
        "pod_reachable_after_add_s": summary(per_pod),
        "add_errors": errors[:10],
        "unreached_pairs": len(missing),
    }
    a = result["add_s"]
    r = result["pod_reachable_after_add_s"]
    echo(
        f"  {backend}: all {args.pods} pods ADDed in {result['adds_done_s']:.2f} s, reachable "
        f"from every node after {_s(result['all_reachable_s'])} ({len(missing)} pairs never); "
        f"ADD p50 {a['p50'] * 1000:.0f} ms p90 {a['p90'] * 1000:.0f} ms max "
        f"{a['max'] * 1000:.0f} ms; a pod reachable from all nodes {r['p50'] * 1000:.0f} ms "
        f"(p50) / {r['p90'] * 1000:.0f} ms (p90) after its ADD returned"
        + (f"; {len(errors)} ADD errors: {errors[0]}" if errors else "")
    )
    return result


def _s(value: float | None) -> str:
    return "never" if value is None else f"{value:.2f} s"


# -- agent cost --------------------------------------------------------------------------------


class FakeNode:
    """A node that exists only in the datastore (Node + heartbeat, blocks claimed through
    the IPAM core as that node) and, for bird, as a BIRD of its own in a namespace on the
    underlay, configured with tabby's own renderer, that announces its blocks."""

    def __init__(self, lab: Lab, backend: str) -> None:
        lab_byte = lab._subnet_byte()
        self.lab = lab
        self.backend = backend
        self.info = LabNode(
            name=FAKE_NODE,
            netns=f"{lab.prefix}-fake",
            index=len(lab.nodes),
            ipv4=ipaddress.IPv4Interface(
                UNDERLAY_V4.format(subnet=SUBNETS[0], lab=lab_byte, host=10 + len(lab.nodes))
            ),
            ipv6=None,
            workdir=os.path.join(lab.workdir, FAKE_NODE),
        )
        os.makedirs(self.info.workdir, mode=0o700)
        lab.make_netns(self.info.netns)
        lab._plug(self.info)
        self.worker = netns_worker(lab.nodes[0].netns)
        self.store: Any = self.worker.submit(lambda: etcd_store(lab)).result()
        self.blocks: list[str] = []
        self.bird: subprocess.Popen[bytes] | None = None

    def run(self, fn: Callable[[], T]) -> T:
        return self.worker.submit(fn).result()

    def register(self, first_block: str) -> None:
        """The pool, the Node (with a VXLAN tunnel address and MAC), its heartbeat, and its
        first block (the one holding the tunnel address)."""
        from ipam.core import AssignRequest, Ipam, handle_id
        from resources.client import ResourceClient

        tunnel = str(ipaddress.ip_network(first_block).network_address + 1)

        def work() -> None:
            ResourceClient(self.store).apply(
                [
                    {
                        "apiVersion": "tabby.io/v1",
                        "kind": "IPPool",
                        "metadata": {"name": "bench-fake-pool"},
                        "spec": {"cidr": BENCH_POOL, "blockSize": 26},
                    },
                    {
                        "apiVersion": "tabby.io/v1",
                        "kind": "Node",
                        "metadata": {"name": FAKE_NODE},
                        "spec": {
                            "backend": self.backend,
                            "ipv4Address": str(self.info.ipv4),
                            **(
                                {"ipv4VXLANTunnelAddr": tunnel, "vxlanTunnelMACAddr": FAKE_MAC}
                                if self.backend == "vxlan"
                                else {}
                            ),
                        },
                    },
                ]
            )
            Ipam(self.store, FAKE_NODE).assign(
                AssignRequest(
                    handle_id("tabby-tunnel", f"vxlan-tunnel-addr-{FAKE_NODE}", "vxlan.tabby"),
                    {"node": FAKE_NODE},
                    v4_pools=[BENCH_POOL],
                    specific_ips=[tunnel],
                )
            )
            self.heartbeat(True)

        self.run(work)
        self.blocks.append(first_block)

    def heartbeat(self, alive: bool) -> None:
        if alive:
            data = {"node": FAKE_NODE, "time": time.time(), "pid": 0}
            self.store.put_leased("heartbeat", FAKE_NODE, data, None, ttl=3600)
        else:
            doc = self.store.get("heartbeat", FAKE_NODE)
            if doc is not None:
                self.store.delete("heartbeat", FAKE_NODE, doc.revision)

    def claim(self, blocks: list[str]) -> None:
        """Claim ``blocks`` as the fake node: one address requested in each, through the
        IPAM core (a block CAS-create plus the affinity, as a node's ADD does)."""
        from ipam.core import AssignRequest, Ipam, handle_id

        def work() -> None:
            ipam = Ipam(self.store, FAKE_NODE)
            for cidr in blocks:
                ip = str(ipaddress.ip_network(cidr).network_address + 2)
                ipam.assign(
                    AssignRequest(
                        handle_id("bench", ip.replace(".", "-"), "eth0"),
                        {"node": FAKE_NODE},
                        v4_pools=[BENCH_POOL],
                        specific_ips=[ip],
                    )
                )

        self.run(work)
        self.blocks.extend(blocks)

    # BIRD (bird backend): announces self.blocks to the lab's nodes ---------------------------

    def bird_config(self) -> str:
        from bird import BirdConfig, BirdNode, Peer, PeerType, Pool, render

        return render(
            BirdConfig(
                node=BirdNode(FAKE_NODE, self.info.ipv4.ip),
                peers=tuple(Peer(n.ipv4.ip, PeerType.MESH, name=n.name) for n in self.lab.nodes),
                pools=(Pool(ipaddress.ip_network(V4_POOL)), Pool(ipaddress.ip_network(BENCH_POOL))),
                blocks=tuple(ipaddress.ip_network(b) for b in self.blocks),
            )
        )

    @property
    def ctl(self) -> str:
        return os.path.join(self.info.workdir, "bird.ctl")

    def start_bird(self) -> None:
        from bird.supervisor import find_bird

        conf = os.path.join(self.info.workdir, "bird.conf")
        Path(conf).write_text(self.bird_config(), encoding="utf-8")
        argv = ["ip", "netns", "exec", self.info.netns, find_bird(), "-f", "-c", conf]
        argv += ["-s", self.ctl]
        self.bird = self.lab.spawn(argv, os.path.join(self.info.workdir, "bird.log"))

    def reload_bird(self) -> None:
        conf = os.path.join(self.info.workdir, "bird.conf")
        Path(conf).write_text(self.bird_config(), encoding="utf-8")
        proc = subprocess.run(
            ["birdc", "-s", self.ctl, "configure"], capture_output=True, text=True, check=False
        )
        if proc.returncode != 0 or "Reconfigured" not in proc.stdout:
            raise LabError(f"fake BIRD did not reload: {proc.stdout} {proc.stderr}")

    def sessions_up(self) -> int:
        proc = subprocess.run(
            ["birdc", "-s", self.ctl, "show", "protocols"],
            capture_output=True,
            text=True,
            check=False,
        )
        return sum(1 for line in proc.stdout.splitlines() if "Established" in line)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.run(self.store.close)
        self.worker.shutdown(wait=True)
        if self.bird is not None and self.bird.poll() is None:
            self.bird.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.bird.wait(10)


def agent(args: argparse.Namespace, backend: str) -> dict[str, Any]:
    echo(
        f"== agent cost, {backend}: tabby-node at rest, then {args.blocks} blocks of a fake node =="
    )
    phases: dict[str, Any] = {}
    hwm: dict[str, float | None] = {}
    with built_lab(1, backend) as lab:
        node = lab.nodes[0]
        assert node.agent is not None
        assert node.etcd is not None
        pids = {"tabby-node": node.agent.pid, "etcd": node.etcd.pid}
        bird_pid = node.bird_pid()
        if backend == "bird" and bird_pid is not None:
            pids["bird"] = bird_pid
        sampler = Sampler(pids)
        fake: FakeNode | None = None
        routes: RouteWatch | None = None
        try:
            blocks = [str(b) for b in ipaddress.ip_network(BENCH_POOL).subnets(new_prefix=26)][
                : args.blocks
            ]
            time.sleep(2)  # start-up work done

            def phase(name: str, t0: float, done: float, quiet: float | None, **extra: Any) -> None:
                """``done``: the phase's result is there; ``quiet``: the start of the first
                1 s window the process was idle again in (CPU counted up to its end)."""
                end = quiet + 1.0 if quiet is not None else done
                phases[name] = {"wall_s": done - t0, **extra, "procs": sampler.window(t0, end)}
                if quiet is not None:
                    phases[name]["busy_s"] = max(done, quiet) - t0
                echo(f"  {name}: done in {done - t0:.2f} s " + _fmt_extra(phases[name]))

            t0 = time.monotonic()
            time.sleep(args.idle)
            phase("rest", t0, time.monotonic(), None)

            fake = FakeNode(lab, backend)
            routes = RouteWatch(node.netns, BENCH_POOL)
            fake.register(blocks[0])
            if backend == "bird":
                fake.start_bird()
                deadline = time.monotonic() + 60
                while fake.sessions_up() < 1:
                    if time.monotonic() > deadline:
                        raise LabError("the fake node's BGP session did not come up")
                    time.sleep(0.2)
            else:
                if routes.wait(lambda n: n >= 1, 30) is None:
                    raise LabError("the fake node's first block got no route")
            time.sleep(2)

            # 1. the blocks arrive in the datastore (and, for vxlan, their routes)
            t0 = time.monotonic()
            fake.claim(blocks[1:])
            t_written = time.monotonic()
            t_routes = None
            if backend == "vxlan":
                t_routes = routes.wait(lambda n: n >= len(blocks), args.timeout)
            t_quiet = sampler.quiet(max(t_written, t_routes or 0), "tabby-node", 10, 120)
            phase(
                f"claims ({len(blocks) - 1} blocks)",
                t0,
                max(t_written, t_routes or 0),
                t_quiet,
                written_s=t_written - t0,
                routes_s=(t_routes - t0) if t_routes else None,
                routes_after_last_write_s=(t_routes - t_written) if t_routes else None,
            )

            if backend == "bird":
                # 2. the fake node announces them: node-1's BIRD programs the kernel
                time.sleep(1)
                t0 = time.monotonic()
                fake.reload_bird()
                t_routes = routes.wait(lambda n: n >= len(blocks), args.timeout)
                t1 = sampler.quiet(t_routes or time.monotonic(), "bird", 10, 60)
                phase(
                    "BGP announce",
                    t0,
                    t_routes or time.monotonic(),
                    t1,
                    routes_s=(t_routes - t0) if t_routes else None,
                )

            time.sleep(2)
            t0 = time.monotonic()
            time.sleep(args.idle)
            phase(f"rest, {len(blocks)} remote blocks", t0, time.monotonic(), None)

            # 3. the fake node dies (heartbeat gone), then comes back
            t0 = time.monotonic()
            fake.run(lambda: fake.heartbeat(False))
            t_gone = routes.wait(lambda n: n == 0, args.timeout)
            t1 = sampler.quiet(t_gone or time.monotonic(), "tabby-node", 10, 60)
            phase("withdraw", t0, t_gone or t1, t1, routes_s=(t_gone - t0) if t_gone else None)
            time.sleep(2)
            t0 = time.monotonic()
            fake.run(lambda: fake.heartbeat(True))
            t_back = routes.wait(lambda n: n >= len(blocks), args.timeout)
            t1 = sampler.quiet(t_back or time.monotonic(), "tabby-node", 10, 60)
            phase("rejoin", t0, t_back or t1, t1, routes_s=(t_back - t0) if t_back else None)
            hwm = {name: hwm_mb(pid) for name, pid in pids.items()}
            echo(
                "  peak RSS since start (VmHWM): "
                + ", ".join(f"{k} {_fmt(v)} MB" for k, v in hwm.items())
            )
        finally:
            sampler.close()
            if routes is not None:
                routes.close()
            if fake is not None:
                fake.close()
    return {
        "backend": backend,
        "blocks": args.blocks,
        "idle_s": args.idle,
        "phases": phases,
        "hwm_mb": hwm,
    }


def _fmt_extra(phase: dict[str, Any]) -> str:
    parts = [
        f"{k.removesuffix('_s')} {v:.2f} s"
        for k, v in phase.items()
        if k.endswith("_s") and k != "wall_s" and isinstance(v, float)
    ]
    for name, v in phase["procs"].items():
        parts.append(
            f"{name} {v['cpu_s']:.2f} s CPU ({v['cpu_pct']:.1f} %) RSS {v['rss_mb']:.1f} MB"
            + (f" (max {v['rss_max_mb']:.1f})" if v["rss_max_mb"] > v["rss_mb"] + 0.05 else "")
        )
    return "\n      " + "\n      ".join(parts)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.2f}"
    return "-" if value is None else str(value)


# -- main --------------------------------------------------------------------------------------


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="what", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--backend", choices=("bird", "vxlan", "both"), default="both")
    common.add_argument("--json", metavar="FILE", help="also write the results as JSON")
    common.add_argument(
        "--timeout", type=float, default=60, help="give up waiting for one result after (s)"
    )
    common.add_argument(
        "--probe-interval", type=float, default=10, help="ms between echo requests (10)"
    )
    record.add_argument(common, "cluster_bench_<convergence|scale|agent>")
    p = sub.add_parser("convergence", parents=[common], help="new block on A -> ping from B")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--settle", type=float, default=1.0, help="quiet seconds before a sample")
    p = sub.add_parser("scale", parents=[common], help="many pods, all reachable from all nodes")
    p.add_argument("--pods", type=int, default=100)
    p.add_argument("-k", type=int, default=8, help="ADDs at a time per node (8)")
    p.add_argument("--settle", type=float, default=2.0, help="quiet seconds before the ADDs")
    p = sub.add_parser("agent", parents=[common], help="tabby-node CPU/RSS, remote blocks")
    p.add_argument("--blocks", type=int, default=1000, help="blocks of the fake node (<= 1024)")
    p.add_argument("--idle", type=float, default=20, help="seconds of each rest window (20)")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("cluster_bench: must run as root (network namespaces)", file=sys.stderr)
        return 2
    if args.what == "agent" and not 2 <= args.blocks <= 1024:
        print("cluster_bench: --blocks must be 2..1024", file=sys.stderr)
        return 2
    backends = ["bird", "vxlan"] if args.backend == "both" else [args.backend]
    run = {"convergence": convergence, "scale": scale, "agent": agent}[args.what]
    echo(
        f"cluster_bench {args.what}: {platform.node()}, {os.cpu_count()} CPUs, "
        f"load {load()} (1/5 min)"
    )
    results = []
    try:
        for backend in backends:
            results.append(run(args, backend))
            echo(f"  load {load()}")
    except KeyboardInterrupt:
        print("cluster_bench: interrupted (everything was removed)", file=sys.stderr)
        return 130
    except LabError as e:
        print(f"cluster_bench: {e}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"what": args.what, "load": load(), "results": results}, f, indent=1)
    return 0


def record_name(argv: list[str]) -> str:
    """``--record``'s default: each measurement recorded apart (cluster_bench_<what>)."""
    what = next((a for a in argv if a in ("convergence", "scale", "agent")), "")
    return f"cluster_bench_{what}" if what else "cluster_bench"


if __name__ == "__main__":
    sys.exit(record.run(main, record_name))
