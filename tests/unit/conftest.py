"""The unit tier's own fixtures: a private configuration cache for every test, one store per
implementation, one real etcd member per module, a settable clock."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cni_config.known import CACHE_ENV
from datastore.base import Store
from datastore.file import FileStore
from datastore.memory import MemoryStore
from tests.etcd_cluster import EtcdCluster, EtcdMissing

REPO_ROOT = Path(__file__).resolve().parents[2]
STORE_KINDS = ["memory", "file"]


@pytest.fixture(autouse=True)
def config_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test keeps validated configurations in a directory of its own
    (``cni_config.known``), never in the machine's /run/tabby."""
    where = tmp_path / "config-cache"
    monkeypatch.setenv(CACHE_ENV, str(where))
    return where


def make_store(kind: str, tmp_path: Path, lock_timeout: float = 5.0) -> Store:
    if kind == "memory":
        return MemoryStore(lock_timeout=lock_timeout)
    return FileStore(str(tmp_path / "state" / "ipam"), lock_timeout=lock_timeout)


@pytest.fixture(params=STORE_KINDS)
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request.param, tmp_path)


@pytest.fixture
def mem_store() -> MemoryStore:
    return MemoryStore(lock_timeout=2.0)


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    return FileStore(str(tmp_path / "state" / "ipam"), lock_timeout=2.0)


@pytest.fixture(scope="module")
def etcd1() -> Iterator[EtcdCluster]:
    """One real etcd member on 127.0.0.1 for the module (stopped by PID, its dir removed)."""
    try:
        cluster = EtcdCluster(1)
    except EtcdMissing as e:
        pytest.fail(str(e))
    with cluster:
        yield cluster


class Clock:
    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for a Python child that imports this repository's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
