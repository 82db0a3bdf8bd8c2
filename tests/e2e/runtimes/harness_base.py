"""Plumbing shared by the runtime e2e tier: paths, the test pools, and process, mount and
wait helpers (every process is stopped by its PID, never by name)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[3]
TOOLS_BIN = REPO / "tests" / "e2e" / "tools" / "bin"
EXAMPLES = REPO / "conf-examples"

# Where tabby and tabby-ipam are installed; TABBY_E2E_BIN_DIR points elsewhere (a build's
# output) without installing.
TABBY_BIN_DIR = Path(os.environ.get("TABBY_E2E_BIN_DIR", "/opt/cni/bin"))
DEBIAN_CNI_DIR = Path("/usr/lib/cni")

POOL_V4 = ipaddress.ip_network("10.244.0.0/16")
POOL_V6 = ipaddress.ip_network("fd00:10:244::/48")
# A pool small enough to exhaust with a handful of pods (tests fill it until ADD fails).
TINY_V4 = ipaddress.ip_network("10.244.255.0/30")

NODE_NAME = "e2e-node"
# Directories the node overlays with its own tmpfs: pod netns mounts, libcni result caches,
# containerd shim sockets, and tabby-node's socket dir (a tabby-node running on the machine
# must not serve the node's plugin calls: it would work in the machine's namespaces).
PRIVATE_DIRS = (
    Path("/run/netns"),
    Path("/var/lib/cni"),
    Path("/run/containerd"),
    Path("/run/tabby"),
    Path("/var/lib/containers"),
)
UPLINK_NODE = "198.18.0.1/30"  # on uplink0 in the node
UPLINK_SINK = "198.18.0.2/30"  # on uplink1 in the sink namespace


def unique(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(4)}"


def run(
    args: Sequence[str],
    *,
    check: bool = True,
    timeout: float = 60,
    env: dict[str, str] | None = None,
    input: str | None = None,
) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        list(args),
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        input=input,
        stdin=None if input is not None else subprocess.DEVNULL,
    )
    if check and proc.returncode != 0:
        raise AssertionError(
            f"command failed ({proc.returncode}): {' '.join(args)}\n"
            f"stdout: {proc.stdout.strip()}\nstderr: {proc.stderr.strip()}"
        )
    return proc


def wait_for(what: str, probe: Any, timeout: float = 10.0, interval: float = 0.1) -> Any:
    """Call probe() until it returns something truthy; fail after timeout."""
    deadline = time.monotonic() + timeout
    last: Any = None
    while True:
        try:
            last = probe()
        except (AssertionError, OSError, subprocess.SubprocessError) as exc:
            last = exc
        else:
            if last:
                return last
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}: {last!r}")
        time.sleep(interval)


def stop_pid(proc: subprocess.Popen[Any] | None, *, grace: float = 10.0) -> None:
    """SIGTERM one process we started, then SIGKILL it if it does not go."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


def kill_pid(pid: int, *, grace: float = 5.0) -> None:
    """SIGTERM then SIGKILL a process (by PID) that is not our child, e.g. a shim or conmon."""
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline:
        if not Path(f"/proc/{pid}").exists():
            return
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def pids_with_cmdline(needle: str) -> list[int]:
    """PIDs whose command line contains needle (a unique temp path: never a broad name)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmdline:
            found.append(int(entry.name))
    return found


def mounts_under(path: Path) -> list[str]:
    prefix = str(path).rstrip("/") + "/"
    out = []
    for line in Path("/proc/self/mountinfo").read_text().splitlines():
        mnt = line.split()[4].replace("\\040", " ")
        if mnt == str(path) or mnt.startswith(prefix):
            out.append(mnt)
    return out


def unmount_under(path: Path) -> list[str]:
    """Lazily unmount everything at or below path (deepest first); return what was there."""
    found = mounts_under(path)
    for mnt in sorted(found, key=len, reverse=True):
        subprocess.run(["umount", "-l", mnt], capture_output=True, check=False)
    return found


# Interpreter for the little client/server snippets run inside the node and the pods.
PYTHON = os.path.realpath(sys.executable)
