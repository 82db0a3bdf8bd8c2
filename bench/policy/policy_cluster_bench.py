#!/usr/bin/env python3
"""NetworkPolicy on a cluster: how fast a change is enforced on every node, and what 200
policies cost a pod's ADD and a TCP stream (needs root, the installed binaries, etcd, BIRD).

    python3 -m bench.policy.policy_cluster_bench [--backend bird] [--rounds 10] [--adds 20]
                                          [--policies 200] [--seconds 3] [--repeats 3]

One lab (tabbyctl.demo.lab: 3 nodes, a 3-member etcd, tabby-node per node, IPv4), built
here and removed at the end, pass or fail. It prints:

* enforcement: pods t1..t3 (one per node, namespace ``lat``) serve TCP 80; a client on the
  previous node connects to each continuously (a new connection every few ms). A
  deny-ingress policy for them is written (tabbyctl's ResourceClient, in process, so that
  the moment of the write is known; tabbyctl's own process time is printed separately);
  from the start of the write until the first probe of the final run of failures, per node
  and for the slowest node ("every node"); deleting it, until the first probe of the final
  run of successes. p50/p90 over ``--rounds``, with no other policy and with ``--policies``
  policies in force (in other namespaces; every change is recomputed with them).
* ADD latency on node-1 (the plugin exec'd as a runtime does, served by tabby-node), with
  no policy and with ``--policies`` policies selecting the new pods, alternated in rounds;
  with tabby-node's own view from its /metrics (ADD served, policy applies, reconciles).
* TCP throughput from a pod on node-1 to a pod on node-2 (iperf3 when installed, else a
  Python sender and receiver), with no policy and with the policies isolating both pods
  (the server's ingress allowed by one of them), alternated.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Any

from bench import record
from bench.stats import pct
from bundle.types import JSON as Doc
from tabbyctl.demo.lab import Lab, LabNode, LabPod
from tests import policy_probes as pp
from tests.cluster import policy_lab as pl

OTHER_NAMESPACES = [f"o{i:02d}" for i in range(1, 17)]
TEAMS = ("t1", "t2", "t3", "t4")
IPERF_PORT = 5201


def log(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def ms(values: list[float]) -> str:
    return f"p50 {pct(values, 50) * 1000:7.0f} ms   p90 {pct(values, 90) * 1000:7.0f} ms"


# -- resources -------------------------------------------------------------------------------


def namespace(name: str, labels: dict[str, str] | None = None) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": name, "labels": labels or {}},
    }


def pod(ns: str, name: str, labels: dict[str, str]) -> Doc:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": labels},
        "spec": {
            "containers": [
                {"name": "app", "ports": [{"name": "http", "containerPort": 80, "protocol": "TCP"}]}
            ]
        },
    }


def netpol(ns: str, name: str, spec: Doc) -> Doc:
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": name, "namespace": ns},
        "spec": spec,
    }


def background_policies(count: int) -> list[Doc]:
    """``count`` policies of the kinds real clusters write: 60 % in namespace ``bench``
    (selecting the ``app=web-N`` pods the ADD phase makes, and ``role=target``), the rest
    in 16 other namespaces; the last one lets ``role=client`` reach ``role=target`` (80 and
    the iperf port), so that the throughput path is isolated but allowed."""
    docs: list[Doc] = []
    in_bench = count * 6 // 10
    for i in range(count - 1):
        ns = "bench" if i < in_bench else OTHER_NAMESPACES[(i - in_bench) % len(OTHER_NAMESPACES)]
        app = {"matchLabels": {"app": f"web-{i % 5}"}}
        kind = i % 6
        if kind == 0:
            spec = {
                "podSelector": app,
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                        "ports": [{"port": 80}, {"port": 8000 + i}],
                    }
                ],
            }
        elif kind == 1:
            spec = {
                "podSelector": {"matchLabels": {"app": f"web-{(i + 1) % 5}"}},
                "ingress": [
                    {
                        "from": [
                            {
                                "namespaceSelector": {"matchLabels": {"team": TEAMS[i % 4]}},
                                "podSelector": {
                                    "matchExpressions": [
                                        {
                                            "key": "tier",
                                            "operator": "In",
                                            "values": ["front", "api"],
                                        }
                                    ]
                                },
                            }
                        ],
                        "ports": [{"port": "http"}],
                    }
                ],
            }
        elif kind == 2:
            spec = {
                "podSelector": app,
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [
                            {
                                "ipBlock": {
                                    "cidr": f"10.{i % 200}.0.0/16",
                                    "except": [f"10.{i % 200}.1.0/24"],
                                }
                            }
                        ]
                    },
                    {"ports": [{"port": 53, "protocol": "UDP"}, {"port": 53, "protocol": "TCP"}]},
                ],
            }
        elif kind == 3:
            spec = {
                "podSelector": {"matchLabels": {"role": "target"}},
                "ingress": [
                    {
                        "from": [{"ipBlock": {"cidr": f"172.16.{i % 250}.0/24"}}],
                        "ports": [{"port": 5000, "endPort": 5010, "protocol": "UDP"}],
                    }
                ],
            }
        elif kind == 4:
            spec = {
                "podSelector": {},
                "ingress": [
                    {
                        "from": [
                            {
                                "namespaceSelector": {
                                    "matchExpressions": [
                                        {"key": "team", "operator": "In", "values": ["t1", "t2"]}
                                    ]
                                }
                            }
                        ]
                    }
                ],
            }
        else:
            spec = {
                "podSelector": app,
                "policyTypes": ["Egress"],
                "egress": [
                    {
                        "to": [{"podSelector": {"matchLabels": {"app": "db"}}}],
                        "ports": [{"port": 5432}],
                    }
                ],
            }
        docs.append(netpol(ns, f"bg-{i:03d}", spec))
    docs.append(
        netpol(
            "bench",
            "allow-clients",
            {
                "podSelector": {"matchLabels": {"role": "target"}},
                "ingress": [
                    {
                        "from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                        "ports": [{"port": 80}, {"port": IPERF_PORT}],
                    }
                ],
            },
        )
    )
    return docs


DENY_TARGETS = netpol(
    "lat",
    "deny-targets",
    {"podSelector": {"matchLabels": {"role": "target"}}, "policyTypes": ["Ingress"]},
)


class Writer:
    """Writes resources the way ``tabbyctl apply`` does (the same ResourceClient, one etcd
    transaction) from inside node-1's namespace, where the lab's etcd is reachable, so that
    the time of the write is known to the millisecond (tabbyctl's own start-up is not part
    of the enforcement numbers)."""

    def __init__(self, lab: Lab) -> None:
        from concurrent.futures import ThreadPoolExecutor

        from datastore.etcd.store import EtcdStore
        from resources.client import ResourceClient

        self.pool = ThreadPoolExecutor(1, initializer=_enter_netns, initargs=(lab.nodes[0].netns,))
        store = EtcdStore(
            lab.endpoints(),
            prefix=lab.etcd_prefix,
            lock_timeout=10,
            lock_dir=os.path.join(lab.workdir, "locks"),
        )
        self.store = store
        self.client = ResourceClient(store)

    def apply(self, docs: list[Doc]) -> None:
        self.pool.submit(self.client.apply, docs).result()

    def delete(self, docs: list[Doc]) -> None:
        self.pool.submit(self.client.delete_documents, docs).result()

    def close(self) -> None:
        self.pool.submit(self.store.close).result()
        self.pool.shutdown()


def scrape(lab: Lab, node: LabNode) -> dict[str, float]:
    """tabby-node's /metrics (default port 9091) as {"name{labels}": value}."""
    from daemon.http import parse_exposition
    from tabbyctl.demo.lab import http_get

    code, body = http_get(node.netns, "http://127.0.0.1:9091/metrics", 3)
    return parse_exposition(body.decode()) if code == 200 else {}


NODE_SIDE = {
    "ADD served": 'tabby_cni_request_duration_seconds_{}{{verb="ADD"}}',
    "policy applies": "tabby_policy_apply_duration_seconds_{}",
    "reconciles": "tabby_reconcile_duration_seconds_{}",
}


def node_side(before: dict[str, float], after: dict[str, float]) -> str:
    """Count and mean of tabby-node's own histograms between two scrapes."""
    parts = []
    for label, pattern in NODE_SIDE.items():
        count = after.get(pattern.format("count"), 0) - before.get(pattern.format("count"), 0)
        total = after.get(pattern.format("sum"), 0) - before.get(pattern.format("sum"), 0)
        mean = f"{total / count * 1000:.0f} ms" if count else "-"
        parts.append(f"{label} {count:.0f} x {mean}")
    return ", ".join(parts)


def _enter_netns(netns: str) -> None:
    from dataplane.netns import setns

    fd = os.open(f"/run/netns/{netns}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd)
    finally:
        os.close(fd)


# -- the lab ---------------------------------------------------------------------------------


class Bench:
    def __init__(self, lab: Lab, args: argparse.Namespace) -> None:
        self.lab = lab
        self.args = args
        self.servers: list[subprocess.Popen[Any]] = []
        self.targets: list[LabPod] = []
        self.clients: list[LabPod] = []
        self.policies = background_policies(args.policies)
        self.write_seconds: list[float] = []
        self.writer: Writer | None = None
        self._after_adds: dict[str, float] = {}

    def policies_on(self, on: bool) -> None:
        """The background policies applied (or deleted) in chunks (an etcd transaction
        takes at most 128 writes), then 2 s for every node to take them in."""
        for i in range(0, len(self.policies), 100):
            chunk = self.policies[i : i + 100]
            if on:
                pl.must(pl.apply_docs(self.lab, chunk))
            else:
                pl.must(pl.delete_docs(self.lab, chunk))
        time.sleep(2.0)

    def setup(self) -> None:
        lab = self.lab
        docs = [namespace("lat"), namespace("bench")]
        docs += [namespace(ns, {"team": TEAMS[i % 4]}) for i, ns in enumerate(OTHER_NAMESPACES)]
        for n in lab.nodes:
            docs.append(pod("lat", f"t{n.index + 1}", {"role": "target"}))
            docs.append(pod("lat", f"c{n.index + 1}", {"role": "client"}))
        docs.append(pod("bench", "iperf-server", {"role": "target"}))
        docs.append(pod("bench", "iperf-client", {"role": "client"}))
        pl.must(pl.apply_docs(lab, docs))
        for n in lab.nodes:
            self.targets.append(lab.add_pod(n, "lat", f"t{n.index + 1}"))
            self.clients.append(lab.add_pod(n, "lat", f"c{n.index + 1}"))
        for t in self.targets:
            self.servers.append(pp.start_server(t.netns, (80,)))
        self.iperf_server = lab.add_pod(lab.nodes[1], "bench", "iperf-server")
        self.iperf_client = lab.add_pod(lab.nodes[0], "bench", "iperf-client")
        self.writer = Writer(lab)
        cli = []
        for _ in range(5):
            t0 = time.monotonic()
            pl.must(pl.apply_docs(lab, [namespace("lat")]))
            cli.append(time.monotonic() - t0)
        print(f"tabbyctl apply of one document (process start to exit): {ms(cli)}")

    def close(self) -> None:
        for s in self.servers:
            pp.stop_process(s)
        if self.writer is not None:
            self.writer.close()

    # -- enforcement --------------------------------------------------------------------------

    def enforcement(self, label: str) -> None:
        """Client on node i-1 -> target on node i, TCP 80, a new connection per probe."""
        n = len(self.lab.nodes)
        pairs = [(self.clients[(i - 1) % n], self.targets[i]) for i in range(n)]
        deny: dict[int, list[float]] = {i: [] for i in range(n)}
        allow: dict[int, list[float]] = {i: [] for i in range(n)}
        every_deny: list[float] = []
        every_allow: list[float] = []
        self.write_seconds = []
        probers = [
            pl.Prober(c.netns, [(t.addresses(4)[0], "TCP", 80)], timeout=0.03, pause=0.002).start()
            for c, t in pairs
        ]
        try:
            time.sleep(0.5)
            for r in range(self.args.rounds):
                for want_open, store, every in (
                    (False, deny, every_deny),
                    (True, allow, every_allow),
                ):
                    assert self.writer is not None
                    t0 = time.monotonic()
                    if want_open:
                        self.writer.delete([DENY_TARGETS])
                    else:
                        self.writer.apply([DENY_TARGETS])
                    self.write_seconds.append(time.monotonic() - t0)
                    times = self._wait_flip(probers, t0, want_open)
                    for i, dt in enumerate(times):
                        if dt is not None:
                            store[i].append(dt)
                    if all(dt is not None for dt in times):
                        every.append(max(t for t in times if t is not None))
                    else:
                        log(f"  round {r}: a node did not flip within 10 s: {times}")
                    time.sleep(0.3)
        finally:
            for p in probers:
                p.stop()
        print(
            f"\nenforcement of a policy change on every node ({label}), {self.args.rounds} rounds"
        )
        for i in range(n):
            print(f"  node-{i + 1}  deny   {ms(deny[i])}      allow again  {ms(allow[i])}")
        print(f"  every node deny   {ms(every_deny)}")
        print(f"  every node allow  {ms(every_allow)}")
        print(f"  (the write itself, one etcd transaction: {ms(self.write_seconds)})")

    @staticmethod
    def _wait_flip(probers: list[pl.Prober], t0: float, want_open: bool) -> list[float | None]:
        """Per prober: seconds from ``t0`` to the first probe of the final run of probes
        with the wanted outcome (None if it never settled); waits until every prober has
        had 0.3 s of the wanted outcome, at most 10 s."""
        deadline = t0 + 10

        def flip(p: pl.Prober) -> float | None:
            rounds = [(s, all(got.values())) for s, got in list(p.rounds) if s >= t0]
            first = None
            for sent, ok in rounds:  # the start of the last run of wanted outcomes
                first = (first if first is not None else sent) if ok == want_open else None
            if first is None or rounds[-1][0] - first < 0.3:
                return None
            return first - t0

        while True:
            times = [flip(p) for p in probers]
            if all(t is not None for t in times) or time.monotonic() > deadline:
                return times
            time.sleep(0.05)

    # -- ADD latency --------------------------------------------------------------------------

    def add_latency(self) -> None:
        node = self.lab.nodes[0]
        namespaces = ["bench", *OTHER_NAMESPACES]
        lab = self.lab
        pods_docs = [
            pod(namespaces[j % len(namespaces)], f"add-{j}", {"app": f"web-{j % 5}", "tier": "api"})
            for j in range(self.args.adds)
        ]
        pl.must(pl.apply_docs(lab, pods_docs))
        results: dict[str, list[float]] = {"none": [], "policies": []}
        dels: dict[str, list[float]] = {"none": [], "policies": []}
        inside: dict[str, list[str]] = {"none": [], "policies": []}
        for r in range(2):
            for label in ("none", "policies") if r % 2 == 0 else ("policies", "none"):
                if label == "policies":
                    self.policies_on(True)
                before = scrape(lab, node)
                adds, removes = self._add_round(node, pods_docs, r)
                inside[label].append(node_side(before, self._after_adds))
                results[label] += adds
                dels[label] += removes
                if label == "policies":
                    self.policies_on(False)
        n = len(results["none"])
        print(f"\npod ADD on node-1 through tabby-node ({n} pods each)")
        for label in ("none", "policies"):
            name = "no policy" if label == "none" else f"{self.args.policies} policies"
            print(f"  {name:13s} ADD {ms(results[label])}   DEL {ms(dels[label])}")
            for line in inside[label]:
                print(f"      node-1 during the ADDs: {line}")
        base = pct(results["none"], 50)
        with_p = pct(results["policies"], 50)
        print(f"  ADD p50 with policies / without: {with_p / base:.2f}")

    def _add_round(self, node: LabNode, docs: list[Doc], r: int) -> tuple[list[float], list[float]]:
        lab = self.lab
        made = []
        adds = []
        for d in docs:
            meta = d["metadata"]
            p = LabPod(
                node=node.name,
                namespace=meta["namespace"],
                name=meta["name"],
                netns=f"{lab.prefix}-a{r}-{meta['name']}",
                container_id=os.urandom(16).hex(),
            )
            lab.make_netns(p.netns)
            lab.pods.append(p)
            made.append(p)
            t = time.monotonic()
            rc, out = lab.cni(node, "ADD", p)
            adds.append(time.monotonic() - t)
            if rc != 0 or out is None:
                raise RuntimeError(f"ADD {p.label} failed: {out}")
            p.result = out
        self._after_adds = scrape(lab, node)
        removes = []
        for p in made:
            t = time.monotonic()
            lab.del_pod(p)
            removes.append(time.monotonic() - t)
        return adds, removes

    # -- throughput ---------------------------------------------------------------------------

    def throughput(self) -> None:
        results: dict[str, list[float]] = {"none": [], "policies": []}
        tool = "iperf3" if shutil.which("iperf3") else "python"
        for r in range(self.args.repeats):
            for label in ("none", "policies") if r % 2 == 0 else ("policies", "none"):
                if label == "policies":
                    self.policies_on(True)
                results[label].append(self._stream(tool))
                if label == "policies":
                    self.policies_on(False)
        print(
            f"\nTCP stream node-1 -> node-2 ({tool}, {self.args.seconds:.0f} s, "
            f"{self.args.repeats} runs each)"
        )
        for label in ("none", "policies"):
            name = "no policy" if label == "none" else f"{self.args.policies} policies"
            vals = results[label]
            print(
                f"  {name:13s} median {pct(vals, 50):8.1f} MB/s   "
                f"(runs: {', '.join(f'{v:.0f}' for v in vals)})"
            )

    def _stream(self, tool: str) -> float:
        server_ns, client_ns = self.iperf_server.netns, self.iperf_client.netns
        dst = self.iperf_server.addresses(4)[0]
        if tool == "iperf3":
            srv = subprocess.Popen(
                ["ip", "netns", "exec", server_ns, "iperf3", "-s", "-1", "-p", str(IPERF_PORT)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                preexec_fn=pp.die_with_parent,
            )
            try:
                time.sleep(0.3)
                out = self.lab.in_ns(
                    client_ns,
                    *("iperf3", "-c", dst, "-p", str(IPERF_PORT), "-J"),
                    *("-t", str(self.args.seconds)),
                    timeout=self.args.seconds + 30,
                )
                data = json.loads(out.stdout)
                return float(data["end"]["sum_received"]["bits_per_second"]) / 8 / 1e6
            finally:
                pp.stop_process(srv)
        receiver = (
            "import socket,sys\n"
            "s=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
            f"s.bind(('0.0.0.0',{IPERF_PORT}));s.listen(1);print('ready',flush=True)\n"
            "c,_=s.accept();n=0\n"
            "while True:\n b=c.recv(1<<20)\n if not b: break\n n+=len(b)\n"
            "print(n,flush=True)\n"
        )
        sender = (
            "import socket,sys,time\n"
            f"s=socket.create_connection(('{dst}',{IPERF_PORT}));buf=b'x'*(1<<18)\n"
            f"end=time.monotonic()+{self.args.seconds};t=time.monotonic();n=0\n"
            "while time.monotonic()<end: s.sendall(buf);n+=len(buf)\n"
            "s.close();print(n/(time.monotonic()-t),flush=True)\n"
        )
        recv = subprocess.Popen(
            ["ip", "netns", "exec", server_ns, sys.executable, "-c", receiver],
            stdout=subprocess.PIPE,
            text=True,
            preexec_fn=pp.die_with_parent,
        )
        try:
            assert recv.stdout is not None
            recv.stdout.readline()
            out = self.lab.in_ns(
                client_ns, sys.executable, "-c", sender, timeout=self.args.seconds + 30
            )
            return float(out.stdout.strip()) / 1e6
        finally:
            pp.stop_process(recv)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backend", default="bird", choices=("bird", "vxlan"))
    ap.add_argument("--rounds", type=int, default=10, help="enforcement rounds (deny + allow)")
    ap.add_argument("--adds", type=int, default=20, help="pods per ADD round (2 rounds each)")
    ap.add_argument("--policies", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=3.0, help="length of one TCP stream")
    ap.add_argument("--repeats", type=int, default=3, help="TCP streams per configuration")
    ap.add_argument(
        "--tabby-node",
        default="",
        help="the tabby-node command the lab runs (default: the installed one), e.g. "
        "'.venv/bin/tabby-node' to measure the working tree",
    )
    ap.add_argument(
        "--only", default="enforcement,add,throughput", help="phases to run (comma-separated)"
    )
    record.add_argument(ap, "policy_cluster_bench")
    args = ap.parse_args()
    if os.geteuid() != 0:
        print("needs root (network namespaces)", file=sys.stderr)
        return 2
    lab = Lab(nodes_wanted=3, backend=args.backend, ipv6=False, echo=log)
    if args.tabby_node:
        lab.tabby_node = shlex.split(args.tabby_node)
    only = set(args.only.split(","))
    bench = Bench(lab, args)
    t0 = time.monotonic()
    try:
        log(f"building a 3-node {args.backend} lab ({lab.prefix})")
        lab.build()
        lab.wait_ready(90)
        bench.setup()
        print(f"NetworkPolicy cluster bench: 3 nodes, backend {args.backend}, IPv4")
        if "enforcement" in only:
            log("enforcement, no other policy")
            bench.enforcement("no other policy")
            log(f"enforcement, {args.policies} other policies")
            bench.policies_on(True)
            bench.enforcement(f"{args.policies} other policies in force")
            bench.policies_on(False)
        if "add" in only:
            log("ADD latency")
            bench.add_latency()
        if "throughput" in only:
            log("throughput")
            bench.throughput()
    finally:
        bench.close()
        problems = lab.teardown()
        if problems:
            log(f"left behind: {problems}")
        log(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "policy_cluster_bench"))
