"""tabby's watch over native gRPC (``datastore.etcd.grpc``): the protobuf it reads and writes,
and, against real etcd, the watch through ``etcd grpc-proxy`` (what makes the fan-out of a
big cluster one watch on etcd per proxy), failover between proxies, and a member that stops
answering on a live connection.

The store's whole sync behaviour (resume, compaction, re-reads, TLS) runs over both
transports in ``test_etcd_store.py``.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datastore.etcd import grpc as etcd_grpc
from datastore.etcd.client import EtcdClient, EtcdUnavailable, KeyValue
from datastore.etcd.grpc import GrpcWatcher, ProtoError, decode_kv, decode_response, encode_create
from tests.etcd_cluster import EtcdCluster, etcd_binary, free_ports
from tests.unit.datastore.sync_mirror import Mirror
from tests.unit.datastore.test_etcd_store import store_on

# -- protobuf --------------------------------------------------------------------------------


def _varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        out.append(byte | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _ld(number: int, data: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(data)) + data


def _vi(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value)


def test_create_request_fields() -> None:
    """WatchRequest{create_request(1){key 1, range_end 2, start_revision 3,
    progress_notify 4}}, the zero fields left out as protobuf does."""
    inner = _ld(1, b"/t/a") + _ld(2, b"/t/b") + _vi(3, 300) + _vi(4, 1)
    assert encode_create(b"/t/a", b"/t/b", 300, True) == _ld(1, inner)
    assert encode_create(b"k", None, 0, False) == _ld(1, _ld(1, b"k"))


def test_response_decoded_with_events_and_unknown_fields() -> None:
    kv = (
        _ld(1, b"/t/n/a")
        + _vi(2, 5)
        + _vi(3, 9)
        + _vi(4, 2)
        + _ld(5, b'{"x":1}')
        + _vi(6, 7587869123)
    )
    put = _ld(2, kv)
    delete = _vi(1, 1) + _ld(2, _ld(1, b"/t/n/b") + _vi(3, 10))
    header = _vi(1, 111) + _vi(2, 222) + _vi(3, 10) + _vi(4, 3)
    msg = (
        _ld(1, header)
        + _vi(2, 4)
        + _ld(11, put)
        + _ld(11, delete)
        + _vi(99, 1)  # a field of a later etcd: skipped
        + b"\x0d\x01\x02\x03\x04"  # fixed32 field 1: skipped
    )
    watch_id, resp = decode_response(msg)
    assert watch_id == 4
    assert resp.revision == 10
    assert not resp.created
    assert not resp.canceled
    assert [e.type for e in resp.events] == ["PUT", "DELETE"]
    first = resp.events[0].kv
    assert (first.key, first.value, first.create_revision, first.mod_revision) == (
        b"/t/n/a",
        b'{"x":1}',
        5,
        9,
    )
    assert (first.version, first.lease) == (2, 7587869123)
    assert resp.events[1].kv.key == b"/t/n/b"
    assert resp.events[1].kv.mod_revision == 10


def test_cancel_answer_and_negative_int64() -> None:
    msg = _vi(2, 1) + _vi(4, 1) + _vi(5, 42) + _ld(6, "compacted ✓".encode())
    _, resp = decode_response(msg)
    assert resp.canceled
    assert resp.compact_revision == 42
    assert resp.reason == "compacted ✓"
    assert decode_kv(_vi(6, -1 & ((1 << 64) - 1))).lease == -1


@pytest.mark.parametrize(
    "broken",
    [
        b"\x0a\x05abc",  # a length past the end
        b"\x10\xff",  # a varint cut short
        b"\x10" + b"\xff" * 11,  # a varint longer than ten bytes
        b"\x0b",  # wire type 3 (groups)
        b"\x0d\x01",  # a fixed32 cut short
    ],
)
def test_broken_messages_are_proto_errors(broken: bytes) -> None:
    with pytest.raises(ProtoError):
        decode_response(broken)


# -- against etcd ----------------------------------------------------------------------------


class Proxy:
    """``etcd grpc-proxy start`` on 127.0.0.1 in front of ``endpoint``, stopped by PID."""

    def __init__(self, endpoint: str) -> None:
        binary = etcd_binary()
        assert binary is not None
        self.port, self.metrics = free_ports(2)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc = subprocess.Popen(
            [
                binary,
                "grpc-proxy",
                "start",
                f"--endpoints={endpoint.split('://', 1)[1]}",
                f"--listen-addr=127.0.0.1:{self.port}",
                f"--metrics-addr=http://127.0.0.1:{self.metrics}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 15
        while not self._serving():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError("etcd grpc-proxy did not start")
            time.sleep(0.1)

    def _serving(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics}/metrics", timeout=1):
                return True
        except OSError:
            return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)


@pytest.fixture
def proxies(etcd1: EtcdCluster) -> Iterator[list[Proxy]]:
    made: list[Proxy] = []
    try:
        yield made
    finally:
        for p in made:
            p.stop()


def _watchers(etcd: EtcdCluster) -> int:
    """etcd's count of the watches it serves (its /metrics gauge)."""
    with urllib.request.urlopen(f"{etcd.endpoints[0]}/metrics", timeout=5) as r:
        text = r.read().decode()
    for line in text.splitlines():
        if line.startswith("etcd_debugging_mvcc_watcher_total "):
            return int(float(line.split()[1]))
    raise AssertionError("etcd_debugging_mvcc_watcher_total not in etcd's metrics")


def _settled_watchers(etcd: EtcdCluster) -> int:
    """etcd's watch count once it stopped moving (a proxy registers its watches on etcd a
    little after its clients' are created)."""
    seen = [_watchers(etcd)]
    deadline = time.monotonic() + 15
    while len(seen) < 4 or len(set(seen[-4:])) > 1:
        assert time.monotonic() < deadline, f"etcd's watch count kept moving: {seen}"
        time.sleep(0.25)
        seen.append(_watchers(etcd))
    return seen[-1]


KINDS = ["node", "block", "workloadendpoint"]


@pytest.mark.etcd
@pytest.mark.slow
def test_nodes_watching_through_one_proxy_cost_etcd_one_watch_per_range(
    etcd1: EtcdCluster, proxies: list[Proxy], tmp_path: Path
) -> None:
    """Five stores (five nodes) sync through one grpc-proxy: etcd serves the watches of one
    node (the proxy coalesces identical ones), and every node sees every write."""
    proxy = Proxy(etcd1.endpoints[0])
    proxies.append(proxy)
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    before = _settled_watchers(etcd1)
    stores = [
        store_on(etcd1, tmp_path, prefix=prefix, watch_endpoints=[proxy.url]) for _ in range(5)
    ]
    writer = store_on(etcd1, tmp_path, prefix=prefix)
    mirrors = [Mirror(s, KINDS) for s in stores]
    try:
        for m in mirrors:
            m.wait(lambda m=m: m.snapshots == 1)  # type: ignore[misc]
        ranges = _settled_watchers(etcd1) - before
        writer.put("node", "n1", {"v": 1}, None)
        writer.put("block", "10.0.0.0/26", {"v": 2}, None)
        writer.put("workloadendpoint", "ns/p", {"v": 3}, None)
        want = {k: dict(writer.list(k)) for k in KINDS}
        for m in mirrors:
            m.wait(lambda m=m: m.state == want)  # type: ignore[misc]
        direct = store_on(etcd1, tmp_path, prefix=prefix)
        mirror = Mirror(direct, KINDS)
        try:
            mirror.wait(lambda: mirror.snapshots == 1)
            per_node = _settled_watchers(etcd1) - before - ranges
        finally:
            mirror.close()
            direct.close()
        assert per_node >= 1
        assert ranges == per_node, f"5 nodes through the proxy: {ranges} watches on etcd"
    finally:
        for m in mirrors:
            m.close()
        for s in stores:
            s.close()
        writer.close()


@pytest.mark.etcd
@pytest.mark.slow
def test_sync_moves_to_the_next_proxy_when_its_proxy_dies(
    etcd1: EtcdCluster, proxies: list[Proxy], tmp_path: Path
) -> None:
    """Two proxies; the one in use is SIGKILLed: the sync resumes through the other from its
    own revision (no snapshot again), and what was written meanwhile arrives."""
    proxies.extend([Proxy(etcd1.endpoints[0]), Proxy(etcd1.endpoints[0])])
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    store = store_on(etcd1, tmp_path, prefix=prefix, watch_endpoints=[p.url for p in proxies])
    writer = store_on(etcd1, tmp_path, prefix=prefix)
    m = Mirror(store, KINDS)
    try:
        m.wait(lambda: m.snapshots == 1)
        writer.put("node", "before", {}, None)
        m.wait(lambda: "before" in m.state["node"])
        watcher = store.watcher
        assert isinstance(watcher, GrpcWatcher)
        used = proxies[watcher._preferred]
        used.stop()
        writer.put("node", "meanwhile", {}, None)
        before = writer.get("node", "before")
        assert before is not None
        writer.delete("node", "before", before.revision)
        m.wait(lambda: set(m.state["node"]) == {"meanwhile"})
        assert m.snapshots == 1
        puts = [e.key for e in m.events if e.type == "put" and e.kind == "node"]
        assert puts == ["before", "meanwhile"]
    finally:
        m.close()
        store.close()
        writer.close()


@pytest.mark.etcd
@pytest.mark.slow
def test_a_member_that_stops_answering_breaks_the_watch_by_ping(
    etcd1: EtcdCluster, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd frozen (SIGSTOP) on a live watch connection: no FIN, no RST, no data. The watch
    pings after PING_IDLE of silence and ends with EtcdUnavailable once the ping has gone
    PING_TIMEOUT unanswered (here 0.5 s each)."""
    monkeypatch.setattr(etcd_grpc, "PING_IDLE", 0.5)
    monkeypatch.setattr(etcd_grpc, "PING_TIMEOUT", 0.5)
    client = EtcdClient(etcd1.endpoints)
    watcher = GrpcWatcher(client)
    stop = threading.Event()
    pid = etcd1.members[0].proc.pid  # type: ignore[union-attr]
    watch = watcher.watch_ranges([(b"/frozen/", b"/frozen0", 0)], stop)
    frozen = False
    try:
        first = next(watch)
        assert first.created
        os.kill(pid, signal.SIGSTOP)
        frozen = True
        t0 = time.monotonic()
        with pytest.raises(EtcdUnavailable, match="ping"):
            for _ in watch:
                pass
        assert time.monotonic() - t0 < 10
    finally:
        if frozen:
            os.kill(pid, signal.SIGCONT)
        stop.set()
        watch.close()
        client.close()
    etcd1.wait_healthy()


@pytest.mark.etcd
def test_watch_stops_soon_after_stop_is_set(etcd1: EtcdCluster) -> None:
    client = EtcdClient(etcd1.endpoints)
    stop = threading.Event()
    seen: list[KeyValue] = []
    ended = threading.Event()

    def run() -> None:
        for resp in GrpcWatcher(client).watch_ranges([(b"/s/", b"/s0", 0)], stop):
            seen.extend(ev.kv for ev in resp.events)
        ended.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(0.5)
    stop.set()
    assert ended.wait(2)
    client.close()


# -- settings --------------------------------------------------------------------------------


def test_watch_endpoints_need_the_grpc_transport() -> None:
    from cni_config.common import DatastoreSettings
    from datastore.etcd.store import EtcdStore
    from ipam.core import InvalidConfig

    ok = DatastoreSettings.model_validate(
        {"etcd_watch_endpoints": "http://p1:23790, http://p2:23790"}
    )
    assert ok.etcd_watch_transport == "grpc"
    assert ok.etcd_watch_endpoints == ["http://p1:23790", "http://p2:23790"]
    with pytest.raises(ValueError, match="etcd_watch_transport grpc"):
        DatastoreSettings.model_validate(
            {"etcd_watch_transport": "gateway", "etcd_watch_endpoints": ["http://p:1"]}
        )
    with pytest.raises(InvalidConfig):
        EtcdStore(["http://e:2379"], watch_transport="gateway", watch_endpoints=["http://p:1"])
    with pytest.raises(InvalidConfig):
        EtcdStore(["http://e:2379"], watch_endpoints=["ftp://p:1"])


def test_clients_start_at_a_random_endpoint() -> None:
    """Nodes given the same endpoint list spread over it (etcd serves each listener's
    gateway through one connection; members share the load)."""
    urls = [f"http://127.0.0.1:{p}" for p in (1, 2, 3, 4)]
    firsts = {EtcdClient(urls)._preferred for _ in range(200)}
    assert firsts == {0, 1, 2, 3}
    watchers = {GrpcWatcher(EtcdClient(urls))._preferred for _ in range(200)}
    assert watchers == {0, 1, 2, 3}


@pytest.mark.etcd
@pytest.mark.parametrize("ranges", [1, 3])
def test_history_read_with_the_created_answer_is_all_delivered(
    etcd1: EtcdCluster, ranges: int
) -> None:
    """A watch from an old revision: etcd sends "created" and the history right behind it,
    often in one read. Every event of every range arrives, once, in order, under its own
    range's index (a regression: the events read with a "created" were dropped)."""
    client = EtcdClient(etcd1.endpoints)
    base = f"/h-{uuid.uuid4().hex[:8]}"
    first_rev = 0
    for n in range(60):
        for r in range(ranges):
            rev = etcd1.put(f"{base}/r{r}/k{n}", "x" * 2000)
            first_rev = first_rev or rev
    stop = threading.Event()
    seen: dict[int, list[bytes]] = {r: [] for r in range(ranges)}
    watch = GrpcWatcher(client).watch_ranges(
        [(f"{base}/r{r}/".encode(), f"{base}/r{r}0".encode(), first_rev) for r in range(ranges)],
        stop,
    )
    try:
        deadline = time.monotonic() + 20
        for resp in watch:
            for ev in resp.events:
                seen[resp.index].append(ev.kv.key)
            if all(len(v) >= 60 for v in seen.values()) or time.monotonic() > deadline:
                break
    finally:
        stop.set()
        watch.close()
        client.close()
    for r in range(ranges):
        assert seen[r] == [f"{base}/r{r}/k{n}".encode() for n in range(60)]


class _ScriptedStream:
    """In place of ``etcd_grpc._Stream``: answers each create with its "created" and, in the
    same read, two events of that watch (and, once all are created, nothing more)."""

    def __init__(self, url: str, host: str, port: int, ctx: object, deadline: float) -> None:
        self.url = url
        self.sent: list[bytes] = []
        self.batches: list[list[tuple[int, Any]]] = []

    def send(self, message: bytes, deadline: float) -> None:
        from datastore.etcd.client import WatchEvent, WatchResponse

        wid = len(self.sent)
        self.sent.append(message)
        events = [
            WatchEvent("PUT", KeyValue(f"w{wid}/k{n}".encode(), b"", 1, 10 + n, 1, 0))
            for n in range(2)
        ]
        self.batches.append(
            [
                (wid, WatchResponse.of(revision=9, events=[], created=True)),
                (wid, WatchResponse.of(revision=10, events=events[:1])),
                (wid, WatchResponse.of(revision=11, events=events[1:])),
            ]
        )

    def receive(self, timeout: float) -> list[tuple[int, Any]]:
        if self.batches:
            return self.batches.pop(0)
        time.sleep(0.01)
        return []

    def close(self) -> None:
        pass


@pytest.mark.parametrize("ranges", [1, 3])
def test_answers_read_together_with_a_created_are_all_delivered(
    monkeypatch: pytest.MonkeyPatch, ranges: int
) -> None:
    """A "created" and its watch's first events in one read: none is dropped, each carries
    its range's index, the creates go one at a time (a regression: the events read with the
    first "created" were lost)."""
    monkeypatch.setattr(etcd_grpc, "_Stream", _ScriptedStream)
    client = EtcdClient(["http://127.0.0.1:1"])
    stop = threading.Event()
    got: list[tuple[int, bool, list[bytes]]] = []
    watch = GrpcWatcher(client).watch_ranges(
        [(f"r{r}".encode(), None, 1) for r in range(ranges)], stop
    )
    timer = threading.Timer(5, stop.set)  # a lost answer: the watch ends, the test fails
    timer.start()
    for resp in watch:
        got.append((resp.index, resp.created, [e.kv.key for e in resp.events]))
        if len(got) == 3 * ranges:
            break
    timer.cancel()
    watch.close()
    want = []
    for r in range(ranges):
        want += [
            (r, True, []),
            (r, False, [f"w{r}/k0".encode()]),
            (r, False, [f"w{r}/k1".encode()]),
        ]
    assert got == want


# -- found by fuzzing (tests/fuzz/etcd_grpc.py) -------------------------------------------


def test_an_overlong_varint_decodes_to_an_int64() -> None:
    """A ten-byte varint carries 70 bits; its high bits made watch ids and revisions
    outside int64 (1162144876643701751807). The low 64 bits are the value, as protobuf's."""
    watch_id, _ = decode_response(b"\x10" + b"\xff" * 9 + b"\x7f")
    assert watch_id == -1
    kv = decode_kv(b"\x10" + b"\x80" * 9 + b"\x02")  # 2**64: the low 64 bits are 0
    assert kv.create_revision == 0


@pytest.mark.parametrize(
    "result",
    [
        '{"header": null}',
        '{"events": "0"}',
        '{"events": [1]}',
        '{"events": [{"kv": {"key": "0"}}]}',  # not base64
        '{"events": [{"kv": {"key": "\\u0080"}}]}',
        '{"events": [{"kv": {"mod_revision": ":"}}]}',
        '{"events": [{"kv": {"create_revision": [1]}}]}',
    ],
)
def test_a_malformed_gateway_watch_line_is_unavailable(result: str) -> None:
    """A gateway watch line whose fields have the wrong shape raised AttributeError,
    TypeError or a base64 error out of the watch; it is EtcdUnavailable (the watch is
    broken, resumed as after any other break)."""
    from datastore.etcd.client import _watch_response

    with pytest.raises(EtcdUnavailable, match="malformed"):
        _watch_response("http://etcd:2379", b'{"result": ' + result.encode() + b"}")
