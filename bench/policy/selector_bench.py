#!/usr/bin/env python3
"""Calico selectors (``resources.selector``): parse and match rates.

    python3 -m bench.policy.selector_bench [--endpoints 20000] [--selectors 1000] [--seconds 2]

A synthetic population shaped like the policy engine's worst case: ``--endpoints`` endpoint
label sets (own labels plus their namespace's under ``pcns.``, as ``endpoint_labels`` builds
them) and ``--selectors`` distinct selectors mixing every operator (equality, sets, has,
prefixes, negation, ``||`` groups, namespace scopes). Prints, per shape of selector:

* parses per second (uncached: every text distinct), and the cached re-parse rate;
* matches per second (one compiled selector against one label set), and how long one full
  cross product (every selector against every endpoint) would take on this core — the figure
  that says whether the incremental engine can afford a rescan.

CPU time of this process (``time.process_time``). Numbers to read, never a pass or fail.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable

from bench import record
from resources.selector import Selector, endpoint_labels, parse_selector

SHAPES: dict[str, Callable[[random.Random, int], str]] = {
    "equality": lambda r, i: f"app == 'app-{i}'",
    "set": lambda r, i: f"tier in {{'t{i}', 't{i + 1}', 't{i + 2}'}} && env != 'dev'",
    "has / negation": lambda r, i: f"has(app) && !has(quarantine-{i}) && !(env == 'test')",
    "prefix / contains": lambda r, i: (
        f"k8s.io/name starts with 'svc-{i % 50}' || k8s.io/name contains '-{i}-'"
    ),
    "policy-like": lambda r, i: (
        f"(app == 'app-{i % 200}' || role in {{'api', 'web-{i % 7}'}}) && pcns.team == "
        f"'team-{i % 20}' && has(projectcalico.org/namespace) && version not in {{'v0', 'v{i}'}}"
    ),
}


def endpoints(rng: random.Random, count: int) -> list[dict[str, str]]:
    out = []
    for i in range(count):
        own = {
            "app": f"app-{rng.randrange(200)}",
            "role": rng.choice(["api", "web-1", "db", "cache"]),
            "env": rng.choice(["prod", "dev", "test"]),
            "tier": f"t{rng.randrange(1000)}",
            "version": f"v{rng.randrange(5)}",
            "k8s.io/name": f"svc-{rng.randrange(50)}-{i}-x",
        }
        ns = f"ns-{rng.randrange(20)}"
        out.append(endpoint_labels(own, namespace=ns, namespace_labels={"team": f"team-{ns[3:]}"}))
    return out


def rate(count: int, seconds: float) -> str:
    return f"{count / seconds:,.0f}/s" if seconds > 0 else "-"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--endpoints", type=int, default=20000)
    ap.add_argument("--selectors", type=int, default=1000)
    ap.add_argument("--seconds", type=float, default=2.0, help="time spent matching per shape")
    record.add_argument(ap, "selector_bench")
    args = ap.parse_args()
    rng = random.Random(7)  # noqa: S311 - a benchmark, not crypto
    eps = endpoints(rng, args.endpoints)
    print(
        f"{args.endpoints} endpoints ({sum(map(len, eps)) / len(eps):.1f} labels each),"
        f" {args.selectors} selectors per shape"
    )
    print(
        f"{'shape':<18} {'parse':>12} {'cached':>12} {'match':>12} {'cross product':>14}"
        "   e.g. canonical text"
    )
    for name, make in SHAPES.items():
        # a unique suffix so no text repeats (parse_selector caches by text)
        texts = [
            f"{make(rng, i)} && run != 'r{time.monotonic_ns()}-{i}'" for i in range(args.selectors)
        ]
        t0 = time.process_time()
        sels: list[Selector] = [parse_selector(t) for t in texts]
        parse_s = time.process_time() - t0
        t0 = time.process_time()
        for t in texts:
            parse_selector(t)
        cached_s = time.process_time() - t0
        n = 0
        selected = 0
        t0 = time.process_time()
        deadline = t0 + args.seconds
        while time.process_time() < deadline:
            for sel in sels[:50]:
                match = sel.matches
                for labels in eps[:2000]:
                    selected += match(labels)
                n += 2000
        match_s = time.process_time() - t0
        per_match = match_s / n
        cross = per_match * args.endpoints * args.selectors
        print(
            f"{name:<18} {rate(len(texts), parse_s):>12} {rate(len(texts), cached_s):>12}"
            f" {rate(n, match_s):>12} {cross:>12.1f} s   {str(sels[0])[:60]}"
        )
        print(f"{'':<18} ({selected / n:.1%} of pairs match)")
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "selector_bench"))
