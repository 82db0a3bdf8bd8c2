"""The installed ``tabby`` wires real pods, exec'd inside a "node" namespace as a runtime would.

Each test builds its own node and pod namespaces (deleted even on failure) and a private
IPAM store. The docstrings name the rules of cni_protocol/CONFORMANCE.md they check.
"""

from __future__ import annotations

import copy
import ipaddress
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.e2e.conftest import TABBY, TABBY_IPAM, Call, exec_plugin, store_lock_held
from tests.privileged import netns_util
from tests.privileged.netns_util import Netns, NetnsPool, Node

pytestmark = [pytest.mark.e2e, pytest.mark.privileged, pytest.mark.usefixtures("installed")]

V4_POOL = "10.244.0.0/16"
V6_POOL = "fd00:10:244::/48"


class Runtime:
    """A minimal libcni: execs tabby in the node namespace, caches ADD results."""

    def __init__(
        self,
        pool: NetnsPool,
        node: Node,
        tmp: Path,
        *,
        v4: bool = True,
        v6: bool = True,
        network: str = "e2e-pods",
        **ipam: Any,
    ) -> None:
        self.pool = pool
        self.node = node
        self.tmp = tmp
        self.data_dir = tmp / "ipam"
        self.conf: dict[str, Any] = {
            "cniVersion": "1.1.0",
            "name": network,
            "type": "tabby",
            "nodename": "node-a",
            "log_file_path": str(tmp / "cni.log"),
            "log_level": "debug",
            "ipam": {
                "type": "tabby-ipam",
                "data_dir": str(self.data_dir),
                "assign_ipv4": v4,
                "assign_ipv6": v6,
                "ipv4_pools": [V4_POOL],
                "ipv6_pools": [V6_POOL],
                **ipam,
            },
        }
        self.cache: dict[tuple[str, str], dict[str, Any]] = {}
        #: added to every call's environment (e.g. a tabby-node's socket)
        self.env: dict[str, str] = {}

    def call(
        self,
        command: str,
        cid: str,
        netns: str | None,
        *,
        ifname: str = "eth0",
        version: str | None = None,
        prev: bool = True,
        extra: dict[str, Any] | None = None,
        binary: str = TABBY,
    ) -> Call:
        conf = copy.deepcopy(self.conf)
        if version:
            conf["cniVersion"] = version
        if prev and command != "ADD" and (cid, ifname) in self.cache:
            conf["prevResult"] = self.cache[(cid, ifname)]
        conf.update(extra or {})
        env = {
            "CNI_CONTAINERID": cid,
            "CNI_IFNAME": ifname,
            "CNI_PATH": os.path.dirname(TABBY),
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=e2e;K8S_POD_NAME={cid}",
            **self.env,
        }
        if netns is not None:
            env["CNI_NETNS"] = netns
        fd = os.open(self.node.path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            call = exec_plugin(binary, command, conf, env=env, netns_fd=fd)
        finally:
            os.close(fd)
        if command == "ADD" and call.rc == 0:
            self.cache[(cid, ifname)] = call.out
        if command == "DEL" and call.rc == 0:
            self.cache.pop((cid, ifname), None)
        return call

    def add(self, cid: str, pod: Netns, **kw: Any) -> dict[str, Any]:
        call = self.call("ADD", cid, pod.path, **kw)
        assert call.rc == 0, call
        out: dict[str, Any] = call.out
        return out

    def handles(self) -> list[str]:
        """The attachments holding an address (the handle of each allocation)."""
        from tests.e2e.test_ipam_binary import store_handles

        return store_handles(self.data_dir)

    def host_veths(self) -> list[str]:
        return [n for n in self.node.links() if n.startswith("cali")]

    def host_routes(self) -> str:
        return (
            self.node.ip("-4", "route", "show").stdout + self.node.ip("-6", "route", "show").stdout
        )


@pytest.fixture
def pool() -> Iterator[NetnsPool]:
    with netns_util.netns_pool() as p:
        yield p


@pytest.fixture
def rt(pool: NetnsPool, tmp_path: Path) -> Runtime:
    return Runtime(pool, pool.node(), tmp_path)


def addrs(result: dict[str, Any], version: int) -> list[str]:
    return [
        ip["address"].split("/")[0]
        for ip in result["ips"]
        if ipaddress.ip_interface(ip["address"]).version == version
    ]


def assert_clean(rt: Runtime) -> None:
    assert rt.host_veths() == []
    assert "cali" not in rt.host_routes()
    assert rt.handles() == []


def test_two_pods_dual_stack_reach_each_other(rt: Runtime, pool: NetnsPool) -> None:
    """Acceptance: two pods from one /26 and one /122 ping each other over both families,
    the node reaches each, CHECK passes, DEL leaves nothing (ADD-1, ADD-3, CHK-8, DEL-1)."""
    p1, p2 = pool.pod(), pool.pod()
    r1, r2 = rt.add("pod-a", p1), rt.add("pod-b", p2)
    v4 = [ipaddress.ip_address(a) for a in addrs(r1, 4) + addrs(r2, 4)]
    v6 = [ipaddress.ip_address(a) for a in addrs(r1, 6) + addrs(r2, 6)]
    assert len(v4) == len(v6) == 2
    assert len({ipaddress.ip_network(f"{a}/26", strict=False) for a in v4}) == 1
    assert len({ipaddress.ip_network(f"{a}/122", strict=False) for a in v6}) == 1
    assert all(a in ipaddress.ip_network(V4_POOL) for a in v4)
    assert all(a in ipaddress.ip_network(V6_POOL) for a in v6)
    for src, dst in ((p1, r2), (p2, r1)):
        for a in addrs(dst, 4) + addrs(dst, 6):
            src.ping(a)
    for r in (r1, r2):
        for a in addrs(r, 4) + addrs(r, 6):
            rt.node.ping(a)
    for cid, pod in (("pod-a", p1), ("pod-b", p2)):
        check = rt.call("CHECK", cid, pod.path)
        assert (check.rc, check.raw) == (0, b""), check
    for cid, pod in (("pod-a", p1), ("pod-b", p2)):
        for _ in range(3):
            call = rt.call("DEL", cid, pod.path)
            assert (call.rc, call.raw) == (0, b""), call
    assert_clean(rt)
    assert p1.links() == ["lo"]


def test_result_describes_what_was_programmed(rt: Runtime, pool: NetnsPool) -> None:
    """ADD-3, CHN-3: interfaces (host without sandbox), IPs on the pod side, real routes."""
    pod = pool.pod()
    r = rt.add("pod-r", pod)
    host, ctr = r["interfaces"]
    assert "sandbox" not in host
    assert host["name"].startswith("cali")
    assert len(host["name"]) == 15
    assert ctr["name"] == "eth0"
    assert ctr["sandbox"] == pod.path
    assert ctr["mac"] in pod.link_line("eth0")
    assert all(ip["interface"] == 1 for ip in r["ips"])
    assert {"dst": "0.0.0.0/0", "gw": "169.254.1.1"} in r["routes"]
    assert {"dst": "::/0", "gw": "fe80::ecee:eeff:feee:eeee"} in r["routes"]
    v4 = addrs(r, 4)[0]
    assert f"{v4}/32" in pod.ip("-4", "addr", "show", "dev", "eth0").stdout
    assert f"{v4} dev {host['name']}" in rt.node.ip("-4", "route", "show").stdout
    assert rt.node.sysctl(f"net/ipv4/conf/{host['name']}/proxy_arp") == "1"
    assert rt.node.sysctl(f"net/ipv6/conf/{host['name']}/proxy_ndp") == "1"
    rt.call("DEL", "pod-r", pod.path)


@pytest.mark.parametrize("version", ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"])
def test_every_version_adds_and_deletes(rt: Runtime, pool: NetnsPool, version: str) -> None:
    """GEN-8, VER-3: ADD at each advertised version answers in that version's shape."""
    pod = pool.pod()
    r = rt.add("pod-v", pod, version=version)
    assert r["cniVersion"] == version
    assert all(("version" in ip) is (version < "1.0.0") for ip in r["ips"])
    if version >= "0.4.0":
        assert rt.call("CHECK", "pod-v", pod.path, version=version).rc == 0
    assert rt.call("DEL", "pod-v", pod.path, version=version).rc == 0
    assert_clean(rt)


@pytest.mark.parametrize(("v4", "v6"), [(True, False), (False, True)])
def test_single_stack(pool: NetnsPool, tmp_path: Path, v4: bool, v6: bool) -> None:
    rt = Runtime(pool, pool.node(), tmp_path, v4=v4, v6=v6)
    p1, p2 = pool.pod(), pool.pod()
    r1, r2 = rt.add("s1", p1), rt.add("s2", p2)
    fam = 4 if v4 else 6
    assert addrs(r1, 10 - fam) == []
    p1.ping(addrs(r2, fam)[0])
    rt.node.ping(addrs(r1, fam)[0])
    assert rt.call("CHECK", "s1", p1.path).rc == 0
    rt.call("DEL", "s1", p1.path)
    rt.call("DEL", "s2", p2.path)
    assert_clean(rt)


def test_existing_ifname_fails_without_touching_it_or_leaking(rt: Runtime, pool: NetnsPool) -> None:
    """ADD-2, ADD-5 (the failure comes after IPAM succeeded), DEL-6."""
    pod = pool.pod()
    pod.ip("link", "add", "eth0", "type", "bridge")
    before = pod.link_line("eth0")
    call = rt.call("ADD", "pod-x", pod.path)
    assert call.rc == 1
    assert call.out["code"] == 103
    assert "eth0" in call.out["msg"]
    assert pod.link_line("eth0") == before
    assert_clean(rt)
    # The runtime's DEL after the failed ADD must not remove the foreign eth0 either.
    assert rt.call("DEL", "pod-x", pod.path).rc == 0
    assert pod.link_line("eth0") == before


def test_not_a_netns_rolls_back(rt: Runtime, tmp_path: Path) -> None:
    """ADD-5: dataplane failure after IPAM ADD -> no link, no route, address free."""
    bogus = tmp_path / "not-a-netns"
    bogus.write_text("")
    call = rt.call("ADD", "pod-y", str(bogus))
    assert call.rc == 1
    assert call.out["code"] in (8, 103)
    assert_clean(rt)


def test_own_netns_is_refused(rt: Runtime) -> None:
    """GEN-16: CNI_NETNS naming the node's own namespace -> code 8, node untouched."""
    before = rt.node.links()
    call = rt.call("ADD", "pod-z", rt.node.path)
    assert (call.rc, call.out["code"]) == (1, 8)
    assert rt.node.links() == before
    assert rt.handles() == []


def test_del_without_netns_vanished_netns_and_repeated(rt: Runtime, pool: NetnsPool) -> None:
    """DEL-1, DEL-2 (a: no CNI_NETNS, b: path gone), DEL-3, ENV-5, IPM-9."""
    p1, p2 = pool.pod(), pool.pod()
    rt.add("gone-1", p1)
    rt.add("gone-2", p2)
    assert rt.call("DEL", "gone-1", None, prev=False).rc == 0
    pool.delete(p2)
    for _ in range(3):
        call = rt.call("DEL", "gone-2", p2.path, prev=False)
        assert (call.rc, call.raw) == (0, b""), call
    assert rt.call("DEL", "never-added", None).rc == 0
    assert_clean(rt)


def test_check_after_tampering_fails_and_passes_after_repair(rt: Runtime, pool: NetnsPool) -> None:
    """CHK-3, CHK-5, CHK-6: host route deleted, pod address removed, IPAM record removed."""
    pod = pool.pod()
    r = rt.add("pod-t", pod)
    host = r["interfaces"][0]["name"]
    v4 = addrs(r, 4)[0]
    assert rt.call("CHECK", "pod-t", pod.path).rc == 0

    rt.node.ip("route", "del", f"{v4}/32", "dev", host)
    call = rt.call("CHECK", "pod-t", pod.path)
    assert (call.rc, call.out["code"]) == (1, 103), call
    rt.node.ip("route", "add", f"{v4}/32", "dev", host, "scope", "link")
    assert rt.call("CHECK", "pod-t", pod.path).rc == 0

    pod.ip("addr", "del", f"{v4}/32", "dev", "eth0")
    assert rt.call("CHECK", "pod-t", pod.path).rc == 1
    pod.ip("addr", "add", f"{v4}/32", "dev", "eth0")
    pod.ip("route", "replace", "169.254.1.1", "dev", "eth0", "scope", "link")
    pod.ip("route", "replace", "default", "via", "169.254.1.1", "dev", "eth0")
    assert rt.call("CHECK", "pod-t", pod.path).rc == 0, rt.call("CHECK", "pod-t", pod.path)

    ipam_del = rt.call("DEL", "pod-t", pod.path, binary=TABBY_IPAM)
    assert ipam_del.rc == 0
    rt.cache[("pod-t", "eth0")] = r  # the runtime still has its cached result
    call = rt.call("CHECK", "pod-t", pod.path)
    assert (call.rc, call.out["code"]) == (1, 3), call
    rt.call("DEL", "pod-t", pod.path)
    assert_clean(rt)


def test_check_tolerates_a_later_plugins_mac_change(rt: Runtime, pool: NetnsPool) -> None:
    """CHK-4: prevResult is the final result; a MAC changed by a later plugin is fine."""
    pod = pool.pod()
    r = rt.add("pod-m", pod)
    pod.ip("link", "set", "eth0", "address", "0a:58:0a:f4:00:99")
    final = copy.deepcopy(r)
    final["interfaces"][1]["mac"] = "0a:58:0a:f4:00:99"
    rt.cache[("pod-m", "eth0")] = final
    assert rt.call("CHECK", "pod-m", pod.path).rc == 0
    rt.call("DEL", "pod-m", pod.path)


def test_old_sandbox_del_leaves_new_sandbox_alone(rt: Runtime, pool: NetnsPool) -> None:
    """DEL-5: DEL of sandbox A after sandbox B of the same pod exists."""
    pa, pb = pool.pod(), pool.pod()
    rt.add("sandbox-a", pa)
    rb = rt.add("sandbox-b", pb)
    assert rt.call("DEL", "sandbox-a", None, prev=False).rc == 0
    assert rt.handles()
    assert len(rt.host_veths()) == 1
    assert rt.call("CHECK", "sandbox-b", pb.path).rc == 0
    rt.node.ping(addrs(rb, 4)[0])
    rt.call("DEL", "sandbox-b", pb.path)
    assert_clean(rt)


def test_same_container_two_ifnames(rt: Runtime, pool: NetnsPool) -> None:
    """ADD-6: each (ID, ifname) gets its own address; DEL of one leaves the other."""
    pod = pool.pod()
    r0 = rt.add("multi", pod, ifname="eth0")
    r1 = rt.add("multi", pod, ifname="net1")
    assert set(addrs(r0, 4)).isdisjoint(addrs(r1, 4))
    assert rt.call("DEL", "multi", pod.path, ifname="eth0").rc == 0
    assert "net1" in pod.links()
    assert rt.call("CHECK", "multi", pod.path, ifname="net1").rc == 0
    rt.call("DEL", "multi", pod.path, ifname="net1")
    assert_clean(rt)


def test_repeated_add_reuses_the_allocation(rt: Runtime, pool: NetnsPool) -> None:
    """ADD-7: ADD twice without DEL -> still one allocation (the same addresses)."""
    pod = pool.pod()
    first = rt.add("again", pod)
    second = rt.add("again", pod)
    assert addrs(first, 4) == addrs(second, 4)
    assert len(rt.handles()) == 1
    assert len(rt.host_veths()) == 1
    rt.call("DEL", "again", pod.path)
    assert_clean(rt)


def test_gc_removes_stale_attachments_only(rt: Runtime, pool: NetnsPool) -> None:
    """GC-2, GC-3, GC-6: valid list keeps exactly the listed attachment."""
    p1, p2 = pool.pod(), pool.pod()
    rt.add("keep-me", p1)
    rt.add("stale", p2)
    valid = {"cni.dev/valid-attachments": [{"containerID": "keep-me", "ifname": "eth0"}]}
    assert rt.call("GC", "", None, extra=valid).rc == 0
    assert len(rt.host_veths()) == 1
    assert len(rt.handles()) == 1
    assert rt.call("CHECK", "keep-me", p1.path).rc == 0
    # absent key: nothing is deleted (GC-4)
    assert rt.call("GC", "", None).rc == 0
    assert len(rt.handles()) == 1
    rt.call("DEL", "keep-me", p1.path)
    assert_clean(rt)


def test_status_ready_and_exhausted(pool: NetnsPool, tmp_path: Path) -> None:
    """STA-2, STA-3, STA-4, STA-5: code 50 on a full pool; ADD/DEL keep working."""
    rt = Runtime(
        pool, pool.node(), tmp_path, v6=False, block_size_ipv4=30, ipv4_pools=["10.244.9.0/30"]
    )
    assert rt.call("STATUS", "", None).rc == 0
    pods = [pool.pod() for _ in range(4)]
    for n, p in enumerate(pods):
        rt.add(f"full-{n}", p)
    status = rt.call("STATUS", "", None)
    assert (status.rc, status.out["code"]) == (1, 50), status
    extra = pool.pod()
    call = rt.call("ADD", "one-too-many", extra.path)
    assert (call.rc, call.out["code"]) == (1, 100)
    rt.call("DEL", "full-0", pods[0].path)
    assert rt.call("STATUS", "", None).rc == 0
    for n, p in enumerate(pods[1:], 1):
        rt.call("DEL", f"full-{n}", p.path)
    assert_clean(rt)


def test_host_state_lands_in_the_node_namespace_only(rt: Runtime, pool: NetnsPool) -> None:
    """GEN-15: host veth, routes and sysctls are in the caller's (node) namespace."""
    pod = pool.pod()
    r = rt.add("where", pod)
    host = r["interfaces"][0]["name"]
    real_host_links = netns_util.run("ip", "-o", "link", "show").stdout
    assert host not in real_host_links
    assert host in rt.node.links()
    rt.call("DEL", "where", pod.path)


def test_log_file_records_the_calls(rt: Runtime, pool: NetnsPool) -> None:
    pod = pool.pod()
    rt.add("logged", pod)
    rt.call("DEL", "logged", pod.path)
    text = (rt.tmp / "cni.log").read_text()
    assert "ADD logged eth0" in text
    assert "DEL logged eth0" in text


STUB_IPAM = """#!/bin/sh
# Delegates to tabby-ipam, then (on ADD) lists its first address twice, so the dataplane
# fails after IPAM succeeded (adding the second copy of the address: EEXIST).
out=$({tabby_ipam})
rc=$?
if [ "$CNI_COMMAND" = ADD ] && [ $rc -eq 0 ]; then
  printf '%s' "$out" | {python} -c 'import json,sys; r=json.load(sys.stdin); \
r["ips"]=[r["ips"][0], r["ips"][0]]; print(json.dumps(r))'
else
  printf '%s' "$out"
fi
exit $rc
"""


def test_failure_after_ipam_rolls_back_through_the_binaries(
    rt: Runtime, pool: NetnsPool, tmp_path: Path
) -> None:
    """ADD-5, DEL-6: the dataplane fails after IPAM ADD succeeded -> no link, no route, the
    address is free again (tabby ran IPAM DEL before reporting)."""
    import sys

    bindir = tmp_path / "bin"
    bindir.mkdir()
    stub = bindir / "dup-ipam"
    stub.write_text(STUB_IPAM.format(tabby_ipam=TABBY_IPAM, python=sys.executable))
    stub.chmod(0o755)
    (bindir / "tabby").symlink_to(TABBY)
    rt.conf["ipam"]["type"] = "dup-ipam"
    pod = pool.pod()
    conf = copy.deepcopy(rt.conf)
    env = {
        "CNI_CONTAINERID": "dup",
        "CNI_IFNAME": "eth0",
        "CNI_NETNS": pod.path,
        "CNI_PATH": f"{bindir}:{os.path.dirname(TABBY)}",
    }
    fd = os.open(rt.node.path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        call = exec_plugin(TABBY, "ADD", conf, env=env, netns_fd=fd)
    finally:
        os.close(fd)
    assert (call.rc, call.out["code"]) == (1, 103), call
    assert pod.links() == ["lo"]
    assert_clean(rt)


def test_del_with_a_locked_store_cleans_locally_and_says_retry(
    rt: Runtime, pool: NetnsPool
) -> None:
    """DEL-7: a store that is temporarily locked never blocks local cleanup; code 11 until
    IPAM can release; the retried DEL succeeds."""
    pod = pool.pod()
    rt.add("locked", pod)
    rt.conf["ipam"]["lock_timeout_seconds"] = 1
    with store_lock_held(str(rt.data_dir / "lock")):
        call = rt.call("DEL", "locked", pod.path)
        assert (call.rc, call.out["code"]) == (1, 11), call
        assert rt.host_veths() == []
        assert pod.links() == ["lo"]
    assert rt.call("DEL", "locked", pod.path).rc == 0
    assert_clean(rt)


def test_missing_nodename_file_never_fails_del(
    rt: Runtime, pool: NetnsPool, tmp_path: Path
) -> None:
    """DEL-7: nodename from a file that has gone away: DEL still cleans everything."""
    pod = pool.pod()
    rt.add("nn", pod)
    del rt.conf["nodename"]
    rt.conf["nodename_file"] = str(tmp_path / "no-such-file")
    assert rt.call("DEL", "nn", pod.path).rc == 0
    assert_clean(rt)


def endpoints(data_dir: Path) -> dict[str, str]:
    """The WorkloadEndpoints in the file store: pod name -> its container id."""
    import json

    wdir = data_dir / "workloadendpoints"
    out: dict[str, str] = {}
    for name in os.listdir(wdir) if wdir.exists() else []:
        if name.endswith(".json"):
            spec = json.loads((wdir / name).read_text())["data"]["spec"]
            out[spec["pod"]] = spec["containerID"]
    return out


@pytest.mark.slow
def test_tabby_node_killed_in_a_burst_of_pods(pool: NetnsPool, tmp_path: Path) -> None:
    """48 pods' ADDs at once through tabby-node (their addresses and WorkloadEndpoints
    written in batches), tabby-node SIGKILLed at a random instant of the burst: every ADD
    succeeded or failed cleanly (code 11); after the runtime's DEL of each failed one (run
    in-process: the node is gone), no address was given twice, none is held and no
    endpoint is left but the live pods', and DEL of every pod leaves nothing (ADD-5,
    DEL-3)."""
    import random
    import signal
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from tests.e2e.conftest import start_tabby_node, stop_tabby_node

    sock = str(tmp_path / "run" / "node.sock")
    node = start_tabby_node(sock, str(tmp_path / "node.log"))
    rt = Runtime(pool, pool.node(), tmp_path)
    rt.data_dir = tmp_path / "agent-store"  # tabby-node's own store: its served path
    rt.conf["ipam"]["data_dir"] = str(rt.data_dir)
    rt.env["TABBY_NODE_SOCKET"] = sock
    pods = {f"burst-{i}": pool.pod() for i in range(48)}
    warm = pool.pod()
    assert rt.add("warm", warm)  # served: the node's store and pools exist
    after = random.Random(os.getpid()).uniform(0.2, 1.5)
    killer = threading.Timer(after, lambda: node.send_signal(signal.SIGKILL))
    try:
        killer.start()
        with ThreadPoolExecutor(max_workers=len(pods)) as burst:
            calls = dict(
                zip(pods, burst.map(lambda c: rt.call("ADD", c, pods[c].path), pods), strict=True)
            )
        killer.join()
    finally:
        killer.cancel()
        stop_tabby_node(node)
    ok = {cid: c for cid, c in calls.items() if c.rc == 0}
    failed = {cid: c for cid, c in calls.items() if c.rc != 0}
    print(f"killed after {after:.2f} s: {len(ok)} ADDs answered, {len(failed)} failed")
    for c in failed.values():
        assert c.out["code"] == 11, c  # clean CNI error JSON, never garbage
    for cid in failed:  # the runtime's DEL after a failed ADD
        assert rt.call("DEL", cid, pods[cid].path).rc == 0
    live = {"warm", *ok}
    given = [a for c in ok.values() for a in addrs(c.out, 4) + addrs(c.out, 6)]
    assert len(given) == len(set(given)), "an address was given twice"
    assert {h.split(":")[1] for h in rt.handles()} == live  # no leak, none missing
    assert endpoints(rt.data_dir) == {cid: cid for cid in live}
    assert len(rt.host_veths()) == len(live)
    for cid in live:
        assert rt.call("DEL", cid, {**pods, "warm": warm}[cid].path).rc == 0
    assert endpoints(rt.data_dir) == {}
    assert rt.handles() == []
