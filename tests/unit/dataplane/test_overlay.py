"""The node agent's routing without a kernel: desired-state validation, the diff (plan_*),
a whole reconcile run against an in-memory kernel (IP-in-IP included, which this machine's
kernel cannot do), the netlink requests as encoded, and the pure node-fact helpers.

The privileged tier (tests/privileged/test_overlay.py) runs the same code against the real
kernel, with traffic.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import struct
from typing import Any

import pytest
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg
from pyroute2.netlink.rtnl.ndmsg import ndmsg
from pyroute2.netlink.rtnl.rtmsg import rtmsg

from dataplane import nodeinfo, overlay
from dataplane.overlay import Changes, Reconciler
from dataplane.overlay_model import (
    NUD_PERMANENT,
    RTN_BLACKHOLE,
    RTN_UNICAST,
    RTPROT_TABBY,
    VXLAN_V4_DEVICE,
    VXLAN_V6_DEVICE,
    DesiredState,
    FdbEntry,
    IpipDevice,
    KernelAddress,
    KernelFdb,
    KernelNeighbour,
    KernelRoute,
    LinkState,
    NeighbourEntry,
    OverlayRoute,
    VxlanAttrs,
    VxlanDevice,
    vxlan_peer,
)
from dataplane.rtnl_routing import RoutingRtnl
from tests.unit.fake_kernel import FakeKernel

ip = ipaddress.ip_address
net = ipaddress.ip_network
MAC_A = "02:aa:00:00:00:01"
MAC_B = "02:bb:00:00:00:02"
MAC_C = "02:cc:00:00:00:03"


def vx4(**kw: Any) -> VxlanDevice:
    args: dict[str, Any] = {"local": ip("192.168.50.1"), "mac": MAC_A, "mtu": 1450}
    args.update(kw)
    return VxlanDevice(**args)


def vx6(**kw: Any) -> VxlanDevice:
    args: dict[str, Any] = {"local": ip("fd50::1"), "mac": MAC_A, "mtu": 1430}
    args.update(kw)
    return VxlanDevice(**args)


# --- desired state ------------------------------------------------------------------------


def test_device_names_follow_the_family_and_macs_are_normalised() -> None:
    assert vx4().name == VXLAN_V4_DEVICE == "vxlan.tabby"
    assert vx6().name == VXLAN_V6_DEVICE == "vxlan-v6.tabby"
    assert (vx4().vni, vx4().port, vx4().learning) == (4096, 4789, False)
    assert vx4(mac="02:AA:00:00:00:01").mac == MAC_A
    assert FdbEntry(VXLAN_V4_DEVICE, " 02:BB:00:00:00:02", ip("1.2.3.4")).mac == MAC_B


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"mac": "01:00:5e:00:00:01"}, "not a unicast"),
        ({"mac": "00:00:00:00:00:00"}, "all-zero"),
        ({"mac": "02:aa:00:00:00"}, "not a MAC"),
        ({"mtu": 67}, "MTU 67"),
        ({"vni": 1 << 24}, "VNI"),
        ({"port": 0}, "port"),
        ({"address": ip("fd00::1")}, "tunnel address"),
    ],
)
def test_bad_devices_are_refused(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        vx4(**kw)


def test_ipv6_device_needs_an_ipv6_mtu() -> None:
    with pytest.raises(ValueError, match="MTU 1200"):
        vx6(mtu=1200)


def test_desired_state_is_validated_as_a_whole() -> None:
    fdb = FdbEntry(VXLAN_V4_DEVICE, MAC_B, ip("192.168.50.2"))
    with pytest.raises(ValueError, match="not one of the desired VXLAN devices"):
        DesiredState(fdb=frozenset({fdb}))
    with pytest.raises(ValueError, match="wrong family"):
        DesiredState(vxlan_v4=vx4(), fdb=frozenset({dataclasses.replace(fdb, dst=ip("fd::2"))}))
    with pytest.raises(ValueError, match="one MAC, two destinations"):
        DesiredState(
            vxlan_v4=vx4(),
            fdb=frozenset({fdb, dataclasses.replace(fdb, dst=ip("192.168.50.3"))}),
        )
    neigh = NeighbourEntry(VXLAN_V4_DEVICE, ip("10.244.2.1"), MAC_B)
    with pytest.raises(ValueError, match="one address, two MACs"):
        DesiredState(
            vxlan_v4=vx4(), neighbours=frozenset({neigh, dataclasses.replace(neigh, mac=MAC_C)})
        )
    with pytest.raises(ValueError, match=r"two routes for 10\.244\.2\.0/26"):
        DesiredState(
            routes=frozenset(
                {
                    OverlayRoute.blackhole("10.244.2.0/26"),
                    OverlayRoute.via("10.244.2.0/26", "10.244.2.1", VXLAN_V4_DEVICE),
                }
            )
        )
    with pytest.raises(ValueError, match="IPv4 underlay"):
        DesiredState(vxlan_v4=vx6())


def test_routes_and_their_text() -> None:
    route = OverlayRoute.via("10.244.2.7/26", "10.244.2.1", VXLAN_V4_DEVICE)
    assert route.dst == net("10.244.2.0/26")  # host bits dropped
    assert str(route) == "10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby onlink"
    assert str(OverlayRoute.blackhole("fd00::/122")) == "blackhole fd00::/122"
    assert (
        str(OverlayRoute.via("10.0.0.0/8", "192.168.50.2", "eth0", onlink=False))
        == "10.0.0.0/8 via 192.168.50.2 dev eth0"
    )
    with pytest.raises(ValueError, match="another family"):
        OverlayRoute.via("10.0.0.0/8", "fd00::1", "eth0")
    with pytest.raises(ValueError, match="needs a gateway"):
        OverlayRoute(net("10.0.0.0/8"))


def test_vxlan_peer_bundles_one_remote_node() -> None:
    peer = vxlan_peer(
        VXLAN_V4_DEVICE,
        node_ip=ip("192.168.50.2"),
        tunnel_ip=ip("10.244.2.1"),
        mac=MAC_B,
        prefixes=[net("10.244.2.0/26"), net("10.244.9.7/32")],
    )
    assert peer.fdb == FdbEntry(VXLAN_V4_DEVICE, MAC_B, ip("192.168.50.2"))
    assert peer.neighbour == NeighbourEntry(VXLAN_V4_DEVICE, ip("10.244.2.1"), MAC_B)
    assert [str(r) for r in peer.routes] == [
        "10.244.2.0/26 via 10.244.2.1 dev vxlan.tabby onlink",
        "10.244.9.7/32 via 10.244.2.1 dev vxlan.tabby onlink",
    ]


# --- planning: devices and addresses ------------------------------------------------------


def link(
    name: str = VXLAN_V4_DEVICE,
    *,
    kind: str | None = "vxlan",
    mac: str = MAC_A,
    mtu: int = 1450,
    up: bool = True,
    vni: int = 4096,
    port: int = 4789,
    local: str = "192.168.50.1",
    learning: bool = False,
    index: int = 7,
) -> LinkState:
    attrs = VxlanAttrs(vni, port, ip(local), learning) if kind == "vxlan" else None
    return LinkState(index, name, kind, mac, mtu, up, attrs)


def test_device_plan_keeps_a_matching_device() -> None:
    plan = overlay.plan_vxlan_device(VXLAN_V4_DEVICE, vx4(), link())
    assert plan.action == "keep"
    assert not plan.in_place


def test_device_plan_changes_mtu_mac_up_local_and_learning_in_place() -> None:
    have = link(mac=MAC_B, mtu=1500, up=False, local="192.168.50.9", learning=True)
    plan = overlay.plan_vxlan_device(VXLAN_V4_DEVICE, vx4(), have)
    assert plan.action == "keep"
    assert plan.in_place
    assert (plan.mtu, plan.mac, plan.set_up) == (1450, MAC_A, True)
    assert (plan.vxlan_local, plan.vxlan_learning) == (ip("192.168.50.1"), False)


@pytest.mark.parametrize(
    ("have", "reason"),
    [
        (link(vni=42), "VNI 42, want 4096"),
        (link(port=8472), "port 8472, want 4789"),
        (link(local="fd50::1"), "local address fd50::1"),
        (LinkState(7, VXLAN_V4_DEVICE, "vxlan", MAC_A, 1450, True, None), "unreadable"),
    ],
)
def test_device_plan_recreates_what_the_kernel_cannot_change(have: LinkState, reason: str) -> None:
    plan = overlay.plan_vxlan_device(VXLAN_V4_DEVICE, vx4(), have)
    assert plan.action == "recreate"
    assert reason in plan.reason


def test_device_plan_create_delete_and_foreign_devices() -> None:
    assert overlay.plan_vxlan_device(VXLAN_V4_DEVICE, vx4(), None).action == "create"
    assert overlay.plan_vxlan_device(VXLAN_V4_DEVICE, None, link()).action == "delete"
    assert overlay.plan_vxlan_device(VXLAN_V4_DEVICE, None, None).action == "keep"
    bridge = link(kind="bridge")
    conflict = overlay.plan_vxlan_device(VXLAN_V4_DEVICE, vx4(), bridge)
    assert conflict.action == "conflict"
    assert "a bridge device named vxlan.tabby exists" in conflict.reason
    # Not wanted and not a VXLAN device: not tabby's, so not deleted either.
    assert overlay.plan_vxlan_device(VXLAN_V4_DEVICE, None, bridge).action == "keep"


def test_ipip_plan_never_deletes_tunl0() -> None:
    tunl = link("tunl0", kind="ipip", mtu=1480)
    assert overlay.plan_ipip_device(None, tunl).action == "keep"
    assert overlay.plan_ipip_device(IpipDevice(1480), None).action == "create"
    plan = overlay.plan_ipip_device(IpipDevice(1440), dataclasses.replace(tunl, up=False))
    assert (plan.action, plan.mtu, plan.set_up) == ("keep", 1440, True)
    assert overlay.plan_ipip_device(IpipDevice(1480), link("tunl0", kind="gre")).action == (
        "conflict"
    )


def addr(a: str, plen: int, *, scope: int = 0, index: int = 7) -> KernelAddress:
    return KernelAddress(index, ip(a), plen, scope, 0)


def test_address_plan_wants_exactly_the_tunnel_address() -> None:
    have = [
        addr("10.244.1.1", 24),  # right address, wrong prefix length
        addr("10.9.9.9", 32),  # someone's extra address
        addr("fe80::1", 64, scope=253),  # the kernel's link-local: never touched
        addr("fd00::1", 128),  # the other family: not this plan's business
    ]
    add, remove = overlay.plan_addresses(ip("10.244.1.1"), have, version=4)
    assert add == [(ip("10.244.1.1"), 32)]
    assert [(a.address, a.prefixlen) for a in remove] == [
        (ip("10.244.1.1"), 24),
        (ip("10.9.9.9"), 32),
    ]
    assert overlay.plan_addresses(ip("10.244.1.1"), [addr("10.244.1.1", 32)], version=4) == (
        [],
        [],
    )
    add6, remove6 = overlay.plan_addresses(None, have, version=6)
    assert add6 == []
    assert [a.address for a in remove6] == [ip("fd00::1")]


# --- planning: neighbours and FDB ---------------------------------------------------------


def test_neighbour_plan() -> None:
    want = [
        NeighbourEntry(VXLAN_V4_DEVICE, ip("10.244.2.1"), MAC_B),  # present and right
        NeighbourEntry(VXLAN_V4_DEVICE, ip("10.244.3.1"), MAC_C),  # present, old MAC
        NeighbourEntry(VXLAN_V4_DEVICE, ip("10.244.4.1"), MAC_C),  # only a kernel entry
        NeighbourEntry(VXLAN_V4_DEVICE, ip("10.244.5.1"), MAC_C),  # missing
    ]
    have = [
        KernelNeighbour(7, ip("10.244.2.1"), MAC_B, NUD_PERMANENT),
        KernelNeighbour(7, ip("10.244.3.1"), MAC_B, NUD_PERMANENT),
        KernelNeighbour(7, ip("10.244.4.1"), None, 0x20),  # FAILED
        KernelNeighbour(7, ip("10.244.9.1"), MAC_B, NUD_PERMANENT),  # a deleted node
        KernelNeighbour(7, ip("10.244.8.8"), MAC_B, 0x02),  # REACHABLE: the kernel's
    ]
    to_set, remove = overlay.plan_neighbours(want, have)
    assert [(str(n.address), replaces) for n, replaces in to_set] == [
        ("10.244.3.1", True),
        ("10.244.4.1", False),
        ("10.244.5.1", False),
    ]
    assert [n.address for n in remove] == [ip("10.244.9.1")]


def fdb(mac: str, dst: str, **kw: Any) -> KernelFdb:
    return KernelFdb(7, mac, ip(dst), kw.pop("state", NUD_PERMANENT), **kw)


def test_fdb_plan_one_destination_per_mac() -> None:
    want = [
        FdbEntry(VXLAN_V4_DEVICE, MAC_A, ip("192.168.50.1")),  # exact, plus a second remote
        FdbEntry(VXLAN_V4_DEVICE, MAC_B, ip("192.168.50.2")),  # node moved: re-point
        FdbEntry(VXLAN_V4_DEVICE, MAC_C, ip("192.168.50.3")),  # missing
    ]
    have = [
        fdb(MAC_A, "192.168.50.9"),
        fdb(MAC_A, "192.168.50.1"),
        fdb(MAC_B, "192.168.50.20"),
        fdb(MAC_B, "192.168.50.21"),
        fdb("02:dd:00:00:00:04", "192.168.50.4"),  # a deleted node
        fdb("02:ee:00:00:00:05", "192.168.50.5", state=0x02),  # learned: not tabby's
    ]
    to_set, remove = overlay.plan_fdb(want, have)
    assert [(e.mac, str(e.dst), replaces) for e, replaces in to_set] == [
        (MAC_B, "192.168.50.2", True),
        (MAC_C, "192.168.50.3", False),
    ]
    assert [(e.mac, str(e.dst)) for e in remove] == [
        (MAC_A, "192.168.50.9"),
        (MAC_B, "192.168.50.21"),
        ("02:dd:00:00:00:04", "192.168.50.4"),
    ]


def test_fdb_entry_with_another_port_is_not_ours_as_is() -> None:
    want = [FdbEntry(VXLAN_V4_DEVICE, MAC_B, ip("192.168.50.2"))]
    to_set, remove = overlay.plan_fdb(want, [fdb(MAC_B, "192.168.50.2", port=5555)])
    assert [replaces for _, replaces in to_set] == [True]
    assert remove == []


# --- planning: routes ---------------------------------------------------------------------


def kroute(dst: str, gw: str | None = None, oif: int | None = 7, **kw: Any) -> KernelRoute:
    network = net(dst)
    return KernelRoute(
        dst=network,
        type=kw.pop("type", RTN_UNICAST),
        proto=RTPROT_TABBY,
        gw=ip(gw) if gw else None,
        oif=oif,
        onlink=kw.pop("onlink", True),
        metric=kw.pop("metric", 0 if network.version == 4 else 1024),
        **kw,
    )


INDEX = {VXLAN_V4_DEVICE: 7, VXLAN_V6_DEVICE: 8, "eth0": 2, "tunl0": None}


def test_route_plan_keeps_matching_routes() -> None:
    want = [
        OverlayRoute.via("10.244.2.0/26", "10.244.2.1", VXLAN_V4_DEVICE),
        OverlayRoute.via("fd00:2::/122", "fd00:2::1", VXLAN_V6_DEVICE),
        OverlayRoute.blackhole("10.244.1.0/26"),
        OverlayRoute.blackhole("fd00:1::/122"),
    ]
    have = [
        kroute("10.244.2.0/26", "10.244.2.1"),
        kroute("fd00:2::/122", "fd00:2::1", oif=8),
        kroute("10.244.1.0/26", None, None, type=RTN_BLACKHOLE, onlink=False),
        kroute("fd00:1::/122", None, 1, type=RTN_BLACKHOLE, onlink=False),  # IPv6: dev lo
    ]
    assert overlay.plan_routes(want, have, INDEX) == overlay.RoutePlan()


def test_route_plan_replaces_what_differs() -> None:
    want = [
        OverlayRoute.via("10.244.2.0/26", "10.244.2.1", VXLAN_V4_DEVICE),  # gateway
        OverlayRoute.via("10.244.3.0/26", "192.168.50.3", "eth0"),  # device (CrossSubnet)
        OverlayRoute.via("10.244.4.0/26", "10.244.4.1", VXLAN_V4_DEVICE),  # onlink flag
        OverlayRoute.blackhole("10.244.5.0/26"),  # the block became ours
        OverlayRoute.via("10.244.6.0/26", "10.244.6.1", VXLAN_V4_DEVICE),  # multipath
    ]
    have = [
        kroute("10.244.2.0/26", "10.244.2.9"),
        kroute("10.244.3.0/26", "10.244.3.1"),
        kroute("10.244.4.0/26", "10.244.4.1", onlink=False),
        kroute("10.244.5.0/26", "10.244.5.1"),
        kroute("10.244.6.0/26", None, None, multipath=True),
    ]
    plan = overlay.plan_routes(want, have, INDEX)
    assert [(str(r.dst), oif) for r, oif, _ in plan.replace] == [
        ("10.244.2.0/26", 7),
        ("10.244.3.0/26", 2),
        ("10.244.4.0/26", 7),
        ("10.244.5.0/26", None),
        ("10.244.6.0/26", 7),
    ]
    assert not plan.add
    assert not plan.remove


def test_route_plan_adds_missing_and_removes_stale_routes() -> None:
    want = [
        OverlayRoute.via("10.244.2.0/26", "10.244.2.1", VXLAN_V4_DEVICE),
        OverlayRoute.via("10.244.3.0/26", "10.244.3.1", VXLAN_V4_DEVICE),
    ]
    have = [
        kroute("10.244.2.0/26", "10.244.2.1"),
        kroute("10.244.2.0/26", "10.244.2.1", metric=100),  # a duplicate at another metric
        kroute("10.244.9.0/26", "10.244.9.1"),  # a deleted node's block
        kroute("fd00:9::/122", "fd00:9::1", oif=8),
    ]
    plan = overlay.plan_routes(want, have, INDEX)
    assert [(str(r.dst), oif) for r, oif in plan.add] == [("10.244.3.0/26", 7)]
    assert [(str(r.dst), r.metric) for r in plan.remove] == [
        ("10.244.2.0/26", 100),
        ("10.244.9.0/26", 0),
        ("fd00:9::/122", 1024),
    ]


def test_route_plan_leaves_routes_through_a_missing_device_alone() -> None:
    want = [
        OverlayRoute.via("10.244.7.0/26", "192.168.50.7", "tunl0"),
        OverlayRoute.via("10.244.8.0/26", "192.168.50.8", "nosuch0"),
    ]
    have = [kroute("10.244.7.0/26", "192.168.50.7", oif=2)]  # the old direct route
    plan = overlay.plan_routes(want, have, INDEX)
    assert [(str(r.dst), why) for r, why in plan.unresolved] == [
        ("10.244.7.0/26", "device tunl0 does not exist"),
        ("10.244.8.0/26", "device nosuch0 does not exist"),
    ]
    assert not plan.remove
    assert not plan.add


# --- a whole run against an in-memory kernel (tests/unit/fake_kernel.py) -------------------


def ipip_state() -> DesiredState:
    return DesiredState(
        ipip=IpipDevice(1480, ipaddress.IPv4Address("10.244.1.2")),
        routes=frozenset(
            {
                OverlayRoute.via("10.244.2.0/26", "192.168.50.2", "tunl0"),
                OverlayRoute.blackhole("10.244.1.0/26"),
            }
        ),
    )


def test_ipip_run_creates_tunl0_with_its_address_and_routes() -> None:
    kernel = FakeKernel(ipip=True)
    reconciler = Reconciler(netlink=kernel)  # type: ignore[arg-type]
    changes = reconciler.reconcile(ipip_state())
    assert changes.ok
    assert kernel.writes == [
        "create ipip tunl0 mtu 1480",
        "add address 10.244.1.2/32 dev tunl0",
        "add route blackhole 10.244.1.0/26 proto 116",
        "add route 10.244.2.0/26 via 192.168.50.2 dev tunl0 onlink proto 116",
    ]
    route = kernel.routes[(net("10.244.2.0/26"), 0)]
    assert (route.oif, route.onlink, route.gw) == (
        kernel.links["tunl0"].index,
        True,
        ip("192.168.50.2"),
    )
    assert not Reconciler(netlink=kernel).reconcile(ipip_state())  # type: ignore[arg-type]

    # The MTU changes in place; switching IP-in-IP off leaves tunl0 (the kernel's) alone
    # but takes tabby's routes through it away.
    smaller = dataclasses.replace(ipip_state(), ipip=IpipDevice(1440, ip("10.244.1.2")))  # type: ignore[arg-type]
    assert [str(c) for c in reconciler.reconcile(smaller).applied] == [
        "replace device tunl0 (mtu 1480 -> 1440)"
    ]
    off = reconciler.reconcile(DesiredState())
    assert off.counts()["route"]["remove"] == 1
    assert off.counts()["blackhole"]["remove"] == 1
    assert off.counts()["device"]["remove"] == 0
    assert "tunl0" in kernel.links


def test_ipip_unavailable_is_reported_once_and_other_routes_still_go_in(
    caplog: pytest.LogCaptureFixture,
) -> None:
    kernel = FakeKernel(ipip=False)
    reconciler = Reconciler(netlink=kernel)  # type: ignore[arg-type]
    for _ in range(3):
        changes = reconciler.reconcile(ipip_state())
    assert {(f.what, f.reason) for f in changes.failures} == {
        ("tunl0", "IP-in-IP is unavailable: this kernel has no ipip support"),
        ("10.244.2.0/26 via 192.168.50.2 dev tunl0 onlink", "device tunl0 does not exist"),
    }
    assert (net("10.244.1.0/26"), 0) in kernel.routes
    warnings = [r for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 2  # once per problem, not once per run


def test_conflicting_foreign_route_is_reported_with_what_holds_the_prefix() -> None:
    kernel = FakeKernel()
    foreign = KernelRoute(net("10.244.1.0/26"), RTN_UNICAST, 4, ip("192.168.50.9"), 2, False, 0)
    kernel.routes[(foreign.dst, 0)] = foreign
    changes = Reconciler(netlink=kernel).reconcile(  # type: ignore[arg-type]
        DesiredState(routes=frozenset({OverlayRoute.blackhole("10.244.1.0/26")}))
    )
    assert not changes
    assert [(c.kind, c.what) for c in changes.conflicts] == [
        ("blackhole", "blackhole 10.244.1.0/26")
    ]
    assert changes.conflicts[0].reason == (
        "the kernel has 10.244.1.0/26 via 192.168.50.9 dev eth0 proto 4 metric 0 "
        "(not tabby's): left alone"
    )
    assert kernel.routes[(foreign.dst, 0)] is foreign


def test_vxlan_run_in_memory_and_a_removed_peer() -> None:
    kernel = FakeKernel()
    peer = vxlan_peer(
        VXLAN_V4_DEVICE,
        node_ip=ip("192.168.50.2"),
        tunnel_ip=ip("10.244.2.1"),
        mac=MAC_B,
        prefixes=[net("10.244.2.0/26")],
    )
    state = DesiredState(
        vxlan_v4=vx4(address=ip("10.244.1.1")),
        fdb=frozenset({peer.fdb}),
        neighbours=frozenset({peer.neighbour}),
        routes=frozenset(peer.routes),
    )
    first = Reconciler(netlink=kernel).reconcile(state)  # type: ignore[arg-type]
    assert first.summary() == "add 1 address, add 1 device, add 1 fdb, add 1 neighbour, add 1 route"
    assert not Reconciler(netlink=kernel).reconcile(state)  # type: ignore[arg-type]
    alone = dataclasses.replace(state, fdb=frozenset(), neighbours=frozenset(), routes=frozenset())
    gone = Reconciler(netlink=kernel).reconcile(alone)  # type: ignore[arg-type]
    assert sorted((c.action, c.kind) for c in gone.applied) == [
        ("remove", "fdb"),
        ("remove", "neighbour"),
        ("remove", "route"),
    ]


def test_a_foreign_tunl0_is_a_conflict_and_no_route_goes_through_it() -> None:
    kernel = FakeKernel()
    kernel.links["tunl0"] = LinkState(5, "tunl0", "gre", None, 1476, True)
    changes = Reconciler(netlink=kernel).reconcile(ipip_state())  # type: ignore[arg-type]
    assert [(c.what, c.reason) for c in changes.conflicts] == [
        ("tunl0", "a gre device named tunl0 exists (not ipip)")
    ]
    assert [f.reason for f in changes.failures] == ["device tunl0 does not exist"]
    assert kernel.writes == ["add route blackhole 10.244.1.0/26 proto 116"]


def test_vxlan_attributes_the_kernel_will_not_change_mean_a_new_device() -> None:
    for refuse in (False, True):
        kernel = FakeKernel(refuse_vxlan_change=refuse)
        reconciler = Reconciler(netlink=kernel)  # type: ignore[arg-type]
        reconciler.reconcile(DesiredState(vxlan_v4=vx4()))
        before = kernel.links[VXLAN_V4_DEVICE].index
        changes = reconciler.reconcile(DesiredState(vxlan_v4=vx4(local=ip("192.168.50.7"))))
        assert changes.ok
        after = kernel.links[VXLAN_V4_DEVICE]
        assert after.vxlan is not None
        assert after.vxlan.local == ip("192.168.50.7")
        if refuse:
            assert (after.index != before, changes.count("replace", "device")) == (True, 1)
            assert "refused to change it in place" in changes.applied[0].what
        else:
            assert after.index == before
            assert [str(c) for c in changes.applied] == [
                "replace device vxlan.tabby (local -> 192.168.50.7)"
            ]


def test_changes_counts_every_kind_and_action() -> None:
    changes = Changes(
        applied=(
            overlay.Change("add", "route", "a"),
            overlay.Change("add", "route", "b"),
            overlay.Change("remove", "fdb", "c"),
        ),
        conflicts=(overlay.Problem("route", "d", "why"),),
    )
    counts = changes.counts()
    assert set(counts) == {"device", "address", "fdb", "neighbour", "route", "blackhole"}
    assert counts["route"] == {"add": 2, "replace": 0, "remove": 0}
    assert counts["fdb"]["remove"] == 1
    assert changes.count("add") == 2
    assert changes.count(kind="fdb") == 1
    assert len(changes.added) == 2
    assert bool(changes)
    assert not changes.ok
    assert changes.summary() == "add 2 route, remove 1 fdb, 1 conflicts"
    assert not Changes()
    assert Changes().summary() == "no change"


# --- the netlink requests as encoded ------------------------------------------------------

HDR = struct.Struct("=IHHII")


class AckingSocket:
    """Acknowledges every request (or answers a dump with DONE) and keeps what was sent;
    with ``err``, refuses every request with that errno instead."""

    def __init__(self, err: int = 0) -> None:
        self.err = err
        self.sent: list[bytes] = []
        self.queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        _len, _type, flags, seq, _pid = HDR.unpack_from(data)
        kind = 3 if flags & 0x300 == 0x300 and not self.err else 2  # NLMSG_DONE / _ERROR
        self.queue.append(HDR.pack(20, kind, 0, seq, 0) + struct.pack("=i", -self.err))
        return len(data)

    def recv(self, size: int) -> bytes:
        return self.queue.pop(0)

    def close(self) -> None:
        pass


def sent(sock: AckingSocket, cls: Any) -> tuple[int, int, Any]:
    data = sock.sent[-1]
    _len, mtype, flags, _seq, _pid = HDR.unpack_from(data)
    msg = cls(data)
    msg.decode()
    return mtype, flags, msg


def fake_rtnl(err: int = 0) -> tuple[RoutingRtnl, AckingSocket]:
    sock = AckingSocket(err)
    return RoutingRtnl(sock, "test"), sock  # type: ignore[arg-type]


def test_route_requests_carry_tabbys_protocol_and_onlink() -> None:
    nl, sock = fake_rtnl()
    nl.write_route(
        net("10.244.2.0/26"),
        proto=RTPROT_TABBY,
        blackhole=False,
        gw=ip("192.168.50.2"),
        oif=9,
        onlink=True,
    )
    mtype, flags, msg = sent(sock, rtmsg)
    assert mtype == 24  # RTM_NEWROUTE
    assert flags & 0x600 == 0x600  # NLM_F_CREATE | NLM_F_EXCL: never silently over another
    assert (msg["proto"], msg["type"], msg["table"], msg["flags"]) == (116, 1, 254, 4)
    assert (msg.get("dst"), msg["dst_len"], msg.get("gateway"), msg.get("oif")) == (
        "10.244.2.0",
        26,
        "192.168.50.2",
        9,
    )

    nl.write_route(net("fd00::/122"), proto=RTPROT_TABBY, blackhole=True, replace=True)
    mtype, flags, msg = sent(sock, rtmsg)
    assert flags & 0x500 == 0x500  # NLM_F_CREATE | NLM_F_REPLACE
    assert (msg["type"], msg.get("oif"), msg.get("gateway")) == (6, None, None)

    nl.delete_kernel_route(KernelRoute(net("10.244.9.0/26"), 1, 116, ip("10.244.9.1"), 7, True, 0))
    mtype, _flags, msg = sent(sock, rtmsg)
    assert mtype == 25  # RTM_DELROUTE: only a route of this protocol can match
    assert (msg["proto"], msg.get("priority"), msg.get("oif")) == (116, 0, 7)


def test_route_dump_is_filtered_by_protocol_and_table_in_the_kernel() -> None:
    nl, sock = fake_rtnl()
    assert nl.routes_of(6, RTPROT_TABBY) == []
    mtype, flags, msg = sent(sock, rtmsg)
    assert mtype == 26
    assert flags & 0x300 == 0x300
    assert (msg["family"], msg["proto"], msg["table"], msg["type"]) == (10, 116, 254, 0)


def test_neighbour_and_fdb_requests() -> None:
    nl, sock = fake_rtnl()
    nl.neighbours(4, 7)
    _t, _f, msg = sent(sock, ndmsg)
    assert (msg["ifindex"], msg.get("NDA_IFINDEX")) == (0, 7)  # strict dumps want the attr
    nl.set_fdb(7, MAC_B, ip("fd50::2"), what="fdb")
    mtype, flags, msg = sent(sock, ndmsg)
    assert (mtype, msg["family"], msg["state"], msg["flags"]) == (28, 7, 0x80, 0x02)
    assert flags & 0x500 == 0x500
    assert (msg.get("lladdr"), msg.get("dst")) == (MAC_B, "fd50::2")
    nl.set_neighbour(7, ip("10.244.2.1"), MAC_B, what="neigh")
    mtype, _f, msg = sent(sock, ndmsg)
    assert (mtype, msg["family"], msg["state"], msg.get("dst")) == (28, 2, 0x80, "10.244.2.1")


def test_ipip_link_request() -> None:
    nl, sock = fake_rtnl()
    nl.create_link("tunl0", "ipip", mtu=1480)
    mtype, flags, msg = sent(sock, ifinfmsg)
    assert (mtype, flags & 0x600) == (16, 0x600)
    assert (msg.get("ifname"), msg.get("mtu"), msg["flags"] & 1) == ("tunl0", 1480, 1)
    assert msg.get(("linkinfo", "kind")) == "ipip"


@pytest.mark.parametrize(
    ("err", "supported"), [(errno.EOPNOTSUPP, False), (errno.EINVAL, True), (errno.ERANGE, True)]
)
def test_kind_probe_sends_data_the_kind_rejects_and_reads_the_answer(
    err: int, supported: bool
) -> None:
    nl, sock = fake_rtnl(err)
    answer = nl.link_kind_supported("ipip", "tbyprobe1")
    assert answer[0] is supported
    assert len(sock.sent) == 1  # refused: nothing was created, nothing to clean up
    mtype, flags, msg = sent(sock, ifinfmsg)
    assert (mtype, flags & 0x600) == (16, 0x600)
    assert msg.get("ifname") == "tbyprobe1"
    data = msg.get(("linkinfo", "data"))
    assert msg.get(("linkinfo", "kind")) == "ipip"
    assert data.get("ipip_proto") == 253  # IFLA_IPTUN_PROTO: ipip_tunnel_validate says EINVAL


def test_kind_probe_that_creates_a_link_removes_it() -> None:
    nl, sock = fake_rtnl()  # acks everything: as if the kind had no validation
    supported, how = nl.link_kind_supported("bridge", "tbyprobe2")
    assert supported
    assert how == "created and removed a probe link"
    # The create, then the lookup of what it made (this fake answers it with nothing, so
    # there is nothing to delete; the kernel tests see a real probe leave nothing behind).
    assert len(sock.sent) == 2


# --- node facts (pure parts) --------------------------------------------------------------


def test_parse_methods() -> None:
    assert nodeinfo.parse_method("first-found").kind == "first-found"
    assert nodeinfo.parse_method("").kind == "first-found"
    assert nodeinfo.parse_method("interface=eth0, en.*").patterns == ("eth0", "en.*")
    assert nodeinfo.parse_method("cidr=10.0.0.0/8").networks == (net("10.0.0.0/8"),)
    assert nodeinfo.parse_method("can-reach=8.8.8.8").target == "8.8.8.8"
    explicit = nodeinfo.parse_method("fd50::1/64", 6)
    assert (explicit.kind, explicit.address, explicit.prefixlen) == ("address", ip("fd50::1"), 64)
    assert nodeinfo.parse_method("10.0.0.1").prefixlen is None
    for bad, message in [
        ("interface=", "at least one"),
        ("cidr=fd00::/8", "IPv4 networks"),
        ("bogus=1", "unknown autodetection method"),
        ("eth0", "not an autodetection method"),
        ("can-reach=", "needs an address"),
    ]:
        with pytest.raises(ValueError, match=message):
            nodeinfo.parse_method(bad)


def test_select_address_snapshot() -> None:
    links = [
        LinkState(1, "lo", None, None, 65536, True),
        LinkState(3, "docker0", "bridge", MAC_A, 1500, True),
        LinkState(4, "ens3", None, MAC_B, 1500, False),  # down
        LinkState(5, "ens4", None, MAC_C, 1450, True),
    ]
    addrs = [
        KernelAddress(1, ip("10.99.0.1"), 32, 0, 0),
        KernelAddress(3, ip("172.17.0.1"), 16, 0, 0),
        KernelAddress(4, ip("10.0.0.4"), 24, 0, 0),
        KernelAddress(5, ip("fe80::1"), 64, 253, 0),
        KernelAddress(5, ip("fd50::9"), 64, 0, 0x20),  # deprecated
        KernelAddress(5, ip("fd50::5"), 64, 0, 0),
        KernelAddress(5, ip("10.0.1.5"), 24, 0, 0),
    ]
    first = nodeinfo.parse_method("first-found")
    assert nodeinfo.select_address(first, 4, links, addrs) == nodeinfo.NodeAddress(
        ip("10.0.1.5"), 24, "ens4"
    )
    assert nodeinfo.select_address(first, 6, links, addrs).address == ip("fd50::5")
    with pytest.raises(nodeinfo.AutodetectError, match="no global IPv4 address"):
        nodeinfo.select_address(first, 4, links[:3], addrs)
    assert nodeinfo.select_uplink_mtu([], links, addrs) == 1450
    assert nodeinfo.select_uplink_mtu([], links[:1], addrs) == nodeinfo.FALLBACK_MTU


def test_pod_mtu_overheads() -> None:
    assert nodeinfo.pod_mtu(1500) == 1500
    assert nodeinfo.pod_mtu(1500, vxlan=True) == 1450
    assert nodeinfo.pod_mtu(1500, vxlan=True, vxlan_v6=True) == 1430
    assert nodeinfo.pod_mtu(9000, ipip=True) == 8980


def test_vxlan_mac_is_stable_local_and_unicast() -> None:
    mac = nodeinfo.vxlan_mac("node-a")
    assert mac == nodeinfo.vxlan_mac("node-a")
    first = int(mac[:2], 16)
    assert first & 0x02  # locally administered
    assert not first & 0x01  # unicast
    assert mac != nodeinfo.vxlan_mac("node-b")
    assert mac != nodeinfo.vxlan_mac("node-a", 6)
    macs = {nodeinfo.vxlan_mac(f"node-{i}") for i in range(500)}
    assert len(macs) == 500
    assert all(int(m[:2], 16) & 0x03 == 0x02 for m in macs)
    VxlanDevice(ip("10.0.0.1"), mac, 1450)  # acceptable as a device MAC
    with pytest.raises(ValueError, match="node name"):
        nodeinfo.vxlan_mac("")
