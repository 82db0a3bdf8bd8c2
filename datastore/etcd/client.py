"""A small etcd v3 client over etcd's gRPC-JSON gateway (``/v3/kv/*``, ``/v3/lease/*``,
``/v3/watch``), standard library only.

Why not a library: see ``ipam/DESIGN.md`` ("etcd datastore"). In short: importing this costs
~3 ms (sockets, json, base64; ``ssl`` only for https), where etcd3gw costs ~100 ms and 22 MB
(requests) and grpc ~50 ms and 20 MB; and none of them rotates over several endpoints within
one deadline.

- HTTP/1.1 over plain sockets, written here (``http.client`` alone costs ~19 ms to import),
  keep-alive: a call takes an idle connection to the endpoint that last answered (or opens
  one) and gives it back after the answer, so a long-lived client serving short-lived
  threads (tabby-node: one thread per CNI call) reuses its connections.
- Every call has a total deadline. Connection errors, and the gateway's answers meaning
  "not now" (HTTP 408/502/503/504, gRPC codes 1 Canceled, 4 DeadlineExceeded, 14
  Unavailable), move the thread to the next endpoint and retry until the deadline; then
  ``EtcdUnavailable`` names every endpoint and the last error.
- A write retried after its outcome became unknown (sent, then the connection broke or the
  answer was "not now") is flagged ``ambiguous`` in its result: it may have been applied
  already. The store resolves that (see ``EtcdStore``).
- The gateway's JSON: keys and values are base64; int64 fields are strings; fields that are
  zero, false or empty are omitted (a txn whose compare failed has no ``succeeded``).
- Watch: a streaming ``POST /v3/watch`` answered with newline-delimited JSON results in HTTP
  chunks; read with short timeouts so a stop request is seen within ~0.25 s. The request
  carries the ``hasleader`` metadata, so a member that loses its leader ends the stream
  instead of going quiet. ``watch_ranges`` opens one stream per range and reads them all
  from the calling thread (``selectors``). Not one stream carrying several create requests,
  although etcd allows it: the gateway reads a request body's second and later requests
  while it already answers the first, and etcd's HTTP/1.1 server (Go's) discards the
  unread rest of a request body once the answer's head is out, so on a busy member those
  watches are silently never created (measured: a third of the streams lost their last
  watch with ~600-byte bodies under load).
"""

from __future__ import annotations

import base64
import json
import os
import socket
import threading
import time
from collections.abc import Generator, Iterator, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import ssl

    from bundle.types import JSON

RETRY_HTTP = frozenset({408, 429, 502, 503, 504})
RETRY_GRPC = frozenset({1, 4, 14})  # Canceled, DeadlineExceeded, Unavailable
COMPACTED = 11  # OutOfRange: "required revision has been compacted"
MAX_HEAD = 64 * 1024
HASLEADER = "Grpc-Metadata-Hasleader: true\r\n"  # clientv3's WithRequireLeader
WATCH_POLL = 0.25  # seconds between looks at the stop event while a watch is idle
CANCEL_SLICE = 0.25  # a cancellable call looks at its event this often while it waits
CANCEL_CONNECT = 1.0  # and gives one connection attempt at most this long
DEFAULT_PORT = 2379


# == errors ==============================================================================


class EtcdError(Exception):
    """Base of the client's errors."""


class EtcdConfigError(EtcdError):
    """Bad endpoint URL, or TLS files that cannot be loaded."""


class EtcdUnavailable(EtcdError):
    """No endpoint gave an answer within the deadline."""

    def __init__(self, endpoints: Sequence[str], reason: str) -> None:
        self.endpoints = list(endpoints)
        self.reason = reason
        super().__init__(f"{', '.join(endpoints)}: {reason}")


class EtcdRequestError(EtcdError):
    """etcd refused the request (an error that another endpoint would give too)."""

    def __init__(self, endpoint: str, http_status: int, code: int, message: str) -> None:
        self.endpoint = endpoint
        self.http_status = http_status
        self.code = code
        self.message = message
        super().__init__(f"{endpoint}: {message} (HTTP {http_status}, gRPC code {code})")


class EtcdCompacted(EtcdRequestError):
    """The revision asked for has been compacted away."""


class EtcdCancelled(EtcdError):
    """The call's ``cancel`` event was set while it waited."""


class _Transient(Exception):
    """One attempt failed in a way another endpoint (or a later try) may not."""

    def __init__(self, reason: str, *, sent: bool) -> None:
        super().__init__(reason)
        self.sent = sent  # the request may have reached etcd


# == data ================================================================================


# Plain slotted classes, not NamedTuples: defining six NamedTuples costs ~1.2 ms of import.


class KeyValue:
    __slots__ = ("create_revision", "key", "lease", "mod_revision", "value", "version")

    def __init__(
        self,
        key: bytes,
        value: bytes,
        create_revision: int,
        mod_revision: int,
        version: int,
        lease: int,
    ) -> None:
        self.key = key
        self.value = value
        self.create_revision = create_revision
        self.mod_revision = mod_revision
        self.version = version
        self.lease = lease

    def __repr__(self) -> str:
        return (
            f"KeyValue(key={self.key!r}, value={self.value!r}, create_revision="
            f"{self.create_revision}, mod_revision={self.mod_revision}, version={self.version}, "
            f"lease={self.lease})"
        )


class RangeResult:
    __slots__ = ("kvs", "more", "revision", "total")

    def __init__(self, kvs: list[KeyValue], revision: int, total: int, more: bool) -> None:
        self.kvs = kvs
        self.revision = revision
        self.total = total  # keys in the range (more than ``kvs`` when limited)
        self.more = more


class TxnResult:
    __slots__ = ("ambiguous", "responses", "revision", "succeeded")

    def __init__(
        self, succeeded: bool, revision: int, responses: list[JSON], ambiguous: bool
    ) -> None:
        self.succeeded = succeeded
        self.revision = revision
        self.responses = responses
        self.ambiguous = ambiguous  # an earlier attempt of this txn may have been applied

    def __repr__(self) -> str:
        return (
            f"TxnResult(succeeded={self.succeeded}, revision={self.revision}, "
            f"ambiguous={self.ambiguous})"
        )


class WatchEvent:
    __slots__ = ("kv", "type")

    def __init__(self, type: str, kv: KeyValue) -> None:
        self.type = type  # "PUT" or "DELETE"
        self.kv = kv


class WatchResponse:
    """One ``result`` of the watch stream, read from the gateway's JSON.

    Which answer it is: ``created`` (the watch started; no events), ``canceled`` (the watch
    ended; ``compact_revision`` > 0: its start revision was compacted away), events, or
    neither (a progress notification: every change of the watch's range up to
    ``revision`` has been sent). ``index``: the position of its range in ``watch_ranges``.
    """

    __slots__ = ("canceled", "compact_revision", "created", "events", "index", "reason", "revision")

    def __init__(self, result: JSON) -> None:
        self.revision = _int(result.get("header", {}).get("revision"))
        self.events = [
            WatchEvent(ev.get("type") or "PUT", kv_from_json(ev.get("kv") or {}))
            for ev in result.get("events", ())
        ]
        # > 0: history gone; the watch was cancelled
        self.compact_revision = _int(result.get("compact_revision"))
        self.canceled = bool(result.get("canceled"))
        self.created = bool(result.get("created"))
        self.reason = str(result.get("cancel_reason", ""))
        self.index = 0

    @classmethod
    def of(
        cls,
        *,
        revision: int,
        events: list[WatchEvent],
        created: bool = False,
        canceled: bool = False,
        compact_revision: int = 0,
        reason: str = "",
    ) -> WatchResponse:
        """A response from its fields (a decoded gRPC message: ``datastore.etcd.grpc``)."""
        resp = cls.__new__(cls)
        resp.revision = revision
        resp.events = events
        resp.created = created
        resp.canceled = canceled
        resp.compact_revision = compact_revision
        resp.reason = reason
        resp.index = 0
        return resp


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def unb64(text: str | None) -> bytes:
    return base64.b64decode(text) if text else b""


def _int(value: str | int | None) -> int:
    """An int64 field: a string in the gateway's JSON, absent when 0."""
    return int(value) if value else 0


def kv_from_json(obj: JSON) -> KeyValue:
    return KeyValue(
        unb64(obj.get("key")),
        unb64(obj.get("value")),
        _int(obj.get("create_revision")),
        _int(obj.get("mod_revision")),
        _int(obj.get("version")),
        _int(obj.get("lease")),
    )


def random_index(n: int) -> int:
    """A random index below ``n`` (``os.urandom``: the random module costs ~1 ms of import on
    a CNI call's path)."""
    return int.from_bytes(os.urandom(2), "big") % n


def prefix_end(prefix: bytes) -> bytes:
    """The ``range_end`` that makes a range cover every key starting with ``prefix``."""
    end = bytearray(prefix)
    while end:
        if end[-1] < 0xFF:
            end[-1] += 1
            return bytes(end)
        end.pop()
    return b"\0"  # every key


# txn building blocks (the gateway's JSON names) -----------------------------------------


def cmp_mod(key: bytes, revision: int) -> JSON:
    return {"key": b64(key), "target": "MOD", "result": "EQUAL", "mod_revision": str(revision)}


def cmp_absent(key: bytes) -> JSON:
    return {"key": b64(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}


def op_put(key: bytes, value: bytes, lease: int = 0) -> JSON:
    req: JSON = {"key": b64(key), "value": b64(value)}
    if lease:
        req["lease"] = str(lease)
    return {"request_put": req}


def op_delete(key: bytes) -> JSON:
    return {"request_delete_range": {"key": b64(key)}}


def op_get(key: bytes) -> JSON:
    return {"request_range": {"key": b64(key)}}


# == endpoints and HTTP ==================================================================


class Endpoint:
    __slots__ = ("host", "port", "tls", "url")

    def __init__(self, url: str, tls: bool, host: str, port: int) -> None:
        self.url = url  # as configured (for messages)
        self.tls = tls
        self.host = host
        self.port = port


def parse_endpoint(text: str, *, tls_default: bool = False) -> Endpoint:
    """``http(s)://host:port``, ``host:port`` or ``[v6]:port`` (a path is ignored)."""
    raw = text.strip()
    rest = raw
    tls = tls_default
    if "://" in rest:
        scheme, rest = rest.split("://", 1)
        if scheme.lower() not in ("http", "https"):
            raise EtcdConfigError(f"etcd endpoint {text!r}: scheme must be http or https")
        tls = scheme.lower() == "https"
    hostport = rest.split("/", 1)[0]
    if "@" in hostport:
        raise EtcdConfigError(f"etcd endpoint {text!r}: credentials in URLs are not supported")
    if hostport.startswith("["):
        host, sep, tail = hostport[1:].partition("]")
        if not sep or (tail and not tail.startswith(":")):
            raise EtcdConfigError(f"etcd endpoint {text!r}: bad IPv6 address")
        port_text = tail[1:]
    else:
        host, _, port_text = hostport.partition(":")
    if not host:
        raise EtcdConfigError(f"etcd endpoint {text!r}: no host")
    try:
        port = int(port_text) if port_text else DEFAULT_PORT
    except ValueError:
        raise EtcdConfigError(f"etcd endpoint {text!r}: bad port") from None
    if not 0 < port < 65536:
        raise EtcdConfigError(f"etcd endpoint {text!r}: bad port")
    return Endpoint(raw, tls, host, port)


class _Conn:
    """One HTTP/1.1 connection to one endpoint. Reads are buffered, so a read timeout
    loses nothing (the watch relies on that)."""

    def __init__(
        self, ep: Endpoint, ctx: ssl.SSLContext | None, deadline: float, cap: float | None = None
    ) -> None:
        self.ep = ep
        self.buf = bytearray()
        self.cancel: threading.Event | None = None  # set by a cancellable call while it runs
        timeout = max(0.001, deadline - time.monotonic())
        if cap is not None:
            timeout = min(timeout, cap)
        try:
            sock = socket.create_connection((ep.host, ep.port), timeout=timeout)
        except OSError as e:
            raise _Transient(f"{ep.url}: connect: {_reason(e)}", sent=False) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock = ctx.wrap_socket(sock, server_hostname=ep.host)
        except OSError as e:  # includes ssl.SSLError
            sock.close()
            raise _Transient(f"{ep.url}: TLS: {_reason(e)}", sent=False) from None
        self.sock: socket.socket | None = sock
        self.host_header = f"[{ep.host}]:{ep.port}" if ":" in ep.host else f"{ep.host}:{ep.port}"

    def idle_ok(self) -> bool:
        """Whether an idle connection is still usable: open, nothing buffered, and not
        readable (an idle HTTP connection becomes readable only when the peer closed it)."""
        if self.sock is None or self.buf:
            return False
        import select

        try:
            readable, _, _ = select.select([self.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not readable

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def send(self, path: str, body: bytes, deadline: float, extra: str = "") -> None:
        if self.sock is None:
            raise _Transient(f"{self.ep.url}: connection closed", sent=False)
        head = (
            f"POST {path} HTTP/1.1\r\nHost: {self.host_header}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n{extra}\r\n"
        )
        try:
            self.sock.settimeout(max(0.001, deadline - time.monotonic()))
            self.sock.sendall(head.encode("ascii") + body)
        except OSError as e:
            self.close()
            # on a fresh connection nothing reached etcd; on a reused one a partial
            # request cannot have been acted on either (etcd needs the whole body)
            raise _Transient(f"{self.ep.url}: send: {_reason(e)}", sent=False) from None

    def _fill(self, deadline: float | None, timeout: float | None = None) -> None:
        """Read more bytes into the buffer. ``TimeoutError`` when ``timeout`` (one wait) or
        the deadline passes; ``EtcdCancelled`` when ``self.cancel`` is set meanwhile (looked
        at every ``CANCEL_SLICE``); EOF is ``_Transient``."""
        assert self.sock is not None
        while True:
            wait = timeout
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("deadline")
                wait = left if wait is None else min(left, wait)
            sliced = self.cancel is not None and timeout is None
            self.sock.settimeout(min(CANCEL_SLICE, wait or CANCEL_SLICE) if sliced else wait)
            try:
                chunk = self.sock.recv(65536)
            except TimeoutError:
                if self.cancel is not None and self.cancel.is_set():
                    raise EtcdCancelled("cancelled") from None
                if sliced:
                    continue
                raise
            if not chunk:
                raise _Transient(f"{self.ep.url}: connection closed by etcd", sent=True)
            self.buf += chunk
            return

    def _line(self, deadline: float | None, timeout: float | None = None) -> bytes:
        while True:
            i = self.buf.find(b"\r\n")
            if i >= 0:
                line = bytes(self.buf[:i])
                del self.buf[: i + 2]
                return line
            if len(self.buf) > MAX_HEAD:
                raise _Transient(f"{self.ep.url}: response line too long", sent=True)
            self._fill(deadline, timeout)

    def _exact(self, n: int, deadline: float | None, timeout: float | None = None) -> bytes:
        while len(self.buf) < n:
            self._fill(deadline, timeout)
        data = bytes(self.buf[:n])
        del self.buf[:n]
        return data

    def read_head(self, deadline: float) -> tuple[int, dict[str, str]]:
        status_line = self._line(deadline)
        parts = status_line.split(None, 2)
        if len(parts) < 2 or not parts[0].startswith(b"HTTP/1."):
            raise _Transient(f"{self.ep.url}: not an HTTP answer: {status_line[:60]!r}", sent=True)
        status = int(parts[1])
        headers: dict[str, str] = {}
        while True:
            line = self._line(deadline)
            if not line:
                return status, headers
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()

    def read_body(self, headers: dict[str, str], deadline: float) -> bytes:
        if headers.get("transfer-encoding", "").lower() == "chunked":
            parts = []
            while True:
                size = self._chunk_size(deadline)
                if size == 0:
                    while self._line(deadline):  # trailers
                        pass
                    break
                parts.append(self._exact(size, deadline))
                self._exact(2, deadline)
            body = b"".join(parts)
        elif "content-length" in headers:
            body = self._exact(int(headers["content-length"]), deadline)
        else:  # read to EOF
            chunks = [bytes(self.buf)]
            self.buf.clear()
            try:
                while True:
                    self._fill(deadline)
                    chunks.append(bytes(self.buf))
                    self.buf.clear()
            except _Transient:
                pass
            self.close()
            body = b"".join(chunks)
        if headers.get("connection", "").lower() == "close":
            self.close()
        return body

    def _chunk_size(self, deadline: float | None, timeout: float | None = None) -> int:
        line = self._line(deadline, timeout)
        try:
            return int(line.split(b";", 1)[0], 16)
        except ValueError:
            raise _Transient(f"{self.ep.url}: bad chunk header {line[:40]!r}", sent=True) from None

    def request(self, path: str, body: bytes, deadline: float) -> tuple[int, dict[str, str], bytes]:
        self.send(path, body, deadline)
        try:
            status, headers = self.read_head(deadline)
            return status, headers, self.read_body(headers, deadline)
        except _Transient:
            self.close()
            raise
        except TimeoutError:
            self.close()
            raise _Transient(f"{self.ep.url}: no answer in time", sent=True) from None
        except OSError as e:
            self.close()
            raise _Transient(f"{self.ep.url}: {_reason(e)}", sent=True) from None


def _reason(e: BaseException) -> str:
    if isinstance(e, TimeoutError | socket.timeout):
        return "timed out"
    text = getattr(e, "strerror", None) or getattr(e, "reason", None) or str(e) or repr(e)
    return str(text)


class _Rotation:
    """One call's way through the endpoints within its deadline. Each attempt gets a share
    of the time left (a member that hangs must not eat the whole deadline when others may
    answer); after a failure the next endpoint, and once every endpoint failed, a short pause
    (50 ms, doubling up to 0.5 s). ``cancel`` ends it (``EtcdCancelled``) at the next attempt
    or during a pause."""

    __slots__ = ("cancel", "deadline", "failures", "index", "last", "n", "urls")

    def __init__(
        self, urls: list[str], index: int, deadline: float, cancel: threading.Event | None
    ) -> None:
        self.urls = urls
        self.n = len(urls)
        self.index = index
        self.deadline = deadline
        self.cancel = cancel
        self.failures = 0
        self.last = "no attempt"

    def attempt(self, giving_up: str) -> float:
        """The deadline of the next attempt; ``EtcdUnavailable("<giving_up> (<last error>)")``
        once the call's deadline has passed."""
        if self.cancel is not None and self.cancel.is_set():
            raise EtcdCancelled("cancelled")
        now = time.monotonic()
        if now >= self.deadline:
            raise EtcdUnavailable(self.urls, f"{giving_up} ({self.last})")
        left = self.deadline - now
        return now + (left if self.n == 1 else max(left / self.n, min(left, 1.0)))

    def failed(self, reason: str) -> None:
        """The attempt failed: move on to the next endpoint (pausing after a full round)."""
        self.last = reason
        self.failures += 1
        self.index = (self.index + 1) % self.n
        if self.failures % self.n:
            return
        pause = min(
            0.05 * (2 ** (self.failures // self.n - 1)), 0.5, self.deadline - time.monotonic()
        )
        if pause > 0:
            if self.cancel is not None:
                self.cancel.wait(pause)
            else:
                time.sleep(pause)


# == the client ==========================================================================


class EtcdClient:
    """Thread-safe; see the module docstring. ``timeout``: default total deadline of a call."""

    def __init__(
        self,
        endpoints: Sequence[str],
        *,
        timeout: float = 5.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
    ) -> None:
        if isinstance(endpoints, str):
            endpoints = [e for e in endpoints.split(",") if e.strip()]
        if not endpoints:
            raise EtcdConfigError("no etcd endpoints")
        if bool(cert_file) != bool(key_file):
            raise EtcdConfigError("etcd client certificate and key must be given together")
        tls_default = bool(ca_file or cert_file)
        self.endpoints = tuple(parse_endpoint(e, tls_default=tls_default) for e in endpoints)
        self.urls = [ep.url for ep in self.endpoints]
        self.timeout = float(timeout)
        self.ca_file = ca_file
        self.cert_file = cert_file
        self.key_file = key_file
        self._ctx: ssl.SSLContext | None = None
        self._ctx_lock = threading.Lock()
        self._idle: dict[int, list[_Conn]] = {}  # endpoint index -> connections not in use
        self._conns: set[_Conn] = set()
        self._conns_lock = threading.Lock()
        # the endpoint that answered last (threads start there); at first a random one, so
        # that nodes given the same list spread over the members (or listeners)
        self._preferred = random_index(len(self.endpoints))
        self._closed = False

    # -- plumbing -----------------------------------------------------------------------

    def _context(self) -> ssl.SSLContext:
        with self._ctx_lock:
            if self._ctx is None:
                self._ctx = self.tls_context()
            return self._ctx

    def tls_context(self, alpn: Sequence[str] = ()) -> ssl.SSLContext:
        """A new TLS context with the client's files (``alpn``: protocols to offer)."""
        import ssl  # only for https endpoints: ~5 ms and 4 MB

        try:
            ctx = ssl.create_default_context(cafile=self.ca_file)
            if self.cert_file and self.key_file:
                ctx.load_cert_chain(self.cert_file, self.key_file)
            if alpn:
                ctx.set_alpn_protocols(list(alpn))
        except (OSError, ssl.SSLError) as e:
            files = ", ".join(f for f in (self.ca_file, self.cert_file, self.key_file) if f)
            raise EtcdConfigError(f"etcd TLS files ({files}): {_reason(e)}") from None
        return ctx

    def _connect(self, index: int, deadline: float, cap: float | None = None) -> _Conn:
        ep = self.endpoints[index]
        ctx = self._context() if ep.tls else None
        conn = _Conn(ep, ctx, deadline, cap)
        with self._conns_lock:
            self._conns.add(conn)
        return conn

    def _drop(self, conn: _Conn) -> None:
        conn.close()
        with self._conns_lock:
            self._conns.discard(conn)

    def call(
        self,
        path: str,
        body: JSON,
        *,
        deadline: float | None = None,
        idempotent: bool = True,
        cancel: threading.Event | None = None,
    ) -> tuple[JSON, bool]:
        """POST ``body`` to ``path``; the decoded answer, and whether a non-idempotent
        request had an attempt with an unknown outcome before the one that answered.
        ``cancel``: give up (``EtcdCancelled``) within ~0.25 s of it being set (connection
        attempts then last at most ``CANCEL_CONNECT`` each)."""
        if self._closed:
            raise EtcdError("client closed")
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        payload = json.dumps(body, separators=(",", ":")).encode()
        tries = _Rotation(self.urls, self._preferred, deadline, cancel)
        ambiguous = False
        cap = CANCEL_CONNECT if cancel is not None else None
        while True:
            attempt_deadline = tries.attempt("no answer within the deadline")
            index = tries.index
            conn = self._checkout(index)
            try:
                if conn is None:
                    conn = self._connect(index, attempt_deadline, cap)
                conn.cancel = cancel
                try:
                    status, _headers, data = conn.request(path, payload, attempt_deadline)
                except EtcdCancelled:
                    self._drop(conn)  # in mid-answer: unusable
                    raise
                finally:
                    conn.cancel = None
                url = conn.ep.url
                self._checkin(index, conn)
                conn = None
                if status == 200:
                    self._preferred = index
                    try:
                        answer = json.loads(data)
                    except ValueError:
                        raise _Transient(f"{url}: answer is not JSON", sent=True) from None
                    if not isinstance(answer, dict):
                        raise _Transient(f"{url}: answer is not an object", sent=True)
                    return answer, ambiguous
                code, message = _error_of(data)
                if status in RETRY_HTTP or code in RETRY_GRPC or (status == 500 and code == 2):
                    raise _Transient(f"{url}: {message} (HTTP {status})", sent=True)
                cls = EtcdCompacted if code == COMPACTED else EtcdRequestError
                raise cls(url, status, code, message)
            except _Transient as e:
                if e.sent and not idempotent:
                    ambiguous = True
                if conn is not None:
                    self._drop(conn)
                tries.failed(str(e))

    def _checkout(self, index: int) -> _Conn | None:
        """An idle connection to endpoint ``index`` (the most recently used), if any. One
        the server has closed meanwhile (readable while idle: EOF) is dropped here, before
        a write is sent on it and its outcome becomes unknown."""
        while True:
            with self._conns_lock:
                idle = self._idle.get(index)
                conn = idle.pop() if idle else None
            if conn is None or conn.idle_ok():
                return conn
            self._drop(conn)

    def _checkin(self, index: int, conn: _Conn) -> None:
        """Give a connection back after a complete answer (a broken one is closed)."""
        if conn.sock is None or self._closed:
            self._drop(conn)
            return
        with self._conns_lock:
            if conn in self._conns:
                self._idle.setdefault(index, []).append(conn)
                return
        conn.close()  # the client was closed meanwhile

    def close(self) -> None:
        """Close every connection (a running watch ends with ``EtcdUnavailable``)."""
        self._closed = True
        with self._conns_lock:
            conns = list(self._conns)
            self._conns.clear()
            self._idle.clear()
        for conn in conns:
            conn.close()

    # -- KV -----------------------------------------------------------------------------

    def range(
        self,
        key: bytes,
        range_end: bytes | None = None,
        *,
        revision: int = 0,
        limit: int = 0,
        keys_only: bool = False,
        count_only: bool = False,
        serializable: bool = False,
        deadline: float | None = None,
        cancel: threading.Event | None = None,
    ) -> RangeResult:
        body: JSON = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        if revision:
            body["revision"] = str(revision)
        if limit:
            body["limit"] = str(limit)
        if keys_only:
            body["keys_only"] = True
        if count_only:
            body["count_only"] = True
        if serializable:
            body["serializable"] = True
        answer, _ = self.call("/v3/kv/range", body, deadline=deadline, cancel=cancel)
        return RangeResult(
            [kv_from_json(kv) for kv in answer.get("kvs", ())],
            _int(answer.get("header", {}).get("revision")),
            _int(answer.get("count")),
            bool(answer.get("more")),
        )

    def put(
        self, key: bytes, value: bytes, *, lease: int = 0, deadline: float | None = None
    ) -> int:
        body = op_put(key, value, lease)["request_put"]
        answer, _ = self.call("/v3/kv/put", body, deadline=deadline)
        return _int(answer.get("header", {}).get("revision"))

    def delete_range(
        self, key: bytes, range_end: bytes | None = None, *, deadline: float | None = None
    ) -> int:
        body: JSON = {"key": b64(key)}
        if range_end is not None:
            body["range_end"] = b64(range_end)
        answer, _ = self.call("/v3/kv/deleterange", body, deadline=deadline)
        return _int(answer.get("deleted"))

    def txn(
        self,
        compare: list[JSON],
        success: list[JSON],
        failure: list[JSON] | None = None,
        *,
        deadline: float | None = None,
    ) -> TxnResult:
        body: JSON = {"compare": compare, "success": success}
        if failure:
            body["failure"] = failure
        answer, ambiguous = self.call("/v3/kv/txn", body, deadline=deadline, idempotent=False)
        return TxnResult(
            bool(answer.get("succeeded")),
            _int(answer.get("header", {}).get("revision")),
            list(answer.get("responses", ())),
            ambiguous,
        )

    # -- leases -------------------------------------------------------------------------

    def lease_grant(self, ttl: int, *, deadline: float | None = None) -> tuple[int, int]:
        """A new lease of ``ttl`` seconds: (id, granted ttl). A retried grant may leave an
        unused lease behind; it expires by itself."""
        answer, _ = self.call("/v3/lease/grant", {"TTL": str(ttl)}, deadline=deadline)
        if answer.get("error"):
            raise EtcdRequestError(self.urls[self._preferred], 200, 0, str(answer["error"]))
        return _int(answer.get("ID")), _int(answer.get("TTL"))

    def lease_revoke(self, lease: int, *, deadline: float | None = None) -> None:
        self.call("/v3/lease/revoke", {"ID": str(lease)}, deadline=deadline)

    def lease_keepalive(self, lease: int, *, deadline: float | None = None) -> int:
        """Renew a lease once; its new ttl (0: the lease is gone)."""
        answer, _ = self.call("/v3/lease/keepalive", {"ID": str(lease)}, deadline=deadline)
        result = answer.get("result", answer)
        return _int(result.get("TTL")) if isinstance(result, dict) else 0

    # -- maintenance --------------------------------------------------------------------

    def status(self, *, deadline: float | None = None) -> JSON:
        answer, _ = self.call("/v3/maintenance/status", {}, deadline=deadline)
        return answer

    # -- watch --------------------------------------------------------------------------

    def watch(
        self,
        key: bytes,
        range_end: bytes | None,
        start_revision: int,
        stop: threading.Event,
        *,
        deadline: float | None = None,
    ) -> Iterator[WatchResponse]:
        """Stream the changes of ``[key, range_end)`` from ``start_revision`` until ``stop``.

        ``watch_ranges`` for one range, without the "created" answer: a response with
        ``canceled`` (``compact_revision`` > 0 after a compaction) ends the iteration; a
        broken stream raises ``EtcdUnavailable``. Ends quietly (within ~0.25 s) once
        ``stop`` is set.
        """
        for resp in self.watch_ranges([(key, range_end, start_revision)], stop, deadline=deadline):
            if resp.created and not resp.canceled:
                continue
            yield resp
            if resp.canceled:
                return

    def watch_ranges(
        self,
        ranges: Sequence[tuple[bytes, bytes | None, int]],
        stop: threading.Event,
        *,
        deadline: float | None = None,
        progress_notify: bool = False,
    ) -> Generator[WatchResponse, None, None]:
        """Watch several ``(key, range_end, start_revision)`` ranges until ``stop``: one
        stream per range (see the module docstring), each from its own revision, all read
        by the calling thread.

        Every stream is connected (and its answer's head read) before ``deadline``
        (default: the client timeout), trying every endpoint; then they last as long as
        etcd keeps them. Every response carries ``index``, the position of its range; each
        watch's "created" answer is yielded too. A cancelled watch (``canceled``;
        ``compact_revision`` > 0 when its start revision was compacted) ends only its own
        range's watch. With ``progress_notify`` etcd sends each watch that is caught up a
        response without events every ``--experimental-watch-progress-notify-interval``
        (10 min by default): its range had no other change up to the response's
        ``revision``. A broken stream raises ``EtcdUnavailable`` (closing them all). Ends
        quietly (within ~0.25 s) once ``stop`` is set.
        """
        if not ranges:
            raise ValueError("watch_ranges needs at least one range")
        if deadline is None:
            deadline = time.monotonic() + self.timeout
        streams: list[_WatchStream] = []
        try:
            for index, (key, range_end, start_revision) in enumerate(ranges):
                create: JSON = {
                    "key": b64(key),
                    "start_revision": str(start_revision),
                }
                if range_end is not None:
                    create["range_end"] = b64(range_end)
                if progress_notify:
                    create["progress_notify"] = True
                payload = json.dumps({"create_request": create}, separators=(",", ":")).encode()
                streams.append(_WatchStream(self._open_watch(payload, deadline, stop), index))
            yield from _read_watches(streams, stop)
        finally:
            for stream in streams:
                self._drop(stream.conn)

    def _open_watch(self, payload: bytes, deadline: float, stop: threading.Event) -> _Conn:
        tries = _Rotation(self.urls, self._preferred, deadline, stop)
        while True:
            attempt_deadline = tries.attempt("watch not started")
            index = tries.index
            conn: _Conn | None = None
            try:
                conn = self._connect(index, attempt_deadline, CANCEL_CONNECT)
                conn.send("/v3/watch", payload, attempt_deadline, HASLEADER)
                conn.cancel = stop
                try:
                    status, headers = conn.read_head(attempt_deadline)
                    if status != 200:
                        data = conn.read_body(headers, attempt_deadline)
                        _code, message = _error_of(data)
                        raise _Transient(
                            f"{conn.ep.url}: watch: {message} (HTTP {status})", sent=True
                        )
                    if headers.get("transfer-encoding", "").lower() != "chunked":
                        raise _Transient(f"{conn.ep.url}: watch answer is not a stream", sent=True)
                except (TimeoutError, OSError) as e:
                    raise _Transient(f"{conn.ep.url}: watch: {_reason(e)}", sent=True) from None
                except EtcdCancelled:
                    self._drop(conn)
                    raise
                conn.cancel = None  # the reader looks at stop itself
                self._preferred = index
                return conn
            except _Transient as e:
                if conn is not None:
                    self._drop(conn)
                tries.failed(str(e))


class _WatchStream:
    """One watch stream being read: its connection and the de-chunking of its answer."""

    __slots__ = ("conn", "index", "size", "text")

    def __init__(self, conn: _Conn, index: int) -> None:
        self.conn = conn
        self.index = index  # the position of its range
        self.text = bytearray()  # de-chunked bytes not yet split into lines
        self.size = -1  # bytes left of the current chunk; -1: its header is next; -2: its CRLF

    def receive(self) -> None:
        """Read what the socket has (a TLS record not complete yet: nothing)."""
        sock = self.conn.sock
        if sock is None:
            raise EtcdUnavailable([self.conn.ep.url], "watch broken: connection closed")
        try:
            chunk = sock.recv(65536)
            if not chunk:
                raise EtcdUnavailable([self.conn.ep.url], "watch broken: connection closed by etcd")
            self.conn.buf += chunk
            pending = getattr(sock, "pending", None)  # TLS: decrypted bytes select cannot see
            while pending is not None and pending():
                self.conn.buf += sock.recv(65536)
        except TimeoutError:
            return
        except OSError as e:
            raise EtcdUnavailable([self.conn.ep.url], f"watch broken: {_reason(e)}") from None

    def responses(self) -> Iterator[WatchResponse]:
        """The complete responses among the bytes received so far, in order."""
        buf = self.conn.buf
        url = self.conn.ep.url
        while True:
            if self.size == -1:
                i = buf.find(b"\r\n")
                if i < 0:
                    if len(buf) > MAX_HEAD:
                        raise EtcdUnavailable([url], "watch broken: chunk header too long")
                    break
                line = bytes(buf[:i])
                del buf[: i + 2]
                try:
                    self.size = int(line.split(b";", 1)[0], 16)
                except ValueError:
                    raise EtcdUnavailable([url], f"watch broken: bad chunk {line[:40]!r}") from None
                if self.size == 0:
                    raise EtcdUnavailable([url], "watch stream ended")
            elif self.size == -2:
                if len(buf) < 2:
                    break
                del buf[:2]
                self.size = -1
            else:
                if not buf:
                    break
                take = min(self.size, len(buf))
                self.text += buf[:take]
                del buf[:take]
                self.size -= take
                if self.size == 0:
                    self.size = -2
        while True:
            i = self.text.find(b"\n")
            if i < 0:
                return
            line = bytes(self.text[:i])
            del self.text[: i + 1]
            if not line.strip():
                continue
            resp = _watch_response(url, line)
            if resp is not None:
                resp.index = self.index
                yield resp


def _read_watches(streams: list[_WatchStream], stop: threading.Event) -> Iterator[WatchResponse]:
    """The responses of every stream as they come, until ``stop`` (looked at every
    ``WATCH_POLL``)."""
    import selectors  # only tabby-node and tabbyctl watch: not on a CNI call's path

    with selectors.DefaultSelector() as selector:
        for stream in streams:
            sock = stream.conn.sock
            assert sock is not None
            sock.settimeout(WATCH_POLL)
            selector.register(sock, selectors.EVENT_READ, stream)
            yield from stream.responses()  # bytes that came with the answer's head
        while not stop.is_set():
            for key, _ in selector.select(WATCH_POLL):
                stream = key.data
                stream.receive()
                yield from stream.responses()


def _watch_response(url: str, line: bytes) -> WatchResponse | None:
    try:
        msg = json.loads(line)
    except ValueError:
        raise EtcdUnavailable([url], f"watch: not JSON: {line[:80]!r}") from None
    if not isinstance(msg, dict):
        raise EtcdUnavailable([url], "watch: not a JSON object")
    if "error" in msg and "result" not in msg:
        err = msg["error"]
        message = err.get("message", str(err)) if isinstance(err, dict) else str(err)
        raise EtcdUnavailable([url], f"watch: {message}")
    result = msg.get("result")
    if not isinstance(result, dict):
        return None
    try:
        return WatchResponse(result)
    except (AttributeError, TypeError, ValueError) as e:  # a field of the wrong shape
        raise EtcdUnavailable([url], f"watch: a malformed response: {_reason(e)}") from None


def _error_of(data: bytes) -> tuple[int, str]:
    """The gRPC code and message of a gateway error body."""
    try:
        err = json.loads(data)
    except ValueError:
        return 0, data[:200].decode("utf-8", "replace") or "empty answer"
    if not isinstance(err, dict):
        return 0, str(err)[:200]
    message = err.get("message") or err.get("error") or "unknown error"
    try:
        code = int(err.get("code", 0))
    except (TypeError, ValueError):
        code = 0
    return code, str(message)
