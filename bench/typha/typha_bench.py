"""tabby-typha with N simulated tabby-nodes: what each node receives per remote pod change,
typha's CPU and memory, a real node's (the probe's) CPU per remote change, and change ->
delivery latency, at N = 100/300/1000 nodes and a fixed churn of pod changes.

Three processes per size, all on loopback (plaintext gRPC: TLS is the same for every size):
- typha: the hub and its gRPC service (``fanout``), fed the cluster as tabby-typha's store
  watch feeds it (``hub.apply`` of sync events: the datastore itself is not measured here,
  it serves one watch whatever N is); N nodes with ``--pods`` pods each and one block each;
  then ``--rate`` pod changes a second on random nodes, each a pod ADD or DEL with its write
  to the node's own block, as tabby-node's IPAM makes it;
- the simulated nodes: N-1 gRPC streams in one asyncio process, counting what they receive;
- the probe: one node as tabby-node runs it (``fanout.client.TyphaSync`` into
  ``tabby_node.cache.Cache``), its process CPU over the churn.

Its pods have no endpoints and no policy selects them: with the interest filter no node but
their own would be sent them. It measures the sending, with every node receiving every pod
change (the filter's worst case: every node's policy needing every pod), so typha runs
without the filter here unless ``--filter`` is given.

    python -m bench.typha.typha_bench [--sizes 100,300,1000] [--rate 20] [--seconds 20]

``--interest``: the interest filter (``fanout.interest``) alone, in one process (the hub,
no gRPC): N nodes of ``--pods`` pods, each with its endpoint, of ``--apps`` apps; the first
``--policies`` apps each have a NetworkPolicy allowing ingress from the app ``--apps``/2
further (so a fifth of the pods, by default, are some policy's peers, and a node needs
the peers of the apps it runs). Then ``--changes`` label changes of random pods: how many
nodes each reached (besides its own), typha's CPU per change with the filter and without
it, and the cost of a policy change that widens interests.

    python -m bench.typha.typha_bench --interest [--sizes 100,300,1000] [--changes 2000]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import resource
import subprocess
import sys
import threading
import time

from bench import record

POOL = "10.0.0.0/8"
BLOCK_BITS = 6  # /26 blocks


def node_name(i: int) -> str:
    return f"node-{i:04d}"


def pod_doc(node: str, name: str, stamp: float, ip: str) -> dict:  # type: ignore[type-arg]
    return {
        "metadata": {
            "name": name,
            "namespace": "bench",
            "uid": f"uid-{name}",
            "labels": {"app": f"app-{hash(name) % 7}", "t": f"{stamp:.6f}"},
            "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x" * 300},
        },
        "spec": {"nodeName": node, "containers": [{"name": "c", "ports": [{"containerPort": 80}]}]},
        "status": {"podIPs": [{"ip": ip}]},
    }


def cidr_of(i: int) -> tuple[str, int]:
    base = (10 << 24) + (i << BLOCK_BITS)
    return f"{(base >> 24) & 255}.{(base >> 16) & 255}.{(base >> 8) & 255}.{base & 255}/26", base


def block_doc(i: int, held: dict[int, str]) -> dict:  # type: ignore[type-arg]
    cidr, _ = cidr_of(i)
    allocations: list[object] = [None] * 64
    for ordinal, pod in held.items():
        allocations[ordinal] = {
            "handle": f"k8s-pod-network.{pod}",
            "seq": ordinal,
            "attrs": {"node": node_name(i), "pod": pod, "namespace": "bench"},
        }
    return {
        "cidr": cidr,
        "pool": POOL,
        "affinity": f"host:{node_name(i)}",
        "seq": len(held),
        "allocations": allocations,
        "unallocated": [o for o in range(64) if o not in held],
        "full": False,
    }


# == typha ===================================================================================


def serve(args: argparse.Namespace) -> None:
    from datastore.base import Doc, SyncEvent
    from fanout import server
    from fanout.hub import Hub

    n, rnd = args.nodes, random.Random(7)  # noqa: S311 (a reproducible churn)
    revision = 0

    def rev() -> int:
        nonlocal revision
        revision += 1
        return revision

    held: list[dict[int, str]] = [{} for _ in range(n)]
    pods: dict[str, dict] = {}  # type: ignore[type-arg]
    blocks: dict[str, Doc] = {}
    nodes: dict[str, Doc] = {}
    for i in range(n):
        nodes[node_name(i)] = Doc({"metadata": {"name": node_name(i)}, "spec": {}}, rev())
        for k in range(args.pods):
            name = f"p-{i}-{k}"
            held[i][k] = name
            _, base = cidr_of(i)
            pods[f"bench/{name}"] = Doc(pod_doc(node_name(i), name, 0.0, _ip(base + k)), rev())
        blocks[cidr_of(i)[0]] = Doc(block_doc(i, held[i]), rev())

    async def run() -> dict[str, object]:
        hub = Hub(interest=args.filter)
        hub.apply(
            SyncEvent("snapshot", "", "", None, {"node": nodes, "pod": pods, "block": blocks})
        )
        srv = await server.start(hub, f"127.0.0.1:{args.port}", None)
        print(json.dumps({"port": srv.port}), flush=True)
        started = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.monotonic()
        deadline = t0 + 300
        while time.monotonic() < deadline and (
            hub.stats.connections < n or hub.stats.snapshots < n
        ):
            await asyncio.sleep(0.2)
        await asyncio.sleep(1.0)  # the last snapshots on their way
        connect_s = time.monotonic() - t0
        synced = resource.getrusage(resource.RUSAGE_SELF)
        connect_cpu = synced.ru_utime + synced.ru_stime - started.ru_utime - started.ru_stime
        connected = hub.stats.connections
        print(json.dumps({"churn": "start"}), flush=True)
        snapshots, snapshot_s = hub.stats.snapshots, hub.stats.snapshot_seconds
        before = resource.getrusage(resource.RUSAGE_SELF)
        sent0, updates0 = hub.stats.bytes_sent, hub.stats.updates_sent
        changes = 0
        start = time.monotonic()
        while time.monotonic() - start < args.seconds:
            i = rnd.randrange(n)
            node = node_name(i)
            free = [o for o in range(64) if o not in held[i]]
            if held[i] and (not free or rnd.random() < 0.5):  # a DEL
                ordinal = rnd.choice(sorted(held[i]))
                name = held[i].pop(ordinal)
                hub.apply(SyncEvent("delete", "pod", f"bench/{name}", None, None))
            else:  # an ADD
                ordinal = free[0]
                name = f"q-{i}-{changes}"
                held[i][ordinal] = name
                doc = pod_doc(node, name, time.time(), _ip(cidr_of(i)[1] + ordinal))
                hub.apply(SyncEvent("put", "pod", f"bench/{name}", Doc(doc, rev()), None))
            hub.apply(
                SyncEvent("put", "block", cidr_of(i)[0], Doc(block_doc(i, held[i]), rev()), None)
            )
            changes += 1
            await asyncio.sleep(max(0.0, start + changes / args.rate - time.monotonic()))
        elapsed = time.monotonic() - start
        await asyncio.sleep(2.0)  # the last changes delivered
        after = resource.getrusage(resource.RUSAGE_SELF)
        hub.tick()
        cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
        await srv.stop(None)
        return {
            "nodes": n,
            "connected": connected,
            "changes": changes,
            "seconds": elapsed,
            "snapshots": snapshots,
            "snapshot_s": snapshot_s,
            "connect_s": connect_s,
            "connect_cpu_s": connect_cpu,
            "cpu_s": cpu,
            "rss_mb": _rss_mb(),
            "bytes_sent": hub.stats.bytes_sent - sent0,
            "updates_sent": hub.stats.updates_sent - updates0,
            "history": len(hub.history),
        }

    print(json.dumps(asyncio.run(run())), flush=True)


def _ip(n: int) -> str:
    return ".".join(str((n >> s) & 255) for s in (24, 16, 8, 0))


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


# == the simulated nodes =====================================================================


def simulate(args: argparse.Namespace) -> None:
    import grpc

    from fanout import METHOD, wire

    async def one(i: int, out: dict[str, float]) -> None:
        me = node_name(i)
        sampled = i % 10 == 1  # these decode what they receive: own or remote
        async with grpc.aio.insecure_channel(f"127.0.0.1:{args.port}") as channel:
            call = channel.stream_stream(
                METHOD, request_serializer=wire.encode_client, response_deserializer=bytes
            )(_hello(wire, me))
            synced = False
            async for raw in call:
                if not synced:  # the type (field 1) alone: b"\x08\x03" is SNAPSHOT_END
                    synced = raw[:2] == b"\x08\x03"
                    out["synced"] += synced
                    continue
                if raw[:1] == b"\x08":  # a type other than UPDATES (0: left out)
                    continue
                out["messages"] += 1
                out["bytes"] += len(raw)
                if not sampled:
                    continue
                for u in wire.decode_server(raw).updates:
                    mine = f"-{i}-" in u.key if u.kind == "pod" else u.kind == "block"
                    if not mine:
                        out["remote_updates"] += 1
                        out["remote_bytes"] += len(u.data) + len(u.key) + len(u.kind) + 12

    async def run() -> dict[str, object]:
        out = {"synced": 0, "messages": 0, "bytes": 0.0, "remote_updates": 0, "remote_bytes": 0}
        tasks = [asyncio.create_task(one(i, out)) for i in range(1, args.nodes)]
        await asyncio.wait(tasks, timeout=args.seconds + 360)
        for t in tasks:
            t.cancel()
        return out

    try:
        print(json.dumps(asyncio.run(run())), flush=True)
    except grpc.RpcError:
        pass


async def _hello(wire, me: str):  # type: ignore[no-untyped-def]
    yield wire.ClientMessage(me)
    await asyncio.sleep(3600)


def _pct(values: list[float], p: float) -> float:
    if not values:
        return float("nan")
    return values[min(len(values) - 1, int(len(values) * p / 100))]


# == the probe ===============================================================================


def probe(args: argparse.Namespace) -> None:
    from fanout.client import TyphaSync
    from resources.index import NODE_KINDS
    from tabby_node.cache import Cache

    me = node_name(0)
    cache = Cache(me)
    source = TyphaSync([f"127.0.0.1:{args.port}"], me, None)
    stop = threading.Event()
    counts = {"events": 0, "remote": 0}
    marks: dict[str, float] = {}
    latencies: list[float] = []

    def consume() -> None:
        for event in source.sync(NODE_KINDS, stop):
            cache.apply(event)
            if event.type == "snapshot":
                marks["synced"] = time.monotonic()
                continue
            counts["events"] += 1
            if f"-{0}-" not in event.key and event.kind == "pod":
                counts["remote"] += 1
                if event.doc is not None and "measuring" in marks:
                    stamp = float(event.doc.data["metadata"]["labels"].get("t") or 0)
                    if stamp:
                        latencies.append(time.time() - stamp)

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    while "synced" not in marks:
        time.sleep(0.05)
    sys.stdin.readline()  # "start": typha starts the churn
    before = resource.getrusage(resource.RUSAGE_SELF)
    marks["measuring"] = time.monotonic()
    remote0 = counts["remote"]
    sys.stdin.readline()  # "stop": the churn is over
    after = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    remote = counts["remote"] - remote0
    stop.set()
    latencies.sort()
    print(
        json.dumps(
            {
                "remote": remote,
                "cpu_s": cpu,
                "rss_mb": _rss_mb(),
                "latency_p50": _pct(latencies, 50),
                "latency_p99": _pct(latencies, 99),
            }
        ),
        flush=True,
    )


# == the interest filter, in process ========================================================


def interest_world(n: int, args: argparse.Namespace) -> dict[str, dict[str, object]]:
    from datastore.base import Doc

    rnd = random.Random(11)  # noqa: S311 (a reproducible world)
    docs: dict[str, dict[str, object]] = {
        "namespace": {"bench": Doc({"metadata": {"name": "bench"}}, 1)},
        "pod": {},
        "workloadendpoint": {},
        "networkpolicy": {},
    }
    revision = 1
    for i in range(n):
        _, base = cidr_of(i)
        for k in range(args.pods):
            name, revision = f"p-{i}-{k}", revision + 1
            app = f"a-{rnd.randrange(args.apps)}"
            docs["pod"][f"bench/{name}"] = Doc(labelled_pod(node_name(i), name, app, 0), revision)
            docs["workloadendpoint"][f"bench/{name}-eth0"] = Doc(
                endpoint_doc(node_name(i), name, _ip(base + k)), revision
            )
    for j in range(args.policies):
        revision += 1
        docs["networkpolicy"][f"bench/allow-{j}"] = Doc(
            allow_policy(f"allow-{j}", f"a-{j}", f"a-{j + args.apps // 2}"), revision
        )
    return docs


def labelled_pod(node: str, name: str, app: str, version: int) -> dict:  # type: ignore[type-arg]
    doc = pod_doc(node, name, 0.0, "10.0.0.1")
    doc["metadata"]["labels"] = {"app": app, "v": str(version)}
    return doc


def endpoint_doc(node: str, name: str, ip: str) -> dict:  # type: ignore[type-arg]
    return {
        "metadata": {"name": f"{name}-eth0", "namespace": "bench", "labels": {}},
        "spec": {
            "pod": name,
            "node": node,
            "containerID": f"c-{name}",
            "interface": "eth0",
            "hostInterface": f"cali{abs(hash(name)) % 10**11:011d}",
            "ipNetworks": [f"{ip}/32"],
        },
    }


def allow_policy(name: str, app: str, peer: str) -> dict:  # type: ignore[type-arg]
    return {
        "metadata": {"name": name, "namespace": "bench"},
        "spec": {
            "podSelector": {"matchLabels": {"app": app}},
            "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": peer}}}]}],
            "policyTypes": ["Ingress"],
        },
    }


def interest_size(n: int, args: argparse.Namespace, filtered: bool) -> dict[str, object]:
    from datastore.base import Doc, SyncEvent
    from fanout.hub import Hub

    world = interest_world(n, args)
    hub = Hub(interest=filtered)
    t0 = time.process_time()
    snapshot = {kind: dict(docs) for kind, docs in world.items()}  # (the hub takes them)
    hub.apply(SyncEvent("snapshot", "", "", None, snapshot))  # type: ignore[arg-type]
    load_cpu = time.process_time() - t0
    rnd = random.Random(13)  # noqa: S311
    keys = sorted(world["pod"])
    reached: list[int] = []
    peers: list[int] = []  # of the pods some policy's peers (before and after)
    cpu = 0.0
    evaluations = hub.interest.counts.evaluations if hub.interest is not None else 0
    peer_apps = {f"a-{j + args.apps // 2}" for j in range(args.policies)}
    for c in range(args.changes):
        key = rnd.choice(keys)
        doc = world["pod"][key]
        data = json.loads(json.dumps(doc.data))  # type: ignore[attr-defined]
        app = data["metadata"]["labels"]["app"]
        data["metadata"]["labels"]["v"] = str(c + 1)
        seq = hub.seq
        t = time.process_time()
        hub.apply(SyncEvent("put", "pod", key, Doc(data, 10**6 + c), None))
        cpu += time.process_time() - t
        world["pod"][key] = Doc(data, 10**6 + c)
        count = 0
        for change in hub.since(seq) or ():
            to = change.to
            if change.remote is None:
                continue
            others = n - 1 - len(to.names) if to.but else len(to.names - {change.owner})
            count = max(count, others)
        reached.append(count)
        if app in peer_apps:
            peers.append(count)
    if hub.interest is not None:
        evaluations = hub.interest.counts.evaluations - evaluations
    # a policy change that widens interests: one more app's policy
    t = time.process_time()
    extra = allow_policy("allow-extra", f"a-{args.policies}", f"a-{args.policies + 1}")
    hub.apply(SyncEvent("put", "networkpolicy", "bench/allow-extra", Doc(extra, 10**7), None))
    policy_cpu = time.process_time() - t
    interest = hub.interest
    return {
        "nodes": n,
        "filtered": filtered,
        "changes": args.changes,
        "load_cpu_s": load_cpu,
        "cpu_per_change_ms": 1000 * cpu / args.changes,
        "reached_mean": sum(reached) / len(reached),
        "reached_peers_mean": sum(peers) / max(1, len(peers)),
        "reached_others_mean": (sum(reached) - sum(peers)) / max(1, len(reached) - len(peers)),
        "policy_change_cpu_ms": 1000 * policy_cpu,
        "items": len(interest.items) if interest is not None else 0,
        "evaluations_per_change": evaluations / args.changes,
        "rss_mb": _rss_mb(),
    }


def interest_main(args: argparse.Namespace) -> None:
    print(
        f"tabby-typha's interest filter, in process (the hub alone): {args.pods} pods per node "
        f"with their endpoints, {args.apps} apps, {args.policies} NetworkPolicies each "
        f"allowing one other app (a fifth of the pods are peers); {args.changes} label "
        "changes of random pods"
    )
    print(
        f"{'nodes':>6} {'filter':>6} {'other nodes reached':>20} {'(peer pod / other)':>19} "
        f"{'typha CPU/change':>17} {'policy change CPU':>18} {'load CPU':>9}"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        for filtered in (False, True):
            r = interest_size(n, args, filtered)
            print(
                f"{n:>6} {'on' if filtered else 'off':>6} {r['reached_mean']:>20.1f} "
                f"{r['reached_peers_mean']:>9.1f} / {r['reached_others_mean']:<7.1f} "
                f"{r['cpu_per_change_ms']:>14.3f} ms {r['policy_change_cpu_ms']:>15.1f} ms "
                f"{r['load_cpu_s']:>7.1f} s",
                flush=True,
            )
            print(f"#   {json.dumps(r)}", file=sys.stderr)


# == the parent ==============================================================================


def one_size(n: int, args: argparse.Namespace) -> dict[str, object]:
    me = [sys.executable, "-m", "bench.typha.typha_bench"]
    common = ["--nodes", str(n), "--rate", str(args.rate), "--seconds", str(args.seconds)]
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    typha = subprocess.Popen(
        [*me, "--child", "serve", *common, "--pods", str(args.pods)]
        + (["--filter"] if args.filter else []),
        stdout=subprocess.PIPE, env=env, text=True,
    )  # fmt: skip
    children = [typha]
    try:
        assert typha.stdout is not None
        port = json.loads(typha.stdout.readline())["port"]
        port_args = ["--port", str(port)]
        nodes = subprocess.Popen(
            [*me, "--child", "simulate", *common, *port_args],
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        children.append(nodes)
        time.sleep(1.0)
        prober = subprocess.Popen(
            [*me, "--child", "probe", *common, *port_args],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
            text=True,
        )
        children.append(prober)
        assert prober.stdin is not None
        json.loads(typha.stdout.readline())  # every node synced: the churn starts
        prober.stdin.write("start\n")
        prober.stdin.flush()
        served = json.loads(typha.stdout.readline())
        probed = json.loads(prober.communicate("stop\n", timeout=120)[0].strip().splitlines()[-1])
        nodes_out = nodes.communicate(timeout=420)[0].strip().splitlines()
        simulated = json.loads(nodes_out[-1]) if nodes_out else {}
        return {"typha": served, "probe": probed, "nodes": simulated}
    finally:
        for child in children:
            if child.poll() is None:
                child.kill()
            child.wait(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,300,1000")
    parser.add_argument("--rate", type=float, default=20.0, help="pod changes a second")
    parser.add_argument("--seconds", type=float, default=20.0, help="of churn per size")
    parser.add_argument("--pods", type=int, default=20, help="pods per node")
    parser.add_argument("--interest", action="store_true", help="the interest filter alone")
    parser.add_argument(
        "--filter", action="store_true", help="typha with the interest filter (none reached)"
    )
    parser.add_argument("--apps", type=int, default=50, help="(--interest) apps")
    parser.add_argument("--policies", type=int, default=10, help="(--interest) policies")
    parser.add_argument("--changes", type=int, default=2000, help="(--interest) label changes")
    parser.add_argument("--nodes", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--child", choices=("serve", "simulate", "probe"), help=argparse.SUPPRESS)
    record.add_argument(parser, "typha_bench")
    args = parser.parse_args()
    if args.child:
        # a socket per node on either side: past the usual 1024 descriptors at 1000 nodes
        _soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        {"serve": serve, "simulate": simulate, "probe": probe}[args.child](args)
        return
    if args.interest:
        interest_main(args)
        return
    print(
        f"tabby-typha, {args.pods} pods per node, {args.rate:g} pod changes/s for "
        f"{args.seconds:g} s per size (each an ADD or DEL with its block write); loopback, "
        "plaintext gRPC; the datastore serves typha one watch whatever N"
    )
    print(
        f"{'nodes':>6} {'all synced, typha CPU':>22} {'typha CPU/change':>17} {'typha RSS':>10} "
        f"{'B/node/remote change':>21} {'probe CPU/remote':>17} {'delivery p50/p99':>17} "
        f"{'bytes sent/change':>18}"
    )
    for n in (int(s) for s in args.sizes.split(",")):
        r = one_size(n, args)
        t, p, s = r["typha"], r["probe"], r["nodes"]
        changes = max(1, t["changes"])  # type: ignore[index]
        per_node = s.get("remote_bytes", 0) / max(1, s.get("remote_updates", 0))  # type: ignore[union-attr]
        probe_ms = 1000 * p["cpu_s"] / max(1, p["remote"])  # type: ignore[index]
        print(
            f"{n:>6} {t['connect_s']:>9.1f} s, {t['connect_cpu_s']:>6.1f} s CPU "  # type: ignore[index]
            f"{1000 * t['cpu_s'] / changes:>14.2f} ms {t['rss_mb']:>7.0f} MB "  # type: ignore[index]
            f"{per_node:>19.0f} B {probe_ms:>14.2f} ms "
            f"{1000 * p['latency_p50']:>7.0f}/{1000 * p['latency_p99']:<4.0f} ms "  # type: ignore[index]
            f"{t['bytes_sent'] / changes:>15.0f} B"  # type: ignore[index]
        )
        print(f"#   {json.dumps(r)}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(record.run(main, "typha_bench"))
