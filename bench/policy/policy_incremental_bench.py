#!/usr/bin/env python3
"""NetworkPolicy per event: the incremental engine against the full recompute, by cluster size.

    python3 -m bench.policy.policy_incremental_bench [--sizes 1000,5000,20000] [--policies 200]
                                              [--local 110] [--events 200] [--kernel]

The synthetic cluster of ``bench/policy/policy_bench.py`` (20 namespaces, ``--policies`` policies
mixing default deny, same-namespace selectors, namespaceSelector AND podSelector, ipBlocks,
named ports, egress to DNS), ``--local`` endpoints on this node and the rest on others. For
each size it loads the cluster into :class:`policy.incremental.IncrementalPolicy` and prints
the CPU time (this process, ``time.process_time``) per event, p50 and p90 over ``--events``
events, each one the engine change plus its delta rendered as nft text:

* a remote pod starts (its Pod, then its WorkloadEndpoint) / its endpoint goes;
* a remote pod relabelled (its endpoint moves between sets);
* a local pod starts (the CNI ADD path: its chains, its program, its map entries);
* a namespace relabelled (namespaceSelector sets);
* a policy added / removed (its chains and sets, the programs it selects);

and, for comparison, the full path tabby-node took before for ONE remote endpoint event:
``engine.compute`` of the whole cluster plus the difference of the two states
(``Renderer.delta``); and what the periodic check costs (``PolicyDataplane.sync`` with the
same inputs: full computation, comparison, no kernel). Also: the load (a tabby-node start),
and the engine's memory once loaded (``tracemalloc``, at the largest size).

With ``--kernel`` (root), each event also goes through ``PolicyDataplane`` into a network
namespace made here (libnftables), so the time includes the nft transaction; the namespace is
deleted at the end, pass or fail. Timings are numbers to read, never a pass or fail.

With ``--calico N``, N Calico GlobalNetworkPolicies in a tier ``security`` (Deny of one app,
Pass of the rest) are added: the engine is then in Calico's model, followed change by change
as well (policy/DESIGN.md "Calico's model"), and the numbers show what that costs.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from bench import record
from bench.policy import policy_bench as pb
from bench.stats import pct
from dataplane import nft
from dataplane.netns import open_netns, run_in_netns
from policy import engine
from policy.calico import CalicoPolicy, CalicoRule, Direction, EntityMatch, Tier
from policy.engine import (
    ClusterState,
    LabelSelector,
    Namespace,
    NatConfig,
    Peer,
    Policy,
    PortSpec,
    Rule,
)
from policy.incremental import IncrementalPolicy
from policy.render import Renderer, Snapshot
from policy.state import PolicyDataplane
from resources.selector import policy_selector, rule_selector


def _line(label: str, seconds: list[float], extra: str = "") -> None:
    ms = [s * 1000 for s in seconds]
    print(f"  {label:<46} p50 {pct(ms, 50):9.3f} ms  p90 {pct(ms, 90):9.3f} ms {extra}")


def _cpu(fn: Callable[[], Any]) -> float:
    t = time.process_time()
    fn()
    return time.process_time() - t


Step = Callable[[Callable[[], Any]], float]


def remote_relabels(
    eng: IncrementalPolicy, state: ClusterState, n: int, step: Step, settle: Callable[[], Any]
) -> list[float]:
    """``n`` remote pods relabelled (their endpoints move between sets), each put back."""
    out = []
    remote = [e for e in state.endpoints if e.node != pb.NODE]
    pods = {(p.namespace, p.name): p for p in state.pods}
    for i in range(n):
        ep = remote[(i * 7919) % len(remote)]
        pod = pods[(ep.namespace, ep.pod)]
        moved = dataclasses.replace(
            pod, labels=(("app", f"app{(i + 3) % pb.APPS}"), ("tier", "web"))
        )
        out.append(step(lambda moved=moved: eng.put_pod(moved)))
        eng.put_pod(pod)
        settle()
    return out


def local_starts(
    eng: IncrementalPolicy, first: int, n: int, step: Step, settle: Callable[[], Any]
) -> list[float]:
    """``n`` pods started on this node (the CNI ADD path), each removed again."""
    out = []
    for i in range(n):
        pod, ep = pb._pod(first + i, pb.NODE)
        out.append(step(lambda pod=pod, ep=ep: (eng.put_pod(pod), eng.put_endpoint(ep))))
        eng.remove_endpoint(ep.namespace, ep.name)
        eng.remove_pod(pod.namespace, pod.name)
        settle()
    return out


def _events(
    eng: IncrementalPolicy,
    state: ClusterState,
    n: int,
    step: Step,
    settle: Callable[[], Any],
) -> Iterator[tuple[str, list[float], str]]:
    """(label, CPU seconds per event, note) for each kind of event: ``step`` times one
    event and sends its delta; ``settle`` sends the untimed changes that undo it."""
    base = len(state.endpoints) + 1_000_000
    adds, dels = [], []
    for i in range(n):
        pod, ep = pb._pod(base + i, "node-far")
        adds.append(step(lambda pod=pod, ep=ep: (eng.put_pod(pod), eng.put_endpoint(ep))))
        dels.append(step(lambda ep=ep: eng.remove_endpoint(ep.namespace, ep.name)))
        eng.remove_pod(pod.namespace, pod.name)
        settle()
    yield "remote pod starts (Pod + endpoint)", adds, ""
    yield "remote endpoint removed", dels, ""
    yield "remote pod relabelled (app, tier)", remote_relabels(eng, state, n, step, settle), ""
    local_adds = local_starts(eng, base + n, n, step, settle)
    yield "local pod starts (CNI ADD: chains, program)", local_adds, ""
    ns_relabel = []
    for i in range(n):
        ns = state.namespaces[i % len(state.namespaces)]
        other = Namespace(ns.name, (("team", f"t{(i + 1) % 4}"), ("env", "prod")))
        ns_relabel.append(step(lambda other=other: eng.put_namespace(other)))
        eng.put_namespace(ns)
        settle()
    yield "namespace relabelled (team, env)", ns_relabel, ""
    pol_add, pol_del = [], []
    for i in range(n):
        p = dataclasses.replace(pb._policy(i % 8 + 8 * (i % 25)), name=f"bench-new-{i}")
        if i % 2:
            p = dataclasses.replace(p, pod_selector=LabelSelector.of({"tier": "db"}))
        pol_add.append(step(lambda p=p: eng.put_policy(p)))
        pol_del.append(step(lambda p=p: eng.remove_policy(p.namespace, p.name)))
    yield "policy added (selectors in use: sets shared)", pol_add, ""
    yield "policy removed", pol_del, ""
    scans = []
    for i in range(max(3, n // 10)):
        # a selector no set has yet, over every namespace: its set is filled by a scan
        peer = Peer(LabelSelector.of({"tier": "web", "app": f"app{i % pb.APPS}"}), LabelSelector())
        rule = Rule((peer,), (PortSpec("TCP", 1000 + i),))
        p = Policy(f"ns{i % pb.NAMESPACES}", f"bench-scan-{i}", LabelSelector(), (rule,))
        scans.append(step(lambda p=p: eng.put_policy(p)))
        eng.remove_policy(p.namespace, p.name)
        settle()
    yield "policy added, new cluster-wide selector", scans, "(its set: a scan of all endpoints)"


def engine_memory(state: ClusterState) -> float:
    """MiB the engine holds once loaded (the inputs themselves are shared with ``state``)."""
    tracemalloc.start()
    try:
        eng = IncrementalPolicy(pb.NODE, (4,))
        eng.load(state)
        eng.take_delta()
        used, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return used / 2**20


def measure_engine(state: ClusterState, events: int, memory: bool) -> None:
    r = Renderer()
    eng = IncrementalPolicy(pb.NODE, (4,))
    load = _cpu(lambda: eng.load(state))
    eng.take_delta()
    ir = eng.desired()
    elements = sum(len(e) for e in ir.elements.values())
    note = f"({len(ir.sets)} sets, {elements} elements, {len(ir.chains)} chains)"
    _line("load (a start: every input, every set filled)", [load], note)

    def step(fn: Callable[[], Any]) -> float:
        t = time.process_time()
        fn()
        d = eng.take_delta()
        r.incremental(d)
        return time.process_time() - t

    for label, values, extra in _events(eng, state, events, step, lambda: step(lambda: None)):
        _line(label, values, extra)
    # the full path, one remote endpoint event (as tabby-node did for every event anywhere)
    snap = Snapshot(engine.compute(state, pb.NODE, (4,)), NatConfig())
    full = []
    for i in range(max(3, min(events, 9))):
        pod, ep = pb._pod(len(state.endpoints) + 2_000_000 + i, "node-far")
        grown = dataclasses.replace(
            state, pods=(*state.pods, pod), endpoints=(*state.endpoints, ep)
        )

        def one(grown: ClusterState = grown) -> None:
            new = Snapshot(engine.compute(grown, pb.NODE, (4,)), NatConfig())
            r.delta(snap, new)

        full.append(_cpu(one))
    _line("FULL PATH: compute + diff, one remote event", full)
    # the periodic check: PolicyDataplane.sync with equal inputs (no kernel: a recorder)
    dp = PolicyDataplane(pb.NODE, backend=_Null(), families=(4,))
    dp.sync(state)
    checks = [_cpu(lambda: dp.sync(state)) for _ in range(3)]
    _line("periodic check (sync: compute, compare)", checks)
    if memory:
        print(f"  engine memory once loaded: {engine_memory(state):.1f} MiB (tracemalloc)")


class _Null:
    name = "null"

    def run(self, text: str) -> str:
        return ""


def measure_kernel(state: ClusterState, events: int) -> None:
    """The same events through PolicyDataplane into a real table (libnftables)."""
    dp = PolicyDataplane(pb.NODE, backend=nft.backend_named("libnftables"), families=(4,))
    start = _cpu(lambda: dp.sync(state))
    _line("start: load + full table (kernel)", [start])
    eng = dp._engine  # the events drive the engine; each step sends its delta

    def step(fn: Callable[[], Any]) -> float:
        t = time.process_time()
        with dp._lock:
            fn()
            res = dp._program(time.monotonic(), False)
        assert not res.full, res
        return time.process_time() - t

    for label, values, extra in _events(eng, state, events, step, lambda: step(lambda: None)):
        _line(label + " + nft", values, extra)
    c = dp.counters
    print(f"  applies {c.applies}, full {c.full_applies}, errors {c.apply_errors}")


def calico_policies(n: int) -> tuple[CalicoPolicy, ...]:
    """``n`` GlobalNetworkPolicies of tier security: each on one app, denying TCP from
    another app and passing the rest on."""
    out = []
    for i in range(n):
        sel = policy_selector(f"app == 'app{i % pb.APPS}'")
        peer = rule_selector(f"app == 'app{(i + 1) % pb.APPS}'")
        rules = (
            CalicoRule("Deny", protocol=6, source=EntityMatch(selector=peer)),
            CalicoRule("Pass"),
        )
        types: frozenset[Direction] = frozenset({"ingress"})
        out.append(CalicoPolicy(f"g{i}", None, sel, "security", float(i), types, rules))
    return tuple(out)


T = TypeVar("T")


@contextlib.contextmanager
def scratch_netns(prefix: str, made: bool) -> Iterator[Callable[[Callable[[], T]], T]]:
    """When ``made``, a network namespace of this process's own (``<prefix><pid>``), deleted
    on the way out, pass or fail; yields a runner of a function inside it (a thread that
    entered it)."""
    name = f"{prefix}{os.getpid()}"

    def run(fn: Callable[[], T]) -> T:
        with open_netns(f"/run/netns/{name}") as handle:
            return run_in_netns(handle.fd, fn)

    if made:
        subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        yield run
    finally:
        if made:
            subprocess.run(["ip", "netns", "del", name], check=False)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sizes", default="1000,5000,20000")
    ap.add_argument("--policies", type=int, default=200)
    ap.add_argument("--local", type=int, default=110)
    ap.add_argument("--events", type=int, default=200)
    ap.add_argument("--kernel", action="store_true", help="also through nft in a netns (root)")
    ap.add_argument("--calico", type=int, default=0, help="Calico GlobalNetworkPolicies to add")
    record.add_argument(ap, "policy_incremental_bench")
    args = ap.parse_args()
    if args.kernel and os.geteuid() != 0:
        print("--kernel needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    sizes = [int(s) for s in args.sizes.split(",")]
    with scratch_netns("tbyincbench", args.kernel) as in_netns:
        for k, size in enumerate(sizes):
            state = pb.cluster(args.local, size - args.local, args.policies)
            if args.calico:
                state = dataclasses.replace(
                    state,
                    calico_policies=calico_policies(args.calico),
                    tiers=(Tier("security", 10),),
                )
            print(
                f"\n{size} endpoints ({args.local} local), {args.policies} policies,"
                f" {args.calico} Calico policies,"
                f" {pb.NAMESPACES} namespaces; CPU per event, {args.events} events each:"
            )
            measure_engine(state, args.events, memory=k == len(sizes) - 1)
            if args.kernel:
                in_netns(lambda st=state: measure_kernel(st, args.events))
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "policy_incremental_bench"))
