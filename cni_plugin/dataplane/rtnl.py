"""A small typed facade over pyroute2's ``IPRoute``: the only module that touches pyroute2.

pyroute2 ships no type information; everything it returns is converted here into the
frozen dataclasses below, so ``Any`` stops at this module's border. Every failure becomes a
:class:`NetlinkFailure` (a ``CniError`` with code 103) that names the operation, the
namespace it ran in and the errno.

Sockets: an :class:`Rtnl` owns one NETLINK_ROUTE socket that *we* create, either in the
calling thread (:meth:`Rtnl.here`) or in a worker thread that entered another namespace
(:meth:`Rtnl.in_netns`). pyroute2 is handed the socket (``use_socket``), so it never opens one
of its own; a netlink socket stays bound to the namespace it was created in, so the object
can then be used from the calling thread. (pyroute2's own sockets are per *thread*, which is
why we do not let it create them.)
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import ipaddress
import os
import socket
from collections.abc import Callable
from typing import Any

from cni_plugin.dataplane import lazy_pyroute2

# Any pyroute2 submodule would run the package __init__ (it imports nearly every pyroute2
# family): registering the package lazily first saves ~80 ms per CNI process. Only this
# module, itself loaded lazily, imports pyroute2.
lazy_pyroute2.prepare("pyroute2")
lazy_pyroute2.prepare("pyroute2.iproute")

from pyroute2.iproute.linux import IPRoute  # noqa: E402
from pyroute2.netlink.exceptions import NetlinkError  # noqa: E402

from cni_plugin.cni.errors import CniError, Code  # noqa: E402
from cni_plugin.dataplane import netns as netns_mod  # noqa: E402
from cni_plugin.dataplane.model import IPAddress, IPNetwork  # noqa: E402

IFF_UP = 0x1
IFA_F_NODAD = 0x02
RT_TABLE_MAIN = 254
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_LINK = 253
RT_SCOPE_NOWHERE = 255  # "any scope" when deleting an IPv4 route
RTPROT_BOOT = 3  # what `ip route add` uses
RTN_UNICAST = 1
SOL_NETLINK = 270
NETLINK_EXT_ACK = 11


class NetlinkFailure(CniError):
    """A netlink request failed (code 103). ``errno`` is the kernel's error number."""

    def __init__(self, op: str, where: str, err: int) -> None:
        name = errno_mod.errorcode.get(err, str(err))
        super().__init__(
            Code.DATAPLANE,
            f"netlink: {op} failed",
            f"{op} (in {where} netns): errno {err} {name} ({os.strerror(err)})",
        )
        self.op = op
        self.where = where
        self.errno = err


@dataclasses.dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str | None
    mac: str | None
    up: bool
    mtu: int
    #: IFLA_LINK: for a veth, the peer's ifindex (in the peer's namespace).
    peer_index: int | None
    #: IFLA_LINK_NETNSID: set when the peer lives in another namespace (its nsid from here).
    peer_netnsid: int | None
    #: IPv6 ``disable_ipv6`` of this link; None if the kernel reports no IPv6 state for it.
    ipv6_disabled: bool | None = None
    #: IFLA_IFALIAS ("" if unset).
    alias: str = ""


@dataclasses.dataclass(frozen=True)
class Addr:
    index: int
    address: IPAddress
    prefixlen: int


@dataclasses.dataclass(frozen=True)
class Route:
    dst: IPNetwork
    gw: IPAddress | None
    oif: int | None
    scope: int
    table: int
    multipath: bool


def _family(version: int) -> int:
    return socket.AF_INET if version == 4 else socket.AF_INET6


def _new_socket() -> socket.socket:
    sock = socket.socket(
        socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
    )
    try:  # extended acks give better kernel messages; harmless if unsupported
        sock.setsockopt(SOL_NETLINK, NETLINK_EXT_ACK, 1)
    except OSError:
        pass
    return sock


class Rtnl:
    """One rtnetlink socket bound to one network namespace. Not thread-safe: use it from the
    thread that created the object."""

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.where = where
        try:
            self._ipr: Any = IPRoute(use_socket=sock)
        except Exception:
            sock.close()
            raise

    @classmethod
    def here(cls, where: str = "host") -> Rtnl:
        """A socket in the calling thread's namespace."""
        return cls(_new_socket(), where)

    @classmethod
    def in_netns(cls, fd: int, where: str = "pod") -> Rtnl:
        """A socket in the namespace ``fd``, created by a short-lived worker thread."""
        try:
            sock = netns_mod.run_in_netns(fd, _new_socket)
        except OSError as exc:
            raise NetlinkFailure("open socket", where, exc.errno or errno_mod.EIO) from None
        return cls(sock, where)

    def close(self) -> None:
        self._ipr.close()  # closes the socket we handed over, too

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _call(self, op: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except NetlinkError as exc:
            raise NetlinkFailure(op, self.where, int(exc.code)) from None
        except OSError as exc:
            raise NetlinkFailure(op, self.where, exc.errno or errno_mod.EIO) from None

    # --- links -------------------------------------------------------------------------

    @staticmethod
    def _link(msg: Any) -> Link:
        kind = msg.get(("linkinfo", "kind"))
        mac = msg.get("address")
        peer = msg.get("link")
        nsid = msg.get("link_netnsid")
        alias = msg.get("ifalias")
        inet6 = msg.get(("af_spec", "af_inet6", "inet6_conf"))
        v6off = inet6.get("disable_ipv6") if isinstance(inet6, dict) else None
        return Link(
            index=int(msg["index"]),
            name=str(msg.get("ifname")),
            kind=str(kind) if kind is not None else None,
            mac=str(mac).lower() if mac is not None else None,
            up=bool(int(msg["flags"]) & IFF_UP),
            mtu=int(msg.get("mtu") or 0),
            peer_index=int(peer) if peer is not None else None,
            peer_netnsid=int(nsid) if nsid is not None else None,
            ipv6_disabled=bool(v6off) if v6off is not None else None,
            alias=str(alias) if alias else "",
        )

    def link_by_name(self, name: str) -> Link | None:
        return self._get_link(f"get link {name}", ifname=name)

    def link_by_index(self, index: int) -> Link | None:
        return self._get_link(f"get link #{index}", index=index)

    def _get_link(self, what: str, **selector: Any) -> Link | None:
        """The one link the selector names, or None when it does not exist (ENODEV)."""
        try:
            msgs = self._call(what, self._ipr.link, "get", **selector)
        except NetlinkFailure as exc:
            if exc.errno == errno_mod.ENODEV:
                return None
            raise
        for msg in msgs:
            return self._link(msg)
        return None

    def links(self) -> list[Link]:
        msgs = self._call("dump links", self._ipr.link, "dump")
        return [self._link(m) for m in msgs]

    def add_veth(
        self,
        name: str,
        *,
        mac: str,
        mtu: int,
        peer_name: str,
        peer_netns_fd: int,
        peer_mac: str | None,
    ) -> None:
        """Create veth ``name`` here, with its peer created directly in ``peer_netns_fd``."""
        peer: dict[str, Any] = {"ifname": peer_name, "net_ns_fd": peer_netns_fd, "mtu": mtu}
        if peer_mac is not None:
            peer["address"] = peer_mac
        self._call(
            f"create veth {name} (peer {peer_name} in the pod)",
            self._ipr.link,
            "add",
            ifname=name,
            kind="veth",
            address=mac,
            mtu=mtu,
            peer=peer,
        )

    def set_up(self, link: Link, *, alias: str | None = None) -> None:
        """Bring ``link`` up, setting its alias in the same request (the kernel ignores
        IFLA_IFALIAS when a link is created)."""
        kwargs: dict[str, Any] = {"index": link.index, "state": "up"}
        if alias:
            # The kernel takes at most IFALIASZ - 1 = 255 bytes; a longer alias would make
            # the whole ADD fail, so keep its (meaningful) beginning.
            kwargs["ifalias"] = alias.encode()[:255].decode(errors="ignore")
        self._call(f"set {link.name} up", self._ipr.link, "set", **kwargs)

    def delete_link(self, index: int, name: str) -> bool:
        """Delete a link; False if it was already gone."""
        try:
            self._call(f"delete link {name}", self._ipr.link, "del", index=index)
        except NetlinkFailure as exc:
            if exc.errno == errno_mod.ENODEV:
                return False
            raise
        return True

    def netnsid_of(self, fd: int) -> int | None:
        """The nsid this namespace has assigned to the namespace ``fd`` (None if none)."""
        reply = self._call("get netns id", self._ipr.get_netnsid, fd=fd)
        if not reply:
            return None
        nsid = reply.get("nsid")
        if nsid is None or int(nsid) < 0:
            return None
        return int(nsid)

    # --- addresses ---------------------------------------------------------------------

    def add_address(self, link: Link, address: IPAddress) -> None:
        plen = 32 if address.version == 4 else 128
        kwargs: dict[str, Any] = {
            "index": link.index,
            "address": str(address),
            "prefixlen": plen,
        }
        if address.version == 6:
            kwargs["flags"] = IFA_F_NODAD  # usable at once, no DAD wait
        self._call(f"add address {address}/{plen} to {link.name}", self._ipr.addr, "add", **kwargs)

    def addresses(self, index: int) -> list[Addr]:
        msgs = self._call(f"dump addresses of #{index}", self._ipr.addr, "dump")
        out: list[Addr] = []
        for msg in msgs:
            if int(msg["index"]) != index:
                continue
            # IPv4 point-to-point style addresses carry IFA_LOCAL; IFA_ADDRESS is the peer.
            raw = msg.get("local") or msg.get("address")
            if raw is None:
                continue
            out.append(Addr(index, ipaddress.ip_address(str(raw)), int(msg["prefixlen"])))
        return out

    # --- routes ------------------------------------------------------------------------

    def _route_kwargs(
        self, dst: IPNetwork, oif: int, gw: IPAddress | None, scope: int
    ) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "family": _family(dst.version),
            "dst": str(dst.network_address),
            "dst_len": dst.prefixlen,
            "oif": oif,
            "table": RT_TABLE_MAIN,
            "proto": RTPROT_BOOT,
            "type": RTN_UNICAST,
        }
        if dst.version == 4:
            kwargs["scope"] = scope
        if gw is not None:
            kwargs["gateway"] = str(gw)
        return kwargs

    def add_route(
        self,
        dst: IPNetwork,
        oif: int,
        *,
        gw: IPAddress | None = None,
        scope: int = RT_SCOPE_UNIVERSE,
        replace: bool = False,
    ) -> None:
        cmd = "replace" if replace else "add"
        via = f" via {gw}" if gw is not None else ""
        self._call(
            f"{cmd} route {dst}{via} dev #{oif}",
            self._ipr.route,
            cmd,
            **self._route_kwargs(dst, oif, gw, scope),
        )

    def delete_route(self, dst: IPNetwork, oif: int) -> bool:
        """Delete the route to ``dst`` *through ``oif``* only; False if there was none."""
        kwargs = self._route_kwargs(dst, oif, None, RT_SCOPE_NOWHERE)
        del kwargs["proto"], kwargs["type"]
        try:
            self._call(f"delete route {dst} dev #{oif}", self._ipr.route, "del", **kwargs)
        except NetlinkFailure as exc:
            if exc.errno in (errno_mod.ESRCH, errno_mod.ENOENT):
                return False
            raise
        return True

    def routes(self, version: int) -> list[Route]:
        """Main-table unicast routes of one family."""
        msgs = self._call(
            f"dump IPv{version} routes", self._ipr.route, "dump", family=_family(version)
        )
        out: list[Route] = []
        for msg in msgs:
            table = msg.get("table")
            table = int(table) if table is not None else int(msg["table"])
            if table != RT_TABLE_MAIN or int(msg["type"]) != RTN_UNICAST:
                continue
            dst_raw = msg.get("dst")
            plen = int(msg["dst_len"])
            if dst_raw is None:
                dst_raw = "0.0.0.0" if version == 4 else "::"
            gw_raw = msg.get("gateway")
            oif = msg.get("oif")
            out.append(
                Route(
                    dst=ipaddress.ip_network(f"{dst_raw}/{plen}", strict=False),
                    gw=ipaddress.ip_address(str(gw_raw)) if gw_raw is not None else None,
                    oif=int(oif) if oif is not None else None,
                    scope=int(msg["scope"]),
                    table=table,
                    multipath=msg.get("multipath") is not None,
                )
            )
        return out
