"""The migration from format 1: handle documents folded into the node's index.

Before format 2 every attachment had a handle document listing the blocks that held its
addresses (``Handle``), and the node's affinity document listed only its own blocks. Now
the node's affinity document lists every block holding the node's allocations (own and
``borrowed``), and the handle is only a field of each allocation. A node migrates itself,
under its lock, the first time a writing operation finds its document of format 1:

1. the blocks its handle documents list that are not its own join ``borrowed``, and the
   document is written as format 2 (one CAS);
2. its handle documents are deleted (each a CAS; one that changed meanwhile stays).

A kill between 1 and 2 leaves handle documents that index nothing new: GC (``gc``) folds
and deletes whatever handle documents of its node remain, and ``tabbyctl ipam check``
reports them as leftovers. Nothing an older tabby wrote is lost: an allocation it made is
found in the node's index from step 1 on, and released by its handle like any other.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipam.core import affinity
from ipam.core.docs import INFO, WARNING, Docs, Op, log
from ipam.core.errors import DatastoreError, StoreCorrupt
from ipam.core.model import AFFINITY_FORMAT, Affinity, Handle

if TYPE_CHECKING:
    from datastore.base import Doc


def migrate(docs: Docs, op: Op, *, leftovers: bool = False) -> int:
    """Fold this node's handle documents into its index (when its document is of format 1
    or missing, or ``leftovers``: whatever handle documents of the node remain); returns how
    many were folded. Runs under the node's lock."""
    aff = docs.my_affinity(op)
    missing = op.aff_rev is None  # a node of format 1 that only ever borrowed has none
    if not aff.legacy and not missing and not leftovers:
        return 0
    if not docs.store.list_keys("handle"):
        if aff.legacy:
            affinity.modify(docs, op, docs.node, _upgrade)
        return 0
    mine: list[tuple[str, Handle, Doc]] = []
    for key, doc in docs.scan("handle"):
        if isinstance(doc, StoreCorrupt):
            log(WARNING, "skipping unreadable handle: %s", doc)
            continue
        try:
            handle = Handle.from_data(doc.data, docs.store.location("handle", key))
        except StoreCorrupt as e:
            log(WARNING, "skipping unreadable handle: %s", e)
            continue
        if handle.node == docs.node:
            mine.append((key, handle, doc))
    blocks = [cidr for _, h, _ in mine for cidr in h.blocks]

    def fold(aff: Affinity) -> bool:
        changed = _upgrade(aff)
        for cidr in blocks:
            if cidr not in aff.blocks and cidr not in aff.borrowed:
                aff.borrowed.append(cidr)
                changed = True
        return changed

    affinity.modify(docs, op, docs.node, fold)
    for key, _handle, doc in mine:
        try:
            docs.store.delete("handle", key, doc.revision)
        except DatastoreError as e:  # changed or gone meanwhile: GC looks again
            log(WARNING, "handle %s stays: %s", key, e)
    if mine:
        log(INFO, "node %s: %d handle document(s) folded into its index", docs.node, len(mine))
    return len(mine)


def _upgrade(aff: Affinity) -> bool:
    if aff.format >= AFFINITY_FORMAT:
        return False
    aff.format = AFFINITY_FORMAT
    return True
