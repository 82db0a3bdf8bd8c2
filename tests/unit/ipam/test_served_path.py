"""The IPAM of the CNI calls tabby-node serves, as tabby-node wires it: its file store watched
into its cache (``tabby_node.watcher``, ``tabby_node.cache``), read through its knowledge
(``tabby_node.knowledge``, ``stores.Served``, ``datastore.cached``), tabby-ipam's verbs with
the node's group commit (``ipam.group``), called through the CNI skeleton.

An ADD or DEL answered from memory reads nothing from the store: its only I/O is the node's
lock and the compare-and-swap write of its block. A block another writer changed behind the
watch costs a conflict and a fresh read, never an address twice."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from cni_config.common import DatastoreSettings
from cni_protocol import skel
from datastore.base import Store
from ipam.core import Ipam, check_consistency
from ipam.group import GroupCommit
from ipam.plugin import IpamVerbs
from stores import Served, open_store
from tabby_node.cache import Cache
from tabby_node.knowledge import Knowledge
from tabby_node.watcher import Watcher

from .core.helpers import hid, req

NODE = "node-a"
POOL = "10.71.0.0/24"


class ServedNode:
    """One tabby-node's served IPAM on the file store in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.ipam = {"datastore_type": "file", "data_dir": str(data_dir), "block_size_ipv4": 26}
        settings = DatastoreSettings.model_validate(
            {"datastore_type": "file", "data_dir": str(data_dir)}
        )
        self.store: Store = open_store(settings)
        self.locks = 0
        lock = self.store.lock

        def counted_lock() -> Any:
            self.locks += 1
            return lock()

        self.store.lock = counted_lock  # type: ignore[method-assign]
        self.cache = Cache(NODE)
        self.stopping = threading.Event()
        watcher = Watcher(self.store, self.cache, stopping=self.stopping, beats={})
        self.watch = threading.Thread(target=watcher.run, daemon=True)
        self.watch.start()
        assert self.cache.synced.wait(10)
        self.served = Served(settings, self.store, Knowledge(self.cache))
        self.group = GroupCommit(self.served)
        self.handlers = IpamVerbs(self.served, self.group).handlers()

    def call(self, command: str, cid: str) -> Any:
        conf = {
            "cniVersion": "1.1.0",
            "name": "net",
            "type": "tabby",
            "nodename": NODE,
            "log_file_path": "/dev/null",
            "ipam": {"type": "tabby-ipam", "ipv4_pools": [POOL], **self.ipam},
        }
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": "/run/netns/x",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"K8S_POD_NAMESPACE=ns;K8S_POD_NAME=pod-{cid}",
        }
        rc, out = skel.run(self.handlers, env, json.dumps(conf).encode())
        assert rc == 0, out
        return json.loads(out) if out.strip() else None

    def address(self, cid: str) -> str:
        return str(self.call("ADD", cid)["ips"][0]["address"])

    def requests(self) -> dict[str, int]:
        got = self.store.requests  # type: ignore[attr-defined]
        return {f"{op} {kind}": n for (op, kind), n in got.items()}

    def stop_watch(self) -> None:
        """The watch stops delivering (what it told the cache stays): the view goes stale."""
        self.stopping.set()
        self.watch.join(10)

    def close(self) -> None:
        self.stop_watch()
        self.store.close()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[ServedNode]:
    served = ServedNode(tmp_path / "store")
    try:
        yield served
    finally:
        served.close()


def _since(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}


def test_a_served_add_and_del_read_nothing_and_write_their_block_once(node: ServedNode) -> None:
    node.address("warm")  # the pool, the first block, the node's index
    before, locks = node.requests(), node.locks
    for i in range(10):
        node.address(f"c{i}")
    adds, add_locks = _since(node.requests(), before), node.locks - locks
    before, locks = node.requests(), node.locks
    for i in range(10):
        node.call("DEL", f"c{i}")
    dels, del_locks = _since(node.requests(), before), node.locks - locks
    assert adds == {"put block": 10}, adds  # no get, no list: answered from memory
    assert add_locks == 10
    assert dels == {"put block": 10}, dels
    assert del_locks == 10
    assert node.served.counts.as_dict()["fresh"] == 0


def test_concurrent_served_adds_share_writes_and_never_share_an_address(
    node: ServedNode,
) -> None:
    node.address("warm")
    before = node.requests()
    got: dict[str, str] = {}
    start = threading.Barrier(32)

    def add(i: int) -> None:
        start.wait()
        got[f"c{i}"] = node.address(f"c{i}")

    threads = [threading.Thread(target=add, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(got) == 32
    assert len(set(got.values())) == 32
    writes = _since(node.requests(), before)
    assert set(writes) <= {"put block", "put affinity"}, writes  # no read at all
    assert writes["put block"] < 32  # batches shared their block's write
    assert [p for p in check_consistency(node.store) if p.severity == "error"] == []


def test_a_block_another_writer_changed_is_read_again_and_nothing_is_doubled(
    node: ServedNode, tmp_path: Path
) -> None:
    node.address("warm")
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
        got[f"c{i}"] = node.address(f"c{i}").split("/")[0]

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
