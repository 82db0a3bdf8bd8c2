"""The IPAM client: assign, release, look up, GC, readiness and operator views.

Every read-modify-write runs under ``store.lock()`` and every write is compare-and-swap with a
bounded retry. Write order (see ``ipam/DESIGN.md``) keeps the handle document a superset
index of its allocations, so a kill at any instant leaves only harmless leftovers.
"""

from __future__ import annotations

import ipaddress
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from ipam.core.block import Block
from ipam.core.errors import (
    AddressUnavailable,
    InvalidConfig,
    IpamError,
    LockTimeout,
    NoAddressAvailable,
    RevisionConflict,
    StoreCorrupt,
    StoreError,
)
from ipam.core.model import (
    Affinity,
    Allocation,
    AssignRequest,
    BlockUsage,
    GcReport,
    Handle,
    IPAddress,
    IPNetwork,
    IpOwner,
    Pool,
    PoolSpec,
    PoolUsage,
    Problem,
    Reserved,
    parse_ip,
    parse_network,
    split_handle_id,
)
from ipam.core.pools import start_index, walk

if TYPE_CHECKING:
    from ipam.store.base import Store

RETRIES = 20  # bounded CAS retries; under the lock a conflict means a foreign writer
PROBES = 3  # claim candidates tried one by one before listing every block key
_ATTR_TYPES = (str, int, float, bool, type(None))


def _log(level: int, msg: str, *args: object) -> None:
    import logging  # lazily: logging costs ~4 ms of start-up and is needed only here

    logging.getLogger("tabby.ipam").log(level, msg, *args)


_WARNING = 30
_INFO = 20


class _Pick(NamedTuple):
    """A block with room and the ordinal to take, as read (not yet written)."""

    block: Block
    revision: int
    ordinal: int
    family: int
    specific: IPAddress | None


class _Ctx:
    """Per-operation state: request settings and the cached affinity doc of this node."""

    __slots__ = ("aff", "aff_rev", "max_blocks", "pools", "reserved", "strict")

    def __init__(
        self,
        reserved: Reserved | None = None,
        strict: bool = False,
        max_blocks: int = 0,
    ) -> None:
        self.reserved = reserved if reserved is not None else Reserved.parse(())
        self.strict = strict
        self.max_blocks = max_blocks
        self.pools: dict[int, list[Pool]] = {4: [], 6: []}
        self.aff: Affinity | None = None
        self.aff_rev: int | None = None


def _family(cidr: str) -> int:
    return 6 if ":" in cidr else 4


def _inside(cidr: str, pools: list[Pool]) -> bool:
    """Whether block ``cidr`` lies in one of ``pools`` (cheaper than reading the block)."""
    try:
        net = ipaddress.ip_network(cidr)
    except ValueError:
        return False
    return any(net.version == p.version and net.network_address in p.network for p in pools)


class Ipam:
    """Block IPAM over a ``Store`` for one node.

    ``node`` may be "" for operations that do not need it (release, lookup, GC of every
    node's handles, operator views); ``assign`` and ``can_allocate`` need it.
    """

    def __init__(self, store: Store, node: str, *, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(node, str) or ":" in node:
            raise InvalidConfig("invalid node name", repr(node))
        self.store = store
        self.node = node
        self.clock = clock
        self._pool_nets: dict[str, IPNetwork] = {}

    # == pools ============================================================================

    def ensure_pools(self, pools: Sequence[PoolSpec]) -> None:
        """Create the configured pools the store lacks (validated; overlap = InvalidConfig).

        An existing pool keeps its stored block size and disabled flag.
        """
        wanted: dict[str, Pool] = {}
        for spec in pools:
            pool = Pool.from_spec(spec.cidr, spec.block_size, spec.disabled)
            other = wanted.get(pool.cidr)
            if other is not None and other.block_size != pool.block_size:
                raise InvalidConfig("pool configured twice", pool.cidr)
            wanted[pool.cidr] = pool
        for a in wanted.values():
            for b in wanted.values():
                if a is not b and a.network.overlaps(b.network):
                    raise InvalidConfig("configured pools overlap", f"{a.cidr} and {b.cidr}")
        if all(self._pool_or_none(c) is not None for c in wanted):
            return  # fast path: every pool exists (checked for overlap when it was made)
        with self.store.lock():
            existing = self._all_pools()
            for pool in wanted.values():
                if pool.cidr in existing:
                    stored = existing[pool.cidr]
                    if stored.block_size != pool.block_size:
                        _log(
                            _WARNING,
                            "pool %s exists with block size %d; configured %d ignored",
                            pool.cidr,
                            stored.block_size,
                            pool.block_size,
                        )
                    continue
                for other in existing.values():
                    if other.network.overlaps(pool.network):
                        raise InvalidConfig(
                            "pool overlaps an existing pool", f"{pool.cidr} and {other.cidr}"
                        )
                self.store.put("pool", pool.cidr, pool.to_data(), None)
                existing[pool.cidr] = pool
                _log(_INFO, "created pool %s (block size %d)", pool.cidr, pool.block_size)

    def list_pools(self) -> list[Pool]:
        return sorted(
            self._all_pools().values(),
            key=lambda p: (p.version, int(p.network.network_address)),
        )

    def add_pool(self, spec: PoolSpec) -> None:
        """Create one pool; InvalidConfig if it exists or overlaps another."""
        pool = Pool.from_spec(spec.cidr, spec.block_size, spec.disabled)
        with self.store.lock():
            existing = self._all_pools()
            for other in existing.values():
                if other.network.overlaps(pool.network):
                    raise InvalidConfig("pool overlaps an existing pool", other.cidr)
            self.store.put("pool", pool.cidr, pool.to_data(), None)

    def set_pool_disabled(self, cidr: str, disabled: bool) -> None:
        """A disabled pool serves no new address; existing allocations stay."""
        key = str(parse_network(cidr, "pool CIDR"))
        with self.store.lock():
            for _ in range(RETRIES):
                doc = self.store.get("pool", key)
                if doc is None:
                    raise InvalidConfig("no such pool", key)
                pool = Pool.from_data(doc.data, self.store.location("pool", key))
                if pool.disabled == disabled:
                    return
                pool.disabled = disabled
                try:
                    self.store.put("pool", key, pool.to_data(), doc.revision)
                    return
                except RevisionConflict:
                    continue
            raise RevisionConflict("pool changed too often", key)

    def delete_pool(self, cidr: str) -> int:
        """Delete a pool and its (empty) blocks; InvalidConfig while any address is in use.

        Returns the number of blocks removed.
        """
        key = str(parse_network(cidr, "pool CIDR"))
        with self.store.lock():
            doc = self.store.get("pool", key)
            if doc is None:
                raise InvalidConfig("no such pool", key)
            pool = Pool.from_data(doc.data, self.store.location("pool", key))
            blocks: list[tuple[Block, int]] = []
            for bkey in self.store.list_keys("block"):
                if _family(bkey) != pool.version:
                    continue
                got = self._load_block(bkey)
                if got is None or got[0].pool != key:
                    continue
                if not got[0].is_empty():
                    raise InvalidConfig("pool in use", f"block {bkey} has allocations")
                blocks.append(got)
            # Pool first: no new block can then be claimed in it, and a block left by a
            # crash in between is an empty block outside every pool (check reports it).
            self.store.delete("pool", key, doc.revision)
            nodes: dict[str, list[str]] = {}
            for blk, rev in blocks:
                self.store.delete("block", blk.cidr, rev)
                if blk.node:
                    nodes.setdefault(blk.node, []).append(blk.cidr)
            ctx = _Ctx()
            for node, cidrs in nodes.items():
                self._aff_modify(ctx, node, partial(_aff_forget, cidrs=cidrs, pool=key))
            return len(blocks)

    # == assign ===========================================================================

    def assign(self, req: AssignRequest) -> list[Allocation]:
        """Addresses for one attachment (see ``AssignRequest``).

        - ``specific_ips``: exactly those, from whatever block holds them (affine, unclaimed
          = claim it, another node's = borrow unless strict); one unavailable = nothing.
        - else one address per wanted family: affine blocks (FIFO), a newly claimed block,
          then one address borrowed from another node's block (unless strict_affinity).
        - all or nothing; a handle that already holds addresses gets them back unchanged.
        """
        if not self.node:
            raise InvalidConfig("the node name is required to assign addresses")
        hid = req.handle_id
        split_handle_id(hid)
        attrs = self._attrs(req.attrs)
        reserved = Reserved.parse(req.reserved)
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
        with self.store.lock():
            ctx = _Ctx(reserved, bool(req.strict_affinity), mb)
            return self._assign_locked(ctx, req, hid, attrs, specific, families)

    def _assign_locked(
        self,
        ctx: _Ctx,
        req: AssignRequest,
        hid: str,
        attrs: dict[str, Any],
        specific: list[IPAddress],
        families: list[int],
    ) -> list[Allocation]:
        stale: list[str] = []
        doc = self.store.get("handle", hid)
        if doc is not None:
            handle = Handle.from_data(doc.data, self.store.location("handle", hid))
            held, stale = self._held(handle)
            if held:
                # ADD-7: a repeated ADD gets what it has; no second address.
                if stale:
                    self._handle_update(hid, add=(), remove=stale)
                return held
        if specific:
            picks = [self._pick_specific(ctx, ip) for ip in specific]
        else:
            for fam in families:
                cidrs = req.v4_pools if fam == 4 else req.v6_pools
                ctx.pools[fam] = self._request_pools(cidrs, fam)
            picks = [self._pick_auto(ctx, fam) for fam in families]
        # The handle lists every block first: a kill after this leaves only leftovers.
        self._handle_update(hid, add=[p.block.cidr for p in picks], remove=stale)
        done: list[Allocation] = []
        try:
            for pick in picks:
                done.append(self._commit(ctx, hid, attrs, pick))
        except BaseException:
            self._rollback(ctx, hid, done)
            raise
        return done

    def _request_pools(self, cidrs: Sequence[str], fam: int) -> list[Pool]:
        if not cidrs:
            raise InvalidConfig(f"no IPv{fam} pool given")
        out: list[Pool] = []
        disabled: list[str] = []
        for text in cidrs:
            net = parse_network(text, "pool CIDR")
            if net.version != fam:
                raise InvalidConfig(f"not an IPv{fam} pool", str(net))
            pool = self._pool_or_none(str(net))
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

    def _attrs(self, given: Mapping[str, Any] | None) -> dict[str, Any]:
        attrs = dict(given or {})
        for k, v in attrs.items():
            if not isinstance(k, str) or not isinstance(v, _ATTR_TYPES):
                raise InvalidConfig("allocation attributes must be JSON scalars", repr(k))
            if isinstance(v, float) and v != v:  # NaN
                raise InvalidConfig("allocation attributes must be JSON scalars", repr(k))
        attrs.setdefault("node", self.node)
        attrs.setdefault("time", self.clock())
        return attrs

    # -- picking a block ------------------------------------------------------------------

    def _pick_auto(self, ctx: _Ctx, fam: int) -> _Pick:
        pools = ctx.pools[fam]
        in_pools = {p.cidr for p in pools}
        aff = self._aff(ctx)
        # 1. this node's blocks hinted to have room; FIFO inside each block
        gone: list[str] = []
        found: _Pick | None = None
        for cidr in list(aff.avail):
            if _family(cidr) != fam or not _inside(cidr, pools):
                continue
            try:
                got = self._load_block(cidr)
            except StoreCorrupt as e:
                _log(_WARNING, "skipping unreadable block: %s", e)
                continue
            if got is None or got[0].node != self.node:
                gone.append(cidr)
                continue
            blk, rev = got
            if blk.pool not in in_pools:
                continue
            o = blk.first_usable(ctx.reserved)
            if o is None:
                self._mark_full(ctx, blk, rev)
                continue
            found = _Pick(blk, rev, o, fam, None)
            break
        if gone:
            self._aff_modify(ctx, self.node, partial(_aff_forget, cidrs=gone))
        if found is not None:
            return found
        # 2. claim a new block (bounded by max_blocks_per_host)
        limited = bool(ctx.max_blocks) and self._count_blocks(ctx, fam) >= ctx.max_blocks
        if not limited:
            for pool in pools:
                claimed = self._claim(ctx, pool)
                if claimed is not None:
                    blk, rev = claimed
                    o = blk.first_usable(ctx.reserved)
                    if o is not None:
                        return _Pick(blk, rev, o, fam, None)
        # 3. hints are only hints: re-read the blocks hinted full before going further
        aff = self._aff(ctx)
        avail = set(aff.avail)
        for cidr in [c for c in aff.blocks if c not in avail]:
            if _family(cidr) != fam or not _inside(cidr, pools):
                continue
            got = self._try_block(cidr)
            if got is None:
                continue
            blk, rev = got
            if blk.node != self.node or blk.pool not in in_pools:
                continue
            o = blk.first_usable(ctx.reserved)
            if o is not None:
                self._aff_modify(ctx, self.node, partial(_aff_unfull, cidrs=[cidr]))
                return _Pick(blk, rev, o, fam, None)
        # 4. every block: adopt our own unlisted ones (crash leftover), else borrow
        mine = set(aff.blocks)
        for cidr in self.store.list_keys("block"):
            if cidr in mine or _family(cidr) != fam:
                continue
            got = self._try_block(cidr)
            if got is None:
                continue
            blk, rev = got
            if blk.pool not in in_pools:
                continue
            if blk.node == self.node:
                self._adopt(ctx, blk)
            elif ctx.strict:
                continue
            o = blk.first_usable(ctx.reserved)
            if o is not None:
                return _Pick(blk, rev, o, fam, None)
        why = []
        if limited:
            why.append(f"max_blocks_per_host {ctx.max_blocks} reached")
        if ctx.strict:
            why.append("strict_affinity: no borrowing")
        raise NoAddressAvailable(
            f"no free IPv{fam} address",
            f"pools {', '.join(sorted(in_pools))} for node {self.node}"
            + (f" ({'; '.join(why)})" if why else ""),
        )

    def _claim(self, ctx: _Ctx, pool: Pool) -> tuple[Block, int] | None:
        """Create the next free block of ``pool`` affine to this node, or adopt our own
        orphan met on the way; None when the pool has no block left to claim."""
        aff = self._aff(ctx)
        n = pool.block_count
        start = aff.cursor.get(pool.cidr)
        if start is None or not 0 <= start < n:
            start = start_index(self.node, pool)
        known = set(aff.blocks)
        existing: set[str] | None = None
        conflicts = 0
        for idx in walk(pool, start, ctx.reserved):
            net = pool.block_network(idx)
            cidr = str(net)
            if cidr in known or (existing is not None and cidr in existing):
                continue
            blk = Block.new(net, pool.cidr, self.node)
            try:
                rev = self.store.put("block", cidr, blk.to_data(), None)
            except StoreCorrupt as e:
                _log(_WARNING, "skipping unreadable block while claiming: %s", e)
                continue
            except RevisionConflict:
                conflicts += 1
                if existing is None:
                    got = self._try_block(cidr)
                    if got is not None and got[0].node == self.node and got[0].pool == pool.cidr:
                        self._adopt(ctx, got[0], cursor=(pool.cidr, (idx + 1) % n))
                        return got
                    if conflicts >= PROBES:
                        existing = set(self.store.list_keys("block"))
                continue
            cursor = (pool.cidr, (idx + 1) % n)
            self._aff_modify(ctx, self.node, partial(_aff_add, cidr=cidr, cursor=cursor))
            _log(_INFO, "node %s claimed block %s", self.node, cidr)
            return blk, rev
        return None

    def _pick_specific(self, ctx: _Ctx, ip: IPAddress) -> _Pick:
        pool = self._pool_containing(ip)
        if pool is None:
            raise AddressUnavailable("requested IP is outside every pool", str(ip))
        if pool.disabled:
            raise AddressUnavailable("requested IP is in a disabled pool", f"{ip} in {pool.cidr}")
        if ctx.reserved.contains(ip):
            raise AddressUnavailable("requested IP is reserved", str(ip))
        net = pool.block_network(pool.block_index(ip))
        cidr = str(net)
        for _ in range(RETRIES):
            got = self._load_block(cidr)
            if got is None:
                fam = pool.version
                limited = bool(ctx.max_blocks) and self._count_blocks(ctx, fam) >= ctx.max_blocks
                if limited and ctx.strict:
                    raise AddressUnavailable(
                        "requested IP needs a new block",
                        f"{ip}: max_blocks_per_host {ctx.max_blocks} reached, strict_affinity",
                    )
                # Over the limit (not strict): a block without affinity, i.e. borrowed.
                blk = Block.new(net, pool.cidr, None if limited else self.node)
                try:
                    rev = self.store.put("block", cidr, blk.to_data(), None)
                except RevisionConflict:
                    continue
                if not limited:
                    self._aff_modify(ctx, self.node, partial(_aff_add, cidr=cidr, cursor=None))
                got = (blk, rev)
            blk, rev = got
            if blk.node == self.node:
                if cidr not in self._aff(ctx).blocks:
                    self._adopt(ctx, blk)
            elif ctx.strict:
                raise AddressUnavailable(
                    "requested IP is in another node's block (strict_affinity)",
                    f"{ip} in {cidr} ({blk.affinity})",
                )
            o = blk.ordinal(ip)
            if blk.allocations[o] is not None:
                raise AddressUnavailable("requested IP is in use", str(ip))
            return _Pick(blk, rev, o, pool.version, ip)
        raise RevisionConflict("block changed too often", cidr)

    # -- writing an allocation ----------------------------------------------------------

    def _commit(self, ctx: _Ctx, hid: str, attrs: dict[str, Any], pick: _Pick) -> Allocation:
        for _ in range(RETRIES):
            blk = pick.block
            new = blk.copy()
            new.assign(pick.ordinal, hid, attrs, ctx.reserved)
            try:
                self.store.put("block", blk.cidr, new.to_data(), pick.revision)
            except RevisionConflict:
                # Someone else wrote the block: choose again from fresh reads.
                if pick.specific is not None:
                    pick = self._pick_specific(ctx, pick.specific)
                else:
                    pick = self._pick_auto(ctx, pick.family)
                if pick.block.cidr != blk.cidr:
                    self._handle_update(hid, add=[pick.block.cidr], remove=())
                continue
            if new.full and not blk.full:
                self._hint_full(ctx, new)
            return self._allocation(new, pick.ordinal)
        raise RevisionConflict("block changed too often", pick.block.cidr)

    def _rollback(self, ctx: _Ctx, hid: str, done: list[Allocation]) -> None:
        """Undo this call's allocations (dual-stack all or nothing); never raises."""
        try:
            for a in reversed(done):
                self._release_in_block(
                    ctx, str(a.block_cidr), partial(_ordinal_if, ip=a.ip, hid=hid, seq=a.seq)
                )
            self._handle_prune(hid, None)
        except IpamError as e:
            _log(_WARNING, "rollback of %s incomplete (DEL or GC will finish it): %s", hid, e)

    # == release ==========================================================================

    def release_handle(self, handle_id: str) -> list[Allocation]:
        """Release every address of the handle and delete it. Not found = [] (success)."""
        split_handle_id(handle_id)
        with self.store.lock():
            return self._release_handle_locked(_Ctx(), handle_id)

    def _release_handle_locked(self, ctx: _Ctx, hid: str) -> list[Allocation]:
        for _ in range(RETRIES):
            doc = self.store.get("handle", hid)
            if doc is None:
                return []
            handle = Handle.from_data(doc.data, self.store.location("handle", hid))
            released: list[Allocation] = []
            failed: list[str] = []
            error: IpamError | None = None
            # Allocations first, then the handle: the handle stays a superset index.
            for cidr in handle.blocks:
                try:
                    released += self._release_in_block(ctx, cidr, lambda b: b.ordinals_of(hid))
                except IpamError as e:
                    failed.append(cidr)
                    error = error or e
            try:
                if failed:
                    handle.blocks = failed
                    self.store.put("handle", hid, handle.to_data(), doc.revision)
                else:
                    self.store.delete("handle", hid, doc.revision)
            except RevisionConflict:
                continue
            if error is not None:
                raise error
            return released
        raise RevisionConflict("handle changed too often", hid)

    def release_ip(self, ip: IPAddress | str, *, expected_seq: int | None = None) -> bool:
        """Release one address. False when it was not allocated, or when ``expected_seq``
        is given and the allocation there is a newer one (a stale release)."""
        addr = parse_ip(ip)
        with self.store.lock():
            ctx = _Ctx()
            cidr = self._block_cidr_for(addr)
            if cidr is None:
                return False
            got = self._load_block(cidr)
            if got is None:
                return False
            blk = got[0]
            alloc = blk.allocations[blk.ordinal(addr)]
            if alloc is None or (expected_seq is not None and alloc["seq"] != expected_seq):
                return False
            hid: str = alloc["handle"]
            seq: int = alloc["seq"]
            done = self._release_in_block(
                ctx, cidr, partial(_ordinal_if, ip=addr, hid=hid, seq=seq)
            )
            if not done:
                return False
            self._handle_prune(hid, [cidr])
            return True

    def _release_in_block(
        self, ctx: _Ctx, cidr: str, select: Callable[[Block], list[int]]
    ) -> list[Allocation]:
        for _ in range(RETRIES):
            got = self._load_block(cidr)
            if got is None:
                return []
            blk, rev = got
            ordinals = select(blk)
            if not ordinals:
                return []
            new = blk.copy()
            for o in ordinals:
                new.release(o)
            try:
                self.store.put("block", cidr, new.to_data(), rev)
            except RevisionConflict:
                continue
            if blk.full and blk.node:
                self._hint_unfull(ctx, blk.node, cidr)
            return [self._allocation(blk, o) for o in ordinals]
        raise RevisionConflict("block changed too often", cidr)

    # == lookups ==========================================================================

    def get_handle(self, handle_id: str) -> list[Allocation]:
        """The handle's addresses (for CHECK); read-only, no lock. Unknown = []."""
        split_handle_id(handle_id)
        doc = self.store.get("handle", handle_id)
        if doc is None:
            return []
        handle = Handle.from_data(doc.data, self.store.location("handle", handle_id))
        return self._held(handle)[0]

    def who_owns(self, ip: IPAddress | str) -> IpOwner | None:
        addr = parse_ip(ip)
        cidr = self._block_cidr_for(addr)
        got = self._load_block(cidr) if cidr else None
        if got is None:
            return None
        blk = got[0]
        o = blk.ordinal(addr)
        a = blk.allocations[o]
        if a is None:
            return None
        return IpOwner(addr, blk.cidr, blk.node, a["handle"], a["seq"], dict(a.get("attrs", {})))

    def _held(self, handle: Handle) -> tuple[list[Allocation], list[str]]:
        """(allocations of the handle, listed blocks holding none of them)."""
        held: list[Allocation] = []
        empty: list[str] = []
        for cidr in handle.blocks:
            got = self._load_block(cidr)
            ordinals = got[0].ordinals_of(handle.id) if got else []
            if not ordinals:
                empty.append(cidr)
            elif got is not None:
                held += [self._allocation(got[0], o) for o in ordinals]
        held.sort(key=lambda a: (a.ip.version, int(a.ip)))
        return held, empty

    # == GC ===============================================================================

    def gc(
        self, network: str, valid: Collection[tuple[str, str]], *, grace_seconds: float
    ) -> GcReport:
        """Release this network's handles whose (container id, ifname) is not in ``valid``
        and that are older than ``grace_seconds``. Only this node's handles (every node's
        when ``node`` is ""). Goes on after individual errors and reports them. Also repairs
        this node's affinity hints and adopts its orphan blocks."""
        if not network or ":" in network:
            raise InvalidConfig("invalid network name", repr(network))
        report = GcReport([], [], [], [])
        prefix = network + ":"
        now = self.clock()
        keys = [k for k in self.store.list_keys("handle") if k.startswith(prefix)]
        for n, key in enumerate(keys):
            parts = key.split(":")
            if len(parts) != 3:
                report.errors.append(f"{key}: not a handle id")
                continue
            if (parts[1], parts[2]) in valid:
                report.kept.append(key)
                continue
            try:
                with self.store.lock():
                    doc = self.store.get("handle", key)
                    if doc is None:
                        continue
                    h = Handle.from_data(doc.data, self.store.location("handle", key))
                    if self.node and h.node and h.node != self.node:
                        continue
                    if grace_seconds > 0 and now - h.created < grace_seconds:
                        report.skipped_recent.append(key)
                        continue
                    self._release_handle_locked(_Ctx(), key)
                    report.released.append(key)
            except LockTimeout as e:
                report.errors.append(f"{key}: {e}; {len(keys) - n - 1} handle(s) not examined")
                return report
            except IpamError as e:
                report.errors.append(f"{key}: {e}")
        if self.node:
            try:
                with self.store.lock():
                    self._repair_affinity(_Ctx())
            except IpamError as e:
                report.errors.append(f"affinity of {self.node}: {e}")
        return report

    def _repair_affinity(self, ctx: _Ctx) -> None:
        aff = self._aff(ctx)
        gone: list[str] = []
        roomy: list[str] = []
        for cidr in aff.blocks:
            try:
                got = self._load_block(cidr)
            except StoreCorrupt as e:
                _log(_WARNING, "skipping unreadable block: %s", e)
                continue
            if got is None or got[0].node != self.node:
                gone.append(cidr)
            elif cidr not in aff.avail and got[0].first_usable(ctx.reserved) is not None:
                roomy.append(cidr)
        if gone or roomy:
            self._aff_modify(ctx, self.node, partial(_aff_repair, gone=gone, roomy=roomy))
        listed = set(self._aff(ctx).blocks)
        for cidr in self.store.list_keys("block"):
            if cidr in listed:
                continue
            got = self._try_block(cidr)
            if got is not None and got[0].node == self.node:
                self._adopt(ctx, got[0])

    # == readiness (STATUS) ===============================================================

    def can_allocate(
        self,
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
        """None when an ADD could get its addresses now, else why not. Read-only, no lock.

        A configured pool the store lacks counts as a fresh pool (ADD creates it).
        """
        if (need_v4 or need_v6) and not self.node:
            raise InvalidConfig("the node name is required")
        try:
            self.store.check_usable()
            res = Reserved.parse(reserved)
            for fam, cidrs, need, bs in (
                (4, v4_pools, need_v4, block_size_v4),
                (6, v6_pools, need_v6, block_size_v6),
            ):
                if need:
                    why = self._family_ready(
                        fam, cidrs, bs, bool(strict_affinity), max_blocks_per_host, res
                    )
                    if why:
                        return why
        except (StoreError, InvalidConfig) as e:
            return str(e)
        return None

    def _family_ready(
        self,
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
            pool = self._pool_or_none(str(net)) or Pool.from_spec(str(net), block_size)
            if not pool.disabled:
                pools.append(pool)
        if not pools:
            return f"no enabled IPv{fam} pool"
        in_pools = {p.cidr for p in pools}
        doc = self.store.get("affinity", self.node) if self.node else None
        aff = (
            Affinity.from_data(doc.data, self.store.location("affinity", self.node))
            if doc
            else Affinity.new(self.node)
        )
        mine = [c for c in aff.blocks if _family(c) == fam]
        hinted = set(aff.avail)
        for cidr in sorted(mine, key=lambda c: c not in hinted):  # likely-roomy blocks first
            got = self._try_block(cidr)
            if got is None:
                continue
            blk = got[0]
            usable = blk.node == self.node and blk.pool in in_pools
            if usable and blk.first_usable(reserved) is not None:
                return None
        limited = bool(max_blocks) and len(mine) >= max_blocks
        if not limited:
            for pool in pools:
                if self._claimable(pool, aff, reserved):
                    return None
        listed = set(aff.blocks)
        for cidr in self.store.list_keys("block"):
            if cidr in listed or _family(cidr) != fam:
                continue
            got = self._try_block(cidr)
            if got is None:
                continue
            blk = got[0]
            if blk.pool not in in_pools or (strict and blk.node != self.node):
                continue
            if blk.first_usable(reserved) is not None:
                return None
        why = f"no free IPv{fam} address for node {self.node} in {', '.join(sorted(in_pools))}"
        if limited:
            why += f" (max_blocks_per_host {max_blocks} reached)"
        if strict:
            why += " (strict_affinity)"
        return why

    def _claimable(self, pool: Pool, aff: Affinity, reserved: Reserved) -> bool:
        start = aff.cursor.get(pool.cidr)
        if start is None or not 0 <= start < pool.block_count:
            start = start_index(self.node, pool)
        existing: set[str] | None = None
        probes = 0
        for idx in walk(pool, start, reserved):
            cidr = str(pool.block_network(idx))
            if existing is None:
                try:
                    if self.store.get("block", cidr) is None:
                        return True
                except StoreCorrupt:
                    pass
                probes += 1
                if probes >= PROBES:
                    existing = set(self.store.list_keys("block"))
            elif cidr not in existing:
                return True
        return False

    # == operator views ===================================================================

    def pool_usage(self, reserved: Sequence[str | IPNetwork | IPAddress] = ()) -> list[PoolUsage]:
        """Per pool: TOTAL / IN USE / RESERVED (not in use) / FREE, and blocks in the store."""
        res = Reserved.parse(reserved)
        pools = self.list_pools()
        in_use: dict[str, int] = {p.cidr: 0 for p in pools}
        reserved_used: dict[str, int] = {p.cidr: 0 for p in pools}
        blocks: dict[str, int] = {p.cidr: 0 for p in pools}
        for blk in self._all_blocks():
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

    def block_usage(self, reserved: Sequence[str | IPNetwork | IPAddress] = ()) -> list[BlockUsage]:
        res = Reserved.parse(reserved)
        out = [
            BlockUsage(blk.cidr, blk.pool, blk.node, blk.in_use(), blk.usable_count(res))
            for blk in self._all_blocks()
        ]
        out.sort(key=lambda b: (_family(b.cidr), int(ipaddress.ip_network(b.cidr).network_address)))
        return out

    def allocations(self) -> list[IpOwner]:
        """Every allocation in the store (unreadable blocks skipped), by address."""
        out = [
            IpOwner(blk.ip(o), blk.cidr, blk.node, a["handle"], a["seq"], dict(a.get("attrs", {})))
            for blk in self._all_blocks()
            for o, a in enumerate(blk.allocations)
            if a is not None
        ]
        out.sort(key=lambda x: (x.ip.version, int(x.ip)))
        return out

    def check(self) -> list[Problem]:
        from ipam.core.check import check_consistency

        return check_consistency(self.store)

    # == store helpers ====================================================================

    def _load_block(self, cidr: str) -> tuple[Block, int] | None:
        doc = self.store.get("block", cidr)
        if doc is None:
            return None
        blk = Block.from_data(doc.data, self.store.location("block", cidr))
        if blk.cidr != cidr:
            raise StoreCorrupt(self.store.location("block", cidr), f"holds block {blk.cidr}")
        return blk, doc.revision

    def _try_block(self, cidr: str) -> tuple[Block, int] | None:
        """Like ``_load_block``, but a corrupt block is logged and skipped (None): for
        scans that must not stop on another block's damage."""
        try:
            return self._load_block(cidr)
        except StoreCorrupt as e:
            _log(_WARNING, "skipping unreadable block: %s", e)
            return None

    def _all_blocks(self) -> list[Block]:
        out = []
        for cidr in self.store.list_keys("block"):
            got = self._try_block(cidr)
            if got is not None:
                out.append(got[0])
        return out

    def _pool_or_none(self, cidr: str) -> Pool | None:
        doc = self.store.get("pool", cidr)
        return None if doc is None else Pool.from_data(doc.data, self.store.location("pool", cidr))

    def _all_pools(self) -> dict[str, Pool]:
        out = {}
        for key in self.store.list_keys("pool"):
            pool = self._pool_or_none(key)
            if pool is not None:
                out[pool.cidr] = pool
        return out

    def _pool_containing(self, ip: IPAddress) -> Pool | None:
        corrupt: StoreCorrupt | None = None
        for key in self.store.list_keys("pool"):
            try:
                net = ipaddress.ip_network(key)
            except ValueError:
                continue
            if net.version == ip.version and ip in net:
                try:
                    return self._pool_or_none(key)
                except StoreCorrupt as e:
                    corrupt = e
        if corrupt is not None:
            raise corrupt
        return None

    def _block_cidr_for(self, ip: IPAddress) -> str | None:
        pool = self._pool_containing(ip)
        if pool is not None:
            return str(pool.block_network(pool.block_index(ip)))
        for key in self.store.list_keys("block"):  # its pool was deleted
            try:
                if ip in ipaddress.ip_network(key):
                    return key
            except (ValueError, TypeError):
                continue
        return None

    def _pool_net(self, cidr: str) -> IPNetwork:
        net = self._pool_nets.get(cidr)
        if net is None:
            net = self._pool_nets[cidr] = ipaddress.ip_network(cidr)
        return net

    def _allocation(self, blk: Block, o: int) -> Allocation:
        a = blk.allocations[o]
        assert a is not None
        return Allocation(blk.ip(o), blk.network, self._pool_net(blk.pool), a["handle"], a["seq"])

    # -- handle document --------------------------------------------------------------

    def _handle_update(self, hid: str, *, add: Iterable[str], remove: Iterable[str]) -> None:
        add = list(add)
        drop = set(remove) - set(add)
        for _ in range(RETRIES):
            doc = self.store.get("handle", hid)
            try:
                if doc is None:
                    if not add:
                        return
                    h = Handle.new(hid, self.node, self.clock())
                    h.blocks = list(dict.fromkeys(add))
                    self.store.put("handle", hid, h.to_data(), None)
                    return
                h = Handle.from_data(doc.data, self.store.location("handle", hid))
                blocks = [b for b in h.blocks if b not in drop]
                blocks += [b for b in dict.fromkeys(add) if b not in blocks]
                if blocks == h.blocks:
                    return
                h.blocks = blocks
                self.store.put("handle", hid, h.to_data(), doc.revision)
                return
            except RevisionConflict:
                continue
        raise RevisionConflict("handle changed too often", hid)

    def _handle_prune(self, hid: str, cidrs: list[str] | None) -> None:
        """Drop listed blocks (``cidrs``, or all when None) that hold nothing of the handle;
        delete the handle when it lists no block any more."""
        for _ in range(RETRIES):
            doc = self.store.get("handle", hid)
            if doc is None:
                return
            h = Handle.from_data(doc.data, self.store.location("handle", hid))
            keep = []
            for cidr in h.blocks:
                if cidrs is None or cidr in cidrs:
                    try:
                        got = self._load_block(cidr)
                    except StoreCorrupt:
                        keep.append(cidr)  # cannot prove it empty: keep indexing it
                        continue
                    if got is None or not got[0].ordinals_of(hid):
                        continue
                keep.append(cidr)
            try:
                if not keep:
                    self.store.delete("handle", hid, doc.revision)
                elif keep != h.blocks:
                    h.blocks = keep
                    self.store.put("handle", hid, h.to_data(), doc.revision)
                return
            except RevisionConflict:
                continue
        raise RevisionConflict("handle changed too often", hid)

    # -- affinity document --------------------------------------------------------------

    def _aff(self, ctx: _Ctx) -> Affinity:
        if ctx.aff is None:
            doc = self.store.get("affinity", self.node)
            if doc is None:
                ctx.aff, ctx.aff_rev = Affinity.new(self.node), None
            else:
                loc = self.store.location("affinity", self.node)
                ctx.aff, ctx.aff_rev = Affinity.from_data(doc.data, loc), doc.revision
        return ctx.aff

    def _aff_modify(self, ctx: _Ctx, node: str, change: Callable[[Affinity], bool]) -> None:
        """CAS-update ``node``'s affinity doc with ``change`` (True = changed). Another
        node's doc is only edited if it exists (hints), this node's is created."""
        mine = node == self.node
        for attempt in range(RETRIES):
            if mine and attempt == 0 and ctx.aff is not None:
                aff, rev = ctx.aff.copy(), ctx.aff_rev
            else:
                doc = self.store.get("affinity", node)
                if doc is None and not mine:
                    return
                loc = self.store.location("affinity", node)
                aff = Affinity.from_data(doc.data, loc) if doc else Affinity.new(node)
                rev = doc.revision if doc else None
            if not change(aff):
                if mine:
                    ctx.aff, ctx.aff_rev = aff, rev
                return
            try:
                new_rev = self.store.put("affinity", node, aff.to_data(), rev)
            except RevisionConflict:
                continue
            if mine:
                ctx.aff, ctx.aff_rev = aff, new_rev
            return
        raise RevisionConflict("affinity changed too often", node)

    def _count_blocks(self, ctx: _Ctx, fam: int) -> int:
        return sum(1 for c in self._aff(ctx).blocks if _family(c) == fam)

    def _adopt(self, ctx: _Ctx, blk: Block, cursor: tuple[str, int] | None = None) -> None:
        _log(_WARNING, "node %s adopts its unlisted block %s (crash leftover)", self.node, blk.cidr)
        self._aff_modify(ctx, self.node, partial(_aff_add, cidr=blk.cidr, cursor=cursor))

    def _mark_full(self, ctx: _Ctx, blk: Block, rev: int) -> None:
        """Found full while not hinted: set the block's flag and the owner's hint."""
        if not blk.full:
            new = blk.copy()
            new.full = True
            try:
                self.store.put("block", blk.cidr, new.to_data(), rev)
            except RevisionConflict:
                return  # it changed under us: no hint then
            blk = new
        self._hint_full(ctx, blk)

    def _hint_full(self, ctx: _Ctx, blk: Block) -> None:
        owner = blk.node
        if not owner:
            return
        try:
            self._aff_modify(ctx, owner, partial(_aff_full, cidr=blk.cidr))
        except StoreCorrupt as e:
            if owner == self.node:
                raise
            _log(_WARNING, "cannot update the hint of node %s: %s", owner, e)

    def _hint_unfull(self, ctx: _Ctx, owner: str, cidr: str) -> None:
        try:
            self._aff_modify(ctx, owner, partial(_aff_unfull, cidrs=[cidr]))
        except StoreCorrupt as e:
            _log(_WARNING, "cannot update the hint of node %s: %s", owner, e)


def _ordinal_if(blk: Block, *, ip: IPAddress, hid: str, seq: int) -> list[int]:
    """[ordinal of ip] if it is still the allocation (hid, seq), else []."""
    try:
        o = blk.ordinal(ip)
    except ValueError:
        return []
    a = blk.allocations[o]
    return [o] if a is not None and a["handle"] == hid and a["seq"] == seq else []


def _aff_add(aff: Affinity, *, cidr: str, cursor: tuple[str, int] | None) -> bool:
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


def _aff_forget(aff: Affinity, *, cidrs: Iterable[str], pool: str | None = None) -> bool:
    drop = set(cidrs)
    before = (len(aff.blocks), len(aff.avail), len(aff.cursor))
    aff.blocks = [c for c in aff.blocks if c not in drop]
    aff.avail = [c for c in aff.avail if c not in drop]
    if pool is not None:
        aff.cursor.pop(pool, None)
    return before != (len(aff.blocks), len(aff.avail), len(aff.cursor))


def _aff_full(aff: Affinity, *, cidr: str) -> bool:
    if cidr in aff.avail:
        aff.avail.remove(cidr)
        return True
    return False


def _aff_unfull(aff: Affinity, *, cidrs: Iterable[str]) -> bool:
    """Hint ``cidrs`` as having room; ``avail`` stays in claim order (older blocks first)."""
    avail = set(aff.avail)
    add = {c for c in cidrs if c not in avail}
    if not add:
        return False
    avail |= add
    aff.avail = [c for c in aff.blocks if c in avail]
    return True


def _aff_repair(aff: Affinity, gone: list[str], roomy: list[str]) -> bool:
    forgot = _aff_forget(aff, cidrs=gone)
    listed = set(aff.blocks)
    strays = [c for c in aff.avail if c not in listed]
    aff.avail = [c for c in aff.avail if c in listed]
    return _aff_unfull(aff, cidrs=roomy) or forgot or bool(strays)
