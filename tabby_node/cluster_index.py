"""The cluster view for routing, kept up to date one changed document at a time: pure.

:meth:`Cluster.from_documents <tabby_node.cluster.Cluster.from_documents>` reads every
document on every pass; :class:`ClusterIndex` holds the same facts (nodes and their
liveness, pools, blocks and their affinity, borrowed addresses, the BGP configuration and
peers) and takes the documents that changed since the last pass
(:meth:`resources.index.Index.drain`). Each change costs what its document costs (a block
of 64 addresses: one look at its allocations) and nothing for the rest of the cluster.

:meth:`ClusterIndex.apply` answers what a batch really changed (:class:`Touched`: the
nodes, blocks, pools and BGP resources whose routing facts differ, with their values
before). A block document rewritten for a pod of its own node (same affinity, same
borrowed addresses) touches nothing: that is the common event in a cluster, and its
consumers (:mod:`tabby_node.vxlan_table`, the BIRD backend) then do nothing at all.

Indexes kept for them: blocks by owner node and by prefix, borrowed addresses by holder and
by /32 (/128) prefix. :meth:`ClusterIndex.cluster` rebuilds the whole :class:`Cluster`
(equal to ``Cluster.from_documents`` over the same documents: the tests replay random
histories to check it), :meth:`ClusterIndex.bird_cluster` the part of it one node's BIRD
configuration reads.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, TypeVar, cast

from resources.index import (
    BGP_CONFIGURATIONS,
    BGP_PEERS,
    BLOCKS,
    HEARTBEATS,
    NODES,
    POOLS,
    Change,
)
from tabby_node.cluster import (
    DEFAULT_AS,
    BlockInfo,
    Borrowed,
    Cluster,
    NodeInfo,
    PeerSpec,
    PoolInfo,
    _block,
    _node,
    _peer,
    pool_info,
)

if TYPE_CHECKING:
    from bundle.types import IPAddress, IPNetwork
    from ipam.core.block import Block
    from resources.tabby import BGPConfiguration, BGPPeer, IPPool, Node

K = TypeVar("K")
V = TypeVar("V")

#: Answers whether a document is in the store although it did not parse (for heartbeats:
#: a node is alive while its heartbeat document exists); ``Index.has`` is one.
Present = Callable[[str, str], bool]


@dataclasses.dataclass(frozen=True, slots=True)
class BlockEntry:
    """One block document as routing reads it: the block and the addresses that nodes
    other than its owner hold in it (in ordinal order)."""

    info: BlockInfo
    borrowed: tuple[Borrowed, ...]


@dataclasses.dataclass(frozen=True, slots=True)
class BgpSettings:
    """The BGPConfiguration ``default`` as routing reads it (the model's defaults when
    there is none)."""

    as_number: int = DEFAULT_AS
    mesh: bool = True
    log_severity: str = "Info"


@dataclasses.dataclass
class Touched:
    """What one :meth:`ClusterIndex.apply` changed, with the values before it (None: it
    did not exist). Only what really differs afterwards is listed: a document rewritten
    with the same routing facts is not."""

    nodes: dict[str, NodeInfo | None] = dataclasses.field(default_factory=dict)
    blocks: dict[str, BlockEntry | None] = dataclasses.field(default_factory=dict)
    pools: bool = False
    #: The BGPConfiguration or a BGPPeer changed.
    bgp: bool = False

    def __bool__(self) -> bool:
        return bool(self.nodes or self.blocks or self.pools or self.bgp)


class ClusterIndex:
    """The routing facts of the cluster as seen from node ``me``, indexed (not
    thread-safe: the dataplane thread owns it)."""

    def __init__(self, me: str) -> None:
        self.me = me
        #: Every Node that parsed, by name; ``alive`` is set from the heartbeats.
        self.nodes: dict[str, NodeInfo] = {}
        #: Names whose heartbeat document exists.
        self.live: set[str] = set()
        self.pools: dict[str, PoolInfo] = {}
        self.blocks: dict[str, BlockEntry] = {}
        #: owner node -> keys of the blocks affine to it
        self.blocks_by_owner: dict[str, set[str]] = {}
        #: block prefix -> keys of the block documents with that prefix (one, normally)
        self.blocks_at: dict[IPNetwork, set[str]] = {}
        #: holder node -> (block key, address) -> what it holds in other nodes' blocks
        self.borrowed_by_holder: dict[str, dict[tuple[str, IPAddress], Borrowed]] = {}
        #: /32 (/128) prefix -> block key -> the borrowed address
        self.borrowed_at: dict[IPNetwork, dict[str, Borrowed]] = {}
        self.bgp = BgpSettings()
        self.peers: dict[str, PeerSpec] = {}
        self._names: list[str] | None = None  # sorted node names, None: to sort again
        self._pools_sorted: tuple[PoolInfo, ...] | None = ()
        self._pool_of: dict[IPNetwork, PoolInfo | None] = {}

    # -- taking changes ------------------------------------------------------------------

    def apply(self, changes: Iterable[Change], present: Present | None = None) -> Touched:
        """Take a batch of changed documents (kinds routing does not read are ignored)
        and return what it touched. ``present`` says whether a heartbeat whose change has
        no value (it did not parse) still exists: then its node stays alive, as in
        ``Cluster.from_documents``; without it such a heartbeat counts as gone."""
        touched = Touched()
        for change in changes:
            kind, key, value = change.kind, change.key, change.value
            if kind == BLOCKS.name:
                self._block(key, cast("Block | None", value), touched)
            elif kind == NODES.name:
                self._node(key, cast("Node | None", value), touched)
            elif kind == HEARTBEATS.name:
                alive = value is not None or (present is not None and present(kind, key))
                self._heartbeat(key, alive, touched)
            elif kind == POOLS.name:
                self._pool(key, cast("IPPool | None", value), touched)
            elif kind == BGP_CONFIGURATIONS.name:
                self._bgp_configuration(key, cast("BGPConfiguration | None", value), touched)
            elif kind == BGP_PEERS.name:
                self._peer(key, cast("BGPPeer | None", value), touched)
        # A node or block changed back within the batch touched nothing.
        touched.nodes = {k: v for k, v in touched.nodes.items() if self.nodes.get(k) != v}
        touched.blocks = {k: v for k, v in touched.blocks.items() if self.blocks.get(k) != v}
        return touched

    def _set_node(self, name: str, info: NodeInfo | None, touched: Touched) -> None:
        before = self.nodes.get(name)
        if before == info:
            return
        touched.nodes.setdefault(name, before)
        if info is None:
            del self.nodes[name]
            self._names = None
        else:
            if before is None:
                self._names = None
            self.nodes[name] = info

    def _node(self, name: str, node: Node | None, touched: Touched) -> None:
        info = None
        if node is not None:
            info = _node(name, node, alive=name in self.live or name == self.me)
        self._set_node(name, info, touched)

    def _heartbeat(self, name: str, alive: bool, touched: Touched) -> None:
        if alive == (name in self.live):
            return
        if alive:
            self.live.add(name)
        else:
            self.live.discard(name)
        info = self.nodes.get(name)
        if info is not None and name != self.me:
            self._set_node(name, dataclasses.replace(info, alive=alive), touched)

    def _pool(self, key: str, pool: IPPool | None, touched: Touched) -> None:
        info = pool_info(pool) if pool is not None else None
        if self.pools.get(key) == info:
            return
        if info is None:
            del self.pools[key]
        else:
            self.pools[key] = info
        self._pools_sorted = None
        self._pool_of.clear()
        touched.pools = True

    def _bgp_configuration(self, key: str, config: BGPConfiguration | None, t: Touched) -> None:
        if key != "default":
            return  # Cluster.from_documents reads only "default"
        bgp = BgpSettings()
        if config is not None:
            spec = config.spec
            bgp = BgpSettings(spec.asNumber, spec.nodeToNodeMeshEnabled, spec.logSeverityScreen)
        if bgp != self.bgp:
            self.bgp = bgp
            t.bgp = True

    def _peer(self, key: str, peer: BGPPeer | None, touched: Touched) -> None:
        spec = _peer(key, peer) if peer is not None else None
        if self.peers.get(key) == spec:
            return
        if spec is None:
            del self.peers[key]
        else:
            self.peers[key] = spec
        touched.bgp = True

    def _block(self, key: str, block: Block | None, touched: Touched) -> None:
        entry = None
        if block is not None:
            info, held = _block(block)
            entry = BlockEntry(info, tuple(held))
        before = self.blocks.get(key)
        if entry == before:
            return  # e.g. a pod of the block's own node came or went: nothing for routing
        touched.blocks.setdefault(key, before)
        if before is not None:
            self._unindex(key, before)
        if entry is None:
            del self.blocks[key]
        else:
            self.blocks[key] = entry
            self._index(key, entry)

    def _index(self, key: str, entry: BlockEntry) -> None:
        owner = entry.info.node
        if owner is not None:
            self.blocks_by_owner.setdefault(owner, set()).add(key)
        self.blocks_at.setdefault(entry.info.cidr, set()).add(key)
        for b in entry.borrowed:
            self.borrowed_by_holder.setdefault(b.holder, {})[(key, b.address)] = b
            self.borrowed_at.setdefault(b.prefix, {})[key] = b

    def _unindex(self, key: str, entry: BlockEntry) -> None:
        owner = entry.info.node
        if owner is not None:
            _discard(self.blocks_by_owner, owner, key)
        _discard(self.blocks_at, entry.info.cidr, key)
        for b in entry.borrowed:
            _pop(self.borrowed_by_holder, b.holder, (key, b.address))
            _pop(self.borrowed_at, b.prefix, key)

    # -- reading ---------------------------------------------------------------------------

    def alive_node(self, name: str | None) -> NodeInfo | None:
        """The node ``name`` if it exists and is alive."""
        if name is None:
            return None
        info = self.nodes.get(name)
        return info if info is not None and info.alive else None

    def sorted_pools(self) -> tuple[PoolInfo, ...]:
        """The pools in ``Cluster.pools`` order (IP version, then prefix)."""
        if self._pools_sorted is None:
            pools = [self.pools[k] for k in sorted(self.pools)]
            self._pools_sorted = tuple(sorted(pools, key=lambda p: (p.cidr.version, p.cidr)))
        return self._pools_sorted

    def pool_of(self, net: IPNetwork) -> PoolInfo | None:
        """``Cluster.pool_of``: the first pool (in that order) holding ``net``."""
        try:
            return self._pool_of[net]
        except KeyError:
            pass
        found = None
        for p in self.sorted_pools():
            if p.cidr.version == net.version and net.subnet_of(p.cidr):  # type: ignore[arg-type]
                found = p
                break
        if len(self._pool_of) > 2 * len(self.blocks) + 1024:
            self._pool_of.clear()  # prefixes of blocks long gone
        self._pool_of[net] = found
        return found

    def prefixes_of(self, name: str) -> set[IPNetwork]:
        """The prefixes whose route depends on node ``name``: its blocks and the
        addresses it holds in other nodes' blocks."""
        out = {self.blocks[k].info.cidr for k in self.blocks_by_owner.get(name, ())}
        out.update(b.prefix for b in self.borrowed_by_holder.get(name, {}).values())
        return out

    def sorted_nodes(self) -> dict[str, NodeInfo]:
        """Every node, in name order (``Cluster.nodes``)."""
        if self._names is None:
            self._names = sorted(self.nodes)
        nodes = self.nodes
        return {name: nodes[name] for name in self._names}

    def cluster(self) -> Cluster:
        """The whole :class:`Cluster`, as ``Cluster.from_documents`` makes it from the same
        documents (O(cluster): for the periodic check, status and tests)."""
        keys = sorted(self.blocks)
        blocks = [self.blocks[k].info for k in keys]
        borrowed = [b for k in keys for b in self.blocks[k].borrowed]
        return self._cluster(
            tuple(sorted(blocks, key=lambda b: (b.cidr.version, b.cidr))),
            tuple(sorted(borrowed, key=lambda b: (b.address.version, b.address))),
        )

    def bird_cluster(self) -> Cluster:
        """The part of the cluster node ``me``'s BIRD configuration reads: every node, the
        pools and BGP resources, but only this node's blocks, the addresses it holds and
        the addresses others hold in its blocks (``bird_config`` of it equals
        ``bird_config`` of the whole cluster; O(nodes), not O(blocks))."""
        me = self.me
        keys = sorted(self.blocks_by_owner.get(me, ()))
        blocks = [self.blocks[k].info for k in keys]
        borrowed = list(self.borrowed_by_holder.get(me, {}).values())
        # what others hold in a block of this prefix: a one-address block lent whole
        # is the holder's to announce (the documents of one prefix: one, normally)
        at = {k for b in blocks for k in self.blocks_at[b.cidr]}
        borrowed += [b for k in sorted(at) for b in self.blocks[k].borrowed if b.holder != me]
        return self._cluster(
            tuple(sorted(blocks, key=lambda b: (b.cidr.version, b.cidr))),
            tuple(sorted(borrowed, key=lambda b: (b.address.version, b.address))),
        )

    def _cluster(self, blocks: tuple[BlockInfo, ...], borrowed: tuple[Borrowed, ...]) -> Cluster:
        return Cluster(
            nodes=self.sorted_nodes(),
            pools=self.sorted_pools(),
            blocks=blocks,
            borrowed=borrowed,
            as_number=self.bgp.as_number,
            mesh=self.bgp.mesh,
            log_severity=self.bgp.log_severity,
            peers=tuple(self.peers[k] for k in sorted(self.peers)),
        )


def _discard(index: dict[K, set[V]], key: K, value: V) -> None:
    values = index.get(key)
    if values is not None:
        values.discard(value)
        if not values:
            del index[key]


def _pop(index: dict[K, dict[V, Borrowed]], key: K, inner: V) -> None:
    values = index.get(key)
    if values is not None:
        values.pop(inner, None)
        if not values:
            del index[key]
