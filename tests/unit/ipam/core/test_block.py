"""Block, pool and reserved-range arithmetic (pure, no store)."""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import Any

import pytest

from ipam.core import InvalidConfig, handle_id, split_handle_id
from ipam.core.block import Block
from ipam.core.errors import StoreCorrupt
from ipam.core.model import Pool, Reserved
from ipam.core.pools import node_seed, start_index, walk

NONE = Reserved.parse(())


def is_full(blk: Block) -> bool:  # a call, so mypy does not narrow the attribute
    return blk.full


@pytest.mark.parametrize(
    ("cidr", "size", "last"),
    [
        ("10.244.3.64/26", 64, "10.244.3.127"),
        ("10.244.16.0/20", 4096, "10.244.31.255"),
        ("10.244.0.7/32", 1, "10.244.0.7"),
        ("fd00:10:244::40/122", 64, "fd00:10:244::7f"),
        ("fd00::5/128", 1, "fd00::5"),
        ("fd00::/116", 4096, "fd00::fff"),
        ("::/120", 256, "::ff"),  # low IPv6 addresses stay IPv6
    ],
)
def test_block_arithmetic(cidr: str, size: int, last: str) -> None:
    net = ipaddress.ip_network(cidr)
    blk = Block.new(net, "pool", "node-a")
    assert blk.size == size
    assert blk.ip(0) == net.network_address
    assert blk.ip(size - 1) == ipaddress.ip_address(last)
    assert blk.ip(size - 1).version == net.version
    for o in (0, size // 2, size - 1):
        assert blk.ordinal(blk.ip(o)) == o
    assert blk.unallocated == list(range(size))
    assert blk.node == "node-a"
    with pytest.raises(ValueError, match="not in block"):
        blk.ordinal(net.broadcast_address + 1)
    other = ipaddress.ip_address("1.2.3.4") if net.version == 6 else ipaddress.ip_address("::1")
    with pytest.raises(ValueError, match="not in block"):
        blk.ordinal(other)


def test_fifo_reuse_longest_free_first() -> None:
    blk = Block.new(ipaddress.ip_network("10.0.0.0/30"), "p", "n")
    for o in range(4):
        assert blk.first_usable(NONE) == o
        blk.assign(o, f"h{o}", {}, NONE)
    assert blk.first_usable(NONE) is None
    assert is_full(blk)
    blk.release(2)
    blk.release(0)
    assert not is_full(blk)
    assert blk.unallocated == [2, 0]
    assert blk.first_usable(NONE) == 2  # released first, reused first
    blk.assign(2, "h9", {}, NONE)
    blk.release(1)
    assert blk.unallocated == [0, 1]  # a released ordinal goes to the back


def test_seq_increments_on_every_assign() -> None:
    blk = Block.new(ipaddress.ip_network("10.0.0.0/30"), "p", "n")
    assert blk.assign(0, "a", {}, NONE) == 1
    assert blk.assign(1, "b", {}, NONE) == 2
    blk.release(0)
    assert blk.assign(0, "c", {}, NONE) == 3
    assert blk.allocations[0] == {"handle": "c", "seq": 3, "attrs": {}}
    with pytest.raises(ValueError, match="in use"):
        blk.assign(0, "d", {}, NONE)


def test_reserved_ordinals_are_skipped() -> None:
    blk = Block.new(ipaddress.ip_network("10.0.0.0/29"), "p", "n")
    res = Reserved.parse(["10.0.0.0/31", ipaddress.ip_address("10.0.0.3"), "10.0.0.7"])
    assert blk.first_usable(res) == 2
    assert blk.usable_count(res) == 4
    for o in (2, 4, 5):
        blk.assign(o, "h", {}, res)
        assert not is_full(blk)
    blk.assign(6, "h", {}, res)
    assert is_full(blk)  # the remaining free ordinals are all reserved
    assert blk.first_usable(res) is None
    assert blk.first_usable(NONE) == 0


def test_first_usable_never_returns_an_allocated_ordinal() -> None:
    blk = Block.new(ipaddress.ip_network("10.0.0.0/30"), "p", "n")
    blk.assign(0, "h", {}, NONE)
    blk.unallocated.insert(0, 0)  # a corrupt FIFO still must not double-allocate
    assert blk.first_usable(NONE) == 1


def test_block_roundtrip_and_copy_is_independent() -> None:
    blk = Block.new(ipaddress.ip_network("fd00::/126"), "fd00::/120", "node-b")
    blk.assign(1, "n:c:eth0", {"pod": "x"}, NONE)
    again = Block.from_data(blk.to_data(), "where")
    assert again.to_data() == blk.to_data()
    cp = blk.copy()
    cp.assign(0, "other", {}, NONE)
    assert blk.allocations[0] is None
    assert blk.unallocated == [0, 2, 3]
    assert blk.ordinals_of("n:c:eth0") == [1]


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("cidr"),
        lambda d: d.__setitem__("cidr", "10.0.0.1/30"),
        lambda d: d.__setitem__("allocations", [None]),
        lambda d: d.__setitem__("unallocated", [9]),
        lambda d: d.__setitem__("seq", "1"),
        lambda d: d.__setitem__("affinity", 5),
        lambda d: d["allocations"].__setitem__(0, {"handle": 1, "seq": 1}),
        lambda d: d.__setitem__("full", "no"),
    ],
)
def test_malformed_block_is_store_corrupt(mutate: Callable[[dict[str, Any]], object]) -> None:
    data = Block.new(ipaddress.ip_network("10.0.0.0/30"), "p", "n").to_data()
    mutate(data)
    with pytest.raises(StoreCorrupt) as info:
        Block.from_data(data, "/x/blocks/10.0.0.0%2F30.json")
    assert info.value.path == "/x/blocks/10.0.0.0%2F30.json"


@pytest.mark.parametrize(
    ("cidr", "block_size", "count"),
    [
        ("10.244.0.0/16", 26, 1024),
        ("10.244.0.0/16", 20, 16),
        ("10.244.0.0/24", 32, 256),
        ("fd00:10:244::/48", 122, 2**74),
        ("fd00::/120", 128, 256),
        ("fd00::/116", 116, 1),
    ],
)
def test_pool_blocks(cidr: str, block_size: int, count: int) -> None:
    pool = Pool.from_spec(cidr, block_size)
    assert pool.block_count == count
    first = pool.block_network(0)
    last = pool.block_network(count - 1)
    assert first.network_address == pool.network.network_address
    assert last.broadcast_address == pool.network.broadcast_address
    assert first.prefixlen == block_size
    assert pool.block_index(last.network_address) == count - 1
    assert pool.block_index(pool.network.broadcast_address) == count - 1


@pytest.mark.parametrize(
    ("cidr", "size", "match"),
    [
        ("10.0.0.0/16", 19, "block size"),
        ("10.0.0.0/16", 33, "block size"),
        ("fd00::/48", 115, "block size"),
        ("fd00::/48", 129, "block size"),
        ("10.0.0.0/27", 26, "smaller than one block"),
        ("fd00::/123", 122, "smaller than one block"),
        ("10.0.0.1/16", 26, "pool CIDR"),
        ("nonsense", 26, "pool CIDR"),
    ],
)
def test_invalid_pools(cidr: str, size: int, match: str) -> None:
    with pytest.raises(InvalidConfig, match=match):
        Pool.from_spec(cidr, size)


def test_default_block_sizes() -> None:
    assert Pool.from_spec("10.0.0.0/16", None).block_size == 26
    assert Pool.from_spec("fd00::/48", None).block_size == 122


def test_reserved_parse_merges_and_counts() -> None:
    res = Reserved.parse(["10.0.0.0/30", "10.0.0.4", " 10.0.0.2/31 ", "fd00::1", "10.0.1.0/24"])
    assert res.ranges[4] == [
        (int(ipaddress.ip_address("10.0.0.0")), int(ipaddress.ip_address("10.0.0.4"))),
        (int(ipaddress.ip_address("10.0.1.0")), int(ipaddress.ip_address("10.0.1.255"))),
    ]
    lo = int(ipaddress.ip_address("10.0.0.0"))
    assert res.count(4, lo, lo + 255) == 5
    assert res.count(4, lo, lo + 511) == 5 + 256
    assert res.contains(ipaddress.ip_address("fd00::1"))
    assert not res.contains(ipaddress.ip_address("10.0.0.5"))
    with pytest.raises(InvalidConfig):
        Reserved.parse(["10.0.0.300"])


def test_walk_covers_every_block_once_from_any_start() -> None:
    pool = Pool.from_spec("10.0.0.0/24", 28)
    for start in (0, 7, 15):
        seen = list(walk(pool, start, NONE))
        assert seen[0] == start
        assert sorted(seen) == list(range(16))


def test_walk_skips_wholly_reserved_blocks_only() -> None:
    pool = Pool.from_spec("10.0.0.0/24", 28)
    # blocks 0-1 wholly reserved, block 2 partly (10.0.0.32-10.0.0.40), 15 wholly
    res = Reserved.parse(["10.0.0.0/27", "10.0.0.32/29", "10.0.0.40", "10.0.0.240/28"])
    assert list(walk(pool, 0, res)) == list(range(2, 15))
    assert list(walk(pool, 14, res)) == [14, *range(2, 14)]


def test_walk_jumps_a_huge_reserved_range_at_once() -> None:
    pool = Pool.from_spec("fd00::/48", 122)
    res = Reserved.parse(["fd00::/64"])
    first = next(iter(walk(pool, 0, res)))
    assert pool.block_network(first) == ipaddress.ip_network("fd00:0:0:1::/122")


def test_node_seed_is_stable_and_spreads() -> None:
    assert node_seed("node-a", "10.244.0.0/16") == node_seed("node-a", "10.244.0.0/16")
    pool = Pool.from_spec("10.244.0.0/16", 26)
    starts = {start_index(f"node-{i}", pool) for i in range(50)}
    assert len(starts) >= 45  # few collisions among 1024 candidates
    assert all(0 <= s < 1024 for s in starts)


def test_handle_id_roundtrip_and_validation() -> None:
    hid = handle_id("k8s-pod-network", "abc123", "eth0")
    assert hid == "k8s-pod-network:abc123:eth0"
    assert split_handle_id(hid) == ("k8s-pod-network", "abc123", "eth0")
    for bad in (("", "c", "i"), ("n", "c:d", "i"), ("n", "c", ""), ("n", "c", "a:b")):
        with pytest.raises(InvalidConfig):
            handle_id(*bad)
    for bad_id in ("a:b", "a:b:c:d", "a::c"):
        with pytest.raises(InvalidConfig):
            split_handle_id(bad_id)


@pytest.mark.parametrize("cidr", [False, True, 5, None, ["10.0.0.0/26"]])
def test_a_cidr_that_is_not_text_is_a_corrupt_block(cidr: object) -> None:
    """Found by fuzzing (tests/fuzz/documents.py): ip_network() reads an int or a bool as
    a /32, so a block document with ``"cidr": false`` was the block 0.0.0.0/32."""
    data = Block.new(ipaddress.ip_network("10.0.0.0/30"), "10.0.0.0/16", "n").to_data()
    data["cidr"] = cidr
    with pytest.raises(StoreCorrupt, match="cidr"):
        Block.from_data(data, "block 10.0.0.0/30")
