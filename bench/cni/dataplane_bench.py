#!/usr/bin/env python3
"""Start-up and kernel-work cost of dataplane (needs root for the netns part).

    python3 -m bench.cni.dataplane_bench [--runs N] [--imports-only]

Prints, as p50 (and p90) over fresh processes or repeated calls:

* import cost in a fresh interpreter without ``site`` (like a frozen binary): the bare
  interpreter, ``import dataplane``, the data types, the module that loads
  pyroute2, and pyroute2 itself by the narrow and the package path;
* setup() and teardown() of a dual-stack pod in throwaway namespaces, warm (imports done);
* one whole "CNI call" worth of dataplane work in a fresh process: import + setup, and
  import + teardown.

Everything runs inside namespaces created here and deleted at the end, pass or fail.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys
import sysconfig
import time
from collections.abc import Callable
from functools import partial

from bench import record
from bench.stats import pct

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SITE = sysconfig.get_paths()["purelib"]

IMPORTS: list[tuple[str, str]] = [
    ("interpreter only (python -S -c pass)", ""),
    ("import dataplane", "import dataplane"),
    ("+ host_veth_name", "from dataplane import host_veth_name"),
    ("+ data types (SetupSpec, ...)", "from dataplane import SetupSpec, host_veth_name"),
    ("+ setup (loads pyroute2)", "from dataplane import setup"),
    ("from pyroute2.iproute.linux import IPRoute", "from pyroute2.iproute.linux import IPRoute"),
    ("from pyroute2 import IPRoute", "from pyroute2 import IPRoute"),
]


def _fmt(values: list[float]) -> str:
    return f"p50 {pct(values, 50):7.1f} ms   p90 {pct(values, 90):7.1f} ms"


def _fresh(code: str, extra_env: dict[str, str] | None = None) -> float:
    """Wall time of a fresh `python -S -E` that runs ``code`` (ms, includes start-up)."""
    prog = f"import sys; sys.path[:0] = [{REPO!r}, {SITE!r}]\n{code}"
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), **(extra_env or {})}
    t = time.perf_counter()
    subprocess.run([sys.executable, "-S", "-E", "-c", prog], check=True, env=env)
    return (time.perf_counter() - t) * 1e3


def bench_imports(runs: int) -> None:
    print(f"import cost, fresh `{sys.executable} -S -E` per run, {runs} runs (wall ms):")
    base: float | None = None
    for label, code in IMPORTS:
        times = [_fresh(code) for _ in range(runs)]
        p50 = pct(times, 50)
        extra = "" if base is None else f"   (+{p50 - base:6.1f} ms over bare)"
        base = p50 if base is None else base
        print(f"  {label:45s} {_fmt(times)}{extra}")


def bench_kernel(runs: int) -> None:
    import dataplane as dp
    from tests.privileged.netns_util import netns_pool

    addrs = [ipaddress.ip_address("10.244.9.1"), ipaddress.ip_address("fd00:10:244:9::1")]
    with netns_pool() as pool:
        node = pool.node()
        pods = [pool.pod() for _ in range(runs)]
        specs = [
            dp.SetupSpec(p.path, "eth0", dp.host_veth_name("cali", "bench", p.name, "eth0"), addrs)
            for p in pods
        ]

        def timed(fn: Callable[[], object]) -> float:
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3

        def loop() -> tuple[list[float], list[float], list[float]]:
            dp.get_dataplane()  # import pyroute2 outside the timings
            ups: list[float] = []
            checks: list[float] = []
            downs: list[float] = []
            for s in specs:
                ups.append(timed(partial(dp.setup, s)))
                checks.append(timed(partial(dp.check, s)))
                downs.append(
                    timed(partial(dp.teardown, s.netns_path, "eth0", s.host_ifname, addrs))
                )
            return ups, checks, downs

        ups, checks, downs = node.run(loop)
        print(f"\nkernel work, warm (pyroute2 already imported), dual-stack pod, {runs} runs:")
        print(f"  {'setup()':45s} {_fmt(ups)}")
        print(f"  {'check()':45s} {_fmt(checks)}")
        print(f"  {'teardown()':45s} {_fmt(downs)}")

        # One CNI call's worth of dataplane work in a fresh process. The child enters the
        # node namespace itself (ctypes, ~1.5 ms, before the clock starts) rather than via
        # `ip netns exec`, which would add a fork+exec to the measurement.
        child = (
            "import os, time, ctypes\n"
            "fd = os.open({node!r}, os.O_RDONLY); "
            "ctypes.CDLL(None, use_errno=True).setns(fd, 0x40000000)\n"
            "t = time.perf_counter()\n"
            "import ipaddress\n"
            "import dataplane as dp\n"
            "addrs = [ipaddress.ip_address(a) for a in ('10.244.9.1', 'fd00:10:244:9::1')]\n"
            "spec = dp.SetupSpec({pod!r}, 'eth0', {host!r}, addrs)\n"
            "{call}\n"
            "print((time.perf_counter() - t) * 1e3)\n"
        )
        cold_up: list[float] = []
        cold_down: list[float] = []
        for p, s in zip(pods, specs, strict=True):
            for call, out in (
                ("dp.setup(spec)", cold_up),
                ("dp.teardown(spec.netns_path, 'eth0', spec.host_ifname, addrs)", cold_down),
            ):
                code = child.format(node=node.path, pod=p.path, host=s.host_ifname, call=call)
                prog = f"import sys; sys.path[:0] = [{REPO!r}, {SITE!r}]\n{code}"
                res = subprocess.run(
                    [sys.executable, "-S", "-E", "-c", prog],
                    check=True,
                    capture_output=True,
                    text=True,
                )
                out.append(float(res.stdout.strip().splitlines()[-1]))
        print(f"\nfresh process (import + call, interpreter start-up excluded), {runs} runs:")
        print(f"  {'import + setup()':45s} {_fmt(cold_up)}")
        print(f"  {'import + teardown()':45s} {_fmt(cold_down)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--imports-only", action="store_true")
    record.add_argument(ap, "dataplane_bench")
    opts = ap.parse_args()
    bench_imports(opts.runs)
    if not opts.imports_only:
        if os.geteuid() != 0:
            print("\n(kernel part skipped: needs root)")
            return 0
        bench_kernel(opts.runs)
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "dataplane_bench"))
