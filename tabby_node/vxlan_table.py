"""The vxlan backend's kernel state, kept up to date per changed document: a pure module.

:func:`tabby_node.cluster.vxlan_state` computes the whole desired state from the whole
cluster. :class:`VxlanTable` holds that state and, given what a batch of changed documents
touched (:class:`tabby_node.cluster_index.Touched`), recomputes only the objects that
depend on it, and returns the difference as a :class:`~dataplane.overlay_model.OverlayDelta`
for :meth:`dataplane.overlay.Reconciler.apply`:

- a block: the route of its prefix and of the addresses borrowed in it (before and after);
- a node: its VXLAN endpoint (FDB entry and neighbour) and the routes of its blocks and of
  the addresses it holds. Endpoints whose MAC or tunnel address collide are decided as the
  full computation decides them, the first node in name order wins: only among the nodes
  connected to the changed one by a shared MAC or tunnel address (itself alone, normally);
- this node's own devices, or a pool (which decides which prefixes use VXLAN and which
  devices exist): everything again, from the index (no document is read again). Rare.

Each prefix's route is decided from every claim on it in the order of the full
computation: the blocks of that prefix (their owner's route, or this node's blackhole),
then the addresses borrowed at it (their holder's /32, or none for a one-address block
this node holds itself).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, TypeVar

from dataplane.overlay_model import (
    DesiredState,
    FdbEntry,
    NeighbourEntry,
    OverlayDelta,
    OverlayRoute,
)
from tabby_node.cluster import (
    NodeInfo,
    Underlay,
    Vtep,
    VtepClaim,
    VxlanLocal,
    accept_vteps,
    encap_of,
    vtep_claim,
    vxlan_wanted,
)

if TYPE_CHECKING:
    from _typeshed import SupportsRichComparison

    from bundle.types import IPAddress, IPNetwork
    from tabby_node.cluster_index import ClusterIndex, Touched

K = TypeVar("K")
V = TypeVar("V")

#: What ``programmed()`` counts (the ``tabby_routes_programmed`` kinds, plus ``fdb``).
ROUTE_KINDS = ("block", "borrowed", "blackhole")


def route_kind(route: OverlayRoute) -> str:
    """``block`` (a unicast route to a prefix), ``borrowed`` (to one address: also a
    one-address block) or ``blackhole``."""
    if route.type == "blackhole":
        return "blackhole"
    return "borrowed" if route.dst.prefixlen == route.dst.max_prefixlen else "block"


class _Journal:
    """The objects a pass changed, each with its value before the pass."""

    def __init__(self) -> None:
        self.fdb: dict[tuple[str, str], FdbEntry | None] = {}
        self.neighbours: dict[tuple[str, IPAddress], NeighbourEntry | None] = {}
        self.routes: dict[IPNetwork, OverlayRoute | None] = {}


class VxlanTable:
    """The desired vxlan state of node ``me``, kept by :meth:`update` (not thread-safe)."""

    def __init__(self, me: str, underlay: Underlay, backend: str) -> None:
        self.me = me
        self.underlay = underlay
        self.backend = backend
        self.local = VxlanLocal(underlay, backend, {})
        #: False until the first :meth:`rebuild` (and after one that failed)
        self.ready = False
        #: version -> node -> the endpoint it claims (alive remote nodes with one)
        self.claims: dict[int, dict[str, VtepClaim]] = {4: {}, 6: {}}
        self._by_mac: dict[int, dict[str, set[str]]] = {4: {}, 6: {}}
        self._by_tunnel: dict[int, dict[IPAddress, set[str]]] = {4: {}, 6: {}}
        self.vteps: dict[tuple[str, int], Vtep] = {}
        self.fdb: dict[tuple[str, str], FdbEntry] = {}
        self.neighbours: dict[tuple[str, IPAddress], NeighbourEntry] = {}
        self.routes: dict[IPNetwork, OverlayRoute] = {}
        self._counts = dict.fromkeys(ROUTE_KINDS, 0)
        self._journal = _Journal()
        #: passes done whole (the first, devices or pools changed) and per change
        self.rebuilds = 0
        self.updates = 0
        #: grows whenever a VTEP (its FDB entry, its neighbour) changes: what node status's
        #: VXLAN peers are made of (``_Overlay.vxlan_peers`` keeps them until it grows)
        self.peers_version = 0

    # -- reading -------------------------------------------------------------------------

    def desired(self) -> DesiredState:
        """The whole desired state (O(cluster): for a full reconcile and the check)."""
        return DesiredState(
            vxlan_v4=self.local.devices.get(4),
            vxlan_v6=self.local.devices.get(6),
            fdb=frozenset(self.fdb.values()),
            neighbours=frozenset(self.neighbours.values()),
            routes=frozenset(self.routes.values()),
        )

    def programmed(self) -> dict[str, int]:
        """Routes by kind, tunnels (neighbours) and FDB entries wanted now (kept as counts:
        no pass over the table)."""
        return {**self._counts, "tunnel": len(self.neighbours), "fdb": len(self.fdb)}

    # -- updating ------------------------------------------------------------------------

    def update(self, index: ClusterIndex, touched: Touched) -> OverlayDelta:
        """Bring the table up to date with ``index`` after a batch that ``touched`` this;
        returns what changed. ValueError (nothing changed) when this node's own tunnel
        address or MAC cannot make a device, as ``vxlan_state`` raises."""
        if not self.ready or touched.pools:
            return self.rebuild(index)
        if self.me in touched.nodes:
            try:
                local = self._local(index)
            except ValueError:
                self.ready = False  # no state until this node's own document is usable
                raise
            if local.devices != self.local.devices:
                return self.rebuild(index)
        if not touched.nodes and not touched.blocks:
            return OverlayDelta()
        self.updates += 1
        renode: set[str] = set()
        for version in sorted(self.local.devices):
            renode |= self._claims(index, version, touched.nodes)
        prefixes: set[IPNetwork] = set()
        for name, before in touched.nodes.items():
            if name != self.me and _where(before) != _where(index.nodes.get(name)):
                renode.add(name)
        for name in renode:
            prefixes |= index.prefixes_of(name)
        for key, old in touched.blocks.items():
            for entry in (old, index.blocks.get(key)):
                if entry is not None:
                    prefixes.add(entry.info.cidr)
                    prefixes.update(b.prefix for b in entry.borrowed)
        for prefix in prefixes:
            self._resolve(index, prefix)
        return self._delta(devices=False)

    def rebuild(self, index: ClusterIndex) -> OverlayDelta:
        """Everything again from ``index`` (the first pass; this node's devices or the
        pools changed); returns the difference to what the table held."""
        try:
            local = self._local(index)
        except ValueError:
            self.ready = False
            raise
        self.rebuilds += 1
        devices = local.devices != self.local.devices or not self.ready
        self.local = local
        self.ready = True
        for version in (4, 6):
            self.claims[version] = {}
            self._by_mac[version] = {}
            self._by_tunnel[version] = {}
        vteps: dict[tuple[str, int], Vtep] = {}
        for version, device in sorted(local.devices.items()):
            claims = self.claims[version]
            for name, info in index.sorted_nodes().items():
                claim = _claim(info, version) if name != self.me else None
                if claim is not None:
                    claims[name] = claim
                    _add(self._by_mac[version], claim.mac, name)
                    _add(self._by_tunnel[version], claim.tunnel, name)
            for name, vtep in accept_vteps(device, claims.items()).items():
                vteps[(name, version)] = vtep
        for key in [k for k in self.vteps if k not in vteps]:
            self._set_vtep(key, None)
        for key, vtep in vteps.items():
            self._set_vtep(key, vtep)
        for prefix in {*self.routes, *index.blocks_at, *index.borrowed_at}:
            self._resolve(index, prefix)
        return self._delta(devices=devices)

    # -- the pieces ------------------------------------------------------------------------

    def _local(self, index: ClusterIndex) -> VxlanLocal:
        pools = index.sorted_pools()
        return VxlanLocal.of(
            index.nodes.get(self.me),
            self.underlay,
            self.backend,
            lambda version: vxlan_wanted(pools, version, self.backend),
        )

    def _claims(
        self, index: ClusterIndex, version: int, nodes: dict[str, NodeInfo | None]
    ) -> set[str]:
        """Take the endpoint claims of the changed ``nodes`` and decide again the
        endpoints of every node that shares a MAC or tunnel address with them (before or
        after), as the full computation would; returns the nodes whose endpoint changed."""
        claims = self.claims[version]
        by_mac, by_tunnel = self._by_mac[version], self._by_tunnel[version]
        macs: set[str] = set()
        tunnels: set[IPAddress] = set()
        group: set[str] = set()
        for name in nodes:
            if name == self.me:
                continue
            info = index.nodes.get(name)
            claim = _claim(info, version) if info is not None else None
            old = claims.get(name)
            if claim == old:
                continue
            group.add(name)
            if old is not None:
                macs.add(old.mac)
                tunnels.add(old.tunnel)
                _remove(by_mac, old.mac, name)
                _remove(by_tunnel, old.tunnel, name)
                del claims[name]
            if claim is not None:
                macs.add(claim.mac)
                tunnels.add(claim.tunnel)
                _add(by_mac, claim.mac, name)
                _add(by_tunnel, claim.tunnel, name)
                claims[name] = claim
        if not group:
            return set()
        # Every node connected to the changed ones through shared MACs or tunnel addresses:
        # outside that group no endpoint can be decided differently.
        seen_macs: set[str] = set()
        seen_tunnels: set[IPAddress] = set()
        while macs or tunnels:
            found: set[str] = set()
            for mac in macs - seen_macs:
                found |= by_mac.get(mac, set())
            for tunnel in tunnels - seen_tunnels:
                found |= by_tunnel.get(tunnel, set())
            seen_macs |= macs
            seen_tunnels |= tunnels
            found -= group
            group |= found
            macs = {claims[n].mac for n in found} - seen_macs
            tunnels = {claims[n].tunnel for n in found} - seen_tunnels
        device = self.local.devices[version]
        accepted = accept_vteps(device, ((n, claims[n]) for n in sorted(group) if n in claims))
        changed = {n for n in group if accepted.get(n) != self.vteps.get((n, version))}
        for name in changed:  # removals first: a MAC may pass from one node to another
            if (name, version) in self.vteps and name not in accepted:
                self._set_vtep((name, version), None)
        for name in changed:
            if name in accepted:
                self._set_vtep((name, version), accepted[name])
        return changed

    def _set_vtep(self, key: tuple[str, int], vtep: Vtep | None) -> None:
        old = self.vteps.get(key)
        if old == vtep:
            return
        self.peers_version += 1
        j = self._journal
        if old is not None:
            fdb_key = (old.fdb.device, old.fdb.mac)
            neigh_key = (old.neighbour.device, old.neighbour.address)
            j.fdb.setdefault(fdb_key, self.fdb.get(fdb_key))
            j.neighbours.setdefault(neigh_key, self.neighbours.get(neigh_key))
            if self.fdb.get(fdb_key) == old.fdb:
                del self.fdb[fdb_key]
            if self.neighbours.get(neigh_key) == old.neighbour:
                del self.neighbours[neigh_key]
            del self.vteps[key]
        if vtep is not None:
            fdb_key = (vtep.fdb.device, vtep.fdb.mac)
            neigh_key = (vtep.neighbour.device, vtep.neighbour.address)
            j.fdb.setdefault(fdb_key, self.fdb.get(fdb_key))
            j.neighbours.setdefault(neigh_key, self.neighbours.get(neigh_key))
            self.fdb[fdb_key] = vtep.fdb
            self.neighbours[neigh_key] = vtep.neighbour
            self.vteps[key] = vtep

    def _route(
        self, node: NodeInfo, prefix: IPNetwork, index: ClusterIndex, block: IPNetwork
    ) -> OverlayRoute | None:
        vtep = self.vteps.get((node.name, prefix.version))
        return self.local.route(node, prefix, index.pool_of(block), vtep)

    def _resolve(self, index: ClusterIndex, prefix: IPNetwork) -> None:
        """Decide ``prefix``'s route from every claim on it, in the full computation's
        order (blocks, then borrowed addresses; documents of one prefix by key)."""
        me = self.me
        route: OverlayRoute | None = None
        keys = index.blocks_at.get(prefix)
        if keys:
            for key in sorted(keys) if len(keys) > 1 else keys:
                owner = index.blocks[key].info.node
                if owner == me:
                    if encap_of(index.pool_of(prefix), self.backend)[0] == "vxlan":
                        route = OverlayRoute.blackhole(prefix)
                    continue
                node = index.alive_node(owner)
                if node is not None:
                    route = self._route(node, prefix, index, prefix) or route
        held = index.borrowed_at.get(prefix)
        if held:
            for key in sorted(held) if len(held) > 1 else held:
                b = held[key]
                if b.holder == me:
                    if b.prefix == b.block:  # a one-address block: this node's pod route
                        route = None
                    continue
                node = index.alive_node(b.holder)
                if node is not None:
                    route = self._route(node, prefix, index, b.block) or route
        self._set_route(prefix, route)

    def _set_route(self, prefix: IPNetwork, route: OverlayRoute | None) -> None:
        old = self.routes.get(prefix)
        if old == route:
            return
        self._journal.routes.setdefault(prefix, old)
        if old is not None:
            self._counts[route_kind(old)] -= 1
        if route is None:
            del self.routes[prefix]
        else:
            self.routes[prefix] = route
            self._counts[route_kind(route)] += 1

    def _delta(self, *, devices: bool) -> OverlayDelta:
        j, self._journal = self._journal, _Journal()
        return OverlayDelta(
            devices=devices,
            fdb=_pairs(j.fdb, self.fdb, lambda k: k),
            neighbours=_pairs(j.neighbours, self.neighbours, lambda k: (k[0], k[1].version, k[1])),
            routes=_pairs(j.routes, self.routes, lambda k: (k.version, k)),
        )


def _claim(info: NodeInfo | None, version: int) -> VtepClaim | None:
    """A live node's endpoint claim (a dead one claims nothing)."""
    if info is None or not info.alive:
        return None
    return vtep_claim(info, version)


def _where(info: NodeInfo | None) -> tuple[object, object] | None:
    """What a node's routes depend on besides its endpoint: alive, and its underlay
    addresses (CrossSubnet routes go straight to them)."""
    if info is None or not info.alive:
        return None
    return (info.ipv4, info.ipv6)


def _pairs(
    before: Mapping[K, V | None],
    now: Mapping[K, V],
    order: Callable[[K], SupportsRichComparison],
) -> tuple[tuple[V | None, V | None], ...]:
    """(before, now) of every key whose value changed, in ``order`` of their keys."""
    changed = [key for key, old in before.items() if now.get(key) != old]
    changed.sort(key=order)
    return tuple((before[key], now.get(key)) for key in changed)


def _add(index: dict[K, set[str]], key: K, name: str) -> None:
    index.setdefault(key, set()).add(name)


def _remove(index: dict[K, set[str]], key: K, name: str) -> None:
    names = index.get(key)
    if names is not None:
        names.discard(name)
        if not names:
            del index[key]
