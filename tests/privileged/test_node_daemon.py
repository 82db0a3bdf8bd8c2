"""tabby-node as a process (root): a delegated IPAM plugin's stderr reaches the caller both
standalone and through the node, a second node on the same run directory exits, and once
tabby-node stopped (its table kept, as for a restart) an ADD it does not serve is refused
rather than started into a table that would drop its traffic.

The plugin runs as a runtime would run it (a process in a "node" network namespace, with
the pod in its own namespace); the node is this checkout's tabby-node in a subprocess.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.node_agent import IsolatedNode
from tests.privileged.netns_util import NetnsPool, Node, netns_pool

pytestmark = pytest.mark.privileged

ROOT = Path(__file__).resolve().parents[2]
PLUGIN = [sys.executable, "-c", "from bundle.entry import main; main()"]
NODE = [sys.executable, "-c", "from bundle.entry import main_node; main_node()"]

STUB = """#!{python}
import json, os, sys
sys.stdin.buffer.read()
command = os.environ["CNI_COMMAND"]
sys.stderr.write(f"stub-ipam {{command}} says hello on stderr\\n")
if os.environ.get("STUB_MODE") == "error":
    print(json.dumps({{"cniVersion": "1.1.0", "code": 11, "msg": "stub is busy"}}))
    sys.exit(1)
if command == "ADD":
    print(json.dumps({{"cniVersion": "1.1.0", "ips": [{{"address": os.environ["STUB_IP"]}}]}}))
"""


@pytest.fixture
def pool() -> Iterator[NetnsPool]:
    with netns_pool() as p:
        yield p


@pytest.fixture
def cni_path(tmp_path: Path) -> str:
    bindir = tmp_path / "cni-bin"
    bindir.mkdir()
    script = bindir / "stub-ipam"
    script.write_text(STUB.format(python=sys.executable))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(bindir)


class NodeProcess(IsolatedNode):
    """tabby-node from this checkout, in a namespace of its own (tests/node_agent.py)."""

    def __init__(self, sock: str, log: str, *, wait: bool = True) -> None:
        super().__init__(NODE, os.path.dirname(log), sock, log, cwd=ROOT, wait=wait)
        self.sock = sock


@pytest.fixture
def tabby_node(tmp_path: Path) -> Iterator[NodeProcess]:
    node = NodeProcess(str(tmp_path / "run" / "node.sock"), str(tmp_path / "node.log"))
    try:
        yield node
    finally:
        node.stop()


def run_plugin(
    node: Node | str, command: str, conf: dict[str, Any], env: dict[str, str]
) -> subprocess.CompletedProcess[bytes]:
    """Exec the plugin inside the node namespace (or the one at that path), as a runtime on
    that node would."""
    from dataplane.netns import setns

    fd = os.open(node if isinstance(node, str) else node.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        return subprocess.run(
            PLUGIN,
            input=json.dumps(conf).encode(),
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "CNI_COMMAND": command, **env},
            cwd=ROOT,
            capture_output=True,
            timeout=60,
            check=False,
            preexec_fn=lambda: setns(fd),
            pass_fds=(fd,),
        )
    finally:
        os.close(fd)


def conf_for(tmp_path: Path) -> dict[str, Any]:
    return {
        "cniVersion": "1.1.0",
        "name": "relay-net",
        "type": "tabby",
        "nodename": "node-a",
        "log_file_path": str(tmp_path / "cni.log"),
        "ipam": {"type": "stub-ipam"},
    }


def add_and_del(
    pool: NetnsPool, tmp_path: Path, cni_path: str, sock: str, cid: str, ip: str
) -> tuple[str, str]:
    node = pool.node()
    pod = pool.pod()
    env = {
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": pod.path,
        "CNI_IFNAME": "eth0",
        "CNI_PATH": cni_path,
        "TABBY_NODE_SOCKET": sock,
        "STUB_IP": ip,
    }
    conf = conf_for(tmp_path)
    add = run_plugin(node, "ADD", conf, env)
    assert add.returncode == 0, add
    assert json.loads(add.stdout)["ips"][0]["address"] == ip
    assert ip.split("/")[0] in pod.ip("-4", "addr", "show", "dev", "eth0").stdout
    delete = run_plugin(node, "DEL", conf, env)
    assert delete.returncode == 0, delete
    return add.stderr.decode(), delete.stderr.decode()


def test_delegate_stderr_reaches_the_caller_standalone_and_through_the_node(
    pool: NetnsPool, tmp_path: Path, cni_path: str, tabby_node: NodeProcess
) -> None:
    alone = add_and_del(pool, tmp_path, cni_path, "off", "relay-alone", "10.77.0.5/32")
    served = add_and_del(pool, tmp_path, cni_path, tabby_node.sock, "relay-node", "10.77.0.6/32")
    for add_err, del_err in (alone, served):
        assert "stub-ipam ADD says hello on stderr\n" in add_err
        assert "stub-ipam DEL says hello on stderr\n" in del_err
    node_stderr = tabby_node.stop()
    assert "stopped after 2 calls" in node_stderr  # the node did serve the second pair
    assert "says hello" not in node_stderr  # relayed, not left on the daemon's stderr


def test_tabby_errors_reach_the_caller_standalone_and_through_the_node(
    pool: NetnsPool, tmp_path: Path, cni_path: str, tabby_node: NodeProcess
) -> None:
    """tabby's own error line for a failed call goes to stderr both ways."""
    node = pool.node()
    pod = pool.pod()
    for sock in ("off", tabby_node.sock):
        env = {
            "CNI_CONTAINERID": "relay-err",
            "CNI_NETNS": pod.path,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": cni_path,
            "TABBY_NODE_SOCKET": sock,
            "STUB_MODE": "error",
        }
        add = run_plugin(node, "ADD", conf_for(tmp_path), env)
        assert add.returncode == 1
        assert json.loads(add.stdout)["code"] == 11
        err = add.stderr.decode()
        assert "stub-ipam ADD says hello on stderr\n" in err, sock
        assert "ERROR" in err, (sock, err)
        assert "stub is busy" in err, (sock, err)
        assert "Traceback" not in err


def test_second_node_on_the_same_socket_exits_with_one_line(
    tmp_path: Path, tabby_node: NodeProcess
) -> None:
    second = NodeProcess(tabby_node.sock, str(tmp_path / "second" / "node.log"), wait=False)
    try:
        rc = second.proc.wait(timeout=60)
    finally:
        err = second.stop()
    assert rc == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert "another tabby-node is running in" in lines[0]
    assert tabby_node.proc.poll() is None  # the first one serves on
    assert os.path.exists(tabby_node.sock)


def test_an_add_after_tabby_node_stopped_is_refused_while_its_table_is_there(
    pool: NetnsPool, tmp_path: Path, cni_path: str, tabby_node: NodeProcess
) -> None:
    """tabby-node served an ADD in its namespace (the "node"); stopped (SIGTERM, not in
    Kubernetes: a restart), it keeps its table ``inet tabby``, which drops every pod
    interface it has no rules for. The next ADD, made in-process, is refused with code 11
    before IPAM is asked and before any interface exists; DEL still works; with the table
    removed, in-process ADDs network pods again (without policy)."""
    netns = f"/run/netns/{tabby_node.netns}"
    pod = pool.pod()
    conf = conf_for(tmp_path)

    def env(cid: str, ip: str) -> dict[str, str]:
        return {
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": pod.path,
            "CNI_IFNAME": "eth0",
            "CNI_PATH": cni_path,
            "TABBY_NODE_SOCKET": tabby_node.sock,
            "STUB_IP": ip,
        }

    served = run_plugin(netns, "ADD", conf, env("served", "10.77.0.7/32"))
    assert served.returncode == 0, served
    assert run_plugin(netns, "DEL", conf, env("served", "10.77.0.7/32")).returncode == 0
    tabby_node.proc.send_signal(signal.SIGTERM)
    assert tabby_node.proc.wait(timeout=30) == 0
    table = ["ip", "netns", "exec", tabby_node.netns, "nft", "list", "table", "inet", "tabby"]
    kept = subprocess.run(table, capture_output=True, text=True, check=False)
    assert kept.returncode == 0, kept.stderr  # a stop is not an uninstall: the table stays
    assert 'drop comment "unknown cali* interface"' in kept.stdout

    refused = run_plugin(netns, "ADD", conf, env("unserved", "10.77.0.8/32"))
    assert refused.returncode == 1, refused
    answer = json.loads(refused.stdout)
    assert answer["code"] == 11, answer
    assert "tabby-node is not running" in answer["msg"]
    err = refused.stderr.decode()
    assert "stub-ipam ADD" not in err  # IPAM was never asked
    assert "Traceback" not in err
    assert "eth0" not in pod.ip("-o", "link", "show").stdout
    deleted = run_plugin(netns, "DEL", conf, env("unserved", "10.77.0.8/32"))
    assert deleted.returncode == 0, deleted

    drop = ["ip", "netns", "exec", tabby_node.netns, "nft", "delete", "table", "inet", "tabby"]
    subprocess.run(drop, check=True)
    alone = run_plugin(netns, "ADD", conf, env("unserved", "10.77.0.8/32"))
    assert alone.returncode == 0, alone
    assert "10.77.0.8" in pod.ip("-4", "addr", "show", "dev", "eth0").stdout
    assert run_plugin(netns, "DEL", conf, env("unserved", "10.77.0.8/32")).returncode == 0
