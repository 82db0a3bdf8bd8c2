"""The etcd store against real etcd members: failover, TLS, quorum loss, leader kill, watch
resync, and the allocator of three "nodes" sharing one cluster.

The store contract itself (every rule, also on etcd) is ``test_ipam_store_contract.py``.
Faults that a live etcd cannot be made to produce on cue (a member that accepts and never
answers, a gateway answering 503, an answer lost after the write was applied) come from
small TCP endpoints in this file, placed in front of or beside the real members.
"""

from __future__ import annotations

import ipaddress
import json
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from datastore import etcd as etcd_module
from datastore.base import Doc, Op, SyncEvent
from datastore.etcd import EtcdStore
from ipam.core import (
    AssignRequest,
    InvalidConfig,
    Ipam,
    PoolSpec,
    RevisionConflict,
    StoreCorrupt,
    StoreUnavailable,
    check_consistency,
    handle_id,
)
from tests.etcd_cluster import EtcdCluster, EtcdMissing, free_ports

pytestmark = pytest.mark.etcd


def _cluster(size: int, **kw: Any) -> EtcdCluster:
    try:
        return EtcdCluster(size, **kw)
    except EtcdMissing as e:
        pytest.fail(str(e))


@pytest.fixture(scope="module")
def etcd1() -> Iterator[EtcdCluster]:
    with _cluster(1) as cluster:
        yield cluster


@pytest.fixture(scope="module")
def etcd3_module() -> Iterator[EtcdCluster]:
    with _cluster(3) as cluster:
        yield cluster


@pytest.fixture
def etcd3(etcd3_module: EtcdCluster) -> EtcdCluster:
    """The module's 3-member cluster, every member running and healthy."""
    for i in range(3):
        etcd3_module.start_member(i)
    etcd3_module.wait_healthy()
    return etcd3_module


def leader_first(cluster: EtcdCluster) -> tuple[int, list[str]]:
    """The leader's index, and the endpoints with the leader's first (clients talk to it,
    so killing it also breaks their connections in mid-request)."""
    leader = cluster.leader()
    urls = cluster.endpoints
    return leader, [urls[leader]] + [u for i, u in enumerate(urls) if i != leader]


def store_on(
    cluster: EtcdCluster | list[str],
    tmp_path: Path,
    *,
    timeout: float = 5.0,
    prefix: str | None = None,
    lock_dir: str = "locks",
    **kw: Any,
) -> EtcdStore:
    endpoints = cluster.endpoints if isinstance(cluster, EtcdCluster) else cluster
    return EtcdStore(
        endpoints,
        prefix=prefix or f"/t-{uuid.uuid4().hex[:10]}",
        lock_timeout=timeout,
        lock_dir=str(tmp_path / lock_dir),
        **kw,
    )


# -- misbehaving endpoints ------------------------------------------------------------------


class FakeEndpoint:
    """A TCP endpoint on 127.0.0.1 that misbehaves on purpose.

    ``silent``: accepts and reads, never answers (a hung member). ``503``/``408``: answers
    what the gateway answers while a member shuts down. ``lose-answer``: passes the request
    to ``upstream`` (a real member), then closes without passing the answer back.
    """

    def __init__(self, mode: str, upstream: tuple[str, int] | None = None) -> None:
        self.mode = mode
        self.upstream = upstream
        self.requests = 0
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(16)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self._conns: list[socket.socket] = []
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self._conns.append(conn)
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()

    def _handle(self, conn: socket.socket) -> None:
        try:
            while not self._stop:
                request = _read_request(conn)
                if request is None:
                    return
                self.requests += 1
                if self.mode == "silent":
                    continue
                if self.mode in ("503", "408"):
                    status = int(self.mode)
                    body = json.dumps(
                        {
                            "error": "etcdserver: not now",
                            "message": "etcdserver: not now",
                            "code": 14 if status == 503 else 1,
                        }
                    ).encode()
                    conn.sendall(
                        f"HTTP/1.1 {status} X\r\nContent-Type: application/json\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n".encode()
                        + body
                    )
                    continue
                assert self.upstream is not None
                with socket.create_connection(self.upstream, timeout=5) as up:
                    up.sendall(request)
                    _read_response(up)  # etcd has acted on it; the answer is lost
                conn.close()
                return
        except OSError:
            return

    def close(self) -> None:
        self._stop = True
        self.sock.close()
        for c in self._conns:
            try:
                c.close()
            except OSError:
                pass


def _read_request(conn: socket.socket) -> bytes | None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            return None
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    while len(body) < length:
        body += conn.recv(65536)
    return head + b"\r\n\r\n" + body


def _read_response(up: socket.socket) -> None:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = up.recv(65536)
        if not chunk:
            return
        data += chunk


@pytest.fixture
def fakes() -> Iterator[list[FakeEndpoint]]:
    made: list[FakeEndpoint] = []
    yield made
    for f in made:
        f.close()


def dead_endpoint() -> str:
    """An address where nothing listens (connection refused)."""
    return f"http://127.0.0.1:{free_ports(1)[0]}"


# -- endpoints and failover -------------------------------------------------------------------


def test_first_endpoint_dead_is_skipped(etcd1: EtcdCluster, tmp_path: Path) -> None:
    store = store_on([dead_endpoint(), *etcd1.endpoints], tmp_path)
    try:
        rev = store.put("pool", "p", {"v": 1}, None)
        assert store.get("pool", "p") == Doc({"v": 1}, rev)
        store.check_usable()
    finally:
        store.close()


@pytest.mark.parametrize("mode", ["503", "408"])
def test_not_now_answers_move_to_the_next_endpoint(
    etcd1: EtcdCluster, tmp_path: Path, fakes: list[FakeEndpoint], mode: str
) -> None:
    fake = FakeEndpoint(mode)
    fakes.append(fake)
    store = store_on([fake.url, *etcd1.endpoints], tmp_path)
    try:
        rev = store.put("pool", "p", {"v": 1}, None)
        assert store.get("pool", "p") == Doc({"v": 1}, rev)
        assert fake.requests >= 1
    finally:
        store.close()


def test_a_hung_member_gets_only_its_share_of_the_deadline(
    etcd1: EtcdCluster, tmp_path: Path, fakes: list[FakeEndpoint]
) -> None:
    fake = FakeEndpoint("silent")
    fakes.append(fake)
    store = store_on([fake.url, *etcd1.endpoints], tmp_path, timeout=4.0)
    try:
        t0 = time.monotonic()
        store.put("pool", "p", {}, None)
        assert time.monotonic() - t0 < 3.5  # 2 s (half of the deadline), then the live one
        assert fake.requests == 1
    finally:
        store.close()


def test_only_hung_or_dead_endpoints_is_unavailable_within_the_timeout(
    tmp_path: Path, fakes: list[FakeEndpoint]
) -> None:
    fake = FakeEndpoint("silent")
    fakes.append(fake)
    dead = dead_endpoint()
    store = store_on([fake.url, dead], tmp_path, timeout=0.8)
    try:
        for op in (
            lambda: store.get("pool", "p"),
            lambda: store.put("pool", "p", {}, None),
            lambda: store.list("pool"),
            store.check_usable,
        ):
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as info:
                op()
            assert time.monotonic() - t0 < 0.8 + 1.0
            assert fake.url in str(info.value)
            assert dead in str(info.value)
    finally:
        store.close()


def test_lost_answer_of_an_applied_write_is_not_a_conflict(
    etcd1: EtcdCluster, tmp_path: Path, fakes: list[FakeEndpoint]
) -> None:
    """The write went through, its answer was lost, the retry's compare fails: the store
    sees its own bytes in etcd and reports success (else the core would take a second
    address for the same handle)."""
    member = etcd1.members[0]
    fake = FakeEndpoint("lose-answer", ("127.0.0.1", member.client_port))
    fakes.append(fake)
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    direct = store_on(etcd1, tmp_path, prefix=prefix)
    store = store_on([fake.url, *etcd1.endpoints], tmp_path, prefix=prefix)
    try:
        rev = store.put("block", "10.0.0.0/26", {"v": 1}, None)  # create
        assert direct.get("block", "10.0.0.0/26") == Doc({"v": 1}, rev)
        store.client._preferred = 0  # every write below goes through the fake first
        rev2 = store.put("block", "10.0.0.0/26", {"v": 2}, rev)  # update
        assert direct.get("block", "10.0.0.0/26") == Doc({"v": 2}, rev2)
        store.client._preferred = 0
        revs = store.commit([Op("pool", "p", {}, None), Op("block", "10.0.0.0/26", None, rev2)])
        assert revs[1] == 0
        assert direct.get("block", "10.0.0.0/26") is None
        assert fake.requests >= 3
        assert store.stats["resolved"] >= 3
        assert store.stats["conflicts"] == 0
        # a stale write whose answer is lost: etcd refused it, but the store cannot know
        # that it was not its own write overwritten since: "unknown", not a conflict
        pool = direct.get("pool", "p")
        store.client._preferred = 0
        with pytest.raises(StoreUnavailable, match="unknown"):
            store.put("pool", "p", {"other": True}, revs[0] - 1)
        assert direct.get("pool", "p") == pool
        assert store.stats["unknown"] == 1
        # without a lost answer it is a plain conflict
        direct_conflicts = direct.stats["conflicts"]
        with pytest.raises(RevisionConflict):
            direct.put("pool", "p", {"other": True}, revs[0] - 1)
        assert direct.stats["conflicts"] == direct_conflicts + 1
    finally:
        store.close()
        direct.close()


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def etcd_tls() -> Iterator[EtcdCluster]:
    with _cluster(1, tls=True) as cluster:
        yield cluster


def test_tls_with_ca_and_client_certificate(etcd_tls: EtcdCluster, tmp_path: Path) -> None:
    tls = etcd_tls.tls
    assert tls is not None
    assert etcd_tls.endpoints[0].startswith("https://")
    store = store_on(
        etcd_tls, tmp_path, ca_file=tls.ca, cert_file=tls.client_cert, key_file=tls.client_key
    )
    try:
        rev = store.put("node", "n", {"v": 1}, None)
        assert store.get("node", "n") == Doc({"v": 1}, rev)
        m = _Mirror(store, ["node"])
        try:
            m.wait(lambda: m.snapshots == 1)
            store.put("node", "m", {}, None)
            m.wait(lambda: "m" in m.state["node"])
        finally:
            m.close()
    finally:
        store.close()


def test_tls_failures_are_unavailable_or_bad_config(etcd_tls: EtcdCluster, tmp_path: Path) -> None:
    tls = etcd_tls.tls
    assert tls is not None
    other_ca = tmp_path / "other"
    from tests.etcd_cluster import make_tls

    wrong = make_tls(other_ca)
    cases = {
        "no client certificate": {"ca_file": tls.ca},
        "unknown server CA": {
            "ca_file": wrong.ca,
            "cert_file": tls.client_cert,
            "key_file": tls.client_key,
        },
        "client cert of another CA": {
            "ca_file": tls.ca,
            "cert_file": wrong.client_cert,
            "key_file": wrong.client_key,
        },
    }
    for what, kw in cases.items():
        store = store_on(etcd_tls, tmp_path, timeout=0.5, **kw)
        try:
            with pytest.raises(StoreUnavailable) as info:
                store.get("pool", "p")
            assert etcd_tls.endpoints[0] in str(info.value), what
        finally:
            store.close()
    verify = store_on(etcd_tls, tmp_path, timeout=0.5, ca_file=wrong.ca)
    with pytest.raises(StoreUnavailable, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify"):
        verify.get("pool", "p")
    missing = store_on(etcd_tls, tmp_path, ca_file=str(tmp_path / "nope.crt"))
    with pytest.raises(InvalidConfig, match=r"nope\.crt"):
        missing.get("pool", "p")
    plain = store_on([etcd_tls.endpoints[0].replace("https", "http")], tmp_path, timeout=0.5)
    with pytest.raises(StoreUnavailable):
        plain.get("pool", "p")


# -- quorum and leader loss ---------------------------------------------------------------------


def test_no_quorum_is_unavailable_within_the_timeout_then_recovers(
    etcd3: EtcdCluster, tmp_path: Path
) -> None:
    store = store_on(etcd3, tmp_path, timeout=1.0)
    try:
        rev = store.put("pool", "p", {"v": 1}, None)
        leader = etcd3.leader()
        stopped = [next(i for i in range(3) if i != leader), leader]
        for i in stopped:
            etcd3.stop_member(i)
        checks: list[tuple[str, Callable[[], object]]] = [
            ("get", lambda: store.get("pool", "p")),
            ("put", lambda: store.put("pool", "p", {"v": 2}, rev)),
            ("commit", lambda: store.commit([Op("pool", "q", {}, None)])),
            ("check_usable", store.check_usable),
            ("ttl put", lambda: store.put("heartbeat", "n", {}, None, ttl=5)),
        ]
        for what, op in checks:
            t0 = time.monotonic()
            with pytest.raises(StoreUnavailable) as info:
                op()
            elapsed = time.monotonic() - t0
            assert elapsed < 1.0 + 1.0, what
            for url in etcd3.endpoints:
                assert url in str(info.value), what
        for i in stopped:
            etcd3.start_member(i)
        etcd3.wait_healthy()
        doc = store.get("pool", "p")
        assert doc == Doc({"v": 1}, rev)  # nothing half-written
        store.put("pool", "p", {"v": 2}, rev)
    finally:
        store.close()


def test_leader_kill_during_concurrent_cas_increments_loses_nothing(
    etcd3: EtcdCluster, tmp_path: Path
) -> None:
    """6 threads increment 3 shared counters by CAS (each write appends its token); the
    leader is SIGKILLed midway. Every applied increment is based on the one before (the
    count equals the log), every reported success is in the log, and writes go on after
    the election."""
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    leader, urls = leader_first(etcd3)
    stores = [store_on(urls, tmp_path, prefix=prefix, lock_dir=f"l{i}") for i in range(3)]
    keys = ["c0", "c1", "c2"]
    for key in keys:
        stores[0].put("pool", key, {"n": 0, "log": []}, None)
    stop = threading.Event()
    killed_at: list[float] = []
    ok: list[tuple[str, str, float]] = []
    unknown: list[str] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def worker(w: int) -> None:
        store = stores[w % 3]
        i = 0
        while not stop.is_set():
            key = keys[(w + i) % 3]
            token = f"w{w}-{i}"
            i += 1
            try:
                doc = store.get("pool", key)
                assert doc is not None
                data = {"n": doc.data["n"] + 1, "log": [*doc.data["log"], token]}
                store.put("pool", key, data, doc.revision)
                with guard:
                    ok.append((key, token, time.monotonic()))
            except RevisionConflict:
                continue
            except StoreUnavailable:
                with guard:
                    unknown.append(token)
            except BaseException as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(6)]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)
        assert etcd3.leader() == leader
        etcd3.kill(leader)
        killed_at.append(time.monotonic())
        time.sleep(3.0)
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors
    print(f"increments {len(ok)}, unknown {len(unknown)}, stats {[s.stats for s in stores]}")
    for store in stores:
        store.close()
    check = store_on(etcd3, tmp_path, prefix=prefix)
    try:
        logged: list[str] = []
        for key in keys:
            doc = check.get("pool", key)
            assert doc is not None
            assert doc.data["n"] == len(doc.data["log"]), "a lost update"
            logged += doc.data["log"]
        assert len(logged) == len(set(logged)), "an increment applied twice"
        succeeded = {token for _, token, _ in ok}
        assert succeeded <= set(logged), "a reported success is not in etcd"
        assert set(logged) <= succeeded | set(unknown), "an increment nobody made"
        after = [t for _, _, t in ok if t > killed_at[0] + 0.2]
        assert len(after) > 10, "writes did not resume after the election"
        assert len(ok) > 50
    finally:
        check.close()
    etcd3.start_member(leader)


# -- sync ---------------------------------------------------------------------------------------


class _Mirror:
    """Runs ``store.sync`` in a thread, keeps the consumer's state."""

    def __init__(self, store: EtcdStore, kinds: list[str]) -> None:
        self.stop = threading.Event()
        self.state: dict[str, dict[str, Doc]] = {}
        self.events: list[SyncEvent] = []
        self.snapshots = 0
        self.error: BaseException | None = None
        self._cond = threading.Condition()
        self._iter = store.sync(kinds, self.stop)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for ev in self._iter:
                with self._cond:
                    self.events.append(ev)
                    if ev.type == "snapshot":
                        assert ev.snapshot is not None
                        self.state = {k: dict(v) for k, v in ev.snapshot.items()}
                        self.snapshots += 1
                    elif ev.type == "put":
                        assert ev.doc is not None
                        self.state[ev.kind][ev.key] = ev.doc
                    else:
                        self.state[ev.kind].pop(ev.key)
                    self._cond.notify_all()
        except BaseException as e:
            self.error = e

    def wait(self, cond: Callable[[], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not cond():
                if self.error is not None:
                    raise AssertionError("sync failed") from self.error
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"sync state never got there: {self.state}")
                self._cond.wait(min(left, 0.1))

    def close(self) -> None:
        self.stop.set()
        self._thread.join(10)
        assert not self._thread.is_alive()
        if self.error is not None:
            raise AssertionError("sync failed") from self.error


@pytest.mark.parametrize("where", ["silent", "dead"])
def test_sync_ends_soon_after_stop_while_etcd_does_not_answer(
    tmp_path: Path, fakes: list[FakeEndpoint], where: str
) -> None:
    """A long lock_timeout must not hold a stopping consumer: the snapshot read and the
    watch connection look at the stop event while they wait."""
    if where == "silent":
        fake = FakeEndpoint("silent")
        fakes.append(fake)
        url = fake.url
    else:
        url = dead_endpoint()
    store = store_on([url], tmp_path, timeout=30.0)
    stop = threading.Event()
    ended = threading.Event()
    events: list[SyncEvent] = []

    def run() -> None:
        events.extend(store.sync(["node"], stop))
        ended.set()

    t = threading.Thread(target=run, daemon=True)
    t.start()
    time.sleep(1.5)
    t0 = time.monotonic()
    stop.set()
    assert ended.wait(10)
    assert time.monotonic() - t0 < 1.5
    assert events == []
    store.close()


def test_sync_resyncs_after_compaction(
    etcd1: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """History compacted between the snapshot and the watch: etcd cancels the watch, the
    store reads everything again (a second snapshot with the changes it missed)."""
    store = store_on(etcd1, tmp_path)
    writer = store_on(etcd1, tmp_path, prefix=store.prefix)
    store.put("node", "a", {}, None)
    real_watch = store.client.watch
    calls = []

    def compact_first(*args: Any, **kw: Any) -> Any:
        calls.append(args[2])
        if len(calls) == 1:
            writer.put("node", "b", {}, None)
            writer.put("node", "c", {}, None)
            etcd1.compact()
        return real_watch(*args, **kw)

    monkeypatch.setattr(store.client, "watch", compact_first)
    m = _Mirror(store, ["node"])
    try:
        m.wait(lambda: m.snapshots == 2)
        assert set(m.state["node"]) == {"a", "b", "c"}
        writer.put("node", "d", {}, None)
        m.wait(lambda: "d" in m.state["node"])
        assert m.snapshots == 2
        assert len(calls) == 2
    finally:
        m.close()
        store.close()
        writer.close()


def test_sync_resyncs_after_a_broken_stream(tmp_path: Path) -> None:
    """The member goes away (SIGKILL) and comes back: a fresh snapshot that includes what
    was written meanwhile through it; nothing stale survives."""
    with _cluster(1) as cluster:
        store = store_on(cluster, tmp_path, timeout=2.0)
        writer = store_on(cluster, tmp_path, prefix=store.prefix, timeout=5.0)
        try:
            r_a = store.put("pod", "ns/a", {}, None)
            store.put("pod", "ns/gone", {}, None)
            m = _Mirror(store, ["pod"])
            try:
                m.wait(lambda: m.snapshots == 1)
                store.put("pod", "ns/live", {}, None)  # seen: the watch stream is up
                m.wait(lambda: "ns/live" in m.state["pod"])
                cluster.kill(0)
                time.sleep(0.5)
                cluster.start_member(0)
                cluster.wait_healthy()
                gone = writer.get("pod", "ns/gone")
                assert gone is not None
                writer.delete("pod", "ns/gone", gone.revision)
                writer.put("pod", "ns/a", {"v": 2}, r_a)
                m.wait(lambda: m.snapshots >= 2)
                want = dict(writer.list("pod"))
                assert set(want) == {"ns/a", "ns/live"}
                m.wait(lambda: m.state["pod"] == want)
            finally:
                m.close()
        finally:
            store.close()
            writer.close()


def test_sync_covers_kinds_in_one_range_and_drops_the_others(
    etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """heartbeat .. resources spans the IPAM keys: handle churn is filtered out."""
    store = store_on(etcd1, tmp_path)
    m = _Mirror(store, ["heartbeat", "workloadendpoint"])
    try:
        m.wait(lambda: m.snapshots == 1)
        store.put("handle", "n:c:eth0", {}, None)
        store.put("block", "10.0.0.0/26", {}, None)
        store.put("workloadendpoint", "ns/p", {"x": 1}, None)
        store.put("heartbeat", "node-a", {}, None, ttl=30)
        m.wait(lambda: "node-a" in m.state["heartbeat"])
        m.wait(lambda: "ns/p" in m.state["workloadendpoint"])
        assert {e.kind for e in m.events if e.type != "snapshot"} == {
            "heartbeat",
            "workloadendpoint",
        }
    finally:
        m.close()
        store.close()


# -- sizes ----------------------------------------------------------------------------------------


def test_lists_page_at_one_revision(
    etcd1: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_module, "PAGE", 7)
    store = store_on(etcd1, tmp_path)
    try:
        keys = [f"10.0.{i}.0/24" for i in range(30)]
        store.commit([Op("block", k, {"k": k}, None) for k in keys])
        assert store.list_keys("block") == sorted(keys)
        assert [(k, d.data) for k, d in store.list("block")] == [
            (k, {"k": k}) for k in sorted(keys)
        ]
        assert [k for k, _ in store.list("block", "10.0.1")] == sorted(
            k for k in keys if k.startswith("10.0.1")
        )
    finally:
        store.close()


def test_commit_over_etcd_txn_limit_is_invalid(etcd1: EtcdCluster, tmp_path: Path) -> None:
    store = store_on(etcd1, tmp_path)
    try:
        store.commit([Op("pod", f"ns/p{i}", {}, None) for i in range(128)])
        with pytest.raises(InvalidConfig, match="128"):
            store.commit([Op("pod", f"ns/q{i}", {}, None) for i in range(129)])
        assert len(store.list_keys("pod")) == 128
    finally:
        store.close()


def test_value_that_is_not_json_is_corrupt_naming_its_key(
    etcd1: EtcdCluster, tmp_path: Path
) -> None:
    store = store_on(etcd1, tmp_path)
    try:
        store.client.put(store.raw_key("block", "10.0.0.0/26"), b"\xff garbage")
        with pytest.raises(StoreCorrupt) as info:
            store.get("block", "10.0.0.0/26")
        assert info.value.path == f"etcd:{store.prefix}/ipam/v1/blocks/10.0.0.0/26"
        store.client.put(store.raw_key("block", "10.0.0.64/26"), b"[1]")
        with pytest.raises(StoreCorrupt, match="not a JSON object"):
            store.get("block", "10.0.0.64/26")
    finally:
        store.close()


# -- the node lock -------------------------------------------------------------------------


@pytest.mark.privileged
def test_lock_file_differs_per_network_namespace(tmp_path: Path) -> None:
    code = (
        "from datastore.etcd import EtcdStore\n"
        f"print(EtcdStore(['http://127.0.0.1:2379'], lock_dir={str(tmp_path)!r}).lock_path)\n"
    )
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]))
    here = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    ).stdout
    there = subprocess.run(
        ["unshare", "--net", sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert here.strip() == EtcdStore(["http://127.0.0.1:2379"], lock_dir=str(tmp_path)).lock_path
    assert here != there


# -- the allocator over etcd: three nodes --------------------------------------------------


def test_three_nodes_eight_threads_each_no_duplicate_and_one_claim_per_block(
    etcd3: EtcdCluster, tmp_path: Path
) -> None:
    pool = "10.77.0.0/22"
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    nodes = [f"node-{i}" for i in range(3)]
    stores = [store_on(etcd3, tmp_path, prefix=prefix, lock_dir=n, timeout=10.0) for n in nodes]
    ipams = [Ipam(s, n) for s, n in zip(stores, nodes, strict=True)]
    ipams[0].ensure_pools([PoolSpec(pool, 28)])
    per_thread = 5
    got: dict[str, tuple[str, str]] = {}  # ip -> (node, handle)
    errors: list[BaseException] = []
    guard = threading.Lock()
    start = threading.Barrier(24)

    def worker(n: int, t: int) -> None:
        ipam = ipams[n]
        try:
            start.wait(10)
            for k in range(per_thread):
                hid = handle_id("net", f"{n:02d}{t:02d}{k:04d}" + "0" * 56, "eth0")
                req = AssignRequest(hid, {"node": nodes[n]}, True, False, [pool])
                (alloc,) = ipam.assign(req)
                with guard:
                    ip = str(alloc.ip)
                    assert ip not in got, f"{ip} twice: {got.get(ip)} and {(nodes[n], hid)}"
                    got[ip] = (nodes[n], hid)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n, t)) for n in range(3) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(120)
    try:
        assert not errors, errors[:3]
        assert len(got) == 3 * 8 * per_thread
        # each block listed once, owned by one node; every address in a block of the node
        # that assigned it (a block claimed twice would put addresses of two nodes in it)
        usage = ipams[0].block_usage()
        cidrs = [str(u.cidr) for u in usage]
        assert len(cidrs) == len(set(cidrs))
        owners = {str(u.cidr): u.node for u in usage}
        for ip, (node, _) in got.items():
            addr = ipaddress.ip_address(ip)
            block = next(b for b in owners if addr in ipaddress.ip_network(b))
            assert owners[block] == node, (ip, block, owners[block], node)
        assert set(owners.values()) == set(nodes)  # everybody claimed (no borrowing needed)
        assert check_consistency(stores[0]) == []
    finally:
        for s in stores:
            s.close()


def test_leader_kill_during_assigns_from_two_nodes(etcd3: EtcdCluster, tmp_path: Path) -> None:
    """Every assign succeeds or fails with StoreUnavailable; no address twice; assigns go
    on after the election; releasing every handle leaves no allocation behind."""
    pool = "10.78.0.0/22"
    prefix = f"/t-{uuid.uuid4().hex[:10]}"
    nodes = ["node-a", "node-b"]
    leader, urls = leader_first(etcd3)
    stores = [store_on(urls, tmp_path, prefix=prefix, lock_dir=n, timeout=5.0) for n in nodes]
    ipams = [Ipam(s, n) for s, n in zip(stores, nodes, strict=True)]
    ipams[0].ensure_pools([PoolSpec(pool, 28)])
    stop = threading.Event()
    done: list[tuple[str, str, float]] = []  # (ip, handle, when)
    tried: list[tuple[int, str]] = []
    unavailable: list[str] = []
    errors: list[BaseException] = []
    guard = threading.Lock()

    def worker(n: int, t: int) -> None:
        k = 0
        while not stop.is_set():
            hid = handle_id("net", f"{n:02d}{t:02d}{k:06d}".ljust(64, "0"), "eth0")
            k += 1
            with guard:
                tried.append((n, hid))
            try:
                (alloc,) = ipams[n].assign(AssignRequest(hid, None, True, False, [pool]))
                with guard:
                    done.append((str(alloc.ip), hid, time.monotonic()))
            except StoreUnavailable:
                with guard:
                    unavailable.append(hid)
            except BaseException as e:
                errors.append(e)
                return

    threads = [threading.Thread(target=worker, args=(n, t)) for n in range(2) for t in range(4)]
    for th in threads:
        th.start()
    try:
        time.sleep(1.0)
        assert etcd3.leader() == leader
        etcd3.kill(leader)
        killed = time.monotonic()
        time.sleep(2.5)
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    try:
        assert not errors, errors[:3]
        ips = [ip for ip, _, _ in done]
        assert len(ips) == len(set(ips)), "an address handed out twice"
        assert any(when > killed + 0.2 for _, _, when in done), "no assign after the election"
        assert all(p.severity == "leftover" for p in check_consistency(stores[0]))
        stats = [s.stats for s in stores]
        print(f"assigned {len(done)}, unavailable {len(unavailable)}, stats {stats}")
        for n, hid in tried:
            ipams[n].release_handle(hid)
        assert ipams[0].allocations() == []
        assert stores[0].list_keys("handle") == []
        assert check_consistency(stores[0]) == []
    finally:
        for s in stores:
            s.close()
        etcd3.start_member(leader)
