"""What tabby-node knows for the calls it serves (``tabby_node.knowledge``): watched
documents from its cache once synced, the rest from what it read or wrote (bounded)."""

from __future__ import annotations

from datastore.base import Doc, SyncEvent
from datastore.cached import UNKNOWN
from tabby_node.cache import Cache
from tabby_node.knowledge import Knowledge


def test_watched_documents_come_from_the_cache_once_it_is_synced() -> None:
    cache = Cache()
    known = Knowledge(cache)
    assert known.lookup("block", "10.0.0.0/26") is UNKNOWN  # no snapshot yet
    block = Doc({"cidr": "10.0.0.0/26"}, 5)
    cache.apply(SyncEvent("snapshot", "", "", None, {"block": {"10.0.0.0/26": block}}))
    assert known.lookup("block", "10.0.0.0/26") == block
    assert known.lookup("block", "10.0.0.64/26") is None  # the watch says: absent
    assert known.lookup("handle", "net:c:eth0") is UNKNOWN  # not watched, not seen


def test_what_it_writes_reaches_the_cache_and_wakes_the_dataplane() -> None:
    cache = Cache()
    cache.apply(SyncEvent("snapshot", "", "", None, {}))
    cache.changed.clear()
    known = Knowledge(cache)
    known.learn("block", "10.0.0.0/26", Doc({"v": 1}, 9))
    assert known.lookup("block", "10.0.0.0/26") == Doc({"v": 1}, 9)
    assert cache.changed.is_set()  # the watch's own event for it will change nothing
    cache.apply(SyncEvent("put", "block", "10.0.0.0/26", Doc({"v": 0}, 8), None))  # late
    assert known.lookup("block", "10.0.0.0/26") == Doc({"v": 1}, 9)


def test_other_documents_are_remembered_within_a_bound_and_forgotten_when_stale() -> None:
    known = Knowledge(Cache(), limit=3)
    for i in range(4):
        known.learn("handle", f"h{i}", Doc({"i": i}, i + 1))
    assert known.lookup("handle", "h0") is UNKNOWN  # the oldest went
    assert known.lookup("handle", "h3") == Doc({"i": 3}, 4)
    known.learn("handle", "h1", None)  # known absent (released)
    assert known.lookup("handle", "h1") is None
    known.forget("handle", "h3")
    assert known.lookup("handle", "h3") is UNKNOWN
