"""Release by handle and by address, and GC of stale attachments."""

from __future__ import annotations

from typing import Any

import pytest

from datastore.base import Store
from datastore.memory import MemoryStore
from ipam.core import InvalidConfig, Ipam, NodeRelease, check_consistency
from tests.unit.store_makers import Clock

from .helpers import handles, hid, in_use, req, setup, small, sreq

# -- release ---------------------------------------------------------------------------


def test_release_is_idempotent(store: Store) -> None:
    ipam = setup(store)
    got = ipam.assign(req(hid(1), want_v6=True))
    assert ipam.release_handle(hid(1)) == got
    assert ipam.release_handle(hid(1)) == []
    assert ipam.release_handle(hid(99)) == []
    assert ipam.get_handle(hid(1)) == []
    assert in_use(ipam) == 0
    assert handles(store) == []


def test_release_ip_with_sequence_number(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    a, b = ipam.assign(req(hid(1), want_v6=True))
    assert not ipam.release_ip(a.ip, expected_seq=a.seq + 1)  # stale release: refused
    assert ipam.who_owns(a.ip) is not None
    assert ipam.release_ip(str(a.ip), expected_seq=a.seq)
    assert not ipam.release_ip(a.ip)
    assert not ipam.release_ip("192.168.1.1")  # outside every pool
    assert ipam.get_handle(hid(1)) == [b]
    assert ipam.release_ip(b.ip)
    assert handles(mem_store) == []
    assert check_consistency(mem_store) == []


# -- GC -------------------------------------------------------------------------------


def test_gc_keeps_exactly_the_valid_ones(store: Store, clock: Clock) -> None:
    ipam = setup(store, clock=clock)
    for n in ("a", "b", "c"):
        ipam.assign(req(hid(n)))
    ipam.assign(req(hid("d", net="other")))
    clock.now += 100
    report = ipam.gc("net", {("ca", "eth0"), ("zz", "eth0")}, grace_seconds=10)
    assert sorted(report.released) == [hid("b"), hid("c")]
    assert report.kept == [hid("a")]
    assert report.errors == []
    assert handles(store) == sorted([hid("a"), hid("d", net="other")])
    assert in_use(ipam) == 2
    # an empty valid list means everything of this network is stale
    assert ipam.gc("net", set(), grace_seconds=0).released == [hid("a")]
    assert handles(store) == [hid("d", net="other")]
    assert check_consistency(store) == []


def test_gc_grace_period(mem_store: MemoryStore, clock: Clock) -> None:
    ipam = setup(mem_store, clock=clock)
    ipam.assign(req(hid("old")))
    clock.now += 60
    ipam.assign(req(hid("new")))
    clock.now += 1
    report = ipam.gc("net", set(), grace_seconds=30)
    assert report.released == [hid("old")]
    assert report.skipped_recent == [hid("new")]


def test_gc_goes_on_after_errors(mem_store: MemoryStore) -> None:
    from .helpers import FailingStore

    ipam = setup(mem_store)
    for n in range(3):
        ipam.assign(req(hid(n)))
    failing = FailingStore(mem_store, "block", "")  # every block write fails ...
    report = Ipam(failing, "node-a").gc("net", set(), grace_seconds=0)  # type: ignore[arg-type]
    assert report.released == []
    assert len(report.errors) == 3  # ... each attachment's failure reported, GC went on
    assert [hid(n) in e for n, e in enumerate(report.errors)] == [True] * 3


def test_gc_leaves_other_nodes_handles(mem_store: MemoryStore) -> None:
    setup(mem_store, "node-a").assign(req(hid("a")))
    Ipam(mem_store, "node-b").assign(req(hid("b")))
    report = Ipam(mem_store, "node-a").gc("net", set(), grace_seconds=0)
    assert report.released == [hid("a")]
    assert handles(mem_store) == [hid("b")]


# -- a node that is gone ----------------------------------------------------------------


def three_nodes(store: Store) -> tuple[Ipam, Ipam, dict[str, Any]]:
    """node-a and node-b on a /29 pool of two /30 blocks, each with a block, each holding
    an address in the other's block."""
    a = small(store, "node-a")
    b = small(store, "node-b")
    got: dict[str, Any] = {}
    got["a1"] = a.assign(sreq(hid("a1")))[0]
    got["b1"] = b.assign(sreq(hid("b1")))[0]
    for i in range(2, 5):
        got[f"a{i}"] = a.assign(sreq(hid(f"a{i}")))[0]  # a's block full after a4
    got["a5"] = a.assign(sreq(hid("a5")))[0]  # borrowed from b's block
    for i in range(2, 4):
        got[f"b{i}"] = b.assign(sreq(hid(f"b{i}")))[0]  # b's block full now
    a.release_handle(hid("a2"))
    got["b4"] = b.assign(sreq(hid("b4")))[0]  # borrowed from a's block
    return a, b, got


def test_release_node_frees_its_addresses_and_blocks(store: Store) -> None:
    _a, b, got = three_nodes(store)
    block_a, block_b = str(got["a1"].block_cidr), str(got["b1"].block_cidr)
    assert str(got["a5"].block_cidr) == block_b
    assert str(got["b4"].block_cidr) == block_a
    report = Ipam(store, "").release_node("node-a")
    assert report.node == "node-a"
    assert sorted(report.released) == sorted(hid(f"a{i}") for i in (1, 3, 4, 5))
    assert sorted(report.addresses) == sorted(str(got[f"a{i}"].ip) for i in (1, 3, 4, 5))
    assert report.deleted_blocks == []
    assert report.unaffined_blocks == [block_a]  # it still holds node-b's b4
    assert report.affinity_deleted
    assert report.errors == []
    assert store.get("affinity", "node-a") is None
    owners = {u.cidr: u.node for u in b.block_usage()}
    assert owners == {block_a: None, block_b: "node-b"}
    assert sorted(o.handle_id for o in b.allocations()) == sorted(hid(f"b{i}") for i in range(1, 5))
    assert check_consistency(store) == []
    # node-b gets a5's address back in its own block, then borrows from the unaffine one
    assert b.assign(sreq(hid("b5")))[0].ip == got["a5"].ip
    assert str(b.assign(sreq(hid("b6")))[0].block_cidr) == block_a
    assert check_consistency(store) == []
    # idempotent: nothing left to do
    again = Ipam(store, "").release_node("node-a")
    assert (again.released, again.deleted_blocks, again.unaffined_blocks) == ([], [], [])
    assert not again.affinity_deleted
    assert again.errors == []


def test_release_node_deletes_empty_blocks_and_they_can_be_claimed_again(
    store: Store,
) -> None:
    a = small(store, "node-a")
    first = a.assign(sreq(hid("a1")))[0]
    report = Ipam(store, "node-b").release_node("node-a")
    assert report.deleted_blocks == [str(first.block_cidr)]
    assert report.unaffined_blocks == []
    assert store.list_keys("block") == []
    assert handles(store) == []
    assert check_consistency(store) == []
    b = Ipam(store, "node-b")
    assert len({b.assign(sreq(hid(f"b{i}")))[0].block_cidr for i in range(8)}) == 2
    assert check_consistency(store) == []


def test_release_node_of_an_unknown_node_does_nothing(mem_store: MemoryStore) -> None:
    a = small(mem_store, "node-a")
    a.assign(sreq(hid("a1")))
    report = a.release_node("node-z")
    assert report == NodeRelease("node-z", [], [], [], [], False, [])
    with pytest.raises(InvalidConfig):
        a.release_node("")
    with pytest.raises(InvalidConfig):
        a.release_node("a:b")


def test_a_stale_release_by_address_misses_a_recreated_block(mem_store: MemoryStore) -> None:
    """The ABA guard holds across a block deleted (release_node) and claimed again: the
    new allocation of the same address has another sequence number."""
    c = small(mem_store, "node-c")
    old = c.assign(sreq(hid("c1")))[0]
    Ipam(mem_store, "").release_node("node-c")
    a = small(mem_store, "node-a")
    mem_store.put(
        "affinity",
        "node-a",
        {"node": "node-a", "format": 2, "blocks": [], "cursor": {"10.1.0.0/29": 0}},
        None,
    )
    new = a.assign(sreq(hid("a1"), specific_ips=[str(old.ip)]))[0]
    assert new.ip == old.ip
    assert new.seq != old.seq
    assert not c.release_ip(old.ip, expected_seq=old.seq)
    assert a.get_handle(hid("a1")) == [new]


def test_release_node_reports_errors_and_goes_on(mem_store: MemoryStore) -> None:
    from .helpers import FailingStore

    a, _b, got = three_nodes(mem_store)
    block_b = str(got["b1"].block_cidr)
    failing = FailingStore(mem_store, "block", block_b.split("/")[0])  # node-b's block fails
    report = Ipam(failing, "").release_node("node-a")  # type: ignore[arg-type]
    assert len(report.errors) == 1
    assert hid("a5") in report.errors[0]  # borrowed from node-b's block
    assert hid("a1") in report.released
    # its block still holds node-b's b4: kept, without affinity
    assert report.unaffined_blocks == [str(got["a1"].block_cidr)]
    assert a.who_owns(got["a5"].ip) is not None


def test_release_node_while_the_node_claims_a_block(mem_store: MemoryStore) -> None:
    """The node is not gone after all and claims a block while its affinity document is
    being deleted: the delete's CAS fails, the next attempt releases that block too."""
    from .helpers import NodeStore

    a = small(mem_store, "node-a")
    a.assign(sreq(hid("a1")))
    a.release_handle(hid("a1"))
    ops = NodeStore(mem_store)
    claimed = []
    ops.on(
        "before",
        "delete",
        "affinity",
        lambda: claimed.extend(a.assign(sreq(hid("a2"), max_blocks_per_host=0))),
    )
    report = Ipam(ops, "").release_node("node-a")  # type: ignore[arg-type]
    (alloc,) = claimed
    assert report.affinity_deleted
    assert str(alloc.block_cidr) in report.unaffined_blocks  # it holds a2's address now
    assert mem_store.get("affinity", "node-a") is None
    assert a.who_owns(alloc.ip) is not None
    # node-a lost its index with its blocks: what it took meanwhile is GC's to collect
    assert [p.kind for p in check_consistency(mem_store)] == ["allocation-of-unindexed-node"]
