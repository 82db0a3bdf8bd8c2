"""What each node receives of each document (docs/typha.md "Per-node views")."""

from __future__ import annotations

from datastore.base import Doc
from fanout import views
from ipam.core.block import Block
from resources.index import BLOCKS, PODS, Index
from resources.remote import RemotePod
from tests.unit.fanout.docs import block, pod


def test_owner_of_each_kind() -> None:
    assert views.owner("pod", pod("a", "n1")) == "n1"
    assert views.owner("workloadendpoint", {"spec": {"node": "n2"}}) == "n2"
    assert views.owner("block", block("10.244.0.0/26", "n3")) == "n3"
    assert views.owner("block", block("10.244.0.0/26", None)) is None
    assert views.owner("node", {"metadata": {"name": "n1"}}) is None
    assert views.owner("pod", None) is None


def test_a_pods_projection_is_what_policy_reads() -> None:
    projected = views.projection("pod", pod("a", "n1", {"app": "db"}))
    assert projected == {
        "metadata": {"name": "a", "namespace": "default", "labels": {"app": "db"}},
        "spec": {
            "nodeName": "n1",
            "containers": [{"name": "c", "ports": [{"name": "http", "containerPort": 80}]}],
        },
    }
    # a status-only change: the same projection
    assert views.projection("pod", pod("a", "n1", {"app": "db"}, ip="10.244.0.9")) == projected
    # and it parses as the node's cache parses another node's pod
    index = Index((PODS,), keep_raw={"pod": lambda d: (d, False)}, compact={"pod": RemotePod.of})
    index.put("pod", "default/a", Doc(projected, 3))
    remote = index.get(PODS, "default/a")
    assert isinstance(remote, RemotePod)
    assert remote.labels == (("app", "db"),)


def test_a_pods_service_account_reaches_other_nodes_policy() -> None:
    """``spec.serviceAccountName`` is what Calico's ``serviceAccounts`` rules and
    ``serviceAccountSelector`` read: kept in another node's projection, read into the
    node's record and into the policy engine's pod."""
    from policy import inputs

    data = pod("a", "n1")
    data["spec"]["serviceAccountName"] = "web-sa"
    projected = views.projection("pod", data)
    assert projected["spec"]["serviceAccountName"] == "web-sa"
    index = Index((PODS,), keep_raw={"pod": lambda d: (d, False)}, compact={"pod": RemotePod.of})
    index.put("pod", "default/a", Doc(projected, 3))
    remote = index.get(PODS, "default/a")
    assert isinstance(remote, RemotePod)
    assert inputs.pod(remote).service_account == "web-sa"
    # another account is another record (a node sees the change)
    other = dict(projected, spec={**projected["spec"], "serviceAccountName": "db-sa"})
    index.put("pod", "default/a", Doc(other, 4))
    changed = index.get(PODS, "default/a")
    assert changed is not None
    assert changed != remote


def test_a_blocks_projection_keeps_the_borrowed_addresses_alone() -> None:
    data = block("10.244.1.0/29", "n1", {0: "n1", 1: "n1", 5: "n2"})
    projected = views.projection("block", data)
    assert projected["affinity"] == "host:n1"
    assert [a and a["attrs"] for a in projected["allocations"]] == [
        None,
        None,
        None,
        None,
        None,
        {"node": "n2"},
        None,
        None,
    ]
    Block.from_data(projected, "test")  # a valid block (the node's cache parses it)
    index = Index((BLOCKS,))
    index.put("block", "10.244.1.0/29", Doc(projected, 9))
    assert index.get(BLOCKS, "10.244.1.0/29") is not None


def test_a_pod_added_in_its_own_nodes_block_changes_no_other_nodes_projection() -> None:
    before = views.projection("block", block("10.244.1.0/29", "n1", {0: "n1"}))
    after = views.projection("block", block("10.244.1.0/29", "n1", {0: "n1", 1: "n1"}))
    assert before == after
    borrowed = views.projection("block", block("10.244.1.0/29", "n1", {0: "n1", 1: "n2"}))
    assert borrowed != after


def test_cluster_wide_kinds_go_whole() -> None:
    node = {"metadata": {"name": "n1"}, "spec": {"bgp": {"ipv4Address": "192.0.2.1/24"}}}
    assert views.projection("node", node) is node
