"""Copy every document of one store into another (``tabbyctl datastore migrate``).

Standard library only, and generic store -> store: a node's file store into etcd, or any
store into any other. Pools, blocks, affinities, handles and every resource (workload
endpoints included) are copied as they are; heartbeats and traces (ephemeral) are not. The
target assigns its own revisions.

The target must hold no tabby document at all (else ``TargetNotEmpty``, nothing written).
The source's lock is held for the whole copy, so the node's own CNI calls wait instead of
writing behind it. Documents are created one at a time (a create that finds the document
present fails: nobody else writes the target meanwhile); if one fails, those already
written are removed again before the error is raised.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from datastore.base import KINDS, Store
from resources.errors import Conflict

#: Kinds copied, in order (IPAM state first, then resources).
MIGRATED_KINDS = tuple(k for k in KINDS if k not in ("heartbeat", "trace"))


class TargetNotEmpty(Conflict):
    """The target store already holds tabby data."""


def copy_store(
    source: Store, target: Store, *, kinds: Sequence[str] = MIGRATED_KINDS
) -> dict[str, int]:
    """Copy ``kinds`` from ``source`` into the empty ``target``; returns counts per kind."""
    held = {k: len(target.list_keys(k)) for k in KINDS}
    if any(held.values()):
        what = ", ".join(f"{n} {k}" for k, n in held.items() if n)
        raise TargetNotEmpty(f"the target already holds tabby data ({what}): nothing copied")
    with source.lock():
        docs = [(kind, key, doc.data) for kind in kinds for key, doc in source.list(kind)]
        written: list[tuple[str, str, int]] = []
        try:
            for kind, key, data in docs:
                written.append((kind, key, target.put(kind, key, data, None)))
        except BaseException:
            _undo(target, written)
            raise
    counts = dict.fromkeys(kinds, 0)
    for kind, _key, _data in docs:
        counts[kind] += 1
    return counts


def _undo(target: Store, written: list[tuple[str, str, int]]) -> None:
    """Best effort: the error being raised is the one that matters."""
    for kind, key, rev in reversed(written):
        with contextlib.suppress(Exception):
            target.delete(kind, key, rev)
