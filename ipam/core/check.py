"""Whole-store consistency check (tests, ``tabbyctl ipam check``).

Errors are broken invariants (see ``ipam/DESIGN.md``); leftovers are what a kill between
two writes may leave, harmless and repaired when next touched (DEL, GC, ADD).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from bundle.types import JSON
from ipam.core.block import Block
from ipam.core.errors import StoreCorrupt
from ipam.core.model import Affinity, Handle, Pool
from ipam.core.reports import Problem

if TYPE_CHECKING:
    from datastore.base import Store

T = TypeVar("T")
ERROR = "error"
LEFTOVER = "leftover"


def check_consistency(store: Store, *, lock: bool = True) -> list[Problem]:
    """Every problem found; an empty list means the store is consistent.

    Takes the store lock (``lock=False`` to run inside one already held) so a concurrent
    writer's half-done operation is not reported.
    """
    if lock:
        with store.lock():
            return _Checker(store).run()
    return _Checker(store).run()


class _Checker:
    def __init__(self, store: Store) -> None:
        from ipam.core.docs import Docs

        self.store = store
        self.docs = Docs(store, "", lambda: 0.0)
        self.out: list[Problem] = []
        self.pools: dict[str, Pool] = {}
        self.blocks: dict[str, Block] = {}
        #: node -> blocks holding an allocation made for it (its "node" attribute)
        self.holders: dict[str, set[str]] = {}

    def problem(self, severity: str, kind: str, subject: str, message: str) -> None:
        self.out.append(Problem(severity, kind, subject, message))

    def documents(
        self, kind: str, decode: Callable[[JSON, str], T]
    ) -> Iterator[tuple[str, str, T]]:
        """(key, location, decoded object) of every readable document of ``kind``; an
        unreadable or undecodable one is reported as corrupt and skipped."""
        for key, doc in self.docs.scan(kind):
            where = self.store.location(kind, key)
            try:
                if isinstance(doc, StoreCorrupt):
                    raise doc
                decoded = decode(doc.data, where)
            except StoreCorrupt as e:
                self.problem(ERROR, "corrupt", e.path, e.reason)
                continue
            yield key, where, decoded

    def run(self) -> list[Problem]:
        self.check_pools()
        self.check_blocks()
        self.check_affinities()
        self.check_legacy_handles()
        return self.out

    def check_pools(self) -> None:
        for key, where, pool in self.documents("pool", Pool.from_data):
            if pool.cidr != key:
                self.problem(ERROR, "misfiled", where, f"holds pool {pool.cidr}")
            self.pools[pool.cidr] = pool
        plist = list(self.pools.values())
        for i, p in enumerate(plist):
            for q in plist[i + 1 :]:
                if p.network.overlaps(q.network):
                    self.problem(ERROR, "pool-overlap", p.cidr, f"overlaps pool {q.cidr}")

    def check_blocks(self) -> None:
        for key, where, blk in self.documents("block", Block.from_data):
            if blk.cidr != key:
                self.problem(ERROR, "misfiled", where, f"holds block {blk.cidr}")
                continue
            self.blocks[key] = blk
            self.check_block(key, blk)
        nets = sorted(
            (b.network for b in self.blocks.values()),
            key=lambda n: (n.version, int(n.network_address)),
        )
        for prev, cur in itertools.pairwise(nets):
            if prev.version == cur.version and int(cur.network_address) <= int(
                prev.broadcast_address
            ):
                self.problem(ERROR, "block-overlap", str(cur), f"overlaps block {prev}")

    def check_block(self, key: str, blk: Block) -> None:
        pool = self.pools.get(blk.pool)
        if pool is None:
            self.problem(ERROR, "block-outside-pools", key, f"its pool {blk.pool} does not exist")
        elif (
            not blk.network.subnet_of(pool.network)  # type: ignore[arg-type]
            or blk.network.prefixlen != pool.block_size
        ):
            self.problem(
                ERROR, "block-outside-pool", key, f"not a /{pool.block_size} of {pool.cidr}"
            )
        fifo = blk.unallocated
        if len(set(fifo)) != len(fifo):
            self.problem(ERROR, "fifo-duplicate", key, "an ordinal is listed free twice")
        free = set(fifo)
        for o, a in enumerate(blk.allocations):
            if a is None:
                if o not in free:
                    self.problem(ERROR, "ordinal-lost", key, f"{blk.ip(o)} neither free nor used")
                continue
            if o in free:
                self.problem(ERROR, "double-state", key, f"{blk.ip(o)} is allocated and free")
            if a["seq"] > blk.seq:
                self.problem(ERROR, "seq", key, f"{blk.ip(o)} has seq {a['seq']} > block seq")
            node = (a.get("attrs") or {}).get("node")
            if isinstance(node, str) and node:
                self.holders.setdefault(node, set()).add(key)

    def check_affinities(self) -> None:
        listed: dict[str, str] = {}
        index: dict[str, Affinity] = {}
        for key, _where, aff in self.documents("affinity", Affinity.from_data):
            index[key] = aff
            for cidr in aff.blocks:
                blk = self.blocks.get(cidr)
                if blk is None:
                    self.problem(LEFTOVER, "affinity-missing-block", key, f"lists gone {cidr}")
                elif blk.node != key:
                    self.problem(
                        LEFTOVER, "affinity-foreign-block", key, f"lists {cidr} ({blk.affinity})"
                    )
                else:
                    listed[cidr] = key
            for cidr in aff.borrowed:
                if cidr not in self.holders.get(key, ()):
                    self.problem(
                        LEFTOVER, "affinity-extra-block", key, f"lists {cidr} without an address"
                    )
        for cidr, blk in self.blocks.items():
            if blk.node and listed.get(cidr) != blk.node:
                self.problem(LEFTOVER, "unlisted-block", cidr, f"affine to {blk.node}, unlisted")
        # I2: every allocation made for a node lies in a block the node's index lists (a
        # node of format 1 indexed them in handle documents: see check_legacy_handles)
        for node, cidrs in sorted(self.holders.items()):
            found = index.get(node)
            if found is None:  # released as gone (release_node): GC's to collect
                for cidr in sorted(cidrs):
                    self.problem(
                        LEFTOVER,
                        "allocation-of-unindexed-node",
                        cidr,
                        f"holds an address of node {node}, which has no affinity document",
                    )
                continue
            if found.legacy:
                continue
            for cidr in sorted(cidrs - set(found.indexed())):
                self.problem(
                    ERROR,
                    "unindexed-allocation",
                    cidr,
                    f"holds an address of node {node}, which does not list it",
                )

    def check_legacy_handles(self) -> None:
        """Handle documents of an older tabby (format 1): their node folds them into its
        index at its next ADD, DEL or GC (``ipam.core.legacy``)."""
        for key, _where, handle in self.documents("handle", Handle.from_data):
            self.problem(LEFTOVER, "legacy-handle", key, f"handle document of node {handle.node}")
