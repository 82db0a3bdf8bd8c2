"""BIRD's control protocol (bird.control): framing, parsing, node status
and readiness. The canned replies are BIRD 2.0.12's own output (captured from a running
daemon with the rendered ``timeformat``); the client is driven against a fake server."""

from __future__ import annotations

import dataclasses
import datetime as dt
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from bird import (
    BirdCommandError,
    BirdControl,
    BirdUnavailable,
    PeerType,
    SinceMemo,
    peer_statuses,
    readiness,
)
from bird.control import (
    BirdError,
    BirdStatus,
    PeerStatus,
    parse_protocols,
    parse_reply,
    parse_status,
)
from tests.unit.bird.fake_bird import SHOW_PROTOCOLS_ALL, SHOW_STATUS, FakeBird


def reply(text: str) -> list[str]:
    return text.splitlines()


def test_reply_framing_continuations_and_spontaneous_lines() -> None:
    lines = parse_reply(["1000-BIRD 2.0.12", "1011-a", " b", "+spontaneous", "0013 done"])
    assert [(r.code, r.text) for r in lines] == [
        (1000, "BIRD 2.0.12"),
        (1011, "a"),
        (1011, "b"),
        (13, "done"),
    ]
    with pytest.raises(BirdError, match="unexpected line"):
        parse_reply(["garbage"])


def test_show_protocols_all_is_parsed() -> None:
    protocols = parse_protocols(parse_reply(reply(SHOW_PROTOCOLS_ALL)))
    assert [p.name for p in protocols] == [
        "tabby_device",
        "tabby_blocks4",
        "Mesh_10_77_0_2",
        "Rr_fd77__3",
        "bgp1",
    ]
    device, static, mesh, rr, _ = protocols
    assert "Neighbor graceful restart" not in mesh.details
    assert (device.kind, device.table, device.state, device.info) == ("Device", "---", "up", "")
    assert static.channels["ipv4"]["Routes"] == "1 imported, 0 exported, 1 preferred"
    assert static.bgp_state == ""
    assert mesh.since == dt.datetime(2026, 11, 23, 11, 8, 23, 76745, tzinfo=dt.UTC)  # +0200
    assert mesh.details["Neighbor address"] == "10.77.0.2"
    assert mesh.details["Description"] == "node-b"
    assert mesh.channels["ipv4"]["Input filter"] == "tabby_import4"
    assert "Input filter" not in mesh.details
    assert (rr.state, rr.bgp_state, rr.info) == (
        "start",
        "Active",
        "Active        Socket: Connection refused",
    )
    assert rr.details["Neighbor address"] == "fd77::3"


def test_peer_statuses_for_node_status() -> None:
    peers = peer_statuses(parse_protocols(parse_reply(reply(SHOW_PROTOCOLS_ALL))))
    assert [(p.type, p.address, p.state) for p in peers] == [
        (PeerType.MESH, ipaddress.ip_address("10.77.0.2"), "Established"),
        (PeerType.RR, ipaddress.ip_address("fd77::3"), "Active"),
    ]  # bgp1 is not tabby's; the order is mesh, rr, global, node
    mesh, rr = peers
    assert not mesh.restarting
    assert not rr.restarting
    assert mesh.established
    assert not rr.established
    assert mesh.since == "2026-11-23T11:08:23Z"
    assert mesh.as_dict() == {
        "address": "10.77.0.2",
        "type": "mesh",
        "state": "Established",
        "since": "2026-11-23T11:08:23Z",
        "info": "Established",
        "protocol": "Mesh_10_77_0_2",
        "peer_as": 64512,
        "description": "node-b",
        "last_error": "",
    }
    assert rr.last_error == "Socket: Connection refused"
    assert rr.protocol_state == "start"


SHOW_PROTOCOLS_RESTARTING = """\
2002-Name       Proto      Table      State  Since         Info
1002-Mesh_10_77_0_4 BGP        ---        start  2026-11-23T11:09:39.625206+0000  \
Passive       Socket: Connection closed
1006-  Description:    node-d
     BGP state:          Passive
       Neighbor address: 10.77.0.4
       Neighbor AS:      64512
       Local AS:         64512
       Neighbor graceful restart active
       Restart timer:    118.995/-
       Last error:       Socket: Connection closed
     Channel ipv4
       State:          START
       Routes:         1 imported, 0 exported, 1 preferred
       Neighbor GR:    Regular
 
0000 
"""


def test_a_peer_in_graceful_restart_is_restarting() -> None:
    """What BIRD shows of a session whose peer closed it without a notification (its BIRD
    restarts for an upgrade): the peer's routes are kept, the peer is restarting."""
    (proto,) = parse_protocols(parse_reply(reply(SHOW_PROTOCOLS_RESTARTING)))
    assert proto.details["Neighbor graceful restart"] == "active"
    assert proto.details["Restart timer"] == "118.995/-"
    assert proto.channels["ipv4"]["Neighbor GR"] == "Regular"
    (peer,) = peer_statuses([proto])
    assert (peer.state, peer.restarting) == ("Passive", True)
    assert peer.last_error == "Socket: Connection closed"


def test_since_memo_keeps_a_session_start_stable() -> None:
    memo = SinceMemo()
    t0 = dt.datetime(2026, 1, 1, 10, 0, 0, 999_990, tzinfo=dt.UTC)
    first = memo.stable("Mesh_x", "Established", t0)
    assert first == "2026-01-01T10:00:00Z"
    # BIRD's value jitters by microseconds across the second boundary: same session.
    assert memo.stable("Mesh_x", "Established", t0 + dt.timedelta(microseconds=20)) == first
    assert memo.stable("Mesh_x", "Established", t0 + dt.timedelta(microseconds=5)) == first
    # A state change, or a real new start, is new.
    assert memo.stable("Mesh_x", "Active", t0 + dt.timedelta(seconds=3)) == "2026-01-01T10:00:03Z"
    memo.forget_others([])
    assert memo.stable("Mesh_x", "Active", t0 + dt.timedelta(microseconds=20)) == (
        "2026-01-01T10:00:01Z"
    )


def test_show_status() -> None:
    status = parse_status(parse_reply(reply(SHOW_STATUS)))
    assert status.version == "2.0.12"
    assert status.router_id == "10.77.0.1"
    assert status.graceful_restart_recovery
    assert status.uptime_seconds == pytest.approx(30.592)
    assert status.message == "Daemon is up and running"


def _status(uptime: float, graceful: bool = False) -> BirdStatus:
    boot = dt.datetime(2026, 1, 1, tzinfo=dt.UTC)
    return BirdStatus(
        "2.0.12", "10.0.0.1", boot + dt.timedelta(seconds=uptime), boot, boot, graceful, ""
    )


def _peer(addr: str, state: str) -> PeerStatus:
    return PeerStatus("Mesh_x", ipaddress.ip_address(addr), PeerType.MESH, state, "", state, "up")


def test_readiness_counts_as_calico_does() -> None:
    up, down = _peer("10.0.0.2", "Established"), _peer("10.0.0.3", "Active")
    assert readiness(None, []) == ["BIRD is not running"]
    assert readiness(_status(5), []) == []  # no peers: nothing to wait for
    # Shortly after start every peer must be Established ...
    assert readiness(_status(5), [up, down]) == ["BGP not established with 10.0.0.3 (mesh: Active)"]
    assert readiness(_status(5), [up]) == []
    # ... later one is enough (other nodes may be down), none is not.
    assert readiness(_status(300), [up, down]) == []
    assert readiness(_status(300), [down]) == ["BGP not established with any of 1 peers"]
    assert readiness(_status(300, graceful=True), [up]) == [
        "BIRD: graceful restart recovery in progress"
    ]
    assert readiness(_status(5), [up, down], settle_seconds=1) == []
    # A peer in graceful restart (its BIRD restarts: an upgrade) is not down, at any time.
    restarting = dataclasses.replace(_peer("10.0.0.4", "Passive"), restarting=True)
    assert readiness(_status(5), [up, restarting]) == []
    assert readiness(_status(300), [restarting]) == []
    assert readiness(_status(5), [restarting, down]) == [
        "BGP not established with 10.0.0.3 (mesh: Active)"
    ]


@pytest.fixture
def fake_bird(tmp_path: Path) -> Iterator[FakeBird]:
    server = FakeBird(
        str(tmp_path / "bird.ctl"),
        {
            "show protocols all": SHOW_PROTOCOLS_ALL,
            "show status": SHOW_STATUS,
            'configure "/run/x/bird.conf"': "0002-Reading configuration\n0003 Reconfigured\n",
            "configure": "0002-Reading configuration from x\n8002 x, line 3: syntax error\n",
        },
    )
    try:
        yield server
    finally:
        server.close()


def test_client_speaks_the_control_protocol(fake_bird: FakeBird) -> None:
    with BirdControl(fake_bird.path) as bird:
        assert bird.version == "2.0.12"
        assert bird.server_pid() == os.getpid()  # the listener's credentials
        protocols = bird.show_protocols()
        assert len(protocols) == 5
        assert bird.show_status().router_id == "10.77.0.1"
        assert bird.configure("/run/x/bird.conf") == "Reconfigured"
        with pytest.raises(BirdCommandError) as info:
            bird.configure()
        assert info.value.code == 8002
        assert "syntax error" in info.value.message
        with pytest.raises(BirdCommandError, match="9001"):
            bird.command("show nonsense")
        with pytest.raises(ValueError, match="one line"):
            bird.command("show status\nshow status")
        with pytest.raises(ValueError, match="unusable"):
            bird.configure('/tmp/a"b')
    assert fake_bird.received[:3] == [
        "show protocols all",
        "show status",
        'configure "/run/x/bird.conf"',
    ]


def test_client_reports_an_absent_bird(tmp_path: Path) -> None:
    with pytest.raises(BirdUnavailable, match=r"bird\.ctl"):
        BirdControl(str(tmp_path / "bird.ctl")).open()
