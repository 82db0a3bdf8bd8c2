#!/usr/bin/env python3
"""What the policy counters (``--policy-visibility``) cost on the data path (needs root).

    python3 -m bench.policy.policy_counters_bench [--reps 3] [--seconds 4] [--policies 200]
                                           [--conditions none,1-off,1-on,200-off,200-on]

A node namespace routes between two pod namespaces (client, server) over veths named as
tabby names them; table ``inet tabby`` is programmed in the node namespace by tabby's own
``policy.state.PolicyDataplane`` with ``visibility`` on (counters and the denied-flow log)
or off. The server's namespace is isolated for ingress; one policy (``zz-allow-client``)
allows the client on the measured ports; with ``--policies N`` the other N-1 policies select
the server too, each allowing a peer and a port the client does not have, and come first
(a pod's policies are tried in name order): a new connection is tried against every one of
them before the allowing one, a denied packet against all N.

Conditions: ``none`` (no table), then ``P-off``/``P-on`` for P policies. They are
interleaved (every condition once per repetition, the order rotating) so that a load change
on this shared machine hits all of them alike. Per condition it reports the median of:

* stream: one TCP stream (iperf3, ``--seconds``): Gbit/s and the CPU seconds per GB of
  both iperf3 processes (their own user+system, from iperf3), the forwarding in softirq
  mostly accounted to the sender;
* conn/s: new TCP connections a second, one at a time (connect, accept, close with RST so
  no TIME_WAIT piles up): the rate, and the CPU microseconds per connection of client and
  server (/proc/PID/stat), forwarding included as above;
* denied: UDP datagrams to a port no policy allows (each one NEW for conntrack, so every
  one goes through the endpoint chain, the default-deny counter and the log chain's
  once-per-flow test): datagrams a second sent and the sender's CPU nanoseconds each;

with the 1-minute load average beside it, then the on/off ratios paired by repetition. With
visibility on, the counters are read back at the end (``PolicyDataplane.packet_counts``):
the allowed connections and denied datagrams must show up, else the run is void.

Everything is created under a random prefix and deleted at the end (processes stopped by
PID), also on failure or Ctrl-C. Needs iperf3 (apt-get install iperf3) and nftables.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TypeVar

from bench import record
from bench.stats import pct
from dataplane.netns import open_netns, run_in_netns
from policy.engine import (
    ClusterState,
    Endpoint,
    LabelSelector,
    Namespace,
    Peer,
    Pod,
    Policy,
    PortSpec,
    Rule,
)
from policy.state import PolicyDataplane

T = TypeVar("T")
NS = "bench"
NODE = "bench-node"
CLIENT, SERVER = "10.213.1.2", "10.213.2.2"
IPERF_PORT, CONN_PORT, DENIED_PORT = 5201, 5202, 6000
#: a pod's policies are tried in name order: the allowing one comes last (the worst case)
ALLOW = "zz-allow-client"
CLK_TCK = os.sysconf("SC_CLK_TCK")

CONN_SERVER = r"""
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1024)
print("ready", flush=True)
while True:
    c, _ = s.accept()
    c.close()
"""

#: connect + close (RST) for SECONDS; prints the count and its own CPU seconds
CONN_CLIENT = r"""
import resource, socket, struct, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
linger = struct.pack("ii", 1, 0)
n = 0
start = time.monotonic(); end = start + seconds
while time.monotonic() < end:
    c = socket.socket()
    c.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, linger)
    c.connect((host, port))
    c.close()
    n += 1
wall = time.monotonic() - start
r = resource.getrusage(resource.RUSAGE_SELF)
print(n, wall, r.ru_utime + r.ru_stime)
"""

#: UDP datagrams to a denied port for SECONDS from one socket; count, wall, CPU seconds
UDP_FLOOD = r"""
import resource, socket, sys, time
host, port, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
payload = b"x" * 64
n = 0
start = time.monotonic(); end = start + seconds
while time.monotonic() < end:
    for _ in range(100):
        s.sendto(payload, (host, port))
    n += 100
wall = time.monotonic() - start
r = resource.getrusage(resource.RUSAGE_SELF)
print(n, wall, r.ru_utime + r.ru_stime)
"""


def run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip()}")
    return proc


@dataclass
class Topology:
    prefix: str
    made: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen[str]] = field(default_factory=list)

    @property
    def node(self) -> str:
        return f"{self.prefix}-node"

    @property
    def client(self) -> str:
        return f"{self.prefix}-cli"

    @property
    def server(self) -> str:
        return f"{self.prefix}-srv"

    @staticmethod
    def iface(i: int) -> str:
        return f"cali{i:011x}"  # tabby's host-side name: prefix + 11 hex digits

    def build(self) -> None:
        for ns in (self.node, self.client, self.server):
            self.made.append(ns)
            run("ip", "netns", "add", ns)
            run("ip", "-n", ns, "link", "set", "lo", "up")
        run("ip", "netns", "exec", self.node, "sysctl", "-qw", "net.ipv4.ip_forward=1")
        for i, (pod, addr) in enumerate(((self.client, CLIENT), (self.server, SERVER)), 1):
            host = self.iface(i)
            gw = addr.rsplit(".", 1)[0] + ".1"
            run("ip", "-n", self.node, "link", "add", host, "type", "veth", "peer", "eth0",
                "netns", pod)  # fmt: skip
            run("ip", "-n", self.node, "addr", "add", f"{gw}/24", "dev", host)
            run("ip", "-n", self.node, "link", "set", host, "up")
            run("ip", "-n", pod, "addr", "add", f"{addr}/24", "dev", "eth0")
            run("ip", "-n", pod, "link", "set", "eth0", "up")
            run("ip", "-n", pod, "route", "add", "default", "via", gw)

    def spawn(self, ns: str, *argv: str) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            ["ip", "netns", "exec", ns, *argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def stop(self, proc: subprocess.Popen[str]) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=10)
        if proc in self.procs:
            self.procs.remove(proc)

    def teardown(self) -> None:
        for proc in list(self.procs):
            self.stop(proc)
        for ns in reversed(self.made):
            run("ip", "netns", "delete", ns, check=False)
        self.made.clear()


def in_netns(ns: str, fn: Callable[[], T]) -> T:
    with open_netns(f"/run/netns/{ns}") as handle:
        return run_in_netns(handle.fd, fn)


def state(policies: int) -> ClusterState:
    """Namespace ``bench``: the client (app=client) and the server (app=server); the
    server isolated for ingress by ``policies`` policies, one of which allows the client."""
    pods = (
        Pod(NS, "client", (("app", "client"),)),
        Pod(NS, "server", (("app", "server"),)),
    )
    eps = (
        Endpoint(NS, "client", NODE, Topology.iface(1), (CLIENT,), "client-eth0"),
        Endpoint(NS, "server", NODE, Topology.iface(2), (SERVER,), "server-eth0"),
    )
    server = LabelSelector.of({"app": "server"})
    allow = Rule(
        (Peer(LabelSelector.of({"app": "client"})),),
        (PortSpec("TCP", IPERF_PORT), PortSpec("TCP", CONN_PORT)),
    )
    pols = [Policy(NS, ALLOW, server, (allow,))]
    for j in range(policies - 1):
        other = Rule((Peer(LabelSelector.of({"app": f"other{j}"})),), (PortSpec("TCP", 10000 + j),))
        pols.append(Policy(NS, f"other-{j:03d}", server, (other,)))
    nss = (Namespace(NS, (("kubernetes.io/metadata.name", NS),)),)
    return ClusterState(tuple(pols), nss, pods, eps)


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat", encoding="ascii") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime


@dataclass
class Sample:
    gbits: float
    stream_cpu_per_gb: float
    conns: float
    conn_cpu_us: float
    denied: float
    denied_cpu_ns: float
    load: float


def measure(topo: Topology, seconds: float) -> Sample:
    load = os.getloadavg()[0]
    # stream
    server = topo.spawn(topo.server, "iperf3", "-s", "-1", "-p", str(IPERF_PORT))
    time.sleep(0.3)
    out = run(
        "ip", "netns", "exec", topo.client, "iperf3", "-c", SERVER, "-p", str(IPERF_PORT),
        "-t", str(max(1, round(seconds))), "-J",
    )  # fmt: skip
    topo.stop(server)
    report = json.loads(out.stdout)
    end = report["end"]
    gbits = end["sum_received"]["bits_per_second"] / 1e9
    gb = end["sum_received"]["bytes"] / 1e9
    cpu = end["cpu_utilization_percent"]
    wall = end["sum_received"]["seconds"]
    stream_cpu = (cpu["host_total"] + cpu["remote_total"]) / 100 * wall / gb
    # connection rate
    server = topo.spawn(topo.server, sys.executable, "-c", CONN_SERVER, str(CONN_PORT))
    assert server.stdout is not None
    server.stdout.readline()
    before = cpu_seconds(server.pid)
    out = run(
        "ip", "netns", "exec", topo.client, sys.executable, "-c", CONN_CLIENT, SERVER,
        str(CONN_PORT), str(seconds),
    )  # fmt: skip
    server_cpu = cpu_seconds(server.pid) - before
    topo.stop(server)
    n, wall_s, client_cpu = (float(x) for x in out.stdout.split())
    # denied datagrams
    out = run(
        "ip", "netns", "exec", topo.client, sys.executable, "-c", UDP_FLOOD, SERVER,
        str(DENIED_PORT), str(seconds),
    )  # fmt: skip
    d, d_wall, d_cpu = (float(x) for x in out.stdout.split())
    return Sample(
        gbits=gbits,
        stream_cpu_per_gb=stream_cpu,
        conns=n / wall_s,
        conn_cpu_us=(client_cpu + server_cpu) / n * 1e6,
        denied=d / d_wall,
        denied_cpu_ns=d_cpu / d * 1e9,
        load=load,
    )


@contextmanager
def programmed(topo: Topology, condition: str) -> Iterator[PolicyDataplane | None]:
    if condition == "none":
        yield None
        return
    count, _, vis = condition.partition("-")
    dp = PolicyDataplane(NODE, families=(4,), visibility=vis == "on")
    in_netns(topo.node, lambda: dp.sync(state(int(count)), full=True))
    try:
        yield dp
    finally:
        in_netns(topo.node, lambda: run("nft", "delete", "table", "inet", "tabby"))


def check_counted(topo: Topology, dp: PolicyDataplane, sample: Sample, seconds: float) -> str:
    counts = in_netns(topo.node, dp.packet_counts)
    allowed = sum(n for k, (n, _) in counts.items() if k.policy == ALLOW)
    denied = sum(n for k, (n, _) in counts.items() if k.policy == "default-deny")
    conns = sample.conns * seconds
    if allowed < conns * 0.95 or denied < sample.denied * seconds * 0.95:
        raise RuntimeError(
            f"counters did not count: allowed {allowed} for ~{conns:.0f} connections, "
            f"denied {denied} for ~{sample.denied * seconds:.0f} datagrams"
        )
    return f"counted: {allowed} allowed, {denied} denied"


def median(samples: list[Sample], attr: str) -> float:
    return pct([float(getattr(s, attr)) for s in samples], 50)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=4.0)
    ap.add_argument("--policies", type=int, default=200)
    ap.add_argument("--conditions", default="")
    record.add_argument(ap, "policy_counters_bench")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (it creates network namespaces)", file=sys.stderr)
        return 2
    if shutil.which("iperf3") is None:
        print("needs iperf3: apt-get install iperf3", file=sys.stderr)
        return 2
    p = args.policies
    conditions = (args.conditions or f"none,1-off,1-on,{p}-off,{p}-on").split(",")
    topo = Topology(f"tbyctr{os.urandom(3).hex()}")
    results: dict[str, list[Sample]] = {c: [] for c in conditions}
    notes: dict[str, str] = {}
    try:
        topo.build()
        print(f"{len(conditions)} conditions x {args.reps} reps, {args.seconds:g} s each")
        for rep in range(args.reps):
            order = conditions[rep % len(conditions) :] + conditions[: rep % len(conditions)]
            for cond in order:
                with programmed(topo, cond) as dp:
                    sample = measure(topo, args.seconds)
                    if dp is not None and dp.visibility:
                        notes[cond] = check_counted(topo, dp, sample, args.seconds)
                results[cond].append(sample)
                print(
                    f"  rep {rep + 1} {cond:>8}: {sample.gbits:6.2f} Gbit/s "
                    f"{sample.conns:7.0f} conn/s {sample.denied:8.0f} denied/s "
                    f"(load {sample.load:.2f})",
                    flush=True,
                )
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    except (RuntimeError, OSError, ValueError, subprocess.SubprocessError) as e:
        print(f"policy_counters_bench: {e}", file=sys.stderr)
        return 1
    finally:
        topo.teardown()
    print()
    head = (
        f"{'condition':>10} | {'Gbit/s':>7} | {'CPU s/GB':>8} | {'conn/s':>7} | "
        f"{'CPU us/conn':>11} | {'denied/s':>9} | {'CPU ns/denied':>13} | load (min-max)"
    )
    print(head)
    print("-" * len(head))
    for cond in conditions:
        s = results[cond]
        loads = [x.load for x in s]
        print(
            f"{cond:>10} | {median(s, 'gbits'):7.2f} | {median(s, 'stream_cpu_per_gb'):8.3f} | "
            f"{median(s, 'conns'):7.0f} | {median(s, 'conn_cpu_us'):11.1f} | "
            f"{median(s, 'denied'):9.0f} | {median(s, 'denied_cpu_ns'):13.0f} | "
            f"{min(loads):.2f}-{max(loads):.2f}"
        )
    for cond, note in notes.items():
        print(f"{cond}: {note} (last rep)")
    paired(conditions, results)
    return 0


def paired(conditions: list[str], results: dict[str, list[Sample]]) -> None:
    """on / off of the same repetition (measured next to each other), median over the
    repetitions: a load change between repetitions cancels out."""
    print("\non/off, paired by repetition (median, min-max):")
    for cond in conditions:
        count, _, vis = cond.partition("-")
        off = f"{count}-off"
        if vis != "on" or off not in results:
            continue
        parts = []
        for attr, what in (
            ("stream_cpu_per_gb", "CPU/GB"),
            ("conn_cpu_us", "CPU/conn"),
            ("denied_cpu_ns", "CPU/denied"),
            ("conns", "conn/s"),
        ):
            ratios = sorted(
                getattr(a, attr) / getattr(b, attr)
                for a, b in zip(results[cond], results[off], strict=True)
            )
            parts.append(f"{what} {pct(ratios, 50):.3f} ({ratios[0]:.2f}-{ratios[-1]:.2f})")
        print(f"  {count} policies: " + ", ".join(parts))


if __name__ == "__main__":
    sys.exit(record.run(main, "policy_counters_bench"))
