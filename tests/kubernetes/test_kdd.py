"""tabby on the Kubernetes datastore (the bird cluster: tests/kubernetes/conftest.py), where
Kubernetes' own objects are read where they live and tabby's are CRDs: nothing of tabby in
etcd; what kubectl changes is what tabby reads, at once and with no controller; tabbyctl
works on it and refuses what is Kubernetes' in one line; a new pod is never reachable
against an isolating policy; the chaos of a 64-pod burst with tabby-node killed and the API
server restarted in the middle leaves no address twice, no block with two owners and
nothing leaked; an unreachable API server makes an ADD fail with code 11 within
``lock_timeout_seconds``, served or not."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from lab.kubernetes import node as knode
from lab.kubernetes.cluster import KubeLab
from lab.kubernetes.controllers import Controllers
from tests.kubernetes.helpers import eventually, isolate_secret_pods, secret_pod, tabby_get
from tests.kubernetes.icmp import Pinger

pytestmark = [
    pytest.mark.kubernetes,
    pytest.mark.parametrize("kube_lab", ["bird"], indirect=True),
]


@pytest.fixture
def scratch(kube_lab: KubeLab, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own, deleted afterwards."""
    ns = ("k-" + request.node.name.split("[")[0].removeprefix("test_")[:30]).replace("_", "-")
    ns = ns.rstrip("-")
    kube_lab.apply({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns}})
    yield ns
    kube_lab.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def ctl_json(kube: KubeLab, *args: str) -> Any:
    proc = kube.tabbyctl(*args, "-o", "json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def allocations(kube: KubeLab, ns: str) -> list[dict[str, Any]]:
    report = ctl_json(kube, "ipam", "show")
    return [a for a in report["allocations"] if str(a.get("pod", "")).startswith(f"{ns}/")]


def ipam_problems(kube: KubeLab) -> list[Any]:
    proc = kube.tabbyctl("ipam", "check", "-o", "json")
    report = json.loads(proc.stdout)
    return [p for p in report["store"] if p["severity"] == "error"]


# == where tabby's state is ======================================================================


def test_nothing_of_tabby_is_in_etcd(kube_lab: KubeLab, scratch: str) -> None:
    """With pods running and a pool in use, etcd holds Kubernetes' objects only: tabby's are
    objects of its CRDs (kept by the API server under /registry/tabby.io/)."""
    kube = kube_lab
    kube.apply(kube.sleeper_pod("p", scratch, {"app": "x"}))
    kube.wait_pods(scratch, "", 1)
    keys = kube.etcd_keys()
    assert keys, "etcd answered no key at all"
    assert [k for k in keys if not k.startswith("/registry/")] == []
    assert any(k.startswith("/registry/tabby.io/ipamblocks/") for k in keys)
    assert any(k.startswith("/registry/tabby.io/ippools/") for k in keys)
    assert not any(k.startswith("/registry/tabby.io/handles") for k in keys)


# == what kubectl does is what tabby reads =========================================================


def test_kubectl_is_what_tabby_reads_with_no_controller(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    """The controllers stopped (they mirror nothing here): a pod, its labels, its namespace's
    labels and a NetworkPolicy are what tabbyctl shows as soon as kubectl made them; the
    WorkloadEndpoint is the pod's allocation with the pod's labels; ``kubectl get
    ippools.tabby.io`` and tabbyctl show one pool; what Kubernetes owns is refused in one
    line."""
    kube, ns = kube_lab, scratch
    for identity in list(controllers.replicas):
        controllers.stop(identity)  # the fixture starts them again for the next test
    kube.apply(kube.sleeper_pod("p", ns, {"app": "one"}))
    (p,) = kube.wait_pods(ns, "", 1)
    got = tabby_get(kube, "pod", "p", ns)
    assert got["metadata"]["labels"] == {"app": "one"}
    (wep,) = tabby_get(kube, "workloadendpoints", namespace=ns)["items"]
    assert wep["metadata"]["labels"] == {"app": "one"}
    assert [n.split("/")[0] for n in wep["spec"]["ipNetworks"]] == p.ips
    assert wep["spec"]["node"] == p.node
    kube.kubectl("label", "pod", "-n", ns, "p", "app=two", "--overwrite")
    (wep,) = tabby_get(kube, "workloadendpoints", namespace=ns)["items"]
    assert wep["metadata"]["labels"] == {"app": "two"}
    kube.kubectl("label", "namespace", ns, "team=red")
    assert tabby_get(kube, "namespace", ns)["metadata"]["labels"]["team"] == "red"
    kube.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "web", "namespace": ns},
            "spec": {"podSelector": {"matchLabels": {"app": "two"}}, "ingress": [{}]},
        }
    )
    assert tabby_get(kube, "networkpolicy", "web", ns)["spec"]["policyTypes"] == ["Ingress"]
    pools = kube.kubectl_json("get", "ippools.tabby.io")["items"]
    listed = ctl_json(kube, "get", "ippools")["items"]
    assert sorted(p["spec"]["cidr"] for p in pools) == sorted(p["spec"]["cidr"] for p in listed)
    # Kubernetes' own: refused in one line, nothing written
    path = Path(kube.workdir) / "kdd-pod.json"
    path.write_text(json.dumps({**kube.sleeper_pod("p", ns, {"app": "x"}), "spec": {}}))
    proc = kube.tabbyctl("apply", "-f", str(path))
    assert proc.returncode == 1
    assert "change it with kubectl" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
    proc = kube.tabbyctl("delete", "networkpolicy", "web", "-n", ns)
    assert proc.returncode == 1
    assert "change it with kubectl" in proc.stderr
    assert kube.get_pods(ns)[0].labels == {"app": "two"}
    # a pool the API server refuses, naming the field, as tabbyctl does
    bad = {
        "apiVersion": "tabby.io/v1",
        "kind": "IPPool",
        "metadata": {"name": "bad"},
        "spec": {"cidr": "10.0.0.0/33"},
    }
    refused = kube.kubectl("apply", "-f", "-", input=json.dumps(bad), check=False)
    assert refused.returncode != 0
    assert "spec.cidr" in refused.stderr
    assert ipam_problems(kube) == []


def test_a_new_pod_is_never_reachable_against_an_isolating_policy(
    kube_lab: KubeLab, scratch: str
) -> None:
    """The policy exists first; the pod's ADD waits for the pod in tabby-node's watch of the
    API (its labels), so the kernel never answers a ping from a pod the policy does not
    allow, from the first moment its interface has an address."""
    kube, ns = kube_lab, scratch
    isolate_secret_pods(kube, ns)
    target = "10.244.250.20"
    stranger = Pinger(kube.pod_netns(ns, "stranger"), target).start()
    client = Pinger(kube.pod_netns(ns, "client"), target).start()
    try:
        kube.apply(secret_pod(kube, ns, target))
        eventually("the allowed client reaches the new pod", lambda: len(client.replies) > 5, 60)
        time.sleep(1)
    finally:
        stranger.stop()
        client.stop()
    assert stranger.sent > 100
    assert stranger.replies == [], f"reached against the policy {len(stranger.replies)} times"


# == chaos ========================================================================================


def started(kube: KubeLab, ns: str) -> int:
    return sum(1 for p in kube.get_pods(ns) if p.ips)


def test_a_64_pod_burst_survives_tabby_node_killed_and_the_api_server_restarted(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    """64 pods at once on node-2. A few in, tabby-node on node-2 is SIGKILLed (and started
    again, as its DaemonSet would); a few more, the API server restarts. Every pod runs,
    with an address of its own; no block has two owners; the IPAM is consistent. Deleted,
    every pod goes and, after the grace periods, nothing is left allocated."""
    kube, ns = kube_lab, scratch
    node2 = kube.node("node-2")
    kube.apply(kube.sleeper_deployment("burst", ns, 64, "node-2"))
    kube.wait_for("8 pods with an address", lambda: started(kube, ns) >= 8, 300, interval=0.2)
    assert node2.agent is not None
    os.kill(node2.agent.pid, signal.SIGKILL)
    node2.agent.wait(10)
    kube.start_agent(node2)
    kube.wait_agent(node2)
    kube.wait_for("24 pods with an address", lambda: started(kube, ns) >= 24, 300, interval=0.2)
    kube.restart_apiserver()
    pods = kube.wait_pods(ns, "", 64, timeout=600)
    ips = [ip for p in pods for ip in p.ips]
    assert len(ips) == len(set(ips)) == 64
    assert ipam_problems(kube) == []
    held = allocations(kube, ns)
    assert sorted(a["ip"] for a in held) == sorted(ips), "an allocation without its pod"
    blocks = ctl_json(kube, "ipam", "show", "--show-blocks").get("blocks", [])
    owners: dict[str, set[str]] = {}
    for b in blocks:
        owners.setdefault(b["cidr"], set()).add(str(b.get("node")))
    assert [c for c, o in owners.items() if len(o) > 1] == []
    kube.kubectl("delete", "deployment", "-n", ns, "burst", "--wait=true", timeout=300)
    kube.wait_for("every pod gone", lambda: not kube.get_pods(ns), 300)
    grace = controllers.leak_grace + 60
    eventually("nothing left allocated", lambda: allocations(kube, ns) == [], grace)
    assert ipam_problems(kube) == []


def ipam_call(
    kube: KubeLab, node: str, command: str, cid: str, *, served: bool = True
) -> tuple[int, Any, float]:
    """tabby-ipam ``command`` on ``node`` as a runtime runs it (in the node, the node's
    conflist): through tabby-node's socket (``served``) or on its own; (exit code, answer,
    seconds)."""
    kn = kube.kube_node(node)
    doc = json.loads(kn.path(knode.CONFLIST).read_text())
    plugin = next(p for p in doc["plugins"] if p.get("type") == "tabby")
    conf = {"cniVersion": doc["cniVersion"], "name": doc["name"], **plugin}  # as delegated
    env = {
        "PATH": os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin"),
        "CNI_COMMAND": command,
        "CNI_CONTAINERID": cid,
        "CNI_NETNS": "/proc/1/ns/net",  # not the node's own (IPAM does not enter it)
        "CNI_IFNAME": "eth0",
        "CNI_PATH": knode.CNI_BIN,
        "TABBY_NODE_SOCKET": "/run/tabby/node.sock" if served else "/run/tabby/none.sock",
    }
    started_at = time.monotonic()
    proc = subprocess.run(
        [*kn.enter(), f"{knode.CNI_BIN}/tabby-ipam"],
        input=json.dumps(conf).encode(),
        capture_output=True,
        env=env,
        timeout=120,
        check=False,
    )
    took = time.monotonic() - started_at
    out = proc.stdout.decode().strip()
    return proc.returncode, json.loads(out) if out else None, took


def ipam_del(kube: KubeLab, node: str, cid: str) -> None:
    rc, out, _ = ipam_call(kube, node, "DEL", cid)
    assert rc == 0, out


def lock_timeout(kube: KubeLab, node: str) -> float:
    doc = json.loads(kube.kube_node(node).path(knode.CONFLIST).read_text())
    plugin = next(p for p in doc["plugins"] if p.get("type") == "tabby")
    return float(plugin["ipam"].get("lock_timeout_seconds", 10))


def test_an_unreachable_api_server_fails_an_add_with_code_11_in_time(kube_lab: KubeLab) -> None:
    """The API server stopped (connections refused) and then dropped on the way (no answer
    at all): an ADD, served by tabby-node or on its own, answers code 11 (try again later)
    within lock_timeout_seconds; with the API server back, both work again."""
    kube = kube_lab
    bound = lock_timeout(kube, "node-2")
    for served in (True, False):
        rc, out, _ = ipam_call(kube, "node-2", "ADD", f"up-{served}", served=served)
        assert rc == 0, out
        ipam_del(kube, "node-2", f"up-{served}")
    kube.stop_apiserver()
    try:
        for served in (True, False):
            rc, out, took = ipam_call(kube, "node-2", "ADD", f"down-{served}", served=served)
            assert (rc, out["code"]) == (1, 11), (served, out)
            assert took <= bound + 2, f"served={served}: {took:.1f} s"
    finally:
        kube.start_apiserver()
    # dropped, not refused: nothing answers, the client's timeout bounds the call
    netns = kube.node("node-2").netns
    api_ip, api_port = kube.api_server.removeprefix("https://").split(":")
    rule = f"ip daddr {api_ip} tcp dport {api_port} drop"
    nft = ["ip", "netns", "exec", netns, "nft"]
    subprocess.run([*nft, "add table inet tabbytest"], check=True)
    try:
        subprocess.run(
            [*nft, "add chain inet tabbytest out { type filter hook output priority 0; }"],
            check=True,
        )
        subprocess.run([*nft, f"add rule inet tabbytest out {rule}"], check=True)
        for served in (True, False):
            rc, out, took = ipam_call(kube, "node-2", "ADD", f"drop-{served}", served=served)
            assert (rc, out["code"]) == (1, 11), (served, out)
            assert took <= bound + 2, f"served={served}: {took:.1f} s"
    finally:
        subprocess.run([*nft, "delete table inet tabbytest"], check=True)
    kube.wait_for("every node Ready again", lambda: kube.nodes_ready(), 120)
    for served in (True, False):
        cid = f"back-{served}"
        rc, out = 1, None
        deadline = time.monotonic() + 60
        while rc != 0 and time.monotonic() < deadline:  # tabby-node's watch reconnecting
            rc, out, _ = ipam_call(kube, "node-2", "ADD", cid, served=served)
        assert rc == 0, out
        ipam_del(kube, "node-2", cid)
    assert ipam_problems(kube) == []
