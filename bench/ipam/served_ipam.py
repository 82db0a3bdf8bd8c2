#!/usr/bin/env python3
"""Benchmark (not a test): the IPAM of the CNI calls tabby-node serves, in-process, as
tabby-node runs it: its long-lived store read through its watch (``tabby_node.cache``,
``tabby_node.knowledge``, ``stores.Served``), tabby-ipam's verbs with the node's group commit
(``ipam.group``). No netlink, no socket, no client: only the IPAM part of a served ADD/DEL.

Per datastore (a file store in a temp dir; etcd, 1 member on 127.0.0.1 with free ports):
store requests (get/list/put/delete, from the store's own counters) and the node's lock taken
per ADD and per DEL, CPU ms per call (the process's, sequential), then ``-k`` ADDs at once
(threads, as tabby-node serves them): the writes per ADD and the rate. Then the
WorkloadEndpoints those ADDs record, ``-k`` at once, each in a lock session of its own and
batched as tabby-node writes them (``EndpointGroup``), interleaved over 3 rounds: writes/s.

    .venv/bin/python -m bench.ipam.served_ipam -n 200 -k 8,32

The counts are the point (they do not depend on the machine's load): an ADD or DEL answered
from memory reads nothing (``get``/``list`` appear once per block claimed: 1/64 of the ADDs
with /26 blocks), takes the node's lock once and writes its block once; k ADDs at once share
the lock and the write (``batches``: how many writes served them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial
from typing import Any

from bench import record
from bench.stats import pct
from cni_config.common import DatastoreSettings
from cni_plugin.plugin import EndpointGroup, locked
from cni_protocol import skel
from datastore.base import Store
from ipam.group import GroupCommit
from ipam.plugin import IpamVerbs
from resources.wep import write_endpoint
from stores import Served, open_store
from tabby_node.cache import Cache
from tabby_node.knowledge import Knowledge
from tabby_node.watcher import Watcher

NODE = "bench-node"
POOL = "10.252.0.0/16"


class Node:
    """A served store as tabby-node holds it: the store, its watch into the cache, the
    knowledge, the verbs with the group commit."""

    def __init__(self, ipam: dict[str, Any]) -> None:
        self.ipam = ipam
        self.settings = settings = DatastoreSettings.model_validate(ipam)
        self.store: Store = open_store(settings)
        self.locks = 0
        lock = self.store.lock

        def counted_lock() -> Any:
            self.locks += 1
            return lock()

        self.store.lock = counted_lock  # type: ignore[method-assign]
        self.cache = Cache(NODE)
        self.stopping = threading.Event()
        watcher = Watcher(self.store, self.cache, stopping=self.stopping, beats={})
        self.thread = threading.Thread(target=watcher.run, daemon=True)
        self.thread.start()
        self.served = Served(settings, self.store, Knowledge(self.cache))
        self.group = GroupCommit(self.served)
        self.handlers = IpamVerbs(self.served, self.group).handlers()
        if not self.cache.synced.wait(30):
            raise RuntimeError("the watch gave no snapshot in 30 s")

    def call(self, command: str, cid: str) -> str:
        conf = {
            "cniVersion": "1.1.0",
            "name": "bench",
            "type": "tabby",
            "nodename": NODE,
            "log_file_path": "/dev/null",
            "ipam": {"type": "tabby-ipam", "ipv4_pools": [POOL], **self.ipam},
        }
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": "/run/netns/x",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"K8S_POD_NAMESPACE=bench;K8S_POD_NAME=pod-{cid}",
        }
        rc, out = skel.run(self.handlers, env, json.dumps(conf).encode())
        if rc != 0:
            raise RuntimeError(f"{command} {cid}: {out!r}")
        return out.decode()

    def counters(self) -> dict[str, int]:
        out: dict[str, int] = {"lock": self.locks}
        for (op, kind), n in self.store.requests.items():  # type: ignore[attr-defined]
            out[f"{op} {kind}"] = n
        return out

    def stop_watch(self) -> None:
        """The watch stops delivering (what it told the cache stays): the view goes stale."""
        self.stopping.set()
        self.thread.join(10)

    def close(self) -> None:
        self.stop_watch()
        self.store.close()


def delta(after: dict[str, int], before: dict[str, int], per: int) -> dict[str, float]:
    return {
        k: (after[k] - before.get(k, 0)) / per for k in sorted(after) if after[k] != before.get(k)
    }


@contextmanager
def datastore(name: str) -> Iterator[dict[str, Any]]:
    workdir = tempfile.mkdtemp(prefix=f"tabby-served-ipam-{os.getpid()}-")
    try:
        if name == "file":
            yield {"datastore_type": "file", "data_dir": os.path.join(workdir, "store")}
            return
        from tests.etcd_cluster import EtcdCluster

        with EtcdCluster(1) as cluster:
            yield {
                "datastore_type": "etcdv3",
                "etcd_endpoints": cluster.endpoints,
                "etcd_prefix": f"/served-{os.getpid()}",
            }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def cpu_ms(fn: Callable[[], object]) -> float:
    t = time.process_time()
    fn()
    return (time.process_time() - t) * 1000


def endpoint_writes(node: Node, pods: int, k: int, grouped: bool, tag: str) -> dict[str, float]:
    """``pods`` WorkloadEndpoints written by ``k`` threads at once through the node's served
    store, as tabby-node's ADDs record them: each in a lock session of its own, or
    (``grouped``) batched (``EndpointGroup``: one session and, on the file store, one
    directory fsync per batch). Writes/s, CPU and lock sessions per write."""
    group = EndpointGroup(node.served) if grouped else None
    ops = [
        partial(
            write_endpoint,
            namespace="bench",
            node=NODE,
            pod=f"{tag}-{i}",
            container_id=f"{tag}-{i}",
            interface="eth0",
            host_interface=f"cali{i}",
            ip_networks=[f"10.252.{i // 250}.{i % 250}/32"],
        )
        for i in range(pods)
    ]
    it = iter(ops)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                op = next(it, None)
            if op is None:
                return
            if group is not None:
                group.run(node.settings, op)
            else:
                node.served.run(node.settings, locked(op))

    locks, t0, cpu0 = node.locks, time.monotonic(), time.process_time()
    threads = [threading.Thread(target=worker) for _ in range(k)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall, cpu = time.monotonic() - t0, time.process_time() - cpu0
    return {
        "writes_per_s": pods / wall,
        "cpu_ms_per_write": cpu * 1000 / pods,
        "locks_per_write": (node.locks - locks) / pods,
    }


def run_store(name: str, pods: int, ks: list[int], rounds: int = 3) -> dict[str, Any]:
    with datastore(name) as ipam:
        node = Node(ipam)
        try:
            for i in range(3):  # warm: the pool, the first block, the node's index
                node.call("ADD", f"warm{i}")
            out: dict[str, Any] = {"store": name}
            before = node.counters()
            adds = [cpu_ms(partial(node.call, "ADD", f"s{i}")) for i in range(pods)]
            mid = node.counters()
            dels = [cpu_ms(partial(node.call, "DEL", f"s{i}")) for i in range(pods)]
            after = node.counters()
            out["add_requests"] = delta(mid, before, pods)
            out["del_requests"] = delta(after, mid, pods)
            out["add_cpu_ms_p50"] = pct(adds, 50)
            out["del_cpu_ms_p50"] = pct(dels, 50)
            for k in ks:
                cids = [f"k{k}-{i}" for i in range(pods)]
                before = node.counters()
                batches = node.group.batches
                t0 = time.monotonic()
                cpu0 = time.process_time()
                it = iter(cids)
                lock = threading.Lock()
                failures: list[str] = []

                def worker() -> None:
                    while True:
                        with lock:  # noqa: B023
                            cid = next(it, None)  # noqa: B023
                        if cid is None:
                            return
                        try:
                            node.call("ADD", cid)
                        except RuntimeError as e:
                            failures.append(str(e))  # noqa: B023

                threads = [threading.Thread(target=worker) for _ in range(k)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join()
                wall = time.monotonic() - t0
                cpu = time.process_time() - cpu0
                after = node.counters()
                out[f"k{k}"] = {
                    "adds_per_s": pods / wall,
                    "cpu_ms_per_add": cpu * 1000 / pods,
                    "requests_per_add": delta(after, before, pods),
                    "batches": node.group.batches - batches,
                    "failures": failures[:3],
                }
                for cid in cids:
                    node.call("DEL", cid)
            for k in ks:  # one by one and batched, interleaved round by round
                runs: dict[str, list[dict[str, float]]] = {"alone": [], "batched": []}
                for r in range(rounds):
                    for how in runs:
                        tag = f"ep{k}-{r}-{how}"
                        runs[how].append(endpoint_writes(node, pods, k, how == "batched", tag))
                out[f"endpoints_k{k}"] = {
                    how: {m: pct([x[m] for x in got], 50) for m in got[0]}
                    | {"writes_per_s_runs": [x["writes_per_s"] for x in got]}
                    for how, got in runs.items()
                }
            return out
        finally:
            node.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", "--pods", type=int, default=100)
    ap.add_argument("-k", default="8,32", help="concurrent ADDs, comma-separated")
    ap.add_argument("--stores", default="file,etcd")
    ap.add_argument("--json", metavar="FILE")
    record.add_argument(ap, "served_ipam")
    args = ap.parse_args()
    ks = [int(k) for k in args.k.split(",") if k]
    results = []
    print(f"served IPAM, in-process: {args.pods} pods; load {os.getloadavg()[0]:.2f}")
    for name in args.stores.split(","):
        r = run_store(name, args.pods, ks)
        results.append(r)
        print(f"-- {name}")
        print(f"  ADD: cpu p50 {r['add_cpu_ms_p50']:.2f} ms; per ADD {r['add_requests']}")
        print(f"  DEL: cpu p50 {r['del_cpu_ms_p50']:.2f} ms; per DEL {r['del_requests']}")
        for k in ks:
            c = r[f"k{k}"]
            print(
                f"  {k:3} at once: {c['adds_per_s']:.0f} ADDs/s, cpu {c['cpu_ms_per_add']:.2f} "
                f"ms/ADD, {c['batches']} batches; per ADD {c['requests_per_add']}"
                + (f"; FAILED {c['failures']}" if c["failures"] else "")
            )
        for k in ks:
            for how, e in r[f"endpoints_k{k}"].items():
                print(
                    f"  {k:3} endpoints at once, {how:7}: {e['writes_per_s']:.0f} writes/s "
                    f"(median of {', '.join(f'{x:.0f}' for x in e['writes_per_s_runs'])}), "
                    f"cpu {e['cpu_ms_per_write']:.2f} ms/write, "
                    f"{e['locks_per_write']:.2f} lock sessions/write"
                )
    print(f"load {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "served_ipam"))
