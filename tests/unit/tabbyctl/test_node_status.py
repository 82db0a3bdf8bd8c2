"""``tabbyctl node status``: the status file tabby-node writes (``tabby_node.status``) plus
BIRD's sessions read live from a fake BIRD control socket (BIRD 2.0.12's own reply to ``show
protocols all``); tables, JSON, and the failures: no tabby-node, BIRD silent, stale file."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from tabby_node.status import write_status
from tabbyctl.cli import cli
from tests.unit.bird.fake_bird import SHOW_PROTOCOLS_ALL, FakeBird

UPDATED = 1_795_000_000.0  # 2026-11-18T11:06:40Z

MESH = {
    "address": "10.77.0.2",
    "type": "mesh",
    "state": "Established",
    "since": "2026-11-23T11:08:23Z",
}
RR = {"address": "fd77::3", "type": "rr", "state": "Active", "since": "2026-11-23T11:08:37Z"}
VXLAN = {
    "node": "node-b",
    "address": "192.168.7.2",
    "tunnel_address": "10.244.1.0",
    "mac": "66:1f:aa:00:00:02",
    "device": "vxlan.tabby",
}


def status(backend: str, **extra: Any) -> dict[str, Any]:
    """What tabby-node writes after a reconcile (``StatusReport.write``)."""
    return {
        "node": "node-a",
        "backend": backend,
        "node_ip": "10.77.0.1",
        "node_ip6": None,
        "mtu": 1450,
        "ipip": {"available": False, "reason": "the kernel has no ipip module"},
        "updated": time.time(),
        "problems": {},
        "pid": os.getpid(),
        "peers": [],
        "vxlan": [],
        "routing_problems": [],
        **extra,
    }


def dead_pid() -> int:
    """A pid that no longer runs."""
    proc = subprocess.Popen(["true"])
    proc.wait()
    return proc.pid


@pytest.fixture
def run_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.delenv("TABBY_RUN_DIR", raising=False)
    d = tmp_path / "run"
    d.mkdir()
    return d


@pytest.fixture
def bird(run_dir: Path) -> Iterator[FakeBird]:
    server = FakeBird(str(run_dir / "bird.ctl"), {"show protocols all": SHOW_PROTOCOLS_ALL})
    try:
        yield server
    finally:
        server.close()


def run(*args: str, env: dict[str, str] | None = None) -> Result:
    result = CliRunner().invoke(cli, ["node", "status", *args], env=env, prog_name="tabbyctl")
    assert "Traceback" not in result.output, result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def error_line(result: Result) -> str:
    """Exit 1 and exactly one line on stderr."""
    assert result.exit_code == 1, (result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def cells(lines: list[str], first: str) -> list[str]:
    for line in lines:
        parts = line.split()
        if parts and parts[0] == first:
            return parts
    raise AssertionError(f"no row {first!r} in:\n" + "\n".join(lines))


# == bird backend =============================================================================


def test_bird_peers_are_read_live_from_bird(run_dir: Path, bird: FakeBird) -> None:
    write_status(str(run_dir), status("bird", peers=[]))
    result = run("--run-dir", str(run_dir))
    assert result.exit_code == 0, (result.stdout, result.stderr)
    lines = result.stdout.splitlines()
    assert cells(lines, "NODE") == ["NODE", "node-a"]
    assert cells(lines, "BACKEND") == ["BACKEND", "bird"]
    assert cells(lines, "NODE")[1] == "node-a"
    assert " ".join(cells(lines, "PEER")) == "PEER ADDRESS TYPE STATE SINCE INFO"
    assert cells(lines, "10.77.0.2")[:4] == ["10.77.0.2", "mesh", "Established", MESH["since"]]
    assert cells(lines, "fd77::3")[:4] == ["fd77::3", "rr", "Active", RR["since"]]
    assert "bgp1" not in result.stdout  # not one of tabby's sessions
    assert "IP-in-IP unavailable: the kernel has no ipip module" in lines
    assert bird.received == ["show protocols all"]


def test_bird_json_has_the_contract_keys(run_dir: Path, bird: FakeBird) -> None:
    write_status(str(run_dir), status("bird", vxlan=[VXLAN]))
    result = run("--run-dir", str(run_dir), "-o", "json")
    assert result.exit_code == 0, result.stderr
    data = json.loads(result.stdout)
    assert {k: data[k] for k in ("node", "backend", "node_ip")} == {
        "node": "node-a",
        "backend": "bird",
        "node_ip": "10.77.0.1",
    }
    assert [{k: p[k] for k in MESH} for p in data["peers"]] == [MESH, RR]
    assert data["peers"][0]["protocol"] == "Mesh_10_77_0_2"
    assert data["peers"][1]["last_error"] == "Socket: Connection refused"
    assert data["vxlan"] == [VXLAN]
    assert data["bird"]["answered"] is True
    assert "errors" not in data


def test_since_stays_what_tabby_node_recorded_for_the_same_session(
    run_dir: Path, bird: FakeBird
) -> None:
    """BIRD recomputes "since" at every query; the second tabby-node recorded for the same
    session and state wins when BIRD's value is within a second or two of it."""
    recorded = [
        {**MESH, "since": "2026-11-23T11:08:22Z", "protocol": "Mesh_10_77_0_2"},
        # same session but another state then: BIRD's current value is shown
        {**RR, "state": "Connect", "since": "2026-11-23T11:08:36Z", "protocol": "Rr_fd77__3"},
    ]
    write_status(str(run_dir), status("bird", peers=recorded))
    data = json.loads(run("--run-dir", str(run_dir), "-o", "json").stdout)
    assert [p["since"] for p in data["peers"]] == ["2026-11-23T11:08:22Z", RR["since"]]


def test_bird_silent_shows_the_recorded_peers_as_unknown(run_dir: Path) -> None:
    recorded = [{**MESH, "protocol": "Mesh_10_77_0_2"}]
    write_status(str(run_dir), status("bird", peers=recorded))
    result = run("--run-dir", str(run_dir), "-o", "json")
    assert f"BIRD does not answer on {run_dir / 'bird.ctl'}" in error_line(result)
    data = json.loads(result.stdout)  # still the whole status, valid JSON
    assert data["peers"] == [
        {
            "address": "10.77.0.2",
            "type": "mesh",
            "state": "unknown",
            "since": "",
            "protocol": "Mesh_10_77_0_2",
            "last_known_state": "Established",
        }
    ]
    assert data["bird"]["answered"] is False
    assert len(data["errors"]) == 1
    table = run("--run-dir", str(run_dir))
    error_line(table)
    assert cells(table.stdout.splitlines(), "10.77.0.2")[:3] == ["10.77.0.2", "mesh", "unknown"]
    # nothing recorded either: unknown, not "none configured"
    write_status(str(run_dir), status("bird"))
    nothing = run("--run-dir", str(run_dir))
    assert "No such file or directory" in error_line(nothing)
    assert "BGP peers unknown: BIRD does not answer" in nothing.stdout.splitlines()


def test_bird_without_peers_says_so(run_dir: Path) -> None:
    empty = "2002-Name       Proto      Table      State  Since         Info\n0000 \n"
    server = FakeBird(str(run_dir / "bird.ctl"), {"show protocols all": empty})
    try:
        write_status(str(run_dir), status("bird"))
        result = run("--run-dir", str(run_dir))
    finally:
        server.close()
    assert result.exit_code == 0, result.stderr
    assert "no BGP peers configured" in result.stdout.splitlines()


# == vxlan and none ==============================================================================


def test_vxlan_lists_the_programmed_endpoints(run_dir: Path) -> None:
    write_status(str(run_dir), status("vxlan", vxlan=[VXLAN]))
    result = run("--run-dir", str(run_dir))
    assert result.exit_code == 0, result.stderr
    lines = result.stdout.splitlines()
    assert " ".join(cells(lines, "VXLAN")) == "VXLAN NODE ADDRESS TUNNEL ADDRESS MAC DEVICE"
    assert cells(lines, "node-b") == [
        "node-b",
        "192.168.7.2",
        "10.244.1.0",
        "66:1f:aa:00:00:02",
        "vxlan.tabby",
    ]
    assert "PEER" not in result.stdout  # no BGP with vxlan: BIRD not asked
    data = json.loads(run("--run-dir", str(run_dir), "-o", "json").stdout)
    assert (data["backend"], data["peers"], data["vxlan"]) == ("vxlan", [], [VXLAN])


def test_vxlan_without_endpoints_and_agent_problems(run_dir: Path) -> None:
    problems = {"policy": "nft: no such file"}
    write_status(str(run_dir), status("vxlan", problems=problems, routing_problems=["route clash"]))
    lines = run("--run-dir", str(run_dir)).stdout.splitlines()
    assert "no VXLAN endpoints programmed" in lines
    assert "problem: policy: nft: no such file" in lines
    assert "problem: route clash" in lines


def test_run_dir_from_the_environment(run_dir: Path) -> None:
    write_status(str(run_dir), status("none", updated=UPDATED, pid=dead_pid()))
    result = run("-o", "json", env={"TABBY_RUN_DIR": str(run_dir)})
    assert result.exit_code == 1  # stale: written long ago by a process that is gone
    data = json.loads(result.stdout)
    assert (data["backend"], data["peers"], data["vxlan"]) == ("none", [], [])
    assert data["run_dir"] == str(run_dir)
    assert data["updated"] == time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(UPDATED))


# == failures ====================================================================================


def test_no_tabby_node_is_one_line(run_dir: Path) -> None:
    for output in ("table", "json"):
        result = run("--run-dir", str(run_dir), "-o", output)
        line = error_line(result)
        assert result.stdout == ""
        assert f"no tabby-node runs here: {run_dir / 'status.json'} does not exist" in line


def test_a_status_file_that_is_not_json_is_one_line(run_dir: Path) -> None:
    (run_dir / "status.json").write_text("{not json")
    result = run("--run-dir", str(run_dir))
    assert "is not a tabby-node status" in error_line(result)
    assert result.stdout == ""


def test_a_stale_status_file_is_shown_and_exits_1(run_dir: Path) -> None:
    old = time.time() - 600
    write_status(str(run_dir), status("vxlan", pid=dead_pid(), updated=old, vxlan=[VXLAN]))
    result = run("--run-dir", str(run_dir), "-o", "json")
    line = error_line(result)
    assert f"{run_dir / 'status.json'} is stale" in line
    assert "is not running" in line
    assert json.loads(result.stdout)["vxlan"] == [VXLAN]  # what it last knew, still shown
    # a tabby-node that runs but has not written for minutes: stuck
    write_status(str(run_dir), status("vxlan", updated=old))
    assert f"(pid {os.getpid()}) has not rewritten it for 600 s" in error_line(
        run("--run-dir", str(run_dir))
    )


def test_a_fresh_file_is_trusted_whatever_the_pid(run_dir: Path) -> None:
    """tabbyctl may run in another pid namespace than tabby-node (host vs container): a
    pid that does not run here proves nothing while the file is fresh."""
    write_status(str(run_dir), status("none", pid=dead_pid(), updated=time.time() - 20))
    result = run("--run-dir", str(run_dir))
    assert result.exit_code == 0, result.stderr


def test_bird_answering_with_an_error_counts_as_silent(run_dir: Path) -> None:
    server = FakeBird(str(run_dir / "bird.ctl"), {})  # every command: 9001 syntax error
    try:
        write_status(str(run_dir), status("bird"))
        result = run("--run-dir", str(run_dir))
    finally:
        server.close()
    assert "BIRD error 9001" in error_line(result)


def test_node_is_a_group() -> None:
    result = CliRunner().invoke(cli, ["node", "--help"])
    assert result.exit_code == 0
    assert "status" in result.stdout
    assert CliRunner().invoke(cli, ["node", "status", "-o", "yaml"]).exit_code == 2
