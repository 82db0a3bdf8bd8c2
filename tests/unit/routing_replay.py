"""Random routing histories replayed op by op, the incremental state compared with the
whole recompute after each (the driver of the unit and privileged replay tests).

Each seed writes a random history into a datastore with tabby's own writers
(tests/unit/cluster_world.py: registration, tunnel addresses, IPAM assigns and releases,
``tabbyctl apply``) plus the raw writes an operator, a crash or a bug can leave (a Node
edited by hand, a MAC another node has, an unparseable document, a block re-affined or
written whole, a pool deleted under its blocks, a foreign route in the kernel): nodes join,
leave, expire and come back, change addresses, MACs and tunnel addresses; pods come and go
in their node's blocks and borrow across nodes, also in one-address (/32) blocks; pools
appear, go and change vxlanMode (CrossSubnet included); the BGP configuration and peers
change. The documents reach a ``resources.index.Index`` as the watch feeds it, and after
every op (or a random batch of them) each node's view is compared:

- ``ClusterIndex.cluster()`` with ``Cluster.from_documents`` of the same documents;
- ``VxlanTable``'s state with ``vxlan_state`` (both raise, or both agree); the delta it
  returned, applied to the state before, with the state after;
- the delta applied to an in-memory kernel (``Reconciler.apply``), then a fresh
  ``Reconciler``'s whole reconcile of that kernel: it must change nothing (with a route
  removed behind tabby's back it must fix exactly that);
- ``bird_config`` of ``ClusterIndex.bird_cluster()`` with ``bird_config`` of the whole
  cluster, and when ``bird_touched`` says a batch cannot alter BIRD's configuration, that
  the whole recompute indeed did not change.

The kernel is pluggable (:class:`Kernel`): an in-memory one here
(tests/unit/tabby_node/test_routing_replay.py), a real one in a network namespace in the privileged
tier (tests/privileged/test_routing_replay.py).
"""

from __future__ import annotations

import copy
import ipaddress
import random
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from bundle.types import IPNetwork
from dataplane.overlay import Changes, Reconciler
from dataplane.overlay_model import (
    RTN_UNICAST,
    DesiredState,
    KernelRoute,
    OverlayDelta,
)
from datastore.base import Doc
from datastore.errors import DatastoreError
from ipam.core.allocator import Ipam
from ipam.core.block import Block
from resources.index import ROUTING, Documents, Index
from tabby_node.cluster import Cluster, Underlay, vxlan_state
from tabby_node.cluster_index import ClusterIndex
from tabby_node.routing import bird_config, bird_touched
from tabby_node.vxlan_table import VxlanTable
from tests.unit.cluster_world import NODE_TTL, World, net
from tests.unit.fake_kernel import FakeKernel

#: name -> (IPv4 underlay, IPv6 underlay or None): two subnets, so CrossSubnet matters
NODES = {
    "a": ("192.168.1.1/24", "fd00:1::1/64"),
    "b": ("192.168.1.2/24", "fd00:1::2/64"),
    "c": ("192.168.1.3/24", None),
    "d": ("192.168.2.4/24", "fd00:2::4/64"),
    "e": ("192.168.2.5/24", None),
    "f": ("192.168.2.6/24", "fd00:2::6/64"),
    "g": ("192.168.1.7/24", None),
}
#: the nodes whose view is checked (the others only write)
VIEWS = ("a", "d", "e")
POOLS = {
    "pods": ("10.244.0.0/16", {}),
    "small": ("10.245.0.0/26", {"blockSize": 29}),
    "single": ("10.99.0.0/28", {"blockSize": 32}),
    "pods6": ("fd10::/48", {}),
}
MODES = (None, "Always", "CrossSubnet", "Never")
MACS = ("02:00:00:00:00:aa", "02:00:00:00:00:bb", "01:00:5e:00:00:01", "00:00:00:00:00:00")
T = TypeVar("T")
RAW_BLOCKS = (
    "10.244.200.0/26",
    "10.244.200.0/32",
    "10.244.200.3/32",
    "10.99.0.9/32",
    "fd10::40/122",
)


class Kernel(Protocol):
    """The kernel a view programs, and what a test does to it behind tabby's back."""

    reconciler: Reconciler

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """Call ``fn`` where the kernel is (its network namespace)."""
        ...

    def whole(self, desired: DesiredState) -> Changes:
        """A fresh Reconciler's whole reconcile of ``desired`` (the periodic check)."""
        ...

    def add_foreign(self, dst: IPNetwork) -> bool:
        """A route of another protocol on ``dst`` (False: a route holds it already)."""
        ...

    def drop_ours(self, rng: random.Random) -> IPNetwork | None:
        """One of tabby's routes removed (None: there is none)."""
        ...

    def foreign_intact(self, dst: IPNetwork) -> bool: ...


class MemoryKernel:
    """:class:`Kernel` in memory (tests/unit/fake_kernel.py)."""

    def __init__(self) -> None:
        self.fake = FakeKernel(ipip=False)
        self.reconciler = Reconciler(netlink=self.fake)  # type: ignore[arg-type]

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return fn(*args)

    def whole(self, desired: DesiredState) -> Changes:
        return Reconciler(netlink=self.fake).reconcile(desired)  # type: ignore[arg-type]

    def add_foreign(self, dst: IPNetwork) -> bool:
        if (dst, 0) in self.fake.routes:
            return False
        self.fake.routes[(dst, 0)] = KernelRoute(dst, RTN_UNICAST, 4, None, 2, False, 0)
        return True

    def drop_ours(self, rng: random.Random) -> IPNetwork | None:
        ours = sorted((k for k, r in self.fake.routes.items() if r.proto == 116), key=str)
        if not ours:
            return None
        key = rng.choice(ours)
        del self.fake.routes[key]
        return key[0]  # type: ignore[no-any-return]

    def foreign_intact(self, dst: IPNetwork) -> bool:
        route = self.fake.routes.get((dst, 0))
        return route is not None and route.proto == 4


class View:
    """One node's incremental routing, and the kernel it programs."""

    def __init__(self, me: str, underlay: Underlay, backend: str, kernel: Kernel) -> None:
        self.me = me
        self.underlay = underlay
        self.backend = backend
        self.index = ClusterIndex(me)
        self.table = VxlanTable(me, underlay, backend)
        self.kernel = kernel
        self.desired: DesiredState | None = None
        self.bird: object = None
        self.deltas = 0
        self.renders = 0
        self.foreign: set[IPNetwork] = set()


class Replay:
    def __init__(
        self,
        seed: int,
        backend: str,
        kernel: Callable[[str, Underlay], Kernel] = lambda me, underlay: MemoryKernel(),
    ) -> None:
        self.kernel = kernel
        self.rng = random.Random(seed)
        self.backend = backend
        self.w = World(backend)  # type: ignore[arg-type]
        self.store = self.w.store
        self.watch = Index(ROUTING)
        self.running: set[str] = set()
        self.views: dict[str, View] = {}
        self.log: list[str] = []

    # -- the history -------------------------------------------------------------------

    def setup(self) -> None:
        for name, (cidr, spec) in POOLS.items():
            if name == "pods":  # one pool with VXLAN at first, whatever the seed
                mode = self.rng.choice([m for m in MODES if m != "Never"])
                self.w.pool(name, cidr, **spec, **({"vxlanMode": mode} if mode else {}))
            elif name != "single" or self.rng.random() < 0.8:
                self.w.pool(name, cidr, **spec, **self._modes())
        for name in NODES:
            if name in VIEWS or self.rng.random() < 0.6:
                self.join(name)
        for me in VIEWS:
            underlay = self.w.underlay(me)
            self.views[me] = View(me, underlay, self.backend, self.kernel(me, underlay))

    def _modes(self) -> dict[str, Any]:
        mode = self.rng.choice(MODES)
        return {} if mode is None else {"vxlanMode": mode}

    def join(self, name: str) -> None:
        v4, v6 = NODES[name]
        try:
            self.w.node(name, v4, v6 if self.rng.random() < 0.8 else None)
        except Exception as e:  # another node has its address: tabby-node refuses to start
            self.log.append(f"join {name}: {e}")
            return
        self.running.add(name)

    def beat(self) -> None:
        for name in sorted(self.running):
            self.w.nodes[name].liveness.beat()

    def edit(self, kind: str, key: str, change: Callable[[dict[str, Any]], object]) -> None:
        doc = self.store.get(kind, key)
        if doc is None:
            return
        data = copy.deepcopy(doc.data)
        change(data)
        self.store.put(kind, key, data, doc.revision)

    def spec(self, name: str, **fields: Any) -> None:
        def change(data: dict[str, Any]) -> None:
            spec = data.setdefault("spec", {})
            for key, value in fields.items():
                if value is None:
                    spec.pop(key, None)
                else:
                    spec[key] = value

        self.edit("node", name, change)

    def nodes(self) -> list[str]:
        return sorted(self.store.list_keys("node"))

    def blocks(self) -> list[tuple[str, Doc]]:
        return sorted(self.store.list("block"))

    def op(self) -> str:
        rng = self.rng
        names = list(NODES)
        pick = rng.random()
        name = rng.choice(names)
        nodes = self.nodes() or names
        if pick < 0.22:
            holder = rng.choice(nodes)
            pool = rng.choice([cidr for cidr, _ in POOLS.values()])
            blocks = [k for k, d in self.blocks() if d.data.get("affinity") != f"host:{holder}"]
            try:
                if blocks and rng.random() < 0.4:  # a borrowed address
                    block = net(rng.choice(blocks))
                    free = self._free(block)
                    if free is None:
                        return "borrow: full"
                    self.w.pod(holder, free)
                    return f"pod on {holder} borrows {free}"
                self.w.pod(holder, pool=pool, v6=ipaddress.ip_network(pool).version == 6)
            except (DatastoreError, ValueError) as e:
                return f"pod on {holder}: {e}"
            return f"pod on {holder} in {pool}"
        if pick < 0.34:
            allocated = [
                (k, i, a)
                for k, d in self.blocks()
                for i, a in enumerate(d.data["allocations"])
                if a is not None
            ]
            if not allocated:
                return "release: nothing"
            key, ordinal, alloc = rng.choice(allocated)
            address = Block.from_data(self.store.get("block", key).data, key).ip(ordinal)  # type: ignore[union-attr]
            holder = (alloc.get("attrs") or {}).get("node") or "x"
            Ipam(self.store, holder).release_ip(address)
            return f"release {address}"
        if pick < 0.40:
            held = self.blocks()
            if not held:
                return "affinity: no block"
            key, _ = rng.choice(held)
            owner = rng.choice([*nodes, None])
            self.edit("block", key, lambda d: d.update(affinity=f"host:{owner}" if owner else None))
            return f"block {key} affine to {owner}"
        if pick < 0.43:
            held = self.blocks()
            if not held:
                return "delete block: none"
            key, doc = rng.choice(held)
            self.store.delete("block", key, doc.revision)
            return f"delete block {key}"
        if pick < 0.47:
            return self.raw_block()
        if pick < 0.53:
            if name in self.running:
                self.running.discard(name)
                self.w.now += NODE_TTL + 1
                self.beat()
                return f"{name} expires"
            if name in nodes:
                self.running.add(name)
                self.w.nodes[name].liveness.beat()
                return f"{name} beats again"
            self.join(name)
            return f"{name} joins"
        if pick < 0.58:
            if name not in nodes or (name in VIEWS and rng.random() < 0.7):
                self.join(name)
                return f"{name} (re)joins"
            self.w.delete("Node", name)
            hb = self.store.get("heartbeat", name)
            if hb is not None and rng.random() < 0.7:
                self.store.delete("heartbeat", name, hb.revision)
                self.running.discard(name)
            return f"{name} leaves"
        if pick < 0.66:
            other = rng.choice(nodes)
            choice = rng.random()
            if choice < 0.4:
                mac = rng.choice([*MACS, self._field(other, "vxlanTunnelMACAddr")])
                self.spec(name, vxlanTunnelMACAddr=mac)
                return f"{name} MAC {mac}"
            if choice < 0.7:
                tunnel = rng.choice(
                    [self._field(other, "ipv4VXLANTunnelAddr"), "10.244.250.1", None]
                )
                self.spec(name, ipv4VXLANTunnelAddr=tunnel)
                return f"{name} tunnel {tunnel}"
            if choice < 0.85:
                mac6 = rng.choice([*MACS, self._field(other, "vxlanTunnelMACAddrV6")])
                self.spec(name, vxlanTunnelMACAddrV6=mac6)
                return f"{name} MAC6 {mac6}"
            if name in self.w.nodes:
                self.w.tunnels(name)  # tabby-node sets them again
            return f"{name} tunnels again"
        if pick < 0.71:
            choice = rng.random()
            if choice < 0.5:
                v4 = rng.choice([NODES[n][0] for n in names] + ["192.168.3.9/24"])
                self.spec(name, ipv4Address=v4)
                return f"{name} address {v4}"
            v6 = rng.choice([NODES[n][1] for n in names])
            self.spec(name, ipv6Address=v6)
            return f"{name} address6 {v6}"
        if pick < 0.76:
            if name not in nodes:
                return "label: no node"
            choice = rng.random()
            if choice < 0.4:
                self.w.label(name, rack=rng.choice(["r1", "r2"]))
                return f"{name} labelled"
            if choice < 0.7:
                self.w.node_bgp(name, asNumber=rng.choice([None, 64512, 65001]))
                return f"{name} AS"
            rr = rng.choice([None, "1.1.1.1", "2.2.2.2"])
            self.w.node_bgp(name, routeReflectorClusterID=rr)
            return f"{name} rr {rr}"
        if pick < 0.84:
            return self.pool_op()
        if pick < 0.90:
            return self.bgp_op()
        if pick < 0.94:
            return self.bad_document(name)
        if pick < 0.97:
            return self.kernel_op()
        self.w.now += 1.0
        self.beat()
        return "time passes"

    def _field(self, name: str, field: str) -> Any:
        doc = self.store.get("node", name)
        return None if doc is None else doc.data.get("spec", {}).get(field)

    def _free(self, block: Any) -> str | None:
        doc = self.store.get("block", str(block))
        if doc is None:
            return None
        for ordinal, address in enumerate(block):
            if doc.data["allocations"][ordinal] is None:
                return str(address)
        return None

    def raw_block(self) -> str:
        """A block document as a bug or an operator may leave it: overlapping another, a
        one-address block lent whole, allocations held by any node."""
        rng = self.rng
        cidr = net(rng.choice(RAW_BLOCKS))
        owner = rng.choice([*NODES, None])
        block = Block.new(cidr, rng.choice([c for c, _ in POOLS.values()]), owner)
        for ordinal in range(min(block.size, 6)):
            if rng.random() < 0.5:
                holder = rng.choice([*NODES, ""])
                block.allocations[ordinal] = {
                    "handle": f"h{ordinal}",
                    "seq": 1,
                    "attrs": {"node": holder} if holder else {},
                }
        current = self.store.get("block", str(cidr))
        self.store.put("block", str(cidr), block.to_data(), current.revision if current else None)
        return f"raw block {cidr} of {owner}"

    def pool_op(self) -> str:
        rng = self.rng
        name = rng.choice(list(POOLS))
        cidr, spec = POOLS[name]
        current = self.store.get("pool", cidr)
        if current is not None and rng.random() < 0.3:
            self.store.delete("pool", cidr, current.revision)  # under its blocks
            return f"pool {cidr} deleted"
        modes = self._modes()
        try:
            self.w.pool(name, cidr, **spec, vxlanMode=modes.get("vxlanMode"))
        except Exception as e:
            return f"pool {cidr}: {e}"
        return f"pool {cidr} {modes}"

    def bgp_op(self) -> str:
        rng = self.rng
        choice = rng.random()
        if choice < 0.3:
            self.w.bgp_configuration(
                asNumber=rng.choice([64512, 65000]),
                nodeToNodeMeshEnabled=rng.random() < 0.7,
                logSeverityScreen=rng.choice(["Info", "Debug"]),
            )
            return "bgp configuration"
        name = rng.choice(["p1", "p2", "p3"])
        if choice < 0.5:
            if self.store.get("bgppeer", name) is not None:
                self.w.delete("BGPPeer", name)
            return f"peer {name} deleted"
        spec: dict[str, Any] = rng.choice(
            [
                {"peerIP": "192.168.1.200", "asNumber": 65100},
                {"peerIP": "192.168.1.2", "asNumber": 64512, "nodeSelector": "rack == 'r1'"},
                {"nodeSelector": "all()", "peerSelector": "rack == 'r2'"},
                {"node": "a", "peerSelector": "has(rack)"},
            ]
        )
        try:
            if self.store.get("bgppeer", name) is not None:
                self.w.delete("BGPPeer", name)
            self.w.bgp_peer(name, **spec)
        except Exception as e:
            return f"peer {name}: {e}"
        return f"peer {name} {spec}"

    def bad_document(self, name: str) -> str:
        if self.rng.random() < 0.5:
            self.spec(name, ipv4Address="not-an-address")  # the Node no longer parses
            return f"{name} unparseable"
        hb = self.store.get("heartbeat", name)
        self.store.put_leased(
            "heartbeat", name, {"bogus": True}, hb.revision if hb else None, ttl=90
        )
        return f"{name} heartbeat unparseable (still alive)"

    def kernel_op(self) -> str:
        """Behind tabby's back: a foreign route on a prefix tabby may want, or one of
        tabby's routes removed (the check must then fix exactly that)."""
        view = self.views[self.rng.choice(VIEWS)]
        kernel = view.kernel
        if self.rng.random() < 0.5:
            dst = net(self.rng.choice(["10.244.200.0/26", "10.99.0.9/32", "10.244.0.0/26"]))
            if dst in view.foreign or not kernel.add_foreign(dst):
                return "foreign route: taken"
            view.foreign.add(dst)
            return f"foreign route {dst} on {view.me}"
        dropped = kernel.drop_ours(self.rng)
        if dropped is None:
            return "drop route: none"
        fixed = kernel.whole(view.table.desired())
        assert len(fixed.applied) == 1, fixed.applied  # the check fixes exactly that
        kernel.run(kernel.reconciler.reconcile, view.table.desired())  # the check's own run
        return f"route {dropped} removed on {view.me}: the check put it back"

    # -- the comparison ----------------------------------------------------------------

    def feed(self) -> None:
        """The store's documents into the watched index, as the watch would: a fresh
        snapshot, or each changed document put or deleted in a random order."""
        snapshot = {k.name: dict(self.store.list(k.name)) for k in ROUTING}
        if self.rng.random() < 0.3:
            self.watch.replace(snapshot)
            return
        docs = self.watch.snapshot()
        events: list[tuple[str, str, Doc | None]] = []
        for kind, now in snapshot.items():
            held = docs.raw(kind)
            events += [(kind, k, d) for k, d in now.items() if held.get(k) != d]
            events += [(kind, k, None) for k in held if k not in now]
        self.rng.shuffle(events)
        for kind, key, doc in events:
            if doc is None:
                self.watch.delete(kind, key)
            else:
                self.watch.put(kind, key, doc)

    def compare(self) -> None:
        self.feed()
        changes = self.watch.drain()
        docs = self.watch.snapshot()
        for view in self.views.values():
            self.compare_view(view, changes, docs)

    def compare_view(self, view: View, changes: list[Any], docs: Documents) -> None:
        me = view.me
        touched = view.index.apply(changes, self.watch.has)
        whole = Cluster.from_documents(docs, me)
        assert view.index.cluster() == whole

        bird: object
        try:
            bird = bird_config(whole, me)
        except ValueError as e:
            bird = str(e)
        try:
            kept: object = bird_config(view.index.bird_cluster(), me)
        except ValueError as e:
            kept = str(e)
        assert kept == bird
        if view.bird is not None and not bird_touched(view.index, touched):
            assert bird == view.bird, "bird_touched said no, but BIRD's configuration changed"
        view.renders += bird_touched(view.index, touched)
        view.bird = bird

        ref: DesiredState | None
        try:
            ref = vxlan_state(whole, me, view.underlay, self.backend)
        except ValueError:
            ref = None
        try:
            delta = view.table.update(view.index, touched)
        except ValueError:
            assert ref is None, "the incremental state raised, the whole one did not"
            return
        assert ref is not None, "the whole state raised, the incremental one did not"
        assert view.table.desired() == ref
        assert view.table.programmed() == _programmed(ref)
        if view.desired is not None:
            assert _after(view.desired, delta, ref) == ref
        view.desired = ref
        view.deltas += bool(delta)

        kernel = view.kernel
        done = kernel.run(kernel.reconciler.apply, delta, view.table.desired)
        check = kernel.whole(ref)
        assert not check.applied, f"the whole reconcile still had to fix {check.applied}"
        # and the problems the deltas keep are the ones a whole reconcile finds
        assert _problems(done) == _problems(check), (_problems(done), _problems(check))
        for dst in view.foreign:
            assert kernel.foreign_intact(dst), f"the foreign route {dst} was clobbered"


def _after(before: DesiredState, delta: OverlayDelta, now: DesiredState) -> DesiredState:
    """``before`` with ``delta`` applied (every "before" of the delta must be in it), with
    the devices of ``now`` (a delta says only whether they changed)."""
    sets: dict[str, set[Any]] = {
        "fdb": set(before.fdb),
        "neighbours": set(before.neighbours),
        "routes": set(before.routes),
    }
    for attr, pairs in (
        ("fdb", delta.fdb),
        ("neighbours", delta.neighbours),
        ("routes", delta.routes),
    ):
        for old, new in pairs:
            assert old is None or old in sets[attr], f"{old} was not there before"
            assert old != new
            sets[attr].discard(old)
            if new is not None:
                sets[attr].add(new)
    devices = (before.vxlan_v4, before.vxlan_v6) != (now.vxlan_v4, now.vxlan_v6)
    assert delta.devices or not devices, "the devices changed, the delta does not say so"
    return DesiredState(
        vxlan_v4=now.vxlan_v4,
        vxlan_v6=now.vxlan_v6,
        fdb=frozenset(sets["fdb"]),
        neighbours=frozenset(sets["neighbours"]),
        routes=frozenset(sets["routes"]),
    )


def _problems(changes: Changes) -> list[str]:
    return sorted(
        [*(f"conflict {p}" for p in changes.conflicts), *(f"failure {p}" for p in changes.failures)]
    )


def _programmed(desired: DesiredState) -> dict[str, int]:
    from tabby_node.routing import _programmed as whole

    return whole(desired)


def replay(
    seed: int,
    backend: str,
    ops: int,
    kernel: Callable[[str, Underlay], Kernel] = lambda me, underlay: MemoryKernel(),
) -> Replay:
    r = Replay(seed, backend, kernel)
    r.setup()
    r.compare()
    for _ in range(ops):
        try:
            r.log.append(r.op())
        except AssertionError:
            raise
        except Exception as e:  # a writer refusing (e.g. a Node that does not parse)
            r.log.append(f"refused: {e}")
        if r.rng.random() < 0.7:
            r.compare()
    r.compare()
    return r
