"""``tabbyctl demo --nodes N [--backend bird|vxlan] [--pods P]``: the cluster demo.

On the demo's lab (:mod:`tabbyctl.demo.lab`): an underlay bridge and N node namespaces, a
3-member etcd (1 member for 2 nodes) on the
nodes, tabby-node on each (BIRD full mesh or VXLAN), P pods per node made by the installed
binaries exactly as a runtime on that node would; then it proves every pod reaches every
other pod across nodes (IPv4 and IPv6), shows ``node status`` and the routes of one node,
applies a NetworkPolicy and shows one path closed and the others open, and removes
everything it made (namespaces, links, processes, temporary files), also on Ctrl-C.
"""

from __future__ import annotations

import json
import time

from bundle.types import JSON
from tabbyctl.demo.lab import Lab, LabPod
from tabbyctl.demo.proc import INTERRUPTS, Echo, LabError, signals_restored

NAMESPACE = "demo"
TOTAL = 7  # steps, the last one the cleanup


def _resources(lab: Lab) -> list[JSON]:
    """The demo namespace and one Pod resource per pod: the first pod of the first node
    is the "db" the policy protects, the first pod of the second node its "client"."""
    docs: list[JSON] = [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}}]
    for pod in lab.pods:
        labels = {"app": "web"}
        if pod is _db(lab):
            labels = {"app": "db"}
        elif pod is _client(lab):
            labels = {"app": "web", "role": "client"}
        docs.append(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": pod.name, "namespace": NAMESPACE, "labels": labels},
            }
        )
    return docs


POLICY = {
    "apiVersion": "networking.k8s.io/v1",
    "kind": "NetworkPolicy",
    "metadata": {"name": "db-from-clients", "namespace": NAMESPACE},
    "spec": {
        "podSelector": {"matchLabels": {"app": "db"}},
        "ingress": [{"from": [{"podSelector": {"matchLabels": {"role": "client"}}}]}],
    },
}


def _db(lab: Lab) -> LabPod:
    return lab.pods[0]


def _client(lab: Lab) -> LabPod:
    return next(p for p in lab.pods if p.node != lab.pods[0].node)


def _apply(lab: Lab, docs: list[JSON]) -> None:
    import os
    import tempfile

    with tempfile.NamedTemporaryFile(
        "w", suffix=".json", dir=lab.workdir, delete=False, encoding="utf-8"
    ) as f:
        f.write("\n---\n".join(json.dumps(d) for d in docs))
        path = f.name
    try:
        proc = lab.tabbyctl("apply", "-f", path)
    finally:
        os.unlink(path)
    if proc.returncode != 0:
        raise LabError(f"tabbyctl apply failed: {proc.stderr.strip()}")


def _step(echo: Echo, n: int, total: int, text: str) -> None:
    echo(f"[{n}/{total}] {text}")


def run(
    nodes: int,
    pods: int,
    backend: str,
    keep: bool,
    cni_bin: str,
    echo: Echo,
) -> int:
    lab = Lab(nodes_wanted=nodes, backend=backend, echo=echo, cni_bin=cni_bin)
    ok = False
    interrupted = False
    with signals_restored():
        try:
            with INTERRUPTS.installed():
                echo(
                    f"tabby cluster demo {lab.prefix}: {nodes} nodes, backend {backend}, "
                    f"{pods} pod(s) per node, etcd with {lab.members()} member(s)"
                )
                ok = _show(lab, pods, echo)
                if keep:
                    echo(
                        f"--keep: the lab {lab.prefix} stays (namespaces "
                        f"{', '.join(lab.made_netns)}, work directory {lab.workdir}); stop its "
                        "processes and delete them by hand"
                    )
                    return 0 if ok else 1
        except KeyboardInterrupt:
            interrupted = True
            echo("interrupted: cleaning up")
        except LabError as e:
            echo(f"demo failed: {e}")
            ok = False
        finally:
            if not keep or interrupted or not ok:
                ok = _tear_down(lab, echo, interrupted) and ok
    if interrupted:
        return 130
    echo("cluster demo passed" if ok else "cluster demo FAILED")
    return 0 if ok else 1


def _show(lab: Lab, pods: int, echo: Echo) -> bool:
    """Steps 1 to 6 of the demo (the last one, the cleanup, is :func:`_tear_down`); whether
    the policy closed every path to the db pod but the client's and left the others open."""
    t0 = time.monotonic()
    _step(echo, 1, TOTAL, "underlay bridge, node namespaces, etcd, tabby-node per node")
    lab.build()
    lab.wait_ready(90)
    for node in lab.nodes:
        v6 = f", {node.ipv6.ip}" if node.ipv6 else ""
        echo(f"      {node.name}: {node.ipv4.ip}{v6} (namespace {node.netns})")
    echo(f"      ready in {time.monotonic() - t0:.1f} s")
    _step(echo, 2, TOTAL, "pods, through the installed binaries on each node")
    for node in lab.nodes:
        for j in range(pods):
            pod = lab.add_pod(node, NAMESPACE, f"pod-{node.index + 1}-{j + 1}")
            echo(f"      {pod.label}: {', '.join(pod.addresses())}")
    _step(echo, 3, TOTAL, "every pod pings every other pod (IPv4 and IPv6)")
    fails = _wait_matrix(lab)
    pairs = len(lab.pods) * (len(lab.pods) - 1) * 2
    if fails:
        for f in fails[:10]:
            echo(f"      unreachable: {f}")
        raise LabError(f"{len(fails)} of {pairs} paths unreachable")
    echo(f"      {pairs} paths, all reachable")
    _step(echo, 4, TOTAL, f"node status and routes of {lab.nodes[0].name}")
    status = lab.tabbyctl("node", "status", "--run-dir", lab.nodes[0].run_dir)
    for line in (status.stdout or status.stderr).splitlines():
        echo(f"      {line}")
    for line in lab.routes(lab.nodes[0]).splitlines():
        echo(f"      {line}")
    _step(echo, 5, TOTAL, "a NetworkPolicy: only role=client may reach the db pod")
    _apply(lab, [*_resources(lab), POLICY])
    db, client = _db(lab), _client(lab)
    others = [p for p in lab.pods if p not in (db, client)]
    closed = _policy_paths(lab, db, client, others, echo)
    _step(echo, 6, TOTAL, "IPAM across the cluster")
    _ipam(lab, echo)
    return closed


def _ipam(lab: Lab, echo: Echo) -> None:
    """``tabbyctl ipam show``: the pools and blocks in full; the allocations (one per pod)
    cut short, said so."""
    show = lab.tabbyctl("ipam", "show")
    shown = show.stdout.splitlines()
    cut = shown.index("") if "" in shown else len(shown)
    rest = shown[cut + 1 :] if cut < len(shown) else []
    blocks_end = rest.index("") if "" in rest else len(rest)
    listed = shown[: cut + 1 + blocks_end]
    for line in listed:
        echo(f"      {line}")
    more = len(shown) - len(listed) - 1
    if more > 0:
        echo(f"      ... and {more} more lines (every pod's address): tabbyctl ipam show")


def _tear_down(lab: Lab, echo: Echo, interrupted: bool) -> bool:
    """Everything the lab made removed; False when something was left behind (each one
    said)."""
    _step(echo, TOTAL, TOTAL, "removing everything the demo made")
    problems = lab.teardown()
    for p in problems:
        echo(f"      left behind: {p}")
    if problems:
        return False
    if not interrupted:
        echo("      every pod, namespace, process and file removed")
    return True


def _wait_matrix(lab: Lab, timeout: float = 20) -> list[str]:
    """The reachability matrix, retried while routes converge (BGP sessions come up)."""
    deadline = time.monotonic() + timeout
    while True:
        fails = lab.matrix()
        if not fails or time.monotonic() > deadline:
            return fails
        time.sleep(0.5)


def _policy_paths(lab: Lab, db: LabPod, client: LabPod, others: list[LabPod], echo: Echo) -> bool:
    """After the policy: client -> db open, every other pod -> db closed, and the other
    paths still open. Waits up to a few seconds for every node to enforce it."""
    target = db.addresses(4)[0]
    deadline = time.monotonic() + 10
    while True:
        blocked = [p for p in others if not lab.ping(p.netns, target, wait=1)]
        if len(blocked) == len(others) or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    allowed = lab.ping(client.netns, target, count=1, wait=2)
    echo(f"      {client.label} -> {db.label}: {'open' if allowed else 'CLOSED (wrong)'}")
    for p in others:
        shut = p in blocked
        echo(f"      {p.label} -> {db.label}: {'closed' if shut else 'OPEN (wrong)'}")
    sample = [(p, q) for p in lab.pods for q in lab.pods if p is not q and q is not db][:6]
    still = all(lab.ping(p.netns, q.addresses(4)[0], wait=2) for p, q in sample)
    echo(f"      paths to other pods: {'open' if still else 'some CLOSED (wrong)'}")
    return allowed and len(blocked) == len(others) and still
