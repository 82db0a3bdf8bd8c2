"""Pods on different nodes reach each other (issue: the node agent's routing).

BIRD full mesh and route reflectors, VXLAN and VXLAN CrossSubnet, dual stack: every pod
reaches every other pod; the expected routes are in each node; ``node status`` shows the
sessions. A borrowed address is reachable from every node; a deleted node's routes are
withdrawn everywhere; tabby-node SIGKILLed and restarted disturbs no pod; BIRD killed is
restarted by tabby-node; the etcd leader killed while pods are added loses nothing.
"""

from __future__ import annotations

import ipaddress
import json
import os
import signal
import threading
import time
from typing import Any

import pytest

from tabbyctl.demo.lab import Lab, LabNode, LabPod
from tests.cluster.conftest import LabFactory

pytestmark = [pytest.mark.e2e, pytest.mark.privileged]


def pods_everywhere(lab: Lab, per_node: int = 2, namespace: str = "r") -> list[LabPod]:
    return [
        lab.add_pod(node, namespace, f"p{node.index + 1}-{j}")
        for node in lab.nodes
        for j in range(per_node)
    ]


def wait_matrix(lab: Lab, timeout: float = 20, families: tuple[int, ...] = (4, 6)) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        fails = lab.matrix(families)
        if not fails or time.monotonic() > deadline:
            return fails
        time.sleep(0.5)


def node_status(lab: Lab, node: LabNode) -> dict[str, Any]:
    proc = lab.tabbyctl("node", "status", "--run-dir", node.run_dir, "-o", "json", node=node)
    assert proc.returncode == 0, proc.stderr
    data: dict[str, Any] = json.loads(proc.stdout)
    return data


def wait_sessions(lab: Lab, node: LabNode, want: int, timeout: float = 30) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        status = node_status(lab, node)
        up = [p for p in status["peers"] if p["state"] == "Established"]
        if len(up) >= want or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def wait_vxlan_peers(
    lab: Lab, node: LabNode, want: set[tuple[str, str]], timeout: float = 5
) -> dict[str, Any]:
    """The node's status once its VXLAN peers include ``want`` (node, underlay address), or
    after ``timeout``: the status file is written at most once a second after the passes,
    so it may trail the kernel (which the ping matrix has just proved) by that much."""
    deadline = time.monotonic() + timeout
    while True:
        status = node_status(lab, node)
        have = {(v["node"], v["address"]) for v in status.get("vxlan") or ()}
        if want <= have or time.monotonic() > deadline:
            return status
        time.sleep(0.3)


def remove_pods(lab: Lab) -> None:
    for pod in list(lab.pods):
        lab.del_pod(pod)


def block_routes(lab: Lab, node: LabNode) -> dict[str, str]:
    """Pool-block routes in the node's main table: prefix -> the rest of the line."""
    out = {}
    for line in lab.routes(node, 4).splitlines():
        words = line.split()
        if not words:
            continue
        dst = words[1] if words[0] == "blackhole" else words[0]
        if dst.startswith("10.244.") and "/" in dst:
            out[dst] = line
    return out


# -- BIRD --------------------------------------------------------------------------------------


def test_bird_full_mesh_dual_stack(bird_lab: Lab) -> None:
    lab = bird_lab
    pods_everywhere(lab)
    try:
        assert wait_matrix(lab) == []
        for node in lab.nodes:
            status = wait_sessions(lab, node, want=4)  # 2 peers x (IPv4 + IPv6)
            assert status["backend"] == "bird"
            assert status["node_ip"] == str(node.ipv4.ip)
            peers = {(p["address"], p["type"], p["state"]) for p in status["peers"]}
            others = [n for n in lab.nodes if n is not node]
            for other in others:
                assert (str(other.ipv4.ip), "mesh", "Established") in peers
                assert other.ipv6 is not None
                assert (str(other.ipv6.ip), "mesh", "Established") in peers
            assert all("T" in p["since"] for p in status["peers"])  # ISO 8601
            # own blocks blackholed by BIRD; every other node's blocks via that node
            routes = block_routes(lab, node)
            mine = [p for p in lab.pods if p.node == node.name]
            for pod in lab.pods:
                block = str(ipaddress.ip_network(f"{pod.addresses(4)[0]}/26", strict=False))
                assert block in routes, (node.name, block, routes)
                if pod in mine:
                    assert routes[block].startswith("blackhole"), routes[block]
                else:
                    owner = lab.node(pod.node)
                    assert f"via {owner.ipv4.ip} dev eth0 proto bird" in routes[block]
    finally:
        remove_pods(lab)


def test_borrowed_address_is_reachable_from_every_node(bird_lab: Lab) -> None:
    """node-1 asks for an address inside node-2's block: node-1 announces the /32, so it is
    not swallowed by node-2's blackhole (Calico #3246)."""
    lab = bird_lab
    n1, n2, _ = lab.nodes
    anchor = lab.add_pod(n2, "r", "anchor")  # node-2 claims a block
    try:
        inside = ipaddress.ip_address(anchor.addresses(4)[0]) + 5
        borrowed = lab.add_pod(n1, "r", "borrower", ip=str(inside))
        others = [lab.add_pod(n, "r", f"peer{n.index}") for n in lab.nodes]
        assert borrowed.addresses(4) == [str(inside)]
        for pod in [anchor, *others]:
            assert lab.ping_until(pod.netns, str(inside), timeout=15) is not None, pod.label
        assert lab.ping_until(borrowed.netns, anchor.addresses(4)[0]) is not None
        n3_routes = lab.routes(lab.nodes[2], 4)
        assert f"{inside} via {n1.ipv4.ip} dev eth0 proto bird" in n3_routes
    finally:
        remove_pods(lab)


def test_route_reflector_topology(make_lab: LabFactory) -> None:
    """Mesh off; node-1 is a route reflector (Node label + routeReflectorClusterID); every
    node peers with the reflectors (BGPPeer peerSelector); clients learn each other's
    blocks through it."""
    lab = make_lab(backend="bird", ipv6=False)
    docs = [
        {
            "apiVersion": "tabby.io/v1",
            "kind": "BGPConfiguration",
            "metadata": {"name": "default"},
            "spec": {"nodeToNodeMeshEnabled": False},
        },
        {
            "apiVersion": "tabby.io/v1",
            "kind": "Node",
            "metadata": {"name": "node-1", "labels": {"route-reflector": "true"}},
            "spec": {"bgp": {"routeReflectorClusterID": "224.0.0.1"}},
        },
        {
            "apiVersion": "tabby.io/v1",
            "kind": "BGPPeer",
            "metadata": {"name": "peer-with-rr"},
            "spec": {"nodeSelector": "all()", "peerSelector": "route-reflector == 'true'"},
        },
    ]
    apply(lab, docs)
    rr, c1, c2 = lab.nodes
    status = wait_sessions(lab, rr, want=2)
    assert sorted((p["address"], p["type"]) for p in status["peers"]) == sorted(
        (str(n.ipv4.ip), "rr") for n in (c1, c2)
    )
    for client in (c1, c2):
        status = wait_sessions(lab, client, want=1)
        assert [(p["address"], p["type"]) for p in status["peers"]] == [(str(rr.ipv4.ip), "rr")]
    pods_everywhere(lab, per_node=1)
    assert wait_matrix(lab, families=(4,)) == []
    c2_block = next(p for p in lab.pods if p.node == c2.name).addresses(4)[0]
    block = str(ipaddress.ip_network(f"{c2_block}/26", strict=False))
    # c1 learns c2's block from the reflector, with c2 as the next hop (no next-hop-self)
    assert f"{block} via {c2.ipv4.ip} dev eth0 proto bird" in lab.routes(c1, 4)


def test_tabby_node_sigkill_and_restart_disturbs_no_pod(make_lab: LabFactory) -> None:
    """SIGKILL tabby-node: BIRD keeps running (and routing); the next tabby-node adopts the
    same BIRD without resetting its sessions; pods keep interfaces and addresses."""
    lab = make_lab(backend="bird", ipv6=False)
    pods_everywhere(lab, per_node=1)
    assert wait_matrix(lab, families=(4,)) == []
    n1 = lab.nodes[0]
    before = wait_sessions(lab, n1, want=2)
    bird_pid = n1.bird_pid()
    assert bird_pid is not None
    lab.stop_agent(n1, signal.SIGKILL)
    assert os.path.exists(f"/proc/{bird_pid}")  # BIRD survived
    assert lab.matrix(families=(4,)) == []  # and routes stay
    lab.start_agent(n1)
    lab.wait_agent(n1)
    lab.wait_ready(60)
    assert n1.bird_pid() == bird_pid  # adopted, not restarted
    after = wait_sessions(lab, n1, want=2)
    since = {p["address"]: p["since"] for p in before["peers"]}
    assert {p["address"]: p["since"] for p in after["peers"]} == since  # no session reset
    pod = next(p for p in lab.pods if p.node == n1.name)
    links = lab.in_ns(pod.netns, "ip", "-4", "addr", "show", "eth0").stdout
    assert pod.addresses(4)[0] in links
    assert wait_matrix(lab, families=(4,)) == []


def test_bird_killed_is_restarted_by_tabby_node(make_lab: LabFactory) -> None:
    lab = make_lab(backend="bird", ipv6=False, nodes_wanted=2)
    pods_everywhere(lab, per_node=1)
    assert wait_matrix(lab, families=(4,)) == []
    n1 = lab.nodes[0]
    pid = n1.bird_pid()
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 20
    while n1.bird_pid() in (None, pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert n1.bird_pid() not in (None, pid)
    wait_sessions(lab, n1, want=1)
    assert wait_matrix(lab, families=(4,)) == []


def test_deleted_node_routes_are_withdrawn_everywhere(make_lab: LabFactory) -> None:
    lab = make_lab(backend="bird", ipv6=False)
    pods_everywhere(lab, per_node=1)
    assert wait_matrix(lab, families=(4,)) == []
    n3 = lab.nodes[2]
    gone = next(p for p in lab.pods if p.node == n3.name)
    block = str(ipaddress.ip_network(f"{gone.addresses(4)[0]}/26", strict=False))
    lab.stop_agent(n3, signal.SIGKILL)  # it cannot re-register; its BIRD lingers
    lab.kill_bird(n3)
    proc = lab.tabbyctl("delete", "node", n3.name)
    assert proc.returncode == 0, proc.stderr
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        if all(block not in block_routes(lab, n) for n in lab.nodes[:2]):
            break
        time.sleep(0.2)
    for n in lab.nodes[:2]:
        assert block not in block_routes(lab, n), n.name


# -- VXLAN -------------------------------------------------------------------------------------


def test_vxlan_dual_stack(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    pods_everywhere(lab)
    try:
        assert wait_matrix(lab) == []
        for node in lab.nodes:
            want = {(o.name, str(o.ipv4.ip)) for o in lab.nodes if o is not node}
            status = wait_vxlan_peers(lab, node, want)
            assert status["backend"] == "vxlan"
            assert want <= {(v["node"], v["address"]) for v in status["vxlan"]}
            routes = block_routes(lab, node)
            for pod in lab.pods:
                block = str(ipaddress.ip_network(f"{pod.addresses(4)[0]}/26", strict=False))
                if pod.node == node.name:
                    assert routes[block].startswith("blackhole")
                else:
                    assert "dev vxlan.tabby proto 116 onlink" in routes[block]
            assert "vxlan-v6.tabby" in lab.routes(node, 6)
    finally:
        remove_pods(lab)


def test_vxlan_borrowed_address(vxlan_lab: Lab) -> None:
    lab = vxlan_lab
    n1, n2, n3 = lab.nodes
    anchor = lab.add_pod(n2, "r", "anchor")
    try:
        inside = ipaddress.ip_address(anchor.addresses(4)[0]) + 7
        borrowed = lab.add_pod(n1, "r", "borrower", ip=str(inside))
        probe = lab.add_pod(n3, "r", "probe")
        for pod in (anchor, probe):
            assert lab.ping_until(pod.netns, str(inside), timeout=10) is not None, pod.label
        assert lab.ping_until(borrowed.netns, probe.addresses(4)[0]) is not None
    finally:
        remove_pods(lab)


def test_vxlan_cross_subnet(make_lab: LabFactory) -> None:
    """CrossSubnet: nodes in one subnet route directly over the underlay, the node in the
    other subnet is reached through the tunnel."""
    lab = make_lab(backend="vxlan", ipv6=False, subnets=2)
    apply(
        lab,
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "IPPool",
                "metadata": {"name": "default-ipv4-ippool"},
                "spec": {"cidr": "10.244.0.0/16", "vxlanMode": "CrossSubnet"},
            }
        ],
    )
    pods_everywhere(lab, per_node=1)
    assert wait_matrix(lab, families=(4,)) == []
    n1, n2, n3 = lab.nodes
    routes = block_routes(lab, n1)
    block_of = {
        p.node: str(ipaddress.ip_network(f"{p.addresses(4)[0]}/26", strict=False)) for p in lab.pods
    }
    assert f"via {n2.ipv4.ip} dev eth0 proto 116 onlink" in routes[block_of[n2.name]]
    assert "dev vxlan.tabby proto 116 onlink" in routes[block_of[n3.name]]


# -- the datastore under stress ------------------------------------------------------------------


def test_etcd_leader_killed_while_pods_are_added(make_lab: LabFactory) -> None:
    """SIGKILL the etcd leader while two nodes add pods: every ADD succeeds or fails with
    code 11; no address twice; writes resume after the election; routes converge."""
    lab = make_lab(backend="vxlan", ipv6=False)
    results: list[tuple[str, int, Any]] = []
    lock = threading.Lock()

    def stream(node: LabNode) -> None:
        for j in range(12):
            pod_name = f"s{node.index + 1}-{j}"
            try:
                pod = lab.add_pod(node, "stress", pod_name)
                with lock:
                    results.append((pod.label, 0, pod.addresses(4)))
            except Exception as e:
                with lock:
                    results.append((pod_name, 1, str(e)))

    workers = [threading.Thread(target=stream, args=(n,)) for n in lab.nodes[:2]]
    for w in workers:
        w.start()
    time.sleep(0.8)
    leader = find_leader(lab)
    assert leader is not None
    assert leader.etcd is not None
    leader.etcd.send_signal(signal.SIGKILL)
    for w in workers:
        w.join(timeout=300)
    failures = [r for r in results if r[1]]
    for _, _, err in failures:
        assert "'code': 11" in err or '"code": 11' in err, err
    addresses = [a for _, rc, addrs in results if rc == 0 for a in addrs]
    assert len(addresses) == len(set(addresses)), "an address was handed out twice"
    assert len(addresses) >= 12, results  # most ADDs went through
    assert wait_matrix(lab, timeout=30, families=(4,)) == []
    # DEL of everything (the failed ADDs too, as runtimes do) leaves nothing allocated
    remove_pods(lab)
    show = lab.tabbyctl("ipam", "show", "-o", "json")
    assert show.returncode == 0, show.stderr
    pods_left = [a for a in json.loads(show.stdout)["allocations"] if a.get("pod")]
    assert pods_left == [], pods_left


def find_leader(lab: Lab) -> LabNode | None:
    from tabbyctl.demo.lab import http_get

    for node in lab.nodes[: lab.members()]:
        code, body = http_get(
            node.netns, "http://127.0.0.1:2379/v3/maintenance/status", 2, body=b"{}"
        )
        if code != 200:
            continue
        try:
            status = json.loads(body)
        except ValueError:
            continue
        header = status.get("header", {})
        if status.get("leader") and status.get("leader") == header.get("member_id"):
            return node
    return None


def apply(lab: Lab, docs: list[dict[str, Any]]) -> None:
    path = os.path.join(lab.workdir, f"apply-{time.monotonic_ns()}.yaml")
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n---\n".join(json.dumps(d) for d in docs))
    proc = lab.tabbyctl("apply", "-f", path)
    assert proc.returncode == 0, proc.stderr
