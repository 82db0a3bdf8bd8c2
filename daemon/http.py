"""The HTTP endpoints every tabby daemon serves: ``/liveness`` and ``/readiness`` (200 or
503 with ``{"ready": bool, "reasons": [...]}``, ``reasons`` empty when ready) and Prometheus
``/metrics``, plus the daemon's own ``routes`` (GET only, the query string as a mapping);
anything else is 404. Each daemon says what its checks are; a check that raises answers 503
naming the failure (a probe always gets an answer)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qsl

log = logging.getLogger("tabby.http")

Check = Callable[[], list[str]]  # the reasons it is not ok (empty: ok)
Exposition = Callable[[str | None], tuple[str, bytes]]  # Accept -> (content type, body)
Route = Callable[[Mapping[str, str]], tuple[int, str, bytes]]  # query -> (status, type, body)


@dataclass(frozen=True)
class Endpoints:
    liveness: Check
    readiness: Check
    metrics: Exposition | None = None
    routes: Mapping[str, Route] = field(default_factory=dict)


def _handler(endpoints: Endpoints, name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        server_version = name

        def do_GET(self) -> None:
            path, _, query = self.path.partition("?")
            if path in ("/liveness", "/readiness"):
                check = endpoints.liveness if path == "/liveness" else endpoints.readiness
                try:
                    reasons = check()
                except Exception as e:  # a probe must always get an answer
                    reasons = [f"health check failed: {e}"]
                body = json.dumps({"ready": not reasons, "reasons": reasons}).encode()
                self._send(200 if not reasons else 503, "application/json", body)
            elif path == "/metrics" and endpoints.metrics is not None:
                ctype, body = endpoints.metrics(self.headers.get("Accept"))
                self._send(200, ctype, body)
            elif path in endpoints.routes:
                try:
                    code, ctype, body = endpoints.routes[path](dict(parse_qsl(query)))
                except Exception as e:
                    log.exception("http: %s failed", path)
                    code, ctype, body = 500, "text/plain", f"{path} failed: {e}\n".encode()
                self._send(code, ctype, body)
            else:
                self._send(404, "text/plain", b"not found\n")

        def _send(self, code: int, ctype: str, body: bytes) -> None:
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler


def serve(host: str, port: int, endpoints: Endpoints, name: str) -> ThreadingHTTPServer:
    """Serve on ``host:port`` from a daemon thread; OSError when the port cannot be had."""
    server = ThreadingHTTPServer((host, port), _handler(endpoints, name))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, name=f"http {host}:{port}", daemon=True)
    thread.start()
    return server


def stop(servers: list[ThreadingHTTPServer]) -> None:
    for server in servers:
        server.shutdown()
        server.server_close()
    servers.clear()


def parse_exposition(text: str) -> dict[str, float]:
    """What ``/metrics`` serves, read back (labs, tests, benches): ``{"name{labels}": value}``
    for every sample line."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            try:
                out[key] = float(value)
            except ValueError:
                continue
    return out
