"""``python -m lab.kubernetes.demo [--backend bird|vxlan] [--keep] [--cni-bin-dir DIR]``:
tabby as the pod network of a real Kubernetes.

Run as root from a checkout (``.venv/bin/python -m lab.kubernetes.demo``), after
``./build.sh`` installed the binaries. Kubernetes is built from Debian's source the first
time (~7 min, cached): lab territory, so this is the lab's entry point, not a tabbyctl
command (the bundle does not carry the lab).

A 3-node Kubernetes 1.20 on the namespace lab (lab.kubernetes.cluster): etcd on the nodes,
the control plane on node-1, containerd + kubelet + tabby-node on every node, and
tabby-kube-controllers (two replicas, the manifest's service account and RBAC) carrying
namespaces, pods and NetworkPolicies from the API into tabby's datastore. The demo shows
the nodes Ready, creates a Deployment whose pods Kubernetes schedules on every node
with tabby's addresses, proves every pod reaches every other across nodes (``kubectl
exec``), applies a NetworkPolicy with kubectl and shows the protected pod closed to every
pod but its client while the other paths stay open, deletes the namespace (every address
released), and removes everything it made, also on Ctrl-C. It prints each command it runs.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from lab.kubernetes import build
from lab.kubernetes.cluster import KubeLab, KubePod
from lab.kubernetes.controllers import Controllers
from tabbyctl.demo.proc import INTERRUPTS, Echo, LabError

NAMESPACE = "demo"
REPLICAS = 6
POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "db-from-client", "namespace": NAMESPACE},
    "spec": {
        "podSelector": {"matchLabels": {"role": "db"}},
        "ingress": [
            {
                "from": [{"podSelector": {"matchLabels": {"role": "client"}}}],
                "ports": [{"protocol": "TCP", "port": 80}],
            }
        ],
    },
}
TOTAL = 8


class Shell:
    """Runs and prints kubectl commands as a person would type them."""

    def __init__(self, lab: KubeLab, echo: Echo) -> None:
        self.lab = lab
        self.echo = echo

    def kubectl(self, *args: str, input: str | None = None, show_output: bool = True) -> str:
        self.echo(f"      $ kubectl {shlex.join(args)}")
        proc = self.lab.kubectl(*args, input=input, timeout=180)
        if show_output:
            for line in proc.stdout.rstrip().splitlines():
                self.echo(f"        {line}")
        return str(proc.stdout)

    def tabbyctl(self, *args: str, lines: int = 20) -> str:
        self.echo(f"      $ tabbyctl {shlex.join(args)}")
        proc = self.lab.tabbyctl(*args)
        if proc.returncode != 0:
            raise LabError(f"tabbyctl {args[0]} failed: {proc.stderr.strip()}")
        for line in proc.stdout.rstrip().splitlines()[:lines]:
            self.echo(f"        {line}")
        return str(proc.stdout)


def _in_use(lab: KubeLab) -> int:
    """Pod addresses tabby has allocated (tunnel addresses are not pods')."""
    proc = lab.tabbyctl("ipam", "show", "-o", "json")
    if proc.returncode != 0:
        raise LabError(f"tabbyctl ipam show failed: {proc.stderr.strip()}")
    rows = json.loads(proc.stdout)["allocations"]
    return sum(1 for a in rows if a.get("purpose") == "workload")


def _step(echo: Echo, n: int, text: str, started: float) -> None:
    echo(f"[{n}/{TOTAL}] {text}   (+{time.monotonic() - started:.0f} s)")


def _ensure_kubernetes(echo: Echo) -> None:
    if build.find_binaries() is not None:
        return
    echo(
        "Kubernetes 1.20 is not built on this machine yet: building it now from Debian's "
        "source package (about 7 minutes, once; cached in "
        f"{build.DEFAULT_ROOT})"
    )
    try:
        build.ensure(log=echo)
    except build.BuildError as e:
        raise LabError(f"building Kubernetes failed: {e}") from None


def run(backend: str, keep: bool, cni_bin: str, echo: Echo) -> int:
    lab = KubeLab(backend=backend, cni_bin=cni_bin, progress=lambda m: echo(f"      {m}"))
    sh = Shell(lab, echo)
    ok = False
    interrupted = False
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    started = time.monotonic()
    try:
        with INTERRUPTS.installed():
            echo(f"tabby Kubernetes demo {lab.prefix}: 3 nodes, backend {backend}")
            _step(echo, 1, "Kubernetes binaries", started)
            _ensure_kubernetes(echo)
            echo(f"      {lab.binary('kubectl').parent}")
            _step(
                echo,
                2,
                "the cluster: etcd, control plane on node-1, containerd + kubelet + "
                "tabby-node on every node",
                started,
            )
            lab.build()
            echo("      tabby-kube-controllers: 2 replicas (node-1, node-2), one Lease")
            controllers = Controllers(lab)
            controllers.install()
            controllers.start("demo-1", lab.nodes[0].name)
            controllers.start("demo-2", lab.nodes[1].name)
            echo(f"      leader: {controllers.wait_leader()}")
            controllers.wait_ready()
            echo(
                "      kubectl below is "
                f"`nsenter --net=/run/netns/{lab.nodes[0].netns} -- "
                f"{shlex.join(lab.kubectl_argv())}`"
            )
            sh.kubectl("get", "nodes", "-o", "wide")
            _step(
                echo, 3, f"a Deployment of {REPLICAS} web servers, scheduled by Kubernetes", started
            )
            sh.kubectl("create", "namespace", NAMESPACE)
            deployment = lab.web_deployment("web", NAMESPACE, REPLICAS)
            echo(f"      (image {lab.busybox.ref if lab.busybox else '?'}: busybox httpd)")
            sh.kubectl("apply", "-f", "-", input=json.dumps(deployment))
            sh.kubectl("rollout", "status", "-n", NAMESPACE, "deployment/web", "--timeout=180s")
            sh.kubectl("get", "pods", "-n", NAMESPACE, "-o", "wide")
            pods = lab.wait_pods(NAMESPACE, "app=web", REPLICAS)
            nodes = sorted({p.node for p in pods})
            echo(f"      {len(pods)} pods on {', '.join(nodes)}, addresses from tabby")
            _step(echo, 4, "every pod reaches every other pod (kubectl exec ... wget)", started)
            echo(
                "      $ kubectl exec -n demo POD -- sh -c 'for ip in ...; do "
                "timeout 3 wget -q -O /dev/null http://$ip/; done'   (one exec per pod)"
            )
            fails = lab.http_matrix(pods)
            paths = len(pods) * (len(pods) - 1)
            if fails:
                for f in fails[:10]:
                    echo(f"      unreachable: {f}")
                raise LabError(f"{len(fails)} of {paths} paths unreachable")
            echo(f"      {paths} paths across {len(nodes)} nodes, all reachable")
            _step(
                echo, 5, "tabby's view: blocks affine to each node, one endpoint per pod", started
            )
            sh.tabbyctl("ipam", "show")
            sh.tabbyctl("get", "workloadendpoints", "-n", NAMESPACE)
            _step(
                echo,
                6,
                "a NetworkPolicy: only the pod labelled role=client may reach role=db",
                started,
            )
            closed = _policy(lab, sh, pods, echo)
            if keep:
                ok = closed
                echo(
                    f"--keep: the cluster {lab.prefix} and its pods stay up (work directory "
                    f"{lab.workdir}); use kubectl as shown above. Ctrl-C removes everything."
                )
                while True:
                    time.sleep(3600)
            _step(echo, 7, "deleting the Deployment: every pod's address released", started)
            sh.kubectl("delete", "deployment", "-n", NAMESPACE, "web", "--wait=false")
            echo(
                "      (kubelet stops each pod's sandbox within seconds: tabby's DEL releases "
                "its address; kubelet 1.20 may keep the pod object Terminating for up to a "
                "minute, until its container GC runs)"
            )
            lab.wait_for("every address released", lambda: _in_use(lab) == 0, 120)
            sh.tabbyctl("ipam", "show")
            left = sum(
                lab.run_on(n.name, ["ip", "-o", "link"], mount=False).stdout.count(" cali")
                for n in lab.nodes
            )
            echo(f"      host-side cali* interfaces left on the nodes: {left}")
            sh.kubectl("delete", "namespace", NAMESPACE, "--wait=false")
            ok = closed and left == 0
    except KeyboardInterrupt:
        interrupted = not keep or not ok
        echo("interrupted: cleaning up" if interrupted else "removing the kept cluster")
    except LabError as e:
        echo(f"demo failed: {e}")
        ok = False
    finally:
        _step(echo, TOTAL, "removing everything the demo made", started)
        problems = lab.teardown()
        for p in problems:
            echo(f"      left behind: {p}")
        if problems:
            ok = False
        elif not interrupted:
            echo(
                "      every process, pod, mount, cgroup, namespace and file removed "
                "(checked on the machine)"
            )
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)
    if interrupted:
        return 130
    echo("kubernetes demo passed" if ok else "kubernetes demo FAILED")
    return 0 if ok else 1


def _policy(lab: KubeLab, sh: Shell, pods: list[KubePod], echo: Echo) -> bool:
    """Label a db pod (node-1) and a client pod (another node), apply the policy with
    kubectl; then client -> db open, every other pod -> db closed,
    and every path to the other pods still open (each pod probes all others at once)."""
    db = next(p for p in pods if p.node == lab.nodes[0].name)
    client = next(p for p in pods if p.node != db.node)
    others = [p for p in pods if p not in (db, client)]
    sh.kubectl("label", "pod", "-n", NAMESPACE, db.name, "role=db")
    sh.kubectl("label", "pod", "-n", NAMESPACE, client.name, "role=client")
    sh.kubectl("apply", "-f", "-", input=json.dumps(POLICY))
    echo("      (tabby-kube-controllers carry the labels and the policy to every node)")

    def answers(src: KubePod) -> dict[str, bool]:
        return lab.probe_http(src, [p.ip for p in pods if p is not src], timeout=2)

    deadline = time.monotonic() + 15
    with ThreadPoolExecutor(max_workers=len(pods)) as pool:
        while True:  # until every node enforces it (within a second or two)
            seen = dict(zip([p.name for p in pods], pool.map(answers, pods), strict=True))
            blocked = [p for p in others if not seen[p.name][db.ip]]
            if len(blocked) == len(others) or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    allowed = seen[client.name][db.ip]
    echo(
        f"      {client.label} (role=client) -> {db.label} (role=db): "
        f"{'open' if allowed else 'CLOSED (wrong)'}"
    )
    for p in others:
        shut = p in blocked
        echo(f"      {p.label} -> {db.label}: {'closed' if shut else 'OPEN (wrong)'}")
    still = all(ok for p in pods for ip, ok in seen[p.name].items() if ip != db.ip)
    echo(f"      every path to the other pods: {'open' if still else 'some CLOSED (wrong)'}")
    return allowed and len(blocked) == len(others) and still


def _echo(line: str) -> None:
    print(line, flush=True)  # as it happens, also into a pipe or a log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m lab.kubernetes.demo",
        description="tabby as the network of a real 3-node Kubernetes 1.20 (builds Kubernetes "
        "from Debian's source the first time: ~7 min)",
    )
    parser.add_argument(
        "--backend",
        choices=("bird", "vxlan"),
        default="bird",
        help="how pods reach other nodes (default: %(default)s)",
    )
    parser.add_argument(
        "--keep", action="store_true", help="leave the cluster and its pods up until Ctrl-C"
    )
    parser.add_argument(
        "--cni-bin-dir",
        default="/opt/cni/bin",
        help="where the installed plugins are (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        return run(args.backend, args.keep, args.cni_bin_dir, _echo)
    except LabError as e:
        print(f"Error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
