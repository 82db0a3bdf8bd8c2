"""The pure parts of cni_bench: no I/O, no root (tests/unit/bench/test_stats.py).

Constants shared by the whole benchmark, CNI version selection, the plugin chain and the stdin
libcni would build for each plugin, CNI_ARGS and the environment, ratios, result parsing, and
the report (statistics and the printed table). Percentiles are ``bench.stats``'s, the one
definition every bench uses. Imports nothing else of the benchmarks.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.stats import median, percentile

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
    client = report.get("client_floor")
    if client and client.get("wall_ms_p50") is not None:
        lines.append(
            f"  client floor (exec of {client['binary']} the same way): p50 "
            f"{client['wall_ms_p50']:.2f} ms, cpu {client['cpu_ms_p50']:.2f} ms"
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
