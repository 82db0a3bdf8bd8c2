"""tabby-node's capabilities in manifests/tabby.yaml are what its namespace switches need
(docs/security.md "What each container may do"): a process holding only those enters
another mount and network namespace with tabby's own code (``dataplane.netns``, as a
served CNI call's thread does); without ``SYS_CHROOT`` the mount namespace is refused,
without ``SYS_ADMIN`` both. The process makes its own namespaces to come back from (the
machine's are untouched) and runs in a child of its own."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from tests import REPO_ROOT

pytestmark = pytest.mark.privileged

#: linux/capability.h
BITS = {"NET_ADMIN": 12, "NET_BIND_SERVICE": 10, "SYS_CHROOT": 18, "SYS_ADMIN": 21}

CHILD = r"""
import ctypes, os, sys, threading
from dataplane import netns

libc = ctypes.CDLL(None, use_errno=True)
mnt = os.open("/proc/self/ns/mnt", os.O_RDONLY)
net = os.open("/proc/self/ns/net", os.O_RDONLY)
if libc.unshare(0x00020000 | 0x40000000) != 0:  # CLONE_NEWNS | CLONE_NEWNET: to come back from
    sys.exit("unshare: " + os.strerror(ctypes.get_errno()))

class Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]

class Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32),
                ("inheritable", ctypes.c_uint32)]

mask = int(sys.argv[1])
data = (Data * 2)(Data(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0),
                  Data(mask >> 32, mask >> 32, 0))
if libc.syscall(126, ctypes.byref(Header(0x20080522, 0)), data) != 0:  # capset, v3
    sys.exit("capset: " + os.strerror(ctypes.get_errno()))
results = {}

def call():  # a served call's thread: the network namespace, then (its own) the mount one
    for name, enter, fd in (("net", netns.setns, net), ("mnt", netns.enter_mount_namespace, mnt)):
        try:
            enter(fd)
            results[name] = "ok"
        except OSError as e:
            results[name] = os.strerror(e.errno) if e.errno else str(e)

t = threading.Thread(target=call)
t.start()
t.join()
print(results["net"] + "|" + results["mnt"])
"""


def node_capabilities() -> set[str]:
    docs = yaml.safe_load_all((REPO_ROOT / "manifests" / "tabby.yaml").read_text())
    (ds,) = [d for d in docs if d and d["kind"] == "DaemonSet"]
    (node,) = ds["spec"]["template"]["spec"]["containers"]
    return set(node["securityContext"]["capabilities"]["add"])


def enter_with(capabilities: set[str]) -> tuple[str, str]:
    mask = sum(1 << BITS[c] for c in capabilities)
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(mask)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    net, mnt = proc.stdout.strip().split("|")
    return net, mnt


def test_the_manifests_capabilities_are_enough_and_each_namespace_one_needed() -> None:
    caps = node_capabilities()
    assert caps <= set(BITS), caps
    assert enter_with(caps) == ("ok", "ok")
    denied = "Operation not permitted"
    assert enter_with(caps - {"SYS_CHROOT"}) == ("ok", denied)
    assert enter_with(caps - {"SYS_ADMIN"}) == (denied, denied)
