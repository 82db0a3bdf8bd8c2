"""A running tabby-node's /metrics, /liveness and /readiness (root): this checkout's
tabby-node in a network namespace of its own, on a real 1-member etcd that runs in the same
namespace (so the node, its CNI calls and the test's clients all reach it on that
namespace's loopback), with its health and metrics ports open there.

- /metrics parses with prometheus-client's own text parser; the CNI counters move as the
  plugin (run as a runtime runs it, in the node's namespace) makes calls through the node;
  the IPAM gauges equal what ``tabbyctl ipam show -o json`` says about this node;
- readiness turns 503 (naming the datastore) within 20 s of stopping etcd, and 200 again
  when etcd is back; liveness stays 200 throughout.

Everything is stopped by PID and both namespaces are deleted, also on failure.
"""

from __future__ import annotations

import json
import os
import queue
import secrets
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.etcd_cluster import EtcdCluster, EtcdMissing
from tests.privileged import netns_util

pytestmark = [pytest.mark.privileged, pytest.mark.etcd]

T = TypeVar("T")
ROOT = Path(__file__).resolve().parents[2]
NODE_CMD = [sys.executable, "-c", "from bundle.entry import main_node; main_node()"]
PLUGIN = [sys.executable, "-c", "from bundle.entry import main; main()"]
TABBYCTL = [sys.executable, "-c", "from tabbyctl.cli import main; main()"]
NODE = "health-node"
POOL = "10.244.0.0/16"
METRICS_PORT = 9091  # the namespace is ours: the default ports are free there
HEALTH_PORT = 9099
#: docs/cluster.md "Metrics and health": readiness turns 503 within 20 s of losing the datastore.
READINESS_BOUND = 20.0


class NsThread:
    """A worker thread that entered a network namespace and runs what it is given: HTTP
    clients and etcd (its children inherit the thread's namespace) live there, while the
    test process itself stays in the host's."""

    def __init__(self, path: str) -> None:
        self.jobs: queue.Queue[tuple[Callable[[], Any], queue.Queue[Any]] | None] = queue.Queue()
        ready: queue.Queue[BaseException | None] = queue.Queue()
        self.thread = threading.Thread(target=self._work, args=(path, ready), daemon=True)
        self.thread.start()
        err = ready.get(timeout=10)
        if err is not None:
            raise err

    def _work(self, path: str, ready: queue.Queue[BaseException | None]) -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                netns_util._setns(fd)
            finally:
                os.close(fd)
        except BaseException as e:
            ready.put(e)
            return
        ready.put(None)
        while (job := self.jobs.get()) is not None:
            fn, reply = job
            try:
                reply.put((True, fn()))
            except BaseException as e:
                reply.put((False, e))
        # the thread ends inside the namespace: nothing else ever runs on it

    def call(self, fn: Callable[[], T], timeout: float = 120.0) -> T:
        reply: queue.Queue[tuple[bool, Any]] = queue.Queue()
        self.jobs.put((fn, reply))
        ok, value = reply.get(timeout=timeout)
        if not ok:
            raise value
        return value  # type: ignore[no-any-return]

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join(10)


_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never a proxy


def _get(url: str) -> tuple[int, bytes]:
    """(status, body); status 0 while nothing listens yet."""
    try:
        with _DIRECT.open(url, timeout=10) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
    except (urllib.error.URLError, OSError) as e:
        return 0, str(e).encode()


class Node:
    """tabby-node and its etcd, both inside namespace ``ns``."""

    def __init__(self, ns: netns_util.Netns, worker: NsThread, etcd: EtcdCluster, tmp: Path):
        self.ns = ns
        self.worker = worker
        self.etcd = etcd
        self.tmp = tmp
        self.run_dir = tmp / "run"
        self.socket = str(self.run_dir / "node.sock")
        self.prefix = f"/tabby-health-{secrets.token_hex(4)}"
        self.log = tmp / "node.log"
        self.stderr = open(tmp / "node.stderr", "wb")  # noqa: SIM115 - closed in stop()
        argv = [
            *NODE_CMD,
            "--nodename", NODE,
            "--backend", "none",
            "--state-dir", str(tmp / "state"),
            "--run-dir", str(self.run_dir),
            "--log-file", str(self.log),
            "--datastore-type", "etcdv3",
            "--etcd-endpoints", etcd.endpoints[0],
            "--etcd-prefix", self.prefix,
            "--metrics-port", str(METRICS_PORT),
            "--health-port", str(HEALTH_PORT),
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", ns.name, *argv],
            cwd=ROOT,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self.stderr,
        )

    def get(self, path: str, port: int = HEALTH_PORT) -> tuple[int, bytes]:
        return self.worker.call(lambda: _get(f"http://127.0.0.1:{port}{path}"))

    def health(self, path: str) -> tuple[int, dict[str, Any]]:
        code, body = self.get(path)
        return code, json.loads(body)

    def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        code, body = self.get("/metrics", METRICS_PORT)
        assert code == 200
        out = {}
        for fam in text_string_to_metric_families(body.decode()):
            for s in fam.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def wait(self, what: str, cond: Callable[[], bool], timeout: float) -> float:
        start = time.monotonic()
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"tabby-node exited: {self.diagnose()}")
            if time.monotonic() - start > timeout:
                raise AssertionError(f"{what}: not within {timeout:.0f} s\n{self.diagnose()}")
            time.sleep(0.25)
        return time.monotonic() - start

    def diagnose(self) -> str:
        tail = self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""
        return f"node log:\n{tail}"

    def stop(self) -> None:
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
        finally:
            self.stderr.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with netns_util.netns_pool() as pool:
        ns = pool.node()  # a namespace with lo up; deleted with the pool
        worker = NsThread(ns.path)
        try:
            try:
                etcd = worker.call(lambda: EtcdCluster(1))
            except EtcdMissing as e:
                pytest.skip(str(e))
            try:
                n = Node(ns, worker, etcd, tmp_path)
                try:
                    yield n
                finally:
                    n.stop()
            finally:
                worker.call(etcd.stop)
        finally:
            worker.close()


def plugin(
    node: Node, pod: netns_util.Netns, command: str, cid: str = "health-pod-1", **conf: Any
) -> dict[str, Any]:
    """The tabby binary as a runtime on the node runs it (in the node's namespace), with
    tabby-node's socket: the node serves the call."""
    netconf = {
        "cniVersion": "1.0.0",
        "name": "health-net",
        "type": "tabby",
        "nodename": NODE,
        "log_file_path": str(node.tmp / "cni.log"),
        "ipam": {
            "type": "tabby-ipam",
            "datastore_type": "etcdv3",
            "etcd_endpoints": node.etcd.endpoints,
            "etcd_prefix": node.prefix,
            "ipv4_pools": [POOL],
            "lock_timeout_seconds": 10,
        },
        **conf,
    }
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": pod.path,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": str(node.tmp),
        "TABBY_NODE_SOCKET": node.socket,
    }
    proc = node.worker.call(
        lambda: subprocess.run(
            PLUGIN,
            input=json.dumps(netconf).encode(),
            env=env,
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=False,
        )
    )
    out = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return {"rc": proc.returncode, "out": out, "err": proc.stderr.decode(errors="replace")}


def tabbyctl_ipam(node: Node) -> dict[str, Any]:
    """``tabbyctl ipam show --show-blocks -o json`` on the node, against the same etcd (a
    conflist of the test's own, never the machine's /etc/cni/net.d)."""
    conf = node.tmp / "tabbyctl.conflist"
    conf.write_text(json.dumps({"cniVersion": "1.0.0", "name": "health-net", "plugins": [
        {"type": "tabby", "nodename": NODE, "ipam": {"type": "tabby-ipam"}}
    ]}))  # fmt: skip
    flags = ["--conf", str(conf), "--datastore-type", "etcdv3"]
    flags += ["--etcd-endpoints", node.etcd.endpoints[0], "--etcd-prefix", node.prefix]
    proc = node.worker.call(
        lambda: subprocess.run(
            [*TABBYCTL, *flags, "ipam", "show", "--show-blocks", "-o", "json"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "TABBY_NODE_SOCKET": "off"},
        )
    )
    assert proc.returncode == 0, proc.stderr
    report: dict[str, Any] = json.loads(proc.stdout)
    return report


def node_view(report: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """pool -> (this node's allocations, the pool's in use), from tabbyctl's report."""
    pool_of = {b["cidr"]: b["pool"] for b in report.get("blocks", [])}
    mine = {p["cidr"]: 0 for p in report["pools"]}
    for a in report["allocations"]:
        if a["node"] == NODE:
            mine[pool_of[a["block"]]] += 1
    return {p["cidr"]: (mine[p["cidr"]], p["in_use"]) for p in report["pools"]}


def gauges(m: dict[Any, float]) -> dict[str, tuple[float, float]]:
    pools = {dict(k[1])["pool"] for k in m if k[0] == "tabby_ipam_pool_size"}
    return {
        p: (
            m.get(("tabby_ipam_addresses_in_use", (("node", NODE), ("pool", p))), -1),
            m.get(("tabby_ipam_pool_addresses_in_use", (("pool", p),)), -1),
        )
        for p in pools
    }


def cni(m: dict[Any, float], verb: str, code: str) -> float:
    return m.get(("tabby_cni_requests_total", (("code", code), ("verb", verb))), 0.0)


def test_metrics_move_with_cni_calls_and_match_tabbyctl(node: Node) -> None:
    node.wait("readiness 200", lambda: node.get("/readiness")[0] == 200, 90)
    before = node.metrics()
    assert before[("tabby_node_up", ())] == 1
    assert cni(before, "ADD", "0") == 0
    assert before[("tabby_ipam_pool_size", (("pool", POOL),))] == 65536  # the default pool

    with netns_util.netns_pool() as pool:
        pod = pool.pod()
        add = plugin(node, pod, "ADD")
        assert add["rc"] == 0, add
        ip = add["out"]["ips"][0]["address"].split("/")[0]
        # a value that cannot be honoured: code 2 (another container: a failed ADD cleans up)
        bad = plugin(node, pod, "ADD", cid="health-pod-bad", mtu=5)
        assert (bad["rc"], bad["out"]["code"]) == (1, 2), bad

        m = node.metrics()
        assert cni(m, "ADD", "0") == 1
        assert cni(m, "ADD", "2") == 1
        assert m[("tabby_cni_request_duration_seconds_count", (("verb", "ADD"),))] == 2
        # the gauges follow the datastore (through the watch) and say what tabbyctl says
        node.wait(
            "the in-use gauge sees the pod",
            lambda: gauges(node.metrics()).get(POOL, (0, 0))[0] == 1,
            30,
        )
        report = tabbyctl_ipam(node)
        assert ip in {a["ip"] for a in report["allocations"] if a["node"] == NODE}
        assert gauges(node.metrics()) == {
            p: (float(a), float(b)) for p, (a, b) in node_view(report).items()
        }

        delete = plugin(node, pod, "DEL")
        assert delete["rc"] == 0, delete
        m = node.metrics()
        assert cni(m, "DEL", "0") == 1
        node.wait(
            "the in-use gauge drops",
            lambda: gauges(node.metrics()).get(POOL, (1, 1))[0] == 0,
            30,
        )
    assert node.metrics()[("tabby_reconcile_passes_total", ())] >= 1


def test_readiness_follows_etcd_and_liveness_stays(node: Node) -> None:
    node.wait("readiness 200", lambda: node.get("/readiness")[0] == 200, 90)
    assert node.health("/liveness") == (200, {"ready": True, "reasons": []})

    node.worker.call(lambda: node.etcd.stop_member(0))
    took = node.wait(
        "readiness 503 after etcd stopped",
        lambda: node.get("/readiness")[0] == 503,
        READINESS_BOUND,
    )
    print(f"readiness turned 503 {took:.1f} s after etcd stopped")
    code, body = node.health("/readiness")
    assert code == 503
    assert body["ready"] is False
    assert any(r.startswith("datastore") for r in body["reasons"]), body
    for _ in range(3):  # the node's own loops are fine: liveness says so
        assert node.health("/liveness")[0] == 200
        time.sleep(0.5)
    m = node.metrics()  # metrics are served without the datastore too
    assert m[("tabby_datastore_errors_total", (("op", "health_check"),))] >= 1

    node.worker.call(lambda: node.etcd.start_member(0))
    node.worker.call(lambda: node.etcd.wait_healthy(60))
    took = node.wait(
        "readiness 200 after etcd returned", lambda: node.get("/readiness")[0] == 200, 60
    )
    print(f"readiness back to 200 {took:.1f} s after etcd answered again")
    assert node.health("/readiness") == (200, {"ready": True, "reasons": []})
    assert node.health("/liveness")[0] == 200
