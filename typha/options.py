"""tabby-typha's settings: one pydantic model, from flags > environment > defaults; the
datastore settings as tabby-node resolves them (``cni_config.resolve``)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Literal

from pydantic import Field, model_validator

from cni_config.common import AbsPath, DatastoreSettings, Section
from cni_config.resolve import add_datastore_flags, daemon_datastore, daemon_options
from cni_protocol.errors import CniError, Code
from fanout import DEFAULT_PORT


def _words(text: str) -> tuple[str, ...]:
    return tuple(w.strip() for w in text.split(",") if w.strip())


class TyphaOptions(Section):
    listen: str = "0.0.0.0"
    port: int = Field(default=DEFAULT_PORT, ge=0, le=65535)
    ca_file: AbsPath | None = None
    cert_file: AbsPath | None = None
    key_file: AbsPath | None = None
    client_cn: str = ""
    client_uri_san: str = ""
    plaintext: bool = False
    history_events: int = Field(default=100_000, ge=1, le=10_000_000)
    history_bytes: int = Field(default=64 << 20, ge=1 << 20, le=4 << 30)
    send_interval: float = Field(default=0.2, ge=0, le=10)
    health_port: int = Field(default=9097, ge=0, le=65535)
    metrics_port: int = Field(default=9093, ge=0, le=65535)
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_file: AbsPath | None = None
    conf: AbsPath | None = None

    @model_validator(mode="after")
    def _tls(self) -> TyphaOptions:
        files = (self.ca_file, self.cert_file, self.key_file)
        if self.plaintext:
            if any(f is not None for f in files):
                raise ValueError("--plaintext takes no TLS files")
        elif any(f is None for f in files):
            raise ValueError(
                "mutual TLS needs --ca-file, --cert-file and --key-file (or --plaintext)"
            )
        return self

    @property
    def client_cns(self) -> tuple[str, ...]:
        return _words(self.client_cn)

    @property
    def client_uri_sans(self) -> tuple[str, ...]:
        return _words(self.client_uri_san)


ENV = {
    "listen": "TABBY_TYPHA_LISTEN",
    "port": "TABBY_TYPHA_PORT",
    "ca_file": "TABBY_TYPHA_CA_FILE",
    "cert_file": "TABBY_TYPHA_CERT_FILE",
    "key_file": "TABBY_TYPHA_KEY_FILE",
    "client_cn": "TABBY_TYPHA_CLIENT_CN",
    "client_uri_san": "TABBY_TYPHA_CLIENT_URI_SAN",
    "plaintext": "TABBY_TYPHA_PLAINTEXT",
    "history_events": "TABBY_TYPHA_HISTORY_EVENTS",
    "history_bytes": "TABBY_TYPHA_HISTORY_BYTES",
    "send_interval": "TABBY_TYPHA_SEND_INTERVAL",
    "health_port": "TABBY_TYPHA_HEALTH_PORT",
    "metrics_port": "TABBY_TYPHA_METRICS_PORT",
    "log_level": "TABBY_LOG_LEVEL",
    "log_file": "TABBY_TYPHA_LOG_FILE",
    "conf": "TABBY_CONF",
}


def _flag(text: str) -> bool:
    word = text.strip().lower()
    if word in ("true", "1", "yes", "on"):
        return True
    if word in ("false", "0", "no", "off", ""):
        return False
    raise ValueError(text)


_NUMBERS: dict[str, Callable[[str], object]] = {
    "plaintext": _flag,
    "port": int,
    "history_events": int,
    "history_bytes": int,
    "send_interval": float,
    "health_port": int,
    "metrics_port": int,
}
HELP = {
    "listen": "address the stream is served on (default 0.0.0.0)",
    "port": f"TCP port of the stream (default {DEFAULT_PORT})",
    "ca_file": "CA the clients' certificates are checked against (PEM)",
    "cert_file": "typha's certificate (PEM)",
    "key_file": "its key (PEM)",
    "client_cn": "client certificate common names allowed, comma-separated (with "
    "--client-uri-san: either matching will do; neither: any certificate of the CA)",
    "client_uri_san": "client certificate URI subject alternative names allowed, comma-separated",
    "plaintext": "serve without TLS (labs and benches only: anyone can read the cluster)",
    "history_events": "changes the history holds for clients that reconnect (default 100000)",
    "history_bytes": "and their bytes at most (default 64 MiB)",
    "send_interval": "seconds at least between two messages to one node: a change after a "
    "quiet spell goes at once, a churn's in batches (default 0.2)",
    "health_port": "/liveness and /readiness on 127.0.0.1, 0 = off (default 9097)",
    "metrics_port": "Prometheus /metrics, 0 = off (default 9093)",
    "log_level": "debug, info, warning or error (default info)",
    "log_file": "log file (default: stderr only)",
    "conf": "conflist whose tabby ipam section gives datastore settings",
}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="tabby-typha",
        description="Hold the cluster's watches once and serve every tabby-node its view "
        "(a snapshot, then changes) over gRPC with mutual TLS",
    )
    for name in TyphaOptions.model_fields:
        if name == "plaintext":
            p.add_argument(
                "--plaintext",
                dest=name,
                action="store_const",
                const=True,
                default=None,
                help=f"{HELP[name]} [env {ENV[name]}]",
            )
            continue
        p.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            default=None,
            help=f"{HELP.get(name, '')} [env {ENV[name]}]",
        )
    add_datastore_flags(p)
    return p


def parse(
    argv: Sequence[str] | None, env: Mapping[str, str] | None = None
) -> tuple[TyphaOptions, DatastoreSettings]:
    """Options and datastore settings; a bad value raises CniError naming its flag."""
    env = os.environ if env is None else env
    ns = parser().parse_args(argv)
    options = daemon_options(TyphaOptions, ns, env, ENV, _NUMBERS)
    datastore = daemon_datastore(ns, env, options.conf)
    if datastore.datastore_type == "file":
        raise CniError(
            Code.UNSUPPORTED_FIELD,
            "tabby-typha serves a cluster datastore: --datastore-type etcdv3 or kubernetes",
            "got file",
        )
    return options, datastore
