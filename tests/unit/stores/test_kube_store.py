"""The Kubernetes datastore (``stores.kube``) against an in-memory API server
(``tests.kube_fake``): the store protocol on the API's per-object compare-and-swap, the
IPAM on it (one write per ADD, none to read when served), and ``sync`` (documents made of
Kubernetes' own objects, endpoints made of the blocks, readiness made of the v1 Nodes, a
410 Gone read again with only the differences)."""

from __future__ import annotations

import ipaddress
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from datastore.base import Doc, SyncEvent
from datastore.cached import Cached, Counts, run
from datastore.errors import InvalidConfig, RevisionConflict, StoreRemoved, StoreUnavailable
from ipam.core import (
    AssignRequest,
    Ipam,
    NoAddressAvailable,
    PoolSpec,
    check_consistency,
    handle_id,
)
from stores.kube import kinds
from stores.kube.client import ApiError, KubeClient, KubeConfig
from stores.kube.store import KubeStore
from stores.kube.sync import KubeSync
from tests.kube_fake import FakeApi, fake_api, namespace, node, pod, policy

POOL = "10.50.0.0/24"


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    with fake_api() as made:
        yield made


def store_of(url: str, tmp_path: Path, timeout: float = 5.0) -> KubeStore:
    client = KubeClient(KubeConfig(server=url), timeout=timeout, agent="tabby-test")
    return KubeStore(client, lock_timeout=timeout, lock_dir=str(tmp_path / "locks"))


@pytest.fixture
def store(api: tuple[FakeApi, str], tmp_path: Path) -> Iterator[KubeStore]:
    made = store_of(api[1], tmp_path)
    yield made
    made.close()


def ready_node(name: str, labels: dict[str, str] | None = None, ready: bool = True) -> Any:
    obj = node(name, labels)
    obj["status"] = {"conditions": [{"type": "Ready", "status": "True" if ready else "False"}]}
    return obj


def attrs(pod_name: str, cid: str, node_name: str = "node-a") -> dict[str, Any]:
    return {
        "node": node_name,
        "network": "net",
        "container_id": cid,
        "ifname": "eth0",
        "pod_namespace": "shop",
        "pod_name": pod_name,
        "host_interface": f"cali{cid}",
        "time": 1700000000.0,
    }


def request(cid: str, **kw: Any) -> AssignRequest:
    return AssignRequest(
        handle_id("net", cid, "eth0"), attrs(f"pod-{cid}", cid), v4_pools=[POOL], **kw
    )


# -- the protocol ---------------------------------------------------------------------------------


def test_create_replace_delete_are_the_apis_compare_and_swap(store: KubeStore) -> None:
    data = {"node": "node-a", "format": 2, "blocks": [], "borrowed": [], "cursor": {}}
    rev = store.put("affinity", "node-a", data, None)
    assert store.get("affinity", "node-a") == Doc(data, rev)
    with pytest.raises(RevisionConflict):
        store.put("affinity", "node-a", data, None)  # exists: a create that loses
    rev2 = store.put("affinity", "node-a", {**data, "blocks": ["x"]}, rev)
    with pytest.raises(RevisionConflict):
        store.put("affinity", "node-a", data, rev)  # stale
    with pytest.raises(RevisionConflict):
        store.delete("affinity", "node-a", rev)  # stale: the precondition fails
    store.delete("affinity", "node-a", rev2)
    assert store.get("affinity", "node-a") is None
    with pytest.raises(RevisionConflict):
        store.put("affinity", "node-a", data, rev2)  # vanished


def test_blocks_and_pools_are_keyed_by_their_cidr(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    fake, _ = api
    Ipam(store, "").ensure_pools([PoolSpec(POOL, 28)])
    assert store.list_keys("pool") == [POOL]
    pools = fake.objects[kinds.CRDS["pool"].path]
    assert list(pools) == ["ippool-10-50-0-0-24"]
    assert pools["ippool-10-50-0-0-24"]["spec"] == {
        "cidr": POOL,
        "blockSize": 28,
        "disabled": False,
    }
    # a pool applied with kubectl under a name of its own is found by its CIDR
    fake.put(
        kinds.CRDS["pool"].path,
        {"metadata": {"name": "blue"}, "spec": {"cidr": "10.60.0.0/24", "blockSize": 26}},
    )
    got = store.get("pool", "10.60.0.0/24")
    assert got is not None
    assert got.data["name"] == "blue"
    assert got.data["block_size"] == 26
    (alloc,) = Ipam(store, "node-a").assign(request("c1"))
    blocks = fake.objects[kinds.CRDS["block"].path]
    name = kinds.block_name(str(alloc.block_cidr))
    assert list(blocks) == [name]
    assert blocks[name]["metadata"]["labels"] == {kinds.NODE_LABEL: "node-a"}
    assert blocks[name]["spec"]["cidr"] == str(alloc.block_cidr)


def test_kubernetes_own_kinds_are_read_never_written(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    fake, _ = api
    fake.put("/api/v1/namespaces", namespace("shop", {"team": "a"}))
    fake.put("/api/v1/pods", pod("shop", "web-0", {"app": "web"}, node="node-a", ips=("10.0.0.5",)))
    got = store.get("pod", "shop/web-0")
    assert got is not None
    assert got.data["metadata"]["labels"] == {"app": "web"}
    assert got.data["spec"]["nodeName"] == "node-a"
    assert [k for k, _ in store.list("namespace")] == ["shop"]
    for kind, key in (("pod", "shop/web-0"), ("namespace", "shop"), ("heartbeat", "node-a")):
        with pytest.raises(InvalidConfig, match="Kubernetes' own"):
            store.put(kind, key, {}, None)


def test_node_is_tabbys_joined_with_the_v1_nodes_labels(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    fake, _ = api
    spec = {"metadata": {"name": "node-a"}, "spec": {"backend": "vxlan"}}
    rev = store.put("node", "node-a", spec, None)
    got = store.get("node", "node-a")
    assert got is not None
    assert "labels" not in got.data["metadata"]  # no v1 Node yet
    fake.put("/api/v1/nodes", ready_node("node-a", {"zone": "a"}))
    got = store.get("node", "node-a")
    assert got is not None
    assert got.data["metadata"]["labels"] == {"zone": "a"}
    assert got.revision > rev
    # a write compares tabby's Node (the labels are not written: they are the v1 Node's)
    again = store.put("node", "node-a", {**got.data, "spec": {"backend": "bird"}}, got.revision)
    with pytest.raises(RevisionConflict):
        store.put("node", "node-a", got.data, got.revision)
    written = fake.objects[kinds.CRDS["node"].path]["node-a"]
    assert written["spec"] == {"backend": "bird"}
    assert "labels" not in written["metadata"]
    assert again > got.revision


def test_the_api_unreachable_is_store_unavailable_within_the_timeout(tmp_path: Path) -> None:
    store = store_of("http://127.0.0.1:9", tmp_path, timeout=1.5)  # nothing listens
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable):
        store.get("block", "10.0.0.0/26")
    assert time.monotonic() - t0 < 3.0


# -- IPAM on the API ------------------------------------------------------------------------------


class Counting:
    """What the store sends the API server, by verb."""

    def __init__(self, fake: FakeApi) -> None:
        self.fake = fake
        self.mark = 0

    def since(self) -> list[str]:
        out = [r for r in self.fake.requests[self.mark :] if "?watch" not in r]
        self.mark = len(self.fake.requests)
        return out


def test_an_add_is_one_write_and_a_served_one_reads_nothing(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    fake, _ = api
    Ipam(store, "").ensure_pools([PoolSpec(POOL, 28)])
    first = Ipam(store, "node-a").assign(request("c1"))[0]  # claims the block
    count = Counting(fake)
    count.since()
    # standalone: the node's index and its block read, one write
    second = Ipam(store, "node-a").assign(request("c2"))[0]
    sent = count.since()
    assert [r for r in sent if not r.startswith("GET")] == [
        f"PUT /apis/tabby.io/v1/ipamblocks/{kinds.block_name(str(first.block_cidr))}"
    ]
    assert "LIST" not in " ".join(sent)
    assert second.ip != first.ip

    class Known:
        """What tabby-node's watch would hold: every document as last read or written."""

        def __init__(self) -> None:
            self.docs: dict[tuple[str, str], Doc | None] = {}

        def lookup(self, kind: str, key: str) -> Any:
            from datastore.cached import UNKNOWN

            return self.docs.get((kind, key), UNKNOWN)

        def learn(self, kind: str, key: str, doc: Doc | None) -> None:
            self.docs[(kind, key)] = doc

        def forget(self, kind: str, key: str) -> None:
            self.docs.pop((kind, key), None)

    known = Known()
    counts = Counts()
    run(store, known, lambda s: Ipam(s, "node-a").assign(request("c3")), counts)  # learns
    count.since()
    got = run(store, known, lambda s: Ipam(s, "node-a").assign(request("c4")), counts)
    assert count.since() == [
        f"PUT /apis/tabby.io/v1/ipamblocks/{kinds.block_name(str(first.block_cidr))}"
    ]
    assert got
    released = run(
        store,
        known,
        lambda s: Ipam(s, "node-a").release_handle(handle_id("net", "c4", "eth0")),
        counts,
    )
    assert released == got
    assert [r.split()[0] for r in count.since()] == ["PUT"]
    assert isinstance(Cached(store, known), Cached)


@pytest.mark.slow  # ~10 s: many threads on the fake API server
def test_two_nodes_claiming_on_the_api_never_share_an_address(
    api: tuple[FakeApi, str], tmp_path: Path
) -> None:
    _fake, url = api
    seen: list[str] = []
    lock = threading.Lock()
    errors: list[BaseException] = []
    admin = store_of(url, tmp_path / "x")
    Ipam(admin, "").ensure_pools([PoolSpec(POOL, 28)])

    def node_run(name: str) -> None:
        store = store_of(url, tmp_path / name)
        try:
            ipam = Ipam(store, name)
            for i in range(40):
                (a,) = ipam.assign(
                    request(f"{name}-{i}")._replace(attrs=attrs(f"p{i}", f"{name}-{i}", name))
                )
                with lock:
                    seen.append(str(a.ip))
        except BaseException as e:  # reported below
            errors.append(e)
        finally:
            store.close()

    threads = [threading.Thread(target=node_run, args=(n,)) for n in ("node-a", "node-b", "node-c")]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    assert len(seen) == 120
    assert len(set(seen)) == 120
    from ipam.core import check_consistency

    try:
        assert [p for p in check_consistency(admin) if p.severity == "error"] == []
    finally:
        admin.close()


# -- sync -----------------------------------------------------------------------------------------


class Mirror:
    """A consumer of ``sync`` in a thread: the documents as its events make them."""

    def __init__(self, store: KubeStore, kinds_: tuple[str, ...]) -> None:
        self.state: dict[str, dict[str, Doc]] = {}
        self.events: list[SyncEvent] = []
        self.stop = threading.Event()
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, args=(store, kinds_), daemon=True)
        self.thread.start()

    def _run(self, store: KubeStore, kinds_: tuple[str, ...]) -> None:
        for event in store.sync(kinds_, self.stop):
            with self.cond:
                self.events.append(event)
                if event.type == "snapshot":
                    assert event.snapshot is not None
                    self.state = {k: dict(v) for k, v in event.snapshot.items()}
                elif event.doc is not None:
                    self.state.setdefault(event.kind, {})[event.key] = event.doc
                else:
                    self.state.get(event.kind, {}).pop(event.key, None)
                self.cond.notify_all()

    def wait(self, cond: Any, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        with self.cond:
            while not cond():
                left = deadline - time.monotonic()
                if left <= 0:
                    pytest.fail(f"never: {self.state}")
                self.cond.wait(left)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)


@pytest.fixture
def mirrors() -> Iterator[list[Mirror]]:
    made: list[Mirror] = []
    yield made
    for m in made:
        m.close()


WATCHED = (
    "pool",
    "block",
    "node",
    "heartbeat",
    "networkpolicy",
    "namespace",
    "pod",
    "workloadendpoint",
)


def test_sync_makes_the_documents_and_yields_only_real_changes(
    api: tuple[FakeApi, str], store: KubeStore, mirrors: list[Mirror]
) -> None:
    fake, _ = api
    fake.put("/api/v1/namespaces", namespace("shop"))
    fake.put("/api/v1/nodes", ready_node("node-a", {"zone": "a"}))
    fake.put("/api/v1/pods", pod("shop", "pod-c1", {"app": "web"}, node="node-a"))
    fake.put(
        "/apis/networking.k8s.io/v1/networkpolicies",
        policy("shop", "deny", {"podSelector": {}}),
    )
    store.put("node", "node-a", {"metadata": {"name": "node-a"}, "spec": {}}, None)
    Ipam(store, "").ensure_pools([PoolSpec(POOL, 28)])
    (a1,) = Ipam(store, "node-a").assign(request("c1"))
    m = Mirror(store, WATCHED)
    mirrors.append(m)
    m.wait(lambda: bool(m.events))
    snap = m.state
    assert list(snap["pod"]) == ["shop/pod-c1"]
    assert list(snap["heartbeat"]) == ["node-a"]
    assert snap["node"]["node-a"].data["metadata"]["labels"] == {"zone": "a"}
    (wep,) = snap["workloadendpoint"].values()
    assert wep.data["spec"]["ipNetworks"] == [f"{a1.ip}/32"]
    assert wep.data["spec"]["hostInterface"] == "calic1"
    # a pod's status changing alone is no event; its labels are
    before = len(m.events)
    changed = pod("shop", "pod-c1", {"app": "web"}, node="node-a", ips=())
    changed["status"]["phase"] = "Succeeded"
    fake.put("/api/v1/pods", changed)
    fake.put("/api/v1/pods", pod("shop", "pod-c1", {"app": "db"}, node="node-a"))
    m.wait(lambda: m.state["pod"]["shop/pod-c1"].data["metadata"]["labels"] == {"app": "db"})
    assert len(m.events) == before + 1
    # an ADD is its block and its endpoint; a DEL the same
    (a2,) = Ipam(store, "node-a").assign(request("c2"))
    m.wait(lambda: len(m.state["workloadendpoint"]) == 2)
    Ipam(store, "node-a").release_handle(handle_id("net", "c1", "eth0"))
    m.wait(lambda: len(m.state["workloadendpoint"]) == 1)
    (left,) = m.state["workloadendpoint"].values()
    assert left.data["spec"]["ipNetworks"] == [f"{a2.ip}/32"]
    # readiness and labels of the v1 Node
    fake.put("/api/v1/nodes", ready_node("node-a", {"zone": "b"}))
    m.wait(lambda: m.state["node"]["node-a"].data["metadata"]["labels"] == {"zone": "b"})
    fake.put("/api/v1/nodes", ready_node("node-a", {"zone": "b"}, ready=False))
    m.wait(lambda: "node-a" not in m.state["heartbeat"])
    # what the events made is what the store lists (a made document's revision is its
    # latest source's as of its last change: compared by content)
    listed = {k: {key: d.data for key, d in store.list(k)} for k in WATCHED}
    assert {k: {key: d.data for key, d in v.items()} for k, v in m.state.items()} == listed


def test_an_event_between_the_first_lists_is_taken_after_the_snapshot(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    """A Node registered after tabby's Nodes were listed but before the v1 Nodes were: its
    watch event reaches the iterator before the snapshot, and must follow it (a tabby-node
    starting beside another once peered with one node of three until a re-list)."""
    fake, url = api
    store.put("node", "node-a", {"metadata": {"name": "node-a"}, "spec": {}}, None)
    store.put("node", "node-b", {"metadata": {"name": "node-b"}, "spec": {}}, None)
    tabby_nodes = kinds.CRDS["node"].path
    node_a, node_b = (fake.objects[tabby_nodes][n] for n in ("node-a", "node-b"))
    client = KubeClient(KubeConfig(server=url), timeout=5, agent="tabby-test")
    sync = KubeSync(client, lambda _what: None, ("node",), threading.Event())
    sync.events.put(("list", tabby_nodes, [node_a]))
    sync.events.put(("ADDED", tabby_nodes, node_b))
    sync.events.put(
        ("list", kinds.V1_NODES, [ready_node("node-a"), ready_node("node-b", {"z": "b"})])
    )
    got = sync._events()
    snapshot = next(got)
    assert snapshot.snapshot is not None
    assert sorted(snapshot.snapshot["node"]) == ["node-a"]
    sync.stop.set()  # what follows the snapshot now, without waiting for more
    (event,) = list(got)
    assert (event.kind, event.key) == ("node", "node-b")
    assert event.doc is not None
    assert event.doc.data["metadata"]["labels"] == {"z": "b"}
    # a collection listed again before the snapshot: what followed its first list is in it
    sync = KubeSync(client, lambda _what: None, ("node",), threading.Event())
    sync.events.put(("list", tabby_nodes, [node_a]))
    sync.events.put(("DELETED", tabby_nodes, node_a))
    sync.events.put(("list", tabby_nodes, [node_b]))
    sync.events.put(("list", kinds.V1_NODES, []))
    got = sync._events()
    snapshot = next(got)
    assert snapshot.snapshot is not None
    assert sorted(snapshot.snapshot["node"]) == ["node-b"]
    sync.stop.set()
    assert list(got) == []
    client.close()


def test_a_change_while_another_collection_is_listed_is_not_lost(
    api: tuple[FakeApi, str], store: KubeStore, mirrors: list[Mirror]
) -> None:
    """A tabby Node registered after its collection was listed but before the others were
    (the snapshot waits for every list): it comes after the snapshot. (Dropped, the
    Kubernetes tier's nodes came up with one BGP peer missing for good.)"""
    fake, _ = api
    store.put("node", "node-a", {"metadata": {"name": "node-a"}, "spec": {}}, None)
    release = fake.hold_lists("/api/v1/pods")
    m = Mirror(store, ("node", "pod"))
    mirrors.append(m)
    try:
        deadline = time.monotonic() + 10
        while not any(r.startswith("GET /apis/tabby.io/v1/nodes?watch") for r in fake.requests):
            assert time.monotonic() < deadline, fake.requests
            time.sleep(0.02)
        store.put("node", "node-b", {"metadata": {"name": "node-b"}, "spec": {}}, None)
        time.sleep(0.3)  # its watch event delivered while the pods are still being listed
        assert not m.events
    finally:
        release.set()
    m.wait(lambda: sorted(m.state.get("node", {})) == ["node-a", "node-b"])
    assert m.events[0].type == "snapshot"


def test_the_token_is_read_again_where_it_was_when_the_path_means_nothing_here(
    api: tuple[FakeApi, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A service account token is re-read (it rotates) from the directory the client found
    it in, not by its path: tabby-node re-reads it in a served CNI call's thread, which is
    in the host's mount namespace, where the pod's path does not exist (there every ADD
    failed "no service account token" a minute after start). Here the directory moves away
    from the path, and the rotated token is still read."""
    from stores.kube import client as kube_client

    _, url = api
    secrets = tmp_path / "serviceaccount"
    secrets.mkdir()
    (secrets / "token").write_text("first\n")
    client = KubeClient(
        KubeConfig(server=url, token_file=str(secrets / "token")), timeout=5, agent="tabby-test"
    )
    assert client._bearer() == "first"
    secrets.rename(tmp_path / "elsewhere")  # the path means nothing now
    (tmp_path / "elsewhere" / "token").write_text("rotated\n")
    monkeypatch.setattr(kube_client, "TOKEN_REREAD_SECONDS", 0.0)
    assert client._bearer() == "rotated"
    client.close()


def test_a_gone_history_is_read_again_and_only_the_differences_yielded(
    api: tuple[FakeApi, str],
    store: KubeStore,
    mirrors: list[Mirror],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from stores.kube import sync

    monkeypatch.setattr(sync, "RELIST_JITTER", 0.1)
    fake, _ = api
    fake.put("/api/v1/pods", pod("shop", "a", {"x": "1"}))
    fake.put("/api/v1/pods", pod("shop", "b", {"x": "1"}))
    m = Mirror(store, ("pod",))
    mirrors.append(m)
    m.wait(lambda: len(m.state.get("pod", {})) == 2)
    events = len(m.events)
    fake.compact()
    fake.delete("/api/v1/pods", "shop/a")
    fake.put("/api/v1/pods", pod("shop", "c", {"x": "1"}))
    fake.compact()
    fake.break_watches()
    m.wait(lambda: set(m.state["pod"]) == {"shop/b", "shop/c"})
    assert len(m.events) == events + 2  # a delete and a put: not b again
    assert store.sync_stats["rereads"] >= 1


def _sync_until_error(
    store: KubeStore, kinds_: tuple[str, ...], act: Any, timeout: float = 10
) -> tuple[list[SyncEvent], Exception | None]:
    """The events of one ``sync`` while ``act()`` runs after its snapshot, until it raises
    (or ``timeout``): what was yielded, and what it raised."""
    stop = threading.Event()
    events: list[SyncEvent] = []
    raised: list[Exception] = []

    def run() -> None:
        try:
            for event in store.sync(kinds_, stop):
                events.append(event)
                if event.type == "snapshot":
                    act()
        except Exception as e:  # what the test looks at
            raised.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    t.join(timeout)
    stop.set()
    t.join(5)
    return events, (raised[0] if raised else None)


def test_an_uninstall_deleting_the_definitions_withdraws_nothing(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    """``kubectl delete -f manifests/tabby.yaml`` deletes the CRDs, and the API server every
    object of their kinds: a watcher must keep what it read (the running pods' endpoints,
    the other nodes' routes), not report the deletions, and start no new sync from what is
    left while a definition is being deleted."""
    fake, _ = api
    store.put("node", "node-a", {"metadata": {"name": "node-a"}, "spec": {}}, None)
    Ipam(store, "").ensure_pools([PoolSpec(POOL, 28)])
    Ipam(store, "node-a").assign(request("c1"))
    kinds_ = ("pool", "node", "workloadendpoint")
    # a block released the ordinary way is reported (its definition stays)
    (block,) = [key for key, _ in store.list("block")]

    def release() -> None:
        Ipam(store, "node-a").release_handle(handle_id("net", "c1", "eth0"))
        store.delete("block", block, store.get("block", block).revision)  # type: ignore[union-attr]

    events, raised = _sync_until_error(store, kinds_, release, timeout=2)
    assert raised is None
    assert [(e.type, e.kind) for e in events[1:]] == [("delete", "workloadendpoint")]
    # the definitions deleted: an error, and no deletion reported
    Ipam(store, "node-a").assign(request("c2"))
    events, raised = _sync_until_error(
        store, kinds_, lambda: [fake.delete_definition(k) for k in ("block", "node", "pool")]
    )
    assert isinstance(raised, StoreRemoved), raised
    assert ".tabby.io: being deleted" in str(raised)
    assert [e.type for e in events] == ["snapshot"]
    (snap,) = events
    assert snap.snapshot is not None
    assert len(snap.snapshot["workloadendpoint"]) == 1
    # a new sync meanwhile: no snapshot of what is left
    events, raised = _sync_until_error(store, kinds_, lambda: None, timeout=5)
    assert isinstance(raised, StoreRemoved)
    assert events == []


def test_a_watching_node_keeps_the_pool_names_so_a_standalone_call_lists_nothing(
    api: tuple[FakeApi, str], store: KubeStore, mirrors: list[Mirror], tmp_path: Path
) -> None:
    """tabby-node's watch of the pools writes their CIDR -> name file beside the lock: a CNI
    call made without tabby-node on that node finds a pool kubectl named with one GET (a
    block's claim lists the pools, once per block: the pool gate's overlap check)."""
    fake, _ = api
    pools = kinds.CRDS["pool"].path
    fake.put(pools, {"metadata": {"name": "blue"}, "spec": {"cidr": POOL, "blockSize": 28}})
    m = Mirror(store, ("pool",))
    mirrors.append(m)
    m.wait(lambda: POOL in m.state.get("pool", {}))
    fake.put(pools, {"metadata": {"name": "green"}, "spec": {"cidr": "10.61.0.0/24"}})
    m.wait(lambda: "10.61.0.0/24" in m.state.get("pool", {}))
    elsewhere = store_of(api[1], tmp_path / "elsewhere")  # the claim lists the pools (gate)
    try:
        Ipam(elsewhere, "node-a").assign(request("c0"))
    finally:
        elsewhere.close()
    count = Counting(fake)
    count.since()
    standalone = store_of(api[1], tmp_path)  # another process: the same lock directory
    try:
        (alloc,) = Ipam(standalone, "node-a").assign(request("c1"))
        got = standalone.get("pool", "10.61.0.0/24")
    finally:
        standalone.close()
    assert alloc.ip in ipaddress.ip_network(POOL)
    assert got is not None
    assert got.data["name"] == "green"
    sent = count.since()
    assert f"GET {pools}" not in sent  # no list of the pools
    assert f"GET {pools}/blue" in sent


def test_the_plugins_kubeconfig_and_the_pods_account_name_one_store(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """tabby-node (the pod's service account) serves the calls whose conflist names the
    plugins' kubeconfig: the same API server is the same store, whoever's the token."""
    from types import SimpleNamespace

    from stores import identity
    from tests.kube_fake import write_kubeconfig

    monkeypatch.delenv("KUBECONFIG", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    monkeypatch.setenv("KUBERNETES_SERVICE_PORT", "443")
    plugins = write_kubeconfig(str(tmp_path / "tabby-kubeconfig"), "https://10.96.0.1:443")
    other = write_kubeconfig(str(tmp_path / "other"), "https://10.0.0.9:6443")

    def settings(kubeconfig: str | None) -> Any:
        return SimpleNamespace(datastore_type="kubernetes", kubeconfig=kubeconfig)

    assert identity(settings(None)) == identity(settings(plugins))
    assert identity(settings(None)) != identity(settings(other))
    write_kubeconfig(plugins, "https://10.0.0.9:6443")  # the file changed: read again
    os.utime(plugins, ns=(0, 10**18))
    assert identity(settings(plugins)) == identity(settings(other))


def test_pools_kubectl_wrote_loosely_are_keyed_canonically_or_ignored(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    """What the schema cannot refuse on 1.20: an IPv6 CIDR not in canonical form is the
    canonical key; one with host bits is no pool (and stops no call)."""
    fake, _ = api
    path = kinds.CRDS["pool"].path
    fake.put(path, {"metadata": {"name": "upper"}, "spec": {"cidr": "FD00:0::/120"}})
    fake.put(path, {"metadata": {"name": "hostbits"}, "spec": {"cidr": "fd01::1/120"}})
    assert store.list_keys("pool") == ["fd00::/120"]
    got = store.get("pool", "fd00::/120")
    assert got is not None
    assert got.data["cidr"] == "fd00::/120"
    (alloc,) = Ipam(store, "node-a").assign(
        AssignRequest(
            handle_id("net", "c6", "eth0"),
            attrs("p", "c6"),
            want_v4=False,
            want_v6=True,
            v6_pools=["fd00::/120"],
        )
    )
    assert alloc.ip in ipaddress.ip_network("fd00::/120")


def test_a_cidr_given_two_ippools_claims_no_block_until_one_goes(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    """IPPool names are not keys: kubectl can make two pools of one CIDR. No block of it is
    claimed while both exist (which one rules would be a guess); one deleted, claims go on."""
    fake, _ = api
    path = kinds.CRDS["pool"].path
    spec = {"cidr": POOL, "blockSize": 28}
    fake.put(path, {"metadata": {"name": "blue"}, "spec": spec})
    fake.put(path, {"metadata": {"name": "green"}, "spec": {**spec, "disabled": True}})
    with pytest.raises(NoAddressAvailable):
        Ipam(store, "node-a").assign(request("c1"))
    fake.delete(path, "green")
    (alloc,) = Ipam(store, "node-a").assign(request("c1"))
    assert alloc.ip in ipaddress.ip_network(POOL)


def test_a_server_gone_silent_on_a_kept_connection_costs_one_timeout_not_two() -> None:
    """A blackholed API server: the request on the kept-alive connection times out, and is
    not sent again on a new one (which would double the bound of the call)."""
    import socket
    import threading

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    port = listener.getsockname()[1]
    held: list[socket.socket] = []

    def serve() -> None:
        answered = False
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            held.append(conn)
            conn.recv(65536)
            if not answered:  # the first request answered, kept alive; then silence
                body = b"{}"
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    + f"Content-Length: {len(body)}\r\n\r\n".encode()
                    + body
                )
                answered = True
                conn.recv(65536)  # the second request: never answered

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    client = KubeClient(KubeConfig(server=f"http://127.0.0.1:{port}"), timeout=1.0)
    try:
        client.get("/api/v1/namespaces/x")
        t0 = time.monotonic()
        with pytest.raises(ApiError):
            client.get("/api/v1/namespaces/x")
        took = time.monotonic() - t0
    finally:
        client.close()
        listener.close()
        for c in held:
            c.close()
    assert took < 1.8, f"{took:.1f} s"


# -- every crash point, on the API (ipam/DESIGN.md "Crash points") -----------------------------


def _kube_scenario_writes() -> int:
    from tests.unit.ipam.core.test_faults import _count_writes

    return _count_writes()


@pytest.mark.parametrize("die_at", range(1, _kube_scenario_writes() + 1))
def test_a_writer_killed_at_every_request_on_the_api_leaves_it_consistent(
    api: tuple[FakeApi, str], store: KubeStore, die_at: int
) -> None:
    """The IPAM's writer dies at each of its writes in turn (an ADD that claims blocks, a
    second ADD, a DEL, a release), on the Kubernetes API: what is left breaks no invariant,
    and the runtime's retries (DEL, ADD, DEL) and GC leave nothing behind."""
    from tests.unit.ipam.core.helpers import V4, Crash, DyingStore, errors, hid, in_use, req, setup
    from tests.unit.ipam.core.test_faults import _scenario

    setup(store)
    with pytest.raises(Crash):
        _scenario(DyingStore(store, die_at))
    assert errors(store) == []
    ipam = Ipam(store, "node-a")
    ipam.release_handle(hid(1))
    ipam.release_handle(hid(2))
    assert in_use(ipam) == 0
    ipam.assign(req(hid(1), want_v6=True))
    assert len([u for u in ipam.block_usage() if u.pool == V4]) == 1
    ipam.gc("net", set(), grace_seconds=0)
    assert in_use(ipam) == 0
    assert check_consistency(store) == []
