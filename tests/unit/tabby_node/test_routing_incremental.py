"""The routing backends' per-change passes (``sync``) and the periodic check (``check``),
with tabby-node's own writers (tests/unit/cluster_world.py), an in-memory kernel
(tests/unit/fake_kernel.py) and a BIRD supervisor that only records: what a change costs
(nothing for another node's pod), what a delta holds, what the check reports.
"""

from __future__ import annotations

import dataclasses
import errno
from typing import Any

import pytest

from bird import BirdConfig
from dataplane.errors import NetlinkFailure
from dataplane.overlay import Reconciler
from dataplane.overlay_model import (
    RTN_UNICAST,
    VXLAN_V4_DEVICE,
    FdbEntry,
    KernelRoute,
    NeighbourEntry,
    OverlayDelta,
    OverlayRoute,
)
from resources.index import ROUTING, Index
from tabby_node.cluster import Cluster, vxlan_state
from tabby_node.cluster_index import ClusterIndex
from tabby_node.routing import BirdRouting, NoRouting, VxlanRouting
from tabby_node.vxlan_table import VxlanTable
from tests.unit.cluster_world import API, World, net
from tests.unit.fake_kernel import FakeKernel

V4_POOL = "10.244.0.0/16"
MORE = "10.245.0.0/16"
NODE = {"apiVersion": API, "kind": "Node"}  # a second pool: a pod in it claims a new block


class FakeBird:
    """A BirdSupervisor that records the configurations it was given."""

    def __init__(self) -> None:
        self.configs: list[BirdConfig] = []
        self.adopted = False
        self.pid = 4242
        self.restarts = 0

    def start(self, config: BirdConfig) -> None:
        self.configs.append(config)

    def apply(self, config: BirdConfig) -> bool:
        self.configs.append(config)
        return True

    def peers(self) -> list[Any]:
        return []

    def readiness(self) -> list[str]:
        return []


class Node:
    """One tabby-node's routing backend fed by a watched index, on an in-memory kernel."""

    def __init__(self, w: World, me: str) -> None:
        self.w = w
        self.me = me
        self.watch = Index(ROUTING)
        parts = w.nodes[me]
        self.routing: NoRouting
        if parts.backend == "bird":
            self.bird = FakeBird()
            self.routing = BirdRouting(parts.facts, self.bird)  # type: ignore[arg-type]
        else:
            self.routing = VxlanRouting(parts.facts, parts.backend)
        self.kernel = FakeKernel(ipip=False)
        self.routing.overlay.reconciler = Reconciler(netlink=self.kernel)  # type: ignore[arg-type]

    def sync(self) -> Any:
        self.watch.replace({k.name: dict(self.w.store.list(k.name)) for k in ROUTING})
        return self.routing.sync(self.watch.drain(), self.watch.has)

    def whole(self) -> Any:
        cluster = Cluster.from_documents(self.watch.snapshot(), self.me)
        return vxlan_state(cluster, self.me, self.w.underlay(self.me), self.w.backend)


def cluster(backend: str = "vxlan", n: int = 3) -> World:
    w = World(backend)  # type: ignore[arg-type]
    mode = {"vxlanMode": "Always"} if backend == "vxlan" else {}
    w.pool("pods", V4_POOL, **mode)
    w.pool("more", MORE, **mode)
    for i, name in enumerate("abcdef"[:n], 1):
        w.node(name, f"192.168.1.{i}/24")  # each with a block: its tunnel address's
    return w


def test_first_pass_programs_everything_then_only_deltas() -> None:
    w = cluster()
    a = Node(w, "a")
    first = a.sync()
    assert first.kernel is not None
    assert first.kernel.count("add", "route") == 2  # b's and c's blocks
    assert first.kernel.count("add", "blackhole") == 1  # a's own
    assert a.routing.overlay.table is not None
    assert a.routing.overlay.table.rebuilds == 1
    w.pod("c", pool=MORE)  # c claims a block: one route, nothing else
    second = a.sync()
    assert [str(c) for c in second.kernel.applied] == [
        f"add {w.block_of('c', pool=MORE)} via {w.tunnel('c')} dev {VXLAN_V4_DEVICE} onlink"
    ]
    assert a.routing.overlay.table.rebuilds == 1


def test_another_nodes_pod_touches_nothing() -> None:
    """The common event of a cluster: a pod on another node, in that node's block."""
    w = cluster("bird")
    w.pool("pods", V4_POOL, vxlanMode="Always")
    w.pod("b")
    a = Node(w, "a")
    a.sync()
    renders = a.routing.renders  # type: ignore[attr-defined]
    writes = len(a.kernel.writes)
    w.pod("b")  # b's block document changes: a new allocation of b's own
    done = a.sync()
    assert not done.touched
    assert done.kernel is None
    assert not done.bird
    assert a.routing.renders == renders  # type: ignore[attr-defined]  # not even rendered
    assert len(a.kernel.writes) == writes


def test_a_borrowed_address_is_one_route_and_its_release_removes_it() -> None:
    w = cluster()
    w.pod("b")
    a = Node(w, "a")
    a.sync()
    borrowed = w.pod("c", w.free_address(w.block_of("b")))
    done = a.sync()
    route = OverlayRoute.via(f"{borrowed}/32", w.tunnel("c"), VXLAN_V4_DEVICE)
    assert [str(c) for c in done.kernel.applied] == [f"add {route}"]
    from ipam.core.allocator import Ipam

    Ipam(w.store, "c").release_ip(borrowed)
    done = a.sync()
    assert [str(c) for c in done.kernel.applied] == [f"remove {route}"]


def test_node_join_and_expiry_are_deltas_of_that_node_only() -> None:
    w = cluster(n=2)
    a = Node(w, "a")
    a.sync()
    w.node("c", "192.168.1.3/24")
    done = a.sync()
    kinds = sorted((c.action, c.kind) for c in done.kernel.applied)
    assert kinds == [("add", "fdb"), ("add", "neighbour"), ("add", "route")]
    w.lease_expires("c")
    done = a.sync()
    kinds = sorted((c.action, c.kind) for c in done.kernel.applied)
    assert kinds == [("remove", "fdb"), ("remove", "neighbour"), ("remove", "route")]
    assert [n[1] for n in a.kernel.state()["neighbours"]] == [str(w.tunnel("b"))]


def test_mac_conflict_first_in_name_order_keeps_it_and_hands_it_on() -> None:
    """d publishes b's MAC: b keeps it (first in name order); when b goes, d gets it."""
    w = cluster(n=4)
    a = Node(w, "a")
    a.sync()
    mac_b = w.mac("b")
    w.apply({**NODE, "metadata": {"name": "d"}, "spec": {"vxlanTunnelMACAddr": mac_b}})
    done = a.sync()
    table = a.routing.overlay.table
    assert table is not None
    assert ("d", 4) not in table.vteps
    assert table.vteps[("b", 4)].fdb.mac == mac_b
    # d's endpoint goes, and with it the route to its block
    assert sorted((c.action, c.kind) for c in done.kernel.applied) == [
        ("remove", "fdb"),
        ("remove", "neighbour"),
        ("remove", "route"),
    ]
    w.delete("Node", "b")
    done = a.sync()
    assert table.vteps[("d", 4)].fdb == FdbEntry(VXLAN_V4_DEVICE, mac_b, net("192.168.1.4/32")[0])
    # one MAC, one FDB entry: re-pointed (replace); the neighbour moves to d's tunnel,
    # b's block's route goes and d's comes
    assert sorted((c.action, c.kind) for c in done.kernel.applied) == [
        ("add", "neighbour"),
        ("add", "route"),
        ("remove", "neighbour"),
        ("remove", "route"),
        ("replace", "fdb"),
    ]
    assert a.routing.overlay.table.desired() == a.whole()  # type: ignore[union-attr]


def test_own_mac_change_rebuilds_and_reconciles_whole() -> None:
    w = cluster()
    a = Node(w, "a")
    a.sync()
    w.apply(
        {**NODE, "metadata": {"name": "a"}, "spec": {"vxlanTunnelMACAddr": "02:00:00:0a:0a:0a"}}
    )
    done = a.sync()
    assert a.routing.overlay.table.rebuilds == 2  # type: ignore[union-attr]
    assert done.kernel.count("replace", "device") == 1


def test_the_check_finds_nothing_after_deltas() -> None:
    w = cluster()
    a = Node(w, "a")
    a.sync()
    for name in "bc":
        w.pod(name)
        w.pod("a", w.free_address(w.block_of(name)))
        a.sync()
    result = a.routing.check(a.watch.snapshot())
    assert result.as_dict() == {"kernel": 0, "model": 0, "bird": 0}
    assert a.routing.check_fixes == {"kernel": 0, "model": 0, "bird": 0}


def test_the_check_fixes_and_counts_a_route_removed_behind_its_back() -> None:
    w = cluster()
    w.pod("b")
    a = Node(w, "a")
    a.sync()
    key = (w.block_of("b"), 0)
    del a.kernel.routes[key]
    result = a.routing.check(a.watch.snapshot())
    assert result.kernel == 1
    assert result.model == 0
    assert key in a.kernel.routes
    assert a.routing.check_fixes["kernel"] == 1
    assert a.routing.status()["routing_passes"]["check_fixes"]["kernel"] == 1


def test_the_check_finds_a_wrong_kept_state_and_rebuilds_it() -> None:
    """A bug in the passes (simulated: a live node taken for dead by the kept view) is
    found by the check, counted, and the kept state rebuilt from the documents."""
    w = cluster()
    w.pod("b")
    a = Node(w, "a")
    a.sync()
    index = a.routing.index
    assert index is not None
    index.nodes["b"] = dataclasses.replace(index.nodes["b"], alive=False)
    result = a.routing.check(a.watch.snapshot())
    assert result.model >= 1
    assert a.routing.index.cluster() == Cluster.from_documents(a.watch.snapshot(), "a")
    w.pod("b")
    a.sync()
    assert a.routing.check(a.watch.snapshot()).fixes == 0


def test_bird_renders_only_for_what_can_change_its_configuration() -> None:
    w = cluster("bird")
    w.pod("b")
    a = Node(w, "a")
    a.sync()
    assert len(a.bird.configs) == 1
    w.pod("a", pool=MORE)  # a new block of a's: announced
    assert a.sync().bird
    assert a.bird.configs[-1].blocks == (w.block_of("a", pool=MORE),)
    w.pod("c", pool=MORE)  # c's new block: nothing for a's BIRD
    assert not a.sync().bird
    w.label("c", rack="r1")  # labels can select BGP peers
    assert a.sync().bird
    w.pod("b", w.free_address(w.block_of("a")))  # b holds an address of a's block
    assert not a.sync().bird  # a announces its block either way: no render
    w.node("d", "192.168.1.4/24")  # a new mesh peer
    done = a.sync()
    assert done.bird
    assert len(a.bird.configs[-1].peers) == 3
    result = a.routing.check(a.watch.snapshot())
    assert result.fixes == 0


def test_backend_none_removes_leftovers_and_then_has_nothing_to_do() -> None:
    w = cluster("none")
    a = Node(w, "a")
    a.kernel.routes[(net("10.244.9.0/26"), 0)] = KernelRoute(
        net("10.244.9.0/26"), RTN_UNICAST, 116, None, 2, False, 0
    )
    routing = NoRouting(w.nodes["a"].facts, "none")
    routing.overlay.reconciler = Reconciler(netlink=a.kernel)  # type: ignore[arg-type]
    a.routing = routing
    first = a.sync()
    assert first.kernel is not None
    assert first.kernel.count("remove", "route") == 1
    w.pod("b")
    assert a.sync().kernel is None


# -- the reconciler's deltas ------------------------------------------------------------------


def programmed(w: World, me: str) -> tuple[FakeKernel, Reconciler, VxlanTable, ClusterIndex]:
    """A table of ``me``'s state and a kernel a whole reconcile brought to it."""
    kernel = FakeKernel(ipip=False)
    reconciler = Reconciler(netlink=kernel)  # type: ignore[arg-type]
    index = ClusterIndex(me)
    watch = Index(ROUTING)
    watch.replace({k.name: dict(w.store.list(k.name)) for k in ROUTING})
    table = VxlanTable(me, w.underlay(me), w.backend)
    table.update(index, index.apply(watch.drain(), watch.has))
    reconciler.reconcile(table.desired())
    return kernel, reconciler, table, index


def test_a_delta_never_replaces_a_foreign_route_and_reports_the_conflict() -> None:
    w = cluster()
    kernel, reconciler, table, _ = programmed(w, "a")
    dst = net("10.244.77.0/26")
    kernel.routes[(dst, 0)] = KernelRoute(dst, RTN_UNICAST, 4, None, 2, False, 0)  # not ours
    route = OverlayRoute.via(dst, w.tunnel("b"), VXLAN_V4_DEVICE)
    done = reconciler.apply(OverlayDelta(routes=((None, route),)), table.desired)
    assert [str(p) for p in done.conflicts] == [
        f"{route}: the kernel has {dst} dev eth0 proto 4 metric 0 (not tabby's): left alone"
    ]
    moved = OverlayRoute.via(dst, w.tunnel("c"), VXLAN_V4_DEVICE)
    done = reconciler.apply(OverlayDelta(routes=((route, moved),)), table.desired)
    assert kernel.routes[(dst, 0)].proto == 4  # still the foreign one: added, not replaced
    assert len(done.conflicts) == 1
    assert str(done.conflicts[0]).startswith(str(moved))
    done = reconciler.apply(OverlayDelta(routes=((moved, None),)), table.desired)
    assert not done.conflicts
    assert kernel.routes[(dst, 0)].proto == 4


def test_a_delta_that_fails_unexpectedly_is_finished_by_a_whole_reconcile() -> None:
    w = cluster()
    kernel, reconciler, table, _ = programmed(w, "a")

    def refuse(*args: object, **kwargs: object) -> None:
        raise NetlinkFailure("set fdb", "fake", errno.EIO)

    kernel.set_fdb = refuse  # type: ignore[method-assign]
    entry = FdbEntry(VXLAN_V4_DEVICE, "02:00:00:00:00:77", net("192.168.1.9/32")[0])
    neighbour = NeighbourEntry(VXLAN_V4_DEVICE, net("10.244.99.1/32")[0], "02:00:00:00:00:77")
    done = reconciler.apply(
        OverlayDelta(fdb=((None, entry),), neighbours=((None, neighbour),)), table.desired
    )
    assert reconciler.fallbacks == 1
    # the whole run brought the kernel to the table's state (which lacks those two)
    assert not done.failures
    assert ("vxlan.tabby", "02:00:00:00:00:77") not in {(f[0], f[1]) for f in kernel.state()["fdb"]}


def test_a_delta_before_any_whole_run_is_a_whole_run() -> None:
    w = cluster()
    w.pod("b")
    kernel = FakeKernel(ipip=False)
    reconciler = Reconciler(netlink=kernel)  # type: ignore[arg-type]
    index = ClusterIndex("a")
    watch = Index(ROUTING)
    watch.replace({k.name: dict(w.store.list(k.name)) for k in ROUTING})
    table = VxlanTable("a", w.underlay("a"), "vxlan")
    table.update(index, index.apply(watch.drain(), watch.has))
    done = reconciler.apply(OverlayDelta(), table.desired)
    assert done.count("add", "device") == 1
    assert done.count("add", "route") == 2


@pytest.mark.parametrize("heartbeat", ["garbage", "gone"])
def test_a_heartbeat_that_does_not_parse_keeps_its_node_alive(heartbeat: str) -> None:
    w = cluster()
    w.pod("b")
    a = Node(w, "a")
    a.sync()
    doc = w.store.get("heartbeat", "b")
    assert doc is not None
    if heartbeat == "garbage":
        w.store.put_leased("heartbeat", "b", {"bogus": 1}, doc.revision, ttl=90)
    else:
        w.store.delete("heartbeat", "b", doc.revision)
    a.sync()
    table = a.routing.overlay.table
    assert table is not None
    assert (("b", 4) in table.vteps) == (heartbeat == "garbage")
    assert table.desired() == a.whole()
