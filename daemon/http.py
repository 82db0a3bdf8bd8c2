"""The HTTP endpoints every tabby daemon serves: ``/liveness`` and ``/readiness`` (200 or
503 with ``{"ready": bool, "reasons": [...]}``, ``reasons`` empty when ready) and Prometheus
``/metrics``, plus the daemon's own ``routes`` (GET only, the query string as a mapping);
anything else is 404. Each daemon says what its checks are; a check that raises answers 503
naming the failure (a probe always gets an answer).

Every listening socket has its bounds (:data:`LIMITS`, ``daemon.limits``): connections
served at once (one more is answered 503 by the accepting thread, no thread made for it),
the request's size (431 for its head, 414 for its line, 413 for its body), the time to
read it from the connection accepted (then the connection is closed) and the time for the
whole answer; what it refused is counted in ``refusals`` under the server's ``label``.

A route in ``private`` (what names pods or flows) is served only when the daemon's ``guard``
lets its :class:`Caller` through (the peer's address, its ``Authorization`` header, the
client certificate TLS verified); the guard's refusal is the answer (401 with
``WWW-Authenticate: Bearer``, 403, 503). ``serve(..., tls=context)`` serves HTTPS: the
handshake happens in the request's own thread, never in the one that accepts."""

from __future__ import annotations

import contextlib
import io
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl

from daemon.limits import (
    BoundedStream,
    Gate,
    Limits,
    Refusals,
    RequestTooLarge,
    linger,
    send_now,
)

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("tabby.http")

Check = Callable[[], list[str]]  # the reasons it is not ok (empty: ok)
Exposition = Callable[[str | None], tuple[str, bytes]]  # Accept -> (content type, body)
Route = Callable[[Mapping[str, str]], tuple[int, str, bytes]]  # query -> (status, type, body)

#: An endpoint's bounds: probes, scrapes and tabbyctl send a few hundred bytes at once and
#: read at once; the longest answer is /policy/log's wait (at most 10 s). docs/node.md "Limits".
LIMITS = Limits(max_connections=64, max_request_bytes=64 << 10, read_within=5.0, answer_within=30.0)
_BUSY = (
    b"HTTP/1.0 503 Service Unavailable\r\nContent-Type: text/plain\r\nContent-Length: 5\r\n"
    b"Retry-After: 1\r\nConnection: close\r\n\r\nbusy\n"
)


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


class _BoundedHandler(BaseHTTPRequestHandler):
    """A request read by a deadline and within a size, its answer written by its own
    deadline (``daemon.limits.BoundedStream``); what it refused counted by its server."""

    stream: BoundedStream

    def setup(self) -> None:
        super().setup()
        limits = _limits_of(self.server)
        read_by = time.monotonic() + limits.read_within
        self.stream = BoundedStream(
            self.connection,
            limits.max_request_bytes,
            read_by,
            read_by + limits.answer_within,
        )
        self.rfile = io.BufferedReader(self.stream)
        self.wfile = io.BufferedWriter(self.stream)
        self.requestline, self.request_version, self.command = "", "", ""

    def handle(self) -> None:
        try:
            super().handle()
        except RequestTooLarge:  # its line or its body (the headers: 431 by parse_request)
            self.close_connection = True
            with contextlib.suppress(OSError):
                self.send_error(413 if self.command else 414)
                self.wfile.flush()

    def parse_request(self) -> bool:
        if not super().parse_request():
            return False
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            length = -1
        if length < 0:
            self.send_error(400, "bad Content-Length")
            return False
        if length > self.stream.limit:
            self.stream.refused = "too_large"
            self.send_error(413)
            return False
        if length:  # no route reads a body: read and dropped, within the limits
            self.rfile.read(length)
        return True

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            reason = self.stream.refused
            if reason is not None:
                server = _limited(self.server)
                server.refusals.count(server.label, reason, str(self.client_address[0]))
                if reason == "too_large":
                    linger(self.connection)


def _handler(endpoints: Endpoints, name: str) -> type[BaseHTTPRequestHandler]:
    class Handler(_BoundedHandler):
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


_Request = socket.socket | tuple[bytes, socket.socket]  # what socketserver hands a server


class _Server(ThreadingHTTPServer):
    """A ThreadingHTTPServer that serves at most ``limits.max_connections`` at once."""

    daemon_threads = True
    #: the kernel's queue of connections not accepted yet (socketserver's default is 5: a
    #: burst beyond it waits for SYN retransmits, seconds); refusing one is quick
    request_queue_size = 128

    def __init__(
        self,
        address: tuple[str, int],
        handler: type[BaseHTTPRequestHandler],
        limits: Limits,
        refusals: Refusals,
        label: str,
    ) -> None:
        self.limits = limits
        self.refusals = refusals
        self.label = label
        self.gate = Gate(limits.max_connections)
        self.tls = False
        refusals.register(label)
        super().__init__(address, handler)

    def process_request(self, request: _Request, client_address: object) -> None:
        if not self.gate.enter():  # limits: answered here, no thread for it
            self.refusals.count(self.label, "busy", f"{self.gate.limit} connections at once")
            # a TLS peer has not shaken hands yet: it only sees the connection closed
            if isinstance(request, socket.socket) and not self.tls:
                send_now(request, _BUSY)
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.gate.leave()
            raise

    def process_request_thread(self, request: _Request, client_address: object) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.gate.leave()

    def handle_error(self, request: object, client_address: object) -> None:
        # a peer that fails the TLS handshake or goes away mid-request: not a traceback
        log.debug("http: request from %s failed", client_address, exc_info=True)


def _limited(server: object) -> _Server:
    assert isinstance(server, _Server)
    return server


def _limits_of(server: object) -> Limits:
    return _limited(server).limits


def serve(
    host: str,
    port: int,
    endpoints: Endpoints,
    name: str,
    tls: ssl.SSLContext | None = None,
    *,
    limits: Limits = LIMITS,
    refusals: Refusals | None = None,
    label: str | None = None,
) -> ThreadingHTTPServer:
    """Serve on ``host:port`` (HTTPS with ``tls``) from a daemon thread; OSError when the port
    cannot be had. ``limits`` bound it; what it refuses is counted in ``refusals`` (its own
    when None) as ``label`` (default ``name``)."""
    server = _Server(
        (host, port),
        _handler(endpoints, name),
        limits,
        refusals if refusals is not None else Refusals(),
        label or name,
    )
    if tls is not None:
        # the handshake on the first read, in the request's thread (a slow peer holds only
        # it, within the request's read deadline)
        server.socket = tls.wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False
        )
        server.tls = True
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
