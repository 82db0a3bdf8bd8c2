"""The IPAM numbers of tabby-node's cache (what its IPAM gauges export): the pools' usage
through the very views ``tabbyctl ipam show`` uses, and this node's share of it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from datastore.base import Doc, Store
    from resources.index import Documents


class SnapshotStore:
    """Stored documents (the cache's) as the read-only part of the Store contract: enough
    for ``ipam.core.Ipam``'s views (``pool_usage``, ``block_usage``, ``allocations``)."""

    def __init__(self, docs: Mapping[str, Mapping[str, Doc]]) -> None:
        self.docs = docs

    def get(self, kind: str, key: str) -> Doc | None:
        return (self.docs.get(kind) or {}).get(key)

    def list_keys(self, kind: str) -> list[str]:
        return sorted(self.docs.get(kind) or {})

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]:
        return sorted(
            (k, d) for k, d in (self.docs.get(kind) or {}).items() if k.startswith(prefix)
        )

    def location(self, kind: str, key: str) -> str:
        return f"cache:{kind}/{key}"

    def __getattr__(self, name: str) -> object:  # lock, put, delete, commit, sync...
        raise AttributeError(f"the cache's snapshot store is read-only (no {name})")


class IpamNumbers:
    """The IPAM numbers of one cache version. Pool-wide numbers and the blocks are
    ``ipam.core``'s views (what ``tabbyctl ipam show`` prints); an allocation belongs to the
    node its attributes name, else to its block's node (as ``tabbyctl`` shows it), counted
    from the block documents the views could read."""

    def __init__(self, docs: Documents, node: str, reserved: Sequence[str]) -> None:
        from ipam.core import Ipam
        from resources.index import BLOCKS

        ipam = Ipam(cast("Store", SnapshotStore(docs.raw_kinds())), "")
        self.pools = ipam.pool_usage(reserved)
        names = [p.cidr for p in self.pools]
        self.node = node
        self.in_use = dict.fromkeys(names, 0)
        self.borrowed = dict.fromkeys(names, 0)
        self.blocks = dict.fromkeys(names, 0)
        readable = {b.cidr: b for b in ipam.block_usage(reserved) if b.pool in self.in_use}
        for cidr, entry in docs.of(BLOCKS).items():
            block = readable.get(cidr)
            if block is None:
                continue  # unreadable, or outside every pool: not in the views either
            if block.node == node:
                self.blocks[block.pool] += 1
            for alloc in entry.value.allocations:
                if alloc is None:
                    continue
                holder = (alloc.get("attrs") or {}).get("node") or block.node
                if holder == node:
                    self.in_use[block.pool] += 1
                    if block.node != node:
                        self.borrowed[block.pool] += 1


def live_nodes(docs: Documents, me: str) -> int:
    """Nodes with a Node and a live heartbeat (this node always counts itself), as
    ``Cluster.alive`` has them."""
    from resources.index import HEARTBEATS, NODES

    live = set(docs.raw(HEARTBEATS.name)) | {me}
    return len(set(docs.of(NODES)) & live)
