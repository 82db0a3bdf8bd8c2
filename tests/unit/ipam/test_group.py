"""tabby-node's group commit (``ipam.group.GroupCommit``): concurrent ADDs share batches, so a
burst costs fewer writes than pods, and each ADD gets its own, distinct addresses."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from datastore.memory import MemoryStore
from ipam.core import Ipam, PoolSpec, StoreUnavailable, check_consistency
from ipam.group import GroupCommit
from tests.unit.served_store import Settings, Stores

from .core.helpers import CountingStore, hid, req

POOL = "10.70.0.0/24"


def test_a_burst_of_adds_costs_fewer_writes_than_pods() -> None:
    inner = MemoryStore(lock_timeout=10)
    Ipam(inner, "node-a").ensure_pools([PoolSpec(POOL, 26)])
    Ipam(inner, "node-a").assign(req(hid("first"), v4_pools=[POOL]))  # the block exists

    class HeldFirstWrite(CountingStore):
        """The first batch's write waits until every other ADD queues behind it, so the
        test does not rest on how the threads happen to be scheduled."""

        def put(self, kind: str, key: str, data: dict[str, Any], rev: int | None) -> int:
            deadline = time.monotonic() + 20
            while self.writes == 0 and queued() < 30 and time.monotonic() < deadline:
                time.sleep(0.005)
            return super().put(kind, key, data, rev)

    def queued() -> int:
        return group.group.pending()

    counting = HeldFirstWrite(inner)
    group = GroupCommit(Stores(counting))  # type: ignore[arg-type]
    got: dict[int, list[str]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(30)

    def add(i: int) -> None:
        try:
            start.wait()
            allocs = group.assign(
                Settings(),
                "node-a",
                [PoolSpec(POOL, 26)],
                req(hid(i), v4_pools=[POOL]),  # type: ignore[arg-type]
            )
            got[i] = [str(a.ip) for a in allocs]
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=add, args=(i,)) for i in range(30)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert errors == []
    ips = [ip for v in got.values() for ip in v]
    assert len(ips) == len(set(ips)) == 30
    assert group.assigned == 30
    assert group.batches == 2  # the first batch, then every ADD that queued behind it
    assert counting.writes == group.batches  # one write per batch: one block
    assert check_consistency(inner) == []


def test_an_add_its_batch_refused_is_asked_again_on_its_own() -> None:
    inner = MemoryStore(lock_timeout=10)
    tiny = "10.71.0.0/30"
    Ipam(inner, "node-a").ensure_pools([PoolSpec(tiny, 30)])
    stores = Stores(inner)
    group = GroupCommit(stores)  # type: ignore[arg-type]
    for i in range(4):
        group.assign(Settings(), "node-a", [PoolSpec(tiny, 30)], req(hid(i), v4_pools=[tiny]))  # type: ignore[arg-type]
    runs = stores.runs
    with pytest.raises(Exception, match="no free IPv4 address"):
        group.assign(Settings(), "node-a", [PoolSpec(tiny, 30)], req(hid(9), v4_pools=[tiny]))  # type: ignore[arg-type]
    assert stores.runs == runs + 2  # the batch, then the ADD alone


def test_a_batch_the_store_failed_is_not_asked_again() -> None:
    """A block write that found the store unreachable fails its ADDs at once: asking again
    alone would spend the call's whole timeout a second time (a blackholed API server)."""
    inner = MemoryStore(lock_timeout=10)
    Ipam(inner, "node-a").ensure_pools([PoolSpec(POOL, 26)])
    Ipam(inner, "node-a").assign(req(hid("first"), v4_pools=[POOL]))  # the block exists

    class Unreachable(CountingStore):
        def put(self, kind: str, key: str, data: dict[str, Any], rev: int | None) -> int:
            raise StoreUnavailable("https://api", "timed out")

    stores = Stores(Unreachable(inner))
    group = GroupCommit(stores)  # type: ignore[arg-type]
    with pytest.raises(StoreUnavailable):
        group.assign(Settings(), "node-a", [PoolSpec(POOL, 26)], req(hid(1), v4_pools=[POOL]))  # type: ignore[arg-type]
    assert stores.runs == 1
