"""Benchmark (not a test): the allocator over etcd. Block-claim contention, and ADD/DEL-like
latency against the file store.

1. Claims: 3 "nodes" (an ``Ipam`` and its own ``EtcdStore`` each, so each its own node
   lock) x 8 worker threads assign addresses from one pool of /32 blocks, so every assign
   claims a block (a CAS-create in etcd). Reported: claims/s over the run, and CAS retries
   (``RevisionConflict`` the stores raised, i.e. writes the allocator had to redo: mostly
   two nodes creating the same block). Checked: no address twice. Two pools: a /16 (the
   nodes' claim walks start far apart) and a /24 filled to 240 of 256 blocks (they collide).
2. Latency: one thread, ``assign`` then ``release_handle`` of a fresh handle (what an ADD and
   a DEL do in IPAM), /16 pool of /26 blocks; the stores are interleaved pair by pair (file,
   etcd 1 member, etcd 3 members), so machine noise hits them alike. "cold" builds a new
   store object (new connection) per pair, as a CNI binary that tabby-node does not serve does.

Every etcd runs on 127.0.0.1 with random ports and a private data dir (``tests/etcd_cluster.py``)
and is removed at the end. The file store's data dir is a temp dir (``--dir`` to choose the
disk: fsync costs are the disk's).

    python -m bench.ipam.etcd_claims [--claims 20] [--pairs 300] [--members 1,3] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

from bench import record
from bench.stats import pct
from datastore.base import Store
from datastore.etcd.store import EtcdStore
from datastore.file import FileStore
from ipam.core import AssignRequest, Ipam, PoolSpec, StoreError, handle_id
from tests.etcd_cluster import EtcdCluster

CLAIM_POOL = "10.60.0.0/16"  # 65536 blocks: the nodes' walks start far apart
FILL_POOL = "10.62.0.0/24"  # 256 blocks, 240 claimed: the walks run into each other
LAT_POOL = "10.61.0.0/16"


def etcd_store(cluster: EtcdCluster, prefix: str, lock_dir: str) -> EtcdStore:
    return EtcdStore(cluster.endpoints, prefix=prefix, lock_timeout=30, lock_dir=lock_dir)


def claims(cluster: EtcdCluster, pool: str, per_worker: int, tmp: str) -> dict[str, Any]:
    prefix = f"/bench-{uuid.uuid4().hex[:8]}"
    nodes = [f"node-{i}" for i in range(3)]
    stores = [etcd_store(cluster, prefix, f"{tmp}/locks-{n}") for n in nodes]
    ipams = [Ipam(s, n) for s, n in zip(stores, nodes, strict=True)]
    ipams[0].ensure_pools([PoolSpec(pool, 32)])
    got: list[str] = []
    errors: list[BaseException] = []
    guard = threading.Lock()
    barrier = threading.Barrier(3 * 8 + 1)

    def worker(n: int, w: int) -> None:
        barrier.wait()
        try:
            for k in range(per_worker):
                hid = handle_id("bench", f"{n:02d}{w:02d}{k:06d}".ljust(64, "0"), "eth0")
                (alloc,) = ipams[n].assign(AssignRequest(hid, None, True, False, [pool]))
                with guard:
                    got.append(str(alloc.ip))
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(n, w)) for n in range(3) for w in range(8)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    for s in stores:
        s.close()
    if errors:
        raise errors[0]
    assert len(got) == len(set(got)), "an address handed out twice"
    return {
        "claims": len(got),
        "wall": wall,
        "per_s": len(got) / wall,
        "retries": sum(s.stats["conflicts"] for s in stores),
        "txns": sum(s.stats["txns"] for s in stores),
        "unknown": sum(s.stats["unknown"] for s in stores),
    }


def latency(
    makers: dict[str, Any], pairs: int, warmup: int = 20
) -> dict[str, dict[str, list[float]]]:
    """makers: label -> (store for warm use, factory for a cold store)."""
    out: dict[str, dict[str, list[float]]] = {}
    warm: dict[str, Ipam] = {}
    for label, (store, _) in makers.items():
        warm[label] = Ipam(store, "node-lat")
        warm[label].ensure_pools([PoolSpec(LAT_POOL, 26)])
        out[label] = {"assign": [], "release": [], "cold pair": []}
    for i in range(warmup + pairs):
        for label, (_, factory) in makers.items():
            ipam = warm[label]
            hid = handle_id("bench", f"{i:064x}", "eth0")
            req = AssignRequest(hid, None, True, False, [LAT_POOL])
            t0 = time.perf_counter()
            ipam.assign(req)
            t1 = time.perf_counter()
            ipam.release_handle(hid)
            t2 = time.perf_counter()
            cold_store: Store = factory()
            cold = Ipam(cold_store, "node-lat")
            hid2 = handle_id("bench", f"c{i:063x}", "eth0")
            t3 = time.perf_counter()
            cold.assign(AssignRequest(hid2, None, True, False, [LAT_POOL]))
            cold.release_handle(hid2)
            t4 = time.perf_counter()
            cold_store.close()
            if i >= warmup:
                out[label]["assign"].append((t1 - t0) * 1000)
                out[label]["release"].append((t2 - t1) * 1000)
                out[label]["cold pair"].append((t4 - t3) * 1000)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--claims", type=int, default=20, help="claims per worker (24 workers)")
    ap.add_argument("--pairs", type=int, default=300, help="assign/release pairs per store")
    ap.add_argument("--members", default="1,3")
    ap.add_argument("--dir", help="parent of the file store's temp dir")
    record.add_argument(ap, "etcd_claims")
    args = ap.parse_args()
    sizes = [int(x) for x in args.members.split(",")]
    clusters: dict[int, EtcdCluster] = {}
    try:
        for size in sizes:
            clusters[size] = EtcdCluster(size)
        with tempfile.TemporaryDirectory(prefix="etcd-claims-", dir=args.dir) as tmp:
            print("== block claims: 3 nodes x 8 workers, one pool of /32 blocks ==")
            print(
                f"{'pool':22} {'etcd':>4} {'claims':>6} {'wall s':>7} {'claims/s':>8} "
                f"{'CAS retries':>11}"
            )
            scenarios = [
                (f"{CLAIM_POOL} (sparse)", CLAIM_POOL, args.claims),
                (f"{FILL_POOL} (fill 240)", FILL_POOL, 10),
            ]
            for label, pool, per_worker in scenarios:
                for size, cluster in clusters.items():
                    r = claims(cluster, pool, per_worker, tmp)
                    print(
                        f"{label:22} {size:>3}m {r['claims']:>6} {r['wall']:7.2f} "
                        f"{r['per_s']:8.0f} {r['retries']:>11}   "
                        f"({r['txns']} txns, {r['unknown']} unknown outcomes)"
                    )
            file_dir = f"{tmp}/file-store"
            makers: dict[str, Any] = {
                "file": (
                    FileStore(file_dir, lock_timeout=30),
                    lambda: FileStore(file_dir, lock_timeout=30),
                )
            }
            for size, cluster in clusters.items():
                prefix = f"/lat-{uuid.uuid4().hex[:8]}"
                lock_dir = f"{tmp}/locks-lat-{size}"

                def factory(c: EtcdCluster = cluster, p: str = prefix, d: str = lock_dir) -> Store:
                    return etcd_store(c, p, d)

                makers[f"etcd {size}m"] = (factory(), factory)
            res = latency(makers, args.pairs)
            print()
            print(
                f"== ADD/DEL-like IPAM latency, ms ({args.pairs} pairs per store, interleaved) =="
            )
            print(f"{'store':10} {'op':10} {'p50':>6} {'p90':>6} {'p99':>6}")
            for label, ops in res.items():
                for op, values in ops.items():
                    print(
                        f"{label:10} {op:10} {pct(values, 50):6.2f} {pct(values, 90):6.2f} "
                        f"{pct(values, 99):6.2f}"
                    )
            for store, _ in makers.values():
                store.close()
    except StoreError as e:
        print(f"store failure: {e}", file=sys.stderr)
        return 1
    finally:
        for cluster in clusters.values():
            cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "etcd_claims"))
