"""Shared set-up of the tabbyctl unit tests (tests/unit/tabbyctl/): a private file store
named by a conflist given with ``--conf``, fake host veths, a CliRunner, and output helpers.

The store is populated through the IPAM core (``Ipam.assign`` with the attributes the plugin
records) or through the ``tabby-ipam`` handlers via ``skel.run``. The node side of ``ipam
check`` / ``ipam gc`` reads the host veths through ``dataplane.list_host_veths``,
replaced here by a list of fakes; a pod's netns is a file under ``tmp_path`` (present = alive,
missing = gone). Test modules take the ``ctl`` fixture by importing ``ctl_fixture``.
"""

from __future__ import annotations

import copy
import ipaddress
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

import dataplane
from dataplane import HostVeth, host_veth_name
from datastore.file import FileStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from tabbyctl.cli import cli

NODE = "node-a"
NET = "net1"
V4 = "10.244.0.0/16"
V6 = "fd00:10:244::/48"
RESERVED = "10.244.0.0/30"


def invoke(argv: list[str], input: str | None = None) -> Result:
    """tabbyctl in-process (click's CliRunner): whatever it does, never a traceback, and
    a failure only as a clean exit."""
    result = CliRunner().invoke(cli, argv, input=input, prog_name="tabbyctl")
    assert "Traceback" not in result.output, result.output
    if result.exception is not None:
        assert isinstance(result.exception, SystemExit), repr(result.exception)
    return result


def without_datastore_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The datastore settings tabbyctl reads from the environment, unset for the test."""
    from cni_config.resolve import SOURCES

    for _flag, var in SOURCES.values():
        monkeypatch.delenv(var, raising=False)


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
        """Inject a fault: the block forgets the allocation."""
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
        return invoke(argv)

    def json(self, *args: str) -> Any:
        result = self.run(*args, "-o", "json")
        return json.loads(result.stdout)


@pytest.fixture(name="ctl")
def ctl_fixture(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctl:
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
