"""The metrics port over TLS in a cluster lab, as docs/cluster.md ("Who reads the policy
log") tells an operator outside Kubernetes to set it up: one CA (lab.kubernetes.pki,
openssl), a certificate per node for its address and 127.0.0.1 (``--metrics-cert-file``,
``--metrics-key-file``), the CA as the client CA (``--metrics-client-ca-file``), and
tabbyctl's client certificate (common name ``tabbyctl``: it may read other nodes' policy
logs) in tabbyctl's environment (``TABBY_POLICY_LOG_*``)."""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from lab.kubernetes.pki import KeyPair, Pki
from tabbyctl.demo.lab import LabNode


@dataclass
class MetricsTls:
    pki: Pki

    @classmethod
    def make(cls, directory: Path) -> MetricsTls:
        return cls(Pki(directory, "tabby-metrics"))

    def node_args(self, node: LabNode) -> list[str]:
        """tabby-node's flags on ``node`` (its certificate made on first use)."""
        pair = self.pki.issue(
            f"metrics-{node.name}",
            node.name,
            sans=(f"IP:{node.ipv4.ip}", "IP:127.0.0.1"),
            server=True,
        )
        return [
            *("--metrics-cert-file", str(pair.cert), "--metrics-key-file", str(pair.key)),
            *("--metrics-client-ca-file", str(self.pki.ca.cert)),
        ]

    def client(self, name: str = "tabbyctl") -> KeyPair:
        return self.pki.issue(f"client-{name}", name)

    def tabbyctl_env(self, name: str = "tabbyctl") -> dict[str, str]:
        """What makes ``tabbyctl policy log --node`` authenticate as ``name``."""
        pair = self.client(name)
        return {
            "TABBY_POLICY_LOG_CA_FILE": str(self.pki.ca.cert),
            "TABBY_POLICY_LOG_CERT_FILE": str(pair.cert),
            "TABBY_POLICY_LOG_KEY_FILE": str(pair.key),
        }

    def context(self) -> ssl.SSLContext:
        """A client's TLS without a certificate (what Prometheus needs for /metrics)."""
        return ssl.create_default_context(cafile=str(self.pki.ca.cert))
