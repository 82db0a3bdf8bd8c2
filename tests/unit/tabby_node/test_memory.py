"""tabby-node's memory per endpoint in the cluster (issue 20: RSS <= 120 MB with 1000 nodes
and 20k endpoints): the state one node keeps (cache, routing, policy) measured with
tracemalloc over the datastore bench/scale/node_memory_bench.py writes, as a slope between two
cluster sizes (what does not grow with the cluster cancels out). Bytes, not time."""

from __future__ import annotations

import gc
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from bench.scale import node_memory_bench as bench
from datastore.base import Doc
from datastore.engine import Reported
from policy.inputs import pod_key
from resources.index import ENDPOINTS, PODS
from resources.remote import RemoteEndpoint, RemotePod
from tabby_node.cache import REMOTE_HANDLE, Cache

#: Bytes of state per endpoint (its Pod, WorkloadEndpoint and share of a block): 2.4 KB
#: measured once other nodes' Pods and WorkloadEndpoints were held as ``resources.remote``'s
#: records with shared labels and ports, and other nodes' allocations as one shared record
#: per holder (3.6 KB with the records alone, 10.3 KB with the models, 17.8 KB with their
#: stored forms as well): the margin (+27 %) stays below each, so that undoing one fails.
PER_ENDPOINT_LIMIT = 3_000


def _traced(path: Path) -> tuple[int, int]:
    bench.build_node(None)  # imports
    gc.collect()
    tracemalloc.start()
    try:
        agent = bench.build_node(str(path))
        gc.collect()
        size = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    return size, len(agent.cache.of(ENDPOINTS))


@pytest.mark.slow
def test_the_state_per_endpoint_stays_small(tmp_path: Path) -> None:
    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    bench.generate(3, 20, small)
    bench.generate(9, 20, big)
    size_small, eps_small = _traced(small)
    size_big, eps_big = _traced(big)
    assert (eps_small, eps_big) == (60, 180)
    per_endpoint = (size_big - size_small) / (eps_big - eps_small)
    assert per_endpoint <= PER_ENDPOINT_LIMIT, f"{per_endpoint:.0f} B per endpoint"


def _pod(name: str, node: str, rev: int) -> Doc:
    return Doc(
        {
            "metadata": {"name": name, "namespace": "ns", "labels": {"app": "a"}},
            "spec": {"nodeName": node},
        },
        rev,
    )


def _wep(name: str, node: str, rev: int) -> Doc:
    return Doc(
        {
            "metadata": {"name": f"{node}-k8s-{name}-eth0", "namespace": "ns"},
            "spec": {
                "node": node,
                "pod": name,
                "containerID": "c" * 64,
                "interface": "eth0",
                "ipNetworks": ["10.0.0.1/32"],
                "hostInterface": "cali0123456789a",
            },
        },
        rev,
    )


def test_only_this_nodes_pods_keep_their_stored_form() -> None:
    from datastore.base import SyncEvent
    from datastore.cached import UNKNOWN

    cache = Cache("me")
    snapshot: dict[str, dict[str, Any]] = {
        "pod": {"ns/mine": _pod("mine", "me", 2), "ns/theirs": _pod("theirs", "other", 3)},
        "workloadendpoint": {
            "ns/me-k8s-mine-eth0": _wep("mine", "me", 4),
            "ns/other-k8s-theirs-eth0": _wep("theirs", "other", 5),
        },
    }
    cache.apply(SyncEvent("snapshot", "", "", None, snapshot))
    # both typed, both held
    assert cache.get(PODS, "ns/theirs") is not None
    assert cache.get(ENDPOINTS, "ns/other-k8s-theirs-eth0") is not None
    assert cache.has("pod", "ns/theirs")
    # this node's as stored (the optimistic CNI path reads them); another's: ask the store
    mine = cache.lookup("pod", "ns/mine")
    assert isinstance(mine, Doc)
    assert mine.revision == 2
    assert cache.lookup("pod", "ns/theirs") is UNKNOWN
    assert cache.lookup("workloadendpoint", "ns/other-k8s-theirs-eth0") is UNKNOWN
    assert cache.lookup("pod", "ns/absent") is None
    # an older revision of a document held typed only is still ignored, a newer one taken
    version = cache.version
    cache.apply(SyncEvent("put", "pod", "ns/theirs", _pod("theirs", "other", 1), None))
    assert cache.version == version
    assert not cache.index.put("pod", "ns/theirs", _pod("theirs", "other", 3))
    assert cache.index.put("pod", "ns/theirs", _pod("theirs", "other", 9))
    # gone: not held
    cache.apply(SyncEvent("delete", "pod", "ns/theirs", None, None))
    assert not cache.has("pod", "ns/theirs")
    assert cache.lookup("pod", "ns/theirs") is None
    # a pod that moves to this node keeps its stored form from then on
    cache.apply(SyncEvent("put", "pod", "ns/theirs", _pod("theirs", "me", 10), None))
    assert isinstance(cache.lookup("pod", "ns/theirs"), Doc)


@pytest.mark.parametrize("me", [None, "me"])
def test_a_node_that_does_not_know_its_name_keeps_everything(me: str | None) -> None:
    from datastore.base import SyncEvent

    cache = Cache(me)
    snapshot = {"pod": {"ns/theirs": _pod("theirs", "other", 3)}}
    cache.apply(SyncEvent("snapshot", "", "", None, snapshot))
    kept = cache.lookup("pod", "ns/theirs")
    assert isinstance(kept, Doc) == (me is None)


def test_the_sync_bookkeeping_keeps_revisions_not_documents() -> None:
    reported = Reported()
    docs = {"pod": {"a": _pod("a", "x", 1), "b": _pod("b", "x", 2)}}
    event = reported.snapshot(docs)
    assert event.snapshot is docs  # handed over, not copied
    assert reported.docs == {"pod": {"a": 1, "b": 2}}
    changed = reported.changes("pod", {"a": _pod("a", "x", 1), "c": _pod("c", "x", 5)})
    assert [(e.type, e.key) for e in changed] == [("delete", "b"), ("put", "c")]
    put = reported.change("pod", "a", _pod("a", "x", 7))
    assert put is not None
    assert put.type == "put"
    assert reported.docs["pod"] == {"a": 7, "c": 5}
    gone = reported.change("pod", "c", None)
    assert gone is not None
    assert gone.type == "delete"
    assert reported.change("pod", "c", None) is None


def _block(affinity: str, rev: int) -> Doc:
    allocations: list[dict[str, Any] | None] = [None] * 4
    allocations[1] = {
        "handle": "k8s-pod-network:c1:eth0",
        "seq": 1,
        "attrs": {"node": "other", "pod_name": "p", "container_id": "c1", "netns": "/x"},
    }
    allocations[2] = {
        "handle": "k8s-pod-network:c2:eth0",
        "seq": 2,
        "attrs": {"node": "me", "pod_name": "q", "container_id": "c2"},
    }
    allocations[3] = {"handle": "reserved", "seq": 3}
    data = {
        "cidr": "10.0.0.0/30",
        "pool": "10.0.0.0/16",
        "affinity": affinity,
        "seq": 3,
        "allocations": allocations,
        "unallocated": [0],
    }
    return Doc(data, rev)


def test_other_nodes_blocks_keep_only_what_routing_and_the_gauges_read() -> None:
    from datastore.base import SyncEvent
    from datastore.cached import UNKNOWN
    from resources.index import BLOCKS
    from tabby_node.cluster import _block as routing_facts

    cache = Cache("me")
    theirs, mine = _block("host:other", 2), _block("host:me", 3)
    snapshot = {"block": {"10.0.0.0/30": theirs}}
    cache.apply(SyncEvent("snapshot", "", "", None, snapshot))
    # the IPAM path must not build a write on the reduced copy: it reads the store
    assert cache.lookup("block", "10.0.0.0/30") is UNKNOWN
    reduced = cache.view().raw("block")["10.0.0.0/30"]
    assert reduced.revision == 2
    assert [None if a is None else a.get("attrs") for a in reduced.data["allocations"]] == [
        None,
        {"node": "other"},
        {"node": "me"},
        {},  # no attributes: none named
    ]
    # handles and sequence numbers are the owner's: one shared allocation per holder
    assert {a["handle"] for a in reduced.data["allocations"] if a} == {REMOTE_HANDLE}
    other_block = _block("host:third", 5)
    cache.apply(SyncEvent("put", "block", "10.0.1.0/30", other_block, None))
    again = cache.view().raw("block")["10.0.1.0/30"]
    assert again.data["allocations"][2] is reduced.data["allocations"][2]
    # a malformed allocation is not made good: the block is refused as the stored one
    broken = _block("host:other", 6)
    broken.data["allocations"][1]["seq"] = "x"
    cache.apply(SyncEvent("put", "block", "10.0.2.0/30", broken, None))
    assert cache.has("block", "10.0.2.0/30")
    assert cache.get(BLOCKS, "10.0.2.0/30") is None
    # routing reads the same facts from the reduced block as from the whole one
    from ipam.core.block import Block

    typed = cache.get(BLOCKS, "10.0.0.0/30")
    assert typed is not None
    whole = Block.from_data(_block("host:other", 2).data, "whole")
    assert routing_facts(typed) == routing_facts(whole)
    # this node's own block: kept whole, read by the optimistic path
    cache.apply(SyncEvent("put", "block", "10.0.0.0/30", mine, None))
    kept = cache.lookup("block", "10.0.0.0/30")
    assert kept is mine


def test_another_nodes_pod_is_parsed_to_what_policy_reads() -> None:
    from datastore.base import SyncEvent
    from policy.inputs import pod as engine_pod
    from resources.index import Index

    data = {
        "metadata": {
            "name": "web-1",
            "namespace": "ns",
            "uid": "u1",
            "labels": {"app": "web"},
            "annotations": {"tabby.io/source": "kubernetes"},
            "creationTimestamp": "2026-11-26T16:56:20Z",
        },
        "spec": {
            "nodeName": "other",
            "containers": [
                {"name": "web", "ports": [{"name": "http", "containerPort": 8080}]},
                {"name": "side", "ports": [{"containerPort": 9090}]},
                {"name": "bare"},
                {
                    "name": "dns",
                    "ports": [
                        {"name": "dns", "containerPort": 53, "protocol": "UDP"},
                        {"containerPort": 54},
                    ],
                },
            ],
        },
        "status": {"podIPs": [{"ip": "10.0.0.5"}]},
    }
    whole = Index((PODS,))
    whole.put("pod", "ns/web-1", Doc(data, 3))
    cache = Cache("me")
    cache.apply(SyncEvent("snapshot", "", "", None, {"pod": {"ns/web-1": Doc(data, 3)}}))
    slim = cache.get(PODS, "ns/web-1")
    full = whole.get(PODS, "ns/web-1")
    assert slim is not None
    assert full is not None
    assert engine_pod(slim) == engine_pod(full)
    # not a model: what policy reads (its uid, annotations, addresses are not held)
    assert isinstance(slim, RemotePod)
    assert not isinstance(full, RemotePod)
    assert full.metadata.uid == "u1"
    assert slim.named_ports() == [("http", "TCP", 8080), ("dns", "UDP", 53)]
    # this node's: whole
    mine = {**data, "spec": {**data["spec"], "nodeName": "me"}}
    cache.apply(SyncEvent("put", "pod", "ns/web-1", Doc(mine, 4), None))
    own = cache.get(PODS, "ns/web-1")
    assert own is not None
    assert not isinstance(own, RemotePod)
    assert own.metadata.uid == "u1"
    assert own.addresses() == ["10.0.0.5"]


def test_another_nodes_endpoint_is_held_as_what_policy_reads() -> None:
    from datastore.base import SyncEvent
    from policy.inputs import endpoint as engine_endpoint
    from resources.index import Index

    doc = _wep("web-1", "other", 3)
    doc.data["metadata"]["labels"] = {"app": "web", "tier": "front"}
    whole = Index((ENDPOINTS,))
    whole.put("workloadendpoint", "ns/other-k8s-web-1-eth0", doc)
    cache = Cache("me")
    cache.apply(
        SyncEvent("snapshot", "", "", None, {"workloadendpoint": {"ns/other-k8s-web-1-eth0": doc}})
    )
    slim = cache.get(ENDPOINTS, "ns/other-k8s-web-1-eth0")
    full = whole.get(ENDPOINTS, "ns/other-k8s-web-1-eth0")
    assert isinstance(slim, RemoteEndpoint)
    assert full is not None
    assert not isinstance(full, RemoteEndpoint)
    assert engine_endpoint(slim) == engine_endpoint(full)
    assert pod_key(slim) == pod_key(full) == "ns/web-1"
    # the engine's input shares the record's values (one copy of them per endpoint)
    converted = engine_endpoint(slim)
    assert converted.labels is slim.labels
    assert converted.addresses is slim.addresses
    # a document the model refuses stays refused (not held as a record either)
    bad = _wep("web-2", "other", 4)
    bad.data["spec"]["ipNetworks"] = ["10.0.0.1/24"]
    cache.apply(SyncEvent("put", "workloadendpoint", "ns/other-k8s-web-2-eth0", bad, None))
    assert cache.has("workloadendpoint", "ns/other-k8s-web-2-eth0")
    assert cache.get(ENDPOINTS, "ns/other-k8s-web-2-eth0") is None
    # this node's: the model, whole
    cache.apply(
        SyncEvent("put", "workloadendpoint", "ns/me-k8s-web-3-eth0", _wep("web-3", "me", 5), None)
    )
    own = cache.get(ENDPOINTS, "ns/me-k8s-web-3-eth0")
    assert own is not None
    assert not isinstance(own, RemoteEndpoint)
    assert own.spec.containerID == "c" * 64


def test_an_undecoded_snapshot_is_decoded_one_document_at_a_time() -> None:
    """etcd's first snapshot hands the documents over as stored: the cache decodes each as
    it takes it (never all at once), and ends with what a decoded snapshot gives."""
    import json

    from datastore.base import SyncEvent, Undecoded
    from datastore.errors import StoreCorrupt

    decoded: list[str] = []

    def decode(key: str, value: bytes) -> dict[str, Any]:
        decoded.append(key)
        data = json.loads(value)
        if not isinstance(data, dict):
            raise StoreCorrupt(key, "not a JSON object")
        return data

    docs = {
        "ns/mine": _pod("mine", "me", 2),
        "ns/theirs": _pod("theirs", "other", 3),
    }
    stored = {k: (json.dumps(d.data).encode(), d.revision) for k, d in docs.items()}
    stored["ns/bad"] = (b"[]", 4)  # the store decoded it once: only garbage of a race
    undecoded = Undecoded(decode, stored)
    reported = Reported()
    event = reported.snapshot({"pod": undecoded})
    assert reported.docs == {"pod": {"ns/mine": 2, "ns/theirs": 3, "ns/bad": 4}}
    assert decoded == []  # the revisions without decoding
    assert undecoded["ns/mine"] == docs["ns/mine"]  # a read decodes (a fresh copy)
    decoded.clear()
    cache = Cache("me")
    cache.apply(event)
    assert sorted(decoded) == ["ns/bad", "ns/mine", "ns/theirs"]  # each once
    assert len(undecoded) == 0  # consumed
    whole = Cache("me")
    whole.apply(SyncEvent("snapshot", "", "", None, {"pod": dict(docs)}))
    assert cache.of(PODS) == whole.of(PODS)
    assert cache.lookup("pod", "ns/mine") == docs["ns/mine"]
    assert not cache.has("pod", "ns/bad")


def test_freed_memory_goes_back_to_the_system_after_a_snapshot(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After the watch's snapshot (and only then) the C allocator's free pages are given
    back (``malloc_trim``): the bytes the documents were read into stay in the watcher
    thread's arena otherwise (a real node at 1000 nodes / 20k endpoints: 121 -> 115 MB)."""
    import threading

    from datastore.base import Doc, SyncEvent
    from tabby_node import watcher as watcher_mod

    watcher_mod.release_freed_memory()  # runs on this system (glibc) without error
    calls: list[int] = []
    monkeypatch.setattr(watcher_mod, "release_freed_memory", lambda: calls.append(1))
    stop = threading.Event()
    applied: list[str] = []

    class Store:
        def sync(self, kinds: object, stopping: object) -> Iterator[SyncEvent]:
            yield SyncEvent("snapshot", "", "", None, {})
            yield SyncEvent("put", "node", "n", Doc({}, 2), None)
            yield SyncEvent("delete", "node", "n", None, None)
            stop.set()

    class Cache:
        def apply(self, event: SyncEvent) -> None:
            applied.append(event.type)

    watcher = watcher_mod.Watcher(
        Store(),  # type: ignore[arg-type]
        Cache(),  # type: ignore[arg-type]
        stopping=stop,
        beats={},
    )
    watcher.run()
    assert applied == ["snapshot", "put", "delete"]
    assert calls == [1]
