"""The NetworkPolicy harness of the cluster tier (tests/cluster/test_policy.py) and of
bench/policy/policy_cluster_bench.py, over a :class:`tabbyctl.demo.lab.Lab`.

* Servers: a small Python process per pod (started inside the pod's namespace, stopped by
  PID, SIGKILLed by the kernel if the test process dies) answering TCP and UDP on 80 and 81.
* Probes: from a thread that entered a pod's namespace, many non-blocking TCP connects and
  UDP datagrams at once with a short timeout. Every UDP probe leaves from a source port of
  its own (a counter over a large range): a datagram that reused the 5-tuple of an earlier
  allowed probe would match that probe's conntrack entry and pass as "established" after
  the policy changed to deny it.
* :class:`TruthTableLab`: the e2e truth table's pods x/a .. z/c spread over the lab's nodes,
  their Namespace and Pod resources applied with ``tabbyctl apply``, the matrix probed and
  compared with a case step's expectation.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

from tabbyctl.demo.lab import Lab, LabNode, LabPod
from tests import policy_truth_table as tt
from tests.policy_probes import (
    SERVER as SERVER,
)
from tests.policy_probes import (
    Job,
    in_netns,
    probe_many,
    start_server,
    stop_process,
)

T = TypeVar("T")
Key = tuple[str, str, str, int]  # source pod, destination pod, protocol, port
PROBE_PROTOCOLS = ("TCP", "UDP")


def probe_from(sources: Mapping[str, list[Job]], timeout: float) -> dict[tuple[str, Job], bool]:
    """Jobs per source namespace, every namespace in parallel."""
    out: dict[tuple[str, Job], bool] = {}
    errors: list[BaseException] = []
    lock = threading.Lock()

    def one(netns: str, jobs: list[Job]) -> None:
        try:
            res = in_netns(netns, lambda: probe_many(jobs, timeout))
        except BaseException as e:
            errors.append(e)
            return
        with lock:
            out.update({(netns, j): ok for j, ok in res.items()})

    threads = [
        threading.Thread(target=one, args=(ns, jobs), daemon=True)
        for ns, jobs in sources.items()
        if jobs
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


@dataclasses.dataclass
class Prober:
    """Probes ``jobs`` from namespace ``netns`` over and over on a thread of its own until
    stopped; counts every probe and keeps the time of every answered one."""

    netns: str
    jobs: list[Job]
    timeout: float = 0.05
    pause: float = 0.005
    tried: int = 0
    answered: list[tuple[float, Job]] = dataclasses.field(default_factory=list)
    rounds: list[tuple[float, dict[Job, bool]]] = dataclasses.field(default_factory=list)
    _stop: threading.Event = dataclasses.field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    error: BaseException | None = None

    def start(self) -> Prober:
        def loop() -> None:
            while not self._stop.is_set():
                sent = time.monotonic()
                got = probe_many(self.jobs, self.timeout)
                self.tried += len(got)
                self.rounds.append((sent, got))
                self.answered += [(sent, j) for j, ok in got.items() if ok]
                self._stop.wait(self.pause)

        def run() -> None:
            try:
                in_netns(self.netns, loop)
            except BaseException as e:
                self.error = e

        self._thread = threading.Thread(target=run, name=f"prober-{self.netns}", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> Prober:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
        if self.error is not None:
            raise self.error
        return self


# -- the truth table on a lab ------------------------------------------------------------


def placement(lab: Lab) -> dict[str, LabNode]:
    """x/a .. z/c over the nodes so that every node has a pod of every namespace and the
    pods of one namespace sit on different nodes: pod j of namespace i on node (i + j) % n."""
    n = len(lab.nodes)
    return {
        pod: lab.nodes[(tt.NAMESPACES.index(pod[0]) + tt.POD_NAMES.index(pod[2])) % n]
        for pod in tt.PODS
    }


def apply_docs(lab: Lab, docs: list[Any], *, fmt: str = "yaml") -> subprocess.CompletedProcess[str]:
    """``tabbyctl apply -f FILE`` on the first node with ``docs`` as YAML (or JSON
    documents); the completed process (the caller checks it)."""
    return _with_file(lab, docs, fmt, lambda path: lab.tabbyctl("apply", "-f", path))


def delete_docs(lab: Lab, docs: list[Any]) -> subprocess.CompletedProcess[str]:
    return _with_file(
        lab, docs, "yaml", lambda path: lab.tabbyctl("delete", "--ignore-not-found", "-f", path)
    )


def _with_file(
    lab: Lab, docs: list[Any], fmt: str, run: Callable[[str], subprocess.CompletedProcess[str]]
) -> subprocess.CompletedProcess[str]:
    import yaml  # type: ignore[import-untyped, unused-ignore]

    path = os.path.join(lab.workdir, f"docs-{time.monotonic_ns()}.{fmt}")
    with open(path, "w", encoding="utf-8") as f:
        if fmt == "yaml":
            yaml.safe_dump_all(docs, f, sort_keys=False)
        else:
            f.write("\n---\n".join(json.dumps(d) for d in docs))
    try:
        return run(path)
    finally:
        os.unlink(path)


def must(proc: subprocess.CompletedProcess[str]) -> subprocess.CompletedProcess[str]:
    if proc.returncode != 0:
        raise AssertionError(f"tabbyctl failed ({proc.returncode}): {proc.stderr.strip()}")
    return proc


@dataclasses.dataclass
class TruthTableLab:
    """Pods x/a .. z/c on ``lab`` at the truth table's addresses, each serving TCP and UDP
    on 80 and 81; what is applied now (policies, labels) is tracked so that a step applies
    only its difference and :meth:`reset` returns to no policy and the base labels."""

    lab: Lab
    pods: dict[str, LabPod] = dataclasses.field(default_factory=dict)
    servers: list[subprocess.Popen[str]] = dataclasses.field(default_factory=list)
    policies: dict[str, tt.Doc] = dataclasses.field(default_factory=dict)
    ns_labels: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    pod_labels: dict[str, dict[str, str]] = dataclasses.field(default_factory=dict)
    probe_timeout: float = 0.4

    @classmethod
    def build(cls, lab: Lab) -> TruthTableLab:
        """Namespace and Pod resources first (an attachment takes its Pod's labels at ADD),
        then the pods through the installed binaries, then the servers."""
        self = cls(lab)
        base = tt.Step((), tt.everything)
        must(apply_docs(lab, tt.setup_docs(base), fmt="json"))
        self.ns_labels = {ns: tt.namespace_labels(base, ns) for ns in tt.NAMESPACES}
        self.pod_labels = {p: tt.pod_labels(base, p) for p in tt.PODS}
        where = placement(lab)
        # Pods a first: each claims its namespace's block for its node, b and c borrow.
        for pod in sorted(tt.PODS, key=lambda p: (p[2], p)):
            ns, name = pod.split("/")
            self.pods[pod] = lab.add_pod(where[pod], ns, name, ip=tt.address(pod))
        for pod in tt.PODS:
            self.servers.append(start_server(self.pods[pod].netns))
        return self

    def close(self) -> None:
        for proc in self.servers:
            stop_process(proc)
        self.servers.clear()

    # -- applying a step -----------------------------------------------------------------------

    def apply_step(self, step: tt.Step) -> None:
        """Labels and policies of ``step`` in one ``tabbyctl apply`` (policies it no longer
        has deleted afterwards)."""
        docs: list[tt.Doc] = []
        for ns in tt.NAMESPACES:
            want = tt.namespace_labels(step, ns)
            change = tt.label_changes(self.ns_labels[ns], want)
            if change:
                docs.append(tt.namespace_doc(ns, change))
                self.ns_labels[ns] = want
        for pod in tt.PODS:
            want = tt.pod_labels(step, pod)
            change = tt.label_changes(self.pod_labels[pod], want)
            if change:
                docs.append(tt.pod_doc(pod, change, ports=False))
                self.pod_labels[pod] = want
        wanted = {f"{p.namespace}/{p.name}": tt.network_policy(p) for p in step.policies}
        for key, doc in wanted.items():
            if self.policies.get(key) != doc:
                docs.append(tt.replacing(doc) if key in self.policies else doc)
        if docs:
            must(apply_docs(self.lab, docs))
        gone = [doc for key, doc in self.policies.items() if key not in wanted]
        if gone:
            must(delete_docs(self.lab, gone))
        self.policies = wanted

    def reset(self) -> None:
        """No policy, the base labels."""
        self.apply_step(tt.Step((), tt.everything))

    # -- the matrix -----------------------------------------------------------------------------

    def probe(self, keys: Iterable[Key], timeout: float) -> dict[Key, bool]:
        keys = list(keys)
        jobs: dict[str, list[Job]] = {}
        for s, d, pr, po in keys:
            jobs.setdefault(self.pods[s].netns, []).append((tt.address(d), pr, po))
        got = probe_from(jobs, timeout)
        return {k: got[(self.pods[k[0]].netns, (tt.address(k[1]), k[2], k[3]))] for k in keys}

    def check(self, expected: Mapping[Key, bool], *, careful: bool = True) -> list[str]:
        """Probe every key of ``expected``; the mismatches. ``careful``: an expected-allowed
        probe that failed is tried again with a long timeout (a slow machine must not fake
        a denial)."""
        got = self.probe(expected, self.probe_timeout)
        if careful:
            again = [k for k, ok in expected.items() if ok and not got[k]]
            if again:
                got.update(self.probe(again, 3.0))
        return [
            f"{s} -> {d} {pr}/{po}: expected {'allow' if expected[(s, d, pr, po)] else 'deny'}"
            for (s, d, pr, po) in expected
            if got[(s, d, pr, po)] != expected[(s, d, pr, po)]
        ]

    def settle(self, expected: Mapping[Key, bool], bound: float = 10.0) -> tuple[list[str], float]:
        """Probe until the matrix matches ``expected`` or ``bound`` seconds passed (then
        once more, carefully); the mismatches and the seconds it took."""
        start = time.monotonic()
        while True:
            bad = self.check(expected, careful=False)
            if not bad:
                return [], time.monotonic() - start
            if time.monotonic() - start > bound:
                return self.check(expected), time.monotonic() - start
            time.sleep(0.1)


def expected_matrix(step: tt.Step) -> dict[Key, bool]:
    """The step's expectation for TCP and UDP (SCTP is not probed)."""
    return {k: v for k, v in tt.matrix(step.expect).items() if k[2] in PROBE_PROTOCOLS}


ALL_OPEN = expected_matrix(tt.Step((), tt.everything))
