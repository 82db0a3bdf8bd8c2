"""The affinity documents: a node's index. ``blocks``: the node's own blocks (claim order);
``borrowed``: other blocks where it holds (or is about to hold) an allocation; ``cursor``:
where its next claim starts in each pool.

Invariant I2: every allocation made for a node lies in a block its document lists. So a
block is listed before the node's first allocation there: a claim lists it after creating
it and before allocating, a borrow lists it before allocating. A listed block that holds
nothing of the node is harmless (a leftover GC removes).

Only a node itself edits its document (claim, adopt, borrow, forget, the legacy migration),
besides ``release_node`` and ``delete_pool``, which forget blocks they removed. Every edit
is a CAS through ``modify``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

from datastore.cas import cas
from ipam.core.block import Block
from ipam.core.docs import INFO, WARNING, Docs, Op, family, log
from ipam.core.model import Affinity


def modify(docs: Docs, op: Op, node: str, change: Callable[[Affinity], bool]) -> None:
    """CAS-update ``node``'s affinity document with ``change`` (True = changed). This
    node's document is created when missing; another node's is only edited if it exists.
    This node's copy in ``op`` is kept up to date (the first attempt starts from it)."""
    mine = node == docs.node
    first = [mine and op.aff is not None]

    def read() -> tuple[Affinity, int | None] | None:
        if first[0]:
            first[0] = False
            assert op.aff is not None
            return op.aff.copy(), op.aff_rev
        aff, rev = docs.affinity(node)
        if rev is None and not mine:
            return None
        return aff, rev

    def write(state: tuple[Affinity, int | None] | None) -> None:
        if state is None:
            return
        aff, rev = state
        if change(aff):
            rev = docs.store.put("affinity", node, aff.to_data(), rev)
        if mine:
            op.aff, op.aff_rev = aff, rev

    cas(read, write, "affinity", node)


def count_blocks(docs: Docs, op: Op, fam: int) -> int:
    return sum(1 for c in docs.my_affinity(op).blocks if family(c) == fam)


def add(docs: Docs, op: Op, cidr: str, cursor: tuple[str, int] | None = None) -> None:
    modify(docs, op, docs.node, partial(_add, cidr=cidr, cursor=cursor))


def borrow(docs: Docs, op: Op, cidr: str) -> None:
    """List another node's (or no node's) block before this node's first allocation in it."""
    if cidr not in docs.my_affinity(op).indexed():
        modify(docs, op, docs.node, partial(_borrow, cidr=cidr))


def forget(docs: Docs, op: Op, node: str, cidrs: Iterable[str], pool: str | None = None) -> None:
    """Unlist blocks that were removed (``release_node``, ``delete_pool``)."""
    modify(docs, op, node, partial(_forget, cidrs=list(cidrs), pool=pool))


def unlist(docs: Docs, op: Op, drop: Iterable[str], lent: Iterable[str]) -> None:
    """This node's index without ``drop`` (blocks gone, or another's holding nothing of
    it), with ``lent`` (listed as its own, another's now, still holding its allocations)
    moved to ``borrowed``. The caller read each of them from the store itself."""
    modify(docs, op, docs.node, partial(_unlist, drop=set(drop), lent=list(lent)))


def adopt(docs: Docs, op: Op, blk: Block, cursor: tuple[str, int] | None = None) -> bool:
    """List this node's unlisted block (a crash leftover) in its affinity document, if the
    pool gate lets it (an unlisted block may never have passed it); False if not."""
    why = docs.gate(blk)
    if why is not None:
        log(WARNING, "node %s does not adopt block %s: %s", docs.node, blk.cidr, why)
        return False
    log(WARNING, "node %s adopts its unlisted block %s (crash leftover)", docs.node, blk.cidr)
    add(docs, op, blk.cidr, cursor)
    return True


def claimed(docs: Docs, op: Op, blk: Block, cursor: tuple[str, int] | None) -> None:
    add(docs, op, blk.cidr, cursor)
    log(INFO, "node %s claimed block %s", docs.node, blk.cidr)


# -- changes (True = the document changed) --------------------------------------------------


def _add(aff: Affinity, *, cidr: str, cursor: tuple[str, int] | None) -> bool:
    changed = False
    if cidr not in aff.blocks:
        aff.blocks.append(cidr)
        changed = True
    if cidr in aff.borrowed:  # claimed after being borrowed (e.g. left unaffine): own now
        aff.borrowed.remove(cidr)
        changed = True
    if cursor is not None and aff.cursor.get(cursor[0]) != cursor[1]:
        aff.cursor[cursor[0]] = cursor[1]
        changed = True
    return changed


def _borrow(aff: Affinity, *, cidr: str) -> bool:
    if cidr in aff.blocks or cidr in aff.borrowed:
        return False
    aff.borrowed.append(cidr)
    return True


def _unlist(aff: Affinity, *, drop: set[str], lent: list[str]) -> bool:
    before = (list(aff.blocks), list(aff.borrowed))
    aff.blocks = [c for c in aff.blocks if c not in drop and c not in lent]
    aff.borrowed = [c for c in aff.borrowed if c not in drop]
    aff.borrowed += [c for c in lent if c not in aff.borrowed]
    return before != (aff.blocks, aff.borrowed)


def _forget(aff: Affinity, *, cidrs: Iterable[str], pool: str | None = None) -> bool:
    drop = set(cidrs)
    before = (len(aff.blocks), len(aff.borrowed), len(aff.cursor))
    aff.blocks = [c for c in aff.blocks if c not in drop]
    aff.borrowed = [c for c in aff.borrowed if c not in drop]
    if pool is not None:
        aff.cursor.pop(pool, None)
    return before != (len(aff.blocks), len(aff.borrowed), len(aff.cursor))
