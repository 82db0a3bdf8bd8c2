"""The etcd store against real etcd members: failover, TLS, quorum loss, leader kill, the
watch (only the wanted ranges; resumed after a member restart; read again only after a
compaction, and then only the differences), and the allocator of three "nodes" sharing one
cluster.

The store contract itself (every rule, also on etcd) is ``test_store_contract.py``.
Faults that a live etcd cannot be made to produce on cue (a member that accepts and never
answers, a gateway answering 503, an answer lost after the write was applied) come from
small TCP endpoints in this file, placed in front of or beside the real members.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from datastore.base import KINDS, Doc, SyncEvent
from datastore.etcd import store as etcd_module
from datastore.etcd.client import prefix_end
from datastore.etcd.store import EtcdStore, watch_groups
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
from resources.wep import endpoint_key, remove_endpoint, write_endpoint
from tabby_node.cache import WATCHED_KINDS
from tests.etcd_cluster import EtcdCluster, free_ports
from tests.unit.datastore.sync_mirror import Mirror
from tests.unit.store_makers import start_etcd

# Real 3-member clusters, members killed and restarted, quorum lost, deadlines waited out:
# the full run's (tests/selection.py); the contract suite runs on etcd in every run.
pytestmark = [pytest.mark.etcd, pytest.mark.slow]


#: etcd 3.4's flag: progress notifications to caught-up watches every 300 ms, not 10 min
PROGRESS_NOTIFY = ("--experimental-watch-progress-notify-interval", "300ms")


@pytest.fixture(scope="module")
def etcd3_module() -> Iterator[EtcdCluster]:
    with start_etcd(3, extra_args=PROGRESS_NOTIFY) as cluster:
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


#: tests of the watch run over both transports (native gRPC, the default; the JSON gateway)
WATCH_TESTS = ("sync", "watch", "tls_with", "pod_add_and_del")
_transport = {"now": "grpc"}


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if any(w in metafunc.function.__name__ for w in WATCH_TESTS):
        metafunc.parametrize("watch_transport", ["grpc", "gateway"], indirect=True)


@pytest.fixture(autouse=True)
def watch_transport(request: pytest.FixtureRequest) -> Iterator[str]:
    """The watch transport of the stores ``store_on`` makes (``grpc`` unless the test is
    one of WATCH_TESTS, run over each)."""
    _transport["now"] = getattr(request, "param", "grpc")
    yield _transport["now"]
    _transport["now"] = "grpc"


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
    store = EtcdStore(
        endpoints,
        prefix=prefix or f"/t-{uuid.uuid4().hex[:10]}",
        lock_timeout=timeout,
        lock_dir=str(tmp_path / lock_dir),
        **{"watch_transport": _transport["now"], **kw},
    )
    # a client starts at a random endpoint; these tests place the endpoint they study first
    store.client._preferred = 0
    return store


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
        r_pool = store.put("pool", "p", {}, None)
        store.client._preferred = 0
        store.delete("block", "10.0.0.0/26", rev2)
        assert direct.get("block", "10.0.0.0/26") is None
        assert fake.requests >= 4
        assert store.stats["resolved"] >= 3
        assert store.stats["conflicts"] == 0
        # a stale write whose answer is lost: etcd refused it, but the store cannot know
        # that it was not its own write overwritten since: "unknown", not a conflict
        pool = direct.get("pool", "p")
        store.client._preferred = 0
        with pytest.raises(StoreUnavailable, match="unknown"):
            store.put("pool", "p", {"other": True}, r_pool - 1)
        assert direct.get("pool", "p") == pool
        assert store.stats["unknown"] == 1
        # without a lost answer it is a plain conflict
        direct_conflicts = direct.stats["conflicts"]
        with pytest.raises(RevisionConflict):
            direct.put("pool", "p", {"other": True}, r_pool - 1)
        assert direct.stats["conflicts"] == direct_conflicts + 1
    finally:
        store.close()
        direct.close()


# -- TLS ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def etcd_tls() -> Iterator[EtcdCluster]:
    with start_etcd(1, tls=True) as cluster:
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
        m = Mirror(store, ["node"])
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
            ("check_usable", store.check_usable),
            ("ttl put", lambda: store.put_leased("heartbeat", "n", {}, None, ttl=5)),
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


def test_watch_groups_are_the_fewest_ranges_without_handles_or_affinities() -> None:
    node_kinds = list(WATCHED_KINDS)
    assert watch_groups(node_kinds) == [
        # Calico's policy kinds (calico/v1/...), every one watched: one range with the
        # heartbeats after them
        (
            "calico-networkpolicy",
            "globalnetworkpolicy",
            "globalnetworkset",
            "hostendpoint",
            "networkset",
            "stagedglobalnetworkpolicy",
            "stagedkubernetesnetworkpolicy",
            "stagednetworkpolicy",
            "tier",
            "heartbeat",
        ),
        ("block",),
        (
            "pool",
            "bgpconfiguration",
            "bgppeer",
            "namespace",
            "networkpolicy",
            "node",
            "pod",
            "serviceaccount",
            "workloadendpoint",
            "trace",  # a policy trace's request to this node (tabbyctl policy trace)
        ),
    ]
    assert watch_groups(["pod", "node"]) == [("node", "pod")]
    assert watch_groups(["heartbeat", "affinity"]) == [("heartbeat", "affinity")]
    assert watch_groups(KINDS) == [tuple(sorted(KINDS, key=etcd_module.LAYOUT.__getitem__))]
    # the byte ranges of a store hold exactly their kinds' keys
    store = EtcdStore(["http://127.0.0.1:1"], prefix="/p")
    for kinds in (node_kinds, ["pod", "heartbeat"], ["handle"], list(KINDS)):
        groups = watch_groups(kinds)
        assert sorted(k for g in groups for k in g) == sorted(set(kinds))
        for kind in KINDS:
            key = store.raw_key(kind, "x")
            inside = [g for g in groups if store._kp[g[0]] <= key < prefix_end(store._kp[g[-1]])]
            assert inside == ([next(g for g in groups if kind in g)] if kind in kinds else [])


def _counting_watch(store: EtcdStore, wire: dict[str, int]) -> Any:
    """``store.watcher.watch_ranges``, counting every event etcd sent by kind (before the
    store looks at it): what the watch costs etcd and the node."""
    real = store.watcher.watch_ranges
    by_prefix = sorted(((store._kp[k], k) for k in KINDS), reverse=True)

    def counting(*args: Any, **kw: Any) -> Iterator[Any]:
        for resp in real(*args, **kw):
            for ev in resp.events:
                kind = next((k for p, k in by_prefix if ev.kv.key.startswith(p)), "other")
                wire[kind] = wire.get(kind, 0) + 1
            yield resp

    return counting


def test_pod_add_and_del_send_a_node_no_handle_or_affinity_event(
    etcd1: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a pod ADD and DEL write (the IPAM block, the first ADD also the block's claim and
    the node's affinity; the WorkloadEndpoint) as tabby-node's watch
    receives them: counted on the wire, so a kind the store dropped after receiving it
    would count. The old single range (heartbeats/ to resources/) is watched alongside
    for the comparison printed."""
    store = store_on(etcd1, tmp_path)
    writer = store_on(etcd1, tmp_path, prefix=store.prefix)
    wire: dict[str, int] = {}
    monkeypatch.setattr(store.watcher, "watch_ranges", _counting_watch(store, wire))
    kinds = list(WATCHED_KINDS)
    old_start = min(store._kp[k] for k in kinds)
    old_end = max(prefix_end(store._kp[k]) for k in kinds)
    old: dict[str, int] = {}
    old_stop = threading.Event()
    m = Mirror(store, kinds)
    old_counting = threading.Thread(
        target=_count_raw, args=(writer, old_start, old_end, old_stop, old), daemon=True
    )
    try:
        m.wait(lambda: m.snapshots == 1)
        old_counting.start()
        time.sleep(0.3)  # its watch is up
        ipam = Ipam(writer, "node-a")
        pool = "10.60.0.0/16"
        ipam.ensure_pools([PoolSpec(pool, 30)])  # 4 addresses a block: one fills
        pods = 5
        for n in range(pods):
            hid = handle_id("net", f"{n:064x}", "eth0")
            (alloc,) = ipam.assign(AssignRequest(hid, {"node": "node-a"}, True, False, [pool]))
            write_endpoint(
                writer,
                namespace="ns",
                node="node-a",
                pod=f"p{n}",
                container_id=f"{n:064x}",
                interface="eth0",
                host_interface=f"cali{n}",
                ip_networks=[f"{alloc.ip}/32"],
            )
        m.wait(lambda: len(m.state["workloadendpoint"]) == pods)
        added = dict(wire)
        for n in range(pods):
            ipam.release_handle(handle_id("net", f"{n:064x}", "eth0"))
            remove_endpoint(writer, endpoint_key("ns", "node-a", f"p{n}", "eth0"), f"{n:064x}")
        m.wait(lambda: not m.state["workloadendpoint"])
        want = {k: dict(writer.list(k)) for k in kinds}
        m.wait(lambda: m.state == want)
        time.sleep(0.3)  # anything late would show
        deleted = {k: wire.get(k, 0) - added.get(k, 0) for k in wire}
        print(f"\n{pods} ADDs, events to a node: {added}; {pods} DELs: {deleted}")
        print(f"the old single range, the ADDs and DELs: {old}")
        assert "handle" not in wire
        assert "affinity" not in wire
        assert "other" not in wire
        assert added["workloadendpoint"] == pods
        assert deleted["workloadendpoint"] == pods
        assert added["block"] >= pods
        assert deleted["block"] >= pods
        assert old["affinity"] >= 1  # what the old range carried to every node
        assert {e.kind for e in m.events if e.type != "snapshot"} <= set(kinds)
        assert store.sync_stats == {"snapshots": 1, "rereads": 0, "resumes": 0}
    finally:
        old_stop.set()
        m.close()
        if old_counting.ident is not None:
            old_counting.join(10)
        store.close()
        writer.close()


def _count_raw(
    store: EtcdStore, start: bytes, end: bytes, stop: threading.Event, out: dict[str, int]
) -> None:
    """What one watch of [start, end) receives, by kind, until ``stop``."""
    rev = store.client.range(start, end, count_only=True).revision
    by_prefix = sorted(((store._kp[k], k) for k in KINDS), reverse=True)
    for resp in store.client.watch(start, end, rev + 1, stop):
        for ev in resp.events:
            kind = next((k for p, k in by_prefix if ev.kv.key.startswith(p)), "other")
            out[kind] = out.get(kind, 0) + 1


def _only(cluster: EtcdCluster, i: int) -> list[str]:
    return [cluster.endpoints[i]]


def _others(cluster: EtcdCluster, i: int) -> list[str]:
    return [u for j, u in enumerate(cluster.endpoints) if j != i]


def _per_key(events: list[SyncEvent]) -> dict[tuple[str, str, str], int]:
    out: dict[tuple[str, str, str], int] = {}
    for e in events:
        out[(e.type, e.kind, e.key)] = out.get((e.type, e.kind, e.key), 0) + 1
    return out


SYNC_KINDS = ["heartbeat", "block", "node", "pod"]  # three ranges: heartbeats, blocks, resources


def test_sync_watches_every_range_also_with_a_long_prefix(
    etcd1: EtcdCluster, tmp_path: Path
) -> None:
    """Each range is a stream of its own: one request body carrying every range's create
    request would lose the later ones whenever etcd answered the first before its gateway
    had read them (bodies over 512 bytes, as a long prefix makes them, on a busy member)."""
    prefix = "/" + "long-prefix-" * 20 + uuid.uuid4().hex[:8]
    store = store_on(etcd1, tmp_path, prefix=prefix)
    writer = store_on(etcd1, tmp_path, prefix=prefix)
    try:
        for n in range(5):
            _sync_sees_a_write_in_every_range(store, writer, n)
    finally:
        store.close()
        writer.close()


def _sync_sees_a_write_in_every_range(store: EtcdStore, writer: EtcdStore, n: int) -> None:
    m = Mirror(store, SYNC_KINDS)
    try:
        m.wait(lambda: m.snapshots == 1)
        writer.put_leased("heartbeat", f"n{n}", {}, None, ttl=60)
        writer.put("block", f"10.0.{n}.0/26", {}, None)
        writer.put("pod", f"ns/p{n}", {}, None)
        want = {k: dict(writer.list(k)) for k in SYNC_KINDS}
        m.wait(lambda: m.state == want)
    finally:
        m.close()


def test_sync_resumes_after_its_member_is_killed_and_restarted(
    etcd3: EtcdCluster, tmp_path: Path
) -> None:
    """The store knows only member 0; it is SIGKILLed while the sync runs, the others take
    writes and deletions, then it comes back: every range resumes from its own revision.
    Every change made meanwhile arrives once, nothing from before arrives again, nothing is
    read again, and the mirror equals the store."""
    store = store_on(_only(etcd3, 0), tmp_path, timeout=3.0)
    writer = store_on(_others(etcd3, 0), tmp_path, prefix=store.prefix)
    try:
        writer.put_leased("heartbeat", "n1", {}, None, ttl=60)
        writer.put("block", "10.0.0.0/26", {"v": 1}, None)
        r_a = writer.put("pod", "ns/a", {"v": 1}, None)
        writer.put("pod", "ns/gone", {}, None)
        writer.put("node", "n1", {}, None)
        m = Mirror(store, SYNC_KINDS)
        try:
            m.wait(lambda: m.snapshots == 1)
            writer.put("pod", "ns/live", {}, None)  # seen: the stream is up
            m.wait(lambda: "ns/live" in m.state["pod"], 30)
            before = len(m.events)
            etcd3.kill(0)
            b = writer.get("block", "10.0.0.0/26")
            assert b is not None
            writer.put("block", "10.0.0.0/26", {"v": 2}, b.revision)
            gone = writer.get("pod", "ns/gone")
            assert gone is not None
            writer.delete("pod", "ns/gone", gone.revision)
            writer.put("pod", "ns/a", {"v": 2}, r_a)
            for i in range(5):
                writer.put("pod", f"ns/new{i}", {}, None)
            writer.put_leased("heartbeat", "n2", {}, None, ttl=60)
            time.sleep(1.0)  # the store tries meanwhile
            assert store.sync_stats["resumes"] == 0
            etcd3.start_member(0)
            t0 = time.monotonic()
            m.wait(lambda: store.sync_stats["resumes"] >= 1, 30)
            resumed = time.monotonic() - t0
            want = {k: dict(writer.list(k)) for k in SYNC_KINDS}
            m.wait(lambda: m.state == want, 30)
            caught_up = time.monotonic() - t0
            print(
                f"\nmember restarted: stream resumed in {resumed:.2f} s, caught up in "
                f"{caught_up:.2f} s (stats {store.sync_stats})"
            )
            assert m.snapshots == 1
            after = m.events[before:]
            assert _per_key(after) == {
                ("put", "block", "10.0.0.0/26"): 1,
                ("delete", "pod", "ns/gone"): 1,
                ("put", "pod", "ns/a"): 1,
                **{("put", "pod", f"ns/new{i}"): 1 for i in range(5)},
                ("put", "heartbeat", "n2"): 1,
            }
            stats = store.sync_stats
            assert stats["rereads"] == 0
            assert stats["resumes"] >= 1
            writer.put("node", "n2", {}, None)  # and it goes on
            m.wait(lambda: "n2" in m.state["node"])
        finally:
            m.close()
    finally:
        etcd3.start_member(0)
        store.close()
        writer.close()


def test_sync_ignores_a_compaction_while_caught_up(etcd1: EtcdCluster, tmp_path: Path) -> None:
    """A compaction while the watch is connected and has delivered everything cancels
    nothing: no re-read, no resume, no event."""
    store = store_on(etcd1, tmp_path)
    writer = store_on(etcd1, tmp_path, prefix=store.prefix)
    m = Mirror(store, SYNC_KINDS)
    try:
        m.wait(lambda: m.snapshots == 1)
        for i in range(5):
            writer.put("pod", f"ns/p{i}", {}, None)
        writer.put("block", "10.0.0.0/26", {}, None)
        m.wait(lambda: len(m.state["pod"]) == 5 and m.state["block"])
        seen = len(m.events)
        etcd1.compact()
        time.sleep(0.5)  # etcd checks its watchers against a compaction every 100 ms
        assert len(m.events) == seen
        writer.put("pod", "ns/after", {}, None)
        m.wait(lambda: "ns/after" in m.state["pod"])
        assert [(e.type, e.key) for e in m.events[seen:]] == [("put", "ns/after")]
        assert store.sync_stats == {"snapshots": 1, "rereads": 0, "resumes": 0}
    finally:
        m.close()
        store.close()
        writer.close()


def test_sync_rereads_once_after_a_compaction_while_away(
    etcd3: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Member 0 (the only one the store knows) is killed; the others take writes and
    deletions and compact the history; member 0 comes back: the ranges cannot resume. One
    re-read, after a random delay of at most REREAD_JITTER, reports only the differences
    (no second snapshot; documents that did not change are not reported again) and the
    mirror equals the store."""
    delays: list[float] = []

    def jittered(most: float) -> float:
        delays.append(most)
        return min(most, 0.3)

    monkeypatch.setattr(etcd_module, "jittered", jittered)
    store = store_on(_only(etcd3, 0), tmp_path, timeout=3.0)
    writer = store_on(_others(etcd3, 0), tmp_path, prefix=store.prefix)
    try:
        writer.put_leased("heartbeat", "n1", {}, None, ttl=60)
        writer.put("block", "10.0.0.0/26", {"v": 1}, None)
        writer.put("node", "n1", {}, None)
        r_a = writer.put("pod", "ns/a", {"v": 1}, None)
        for key in ("ns/same", "ns/gone", "ns/gone2"):
            writer.put("pod", key, {}, None)
        m = Mirror(store, SYNC_KINDS)
        try:
            m.wait(lambda: m.snapshots == 1 and len(m.state["pod"]) == 4, 30)
            before = len(m.events)
            etcd3.kill(0)
            for key in ("ns/gone", "ns/gone2"):
                doc = writer.get("pod", key)
                assert doc is not None
                writer.delete("pod", key, doc.revision)
            writer.put("pod", "ns/a", {"v": 2}, r_a)
            writer.put("pod", "ns/new", {}, None)
            writer.put_leased("heartbeat", "n2", {}, None, ttl=60)
            etcd3.compact()
            etcd3.start_member(0)
            want = {k: dict(writer.list(k)) for k in SYNC_KINDS}
            m.wait(lambda: m.state == want, 30)
            time.sleep(0.5)  # nothing more comes
            assert m.snapshots == 1
            assert _per_key(m.events[before:]) == {
                ("delete", "pod", "ns/gone"): 1,
                ("delete", "pod", "ns/gone2"): 1,
                ("put", "pod", "ns/a"): 1,
                ("put", "pod", "ns/new"): 1,
                ("put", "heartbeat", "n2"): 1,
            }
            assert store.sync_stats["rereads"] == 1
            assert delays.count(etcd_module.REREAD_JITTER) == 1
            writer.put("pod", "ns/later", {}, None)  # watching again
            m.wait(lambda: "ns/later" in m.state["pod"])
            assert store.sync_stats["rereads"] == 1
            print(f"\ncompacted while away: stats {store.sync_stats}")
        finally:
            m.close()
    finally:
        etcd3.start_member(0)
        store.close()
        writer.close()


def test_sync_keeps_a_quiet_range_resumable_by_progress_notifications(
    etcd3: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """etcd sends a caught-up watch that asked for them progress notifications (every
    300 ms in this cluster: etcd 3.4's --experimental-watch-progress-notify-interval; 10 min
    by default), so a quiet range's progress follows the store's revision. The heartbeats
    and blocks stay quiet while the pods move on; member 0 is killed, the history compacted
    at the revision everything had got to, a pod written: the store resumes every range,
    reading nothing again (without the notifications the quiet ranges would start before
    the compaction and be read again)."""
    monkeypatch.setattr(etcd_module, "jittered", lambda most: min(most, 0.2))
    store = store_on(_only(etcd3, 0), tmp_path, timeout=3.0)
    writer = store_on(_others(etcd3, 0), tmp_path, prefix=store.prefix)
    try:
        writer.put_leased("heartbeat", "n1", {}, None, ttl=60)
        writer.put("block", "10.0.0.0/26", {}, None)
        m = Mirror(store, SYNC_KINDS)
        try:
            m.wait(lambda: m.snapshots == 1)
            for i in range(5):
                writer.put("pod", f"ns/p{i}", {}, None)
            m.wait(lambda: len(m.state["pod"]) == 5)
            time.sleep(1.0)  # a few notifications
            etcd3.kill(0)
            etcd3.compact()  # the revision of the last pod: every range has got there
            writer.put("pod", "ns/while-away", {}, None)
            etcd3.start_member(0)
            m.wait(lambda: "ns/while-away" in m.state["pod"], 30)
            want = {k: dict(writer.list(k)) for k in SYNC_KINDS}
            m.wait(lambda: m.state == want)
            stats = store.sync_stats
            assert stats["rereads"] == 0, stats
            assert stats["resumes"] >= 1, stats
            assert m.snapshots == 1
        finally:
            m.close()
    finally:
        etcd3.start_member(0)
        store.close()
        writer.close()


def test_sync_rereads_only_the_ranges_whose_history_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With etcd's default notification interval (10 min) a quiet range's progress stays
    at its last event. A compaction while the watch is caught up cancels nothing; when the
    stream breaks later (the member restarted), the quiet ranges (heartbeats, blocks) start
    before the compaction and are read again; the busy one (pods) resumes. Nothing changed,
    so nothing is reported."""
    monkeypatch.setattr(etcd_module, "jittered", lambda most: min(most, 0.2))
    with start_etcd(1) as cluster:
        store = store_on(cluster, tmp_path, timeout=3.0)
        writer = store_on(cluster, tmp_path, prefix=store.prefix)
        reads: list[tuple[bytes, bytes]] = []
        real = store._read_ranges

        def recording(ranges: list[tuple[bytes, bytes]], stop: threading.Event) -> Any:
            reads.extend(ranges)
            return real(ranges, stop)

        monkeypatch.setattr(store, "_read_ranges", recording)
        try:
            writer.put_leased("heartbeat", "n1", {}, None, ttl=60)
            writer.put("block", "10.0.0.0/26", {}, None)
            m = Mirror(store, SYNC_KINDS)
            try:
                m.wait(lambda: m.snapshots == 1)
                for i in range(5):
                    writer.put("pod", f"ns/p{i}", {}, None)
                m.wait(lambda: len(m.state["pod"]) == 5)
                cluster.compact()
                time.sleep(0.3)
                assert store.sync_stats == {"snapshots": 1, "rereads": 0, "resumes": 0}
                seen = len(m.events)
                del reads[:]
                cluster.kill(0)
                cluster.start_member(0)
                cluster.wait_healthy()
                m.wait(lambda: store.sync_stats["rereads"] == 1, 30)
                m.wait(lambda: store.sync_stats["resumes"] >= 1, 30)
                assert sorted(reads) == sorted(
                    (store._kp[k], prefix_end(store._kp[k])) for k in ("heartbeat", "block")
                )
                assert m.events[seen:] == []
                writer.put("pod", "ns/after", {}, None)
                writer.put_leased("heartbeat", "n2", {}, None, ttl=60)
                want = {k: dict(writer.list(k)) for k in SYNC_KINDS}
                m.wait(lambda: m.state == want)
                assert m.snapshots == 1
            finally:
                m.close()
        finally:
            store.close()
            writer.close()


def test_sync_compacted_before_its_watch_started_reports_the_differences(
    etcd1: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """History compacted between the snapshot and the watch: etcd cancels the watch, the
    store reads the range again and reports what changed (no second snapshot)."""
    monkeypatch.setattr(etcd_module, "jittered", lambda most: min(most, 0.2))
    store = store_on(etcd1, tmp_path)
    writer = store_on(etcd1, tmp_path, prefix=store.prefix)
    store.put("node", "a", {}, None)
    store.put("node", "gone", {}, None)
    real = store.watcher.watch_ranges
    calls: list[list[int]] = []

    def compact_first(ranges: Any, *args: Any, **kw: Any) -> Any:
        calls.append([r[2] for r in ranges])
        if len(calls) == 1:
            writer.put("node", "b", {}, None)
            gone = writer.get("node", "gone")
            assert gone is not None
            writer.delete("node", "gone", gone.revision)
            etcd1.compact()
        return real(ranges, *args, **kw)

    monkeypatch.setattr(store.watcher, "watch_ranges", compact_first)
    m = Mirror(store, ["node"])
    try:
        m.wait(lambda: set(m.state.get("node", ())) == {"a", "b"})
        assert m.snapshots == 1
        assert set(m.state["node"]) == {"a", "b"}
        assert _per_key(m.events[1:]) == {("put", "node", "b"): 1, ("delete", "node", "gone"): 1}
        writer.put("node", "d", {}, None)
        m.wait(lambda: "d" in m.state["node"])
        assert store.sync_stats == {"snapshots": 1, "rereads": 1, "resumes": 0}
        assert len(calls) == 2
        assert calls[1][0] > calls[0][0]
    finally:
        m.close()
        store.close()
        writer.close()


def test_sync_stops_during_the_reread_delay(
    etcd1: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    waiting = threading.Event()

    def longest(most: float) -> float:
        if most == etcd_module.REREAD_JITTER:
            waiting.set()
        return most

    monkeypatch.setattr(etcd_module, "REREAD_JITTER", 60.0)
    monkeypatch.setattr(etcd_module, "jittered", longest)
    store = store_on(etcd1, tmp_path)
    store.put("node", "a", {}, None)
    real = store.watcher.watch_ranges

    def compact_first(*args: Any, **kw: Any) -> Any:
        store.put("node", "b", {}, None)
        etcd1.compact(store.put("node", "c", {}, None))  # past the watch's start
        return real(*args, **kw)

    monkeypatch.setattr(store.watcher, "watch_ranges", compact_first)
    m = Mirror(store, ["node"])
    try:
        assert waiting.wait(10)
    finally:
        t0 = time.monotonic()
        m.close()
        assert time.monotonic() - t0 < 2.0
        store.close()


# -- sizes ----------------------------------------------------------------------------------------


def test_lists_page_at_one_revision(
    etcd1: EtcdCluster, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(etcd_module, "PAGE", 7)
    store = store_on(etcd1, tmp_path)
    try:
        keys = [f"10.0.{i}.0/24" for i in range(30)]
        for k in keys:
            store.put("block", k, {"k": k}, None)
        assert store.list_keys("block") == sorted(keys)
        assert [(k, d.data) for k, d in store.list("block")] == [
            (k, {"k": k}) for k in sorted(keys)
        ]
        assert [k for k, _ in store.list("block", "10.0.1")] == sorted(
            k for k in keys if k.startswith("10.0.1")
        )
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
