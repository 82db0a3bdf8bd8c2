#!/usr/bin/env python3
"""Benchmark CNI plugins on a node, driven the way a container runtime (libcni) drives them.

Every plugin call is a fresh process: ``argv[0]`` is the binary that ``type`` names in the CNI
path, the environment carries ``CNI_COMMAND/CNI_CONTAINERID/CNI_NETNS/CNI_IFNAME/CNI_PATH/
CNI_ARGS`` and ``PATH``, and stdin is the plugin's entry of the conflist with ``name``,
``cniVersion`` and ``prevResult`` injected as libcni's ``buildOneConfig`` does. ADD runs the
chain in order (each plugin gets the previous plugin's result), CHECK in order and DEL in
reverse with the cached final ADD result as ``prevResult``.

By default the plugins run inside a private "node" network namespace, one network namespace
per pod; everything the run created is DELeted and removed on any exit. See bench/README.md.

Standard library only; needs Linux, root and iproute2; ``--rss`` needs GNU time.
The pure helpers (percentiles, ratios, stdin building, CNI_ARGS) import without side effects.
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import hashlib
import ipaddress
import json
import math
import os
import platform
import secrets
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

VERBS = ("ADD", "CHECK", "DEL")
CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"
STATE_DIR = "/run/tabby-bench"
GNU_TIME = "/usr/bin/time"
NETNS_PREFIX = "tbench-"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FLOOR_CALLS = 21
READ_CHUNK = 65536

EXIT_OK = 0
EXIT_FAILURES = 1
EXIT_USAGE = 2
EXIT_INTERRUPTED = 130


# --------------------------------------------------------------------------------------------
# Pure helpers: no I/O, no root. Unit-tested in tests/unit/test_bench_stats.py.
# --------------------------------------------------------------------------------------------


def parse_version(text: str) -> tuple[int, int, int]:
    """``"1.0.0"`` -> ``(1, 0, 0)``; ``"0.4"`` -> ``(0, 4, 0)``. ValueError if not a version."""
    parts = str(text).strip().split(".")
    if not 1 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"not a CNI version: {text!r}")
    nums = [int(p) for p in parts] + [0] * (3 - len(parts))
    return (nums[0], nums[1], nums[2])


def version_at_least(version: str, minimum: str) -> bool:
    return parse_version(version) >= parse_version(minimum)


def select_cni_version(conflist: Mapping[str, Any]) -> str:
    """The highest of ``cniVersions`` and ``cniVersion`` (the version every plugin is sent)."""
    candidates: list[str] = []
    top = conflist.get("cniVersion")
    if top is not None:
        if not isinstance(top, str):
            raise ValueError("cniVersion must be a string")
        if top:
            candidates.append(top)
    extra = conflist.get("cniVersions")
    if extra is not None:
        if not isinstance(extra, list) or not all(isinstance(v, str) for v in extra):
            raise ValueError("cniVersions must be a list of strings")
        candidates.extend(v for v in extra if v)
    if not candidates:
        raise ValueError("the network configuration has neither cniVersion nor cniVersions")
    for v in candidates:
        parse_version(v)
    return max(candidates, key=parse_version)


@dataclass(frozen=True)
class Chain:
    """A network configuration list as libcni sees it."""

    name: str
    cni_version: str
    plugins: tuple[dict[str, Any], ...]
    disable_check: bool = False

    @classmethod
    def from_doc(cls, doc: Any) -> Chain:
        """From a parsed conflist; a single-plugin ``.conf`` becomes a one-plugin list."""
        if not isinstance(doc, dict):
            raise ValueError("a network configuration must be a JSON object")
        if "plugins" in doc:
            plugins = doc["plugins"]
            if not isinstance(plugins, list) or not plugins:
                raise ValueError("'plugins' must be a non-empty list")
        else:
            plugins = [doc]
        for i, plugin in enumerate(plugins):
            if not isinstance(plugin, dict):
                raise ValueError(f"plugins[{i}] is not an object")
            ptype = plugin.get("type")
            if not isinstance(ptype, str) or not ptype or "/" in ptype:
                raise ValueError(f"plugins[{i}] has no valid 'type'")
        name = doc.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError("the network configuration has no 'name'")
        return cls(
            name=name,
            cni_version=select_cni_version(doc),
            plugins=tuple(plugins),
            disable_check=bool(doc.get("disableCheck", False)),
        )

    @property
    def types(self) -> list[str]:
        return [p["type"] for p in self.plugins]

    @property
    def ipam_types(self) -> list[str]:
        """Delegated IPAM plugin types, in chain order (they must be in the CNI path too)."""
        out = []
        for p in self.plugins:
            ipam = p.get("ipam")
            if isinstance(ipam, dict) and isinstance(ipam.get("type"), str) and ipam["type"]:
                out.append(ipam["type"])
        return out

    @property
    def supports_check(self) -> bool:
        """libcni runs CHECK only for cniVersion >= 0.4.0 and not with ``disableCheck``."""
        return version_at_least(self.cni_version, "0.4.0") and not self.disable_check

    def order(self, verb: str) -> list[int]:
        """Plugin indices in execution order: DEL runs the chain in reverse."""
        indices = list(range(len(self.plugins)))
        return indices[::-1] if verb == "DEL" else indices

    def plugin_config(self, index: int, prev_result: Any | None) -> dict[str, Any]:
        """One plugin's stdin object (libcni buildOneConfig: injected keys win)."""
        conf = dict(self.plugins[index])
        conf["name"] = self.name
        conf["cniVersion"] = self.cni_version
        if prev_result is not None:
            conf["prevResult"] = prev_result
        return conf

    def cached_prev_result(self, verb: str, cached: Any | None) -> Any | None:
        """What CHECK/DEL pass as prevResult: the cached ADD result (DEL: only from 0.4.0)."""
        if verb == "CHECK":
            return cached
        if verb == "DEL":
            return cached if version_at_least(self.cni_version, "0.4.0") else None
        raise ValueError("ADD passes each plugin's own result to the next plugin")

    def stdins(self, verb: str, cached: Any | None = None) -> list[tuple[int, dict[str, Any]]]:
        """``(plugin index, stdin object)`` in execution order for CHECK or DEL."""
        prev = self.cached_prev_result(verb, cached)
        return [(i, self.plugin_config(i, prev)) for i in self.order(verb)]


def encode_config(conf: Mapping[str, Any]) -> bytes:
    return json.dumps(conf, separators=(",", ":")).encode()


def cni_args(pod_name: str, container_id: str, namespace: str = "bench") -> str:
    """The CNI_ARGS a Kubernetes runtime sends for a pod."""
    return (
        f"IgnoreUnknown=1;K8S_POD_NAMESPACE={namespace};K8S_POD_NAME={pod_name};"
        f"K8S_POD_INFRA_CONTAINER_ID={container_id}"
    )


def plugin_env(
    *,
    command: str,
    container_id: str,
    netns: str,
    ifname: str,
    cni_path: str,
    args: str,
    path: str,
    extra: Mapping[str, str] | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of one plugin call: (base minus CNI_*) + PATH + CNI_* + extra."""
    env = {} if base is None else {k: v for k, v in base.items() if not k.startswith("CNI_")}
    env["PATH"] = path
    env.update(
        CNI_COMMAND=command,
        CNI_CONTAINERID=container_id,
        CNI_NETNS=netns,
        CNI_IFNAME=ifname,
        CNI_PATH=cni_path,
        CNI_ARGS=args,
    )
    if extra:
        env.update(extra)
    return env


def parse_env_assignments(items: Iterable[str]) -> dict[str, str]:
    """``["K=V", ...]`` -> dict; ValueError on an item without ``=`` or with an empty key."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--env wants KEY=VALUE, got {item!r}")
        out[key] = value
    return out


def find_plugin(ptype: str, cni_path: str) -> str | None:
    """First executable file named ``ptype`` in the colon-separated CNI path (libcni FindInPath)."""
    if not ptype or "/" in ptype:
        return None
    for directory in cni_path.split(":"):
        if not directory:
            continue
        candidate = os.path.join(directory, ptype)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    return None


def percentile(values: Sequence[float], q: float) -> float | None:
    """q-th percentile (0..100), linear interpolation between closest ranks.

    The same definition as numpy's default and ``statistics.quantiles(method="inclusive")``:
    the p50 of an even-sized sample is the mean of the two middle values.
    """
    if not 0 <= q <= 100:
        raise ValueError("q must be within 0..100")
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float | None:
    return percentile(values, 50)


def paired_ratios(a: Mapping[Any, float], b: Mapping[Any, float]) -> list[float]:
    """``b[k] / a[k]`` for every key in both (in a's order), skipping a[k] <= 0."""
    return [b[k] / a[k] for k in a if k in b and a[k] > 0]


def ratio(numerator: float | None, denominator: float | None) -> float | None:
    if numerator is None or denominator is None or denominator <= 0:
        return None
    return numerator / denominator


def summarize(values: Sequence[float]) -> dict[str, float | int | None]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p90": percentile(values, 90),
        "p99": percentile(values, 99),
        "max": max(values) if values else None,
        "mean": (sum(values) / len(values)) if values else None,
    }


def result_ips(result: Any) -> list[str]:
    """Addresses (no prefix length) of a CNI result: ``ips`` (>= 0.3.0) or ``ip4``/``ip6``."""
    if not isinstance(result, dict):
        return []
    raw: list[str] = []
    ips = result.get("ips")
    if isinstance(ips, list):
        raw.extend(str(i.get("address", "")) for i in ips if isinstance(i, dict))
    for legacy in ("ip4", "ip6"):
        entry = result.get(legacy)
        if isinstance(entry, dict) and entry.get("ip"):
            raw.append(str(entry["ip"]))
    out = []
    for addr in raw:
        with contextlib.suppress(ValueError):
            out.append(str(ipaddress.ip_interface(addr).ip))
    return out


def result_host_interfaces(result: Any) -> list[str]:
    """Names of the result's interfaces that are not in a sandbox (host side)."""
    if not isinstance(result, dict) or not isinstance(result.get("interfaces"), list):
        return []
    return [
        i["name"]
        for i in result["interfaces"]
        if isinstance(i, dict) and i.get("name") and not i.get("sandbox")
    ]


def ipam_networks(plugins: Iterable[Mapping[str, Any]]) -> list[Any]:
    """Address ranges of the chain's IPAM sections (keys named like ``subnet`` or ``*pool*``)."""
    found: list[Any] = []

    def walk(node: Any, key: str) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, str(k).lower())
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        elif isinstance(node, str) and ("subnet" in key or "pool" in key) and "/" in node:
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(node, strict=False)
                if net.prefixlen > 0:
                    found.append(net)

    for plugin in plugins:
        walk(plugin.get("ipam"), "ipam")
    return found


def overlapping(nets_a: Iterable[Any], nets_b: Iterable[Any]) -> list[tuple[str, str]]:
    nets_b = list(nets_b)
    return [
        (str(x), str(y)) for x in nets_a for y in nets_b if x.version == y.version and x.overlaps(y)
    ]


def plugin_error(stdout: bytes, stderr: bytes, rc: int) -> str:
    """A one-line reason from a failed call: the CNI error object, else the stderr tail."""
    with contextlib.suppress(ValueError, UnicodeDecodeError):
        obj = json.loads(stdout)
        if isinstance(obj, dict) and "msg" in obj:
            msg = f"code {obj.get('code')}: {obj.get('msg')}"
            if obj.get("details"):
                msg += f" ({obj['details']})"
            return msg
    tail = stderr.decode(errors="replace").strip().splitlines()[-3:]
    reason = " | ".join(tail) if tail else stdout.decode(errors="replace").strip()[:300]
    how = f"killed by signal {-rc}" if rc < 0 else f"exit {rc}"
    return f"{how}: {reason}" if reason else how


def compute_stats(samples: Iterable[Mapping[str, Any]], labels: Sequence[str]) -> dict[str, Any]:
    """Per label, per verb (and per plugin for chains longer than one) latency/CPU/RSS stats.

    ``samples`` are call records; warm-up and cleanup records are skipped. Percentiles use the
    calls that succeeded; ``fail`` counts the others.
    """
    groups: dict[str, dict[str, dict[str, list[float]]]] = {lbl: {} for lbl in labels}

    def bucket(label: str, key: str) -> dict[str, list[float]]:
        per_label = groups.setdefault(label, {})
        return per_label.setdefault(key, {"wall": [], "cpu": [], "rss": [], "fail": []})

    for s in samples:
        if s.get("warmup") or s.get("cleanup"):
            continue
        b = bucket(s["label"], s["verb"])
        if not s["ok"]:
            b["fail"].append(1.0)
            continue
        b["wall"].append(s["wall_ms"])
        b["cpu"].append(s["cpu_ms"])
        if s.get("rss_kb") is not None:
            b["rss"].append(s["rss_kb"] / 1024.0)
        plugins = s.get("plugins") or []
        if len(plugins) > 1:
            for p in plugins:
                pb = bucket(s["label"], f"{s['verb']}/{p['type']}")
                pb["wall"].append(p["wall_ms"])
                pb["cpu"].append(p["cpu_ms"])
                if p.get("rss_kb") is not None:
                    pb["rss"].append(p["rss_kb"] / 1024.0)

    def sort_key(key: str) -> tuple[int, int]:
        # verb order, the whole call first, then its plugins in the order they first ran
        verb = key.split("/", 1)[0]
        return (VERBS.index(verb) if verb in VERBS else len(VERBS), "/" in key)

    out: dict[str, Any] = {}
    for label, per_key in groups.items():
        out[label] = {}
        for key in sorted(per_key, key=sort_key):  # stable: keeps first-seen order
            b = per_key[key]
            entry: dict[str, Any] = summarize(b["wall"])
            entry["fail"] = len(b["fail"])
            entry["cpu_p50"] = percentile(b["cpu"], 50)
            entry["cpu_mean"] = (sum(b["cpu"]) / len(b["cpu"])) if b["cpu"] else None
            entry["rss_p50_mb"] = percentile(b["rss"], 50)
            entry["rss_max_mb"] = max(b["rss"]) if b["rss"] else None
            out[label][key] = entry
    return out


def compare_stats(
    stats: Mapping[str, Any], samples: Iterable[Mapping[str, Any]], label_a: str, label_b: str
) -> dict[str, Any]:
    """B relative to A per verb: ratio of p50s, ratio of p90s, median of per-pod B/A ratios."""
    walls: dict[tuple[str, str], dict[int, float]] = {}
    for s in samples:
        if s.get("warmup") or s.get("cleanup") or not s["ok"]:
            continue
        walls.setdefault((s["label"], s["verb"]), {})[s["index"]] = s["wall_ms"]
    verbs: dict[str, Any] = {}
    for verb in VERBS:
        sa = stats.get(label_a, {}).get(verb)
        sb = stats.get(label_b, {}).get(verb)
        if not sa or not sb or not sa["n"] or not sb["n"]:
            continue
        pairs = paired_ratios(walls.get((label_a, verb), {}), walls.get((label_b, verb), {}))
        verbs[verb] = {
            "p50_ratio": ratio(sb["p50"], sa["p50"]),
            "p90_ratio": ratio(sb["p90"], sa["p90"]),
            "paired_median": median(pairs),
            "pairs": len(pairs),
        }
    return {"a": label_a, "b": label_b, "verbs": verbs}


def rounded(obj: Any, digits: int = 4) -> Any:
    """A copy of a JSON-able structure with floats rounded (for the JSON report)."""
    if isinstance(obj, float):
        return round(obj, digits)
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [rounded(v, digits) for v in obj]
    return obj


def _fmt(value: float | None, width: int, digits: int = 2) -> str:
    if value is None:
        return "-".rjust(width)
    if digits and abs(value) >= 1000:
        digits = 0
    elif digits and abs(value) >= 100:
        digits = 1
    return f"{value:{width}.{digits}f}"


def format_report(report: Mapping[str, Any]) -> str:
    """The human-readable table for a report dict (what ``--json`` prints)."""
    lines: list[str] = []
    run = report["run"]
    iso = "private node netns " + run["node_netns"] if run["node_netns"] else "HOST netns"
    head = (
        f"cni_bench run {run['id']}: {run['mode']}"
        + (f" k={run['concurrency']}" if run["mode"] == "concurrent" else "")
        + f", {run['pods']} pods per config (+{run['warmup']} warm-up), {iso}"
    )
    lines.append(head)
    for c in report["configs"]:
        chain = " -> ".join(
            t + (f"[ipam {i}]" if i else "") for t, i in zip(c["chain"], c["ipam"], strict=True)
        )
        lines.append(
            f"  {c['label']}: {c['path']}  network={c['network']} cniVersion={c['cni_version']}"
            f"  chain {chain}  CNI_PATH={c['cni_path']}"
        )
    floor = report.get("spawn_floor")
    if floor and floor.get("wall_ms_p50") is not None:
        rss = floor.get("rss_mb_p50")
        lines.append(
            f"  spawn floor (exec of /bin/true the same way): p50 {floor['wall_ms_p50']:.2f} ms,"
            f" cpu {floor['cpu_ms_p50']:.2f} ms"
            + (f", rss {rss:.1f} MB (all via /usr/bin/time)" if rss is not None else "")
        )
    lines.append("")
    label_w = max([6, *(len(c["label"]) for c in report["configs"])])
    verb_w = max([5, *(len(k) for per in report["stats"].values() for k in per)])
    hdr = (
        f"{'config':<{label_w}}  {'verb':<{verb_w}} {'n':>5} {'fail':>4}"
        f" {'p50':>8} {'p90':>8} {'p99':>8} {'max':>8} {'cpu p50':>8} {'rss p50':>8}"
        f" {'rss max':>8}"
    )
    lines.append(hdr)
    lines.append(
        f"{'':<{label_w}}  {'':<{verb_w}} {'':>5} {'':>4} {'ms':>8} {'ms':>8} {'ms':>8} {'ms':>8}"
        f" {'ms':>8} {'MB':>8} {'MB':>8}"
    )
    for label, per in report["stats"].items():
        for key, st in per.items():
            lines.append(
                f"{label:<{label_w}}  {key:<{verb_w}} {st['n']:>5} {st['fail']:>4}"
                f" {_fmt(st['p50'], 8)} {_fmt(st['p90'], 8)} {_fmt(st['p99'], 8)}"
                f" {_fmt(st['max'], 8)} {_fmt(st['cpu_p50'], 8)} {_fmt(st['rss_p50_mb'], 8, 1)}"
                f" {_fmt(st['rss_max_mb'], 8, 1)}"
            )
    if report.get("phases"):
        lines.append("")
        lines.append(f"{'phase':<6} {'calls':>6} {'failed':>6} {'wall s':>8} {'calls/s':>8}")
        for ph in report["phases"]:
            lines.append(
                f"{ph['verb']:<6} {ph['calls']:>6} {ph['failed']:>6} {_fmt(ph['wall_s'], 8, 3)}"
                f" {_fmt(ph['calls_per_s'], 8, 1)}"
            )
    cmp_ = report.get("compare")
    if cmp_ and cmp_.get("verbs"):
        lines.append("")
        lines.append(f"compare {cmp_['b']} / {cmp_['a']} (above 1: {cmp_['b']} is slower)")
        lines.append(
            f"{'verb':<6} {'p50 B/A':>8} {'p90 B/A':>8} {'paired median B/A':>18} {'pairs':>6}"
        )
        for verb, c in cmp_["verbs"].items():
            lines.append(
                f"{verb:<6} {_fmt(c['p50_ratio'], 8)} {_fmt(c['p90_ratio'], 8)}"
                f" {_fmt(c['paired_median'], 18)} {c['pairs']:>6}"
            )
    lines.append("")
    failures = report.get("failures") or []
    if failures:
        lines.append(f"FAILURES: {len(failures)} (first 20; all of them in --json/--output)")
        for f in failures[:20]:
            lines.append(f"  {f['label']} {f['pod']} {f['verb']} [{f['stage']}]: {f['detail']}")
    elif report.get("interrupted"):
        lines.append("verification: incomplete (interrupted), no failure so far")
    else:
        lines.append("verification: OK (every call succeeded and every check passed)")
    if report.get("interrupted"):
        lines.append(f"INTERRUPTED ({report['interrupted']}); cleanup done")
    cleanup = report.get("cleanup") or {}
    if cleanup.get("dels"):
        lines.append(f"cleanup: DEL of {cleanup['dels']} pod(s) left over")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------------
# Executing one plugin the way libcni does.
# --------------------------------------------------------------------------------------------

_libc: ctypes.CDLL | None = None


def setns_thread(fd: int) -> None:
    """Move the *calling thread* (only it: setns(2) is per thread) into a network namespace.

    Python 3.11 has no os.setns, so this goes through libc.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@dataclass
class ExecResult:
    rc: int
    stdout: bytes
    stderr: bytes
    wall_ms: float
    cpu_ms: float
    rss_kb: int | None
    timed_out: bool = False


class Spawner:
    """fork+exec of one binary with stdin/stdout/stderr pipes, then wait4 for its rusage.

    ``os.posix_spawn`` (glibc: clone(CLONE_VM|CLONE_VFORK), as Go's os/exec does) is thread
    safe and its cost does not grow with the harness's heap; the child starts in the network
    namespace of the calling thread. Each child gets its own session so a terminal Ctrl-C
    never kills a plugin half-way through an ADD; on timeout the session is SIGKILLed.
    """

    def __init__(self, timeout: float, rss_dir: str | None = None) -> None:
        self.timeout = timeout
        self.rss_dir = rss_dir
        self._seq = 0
        self._lock = threading.Lock()

    def _rss_file(self) -> str:
        assert self.rss_dir is not None
        with self._lock:
            self._seq += 1
            seq = self._seq
        return os.path.join(self.rss_dir, f"call-{seq}")

    def run(self, path: str, env: Mapping[str, str], stdin: bytes) -> ExecResult:
        argv = [path]
        rss_file = None
        if self.rss_dir is not None:
            rss_file = self._rss_file()
            argv = [GNU_TIME, "-q", "-f", "%M", "-o", rss_file, path]
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        parent_fds = [in_w, out_r, err_r]
        try:
            actions = [
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ]
            t0 = time.perf_counter_ns()
            try:
                pid = os.posix_spawn(
                    argv[0],
                    argv,
                    dict(env),
                    file_actions=actions,
                    setsid=True,
                    setsigmask=(),
                    setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE),
                )
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            parent_fds = []  # _communicate owns (and always closes) them from here on
            stdout, stderr, timed_out = self._communicate(pid, in_w, out_r, err_r, stdin)
            _, status, usage = os.wait4(pid, 0)
            t1 = time.perf_counter_ns()
        finally:
            for fd in parent_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        rss_kb = None
        if rss_file is not None:
            rss_kb = _read_rss(rss_file)
        return ExecResult(
            rc=os.waitstatus_to_exitcode(status),
            stdout=stdout,
            stderr=stderr,
            wall_ms=(t1 - t0) / 1e6,
            cpu_ms=(usage.ru_utime + usage.ru_stime) * 1000.0,
            rss_kb=rss_kb,
            timed_out=timed_out,
        )

    def _communicate(
        self, pid: int, in_w: int, out_r: int, err_r: int, data: bytes
    ) -> tuple[bytes, bytes, bool]:
        """Write stdin and drain stdout/stderr without deadlock; closes the three fds."""
        bufs: dict[int, list[bytes]] = {out_r: [], err_r: []}
        poller = select.poll()
        open_fds = {out_r, err_r}
        poller.register(out_r, select.POLLIN)
        poller.register(err_r, select.POLLIN)
        view = memoryview(data)
        offset = 0
        if data:
            os.set_blocking(in_w, False)
            poller.register(in_w, select.POLLOUT)
            open_fds.add(in_w)
        else:
            os.close(in_w)
        deadline = time.monotonic() + self.timeout
        timed_out = False
        try:
            while open_fds:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if timed_out:  # killed and still not drained: a daemon holds the pipe
                        break
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 5.0
                    continue
                for fd, ev in poller.poll(max(1, int(remaining * 1000))):
                    if fd == in_w:
                        if ev & (select.POLLERR | select.POLLHUP):
                            done = True
                        else:
                            try:
                                offset += os.write(in_w, view[offset : offset + READ_CHUNK])
                            except BlockingIOError:
                                pass
                            except BrokenPipeError:
                                offset = len(view)
                            done = offset >= len(view)
                        if done:
                            poller.unregister(in_w)
                            open_fds.discard(in_w)
                            os.close(in_w)
                        continue
                    chunk = os.read(fd, READ_CHUNK)
                    if chunk:
                        bufs[fd].append(chunk)
                    else:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        os.close(fd)
        finally:
            for fd in open_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return b"".join(bufs[out_r]), b"".join(bufs[err_r]), timed_out


def _read_rss(path: str) -> int | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        os.unlink(path)
    except OSError:
        return None
    if lines and lines[-1].isdigit():
        return int(lines[-1])
    return None


# --------------------------------------------------------------------------------------------
# Namespaces and iproute2 (untimed).
# --------------------------------------------------------------------------------------------


class BenchError(Exception):
    """A usage or setup problem (exit 2)."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP, treated like Ctrl-C."""


def run_ip(args: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(
        ["ip", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def ip_json(netns: str | None, *args: str) -> list[dict[str, Any]]:
    prefix = ["-n", netns] if netns else []
    out = run_ip(["-j", *prefix, *args])
    data = json.loads(out) if out.strip() else []
    return [d for d in data if isinstance(d, dict)]


def host_route_ips(netns: str | None) -> set[str]:
    """Addresses that have a host route (/32, /128) in any routing table of the namespace."""
    found: set[str] = set()
    for family in ("-4", "-6"):
        try:
            routes = ip_json(netns, family, "route", "show", "table", "all")
        except RuntimeError:
            if family == "-4":
                raise
            continue  # IPv6 disabled on this kernel
        for route in routes:
            dst = route.get("dst")
            if not dst or dst == "default":
                continue
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(dst, strict=False)
                if net.prefixlen == net.max_prefixlen:
                    found.add(str(net.network_address))
    return found


# --------------------------------------------------------------------------------------------
# The benchmark.
# --------------------------------------------------------------------------------------------


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
        self.node_fd: int | None = None
        self.node_ino: int | None = None
        self.created_ns: list[str] = []
        self.pods: list[Pod] = []
        self.samples: list[dict[str, Any]] = []
        self.failures: list[dict[str, Any]] = []
        self.phases: list[dict[str, Any]] = []
        self.floor: dict[str, Any] = {}
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
        wanted = [p.netns for p in self.pods] + ([self.node_ns] if self.node_ns else [])
        clash = set(wanted) & set(_list_netns())
        if clash:  # never adopt (and later delete) a namespace this run did not create
            raise BenchError(f"namespace already exists: {' '.join(sorted(clash))}")
        if self.args.rss:
            self.rss_dir = tempfile.mkdtemp(prefix=f".rss-{self.run_id}-", dir=STATE_DIR)
            self.spawner.rss_dir = self.rss_dir
        if self.node_ns:
            self.log(f"node netns {self.node_ns}")
            self.created_ns.append(self.node_ns)
            run_ip(["netns", "add", self.node_ns])
            run_ip(["-n", self.node_ns, "link", "set", "lo", "up"])
            run_ip(["-n", self.node_ns, "addr", "add", self.args.node_addr, "dev", "lo"])
            run_ip(["-n", self.node_ns, "route", "add", "169.254.1.1/32", "dev", "lo"])
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
        """Cost of the harness's own fork+exec+wait4 path, with /bin/true in the worker."""
        true_bin = shutil.which("true") or "/bin/true"
        env = {"PATH": self.path_var}
        assert self.pool is not None
        results = [
            self.pool.submit(self.spawner.run, true_bin, env, b"").result()
            for _ in range(FLOOR_CALLS)
        ]
        walls = [r.wall_ms for r in results[1:]]
        cpus = [r.cpu_ms for r in results[1:]]
        rss = [r.rss_kb / 1024.0 for r in results[1:] if r.rss_kb is not None]
        self.floor = {
            "binary": true_bin,
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
            "tool": "tabby bench/cni_bench.py",
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


# --------------------------------------------------------------------------------------------
# Command line.
# --------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cni_bench.py",
        description=(
            "Benchmark CNI plugins on a node the way a runtime (libcni) runs them: per-call "
            "ADD/CHECK/DEL latency percentiles, CPU per call, peak RSS, sequential or concurrent, "
            "optionally interleaved against a second conflist. Needs root."
        ),
        epilog="Exit status: 0 all good, 1 plugin or verification failures, 2 usage/setup "
        "error, 130 interrupted (after cleanup). See bench/README.md.",
    )
    p.add_argument("--conf", required=True, help="conflist (or single .conf) to benchmark (A)")
    p.add_argument(
        "--cni-path",
        default=os.environ.get("CNI_PATH") or "/opt/cni/bin",
        help="colon-separated plugin directories for A (default: $CNI_PATH or /opt/cni/bin)",
    )
    p.add_argument(
        "--compare", metavar="B.conflist", help="interleave this conflist (B) pod by pod"
    )
    p.add_argument("--cni-path-b", help="plugin directories for B (default: --cni-path)")
    p.add_argument("--label-a", help="name of A in the report (default: its plugin chain)")
    p.add_argument("--label-b", help="name of B in the report (default: its plugin chain)")
    p.add_argument(
        "--mode",
        choices=("sequential", "concurrent"),
        default="sequential",
        help="one call at a time (default), or -k calls in flight",
    )
    p.add_argument(
        "-k", "--concurrency", type=int, default=8, help="workers in concurrent mode (8)"
    )
    p.add_argument("-n", "--pods", type=int, default=50, help="measured pods per config (50)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured warm-up pods per config (3)")
    p.add_argument("--ifname", default="eth0", help="CNI_IFNAME (eth0)")
    p.add_argument("--k8s-namespace", default="bench", help="K8S_POD_NAMESPACE in CNI_ARGS")
    p.add_argument(
        "--env", action="append", metavar="K=V", help="add a variable to the plugin env (repeat)"
    )
    p.add_argument(
        "--inherit-env",
        action="store_true",
        help="pass this process's environment (minus CNI_*) to plugins, as libcni does; "
        "default: only PATH, the CNI_* variables and --env",
    )
    p.add_argument(
        "--rss", action="store_true", help="peak RSS per call via /usr/bin/time (adds ~1 ms/call)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="per plugin call, seconds (60)")
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="run plugins in the real host netns, not a private node netns (changes the host!)",
    )
    p.add_argument(
        "--node-addr", default="192.0.2.1/32", help="address put on lo of the node netns"
    )
    p.add_argument("--json", action="store_true", help="JSON report on stdout (progress on stderr)")
    p.add_argument("--output", metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    return p


def load_conf(path: str, cni_path: str, label: str | None, tag: str) -> NetConf:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        chain = Chain.from_doc(doc)
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: {e}") from e
    binaries = []
    for ptype in chain.types:
        found = find_plugin(ptype, cni_path)
        if found is None:
            raise BenchError(f"{path}: plugin {ptype!r} not found in CNI path {cni_path}")
        binaries.append(found)
    for ipam in chain.ipam_types:
        if find_plugin(ipam, cni_path) is None:
            raise BenchError(f"{path}: IPAM plugin {ipam!r} not found in CNI path {cni_path}")
    default_label = "+".join(dict.fromkeys([*chain.types, *chain.ipam_types]))
    return NetConf(
        label=label or default_label,
        tag=tag,
        path=path,
        chain=chain,
        cni_path=cni_path,
        binaries=binaries,
    )


def preflight(confs: list[NetConf], args: argparse.Namespace) -> None:
    """Untimed VERSION call to every binary: it runs, and speaks the chosen cniVersion."""
    spawner = Spawner(timeout=30.0)
    path_var = os.environ.get("PATH") or DEFAULT_PATH
    for conf in confs:
        types = list(dict.fromkeys([*conf.chain.types, *conf.chain.ipam_types]))
        for ptype in types:
            binary = find_plugin(ptype, conf.cni_path)
            assert binary is not None
            env = {
                "PATH": path_var,
                "CNI_COMMAND": "VERSION",
                "CNI_PATH": conf.cni_path,
                "CNI_NETNS": "dummy",
                "CNI_IFNAME": "dummy",
                "CNI_CONTAINERID": "dummy",
            }
            res = spawner.run(binary, env, encode_config({"cniVersion": conf.chain.cni_version}))
            if res.rc != 0:
                raise BenchError(
                    f"{binary} VERSION failed: {plugin_error(res.stdout, res.stderr, res.rc)}"
                )
            try:
                supported = json.loads(res.stdout).get("supportedVersions") or []
            except (ValueError, AttributeError):
                supported = []
            if supported and conf.chain.cni_version not in supported:
                raise BenchError(
                    f"{binary} does not speak cniVersion {conf.chain.cni_version} "
                    f"(supports {', '.join(supported)}); lower it in {conf.path}"
                )


def prepare(args: argparse.Namespace) -> list[NetConf]:
    if args.pods < 1 or args.warmup < 0 or args.concurrency < 1 or args.timeout <= 0:
        raise BenchError("need -n >= 1, --warmup >= 0, -k >= 1, --timeout > 0")
    try:
        parse_env_assignments(args.env or [])
        ipaddress.ip_interface(args.node_addr)
    except ValueError as e:
        raise BenchError(str(e)) from e
    if not args.ifname or len(args.ifname) > 15 or "/" in args.ifname:
        raise BenchError("--ifname must be a valid interface name")
    if os.geteuid() != 0:
        raise BenchError("must run as root (network namespaces, plugins)")
    if shutil.which("ip") is None:
        raise BenchError("iproute2 'ip' not found (apt-get install iproute2)")
    if args.rss and not os.access(GNU_TIME, os.X_OK):
        raise BenchError(f"--rss needs GNU time at {GNU_TIME} (apt-get install time)")
    confs = [load_conf(args.conf, args.cni_path, args.label_a, "a")]
    if args.compare:
        confs.append(load_conf(args.compare, args.cni_path_b or args.cni_path, args.label_b, "b"))
        a, b = confs
        if a.chain.name == b.chain.name:
            raise BenchError(
                f"both configs use network name {a.chain.name!r}: IPAM state and cached "
                "results would mix; give them different names"
            )
        clash = overlapping(ipam_networks(a.chain.plugins), ipam_networks(b.chain.plugins))
        if clash:
            pairs = ", ".join(f"{x} / {y}" for x, y in clash)
            raise BenchError(f"the two configs' address ranges overlap: {pairs}")
        if a.label == b.label:
            a.label, b.label = f"A:{a.label}", f"B:{b.label}"
    elif args.cni_path_b or args.label_b:
        raise BenchError("--cni-path-b and --label-b need --compare")
    preflight(confs, args)
    return confs


def _ensure_std_fds() -> None:
    """posix_spawn's dup2 onto 0/1/2 needs our pipes not to *be* 0/1/2: keep them open."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _ensure_std_fds()
    try:
        confs = prepare(args)
    except BenchError as e:
        print(f"cni_bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    bench = Bench(args, confs)
    try:
        rc = bench.run()
    except BenchError as e:
        print(f"cni_bench: error: {e} (everything the run created was cleaned up)", file=sys.stderr)
        rc = EXIT_USAGE
    report = rounded(bench.report())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return rc


if __name__ == "__main__":
    sys.exit(main())
