"""tabby-node's HTTP endpoints (served by ``daemon.http``): ``/liveness`` and ``/readiness``
on ``--health-port``, Prometheus ``/metrics`` on ``--metrics-port`` (tabby_node.metrics),
and the denied-flow log ``/policy/log`` on both (tabby_node.policylog; ``tabbyctl policy
log``: on the node through the health port, from elsewhere through the metrics port, which
is as readable as ``/metrics``).

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
    from collections.abc import Mapping

    from daemon.http import Route
    from datastore.base import Store
    from tabby_node.view import AgentView

log = logging.getLogger("tabby.node")

#: How stale a loop's last beat may be before liveness fails.
STUCK_SECONDS = {"dataplane": 60.0}
DATASTORE_CHECK_TIMEOUT = 3.0
DATASTORE_CHECK_EVERY = 2.0


class Health:
    def __init__(self, agent: AgentView) -> None:
        self.agent = agent
        self._checked = 0.0
        self._datastore_problem: str | None = None
        self._store: Store | None = None
        self._lock = threading.Lock()

    def liveness(self) -> list[str]:
        now = time.monotonic()
        reasons = []
        beats = dict(self.agent.loop_beat)
        for loop, limit in STUCK_SECONDS.items():
            beat = beats.get(loop)
            if beat is not None and now - beat > limit:
                reasons.append(f"{loop} loop stuck for {now - beat:.0f} s")
        period = max(self.agent.options.node_ttl / 3, 1.0)
        beat = beats.get("heartbeat")
        if beat is not None and now - beat > 3 * period + 10:
            reasons.append(f"heartbeat loop stuck for {now - beat:.0f} s")
        reasons += [f"{k}: {v}" for k, v in self.agent.problems.items() if k.startswith("loop ")]
        return reasons

    def _datastore(self) -> str | None:
        with self._lock:
            if time.monotonic() - self._checked < DATASTORE_CHECK_EVERY:
                return self._datastore_problem
            from datastore import open_store
            from ipam.core.errors import DatastoreError

            if self._store is None:
                quick = self.agent.datastore.model_copy(
                    update={"lock_timeout_seconds": DATASTORE_CHECK_TIMEOUT}
                )
                self._store = open_store(quick)
            try:
                self._store.check_usable()
                self._datastore_problem = None
            except (DatastoreError, OSError) as e:
                self._datastore_problem = f"datastore: {e}"
                if self.agent.metrics is not None:  # metrics
                    self.agent.metrics.datastore_error("health_check")
            self._checked = time.monotonic()
            return self._datastore_problem

    def readiness(self) -> list[str]:
        agent = self.agent
        reasons = []
        problem = self._datastore()
        if problem:
            reasons.append(problem)
        if agent.reconciles == 0:
            reasons.append("dataplane: not programmed yet")
        elif not agent.in_sync:
            for key in ("routing", "policy"):
                if key in agent.problems:
                    reasons.append(f"{key}: {agent.problems[key]}")
            if len(reasons) == (1 if problem else 0):
                reasons.append("dataplane: the last reconcile failed")
        if agent.routing is not None:
            reasons += agent.routing.readiness()
        if "ipip" in agent.problems:
            reasons.append(f"ipip: {agent.problems['ipip']}")
        return reasons


def _serve(
    agent: AgentView,
    host: str,
    port: int,
    health: Health,
    what: str,
    routes: Mapping[str, Route] | None = None,
) -> None:
    from daemon.http import Endpoints, serve

    metrics = agent.metrics.exposition if agent.metrics is not None else None
    endpoints = Endpoints(health.liveness, health.readiness, metrics, routes or {})
    try:
        server = serve(host, port, endpoints, what)
    except OSError as e:
        log.warning("cannot serve %s on %s:%d: %s", what, host, port, e)
        agent.problems[f"http {what}"] = f"cannot listen on {host}:{port}: {e}"
        return
    agent.http_servers.append(server)


def start(agent: AgentView) -> None:
    """Serve health on 127.0.0.1 (probes run on the node) and metrics on 127.0.0.1 and the
    node's IPv4 address (Prometheus scrapes from elsewhere), as the ports say (0: off);
    the denied-flow log on both."""
    health = Health(agent)
    options = agent.options
    routes: dict[str, Route] = {}
    if agent.denied_flows is not None:
        from tabby_node.policylog import http_route

        routes["/policy/log"] = http_route(agent.denied_flows)
    if options.health_port:
        _serve(agent, "127.0.0.1", options.health_port, health, "health", routes)
    if options.metrics_port and agent.metrics is not None:
        hosts = ["127.0.0.1"]
        facts = agent.facts
        if facts is not None and facts.ipv4 is not None:
            hosts.append(str(facts.ipv4.address))
        for host in hosts:
            _serve(agent, host, options.metrics_port, health, f"metrics {host}", routes)


def stop(agent: AgentView) -> None:
    from daemon.http import stop as stop_servers

    stop_servers(agent.http_servers)
