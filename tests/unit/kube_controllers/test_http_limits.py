"""tabby-kube-controllers' HTTP endpoints have the daemons' bounds (``daemon.http.LIMITS``):
a connection beyond the limit is answered 503 and counted under its server's name in
``tabby_controllers_connections_refused_total``; the endpoint serves again afterwards."""

from __future__ import annotations

import socket
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from cni_config.common import DatastoreSettings
from daemon.http import LIMITS
from daemon.http import stop as stop_servers
from daemon.limits import Gate
from kube_controllers.controller import Controllers, _serve_http
from kube_controllers.metrics import Metrics
from kube_controllers.options import ControllerOptions
from tests.slow_clients import wait_for


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def test_a_flood_of_the_health_port_is_refused_counted_and_survived() -> None:
    port = free_port()
    options = ControllerOptions(identity="limits", health_port=port, metrics_port=0)
    ctl = Controllers(options, DatastoreSettings(datastore_type="kubernetes"))
    ctl.metrics = Metrics(ctl)
    _serve_http(ctl)
    assert not ctl.problems
    (server,) = ctl.http_servers
    gate = getattr(server, "gate", None)
    assert isinstance(gate, Gate)
    idle = []
    try:
        for _ in range(LIMITS.max_connections):
            idle.append(socket.create_connection(("127.0.0.1", port), timeout=5))
        wait_for(lambda: gate.inside == LIMITS.max_connections)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as extra:
            assert extra.recv(4096).startswith(b"HTTP/1.0 503 Service Unavailable")
    finally:
        for c in idle:
            c.close()
    try:
        wait_for(lambda: gate.inside == 0)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/liveness", timeout=5) as r:
            assert r.status == 200
        _, body = ctl.metrics.exposition(None)
    finally:
        stop_servers(ctl.http_servers)
    refused = {
        (s.labels["server"], s.labels["reason"]): s.value
        for f in text_string_to_metric_families(body.decode())
        if f.name == "tabby_controllers_connections_refused"
        for s in f.samples
    }
    assert refused[("health", "busy")] == 1
    assert refused[("health", "timeout")] == 0
