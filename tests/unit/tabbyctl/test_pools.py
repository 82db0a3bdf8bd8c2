"""``tabbyctl pool``: list, add (and its refusals), disable, enable, delete."""

from __future__ import annotations

import ipaddress

import pytest

from ipam.core import NoAddressAvailable
from tests.unit.tabbyctl.helpers import (
    V4,
    V6,
    Ctl,
    ctl_fixture,  # noqa: F401  (the ``ctl`` fixture)
    ok,
    one_line_error,
    row,
)

# == pools ==================================================================================


def test_pool_list_empty(ctl: Ctl) -> None:
    assert ok(ctl.run("pool", "list")) == [
        "no pools yet (a pool is created on the first ADD that needs it)"
    ]
    assert ctl.json("pool", "list") == []


def test_pool_add_and_list(ctl: Ctl) -> None:
    assert ok(ctl.run("pool", "add", "10.50.0.0/16", "--block-size", "24")) == [
        "pool 10.50.0.0/16 added"
    ]
    assert ok(ctl.run("pool", "add", "fd00:50::/64")) == ["pool fd00:50::/64 added"]
    lines = ok(ctl.run("pool", "list"))
    assert row(lines, "10.50.0.0/16")[1:] == ["/24", "65536", "0", "0", "65536", "0", "enabled"]
    assert row(lines, "fd00:50::/64")[1] == "/122"
    data = ctl.json("pool", "list")
    assert [p["cidr"] for p in data] == ["10.50.0.0/16", "fd00:50::/64"]
    assert data[0]["block_size"] == 24
    # the new pool serves addresses
    ip = ctl.add("pod-a", pools=("10.50.0.0/16",), v6=False)[0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("10.50.0.0/16")
    assert ctl.json("pool", "list")[0]["in_use"] == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["10.50.0.0/16"], "overlaps"),  # exists already
        (["10.50.3.0/24"], "overlaps"),
        (["10.51.0.1/16"], "10.51.0.1/16"),  # host bits
        (["nonsense"], "nonsense"),
        (["10.52.0.0/16", "--block-size", "12"], "block size"),
        (["10.53.0.0/28"], "smaller than one block"),
    ],
)
def test_pool_add_refusals_are_one_line(ctl: Ctl, args: list[str], needle: str) -> None:
    ctl.run("pool", "add", "10.50.0.0/16")
    assert needle in one_line_error(ctl.run("pool", "add", *args))


def test_pool_disable_and_enable(ctl: Ctl) -> None:
    ctl.add("pod-a", v6=False)
    assert ok(ctl.run("pool", "disable", V4)) == [f"pool {V4} disabled"]
    assert row(ok(ctl.run("pool", "list")), V4)[-1] == "disabled"
    assert ctl.json("pool", "list")[0]["disabled"] is True
    assert ctl.json("ipam", "show")["pools"][0]["disabled"] is True
    # existing allocations stay; a disabled pool serves no new address ...
    assert len(ctl.ipam().allocations()) == 1
    with pytest.raises(NoAddressAvailable, match="disabled"):
        ctl.add("pod-b", v6=False)
    # ... and another pool serves instead
    ctl.run("pool", "add", "10.60.0.0/16")
    ip = ctl.add("pod-c", pools=(V4, "10.60.0.0/16"), v6=False)[0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("10.60.0.0/16")
    # disabling twice is fine
    assert ctl.run("pool", "disable", V4).exit_code == 0
    assert ok(ctl.run("pool", "enable", V4)) == [f"pool {V4} enabled"]
    assert row(ok(ctl.run("pool", "list")), V4)[-1] == "enabled"
    ip = ctl.add("pod-d", v6=False)[0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(V4)


@pytest.mark.parametrize("verb", ["disable", "enable", "delete"])
def test_pool_verbs_on_a_missing_pool(ctl: Ctl, verb: str) -> None:
    ctl.run("pool", "add", V4)
    assert "no such pool: 10.77.0.0/16" in one_line_error(ctl.run("pool", verb, "10.77.0.0/16"))


def test_pool_delete_refuses_a_pool_in_use(ctl: Ctl) -> None:
    ips = ctl.add("pod-a", v6=False)
    block = ctl.block_of(ips[0])
    line = one_line_error(ctl.run("pool", "delete", V4))
    assert "pool in use" in line
    assert block in line
    assert [p["cidr"] for p in ctl.json("pool", "list")] == [V4, V6]
    assert ctl.ipam().who_owns(ips[0]) is not None


def test_pool_delete_empty_pool(ctl: Ctl) -> None:
    ips = ctl.add("pod-a", v6=False)
    ctl.run("ipam", "release", "--ip", ips[0])
    ctl.veths.clear()  # the pod is gone
    assert ok(ctl.run("pool", "delete", V4)) == [f"pool {V4} deleted"]
    assert [p["cidr"] for p in ctl.json("pool", "list")] == [V6]
    # its (empty) block went with it
    assert ctl.json("ipam", "show", "--show-blocks")["blocks"] == []
    assert ctl.json("ipam", "check")["ok"] is True
