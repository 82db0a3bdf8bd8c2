"""Group commit (``ipam.core.batch.assign_many``): many attachments planned together, each
block they land in written once; the same outcome as assigning them one by one (the rule
IDs are cni_protocol/CONFORMANCE.md's)."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from datastore.memory import MemoryStore
from ipam.core import Ipam, NoAddressAvailable, PoolSpec, check_consistency
from ipam.core.errors import InvalidConfig

from .helpers import CountingStore, Crash, DyingStore, NodeStore, handles, hid, req

POOL = "10.40.0.0/24"
POOL6 = "fd40::/120"


def setup(store: MemoryStore) -> Ipam:
    ipam = Ipam(store, "node-a")
    ipam.ensure_pools([PoolSpec(POOL, 26), PoolSpec(POOL6, 122)])
    return ipam


def test_a_burst_landing_in_one_block_is_one_write() -> None:
    store = MemoryStore()
    ipam = setup(store)
    ipam.assign(req(hid("first"), v4_pools=[POOL]))  # the block exists
    counting = CountingStore(store)
    got = Ipam(counting, "node-a").assign_many([req(hid(i), v4_pools=[POOL]) for i in range(40)])
    assert counting.writes == 1
    ips = [str(a.ip) for r in got for a in r]  # type: ignore[union-attr]
    assert len(ips) == len(set(ips)) == 40
    assert handles(store) == sorted([hid("first"), *(hid(i) for i in range(40))])
    assert check_consistency(store) == []


def test_a_burst_that_fills_a_block_claims_the_next_and_writes_each_once() -> None:
    store = MemoryStore()
    ipam = setup(store)
    counting = CountingStore(store)
    got = Ipam(counting, "node-a").assign_many(
        [req(hid(i), v4_pools=[POOL], want_v6=True, v6_pools=[POOL6]) for i in range(100)]
    )
    assert all(isinstance(r, list) and len(r) == 2 for r in got)
    blocks = {str(a.block_cidr) for r in got for a in r}  # type: ignore[union-attr]
    assert len(blocks) == 4  # two /26 and two /122
    # a claim: the block's create and the index's write; then each block written once
    assert counting.writes <= 3 * len(blocks)
    assert check_consistency(store) == []
    assert ipam.assign(req(hid(7), v4_pools=[POOL])) == got[7]  # ADD-7: what it holds


def test_each_request_fails_alone_and_held_ones_are_returned() -> None:
    store = MemoryStore()
    ipam = setup(store)
    before = ipam.assign(req(hid("again"), v4_pools=[POOL]))
    tiny = "10.41.0.0/30"
    ipam.ensure_pools([PoolSpec(tiny, 30)])
    got = ipam.assign_many(
        [
            req(hid("again"), v4_pools=[POOL]),  # ADD-7: what it holds
            req("bad id", v4_pools=[POOL]),
            *(req(hid(f"t{i}"), v4_pools=[tiny]) for i in range(5)),  # four fit
        ]
    )
    assert got[0] == before
    assert isinstance(got[1], InvalidConfig)
    assert [isinstance(r, list) for r in got[2:]] == [True] * 4 + [False]
    assert isinstance(got[6], NoAddressAvailable)
    assert check_consistency(store) == []


def test_a_block_written_meanwhile_sends_its_members_round_again() -> None:
    """Another node's writer changes the block between the plan and the write: the write
    loses, and those attachments are assigned again on their own, never twice."""
    store = MemoryStore()
    ipam = setup(store)
    (first,) = ipam.assign(req(hid("x"), v4_pools=[POOL]))
    block = str(first.block_cidr)

    class Racing(CountingStore):
        raced = False

        def put(self, kind: str, key: str, data: dict[str, Any], rev: int | None) -> int:
            if kind == "block" and key == block and not self.raced:
                self.raced = True
                other = Ipam(NodeStore(store), "node-b")  # type: ignore[arg-type]
                other.assign(req(hid("b"), specific_ips=[str(first.ip + 1)]))
            return super().put(kind, key, data, rev)

    got = Ipam(Racing(NodeStore(store)), "node-a").assign_many(  # type: ignore[arg-type]
        [req(hid(i), v4_pools=[POOL]) for i in range(5)]
    )
    ips = [str(a.ip) for r in got for a in r]  # type: ignore[union-attr]
    assert len(set(ips)) == 5
    assert str(first.ip + 1) not in ips
    assert check_consistency(store) == []


def test_concurrent_batches_and_singles_never_share_an_address() -> None:
    store = MemoryStore()
    setup(store)
    seen: list[str] = []
    lock = threading.Lock()

    def run(n: int) -> None:
        ipam = Ipam(store, "node-a")
        for k in range(5):
            if n % 2:
                got = ipam.assign_many(
                    [req(hid(f"{n}-{k}-{j}"), v4_pools=[POOL]) for j in range(4)]
                )
                ips = [str(a.ip) for r in got for a in r]  # type: ignore[union-attr]
            else:
                ips = [str(a.ip) for a in ipam.assign(req(hid(f"{n}-{k}"), v4_pools=[POOL]))]
            with lock:
                seen.extend(ips)

    threads = [threading.Thread(target=run, args=(n,)) for n in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(seen) == 2 * 5 * 4 + 2 * 5
    assert len(set(seen)) == len(seen)
    assert check_consistency(store) == []


# -- a kill at every write of a batch ---------------------------------------------------


def _burst(store: Any) -> list[Any]:
    """A dual-stack burst that fills the node's first blocks and claims the next ones."""
    ipam = Ipam(store, "node-a")
    ipam.ensure_pools([PoolSpec(POOL, 28), PoolSpec(POOL6, 124)])
    return ipam.assign_many(
        [req(hid(i), want_v6=True, v4_pools=[POOL], v6_pools=[POOL6]) for i in range(24)]
    )


def _burst_writes() -> int:
    probe = DyingStore(MemoryStore())
    _burst(probe)
    return probe.writes


@pytest.mark.parametrize("die_at", range(1, _burst_writes() + 1))
def test_a_kill_at_every_write_of_a_batch_leaves_no_duplicate_and_no_leak(die_at: int) -> None:
    """Whatever a batch wrote before the kill (claims, index listings, blocks holding several
    attachments each): the store is consistent, the runtime's DEL of every attachment
    releases all that was given, the ADDs asked again get distinct addresses, and GC leaves
    nothing behind."""
    inner = MemoryStore()
    with pytest.raises(Crash):
        _burst(DyingStore(inner, die_at))
    assert [p for p in check_consistency(inner) if p.severity == "error"] == []
    ipam = Ipam(inner, "node-a")
    for i in range(24):  # the runtime's DEL after a failed ADD
        ipam.release_handle(hid(i))
    assert ipam.allocations() == []  # nothing leaked past the DELs
    got = _burst(inner)  # the ADDs asked again
    addresses = [str(a.ip) for r in got if isinstance(r, list) for a in r]
    assert len(addresses) == 48
    assert len(set(addresses)) == 48
    ipam.gc("net", set(), grace_seconds=0)
    assert ipam.allocations() == []
    assert check_consistency(inner) == []
