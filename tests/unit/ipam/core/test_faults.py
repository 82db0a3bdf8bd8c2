"""Failures: kills at every write, I/O errors, rollback, corrupt documents, lock timeouts;
and the cost of an ADD/DEL at high occupancy."""

from __future__ import annotations

from pathlib import Path

import pytest

from datastore.base import Store
from datastore.memory import MemoryStore
from ipam.core import (
    Ipam,
    LockTimeout,
    NoAddressAvailable,
    PoolSpec,
    StoreUnavailable,
    check_consistency,
)
from tests.unit.store_makers import make_store

from .helpers import (
    V4,
    CountingStore,
    Crash,
    DyingStore,
    FailingStore,
    errors,
    hid,
    in_use,
    req,
    setup,
    small,
    sreq,
)

# -- failures and crashes ---------------------------------------------------------------


def _scenario(store: Store) -> None:
    """A dual-stack ADD that claims two blocks, a second ADD, a DEL, one release_ip."""
    ipam = Ipam(store, "node-a")
    ipam.assign(req(hid(1), want_v6=True))
    b = ipam.assign(req(hid(2), want_v6=True))
    ipam.release_handle(hid(1))
    ipam.release_ip(b[1].ip)


def _count_writes() -> int:
    inner = MemoryStore()
    setup(inner)
    probe = DyingStore(inner)
    _scenario(probe)
    return probe.writes


@pytest.mark.parametrize("die_at", range(1, _count_writes() + 1))
def test_kill_at_every_write_leaves_a_consistent_store(die_at: int) -> None:
    inner = MemoryStore()
    setup(inner)
    dying = DyingStore(inner, die_at)
    with pytest.raises(Crash):
        _scenario(dying)
    assert errors(inner) == []  # only harmless leftovers, never a broken invariant
    # The runtime retries: DEL of both attachments, then ADD again, then DEL.
    ipam = Ipam(inner, "node-a")
    ipam.release_handle(hid(1))
    ipam.release_handle(hid(2))
    assert in_use(ipam) == 0
    _v4, _v6 = ipam.assign(req(hid(1), want_v6=True))
    # leftovers are repaired when touched: the orphan block was adopted, not doubled
    assert len([u for u in ipam.block_usage() if u.pool == V4]) == 1
    ipam.gc("net", set(), grace_seconds=0)
    assert in_use(ipam) == 0
    assert check_consistency(inner) == []


def test_an_add_into_an_existing_block_is_one_write() -> None:
    """The block exists: an ADD writes the block, holding the allocation (and so its
    handle), and nothing else; a kill before that write leaves nothing at all."""
    inner = MemoryStore()
    ipam = setup(inner)
    ipam.assign(req(hid(0)))  # the block exists already
    counting = CountingStore(inner)
    Ipam(counting, "node-a").assign(req(hid(1)))
    assert counting.writes == 1
    dying = DyingStore(inner, die_at=1)
    with pytest.raises(Crash):
        Ipam(dying, "node-a").assign(req(hid(2)))
    assert check_consistency(inner) == []
    assert ipam.get_handle(hid(2)) == []
    a = ipam.assign(req(hid(2)))[0]  # the retried ADD
    assert ipam.get_handle(hid(2)) == [a]
    assert check_consistency(inner) == []


def test_dual_stack_rolls_back_v4_when_v6_fails(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    ipam.assign(req(hid(0), want_v6=True))  # both blocks exist
    failing = Ipam(FailingStore(mem_store, "block", ":"), "node-a")  # any IPv6 block write
    with pytest.raises(StoreUnavailable):
        failing.assign(req(hid(1), want_v6=True))
    assert ipam.get_handle(hid(1)) == []
    assert mem_store.get("handle", hid(1)) is None
    assert in_use(ipam) == 2
    assert check_consistency(mem_store) == []


def test_dual_stack_exhausted_v6_allocates_no_v4(mem_store: MemoryStore) -> None:
    ipam = Ipam(mem_store, "node-a")
    ipam.ensure_pools([PoolSpec(V4, 28), PoolSpec("fd00::/127", 128)])
    ipam.assign(req(hid(0), want_v4=False, want_v6=True, v6_pools=["fd00::/127"]))
    ipam.assign(req(hid(1), want_v4=False, want_v6=True, v6_pools=["fd00::/127"]))
    with pytest.raises(NoAddressAvailable, match="IPv6"):
        ipam.assign(req(hid(2), want_v6=True, v6_pools=["fd00::/127"]))
    assert ipam.get_handle(hid(2)) == []
    assert in_use(ipam) == 2


def test_corrupt_blocks_do_not_stop_this_nodes_add(mem_store: MemoryStore) -> None:
    a = small(mem_store, "node-a", pool="10.1.0.0/28")
    b = small(mem_store, "node-b", pool="10.1.0.0/28")
    b_ip = b.assign(sreq(hid("b"), "10.1.0.0/28"))[0]
    mem_store.corrupt("block", str(b_ip.block_cidr))  # another node's block
    got = [a.assign(sreq(hid(i), "10.1.0.0/28"))[0] for i in range(12)]  # 3 free blocks
    assert len({x.ip for x in got}) == 12
    assert b_ip.block_cidr not in {x.block_cidr for x in got}
    with pytest.raises(NoAddressAvailable):
        a.assign(sreq(hid(12), "10.1.0.0/28"))
    probs = check_consistency(mem_store)
    assert [p.kind for p in probs if p.severity == "error"] == ["corrupt"]


def test_corrupt_candidate_block_is_skipped_when_claiming(mem_store: MemoryStore) -> None:
    a = small(mem_store)
    aff_start = a.assign(sreq(hid(0)))[0].block_cidr
    a.release_handle(hid(0))
    # a fresh node whose first candidate is unreadable still gets a block
    c = small(mem_store, "node-c")
    from ipam.core.model import Pool
    from ipam.core.pools import start_index

    pool = Pool.from_spec("10.1.0.0/29", 30)
    first = str(pool.block_network(start_index("node-c", pool)))
    if first == str(aff_start):
        first = str(pool.block_network((start_index("node-c", pool) + 1) % 2))
    mem_store.corrupt("block", first)
    got = c.assign(sreq(hid(1)))[0]
    assert str(got.block_cidr) != first


@pytest.mark.parametrize("kind", ["memory", "file"])
def test_store_lock_timeout_surfaces(tmp_path: Path, kind: str) -> None:
    holder = make_store(kind, tmp_path, lock_timeout=0.2)
    # the file store's flock excludes a second store object, like another process
    store = holder if kind == "memory" else make_store(kind, tmp_path, lock_timeout=0.2)
    ipam = setup(store)
    with holder.lock(), pytest.raises(LockTimeout):
        ipam.assign(req(hid(1)))
    assert ipam.assign(req(hid(1)))


# -- cost -----------------------------------------------------------------------------


@pytest.fixture
def full_pool() -> tuple[MemoryStore, Ipam]:
    """A /20 of /26 blocks (64 blocks) filled to ~95% by eight nodes, eight blocks each."""
    store = MemoryStore()
    Ipam(store, "").ensure_pools([PoolSpec("10.20.0.0/20", 26)])
    for n in range(8):
        node = Ipam(store, f"node-{'abcdefgh'[n]}")
        for i in range(int(512 * 0.95)):
            node.assign(req(hid(f"{n}-{i}"), v4_pools=["10.20.0.0/20"], max_blocks_per_host=8))
    return store, Ipam(store, "node-a")


@pytest.mark.slow
def test_cost_is_flat_at_high_occupancy(full_pool: tuple[MemoryStore, Ipam]) -> None:
    """An ADD and a DEL read the node's index and its own blocks (each once; the ADD its
    pool too), never the other nodes' blocks, and write one block each."""
    store, _ = full_pool
    assert len(store.list_keys("block")) == 64
    counting = CountingStore(store)
    ipam = Ipam(counting, "node-a")
    for i in range(40):
        ipam.assign(req(hid(f"x{i}"), v4_pools=["10.20.0.0/20"], max_blocks_per_host=8))
        ipam.release_handle(hid(f"x{i}"))
    mine = 8  # node-a's blocks, of 64
    assert counting.gets / 40 <= 2 * (1 + mine) + 1  # ADD and DEL: index + own blocks
    assert counting.lists == 0
    assert counting.writes / 40 == 2  # one block write each


@pytest.mark.slow
def test_a_scan_is_one_ranged_read_and_survives_a_corrupt_document(
    full_pool: tuple[MemoryStore, Ipam],
) -> None:
    """Every block in one ``list`` (on etcd: one round trip, not one per block); with an
    unreadable block in it, one read per block instead, the others still seen."""
    store, _ = full_pool
    counting = CountingStore(store)
    ipam = Ipam(counting, "node-a")
    blocks = len(store.list_keys("block"))
    assert blocks > 50
    assert len(ipam.block_usage()) == blocks
    assert (counting.lists, counting.gets) == (1, 0)
    store.corrupt("block", "10.20.0.0/26")
    counting.lists = counting.gets = 0
    usage = ipam.block_usage()
    assert len(usage) == blocks - 1
    assert counting.gets == blocks  # the fallback: each block on its own
