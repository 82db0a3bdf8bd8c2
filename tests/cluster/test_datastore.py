"""The cluster datastore through the installed binaries (issue: etcd v3 datastore).

Three nodes on one 3-member etcd, each adding pods concurrently; etcd losing its quorum
and coming back; the acceptance flows of the issue: blocks affine to their node and seen
from every node, and resources applied and read back.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import subprocess
import threading
import time
from typing import Any

import pytest

from tabbyctl.demo.lab import Lab, LabNode, LabPod
from tests.cluster.conftest import LabFactory

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]


def _ipam(lab: Lab, node: LabNode | None = None) -> dict[str, Any]:
    proc = lab.tabbyctl("ipam", "show", "--show-blocks", "-o", "json", node=node)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def test_three_nodes_eight_concurrent_adds_each(make_lab: LabFactory) -> None:
    """24 ADDs at once over 3 nodes (8 per node, through each node's tabby-node): every one
    succeeds, no address twice, every block has one node, no lock timeout."""
    lab = make_lab(backend="vxlan", ipv6=False)
    results: list[tuple[str, Any]] = []
    lock = threading.Lock()

    def add(node: LabNode, j: int) -> None:
        try:
            pod = lab.add_pod(node, "burst", f"b{node.index + 1}-{j}")
            outcome: Any = pod.addresses(4)
        except Exception as e:
            outcome = str(e)
        with lock:
            results.append((f"{node.name}/{j}", outcome))

    threads = [threading.Thread(target=add, args=(n, j)) for n in lab.nodes for j in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    failed = [r for r in results if isinstance(r[1], str)]
    assert not failed, failed
    addresses = [a for _, addrs in results for a in addrs]
    assert len(addresses) == 24
    assert len(set(addresses)) == 24, "an address was handed out twice"
    data = _ipam(lab)
    owners: dict[str, set[str]] = {}
    for block in data["blocks"]:
        owners.setdefault(block["cidr"], set()).add(block.get("node") or "")
    assert all(len(nodes) == 1 for nodes in owners.values()), owners
    by_node: dict[str, list[str]] = {}
    for pod in lab.pods:
        by_node.setdefault(pod.node, []).extend(pod.addresses(4))
    blocks_of = {b["cidr"]: b.get("node") for b in data["blocks"]}
    for node, addrs in by_node.items():
        for a in addrs:
            block = next(c for c in blocks_of if ipaddress.ip_address(a) in ipaddress.ip_network(c))
            assert blocks_of[block] == node, (a, block, blocks_of[block], node)


def test_every_node_sees_the_whole_cluster(make_lab: LabFactory) -> None:
    """Acceptance: pods on two nodes get addresses from blocks affine to their own node;
    `tabbyctl ipam show -o json` from either node shows both nodes' blocks."""
    lab = make_lab(backend="bird")
    n1, n2, _ = lab.nodes
    a = lab.add_pod(n1, "x", "a")
    b = lab.add_pod(n2, "x", "b")
    views = [_ipam(lab, node) for node in (n1, n2)]
    assert views[0] == views[1]
    blocks = {blk["cidr"]: blk.get("node") for blk in views[0]["blocks"]}
    for pod, node in ((a, n1), (b, n2)):
        for addr in pod.addresses():
            owner = next(
                n
                for c, n in blocks.items()
                if ipaddress.ip_address(addr) in ipaddress.ip_network(c)
            )
            assert owner == node.name
    assert {n1.name, n2.name} <= set(blocks.values())
    assert lab.ping_until(a.netns, b.addresses(4)[0]) is not None


def test_no_quorum_then_back(make_lab: LabFactory) -> None:
    """All members stopped: ADD answers code 11 within lock_timeout_seconds; DEL of an
    existing pod removes its interfaces and answers 11; after etcd is back, DEL succeeds."""
    lab = make_lab(backend="vxlan", ipv6=False, nodes_wanted=2, etcd_members=1)
    n1 = lab.nodes[0]
    pod = lab.add_pod(n1, "q", "kept")
    host_veth = next(i["name"] for i in (pod.result or {})["interfaces"] if "sandbox" not in i)
    assert n1.etcd is not None
    n1.etcd.send_signal(signal.SIGSTOP)  # a member that answers nothing: no quorum
    try:
        extra = LabPod(n1.name, "q", "new", f"{lab.prefix}-q-new", "c" * 32)
        lab.make_netns(extra.netns)
        lab.pods.append(extra)
        start = time.monotonic()
        rc, out = lab.cni(n1, "ADD", extra)
        took = time.monotonic() - start
        assert (rc, (out or {}).get("code")) == (1, 11), out
        assert took < 10 + 6, took  # lock_timeout_seconds 10 (+ the client's grace)
        rc, out = lab.cni(n1, "DEL", pod, pod.result)
        assert (rc, (out or {}).get("code")) == (1, 11), out
        links = lab._ip("-o", "link", "show", ns=n1.netns)
        assert host_veth not in links, "DEL removes the pod's interfaces first"
    finally:
        n1.etcd.send_signal(signal.SIGCONT)
    deadline = time.monotonic() + 30
    while True:
        rc, out = lab.cni(n1, "DEL", pod, pod.result)
        if rc == 0 or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert rc == 0, out
    pod.result = None
    assert [a["ip"] for a in _ipam(lab)["allocations"] if a.get("pod") == "q/kept"] == []


RESOURCES = """
apiVersion: tabby.io/v1
kind: IPPool
metadata: {name: extra-pool}
spec: {cidr: 10.99.0.0/24, blockSize: 28, natOutgoing: true}
---
apiVersion: v1
kind: Namespace
metadata: {name: shop, labels: {team: web}}
---
apiVersion: v1
kind: Pod
metadata: {name: cart, namespace: shop, labels: {app: cart}}
spec:
  containers:
  - name: main
    ports: [{name: http, containerPort: 8080}]
---
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: cart-in, namespace: shop}
spec:
  podSelector: {matchLabels: {app: cart}}
  ingress:
  - from: [{namespaceSelector: {matchLabels: {team: web}}}]
    ports: [{port: http}]
"""


def test_apply_get_round_trip_and_endpoint_labels(make_lab: LabFactory) -> None:
    """Acceptance: apply an IPPool, a Namespace, a Pod and a NetworkPolicy in one file;
    `get ... -o yaml` gives them back; `get workloadendpoints` shows the pod's labels."""
    import yaml

    lab = make_lab(backend="vxlan", ipv6=False, nodes_wanted=2, etcd_members=1)
    path = os.path.join(lab.workdir, "shop.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(RESOURCES)
    proc = lab.tabbyctl("apply", "-f", path)
    assert proc.returncode == 0, proc.stderr
    lab.add_pod(lab.nodes[1], "shop", "cart")
    for kind, name, extra in (
        ("ippool", "extra-pool", ()),
        ("namespace", "shop", ()),
        ("pod", "cart", ("-n", "shop")),
        ("networkpolicy", "cart-in", ("-n", "shop")),
    ):
        got = lab.tabbyctl("get", kind, name, *extra, "-o", "yaml")
        assert got.returncode == 0, got.stderr
        doc = yaml.safe_load(got.stdout)
        assert doc["metadata"]["name"] == name
        if kind == "networkpolicy":
            assert doc["spec"]["policyTypes"] == ["Ingress"]  # defaulted as the API does
            assert doc["spec"]["ingress"][0]["ports"][0] == {"port": "http", "protocol": "TCP"}
        if kind == "ippool":
            assert doc["spec"]["natOutgoing"] is True
    weps = lab.tabbyctl("get", "workloadendpoints", "-n", "shop", "-o", "json")
    assert weps.returncode == 0, weps.stderr
    items = json.loads(weps.stdout)["items"]
    assert len(items) == 1
    assert items[0]["metadata"]["labels"] == {"app": "cart"}
    assert items[0]["spec"]["node"] == lab.nodes[1].name
    table = lab.tabbyctl("get", "wep", "-n", "shop").stdout
    assert "app=cart" in table


def test_tabbyctl_apply_refuses_a_bad_document_and_writes_nothing(make_lab: LabFactory) -> None:
    lab = make_lab(backend="vxlan", ipv6=False, nodes_wanted=2, etcd_members=1)
    path = os.path.join(lab.workdir, "bad.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "apiVersion: v1\nkind: Namespace\nmetadata: {name: fine}\n---\n"
            "apiVersion: networking.k8s.io/v1\nkind: NetworkPolicy\n"
            "metadata: {name: deny-all, namespace: fine}\n"
            "spec: {podSelector: {}, ingress: [{ports: [{port: 70000}]}]}\n"
        )
    proc = lab.tabbyctl("apply", "-f", path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "NetworkPolicy/deny-all" in lines[0]
    assert "spec.ingress[0].ports[0].port" in lines[0]
    assert lab.tabbyctl("get", "namespace", "fine").returncode == 1, "nothing written"


def test_migrate_a_file_store_into_the_cluster(make_lab: LabFactory, tmp_path: Any) -> None:
    """A single node's file store copied into etcd (pools, blocks, handles, endpoints)."""
    lab = make_lab(backend="vxlan", ipv6=False, nodes_wanted=2, etcd_members=1)
    data_dir = tmp_path / "store"
    prefix = "/tabby-migrated"
    env_conf = tmp_path / "conf.json"
    env_conf.write_text(
        json.dumps(
            {
                "cniVersion": "1.0.0",
                "name": "single",
                "plugins": [
                    {"type": "tabby", "ipam": {"type": "tabby-ipam", "data_dir": str(data_dir)}}
                ],
            }
        )
    )
    tabbyctl = [*lab.tabbyctl_bin, "--conf", str(env_conf)]
    out = subprocess.run(
        [*tabbyctl, "pool", "add", "10.98.0.0/24", "--block-size", "28"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    proc = lab.in_ns(
        lab.nodes[0].netns,
        *tabbyctl,
        "datastore",
        "migrate",
        "--to",
        "etcdv3",
        "--etcd-endpoints",
        ",".join(lab.endpoints()),
        "--etcd-prefix",
        prefix,
    )
    assert proc.returncode == 0, proc.stderr
    again = lab.in_ns(
        lab.nodes[0].netns,
        *tabbyctl,
        "datastore",
        "migrate",
        "--to",
        "etcdv3",
        "--etcd-endpoints",
        ",".join(lab.endpoints()),
        "--etcd-prefix",
        prefix,
    )
    assert again.returncode == 1, "refuses to overwrite"
    pools = lab.in_ns(
        lab.nodes[0].netns,
        *lab.tabbyctl_bin,
        "--datastore-type",
        "etcdv3",
        "--etcd-endpoints",
        ",".join(lab.endpoints()),
        "--etcd-prefix",
        prefix,
        "pool",
        "list",
        "-o",
        "json",
    )
    assert pools.returncode == 0, pools.stderr
    assert [p["cidr"] for p in json.loads(pools.stdout)] == ["10.98.0.0/24"]
