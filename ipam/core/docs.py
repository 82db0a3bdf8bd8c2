"""Typed reads of the store for one node, per-operation state, and the pool gate.

Every module of the core works through one ``Docs`` (the store, this node's name, the clock)
and, inside one operation, one ``Op`` (the request's settings and the cached affinity
document of this node). Nothing here writes.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from typing import TYPE_CHECKING

from bundle.types import IPAddress, IPNetwork
from ipam.core.block import Block
from ipam.core.errors import StoreCorrupt
from ipam.core.model import (
    Affinity,
    Allocation,
    Pool,
    Reserved,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from datastore.base import Doc, Store

WARNING = 30
INFO = 20


def log(level: int, msg: str, *args: object) -> None:
    import logging  # lazily: logging costs ~4 ms of start-up and is needed only here

    logging.getLogger("tabby.ipam").log(level, msg, *args)


def family(cidr: str) -> int:
    return 6 if ":" in cidr else 4


def inside(cidr: str, pools: list[Pool]) -> bool:
    """Whether block ``cidr`` lies in one of ``pools`` (cheaper than reading the block)."""
    try:
        net = ipaddress.ip_network(cidr)
    except ValueError:
        return False
    return any(net.version == p.version and net.network_address in p.network for p in pools)


class Op:
    """One operation's state: request settings and this node's affinity document as last
    read or written (``aff`` None = not read yet)."""

    __slots__ = (
        "aff",
        "aff_rev",
        "blocks",
        "closed",
        "max_blocks",
        "pools",
        "reserved",
        "strict",
    )

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
        self.closed: set[str] = set()  # pools found unusable by the gate during this op
        #: the node's blocks as this operation first read them (``Docs.held``), so that
        #: finding room reads none of them again; dropped when a write proved them stale
        self.blocks: dict[str, tuple[Block, int] | None] = {}


class Docs:
    """The store, read as typed documents, for node ``node`` ("" = no node)."""

    __slots__ = ("_pool_nets", "clock", "node", "store")

    def __init__(self, store: Store, node: str, clock: Callable[[], float]) -> None:
        self.store = store
        self.node = node
        self.clock = clock
        self._pool_nets: dict[str, IPNetwork] = {}

    # -- blocks -------------------------------------------------------------------------

    def block(self, cidr: str, *, fresh: bool = False) -> tuple[Block, int] | None:
        """The block and its revision; ``fresh``: as the store holds it now, never from
        what a serving process knows (for decisions that remove something from an index:
        a stale "gone" must not hide an allocation)."""
        doc = self._get("block", cidr) if fresh else self.store.get("block", cidr)
        if doc is None:
            return None
        return self.parse_block(cidr, doc), doc.revision

    def _get(self, kind: str, key: str) -> Doc | None:
        """The store's document now: a served store (``datastore.cached.Cached``) reads
        through what tabby-node knows, and its ``fresh_get`` asks the store itself."""
        return getattr(self.store, "fresh_get", self.store.get)(kind, key)

    def seen_block(self, op: Op | None, cidr: str) -> tuple[Block, int] | None:
        """The block as this operation read it already, else read now."""
        if op is not None and cidr in op.blocks:
            return op.blocks[cidr]
        return self.block(cidr)

    def parse_block(self, cidr: str, doc: Doc) -> Block:
        blk = Block.from_data(doc.data, self.store.location("block", cidr))
        if blk.cidr != cidr:
            raise StoreCorrupt(self.store.location("block", cidr), f"holds block {blk.cidr}")
        return blk

    def scan(self, kind: str) -> Iterator[tuple[str, Doc | StoreCorrupt]]:
        """Every document of ``kind``, by key: one ranged read (``list``); when that meets
        an unreadable document, one read per document instead, so that the others are
        still seen (the unreadable ones are yielded as their ``StoreCorrupt``)."""
        try:
            listed = self.store.list(kind)
        except StoreCorrupt:
            pass
        else:
            yield from listed
            return
        for key in self.store.list_keys(kind):
            try:
                doc = self.store.get(kind, key)
            except StoreCorrupt as e:
                yield key, e
                continue
            if doc is not None:  # else deleted since it was listed
                yield key, doc

    def scan_blocks(self) -> Iterator[tuple[Block, int]]:
        """Every readable block (an unreadable one is logged and skipped)."""
        for cidr, doc in self.scan("block"):
            try:
                if isinstance(doc, StoreCorrupt):
                    raise doc
                yield self.parse_block(cidr, doc), doc.revision
            except StoreCorrupt as e:
                log(WARNING, "skipping unreadable block: %s", e)

    def try_block(self, cidr: str) -> tuple[Block, int] | None:
        """Like ``block``, but a corrupt block is logged and skipped (None): for scans that
        must not stop on another block's damage."""
        try:
            return self.block(cidr)
        except StoreCorrupt as e:
            log(WARNING, "skipping unreadable block: %s", e)
            return None

    def all_blocks(self) -> list[tuple[Block, int]]:
        return list(self.scan_blocks())

    def block_cidr_for(self, ip: IPAddress) -> str | None:
        pool = self.pool_containing(ip)
        if pool is not None:
            return str(pool.block_network(pool.block_index(ip)))
        for key in self.store.list_keys("block"):  # its pool was deleted
            try:
                if ip in ipaddress.ip_network(key):
                    return key
            except (ValueError, TypeError):
                continue
        return None

    # -- pools --------------------------------------------------------------------------

    def pool_doc(self, cidr: str, *, fresh: bool = False) -> tuple[Pool, int] | None:
        """The pool document; ``fresh``: as the store holds it now, never from what a
        serving process knows (``datastore.cached``)."""
        doc = self._get("pool", cidr) if fresh else self.store.get("pool", cidr)
        if doc is None:
            return None
        return Pool.from_data(doc.data, self.store.location("pool", cidr)), doc.revision

    def pool(self, cidr: str) -> Pool | None:
        got = self.pool_doc(cidr)
        return None if got is None else got[0]

    def all_pools(self) -> dict[str, Pool]:
        out = {}
        for key in self.store.list_keys("pool"):
            pool = self.pool(key)
            if pool is not None:
                out[pool.cidr] = pool
        return out

    def pool_containing(self, ip: IPAddress) -> Pool | None:
        corrupt: StoreCorrupt | None = None
        for key in self.store.list_keys("pool"):
            try:
                net = ipaddress.ip_network(key)
            except ValueError:
                continue
            if net.version == ip.version and ip in net:
                try:
                    return self.pool(key)
                except StoreCorrupt as e:
                    corrupt = e
        if corrupt is not None:
            raise corrupt
        return None

    def gate(self, blk: Block) -> str | None:
        """The pool gate: None when block ``blk`` (read from the store, so it existed
        before this call) may receive allocations, else why not.

        It may if, now, its pool exists, is enabled, overlaps no other pool, and the block
        is a cut of the pool's current layout. A block passes the gate once, after it was
        created and before its first allocation (the claim; or the borrow, adoption or
        specific-IP assign that first uses a block no node has listed), which is what
        makes ``delete_pool`` and pool creation safe without a lock (see ipam/DESIGN.md,
        "Cluster mode").
        """
        pool, why = self._pool_gate(blk.pool)
        if pool is None:
            return why
        net = blk.network
        if pool.block_size != net.prefixlen or net.network_address not in pool.network:
            return f"block {blk.cidr} is not a /{pool.block_size} of pool {pool.cidr}"
        return None

    def pool_refuses(self, cidr: str) -> str | None:
        """Why the gate refuses every block of pool ``cidr`` now (None: it does not)."""
        return self._pool_gate(cidr)[1]

    def _pool_gate(self, cidr: str) -> tuple[Pool | None, str | None]:
        try:
            got = self.pool_doc(cidr, fresh=True)
        except StoreCorrupt as e:
            return None, str(e)
        pool = None if got is None else got[0]
        if pool is None:
            return None, f"pool {cidr} no longer exists"
        if pool.disabled:
            return None, f"pool {cidr} is disabled"
        copies = 0
        for key in self.store.list_keys("pool"):
            if key == pool.cidr:
                copies += 1  # the Kubernetes datastore: two IPPool objects of one CIDR
                if copies > 1:
                    return None, f"pool {cidr} is defined more than once"
                continue
            try:
                other = ipaddress.ip_network(key)
            except ValueError:
                continue
            if other.version == pool.version and other.overlaps(pool.network):
                return None, f"pool {cidr} overlaps pool {key}"
        return pool, None

    # -- the node's index --------------------------------------------------------------

    def affinity(self, node: str) -> tuple[Affinity, int | None]:
        """``node``'s affinity document and its revision; a new empty one (revision None)
        when it does not exist."""
        doc = self.store.get("affinity", node)
        if doc is None:
            return Affinity.new(node), None
        return Affinity.from_data(doc.data, self.store.location("affinity", node)), doc.revision

    def my_affinity(self, op: Op) -> Affinity:
        """This node's affinity document, read once per operation."""
        if op.aff is None:
            op.aff, op.aff_rev = self.affinity(self.node)
        return op.aff

    def held(self, hid: str, cidrs: Iterable[str], op: Op | None = None) -> list[Allocation]:
        """The allocations of handle ``hid`` in blocks ``cidrs`` (a block that is gone holds
        none; an unreadable one raises: it might hold some), by family and address; the
        blocks read are kept in ``op`` for the rest of the operation."""
        out: list[Allocation] = []
        for cidr in cidrs:
            got = self.seen_block(op, cidr)
            if op is not None:
                op.blocks[cidr] = got
            if got is not None:
                out += [self.allocation(got[0], o) for o in got[0].ordinals_of(hid)]
        out.sort(key=lambda a: (a.ip.version, int(a.ip)))
        return out

    # -- values -------------------------------------------------------------------------

    def pool_net(self, cidr: str) -> IPNetwork:
        net = self._pool_nets.get(cidr)
        if net is None:
            net = self._pool_nets[cidr] = ipaddress.ip_network(cidr)
        return net

    def allocation(self, blk: Block, o: int) -> Allocation:
        a = blk.allocations[o]
        assert a is not None
        return Allocation(blk.ip(o), blk.network, self.pool_net(blk.pool), a["handle"], a["seq"])
