"""tabby-node's Prometheus metrics (tabby_node.metrics), without root.

- the registry is the node's own and exports every name of docs/cluster.md's table (and the
  catalogue), and prometheus-client's own parsers read the exposition back;
- CNI calls are counted by a real NodeServer serving them over its socket (the node's work,
  ``execute``, replaced by a stand-in: the privileged test runs the real thing);
- the IPAM gauges, computed from tabby-node's cache, equal what ``tabbyctl ipam show``
  computes from the same datastore (pods, borrowed addresses and a tunnel address), and the
  per-node in-use gauges of every node add up to the pools' total;
- the hooks the dataplane passes and routing call (reconcile, routes, policy, datastore
  errors), and the state a scrape reads (BIRD, policy, the store);
- conf-examples' dashboard and alert rules name only metrics a live registry exports.
"""

from __future__ import annotations

import json
import re
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from bundle import __version__
from cni_config.common import DatastoreSettings
from daemon.limits import Refusals
from datastore.base import Doc, SyncEvent
from datastore.memory import MemoryStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from policy.counters import CounterKey
from policy.state import ApplyResult, PolicyCounters
from tabby_node import http, metrics, server
from tabby_node.access import Door
from tabby_node.cache import WATCHED_KINDS, Cache
from tabby_node.client import try_node
from tabby_node.metrics import CATALOGUE, Metrics, NodeCollector, metric_names
from tabby_node.options import conf_reserved
from tabby_node.server import NodeServer
from tabbyctl import views
from tests import REPO_ROOT as ROOT

EXAMPLES = ROOT / "conf-examples"
DASHBOARD = EXAMPLES / "grafana-dashboard.json"
ALERTS = EXAMPLES / "prometheus-alerts.yaml"

#: docs/cluster.md "Metrics and health": name -> type.
README_TABLE = {
    "tabby_cni_requests_total": "counter",
    "tabby_cni_request_duration_seconds": "histogram",
    "tabby_ipam_addresses_in_use": "gauge",
    "tabby_ipam_addresses_borrowed": "gauge",
    "tabby_ipam_blocks": "gauge",
    "tabby_ipam_pool_size": "gauge",
    "tabby_bgp_peers": "gauge",
    "tabby_routes_programmed": "gauge",
    "tabby_policy_rules": "gauge",
    "tabby_policy_apply_duration_seconds": "histogram",
    "tabby_datastore_errors_total": "counter",
    "tabby_datastore_watch_resyncs_total": "counter",
    "tabby_datastore_watch_resumes_total": "counter",
}

POOL = "10.250.0.0/28"  # 4 blocks of /30 (4 addresses each)
POOL2 = "10.251.0.0/24"
NET = "k8s-pod-network"


def family_types(m: Metrics) -> dict[str, str]:
    """Exposed name -> type, as the text parser reads the exposition."""
    _, body = m.exposition(None)
    out = {}
    for fam in text_string_to_metric_families(body.decode()):
        name = fam.name + "_total" if fam.type == "counter" else fam.name
        out[name] = fam.type
    return out


def sample(m: Metrics, name: str, **labels: str) -> float | None:
    return m.registry.get_sample_value(name, labels)


class NoCalls:
    """A call server with no call in flight."""

    inflight: set[threading.Thread] = set()


def node_metrics(
    name: str = "node-a", docs: MemoryStore | None = None, **parts: Any
) -> tuple[Metrics, NodeCollector]:
    """The metrics of node ``name`` (backend none) with its state registered as tabby-node
    registers it (``tabby_node.main``): its cache (the snapshot of ``docs``) and ``parts``
    (policy, bgp, store, served, reserved...)."""
    m = Metrics()
    collector = NodeCollector(
        node=name,
        backend="none",
        started=m.started,
        problems={},
        calls=NoCalls(),
        cache=cache_of(name, docs),
        **parts,
    )
    m.registry.register(collector)
    return m, collector


# -- the registry ----------------------------------------------------------------------------


def test_registry_is_the_nodes_own_and_has_the_product_table() -> None:
    m, _ = node_metrics()
    types = family_types(m)
    for name, kind in README_TABLE.items():
        assert types.get(name) == kind, name
    for name, (kind, _labels, _help) in CATALOGUE.items():
        assert types.get(name) == kind, name
    # nothing leaks into (or comes from) the library's global registry
    assert not any(f.name.startswith("tabby_") for f in REGISTRY.collect()), (
        "tabby metrics in the global registry"
    )
    assert "process_cpu_seconds_total" in metric_names(m.registry)
    assert not any(n.endswith("_created") for n in metric_names(m.registry))


def test_units_in_the_names_follow_prometheus_conventions() -> None:
    for name, (kind, _labels, _help) in CATALOGUE.items():
        assert name.startswith("tabby_")
        assert (kind == "counter") == name.endswith("_total"), name
        if "duration" in name or name.endswith("_time"):
            assert name.endswith("_seconds"), name


def test_exposition_parses_as_prometheus_text_and_openmetrics() -> None:
    m = Metrics()
    m.cni_request("ADD", 0, b"{}", 0.012)
    ctype, body = m.exposition("text/plain")
    assert ctype.startswith("text/plain; version=0.0.4")
    fams = {f.name: f for f in text_string_to_metric_families(body.decode())}
    assert fams["tabby_cni_request_duration_seconds"].type == "histogram"
    ctype, body = m.exposition("application/openmetrics-text; version=1.0.0")
    assert ctype.startswith("application/openmetrics-text")
    names = {f.name for f in openmetrics_families(body.decode())}
    assert "tabby_cni_requests" in names


def test_cni_buckets_resolve_5ms_to_5s() -> None:
    assert metrics.CNI_BUCKETS[0] == 0.005
    assert 5.0 in metrics.CNI_BUCKETS
    assert all(b > a for a, b in zip(metrics.CNI_BUCKETS, metrics.CNI_BUCKETS[1:], strict=False))


# -- CNI calls -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("rc", "out", "code"),
    [
        (0, b'{"cniVersion": "1.1.0"}', "0"),
        (1, b'{"code": 7, "msg": "bad"}', "7"),
        (1, b'{"code": "7"}', "unknown"),
        (1, b"not json", "unknown"),
        (1, b"[1]", "unknown"),
    ],
)
def test_result_code(rc: int, out: bytes, code: str) -> None:
    assert metrics.result_code(rc, out) == code


@pytest.fixture
def node_server(tmp_path: Path) -> Iterator[tuple[NodeServer, Metrics]]:
    m = Metrics()
    srv = NodeServer(str(tmp_path / "run" / "node.sock"), metrics=m)
    srv.bind()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, m
    finally:
        srv.stop(grace=5)
        t.join(5)


def test_calls_served_by_a_node_server_are_counted_by_verb_and_code(
    node_server: tuple[NodeServer, Metrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, m = node_server
    answers = {
        "ADD": (0, b'{"cniVersion": "1.1.0", "ips": []}\n'),
        "DEL": (0, b""),
        "CHECK": (1, b'{"cniVersion": "1.1.0", "code": 3, "msg": "no allocation"}\n'),
        "STATUS": (1, b'{"cniVersion": "1.1.0", "code": 11, "msg": "etcd unreachable"}\n'),
        "BOGUS": (1, b'{"cniVersion": "1.1.0", "code": 4, "msg": "bad CNI_COMMAND"}\n'),
    }

    def execute(role: str, env: dict[str, str], *_rest: object) -> tuple[int, bytes]:
        time.sleep(0.006 if env["CNI_COMMAND"] == "ADD" else 0)
        return answers[env["CNI_COMMAND"]]

    monkeypatch.setattr(server, "execute", execute)
    for command in ("ADD", "ADD", "DEL", "CHECK", "STATUS", "BOGUS"):
        env = {"CNI_COMMAND": command, "TABBY_NODE_SOCKET": srv.path, "PATH": "/usr/bin:/bin"}
        role = "tabby-ipam" if command == "DEL" else "tabby"  # either binary is counted
        assert try_node(role, env, b"{}", __version__) == answers[command]
    assert sample(m, "tabby_cni_requests_total", verb="ADD", code="0") == 2
    assert sample(m, "tabby_cni_requests_total", verb="DEL", code="0") == 1
    assert sample(m, "tabby_cni_requests_total", verb="CHECK", code="3") == 1
    assert sample(m, "tabby_cni_requests_total", verb="STATUS", code="11") == 1
    assert sample(m, "tabby_cni_requests_total", verb="other", code="4") == 1
    assert sample(m, "tabby_cni_requests_total", verb="GC", code="0") == 0  # pre-set
    assert sample(m, "tabby_cni_request_duration_seconds_count", verb="ADD") == 2
    assert sample(m, "tabby_cni_request_duration_seconds_bucket", verb="ADD", le="0.005") == 0
    assert sample(m, "tabby_cni_request_duration_seconds_bucket", verb="ADD", le="5.0") == 2
    assert sample(m, "tabby_datastore_errors_total", op="cni") == 1  # the code 11
    # where the time went: this execute() runs no phase, so it is all the server's
    assert sample(m, "tabby_cni_phase_duration_seconds_count", verb="ADD", phase="server") == 2
    assert sample(m, "tabby_cni_phase_duration_seconds_sum", verb="ADD", phase="server") >= 0.012
    assert sample(m, "tabby_cni_phase_duration_seconds_count", verb="ADD", phase="ipam") is None
    assert sample(m, "tabby_cni_cpu_seconds_total", verb="ADD") is not None


def test_a_failing_metric_never_fails_a_call(
    node_server: tuple[NodeServer, Metrics], monkeypatch: pytest.MonkeyPatch
) -> None:
    srv, m = node_server

    def broken(*_args: object, **_kw: object) -> Any:
        raise RuntimeError("broken metric")

    monkeypatch.setattr(m.cni_requests, "labels", broken)
    monkeypatch.setattr(server, "execute", lambda *_a: (0, b"{}\n"))
    env = {"CNI_COMMAND": "ADD", "TABBY_NODE_SOCKET": srv.path, "PATH": "/usr/bin:/bin"}
    assert try_node("tabby", env, b"{}", __version__) == (0, b"{}\n")


# -- IPAM gauges from the cache ----------------------------------------------------------------


def cache_of(name: str, store: MemoryStore | None = None) -> Cache:
    """Node ``name``'s cache, with ``store``'s snapshot when given."""
    cache = Cache(name)
    if store is not None:
        feed(cache, store)
    return cache


def feed(cache: Cache, store: MemoryStore) -> None:
    """The watch's snapshot, as tabby-node's watcher thread would apply it."""
    stop = threading.Event()
    events = store.sync(WATCHED_KINDS, stop)
    cache.apply(next(events))
    stop.set()
    events.close()  # type: ignore[attr-defined]


def pod(store: MemoryStore, node: str, n: int, **req: Any) -> None:
    Ipam(store, node).assign(
        AssignRequest(
            handle_id=handle_id(NET, f"c-{node}-{n}", "eth0"),
            attrs={"node": node, "network": NET, "container_id": f"c-{node}-{n}"},
            v4_pools=[POOL],
            **req,
        )
    )


@pytest.fixture
def cluster_store() -> MemoryStore:
    """node-a: a block with 2 pods and its VXLAN tunnel address; node-b: a full block, then
    (one block per host) the last free address of node-a's, borrowed; node-c: a pod in the
    second pool."""
    store = MemoryStore()
    Ipam(store, "plugin").ensure_pools([PoolSpec(POOL, 30), PoolSpec(POOL2, 26)])
    for n in range(2):
        pod(store, "node-a", n)
    Ipam(store, "node-a").assign(
        AssignRequest(
            handle_id=handle_id("tabby-tunnel", "vxlan-tunnel-addr-node-a", "vxlan.tabby"),
            attrs={"node": "node-a", "network": "tabby-tunnel", "purpose": "vxlan-tunnel"},
            v4_pools=[POOL],
        )
    )
    for n in range(5):  # a /30 block holds 4: the fifth is borrowed (one block per host)
        pod(store, "node-b", n, max_blocks_per_host=1)
    Ipam(store, "node-c").assign(
        AssignRequest(
            handle_id=handle_id(NET, "c-node-c", "eth0"),
            attrs={"node": "node-c", "network": NET},
            v4_pools=[POOL2],
        )
    )
    return store


def tabbyctl_view(store: MemoryStore, reserved: list[str]) -> dict[str, Any]:
    """What ``tabbyctl ipam show --show-blocks -o json`` reports for this datastore."""
    return views.ipam_report(Ipam(store, ""), reserved, show_blocks=True)


def expected_per_node(report: dict[str, Any], node: str) -> dict[str, dict[str, int]]:
    pool_of = {b["cidr"]: b["pool"] for b in report["blocks"]}
    out: dict[str, dict[str, int]] = {
        p["cidr"]: {"in_use": 0, "borrowed": 0, "blocks": 0} for p in report["pools"]
    }
    for b in report["blocks"]:
        if b["node"] == node:
            out[b["pool"]]["blocks"] += 1
    for a in report["allocations"]:
        if a["node"] == node:
            pool = pool_of[a["block"]]
            out[pool]["in_use"] += 1
            owner = next(b["node"] for b in report["blocks"] if b["cidr"] == a["block"])
            if owner != node:
                out[pool]["borrowed"] += 1
    return out


@pytest.mark.parametrize("node", ["node-a", "node-b", "node-c", "node-d"])
def test_ipam_gauges_equal_the_tabbyctl_view(cluster_store: MemoryStore, node: str) -> None:
    m, _ = node_metrics(node, cluster_store)
    report = tabbyctl_view(cluster_store, [])
    for p in report["pools"]:
        cidr = p["cidr"]
        assert sample(m, "tabby_ipam_pool_size", pool=cidr) == p["total"]
        assert sample(m, "tabby_ipam_pool_reserved", pool=cidr) == p["reserved"]
        assert sample(m, "tabby_ipam_pool_addresses_in_use", pool=cidr) == p["in_use"]
        assert sample(m, "tabby_ipam_pool_addresses_free", pool=cidr) == p["free"]
        assert sample(m, "tabby_ipam_pool_blocks", pool=cidr) == p["blocks"]
        want = expected_per_node(report, node)[cidr]
        got = {
            key: sample(m, f"tabby_ipam_{name}", pool=cidr, node=node)
            for key, name in (
                ("in_use", "addresses_in_use"),
                ("borrowed", "addresses_borrowed"),
                ("blocks", "blocks"),
            )
        }
        assert got == want, (cidr, node)


def test_the_fixture_has_what_the_gauges_must_get_right(cluster_store: MemoryStore) -> None:
    m = {n: node_metrics(n, cluster_store)[0] for n in ("node-a", "node-b")}
    # the tunnel address counts for node-a; node-b borrows one from node-a's block
    assert sample(m["node-a"], "tabby_ipam_addresses_in_use", pool=POOL, node="node-a") == 3
    assert sample(m["node-b"], "tabby_ipam_addresses_in_use", pool=POOL, node="node-b") == 5
    assert sample(m["node-b"], "tabby_ipam_addresses_borrowed", pool=POOL, node="node-b") == 1
    assert sample(m["node-a"], "tabby_ipam_blocks", pool=POOL, node="node-a") == 1
    assert sample(m["node-a"], "tabby_ipam_addresses_borrowed", pool=POOL, node="node-a") == 0


def test_per_node_in_use_adds_up_to_the_pools_total(cluster_store: MemoryStore) -> None:
    """The acceptance check, on one datastore: scrape every node, sum the in-use gauges."""
    report = tabbyctl_view(cluster_store, [])
    total = sum(p["in_use"] for p in report["pools"])
    scraped = 0.0
    for node in ("node-a", "node-b", "node-c"):
        _, body = node_metrics(node, cluster_store)[0].exposition(None)
        for fam in text_string_to_metric_families(body.decode()):
            if fam.name == "tabby_ipam_addresses_in_use":
                scraped += sum(s.value for s in fam.samples)
    assert scraped == total == 9


def test_reserved_comes_from_the_conf_as_tabbyctl_reads_it(
    cluster_store: MemoryStore, tmp_path: Path
) -> None:
    conf = tmp_path / "10-tabby.conflist"
    reserved = ["10.250.0.12/30", "10.251.0.200"]
    conf.write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "n",
                "plugins": [
                    {"type": "tabby", "ipam": {"type": "tabby-ipam", "reserved": reserved}}
                ],
            }
        )
    )
    assert conf_reserved(str(conf)) == reserved
    assert conf_reserved(str(tmp_path / "missing")) == []
    assert conf_reserved(None) == []
    m, _ = node_metrics("node-a", cluster_store, reserved=conf_reserved(str(conf)))
    for p in tabbyctl_view(cluster_store, reserved)["pools"]:
        assert sample(m, "tabby_ipam_pool_reserved", pool=p["cidr"]) == p["reserved"]
        assert sample(m, "tabby_ipam_pool_addresses_free", pool=p["cidr"]) == p["free"]


def test_ipam_gauges_follow_the_cache(cluster_store: MemoryStore) -> None:
    m, collector = node_metrics("node-c", cluster_store)
    assert sample(m, "tabby_ipam_addresses_in_use", pool=POOL2, node="node-c") == 1
    Ipam(cluster_store, "node-c").release_handle(handle_id(NET, "c-node-c", "eth0"))
    assert sample(m, "tabby_ipam_addresses_in_use", pool=POOL2, node="node-c") == 1  # cached
    feed(collector.cache, cluster_store)
    assert sample(m, "tabby_ipam_addresses_in_use", pool=POOL2, node="node-c") == 0


def test_an_empty_cache_still_exports_every_family() -> None:
    names = metric_names(node_metrics()[0].registry)
    for name in ("tabby_ipam_addresses_in_use", "tabby_ipam_pool_size", "tabby_bgp_peers"):
        assert name in names


# -- the other hooks ---------------------------------------------------------------------------


class FakeChanges:
    conflicts = ("x",)
    failures = ()

    def counts(self) -> dict[str, dict[str, int]]:
        return {"route": {"add": 3, "replace": 0, "remove": 1}, "fdb": {"add": 0}}


class FakePeer:
    def __init__(self, state: str) -> None:
        self.state = state


class FakeBird:
    restarts = 2

    def __init__(self, states: list[str], up: bool = True) -> None:
        self.states = states
        self.up = up

    def running(self) -> bool:
        return self.up

    def peers(self) -> list[FakePeer]:
        return [FakePeer(s) for s in self.states]


class FakeBgp:
    """The bird backend, as the metrics read it."""

    def __init__(self, bird: Any) -> None:
        self.bird = bird

    def announced(self) -> dict[str, int]:
        return {"block": 2, "borrowed": 1}


def test_reconcile_routes_bird_policy_and_datastore_hooks() -> None:
    m, state = node_metrics("node-a")
    m.reconciled(0.02, True)
    m.reconciled(0.5, False)
    assert sample(m, "tabby_reconcile_passes_total") == 2
    assert sample(m, "tabby_reconcile_failures_total") == 1
    assert sample(m, "tabby_reconcile_duration_seconds_count") == 2
    assert sample(m, "tabby_dataplane_in_sync") == 0

    m.routes({"block": 3, "borrowed": 1, "blackhole": 2, "tunnel": 2, "fdb": 2}, FakeChanges())
    m.routes({"block": 3, "borrowed": 1, "blackhole": 2, "tunnel": 2, "fdb": 2}, FakeChanges())
    assert sample(m, "tabby_routes_programmed", kind="block") == 3
    assert sample(m, "tabby_routes_programmed", kind="tunnel") == 2
    assert sample(m, "tabby_routes_programmed", kind="fdb") is None
    assert sample(m, "tabby_fdb_entries_programmed") == 2
    assert sample(m, "tabby_neighbours_programmed") == 2
    assert sample(m, "tabby_dataplane_changes_total", kind="route", action="add") == 6
    assert sample(m, "tabby_dataplane_problems", type="conflict") == 1

    assert sample(m, "tabby_bgp_peers", state="Established") == 0
    assert sample(m, "tabby_bird_up") == 0
    assert sample(m, "tabby_bgp_announced_prefixes", kind="block") == 0
    state.bgp = FakeBgp(FakeBird(["Established", "Active", "Established", "Passive"]))
    assert sample(m, "tabby_bgp_peers", state="Established") == 2
    assert sample(m, "tabby_bgp_peers", state="Active") == 1
    assert sample(m, "tabby_bgp_peers", state="Passive") == 1
    assert sample(m, "tabby_bgp_peers", state="Idle") == 0
    assert sample(m, "tabby_bird_up") == 1
    assert sample(m, "tabby_bird_restarts_total") == 2
    assert sample(m, "tabby_bgp_announced_prefixes", kind="block") == 2
    state.bgp = FakeBgp(FakeBird(["Established"], up=False))
    assert sample(m, "tabby_bgp_peers", state="Established") == 0
    assert sample(m, "tabby_bird_up") == 0

    class Policy:
        counters = PolicyCounters(
            endpoints=4,
            policies=2,
            rules=17,
            sets=3,
            set_elements=9,
            applies=5,
            full_applies=1,
            apply_errors=1,
            last_apply_seconds=0.003,
            checks=3,
            check_fixes=2,
        )

        def packet_counts(self) -> dict[CounterKey, tuple[int, int]]:
            return {CounterKey("x", "default-deny", "ingress", "deny"): (5, 300)}

    state.policy = Policy()
    m.policy_applied(ApplyResult(True, False, 12, 0.003))
    m.policy_applied(ApplyResult(False, False, 0, 0.0))  # nothing programmed: not an apply
    assert sample(m, "tabby_policy_apply_duration_seconds_count") == 1
    assert sample(m, "tabby_policy_rules") == 17
    assert sample(m, "tabby_policy_endpoints") == 4
    assert sample(m, "tabby_policy_networkpolicies") == 2
    assert sample(m, "tabby_policy_applies_total", mode="incremental") == 4
    assert sample(m, "tabby_policy_apply_errors_total") == 1
    assert sample(m, "tabby_policy_checks_total") == 3
    assert sample(m, "tabby_policy_check_fixes_total") == 2
    deny = {"namespace": "x", "policy": "default-deny", "direction": "ingress", "verdict": "deny"}
    deny |= {"tier": "", "rule": "", "staged": "false"}
    assert sample(m, "tabby_policy_packets_total", **deny) == 5

    m.datastore_error("default pools")
    m.datastore_error("watch")
    assert sample(m, "tabby_datastore_errors_total", op="default_pools") == 1
    assert sample(m, "tabby_datastore_errors_total", op="watch") == 1
    assert sample(m, "tabby_datastore_errors_total", op="heartbeat") == 0  # pre-set
    state.store = type("S", (), {"stats": {"txns": 7, "conflicts": 1, "resolved": 0}})()
    assert sample(m, "tabby_datastore_transactions_total") == 7
    assert sample(m, "tabby_datastore_retried_writes_total", outcome="unknown") == 0
    assert sample(m, "tabby_datastore_fast_path_total", outcome="cached") == 0
    from datastore.memory import MemoryStore
    from stores import Served

    settings = type("Settings", (), {"datastore_type": "file", "data_dir": "/x"})()
    state.served = served = Served(settings, MemoryStore())  # type: ignore[arg-type]
    for outcome in ("cached", "cached", "retried"):
        served.counts.add(outcome)
    assert sample(m, "tabby_datastore_fast_path_total", outcome="cached") == 2
    assert sample(m, "tabby_datastore_fast_path_total", outcome="retried") == 1
    assert sample(m, "tabby_node_info", node="node-a", version=__version__, backend="none") == 1


def test_watch_counters_are_the_stores_rereads_and_resumes() -> None:
    """The watch metrics count what the store did (sync_stats), not snapshot events: the
    first read is not a re-read, a store's re-read is one (its events are only the
    differences), and an etcd store's resumed streams are counted as it counts them."""
    store = MemoryStore()
    m, state = node_metrics("node-a", store, store=store)
    assert sample(m, "tabby_datastore_watch_resyncs_total") == 0
    assert sample(m, "tabby_datastore_watch_resumes_total") == 0
    stop = threading.Event()
    events = store.sync(WATCHED_KINDS, stop)
    state.cache.apply(next(events))
    store.put("node", "node-b", {}, None)
    store.resync()
    event = next(events)
    assert (event.type, event.key) == ("put", "node-b")
    state.cache.apply(event)
    stop.set()
    assert list(events) == []
    assert sample(m, "tabby_datastore_watch_resyncs_total") == 1
    state.store = type("S", (), {"sync_stats": {"snapshots": 1, "rereads": 2, "resumes": 5}})()
    assert sample(m, "tabby_datastore_watch_resyncs_total") == 2
    assert sample(m, "tabby_datastore_watch_resumes_total") == 5


def test_a_broken_section_does_not_break_the_scrape() -> None:
    class Broken:
        restarts = 0

        def running(self) -> bool:
            raise RuntimeError("boom")

    m, _ = node_metrics("node-a", bgp=FakeBgp(Broken()))
    _, body = m.exposition(None)
    names = {f.name for f in text_string_to_metric_families(body.decode())}
    assert "tabby_cni_requests" in names
    assert "tabby_ipam_pool_size" in names


# -- /metrics over HTTP ----------------------------------------------------------------------


class Passes:
    reconciles = 1
    in_sync = True


class Routing:
    def readiness(self) -> list[str]:
        return []


def test_metrics_route_serves_the_registry(cluster_store: MemoryStore) -> None:
    refusals = Refusals()
    m, _ = node_metrics("node-a", cluster_store, refusals=refusals)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    health = http.Health(
        node_ttl=90.0,
        datastore=DatastoreSettings(),
        passes=Passes(),
        routing=Routing(),
        beats={},
        problems={},
    )
    problems: dict[str, str] = {}
    servers = http.start(
        health,
        health_port=0,
        metrics_port=port,
        node_ip=None,
        exposition=m.exposition,
        denied_flows=None,
        problems=problems,
        refusals=refusals,
        guard=Door(),
    )
    assert len(servers) == 1
    assert not problems
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Type"].startswith("text/plain")
            text = resp.read().decode()
    finally:
        http.stop(servers)
    got = {
        s.labels.get("pool"): s.value
        for f in text_string_to_metric_families(text)
        if f.name == "tabby_ipam_addresses_in_use"
        for s in f.samples
    }
    assert got == {POOL: 3, POOL2: 0}
    refused = {
        (s.labels["server"], s.labels["reason"])
        for f in text_string_to_metric_families(text)
        if f.name == "tabby_connections_refused"
        for s in f.samples
    }
    assert ("metrics", "busy") in refused  # the metrics server counts under its name


# -- conf-examples: the dashboard and the alert rules ------------------------------------------

_NAME = re.compile(r"\btabby_[a-z0-9_]+")


def example_metric_names() -> dict[str, set[str]]:
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [
        t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", []) if "expr" in t
    ]
    exprs += [
        v["query"]["query"] if isinstance(v.get("query"), dict) else v.get("query", "")
        for v in dashboard.get("templating", {}).get("list", [])
    ]
    rules = yaml.safe_load(ALERTS.read_text())
    alert_exprs = [r["expr"] for g in rules["groups"] for r in g["rules"]]
    return {
        "dashboard": {n for e in exprs for n in _NAME.findall(e)},
        "alerts": {n for e in alert_exprs for n in _NAME.findall(e)},
    }


def test_examples_name_only_metrics_a_live_registry_exports() -> None:
    exported = metric_names(node_metrics("node-a")[0].registry)
    found = example_metric_names()
    assert len(found["dashboard"]) >= 10
    assert len(found["alerts"]) >= 5
    for where, names in found.items():
        unknown = sorted(n for n in names if n not in exported)
        assert not unknown, f"{where} names metrics tabby-node does not export: {unknown}"


def test_alert_rules_cover_what_the_issue_asks() -> None:
    rules = yaml.safe_load(ALERTS.read_text())
    alerts = {r["alert"]: r for g in rules["groups"] for r in g["rules"]}
    exprs = " ".join(r["expr"] for r in alerts.values())
    for name in (
        "tabby_ipam_pool_addresses_in_use",
        'tabby_bgp_peers{state="Established"}',
        "tabby_reconcile_failures_total",
        "tabby_cni_requests_total",
        "tabby_datastore_errors_total",
    ):
        assert name in exprs, name
    assert "0.9" in alerts["TabbyIPPoolNearlyFull"]["expr"]
    for rule in alerts.values():
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"]


def test_metric_names_handles_suffixes() -> None:
    names = metric_names(node_metrics()[0].registry)
    for n in (
        "tabby_cni_requests_total",
        "tabby_cni_request_duration_seconds_bucket",
        "tabby_cni_request_duration_seconds_sum",
        "tabby_cni_request_duration_seconds_count",
        "tabby_bird_restarts_total",
    ):
        assert n in names


def test_cluster_nodes_counts_live_nodes_as_the_cluster_view_does() -> None:
    def node(name: str) -> Doc:
        return Doc({"metadata": {"name": name}}, 1)

    beat = Doc({"metadata": {}}, 1)  # liveness is the document's existence, not its content
    snapshot = {
        "node": {n: node(n) for n in ("node-a", "node-b", "node-c")},
        "heartbeat": {"node-a": beat, "node-b": beat, "node-gone": beat},
    }
    for me, live in (("node-c", 3), ("node-d", 2)):
        m, state = node_metrics(me)
        # the cache consumes a snapshot (the watch's to give away): each node its own
        copy = {kind: dict(docs) for kind, docs in snapshot.items()}
        state.cache.apply(SyncEvent("snapshot", "", "", None, copy))
        assert sample(m, "tabby_cluster_nodes") == live


def test_refusals_of_the_nodes_servers_are_counted_by_server_and_reason() -> None:
    refusals = Refusals()
    for server_name in ("cni", "health", "metrics"):
        refusals.register(server_name)
    refusals.count("cni", "busy")
    refusals.count("metrics", "timeout")
    m, _ = node_metrics(refusals=refusals)
    name = "tabby_connections_refused_total"
    assert sample(m, name, server="cni", reason="busy") == 1
    assert sample(m, name, server="metrics", reason="timeout") == 1
    assert sample(m, name, server="health", reason="too_large") == 0


def test_behind_typha_the_watch_counters_and_synced_are_its_clients() -> None:
    """With tabby-typha the watch is typha's client: its re-reads and resumes are counted,
    and the watch is not synced while typha cannot be read."""
    store = MemoryStore()
    m, state = node_metrics("node-a", store, store=store)
    client = type(
        "Typha",
        (),
        {"sync_stats": {"snapshots": 1, "rereads": 3, "resumes": 4}, "last_error": None},
    )()
    state.watch = client
    assert sample(m, "tabby_datastore_watch_resyncs_total") == 3
    assert sample(m, "tabby_datastore_watch_resumes_total") == 4
    assert sample(m, "tabby_datastore_synced") == 1
    client.last_error = "typha 10.0.0.1:5473: UNAVAILABLE"
    assert sample(m, "tabby_datastore_synced") == 0
