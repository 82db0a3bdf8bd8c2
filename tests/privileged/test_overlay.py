"""The node agent's routing (dataplane.overlay) and node facts (nodeinfo) against
the real kernel, in throwaway namespaces.

A small cluster: an "underlay" namespace with a bridge, and node namespaces attached to it
by veth (one IPv4 /24 and one IPv6 /64 underlay subnet). Each node gets a pod networked by
tabby's own pod data path (``dataplane.setup``), and the reconciler runs in a thread that
entered the node (``Node.run``), exactly as tabby-node would run in the node. Pods then ping
each other over the VXLAN tunnels (IPv4 and IPv6) or over CrossSubnet direct routes.
Everything is deleted by the ``netns_pool`` fixture, also when a test fails.
"""

from __future__ import annotations

import dataclasses
import ipaddress
from collections.abc import Iterable

import pytest

import dataplane
from dataplane import nodeinfo
from dataplane.overlay import Changes, Reconciler
from dataplane.overlay_model import (
    RTPROT_TABBY,
    VXLAN_V4_DEVICE,
    VXLAN_V6_DEVICE,
    DesiredState,
    FdbEntry,
    IpipDevice,
    NeighbourEntry,
    OverlayRoute,
    VxlanDevice,
    vxlan_peer,
)
from tests.privileged.netns_util import Netns, NetnsPool, Node

pytestmark = pytest.mark.privileged

ip = ipaddress.ip_address
net = ipaddress.ip_network


@dataclasses.dataclass
class SimNode:
    """One node of the test cluster and the addresses the datastore would give it."""

    k: int
    ns: Node
    pod: Netns
    pool: NetnsPool

    @property
    def name(self) -> str:
        return f"node-{self.k}"

    @property
    def ip4(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Address(f"192.168.50.{self.k}")

    @property
    def ip6(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(f"fd50::{self.k}")

    @property
    def tunnel4(self) -> ipaddress.IPv4Address:
        return ipaddress.IPv4Address(f"10.244.{self.k}.1")

    @property
    def tunnel6(self) -> ipaddress.IPv6Address:
        return ipaddress.IPv6Address(f"fd00:10:244:{self.k}::1")

    @property
    def block4(self) -> ipaddress.IPv4Network:
        return ipaddress.IPv4Network(f"10.244.{self.k}.0/26")

    @property
    def block6(self) -> ipaddress.IPv6Network:
        return ipaddress.IPv6Network(f"fd00:10:244:{self.k}::/122")

    @property
    def pod4(self) -> str:
        return f"10.244.{self.k}.5"

    @property
    def pod6(self) -> str:
        return f"fd00:10:244:{self.k}::5"

    def mac(self, version: int) -> str:
        return nodeinfo.vxlan_mac(self.name, version)

    def reconcile(self, desired: DesiredState, reconciler: Reconciler | None = None) -> Changes:
        return self.ns.run((reconciler or Reconciler()).reconcile, desired)

    def show(self, *args: str) -> str:
        return self.ns.ip(*args).stdout.strip()


def add_pod(node: Node, pod: Netns, addresses: Iterable[str]) -> None:
    spec = dataplane.SetupSpec(
        netns_path=pod.path,
        ifname="eth0",
        host_ifname=dataplane.host_veth_name("cali", "k8s-pod-network", pod.name, "eth0"),
        addresses=[ip(a) for a in addresses],
        mtu=1400,
    )
    node.run(dataplane.setup, spec)


def make_cluster(pool: NetnsPool, n: int) -> list[SimNode]:
    underlay = pool.pod()
    underlay.ip("link", "add", "br0", "type", "bridge")
    underlay.ip("link", "set", "br0", "up")
    nodes = []
    for k in range(1, n + 1):
        ns = pool.node()
        ns.ip(
            "link", "add", "eth0", "type", "veth", "peer", "name", f"ul{k}", "netns", underlay.name
        )
        underlay.ip("link", "set", f"ul{k}", "master", "br0", "up")
        ns.ip("link", "set", "eth0", "up")
        ns.ip("addr", "add", f"192.168.50.{k}/24", "dev", "eth0")
        ns.ip("-6", "addr", "add", f"fd50::{k}/64", "dev", "eth0", "nodad")
        node = SimNode(k, ns, pool.pod(), pool)
        add_pod(ns, node.pod, [node.pod4, node.pod6])
        nodes.append(node)
    return nodes


def desired_for(
    me: SimNode,
    peers: Iterable[SimNode],
    *,
    direct: Iterable[SimNode] = (),
    extra: Iterable[OverlayRoute] = (),
    mtu: int = 1450,
) -> DesiredState:
    """What tabby-node would want on ``me``: both VXLAN devices, per peer an FDB entry and a
    neighbour per family and its blocks through the tunnel (``direct`` peers: CrossSubnet
    routes via their underlay address), blackholes for ``me``'s own blocks."""
    direct_names = {p.name for p in direct}
    fdb: set[FdbEntry] = set()
    neighbours: set[NeighbourEntry] = set()
    routes: set[OverlayRoute] = {
        OverlayRoute.blackhole(me.block4),
        OverlayRoute.blackhole(me.block6),
    }
    for peer in peers:
        for dev, node_ip, tunnel, block, version in (
            (VXLAN_V4_DEVICE, peer.ip4, peer.tunnel4, peer.block4, 4),
            (VXLAN_V6_DEVICE, peer.ip6, peer.tunnel6, peer.block6, 6),
        ):
            entries = vxlan_peer(
                dev, node_ip=node_ip, tunnel_ip=tunnel, mac=peer.mac(version), prefixes=[block]
            )
            fdb.add(entries.fdb)
            neighbours.add(entries.neighbour)
            if peer.name in direct_names:
                routes.add(OverlayRoute.via(block, node_ip, "eth0"))
            else:
                routes.update(entries.routes)
    routes.update(extra)
    return DesiredState(
        vxlan_v4=VxlanDevice(me.ip4, me.mac(4), mtu, me.tunnel4),
        vxlan_v6=VxlanDevice(me.ip6, me.mac(6), mtu - 20, me.tunnel6),
        fdb=frozenset(fdb),
        neighbours=frozenset(neighbours),
        routes=frozenset(routes),
    )


def reconcile_all(nodes: list[SimNode]) -> dict[str, Changes]:
    out = {}
    for node in nodes:
        changes = node.reconcile(desired_for(node, peers_of(node, nodes)))
        assert changes.ok, (changes.conflicts, changes.failures)
        out[node.name] = changes
    return out


def ping_all(nodes: list[SimNode]) -> None:
    for src in nodes:
        for dst in nodes:
            if dst is not src:
                src.pod.ping(dst.pod4)
                src.pod.ping(dst.pod6)


def peers_of(node: SimNode, nodes: list[SimNode]) -> list[SimNode]:
    return [p for p in nodes if p is not node]


@pytest.fixture
def cluster3(netns_pool: NetnsPool) -> list[SimNode]:
    return make_cluster(netns_pool, 3)


@pytest.fixture
def cluster2(netns_pool: NetnsPool) -> list[SimNode]:
    return make_cluster(netns_pool, 2)


# --- the overlay works ----------------------------------------------------------------------


def test_pods_on_three_nodes_reach_each_other_over_vxlan_v4_and_v6(
    cluster3: list[SimNode],
) -> None:
    first = reconcile_all(cluster3)
    ping_all(cluster3)

    counts = first["node-1"].counts()
    assert counts["device"]["add"] == 2
    assert counts["address"]["add"] == 2
    assert counts["fdb"]["add"] == 4  # two peers, two families
    assert counts["neighbour"]["add"] == 4
    assert counts["route"]["add"] == 4
    assert counts["blackhole"]["add"] == 2
    assert not first["node-1"].removed
    assert not first["node-1"].replaced

    n1, n2, n3 = cluster3
    mine = n1.show("route", "show", "proto", str(RTPROT_TABBY))
    assert "blackhole 10.244.1.0/26" in mine
    assert "10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby onlink" in mine
    assert "10.244.3.0/26 via 10.244.3.1 dev vxlan.tabby onlink" in mine
    mine6 = n1.show("-6", "route", "show", "proto", str(RTPROT_TABBY))
    assert "blackhole fd00:10:244:1::/122" in mine6
    assert "fd00:10:244:2::/122 via fd00:10:244:2::1 dev vxlan-v6.tabby" in mine6
    details = n1.show("-d", "link", "show", "vxlan.tabby")
    for text in ("vxlan id 4096", "dstport 4789", "local 192.168.50.1", "nolearning", "mtu 1450"):
        assert text in details
    assert n1.mac(4) in details
    assert "local fd50::1" in n1.show("-d", "link", "show", "vxlan-v6.tabby")
    assert "10.244.1.1/32" in n1.show("addr", "show", "dev", "vxlan.tabby")
    assert "fd00:10:244:1::1/128" in n1.show("addr", "show", "dev", "vxlan-v6.tabby")
    neigh = n1.show("neigh", "show", "dev", "vxlan.tabby", "nud", "permanent")
    assert f"10.244.2.1 lladdr {n2.mac(4)} PERMANENT" in neigh
    neigh6 = n1.show("-6", "neigh", "show", "dev", "vxlan-v6.tabby", "nud", "permanent")
    assert f"fd00:10:244:3::1 lladdr {n3.mac(6)} PERMANENT" in neigh6
    fdb = n1.ns.exec("bridge", "fdb", "show", "dev", "vxlan.tabby").stdout
    assert f"{n3.mac(4)} dst 192.168.50.3 self permanent" in fdb
    fdb6 = n1.ns.exec("bridge", "fdb", "show", "dev", "vxlan-v6.tabby").stdout
    assert f"{n2.mac(6)} dst fd50::2 self permanent" in fdb6

    # Idempotent: the same desired state again changes nothing, on every node.
    for node in cluster3:
        again = node.reconcile(desired_for(node, peers_of(node, cluster3)))
        assert not again, again.applied
        assert again.ok
        assert again.summary() == "no change"


def test_cross_subnet_routes_go_direct_via_the_peer_node(cluster2: list[SimNode]) -> None:
    a, b = cluster2
    assert a.reconcile(desired_for(a, [b], direct=[b])).ok
    assert b.reconcile(desired_for(b, [a], direct=[a])).ok
    assert "10.244.2.0/26 via 192.168.50.2 dev eth0 proto 116 onlink" in a.show(
        "route", "show", "10.244.2.0/26"
    )
    assert "via fd50::2 dev eth0" in a.show("-6", "route", "show", "fd00:10:244:2::/122")
    assert "dev eth0" in a.show("route", "get", b.pod4)  # not through the tunnel
    a.pod.ping(b.pod4)
    a.pod.ping(b.pod6)
    b.pod.ping(a.pod4)

    # Moving the peer to the tunnel replaces the same two prefixes in place.
    changes = a.reconcile(desired_for(a, [b]))
    assert changes.count("replace", "route") == 2
    assert len(changes) == 2
    assert "dev vxlan.tabby" in a.show("route", "get", b.pod4)
    a.pod.ping(b.pod4)
    a.pod.ping(b.pod6)


def test_borrowed_address_is_reachable_behind_the_owners_blackhole(
    cluster3: list[SimNode],
) -> None:
    n1, n2, n3 = cluster3
    # A second pod on node 1 holds addresses of node 2's blocks (borrowed).
    borrower = n1.pool.pod()
    add_pod(n1.ns, borrower, ["10.244.2.77", "fd00:10:244:2::77"])
    held = [
        OverlayRoute.via("10.244.2.77/32", n1.tunnel4, VXLAN_V4_DEVICE),
        OverlayRoute.via("fd00:10:244:2::77/128", n1.tunnel6, VXLAN_V6_DEVICE),
    ]
    # Every other node routes the /32 (/128) to node 1: node 2 too, behind its blackhole.
    for node in (n2, n3):
        assert node.reconcile(desired_for(node, peers_of(node, cluster3), extra=held)).ok
    assert n1.reconcile(desired_for(n1, [n2, n3])).ok
    assert "10.244.2.77 via 10.244.1.1 dev vxlan.tabby proto 116 onlink" in n2.show(
        "route", "show", "10.244.2.77/32"
    )
    assert "blackhole 10.244.2.0/26" in n2.show("route", "show", "10.244.2.0/26")
    for node in (n2, n3):
        node.pod.ping("10.244.2.77")
        node.pod.ping("fd00:10:244:2::77")


# --- reconciling like a daemon --------------------------------------------------------------


def test_a_restarted_reconciler_adopts_everything_and_repairs_a_half_done_run(
    cluster3: list[SimNode],
) -> None:
    reconcile_all(cluster3)
    n1, n2, n3 = cluster3
    want = desired_for(n1, [n2, n3])
    index_before = n1.show("link", "show", "vxlan.tabby").split(":")[0]

    # "Restart": a new Reconciler (nothing in memory) finds nothing to do.
    assert not n1.reconcile(want, Reconciler())

    # A crash half-way through a run, and someone else's fiddling, leave the kernel like so:
    n1.ns.ip("route", "del", "10.244.3.0/26")  # a route not yet (re)added
    n1.ns.ip("-6", "route", "del", "blackhole", "fd00:10:244:1::/122")
    n1.ns.exec("bridge", "fdb", "del", n2.mac(4), "dev", "vxlan.tabby", "dst", "192.168.50.2")
    n1.ns.ip(
        "neigh",
        "replace",
        "10.244.3.1",
        "lladdr",
        "02:00:00:00:00:99",
        "dev",
        "vxlan.tabby",
        "nud",
        "permanent",
    )  # a stale MAC
    n1.ns.ip(
        "neigh",
        "add",
        "10.244.9.1",
        "lladdr",
        "02:00:00:00:00:09",
        "dev",
        "vxlan.tabby",
        "nud",
        "permanent",
    )  # a node deleted meanwhile
    n1.ns.ip("link", "set", "vxlan.tabby", "mtu", "1400")
    n1.ns.ip(
        "route",
        "add",
        "10.244.9.0/26",
        "via",
        "10.244.9.1",
        "dev",
        "vxlan.tabby",
        "onlink",
        "proto",
        str(RTPROT_TABBY),
    )

    changes = n1.reconcile(want, Reconciler())
    assert changes.ok
    assert sorted(str(c) for c in changes.applied) == sorted(
        [
            "add 10.244.3.0/26 via 10.244.3.1 dev vxlan.tabby onlink",
            "add blackhole fd00:10:244:1::/122",
            f"add fdb {n2.mac(4)} dst 192.168.50.2 dev vxlan.tabby",
            f"replace neigh 10.244.3.1 lladdr {n3.mac(4)} dev vxlan.tabby",
            "remove neigh 10.244.9.1 lladdr 02:00:00:00:00:09 dev vxlan.tabby",
            "replace device vxlan.tabby (mtu 1400 -> 1450)",
            f"remove 10.244.9.0/26 via 10.244.9.1 dev #{index_before} onlink proto 116 metric 0",
        ]
    )
    assert n1.show("link", "show", "vxlan.tabby").split(":")[0] == index_before  # in place
    ping_all(cluster3)
    assert not n1.reconcile(want, Reconciler())


def test_a_route_deleted_behind_tabbys_back_is_restored(cluster2: list[SimNode]) -> None:
    reconcile_all(cluster2)
    a, b = cluster2
    a.ns.ip("route", "del", "10.244.2.0/26")
    a.ns.ip("-6", "route", "del", "fd00:10:244:2::/122")
    changes = a.reconcile(desired_for(a, [b]))
    assert [str(c) for c in changes.added] == [
        "add 10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby onlink",
        "add fd00:10:244:2::/122 via fd00:10:244:2::1 dev vxlan-v6.tabby onlink",
    ]
    assert len(changes) == 2
    a.pod.ping(b.pod4)
    a.pod.ping(b.pod6)


def test_a_removed_node_loses_its_routes_fdb_and_neighbours(cluster3: list[SimNode]) -> None:
    reconcile_all(cluster3)
    n1, n2, n3 = cluster3
    changes = n1.reconcile(desired_for(n1, [n2]))
    assert changes.ok
    assert not changes.added
    assert changes.counts()["route"]["remove"] == 2
    assert changes.counts()["fdb"]["remove"] == 2
    assert changes.counts()["neighbour"]["remove"] == 2
    assert len(changes) == 6
    assert n1.show("route", "show", "10.244.3.0/26") == ""
    assert n1.show("-6", "route", "show", "fd00:10:244:3::/122") == ""
    assert "10.244.3.1" not in n1.show("neigh", "show", "dev", "vxlan.tabby")
    assert n3.mac(4) not in n1.ns.exec("bridge", "fdb", "show", "dev", "vxlan.tabby").stdout
    assert n3.mac(6) not in n1.ns.exec("bridge", "fdb", "show", "dev", "vxlan-v6.tabby").stdout
    n1.pod.ping(n2.pod4)
    n1.pod.ping(n2.pod6)


def test_foreign_routes_and_entries_are_never_touched(cluster2: list[SimNode]) -> None:
    a, b = cluster2
    # Someone else's route holds the prefix tabby wants for b's IPv4 block, another sits on
    # tabby's device, a third is an unrelated static route; a neighbour on the uplink.
    a.ns.ip(
        "route", "add", "10.244.2.0/26", "via", "192.168.50.2", "dev", "eth0", "proto", "static"
    )
    a.ns.ip(
        "-6",
        "route",
        "add",
        "fd00:10:244:2::/122",
        "via",
        "fd50::2",
        "dev",
        "eth0",
        "proto",
        "static",
    )
    a.ns.ip("route", "add", "10.77.0.0/16", "via", "192.168.50.2", "dev", "eth0")
    a.ns.ip(
        "neigh",
        "add",
        "192.168.50.99",
        "lladdr",
        "02:00:00:00:00:63",
        "dev",
        "eth0",
        "nud",
        "permanent",
    )
    first = a.reconcile(desired_for(a, [b]))
    a.ns.ip("route", "add", "10.55.0.0/24", "dev", "vxlan.tabby")
    a.ns.ip("route", "add", "blackhole", "10.66.0.0/24", "proto", "bird")

    for changes in (first, a.reconcile(desired_for(a, [b]))):
        assert not changes.failures
        assert sorted(c.what for c in changes.conflicts) == [
            "10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby onlink",
            "fd00:10:244:2::/122 via fd00:10:244:2::1 dev vxlan-v6.tabby onlink",
        ]
        reason = next(c.reason for c in changes.conflicts if c.what.startswith("10.244.2.0"))
        assert "10.244.2.0/26 via 192.168.50.2 dev eth0 proto 4" in reason
        assert "not tabby's" in reason
    assert not a.reconcile(desired_for(a, [b]))  # conflicts are no changes

    assert "proto static" in a.show("route", "show", "10.244.2.0/26")
    assert "proto static" in a.show("-6", "route", "show", "fd00:10:244:2::/122")
    assert "10.55.0.0/24 dev vxlan.tabby" in a.show("route", "show", "10.55.0.0/24")
    assert "blackhole 10.66.0.0/24 proto bird" in a.show("route", "show", "10.66.0.0/24")
    assert "10.77.0.0/16 via 192.168.50.2" in a.show("route", "show", "10.77.0.0/16")
    assert "PERMANENT" in a.show("neigh", "show", "192.168.50.99", "dev", "eth0")

    # Removing everything tabby owns still leaves all of it in place.
    gone = a.reconcile(DesiredState())
    assert gone.counts()["device"]["remove"] == 2
    assert gone.counts()["blackhole"]["remove"] == 2
    assert a.show("route", "show", "proto", str(RTPROT_TABBY)) == ""
    assert a.show("-6", "route", "show", "proto", str(RTPROT_TABBY)) == ""
    assert "vxlan" not in a.show("link", "show")
    assert "proto static" in a.show("route", "show", "10.244.2.0/26")
    assert "blackhole 10.66.0.0/24 proto bird" in a.show("route", "show", "10.66.0.0/24")
    assert "10.77.0.0/16 via 192.168.50.2" in a.show("route", "show", "10.77.0.0/16")
    assert "PERMANENT" in a.show("neigh", "show", "192.168.50.99", "dev", "eth0")
    assert not a.reconcile(DesiredState())

    # Once the foreign route is gone, tabby's takes its place.
    a.ns.ip("route", "del", "10.244.2.0/26", "proto", "static")
    again = a.reconcile(desired_for(a, [b]))
    assert len(again.conflicts) == 1
    assert "10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby proto 116 onlink" in a.show(
        "route", "show", "10.244.2.0/26"
    )


def _mac_of(node: SimNode, dev: str) -> str:
    return node.show("link", "show", dev).split("link/ether ")[1].split()[0]


def test_device_attributes_change_in_place_or_by_recreating(cluster2: list[SimNode]) -> None:
    a, b = cluster2
    want = desired_for(a, [b])
    a.ns.ip(
        "link",
        "add",
        "vxlan.tabby",
        "type",
        "vxlan",
        "id",
        "42",
        "dstport",
        "4789",
        "local",
        "192.168.50.1",
    )  # a wrong VNI (and learning on)
    a.ns.ip(
        "link",
        "add",
        "vxlan-v6.tabby",
        "type",
        "vxlan",
        "id",
        "4096",
        "dstport",
        "4789",
        "local",
        "fd50::1",
        "nolearning",
    )  # right, but down, default MTU, random MAC
    a.ns.ip("-6", "addr", "add", "fd00:99::1/128", "dev", "vxlan-v6.tabby", "nodad")
    v6_index = a.show("link", "show", "vxlan-v6.tabby").split(":")[0]
    old_mac = _mac_of(a, "vxlan-v6.tabby")

    changes = a.reconcile(want)
    assert changes.ok
    device = [str(c) for c in changes.applied if c.kind == "device"]
    assert device[0].startswith("replace device vxlan.tabby (vxlan id 4096")
    assert "was VNI 42, want 4096" in device[0]
    assert device[1] == (
        f"replace device vxlan-v6.tabby (mtu 1500 -> 1430, address {old_mac} -> {a.mac(6)}, up)"
    )
    assert "remove address fd00:99::1/128 dev vxlan-v6.tabby" in [str(c) for c in changes.applied]
    assert a.show("link", "show", "vxlan-v6.tabby").split(":")[0] == v6_index
    assert "vxlan id 4096" in a.show("-d", "link", "show", "vxlan.tabby")
    assert "nolearning" in a.show("-d", "link", "show", "vxlan.tabby")
    assert a.mac(6) in a.show("link", "show", "vxlan-v6.tabby")
    assert not a.reconcile(want)
    assert b.reconcile(desired_for(b, [a])).ok
    a.pod.ping(b.pod4)
    a.pod.ping(b.pod6)

    # Learning and the local address change in place too; a new port means a new device.
    a.ns.ip("link", "set", "vxlan.tabby", "type", "vxlan", "learning")
    v4_index = a.show("link", "show", "vxlan.tabby").split(":")[0]
    fixed = a.reconcile(want)
    assert [str(c) for c in fixed.applied] == ["replace device vxlan.tabby (learning off)"]
    a.ns.ip("addr", "add", "192.168.50.101/24", "dev", "eth0")
    assert want.vxlan_v4 is not None
    renumbered = dataclasses.replace(
        want, vxlan_v4=dataclasses.replace(want.vxlan_v4, local=ip("192.168.50.101"))
    )
    local = a.reconcile(renumbered)
    assert [str(c) for c in local.applied] == [
        "replace device vxlan.tabby (local -> 192.168.50.101)"
    ]
    assert "local 192.168.50.101" in a.show("-d", "link", "show", "vxlan.tabby")
    assert a.show("link", "show", "vxlan.tabby").split(":")[0] == v4_index
    assert not a.reconcile(renumbered)

    moved = dataclasses.replace(want, vxlan_v4=dataclasses.replace(want.vxlan_v4, port=8472))
    recreated = a.reconcile(moved)
    assert recreated.ok
    assert recreated.count("replace", "device") == 1
    assert a.show("link", "show", "vxlan.tabby").split(":")[0] != v4_index
    # What hung off the old device went with it and is back.
    assert recreated.count("add", "address") == 1
    assert recreated.count("add", "route") == 1
    assert recreated.count("add", "fdb") == 1
    assert recreated.count("add", "neighbour") == 1
    assert "dstport 8472" in a.show("-d", "link", "show", "vxlan.tabby")
    assert not a.reconcile(moved)


def test_a_device_that_is_not_tabbys_is_a_conflict_and_left_alone(
    cluster2: list[SimNode],
) -> None:
    a, b = cluster2
    a.ns.ip("link", "add", "vxlan.tabby", "type", "bridge")
    changes = a.reconcile(desired_for(a, [b]))
    assert [(c.kind, c.what) for c in changes.conflicts] == [("device", "vxlan.tabby")]
    assert "bridge" in changes.conflicts[0].reason
    # Its routes cannot be placed; IPv6 is reconciled all the same.
    assert {f.what for f in changes.failures} == {
        "10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby onlink"
    }
    assert changes.count("add", "device") == 1
    assert "bridge" in a.show("-d", "link", "show", "vxlan.tabby")
    # Not wanted any more: still not tabby's to delete.
    gone = a.reconcile(DesiredState())
    assert [c.what for c in gone.applied if c.kind == "device"] == [
        "device vxlan-v6.tabby (not wanted any more)"
    ]
    assert "bridge" in a.show("-d", "link", "show", "vxlan.tabby")


def test_ipip_unavailable_is_a_clear_failure_and_the_rest_is_reconciled(
    cluster2: list[SimNode],
) -> None:
    a, b = cluster2
    base = desired_for(a, [b])
    want = dataclasses.replace(
        base,
        ipip=IpipDevice(1480, ipaddress.IPv4Address("10.244.1.2")),
        routes=base.routes | {OverlayRoute.via("10.244.7.0/26", "192.168.50.2", "tunl0")},
    )
    changes = a.reconcile(want)
    reasons = {f.what: f.reason for f in changes.failures}
    assert "no ipip support" in reasons["tunl0"]
    assert (
        reasons["10.244.7.0/26 via 192.168.50.2 dev tunl0 onlink"] == "device tunl0 does not exist"
    )
    assert changes.count("add", "route") == 2
    assert "tunl0" not in a.show("link", "show")
    assert b.reconcile(desired_for(b, [a])).ok
    a.pod.ping(b.pod4)


# --- node facts -----------------------------------------------------------------------------


@pytest.fixture
def busy_node(netns_pool: NetnsPool) -> Node:
    """A node with the interfaces that fool naive autodetection, in index order: container
    bridges and veths, a pod veth, a VXLAN device, a down NIC, then eth0 (MTU 1400) and eth1
    (MTU 9000), each with global addresses."""
    node = netns_pool.node()

    def veth(name: str, peer: str, *addrs: str, mtu: int = 1500, up: bool = True) -> None:
        node.ip("link", "add", name, "mtu", str(mtu), "type", "veth", "peer", "name", peer)
        for a in addrs:
            node.ip("addr", "add", a, "dev", name, *(["nodad"] if ":" in a else []))
        if up:
            node.ip("link", "set", name, "up")
            node.ip("link", "set", peer, "up")

    for name, v4, v6 in (
        ("docker0", "172.17.0.1/16", "fd17::1/64"),
        ("br-1a2b3c", "172.18.0.1/16", "fd18::1/64"),
    ):
        node.ip("link", "add", name, "type", "bridge")
        node.ip("addr", "add", v4, "dev", name)
        node.ip("-6", "addr", "add", v6, "dev", name, "nodad")
        node.ip("link", "set", name, "up")
    veth("veth1234", "peer1234", "10.1.1.1/24", "fd11::1/64")
    veth("cali0123456789a", "calipeer", "10.1.2.1/24")
    node.ip("link", "add", "vxlan.calico", "type", "vxlan", "id", "4096", "dstport", "4789")
    node.ip("addr", "add", "10.1.3.1/32", "dev", "vxlan.calico")
    node.ip("link", "set", "vxlan.calico", "up")
    veth("nic9", "nic9p", "10.1.4.1/24", "fd14::1/64", up=False)
    veth("eth0", "eth0p", "192.168.60.10/24", "fd60::10/64", mtu=1400)
    veth("eth1", "eth1p", "192.168.61.10/24", "fd61::10/64", mtu=9000)
    return node


def test_first_found_skips_excluded_and_down_interfaces(busy_node: Node) -> None:
    v4 = busy_node.run(nodeinfo.detect_address, "first-found", 4)
    assert v4 == nodeinfo.NodeAddress(ip("192.168.60.10"), 24, "eth0")
    assert str(v4) == "192.168.60.10/24"
    assert v4.network == net("192.168.60.0/24")
    v6 = busy_node.run(nodeinfo.detect_address, "first-found", 6)
    assert v6 == nodeinfo.NodeAddress(ip("fd60::10"), 64, "eth0")
    skip = busy_node.run(nodeinfo.detect_address, "skip-interface=eth0", 4)
    assert skip.interface == "eth1"
    cidr = busy_node.run(nodeinfo.detect_address, "cidr=192.168.61.0/24", 4)
    assert (cidr.address, cidr.interface) == (ip("192.168.61.10"), "eth1")


def test_interface_regex_matches_whole_names_without_exclusions(busy_node: Node) -> None:
    detect = nodeinfo.detect_address
    assert busy_node.run(detect, "interface=eth1", 4).address == ip("192.168.61.10")
    assert busy_node.run(detect, "interface=eth.*", 6).address == ip("fd60::10")
    assert busy_node.run(detect, "interface=nomatch,veth.*", 4).address == ip("10.1.1.1")
    with pytest.raises(nodeinfo.AutodetectError, match="matching eth"):
        busy_node.run(detect, "interface=eth", 4)  # a whole-name match: not eth0
    with pytest.raises(ValueError, match="bad regular expression"):
        busy_node.run(detect, "interface=(", 4)


def test_can_reach_and_explicit_addresses(busy_node: Node) -> None:
    detect = nodeinfo.detect_address
    assert busy_node.run(detect, "can-reach=192.168.61.99", 4) == nodeinfo.NodeAddress(
        ip("192.168.61.10"), 24, "eth1"
    )
    assert busy_node.run(detect, "can-reach=fd61::99", 6) == nodeinfo.NodeAddress(
        ip("fd61::10"), 64, "eth1"
    )
    with pytest.raises(nodeinfo.AutodetectError, match="no route"):
        busy_node.run(detect, "can-reach=203.0.113.1", 4)  # no default route here
    assert busy_node.run(detect, "192.168.61.10", 4) == nodeinfo.NodeAddress(
        ip("192.168.61.10"), 24, "eth1"
    )
    assert busy_node.run(detect, "10.9.9.9/16", 4) == nodeinfo.NodeAddress(ip("10.9.9.9"), 16, None)
    with pytest.raises(ValueError, match="not an IPv6 address"):
        busy_node.run(detect, "10.9.9.9", 6)


def test_uplink_mtu_is_the_smallest_of_the_interfaces_carrying_node_addresses(
    busy_node: Node,
) -> None:
    eth0 = nodeinfo.NodeAddress(ip("192.168.60.10"), 24, "eth0")
    eth1 = nodeinfo.NodeAddress(ip("fd61::10"), 64, "eth1")
    assert busy_node.run(nodeinfo.uplink_mtu, [eth1]) == 9000
    assert busy_node.run(nodeinfo.uplink_mtu, [eth0, eth1]) == 1400
    # No address on an interface: the smallest up, non-excluded uplink with an address
    # (docker0 and the others do not count, nic9 is down).
    assert busy_node.run(nodeinfo.uplink_mtu, []) == 1400
    busy_node.ip("link", "set", "eth1", "mtu", "1300")
    assert busy_node.run(nodeinfo.uplink_mtu, [eth1]) == 1300


def test_ipip_detection_says_unavailable_and_leaves_nothing_behind(node: Node) -> None:
    before = node.links()
    support = node.run(nodeinfo.ipip_support)
    assert not support.available
    assert "no ipip support" in support.reason
    assert "Unknown device type" in support.reason
    assert not support.tunl0
    assert node.links() == before

    # The same probe on a kind this kernel has says yes, and creates nothing either.
    from dataplane.rtnl_routing import RoutingRtnl

    def probe() -> tuple[bool, str]:
        with RoutingRtnl.here() as nl:
            return nl.link_kind_supported("vxlan", "tbyprobe0")

    supported, answer = node.run(probe)
    assert supported
    assert "VXLAN ID" in answer
    assert node.links() == before
