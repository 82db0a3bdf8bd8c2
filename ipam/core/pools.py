"""Pool arithmetic: where a node starts looking for a block, and the claim walk.

Each node walks a pool's blocks in index order from its own start (a hash of node name and
pool), so nodes rarely race for the same block and a node's blocks tend to be contiguous.
The affinity document remembers where the walk stopped (``cursor``), so a claim usually
tries one candidate; that cursor is a hint only, the walk still covers every block once.
"""

from __future__ import annotations

from collections.abc import Iterator

from ipam.core.model import Pool, Reserved

_FNV_OFFSET = 0xCBF29CE484222325
_FNV_PRIME = 0x100000001B3
_MASK64 = (1 << 64) - 1


def node_seed(node: str, pool: str) -> int:
    """A stable 64-bit hash of (node, pool): FNV-1a, then a splitmix64 finaliser."""
    h = _FNV_OFFSET
    for b in f"{node}\0{pool}".encode():
        h = ((h ^ b) * _FNV_PRIME) & _MASK64
    h ^= h >> 30
    h = (h * 0xBF58476D1CE4E5B9) & _MASK64
    h ^= h >> 27
    h = (h * 0x94D049BB133111EB) & _MASK64
    h ^= h >> 31
    return h


def start_index(node: str, pool: Pool) -> int:
    return node_seed(node, pool.cidr) % pool.block_count


def walk(pool: Pool, start: int, reserved: Reserved) -> Iterator[int]:
    """Block indexes from ``start``, wrapping, each at most once, skipping blocks that are
    wholly reserved (a whole reserved range is jumped over at once, so a reserved /64 in a
    /48 IPv6 pool costs one step, not 2**58)."""
    n = pool.block_count
    step = pool.block_addresses
    base = int(pool.network.network_address)
    version = pool.version
    k = 0
    while k < n:
        idx = (start + k) % n
        lo = base + idx * step
        end = reserved.covering(version, lo, lo + step - 1)
        if end is None:
            yield idx
            k += 1
            continue
        # the last block wholly inside the reserved range (at least idx itself)
        last = min((end - base + 1) // step - 1, n - 1)
        k += last - idx + 1
