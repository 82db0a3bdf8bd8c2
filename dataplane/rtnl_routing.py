"""The rtnetlink requests of the node agent's routing (VXLAN/IP-in-IP devices, neighbours,
FDB entries, tabby's own routes), on the transport of :mod:`dataplane.rtnl`.

Only tabby-node loads this module (never the per-call CNI binaries). As in ``rtnl``,
pyroute2 only builds and decodes the messages, and everything it returns is converted into
the frozen types of :mod:`dataplane.overlay_model` here.

Dumps are filtered by the kernel (the socket asks for strict checking): routes by table and
protocol, neighbours and FDB entries by device, so a node with thousands of routes of other
daemons costs nothing extra. The filters are applied again here for kernels without strict
checking (< 4.20).
"""

from __future__ import annotations

import errno as errno_mod
import ipaddress
from typing import cast

from dataplane import lazy_pyroute2

lazy_pyroute2.prepare("pyroute2")  # before any pyroute2 submodule (see rtnl.py)

from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg  # noqa: E402
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg  # noqa: E402
from pyroute2.netlink.rtnl.ndmsg import ndmsg  # noqa: E402
from pyroute2.netlink.rtnl.rtmsg import rtmsg  # noqa: E402

from bundle.types import IPAddress, IPNetwork  # noqa: E402
from dataplane import rtnl  # noqa: E402
from dataplane.errors import NetlinkFailure  # noqa: E402
from dataplane.overlay_model import (  # noqa: E402
    NUD_PERMANENT,
    RT_TABLE_MAIN,
    RTN_BLACKHOLE,
    RTN_UNICAST,
    KernelAddress,
    KernelFdb,
    KernelNeighbour,
    KernelRoute,
    LinkState,
    VxlanAttrs,
    default_metric,
    family,
)
from dataplane.rtnl import (  # noqa: E402
    IFF_UP,
    NLM_F_CREATE,
    NLM_F_DUMP,
    NLM_F_EXCL,
    NLM_F_REPLACE,
    RT_SCOPE_NOWHERE,
    RT_SCOPE_UNIVERSE,
    RTM_GETADDR,
    RTM_GETLINK,
    RTM_GETROUTE,
    RTM_NEWADDR,
    RTM_NEWLINK,
    RTM_NEWROUTE,
    Attr,
    Message,
    Rtnl,
)

RTM_DELADDR = 21
RTM_DELROUTE = 25
RTM_NEWNEIGH, RTM_DELNEIGH, RTM_GETNEIGH = 28, 29, 30
AF_BRIDGE = 7
NTF_SELF = 0x02
RTNH_F_ONLINK = 0x4
RTM_F_FIB_MATCH = 0x2000
IFA_F_NODAD = 0x02

#: ifinfmsg's IFLA_INFO_DATA that each kind's ``validate`` rejects (kernel: vxlan_validate
#: "VXLAN ID must be lower than 16777216", ipip_tunnel_validate: unknown protocol). Used by
#: :meth:`RoutingRtnl.link_kind_supported` so that probing a kind creates nothing.
_INVALID_DATA: dict[str, list[Attr]] = {
    "vxlan": [("IFLA_VXLAN_ID", 1 << 24)],
    "ipip": [("IFLA_IPIP_PROTO", 253)],
}


def _ip(raw: object) -> IPAddress:
    return ipaddress.ip_address(str(raw))


class RoutingRtnl(Rtnl):
    """An :class:`~dataplane.rtnl.Rtnl` that also speaks neighbours, FDB entries,
    VXLAN/IP-in-IP links and routes of any type and protocol."""

    _decoders = {**rtnl.Rtnl._decoders, RTM_NEWNEIGH: ndmsg}

    @classmethod
    def here(cls, where: str = "node") -> RoutingRtnl:
        return cast(RoutingRtnl, super().here(where))

    def __enter__(self) -> RoutingRtnl:
        return self

    # --- links -------------------------------------------------------------------------

    def link_state(self, name: str) -> LinkState | None:
        """The link ``name`` with its VXLAN attributes (if it is one), None if absent."""
        msg = ifinfmsg()
        msg["attrs"] = [("IFLA_IFNAME", name)]
        try:
            replies = self._request(f"get link {name}", msg, RTM_GETLINK)
        except NetlinkFailure as exc:
            if exc.errno == errno_mod.ENODEV:
                return None
            raise
        return self._link_state(replies[0]) if replies else None

    def link_states(self) -> list[LinkState]:
        replies = self._request("dump links", ifinfmsg(), RTM_GETLINK, NLM_F_DUMP)
        return [self._link_state(m) for m in replies]

    @staticmethod
    def _link_state(msg: Message) -> LinkState:
        link = Rtnl._link(msg)
        vxlan = None
        if link.kind == "vxlan":
            data = msg.get(("linkinfo", "data"))
            if data is not None:
                local = data.get("vxlan_local") or data.get("vxlan_local6")
                vni, port = data.get("vxlan_id"), data.get("vxlan_port")
                vxlan = VxlanAttrs(
                    vni=int(vni) if vni is not None else None,
                    port=int(port) if port is not None else None,
                    local=_ip(local) if local else None,
                    learning=bool(data.get("vxlan_learning")),
                )
        return LinkState(link.index, link.name, link.kind, link.mac, link.mtu, link.up, vxlan)

    @staticmethod
    def _vxlan_data(
        *, vni: int | None, port: int | None, local: IPAddress | None, learning: bool
    ) -> list[Attr]:
        data: list[Attr] = []
        if vni is not None:
            data.append(("IFLA_VXLAN_ID", vni))
        if port is not None:
            data.append(("IFLA_VXLAN_PORT", port))
        if local is not None:
            key = "IFLA_VXLAN_LOCAL" if local.version == 4 else "IFLA_VXLAN_LOCAL6"
            data.append((key, str(local)))
        data.append(("IFLA_VXLAN_LEARNING", int(learning)))
        return data

    def create_vxlan(
        self,
        name: str,
        *,
        vni: int,
        port: int,
        local: IPAddress,
        learning: bool,
        mac: str,
        mtu: int,
    ) -> None:
        """Create a VXLAN device, up, with its MAC and MTU, in one request."""
        msg = ifinfmsg()
        msg["flags"] = IFF_UP
        msg["change"] = IFF_UP
        data = self._vxlan_data(vni=vni, port=port, local=local, learning=learning)
        msg["attrs"] = [
            ("IFLA_IFNAME", name),
            ("IFLA_ADDRESS", mac),
            ("IFLA_MTU", mtu),
            (
                "IFLA_LINKINFO",
                {"attrs": [("IFLA_INFO_KIND", "vxlan"), ("IFLA_INFO_DATA", {"attrs": data})]},
            ),
        ]
        self._request(
            f"create vxlan {name} (vni {vni}, port {port}, local {local})",
            msg,
            RTM_NEWLINK,
            NLM_F_CREATE | NLM_F_EXCL,
        )

    def change_vxlan(
        self, link: LinkState, *, local: IPAddress | None = None, learning: bool
    ) -> None:
        """Change a VXLAN device's local address and learning in place (the kernel refuses
        to change the VNI or port of an existing device)."""
        msg = ifinfmsg()
        msg["index"] = link.index
        data = self._vxlan_data(vni=None, port=None, local=local, learning=learning)
        msg["attrs"] = [
            (
                "IFLA_LINKINFO",
                {"attrs": [("IFLA_INFO_KIND", "vxlan"), ("IFLA_INFO_DATA", {"attrs": data})]},
            )
        ]
        self._request(f"change vxlan {link.name}", msg, RTM_NEWLINK)

    def create_link(self, name: str, kind: str, *, mtu: int) -> None:
        """Create a link of ``kind`` with no kind-specific attributes, up."""
        msg = ifinfmsg()
        msg["flags"] = IFF_UP
        msg["change"] = IFF_UP
        msg["attrs"] = [
            ("IFLA_IFNAME", name),
            ("IFLA_MTU", mtu),
            ("IFLA_LINKINFO", {"attrs": [("IFLA_INFO_KIND", kind)]}),
        ]
        self._request(f"create {kind} {name}", msg, RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL)

    def set_link(
        self,
        link: LinkState,
        *,
        mtu: int | None = None,
        mac: str | None = None,
        up: bool | None = None,
    ) -> None:
        msg = ifinfmsg()
        msg["index"] = link.index
        attrs: list[Attr] = []
        what = []
        if mtu is not None:
            attrs.append(("IFLA_MTU", mtu))
            what.append(f"mtu {mtu}")
        if mac is not None:
            attrs.append(("IFLA_ADDRESS", mac))
            what.append(f"address {mac}")
        if up is not None:
            msg["flags"] = IFF_UP if up else 0
            msg["change"] = IFF_UP
            what.append("up" if up else "down")
        msg["attrs"] = attrs
        self._request(f"set {link.name} {' '.join(what)}", msg, RTM_NEWLINK)

    def link_kind_supported(self, kind: str, probe_name: str) -> tuple[bool, str]:
        """Whether the kernel can create links of ``kind`` (loading its module on demand),
        found without creating one: the request carries kind-specific data that the kind's
        own validation rejects. An unknown kind is EOPNOTSUPP ("Unknown device type")
        before any validation. Returns (supported, the kernel's answer)."""
        msg = ifinfmsg()
        info: list[Attr] = [("IFLA_INFO_KIND", kind)]
        invalid = _INVALID_DATA.get(kind)
        if invalid is not None:
            info.append(("IFLA_INFO_DATA", {"attrs": invalid}))
        msg["attrs"] = [("IFLA_IFNAME", probe_name), ("IFLA_LINKINFO", {"attrs": info})]
        try:
            self._request(f"probe link kind {kind}", msg, RTM_NEWLINK, NLM_F_CREATE | NLM_F_EXCL)
        except NetlinkFailure as exc:
            if exc.errno == errno_mod.EOPNOTSUPP:
                return False, exc.details
            return True, exc.details
        # Validation let it through (a kernel without the check): it exists now, remove it.
        made = self.link_by_name(probe_name)
        if made is not None:
            self.delete_link(made.index, probe_name)
        return True, "created and removed a probe link"

    # --- addresses ---------------------------------------------------------------------

    def address_states(self, index: int | None = None) -> list[KernelAddress]:
        """Addresses of every link (or of link ``index``), both families."""
        msg = ifaddrmsg()
        if index is not None:
            msg["index"] = index
        replies = self._request("dump addresses", msg, RTM_GETADDR, NLM_F_DUMP)
        out: list[KernelAddress] = []
        for reply in replies:
            if index is not None and int(reply["index"]) != index:
                continue
            raw = reply.get_attr("IFA_LOCAL") or reply.get_attr("IFA_ADDRESS")
            if raw is None:
                continue
            flags = reply.get_attr("IFA_FLAGS")
            out.append(
                KernelAddress(
                    index=int(reply["index"]),
                    address=_ip(raw),
                    prefixlen=int(reply["prefixlen"]),
                    scope=int(reply["scope"]),
                    flags=int(flags) if flags is not None else int(reply["flags"]),
                )
            )
        return out

    def _address_msg(self, index: int, address: IPAddress, prefixlen: int) -> Message:
        msg: Message = ifaddrmsg()
        msg["family"] = family(address.version)
        msg["prefixlen"] = prefixlen
        msg["index"] = index
        if address.version == 4:
            msg["attrs"] = [("IFA_LOCAL", str(address)), ("IFA_ADDRESS", str(address))]
        else:
            msg["flags"] = IFA_F_NODAD
            msg["attrs"] = [("IFA_ADDRESS", str(address))]
        return msg

    def add_prefixed_address(self, link: LinkState, address: IPAddress, prefixlen: int) -> None:
        msg = self._address_msg(link.index, address, prefixlen)
        self._request(
            f"add address {address}/{prefixlen} to {link.name}",
            msg,
            RTM_NEWADDR,
            NLM_F_CREATE | NLM_F_REPLACE,
        )

    def delete_address(self, link: LinkState, address: IPAddress, prefixlen: int) -> bool:
        msg = self._address_msg(link.index, address, prefixlen)
        return self._delete(
            f"delete address {address}/{prefixlen} of {link.name}",
            msg,
            RTM_DELADDR,
            absent=(errno_mod.EADDRNOTAVAIL, errno_mod.ENODEV),
        )

    # --- routes ------------------------------------------------------------------------

    @staticmethod
    def _kernel_route(msg: Message, version: int) -> KernelRoute:
        # One pass over the attributes: pyroute2's get() scans them on every call, which
        # is most of the cost of a dump of a thousand routes.
        attrs = {slot[0]: slot[1] for slot in msg["attrs"]}
        table = attrs.get("RTA_TABLE", msg["table"])
        dst_raw = attrs.get("RTA_DST")
        if dst_raw is None:
            dst_raw = "0.0.0.0" if version == 4 else "::"
        gw = attrs.get("RTA_GATEWAY")
        oif = attrs.get("RTA_OIF")
        metric = attrs.get("RTA_PRIORITY")
        return KernelRoute(
            dst=ipaddress.ip_network(f"{dst_raw}/{int(msg['dst_len'])}", strict=False),
            type=int(msg["type"]),
            proto=int(msg["proto"]),
            gw=_ip(gw) if gw is not None else None,
            oif=int(oif) if oif is not None else None,
            onlink=bool(int(msg["flags"]) & RTNH_F_ONLINK),
            metric=int(metric) if metric is not None else default_metric(version),
            table=int(table),
            multipath="RTA_MULTIPATH" in attrs,
        )

    def routes_of(self, version: int, proto: int) -> list[KernelRoute]:
        """Main-table routes of one family whose protocol is ``proto``, of every type."""
        query = rtmsg()
        query["family"] = family(version)
        query["table"] = RT_TABLE_MAIN
        query["proto"] = proto
        msgs = self._request(
            f"dump IPv{version} routes of protocol {proto}", query, RTM_GETROUTE, NLM_F_DUMP
        )
        out = []
        for msg in msgs:
            route = self._kernel_route(msg, version)
            if route.table == RT_TABLE_MAIN and route.proto == proto:
                out.append(route)
        return out

    def route_matching(self, dst: IPNetwork) -> KernelRoute | None:
        """The route the kernel would use for ``dst``'s first address (the FIB entry itself,
        RTM_F_FIB_MATCH, through the policy rules), or None if there is none."""
        msg = rtmsg()
        plen = dst.max_prefixlen
        msg["family"] = family(dst.version)
        msg["dst_len"] = plen
        msg["flags"] = RTM_F_FIB_MATCH
        msg["attrs"] = [("RTA_DST", str(dst.network_address))]
        try:
            replies = self._request(f"get route {dst}", msg, RTM_GETROUTE)
        except NetlinkFailure as exc:
            if exc.errno in (errno_mod.ENETUNREACH, errno_mod.EHOSTUNREACH, errno_mod.ESRCH):
                return None
            raise
        return self._kernel_route(replies[0], dst.version) if replies else None

    def route_exact(self, dst: IPNetwork, metric: int) -> KernelRoute | None:
        """The main-table route of exactly ``dst`` at ``metric``, of any protocol (a dump
        of the family's main table), or None."""
        query = rtmsg()
        query["family"] = family(dst.version)
        query["table"] = RT_TABLE_MAIN
        msgs = self._request(f"dump IPv{dst.version} routes", query, RTM_GETROUTE, NLM_F_DUMP)
        for msg in msgs:
            if int(msg["dst_len"]) != dst.prefixlen:
                continue
            route = self._kernel_route(msg, dst.version)
            if route.table == RT_TABLE_MAIN and route.dst == dst and route.metric == metric:
                return route
        return None

    def write_route(
        self,
        dst: IPNetwork,
        *,
        proto: int,
        blackhole: bool,
        gw: IPAddress | None = None,
        oif: int | None = None,
        onlink: bool = False,
        replace: bool = False,
        what: str = "",
    ) -> None:
        """Add (failing with EEXIST if the key is taken) or replace one main-table route at
        the kernel's default metric."""
        msg = rtmsg()
        msg["family"] = family(dst.version)
        msg["dst_len"] = dst.prefixlen
        msg["table"] = RT_TABLE_MAIN
        msg["proto"] = proto
        msg["type"] = RTN_BLACKHOLE if blackhole else RTN_UNICAST
        msg["scope"] = RT_SCOPE_UNIVERSE
        msg["flags"] = RTNH_F_ONLINK if onlink else 0
        attrs: list[Attr] = []
        if dst.prefixlen:
            attrs.append(("RTA_DST", str(dst.network_address)))
        if oif is not None:
            attrs.append(("RTA_OIF", oif))
        if gw is not None:
            attrs.append(("RTA_GATEWAY", str(gw)))
        msg["attrs"] = attrs
        flags = NLM_F_CREATE | (NLM_F_REPLACE if replace else NLM_F_EXCL)
        op = f"{'replace' if replace else 'add'} route {what or dst}"
        self._request(op, msg, RTM_NEWROUTE, flags)

    def delete_kernel_route(self, route: KernelRoute) -> bool:
        """Delete exactly ``route`` (as dumped: protocol, type, metric, next hop); False if
        it was already gone. A route of another protocol with the same prefix never
        matches."""
        msg = rtmsg()
        msg["family"] = family(route.dst.version)
        msg["dst_len"] = route.dst.prefixlen
        msg["table"] = RT_TABLE_MAIN
        msg["proto"] = route.proto
        msg["type"] = route.type
        msg["scope"] = RT_SCOPE_NOWHERE if route.dst.version == 4 else RT_SCOPE_UNIVERSE
        attrs: list[Attr] = [("RTA_PRIORITY", route.metric)]
        if route.dst.prefixlen:
            attrs.append(("RTA_DST", str(route.dst.network_address)))
        if route.type != RTN_BLACKHOLE and not route.multipath:
            if route.oif is not None:
                attrs.append(("RTA_OIF", route.oif))
            if route.gw is not None:
                attrs.append(("RTA_GATEWAY", str(route.gw)))
        msg["attrs"] = attrs
        return self._delete(f"delete route {route}", msg, RTM_DELROUTE)

    def delete_route_of(self, dst: IPNetwork, *, proto: int, metric: int) -> bool:
        """Delete the main-table route of ``dst`` at ``metric`` whose protocol is
        ``proto``, whatever its type and next hop (no type, scope or next hop in the
        request: the kernel matches any); False if there is none. A route of another
        protocol for the same prefix never matches."""
        msg = rtmsg()
        msg["family"] = family(dst.version)
        msg["dst_len"] = dst.prefixlen
        msg["table"] = RT_TABLE_MAIN
        msg["proto"] = proto
        msg["type"] = 0  # RTN_UNSPEC: any type
        msg["scope"] = RT_SCOPE_NOWHERE if dst.version == 4 else RT_SCOPE_UNIVERSE
        attrs: list[Attr] = [("RTA_PRIORITY", metric)]
        if dst.prefixlen:
            attrs.append(("RTA_DST", str(dst.network_address)))
        msg["attrs"] = attrs
        return self._delete(f"delete route {dst} proto {proto} metric {metric}", msg, RTM_DELROUTE)

    # --- neighbours and FDB entries ----------------------------------------------------

    def neighbours(self, version: int, ifindex: int) -> list[KernelNeighbour]:
        msg = ndmsg()
        msg["family"] = family(version)
        # Strict checking wants the device as NDA_IFINDEX here (a header ifindex is EINVAL).
        msg["attrs"] = [("NDA_IFINDEX", ifindex)]
        replies = self._request(
            f"dump IPv{version} neighbours of #{ifindex}", msg, RTM_GETNEIGH, NLM_F_DUMP
        )
        out = []
        for reply in replies:
            dst = reply.get("dst")
            if int(reply["ifindex"]) != ifindex or dst is None:
                continue
            mac = reply.get("lladdr")
            out.append(
                KernelNeighbour(
                    ifindex=ifindex,
                    address=_ip(dst),
                    mac=str(mac).lower() if mac is not None else None,
                    state=int(reply["state"]),
                )
            )
        return out

    def set_neighbour(self, ifindex: int, address: IPAddress, mac: str, *, what: str) -> None:
        """``ip neigh replace <address> lladdr <mac> dev <ifindex> nud permanent``."""
        msg = ndmsg()
        msg["family"] = family(address.version)
        msg["ifindex"] = ifindex
        msg["state"] = NUD_PERMANENT
        msg["attrs"] = [("NDA_DST", str(address)), ("NDA_LLADDR", mac)]
        self._request(f"set {what}", msg, RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE)

    def delete_neighbour(self, ifindex: int, address: IPAddress, *, what: str) -> bool:
        msg = ndmsg()
        msg["family"] = family(address.version)
        msg["ifindex"] = ifindex
        msg["attrs"] = [("NDA_DST", str(address))]
        return self._delete(f"delete {what}", msg, RTM_DELNEIGH)

    def fdb_entries(self, ifindex: int) -> list[KernelFdb]:
        """The device's own FDB entries (``bridge fdb show dev X self``)."""
        msg = ndmsg()
        msg["family"] = AF_BRIDGE
        msg["ifindex"] = ifindex
        replies = self._request(f"dump fdb of #{ifindex}", msg, RTM_GETNEIGH, NLM_F_DUMP)
        out = []
        for reply in replies:
            mac = reply.get("lladdr")
            if int(reply["ifindex"]) != ifindex or mac is None:
                continue
            if not int(reply["flags"]) & NTF_SELF:
                continue
            dst, port, vni = reply.get("dst"), reply.get("port"), reply.get("vni")
            out.append(
                KernelFdb(
                    ifindex=ifindex,
                    mac=str(mac).lower(),
                    dst=_ip(dst) if dst is not None else None,
                    state=int(reply["state"]),
                    port=int(port) if port is not None else None,
                    vni=int(vni) if vni is not None else None,
                )
            )
        return out

    def set_fdb(self, ifindex: int, mac: str, dst: IPAddress, *, what: str) -> None:
        """``bridge fdb replace <mac> dev <ifindex> dst <dst> self permanent``: creates the
        entry or points its (first) destination at ``dst``."""
        msg = ndmsg()
        msg["family"] = AF_BRIDGE
        msg["ifindex"] = ifindex
        msg["state"] = NUD_PERMANENT
        msg["flags"] = NTF_SELF
        msg["attrs"] = [("NDA_LLADDR", mac), ("NDA_DST", str(dst))]
        self._request(f"set {what}", msg, RTM_NEWNEIGH, NLM_F_CREATE | NLM_F_REPLACE)

    def delete_fdb(self, entry: KernelFdb, *, what: str) -> bool:
        """Delete one destination of an FDB entry (the whole entry with its last one)."""
        msg = ndmsg()
        msg["family"] = AF_BRIDGE
        msg["ifindex"] = entry.ifindex
        msg["flags"] = NTF_SELF
        attrs: list[Attr] = [("NDA_LLADDR", entry.mac)]
        if entry.dst is not None:
            attrs.append(("NDA_DST", str(entry.dst)))
        if entry.port is not None:
            attrs.append(("NDA_PORT", entry.port))
        if entry.vni is not None:
            attrs.append(("NDA_VNI", entry.vni))
        msg["attrs"] = attrs
        return self._delete(f"delete {what}", msg, RTM_DELNEIGH)
