"""tabby-node: the fast path, its refusals, and its death in the middle of a stream of ADDs."""

from __future__ import annotations

import json
import os
import random
import signal
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import (
    TABBY_IPAM,
    Call,
    exec_plugin,
    ipam_conf,
    start_tabby_node,
    stop_tabby_node,
)
from tests.e2e.test_ipam_binary import allocated, store_handles

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
    import socket

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
    from cni_plugin.node.client import try_node

    _, sock = node
    conf = json.dumps(ipam_conf(str(tmp_path / "ipam"))).encode()
    e = {**env("v1", sock), "CNI_COMMAND": "ADD"}
    assert try_node("tabby-ipam", e, conf, "0.0.0-other") is None
    assert store_handles(tmp_path / "ipam") == []
    rc, out = try_node("tabby-ipam", e, conf, __import__("cni_plugin").__version__) or (9, b"")
    assert rc == 0, out
    assert len(store_handles(tmp_path / "ipam")) == 1
