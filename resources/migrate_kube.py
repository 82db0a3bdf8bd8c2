"""A running cluster moved from etcd to the Kubernetes datastore, no address handed out twice
(``tabbyctl datastore migrate --to kubernetes``; docs/kubernetes.md "Migrating a running
cluster from etcd").

The two stores are never written as one: nodes switch one at a time (a rolling restart), so
for a while some allocate in one store while others release in the other. What keeps every
address unique is that at any time at most one store hands addresses out:

1. **freeze** (``freeze``): every pool of the source is disabled and marked
   ``tabby.io/migrating: kubernetes`` (``kubernetes (disabled before)`` for one that was
   disabled already; one compare-and-swap each), so no ADD allocates or claims there any
   more (a claim fails the pool gate, which reads the store itself); then ``settle``
   seconds pass, so that an ADD that read its pool before the freeze (or through a serving
   tabby-node's watch, a moment behind) has written its allocation into a block it had
   (a CNI call's store operations end within the lock timeout).
2. **copy**: pools (into the API disabled and marked until the copy is done),
   BGPConfigurations, BGPPeers, tabby Nodes (their spec: their labels are the Kubernetes
   Node's there), Calico's policy kinds (Tiers, policies, network sets, host endpoints),
   then IPAM state, in passes: every node's index (legacy handle documents
   folded in), then every block (``copy_ipam``), each merged into the API's by one
   compare-and-swap of it.
   A merge keeps every allocation present on either side (never drops one); where both hold
   one address for different attachments, the later one (its sequence number) stays: an
   allocation made on the API after the copy is newer than any of the frozen source's, and
   the address it reuses was released there because its pod had gone. A pass re-reads the
   source's blocks that changed since the pass before; the copy ends with a pass that adds
   nothing (releases change the source too, and add nothing).
3. **open** (``_open_pools``): the API's pools are enabled (those the source had enabled)
   and unmarked: from now on the nodes that run on the API allocate there. The nodes switch
   by a rolling restart; until its turn a node allocates nothing (its pools are frozen) and
   its DELs release in the source only: the API's copy of such an allocation is released by
   tabby-kube-controllers once its pod has been gone for ``--leak-grace``.

A run is idempotent: a run after an interrupted one (any step) goes on from where the stores
are. ``abort`` ends a migration instead: the source's pools are as before the freeze again and
the API's IPAM copy removed, refused when a node has allocated on the API already (an address made
there would be handed out again by the source).

Pods, Namespaces and NetworkPolicies are Kubernetes' own on the API (never copied; one made
with tabbyctl, not mirrored, is reported), WorkloadEndpoints are made of the allocations
there, liveness is the kubelet's and traces are short-lived: none of them is copied.
Standard library only; both stores are any ``Store``.
"""

from __future__ import annotations

import copy
import ipaddress
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from datastore.base import CALICO_KINDS
from datastore.cas import DELETE, Delete, update
from datastore.engine import PLURALS
from ipam.core.block import Block
from ipam.core.model import AFFINITY_FORMAT, Affinity, Handle
from resources import mirror
from resources.errors import Conflict

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import Doc, Store

#: The annotation of a pool a migration holds: on the source every pool once frozen (its
#: value says whether it was enabled before: what the target gets, and ``abort`` restores),
#: on the target one whose copy is not done yet.
MIGRATING = "tabby.io/migrating"
TO_KUBERNETES = "kubernetes"
WAS_DISABLED = "kubernetes (disabled before)"
#: Passes over the source's blocks before the copy gives up (each after the first re-reads
#: only what changed: a frozen source stops adding within the first few).
MAX_PASSES = 10
#: The resources copied (a tabby Node without its labels), in order: Calico's policy kinds
#: are custom resources of tabby's there too.
RESOURCE_KINDS = ("bgpconfiguration", "bgppeer", "node", *CALICO_KINDS)
#: What the target never gets: Kubernetes' own there, or made of other documents.
NOT_COPIED = ("namespace", "pod", "networkpolicy")


@dataclass
class Report:
    """What a run did (counts by what, lines for the operator)."""

    frozen: list[str] = field(default_factory=list)  #: source pools frozen by this run
    opened: list[str] = field(default_factory=list)  #: target pools enabled at the end
    thawed: list[str] = field(default_factory=list)  #: source pools enabled again (abort)
    counts: dict[str, int] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    passes: int = 0

    def count(self, what: str, n: int = 1) -> None:
        self.counts[what] = self.counts.get(what, 0) + n


# -- pools -----------------------------------------------------------------------------------


def _mark_of(data: Mapping[str, object]) -> object:
    annotations = data.get("annotations")
    return annotations.get(MIGRATING) if isinstance(annotations, Mapping) else None


def marked(data: Mapping[str, object]) -> bool:
    """Whether a pool document carries a migration's mark."""
    return _mark_of(data) in (TO_KUBERNETES, WAS_DISABLED)


def was_enabled(data: Mapping[str, object]) -> bool:
    """Whether a source pool served addresses before a migration froze it (or serves now)."""
    if marked(data):
        return _mark_of(data) == TO_KUBERNETES
    return not data.get("disabled")


def _with_mark(data: JSON, *, mark: str | None, disabled: bool) -> JSON:
    out = copy.deepcopy(data)
    annotations = dict(out.get("annotations") or {})
    if mark is not None:
        annotations[MIGRATING] = mark
    else:
        annotations.pop(MIGRATING, None)
    if annotations:
        out["annotations"] = annotations
    else:
        out.pop("annotations", None)
    out["disabled"] = disabled
    return out


def _write(
    store: Store, kind: str, key: str, change: Callable[[Doc | None], JSON | Delete | None]
) -> bool:
    """``datastore.cas.update``; whether it wrote (the last run of ``change`` decides: it
    is the one whose write went through)."""
    wrote = [False]

    def decide(doc: Doc | None) -> JSON | Delete | None:
        new = change(doc)
        wrote[0] = new is not None
        return new

    update(store, kind, key, decide)
    return wrote[0]


def freeze(source: Store) -> list[str]:
    """Step 1: every pool of ``source`` disabled and marked (with whether it was enabled);
    the CIDRs that served addresses until now."""
    frozen: list[str] = []
    for key, doc in source.list("pool"):
        if marked(doc.data):
            continue

        def change(got: Doc | None) -> JSON | None:
            if got is None or marked(got.data):
                return None
            mark = TO_KUBERNETES if was_enabled(got.data) else WAS_DISABLED
            return _with_mark(got.data, mark=mark, disabled=True)

        if _write(source, "pool", key, change) and was_enabled(doc.data):
            frozen.append(key)
    return frozen


def thaw(source: Store) -> list[str]:
    """``abort``: every pool a migration froze as it was before; those enabled again."""
    thawed: list[str] = []
    for key, doc in source.list("pool"):

        def change(got: Doc | None) -> JSON | None:
            if got is None or not marked(got.data):
                return None
            return _with_mark(got.data, mark=None, disabled=not was_enabled(got.data))

        if _write(source, "pool", key, change) and was_enabled(doc.data):
            thawed.append(key)
    return thawed


def _overlaps(a: str, b: str) -> bool:
    try:
        x, y = ipaddress.ip_network(a), ipaddress.ip_network(b)
    except ValueError:
        return False
    return x.version == y.version and x.overlaps(y) and x != y


def _stage_pools(source: Store, target: Store, first_run: bool, report: Report) -> None:
    """The source's pools on the target, disabled and marked until the copy is done. A
    target pool that exists unmarked is marked too on a first run (nothing runs on it:
    ``check``), else it stays as it is (nodes may allocate there already)."""
    for key, doc in source.list("pool"):

        def change(got: Doc | None, data: JSON = doc.data) -> JSON | None:
            if got is None:
                return _with_mark(data, mark=TO_KUBERNETES, disabled=True)
            if marked(got.data) or not first_run:
                return None
            return _with_mark(got.data, mark=TO_KUBERNETES, disabled=True)

        if _write(target, "pool", key, change):
            report.count("pools")


def _open_pools(source: Store, target: Store, report: Report) -> None:
    """Step 3: the target's marked pools enabled (when the source had them enabled before
    its freeze) and unmarked."""
    for key, doc in source.list("pool"):
        disabled = not was_enabled(doc.data)

        def change(got: Doc | None, disabled: bool = disabled) -> JSON | None:
            if got is None or not marked(got.data):
                return None
            return _with_mark(got.data, mark=None, disabled=disabled)

        if _write(target, "pool", key, change) and not disabled:
            report.opened.append(key)


# -- resources -------------------------------------------------------------------------------


def _resource_data(kind: str, data: JSON) -> JSON:
    """A resource as the target keeps it: a Node's labels are the Kubernetes Node's there,
    and nothing is mirrored (the mark of the controllers dropped)."""
    out = copy.deepcopy(data)
    meta = dict(out.get("metadata") or {})
    if kind == "node":
        meta.pop("labels", None)
    annotations = dict(meta.get("annotations") or {})
    annotations.pop(mirror.SOURCE_ANNOTATION, None)
    if annotations:
        meta["annotations"] = annotations
    else:
        meta.pop("annotations", None)
    out["metadata"] = meta
    return out


def _copy_resources(source: Store, target: Store, report: Report) -> None:
    """BGP resources and tabby Nodes created where the target lacks them (the target's
    stand: a change made there after a first run is kept)."""
    for kind in RESOURCE_KINDS:
        for key, doc in source.list(kind):
            data = _resource_data(kind, doc.data)

            def create(got: Doc | None, data: JSON = data) -> JSON | None:
                return data if got is None else None

            if _write(target, kind, key, create):
                report.count(PLURALS[kind])
    for kind in NOT_COPIED:
        for key, doc in source.list(kind):
            if not mirror.is_mirrored(doc.data):
                report.skipped.append(
                    f"{kind} {key}: made with tabbyctl; Kubernetes' own in the Kubernetes "
                    "datastore (apply it with kubectl)"
                )


# -- IPAM ------------------------------------------------------------------------------------


def merge_block(src: Block, tgt: Block | None) -> tuple[Block, int, list[str]]:
    """``src``'s allocations merged into ``tgt``: (the block, allocations added, conflicts).
    Every allocation of either side is kept; of two at one address, the later (``seq``)."""
    if tgt is None:
        return src.copy(), src.in_use(), []
    if tgt.network != src.network:
        raise Conflict(f"block {src.cidr}: the target's is {tgt.cidr}")
    out = tgt.copy()
    out.seq = max(src.seq, tgt.seq)
    added = 0
    conflicts: list[str] = []
    for ordinal, a in enumerate(src.allocations):
        b = out.allocations[ordinal]
        if a is None or a == b:
            continue
        if b is None:
            out.allocations[ordinal] = a
            out.unallocated = [o for o in out.unallocated if o != ordinal]
            added += 1
            continue
        newer, older = (a, b) if a["seq"] > b["seq"] else (b, a)
        out.allocations[ordinal] = newer
        conflicts.append(
            f"{src.ip(ordinal)}: kept {newer['handle']} (seq {newer['seq']}), not "
            f"{older['handle']} (seq {older['seq']}, released since)"
        )
    out.full = all(a is not None for a in out.allocations)
    return out, added, conflicts


def merge_affinity(src: Affinity, tgt: Affinity | None) -> Affinity:
    """A node's index listing every block either side lists (a listed block that holds
    nothing of the node is harmless: its next ADD unlists it)."""
    out = tgt.copy() if tgt is not None else Affinity.new(src.node)
    out.format = AFFINITY_FORMAT
    for cidr in src.blocks:
        if cidr not in out.blocks and cidr not in out.borrowed:
            out.blocks.append(cidr)
    for cidr in src.borrowed:
        if cidr not in out.indexed():
            out.borrowed.append(cidr)
    for pool, index in src.cursor.items():
        out.cursor[pool] = max(index, out.cursor.get(pool, 0))
    return out


def source_indexes(source: Store) -> dict[str, Affinity]:
    """Every node's index in ``source``, legacy handle documents folded in (the blocks a
    node's handle lists that are not its own join its ``borrowed``: ``ipam.core.legacy``)."""
    out: dict[str, Affinity] = {}
    for key, doc in source.list("affinity"):
        out[key] = Affinity.from_data(doc.data, source.location("affinity", key))
    for key, doc in source.list("handle"):
        handle = Handle.from_data(doc.data, source.location("handle", key))
        aff = out.setdefault(handle.node, Affinity.new(handle.node))
        for cidr in handle.blocks:
            if cidr not in aff.indexed():
                aff.borrowed.append(cidr)
    return out


def _merge_indexes(source: Store, target: Store, report: Report, seen: dict[str, str]) -> None:
    for node, aff in source_indexes(source).items():
        digest = repr(aff.to_data())
        if seen.get(node) == digest:
            continue  # unchanged since the pass before

        def change(got: Doc | None, aff: Affinity = aff) -> JSON | None:
            have = None if got is None else Affinity.from_data(got.data, "target")
            merged = merge_affinity(aff, have)
            if have is not None and merged.to_data() == have.to_data():
                return None
            return merged.to_data()

        if _write(target, "affinity", node, change):
            report.count("indexes")
        seen[node] = digest


def _merge_blocks(source: Store, target: Store, report: Report, seen: dict[str, int]) -> int:
    """One pass over the source's blocks changed since ``seen``; allocations added."""
    added = 0
    for key, doc in source.list("block"):
        if seen.get(key) == doc.revision:
            continue
        merge = _BlockMerge(Block.from_data(doc.data, source.location("block", key)), target)
        if _write(target, "block", key, merge):
            report.count("blocks")
        added += merge.added
        report.conflicts += [c for c in merge.conflicts if c not in report.conflicts]
        seen[key] = doc.revision
    report.count("allocations", added)
    return added


class _BlockMerge:
    """``update``'s change for one block: ``merge_block`` with what it found (of its last
    run: the one whose write went through)."""

    def __init__(self, src: Block, target: Store) -> None:
        self.src = src
        self.target = target
        self.added = 0
        self.conflicts: list[str] = []

    def __call__(self, got: Doc | None) -> JSON | None:
        where = self.target.location("block", self.src.cidr)
        have = None if got is None else Block.from_data(got.data, where)
        merged, self.added, self.conflicts = merge_block(self.src, have)
        if have is not None and merged.to_data() == have.to_data():
            return None
        return merged.to_data()


def allocations_made_on(source: Store, target: Store) -> list[str]:
    """The target's allocations no source block has made: a node allocated on the target
    (a block the source lacks, or an allocation above the source block's sequence number:
    the frozen source's numbers do not grow)."""
    src_seq = {key: int(doc.data.get("seq") or 0) for key, doc in source.list("block")}
    made: list[str] = []
    for key, doc in target.list("block"):
        blk = Block.from_data(doc.data, target.location("block", key))
        for ordinal, a in enumerate(blk.allocations):
            if a is not None and (key not in src_seq or a["seq"] > src_seq[key]):
                made.append(f"{blk.ip(ordinal)} ({a['handle']})")
    return made


# -- the run ---------------------------------------------------------------------------------


def check(source: Store, target: Store) -> bool:
    """Refuse what cannot be merged (``Conflict``), before anything is written; whether this
    is a first run (no source pool frozen yet)."""
    pools = {key: doc.data for key, doc in source.list("pool")}
    first_run = not any(marked(d) for d in pools.values())
    theirs = [key for key, _ in target.list("pool")]
    for mine in pools:
        for other in theirs:
            if _overlaps(mine, other):
                raise Conflict(
                    f"pool {mine} overlaps the Kubernetes API's pool {other}: nothing copied"
                )
    if first_run:
        held = sum(
            Block.from_data(d.data, target.location("block", k)).in_use()
            for k, d in target.list("block")
        )
        if held:
            raise Conflict(
                f"the target already holds {held} allocation(s) that no migration copied: "
                "nodes run on it already (a copy into it could hand an address out twice): "
                "nothing changed"
            )
    return first_run


def copy_ipam(source: Store, target: Store, report: Report, max_passes: int = MAX_PASSES) -> None:
    """Step 2's IPAM part: indexes, then blocks, in passes until one adds nothing."""
    index_seen: dict[str, str] = {}
    block_seen: dict[str, int] = {}
    for n in range(1, max_passes + 1):
        report.passes = n
        _merge_indexes(source, target, report, index_seen)
        added = _merge_blocks(source, target, report, block_seen)
        if n > 1 and added == 0:
            return
    raise Conflict(
        f"the source still got new allocations after {max_passes} passes (a node allocates "
        "there: is a pool enabled?): run the migration again"
    )


def migrate(
    source: Store,
    target: Store,
    *,
    settle: float,
    say: Callable[[str], None] = lambda line: None,
    sleep: Callable[[float], None] = time.sleep,
    max_passes: int = MAX_PASSES,
) -> Report:
    """Freeze, copy, open (see the module); safe to run again after any interruption."""
    report = Report()
    first_run = check(source, target)
    report.frozen = freeze(source)
    if report.frozen:
        say(
            f"froze {len(report.frozen)} pool(s) in the source ({', '.join(report.frozen)}): "
            f"waiting {settle:g} s for the ADDs in flight"
        )
        sleep(settle)
    _stage_pools(source, target, first_run, report)
    _copy_resources(source, target, report)
    copy_ipam(source, target, report, max_passes)
    _open_pools(source, target, report)
    return report


def abort(source: Store, target: Store) -> Report:
    """End a migration: refused (``Conflict``) once a node allocated on the target; else
    the target's IPAM copy removed (its pools disabled and marked: nothing allocates there
    until a migration completes) and the source's frozen pools enabled again."""
    made = allocations_made_on(source, target)
    if made:
        shown = ", ".join(made[:5]) + (f" and {len(made) - 5} more" if len(made) > 5 else "")
        raise Conflict(
            f"{len(made)} allocation(s) were made on the Kubernetes datastore already ({shown}): "
            "nodes run on it, and the source would hand those addresses out again; finish the "
            "migration instead (nothing changed)"
        )
    report = Report()
    for kind, what in (("block", "blocks"), ("affinity", "indexes")):
        for key, _doc in target.list(kind):
            if _write(target, kind, key, _delete):
                report.count(f"{what} removed")
    for key, _doc in target.list("pool"):
        if _write(target, "pool", key, _close):
            report.count("pools closed")
    report.thawed = thaw(source)
    return report


def _delete(doc: Doc | None) -> Delete | None:
    return None if doc is None else DELETE


def _close(doc: Doc | None) -> JSON | None:
    if doc is None or marked(doc.data):
        return None
    return _with_mark(doc.data, mark=TO_KUBERNETES, disabled=True)
