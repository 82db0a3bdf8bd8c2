"""tabby-typha on the Kubernetes datastore (an in-memory API server, tests/kube_fake.py):
its one watch per kind fanned out, each node's view, a Pod's status and label changes kept
to its own node when no other node's policy depends on it (the interest filter)."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from fanout.client import TyphaSync
from resources.index import NODE_KINDS, PODS
from resources.remote import RemotePod
from tabby_node.cache import Cache
from tests.kube_fake import FakeApi, fake_api, namespace, pod, write_kubeconfig
from tests.unit.typha.test_process import Typha, wait


class Node:
    def __init__(self, name: str, port: int) -> None:
        self.source = TyphaSync([f"127.0.0.1:{port}"], name, None, backoff=(0.05, 0.5))
        self.cache = Cache(name, pods_from_api=True)
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


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    with fake_api() as made:
        yield made


def test_typha_on_the_kubernetes_api(
    api: tuple[FakeApi, str], tmp_path: Path, subprocess_env: dict[str, str]
) -> None:
    fake, url = api
    fake.put("/api/v1/namespaces", namespace("shop", {"team": "a"}))
    fake.put("/api/v1/pods", pod("shop", "web-0", {"app": "web"}, node="node-a", ips=("10.0.0.5",)))
    typha = Typha.plaintext(
        [
            "--datastore-type",
            "kubernetes",
            "--kubeconfig",
            write_kubeconfig(str(tmp_path / "kc"), url),
        ],
        subprocess_env,
    )
    typha.start()
    a, b = Node("node-a", typha.port), Node("node-b", typha.port)
    try:
        for node in (a, b):
            wait(node.cache.synced.is_set, f"{node.source.node} synced")
        own = a.cache.get(PODS, "shop/web-0")
        assert own is not None
        assert not isinstance(own, RemotePod)
        assert b.cache.get(PODS, "shop/web-0") is None  # no policy of node-b's needs it
        seen = len(b.events)
        # the pod's status changes, then its labels: its node alone
        fake.put(
            "/api/v1/pods", pod("shop", "web-0", {"app": "web"}, node="node-a", ips=("10.0.0.6",))
        )
        wait(lambda: len(a.events) >= 2, "node-a sees the status change")
        fake.put(
            "/api/v1/pods", pod("shop", "web-0", {"app": "db"}, node="node-a", ips=("10.0.0.6",))
        )
        wait(lambda: len(a.events) >= 3, "node-a sees the label change")
        mine = a.cache.get(PODS, "shop/web-0")
        assert mine is not None
        assert not isinstance(mine, RemotePod)
        assert mine.metadata.labels == {"app": "db"}
        assert b.events[seen:] == []
    finally:
        a.close()
        b.close()
        typha.stop()
