"""tabby-kube-controllers in a Kubernetes lab, as an operator runs them: with the service
account and RBAC of manifests/tabby.yaml (so the demo, the tier and the benches all prove
that least privilege is enough), replicas on the nodes electing a leader on their Lease, the
lab's datastore (etcd, or the Kubernetes API itself). Started with the installed binary,
stopped by PID (the lab records them: its teardown stops them too)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
from pathlib import Path
from typing import Any

from daemon.http import parse_exposition
from lab.kubernetes import kdd
from lab.kubernetes.cluster import KubeLab
from tabbyctl.demo.lab import http_get
from tabbyctl.demo.proc import stop_process

NAMESPACE = "tabby-system"
ACCOUNT = "tabby-kube-controllers"
BINARY = "/usr/local/bin/tabby-kube-controllers"
RBAC_KINDS = {
    "Namespace",
    "ServiceAccount",
    "ClusterRole",
    "ClusterRoleBinding",
    "Role",
    "RoleBinding",
}
HEALTH_PORT = 9098
METRICS_PORT = 9094


def rbac_documents() -> list[dict[str, Any]]:
    """The manifest's namespace, service accounts and RBAC (what the controllers run as)."""
    return kdd.manifest_documents(RBAC_KINDS)


@dataclasses.dataclass
class Replica:
    identity: str
    node: str
    proc: subprocess.Popen[bytes] | None = None


@dataclasses.dataclass
class Controllers:
    kube: KubeLab
    node_grace: float = 3.0
    leak_grace: float = 5.0
    kubeconfig: Path | None = None
    log_level: str = "debug"  # the tests read the debug lines; kube_bench runs "info"
    binary: str = BINARY  # kube_bench --controllers-bin: another build's
    replicas: dict[str, Replica] = dataclasses.field(default_factory=dict)

    def install(self) -> None:
        self.kube.apply(rbac_documents())
        self.kubeconfig = self.kube.kubeconfig_for_service_account(NAMESPACE, ACCOUNT)

    def argv(self, identity: str) -> list[str]:
        assert self.kubeconfig is not None
        return [
            self.binary,
            *("--kubeconfig", str(self.kubeconfig)),
            *("--lease-namespace", NAMESPACE, "--identity", identity),
            *("--node-grace", str(self.node_grace), "--leak-grace", str(self.leak_grace)),
            *("--health-port", str(HEALTH_PORT), "--metrics-port", str(METRICS_PORT)),
            *("--log-level", self.log_level),
            # the Kubernetes datastore: the API the --kubeconfig above names (their account)
            *(
                ("--datastore-type", "kubernetes")
                if self.kube.datastore == "kubernetes"
                else self.kube.datastore_flags()
            ),
        ]

    def start(self, identity: str, node: str) -> Replica:
        replica = Replica(identity, node)
        replica.proc = self.kube.spawn_on(
            node, self.argv(identity), f"controllers-{identity}.log", mount=False
        )
        self.replicas[identity] = replica
        return replica

    def stop(self, identity: str) -> None:
        """A clean stop (SIGTERM: the holder gives its Lease up)."""
        replica = self.replicas.pop(identity)
        if replica.proc is not None:
            stop_process(replica.proc, grace=20)

    def stop_all(self) -> None:
        for identity in list(self.replicas):
            self.stop(identity)

    def signal(self, identity: str, sig: int) -> None:
        proc = self.replicas[identity].proc
        assert proc is not None
        os.kill(proc.pid, sig)

    # -- what a replica says ----------------------------------------------------------------------

    def _get(self, identity: str, port: int, path: str) -> tuple[int, bytes]:
        replica = self.replicas[identity]
        netns = self.kube.node(replica.node).netns
        return http_get(netns, f"http://127.0.0.1:{port}{path}", timeout=3)

    def metrics(self, identity: str) -> dict[str, float]:
        code, body = self._get(identity, METRICS_PORT, "/metrics")
        return parse_exposition(body.decode()) if code == 200 else {}

    def ready(self, identity: str) -> tuple[bool, list[str]]:
        code, body = self._get(identity, HEALTH_PORT, "/readiness")
        try:
            reasons = json.loads(body).get("reasons", [])
        except ValueError:
            reasons = [body.decode(errors="replace")[:200]]
        return code == 200, reasons

    def leader(self) -> str | None:
        for identity in self.replicas:
            if self.metrics(identity).get("tabby_controllers_leader") == 1.0:
                return identity
        return None

    def wait_leader(self, timeout: float = 60) -> str:
        return self.kube.wait_for("a leading tabby-kube-controllers", self.leader, timeout)

    def wait_ready(self, timeout: float = 60) -> None:
        for identity in self.replicas:

            def ready(identity: str = identity) -> bool:
                return self.ready(identity)[0]

            self.kube.wait_for(f"{identity} ready", ready, timeout)

    def log(self, identity: str) -> str:
        replica = self.replicas[identity]
        path = Path(self.kube.node(replica.node).workdir) / f"controllers-{identity}.log"
        try:
            return path.read_text(errors="replace")[-4000:]
        except OSError:
            return ""
