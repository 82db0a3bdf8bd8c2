"""Assigning addresses to one attachment: plan (pick a block for every address, claiming
one as needed), then write each allocation: one CAS of its block, nothing else. See
ipam/DESIGN.md "Assign".

The node's index (its affinity document) lists every block before the node's first
allocation there (a claim lists the block it created, a borrow the block it borrows from),
so a release by handle finds every address of the attachment in the blocks the node lists.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bundle.types import JSON, IPAddress
from datastore.cas import cas
from ipam.core import affinity, legacy
from ipam.core.block import Block
from ipam.core.candidates import (
    BORROW,
    CLAIM,
    GONE,
    ORPHAN,
    OWN,
    Candidate,
    Candidates,
)
from ipam.core.docs import WARNING, Docs, Op, log
from ipam.core.errors import (
    AddressUnavailable,
    DatastoreError,
    InvalidConfig,
    NoAddressAvailable,
    RevisionConflict,
    StoreCorrupt,
)
from ipam.core.model import (
    Allocation,
    AssignRequest,
    Pool,
    Reserved,
    parse_ip,
    parse_network,
    split_handle_id,
)

_ATTR_TYPES = (str, int, float, bool, type(None))


class Pick:
    """A block with room and the ordinal to take, as read (not yet written)."""

    __slots__ = ("block", "family", "ordinal", "revision", "specific")

    def __init__(
        self, block: Block, revision: int, ordinal: int, family: int, specific: IPAddress | None
    ) -> None:
        self.block = block
        self.revision = revision
        self.ordinal = ordinal
        self.family = family
        self.specific = specific


def check(docs: Docs, req: AssignRequest) -> tuple[str, list[IPAddress], list[int]]:
    """What a request asks for, checked before anything is read: its handle, specific IPs
    and families (``InvalidConfig`` for a request that cannot be honoured)."""
    if not docs.node:
        raise InvalidConfig("the node name is required to assign addresses")
    hid = req.handle_id
    split_handle_id(hid)
    specific: list[IPAddress] = []
    for value in req.specific_ips:
        ip = parse_ip(value, "requested IP")
        if ip in specific:
            raise InvalidConfig("requested IP listed twice", str(ip))
        specific.append(ip)
    families = [f for f, want in ((4, req.want_v4), (6, req.want_v6)) if want]
    if not specific and not families:
        raise InvalidConfig("nothing to assign", "neither IPv4 nor IPv6 requested")
    mb = req.max_blocks_per_host
    if isinstance(mb, bool) or not isinstance(mb, int) or mb < 0:
        raise InvalidConfig("invalid max_blocks_per_host", repr(mb))
    Reserved.parse(req.reserved)
    attributes(docs, req.attrs)
    return hid, specific, families


def assign(docs: Docs, req: AssignRequest) -> list[Allocation]:
    hid, specific, families = check(docs, req)
    attrs = attributes(docs, req.attrs)
    with docs.store.lock():
        op = Op(Reserved.parse(req.reserved), bool(req.strict_affinity), req.max_blocks_per_host)
        return _assign_locked(docs, op, req, hid, attrs, specific, families)


def _assign_locked(
    docs: Docs,
    op: Op,
    req: AssignRequest,
    hid: str,
    attrs: JSON,
    specific: list[IPAddress],
    families: list[int],
) -> list[Allocation]:
    legacy.migrate(docs, op)
    held = docs.held(hid, docs.my_affinity(op).indexed(), op)
    if held:
        # ADD-7 (cni_protocol/CONFORMANCE.md): a repeated ADD gets what it has, no second
        # address.
        return held
    if specific:
        picks = [pick_specific(docs, op, ip) for ip in specific]
    else:
        for fam in families:
            cidrs = req.v4_pools if fam == 4 else req.v6_pools
            op.pools[fam] = request_pools(docs, cidrs, fam)
        picks = [pick_auto(docs, op, fam) for fam in families]
    done: list[Allocation] = []
    try:
        for pick in picks:
            done.append(_commit(docs, op, hid, attrs, pick))
    except BaseException:
        from ipam.core import release  # rare: imported only when needed (start-up cost)

        release.rollback(docs, op, hid, done)
        raise
    return done


def request_pools(docs: Docs, cidrs: Sequence[str], fam: int) -> list[Pool]:
    if not cidrs:
        raise InvalidConfig(f"no IPv{fam} pool given")
    out: list[Pool] = []
    disabled: list[str] = []
    for text in cidrs:
        net = parse_network(text, "pool CIDR")
        if net.version != fam:
            raise InvalidConfig(f"not an IPv{fam} pool", str(net))
        pool = docs.pool(str(net))
        if pool is None:
            raise InvalidConfig(
                "pool not found in the IPAM datastore",
                f"{net} (pools come from the configuration or `tabbyctl pool add`)",
            )
        if pool.disabled:
            disabled.append(pool.cidr)
        elif all(p.cidr != pool.cidr for p in out):
            out.append(pool)
    if not out:
        raise NoAddressAvailable(f"every IPv{fam} pool is disabled", ", ".join(disabled))
    return out


def attributes(docs: Docs, given: Mapping[str, object] | None) -> JSON:
    attrs = dict(given or {})
    for k, v in attrs.items():
        if not isinstance(k, str) or not isinstance(v, _ATTR_TYPES):
            raise InvalidConfig("allocation attributes must be JSON scalars", repr(k))
        if isinstance(v, float) and v != v:  # NaN
            raise InvalidConfig("allocation attributes must be JSON scalars", repr(k))
    attrs.setdefault("node", docs.node)
    attrs.setdefault("time", docs.clock())
    return attrs


# -- picking a block ----------------------------------------------------------------------


def pick_auto(docs: Docs, op: Op, fam: int) -> Pick:
    """The first usable candidate (``candidates.Candidates``), acting on each on the way."""
    pools = op.pools[fam]
    cands = Candidates(
        docs,
        fam,
        pools,
        op.reserved,
        strict=op.strict,
        max_blocks=op.max_blocks,
        aff=lambda: docs.my_affinity(op),
        closed=op.closed,
        op=op,
    )
    gone: list[str] = []
    for c in cands:
        if c.kind == GONE:
            gone.append(c.cidr)
            continue
        if gone:  # leaving the listed blocks: forget those that are not ours any more
            _forget_gone(docs, op, gone)
            gone = []
        pick = _take(docs, op, fam, c)
        if pick is not None:
            return pick
    if gone:
        _forget_gone(docs, op, gone)
    why = []
    if cands.limited:
        why.append(f"max_blocks_per_host {op.max_blocks} reached")
    if op.strict:
        why.append("strict_affinity: no borrowing")
    raise NoAddressAvailable(
        f"no free IPv{fam} address",
        f"pools {', '.join(sorted(p.cidr for p in pools))} for node {docs.node}"
        + (f" ({'; '.join(why)})" if why else ""),
    )


def _forget_gone(docs: Docs, op: Op, cidrs: list[str]) -> None:
    """Unlist blocks found gone or another node's: each read again from the store itself
    first (a served call may have read a stale "gone"), and kept while it holds an address
    made for this node (then it is listed as borrowed: I2)."""
    drop: list[str] = []
    lent: list[str] = []
    for cidr in cidrs:
        try:
            got = docs.block(cidr, fresh=True)
        except StoreCorrupt:
            continue  # cannot prove it gone: keep it listed
        if got is None:
            drop.append(cidr)
        elif got[0].node != docs.node:
            (lent if got[0].holds_for(docs.node) else drop).append(cidr)
    if drop or lent:
        affinity.unlist(docs, op, drop, lent)


def _take(docs: Docs, op: Op, fam: int, c: Candidate) -> Pick | None:
    """Act on one candidate: a Pick, or None to go on."""
    if c.kind == CLAIM:
        got = _claim(docs, op, c)
        if got is None:
            return None
        o = got[0].first_usable(op.reserved)
        return None if o is None else Pick(got[0], got[1], o, fam, None)
    blk = c.block
    assert blk is not None
    if c.kind == ORPHAN:
        if not affinity.adopt(docs, op, blk, c.cursor()) or c.ordinal is None:
            return None
    elif c.kind == BORROW:
        why = docs.gate(blk)
        if why is not None:
            log(WARNING, "not borrowing from block %s: %s", c.cidr, why)
            if docs.pool_refuses(blk.pool) is not None:
                op.closed.add(blk.pool)  # none of its blocks will do
            return None
        affinity.borrow(docs, op, c.cidr)  # listed before the allocation (I2)
    else:
        assert c.kind == OWN
    assert c.ordinal is not None
    return Pick(blk, c.revision, c.ordinal, fam, None)


def _claim(docs: Docs, op: Op, c: Candidate) -> tuple[Block, int] | None:
    """CAS-create block ``c`` affine to this node, pass it through the pool gate, list it.
    None when another node was first (or the pool became unusable)."""
    pool = c.pool
    assert pool is not None
    blk = Block.new(pool.block_network(c.index), pool.cidr, docs.node)
    try:
        rev = docs.store.put("block", c.cidr, blk.to_data(), None)
    except StoreCorrupt as e:
        log(WARNING, "skipping unreadable block while claiming: %s", e)
        return None
    except RevisionConflict:
        # Created since the walk looked: another node's, or ours from a killed claim.
        got = docs.try_block(c.cidr)
        ours = got is not None and got[0].node == docs.node and got[0].pool == pool.cidr
        if got is not None and ours and affinity.adopt(docs, op, got[0], c.cursor()):
            return got
        return None
    why = docs.gate(blk)
    if why is not None:
        op.closed.add(pool.cidr)
        _undo_create(docs, blk, rev, why)
        return None
    affinity.claimed(docs, op, blk, c.cursor())
    return blk, rev


def _undo_create(docs: Docs, blk: Block, rev: int, why: str) -> None:
    """Delete a block this call created that failed the pool gate (if nobody wrote it
    since: then someone saw the pool usable after us, and the block stays)."""
    log(WARNING, "removing new block %s again: %s", blk.cidr, why)
    try:
        docs.store.delete("block", blk.cidr, rev)
    except DatastoreError as e:
        log(WARNING, "block %s stays: %s", blk.cidr, e)


def _specific_pool(docs: Docs, op: Op, ip: IPAddress) -> Pool:
    """The pool a requested IP is in; AddressUnavailable when there is none, or it is
    disabled, or the IP is reserved."""
    pool = docs.pool_containing(ip)
    if pool is None:
        raise AddressUnavailable("requested IP is outside every pool", str(ip))
    if pool.disabled:
        raise AddressUnavailable("requested IP is in a disabled pool", f"{ip} in {pool.cidr}")
    if op.reserved.contains(ip):
        raise AddressUnavailable("requested IP is reserved", str(ip))
    return pool


def pick_specific(docs: Docs, op: Op, ip: IPAddress) -> Pick:
    pool = _specific_pool(docs, op, ip)
    net = pool.block_network(pool.block_index(ip))
    cidr = str(net)

    def read() -> tuple[Block, int] | None:
        return docs.block(cidr)

    def write(got: tuple[Block, int] | None) -> tuple[Block, int, bool]:
        if got is not None:
            return got[0], got[1], False
        fam = pool.version
        limited = bool(op.max_blocks) and affinity.count_blocks(docs, op, fam) >= op.max_blocks
        if limited and op.strict:
            raise AddressUnavailable(
                "requested IP needs a new block",
                f"{ip}: max_blocks_per_host {op.max_blocks} reached, strict_affinity",
            )
        # Over the limit (not strict): a block without affinity, i.e. borrowed.
        blk = Block.new(net, pool.cidr, None if limited else docs.node)
        return blk, docs.store.put("block", cidr, blk.to_data(), None), True

    blk, rev, created = cas(read, write, "block", cidr)
    if created:
        why = docs.gate(blk)
        if why is not None:
            _undo_create(docs, blk, rev, why)
            raise AddressUnavailable("requested IP's pool is not usable", f"{ip}: {why}")
        if blk.node:
            affinity.add(docs, op, cidr)
        else:
            affinity.borrow(docs, op, cidr)
    elif blk.node == docs.node:
        if cidr not in docs.my_affinity(op).blocks and not affinity.adopt(docs, op, blk):
            raise AddressUnavailable("requested IP's pool is not usable", str(ip))
    elif op.strict:
        raise AddressUnavailable(
            "requested IP is in another node's block (strict_affinity)",
            f"{ip} in {cidr} ({blk.affinity})",
        )
    else:
        why = docs.gate(blk)
        if why is not None:
            raise AddressUnavailable("requested IP's pool is not usable", f"{ip}: {why}")
    o = blk.ordinal(ip)
    if blk.allocations[o] is not None:
        raise AddressUnavailable("requested IP is in use", str(ip))
    if blk.node != docs.node:
        affinity.borrow(docs, op, cidr)  # listed before the allocation (I2)
    return Pick(blk, rev, o, pool.version, ip)


# -- writing an allocation ------------------------------------------------------------------


def _commit(docs: Docs, op: Op, hid: str, attrs: JSON, pick: Pick) -> Allocation:
    """Write the allocation at the revision the pick was read at; a lost CAS picks again
    from fresh reads."""
    tried: list[Pick] = []

    def read() -> Pick:
        if not tried:  # first attempt: the pick as planned
            tried.append(pick)
            return pick
        old = tried[-1]
        op.blocks.clear()  # the write lost: what this operation read is stale
        if old.specific is not None:
            new = pick_specific(docs, op, old.specific)
        else:
            new = pick_auto(docs, op, old.family)
        tried.append(new)
        return new

    def write(p: Pick) -> tuple[Block, Pick]:
        new = p.block.copy()
        # The allocation's sequence number must never repeat for its address, also when the
        # block is deleted (release_node, delete_pool) and created again from seq 0: so it
        # is above the revision it is based on (revisions only grow and never repeat for a
        # key), which is above every sequence number an earlier block of that key reached.
        new.seq = max(new.seq, p.revision)
        new.assign(p.ordinal, hid, attrs, op.reserved)
        docs.store.put("block", p.block.cidr, new.to_data(), p.revision)
        return new, p

    new, p = cas(read, write, "block", pick.block.cidr)
    return docs.allocation(new, p.ordinal)
