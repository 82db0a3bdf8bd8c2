"""``tabbyctl node diags``: one tarball an operator attaches to a bug report.

Collected on the node it runs on (its network namespace), each part on its own, so a part
that cannot be had (BIRD down, no nft, datastore unreachable) is recorded in
``manifest.json`` with the reason instead of failing the whole bundle:

===============================  ================================================================
``versions.json``                tabby, Python, kernel, and the versions of bird, nft, ip
``node/status.json``             what tabby-node last wrote (``<run-dir>/status.json``:
                                 node, backend, peers, VXLAN endpoints, problems)
``bird/bird.conf``               the rendered BIRD configuration (``<run-dir>/bird.conf``)
``bird/show-*.txt``              BIRD's answers on ``<run-dir>/bird.ctl``: ``show status``,
                                 ``show protocols all``, ``show route count``
``bird/bird.log``                the last lines of BIRD's log in the run directory
``kernel/*.txt``                 addresses, links, routes (all tables), neighbours, rules,
                                 the VXLAN devices' FDB (``ip``, ``bridge``)
``nftables/inet-tabby.txt``      ``nft list table inet tabby`` (the NetworkPolicy ruleset)
``logs/node.log``                the last lines of tabby-node's log (``--log-file``)
``ipam/node.json``               the IPAM view of this node: pools, its blocks, its allocations
``manifest.json``                every part with its source, size or error; redactions
===============================  ================================================================

Nothing secret goes in: no TLS key or certificate file is ever read, and every text is
passed through ``cni_protocol.redact`` (private keys in PEM form; values of fields and words that
look like passwords, tokens, secrets or keys; BIRD's ``password "..."``).
"""

from __future__ import annotations

import datetime as dt
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Required, TypedDict

import click

from cni_protocol.redact import redact_json, redact_text
from tabby_node import DEFAULT_NODE_LOG_FILE as DEFAULT_LOG_FILE
from tabbyctl.common import Ctx, run_dir_option

if TYPE_CHECKING:
    from tabbyctl.views import Settings

LOG_LINES = 2000
COMMAND_TIMEOUT = 20.0
BIRD_TIMEOUT = 5.0
DATASTORE_TIMEOUT = 5.0
BIRD_COMMANDS = ("show status", "show protocols all", "show route count")
VXLAN_DEVICES = ("vxlan.tabby", "vxlan-v6.tabby")

#: kernel/<name>.txt -> the command (run in the namespace tabbyctl runs in: the node's)
KERNEL_COMMANDS: dict[str, list[str]] = {
    "addresses": ["ip", "-d", "address", "show"],
    "links": ["ip", "-d", "-s", "link", "show"],
    "routes-v4": ["ip", "-4", "route", "show", "table", "all"],
    "routes-v6": ["ip", "-6", "route", "show", "table", "all"],
    "rules": ["ip", "rule", "show"],
    "neighbours": ["ip", "neighbour", "show"],
    **{f"fdb-{dev}": ["bridge", "fdb", "show", "dev", dev] for dev in VXLAN_DEVICES},
}
VERSION_COMMANDS: dict[str, list[str]] = {
    "bird": ["bird", "--version"],
    "nft": ["nft", "--version"],
    "iproute2": ["ip", "-V"],
}
NFT_COMMAND = ["nft", "list", "table", "inet", "tabby"]

# -- the bundle ----------------------------------------------------------------------------------

Runner = Callable[[Sequence[str], float], tuple[int | None, str]]


def run_command(argv: Sequence[str], timeout: float) -> tuple[int | None, str]:
    """(exit status, stdout + stderr) of a command; None when it could not run."""
    try:
        proc = subprocess.run(
            list(argv),
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return None, f"{argv[0]}: not installed"
    except subprocess.TimeoutExpired:
        return None, f"timed out after {timeout:.0f} s"
    except OSError as e:
        return None, f"cannot run {argv[0]}: {e}"
    return proc.returncode, proc.stdout + proc.stderr


def tail(path: str, lines: int) -> str:
    """The last ``lines`` lines of a (possibly large) text file."""
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        size = f.tell()
        block = 1 << 16
        data = b""
        pos = size
        while pos > 0 and data.count(b"\n") <= lines:
            step = min(block, pos)
            pos -= step
            f.seek(pos)
            data = f.read(step) + data
    text = data.decode("utf-8", "replace").splitlines()[-lines:]
    return "\n".join(text) + ("\n" if text else "")


class Part(TypedDict, total=False):
    """One part in ``manifest.json``: its size and redactions, or why it is missing."""

    part: Required[str]
    source: Required[str]
    bytes: int
    redacted: int
    error: str


@dataclass
class Bundle:
    """Parts gathered in memory; ``manifest`` says where each came from or why it is not
    there."""

    parts: dict[str, bytes] = field(default_factory=dict)
    manifest: list[Part] = field(default_factory=list)
    redactions: int = 0

    def text(self, name: str, text: str, source: str) -> None:
        clean, n = redact_text(text)
        self.redactions += n
        self.parts[name] = clean.encode()
        self.manifest.append(
            {"part": name, "source": source, "bytes": len(self.parts[name]), "redacted": n}
        )

    def json(self, name: str, value: object, source: str) -> None:
        clean, n = redact_json(value)
        self.redactions += n
        self.parts[name] = (
            json.dumps(clean, indent=2, sort_keys=True, default=str) + "\n"
        ).encode()
        self.manifest.append(
            {"part": name, "source": source, "bytes": len(self.parts[name]), "redacted": n}
        )

    def missing(self, name: str, source: str, why: str) -> None:
        clean, _ = redact_text(why)
        self.manifest.append({"part": name, "source": source, "error": clean})

    def command(self, name: str, argv: Sequence[str], run: Runner) -> None:
        rc, out = run(argv, COMMAND_TIMEOUT)
        source = " ".join(argv)
        if rc is None:
            self.missing(name, source, out.strip())
            return
        self.text(name, f"$ {source}\n{out}" + ("" if rc == 0 else f"(exit status {rc})\n"), source)


def collect(
    run_dir: str,
    *,
    log_file: str | None = DEFAULT_LOG_FILE,
    log_lines: int = LOG_LINES,
    settings: Callable[[], Settings] | None = None,
    run: Runner | None = None,
) -> Bundle:
    """Everything ``node diags`` puts in the tarball. ``settings`` gives tabbyctl's
    datastore settings (``tabbyctl.views.Settings``) for the IPAM view."""
    from bird import CONF_NAME, CTL_NAME, LOG_NAME
    from bundle import __version__
    from tabby_node.status import STATUS_FILE, read_status

    run = run if run is not None else run_command
    b = Bundle()
    versions: dict[str, str | None] = {
        "tabby": __version__,
        "python": sys.version.split()[0],
        "kernel": " ".join(platform.uname()[2:4]),
        "machine": platform.machine(),
    }
    for tool, argv in VERSION_COMMANDS.items():
        rc, out = run(argv, COMMAND_TIMEOUT)
        versions[tool] = (out.strip().splitlines() or [""])[0] if rc == 0 else None
    b.json("versions.json", versions, "tabbyctl, " + ", ".join(VERSION_COMMANDS))

    status_path = os.path.join(run_dir, STATUS_FILE)
    status = read_status(run_dir)
    if status is None:
        b.missing(
            "node/status.json", status_path, "no readable status file: is tabby-node running?"
        )
    else:
        b.json("node/status.json", status, status_path)

    conf = os.path.join(run_dir, CONF_NAME)
    _file(b, "bird/bird.conf", conf, None)
    _bird(b, os.path.join(run_dir, CTL_NAME))
    _file(b, "bird/bird.log", os.path.join(run_dir, LOG_NAME), log_lines)

    for name, argv in KERNEL_COMMANDS.items():
        b.command(f"kernel/{name}.txt", argv, run)
    b.command("nftables/inet-tabby.txt", NFT_COMMAND, run)

    if log_file:
        _file(b, "logs/node.log", log_file, log_lines)
    else:
        b.missing("logs/node.log", "--log-file", "no log file given")

    node = str(status.get("node") or "") if status else ""
    if settings is None:
        b.missing("ipam/node.json", "datastore", "no datastore settings")
    else:
        try:
            b.json("ipam/node.json", ipam_view(settings(), node or None), "datastore")
        except Exception as e:
            b.missing("ipam/node.json", "datastore", f"{type(e).__name__}: {e}")
    return b


def _file(b: Bundle, name: str, path: str, lines: int | None) -> None:
    try:
        if lines is None:
            with open(path, encoding="utf-8", errors="replace") as f:
                text = f.read()
        else:
            text = tail(path, lines)
    except OSError as e:
        b.missing(name, path, e.strerror or str(e))
        return
    b.text(name, text, path if lines is None else f"{path} (last {lines} lines)")


def _bird(b: Bundle, ctl: str) -> None:
    from bird import BirdControl, BirdError

    try:
        with BirdControl(ctl, BIRD_TIMEOUT) as bird:
            for cmd in BIRD_COMMANDS:
                name = "bird/" + cmd.replace(" ", "-") + ".txt"
                try:
                    reply = bird.command(cmd)
                except BirdError as e:
                    b.missing(name, f"{ctl}: {cmd}", str(e))
                    continue
                b.text(name, "".join(f"{line.text}\n" for line in reply), f"{ctl}: {cmd}")
    except (BirdError, OSError) as e:
        for cmd in BIRD_COMMANDS:
            b.missing("bird/" + cmd.replace(" ", "-") + ".txt", f"{ctl}: {cmd}", str(e))


def ipam_view(settings: Settings, node: str | None) -> dict[str, object]:
    """Pools (cluster-wide), this node's blocks and allocations, as ``tabbyctl ipam show``
    computes them."""
    from tabbyctl import views

    me = node or settings.node
    ipam = settings.open(lock_timeout=DATASTORE_TIMEOUT)
    reserved = settings.ipam.reserved_networks
    rows = [views.owner_row(o) for o in ipam.allocations()]
    return {
        "node": me,
        "store": settings.describe_store(),
        "pools": [p._asdict() for p in ipam.pool_usage(reserved)],
        "blocks": [b._asdict() for b in ipam.block_usage(reserved) if b.node == me],
        "allocations": [r for r in rows if r["node"] == me],
    }


def write_tarball(b: Bundle, out_dir: str, node: str, now: float | None = None) -> str:
    """``<out_dir>/tabby-diags-<node>-<UTC time>.tar.gz`` (mode 0600); its path."""
    stamp = dt.datetime.fromtimestamp(now if now is not None else time.time(), tz=dt.UTC)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", node) or "node"
    base = f"tabby-diags-{safe}-{stamp.strftime('%Y%m%dT%H%M%SZ')}"
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, base + ".tar.gz")
    manifest = {
        "created": stamp.isoformat(),
        "node": node,
        "redactions": b.redactions,
        "parts": b.manifest,
    }
    parts = {**b.parts, "manifest.json": (json.dumps(manifest, indent=2) + "\n").encode()}
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w:gz") as tar:
        for name, data in parts.items():
            info = tarfile.TarInfo(f"{base}/{name}")
            info.size = len(data)
            info.mtime = int(stamp.timestamp())
            info.mode = 0o600
            tar.addfile(info, io.BytesIO(data))
    return path


def register(cli: click.Group) -> None:
    """``node diags`` under tabbyctl's ``node`` group (made here if it does not exist)."""
    node = cli.commands.get("node")
    if not isinstance(node, click.Group):
        node = click.Group("node", help="This node's tabby-node: status and diagnostics.")
        cli.add_command(node)
    node.add_command(diags_cmd)


@click.command("diags")
@click.option(
    "-o",
    "--output-dir",
    "out_dir",
    default=".",
    show_default=True,
    help="directory to write the tarball to",
)
@run_dir_option
@click.option(
    "--log-file",
    default=DEFAULT_LOG_FILE,
    show_default=True,
    envvar="TABBY_NODE_LOG_FILE",
    help="tabby-node's log file (env TABBY_NODE_LOG_FILE)",
)
@click.option(
    "--log-lines",
    type=click.IntRange(1, 1_000_000),
    default=LOG_LINES,
    show_default=True,
    help="how many of the last log lines to include",
)
@click.pass_obj
def diags_cmd(obj: Ctx, out_dir: str, run_dir: str, log_file: str, log_lines: int) -> None:
    """One tarball for a bug report: versions, node status, BIRD's configuration and
    sessions, routes, neighbours, FDB, the nftables ruleset, the last log lines and the IPAM
    view of this node. No TLS keys or certificates; secrets are redacted."""
    settings = obj.settings if obj is not None else None
    b = collect(run_dir, log_file=log_file, log_lines=log_lines, settings=settings)
    node = ""
    status = b.parts.get("node/status.json")
    if status:
        node = str(json.loads(status).get("node") or "")
    if not node and obj is not None:
        try:
            node = obj.settings().node
        except Exception:
            node = platform.node()
    try:
        path = write_tarball(b, out_dir, node or platform.node())
    except OSError as e:
        raise click.ClickException(f"cannot write the tarball in {out_dir}: {e}") from None
    failed = [p["part"] for p in b.manifest if "error" in p]
    click.echo(path)
    if failed:
        click.echo(f"not collected (see manifest.json): {', '.join(failed)}", err=True)
