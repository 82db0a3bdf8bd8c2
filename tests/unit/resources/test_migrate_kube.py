"""A running cluster moved from etcd to the Kubernetes datastore (``resources.migrate_kube``):
the merge rules (every allocation of either side kept; of two at one address the later),
legacy handle documents folded into the nodes' indexes, the freeze / copy / open steps from a
real etcd into the in-memory API server with ADDs and DELs running on etcd throughout (no
address ever held twice across both stores, every acknowledged allocation in the API), an
interrupted run resumed or aborted, and what is refused before anything is written."""

from __future__ import annotations

import ipaddress
import random
import threading
import time
from typing import Any

import pytest

from datastore.base import Store
from datastore.memory import MemoryStore
from ipam.core import AssignRequest, Ipam, NoAddressAvailable, PoolSpec, handle_id
from ipam.core.block import Block
from ipam.core.model import Affinity, Reserved
from resources import migrate_kube as mk
from resources.errors import Conflict
from stores.kube import kinds
from tests.kube_fake import FakeApi

from .conftest import Stores

POOL = "10.244.0.0/22"
NET = "k8s-pod-network"

pytestmark = pytest.mark.etcd


def request(node: str, cid: str, pool: str = POOL) -> AssignRequest:
    return AssignRequest(
        handle_id(NET, cid, "eth0"),
        {
            "node": node,
            "network": NET,
            "container_id": cid,
            "ifname": "eth0",
            "pod_namespace": "x",
            "pod_name": cid,
            "pod_uid": f"uid-{cid}",
            "time": time.time(),
        },
        v4_pools=[pool],
    )


def held(store: Store) -> dict[str, str]:
    """Every allocated address -> its handle."""
    return {str(o.ip): o.handle_id for o in Ipam(store, "").allocations()}


def no_address_twice(*stores: Store) -> None:
    """No address held for two attachments across ``stores``."""
    owner: dict[str, str] = {}
    for store in stores:
        for ip, handle in held(store).items():
            assert owner.setdefault(ip, handle) == handle, f"{ip}: {owner[ip]} and {handle}"


# -- the merge rules ------------------------------------------------------------------------------


def block_with(allocs: dict[int, tuple[str, int]], seq: int) -> Block:
    blk = Block.new(ipaddress.ip_network("10.244.0.0/29"), POOL, "node-a")
    for ordinal, (handle, s) in allocs.items():
        blk.assign(ordinal, handle, {"node": "node-a"}, Reserved.parse([]))
        blk.allocations[ordinal] = {"handle": handle, "seq": s, "attrs": {"node": "node-a"}}
    blk.seq = seq
    return blk


def test_a_merge_keeps_every_allocation_and_of_two_at_one_address_the_later() -> None:
    src = block_with({0: ("h0", 1), 1: ("h1", 2), 2: ("h2", 3)}, seq=3)
    # the target: h0 copied before, h1 released there since and its address taken again by
    # h9 (a node on the API: a higher sequence number), an allocation h5 of its own
    tgt = block_with({0: ("h0", 1), 1: ("h9", 140), 5: ("h5", 141)}, seq=141)
    merged, added, conflicts = mk.merge_block(src, tgt)
    handles = {o: a["handle"] for o, a in enumerate(merged.allocations) if a is not None}
    assert handles == {0: "h0", 1: "h9", 2: "h2", 5: "h5"}
    assert added == 1  # h2
    assert conflicts == ["10.244.0.1: kept h9 (seq 140), not h1 (seq 2, released since)"]
    assert merged.seq == 141
    assert 2 not in merged.unallocated
    assert 5 not in merged.unallocated
    assert sorted(merged.unallocated) == [3, 4, 6, 7]
    # a later source allocation (an ADD in flight at the freeze) wins over an earlier copy
    late = block_with({1: ("h7", 4)}, seq=4)
    earlier = block_with({1: ("h1", 2)}, seq=3)
    merged, added, conflicts = mk.merge_block(late, earlier)
    assert merged.allocations[1]["handle"] == "h7"
    # nothing in the target: a copy
    copied, added, _ = mk.merge_block(src, None)
    assert (copied.to_data(), added) == (src.to_data(), 3)


def test_indexes_merge_and_legacy_handles_join_the_borrowed() -> None:
    source = MemoryStore()
    source.put(
        "affinity",
        "node-a",
        {"node": "node-a", "blocks": ["10.244.0.0/26"], "cursor": {POOL: 1}},  # format 1
        None,
    )
    source.put(
        "handle",
        f"{NET}:c1:eth0",
        {
            "id": f"{NET}:c1:eth0",
            "network": NET,
            "container_id": "c1",
            "ifname": "eth0",
            "node": "node-a",
            "created": 1.0,
            "blocks": ["10.244.0.0/26", "10.244.1.0/26"],
        },
        None,
    )
    source.put(  # a node of format 1 that only ever borrowed: no affinity document
        "handle",
        f"{NET}:c2:eth0",
        {
            "id": f"{NET}:c2:eth0",
            "network": NET,
            "container_id": "c2",
            "ifname": "eth0",
            "node": "node-b",
            "created": 1.0,
            "blocks": ["10.244.0.0/26"],
        },
        None,
    )
    found = mk.source_indexes(source)
    assert found["node-a"].blocks == ["10.244.0.0/26"]
    assert found["node-a"].borrowed == ["10.244.1.0/26"]
    assert found["node-b"].borrowed == ["10.244.0.0/26"]
    target = Affinity("node-a", ["10.244.2.0/26"], ["10.244.0.0/26"], {POOL: 3})
    merged = mk.merge_affinity(found["node-a"], target)
    assert merged.to_data() == {
        "node": "node-a",
        "format": 2,
        "blocks": ["10.244.2.0/26"],
        "borrowed": ["10.244.0.0/26", "10.244.1.0/26"],
        "cursor": {POOL: 3},
    }


# -- freeze, copy, open ----------------------------------------------------------------------------


def test_a_migration_copies_what_the_api_keeps_and_opens_its_pools(
    stores: Stores, api: tuple[FakeApi, str]
) -> None:
    from resources.client import ResourceClient

    fake, _url = api
    source = stores.etcd("admin")
    target = stores.kube()
    Ipam(source, "").ensure_pools([PoolSpec(POOL, 26), PoolSpec("10.250.0.0/24", 26, True)])
    for i in range(3):
        Ipam(source, "node-a").assign(request("node-a", f"a{i}"))
    Ipam(source, "node-b").assign(request("node-b", "b0"))
    ResourceClient(source).apply(
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "BGPPeer",
                "metadata": {"name": "rr"},
                "spec": {"peerIP": "10.0.0.9", "asNumber": 64512},
            },
            {
                "apiVersion": "networking.k8s.io/v1",
                "kind": "NetworkPolicy",
                "metadata": {"name": "by-hand", "namespace": "x"},
                "spec": {"podSelector": {}},
            },
        ]
    )
    node = {
        "metadata": {
            "name": "node-a",
            "labels": {"zone": "a"},
            "annotations": {"tabby.io/source": "kubernetes", "keep": "me"},
        },
        "spec": {"backend": "vxlan", "ipv4Address": "192.168.7.1/24"},
    }
    source.put("node", "node-a", node, None)
    said: list[str] = []
    slept: list[float] = []
    report = mk.migrate(source, target, settle=2.5, say=said.append, sleep=slept.append)
    # the source: frozen (its enabled pool disabled and marked; the disabled one as it was)
    pools = {k: d.data for k, d in source.list("pool")}
    assert pools[POOL]["disabled"]
    assert mk.marked(pools[POOL])
    assert pools["10.250.0.0/24"]["disabled"]
    assert pools["10.250.0.0/24"]["annotations"] == {mk.MIGRATING: mk.WAS_DISABLED}
    assert report.frozen == [POOL]
    assert slept == [2.5]
    assert "waiting 2.5 s for the ADDs in flight" in said[0]
    with pytest.raises(NoAddressAvailable):
        Ipam(source, "node-a").assign(request("node-a", "late"))
    # the API: the same allocations, pools open as they were, resources as it keeps them
    assert held(target) == held(source)
    assert report.counts["allocations"] == 4
    assert report.opened == [POOL]
    ippools = {o["spec"]["cidr"]: o for o in fake.objects[kinds.CRDS["pool"].path].values()}
    assert ippools[POOL]["spec"]["disabled"] is False
    assert "annotations" not in ippools[POOL]["metadata"]
    assert ippools["10.250.0.0/24"]["spec"]["disabled"] is True
    assert fake.objects[kinds.CRDS["bgppeer"].path]["rr"]["spec"]["peerIP"] == "10.0.0.9"
    copied = fake.objects[kinds.CRDS["node"].path]["node-a"]
    assert copied["spec"] == node["spec"]
    assert copied["metadata"]["annotations"] == {"keep": "me"}  # not mirrored any more
    assert "labels" not in copied["metadata"]
    assert [a for a in report.skipped if "by-hand" in a] == [
        "networkpolicy x/by-hand: made with tabbyctl; Kubernetes' own in the Kubernetes "
        "datastore (apply it with kubectl)"
    ]
    assert sorted(target.list_keys("affinity")) == ["node-a", "node-b"]
    # the nodes switch: they allocate on the API, never an address the source holds
    for i in range(70):  # past node-a's first block: a claim on the API
        Ipam(target, "node-a").assign(request("node-a", f"k{i}"))
    no_address_twice(source, target)
    # a run again is a merge that adds nothing and leaves the open pools open
    again = mk.migrate(source, target, settle=2.5, sleep=slept.append)
    assert (again.frozen, again.counts.get("allocations"), again.conflicts) == ([], 0, [])
    assert slept == [2.5]  # nothing frozen now: nothing to wait for
    assert len(held(target)) == 74
    assert target.get("pool", POOL).data["disabled"] is False  # type: ignore[union-attr]


class SlowWrites:
    """A store whose block writes wait ``delay`` first: a node whose ADD is in flight for a
    while between reading its pool and writing its allocation (what the freeze waits for)."""

    def __init__(self, store: Store, delay: float) -> None:
        self.store = store
        self.delay = delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def put(self, kind: str, key: str, data: Any, rev: int | None) -> int:
        if kind == "block":
            time.sleep(self.delay)
        return self.store.put(kind, key, data, rev)


def test_adds_and_dels_during_the_migration_never_share_an_address(
    stores: Stores, api: tuple[FakeApi, str]
) -> None:
    """Three nodes keep adding and deleting on etcd while the migration runs: ADDs stop
    being served at the freeze, DELs go on; afterwards every allocation etcd holds is in the
    API, and no address is held for two attachments across both stores, also once the
    nodes allocate on the API."""
    admin = stores.etcd("admin")
    Ipam(admin, "").ensure_pools([PoolSpec(POOL, 27)])
    stop = threading.Event()
    lock = threading.Lock()
    acked: dict[str, str] = {}  # handle -> address: ADDs answered
    released: set[str] = set()  # handles whose DEL was answered
    refused: list[str] = []
    errors: list[BaseException] = []
    holding: dict[str, int] = {}

    def node(name: str) -> None:
        """ADDs and DELs in turn, a DEL only while the node holds more than 10 (so that it
        always has pods when the copy runs: after the freeze only DELs are answered).
        node-c is slow: its ADD writes its block 0.2 s after it read the pool."""
        store = stores.etcd(name)
        ipam = Ipam(SlowWrites(store, 0.2) if name == "node-c" else store, name)
        mine: list[str] = []
        rnd = random.Random(name)
        try:
            for i in range(10_000):
                if stop.is_set():
                    return
                if len(mine) > 10 and rnd.random() < 0.5:
                    hid = mine.pop(rnd.randrange(len(mine)))
                    ipam.release_handle(hid)
                    with lock:
                        released.add(hid)
                    continue
                try:
                    (got,) = ipam.assign(request(name, f"{name}-{i}"))
                except NoAddressAvailable:
                    with lock:
                        refused.append(name)
                    time.sleep(0.01)
                    continue
                mine.append(got.handle_id)
                with lock:
                    acked[got.handle_id] = str(got.ip)
                    holding[name] = len(mine)
        except BaseException as e:  # reported below
            errors.append(e)

    threads = [threading.Thread(target=node, args=(n,)) for n in ("node-a", "node-b", "node-c")]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 30
    while len([n for n in holding.values() if n > 10]) < 3:  # every node holds 10, and goes on
        assert time.monotonic() < deadline, holding
        time.sleep(0.05)
    source = stores.etcd("admin")
    target = stores.kube()
    report = mk.migrate(source, target, settle=0.5)
    time.sleep(0.5)  # DELs go on after the copy: released in etcd only
    stop.set()
    for t in threads:
        t.join(30)
    assert errors == []
    assert refused, "no ADD was refused after the freeze"
    assert report.frozen == [POOL]
    in_etcd, in_api = held(source), held(target)
    assert len(acked) > 60
    assert len(in_etcd) >= 30  # each node keeps 10 or more
    # every acknowledged allocation that was not released is in both stores
    live = {ip: h for h, ip in acked.items() if h not in released}
    assert live == in_etcd
    assert live.items() <= in_api.items()
    assert report.counts["allocations"] >= len(live)
    # the API keeps those released after the copy (the controllers' leak GC takes them)
    assert set(in_etcd) <= set(in_api)
    no_address_twice(source, target)
    # the nodes switch and allocate on the API: never an address etcd or the API holds
    for name in ("node-a", "node-b", "node-c"):
        ipam = Ipam(target, name)
        for i in range(15):
            ipam.assign(request(name, f"{name}-kdd-{i}"))
    no_address_twice(source, target)
    assert not mk.freeze(source)  # still frozen: etcd hands nothing out any more


def test_an_add_in_flight_at_the_freeze_is_copied(stores: Stores) -> None:
    """An ADD that read its pool before the freeze and writes its allocation after it (a
    slow node) lands while the migration waits ``settle``, and is in the copy."""
    source, target = stores.etcd("admin"), stores.kube()
    Ipam(source, "").ensure_pools([PoolSpec(POOL, 26)])
    Ipam(source, "node-a").assign(request("node-a", "first"))  # its block exists
    freezing = threading.Event()

    class InFlight(SlowWrites):
        def put(self, kind: str, key: str, data: Any, rev: int | None) -> int:
            if kind == "block":
                freezing.wait(10)  # read before the freeze...
                time.sleep(0.3)  # ...written after it
            return self.store.put(kind, key, data, rev)

    got: list[str] = []
    slow = threading.Thread(
        target=lambda: got.extend(
            str(a.ip)
            for a in Ipam(InFlight(stores.etcd("node-a"), 0), "node-a").assign(
                request("node-a", "slow")
            )
        )
    )
    slow.start()
    time.sleep(0.3)  # it has read the pool (enabled) and waits to write
    report = mk.migrate(source, target, settle=1.5, say=lambda line: freezing.set())
    slow.join(10)
    assert len(got) == 1  # acknowledged
    assert held(target)[got[0]] == handle_id(NET, "slow", "eth0")
    assert held(target) == held(source)
    assert report.counts["allocations"] == 2


def test_a_del_before_its_node_switched_is_released_on_the_api_after_the_leak_grace(
    stores: Stores, api: tuple[FakeApi, str]
) -> None:
    """A pod deleted on a node not yet switched: its DEL releases in etcd only; the API's
    copy of the allocation goes when tabby-kube-controllers (on the Kubernetes datastore)
    find its pod gone for ``--leak-grace``; the other pod's address stays."""
    from kube_controllers import mirror
    from kube_controllers.ipamgc import IpamGc
    from kube_controllers.reflector import Reflector
    from stores.kube.client import KubeClient, KubeConfig
    from tests.kube_fake import pod, ready_node

    fake, url = api
    source, target = stores.etcd("node-a"), stores.kube()
    Ipam(source, "").ensure_pools([PoolSpec(POOL, 26)])
    fake.put("/api/v1/nodes", ready_node("node-a"))
    for name in ("stays", "goes"):
        ip = Ipam(source, "node-a").assign(request("node-a", name))[0].ip
        obj = pod("x", name, node="node-a", ips=(str(ip),))
        obj["metadata"]["uid"] = f"uid-{name}"
        fake.put("/api/v1/pods", obj)
    mk.migrate(source, target, settle=0)
    Ipam(source, "node-a").release_handle(handle_id(NET, "goes", "eth0"))  # its DEL, on etcd
    fake.delete("/api/v1/pods", "x/goes")
    assert sorted(held(target).values()) == [handle_id(NET, c, "eth0") for c in ("goes", "stays")]
    client = KubeClient(KubeConfig(server=url))
    try:
        nodes = Reflector(client, "node", "/api/v1/nodes", mirror.project_node, lambda k, n: None)
        pods = Reflector(client, "pod", "/api/v1/pods", mirror.project_pod, lambda k, n: None)
        nodes.relist()
        pods.relist()
        now = [0.0]
        gc = IpamGc(
            target, client, nodes, pods, 300, 900, clock=lambda: now[0], kubernetes_datastore=True
        )
        gc.run_once()
        assert len(held(target)) == 2  # within the grace
        now[0] = 901
        gc.run_once()
    finally:
        client.close()
    assert list(held(target).values()) == [handle_id(NET, "stays", "eth0")]
    no_address_twice(source, target)


# -- interruptions ---------------------------------------------------------------------------------


def test_an_interrupted_copy_leaves_both_stores_closed_then_resumes_or_aborts(
    stores: Stores, api: tuple[FakeApi, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake, _url = api
    source = stores.etcd("admin")
    target = stores.kube()
    Ipam(source, "").ensure_pools([PoolSpec(POOL, 28), PoolSpec("10.250.0.0/24", 28, True)])
    for i in range(40):  # three blocks of node-a
        Ipam(source, "node-a").assign(request("node-a", f"a{i}"))
    merged: list[str] = []
    real = mk.merge_block

    def crash_after_two(src: Block, tgt: Block | None) -> Any:
        if len(merged) == 2:
            raise KeyboardInterrupt  # the operator's Ctrl-C, or tabbyctl killed
        merged.append(src.cidr)
        return real(src, tgt)

    monkeypatch.setattr(mk, "merge_block", crash_after_two)
    with pytest.raises(KeyboardInterrupt):
        mk.migrate(source, target, settle=0)
    monkeypatch.setattr(mk, "merge_block", real)
    # what an interruption leaves: the source frozen, the API's pools closed and marked
    assert mk.marked(source.get("pool", POOL).data)  # type: ignore[union-attr]
    staged = target.get("pool", POOL)
    assert staged is not None
    assert staged.data["disabled"]
    assert mk.marked(staged.data)
    with pytest.raises(NoAddressAvailable):
        Ipam(source, "node-a").assign(request("node-a", "x"))
    with pytest.raises(NoAddressAvailable):
        Ipam(target, "node-a").assign(request("node-a", "x"))
    assert 0 < len(held(target)) < 40
    # abort: the API's copy removed, its pools stay closed, the source open again
    done = mk.abort(source, target)
    assert done.thawed == [POOL]
    restored = {k: d.data for k, d in source.list("pool")}
    assert (restored[POOL]["disabled"], restored["10.250.0.0/24"]["disabled"]) == (False, True)
    assert not any(mk.marked(d) for d in restored.values())
    assert held(target) == {}
    assert target.list_keys("affinity") == []
    assert target.get("pool", POOL).data["disabled"]  # type: ignore[union-attr]
    Ipam(source, "node-a").assign(request("node-a", "after-abort"))
    # a migration again (the source changed meanwhile): complete
    report = mk.migrate(source, target, settle=0)
    assert held(target) == held(source)
    assert report.opened == [POOL]
    # once a node allocated on the API, an abort is refused and changes nothing
    Ipam(target, "node-a").assign(request("node-a", "on-the-api"))
    with pytest.raises(Conflict, match="1 allocation\\(s\\) were made on the Kubernetes datastore"):
        mk.abort(source, target)
    assert mk.marked(source.get("pool", POOL).data)  # type: ignore[union-attr]
    assert len(held(target)) == len(held(source)) + 1
    assert fake.objects[kinds.CRDS["pool"].path]


def test_refused_before_anything_is_written(stores: Stores, api: tuple[FakeApi, str]) -> None:
    source = stores.etcd("admin")
    target = stores.kube()
    Ipam(source, "").ensure_pools([PoolSpec(POOL, 26)])
    Ipam(source, "node-a").assign(request("node-a", "a"))
    # the API runs a cluster of its own already: a copy could hand an address out twice
    Ipam(target, "").ensure_pools([PoolSpec("10.99.0.0/24", 26)])
    Ipam(target, "node-z").assign(request("node-z", "z", "10.99.0.0/24"))
    with pytest.raises(Conflict, match="already holds 1 allocation"):
        mk.migrate(source, target, settle=0)
    assert not mk.marked(source.get("pool", POOL).data)  # type: ignore[union-attr]
    # a pool of the API overlapping one of the source
    Ipam(target, "").release_handle(handle_id(NET, "z", "eth0"))
    Ipam(target, "").ensure_pools([PoolSpec("10.244.0.0/16", 26)])
    with pytest.raises(Conflict, match=r"overlaps the Kubernetes API.s pool 10\.244\.0\.0/16"):
        mk.migrate(source, target, settle=0)
    assert not mk.marked(source.get("pool", POOL).data)  # type: ignore[union-attr]
