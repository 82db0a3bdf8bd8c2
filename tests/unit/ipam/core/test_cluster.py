"""Cluster mode: several nodes write one store, each with its own lock (as with etcd, where
``store.lock()`` only serialises one node's writers). Correctness rests on compare-and-swap
alone: threads churning on every node, and each known race put at its exact instant."""

from __future__ import annotations

import random
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from datastore.memory import MemoryStore
from ipam.core import (
    InvalidConfig,
    Ipam,
    NoAddressAvailable,
    PoolSpec,
    RevisionConflict,
    check_consistency,
)

from .helpers import NodeStore, assert_one_affinity_per_block, errors, hid, req, sreq

POOL = "10.50.0.0/26"  # eight /29 blocks
POOL6 = "fd50::/122"  # four /124 blocks


def node(inner: MemoryStore, name: str) -> tuple[NodeStore, Ipam]:
    store = NodeStore(inner)
    return store, Ipam(store, name)  # type: ignore[arg-type]


def cluster(*names: str, pool: str = POOL, size: int = 29) -> tuple[MemoryStore, dict[str, Any]]:
    inner = MemoryStore()
    Ipam(inner, "").ensure_pools([PoolSpec(pool, size), PoolSpec(POOL6, 124)])
    return inner, {n: node(inner, n) for n in names}


@pytest.fixture
def fine_switching() -> Iterator[None]:
    """Switch threads every few bytecodes, so the nodes' steps interleave finely."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        yield
    finally:
        sys.setswitchinterval(old)


class Ledger:
    """Who holds which address, by the callers' own account. An address is entered when
    ``assign`` returned it and removed before its release starts, so finding it held at
    entry means two holders at once: a double hand-out."""

    def __init__(self) -> None:
        self.mutex = threading.Lock()
        self.owner: dict[str, str] = {}
        self.doubles: list[str] = []

    def took(self, handle: str, ips: list[str]) -> None:
        with self.mutex:
            for ip in ips:
                if ip in self.owner:
                    self.doubles.append(f"{ip}: {self.owner[ip]} and {handle}")
                self.owner[ip] = handle

    def giving_back(self, ips: list[str]) -> None:
        with self.mutex:
            for ip in ips:
                self.owner.pop(ip, None)


Held = dict[str, list[tuple[str, int]]]  # handle -> (address, sequence number)


def churn(
    ipam: Ipam,
    name: str,
    seed: int,
    steps: int,
    ledger: Ledger,
    held: Held,
    failures: list[str],
    pools: tuple[str, ...] = (POOL,),
) -> None:
    """Random ADD/DEL/release-by-address on one node, bookkept in ``held``."""
    rnd = random.Random(seed)
    try:
        for step in range(steps):
            r = rnd.random()
            if r < 0.55 or not held:
                h = hid(f"{name}-{seed}-{step}")
                v4 = [rnd.choice(pools)]
                try:
                    got = ipam.assign(
                        req(h, v4_pools=v4, v6_pools=[POOL6], want_v6=rnd.random() < 0.3)
                    )
                except (NoAddressAvailable, RevisionConflict, InvalidConfig):
                    continue  # exhausted, lost too many races, pool deleted: nothing held
                ledger.took(h, [str(a.ip) for a in got])
                held[h] = [(str(a.ip), a.seq) for a in got]
            elif r < 0.9:
                h = rnd.choice(sorted(held))
                ledger.giving_back([ip for ip, _ in held.pop(h)])
                ipam.release_handle(h)
            else:
                h = rnd.choice(sorted(held))
                ip, seq = held[h].pop()
                if not held[h]:
                    del held[h]
                ledger.giving_back([ip])
                ipam.release_ip(ip, expected_seq=seq)  # a no-op if someone released it
    except BaseException as e:  # pragma: no cover - reported by the test
        failures.append(f"{name}: {type(e).__name__}: {e}")


def run_threads(targets: list[Any]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
        assert not t.is_alive(), "a node hung"


def check_holdings(inner: MemoryStore, held: Held) -> None:
    """Every address the callers believe held is held by them, once."""
    reader = Ipam(inner, "")
    everyone = [ip for pairs in held.values() for ip, _ in pairs]
    assert len(everyone) == len(set(everyone))
    for h, pairs in held.items():
        assert sorted((str(a.ip), a.seq) for a in reader.get_handle(h)) == sorted(pairs), h
        for ip, _ in pairs:
            owner = reader.who_owns(ip)
            assert owner is not None
            assert owner.handle_id == h


@pytest.mark.slow
def test_nodes_without_a_shared_lock_never_hand_out_an_address_twice(
    fine_switching: None,
) -> None:
    names = ("node-a", "node-b", "node-c")
    inner, nodes = cluster(*names)
    for store, _ in nodes.values():
        store.yielding = True
    ledger = Ledger()
    failures: list[str] = []
    helds: list[Held] = []
    targets = []
    for i, name in enumerate(names):
        for t in range(2):  # two writers per node share that node's lock
            held: Held = {}
            helds.append(held)
            ipam = nodes[name][1]
            targets.append(
                lambda ipam=ipam, name=name, seed=i * 10 + t, held=held: churn(
                    ipam, name, seed, 250, ledger, held, failures
                )
            )
    run_threads(targets)
    assert failures == []
    assert ledger.doubles == []
    assert errors(inner) == []
    assert_one_affinity_per_block(inner)
    check_holdings(inner, {h: ips for held in helds for h, ips in held.items()})
    # every block was claimed by one node and the pool was worked hard
    assert len(inner.list_keys("block")) >= 8


@pytest.mark.slow
def test_pool_deleted_and_recreated_with_another_layout_while_nodes_churn(
    fine_switching: None,
) -> None:
    """An operator deletes a pool whenever it is empty and creates it again with another
    block size, while two nodes assign from it: a block of the old layout must never
    survive into the new one (it would overlap the new blocks: an address twice)."""
    extra = "10.70.0.0/27"
    inner, nodes = cluster("node-a", "node-b")
    for store, _ in nodes.values():
        store.yielding = True
    Ipam(inner, "").add_pool(PoolSpec(extra, 29))
    ledger = Ledger()
    failures: list[str] = []
    helds: list[Held] = [{}, {}]
    done = threading.Event()
    cycles = []

    def operator() -> None:
        ops = Ipam(NodeStore(inner), "")  # type: ignore[arg-type]
        size = 29
        try:
            while not done.is_set():
                time.sleep(0.002)
                try:
                    ops.delete_pool(extra)
                except InvalidConfig:
                    continue  # in use
                size = 30 if size == 29 else 29
                ops.add_pool(PoolSpec(extra, size))
                cycles.append(size)
        except BaseException as e:  # pragma: no cover - reported by the test
            failures.append(f"operator: {type(e).__name__}: {e}")

    def worker(name: str, seed: int, held: Held) -> None:
        try:
            churn(nodes[name][1], name, seed, 400, ledger, held, failures, (POOL, extra))
        finally:
            done.set()

    run_threads(
        [
            lambda: worker("node-a", 1, helds[0]),
            lambda: worker("node-b", 2, helds[1]),
            operator,
        ]
    )
    assert failures == []
    assert ledger.doubles == []
    assert errors(inner) == []
    assert_one_affinity_per_block(inner)
    check_holdings(inner, {h: p for held in helds for h, p in held.items()})
    assert cycles, "the pool never went"


@pytest.mark.slow
def test_release_node_while_the_node_is_still_active(fine_switching: None) -> None:
    """An operator releases node-c again and again while node-c is in fact still running
    (and node-a borrows from its blocks): node-c only loses what it has, no invariant
    breaks, node-a keeps everything. (node-c's own ledger cannot tell doubles: its
    addresses are taken back behind its back.)"""
    inner, nodes = cluster("node-a", "node-c")
    for store, _ in nodes.values():
        store.yielding = True
    ledger_a, ledger_c = Ledger(), Ledger()
    held_a: Held = {}
    held_c: Held = {}
    failures: list[str] = []
    reports = []
    done = threading.Event()

    def release_c() -> None:
        operator = Ipam(NodeStore(inner), "")  # type: ignore[arg-type]
        try:
            while not done.is_set():
                time.sleep(0.005)
                reports.append(operator.release_node("node-c"))
        except BaseException as e:  # pragma: no cover - reported by the test
            failures.append(f"release_node: {type(e).__name__}: {e}")

    def node_a() -> None:
        churn(nodes["node-a"][1], "node-a", 1, 400, ledger_a, held_a, failures)

    def node_c() -> None:
        try:
            churn(nodes["node-c"][1], "node-c", 2, 400, ledger_c, held_c, failures)
        finally:
            done.set()

    run_threads([node_a, node_c, release_c])
    assert len(reports) >= 2
    assert failures == []
    assert ledger_a.doubles == []
    assert errors(inner) == []
    assert_one_affinity_per_block(inner)
    check_holdings(inner, held_a)  # node-a kept everything, also what it borrowed from c
    assert all(not r.errors for r in reports), [r.errors for r in reports]
    # once node-c has really stopped, one more release leaves nothing of it
    Ipam(inner, "").release_node("node-c")
    assert not any(o.attrs.get("node") == "node-c" for o in Ipam(inner, "").allocations())
    assert inner.get("affinity", "node-c") is None


# -- each race at its instant ------------------------------------------------------------------


def test_delete_pool_while_another_node_creates_a_block() -> None:
    """Node B read the pool (enabled) and is about to claim; the pool is deleted first.
    B's new block then fails the pool gate, B removes it again: no block outside pools."""
    inner, nodes = cluster("node-a", "node-b")
    (_sa, a), (sb, b) = nodes["node-a"], nodes["node-b"]
    deleted = []
    sb.on("before", "create", "block", lambda: deleted.append(a.delete_pool(POOL)))
    with pytest.raises(NoAddressAvailable):
        b.assign(sreq(hid(1), POOL))
    assert deleted == [0]
    assert inner.list_keys("pool") == [POOL6]
    assert inner.list_keys("block") == []
    assert inner.list_keys("handle") == []
    assert check_consistency(inner) == []


def test_delete_pool_sees_a_block_created_before_it_disabled_the_pool() -> None:
    """B created its block (not yet through the gate) when the delete runs: the delete
    removes the empty block; B's gate finds the pool gone; nothing is left behind."""
    inner, nodes = cluster("node-a", "node-b")
    (_sa, a), (sb, b) = nodes["node-a"], nodes["node-b"]
    deleted = []
    sb.on("after", "create", "block", lambda: deleted.append(a.delete_pool(POOL)))
    with pytest.raises(NoAddressAvailable):
        b.assign(sreq(hid(1), POOL))
    assert deleted == [1]
    assert inner.list_keys("block") == []
    assert check_consistency(inner) == []


def test_delete_pool_aborts_when_an_address_lands_after_its_check() -> None:
    """The delete's read-only check passed; before it disables the pool another node
    assigns an address: the delete finds it, restores the pool and fails."""
    inner, nodes = cluster("node-a", "node-b")
    (sa, a), (_sb, b) = nodes["node-a"], nodes["node-b"]
    b.assign(sreq(hid(0), POOL))
    b.release_handle(hid(0))  # B's block exists, empty
    doc = inner.get("pool", POOL)
    assert doc is not None
    inner.put("pool", POOL, dict(doc.data, name="default-ipv4-ippool"), doc.revision)
    got = []
    sa.on("before", "put", "pool", lambda: got.extend(b.assign(sreq(hid(1), POOL))))
    with pytest.raises(InvalidConfig, match="in use"):
        a.delete_pool(POOL)
    (alloc,) = got
    assert b.get_handle(hid(1)) == [alloc]
    pool = inner.get("pool", POOL)
    assert pool is not None
    assert pool.data == {
        "cidr": POOL,
        "block_size": 29,
        "disabled": False,
        "name": "default-ipv4-ippool",
    }
    assert check_consistency(inner) == []


def test_delete_pool_removes_a_block_under_a_pending_assign() -> None:
    """B read its empty block and is about to write an allocation when the pool goes: B's
    write fails (the block is gone), B finds no usable block, nothing is left behind."""
    inner, nodes = cluster("node-a", "node-b")
    (_sa, a), (sb, b) = nodes["node-a"], nodes["node-b"]
    b.assign(sreq(hid(0), POOL))
    b.release_handle(hid(0))
    sb.on("before", "put", "block", lambda: a.delete_pool(POOL))
    with pytest.raises(NoAddressAvailable):
        b.assign(sreq(hid(1), POOL))
    assert inner.list_keys("block") == []
    assert inner.list_keys("handle") == []
    assert inner.get("affinity", "node-b") is not None
    assert check_consistency(inner) == []


def test_no_borrowing_from_a_block_whose_pool_was_disabled_meanwhile() -> None:
    _inner, nodes = cluster("node-a", "node-b", pool="10.50.0.0/29", size=29)  # one block
    (_sa, a), (sb, b) = nodes["node-a"], nodes["node-b"]
    a.assign(sreq(hid("a"), "10.50.0.0/29"))
    sb.on("before", "list", "block", lambda: a.set_pool_disabled("10.50.0.0/29", True))
    with pytest.raises(NoAddressAvailable):
        b.assign(sreq(hid("b"), "10.50.0.0/29"))
    assert [o.handle_id for o in a.allocations()] == [hid("a")]


def test_a_borrower_lists_the_block_before_its_allocation_lands() -> None:
    """B borrows from A's block: B's index lists the block before B's allocation is written
    there (I2: a kill in between leaves a listed block without B's address, never an
    address B's DEL cannot find)."""
    inner, nodes = cluster("node-a", "node-b", pool="10.50.0.0/28", size=29)  # two blocks
    (_sa, a), (sb, b) = nodes["node-a"], nodes["node-b"]
    mine = [a.assign(sreq(hid(i), "10.50.0.0/28", max_blocks_per_host=1))[0] for i in range(7)]
    block = str(mine[0].block_cidr)
    for i in range(8):  # B fills the other block
        b.assign(sreq(hid(f"b{i}"), "10.50.0.0/28"))
    listed: list[list[str]] = []

    def look() -> None:
        doc = inner.get("affinity", "node-b")
        listed.append(doc.data["borrowed"] if doc is not None else [])

    sb.on("before", "put", "block", look, key=block)
    borrowed = b.assign(sreq(hid("b8"), "10.50.0.0/28"))[0]
    assert str(borrowed.block_cidr) == block
    assert listed == [[block]]
    assert b.release_handle(hid("b8")) == [borrowed]  # found through the index
    # the DEL wrote the block only: the listing stays until GC (a harmless leftover)
    assert [p.kind for p in check_consistency(inner)] == ["affinity-extra-block"]
    b.gc("other", set(), grace_seconds=0)
    assert check_consistency(inner) == []


def test_two_nodes_racing_for_one_block() -> None:
    """Both claim walks point at the same block: one CAS-create wins, the other node walks
    on and claims the next one."""
    inner, nodes = cluster("node-a", "node-b")
    (_sa, a), (sb, b) = nodes["node-a"], nodes["node-b"]
    for name in ("node-a", "node-b"):
        inner.put(
            "affinity", name, {"node": name, "format": 2, "blocks": [], "cursor": {POOL: 3}}, None
        )
    got_a = []
    sb.on("before", "create", "block", lambda: got_a.extend(a.assign(sreq(hid("a"), POOL))))
    got_b = b.assign(sreq(hid("b"), POOL))
    assert str(got_a[0].block_cidr) == "10.50.0.24/29"  # index 3
    assert str(got_b[0].block_cidr) == "10.50.0.32/29"  # the next one
    assert_one_affinity_per_block(inner)
    assert check_consistency(inner) == []


def test_release_of_a_handle_racing_its_assign() -> None:
    """An operator releases a handle (looking at every block) while its ADD runs: each
    block's write is one CAS, so the release comes before the allocation (it finds
    nothing, and the ADD's address stays, indexed) or after it (it frees it); never an
    address without its node's index (I2)."""
    inner, nodes = cluster("node-a")
    sa, a = nodes["node-a"]
    a.assign(sreq(hid(0), POOL))  # the block exists
    operator = Ipam(NodeStore(inner), "")  # type: ignore[arg-type]
    early: list[Any] = []
    sa.on("before", "put", "block", lambda: early.extend(operator.release_handle(hid(1))))
    (got,) = a.assign(sreq(hid(1), POOL))
    assert early == []
    assert a.get_handle(hid(1)) == [got]
    assert check_consistency(inner) == []
    assert operator.release_handle(hid(1)) == [got]
    assert [o.handle_id for o in a.allocations()] == [hid(0)]
    assert check_consistency(inner) == []


def test_overlapping_pools_created_at_the_same_time() -> None:
    """Two nodes create overlapping pools under different keys at once: the second to
    look backs off; no block can be claimed in a pool that overlaps another."""
    inner = MemoryStore()
    sa, a = node(inner, "node-a")
    _sb, b = node(inner, "node-b")
    sa.on("before", "create", "pool", lambda: b.ensure_pools([PoolSpec("10.60.0.0/24", 28)]))
    with pytest.raises(InvalidConfig, match="overlaps"):
        a.ensure_pools([PoolSpec("10.60.0.0/16", 26)])
    assert inner.list_keys("pool") == ["10.60.0.0/24"]
    assert b.assign(sreq(hid(1), "10.60.0.0/24"))
    # the gate: a block of a pool that overlaps another one is never used
    inner.put("pool", "10.60.0.0/16", {"cidr": "10.60.0.0/16", "block_size": 26}, None)
    with pytest.raises(NoAddressAvailable):
        a.assign(sreq(hid(2), "10.60.0.0/16"))
    assert [p.kind for p in check_consistency(inner) if p.severity == "error"] == ["pool-overlap"]
    assert all(
        (inner.get("block", k) or pytest.fail(k)).data["pool"] == "10.60.0.0/24"
        for k in inner.list_keys("block")
    )
