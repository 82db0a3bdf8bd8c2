"""Incremental routing on a real kernel: the random histories of the unit tier
(tests/unit/routing_replay.py) replayed with each view's deltas applied by
``Reconciler.apply`` in a network namespace made here, one per view. After every op a fresh
``Reconciler``'s whole reconcile of that namespace must change nothing and find the same
problems (the kernel is exactly what a whole reconcile programs), foreign routes stay, and a
route removed behind tabby's back is the one thing the whole reconcile fixes.

The kernel has what the in-memory one lacks: IPv6's refusal to replace an on-link route
whose gateway another route covers, real VXLAN devices, neighbour and FDB semantics.
"""

from __future__ import annotations

import ipaddress
import json
import random
from collections.abc import Callable
from typing import Any, TypeVar

import pytest

from bundle.types import IPNetwork
from dataplane.overlay import Changes, Reconciler
from dataplane.overlay_model import DesiredState
from tabby_node.cluster import Underlay
from tests.privileged.netns_util import NetnsPool, Node
from tests.unit.routing_replay import replay

pytestmark = pytest.mark.privileged

T = TypeVar("T")
OPS = 150


class NetnsKernel:
    """A view's kernel: a node namespace with an ``eth0`` holding its underlay addresses."""

    def __init__(self, pool: NetnsPool, underlay: Underlay) -> None:
        self.ns: Node = pool.node()
        self.ns.ip("link", "add", "eth0", "type", "veth", "peer", "name", "eth0-peer")
        self.ns.ip("link", "set", "eth0-peer", "up")
        if underlay.ipv4 is not None:
            self.ns.ip("addr", "add", str(underlay.ipv4), "dev", "eth0")
        if underlay.ipv6 is not None:
            self.ns.ip("-6", "addr", "add", str(underlay.ipv6), "dev", "eth0", "nodad")
        self.ns.ip("link", "set", "eth0", "up")
        self.reconciler = Reconciler()
        #: whole reconciles of a state with VXLAN devices that found them there
        self.with_devices = 0

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        return self.ns.run(fn, *args)

    def whole(self, desired: DesiredState) -> Changes:
        done = self.ns.run(Reconciler().reconcile, desired)
        if desired.vxlan_v4 is not None or desired.vxlan_v6 is not None:
            assert not any(p.kind == "device" for p in done.failures), done.failures
            self.with_devices += 1
        return done

    def add_foreign(self, dst: IPNetwork) -> bool:
        done = self.ns.ip("route", "add", str(dst), "dev", "eth0", "proto", "static", check=False)
        return done.returncode == 0

    def drop_ours(self, rng: random.Random) -> IPNetwork | None:
        ours = []
        for family in ("-4", "-6"):
            out = self.ns.ip("-j", family, "route", "show", "proto", "116").stdout
            for route in json.loads(out or "[]"):
                dst = route["dst"]
                if "/" not in dst:
                    dst += "/32" if family == "-4" else "/128"
                ours.append(ipaddress.ip_network(dst))
        if not ours:
            return None
        dst = rng.choice(sorted(ours, key=lambda n: (n.version, n)))
        self.ns.ip("route", "del", str(dst), "proto", "116")
        return dst

    def foreign_intact(self, dst: IPNetwork) -> bool:
        out = self.ns.ip("route", "show", "exact", str(dst), "proto", "static").stdout
        return bool(out.strip())


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("backend", ["vxlan", "bird"])
def test_deltas_on_a_real_kernel_equal_a_whole_reconcile(
    netns_pool: NetnsPool, backend: str, seed: int
) -> None:
    kernels: dict[str, NetnsKernel] = {}

    def kernel(me: str, underlay: Underlay) -> NetnsKernel:
        kernels[me] = NetnsKernel(netns_pool, underlay)
        return kernels[me]

    r = replay(seed, backend, OPS, kernel)
    for view in r.views.values():
        assert view.deltas > 0, f"{view.me}: no delta reached the kernel"
    assert sum(k.with_devices for k in kernels.values()) > 0, "no VXLAN device was ever wanted"
