"""``bird_config``: which BGP sessions, blocks and borrowed addresses a node's BIRD gets
(Calico's confd rules), from datastore documents written by tabby's own writers
(tests/unit/cluster_world.py). Representative results are rendered and checked with
``bird -p``. No root, no BIRD process.
"""

from __future__ import annotations

import ipaddress
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from bird import (
    BirdConfig,
    BirdNode,
    Peer,
    PeerType,
    Pool,
    check_config,
    render,
)
from ipam.core.block import Block
from ipam.core.model import Reserved
from tabby_node.routing import bird_config
from tests.unit.cluster_world import API, World, cluster_of, ip, net

V4_POOL = "10.244.0.0/16"
V6_POOL = "fd10::/48"
RR_LABEL = {"route-reflector": "true"}
BIRD = shutil.which("bird") or shutil.which("bird", path="/usr/sbin:/usr/local/sbin")

A4, B4, C4, D4 = (ipaddress.IPv4Address(f"192.168.1.{i}") for i in (1, 2, 3, 4))
A6, B6 = (ipaddress.IPv6Address(f"fd00:1::{i}") for i in (1, 2))

MESH, RR, GLOBAL, NODE = PeerType.MESH, PeerType.RR, PeerType.GLOBAL, PeerType.NODE


@pytest.fixture
def bird_accepts(tmp_path: Path) -> Iterator[list[BirdConfig]]:
    """Configs appended to the list are rendered and checked with ``bird -p`` at the end."""
    configs: list[BirdConfig] = []
    yield configs
    if BIRD is None:
        pytest.skip("bird (BIRD 2) is not installed: rendered text not checked by bird -p")
    for i, config in enumerate(configs):
        path = tmp_path / f"bird{i}.conf"
        path.write_text(render(config))
        check_config(str(path), BIRD)


def cluster(
    n: int = 3,
    *,
    v6: tuple[str, ...] = (),
    pools: tuple[tuple[str, str, dict[str, str]], ...] = (("pods", V4_POOL, {}),),
) -> World:
    """``n`` tabby-nodes --backend bird (a, b, c, d...) on 192.168.1.0/24; those named in
    ``v6`` also have an IPv6 underlay address. Each node has one pod (so one block)."""
    w = World("bird")
    for name, cidr, spec in pools:
        w.pool(name, cidr, **spec)
    for i, name in enumerate("abcdefgh"[:n], 1):
        w.node(name, f"192.168.1.{i}/24", f"fd00:1::{i}/64" if name in v6 else None)
    for name in "abcdefgh"[:n]:
        w.pod(name, pool=V4_POOL)
    return w


def config(w: World, me: str, *, ipip: bool = False) -> BirdConfig:
    got = bird_config(w.cluster(me), me, ipip=ipip)
    assert got is not None
    return got


def peers(c: BirdConfig) -> dict[str, tuple[PeerType, int, bool, str]]:
    """address -> (type, AS, rr client, name)."""
    return {str(p.address): (p.type, p.as_number, p.rr_client, p.name) for p in c.peers}


def _no_reserved() -> Reserved:
    return Reserved.parse([])


# == full mesh ==========================================================================


def test_full_mesh_of_three(bird_accepts: list[BirdConfig]) -> None:
    w = cluster(3)
    got = config(w, "a")
    assert got == BirdConfig(
        node=BirdNode("a", A4, None, 64512, None),
        peers=(Peer(B4, MESH, 64512, False, "b"), Peer(C4, MESH, 64512, False, "c")),
        pools=(Pool(net(V4_POOL)),),
        blocks=(w.block_of("a"),),
        borrowed=(),
        log_severity="info",
    )
    for me in "abc":
        c = config(w, me)
        others = {str(ip(f"192.168.1.{i}")) for i, n in enumerate("abc", 1) if n != me}
        assert set(peers(c)) == others
        assert all(p.type == MESH and not p.rr_client for p in c.peers)
        assert c.blocks == (w.block_of(me),)
    bird_accepts.append(got)


def test_mesh_over_ipv6_only_where_both_sides_have_it(bird_accepts: list[BirdConfig]) -> None:
    w = cluster(3, v6=("a", "b"), pools=(("pods", V4_POOL, {}), ("pods6", V6_POOL, {})))
    w.pod("a", v6=True)
    w.pod("c", v6=True)  # c has no IPv6 underlay, but may have IPv6 pods
    a = config(w, "a")
    assert a.node.ipv6 == A6
    assert peers(a) == {
        str(B4): (MESH, 64512, False, "b"),
        str(C4): (MESH, 64512, False, "c"),
        str(B6): (MESH, 64512, False, "b"),
    }
    assert a.pools == (Pool(net(V4_POOL)), Pool(net(V6_POOL)))
    assert a.blocks == (w.block_of("a"), w.block_of("a", 6))
    c = config(w, "c")
    assert c.node.ipv6 is None
    assert set(peers(c)) == {str(A4), str(B4)}
    assert c.pools == (Pool(net(V4_POOL)),)  # no IPv6 half without an IPv6 underlay
    assert c.blocks == (w.block_of("c"),)
    bird_accepts.extend([a, c])


def test_cluster_as_and_per_node_as() -> None:
    w = cluster(3)
    w.bgp_configuration(asNumber=65100)
    w.node_bgp("b", asNumber=65002)
    a, b = config(w, "a"), config(w, "b")
    assert a.node.as_number == 65100
    assert peers(a)[str(B4)] == (MESH, 65002, False, "b")  # eBGP towards b
    assert peers(a)[str(C4)] == (MESH, 65100, False, "c")
    assert b.node.as_number == 65002
    assert peers(b) == {str(A4): (MESH, 65100, False, "a"), str(C4): (MESH, 65100, False, "c")}


def test_default_as_without_a_bgp_configuration() -> None:
    assert config(cluster(2), "a").node.as_number == 64512


def test_dead_and_deleted_nodes_are_not_peered() -> None:
    w = cluster(4)
    w.lease_expires("c")
    w.delete("Node", "d")
    assert set(peers(config(w, "a"))) == {str(B4)}
    # c itself still renders its view (it counts as alive for itself)
    assert set(peers(config(w, "c"))) == {str(A4), str(B4)}


def test_no_mesh_when_disabled() -> None:
    w = cluster(3)
    w.bgp_configuration(nodeToNodeMeshEnabled=False)
    assert config(w, "a").peers == ()


# == route reflectors (Calico's documented set-up) ========================================


def rr_cluster(second_rr_id: str | None = None) -> World:
    """Mesh off; c is a route reflector (label + cluster id), optionally d too; one BGPPeer
    as in Calico's docs: every node peers with the nodes labelled route-reflector."""
    w = cluster(4 if second_rr_id else 3)
    w.bgp_configuration(nodeToNodeMeshEnabled=False)
    w.label("c", **RR_LABEL)
    w.node_bgp("c", routeReflectorClusterID="244.0.0.1")
    if second_rr_id:
        w.label("d", **RR_LABEL)
        w.node_bgp("d", routeReflectorClusterID=second_rr_id)
    w.bgp_peer(
        "peer-with-route-reflectors",
        nodeSelector="all()",
        peerSelector="route-reflector == 'true'",
    )
    return w


def test_route_reflector_clients_peer_only_with_it(bird_accepts: list[BirdConfig]) -> None:
    w = rr_cluster()
    for me in ("a", "b"):
        c = config(w, me)
        assert peers(c) == {str(C4): (RR, 64512, False, "c")}
        assert c.node.rr_cluster_id is None
    bird_accepts.append(config(w, "a"))


def test_route_reflector_has_the_nodes_as_clients(bird_accepts: list[BirdConfig]) -> None:
    w = rr_cluster()
    c = config(w, "c")
    assert c.node.rr_cluster_id == ip("244.0.0.1")
    assert peers(c) == {str(A4): (RR, 64512, True, "a"), str(B4): (RR, 64512, True, "b")}
    bird_accepts.append(c)


def test_reflectors_with_one_cluster_id_are_not_each_others_clients(
    bird_accepts: list[BirdConfig],
) -> None:
    w = rr_cluster(second_rr_id="244.0.0.1")
    c, d = config(w, "c"), config(w, "d")
    assert peers(c) == {
        str(A4): (RR, 64512, True, "a"),
        str(B4): (RR, 64512, True, "b"),
        str(D4): (RR, 64512, False, "d"),
    }
    assert peers(d)[str(C4)] == (RR, 64512, False, "c")
    assert peers(config(w, "a")) == {
        str(C4): (RR, 64512, False, "c"),
        str(D4): (RR, 64512, False, "d"),
    }
    bird_accepts.extend([c, d])


def test_reflectors_with_different_cluster_ids_are_each_others_clients() -> None:
    w = rr_cluster(second_rr_id="244.0.0.2")
    assert peers(config(w, "c"))[str(D4)] == (RR, 64512, True, "d")
    assert peers(config(w, "d"))[str(C4)] == (RR, 64512, True, "c")


def test_a_reflector_renders_no_mesh_and_the_mesh_skips_it() -> None:
    w = cluster(3)  # mesh on, no BGPPeer
    w.node_bgp("c", routeReflectorClusterID="244.0.0.1")
    assert config(w, "c").peers == ()
    assert peers(config(w, "a")) == {str(B4): (MESH, 64512, False, "b")}


def test_reflector_with_a_client_in_another_as_is_ebgp_not_a_client() -> None:
    w = rr_cluster()
    w.node_bgp("b", asNumber=65002)
    c = config(w, "c")
    assert peers(c)[str(B4)] == (RR, 65002, False, "b")
    assert peers(c)[str(A4)] == (RR, 64512, True, "a")


def test_reflector_reached_by_peer_ip_peers_back() -> None:
    """A BGPPeer towards a node's address (at its AS) also makes that node peer with the
    nodes the BGPPeer is for, over the same IP version (Calico's reverse peering)."""
    w = cluster(4)
    w.bgp_configuration(nodeToNodeMeshEnabled=False)
    w.node_bgp("c", routeReflectorClusterID="244.0.0.1")
    w.label("a", rack="r1")
    w.label("b", rack="r1")
    w.bgp_peer("rack-r1-to-c", nodeSelector="rack == 'r1'", peerIP=str(C4), asNumber=64512)
    # a's session is the BGPPeer's (named after it), of type rr: c is a reflector
    assert peers(config(w, "a")) == {str(C4): (RR, 64512, False, "rack-r1-to-c")}
    assert peers(config(w, "c")) == {
        str(A4): (RR, 64512, True, "a"),
        str(B4): (RR, 64512, True, "b"),
    }
    assert config(w, "d").peers == ()


def test_a_peer_ip_at_another_as_is_no_reverse_peering() -> None:
    w = cluster(3)
    w.bgp_configuration(nodeToNodeMeshEnabled=False)
    w.bgp_peer("to-c", node="a", peerIP=str(C4), asNumber=65009)
    assert peers(config(w, "a")) == {str(C4): (NODE, 65009, False, "to-c")}
    assert config(w, "c").peers == ()


def test_selector_peering_between_two_racks_is_symmetric() -> None:
    w = cluster(4)
    w.bgp_configuration(nodeToNodeMeshEnabled=False)
    for name, rack in (("a", "r1"), ("b", "r1"), ("c", "r2"), ("d", "r2")):
        w.label(name, rack=rack)
    w.bgp_peer("r1-r2", nodeSelector="rack == 'r1'", peerSelector="rack == 'r2'")
    assert set(peers(config(w, "a"))) == {str(C4), str(D4)}
    assert set(peers(config(w, "c"))) == {str(A4), str(B4)}
    assert all(p.type == NODE for p in config(w, "c").peers)


# == explicit BGPPeers ====================================================================


def test_global_peer_ip_is_ebgp_on_every_node(bird_accepts: list[BirdConfig]) -> None:
    w = cluster(3)
    w.bgp_peer("tor", peerIP="192.168.1.254", asNumber=65000)
    for me in "abc":
        c = config(w, me)
        assert peers(c)["192.168.1.254"] == (GLOBAL, 65000, False, "tor")
        assert sum(1 for p in c.peers if p.type == MESH) == 2
    bird_accepts.append(config(w, "a"))


def test_node_specific_peers(bird_accepts: list[BirdConfig]) -> None:
    w = cluster(3)
    w.label("a", rack="r1")
    w.label("b", rack="r1")
    w.bgp_peer("a-only", node="a", peerIP="192.168.1.253", asNumber=65001)
    w.bgp_peer("rack-r1", nodeSelector="rack == 'r1'", peerIP="192.168.1.252", asNumber=65002)
    a, b, c = (config(w, n) for n in "abc")
    assert peers(a)["192.168.1.253"] == (NODE, 65001, False, "a-only")
    assert peers(a)["192.168.1.252"] == (NODE, 65002, False, "rack-r1")
    assert "192.168.1.253" not in peers(b)
    assert peers(b)["192.168.1.252"] == (NODE, 65002, False, "rack-r1")
    assert {"192.168.1.252", "192.168.1.253"}.isdisjoint(peers(c))
    bird_accepts.append(a)


def test_ibgp_peer_ip_gets_the_node_as() -> None:
    w = cluster(2)
    w.bgp_peer("rr-outside", peerIP="192.168.1.250", asNumber=64512)
    assert peers(config(w, "a"))["192.168.1.250"] == (GLOBAL, 64512, False, "rr-outside")


def test_an_explicit_peer_wins_over_the_mesh_session_to_the_same_address() -> None:
    w = cluster(3)
    w.bgp_peer("to-b", peerIP=str(B4), asNumber=64512)
    a = config(w, "a")
    assert peers(a)[str(B4)] == (GLOBAL, 64512, False, "to-b")
    assert [p.address for p in a.peers].count(B4) == 1
    assert peers(a)[str(C4)] == (MESH, 64512, False, "c")
    # b is the BGPPeer's far side: it peers back with every node, one session each
    b = config(w, "b")
    assert peers(b) == {str(A4): (NODE, 64512, False, "a"), str(C4): (NODE, 64512, False, "c")}


def test_a_global_peer_wins_over_a_node_specific_one_to_the_same_address() -> None:
    w = cluster(2)
    w.bgp_peer("a-first", node="a", peerIP="192.168.1.254", asNumber=65001)
    w.bgp_peer("z-global", peerIP="192.168.1.254", asNumber=65000)
    assert peers(config(w, "a"))["192.168.1.254"] == (GLOBAL, 65000, False, "z-global")


def test_ipv6_peer_needs_an_ipv6_underlay() -> None:
    w = cluster(2, v6=("a",))
    w.bgp_peer("tor6", peerIP="fd00:1::fe", asNumber=65000)
    assert peers(config(w, "a"))["fd00:1::fe"] == (GLOBAL, 65000, False, "tor6")
    assert "fd00:1::fe" not in peers(config(w, "b"))


@pytest.mark.parametrize("address", ["127.0.0.1", "224.0.0.5", "0.0.0.0", "fe80::1", "::1"])
def test_an_unusable_peer_address_is_skipped_not_fatal(address: str) -> None:
    w = cluster(2, v6=("a", "b"))
    w.bgp_peer("bad", peerIP=address, asNumber=65000)
    a = config(w, "a")
    assert address not in peers(a)
    assert set(peers(a)) == {str(B4), str(B6)}


def test_a_node_with_an_unusable_address_is_skipped_not_fatal() -> None:
    w = cluster(2, v6=("a", "b"))
    w.node("x", "127.0.0.9/8", "fe80::9/64")
    w.node("y", "192.168.1.9/24", "fe80::19/64")
    a = config(w, "a")
    assert set(peers(a)) == {str(B4), str(B6), "192.168.1.9"}


# == blocks, borrowed addresses, pools =====================================================


def test_borrowed_addresses_only_of_this_node() -> None:
    w = cluster(3)
    lent = w.pod("b", w.free_address(w.block_of("a")))
    a, b, c = (config(w, n) for n in "abc")
    assert b.borrowed == (lent,)
    assert a.borrowed == ()
    assert c.borrowed == ()
    assert a.blocks == (w.block_of("a"),)  # the owner keeps announcing its block


def test_blocks_and_borrowed_addresses_of_vxlan_pools_are_left_to_vxlan() -> None:
    w = cluster(2, pools=(("pods", V4_POOL, {}), ("vx", "10.10.0.0/16", {"vxlanMode": "Always"})))
    plain_a = w.block_of("a", pool=V4_POOL)
    vx_a = w.block_of("a", pool="10.10.0.0/16")  # the VXLAN tunnel address's block
    lent_plain = w.pod("b", w.free_address(plain_a))
    lent_vx = w.pod("b", w.free_address(vx_a), pool="10.10.0.0/16")
    a, b = config(w, "a"), config(w, "b")
    assert a.pools == (Pool(net(V4_POOL)),)
    assert a.blocks == (plain_a,)
    assert b.borrowed == (lent_plain,)
    assert lent_vx not in b.borrowed


def test_cross_subnet_vxlan_pool_is_left_to_vxlan_too() -> None:
    w = cluster(2, pools=(("pods", V4_POOL, {"vxlanMode": "CrossSubnet"}),))
    assert config(w, "a").pools == ()
    assert config(w, "a").blocks == ()


def test_ipip_pool(bird_accepts: list[BirdConfig]) -> None:
    w = cluster(
        2,
        v6=("a", "b"),
        pools=(("pods", V4_POOL, {"ipipMode": "Always"}), ("pods6", V6_POOL, {})),
    )
    assert config(w, "a", ipip=True).pools == (Pool(net(V4_POOL), ipip=True), Pool(net(V6_POOL)))
    # no ipip module in the kernel: the pool's routes stay direct
    assert config(w, "a", ipip=False).pools == (Pool(net(V4_POOL)), Pool(net(V6_POOL)))
    bird_accepts.append(config(w, "a", ipip=True))


def test_disabled_pool_keeps_its_routes() -> None:
    w = cluster(2)
    before = config(w, "a")
    w.pool("pods", V4_POOL, disabled=True)
    assert config(w, "a") == before


def test_pool_created_from_configuration() -> None:
    w = World("bird")
    w.config_pool(V4_POOL)
    w.node("a", "192.168.1.1/24")
    w.node("b", "192.168.1.2/24")
    w.pod("a")
    assert config(w, "a").pools == (Pool(net(V4_POOL)),)
    assert config(w, "a").blocks == (w.block_of("a"),)


def test_unaffine_block_is_nobodys_but_its_holders_announce_their_addresses() -> None:
    w = cluster(2)
    blk = Block.new(net("10.244.200.0/26"), V4_POOL, None)
    blk.assign(1, "h1", {"node": "b"}, _no_reserved())
    w.block_doc(blk)
    assert net("10.244.200.0/26") not in config(w, "a").blocks
    assert config(w, "b").borrowed == (ip("10.244.200.1"),)


def test_a_one_address_block_held_by_another_node_is_announced_by_the_holder_only() -> None:
    w = cluster(2)
    blk = Block.new(net("10.244.250.7/32"), V4_POOL, "a")
    blk.assign(0, "h", {"node": "b"}, _no_reserved())
    w.block_doc(blk)
    assert net("10.244.250.7/32") not in config(w, "a").blocks
    assert config(w, "b").borrowed == (ip("10.244.250.7"),)


# == the rest =============================================================================


@pytest.mark.parametrize(
    ("screen", "bird"),
    [
        ("Debug", "debug"),
        ("Info", "info"),
        ("Warning", "warning"),
        ("Error", "error"),
        ("Fatal", "error"),
    ],
)
def test_log_severity(screen: str, bird: str) -> None:
    w = cluster(2)
    w.bgp_configuration(logSeverityScreen=screen)
    assert config(w, "a").log_severity == bird


def test_a_node_without_ipv4_has_no_bird_config() -> None:
    w = cluster(2)
    w.node("six", None, "fd00:1::9/64")
    assert bird_config(w.cluster("six"), "six") is None
    assert bird_config(w.cluster("a"), "nobody") is None
    assert set(peers(config(w, "a"))) == {str(B4)}  # and nobody peers with it over IPv4


def test_the_config_does_not_depend_on_document_order() -> None:
    w = rr_cluster(second_rr_id="244.0.0.1")
    w.bgp_peer("tor", peerIP="192.168.1.254", asNumber=65000)
    docs = w.docs()
    want = {me: render(config(w, me)) for me in "abcd"}
    reversed_docs = {k: dict(reversed(list(v.items()))) for k, v in reversed(docs.items())}
    for me in "abcd":
        got = bird_config(cluster_of(reversed_docs, me), me)
        assert got is not None
        assert render(got) == want[me]


def test_rendered_text_names_the_sessions() -> None:
    w = rr_cluster()
    text = render(config(w, "c"))
    assert "protocol bgp Rr_192_168_1_1 from tabby_bgp4 {" in text
    assert "  rr client;\n  rr cluster id 244.0.0.1;" in text
    mesh = render(config(cluster(2), "a"))
    assert "protocol bgp Mesh_192_168_1_2 from tabby_bgp4 {" in mesh
    assert "  passive on;" in mesh  # b's address sorts above a's: a waits for b


def test_node_labels_applied_with_tabbyctl_select_peers() -> None:
    w = cluster(3)
    w.bgp_configuration(nodeToNodeMeshEnabled=False)
    w.apply(
        {
            "apiVersion": API,
            "kind": "BGPPeer",
            "metadata": {"name": "edge"},
            "spec": {"nodeSelector": "edge == 'yes'", "peerIP": "192.168.1.200", "asNumber": 65010},
        }
    )
    assert config(w, "b").peers == ()
    w.label("b", edge="yes")
    assert peers(config(w, "b")) == {"192.168.1.200": (NODE, 65010, False, "edge")}
    assert ipaddress.ip_address("192.168.1.200") not in {p.address for p in config(w, "a").peers}


# == above ~100 nodes: route reflectors (the configuration docs/cluster.md recommends) ======


def _big(n: int, reflectors: int) -> World:
    """``n`` nodes on 10.1.0.0/16, node n010 with a pod (a block); with ``reflectors``, mesh off and
    the first nodes reflectors sharing one cluster id (redundant: a client keeps its routes
    while one is down), every node peering with them by label (Calico's set-up)."""
    w = World("bird")
    w.pool("pods", V4_POOL)
    names = [f"n{i:03d}" for i in range(n)]
    for i, name in enumerate(names):
        w.node(name, f"10.1.{i // 250}.{i % 250 + 1}/16", None, tunnels=False)  # no vxlan
    w.pod("n010", pool=V4_POOL)
    if reflectors:
        w.bgp_configuration(nodeToNodeMeshEnabled=False)
        for name in names[:reflectors]:
            w.label(name, **RR_LABEL)
            w.node_bgp(name, routeReflectorClusterID="244.0.0.1")
        w.bgp_peer("rr", nodeSelector="all()", peerSelector="route-reflector == 'true'")
    return w


def test_with_reflectors_a_node_has_two_sessions_whatever_the_cluster_size(
    bird_accepts: list[BirdConfig],
) -> None:
    """The full mesh costs every node a session per other node (N-1; N(N-1)/2 in all, each
    carrying every block); with two reflectors a client has two sessions and a rendered
    configuration whose size does not depend on N, and only the reflectors carry N."""
    for n in (50, 200):  # (the blocks other nodes hold change no session: left out)
        mesh = _big(n, reflectors=0)
        assert len(config(mesh, "n010").peers) == n - 1
        w = _big(n, reflectors=2)
        client = config(w, "n010")
        assert [(p.name, p.type) for p in client.peers] == [("n000", RR), ("n001", RR)]
        assert client.node.rr_cluster_id is None
        assert client.blocks == (w.block_of("n010"),)
        reflector = config(w, "n000")
        assert reflector.node.rr_cluster_id == ip("244.0.0.1")
        clients = [p for p in reflector.peers if p.rr_client]
        assert len(clients) == n - 2  # every node but the two reflectors
        # the other reflector: a peer, not a client (same cluster id)
        assert [(p.name, p.rr_client) for p in reflector.peers if not p.rr_client] == [
            ("n001", False)
        ]
        if n == 200:
            assert len(render(client)) == len(render(config(_big(50, 2), "n010")))
            bird_accepts.extend([client, reflector])
