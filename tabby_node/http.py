"""tabby-node's HTTP endpoints (served by ``daemon.http``): ``/liveness`` and ``/readiness``
on ``--health-port``, Prometheus ``/metrics`` on ``--metrics-port`` (tabby_node.metrics),
and the denied-flow log ``/policy/log`` on both (tabby_node.policylog; ``tabbyctl policy
log``: on the node through the health port, from elsewhere through the metrics port). The
log names pods and flows: it is served to 127.0.0.1 and to callers that authenticate
(tabby_node.access); ``/metrics`` and health to anyone who reaches them. With
``--metrics-cert-file`` and ``--metrics-key-file`` the metrics port speaks HTTPS, and with
``--metrics-client-ca-file`` it asks for a client certificate (checked by that CA; the log's
readers are named by ``--policy-log-client-cn``).

Both answer 200 or 503 with ``{"ready": bool, "reasons": [...]}`` (``reasons`` empty when
ready). Liveness fails only when tabby-node's own loops are stuck. Readiness is 200 only when
the datastore answers (checked with a short timeout of its own, so it turns 503 within a
few seconds of losing etcd), the routing backend is up (BIRD running with its sessions as
Calico counts them, or the VXLAN state programmed) and the dataplane matches the datastore
(the last reconcile succeeded).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl
    from collections.abc import Mapping
    from http.server import ThreadingHTTPServer

    from cni_config.common import DatastoreSettings
    from daemon.http import Endpoints, Exposition, Guard, Route
    from daemon.limits import Refusals
    from datastore.base import Store
    from tabby_node.policylog import DeniedFlows
    from tabby_node.view import DatastoreErrors, Passes, Ready

log = logging.getLogger("tabby.node")

#: How stale a loop's last beat may be before liveness fails.
STUCK_SECONDS = {"dataplane": 60.0}
DATASTORE_CHECK_TIMEOUT = 3.0
DATASTORE_CHECK_EVERY = 2.0


class Health:
    """``/liveness`` from the loops' beats (``beats``: loop -> when it last went round) and
    crashed loops (``problems``); ``/readiness`` from a datastore check of its own (a store
    opened from ``datastore`` with a short timeout), the dataplane passes, the routing
    backend and the problems."""

    def __init__(
        self,
        *,
        node_ttl: float,
        datastore: DatastoreSettings,
        passes: Passes,
        routing: Ready,
        beats: Mapping[str, float],
        problems: Mapping[str, str],
        metrics: DatastoreErrors | None = None,
    ) -> None:
        self.node_ttl = node_ttl
        self.datastore = datastore
        self.passes = passes
        self.routing = routing
        self.beats = beats
        self.problems = problems
        self.metrics = metrics
        self._checked = 0.0
        self._datastore_problem: str | None = None
        self._store: Store | None = None
        self._lock = threading.Lock()

    def liveness(self) -> list[str]:
        now = time.monotonic()
        reasons = []
        beats = dict(self.beats)
        for loop, limit in STUCK_SECONDS.items():
            beat = beats.get(loop)
            if beat is not None and now - beat > limit:
                reasons.append(f"{loop} loop stuck for {now - beat:.0f} s")
        period = max(self.node_ttl / 3, 1.0)
        beat = beats.get("heartbeat")
        if beat is not None and now - beat > 3 * period + 10:
            reasons.append(f"heartbeat loop stuck for {now - beat:.0f} s")
        reasons += [f"{k}: {v}" for k, v in self.problems.items() if k.startswith("loop ")]
        return reasons

    def _datastore(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._checked < DATASTORE_CHECK_EVERY:
                return self._datastore_problem
            from ipam.core.errors import DatastoreError
            from stores import open_store

            if self._store is None:
                quick = self.datastore.model_copy(
                    update={"lock_timeout_seconds": DATASTORE_CHECK_TIMEOUT}
                )
                self._store = open_store(quick)
            try:
                self._store.check_usable()
                self._datastore_problem = None
            except (DatastoreError, OSError) as e:
                self._datastore_problem = f"datastore: {e}"
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error("health_check")
            self._checked = time.monotonic()
            return self._datastore_problem

    def readiness(self) -> list[str]:
        problems = self.problems
        reasons = []
        problem = self._datastore()
        if problem:
            reasons.append(problem)
        if self.passes.reconciles == 0:
            reasons.append("dataplane: not programmed yet")
        elif not self.passes.in_sync:
            for key in ("routing", "policy"):
                if key in problems:
                    reasons.append(f"{key}: {problems[key]}")
            if len(reasons) == (1 if problem else 0):
                reasons.append("dataplane: the last reconcile failed")
        reasons += self.routing.readiness()
        if "ipip" in problems:
            reasons.append(f"ipip: {problems['ipip']}")
        if "typha" in problems:  # behind tabby-typha: it cannot be read now
            reasons.append(f"typha: {problems['typha']}")
        return reasons


def tls_context(cert_file: str, key_file: str, client_ca_file: str | None) -> ssl.SSLContext:
    """The metrics port's TLS (1.2 or later): its certificate and key, and with a client CA
    a client certificate asked for (optional: ``/metrics`` needs none) and checked against
    it. OSError or ssl.SSLError when a file cannot be used."""
    import ssl

    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    ctx.load_cert_chain(cert_file, key_file)
    if client_ca_file:
        ctx.load_verify_locations(cafile=client_ca_file)
        ctx.verify_mode = ssl.CERT_OPTIONAL
    return ctx


def _serve(
    host: str,
    port: int,
    endpoints: Endpoints,
    what: str,
    problems: dict[str, str],
    refusals: Refusals | None,
    tls: ssl.SSLContext | None = None,
) -> ThreadingHTTPServer | None:
    """One server; None (and a problem node status shows) when the port cannot be had."""
    from daemon.http import serve

    try:
        return serve(host, port, endpoints, what, tls, refusals=refusals, label=what.split()[0])
    except OSError as e:
        log.warning("cannot serve %s on %s:%d: %s", what, host, port, e)
        problems[f"http {what}"] = f"cannot listen on {host}:{port}: {e}"
        return None


def start(
    health: Health,
    *,
    health_port: int,
    metrics_port: int,
    node_ip: str | None,
    exposition: Exposition | None,
    denied_flows: DeniedFlows | None,
    problems: dict[str, str],
    guard: Guard,
    tls: ssl.SSLContext | None = None,
    refusals: Refusals | None = None,
) -> list[ThreadingHTTPServer]:
    """Serve health on 127.0.0.1 (probes run on the node) and metrics (``exposition``) on
    127.0.0.1 and the node's IPv4 address (Prometheus scrapes from elsewhere; HTTPS with
    ``tls``), as the ports say (0: off); the denied-flow log on both, to whom ``guard`` lets
    through (tabby_node.access.Door). Each listening socket has its own bounds
    (``daemon.http.LIMITS``: a flood of the metrics port leaves the probes their own);
    what they refuse is counted in ``refusals`` as ``health`` or ``metrics``. Returns the
    servers (:func:`stop`)."""
    from daemon.http import Endpoints
    from tabby_node.access import PRIVATE

    routes: dict[str, Route] = {}
    if denied_flows is not None:
        from tabby_node.policylog import http_route

        routes["/policy/log"] = http_route(denied_flows)
    endpoints = Endpoints(
        health.liveness,
        health.readiness,
        exposition,
        routes,
        private=frozenset(PRIVATE),
        guard=guard,
    )
    wanted: list[tuple[str, int, str, ssl.SSLContext | None]] = []
    if health_port:
        wanted.append(("127.0.0.1", health_port, "health", None))
    if metrics_port and exposition is not None:
        hosts = ["127.0.0.1", *([node_ip] if node_ip is not None else [])]
        wanted += [(host, metrics_port, f"metrics {host}", tls) for host in hosts]
    servers = []
    for host, port, what, context in wanted:
        server = _serve(host, port, endpoints, what, problems, refusals, context)
        if server is not None:
            servers.append(server)
    return servers


def stop(servers: list[ThreadingHTTPServer]) -> None:
    from daemon.http import stop as stop_servers

    stop_servers(servers)
