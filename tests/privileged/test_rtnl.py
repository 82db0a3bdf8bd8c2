"""The rtnetlink transport (dataplane.rtnl) against the real kernel.

The dataplane tests exercise every request the plugin makes; these pin the transport
itself: dumps that need several reads, errors (with the kernel's own words) that do not
desynchronise the socket, "gone" answers, netns ids. All inside throwaway namespaces.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import subprocess
from collections.abc import Callable

import pytest

from cni_plugin.cni_codes import to_cni_error
from dataplane.errors import NetlinkFailure
from dataplane.rtnl import Rtnl, link_request, route_request
from tests.privileged.netns_util import Netns, Node, run_in_thread_netns

pytestmark = pytest.mark.privileged


def test_route_dump_larger_than_one_read(node: Node) -> None:
    """A dump of ~2000 routes comes in many parts (several reads): every one is returned
    once, and the socket still answers the next request."""
    node.ip("link", "add", "dum0", "type", "veth", "peer", "name", "dum1")
    node.ip("link", "set", "dum0", "up")
    node.ip("link", "set", "dum1", "up")
    batch = "".join(f"route add 10.77.{i // 250}.{i % 250}/32 dev dum0\n" for i in range(2000))
    subprocess.run(
        ["ip", "-n", node.name, "-batch", "-"], input=batch, text=True, check=True, timeout=60
    )

    node.ip("route", "add", "10.78.0.1/32", "dev", "dum1")

    def dump() -> tuple[list[str], list[str], list[str], bool]:
        with Rtnl.here("node") as r:
            routes = [str(rt.dst) for rt in r.routes(4) if str(rt.dst).startswith("10.77.")]
            dum0, dum1 = r.link_by_name("dum0"), r.link_by_name("dum1")
            assert dum0 is not None
            assert dum1 is not None
            via0 = [str(rt.dst) for rt in r.routes(4, oif=dum0.index)]
            via1 = [str(rt.dst) for rt in r.routes(4, oif=dum1.index)]
            return routes, via0, via1, r.link_by_name("lo") is not None

    routes, via0, via1, lo_found = node.run(dump)
    assert len(routes) == 2000
    assert len(set(routes)) == 2000
    assert sorted(via0) == sorted(routes)  # the interface filter: dum0's routes only
    assert via1 == ["10.78.0.1/32"]
    assert lo_found


def test_failure_carries_errno_and_kernel_message_and_socket_stays_usable(node: Node) -> None:
    def work() -> tuple[NetlinkFailure, int | None]:
        with Rtnl.here("node") as r:
            lo = r.link_by_name("lo")
            assert lo is not None
            with pytest.raises(NetlinkFailure) as info:
                r.add_route(
                    ipaddress.ip_network("10.1.0.0/16"),
                    lo.index,
                    gw=ipaddress.ip_address("10.9.9.9"),  # not reachable from here
                )
            again = r.link_by_name("lo")  # the error's reply was consumed: in step
            return info.value, again.index if again else None

    failure, index = node.run(work)
    assert failure.errno == errno.ENETUNREACH
    assert to_cni_error(failure).code == 103
    assert "add route 10.1.0.0/16 via 10.9.9.9" in failure.details
    assert "(in node netns)" in failure.details
    assert "the kernel says" in failure.details  # extended ack text
    assert index == 1


def test_requests_sent_together_are_answered_each_in_order(node: Node) -> None:
    """Several requests in one datagram (``Rtnl.send``): the kernel runs each, one that
    fails does not stop the next, each answer is read in its place, and the socket is in
    step afterwards (``run`` raises the first failure only once every answer is read)."""
    net = ipaddress.ip_network

    def work() -> tuple[list[object], list[str], int | None]:
        with Rtnl.here("node") as r:
            lo = r.link_by_name("lo")
            assert lo is not None
            r.set_up(lo)
            results = r.results(
                r.send(
                    [
                        route_request(net("10.5.0.1/32"), lo.index),
                        route_request(
                            net("10.5.0.0/16"), lo.index, gw=ipaddress.ip_address("10.9.9.9")
                        ),
                        link_request("nosuch0"),
                        route_request(net("10.5.0.2/32"), lo.index),
                        link_request("lo"),
                    ]
                )
            )
            no_link, lo_again = r.link_of(results[2]), r.link_of(results[4])
            kinds: list[object] = [
                x.errno if isinstance(x, NetlinkFailure) else "ok" for x in results[:2]
            ]
            kinds += [no_link, results[3], lo_again.name if lo_again else None]
            with pytest.raises(NetlinkFailure):
                r.run([route_request(net("10.5.0.1/32"), lo.index), link_request("lo")])
            routes = sorted(str(rt.dst) for rt in r.routes(4, oif=lo.index))
            again = r.link_by_name("lo")
            return kinds, routes, again.index if again else None

    kinds, routes, index = node.run(work)
    assert kinds == ["ok", errno.ENETUNREACH, None, [], "lo"]  # an ACK alone: no replies
    assert "10.5.0.1/32" in routes
    assert "10.5.0.2/32" in routes
    assert index == 1


def test_gone_things_are_answers_not_errors(node: Node) -> None:
    def work() -> tuple[object, bool, bool, bool]:
        with Rtnl.here("node") as r:
            missing = r.link_by_name("nosuch0")
            gone_link = r.delete_link(4242, "nosuch0")
            gone_route = r.delete_route(ipaddress.ip_network("10.123.0.1/32"), 1)
            gone_route6 = r.delete_route(ipaddress.ip_network("fd00:123::1/128"), 1)
            return missing, gone_link, gone_route, gone_route6

    assert node.run(work) == (None, False, False, False)


def test_veth_add_address_route_and_dumps(node: Node, make_pod: object) -> None:
    pod: Netns = make_pod()  # type: ignore[operator]
    fd = os.open(pod.path, os.O_RDONLY | os.O_CLOEXEC)
    try:

        def work() -> tuple[int | None, list[str], list[str], list[str], str]:
            with Rtnl.here("node") as host:
                host.add_veth(
                    "tbyv0",
                    mac="ee:ee:ee:ee:ee:ee",
                    mtu=1400,
                    peer_name="eth9",
                    peer_netns_fd=fd,
                    peer_mac="02:00:00:00:00:09",
                )
                link = host.link_by_name("tbyv0")
                assert link is not None
                host.set_up(link, alias="tabby:test:alias")
                host.add_address(link, ipaddress.ip_address("10.55.0.1"))
                host.add_address(link, ipaddress.ip_address("fd00:55::1"))
                host.add_route(ipaddress.ip_network("10.55.1.0/24"), link.index)
                host.add_route(ipaddress.ip_network("10.55.1.0/24"), link.index, replace=True)
                with pytest.raises(NetlinkFailure) as dup:
                    host.add_route(ipaddress.ip_network("10.55.1.0/24"), link.index)
                assert dup.value.errno == errno.EEXIST
                addrs = [str(a.address) for a in host.addresses(link.index)]
                names = [x.name for x in host.links()]
                routes = [str(rt.dst) for rt in host.routes(4) if rt.oif == link.index]
                nsid = host.netnsid_of(fd)
                after = host.link_by_name("tbyv0")
                assert after is not None
                return nsid, addrs, names, routes, after.alias

        nsid, addrs, names, routes, alias = node.run(work)
    finally:
        os.close(fd)
    assert sorted(addrs) == ["10.55.0.1", "fd00:55::1"]
    assert "tbyv0" in names
    assert "lo" in names
    assert "10.55.1.0/24" in routes
    assert alias == "tabby:test:alias"
    # the veth's peer lives in the pod: the kernel gave that namespace an id from the node
    assert nsid is not None
    assert nsid >= 0
    line = pod.link_line("eth9")
    assert "02:00:00:00:00:09" in line
    assert "mtu 1400" in line


def test_netnsid_of_an_unrelated_namespace_is_none(node: Node, make_pod: object) -> None:
    pod: Netns = make_pod()  # type: ignore[operator]
    fd = os.open(pod.path, os.O_RDONLY | os.O_CLOEXEC)

    def work() -> int | None:
        with Rtnl.here("node") as r:
            return r.netnsid_of(fd)

    try:
        assert node.run(work) is None
    finally:
        os.close(fd)


def test_links_read_from_their_bytes_are_what_pyroute2_decodes(
    node: Node, make_pod: Callable[[], Netns]
) -> None:
    """``parse_link`` (a link read straight from the kernel's bytes) against pyroute2's
    decoding of the same replies, for every link of a node and a pod namespace: a veth
    pair across them (peer index, netns id), an alias, IPv6 off on one end."""
    pod = make_pod()
    node.ip("link", "add", "ptest0", "type", "veth", "peer", "name", "eth0", "netns", pod.name)
    node.ip("link", "set", "ptest0", "alias", "ns/pod", "up")
    pod.ip("link", "set", "eth0", "up")
    pod.exec("sysctl", "-qw", "net.ipv6.conf.eth0.disable_ipv6=1")

    def compare() -> list[tuple[object, object]]:
        from dataplane.rtnl import IFF_UP, NLM_F_DUMP, RTM_GETLINK, Link, ifinfmsg, parse_link

        out = []
        with Rtnl.here("test") as r:
            for reply in r._request("dump links", ifinfmsg(), RTM_GETLINK, NLM_F_DUMP):
                msg = ifinfmsg(bytes(reply.data))
                msg.decode()
                inet6 = msg.get(("af_spec", "af_inet6", "inet6_conf"))
                v6off = inet6.get("disable_ipv6") if isinstance(inet6, dict) else None
                kind, peer, nsid = (
                    msg.get(("linkinfo", "kind")),
                    msg.get("link"),
                    msg.get("link_netnsid"),
                )
                decoded = Link(
                    index=msg["index"],
                    name=msg.get("ifname"),
                    kind=kind,
                    mac=msg.get("address"),
                    up=bool(msg["flags"] & IFF_UP),
                    mtu=msg.get("mtu") or 0,
                    peer_index=peer,
                    peer_netnsid=nsid,
                    ipv6_disabled=None if v6off is None else bool(v6off),
                    alias=msg.get("ifalias") or "",
                )
                out.append((parse_link(bytes(reply.data)), decoded))
        return out

    pairs = node.run(compare) + run_in_thread_netns(pod.path, compare)
    assert len(pairs) >= 4  # lo and ptest0, lo and eth0
    for read, decoded in pairs:
        assert read == decoded
    by_name = {read.name: read for read, _ in pairs}  # type: ignore[attr-defined]
    assert by_name["eth0"].ipv6_disabled is True
    assert by_name["ptest0"].alias == "ns/pod"
    assert by_name["ptest0"].kind == "veth"
