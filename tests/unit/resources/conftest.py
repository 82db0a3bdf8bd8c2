"""Fixtures of the resource-layer tests: one real etcd member for the module (the migration
into the Kubernetes datastore runs from a live etcd store), the in-memory API server, and a
store on each."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from datastore.base import Store
from datastore.etcd.store import EtcdStore
from stores.kube.client import KubeClient, KubeConfig
from stores.kube.store import KubeStore
from tests.etcd_cluster import EtcdCluster
from tests.kube_fake import FakeApi, fake_api


class Stores:
    """Stores on the module's etcd (``prefix``) and on the API server, closed at the end."""

    def __init__(self, cluster: EtcdCluster, url: str, prefix: str, tmp_path: Path) -> None:
        self.cluster = cluster
        self.url = url
        self.prefix = prefix
        self.tmp = tmp_path
        self.made: list[Store] = []

    def etcd(self, node: str, timeout: float = 5.0) -> EtcdStore:
        """``node``: whose lock it takes (one lock directory per node it stands for)."""
        store = EtcdStore(
            self.cluster.endpoints,
            prefix=self.prefix,
            lock_timeout=timeout,
            lock_dir=str(self.tmp / f"locks-{node}"),
        )
        self.made.append(store)
        return store

    def kube(self, node: str = "admin", timeout: float = 5.0) -> KubeStore:
        client = KubeClient(KubeConfig(server=self.url), timeout=timeout, agent="tabby-test")
        store = KubeStore(client, lock_timeout=timeout, lock_dir=str(self.tmp / f"kube-{node}"))
        self.made.append(store)
        return store

    def close(self) -> None:
        for store in self.made:
            store.close()


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    with fake_api() as made:
        yield made


@pytest.fixture
def prefix() -> str:
    return f"/test-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def stores(
    etcd1: EtcdCluster, api: tuple[FakeApi, str], prefix: str, tmp_path: Path
) -> Iterator[Stores]:
    made = Stores(etcd1, api[1], prefix, tmp_path)
    yield made
    made.close()
