"""``tabbyctl ipam show``: pools, usage, blocks and single addresses, as a table and as JSON."""

from __future__ import annotations

import json

import pytest

from cni_protocol import skel
from ipam import plugin as ipam_plugin
from tests.unit.tabbyctl.helpers import (
    NET,
    NODE,
    V4,
    V6,
    Ctl,
    ctl_fixture,  # noqa: F401  (the ``ctl`` fixture)
    ok,
    one_line_error,
    row,
)

# == ipam show ==============================================================================


def test_show_table_lists_pools_usage_and_every_allocation(ctl: Ctl) -> None:
    a = ctl.add("pod-a")
    b = ctl.add("pod-b")
    lines = ok(ctl.run("ipam", "show"))
    assert lines[0] == f"file store {ctl.data_dir} ({ctl.conf})"
    header = row(lines, "POOL")
    assert " ".join(header) == "POOL BLOCK SIZE TOTAL IN USE RESERVED FREE BLOCKS STATE"
    # 65536 addresses, 2 in use, the 4 of the reserved /30, the rest free; one block.
    assert row(lines, V4)[1:] == ["/26", "65536", "2", "4", "65530", "1", "enabled"]
    # IPv6 sizes a person can read (JSON keeps the exact numbers)
    assert row(lines, V6)[1:4] == ["/122", "2^80", "2"]
    assert row(lines, V6)[5] == "2^80-2"
    assert "BLOCK" not in [line.split()[0] for line in lines if line]  # no --show-blocks
    for ip in a:
        assert row(lines, ip)[1:5] == [NODE, "e2e/pod-a", "eth0", "pod-a"]
    for ip in b:
        assert row(lines, ip)[1:5] == [NODE, "e2e/pod-b", "eth0", "pod-b"]


def test_large_counts_read_as_powers_of_two() -> None:
    from tabbyctl.views import count_text

    assert [count_text(n) for n in (0, 65530, 10**9 - 1, None)] == ["0", "65530", "999999999", "-"]
    assert count_text(2**64) == "2^64"
    assert count_text(2**64 - 70) == "2^64-70"
    assert count_text(2**122 + 5) == "2^122+5"
    assert count_text(3 * 2**70) == "~2^71.6"


def test_show_json_lists_both_pods_with_their_addresses(ctl: Ctl) -> None:
    """Acceptance (unit tier): after two ADDs the JSON maps each address to its pod."""
    a = ctl.add("pod-a")
    b = ctl.add("pod-b")
    data = ctl.json("ipam", "show")
    assert data["store"] == f"file store {ctl.data_dir}"
    assert "blocks" not in data
    by_pod: dict[str, list[str]] = {}
    for alloc in data["allocations"]:
        by_pod.setdefault(alloc["pod"], []).append(alloc["ip"])
    assert by_pod == {"e2e/pod-a": a, "e2e/pod-b": b}
    first = data["allocations"][0]
    assert first == {
        **first,
        "handle": f"{NET}:pod-a:eth0",
        "node": NODE,
        "network": NET,
        "container_id": "pod-a",
        "ifname": "eth0",
        "netns": str(ctl.netns("pod-a")),
    }
    assert isinstance(first["time"], float)
    pools = {p["cidr"]: p for p in data["pools"]}
    assert pools[V4] == {
        "cidr": V4,
        "block_size": 26,
        "disabled": False,
        "total": 65536,
        "in_use": 2,
        "reserved": 4,
        "free": 65530,
        "blocks": 1,
    }
    assert pools[V6]["in_use"] == 2


def test_show_json_after_two_adds_through_the_ipam_plugin(ctl: Ctl) -> None:
    """The same acceptance with the attributes tabby-ipam itself records (skel.run)."""
    plugin_conf = json.loads(ctl.conf.read_text())
    stdin = json.dumps({"cniVersion": "1.1.0", "name": NET, **plugin_conf["plugins"][0]}).encode()
    results = {}
    for pod in ("web-1", "web-2"):
        env = {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": f"cid-{pod}",
            "CNI_NETNS": f"/run/netns/{pod}",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={pod}",
        }
        rc, out = skel.run(ipam_plugin.HANDLERS, env, stdin)
        assert rc == 0, out
        results[pod] = sorted(ip["address"].split("/")[0] for ip in json.loads(out)["ips"])
    data = ctl.json("ipam", "show")
    listed: dict[str, list[str]] = {}
    for alloc in data["allocations"]:
        listed.setdefault(alloc["pod"], []).append(alloc["ip"])
        assert alloc["node"] == NODE
        assert alloc["netns"] == f"/run/netns/{alloc['pod'].split('/')[1]}"
    assert {k: sorted(v) for k, v in listed.items()} == {
        "shop/web-1": results["web-1"],
        "shop/web-2": results["web-2"],
    }
    table = ok(ctl.run("ipam", "show"))
    for pod, ips in results.items():
        for ip in ips:
            assert row(table, ip)[2] == f"shop/{pod}"


def test_show_blocks_table_and_json(ctl: Ctl) -> None:
    a = ctl.add("pod-a")
    ctl.add("pod-b")
    v4_block, v6_block = ctl.block_of(a[0]), ctl.block_of(a[1])
    lines = ok(ctl.run("ipam", "show", "--show-blocks"))
    assert row(lines, "BLOCK") == ["BLOCK", "POOL", "AFFINITY", "IN", "USE", "FREE"]
    assert row(lines, v4_block)[1:] == [V4, f"host:{NODE}", "2", "62"]
    assert row(lines, v6_block)[1:] == [V6, f"host:{NODE}", "2", "62"]
    data = ctl.json("ipam", "show", "--show-blocks")
    assert data["blocks"] == [
        {"cidr": v4_block, "pool": V4, "node": NODE, "in_use": 2, "free": 62},
        {"cidr": v6_block, "pool": V6, "node": NODE, "in_use": 2, "free": 62},
    ]


def test_show_ip_owned(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    lines = ok(ctl.run("ipam", "show", "--ip", ips[0]))
    fields = {line.split()[0]: line.split(None, 1)[1] for line in lines[1:]}
    assert lines[0].split() == ["FIELD", "VALUE"]
    assert fields["IP"] == ips[0]
    assert fields["HANDLE"] == f"{NET}:pod-a:eth0"
    assert fields["BLOCK"] == ctl.block_of(ips[0])
    assert fields["NODE"] == NODE
    assert fields["POD"] == "e2e/pod-a"
    assert fields["IFNAME"] == "eth0"
    assert fields["POD_UID"] == "-"
    assert fields["TIME"].endswith("Z")
    data = ctl.json("ipam", "show", "--ip", ips[1])
    assert data["allocated"] is True
    assert (data["ip"], data["pod"], data["container_id"]) == (ips[1], "e2e/pod-a", "pod-a")


@pytest.mark.parametrize("ip", ["10.244.7.7", "10.99.0.1", "fd00:10:244::99"])
def test_show_ip_not_owned(ctl: Ctl, ip: str) -> None:
    ctl.add("pod-a")
    assert ok(ctl.run("ipam", "show", "--ip", ip)) == [f"{ip} is not allocated"]
    assert ctl.json("ipam", "show", "--ip", ip) == {"ip": ip, "allocated": False}


def test_show_ip_invalid_is_one_line(ctl: Ctl) -> None:
    assert "not-an-ip" in one_line_error(ctl.run("ipam", "show", "--ip", "not-an-ip"))


def test_show_on_an_empty_store_creates_nothing(ctl: Ctl) -> None:
    lines = ok(ctl.run("ipam", "show"))
    assert lines[0] == f"file store {ctl.data_dir} ({ctl.conf})"
    assert ctl.json("ipam", "show")["pools"] == []
    assert ctl.json("ipam", "show")["allocations"] == []
    assert not ctl.data_dir.exists()


def test_invalid_output_format_is_a_usage_error(ctl: Ctl) -> None:
    result = ctl.run("ipam", "show", "-o", "yaml")
    assert result.exit_code == 2
    assert "yaml" in result.stderr
