"""Where an address of one family can come from, in the order the allocator tries: the one
candidate generator, read-only, shared by assignment and by readiness (STATUS).

1. ``OWN``: this node's blocks with room, in claim order, each with the ordinal to take
   (``GONE``: a listed block that is not the node's any more, for the consumer to forget);
2. ``CLAIM``: blocks of the pools that do not exist yet, in this node's claim walk
   (``ClaimWalk``), unless ``max_blocks_per_host`` is reached; an ``ORPHAN`` (this node's
   block missing from its list: a killed claim) met on the walk is offered for adoption;
3. every other block of the pools: this node's unlisted ones (``ORPHAN``), else unless
   ``strict_affinity`` another node's or no node's block with room (``BORROW``).

Stage 1 reads the node's own blocks (tabby-node serves them from its watch: no read of the
datastore); stage 3 reads every block, only when the node has no room and cannot claim. The
generator only reads; the consumer acts on each candidate (claims, adopts, lists a borrowed
block, checks the pool gate) between two steps, and the generator reads the node's
affinity document afresh at each stage. A pool the consumer adds to ``closed`` is offered no
more.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from bundle.types import IPNetwork
from ipam.core.block import Block
from ipam.core.docs import WARNING, Docs, Op, family, inside, log
from ipam.core.errors import StoreCorrupt
from ipam.core.model import Affinity, Pool, Reserved
from ipam.core.pools import start_index, walk

if TYPE_CHECKING:
    from datastore.base import Store

PROBES = 3  # claim candidates found taken one by one before listing every block key

OWN = "own"
GONE = "gone"
CLAIM = "claim"
ORPHAN = "orphan"
BORROW = "borrow"

USABLE = (OWN, CLAIM, BORROW)  # ORPHAN too, when it has an ordinal


class Candidate:
    """One candidate. ``block``/``revision``: the block as read (None/0 for ``CLAIM``);
    ``ordinal``: the address to take (None: no room); ``pool``/``index``: for ``CLAIM``
    and for an ``ORPHAN`` met on the claim walk (where the walk's cursor goes next)."""

    __slots__ = ("block", "cidr", "index", "kind", "ordinal", "pool", "revision")

    def __init__(
        self,
        kind: str,
        cidr: str,
        block: Block | None = None,
        revision: int = 0,
        ordinal: int | None = None,
        pool: Pool | None = None,
        index: int = -1,
    ) -> None:
        self.kind = kind
        self.cidr = cidr
        self.block = block
        self.revision = revision
        self.ordinal = ordinal
        self.pool = pool
        self.index = index

    def usable(self) -> bool:
        return self.kind in USABLE or (self.kind == ORPHAN and self.ordinal is not None)

    def cursor(self) -> tuple[str, int] | None:
        """Where this node's next claim in the pool starts, for a claim-walk candidate."""
        if self.pool is None:
            return None
        return self.pool.cidr, (self.index + 1) % self.pool.block_count

    def __repr__(self) -> str:
        return f"Candidate({self.kind}, {self.cidr}, ordinal={self.ordinal})"


class ClaimWalk:
    """The one claim walk: block indexes of ``pool`` from this node's cursor (first claim:
    a hash of node and pool), wrapping, wholly reserved blocks skipped, the node's own
    listed blocks skipped. The consumer calls ``taken()`` for each candidate it found to
    exist; after ``PROBES`` of them the walk lists every block key once and skips the
    existing ones without asking."""

    __slots__ = ("existing", "known", "pool", "probes", "reserved", "start", "store")

    def __init__(
        self, store: Store, node: str, pool: Pool, aff: Affinity, reserved: Reserved
    ) -> None:
        self.store = store
        self.pool = pool
        self.reserved = reserved
        start = aff.cursor.get(pool.cidr)
        if start is None or not 0 <= start < pool.block_count:
            start = start_index(node, pool)
        self.start = start
        self.known = set(aff.blocks)
        self.existing: set[str] | None = None
        self.probes = 0

    def __iter__(self) -> Iterator[tuple[int, IPNetwork]]:
        for idx in walk(self.pool, self.start, self.reserved):
            net = self.pool.block_network(idx)
            cidr = str(net)
            if cidr in self.known or (self.existing is not None and cidr in self.existing):
                continue
            yield idx, net

    def taken(self) -> None:
        self.probes += 1
        if self.existing is None and self.probes >= PROBES:
            self.existing = set(self.store.list_keys("block"))


class Candidates:
    """Candidates for one address of family ``fam`` for ``docs.node`` (see the module)."""

    __slots__ = (
        "aff",
        "closed",
        "docs",
        "fam",
        "limited",
        "max_blocks",
        "op",
        "pools",
        "reserved",
        "strict",
    )

    def __init__(
        self,
        docs: Docs,
        fam: int,
        pools: list[Pool],
        reserved: Reserved,
        *,
        strict: bool,
        max_blocks: int,
        aff: Callable[[], Affinity],
        closed: set[str] | None = None,
        op: Op | None = None,
    ) -> None:
        self.docs = docs
        self.fam = fam
        self.pools = pools
        self.reserved = reserved
        self.strict = strict
        self.max_blocks = max_blocks
        self.aff = aff  # this node's affinity document as it is now
        self.closed = closed if closed is not None else set()
        self.op = op  # the operation whose reads of the node's blocks can be reused
        self.limited = False  # max_blocks_per_host reached: no claim (known after stage 2)

    def _open_pools(self) -> list[Pool]:
        return [p for p in self.pools if p.cidr not in self.closed]

    def __iter__(self) -> Iterator[Candidate]:
        yield from self._own()
        yield from self._claims()
        yield from self._unlisted()

    def _own(self) -> Iterator[Candidate]:
        pools = self._open_pools()
        in_pools = {p.cidr for p in pools}
        for cidr in list(self.aff().blocks):
            if family(cidr) != self.fam or not inside(cidr, pools):
                continue
            try:
                got = self.docs.seen_block(self.op, cidr)
            except StoreCorrupt as e:
                log(WARNING, "skipping unreadable block: %s", e)
                continue
            if got is None or got[0].node != self.docs.node:
                yield Candidate(GONE, cidr)
                continue
            blk, rev = got
            if blk.pool not in in_pools:
                continue
            o = blk.first_usable(self.reserved)
            if o is not None:
                yield Candidate(OWN, cidr, blk, rev, o)

    def _claims(self) -> Iterator[Candidate]:
        aff = self.aff()
        mine = sum(1 for c in aff.blocks if family(c) == self.fam)
        self.limited = bool(self.max_blocks) and mine >= self.max_blocks
        if self.limited:
            return
        docs = self.docs
        for pool in self._open_pools():
            walker = ClaimWalk(docs.store, docs.node, pool, self.aff(), self.reserved)
            for idx, net in walker:
                if pool.cidr in self.closed:
                    break
                cidr = str(net)
                try:
                    got = docs.block(cidr)
                except StoreCorrupt as e:
                    log(WARNING, "skipping unreadable block while claiming: %s", e)
                    walker.taken()
                    continue
                if got is None:
                    yield Candidate(CLAIM, cidr, pool=pool, index=idx)
                    continue
                walker.taken()
                blk, rev = got
                ours = blk.node == docs.node and blk.pool == pool.cidr
                if ours and cidr not in self.aff().blocks:
                    o = blk.first_usable(self.reserved)
                    yield Candidate(ORPHAN, cidr, blk, rev, o, pool, idx)

    def _unlisted(self) -> Iterator[Candidate]:
        docs = self.docs
        listed = set(self.aff().blocks)
        in_pools = {p.cidr for p in self.pools}
        for blk, rev in docs.scan_blocks():
            cidr = blk.cidr
            if cidr in listed or family(cidr) != self.fam:
                continue
            if blk.pool in self.closed or blk.pool not in in_pools:
                continue
            if blk.node == docs.node:
                yield Candidate(ORPHAN, cidr, blk, rev, blk.first_usable(self.reserved))
            elif not self.strict:
                o = blk.first_usable(self.reserved)
                if o is not None:
                    yield Candidate(BORROW, cidr, blk, rev, o)
