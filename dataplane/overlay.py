"""The node agent's routing in the kernel: reconcile a :class:`DesiredState` (VXLAN devices,
``tunl0``, permanent neighbour and FDB entries, tabby's routes) with what the kernel has.

How it reconciles (the way a daemon must):

* It reads the kernel every time and changes only the difference; it keeps no memory of
  what it did. A second run with the same desired state changes nothing; a new
  :class:`Reconciler` after a restart (or a crash half-way through a run) adopts what is
  there and finishes the job.
* It owns only what it marked as its own (see :mod:`dataplane.overlay_model`):
  routes carry the route protocol :data:`RTPROT_TABBY` and only routes of that protocol are
  read (filtered by the kernel) or removed; neighbours and FDB entries are read and changed
  only on tabby's own VXLAN devices. A foreign route that holds a prefix tabby wants is a
  *conflict*: reported, never removed.
* Devices: a VXLAN device whose VNI or UDP port differs (the kernel cannot change them) is
  recreated; MTU, MAC, up, local address and learning are changed in place.
* One failed kernel request does not stop the run: it is reported in
  :attr:`Changes.failures` and the rest is still reconciled (a read that fails raises
  :class:`~dataplane.errors.NetlinkFailure`).

Order of a run: devices and their addresses, removal of stale routes, neighbours and FDB
entries, then new and changed routes (so a route never points at a neighbour that is
missing for longer than necessary).

Everything happens in the network namespace of the calling thread.
"""

from __future__ import annotations

import collections
import dataclasses
import errno as errno_mod
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal, TypeAlias

from bundle.types import IPAddress, IPNetwork
from dataplane.errors import NetlinkFailure
from dataplane.model import SCOPE_LINK
from dataplane.overlay_model import (
    IPIP_DEVICE,
    NUD_PERMANENT,
    RT_TABLE_MAIN,
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
    OverlayDelta,
    OverlayRoute,
    VxlanDevice,
    default_metric,
)
from dataplane.rtnl_routing import RoutingRtnl

__all__ = [
    "RTPROT_TABBY",
    "Change",
    "Changes",
    "DevicePlan",
    "Problem",
    "Reconciler",
    "RoutePlan",
    "plan_addresses",
    "plan_fdb",
    "plan_ipip_device",
    "plan_neighbours",
    "plan_routes",
    "plan_vxlan_device",
    "reconcile",
]

log = logging.getLogger("tabby.dataplane.overlay")

Kind: TypeAlias = Literal["device", "address", "fdb", "neighbour", "route", "blackhole"]
Action: TypeAlias = Literal["add", "replace", "remove"]
KINDS: tuple[Kind, ...] = ("device", "address", "fdb", "neighbour", "route", "blackhole")
ACTIONS: tuple[Action, ...] = ("add", "replace", "remove")


# --- the result of a run -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Change:
    action: Action
    kind: Kind
    what: str

    def __str__(self) -> str:
        return f"{self.action} {self.what}"


@dataclasses.dataclass(frozen=True)
class Problem:
    """A conflict (something not tabby's is in the way: left alone) or a failure (the
    kernel refused a request). ``what`` names the desired item, ``reason`` explains."""

    kind: Kind
    what: str
    reason: str

    def __str__(self) -> str:
        return f"{self.what}: {self.reason}"


@dataclasses.dataclass(frozen=True)
class Changes:
    """What one :meth:`Reconciler.reconcile` run did. False when it changed nothing."""

    applied: tuple[Change, ...] = ()
    conflicts: tuple[Problem, ...] = ()
    failures: tuple[Problem, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.applied)

    def __len__(self) -> int:
        return len(self.applied)

    def _of(self, action: Action) -> tuple[Change, ...]:
        return tuple(c for c in self.applied if c.action == action)

    @property
    def added(self) -> tuple[Change, ...]:
        return self._of("add")

    @property
    def replaced(self) -> tuple[Change, ...]:
        return self._of("replace")

    @property
    def removed(self) -> tuple[Change, ...]:
        return self._of("remove")

    def count(self, action: Action | None = None, kind: Kind | None = None) -> int:
        return sum(
            1
            for c in self.applied
            if (action is None or c.action == action) and (kind is None or c.kind == kind)
        )

    def counts(self) -> dict[Kind, dict[Action, int]]:
        """Every kind and action with its count (zeros included): for metrics."""
        out: dict[Kind, dict[Action, int]] = {k: dict.fromkeys(ACTIONS, 0) for k in KINDS}
        for change in self.applied:
            out[change.kind][change.action] += 1
        return out

    @property
    def ok(self) -> bool:
        """True when the kernel now matches the desired state (no conflict, no failure)."""
        return not self.conflicts and not self.failures

    def summary(self) -> str:
        counter = collections.Counter((c.action, c.kind) for c in self.applied)
        parts = [f"{a} {n} {k}" for (a, k), n in sorted(counter.items())]
        if self.conflicts:
            parts.append(f"{len(self.conflicts)} conflicts")
        if self.failures:
            parts.append(f"{len(self.failures)} failures")
        return ", ".join(parts) or "no change"


class _Recorder:
    def __init__(self) -> None:
        self.applied: list[Change] = []
        self.conflicts: list[Problem] = []
        self.failures: list[Problem] = []

    def change(self, action: Action, kind: Kind, what: str) -> None:
        log.info("%s %s", action, what)
        self.applied.append(Change(action, kind, what))

    def conflict(self, kind: Kind, what: str, reason: str) -> None:
        self.conflicts.append(Problem(kind, what, reason))

    def failure(self, kind: Kind, what: str, reason: str) -> None:
        self.failures.append(Problem(kind, what, reason))

    def result(self) -> Changes:
        return Changes(tuple(self.applied), tuple(self.conflicts), tuple(self.failures))


# --- pure planning (unit-tested without a kernel) -------------------------------------------


@dataclasses.dataclass(frozen=True)
class DevicePlan:
    """What to do with one of tabby's devices.

    ``action``: ``keep`` (nothing, or only the in-place fields below), ``create``,
    ``recreate`` (delete, then create), ``delete``, ``conflict`` (a device that is not
    tabby's has the name: left alone). For ``keep``: the fields to change in place."""

    action: Literal["keep", "create", "recreate", "delete", "conflict"]
    reason: str = ""
    mtu: int | None = None
    mac: str | None = None
    set_up: bool = False
    #: VXLAN local address and learning to set in place (None: leave as is).
    vxlan_local: IPAddress | None = None
    vxlan_learning: bool | None = None

    @property
    def in_place(self) -> bool:
        return self.action == "keep" and (
            self.mtu is not None
            or self.mac is not None
            or self.set_up
            or self.vxlan_local is not None
            or self.vxlan_learning is not None
        )


def plan_vxlan_device(name: str, want: VxlanDevice | None, have: LinkState | None) -> DevicePlan:
    if want is None:
        if have is not None and have.kind == "vxlan":
            return DevicePlan("delete", "not wanted any more")
        return DevicePlan("keep")
    if have is None:
        return DevicePlan("create")
    if have.kind != "vxlan":
        return DevicePlan(
            "conflict", f"a {have.kind or 'plain'} device named {name} exists (not tabby's)"
        )
    attrs = have.vxlan
    if attrs is None:
        return DevicePlan("recreate", "its VXLAN attributes are unreadable")
    if attrs.vni != want.vni:
        return DevicePlan("recreate", f"VNI {attrs.vni}, want {want.vni}")
    if attrs.port != want.port:
        return DevicePlan("recreate", f"port {attrs.port}, want {want.port}")
    if attrs.local is None or attrs.local.version != want.local.version:
        return DevicePlan("recreate", f"local address {attrs.local}, want {want.local}")
    return DevicePlan(
        "keep",
        mtu=want.mtu if have.mtu != want.mtu else None,
        mac=want.mac if (have.mac or "").lower() != want.mac else None,
        set_up=not have.up,
        vxlan_local=want.local if attrs.local != want.local else None,
        vxlan_learning=want.learning if attrs.learning != want.learning else None,
    )


def plan_ipip_device(want: IpipDevice | None, have: LinkState | None) -> DevicePlan:
    """``tunl0`` is the kernel's fallback device: tabby creates it if missing but never
    deletes it (``want`` None leaves it as it is)."""
    if want is None:
        return DevicePlan("keep")
    if have is None:
        return DevicePlan("create")
    if have.kind != "ipip":
        return DevicePlan(
            "conflict", f"a {have.kind or 'plain'} device named {IPIP_DEVICE} exists (not ipip)"
        )
    return DevicePlan("keep", mtu=want.mtu if have.mtu != want.mtu else None, set_up=not have.up)


def _is_link_local(address: KernelAddress) -> bool:
    return address.scope == SCOPE_LINK or address.address.is_link_local


def plan_addresses(
    want: IPAddress | None, have: Sequence[KernelAddress], *, version: int
) -> tuple[list[tuple[IPAddress, int]], list[KernelAddress]]:
    """(to add, to remove) on one of tabby's devices: exactly ``want`` as /32 (/128) among
    its addresses of ``version``; link-local addresses (the kernel's) are left alone."""
    mine = [a for a in have if a.address.version == version and not _is_link_local(a)]
    key = (want, want.max_prefixlen) if want is not None else None
    add: list[tuple[IPAddress, int]] = []
    if key is not None and not any((a.address, a.prefixlen) == key for a in mine):
        add.append(key)
    remove = [a for a in mine if (a.address, a.prefixlen) != key]
    return add, remove


def plan_neighbours(
    want: Iterable[NeighbourEntry], have: Sequence[KernelNeighbour]
) -> tuple[list[tuple[NeighbourEntry, bool]], list[KernelNeighbour]]:
    """(to set, with True when it replaces one of ours; permanent entries to remove).
    Only permanent entries are tabby's: the kernel's own (incomplete, reachable...) are
    never removed, though one for a desired address is overwritten."""
    permanent = {n.address: n for n in have if n.permanent}
    wanted = {w.address: w for w in want}
    to_set: list[tuple[NeighbourEntry, bool]] = []
    for address, entry in sorted(wanted.items(), key=lambda kv: (kv[0].version, kv[0])):
        current = permanent.get(address)
        if current is None:
            to_set.append((entry, False))
        elif current.mac != entry.mac:
            to_set.append((entry, True))
    remove = [n for a, n in sorted(permanent.items(), key=lambda kv: str(kv[0])) if a not in wanted]
    return to_set, remove


def _fdb_exact(entry: KernelFdb, want: FdbEntry) -> bool:
    return entry.dst == want.dst and entry.port is None and entry.vni is None


def plan_fdb(
    want: Iterable[FdbEntry], have: Sequence[KernelFdb]
) -> tuple[list[tuple[FdbEntry, bool]], list[KernelFdb]]:
    """(to set, with True when it re-points one of ours; destinations to remove). One
    destination per MAC; every other permanent destination on the device is removed."""
    by_mac: dict[str, list[KernelFdb]] = collections.defaultdict(list)
    for found in have:
        if found.permanent:
            by_mac[found.mac].append(found)
    to_set: list[tuple[FdbEntry, bool]] = []
    remove: list[KernelFdb] = []
    wanted = {w.mac: w for w in want}
    for mac, entry in sorted(wanted.items()):
        remotes = by_mac.pop(mac, [])
        exact = [r for r in remotes if _fdb_exact(r, entry)]
        if exact:
            remove += [r for r in remotes if r is not exact[0]]
        elif remotes:
            # A replace re-points the entry's first destination; any others go.
            to_set.append((entry, True))
            remove += remotes[1:]
        else:
            to_set.append((entry, False))
    for mac in sorted(by_mac):
        remove += by_mac[mac]
    return to_set, remove


@dataclasses.dataclass(frozen=True)
class RoutePlan:
    add: tuple[tuple[OverlayRoute, int | None], ...] = ()
    replace: tuple[tuple[OverlayRoute, int | None, KernelRoute], ...] = ()
    remove: tuple[KernelRoute, ...] = ()
    #: Desired routes whose device does not exist: (route, why). Tabby's current route
    #: for such a prefix, if any, is left as it is until the device appears.
    unresolved: tuple[tuple[OverlayRoute, str], ...] = ()


def route_matches(have: KernelRoute, want: OverlayRoute, oif: int | None) -> bool:
    if have.multipath or have.table != RT_TABLE_MAIN:
        return False
    if want.type == "blackhole":
        return have.type == RTN_BLACKHOLE
    return (
        have.type == RTN_UNICAST
        and have.gw == want.gw
        and have.oif == oif
        and have.onlink == want.onlink
    )


def plan_routes(
    want: Iterable[OverlayRoute],
    have: Sequence[KernelRoute],
    index_of: Mapping[str, int | None],
) -> RoutePlan:
    """Diff the desired routes against tabby's routes in the kernel (``have``: only routes
    of protocol :data:`RTPROT_TABBY`). ``index_of`` maps device names to ifindex (None:
    the device does not exist)."""
    by_dst: dict[object, list[KernelRoute]] = collections.defaultdict(list)
    for found in have:
        by_dst[found.dst].append(found)
    add: list[tuple[OverlayRoute, int | None]] = []
    replace: list[tuple[OverlayRoute, int | None, KernelRoute]] = []
    remove: list[KernelRoute] = []
    unresolved: list[tuple[OverlayRoute, str]] = []
    for route in sorted(want, key=lambda r: (r.version, r.dst)):
        oif: int | None = None
        if route.type == "unicast":
            assert route.device is not None
            oif = index_of.get(route.device)
            if oif is None:
                unresolved.append((route, f"device {route.device} does not exist"))
                by_dst.pop(route.dst, None)
                continue
        current = by_dst.pop(route.dst, [])
        metric = default_metric(route.version)
        primary = next((r for r in current if r.metric == metric), None)
        remove += [r for r in current if r is not primary]
        if primary is None:
            add.append((route, oif))
        elif not route_matches(primary, route, oif):
            replace.append((route, oif, primary))
    for stale in by_dst.values():
        remove += stale
    remove.sort(key=lambda r: (r.dst.version, r.dst, r.metric))
    return RoutePlan(tuple(add), tuple(replace), tuple(remove), tuple(unresolved))


# --- applying it --------------------------------------------------------------------------


def _route_kind(route: OverlayRoute | KernelRoute) -> Kind:
    if isinstance(route, OverlayRoute):
        return "blackhole" if route.type == "blackhole" else "route"
    return "blackhole" if route.type == RTN_BLACKHOLE else "route"


class Reconciler:
    """Brings the kernel of the calling thread's network namespace to a desired state.

    :meth:`reconcile` reads the kernel and holds no kernel state between runs (a netlink
    socket is opened per run, in the calling thread's namespace), so a new object after a
    restart behaves exactly like the old one. :meth:`apply` changes the objects of a delta
    only, on what the last whole run found (the devices' ifindex, the prefixes a foreign
    route holds); a run remembers the problems it left and which it has logged, to log
    each once."""

    def __init__(
        self, *, where: str = "node", netlink: Callable[[str], RoutingRtnl] | None = None
    ) -> None:
        self.where = where
        #: Opens the run's netlink socket (a test may hand in a fake kernel).
        self._netlink = netlink or RoutingRtnl.here
        self._logged: set[tuple[str, str]] = set()
        #: What the last run left unsolved ("conflict" or "failure", problem): a
        #: delta keeps those of the objects it did not touch.
        self._standing: list[tuple[str, Problem]] = []
        #: ifindex of the devices routes go through, as the last whole run found them
        #: (None: no whole run yet, so :meth:`apply` has nothing to build on)
        self._links: dict[str, int] | None = None
        #: Prefixes tabby wants that the kernel does not have as tabby's (a foreign route
        #: holds them, or writing them failed): a delta adds those, never replaces them.
        self._absent: set[IPNetwork] = set()
        #: Deltas that failed unexpectedly and were finished by a whole run.
        self.fallbacks = 0

    def reconcile(self, desired: DesiredState) -> Changes:
        """Bring the kernel to ``desired`` by reading what is there (the whole state)."""
        rec = _Recorder()
        absent: set[IPNetwork] = set()
        with self._netlink(self.where) as nl:
            devices: dict[str, LinkState | None] = {}
            for name, want in desired.vxlan_devices().items():
                devices[name] = self._vxlan_device(nl, name, want, rec)
            if desired.ipip is not None:
                # None when it cannot be had: then no route may use a foreign tunl0 either.
                devices[IPIP_DEVICE] = self._ipip_device(nl, desired.ipip, rec)

            index_of: dict[str, int | None] = {
                name: link.index if link is not None else None for name, link in devices.items()
            }
            for route in desired.routes:
                if route.device is not None and route.device not in index_of:
                    other = nl.link_by_name(route.device)
                    index_of[route.device] = other.index if other is not None else None
            have = nl.routes_of(4, RTPROT_TABBY) + nl.routes_of(6, RTPROT_TABBY)
            plan = plan_routes(desired.routes, have, index_of)

            for stale in plan.remove:
                self._do(
                    rec, "remove", _route_kind(stale), str(stale), nl.delete_kernel_route, stale
                )
            for name in (VXLAN_V4_DEVICE, VXLAN_V6_DEVICE):
                vxlan = devices.get(name)
                if vxlan is not None:
                    self._entries(nl, vxlan, desired, rec)
            for route, why in plan.unresolved:
                rec.failure(_route_kind(route), str(route), why)
                absent.add(route.dst)
            for route, oif in plan.add:
                if not self._add_route(nl, route, oif, rec):
                    absent.add(route.dst)
            for route, oif, old in plan.replace:
                self._do(
                    rec,
                    "replace",
                    _route_kind(route),
                    str(route),
                    self._replace,
                    nl,
                    route,
                    oif,
                    old,
                )
        self._links = {name: index for name, index in index_of.items() if index is not None}
        self._absent = absent
        result = rec.result()
        self._standing = [("conflict", p) for p in result.conflicts]
        self._standing += [("failure", p) for p in result.failures]
        self._log_problems()
        return result

    def apply(self, delta: OverlayDelta, desired: Callable[[], DesiredState]) -> Changes:
        """Change exactly the objects of ``delta`` (netlink add, replace or delete of each;
        no table is read), on a kernel that a whole :meth:`reconcile` brought to the state
        before the delta. ``desired`` gives the whole state after it, for a whole run
        instead: when the delta changes devices, when no whole run was done yet, and when a
        request fails other than by a foreign route holding a prefix (that one is a
        conflict, as in a whole run).

        Returns what this run changed, and the problems known now: those of this run and
        those earlier runs left on objects this delta did not touch."""
        if delta.devices or self._links is None:
            return self.reconcile(desired())
        rec = _Recorder()
        touched: set[str] = set()
        if delta:
            try:
                with self._netlink(self.where) as nl:
                    self._apply(nl, delta, rec, touched)
            except NetlinkFailure as exc:
                self.fallbacks += 1
                log.warning("routing: %s: reconciling the whole state instead", exc)
                done = self.reconcile(desired())
                return Changes(tuple(rec.applied) + done.applied, done.conflicts, done.failures)
        self._standing = [(k, p) for k, p in self._standing if p.what not in touched]
        self._standing += [("conflict", p) for p in rec.conflicts]
        self._standing += [("failure", p) for p in rec.failures]
        self._log_problems()
        return Changes(
            tuple(rec.applied),
            tuple(p for k, p in self._standing if k == "conflict"),
            tuple(p for k, p in self._standing if k == "failure"),
        )

    def _apply(
        self, nl: RoutingRtnl, delta: OverlayDelta, rec: _Recorder, touched: set[str]
    ) -> None:
        """One delta, in the order of a whole run: stale routes, stale neighbours and FDB
        entries, new FDB entries and neighbours, new and changed routes. A NetlinkFailure
        out of here means: do a whole run."""
        links = self._links
        assert links is not None
        self._remove_stale(nl, delta, rec, touched, links)
        self._write_entries(nl, delta, rec, links)
        for old, new in delta.routes:
            if new is not None:
                self._apply_route(nl, old, new, rec)

    def _remove_stale(
        self,
        nl: RoutingRtnl,
        delta: OverlayDelta,
        rec: _Recorder,
        touched: set[str],
        links: dict[str, int],
    ) -> None:
        """The first half of :meth:`_apply`: stale routes, stale neighbours and FDB entries
        (and every object of the delta is ``touched``)."""
        for old, new in delta.routes:
            touched.update(str(r) for r in (old, new) if r is not None)
            if new is None and old is not None:
                self._absent.discard(old.dst)
                metric = default_metric(old.version)
                if nl.delete_route_of(old.dst, proto=RTPROT_TABBY, metric=metric):
                    rec.change("remove", _route_kind(old), str(old))
        for n_old, n_new in delta.neighbours:
            touched.update(str(n) for n in (n_old, n_new) if n is not None)
            if n_new is None and n_old is not None and n_old.device in links:
                what = str(n_old)
                if nl.delete_neighbour(links[n_old.device], n_old.address, what=what):
                    rec.change("remove", "neighbour", what)
        for f_old, f_new in delta.fdb:
            touched.update(str(f) for f in (f_old, f_new) if f is not None)
            if f_new is None and f_old is not None and f_old.device in links:
                entry = KernelFdb(links[f_old.device], f_old.mac, f_old.dst, NUD_PERMANENT)
                if nl.delete_fdb(entry, what=str(f_old)):
                    rec.change("remove", "fdb", str(f_old))

    def _write_entries(
        self, nl: RoutingRtnl, delta: OverlayDelta, rec: _Recorder, links: dict[str, int]
    ) -> None:
        """The new and changed FDB entries and neighbours of a delta (:meth:`_apply`)."""
        for f_old, f_new in delta.fdb:
            if f_new is not None and f_new.device in links:
                nl.set_fdb(links[f_new.device], f_new.mac, f_new.dst, what=str(f_new))
                rec.change("add" if f_old is None else "replace", "fdb", str(f_new))
        for n_old, n_new in delta.neighbours:
            if n_new is not None and n_new.device in links:
                index = links[n_new.device]
                nl.set_neighbour(index, n_new.address, n_new.mac, what=str(n_new))
                rec.change("add" if n_old is None else "replace", "neighbour", str(n_new))

    def _apply_route(
        self, nl: RoutingRtnl, old: OverlayRoute | None, new: OverlayRoute, rec: _Recorder
    ) -> None:
        kind = _route_kind(new)
        oif: int | None = None
        if new.device is not None:
            oif = self._link_index(nl, new.device)
            if oif is None:
                rec.failure(kind, str(new), f"device {new.device} does not exist")
                self._absent.add(new.dst)
                return
        if old is not None and new.dst not in self._absent:
            self._replace(nl, new, oif, None)
            rec.change("replace", kind, str(new))
            return
        try:
            self._write(nl, new, oif, False)
        except NetlinkFailure as exc:
            if exc.errno != errno_mod.EEXIST:
                raise
            foreign = self._foreign_route(nl, new)
            if foreign is not None:
                rec.conflict(kind, str(new), foreign)
                self._absent.add(new.dst)
                return
            self._replace(nl, new, oif, None)  # tabby's own, left by an earlier run
            rec.change("replace", kind, str(new))
        else:
            rec.change("add", kind, str(new))
        self._absent.discard(new.dst)

    def _link_index(self, nl: RoutingRtnl, name: str) -> int | None:
        """The ifindex of a device routes go through: tabby's VXLAN devices as the last
        whole run left them, any other one (an uplink) looked up once."""
        links = self._links
        assert links is not None
        if name in links:
            return links[name]
        if name in (VXLAN_V4_DEVICE, VXLAN_V6_DEVICE, IPIP_DEVICE):
            return None  # tabby's, and the last whole run did not have it
        link = nl.link_by_name(name)
        if link is None:
            return None
        links[name] = link.index
        return link.index

    # --- devices ---

    def _vxlan_device(
        self, nl: RoutingRtnl, name: str, want: VxlanDevice | None, rec: _Recorder
    ) -> LinkState | None:
        have = nl.link_state(name)
        plan = plan_vxlan_device(name, want, have)
        if plan.action == "conflict":
            rec.conflict("device", name, plan.reason)
            return None
        if plan.action == "delete":
            assert have is not None
            self._do(
                rec,
                "remove",
                "device",
                f"device {name} ({plan.reason})",
                nl.delete_link,
                have.index,
                name,
            )
            return None
        if want is None:
            return None
        action, reason = plan.action, plan.reason
        if plan.in_place:
            assert have is not None
            refused = self._in_place(nl, have, plan, rec)
            if refused:  # a kernel that cannot change these VXLAN attributes in place
                action, reason = "recreate", f"the kernel refused to change it in place: {refused}"
        if action in ("create", "recreate"):
            if action == "recreate":
                assert have is not None
                try:
                    nl.delete_link(have.index, name)
                except NetlinkFailure as exc:
                    rec.failure("device", name, f"cannot delete it to recreate it: {exc.details}")
                    return None
            what = (
                f"device {name} (vxlan id {want.vni} dstport {want.port} local {want.local}"
                f" mtu {want.mtu} address {want.mac})"
            )
            if reason:
                what += f": was {reason}"
            done = self._do(
                rec,
                "replace" if action == "recreate" else "add",
                "device",
                what,
                nl.create_vxlan,
                name,
                vni=want.vni,
                port=want.port,
                local=want.local,
                learning=want.learning,
                mac=want.mac,
                mtu=want.mtu,
            )
            if not done:
                return None
        link = nl.link_state(name)
        if link is None:
            rec.failure("device", name, "vanished while it was being configured")
            return None
        self._addresses(nl, link, want.address, want.version, rec)
        return link

    def _in_place(self, nl: RoutingRtnl, have: LinkState, plan: DevicePlan, rec: _Recorder) -> str:
        """Apply the in-place part of ``plan``. Returns "" when done (or failed: recorded),
        else the kernel's refusal to change VXLAN attributes (the caller recreates)."""
        parts = []
        if plan.mtu is not None:
            parts.append(f"mtu {have.mtu} -> {plan.mtu}")
        if plan.mac is not None:
            parts.append(f"address {have.mac} -> {plan.mac}")
        if plan.set_up:
            parts.append("up")
        if plan.vxlan_local is not None:
            parts.append(f"local -> {plan.vxlan_local}")
        if plan.vxlan_learning is not None:
            parts.append(f"learning {'on' if plan.vxlan_learning else 'off'}")
        what = f"device {have.name} ({', '.join(parts)})"
        if plan.vxlan_local is not None or plan.vxlan_learning is not None:
            learning = plan.vxlan_learning
            if learning is None:
                learning = bool(have.vxlan and have.vxlan.learning)
            try:
                nl.change_vxlan(have, local=plan.vxlan_local, learning=learning)
            except NetlinkFailure as exc:
                if exc.errno in (errno_mod.EOPNOTSUPP, errno_mod.EINVAL, errno_mod.EPERM):
                    return exc.details
                rec.failure("device", what, exc.details)
                return ""
        if plan.mtu is not None or plan.mac is not None or plan.set_up:
            try:
                nl.set_link(have, mtu=plan.mtu, mac=plan.mac, up=True if plan.set_up else None)
            except NetlinkFailure as exc:
                rec.failure("device", what, exc.details)
                return ""
        rec.change("replace", "device", what)
        return ""

    def _ipip_device(self, nl: RoutingRtnl, want: IpipDevice, rec: _Recorder) -> LinkState | None:
        have = nl.link_state(IPIP_DEVICE)
        plan = plan_ipip_device(want, have)
        if plan.action == "conflict":
            rec.conflict("device", IPIP_DEVICE, plan.reason)
            return None
        if plan.action == "create":
            try:
                nl.create_link(IPIP_DEVICE, "ipip", mtu=want.mtu)
            except NetlinkFailure as exc:
                why = exc.details
                if exc.errno == errno_mod.EOPNOTSUPP:
                    why = "IP-in-IP is unavailable: this kernel has no ipip support"
                rec.failure("device", IPIP_DEVICE, why)
                return None
            rec.change("add", "device", f"device {IPIP_DEVICE} (ipip, mtu {want.mtu})")
        elif plan.in_place:
            assert have is not None
            self._in_place(nl, have, plan, rec)
        link = nl.link_state(IPIP_DEVICE)
        if link is None:
            rec.failure("device", IPIP_DEVICE, "vanished while it was being configured")
            return None
        self._addresses(nl, link, want.address, 4, rec)
        return link

    def _addresses(
        self,
        nl: RoutingRtnl,
        link: LinkState,
        want: IPAddress | None,
        version: int,
        rec: _Recorder,
    ) -> None:
        add, remove = plan_addresses(want, nl.address_states(link.index), version=version)
        for old in remove:
            what = f"address {old.address}/{old.prefixlen} dev {link.name}"
            self._do(
                rec, "remove", "address", what, nl.delete_address, link, old.address, old.prefixlen
            )
        for address, plen in add:
            what = f"address {address}/{plen} dev {link.name}"
            self._do(rec, "add", "address", what, nl.add_prefixed_address, link, address, plen)

    # --- neighbours and FDB ---

    def _entries(
        self, nl: RoutingRtnl, link: LinkState, desired: DesiredState, rec: _Recorder
    ) -> None:
        version = 4 if link.name == VXLAN_V4_DEVICE else 6
        fdb_set, fdb_remove = plan_fdb(
            (f for f in desired.fdb if f.device == link.name), nl.fdb_entries(link.index)
        )
        neigh_set, neigh_remove = plan_neighbours(
            (n for n in desired.neighbours if n.device == link.name),
            nl.neighbours(version, link.index),
        )
        for stale in neigh_remove:
            what = f"neigh {stale.address} lladdr {stale.mac} dev {link.name}"
            self._do(
                rec,
                "remove",
                "neighbour",
                what,
                nl.delete_neighbour,
                link.index,
                stale.address,
                what=what,
            )
        for old in fdb_remove:
            what = f"fdb {old.mac} dst {old.dst} dev {link.name}"
            self._do(rec, "remove", "fdb", what, nl.delete_fdb, old, what=what)
        for entry, replaces in fdb_set:
            what = str(entry)
            self._do(
                rec,
                "replace" if replaces else "add",
                "fdb",
                what,
                nl.set_fdb,
                link.index,
                entry.mac,
                entry.dst,
                what=what,
            )
        for neigh, replaces in neigh_set:
            what = str(neigh)
            self._do(
                rec,
                "replace" if replaces else "add",
                "neighbour",
                what,
                nl.set_neighbour,
                link.index,
                neigh.address,
                neigh.mac,
                what=what,
            )

    # --- routes ---

    @staticmethod
    def _write(nl: RoutingRtnl, route: OverlayRoute, oif: int | None, replace: bool) -> None:
        nl.write_route(
            route.dst,
            proto=RTPROT_TABBY,
            blackhole=route.type == "blackhole",
            gw=route.gw,
            oif=oif,
            onlink=route.onlink,
            replace=replace,
            what=str(route),
        )

    @classmethod
    def _replace(
        cls, nl: RoutingRtnl, route: OverlayRoute, oif: int | None, old: KernelRoute | None
    ) -> None:
        """Replace tabby's route for the prefix (``old``: as the kernel has it; None: at
        the default metric, whatever it is). IPv6 refuses an on-link gateway that its
        table routes through another device ("Nexthop has invalid gateway or device
        mismatch"): the very route being replaced does when a block moves between a direct
        route and the tunnel, whose gateway lies inside the block. Then the old route is
        deleted and the new one added."""
        try:
            cls._write(nl, route, oif, True)
        except NetlinkFailure as exc:
            if route.version != 6 or exc.errno != errno_mod.EINVAL or route.type != "unicast":
                raise
            if old is not None:
                nl.delete_kernel_route(old)
            else:
                nl.delete_route_of(route.dst, proto=RTPROT_TABBY, metric=default_metric(6))
            cls._write(nl, route, oif, False)

    def _add_route(
        self, nl: RoutingRtnl, route: OverlayRoute, oif: int | None, rec: _Recorder
    ) -> bool:
        """Add a route; a foreign route for the same prefix makes it a conflict (EEXIST, or
        for IPv6 EINVAL when that route also covers the on-link gateway). True if added."""
        kind = _route_kind(route)
        try:
            self._write(nl, route, oif, False)
        except NetlinkFailure as exc:
            foreign = self._foreign_route(nl, route)
            if foreign is None:
                rec.failure(kind, str(route), exc.details)
            else:
                rec.conflict(kind, str(route), foreign)
            return False
        rec.change("add", kind, str(route))
        return True

    @staticmethod
    def _foreign_route(nl: RoutingRtnl, route: OverlayRoute) -> str | None:
        """A description of the route of another protocol that holds ``route``'s prefix,
        or None if there is none."""
        try:
            found = nl.route_matching(route.dst)
            if found is not None and found.dst != route.dst:
                # a more specific route covers the prefix's first address: look for the
                # prefix itself (a dump of the table: only ever for a conflict)
                found = nl.route_exact(route.dst, default_metric(route.version))
        except NetlinkFailure:
            return None
        if found is None or found.dst != route.dst or found.proto == RTPROT_TABBY:
            return None
        dev = ""
        if found.oif is not None and found.type != RTN_BLACKHOLE:
            link = nl.link_by_index(found.oif)
            dev = f" dev {link.name}" if link is not None else f" dev #{found.oif}"
        via = f" via {found.gw}" if found.gw is not None else ""
        kind = "blackhole " if found.type == RTN_BLACKHOLE else ""
        return (
            f"the kernel has {kind}{found.dst}{via}{dev} proto {found.proto} metric "
            f"{found.metric} (not tabby's): left alone"
        )

    # --- helpers ---

    @staticmethod
    def _do(
        rec: _Recorder,
        action: Action,
        kind: Kind,
        label: str,
        fn: Callable[..., object],
        *args: object,
        **kwargs: object,
    ) -> bool:
        """Run one kernel request; record it as a change, or as a failure. A removal of
        something already gone is neither."""
        try:
            done = fn(*args, **kwargs)
        except NetlinkFailure as exc:
            rec.failure(kind, label, exc.details)
            return False
        if action == "remove" and done is False:
            return True
        rec.change(action, kind, label)
        return True

    def _log_problems(self) -> None:
        """Each standing problem logged once as it appears, and once as it goes."""
        current: set[tuple[str, str]] = set()
        for label, problem in self._standing:
            key = (label, str(problem))
            current.add(key)
            if key not in self._logged:
                log.warning("routing %s: %s", label, problem)
            else:
                log.debug("routing %s (still): %s", label, problem)
        for key in self._logged - current:
            log.info("routing %s resolved: %s", key[0], key[1])
        self._logged = current


def reconcile(desired: DesiredState) -> Changes:
    """One run with a fresh :class:`Reconciler` (in the calling thread's namespace)."""
    return Reconciler().reconcile(desired)
