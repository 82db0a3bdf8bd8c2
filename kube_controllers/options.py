"""tabby-kube-controllers' settings: one pydantic model, from flags > environment > defaults
(PRODUCT "tabby-kube-controllers"); the datastore settings as tabby-node resolves them
(``cni_config.resolve``): etcd or the Kubernetes API, a cluster's controllers need the shared
datastore (on the Kubernetes API, the one ``--kubeconfig`` reaches unless the datastore
settings name another)."""

from __future__ import annotations

import argparse
import os
import socket
from collections.abc import Mapping, Sequence
from typing import Annotated, Literal

from pydantic import AfterValidator, BeforeValidator, Field

from cni_config.common import AbsPath, DatastoreSettings, Section
from cni_config.resolve import add_datastore_flags, daemon_datastore, daemon_options
from cni_protocol.errors import CniError, Code

CONTROLLERS = ("namespace", "serviceaccount", "pod", "policy", "node", "ipam")
LEASE_NAME = "tabby-kube-controllers"


def _names(value: object) -> object:
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    return value


def _known(value: list[str]) -> list[str]:
    unknown = [v for v in value if v not in CONTROLLERS]
    if unknown:
        known = ", ".join(CONTROLLERS)
        raise ValueError(f"unknown controller(s) {', '.join(unknown)} (known: {known})")
    return value


class ControllerOptions(Section):
    kubeconfig: str | None = None
    controllers: Annotated[list[str], BeforeValidator(_names), AfterValidator(_known)] = list(
        CONTROLLERS
    )
    leader_elect: bool = True
    lease_namespace: str = "kube-system"
    identity: str = Field(default_factory=lambda: f"{socket.gethostname()}_{os.getpid()}")
    node_grace: float = Field(default=300.0, ge=0, le=30 * 86400)
    leak_grace: float = Field(default=900.0, ge=0, le=30 * 86400)
    health_port: int = Field(default=9098, ge=0, le=65535)
    metrics_port: int = Field(default=9094, ge=0, le=65535)
    typha_certs: str = ""
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_file: AbsPath | None = None
    conf: AbsPath | None = None


#: option -> environment variable.
ENV = {
    "kubeconfig": "KUBECONFIG",
    "controllers": "TABBY_CONTROLLERS",
    "node_grace": "TABBY_NODE_GRACE",
    "leak_grace": "TABBY_LEAK_GRACE",
    "health_port": "TABBY_CONTROLLERS_HEALTH_PORT",
    "metrics_port": "TABBY_CONTROLLERS_METRICS_PORT",
    "typha_certs": "TABBY_TYPHA_CERTS",
    "log_level": "TABBY_LOG_LEVEL",
    "log_file": "TABBY_CONTROLLERS_LOG_FILE",
    "conf": "TABBY_CONF",
}
_NUMBERS = {"node_grace": float, "leak_grace": float, "health_port": int, "metrics_port": int}
HELP = {
    "kubeconfig": "kubeconfig to reach the API server (default: the pod's service account "
    "when KUBERNETES_SERVICE_HOST is set)",
    "controllers": f"which to run, comma-separated (default {','.join(CONTROLLERS)})",
    "lease_namespace": "namespace of the Lease tabby-kube-controllers (default kube-system)",
    "identity": "this replica's name in the Lease (default <hostname>_<pid>)",
    "node_grace": "seconds after a Kubernetes Node is deleted before its blocks and "
    "allocations are released (default 300; 0: at once)",
    "leak_grace": "seconds an allocation whose pod is gone stays before it is released "
    "(default 900)",
    "health_port": "/liveness and /readiness on 127.0.0.1, 0 = off (default 9098)",
    "metrics_port": "Prometheus /metrics, 0 = off (default 9094)",
    "typha_certs": "namespace where tabby-typha's CA and the Secrets tabby-typha-server and "
    "tabby-typha-client are made if absent and renewed before they end (default: none)",
    "log_level": "debug, info, warning or error (default info)",
    "log_file": "log file (default: stderr only)",
    "conf": "conflist whose tabby ipam section gives datastore settings",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tabby-kube-controllers",
        description="Mirror Kubernetes Namespaces, Pods, NetworkPolicies and Node labels into "
        "tabby's etcd datastore (on the Kubernetes datastore: nothing to mirror); release the "
        "blocks of deleted nodes and leaked addresses",
    )
    for name in ControllerOptions.model_fields:
        if name == "kubeconfig":
            continue  # the datastore's --kubeconfig (add_datastore_flags): one API for both
        if name == "leader_elect":
            p.add_argument(
                "--leader-elect",
                dest=name,
                action=argparse.BooleanOptionalAction,
                default=None,
                help="elect one writer on a coordination.k8s.io/v1 Lease (default on)",
            )
            continue
        env = f" [env {ENV[name]}]" if name in ENV else ""
        p.add_argument(
            "--" + name.replace("_", "-"), dest=name, default=None, help=HELP.get(name, "") + env
        )
    add_datastore_flags(p)
    return p


def parse(
    argv: Sequence[str] | None, env: Mapping[str, str] | None = None
) -> tuple[ControllerOptions, DatastoreSettings]:
    """Options and datastore settings; a bad value raises CniError naming its flag."""
    env = os.environ if env is None else env
    ns = parser().parse_args(argv)
    ns.kubeconfig = ns.ds_kubeconfig  # the API server watched: the one flag names both
    options = daemon_options(ControllerOptions, ns, env, ENV, _NUMBERS)
    datastore = daemon_datastore(ns, env, options.conf)
    if datastore.datastore_type not in ("etcdv3", "kubernetes"):
        raise CniError(
            Code.UNSUPPORTED_FIELD,
            "tabby-kube-controllers needs the cluster datastore: --datastore-type etcdv3 or "
            "kubernetes",
            f"got {datastore.datastore_type}",
        )
    if datastore.datastore_type == "kubernetes" and datastore.kubeconfig is None:
        # the Kubernetes datastore is the API server the controllers watch
        datastore = datastore.model_copy(update={"kubeconfig": options.kubeconfig})
    return options, datastore
