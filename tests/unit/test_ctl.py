"""tabbyctl through click's CliRunner: every command, both output formats, helpful errors.

No root needed. The store is a private file store under ``tmp_path`` named by a conflist
given with ``--conf``; it is populated through the IPAM core (``Ipam.assign`` with the
attributes the plugin records) or through the ``tabby-ipam`` handlers via ``skel.run``.
The node side of ``ipam check`` / ``ipam gc`` reads the host veths through
``cni_plugin.dataplane.list_host_veths``, replaced here by a list of fakes; a pod's netns
is a file under ``tmp_path`` (present = alive, missing = gone).
"""

from __future__ import annotations

import copy
import errno
import ipaddress
import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

from cni_plugin import __version__, dataplane
from cni_plugin.cni import skel
from cni_plugin.cni.errors import CniError, Code
from cni_plugin.cni.version import SUPPORTED_VERSIONS
from cni_plugin.ctl import views
from cni_plugin.ctl.cli import cli
from cni_plugin.dataplane import HostVeth, host_veth_name
from ipam import plugin as ipam_plugin
from ipam.core import AssignRequest, Ipam, NoAddressAvailable, PoolSpec, handle_id
from ipam.store.file import FileStore, _dir_error

NODE = "node-a"
NET = "net1"
V4 = "10.244.0.0/16"
V6 = "fd00:10:244::/48"
RESERVED = "10.244.0.0/30"


class Ctl:
    """One private store + conflist, fake host veths, and a runner for tabbyctl."""

    def __init__(self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
        self.tmp = tmp_path
        self.data_dir = tmp_path / "ipam"
        self.conf = tmp_path / "10-tabby.conflist"
        self.netns_dir = tmp_path / "netns"
        self.netns_dir.mkdir()
        self.veths: list[HostVeth] = []
        self.write_conf()
        monkeypatch.setattr(dataplane, "list_host_veths", self._list_host_veths)

    def _list_host_veths(self, prefix: str) -> list[HostVeth]:
        return [v for v in self.veths if v.name.startswith(prefix)]

    def write_conf(self, **ipam: Any) -> None:
        doc = {
            "cniVersion": "1.1.0",
            "name": NET,
            "plugins": [
                {
                    "type": "tabby",
                    "nodename": NODE,
                    "ipam": {
                        "type": "tabby-ipam",
                        "assign_ipv6": True,
                        "ipv4_pools": [V4],
                        "ipv6_pools": [V6],
                        "reserved": [RESERVED],
                        "data_dir": str(self.data_dir),
                        "lock_timeout_seconds": 5,
                        **ipam,
                    },
                },
                {"type": "portmap", "capabilities": {"portMappings": True}},
            ],
        }
        self.conf.write_text(json.dumps(doc))

    # -- the store ----------------------------------------------------------------------

    def store(self) -> FileStore:
        return FileStore(str(self.data_dir), lock_timeout=5)

    def ipam(self, node: str = NODE) -> Ipam:
        return Ipam(self.store(), node)

    def netns(self, cid: str) -> Path:
        return self.netns_dir / cid

    def add(
        self,
        cid: str,
        *,
        node: str = NODE,
        age: float = 3600.0,
        netns: bool = True,
        veth: bool = True,
        v6: bool = True,
        ifname: str = "eth0",
        pools: tuple[str, ...] = (V4,),
    ) -> list[str]:
        """ADD as the plugin records it: one attachment of pod ``e2e/<cid>`` made ``age``
        seconds ago, its netns file present or not, its host veth (with the host routes
        to its addresses) present or not."""
        ipam = self.ipam(node)
        ipam.ensure_pools([PoolSpec(V4), PoolSpec(V6)])
        path = self.netns(cid)
        if netns:
            path.touch()
        attrs = {
            "node": node,
            "network": NET,
            "container_id": cid,
            "ifname": ifname,
            "pod_namespace": "e2e",
            "pod_name": cid,
            "pod_uid": "",
            "netns": str(path),
            "time": time.time() - age,
        }
        got = ipam.assign(
            AssignRequest(
                handle_id(NET, cid, ifname),
                attrs=attrs,
                want_v6=v6,
                v4_pools=list(pools),
                v6_pools=[V6],
                reserved=[RESERVED],
            )
        )
        ips = [str(a.ip) for a in got]
        if veth:
            self.add_veth(cid, ips, ifname=ifname)
        return ips

    def add_veth(
        self, cid: str, ips: list[str], *, ifname: str = "eth0", alias: str | None = None
    ) -> str:
        name = host_veth_name("cali", NET, cid, ifname)
        routes = tuple(ipaddress.ip_network(ip) for ip in ips)
        tag = f"tabby:{NET}:{cid}:{ifname}" if alias is None else alias
        self.veths.append(HostVeth(name, 100 + len(self.veths), True, tag, routes))
        return name

    def edit(self, kind: str, key: str, change: Callable[[dict[str, Any]], None]) -> None:
        """Inject a fault: rewrite one document as a bug or a hand edit would."""
        store = self.store()
        with store.lock():
            doc = store.get(kind, key)
            assert doc is not None, (kind, key)
            data = copy.deepcopy(doc.data)
            change(data)
            store.put(kind, key, data, doc.revision)

    def block_of(self, ip: str) -> str:
        owner = self.ipam().who_owns(ip)
        assert owner is not None
        return owner.block_cidr

    def drop_block_entry(self, ip: str) -> str:
        """Inject a fault: the block forgets the allocation, the handle still lists it."""
        block = self.block_of(ip)
        ordinal = int(ipaddress.ip_address(ip)) - int(ipaddress.ip_network(block).network_address)

        def drop(d: dict[str, Any]) -> None:
            d["allocations"][ordinal] = None
            d["unallocated"].append(ordinal)

        self.edit("block", block, drop)
        return block

    # -- running tabbyctl -----------------------------------------------------------------

    def run(self, *args: str, conf: bool = True) -> Result:
        argv = (["--conf", str(self.conf)] if conf else []) + list(args)
        result = CliRunner().invoke(cli, argv, prog_name="tabbyctl")
        assert "Traceback" not in result.output, result.output
        if result.exception is not None:
            assert isinstance(result.exception, SystemExit), repr(result.exception)
        return result

    def json(self, *args: str) -> Any:
        result = self.run(*args, "-o", "json")
        return json.loads(result.stdout)


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctl:
    return Ctl(tmp_path, monkeypatch)


def ok(result: Result) -> list[str]:
    assert result.exit_code == 0, result.output
    return result.stdout.splitlines()


def one_line_error(result: Result, code: int = 1) -> str:
    """A failure is exit status 1 and exactly one line on stderr, no traceback."""
    assert result.exit_code == code, result.output
    assert result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("Error: ")
    return lines[0]


def row(lines: list[str], first: str) -> list[str]:
    """The cells of the table row whose first cell is ``first``."""
    for line in lines:
        cells = line.split()
        if cells and cells[0] == first:
            return cells
    raise AssertionError(f"no row {first!r} in:\n" + "\n".join(lines))


def findings(data: dict[str, Any]) -> set[tuple[str, str]]:
    """(kind, subject) of every store and node finding of ``ipam check -o json``."""
    return {(p["kind"], p["subject"]) for p in data["store"] + data["node"]}


# == version ================================================================================


def test_version_table() -> None:
    result = CliRunner().invoke(cli, ["version"])
    (line,) = ok(result)
    assert line.startswith(f"tabby {__version__} (CNI ")
    assert ", ".join(SUPPORTED_VERSIONS) in line


def test_version_json() -> None:
    result = CliRunner().invoke(cli, ["version", "-o", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["version"] == __version__
    assert data["cniVersions"] == list(SUPPORTED_VERSIONS)
    assert data["python"].count(".") == 2


def test_version_needs_no_conflist(tmp_path: Path) -> None:
    """version reads no configuration: a broken --conf does not matter."""
    result = CliRunner().invoke(cli, ["--conf", str(tmp_path / "missing"), "version"])
    assert ok(result)[0].startswith("tabby ")


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["version"],
        ["ipam"],
        ["ipam", "show"],
        ["ipam", "check"],
        ["ipam", "release"],
        ["ipam", "gc"],
        ["pool"],
        ["pool", "list"],
        ["pool", "add"],
        ["pool", "disable"],
        ["pool", "enable"],
        ["pool", "delete"],
        ["demo"],
    ],
)
def test_every_command_has_help(command: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


# == ipam show ==============================================================================


def test_show_table_lists_pools_usage_and_every_allocation(ctl: Ctl) -> None:
    a = ctl.add("pod-a")
    b = ctl.add("pod-b")
    lines = ok(ctl.run("ipam", "show"))
    assert lines[0] == f"file store {ctl.data_dir} ({ctl.conf})"
    header = row(lines, "POOL")
    assert " ".join(header) == "POOL BLOCK SIZE TOTAL IN USE RESERVED FREE BLOCKS STATE"
    # 65536 addresses, 2 in use, the 4 of the reserved /30, the rest free; one block.
    assert row(lines, V4)[1:] == ["/26", "65536", "2", "4", "65530", "1", "enabled"]
    assert row(lines, V6)[1:4] == ["/122", str(2**80), "2"]
    assert "BLOCK" not in [line.split()[0] for line in lines if line]  # no --show-blocks
    for ip in a:
        assert row(lines, ip)[1:5] == [NODE, "e2e/pod-a", "eth0", "pod-a"]
    for ip in b:
        assert row(lines, ip)[1:5] == [NODE, "e2e/pod-b", "eth0", "pod-b"]


def test_show_json_lists_both_pods_with_their_addresses(ctl: Ctl) -> None:
    """Acceptance (unit tier): after two ADDs the JSON maps each address to its pod."""
    a = ctl.add("pod-a")
    b = ctl.add("pod-b")
    data = ctl.json("ipam", "show")
    assert data["store"] == f"file store {ctl.data_dir}"
    assert "blocks" not in data
    by_pod: dict[str, list[str]] = {}
    for alloc in data["allocations"]:
        by_pod.setdefault(alloc["pod"], []).append(alloc["ip"])
    assert by_pod == {"e2e/pod-a": a, "e2e/pod-b": b}
    first = data["allocations"][0]
    assert first == {
        **first,
        "handle": f"{NET}:pod-a:eth0",
        "node": NODE,
        "network": NET,
        "container_id": "pod-a",
        "ifname": "eth0",
        "netns": str(ctl.netns("pod-a")),
    }
    assert isinstance(first["time"], float)
    pools = {p["cidr"]: p for p in data["pools"]}
    assert pools[V4] == {
        "cidr": V4,
        "block_size": 26,
        "disabled": False,
        "total": 65536,
        "in_use": 2,
        "reserved": 4,
        "free": 65530,
        "blocks": 1,
    }
    assert pools[V6]["in_use"] == 2


def test_show_json_after_two_adds_through_the_ipam_plugin(ctl: Ctl) -> None:
    """The same acceptance with the attributes tabby-ipam itself records (skel.run)."""
    plugin_conf = json.loads(ctl.conf.read_text())
    stdin = json.dumps({"cniVersion": "1.1.0", "name": NET, **plugin_conf["plugins"][0]}).encode()
    results = {}
    for pod in ("web-1", "web-2"):
        env = {
            "CNI_COMMAND": "ADD",
            "CNI_CONTAINERID": f"cid-{pod}",
            "CNI_NETNS": f"/run/netns/{pod}",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"IgnoreUnknown=1;K8S_POD_NAMESPACE=shop;K8S_POD_NAME={pod}",
        }
        rc, out = skel.run(ipam_plugin.HANDLERS, env, stdin)
        assert rc == 0, out
        results[pod] = sorted(ip["address"].split("/")[0] for ip in json.loads(out)["ips"])
    data = ctl.json("ipam", "show")
    listed: dict[str, list[str]] = {}
    for alloc in data["allocations"]:
        listed.setdefault(alloc["pod"], []).append(alloc["ip"])
        assert alloc["node"] == NODE
        assert alloc["netns"] == f"/run/netns/{alloc['pod'].split('/')[1]}"
    assert {k: sorted(v) for k, v in listed.items()} == {
        "shop/web-1": results["web-1"],
        "shop/web-2": results["web-2"],
    }
    table = ok(ctl.run("ipam", "show"))
    for pod, ips in results.items():
        for ip in ips:
            assert row(table, ip)[2] == f"shop/{pod}"


def test_show_blocks_table_and_json(ctl: Ctl) -> None:
    a = ctl.add("pod-a")
    ctl.add("pod-b")
    v4_block, v6_block = ctl.block_of(a[0]), ctl.block_of(a[1])
    lines = ok(ctl.run("ipam", "show", "--show-blocks"))
    assert row(lines, "BLOCK") == ["BLOCK", "POOL", "AFFINITY", "IN", "USE", "FREE"]
    assert row(lines, v4_block)[1:] == [V4, f"host:{NODE}", "2", "62"]
    assert row(lines, v6_block)[1:] == [V6, f"host:{NODE}", "2", "62"]
    data = ctl.json("ipam", "show", "--show-blocks")
    assert data["blocks"] == [
        {"cidr": v4_block, "pool": V4, "node": NODE, "in_use": 2, "free": 62},
        {"cidr": v6_block, "pool": V6, "node": NODE, "in_use": 2, "free": 62},
    ]


def test_show_ip_owned(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    lines = ok(ctl.run("ipam", "show", "--ip", ips[0]))
    fields = {line.split()[0]: line.split(None, 1)[1] for line in lines[1:]}
    assert lines[0].split() == ["FIELD", "VALUE"]
    assert fields["IP"] == ips[0]
    assert fields["HANDLE"] == f"{NET}:pod-a:eth0"
    assert fields["BLOCK"] == ctl.block_of(ips[0])
    assert fields["NODE"] == NODE
    assert fields["POD"] == "e2e/pod-a"
    assert fields["IFNAME"] == "eth0"
    assert fields["POD_UID"] == "-"
    assert fields["TIME"].endswith("Z")
    data = ctl.json("ipam", "show", "--ip", ips[1])
    assert data["allocated"] is True
    assert (data["ip"], data["pod"], data["container_id"]) == (ips[1], "e2e/pod-a", "pod-a")


@pytest.mark.parametrize("ip", ["10.244.7.7", "10.99.0.1", "fd00:10:244::99"])
def test_show_ip_not_owned(ctl: Ctl, ip: str) -> None:
    ctl.add("pod-a")
    assert ok(ctl.run("ipam", "show", "--ip", ip)) == [f"{ip} is not allocated"]
    assert ctl.json("ipam", "show", "--ip", ip) == {"ip": ip, "allocated": False}


def test_show_ip_invalid_is_one_line(ctl: Ctl) -> None:
    assert "not-an-ip" in one_line_error(ctl.run("ipam", "show", "--ip", "not-an-ip"))


def test_show_on_an_empty_store_creates_nothing(ctl: Ctl) -> None:
    lines = ok(ctl.run("ipam", "show"))
    assert lines[0] == f"file store {ctl.data_dir} ({ctl.conf})"
    assert ctl.json("ipam", "show")["pools"] == []
    assert ctl.json("ipam", "show")["allocations"] == []
    assert not ctl.data_dir.exists()


def test_invalid_output_format_is_a_usage_error(ctl: Ctl) -> None:
    result = ctl.run("ipam", "show", "-o", "yaml")
    assert result.exit_code == 2
    assert "yaml" in result.stderr


# == ipam check: the store ==================================================================


def test_check_clean_store_and_node(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ctl.add("pod-b", v6=False)
    result = ctl.run("ipam", "check")
    assert ok(result) == [f"no problems found (file store {ctl.data_dir}, node {NODE})"]
    assert ctl.json("ipam", "check") == {"store": [], "node": [], "node_name": NODE, "ok": True}


def test_check_empty_store(ctl: Ctl) -> None:
    assert ctl.run("ipam", "check").exit_code == 0


def _drop_handle(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    store = ctl.store()
    with store.lock():
        doc = store.get("handle", f"{NET}:pod-a:eth0")
        assert doc is not None
        store.delete("handle", f"{NET}:pod-a:eth0", doc.revision)
    return "allocation-without-handle", ctl.block_of(ips[0])


def _unlist_block(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """An address allocated in a block the handle document does not list."""
    block = ctl.block_of(ips[0])
    ctl.edit("handle", f"{NET}:pod-a:eth0", lambda d: d["blocks"].remove(block))
    return "handle-missing-block", f"{NET}:pod-a:eth0"


def _duplicate_block(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """A second (overlapping /27) block holding the same address: one address twice."""
    block = ctl.block_of(ips[0])
    store = ctl.store()
    doc = store.get("block", block)
    assert doc is not None
    data = copy.deepcopy(doc.data)
    net = ipaddress.ip_network(block)
    dup = str(ipaddress.ip_network(f"{net.network_address}/27"))
    data["cidr"] = dup
    data["allocations"] = data["allocations"][:32]
    data["unallocated"] = [o for o in data["unallocated"] if o < 32]
    with store.lock():
        store.put("block", dup, data, None)
    return "block-overlap", dup


def _free_and_used(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """An allocated ordinal also listed free: the next ADD could get the same address."""
    block = ctl.block_of(ips[0])
    ordinal = int(ipaddress.ip_address(ips[0])) - int(ipaddress.ip_network(block).network_address)
    ctl.edit("block", block, lambda d: d["unallocated"].insert(0, ordinal))
    return "double-state", block


def _block_outside_its_pool(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """Addresses outside their pool: the block claims a pool that does not contain it."""
    ctl.ipam().add_pool(PoolSpec("10.99.0.0/16"))
    block = ctl.block_of(ips[0])
    ctl.edit("block", block, lambda d: d.update(pool="10.99.0.0/16"))
    return "block-outside-pool", block


def _block_of_no_pool(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    block = ctl.block_of(ips[0])
    ctl.edit("block", block, lambda d: d.update(pool="10.98.0.0/16"))
    return "block-outside-pools", block


def _address_beyond_its_block(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    """An allocation past the end of its block cannot be represented: the document is
    reported as corrupt (naming the file)."""
    block = ctl.block_of(ips[0])
    ctl.edit("block", block, lambda d: d["allocations"].append(d["allocations"][-1]))
    return "corrupt", ctl.store().location("block", block)


def _seq_ahead(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    block = ctl.block_of(ips[0])
    ordinal = int(ipaddress.ip_address(ips[0])) - int(ipaddress.ip_network(block).network_address)
    ctl.edit("block", block, lambda d: d["allocations"][ordinal].update(seq=d["seq"] + 5))
    return "seq", block


def _truncated_handle(ctl: Ctl, ips: list[str]) -> tuple[str, str]:
    path = ctl.store().location("handle", f"{NET}:pod-b:eth0")
    Path(path).write_text('{"format": 1, "kind": "han')
    return "corrupt", path


@pytest.mark.parametrize(
    "inject",
    [
        _drop_handle,
        _unlist_block,
        _duplicate_block,
        _free_and_used,
        _block_outside_its_pool,
        _block_of_no_pool,
        _address_beyond_its_block,
        _seq_ahead,
        _truncated_handle,
    ],
)
def test_check_finds_store_faults(
    ctl: Ctl, inject: Callable[[Ctl, list[str]], tuple[str, str]]
) -> None:
    ips = ctl.add("pod-a")
    ctl.add("pod-b")
    assert ctl.run("ipam", "check").exit_code == 0
    kind, subject = inject(ctl, ips)
    result = ctl.run("ipam", "check")
    assert result.exit_code == 1, result.output
    assert row(result.stdout.splitlines(), "SEVERITY") == ["SEVERITY", "KIND", "SUBJECT", "PROBLEM"]
    assert any(
        line.split()[:3] == ["error", kind, subject] for line in result.stdout.splitlines()
    ), result.stdout
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    assert {"severity": "error", "kind": kind, "subject": subject} in [
        {k: p[k] for k in ("severity", "kind", "subject")} for p in data["store"]
    ]


def test_check_handle_whose_block_entry_is_gone_store_only(ctl: Ctl) -> None:
    """A handle listing a block that no longer holds its address, with no attachment on
    this node to compare with (another node's pod): the store alone cannot tell it from what
    a kill -9 in the middle of an ADD leaves (ipam/DESIGN.md), so it is listed as a
    leftover and does not fail check."""
    ips = ctl.add("pod-a", node="node-b", veth=False, netns=False)
    ctl.drop_block_entry(ips[0])
    result = ctl.run("ipam", "check")
    assert result.exit_code == 0, result.output
    assert row(result.stdout.splitlines(), "leftover")[1:3] == [
        "handle-extra-block",
        f"{NET}:pod-a:eth0",
    ]
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is True
    assert [(p["severity"], p["kind"]) for p in data["store"]] == [
        ("leftover", "handle-extra-block")
    ]


def test_check_handle_whose_block_entry_is_gone_for_a_live_pod(ctl: Ctl) -> None:
    """The same fault while the pod lives: its address could be handed out again. The
    node check sees the host route (and veth) with no allocation: exit 1."""
    ips = ctl.add("pod-a")
    single = ctl.add("pod-b", v6=False)
    hid_a, hid_b = f"{NET}:pod-a:eth0", f"{NET}:pod-b:eth0"
    ctl.drop_block_entry(ips[0])
    ctl.drop_block_entry(single[0])
    result = ctl.run("ipam", "check")
    assert result.exit_code == 1, result.output
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    got = findings(data)
    veth_a = host_veth_name("cali", NET, "pod-a", "eth0")
    veth_b = host_veth_name("cali", NET, "pod-b", "eth0")
    assert ("handle-extra-block", hid_a) in got
    assert ("handle-extra-block", hid_b) in got
    assert ("route-without-allocation", veth_a) in got
    assert ("route-without-allocation", veth_b) in got
    # pod-b has no address left at all: its tagged veth is an orphan too
    assert ("veth-without-allocation", veth_b) in got
    assert ("veth-without-allocation", veth_a) not in got
    messages = " ".join(p["message"] for p in data["node"])
    assert ips[0] in messages
    assert single[0] in messages


# == ipam check: this node ==================================================================


def test_check_finds_a_deleted_netns(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ips = ctl.add("pod-b")
    ctl.netns("pod-b").unlink()
    result = ctl.run("ipam", "check")
    assert result.exit_code == 1
    cells = row(result.stdout.splitlines(), "node")
    assert cells[1:3] == ["netns-gone", f"{NET}:pod-b:eth0"]
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["store"] == []
    (finding,) = data["node"]
    assert finding["kind"] == "netns-gone"
    assert str(ctl.netns("pod-b")) in finding["message"]
    assert all(ip in finding["message"] for ip in ips)


def test_check_finds_a_removed_host_veth(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ctl.add("pod-b")
    gone = host_veth_name("cali", NET, "pod-b", "eth0")
    ctl.veths = [v for v in ctl.veths if v.name != gone]
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    assert [(f["kind"], f["subject"]) for f in data["node"]] == [
        ("host-veth-gone", f"{NET}:pod-b:eth0")
    ]
    assert gone in data["node"][0]["message"]
    assert ctl.run("ipam", "check").exit_code == 1


def test_check_finds_a_veth_and_a_route_without_allocation(ctl: Ctl) -> None:
    ctl.add("pod-a")
    orphan = ctl.add_veth("pod-x", ["10.244.200.9"])
    stray = ctl.veths[0]
    ctl.veths[0] = HostVeth(
        stray.name,
        stray.index,
        stray.up,
        stray.alias,
        (*stray.routes, ipaddress.ip_network("10.244.201.1/32")),
    )
    # A cali* veth that tabby did not make (no tabby: alias) is not tabby's business,
    # but a host route through it to an address not allocated here still is reported.
    foreign = ctl.add_veth("pod-y", [], alias="")
    data = json.loads(ctl.run("ipam", "check", "-o", "json").stdout)
    assert data["ok"] is False
    assert findings(data) == {
        ("veth-without-allocation", orphan),
        ("route-without-allocation", orphan),
        ("route-without-allocation", stray.name),
    }
    assert foreign not in {f["subject"] for f in data["node"]}
    lines = ctl.run("ipam", "check").stdout.splitlines()
    assert any("10.244.201.1/32" in line for line in lines)


def test_check_ignores_other_nodes_allocations(ctl: Ctl) -> None:
    ctl.add("pod-a")
    ctl.add("remote", node="node-b", netns=False, veth=False)
    assert ctl.json("ipam", "check")["ok"] is True
    # ... unless this node is told it is node-b
    data = json.loads(ctl.run("--node", "node-b", "ipam", "check", "-o", "json").stdout)
    assert data["node_name"] == "node-b"
    kinds = {(f["kind"], f["subject"]) for f in data["node"]}
    assert ("netns-gone", f"{NET}:remote:eth0") in kinds
    assert ("host-veth-gone", f"{NET}:remote:eth0") in kinds


def test_check_dataplane_failure_is_one_line(ctl: Ctl, monkeypatch: pytest.MonkeyPatch) -> None:
    ctl.add("pod-a")

    def broken(prefix: str) -> list[HostVeth]:
        raise CniError(Code.DATAPLANE, "netlink dump failed", "EPERM")

    monkeypatch.setattr(dataplane, "list_host_veths", broken)
    assert "cannot list host veths" in one_line_error(ctl.run("ipam", "check"))


# == ipam release ===========================================================================


def test_release_by_ip(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    assert ok(ctl.run("ipam", "release", "--ip", ips[0])) == [f"released {ips[0]}"]
    assert ctl.ipam().who_owns(ips[0]) is None
    assert ctl.ipam().who_owns(ips[1]) is not None  # the other family stays
    assert ctl.json("ipam", "release", "--ip", ips[1]) == {"released": [ips[1]]}
    assert ctl.ipam().allocations() == []
    assert ctl.store().list_keys("handle") == []  # the empty handle went with it
    again = ctl.run("ipam", "release", "--ip", ips[0])
    assert (again.exit_code, again.stdout) == (1, "nothing to release\n")


def test_release_by_handle(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    kept = ctl.add("pod-b")
    result = ctl.run("ipam", "release", "--handle", f"{NET}:pod-a:eth0")
    assert ok(result) == [f"released {', '.join(ips)}"]
    assert [str(o.ip) for o in ctl.ipam().allocations()] == kept
    data = json.loads(
        ctl.run("ipam", "release", "--handle", f"{NET}:pod-b:eth0", "-o", "json").stdout
    )
    assert data == {"released": kept}
    missing = ctl.run("ipam", "release", "--handle", f"{NET}:pod-b:eth0", "-o", "json")
    assert missing.exit_code == 1
    assert json.loads(missing.stdout) == {"released": []}


@pytest.mark.parametrize(
    "args", [[], ["--ip", "10.244.0.9", "--handle", f"{NET}:pod-a:eth0"], ["--ip", ""]]
)
def test_release_needs_exactly_one_of_ip_or_handle(ctl: Ctl, args: list[str]) -> None:
    ctl.add("pod-a")
    result = ctl.run("ipam", "release", *args)
    assert result.exit_code == 2
    assert "give exactly one of --ip or --handle" in result.stderr
    assert len(ctl.ipam().allocations()) == 2


@pytest.mark.parametrize(("flag", "value"), [("--handle", "no-colons"), ("--ip", "10.244.0.")])
def test_release_invalid_value_is_one_line(ctl: Ctl, flag: str, value: str) -> None:
    assert value in one_line_error(ctl.run("ipam", "release", flag, value))


# == ipam gc ================================================================================


@pytest.fixture
def leaks(ctl: Ctl) -> dict[str, list[str]]:
    """Attachments of this node in every state GC must tell apart."""
    return {
        # after a reboot: netns and host veth gone, allocation old -> released
        "leaked": ctl.add("leaked", netns=False, veth=False),
        "leaked-too": ctl.add("leaked-too", netns=False, veth=False, v6=False),
        # netns path gone but the veth lives (e.g. netns held by a process) -> kept
        "veth-alive": ctl.add("veth-alive", netns=False, veth=True),
        # veth gone but netns there (half-torn-down, DEL will finish) -> kept
        "netns-alive": ctl.add("netns-alive", netns=True, veth=False),
        # everything alive -> kept
        "alive": ctl.add("alive"),
        # gone, but younger than the grace period -> kept
        "young": ctl.add("young", netns=False, veth=False, age=5),
        # gone, but another node's -> kept
        "remote": ctl.add("remote", node="node-b", netns=False, veth=False),
    }


def test_gc_dry_run_lists_only_leaks_and_changes_nothing(
    ctl: Ctl, leaks: dict[str, list[str]]
) -> None:
    before = ctl.ipam().allocations()
    data = ctl.json("ipam", "gc", "--dry-run")
    assert data == {
        "dry_run": True,
        "stale": {
            f"{NET}:leaked:eth0": leaks["leaked"],
            f"{NET}:leaked-too:eth0": leaks["leaked-too"],
        },
    }
    lines = ok(ctl.run("ipam", "gc", "--dry-run"))
    assert row(lines, f"{NET}:leaked:eth0")[1:] == [f"{leaks['leaked'][0]},", leaks["leaked"][1]]
    assert lines[-1] == "would release 3 addresses"
    assert ctl.ipam().allocations() == before


def test_gc_releases_this_nodes_leaks_only(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    result = ctl.run("ipam", "gc")
    lines = ok(result)
    assert lines[-1] == "released 3 addresses"
    assert row(lines, f"{NET}:leaked-too:eth0")[1:] == leaks["leaked-too"]
    left = {str(o.ip) for o in ctl.ipam().allocations()}
    gone = set(leaks["leaked"] + leaks["leaked-too"])
    assert left == {ip for ips in leaks.values() for ip in ips} - gone
    assert f"{NET}:leaked:eth0" not in ctl.store().list_keys("handle")
    # nothing more to do
    assert ok(ctl.run("ipam", "gc")) == [f"no leaked allocations on node {NODE}"]


def test_gc_grace(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    data = ctl.json("ipam", "gc", "--grace", "0")
    assert data["dry_run"] is False
    assert set(data["released"]) == {
        f"{NET}:leaked:eth0",
        f"{NET}:leaked-too:eth0",
        f"{NET}:young:eth0",
    }
    assert data["released"][f"{NET}:young:eth0"] == leaks["young"]


def test_gc_long_grace_keeps_everything(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    assert ctl.json("ipam", "gc", "--grace", "86400") == {"dry_run": False, "released": {}}
    assert len(ctl.ipam().allocations()) == sum(len(v) for v in leaks.values())


def test_gc_as_another_node(ctl: Ctl, leaks: dict[str, list[str]]) -> None:
    data = json.loads(ctl.run("--node", "node-b", "ipam", "gc", "-o", "json").stdout)
    assert data["released"] == {f"{NET}:remote:eth0": leaks["remote"]}


# == pools ==================================================================================


def test_pool_list_empty(ctl: Ctl) -> None:
    assert ok(ctl.run("pool", "list")) == [
        "no pools yet (a pool is created on the first ADD that needs it)"
    ]
    assert ctl.json("pool", "list") == []


def test_pool_add_and_list(ctl: Ctl) -> None:
    assert ok(ctl.run("pool", "add", "10.50.0.0/16", "--block-size", "24")) == [
        "pool 10.50.0.0/16 added"
    ]
    assert ok(ctl.run("pool", "add", "fd00:50::/64")) == ["pool fd00:50::/64 added"]
    lines = ok(ctl.run("pool", "list"))
    assert row(lines, "10.50.0.0/16")[1:] == ["/24", "65536", "0", "0", "65536", "0", "enabled"]
    assert row(lines, "fd00:50::/64")[1] == "/122"
    data = ctl.json("pool", "list")
    assert [p["cidr"] for p in data] == ["10.50.0.0/16", "fd00:50::/64"]
    assert data[0]["block_size"] == 24
    # the new pool serves addresses
    ip = ctl.add("pod-a", pools=("10.50.0.0/16",), v6=False)[0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("10.50.0.0/16")
    assert ctl.json("pool", "list")[0]["in_use"] == 1


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["10.50.0.0/16"], "overlaps"),  # exists already
        (["10.50.3.0/24"], "overlaps"),
        (["10.51.0.1/16"], "10.51.0.1/16"),  # host bits
        (["nonsense"], "nonsense"),
        (["10.52.0.0/16", "--block-size", "12"], "block size"),
        (["10.53.0.0/28"], "smaller than one block"),
    ],
)
def test_pool_add_refusals_are_one_line(ctl: Ctl, args: list[str], needle: str) -> None:
    ctl.run("pool", "add", "10.50.0.0/16")
    assert needle in one_line_error(ctl.run("pool", "add", *args))


def test_pool_disable_and_enable(ctl: Ctl) -> None:
    ctl.add("pod-a", v6=False)
    assert ok(ctl.run("pool", "disable", V4)) == [f"pool {V4} disabled"]
    assert row(ok(ctl.run("pool", "list")), V4)[-1] == "disabled"
    assert ctl.json("pool", "list")[0]["disabled"] is True
    assert ctl.json("ipam", "show")["pools"][0]["disabled"] is True
    # existing allocations stay; a disabled pool serves no new address ...
    assert len(ctl.ipam().allocations()) == 1
    with pytest.raises(NoAddressAvailable, match="disabled"):
        ctl.add("pod-b", v6=False)
    # ... and another pool serves instead
    ctl.run("pool", "add", "10.60.0.0/16")
    ip = ctl.add("pod-c", pools=(V4, "10.60.0.0/16"), v6=False)[0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network("10.60.0.0/16")
    # disabling twice is fine
    assert ctl.run("pool", "disable", V4).exit_code == 0
    assert ok(ctl.run("pool", "enable", V4)) == [f"pool {V4} enabled"]
    assert row(ok(ctl.run("pool", "list")), V4)[-1] == "enabled"
    ip = ctl.add("pod-d", v6=False)[0]
    assert ipaddress.ip_address(ip) in ipaddress.ip_network(V4)


@pytest.mark.parametrize("verb", ["disable", "enable", "delete"])
def test_pool_verbs_on_a_missing_pool(ctl: Ctl, verb: str) -> None:
    ctl.run("pool", "add", V4)
    assert "no such pool: 10.77.0.0/16" in one_line_error(ctl.run("pool", verb, "10.77.0.0/16"))


def test_pool_delete_refuses_a_pool_in_use(ctl: Ctl) -> None:
    ips = ctl.add("pod-a", v6=False)
    block = ctl.block_of(ips[0])
    line = one_line_error(ctl.run("pool", "delete", V4))
    assert "pool in use" in line
    assert block in line
    assert [p["cidr"] for p in ctl.json("pool", "list")] == [V4, V6]
    assert ctl.ipam().who_owns(ips[0]) is not None


def test_pool_delete_empty_pool(ctl: Ctl) -> None:
    ips = ctl.add("pod-a", v6=False)
    ctl.run("ipam", "release", "--ip", ips[0])
    ctl.veths.clear()  # the pod is gone
    assert ok(ctl.run("pool", "delete", V4)) == [f"pool {V4} deleted"]
    assert [p["cidr"] for p in ctl.json("pool", "list")] == [V6]
    # its (empty) block went with it
    assert ctl.json("ipam", "show", "--show-blocks")["blocks"] == []
    assert ctl.json("ipam", "check")["ok"] is True


# == settings and helpful errors ============================================================


def test_conf_missing_file(ctl: Ctl) -> None:
    missing = ctl.tmp / "nope.conflist"
    line = one_line_error(CliRunner().invoke(cli, ["--conf", str(missing), "ipam", "show"]))
    assert line == f"Error: cannot read {missing}: No such file or directory"


def test_conf_without_tabby(ctl: Ctl) -> None:
    other = ctl.tmp / "87-bridge.conflist"
    other.write_text(
        json.dumps({"cniVersion": "1.0.0", "name": "b", "plugins": [{"type": "bridge"}]})
    )
    line = one_line_error(CliRunner().invoke(cli, ["--conf", str(other), "pool", "list"]))
    assert line == f"Error: {other} has no plugin of type tabby"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "is not valid JSON"),
        ('["a list"]', "has no plugin of type tabby"),
        ('{"name": "n", "plugins": [{"type": "tabby", "ipam": "file"}]}', "not a JSON object"),
        (
            '{"name": "n", "plugins": [{"type": "tabby", "ipam": {"block_size_ipv4": 99}}]}',
            "block_size_ipv4",
        ),
        (
            '{"name": "n", "plugins": [{"type": "tabby", "ipam": {"datastore_type": "zk"}}]}',
            "datastore_type",
        ),
        (
            '{"name": "n", "plugins": [{"type": "tabby", "ipam": {"data_dir": "rel/dir"}}]}',
            "absolute",
        ),
    ],
)
def test_conf_unusable(ctl: Ctl, text: str, needle: str) -> None:
    ctl.conf.write_text(text)
    line = one_line_error(ctl.run("ipam", "show"))
    assert needle in line
    assert str(ctl.conf) in line


def test_single_plugin_conf_is_accepted(ctl: Ctl) -> None:
    """A .conf (one plugin, no "plugins" list) as the runtimes' test tools write it."""
    ctl.add("pod-a")
    single = ctl.tmp / "tabby.conf"
    single.write_text(
        json.dumps(
            {
                "name": NET,
                "type": "tabby",
                "nodename": NODE,
                "ipam": {"data_dir": str(ctl.data_dir)},
            }
        )
    )
    result = CliRunner().invoke(cli, ["--conf", str(single), "ipam", "show", "-o", "json"])
    assert len(json.loads(result.stdout)["allocations"]) == 2


def test_corrupt_store_file_is_named(ctl: Ctl) -> None:
    """Store unreadable: exit 1, one line naming the file, no traceback, for every command
    that needs the document."""
    ctl.add("pod-a")
    pool_file = Path(ctl.store().location("pool", V4))
    pool_file.write_text("{truncat")
    for args in (
        ["ipam", "show"],
        ["ipam", "show", "-o", "json"],
        ["ipam", "show", "--ip", "10.244.9.9"],
        ["pool", "list"],
        ["pool", "add", "10.70.0.0/16"],
        ["pool", "disable", V4],
        ["pool", "delete", V4],
    ):
        line = one_line_error(ctl.run(*args))
        assert str(pool_file) in line, (args, line)
        assert "truncated or not JSON" in line
    # check lists it instead of failing on it
    data = ctl.json("ipam", "check")
    assert ("corrupt", str(pool_file)) in findings(data)
    assert ctl.run("ipam", "check").exit_code == 1


def test_corrupt_block_fails_release_naming_it(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    block_file = Path(ctl.store().location("block", ctl.block_of(ips[0])))
    block_file.write_text("")
    line = one_line_error(ctl.run("ipam", "release", "--handle", f"{NET}:pod-a:eth0"))
    assert f"{block_file}: empty file" in line
    line = one_line_error(ctl.run("ipam", "show", "--ip", ips[0]))
    assert str(block_file) in line


def test_store_not_readable_without_root(ctl: Ctl, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a non-root user the 0700 store cannot be opened: say so, name it, suggest root."""
    ctl.add("pod-a")

    def denied(self: FileStore, *, create: bool) -> int | None:
        raise _dir_error(self.data_dir, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))

    monkeypatch.setattr(FileStore, "_open_root", denied)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for args in (["ipam", "show"], ["ipam", "check"], ["pool", "list"], ["ipam", "gc"]):
        line = one_line_error(ctl.run(*args))
        assert str(ctl.data_dir) in line
        assert line.endswith("Permission denied: run tabbyctl as root"), line
    # as root the same failure is not blamed on privileges
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    line = one_line_error(ctl.run("ipam", "show"))
    assert line.endswith(f"{ctl.data_dir}: Permission denied")


def test_no_conflist_means_built_in_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "net.d"
    conf_dir.mkdir()
    (conf_dir / "87-bridge.conflist").write_text(
        json.dumps({"name": "b", "plugins": [{"type": "bridge"}]})
    )
    monkeypatch.setattr(views, "DEFAULT_CONF_DIR", str(conf_dir))
    data_dir = tmp_path / "store"
    result = CliRunner().invoke(cli, ["--data-dir", str(data_dir), "ipam", "show"])
    assert ok(result)[0] == f"file store {data_dir} (built-in defaults)"
    s = views.load_settings(None)
    assert (s.source, s.network, s.ipam.data_dir) == (
        "built-in defaults",
        "k8s-pod-network",
        "/var/lib/tabby/ipam",
    )
    assert s.ipam.ipv4_pools == ["10.244.0.0/16"]
    monkeypatch.setattr(views, "DEFAULT_CONF_DIR", str(tmp_path / "absent"))
    assert views.load_settings(None).source == f"built-in defaults (no {tmp_path / 'absent'})"


def test_default_conflist_is_the_first_with_tabby(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "net.d"
    conf_dir.mkdir()
    (conf_dir / "05-broken.conflist").write_text("{nope")
    (conf_dir / "07-bridge.conflist").write_text(json.dumps({"plugins": [{"type": "bridge"}]}))
    for n, node in (("10", "first"), ("20", "second")):
        (conf_dir / f"{n}-tabby.conflist").write_text(
            json.dumps(
                {
                    "name": f"net-{n}",
                    "plugins": [
                        {"type": "tabby", "nodename": node, "ipam": {"data_dir": f"/x/{n}"}}
                    ],
                }
            )
        )
    monkeypatch.setattr(views, "DEFAULT_CONF_DIR", str(conf_dir))
    result = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "s"), "ipam", "show"])
    assert ok(result)[0] == f"file store {tmp_path / 's'} ({conf_dir / '10-tabby.conflist'})"
    s = views.load_settings(None)
    assert (s.network, s.node, s.datastore.data_dir) == ("net-10", "first", "/x/10")
    s = views.load_settings(None, data_dir="/y", node="other")
    assert (s.node, s.datastore.data_dir) == ("other", "/y")


def test_data_dir_and_node_overrides(ctl: Ctl) -> None:
    ctl.add("pod-a")
    elsewhere = ctl.tmp / "elsewhere"
    result = ctl.run("--data-dir", str(elsewhere), "ipam", "show", "-o", "json")
    data = json.loads(result.stdout)
    assert (data["store"], data["allocations"]) == (f"file store {elsewhere}", [])
    assert (
        json.loads(ctl.run("--node", "n9", "ipam", "check", "-o", "json").stdout)["node_name"]
        == "n9"
    )


# == demo (its refusals; the demo itself runs in tests/e2e/test_ctl_e2e.py) ================


def test_demo_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    line = one_line_error(CliRunner().invoke(cli, ["demo"]))
    assert line == "Error: the demo creates network namespaces: run it as root"


def test_demo_needs_the_installed_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    line = one_line_error(CliRunner().invoke(cli, ["demo", "--cni-bin-dir", str(tmp_path)]))
    assert line == f"Error: {tmp_path / 'tabby'} not found or not executable: run ./build.sh first"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("pods", ["0", "51", "x"])
def test_demo_pod_count_is_checked(pods: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "--pods", pods])
    assert result.exit_code == 2
    assert "--pods" in result.stderr
