"""The allocator over the in-memory store (and the file store where it matters)."""

from __future__ import annotations

import ipaddress
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import pytest

from ipam.core import (
    AddressUnavailable,
    AssignRequest,
    InvalidConfig,
    Ipam,
    LockTimeout,
    NoAddressAvailable,
    PoolSpec,
    StoreUnavailable,
    check_consistency,
    handle_id,
)
from ipam.store.base import Doc, Store
from ipam.store.memory import MemoryStore

from .conftest import Clock, make_store

V4 = "10.0.0.0/24"
V6 = "fd00::/120"


def hid(n: int | str, net: str = "net") -> str:
    return handle_id(net, f"c{n}", "eth0")


def req(h: str, **kw: Any) -> AssignRequest:
    base: dict[str, Any] = {
        "attrs": {"pod_name": "p", "pod_namespace": "ns"},
        "want_v4": True,
        "want_v6": False,
        "v4_pools": [V4],
        "v6_pools": [V6],
    }
    base.update(kw)
    return AssignRequest(h, **base)


def setup(store: Store, node: str = "node-a", *, v4: int = 28, v6: int = 124, **kw: Any) -> Ipam:
    ipam = Ipam(store, node, **kw)
    ipam.ensure_pools([PoolSpec(V4, v4), PoolSpec(V6, v6)])
    return ipam


def errors(store: Store) -> list[Any]:
    return [p for p in check_consistency(store) if p.severity == "error"]


def in_use(ipam: Ipam) -> int:
    return sum(p.in_use for p in ipam.pool_usage())


# -- basics ---------------------------------------------------------------------------


def test_assign_v4_from_an_affine_block(store: Store) -> None:
    ipam = setup(store)
    (a,) = ipam.assign(req(hid(1)))
    assert a.ip in ipaddress.ip_network(V4)
    assert a.ip in a.block_cidr
    assert a.block_cidr.prefixlen == 28
    assert str(a.pool_cidr) == V4
    assert a.handle_id == hid(1)
    (blk,) = ipam.block_usage()
    assert blk.node == "node-a"
    assert blk.in_use == 1
    assert blk.free == 15
    owner = ipam.who_owns(a.ip)
    assert owner is not None
    assert owner.handle_id == hid(1)
    assert owner.node == "node-a"
    assert owner.seq == a.seq
    assert owner.attrs["pod_name"] == "p"
    assert owner.attrs["node"] == "node-a"
    assert ipam.get_handle(hid(1)) == [a]
    assert ipam.allocations() == [owner]
    assert check_consistency(store) == []


def test_dual_stack(store: Store) -> None:
    ipam = setup(store)
    v4, v6 = ipam.assign(req(hid(1), want_v6=True))
    assert v4.ip.version == 4
    assert v6.ip.version == 6
    assert v6.ip in ipaddress.ip_network(V6)
    assert v6.block_cidr.prefixlen == 124
    assert ipam.get_handle(hid(1)) == [v4, v6]
    assert check_consistency(store) == []


def test_v6_only(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    (a,) = ipam.assign(req(hid(1), want_v4=False, want_v6=True))
    assert a.ip.version == 6


@pytest.mark.parametrize(
    ("pool", "size", "n"),
    [
        ("10.9.0.0/24", 32, 3),
        ("10.9.0.0/16", 20, 3),
        ("fd09::/120", 128, 3),
        ("fd09::/112", 116, 3),
    ],
)
def test_block_size_extremes(mem_store: MemoryStore, pool: str, size: int, n: int) -> None:
    ipam = Ipam(mem_store, "node-a")
    ipam.ensure_pools([PoolSpec(pool, size)])
    fam = ipaddress.ip_network(pool).version
    got = [
        ipam.assign(
            req(hid(i), want_v4=fam == 4, want_v6=fam == 6, v4_pools=[pool], v6_pools=[pool])
        )[0]
        for i in range(n)
    ]
    assert len({a.ip for a in got}) == n
    assert all(a.block_cidr.prefixlen == size and a.ip in a.block_cidr for a in got)
    expected_blocks = n if size in (32, 128) else 1
    assert len(ipam.block_usage()) == expected_blocks
    assert check_consistency(mem_store) == []


def test_repeated_assign_returns_the_same_addresses(store: Store) -> None:
    ipam = setup(store)
    first = ipam.assign(req(hid(1), want_v6=True))
    again = ipam.assign(req(hid(1), want_v6=True))
    assert again == first
    assert in_use(ipam) == 2


def test_release_is_idempotent(store: Store) -> None:
    ipam = setup(store)
    got = ipam.assign(req(hid(1), want_v6=True))
    assert ipam.release_handle(hid(1)) == got
    assert ipam.release_handle(hid(1)) == []
    assert ipam.release_handle(hid(99)) == []
    assert ipam.get_handle(hid(1)) == []
    assert in_use(ipam) == 0
    assert store.list_keys("handle") == []


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
    assert mem_store.list_keys("handle") == []  # last address gone: handle gone
    assert check_consistency(mem_store) == []


def test_fifo_reuse_longest_free_first(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store, v4=30)
    got = [ipam.assign(req(hid(i)))[0] for i in range(4)]
    assert len({a.block_cidr for a in got}) == 1
    ipam.release_handle(hid(2))
    ipam.release_handle(hid(0))
    assert ipam.assign(req(hid(10)))[0].ip == got[2].ip
    assert ipam.assign(req(hid(11)))[0].ip == got[0].ip


def test_sequential_assigns_fill_one_block_then_claim_the_next(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    ips = [ipam.assign(req(hid(i)))[0] for i in range(17)]
    blocks = [a.block_cidr for a in ips]
    assert len(set(blocks[:16])) == 1
    assert blocks[16] != blocks[0]
    assert [int(a.ip) - int(blocks[0].network_address) for a in ips[:16]] == list(range(16))


def test_second_node_gets_a_different_block(store: Store) -> None:
    a = setup(store, "node-a").assign(req(hid(1)))[0]
    b = Ipam(store, "node-b").assign(req(hid(2)))[0]
    assert a.block_cidr != b.block_cidr
    owners = {u.cidr: u.node for u in Ipam(store, "").block_usage()}
    assert owners == {str(a.block_cidr): "node-a", str(b.block_cidr): "node-b"}


# -- exhaustion, borrowing, limits ----------------------------------------------------


def small(store: Store, node: str = "node-a", pool: str = "10.1.0.0/29", **kw: Any) -> Ipam:
    ipam = Ipam(store, node, **kw)
    ipam.ensure_pools([PoolSpec(pool, 30)])
    return ipam


def sreq(h: str, pool: str = "10.1.0.0/29", **kw: Any) -> AssignRequest:
    return req(h, v4_pools=[pool], **kw)


def test_exhaustion_and_recovery(mem_store: MemoryStore) -> None:
    ipam = small(mem_store)
    got = [ipam.assign(sreq(hid(i)))[0] for i in range(8)]
    assert len({a.ip for a in got}) == 8
    with pytest.raises(NoAddressAvailable):
        ipam.assign(sreq(hid(8)))
    assert ipam.get_handle(hid(8)) == []
    assert mem_store.get("handle", hid(8)) is None
    ipam.release_handle(hid(3))
    assert ipam.assign(sreq(hid(8)))[0].ip == got[3].ip


def test_borrowing_and_strict_affinity(mem_store: MemoryStore) -> None:
    a = small(mem_store, "node-a")
    b = small(mem_store, "node-b")
    first_a = a.assign(sreq(hid("a0")))[0]
    b_ips = [b.assign(sreq(hid(f"b{i}")))[0] for i in range(4)]  # node-b's whole block
    assert {x.block_cidr for x in b_ips} != {first_a.block_cidr}
    with pytest.raises(NoAddressAvailable, match="no free IPv4"):
        b.assign(sreq(hid("b4"), strict_affinity=True))
    borrowed = b.assign(sreq(hid("b4")))[0]
    assert borrowed.block_cidr == first_a.block_cidr  # one address from node-a's block
    owner = a.who_owns(borrowed.ip)
    assert owner is not None
    assert owner.node == "node-a"
    assert owner.attrs["node"] == "node-b"
    # node-a's own next assign still comes from its block, skipping the borrowed address
    nxt = a.assign(sreq(hid("a1")))[0]
    assert nxt.block_cidr == first_a.block_cidr
    assert nxt.ip not in (first_a.ip, borrowed.ip)
    assert check_consistency(mem_store) == []


def test_max_blocks_per_host(mem_store: MemoryStore) -> None:
    a = small(mem_store, "node-a", pool="10.1.0.0/28")
    got = [a.assign(sreq(hid(i), "10.1.0.0/28", max_blocks_per_host=1))[0] for i in range(4)]
    assert len({x.block_cidr for x in got}) == 1
    with pytest.raises(NoAddressAvailable, match="max_blocks_per_host 1"):
        a.assign(sreq(hid(4), "10.1.0.0/28", max_blocks_per_host=1))
    assert len(a.block_usage()) == 1
    # another node's block with room can be borrowed from, unless strict
    b = small(mem_store, "node-b", pool="10.1.0.0/28")
    b.assign(sreq(hid("b"), "10.1.0.0/28"))
    borrowed = a.assign(sreq(hid(4), "10.1.0.0/28", max_blocks_per_host=1))[0]
    assert a.who_owns(borrowed.ip).node == "node-b"  # type: ignore[union-attr]
    with pytest.raises(NoAddressAvailable):
        a.assign(sreq(hid(5), "10.1.0.0/28", max_blocks_per_host=1, strict_affinity=True))
    # without the limit node-a claims a second block
    c = a.assign(sreq(hid(6), "10.1.0.0/28"))[0]
    assert a.who_owns(c.ip).node == "node-a"  # type: ignore[union-attr]
    assert len([u for u in a.block_usage() if u.node == "node-a"]) == 2


def test_reserved_addresses_are_never_handed_out(mem_store: MemoryStore) -> None:
    ipam = small(mem_store, pool="10.1.0.0/28")
    reserved = ["10.1.0.0/30", "10.1.0.5", "10.1.0.15"]
    got = [ipam.assign(sreq(hid(i), "10.1.0.0/28", reserved=reserved))[0] for i in range(10)]
    ips = {str(a.ip) for a in got}
    assert len(ips) == 10
    assert not ips & {"10.1.0.0", "10.1.0.1", "10.1.0.2", "10.1.0.3", "10.1.0.5", "10.1.0.15"}
    with pytest.raises(NoAddressAvailable):
        ipam.assign(sreq(hid(10), "10.1.0.0/28", reserved=reserved))
    # the wholly reserved block was never claimed
    assert "10.1.0.0/30" not in mem_store.list_keys("block")
    (usage,) = ipam.pool_usage(reserved)
    assert (usage.total, usage.in_use, usage.reserved, usage.free) == (16, 10, 6, 0)
    assert all(b.free == 0 for b in ipam.block_usage(reserved))


def test_stale_full_hint_is_rescanned_before_exhaustion(mem_store: MemoryStore) -> None:
    ipam = small(mem_store)
    got = [ipam.assign(sreq(hid(i)))[0] for i in range(8)]
    ipam.release_handle(hid(5))
    # simulate a kill between the block write and the hint update: the hint says full
    doc = mem_store.get("affinity", "node-a")
    assert doc is not None
    doc.data["avail"] = []  # every block hinted full
    mem_store.put("affinity", "node-a", doc.data, doc.revision)
    again = ipam.assign(sreq(hid(9), strict_affinity=True))[0]
    assert again.ip == got[5].ip
    assert check_consistency(mem_store) == []


def test_release_from_a_full_block_makes_it_preferred_again(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    got = [ipam.assign(req(hid(i)))[0] for i in range(20)]  # block 1 full, block 2 has 4
    first_block = got[0].block_cidr
    aff = mem_store.get("affinity", "node-a")
    assert aff is not None
    assert str(first_block) not in aff.data["avail"]
    ipam.release_handle(hid(3))
    aff = mem_store.get("affinity", "node-a")
    assert aff is not None
    assert str(first_block) in aff.data["avail"]
    assert ipam.assign(req(hid(50)))[0].ip == got[3].ip


def test_disabled_pool_serves_no_new_address(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    ipam.ensure_pools([PoolSpec("10.5.0.0/24", 28)])
    kept = ipam.assign(req(hid(1)))[0]
    ipam.set_pool_disabled(V4, True)
    with pytest.raises(NoAddressAvailable, match="disabled"):
        ipam.assign(req(hid(2)))
    other = ipam.assign(req(hid(2), v4_pools=[V4, "10.5.0.0/24"]))[0]
    assert other.ip in ipaddress.ip_network("10.5.0.0/24")
    with pytest.raises(AddressUnavailable, match="disabled"):
        ipam.assign(req(hid(3), specific_ips=["10.0.0.200"]))
    assert ipam.get_handle(hid(1)) == [kept]  # existing allocations stay
    ipam.set_pool_disabled(V4, False)
    assert ipam.assign(req(hid(4)))[0].ip in ipaddress.ip_network(V4)


def test_pools_per_request(mem_store: MemoryStore) -> None:
    """The pod-annotation case: the request names the pools."""
    ipam = setup(mem_store)
    ipam.ensure_pools([PoolSpec("10.7.0.0/24", 26), PoolSpec("fd07::/120", 124)])
    v4, v6 = ipam.assign(
        req(hid(1), want_v6=True, v4_pools=["10.7.0.0/24"], v6_pools=["fd07::/120"])
    )
    assert v4.ip in ipaddress.ip_network("10.7.0.0/24")
    assert v6.ip in ipaddress.ip_network("fd07::/120")
    assert v4.block_cidr.prefixlen == 26
    with pytest.raises(InvalidConfig, match="not found"):
        ipam.assign(req(hid(2), v4_pools=["10.8.0.0/24"]))
    with pytest.raises(InvalidConfig, match="not an IPv4 pool"):
        ipam.assign(req(hid(2), v4_pools=["fd07::/120"]))
    with pytest.raises(InvalidConfig, match="no IPv4 pool"):
        ipam.assign(req(hid(2), v4_pools=[]))


# -- specific addresses -----------------------------------------------------------------


def test_specific_ips(store: Store) -> None:
    ipam = setup(store)
    got = ipam.assign(req(hid(1), specific_ips=["10.0.0.77", ipaddress.ip_address("fd00::33")]))
    assert [str(a.ip) for a in got] == ["10.0.0.77", "fd00::33"]
    assert str(got[0].block_cidr) == "10.0.0.64/28"
    (blk,) = [u for u in ipam.block_usage() if u.cidr == "10.0.0.64/28"]
    assert blk.node == "node-a"  # the unclaimed block was claimed
    # auto-assign afterwards uses that affine block, never the taken address
    nxt = ipam.assign(req(hid(2)))[0]
    assert nxt.block_cidr == got[0].block_cidr
    assert nxt.ip != got[0].ip
    assert check_consistency(store) == []


@pytest.mark.parametrize(
    ("ips", "match"),
    [
        (["10.0.0.10", "10.0.0.77"], "in use"),
        (["10.0.0.11", "10.0.0.1"], "reserved"),
        (["10.0.0.12", "192.168.0.1"], "outside every pool"),
        (["10.0.0.13", "fd01::1"], "outside every pool"),
    ],
)
def test_specific_ip_unavailable_allocates_nothing(
    mem_store: MemoryStore, ips: list[str], match: str
) -> None:
    ipam = setup(mem_store)
    ipam.assign(req(hid(1), specific_ips=["10.0.0.77"]))
    before = check_consistency(mem_store), in_use(ipam)
    with pytest.raises(AddressUnavailable, match=match):
        ipam.assign(req(hid(2), specific_ips=ips, reserved=["10.0.0.0/30"]))
    assert ipam.get_handle(hid(2)) == []
    assert mem_store.get("handle", hid(2)) is None
    assert (check_consistency(mem_store), in_use(ipam)) == before


def test_specific_ip_in_another_nodes_block(mem_store: MemoryStore) -> None:
    a = setup(mem_store, "node-a")
    first = a.assign(req(hid(1)))[0]
    wanted = first.ip + 1
    b = Ipam(mem_store, "node-b")
    with pytest.raises(AddressUnavailable, match="strict"):
        b.assign(req(hid(2), specific_ips=[wanted], strict_affinity=True))
    got = b.assign(req(hid(2), specific_ips=[wanted]))[0]
    assert got.ip == wanted
    assert got.block_cidr == first.block_cidr
    assert a.who_owns(wanted).node == "node-a"  # type: ignore[union-attr]


def test_specific_ips_in_one_block(store: Store) -> None:
    ipam = setup(store)
    got = ipam.assign(req(hid(1), specific_ips=["10.0.0.20", "10.0.0.21", "10.0.0.30"]))
    assert [str(a.ip) for a in got] == ["10.0.0.20", "10.0.0.21", "10.0.0.30"]
    assert len({a.block_cidr for a in got}) == 1
    assert ipam.get_handle(hid(1)) == got
    assert ipam.release_handle(hid(1)) == got
    assert check_consistency(store) == []


def test_repeated_assign_needs_no_pool(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    first = ipam.assign(req(hid(1)))
    assert ipam.assign(req(hid(1), v4_pools=["10.99.0.0/24"])) == first


def test_specific_ip_duplicate_is_invalid(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    with pytest.raises(InvalidConfig, match="twice"):
        ipam.assign(req(hid(1), specific_ips=["10.0.0.5", "10.0.0.5"]))


# -- pools ----------------------------------------------------------------------------


def test_ensure_pools_validation(mem_store: MemoryStore) -> None:
    ipam = Ipam(mem_store, "node-a")
    ipam.ensure_pools([PoolSpec("10.0.0.0/16", 26)])
    ipam.ensure_pools([PoolSpec("10.0.0.0/16", 24)])  # exists: stored block size wins
    doc = mem_store.get("pool", "10.0.0.0/16")
    assert doc is not None
    assert doc.data == {
        "cidr": "10.0.0.0/16",
        "block_size": 26,
        "disabled": False,
    }
    with pytest.raises(InvalidConfig, match="overlaps"):
        ipam.ensure_pools([PoolSpec("10.0.128.0/17", 26)])
    with pytest.raises(InvalidConfig, match="overlap"):
        ipam.ensure_pools([PoolSpec("10.9.0.0/16"), PoolSpec("10.9.0.0/24")])
    with pytest.raises(InvalidConfig, match="smaller than one block"):
        ipam.ensure_pools([PoolSpec("10.8.0.0/28", 26)])
    with pytest.raises(InvalidConfig, match="block size"):
        ipam.ensure_pools([PoolSpec("fd00::/48", 64)])
    assert mem_store.list_keys("pool") == ["10.0.0.0/16"]


def test_pool_admin(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    ipam.add_pool(PoolSpec("10.6.0.0/24", 28))
    with pytest.raises(InvalidConfig):
        ipam.add_pool(PoolSpec("10.6.0.0/25", 28))
    a = ipam.assign(req(hid(1), v4_pools=["10.6.0.0/24"]))[0]
    with pytest.raises(InvalidConfig, match="in use"):
        ipam.delete_pool("10.6.0.0/24")
    ipam.release_handle(hid(1))
    assert ipam.delete_pool("10.6.0.0/24") == 1
    assert [p.cidr for p in ipam.list_pools()] == [V4, V6]
    assert str(a.block_cidr) not in mem_store.list_keys("block")
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
    assert store.list_keys("handle") == sorted([hid("a"), hid("d", net="other")])
    assert in_use(ipam) == 2
    # an empty valid list means everything of this network is stale
    assert ipam.gc("net", set(), grace_seconds=0).released == [hid("a")]
    assert store.list_keys("handle") == [hid("d", net="other")]
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
    ipam = setup(mem_store)
    for n in range(3):
        ipam.assign(req(hid(n)))
    mem_store.corrupt("handle", hid(1))
    report = ipam.gc("net", set(), grace_seconds=0)
    assert sorted(report.released) == [hid(0), hid(2)]
    assert len(report.errors) == 1
    assert hid(1) in report.errors[0]


def test_gc_leaves_other_nodes_handles(mem_store: MemoryStore) -> None:
    setup(mem_store, "node-a").assign(req(hid("a")))
    Ipam(mem_store, "node-b").assign(req(hid("b")))
    report = Ipam(mem_store, "node-a").gc("net", set(), grace_seconds=0)
    assert report.released == [hid("a")]
    assert mem_store.list_keys("handle") == [hid("b")]


# -- failures and crashes ---------------------------------------------------------------


class Crash(BaseException):
    """The process died: nothing after this point happens."""


class DyingStore:
    """Passes through to ``inner`` until the ``die_at``-th write, then every call fails."""

    def __init__(self, inner: Store, die_at: int | None = None) -> None:
        self.inner = inner
        self.die_at = die_at
        self.writes = 0
        self.dead = False

    def _write(self) -> None:
        self.writes += 1
        if self.dead or (self.die_at is not None and self.writes >= self.die_at):
            self.dead = True
            raise Crash

    def _alive(self) -> None:
        if self.dead:
            raise Crash

    def lock(self) -> AbstractContextManager[None]:
        self._alive()
        return self.inner.lock()

    def get(self, kind: str, key: str) -> Doc | None:
        self._alive()
        return self.inner.get(kind, key)

    def list_keys(self, kind: str) -> list[str]:
        self._alive()
        return self.inner.list_keys(kind)

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        self._write()
        return self.inner.put(kind, key, data, expected_revision)

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        self._write()
        self.inner.delete(kind, key, expected_revision)

    def check_usable(self) -> None:
        self._alive()

    def location(self, kind: str, key: str) -> str:
        return self.inner.location(kind, key)


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
    assert inner.list_keys("handle") == []
    _v4, _v6 = ipam.assign(req(hid(1), want_v6=True))
    # leftovers are repaired when touched: the orphan block was adopted, not doubled
    assert len([u for u in ipam.block_usage() if u.pool == V4]) == 1
    ipam.gc("net", set(), grace_seconds=0)
    assert in_use(ipam) == 0
    assert check_consistency(inner) == []


def test_kill_between_handle_and_block_write_then_add_again() -> None:
    inner = MemoryStore()
    ipam = setup(inner)
    ipam.assign(req(hid(0)))  # the block exists already: this ADD writes handle, block
    dying = DyingStore(inner, die_at=2)
    with pytest.raises(Crash):
        Ipam(dying, "node-a").assign(req(hid(1)))
    problems = check_consistency(inner)
    assert [(p.severity, p.kind) for p in problems] == [("leftover", "handle-extra-block")]
    assert ipam.get_handle(hid(1)) == []
    a = ipam.assign(req(hid(1)))[0]  # the retried ADD repairs the handle
    assert ipam.get_handle(hid(1)) == [a]
    assert check_consistency(inner) == []


class FailingStore(DyingStore):
    """Fails one chosen write with a StoreUnavailable (an I/O error, not a crash)."""

    def __init__(self, inner: Store, fail_kind: str, fail_key_part: str) -> None:
        super().__init__(inner)
        self.fail_kind = fail_kind
        self.fail_key_part = fail_key_part

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        if kind == self.fail_kind and self.fail_key_part in key:
            raise StoreUnavailable(key, "disk full")
        return self.inner.put(kind, key, data, expected_revision)


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


# -- readiness ------------------------------------------------------------------------


def _snapshot(store: MemoryStore) -> dict[str, dict[str, Any]]:
    return {
        kind: {k: store.get(kind, k) for k in store.list_keys(kind)}
        for kind in ("pool", "block", "handle", "affinity")
    }


def test_can_allocate(mem_store: MemoryStore) -> None:
    ipam = Ipam(mem_store, "node-a")
    kw: dict[str, Any] = {
        "need_v4": True,
        "need_v6": False,
        "strict_affinity": True,
        "max_blocks_per_host": 0,
        "reserved": [],
    }
    assert ipam.can_allocate(["10.1.0.0/29"], [], **kw, block_size_v4=30) is None  # fresh: ready
    why = ipam.can_allocate(["10.1.0.0/29"], [], **kw)  # a /26 does not fit: not ready
    assert why is not None
    assert "smaller than one block" in why
    ipam.ensure_pools([PoolSpec("10.1.0.0/29", 30)])
    for i in range(8):
        ipam.assign(sreq(hid(i), strict_affinity=True))
    before = _snapshot(mem_store)
    why = ipam.can_allocate(["10.1.0.0/29"], [], **kw)
    assert why is not None
    assert "no free IPv4 address" in why
    assert _snapshot(mem_store) == before  # read-only
    ipam.release_handle(hid(4))
    assert ipam.can_allocate(["10.1.0.0/29"], [], **kw) is None
    # a reserved free address does not count
    ip = ipam.assign(sreq(hid(4), strict_affinity=True))[0].ip
    ipam.release_ip(ip)
    assert ipam.can_allocate(["10.1.0.0/29"], [], **{**kw, "reserved": [str(ip)]}) is not None
    mem_store.unusable = "disk gone"
    assert "disk gone" in (ipam.can_allocate(["10.1.0.0/29"], [], **kw) or "")


def test_can_allocate_counts_borrowing_and_limits(mem_store: MemoryStore) -> None:
    a = small(mem_store, "node-a")
    b = Ipam(mem_store, "node-b")
    a.assign(sreq(hid("a")))
    for i in range(4):
        b.assign(sreq(hid(f"b{i}")))
    kw: dict[str, Any] = {"need_v4": True, "need_v6": False, "reserved": []}
    assert (
        b.can_allocate(["10.1.0.0/29"], [], strict_affinity=False, max_blocks_per_host=0, **kw)
        is None
    )
    assert b.can_allocate(["10.1.0.0/29"], [], strict_affinity=True, max_blocks_per_host=0, **kw)
    fresh = Ipam(mem_store, "node-c")
    assert fresh.can_allocate(
        ["10.1.0.0/29"], [], strict_affinity=True, max_blocks_per_host=0, **kw
    )


# -- cost -----------------------------------------------------------------------------


class CountingStore(DyingStore):
    def __init__(self, inner: Store) -> None:
        super().__init__(inner)
        self.gets = 0
        self.lists = 0

    def get(self, kind: str, key: str) -> Doc | None:
        self.gets += 1
        return self.inner.get(kind, key)

    def list_keys(self, kind: str) -> list[str]:
        self.lists += 1
        return self.inner.list_keys(kind)


@pytest.fixture
def full_pool() -> tuple[MemoryStore, Ipam]:
    """A /20 of /26 blocks (64 blocks) filled to ~95% by one node."""
    store = MemoryStore()
    ipam = Ipam(store, "node-a")
    ipam.ensure_pools([PoolSpec("10.20.0.0/20", 26)])
    for i in range(int(4096 * 0.95)):
        ipam.assign(req(hid(i), v4_pools=["10.20.0.0/20"]))
    return store, ipam


def test_cost_is_flat_at_high_occupancy(full_pool: tuple[MemoryStore, Ipam]) -> None:
    store, _ = full_pool
    counting = CountingStore(store)
    ipam = Ipam(counting, "node-a")
    for i in range(40):
        ipam.assign(req(hid(f"x{i}"), v4_pools=["10.20.0.0/20"]))
        ipam.release_handle(hid(f"x{i}"))
    # a handful of documents per operation, never a scan of the 64 blocks
    assert counting.gets / 40 <= 12
    assert counting.lists == 0
    assert counting.writes / 40 <= 5
