"""The benches' one percentile definition (bench/stats.py), and the pure parts of cni_bench
(bench/cni/cni_bench_pure.py): stdin building, CNI_ARGS/env, the report (no root)."""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from bench import stats
from bench.cni import cni_bench_pure as cb
from tests import REPO_ROOT as ROOT

PTP_LIST: dict[str, Any] = {
    "cniVersion": "0.4.0",
    "cniVersions": ["1.0.0", "0.3.1"],
    "name": "net1",
    "plugins": [
        {"type": "ptp", "ipam": {"type": "host-local", "subnet": "10.250.0.0/16"}},
        {"type": "tuning", "sysctl": {"net.core.somaxconn": "1024"}},
        {"type": "portmap", "name": "ignored", "cniVersion": "0.1.0", "snat": True},
    ],
}
RESULT = {
    "cniVersion": "1.0.0",
    "interfaces": [
        {"name": "veth1", "mac": "aa:bb:cc:dd:ee:ff"},
        {"name": "eth0", "sandbox": "/run/netns/p"},
    ],
    "ips": [
        {"address": "10.250.0.7/16", "interface": 1},
        {"address": "fd00::0007/64", "interface": 1},
    ],
}


# -- percentiles -------------------------------------------------------------------------------


def test_percentile_matches_statistics_inclusive() -> None:
    data = [7.0, 1.0, 3.0, 10.0, 4.0, 2.5, 8.0, 6.0, 5.0, 9.0, 0.5]
    cuts = statistics.quantiles(data, n=100, method="inclusive")
    for q in range(1, 100):
        assert stats.percentile(data, q) == pytest.approx(cuts[q - 1])
    assert stats.median(data) == statistics.median(data)
    assert stats.median(data[1:]) == statistics.median(data[1:])  # even: the two middle ones


@pytest.mark.parametrize(
    ("values", "q", "expected"),
    [
        ([5.0], 50, 5.0),
        ([5.0], 99, 5.0),
        ([1.0, 2.0], 50, 1.5),
        ([1.0, 2.0, 3.0, 4.0], 50, 2.5),
        ([4.0, 1.0, 3.0, 2.0], 0, 1.0),
        ([4.0, 1.0, 3.0, 2.0], 100, 4.0),
        (list(range(1, 101)), 90, 90.1),
        (list(range(1, 101)), 99, 99.01),
    ],
)
def test_percentile_values(values: list[float], q: float, expected: float) -> None:
    assert stats.percentile(values, q) == pytest.approx(expected)
    assert stats.pct(values, q) == pytest.approx(expected)


def test_percentile_empty_and_bounds() -> None:
    assert stats.percentile([], 50) is None
    assert stats.median([]) is None
    assert math.isnan(stats.pct([], 90))
    with pytest.raises(ValueError):
        stats.percentile([1.0], 101)
    with pytest.raises(ValueError):
        stats.percentile([1.0], -1)


def test_percentile_does_not_mutate_input_and_takes_any_iterable() -> None:
    data = [3.0, 1.0, 2.0]
    stats.percentile(data, 50)
    assert data == [3.0, 1.0, 2.0]
    assert stats.percentile(iter(data), 50) == 2.0
    assert stats.percentile((float(v) for v in range(5)), 75) == 3.0


def test_summary() -> None:
    assert stats.summary([4.0, 1.0, 3.0, 2.0]) == {
        "n": 4,
        "p50": 2.5,
        "p90": pytest.approx(3.7),
        "min": 1.0,
        "max": 4.0,
    }
    empty = stats.summary([], qs=(50, 99))
    assert empty["n"] == 0
    assert all(math.isnan(float(empty[k])) for k in ("p50", "p99", "min", "max"))


def test_the_cni_bench_reports_with_the_one_definition() -> None:
    """cni_bench's statistics are bench.stats', not a copy of their own."""
    assert cb.percentile is stats.percentile
    assert cb.median is stats.median


def test_summarize() -> None:
    s = cb.summarize([1.0, 2.0, 3.0, 4.0, 10.0])
    assert s["n"] == 5
    assert s["p50"] == 3.0
    assert s["max"] == 10.0
    assert s["mean"] == 4.0
    empty = cb.summarize([])
    assert empty["n"] == 0
    assert empty["p50"] is None
    assert empty["max"] is None


# -- ratios ------------------------------------------------------------------------------------


def test_paired_ratios_by_key() -> None:
    a = {0: 10.0, 1: 20.0, 2: 5.0, 3: 0.0}
    b = {0: 20.0, 1: 10.0, 3: 7.0, 4: 1.0}
    # key 2 missing in b, key 3 has a zero denominator, key 4 missing in a
    assert cb.paired_ratios(a, b) == [2.0, 0.5]


def test_paired_median_differs_from_ratio_of_medians() -> None:
    a = {i: v for i, v in enumerate([1.0, 2.0, 3.0])}
    b = {i: v for i, v in enumerate([3.0, 2.0, 3.0])}
    assert cb.median(cb.paired_ratios(a, b)) == 1.0
    assert cb.ratio(cb.median(list(b.values())), cb.median(list(a.values()))) == 1.5


def test_ratio_guards() -> None:
    assert cb.ratio(2.0, 4.0) == 0.5
    assert cb.ratio(None, 4.0) is None
    assert cb.ratio(2.0, None) is None
    assert cb.ratio(2.0, 0.0) is None


def _sample(label: str, verb: str, index: int, wall: float, **kw: object) -> dict[str, object]:
    rec: dict[str, object] = {
        "label": label,
        "verb": verb,
        "index": index,
        "ok": True,
        "wall_ms": wall,
        "cpu_ms": wall / 2,
        "rss_kb": None,
        "warmup": False,
        "cleanup": False,
        "plugins": [{"type": "x", "wall_ms": wall, "cpu_ms": wall / 2, "rss_kb": None}],
    }
    rec.update(kw)
    return rec


def test_compute_and_compare_stats() -> None:
    samples = [_sample("A", "ADD", i, w) for i, w in enumerate([10.0, 12.0, 14.0])]
    samples += [_sample("B", "ADD", i, w) for i, w in enumerate([20.0, 12.0, 28.0])]
    samples.append(_sample("B", "ADD", 3, 1.0, ok=False))  # failure: counted, not timed
    samples.append(_sample("A", "ADD", 9, 999.0, warmup=True))  # warm-up: ignored
    samples.append(_sample("A", "DEL", 0, 999.0, cleanup=True))  # cleanup: ignored
    stats = cb.compute_stats(samples, ["A", "B"])
    assert stats["A"]["ADD"]["n"] == 3
    assert stats["A"]["ADD"]["p50"] == 12.0
    assert stats["A"]["ADD"]["cpu_p50"] == 6.0
    assert "DEL" not in stats["A"]
    assert stats["B"]["ADD"]["fail"] == 1
    assert stats["B"]["ADD"]["p50"] == 20.0
    cmp_ = cb.compare_stats(stats, samples, "A", "B")
    add = cmp_["verbs"]["ADD"]
    assert add["p50_ratio"] == pytest.approx(20.0 / 12.0)
    assert add["pairs"] == 3
    assert add["paired_median"] == pytest.approx(2.0)  # ratios 2.0, 1.0, 2.0


def test_compute_stats_per_plugin_rows_and_rss() -> None:
    plugins = [
        {"type": "ptp", "wall_ms": 6.0, "cpu_ms": 3.0, "rss_kb": 4096},
        {"type": "tuning", "wall_ms": 4.0, "cpu_ms": 2.0, "rss_kb": 2048},
    ]
    samples = [_sample("A", "ADD", 0, 10.0, rss_kb=4096, plugins=plugins)]
    stats = cb.compute_stats(samples, ["A"])
    assert list(stats["A"]) == ["ADD", "ADD/ptp", "ADD/tuning"]
    assert stats["A"]["ADD"]["rss_max_mb"] == 4.0
    assert stats["A"]["ADD/tuning"]["p50"] == 4.0
    assert stats["A"]["ADD/tuning"]["rss_p50_mb"] == 2.0


# -- conflist -> per-plugin stdin ----------------------------------------------------------------


def test_select_cni_version_highest() -> None:
    assert cb.select_cni_version(PTP_LIST) == "1.0.0"
    assert cb.select_cni_version({"cniVersion": "1.1.0", "cniVersions": ["0.4.0"]}) == "1.1.0"
    assert cb.select_cni_version({"cniVersions": ["0.3.1", "0.10.0", "0.4.0"]}) == "0.10.0"
    with pytest.raises(ValueError):
        cb.select_cni_version({"name": "x"})
    with pytest.raises(ValueError):
        cb.select_cni_version({"cniVersion": "one"})


def test_chain_from_doc_and_single_conf() -> None:
    chain = cb.Chain.from_doc(PTP_LIST)
    assert chain.name == "net1"
    assert chain.types == ["ptp", "tuning", "portmap"]
    assert chain.ipam_types == ["host-local"]
    single = cb.Chain.from_doc({"cniVersion": "0.3.1", "name": "n", "type": "bridge"})
    assert single.types == ["bridge"]
    assert single.cni_version == "0.3.1"
    bad: object
    for bad in ({"name": "n", "cniVersion": "1.0.0", "plugins": []}, {"plugins": [{}]}, []):
        with pytest.raises(ValueError):
            cb.Chain.from_doc(bad)
    with pytest.raises(ValueError):
        cb.Chain.from_doc({"cniVersion": "1.0.0", "plugins": [{"type": "ptp"}]})  # no name


def test_plugin_config_injects_name_version_prev_result() -> None:
    chain = cb.Chain.from_doc(PTP_LIST)
    first = chain.plugin_config(0, None)
    assert first["name"] == "net1"
    assert first["cniVersion"] == "1.0.0"
    assert "prevResult" not in first
    assert first["ipam"] == PTP_LIST["plugins"][0]["ipam"]
    third = chain.plugin_config(2, RESULT)
    assert third["name"] == "net1"  # the injected values win over the plugin's own
    assert third["cniVersion"] == "1.0.0"
    assert third["prevResult"] == RESULT
    assert third["snat"] is True
    # the conflist itself is not modified
    assert PTP_LIST["plugins"][2]["name"] == "ignored"
    assert "prevResult" not in PTP_LIST["plugins"][2]
    assert json.loads(cb.encode_config(third)) == third


def test_order_reverses_for_del() -> None:
    chain = cb.Chain.from_doc(PTP_LIST)
    assert chain.order("ADD") == [0, 1, 2]
    assert chain.order("CHECK") == [0, 1, 2]
    assert chain.order("DEL") == [2, 1, 0]


def test_check_and_del_stdins_carry_cached_result() -> None:
    chain = cb.Chain.from_doc(PTP_LIST)
    dels = chain.stdins("DEL", RESULT)
    assert [i for i, _ in dels] == [2, 1, 0]
    assert [c["type"] for _, c in dels] == ["portmap", "tuning", "ptp"]
    assert all(c["prevResult"] == RESULT for _, c in dels)
    checks = chain.stdins("CHECK", RESULT)
    assert [i for i, _ in checks] == [0, 1, 2]
    assert all(c["prevResult"] == RESULT and c["cniVersion"] == "1.0.0" for _, c in checks)
    with pytest.raises(ValueError):
        chain.stdins("ADD", RESULT)


def test_old_versions_no_check_no_del_prev_result() -> None:
    old = cb.Chain.from_doc({"cniVersion": "0.3.1", "name": "o", "plugins": [{"type": "ptp"}]})
    assert not old.supports_check
    assert all("prevResult" not in c for _, c in old.stdins("DEL", RESULT))
    new = cb.Chain.from_doc({"cniVersion": "0.4.0", "name": "o", "plugins": [{"type": "ptp"}]})
    assert new.supports_check
    disabled = cb.Chain.from_doc(
        {"cniVersion": "1.0.0", "name": "o", "disableCheck": True, "plugins": [{"type": "ptp"}]}
    )
    assert not disabled.supports_check


# -- CNI_ARGS and environment ------------------------------------------------------------------


def test_cni_args_string() -> None:
    assert cb.cni_args("bench-a-0001", "c0ffee") == (
        "IgnoreUnknown=1;K8S_POD_NAMESPACE=bench;K8S_POD_NAME=bench-a-0001;"
        "K8S_POD_INFRA_CONTAINER_ID=c0ffee"
    )
    assert "K8S_POD_NAMESPACE=prod;" in cb.cni_args("p", "c", namespace="prod")


def test_plugin_env_minimal_and_inherited() -> None:
    common = {
        "command": "ADD",
        "container_id": "cid",
        "netns": "/run/netns/x",
        "ifname": "eth0",
        "cni_path": "/opt/cni/bin:/usr/lib/cni",
        "args": "IgnoreUnknown=1",
        "path": "/usr/bin:/bin",
    }
    env = cb.plugin_env(**common)
    assert env == {
        "PATH": "/usr/bin:/bin",
        "CNI_COMMAND": "ADD",
        "CNI_CONTAINERID": "cid",
        "CNI_NETNS": "/run/netns/x",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin:/usr/lib/cni",
        "CNI_ARGS": "IgnoreUnknown=1",
    }
    base = {"HOME": "/root", "CNI_COMMAND": "DEL", "CNI_STALE": "1", "PATH": "/x"}
    env = cb.plugin_env(**common, base=base, extra={"TABBY_NODE_SOCKET": "/run/s.sock"})
    assert env["HOME"] == "/root"
    assert "CNI_STALE" not in env
    assert env["CNI_COMMAND"] == "ADD"
    assert env["PATH"] == "/usr/bin:/bin"
    assert env["TABBY_NODE_SOCKET"] == "/run/s.sock"


def test_parse_env_assignments() -> None:
    assert cb.parse_env_assignments(["A=1", "B=x=y", "C="]) == {"A": "1", "B": "x=y", "C": ""}
    for bad in (["A"], ["=1"]):
        with pytest.raises(ValueError):
            cb.parse_env_assignments(bad)


# -- results, plugin lookup, address ranges ----------------------------------------------------


def test_result_ips_and_host_interfaces() -> None:
    assert cb.result_ips(RESULT) == ["10.250.0.7", "fd00::7"]
    assert cb.result_ips({"ip4": {"ip": "10.1.0.2/24"}}) == ["10.1.0.2"]
    assert cb.result_ips({"ips": []}) == []
    assert cb.result_ips("junk") == []
    assert cb.result_host_interfaces(RESULT) == ["veth1"]


def test_find_plugin(tmp_path: Path) -> None:
    d1, d2 = tmp_path / "a", tmp_path / "b"
    d1.mkdir()
    d2.mkdir()
    (d1 / "ptp").write_text("not executable")
    exe = d2 / "ptp"
    exe.write_text("#!/bin/sh\n")
    exe.chmod(0o755)
    assert cb.find_plugin("ptp", f"{d1}:{d2}") == str(exe)
    assert cb.find_plugin("bridge", f"{d1}:{d2}") is None
    assert cb.find_plugin("../b/ptp", str(d1)) is None


def test_ipam_networks_and_overlap() -> None:
    a = [
        {
            "type": "ptp",
            "ipam": {
                "type": "host-local",
                "ranges": [[{"subnet": "10.250.0.0/16"}]],
                "routes": [{"dst": "0.0.0.0/0"}],
            },
        }
    ]
    b = [{"type": "tabby", "ipam": {"type": "tabby-ipam", "ipv4_pools": ["10.251.0.0/16"]}}]
    c = [{"type": "bridge", "ipam": {"type": "host-local", "subnet": "10.250.128.0/17"}}]
    assert [str(n) for n in cb.ipam_networks(a)] == ["10.250.0.0/16"]
    assert cb.overlapping(cb.ipam_networks(a), cb.ipam_networks(b)) == []
    assert cb.overlapping(cb.ipam_networks(a), cb.ipam_networks(c)) == [
        ("10.250.0.0/16", "10.250.128.0/17")
    ]


def test_plugin_error_prefers_cni_error_object() -> None:
    out = json.dumps({"cniVersion": "1.0.0", "code": 11, "msg": "busy", "details": "lock"})
    assert cb.plugin_error(out.encode(), b"noise\n", 1) == "code 11: busy (lock)"
    assert cb.plugin_error(b"", b"a\nb\n", 2) == "exit 2: a | b"
    assert cb.plugin_error(b"", b"", -9) == "killed by signal 9"


def test_format_report_smoke() -> None:
    samples = [_sample("A", v, i, 5.0 + i) for v in cb.VERBS for i in range(4)]
    samples += [_sample("B", v, i, 7.0 + i) for v in cb.VERBS for i in range(4)]
    stats = cb.compute_stats(samples, ["A", "B"])
    report = {
        "run": {
            "id": "abc123",
            "mode": "concurrent",
            "concurrency": 8,
            "pods": 4,
            "warmup": 0,
            "node_netns": "tbench-abc123-node",
            "rss": False,
        },
        "configs": [
            {
                "label": lbl,
                "path": f"{lbl}.conflist",
                "network": lbl,
                "cni_version": "1.0.0",
                "chain": ["ptp"],
                "ipam": ["host-local"],
                "cni_path": "/usr/lib/cni",
            }
            for lbl in ("A", "B")
        ],
        "spawn_floor": {"wall_ms_p50": 0.6, "cpu_ms_p50": 0.5, "rss_mb_p50": None},
        "stats": stats,
        "phases": [{"verb": "ADD", "calls": 8, "failed": 0, "wall_s": 0.1, "calls_per_s": 80.0}],
        "compare": cb.compare_stats(stats, samples, "A", "B"),
        "failures": [],
        "interrupted": None,
        "cleanup": {"dels": 0},
    }
    text = cb.format_report(report)
    assert "concurrent k=8" in text
    assert "compare B / A" in text
    assert "verification: OK" in text
    json.dumps(cb.rounded(report))


def test_the_benchmark_script_wires_its_modules_together() -> None:
    """``python -m bench.cni.cni_bench`` (from the repository root) imports its siblings
    (exec, run, pure) and bench.stats; --help needs all of them and no root."""
    proc = subprocess.run(
        [sys.executable, "-m", "bench.cni.cni_bench", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: cni_bench.py")
