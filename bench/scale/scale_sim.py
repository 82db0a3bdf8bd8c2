#!/usr/bin/env python3
"""Simulated tabby-nodes for bench/scale/scale_bench.py: many nodes in one process.

Started by scale_bench.py inside the control node's network namespace (where etcd listens),
driven by JSON lines on stdin, answering with JSON lines on stdout. Not meant to be run by
hand.

What a simulated node is: tabby-node's own parts with its own ``EtcdStore``, running
tabby-node's own loops (``Watcher.run``: ``store.sync(WATCHED_KINDS)``; ``Liveness.run``:
the lease kept alive every ttl/3, written again only when it expired), so the ranges it
reads and watches, the revisions it watches from, what it does after a broken or compacted
watch and how it keeps its liveness are tabby's, and follow tabby's code as it changes.
Only the transport under tabby's etcd client is the bench's (``SimClient``):

- a watch stream, once tabby's client has opened it (JSON gateway: the HTTP request sent
  and the answer's head read by tabby's code), is handed to one asyncio loop that reads
  every byte etcd sends and takes from each message only its revision and each event's key
  and mod_revision (``scale_wire``), counting events by kind and recording when each
  revision reached the last watcher. tabby's code gets the stream back when it ends
  (broken, cancelled, compacted), with the last message read, and decides what to do
  next as it always does. With ``--engine grpc|proxy`` the stream is a native gRPC Watch
  (to etcd, or to ``etcd grpc-proxy``) created from the very request tabby's client built;
- a snapshot read (a multi-key range) is read in full from etcd but handed to tabby's
  paging code cut to its last key (``scale_wire.reduce_range_answer``);
- while the nodes boot, the first snapshot of a range is read from etcd once per two
  seconds and shared (1000 nodes starting at one moment are a storm of their own, which
  the recovery phases measure); every later snapshot is each node's own read.

The node's dataplane is not simulated: its cache (``SimCache``) only counts snapshots.
The heartbeat/watch threads sleep in tabby's own waits (no CPU at rest); all stream data
is read by the one asyncio thread.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import concurrent.futures
import json
import logging
import os
import resource
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.scale import scale_wire as wire
from datastore.base import SyncEvent
from datastore.etcd import client as etcd_client
from datastore.etcd.client import (
    EtcdClient,
    EtcdUnavailable,
    _Conn,
    _Rotation,
    _Transient,
    _watch_response,
)
from datastore.etcd.store import LAYOUT
from resources.index import NODES
from tabby_node.cache import Cache

MEMO_MAX = 8192
BOOT_CACHE_SECONDS = 2.0


def now() -> float:
    return time.monotonic()


# == the asyncio side ===========================================================================


class Stream:
    """One watch stream of one simulated node (one create request)."""

    def __init__(self, node: SimNode, create: dict[str, Any]) -> None:
        self.node = node
        self.create = create
        self.start = base64.b64decode(create.get("key", ""))
        self.end = base64.b64decode(create.get("range_end", ""))
        self.start_revision = int(create.get("start_revision", 0) or 0)
        self.pos = max(self.start_revision - 1, 0)
        self.history: collections.deque[tuple[int, float]] = collections.deque(maxlen=32)
        self.created_at: float | None = None
        self.opened_at = now()
        self.last: bytes | None = None  # the last message with events, as a JSON line
        self.last_raw: bytes | None = None  # (gRPC: the message, converted when needed)
        self.cancel_line: bytes | None = None
        self.ended = threading.Event()
        self.wake: threading.Event | None = None  # set when created or ended (the reader waits)
        self.index = 0  # the position of its range in tabby's watch_ranges call
        self.url = ""  # the gateway endpoint (gRPC: the target)
        self.reason = ""
        self.detail = ""
        self.closer: Any = None  # asyncio transport or gRPC call

    def covers(self, key: bytes) -> bool:
        return wire.covers([(self.start, self.end)], key)

    def last_line(self) -> bytes | None:
        if self.last is None and self.last_raw is not None:
            self.last = wire.watch_response_json(self.last_raw)
        return self.last


class Hub:
    """Every simulated node's streams, read on one asyncio loop, and what was counted."""

    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.engine: str = cfg["engine"]
        self.loop = asyncio.new_event_loop()
        self.kind_of = wire.KindOf(cfg["prefix"], LAYOUT)
        self.lock = threading.Lock()  # for what the control threads change
        self.nodes: list[SimNode] = []
        self.streams: set[Stream] = set()
        self.memo: dict[bytes, tuple[int, bool, bool, tuple[tuple[str, int], ...]]] = {}
        # cumulative counters (the parent takes differences)
        self.events: collections.Counter[str] = collections.Counter()
        self.messages = 0
        self.bytes = 0
        self.streams_opened = 0
        self.streams_ended: collections.Counter[str] = collections.Counter()
        self.snapshots: list[tuple[str, float]] = []  # (node, time) of every snapshot read
        self.range_reads = 0
        self.range_bytes = 0
        self.range_keys = 0
        self.arrivals: dict[int, list[float]] = {}  # revision -> [count, first, last]
        self.booting = True
        self.boot_cache: dict[bytes, tuple[float, tuple[int, dict[str, str], bytes]]] = {}
        self.boot_flights: dict[bytes, threading.Event] = {}  # boot reads under way
        self.expect: tuple[bytes, int] | None = None
        self.channels: dict[str, Any] = {}
        self.stopping = False

    # -- bookkeeping for control threads ---------------------------------------------------

    def note_snapshot(self, node: str) -> None:
        with self.lock:
            self.snapshots.append((node, now()))

    def note_range(self, size: int, keys: int) -> None:
        with self.lock:
            self.range_reads += 1
            self.range_bytes += size
            self.range_keys += keys

    # -- reading ---------------------------------------------------------------------------

    def _classified(
        self, msg: wire.WatchMessage
    ) -> tuple[int, bool, bool, tuple[tuple[str, int], ...]]:
        kind_of = self.kind_of
        return (
            msg.revision,
            msg.created,
            msg.canceled,
            tuple((kind_of(k), r) for k, r in msg.events),
        )

    def on_message(self, stream: Stream, raw: bytes, gateway: bool) -> None:
        """One WatchResponse of ``stream`` (a gateway JSON line, or a gRPC message)."""
        info = self.memo.get(raw)
        if info is None:
            msg = wire.scan_gateway_line(raw) if gateway else wire.decode_watch_response(raw)
            info = self._classified(msg)
            if msg.canceled:
                stream.cancel_line = raw if gateway else wire.watch_response_json(raw)
            elif len(self.memo) < MEMO_MAX:
                self.memo[raw] = info
            else:
                self.memo.clear()
        _rev, _created, canceled, events = info
        self.messages += 1
        t = now()
        if stream.created_at is None:
            stream.created_at = t
            if stream.wake is not None:
                stream.wake.set()
            if not events and not canceled:
                self._check_sync(stream.node)
                return
        if canceled:
            if stream.cancel_line is None:
                stream.cancel_line = raw if gateway else wire.watch_response_json(raw)
            self.end(stream, "canceled", "")
            return
        if not events:  # a progress notification: what tabby resumes from, if it is the last
            if _rev > stream.pos:
                stream.pos = _rev
                stream.history.append((_rev, t))
                self._keep_last(stream, raw, gateway)
                if self.expect is not None:
                    self._check_sync(stream.node)
            return
        counts = self.events
        arrivals = self.arrivals
        top = stream.pos
        for kind, rev in events:
            counts[kind] += 1
            a = arrivals.get(rev)
            if a is None:
                arrivals[rev] = [1, t, t]
            else:
                a[0] += 1
                a[2] = t
            if rev > top:
                top = rev
        if top > stream.pos:
            stream.pos = top
            stream.history.append((top, t))
        self._keep_last(stream, raw, gateway)
        if self.expect is not None:
            self._check_sync(stream.node)

    @staticmethod
    def _keep_last(stream: Stream, raw: bytes, gateway: bool) -> None:
        """The last message that moved the stream's revision (events or a progress
        notification): handed to tabby's code when the stream ends, so that tabby resumes
        from where it would have."""
        if gateway:
            stream.last = raw
        else:
            stream.last_raw, stream.last = raw, None

    def end(self, stream: Stream, reason: str, detail: str) -> None:
        if stream.ended.is_set():
            return
        stream.reason, stream.detail = reason, detail
        self.streams_ended[reason] += 1
        self.streams.discard(stream)
        stream.node.streams.discard(stream)
        closer, stream.closer = stream.closer, None
        if closer is not None:
            try:
                if isinstance(closer, asyncio.BaseTransport):
                    closer.close()
                else:
                    closer.cancel()
            except Exception as e:  # closing what may already be closed
                logging.debug("closing a stream: %s", e)
        stream.ended.set()
        if stream.wake is not None:
            stream.wake.set()

    def adopt(self, stream: Stream) -> None:
        self.streams.add(stream)
        stream.node.streams.add(stream)
        stream.node.max_streams = max(stream.node.max_streams, len(stream.node.streams))
        self.streams_opened += 1

    # -- the JSON gateway: a socket tabby's client opened -----------------------------------

    async def adopt_gateway(self, stream: Stream, sock: Any, buffered: bytes) -> None:
        self.adopt(stream)
        sock.setblocking(False)
        proto = GatewayStream(self, stream, buffered)
        await self.loop.create_connection(lambda: proto, sock=sock)

    # -- gRPC: a Watch stream made from tabby's request --------------------------------------

    def channel(self, node: str) -> Any:
        import grpc

        ch = self.channels.get(node)
        if ch is None:
            # one connection per node, as each tabby-node would have its own; reconnecting
            # as fast as tabby's own client retries (gRPC's default backoff is 1 s to 2 min)
            ch = grpc.aio.insecure_channel(
                self.cfg["grpc_target"],
                options=[
                    ("grpc.use_local_subchannel_pool", 1),
                    ("grpc.initial_reconnect_backoff_ms", 100),
                    ("grpc.min_reconnect_backoff_ms", 100),
                    ("grpc.max_reconnect_backoff_ms", 1000),
                ],
            )
            self.channels[node] = ch
        return ch

    async def open_grpc(self, stream: Stream, request: bytes, timeout: float) -> None:
        import grpc

        call = self.channel(stream.node.name).stream_stream(
            "/etcdserverpb.Watch/Watch", request_serializer=None, response_deserializer=None
        )(metadata=GRPC_METADATA)
        try:
            await asyncio.wait_for(call.write(request), timeout)
            first = await asyncio.wait_for(call.read(), timeout)
        except (TimeoutError, grpc.aio.AioRpcError) as e:
            call.cancel()
            target = self.cfg["grpc_target"]
            raise _Transient(f"{target}: watch: {_grpc_reason(e)}", sent=True) from None
        if first is grpc.aio.EOF:
            raise _Transient(f"{self.cfg['grpc_target']}: watch: stream ended", sent=True)
        self.adopt(stream)
        stream.closer = call
        self.bytes += len(first)
        self.on_message(stream, first, gateway=False)
        if not stream.ended.is_set():
            self.loop.create_task(self._read_grpc(stream, call))

    async def _read_grpc(self, stream: Stream, call: Any) -> None:
        import grpc

        try:
            while not stream.ended.is_set():
                msg = await call.read()
                if msg is grpc.aio.EOF:
                    self.end(stream, "broken", "stream ended")
                    return
                self.bytes += len(msg)
                self.on_message(stream, msg, gateway=False)
        except asyncio.CancelledError:
            self.end(stream, "stopped" if self.stopping else "broken", "cancelled")
        except grpc.aio.AioRpcError as e:
            self.end(stream, "broken", _grpc_reason(e))

    # -- recovery: when is a node back in sync ----------------------------------------------

    def set_expect(self, key: bytes, rev: int) -> None:
        self.expect = (key, rev)
        for node in self.nodes:
            node.synced_at = None
            self._check_sync(node)

    def _check_sync(self, node: SimNode) -> None:
        """In sync with the marker write (key, rev): every stream the node had after it
        booted is open again and created, and a stream over the key has seen the marker
        (or started after it)."""
        if self.expect is None or node.synced_at is not None:
            return
        streams = list(node.streams)
        if len(streams) < node.booted_streams or any(s.created_at is None for s in streams):
            return
        key, rev = self.expect
        t = max(s.created_at or 0.0 for s in streams) if streams else now()
        for s in streams:
            if not s.covers(key):
                continue
            if s.start_revision > rev:
                continue
            seen = [when for r, when in s.history if r >= rev]
            if not seen:
                return
            t = max(t, seen[0])
        node.synced_at = t

    # -- shutdown --------------------------------------------------------------------------

    async def close_all(self) -> None:
        self.stopping = True
        for stream in list(self.streams):
            self.end(stream, "stopped", "")
        for ch in self.channels.values():
            await ch.close()


GRPC_METADATA: tuple[tuple[str, str], ...] = tuple(
    (name.split("Grpc-Metadata-", 1)[1].lower(), value.strip())
    for name, _, value in [etcd_client.HASLEADER.strip().partition(":")]
)


def _grpc_reason(e: BaseException) -> str:
    code = getattr(e, "code", None)
    details = getattr(e, "details", None)
    if callable(code) and callable(details):
        return f"{code().name}: {details()}"
    return type(e).__name__


class GatewayStream(asyncio.Protocol):
    """The rest of a gateway watch answer: chunked newline-delimited JSON."""

    def __init__(self, hub: Hub, stream: Stream, buffered: bytes) -> None:
        self.hub = hub
        self.stream = stream
        self.chunks = wire.ChunkedLines()
        self.buffered = buffered  # what tabby's client had read past the answer's head

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.stream.closer = transport
        if self.buffered:
            self.data_received(self.buffered)
            self.buffered = b""

    def data_received(self, data: bytes) -> None:
        hub = self.hub
        hub.bytes += len(data)
        stream = self.stream
        try:
            lines = self.chunks.feed(data)
        except wire.WireError as e:
            hub.end(stream, "broken", str(e))
            return
        for line in lines:
            hub.on_message(stream, line, gateway=True)
            if stream.ended.is_set():
                return
        if self.chunks.ended:
            hub.end(stream, "broken", "watch stream ended")

    def connection_lost(self, exc: Exception | None) -> None:
        reason = "stopped" if self.hub.stopping else "broken"
        self.hub.end(self.stream, reason, str(exc) if exc else "connection closed by etcd")


# == tabby's client, over the hub ================================================================


class _GrpcConn:
    """What ``SimClient._open_watch`` hands tabby's ``watch_ranges`` for a gRPC stream."""

    def __init__(self, stream: Stream, url: str) -> None:
        self.stream = stream
        self.url = url
        self.sock = None  # tabby's reader never sees it: _sim_read_watches takes the stream

    def close(self) -> None:
        """tabby's client drops the connection when the watch ends: the hub has."""


class SimConn(_Conn):
    """tabby's HTTP connection; a multi-key range answer is read in full and handed to
    tabby's paging code reduced to its last key. While the nodes boot, one read of a given
    request is made at a time and its answer shared for ``BOOT_CACHE_SECONDS`` (the
    nodes asking meanwhile wait for it): a thousand nodes booting in seconds, each reading
    tens of MB, is a storm the bench must not make by accident (etcd 3.4 holding hundreds
    of such answers at once was OOM-killed at ~19 GB here)."""

    hub: Hub

    def request(self, path: str, body: bytes, deadline: float) -> tuple[int, dict[str, str], bytes]:
        if path != "/v3/kv/range" or b'"range_end"' not in body:
            return super().request(path, body, deadline)
        hub = self.hub
        if not hub.booting:
            return self._read(path, body, deadline)
        while True:
            with hub.lock:
                hit = hub.boot_cache.get(body)
                if hit is not None and now() - hit[0] < BOOT_CACHE_SECONDS:
                    return hit[1]
                flight = hub.boot_flights.get(body)
                mine = flight is None
                if mine:
                    flight = hub.boot_flights[body] = threading.Event()
            assert flight is not None
            if not mine:
                flight.wait(max(0.0, deadline - now()))
                if now() >= deadline:
                    raise _Transient(f"{self.ep.url}: shared boot read not done", sent=False)
                continue
            try:
                answer = self._read(path, body, deadline)
                if answer[0] == 200:
                    with hub.lock:
                        hub.boot_cache[body] = (now(), answer)
                return answer
            finally:
                with hub.lock:
                    hub.boot_flights.pop(body, None)
                flight.set()

    def _read(self, path: str, body: bytes, deadline: float) -> tuple[int, dict[str, str], bytes]:
        status, headers, data = super().request(path, body, deadline)
        if status != 200:
            return status, headers, data
        reduced, keys = wire.reduce_range_answer(data)
        self.hub.note_range(len(data), keys)
        return status, headers, reduced


class SimClient(EtcdClient):
    """tabby's etcd client with the watch streams read by the hub (see the module doc)."""

    hub: Hub
    node: SimNode

    def _connect(self, index: int, deadline: float, cap: float | None = None) -> _Conn:
        ep = self.endpoints[index]
        conn = SimConn(ep, None, deadline, cap)
        conn.hub = self.hub
        with self._conns_lock:
            self._conns.add(conn)
        return conn

    def _open_watch(self, payload: bytes, deadline: float, stop: threading.Event) -> Any:
        """One stream of tabby's ``watch_ranges`` (which builds the create requests,
        one stream per range): the gateway's opened by tabby's own code, a gRPC one by the
        hub from the very same request."""
        hub = self.hub
        create = json.loads(payload)["create_request"]
        node = self.node
        if hub.engine == "gateway":
            conn = super()._open_watch(payload, deadline, stop)
            conn.sim_create = create  # type: ignore[attr-defined]
            conn.sim_node = node  # type: ignore[attr-defined]
            return conn
        request = wire.encode_create(create)
        target = hub.cfg["grpc_target"]
        tries = _Rotation([target], 0, deadline, stop)
        while True:
            attempt_deadline = tries.attempt("watch not started")
            stream = Stream(node, create)
            future = asyncio.run_coroutine_threadsafe(
                hub.open_grpc(stream, request, max(0.05, attempt_deadline - now())), hub.loop
            )
            try:
                future.result()
                return _GrpcConn(stream, target)
            except _Transient as e:
                tries.failed(str(e))


def _hub_stream(ws: Any) -> Stream | None:
    """The hub's stream behind one of tabby's ``_WatchStream`` (None: not a simulated
    node's), handing a gateway socket over to the hub."""
    conn = ws.conn
    if isinstance(conn, _GrpcConn):
        conn.stream.index = ws.index
        return conn.stream
    node = getattr(conn, "sim_node", None)
    if node is None:
        return None
    hub: Hub = node.hub
    stream = Stream(node, conn.sim_create)
    stream.index = ws.index
    stream.url = conn.ep.url
    sock, conn.sock = conn.sock, None  # the hub owns it now (tabby's close is a no-op)
    buffered = bytes(conn.buf)
    conn.buf.clear()
    asyncio.run_coroutine_threadsafe(hub.adopt_gateway(stream, sock, buffered), hub.loop).result()
    return stream


_TABBY_READ_WATCHES = etcd_client._read_watches


def _sim_read_watches(
    streams: list[Any], stop: threading.Event
) -> Iterator[etcd_client.WatchResponse]:
    """tabby's ``_read_watches`` for a simulated node's streams (any other client's go to
    tabby's own): the hub reads the bytes; tabby's code gets each stream's "created", and,
    when a stream ends, the last message that moved its revision and how it ended
    (cancelled: the cancel answer; broken: ``EtcdUnavailable``), as its own reader would
    have given them."""
    hubbed = [_hub_stream(ws) for ws in streams]
    if any(s is None for s in hubbed):
        if not all(s is None for s in hubbed):
            raise RuntimeError("a watch mixing simulated and real streams")
        yield from _TABBY_READ_WATCHES(streams, stop)
        return
    mine: list[Stream] = [s for s in hubbed if s is not None]
    hub = mine[0].node.hub
    wake = threading.Event()
    for s in mine:
        s.wake = wake
    reported: set[int] = set()
    try:
        while not stop.is_set():
            wake.clear()
            for s in mine:
                if s.created_at is not None and s.index not in reported:
                    reported.add(s.index)
                    resp = etcd_client.WatchResponse({"created": True})
                    resp.index = s.index
                    yield resp
            done = next((s for s in mine if s.ended.is_set()), None)
            if done is None:
                wake.wait(0.25)
                continue
            if done.reason == "stopped":
                return
            url = getattr(done, "url", None) or str(hub.cfg.get("grpc_target", ""))
            last = done.last_line()
            if last is not None:
                resp_last = _watch_response(url, last)
                if resp_last is not None:
                    resp_last.index = done.index
                    yield resp_last
            if done.reason == "canceled" and done.cancel_line is not None:
                resp_cancel = _watch_response(url, done.cancel_line)  # raises on an error
                if resp_cancel is not None:
                    resp_cancel.index = done.index
                    yield resp_cancel
                    if resp_cancel.canceled:
                        mine.remove(done)
                        if not mine:
                            return
                        continue
            raise EtcdUnavailable([url], f"watch broken: {done.detail or done.reason}")
    finally:
        for s in mine:
            if not s.ended.is_set():
                hub.loop.call_soon_threadsafe(hub.end, s, "closed", "tabby closed the watch")


etcd_client._read_watches = _sim_read_watches  # type: ignore[assignment]


# == simulated nodes ===============================================================================


class SimCache(Cache):
    """The node's cache without a dataplane behind it: it counts snapshots; its own Node is
    always there (so tabby's heartbeat loop does not look it up in the datastore)."""

    def __init__(self, hub: Hub, node: str) -> None:
        super().__init__()
        self.hub = hub
        self.node = node

    def apply(self, event: SyncEvent) -> None:
        if event.type == "snapshot":
            self.resyncs += 1
            self.hub.note_snapshot(self.node)
        self.synced.set()

    def get(self, kind: Any, key: str) -> Any:
        if kind is NODES and key == self.node:
            return True
        return None


class SimNode:
    def __init__(self, hub: Hub, name: str, argv: list[str]) -> None:
        from stores import open_store
        from tabby_node import options as node_options
        from tabby_node.facts import Facts
        from tabby_node.lifecycle import Retry, Threads
        from tabby_node.registration import Liveness
        from tabby_node.tunnels import Tunnels
        from tabby_node.watcher import Watcher

        self.hub = hub
        self.name = name
        self.streams: set[Stream] = set()
        self.max_streams = 0
        self.booted_streams = 0
        self.synced_at: float | None = None
        options, datastore = node_options.parse(argv)
        facts = Facts(name, None, None, 1500, False, "")
        cache = SimCache(hub, name)
        store = open_store(datastore)
        inner: EtcdClient = store.client  # type: ignore[attr-defined]
        client = SimClient(inner.urls, timeout=inner.timeout)
        client.hub = hub
        client.node = self
        inner.close()
        store.client = client  # type: ignore[attr-defined]
        # the hub stands in for the transport under tabby's gateway watch (its engine says
        # what etcd serves: the gateway, native gRPC, or the proxy)
        store.watch_transport = "gateway"  # type: ignore[attr-defined]
        count_sync = store.count_sync

        def counted(what: str) -> None:
            # tabby's store counts its full reads: a re-read after a compaction yields
            # only the differences (no snapshot event reaches the cache), so note it here
            if what == "rereads":
                hub.note_snapshot(name)
            count_sync(what)

        store.count_sync = counted  # type: ignore[method-assign]
        self.store = store
        self.stopping = threading.Event()
        problems: dict[str, str] = {}
        beats: dict[str, float] = {}
        self.threads = Threads(problems)
        self.retry = Retry(self.stopping, problems)
        self.liveness = Liveness(
            facts,
            options.backend,
            store,
            node_ttl=options.node_ttl,
            cache=cache,
            ensure_tunnels=Tunnels(facts, options.backend, store, cache).ensure,
            stopping=self.stopping,
            beats=beats,
            problems=problems,
        )
        self.watcher = Watcher(store, cache, stopping=self.stopping, beats=beats)

    def beat(self) -> None:
        self.retry("heartbeat", self.liveness.beat)

    def start_loops(self) -> None:
        self.threads.spawn("watcher", self.watcher.run)
        self.threads.spawn("heartbeat", self.liveness.run)

    def stop(self) -> None:
        self.stopping.set()


# == the command loop ==============================================================================


def cpu_seconds() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


class Sim:
    def __init__(self, cfg: dict[str, Any]) -> None:
        self.cfg = cfg
        self.hub = Hub(cfg)
        self.out_lock = threading.Lock()

    def reply(self, obj: dict[str, Any]) -> None:
        with self.out_lock:
            sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
            sys.stdout.flush()

    def boot(self) -> dict[str, Any]:
        """Every node: its heartbeat first (a lease; one put each), then its loops, at
        ``boot_rate`` nodes a second; done when every node has its streams created."""
        hub = self.hub
        cfg = self.cfg
        t0 = now()
        names: list[str] = cfg["nodes"]
        endpoints: list[str] = cfg.get("endpoints") or [""]
        for i, name in enumerate(names):
            endpoint = endpoints[i % len(endpoints)]  # spread over etcd's client listeners
            argv = [
                a.replace("{node}", name).replace("{endpoint}", endpoint) for a in cfg["node_argv"]
            ]
            hub.nodes.append(SimNode(hub, name, argv))
        with concurrent.futures.ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(lambda n: n.beat(), hub.nodes))
        t_beats = now()
        rate = float(cfg.get("boot_rate", 100))
        for i, node in enumerate(hub.nodes):
            node.start_loops()
            wait = t_beats + (i + 1) / rate - now()
            if wait > 0:
                time.sleep(wait)
            if i == 0:
                self._first_node_check(node)
        deadline = now() + float(cfg.get("boot_timeout", 300))
        while True:
            pending = asyncio.run_coroutine_threadsafe(self._pending_boot(), hub.loop).result()
            if not pending:
                break
            if now() > deadline:
                raise SystemExit(f"{pending} simulated nodes did not get their watches")
            time.sleep(0.2)
        time.sleep(1.0)  # streams of a node may open one after the other
        for node in hub.nodes:
            node.booted_streams = node.max_streams
        hub.booting = False
        hub.boot_cache.clear()
        streams = [n.booted_streams for n in hub.nodes]
        ranges = sorted(
            {
                (base64.b64encode(s.start).decode(), base64.b64encode(s.end).decode())
                for s in hub.streams
            }
        )
        return {
            "booted": len(hub.nodes),
            "beats_s": round(t_beats - t0, 2),
            "boot_s": round(now() - t0, 2),
            "streams_per_node": [min(streams), max(streams)],
            "ranges": ranges,
            "start_offset": self._start_offset(),
        }

    def _start_offset(self) -> int | None:
        """How far after the snapshot's revision tabby's watches start (+1 today)."""
        offsets = set()
        for s in self.hub.streams:
            offsets.add(s.start_revision)
        return min(offsets) if offsets else None

    async def _pending_boot(self) -> int:
        return sum(
            1
            for n in self.hub.nodes
            if not n.streams or any(s.created_at is None for s in n.streams)
        )

    def _first_node_check(self, node: SimNode) -> None:
        """tabby's store must watch through the client methods the bench hooks; if it no
        longer does, say so instead of measuring something else."""
        deadline = now() + 120
        while now() < deadline:
            if node.max_streams:
                return
            time.sleep(0.05)
        raise SystemExit(
            "the first simulated node opened no watch through EtcdClient._open_watch and "
            "etcd_client._read_watches: tabby's store changed how it watches; "
            "bench/scale/scale_sim.py must follow"
        )

    def counters(self) -> dict[str, Any]:
        hub = self.hub
        fut = asyncio.run_coroutine_threadsafe(self._counters(), hub.loop)
        return fut.result()

    async def _counters(self) -> dict[str, Any]:
        hub = self.hub
        with hub.lock:
            return {
                "t": now(),
                "cpu": cpu_seconds(),
                "events": dict(hub.events),
                "messages": hub.messages,
                "bytes": hub.bytes,
                "streams": len(hub.streams),
                "streams_opened": hub.streams_opened,
                "streams_ended": dict(hub.streams_ended),
                "snapshots": len(hub.snapshots),
                "range_reads": hub.range_reads,
                "range_bytes": hub.range_bytes,
                "range_keys": hub.range_keys,
                "threads": threading.active_count(),
            }

    async def _arrivals(self) -> dict[str, Any]:
        hub = self.hub
        out = {str(rev): a for rev, a in hub.arrivals.items()}
        hub.arrivals = {}
        return {"arrivals": out, "nodes": len(hub.nodes)}

    async def _expect(self, key: bytes, rev: int) -> dict[str, Any]:
        self.hub.set_expect(key, rev)
        return {"ok": True}

    async def _sync_report(self, since: float) -> dict[str, Any]:
        hub = self.hub
        times = [n.synced_at for n in hub.nodes]
        with hub.lock:
            snaps = [t for _, t in hub.snapshots if t >= since]
        return {
            "synced": [t for t in times if t is not None],
            "pending": sum(1 for t in times if t is None),
            "snapshot_times": snaps,
        }

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        loop = self.hub.loop
        if op == "boot":
            return self.boot()
        if op == "counters":
            return self.counters()
        if op == "arrivals":
            return asyncio.run_coroutine_threadsafe(self._arrivals(), loop).result()
        if op == "expect":
            key = base64.b64decode(cmd["key"])
            return asyncio.run_coroutine_threadsafe(
                self._expect(key, int(cmd["rev"])), loop
            ).result()
        if op == "sync_report":
            coro = self._sync_report(float(cmd.get("since", 0)))
            return asyncio.run_coroutine_threadsafe(coro, loop).result()
        if op == "ping":
            return {"pong": now()}
        raise SystemExit(f"unknown command {op!r}")

    def shutdown(self) -> None:
        hub = self.hub
        for node in hub.nodes:
            node.stop()
        try:
            asyncio.run_coroutine_threadsafe(hub.close_all(), hub.loop).result(timeout=30)
        except Exception as e:
            logging.warning("closing the streams: %s", e)
        for node in hub.nodes:
            node.threads.join(timeout=0.05)
            try:
                node.store.close()
            except Exception as e:
                logging.warning("closing a store: %s", e)


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = max(soft, min(hard, 1 << 17))
    resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    threading.stack_size(512 * 1024)
    logging.basicConfig(
        filename=cfg["log_file"], level=logging.WARNING, format="%(asctime)s %(message)s"
    )
    sim = Sim(cfg)
    loop = sim.hub.loop
    runner = threading.Thread(target=loop.run_forever, name="hub", daemon=True)
    runner.start()
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            cmd = json.loads(line)
            if cmd.get("op") == "stop":
                break
            try:
                sim.reply({"id": cmd.get("id"), **sim.handle(cmd)})
            except SystemExit as e:
                sim.reply({"id": cmd.get("id"), "error": str(e)})
    finally:
        sim.shutdown()
        sim.reply({"id": "stopped", "cpu": cpu_seconds()})
        loop.call_soon_threadsafe(loop.stop)
        runner.join(timeout=5)
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
