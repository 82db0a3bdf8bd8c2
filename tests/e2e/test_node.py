"""tabby-node: the fast path, its refusals, its death in the middle of a stream of ADDs, fake
nodes that never answer, the stderr it relays, and one node per run directory."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    TABBY,
    TABBY_IPAM,
    TABBY_NODE,
    Call,
    exec_plugin,
    ipam_conf,
    start_tabby_node,
    stop_tabby_node,
)
from tests.e2e.test_ipam_binary import allocated, store_handles
from tests.node_agent import IsolatedNode

pytestmark = [pytest.mark.e2e, pytest.mark.privileged, pytest.mark.usefixtures("installed")]


@pytest.fixture
def node(tmp_path: Path) -> Iterator[tuple[Any, str]]:
    sock = str(tmp_path / "run" / "node.sock")
    proc = start_tabby_node(sock, str(tmp_path / "node.log"))
    try:
        yield proc, sock
    finally:
        stop_tabby_node(proc)


def env(cid: str, sock: str) -> dict[str, str]:
    return {
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": "/nonexistent/netns",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": os.path.dirname(TABBY_IPAM),
        "TABBY_NODE_SOCKET": sock,
        "CNI_ARGS": f"K8S_POD_NAMESPACE=ns;K8S_POD_NAME={cid}",
    }


def test_node_serves_and_results_match_in_process(node: tuple[Any, str], tmp_path: Path) -> None:
    """The node's answer is the in-process answer: same shape, same store."""
    _, sock = node
    conf = ipam_conf(str(tmp_path / "ipam"))
    via_node = exec_plugin(TABBY_IPAM, "ADD", conf, env=env("n1", sock))
    alone = exec_plugin(TABBY_IPAM, "ADD", conf, env=env("n2", "off"))
    assert via_node.rc == alone.rc == 0
    assert set(via_node.out) == set(alone.out)
    assert via_node.out["ips"] != alone.out["ips"]
    assert len(store_handles(tmp_path / "ipam")) == 2
    err = exec_plugin(TABBY_IPAM, "ADD", {**conf, "cniVersion": "9.9.9"}, env=env("n3", sock))
    assert (err.rc, err.out["code"]) == (1, 1)


def test_socket_is_root_only(node: tuple[Any, str]) -> None:
    _, sock = node
    assert oct(os.stat(sock).st_mode & 0o777) == "0o600"
    assert oct(os.stat(os.path.dirname(sock)).st_mode & 0o777) == "0o700"


def test_absent_or_refusing_socket_falls_back(tmp_path: Path) -> None:
    conf = ipam_conf(str(tmp_path / "ipam"))
    missing = exec_plugin(TABBY_IPAM, "ADD", conf, env=env("f1", str(tmp_path / "nope.sock")))
    assert missing.rc == 0, missing
    stale = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(stale))
    s.close()  # a socket file nobody listens on: connect is refused
    refused = exec_plugin(TABBY_IPAM, "ADD", conf, env=env("f2", str(stale)))
    assert refused.rc == 0, refused
    assert len(store_handles(tmp_path / "ipam")) == 2


@pytest.mark.slow
def test_kill_node_in_a_stream_of_adds(tmp_path: Path) -> None:
    """SIGKILL tabby-node while 4 workers stream ADDs: every ADD succeeds or fails cleanly
    (code 11), the runtime's DEL after a failed ADD cleans it, no address leaks or is given
    twice, and calls after the kill run in-process."""
    sock = str(tmp_path / "run" / "node.sock")
    proc = start_tabby_node(sock, str(tmp_path / "node.log"))
    conf = ipam_conf(str(tmp_path / "ipam"))
    results: dict[str, Call] = {}
    lock = threading.Lock()
    killed_at: list[float] = []
    stop = time.monotonic() + 6.0

    def worker(w: int) -> None:
        n = 0
        while time.monotonic() < stop:
            cid = f"k{w}-{n}"
            call = exec_plugin(TABBY_IPAM, "ADD", conf, env=env(cid, sock))
            with lock:
                results[cid] = call
            n += 1

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(4)]
    for t in threads:
        t.start()
    time.sleep(random.Random(7).uniform(1.0, 2.5))
    proc.send_signal(signal.SIGKILL)
    killed_at.append(time.monotonic())
    for t in threads:
        t.join()
    stop_tabby_node(proc)

    ok = {cid: c for cid, c in results.items() if c.rc == 0}
    print(f"ADDs: {len(results)}, ok {len(ok)}, failed {len(results) - len(ok)}")
    failed = {cid: c for cid, c in results.items() if c.rc != 0}
    assert len(results) > 20
    for c in failed.values():
        assert c.out["code"] == 11, c  # clean CNI error JSON, never garbage
    # Runtimes DEL after a failed ADD (spec); the node is gone, so this runs in-process.
    for cid in failed:
        assert exec_plugin(TABBY_IPAM, "DEL", conf, env=env(cid, sock)).rc == 0
    given = [c.out["ips"][0]["address"].split("/")[0] for c in ok.values()]
    assert len(given) == len(set(given)), "an address was given twice"
    assert sorted(allocated(tmp_path / "ipam")) == sorted(given)
    assert len(store_handles(tmp_path / "ipam")) == len(ok)
    # after the kill everything works in-process
    after = exec_plugin(TABBY_IPAM, "ADD", conf, env=env("after-kill", sock))
    assert after.rc == 0, after


def test_other_version_is_refused_and_runs_in_process(
    node: tuple[Any, str], tmp_path: Path
) -> None:
    """A daemon of another version than the binary is not used."""
    from tabby_node.client import try_node

    _, sock = node
    conf = json.dumps(ipam_conf(str(tmp_path / "ipam"))).encode()
    e = {**env("v1", sock), "CNI_COMMAND": "ADD"}
    assert try_node("tabby-ipam", e, conf, "0.0.0-other") is None
    assert store_handles(tmp_path / "ipam") == []
    rc, out = try_node("tabby-ipam", e, conf, __import__("bundle").__version__) or (9, b"")
    assert rc == 0, out
    assert len(store_handles(tmp_path / "ipam")) == 1


# -- a wedged node never hangs the runtime (fake sockets) --------------------------------


class FakeNode:
    """A unix socket that accepts connections and answers as ``behave(conn)`` says."""

    def __init__(self, path: str, behave: Callable[[socket.socket], None]) -> None:
        self.path = path
        self.behave = behave
        self.release = threading.Event()
        self.connections = 0
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(path)
        self.sock.listen(8)
        self.sock.settimeout(0.1)
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while not self.release.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            self.connections += 1
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            try:
                self.behave(conn)
            except OSError:
                pass

    def read_request(self, conn: socket.socket) -> None:
        first, fds, _flags, _addr = socket.recv_fds(conn, 65536, 4)
        for fd in fds:
            os.close(fd)
        data = bytearray(first)
        while len(data) < 12:
            data += conn.recv(65536)
        hlen, slen = struct.unpack("!II", data[4:12])
        while len(data) < 12 + hlen + slen:
            chunk = conn.recv(65536)
            if not chunk:
                return
            data += chunk

    def close(self) -> None:
        self.release.set()
        self.sock.close()
        self.thread.join(5)


@pytest.fixture
def fake_node(tmp_path: Path) -> Iterator[Callable[[Callable[[socket.socket], None]], FakeNode]]:
    made: list[FakeNode] = []

    def make(behave: Callable[[socket.socket], None]) -> FakeNode:
        made.append(FakeNode(str(tmp_path / f"fake{len(made)}.sock"), behave))
        return made[-1]

    yield make
    for fake in made:
        fake.close()


def timed(binary: str, command: str, conf: dict[str, Any], e: dict[str, str]) -> tuple[Call, float]:
    t0 = time.monotonic()
    call = exec_plugin(binary, command, conf, env=e, timeout=120)
    return call, time.monotonic() - t0


@pytest.mark.parametrize("binary", [TABBY_IPAM, TABBY], ids=["tabby-ipam", "tabby"])
def test_silent_node_is_treated_as_absent(
    fake_node: Callable[[Callable[[socket.socket], None]], FakeNode],
    tmp_path: Path,
    binary: str,
) -> None:
    """A node that accepts the connection and never answers (wedged): after 2 s the binary
    works in-process, for ADD and DEL. (tabby's DEL execs tabby-ipam, which does not ask
    the silent node again: one wait of 2 s per call, not two.)"""

    def silent(conn: socket.socket) -> None:
        fake.read_request(conn)
        fake.release.wait(120)

    fake = fake_node(silent)
    conf = ipam_conf(str(tmp_path / "ipam"), lock_timeout_seconds=3)
    e = env("wedged", fake.path)
    call, elapsed = timed(TABBY_IPAM, "ADD", conf, e)
    print(f"ADD against a silent node: {elapsed:.2f} s")
    assert call.rc == 0, call
    assert len(store_handles(tmp_path / "ipam")) == 1
    call, elapsed = timed(binary, "DEL", conf, e)
    print(f"DEL against a silent node: {elapsed:.2f} s")
    assert call.rc == 0, call
    assert elapsed < 60
    assert store_handles(tmp_path / "ipam") == []
    assert fake.connections == 2


@pytest.mark.parametrize("command", ["ADD", "DEL"])
def test_accepted_then_stalled_is_code_11(
    fake_node: Callable[[Callable[[socket.socket], None]], FakeNode],
    tmp_path: Path,
    command: str,
) -> None:
    """A node that accepts the call and then stalls: code 11 after lock_timeout_seconds +
    5 s, never a hang, and the call is not also run in-process."""

    def stalls(conn: socket.socket) -> None:
        fake.read_request(conn)
        conn.sendall(b"A")
        fake.release.wait(120)

    fake = fake_node(stalls)
    conf = ipam_conf(str(tmp_path / "ipam"), lock_timeout_seconds=1)
    call, elapsed = timed(TABBY_IPAM, command, conf, env("stalled", fake.path))
    print(f"{command} against a stalled node: {elapsed:.2f} s")
    assert (call.rc, call.out["code"]) == (1, 11), call
    assert "6 s" in call.out["msg"]
    assert elapsed < 60
    assert store_handles(tmp_path / "ipam") == []


# -- stderr relay, stray connections, one node per run directory ---------------------------

STUB_IPAM = """#!/bin/sh
cat >/dev/null
echo "stub-ipam $CNI_COMMAND says hello on stderr" >&2
if [ "$CNI_COMMAND" = ADD ]; then
    echo '{"cniVersion": "1.1.0", "ips": [{"address": "'"$STUB_IP"'"}]}'
fi
"""


def test_delegate_stderr_reaches_the_caller_both_ways(
    node: tuple[Any, str], tmp_path: Path
) -> None:
    """A delegated (non-tabby) IPAM plugin's stderr reaches the runtime standalone and when
    tabby-node serves the call."""
    from tests.privileged.netns_util import netns_pool

    _, sock = node
    bindir = tmp_path / "cni-bin"
    bindir.mkdir()
    (bindir / "stub-ipam").write_text(STUB_IPAM)
    (bindir / "stub-ipam").chmod(0o755)
    conf = {
        "cniVersion": "1.1.0",
        "name": "relay-net",
        "type": "tabby",
        "nodename": "node-a",
        "log_file_path": str(tmp_path / "cni.log"),
        "ipam": {"type": "stub-ipam"},
    }
    with netns_pool() as pool:
        host = pool.node()
        fd = os.open(host.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            for n, via in enumerate(("off", sock)):
                pod = pool.pod()
                e = {
                    **env(f"relay{n}", via),
                    "CNI_NETNS": pod.path,
                    "CNI_PATH": str(bindir),
                    "STUB_IP": f"10.77.0.{n + 5}/32",
                }
                add = exec_plugin(TABBY, "ADD", conf, env=e, netns_fd=fd)
                assert add.rc == 0, add
                assert "stub-ipam ADD says hello on stderr" in add.stderr, (via, add)
                delete = exec_plugin(TABBY, "DEL", conf, env=e, netns_fd=fd)
                assert delete.rc == 0, delete
                assert "stub-ipam DEL says hello on stderr" in delete.stderr, (via, delete)
        finally:
            os.close(fd)


def test_stray_connections_are_not_errors(node: tuple[Any, str], tmp_path: Path) -> None:
    """Probes and callers that leave early are normal life: no ERROR, no traceback."""
    proc, sock = node
    for sent in (b"", b"TBY2\0\0"):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as c:
            c.connect(sock)
            if sent:
                c.sendall(sent)
    conf = ipam_conf(str(tmp_path / "ipam"))
    assert exec_plugin(TABBY_IPAM, "ADD", conf, env=env("after-probe", sock)).rc == 0
    time.sleep(0.5)  # the strays' threads are done long before; their lines are written
    assert proc.poll() is None
    text = (tmp_path / "node.log").read_text()
    assert "after-probe" in text or "ADD" in text
    assert " ERROR " not in text, text[-3000:]
    assert "Traceback" not in text, text[-3000:]


def test_second_node_on_the_same_socket_exits_with_one_line(
    node: tuple[Any, str], tmp_path: Path
) -> None:
    proc, sock = node
    second = IsolatedNode(
        [TABBY_NODE], str(tmp_path / "second"), sock, str(tmp_path / "second.log"), wait=False
    )
    try:
        rc = second.proc.wait(timeout=60)
    finally:
        err = second.stop()
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "another tabby-node is running in" in lines[0]
    assert proc.poll() is None
    assert (
        exec_plugin(TABBY_IPAM, "ADD", ipam_conf(str(tmp_path / "ipam")), env=env("x", sock)).rc
        == 0
    )
