"""The scale benchmark's own parts (bench/scale/scale_wire.py, scale_sim.py; no root).

The pure parts: the minimal readers of etcd's watch streams (gateway JSON and gRPC
protobuf), the WatchRequest built from tabby's own create request, the reduced snapshot
answer that tabby's paging code must still read correctly. Then, against a real etcd, the
simulated nodes: tabby's own store and loops over the bench's transport, which must keep
following tabby's code (the hooks it relies on are checked by name first, so a change in
tabby's client says where the bench must follow).
"""

from __future__ import annotations

import base64
import importlib.util
import json
import random
import threading
import time
import uuid
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest


def _load(name: str) -> ModuleType:
    """``bench.scale.<name>``, imported when a test needs it (the simulator and the writer
    import tabby-node's parts)."""
    return importlib.import_module(f"bench.scale.{name}")


wire = _load("scale_wire")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# == protobuf =================================================================================


def test_varint_and_int64() -> None:
    assert wire.varint(0) == b"\x00"
    assert wire.varint(1) == b"\x01"
    assert wire.varint(300) == b"\xac\x02"
    assert wire.varint(-1) == b"\xff" * 9 + b"\x01"  # int64 -1: ten bytes
    n, i = wire._read_varint(wire.varint(2**40 + 5), 0)
    assert (n, i) == (2**40 + 5, 6)


def test_create_request_from_tabbys_json() -> None:
    """WatchRequest{create_request = 1: {key = 1, range_end = 2, start_revision = 3}}."""
    create = {"key": b64(b"/a"), "range_end": b64(b"/b"), "start_revision": "5"}
    inner = b"\x0a\x02/a" + b"\x12\x02/b" + b"\x18\x05"
    assert wire.encode_create(create) == b"\x0a" + bytes([len(inner)]) + inner


def test_create_request_options_and_unknown_fields() -> None:
    create = {
        "key": b64(b"k"),
        "progress_notify": True,
        "filters": ["NODELETE"],
        "prev_kv": True,
        "watch_id": "7",
        "fragment": False,
    }
    inner = b"\x0a\x01k" + b"\x20\x01" + b"\x2a\x01\x01" + b"\x30\x01" + b"\x38\x07"
    assert wire.encode_create(create) == b"\x0a" + bytes([len(inner)]) + inner
    with pytest.raises(wire.WireError, match="is not in etcd's WatchCreateRequest"):
        wire.encode_create({"key": b64(b"k"), "something_new": True})


def _pb_len(field: int, data: bytes) -> bytes:
    return wire.varint(field << 3 | 2) + wire.varint(len(data)) + data


def _pb_int(field: int, value: int) -> bytes:
    return wire.varint(field << 3) + wire.varint(value)


def _kv(key: bytes, mod: int, value: bytes) -> bytes:
    return _pb_len(1, key) + _pb_int(2, mod) + _pb_int(3, mod) + _pb_int(4, 1) + _pb_len(5, value)


def _response(revision: int, events: list[bytes], **flags: int) -> bytes:
    out = _pb_len(1, _pb_int(1, 99) + _pb_int(3, revision) + _pb_int(4, 2))
    for field, name in ((3, "created"), (4, "canceled"), (5, "compact_revision")):
        if flags.get(name):
            out += _pb_int(field, flags[name])
    for ev in events:
        out += _pb_len(11, ev)
    return out


def test_decode_watch_response() -> None:
    put = _pb_len(2, _kv(b"/p/blocks/x", 41, b'{"a": 1}'))
    delete = _pb_int(1, 1) + _pb_len(2, _pb_len(1, b"/p/weps/y") + _pb_int(3, 42))
    msg = wire.decode_watch_response(_response(42, [put, delete]))
    assert msg.revision == 42
    assert msg.events == [(b"/p/blocks/x", 41), (b"/p/weps/y", 42)]
    assert not msg.created
    assert not msg.canceled
    created = wire.decode_watch_response(_response(40, [], created=1))
    assert created.created
    assert created.events == []
    gone = wire.decode_watch_response(_response(50, [], canceled=1, compact_revision=45))
    assert gone.canceled
    assert gone.compact_revision == 45
    with pytest.raises(wire.WireError):
        wire.decode_watch_response(_response(42, [put])[:-3])


def test_grpc_response_as_tabby_reads_it() -> None:
    """The last message of a gRPC stream, handed to tabby's own gateway parser."""
    from datastore.etcd.client import _watch_response

    put = _pb_len(2, _kv(b"/p/blocks/x", 41, b'{"a": 1}'))
    delete = _pb_int(1, 1) + _pb_len(2, _pb_len(1, b"/p/weps/y") + _pb_int(3, 42))
    resp = _watch_response("u", wire.watch_response_json(_response(42, [put, delete])))
    assert resp is not None
    assert resp.revision == 42
    assert [(e.type, e.kv.key, e.kv.mod_revision) for e in resp.events] == [
        ("PUT", b"/p/blocks/x", 41),
        ("DELETE", b"/p/weps/y", 42),
    ]
    assert resp.events[0].kv.value == b'{"a": 1}'
    gone = _watch_response(
        "u", wire.watch_response_json(_response(50, [], canceled=1, compact_revision=45))
    )
    assert gone is not None
    assert gone.canceled
    assert gone.compact_revision == 45


# == the gateway's stream =======================================================================

# Lines as etcd 3.4's gateway wrote them (header ids shortened).
CREATED = (
    b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"1","raft_term":"2"},'
    b'"created":true}}'
)
PUT = (
    b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"2","raft_term":"2"},'
    b'"events":[{"kv":{"key":"L2EveA==","create_revision":"2","mod_revision":"2","version":"1",'
    b'"value":"eyJ4IjoxfQ=="}}]}}'
)
DELETE = (
    b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"3","raft_term":"2"},'
    b'"events":[{"type":"DELETE","kv":{"key":"L2EveA==","mod_revision":"3"}}]}}'
)
COMPACTED = (
    b'{"result":{"header":{"cluster_id":"1","member_id":"2","revision":"9","raft_term":"2"},'
    b'"canceled":true,"compact_revision":"7"}}'
)


def test_scan_gateway_lines() -> None:
    created = wire.scan_gateway_line(CREATED)
    assert created.created
    assert created.revision == 1
    assert created.events == []
    put = wire.scan_gateway_line(PUT)
    assert put.revision == 2
    assert put.events == [(b"/a/x", 2)]
    delete = wire.scan_gateway_line(DELETE)
    assert delete.events == [(b"/a/x", 3)]
    gone = wire.scan_gateway_line(COMPACTED)
    assert gone.canceled
    assert gone.compact_revision == 7
    error = wire.scan_gateway_line(b'{"error":{"grpc_code":14,"message":"no leader"}}')
    assert error.canceled
    assert "no leader" in error.cancel_reason


def test_scan_agrees_with_json_on_many_events() -> None:
    events = [
        {"kv": {"key": b64(f"/p/k{i}".encode()), "mod_revision": str(100 + i), "value": b64(b"v")}}
        for i in range(5)
    ]
    line = json.dumps({"result": {"header": {"revision": "104"}, "events": events}}).encode()
    line = line.replace(b" ", b"")
    assert wire.scan_gateway_line(line).events == [(f"/p/k{i}".encode(), 100 + i) for i in range(5)]
    assert wire._json_line(line).events == wire.scan_gateway_line(line).events


def test_chunked_lines_any_split() -> None:
    msgs = [CREATED, PUT, DELETE, COMPACTED] * 20
    raw = b"".join(b"%x\r\n%s\r\n" % (len(m) + 1, m + b"\n") for m in msgs) + b"0\r\n\r\n"
    rng = random.Random(5)
    for _ in range(100):
        chunks = wire.ChunkedLines()
        out: list[bytes] = []
        i = 0
        while i < len(raw):
            n = rng.randint(1, 64)
            out += chunks.feed(raw[i : i + n])
            i += n
        assert out == msgs
        assert chunks.ended
    with pytest.raises(wire.WireError):
        wire.ChunkedLines().feed(b"zz\r\nabc")


# == reduced snapshot reads =======================================================================


def _range_answer(keys: list[bytes], more: bool) -> bytes:
    kvs = [
        {
            "key": b64(k),
            "create_revision": "5",
            "mod_revision": str(10 + i),
            "version": "1",
            "value": b64(json.dumps({"doc": i}).encode()),
            **({"lease": "77"} if i == len(keys) - 1 else {}),
        }
        for i, k in enumerate(keys)
    ]
    answer: dict[str, Any] = {"header": {"revision": "42"}, "kvs": kvs, "count": "9"}
    if more:
        answer["more"] = True
    return json.dumps(answer, separators=(",", ":")).encode()


def test_reduced_range_answer_pages_as_before() -> None:
    """What tabby's paging reads (revision, more, count, the last key) survives; the
    documents do not (the last one reads as ``{}``)."""
    from datastore.etcd.client import kv_from_json

    data = _range_answer([b"/p/a", b"/p/b", b"/p/c"], more=True)
    reduced, n = wire.reduce_range_answer(data)
    assert n == 3
    answer = json.loads(reduced)
    assert answer["header"]["revision"] == "42"
    assert answer["more"] is True
    assert answer["count"] == "9"
    (kv,) = [kv_from_json(x) for x in answer["kvs"]]
    assert (kv.key, kv.mod_revision, kv.lease, kv.value) == (b"/p/c", 12, 77, b"{}")
    last, n = wire.reduce_range_answer(_range_answer([b"/p/z"], more=False))
    assert n == 1
    assert "more" not in json.loads(last)
    empty = json.dumps({"header": {"revision": "3"}}).encode()
    assert wire.reduce_range_answer(empty) == (empty, 0)


# == keys, statistics, tables =====================================================================


def test_kind_of_follows_tabbys_layout() -> None:
    from datastore.etcd.store import LAYOUT

    kind_of = wire.KindOf("/tabby-x", LAYOUT)
    for kind, sub in LAYOUT.items():
        assert kind_of(f"/tabby-x/{sub}some/key".encode()) == kind
    assert kind_of(b"/tabby-x/elsewhere/k") == "other"
    assert kind_of(b"/tabby-xy/heartbeats/n") == "other"


def test_covers() -> None:
    ranges = [(b"/a/", b"/a0"), (b"/k", b"")]
    assert wire.covers(ranges, b"/a/x")
    assert not wire.covers(ranges, b"/a0")
    assert wire.covers(ranges, b"/k")
    assert not wire.covers(ranges, b"/k2")
    assert wire.covers([(b"/z", b"\0")], b"/zzz")


def test_table_and_fmt() -> None:
    """(The percentiles scale_bench prints are bench.stats', tests/unit/bench/test_stats.py.)"""
    text = wire.table([["a", "1"], ["bbb", "22"]], ["x", "y"])
    assert text.splitlines() == ["x    y", "---  --", "a    1", "bbb  22"]
    assert wire.fmt(None) == "-"
    assert wire.fmt(1.234, " ms", 2) == "1.23 ms"


# == the simulated nodes follow tabby ==============================================================


def test_the_hooks_the_simulator_relies_on_exist() -> None:
    """bench/scale/scale_sim.py runs tabby-node's own loops over tabby's own client and
    replaces only the transport under these methods; bench/scale/scale_writer.py records
    revisions at ``EtcdStore._apply``. If one of them goes, the bench must follow tabby's new
    code."""
    import inspect

    from datastore.etcd.client import (
        EtcdClient,
        _Conn,
        _read_watches,
        _Rotation,
        _watch_response,
        _WatchStream,
    )
    from datastore.etcd.store import EtcdStore
    from tabby_node.cache import WATCHED_KINDS, Cache
    from tabby_node.lifecycle import Retry, Threads
    from tabby_node.registration import Liveness, cas, node_spec
    from tabby_node.tunnels import Tunnels
    from tabby_node.watcher import Watcher

    assert list(inspect.signature(EtcdClient._open_watch).parameters) == [
        "self",
        "payload",
        "deadline",
        "stop",
    ]
    assert list(inspect.signature(_read_watches).parameters) == ["streams", "stop"]
    assert set(_WatchStream.__slots__) >= {"conn", "index"}
    assert "_open_watch" in inspect.getsource(EtcdClient.watch_ranges)
    assert "_read_watches" in inspect.getsource(EtcdClient.watch_ranges)
    assert list(inspect.signature(EtcdClient._connect).parameters)[:3] == [
        "self",
        "index",
        "deadline",
    ]
    assert list(inspect.signature(_Conn.request).parameters) == ["self", "path", "body", "deadline"]
    assert callable(_Rotation)
    assert callable(_watch_response)
    for cls, name in (
        (Watcher, "run"),
        (Liveness, "run"),
        (Liveness, "beat"),
        (Retry, "__call__"),
        (Threads, "spawn"),
        (Tunnels, "ensure"),
    ):
        assert callable(getattr(cls, name)), f"{cls.__name__}.{name}"
    assert callable(node_spec)
    assert callable(cas)
    assert callable(Cache.apply)
    assert WATCHED_KINDS
    assert callable(EtcdStore._apply)
    assert callable(EtcdStore.raw_key)


def _wait(what: str, check: Any, timeout: float = 30.0) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"{what}: not within {timeout} s")


@pytest.mark.etcd
@pytest.mark.parametrize("engine", ["gateway", "grpc"])
@pytest.mark.slow
def test_simulated_nodes_against_etcd(etcd1: Any, tmp_path: Path, engine: str) -> None:
    """Three simulated nodes: every watched write reaches each of them (counted by kind,
    with its arrival), liveness costs no event, an etcd restart or a compaction is
    followed by tabby's own recovery, after which every node is back in sync."""
    if engine == "grpc":
        pytest.importorskip("grpc")
    sim_mod = _load("scale_sim")
    from datastore.etcd.store import EtcdStore

    prefix = f"/scale-{uuid.uuid4().hex[:10]}"
    store = EtcdStore(etcd1.endpoints, prefix=prefix, lock_timeout=5, lock_dir=str(tmp_path))
    endpoint = etcd1.endpoints[0]
    cfg = {
        "prefix": prefix,
        "engine": engine,
        "grpc_target": endpoint.split("://", 1)[1],
        "nodes": ["sim-a", "sim-b", "sim-c"],
        "node_argv": [
            *("--nodename", "{node}", "--backend", "vxlan", "--node-ttl", "30"),
            *("--datastore-type", "etcdv3", "--etcd-endpoints", endpoint),
            *("--etcd-prefix", prefix, "--log-file", ""),
        ],
        "log_file": str(tmp_path / "sim.log"),
        "boot_rate": 50,
        "boot_timeout": 60,
    }
    sim = sim_mod.Sim(cfg)
    loop = sim.hub.loop
    runner = threading.Thread(target=loop.run_forever, daemon=True)
    runner.start()
    try:
        store.put("pool", "10.9.0.0/16", {"spec": {"cidr": "10.9.0.0/16"}}, None)
        boot = sim.boot()
        assert boot["booted"] == 3
        assert boot["streams_per_node"][0] >= 1
        events0 = sim.counters()["events"]
        sim.handle({"op": "arrivals"})  # drop the boot's
        rev = store.put("node", "other", {"metadata": {"name": "other"}}, None)
        _wait(
            "the Node reaches every simulated node",
            lambda: sim.counters()["events"].get("node", 0) - events0.get("node", 0) >= 3,
        )
        assert sim.counters()["events"].get("node", 0) - events0.get("node", 0) == 3
        count, first, last = sim.handle({"op": "arrivals"})["arrivals"][str(rev)]
        assert count == 3
        assert first <= last
        # liveness: every node's lease kept alive by tabby's own beat, no event
        before = sim.counters()["events"].get("heartbeat", 0)
        for node in sim.hub.nodes:
            node.liveness.beat()
        time.sleep(0.5)
        assert sim.counters()["events"].get("heartbeat", 0) == before

        def back_in_sync(since: float) -> None:
            name = f"marker-{uuid.uuid4().hex[:6]}"
            marker = store.put("node", name, {"m": 1}, None)
            key = store.raw_key("node", name)
            sim.handle({"op": "expect", "key": b64(key), "rev": marker})
            report = _wait(
                "every simulated node back in sync",
                lambda: (
                    (r := sim.handle({"op": "sync_report", "since": since}))["pending"] == 0 and r
                ),
            )
            assert len(report["synced"]) == 3

        t0 = time.monotonic()
        snaps0 = sim.counters()["snapshots"]
        etcd1.compact()
        back_in_sync(t0)
        assert sim.counters()["snapshots"] == snaps0  # live watches survive a compaction
        t1 = time.monotonic()
        etcd1.stop_member(0)
        etcd1.start_member(0)
        etcd1.wait_healthy()
        back_in_sync(t1)
        assert sim.counters()["streams_opened"] > 3
    finally:
        sim.shutdown()
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=5)
        loop.close()
        store.close()


# == the writer writes what tabby would ================================================


@pytest.mark.etcd
@pytest.mark.slow
def test_writer_fills_and_churns_the_datastore(
    etcd1: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bench/scale/scale_writer.py: the simulated nodes registered as tabby-node registers (a
    Node with its VXLAN tunnel, a block of its own), their pods ADDed through tabby's CNI
    handlers (a WorkloadEndpoint each, the Pod mirrored), a churn of ADDs, DELs, new blocks
    and policy changes on schedule with every write's revision recorded, and a
    compaction."""
    from datastore.etcd import client as etcd_client
    from datastore.etcd.store import EtcdStore

    writer_mod = _load("scale_writer")
    # the writer wraps these to record revisions: undone after the test
    monkeypatch.setattr(etcd_client.EtcdClient, "txn", etcd_client.EtcdClient.txn)
    monkeypatch.setattr(EtcdStore, "_apply", EtcdStore._apply)
    writer_mod._instrument()
    prefix = f"/scale-{uuid.uuid4().hex[:10]}"
    endpoint = etcd1.endpoints[0]
    cfg = {
        "prefix": prefix,
        "pool": "10.77.0.0/16",
        "kubernetes": True,
        "lanes": [endpoint, endpoint],
        "endpoint": endpoint,
        "cni_log": str(tmp_path / "cni.log"),
        "node_argv": [
            *("--nodename", "{node}", "--backend", "vxlan", "--node-ttl", "30"),
            *("--datastore-type", "etcdv3", "--etcd-endpoints", "{endpoint}"),
            *("--etcd-prefix", prefix, "--log-file", ""),
        ],
        "sim_underlay": "172.30.0.1",
        "namespaces": 2,
    }
    writer = writer_mod.Writer(cfg)
    store = EtcdStore(endpoint, prefix=prefix, lock_dir=str(tmp_path))
    try:
        setup = writer.handle(
            {"op": "setup", "sims": ["sim-a", "sim-b"], "pods_per_node": 2, "namespaces": 2}
        )
        assert setup["revision"] > 0
        nodes = dict(store.list("node"))
        assert set(nodes) == {"sim-a", "sim-b"}
        for name, doc in nodes.items():
            text = json.dumps(doc.data)
            assert "vxlan" in text.lower(), (name, text)
        blocks = {key: json.dumps(doc.data) for key, doc in store.list("block")}
        for name in ("sim-a", "sim-b"):
            assert any(name in text for text in blocks.values()), (name, blocks)
        weps = dict(store.list("workloadendpoint"))
        assert len(weps) == 4
        pods = dict(store.list("pod"))  # mirrored as tabby-kube-controllers do, with the address
        assert len(pods) == 4
        assert all(doc.data["status"]["podIPs"] for doc in pods.values())
        policies = dict(store.list("networkpolicy"))
        assert len(policies) == 2

        log = writer.handle(
            {"op": "churn", "rate": 4, "duration": 2, "block_every": 1, "policy_every": 1}
        )
        ops = log["ops"]
        assert [o for o in ops if "error" in o] == []
        counts = {k: sum(1 for o in ops if o["op"] == k) for k in ("add", "del", "block")}
        assert counts == {"add": 4, "del": 4, "block": 2}
        assert sum(1 for o in ops if "cidr" in o) == 2  # the marker policy, twice
        revs = [w[2] for w in log["writes"]]
        assert revs
        assert all(r > setup["revision"] for r in revs)
        for op in ops:
            assert op["writes"], op
            assert op["t0"] <= op["t1"]
        # every write recorded is in the store at (or after) its revision
        for op in ops:
            if op["op"] == "block":
                doc = store.get("block", op["block"])
                assert doc is not None
                assert op["node"] in json.dumps(doc.data)
                assert any(w[0] == "block" for w in op["writes"])
        marker = store.get("networkpolicy", f"{writer_mod.PROBE_NAMESPACE}/probe-marker")
        assert marker is not None
        last_cidr = [o["cidr"] for o in ops if "cidr" in o][-1]
        assert last_cidr in json.dumps(marker.data)
        # ADDs minus DELs plus the block pods: the endpoints alive now
        assert len(dict(store.list("workloadendpoint"))) == 4 + 4 - 4 + 2
        compacted = writer.handle({"op": "compact"})["compacted"]
        assert compacted >= max(revs)
    finally:
        writer.pool_exec.shutdown(wait=True)
        writer.store.close()
        for lane_store in writer.lane_stores:
            lane_store.close()
        store.close()
