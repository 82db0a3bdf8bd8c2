"""What every server a tabby daemon runs bounds, and the parts that bound it: how many
connections it serves at once (:class:`Gate`: beyond it a connection is refused at once,
never queued in a thread of its own), how large a request may be and how long reading it
may take (:class:`BoundedStream` for HTTP; the node socket's frames through
``tabby_node.recv_exact``), and how long the whole exchange may take; what each server
refused or cut, by reason (:class:`Refusals`, exported by the daemons' metrics).

A deadline here is a ``time.monotonic()`` instant fixed when the connection is accepted:
every read is given only the time left (a client that sends one byte at a time gains
nothing by it), and a write only the time left of the exchange (a client that never reads
its answer holds its worker no longer). docs/node.md "Limits" has the values and why.
"""

from __future__ import annotations

import http.client
import io
import logging
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

log = logging.getLogger("tabby.limits")

#: Why a server refused or cut a connection (the ``reason`` label).
#: busy: at its connection limit; too_large: a request over the size limit; timeout: the
#: request not read in time; overdue: the answer not delivered within the exchange's bound.
REASONS = ("busy", "too_large", "timeout", "overdue")
#: A reason is logged as a warning at most this often per server (else at debug level).
WARN_EVERY = 60.0


@dataclass(frozen=True)
class Limits:
    """A server's bounds: ``max_connections`` served at once, ``max_request_bytes`` per
    request (all of it: for HTTP its line, headers and body), ``read_within`` seconds from
    the connection accepted to the whole request read, ``answer_within`` seconds from then
    to the whole exchange done (the work and writing the answer)."""

    max_connections: int
    max_request_bytes: int
    read_within: float
    answer_within: float


class Refusals:
    """Connections refused or cut, by server and reason; thread-safe. A server registers
    its name (its counts start at zero); :meth:`count` logs a reason's first occurrence in
    :data:`WARN_EVERY` seconds as a warning."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: dict[tuple[str, str], int] = {}
        self._warned: dict[tuple[str, str], float] = {}

    def register(self, server: str) -> None:
        with self._lock:
            for reason in REASONS:
                self._counts.setdefault((server, reason), 0)

    def count(self, server: str, reason: str, detail: str = "") -> None:
        key = (server, reason)
        now = time.monotonic()
        with self._lock:
            self._counts[key] = self._counts.get(key, 0) + 1
            last = self._warned.get(key)
            warn = last is None or now - last >= WARN_EVERY
            if warn:
                self._warned[key] = now
        log.log(
            logging.WARNING if warn else logging.DEBUG,
            "%s: refused a connection (%s)%s",
            server,
            reason,
            f": {detail}" if detail else "",
        )

    def snapshot(self) -> dict[tuple[str, str], int]:
        """(server, reason) -> how many so far."""
        with self._lock:
            return dict(self._counts)


class Gate:
    """At most ``limit`` connections inside at once: :meth:`enter` says at once whether
    one more may come in (it never waits), :meth:`leave` when it is done."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError("a gate lets at least one connection in")
        self.limit = limit
        self._lock = threading.Lock()
        self._inside = 0

    def enter(self) -> bool:
        with self._lock:
            if self._inside >= self.limit:
                return False
            self._inside += 1
            return True

    def leave(self) -> None:
        with self._lock:
            if self._inside <= 0:
                raise RuntimeError("left a gate nobody entered")
            self._inside -= 1

    @property
    def inside(self) -> int:
        with self._lock:
            return self._inside


def time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (monotonic); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left


class RequestTooLarge(http.client.HTTPException):
    """More bytes than the request may have (an HTTPException: the standard library's
    header parser answers 431 for it)."""


class BoundedStream(io.RawIOBase):
    """One connection as a raw stream for an HTTP handler: reads stop at ``limit`` bytes
    in all (RequestTooLarge) and at ``read_by`` (TimeoutError); writes end by
    ``answer_by`` (TimeoutError). :attr:`refused` is the reason the first of those gave
    (:data:`REASONS`), None while none did."""

    def __init__(self, sock: socket.socket, limit: int, read_by: float, answer_by: float) -> None:
        super().__init__()
        self.sock = sock
        self.limit = limit
        self.read_by = read_by
        self.answer_by = answer_by
        self.received = 0
        self.refused: str | None = None

    def _refuse(self, reason: str) -> None:
        if self.refused is None:
            self.refused = reason

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, buffer: WriteableBuffer, /) -> int:
        room = self.limit - self.received
        if room <= 0:
            self._refuse("too_large")
            raise RequestTooLarge(f"the request is over {self.limit} bytes")
        try:
            self.sock.settimeout(time_left(self.read_by))
            n = self.sock.recv_into(buffer, min(memoryview(buffer).nbytes, room))
        except TimeoutError:
            self._refuse("timeout")
            raise
        self.received += n
        return n

    def write(self, data: ReadableBuffer, /) -> int:
        try:
            self.sock.settimeout(time_left(self.answer_by))
            self.sock.sendall(data)
        except TimeoutError:
            self._refuse("overdue")
            raise
        return memoryview(data).nbytes


def send_now(sock: socket.socket, data: bytes) -> None:
    """Send ``data`` (a short refusal) without waiting; nothing if it does not go at once."""
    try:
        sock.setblocking(False)
        sock.send(data)
    except OSError:
        pass


def linger(sock: socket.socket, seconds: float = 1.0, max_bytes: int = 1 << 20) -> None:
    """After a refusal sent on a TCP connection whose request was not read whole: say we are
    done (FIN after the refusal) and read what the client still sends, for at most
    ``seconds`` and ``max_bytes``, so that closing with unread data does not reset the
    connection before the client has read why."""
    deadline = time.monotonic() + seconds
    try:
        sock.shutdown(socket.SHUT_WR)
        drained = 0
        while drained < max_bytes:
            sock.settimeout(time_left(deadline))
            chunk = sock.recv(65536)
            if not chunk:
                return
            drained += len(chunk)
    except OSError:  # TimeoutError included: the linger is over
        pass
