"""The Kubernetes lab's PKI: one CA (openssl, EC P-256) and every certificate, key and
kubeconfig the cluster uses, written into a directory of the lab's work directory.

P-256 keys, not RSA: a whole cluster's worth (about 12 certificates) takes ~0.2 s instead of
seconds, and Kubernetes 1.20 takes ECDSA everywhere (TLS, client certificates, the service
account signing key: ES256 tokens).

Who is who (Kubernetes' own conventions, so RBAC's bootstrap roles apply unchanged):

=========================  =====================================  ===========================
certificate                subject                                what for
=========================  =====================================  ===========================
apiserver                  CN=kube-apiserver, SANs: every         the API server's serving
                           address it is reached at               certificate
apiserver-kubelet-client   O=system:masters,                      the API server to kubelets
                           CN=kube-apiserver-kubelet-client       (exec, logs)
admin                      O=system:masters, CN=tabby-lab-admin   kubectl
controller-manager         CN=system:kube-controller-manager
scheduler                  CN=system:kube-scheduler
kubelet-<node>             O=system:nodes, CN=system:node:<node>  the kubelet's client (Node
                                                                  authorizer, NodeRestriction)
kubelet-<node>-serving     CN=<node>, SAN: the node's address     the kubelet's server
=========================  =====================================  ===========================
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path

from tabbyctl.demo.proc import LabError, run

CURVE = "prime256v1"
DAYS = "3650"
SERVICE_ACCOUNT_ISSUER = "https://kubernetes.default.svc.cluster.local"

_CONFIG = """\
[req]
distinguished_name = dn
[dn]
[ca]
basicConstraints = critical,CA:TRUE
keyUsage = critical,keyCertSign,cRLSign,digitalSignature
subjectKeyIdentifier = hash
[leaf]
basicConstraints = critical,CA:FALSE
keyUsage = critical,digitalSignature,keyEncipherment
extendedKeyUsage = {usage}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid
{sans}
"""


@dataclass(frozen=True)
class KeyPair:
    cert: Path
    key: Path


class Pki:
    """A CA in ``directory`` and the certificates signed by it (made on demand)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.dir = directory
        self.name = name
        self.dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.ca = KeyPair(self.dir / "ca.crt", self.dir / "ca.key")
        if not self.ca.cert.exists():
            self._openssl(
                "ca",
                "ca",
                "req",
                "-x509",
                "-new",
                *("-keyout", str(self.ca.key), "-out", str(self.ca.cert)),
                *("-subj", f"/CN={name}-ca"),
            )

    def _openssl(
        self, stem: str, section: str, *args: str, usage: str = "", sans: str = ""
    ) -> None:
        cnf = self.dir / f"{stem}.cnf"
        cnf.write_text(_CONFIG.format(usage=usage or "clientAuth", sans=sans))
        cmd = [
            "openssl",
            *args,
            "-nodes",
            *("-newkey", "ec", "-pkeyopt", f"ec_paramgen_curve:{CURVE}"),
            *("-days", DAYS, "-sha256", "-config", str(cnf), "-extensions", section),
        ]
        try:
            proc = run(cmd, capture_output=True, text=True)
        except FileNotFoundError:
            raise LabError("openssl is missing: apt-get install openssl") from None
        finally:
            cnf.unlink(missing_ok=True)
        if proc.returncode != 0:
            raise LabError(f"openssl {' '.join(args[:2])} for {stem}: {proc.stderr.strip()}")

    def issue(
        self,
        stem: str,
        common_name: str,
        *,
        groups: tuple[str, ...] = (),
        sans: tuple[str, ...] = (),
        server: bool = False,
    ) -> KeyPair:
        """A certificate for ``common_name`` (organisations ``groups``: Kubernetes' groups),
        signed by the CA; ``sans``: ``IP:a.b.c.d`` / ``DNS:name`` entries. Made once."""
        pair = KeyPair(self.dir / f"{stem}.crt", self.dir / f"{stem}.key")
        if pair.cert.exists():
            return pair
        subject = "".join(f"/O={g}" for g in groups) + f"/CN={common_name}"
        self._openssl(
            stem,
            "leaf",
            "req",
            "-new",
            *("-keyout", str(pair.key), "-out", str(pair.cert), "-subj", subject),
            *("-CA", str(self.ca.cert), "-CAkey", str(self.ca.key)),
            usage="serverAuth,clientAuth" if server else "clientAuth",
            sans=f"subjectAltName = {','.join(sans)}" if sans else "",
        )
        return pair

    def service_account_keys(self) -> KeyPair:
        """The service account signing key (``key``) and its public key (``cert``: a PEM
        public key, what --service-account-key-file takes)."""
        pair = KeyPair(self.dir / "sa.pub", self.dir / "sa.key")
        if pair.key.exists():
            return pair
        for cmd in (
            [
                *("openssl", "genpkey", "-algorithm", "EC"),
                *("-pkeyopt", f"ec_paramgen_curve:{CURVE}", "-out", str(pair.key)),
            ],
            ["openssl", "pkey", "-in", str(pair.key), "-pubout", "-out", str(pair.cert)],
        ):
            proc = run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                raise LabError(f"openssl {cmd[1]} (service account key): {proc.stderr.strip()}")
        return pair


def _b64(path: Path) -> str:
    return base64.b64encode(path.read_bytes()).decode()


def write_kubeconfig(
    path: Path,
    server: str,
    ca: Path,
    user: str,
    *,
    client: KeyPair | None = None,
    token: str | None = None,
) -> Path:
    """A self-contained kubeconfig (certificates embedded) for ``user`` at ``server``,
    authenticated by a client certificate or a bearer token. JSON is valid YAML."""
    credentials: dict[str, str] = {}
    if client is not None:
        credentials["client-certificate-data"] = _b64(client.cert)
        credentials["client-key-data"] = _b64(client.key)
    if token is not None:
        credentials["token"] = token
    doc = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "tabby-lab",
                "cluster": {"server": server, "certificate-authority-data": _b64(ca)},
            }
        ],
        "users": [{"name": user, "user": credentials}],
        "contexts": [{"name": user, "context": {"cluster": "tabby-lab", "user": user}}],
        "current-context": user,
        "preferences": {},
    }
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=2)
    return path


def ip_sans(*addresses: str) -> tuple[str, ...]:
    return tuple(f"IP:{a}" for a in addresses)


def check_openssl() -> None:
    try:
        subprocess.run(["openssl", "version"], capture_output=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        raise LabError("openssl is missing: apt-get install openssl") from None
