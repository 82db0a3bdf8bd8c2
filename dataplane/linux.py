"""The Calico-style pod data path on Linux: veth pair, /32 and /128 routes, proxy ARP/NDP.

"Host" always means the network namespace of the *calling thread* (the plugin's own, in
production); the pod namespace is entered only by short-lived worker threads
(:mod:`dataplane.netns`).
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager

from bundle.beside import Beside
from bundle.types import IPAddress, IPNetwork
from dataplane import netns as netns_mod
from dataplane import sysctl
from dataplane.errors import (
    CheckMismatch,
    DataplaneError,
    InterfaceConflict,
    InvalidNetNS,
    NetlinkFailure,
    NetNSNotFound,
)
from dataplane.model import (
    HOST_VETH_MAC,
    SCOPE_LINK,
    ExpectedState,
    HostVeth,
    PodRoute,
    SetupResult,
    SetupSpec,
    default_pod_routes,
    host_prefix,
)
from dataplane.netns import NetNS
from dataplane.rtnl import Link, Rtnl, address_request, link_request, route_request, set_up_request

log = logging.getLogger("tabby.dataplane")


def _host_sysctls(ifname: str, *, ipv4: bool, ipv6: bool) -> list[tuple[str, str, bool]]:
    """(key, value, missing_ok) for the host veth; written before the link goes up."""
    keys: list[tuple[str, str, bool]] = []
    if ipv4:
        keys += [
            (f"ipv4/conf/{ifname}/forwarding", "1", False),
            (f"ipv4/conf/{ifname}/proxy_arp", "1", False),
            (f"ipv4/neigh/{ifname}/proxy_delay", "0", False),
        ]
    if ipv6:
        # Missing entries mean IPv6 is disabled on the node: skip here, the IPv6 route
        # below then fails with a clear netlink error.
        keys += [
            (f"ipv6/conf/{ifname}/disable_ipv6", "0", True),
            # EUI-64 link-local from HOST_VETH_MAC, whatever the node's default mode is:
            # it is the pod's IPv6 gateway.
            (f"ipv6/conf/{ifname}/addr_gen_mode", "0", True),
            (f"ipv6/conf/{ifname}/accept_dad", "0", True),
            (f"ipv6/conf/{ifname}/accept_ra", "0", True),
            (f"ipv6/conf/{ifname}/forwarding", "1", True),
            (f"ipv6/conf/{ifname}/proxy_ndp", "1", True),
        ]
    return keys


def _pod_sysctls(
    ifname: str, *, ipv4: bool, ipv6: bool, forwarding: bool, enable_ipv6: bool = False
) -> list[tuple[str, str]]:
    """(key, value) inside the pod: re-enable IPv6 on our interface if the pod's defaults
    disabled it (e.g. a runtime's ``default/disable_ipv6=1``); ``allow_ip_forwarding``."""
    keys: list[tuple[str, str]] = []
    if ipv6 and enable_ipv6:
        keys.append((f"ipv6/conf/{ifname}/disable_ipv6", "0"))
    if forwarding:
        if ipv4:
            keys.append(("ipv4/ip_forward", "1"))
        if ipv6:
            keys.append(("ipv6/conf/all/forwarding", "1"))
    return keys


@contextmanager
def _sockets(ns: NetNS) -> Iterator[tuple[Rtnl, Rtnl]]:
    with ExitStack() as stack:
        host = stack.enter_context(Rtnl.here("host"))
        pod = stack.enter_context(Rtnl.in_netns(ns.fd, "pod"))
        yield host, pod


def _is_our_peer(host: Rtnl, pod: Rtnl, ns: NetNS, host_link: Link, pod_link: Link) -> bool:
    """True if ``pod_link`` (in ``ns``) and ``host_link`` are the two ends of one veth."""
    if host_link.kind != "veth" or pod_link.kind != "veth":
        return False
    if host_link.peer_index != pod_link.index or pod_link.peer_index != host_link.index:
        return False
    # Indexes are per namespace: also make sure each end's peer lives where the other is.
    pod_nsid = host.netnsid_of(ns.fd)
    return pod_nsid is not None and host_link.peer_netnsid == pod_nsid


def _peer_is_in_host(pod: Rtnl, pod_link: Link) -> bool:
    """True if ``pod_link`` is a veth whose peer lives in the calling thread's namespace."""
    if pod_link.kind != "veth" or pod_link.peer_netnsid is None:
        return False
    fd = netns_mod.own_netns_fd()
    try:
        host_nsid = pod.netnsid_of(fd)
    finally:
        os.close(fd)
    return host_nsid is not None and host_nsid == pod_link.peer_netnsid


def _already_exists(spec: SetupSpec) -> InterfaceConflict:
    return InterfaceConflict(
        f"interface {spec.ifname} already exists in the pod",
        f"an interface named {spec.ifname!r} already exists in {spec.netns_path}; "
        "it was left untouched (CNI_IFNAME must be new)",
    )


def setup(
    spec: SetupSpec, addresses: Callable[[], Sequence[IPAddress]] | None = None
) -> SetupResult:
    """Build the attachment's data path; on failure remove whatever was created and raise.

    Raises :class:`~dataplane.errors.NetNSNotFound`, :class:`~dataplane.errors.InvalidNetNS`,
    :class:`~dataplane.errors.InterfaceConflict` for a ``CNI_IFNAME`` that already exists
    in the pod (which is then left untouched), or another
    :class:`~dataplane.errors.DataplaneError` for kernel failures.

    ``addresses``: where the addresses come from when they are not known yet (the spec's own
    are then ignored): it is called in the calling thread while the veth pair is made on a
    thread of its own (the kernel's veth creation and the caller's IPAM overlap), then the
    pair is configured with what it returned. What it raises is raised unchanged, the pair
    removed first; ``setup`` raises before calling it only when the namespace cannot be
    opened.

    Round trips (the usual case, IPv4 or IPv6 or both): the veth pair made with its pod end
    directly in the pod; both ends read back at once (two sockets, both requests under way
    together); then each side's changes in one datagram, both under way together: the host
    end up with its alias and its routes, the pod end up with its addresses and routes.
    Names already taken are looked at only when the kernel refuses the pair (EEXIST).
    """
    if addresses is None and not spec.addresses:
        raise DataplaneError("no addresses to configure", "setup() needs at least one")
    with netns_mod.open_netns(spec.netns_path) as ns, _sockets(ns) as (host, pod):
        if addresses is None:
            host_link, pod_link = _make_pair(spec, ns, host, pod)
        else:
            spec, (host_link, pod_link) = _pair_beside(spec, ns, host, pod, addresses)
        try:
            return _configure(spec, ns, host, pod, host_link, pod_link)
        except BaseException:
            _rollback(host, spec.host_ifname, host_link)
            raise


def _make_pair(spec: SetupSpec, ns: NetNS, host: Rtnl, pod: Rtnl) -> tuple[Link, Link]:
    """The veth pair, made and read back (both ends); removed again if that fails."""
    try:
        _add_veth(spec, ns, host)
    except NetlinkFailure as exc:
        if exc.errno != errno.EEXIST:
            raise
        _prepare(spec, ns, host, pod)  # a conflict raises; a stale veth of ours goes
        _add_veth(spec, ns, host)
    host_link: Link | None = None
    try:
        host_sent = host.send([link_request(spec.host_ifname)])
        pod_sent = pod.send([link_request(spec.ifname)])
        host_link = host.link_of(host.results(host_sent)[0])
        pod_link = pod.link_of(pod.results(pod_sent)[0])
        if host_link is None:
            raise DataplaneError(
                f"host veth {spec.host_ifname} vanished right after creation",
                "another process deleted it concurrently",
            )
        if pod_link is None:
            raise DataplaneError(
                f"pod interface {spec.ifname} not found after creating the veth pair",
                f"in {spec.netns_path}",
            )
        return host_link, pod_link
    except BaseException:
        _rollback(host, spec.host_ifname, host_link)
        raise


def _pair_beside(
    spec: SetupSpec,
    ns: NetNS,
    host: Rtnl,
    pod: Rtnl,
    addresses: Callable[[], Sequence[IPAddress]],
) -> tuple[SetupSpec, tuple[Link, Link]]:
    """``addresses()`` in this thread while the pair is made on another: the spec with the
    addresses, and the pair. The sockets and the namespace's descriptor are only the other
    thread's until it is joined (a netlink socket stays in the namespace it was opened in,
    whichever thread uses it); sysctls, which are read in the thread's own namespace, are
    written by ``_configure`` in this one."""
    maker = Beside(lambda: _make_pair(spec, ns, host, pod), "tabby-veth")
    try:
        given = tuple(addresses())
    except BaseException:
        made = maker.join()
        if isinstance(made, tuple):
            _rollback(host, spec.host_ifname, made[0])
        raise
    made = maker.join()
    if isinstance(made, BaseException):
        raise made
    if not given:
        _rollback(host, spec.host_ifname, made[0])
        raise DataplaneError("no addresses to configure", "setup() needs at least one")
    return dataclasses.replace(spec, addresses=given), made


def _add_veth(spec: SetupSpec, ns: NetNS, host: Rtnl) -> None:
    host.add_veth(
        spec.host_ifname,
        mac=HOST_VETH_MAC,
        mtu=spec.mtu,
        peer_name=spec.ifname,
        peer_netns_fd=ns.fd,
        peer_mac=spec.mac,
    )


def _prepare(spec: SetupSpec, ns: NetNS, host: Rtnl, pod: Rtnl) -> None:
    """Refuse an existing ``ifname`` in the pod; remove a stale host veth of our own name."""
    stale = host.link_by_name(spec.host_ifname)
    existing = pod.link_by_name(spec.ifname)
    if existing is not None and not (
        stale is not None and _is_our_peer(host, pod, ns, stale, existing)
    ):
        raise _already_exists(spec)
    if stale is None:
        return
    if stale.kind != "veth":
        raise InterfaceConflict(
            f"host interface {spec.host_ifname} exists and is not a veth",
            f"{spec.host_ifname} is of kind {stale.kind!r}; refusing to delete it",
        )
    log.info("replacing stale host veth %s (index %d)", stale.name, stale.index)
    host.delete_link(stale.index, stale.name)


def _configure(
    spec: SetupSpec, ns: NetNS, host: Rtnl, pod: Rtnl, host_link: Link, pod_link: Link
) -> SetupResult:
    ipv4, ipv6 = spec.has_ipv4, spec.has_ipv6
    for key, value, missing_ok in _host_sysctls(spec.host_ifname, ipv4=ipv4, ipv6=ipv6):
        sysctl.write(key, value, missing_ok=missing_ok)
    pod_keys = _pod_sysctls(
        spec.ifname,
        ipv4=ipv4,
        ipv6=ipv6,
        forwarding=spec.allow_ip_forwarding,
        enable_ipv6=bool(pod_link.ipv6_disabled),
    )
    if pod_keys:
        netns_mod.call_in_netns(ns.fd, lambda: _write_all(pod_keys))

    # The host end up (its sysctls are written: they apply from the start), and the host
    # routes to the pod's addresses (replacing a stale one of an earlier pod).
    host_requests = [set_up_request(host_link, alias=spec.alias)]
    for address in spec.addresses:
        scope = SCOPE_LINK if address.version == 4 else 0
        host_requests.append(
            route_request(host_prefix(address), host_link.index, scope=scope, replace=True)
        )
    # The pod end up, its addresses, its routes: in this order, each after the previous
    # (the kernel runs a datagram's requests in turn).
    routes = default_pod_routes(spec.addresses)
    pod_requests = [set_up_request(pod_link)]
    pod_requests += [address_request(pod_link, address) for address in spec.addresses]
    pod_requests += [
        route_request(route.dst, pod_link.index, gw=route.gw, scope=route.scope) for route in routes
    ]
    host_sent = host.send(host_requests)
    try:
        pod_sent = pod.send(pod_requests)
    finally:
        host_done = host.results(host_sent)
    pod_done = pod.results(pod_sent)
    for result in host_done + pod_done[: 1 + len(spec.addresses)]:
        if isinstance(result, NetlinkFailure):
            raise result
    programmed = _pod_routes(spec, routes, pod_done[1 + len(spec.addresses) :])
    return SetupResult(
        host_ifname=host_link.name,
        host_mac=host_link.mac or HOST_VETH_MAC,
        host_index=host_link.index,
        container_ifname=pod_link.name,
        container_mac=pod_link.mac or "",
        container_index=pod_link.index,
        routes=programmed,
    )


def _pod_routes(
    spec: SetupSpec, routes: Sequence[PodRoute], results: Sequence[object]
) -> tuple[PodRoute, ...]:
    """The pod routes programmed, from the kernel's answers to ``routes``; a route another
    attachment of this pod already owns (EEXIST) is kept and not reported, and so is the
    IPv4 default route through a gateway routed out of another attachment's interface."""
    programmed: list[PodRoute] = []
    skipped_v4_gateway = False
    for route, result in zip(routes, results, strict=True):
        if not isinstance(result, NetlinkFailure):
            programmed.append(route)
            continue
        if skipped_v4_gateway and route.dst.version == 4 and route.dst.prefixlen == 0:
            # The gateway is routed out of another attachment's interface, so a default
            # route via this one could not be resolved (ENETUNREACH); that attachment's
            # default route serves the pod.
            log.info("pod default route is on another interface, not adding it on %s", spec.ifname)
            continue
        if result.errno != errno.EEXIST:
            raise result
        # Another attachment of this pod already owns the default route: keep it, and
        # report only what we programmed.
        log.info("pod route %s already exists, not adding it on %s", route, spec.ifname)
        if route.dst.version == 4 and route.gw is None:
            skipped_v4_gateway = True
    return tuple(programmed)


def _write_all(keys: Sequence[tuple[str, str]]) -> None:
    for key, value in keys:
        sysctl.write(key, value)


def _rollback(host: Rtnl, name: str, link: Link | None) -> None:
    """Delete the host veth we created (its peer and its routes go with it). Best effort."""
    try:
        if link is None:
            link = host.link_by_name(name)
        if link is not None:
            host.delete_link(link.index, name)
    except DataplaneError as exc:
        log.warning("rollback: could not delete host veth %s: %s", name, exc)


def teardown(
    netns_path: str | None,
    ifname: str,
    host_ifname: str | None,
    addresses: Sequence[IPAddress] | None = None,
) -> None:
    """Remove the attachment's data path. Idempotent; never touches what is not ours.

    * ``netns_path`` None/empty, missing, or vanished: only the host side is cleaned.
    * ``host_ifname`` None: the host veth's name is unknown (DEL with an invalid
      ``veth_prefix``), so no host link is looked for; only the pod side is, as below (its
      host end and that end's routes go with it).
    * ``netns_path`` is the caller's own namespace: :class:`~dataplane.errors.InvalidNetNS`,
      nothing is touched. A path that exists but is not a network namespace is logged and skipped.
    * Host routes of ``addresses`` are removed only where they point at ``host_ifname``:
      the kernel removes them with the link, in the same request.
    * Deleting the host veth removes its pod end too; if the host veth is gone (e.g. the
      prefix changed) the pod's ``ifname`` is deleted only if it is a veth whose peer lives in
      the host namespace, never a foreign interface of that name.
    """
    ns: NetNS | None = None
    if netns_path:
        try:
            ns = netns_mod.open_netns(netns_path)
        except NetNSNotFound:
            log.debug("teardown: netns %s is gone", netns_path)
        except InvalidNetNS as exc:
            if exc.own:
                raise
            log.warning("teardown: skipping the pod side: %s", exc)
    with ExitStack() as stack:
        if ns is not None:
            stack.enter_context(ns)
        host = stack.enter_context(Rtnl.here("host"))
        if host_ifname is not None:
            link = host.link_by_name(host_ifname)
            if link is not None and link.kind == "veth":
                host.delete_link(link.index, host_ifname)  # its routes go with it
                return
            if link is not None:
                log.warning("teardown: %s is a %s, not a veth; left alone", host_ifname, link.kind)
        if ns is None:
            return
        pod = stack.enter_context(Rtnl.in_netns(ns.fd, "pod"))
        pod_link = pod.link_by_name(ifname)
        if pod_link is None:
            return
        if _peer_is_in_host(pod, pod_link):
            log.info(
                "teardown: deleting pod interface %s (host end is not %s)",
                ifname,
                host_ifname or "known",
            )
            pod.delete_link(pod_link.index, ifname)
        else:
            log.info("teardown: pod interface %s is not our veth; left alone", ifname)


def pod_interface_present(netns_path: str, ifname: str) -> bool:
    """Whether the pod already has ``ifname`` as a veth to this host (a live attachment).
    A missing or unusable namespace is False."""
    if not netns_path:
        return False
    try:
        ns = netns_mod.open_netns(netns_path)
    except (NetNSNotFound, InvalidNetNS):
        return False
    with ns, Rtnl.in_netns(ns.fd, "pod") as pod:
        link = pod.link_by_name(ifname)
        return link is not None and _peer_is_in_host(pod, link)


def delete_host_veth(name: str) -> None:
    """Delete a host veth (its pod end and its routes go with it). Idempotent."""
    with Rtnl.here("host") as host:
        link = host.link_by_name(name)
        if link is None:
            return
        if link.kind != "veth":
            raise InterfaceConflict(
                f"{name} is not a veth",
                f"{name} is of kind {link.kind!r}; refusing to delete it",
            )
        host.delete_link(link.index, name)


def list_host_veths(prefix: str) -> list[HostVeth]:
    """Host veths whose name starts with ``prefix``, each with the /32 and /128 routes
    (main table) that point only at it. For GC."""
    with Rtnl.here("host") as host:
        veths = [v for v in host.links() if v.kind == "veth" and v.name.startswith(prefix)]
        if not veths:
            return []
        by_index: dict[int, list[IPNetwork]] = {v.index: [] for v in veths}
        for version, plen in ((4, 32), (6, 128)):
            for route in host.routes(version):
                if (
                    route.dst.prefixlen == plen
                    and route.oif is not None
                    and route.oif in by_index
                    and not route.multipath
                ):
                    by_index[route.oif].append(route.dst)
    return [
        HostVeth(v.name, v.index, v.up, v.alias, tuple(by_index[v.index]))
        for v in sorted(veths, key=lambda v: v.name)
    ]


# --- CHECK ---------------------------------------------------------------------------------


def _same_mac(a: str | None, b: str | None) -> bool:
    return (a or "").lower() == (b or "").lower()


def check(spec: SetupSpec, expected: ExpectedState | None = None) -> None:
    """Raise :class:`~dataplane.errors.CheckMismatch` describing the first difference from
    what :func:`setup` built. Extra addresses and routes (other chained plugins) are
    tolerated; the MAC is compared with ``expected.container_mac`` (the final one), else
    ``spec.mac``."""
    expected = expected or ExpectedState()
    with netns_mod.open_netns(spec.netns_path) as ns, _sockets(ns) as (host, pod):
        pod_link = pod.link_by_name(spec.ifname)
        if pod_link is None:
            raise CheckMismatch(
                f"interface {spec.ifname} not found in the pod", f"netns {spec.netns_path}"
            )
        want_mac = expected.container_mac or spec.mac
        if want_mac and not _same_mac(pod_link.mac, want_mac):
            raise CheckMismatch(
                f"{spec.ifname} has MAC {pod_link.mac}, expected {want_mac}",
                f"netns {spec.netns_path}",
            )
        if not pod_link.up:
            raise CheckMismatch(f"{spec.ifname} is down in the pod", f"netns {spec.netns_path}")
        have = {(a.address, a.prefixlen) for a in pod.addresses(pod_link.index)}
        for address in spec.addresses:
            plen = 32 if address.version == 4 else 128
            if (address, plen) not in have:
                raise CheckMismatch(
                    f"address {address}/{plen} missing on {spec.ifname}",
                    f"netns {spec.netns_path} has {sorted(str(a) for a, _ in have)}",
                )
        want_routes = (
            expected.routes if expected.routes is not None else default_pod_routes(spec.addresses)
        )
        _check_pod_routes(pod, pod_link, want_routes, spec)

        host_link = host.link_by_name(spec.host_ifname)
        if host_link is None or host_link.kind != "veth":
            raise CheckMismatch(f"host veth {spec.host_ifname} not found", "in the host netns")
        if not host_link.up:
            raise CheckMismatch(f"host veth {spec.host_ifname} is down", "in the host netns")
        if not _is_our_peer(host, pod, ns, host_link, pod_link):
            raise CheckMismatch(
                f"host veth {spec.host_ifname} is not the peer of {spec.ifname}",
                f"host peer index {host_link.peer_index}, pod index {pod_link.index}",
            )
        _check_host_routes(host, host_link, spec)
        _check_host_sysctls(spec)
        if spec.allow_ip_forwarding:
            keys = _pod_sysctls(
                spec.ifname, ipv4=spec.has_ipv4, ipv6=spec.has_ipv6, forwarding=True
            )
            values = netns_mod.run_in_netns(ns.fd, lambda: [sysctl.read(k) for k, _ in keys])
            for (key, want), got in zip(keys, values, strict=True):
                if got != want:
                    raise CheckMismatch(
                        f"pod sysctl net/{key} is {got}, expected {want}",
                        f"netns {spec.netns_path}",
                    )


def _check_pod_routes(pod: Rtnl, pod_link: Link, want: Sequence[PodRoute], spec: SetupSpec) -> None:
    have = {
        (r.dst, r.gw)
        for version in {w.dst.version for w in want}
        for r in pod.routes(version, oif=pod_link.index)
    }
    for route in want:
        if (route.dst, route.gw) not in have:
            raise CheckMismatch(
                f"pod route {route} dev {spec.ifname} missing", f"netns {spec.netns_path}"
            )


def _check_host_routes(host: Rtnl, host_link: Link, spec: SetupSpec) -> None:
    for version in sorted({a.version for a in spec.addresses}):
        have = {r.dst for r in host.routes(version, oif=host_link.index)}
        for address in spec.addresses:
            if address.version == version and host_prefix(address) not in have:
                raise CheckMismatch(
                    f"host route {host_prefix(address)} dev {spec.host_ifname} missing",
                    "in the host netns",
                )


def _check_host_sysctls(spec: SetupSpec) -> None:
    keys = _host_sysctls(spec.host_ifname, ipv4=spec.has_ipv4, ipv6=spec.has_ipv6)
    for key, want, missing_ok in keys:
        got = sysctl.read(key)
        if got is None and missing_ok:
            continue
        if got != want:
            raise CheckMismatch(f"host sysctl net/{key} is {got}, expected {want}", "host netns")
