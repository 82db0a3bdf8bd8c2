"""The metrics issue's acceptance on a 3-node cluster (installed binaries, a real etcd):
scrape every node's /metrics (prometheus-client's own parser), and the per-node in-use
gauges add up to the total in use that ``tabbyctl ipam show -o json`` reports, node by node
and in sum; every node counted the ADDs it served; with BIRD, the BGP gauge sees the
sessions the node's readiness already required to be Established.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tabbyctl.demo.lab import Lab, LabNode, http_get
from tests.cluster.conftest import LabFactory

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

METRICS_PORT = 9091  # tabby-node's default, inside each node's namespace
PODS_PER_NODE = 2

Samples = list[tuple[str, dict[str, str], float]]


def scrape(node: LabNode) -> Samples:
    code, body = http_get(node.netns, f"http://127.0.0.1:{METRICS_PORT}/metrics", timeout=10)
    assert code == 200, body[:300]
    return [
        (s.name, dict(s.labels), s.value)
        for fam in text_string_to_metric_families(body.decode())
        for s in fam.samples
    ]


def value(samples: Samples, name: str, **labels: str) -> float:
    return sum(v for n, lab, v in samples if n == name and labels.items() <= lab.items())


def ipam_report(lab: Lab) -> dict[str, Any]:
    proc = lab.tabbyctl("ipam", "show", "--show-blocks", "-o", "json")
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def eventually(what: str, check: Callable[[], str | None], timeout: float = 30) -> None:
    """``check`` returns None when satisfied, else what is still wrong."""
    deadline = time.monotonic() + timeout
    while (problem := check()) is not None:
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: {problem}")
        time.sleep(0.5)


@pytest.mark.parametrize("backend", ["bird", "vxlan"])
def test_sum_of_per_node_in_use_equals_tabbyctl_total(make_lab: LabFactory, backend: str) -> None:
    lab = make_lab(backend=backend)
    for node in lab.nodes:
        for i in range(PODS_PER_NODE):
            lab.add_pod(node, "metrics", f"m{node.index + 1}-{i}")
    report = ipam_report(lab)
    total = sum(p["in_use"] for p in report["pools"])
    per_node = Counter(a["node"] for a in report["allocations"])
    assert total == sum(per_node.values())  # tunnel addresses (vxlan) included in both

    def converged() -> str | None:
        scraped: dict[str, float] = {}
        for node in lab.nodes:
            samples = scrape(node)
            scraped[node.name] = value(samples, "tabby_ipam_addresses_in_use", node=node.name)
            for p in report["pools"]:
                pool_wide = value(samples, "tabby_ipam_pool_addresses_in_use", pool=p["cidr"])
                if pool_wide != p["in_use"]:
                    return f"{node.name} says pool {p['cidr']} has {pool_wide} in use"
        want = {n.name: float(per_node[n.name]) for n in lab.nodes}
        if scraped != want or sum(scraped.values()) != total:
            return f"per-node gauges {scraped}, tabbyctl {want} (total {total})"
        return None

    eventually("the in-use gauges match tabbyctl", converged)

    for node in lab.nodes:
        samples = scrape(node)
        assert value(samples, "tabby_cni_requests_total", verb="ADD", code="0") == PODS_PER_NODE
        assert value(samples, "tabby_node_info", node=node.name, backend=backend) == 1
        assert value(samples, "tabby_cluster_nodes") == len(lab.nodes)
        assert value(samples, "tabby_reconcile_passes_total") >= 1
        sessions = value(samples, "tabby_bgp_peers")
        if backend == "bird":
            assert sessions > 0
            assert value(samples, "tabby_bgp_peers", state="Established") == sessions
            assert value(samples, "tabby_bird_up") == 1
        else:
            assert sessions == 0
            assert value(samples, "tabby_fdb_entries_programmed") >= len(lab.nodes) - 1
