"""Assignment: affine blocks, claims, exhaustion, borrowing, limits, specific addresses."""

from __future__ import annotations

import ipaddress

import pytest

from datastore.base import Store
from datastore.memory import MemoryStore
from ipam.core import (
    AddressUnavailable,
    InvalidConfig,
    Ipam,
    NoAddressAvailable,
    PoolSpec,
    check_consistency,
)

from .helpers import V4, V6, hid, in_use, req, setup, small, sreq

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


def test_exhaustion_and_recovery(mem_store: MemoryStore) -> None:
    ipam = small(mem_store)
    got = [ipam.assign(sreq(hid(i)))[0] for i in range(8)]
    assert len({a.ip for a in got}) == 8
    with pytest.raises(NoAddressAvailable):
        ipam.assign(sreq(hid(8)))
    assert ipam.get_handle(hid(8)) == []
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


def test_a_released_address_in_a_full_block_is_handed_out_again(mem_store: MemoryStore) -> None:
    """No hint decides where room is: the node's own blocks are read in claim order, so a
    release in the first (full) block is found by the next ADD, before the second block."""
    ipam = setup(mem_store)
    got = [ipam.assign(req(hid(i)))[0] for i in range(20)]  # block 1 full, block 2 has 4
    assert got[15].block_cidr == got[0].block_cidr != got[16].block_cidr
    ipam.release_handle(hid(3))
    assert ipam.assign(req(hid(50)))[0].ip == got[3].ip
    assert check_consistency(mem_store) == []


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
