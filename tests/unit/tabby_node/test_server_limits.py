"""The node socket's bounds (``daemon.limits``; docs/node.md "Limits"), on a real unix
socket in a temporary directory with the node's work (``execute``) replaced by a stand-in:
a request over the size limit and a call beyond the connection limit are answered "R" and
the plugin's client runs the call itself; a client that sends slowly or not at all is cut
at the read deadline while the node serves others; an answer nobody reads in time frees
its worker. The deadlines are made small here; the options that set the limits are read
as the other options are."""

from __future__ import annotations

import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from bundle import __version__
from cni_protocol.errors import CniError
from daemon.limits import Limits
from tabby_node import ACCEPT, ANSWER_GRACE, MAGIC, MAX_CALLS, MAX_REQUEST, REJECT, server
from tabby_node.client import try_node
from tabby_node.options import parse
from tabby_node.server import LIMITS, NodeServer
from tests.slow_clients import SlowClient, seconds_until_closed, wait_for

from .test_server import request, send_with_fds, serving

READ_WITHIN = 0.5
SMALL = Limits(
    max_connections=2, max_request_bytes=64 << 10, read_within=READ_WITHIN, answer_within=0.3
)
ANSWER = b'{"cniVersion": "1.1.0"}\n'


class Work:
    """The node's work for the test running (``execute``'s stand-in)."""

    def __init__(self) -> None:
        self.answer: Callable[[], tuple[int, bytes]] = lambda: (0, ANSWER)

    def __call__(self, *_args: object) -> tuple[int, bytes]:
        return self.answer()


@pytest.fixture(scope="module")
def one_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeServer, Work]]:
    work = Work()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(server, "execute", work)
        path = tmp_path_factory.mktemp("limits") / "run" / "node.sock"
        with serving(NodeServer(str(path), limits=SMALL)) as srv:
            yield srv, work


@pytest.fixture
def node(one_node: tuple[NodeServer, Work]) -> NodeServer:
    """The module's node (stopping one takes its accept timeout), idle, counting anew."""
    srv, work = one_node
    wait_for(lambda: srv.gate.inside == 0)
    work.answer = lambda: (0, ANSWER)
    srv.served = 0
    BEFORE.clear()
    BEFORE.update(srv.refusals.snapshot())
    return srv


@pytest.fixture
def work(one_node: tuple[NodeServer, Work]) -> Work:
    return one_node[1]


BEFORE: dict[tuple[str, str], int] = {}


def call(node: NodeServer, stdin: bytes = b"{}") -> tuple[tuple[int, bytes] | None, float]:
    """A plugin's call through tabby's client: (what it got, seconds it took)."""
    t0 = time.monotonic()
    got = try_node(
        "tabby", {"TABBY_NODE_SOCKET": node.path, "CNI_COMMAND": "ADD"}, stdin, __version__
    )
    return got, time.monotonic() - t0


def refused(node: NodeServer, reason: str) -> int:
    """Refusals for ``reason`` since the test began."""
    return node.refusals.snapshot()[("cni", reason)] - BEFORE.get(("cni", reason), 0)


def test_the_defaults_are_the_documented_ones() -> None:
    assert (LIMITS.max_connections, LIMITS.max_request_bytes) == (MAX_CALLS, MAX_REQUEST)
    assert (MAX_CALLS, MAX_REQUEST) == (256, 1 << 20)
    assert LIMITS.read_within == 5.0
    assert LIMITS.answer_within == ANSWER_GRACE


def test_a_request_over_the_size_limit_runs_in_the_plugin(node: NodeServer) -> None:
    big = json.dumps({"cniVersion": "1.1.0", "pad": "x" * (SMALL.max_request_bytes + 1)})
    got, seconds = call(node, big.encode())
    assert got is None  # refused: the plugin runs the call itself
    assert seconds < 1.0
    assert refused(node, "too_large") == 1
    assert call(node)[0] == (0, ANSWER)  # and the node serves the next one
    wait_for(lambda: node.served == 1)


def test_a_request_at_the_size_limit_is_served(node: NodeServer) -> None:
    header_len = len(request({"TABBY_NODE_SOCKET": node.path, "CNI_COMMAND": "ADD"})) - 12 - 2
    stdin = b"{" + b" " * (SMALL.max_request_bytes - header_len - 2) + b"}"
    assert call(node, stdin)[0] == (0, ANSWER)
    assert refused(node, "too_large") == 0


def test_calls_beyond_the_connection_limit_run_in_the_plugin(node: NodeServer) -> None:
    holders = []
    try:
        for _ in range(SMALL.max_connections):
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.connect(node.path)
            holders.append(c)
        wait_for(lambda: node.gate.inside == SMALL.max_connections)
        got, seconds = call(node)
        assert got is None  # "R busy" at once, no thread made for it
        assert seconds < 1.0
        assert refused(node, "busy") == 1
        assert node.gate.inside == SMALL.max_connections
    finally:
        for c in holders:
            c.close()
    wait_for(lambda: node.gate.inside == 0)
    assert call(node)[0] == (0, ANSWER)


@pytest.mark.parametrize("sends", ["one byte at a time", "nothing"])
def test_a_slow_client_is_cut_at_the_read_deadline_while_others_are_served(
    node: NodeServer, sends: str
) -> None:
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    since = time.monotonic()
    conn.connect(node.path)
    data = b""
    if sends != "nothing":
        data = request({"CNI_COMMAND": "ADD"}, b"{}" * 1000)
        send_with_fds(conn, data[:1])  # the namespace fds with the first byte
    with SlowClient(conn, since, data[1:]) as slow:
        wait_for(lambda: node.gate.inside == 1)
        for _ in range(3):  # meanwhile, the node serves others (in the other slot)
            assert call(node)[0] == (0, ANSWER)
            wait_for(lambda: node.gate.inside == 1)
        gone = slow.closed_after()
    assert READ_WITHIN * 0.8 < gone < READ_WITHIN + 1.0, gone
    wait_for(lambda: node.served == 3)
    wait_for(lambda: node.gate.inside == 0)
    assert refused(node, "timeout") == 1
    wait_for(lambda: node.served == 3)


def test_an_answer_not_read_in_time_frees_the_worker(node: NodeServer, work: Work) -> None:
    """The caller takes "A" and never reads its (large) answer: the worker sends until the
    call's bound (its lock_timeout_seconds + answer_within) and no longer."""
    work.answer = lambda: (0, b"x" * (16 << 20))
    stdin = b'{"ipam": {"lock_timeout_seconds": 0.2}}'
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(node.path)
        send_with_fds(c, request({"CNI_COMMAND": "ADD"}, stdin))
        assert c.recv(1) == ACCEPT
        t0 = time.monotonic()
        wait_for(lambda: node.gate.inside == 0, within=5.0)
        held = time.monotonic() - t0
    assert held < 0.2 + SMALL.answer_within + 1.0, held
    assert refused(node, "overdue") == 1


def test_a_call_past_its_bound_is_counted_and_its_answer_not_waited_on(
    node: NodeServer, work: Work
) -> None:
    def late() -> tuple[int, bytes]:
        time.sleep(0.6)  # past 0.1 + answer_within
        return 0, ANSWER

    work.answer = late
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(node.path)
        send_with_fds(c, request({"CNI_COMMAND": "ADD"}, b'{"lock_timeout_seconds": 0.1}'))
        assert c.recv(1) == ACCEPT
        wait_for(lambda: node.gate.inside == 0)
    assert refused(node, "overdue") == 1


def test_garbage_and_refusals_close_the_connection(node: NodeServer) -> None:
    """A frame whose lengths say more than the limit is answered "R" before any of it is
    read, and the connection closed."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(node.path)
        send_with_fds(c, MAGIC + struct.pack("!II", 10, 1 << 30))
        assert c.recv(64) == REJECT + b"request too large"
        assert seconds_until_closed(c, within=2.0) < 2.0
    assert refused(node, "too_large") == 1


# -- the options --------------------------------------------------------------------------


def test_the_limits_are_options_with_environment_variables() -> None:
    options, _ = parse(["--max-calls", "3"], {"TABBY_MAX_REQUEST_BYTES": "100000"})
    limits = options.call_limits
    assert (limits.max_connections, limits.max_request_bytes) == (3, 100_000)
    assert (limits.read_within, limits.answer_within) == (LIMITS.read_within, LIMITS.answer_within)
    defaults, _ = parse([], {})
    assert defaults.call_limits == LIMITS


@pytest.mark.parametrize(
    ("argv", "env", "named"),
    [
        (["--max-calls", "0"], {}, "--max-calls"),
        ([], {"TABBY_MAX_CALLS": "many"}, "TABBY_MAX_CALLS"),
        (["--max-request-bytes", "1000"], {}, "--max-request-bytes"),
    ],
)
def test_a_bad_limit_is_refused_naming_it(argv: list[str], env: dict[str, str], named: str) -> None:
    with pytest.raises(CniError) as exc:
        parse(argv, env)
    assert named in str(exc.value)


def test_the_node_counts_every_reason_from_zero() -> None:
    """Every reason the node counts is one daemon.limits knows (the metrics' label values)."""
    from daemon.limits import REASONS

    srv = NodeServer(os.path.join("/nonexistent", "node.sock"))
    assert {reason for (_server, reason) in srv.refusals.snapshot()} == set(REASONS)


def test_the_default_limits_serve_64_slow_adds_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The e2e and Kubernetes tiers' burst: 64 ADDs at once, each held a while by a slow
    datastore, are all served by the node (none refused, none run in the plugin)."""

    def slow(*_a: object) -> tuple[int, bytes]:
        time.sleep(0.3)
        return 0, ANSWER

    monkeypatch.setattr(server, "execute", slow)
    got: list[tuple[int, bytes] | None] = []
    with serving(NodeServer(str(tmp_path / "run" / "node.sock"))) as srv:
        callers = [threading.Thread(target=lambda: got.append(call(srv)[0])) for _ in range(64)]
        for c in callers:
            c.start()
        for c in callers:
            c.join(30)
    assert got == [(0, ANSWER)] * 64
    assert set(srv.refusals.snapshot().values()) == {0}
