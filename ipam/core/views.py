"""Read-only views: lookups (CHECK, who owns an address) and the operator's usage tables."""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence

from bundle.types import IPAddress, IPNetwork
from ipam.core.docs import Docs, Op, family
from ipam.core.model import (
    Allocation,
    Reserved,
    parse_ip,
    split_handle_id,
)
from ipam.core.pooladmin import list_pools
from ipam.core.reports import BlockUsage, IpOwner, PoolUsage


def get_handle(docs: Docs, handle_id: str) -> list[Allocation]:
    """The handle's addresses: in this node's index (every block without a node, or while
    the node's index is of format 1: an older tabby's handle document may list more)."""
    split_handle_id(handle_id)
    if docs.node:
        aff = docs.my_affinity(Op())
        if not aff.legacy:
            return docs.held(handle_id, aff.indexed())
    return docs.held(handle_id, [blk.cidr for blk, _rev in docs.scan_blocks()])


def who_owns(docs: Docs, ip: IPAddress | str) -> IpOwner | None:
    addr = parse_ip(ip)
    cidr = docs.block_cidr_for(addr)
    got = docs.block(cidr) if cidr else None
    if got is None:
        return None
    blk = got[0]
    a = blk.allocations[blk.ordinal(addr)]
    if a is None:
        return None
    return IpOwner(addr, blk.cidr, blk.node, a["handle"], a["seq"], dict(a.get("attrs", {})))


def pool_usage(docs: Docs, reserved: Sequence[str | IPNetwork | IPAddress]) -> list[PoolUsage]:
    res = Reserved.parse(reserved)
    pools = list_pools(docs)
    in_use: dict[str, int] = {p.cidr: 0 for p in pools}
    reserved_used: dict[str, int] = {p.cidr: 0 for p in pools}
    blocks: dict[str, int] = {p.cidr: 0 for p in pools}
    for blk, _rev in docs.all_blocks():
        if blk.pool not in in_use:
            continue
        blocks[blk.pool] += 1
        for o, a in enumerate(blk.allocations):
            if a is not None:
                in_use[blk.pool] += 1
                if res.contains(blk.ip(o)):
                    reserved_used[blk.pool] += 1
    out = []
    for p in pools:
        lo = int(p.network.network_address)
        hi = int(p.network.broadcast_address)
        total = p.network.num_addresses
        resv = res.count(p.version, lo, hi) - reserved_used[p.cidr]
        out.append(
            PoolUsage(
                p.cidr,
                p.block_size,
                p.disabled,
                total,
                in_use[p.cidr],
                resv,
                total - in_use[p.cidr] - resv,
                blocks[p.cidr],
            )
        )
    return out


def block_usage(docs: Docs, reserved: Sequence[str | IPNetwork | IPAddress]) -> list[BlockUsage]:
    res = Reserved.parse(reserved)
    out = [
        BlockUsage(blk.cidr, blk.pool, blk.node, blk.in_use(), blk.usable_count(res))
        for blk, _rev in docs.all_blocks()
    ]
    out.sort(key=lambda b: (family(b.cidr), int(ipaddress.ip_network(b.cidr).network_address)))
    return out


def allocations(docs: Docs) -> list[IpOwner]:
    out = [
        IpOwner(blk.ip(o), blk.cidr, blk.node, a["handle"], a["seq"], dict(a.get("attrs", {})))
        for blk, _rev in docs.all_blocks()
        for o, a in enumerate(blk.allocations)
        if a is not None
    ]
    out.sort(key=lambda x: (x.ip.version, int(x.ip)))
    return out
