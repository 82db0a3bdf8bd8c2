#!/usr/bin/env python3
"""Calico's policy model at the issue's scale: what one change costs a node, by number of
GlobalNetworkPolicies (issue 30's target: a policy or label change enforced on every node
within 1 s p99, costing a node CPU in proportion to what it changes, not to the number of
policies; measured with 1,000 global policies and 20,000 endpoints).

    python3 -m bench.policy.policy_calico_scale_bench [--endpoints 20000] [--calico 0,1,1000]
                                                [--policies 200] [--events 10] [--kernel]

The synthetic cluster of ``bench/policy/policy_bench.py`` (``--endpoints`` endpoints, 110 on
this node, 20 namespaces, ``--policies`` Kubernetes NetworkPolicies) plus, for each count of
``--calico``, that many GlobalNetworkPolicies in a tier ``security``
(``policy_incremental_bench.calico_policies``: each selects one app, denies TCP from another
and passes the rest on). For each count, per event (``--events`` of each):

* (a) a remote pod relabelled (its endpoint moves between selector sets);
* (b) a policy changed: one GlobalNetworkPolicy's rules (with 0 Calico policies: one
  Kubernetes NetworkPolicy's podSelector), put back afterwards;
* (c) a pod started on this node (the CNI ADD path).

Printed: the CPU of this process (``time.process_time``) and the wall time per event, p50
and max, from the change entering the engine to its delta rendered (with ``--kernel``, root:
applied by ``PolicyDataplane`` into nftables in a network namespace made here and deleted at
the end, pass or fail). The wall time is what a node adds to the watch's delivery before the
change is enforced. Numbers to read, never a pass or fail.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import record
from bench.policy import policy_bench as pb
from bench.policy.policy_incremental_bench import (
    calico_policies,
    local_starts,
    remote_relabels,
    scratch_netns,
)
from bench.stats import pct
from dataplane import nft
from policy.calico import CalicoRule, EntityMatch, Tier
from policy.engine import ClusterState, LabelSelector
from policy.incremental import IncrementalPolicy, Update
from policy.render import Renderer
from policy.state import PolicyDataplane
from resources.selector import rule_selector

Timed = tuple[list[float], list[float]]  # CPU seconds, wall seconds per event


def _state(endpoints: int, local: int, policies: int, calico: int) -> ClusterState:
    state = pb.cluster(local, endpoints - local, policies)
    if not calico:
        return state
    return dataclasses.replace(
        state, calico_policies=calico_policies(calico), tiers=(Tier("security", 10),)
    )


def _policy_changes(
    eng: IncrementalPolicy,
    state: ClusterState,
    n: int,
    step: Callable[[Callable[[], Any]], float],
    settle: Callable[[], Any],
) -> list[float]:
    """``n`` policies changed and put back: a GlobalNetworkPolicy's rules (its Deny now of
    UDP from a third app) or, without Calico policies, a NetworkPolicy's podSelector."""
    out = []
    for i in range(n):
        if state.calico_policies:
            was = state.calico_policies[(i * 37) % len(state.calico_policies)]
            peer = rule_selector(f"app == 'app{(i + 2) % pb.APPS}'")
            rules = (
                CalicoRule("Deny", protocol=17, source=EntityMatch(selector=peer)),
                CalicoRule("Pass"),
            )
            now = dataclasses.replace(was, ingress=rules)
            out.append(step(lambda now=now: eng.apply([Update("calico-policy", now.key, now)])))
            eng.apply([Update("calico-policy", was.key, was)])
        else:
            k8s = state.policies[(i * 37) % len(state.policies)]
            changed = dataclasses.replace(k8s, pod_selector=LabelSelector.of({"tier": "db"}))
            out.append(step(lambda changed=changed: eng.put_policy(changed)))
            eng.put_policy(k8s)
        settle()
    return out


def _measure(
    eng: IncrementalPolicy,
    state: ClusterState,
    n: int,
    send: Callable[[], None],
) -> dict[str, Timed]:
    """The three events; ``send`` takes the engine's delta to the dataplane."""
    walls: list[float] = []

    def step(fn: Callable[[], Any]) -> float:
        t, w = time.process_time(), time.perf_counter()
        fn()
        send()
        walls.append(time.perf_counter() - w)
        return time.process_time() - t

    def settle() -> None:
        send()

    out: dict[str, Timed] = {}
    for label, run in (
        ("(a) remote pod relabelled", lambda: remote_relabels(eng, state, n, step, settle)),
        ("(b) policy changed", lambda: _policy_changes(eng, state, n, step, settle)),
        ("(c) local pod starts (CNI ADD)", lambda: local_starts(eng, 3_000_000, n, step, settle)),
    ):
        walls.clear()
        cpu = run()
        out[label] = (cpu, list(walls))
    return out


def engine_only(state: ClusterState, n: int) -> dict[str, Timed]:
    r = Renderer()
    eng = IncrementalPolicy(pb.NODE, (4,))
    load = time.process_time()
    eng.load(state)
    r.incremental(eng.take_delta())
    print(f"  load: {(time.process_time() - load) * 1000:.0f} ms of CPU")

    def send() -> None:
        r.incremental(eng.take_delta())

    return _measure(eng, state, n, send)


def kernel(state: ClusterState, n: int) -> dict[str, Timed]:
    dp = PolicyDataplane(pb.NODE, backend=nft.backend_named("libnftables"), families=(4,))
    load = time.process_time()
    dp.sync(state)
    print(f"  start (load + full table into nftables): {time.process_time() - load:.2f} s of CPU")

    def send() -> None:
        with dp._lock:
            res = dp._program(time.monotonic(), False)
        assert not res.full, res

    out = _measure(dp._engine, state, n, send)
    c = dp.counters
    print(f"  nft applies {c.applies}, full {c.full_applies}, errors {c.apply_errors}")
    return out


def _ms(values: list[float], q: float) -> str:
    return f"{pct([v * 1000 for v in values], q):9.1f}"


def report(results: dict[int, dict[str, Timed]]) -> None:
    print("\nms per event (p50, max): CPU of the node's process; wall time until enforced")
    print(f"{'event':<32} {'GNPs':>5} {'CPU p50':>9} {'max':>8} {'wall p50':>9} {'max':>8}")
    for label in next(iter(results.values())):
        for k, (count, by_event) in enumerate(results.items()):
            cpu, wall = by_event[label]
            cells = f"{_ms(cpu, 50)} {_ms(cpu, 100)} {_ms(wall, 50)} {_ms(wall, 100)}"
            print(f"{label if k == 0 else '':<32} {count:>5} {cells}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=20_000)
    ap.add_argument("--local", type=int, default=110)
    ap.add_argument("--policies", type=int, default=200, help="Kubernetes NetworkPolicies")
    ap.add_argument("--calico", default="0,1,1000", help="GlobalNetworkPolicy counts")
    ap.add_argument("--events", type=int, default=10)
    ap.add_argument("--kernel", action="store_true", help="through nft in a netns (root)")
    record.add_argument(ap, "policy_calico_scale_bench")
    args = ap.parse_args()
    if args.kernel and os.geteuid() != 0:
        print("--kernel needs root (it creates a network namespace)", file=sys.stderr)
        return 2
    results: dict[int, dict[str, Timed]] = {}
    with scratch_netns("tbycalscale", args.kernel) as in_netns:
        for count in (int(c) for c in args.calico.split(",")):
            state = _state(args.endpoints, args.local, args.policies, count)
            print(
                f"\n{args.endpoints} endpoints ({args.local} local), {args.policies} Kubernetes"
                f" policies, {count} GlobalNetworkPolicies; {args.events} events each"
                f"{' (through nftables)' if args.kernel else ' (engine and rendering, no kernel)'}:"
            )
            sys.stdout.flush()
            if args.kernel:
                results[count] = in_netns(lambda st=state: kernel(st, args.events))
            else:
                results[count] = engine_only(state, args.events)
    report(results)
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "policy_calico_scale_bench"))
