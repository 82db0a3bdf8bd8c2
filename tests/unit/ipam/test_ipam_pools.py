"""Pool administration."""

from __future__ import annotations

import pytest

from ipam.core import InvalidConfig, Ipam, PoolSpec, check_consistency
from ipam.store.memory import MemoryStore

from .helpers import V4, V6, hid, req, setup

# -- pools ----------------------------------------------------------------------------


def test_ensure_pools_validation(mem_store: MemoryStore) -> None:
    ipam = Ipam(mem_store, "node-a")
    ipam.ensure_pools([PoolSpec("10.0.0.0/16", 26)])
    ipam.ensure_pools([PoolSpec("10.0.0.0/16", 24)])  # exists: stored block size wins
    doc = mem_store.get("pool", "10.0.0.0/16")
    assert doc is not None
    assert doc.data == {
        "cidr": "10.0.0.0/16",
        "block_size": 26,
        "disabled": False,
    }
    with pytest.raises(InvalidConfig, match="overlaps"):
        ipam.ensure_pools([PoolSpec("10.0.128.0/17", 26)])
    with pytest.raises(InvalidConfig, match="overlap"):
        ipam.ensure_pools([PoolSpec("10.9.0.0/16"), PoolSpec("10.9.0.0/24")])
    with pytest.raises(InvalidConfig, match="smaller than one block"):
        ipam.ensure_pools([PoolSpec("10.8.0.0/28", 26)])
    with pytest.raises(InvalidConfig, match="block size"):
        ipam.ensure_pools([PoolSpec("fd00::/48", 64)])
    assert mem_store.list_keys("pool") == ["10.0.0.0/16"]


def test_pool_admin(mem_store: MemoryStore) -> None:
    ipam = setup(mem_store)
    ipam.add_pool(PoolSpec("10.6.0.0/24", 28))
    with pytest.raises(InvalidConfig):
        ipam.add_pool(PoolSpec("10.6.0.0/25", 28))
    a = ipam.assign(req(hid(1), v4_pools=["10.6.0.0/24"]))[0]
    with pytest.raises(InvalidConfig, match="in use"):
        ipam.delete_pool("10.6.0.0/24")
    ipam.release_handle(hid(1))
    assert ipam.delete_pool("10.6.0.0/24") == 1
    assert [p.cidr for p in ipam.list_pools()] == [V4, V6]
    assert str(a.block_cidr) not in mem_store.list_keys("block")
    assert check_consistency(mem_store) == []
