"""``tabbyctl datastore migrate --to kubernetes``: a running etcd-mode cluster's state into
the Kubernetes API (the in-memory API server), run again after an interruption, ``--abort``,
and what is refused in one line."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator

import pytest
from click.testing import Result

from datastore.base import Store
from datastore.etcd.store import EtcdStore
from ipam.core import AssignRequest, Ipam, NoAddressAvailable, PoolSpec, handle_id
from resources import migrate_kube
from tests.etcd_cluster import EtcdCluster

from .conftest import NET, POOL, Kdd
from .helpers import ok, one_line_error

pytestmark = pytest.mark.etcd


def add(store: Store, node: str, cid: str) -> str:
    attrs = {"node": node, "pod_namespace": "x", "pod_name": cid, "time": time.time()}
    req = AssignRequest(handle_id(NET, cid, "eth0"), attrs, v4_pools=[POOL])
    return str(Ipam(store, node).assign(req)[0].ip)


class Source:
    """An etcd-mode cluster's datastore, and tabbyctl's flags naming it."""

    def __init__(self, etcd: EtcdCluster, kdd: Kdd) -> None:
        self.prefix = f"/test-{uuid.uuid4().hex[:12]}"
        self.store = EtcdStore(
            etcd.endpoints, prefix=self.prefix, lock_timeout=5, lock_dir=str(kdd.tmp / "locks-e")
        )
        self.flags = [
            "--datastore-type",
            "etcdv3",
            "--etcd-endpoints",
            ",".join(etcd.endpoints),
            "--etcd-prefix",
            self.prefix,
        ]
        self.kdd = kdd

    def migrate(self, *extra: str) -> Result:
        return self.kdd.run(
            *self.flags,
            "datastore",
            "migrate",
            "--to",
            "kubernetes",
            "--kubeconfig",
            self.kdd.kubeconfig,
            *extra,
            conf=False,
        )


@pytest.fixture
def source(etcd1: EtcdCluster, kdd: Kdd) -> Iterator[Source]:
    made = Source(etcd1, kdd)
    yield made
    made.store.close()


def test_a_cluster_moves_into_the_api_and_a_second_run_merges_nothing_new(
    kdd: Kdd, source: Source
) -> None:
    Ipam(source.store, "").ensure_pools([PoolSpec(POOL, 26)])
    ips = [add(source.store, "node-a", f"a{i}") for i in range(3)] + [
        add(source.store, "node-b", "b0")
    ]
    out = ok(source.migrate("--settle", "0.2"))
    assert out[0] == (
        f"froze 1 pool(s) in the source ({POOL}): waiting 0.2 s for the ADDs in flight"
    )
    assert "allocations        4" in out
    assert out[-1].startswith(f"copied to Kubernetes API ({kdd.kubeconfig}) in 2 pass(es)")
    assert f"pools open there: {POOL}" in out[-1]
    # kubectl get ippools.tabby.io / ipamblocks.tabby.io: what tabbyctl shows on the API
    (pool,) = kdd.objects("pool").values()
    assert (pool["spec"]["cidr"], pool["spec"]["disabled"]) == (POOL, False)
    blocks = kdd.objects("block").values()
    assert sorted(b["metadata"]["labels"]["tabby.io/node"] for b in blocks) == ["node-a", "node-b"]
    assert sorted(kdd.objects("affinity")) == ["node-a", "node-b"]
    shown = kdd.json("ipam", "show")
    assert sorted(a["ip"] for a in shown["allocations"]) == sorted(ips)
    # etcd hands out nothing any more
    with pytest.raises(NoAddressAvailable):
        add(source.store, "node-a", "late")
    again = ok(source.migrate("--settle", "0.2"))
    assert "allocations        0" in again
    assert not again[0].startswith("froze")


def test_abort_opens_the_source_again_until_a_node_allocated_on_the_api(
    kdd: Kdd, source: Source
) -> None:
    Ipam(source.store, "").ensure_pools([PoolSpec(POOL, 26)])
    add(source.store, "node-a", "a0")
    ok(source.migrate("--settle", "0"))
    out = ok(source.migrate("--abort"))
    assert out == [
        f"pools enabled again in the source: {POOL}; removed from Kubernetes API "
        f"({kdd.kubeconfig}): 1 block(s), 1 index(es)"
    ]
    assert kdd.objects("block") == {}
    assert kdd.objects("pool")[f"ippool-{POOL.replace('.', '-').replace('/', '-')}"]["spec"][
        "disabled"
    ]
    add(source.store, "node-a", "a1")  # etcd serves again
    ok(source.migrate("--settle", "0"))
    add(kdd.store, "node-a", "on-the-api")  # a node switched and allocated there
    line = one_line_error(source.migrate("--abort"))
    assert "1 allocation(s) were made on the Kubernetes datastore already" in line
    assert migrate_kube.marked(source.store.get("pool", POOL).data)  # type: ignore[union-attr]


def test_what_is_refused_in_one_line(kdd: Kdd, source: Source) -> None:
    line = one_line_error(kdd.run("datastore", "migrate", "--to", "kubernetes"), code=1)
    assert line == "Error: the datastore is the Kubernetes API already: nothing to move"
    usage = kdd.run("datastore", "migrate", "--to", "etcdv3", "--abort")
    assert usage.exit_code == 2
    assert "--kubeconfig, --settle and --abort go with --to kubernetes" in usage.stderr
    # the API already runs a cluster of its own
    Ipam(kdd.store, "").ensure_pools([PoolSpec("10.99.0.0/24", 26)])
    req = AssignRequest(handle_id(NET, "z", "eth0"), {"pod_name": "z"}, v4_pools=["10.99.0.0/24"])
    Ipam(kdd.store, "node-z").assign(req)
    Ipam(source.store, "").ensure_pools([PoolSpec(POOL, 26)])
    line = one_line_error(source.migrate())
    assert "the target already holds 1 allocation(s) that no migration copied" in line
