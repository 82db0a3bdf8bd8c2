"""tabby-node's endpoint group commit (``cni_plugin.plugin.EndpointGroup``): the
WorkloadEndpoints of concurrent ADDs written in batches, one lock session of the node per
batch, each its own compare-and-swap; a write its batch failed is run again alone, unless the
store itself failed."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, TypeVar

import pytest

from cni_plugin.plugin import EndpointGroup
from datastore.base import Store
from datastore.errors import StoreCorrupt, StoreUnavailable
from datastore.file import FileStore
from datastore.memory import MemoryStore
from resources.wep import KIND, endpoint_key, remove_endpoint, write_endpoint
from tests.unit.served_store import Settings, Stores

T = TypeVar("T")
N = 24


class Sessions:
    """A store that counts its lock sessions; the first one is held until every other
    write has queued behind it (so the test does not rest on scheduling)."""

    def __init__(self, inner: Any, group: Callable[[], EndpointGroup], hold: int = N) -> None:
        self.inner = inner
        self.group = group
        self.hold = hold
        self.sessions = 0
        self.fail: Callable[[str], BaseException | None] = lambda key: None

    def lock(self) -> AbstractContextManager[None]:
        @contextmanager
        def session() -> Iterator[None]:
            with self.inner.lock():
                self.sessions += 1
                if self.sessions == 1:
                    deadline = time.monotonic() + 20
                    while (
                        self.group().batches.pending() < self.hold and time.monotonic() < deadline
                    ):
                        time.sleep(0.002)
                yield

        return session()

    def put(self, kind: str, key: str, data: dict[str, Any], rev: int | None) -> int:
        err = self.fail(key)
        if err is not None:
            raise err
        return self.inner.put(kind, key, data, rev)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _write(i: int) -> Callable[[Store], str]:
    return lambda store: write_endpoint(
        store,
        namespace="ns",
        node="node-a",
        pod=f"pod-{i}",
        container_id=f"c{i}",
        interface="eth0",
        host_interface=f"cali{i}",
        ip_networks=[f"10.0.0.{i}/32"],
    )


def _burst(group: EndpointGroup, ops: list[Callable[[Store], T]]) -> dict[int, Any]:
    got: dict[int, Any] = {}
    start = threading.Barrier(len(ops))

    def one(i: int) -> None:
        start.wait()
        try:
            got[i] = group.run(Settings(), ops[i])  # type: ignore[arg-type]
        except Exception as e:  # reported by the caller
            got[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(ops))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_a_burst_of_endpoints_takes_the_nodes_lock_once_per_batch() -> None:
    inner = MemoryStore(lock_timeout=10)
    store = Sessions(inner, lambda: group)
    stores = Stores(store)
    group = EndpointGroup(stores)  # type: ignore[arg-type]
    got = _burst(group, [_write(i) for i in range(N)])
    keys = {endpoint_key("ns", "node-a", f"pod-{i}", "eth0") for i in range(N)}
    assert set(got.values()) == keys
    assert store.sessions == 2 == stores.runs  # the first write, then all that queued behind
    for i in range(N):
        doc = inner.get(KIND, endpoint_key("ns", "node-a", f"pod-{i}", "eth0"))
        assert doc is not None
        assert doc.data["spec"]["containerID"] == f"c{i}"
        assert doc.data["spec"]["ipNetworks"] == [f"10.0.0.{i}/32"]
    # and removed the same way, each only if it is its container's
    removed = _burst(
        group,
        [
            (lambda k, cid: lambda s: remove_endpoint(s, k, cid))(
                endpoint_key("ns", "node-a", f"pod-{i}", "eth0"), f"c{i}" if i % 2 else "other"
            )
            for i in range(N)
        ],
    )
    assert removed == {i: bool(i % 2) for i in range(N)}
    assert len(inner.list(KIND)) == N // 2


def test_a_write_its_batch_failed_is_run_again_alone() -> None:
    inner = MemoryStore(lock_timeout=10)
    store = Sessions(inner, lambda: group)
    stores = Stores(store)
    group = EndpointGroup(stores)  # type: ignore[arg-type]
    failed: list[str] = []

    def once(key: str) -> BaseException | None:
        if key.endswith("-pod--3-eth0") and not failed:  # its document unreadable, once
            failed.append(key)
            return StoreCorrupt(key, "truncated")
        return None

    store.fail = once
    got = _burst(group, [_write(i) for i in range(N)])
    assert got[3] == endpoint_key("ns", "node-a", "pod-3", "eth0")
    assert failed == [got[3]]
    assert stores.runs == 3  # two batches, then pod-3 alone
    assert len(inner.list(KIND)) == N


def test_a_store_that_failed_fails_its_batch_without_asking_again() -> None:
    inner = MemoryStore(lock_timeout=10)
    store = Sessions(inner, lambda: group, hold=1)
    store.fail = lambda key: StoreUnavailable(key, "disk full")
    stores = Stores(store)
    group = EndpointGroup(stores)  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        group.run(Settings(), _write(1))  # type: ignore[arg-type]
    assert stores.runs == 1
    assert inner.list(KIND) == []


def test_a_batch_on_the_file_store_syncs_its_directory_once(tmp_path: Path) -> None:
    """The batch's endpoints are durable together at its end: one fsync of the directory
    per batch, not one per pod (``datastore.base.write_batch``)."""
    syncs = [0]

    class Counting(FileStore):
        def _fsync_dir(self, dfd: int) -> None:
            syncs[0] += 1
            super()._fsync_dir(dfd)

    inner = Counting(str(tmp_path), lock_timeout=10)
    store = Sessions(inner, lambda: group)  # type: ignore[arg-type]
    group = EndpointGroup(Stores(store))  # type: ignore[arg-type]
    got = _burst(group, [_write(i) for i in range(N)])
    assert len(set(got.values())) == N
    assert syncs == [2]  # two batches
    assert len(FileStore(str(tmp_path)).list(KIND)) == N
