"""Plumbing for the runtime e2e tier: a throwaway node, the plugin flavour, and small probes.

One module per concern, all re-exported here for the tests:

- ``harness_base``: paths, the test pools, process/mount/wait helpers;
- ``harness_node``: the node (network + mount namespace) every runtime runs in; its
  docstring describes what the node isolates;
- ``harness_flavors``: tabby or the reference plugins, and the conflists for each;
- ``harness_libcni``: the cnitool driver;
- ``harness_podman``, ``harness_containerd``: the two real runtimes.
"""

from __future__ import annotations

from .harness_base import (
    DEBIAN_CNI_DIR,
    EXAMPLES,
    NODE_NAME,
    POOL_V4,
    POOL_V6,
    PRIVATE_DIRS,
    PYTHON,
    REPO,
    TABBY_BIN_DIR,
    TINY_V4,
    TOOLS_BIN,
    UPLINK_NODE,
    UPLINK_SINK,
    kill_pid,
    mounts_under,
    pids_with_cmdline,
    run,
    stop_pid,
    unique,
    unmount_under,
    wait_for,
)
from .harness_containerd import WRAPPER, CniCall, Containerd, cri_modules
from .harness_flavors import EXAMPLE_FILES, Flavor, in_pools, load_example, pod_ips
from .harness_libcni import CniReply, CniTool, serving
from .harness_node import Node
from .harness_podman import Podman

__all__ = [
    "DEBIAN_CNI_DIR",
    "EXAMPLES",
    "EXAMPLE_FILES",
    "NODE_NAME",
    "POOL_V4",
    "POOL_V6",
    "PRIVATE_DIRS",
    "PYTHON",
    "REPO",
    "TABBY_BIN_DIR",
    "TINY_V4",
    "TOOLS_BIN",
    "UPLINK_NODE",
    "UPLINK_SINK",
    "WRAPPER",
    "CniCall",
    "CniReply",
    "CniTool",
    "Containerd",
    "Flavor",
    "Node",
    "Podman",
    "cri_modules",
    "in_pools",
    "kill_pid",
    "load_example",
    "mounts_under",
    "pids_with_cmdline",
    "pod_ips",
    "run",
    "serving",
    "stop_pid",
    "unique",
    "unmount_under",
    "wait_for",
]
