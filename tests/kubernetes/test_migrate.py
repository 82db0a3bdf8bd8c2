"""A running cluster moved from etcd to the Kubernetes datastore (the vxlan cluster, on etcd:
tests/kubernetes/conftest.py), as docs/kubernetes.md tells an operator to: tabby's CRDs and
accounts applied, ``tabbyctl datastore migrate --to kubernetes``, then a rolling restart of
tabby-node onto the new conflist, one node at a time. ICMP streams run between pods on
different nodes the whole time: none loses a packet, no pod changes address, and pods made
afterwards on every node get addresses of their own. This test runs last (conftest.py):
the cluster is on the Kubernetes datastore afterwards."""

from __future__ import annotations

import json
from typing import Any

import pytest

from lab.kubernetes.cluster import KubeLab, KubePod
from tests.kubernetes.icmp import Stream

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.parametrize("kube_lab", ["vxlan"], indirect=True),
]

NS = "migrate"
RATE = 50.0


def one_per_node(pods: list[KubePod]) -> dict[str, KubePod]:
    out: dict[str, KubePod] = {}
    for p in sorted(pods, key=lambda p: p.name):
        out.setdefault(p.node, p)
    return out


def ctl_json(kube: KubeLab, *args: str) -> Any:
    proc = kube.tabbyctl(*args, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_a_running_cluster_moves_from_etcd_to_the_api_with_traffic_flowing(
    kube_lab: KubeLab,
) -> None:
    kube = kube_lab
    assert kube.datastore == "etcdv3"
    kube.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
    kube.apply(kube.web_deployment("before", NS, replicas=6))
    pods = kube.wait_pods(NS, "app=before", 6, timeout=180)
    by_node = one_per_node(pods)
    assert len(by_node) == 3, by_node
    addresses = {p.name: p.ips for p in pods}
    ring = [("node-1", "node-2"), ("node-2", "node-3"), ("node-3", "node-1")]
    streams = [
        Stream(
            kube.pod_netns(NS, by_node[a].name),
            by_node[b].ip,
            RATE,
            f"{by_node[a].label} -> {by_node[b].label}",
        ).start()
        for a, b in ring
    ]
    try:
        kube.install_kdd()  # the manifest's CRDs, accounts and the plugins' kubeconfig
        admin = str(kube.admin_kubeconfig)
        proc = kube.tabbyctl(
            "datastore", "migrate", "--to", "kubernetes", "--kubeconfig", admin, "--settle", "2"
        )
        assert proc.returncode == 0, proc.stderr
        for n in kube.nodes:
            kube.switch_to_kdd(n)
        kube.datastore = "kubernetes"  # tabbyctl now reads the API
    finally:
        for s in streams:
            s.stop()
    summary = "; ".join(s.summary() for s in streams)
    assert all(len(s.sent) > RATE * 5 for s in streams), summary
    assert [s.lost for s in streams] == [[], [], []], summary
    assert {p.name: p.ips for p in kube.get_pods(NS, "app=before")} == addresses
    # the API holds what etcd held: every running pod's address, nothing wrong
    held = {a["ip"] for a in ctl_json(kube, "ipam", "show")["allocations"]}
    assert {ip for ips in addresses.values() for ip in ips} <= held
    # the store's findings (the node's own compare the kernel of tabbyctl's node: not here)
    check = json.loads(kube.tabbyctl("ipam", "check", "-o", "json").stdout)
    assert [p for p in check["store"] if p["severity"] == "error"] == []
    # new pods on every node: addresses of their own, reachable from the old ones
    kube.apply(kube.web_deployment("after", NS, replicas=3))
    after = kube.wait_pods(NS, "app=after", 3, timeout=180)
    assert {p.node for p in after} == {"node-1", "node-2", "node-3"}
    every = [ip for p in [*pods, *after] for ip in p.ips]
    assert len(every) == len(set(every))
    assert kube.http_matrix([*by_node.values(), *after]) == []
