"""tabby-node's typha client against the gRPC service on loopback: mutual TLS and who may
connect, the sync contract, reconnection with resume, and a snapshot from another replica
turned into differences."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from datastore.base import Doc, SyncEvent
from fanout import server, wire
from fanout.client import ClientTls, TyphaSync
from fanout.hub import Handshakes, Hub
from lab.kubernetes.pki import KeyPair, Pki
from tests.unit.fanout.docs import pod

KINDS = ("pod", "node")
URI = "spiffe://cluster.local/ns/kube-system/sa/tabby-node"


class Loop:
    """An asyncio loop in a thread, where the hub and the server live."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    def call(self, fn: Callable[..., object], *args: object) -> None:
        self.loop.call_soon_threadsafe(fn, *args)

    def run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)
        self.loop.close()


@pytest.fixture
def loop() -> Iterator[Loop]:
    made = Loop()
    yield made
    made.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("typha-pki"), "typha-test")


def pem(pair: KeyPair) -> tuple[bytes, bytes]:
    return pair.cert.read_bytes(), pair.key.read_bytes()


def serving(pki: Pki, **allowed: tuple[str, ...]) -> server.Tls:
    cert, key = pem(pki.issue("typha", "typha", sans=("DNS:typha", "IP:127.0.0.1"), server=True))
    return server.Tls(pki.ca.cert.read_bytes(), cert, key, **allowed)


def client_tls(pki: Pki, pair: KeyPair) -> ClientTls:
    cert, key = pem(pair)
    return ClientTls(pki.ca.cert.read_bytes(), cert, key, "typha")


def started_hub(loop: Loop, epoch: str, docs: dict[str, Doc]) -> Hub:
    async def make() -> Hub:
        hub = Hub(epoch=epoch, interest=False)
        hub.apply(SyncEvent("snapshot", "", "", None, {"pod": dict(docs), "node": {}}))
        return hub

    return loop.run(make())  # type: ignore[no-any-return]


def start(loop: Loop, hub: Hub, tls: server.Tls | None, port: int = 0) -> grpc.aio.Server:
    return loop.run(server.start(hub, f"127.0.0.1:{port}", tls))  # type: ignore[no-any-return]


class Consumer:
    """A sync iterator read in a thread, its events collected."""

    def __init__(self, source: TyphaSync) -> None:
        self.source = source
        self.stop = threading.Event()
        self.events: list[SyncEvent] = []
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        for event in self.source.sync(KINDS, self.stop):
            self.events.append(event)

    def wait(self, check: Callable[[list[SyncEvent]], bool], timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while not check(self.events):
            assert time.monotonic() < deadline, f"not seen: {self.events}"
            time.sleep(0.02)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        assert not self.thread.is_alive(), "the sync iterator did not end after stop"


def test_snapshot_then_changes_over_mutual_tls(loop: Loop, pki: Pki) -> None:
    hub = started_hub(loop, "e1", {"default/a": Doc(pod("a", "n1"), 1)})
    srv = start(loop, hub, serving(pki, client_cns=("tabby-node",)))
    node = client_tls(pki, pki.issue("node", "tabby-node"))
    consumer = Consumer(TyphaSync([f"127.0.0.1:{srv.port}"], "n2", node))
    try:
        consumer.wait(lambda e: len(e) == 1)
        first = consumer.events[0]
        assert first.type == "snapshot"
        assert first.snapshot is not None
        assert "uid" not in first.snapshot["pod"]["default/a"].data["metadata"]  # n2's view
        loop.call(hub.apply, SyncEvent("put", "pod", "default/b", Doc(pod("b", "n2"), 5), None))
        consumer.wait(lambda e: len(e) == 2)
        assert (consumer.events[1].type, consumer.events[1].key) == ("put", "default/b")
        assert consumer.events[1].doc is not None
        assert consumer.events[1].doc.data["metadata"]["uid"] == "uid-b"  # its own: whole
    finally:
        consumer.close()
        loop.run(srv.stop(None))


@pytest.mark.parametrize(
    ("stem", "cn", "sans", "reason"),
    [
        ("stranger", "someone", (), "identity"),
        ("by-uri", "someone-else", (f"URI:{URI}",), None),
        ("by-cn", "tabby-node", (), None),
    ],
)
def test_who_may_connect(
    loop: Loop, pki: Pki, stem: str, cn: str, sans: tuple[str, ...], reason: str | None
) -> None:
    hub = started_hub(loop, "e1", {})
    srv = start(loop, hub, serving(pki, client_cns=("tabby-node",), client_uri_sans=(URI,)))
    source = TyphaSync(
        [f"127.0.0.1:{srv.port}"], "n1", client_tls(pki, pki.issue(stem, cn, sans=sans))
    )
    consumer = Consumer(source)
    try:
        if reason is None:
            consumer.wait(lambda e: len(e) == 1)
            assert hub.stats.refused == {}
        else:
            deadline = time.monotonic() + 10
            while hub.stats.refused.get(reason) is None or source.last_error is None:
                assert time.monotonic() < deadline
                time.sleep(0.05)
            assert consumer.events == []
            assert "PERMISSION_DENIED" in source.last_error
    finally:
        consumer.close()
        loop.run(srv.stop(None))


@pytest.fixture(scope="module")
def other_pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("other-pki"), "another-ca")


def _call_sync(port: int, credentials: grpc.ChannelCredentials) -> grpc.StatusCode:
    """One Sync call with these credentials (as any gRPC client makes it): its status."""
    channel = grpc.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "typha")]
    )
    try:
        call = channel.stream_stream(
            "/tabby.typha.v1.Typha/Sync",
            request_serializer=wire.encode_client,
            response_deserializer=wire.decode_server,
        )(iter([wire.ClientMessage("n1", kinds=KINDS)]), timeout=5)
        try:
            next(iter(call))
        except grpc.RpcError as e:
            return e.code()  # type: ignore[no-any-return]
        return grpc.StatusCode.OK
    finally:
        channel.close()


@pytest.mark.parametrize(
    ("who", "status", "reason"),
    [
        ("no certificate", grpc.StatusCode.UNAVAILABLE, "handshake"),
        ("another CA's", grpc.StatusCode.UNAVAILABLE, "handshake"),
        ("the wrong CN", grpc.StatusCode.PERMISSION_DENIED, "identity"),
        ("tabby-node", grpc.StatusCode.OK, None),
    ],
)
def test_a_client_without_a_valid_certificate_is_refused_and_counted(
    loop: Loop,
    pki: Pki,
    other_pki: Pki,
    who: str,
    status: grpc.StatusCode,
    reason: str | None,
) -> None:
    """No certificate or one of another CA: the TLS handshake fails inside grpcio (the
    client sees UNAVAILABLE) and is counted as a handshake that never reached the service;
    a certificate of the CA with another CN: PERMISSION_DENIED, counted by its reason.
    Every connection is a handshake begun, each counted once whatever its calls."""
    hub = started_hub(loop, "e1", {})
    hub.stats.handshakes = Handshakes(settle=0.3)
    srv = start(loop, hub, serving(pki, client_cns=("tabby-node",)))
    ca = pki.ca.cert.read_bytes()
    credentials = {
        "no certificate": lambda: grpc.ssl_channel_credentials(ca),
        "another CA's": lambda: grpc.ssl_channel_credentials(
            ca, *reversed(pem(other_pki.issue("node", "tabby-node")))
        ),
        "the wrong CN": lambda: grpc.ssl_channel_credentials(
            ca, *reversed(pem(pki.issue("stranger", "someone")))
        ),
        "tabby-node": lambda: grpc.ssl_channel_credentials(
            ca, *reversed(pem(pki.issue("node", "tabby-node")))
        ),
    }[who]()

    def scrape() -> dict[str, float]:
        from typha.metrics import collect

        return {
            s.name + "".join(f'{{reason="{r}"}}' for r in s.labels.values()): s.value
            for m in collect(hub)
            for s in m.samples
        }

    try:
        assert _call_sync(srv.port, credentials) == status
        assert _call_sync(srv.port, credentials) == status  # a second connection
        time.sleep(0.4)  # the handshakes settled
        metrics = scrape()
        assert metrics["tabby_typha_tls_handshakes_total"] == 2
        counted = {
            k: v
            for k, v in metrics.items()
            if k.startswith("tabby_typha_connections_refused_total") and v
        }
        name = f'tabby_typha_connections_refused_total{{reason="{reason}"}}'
        wanted = {} if reason is None else {name: 2}
        assert counted == wanted
        assert hub.stats.handshakes.reached == (0 if reason == "handshake" else 2)
    finally:
        loop.run(srv.stop(None))


def test_the_calls_of_one_connection_are_one_handshake() -> None:
    """A peer's calls while one is open, or soon after the last ended, are one connection;
    a handshake counted as failed stays counted (a counter never goes back)."""
    shakes = Handshakes(settle=0.0)
    shakes.begin()
    shakes.begin()
    assert shakes.failed() == 2  # nothing reached the service yet
    shakes.opened("ipv4:10.0.0.1:40000")
    shakes.opened("ipv4:10.0.0.1:40000")  # a second call on the same connection
    shakes.closed("ipv4:10.0.0.1:40000")
    shakes.closed("ipv4:10.0.0.1:40000")
    shakes.opened("ipv4:10.0.0.1:40000")  # and a third, after the others ended
    assert shakes.reached == 1
    assert shakes.failed() == 2  # the max: the late call does not take it back
    shakes.begin()
    assert shakes.failed() == 2  # 3 begun, 1 reached: the late one absorbed
    shakes.begin()
    assert shakes.failed() == 3


def test_a_client_asking_for_kinds_typha_does_not_serve_is_refused(loop: Loop) -> None:
    """A tabby-node newer than its typha (a kind it watches that typha does not sync) is
    refused rather than sent nothing of that kind, and counted; it tries the next typha."""

    async def make() -> Hub:
        hub = Hub(epoch="e1", kinds=("pod",))
        hub.apply(SyncEvent("snapshot", "", "", None, {"pod": {}}))
        return hub

    hub: Hub = loop.run(make())
    srv = start(loop, hub, None)
    source = TyphaSync([f"127.0.0.1:{srv.port}"], "n1", None, backoff=(0.05, 0.1))
    consumer = Consumer(source)  # asks for pods and nodes
    try:
        deadline = time.monotonic() + 10
        while source.last_error is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert "FAILED_PRECONDITION" in source.last_error
        assert "does not serve node" in source.last_error
        assert consumer.events == []
        assert hub.stats.refused["kinds"] >= 1
    finally:
        consumer.close()
        loop.run(srv.stop(None))


def test_plaintext_client_is_refused_by_a_tls_server(loop: Loop, pki: Pki) -> None:
    hub = started_hub(loop, "e1", {})
    srv = start(loop, hub, serving(pki))
    problems: dict[str, str] = {}
    source = TyphaSync(
        [f"127.0.0.1:{srv.port}"], "n1", None, backoff=(0.05, 0.1), problems=problems
    )
    consumer = Consumer(source)
    try:
        deadline = time.monotonic() + 5
        while "typha" not in problems:  # tabby-node's readiness says why
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert problems["typha"].startswith(f"typha 127.0.0.1:{srv.port}: UNAVAILABLE")
        assert consumer.events == []
    finally:
        consumer.close()
        loop.run(srv.stop(None))


def test_reconnection_resumes_and_another_replica_sends_only_differences(loop: Loop) -> None:
    docs = {"default/a": Doc(pod("a", "n1"), 1), "default/b": Doc(pod("b", "n1"), 2)}
    hub = started_hub(loop, "e1", docs)
    srv = start(loop, hub, None)
    port = srv.port
    problems: dict[str, str] = {}
    source = TyphaSync([f"127.0.0.1:{port}"], "n1", None, backoff=(0.05, 0.2), problems=problems)
    consumer = Consumer(source)
    try:
        consumer.wait(lambda e: len(e) == 1)
        assert problems == {}
        # typha goes away; a change happens meanwhile; the same typha comes back
        loop.run(srv.stop(None))
        loop.call(hub.apply, SyncEvent("put", "pod", "default/c", Doc(pod("c", "n1"), 7), None))
        srv = start(loop, hub, None, port)
        consumer.wait(lambda e: len(e) == 2)
        assert (consumer.events[1].type, consumer.events[1].key) == ("put", "default/c")
        assert source.stats["resumes"] == 1
        assert source.stats["snapshots"] == 1
        # another replica (its own epoch): a snapshot, yielded as its differences only
        loop.run(srv.stop(None))
        other = started_hub(
            loop,
            "e2",
            {
                "default/a": Doc(pod("a", "n1"), 1),
                "default/c": Doc(pod("c", "n1"), 7),
                "default/d": Doc(pod("d", "n1"), 9),
            },
        )
        srv = start(loop, other, None, port)
        consumer.wait(lambda e: len(e) == 4)
        assert sorted((e.type, e.key) for e in consumer.events[2:]) == [
            ("delete", "default/b"),
            ("put", "default/d"),
        ]
        assert source.stats["rereads"] == 1
    finally:
        consumer.close()
        loop.run(srv.stop(None))
