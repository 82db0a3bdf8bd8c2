"""The benchmark itself for cni_bench.py: pods in their own network namespaces inside a
private node namespace, the ADD/CHECK/DEL rounds, the cleanup on any exit, and the report."""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import ipaddress
import json
import os
import platform
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from bench.cni.cni_bench_exec import (
    BenchError,
    ExecResult,
    Interrupted,
    Spawner,
    host_route_ips,
    ip_json,
    run_ip,
    setns_thread,
)
from bench.cni.cni_bench_pure import (
    DEFAULT_PATH,
    EXIT_FAILURES,
    EXIT_INTERRUPTED,
    EXIT_OK,
    FLOOR_CALLS,
    NETNS_PREFIX,
    NETNS_RUN_DIR,
    STATE_DIR,
    Chain,
    cni_args,
    compare_stats,
    compute_stats,
    encode_config,
    parse_env_assignments,
    plugin_env,
    plugin_error,
    result_host_interfaces,
    result_ips,
)
from bench.stats import percentile


@dataclass
class NetConf:
    label: str
    tag: str
    path: str
    chain: Chain
    cni_path: str
    binaries: list[str]


@dataclass
class Pod:
    conf: NetConf
    index: int
    warmup: bool
    name: str
    netns: str
    container_id: str
    add_started: bool = False
    add_ok: bool = False
    result: Any = None
    ips: list[str] = field(default_factory=list)
    host_veths: list[str] = field(default_factory=list)
    deleted: bool = False

    @property
    def netns_path(self) -> str:
        return os.path.join(NETNS_RUN_DIR, self.netns)


class Bench:
    def __init__(self, args: argparse.Namespace, confs: list[NetConf]) -> None:
        self.args = args
        self.confs = confs
        self.run_id = secrets.token_hex(3)
        self.isolate = not args.no_isolate
        self.node_ns = f"{NETNS_PREFIX}{self.run_id}-node" if self.isolate else None
        self.given_node_ns = bool(getattr(args, "node_netns", None))
        if self.given_node_ns:  # the caller's: set up here, never created or deleted
            self.node_ns = args.node_netns
        self.node_fd: int | None = None
        self.node_ino: int | None = None
        self.created_ns: list[str] = []
        self.pods: list[Pod] = []
        self.samples: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.floor: dict[str, Any] = {}
        self.client_floor: dict[str, Any] = {}
        self.cleanup_info: dict[str, Any] = {"dels": 0, "netns_deleted": 0}
        self.interrupted: str | None = None
        self.stop = threading.Event()
        self.pool: ThreadPoolExecutor | None = None
        self.rss_dir: str | None = None
        self.spawner = Spawner(args.timeout)
        self.extra_env = parse_env_assignments(args.env or [])
        self.base_env = dict(os.environ) if args.inherit_env else None
        self.path_var = os.environ.get("PATH") or DEFAULT_PATH
        self._lock = threading.Lock()
        self.started = datetime.datetime.now(datetime.UTC)
        self.t_start = time.monotonic()

    # -- logging and bookkeeping -------------------------------------------------------------

    def log(self, msg: str) -> None:
        if not self.args.quiet:
            print(f"[{time.monotonic() - self.t_start:7.2f}s] {msg}", file=sys.stderr, flush=True)

    def fail(self, pod: Pod, verb: str, stage: str, detail: str) -> None:
        entry = {
            "label": pod.conf.label,
            "pod": pod.name,
            "verb": verb,
            "stage": ("warmup " if pod.warmup else "") + stage,
            "detail": detail,
        }
        with self._lock:
            self.failures.append(entry)

    # -- set-up ------------------------------------------------------------------------------

    def _make_pods(self) -> None:
        n, warm = self.args.pods, self.args.warmup
        for warmup, count in ((True, warm), (False, n)):
            for i in range(count):
                for conf in self.confs:  # interleaved: A0 B0 A1 B1 ...
                    name = f"bench-{conf.tag}-{'w' if warmup else ''}{i:04d}"
                    cid = hashlib.sha256(f"{self.run_id}/{name}".encode()).hexdigest()
                    self.pods.append(
                        Pod(
                            conf=conf,
                            index=i,
                            warmup=warmup,
                            name=name,
                            netns=f"{NETNS_PREFIX}{self.run_id}-{name[6:]}",
                            container_id=cid,
                        )
                    )

    def setup(self) -> None:
        os.makedirs(STATE_DIR, exist_ok=True)
        stale = sorted(n for n in _list_netns() if n.startswith(NETNS_PREFIX))
        if stale:
            self.log(f"warning: namespaces left by an earlier run: {' '.join(stale[:6])}")
        self._make_pods()
        wanted = [p.netns for p in self.pods]
        if self.node_ns and not self.given_node_ns:
            wanted.append(self.node_ns)
        clash = set(wanted) & set(_list_netns())
        if clash:  # never adopt (and later delete) a namespace this run did not create
            raise BenchError(f"namespace already exists: {' '.join(sorted(clash))}")
        if self.args.rss:
            self.rss_dir = tempfile.mkdtemp(prefix=f".rss-{self.run_id}-", dir=STATE_DIR)
            self.spawner.rss_dir = self.rss_dir
        if self.node_ns:
            self.log(f"node netns {self.node_ns}")
            if not self.given_node_ns:
                self.created_ns.append(self.node_ns)
                run_ip(["netns", "add", self.node_ns])
            run_ip(["-n", self.node_ns, "link", "set", "lo", "up"])
            # replace: idempotent in a given namespace, the same as add in a new one
            run_ip(["-n", self.node_ns, "addr", "replace", self.args.node_addr, "dev", "lo"])
            run_ip(["-n", self.node_ns, "route", "replace", "169.254.1.1/32", "dev", "lo"])
            subprocess.run(
                ["ip", "netns", "exec", self.node_ns, "sysctl", "-q", "-w",
                 "net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
                capture_output=True, check=False, timeout=60,
            )  # fmt: skip
            path = os.path.join(NETNS_RUN_DIR, self.node_ns)
            self.node_fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            self.node_ino = os.fstat(self.node_fd).st_ino
        self.log(f"creating {len(self.pods)} pod namespaces")
        names = [p.netns for p in self.pods]
        self.created_ns.extend(names)
        run_ip(["-batch", "-"], stdin="".join(f"netns add {n}\n" for n in names))
        run_ip(
            ["-batch", "-"],
            stdin="".join(f"netns exec {n} ip link set lo up\n" for n in names),
        )
        workers = self.args.concurrency if self.args.mode == "concurrent" else 1
        self.pool = self._new_pool(workers)
        # Fail early if the worker threads cannot enter the node namespace.
        self.pool.submit(lambda: None).result()

    def _new_pool(self, workers: int) -> ThreadPoolExecutor:
        return ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="cni", initializer=self._enter_node_netns
        )

    def _enter_node_netns(self) -> None:
        if self.node_fd is None:
            return
        setns_thread(self.node_fd)
        if os.stat("/proc/thread-self/ns/net").st_ino != self.node_ino:
            raise OSError("worker thread is not in the node network namespace")

    # -- plugin calls ------------------------------------------------------------------------

    def _env(self, pod: Pod, verb: str) -> dict[str, str]:
        return plugin_env(
            command=verb,
            container_id=pod.container_id,
            netns=pod.netns_path,
            ifname=self.args.ifname,
            cni_path=pod.conf.cni_path,
            args=cni_args(pod.name, pod.container_id, self.args.k8s_namespace),
            path=self.path_var,
            extra=self.extra_env,
            base=self.base_env,
        )

    def run_chain(self, pod: Pod, verb: str, cleanup: bool = False) -> dict[str, Any] | None:
        """One runtime-level call (ADD/CHECK/DEL of the network list) for one pod."""
        if self.stop.is_set() and not cleanup:
            return None
        conf = pod.conf
        chain = conf.chain
        env = self._env(pod, verb)
        calls: list[dict[str, Any]] = []
        error = None
        if verb == "ADD":
            pod.add_started = True
            prev: Any = None
            order = chain.order("ADD")
            for pos, i in enumerate(order):
                res, error = self._call(conf, i, env, chain.plugin_config(i, prev), calls)
                if error is None:
                    try:
                        prev = json.loads(res.stdout)
                        if not isinstance(prev, dict):
                            raise ValueError("not a JSON object")
                    except ValueError as e:
                        error = f"{chain.types[i]}: ADD result does not parse: {e}"
                if error is None and self.stop.is_set() and pos < len(order) - 1:
                    error = "interrupted in the middle of the chain"
                if error is not None:
                    break
            if error is None:
                pod.result = prev
                pod.add_ok = True
                pod.ips = result_ips(prev)
        else:
            for i, conf_obj in chain.stdins(verb, pod.result):
                _, error = self._call(conf, i, env, conf_obj, calls)
                if error is not None:
                    break
            if verb == "DEL" and error is None:
                pod.deleted = True
        if error is not None:
            self.fail(pod, verb, "cleanup" if cleanup else "plugin", error)
        rss = [c["rss_kb"] for c in calls if c["rss_kb"] is not None]
        return {
            "label": conf.label,
            "pod": pod.name,
            "index": pod.index,
            "warmup": pod.warmup,
            "cleanup": cleanup,
            "verb": verb,
            "ok": error is None,
            "wall_ms": sum(c["wall_ms"] for c in calls),
            "cpu_ms": sum(c["cpu_ms"] for c in calls),
            "rss_kb": max(rss) if rss else None,
            "error": error,
            "plugins": calls,
        }

    def _call(
        self,
        conf: NetConf,
        index: int,
        env: Mapping[str, str],
        stdin_obj: Mapping[str, Any],
        calls: list[dict[str, Any]],
    ) -> tuple[ExecResult, str | None]:
        ptype = conf.chain.types[index]
        try:
            res = self.spawner.run(conf.binaries[index], env, encode_config(stdin_obj))
        except OSError as e:
            res = ExecResult(-1, b"", str(e).encode(), 0.0, 0.0, None)
            calls.append({"type": ptype, "wall_ms": 0.0, "cpu_ms": 0.0, "rss_kb": None, "rc": -1})
            return res, f"{ptype}: cannot exec: {e}"
        calls.append(
            {
                "type": ptype,
                "wall_ms": res.wall_ms,
                "cpu_ms": res.cpu_ms,
                "rss_kb": res.rss_kb,
                "rc": res.rc,
            }
        )
        if res.timed_out:
            return res, f"{ptype}: timed out after {self.args.timeout:g} s (killed)"
        if res.rc != 0:
            return res, f"{ptype}: {plugin_error(res.stdout, res.stderr, res.rc)}"
        return res, None

    # -- phases ------------------------------------------------------------------------------

    def _eligible(self, pod: Pod, verb: str) -> bool:
        if verb == "ADD":
            return not pod.add_started
        if verb == "CHECK":
            return pod.add_ok and not pod.deleted and pod.conf.chain.supports_check
        return pod.add_started and not pod.deleted

    def run_phase(self, verb: str, pods: list[Pod], record: bool) -> None:
        todo = [p for p in pods if self._eligible(p, verb)]
        if not todo:
            return
        assert self.pool is not None
        kind = "warm-up " if not record else ""
        self.log(f"{kind}{verb}: {len(todo)} calls")
        t0 = time.perf_counter()
        futures: list[Future[dict[str, Any] | None]] = [
            self.pool.submit(self.run_chain, p, verb) for p in todo
        ]
        records = [f.result() for f in futures]
        wall = time.perf_counter() - t0
        done = [r for r in records if r is not None]
        with self._lock:
            self.samples.extend(done)
        failed = sum(1 for r in done if not r["ok"])
        if record:
            self.phases.append(
                {
                    "verb": verb,
                    "calls": len(done),
                    "failed": failed,
                    "wall_s": wall,
                    "calls_per_s": len(done) / wall if wall > 0 else None,
                }
            )
        self.log(f"{kind}{verb}: {len(done) - failed}/{len(done)} ok in {wall:.3f} s")

    def run_all(self) -> None:
        self.setup()
        warm = [p for p in self.pods if p.warmup]
        real = [p for p in self.pods if not p.warmup]
        for pods, record in ((warm, False), (real, True)):
            if record:  # after the warm-up, once set-up noise has settled
                self.measure_floor()
            if not pods:
                continue
            self.run_phase("ADD", pods, record)
            self.verify_add(pods)
            self.run_phase("CHECK", pods, record)
            self.run_phase("DEL", pods, record)
            self.verify_del(pods)

    def measure_floor(self) -> None:
        """Cost of the harness's own fork+exec+wait4 path, with /bin/true in the worker; and
        of ``--client-floor``'s binary the same way."""
        self.floor = self._time_binary(shutil.which("true") or "/bin/true")
        client = getattr(self.args, "client_floor", None)
        if client:
            self.client_floor = self._time_binary(client)

    def _time_binary(self, binary: str) -> dict[str, Any]:
        env = {"PATH": self.path_var}
        assert self.pool is not None
        results = [
            self.pool.submit(self.spawner.run, binary, env, b"").result()
            for _ in range(FLOOR_CALLS)
        ]
        walls = [r.wall_ms for r in results[1:]]
        cpus = [r.cpu_ms for r in results[1:]]
        rss = [r.rss_kb / 1024.0 for r in results[1:] if r.rss_kb is not None]
        return {
            "binary": binary,
            "n": len(walls),
            "wall_ms_p50": percentile(walls, 50),
            "cpu_ms_p50": percentile(cpus, 50),
            "rss_mb_p50": percentile(rss, 50),
        }

    # -- verification (untimed) ----------------------------------------------------------------

    def _links(self) -> dict[str, str]:
        links = ip_json(self.node_ns, "-d", "link", "show")
        return {lk["ifname"]: (lk.get("linkinfo") or {}).get("info_kind", "") for lk in links}

    def verify_add(self, pods: list[Pod]) -> None:
        done = [p for p in pods if p.add_ok]
        if not done:
            return
        node_links = self._links()
        seen: dict[str, str] = {}
        for pod in done:
            if not pod.ips:
                self.fail(pod, "ADD", "verify", "the ADD result carries no IPs")
            for ip in pod.ips:
                owner = seen.setdefault(ip, pod.name)
                if owner != pod.name:
                    self.fail(pod, "ADD", "verify", f"IP {ip} is also assigned to {owner}")
            try:
                addrs = ip_json(pod.netns, "addr", "show")
            except (RuntimeError, ValueError) as e:
                self.fail(pod, "ADD", "verify", f"cannot list the pod netns: {e}")
                continue
            iface = next((a for a in addrs if a.get("ifname") == self.args.ifname), None)
            if iface is None:
                self.fail(pod, "ADD", "verify", f"{self.args.ifname} missing in the pod netns")
            else:
                local = set()
                for ai in iface.get("addr_info", []):
                    with contextlib.suppress(ValueError, KeyError):
                        local.add(str(ipaddress.ip_address(ai["local"])))
                for ip in pod.ips:
                    if ip not in local:
                        self.fail(pod, "ADD", "verify", f"{ip} is not on {self.args.ifname}")
            for name in result_host_interfaces(pod.result):
                if name not in node_links:
                    self.fail(pod, "ADD", "verify", f"host interface {name} not found on the node")
                elif node_links[name] == "veth":
                    pod.host_veths.append(name)

    def verify_del(self, pods: list[Pod]) -> None:
        done = [p for p in pods if p.deleted]
        if not done:
            return
        node_links = self._links()
        routes = host_route_ips(self.node_ns)
        for pod in done:
            try:
                addrs = ip_json(pod.netns, "link", "show")
                if any(a.get("ifname") == self.args.ifname for a in addrs):
                    self.fail(pod, "DEL", "verify", f"{self.args.ifname} still in the pod netns")
            except (RuntimeError, ValueError) as e:
                self.fail(pod, "DEL", "verify", f"cannot list the pod netns: {e}")
            for name in pod.host_veths:
                if name in node_links:
                    self.fail(pod, "DEL", "verify", f"host veth {name} still exists")
            for ip in pod.ips:
                if ip in routes:
                    self.fail(pod, "DEL", "verify", f"host route to {ip} left on the node")

    # -- teardown ----------------------------------------------------------------------------

    def teardown(self) -> None:
        """DEL every pod whose ADD started and was not deleted, then remove every namespace."""
        self.stop.set()
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None
        left = [p for p in self.pods if p.add_started and not p.deleted]
        if left:
            self.log(f"cleanup: DEL of {len(left)} pod(s)")
            pool = self._new_pool(1)
            try:
                for pod in left:
                    try:
                        rec = pool.submit(self.run_chain, pod, "DEL", True).result()
                    except Exception as e:  # keep cleaning up whatever happens
                        self.fail(pod, "DEL", "cleanup", f"{type(e).__name__}: {e}")
                        continue
                    if rec is not None:
                        self.samples.append(rec)
                    self.cleanup_info["dels"] += 1
            finally:
                pool.shutdown(wait=True)
        if self.node_fd is not None:
            os.close(self.node_fd)
            self.node_fd = None
        if self.created_ns:
            # Pods first, the node last (deleting it destroys the host ends of the veths).
            order = [n for n in self.created_ns if n != self.node_ns]
            if self.node_ns in self.created_ns:
                order.append(self.node_ns)
            with contextlib.suppress(Exception):
                run_ip(
                    ["-force", "-batch", "-"],
                    stdin="".join(f"netns del {n}\n" for n in order),
                    check=False,
                )
            remaining = set(_list_netns())
            leftover = [n for n in order if n in remaining]
            for n in leftover:  # one more try, one by one
                run_ip(["netns", "del", n], check=False)
            still = sorted(set(leftover) & set(_list_netns()))
            self.cleanup_info["netns_deleted"] = len(order) - len(still)
            if still:
                self.cleanup_info["netns_left"] = still
                with self._lock:
                    self.failures.append(
                        {
                            "label": "-",
                            "pod": "-",
                            "verb": "-",
                            "stage": "cleanup",
                            "detail": f"namespaces not deleted: {' '.join(still)}",
                        }
                    )
            self.created_ns = []
        if self.rss_dir is not None:
            shutil.rmtree(self.rss_dir, ignore_errors=True)
            self.rss_dir = None

    def run(self) -> int:
        old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}

        def on_signal(signum: int, _frame: Any) -> None:
            raise Interrupted(signal.Signals(signum).name)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGHUP, on_signal)
        error: BaseException | None = None
        try:
            self.run_all()
        except Interrupted as e:
            self.interrupted = str(e) or "signal"
        except KeyboardInterrupt:
            self.interrupted = "SIGINT"
        except Exception as e:
            error = e
        finally:
            for s in old:
                signal.signal(s, signal.SIG_IGN)
            try:
                if self.interrupted:
                    self.log(f"interrupted ({self.interrupted}): cleaning up")
                self.teardown()
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)
        if error is not None:
            raise BenchError(f"{type(error).__name__}: {error}") from error
        if self.interrupted:
            return EXIT_INTERRUPTED
        return EXIT_FAILURES if self.failures else EXIT_OK

    # -- report ------------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        labels = [c.label for c in self.confs]
        stats = compute_stats(self.samples, labels)
        cmp_ = None
        if len(self.confs) == 2:
            cmp_ = compare_stats(stats, self.samples, labels[0], labels[1])
        return {
            "tool": "tabby bench/cni/cni_bench.py",
            "run": {
                "id": self.run_id,
                "started": self.started.isoformat(timespec="seconds"),
                "mode": self.args.mode,
                "concurrency": self.args.concurrency if self.args.mode == "concurrent" else 1,
                "pods": self.args.pods,
                "warmup": self.args.warmup,
                "node_netns": self.node_ns,
                "rss": bool(self.args.rss),
                "ifname": self.args.ifname,
                "extra_env": self.extra_env,
                "host": {
                    "kernel": platform.release(),
                    "machine": platform.machine(),
                    "cpus": os.cpu_count(),
                    "python": platform.python_version(),
                },
            },
            "configs": [
                {
                    "label": c.label,
                    "path": c.path,
                    "network": c.chain.name,
                    "cni_version": c.chain.cni_version,
                    "chain": c.chain.types,
                    "ipam": [
                        (p.get("ipam") or {}).get("type")
                        if isinstance(p.get("ipam"), dict)
                        else None
                        for p in c.chain.plugins
                    ],
                    "cni_path": c.cni_path,
                    "binaries": c.binaries,
                    "check": c.chain.supports_check,
                }
                for c in self.confs
            ],
            "spawn_floor": self.floor,
            "client_floor": self.client_floor,
            "stats": stats,
            "phases": self.phases,
            "compare": cmp_,
            "failures": self.failures,
            "interrupted": self.interrupted,
            "cleanup": self.cleanup_info,
            "samples": self.samples,
        }


def _list_netns() -> list[str]:
    try:
        return os.listdir(NETNS_RUN_DIR)
    except OSError:
        return []
