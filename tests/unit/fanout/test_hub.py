"""tabby-typha's hub: each node's view, the bounded history, resume, and a slow client."""

from __future__ import annotations

import asyncio
import json

from datastore.base import Doc, SyncEvent
from fanout import wire
from fanout.hub import Bounds, Client, Hub, canonical
from tests.unit.fanout.docs import block, pod

CIDR = "10.244.1.0/29"


def snapshot(**kinds: dict[str, Doc]) -> SyncEvent:
    docs: dict[str, dict[str, Doc]] = {"pod": {}, "block": {}, "node": {}}
    docs.update(kinds)
    return SyncEvent("snapshot", "", "", None, docs)


def put(kind: str, key: str, data: dict, rev: int) -> SyncEvent:  # type: ignore[type-arg]
    return SyncEvent("put", kind, key, Doc(data, rev), None)


def cluster(bounds: Bounds | None = None) -> Hub:
    """(Without the interest filter: every node gets every other node's pods, as
    projections; the filter has its own tests, test_interest.py.)"""
    hub = Hub(bounds, epoch="e1", interest=False)
    hub.apply(
        snapshot(
            pod={"default/a": Doc(pod("a", "n1"), 1), "default/b": Doc(pod("b", "n2"), 2)},
            block={CIDR: Doc(block(CIDR, "n1", {0: "n1"}), 3)},
        )
    )
    return hub


class Reader:
    """One client's stream, read a message at a time."""

    def __init__(self, hub: Hub, node: str, epoch: str = "", seq: int = 0) -> None:
        self.stream = hub.stream(Client(node), wire.ClientMessage(node, epoch, seq))

    async def next(self, timeout: float = 1.0) -> wire.ServerMessage:
        return wire.decode_server(await asyncio.wait_for(self.stream.__anext__(), timeout))

    async def snapshot(self) -> dict[tuple[str, str], object]:
        begin = await self.next()
        assert begin.type == wire.SNAPSHOT_BEGIN
        docs = {}
        while (m := await self.next()).type == wire.SNAPSHOT_CHUNK:
            docs.update({(u.kind, u.key): json.loads(u.data) for u in m.updates})
        assert m.type == wire.SNAPSHOT_END
        return docs


def run(coro):  # type: ignore[no-untyped-def]
    return asyncio.run(coro)


def test_each_node_gets_its_own_documents_whole_and_the_others_projected() -> None:
    async def go() -> None:
        hub = cluster()
        n1, n2 = await Reader(hub, "n1").snapshot(), await Reader(hub, "n2").snapshot()
        assert n1["pod", "default/a"]["metadata"]["uid"] == "uid-a"  # whole
        assert "uid" not in n2["pod", "default/a"]["metadata"]  # projected
        assert n1["block", CIDR]["allocations"][0]["handle"] == "k8s-pod-network.0"
        assert n2["block", CIDR]["allocations"][0] is None  # the owner's own: not routed apart
        assert hub.stats.snapshots == 2

    run(go())


def test_a_change_reaches_the_nodes_whose_view_it_changes() -> None:
    async def go() -> None:
        hub = cluster()
        n1, n2 = Reader(hub, "n1"), Reader(hub, "n2")
        await n1.snapshot()
        await n2.snapshot()
        # n1's pod changes status, and n1 allocates in its own block: nothing for n2
        hub.apply(put("pod", "default/a", pod("a", "n1", ip="10.244.0.9"), 10))
        hub.apply(put("block", CIDR, block(CIDR, "n1", {0: "n1", 1: "n1"}), 11))
        # a label change of n1's pod: n2 gets the projection
        hub.apply(put("pod", "default/a", pod("a", "n1", {"app": "db"}), 12))
        got1 = await n1.next()
        assert [(u.kind, u.revision) for u in got1.updates] == [
            ("pod", 10),
            ("block", 11),
            ("pod", 12),
        ]
        got2 = await n2.next()
        assert [(u.kind, u.revision) for u in got2.updates] == [("pod", 12)]
        assert json.loads(got2.updates[0].data)["metadata"]["labels"] == {"app": "db"}
        assert got2.seq == hub.seq
        # n2 borrows an address in n1's block: both need it
        hub.apply(put("block", CIDR, block(CIDR, "n1", {0: "n1", 1: "n1", 2: "n2"}), 13))
        assert [u.revision for u in (await n2.next()).updates] == [13]
        assert [u.revision for u in (await n1.next()).updates] == [13]

    run(go())


def test_a_resumed_client_gets_only_what_it_missed() -> None:
    async def go() -> None:
        hub = cluster()
        first = Reader(hub, "n2")
        await first.snapshot()
        seq = hub.seq
        await first.stream.aclose()
        hub.apply(put("pod", "default/c", pod("c", "n1"), 20))
        again = Reader(hub, "n2", "e1", seq)
        m = await again.next()
        assert m.type == wire.UPDATES
        assert [(u.key, u.revision) for u in m.updates] == [("default/c", 20)]
        assert hub.stats.resumes == 1
        # another replica's (or a restarted typha's) position: a snapshot
        assert (await Reader(hub, "n2", "other", seq).next()).type == wire.SNAPSHOT_BEGIN

    run(go())


def test_the_history_is_bounded_and_a_slow_client_gets_a_snapshot_later() -> None:
    async def go() -> None:
        hub = cluster(Bounds(history_events=3, history_bytes=1 << 20))
        slow = Reader(hub, "n2")
        await slow.snapshot()
        for rev in range(30, 40):  # while it reads nothing
            hub.apply(put("pod", f"default/p{rev}", pod(f"p{rev}", "n1"), rev))
        assert len(hub.history) == 3  # typha holds no more for it
        docs = await slow.snapshot()
        assert ("pod", "default/p39") in docs
        assert hub.stats.snapshots == 2
        # and a client whose position the history lost
        assert not hub.holds("e1", 1)

    run(go())


def test_typhas_own_rereads_reach_clients_as_differences() -> None:
    async def go() -> None:
        hub = cluster()
        reader = Reader(hub, "n1")
        await reader.snapshot()
        # the datastore's watch broke and was read again: b is gone, a the same
        hub.apply(
            snapshot(
                pod={"default/a": Doc(pod("a", "n1"), 1)},
                block={CIDR: Doc(block(CIDR, "n1", {0: "n1"}), 3)},
            )
        )
        m = await reader.next()
        assert m.type == wire.UPDATES
        assert [(u.key, u.deleted) for u in m.updates] == [("default/b", True)]

    run(go())


def test_another_replica_resumes_a_client_by_digests_without_a_snapshot() -> None:
    async def go() -> None:
        a = cluster()
        reader = Reader(a, "n2")
        held = {(k, key): v for (k, key), v in (await reader.snapshot()).items()}
        # n1's pod changes status only: a sends n2 nothing; b, started after, holds it at
        # its new revision
        a.apply(put("pod", "default/a", pod("a", "n1", ip="10.244.0.9"), 10))
        b = Hub(epoch="e2", interest=False)
        b.apply(
            snapshot(
                pod={
                    "default/a": Doc(pod("a", "n1", ip="10.244.0.9"), 10),
                    "default/b": Doc(pod("b", "n2"), 2),
                },
                block={CIDR: Doc(block(CIDR, "n1", {0: "n1"}), 3)},
            )
        )
        kinds = ("pod", "block", "node")
        contents = {kind: {} for kind in kinds}  # type: ignore[var-annotated]
        for (kind, key), data in held.items():
            contents[kind][key] = wire.content(canonical(data))
        digests = wire.digests(kinds, contents)
        hello = wire.ClientMessage("n2", "e1", 1, 0, kinds, digests)
        assert b.differing("n2", hello) == []
        m = wire.decode_server(await anext(b.stream(Client("n2"), hello)))
        assert (m.type, m.epoch, m.seq) == (wire.KEEPALIVE, "e2", b.seq)
        # b has a change the client missed: the bucket of that key alone is sent
        b.apply(put("pod", "default/c", pod("c", "n1"), 11))
        differing = b.differing("n2", hello)
        assert differing == [wire.bucket("default/c")]
        stream = b.stream(Client("n2"), hello)
        begin = wire.decode_server(await anext(stream))
        assert begin.type == wire.SNAPSHOT_BEGIN
        assert begin.buckets == (wire.bucket("default/c"),)
        chunk = wire.decode_server(await anext(stream))
        assert {u.key for u in chunk.updates} <= {"default/a", "default/b", "default/c"}
        assert "default/c" in {u.key for u in chunk.updates}
        assert b.stats.snapshots == 0
        assert b.stats.resyncs == 2

    run(go())
