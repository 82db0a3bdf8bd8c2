"""The stores the unit tests run on, made one way: memory, file, or etcd on a prefix of its
own (tests share one etcd member per module, ``etcd1`` in tests/unit/conftest.py), and the
real etcd clusters behind them (``start_etcd``: a missing binary fails the test, naming it).

The fixtures built on these (``store``, ``every_store``, ``etcd1``, ``clock``) are in
tests/unit/conftest.py.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from datastore.base import Store
from datastore.etcd.store import EtcdStore
from datastore.file import FileStore
from datastore.memory import MemoryStore
from tests.etcd_cluster import EtcdCluster, EtcdMissing

#: The kinds of store every implementation-independent suite runs on; etcd's param carries
#: the ``etcd`` marker (tests/conftest.py skips it where the binary is missing).
EVERY_KIND = ["memory", "file", pytest.param("etcd", marks=pytest.mark.etcd)]


def start_etcd(size: int = 1, **kw: Any) -> EtcdCluster:
    """A real etcd cluster of ``size`` members on 127.0.0.1 (use it in ``with``)."""
    try:
        return EtcdCluster(size, **kw)
    except EtcdMissing as e:
        pytest.fail(str(e))


def make_etcd_store(
    cluster: EtcdCluster, tmp_path: Path, lock_timeout: float = 5.0, prefix: str = ""
) -> EtcdStore:
    """A store on its own prefix (tests share one etcd), its lock files under tmp_path."""
    return EtcdStore(
        cluster.endpoints,
        prefix=prefix or f"/test-{uuid.uuid4().hex[:12]}",
        lock_timeout=lock_timeout,
        lock_dir=str(tmp_path / "locks"),
    )


def make_store(
    kind: str, tmp_path: Path, lock_timeout: float = 5.0, etcd: EtcdCluster | None = None
) -> Store:
    """A fresh store of ``kind`` (memory, file under tmp_path, or etcd on ``etcd``)."""
    if kind == "memory":
        return MemoryStore(lock_timeout=lock_timeout)
    if kind == "etcd":
        assert etcd is not None, "an etcd store needs the etcd1 fixture's cluster"
        return make_etcd_store(etcd, tmp_path, lock_timeout)
    assert kind == "file", kind
    return FileStore(str(tmp_path / "state" / "ipam"), lock_timeout=lock_timeout)


class Clock:
    """A settable clock: ``clock.now += 60`` moves time for what was given it."""

    def __init__(self, now: float = 1_700_000_000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
