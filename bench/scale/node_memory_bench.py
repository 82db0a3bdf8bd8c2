#!/usr/bin/env python3
"""Where tabby-node's memory goes as the cluster grows, without etcd and in a minute.

The datastore of bench/scale/scale_bench.py (its Kubernetes mode: the pool, 50 namespaces, the
probe namespace and its two NetworkPolicies, N nodes each registered as tabby-node does,
``--pods-per-node`` pods on each, every Pod mirrored as tabby-kube-controllers mirror it, a
heartbeat per node) is written by the same code paths bench/scale/scale_writer.py drives (its
``Writer``: tabby-node's CNI handlers with the in-process tabby-ipam and the endpoint
recorder, the controllers' mirror), here into a ``MemoryStore`` served in place of etcd.
The documents are saved once per size (``--cache-dir``) and reused.

Then, for each N, a fresh process is one tabby-node's state: the store's sync snapshot
(what the watch hands over first) goes into tabby-node's ``Cache`` (``Index``), and
``DataplaneLoop.reconcile(full=True)`` builds the routing (``VxlanRouting``: cluster index, VXLAN
table; the kernel is the unit tests' fake one) and the policy state (policy memo, nft
dataplane; nft is the unit tests' model). Measured, each in its own process:

- ``rss``: the process's RSS after the state is built (``gc.collect``), and ``idle``: the
  same process with everything imported but no document (what a tabby-node is at rest
  before its first snapshot);
- ``traced``: tracemalloc's bytes still held after the pass, by the file of the allocation
  (``--top`` lines by file and line too), the fake kernel's and nft model's own (not a
  real node's memory) left out.

``per endpoint`` is (rss - idle) / endpoints; ``proj. 20k`` projects the RSS to 1000
nodes with 20 endpoints each (idle + 20,000 x the per-endpoint cost at the largest N).

Usage::

    .venv/bin/python -m bench.scale.node_memory_bench [--nodes 100,300,1000] [--pods-per-node 20]
"""

from __future__ import annotations

import argparse
import atexit
import gc
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any

from bench import record

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench.scale.node_memory_bench"  # its children run it again: -m from ROOT

POOL = "10.128.0.0/14"  # scale_bench's
SIM_UNDERLAY = "172.30.0.1"
NAMESPACES = 50
ENDPOINT = "http://127.0.0.1:1"  # never dialled: the memory store is served in its place
PREFIX = "/bench-memory"
ME = "sim-0"  # the node whose state is measured (a node like the others)
HELD: list[object] = []  # what a running watch holds besides the node's parts


# == the datastore, written by scale_writer's code paths ===========================================


def generate(nodes: int, pods_per_node: int, path: Path) -> None:
    """Write the documents of an N-node cluster to ``path`` (JSON lines: kind, key, data,
    revision); tabby's warnings about the absent kernel are silenced meanwhile."""
    import logging

    logging.disable(logging.WARNING)
    try:
        _generate(nodes, pods_per_node, path)
    finally:
        logging.disable(logging.NOTSET)


def _generate(nodes: int, pods_per_node: int, path: Path) -> None:
    from cni_config.common import DatastoreSettings
    from datastore.memory import MemoryStore
    from stores import Served

    settings = DatastoreSettings(
        datastore_type="etcdv3", etcd_endpoints=[ENDPOINT], etcd_prefix=PREFIX
    )
    store = MemoryStore()
    _write(store, Served(settings, store), nodes, pods_per_node, path)


def _write(store: Any, stores: Any, nodes: int, pods_per_node: int, path: Path) -> None:
    import ipaddress

    from bench.scale import scale_writer
    from resources.heartbeat import Heartbeat
    from tabby_node.cache import Cache
    from tabby_node.facts import Facts
    from tabby_node.registration import cas, node_spec
    from tabby_node.tunnels import Tunnels

    with tempfile.TemporaryDirectory() as tmp:
        cfg = {
            "prefix": PREFIX,
            "pool": POOL,
            "kubernetes": True,
            "lanes": [ENDPOINT],
            "endpoint": ENDPOINT,
            "cni_log": os.path.join(tmp, "cni.log"),
            "namespaces": NAMESPACES,
        }
        writer = scale_writer.Writer(cfg, stores)
        writer.store = store
        writer.lane_stores = [store]

        def register(node: str, index: int) -> None:  # Writer.register, on this store
            from dataplane.nodeinfo import NodeAddress

            address = ipaddress.ip_address(SIM_UNDERLAY) + index
            facts = Facts(node, NodeAddress(address, 16, None), None, 1500, False, "")
            cache = Cache(node)
            cas(store, "node", node, lambda existing: node_spec(facts, "vxlan", existing))
            for key, doc in store.list("pool"):
                cache.put_local("pool", key, doc)
            Tunnels(facts, "vxlan", store, cache).ensure()
            store.put("heartbeat", node, Heartbeat(node, time.time(), 1000 + index).to_data(), None)

        writer.register = register  # type: ignore[method-assign]
        writer.revision = lambda: 0  # type: ignore[method-assign]
        sims = [f"sim-{i}" for i in range(nodes)]
        try:
            writer.setup({"namespaces": NAMESPACES, "sims": sims, "pods_per_node": pods_per_node})
        finally:
            writer.pool_exec.shutdown(wait=True)
    from tabby_node.cache import WATCHED_KINDS

    with path.open("w") as f:
        for kind in WATCHED_KINDS:
            for key, doc in store.list(kind):
                f.write(json.dumps([kind, key, doc.data, doc.revision]) + "\n")


def load(path: Path) -> dict[str, Any]:
    """The saved documents as etcd's sync snapshot hands them over: each kind's as stored
    (JSON bytes, ``datastore.base.Undecoded``), decoded as the consumer takes them."""
    from datastore.base import Undecoded

    stored: dict[str, dict[str, tuple[bytes, int]]] = {}
    with path.open() as f:
        for line in f:
            kind, key, data, revision = json.loads(line)
            value = json.dumps(data, separators=(",", ":")).encode()
            stored.setdefault(kind, {})[key] = (value, revision)
    return {kind: Undecoded(_decode, docs) for kind, docs in stored.items()}


def _decode(key: str, value: bytes) -> dict[str, Any]:
    data = json.loads(value)
    assert isinstance(data, dict), key
    return data


# == one tabby-node's state ========================================================================


def rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def build_node(path: str | None) -> Any:
    """tabby-node's cache, routing and policy state from the documents saved at ``path``
    (None: imports only), as its watch and first pass make them: the store's sync hands
    them over as one snapshot (through the stores' own ``Reported``, which the watch keeps
    for as long as it runs), the cache takes it, the first pass builds the rest."""
    import ipaddress
    import threading

    from dataplane.nodeinfo import NodeAddress
    from dataplane.overlay import Reconciler
    from datastore.engine import Reported
    from policy.state import PolicyDataplane
    from tabby_node.cache import Cache
    from tabby_node.facts import Facts
    from tabby_node.node_status import StatusReport
    from tabby_node.passes import DataplaneLoop, IpipNotice, PolicyPass, Requests
    from tabby_node.routing import VxlanRouting
    from tests.nft_model import NftModel
    from tests.unit.fake_kernel import FakeKernel

    tmp = tempfile.mkdtemp(prefix="tabby-node-memory-")
    atexit.register(shutil.rmtree, tmp, True)
    address = ipaddress.ip_address(SIM_UNDERLAY)
    facts = Facts(ME, NodeAddress(address, 16, None), None, 1500, False, "")
    cache = Cache(ME)
    routing = VxlanRouting(facts, "vxlan")
    routing.overlay.reconciler = Reconciler(netlink=FakeKernel(ipip=False))  # type: ignore[arg-type]
    policy = PolicyDataplane(ME, backend=NftModel(), families=(4,))
    problems: dict[str, str] = {}
    node = DataplaneLoop(
        cache,
        routing,
        PolicyPass(policy),
        ipip=IpipNotice(facts, "vxlan", problems),
        status=StatusReport(
            facts, backend="vxlan", mtu=1450, problems=problems, routing=routing, run_dir=tmp
        ),
        requests=Requests(cache.wake),
        stopping=threading.Event(),
        beats={},
        problems=problems,
    )
    if path is None:
        return node
    reported = Reported()  # the watch's: alive as long as the watch
    HELD.append(reported)
    event = reported.snapshot(load(Path(path)))
    node.cache.apply(event)
    del event
    if not node.reconcile(full=True):
        raise SystemExit(f"the pass failed: {node.problems}")
    return node


#: Allocations that are not a real node's memory (the fake kernel, the nft model, this file).
NOT_THE_NODE = ("fake_kernel.py", "nft_model.py", "node_memory_bench.py", "tracemalloc.py")


def measure(path: str | None, mode: str, top: int) -> dict[str, Any]:
    """In this process: the state from the saved documents, measured by ``mode``."""
    endpoints = 0
    if path:
        with open(path) as f:
            endpoints = sum(1 for line in f if line.startswith('["workloadendpoint"'))
    if mode == "rss":
        t0 = time.process_time()
        node = build_node(path)
        cpu = time.process_time() - t0
        gc.collect()
        return {"rss_kb": rss_kb(), "cpu_s": cpu, "endpoints": endpoints, "node": id(node)}
    build_node(None)  # the imports are the idle node's, not the state's
    gc.collect()
    tracemalloc.start()
    node = build_node(path)
    gc.collect()
    peak = tracemalloc.get_traced_memory()[1]
    snap = tracemalloc.take_snapshot()
    tracemalloc.stop()
    keep = [tracemalloc.Filter(False, f"*{name}") for name in NOT_THE_NODE] + [
        tracemalloc.Filter(False, "<frozen importlib._bootstrap*>")
    ]
    snap = snap.filter_traces(keep)
    by_file = snap.statistics("filename")
    by_line = snap.statistics("lineno")
    total = sum(s.size for s in by_file)
    del node
    return {
        "traced": total,
        "peak": peak,
        "endpoints": endpoints,
        "files": [(_short(s.traceback[0].filename), s.size, s.count) for s in by_file[:top]],
        "lines": [
            (f"{_short(s.traceback[0].filename)}:{s.traceback[0].lineno}", s.size, s.count)
            for s in by_line[:top]
        ],
    }


def _short(filename: str) -> str:
    root = str(ROOT) + os.sep
    if filename.startswith(root):
        return filename[len(root) :]
    parts = filename.split(os.sep)
    return os.sep.join(parts[-2:])


def child(path: str | None, mode: str, top: int) -> dict[str, Any]:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            MODULE,
            "--child",
            mode,
            "--top",
            str(top),
            *([path] if path else []),
        ],
        check=True,
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--nodes", default="100,300,1000", help="cluster sizes (100,300,1000)")
    ap.add_argument("--pods-per-node", type=int, default=20, help="pods per node (20)")
    ap.add_argument("--top", type=int, default=12, help="allocation sites to print (12)")
    ap.add_argument(
        "--cache-dir",
        default=os.path.join(tempfile.gettempdir(), "tabby-node-memory-bench"),
        help="where the generated documents are kept between runs",
    )
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("path", nargs="?", help=argparse.SUPPRESS)
    record.add_argument(ap, "node_memory_bench")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(measure(args.path, args.child, args.top)))
        return 0
    sizes = [int(n) for n in args.nodes.split(",") if n]
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)
    print(f"tabby-node memory, {args.pods_per_node} pods per node (load {load_average()})")
    idle = child(None, "rss", args.top)
    print(f"  idle tabby-node state (imports, no document): RSS {idle['rss_kb'] / 1024:.1f} MB")
    rows = []
    for n in sizes:
        path = cache / f"n{n}-p{args.pods_per_node}.jsonl"
        if not path.exists():
            t0 = time.monotonic()
            part = path.with_suffix(".part")
            generate(n, args.pods_per_node, part)
            part.rename(path)
            print(
                f"  N={n}: documents written in {time.monotonic() - t0:.0f} s "
                f"(load {load_average()})"
            )
        rss = child(str(path), "rss", args.top)
        traced = child(str(path), "traced", args.top)
        rows.append((n, rss, traced))
        print(f"\n  N={n}, {traced['endpoints']} endpoints: top allocation sites (traced)")
        for name, size, count in traced["files"]:
            print(f"    {size / 2**20:8.1f} MB {count:9d}  {name}")
        print("    --")
        for name, size, count in traced["lines"]:
            print(f"    {size / 2**20:8.1f} MB {count:9d}  {name}")
    print()
    print(
        f"  {'N':>5} {'endpoints':>9} {'RSS MB':>7} {'state MB':>8} {'traced MB':>9} "
        f"{'peak MB':>7} {'B/endpoint':>10} {'CPU s':>6}"
    )
    base = idle["rss_kb"] * 1024
    for n, rss, traced in rows:
        state = rss["rss_kb"] * 1024 - base
        per = state / max(1, rss["endpoints"])
        print(
            f"  {n:>5} {rss['endpoints']:>9} {rss['rss_kb'] / 1024:>7.1f} {state / 2**20:>8.1f} "
            f"{traced['traced'] / 2**20:>9.1f} {traced['peak'] / 2**20:>7.1f} {per:>10.0f} "
            f"{rss['cpu_s']:>6.1f}"
        )
    if rows:
        n, rss, _ = rows[-1]
        per = (rss["rss_kb"] * 1024 - base) / max(1, rss["endpoints"])
        proj = (base + 20000 * per) / 2**20
        print(
            f"\n  projection, 1000 nodes / 20,000 endpoints: {proj:.0f} MB RSS "
            f"(idle {base / 2**20:.0f} MB + 20,000 x {per:.0f} B, from N={n})"
        )
    print(f"  (load {load_average()}; 'CPU s': CPU seconds to load and build the state)")
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "node_memory_bench"))
