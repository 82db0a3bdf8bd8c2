"""tabby-node's side of a call, without root: what it logs when clients come and go, the
stderr it captures and relays, and one node per run directory.

The node's work (``execute``: entering the caller's namespaces, running the plugin) is
replaced by a stand-in; the privileged tests in
``tests/privileged/test_node_daemon.py`` run the real thing.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest

from bundle import __version__
from cni_protocol import invoke
from cni_protocol import log as cni_log
from tabby_node import ACCEPT, MAGIC, MAX_STDERR, encode_header, server
from tabby_node.client import try_node
from tabby_node.server import LOCK_NAME, NodeServer

S = TypeVar("S", bound=NodeServer)


class Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def records() -> Iterator[Records]:
    logger = logging.getLogger("tabby.node")
    handler = Records()
    old = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(handler)
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old)


class Node(NodeServer):
    """The real server, counting the connections it has finished with."""

    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.finished = 0

    def _handle(self, conn: socket.socket) -> None:
        try:
            super()._handle(conn)
        finally:
            with self.lock:
                self.finished += 1

    def settle(self, connections: int = 1) -> None:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with self.lock:
                if self.finished >= connections:
                    return
            time.sleep(0.01)
        raise AssertionError("the node did not finish its connections")


@contextlib.contextmanager
def serving(srv: S) -> Iterator[S]:
    """``srv`` bound and serving from a thread of its own; stopped when the block ends."""
    srv.bind()
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv
    finally:
        srv.stop(grace=5)
        t.join(5)


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    with serving(Node(str(tmp_path / "run" / "node.sock"))) as srv:
        yield srv


def request(env: dict[str, str], stdin: bytes = b"{}", version: str = __version__) -> bytes:
    header = encode_header(version, "tabby", env)
    return MAGIC + struct.pack("!II", len(header), len(stdin)) + header + stdin


def send_with_fds(conn: socket.socket, data: bytes) -> None:
    net = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    mnt = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        socket.send_fds(conn, [data], [net, mnt])
    finally:
        os.close(net)
        os.close(mnt)


# -- clients that come and go (probes, runtimes killed mid-call) -------------------------


@pytest.mark.parametrize(
    ("sent", "words"),
    [
        pytest.param(b"", "without a request", id="connect-and-close"),
        pytest.param(MAGIC + b"\0\0", "before its call was accepted", id="half-head"),
        pytest.param(
            MAGIC + struct.pack("!II", 100, 100) + b"x" * 30,
            "before its call was accepted",
            id="half-body",
        ),
    ],
)
def test_client_leaving_without_a_call_is_one_debug_line(
    node: Node, records: Records, sent: bytes, words: str
) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(node.path)
        if sent:  # with the namespace fds, as tabby's client sends them: only the bytes are short
            send_with_fds(c, sent)
    node.settle()
    assert [(r.levelno, r.exc_info) for r in records.records] == [(logging.DEBUG, None)]
    assert words in records.records[0].getMessage()


def test_caller_gone_before_the_answer_is_one_info_line(
    node: Node, records: Records, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runtime killed mid-call: the node finishes the call and says so once, no traceback."""
    gone = threading.Event()

    def execute(*_args: object) -> tuple[int, bytes]:
        gone.wait(10)
        time.sleep(0.05)
        return 0, b"{}" * 100_000

    monkeypatch.setattr(server, "execute", execute)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(node.path)
        send_with_fds(c, request({"CNI_COMMAND": "ADD", "CNI_CONTAINERID": "abc"}))
        assert c.recv(1) == ACCEPT
    gone.set()
    node.settle()
    assert [(r.levelno, r.exc_info) for r in records.records] == [(logging.INFO, None)]
    assert "tabby ADD abc" in records.records[0].getMessage()


def test_garbage_is_refused_without_noise(node: Node, records: Records) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
        c.connect(node.path)
        c.sendall(b"GET / HTTP/1.0\r\n\r\n")
        assert c.recv(1) == b"R"
    node.settle()
    assert all(r.levelno < logging.WARNING for r in records.records)


# -- stderr captured per call and relayed ---------------------------------------------------

STUB = """#!{python}
import sys
sys.stdin.buffer.read()
sys.stderr.write("stub ipam speaks on stderr\\n")
sys.stderr.flush()
print('{{"cniVersion": "1.1.0", "ips": [{{"address": "10.0.0.1/32"}}]}}')
"""


@pytest.fixture
def stub_path(tmp_path: Path) -> str:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "stub-ipam"
    script.write_text(STUB.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(bindir)


def test_capture_takes_a_delegates_stderr(
    stub_path: str, capfd: pytest.CaptureFixture[str]
) -> None:
    env = {"CNI_COMMAND": "ADD", "PATH": os.environ.get("PATH", "")}
    cni_log.begin_stderr_capture()
    try:
        result = invoke.exec_plugin("stub-ipam", "ADD", b"{}", env, [stub_path])
    finally:
        captured = cni_log.end_stderr_capture()
    assert result is not None
    assert captured == b"stub ipam speaks on stderr\n"
    assert capfd.readouterr().err == ""  # not on the node's own stderr
    assert cni_log.stderr_capture_fd() is None


def test_capture_is_per_thread_and_bounded() -> None:
    cni_log.begin_stderr_capture()
    try:
        fd = cni_log.stderr_capture_fd()
        assert fd is not None
        seen: list[int | None] = []
        t = threading.Thread(target=lambda: seen.append(cni_log.stderr_capture_fd()))
        t.start()
        t.join()
        assert seen == [None]
        os.write(fd, b"a" * 100)
    finally:
        captured = cni_log.end_stderr_capture(limit=10)
    assert captured.startswith(b"a" * 10 + b"\n[90 more bytes")
    assert cni_log.end_stderr_capture() == b""  # nothing open any more


def test_node_relays_delegate_stderr_and_warnings_to_the_caller(
    node: Node,
    stub_path: str,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
) -> None:
    """What a call writes to stderr in the node (a delegated plugin's stderr, tabby's own
    warnings at the call's level) reaches the client's stderr; INFO does not, as
    standalone."""
    relay = cni_log.call_stderr_handler()
    tabby = logging.getLogger("tabby")
    old_level = tabby.level
    tabby.addHandler(relay)
    tabby.setLevel(logging.DEBUG)

    def execute(role: str, env: dict[str, str], *_fds: object) -> tuple[int, bytes]:
        logging.getLogger("tabby.plugin").info("info stays in the log file")
        logging.getLogger("tabby.plugin").warning("a warning for the caller")
        invoke.exec_plugin("stub-ipam", "ADD", b"{}", env, [stub_path])
        return 0, b'{"ok": 1}\n'

    monkeypatch.setattr(server, "execute", execute)
    try:
        env = {"CNI_COMMAND": "ADD", "TABBY_NODE_SOCKET": node.path, "PATH": "/usr/bin:/bin"}
        got = try_node("tabby", env, b"{}", __version__)
    finally:
        tabby.removeHandler(relay)
        tabby.setLevel(old_level)
    assert got == (0, b'{"ok": 1}\n')
    err = capfd.readouterr().err
    assert "stub ipam speaks on stderr\n" in err
    assert "WARNING tabby.plugin" in err
    assert "a warning for the caller" in err
    assert "info stays" not in err


def test_node_relays_at_most_max_stderr(
    node: Node, monkeypatch: pytest.MonkeyPatch, capfd: pytest.CaptureFixture[str]
) -> None:
    def execute(*_args: object) -> tuple[int, bytes]:
        fd = cni_log.stderr_capture_fd()
        assert fd is not None
        os.write(fd, b"e" * (MAX_STDERR + 5))
        return 0, b"{}\n"

    monkeypatch.setattr(server, "execute", execute)
    got = try_node("tabby", {"TABBY_NODE_SOCKET": node.path}, b"{}", __version__)
    assert got == (0, b"{}\n")
    err = capfd.readouterr().err
    assert err.startswith("e" * MAX_STDERR + "\n[5 more bytes of stderr not relayed]")


# -- one tabby-node per run directory -----------------------------------------------------


def test_second_node_in_the_same_run_dir_exits_with_one_line(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = NodeServer(str(run / "node.sock"))
    first.bind()
    try:
        for name in ("node.sock", "other.sock"):
            with pytest.raises(SystemExit) as exc:
                NodeServer(str(run / name)).bind()
            text = str(exc.value.code)
            assert text.startswith("tabby-node: another tabby-node is running in ")
            assert "\n" not in text
            assert LOCK_NAME in text
        assert os.path.exists(first.path)  # the loser touched nothing of the winner's
    finally:
        first.stop(grace=1)
    again = NodeServer(str(run / "node.sock"))
    again.bind()  # the lock went with the first node
    again.stop(grace=1)


def test_nodes_in_different_run_dirs_coexist(tmp_path: Path) -> None:
    a = NodeServer(str(tmp_path / "a" / "node.sock"))
    b = NodeServer(str(tmp_path / "b" / "node.sock"))
    a.bind()
    try:
        b.bind()
        b.stop(grace=1)
    finally:
        a.stop(grace=1)


def test_lock_file_is_root_only(tmp_path: Path) -> None:
    srv = NodeServer(str(tmp_path / "run" / "node.sock"))
    srv.bind()
    try:
        mode = os.stat(tmp_path / "run" / LOCK_NAME).st_mode & 0o777
        assert mode & 0o077 == 0, oct(mode)
    finally:
        srv.stop(grace=1)
