"""The status file tabby-node writes after its dataplane passes (at most once a second, so
after nearly every CNI call it serves): what it costs must not grow with the cluster. Its
VXLAN peers (one per other node) are computed again only when a VTEP changed, and encoded
again only when they are another list (counts, not timings)."""

from __future__ import annotations

import json
from pathlib import Path

from tabby_node.status import StatusWriter, read_status
from tests.unit.cluster_world import World
from tests.unit.tabby_node.test_routing_incremental import V4_POOL, Node


def vxlan_cluster(n: int) -> World:
    w = World("vxlan")
    w.pool("pods", V4_POOL, vxlanMode="Always")
    for i in range(n):
        w.node(f"n{i}", f"192.168.{i // 200}.{i % 200 + 1}/16")
    return w


def test_peers_are_computed_again_only_when_a_vtep_changes() -> None:
    w = vxlan_cluster(3)
    a = Node(w, "n0")
    a.sync()
    overlay = a.routing.overlay
    peers = overlay.vxlan_peers()
    assert [p["node"] for p in peers] == ["n1", "n2"]
    w.pod("n0")  # a pod served here: its block changes, no VTEP does
    w.pod("n1")  # and one on another node
    a.sync()
    assert overlay.vxlan_peers() is peers  # kept: nothing recomputed
    w.node("n3", "192.168.0.4/16")  # a new node: a new VTEP
    a.sync()
    again = overlay.vxlan_peers()
    assert again is not peers
    assert [p["node"] for p in again] == ["n1", "n2", "n3"]
    assert overlay.vxlan_peers() is again


def test_a_status_write_with_unchanged_peers_encodes_nothing_big(tmp_path: Path) -> None:
    """However many peers (10 or 1000), a write whose peers did not change encodes only the
    small fields: the same number of big-field encodings."""
    for n in (10, 1000):
        writer = StatusWriter()
        peers = [{"node": f"n{i}", "address": f"192.168.{i // 250}.{i % 250}"} for i in range(n)]
        status = {"node": "me", "backend": "vxlan", "vxlan": peers, "peers": [], "passes": 1}
        writer.write(str(tmp_path), status)
        assert writer.encodings == 2  # vxlan and peers, once
        for passes in range(2, 6):
            writer.write(str(tmp_path), {**status, "passes": passes})
        assert writer.encodings == 2  # none again
        assert read_status(str(tmp_path)) == {**status, "passes": 5}
        writer.write(str(tmp_path), {**status, "vxlan": peers[:-1]})  # another list: again
        assert writer.encodings == 3
        assert read_status(str(tmp_path)) == {**status, "vxlan": peers[:-1]}


def test_the_status_file_is_the_json_of_the_status() -> None:
    writer = StatusWriter()
    for status in (
        {},
        {"node": "a"},
        {"vxlan": []},
        {"node": "a", "peers": [{"name": "p"}], "vxlan": [{"node": "b"}], "z": {"k": 1}},
    ):
        assert json.loads(writer.encode(status)) == status
