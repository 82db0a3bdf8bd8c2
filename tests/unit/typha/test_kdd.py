"""tabby-typha on the Kubernetes datastore (an in-memory API server, tests/kube_fake.py):
its one watch per kind fanned out, each node's view, a Pod's status and label changes kept
to its own node when no other node's policy depends on it (the interest filter)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from resources.index import PODS
from resources.remote import RemotePod
from tests.kube_fake import FakeApi, fake_api, namespace, pod, write_kubeconfig
from tests.unit.typha.test_process import Node, Typha, wait


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
    a, b = (
        Node("node-a", typha.port, None, pods_from_api=True),
        Node("node-b", typha.port, None, pods_from_api=True),
    )
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
