"""The incremental policy dataplane against a fresh full apply, in the kernel (real nftables).

In a node namespace made here: a :class:`PolicyDataplane` (libnftables, table ``inet tabby``)
receives a random sequence of changes (``tests/policy_fuzz.py``: policies, namespaces, pods,
endpoints moving between nodes, duplicate addresses, both families, NAT pools) through
``update`` and the CNI path, so the kernel gets only deltas. After every change, the state the
changes led to is rendered whole (``engine.compute`` + ``Renderer.full``) into a second
table, ``inet tabbyref``, replaced each time; ``nft -j list table`` of both must be equal
(handles dropped, elements sorted). The namespace goes at the end, pass or fail.
"""

from __future__ import annotations

import dataclasses
import json
import random

import pytest

from policy import engine
from policy.engine import Endpoint
from policy.incremental import Update
from policy.render import Renderer, Snapshot
from policy.state import PolicyDataplane
from tests import policy_fuzz as fz
from tests.privileged.netns_util import Node

pytestmark = pytest.mark.privileged

OPS = 150


def _canonical(node: Node, table: str) -> dict[str, object]:
    raw = json.loads(node.exec("nft", "-j", "list", "table", "inet", table).stdout)
    objects: dict[str, object] = {}
    rules: dict[str, list[object]] = {}
    for obj in raw["nftables"]:
        ((kind, body),) = obj.items()
        if kind in ("metainfo", "table"):
            continue
        body.pop("handle", None)
        body.pop("table", None)
        if kind == "rule":
            rules.setdefault(body["chain"], []).append(body)
            continue
        if "elem" in body:
            body["elem"] = sorted(body["elem"], key=json.dumps)
        objects[f"{kind} {body.get('name', '')}"] = body
    objects["rules"] = rules
    return objects


@pytest.mark.parametrize("seed", [1, 2])
def test_deltas_in_the_kernel_build_what_a_full_apply_builds(node: Node, seed: int) -> None:
    r = random.Random(seed)
    world = fz.World()
    for _ in range(40):
        world.apply(fz.random_update(r, world.state()))
    dp = PolicyDataplane(fz.NODE)  # both families, the process-wide libnftables backend
    ref = Renderer("tabbyref")

    def reference() -> str:
        snap = Snapshot(engine.compute(world.state(), fz.NODE), world.nat)
        return dp.backend.run(ref.full(snap))

    assert node.run(dp.sync, world.state(), world.nat).full
    fulls = 0
    for i in range(OPS):
        u = fz.random_update(r, world.state())
        was_nat = world.nat.enabled
        world.apply(u)
        if u.kind == "endpoint" and isinstance(u.value, Endpoint) and r.random() < 0.5:
            res = node.run(dp.add_endpoint, u.value)
        else:
            res = node.run(dp.update, [u])
        # only switching masquerading on or off replaces the table
        assert res.full == (was_nat != world.nat.enabled), f"op {i}: {u}"
        fulls += res.full
        node.run(reference)
        assert _canonical(node, "tabby") == _canonical(node, "tabbyref"), f"op {i}: {u}"
    c = dp.counters
    assert c.apply_errors == 0
    assert c.full_applies == 1 + fulls
    check = node.run(dp.sync, world.state(), world.nat)
    assert (check.fixes, check.changed) == (0, False)


@pytest.mark.parametrize("seed", [3])
def test_calico_and_host_endpoint_deltas_in_the_kernel(node: Node, seed: int) -> None:
    """The same with Calico's kinds and host endpoints among the changes: every delta
    (host chains rewritten, policy chains with untracked and pre-DNAT verdicts) is one
    transaction the kernel takes, and builds what a full apply builds; only entering or
    leaving Calico's model, the node's first host endpoint or its last, and NAT switched
    replace the table."""
    r = random.Random(seed)
    world = fz.World()
    for _ in range(40):
        world.apply(fz.random_update(r, world.state(), calico=True))
    for h in (fz.host_endpoint(r) for _ in range(3)):  # this node's too, from the start
        world.apply(Update("host-endpoint", h.key, dataclasses.replace(h, node=fz.NODE)))
    dp = PolicyDataplane(fz.NODE)
    ref = Renderer("tabbyref")

    def reference() -> str:
        snap = Snapshot(engine.compute(world.state(), fz.NODE), world.nat)
        return dp.backend.run(ref.full(snap))

    assert node.run(dp.sync, world.state(), world.nat).full
    hosts_seen = policed = 0
    for i in range(OPS):
        u = fz.random_update(r, world.state(), calico=True)
        was = (world.nat.enabled, fz.calico_mode(world), bool(dp.desired().hosts))
        world.apply(u)
        res = node.run(dp.update, [u])
        ir = engine.compute(world.state(), fz.NODE)
        hosts = bool(ir.hosts)
        hosts_seen += hosts
        policed += any(spans for h in ir.hosts.values() for _, spans in h.stages)
        now = (world.nat.enabled, fz.calico_mode(world), hosts)
        assert res.full == (was != now), f"op {i}: {u}"
        node.run(reference)
        assert _canonical(node, "tabby") == _canonical(node, "tabbyref"), f"op {i}: {u}"
    assert hosts_seen > OPS // 10
    assert policed > OPS // 20  # host endpoints with policies in some stage
    assert dp.counters.apply_errors == 0
