"""The NetworkPolicy truth table on a real Kubernetes (the Kubernetes tier's harness).

The cluster tier's :class:`tests.cluster.policy_lab.TruthTableLab`, with everything a user
does done with kubectl: namespaces x, y, z and pods x/a .. z/c are Kubernetes objects (their
labels as the e2e suite sets them, the named container ports, each pinned to a node so that
every node has a pod of every namespace, and the truth table's address asked for with the
``tabby.io/ipAddrs`` pod annotation, which containerd hands to tabby); a case step's
policies are applied and deleted with ``kubectl apply``/``delete`` and its label changes
made with ``kubectl label``. tabby-kube-controllers carry them into tabby's datastore. The
servers (TCP and UDP on 80 and 81) and the probes run in the pods' network namespaces,
entered from the host through the node's mount namespace (the sandbox's netns path is the
one its IPAM allocation recorded).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from lab.kubernetes.cluster import KubeLab
from tabbyctl.demo.lab import LabPod
from tests import policy_truth_table as tt
from tests.cluster import policy_lab as pl
from tests.policy_probes import start_server


#: Kubernetes 1.20 has no ``endPort`` (its API server drops the field): cases with one stay
#: in tabby's own tiers.
def expressible(case: tt.Case) -> bool:
    return not any(
        port.end_port is not None
        for step in case.steps
        for policy in step.policies
        for rule in (*policy.ingress, *policy.egress)
        for port in rule.ports
    )


CASES = [c for c in tt.CASES if expressible(c)]


def _ports() -> list[dict[str, Any]]:
    return [
        {"name": p.name, "containerPort": p.port, "protocol": p.protocol} for p in tt.NAMED_PORTS
    ]


def pod_object(kube: KubeLab, pod: str, node: str, labels: dict[str, str]) -> dict[str, Any]:
    ns, name = pod.split("/")
    assert kube.busybox is not None
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": ns,
            "labels": labels,
            "annotations": {"tabby.io/ipAddrs": json.dumps([tt.address(pod)])},
        },
        "spec": {
            "nodeName": node,
            "terminationGracePeriodSeconds": 1,
            "containers": [
                {
                    "name": "c",
                    "image": kube.busybox.ref,
                    "imagePullPolicy": "Never",
                    "command": ["sleep", "100000"],
                    "ports": _ports(),
                }
            ],
        },
    }


@dataclasses.dataclass
class KubeTruthTable(pl.TruthTableLab):
    kube: KubeLab | None = None

    @classmethod
    def build_on(cls, kube: KubeLab) -> KubeTruthTable:
        self = cls(kube, kube=kube)
        base = tt.Step((), tt.everything)
        self.ns_labels = {ns: tt.namespace_labels(base, ns) for ns in tt.NAMESPACES}
        self.pod_labels = {p: tt.pod_labels(base, p) for p in tt.PODS}
        namespaces = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns, "labels": labels}}
            for ns, labels in self.ns_labels.items()
        ]
        kube.apply(namespaces)
        where = pl.placement(kube)
        # Pods a first: each claims its namespace's block for its node, b and c borrow.
        order = sorted(tt.PODS, key=lambda p: (p[2], p))
        for pod in order:
            kube.apply(pod_object(kube, pod, where[pod].name, self.pod_labels[pod]))
        for ns in tt.NAMESPACES:
            kube.wait_pods(ns, "", len(tt.POD_NAMES), timeout=180)
        for pod in tt.PODS:
            ns, name = pod.split("/")
            path = kube.pod_netns(ns, name)
            self.pods[pod] = LabPod(where[pod].name, ns, name, path, "")
            server = start_server(path)
            self.servers.append(server)
            kube.extra.append(server)  # type: ignore[arg-type]  # the lab's teardown stops it
        return self

    def apply_step(self, step: tt.Step) -> None:
        kube = self.kube
        assert kube is not None
        for ns in tt.NAMESPACES:
            want = tt.namespace_labels(step, ns)
            change = tt.label_changes(self.ns_labels[ns], want)
            if change:
                kube.kubectl("label", "namespace", ns, "--overwrite", *_label_args(change))
                self.ns_labels[ns] = want
        for pod in tt.PODS:
            want = tt.pod_labels(step, pod)
            change = tt.label_changes(self.pod_labels[pod], want)
            if change:
                ns, name = pod.split("/")
                kube.kubectl("label", "pod", "-n", ns, name, "--overwrite", *_label_args(change))
                self.pod_labels[pod] = want
        wanted = {f"{p.namespace}/{p.name}": tt.network_policy(p) for p in step.policies}
        changed = [doc for key, doc in wanted.items() if self.policies.get(key) != doc]
        if changed:
            kube.apply(changed)
        for key in self.policies.keys() - wanted.keys():
            ns, name = key.split("/")
            kube.kubectl("delete", "networkpolicy", "-n", ns, name, "--ignore-not-found")
        self.policies = wanted

    def close(self) -> None:
        super().close()
        kube = self.kube
        if kube is not None:
            kube.kubectl(
                "delete", "namespace", *tt.NAMESPACES, "--wait=true", timeout=180, check=False
            )


def _label_args(change: dict[str, str | None]) -> list[str]:
    return [f"{k}-" if v is None else f"{k}={v}" for k, v in sorted(change.items())]
