"""A real tabby-typha process (this checkout's code) on loopback in front of etcd, with two
tabby-node caches fed by typha clients: each node's view, /metrics and health, and a typha
restarted under them (the nodes catch up by differences, their caches never start over)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from daemon.http import parse_exposition
from datastore.etcd.store import EtcdStore
from fanout.client import ClientTls, TyphaSync
from lab.kubernetes.pki import Pki
from resources.index import NODE_KINDS, PODS
from resources.remote import RemotePod
from tabby_node.cache import Cache
from tests.etcd_cluster import EtcdCluster, free_ports
from tests.unit.fanout.docs import ALLOW_NAMESPACE, block, endpoint, pod

CIDR = "10.244.7.0/29"


def wait(check: Callable[[], bool], what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


def http_get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=2) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()
    except OSError:
        return 0, ""


class Typha:
    """A tabby-typha process of this checkout on loopback (``args``: its TLS and datastore)."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.port, self.health, self.metrics = free_ports(3)
        self.args = [
            sys.executable, "-m", "bundle",
            "--listen", "127.0.0.1", "--port", str(self.port),
            "--health-port", str(self.health), "--metrics-port", str(self.metrics),
            *args,
        ]  # fmt: skip
        self.env = {**env, "TABBY_ROLE": "tabby-typha", "POD_IP": ""}
        self.proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def on_etcd(cls, etcd: EtcdCluster, prefix: str, pki: Pki, env: dict[str, str]) -> Typha:
        typha = pki.issue("typha", "typha", sans=("DNS:typha", "IP:127.0.0.1"), server=True)
        args = [
            "--ca-file", str(pki.ca.cert),
            "--cert-file", str(typha.cert), "--key-file", str(typha.key),
            "--client-cn", "tabby-node",
            "--datastore-type", "etcdv3", "--etcd-endpoints", ",".join(etcd.endpoints),
            "--etcd-prefix", prefix,
        ]  # fmt: skip
        return cls(args, env)

    @classmethod
    def plaintext(cls, args: list[str], env: dict[str, str]) -> Typha:
        return cls(["--plaintext", *args], env)

    def start(self) -> None:
        self.proc = subprocess.Popen(self.args, env=self.env, stderr=subprocess.PIPE)
        wait(lambda: http_get(self.health, "/readiness")[0] == 200, "typha ready")

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        self.proc.stderr.close()  # type: ignore[union-attr]
        self.proc = None

    def scrape(self) -> dict[str, float]:
        status, text = http_get(self.metrics, "/metrics")
        assert status == 200
        return parse_exposition(text)


class Node:
    """A tabby-node's cache, fed by a typha client as tabby-node's watcher feeds it."""

    def __init__(
        self, name: str, port: int, tls: ClientTls | None, *, pods_from_api: bool = False
    ) -> None:
        self.source = TyphaSync([f"127.0.0.1:{port}"], name, tls, backoff=(0.05, 0.5))
        self.cache = Cache(name, pods_from_api=pods_from_api)
        self.events: list[tuple[str, str, str]] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for event in self.source.sync(NODE_KINDS, self.stop):
            self.cache.apply(event)
            self.events.append((event.type, event.kind, event.key))

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)

    @classmethod
    def certified(cls, name: str, typha: Typha, pki: Pki) -> Node:
        """A node with a client certificate of ``pki`` (CN tabby-node), checking typha's."""
        pair = pki.issue(f"node-{name}", "tabby-node")
        tls = ClientTls(
            pki.ca.cert.read_bytes(), pair.cert.read_bytes(), pair.key.read_bytes(), "typha"
        )
        return cls(name, typha.port, tls)


@pytest.fixture
def world(
    etcd1: EtcdCluster, tmp_path: Path, subprocess_env: dict[str, str]
) -> Iterator[tuple[EtcdStore, Typha, Pki]]:
    prefix = f"/typha-{uuid.uuid4().hex[:10]}"
    store = EtcdStore(
        etcd1.endpoints, prefix=prefix, lock_timeout=5.0, lock_dir=str(tmp_path / "locks")
    )
    pki = Pki(tmp_path / "pki", "typha-it")
    typha = Typha.on_etcd(etcd1, prefix, pki, subprocess_env)
    try:
        yield store, typha, pki
    finally:
        typha.stop()
        store.close()


def test_typha_serves_each_node_its_view_and_survives_a_restart(
    world: tuple[EtcdStore, Typha, Pki],
) -> None:
    store, typha, pki = world
    rev_a = store.put("pod", "default/a", pod("a", "n1"), None)
    store.put("workloadendpoint", "default/a-eth0", endpoint("a", "n1", "10.244.7.1"), None)
    store.put("block", CIDR, block(CIDR, "n1", {0: "n1"}), None)
    # every pod of default allows every other: a node running one needs them all
    store.put("networkpolicy", "default/same-namespace", ALLOW_NAMESPACE, None)
    typha.start()
    n1, n2 = Node.certified("n1", typha, pki), Node.certified("n2", typha, pki)
    try:
        for node in (n1, n2):
            wait(node.cache.synced.is_set, f"{node.source.node} synced")
        own = n1.cache.get(PODS, "default/a")
        assert own is not None
        assert not isinstance(own, RemotePod)  # n1's own pod: whole
        # n2 runs no pod: its policy depends on none of n1's (the interest filter)
        assert n2.cache.get(PODS, "default/a") is None
        assert n1.cache.lookup("block", CIDR) is not None
        metrics = typha.scrape()
        assert metrics["tabby_typha_connections"] == 2
        assert metrics["tabby_typha_snapshots_total"] == 2

        # n1's pod changes status and n1 allocates in its own block: n2 is sent nothing
        seen2 = len(n2.events)
        store.put("pod", "default/a", pod("a", "n1", ip="10.244.0.9"), rev_a)
        rev_b = store.get("block", CIDR)
        assert rev_b is not None
        store.put("block", CIDR, block(CIDR, "n1", {0: "n1", 1: "n1"}), rev_b.revision)
        # then a pod starts on n2: n1's policy allows it, and n2's now needs a
        store.put("pod", "default/b", pod("b", "n2", {"app": "db"}), None)
        store.put("workloadendpoint", "default/b-eth0", endpoint("b", "n2", "10.244.8.1"), None)
        wait(lambda: ("put", "workloadendpoint", "default/b-eth0") in n1.events, "n1 sees b")
        wait(lambda: ("put", "workloadendpoint", "default/a-eth0") in n2.events, "n2 gets a")
        assert ("put", "pod", "default/b") in n1.events
        assert ("put", "block", CIDR) in n1.events
        assert isinstance(n2.cache.get(PODS, "default/a"), RemotePod)
        assert sorted(n2.events[seen2:]) == [
            ("put", "pod", "default/a"),
            ("put", "pod", "default/b"),
            ("put", "workloadendpoint", "default/a-eth0"),
            ("put", "workloadendpoint", "default/b-eth0"),
        ]

        # typha restarts (another epoch): the nodes catch up by differences alone, sent only
        # the buckets of documents that differ (no snapshot)
        typha.stop()
        store.delete("pod", "default/b", store.get("pod", "default/b").revision)  # type: ignore[union-attr]
        typha.start()
        # (n2 may also be sent a's projection again: the new typha knows it at a's newest
        # revision, which a status change gave it)
        wait(lambda: ("delete", "pod", "default/b") in n2.events, "n2 sees b deleted")
        wait(lambda: n1.source.stats["rereads"] == 1, "n1 caught up")
        assert n1.cache.resyncs == n2.cache.resyncs == 1  # never a fresh snapshot into the cache
        assert n2.source.stats["rereads"] == 1
        metrics = typha.scrape()
        assert metrics["tabby_typha_snapshots_total"] == 0
        assert metrics["tabby_typha_resyncs_total"] == 2
    finally:
        n1.close()
        n2.close()


def test_a_node_with_the_wrong_identity_is_refused_and_counted(
    world: tuple[EtcdStore, Typha, Pki],
) -> None:
    _, typha, pki = world
    typha.start()
    pair = pki.issue("intruder", "intruder")
    tls = ClientTls(
        pki.ca.cert.read_bytes(), pair.cert.read_bytes(), pair.key.read_bytes(), "typha"
    )
    source = TyphaSync([f"127.0.0.1:{typha.port}"], "n9", tls, backoff=(0.05, 0.2))
    stop = threading.Event()
    events: list[object] = []
    thread = threading.Thread(
        target=lambda: events.extend(source.sync(NODE_KINDS, stop)), daemon=True
    )
    thread.start()
    try:
        wait(
            lambda: (
                typha.scrape().get('tabby_typha_connections_refused_total{reason="identity"}', 0)
                >= 1
            ),
            "refusal counted",
        )
        assert events == []
        assert typha.scrape()["tabby_typha_connections"] == 0
    finally:
        stop.set()
        thread.join(5)
    assert os.path.exists(pki.ca.cert)
