"""The cluster tier: tabby on several "nodes" (network namespaces on an underlay bridge),
a real etcd (3 members on the nodes), tabby-node (and BIRD) on every node, pods made by the
installed binaries. Built with tabbyctl.demo.lab (the same lab the cluster demo uses);
every process is stopped by PID and every namespace deleted, also when a test fails.

Needs root, the installed binaries (./build.sh --no-demo), etcd, BIRD 2 and nftables:
``.venv/bin/pytest --run-privileged --run-e2e tests/cluster``. Binaries installed elsewhere
(``./build.sh --cni-bin-dir C --bin-dir B``): ``TABBY_CNI_BIN=C PATH=B:$PATH``.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from tabbyctl.demo.lab import Lab

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]

#: Where the plugins are (the tier's labs exec them from there); tabby-node and tabbyctl are
#: found on PATH (tabbyctl.demo.lab).
CNI_BIN = os.environ.get("TABBY_CNI_BIN", "/opt/cni/bin")
BINARIES = (f"{CNI_BIN}/tabby", f"{CNI_BIN}/tabby-ipam")


@pytest.fixture(scope="session", autouse=True)
def _cluster_tools() -> None:
    for tool in ("etcd", "bird", "nft"):
        if subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True).returncode:
            raise AssertionError(f"{tool} is missing: the cluster tier needs it (tests/run.sh)")
    for path in BINARIES:
        assert os.access(path, os.X_OK), f"{path}: run ./build.sh --no-demo first"


#: Prefixes of the labs this session built (other sessions may run labs of their own).
BUILT: list[str] = []


@pytest.fixture(scope="session", autouse=True)
def _nothing_left() -> Iterator[None]:
    yield
    names = os.listdir("/run/netns") if os.path.isdir("/run/netns") else []
    left = [ns for ns in names if any(ns.startswith(p) for p in BUILT)]
    assert not left, f"the cluster tier left namespaces behind: {left}"


def new_lab(**kwargs: Any) -> Lab:
    lab = Lab(**{"cni_bin": CNI_BIN, **kwargs})
    BUILT.append(lab.prefix)
    return lab


LabFactory = Callable[..., Lab]


@pytest.fixture
def make_lab() -> Iterator[LabFactory]:
    """Build labs inside the test; each is torn down afterwards, pass or fail."""
    with ExitStack() as stack:

        def build(**kwargs: Any) -> Lab:
            lab = new_lab(**{"nodes_wanted": 3, **kwargs})
            stack.callback(_teardown, lab)
            lab.build()
            lab.wait_ready(90)
            return lab

        yield build


def _teardown(lab: Lab) -> None:
    problems = lab.teardown()
    assert not problems, problems


@pytest.fixture(scope="module")
def bird_lab() -> Iterator[Lab]:
    """One 3-node BIRD full mesh, dual stack, shared by a module's non-destructive tests."""
    lab = new_lab(nodes_wanted=3, backend="bird")
    try:
        lab.build()
        lab.wait_ready(90)
        yield lab
    finally:
        _teardown(lab)


@pytest.fixture(scope="module")
def vxlan_lab() -> Iterator[Lab]:
    lab = new_lab(nodes_wanted=3, backend="vxlan")
    try:
        lab.build()
        lab.wait_ready(90)
        yield lab
    finally:
        _teardown(lab)
