"""``tabbyctl ipam check``: faults injected into the store, and this node's pods whose netns or
host veth is gone."""

from __future__ import annotations

import copy
import errno
import ipaddress
import json
from collections.abc import Callable
from pathlib import Path

import pytest

import dataplane
from dataplane import HostVeth, host_veth_name
from dataplane.errors import NetlinkFailure
from ipam.core import PoolSpec
from tests.unit.tabbyctl.helpers import (
    NET,
    NODE,
    Ctl,
    ctl_fixture,  # noqa: F401  (the ``ctl`` fixture)
    findings,
    ok,
    one_line_error,
    row,
)

# == ipam check: the store ==================================================================


def test_check_clean_store_and_node(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ctl.add("pod-b", v6=False)
    result = ctl.run("ipam", "check")
    assert ok(result) == [f"no problems found (file store {ctl.data_dir}, node {NODE})"]
    assert ctl.json("ipam", "check") == {"store": [], "node": [], "node_name": NODE, "ok": True}


def test_check_empty_store(ctl: Ctl) -> None:
    assert ctl.run("ipam", "check").exit_code == 0


def _unindex_block(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """An address in a block its node's index does not list: its DEL could not find it."""
    block = ctl.block_of(ips[0])
    ctl.edit("affinity", NODE, lambda d: d["blocks"].remove(block))
    return "unindexed-allocation", block


def _duplicate_block(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """A second (overlapping /27) block holding the same address: one address twice."""
    block = ctl.block_of(ips[0])
    store = ctl.store()
    doc = store.get("block", block)
    assert doc is not None
    data = copy.deepcopy(doc.data)
    net = ipaddress.ip_network(block)
    dup = str(ipaddress.ip_network(f"{net.network_address}/27"))
    data["cidr"] = dup
    data["allocations"] = data["allocations"][:32]
    data["unallocated"] = [o for o in data["unallocated"] if o < 32]
    with store.lock():
        store.put("block", dup, data, None)
    return "block-overlap", dup


def _free_and_used(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """An allocated ordinal also listed free: the next ADD could get the same address."""
    block = ctl.block_of(ips[0])
    ordinal = int(ipaddress.ip_address(ips[0])) - int(ipaddress.ip_network(block).network_address)
    ctl.edit("block", block, lambda d: d["unallocated"].insert(0, ordinal))
    return "double-state", block


def _block_outside_its_pool(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """Addresses outside their pool: the block claims a pool that does not contain it."""
    ctl.ipam().add_pool(PoolSpec("10.99.0.0/16"))
    block = ctl.block_of(ips[0])
    ctl.edit("block", block, lambda d: d.update(pool="10.99.0.0/16"))
    return "block-outside-pool", block


def _block_of_no_pool(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    block = ctl.block_of(ips[0])
    ctl.edit("block", block, lambda d: d.update(pool="10.98.0.0/16"))
    return "block-outside-pools", block


def _address_beyond_its_block(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """An allocation past the end of its block cannot be represented: the document is
    reported as corrupt (naming the file)."""
    block = ctl.block_of(ips[0])
    ctl.edit("block", block, lambda d: d["allocations"].append(d["allocations"][-1]))
    return "corrupt", ctl.store().location("block", block)


def _seq_ahead(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    block = ctl.block_of(ips[0])
    ordinal = int(ipaddress.ip_address(ips[0])) - int(ipaddress.ip_network(block).network_address)
    ctl.edit("block", block, lambda d: d["allocations"][ordinal].update(seq=d["seq"] + 5))
    return "seq", block


def _truncated_affinity(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    path = ctl.store().location("affinity", NODE)
    Path(path).write_text('{"format": 1, "kind": "aff')
    return "corrupt", path


@pytest.mark.parametrize(
    "inject",
    [
        _unindex_block,
        _duplicate_block,
        _free_and_used,
        _block_outside_its_pool,
        _block_of_no_pool,
        _address_beyond_its_block,
        _seq_ahead,
        _truncated_affinity,
    ],
)
def test_check_finds_store_faults(
    ctl: Ctl, inject: Callable[[Ctl, list[str]], tuple[str, str]]
) -> None:
    ips = ctl.add("pod-a")
    ctl.add("pod-b")
    assert ctl.run("ipam", "check").exit_code == 0
    kind, subject = inject(ctl, ips)
    result = ctl.run("ipam", "check")
    assert result.exit_code == 1, result.output
    assert row(result.stdout.splitlines(), "SEVERITY") == ["SEVERITY", "KIND", "SUBJECT", "PROBLEM"]
    assert any(
        line.split()[:3] == ["error", kind, subject] for line in result.stdout.splitlines()
    ), result.stdout
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    assert {"severity": "error", "kind": kind, "subject": subject} in [
        {k: p[k] for k in ("severity", "kind", "subject")} for p in data["store"]
    ]


def test_check_an_allocation_gone_from_its_block_store_only(ctl: Ctl) -> None:
    """A block that forgot an allocation of another node's pod: the store holds no other
    record of it (the handle is a field of the allocation), so the store check cannot see
    it; only the node that runs the pod can (next test)."""
    ips = ctl.add("pod-a", node="node-b", veth=False, netns=False)
    ctl.drop_block_entry(ips[0])
    result = ctl.run("ipam", "check")
    assert result.exit_code == 0, result.output
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is True
    assert data["store"] == []


def test_check_an_allocation_gone_from_its_block_for_a_live_pod(ctl: Ctl) -> None:
    """The same fault while the pod lives: its address could be handed out again. The
    node check sees the host route (and veth) with no allocation: exit 1."""
    ips = ctl.add("pod-a")
    single = ctl.add("pod-b", v6=False)
    ctl.drop_block_entry(ips[0])
    ctl.drop_block_entry(single[0])
    result = ctl.run("ipam", "check")
    assert result.exit_code == 1, result.output
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    got = findings(data)
    veth_a = host_veth_name("cali", NET, "pod-a", "eth0")
    veth_b = host_veth_name("cali", NET, "pod-b", "eth0")
    assert ("route-without-allocation", veth_a) in got
    assert ("route-without-allocation", veth_b) in got
    # pod-b has no address left at all: its tagged veth is an orphan too
    assert ("veth-without-allocation", veth_b) in got
    assert ("veth-without-allocation", veth_a) not in got
    messages = " ".join(p["message"] for p in data["node"])
    assert ips[0] in messages
    assert single[0] in messages


# == ipam check: this node ==================================================================


def test_check_finds_a_deleted_netns(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ips = ctl.add("pod-b")
    ctl.netns("pod-b").unlink()
    result = ctl.run("ipam", "check")
    assert result.exit_code == 1
    cells = row(result.stdout.splitlines(), "node")
    assert cells[1:3] == ["netns-gone", f"{NET}:pod-b:eth0"]
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["store"] == []
    (finding,) = data["node"]
    assert finding["kind"] == "netns-gone"
    assert str(ctl.netns("pod-b")) in finding["message"]
    assert all(ip in finding["message"] for ip in ips)


def test_check_finds_a_removed_host_veth(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ctl.add("pod-b")
    gone = host_veth_name("cali", NET, "pod-b", "eth0")
    ctl.veths = [v for v in ctl.veths if v.name != gone]
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    assert [(f["kind"], f["subject"]) for f in data["node"]] == [
        ("host-veth-gone", f"{NET}:pod-b:eth0")
    ]
    assert gone in data["node"][0]["message"]
    assert ctl.run("ipam", "check").exit_code == 1


def test_check_finds_a_veth_and_a_route_without_allocation(ctl: Ctl) -> None:
    ctl.add("pod-a")
    orphan = ctl.add_veth("pod-x", ["10.244.200.9"])
    stray = ctl.veths[0]
    ctl.veths[0] = HostVeth(
        stray.name,
        stray.index,
        stray.up,
        stray.alias,
        (*stray.routes, ipaddress.ip_network("10.244.201.1/32")),
    )
    # A cali* veth that tabby did not make (no tabby: alias) is not tabby's business,
    # but a host route through it to an address not allocated here still is reported.
    foreign = ctl.add_veth("pod-y", [], alias="")
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    assert findings(data) == {
        ("veth-without-allocation", orphan),
        ("route-without-allocation", orphan),
        ("route-without-allocation", stray.name),
    }
    assert foreign not in {f["subject"] for f in data["node"]}
    lines = ctl.run("ipam", "check").stdout.splitlines()
    assert any("10.244.201.1/32" in line for line in lines)


def test_check_ignores_other_nodes_allocations(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ctl.add("remote", node="node-b", netns=False, veth=False)
    assert ctl.json("ipam", "check")["ok"] is True
    # ... unless this node is told it is node-b
    data = json.loads(ctl.run("--node", "node-b", "ipam", "check", "-o", "json").stdout)
    assert data["node_name"] == "node-b"
    kinds = {(f["kind"], f["subject"]) for f in data["node"]}
    assert ("netns-gone", f"{NET}:remote:eth0") in kinds
    assert ("host-veth-gone", f"{NET}:remote:eth0") in kinds


def test_check_dataplane_failure_is_one_line(ctl: Ctl, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl.add("pod-a")

    def broken(prefix: str) -> list[HostVeth]:
        raise NetlinkFailure("dump links", "host", errno.EPERM)

    monkeypatch.setattr(dataplane, "list_host_veths", broken)
    assert "cannot list host veths" in one_line_error(ctl.run("ipam", "check"))
