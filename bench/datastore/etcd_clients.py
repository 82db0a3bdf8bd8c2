"""Benchmark (not a test): which etcd client for tabby. Import cost, RSS, put and txn latency.

Candidates, each measured in a fresh child process against a real etcd (1 member, then 3
members, on 127.0.0.1 with random ports, started and removed by ``tests/etcd_cluster.py``):

- ``tabby``: ``datastore.etcd.client`` (gRPC-JSON gateway over plain sockets, stdlib only)
- ``etcd3gw``: the maintained gateway client (requests underneath)
- ``aetcd``: a gRPC client (asyncio)

etcd3gw and aetcd are not tabby dependencies: give an interpreter that has them with
``--other-python`` (e.g. a throw-away venv: ``python3 -m venv /tmp/v && /tmp/v/bin/pip
install etcd3gw aetcd``); without it only ``tabby`` is measured. python-etcd3 is left out:
0.12 fails to import with protobuf >= 4.

The child imports the client (timed; RSS before/after), then does ``-n`` puts and ``-n``
txns (compare mod_revision, then put: what every store write is), one at a time, and
reports p50/p90 in ms. Rounds alternate the candidates' order.

    python -m bench.datastore.etcd_clients [-n 300] [--rounds 2] [--members 1,3] [--other-python PY]
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench import record
from bench.stats import pct

ROOT = Path(__file__).resolve().parents[2]
MODULE = "bench.datastore.etcd_clients"  # the children run it again: -m from ROOT

CANDIDATES = ("tabby", "etcd3gw", "aetcd")


def _rss_kb() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS"):
                return int(line.split()[1])
    return 0


def child(name: str, endpoint: str, n: int) -> dict[str, Any]:
    import base64
    import json as _json  # the store imports json anyway: not counted

    del _json
    host, port = endpoint.rsplit("//", 1)[1].rsplit(":", 1)
    rss0 = _rss_kb()
    t0 = time.perf_counter()
    module = {"tabby": "datastore.etcd.client"}.get(name, name)
    mod: Any = importlib.import_module(module)
    import_ms = (time.perf_counter() - t0) * 1000
    rss_mb = (_rss_kb() - rss0) / 1024
    puts: list[float] = []
    txns: list[float] = []
    key = f"/bench/{name}/{os.getpid()}".encode()

    if name == "tabby":
        c = mod.EtcdClient([endpoint])
        rev = c.put(key, b"0")
        for i in range(n + 20):
            t = time.perf_counter()
            rev = c.put(key, str(i).encode())
            if i >= 20:
                puts.append(time.perf_counter() - t)
        for i in range(n + 20):
            t = time.perf_counter()
            r = c.txn([mod.cmp_mod(key, rev)], [mod.op_put(key, str(i).encode())])
            if i >= 20:
                txns.append(time.perf_counter() - t)
            assert r.succeeded
            rev = r.revision
        c.close()
    elif name == "etcd3gw":
        c = mod.client(host=host, port=int(port))
        c.put(key, "0")
        rev = int(c.get(key, metadata=True)[0][1]["mod_revision"])
        k64 = base64.b64encode(key).decode()
        for i in range(n + 20):
            t = time.perf_counter()
            c.put(key, str(i))
            if i >= 20:
                puts.append(time.perf_counter() - t)
        rev = int(c.get(key, metadata=True)[0][1]["mod_revision"])
        for i in range(n + 20):
            v64 = base64.b64encode(str(i).encode()).decode()
            t = time.perf_counter()
            r = c.transaction(
                {
                    "compare": [
                        {"key": k64, "target": "MOD", "result": "EQUAL", "mod_revision": rev}
                    ],
                    "success": [{"request_put": {"key": k64, "value": v64}}],
                    "failure": [],
                }
            )
            if i >= 20:
                txns.append(time.perf_counter() - t)
            assert r.get("succeeded")
            rev = int(r["header"]["revision"])
    else:
        import asyncio

        async def run() -> None:
            async with mod.Client(host=host, port=int(port)) as c:
                await c.put(key, b"0")
                for i in range(n + 20):
                    t = time.perf_counter()
                    await c.put(key, str(i).encode())
                    if i >= 20:
                        puts.append(time.perf_counter() - t)
                got = await c.get(key)
                rev = got.mod_revision
                for i in range(n + 20):
                    t = time.perf_counter()
                    ok, _ = await c.transaction(
                        compare=[c.transactions.mod(key) == rev],
                        success=[c.transactions.put(key, str(i).encode())],
                        failure=[],
                    )
                    if i >= 20:
                        txns.append(time.perf_counter() - t)
                    assert ok
                    rev = (await c.get(key)).mod_revision

        asyncio.run(run())
    return {
        "import_ms": import_ms,
        "rss_mb": rss_mb,
        "put": [x * 1000 for x in puts],
        "txn": [x * 1000 for x in txns],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("-n", type=int, default=300, help="puts and txns per candidate and round")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--members", default="1,3", help="cluster sizes to measure")
    ap.add_argument("--other-python", help="interpreter that has etcd3gw and aetcd")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--endpoint", help=argparse.SUPPRESS)
    record.add_argument(ap, "etcd_clients")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.endpoint, args.n)))
        return 0

    from tests.etcd_cluster import EtcdCluster

    pythons = {"tabby": sys.executable}
    if args.other_python:
        for name in ("etcd3gw", "aetcd"):
            pythons[name] = args.other_python
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    # imports are measured from cached bytecode, as an installed program has it
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env["PYTHONPYCACHEPREFIX"] = tempfile.mkdtemp(prefix="etcd-clients-pyc-")
    for name, python in pythons.items():  # warm the bytecode cache
        module = {"tabby": "datastore.etcd.client"}.get(name, name)
        subprocess.run([python, "-c", f"import {module}"], env=env, check=True)
    rows = []
    for size in [int(x) for x in args.members.split(",")]:
        results: dict[str, dict[str, list[float]]] = {
            c: {"import_ms": [], "rss_mb": [], "put": [], "txn": []} for c in pythons
        }
        with EtcdCluster(size) as cluster:
            endpoint = cluster.endpoints[cluster.leader()]
            for rnd in range(args.rounds):
                order = list(pythons) if rnd % 2 == 0 else list(reversed(pythons))
                for name in order:
                    cmd = [pythons[name], "-m", MODULE, "--child", name, "--endpoint", endpoint]
                    out = subprocess.run(
                        [*cmd, "-n", str(args.n)],
                        env=env,
                        capture_output=True,
                        text=True,
                        check=True,
                    ).stdout
                    r = json.loads(out)
                    for k in ("import_ms", "rss_mb"):
                        results[name][k].append(r[k])
                    results[name]["put"] += r["put"]
                    results[name]["txn"] += r["txn"]
                    print(f"  {size} member(s), round {rnd + 1}: {name} done", file=sys.stderr)
        for name, r in results.items():
            rows.append(
                (
                    name,
                    size,
                    min(r["import_ms"]),
                    min(r["rss_mb"]),
                    pct(r["put"], 50),
                    pct(r["put"], 90),
                    pct(r["txn"], 50),
                    pct(r["txn"], 90),
                )
            )
    print(
        f"{'client':8} {'members':>7} {'import ms':>9} {'+RSS MB':>7} "
        f"{'put p50':>7} {'put p90':>7} {'txn p50':>7} {'txn p90':>7}"
    )
    for row in rows:
        print(
            f"{row[0]:8} {row[1]:>7} {row[2]:9.1f} {row[3]:7.1f} "
            f"{row[4]:7.2f} {row[5]:7.2f} {row[6]:7.2f} {row[7]:7.2f}"
        )
    print("(import: best of rounds, the child had json loaded already; latency in ms)")
    shutil.rmtree(env["PYTHONPYCACHEPREFIX"], ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "etcd_clients"))
