"""Shared helpers for tests that exec the installed binaries as a runtime would."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Mapping
from typing import Any

import pytest

from tests.node_agent import IsolatedNode

CNI_BIN = os.environ.get("TABBY_CNI_BIN", "/opt/cni/bin")
TABBY_NODE = os.environ.get("TABBY_NODE_BIN", "/usr/local/bin/tabby-node")
# Not under /run/tabby: the runtime tier gives its node a private /run/tabby.
NODE_SOCKET_DIR = "/run/tabby-e2e-node"
TABBY = os.path.join(CNI_BIN, "tabby")
TABBY_IPAM = os.path.join(CNI_BIN, "tabby-ipam")
PLUGINS = (TABBY, TABBY_IPAM)


class Call:
    """One finished plugin exec: exit status, parsed stdout, raw stderr."""

    def __init__(self, rc: int, stdout: bytes, stderr: bytes) -> None:
        self.rc = rc
        self.raw = stdout
        self.stderr = stderr.decode(errors="replace")
        text = stdout.decode(errors="replace").strip()
        # GEN-5 (cni_protocol/CONFORMANCE.md): stdout is one JSON document or nothing.
        self.out: Any = json.loads(text) if text else None

    def __repr__(self) -> str:
        return f"Call(rc={self.rc}, out={self.out!r}, stderr={self.stderr[-500:]!r})"


def exec_plugin(
    binary: str,
    command: str,
    conf: Mapping[str, Any] | bytes,
    *,
    env: Mapping[str, str] | None = None,
    netns_fd: int | None = None,
    timeout: float = 60,
) -> Call:
    """Exec ``binary`` like libcni: CNI_* env, config on stdin, optionally inside a netns."""
    full_env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": command,
        "TABBY_NODE_SOCKET": os.environ.get("TABBY_NODE_SOCKET", "off"),
    }
    full_env.update(env or {})
    stdin = conf if isinstance(conf, bytes) else json.dumps(conf).encode()
    preexec = None
    if netns_fd is not None:
        from dataplane.netns import setns

        fd = netns_fd

        def preexec() -> None:
            setns(fd)

    proc = subprocess.run(
        [binary],
        input=stdin,
        env=full_env,
        capture_output=True,
        timeout=timeout,
        check=False,
        preexec_fn=preexec,
        pass_fds=(netns_fd,) if netns_fd is not None else (),
    )
    call = Call(proc.returncode, proc.stdout, proc.stderr)
    assert "Traceback" not in call.stderr, call
    return call


@pytest.fixture(scope="session")
def installed() -> None:
    for p in PLUGINS:
        if not os.access(p, os.X_OK):
            pytest.fail(f"{p} is not installed: run ./build.sh --no-demo first")


def ipam_conf(
    data_dir: str,
    version: str = "1.1.0",
    *,
    name: str = "e2e-net",
    node: str = "node-a",
    **ipam: Any,
) -> dict[str, Any]:
    return {
        "cniVersion": version,
        "name": name,
        "type": "tabby",
        "nodename": node,
        "log_file_path": os.path.join(os.path.dirname(data_dir), "cni.log"),
        "ipam": {
            "type": "tabby-ipam",
            "data_dir": data_dir,
            "ipv4_pools": ["10.244.0.0/16"],
            "ipv6_pools": ["fd00:10:244::/48"],
            **ipam,
        },
    }


def run_cmd(*cmd: str, check: bool = True) -> str:
    proc = subprocess.run(list(cmd), capture_output=True, text=True, check=False)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd}: {proc.stderr}")
    return proc.stdout


_ISOLATED: dict[int, IsolatedNode] = {}


def start_tabby_node(socket_path: str, log_path: str) -> subprocess.Popen[bytes]:
    """Start tabby-node (in a namespace of its own, tests/node_agent.py) on its own socket
    and wait until it serves."""
    node = IsolatedNode([TABBY_NODE], os.path.dirname(log_path), socket_path, log_path)
    _ISOLATED[node.pid] = node
    return node.proc


def stop_tabby_node(proc: subprocess.Popen[bytes]) -> str:
    """SIGTERM by PID (then SIGKILL); its namespace deleted; returns what it printed on
    stderr."""
    node = _ISOLATED.pop(proc.pid, None)
    assert node is not None, "not started by start_tabby_node"
    return node.stop()


@pytest.fixture(scope="session", autouse=True)
def tabby_node_mode() -> Iterator[None]:
    """TABBY_E2E_NODE=1: the whole e2e tier runs with tabby-node serving the calls.

    Every runtime here passes its environment to the plugins, so TABBY_NODE_SOCKET
    reaches them. At the end the node must have served calls, or the run proved nothing.
    """
    if os.environ.get("TABBY_E2E_NODE") != "1":
        yield
        return
    sock = os.path.join(NODE_SOCKET_DIR, "node.sock")
    proc = start_tabby_node(sock, os.path.join(NODE_SOCKET_DIR, "node.log"))
    old = os.environ.get("TABBY_NODE_SOCKET")
    os.environ["TABBY_NODE_SOCKET"] = sock
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("TABBY_NODE_SOCKET", None)
        else:
            os.environ["TABBY_NODE_SOCKET"] = old
        err = stop_tabby_node(proc)
    served = [line for line in err.splitlines() if "stopped after" in line]
    assert served, f"tabby-node did not report: {err[-2000:]}"
    assert " 0 calls" not in served[-1], "TABBY_E2E_NODE=1 but tabby-node served no call"


@contextlib.contextmanager
def store_lock_held(lock_path: str) -> Iterator[None]:
    """Another process holds the IPAM store's flock for the duration."""
    holder = subprocess.Popen(
        [
            "python3",
            "-c",
            "import fcntl,sys,time;f=open(sys.argv[1],'a');"
            "fcntl.flock(f,fcntl.LOCK_EX);print('held',flush=True);time.sleep(60)",
            lock_path,
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None
        assert holder.stdout.readline().strip() == b"held"
        yield
    finally:
        holder.kill()
        holder.wait()
        if holder.stdout is not None:
            holder.stdout.close()
