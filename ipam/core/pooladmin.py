"""Pool administration: create (from the configuration or an operator), disable, delete."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ipam.core import affinity
from ipam.core.block import Block
from ipam.core.cas import cas, update
from ipam.core.docs import INFO, WARNING, Docs, Op, family, inside, log
from ipam.core.errors import InvalidConfig
from ipam.core.model import Pool, PoolSpec, parse_network

if TYPE_CHECKING:
    from ipam.store.base import Doc


def ensure_pools(docs: Docs, specs: Sequence[PoolSpec]) -> None:
    wanted: dict[str, Pool] = {}
    for spec in specs:
        pool = Pool.from_spec(spec.cidr, spec.block_size, spec.disabled)
        other = wanted.get(pool.cidr)
        if other is not None and other.block_size != pool.block_size:
            raise InvalidConfig("pool configured twice", pool.cidr)
        wanted[pool.cidr] = pool
    for a in wanted.values():
        for b in wanted.values():
            if a is not b and a.network.overlaps(b.network):
                raise InvalidConfig("configured pools overlap", f"{a.cidr} and {b.cidr}")
    if all(docs.pool(c) is not None for c in wanted):
        return  # fast path: every pool exists (checked for overlap when it was made)
    with docs.store.lock():
        existing = docs.all_pools()
        for pool in wanted.values():
            stored = existing.get(pool.cidr)
            if stored is None:
                _no_overlap(pool, existing)
                stored = create(docs, pool)
                existing[stored.cidr] = stored
                if stored is pool:
                    log(INFO, "created pool %s (block size %d)", pool.cidr, pool.block_size)
                    continue
            if stored.block_size != pool.block_size:
                log(
                    WARNING,
                    "pool %s exists with block size %d; configured %d ignored",
                    pool.cidr,
                    stored.block_size,
                    pool.block_size,
                )


def _no_overlap(pool: Pool, existing: dict[str, Pool]) -> None:
    for other in existing.values():
        if other.network.overlaps(pool.network):
            raise InvalidConfig("pool overlaps an existing pool", f"{pool.cidr} and {other.cidr}")


def create(docs: Docs, pool: Pool) -> Pool:
    """CAS-create ``pool``; returns it, or the pool another writer created first under the
    same key."""

    def read() -> tuple[Pool, int] | None:
        return docs.pool_doc(pool.cidr)

    def write(got: tuple[Pool, int] | None) -> Pool:
        if got is not None:
            return got[0]
        docs.store.put("pool", pool.cidr, pool.to_data(), None)
        return pool

    return cas(read, write, "pool", pool.cidr)


def list_pools(docs: Docs) -> list[Pool]:
    return sorted(
        docs.all_pools().values(),
        key=lambda p: (p.version, int(p.network.network_address)),
    )


def add_pool(docs: Docs, spec: PoolSpec) -> None:
    pool = Pool.from_spec(spec.cidr, spec.block_size, spec.disabled)
    with docs.store.lock():
        existing = docs.all_pools()
        for other in existing.values():
            if other.network.overlaps(pool.network):
                raise InvalidConfig("pool overlaps an existing pool", other.cidr)
        if create(docs, pool) is not pool:
            raise InvalidConfig("pool overlaps an existing pool", pool.cidr)


def set_pool_disabled(docs: Docs, cidr: str, disabled: bool) -> None:
    key = str(parse_network(cidr, "pool CIDR"))

    def change(doc: Doc | None) -> dict[str, Any] | None:
        if doc is None:
            raise InvalidConfig("no such pool", key)
        pool = Pool.from_data(doc.data, docs.store.location("pool", key))
        if pool.disabled == disabled:
            return None
        pool.disabled = disabled
        return pool.to_data()

    with docs.store.lock():
        update(docs.store, "pool", key, change)


def delete_pool(docs: Docs, cidr: str) -> int:
    key = str(parse_network(cidr, "pool CIDR"))
    with docs.store.lock():
        got = docs.pool_doc(key)
        if got is None:
            raise InvalidConfig("no such pool", key)
        pool, rev = got
        blocks = _blocks_of(docs, pool)
        for blk, _rev in blocks:
            if not blk.is_empty():
                raise InvalidConfig("pool in use", f"block {blk.cidr} has allocations")
        # Pool first: no new block can then be claimed in it, and a block left by a
        # crash in between is an empty block outside every pool (check reports it).
        docs.store.delete("pool", key, rev)
        removed: dict[str, str | None] = {}
        for blk, brev in blocks:
            docs.store.delete("block", blk.cidr, brev)
            removed[blk.cidr] = blk.node
        _forget(docs, key, removed)
        return len(removed)


def _blocks_of(docs: Docs, pool: Pool) -> list[tuple[Block, int]]:
    """The pool's blocks (a corrupt one raises: it might hold addresses)."""
    out = []
    for cidr in docs.store.list_keys("block"):
        if family(cidr) != pool.version or not inside(cidr, [pool]):
            continue
        got = docs.block(cidr)
        if got is not None and got[0].pool == pool.cidr:
            out.append(got)
    return out


def _forget(docs: Docs, pool: str, removed: dict[str, str | None]) -> None:
    """Drop deleted blocks (and the pool's claim cursor) from their nodes' documents."""
    nodes: dict[str, list[str]] = {}
    for cidr, node in removed.items():
        if node:
            nodes.setdefault(node, []).append(cidr)
    op = Op()
    for node, cidrs in nodes.items():
        affinity.forget(docs, op, node, cidrs, pool=pool)
