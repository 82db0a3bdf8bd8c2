"""The HTTP endpoints every tabby daemon serves: ``/liveness`` and ``/readiness`` (200 or
503 with ``{"ready": bool, "reasons": [...]}``, ``reasons`` empty when ready) and Prometheus
``/metrics``, plus the daemon's own ``routes`` (GET only, the query string as a mapping);
anything else is 404. Each daemon says what its checks are; a check that raises answers 503
naming the failure (a probe always gets an answer).

A route in ``private`` (what names pods or flows) is served only when the daemon's ``guard``
lets its :class:`Caller` through (the peer's address, its ``Authorization`` header, the
client certificate TLS verified); the guard's refusal is the answer (401 with
``WWW-Authenticate: Bearer``, 403, 503). ``serve(..., tls=context)`` serves HTTPS: the
handshake happens in the request's own thread, never in the one that accepts."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("tabby.http")

Check = Callable[[], list[str]]  # the reasons it is not ok (empty: ok)
Exposition = Callable[[str | None], tuple[str, bytes]]  # Accept -> (content type, body)
Route = Callable[[Mapping[str, str]], tuple[int, str, bytes]]  # query -> (status, type, body)


@dataclass(frozen=True)
class Caller:
    """Who asks for a private route: the peer's address, the ``Authorization`` header, and
    the client certificate TLS verified (``ssl``'s ``getpeercert()``; None without one)."""

    path: str
    address: str
    authorization: str | None = None
    certificate: Mapping[str, object] | None = None


#: caller -> (200: serve it, else the status to answer: 401, 403, 503; and why)
Guard = Callable[[Caller], tuple[int, str]]


@dataclass(frozen=True)
class Endpoints:
    liveness: Check
    readiness: Check
    metrics: Exposition | None = None
    routes: Mapping[str, Route] = field(default_factory=dict)
    #: the routes (of ``routes``) served only to whom ``guard`` lets through
    private: frozenset[str] = frozenset()
    guard: Guard | None = None

    def __post_init__(self) -> None:
        if self.private and self.guard is None:
            raise ValueError("private routes need a guard")


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
                if path in endpoints.private and not self._let_through(path):
                    return
                try:
                    code, ctype, body = endpoints.routes[path](dict(parse_qsl(query)))
                except Exception as e:
                    log.exception("http: %s failed", path)
                    code, ctype, body = 500, "text/plain", f"{path} failed: {e}\n".encode()
                self._send(code, ctype, body)
            else:
                self._send(404, "text/plain", b"not found\n")

        def _let_through(self, path: str) -> bool:
            """Whether the guard lets this caller have ``path`` (else its refusal sent)."""
            assert endpoints.guard is not None
            getpeercert = getattr(self.connection, "getpeercert", None)
            certificate = getpeercert() if getpeercert is not None else None
            caller = Caller(
                path, self.client_address[0], self.headers.get("Authorization"), certificate or None
            )
            try:
                code, why = endpoints.guard(caller)
            except Exception as e:  # never open on a failure
                log.exception("http: the guard of %s failed", path)
                code, why = 503, f"cannot authorize: {e}"
            if code == 200:
                return True
            extra = {"WWW-Authenticate": 'Bearer realm="tabby"'} if code == 401 else {}
            self._send(code, "text/plain", f"{why}\n".encode(), extra)
            return False

        def _send(
            self, code: int, ctype: str, body: bytes, extra: Mapping[str, str] | None = None
        ) -> None:
            self.send_response(code)
            for key, value in (extra or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            log.debug("http: " + format, *args)

    return Handler


class _Server(ThreadingHTTPServer):
    def handle_error(self, request: object, client_address: object) -> None:
        # a peer that fails the TLS handshake or goes away mid-request: not a traceback
        log.debug("http: request from %s failed", client_address, exc_info=True)


def serve(
    host: str, port: int, endpoints: Endpoints, name: str, tls: ssl.SSLContext | None = None
) -> ThreadingHTTPServer:
    """Serve on ``host:port`` (HTTPS with ``tls``) from a daemon thread; OSError when the port
    cannot be had."""
    server = _Server((host, port), _handler(endpoints, name))
    if tls is not None:
        # the handshake on the first read, in the request's thread (a slow peer holds only it)
        server.socket = tls.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
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
