"""Every tabbyctl command on the Kubernetes datastore (``--datastore-type kubernetes``, a
kubeconfig reaching the in-memory API server): get of every kind (Kubernetes' own read where
they live, endpoints made of the allocations with their pods' labels), apply and delete of
tabby's kinds (the objects kubectl sees), Kubernetes' own refused in one line with nothing
written, ``ipam show|check|gc|release``, pools, ``node status``, ``policy explain|log|trace``."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

from dataplane import host_veth_name

from .conftest import NET, POOL, Kdd
from .helpers import ok, one_line_error, row

# -- get ------------------------------------------------------------------------------------------


def test_every_kind_is_read_from_the_api(kdd: Kdd) -> None:
    ips = kdd.cluster()
    nodes = ok(kdd.run("get", "nodes"))
    assert row(nodes, "node-1")[1:] == ["vxlan", "192.168.7.1/24", "-", "-", "-", "zone=a"]
    pods = ok(kdd.run("get", "pods", "-n", "x"))
    assert [r.split()[:3] for r in pods[1:]] == [["x", "a", "pod=a"], ["x", "b", "pod=b"]]
    assert "http:80/TCP" in pods[1]
    assert row(ok(kdd.run("get", "ns")), "x")[1] == "kubernetes.io/metadata.name=x,team=x"
    assert row(ok(kdd.run("get", "netpol", "-n", "x")), "x")[1:3] == ["a-from-b", "pod=a"]
    assert row(ok(kdd.run("get", "ippools")), "ippool-10-244-0-0-16")[1] == POOL
    assert ok(kdd.run("get", "bgppeers")) == ["no bgppeers found"]
    assert ok(kdd.run("get", "bgpconfigurations")) == ["no bgpconfigurations found"]
    # endpoints: one per attachment, made of the blocks' allocations, with the pods' labels
    listed = kdd.json("get", "workloadendpoints")["items"]
    by_pod = {f"{w['metadata']['namespace']}/{w['spec']['pod']}": w for w in listed}
    assert sorted(by_pod) == ["x/a", "x/b", "y/c"]
    a = by_pod["x/a"]
    assert a["spec"]["ipNetworks"] == [f"{ips['x/a']}/32"]
    assert a["spec"]["node"] == "node-1"
    assert a["metadata"]["labels"] == {"pod": "a"}
    table = ok(kdd.run("get", "wep", "-n", "y"))
    assert table[1].split()[2:4] == ["node-1", "c"]
    assert table[1].split()[-1] == "pod=c"
    one = kdd.run("get", "pod", "a", "-n", "x", "-o", "yaml")
    assert "  name: a" in ok(one)
    # the global flags name the datastore as well as a conflist does
    flags = kdd.run(
        "--datastore-type", "kubernetes", "--kubeconfig", kdd.kubeconfig, "get", "nodes", conf=False
    )
    assert row(ok(flags), "node-2")[-1] == "zone=b"


# -- apply and delete of tabby's kinds ---------------------------------------------------------

POOL_DOC = """\
apiVersion: tabby.io/v1
kind: IPPool
metadata: {name: blue}
spec: {cidr: 10.99.0.0/24, blockSize: 28}
---
apiVersion: tabby.io/v1
kind: BGPPeer
metadata: {name: rr1}
spec: {peerIP: 10.0.0.9, asNumber: 64512}
---
apiVersion: tabby.io/v1
kind: BGPConfiguration
metadata: {name: default}
spec: {asNumber: 64513, nodeToNodeMeshEnabled: false}
"""


def test_tabbys_kinds_are_applied_and_deleted_as_objects_kubectl_sees(kdd: Kdd) -> None:
    kdd.cluster()
    assert ok(kdd.run("apply", "-f", "-", stdin=POOL_DOC)) == [
        "IPPool/blue created",
        "BGPPeer/rr1 created",
        "BGPConfiguration/default created",
    ]
    blue = kdd.objects("pool")["blue"]["spec"]
    assert (blue["cidr"], blue["blockSize"], blue["disabled"]) == ("10.99.0.0/24", 28, False)
    assert kdd.objects("bgppeer")["rr1"]["spec"]["peerIP"] == "10.0.0.9"
    assert kdd.objects("bgpconfiguration")["default"]["spec"]["asNumber"] == 64513
    assert ok(kdd.run("apply", "-f", "-", stdin=POOL_DOC)) == [
        "IPPool/blue unchanged",
        "BGPPeer/rr1 unchanged",
        "BGPConfiguration/default unchanged",
    ]
    # a tabby Node's spec is tabbyctl's to change; its labels stay the Kubernetes Node's
    got = kdd.run("get", "node", "node-1", "-o", "yaml")
    changed = ok(got)
    text = "\n".join(changed).replace("spec:", "spec:\n  bgp: {asNumber: 65001}", 1)
    assert ok(kdd.run("apply", "-f", "-", stdin=text)) == ["Node/node-1 configured"]
    assert kdd.objects("node")["node-1"]["spec"]["bgp"] == {"asNumber": 65001}
    assert "labels" not in kdd.objects("node")["node-1"]["metadata"]
    assert row(ok(kdd.run("get", "nodes")), "node-1")[4] == "65001"
    for kind, name in (("ippool", "blue"), ("bgppeer", "rr1"), ("bgpconfiguration", "default")):
        assert ok(kdd.run("delete", kind, name)) == [f"{kind_label(kind)}/{name} deleted"]
    assert "blue" not in kdd.objects("pool")
    assert kdd.objects("bgppeer") == {}
    # delete node --release-blocks: the tabby Node, its blocks and addresses
    lines = ok(kdd.run("delete", "node", "node-2", "--release-blocks"))
    assert lines[0] == "Node/node-2 deleted"
    assert "released 1 address(es) of 1 attachment(s)" in lines[1]
    assert "node-2" not in kdd.objects("node")
    assert "node-2" not in kdd.objects("affinity")


def kind_label(kind: str) -> str:
    return {"ippool": "IPPool", "bgppeer": "BGPPeer", "bgpconfiguration": "BGPConfiguration"}[kind]


# -- Kubernetes' own: refused in one line, nothing written -----------------------------------

POD = """\
apiVersion: v1
kind: Pod
metadata: {name: %s, namespace: x}
spec: {containers: [{name: c, image: busybox}]}
"""
NAMESPACE = "apiVersion: v1\nkind: Namespace\nmetadata: {name: %s}\n"
NETPOL = """\
apiVersion: networking.k8s.io/v1
kind: NetworkPolicy
metadata: {name: %s, namespace: x}
spec: {podSelector: {}}
"""
WEP = """\
apiVersion: tabby.io/v1
kind: WorkloadEndpoint
metadata: {name: node--1-k8s-a-eth0, namespace: x}
spec: {node: node-1, pod: a, containerID: c1, interface: eth0, hostInterface: cali1}
"""


@pytest.mark.parametrize(
    ("doc", "label"),
    [
        (POD % "a", "Pod/a"),  # exists
        (POD % "new", "Pod/new"),  # does not
        (NAMESPACE % "x", "Namespace/x"),
        (NAMESPACE % "other", "Namespace/other"),
        (NETPOL % "a-from-b", "NetworkPolicy/a-from-b"),
        (NETPOL % "new", "NetworkPolicy/new"),
    ],
)
def test_applying_kubernetes_own_kinds_is_refused_in_one_line(
    kdd: Kdd, doc: str, label: str
) -> None:
    kdd.cluster()
    mark = len(kdd.fake.requests)
    line = one_line_error(kdd.run("apply", "-f", "-", stdin=doc))
    assert line == (
        f"Error: {label} is Kubernetes' own in the Kubernetes datastore: change it with kubectl"
    )
    assert kdd.writes(mark) == []


def test_deleting_kubernetes_own_kinds_is_refused_and_a_mixed_file_writes_nothing(
    kdd: Kdd,
) -> None:
    kdd.cluster()
    mark = len(kdd.fake.requests)
    for args, label in (
        (("pod", "a", "-n", "x"), "Pod/a"),
        (("ns", "y"), "Namespace/y"),
        (("netpol", "a-from-b", "-n", "x"), "NetworkPolicy/a-from-b"),
    ):
        line = one_line_error(kdd.run("delete", *args))
        assert line == (
            f"Error: {label} is Kubernetes' own in the Kubernetes datastore: change it with kubectl"
        )
    line = one_line_error(kdd.run("delete", "-f", "-", stdin=POD % "a"))
    assert "Pod/a is Kubernetes' own" in line
    # all or nothing: the BGPPeer before the NetworkPolicy is not written either
    mixed = POOL_DOC.split("---\n")[1] + "---\n" + NETPOL % "np"
    line = one_line_error(kdd.run("apply", "-f", "-", stdin=mixed))
    assert "NetworkPolicy/np is Kubernetes' own" in line
    line = one_line_error(kdd.run("apply", "-f", "-", stdin=WEP))
    assert "is made of its pod's IPAM allocations in the Kubernetes datastore" in line
    assert kdd.writes(mark) == []
    assert kdd.objects("bgppeer") == {}


def test_a_nodes_labels_are_the_kubernetes_nodes(kdd: Kdd) -> None:
    kdd.cluster()
    doc = "apiVersion: tabby.io/v1\nkind: Node\nmetadata: {name: node-1, labels: {zone: c}}\n"
    line = one_line_error(kdd.run("apply", "-f", "-", stdin=doc))
    assert line == (
        "Error: Node/node-1: its labels are the Kubernetes Node's in the Kubernetes datastore: "
        "change them with kubectl label node node-1"
    )


# -- ipam and pools -----------------------------------------------------------------------------


def test_ipam_show_check_release_and_gc(kdd: Kdd) -> None:
    ips = kdd.cluster()
    show = kdd.json("ipam", "show")
    assert show["store"] == f"Kubernetes API ({kdd.kubeconfig})"
    held = {a["pod"]: (a["ip"], a["node"]) for a in show["allocations"]}
    assert held == {
        "x/a": (ips["x/a"], "node-1"),
        "x/b": (ips["x/b"], "node-2"),
        "y/c": (ips["y/c"], "node-1"),
    }
    assert {b["node"] for b in show["blocks"]} == {"node-1", "node-2"}
    owner = kdd.json("ipam", "show", "--ip", ips["x/b"])
    assert (owner["pod"], owner["node"]) == ("x/b", "node-2")
    check = kdd.run("ipam", "check")
    assert ok(check) == [f"no problems found (Kubernetes API ({kdd.kubeconfig}), node node-1)"]
    # a leak on this node: its netns and its veth gone
    leaked = kdd.pod("y", "gone", {"pod": "gone"}, "node-1", veth=False, netns=False)
    data = kdd.json("ipam", "check")
    assert not data["ok"]
    assert {f["kind"] for f in data["node"]} == {"netns-gone", "host-veth-gone"}
    assert kdd.json("ipam", "gc", "--dry-run")["stale"] == {f"{NET}:y-gone:eth0": [leaked]}
    assert kdd.json("ipam", "gc")["released"] == {f"{NET}:y-gone:eth0": [leaked]}
    assert ok(kdd.run("ipam", "check"))[0].startswith("no problems found")
    # release by address (any node's) and by handle (this node's)
    assert ok(kdd.run("ipam", "release", "--ip", ips["x/b"])) == [f"released {ips['x/b']}"]
    out = ok(kdd.run("ipam", "release", "--handle", f"{NET}:y-c:eth0"))
    assert out == [f"released {ips['y/c']}"]
    assert [a["pod"] for a in kdd.json("ipam", "show")["allocations"]] == ["x/a"]


def test_ipam_gc_of_a_node_waits_for_its_kubernetes_node(kdd: Kdd) -> None:
    kdd.cluster()
    line = one_line_error(kdd.run("ipam", "gc", "--node", "node-2"))
    assert line == (
        "Error: node node-2 is alive: its Kubernetes Node is Ready; drain and delete it "
        "(kubectl delete node node-2), or give --force"
    )
    dry = kdd.run("ipam", "gc", "--node", "node-2", "--dry-run")
    assert "warning: node node-2 is alive (its Kubernetes Node is Ready)" in ok(dry)
    kdd.fake.delete("/api/v1/nodes", "node-2")  # kubectl delete node node-2
    done = kdd.json("ipam", "gc", "--node", "node-2")
    assert (len(done["addresses"]), done["alive"]) == (1, False)
    assert "node-2" not in kdd.objects("affinity")


def test_pools_are_ippool_objects(kdd: Kdd) -> None:
    kdd.cluster()
    assert ok(kdd.run("pool", "add", "10.98.0.0/24", "--block-size", "28")) == [
        "pool 10.98.0.0/24 added"
    ]
    assert kdd.objects("pool")["ippool-10-98-0-0-24"]["spec"]["blockSize"] == 28
    ok(kdd.run("pool", "disable", "10.98.0.0/24"))
    assert kdd.objects("pool")["ippool-10-98-0-0-24"]["spec"]["disabled"] is True
    listed = {p["cidr"]: p for p in kdd.json("pool", "list")}
    assert listed["10.98.0.0/24"]["disabled"]
    assert listed[POOL]["in_use"] == 3
    ok(kdd.run("pool", "enable", "10.98.0.0/24"))
    assert ok(kdd.run("pool", "delete", "10.98.0.0/24")) == ["pool 10.98.0.0/24 deleted"]
    assert "ippool-10-98-0-0-24" not in kdd.objects("pool")
    line = one_line_error(kdd.run("pool", "delete", POOL))
    assert "in use" in line


# -- node status: tabby-node's status file, whatever the datastore ------------------------------


def test_node_status_reads_the_local_status_file(kdd: Kdd) -> None:
    from tabby_node.status import write_status

    kdd.run_dir.mkdir()
    write_status(
        str(kdd.run_dir),
        {
            "node": "node-1",
            "backend": "vxlan",
            "node_ip": "192.168.7.1",
            "updated": time.time(),
            "pid": __import__("os").getpid(),
            "peers": [],
            "vxlan": [],
            "problems": {},
        },
    )
    data = kdd.json("node", "status", "--run-dir", str(kdd.run_dir))
    assert (data["node"], data["backend"]) == ("node-1", "vxlan")


# -- policy -------------------------------------------------------------------------------------


def test_policy_explain_reads_pods_namespaces_and_policies_from_the_api(kdd: Kdd) -> None:
    kdd.cluster()
    lines = ok(kdd.run("policy", "explain", "x/a"))
    assert lines[1] == "  ingress: isolated, selected by x/a-from-b"
    allowed = kdd.json("policy", "explain", "x/a", "--from", "x/b", "--port", "80")
    assert allowed["traffic"]["allowed"] is True
    denied = kdd.json("policy", "explain", "x/a", "--from", "y/c", "--port", "80")
    assert denied["traffic"]["allowed"] is False
    named = kdd.json("policy", "explain", "x/a", "--from", "x/b", "--port", "http")
    assert (named["traffic"]["allowed"], named["traffic"]["port"]) == (True, 80)


def test_policy_log_finds_the_nodes_in_the_api(kdd: Kdd, monkeypatch: pytest.MonkeyPatch) -> None:
    from tabbyctl import policy_log

    kdd.cluster()
    seen: list[list[tuple[str, int]]] = []

    def show(sources: list[Any], **kw: Any) -> None:
        seen.append([(s.host, s.port) for s in sources])

    monkeypatch.setattr(policy_log, "show", show)
    ok(kdd.run("policy", "log", "--all-nodes", "--metrics-port", "9091"))
    assert seen == [[("192.168.7.1", 9091), ("192.168.7.2", 9091)]]


def test_policy_trace_asks_the_other_node_through_trace_objects(
    kdd: Kdd, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The trace's datastore side on the API: the request and the other node's answers are
    leased ``policytraces.tabby.io`` objects; none is left behind."""
    from dataplane import nfttrace
    from resources import trace as rtrace
    from tabbyctl import policy_trace
    from tabbyctl.policy import read_cluster

    ips = kdd.cluster()

    class Socket:
        def probe(self, port: int | None) -> Any:
            return type(
                "P",
                (),
                {
                    "src": ips["x/a"],
                    "dst": ips["x/b"],
                    "protocol": "TCP",
                    "sport": 40000,
                    "dport": 80,
                    "icmp_id": None,
                },
            )()

        def send(self, port: int | None) -> None:
            pass

        def answer(self, seconds: float) -> str:
            return "connected"

        def close(self) -> None:
            pass

    class Trace:
        def __init__(self, probe: Any) -> None:
            pass

        def __enter__(self) -> Trace:
            return self

        def __exit__(self, *exc: object) -> None:
            pass

        def collect(self, seconds: float) -> list[Any]:
            return []

        def rules(self) -> dict[str, Any]:
            return {}

    monkeypatch.setattr(policy_trace, "_open_socket", lambda p: Socket())
    monkeypatch.setattr(nfttrace, "Trace", Trace)
    # node-2 (where x/b is) answers as its tabby-node does: armed, then done
    stop = threading.Event()
    requests: list[str] = []

    def other_node() -> None:
        from datastore.base import leases

        lease = leases(kdd.store)
        while not stop.is_set():
            for key, _doc in kdd.store.list(rtrace.KIND):
                if "." in key or key in requests:
                    continue
                requests.append(key)
                answer = rtrace.answer_key(key, "node-2")
                armed = rtrace.TraceAnswer(key, "node-2", "armed", ())
                rev = lease.put_leased(rtrace.KIND, answer, armed.to_data(), None, ttl=30)
                time.sleep(0.2)
                done = rtrace.TraceAnswer(key, "node-2", "done", ())
                lease.put_leased(rtrace.KIND, answer, done.to_data(), rev, ttl=30)
            time.sleep(0.05)

    t = threading.Thread(target=other_node, daemon=True)
    t.start()
    try:
        netns = tmp_path / "netns-a"
        netns.touch()
        here = host_veth_name("cali", NET, "x-a", "eth0")
        trace = policy_trace.plan(
            read_cluster(kdd.store), "x/a", "x/b", "80", lambda addr: str(netns), here.__eq__
        )
        assert (trace.src_node, trace.dst_node, trace.dst_remote) == ("node-1", "node-2", True)
        answer = policy_trace.run(trace, kdd.store)
    finally:
        stop.set()
        t.join(5)
    assert len(requests) == 1
    assert answer["kernel"]["ingress"]["node"] == "node-2"
    traces = [r for r in kdd.writes() if "/policytraces" in r]
    assert traces[0] == "POST /apis/tabby.io/v1/policytraces"  # the request, leased
    assert f"DELETE /apis/tabby.io/v1/policytraces/{requests[0]}" in traces  # gone at the end
    assert requests[0] not in kdd.objects("trace")
    # its annotation is the lease's end: an expired one reads as absent
    (left,) = kdd.objects("trace").values()
    assert float(left["metadata"]["annotations"]["tabby.io/expires"]) > time.time()
