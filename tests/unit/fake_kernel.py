"""Enough of the kernel's routing, in memory, to run :class:`dataplane.overlay.Reconciler`
without root: links, addresses, routes, neighbours, FDB entries (shared by the overlay and
the incremental routing tests)."""

from __future__ import annotations

import dataclasses
import errno
import itertools
from typing import Any

from dataplane.errors import NetlinkFailure
from dataplane.overlay_model import (
    NUD_PERMANENT,
    RTN_BLACKHOLE,
    RTN_UNICAST,
    KernelAddress,
    KernelFdb,
    KernelNeighbour,
    KernelRoute,
    LinkState,
    VxlanAttrs,
)

MAC_C = "02:cc:00:00:00:03"


class FakeKernel:
    """Enough of RoutingRtnl, in memory, to run the Reconciler: links, addresses, routes
    (keyed by prefix and metric, like the kernel's main table), neighbours, FDB entries.
    ``ipip`` says whether the kernel knows the ipip kind. Records every write."""

    def __init__(self, *, ipip: bool = True, refuse_vxlan_change: bool = False) -> None:
        self.ipip = ipip
        self.refuse_vxlan_change = refuse_vxlan_change
        self.index = itertools.count(10)
        self.links: dict[str, LinkState] = {"lo": LinkState(1, "lo", None, None, 65536, True)}
        self.links["eth0"] = LinkState(2, "eth0", "veth", MAC_C, 1500, True)
        self.addresses: list[KernelAddress] = []
        self.routes: dict[tuple[Any, int], KernelRoute] = {}
        self.neigh: dict[tuple[int, Any], KernelNeighbour] = {}
        self.fdb: dict[tuple[int, str], KernelFdb] = {}
        self.writes: list[str] = []

    def __call__(self, where: str) -> FakeKernel:
        return self

    def __enter__(self) -> FakeKernel:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def _fail(self, op: str, err: int) -> NetlinkFailure:
        return NetlinkFailure(op, "fake", err)

    # links
    def link_state(self, name: str) -> LinkState | None:
        return self.links.get(name)

    def link_by_name(self, name: str) -> LinkState | None:
        return self.links.get(name)

    def link_by_index(self, index: int) -> LinkState | None:
        return next((lk for lk in self.links.values() if lk.index == index), None)

    def create_vxlan(
        self, name: str, *, vni: int, port: int, local: Any, learning: bool, mac: str, mtu: int
    ) -> None:
        attrs = VxlanAttrs(vni, port, local, learning)
        self.links[name] = LinkState(next(self.index), name, "vxlan", mac, mtu, True, attrs)
        self.writes.append(f"create vxlan {name}")

    def create_link(self, name: str, kind: str, *, mtu: int) -> None:
        if kind == "ipip" and not self.ipip:
            raise self._fail(f"create {kind} {name}", errno.EOPNOTSUPP)
        self.links[name] = LinkState(next(self.index), name, kind, None, mtu, True)
        self.writes.append(f"create {kind} {name} mtu {mtu}")

    def delete_link(self, index: int, name: str) -> bool:
        gone = self.links.pop(name)
        # as the kernel does: what hangs on the device goes with it
        self.routes = {k: r for k, r in self.routes.items() if r.oif != gone.index}
        self.addresses = [a for a in self.addresses if a.index != gone.index]
        self.neigh = {k: n for k, n in self.neigh.items() if k[0] != gone.index}
        self.fdb = {k: e for k, e in self.fdb.items() if k[0] != gone.index}
        self.writes.append(f"delete link {name}")
        return True

    def set_link(
        self,
        link: LinkState,
        *,
        mtu: int | None = None,
        mac: str | None = None,
        up: bool | None = None,
    ) -> None:
        new = link
        if mtu is not None:
            new = dataclasses.replace(new, mtu=mtu)
        if mac is not None:
            new = dataclasses.replace(new, mac=mac)
        if up is not None:
            new = dataclasses.replace(new, up=up)
        self.links[link.name] = new
        self.writes.append(f"set {link.name}")

    def change_vxlan(self, link: LinkState, *, local: Any = None, learning: bool) -> None:
        if self.refuse_vxlan_change:
            raise self._fail(f"change vxlan {link.name}", errno.EOPNOTSUPP)
        assert link.vxlan is not None
        attrs = dataclasses.replace(link.vxlan, local=local or link.vxlan.local, learning=learning)
        self.links[link.name] = dataclasses.replace(link, vxlan=attrs)
        self.writes.append(f"change vxlan {link.name}")

    # addresses
    def address_states(self, index: int | None = None) -> list[KernelAddress]:
        return [a for a in self.addresses if index is None or a.index == index]

    def add_prefixed_address(self, link: LinkState, address: Any, plen: int) -> None:
        self.addresses.append(KernelAddress(link.index, address, plen, 0, 0))
        self.writes.append(f"add address {address}/{plen} dev {link.name}")

    def delete_address(self, link: LinkState, address: Any, plen: int) -> bool:
        key = (link.index, address, plen)
        self.addresses = [a for a in self.addresses if (a.index, a.address, a.prefixlen) != key]
        return True

    # routes
    def routes_of(self, version: int, proto: int) -> list[KernelRoute]:
        return [r for r in self.routes.values() if r.dst.version == version and r.proto == proto]

    def write_route(
        self,
        dst: Any,
        *,
        proto: int,
        blackhole: bool,
        gw: Any = None,
        oif: int | None = None,
        onlink: bool = False,
        replace: bool = False,
        what: str = "",
    ) -> None:
        metric = 0 if dst.version == 4 else 1024
        key = (dst, metric)
        if key in self.routes and not replace:
            raise self._fail(f"add route {what}", errno.EEXIST)
        if oif is not None and self.link_by_index(oif) is None:
            raise self._fail(f"add route {what}", errno.ENODEV)
        rtype = RTN_BLACKHOLE if blackhole else RTN_UNICAST
        self.routes[key] = KernelRoute(dst, rtype, proto, gw, oif, onlink, metric)
        self.writes.append(f"{'replace' if replace else 'add'} route {what} proto {proto}")

    def delete_kernel_route(self, route: KernelRoute) -> bool:
        key = (route.dst, route.metric)
        if key not in self.routes or self.routes[key].proto != route.proto:
            return False
        del self.routes[key]
        self.writes.append(f"delete route {route.dst}")
        return True

    def route_matching(self, dst: Any) -> KernelRoute | None:
        """The most specific route holding ``dst``'s first address (as the kernel's FIB)."""
        first = dst.network_address
        holding = [
            r for (d, _), r in self.routes.items() if d.version == dst.version and first in d
        ]
        return max(holding, key=lambda r: r.dst.prefixlen, default=None)

    def route_exact(self, dst: Any, metric: int) -> KernelRoute | None:
        return self.routes.get((dst, metric))

    # neighbours and FDB
    def neighbours(self, version: int, ifindex: int) -> list[KernelNeighbour]:
        return [n for (i, a), n in self.neigh.items() if i == ifindex and a.version == version]

    def set_neighbour(self, ifindex: int, address: Any, mac: str, *, what: str) -> None:
        self.neigh[(ifindex, address)] = KernelNeighbour(ifindex, address, mac, NUD_PERMANENT)
        self.writes.append(f"set {what}")

    def delete_neighbour(self, ifindex: int, address: Any, *, what: str) -> bool:
        return self.neigh.pop((ifindex, address), None) is not None

    def fdb_entries(self, ifindex: int) -> list[KernelFdb]:
        return [e for (i, _), e in self.fdb.items() if i == ifindex]

    def set_fdb(self, ifindex: int, mac: str, dst: Any, *, what: str) -> None:
        self.fdb[(ifindex, mac)] = KernelFdb(ifindex, mac, dst, NUD_PERMANENT)
        self.writes.append(f"set {what}")

    def delete_fdb(self, entry: KernelFdb, *, what: str) -> bool:
        return self.fdb.pop((entry.ifindex, entry.mac), None) is not None

    def delete_route_of(self, dst: Any, *, proto: int, metric: int) -> bool:
        key = (dst, metric)
        if key not in self.routes or self.routes[key].proto != proto:
            return False
        del self.routes[key]
        self.writes.append(f"delete route {dst}")
        return True

    # what the kernel holds, comparable
    def state(self) -> dict[str, Any]:
        """Links (name, kind, MAC, MTU, up, VXLAN attributes), addresses, routes (by
        device name), neighbours and FDB entries (by device name)."""
        name = {lk.index: lk.name for lk in self.links.values()}
        return {
            "links": {
                lk.name: (lk.kind, lk.mac, lk.mtu, lk.up, lk.vxlan) for lk in self.links.values()
            },
            "addresses": sorted(
                (name[a.index], str(a.address), a.prefixlen) for a in self.addresses
            ),
            "routes": sorted(
                (str(r.dst), r.type, r.proto, str(r.gw), name.get(r.oif or -1), r.onlink, r.metric)
                for r in self.routes.values()
            ),
            "neighbours": sorted(
                (name[n.ifindex], str(n.address), n.mac, n.state) for n in self.neigh.values()
            ),
            "fdb": sorted((name[e.ifindex], e.mac, str(e.dst), e.state) for e in self.fdb.values()),
        }
