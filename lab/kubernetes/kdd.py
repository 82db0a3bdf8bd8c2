"""The lab on the Kubernetes datastore (``KubeLab(datastore="kubernetes")``): tabby's state in
the lab's API server, as manifests/tabby.yaml installs it, with nothing of tabby in etcd.

What the lab takes from the manifest: its Namespace, tabby's CRDs, the service accounts with
their ClusterRoles and bindings, and the plugins' token Secret. With those the lab runs
tabby-node with the ``tabby-node`` account's token, the plugins with the ``tabby-cni``
account's (the kubeconfig the manifest's installer writes, ``/etc/cni/net.d/tabby-kubeconfig``
in every node, JSON), and tabby-kube-controllers with theirs (lab.kubernetes.controllers): so
every test on this lab also proves that the manifest's least privilege is enough
(``KubeLab._install_kdd`` applies them).
"""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import yaml

from lab.kubernetes import node as knode

#: In the repository, or beside the modules in the frozen bundle (packaging/tabby.spec).
MANIFEST = Path(__file__).resolve().parents[2] / "manifests" / "tabby.yaml"
NAMESPACE = "tabby-system"
NODE_ACCOUNT = "tabby-node"
CNI_ACCOUNT = "tabby-cni"
CNI_SECRET = "tabby-cni-token"  # noqa: S105 (the Secret's name, not a secret)
#: Where the manifest's installer writes the plugins' kubeconfig (in every node).
CNI_KUBECONFIG = f"{knode.CNI_CONF_DIR}/tabby-kubeconfig"
#: What the lab applies of the manifest: everything but the workloads and their ConfigMaps.
SETUP_KINDS = frozenset(
    {
        "Namespace",
        "CustomResourceDefinition",
        "ServiceAccount",
        "Secret",
        "ClusterRole",
        "ClusterRoleBinding",
        "Role",
        "RoleBinding",
    }
)


def manifest_documents(kinds: frozenset[str] | set[str]) -> list[dict[str, Any]]:
    """The manifest's documents of ``kinds``, in its order."""
    docs = [d for d in yaml.safe_load_all(MANIFEST.read_text()) if isinstance(d, dict)]
    return [d for d in docs if d.get("kind") in kinds]


def cni_kubeconfig(server: str, ca: bytes, token: str) -> dict[str, Any]:
    """The plugins' kubeconfig as the manifest's installer writes it: JSON (read without a
    YAML parser on a CNI call), the CA embedded, the ``tabby-cni`` account's token."""
    user = f"system:serviceaccount:{NAMESPACE}:{CNI_ACCOUNT}"
    return {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "kubernetes",
                "cluster": {
                    "server": server,
                    "certificate-authority-data": base64.b64encode(ca).decode(),
                },
            }
        ],
        "users": [{"name": user, "user": {"token": token}}],
        "contexts": [{"name": "tabby", "context": {"cluster": "kubernetes", "user": user}}],
        "current-context": "tabby",
    }


#: The conflist's IPAM settings on the Kubernetes datastore (``node.conflist``).
IPAM_SETTINGS = {"datastore_type": "kubernetes", "kubeconfig": CNI_KUBECONFIG}
