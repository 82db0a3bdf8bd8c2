#!/usr/bin/env python3
"""What the BIRD backend (bird) costs and how fast it converges (root).

    python3 -m bench.routing.bird_bench [--nodes 3] [--runs 20]

Builds an underlay (a bridge namespace and N node namespaces, 10.251.0.X/24), starts one
BirdSupervisor (one ``bird``) per node in a full mesh, then prints:

* render + check: render() of 100 peers and 1000 blocks, and ``bird -p`` of it;
* mesh up: from the first start() until every session is Established and every node's
  kernel has every other node's block;
* apply(): p50/p90 of one reload (render, ``bird -p``, write, ``configure``) adding a block;
* block added -> route on another node: p50/p90 from apply() to the route in that node's
  kernel (polled every 2 ms), and the same for a withdrawal;
* BIRD SIGKILLed -> a new BIRD with every session Established again.

Everything runs inside namespaces made here and deleted at the end, pass or fail.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from bench import record
from bench.stats import pct
from bird import (
    BirdConfig,
    BirdNode,
    BirdSupervisor,
    Peer,
    PeerType,
    Pool,
    check_config,
    render,
)
from dataplane.netns import open_netns, run_in_netns

T = TypeVar("T")
POOL = Pool(ipaddress.ip_network("10.244.0.0/16"))


def sh(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    """Run ``fn`` in a thread that entered namespace ``ns`` (what it starts stays there)."""
    with open_netns(f"/run/netns/{ns}") as handle:
        return run_in_netns(handle.fd, fn)


def wait(check: Callable[[], bool], timeout: float = 30.0, step: float = 0.002) -> float:
    start = time.monotonic()
    while not check():
        if time.monotonic() - start > timeout:
            raise TimeoutError("timed out")
        time.sleep(step)
    return time.monotonic() - start


def has_route(ns: str, prefix: str) -> bool:
    return bool(sh("ip", "-n", ns, "route", "show", "proto", "bird", prefix).strip())


def no_route(ns: str, prefix: str) -> bool:
    return not has_route(ns, prefix)


def all_up(sup: BirdSupervisor) -> bool:
    return all(p.established for p in sup.peers())


def since(sup: BirdSupervisor) -> list[str]:
    return [p.since for p in sup.peers()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3)
    parser.add_argument("--runs", type=int, default=20)
    record.add_argument(parser, "bird_bench")
    args = parser.parse_args()
    sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]

    peers = tuple(
        Peer(ipaddress.IPv4Address(f"10.0.{i // 250}.{i % 250 + 2}"), PeerType.MESH)
        for i in range(100)
    )
    blocks = tuple(ipaddress.IPv4Network(f"10.244.{i // 4}.{(i % 4) * 64}/26") for i in range(1000))
    big = BirdConfig(
        node=BirdNode("a", ipaddress.IPv4Address("10.0.0.1")),
        peers=peers,
        pools=(POOL,),
        blocks=blocks,
    )
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        text = render(big)
        times.append(time.perf_counter() - t0)
    tmp = tempfile.mkdtemp(prefix="bird-bench-")
    path = os.path.join(tmp, "big.conf")
    with open(path, "w") as f:
        f.write(text)
    checks = []
    for _ in range(10):
        t0 = time.perf_counter()
        check_config(path)
        checks.append(time.perf_counter() - t0)
    print(
        f"render 100 peers + 1000 blocks ({len(text)} bytes): p50 {pct(times, 50) * 1e3:.1f} ms",
    )
    print(
        f"bird -p of it:                                  p50 {pct(checks, 50) * 1e3:.1f} ms",
    )

    tag = f"tbybench{os.getpid()}-{secrets.token_hex(2)}"
    bridge = f"{tag}-ul"
    names = [f"{tag}-n{i}" for i in range(1, args.nodes + 1)]
    addrs = [ipaddress.IPv4Address(f"10.251.0.{i}") for i in range(1, args.nodes + 1)]
    made: list[str] = []
    sups: list[BirdSupervisor] = []
    try:
        sh("ip", "netns", "add", bridge)
        made.append(bridge)
        sh("ip", "-n", bridge, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", bridge, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(names, addrs, strict=True), 1):
            sh("ip", "netns", "add", ns)
            made.append(ns)
            sh("ip", "-n", bridge, "link", "add", f"p{i}", "type", "veth", "peer", "name", "eth0",
               "netns", ns)  # fmt: skip
            sh("ip", "-n", bridge, "link", "set", f"p{i}", "master", "br0", "up")
            sh("ip", "-n", ns, "addr", "add", f"{addr}/24", "dev", "eth0")
            sh("ip", "-n", ns, "link", "set", "eth0", "up")

        def config(i: int, extra: tuple[ipaddress.IPv4Network, ...] = ()) -> BirdConfig:
            return BirdConfig(
                node=BirdNode(names[i], addrs[i]),
                peers=tuple(Peer(a, PeerType.MESH) for a in addrs if a != addrs[i]),
                pools=(POOL,),
                blocks=(ipaddress.IPv4Network(f"10.244.{i + 1}.0/26"), *extra),
            )

        t0 = time.monotonic()
        for i, ns in enumerate(names):
            sup = BirdSupervisor(os.path.join(tmp, f"n{i}"))
            sups.append(sup)
            in_netns(ns, partial(sup.start, config(i)))
        for sup in sups:
            wait(partial(all_up, sup), step=0.01)
        for i, ns in enumerate(names):
            for j in range(args.nodes):
                if j != i:
                    wait(partial(has_route, ns, f"10.244.{j + 1}.0/26"), step=0.01)
        print(
            f"mesh of {args.nodes} up (sessions + routes):        {time.monotonic() - t0:.2f} s",
        )

        sessions = since(sups[1])
        applies, adds, withdraws = [], [], []
        for run in range(args.runs):
            block = ipaddress.IPv4Network(f"10.244.{100 + run}.0/26")
            t0 = time.monotonic()
            sups[0].apply(config(0, (block,)))
            applies.append(time.monotonic() - t0)
            adds.append(wait(partial(has_route, names[1], str(block))) + applies[-1])
            t0 = time.monotonic()
            sups[0].apply(config(0))
            withdraws.append(wait(partial(no_route, names[1], str(block))) + time.monotonic() - t0)
        for label, values in (
            ("apply() (render, bird -p, configure)", applies),
            ("block added -> route on another node", adds),
            ("block withdrawn -> route gone there", withdraws),
        ):
            print(
                f"{label:<40} p50 {pct(values, 50) * 1e3:6.1f} ms  "
                f"p90 {pct(values, 90) * 1e3:6.1f} ms  (n={len(values)})"
            )
        resets = sum(a != b for a, b in zip(sessions, since(sups[1]), strict=True))
        print(f"sessions reset by those {2 * args.runs} reloads: {resets}")

        old = sups[-1].pid
        assert old is not None
        t0 = time.monotonic()
        os.kill(old, signal.SIGKILL)
        wait(lambda: sups[-1].pid not in (None, old), step=0.01)
        restarted = time.monotonic() - t0
        wait(partial(all_up, sups[-1]), step=0.01)
        print(
            f"BIRD SIGKILLed -> running again {restarted:.2f} s, "
            f"sessions Established {time.monotonic() - t0:.2f} s"
        )
    finally:
        for sup in sups:
            try:
                sup.stop()
            except Exception as exc:
                print(f"stop: {exc}", file=sys.stderr)
        for ns in reversed(made):
            subprocess.run(["ip", "netns", "del", ns], check=False)
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(record.run(main, "bird_bench"))
