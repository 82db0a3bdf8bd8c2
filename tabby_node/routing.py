"""tabby-node's routing backends: what reaches other nodes' pods (``--backend``).

* ``bird``: BIRD 2 speaks BGP (full mesh, route reflectors, explicit BGPPeers); tabby-node
  renders its configuration from the cluster view and reloads it on change (confd's role,
  :mod:`bird`). Pools with VXLAN get the vxlan state too.
* ``vxlan``: no BGP; tabby-node programs VXLAN devices, neighbours, FDB entries and routes
  itself (felix's role, :mod:`dataplane.overlay`).
* ``none``: one node; tabby's own routes, if an earlier backend left some, are removed.

Each backend reconciles: it computes the whole desired state and changes only the
difference, so running it twice, or after a restart, changes nothing.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from bundle.types import JSON
from resources.index import (
    BGP_CONFIGURATIONS,
    BGP_PEERS,
    BLOCKS,
    HEARTBEATS,
    NODES,
    POOLS,
    Change,
    Documents,
)
from tabby_node.cluster import Cluster, NodeInfo, PeerSpec, encap_of, vxlan_state
from tabby_node.cluster_index import BlockEntry, ClusterIndex, Present, Touched
from tabby_node.view import RoutingCheck, RoutingPass
from tabby_node.vxlan_table import ROUTE_KINDS, VxlanTable, route_kind

if TYPE_CHECKING:
    from bird import BirdConfig, BirdNode, BirdSupervisor, Peer, PeerType
    from bird import Pool as BirdPool
    from bundle.types import IPAddress, IPNetwork
    from dataplane.overlay import Changes
    from dataplane.overlay_model import DesiredState, FdbEntry, NeighbourEntry
    from tabby_node.facts import Facts
    from tabby_node.view import RoutingBackend, RoutingHooks

log = logging.getLogger("tabby.node")

# BGPConfiguration.logSeverityScreen -> BIRD's log level (BIRD has no level above error).
_SEVERITY = {
    "Debug": "debug",
    "Info": "info",
    "Warning": "warning",
    "Error": "error",
    "Fatal": "error",
}


class _Overlay:
    """The kernel side of VXLAN (and of nothing, when no pool wants it): kept per change
    (:meth:`update`), or computed whole from a cluster view (:meth:`reconcile`)."""

    def __init__(self, facts: Facts, backend: str, metrics: RoutingHooks | None) -> None:
        from dataplane.overlay import Reconciler

        self.facts = facts
        self.backend = backend
        self.metrics = metrics
        self.reconciler = Reconciler()
        self.table: VxlanTable | None = None
        #: The last whole state programmed by :meth:`reconcile` (None: by :meth:`update`).
        self.last: DesiredState | None = None
        self.programmed: dict[str, int] = {}
        self.problems: list[str] = []
        self.passes = 0
        #: node status's VXLAN peers when the whole path programmed the kernel (else: the table)
        self._peers: list[JSON] | None = []
        #: the table's peers as last computed, and the table's ``peers_version`` then
        self._table_peers: tuple[int, list[JSON]] | None = None
        self._whole = False  # a pass failed half-way: the next one reconciles whole

    def _table(self) -> VxlanTable:
        if self.table is None:
            self.table = VxlanTable(self.facts.name, self.facts.underlay(), self.backend)
        return self.table

    def _whole_state(self, cluster: Cluster) -> DesiredState:
        """The kernel state this node wants, computed whole from ``cluster``."""
        return vxlan_state(cluster, self.facts.name, self.facts.underlay(), self.backend)

    def reconcile(self, cluster: Cluster) -> Changes:
        """The whole state from ``cluster`` (``vxlan_state``), reconciled whole."""
        desired = self._whole_state(cluster)
        changes = self.reconciler.reconcile(desired)
        self.last = desired
        self._peers = _whole_peers(cluster, desired)
        self._done(changes, _programmed(desired))
        return changes

    def update(self, index: ClusterIndex, touched: Touched) -> Changes | None:
        """The objects ``touched`` changed, recomputed and applied as a delta (the first
        pass, and one after devices changed or a delta failed, reconcile whole)."""
        table = self._table()
        delta = table.update(index, touched)
        # whole: the first pass, one after the whole path, or after a pass that failed
        whole = self._whole or self.last is not None or self.passes == 0
        if not delta and not whole:
            return None
        self._whole = True
        if whole:
            changes = self.reconciler.reconcile(table.desired())
        else:
            changes = self.reconciler.apply(delta, table.desired)
        self._whole = False
        self.last = None
        self._peers = None  # from the table, now the truth
        self._done(changes, table.programmed())
        return changes

    def check(
        self, cluster: Cluster, index: ClusterIndex, *, rebuild: bool = False
    ) -> tuple[int, Changes]:
        """The periodic check: the whole state from ``cluster`` (the documents) against the
        kept one (the objects that differ are counted and the table is rebuilt from
        ``index``, as it is with ``rebuild``: a new index), then reconciled whole. Returns
        (objects that differed, what the kernel needed)."""
        desired = self._whole_state(cluster)
        table = self._table()
        model = 0
        if table.ready and self.last is None:
            model = _difference(table.desired(), desired)
            if model:
                log.warning(
                    "routing check: the incremental vxlan state differed from the whole "
                    "recompute in %d objects: rebuilt",
                    model,
                )
        if table.ready and (model or rebuild):
            table.rebuild(index)
        changes = self.reconciler.reconcile(desired)
        if not table.ready:
            self.last = desired  # the table could not be built: the whole path stands
        # What the kernel was just given: from the table when it is ready (just compared
        # with the whole recompute, rebuilt if it differed), else from the whole state.
        self._peers = None if table.ready else _whole_peers(cluster, desired)
        self._done(changes, _programmed(desired))
        return model, changes

    def _done(self, changes: Changes, programmed: dict[str, int]) -> None:
        self.passes += 1
        if changes:
            log.info("routing: %s", changes.summary())
        self.programmed = programmed
        self.problems = [str(p) for p in (*changes.conflicts, *changes.failures)]
        if self.metrics is not None:
            self.metrics.routes(self.programmed, changes)

    def vxlan_peers(self) -> list[JSON]:
        """``node status``'s VXLAN peers as programmed (one per other node). From the table
        they are computed again only when a VTEP changed (``VxlanTable.peers_version``):
        the status file is written after the passes a pod started here or anywhere causes,
        and that must not cost more with more nodes. The same list object is returned until
        then (the status writer encodes it once); callers must not change it."""
        if self._peers is not None:  # the whole path programmed the kernel
            return self._peers
        table = self._table()
        kept = self._table_peers
        if kept is not None and kept[0] == table.peers_version:
            return kept[1]
        names = {(v.fdb.device, v.fdb.mac): name for (name, _), v in table.vteps.items()}
        peers = _vxlan_peers(table.fdb.values(), table.neighbours.values(), names)
        self._table_peers = (table.peers_version, peers)
        return peers


def _whole_peers(cluster: Cluster, desired: DesiredState) -> list[JSON]:
    """``node status``'s VXLAN peers of a whole state computed from ``cluster``."""
    by_mac = {n.vxlan_mac: n.name for n in cluster.nodes.values() if n.vxlan_mac}
    by_mac.update({n.vxlan_mac_v6: n.name for n in cluster.nodes.values() if n.vxlan_mac_v6})
    names = {(f.device, f.mac): by_mac.get(f.mac, "") for f in desired.fdb}
    return _vxlan_peers(desired.fdb, desired.neighbours, names)


def _vxlan_peers(
    fdb: Iterable[FdbEntry],
    neighbours: Iterable[NeighbourEntry],
    names: Mapping[tuple[str, str], str],
) -> list[JSON]:
    """``node status``'s VXLAN peers: one per FDB entry, with its node and tunnel address."""
    tunnels = {(n.device, n.mac): n.address for n in neighbours}
    out = []
    for f in sorted(fdb, key=lambda f: (f.device, str(f.dst))):
        out.append(
            {
                "node": names.get((f.device, f.mac), ""),
                "address": str(f.dst),
                "tunnel_address": str(tunnels.get((f.device, f.mac), "")),
                "mac": f.mac,
                "device": f.device,
            }
        )
    return out


def _programmed(desired: DesiredState) -> dict[str, int]:
    out = dict.fromkeys(ROUTE_KINDS, 0)
    for route in desired.routes:
        out[route_kind(route)] += 1
    return {**out, "tunnel": len(desired.neighbours), "fdb": len(desired.fdb)}


def _difference(kept: DesiredState, whole: DesiredState) -> int:
    """How many objects (devices, FDB entries, neighbours, routes) differ."""
    n = int(kept.vxlan_v4 != whole.vxlan_v4) + int(kept.vxlan_v6 != whole.vxlan_v6)
    n += len(kept.fdb ^ whole.fdb) + len(kept.neighbours ^ whole.neighbours)
    return n + len(kept.routes ^ whole.routes)


def _cluster_difference(kept: Cluster, whole: Cluster) -> int:
    """How many facts (nodes, pools, blocks, borrowed addresses, peers, BGP settings)
    differ between two cluster views."""
    n = len(set(kept.nodes) ^ set(whole.nodes))
    n += sum(1 for k, v in kept.nodes.items() if k in whole.nodes and whole.nodes[k] != v)
    for a, b in (
        (kept.pools, whole.pools),
        (kept.blocks, whole.blocks),
        (kept.borrowed, whole.borrowed),
        (kept.peers, whole.peers),
    ):
        n += len(set(a) ^ set(b)) + int(set(a) == set(b) and a != b)
    settings = (kept.as_number, kept.mesh, kept.log_severity)
    return n + int(settings != (whole.as_number, whole.mesh, whole.log_severity))


class NoRouting:
    """``--backend none``; the base of the others.

    Per dataplane pass the dataplane loop hands over the documents that changed
    (:meth:`sync`); periodically it has everything recomputed from the documents and
    checked (:meth:`check`). :meth:`reconcile` is a whole pass from a cluster view.
    ``backend`` is ``--backend`` (the pools' encapsulation depends on it)."""

    def __init__(
        self, facts: Facts, backend: str = "none", metrics: RoutingHooks | None = None
    ) -> None:
        self.facts = facts
        self.metrics = metrics
        self.overlay = _Overlay(facts, backend, metrics)
        self.index: ClusterIndex | None = None
        #: What the periodic checks had to fix so far, by kind (see RoutingCheck).
        self.check_fixes: dict[str, int] = RoutingCheck().as_dict()
        self.last_check: RoutingCheck | None = None

    def start(self) -> None:
        pass

    def _index(self) -> ClusterIndex:
        if self.index is None:
            self.index = ClusterIndex(self.facts.name)
        return self.index

    def sync(self, changes: Iterable[Change], present: Present | None = None) -> RoutingPass:
        """One dataplane pass: the documents that changed since the last one
        (``Index.drain()``: kinds routing does not read are ignored; ``present``:
        ``Index.has``, for a heartbeat that does not parse) are taken into the cluster view,
        and the kernel (and BIRD) get what they change. The first pass (given every
        document) programs everything."""
        index = self._index()
        touched = index.apply(changes, present)
        kernel = None
        try:
            kernel = self.overlay.update(index, touched)
        finally:  # BIRD gets its change even when the kernel's failed (and vice versa)
            bird = self._sync_bird(index, touched)
        return RoutingPass(touched, kernel, bird)

    def _sync_bird(self, index: ClusterIndex, touched: Touched) -> bool:
        return False

    def check(self, docs: Documents) -> RoutingCheck:
        """The periodic check: the cluster view, the vxlan state and BIRD's configuration
        recomputed from ``docs`` (the cache's snapshot) and compared with what the passes
        kept (a difference is a bug: logged, counted, and the kept state rebuilt from the
        documents), then the kernel reconciled whole against it. All counts 0 when all was
        right; they are added to :attr:`check_fixes` and exported."""
        cluster = Cluster.from_documents(docs, self.facts.name)
        model = 0
        if self.index is not None:
            model = _cluster_difference(self.index.cluster(), cluster)
            if model:
                log.warning(
                    "routing check: the kept cluster view differed from the documents in %d "
                    "facts: rebuilt",
                    model,
                )
                self.index = None
        rebuild = self.index is None
        if rebuild:
            self._index().apply(_every(docs), lambda kind, key: key in docs.raw(kind))
        vxlan, changes = self.overlay.check(cluster, self._index(), rebuild=rebuild)
        result = RoutingCheck(len(changes), model + vxlan, self._check_bird(cluster))
        self.last_check = result
        for key, n in result.as_dict().items():
            self.check_fixes[key] += n
        if result.fixes:
            log.warning("routing check fixed %s", result.as_dict())
        if self.metrics is not None:
            self.metrics.routing_checked(result.as_dict())
        return result

    def _check_bird(self, cluster: Cluster) -> int:
        return 0

    def reconcile(self, cluster: Cluster, *, full: bool = False) -> None:
        """A whole pass from ``cluster`` (what every pass was before :meth:`sync`)."""
        self.overlay.reconcile(cluster)  # empty under --backend none: removes leftovers

    def status(self, cluster: Cluster | None = None) -> JSON:
        return {"peers": [], "vxlan": [], **self._status_common()}

    def _status_common(self) -> JSON:
        out: JSON = {"routing_problems": self.overlay.problems}
        table = self.overlay.table
        out["routing_passes"] = {
            "passes": self.overlay.passes,
            "rebuilds": table.rebuilds if table is not None else 0,
            "deltas": table.updates if table is not None else 0,
            "fallbacks": self.overlay.reconciler.fallbacks,
            "check_fixes": dict(self.check_fixes),
        }
        return out

    def readiness(self) -> list[str]:
        return []

    def announced(self) -> dict[str, int]:
        return {"block": 0, "borrowed": 0}

    def stop(self, *, stop_bird: bool = True) -> None:
        pass


def _every(docs: Documents) -> list[Change]:
    """Every routing document of a snapshot, as changes (to build a cluster view anew)."""
    return [
        Change(kind.name, key, entry.value)
        for kind in (NODES, HEARTBEATS, POOLS, BLOCKS, BGP_CONFIGURATIONS, BGP_PEERS)
        for key, entry in docs.of(kind).items()
    ] + [
        Change(HEARTBEATS.name, key, None)  # present, though it did not parse
        for key in docs.raw(HEARTBEATS.name)
        if key not in docs.of(HEARTBEATS)
    ]


class VxlanRouting(NoRouting):
    def __init__(
        self, facts: Facts, backend: str = "vxlan", metrics: RoutingHooks | None = None
    ) -> None:
        super().__init__(facts, backend, metrics)

    def status(self, cluster: Cluster | None = None) -> JSON:
        return {"peers": [], "vxlan": self.overlay.vxlan_peers(), **self._status_common()}

    def readiness(self) -> list[str]:
        if self.overlay.passes == 0:
            return ["vxlan: not programmed yet"]
        return [f"vxlan: {p}" for p in self.overlay.problems[:3]]


class BirdRouting(NoRouting):
    """BIRD for BGP (``bird``: the supervisor of the run directory's BIRD); the vxlan state
    for pools that ask for VXLAN."""

    def __init__(
        self,
        facts: Facts,
        bird: BirdSupervisor,
        backend: str = "bird",
        metrics: RoutingHooks | None = None,
    ) -> None:
        super().__init__(facts, backend, metrics)
        self.bird = bird
        self.started = False
        self.config: BirdConfig | None = None
        #: BIRD's configuration rendered, and rendered because a change could alter it
        self.renders = 0
        self._retry = False  # the last render or reload failed: the next pass tries again

    def start(self) -> None:
        pass  # BIRD starts (or is adopted) with the first configuration

    def _bird(self, cluster: Cluster) -> None:
        """Render BIRD's configuration from ``cluster``; start BIRD with it, or reload it
        when it changed."""
        facts = self.facts
        self._retry = True
        self.renders += 1
        config = bird_config(cluster, facts.name, ipip=facts.ipip_available)
        if config is None:
            raise RuntimeError("BIRD needs the node's IPv4 address (--node-ip)")
        if not self.started:
            self.bird.start(config)
            self.started = True
            if self.bird.adopted:
                log.warning("adopted the running BIRD (pid %s)", self.bird.pid)
        elif config != self.config:
            self.bird.apply(config)
        self.config = config
        self._retry = False

    def _sync_bird(self, index: ClusterIndex, touched: Touched) -> bool:
        if self.started and not self._retry and not bird_touched(index, touched):
            return False  # e.g. a pod on another node: BIRD's configuration cannot change
        self._bird(index.bird_cluster())
        return True

    def _check_bird(self, cluster: Cluster) -> int:
        before = self.config
        self._bird(cluster)
        if before is not None and before != self.config:
            log.warning("routing check: BIRD's configuration differed from the whole recompute")
            return 1
        return 0

    def reconcile(self, cluster: Cluster, *, full: bool = False) -> None:
        self.overlay.reconcile(cluster)
        self._bird(cluster)

    def status(self, cluster: Cluster | None = None) -> JSON:
        problems = []
        try:
            peers = [p.as_dict() for p in self.bird.peers()]
        except Exception as e:
            peers = []
            problems = [f"bird: {e}"]
        out = {
            "peers": peers,
            "vxlan": self.overlay.vxlan_peers(),
            "bird": {"pid": self.bird.pid, "restarts": self.bird.restarts, "renders": self.renders},
            **self._status_common(),
        }
        out["routing_problems"] = [*self.overlay.problems, *problems]
        return out

    def announced(self) -> dict[str, int]:
        if self.config is None:
            return super().announced()
        return {"block": len(self.config.blocks), "borrowed": len(self.config.borrowed)}

    def readiness(self) -> list[str]:
        if not self.started:
            return ["bird: not started yet"]
        return [f"bird: {r}" for r in self.bird.readiness()]

    def stop(self, *, stop_bird: bool = True) -> None:
        """tabby-node's SIGTERM: BIRD goes for a graceful restart (peers keep this node's
        routes until the next tabby-node's BIRD sent them again: a restart or an upgrade
        moves no traffic); ``stop_bird`` False leaves it running for a successor."""
        if stop_bird:
            self.bird.stop(graceful=True)
        else:
            self.bird.detach()


def choose(
    backend: str, facts: Facts, run_dir: str, metrics: RoutingHooks | None
) -> RoutingBackend:
    """The routing backend ``--backend`` names (BIRD's supervisor on ``run_dir``)."""
    if backend == "bird":
        from bird import BirdSupervisor

        return BirdRouting(facts, BirdSupervisor(run_dir), backend, metrics)
    if backend == "vxlan":
        return VxlanRouting(facts, backend, metrics)
    return NoRouting(facts, backend, metrics)


def bird_touched(index: ClusterIndex, touched: Touched) -> bool:
    """Whether what ``touched`` changed can alter node ``index.me``'s BIRD configuration
    (``bird_config`` reads): pools, the BGP configuration and peers; a node appearing,
    expiring, going, or changing its address, AS, route reflector cluster id or labels;
    this node's own blocks coming and going; an address it holds in another's block; the
    one address of a one-address block of its own held by another node. Pods, its own or
    another node's, come and go without it (but for those borrowed addresses)."""
    if touched.pools or touched.bgp:
        return True
    me = index.me
    for name, before in touched.nodes.items():
        if _bird_facts(before, name == me) != _bird_facts(index.nodes.get(name), name == me):
            return True
    for key, old in touched.blocks.items():
        if _bird_block(index, old) != _bird_block(index, index.blocks.get(key)):
            return True
    return False


def _bird_block(index: ClusterIndex, entry: BlockEntry | None) -> tuple[object, ...] | None:
    """What ``bird_config`` reads of a block document: its prefix if it is this node's
    (announced), whether another node holds its one address (then that node announces
    it), and the addresses this node holds in it (announced as /32 or /128)."""
    if entry is None:
        return None
    me = index.me
    mine = entry.info.node == me
    held = frozenset((b.address, b.block) for b in entry.borrowed if b.holder == me)
    lent = any(b.holder != me and b.prefix == b.block for b in entry.borrowed)
    if lent and not mine:  # counts only for a block of this node's of that prefix
        at = index.blocks_at.get(entry.info.cidr, ())
        lent = any(index.blocks[k].info.node == me for k in at)
    if not mine and not held and not lent:
        return None
    return (entry.info.cidr if mine else None, lent, held)


def _bird_facts(node: NodeInfo | None, mine: bool) -> tuple[object, ...] | None:
    """What ``bird_config`` reads of a node (of another only while it is alive)."""
    if node is None or not (node.alive or mine):
        return None
    return (node.ipv4, node.ipv6, node.as_number, node.rr_cluster_id, node.labels)


# -- the BIRD configuration from the cluster view (confd's role) --------------------------------


def _matches(selector: str | None, labels: Mapping[str, str]) -> bool:
    from resources.selector import parse_selector

    if not selector:
        return True
    try:
        return parse_selector(selector).matches(labels)
    except ValueError:
        log.warning("ignoring an invalid selector %r", selector)
        return False


def _address(text: str | None) -> IPAddress | None:
    try:
        return ipaddress.ip_address(text) if text else None
    except ValueError:
        return None


def _applies_to(peer: PeerSpec, me: NodeInfo) -> bool:
    if peer.node is not None:
        return peer.node == me.name
    return _matches(peer.node_selector, me.labels)


def bird_config(cluster: Cluster, me_name: str, *, ipip: bool = False) -> BirdConfig | None:
    """The BirdConfig of node ``me_name`` (None when it has no IPv4 underlay address).

    Sessions, as Calico's confd decides them: the node-to-node mesh (unless disabled or this
    node is a route reflector) towards every other live node that is not a reflector;
    BGPPeers that apply to this node (``node`` or ``nodeSelector``; neither: every node)
    towards ``peerIP`` or towards the live nodes ``peerSelector`` selects; and the reverse
    of every BGPPeer whose far side is this node (``peerSelector`` selects it, or ``peerIP``
    is its address at its AS): it peers back with the live nodes the BGPPeer applies to, so
    that both ends of a session exist (Calico's route reflector set-up is one BGPPeer,
    ``nodeSelector: all()``, ``peerSelector: route-reflector == 'true'``). A reflector has
    the nodes it peers with as clients unless they share its cluster id. One session per
    address, the first one wins: global BGPPeers, node-specific ones, reverse peerings, the
    mesh. A peer address BIRD cannot use (loopback, link-local, ...) is skipped and logged.
    Blocks and borrowed addresses of pools that use VXLAN are left to the vxlan state."""
    from bird import DEFAULT_AS, BirdConfig, BirdNode, PeerType

    me = cluster.nodes.get(me_name)
    if me is None or me.ipv4 is None:
        return None
    cluster_as = cluster.as_number or DEFAULT_AS
    my_as = me.as_number or cluster_as
    rr = ipaddress.IPv4Address(me.rr_cluster_id) if me.rr_cluster_id else None
    node = BirdNode(
        me_name,
        me.ipv4.ip,
        me.ipv6.ip if me.ipv6 else None,
        as_number=my_as,
        rr_cluster_id=rr,
    )
    sessions = _Sessions(node, me, cluster_as)
    others = [n for n in cluster.alive() if n.name != me_name]
    # global BGPPeers before node-specific ones: for one address, the global one wins
    specs = sorted(cluster.peers, key=lambda p: bool(p.node or p.node_selector))
    sessions.bgp_peers(specs, others)
    sessions.reverse_peerings(specs, others)
    if cluster.mesh and rr is None:
        for other in others:
            if not other.rr_cluster_id:
                sessions.add_node(other, PeerType.MESH)
    pools, blocks, borrowed = _bird_routes(cluster, me_name, ipv6=node.ipv6 is not None, ipip=ipip)
    return BirdConfig(
        node=node,
        peers=tuple(sessions.peers.values()),
        pools=pools,
        blocks=blocks,
        borrowed=borrowed,
        log_severity=_SEVERITY.get(cluster.log_severity, "info"),  # type: ignore[arg-type]
    )


class _Sessions:
    """The BGP sessions of one node as :func:`bird_config` collects them: one per address,
    the first one wins."""

    def __init__(self, node: BirdNode, me: NodeInfo, cluster_as: int) -> None:
        self.node = node
        self.me = me
        self.cluster_as = cluster_as
        self.peers: dict[IPAddress, Peer] = {}

    def as_of(self, other: NodeInfo) -> int:
        return other.as_number or self.cluster_as

    def add(
        self,
        other: NodeInfo | None,
        address: IPAddress | None,
        kind: PeerType,
        as_number: int,
        name: str,
    ) -> None:
        from bird import Peer, PeerType

        node, rr = self.node, self.node.rr_cluster_id
        if address is None or address in (node.ipv4, node.ipv6) or address in self.peers:
            return
        if address.version == 6 and node.ipv6 is None:
            return
        client = False
        if other is not None and rr is not None and as_number == node.as_number:
            client = other.rr_cluster_id != self.me.rr_cluster_id
        if other is not None and (rr is not None or other.rr_cluster_id):
            kind = PeerType.RR
        try:
            self.peers[address] = Peer(address, kind, as_number, client, name)
        except ValueError as e:  # one bad Node or BGPPeer must not stop every node's BGP
            log.warning("ignoring BGP peer %s (%s): %s", address, name, e)

    def add_node(self, other: NodeInfo, kind: PeerType, versions: tuple[int, ...] = (4, 6)) -> None:
        for iface in (other.ipv4, other.ipv6):
            if iface is not None and iface.version in versions:
                self.add(other, iface.ip, kind, self.as_of(other), other.name)

    def bgp_peers(self, specs: list[PeerSpec], others: list[NodeInfo]) -> None:
        """The BGPPeers that apply to this node, towards ``peerIP`` or the live nodes
        ``peerSelector`` selects."""
        from bird import PeerType

        by_address = {i.ip: n for n in others for i in (n.ipv4, n.ipv6) if i is not None}
        for spec in specs:
            if not _applies_to(spec, self.me):
                continue
            kind = PeerType.NODE if (spec.node or spec.node_selector) else PeerType.GLOBAL
            if spec.peer_ip:
                addr = _address(spec.peer_ip)
                if addr is not None:
                    as_number = spec.as_number or self.node.as_number
                    self.add(by_address.get(addr), addr, kind, as_number, spec.name)
            elif spec.peer_selector is not None:
                for other in others:
                    if _matches(spec.peer_selector, other.labels):
                        self.add_node(other, kind)

    def reverse_peerings(self, specs: list[PeerSpec], others: list[NodeInfo]) -> None:
        """The reverse peerings: this node is the BGPPeer's far side (``peerSelector``
        selects it, or ``peerIP`` is its address at its AS)."""
        from bird import PeerType

        node = self.node
        for spec in specs:
            if spec.peer_selector is not None:
                if not _matches(spec.peer_selector, self.me.labels):
                    continue
                versions: tuple[int, ...] = (4, 6)
            else:
                addr = _address(spec.peer_ip)
                if addr is None or addr not in (node.ipv4, node.ipv6):
                    continue
                if spec.as_number != node.as_number:
                    continue
                versions = (addr.version,)
            for other in others:
                if _applies_to(spec, other):
                    self.add_node(other, PeerType.NODE, versions)


def _bird_routes(
    cluster: Cluster, me_name: str, *, ipv6: bool, ipip: bool
) -> tuple[tuple[BirdPool, ...], tuple[IPNetwork, ...], tuple[IPAddress, ...]]:
    """What BIRD announces for node ``me_name`` (``ipv6``: it has an IPv6 underlay
    address): the pools, its blocks and the addresses it borrowed, of the pools that do
    not use VXLAN."""
    from bird import Pool

    def routed_by_bird(net: IPNetwork) -> bool:
        return encap_of(cluster.pool_of(net), "bird")[0] != "vxlan"

    # A one-address block (blockSize 32/128) whose address another node holds is that
    # node's /32 to announce: the owner announcing the same prefix would split the traffic.
    lent_whole = {b.block for b in cluster.borrowed if b.holder != me_name and b.prefix == b.block}

    pools = tuple(
        Pool(p.cidr, ipip=ipip and p.encap("bird")[0] == "ipip" and p.cidr.version == 4)
        for p in cluster.pools
        if p.encap("bird")[0] != "vxlan" and (p.cidr.version == 4 or ipv6)
    )
    blocks = tuple(
        b.cidr
        for b in cluster.blocks_of(me_name)
        if routed_by_bird(b.cidr) and (b.cidr.version == 4 or ipv6) and b.cidr not in lent_whole
    )
    borrowed = tuple(
        b.address
        for b in cluster.borrowed
        if b.holder == me_name and routed_by_bird(b.block) and (b.address.version == 4 or ipv6)
    )
    return pools, blocks, borrowed
