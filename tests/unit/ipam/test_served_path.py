"""The IPAM of the CNI calls tabby-node serves, as tabby-node wires it (``bench.ipam.served_ipam``'s
``Node``: its file store watched into its cache, read through its knowledge, tabby-ipam's verbs
with the node's group commit, called through the CNI skeleton).

An ADD or DEL answered from memory reads nothing from the store: its only I/O is the node's
lock and the compare-and-swap write of its block. A block another writer changed behind the
watch costs a conflict and a fresh read, never an address twice."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from bench.ipam.served_ipam import NODE, POOL, Node
from cni_config.common import DatastoreSettings
from ipam.core import Ipam, check_consistency
from stores import open_store

from .core.helpers import hid, req


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    served = Node({"datastore_type": "file", "data_dir": str(tmp_path / "store")})
    try:
        yield served
    finally:
        served.close()


def _address(node: Node, cid: str) -> str:
    import json

    return str(json.loads(node.call("ADD", cid))["ips"][0]["address"]).split("/")[0]


def _since(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_served_add_and_del_read_nothing_and_write_their_block_once(node: Node) -> None:
    _address(node, "warm")  # the pool, the first block, the node's index
    before = node.counters()
    for i in range(10):
        _address(node, f"c{i}")
    adds = _since(node.counters(), before)
    before = node.counters()
    for i in range(10):
        node.call("DEL", f"c{i}")
    dels = _since(node.counters(), before)
    assert adds == {"lock": 10, "put block": 10}, adds  # no get, no list: from memory
    assert dels == {"lock": 10, "put block": 10}, dels
    assert node.served.counts.as_dict()["fresh"] == 0


def test_concurrent_served_adds_share_writes_and_never_share_an_address(node: Node) -> None:
    _address(node, "warm")
    before = node.counters()
    got: dict[str, str] = {}
    start = threading.Barrier(32)

    def add(i: int) -> None:
        start.wait()
        got[f"c{i}"] = _address(node, f"c{i}")

    threads = [threading.Thread(target=add, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 32
    assert len(set(got.values())) == 32
    done = _since(node.counters(), before)
    assert set(done) <= {"lock", "put block", "put affinity"}, done  # no read at all
    assert done["put block"] < 32  # batches shared their block's write
    assert [p for p in check_consistency(node.store) if p.severity == "error"] == []


def test_a_block_another_writer_changed_is_read_again_and_nothing_is_doubled(
    node: Node, tmp_path: Path
) -> None:
    _address(node, "warm")
    node.stop_watch()  # from here the cache does not hear of the other writer
    other = open_store(
        DatastoreSettings.model_validate(
            {"datastore_type": "file", "data_dir": str(tmp_path / "store")}
        )
    )
    try:  # another process of the node (a standalone tabby-ipam) takes addresses meanwhile
        theirs = [
            str(a.ip)
            for i in range(3)
            for a in Ipam(other, NODE).assign(req(hid(f"other{i}"), v4_pools=[POOL]))
        ]
    finally:
        other.close()
    got: dict[str, str] = {}

    def add(i: int) -> None:
        got[f"c{i}"] = _address(node, f"c{i}")

    threads = [threading.Thread(target=add, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    mine = list(got.values())
    assert len(mine) == 8
    assert len(set(mine)) == 8
    assert not set(mine) & set(theirs), (mine, theirs)
    # the lost write sent its block to the store once: one conflict, one fresh read, not a
    # compare-and-swap loop spent on the watch's stale copy and the call run again
    counts = node.served.counts.as_dict()
    assert counts["retried"] >= 1, counts
    assert counts["fresh"] == 0, counts
    assert [p for p in check_consistency(node.store) if p.severity == "error"] == []
    node.call("DEL", "c0")  # and a DEL on the stale view releases its own address only
    held = {str(o.ip) for o in Ipam(node.store, NODE).allocations()}
    assert got["c0"] not in held
    assert set(theirs) | (set(mine) - {got["c0"]}) <= held
