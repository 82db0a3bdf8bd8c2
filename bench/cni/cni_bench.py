#!/usr/bin/env python3
"""Benchmark CNI plugins on a node, driven the way a container runtime (libcni) drives them.

Every plugin call is a fresh process: ``argv[0]`` is the binary that ``type`` names in the CNI
path, the environment carries ``CNI_COMMAND/CNI_CONTAINERID/CNI_NETNS/CNI_IFNAME/CNI_PATH/
CNI_ARGS`` and ``PATH``, and stdin is the plugin's entry of the conflist with ``name``,
``cniVersion`` and ``prevResult`` injected as libcni's ``buildOneConfig`` does. ADD runs the
chain in order (each plugin gets the previous plugin's result), CHECK in order and DEL in
reverse with the cached final ADD result as ``prevResult``.

By default the plugins run inside a private "node" network namespace, one network namespace
per pod; everything the run created is DELeted and removed on any exit. See bench/README.md.

Standard library only; needs Linux, root and iproute2; ``--rss`` needs GNU time.
The pure helpers (percentiles, ratios, stdin building, CNI_ARGS) live in cni_bench_pure.py and
import without side effects; plugin execution and namespaces in cni_bench_exec.py; the run
itself in cni_bench_run.py; this file is the command line.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import shutil
import sys
from collections.abc import Sequence

from bench import record
from bench.cni.cni_bench_exec import (
    BenchError,
    Spawner,
)
from bench.cni.cni_bench_pure import (
    DEFAULT_PATH,
    EXIT_USAGE,
    GNU_TIME,
    NETNS_RUN_DIR,
    Chain,
    encode_config,
    find_plugin,
    format_report,
    ipam_networks,
    overlapping,
    parse_env_assignments,
    plugin_error,
    rounded,
)
from bench.cni.cni_bench_run import (
    Bench,
    NetConf,
)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cni_bench.py",
        description=(
            "Benchmark CNI plugins on a node the way a runtime (libcni) runs them: per-call "
            "ADD/CHECK/DEL latency percentiles, CPU per call, peak RSS, sequential or concurrent, "
            "optionally interleaved against a second conflist. Needs root."
        ),
        epilog="Exit status: 0 all good, 1 plugin or verification failures, 2 usage/setup "
        "error, 130 interrupted (after cleanup). See bench/README.md.",
    )
    p.add_argument("--conf", required=True, help="conflist (or single .conf) to benchmark (A)")
    p.add_argument(
        "--cni-path",
        default=os.environ.get("CNI_PATH") or "/opt/cni/bin",
        help="colon-separated plugin directories for A (default: $CNI_PATH or /opt/cni/bin)",
    )
    p.add_argument(
        "--compare", metavar="B.conflist", help="interleave this conflist (B) pod by pod"
    )
    p.add_argument("--cni-path-b", help="plugin directories for B (default: --cni-path)")
    p.add_argument("--label-a", help="name of A in the report (default: its plugin chain)")
    p.add_argument("--label-b", help="name of B in the report (default: its plugin chain)")
    p.add_argument(
        "--mode",
        choices=("sequential", "concurrent"),
        default="sequential",
        help="one call at a time (default), or -k calls in flight",
    )
    p.add_argument(
        "-k", "--concurrency", type=int, default=8, help="workers in concurrent mode (8)"
    )
    p.add_argument("-n", "--pods", type=int, default=50, help="measured pods per config (50)")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured warm-up pods per config (3)")
    p.add_argument("--ifname", default="eth0", help="CNI_IFNAME (eth0)")
    p.add_argument("--k8s-namespace", default="bench", help="K8S_POD_NAMESPACE in CNI_ARGS")
    p.add_argument(
        "--env", action="append", metavar="K=V", help="add a variable to the plugin env (repeat)"
    )
    p.add_argument(
        "--inherit-env",
        action="store_true",
        help="pass this process's environment (minus CNI_*) to plugins, as libcni does; "
        "default: only PATH, the CNI_* variables and --env",
    )
    p.add_argument(
        "--rss", action="store_true", help="peak RSS per call via /usr/bin/time (adds ~1 ms/call)"
    )
    p.add_argument("--timeout", type=float, default=60.0, help="per plugin call, seconds (60)")
    p.add_argument(
        "--no-isolate",
        action="store_true",
        help="run plugins in the real host netns, not a private node netns (changes the host!)",
    )
    p.add_argument(
        "--node-addr", default="192.0.2.1/32", help="address put on lo of the node netns"
    )
    p.add_argument(
        "--node-netns",
        metavar="NAME",
        help="use this existing network namespace as the node (e.g. one where the caller runs "
        "etcd or tabby-node): set up like the private one, never deleted",
    )
    p.add_argument(
        "--client-floor",
        metavar="BINARY",
        help="also time BINARY (no stdin, no CNI variables) the way the spawn floor is timed "
        "and report it beside it: e.g. a frozen Python program that does nothing "
        "(bench/cni/client_floor.py builds one), the least any Python plugin process costs",
    )
    p.add_argument("--json", action="store_true", help="JSON report on stdout (progress on stderr)")
    p.add_argument("--output", metavar="FILE", help="also write the JSON report to FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress lines on stderr")
    record.add_argument(p, "cni_bench")
    return p


def load_conf(path: str, cni_path: str, label: str | None, tag: str) -> NetConf:
    try:
        with open(path, encoding="utf-8") as f:
            doc = json.load(f)
        chain = Chain.from_doc(doc)
    except (OSError, ValueError) as e:
        raise BenchError(f"{path}: {e}") from e
    binaries = []
    for ptype in chain.types:
        found = find_plugin(ptype, cni_path)
        if found is None:
            raise BenchError(f"{path}: plugin {ptype!r} not found in CNI path {cni_path}")
        binaries.append(found)
    for ipam in chain.ipam_types:
        if find_plugin(ipam, cni_path) is None:
            raise BenchError(f"{path}: IPAM plugin {ipam!r} not found in CNI path {cni_path}")
    default_label = "+".join(dict.fromkeys([*chain.types, *chain.ipam_types]))
    return NetConf(
        label=label or default_label,
        tag=tag,
        path=path,
        chain=chain,
        cni_path=cni_path,
        binaries=binaries,
    )


def preflight(confs: list[NetConf], args: argparse.Namespace) -> None:
    """Untimed VERSION call to every binary: it runs, and speaks the chosen cniVersion."""
    spawner = Spawner(timeout=30.0)
    path_var = os.environ.get("PATH") or DEFAULT_PATH
    for conf in confs:
        types = list(dict.fromkeys([*conf.chain.types, *conf.chain.ipam_types]))
        for ptype in types:
            binary = find_plugin(ptype, conf.cni_path)
            assert binary is not None
            env = {
                "PATH": path_var,
                "CNI_COMMAND": "VERSION",
                "CNI_PATH": conf.cni_path,
                "CNI_NETNS": "dummy",
                "CNI_IFNAME": "dummy",
                "CNI_CONTAINERID": "dummy",
            }
            res = spawner.run(binary, env, encode_config({"cniVersion": conf.chain.cni_version}))
            if res.rc != 0:
                raise BenchError(
                    f"{binary} VERSION failed: {plugin_error(res.stdout, res.stderr, res.rc)}"
                )
            try:
                supported = json.loads(res.stdout).get("supportedVersions") or []
            except (ValueError, AttributeError):
                supported = []
            if supported and conf.chain.cni_version not in supported:
                raise BenchError(
                    f"{binary} does not speak cniVersion {conf.chain.cni_version} "
                    f"(supports {', '.join(supported)}); lower it in {conf.path}"
                )


def prepare(args: argparse.Namespace) -> list[NetConf]:
    if args.pods < 1 or args.warmup < 0 or args.concurrency < 1 or args.timeout <= 0:
        raise BenchError("need -n >= 1, --warmup >= 0, -k >= 1, --timeout > 0")
    try:
        parse_env_assignments(args.env or [])
        ipaddress.ip_interface(args.node_addr)
    except ValueError as e:
        raise BenchError(str(e)) from e
    if not args.ifname or len(args.ifname) > 15 or "/" in args.ifname:
        raise BenchError("--ifname must be a valid interface name")
    if os.geteuid() != 0:
        raise BenchError("must run as root (network namespaces, plugins)")
    if args.node_netns and args.no_isolate:
        raise BenchError("--node-netns and --no-isolate exclude each other")
    if args.node_netns and not os.path.exists(os.path.join(NETNS_RUN_DIR, args.node_netns)):
        raise BenchError(f"--node-netns {args.node_netns}: no such network namespace")
    if shutil.which("ip") is None:
        raise BenchError("iproute2 'ip' not found (apt-get install iproute2)")
    if args.rss and not os.access(GNU_TIME, os.X_OK):
        raise BenchError(f"--rss needs GNU time at {GNU_TIME} (apt-get install time)")
    confs = [load_conf(args.conf, args.cni_path, args.label_a, "a")]
    if args.compare:
        confs.append(load_conf(args.compare, args.cni_path_b or args.cni_path, args.label_b, "b"))
        a, b = confs
        if a.chain.name == b.chain.name:
            raise BenchError(
                f"both configs use network name {a.chain.name!r}: IPAM state and cached "
                "results would mix; give them different names"
            )
        clash = overlapping(ipam_networks(a.chain.plugins), ipam_networks(b.chain.plugins))
        if clash:
            pairs = ", ".join(f"{x} / {y}" for x, y in clash)
            raise BenchError(f"the two configs' address ranges overlap: {pairs}")
        if a.label == b.label:
            a.label, b.label = f"A:{a.label}", f"B:{b.label}"
    elif args.cni_path_b or args.label_b:
        raise BenchError("--cni-path-b and --label-b need --compare")
    preflight(confs, args)
    return confs


def _ensure_std_fds() -> None:
    """posix_spawn's dup2 onto 0/1/2 needs our pipes not to *be* 0/1/2: keep them open."""
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            os.open(os.devnull, os.O_RDWR)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _ensure_std_fds()
    try:
        confs = prepare(args)
    except BenchError as e:
        print(f"cni_bench: {e}", file=sys.stderr)
        return EXIT_USAGE
    bench = Bench(args, confs)
    try:
        rc = bench.run()
    except BenchError as e:
        print(f"cni_bench: error: {e} (everything the run created was cleaned up)", file=sys.stderr)
        rc = EXIT_USAGE
    report = rounded(bench.report())
    if args.output:
        with open(args.output, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2)
            f.write("\n")
    if args.json:
        json.dump(report, sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(format_report(report))
    return rc


if __name__ == "__main__":
    sys.exit(record.run(main, "cni_bench"))
