"""The installed ``tabby-ipam`` under concurrency and SIGKILL, exec'd as a runtime would.

No namespace is needed: an IPAM plugin never touches interfaces (IPM-8), so CNI_NETNS is a
dummy path. Rules (cni_protocol/CONFORMANCE.md): GEN-12, GEN-13, IPM-7..11, DEL-1, GC-2..4,
STA-3.
"""

from __future__ import annotations

import ipaddress
import json
import os
import random
import signal
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import ALL_SPEC_VERSIONS
from tests.e2e.conftest import TABBY_IPAM, Call, exec_plugin, ipam_conf, store_lock_held

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("installed")]


def env(cid: str, ifname: str = "eth0", **extra: str) -> dict[str, str]:
    return {
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": "/nonexistent/netns",
        "CNI_IFNAME": ifname,
        "CNI_PATH": os.path.dirname(TABBY_IPAM),
        "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME={cid}",
        **extra,
    }


def ipam(command: str, conf: dict[str, Any], cid: str = "", **kw: Any) -> Call:
    return exec_plugin(
        TABBY_IPAM,
        command,
        conf,
        env=env(cid, **kw) if cid else {"CNI_PATH": os.path.dirname(TABBY_IPAM)},
    )


def store_handles(data_dir: Path) -> list[str]:
    """Every attachment (handle) holding an address, read straight from the store's blocks
    (the handle is a field of each allocation)."""
    out: set[str] = set()
    bdir = data_dir / "blocks"
    if not bdir.exists():
        return []
    for name in os.listdir(bdir):
        if name.endswith(".json"):
            doc = json.loads((bdir / name).read_text())
            out.update(a["handle"] for a in doc.get("data", doc)["allocations"] if a)
    return sorted(out)


def allocated(data_dir: Path) -> list[str]:
    """Every address some block says is allocated (read straight from the store)."""
    out = []
    bdir = data_dir / "blocks"
    if not bdir.exists():
        return out
    for name in os.listdir(bdir):
        if not name.endswith(".json"):
            continue
        doc = json.loads((bdir / name).read_text())
        data = doc.get("data", doc)
        net = ipaddress.ip_network(data["cidr"])
        for ordinal, a in enumerate(data["allocations"]):
            if a is not None:
                out.append(str(net[ordinal]))
    return out


@pytest.fixture
def conf(tmp_path: Path) -> dict[str, Any]:
    return ipam_conf(str(tmp_path / "ipam"))


@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_acceptance_flow_at_every_version(tmp_path: Path, version: str) -> None:
    """ADD from a /26 and a /122 affine to the node; another node gets another block;
    DEL x3; CHECK after DEL fails; IPAM-shaped result (IPM-7)."""
    c = ipam_conf(str(tmp_path / "ipam"), version, assign_ipv6=True)
    a = ipam("ADD", c, "cid-a")
    assert a.rc == 0, a
    assert a.out["cniVersion"] == version
    assert "interfaces" not in a.out
    assert all("interface" not in ip for ip in a.out["ips"])
    addrs = [ipaddress.ip_interface(ip["address"]) for ip in a.out["ips"]]
    assert sorted(x.version for x in addrs) == [4, 6]
    assert all(("version" in ip) is (version < "1.0.0") for ip in a.out["ips"])
    v4 = next(x.ip for x in addrs if x.version == 4)
    assert v4 in ipaddress.ip_network("10.244.0.0/16")
    other = ipam("ADD", {**c, "nodename": "node-b"}, "cid-b")
    v4b = next(
        ipaddress.ip_interface(ip["address"]).ip
        for ip in other.out["ips"]
        if ":" not in ip["address"]
    )
    assert ipaddress.ip_network(f"{v4}/26", strict=False) != ipaddress.ip_network(
        f"{v4b}/26", strict=False
    )
    if version >= "0.4.0":
        assert ipam("CHECK", {**c, "prevResult": a.out}, "cid-a").rc == 0
    for _ in range(3):
        d = ipam("DEL", c, "cid-a")
        assert (d.rc, d.raw) == (0, b"")
    if version >= "0.4.0":
        chk = ipam("CHECK", {**c, "prevResult": a.out}, "cid-a")
        assert chk.rc == 1
        assert chk.out["code"] == 3


def test_gc_keeps_exactly_the_listed(conf: dict[str, Any], tmp_path: Path) -> None:
    """GC-2, GC-3, GC-4: valid list / legacy key / absent key / other network untouched."""
    added = {cid: ipam("ADD", conf, cid) for cid in ("a", "b", "c")}
    assert all(c.rc == 0 for c in added.values())
    other = {**conf, "name": "other-net"}
    assert ipam("ADD", other, "a").rc == 0
    assert ipam("GC", conf).rc == 0  # no key: nothing deleted
    assert len(store_handles(tmp_path / "ipam")) == 4
    gc = {
        **conf,
        "cni.dev/attachments": [
            {"containerID": "a", "ifname": "eth0"},
            {"containerID": "b", "ifname": "eth0"},
        ],
    }
    assert ipam("GC", gc).rc == 0
    assert len(store_handles(tmp_path / "ipam")) == 3
    gc = {**conf, "cni.dev/valid-attachments": [{"containerID": "a", "ifname": "eth0"}]}
    assert ipam("GC", gc).rc == 0
    handles = store_handles(tmp_path / "ipam")
    assert len(handles) == 2
    assert any(h.startswith("other-net") for h in handles)
    assert ipam("CHECK", {**conf, "prevResult": added["a"].out}, "a").rc == 0
    assert ipam("CHECK", {**conf, "prevResult": added["b"].out}, "b").rc == 1


def test_status_of_a_full_pool_is_code_50(tmp_path: Path) -> None:
    """STA-2, STA-3: code 50 when no address can be had; fine again after a DEL."""
    c = ipam_conf(str(tmp_path / "ipam"), ipv4_pools=["10.244.7.0/30"], block_size_ipv4=30)
    assert ipam("STATUS", c).rc == 0
    for n in range(4):
        assert ipam("ADD", c, f"f{n}").rc == 0
    st = ipam("STATUS", c)
    assert (st.rc, st.out["code"]) == (1, 50)
    full = ipam("ADD", c, "f9")
    assert (full.rc, full.out["code"]) == (1, 100)
    assert ipam("DEL", c, "f0").rc == 0
    assert ipam("STATUS", c).rc == 0


def test_lock_timeout_is_code_11(conf: dict[str, Any], tmp_path: Path) -> None:
    """GEN-14: a held store lock fails ADD with code 11 within the timeout."""
    assert ipam("ADD", conf, "warm").rc == 0
    with store_lock_held(str(tmp_path / "ipam" / "lock")):
        t0 = time.monotonic()
        c = {**conf, "ipam": {**conf["ipam"], "lock_timeout_seconds": 1}}
        call = ipam("ADD", c, "blocked")
        assert (call.rc, call.out["code"]) == (1, 11)
        assert time.monotonic() - t0 < 10


def test_specific_ip_via_cni_args(conf: dict[str, Any]) -> None:
    """IPM-12, KARG-4: CNI_ARGS IP= is honoured; a taken one fails and allocates nothing."""
    a = ipam("ADD", conf, "want", CNI_ARGS="IgnoreUnknown=1;IP=10.244.200.7")
    assert a.rc == 0, a
    assert a.out["ips"][0]["address"] == "10.244.200.7/32"
    b = ipam("ADD", conf, "want2", CNI_ARGS="IP=10.244.200.7")
    assert (b.rc, b.out["code"]) == (1, 102)
    outside = ipam("ADD", conf, "want3", CNI_ARGS="IP=192.168.77.1")
    assert (outside.rc, outside.out["code"]) == (1, 102)


def test_64_concurrent_adds_get_64_distinct_addresses(conf: dict[str, Any], tmp_path: Path) -> None:
    """GEN-12, IPM-10: 64 processes at once."""
    with ThreadPoolExecutor(max_workers=64) as pool:
        calls = list(pool.map(lambda n: ipam("ADD", conf, f"par-{n}"), range(64)))
    assert all(c.rc == 0 for c in calls), [c for c in calls if c.rc][:3]
    addresses = [c.out["ips"][0]["address"] for c in calls]
    assert len(set(addresses)) == 64
    assert len(allocated(tmp_path / "ipam")) == 64
    assert len(store_handles(tmp_path / "ipam")) == 64


def test_200_add_del_cycles_across_8_processes_leave_the_store_empty(
    conf: dict[str, Any], tmp_path: Path
) -> None:
    """GEN-12, DEL-1: interleaved ADD/DEL from 8 workers; no duplicate ever held."""
    import threading

    lock = threading.Lock()
    held: set[str] = set()  # addresses between their ADD's answer and their DEL's start
    dupes: list[str] = []

    def worker(w: int) -> None:
        for n in range(25):
            cid = f"cyc-{w}-{n}"
            add = ipam("ADD", conf, cid)
            assert add.rc == 0, add
            ip = add.out["ips"][0]["address"]
            with lock:
                if ip in held:
                    dupes.append(ip)
                held.add(ip)
            time.sleep(random.uniform(0, 0.02))  # the "pod" lives a little while
            with lock:
                held.discard(ip)
            assert ipam("DEL", conf, cid).rc == 0

    with ThreadPoolExecutor(max_workers=8) as pool:
        list(pool.map(worker, range(8)))
    assert dupes == []
    assert allocated(tmp_path / "ipam") == []
    assert store_handles(tmp_path / "ipam") == []


@pytest.mark.slow
def test_sigkill_at_random_points_then_del_then_gc(conf: dict[str, Any], tmp_path: Path) -> None:
    """GEN-13, IPM-10: 100 ADDs killed with SIGKILL at a random instant, each followed by
    DEL of the same attachment; a live pod keeps its address throughout; then GC. No
    address is ever given twice, nothing leaks, the store stays readable."""
    data_dir = tmp_path / "ipam"
    keeper = ipam("ADD", conf, "keeper")
    keeper_ip = keeper.out["ips"][0]["address"]
    rng = random.Random(1234)
    stdin = json.dumps(conf).encode()
    killed = 0
    for n in range(100):
        cid = f"kill-{n}"
        full_env = {
            "PATH": os.environ.get("PATH", ""),
            "CNI_COMMAND": "ADD",
            "TABBY_NODE_SOCKET": "off",
            **env(cid),
        }
        proc = subprocess.Popen(
            [TABBY_IPAM],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env=full_env,
        )
        assert proc.stdin is not None
        proc.stdin.write(stdin)
        proc.stdin.close()
        time.sleep(rng.uniform(0, 0.08))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        killed += proc.returncode == -signal.SIGKILL
        # Every so often a survivor pod is added: it must never get the keeper's address.
        if n % 10 == 0:
            probe = ipam("ADD", conf, f"probe-{n}")
            assert probe.rc == 0, probe
            assert probe.out["ips"][0]["address"] != keeper_ip
            assert ipam("DEL", conf, f"probe-{n}").rc == 0
        d = ipam("DEL", conf, cid)
        assert d.rc == 0, d
        addresses = allocated(data_dir)
        assert len(addresses) == len(set(addresses))
    assert killed > 20  # the kills really landed mid-call, not after it finished
    valid = {**conf, "cni.dev/valid-attachments": [{"containerID": "keeper", "ifname": "eth0"}]}
    assert ipam("GC", valid).rc == 0
    assert allocated(data_dir) == [keeper_ip.split("/")[0]]
    assert store_handles(data_dir) == ["e2e-net:keeper:eth0"]
    assert ipam("CHECK", {**conf, "prevResult": keeper.out}, "keeper").rc == 0
    leftovers = [p for p in os.listdir(data_dir) if p.startswith(".") or p.endswith(".tmp")]
    for sub in ("blocks", "handles", "pools", "affinities"):
        if (data_dir / sub).exists():
            leftovers += [p for p in os.listdir(data_dir / sub) if not p.endswith(".json")]
    assert leftovers == []
