"""``tabbyctl ipam release`` and ``tabbyctl ipam gc``: one allocation by IP or handle, and this
node's leaks (dry run, grace, another node)."""

from __future__ import annotations

import json

import pytest

from tests.unit.tabbyctl.helpers import (
    NET,
    NODE,
    Ctl,
    ctl_fixture,  # noqa: F401  (the ``ctl`` fixture)
    ok,
    one_line_error,
    row,
)

# == ipam release ===========================================================================


def test_release_by_ip(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    assert ok(ctl.run("ipam", "release", "--ip", ips[0])) == [f"released {ips[0]}"]
    assert ctl.ipam().who_owns(ips[0]) is None
    assert ctl.ipam().who_owns(ips[1]) is not None  # the other family stays
    assert ctl.json("ipam", "release", "--ip", ips[1]) == {"released": [ips[1]]}
    assert ctl.ipam().allocations() == []
    assert ctl.store().list_keys("handle") == []  # the empty handle went with it
    again = ctl.run("ipam", "release", "--ip", ips[0])
    assert (again.exit_code, again.stdout) == (1, "nothing to release\n")


def test_release_by_handle(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    kept = ctl.add("pod-b")
    result = ctl.run("ipam", "release", "--handle", f"{NET}:pod-a:eth0")
    assert ok(result) == [f"released {', '.join(ips)}"]
    assert [str(o.ip) for o in ctl.ipam().allocations()] == kept
    data = json.loads(
        ctl.run("ipam", "release", "--handle", f"{NET}:pod-b:eth0", "-o", "json").stdout
    )
    assert data == {"released": kept}
    missing = ctl.run("ipam", "release", "--handle", f"{NET}:pod-b:eth0", "-o", "json")
    assert missing.exit_code == 1
    assert json.loads(missing.stdout) == {"released": []}


@pytest.mark.parametrize(
    "args", [[], ["--ip", "10.244.0.9", "--handle", f"{NET}:pod-a:eth0"], ["--ip", ""]]
)
def test_release_needs_exactly_one_of_ip_or_handle(ctl: Ctl, args: list[str]) -> None:
    ctl.add("pod-a")
    result = ctl.run("ipam", "release", *args)
    assert result.exit_code == 2
    assert "give exactly one of --ip or --handle" in result.stderr
    assert len(ctl.ipam().allocations()) == 2


@pytest.mark.parametrize(("flag", "value"), [("--handle", "no-colons"), ("--ip", "10.244.0.")])
def test_release_invalid_value_is_one_line(ctl: Ctl, flag: str, value: str) -> None:
    assert value in one_line_error(ctl.run("ipam", "release", flag, value))


# == ipam gc ================================================================================


@pytest.fixture
def leaks(ctl: Ctl) -> dict[str, list[str]]:
    """Attachments of this node in every state GC must tell apart."""
    return {
        # after a reboot: netns and host veth gone, allocation old -> released
        "leaked": ctl.add("leaked", netns=False, veth=False),
        "leaked-too": ctl.add("leaked-too", netns=False, veth=False, v6=False),
        # netns path gone but the veth lives (e.g. netns held by a process) -> kept
        "veth-alive": ctl.add("veth-alive", netns=False, veth=True),
        # veth gone but netns there (half-torn-down, DEL will finish) -> kept
        "netns-alive": ctl.add("netns-alive", netns=True, veth=False),
        # everything alive -> kept
        "alive": ctl.add("alive"),
        # gone, but younger than the grace period -> kept
        "young": ctl.add("young", netns=False, veth=False, age=5),
        # gone, but another node's -> kept
        "remote": ctl.add("remote", node="node-b", netns=False, veth=False),
    }


def test_gc_dry_run_lists_only_leaks_and_changes_nothing(
    ctl: Ctl, leaks: dict[str, list[str]]
) -> None:
    before = ctl.ipam().allocations()
    data = ctl.json("ipam", "gc", "--dry-run")
    assert data == {
        "dry_run": True,
        "stale": {
            f"{NET}:leaked:eth0": leaks["leaked"],
            f"{NET}:leaked-too:eth0": leaks["leaked-too"],
        },
    }
    lines = ok(ctl.run("ipam", "gc", "--dry-run"))
    assert row(lines, f"{NET}:leaked:eth0")[1:] == [f"{leaks['leaked'][0]},", leaks["leaked"][1]]
    assert lines[-1] == "would release 3 addresses"
    assert ctl.ipam().allocations() == before


def test_gc_releases_this_nodes_leaks_only(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    result = ctl.run("ipam", "gc")
    lines = ok(result)
    assert lines[-1] == "released 3 addresses"
    assert row(lines, f"{NET}:leaked-too:eth0")[1:] == leaks["leaked-too"]
    left = {str(o.ip) for o in ctl.ipam().allocations()}
    gone = set(leaks["leaked"] + leaks["leaked-too"])
    assert left == {ip for ips in leaks.values() for ip in ips} - gone
    assert f"{NET}:leaked:eth0" not in ctl.store().list_keys("handle")
    # nothing more to do
    assert ok(ctl.run("ipam", "gc")) == [f"no leaked allocations on node {NODE}"]


def test_gc_grace(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    data = ctl.json("ipam", "gc", "--grace", "0")
    assert data["dry_run"] is False
    assert set(data["released"]) == {
        f"{NET}:leaked:eth0",
        f"{NET}:leaked-too:eth0",
        f"{NET}:young:eth0",
    }
    assert data["released"][f"{NET}:young:eth0"] == leaks["young"]


def test_gc_long_grace_keeps_everything(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    assert ctl.json("ipam", "gc", "--grace", "86400") == {"dry_run": False, "released": {}}
    assert len(ctl.ipam().allocations()) == sum(len(v) for v in leaks.values())


def test_gc_as_another_node(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    data = json.loads(ctl.run("--node", "node-b", "ipam", "gc", "-o", "json").stdout)
    assert data["released"] == {f"{NET}:remote:eth0": leaks["remote"]}
