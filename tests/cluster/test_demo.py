"""The cluster demo, as build.sh runs it: exit 0 with both backends, nothing left behind."""

from __future__ import annotations

import os
import re
import subprocess

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

TABBYCTL = os.environ.get("TABBY_TABBYCTL_BIN", "/usr/local/bin/tabbyctl")


def _processes_of(prefix: str) -> list[str]:
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmdline = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if prefix in cmdline:
            out.append(f"{pid}: {cmdline[:200]}")
    return out


@pytest.mark.parametrize("backend", ["bird", "vxlan"])
def test_cluster_demo_passes_and_leaves_nothing(backend: str) -> None:
    proc = subprocess.run(
        [TABBYCTL, "demo", "--nodes", "3", "--backend", backend],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "cluster demo passed" in proc.stdout
    assert "60 paths, all reachable" in proc.stdout  # 6 pods, both families
    assert re.search(r"-> demo/pod-1-1@node-1: open", proc.stdout)
    assert "closed" in proc.stdout
    assert "OPEN (wrong)" not in proc.stdout
    assert "CLOSED (wrong)" not in proc.stdout
    match = re.search(r"tabby cluster demo (tbylab[0-9a-f]+)", proc.stdout)
    assert match is not None
    prefix = match.group(1)
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    assert [n for n in names if n.startswith(prefix)] == []
    assert _processes_of(prefix) == []
    assert not [d for d in os.listdir("/tmp") if d.startswith(prefix)]
