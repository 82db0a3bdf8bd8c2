"""A real Prometheus (Debian's ``prometheus`` package) scraping the 3-node lab:

* it runs inside the first node's network namespace (its own data directory, listening on
  that namespace's 127.0.0.1, stopped by PID, its directory removed) and scrapes every
  tabby-node's /metrics at the node's underlay address, as the example job in
  conf-examples/prometheus-alerts.yaml does; that rule file is loaded and every rule must
  evaluate without error;
* the lab is exercised so that what the dashboard shows exists: pods on every node, a
  default-deny namespace with an allow-by-label policy and traffic it allows and denies
  (tabby_policy_packets_total), a CNI ADD that fails (the error panels);
* every query of conf-examples/grafana-dashboard.json, with its template variables as
  Grafana substitutes them ($instance "All" and every node picked; $__rate_interval), is
  evaluated by that Prometheus and must return series; every tabby_* name in it must be
  one the nodes export (no panel on a metric that does not exist). Once per backend: a
  metric only one backend fills (BACKEND_ONLY) is required there.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tabbyctl.demo.lab import Lab, LabNode, http_get
from tests.cluster.conftest import LabFactory
from tests.cluster.policy_lab import apply_docs, must, probe_from
from tests.policy_probes import start_server, stop_process

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "conf-examples" / "grafana-dashboard.json"
ALERTS = ROOT / "conf-examples" / "prometheus-alerts.yaml"
METRICS_PORT = 9091  # tabby-node's default
PROMETHEUS_PORT = 9090  # inside the first node's namespace: nobody else's
SCRAPE = 2  # seconds
#: what Grafana makes of $__rate_interval: max(4 x scrape interval, step + scrape interval)
RATE_INTERVAL = f"{4 * SCRAPE}s"
NAME = re.compile(r"\btabby_[a-z0-9_]+")
#: metrics that have series with one backend only, and why (the other backend must have them)
BACKEND_ONLY = {
    # BIRD programs the routes itself: the routing reconciler changes nothing in the kernel,
    # and a labelled counter that never counted has no series
    "tabby_dataplane_changes_total": "vxlan",
}


class Prometheus:
    """``prometheus`` in ``node``'s network namespace, answering on its 127.0.0.1."""

    def __init__(self, lab: Lab, node: LabNode, workdir: str) -> None:
        self.node = node
        self.workdir = workdir
        config = {
            "global": {"scrape_interval": f"{SCRAPE}s", "evaluation_interval": f"{SCRAPE}s"},
            "rule_files": [str(ALERTS)],
            "scrape_configs": [
                {
                    "job_name": "tabby-node",
                    "static_configs": [
                        {"targets": [f"{n.ipv4.ip}:{METRICS_PORT}" for n in lab.nodes]}
                    ],
                }
            ],
        }
        path = os.path.join(workdir, "prometheus.yml")
        with open(path, "w", encoding="utf-8") as f:
            yaml.safe_dump(config, f)
        self.log = os.path.join(workdir, "prometheus.log")
        with open(self.log, "wb") as log:
            # `ip netns exec` execs prometheus: the PID is prometheus's
            self.proc = subprocess.Popen(
                [
                    *("ip", "netns", "exec", node.netns, "prometheus"),
                    f"--config.file={path}",
                    f"--storage.tsdb.path={os.path.join(workdir, 'data')}",
                    f"--web.listen-address=127.0.0.1:{PROMETHEUS_PORT}",
                    "--storage.tsdb.retention.time=1h",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def tail(self) -> str:
        try:
            return Path(self.log).read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def api(self, path: str, **params: str) -> Any:
        query = urllib.parse.urlencode(params)
        url = f"http://127.0.0.1:{PROMETHEUS_PORT}/api/v1/{path}" + (f"?{query}" if query else "")
        code, body = http_get(self.node.netns, url, timeout=20)
        if code != 200:
            raise AssertionError(f"prometheus {path} {params}: HTTP {code} {body[:500]!r}")
        data = json.loads(body)
        assert data["status"] == "success", data
        return data["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        data = self.api("query", query=expr)
        assert data["resultType"] in ("vector", "scalar"), (expr, data)
        return data["result"] if data["resultType"] == "vector" else [data["result"]]

    def wait_up(self, timeout: float = 90) -> None:
        deadline = time.monotonic() + timeout
        problem = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"prometheus exited: {self.tail()}")
            code, _ = http_get(self.node.netns, f"http://127.0.0.1:{PROMETHEUS_PORT}/-/ready")
            if code == 200:
                targets = self.api("targets")["activeTargets"]
                down = [t["scrapeUrl"] for t in targets if t["health"] != "up"]
                if len(targets) == 3 and not down:
                    return
                problem = f"targets not up: {down or targets}"
            time.sleep(1)
        raise AssertionError(f"{problem}\n{self.tail()}")


@pytest.fixture
def prometheus_binary() -> str:
    path = shutil.which("prometheus")
    assert path is not None, "prometheus is missing: apt-get install prometheus (tests/run.sh)"
    return path


@pytest.fixture
def workdir() -> Iterator[str]:
    path = tempfile.mkdtemp(prefix="tabby-prometheus-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def dashboard_queries() -> list[tuple[str, str]]:
    """(panel title, expression) of every target of every panel."""
    data = json.loads(DASHBOARD.read_text())
    return [
        (panel["title"], target["expr"])
        for panel in data["panels"]
        for target in panel.get("targets", [])
    ]


def substitute(expr: str, instance: str) -> str:
    return (
        expr.replace("$__rate_interval", RATE_INTERVAL)
        .replace("$__interval", f"{SCRAPE}s")
        .replace("$instance", instance)
    )


def exercise(lab: Lab) -> list[subprocess.Popen[str]]:
    """Pods on every node; namespace prom isolated (default deny) with an allow-by-label
    policy; allowed and denied TCP to its server; one failed CNI ADD (an address outside
    the pool). The server processes, for the caller to stop."""
    docs: list[dict[str, Any]] = [
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "prom"}},
        *(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": name, "namespace": "prom", "labels": {"app": name}},
            }
            for name in ("server", "client", "stranger")
        ),
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "default-deny-ingress", "namespace": "prom"},
            "spec": {"podSelector": {}, "policyTypes": ["Ingress"]},
        },
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "allow-client", "namespace": "prom"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "server"}},
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"app": "client"}}}],
                        "ports": [{"protocol": "TCP", "port": 80}],
                    }
                ],
            },
        },
    ]
    must(apply_docs(lab, docs))
    server = lab.add_pod(lab.nodes[0], "prom", "server")
    client = lab.add_pod(lab.nodes[1], "prom", "client")
    stranger = lab.add_pod(lab.nodes[2], "prom", "stranger")
    servers = [start_server(server.netns)]
    addr = server.addresses(4)[0]
    # the policies reach node 0 through the watch: allowed and denied once they are there
    deadline = time.monotonic() + 30
    want = {
        (client.netns, (addr, "TCP", 80)): True,
        (client.netns, (addr, "TCP", 81)): False,
        (stranger.netns, (addr, "TCP", 80)): False,
    }
    while True:
        got = probe_from(
            {
                client.netns: [(addr, "TCP", 80), (addr, "TCP", 81)],
                stranger.netns: [(addr, "TCP", 80)],
            },
            timeout=0.5,
        )
        if got == want:
            break
        assert time.monotonic() < deadline, f"policy not in force: {got}"
        time.sleep(0.5)
    # a CNI ADD that fails: the error panels have their series
    failing = lab.new_pod(lab.nodes[1], "prom", "outside")
    rc, out = lab.cni(lab.nodes[1], "ADD", failing, extra_args="IP=192.0.2.10")
    assert rc != 0, out
    return servers


@pytest.mark.parametrize("backend", ["bird", "vxlan"])
def test_a_real_prometheus_scrapes_the_lab_and_every_dashboard_query_has_series(
    make_lab: LabFactory, prometheus_binary: str, workdir: str, backend: str
) -> None:
    lab = make_lab(backend=backend)
    servers = exercise(lab)
    prometheus = Prometheus(lab, lab.nodes[0], workdir)
    try:
        prometheus.wait_up()
        # a few scrapes, so that rates over RATE_INTERVAL have two samples
        time.sleep(3 * SCRAPE + 1)
        up = prometheus.query('up{job="tabby-node"}')
        assert sorted(s["metric"]["instance"] for s in up) == sorted(
            f"{n.ipv4.ip}:{METRICS_PORT}" for n in lab.nodes
        )

        # the rules load and evaluate (a rule that cannot run reports its error here)
        groups = prometheus.api("rules")["groups"]
        rules = [r for g in groups for r in g["rules"]]
        assert len(rules) == len(
            [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]
        )
        time.sleep(SCRAPE + 1)
        groups = prometheus.api("rules")["groups"]
        bad = [(r["name"], r.get("lastError")) for g in groups for r in g["rules"]]
        assert [b for b in bad if b[1]] == [], bad

        # the template variable, as Grafana reads it
        instances = prometheus.api("label/instance/values", **{"match[]": "tabby_node_up"})
        assert sorted(instances) == sorted(s["metric"]["instance"] for s in up)
        # a multi-value pick: each value regex-escaped, and the backslash doubled inside
        # PromQL's string literal (as Grafana's Prometheus data source does)
        every = "(" + "|".join(re.escape(i).replace("\\", "\\\\") for i in instances) + ")"

        exported = set(prometheus.api("label/__name__/values"))
        missing: list[str] = []
        empty: list[str] = []
        queries = dashboard_queries()
        assert len(queries) >= 40
        for title, expr in queries:
            names = NAME.findall(expr)
            if any(BACKEND_ONLY.get(n, backend) != backend for n in names):
                continue
            for name in names:
                if not ({name, f"{name}_bucket"} & exported):
                    missing.append(f"{title}: {name}")
            for instance in (".*", every):
                if not prometheus.query(substitute(expr, instance)):
                    empty.append(f"{title}: {substitute(expr, instance)}")
        assert not missing, f"panels on metrics no node exports: {missing}"
        assert not empty, f"queries that return no series: {empty}"

        # the new counters: node 0 (the server's) counted what the policies allowed and denied
        by_policy = prometheus.query(
            'sum by (instance, policy, verdict) (tabby_policy_packets_total{namespace="prom"})'
        )
        counted = {
            (s["metric"]["instance"], s["metric"]["policy"], s["metric"]["verdict"]): float(
                s["value"][1]
            )
            for s in by_policy
        }
        node0 = f"{lab.nodes[0].ipv4.ip}:{METRICS_PORT}"
        assert counted.get((node0, "allow-client", "allow"), 0) >= 1, counted
        assert counted.get((node0, "default-deny", "deny"), 0) >= 2, counted
    finally:
        prometheus.stop()
        for proc in servers:
            stop_process(proc)
    assert prometheus.proc.returncode is not None
