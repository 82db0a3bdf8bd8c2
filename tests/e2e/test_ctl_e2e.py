"""The installed ``tabbyctl`` against real namespaces: the demo, and the IPAM views, checks and
GC of a node whose pods were added by the installed ``tabby``.

``tabbyctl`` runs as a subprocess; the ``ipam`` commands run inside the test's node namespace
(``ip netns exec <node> tabbyctl ...``) so they see that node's host veths and routes, as on
a real node. Every namespace is deleted even when a test fails (``NetnsPool``); the demo's
own namespaces are checked (and swept, if it failed) by its network name.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datastore.file import FileStore
from tests.e2e.conftest import CNI_BIN
from tests.e2e.test_pod_network import Runtime, addrs
from tests.privileged import netns_util
from tests.privileged.netns_util import Netns, NetnsPool

pytestmark = [pytest.mark.e2e, pytest.mark.privileged, pytest.mark.usefixtures("installed")]

TABBYCTL = os.environ.get("TABBYCTL_BIN", "/usr/local/bin/tabbyctl")
NETWORK = "e2e-ctl"
NOBODY = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups")


@pytest.fixture(scope="module", autouse=True)
def tabbyctl_installed() -> None:
    if not os.access(TABBYCTL, os.X_OK):
        pytest.fail(f"{TABBYCTL} is not installed: run ./build.sh --no-demo first")


def run_ctl(
    *args: str, netns: Netns | None = None, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    cmd = [TABBYCTL, *args]
    if netns is not None:
        cmd = ["ip", "netns", "exec", netns.name, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    assert "Traceback" not in proc.stdout + proc.stderr, proc
    return proc


class Node:
    """A node namespace with pods added by the installed tabby, and tabbyctl run there."""

    def __init__(self, pool: NetnsPool, tmp: Path) -> None:
        self.pool = pool
        self.rt = Runtime(pool, pool.node(), tmp, network=NETWORK)
        plugin = {k: v for k, v in self.rt.conf.items() if k not in ("name", "cniVersion")}
        self.conflist = tmp / "10-tabby.conflist"
        self.conflist.write_text(
            json.dumps(
                {"cniVersion": self.rt.conf["cniVersion"], "name": NETWORK, "plugins": [plugin]}
            )
        )
        self.pods: dict[str, tuple[Netns, dict[str, Any]]] = {}

    def add(self, cid: str) -> list[str]:
        pod = self.pool.pod()
        result = self.rt.add(cid, pod)
        self.pods[cid] = (pod, result)
        return self.ips(cid)

    def ips(self, cid: str) -> list[str]:
        result = self.pods[cid][1]
        return addrs(result, 4) + addrs(result, 6)

    def veth(self, cid: str) -> str:
        return str(self.pods[cid][1]["interfaces"][0]["name"])

    def ctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return run_ctl("--conf", str(self.conflist), *args, netns=self.rt.node)

    def json(self, *args: str) -> tuple[int, Any]:
        proc = self.ctl(*args, "-o", "json")
        return proc.returncode, json.loads(proc.stdout)

    def delete_all(self) -> None:
        for cid, (pod, _) in self.pods.items():
            netns = pod.path if os.path.exists(pod.path) else None
            self.rt.call("DEL", cid, netns)


@pytest.fixture
def pool() -> Iterator[NetnsPool]:
    with netns_util.netns_pool() as p:
        yield p


@pytest.fixture
def node(pool: NetnsPool, tmp_path: Path) -> Iterator[Node]:
    n = Node(pool, tmp_path)
    try:
        yield n
    finally:
        n.delete_all()


def hid(cid: str) -> str:
    return f"{NETWORK}:{cid}:eth0"


def node_findings(data: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["kind"], f["subject"]) for f in data["node"]}


# == the demo ================================================================================


def demo_state() -> tuple[set[str], set[str], set[str]]:
    """tabby-demo-* namespaces and temp dirs, and cali* links of the host netns."""
    netns = {n for n in netns_util.list_netns() if n.startswith("tabby-demo-")}
    dirs = set(glob.glob(os.path.join(tempfile.gettempdir(), "tabby-demo-*")))
    links = netns_util.run("ip", "-o", "link", "show").stdout.splitlines()
    cali = {line.split(":")[1].strip().split("@")[0] for line in links}
    return netns, dirs, {n for n in cali if n.startswith("cali")}


def sweep_demo(network: str) -> list[str]:
    """Remove what a failed demo run left (only its own, by its network name)."""
    left = []
    for name in netns_util.list_netns():
        if name.startswith(network + "-"):
            netns_util.run("ip", "netns", "del", name, check=False)
            left.append(name)
    for d in glob.glob(os.path.join(tempfile.gettempdir(), network + "-*")):
        shutil.rmtree(d, ignore_errors=True)
        left.append(d)
    return left


def processes_mentioning(text: str) -> list[int]:
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if text.encode() in f.read():
                    found.append(int(entry))
        except OSError:
            continue
    return found


def assert_demo_left_nothing(out: str, before: tuple[set[str], set[str], set[str]]) -> None:
    m = re.search(r"tabby demo (tabby-demo-[0-9a-f]+):", out)
    assert m, out
    network = m.group(1)
    # no process of the demo (its tabby-node runs with the demo's workdir in its argv)
    deadline = time.monotonic() + 10
    while processes_mentioning(network) and time.monotonic() < deadline:
        time.sleep(0.1)
    stray = processes_mentioning(network)
    for pid in stray:  # ours (the network name is in its argv): stopped even as we fail
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    left = sweep_demo(network)
    assert stray == [], f"the demo left processes {stray} running"
    assert left == [], f"the demo left {left}"
    netns, dirs, cali = demo_state()
    assert netns <= before[0], netns - before[0]
    assert dirs <= before[1], dirs - before[1]
    assert cali <= before[2], cali - before[2]
    assert "left behind" not in out


@pytest.mark.parametrize("flags", [[], ["--no-node"]], ids=["with-node", "in-process"])
def test_demo_three_pods_passes_and_leaves_nothing(flags: list[str]) -> None:
    before = demo_state()
    proc = run_ctl("demo", "--pods", "3", *flags, timeout=600)
    out = proc.stdout
    try:
        assert proc.returncode == 0, out + proc.stderr
        assert out.rstrip().endswith("demo passed"), out
        assert len(re.findall(r"\[\d/3\] pod\d", out)) == 3
        assert "CHECK passed for 3 pods" in out
        # 3 pods x 2 others x 2 families, and node -> 3 pods x 2 families
        assert len(re.findall(r" ok$", out, re.M)) == 12 + 6, out
        assert "UNREACHABLE" not in out
        assert out.count("demo/pod") == 6  # the IPAM view lists every address
        assert "DEL: every pod removed" in out
        if not flags and shutil.which("tabby-node"):
            assert "tabby-node (pid" in out
    finally:
        assert_demo_left_nothing(out, before)


FAILURES = {
    # pod2's ADD fails with a CNI error
    "error": (
        'echo \'{"cniVersion": "1.1.0", "code": 100, "msg": "injected"}\'; exit 1',
        "ADD pod2 failed: ",
    ),
    # pod2's ADD "succeeds" but prints no result
    "garbage": ("echo injected; exit 0", "ADD pod2 printed no CNI result: "),
}


@pytest.mark.parametrize("failure", sorted(FAILURES))
def test_demo_failure_cleans_up(tmp_path: Path, failure: str) -> None:
    """pod1 is networked for real, pod2's ADD fails: the demo says so, exits 1 and still
    removes pod1's veth, address and every namespace."""
    action, message = FAILURES[failure]
    bindir = tmp_path / "bin"
    bindir.mkdir()
    fake = bindir / "tabby"
    fake.write_text(
        "#!/bin/sh\n"
        'case "$CNI_COMMAND:$CNI_CONTAINERID" in\n'
        f"  ADD:*-pod2) {action} ;;\n"
        "esac\n"
        f'exec {CNI_BIN}/tabby "$@"\n'
    )
    fake.chmod(0o755)
    (bindir / "tabby-ipam").symlink_to(os.path.join(CNI_BIN, "tabby-ipam"))
    before = demo_state()
    proc = run_ctl("demo", "--pods", "3", "--no-node", "--cni-bin-dir", str(bindir), timeout=300)
    out = proc.stdout
    try:
        assert proc.returncode == 1, out + proc.stderr
        assert "[1/3] pod1" in out
        assert f"demo failed: {message}" in out
        assert "injected" in out
        assert "DEL: every pod removed" in out
        assert out.rstrip().endswith("demo FAILED")
    finally:
        assert_demo_left_nothing(out, before)


@pytest.mark.parametrize(
    ("flags", "when"),
    [
        (["--no-node"], "[1/6]"),  # while pod2's namespace is being made
        ([], "tabby demo "),  # right at the start (tabby-node starting)
        ([], "[2/6]"),  # with tabby-node serving
    ],
    ids=["pods", "early", "node-serving"],
)
def test_demo_sigterm_cleans_up(flags: list[str], when: str) -> None:
    """SIGTERM in the middle (as Ctrl-C): the same cleanup, exit status 130."""
    before = demo_state()
    proc = subprocess.Popen(
        [TABBYCTL, "demo", "--pods", "6", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = ""
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            out += line
            if when in line:
                proc.send_signal(signal.SIGTERM)
                break
        rest, err = proc.communicate(timeout=300)
        out += rest
        assert proc.returncode == 130, out + err
        assert "interrupted: cleaning up" in out
        assert "Traceback" not in out + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert_demo_left_nothing(out, before)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["TERM", "INT"])
@pytest.mark.parametrize("delay_ms", [0, 10, 25, 50, 100, 200, 400])
def test_demo_signal_at_any_moment_leaves_nothing(sig: int, delay_ms: int) -> None:
    """A signal a few ms after the demo starts lands inside the start of tabby-node or of an
    `ip netns add`: no process, namespace, veth or directory may outlive the demo. (CI once
    caught a tabby-node left running when SIGTERM came while it was being spawned.)"""
    before = demo_state()
    proc = subprocess.Popen(
        [TABBYCTL, "demo", "--pods", "2"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    out = ""
    try:
        assert proc.stdout is not None
        out = proc.stdout.readline()  # the banner: the workdir exists, the network is named
        time.sleep(delay_ms / 1000)
        proc.send_signal(sig)
        rest, err = proc.communicate(timeout=300)
        out += rest
        # a late signal may find the demo already done (then it passed)
        assert proc.returncode in (0, 130), out + err
        assert ("interrupted: cleaning up" in out) == (proc.returncode == 130), out
        assert "Traceback" not in out + err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        assert_demo_left_nothing(out, before)


# == ipam show / check / gc on a real node ===================================================


def test_show_json_after_two_adds_lists_both_pods(node: Node) -> None:
    """Acceptance: after two ADDs, `ipam show -o json` lists both addresses with their pods."""
    a = node.add("pod-a")
    b = node.add("pod-b")
    rc, data = node.json("ipam", "show")
    assert rc == 0
    assert data["store"] == f"file store {node.rt.data_dir}"
    listed: dict[str, list[str]] = {}
    for alloc in data["allocations"]:
        listed.setdefault(alloc["pod"], []).append(alloc["ip"])
        assert alloc["node"] == "node-a"
        assert alloc["network"] == NETWORK
    assert {k: sorted(v) for k, v in listed.items()} == {
        "e2e/pod-a": sorted(a),
        "e2e/pod-b": sorted(b),
    }
    assert {p["cidr"]: p["in_use"] for p in data["pools"]} == {
        "10.244.0.0/16": 2,
        "fd00:10:244::/48": 2,
    }
    table = node.ctl("ipam", "show", "--show-blocks")
    assert table.returncode == 0
    for ip in a:
        assert re.search(rf"^{re.escape(ip)}\s+node-a\s+e2e/pod-a\s+eth0\s", table.stdout, re.M)
    assert "host:node-a" in table.stdout
    rc, owner = node.json("ipam", "show", "--ip", b[0])
    assert (rc, owner["pod"], owner["handle"]) == (0, "e2e/pod-b", hid("pod-b"))
    assert owner["netns"] == node.pods["pod-b"][0].path
    # a healthy node: the real veths, routes and namespaces match the store
    check = node.ctl("ipam", "check")
    assert check.returncode == 0, check.stdout + check.stderr
    assert check.stdout.startswith("no problems found")
    node.delete_all()
    node.pods.clear()
    rc, data = node.json("ipam", "show")
    assert (rc, data["allocations"]) == (0, [])


def test_check_finds_a_deleted_netns_and_a_removed_host_veth(node: Node, pool: NetnsPool) -> None:
    node.add("pod-a")
    b = node.add("pod-b")
    c = node.add("pod-c")
    rc, data = node.json("ipam", "check")
    assert (rc, data["ok"], data["node"], data["store"]) == (0, True, [], [])

    pool.delete(node.pods["pod-b"][0])  # the pod's netns is deleted (and its veth with it)
    rc, data = node.json("ipam", "check")
    assert rc == 1
    assert data["ok"] is False
    assert node_findings(data) == {
        ("netns-gone", hid("pod-b")),
        ("host-veth-gone", hid("pod-b")),
    }
    assert all(ip in " ".join(f["message"] for f in data["node"]) for ip in b)

    node.rt.node.ip("link", "del", node.veth("pod-c"))  # pod-c's host veth removed
    rc, data = node.json("ipam", "check")
    assert rc == 1
    assert node_findings(data) == {
        ("netns-gone", hid("pod-b")),
        ("host-veth-gone", hid("pod-b")),
        ("host-veth-gone", hid("pod-c")),
    }
    message = next(f["message"] for f in data["node"] if f["subject"] == hid("pod-c"))
    assert node.veth("pod-c") in message
    assert c[0] in message
    table = node.ctl("ipam", "check")
    assert table.returncode == 1
    assert re.search(rf"^node\s+host-veth-gone\s+{re.escape(hid('pod-c'))}\s", table.stdout, re.M)
    assert re.search(rf"^node\s+netns-gone\s+{re.escape(hid('pod-b'))}\s", table.stdout, re.M)


def test_check_finds_a_live_pods_lost_allocation(node: Node) -> None:
    """An allocation whose block entry is gone while the pod lives: the store holds no other
    record of it, the node shows the host route with no allocation behind it: exit 1."""
    a = node.add("pod-a")
    node.add("pod-b")
    store = FileStore(str(node.rt.data_dir))
    rc, owner = node.json("ipam", "show", "--ip", a[0])
    block = owner["block"]
    with store.lock():
        doc = store.get("block", block)
        assert doc is not None
        ordinal = next(
            o for o, x in enumerate(doc.data["allocations"]) if x and x["handle"] == hid("pod-a")
        )
        doc.data["allocations"][ordinal] = None
        doc.data["unallocated"].append(ordinal)
        store.put("block", block, doc.data, doc.revision)
    rc, data = node.json("ipam", "check")
    assert rc == 1
    assert data["store"] == []
    assert node_findings(data) == {("route-without-allocation", node.veth("pod-a"))}
    assert a[0] in data["node"][0]["message"]


def _hold_netns(pod: Netns) -> subprocess.Popen[bytes]:
    """A process inside the pod netns, so it outlives `ip netns del` (path gone, veth up)."""
    proc = subprocess.Popen(["ip", "netns", "exec", pod.name, "sleep", "300"])
    want = f"net:[{os.stat(pod.path).st_ino}]"
    deadline = time.monotonic() + 10
    while True:
        try:
            if os.readlink(f"/proc/{proc.pid}/ns/net") == want:
                return proc
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise AssertionError("the holder did not enter the pod netns")
        time.sleep(0.02)


def test_gc_releases_exactly_the_gone_pods_addresses(node: Node, pool: NetnsPool) -> None:
    gone = node.add("gone")
    node.add("netns-alive")
    node.add("veth-alive")
    node.add("alive")
    holder = _hold_netns(node.pods["veth-alive"][0])
    try:
        # gone: netns deleted, and its host veth with it -> released
        pool.delete(node.pods["gone"][0])
        # veth gone, netns still there -> kept
        node.rt.node.ip("link", "del", node.veth("netns-alive"))
        # netns path gone, namespace (and veth) alive -> kept
        pool.delete(node.pods["veth-alive"][0])
        assert node.veth("veth-alive") in node.rt.node.links()

        # everything is younger than the default grace period (60 s)
        rc, data = node.json("ipam", "gc")
        assert (rc, data) == (0, {"dry_run": False, "released": {}})
        proc = node.ctl("ipam", "gc")
        assert proc.stdout.strip() == "no leaked allocations on node node-a"

        rc, data = node.json("ipam", "gc", "--grace", "0", "--dry-run")
        assert rc == 0
        assert {k: sorted(v) for k, v in data["stale"].items()} == {hid("gone"): sorted(gone)}
        rc, shown = node.json("ipam", "show")
        assert len(shown["allocations"]) == 8  # dry run: nothing released

        rc, data = node.json("ipam", "gc", "--grace", "0")
        assert rc == 0
        assert {k: sorted(v) for k, v in data["released"].items()} == {hid("gone"): sorted(gone)}
        rc, shown = node.json("ipam", "show")
        left = sorted(a["ip"] for a in shown["allocations"])
        assert left == sorted(node.ips("netns-alive") + node.ips("veth-alive") + node.ips("alive"))
        assert node.ctl("ipam", "gc", "--grace", "0").stdout.strip() == (
            "no leaked allocations on node node-a"
        )
    finally:
        holder.kill()
        holder.wait()


def test_not_root_is_told_to_run_as_root(node: Node) -> None:
    """The store is root's (0700): a plain user gets one line naming it and the remedy."""
    if shutil.which("setpriv") is None:
        pytest.skip("setpriv (util-linux) is not installed")
    assert node.ctl("pool", "add", "10.244.0.0/16").returncode == 0
    public = Path(tempfile.mkdtemp(prefix="tabbyctl-e2e-"))
    try:
        public.chmod(0o755)
        conf = public / "10-tabby.conflist"
        shutil.copy(node.conflist, conf)
        conf.chmod(0o644)
        proc = subprocess.run(
            [*NOBODY, TABBYCTL, "--conf", str(conf), "ipam", "show"],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        shutil.rmtree(public)
    assert proc.returncode == 1, proc
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert str(node.rt.data_dir) in lines[0]
    assert lines[0].endswith("Permission denied: run tabbyctl as root"), lines[0]
