"""etcd's Watch over native gRPC: tabby-node's watches (``GrpcWatcher.watch_ranges``, the
same contract as ``EtcdClient.watch_ranges`` over the JSON gateway).

Why a second transport: through etcd's JSON gateway every delivered event costs etcd ~70-160
us of CPU, and all gateway watchers of one client listener share one internal connection (a
hundred of them fell tens of seconds behind: docs/performance.md, ``bench.scale.scale_bench``);
native gRPC costs etcd ~24 us per event, and it is the only protocol ``etcd grpc-proxy`` speaks (the
proxy coalesces the identical watches of many nodes into one watch on etcd, which is how
tabby's fan-out scales past a few hundred nodes: docs/cluster.md "Scale and watch fan-out").

- HTTP/2 by ``h2`` (pure Python, ~4 MB; imported when a watch starts: tabby-node, tabbyctl
  and the controllers, never a CNI call). The protobuf of the few messages used is encoded
  and decoded here (etcd's ``etcdserverpb.WatchRequest`` / ``WatchCreateRequest`` /
  ``WatchResponse`` / ``ResponseHeader`` and ``mvccpb.Event`` / ``KeyValue``, field numbers
  from etcd's API reference).
- One connection per ``watch_ranges`` call, one ``Watch`` stream on it carrying every
  range's watch. The creates are sent one at a time, each after the previous one's "created"
  answer (etcd numbers a stream's watches as it creates them; every later answer carries the
  number): each response's ``index`` is the position of its range.
- ``hasleader: true`` metadata (clientv3's WithRequireLeader): a member that loses its leader
  ends the stream instead of going quiet.
- Flow control: the stream and connection windows are WINDOW bytes (a resumed watch may bring
  megabytes at once), given back as the bytes are read.
- A connection silent for PING_IDLE s is pinged; without an answer within PING_TIMEOUT s it
  is broken (a member gone without a FIN or RST). etcd's default keepalive policy allows a
  client ping every 5 s on a connection with a stream.
- Endpoints: ``watch_endpoints`` (default: the client's own), each tried in turn from a
  random one within the deadline, like every call of ``EtcdClient``.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections import deque
from collections.abc import Generator, Sequence
from typing import TYPE_CHECKING

from datastore.etcd.client import (
    WATCH_POLL,
    EtcdCancelled,
    EtcdClient,
    EtcdUnavailable,
    KeyValue,
    WatchEvent,
    WatchResponse,
    _reason,
    _Rotation,
    _Transient,
    parse_endpoint,
    random_index,
)
from datastore.protobuf import ProtoError, as_bytes, as_int64, fields, int_field, len_field

if TYPE_CHECKING:
    import ssl

    from h2.connection import H2Connection

WATCH_PATH = "/etcdserverpb.Watch/Watch"
WINDOW = 16 * 1024 * 1024  # flow-control window of the stream and of the connection
MAX_MESSAGE = 256 * 1024 * 1024  # a longer gRPC message is refused (etcd's own send limit)
PING_IDLE = 30.0  # seconds of silence before a ping
PING_TIMEOUT = 10.0  # seconds a ping may go unanswered


# == protobuf (the wire format: datastore.protobuf) ====================================


def encode_create(
    key: bytes, range_end: bytes | None, start_revision: int, progress_notify: bool
) -> bytes:
    """A ``WatchRequest`` holding a ``WatchCreateRequest`` (key 1, range_end 2,
    start_revision 3, progress_notify 4; the request's create_request is field 1)."""
    create = len_field(1, key)
    if range_end is not None:
        create += len_field(2, range_end)
    create += int_field(3, start_revision) + int_field(4, int(progress_notify))
    return len_field(1, create)


def decode_kv(buf: bytes) -> KeyValue:
    """``mvccpb.KeyValue``: key 1, create_revision 2, mod_revision 3, version 4, value 5,
    lease 6."""
    key = value = b""
    create = mod = version = lease = 0
    for number, v in fields(buf):
        if number == 1:
            key = as_bytes(v)
        elif number == 2:
            create = as_int64(v)
        elif number == 3:
            mod = as_int64(v)
        elif number == 4:
            version = as_int64(v)
        elif number == 5:
            value = as_bytes(v)
        elif number == 6:
            lease = as_int64(v)
    return KeyValue(key, value, create, mod, version, lease)


def _decode_event(buf: bytes) -> WatchEvent:
    """``mvccpb.Event``: type 1 (0 PUT, 1 DELETE), kv 2 (prev_kv 3 is never asked for)."""
    kind = 0
    kv = None
    for number, v in fields(buf):
        if number == 1:
            kind = as_int64(v)
        elif number == 2:
            kv = decode_kv(as_bytes(v))
    return WatchEvent("DELETE" if kind == 1 else "PUT", kv or KeyValue(b"", b"", 0, 0, 0, 0))


def decode_response(buf: bytes) -> tuple[int, WatchResponse]:
    """``(watch_id, response)`` of an ``etcdserverpb.WatchResponse``: header 1 (its
    revision: 3), watch_id 2, created 3, canceled 4, compact_revision 5, cancel_reason 6,
    events 11."""
    watch_id = 0
    revision = compact = 0
    created = canceled = False
    reason = ""
    events: list[WatchEvent] = []
    for number, v in fields(buf):
        if number == 1:
            for hn, hv in fields(as_bytes(v)):
                if hn == 3:
                    revision = as_int64(hv)
        elif number == 2:
            watch_id = as_int64(v)
        elif number == 3:
            created = bool(v)
        elif number == 4:
            canceled = bool(v)
        elif number == 5:
            compact = as_int64(v)
        elif number == 6:
            reason = as_bytes(v).decode("utf-8", "replace")
        elif number == 11:
            events.append(_decode_event(as_bytes(v)))
    resp = WatchResponse.of(
        revision=revision,
        events=events,
        created=created,
        canceled=canceled,
        compact_revision=compact,
        reason=reason,
    )
    return watch_id, resp


# == the connection ======================================================================


class _Stream:
    """One HTTP/2 connection carrying one ``Watch`` call: send requests, read responses."""

    def __init__(
        self, url: str, host: str, port: int, ctx: ssl.SSLContext | None, deadline: float
    ) -> None:
        from h2.config import H2Configuration
        from h2.connection import H2Connection
        from h2.settings import SettingCodes

        self.url = url
        self.buf = bytearray()  # gRPC framed bytes not yet decoded
        self.ended = ""  # why the call ended ("" while it runs)
        self.last_heard = time.monotonic()
        self.ping_sent = 0.0  # when the unanswered ping went out (0: none)
        self.timeout = 0.0  # the socket's timeout now
        timeout = max(0.001, deadline - time.monotonic())
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as e:
            raise _Transient(f"{url}: connect: {_reason(e)}", sent=False) from None
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if ctx is not None:
                sock.settimeout(max(0.001, deadline - time.monotonic()))
                sock = ctx.wrap_socket(sock, server_hostname=host)
                if sock.selected_alpn_protocol() != "h2":
                    raise _Transient(f"{url}: TLS: the server does not speak HTTP/2", sent=False)
        except OSError as e:  # includes ssl.SSLError
            sock.close()
            raise _Transient(f"{url}: TLS: {_reason(e)}", sent=False) from None
        self.sock: socket.socket | None = sock
        self.h2: H2Connection = H2Connection(H2Configuration(client_side=True))
        self.h2.initiate_connection()
        self.h2.update_settings({SettingCodes.INITIAL_WINDOW_SIZE: WINDOW})
        self.h2.increment_flow_control_window(WINDOW - 65535)  # the connection's own window
        self.sid = self.h2.get_next_available_stream_id()
        authority = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self.h2.send_headers(
            self.sid,
            [
                (":method", "POST"),
                (":scheme", "https" if ctx is not None else "http"),
                (":path", WATCH_PATH),
                (":authority", authority),
                ("content-type", "application/grpc"),
                ("te", "trailers"),
                ("hasleader", "true"),
                ("user-agent", "tabby"),
            ],
        )
        self.flush(deadline)

    def close(self) -> None:
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.close()
            except OSError:
                pass

    def flush(self, deadline: float | None = None) -> None:
        out = self.h2.data_to_send()
        if not out:
            return
        sock = self.sock
        if sock is None:
            raise EtcdUnavailable([self.url], "watch broken: connection closed")
        try:
            self.timeout = (
                max(0.001, deadline - time.monotonic()) if deadline is not None else PING_TIMEOUT
            )
            sock.settimeout(self.timeout)
            sock.sendall(out)
        except OSError as e:
            raise EtcdUnavailable([self.url], f"watch broken: send: {_reason(e)}") from None

    def send(self, message: bytes, deadline: float) -> None:
        self.h2.send_data(self.sid, b"\0" + len(message).to_bytes(4, "big") + message)
        self.flush(deadline)

    def receive(self, timeout: float) -> list[tuple[int, WatchResponse]]:
        """What arrives within ``timeout`` (nothing: ``[]``); ``EtcdUnavailable`` once the
        call or the connection has ended."""
        if self.ended:
            raise EtcdUnavailable([self.url], self.ended)
        sock = self.sock
        if sock is None:
            raise EtcdUnavailable([self.url], "watch broken: connection closed")
        now = time.monotonic()
        if self.ping_sent and now - self.ping_sent > PING_TIMEOUT:
            raise EtcdUnavailable([self.url], "watch broken: no answer to a ping")
        if not self.ping_sent and now - self.last_heard > PING_IDLE:
            self.h2.ping(os.urandom(8))
            self.ping_sent = now
            self.flush()
        try:
            timeout = max(0.001, timeout)
            if timeout != self.timeout:  # a syscall: not once per message
                sock.settimeout(timeout)
                self.timeout = timeout
            data = sock.recv(65536)
            pending = getattr(sock, "pending", None)  # TLS: decrypted bytes select cannot see
            while data and pending is not None and pending():
                data += sock.recv(65536)
        except TimeoutError:
            return []
        except OSError as e:
            raise EtcdUnavailable([self.url], f"watch broken: {_reason(e)}") from None
        if not data:
            raise EtcdUnavailable([self.url], "watch broken: connection closed by etcd")
        self.last_heard = time.monotonic()
        out = self._events(data)
        self.flush()
        if not out and self.ended:
            raise EtcdUnavailable([self.url], self.ended)
        return out

    def _events(self, data: bytes) -> list[tuple[int, WatchResponse]]:
        from h2.events import (
            ConnectionTerminated,
            DataReceived,
            PingAckReceived,
            ResponseReceived,
            StreamEnded,
            StreamReset,
            TrailersReceived,
        )
        from h2.exceptions import ProtocolError

        try:
            events = self.h2.receive_data(data)
        except ProtocolError as e:
            raise EtcdUnavailable([self.url], f"watch broken: HTTP/2: {e}") from None
        for ev in events:
            if isinstance(ev, DataReceived):
                if ev.data:
                    self.buf += ev.data
                if ev.flow_controlled_length:
                    self.h2.acknowledge_received_data(ev.flow_controlled_length, ev.stream_id)
            elif isinstance(ev, ResponseReceived):
                self._head(ev.headers or [], trailers=False)
            elif isinstance(ev, TrailersReceived):
                self._head(ev.headers or [], trailers=True)
            elif isinstance(ev, StreamEnded):
                self.ended = self.ended or "watch stream ended by etcd"
            elif isinstance(ev, StreamReset):
                self.ended = f"watch broken: stream reset by etcd (HTTP/2 code {ev.error_code})"
            elif isinstance(ev, ConnectionTerminated):
                self.ended = self.ended or (
                    f"watch broken: etcd closed the connection (GOAWAY {ev.error_code})"
                )
            elif isinstance(ev, PingAckReceived):
                self.ping_sent = 0.0
        return self._messages()

    def _head(self, headers: Sequence[tuple[object, object]], trailers: bool) -> None:
        """A response's headers or trailers: a status other than 200, or a grpc-status
        (trailers, or a "trailers-only" answer), ends the call."""
        fields = {_text(k).lower(): _text(v) for k, v in headers}
        status = fields.get(":status")
        if status is not None and status != "200":
            self.ended = f"watch: HTTP {status}"
            return
        code = fields.get("grpc-status")
        if code is None:
            if trailers:
                self.ended = "watch ended without a gRPC status"
            return
        message = _unpercent(fields.get("grpc-message", ""))
        if code == "0":
            self.ended = "watch stream ended by etcd"
        else:
            self.ended = f"watch: {message or 'no message'} (gRPC code {code})"

    def _messages(self) -> list[tuple[int, WatchResponse]]:
        out: list[tuple[int, WatchResponse]] = []
        buf = self.buf
        while len(buf) >= 5:
            if buf[0] != 0:
                raise EtcdUnavailable([self.url], "watch: a compressed message (not asked for)")
            size = int.from_bytes(buf[1:5], "big")
            if size > MAX_MESSAGE:
                raise EtcdUnavailable([self.url], f"watch: a message of {size} bytes")
            if len(buf) < 5 + size:
                break
            message = bytes(buf[5 : 5 + size])
            del buf[: 5 + size]
            try:
                out.append(decode_response(message))
            except ProtoError as e:
                raise EtcdUnavailable([self.url], f"watch: bad WatchResponse: {e}") from None
        return out


def _text(value: object) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _unpercent(text: str) -> str:
    """grpc-message is percent-encoded."""
    if "%" not in text:
        return text
    from urllib.parse import unquote

    return unquote(text)


# == the watcher =========================================================================


class GrpcWatcher:
    """``watch_ranges`` over native gRPC for an ``EtcdClient``'s settings (its TLS files;
    its deadline), on ``watch_endpoints`` (default: the client's endpoints)."""

    def __init__(self, client: EtcdClient, watch_endpoints: Sequence[str] = ()) -> None:
        self.client = client
        if isinstance(watch_endpoints, str):
            watch_endpoints = [e for e in watch_endpoints.split(",") if e.strip()]
        tls_default = bool(client.ca_file or client.cert_file)
        self.endpoints = (
            tuple(parse_endpoint(e, tls_default=tls_default) for e in watch_endpoints)
            if watch_endpoints
            else client.endpoints
        )
        self.urls = [ep.url for ep in self.endpoints]
        self._preferred = random_index(len(self.endpoints))
        self._ctx: ssl.SSLContext | None = None
        self._ctx_lock = threading.Lock()

    def _context(self) -> ssl.SSLContext:
        with self._ctx_lock:
            if self._ctx is None:
                self._ctx = self.client.tls_context(alpn=["h2"])  # gRPC is HTTP/2 only
            return self._ctx

    def watch_ranges(
        self,
        ranges: Sequence[tuple[bytes, bytes | None, int]],
        stop: threading.Event,
        *,
        deadline: float | None = None,
        progress_notify: bool = False,
    ) -> Generator[WatchResponse, None, None]:
        """What ``EtcdClient.watch_ranges`` does (see there), over one gRPC stream."""
        if not ranges:
            raise ValueError("watch_ranges needs at least one range")
        if deadline is None:
            deadline = time.monotonic() + self.client.timeout
        stream, queue = self._open(ranges[0], deadline, stop, progress_notify)
        try:
            ids: dict[int, int] = {}  # watch id -> the position of its range
            while not stop.is_set():
                if not queue:
                    if len(ids) < len(ranges) and time.monotonic() > deadline:
                        raise EtcdUnavailable([stream.url], "watch not created in time")
                    queue.extend(stream.receive(WATCH_POLL))
                    continue
                watch_id, resp = queue.popleft()
                if resp.created and watch_id not in ids:
                    # the answer to the create sent last (one at a time): send the next
                    index = ids[watch_id] = len(ids)
                    if index + 1 < len(ranges):
                        stream.send(encode_create(*ranges[index + 1], progress_notify), deadline)
                elif watch_id not in ids:
                    continue  # not one of ours (cannot happen on our own stream)
                resp.index = ids[watch_id]
                yield resp
        finally:
            stream.close()

    def _open(
        self,
        first: tuple[bytes, bytes | None, int],
        deadline: float,
        stop: threading.Event,
        progress_notify: bool,
    ) -> tuple[_Stream, deque[tuple[int, WatchResponse]]]:
        """A stream whose first range's watch is created (trying every endpoint within the
        deadline), and the answers read so far, from its "created" on."""
        tries = _Rotation(self.urls, self._preferred, deadline, stop)
        request = encode_create(*first, progress_notify)
        while True:
            attempt_deadline = tries.attempt("watch not started")
            index = tries.index
            ep = self.endpoints[index]
            stream: _Stream | None = None
            try:
                ctx = self._context() if ep.tls else None
                stream = _Stream(ep.url, ep.host, ep.port, ctx, attempt_deadline)
                stream.send(request, attempt_deadline)
                while True:
                    if stop.is_set():
                        raise EtcdCancelled("cancelled")
                    left = attempt_deadline - time.monotonic()
                    if left <= 0:
                        raise _Transient(f"{ep.url}: watch: no answer", sent=True)
                    got = stream.receive(min(WATCH_POLL, left))
                    at = next((n for n, (_, r) in enumerate(got) if r.created), None)
                    if at is not None:  # nothing can come before it: no watch yet
                        self._preferred = index
                        return stream, deque(got[at:])
            except EtcdUnavailable as e:
                if stream is not None:
                    stream.close()
                tries.failed(f"{ep.url}: {e.reason}")
            except _Transient as e:
                if stream is not None:
                    stream.close()
                tries.failed(str(e))
            except BaseException:
                if stream is not None:
                    stream.close()
                raise
