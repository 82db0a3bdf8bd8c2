"""Releasing addresses: by handle (DEL), by address (with the ABA guard), GC of a network's
stale attachments (with the repair of this node's index), and every address and block of a
node that is gone.

A release is one CAS per block that holds an address of the handle; the blocks looked at
are the node's index (its affinity document: own and borrowed blocks), so a DEL reads the
node's few blocks and writes one. Without a node (an operator's release, ``node`` "") every
block is looked at.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from functools import partial
from typing import TYPE_CHECKING

from bundle.types import IPAddress
from datastore.cas import cas
from ipam.core import affinity, legacy
from ipam.core.block import Block
from ipam.core.docs import WARNING, Docs, Op, log
from ipam.core.errors import DatastoreError, InvalidConfig, LockTimeout, StoreCorrupt
from ipam.core.model import (
    Allocation,
    GcReport,
    parse_ip,
    split_handle_id,
)

if TYPE_CHECKING:
    from ipam.core.reports import NodeRelease


def release_in_block(
    docs: Docs, cidr: str, select: Callable[[Block], list[int]]
) -> list[Allocation]:
    """Free the ordinals ``select(block)`` picks (one CAS on the block)."""

    def read() -> tuple[Block, int] | None:
        return docs.block(cidr)

    def write(got: tuple[Block, int] | None) -> tuple[Block | None, list[int]]:
        if got is None:
            return None, []
        blk, rev = got
        ordinals = select(blk)
        if ordinals:
            new = blk.copy()
            for o in ordinals:
                new.release(o)
            docs.store.put("block", cidr, new.to_data(), rev)
        return blk, ordinals

    blk, ordinals = cas(read, write, "block", cidr)
    if blk is None or not ordinals:
        return []
    return [docs.allocation(blk, o) for o in ordinals]


def ordinal_if(blk: Block, *, ip: IPAddress, hid: str, seq: int) -> list[int]:
    """[ordinal of ip] if it is still the allocation (hid, seq), else []."""
    try:
        o = blk.ordinal(ip)
    except ValueError:
        return []
    a = blk.allocations[o]
    return [o] if a is not None and a["handle"] == hid and a["seq"] == seq else []


def where_to_look(docs: Docs, op: Op) -> list[str]:
    """The blocks that may hold an allocation of this node: its index (after folding what
    an older tabby indexed in handle documents); every block without a node."""
    if not docs.node:
        return [blk.cidr for blk, _rev in docs.scan_blocks()]
    legacy.migrate(docs, op)
    return docs.my_affinity(op).indexed()


def release_handle(docs: Docs, handle_id: str) -> list[Allocation]:
    split_handle_id(handle_id)
    with docs.store.lock():
        op = Op()
        return release_handle_in(docs, handle_id, where_to_look(docs, op))


def release_handle_in(docs: Docs, hid: str, cidrs: Iterable[str]) -> list[Allocation]:
    """Release every allocation of the handle in ``cidrs``; a block that cannot be read
    raises (after the others were released: it may hold an address of the handle)."""
    released: list[Allocation] = []
    error: DatastoreError | None = None
    for cidr in cidrs:
        try:
            released += release_in_block(docs, cidr, lambda b: b.ordinals_of(hid))
        except DatastoreError as e:
            error = error or e
    if error is not None:
        raise error
    return released


def release_ip(docs: Docs, ip: IPAddress | str, expected_seq: int | None) -> bool:
    addr = parse_ip(ip)
    with docs.store.lock():
        cidr = docs.block_cidr_for(addr)
        if cidr is None:
            return False
        got = docs.block(cidr)
        if got is None:
            return False
        blk = got[0]
        alloc = blk.allocations[blk.ordinal(addr)]
        if alloc is None or (expected_seq is not None and alloc["seq"] != expected_seq):
            return False
        hid: str = alloc["handle"]
        seq: int = alloc["seq"]
        return bool(release_in_block(docs, cidr, partial(ordinal_if, ip=addr, hid=hid, seq=seq)))


def rollback(docs: Docs, op: Op, hid: str, done: list[Allocation]) -> None:
    """Undo one assign's allocations (dual-stack all or nothing); never raises."""
    try:
        for a in reversed(done):
            release_in_block(
                docs, str(a.block_cidr), partial(ordinal_if, ip=a.ip, hid=hid, seq=a.seq)
            )
    except DatastoreError as e:
        log(WARNING, "rollback of %s incomplete (DEL or GC will finish it): %s", hid, e)


# == GC ============================================================================================


def gc(
    docs: Docs, network: str, valid: Collection[tuple[str, str]], grace_seconds: float
) -> GcReport:
    """Release this node's attachments of ``network`` (every node's when ``docs.node`` is "")
    that are not in ``valid`` and older than ``grace_seconds``; then repair this node's
    index. An attachment's age is its oldest allocation's ``time`` attribute."""
    if not network or ":" in network:
        raise InvalidConfig("invalid network name", repr(network))
    report = GcReport([], [], [], [])
    prefix = network + ":"
    now = docs.clock()
    try:
        with docs.store.lock():
            op = Op()
            cidrs = where_to_look(docs, op)
            found = _attachments(docs, cidrs, prefix)
    except DatastoreError as e:
        report.errors.append(f"{docs.node or 'every node'}: {e}")
        return report
    for n, (hid, (born, holding)) in enumerate(sorted(found.items())):
        parts = hid.split(":")
        if len(parts) != 3:
            report.errors.append(f"{hid}: not a handle id")
            continue
        if (parts[1], parts[2]) in valid:
            report.kept.append(hid)
            continue
        if grace_seconds > 0 and now - born < grace_seconds:
            report.skipped_recent.append(hid)
            continue
        try:
            with docs.store.lock():
                release_handle_in(docs, hid, holding)
            report.released.append(hid)
        except LockTimeout as e:
            report.errors.append(f"{hid}: {e}; {len(found) - n - 1} handle(s) not examined")
            return report
        except DatastoreError as e:
            report.errors.append(f"{hid}: {e}")
    if docs.node:
        try:
            with docs.store.lock():
                repair_index(docs, Op())
        except DatastoreError as e:
            report.errors.append(f"affinity of {docs.node}: {e}")
    return report


def _attachments(
    docs: Docs, cidrs: Iterable[str], prefix: str
) -> dict[str, tuple[float, list[str]]]:
    """handle id -> (its oldest allocation's time, the blocks holding it), for the handles
    of ``prefix`` (one network) allocated for this node (any node's without a node)."""
    out: dict[str, tuple[float, list[str]]] = {}
    for cidr in cidrs:
        got = docs.try_block(cidr)
        if got is None:
            continue
        for a in got[0].allocations:
            if a is None or not a["handle"].startswith(prefix):
                continue
            attrs = a.get("attrs") or {}
            if docs.node and attrs.get("node", docs.node) != docs.node:
                continue  # another node's, borrowed from this node's block
            when = attrs.get("time")
            born = float(when) if isinstance(when, int | float) else 0.0
            old_born, holding = out.get(a["handle"], (born, []))
            if cidr not in holding:
                holding.append(cidr)
            out[a["handle"]] = (min(old_born, born), holding)
    return out


def repair_index(docs: Docs, op: Op) -> None:
    """Make this node's index true again: fold what handle documents of an older tabby
    remain; forget own blocks that are not its own any more, and borrowed blocks that hold
    nothing of it; adopt its unlisted blocks; delete an unlisted empty block whose pool is
    gone (a killed claim racing a pool delete)."""
    legacy.migrate(docs, op, leftovers=True)
    aff = docs.my_affinity(op)
    drop: list[str] = []
    lent: list[str] = []  # listed as its own, another's now, still holding its allocations
    for cidr in aff.indexed():
        try:
            got = docs.block(cidr)
        except StoreCorrupt as e:
            log(WARNING, "skipping unreadable block: %s", e)
            continue
        if got is None:
            drop.append(cidr)
        elif got[0].node != docs.node:
            if not got[0].holds_for(docs.node):
                drop.append(cidr)
            elif cidr in aff.blocks:
                lent.append(cidr)
    if drop or lent:
        affinity.unlist(docs, op, drop, lent)
    listed = set(docs.my_affinity(op).blocks)
    for blk, rev in docs.scan_blocks():
        cidr = blk.cidr
        if cidr in listed or blk.node != docs.node:
            continue
        if affinity.adopt(docs, op, blk):
            continue
        if blk.is_empty() and docs.pool(blk.pool) is None:
            try:
                docs.store.delete("block", cidr, rev)
            except DatastoreError as e:
                log(WARNING, "cannot remove block %s of a deleted pool: %s", cidr, e)


# == a node that is gone ====================================================================


def release_node(docs: Docs, node: str) -> NodeRelease:
    """Release every allocation recorded for ``node`` (allocation attribute "node"), then
    its blocks: an empty one is deleted, one still holding addresses (borrowed by other
    nodes, or assigned by the node meanwhile) loses its affinity; then its affinity
    document and any handle documents an older tabby left for it. Every step is a CAS, so
    a node that is in fact still running can only make this do less (it keeps what it
    claims or assigns after the step that would have released it), never break an
    invariant."""
    from ipam.core.reports import NodeRelease  # not on a CNI call's path

    if not isinstance(node, str) or not node or ":" in node:
        raise InvalidConfig("invalid node name", repr(node))
    deleted: list[str] = []
    unaffined: list[str] = []
    errors: list[str] = []
    affine, held = _node_blocks(docs, node)
    # 1. the node's allocations, a handle (one attachment) at a time
    released, addresses = _release_handles(docs, held, errors)

    # 2. its blocks, then 3. its affinity document: blocks first, so a kill in between
    # leaves an affinity document listing blocks that are no longer the node's (a rerun
    # removes it). The document is deleted at the revision whose blocks were released: a
    # block the node claimed meanwhile changes it, and the next attempt releases that too.
    done: set[str] = set()

    def release_blocks(cidrs: Iterable[str]) -> None:
        for cidr in cidrs:
            if cidr in done:
                continue
            done.add(cidr)
            try:
                outcome = _release_block(docs, node, cidr)
            except DatastoreError as e:
                errors.append(f"block {cidr}: {e}")
                continue
            if outcome == "deleted":
                deleted.append(cidr)
            elif outcome == "unaffined":
                unaffined.append(cidr)

    def read() -> int | None:
        aff, rev = docs.affinity(node)
        release_blocks(aff.blocks)
        return rev

    def write(rev: int | None) -> bool:
        if rev is None:
            return False
        docs.store.delete("affinity", node, rev)
        return True

    aff_deleted = False
    try:
        with docs.store.lock():
            release_blocks(affine)
            aff_deleted = cas(read, write, "affinity", node)
            _drop_legacy_handles(docs, node)
    except DatastoreError as e:
        errors.append(f"affinity of {node}: {e}")
    return NodeRelease(node, released, addresses, deleted, unaffined, aff_deleted, errors)


def _node_blocks(docs: Docs, node: str) -> tuple[list[str], dict[str, list[str]]]:
    """The blocks affine to ``node``, and by handle the blocks holding the allocations
    recorded for it."""
    affine: list[str] = []
    held: dict[str, list[str]] = {}
    for blk, _rev in docs.all_blocks():
        if blk.node == node:
            affine.append(blk.cidr)
        for a in blk.allocations:
            if a is not None and (a.get("attrs") or {}).get("node") == node:
                cidrs = held.setdefault(a["handle"], [])
                if blk.cidr not in cidrs:
                    cidrs.append(blk.cidr)
    return affine, held


def _release_handles(
    docs: Docs, held: dict[str, list[str]], errors: list[str]
) -> tuple[list[str], list[str]]:
    """Release each handle in its blocks (a lock each): the handles released and their
    addresses. A failure is added to ``errors``; a lock timeout ends the loop."""
    released: list[str] = []
    addresses: list[str] = []
    for hid, cidrs in held.items():
        try:
            with docs.store.lock():
                got = release_handle_in(docs, hid, cidrs)
        except LockTimeout as e:
            errors.append(f"{hid}: {e}")
            break
        except DatastoreError as e:
            errors.append(f"{hid}: {e}")
            continue
        released.append(hid)
        addresses += [str(a.ip) for a in got]
    return released, addresses


def _drop_legacy_handles(docs: Docs, node: str) -> None:
    """The handle documents an older tabby wrote for ``node`` (its allocations are released
    by now: they index nothing)."""
    from ipam.core.model import Handle

    if not docs.store.list_keys("handle"):
        return
    for key, doc in docs.scan("handle"):
        if isinstance(doc, StoreCorrupt):
            continue
        try:
            if Handle.from_data(doc.data, key).node != node:
                continue
            docs.store.delete("handle", key, doc.revision)
        except DatastoreError as e:
            log(WARNING, "handle %s stays: %s", key, e)


def _release_block(docs: Docs, node: str, cidr: str) -> str | None:
    """Delete ``node``'s block if empty, else make it affine to no node (CAS)."""

    def read() -> tuple[Block, int] | None:
        return docs.block(cidr)

    def write(got: tuple[Block, int] | None) -> str | None:
        if got is None or got[0].node != node:
            return None
        blk, rev = got
        if blk.is_empty():
            docs.store.delete("block", cidr, rev)
            return "deleted"
        new = blk.copy()
        new.affinity = None
        docs.store.put("block", cidr, new.to_data(), rev)
        return "unaffined"

    return cas(read, write, "block", cidr)
