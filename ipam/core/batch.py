"""Several attachments' addresses at once, one write per block (group commit).

When many ADDs arrive on one node together (the kubelet starts a Deployment's pods at once),
each would write the node's block once, one after the other. ``assign_many`` plans them all
under the node's lock on the blocks as the plan leaves them (each attachment sees the
ordinals the ones before it took), then writes each block it changed ONCE, a
compare-and-swap at the revision it read: a hundred pods landing in one block cost one
write, not a hundred. An attachment whose block's write lost (another node, or an operator,
wrote it meanwhile) is planned and written again on its own (``assign``: a CAS retry loop
as always); nothing of it was written, so that is a clean retry.

What is the same as ``assign`` (one by one, for each attachment): ADD-7 of
cni_protocol/CONFORMANCE.md (an attachment that holds addresses gets them back), the
candidates and their order, claims (a claim writes its block and the node's index at once,
as ever, so the attachments after it see it), borrows (listed in the index before the
write), dual-stack all or nothing (a family that cannot be had undoes the other in the
plan). Specific IPs are assigned one by one.
"""

from __future__ import annotations

from collections.abc import Sequence

from datastore.errors import RevisionConflict
from ipam.core import assign as single
from ipam.core import legacy
from ipam.core.block import Block
from ipam.core.docs import Docs, Op
from ipam.core.errors import DatastoreError
from ipam.core.model import Allocation, AssignRequest, Reserved

Result = list[Allocation] | DatastoreError


def assign_many(docs: Docs, reqs: Sequence[AssignRequest]) -> list[Result]:
    """Each request's allocations, or the error it alone failed with, in order."""
    results: list[Result | None] = [None] * len(reqs)
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, req in enumerate(reqs):
        try:
            single.check(docs, req)
        except DatastoreError as e:
            results[i] = e
            continue
        if req.specific_ips:
            groups.setdefault(("one", i), []).append(i)
        else:  # the plan's settings: one Op per group
            key = (
                tuple(map(str, req.reserved)),
                bool(req.strict_affinity),
                req.max_blocks_per_host,
            )
            groups.setdefault(key, []).append(i)
    again: list[int] = []
    for members in groups.values():
        if len(members) == 1 and reqs[members[0]].specific_ips:
            again += members
            continue
        try:
            again += _plan_and_write(docs, reqs, members, results)
        except DatastoreError as e:  # the lock, the node's index: every member fails so
            for i in members:
                if results[i] is None:
                    results[i] = e
    for i in again:  # on their own, from fresh reads
        try:
            results[i] = single.assign(docs, reqs[i])
        except DatastoreError as e:
            results[i] = e
    return [r if r is not None else DatastoreError("not assigned") for r in results]


def _plan_and_write(
    docs: Docs, reqs: Sequence[AssignRequest], members: list[int], results: list[Result | None]
) -> list[int]:
    """Plan ``members`` on one overlay of the node's blocks, write each changed block once;
    the members to assign again on their own (their block's write lost)."""
    first = reqs[members[0]]
    planned: dict[int, list[Allocation]] = {}
    with docs.store.lock():
        op = Op(
            Reserved.parse(first.reserved),
            bool(first.strict_affinity),
            first.max_blocks_per_host,
        )
        legacy.migrate(docs, op)
        dirty: dict[str, int] = {}  # block -> the revision the plan is based on
        for i in members:
            try:
                planned[i] = _plan_one(docs, op, reqs[i], dirty)
            except DatastoreError as e:
                results[i] = e
        lost: set[str] = set()
        failed: dict[str, DatastoreError] = {}
        for cidr, base in dirty.items():
            seen = op.blocks.get(cidr)
            assert seen is not None
            try:
                docs.store.put("block", cidr, seen[0].to_data(), base)
            except RevisionConflict:
                lost.add(cidr)
            except DatastoreError as e:  # not written: its members fail with it
                failed[cidr] = e
    again = []
    for i, got in planned.items():
        blocks = {str(a.block_cidr) for a in got}
        error = next((failed[c] for c in blocks if c in failed), None)
        if error is not None:
            results[i] = error
        elif lost.intersection(blocks):
            again.append(i)
        else:
            results[i] = got
    return again


def _plan_one(docs: Docs, op: Op, req: AssignRequest, dirty: dict[str, int]) -> list[Allocation]:
    """One attachment on the overlay: what it holds already, else an address per family
    from the blocks as the plan left them (nothing written but a claim's or a borrow's)."""
    hid = req.handle_id
    held = docs.held(hid, docs.my_affinity(op).indexed(), op)
    if held:
        return held  # ADD-7
    attrs = single.attributes(docs, req.attrs)
    families = [f for f, want in ((4, req.want_v4), (6, req.want_v6)) if want]
    done: list[tuple[str, Block, int, bool]] = []  # cidr, block before, base, was dirty
    out: list[Allocation] = []
    try:
        for fam in families:
            pools = req.v4_pools if fam == 4 else req.v6_pools
            op.pools[fam] = single.request_pools(docs, pools, fam)
            pick = single.pick_auto(docs, op, fam)
            cidr = pick.block.cidr
            base = dirty.get(cidr, pick.revision)
            new = pick.block.copy()
            new.seq = max(new.seq, base)
            new.assign(pick.ordinal, hid, attrs, op.reserved)
            done.append((cidr, pick.block, base, cidr in dirty))
            op.blocks[cidr] = (new, base)
            dirty[cidr] = base
            out.append(docs.allocation(new, pick.ordinal))
    except BaseException:
        for cidr, before, base, was_dirty in reversed(done):  # dual-stack: all or nothing
            op.blocks[cidr] = (before, base)
            if not was_dirty:
                dirty.pop(cidr, None)
        raise
    return out
