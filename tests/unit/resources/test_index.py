"""The typed mirror of the datastore (``resources.index``): each document parsed once per
revision, through a fresh snapshot too; invalid documents left out of the typed view (and
logged once), kept raw; an older revision never replaces a newer one."""

from __future__ import annotations

import ipaddress
import logging

import pytest

from datastore.base import Doc, SyncEvent
from datastore.memory import MemoryStore
from ipam.core.block import Block
from resources.heartbeat import Heartbeat
from resources.index import (
    ALL,
    BLOCKS,
    HEARTBEATS,
    NODES,
    POLICIES,
    POOLS,
    Documents,
    Index,
)
from resources.k8s import NetworkPolicy
from resources.tabby import IPPool, Node


def node(name: str, ip: str = "10.0.0.1/24") -> dict[str, object]:
    return {"metadata": {"name": name}, "spec": {"ipv4Address": ip}}


def policy(name: str) -> dict[str, object]:
    return {"metadata": {"name": name, "namespace": "x"}, "spec": {"podSelector": {}}}


def put(kind: str, key: str, data: dict[str, object], rev: int) -> SyncEvent:
    return SyncEvent("put", kind, key, Doc(data, rev), None)


def test_documents_are_typed_and_parsed_once_per_revision() -> None:
    index = Index(ALL)
    assert index.apply(put("node", "a", node("a"), 1))
    assert index.apply(put("node", "a", node("a"), 1)) is False  # same revision: nothing
    assert index.apply(put("networkpolicy", "x/p", policy("p"), 2))
    docs = index.snapshot()
    a = docs.of(NODES)["a"]
    assert isinstance(a.value, Node)
    assert a.value.spec.ipv4Address == "10.0.0.1/24"
    assert a.revision == 1
    assert isinstance(docs.get(POLICIES, "x/p"), NetworkPolicy)
    assert docs.get(POLICIES, "x/p").spec.policyTypes == ["Ingress"]  # type: ignore[union-attr]
    assert index.parsed == 2
    index.apply(put("node", "a", node("a", "10.0.0.2/24"), 3))
    assert index.parsed == 3
    assert index.get(NODES, "a").spec.ipv4Address == "10.0.0.2/24"  # type: ignore[union-attr]


def test_a_snapshot_keeps_what_it_parsed_before() -> None:
    index = Index(ALL)
    index.apply(put("node", "a", node("a"), 1))
    index.apply(put("node", "b", node("b", "10.0.0.2/24"), 2))
    before = index.snapshot().of(NODES)["a"].value
    snapshot = {"node": {"a": Doc(node("a"), 1), "c": Doc(node("c", "10.0.0.3/24"), 4)}}
    assert index.apply(SyncEvent("snapshot", "", "", None, snapshot))
    docs = index.snapshot()
    assert docs.of(NODES)["a"].value is before  # the same revision is not parsed again
    assert sorted(docs.of(NODES)) == ["a", "c"]  # b is gone
    assert index.parsed == 3


def test_an_invalid_document_is_left_out_logged_once_and_kept_raw(
    caplog: pytest.LogCaptureFixture,
) -> None:
    index = Index(ALL)
    bad = {"metadata": {"name": "p", "namespace": "x"}, "spec": {"podSelector": 7}}
    with caplog.at_level(logging.WARNING):
        index.apply(put("networkpolicy", "x/p", bad, 5))
        index.apply(SyncEvent("snapshot", "", "", None, {"networkpolicy": {"x/p": Doc(bad, 5)}}))
    assert "x/p" not in index.snapshot().of(POLICIES)
    assert index.snapshot().raw("networkpolicy")["x/p"].revision == 5
    assert sum("skipping NetworkPolicy x/p" in r.getMessage() for r in caplog.records) == 1
    index.apply(put("networkpolicy", "x/p", policy("p"), 6))  # repaired
    assert "x/p" in index.snapshot().of(POLICIES)


def test_an_older_revision_never_replaces_a_newer_one() -> None:
    index = Index(ALL)
    index.put("node", "a", Doc(node("a", "10.0.0.9/24"), 7))  # what this node just wrote
    assert index.put("node", "a", Doc(node("a"), 6)) is False  # the watch, late
    assert index.get(NODES, "a").spec.ipv4Address == "10.0.0.9/24"  # type: ignore[union-attr]
    assert index.delete("node", "a")
    assert index.get(NODES, "a") is None
    assert index.delete("node", "a") is False


def test_kinds_outside_the_index_are_ignored() -> None:
    index = Index((NODES,))
    assert index.apply(put("networkpolicy", "x/p", policy("p"), 1)) is False
    assert index.snapshot().of(POLICIES) == {}


def test_read_from_a_store_parses_every_kind_asked_for() -> None:
    store = MemoryStore()
    store.put("pool", "10.244.0.0/16", {"cidr": "10.244.0.0/16", "block_size": 26}, None)
    block = Block.new(ipaddress.ip_network("10.244.0.0/26"), "10.244.0.0/16", "a")
    store.put("block", "10.244.0.0/26", block.to_data(), None)
    store.put("heartbeat", "a", Heartbeat("a", 1.0, 7).to_data(), None)
    docs = Documents.read(store, (POOLS, BLOCKS, HEARTBEATS))
    pool = docs.get(POOLS, "10.244.0.0/16")
    assert isinstance(pool, IPPool)
    assert pool.spec.block_size == 26
    assert pool.metadata.name == "ippool-10-244-0-0-16"
    got = docs.get(BLOCKS, "10.244.0.0/26")
    assert isinstance(got, Block)
    assert got.node == "a"
    assert docs.get(HEARTBEATS, "a") == Heartbeat("a", 1.0, 7)


def test_drain_journals_each_changed_document_once_with_its_value_now() -> None:
    index = Index(ALL)
    assert index.drain() == []
    index.apply(put("node", "a", node("a"), 1))
    index.apply(put("node", "b", node("b", "10.0.0.2/24"), 2))
    index.apply(put("node", "a", node("a", "10.0.0.3/24"), 3))
    index.apply(put("node", "b", node("b", "10.0.0.2/24"), 2))  # same revision: no change
    changes = index.drain()
    assert [(c.kind, c.key) for c in changes] == [("node", "a"), ("node", "b")]
    assert changes[0].value is index.get(NODES, "a")
    assert index.drain() == []
    index.delete("node", "b")
    index.delete("node", "zz")  # nothing held: nothing journalled
    assert [(c.key, c.value) for c in index.drain()] == [("b", None)]


def test_a_fresh_snapshot_journals_only_what_differs() -> None:
    index = Index(ALL)
    index.apply(put("node", "a", node("a"), 1))
    index.apply(put("node", "b", node("b", "10.0.0.2/24"), 2))
    index.apply(put("networkpolicy", "x/p", policy("p"), 3))
    index.drain()
    raw = index.snapshot().raw_kinds()
    snapshot = {k: dict(v) for k, v in raw.items()}
    del snapshot["node"]["b"]  # deleted while the watch was down
    snapshot["node"]["c"] = Doc(node("c", "10.0.0.4/24"), 9)  # created meanwhile
    index.apply(SyncEvent("snapshot", "", "", None, snapshot))
    assert sorted((c.key, c.value is None) for c in index.drain()) == [("b", True), ("c", False)]
    bad = policy("p")
    bad["metadata"] = "not a map"
    snapshot["networkpolicy"]["x/p"] = Doc(bad, 10)  # now unparsable: gone for consumers
    index.apply(SyncEvent("snapshot", "", "", None, snapshot))
    assert [(c.key, c.value) for c in index.drain()] == [("x/p", None)]
