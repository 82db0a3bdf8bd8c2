"""Release by handle and by address, and GC of stale handles."""

from __future__ import annotations

from ipam.core import Ipam, check_consistency
from ipam.store.base import Store
from ipam.store.memory import MemoryStore

from .conftest import Clock
from .helpers import hid, in_use, req, setup

# -- release ---------------------------------------------------------------------------


def test_release_is_idempotent(store: Store) -> None:
    ipam = setup(store)
    got = ipam.assign(req(hid(1), want_v6=True))
    assert ipam.release_handle(hid(1)) == got
    assert ipam.release_handle(hid(1)) == []
    assert ipam.release_handle(hid(99)) == []
    assert ipam.get_handle(hid(1)) == []
    assert in_use(ipam) == 0
    assert store.list_keys("handle") == []


def test_release_ip_with_sequence_number(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    a, b = ipam.assign(req(hid(1), want_v6=True))
    assert not ipam.release_ip(a.ip, expected_seq=a.seq + 1)  # stale release: refused
    assert ipam.who_owns(a.ip) is not None
    assert ipam.release_ip(str(a.ip), expected_seq=a.seq)
    assert not ipam.release_ip(a.ip)
    assert not ipam.release_ip("192.168.1.1")  # outside every pool
    assert ipam.get_handle(hid(1)) == [b]
    assert ipam.release_ip(b.ip)
    assert mem_store.list_keys("handle") == []  # last address gone: handle gone
    assert check_consistency(mem_store) == []


# -- GC -------------------------------------------------------------------------------


def test_gc_keeps_exactly_the_valid_ones(store: Store, clock: Clock) -> None:
    ipam = setup(store, clock=clock)
    for n in ("a", "b", "c"):
        ipam.assign(req(hid(n)))
    ipam.assign(req(hid("d", net="other")))
    clock.now += 100
    report = ipam.gc("net", {("ca", "eth0"), ("zz", "eth0")}, grace_seconds=10)
    assert sorted(report.released) == [hid("b"), hid("c")]
    assert report.kept == [hid("a")]
    assert report.errors == []
    assert store.list_keys("handle") == sorted([hid("a"), hid("d", net="other")])
    assert in_use(ipam) == 2
    # an empty valid list means everything of this network is stale
    assert ipam.gc("net", set(), grace_seconds=0).released == [hid("a")]
    assert store.list_keys("handle") == [hid("d", net="other")]
    assert check_consistency(store) == []


def test_gc_grace_period(mem_store: MemoryStore, clock: Clock) -> None:
    ipam = setup(mem_store, clock=clock)
    ipam.assign(req(hid("old")))
    clock.now += 60
    ipam.assign(req(hid("new")))
    clock.now += 1
    report = ipam.gc("net", set(), grace_seconds=30)
    assert report.released == [hid("old")]
    assert report.skipped_recent == [hid("new")]


def test_gc_goes_on_after_errors(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    for n in range(3):
        ipam.assign(req(hid(n)))
    mem_store.corrupt("handle", hid(1))
    report = ipam.gc("net", set(), grace_seconds=0)
    assert sorted(report.released) == [hid(0), hid(2)]
    assert len(report.errors) == 1
    assert hid(1) in report.errors[0]


def test_gc_leaves_other_nodes_handles(mem_store: MemoryStore) -> None:
    setup(mem_store, "node-a").assign(req(hid("a")))
    Ipam(mem_store, "node-b").assign(req(hid("b")))
    report = Ipam(mem_store, "node-a").gc("net", set(), grace_seconds=0)
    assert report.released == [hid("a")]
    assert mem_store.list_keys("handle") == [hid("b")]
