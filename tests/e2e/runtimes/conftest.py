"""Fixtures of the runtime e2e tier: real runtimes (libcni, podman, containerd) drive the
installed CNI binaries inside a throwaway node (see harness.py).

Selection
- The tier runs with the top-level `--run-e2e` option (tests/conftest.py skips `e2e` tests
  without it). Once it runs, a missing prerequisite (not root, tools not built, plugin binaries
  not installed) is a failure, never a skip.
- TABBY_E2E_PLUGIN=tabby (default): the conf-examples as written, /opt/cni/bin + /usr/lib/cni.
  TABBY_E2E_PLUGIN=reference: the same shapes with Debian's ptp + host-local instead of
  tabby + tabby-ipam, to prove the harness without tabby.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .harness import (
    DEBIAN_CNI_DIR,
    TABBY_BIN_DIR,
    TOOLS_BIN,
    CniTool,
    Flavor,
    Node,
    unique,
)


@pytest.fixture(scope="session")
def flavor() -> Flavor:
    name = os.environ.get("TABBY_E2E_PLUGIN", "tabby")
    if name not in ("tabby", "reference"):
        pytest.fail(f"TABBY_E2E_PLUGIN must be 'tabby' or 'reference', not {name!r}")
    if os.geteuid() != 0:
        pytest.fail("the runtime e2e tier needs root")
    dirs = [str(TABBY_BIN_DIR), str(DEBIAN_CNI_DIR)] if name == "tabby" else [str(DEBIAN_CNI_DIR)]
    fl = Flavor(name, dirs)
    missing = [str(b) for b in fl.binaries() if not os.access(b, os.X_OK)]
    missing += [
        str(DEBIAN_CNI_DIR / p)
        for p in ("portmap", "tuning", "loopback")
        if not os.access(DEBIAN_CNI_DIR / p, os.X_OK)
    ]
    if missing:
        pytest.fail(f"plugin binaries missing for TABBY_E2E_PLUGIN={name}: {missing}")
    return fl


@pytest.fixture(scope="session")
def tools() -> Path:
    needed = [
        "cnitool",
        "cri/cri_v1_pb2.py",
        "cri/cri_v1_pb2_grpc.py",
        "rootfs.tar",
        "pause-oci.tar",
        "image-ref",
    ]
    missing = [n for n in needed if not (TOOLS_BIN / n).exists()]
    if missing:
        pytest.fail(f"e2e tools not built ({missing}): run tests/e2e/tools/build.sh")
    return TOOLS_BIN


@pytest.fixture(scope="session")
def node(flavor: Flavor, tools: Path) -> Iterator[Node]:
    n = Node()
    n.start()
    try:
        yield n
    finally:
        n.stop()


@pytest.fixture(autouse=True)
def _node_left_clean(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test of this tier: nothing of its pods may remain in the node."""
    yield
    if "node" not in request.fixturenames:
        return
    n: Node = request.getfixturevalue("node")
    problems = n.leftovers()
    if problems:
        # Clean up for the next test, then report.
        for name in n.netns_list():
            n.netns_del(name)
        n.remove_cni_chains()
        pytest.fail(f"test left state behind in the node: {problems}")


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    for sub in ("ipam", "log", "net.d", "cache"):
        (tmp_path / sub).mkdir()
    return tmp_path


@pytest.fixture
def plugin_log(workdir: Path, flavor: Flavor) -> Iterator[Path]:
    """tabby's log file for this test; its tail is printed (shown on failure)."""
    path = workdir / "log" / "cni.log"
    yield path
    if flavor.name == "tabby" and path.exists():
        lines = path.read_text(errors="replace").splitlines()
        print(f"--- last lines of {path} ---")
        print("\n".join(lines[-60:]))


@pytest.fixture
def cni(
    node: Node,
    workdir: Path,
    flavor: Flavor,
    plugin_log: Path,
    pod_netns: Callable[[], tuple[str, str]],
) -> Iterator[CniTool]:
    """The libcni driver on this test's conflist dir and cache; after the test it DELs what
    the test added and did not delete (so a failing test still cleans up), before the pod
    namespaces go."""
    tool = CniTool(node, workdir / "net.d", workdir / "cache", flavor.plugin_dirs)
    yield tool
    failures = tool.cleanup()
    node.remove_cni_chains()
    if failures:
        print("cleanup DEL failures:", *failures, sep="\n")


@pytest.fixture
def pod_netns(node: Node) -> Iterator[Callable[[], tuple[str, str]]]:
    """Factory: make a pod network namespace in the node; returns (name, path). Removed after."""
    made: list[str] = []

    def make() -> tuple[str, str]:
        name = unique("tbe2e-pod-")
        path = node.netns_add(name)
        made.append(name)
        return name, path

    yield make
    for name in made:
        node.netns_del(name)
