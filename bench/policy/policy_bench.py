#!/usr/bin/env python3
"""NetworkPolicy programming cost: engine + nftables at scale (needs root for the netns).

    python3 -m bench.policy.policy_bench [--local 1000] [--remote 0] [--policies 200] [--runs 7]
                                  [--backend libnftables,nft-cli]

A synthetic cluster: ``--local`` endpoints on this node and ``--remote`` on others, spread
over 20 namespaces, and ``--policies`` NetworkPolicies mixing what real clusters write
(default deny, same-namespace app selectors, namespaceSelector AND podSelector, ipBlock with
except, named ports, egress to DNS). For each mechanism it prints p50/p90 of:

* full: compute + render + replace the whole table (what a tabby-node start does);
* one changed policy (a port of one rule), through ``sync`` (difference only);
* one new pod (``add_endpoint``, the no-window path of a CNI ADD), and its removal;
* one namespace relabelled (set elements of namespaceSelector sets);
* compute only (the engine), render only (text of the full table), its size;
* JSON input for comparison: the same table as ``nft -j`` lists it, loaded by ``nft -j -f``.

Everything runs in a network namespace created here and deleted at the end, pass or fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any, TypeVar

from bench import record
from bench.stats import pct
from dataplane import nft
from dataplane.netns import open_netns, run_in_netns
from policy import engine
from policy.engine import (
    ClusterState,
    ContainerPort,
    Endpoint,
    IPBlock,
    LabelSelector,
    Namespace,
    NatConfig,
    Peer,
    Pod,
    Policy,
    PortSpec,
    Requirement,
    Rule,
)
from policy.render import Renderer, Snapshot
from policy.state import PolicyDataplane

T = TypeVar("T")
NAMESPACES = 20
APPS = 10
NODE = "bench-node"


def _in_netns(path: str, fn: Callable[[], T]) -> T:
    with open_netns(path) as handle:
        return run_in_netns(handle.fd, fn)


def _pod(i: int, node: str) -> tuple[Pod, Endpoint]:
    ns = f"ns{i % NAMESPACES}"
    app = f"app{(i // NAMESPACES) % APPS}"
    tier = ("web", "db", "cache")[i % 3]
    labels = (("app", app), ("tier", tier), ("pod-template-hash", f"h{i // 7}"))
    ports = (
        ContainerPort("http", 8080 + i % 2),
        ContainerPort("metrics", 9090),
        ContainerPort("dns", 53, "UDP"),
    )
    name = f"p{i}"
    addr = f"10.{64 + i // 65536}.{(i // 256) % 256}.{i % 256}"
    iface = f"cali{i:011x}"
    return Pod(ns, name, labels, ports), Endpoint(ns, name, node, iface, (addr,), f"{name}-eth0")


def _policy(j: int, variant: int = 0) -> Policy:
    ns = f"ns{j % NAMESPACES}"
    app = f"app{(j // NAMESPACES) % APPS}"
    kind = j % 8
    sel = LabelSelector.of({"app": app})
    name = f"pol{j}"
    if kind == 0:
        return Policy(ns, name, LabelSelector(), policy_types=("Ingress",))
    if kind == 1:
        peer = Peer(LabelSelector.of({"tier": "web"}))
        return Policy(ns, name, sel, (Rule((peer,), (PortSpec("TCP", 8080 + variant),)),))
    if kind == 2:
        peer = Peer(LabelSelector.of({"app": app}), LabelSelector.of({"team": f"t{j % 4}"}))
        return Policy(ns, name, sel, (Rule((peer,), (PortSpec("TCP", "http"),)),))
    if kind == 3:
        blk = Peer(
            ip_block=IPBlock(f"10.{64 + j % 2}.0.0/16", (f"10.{64 + j % 2}.{j % 200}.0/24",))
        )
        return Policy(ns, name, sel, (Rule((blk,), (PortSpec("TCP", 443 + variant),)),))
    if kind == 4:
        dns = Peer(None, LabelSelector.of({"kubernetes.io/metadata.name": "ns0"}))
        rules = (
            Rule((dns,), (PortSpec("UDP", 53), PortSpec("TCP", 53))),
            Rule((Peer(LabelSelector()),), (PortSpec("TCP", "http"),)),
        )
        return Policy(ns, name, sel, egress=rules, policy_types=("Egress",))
    if kind == 5:
        expr = LabelSelector((), (Requirement("tier", "In", ("web", "cache")),))
        peer = Peer(expr, LabelSelector((), (Requirement("env", "NotIn", ("dev",)),)))
        return Policy(ns, name, sel, (Rule((peer,), (PortSpec("TCP", 9000 + variant, 9100),)),))
    if kind == 6:
        rule = Rule((), (PortSpec("TCP", "metrics"),))
        return Policy(ns, name, LabelSelector.of({"tier": "db"}), (rule,))
    peers = (Peer(LabelSelector.of({"app": f"app{(j + 1) % APPS}"})), Peer(None, LabelSelector()))
    return Policy(ns, name, sel, (Rule(peers, (PortSpec("SCTP", 7000 + variant),)),))


def cluster(local: int, remote: int, policies: int) -> ClusterState:
    pods, eps = [], []
    for i in range(local + remote):
        p, e = _pod(i, NODE if i < local else f"node{1 + i % 3}")
        pods.append(p)
        eps.append(e)
    nss = tuple(
        Namespace(f"ns{k}", (("team", f"t{k % 4}"), ("env", "prod" if k % 2 else "dev")))
        for k in range(NAMESPACES)
    )
    return ClusterState(tuple(_policy(j) for j in range(policies)), nss, tuple(pods), tuple(eps))


def _line(label: str, values: list[float], extra: str = "") -> None:
    ms = [v * 1000 for v in values]
    print(f"  {label:<44} p50 {pct(ms, 50):8.1f} ms   p90 {pct(ms, 90):8.1f} ms {extra}")


def _timed(fn: Callable[[], Any]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def measure(backend_name: str, state: ClusterState, runs: int) -> None:
    backend = nft.backend_named(backend_name)  # type: ignore[arg-type]
    dp = PolicyDataplane(NODE, backend=backend, families=(4,))
    print(f"\n{backend_name}:")
    full = [_timed(lambda: dp.sync(state, full=True)) for _ in range(runs)]
    c = dp.counters
    _line(
        "full build + apply",
        full,
        f"({c.endpoints} endpoints, {c.policies} policies, {c.rules} rules, {c.sets} sets,"
        f" {c.set_elements} elements)",
    )
    # one changed policy: alternate a port of policy 1 (kind 1)
    changed = []
    pols = list(state.policies)
    for r in range(runs):
        pols[1] = _policy(1, variant=(r % 2) + 1)
        st = dataclasses.replace(state, policies=tuple(pols))
        res_t = time.perf_counter()
        res = dp.sync(st)
        changed.append(time.perf_counter() - res_t)
        assert res.changed, res
        assert not res.full, res
    _line("one changed policy (sync, difference)", changed)
    dp.sync(state)
    adds, dels = [], []
    base = len(state.endpoints)
    for r in range(runs):
        pod, ep = _pod(base + r, NODE)
        t = time.perf_counter()
        res = dp.add_endpoint(ep, pod)
        adds.append(time.perf_counter() - t)
        assert res.changed, res
        assert not res.full, res
        t = time.perf_counter()
        dp.remove_endpoint(ep.namespace, ep.name)
        dels.append(time.perf_counter() - t)
    _line("one new pod (add_endpoint)", adds, f"({res.commands} commands)")
    _line("one pod removed (remove_endpoint)", dels)
    relabel = []
    for r in range(runs):
        nss = tuple(
            Namespace(
                n.name, (*((k, v) for k, v in n.labels if k != "team"), ("team", f"t{r % 4}"))
            )
            if n.name == "ns3"
            else n
            for n in state.namespaces
        )
        relabel.append(_timed(lambda nss=nss: dp.sync(dataclasses.replace(state, namespaces=nss))))  # type: ignore[misc]
    _line("one namespace relabelled (sync)", relabel)
    same = [_timed(lambda: dp.sync(state)) for _ in range(runs)]
    _line("unchanged state (sync: equal inputs, no-op)", same)
    c = dp.counters
    print(f"  applies {c.applies}, full {c.full_applies}, failed differences {c.apply_errors}")
    if isinstance(backend, nft.LibNftables):
        backend.close()


def measure_parts(state: ClusterState, runs: int) -> Snapshot:
    comp = []
    ir = None
    for _ in range(runs):
        t = time.perf_counter()
        ir = engine.compute(state, NODE, (4,))
        comp.append(time.perf_counter() - t)
    assert ir is not None
    snap = Snapshot(ir, NatConfig())
    r = Renderer()
    text = r.full(snap)
    rend = [_timed(lambda: r.full(snap)) for _ in range(runs)]
    print("\nparts:")
    _line("engine.compute (whole cluster)", comp)
    _line(
        "render full table text",
        rend,
        f"({len(text.splitlines())} commands, {len(text) // 1024} KiB)",
    )
    return snap


def measure_json(text_backend: nft.NftBackend, snap: Snapshot, runs: int) -> None:
    r = Renderer()
    text_backend.run(r.full(snap))
    listed = subprocess.run(
        ["nft", "-j", "list", "table", "inet", "tabby"], capture_output=True, text=True, check=True
    ).stdout
    order = {"table": 0, "set": 1, "chain": 2, "map": 3, "rule": 4}
    objs = [o for o in json.loads(listed)["nftables"] if "metainfo" not in o]
    objs.sort(key=lambda o: order[next(iter(o))])  # chains before the map elements jumping there
    for o in objs:
        for v in o.values():
            v.pop("handle", None)
    doc = json.dumps(
        {
            "nftables": [
                {"add": {"table": {"family": "inet", "name": "tabby"}}},
                {"delete": {"table": {"family": "inet", "name": "tabby"}}},
                *({"add": o} for o in objs),
            ]
        }
    )
    cli = nft.NftCli(json=True)
    times = [_timed(lambda: cli.run(doc)) for _ in range(runs)]
    print("\nnft-cli-json:")
    _line("full apply only (nft -j -f, same table)", times, f"({len(doc) // 1024} KiB)")
    ttimes = [_timed(lambda: nft.NftCli().run(r.full(snap))) for _ in range(runs)]
    _line("full apply only, text (nft -f), for comparison", ttimes)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--local", type=int, default=1000)
    ap.add_argument("--remote", type=int, default=0)
    ap.add_argument("--policies", type=int, default=200)
    ap.add_argument("--runs", type=int, default=7)
    ap.add_argument("--backend", default="libnftables,nft-cli")
    ap.add_argument("--no-json", action="store_true")
    record.add_argument(ap, "policy_bench")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    state = cluster(args.local, args.remote, args.policies)
    print(
        f"cluster: {args.local} local + {args.remote} remote endpoints, {args.policies} policies,"
        f" {NAMESPACES} namespaces; {args.runs} runs each"
    )
    name = f"tbybench{os.getpid()}-{os.urandom(3).hex()}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        path = f"/run/netns/{name}"
        snap = measure_parts(state, args.runs)
        for b in args.backend.split(","):
            _in_netns(path, lambda b=b: measure(b, state, args.runs))  # type: ignore[misc]
        if not args.no_json:
            _in_netns(path, lambda: measure_json(nft.NftCli(), snap, args.runs))
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "policy_bench"))
