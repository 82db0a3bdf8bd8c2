"""ResourceClient over the memory and file stores: round trips, every document checked
before any is written, then each one compare-and-swap, resourceVersion, merge semantics,
IPPools as IPAM pool documents, WorkloadEndpoint labels, and store -> store migration.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path
from typing import Any, cast

import pytest

from datastore.base import Store
from datastore.file import FileStore
from datastore.memory import MemoryStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
from ipam.core.errors import RevisionConflict
from resources import wep
from resources.client import ResourceClient, document_label, merge
from resources.errors import Conflict, InvalidDocument, NotFound, UnknownKind
from resources.migrate import MIGRATED_KINDS, TargetNotEmpty, copy_store
from resources.tabby import IPPool, WorkloadEndpoint
from tests.unit.store_makers import EVERY_KIND, make_store

from .test_calico import CALICO_VALID
from .test_models import VALID


class Recording:
    """A store that records its writes (kind, key) and can play another writer before one
    of them."""

    def __init__(self, inner: Store) -> None:
        self.inner = inner
        self.writes: list[tuple[str, str]] = []
        self.before_write: list[Any] = []  # callables run (once each) before a write

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _write(self, kind: str, key: str) -> None:
        if self.before_write:
            self.before_write.pop(0)(self.inner)
        self.writes.append((kind, key))

    def put(self, kind: str, key: str, data: dict[str, Any], rev: int | None) -> int:
        self._write(kind, key)
        return self.inner.put(kind, key, data, rev)

    def delete(self, kind: str, key: str, rev: int) -> None:
        self._write(kind, key)
        self.inner.delete(kind, key, rev)


@pytest.fixture
def store(every_store: Store) -> Recording:
    return Recording(every_store)


@pytest.fixture
def client(store: Recording) -> ResourceClient:
    uids = (f"uid-{i}" for i in itertools.count(1))
    return ResourceClient(
        cast(Store, store), clock=lambda: 1_700_000_000.0, new_uid=lambda: next(uids)
    )


def everything(store: Recording) -> dict[tuple[str, str], Any]:
    from datastore.base import KINDS

    return {(k, key): d.data for k in KINDS for key, d in store.inner.list(k)}


def name_ns(kind: str) -> tuple[str, str | None]:
    meta = VALID[kind]["metadata"]
    return meta["name"], meta.get("namespace")


# -- round trip ----------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", sorted(VALID))
def test_apply_get_list_delete_every_kind(
    client: ResourceClient, store: Recording, kind: str
) -> None:
    [applied] = client.apply([VALID[kind]])
    assert (applied.label, applied.action) == (
        f"{kind}/{VALID[kind]['metadata']['name']}",
        "created",
    )
    name, ns = name_ns(kind)
    got = client.get(kind, name, ns)
    assert got.metadata.uid == "uid-1"
    assert got.metadata.creationTimestamp == "2023-11-14T22:13:20Z"
    rev = got.metadata.resourceVersion
    assert rev is not None
    assert int(rev) > 0
    wire = got.wire()
    for field in ("resourceVersion", "uid", "creationTimestamp"):
        del wire["metadata"][field]
    expected = applied.resource.wire()
    for field in ("uid", "creationTimestamp"):
        del expected["metadata"][field]
    assert wire == expected
    assert [r.name for r in client.list(kind)] == [name]
    assert [r.name for r in client.list(kind, ns)] == [name]
    if ns is not None:
        assert client.list(kind, "elsewhere") == []
    # the resource as shown re-applies unchanged: nothing written
    writes = len(store.writes)
    [again] = client.apply([got.wire()])
    assert again.action == "unchanged"
    assert len(store.writes) == writes
    deleted = client.delete(kind, name, ns)
    assert deleted.label == f"{kind}/{name}"
    with pytest.raises(NotFound):
        client.get(kind, name, ns)
    assert everything(store) == {}


def test_apply_writes_each_document_once(client: ResourceClient, store: Recording) -> None:
    docs = [VALID[k] for k in ("IPPool", "Namespace", "Pod", "NetworkPolicy", "Node")]
    results = client.apply(docs)
    assert [r.action for r in results] == ["created"] * 5
    assert [kind for kind, _ in store.writes] == [
        "pool",
        "namespace",
        "pod",
        "networkpolicy",
        "node",
    ]


@pytest.mark.parametrize("bad_index", [0, 1])
def test_one_bad_document_writes_nothing(
    client: ResourceClient, store: Recording, bad_index: int
) -> None:
    docs = [copy.deepcopy(VALID["Namespace"]), copy.deepcopy(VALID["NetworkPolicy"])]
    docs[1]["spec"]["ingress"][0]["ports"][0]["port"] = 0
    if bad_index == 0:
        docs.reverse()
    with pytest.raises(InvalidDocument) as info:
        client.apply(docs)
    assert str(info.value) == (
        "NetworkPolicy/allow-web: spec.ingress[0].ports[0].port: Invalid value: 0: "
        "must be between 1 and 65535, inclusive"
    )
    assert info.value.path == "spec.ingress[0].ports[0].port"
    assert store.writes == []
    assert everything(store) == {}


def test_document_labels() -> None:
    assert document_label(1, VALID["NetworkPolicy"]) == "NetworkPolicy/allow-web"
    assert document_label(2, {"kind": "Pod", "metadata": {}}) == "document 2"
    assert document_label(3, {"metadata": {"name": "x"}}) == "document 3"
    assert document_label(4, ["not", "a", "mapping"]) == "document 4"


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("just text", "document 2: not an object"),
        ({"apiVersion": "v1", "metadata": {"name": "x"}}, "document 2: kind: Required value"),
        (
            {"apiVersion": "v1", "kind": "Service", "metadata": {"name": "x"}},
            "Service/x: kind: Unsupported value",
        ),
        (
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": 5}},
            "document 2: metadata.name: Invalid value: 5",
        ),
        ({"apiVersion": "v1", "kind": "Pod"}, "document 2: metadata.name: Required value"),
        (
            {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p", "resourceVersion": 7}},
            "Pod/p: metadata.resourceVersion: Invalid value: 7",
        ),
    ],
)
def test_malformed_documents(
    client: ResourceClient, store: Recording, doc: Any, message: str
) -> None:
    with pytest.raises(InvalidDocument) as info:
        client.apply([VALID["Namespace"], doc])
    assert str(info.value).startswith(message), str(info.value)
    assert everything(store) == {}


def test_unknown_kind_name(client: ResourceClient) -> None:
    with pytest.raises(UnknownKind, match="services"):
        client.list("services")


# -- resourceVersion -----------------------------------------------------------------------------


def test_resource_version_must_match(client: ResourceClient, store: Recording) -> None:
    client.apply([VALID["Pod"]])
    pod = client.get("pod", "web-0", "shop")
    rv = pod.metadata.resourceVersion
    assert rv is not None
    stale = pod.wire()
    stale["metadata"]["labels"] = {"app": "v2"}
    client.apply([stale])  # matches: applied
    after = client.get("pod", "web-0", "shop")
    assert after.labels == {"app": "v2"}
    assert after.metadata.resourceVersion != rv
    before = everything(store)
    stale["metadata"]["labels"] = {"app": "v3"}
    with pytest.raises(Conflict, match="has been modified"):
        client.apply([VALID["Namespace"], stale])  # rv is now stale: nothing written
    assert everything(store) == before
    # none: last writer wins
    client.apply(
        [
            {
                **VALID["Pod"],
                "metadata": {"name": "web-0", "namespace": "shop", "labels": {"app": "v4"}},
            }
        ]
    )
    assert client.get("pod", "web-0", "shop").labels == {"app": "v4"}


def test_resource_version_on_create_is_a_conflict(client: ResourceClient, store: Recording) -> None:
    doc = copy.deepcopy(VALID["Namespace"])
    doc["metadata"]["resourceVersion"] = "12"
    with pytest.raises(Conflict, match="no such Namespace"):
        client.apply([doc])
    assert everything(store) == {}


def test_resource_version_on_delete(client: ResourceClient) -> None:
    client.apply([VALID["Namespace"]])
    with pytest.raises(Conflict):
        client.delete("ns", "shop", resource_version="999999999")
    rv = client.get("ns", "shop").metadata.resourceVersion
    client.delete("ns", "shop", resource_version=rv)


def test_a_concurrent_writer_makes_apply_retry_and_merge(
    client: ResourceClient, store: Recording
) -> None:
    client.apply([VALID["Pod"]])
    key = "shop/web-0"

    def other_writer(inner: Store) -> None:
        doc = inner.get("pod", key)
        assert doc is not None
        data = copy.deepcopy(doc.data)
        data["metadata"]["annotations"] = {"by": "other"}
        inner.put("pod", key, data, doc.revision)

    store.before_write.append(other_writer)
    client.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "web-0", "namespace": "shop", "labels": {"tier": "fe"}},
            }
        ]
    )
    pod = client.get("pod", "web-0", "shop")
    assert pod.labels == {"app": "web", "tier": "fe"}
    assert pod.metadata.annotations == {"by": "other"}
    assert len(store.writes) == 3  # create, the lost race, the retry


# -- merge ---------------------------------------------------------------------------------------


def test_merge_function() -> None:
    base = {"a": {"x": 1, "y": [1, 2]}, "b": 1, "c": 2}
    patch = {"a": {"y": [3], "z": {"k": 1}}, "b": None, "d": [{"e": None}]}
    assert merge(base, patch) == {
        "a": {"x": 1, "y": [3], "z": {"k": 1}},
        "c": 2,
        "d": [{"e": None}],
    }
    assert base == {"a": {"x": 1, "y": [1, 2]}, "b": 1, "c": 2}


def test_apply_merges_the_fields_a_document_sets(client: ResourceClient) -> None:
    client.apply([VALID["Node"]])
    created = client.get("node", "node-a")
    # tabby-node re-registers with its own fields: the operator's labels and bgp stay
    client.apply(
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "Node",
                "metadata": {"name": "node-a"},
                "spec": {"ipv4Address": "192.168.1.9/24"},
            }
        ]
    )
    node = client.get("node", "node-a")
    assert node.labels == {"rack": "a"}
    assert node.wire()["spec"]["bgp"] == {"asNumber": 64600, "routeReflectorClusterID": "224.0.0.1"}
    assert node.wire()["spec"]["ipv4Address"] == "192.168.1.9/24"
    assert node.metadata.uid == created.metadata.uid
    assert node.metadata.creationTimestamp == created.metadata.creationTimestamp
    # labels merge key by key; null removes one; a nested map merges too
    client.apply(
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "Node",
                "metadata": {"name": "node-a", "labels": {"zone": "z1", "rack": None}},
                "spec": {"bgp": {"routeReflectorClusterID": None}},
            }
        ]
    )
    node = client.get("node", "node-a")
    assert node.labels == {"zone": "z1"}
    assert node.wire()["spec"]["bgp"] == {"asNumber": 64600}


def test_lists_replace_and_defaults_stay_defaults(client: ResourceClient, store: Recording) -> None:
    client.apply([VALID["NetworkPolicy"]])
    # the stored document is what was applied (policyTypes not frozen to its default) ...
    stored = store.inner.get("networkpolicy", "shop/allow-web")
    assert stored is not None
    assert "policyTypes" not in stored.data["spec"]
    assert client.get("netpol", "allow-web", "shop").wire()["spec"]["policyTypes"] == [
        "Ingress",
        "Egress",
    ]
    # ... so dropping the egress rules later gives [Ingress] again, as a fresh policy would
    client.apply(
        [
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "allow-web", "namespace": "shop"},
                "spec": {"egress": None, "ingress": [{}]},
            }
        ]
    )
    got = client.get("netpol", "allow-web", "shop").wire()["spec"]
    assert got["policyTypes"] == ["Ingress"]
    assert got["ingress"] == [{}]
    assert got["podSelector"] == {"matchLabels": {"app": "web"}}


def test_a_merge_that_breaks_a_rule_is_refused(client: ResourceClient) -> None:
    client.apply([VALID["BGPPeer"]])
    with pytest.raises(InvalidDocument, match=r"BGPPeer/tor: spec\.peerIP: Forbidden"):
        client.apply(
            [
                {
                    "apiVersion": "tabby.io/v1",
                    "kind": "BGPPeer",
                    "metadata": {"name": "tor"},
                    "spec": {"peerSelector": "rr == 'true'", "asNumber": None},
                }
            ]
        )
    peer = client.get("bgppeer", "tor").wire()
    assert peer["spec"]["peerIP"] == "192.0.2.1"


def test_two_documents_for_one_resource_apply_in_order(
    client: ResourceClient, store: Recording
) -> None:
    first = copy.deepcopy(VALID["Namespace"])
    second = {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"env": "prod"}},
    }
    results = client.apply([first, second])
    assert [r.action for r in results] == ["created", "configured"]
    assert len(store.writes) == 2
    assert client.get("ns", "shop").labels == {
        "team": "a",
        "env": "prod",
        "kubernetes.io/metadata.name": "shop",
    }


# -- IPPool as the IPAM pool document ------------------------------------------------------------


def test_ippool_is_the_pool_document_the_allocator_reads(
    client: ResourceClient, store: Recording
) -> None:
    client.apply([VALID["IPPool"]])
    doc = store.inner.get("pool", "10.50.0.0/16")
    assert doc is not None
    assert {k: doc.data[k] for k in ("cidr", "block_size", "disabled", "name", "vxlan_mode")} == {
        "cidr": "10.50.0.0/16",
        "block_size": 26,
        "disabled": False,
        "name": "pool-a",
        "vxlan_mode": "Always",
    }
    ipam = Ipam(store.inner, "node-a")
    [alloc] = ipam.assign(AssignRequest(handle_id("net", "c1", "eth0"), v4_pools=["10.50.0.0/16"]))
    assert str(alloc.pool_cidr) == "10.50.0.0/16"
    client.apply(
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "IPPool",
                "metadata": {"name": "pool-a"},
                "spec": {"disabled": True},
            }
        ]
    )
    assert [p.disabled for p in ipam.list_pools()] == [True]
    ipam.set_pool_disabled("10.50.0.0/16", False)  # the core keeps the resource's fields
    pool = client.get("ippool", "pool-a")
    assert isinstance(pool, IPPool)
    assert (pool.spec.disabled, pool.spec.vxlanMode, pool.metadata.uid) == (
        False,
        "Always",
        "uid-1",
    )


def test_a_pool_the_plugin_created_is_shown_under_a_derived_name(
    client: ResourceClient, store: Recording
) -> None:
    Ipam(store.inner, "node-a").ensure_pools([PoolSpec("10.244.0.0/16")])
    [pool] = client.list("ippools")
    assert isinstance(pool, IPPool)
    assert pool.name == "ippool-10-244-0-0-16"
    assert (pool.spec.cidr, pool.spec.blockSize, pool.spec.ipipMode) == ("10.244.0.0/16", 26, None)
    client.apply(
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "IPPool",
                "metadata": {"name": "ippool-10-244-0-0-16"},
                "spec": {"natOutgoing": True},
            }
        ]
    )
    stored = store.inner.get("pool", "10.244.0.0/16")
    assert stored is not None
    assert stored.data["nat_outgoing"] is True
    assert stored.data["block_size"] == 26


def test_ippool_rules(client: ResourceClient, store: Recording) -> None:
    client.apply([VALID["IPPool"]])
    before = everything(store)
    cases: list[tuple[dict[str, Any], str]] = [
        (
            {"metadata": {"name": "pool-b"}, "spec": {"cidr": "10.50.128.0/17"}},
            'spec.cidr: Invalid value: "10.50.128.0/17": overlaps IPPool pool-a',
        ),
        (
            {"metadata": {"name": "pool-b"}, "spec": {"cidr": "10.50.0.0/16"}},
            "overlaps IPPool pool-a",
        ),
        (
            {"metadata": {"name": "pool-b"}, "spec": {"cidr": "10.0.0.0/8"}},
            "overlaps IPPool pool-a",
        ),
        (
            {"metadata": {"name": "pool-a"}, "spec": {"cidr": "10.51.0.0/16"}},
            "spec.cidr: Forbidden: may not be changed",
        ),
        (
            {"metadata": {"name": "pool-a"}, "spec": {"blockSize": 28}},
            "spec.blockSize: Forbidden: may not be changed",
        ),
    ]
    for body, message in cases:
        with pytest.raises(InvalidDocument) as info:
            client.apply([{"apiVersion": "tabby.io/v1", "kind": "IPPool", **body}])
        assert message in str(info.value)
    assert everything(store) == before
    # two new pools in one apply that overlap each other
    with pytest.raises(InvalidDocument, match="overlaps IPPool p1"):
        client.apply(
            [
                {
                    "apiVersion": "tabby.io/v1",
                    "kind": "IPPool",
                    "metadata": {"name": "p1"},
                    "spec": {"cidr": "10.60.0.0/16"},
                },
                {
                    "apiVersion": "tabby.io/v1",
                    "kind": "IPPool",
                    "metadata": {"name": "p2"},
                    "spec": {"cidr": "10.60.0.0/20"},
                },
            ]
        )
    assert everything(store) == before


def test_deleting_a_pool_in_use_is_refused(client: ResourceClient, store: Recording) -> None:
    client.apply([VALID["IPPool"], VALID["Namespace"]])
    ipam = Ipam(store.inner, "node-a")
    hid = handle_id("net", "c1", "eth0")
    ipam.assign(AssignRequest(hid, v4_pools=["10.50.0.0/16"]))
    with pytest.raises(Conflict, match="in use"):
        client.delete_documents([VALID["Namespace"], VALID["IPPool"]])
    assert client.get("ns", "shop").name == "shop"  # nothing deleted
    ipam.release_handle(hid)
    deleted = client.delete_documents([VALID["Namespace"], VALID["IPPool"]])
    assert [d.label for d in deleted] == ["Namespace/shop", "IPPool/pool-a"]
    assert store.inner.list("pool") == []
    assert store.inner.list("block") == []


# -- delete --------------------------------------------------------------------------------------


def test_delete_documents_checks_all_before_deleting_any(
    client: ResourceClient, store: Recording
) -> None:
    client.apply([VALID["Namespace"], VALID["Pod"]])
    before = everything(store)
    store.writes.clear()
    with pytest.raises(NotFound, match="NetworkPolicy 'allow-web' not found in namespace shop"):
        client.delete_documents([VALID["Namespace"], VALID["NetworkPolicy"], VALID["Pod"]])
    assert everything(store) == before
    assert store.writes == []
    deleted = client.delete_documents(
        [VALID["Namespace"], VALID["NetworkPolicy"], VALID["Pod"]], ignore_not_found=True
    )
    assert [d.label for d in deleted] == ["Namespace/shop", "Pod/web-0"]
    assert store.writes == [("namespace", "shop"), ("pod", "shop/web-0")]
    assert everything(store) == {}


def test_delete_missing(client: ResourceClient) -> None:
    with pytest.raises(NotFound, match="Node 'node-x' not found"):
        client.delete("node", "node-x")
    with pytest.raises(NotFound, match="in namespace default"):
        client.delete("pod", "p")


# -- WorkloadEndpoint labels ---------------------------------------------------------------------


def add(store: Store, pod: str = "web-0", cid: str = "c1", ifname: str = "eth0") -> str:
    return wep.write_endpoint(
        store,
        namespace="shop",
        node="node-a",
        pod=pod,
        container_id=cid,
        interface=ifname,
        host_interface="cali0123456789a",
        ip_networks=["10.50.0.7/32"],
        clock=lambda: 1_700_000_000.0,
    )


def stored_labels(store: Recording, key: str) -> Any:
    doc = store.inner.get(wep.KIND, key)
    assert doc is not None
    return doc.data["metadata"]["labels"]


def test_endpoint_takes_the_labels_of_a_pod_applied_before(
    client: ResourceClient, store: Recording
) -> None:
    client.apply([VALID["Pod"]])
    key = add(cast(Store, store))
    assert key == "shop/node--a-k8s-web--0-eth0"
    assert stored_labels(store, key) == {"app": "web"}
    [endpoint] = client.list("wep")
    assert isinstance(endpoint, WorkloadEndpoint)
    assert endpoint.labels == {"app": "web"}
    assert endpoint.namespace == "shop"
    assert (endpoint.spec.node, endpoint.spec.pod, endpoint.spec.interface) == (
        "node-a",
        "web-0",
        "eth0",
    )


def test_endpoint_takes_the_labels_of_a_pod_applied_after(
    client: ResourceClient, store: Recording
) -> None:
    """An endpoint's labels are its Pod's whenever the Pod exists, as every reader sees
    them: a Pod's write changes nothing else (one write), and the labels it stored at ADD
    count only while no Pod of that name exists."""
    key = add(cast(Store, store))
    other = add(cast(Store, store), pod="db-0", cid="c2")
    assert stored_labels(store, key) == {}
    store.writes.clear()
    client.apply([VALID["Pod"]])
    assert store.writes == [("pod", "shop/web-0")]
    name = key.split("/")[1]
    assert client.get("wep", name, "shop").labels == {"app": "web"}
    assert client.get("wep", other.split("/")[1], "shop").labels == {}
    client.apply(
        [
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": "web-0",
                    "namespace": "shop",
                    "labels": {"app": None, "v": "2"},
                },
            }
        ]
    )
    assert client.get("wep", name, "shop").labels == {"v": "2"}
    assert [w.labels for w in client.list("wep", "shop") if w.name == name] == [{"v": "2"}]
    client.delete("pod", "web-0", "shop")
    assert client.get("wep", name, "shop").labels == {}  # what it stored at its ADD: none


def test_an_added_endpoint_stores_its_pods_labels_of_the_moment(store: Recording) -> None:
    store.inner.put(
        "pod", "shop/web-0", {"metadata": {"name": "web-0", "labels": {"app": "web"}}}, None
    )
    key = add(cast(Store, store))
    assert stored_labels(store, key) == {"app": "web"}
    store.writes.clear()
    add(cast(Store, store))  # the same ADD again: nothing to change
    assert store.writes == []


def test_effective_labels_win_over_stale_stored_ones(
    client: ResourceClient, store: Recording
) -> None:
    key = add(cast(Store, store))
    # a Pod committed by something that did not relabel (a race, an older tabby)
    store.inner.put(
        "pod",
        "shop/web-0",
        {"metadata": {"name": "web-0", "namespace": "shop", "labels": {"x": "y"}}},
        None,
    )
    assert stored_labels(store, key) == {}
    assert client.get("wep", key.split("/")[1], "shop").labels == {"x": "y"}
    assert wep.effective_labels({"metadata": {"labels": {"a": "b"}}}, None) == {"a": "b"}
    assert wep.effective_labels({"metadata": {"labels": {"a": "b"}}}, {"metadata": {}}) == {}


def test_remove_endpoint_only_for_its_container(store: Recording) -> None:
    key = add(cast(Store, store), cid="old")
    add(cast(Store, store), cid="new")  # a new sandbox of the same pod
    assert wep.remove_endpoint(cast(Store, store), key, "old") is False
    assert store.inner.get(wep.KIND, key) is not None
    assert wep.remove_endpoint(cast(Store, store), key, "new") is True
    assert wep.remove_endpoint(cast(Store, store), key, "new") is False


def test_endpoint_names() -> None:
    assert wep.endpoint_name("node-a", "web-0", "eth0") == "node--a-k8s-web--0-eth0"
    assert wep.endpoint_name("n", "a-k8s", "x") != wep.endpoint_name("n-k8s-a", "", "x")
    odd = wep.endpoint_name("node-a", "web-0", "Eth_0")
    assert odd.startswith("wep-")
    assert odd == wep.endpoint_name("node-a", "web-0", "Eth_0")


# -- migration -----------------------------------------------------------------------------------


def populate(store: Store) -> dict[tuple[str, str], Any]:
    ResourceClient(store).apply([VALID[k] for k in VALID if k != "WorkloadEndpoint"])
    ResourceClient(store).apply(list(CALICO_VALID.values()))
    ipam = Ipam(store, "node-a")
    ipam.ensure_pools([PoolSpec("10.244.0.0/16")])
    ipam.assign(AssignRequest(handle_id("net", "c1", "eth0"), v4_pools=["10.244.0.0/16"]))
    add(store)
    legacy = {"id": "net:c0:eth0", "node": "node-a", "blocks": []}  # an older tabby's handle
    store.put("handle", "net:c0:eth0", legacy, None)
    store.put_leased("heartbeat", "node-a", {"t": 1}, None, ttl=60)  # type: ignore[attr-defined]
    return {(k, key): d.data for k in MIGRATED_KINDS for key, d in store.list(k)}


@pytest.mark.parametrize("target_kind", EVERY_KIND)
def test_copy_store(request: pytest.FixtureRequest, tmp_path: Path, target_kind: str) -> None:
    source = FileStore(str(tmp_path / "source"), lock_timeout=5)
    want = populate(source)
    assert {k for k, _ in want} == set(MIGRATED_KINDS)  # every kind has a document
    etcd = request.getfixturevalue("etcd1") if target_kind == "etcd" else None
    target = make_store(target_kind, tmp_path / "target", etcd=etcd)
    try:
        counts = copy_store(source, target)
        assert sum(counts.values()) == len(want)
        assert {(k, key): d.data for k in MIGRATED_KINDS for key, d in target.list(k)} == want
        assert target.list("heartbeat") == []
        # the copy works: the allocator and the resource client read it
        names = [p.name for p in ResourceClient(target).list("ippools")]
        assert names == ["ippool-10-244-0-0-16", "pool-a"]
        [owner] = Ipam(target, "node-a").allocations()
        assert owner.handle_id == handle_id("net", "c1", "eth0")
        with pytest.raises(TargetNotEmpty, match="already holds tabby data"):
            copy_store(source, target)
    finally:
        target.close()


def test_copy_store_refuses_any_data_and_undoes_a_failed_copy(tmp_path: Path) -> None:
    source = FileStore(str(tmp_path / "source"), lock_timeout=5)
    populate(source)
    target = MemoryStore()
    target.put("heartbeat", "x", {}, None)
    with pytest.raises(TargetNotEmpty, match="1 heartbeat"):
        copy_store(source, target)
    target = MemoryStore()
    failing = Recording(target)
    calls = itertools.count()

    def fail_third(inner: Store) -> None:
        if next(calls) == 2:
            raise RevisionConflict("injected", "x")

    failing.before_write.extend([fail_third] * 3)
    with pytest.raises(RevisionConflict, match="injected"):
        copy_store(source, cast(Store, failing))
    assert all(target.list(k) == [] for k in MIGRATED_KINDS)
