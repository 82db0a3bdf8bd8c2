#!/usr/bin/env python3
"""tabby-node's routing work per watch event: incremental (per changed document) against
the whole recompute it replaced, as the cluster grows.

    python3 -m bench.routing.routing_bench [--nodes 100,300,1000] [--pods 20] [--runs 60]
                                   [--backend vxlan,bird] [--kernel] [--json]

A synthetic cluster as tabby's writers leave it in the datastore: ``--nodes`` nodes alive
(Node with underlay address, VXLAN tunnel address and MAC, heartbeat), one pool, per node
one /26 block holding its tunnel address and ``--pods`` pods. The view is one node's (the
first). Events, each a document the watch delivers, parsed into ``resources.index`` first
(the parse is the same for both paths and shown on its own):

* remote pod: a pod starts (or stops) on another node, in that node's block: the common
  event (Kubernetes' steady state is 20 a second);
* remote block: another node claims a new block (then releases it);
* borrowed: a node takes one address of another node's block (then gives it back);
* node join: a Node and its heartbeat appear (then go).

For each, the CPU of the consumer (``time.thread_time``, p50 and p90 over ``--runs``):

* incremental: ``ClusterIndex.apply`` + ``VxlanTable.update`` (+ ``bird_touched`` and,
  when it says so, ``bird_config`` of ``bird_cluster()`` and its text) -- what
  ``routing.sync`` computes;
* whole: ``Index.snapshot`` + ``Cluster.from_documents`` + ``vxlan_state`` (+
  ``bird_config`` and its text when it changed) -- what every pass did before.

``--kernel`` (root) adds the kernel in a network namespace made here and deleted at the end:
the delta applied (``Reconciler.apply``) against the whole reconcile (``Reconciler.reconcile``
of the whole state: dumps of tabby's routes, neighbours and FDB entries, then the diff).
Numbers are CPU of this machine, noisy: compare columns of one run, not runs.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from bench import record
from bench.stats import pct
from datastore.base import Doc
from resources.index import ROUTING, Index
from tabby_node.cluster import Cluster, Underlay, vxlan_state
from tabby_node.cluster_index import ClusterIndex
from tabby_node.routing import bird_config, bird_touched
from tabby_node.vxlan_table import VxlanTable

T = TypeVar("T")
POOL = "10.0.0.0/8"
ME = "node-0000"
EVENTS = ("remote pod", "remote block", "borrowed", "node join")


def name_of(i: int) -> str:
    return f"node-{i:04d}"


def underlay_of(i: int) -> str:
    return f"172.16.{i // 250}.{i % 250 + 1}"


def block_of(i: int) -> str:
    """Node ``i``'s block; blocks from 2**16 on are the ones claimed by the events."""
    return f"10.{i // 1024}.{(i // 4) % 256}.{(i % 4) * 64}/26"


def mac_of(i: int) -> str:
    return f"02:00:00:{i >> 16 & 0xFF:02x}:{i >> 8 & 0xFF:02x}:{i & 0xFF:02x}"


class Datastore:
    """The documents of a synthetic cluster, written with increasing revisions."""

    def __init__(self, nodes: int, pods: int, backend: str) -> None:
        self.rev = 0
        self.docs: dict[str, dict[str, Doc]] = {k.name: {} for k in ROUTING}
        pool: dict[str, Any] = {"cidr": POOL, "block_size": 26, "disabled": False, "name": "pods"}
        if backend == "vxlan":
            pool["vxlan_mode"] = "Always"
        self.put("pool", POOL, pool)
        self.pods = pods
        for i in range(nodes):
            self.node(i, backend)
            self.put("heartbeat", name_of(i), {"node": name_of(i), "time": 1.0e9, "pid": 1})
            self.block(i, i, pods)

    def put(self, kind: str, key: str, data: dict[str, Any]) -> Doc:
        self.rev += 1
        doc = Doc(data, self.rev)
        self.docs[kind][key] = doc
        return doc

    def node(self, i: int, backend: str) -> Doc:
        spec: dict[str, Any] = {"backend": backend, "ipv4Address": f"{underlay_of(i)}/16"}
        if backend == "vxlan":
            first = block_of(i).split("/")[0]
            spec.update(ipv4VXLANTunnelAddr=first, vxlanTunnelMACAddr=mac_of(i))
        return self.put("node", name_of(i), {"metadata": {"name": name_of(i)}, "spec": spec})

    def block(self, owner: int, at: int, pods: int, holders: dict[int, int] | None = None) -> Doc:
        """Block number ``at`` affine to node ``owner`` with ``pods`` allocations (the
        first its tunnel address); ``holders``: ordinal -> node holding it instead."""
        allocations: list[dict[str, Any] | None] = [None] * 64
        for ordinal in range(min(pods + 1, 64)):
            holder = (holders or {}).get(ordinal, owner)
            allocations[ordinal] = {
                "handle": f"k8s-pod-network:c{at}-{ordinal}:eth0",
                "seq": ordinal + 1,
                "attrs": {"node": name_of(holder), "network": "k8s-pod-network"},
            }
        data = {
            "cidr": block_of(at),
            "pool": POOL,
            "affinity": f"host:{name_of(owner)}",
            "seq": 64,
            "allocations": allocations,
            "unallocated": [o for o in range(64) if allocations[o] is None],
            "full": False,
        }
        return self.put("block", block_of(at), data)


class Consumers:
    """The incremental consumer and the whole recompute, side by side on one index."""

    def __init__(self, store: Datastore, backend: str) -> None:
        self.backend = backend
        self.underlay = Underlay(
            ipv4=ipaddress.IPv4Interface(f"{underlay_of(0)}/16"),
            ipv6=None,
            uplink_v4="eth0",
            uplink_v6=None,
            mtu=1500,
        )
        self.index = Index(ROUTING)
        self.index.replace(store.docs)
        self.view = ClusterIndex(ME)
        self.table = VxlanTable(ME, self.underlay, backend)
        touched = self.view.apply(self.index.drain(), self.index.has)
        self.delta = self.table.update(self.view, touched)
        self.bird = bird_config(self.view.bird_cluster(), ME)
        self.bird_text = _render(self.bird)
        self.whole_bird = self.bird
        self.renders = 0

    def incremental(self) -> Any:
        touched = self.view.apply(self.index.drain(), self.index.has)
        delta = self.table.update(self.view, touched)
        if self.backend == "bird" and bird_touched(self.view, touched):
            self.renders += 1
            config = bird_config(self.view.bird_cluster(), ME)
            if config != self.bird:
                self.bird = config
                self.bird_text = _render(config)
        return delta

    def whole(self) -> Any:
        cluster = Cluster.from_documents(self.index.snapshot(), ME)
        state = vxlan_state(cluster, ME, self.underlay, self.backend)
        if self.backend == "bird":
            config = bird_config(cluster, ME)
            if config != self.whole_bird:
                self.whole_bird = config
                _render(config)
        return state


def _render(config: Any) -> str:
    from bird import render

    return render(config) if config is not None else ""


def events(
    store: Datastore, nodes: int
) -> dict[str, list[Callable[[], list[tuple[str, str, Doc | None]]]]]:
    """Per event kind, a pair of writes (there and back again) as the watch delivers them."""
    remote = nodes // 2
    pods = store.pods

    def pod_on() -> list[tuple[str, str, Doc | None]]:
        return [("block", block_of(remote), store.block(remote, remote, pods + 1))]

    def pod_off() -> list[tuple[str, str, Doc | None]]:
        return [("block", block_of(remote), store.block(remote, remote, pods))]

    extra = 1 << 16

    def claim() -> list[tuple[str, str, Doc | None]]:
        return [("block", block_of(extra), store.block(remote, extra, 1))]

    def release() -> list[tuple[str, str, Doc | None]]:
        store.docs["block"].pop(block_of(extra), None)
        return [("block", block_of(extra), None)]

    lender = nodes // 3

    def borrow() -> list[tuple[str, str, Doc | None]]:
        doc = store.block(lender, lender, pods + 1, holders={pods + 1: remote})
        return [("block", block_of(lender), doc)]

    def give_back() -> list[tuple[str, str, Doc | None]]:
        return [("block", block_of(lender), store.block(lender, lender, pods))]

    new = nodes + 7

    def join() -> list[tuple[str, str, Doc | None]]:
        backend = "vxlan" if "vxlan_mode" in store.docs["pool"][POOL].data else "bird"
        hb = store.put("heartbeat", name_of(new), {"node": name_of(new), "time": 1e9, "pid": 1})
        return [("node", name_of(new), store.node(new, backend)), ("heartbeat", name_of(new), hb)]

    def leave() -> list[tuple[str, str, Doc | None]]:
        for kind in ("node", "heartbeat"):
            store.docs[kind].pop(name_of(new), None)
        return [("node", name_of(new), None), ("heartbeat", name_of(new), None)]

    return {
        "remote pod": [pod_on, pod_off],
        "remote block": [claim, release],
        "borrowed": [borrow, give_back],
        "node join": [join, leave],
    }


def cpu(fn: Callable[[], T]) -> tuple[float, T]:
    t0 = time.thread_time()
    out = fn()
    return time.thread_time() - t0, out


def measure(
    nodes: int, pods: int, backend: str, runs: int, kernel: Any = None
) -> dict[str, dict[str, list[float]]]:
    store = Datastore(nodes, pods, backend)
    c = Consumers(store, backend)
    if kernel is not None:
        kernel.start(c.table.desired())
    out: dict[str, dict[str, list[float]]] = {}
    for event, (there, back) in events(store, nodes).items():
        samples: dict[str, list[float]] = {"parse": [], "incremental": [], "whole": []}
        if kernel is not None:
            samples.update({"delta": [], "reconcile": []})
        for run in range(runs):
            for write in (there, back):
                writes = write()
                t0 = time.thread_time()
                for kind, key, doc in writes:
                    if doc is None:
                        c.index.delete(kind, key)
                    else:
                        c.index.put(kind, key, doc)
                parse = time.thread_time() - t0
                whole_s, _ = cpu(c.whole)
                inc_s, delta = cpu(c.incremental)
                if (
                    backend == "vxlan"
                    and run == 0
                    and write is there
                    and not delta
                    and event != "remote pod"
                ):
                    raise SystemExit(f"{event}: the incremental pass changed nothing")
                if write is there:  # the cost of the event (going back is the same)
                    samples["parse"].append(parse)
                    samples["whole"].append(whole_s)
                    samples["incremental"].append(inc_s)
                if kernel is not None:
                    d, r = kernel.apply(delta, c.table.desired)
                    if write is there:
                        samples["delta"].append(d)
                        samples["reconcile"].append(r)
        out[event] = samples
    return out


class NetnsKernel:
    """The kernel side in a private network namespace (root)."""

    def __init__(self) -> None:
        self.name = f"tabby-routing-bench-{os.getpid()}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        ip = ["ip", "-n", self.name]
        subprocess.run(
            [*ip, "link", "add", "eth0", "type", "veth", "peer", "name", "eth0p"], check=True
        )
        subprocess.run([*ip, "link", "set", "eth0p", "up"], check=True)
        subprocess.run([*ip, "addr", "add", f"{underlay_of(0)}/16", "dev", "eth0"], check=True)
        subprocess.run([*ip, "link", "set", "eth0", "up"], check=True)
        from dataplane.netns import open_netns

        self.handle = open_netns(f"/run/netns/{self.name}")
        from dataplane.overlay import Reconciler

        self.reconciler = Reconciler()
        self.checker = Reconciler()

    def run(self, fn: Callable[[], T]) -> T:
        from dataplane.netns import run_in_netns

        return run_in_netns(self.handle.fd, fn)

    def start(self, desired: Any) -> None:
        done = self.run(lambda: self.reconciler.reconcile(desired))
        if not done.ok:
            raise SystemExit(f"programming the namespace failed: {done.summary()}")

    def apply(self, delta: Any, desired: Callable[[], Any]) -> tuple[float, float]:
        """(CPU of the delta applied, CPU of a whole reconcile of the same state)."""

        def both() -> tuple[float, float]:
            d, _ = cpu(lambda: self.reconciler.apply(delta, desired))
            state = desired()
            r, fixed = cpu(lambda: self.checker.reconcile(state))
            if fixed.applied:
                raise SystemExit(f"the delta left work for the whole reconcile: {fixed.summary()}")
            return d, r

        return self.run(both)

    def close(self) -> None:
        self.handle.close()
        subprocess.run(["ip", "netns", "del", self.name], check=False)


def ms(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` (s) in ms; NaN without values."""
    return 1000 * pct(values, q)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    parser.add_argument("--nodes", default="100,300,1000")
    parser.add_argument("--pods", type=int, default=20)
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--backend", default="vxlan,bird")
    parser.add_argument("--kernel", action="store_true", help="also the kernel (root, netns)")
    parser.add_argument("--json", action="store_true")
    record.add_argument(parser, "routing_bench")
    args = parser.parse_args()
    results: list[dict[str, Any]] = []
    for backend in args.backend.split(","):
        for n in (int(x) for x in args.nodes.split(",")):
            kernel = NetnsKernel() if args.kernel and backend == "vxlan" else None
            try:
                got = measure(n, args.pods, backend, args.runs, kernel)
            finally:
                if kernel is not None:
                    kernel.close()
            for event, samples in got.items():
                row: dict[str, Any] = {"backend": backend, "nodes": n, "event": event}
                for column, values in samples.items():
                    row[column] = (ms(values, 50), ms(values, 90))
                results.append(row)
                if not args.json:
                    _print(row)
    if args.json:
        print(json.dumps(results, indent=1))
    return 0


_HEADER = False


def _print(row: dict[str, Any]) -> None:
    global _HEADER
    columns = [c for c in ("parse", "incremental", "whole", "delta", "reconcile") if c in row]
    if not _HEADER:
        print("CPU per event, ms p50/p90 (parse: the document, common to both paths)")
        print(f"{'backend':8} {'nodes':>5} {'event':13} " + " ".join(f"{c:>15}" for c in columns))
        _HEADER = True
    cells = " ".join(f"{row[c][0]:7.3f}/{row[c][1]:<7.3f}" for c in columns)
    print(f"{row['backend']:8} {row['nodes']:>5} {row['event']:13} {cells}", flush=True)


if __name__ == "__main__":
    sys.exit(record.run(main, "routing_bench"))
