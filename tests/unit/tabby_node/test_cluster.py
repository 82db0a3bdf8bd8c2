"""The cluster view (``Cluster.from_docs``) and the vxlan backend's kernel state
(``vxlan_state``), from datastore documents written by tabby's own writers
(tests/unit/cluster_world.py): no root, no kernel.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import pytest

from dataplane.nodeinfo import vxlan_mac
from dataplane.overlay_model import (
    VXLAN_V4_DEVICE,
    VXLAN_V6_DEVICE,
    DesiredState,
    FdbEntry,
    NeighbourEntry,
    OverlayRoute,
    VxlanDevice,
)
from datastore.base import Doc
from ipam.core.block import Block
from ipam.core.model import Reserved
from tabby_node.cluster import (
    DEFAULT_AS,
    Borrowed,
    PeerSpec,
    PoolInfo,
    vxlan_state,
)
from tests.unit.cluster_world import API, World, cluster_of, ip, net

V4_POOL = "10.244.0.0/16"
V6_POOL = "fd10::/48"


def three_nodes(*, mode: str | None = "Always", subnet_c: str = "192.168.1.3/24") -> World:
    """a, b, c registered by tabby-node --backend vxlan over one VXLAN pool."""
    w = World("vxlan")
    if mode is None:
        w.pool("pods", V4_POOL)
    else:
        w.pool("pods", V4_POOL, vxlanMode=mode)
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24")
    w.node("c", subnet_c)
    return w


def state(w: World, me: str, backend: str | None = None) -> DesiredState:
    return vxlan_state(w.cluster(me), me, w.underlay(me), backend or w.backend)


def device(w: World, me: str, version: int = 4, mtu: int = 1450) -> VxlanDevice:
    facts = w.nodes[me].facts
    local = facts.ipv4 if version == 4 else facts.ipv6
    assert local is not None
    return VxlanDevice(local.address, w.mac(me, version), mtu, w.tunnel(me, version))


def vtep(w: World, node: str, version: int = 4) -> tuple[FdbEntry, NeighbourEntry]:
    """The FDB and neighbour entries that make ``node`` reachable on a VXLAN device."""
    facts = w.nodes[node].facts
    underlay = facts.ipv4 if version == 4 else facts.ipv6
    assert underlay is not None
    dev = VXLAN_V4_DEVICE if version == 4 else VXLAN_V6_DEVICE
    mac = w.mac(node, version)
    return FdbEntry(dev, mac, underlay.address), NeighbourEntry(dev, w.tunnel(node, version), mac)


def via_tunnel(w: World, dst: object, node: str, version: int = 4) -> OverlayRoute:
    dev = VXLAN_V4_DEVICE if version == 4 else VXLAN_V6_DEVICE
    return OverlayRoute.via(str(dst), w.tunnel(node, version), dev)


def routes_by_dst(s: DesiredState) -> dict[str, OverlayRoute]:
    return {str(r.dst): r for r in s.routes}


# == Cluster.from_docs ================================================================


def test_nodes_as_tabby_node_registers_them() -> None:
    w = World("vxlan")
    w.pool("pods", V4_POOL, vxlanMode="Always")
    w.pool("pods6", V6_POOL, vxlanMode="Always")
    w.node("a", "192.168.1.1/24", "fd00:1::1/64")
    w.node("b", "192.168.1.2/24")
    c = w.cluster("a")
    assert list(c.nodes) == ["a", "b"]
    a, b = c.nodes["a"], c.nodes["b"]
    assert str(a.ipv4) == "192.168.1.1/24"
    assert str(a.ipv6) == "fd00:1::1/64"
    assert a.backend == "vxlan"
    assert a.alive
    assert a.vxlan_v4 == w.tunnel("a")
    assert a.vxlan_mac == vxlan_mac("a", 4)
    assert a.vxlan_v6 == w.tunnel("a", 6)
    assert a.vxlan_mac_v6 == vxlan_mac("a", 6)
    assert a.vxlan_v4 in w.block_of("a")
    assert a.vxlan_v6 in w.block_of("a", 6)
    # b has no IPv6 underlay: no IPv6 tunnel either
    assert b.ipv6 is None
    assert b.vxlan_v6 is None
    assert b.vxlan_mac_v6 is None
    assert b.as_number is None
    assert b.rr_cluster_id is None
    assert dict(b.labels) == {}


def test_alive_is_node_plus_heartbeat_and_self_always() -> None:
    w = three_nodes()
    w.lease_expires("b", "c")  # a beats; b and c stopped (their leases run out)
    c = w.cluster("a")
    assert {n.name: n.alive for n in c.nodes.values()} == {"a": True, "b": False, "c": False}
    assert [n.name for n in c.alive()] == ["a"]
    # seen from b, b itself counts as alive although its own lease ran out
    assert {n.name for n in w.cluster("b").alive()} == {"a", "b"}
    # b comes back: registering beats again
    w.node("b", "192.168.1.2/24")
    assert {n.name for n in w.cluster("a").alive()} == {"a", "b"}


def test_heartbeat_without_node_is_no_node_and_deleted_node_is_gone() -> None:
    w = three_nodes()
    w.delete("Node", "c")  # tabbyctl delete node c (its heartbeat lives on until it expires)
    assert "c" in w.docs()["heartbeat"]
    c = w.cluster("a")
    assert list(c.nodes) == ["a", "b"]
    assert c.blocks_of("c") == [b for b in c.blocks if b.node == "c"]  # blocks stay c's
    assert len(c.blocks_of("c")) == 1


def test_me_without_a_node_document() -> None:
    w = three_nodes()
    c = w.cluster("z")
    assert "z" not in c.nodes
    assert {n.name for n in c.alive()} == {"a", "b", "c"}


def test_operator_fields_merge_into_the_node_and_survive_reregistration() -> None:
    w = three_nodes()
    w.label("b", rack="r1", **{"route-reflector": "true"})
    w.node_bgp("b", asNumber=65002, routeReflectorClusterID="224.0.0.1")
    w.node("b", "192.168.1.2/24")  # tabby-node restarts: node_spec keeps the operator's fields
    b = w.cluster("a").nodes["b"]
    assert dict(b.labels) == {"rack": "r1", "route-reflector": "true"}
    assert b.as_number == 65002
    assert b.rr_cluster_id == "224.0.0.1"
    assert b.vxlan_v4 == w.tunnel("b")
    assert str(b.ipv4) == "192.168.1.2/24"


def test_pools_applied_and_created_from_configuration() -> None:
    w = World("bird")
    w.pool(
        "vx",
        "10.10.0.0/16",
        vxlanMode="CrossSubnet",
        natOutgoing=True,
        blockSize=24,
        disabled=True,
    )
    w.pool("ipip", "10.20.0.0/16", ipipMode="Always")
    w.pool("six", "fd10::/48")
    w.config_pool("10.30.0.0/16", 28)
    pools = w.cluster("a").pools
    assert pools == (
        PoolInfo(net("10.10.0.0/16"), 24, "CrossSubnet", None, True, True, "vx"),
        PoolInfo(net("10.20.0.0/16"), 26, None, "Always", False, False, "ipip"),
        PoolInfo(net("10.30.0.0/16"), 28, None, None, False, False, "ippool-10-30-0-0-16"),
        PoolInfo(net("fd10::/48"), 122, None, None, False, False, "six"),
    )


@pytest.mark.parametrize(
    ("vxlan", "ipip", "backend", "want"),
    [
        (None, None, "vxlan", ("vxlan", "Always")),
        (None, None, "bird", ("none", "Never")),
        (None, None, "none", ("none", "Never")),
        ("Always", None, "bird", ("vxlan", "Always")),
        ("CrossSubnet", None, "vxlan", ("vxlan", "CrossSubnet")),
        ("Never", None, "vxlan", ("none", "Never")),
        ("Never", None, "bird", ("none", "Never")),
        (None, "Always", "bird", ("ipip", "Always")),
        (None, "CrossSubnet", "bird", ("ipip", "CrossSubnet")),
        (None, "Always", "vxlan", ("ipip", "Always")),
        # vxlanMode unset means Always under --backend vxlan, also next to ipipMode: Never
        (None, "Never", "vxlan", ("vxlan", "Always")),
        (None, "Never", "bird", ("none", "Never")),
        ("Never", "Never", "vxlan", ("none", "Never")),
    ],
)
def test_pool_encapsulation(
    vxlan: str | None, ipip: str | None, backend: str, want: tuple[str, str]
) -> None:
    assert PoolInfo(net(V4_POOL), 26, vxlan, ipip).encap(backend) == want


def test_blocks_affinity_and_borrowed_addresses() -> None:
    w = three_nodes()
    a_block, b_block = w.block_of("a"), w.block_of("b")
    own = w.pod("a")
    lent = w.pod("b", w.free_address(a_block))  # b borrows from a
    c = w.cluster("a")
    assert {(b.cidr, b.node) for b in c.blocks} == {
        (a_block, "a"),
        (b_block, "b"),
        (w.block_of("c"), "c"),
    }
    assert all(b.pool == V4_POOL for b in c.blocks)
    assert c.borrowed == (Borrowed(lent, a_block, "b", "a"),)
    assert c.borrowed[0].prefix == net(f"{lent}/32")
    assert c.blocks_of("a") == [b for b in c.blocks if b.cidr == a_block]
    assert own not in {b.address for b in c.borrowed}  # a's own pod: not borrowed
    assert c.pool_of(a_block) == c.pools[0]
    assert c.pool_of(net("10.99.0.0/26")) is None


def test_unaffine_block_and_allocations_without_node() -> None:
    w = three_nodes()
    blk = Block.new(net("10.244.200.0/26"), V4_POOL, None)
    blk.assign(1, "h1", {"node": "b"}, _no_reserved())
    blk.assign(2, "h2", {}, _no_reserved())  # an old allocation without "node": nobody's
    w.block_doc(blk)
    foreign = Block.new(net("10.244.201.0/26"), V4_POOL, None)
    foreign.affinity = "virtual:x"  # not a host's affinity: nobody's block
    w.block_doc(foreign)
    c = w.cluster("a")
    info = {b.cidr: b.node for b in c.blocks}
    assert info[net("10.244.200.0/26")] is None
    assert info[net("10.244.201.0/26")] is None
    assert c.borrowed == (Borrowed(ip("10.244.200.1"), net("10.244.200.0/26"), "b", None),)


def test_bgp_configuration_and_peers() -> None:
    w = three_nodes()
    c = w.cluster("a")
    assert (c.as_number, c.mesh, c.log_severity, c.peers) == (DEFAULT_AS, True, "Info", ())
    w.bgp_configuration(asNumber=65100, nodeToNodeMeshEnabled=False, logSeverityScreen="Debug")
    w.bgp_peer("z-tor", peerIP="192.168.1.254", asNumber=65000)
    w.bgp_peer("a-rr", nodeSelector="all()", peerSelector="route-reflector == 'true'")
    w.bgp_peer("m-one", node="b", peerIP="fd00::fe", asNumber=65001)
    c = w.cluster("a")
    assert (c.as_number, c.mesh, c.log_severity) == (65100, False, "Debug")
    assert c.peers == (
        PeerSpec("a-rr", None, "all()", None, None, "route-reflector == 'true'"),
        PeerSpec("m-one", "b", None, "fd00::fe", 65001, None),
        PeerSpec("z-tor", None, None, "192.168.1.254", 65000, None),
    )


BAD_DOCS: list[tuple[str, str, dict[str, Any]]] = [
    ("node", "x1", {"metadata": ["x"], "spec": {}}),
    ("node", "x2", {"metadata": "name", "spec": {}}),
    ("node", "x3", {"metadata": 5}),
    ("node", "x4", {"metadata": {"name": "x4"}, "spec": "nope"}),
    ("node", "x5", {"metadata": {"name": "x5"}, "spec": {"ipv4Address": "10.0.0.5"}}),
    ("node", "x6", {"metadata": {"name": "x6"}, "spec": {"vxlanTunnelMACAddr": "zz"}}),
    ("node", "x7", {"metadata": {"name": "x7"}, "spec": {"bgp": {"asNumber": 0}}}),
    ("pool", "10.50.0.0/16", {"cidr": "10.50.0.0/16", "block_size": "x"}),
    ("pool", "10.51.0.0/16", {"cidr": "10.51.0.0/16", "block_size": 26, "vxlan_mode": "On"}),
    ("pool", "10.52.0.0/16", {"cidr": 7}),
    ("block", "10.244.250.0/26", {"cidr": "10.244.250.0/26", "pool": V4_POOL}),
    ("block", "junk", {"cidr": "not a cidr"}),
    ("bgpconfiguration", "default", {"metadata": {"name": "default"}, "spec": {"asNumber": -1}}),
    ("bgpconfiguration", "other", {"metadata": {"name": "other"}, "spec": {"asNumber": 1}}),
    ("bgppeer", "p1", {"metadata": {"name": "p1"}, "spec": {"peerIP": "1.2.3.4"}}),
    ("bgppeer", "p2", {"metadata": ["p2"], "spec": {}}),
    ("bgppeer", "p3", {"metadata": {"name": "p3"}, "spec": {"peerSelector": "((("}}),
]


@pytest.mark.parametrize(
    ("kind", "key", "data"), BAD_DOCS, ids=[f"{k}-{n}" for k, n, _ in BAD_DOCS]
)
def test_an_invalid_document_is_skipped_not_fatal(
    kind: str, key: str, data: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    w = three_nodes()
    docs = w.docs()
    good = cluster_of(docs, "a")
    docs.setdefault(kind, {})[key] = Doc(data, 999)  # e.g. written with etcdctl
    with caplog.at_level(logging.WARNING):
        seen = cluster_of(docs, "a")
    assert seen == good
    assert any("skipping" in r.getMessage() for r in caplog.records)


def test_all_invalid_documents_at_once_leave_the_valid_ones() -> None:
    w = three_nodes()
    docs = w.docs()
    good = cluster_of(docs, "a")
    for kind, key, data in BAD_DOCS:
        docs.setdefault(kind, {})[key] = Doc(data, 999)
    assert cluster_of(docs, "a") == good
    assert vxlan_state(cluster_of(docs, "a"), "a", w.underlay("a")) == state(w, "a")


def test_missing_kinds_are_an_empty_cluster() -> None:
    c = cluster_of({}, "a")
    assert (c.nodes, c.pools, c.blocks, c.borrowed, c.peers) == ({}, (), (), (), ())
    assert c.as_number == DEFAULT_AS
    assert c.mesh


# == vxlan_state =======================================================================


def test_three_nodes_vxlan() -> None:
    w = three_nodes()
    got = state(w, "a")
    fdb_b, neigh_b = vtep(w, "b")
    fdb_c, neigh_c = vtep(w, "c")
    assert got == DesiredState(
        vxlan_v4=device(w, "a"),
        fdb=frozenset({fdb_b, fdb_c}),
        neighbours=frozenset({neigh_b, neigh_c}),
        routes=frozenset(
            {
                OverlayRoute.blackhole(w.block_of("a")),
                via_tunnel(w, w.block_of("b"), "b"),
                via_tunnel(w, w.block_of("c"), "c"),
            }
        ),
    )
    assert got.vxlan_v4 is not None
    assert got.vxlan_v4.address == w.tunnel("a")
    assert got.vxlan_v4.mac == vxlan_mac("a")
    assert str(via_tunnel(w, w.block_of("b"), "b")).endswith("dev vxlan.tabby onlink")


def test_every_node_sees_the_others() -> None:
    w = three_nodes()
    for me in "abc":
        got = state(w, me)
        others = [n for n in "abc" if n != me]
        assert got.fdb == frozenset(vtep(w, n)[0] for n in others)
        assert routes_by_dst(got)[str(w.block_of(me))].type == "blackhole"
        for n in others:
            assert routes_by_dst(got)[str(w.block_of(n))] == via_tunnel(w, w.block_of(n), n)


def test_the_result_does_not_depend_on_document_order() -> None:
    w = three_nodes()
    w.pod("b", w.free_address(w.block_of("c")))
    docs = w.docs()
    want = vxlan_state(cluster_of(docs, "a"), "a", w.underlay("a"))
    rng = random.Random(7)
    for _ in range(5):
        shuffled = {}
        for kind in rng.sample(list(docs), len(docs)):
            items = list(docs[kind].items())
            rng.shuffle(items)
            shuffled[kind] = dict(items)
        assert vxlan_state(cluster_of(shuffled, "a"), "a", w.underlay("a")) == want


def test_cross_subnet_routes_directly_only_within_the_subnet() -> None:
    w = three_nodes(mode="CrossSubnet", subnet_c="192.168.2.3/24")
    lent_b = w.pod("b", w.free_address(w.block_of("c")))
    lent_c = w.pod("c", w.free_address(w.block_of("b")))
    got = routes_by_dst(state(w, "a"))
    assert got[str(w.block_of("b"))] == OverlayRoute.via(w.block_of("b"), "192.168.1.2", "eth0")
    assert got[str(w.block_of("c"))] == via_tunnel(w, w.block_of("c"), "c")
    assert got[f"{lent_b}/32"] == OverlayRoute.via(f"{lent_b}/32", "192.168.1.2", "eth0")
    assert got[f"{lent_c}/32"] == via_tunnel(w, f"{lent_c}/32", "c")
    assert got[str(w.block_of("a"))].type == "blackhole"
    assert str(got[str(w.block_of("b"))]).endswith("dev eth0 onlink")
    # both remote nodes keep their VTEP entries (c needs them, b is harmless)
    assert state(w, "a").fdb == frozenset({vtep(w, "b")[0], vtep(w, "c")[0]})
    # seen from c (another subnet) everything goes through the tunnel
    from_c = routes_by_dst(state(w, "c"))
    assert from_c[str(w.block_of("b"))] == via_tunnel(w, w.block_of("b"), "b")


def test_cross_subnet_direct_route_needs_no_tunnel_of_the_peer() -> None:
    w = World("vxlan")
    w.pool("pods", V4_POOL, vxlanMode="CrossSubnet")
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24", tunnels=False)  # not (yet) published its VTEP
    w.pod("b")
    got = state(w, "a")
    assert got.fdb == frozenset()
    assert routes_by_dst(got)[str(w.block_of("b"))] == OverlayRoute.via(
        w.block_of("b"), "192.168.1.2", "eth0"
    )


def test_borrowed_address_in_a_remote_block_goes_to_its_holder() -> None:
    w = three_nodes()
    lent = w.pod("b", w.free_address(w.block_of("c")))
    host = f"{lent}/32"
    on_a = routes_by_dst(state(w, "a"))
    assert on_a[host] == via_tunnel(w, host, "b")
    assert on_a[str(w.block_of("c"))] == via_tunnel(w, w.block_of("c"), "c")
    on_c = routes_by_dst(state(w, "c"))
    assert on_c[host] == via_tunnel(w, host, "b")  # the /32 behind c's own blackhole
    assert on_c[str(w.block_of("c"))] == OverlayRoute.blackhole(w.block_of("c"))
    on_b = routes_by_dst(state(w, "b"))
    assert host not in on_b  # b delivers through the pod's own route
    assert on_b[str(w.block_of("c"))] == via_tunnel(w, w.block_of("c"), "c")


def test_borrowed_address_in_our_block_is_a_host_route_behind_our_blackhole() -> None:
    w = three_nodes()
    lent = w.pod("b", w.free_address(w.block_of("a")))
    got = routes_by_dst(state(w, "a"))
    assert got[str(w.block_of("a"))] == OverlayRoute.blackhole(w.block_of("a"))
    assert got[f"{lent}/32"] == via_tunnel(w, f"{lent}/32", "b")


def test_a_one_address_block_held_by_another_node() -> None:
    """blockSize 32: the whole block is the borrowed address. Its holder must not route it
    to the block's owner (its pod's own route has the same destination)."""
    w = three_nodes()
    blk = Block.new(net("10.244.250.7/32"), V4_POOL, "a")
    blk.assign(0, "h", {"node": "b"}, _no_reserved())
    w.block_doc(blk)
    host = "10.244.250.7/32"
    assert routes_by_dst(state(w, "a"))[host] == via_tunnel(w, host, "b")
    assert routes_by_dst(state(w, "c"))[host] == via_tunnel(w, host, "b")
    assert host not in routes_by_dst(state(w, "b"))


def test_dead_node_gets_nothing_but_addresses_borrowed_from_it_stay_routed() -> None:
    w = three_nodes()
    held_by_b = w.pod("b", w.free_address(w.block_of("c")))
    held_by_c = w.pod("c", w.free_address(w.block_of("b")))
    w.lease_expires("c")
    got = state(w, "a")
    fdb_b, neigh_b = vtep(w, "b")
    assert got.fdb == frozenset({fdb_b})
    assert got.neighbours == frozenset({neigh_b})
    by_dst = routes_by_dst(got)
    assert str(w.block_of("c")) not in by_dst
    assert f"{held_by_c}/32" not in by_dst
    assert by_dst[f"{held_by_b}/32"] == via_tunnel(w, f"{held_by_b}/32", "b")
    assert by_dst[str(w.block_of("b"))] == via_tunnel(w, w.block_of("b"), "b")


def test_deleted_node_gets_nothing() -> None:
    w = three_nodes()
    w.delete("Node", "c")
    got = state(w, "a")
    assert got.fdb == frozenset({vtep(w, "b")[0]})
    assert str(w.block_of("c")) not in routes_by_dst(got)


def test_node_without_tunnel_address_or_mac_gets_nothing() -> None:
    w = three_nodes()
    w.node("d", "192.168.1.4/24", tunnels=False)  # registered, VTEP not published yet
    w.pod("d")
    got = state(w, "a")
    assert str(w.block_of("d")) not in routes_by_dst(got)
    assert {f.dst for f in got.fdb} == {ip("192.168.1.2"), ip("192.168.1.3")}
    # a tunnel address without a MAC (a half-written Node): no route into a black hole
    doc = w.store.get("node", "c")
    assert doc is not None
    spec = dict(doc.data["spec"])
    del spec["vxlanTunnelMACAddr"]
    w.store.put("node", "c", {**doc.data, "spec": spec}, doc.revision)
    got = state(w, "a")
    assert str(w.block_of("c")) not in routes_by_dst(got)
    assert got.fdb == frozenset({vtep(w, "b")[0]})


def test_node_without_underlay_address_gets_nothing() -> None:
    w = three_nodes()
    doc = w.store.get("node", "c")
    assert doc is not None
    spec = {k: v for k, v in doc.data["spec"].items() if k != "ipv4Address"}
    w.store.put("node", "c", {**doc.data, "spec": spec}, doc.revision)
    got = state(w, "a")
    assert got.fdb == frozenset({vtep(w, "b")[0]})
    assert str(w.block_of("c")) not in routes_by_dst(got)


@pytest.mark.parametrize(
    "field",
    [
        {"vxlanTunnelMACAddr": "01:00:5e:00:00:01"},  # multicast: not a VTEP's MAC
        {"vxlanTunnelMACAddr": "00:00:00:00:00:00"},
        {"vxlanTunnelMACAddr": "b"},  # replaced below by b's MAC: two nodes, one MAC
        {"ipv4VXLANTunnelAddr": "b"},  # replaced below by b's tunnel: one address, two nodes
    ],
)
def test_an_unusable_vtep_skips_that_node_only(field: dict[str, str]) -> None:
    w = three_nodes()
    ((key, value),) = field.items()
    if value == "b":
        value = w.mac("b") if key == "vxlanTunnelMACAddr" else str(w.tunnel("b"))
    w.apply({"apiVersion": API, "kind": "Node", "metadata": {"name": "c"}, "spec": {key: value}})
    for me in ("a", "b"):
        got = state(w, me)  # builds a valid DesiredState: no exception
        assert str(w.block_of("c")) not in routes_by_dst(got)
    got = state(w, "a")
    assert got.fdb == frozenset({vtep(w, "b")[0]})
    assert routes_by_dst(got)[str(w.block_of("b"))] == via_tunnel(w, w.block_of("b"), "b")


def test_own_node_without_mac_has_no_device_and_no_tunnel_routes() -> None:
    w = three_nodes()
    w.node("d", "192.168.1.4/24", tunnels=False)
    got = state(w, "d")
    assert got.vxlan_v4 is None
    assert got.fdb == frozenset()
    assert got.neighbours == frozenset()
    assert all(r.type == "blackhole" for r in got.routes)


def test_ipv6_on_its_own_device_when_both_sides_have_ipv6() -> None:
    w = World("vxlan")
    w.pool("pods", V4_POOL, vxlanMode="Always")
    w.pool("pods6", V6_POOL, vxlanMode="Always")
    w.node("a", "192.168.1.1/24", "fd00:1::1/64")
    w.node("b", "192.168.1.2/24", "fd00:1::2/64")
    w.node("c", "192.168.1.3/24")  # no IPv6 underlay
    c6 = w.pod("c", v6=True)  # c's pods may still have IPv6 addresses
    got = state(w, "a")
    assert got.vxlan_v4 == device(w, "a")
    assert got.vxlan_v6 == device(w, "a", 6, mtu=1430)
    assert got.vxlan_v6 is not None
    assert got.vxlan_v6.name == VXLAN_V6_DEVICE
    assert got.fdb == frozenset({vtep(w, "b")[0], vtep(w, "c")[0], vtep(w, "b", 6)[0]})
    assert vtep(w, "b", 6)[0].dst == ip("fd00:1::2")
    assert got.neighbours == frozenset({vtep(w, "b")[1], vtep(w, "c")[1], vtep(w, "b", 6)[1]})
    by_dst = routes_by_dst(got)
    assert by_dst[str(w.block_of("b", 6))] == via_tunnel(w, w.block_of("b", 6), "b", 6)
    assert by_dst[str(w.block_of("a", 6))] == OverlayRoute.blackhole(w.block_of("a", 6))
    assert c6 in w.block_of("c", 6)
    assert all(r.dst != w.block_of("c", 6) for r in got.routes)
    # c has no IPv6: no IPv6 device, nothing of IPv6 through a tunnel
    from_c = state(w, "c")
    assert from_c.vxlan_v6 is None
    assert all(r.version == 4 for r in from_c.routes if r.type == "unicast")


def test_bird_backend_leaves_pools_without_vxlan_alone() -> None:
    w = World("bird")
    w.pool("plain", V4_POOL)
    w.pool("six", V6_POOL)
    w.node("a", "192.168.1.1/24", "fd00:1::1/64")
    w.node("b", "192.168.1.2/24", "fd00:1::2/64")
    w.pod("a")
    w.pod("b")
    w.pod("b", v6=True)
    w.pod("a", w.free_address(w.block_of("b")))  # borrowed: BIRD's business too
    assert w.cluster("a").nodes["a"].vxlan_mac is None  # no VXLAN pool: no tunnel
    assert state(w, "a") == DesiredState()


def test_bird_backend_programs_only_the_vxlan_pools() -> None:
    w = World("bird")
    w.pool("plain", V4_POOL)
    w.pool("vx", "10.10.0.0/16", vxlanMode="Always")
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24")
    plain_b = w.pod("b", pool=V4_POOL)
    got = state(w, "a")
    vx_a, vx_b = w.block_of("a", pool="10.10.0.0/16"), w.block_of("b", pool="10.10.0.0/16")
    assert w.tunnel("a") in vx_a  # the tunnel address came from the VXLAN pool
    assert plain_b in w.block_of("b", pool=V4_POOL)
    assert got.vxlan_v4 == device(w, "a")
    assert routes_by_dst(got) == {
        str(vx_a): OverlayRoute.blackhole(vx_a),
        str(vx_b): via_tunnel(w, vx_b, "b"),
    }


def test_unset_vxlan_mode_means_always_under_backend_vxlan() -> None:
    for spec in ({}, {"ipipMode": "Never"}):
        w = World("vxlan")
        w.pool("pods", V4_POOL, **spec)
        w.node("a", "192.168.1.1/24")
        w.node("b", "192.168.1.2/24")
        got = routes_by_dst(state(w, "a"))
        assert got[str(w.block_of("b"))] == via_tunnel(w, w.block_of("b"), "b"), spec


def test_pool_created_from_configuration_is_vxlan_under_backend_vxlan() -> None:
    w = World("vxlan")
    w.config_pool(V4_POOL)
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24")
    assert routes_by_dst(state(w, "a"))[str(w.block_of("b"))] == via_tunnel(w, w.block_of("b"), "b")


def test_vxlan_mode_never_gets_nothing_under_backend_vxlan() -> None:
    w = World("vxlan")
    w.pool("vx", "10.10.0.0/16", vxlanMode="Always")
    w.pool("plain", V4_POOL, vxlanMode="Never")
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24")
    plain_b = w.pod("b", pool=V4_POOL)
    got = state(w, "a")
    assert all(not r.dst.subnet_of(net(V4_POOL)) for r in got.routes)  # type: ignore[arg-type]
    assert plain_b in net(V4_POOL)


def test_disabled_pool_is_still_routed() -> None:
    w = three_nodes()
    w.pod("b")
    before = state(w, "a")
    w.pool("pods", V4_POOL, vxlanMode="Always", disabled=True)
    assert w.cluster("a").pools[0].disabled
    assert state(w, "a") == before


def test_unaffine_block_routes_only_its_holders_addresses() -> None:
    w = three_nodes()
    blk = Block.new(net("10.244.200.0/26"), V4_POOL, None)
    blk.assign(1, "h1", {"node": "b"}, _no_reserved())
    blk.assign(2, "h2", {"node": "a"}, _no_reserved())
    w.block_doc(blk)
    got = routes_by_dst(state(w, "a"))
    assert "10.244.200.0/26" not in got
    assert got["10.244.200.1/32"] == via_tunnel(w, "10.244.200.1/32", "b")
    assert "10.244.200.2/32" not in got  # a's own pod


def test_block_without_a_pool_follows_the_backend() -> None:
    """A block whose pool was deleted: VXLAN routes it under --backend vxlan; under
    --backend bird it is BIRD's (no second route or blackhole from the vxlan state)."""
    w = three_nodes()
    for owner, cidr in (("a", "10.99.0.0/26"), ("b", "10.99.0.64/26")):
        w.block_doc(Block.new(net(cidr), "10.99.0.0/16", owner))
    got = routes_by_dst(state(w, "a"))
    assert got["10.99.0.0/26"] == OverlayRoute.blackhole("10.99.0.0/26")
    assert got["10.99.0.64/26"] == via_tunnel(w, "10.99.0.64/26", "b")
    wb = World("bird")
    wb.pool("vx", V4_POOL, vxlanMode="Always")
    wb.node("a", "192.168.1.1/24")
    wb.node("b", "192.168.1.2/24")
    for owner, cidr in (("a", "10.99.0.0/26"), ("b", "10.99.0.64/26")):
        wb.block_doc(Block.new(net(cidr), "10.99.0.0/16", owner))
    got = routes_by_dst(state(wb, "a"))
    assert "10.99.0.0/26" not in got
    assert "10.99.0.64/26" not in got
    assert got[str(wb.block_of("b"))] == via_tunnel(wb, wb.block_of("b"), "b")


def test_device_mtu_follows_the_underlay() -> None:
    w = World("vxlan")
    w.pool("pods", V4_POOL)
    w.pool("pods6", V6_POOL)
    w.node("a", "192.168.1.1/24", "fd00:1::1/64", mtu=9000)
    got = state(w, "a")
    assert got.vxlan_v4 is not None
    assert got.vxlan_v4.mtu == 8950
    assert got.vxlan_v6 is not None
    assert got.vxlan_v6.mtu == 8930


def test_backend_none_or_no_pools_wants_nothing() -> None:
    w = World("none")
    w.pool("pods", V4_POOL)
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24")
    w.pod("b")
    assert state(w, "a") == DesiredState()
    empty = World("vxlan")
    empty.node("a", "192.168.1.1/24")
    assert state(empty, "a") == DesiredState()


def _no_reserved() -> Reserved:
    return Reserved.parse([])
