"""tabby as the network of a real Kubernetes, per backend: a Deployment's pods spread over
the 3 nodes get tabby addresses from blocks affine to their node, reach each other across
nodes, and leave nothing behind when deleted (addresses, host-side interfaces,
WorkloadEndpoints)."""

from __future__ import annotations

import ipaddress
import json
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest

from lab.kubernetes.cluster import KubeLab, KubePod

pytestmark = pytest.mark.kubernetes

NAMESPACE = "pod-network"
REPLICAS = 6
POOL = ipaddress.ip_network("10.244.0.0/16")


@pytest.fixture(scope="session")
def web(kube_lab: KubeLab) -> Iterator[list[KubePod]]:
    """6 busybox httpd pods of one Deployment in namespace pod-network, Running."""
    kube_lab.kubectl("create", "namespace", NAMESPACE)
    kube_lab.apply(kube_lab.web_deployment("web", NAMESPACE, REPLICAS))
    yield kube_lab.wait_pods(NAMESPACE, "app=web", REPLICAS)
    kube_lab.kubectl("delete", "namespace", NAMESPACE, "--ignore-not-found", "--wait=false")


def _tabbyctl_json(lab: KubeLab, *args: str) -> Any:
    proc = lab.tabbyctl(*args, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def test_pods_spread_over_the_nodes_with_addresses_from_their_nodes_blocks(
    kube_lab: KubeLab, web: list[KubePod]
) -> None:
    assert Counter(p.node for p in web) == {"node-1": 2, "node-2": 2, "node-3": 2}
    for pod in web:
        assert pod.phase == "Running"
        assert pod.ready
        assert len(pod.ips) == 1
        assert ipaddress.ip_address(pod.ip) in POOL, pod
    report = _tabbyctl_json(kube_lab, "ipam", "show", "--show-blocks")
    allocations = {a["ip"]: a for a in report["allocations"]}
    blocks = {b["cidr"]: b for b in report["blocks"]}
    for pod in web:
        row = allocations.get(pod.ip)
        assert row is not None, f"{pod.label}: {pod.ip} is not allocated in tabby"
        assert row["pod"] == f"{NAMESPACE}/{pod.name}"
        assert row["purpose"] == "workload"
        assert row["node"] == pod.node, row
        assert row["block_node"] == pod.node, f"{pod.label}: block of another node: {row}"
        block = blocks[row["block"]]
        assert block["node"] == pod.node
        assert ipaddress.ip_address(pod.ip) in ipaddress.ip_network(block["cidr"])
    endpoints = _tabbyctl_json(kube_lab, "get", "workloadendpoints", "-n", NAMESPACE)["items"]
    by_pod = {e["spec"]["pod"]: e for e in endpoints}
    assert set(by_pod) == {p.name for p in web}
    for pod in web:
        spec = by_pod[pod.name]["spec"]
        assert spec["node"] == pod.node
        assert spec["ipNetworks"] == [f"{pod.ip}/32"]
        assert spec["hostInterface"].startswith("cali")


def test_every_pod_reaches_every_other_across_nodes(kube_lab: KubeLab, web: list[KubePod]) -> None:
    """HTTP from every pod to every other (kubectl exec: one per source pod)."""
    assert kube_lab.http_matrix(web) == []


def test_deleting_the_pods_releases_every_address_and_interface(
    kube_lab: KubeLab, web: list[KubePod]
) -> None:
    """tabby's state is checked, not the API's: the CNI DEL comes when kubelet stops a pod's
    sandbox, within seconds; kubelet 1.20 may then keep the pod object Terminating for up to
    a minute (until its container GC runs). Only these pods' addresses, endpoints and
    interfaces are looked at: the cluster is shared with the tier's other modules, whose
    pods (and leaks their tests make on purpose) may still be there."""
    endpoints = _tabbyctl_json(kube_lab, "get", "workloadendpoints", "-n", NAMESPACE)["items"]
    interfaces = {e["spec"]["hostInterface"] for e in endpoints}
    addresses = {p.ip for p in web}
    assert len(interfaces) == len(addresses) == REPLICAS
    kube_lab.kubectl("delete", "deployment", "-n", NAMESPACE, "web", "--wait=false")

    def left() -> list[str]:
        report = _tabbyctl_json(kube_lab, "ipam", "show")
        found = [f"address {a['ip']}" for a in report["allocations"] if a["ip"] in addresses]
        found += [
            f"endpoint {e['metadata']['name']}"
            for e in _tabbyctl_json(kube_lab, "get", "workloadendpoints", "-n", NAMESPACE)["items"]
        ]
        for node in kube_lab.nodes:
            links = kube_lab.run_on(node.name, ["ip", "-o", "link", "show"], mount=False).stdout
            found += [
                f"{node.name}: {line[:60]}"
                for line in links.splitlines()
                if any(f" {name}@" in line or f" {name}:" in line for name in interfaces)
            ]
        return found

    kube_lab.wait_for("every address, endpoint and interface gone", lambda: not left(), 90)
    assert left() == []
