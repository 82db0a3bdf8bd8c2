"""Readiness (CNI STATUS): could an ADD on this node get its addresses now? Read-only, no
lock; the same candidate generator as assignment decides."""

from __future__ import annotations

from collections.abc import Sequence

from bundle.types import IPAddress, IPNetwork
from ipam.core.candidates import Candidates
from ipam.core.docs import Docs
from ipam.core.errors import InvalidConfig, StoreError
from ipam.core.model import Pool, Reserved, parse_network


def can_allocate(
    docs: Docs,
    v4_pools: Sequence[str],
    v6_pools: Sequence[str],
    *,
    need_v4: bool,
    need_v6: bool,
    strict_affinity: bool,
    max_blocks_per_host: int,
    reserved: Sequence[str | IPNetwork | IPAddress],
    block_size_v4: int | None = None,
    block_size_v6: int | None = None,
) -> str | None:
    if (need_v4 or need_v6) and not docs.node:
        raise InvalidConfig("the node name is required")
    try:
        docs.store.check_usable()
        res = Reserved.parse(reserved)
        for fam, cidrs, need, bs in (
            (4, v4_pools, need_v4, block_size_v4),
            (6, v6_pools, need_v6, block_size_v6),
        ):
            if need:
                why = _family_ready(
                    docs, fam, cidrs, bs, bool(strict_affinity), max_blocks_per_host, res
                )
                if why:
                    return why
    except (StoreError, InvalidConfig) as e:
        return str(e)
    return None


def _family_ready(
    docs: Docs,
    fam: int,
    cidrs: Sequence[str],
    block_size: int | None,
    strict: bool,
    max_blocks: int,
    reserved: Reserved,
) -> str | None:
    pools: list[Pool] = []
    for text in cidrs:
        net = parse_network(text, "pool CIDR")
        # A configured pool the store lacks counts as a fresh one (the ADD creates it).
        pool = docs.pool(str(net)) or Pool.from_spec(str(net), block_size)
        if not pool.disabled:
            pools.append(pool)
    if not pools:
        return f"no enabled IPv{fam} pool"
    aff = docs.affinity(docs.node)[0]
    cands = Candidates(
        docs, fam, pools, reserved, strict=strict, max_blocks=max_blocks, aff=lambda: aff
    )
    if any(c.usable() for c in cands):
        return None
    in_pools = sorted(p.cidr for p in pools)
    why = f"no free IPv{fam} address for node {docs.node} in {', '.join(in_pools)}"
    if cands.limited:
        why += f" (max_blocks_per_host {max_blocks} reached)"
    if strict:
        why += " (strict_affinity)"
    return why
