"""The HTTP endpoints' bounds (``daemon.http`` with ``daemon.limits``), on a real server on
127.0.0.1 with small limits: a request head or body over the size limit is answered 431,
414 or 413 and the connection closed; connections beyond the limit are answered 503 by
the accepting thread; a client that sends slowly or never finishes its headers is cut at
the read deadline while others are served; an answer nobody reads frees its worker at the
answer deadline. After each, the server serves a legit client."""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator, Mapping
from http.server import ThreadingHTTPServer

import pytest

from daemon.http import LIMITS, Endpoints, serve, stop
from daemon.limits import REASONS, Gate, Limits, Refusals
from tests.slow_clients import SlowClient, wait_for

READ_WITHIN = 0.5
SMALL = Limits(
    max_connections=3, max_request_bytes=4096, read_within=READ_WITHIN, answer_within=0.5
)
BIG = b"b" * (16 << 20)


def big(_query: Mapping[str, str]) -> tuple[int, str, bytes]:
    return 200, "application/octet-stream", BIG


class Served:
    def __init__(self) -> None:
        self.refusals = Refusals()
        endpoints = Endpoints(list, list, routes={"/big": big})
        self.server = serve(
            "127.0.0.1", 0, endpoints, "test", limits=SMALL, refusals=self.refusals, label="health"
        )
        self.port = self.server.server_address[1]

    @property
    def gate(self) -> Gate:
        gate = getattr(self.server, "gate", None)
        assert isinstance(gate, Gate)
        return gate

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=5)

    def refused(self, reason: str) -> int:
        """Refusals for ``reason`` since the test began."""
        return self.refusals.snapshot()[("health", reason)] - self.before[reason]

    def begin(self) -> None:
        self.before = {reason: n for (_, reason), n in self.refusals.snapshot().items()}

    def exchange(self, request: bytes) -> bytes:
        """Send ``request``, read the answer to the end."""
        with self.connect() as c:
            c.sendall(request)
            return read_all(c)

    def liveness_ok(self) -> bool:
        return self.exchange(b"GET /liveness HTTP/1.0\r\n\r\n").startswith(b"HTTP/1.0 200")


def read_all(c: socket.socket) -> bytes:
    out = bytearray()
    while chunk := c.recv(65536):
        out += chunk
    return bytes(out)


@pytest.fixture(scope="module")
def one_server() -> Iterator[Served]:
    s = Served()
    servers: list[ThreadingHTTPServer] = [s.server]
    try:
        yield s
    finally:
        stop(servers)


@pytest.fixture
def served(one_server: Served) -> Served:
    """The module's server (stopping one takes its poll interval), idle, counting anew."""
    wait_for(lambda: one_server.gate.inside == 0)
    one_server.begin()
    return one_server


def status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def test_the_endpoints_bounds_are_the_documented_ones() -> None:
    assert Limits(64, 64 << 10, 5.0, 30.0) == LIMITS


def test_a_legit_request_is_served_and_nothing_counted(served: Served) -> None:
    assert served.liveness_ok()
    assert {r: served.refused(r) for r in REASONS} == dict.fromkeys(REASONS, 0)
    assert {key for key in served.refusals.snapshot()} == {("health", r) for r in REASONS}


@pytest.mark.parametrize(
    ("request_bytes", "code"),
    [
        pytest.param(
            b"GET /liveness HTTP/1.0\r\nX-Pad: " + b"h" * 8000 + b"\r\n\r\n", 431, id="headers"
        ),
        pytest.param(b"GET /" + b"u" * 8000 + b" HTTP/1.0\r\n\r\n", 414, id="request-line"),
        pytest.param(
            b"GET /liveness HTTP/1.0\r\nContent-Length: 100000\r\n\r\n" + b"x" * 100, 413, id="body"
        ),
        pytest.param(
            b"GET /liveness HTTP/1.0\r\nContent-Length: 4090\r\n\r\n" + b"x" * 4090,
            413,
            id="head+body",
        ),
    ],
)
def test_a_request_over_the_size_limit_is_refused(
    served: Served, request_bytes: bytes, code: int
) -> None:
    answer = served.exchange(request_bytes)
    assert status(answer) == code
    assert b"Connection: close" in answer
    assert served.refused("too_large") == 1
    assert served.liveness_ok()


def test_a_small_body_is_read_and_dropped(served: Served) -> None:
    answer = served.exchange(b"GET /liveness HTTP/1.0\r\nContent-Length: 10\r\n\r\n0123456789")
    assert status(answer) == 200
    assert served.refused("too_large") == 0


def test_connections_beyond_the_limit_get_503_and_the_server_serves_after(served: Served) -> None:
    idle = [served.connect() for _ in range(SMALL.max_connections)]
    try:
        wait_for(lambda: served.gate.inside == SMALL.max_connections)
        with served.connect() as extra:
            answer = read_all(extra)
        assert status(answer) == 503
        assert b"Retry-After: 1" in answer
        assert served.refused("busy") == 1
    finally:
        for c in idle:
            c.close()
    wait_for(lambda: served.gate.inside == 0)
    assert served.liveness_ok()


@pytest.mark.parametrize("sends", ["one byte at a time", "nothing"])
def test_a_slow_client_is_cut_at_the_read_deadline_while_others_are_served(
    served: Served, sends: str
) -> None:
    since = time.monotonic()
    conn = served.connect()
    # headers that never end, well under the size limit in the time it has
    data = b"GET /liveness HTTP/1.0\r\nX-Slow: " + b"s" * 1000 if sends != "nothing" else b""
    with SlowClient(conn, since, data) as slow:
        wait_for(lambda: served.gate.inside == 1)
        for _ in range(3):
            assert served.liveness_ok()
        gone = slow.closed_after()
    assert READ_WITHIN * 0.8 < gone < READ_WITHIN + 1.0, gone
    wait_for(lambda: served.gate.inside == 0)
    assert served.refused("timeout") == 1


def test_an_answer_not_read_frees_the_worker_at_its_deadline(served: Served) -> None:
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # the kernel buffers little of it
    try:
        c.connect(("127.0.0.1", served.port))
        t0 = time.monotonic()
        c.sendall(b"GET /big HTTP/1.0\r\n\r\n")
        wait_for(lambda: served.gate.inside == 1)
        wait_for(lambda: served.gate.inside == 0)
        held = time.monotonic() - t0
    finally:
        c.close()
    assert held < READ_WITHIN + SMALL.answer_within + 1.0, held
    assert served.refused("overdue") == 1
    assert served.liveness_ok()


def test_a_gate_lets_in_its_limit_and_no_more() -> None:
    gate = Gate(2)
    assert gate.enter()
    assert gate.enter()
    assert not gate.enter()
    gate.leave()
    assert gate.inside == 1
    assert gate.enter()
    gate.leave()
    gate.leave()
    with pytest.raises(RuntimeError):
        gate.leave()
    with pytest.raises(ValueError, match="at least one"):
        Gate(0)


def test_refusals_warn_once_a_minute_per_reason(caplog: pytest.LogCaptureFixture) -> None:
    refusals = Refusals()
    refusals.register("cni")
    with caplog.at_level("DEBUG", logger="tabby.limits"):
        for _ in range(3):
            refusals.count("cni", "busy", "256 calls at once")
        refusals.count("cni", "timeout")
    assert refusals.snapshot()[("cni", "busy")] == 3
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert warnings == [
        "cni: refused a connection (busy): 256 calls at once",
        "cni: refused a connection (timeout)",
    ]
