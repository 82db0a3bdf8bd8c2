"""Readiness (STATUS): can_allocate."""

from __future__ import annotations

from typing import Any

from datastore.memory import MemoryStore
from ipam.core import Ipam, PoolSpec

from .helpers import hid, small, sreq

# -- readiness ------------------------------------------------------------------------


def _snapshot(store: MemoryStore) -> dict[str, dict[str, Any]]:
    return {
        kind: {k: store.get(kind, k) for k in store.list_keys(kind)}
        for kind in ("pool", "block", "handle", "affinity")
    }


def test_can_allocate(mem_store: MemoryStore) -> None:
    ipam = Ipam(mem_store, "node-a")
    kw: dict[str, Any] = {
        "need_v4": True,
        "need_v6": False,
        "strict_affinity": True,
        "max_blocks_per_host": 0,
        "reserved": [],
    }
    assert ipam.can_allocate(["10.1.0.0/29"], [], **kw, block_size_v4=30) is None  # fresh: ready
    why = ipam.can_allocate(["10.1.0.0/29"], [], **kw)  # a /26 does not fit: not ready
    assert why is not None
    assert "smaller than one block" in why
    ipam.ensure_pools([PoolSpec("10.1.0.0/29", 30)])
    for i in range(8):
        ipam.assign(sreq(hid(i), strict_affinity=True))
    before = _snapshot(mem_store)
    why = ipam.can_allocate(["10.1.0.0/29"], [], **kw)
    assert why is not None
    assert "no free IPv4 address" in why
    assert _snapshot(mem_store) == before  # read-only
    ipam.release_handle(hid(4))
    assert ipam.can_allocate(["10.1.0.0/29"], [], **kw) is None
    # a reserved free address does not count
    ip = ipam.assign(sreq(hid(4), strict_affinity=True))[0].ip
    ipam.release_ip(ip)
    assert ipam.can_allocate(["10.1.0.0/29"], [], **{**kw, "reserved": [str(ip)]}) is not None
    mem_store.unusable = "disk gone"
    assert "disk gone" in (ipam.can_allocate(["10.1.0.0/29"], [], **kw) or "")


def test_can_allocate_counts_borrowing_and_limits(mem_store: MemoryStore) -> None:
    a = small(mem_store, "node-a")
    b = Ipam(mem_store, "node-b")
    a.assign(sreq(hid("a")))
    for i in range(4):
        b.assign(sreq(hid(f"b{i}")))
    kw: dict[str, Any] = {"need_v4": True, "need_v6": False, "reserved": []}
    assert (
        b.can_allocate(["10.1.0.0/29"], [], strict_affinity=False, max_blocks_per_host=0, **kw)
        is None
    )
    assert b.can_allocate(["10.1.0.0/29"], [], strict_affinity=True, max_blocks_per_host=0, **kw)
    fresh = Ipam(mem_store, "node-c")
    assert fresh.can_allocate(
        ["10.1.0.0/29"], [], strict_affinity=True, max_blocks_per_host=0, **kw
    )
