"""tabby-kube-controllers on a real Kubernetes, two replicas with the manifest's service
account and RBAC. On both clusters (bird: the Kubernetes datastore, vxlan: etcd): a killed
leader's standby takes over; a leak and a deleted node are released after their grace, never
a live pod's address. The RBAC is least privilege. On etcd, where they mirror Kubernetes
into tabby's datastore: what kubectl does reaches tabby's datastore (the mirror's ownership
rules hold both ways); a pod created under an isolating policy is never reachable against
it, not even while the controllers lag; pods start with the controllers down and everything
converges when they return; an API server restart whose history was compacted (a 410 for
the watches) loses no deletion. (What the Kubernetes datastore reads directly, with no
mirror: test_kdd.py.) The tests of a cluster run in this order and leave it as they found
it (the last one deletes node-3 and brings it back)."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from lab.kubernetes.cluster import KubeLab
from lab.kubernetes.controllers import ACCOUNT, NAMESPACE, Controllers
from tests.kubernetes.helpers import eventually, isolate_secret_pods, secret_pod, tabby_get
from tests.kubernetes.icmp import Pinger

pytestmark = [pytest.mark.kubernetes]
#: The clusters (tests/kubernetes/conftest.py): bird on the Kubernetes datastore, vxlan on etcd.
KDD = pytest.mark.parametrize("kube_lab", ["bird"], indirect=True)
ETCD = pytest.mark.parametrize("kube_lab", ["vxlan"], indirect=True)
BOTH = pytest.mark.parametrize("kube_lab", ["bird", "vxlan"], indirect=True)

MARK = {"tabby.io/source": "kubernetes"}


def namespace(name: str, labels: dict[str, str] | None = None) -> dict[str, Any]:
    meta = {"name": name, "labels": labels or {}}
    return {"apiVersion": "v1", "kind": "Namespace", "metadata": meta}


@pytest.fixture
def scratch(kube_lab: KubeLab, request: pytest.FixtureRequest) -> Iterator[str]:
    """A namespace of the test's own, deleted afterwards (its mirrors with it)."""
    ns = ("t-" + request.node.name.split("[")[0].removeprefix("test_")[:30]).replace("_", "-")
    ns = ns.rstrip("-")
    kube_lab.apply(namespace(ns, {"test": "yes"}))
    yield ns
    kube_lab.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def tabbyctl_apply(kube: KubeLab, doc: dict[str, Any]) -> tuple[int, str]:
    path = f"{kube.workdir}/apply-{time.monotonic_ns()}.json"
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f)
    proc = kube.tabbyctl("apply", "-f", path)
    return proc.returncode, proc.stderr


def labels(kube: KubeLab, kind: str, name: str, ns: str | None = None) -> dict[str, str]:
    """A tabby resource's labels ({} when it does not exist)."""
    doc = tabby_get(kube, kind, name, ns) or {}
    return dict(doc.get("metadata", {}).get("labels") or {})


def relists(controllers: Controllers) -> float:
    """Full lists made by every replica (tabby_controllers_relists_total)."""
    return sum(
        v
        for i in controllers.replicas
        for k, v in controllers.metrics(i).items()
        if k.startswith("tabby_controllers_relists_total")
    )


# == least privilege ==============================================================================


@KDD
def test_rbac_is_least_privilege(kube_lab: KubeLab, controllers: Controllers) -> None:
    me = f"system:serviceaccount:{NAMESPACE}:{ACCOUNT}"
    node = f"system:serviceaccount:{NAMESPACE}:tabby-node"
    allowed = [
        ("list", "pods", None),
        ("watch", "pods", None),
        ("list", "namespaces", None),
        ("watch", "nodes", None),
        ("list", "networkpolicies.networking.k8s.io", None),
        ("create", "leases.coordination.k8s.io", NAMESPACE),
        ("update", "leases.coordination.k8s.io/tabby-kube-controllers", NAMESPACE),
    ]
    denied = [
        ("create", "pods", "default"),
        ("delete", "pods", "default"),
        ("patch", "nodes", None),
        ("get", "secrets", NAMESPACE),
        ("list", "secrets", None),
        ("update", "networkpolicies.networking.k8s.io", "default"),
        ("update", "leases.coordination.k8s.io/some-other-lease", NAMESPACE),
        ("create", "leases.coordination.k8s.io", "kube-system"),
        ("delete", "leases.coordination.k8s.io/tabby-kube-controllers", NAMESPACE),
    ]

    def can(user: str, verb: str, what: str, ns: str | None) -> bool:
        args = ["auth", "can-i", verb, what, f"--as={user}"]
        args += ["-n", ns] if ns else ["--all-namespaces"]
        out = kube_lab.kubectl(*args, check=False).stdout.strip()
        return out == "yes"

    assert [a for a in allowed if not can(me, *a)] == []
    assert [d for d in denied if can(me, *d)] == []
    # tabby-node reads what the Kubernetes datastore needs of the API (every account's roles:
    # tests/kubernetes/test_manifest.py), never the controllers' Lease
    assert [a for a in allowed if "leases" in a[1] and can(node, *a)] == []
    assert not can(node, "get", "namespaces", None)


# == the mirror ===================================================================================


@ETCD
def test_what_kubectl_does_reaches_tabby(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    kube, ns = kube_lab, scratch
    kube.kubectl("label", "namespace", ns, "team=red")
    kube.apply(kube.sleeper_pod("p", ns, {"app": "one"}))
    (p,) = kube.wait_pods(ns, "", 1)

    def mirrored() -> bool:
        doc = tabby_get(kube, "pod", "p", ns) or {}
        meta, status = doc.get("metadata", {}), doc.get("status") or {}
        return (
            meta.get("labels") == {"app": "one"}
            and meta.get("annotations") == MARK
            and meta.get("uid") == p.uid
            and doc["spec"].get("nodeName") == p.node
            and [x["ip"] for x in status.get("podIPs", [])] == p.ips
        )

    eventually("the pod mirrored with its uid, node and address", mirrored)
    eventually(
        "the namespace mirrored",
        lambda: (
            (tabby_get(kube, "namespace", ns) or {})
            .get("metadata", {})
            .get("labels", {})
            .get("team")
            == "red"
        ),
    )

    def endpoint_labels() -> dict[str, str]:
        (wep,) = tabby_get(kube, "workloadendpoints", namespace=ns)["items"]
        return dict(wep["metadata"].get("labels") or {})

    kube.kubectl("label", "pod", "-n", ns, "p", "app=two", "--overwrite")
    # Event-driven, not the 300 s resync: well inside 30 s even on a loaded machine (how
    # fast is kube_bench's business; a 3 s bound here failed under load)
    eventually("the endpoint relabelled", lambda: endpoint_labels() == {"app": "two"}, 30)
    kube.kubectl("label", "namespace", ns, "team=blue", "--overwrite")
    eventually(
        "the namespace relabelled",
        lambda: labels(kube, "namespace", ns).get("team") == "blue",
    )
    policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "web", "namespace": ns},
        "spec": {"podSelector": {"matchLabels": {"app": "two"}}, "ingress": [{}]},
    }
    kube.apply(policy)
    eventually(
        "the policy mirrored as the API server stores it (policyTypes defaulted)",
        lambda: (
            (tabby_get(kube, "networkpolicy", "web", ns) or {}).get("spec", {}).get("policyTypes")
            == ["Ingress"]
        ),
    )
    # tabbyctl may not change or delete what Kubernetes owns ...
    change = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "p", "namespace": ns, "labels": {"app": "x"}},
    }
    rc, err = tabbyctl_apply(kube, change)
    assert rc == 1
    assert "mirrored from Kubernetes" in err
    proc = kube.tabbyctl("delete", "networkpolicy", "web", "-n", ns)
    assert proc.returncode == 1
    assert "change it with kubectl" in proc.stderr
    # ... and the controllers never change what an operator made with tabbyctl
    own = {**policy, "metadata": {"name": "own", "namespace": ns}, "spec": {"podSelector": {}}}
    assert tabbyctl_apply(kube, own)[0] == 0
    kube.apply({**own, "spec": {"podSelector": {"matchLabels": {"from": "kubectl"}}}})
    time.sleep(2)
    kept = tabby_get(kube, "networkpolicy", "own", ns)
    assert kept["spec"]["podSelector"] == {}
    assert "annotations" not in kept["metadata"]
    kube.kubectl("delete", "networkpolicy", "-n", ns, "web", "own")
    eventually("the policy gone", lambda: tabby_get(kube, "networkpolicy", "web", ns) is None)
    assert tabby_get(kube, "networkpolicy", "own", ns) is not None  # still the operator's
    assert kube.tabbyctl("delete", "networkpolicy", "own", "-n", ns).returncode == 0
    kube.kubectl("delete", "pod", "-n", ns, "p", "--grace-period=1")
    eventually("the pod's mirror gone", lambda: tabby_get(kube, "pod", "p", ns) is None, 60)


# == no window ====================================================================================


@ETCD
def test_a_new_pod_is_never_reachable_against_an_isolating_policy(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    """The policy exists first; the leader is frozen while the pod is created, so the pod's
    ADD comes before its labels are mirrored: tabby-node holds the ADD until they are, and
    the kernel never answers a ping from a pod the policy does not allow (the kernel answers
    as soon as the interface has its address: the earliest possible moment)."""
    kube, ns = kube_lab, scratch
    isolate_secret_pods(kube, ns)
    eventually(
        "the policy on every node",
        lambda: tabby_get(kube, "networkpolicy", "secret", ns) is not None,
    )
    target = "10.244.250.10"
    stranger = Pinger(kube.pod_netns(ns, "stranger"), target).start()
    client = Pinger(kube.pod_netns(ns, "client"), target).start()
    leader = controllers.wait_leader()
    controllers.signal(leader, signal.SIGSTOP)
    try:
        kube.apply(secret_pod(kube, ns, target))
        time.sleep(3)  # the ADD waits for the labels now
    finally:
        controllers.signal(leader, signal.SIGCONT)
    try:
        eventually("the allowed client reaches the new pod", lambda: len(client.replies) > 5, 60)
        time.sleep(1)
    finally:
        stranger.stop()
        client.stop()
    assert stranger.sent > 100
    assert stranger.replies == [], f"reached against the policy {len(stranger.replies)} times"
    log = kube.kube_node("node-1").read("/var/log/tabby/node.log", limit=200_000)
    assert f"pod {ns}/secret: waited" in log, "the ADD did not wait for the labels"


# == failures =====================================================================================


@BOTH
def test_a_standby_takes_over_a_killed_leader(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    kube, ns = kube_lab, scratch
    leader = controllers.wait_leader()
    standby = next(i for i in controllers.replicas if i != leader)
    killed = time.monotonic()
    controllers.signal(leader, signal.SIGKILL)
    eventually("the standby leads", lambda: controllers.leader() == standby, 30)
    took = time.monotonic() - killed
    assert took <= 20.0, f"the standby took {took:.1f} s"
    if kube.datastore == "kubernetes":
        return  # nothing mirrored there: the collector's work is the deleted-node test's
    kube.kubectl("label", "namespace", ns, "after=takeover")
    eventually(
        "a change mirrored by the new leader",
        lambda: labels(kube, "namespace", ns).get("after") == "takeover",
    )


@ETCD
def test_changes_made_while_the_controllers_are_down_converge(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    kube, ns = kube_lab, scratch
    kube.apply(kube.sleeper_pod("old", ns, {"v": "1"}))
    kube.wait_pods(ns, "", 1)
    eventually("mirrored", lambda: tabby_get(kube, "pod", "old", ns) is not None)
    for identity in list(controllers.replicas):
        controllers.stop(identity)  # clean stop: the Lease and the liveness document go
    started = time.monotonic()
    kube.apply(
        kube.sleeper_pod("new", ns, {"v": "2"})
    )  # no controllers: starts at once, unlabelled
    kube.wait_pods(ns, "", 2, timeout=60)
    assert time.monotonic() - started < 30
    kube.kubectl("label", "namespace", ns, "while=down")
    kube.kubectl("delete", "pod", "-n", ns, "old", "--grace-period=1", "--wait=true", timeout=120)
    assert tabby_get(kube, "pod", "old", ns) is not None  # nobody mirrored the deletion
    for identity, node in (("replica-1", "node-1"), ("replica-2", "node-2")):
        controllers.start(identity, node)
    eventually(
        "the deleted pod's mirror gone", lambda: tabby_get(kube, "pod", "old", ns) is None, 30
    )
    eventually("the new pod mirrored", lambda: tabby_get(kube, "pod", "new", ns) is not None)
    eventually(
        "the namespace label mirrored",
        lambda: labels(kube, "namespace", ns).get("while") == "down",
    )
    (wep,) = tabby_get(kube, "workloadendpoints", namespace=ns)["items"]
    assert wep["metadata"]["labels"] == {"v": "2"}  # the late labels reached the endpoint


@ETCD
def test_an_api_server_restart_with_a_compacted_history_loses_nothing(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    """Both replicas frozen; the API server restarted (every watch breaks); meanwhile a pod
    is deleted and a label changed, and etcd's history compacted: the watches come back
    with a resourceVersion that is gone (410), list again, and find the deletion."""
    kube, ns = kube_lab, scratch
    kube.apply(kube.sleeper_pod("gone", ns, {}))
    kube.wait_pods(ns, "", 1)
    eventually("mirrored", lambda: tabby_get(kube, "pod", "gone", ns) is not None)
    before = {i: controllers.metrics(i) for i in controllers.replicas}
    relists_before = sum(
        v
        for m in before.values()
        for k, v in m.items()
        if k.startswith("tabby_controllers_relists_total")
    )
    for identity in controllers.replicas:
        controllers.signal(identity, signal.SIGSTOP)
    try:
        kube.restart_apiserver()
        kube.kubectl(
            "delete", "pod", "-n", ns, "gone", "--grace-period=0", "--force", "--wait=false"
        )
        kube.kubectl("label", "namespace", ns, "seen=after-410")
        kube.compact_etcd()
    finally:
        for identity in controllers.replicas:
            controllers.signal(identity, signal.SIGCONT)
    eventually(
        "the deletion of the gap found", lambda: tabby_get(kube, "pod", "gone", ns) is None, 60
    )
    eventually(
        "the label of the gap mirrored",
        lambda: labels(kube, "namespace", ns).get("seen") == "after-410",
        30,
    )
    assert relists(controllers) > relists_before, "no watch saw a 410 (nothing listed again)"


@BOTH
def test_a_leak_is_released_never_a_live_pod_s_address(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    """node-2's kubelet stops; its pod is force-deleted from the API: its sandbox stays and
    nobody calls DEL, so its address leaks. After --leak-grace it is released; the address
    of a live pod on the same node never is."""
    kube, ns = kube_lab, scratch
    kube.apply(kube.sleeper_pod("live", ns, {}, nodeName="node-2"))
    kube.apply(kube.sleeper_pod("leaky", ns, {}, nodeName="node-2"))
    kube.wait_pods(ns, "", 2)

    def held(name: str) -> bool:
        report = json.loads(kube.tabbyctl("ipam", "show", "-o", "json").stdout)
        return any(a["pod"] == f"{ns}/{name}" for a in report["allocations"])

    kube.stop_kubelet("node-2")
    try:
        deleted = time.monotonic()  # the grace starts after this (when the mirror sees it)
        kube.kubectl("delete", "pod", "-n", ns, "leaky", "--grace-period=0", "--force")
        assert held("leaky")
        eventually("the leaked address released", lambda: not held("leaky"), 60)
        # from the delete, not from the first check: a tabbyctl call takes seconds when the
        # machine is loaded, and the grace was running meanwhile (seen: 3.0 s "early")
        released = time.monotonic() - deleted
        assert released >= controllers.leak_grace - 1, f"released {released:.1f} s after"
        assert held("live")
        counts = [
            controllers.metrics(i).get('tabby_controllers_releases_total{reason="leak"}', 0)
            for i in controllers.replicas
        ]
        assert max(counts) >= 1
    finally:
        kube.start_kubelet("node-2")
    kube.wait_for("node-2 Ready again", lambda: kube._nodes_ready(), 120)
    assert held("live")


@BOTH
def test_a_deleted_node_is_withdrawn_everywhere_and_its_blocks_released(
    kube_lab: KubeLab, controllers: Controllers, scratch: str
) -> None:
    """node-3 (a pod of its own running: it holds a block) goes away (kubelet and
    tabby-node stopped) and is deleted from Kubernetes: its tabby Node goes (the other nodes
    withdraw its routes), and after --node-grace its blocks and addresses are released. Then
    node-3 comes back and registers again."""
    kube = kube_lab
    gone = kube.node("node-3")
    kube.apply(kube.sleeper_pod("on-3", scratch, {}, nodeName=gone.name))
    kube.wait_pods(scratch, "", 1)
    report = json.loads(kube.tabbyctl("ipam", "show", "--show-blocks", "-o", "json").stdout)
    blocks = [b["cidr"] for b in report.get("blocks", []) if b.get("node") == "node-3"]
    assert blocks, "node-3 holds no block"
    kube.stop_kubelet(gone.name)
    kube.stop_agent(gone)
    try:
        kube.kubectl("delete", "node", gone.name)
        eventually("the tabby Node gone", lambda: tabby_get(kube, "node", gone.name) is None, 30)

        def withdrawn() -> bool:
            routes = kube.routes(kube.nodes[0])
            return not any(b in routes for b in blocks)

        eventually("node-3's block routes withdrawn on node-1", withdrawn, 60)

        def released() -> bool:
            now = json.loads(kube.tabbyctl("ipam", "show", "--show-blocks", "-o", "json").stdout)
            return not any(b.get("node") == gone.name for b in now.get("blocks", []))

        eventually("node-3's blocks released", released, 90)
    finally:
        kube.start_agent(gone)
        kube.wait_agent(gone)
        kube.start_kubelet(gone.name)
    kube.wait_for("every node Ready again", lambda: kube._nodes_ready(), 120)
    eventually(
        "node-3 registered again", lambda: tabby_get(kube, "node", gone.name) is not None, 60
    )
