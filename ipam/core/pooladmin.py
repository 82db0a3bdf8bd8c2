"""Pool administration: create (from the configuration or an operator), disable, delete.

A pool document may carry keys the allocator does not know (the IPPool resource's fields):
every rewrite keeps them (``Pool.extra``).

Without a cluster-wide lock, two things need care (ipam/DESIGN.md, "Cluster mode"):

- *Overlap.* Creating is a CAS-create of the pool's own key, which cannot see an
  overlapping pool created at the same instant under another key. So the creator looks
  again afterwards and backs off (removes its pool) if any other pool overlaps it; and the
  pool gate admits no block of a pool that overlaps another. Both racers may back off; one
  retry then wins.
- *Delete.* ``remove`` disables the pool (CAS), deletes its blocks while each is empty
  (CAS: an allocation racing in makes the delete fail, or makes the allocation fail), then
  deletes the pool at the revision it disabled, then deletes blocks created meanwhile by
  claims that had read the pool before it was disabled (their claimers remove them too: the
  pool gate fails for them).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from bundle.types import JSON
from datastore.cas import DELETE, Delete, cas, update
from ipam.core import affinity
from ipam.core.block import Block
from ipam.core.docs import INFO, WARNING, Docs, Op, family, inside, log
from ipam.core.errors import InvalidConfig, StoreCorrupt
from ipam.core.model import Pool, PoolSpec, parse_network

if TYPE_CHECKING:
    from datastore.base import Doc


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
    same key. A pool created here that overlaps another (created concurrently under another
    key) is removed again: InvalidConfig."""

    def read() -> tuple[Pool, int] | None:
        return docs.pool_doc(pool.cidr)

    def write(got: tuple[Pool, int] | None) -> Pool:
        if got is not None:
            return got[0]
        docs.store.put("pool", pool.cidr, pool.to_data(), None)
        return pool

    stored = cas(read, write, "pool", pool.cidr)
    if stored is not pool:
        return stored
    for key in docs.store.list_keys("pool"):
        if key == pool.cidr:
            continue
        try:
            net = parse_network(key, "pool CIDR")
        except InvalidConfig:
            continue
        if net.overlaps(pool.network):
            try:
                remove(docs, pool.cidr)
            except InvalidConfig as e:
                log(WARNING, "pool %s stays disabled: %s", pool.cidr, e)
            raise InvalidConfig("pool overlaps an existing pool", f"{pool.cidr} and {key}")
    return pool


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
    with docs.store.lock():
        _set_disabled(docs, key, disabled)


def _set_disabled(docs: Docs, key: str, disabled: bool) -> tuple[bool, int | None]:
    """Set the flag (CAS; other keys kept). Returns (the flag before, the revision after)."""
    before: list[bool] = []

    def change(doc: Doc | None) -> JSON | None:
        if doc is None:
            raise InvalidConfig("no such pool", key)
        pool = Pool.from_data(doc.data, docs.store.location("pool", key))
        before[:] = [pool.disabled]
        if pool.disabled == disabled:
            return None
        pool.disabled = disabled
        return pool.to_data()

    rev = update(docs.store, "pool", key, change)
    return before[0], rev


def delete_pool(docs: Docs, cidr: str) -> int:
    key = str(parse_network(cidr, "pool CIDR"))
    with docs.store.lock():
        got = docs.pool_doc(key)
        if got is None:
            raise InvalidConfig("no such pool", key)
        # Read-only first: nothing is written while an address is in use.
        for blk, _rev in _blocks_of(docs, got[0]):
            if not blk.is_empty():
                raise InvalidConfig("pool in use", f"block {blk.cidr} has allocations")
        return remove(docs, key)


def _blocks_of(docs: Docs, pool: Pool) -> list[tuple[Block, int]]:
    """The pool's blocks (a corrupt one raises: it might hold addresses)."""
    out = []
    for cidr, doc in docs.scan("block"):
        if family(cidr) != pool.version or not inside(cidr, [pool]):
            continue
        if isinstance(doc, StoreCorrupt):
            raise doc
        blk = docs.parse_block(cidr, doc)
        if blk.pool == pool.cidr:
            out.append((blk, doc.revision))
    return out


def remove(docs: Docs, key: str) -> int:
    """Disable, delete the empty blocks, delete the pool (see the module); InvalidConfig
    (pool left as it was, minus some empty blocks) if a block holds an address. Returns
    the number of blocks deleted."""
    removed: dict[str, str | None] = {}  # block CIDR -> the node it was affine to
    was_disabled: list[bool] = []

    def read() -> tuple[Pool, int]:
        before, _rev = _set_disabled(docs, key, True)
        if not was_disabled:
            was_disabled.append(before)
        got = docs.pool_doc(key)
        if got is None:
            raise InvalidConfig("no such pool", key)
        for blk, _rev in _blocks_of(docs, got[0]):
            if _delete_if_empty(docs, blk.cidr, key):
                removed[blk.cidr] = blk.node
            else:
                _forget(docs, key, removed)
                if not was_disabled[0]:
                    _set_disabled(docs, key, False)
                raise InvalidConfig("pool in use", f"block {blk.cidr} has allocations")
        return got

    def write(got: tuple[Pool, int]) -> Pool:
        docs.store.delete("pool", key, got[1])
        return got[0]

    pool = cas(read, write, "pool", key)
    # Blocks created by claims that read the pool before it was disabled, whose claimers
    # have not removed them yet (the pool gate fails for them: they never hold addresses).
    for blk, _rev in _blocks_of(docs, pool):
        if _delete_if_empty(docs, blk.cidr, key):
            removed[blk.cidr] = blk.node
        else:
            log(WARNING, "block %s of deleted pool %s holds addresses", blk.cidr, key)
    _forget(docs, key, removed)
    return len(removed)


def _delete_if_empty(docs: Docs, cidr: str, pool: str) -> bool:
    """CAS-delete the block while it is empty; False if it holds an address."""

    def change(doc: Doc | None) -> JSON | Delete | None:
        if doc is None:
            return None
        blk = Block.from_data(doc.data, docs.store.location("block", cidr))
        if blk.pool != pool:
            return None
        if not blk.is_empty():
            raise _InUse
        return DELETE

    try:
        update(docs.store, "block", cidr, change)
    except _InUse:
        return False
    return True


class _InUse(Exception):
    pass


def _forget(docs: Docs, pool: str, removed: dict[str, str | None]) -> None:
    """Drop deleted blocks (and the pool's claim cursor) from their nodes' documents."""
    nodes: dict[str, list[str]] = {}
    for cidr, node in removed.items():
        if node:
            nodes.setdefault(node, []).append(cidr)
    op = Op()
    for node, cidrs in nodes.items():
        affinity.forget(docs, op, node, cidrs, pool=pool)
