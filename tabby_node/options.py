"""tabby-node's settings: one pydantic model, filled from flags > environment > defaults.

PRODUCT's table (docs/cluster.md "tabby-node in cluster mode"): every flag has a ``TABBY_*``
variable. The datastore settings are resolved by the one module that does it for tabbyctl too
(``ipam.config.resolve_datastore``: flag > env > ``--conf``'s ipam section > defaults).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Annotated, Literal

from pydantic import AfterValidator, Field, model_validator

from cni_config.common import AbsPath, DatastoreSettings, NodeName, Section
from cni_config.resolve import (
    add_datastore_flags,
    daemon_datastore,
    daemon_options,
    tabby_ipam_section,
)
from cni_protocol.errors import CniError
from policy.calico import FAILSAFE_INBOUND_TEXT as DEFAULT_FAILSAFE_IN
from policy.calico import FAILSAFE_OUTBOUND_TEXT as DEFAULT_FAILSAFE_OUT
from policy.calico import parse_failsafe_ports
from tabby_node import (
    DEFAULT_CNI_CONF_DIR,
    DEFAULT_HEALTH_PORT,
    DEFAULT_METRICS_PORT,
    DEFAULT_RUN_DIR,
    MAX_CALLS,
    MAX_REQUEST,
)
from tabby_node import DEFAULT_NODE_LOG_FILE as DEFAULT_LOG_FILE

if TYPE_CHECKING:
    from daemon.limits import Limits

DEFAULT_STATE_DIR = "/var/lib/tabby"
DEFAULT_V4_POOL = "10.244.0.0/16"
#: Who may read the policy log from another node: a client certificate's common name, and
#: the audience of a Kubernetes bearer token (tabby_node.access).
DEFAULT_LOG_CLIENT_CN = "tabbyctl"
DEFAULT_LOG_AUDIENCE = "tabby-node"


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


def _method(version: int) -> AfterValidator:
    def check(value: str) -> str:
        from dataplane.nodeinfo import parse_method

        parse_method(value, version)  # ValueError names the problem
        return value

    return AfterValidator(check)


def _cidr(version: int) -> AfterValidator:
    def check(value: str) -> str:
        try:
            net = ipaddress.ip_network(value, strict=True)
        except ValueError as e:
            raise ValueError(f"not a CIDR: {e}") from None
        if net.version != version:
            raise ValueError(f"not an IPv{version} CIDR")
        return str(net)

    return AfterValidator(check)


def _failsafe_ports(value: str) -> str:
    parse_failsafe_ports(value)  # ValueError names the bad entry
    return value


def _daemonset(value: str) -> str:
    namespace, sep, name = value.partition("/")
    if not (sep and _DNS_LABEL.fullmatch(namespace) and _DNS_NAME.fullmatch(name)):
        raise ValueError("not NAMESPACE/NAME of a DaemonSet")
    return value


def _service(value: str) -> str:
    namespace, sep, name = value.partition("/")
    if not (sep and _DNS_LABEL.fullmatch(namespace) and _DNS_LABEL.fullmatch(name)):
        raise ValueError("not NAMESPACE/NAME of a Service")
    return value


_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


class NodeOptions(Section):
    """What one tabby-node runs with (flags are the field names with ``-``)."""

    nodename: NodeName | None = None
    node_ip: Annotated[str, _method(4)] = "first-found"
    node_ip6: Annotated[str, _method(6)] | None = None
    backend: Literal["bird", "vxlan", "none"] = "bird"
    state_dir: AbsPath = DEFAULT_STATE_DIR
    run_dir: AbsPath = DEFAULT_RUN_DIR
    socket: AbsPath | None = None
    metrics_port: int = Field(default=DEFAULT_METRICS_PORT, ge=0, le=65535)
    health_port: int = Field(default=DEFAULT_HEALTH_PORT, ge=0, le=65535)
    node_ttl: float = Field(default=90.0, ge=3, le=86400)
    ipv4_pool: Annotated[str, _cidr(4)] = DEFAULT_V4_POOL
    ipv6_pool: Annotated[str, _cidr(6)] | None = None
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_file: AbsPath | None = DEFAULT_LOG_FILE
    conf: AbsPath | None = None
    policy_visibility: Literal["on", "off"] = "on"
    daemonset: Annotated[str, AfterValidator(_daemonset)] | None = None
    cni_conf_dir: AbsPath = DEFAULT_CNI_CONF_DIR
    max_calls: int = Field(default=MAX_CALLS, ge=1, le=65536)
    max_request_bytes: int = Field(default=MAX_REQUEST, ge=64 << 10, le=64 << 20)
    metrics_cert_file: AbsPath | None = None
    metrics_key_file: AbsPath | None = None
    metrics_client_ca_file: AbsPath | None = None
    policy_log_client_cn: str = DEFAULT_LOG_CLIENT_CN
    policy_log_audience: str = DEFAULT_LOG_AUDIENCE
    typha_endpoints: str = ""
    typha_service: Annotated[str, AfterValidator(_service)] | None = None
    typha_ca_file: AbsPath | None = None
    typha_cert_file: AbsPath | None = None
    typha_key_file: AbsPath | None = None
    typha_cn: str | None = None
    failsafe_inbound_host_ports: Annotated[str, AfterValidator(_failsafe_ports)] = (
        DEFAULT_FAILSAFE_IN
    )
    failsafe_outbound_host_ports: Annotated[str, AfterValidator(_failsafe_ports)] = (
        DEFAULT_FAILSAFE_OUT
    )

    @model_validator(mode="after")
    def _tls_files(self) -> NodeOptions:
        if (self.metrics_cert_file is None) != (self.metrics_key_file is None):
            raise ValueError("--metrics-cert-file and --metrics-key-file go together")
        if self.metrics_client_ca_file is not None and self.metrics_cert_file is None:
            raise ValueError("--metrics-client-ca-file needs --metrics-cert-file (TLS)")
        if self.typha_endpoints and self.typha_service:
            raise ValueError("--typha-endpoints or --typha-service, not both")
        if self.typha_endpoints:
            from fanout.client import parse_endpoints

            parse_endpoints(self.typha_endpoints)  # ValueError names the bad one
        files = (self.typha_ca_file, self.typha_cert_file, self.typha_key_file)
        if any(f is not None for f in files) and any(f is None for f in files):
            raise ValueError("--typha-ca-file, --typha-cert-file and --typha-key-file go together")
        return self

    @property
    def typha(self) -> bool:
        """tabby-node reads its view from tabby-typha, not from the datastore's watch."""
        return bool(self.typha_endpoints or self.typha_service)

    @property
    def call_limits(self) -> Limits:
        """The node socket's bounds (``tabby_node.server.LIMITS`` with these options')."""
        from tabby_node.server import LIMITS

        return replace(
            LIMITS, max_connections=self.max_calls, max_request_bytes=self.max_request_bytes
        )

    @property
    def log_client_cns(self) -> tuple[str, ...]:
        return _words(self.policy_log_client_cn)

    @property
    def log_audiences(self) -> tuple[str, ...]:
        return _words(self.policy_log_audience)

    @property
    def socket_path(self) -> str:
        return self.socket or os.path.join(self.run_dir, "node.sock")

    @property
    def nodename_file(self) -> str:
        return os.path.join(self.state_dir, "nodename")

    @property
    def mtu_file(self) -> str:
        return os.path.join(self.state_dir, "mtu")


#: option -> environment variable (docs/cluster.md "tabby-node in cluster mode").
ENV = {
    "nodename": "TABBY_NODENAME",
    "node_ip": "TABBY_NODE_IP",
    "node_ip6": "TABBY_NODE_IP6",
    "backend": "TABBY_BACKEND",
    "state_dir": "TABBY_STATE_DIR",
    "run_dir": "TABBY_RUN_DIR",
    "socket": "TABBY_NODE_SOCKET",
    "metrics_port": "TABBY_METRICS_PORT",
    "health_port": "TABBY_HEALTH_PORT",
    "node_ttl": "TABBY_NODE_TTL",
    "ipv4_pool": "TABBY_IPV4_POOL",
    "ipv6_pool": "TABBY_IPV6_POOL",
    "log_level": "TABBY_LOG_LEVEL",
    "log_file": "TABBY_NODE_LOG_FILE",
    "conf": "TABBY_CONF",
    "policy_visibility": "TABBY_POLICY_VISIBILITY",
    "daemonset": "TABBY_DAEMONSET",
    "cni_conf_dir": "TABBY_CNI_CONF_DIR",
    "metrics_cert_file": "TABBY_METRICS_CERT_FILE",
    "metrics_key_file": "TABBY_METRICS_KEY_FILE",
    "metrics_client_ca_file": "TABBY_METRICS_CLIENT_CA_FILE",
    "policy_log_client_cn": "TABBY_POLICY_LOG_CLIENT_CN",
    "policy_log_audience": "TABBY_POLICY_LOG_AUDIENCE",
    "max_calls": "TABBY_MAX_CALLS",
    "max_request_bytes": "TABBY_MAX_REQUEST_BYTES",
    "typha_endpoints": "TABBY_TYPHA_ENDPOINTS",
    "typha_service": "TABBY_TYPHA_SERVICE",
    "typha_ca_file": "TABBY_TYPHA_CA_FILE",
    "typha_cert_file": "TABBY_TYPHA_CERT_FILE",
    "typha_key_file": "TABBY_TYPHA_KEY_FILE",
    "typha_cn": "TABBY_TYPHA_CN",
    "failsafe_inbound_host_ports": "TABBY_FAILSAFE_INBOUND_HOST_PORTS",
    "failsafe_outbound_host_ports": "TABBY_FAILSAFE_OUTBOUND_HOST_PORTS",
}
_NUMBERS = {
    "metrics_port": int,
    "health_port": int,
    "node_ttl": float,
    "max_calls": int,
    "max_request_bytes": int,
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tabby-node",
        description="tabby's node agent: serves the CNI plugins' calls, registers the node, "
        "routes pods between nodes (BIRD or VXLAN), enforces NetworkPolicy (nftables)",
    )
    helps = {
        "nodename": "this node's name (default: <state-dir>/nodename, else the hostname)",
        "node_ip": "underlay IPv4: ADDR[/LEN], first-found, interface=REGEX, "
        "skip-interface=REGEX, cidr=CIDR or can-reach=ADDR (default first-found)",
        "node_ip6": "underlay IPv6, same methods (default: none)",
        "backend": "bird (BGP), vxlan or none (default bird)",
        "state_dir": f"where nodename and mtu are written (default {DEFAULT_STATE_DIR})",
        "run_dir": f"socket, BIRD config and control socket (default {DEFAULT_RUN_DIR})",
        "socket": "the plugins' socket (default <run-dir>/node.sock)",
        "metrics_port": "Prometheus /metrics (and /policy/log) port, 0 = off "
        f"(default {DEFAULT_METRICS_PORT})",
        "health_port": "/liveness, /readiness and /policy/log port on 127.0.0.1, 0 = off "
        f"(default {DEFAULT_HEALTH_PORT})",
        "node_ttl": "seconds without a heartbeat before other nodes withdraw this "
        "node's routes (default 90)",
        "ipv4_pool": f"default IPv4 pool created when the datastore has none ({DEFAULT_V4_POOL})",
        "ipv6_pool": "default IPv6 pool created when the datastore has none (default: none)",
        "log_level": "debug, info, warning or error (default info)",
        "log_file": f"log file (default {DEFAULT_LOG_FILE}; '' = stderr only)",
        "conf": "conflist whose tabby ipam section gives datastore settings "
        "(default: none; flags and TABBY_* variables win)",
        "policy_visibility": "on: count packets per policy (tabby_policy_packets_total) and "
        "log denied flows (tabbyctl policy log); off: neither (default on)",
        "daemonset": "NAMESPACE/NAME of the DaemonSet running this tabby-node (Kubernetes): "
        "a stop while it is gone or being deleted is an uninstall, which removes tabby's "
        "conflist and nftables table from the node (default: none, a stop keeps everything)",
        "cni_conf_dir": "the runtime's CNI configuration directory, where an uninstall removes "
        f"tabby's conflist, kubeconfig and TLS files (default {DEFAULT_CNI_CONF_DIR})",
        "max_calls": "CNI calls served at once; one more is answered at once and the plugin "
        f"runs it itself (default {MAX_CALLS})",
        "max_request_bytes": "largest CNI call served (environment and config); a larger "
        f"one the plugin runs itself (default {MAX_REQUEST})",
        "metrics_cert_file": "serve the metrics port over HTTPS with this certificate (PEM; "
        "with --metrics-key-file)",
        "metrics_key_file": "the key of --metrics-cert-file (PEM)",
        "metrics_client_ca_file": "ask the metrics port's clients for a certificate and check "
        "it against this CA (PEM): how other nodes' tabbyctl reads the policy log outside "
        "Kubernetes",
        "policy_log_client_cn": "client certificate common names that may read /policy/log "
        f"from elsewhere, comma-separated (default {DEFAULT_LOG_CLIENT_CN})",
        "policy_log_audience": "the audiences a Kubernetes bearer token for /policy/log must "
        f"have, comma-separated; '' = the API server's (default {DEFAULT_LOG_AUDIENCE})",
        "typha_endpoints": "read the cluster from tabby-typha at these host:port, "
        "comma-separated (default: none, watch the datastore)",
        "typha_service": "read the cluster from tabby-typha, its endpoints those of this "
        "Kubernetes Service (NAMESPACE/NAME)",
        "typha_ca_file": "CA typha's certificate is checked against (PEM; with "
        "--typha-cert-file and --typha-key-file: mutual TLS, else plaintext)",
        "typha_cert_file": "this node's client certificate for typha (PEM)",
        "typha_key_file": "its key (PEM)",
        "typha_cn": "the name typha's certificate must carry (its DNS SAN or, without one, "
        "its CN; default: the endpoint's host)",
        "failsafe_inbound_host_ports": "connections to the node no host-endpoint policy can "
        "close: PROTOCOL:[NET:]PORT, comma-separated, or none (default Calico's: "
        f"{DEFAULT_FAILSAFE_IN})",
        "failsafe_outbound_host_ports": "connections from the node no host-endpoint policy "
        f"can close, likewise (default Calico's: {DEFAULT_FAILSAFE_OUT})",
    }
    for name in NodeOptions.model_fields:
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            help=f"{helps.get(name, '')} [env {ENV[name]}]",
        )
    add_datastore_flags(p)
    return p


def parse(
    argv: Sequence[str] | None, env: Mapping[str, str] | None = None
) -> tuple[NodeOptions, DatastoreSettings]:
    """Options and datastore settings; a bad value raises CniError naming its flag."""
    env = os.environ if env is None else env
    ns = parser().parse_args(argv)
    options = daemon_options(
        NodeOptions,
        ns,
        env,
        ENV,
        _NUMBERS,
        empty_is_unset=(
            "log_file",
            "metrics_cert_file",
            "metrics_key_file",
            "metrics_client_ca_file",
            "typha_service",
            "typha_ca_file",
            "typha_cert_file",
            "typha_key_file",
            "typha_cn",
        ),
    )
    return options, daemon_datastore(ns, env, options.conf)


def conf_reserved(conf: str | None) -> list[str]:
    """The ``reserved`` list of ``--conf``'s tabby ipam section (what ``tabbyctl ipam show
    --conf`` counts as reserved; the IPAM gauges count it so); [] without one, or when the
    file cannot be read now."""
    try:
        section = tabby_ipam_section(conf)
    except CniError:
        return []
    reserved = (section or {}).get("reserved")
    if isinstance(reserved, list) and all(isinstance(r, str) for r in reserved):
        return list(reserved)
    return []
