"""``tabbyctl ipam`` in cluster mode: every node's blocks and allocations in ``ipam show``
(``--node`` to filter), ``ipam gc --node N`` for a node that is gone (refused while its
heartbeat is in the datastore, unless ``--force``), and tabby-node's VXLAN tunnel addresses,
which the node-local leak checks of ``ipam check`` and ``ipam gc`` must leave alone.

Two "nodes" share one private file store (set-up in helpers.py); the gone-node release
also runs over the memory store.
"""

from __future__ import annotations

import ipaddress
import json
from typing import Any

import pytest

from datastore.memory import MemoryStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from tabbyctl import views
from tests.unit.tabbyctl.helpers import (
    NODE,
    V4,
    V6,
    Ctl,
    ctl_fixture,  # noqa: F401  (the ``ctl`` fixture)
    ok,
    one_line_error,
    row,
)

OTHER = "node-b"
TUNNEL_HANDLE = handle_id("tabby-tunnel", f"vxlan-tunnel-addr-{NODE}", "vxlan.tabby")


def add_tunnel(ipam: Ipam, node: str = NODE) -> str:
    """The VXLAN tunnel address as tabby-node allocates it (``Tunnels.ensure``)."""
    ipam.ensure_pools([PoolSpec(V4), PoolSpec(V6)])
    (got,) = ipam.assign(
        AssignRequest(
            handle_id("tabby-tunnel", f"vxlan-tunnel-addr-{node}", "vxlan.tabby"),
            attrs={"node": node, "network": "tabby-tunnel", "purpose": "vxlan-tunnel"},
            v4_pools=[V4],
        )
    )
    return str(got.ip)


def beat(ctl: Ctl, node: str = OTHER) -> None:
    """tabby-node's heartbeat document (``Liveness.beat``)."""
    ctl.store().put_leased(  # type: ignore[attr-defined]
        "heartbeat", node, {"node": node, "time": 1.0e9, "pid": 4242}, None, ttl=300
    )


def two_nodes(ctl: Ctl) -> dict[str, list[str]]:
    return {
        "a1": ctl.add("a1"),
        "a2": ctl.add("a2"),
        "b1": ctl.add("b1", node=OTHER, veth=False),
        "b2": ctl.add("b2", node=OTHER, veth=False, v6=False),
    }


# == ipam show ===================================================================================


def test_show_lists_every_nodes_blocks_and_allocations(ctl: Ctl) -> None:
    pods = two_nodes(ctl)
    lines = ok(ctl.run("ipam", "show"))  # no --show-blocks: two nodes hold blocks
    assert " ".join(row(lines, "BLOCK")) == "BLOCK POOL AFFINITY IN USE FREE"
    affinities = {line.split()[2] for line in lines if line.startswith(("10.244.", "fd00:"))}
    assert {f"host:{NODE}", f"host:{OTHER}"} <= affinities
    for pod, ips in pods.items():
        node = OTHER if pod.startswith("b") else NODE
        for ip in ips:
            assert row(lines, ip)[1:3] == [node, f"e2e/{pod}"]
    data = ctl.json("ipam", "show")
    assert {b["node"] for b in data["blocks"]} == {NODE, OTHER}
    assert {a["ip"]: a["node"] for a in data["allocations"]} == {
        ip: (OTHER if pod.startswith("b") else NODE) for pod, ips in pods.items() for ip in ips
    }


def test_show_node_filters_blocks_and_allocations(ctl: Ctl) -> None:
    pods = two_nodes(ctl)
    data = ctl.json("ipam", "show", "--node", OTHER)
    assert data["node"] == OTHER
    assert sorted(a["ip"] for a in data["allocations"]) == sorted(pods["b1"] + pods["b2"])
    assert {b["node"] for b in data["blocks"]} == {OTHER}
    assert sum(b["in_use"] for b in data["blocks"]) == 3
    assert len(data["pools"]) == 2  # pools stay cluster-wide
    lines = ok(ctl.run("ipam", "show", "--node", NODE))
    for ip in pods["a1"]:
        assert row(lines, ip)[1] == NODE
    assert not any(ip in " ".join(lines) for ip in pods["b1"])
    assert ctl.json("ipam", "show", "--node", "nobody")["allocations"] == []


def test_show_single_node_keeps_blocks_behind_the_flag(ctl: Ctl) -> None:
    ctl.add("a1")
    assert "blocks" not in ctl.json("ipam", "show")
    assert len(ctl.json("ipam", "show", "--show-blocks")["blocks"]) == 2


def test_show_ip_and_node_together_is_a_usage_error(ctl: Ctl) -> None:
    result = ctl.run("ipam", "show", "--ip", "10.244.0.9", "--node", NODE)
    assert result.exit_code == 2
    assert "give --ip or --node, not both" in result.stderr


def test_a_borrowed_address_shows_its_node_and_its_blocks_node(ctl: Ctl) -> None:
    [ip] = ctl.add("b1", node=OTHER, veth=False, v6=False)

    def lend(d: dict[str, Any]) -> None:  # node-a recorded it in node-b's block
        for a in d["allocations"]:
            if a is not None:
                a["attrs"]["node"] = NODE

    ctl.edit("block", ctl.block_of(ip), lend)
    [alloc] = ctl.json("ipam", "show")["allocations"]
    assert (alloc["node"], alloc["block_node"]) == (NODE, OTHER)


# == VXLAN tunnel addresses ========================================================================


def test_tunnel_addresses_are_shown_as_such(ctl: Ctl) -> None:
    tunnel = add_tunnel(ctl.ipam())
    ctl.add("a1")
    lines = ok(ctl.run("ipam", "show"))
    assert row(lines, tunnel)[1:4] == [NODE, "vxlan-tunnel", "vxlan.tabby"]
    by_ip = {a["ip"]: a for a in ctl.json("ipam", "show")["allocations"]}
    assert by_ip[tunnel]["purpose"] == "vxlan-tunnel"
    assert by_ip[tunnel]["handle"] == TUNNEL_HANDLE
    assert {a["purpose"] for ip, a in by_ip.items() if ip != tunnel} == {"workload"}


def test_check_leaves_tunnel_addresses_alone(ctl: Ctl) -> None:
    tunnel = add_tunnel(ctl.ipam())
    result = ctl.run("ipam", "check")
    lines = ok(result)
    assert lines[0].startswith("no problems found")
    assert lines[1] == (
        "vxlan tunnel addresses of tabby-node (no netns or veth by design, never leaks): "
        f"{tunnel} (vxlan.tabby)"
    )
    data = ctl.json("ipam", "check")
    assert (data["ok"], data["node"]) == (True, [])
    assert [t["ip"] for t in data["vxlan_tunnels"]] == [tunnel]
    # a real leak next to it is still found, and the tunnel still is not
    ctl.add("gone", netns=False, veth=False)
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert {f["subject"] for f in data["node"]} == {"net1:gone:eth0"}


def test_another_nodes_tunnel_is_not_this_nodes_business(ctl: Ctl) -> None:
    add_tunnel(ctl.ipam(OTHER), OTHER)
    data = ctl.json("ipam", "check")
    assert "vxlan_tunnels" not in data
    assert data["ok"] is True


def test_gc_keeps_tunnel_addresses(ctl: Ctl) -> None:
    tunnel = add_tunnel(ctl.ipam())
    leaked = ctl.add("gone", netns=False, veth=False)
    dry = ctl.json("ipam", "gc", "--grace", "0", "--dry-run")
    assert dry["stale"] == {"net1:gone:eth0": leaked}
    assert [t["ip"] for t in dry["vxlan_tunnels"]] == [tunnel]
    lines = ok(ctl.run("ipam", "gc", "--grace", "0"))
    assert lines[-1].startswith("vxlan tunnel addresses of tabby-node")
    assert f"released {len(leaked)} addresses" in lines
    assert [str(o.ip) for o in ctl.ipam().allocations()] == [tunnel]
    assert ok(ctl.run("ipam", "gc", "--grace", "0"))[0] == f"no leaked allocations on node {NODE}"


# == ipam gc --node ================================================================================


def test_gc_node_releases_a_gone_node(ctl: Ctl) -> None:
    pods = two_nodes(ctl)
    tunnel = add_tunnel(ctl.ipam(OTHER), OTHER)
    data = ctl.json("ipam", "gc", "--node", OTHER)
    gone = [*pods["b1"], *pods["b2"], tunnel]
    assert sorted(data["addresses"]) == sorted(gone)
    assert sorted(data["released"]) == sorted(
        [
            "net1:b1:eth0",
            "net1:b2:eth0",
            handle_id("tabby-tunnel", f"vxlan-tunnel-addr-{OTHER}", "vxlan.tabby"),
        ]
    )
    assert len(data["deleted_blocks"]) == 2
    assert data["unaffined_blocks"] == []
    assert (data["node"], data["dry_run"], data["alive"], data["errors"]) == (
        OTHER,
        False,
        False,
        [],
    )
    left = ctl.ipam().allocations()
    assert sorted(str(o.ip) for o in left) == sorted(pods["a1"] + pods["a2"])
    assert {b.node for b in ctl.ipam().block_usage()} == {NODE}
    # again: nothing left to do
    lines = ok(ctl.run("ipam", "gc", "--node", OTHER))
    assert lines == [
        f"node {OTHER}: released 0 address(es) of 0 attachment(s), deleted 0 empty block(s), "
        "made 0 block(s) still in use affine to no node"
    ]


def test_gc_node_table_and_dry_run(ctl: Ctl) -> None:
    pods = two_nodes(ctl)
    dry = ok(ctl.run("ipam", "gc", "--node", OTHER, "--dry-run"))
    assert dry[-1] == (
        f"node {OTHER}: would release 3 address(es) of 2 attachment(s), would delete 2 empty "
        "block(s), would make 0 block(s) still in use affine to no node"
    )
    assert row(dry, "net1:b1:eth0")[1:] == ["release", "attachment"]
    assert len(ctl.ipam().allocations()) == 7  # nothing released
    lines = ok(ctl.run("ipam", "gc", "--node", OTHER))
    assert row(lines, "HANDLE")[1:] == ["OR", "BLOCK", "ACTION"]
    assert row(lines, "net1:b2:eth0")[1:] == ["release", "attachment"]
    assert sum(1 for line in lines if line.endswith("delete empty block")) == 2
    block = ctl.block_of(pods["a1"][0])
    assert block not in " ".join(lines)  # node-a's blocks stay


def test_gc_node_dry_run_predicts_a_block_still_in_use(ctl: Ctl) -> None:
    """node-a holds an address in node-b's block: the block loses its affinity but stays."""
    [kept] = ctl.add("b1", node=OTHER, veth=False, v6=False)
    [gone] = ctl.add("b2", node=OTHER, veth=False, v6=False)
    block = ctl.block_of(kept)
    ordinal = int(ipaddress.ip_address(kept)) - int(ipaddress.ip_network(block).network_address)

    def lend(d: dict[str, Any]) -> None:
        d["allocations"][ordinal]["attrs"]["node"] = NODE

    ctl.edit("block", block, lend)
    dry = ctl.json("ipam", "gc", "--node", OTHER, "--dry-run")
    done = ctl.json("ipam", "gc", "--node", OTHER)
    for data in (dry, done):
        assert (data["addresses"], data["unaffined_blocks"], data["deleted_blocks"]) == (
            [gone],
            [block],
            [],
        )
    owner = ctl.ipam().who_owns(kept)
    assert owner is not None
    assert owner.node is None  # affine to no node, the borrowed address kept


def test_gc_node_refused_while_the_heartbeat_lives(ctl: Ctl) -> None:
    two_nodes(ctl)
    beat(ctl)
    line = one_line_error(ctl.run("ipam", "gc", "--node", OTHER))
    assert f"node {OTHER} is alive: its heartbeat is in the datastore" in line
    assert "--force" in line
    assert len(ctl.ipam().allocations()) == 7
    # a dry run is allowed, and says so
    dry = ok(ctl.run("ipam", "gc", "--node", OTHER, "--dry-run"))
    assert dry[0] == f"warning: node {OTHER} is alive (its heartbeat is in the datastore)"
    assert ctl.json("ipam", "gc", "--node", OTHER, "--dry-run")["alive"] is True
    # another node's heartbeat does not protect this one
    assert ctl.json("ipam", "gc", "--node", "node-c")["alive"] is False
    forced = ctl.json("ipam", "gc", "--node", OTHER, "--force")
    assert (forced["alive"], forced["forced"], len(forced["addresses"])) == (True, True, 3)
    assert len(ctl.ipam().allocations()) == 4


def test_gc_node_usage_and_errors(ctl: Ctl) -> None:
    result = ctl.run("ipam", "gc", "--force")
    assert result.exit_code == 2
    assert "--force goes with --node" in result.stderr
    assert "invalid node name" in one_line_error(ctl.run("ipam", "gc", "--node", "a:b"))


def test_release_gone_node_over_the_memory_store() -> None:
    store = MemoryStore()
    other = Ipam(store, OTHER)
    other.ensure_pools([PoolSpec(V4)])
    other.assign(AssignRequest(handle_id("net1", "c1", "eth0"), {"node": OTHER}, v4_pools=[V4]))
    store.put_leased("heartbeat", OTHER, {"node": OTHER, "time": 1.0e9}, None, ttl=300)
    with pytest.raises(views.CtlError, match="is alive"):
        views.release_gone_node(Ipam(store, ""), OTHER, force=False, dry_run=False)
    hb = store.get("heartbeat", OTHER)
    assert hb is not None
    store.delete("heartbeat", OTHER, hb.revision)
    data = views.release_gone_node(Ipam(store, ""), OTHER, force=False, dry_run=False)
    assert (len(data["addresses"]), len(data["deleted_blocks"]), data["alive"]) == (1, 1, False)
    assert Ipam(store, "").allocations() == []
