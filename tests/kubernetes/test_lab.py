"""The lab's helpers for other programs (tabby-kube-controllers' tests use them): credentials
for a service account and for a certificate user, a process on a node, and the node's
private mounts. One backend is enough: they do not depend on routing."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from lab.kubernetes.cluster import KubeLab
from lab.kubernetes.node import KERNEL_TUNABLES

pytestmark = [pytest.mark.kubernetes, pytest.mark.parametrize("kube_lab", ["bird"], indirect=True)]


def test_a_service_account_kubeconfig_has_exactly_its_roles_rights(kube_lab: KubeLab) -> None:
    kube_lab.kubectl("create", "namespace", "sa-test")
    kube_lab.kubectl("create", "serviceaccount", "-n", "sa-test", "reader")
    kube_lab.kubectl(
        "create", "role", "-n", "sa-test", "pod-reader", "--verb=get,list", "--resource=pods"
    )
    kube_lab.kubectl(
        "create",
        "rolebinding",
        "-n",
        "sa-test",
        "reader",
        "--role=pod-reader",
        "--serviceaccount=sa-test:reader",
    )
    conf = kube_lab.kubeconfig_for_service_account("sa-test", "reader")
    allowed = kube_lab.kubectl("get", "pods", "-n", "sa-test", kubeconfig=conf, check=False)
    assert allowed.returncode == 0, allowed.stderr
    denied = kube_lab.kubectl("get", "pods", "-n", "default", kubeconfig=conf, check=False)
    assert denied.returncode != 0
    assert "forbidden" in denied.stderr
    kube_lab.kubectl("delete", "namespace", "sa-test", "--wait=false")


def test_a_certificate_user_is_who_the_certificate_says(kube_lab: KubeLab) -> None:
    nobody = kube_lab.kubeconfig_for_user("tabby-test-nobody")
    denied = kube_lab.kubectl("get", "nodes", kubeconfig=nobody, check=False)
    assert "forbidden" in denied.stderr
    assert 'User "tabby-test-nobody"' in denied.stderr
    admin = kube_lab.kubeconfig_for_user("tabby-test-admin", groups=("system:masters",))
    nodes = kube_lab.kubectl_json("get", "nodes", kubeconfig=admin)["items"]
    assert sorted(n["metadata"]["name"] for n in nodes) == ["node-1", "node-2", "node-3"]


def test_a_process_on_a_node_sees_the_nodes_network_and_private_mounts(
    kube_lab: KubeLab,
) -> None:
    node = kube_lab.nodes[1]
    kn = kube_lab.kube_node(node)
    # the node's own files (its private /var/lib), its network, its kernel tunables
    nodename = kube_lab.run_on(node, ["cat", "/var/lib/tabby/nodename"]).stdout.strip()
    assert nodename == node.name
    addresses = kube_lab.run_on(node, ["ip", "-4", "-o", "addr", "show", "eth0"]).stdout
    assert str(node.ipv4.ip) in addresses
    for key, value in KERNEL_TUNABLES.items():
        inside = kube_lab.run_on(node, ["cat", f"/proc/sys/{key}"]).stdout.strip()
        assert inside == value
    on_the_machine = Path("/var/lib/tabby/nodename")
    assert not on_the_machine.exists() or on_the_machine.read_text().strip() != node.name
    # a daemon there, stopped by the teardown (spawn_on records it)
    proc = kube_lab.spawn_on(node, ["sleep", "300"], "test-sleep.log")
    deadline = time.monotonic() + 5
    while os.readlink(f"/proc/{proc.pid}/ns/mnt") != kn.mnt_ns:
        assert time.monotonic() < deadline, "the process never entered the node"
        time.sleep(0.02)
    assert os.readlink(f"/proc/{proc.pid}/ns/net") == os.readlink(f"/proc/{kn.pid}/ns/net")
    assert proc in kube_lab.processes
