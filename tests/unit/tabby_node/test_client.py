"""The thin client against fake tabby-nodes: a wedged node never hangs the caller.

Each fake is a unix socket served by a thread of the test: one that accepts the connection
and stays silent (the client runs the call in-process after 2 s), one that accepts the call
and then stalls (code 11 after lock_timeout_seconds + 5 s), ones that break off in the
middle of an answer, and a well-behaved one (the normal path, stderr relayed).
"""

from __future__ import annotations

import json
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tabby_node import ACCEPT, DEFAULT_LOCK_TIMEOUT, MAGIC, REJECT, client, decode_header
from tabby_node.client import lock_timeout, try_node
from tests import REPO_ROOT as ROOT

ENV = {"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "c1", "CNI_IFNAME": "eth0"}


def conf(lock: float | None = None) -> bytes:
    ipam: dict[str, object] = {"type": "tabby-ipam"}
    if lock is not None:
        ipam["lock_timeout_seconds"] = lock
    return json.dumps({"cniVersion": "0.4.0", "name": "n", "type": "tabby", "ipam": ipam}).encode()


class Request:
    def __init__(
        self, version: str, role: str, env: dict[str, str], stdin: bytes, nfds: int
    ) -> None:
        self.version, self.role, self.env, self.stdin, self.nfds = version, role, env, stdin, nfds


def read_request(conn: socket.socket) -> Request:
    first, fds, _flags, _addr = socket.recv_fds(conn, 65536, 4)
    for fd in fds:
        os.close(fd)
    data = bytearray(first)
    while len(data) < 12:
        data += conn.recv(65536)
    assert bytes(data[:4]) == MAGIC
    hlen, slen = struct.unpack("!II", data[4:12])
    while len(data) < 12 + hlen + slen:
        chunk = conn.recv(65536)
        assert chunk
        data += chunk
    version, role, env = decode_header(bytes(data[12 : 12 + hlen]))
    return Request(version, role, env, bytes(data[12 + hlen :]), len(fds))


class FakeNode:
    """A unix socket whose connections are served by ``behave(conn)`` in threads."""

    def __init__(
        self, path: str, behave: Callable[[socket.socket], None], *, accept: bool = True
    ) -> None:
        self.path = path
        self.behave = behave
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.release = threading.Event()  # stalled fakes wait on this, never forever
        self.requests: list[Request] = []
        self.errors: list[BaseException] = []
        self.threads: list[threading.Thread] = []
        if accept:
            self._spawn(self._accept_loop)

    def _spawn(self, fn: Callable[..., None], *args: object) -> None:
        t = threading.Thread(target=fn, args=args, daemon=True)
        self.threads.append(t)
        t.start()

    def _accept_loop(self) -> None:
        self.sock.settimeout(0.1)
        while not self.release.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self._spawn(self._serve, conn)

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.behave(conn)
            except BaseException as e:
                self.errors.append(e)

    def stall(self) -> None:
        self.release.wait(60)

    def close(self) -> None:
        self.release.set()
        self.sock.close()
        for t in self.threads:
            t.join(5)


@pytest.fixture
def fake(tmp_path: Path) -> Iterator[Callable[..., FakeNode]]:
    made: list[FakeNode] = []

    def make(behave: Callable[[socket.socket], None], accept: bool = True) -> FakeNode:
        node = FakeNode(str(tmp_path / f"fake{len(made)}.sock"), behave, accept=accept)
        made.append(node)
        return node

    yield make
    for node in made:
        node.close()


def call(node: FakeNode, stdin: bytes, **kw: float) -> tuple[tuple[int, bytes] | None, float]:
    t0 = time.monotonic()
    got = try_node("tabby", {**ENV, "TABBY_NODE_SOCKET": node.path}, stdin, "9.9.9", **kw)
    return got, time.monotonic() - t0


def error_of(got: tuple[int, bytes] | None) -> dict[str, object]:
    assert got is not None
    rc, out = got
    assert rc == 1
    err: dict[str, object] = json.loads(out)
    assert err["code"] == 11
    assert err["cniVersion"] == "0.4.0"
    return err


def answer(rc: int, out: bytes, err: bytes = b"") -> bytes:
    return ACCEPT + struct.pack("!III", rc, len(out), len(err)) + out + err


# -- the normal path ----------------------------------------------------------------------


def test_normal_answer_is_returned_and_stderr_relayed(
    fake: Callable[..., FakeNode], capfd: pytest.CaptureFixture[str]
) -> None:
    def behave(conn: socket.socket) -> None:
        node.requests.append(read_request(conn))
        conn.sendall(answer(0, b'{"ips":[]}\n', b"delegate says hello\n"))

    node = fake(behave)
    got, _ = call(node, conf(3))
    assert got == (0, b'{"ips":[]}\n')
    assert "delegate says hello\n" in capfd.readouterr().err
    (req,) = node.requests
    assert (req.version, req.role, req.stdin, req.nfds) == ("9.9.9", "tabby", conf(3), 2)
    assert req.env["CNI_CONTAINERID"] == "c1"


def test_large_answer_and_request_cross_the_socket_whole(fake: Callable[..., FakeNode]) -> None:
    big_out = b"x" * (3 << 20)
    stdin = conf(3)[:-1] + b', "pad": "' + b"p" * (2 << 20) + b'"}'

    def behave(conn: socket.socket) -> None:
        node.requests.append(read_request(conn))
        conn.sendall(answer(7, big_out))

    node = fake(behave)
    got, _ = call(node, stdin)
    assert got == (7, big_out)
    assert node.requests[0].stdin == stdin


def test_rejected_call_runs_in_process(fake: Callable[..., FakeNode]) -> None:
    def behave(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(REJECT + b"tabby-node is 0.0.1")

    node = fake(behave)
    t0 = time.monotonic()
    why: list[str] = []
    env = {**ENV, "TABBY_NODE_SOCKET": node.path}
    got = try_node("tabby", env, conf(), "9.9.9", accept_within=30, why=why)
    assert got is None
    assert time.monotonic() - t0 < 10  # at once, not after waiting out the accept limit
    assert why == [client.NOT_TAKEN]  # a node is there: it programs the pod from its watch


def test_absent_or_off_socket_runs_in_process(tmp_path: Path) -> None:
    stdin = conf()
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(tmp_path / "stale.sock"))
    stale.close()  # a socket file nobody listens on: connect is refused
    for path in ("off", "", str(tmp_path / "none.sock"), str(tmp_path / "stale.sock")):
        why: list[str] = []
        assert try_node("tabby", {"TABBY_NODE_SOCKET": path}, stdin, "1", why=why) is None
        assert why == [client.ABSENT], path  # no tabby-node: an ADD minds its table


def test_fast_path_imports_no_json_and_no_config_models(fake: Callable[..., FakeNode]) -> None:
    """The whole normal path (the entry's environment restore, import, call, answer) in a
    fresh interpreter without site (as the frozen bundle runs: site would load collections
    and more first) loads only C modules: no json, no socket.py, no collections, no config
    models (they cost ms on every call)."""

    def behave(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(answer(0, b"{}\n", b"note\n"))

    node = fake(behave)
    code = (
        "import sys\n"
        "before = set(sys.modules)\n"
        "from bundle import environ\n"
        "environ.restore()\n"
        "from tabby_node.client import try_node\n"
        f"got = try_node('tabby', {{'TABBY_NODE_SOCKET': {node.path!r}}}, b'{{}}', '1')\n"
        "assert got == (0, b'{}\\n'), got\n"
        "new = set(sys.modules) - before\n"
        "bad = [m for m in ('json', 'socket', 're', 'enum', 'typing', 'pydantic', 'collections',\n"
        "       'cni_plugin.config', 'ipam.config') if m in new]\n"
        "print(','.join(bad), sorted(new))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-S", "-c", code], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr
    bad, new = proc.stdout.split(" ", 1)
    assert bad == "", new
    assert proc.stderr == "note\n"


# -- a node that does not accept ------------------------------------------------------------


@pytest.mark.slow
def test_silent_node_is_treated_as_absent_after_2_s(fake: Callable[..., FakeNode]) -> None:
    """Accepts the connection, reads the call, never answers: in-process after ~2 s. A node
    that gets to the call later cannot accept it any more (no call runs twice)."""
    late: list[BaseException] = []
    given_up = threading.Event()

    def behave(conn: socket.socket) -> None:
        read_request(conn)
        given_up.wait(30)
        try:
            conn.sendall(ACCEPT)
        except OSError as e:
            late.append(e)

    got, elapsed = call(fake(behave), conf(1))
    given_up.set()
    assert got is None
    assert elapsed < 10
    deadline = time.monotonic() + 5
    while not late and time.monotonic() < deadline:
        time.sleep(0.01)
    assert late
    assert isinstance(late[0], BrokenPipeError)


def test_listening_node_that_never_accepts_is_absent(fake: Callable[..., FakeNode]) -> None:
    """A stopped-but-not-closed node: the kernel queues the connection, nobody reads it."""
    node = fake(lambda conn: None, accept=False)
    got, elapsed = call(node, conf(), accept_within=0.3)
    assert got is None
    assert elapsed < 5


def test_answer_byte_arriving_as_the_client_gives_up_is_code_11() -> None:
    """ "A" already queued when the client shuts down: the call may run there, so the client
    must not run it too; it answers code 11 (the spec's "try again")."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with theirs:
        theirs.sendall(ACCEPT)
        import _socket

        sock = _socket.socket(fileno=ours.detach())
        try:
            err = error_of(client._not_accepted(sock, conf()))
        finally:
            sock.close()
    assert "too late" in str(err["msg"])


def test_nothing_queued_when_the_client_gives_up_runs_in_process() -> None:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    with theirs:
        import _socket

        sock = _socket.socket(fileno=ours.detach())
        try:
            assert client._not_accepted(sock, conf()) is None
        finally:
            sock.close()
        with pytest.raises(BrokenPipeError):
            theirs.sendall(ACCEPT)


# -- a node that accepted -----------------------------------------------------------------


@pytest.mark.slow
def test_accepted_then_stalled_is_code_11_after_lock_timeout_plus_5_s(
    fake: Callable[..., FakeNode],
) -> None:
    def behave(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(ACCEPT)
        node.stall()

    node = fake(behave)
    got, elapsed = call(node, conf(0.5))
    err = error_of(got)
    assert "did not answer" in str(err["msg"])
    assert "5.5 s" in str(err["msg"])
    assert elapsed < 20


@pytest.mark.parametrize(
    "sent",
    [
        pytest.param(ACCEPT, id="accept-only"),
        pytest.param(ACCEPT + b"\0\0\0\0\0\0", id="half-header"),
        pytest.param(answer(0, b'{"ips": []}\n', b"err")[:-5], id="half-stdout"),
        pytest.param(answer(0, b"{}\n", b"0123456789")[:-3], id="half-stderr"),
    ],
)
@pytest.mark.parametrize("then", ["close", "stall"])
def test_partial_answer_is_code_11(
    fake: Callable[..., FakeNode],
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    sent: bytes,
    then: str,
) -> None:
    monkeypatch.setattr(client, "ANSWER_GRACE", 0.2)

    def behave(conn: socket.socket) -> None:
        read_request(conn)
        conn.sendall(sent)
        if then == "stall":
            node.stall()

    node = fake(behave)
    got, elapsed = call(node, conf(0.1))
    err = error_of(got)
    expected = "stopped while serving" if then == "close" else "did not answer"
    assert expected in str(err["msg"])
    assert elapsed < 10
    assert capfd.readouterr().err == ""  # a broken answer's stderr is not half-written


# -- lock_timeout_seconds from the raw config ---------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        (b"{}", DEFAULT_LOCK_TIMEOUT),
        (b"", DEFAULT_LOCK_TIMEOUT),
        (b"not json at all", DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds": 3}}', 3.0),
        (b'{"ipam": {"lock_timeout_seconds" :\n\t 2.5 }}', 2.5),
        (b'{"ipam": {"lock_timeout_seconds": 1e2}}', 100.0),
        (b'{"ipam": {"lock_timeout_seconds": "3"}}', DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds": -3}}', DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds": 0}}', DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds": true}}', DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds": 1e999}}', 1e7),
        (b'{"ipam": {"lock_timeout_seconds": 1-2}}', DEFAULT_LOCK_TIMEOUT),
        (b'{"lock_timeout_seconds": 2, "ipam": {"lock_timeout_seconds": 9}}', 9.0),
        (b'{"ipam": {"lock_timeout_seconds": 9}, "lock_timeout_seconds": 2}', 9.0),
        (b'{"args": "\\"lock_timeout_seconds\\": 999", "ipam": {}}', DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds"', DEFAULT_LOCK_TIMEOUT),
        (b'{"ipam": {"lock_timeout_seconds": ', DEFAULT_LOCK_TIMEOUT),
    ],
)
def test_lock_timeout_found_in_raw_config(raw: bytes, expected: float) -> None:
    assert lock_timeout(raw) == expected
