"""The affinity documents: which blocks a node owns (``blocks``, claim order), the hint of
those last seen with room (``avail``), and where its next claim starts (``cursor``).

Only a node itself adds or removes its blocks (claim, adopt, forget); any node edits the
hints of an existing document (a borrower that fills a block, a release that empties one)
and never creates another node's document. ``release_node`` and ``delete_pool`` forget
blocks they removed. Every edit is a CAS through ``modify``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial

from ipam.core.block import Block
from ipam.core.cas import cas
from ipam.core.docs import INFO, WARNING, Docs, Op, family, log
from ipam.core.errors import RevisionConflict, StoreCorrupt
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


def forget(docs: Docs, op: Op, node: str, cidrs: Iterable[str], pool: str | None = None) -> None:
    modify(docs, op, node, partial(_forget, cidrs=list(cidrs), pool=pool))


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


def mark_full(docs: Docs, op: Op, blk: Block, rev: int) -> None:
    """Found full while hinted to have room: set the block's flag and the owner's hint.

    One attempt: a lost CAS means the block changed, and its writer keeps flag and hint.
    """
    if not blk.full:
        new = blk.copy()
        new.full = True
        try:
            docs.store.put("block", blk.cidr, new.to_data(), rev)
        except RevisionConflict:
            return
        blk = new
    hint_full(docs, op, blk)


def hint_full(docs: Docs, op: Op, blk: Block) -> None:
    """Drop ``blk`` from its owner's ``avail`` hint, then look again: if a release gave it
    room meanwhile (another node's, whose "room" hint this write may have undone), put it
    back. Hints never decide, but a block hidden as full would make its node claim more."""
    owner = blk.node
    if not owner:
        return
    try:
        modify(docs, op, owner, partial(_full, cidr=blk.cidr))
    except StoreCorrupt as e:
        if owner == docs.node:
            raise
        log(WARNING, "cannot update the hint of node %s: %s", owner, e)
        return
    now = docs.try_block(blk.cidr)
    if now is not None and now[0].node == owner and not now[0].full:
        hint_unfull(docs, op, owner, blk.cidr)


def hint_unfull(docs: Docs, op: Op, owner: str, cidr: str) -> None:
    """Put ``cidr`` back in its owner's ``avail`` hint (after a release gave it room); a
    corrupt affinity document is logged and left alone (the release itself is done)."""
    try:
        modify(docs, op, owner, partial(_unfull, cidrs=[cidr]))
    except StoreCorrupt as e:
        log(WARNING, "cannot update the hint of node %s: %s", owner, e)


def room_found(docs: Docs, op: Op, cidr: str) -> None:
    """This node found room in its block ``cidr`` hinted full: hint it again."""
    modify(docs, op, docs.node, partial(_unfull, cidrs=[cidr]))


def repair(docs: Docs, op: Op, gone: list[str], roomy: list[str]) -> None:
    modify(docs, op, docs.node, partial(_repair, gone=gone, roomy=roomy))


# -- changes (True = the document changed) --------------------------------------------------


def _add(aff: Affinity, *, cidr: str, cursor: tuple[str, int] | None) -> bool:
    changed = False
    if cidr not in aff.blocks:
        aff.blocks.append(cidr)
        changed = True
    if cidr not in aff.avail:
        aff.avail.append(cidr)
        changed = True
    if cursor is not None and aff.cursor.get(cursor[0]) != cursor[1]:
        aff.cursor[cursor[0]] = cursor[1]
        changed = True
    return changed


def _forget(aff: Affinity, *, cidrs: Iterable[str], pool: str | None = None) -> bool:
    drop = set(cidrs)
    before = (len(aff.blocks), len(aff.avail), len(aff.cursor))
    aff.blocks = [c for c in aff.blocks if c not in drop]
    aff.avail = [c for c in aff.avail if c not in drop]
    if pool is not None:
        aff.cursor.pop(pool, None)
    return before != (len(aff.blocks), len(aff.avail), len(aff.cursor))


def _full(aff: Affinity, *, cidr: str) -> bool:
    if cidr in aff.avail:
        aff.avail.remove(cidr)
        return True
    return False


def _unfull(aff: Affinity, *, cidrs: Iterable[str]) -> bool:
    """Hint ``cidrs`` as having room; ``avail`` stays in claim order (older blocks first)."""
    avail = set(aff.avail)
    add = {c for c in cidrs if c not in avail and c in aff.blocks}
    if not add:
        return False
    avail |= add
    aff.avail = [c for c in aff.blocks if c in avail]
    return True


def _repair(aff: Affinity, *, gone: list[str], roomy: list[str]) -> bool:
    forgot = _forget(aff, cidrs=gone)
    listed = set(aff.blocks)
    strays = [c for c in aff.avail if c not in listed]
    aff.avail = [c for c in aff.avail if c in listed]
    return _unfull(aff, cidrs=roomy) or forgot or bool(strays)
