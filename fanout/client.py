"""tabby-node's side of tabby-typha: a ``sync`` source with the store's contract
(``datastore.base``: one snapshot, then only puts and deletes for the life of the iterator),
read from typha's stream instead of the datastore's watch.

A broken stream never ends the iterator and never starts the consumer over: the client
connects again (jittered back-off from 0.2 s to 5 s, the next endpoint each time) with the
position it applied; typha sends what it missed, or a snapshot from which the client yields
only the difference from what it reported (``datastore.engine.Reported``). While typha is
away the consumer keeps what it has (tabby-node's dataplane stays as it is).
"""

from __future__ import annotations

import json
import logging
import queue
import random
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import grpc

from datastore.base import Doc, SyncEvent, sync_kinds
from datastore.engine import Reported
from datastore.protobuf import ProtoError
from fanout import METHOD, wire

if TYPE_CHECKING:
    from bundle.types import JSON

log = logging.getLogger("tabby.node")

BACKOFF = (0.2, 5.0)  #: first and longest wait between connection attempts (s)
ACK_EVERY = 1.0  #: seconds between the acknowledgements of the position applied

CHANNEL_OPTIONS: list[tuple[str, int | str]] = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.max_receive_message_length", 256 << 20),
    # one endpoint per channel: the client chooses (and rotates) them itself
    ("grpc.enable_retries", 0),
]


@dataclass(frozen=True)
class ClientTls:
    """The CA typha's certificate is checked against, this node's certificate and key (PEM
    bytes), and the name typha's certificate must carry (None: the endpoint's host)."""

    ca: bytes
    cert: bytes
    key: bytes
    server_name: str | None = None


def parse_endpoints(text: str) -> list[str]:
    """``host:port,...`` (a bare host: port 5473); ValueError naming a bad one."""
    from fanout import DEFAULT_PORT

    out = []
    for word in (w.strip() for w in text.split(",")):
        if not word:
            continue
        host, sep, port = word.rpartition(":")
        if not sep or host.endswith(":") or (host.count(":") and not host.startswith("[")):
            host, port = word, str(DEFAULT_PORT)
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"not host:port: {word!r}")
        out.append(f"{host}:{port}")
    return out


class TyphaSync:
    """``sync(kinds, stop)`` from tabby-typha (see the module docstring)."""

    def __init__(
        self,
        endpoints: Sequence[str] | Callable[[], Sequence[str]],
        node: str,
        tls: ClientTls | None,
        *,
        backoff: tuple[float, float] = BACKOFF,
        problems: dict[str, str] | None = None,
    ) -> None:
        if not callable(endpoints) and not endpoints:
            raise ValueError("no typha endpoint")
        #: where typha is: a list, or how to find it (a Service's endpoints), asked again
        #: before every connection
        self.endpoints = endpoints
        self.node = node
        self.tls = tls
        self.backoff = backoff
        self.stats = {"snapshots": 0, "rereads": 0, "resumes": 0, "connects": 0}
        #: the position applied: (typha's epoch, seq); ("", 0) before the first snapshot
        self.epoch = ""
        self.seq = 0
        #: kind -> key -> ``wire.content`` of the update applied (what ``digests`` say)
        self.contents: dict[str, dict[str, int]] = {}
        self.connected = threading.Event()
        #: the daemon's problems (its readiness): ``"typha"`` while typha cannot be read
        self.problems = problems if problems is not None else {}

    @property
    def last_error(self) -> str | None:
        return self.problems.get("typha")

    @last_error.setter
    def last_error(self, why: str | None) -> None:
        if why is None:
            self.problems.pop("typha", None)
        else:
            self.problems["typha"] = why

    @property
    def sync_stats(self) -> dict[str, int]:
        return {k: self.stats[k] for k in ("snapshots", "rereads", "resumes")}

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        watched = sync_kinds(kinds)
        reported = Reported()
        first = True
        delay = self.backoff[0]
        turn = random.randrange(1 << 16)  # noqa: S311 (spreading, not secrecy)
        while not stop.is_set():
            endpoints = self.endpoints() if callable(self.endpoints) else self.endpoints
            if not endpoints:
                self.last_error = "no typha endpoint known"
                log.warning("%s (again in about %.1f s)", self.last_error, delay)
                stop.wait(_jitter(delay))
                delay = min(delay * 2, self.backoff[1])
                continue
            endpoint = endpoints[turn % len(endpoints)]
            turn += 1
            try:
                for event in self._session(endpoint, watched, reported, first, stop):
                    first = False
                    delay = self.backoff[0]
                    yield event
            except (grpc.RpcError, ProtoError, ValueError) as e:
                if stop.is_set():
                    return
                self.last_error = f"typha {endpoint}: {_why(e)}"
                log.warning("%s (again in about %.1f s)", self.last_error, delay)
            self.connected.clear()
            stop.wait(_jitter(delay))
            delay = min(delay * 2, self.backoff[1])

    def _session(
        self,
        endpoint: str,
        kinds: tuple[str, ...],
        reported: Reported,
        first: bool,
        stop: threading.Event,
    ) -> Iterator[SyncEvent]:
        requests: queue.Queue[wire.ClientMessage | None] = queue.Queue()
        # what it holds, for a typha that cannot resume its position (another replica)
        held = wire.digests(kinds, self.contents) if not first else b""
        requests.put(wire.ClientMessage(self.node, self.epoch, self.seq, 0, kinds, held))
        channel = self._channel(endpoint)
        done = threading.Event()
        stream = _Stream(kinds, reported, first, self.contents)
        try:
            call = channel.stream_stream(
                METHOD,
                request_serializer=wire.encode_client,
                response_deserializer=wire.decode_server,
            )(_drain(requests))
            threading.Thread(
                target=_cancel_on, args=(call, stop, done), name="typha cancel", daemon=True
            ).start()
            resuming = bool(self.epoch)
            acked = time.monotonic()
            for message in call:
                if not self.connected.is_set():
                    self.connected.set()
                    self.last_error = None
                if resuming:
                    resuming = False
                    self.stats["connects"] += 1
                    if message.type != wire.SNAPSHOT_BEGIN:
                        self.stats["resumes"] += 1
                yield from stream.read(message, self.stats)
                if stream.collecting is None and message.epoch:
                    self.epoch, self.seq = message.epoch, message.seq
                now = time.monotonic()
                if now - acked >= ACK_EVERY:
                    acked = now
                    requests.put(wire.ClientMessage(ack=self.seq))
        finally:
            done.set()
            requests.put(None)
            channel.close()

    def _channel(self, endpoint: str) -> grpc.Channel:
        if self.tls is None:
            return grpc.insecure_channel(endpoint, options=CHANNEL_OPTIONS)
        tls = self.tls
        credentials = grpc.ssl_channel_credentials(tls.ca, tls.key, tls.cert)
        options = list(CHANNEL_OPTIONS)
        if tls.server_name:
            options.append(("grpc.ssl_target_name_override", tls.server_name))
        return grpc.secure_channel(endpoint, credentials, options=options)


class _Stream:
    """One connection's messages into sync events: a snapshot collected whole, then the
    first one given as it is and any later one as its difference from what was reported."""

    def __init__(
        self,
        kinds: tuple[str, ...],
        reported: Reported,
        first: bool,
        contents: dict[str, dict[str, int]],
    ) -> None:
        self.kinds = kinds
        self.reported = reported
        self.first = first
        self.contents = contents
        self.collecting: dict[str, dict[str, Doc]] | None = None
        self.incoming: dict[str, dict[str, int]] = {}
        self.buckets: tuple[int, ...] = ()  #: the snapshot's (empty: all)

    def read(self, message: wire.ServerMessage, stats: dict[str, int]) -> Iterator[SyncEvent]:
        if message.type == wire.SNAPSHOT_BEGIN:
            self.collecting = {kind: {} for kind in self.kinds}
            self.incoming = {kind: {} for kind in self.kinds}
            self.buckets = message.buckets
            if self.buckets and self.first:
                raise ProtoError("a partial snapshot before a whole one")
        elif message.type == wire.SNAPSHOT_CHUNK:
            if self.collecting is None:
                raise ProtoError("a snapshot chunk outside a snapshot")
            for u in message.updates:
                if u.kind in self.collecting and not u.deleted:
                    self.collecting[u.kind][u.key] = Doc(_json(u.data), u.revision)
                    self.incoming[u.kind][u.key] = wire.content(u.data)
        elif message.type == wire.SNAPSHOT_END:
            yield from self._end(stats)
        elif message.type == wire.UPDATES:
            if self.first or self.collecting is not None:
                raise ProtoError("updates outside their place (before a snapshot, inside one)")
            for u in message.updates:
                if u.kind not in self.kinds:
                    continue
                doc = None if u.deleted else Doc(_json(u.data), u.revision)
                held = self.contents.setdefault(u.kind, {})
                if doc is None:
                    held.pop(u.key, None)
                else:
                    held[u.key] = wire.content(u.data)
                event = self.reported.change(u.kind, u.key, doc)
                if event is not None:
                    yield event

    def _end(self, stats: dict[str, int]) -> Iterator[SyncEvent]:
        collected, self.collecting = self.collecting, None
        if collected is None:
            raise ProtoError("a snapshot's end outside a snapshot")
        if self.first:
            stats["snapshots"] += 1
            self.first = False
            self.contents.clear()
            self.contents.update(self.incoming)
            yield self.reported.snapshot(collected)
            return
        stats["rereads"] += 1
        for i, kind in enumerate(self.kinds):
            docs = self._kept(i, kind, collected[kind])
            if docs is not None:
                yield from self.reported.changes(kind, docs)

    def _kept(self, i: int, kind: str, sent: dict[str, Doc]) -> dict[str, Doc] | None:
        """A kind's documents after a snapshot: ``sent`` and, of a partial one, what is held
        in the buckets it did not cover (as their revisions: unchanged, never yielded);
        None: the kind is not covered at all."""
        if not self.buckets:
            self.contents[kind] = self.incoming[kind]
            return sent
        base = i * wire.BUCKETS
        covered = {b - base for b in self.buckets if base <= b < base + wire.BUCKETS}
        if not covered:
            return None
        held = self.contents.setdefault(kind, {})
        for key in [k for k in held if wire.bucket(k) in covered]:
            del held[key]
        held.update(self.incoming[kind])
        docs = dict(sent)
        for key, revision in self.reported.docs[kind].items():
            if wire.bucket(key) not in covered:
                docs[key] = Doc({}, revision)
        return docs


def _drain(requests: queue.Queue[wire.ClientMessage | None]) -> Iterator[wire.ClientMessage]:
    while (message := requests.get()) is not None:
        yield message


def _cancel_on(call: grpc.Future[object], stop: threading.Event, done: threading.Event) -> None:
    while not done.is_set():
        if stop.wait(0.5):
            call.cancel()
            return


def _jitter(delay: float) -> float:
    return delay * random.uniform(0.5, 1.5)  # noqa: S311 (spreading, not secrecy)


def _json(data: bytes) -> JSON:
    try:
        value = json.loads(data)
    except ValueError:
        raise ProtoError("a document that is not JSON") from None
    if not isinstance(value, dict):
        raise ProtoError("a document that is not a JSON object")
    return value


def _why(e: BaseException) -> str:
    if isinstance(e, grpc.RpcError) and hasattr(e, "code"):
        details = e.details() if hasattr(e, "details") else ""
        return f"{e.code().name}: {details}"
    return str(e)
