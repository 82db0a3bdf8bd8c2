"""``tabbyctl node diags``, without root: a fake run directory (status file, BIRD's
configuration and log, a fake BIRD control socket), a node log, a private file store, and
the commands (ip, bridge, nft, versions) answered by a stand-in that records them.

What it proves: the tarball holds every part the issue lists, BIRD's answers come through
its control socket, the IPAM view holds this node's blocks and allocations only, a part
that cannot be had is named in the manifest instead of failing the bundle, and nothing
secret gets in (private keys, passwords, tokens; TLS key and certificate files never read).
"""

from __future__ import annotations

import json
import os
import stat
import tarfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner

from cni_protocol import redact
from datastore.file import FileStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from tabbyctl import diags
from tabbyctl.cli import cli
from tabbyctl.views import load_settings
from tests.unit.bird.fake_bird import FakeBird

NODE = "node-a"
POOL = "10.244.0.0/16"
PEM = "-----BEGIN EC PRIVATE KEY-----\nMHcCAQEEIFAKEFAKEFAKE\n-----END EC PRIVATE KEY-----"
SECRETS = ("hunter2", "s3cret-bgp", "MHcCAQEEIFAKEFAKEFAKE", "tok-123", "KEYFILECONTENT")

SHOW = {
    "show status": "1000-BIRD 2.0.12\n1011-Router ID is 10.0.0.1\n0013 Daemon is up and running\n",
    "show protocols all": (
        "2002-Name       Proto      Table      State  Since         Info\n"
        "1002-Mesh_10_0_0_2 BGP        ---        up     11:08:23.000  Established\n"
        "1006-  Description:    node-b\n"
        "0000 \n"
    ),
    "show route count": "0014 3 of 3 routes for 3 networks in table master4\n",
}


class Commands:
    """The stand-in for subprocess: canned answers; nft is missing on this 'node'."""

    def __init__(self) -> None:
        self.ran: list[list[str]] = []

    def __call__(self, argv: Sequence[str], timeout: float) -> tuple[int | None, str]:
        self.ran.append(list(argv))
        if argv[0] == "nft":
            return None, "nft: not installed"
        if argv[:2] == ["ip", "-V"]:
            return 0, "ip utility, iproute2-6.1.0\n"
        if argv[0] == "bird":
            return 0, "BIRD version 2.0.12\n"
        if "fdb" in argv:
            return 1, 'Cannot find device "vxlan.tabby"\n'
        return 0, f"output of {' '.join(argv)} password=hunter2\n"


@pytest.fixture
def node_dir(tmp_path: Path) -> Iterator[dict[str, Any]]:
    run = tmp_path / "run"
    run.mkdir()
    status = {
        "node": NODE,
        "backend": "bird",
        "node_ip": "10.0.0.1",
        "pid": 1,
        "problems": {"datastore: heartbeat": "etcd says token=tok-123"},
        "peers": [{"address": "10.0.0.2", "state": "Established"}],
        "etcd_key_file": "/etc/tabby/etcd.key",
        "password": "hunter2",
    }
    (run / "status.json").write_text(json.dumps(status))
    (run / "bird.conf").write_text(
        'router id 10.0.0.1;\nprotocol bgp Mesh_10_0_0_2 {\n  password "s3cret-bgp";\n}\n'
    )
    (run / "bird.log").write_text("".join(f"bird line {i}\n" for i in range(50)))
    # a key file next to everything else: never read
    (run / "etcd.key").write_text("KEYFILECONTENT\n")
    log = tmp_path / "node.log"
    log.write_text(
        "".join(f"node log line {i}\n" for i in range(5000))
        + f"a key in the log by mistake:\n{PEM}\nlast line\n"
    )
    data = tmp_path / "ipam"
    store = FileStore(str(data), lock_timeout=5)
    Ipam(store, NODE).ensure_pools([PoolSpec(POOL)])
    for node, n in ((NODE, 2), ("node-b", 3)):
        for i in range(n):
            Ipam(store, node).assign(
                AssignRequest(
                    handle_id=handle_id("net1", f"{node}-c{i}", "eth0"),
                    attrs={"node": node, "network": "net1", "container_id": f"{node}-c{i}"},
                    v4_pools=[POOL],
                )
            )
    conf = tmp_path / "10-tabby.conflist"
    conf.write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "net1",
                "plugins": [
                    {
                        "type": "tabby",
                        "nodename": NODE,
                        "ipam": {
                            "type": "tabby-ipam",
                            "data_dir": str(data),
                            "lock_timeout_seconds": 5,
                        },
                    }
                ],
            }
        )
    )
    bird = FakeBird(str(run / "bird.ctl"), SHOW)
    try:
        yield {"run": str(run), "log": str(log), "conf": str(conf), "bird": bird}
    finally:
        bird.close()


def members(path: str) -> dict[str, bytes]:
    with tarfile.open(path) as tar:
        out = {}
        for m in tar.getmembers():
            f = tar.extractfile(m)
            assert f is not None
            out[m.name.split("/", 1)[1]] = f.read()
        return out


def test_the_bundle_holds_every_part(node_dir: dict[str, Any], tmp_path: Path) -> None:
    run = Commands()
    b = diags.collect(
        node_dir["run"],
        log_file=node_dir["log"],
        log_lines=100,
        settings=lambda: load_settings(node_dir["conf"]),
        run=run,
    )
    path = diags.write_tarball(b, str(tmp_path / "out"), NODE, now=0)
    assert os.path.basename(path) == "tabby-diags-node-a-19700101T000000Z.tar.gz"
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    parts = members(path)
    for name in (
        "versions.json",
        "node/status.json",
        "bird/bird.conf",
        "bird/show-status.txt",
        "bird/show-protocols-all.txt",
        "bird/show-route-count.txt",
        "bird/bird.log",
        "kernel/addresses.txt",
        "kernel/routes-v4.txt",
        "kernel/routes-v6.txt",
        "kernel/neighbours.txt",
        "kernel/fdb-vxlan.tabby.txt",
        "logs/node.log",
        "ipam/node.json",
        "manifest.json",
    ):
        assert name in parts, name
    versions = json.loads(parts["versions.json"])
    assert versions["bird"] == "BIRD version 2.0.12"
    assert versions["iproute2"] == "ip utility, iproute2-6.1.0"
    assert versions["nft"] is None
    assert "Mesh_10_0_0_2" in parts["bird/show-protocols-all.txt"].decode()
    assert node_dir["bird"].received == list(diags.BIRD_COMMANDS)
    assert json.loads(parts["node/status.json"])["node"] == NODE
    assert ["ip", "-4", "route", "show", "table", "all"] in run.ran
    assert ["nft", "list", "table", "inet", "tabby"] in run.ran
    assert b"(exit status 1)" in parts["kernel/fdb-vxlan.tabby.txt"]
    # the last 100 lines of the log only (the 3-line key in them redacted to one)
    log = parts["logs/node.log"].decode().splitlines()
    assert (log[0], log[-1], len(log)) == ("node log line 4905", "last line", 98)
    # a part that could not be had is named, with why
    manifest = json.loads(parts["manifest.json"])
    errors = {p["part"]: p["error"] for p in manifest["parts"] if "error" in p}
    assert errors == {"nftables/inet-tabby.txt": "nft: not installed"}
    assert manifest["node"] == NODE


def test_the_ipam_view_is_this_nodes(node_dir: dict[str, Any]) -> None:
    b = diags.collect(
        node_dir["run"],
        log_file=None,
        settings=lambda: load_settings(node_dir["conf"]),
        run=Commands(),
    )
    view = json.loads(b.parts["ipam/node.json"])
    assert view["node"] == NODE
    assert {a["node"] for a in view["allocations"]} == {NODE}
    assert len(view["allocations"]) == 2
    assert [b["node"] for b in view["blocks"]] == [NODE]
    assert view["pools"][0]["in_use"] == 5  # the pool, cluster-wide


def test_nothing_secret_gets_in(node_dir: dict[str, Any], tmp_path: Path) -> None:
    b = diags.collect(
        node_dir["run"],
        log_file=node_dir["log"],
        settings=lambda: load_settings(node_dir["conf"]),
        run=Commands(),
    )
    parts = members(diags.write_tarball(b, str(tmp_path), NODE))
    for name, data in parts.items():
        for secret in SECRETS:
            assert secret.encode() not in data, (name, secret)
    assert b"[REDACTED EC PRIVATE KEY]" in parts["logs/node.log"]
    assert b"password [REDACTED]" in parts["bird/bird.conf"]
    status = json.loads(parts["node/status.json"])
    assert status["etcd_key_file"] == redact.REDACTED
    assert status["peers"][0]["state"] == "Established"  # the rest stays readable
    assert json.loads(parts["manifest.json"])["redactions"] >= 5
    assert not any(n.endswith((".key", ".crt", ".pem")) for n in parts)


@pytest.mark.parametrize(
    ("text", "clean"),
    [
        ('password "x";', "password [REDACTED];"),
        ("Authorization: Bearer abc.def", "Authorization: [REDACTED]"),
        ("ETCD_PASSWORD=abc rest", "ETCD_PASSWORD=[REDACTED] rest"),
        ('{"api_key": "zzz"}', '{"api_key": [REDACTED]}'),
        (
            "10.0.0.0/24 via 10.0.0.2 dev eth0 proto bird",
            "10.0.0.0/24 via 10.0.0.2 dev eth0 proto bird",
        ),
        ("-----BEGIN PRIVATE KEY-----\nAAAA", "[REDACTED PRIVATE KEY]"),  # cut off: still out
    ],
)
def test_redact_text(text: str, clean: str) -> None:
    assert redact.redact_text(text)[0] == clean
    assert redact.redact_text(clean)[1] == 0  # idempotent


def test_missing_run_dir_and_bird_are_reported_not_fatal(tmp_path: Path) -> None:
    b = diags.collect(str(tmp_path / "nothing"), log_file=None, settings=None, run=Commands())
    errors = {p["part"] for p in b.manifest if "error" in p}
    assert {"node/status.json", "bird/bird.conf", "bird/show-protocols-all.txt"} <= errors
    assert {"ipam/node.json", "logs/node.log"} <= errors
    assert "versions.json" in b.parts


def test_tabbyctl_node_diags(
    node_dir: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(diags, "run_command", Commands())
    out = tmp_path / "bundle"
    result = CliRunner().invoke(
        cli,
        [
            "--conf",
            node_dir["conf"],
            "node",
            "diags",
            "-o",
            str(out),
            "--run-dir",
            node_dir["run"],
            "--log-file",
            node_dir["log"],
            "--log-lines",
            "10",
        ],
    )
    assert result.exit_code == 0, result.output
    path = result.stdout.strip()
    assert path.startswith(str(out / "tabby-diags-node-a-"))
    parts = members(path)
    assert parts["logs/node.log"].decode().splitlines()[0] == "node log line 4995"
    assert len(json.loads(parts["ipam/node.json"])["allocations"]) == 2
