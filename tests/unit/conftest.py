"""The unit tier's own fixtures: a private configuration cache for every test, the stores
(memory and file; every kind, etcd included, for the suites every implementation must
pass), one real etcd member per module, a settable clock. How each is made:
tests/unit/store_makers.py."""

from __future__ import annotations

import itertools
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from cni_config.known import CACHE_ENV
from datastore.base import Store
from datastore.file import FileStore
from datastore.memory import MemoryStore
from tests import REPO_ROOT
from tests.etcd_cluster import EtcdCluster
from tests.unit.store_makers import EVERY_KIND, Clock, make_store, start_etcd


@pytest.fixture(scope="session")
def config_caches(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where the tests' configuration caches go: one directory per test below this one,
    made by ``cni_config.known`` when it first keeps a configuration."""
    return tmp_path_factory.mktemp("config-caches")


_CACHE_NUMBERS = itertools.count()


@pytest.fixture(autouse=True)
def config_cache(
    config_caches: Path, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Path:
    """Each test keeps validated configurations in a directory of its own
    (``cni_config.known``), never in the machine's /run/tabby. Not under ``tmp_path``: most
    tests never keep one, and a tmp_path for each of the tier's thousands of tests costs
    seconds of a developer's run."""
    where = config_caches / f"{next(_CACHE_NUMBERS)}"
    monkeypatch.setenv(CACHE_ENV, str(where))
    return where


@pytest.fixture(params=["memory", "file"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Store:
    return make_store(request.param, tmp_path)


@pytest.fixture(params=EVERY_KIND)
def every_store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Store]:
    """Memory, file and etcd (on ``etcd1``, a prefix of its own); closed after the test."""
    etcd = request.getfixturevalue("etcd1") if request.param == "etcd" else None
    made = make_store(request.param, tmp_path, etcd=etcd)
    yield made
    made.close()


@pytest.fixture
def mem_store() -> MemoryStore:
    return MemoryStore(lock_timeout=2.0)


@pytest.fixture
def file_store(tmp_path: Path) -> FileStore:
    return FileStore(str(tmp_path / "state" / "ipam"), lock_timeout=2.0)


@pytest.fixture(scope="module")
def etcd1() -> Iterator[EtcdCluster]:
    """One real etcd member on 127.0.0.1 for the module (stopped by PID, its dir removed)."""
    with start_etcd(1) as cluster:
        yield cluster


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def subprocess_env() -> dict[str, str]:
    """Environment for a Python child that imports this repository's packages."""
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env
