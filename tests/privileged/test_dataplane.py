"""dataplane against the real kernel, inside throwaway namespaces.

The "host" is a node namespace (``node`` fixture); the dataplane runs in a thread that entered
it (``node.run``), so the test process stays in the real host namespace. Traffic only ever
goes to addresses inside these namespaces. Rule IDs (GEN-15, GEN-16): cni_protocol/CONFORMANCE.md.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
import socket
import threading
import time
from collections.abc import Callable

import pytest

import dataplane
from cni_plugin.cni_codes import to_cni_error
from dataplane import (
    HOST_VETH_MAC,
    CheckMismatch,
    ExpectedState,
    InterfaceConflict,
    InvalidNetNS,
    InvalidVethPrefix,
    NetlinkFailure,
    NetNSNotFound,
    PodRoute,
    SetupSpec,
)
from tests.privileged.netns_util import (
    NODE_V4,
    NODE_V6,
    Netns,
    NetnsPool,
    Node,
    run_in_thread_netns,
)

pytestmark = pytest.mark.privileged

MakePod = Callable[[], Netns]
FAMILIES = {"ipv4": (4,), "ipv6": (6,), "dual": (4, 6)}


def pod_ips(
    n: int, families: tuple[int, ...] = (4, 6)
) -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out: list[ipaddress.IPv4Address | ipaddress.IPv6Address] = []
    if 4 in families:
        out.append(ipaddress.IPv4Address(f"10.244.0.{n}"))
    if 6 in families:
        out.append(ipaddress.IPv6Address(f"fd00:10:244::{n:x}"))
    return out


def make_spec(pod: Netns, n: int, families: tuple[int, ...] = (4, 6), **kw: object) -> SetupSpec:
    ifname = str(kw.pop("ifname", "eth0"))
    host = dataplane.host_veth_name("cali", "k8s-pod-network", pod.name, ifname)
    return SetupSpec(
        netns_path=pod.path,
        ifname=ifname,
        host_ifname=host,
        addresses=pod_ips(n, families),
        **kw,  # type: ignore[arg-type]
    )


def host_routes(node: Node, dst: str) -> str:
    family = "-6" if ":" in dst else "-4"
    return node.ip(family, "route", "show", "exact", dst).stdout.strip()


# --- names ---------------------------------------------------------------------------------


def test_host_veth_name_is_deterministic_and_fits() -> None:
    name = dataplane.host_veth_name("cali", "k8s-pod-network", "abc123", "eth0")
    assert name == dataplane.host_veth_name("cali", "k8s-pod-network", "abc123", "eth0")
    assert len(name) == 15
    assert name.startswith("cali")
    assert all(c in "0123456789abcdef" for c in name[4:])
    others = {
        dataplane.host_veth_name("cali", "k8s-pod-network", "abc123", "net1"),
        dataplane.host_veth_name("cali", "other-network", "abc123", "eth0"),
        dataplane.host_veth_name("cali", "k8s-pod-network", "abc124", "eth0"),
    }
    assert name not in others
    assert len(others) == 3
    assert len(dataplane.host_veth_name("v", "n", "c", "eth0")) == 12


@pytest.mark.parametrize("prefix", ["", "toolong", "a b", "a/b", "a:b", "é", "x%d", "1ab"])
def test_invalid_veth_prefix_is_refused(prefix: str) -> None:
    """The one veth_prefix rule (the configuration models use it too): code 2, naming the
    field and the value."""
    with pytest.raises(InvalidVethPrefix) as exc:
        dataplane.host_veth_name(prefix, "n", "c", "eth0")
    assert to_cni_error(exc.value).code == 2
    assert "veth_prefix" in exc.value.msg


# --- kernel facts the design relies on --------------------------------------------------


def test_proc_sys_net_follows_the_opening_thread(make_pod: MakePod) -> None:
    """/proc/sys/net is per *thread* netns; /proc/net follows the process; the main thread's
    namespace never changes."""
    pod = make_pod()
    pod.exec("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
    before = os.readlink("/proc/thread-self/ns/net")

    def probe() -> tuple[str, int, int]:
        with open("/proc/sys/net/ipv4/ip_forward") as f:
            fwd = f.read().strip()
        with open("/proc/net/dev") as f:
            proc_net = len(f.readlines())
        with open("/proc/thread-self/net/dev") as f:
            thread_net = len(f.readlines())
        return fwd, proc_net, thread_net

    fwd, proc_net, thread_net = run_in_thread_netns(pod.path, probe)
    assert fwd == "1"  # the pod's value, not the host's
    assert thread_net == 3  # header (2 lines) + lo: the pod's view
    assert proc_net >= thread_net  # /proc/net = thread-group leader = host view
    assert os.readlink("/proc/thread-self/ns/net") == before


# --- setup: the data path works ----------------------------------------------------------


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_two_pods_reach_each_other_and_the_node(node: Node, make_pod: MakePod, family: str) -> None:
    fams = FAMILIES[family]
    pod_a, pod_b = make_pod(), make_pod()
    spec_a, spec_b = make_spec(pod_a, 1, fams), make_spec(pod_b, 2, fams)
    node.run(dataplane.setup, spec_a)
    node.run(dataplane.setup, spec_b)
    # First attempt, no retry: the data path must work as soon as setup() returns (the host
    # veth's IPv6 link-local has no DAD, the pod's /128 is NODAD).
    for ip_a, ip_b in zip(spec_a.addresses, spec_b.addresses, strict=True):
        pod_a.ping(str(ip_b), attempts=1)
        pod_b.ping(str(ip_a), attempts=1)
        node.ping(str(ip_a), attempts=1)
        node.ping(str(ip_b), attempts=1)
    if 4 in fams:
        pod_a.ping(NODE_V4, attempts=1)
    if 6 in fams:
        pod_b.ping(NODE_V6, attempts=1)


def test_setup_builds_the_calico_data_path(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 7, mtu=1400, mac="02:00:00:aa:bb:cc")
    res = node.run(dataplane.setup, spec)

    assert res.host_ifname == spec.host_ifname
    assert len(res.host_ifname) == 15
    assert res.host_mac == HOST_VETH_MAC
    assert res.container_ifname == "eth0"
    assert res.container_mac == "02:00:00:aa:bb:cc"
    assert [str(r) for r in res.routes] == [
        "169.254.1.1/32 scope link",
        "0.0.0.0/0 via 169.254.1.1",
        "::/0 via fe80::ecee:eeff:feee:eeee",
    ]

    # pod side
    assert "mtu 1400" in pod.link_line("eth0")
    assert "UP" in pod.link_line("eth0")
    idx = int(pod.link_line("eth0").split(":")[0])
    assert idx == res.container_index
    addrs = pod.ip("-o", "addr", "show", "dev", "eth0").stdout
    assert "inet 10.244.0.7/32" in addrs
    assert "inet6 fd00:10:244::7/128" in addrs
    assert "nodad" in addrs
    assert pod.ip("-4", "route", "show").stdout.splitlines() == [
        "default via 169.254.1.1 dev eth0 ",
        "169.254.1.1 dev eth0 scope link ",
    ]
    assert "default via fe80::ecee:eeff:feee:eeee dev eth0" in pod.ip("-6", "route").stdout
    assert pod.links() == ["lo", "eth0"]  # no temporary names, lo left alone (down)
    assert "state DOWN" in pod.link_line("lo") or "LOOPBACK>" in pod.link_line("lo")

    # host side
    host = node.link_line(spec.host_ifname)
    assert "ee:ee:ee:ee:ee:ee" in host
    assert "mtu 1400" in host
    assert ",UP" in host
    assert not node.ip("-o", "addr", "show", "dev", spec.host_ifname, "scope", "global").stdout
    assert host_routes(node, "10.244.0.7/32") == f"10.244.0.7 dev {spec.host_ifname} scope link"
    assert host_routes(node, "fd00:10:244::7/128").startswith(
        f"fd00:10:244::7 dev {spec.host_ifname}"
    )
    h = spec.host_ifname
    for key, want in {
        f"net/ipv4/conf/{h}/proxy_arp": "1",
        f"net/ipv4/conf/{h}/forwarding": "1",
        f"net/ipv4/neigh/{h}/proxy_delay": "0",
        f"net/ipv6/conf/{h}/proxy_ndp": "1",
        f"net/ipv6/conf/{h}/forwarding": "1",
        f"net/ipv6/conf/{h}/accept_dad": "0",
        f"net/ipv6/conf/{h}/accept_ra": "0",
    }.items():
        assert node.sysctl(key) == want, key
    # host sysctls went to the node namespace, not to the test process's namespace
    assert not os.path.exists(f"/proc/sys/net/ipv4/conf/{h}")
    assert "fe80::ecee:eeff:feee:eeee" in node.ip("-6", "addr", "show", "dev", h).stdout
    assert pod.sysctl("net/ipv4/ip_forward") == "0"  # allow_ip_forwarding is off


def test_allow_ip_forwarding_sets_pod_sysctls(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 8, allow_ip_forwarding=True)
    node.run(dataplane.setup, spec)
    assert pod.sysctl("net/ipv4/ip_forward") == "1"
    assert pod.sysctl("net/ipv6/conf/all/forwarding") == "1"
    node.run(dataplane.check, spec)


def test_pod_with_ipv6_disabled_by_default_gets_it_enabled(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    pod.exec("sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/default/disable_ipv6")
    spec = make_spec(pod, 9, (6,))
    node.run(dataplane.setup, spec)
    node.ping(str(spec.addresses[0]))


def test_calling_threads_keep_their_namespace(node: Node, make_pod: MakePod) -> None:
    """GEN-15: the caller's netns never changes; host work lands in the caller's netns."""
    pod = make_pod()
    spec = make_spec(pod, 10)
    main_before = os.readlink("/proc/thread-self/ns/net")
    node_ns = run_in_thread_netns(node.path, lambda: os.readlink("/proc/thread-self/ns/net"))

    def setup_and_report() -> str:
        dataplane.setup(spec)
        dataplane.check(spec)
        dataplane.teardown(spec.netns_path, spec.ifname, spec.host_ifname, spec.addresses)
        return os.readlink("/proc/thread-self/ns/net")

    assert node.run(setup_and_report) == node_ns
    assert os.readlink("/proc/thread-self/ns/net") == main_before
    assert threading.active_count() == 1  # worker threads are gone


# --- setup: refusals and rollback ------------------------------------------------------


def test_existing_ifname_in_pod_is_refused_and_left_untouched(
    node: Node, make_pod: MakePod
) -> None:
    pod = make_pod()
    pod.ip("link", "add", "eth0", "type", "bridge")
    pod.ip("addr", "add", "192.0.2.1/24", "dev", "eth0")
    before = pod.ip("-o", "addr", "show", "dev", "eth0").stdout + pod.link_line("eth0")
    spec = make_spec(pod, 11)

    with pytest.raises(InterfaceConflict) as exc:
        node.run(dataplane.setup, spec)
    assert to_cni_error(exc.value).code == 103
    assert "eth0" in exc.value.msg
    assert "already exists" in exc.value.msg
    assert pod.ip("-o", "addr", "show", "dev", "eth0").stdout + pod.link_line("eth0") == before
    assert spec.host_ifname not in node.links()

    # the runtime's DEL after the failed ADD must not remove the foreign interface either
    node.run(dataplane.teardown, spec.netns_path, "eth0", spec.host_ifname, spec.addresses)
    assert pod.ip("-o", "addr", "show", "dev", "eth0").stdout + pod.link_line("eth0") == before


def test_existing_ifname_that_is_a_local_veth_is_refused(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    pod.ip("link", "add", "eth0", "type", "veth", "peer", "name", "other0")
    spec = make_spec(pod, 12)
    with pytest.raises(InterfaceConflict, match="already exists"):
        node.run(dataplane.setup, spec)
    node.run(dataplane.teardown, spec.netns_path, "eth0", spec.host_ifname, None)
    assert {"eth0", "other0"} <= set(pod.links())


def test_failure_midway_rolls_back(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    ip = pod_ips(13, (4,))[0]
    spec = SetupSpec(pod.path, "eth0", "calirollback0", [ip, ip])  # 2nd address: EEXIST
    with pytest.raises(NetlinkFailure) as exc:
        node.run(dataplane.setup, spec)
    assert to_cni_error(exc.value).code == 103
    assert "errno 17" in exc.value.details
    assert "add address" in exc.value.details
    assert "calirollback0" not in node.links()
    assert pod.links() == ["lo"]
    assert host_routes(node, f"{ip}/32") == ""


# --- setup with the addresses asked for while the pair is made (the served ADD) ----------


def _pair_only(spec: SetupSpec) -> SetupSpec:
    return dataclasses.replace(spec, addresses=())


def _wait_for_link(name: str) -> None:
    """Until ``name`` exists in the calling thread's namespace (2 s at most)."""
    deadline = time.monotonic() + 2
    while True:
        try:
            socket.if_nametoindex(name)
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def test_addresses_are_asked_for_in_the_calling_thread(node: Node, make_pod: MakePod) -> None:
    """The same data path as with the addresses given; the callable runs in the calling
    thread (where the IPAM call's namespaces are), the pair on another."""
    pod = make_pod()
    spec = make_spec(pod, 30)
    seen: list[int] = []

    def addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        seen.append(threading.get_ident())
        return list(spec.addresses)

    def run() -> tuple[int, object]:
        return threading.get_ident(), dataplane.setup(_pair_only(spec), addresses)

    caller, res = node.run(run)
    assert seen == [caller]
    assert res.host_ifname == spec.host_ifname  # type: ignore[attr-defined]
    node.run(dataplane.check, spec)
    node.ping(str(spec.addresses[0]))


def test_a_failed_address_call_removes_the_pair(node: Node, make_pod: MakePod) -> None:
    """The IPAM call fails once the pair exists: what it raised is raised unchanged, and
    neither end is left."""
    pod = make_pod()
    spec = make_spec(pod, 31)

    def addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        _wait_for_link(spec.host_ifname)
        raise LookupError("no address available")

    with pytest.raises(LookupError, match="no address available"):
        node.run(dataplane.setup, _pair_only(spec), addresses)
    assert spec.host_ifname not in node.links()
    assert pod.links() == ["lo"]


def test_no_addresses_removes_the_pair(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 32)

    def addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        _wait_for_link(spec.host_ifname)
        return []

    with pytest.raises(dataplane.DataplaneError, match="no addresses"):
        node.run(dataplane.setup, _pair_only(spec), addresses)
    assert spec.host_ifname not in node.links()
    assert pod.links() == ["lo"]


def test_a_pair_refused_beside_the_address_call(node: Node, make_pod: MakePod) -> None:
    """The pod already has ``eth0``: the refusal comes after the addresses were asked for
    (the caller gives them back), and the foreign interface is left untouched."""
    pod = make_pod()
    pod.ip("link", "add", "eth0", "type", "bridge")
    before = pod.link_line("eth0")
    spec = make_spec(pod, 33)
    asked: list[bool] = []

    def addresses() -> list[ipaddress.IPv4Address | ipaddress.IPv6Address]:
        asked.append(True)
        return list(spec.addresses)

    with pytest.raises(InterfaceConflict, match="already exists"):
        node.run(dataplane.setup, _pair_only(spec), addresses)
    assert asked == [True]
    assert pod.link_line("eth0") == before
    assert spec.host_ifname not in node.links()


def test_a_failed_configuration_after_the_address_call_rolls_back(
    node: Node, make_pod: MakePod
) -> None:
    pod = make_pod()
    ip = pod_ips(34, (4,))[0]
    spec = SetupSpec(pod.path, "eth0", "calibeside0", ())
    with pytest.raises(NetlinkFailure) as exc:
        node.run(dataplane.setup, spec, lambda: [ip, ip])  # 2nd address: EEXIST
    assert "add address" in exc.value.details
    assert "calibeside0" not in node.links()
    assert pod.links() == ["lo"]
    assert host_routes(node, f"{ip}/32") == ""


def test_stale_host_veth_of_same_attachment_is_replaced(node: Node, make_pod: MakePod) -> None:
    old_pod, new_pod = make_pod(), make_pod()
    old = make_spec(old_pod, 14)
    node.run(dataplane.setup, old)
    # same attachment id (same host veth name), a new sandbox
    new = SetupSpec(new_pod.path, "eth0", old.host_ifname, pod_ips(15))
    node.run(dataplane.setup, new)
    assert old_pod.links() == ["lo"]  # the old pair went with the stale host veth
    assert host_routes(node, "10.244.0.14/32") == ""
    node.run(dataplane.check, new)
    node.ping("10.244.0.15")


def test_repeated_setup_in_same_pod_replaces_own_interface(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 16)
    first = node.run(dataplane.setup, spec)
    second = node.run(dataplane.setup, spec)
    assert second.container_index != first.container_index or second.host_index != (
        first.host_index
    )
    node.run(dataplane.check, spec)
    node.ping("10.244.0.16")


def test_stale_route_to_another_veth_is_replaced(node: Node, make_pod: MakePod) -> None:
    pod_a, pod_b = make_pod(), make_pod()
    a = make_spec(pod_a, 17, (4,))
    node.run(dataplane.setup, a)
    # the same address handed to a new pod while the old veth still exists
    b = SetupSpec(pod_b.path, "eth0", "calinewowner00", a.addresses)
    node.run(dataplane.setup, b)
    assert host_routes(node, "10.244.0.17/32") == "10.244.0.17 dev calinewowner00 scope link"


def test_own_netns_is_refused(node: Node, make_pod: MakePod) -> None:
    """GEN-16: CNI_NETNS naming the caller's own namespace -> code 8, nothing touched."""
    spec = SetupSpec(node.path, "tbyown0", "caliown000000", pod_ips(18))
    links_before = node.links()
    for fn in (
        lambda: dataplane.setup(spec),
        lambda: dataplane.check(spec),
        lambda: dataplane.teardown(node.path, "lo", "caliown000000", spec.addresses),
    ):
        with pytest.raises(InvalidNetNS) as exc:
            node.run(fn)
        assert to_cni_error(exc.value).code == 8
    assert node.links() == links_before
    # from the test process itself, with the path libcni's own test uses
    with pytest.raises(InvalidNetNS):
        dataplane.setup(SetupSpec("/proc/self/ns/net", "tbyown0", "caliown000000", pod_ips(18)))


def test_missing_and_invalid_netns(node: Node, tmp_path: os.PathLike[str]) -> None:
    missing = SetupSpec("/run/netns/tby-does-not-exist", "eth0", "calimissing00", pod_ips(19))
    with pytest.raises(NetNSNotFound) as nf:
        node.run(dataplane.setup, missing)
    assert to_cni_error(nf.value).code == 3
    plain = os.path.join(tmp_path, "not-a-netns")
    with open(plain, "w"):
        pass
    with pytest.raises(InvalidNetNS) as inv:
        node.run(dataplane.setup, SetupSpec(plain, "eth0", "caliinvalid00", pod_ips(19)))
    assert to_cni_error(inv.value).code == 8
    with pytest.raises(InvalidNetNS):  # a namespace, but not a network namespace
        node.run(
            dataplane.setup, SetupSpec("/proc/self/ns/mnt", "eth0", "calimnt000000", pod_ips(19))
        )
    assert "calimissing00" not in node.links()
    assert "caliinvalid00" not in node.links()


# --- teardown -----------------------------------------------------------------------------


def test_teardown_is_idempotent(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 20)
    node.run(dataplane.setup, spec)
    for _ in range(3):
        node.run(dataplane.teardown, spec.netns_path, "eth0", spec.host_ifname, spec.addresses)
    assert spec.host_ifname not in node.links()
    assert pod.links() == ["lo"]
    assert host_routes(node, "10.244.0.20/32") == ""
    assert host_routes(node, "fd00:10:244::14/128") == ""


def test_second_attachment_keeps_the_first_ones_default_routes(
    node: Node, make_pod: MakePod
) -> None:
    """The pod's requests go to the kernel in one datagram: a route the first attachment
    owns (EEXIST) is neither an error nor reported, and the rest of the second one is
    built (its address, its host routes)."""
    pod = make_pod()
    first = node.run(dataplane.setup, make_spec(pod, 25))
    second_spec = make_spec(pod, 26, ifname="net1")
    second = node.run(dataplane.setup, second_spec)
    assert len(first.routes) == 3
    assert second.routes == ()
    assert "inet 10.244.0.26/32" in pod.ip("-o", "addr", "show", "dev", "net1").stdout
    assert "UP" in pod.link_line("net1")
    assert pod.ip("-4", "route", "show", "default").stdout.strip() == (
        "default via 169.254.1.1 dev eth0"
    )
    assert host_routes(node, "10.244.0.26/32") == (
        f"10.244.0.26 dev {second_spec.host_ifname} scope link"
    )
    node.run(dataplane.check, second_spec, ExpectedState(routes=()))


def test_pod_interface_present_only_for_a_live_attachment(node: Node, make_pod: MakePod) -> None:
    """What a refused repeated ADD asks before giving addresses back."""
    pod = make_pod()
    spec = make_spec(pod, 21)
    assert not node.run(dataplane.pod_interface_present, pod.path, "eth0")
    node.run(dataplane.setup, spec)
    assert node.run(dataplane.pod_interface_present, pod.path, "eth0")
    assert not node.run(dataplane.pod_interface_present, pod.path, "eth1")
    assert not node.run(dataplane.pod_interface_present, "/nonexistent/netns", "eth0")
    node.run(dataplane.teardown, spec.netns_path, "eth0", spec.host_ifname, spec.addresses)
    assert not node.run(dataplane.pod_interface_present, pod.path, "eth0")


def test_teardown_without_netns(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 21)
    node.run(dataplane.setup, spec)
    node.run(dataplane.teardown, None, "eth0", spec.host_ifname, spec.addresses)
    node.run(dataplane.teardown, "", "eth0", spec.host_ifname, None)
    assert spec.host_ifname not in node.links()
    assert pod.links() == ["lo"]


def test_teardown_with_vanished_netns(node: Node, make_pod: MakePod, netns_pool: NetnsPool) -> None:
    pod = make_pod()
    spec = make_spec(pod, 22)
    node.run(dataplane.setup, spec)
    netns_pool.delete(pod)
    for _ in range(2):
        node.run(dataplane.teardown, spec.netns_path, "eth0", spec.host_ifname, spec.addresses)
    assert spec.host_ifname not in node.links()
    assert host_routes(node, "10.244.0.22/32") == ""


def test_teardown_keeps_routes_that_point_at_another_veth(node: Node, make_pod: MakePod) -> None:
    pod_a, pod_b = make_pod(), make_pod()
    a, b = make_spec(pod_a, 23), make_spec(pod_b, 24)
    node.run(dataplane.setup, a)
    node.run(dataplane.setup, b)
    # pod B's veth now also owns A's addresses (an IP reused before A's DEL arrived)
    node.ip("route", "replace", "10.244.0.23/32", "dev", b.host_ifname, "scope", "link")
    node.ip("-6", "route", "replace", "fd00:10:244::17/128", "dev", b.host_ifname)
    node.run(dataplane.teardown, a.netns_path, "eth0", a.host_ifname, a.addresses)
    assert host_routes(node, "10.244.0.23/32") == f"10.244.0.23 dev {b.host_ifname} scope link"
    assert host_routes(node, "fd00:10:244::17/128").startswith(
        f"fd00:10:244::17 dev {b.host_ifname}"
    )
    node.run(dataplane.check, b)


def test_teardown_finds_our_pod_end_under_another_host_name(node: Node, make_pod: MakePod) -> None:
    """A DEL whose host veth name does not match (veth_prefix changed) still removes the
    pod end, because it is a veth whose peer lives in the host namespace."""
    pod = make_pod()
    spec = make_spec(pod, 25)
    node.run(dataplane.setup, spec)
    node.run(dataplane.teardown, pod.path, "eth0", "tabby0000000000", spec.addresses)
    assert pod.links() == ["lo"]
    assert spec.host_ifname not in node.links()


def test_teardown_without_a_host_name_removes_the_pod_end(node: Node, make_pod: MakePod) -> None:
    """DEL-9: a DEL whose ``veth_prefix`` is invalid knows no host veth name; the pod end,
    found by ifname, goes, and the host end and its routes with it."""
    pod = make_pod()
    spec = make_spec(pod, 26)
    node.run(dataplane.setup, spec)
    for _ in range(2):
        node.run(dataplane.teardown, pod.path, "eth0", None, spec.addresses)
    assert pod.links() == ["lo"]
    assert spec.host_ifname not in node.links()
    assert host_routes(node, "10.244.0.26/32") == ""
    node.run(dataplane.teardown, None, "eth0", None, None)  # nothing to find: no error


# --- check --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "break_it",
    [
        pytest.param(lambda n, p, s: n.ip("route", "del", "10.244.0.30/32"), id="host-route-v4"),
        pytest.param(
            lambda n, p, s: n.ip("-6", "route", "del", "fd00:10:244::1e/128"), id="host-route-v6"
        ),
        pytest.param(
            lambda n, p, s: p.ip("addr", "del", "10.244.0.30/32", "dev", "eth0"), id="pod-addr"
        ),
        pytest.param(
            lambda n, p, s: p.ip("-6", "addr", "del", "fd00:10:244::1e/128", "dev", "eth0"),
            id="pod-addr-v6",
        ),
        pytest.param(lambda n, p, s: p.ip("route", "del", "default"), id="pod-default-route"),
        pytest.param(
            lambda n, p, s: n.ip("link", "set", s.host_ifname, "down"), id="host-veth-down"
        ),
        pytest.param(lambda n, p, s: n.ip("link", "del", s.host_ifname), id="host-veth-deleted"),
        pytest.param(lambda n, p, s: p.ip("link", "set", "eth0", "down"), id="pod-if-down"),
        pytest.param(
            lambda n, p, s: n.exec(
                "sh", "-c", f"echo 0 > /proc/sys/net/ipv4/conf/{s.host_ifname}/proxy_arp"
            ),
            id="proxy-arp-off",
        ),
    ],
)
def test_check_detects_damage_and_passes_after_repair(
    node: Node, make_pod: MakePod, break_it: Callable[[Node, Netns, SetupSpec], object]
) -> None:
    pod = make_pod()
    spec = make_spec(pod, 30)
    node.run(dataplane.setup, spec)
    node.run(dataplane.check, spec)
    break_it(node, pod, spec)
    with pytest.raises(CheckMismatch) as exc:
        node.run(dataplane.check, spec)
    assert to_cni_error(exc.value).code == 103
    assert exc.value.msg.startswith("check failed")
    # repair: a fresh DEL + ADD
    node.run(dataplane.teardown, spec.netns_path, "eth0", spec.host_ifname, spec.addresses)
    node.run(dataplane.setup, spec)
    node.run(dataplane.check, spec)


def test_check_tolerates_other_plugins_changes(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 31)
    node.run(dataplane.setup, spec)
    # a later chained plugin: extra address and route, a new MAC (like `tuning`)
    pod.ip("addr", "add", "192.0.2.31/32", "dev", "eth0")
    pod.ip("route", "add", "198.51.100.0/24", "via", "169.254.1.1", "dev", "eth0")
    pod.ip("link", "set", "eth0", "address", "02:11:22:33:44:55")
    node.run(dataplane.check, spec, ExpectedState(container_mac="02:11:22:33:44:55"))
    with pytest.raises(CheckMismatch, match="MAC"):
        node.run(dataplane.check, spec, ExpectedState(container_mac="02:00:00:00:00:01"))
    want = [PodRoute(ipaddress.ip_network("198.51.100.0/24"), ipaddress.ip_address("169.254.1.1"))]
    node.run(dataplane.check, spec, ExpectedState(routes=want))
    with pytest.raises(CheckMismatch, match="pod route"):
        node.run(
            dataplane.check,
            spec,
            ExpectedState(routes=[PodRoute(ipaddress.ip_network("203.0.113.0/24"), None)]),
        )


def test_check_of_missing_pod(node: Node, make_pod: MakePod) -> None:
    pod = make_pod()
    spec = make_spec(pod, 32)
    with pytest.raises(CheckMismatch, match="not found in the pod"):
        node.run(dataplane.check, spec)


# --- GC helpers -----------------------------------------------------------------------------


def test_list_and_delete_host_veths(node: Node, make_pod: MakePod) -> None:
    pod_a, pod_b = make_pod(), make_pod()
    a, b = make_spec(pod_a, 40, alias="tabby:net:a:eth0"), make_spec(pod_b, 41, (4,))
    node.run(dataplane.setup, a)
    node.run(dataplane.setup, b)
    node.ip("link", "add", "tby-other0", "type", "veth", "peer", "name", "tby-other1")
    found = {v.name: v for v in node.run(dataplane.list_host_veths, "cali")}
    assert set(found) == {a.host_ifname, b.host_ifname}
    assert sorted(map(str, found[a.host_ifname].routes)) == [
        "10.244.0.40/32",
        "fd00:10:244::28/128",
    ]
    assert [str(r) for r in found[b.host_ifname].routes] == ["10.244.0.41/32"]
    assert found[a.host_ifname].up
    assert found[a.host_ifname].alias == "tabby:net:a:eth0"
    assert found[b.host_ifname].alias == ""
    assert "alias tabby:net:a:eth0" in node.ip("link", "show", "dev", a.host_ifname).stdout

    node.run(dataplane.delete_host_veth, a.host_ifname)
    node.run(dataplane.delete_host_veth, a.host_ifname)  # idempotent
    assert [v.name for v in node.run(dataplane.list_host_veths, "cali")] == [b.host_ifname]
    assert pod_a.links() == ["lo"]
    assert host_routes(node, "10.244.0.40/32") == ""
    with pytest.raises(InterfaceConflict, match="not a veth"):
        node.run(dataplane.delete_host_veth, "lo")
