"""Pool administration."""

from __future__ import annotations

import pytest

from datastore.memory import MemoryStore
from ipam.core import InvalidConfig, Ipam, PoolSpec, check_consistency
from ipam.core.model import Pool

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


# -- the IPPool resource's own fields ride along ------------------------------------------

IPPOOL_FIELDS = {
    "name": "default-ipv4-ippool",
    "ipip_mode": "CrossSubnet",
    "vxlan_mode": "Never",
    "nat_outgoing": True,
    "node_selector": "all()",
    "labels": {"tier": "a"},
}


def test_pool_document_keeps_keys_it_does_not_know() -> None:
    data = {"cidr": "10.8.0.0/16", "block_size": 26, "disabled": False, **IPPOOL_FIELDS}
    pool = Pool.from_data(dict(data), "here")
    assert pool.extra == IPPOOL_FIELDS
    assert pool.to_data() == data
    pool.disabled = True
    assert pool.to_data() == {**data, "disabled": True}
    # a document without "disabled" reads as enabled and is written with it
    bare = Pool.from_data({"cidr": "10.8.0.0/16", "block_size": 26, "name": "x"}, "here")
    assert bare.to_data() == {
        "cidr": "10.8.0.0/16",
        "block_size": 26,
        "disabled": False,
        "name": "x",
    }


def put_resource_pool(store: MemoryStore, cidr: str, size: int) -> None:
    store.put("pool", cidr, {"cidr": cidr, "block_size": size, **IPPOOL_FIELDS}, None)


def test_every_rewrite_of_a_pool_keeps_its_other_keys(mem_store: MemoryStore) -> None:
    put_resource_pool(mem_store, V4, 28)
    ipam = Ipam(mem_store, "node-a")
    ipam.ensure_pools([PoolSpec(V4, 26)])  # exists: untouched (stored block size wins)
    ipam.set_pool_disabled(V4, True)
    ipam.set_pool_disabled(V4, True)  # no change, no write
    doc = mem_store.get("pool", V4)
    assert doc is not None
    assert doc.data == {"cidr": V4, "block_size": 28, "disabled": True, **IPPOOL_FIELDS}
    ipam.set_pool_disabled(V4, False)
    doc = mem_store.get("pool", V4)
    assert doc is not None
    assert doc.data == {"cidr": V4, "block_size": 28, "disabled": False, **IPPOOL_FIELDS}
    (pool,) = ipam.list_pools()
    assert pool.extra == IPPOOL_FIELDS
    # a delete that fails (in use) leaves it whole
    ipam.assign(req(hid(1)))
    with pytest.raises(InvalidConfig, match="in use"):
        ipam.delete_pool(V4)
    doc = mem_store.get("pool", V4)
    assert doc is not None
    assert doc.data == {"cidr": V4, "block_size": 28, "disabled": False, **IPPOOL_FIELDS}
    ipam.release_handle(hid(1))
    assert ipam.delete_pool(V4) == 1
    assert mem_store.get("pool", V4) is None


def test_delete_pool_in_use_writes_nothing(mem_store: MemoryStore) -> None:
    """The in-use check comes first and only reads: the pool, enabled or disabled, keeps
    its revision (the racing case, an address landing after the check, is in
    test_cluster.py)."""
    put_resource_pool(mem_store, V4, 28)
    ipam = Ipam(mem_store, "node-a")
    ipam.assign(req(hid(1)))
    for disabled in (False, True):
        ipam.set_pool_disabled(V4, disabled)
        before = mem_store.get("pool", V4)
        with pytest.raises(InvalidConfig, match="in use"):
            ipam.delete_pool(V4)
        assert mem_store.get("pool", V4) == before
