"""Releasing addresses: by handle (DEL), by address (with the ABA guard), GC of a network's
stale handles (with the repair of this node's hints), and every address and block of a node
that is gone.

Order (see ipam/DESIGN.md): allocations first, then the handle, so the handle stays a
superset index (I2) at every instant. After unlisting blocks from a handle (or deleting
it), those blocks are looked at once more (``sweep``): an assign of the same handle running
on another node may have written an allocation there after this release passed, and its
own check (the handle still lists its blocks) may have passed before the handle went.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable
from functools import partial
from typing import TYPE_CHECKING, Any

from bundle.types import IPAddress
from ipam.core import affinity
from ipam.core.block import Block
from ipam.core.cas import DELETE, Delete, cas, update
from ipam.core.docs import WARNING, Docs, Op, log
from ipam.core.errors import DatastoreError, InvalidConfig, LockTimeout, StoreCorrupt
from ipam.core.model import (
    Allocation,
    GcReport,
    Handle,
    parse_ip,
    split_handle_id,
)

if TYPE_CHECKING:
    from datastore.base import Doc
    from ipam.core.reports import NodeRelease


def release_in_block(
    docs: Docs, op: Op, cidr: str, select: Callable[[Block], list[int]]
) -> list[Allocation]:
    """Free the ordinals ``select(block)`` picks (CAS on the block); give the block back
    to its owner's ``avail`` hint if it was full."""

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
    if blk.full and blk.node:
        affinity.hint_unfull(docs, op, blk.node, cidr)
    return [docs.allocation(blk, o) for o in ordinals]


def ordinal_if(blk: Block, *, ip: IPAddress, hid: str, seq: int) -> list[int]:
    """[ordinal of ip] if it is still the allocation (hid, seq), else []."""
    try:
        o = blk.ordinal(ip)
    except ValueError:
        return []
    a = blk.allocations[o]
    return [o] if a is not None and a["handle"] == hid and a["seq"] == seq else []


def sweep(docs: Docs, op: Op, hid: str, cidrs: Iterable[str]) -> list[Allocation]:
    """Release allocations of ``hid`` in ``cidrs`` that its handle does not index (the
    handle is gone or no longer lists the block). The handle is read after the block and
    the block written at the revision read, so an allocation a new handle indexes is left
    alone."""
    out: list[Allocation] = []
    for cidr in cidrs:

        def unindexed(blk: Block, cidr: str = cidr) -> list[int]:
            ordinals = blk.ordinals_of(hid)
            if not ordinals:
                return []
            try:
                got = docs.handle(hid)
            except StoreCorrupt:
                return []  # cannot prove it unindexed: leave it
            if got is not None and cidr in got[0].blocks:
                return []
            return ordinals

        try:
            out += release_in_block(docs, op, cidr, unindexed)
        except StoreCorrupt:
            continue  # nothing of ours can be found in an unreadable block
    return out


def prune(docs: Docs, op: Op, hid: str, cidrs: list[str] | None) -> None:
    """Unlist blocks (``cidrs``, or all when None) that hold nothing of the handle; delete
    the handle when it lists no block any more."""
    dropped: list[str] = []

    def change(doc: Doc | None) -> dict[str, Any] | Delete | None:
        dropped.clear()
        if doc is None:
            return None
        h = Handle.from_data(doc.data, docs.store.location("handle", hid))
        keep = []
        for cidr in h.blocks:
            if cidrs is None or cidr in cidrs:
                try:
                    got = docs.block(cidr)
                except StoreCorrupt:
                    keep.append(cidr)  # cannot prove it empty: keep indexing it
                    continue
                if got is None or not got[0].ordinals_of(hid):
                    dropped.append(cidr)
                    continue
            keep.append(cidr)
        if not keep:
            return DELETE
        if keep != h.blocks:
            h.blocks = keep
            return h.to_data()
        return None

    update(docs.store, "handle", hid, change)
    if dropped:
        sweep(docs, op, hid, dropped)


def release_handle(docs: Docs, handle_id: str) -> list[Allocation]:
    split_handle_id(handle_id)
    with docs.store.lock():
        return release_handle_locked(docs, Op(), handle_id)


def release_handle_locked(docs: Docs, op: Op, hid: str) -> list[Allocation]:
    """Release every allocation of the handle, then delete it (or, when a listed block
    cannot be read, rewrite it listing only those and raise the error)."""
    released: dict[tuple[str, int], Allocation] = {}  # over attempts: (ip, seq) -> allocation

    def read() -> tuple[Handle, int, list[str], DatastoreError | None] | None:
        got = docs.handle(hid)
        if got is None:
            return None
        handle, rev = got
        failed: list[str] = []
        error: DatastoreError | None = None
        for cidr in handle.blocks:
            try:
                for a in release_in_block(docs, op, cidr, lambda b: b.ordinals_of(hid)):
                    released[(str(a.ip), a.seq)] = a
            except DatastoreError as e:
                failed.append(cidr)
                error = error or e
        return handle, rev, failed, error

    def write(
        state: tuple[Handle, int, list[str], DatastoreError | None] | None,
    ) -> tuple[list[str], DatastoreError | None]:
        if state is None:
            return [], None
        handle, rev, failed, error = state
        dropped = [c for c in handle.blocks if c not in failed]
        if failed:
            handle.blocks = failed
            docs.store.put("handle", hid, handle.to_data(), rev)
        else:
            docs.store.delete("handle", hid, rev)
        return dropped, error

    dropped, error = cas(read, write, "handle", hid)
    for a in sweep(docs, op, hid, dropped):
        released[(str(a.ip), a.seq)] = a
    if error is not None:
        raise error
    return list(released.values())


def release_ip(docs: Docs, ip: IPAddress | str, expected_seq: int | None) -> bool:
    addr = parse_ip(ip)
    with docs.store.lock():
        op = Op()
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
        done = release_in_block(docs, op, cidr, partial(ordinal_if, ip=addr, hid=hid, seq=seq))
        if not done:
            return False
        prune(docs, op, hid, [cidr])
        return True


def rollback(docs: Docs, op: Op, hid: str, done: list[Allocation]) -> None:
    """Undo one assign's allocations (dual-stack all or nothing); never raises."""
    try:
        for a in reversed(done):
            release_in_block(
                docs, op, str(a.block_cidr), partial(ordinal_if, ip=a.ip, hid=hid, seq=a.seq)
            )
        prune(docs, op, hid, None)
    except DatastoreError as e:
        log(WARNING, "rollback of %s incomplete (DEL or GC will finish it): %s", hid, e)


# == GC ============================================================================================


def gc(
    docs: Docs, network: str, valid: Collection[tuple[str, str]], grace_seconds: float
) -> GcReport:
    if not network or ":" in network:
        raise InvalidConfig("invalid network name", repr(network))
    report = GcReport([], [], [], [])
    prefix = network + ":"
    now = docs.clock()
    keys = [k for k in docs.store.list_keys("handle") if k.startswith(prefix)]
    for n, key in enumerate(keys):
        parts = key.split(":")
        if len(parts) != 3:
            report.errors.append(f"{key}: not a handle id")
            continue
        if (parts[1], parts[2]) in valid:
            report.kept.append(key)
            continue
        try:
            with docs.store.lock():
                got = docs.handle(key)
                if got is None:
                    continue
                h = got[0]
                if docs.node and h.node and h.node != docs.node:
                    continue
                if grace_seconds > 0 and now - h.created < grace_seconds:
                    report.skipped_recent.append(key)
                    continue
                release_handle_locked(docs, Op(), key)
                report.released.append(key)
        except LockTimeout as e:
            report.errors.append(f"{key}: {e}; {len(keys) - n - 1} handle(s) not examined")
            return report
        except DatastoreError as e:
            report.errors.append(f"{key}: {e}")
    if docs.node:
        try:
            with docs.store.lock():
                repair_affinity(docs, Op())
        except DatastoreError as e:
            report.errors.append(f"affinity of {docs.node}: {e}")
    return report


def repair_affinity(docs: Docs, op: Op) -> None:
    """Make this node's hints true again (forget blocks that are not its own any more, hint
    those with room) and adopt its unlisted blocks; an unlisted empty block whose pool is
    gone (a killed claim racing a pool delete) is deleted."""
    aff = docs.my_affinity(op)
    gone: list[str] = []
    roomy: list[str] = []
    for cidr in aff.blocks:
        try:
            got = docs.block(cidr)
        except StoreCorrupt as e:
            log(WARNING, "skipping unreadable block: %s", e)
            continue
        if got is None or got[0].node != docs.node:
            gone.append(cidr)
        elif cidr not in aff.avail and got[0].first_usable(op.reserved) is not None:
            roomy.append(cidr)
    if gone or roomy:
        affinity.repair(docs, op, gone, roomy)
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
    document. Every step is a CAS, so a node that is in fact still running can only make
    this do less (it keeps what it claims or assigns after the step that would have
    released it), never break an invariant."""
    from ipam.core.reports import NodeRelease  # not on a CNI call's path

    if not isinstance(node, str) or not node or ":" in node:
        raise InvalidConfig("invalid node name", repr(node))
    released: list[str] = []
    addresses: list[str] = []
    deleted: list[str] = []
    unaffined: list[str] = []
    errors: list[str] = []
    hids: dict[str, None] = {}
    affine: list[str] = []
    for blk, _rev in docs.all_blocks():
        if blk.node == node:
            affine.append(blk.cidr)
        for a in blk.allocations:
            if a is not None and a.get("attrs", {}).get("node") == node:
                hids[a["handle"]] = None
    # 1. the node's allocations, a handle (one attachment) at a time
    for hid in hids:
        try:
            with docs.store.lock():
                got = release_handle_locked(docs, Op(), hid)
        except LockTimeout as e:
            errors.append(f"{hid}: {e}")
            break
        except DatastoreError as e:
            errors.append(f"{hid}: {e}")
            continue
        released.append(hid)
        addresses += [str(a.ip) for a in got]

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
    except DatastoreError as e:
        errors.append(f"affinity of {node}: {e}")
    return NodeRelease(node, released, addresses, deleted, unaffined, aff_deleted, errors)


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
