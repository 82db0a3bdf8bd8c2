"""Benchmark (not a test): IPAM assign/release cost against pool occupancy, file store.

A /16 pool cut into /26 blocks (1024 blocks), one node, the file store in a temp directory.
For each occupancy level the pool is filled with ``Ipam.assign`` (fsync switched off while
filling, to keep the run short), then timed with fsync on:

- ``assign``/``release``: 200 x (assign a new handle, release it)
- ``churn``: 200 x (release a random existing handle, assign a new one), which also moves
  blocks in and out of the "full" hint
- ``(no fsync)``: 50 fresh pairs with fsync stubbed out: the CPU and syscall share, which is
  what occupancy could change; fsync latency is the disk's

Levels are measured interleaved (each round touches every level), so disk noise hits all
levels alike.

Cost must not grow with occupancy: no per-ADD read of every block.

    python -m bench.ipam.ipam_occupancy [--levels 1,50,95] [--pairs 200] [--dir /var/tmp]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time

from bench import record
from bench.stats import pct
from datastore.file import FileStore
from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id

POOL = "10.244.0.0/16"
BLOCK = 26
NODE = "node-a"


def request(n: int) -> AssignRequest:
    attrs = {
        "node": NODE,
        "network": "k8s-pod-network",
        "container_id": f"{n:064x}",
        "ifname": "eth0",
        "pod_namespace": "default",
        "pod_name": f"pod-{n}",
        "pod_uid": f"00000000-0000-0000-0000-{n:012x}",
        "time": time.time(),
    }
    return AssignRequest(
        handle_id("k8s-pod-network", f"{n:064x}", "eth0"), attrs, True, False, [POOL]
    )


def fill(ipam: Ipam, count: int) -> list[int]:
    real_fsync = os.fsync
    os.fsync = lambda fd: None  # filling only: durability is not what is measured here
    try:
        for n in range(count):
            ipam.assign(request(n))
    finally:
        os.fsync = real_fsync
    return list(range(count))


class Level:
    """One filled store; its timings accumulate over interleaved rounds."""

    def __init__(self, level: float, base: str) -> None:
        self.level = level
        self.tmp = tempfile.TemporaryDirectory(dir=base, prefix="tabby-bench-")
        self.store = FileStore(os.path.join(self.tmp.name, "ipam"))
        self.ipam = Ipam(self.store, NODE)
        self.ipam.ensure_pools([PoolSpec(POOL, BLOCK)])
        t0 = time.perf_counter()
        # Whole blocks plus one half-full block at every level: the block being filled is
        # read and written by every ADD, so its fill must not differ between levels.
        full_blocks = int((1 << 16) * level / 100) // 64
        self.live = fill(self.ipam, full_blocks * 64 + 32)
        self.fill_s = time.perf_counter() - t0
        self.rnd = random.Random(int(level * 100))  # noqa: S311 - a benchmark, not crypto
        self.next = 10_000_000
        self.times: dict[str, list[float]] = {}

    def _note(self, name: str, seconds: float) -> None:
        self.times.setdefault(name, []).append(seconds * 1e6)

    def fresh(self, tag: str) -> None:
        """Assign a new handle, release it."""
        self.next += 1
        req = request(self.next)
        t0 = time.perf_counter()
        self.ipam.assign(req)
        t1 = time.perf_counter()
        self.ipam.release_handle(req.handle_id)
        t2 = time.perf_counter()
        self._note(f"assign{tag}", t1 - t0)
        self._note(f"release{tag}", t2 - t1)

    def churn(self, tag: str) -> None:
        """Release a random existing handle, assign a new one (reuses the freed address)."""
        if not self.live:
            return
        victim = self.live.pop(self.rnd.randrange(len(self.live)))
        self.next += 1
        t0 = time.perf_counter()
        self.ipam.release_handle(request(victim).handle_id)
        t1 = time.perf_counter()
        self.ipam.assign(request(self.next))
        t2 = time.perf_counter()
        self.live.append(self.next)
        self._note(f"churn release{tag}", t1 - t0)
        self._note(f"churn assign{tag}", t2 - t1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--levels", default="1,95", help="occupancy percentages")
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--dir", default=None, help="where to put the temp stores")
    record.add_argument(parser, "ipam_occupancy")
    args = parser.parse_args()
    base = args.dir or tempfile.gettempdir()
    levels = []
    for pct_text in args.levels.split(","):
        lv = Level(float(pct_text), base)
        usage = lv.ipam.pool_usage()[0]
        print(
            f"# {lv.level:g}%: {usage.in_use} in use, {len(lv.store.list_keys('block'))} "
            f"blocks, filled in {lv.fill_s:.1f} s",
            file=sys.stderr,
        )
        levels.append(lv)
    # Interleaved: every round touches every level, so disk noise hits them alike.
    real_fsync = os.fsync
    for i in range(args.pairs):
        for lv in levels:
            lv.fresh("")
            lv.churn("")
        if i % 4 == 0:  # the same operations without fsync: the CPU and syscall share
            os.fsync = lambda fd: None
            try:
                for lv in levels:
                    lv.fresh(" (no fsync)")
            finally:
                os.fsync = real_fsync
    print(f"pool {POOL}, /{BLOCK} blocks, file store, {args.pairs} pairs per level, µs")
    print(f"{'occupancy':>9}  {'operation':<22} {'p50':>7} {'p90':>7} {'max':>7}")
    for lv in levels:
        for name, values in lv.times.items():
            print(
                f"{lv.level:>8g}%  {name:<22} {pct(values, 50):7.0f} {pct(values, 90):7.0f} "
                f"{max(values):7.0f}"
            )
        lv.tmp.cleanup()


if __name__ == "__main__":
    sys.exit(record.run(main, "ipam_occupancy"))
