"""tabby-typha's state: the watched documents as each node receives them, a bounded history
of the changes, and each client's stream (a cursor into that history).

Everything here runs on one asyncio loop: the store's ``sync`` thread hands its events over
with ``loop.call_soon_threadsafe(hub.apply, event)``; each client's stream is a coroutine
reading the shared history from its own position. There is no queue per client: a client
that reads slowly falls behind in the history, and once the history no longer holds its
position it is sent a snapshot. typha's memory is the cluster's state plus the history's
bound, whatever its clients do (docs/typha.md "Bounded").

Positions are ``(epoch, seq)``: ``epoch`` names this process's history (random at start),
``seq`` counts the changes it applied. A client that comes back with this epoch and a
``seq`` the history still holds is sent only what it missed; any other position gets a
snapshot, from which the client derives the difference to what it holds.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from fanout import views, wire
from fanout.interest import EVERY, KINDS, WORKLOAD_KINDS, Interest, Nodes

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import Doc, SyncEvent, Undecoded

log = logging.getLogger("tabby.typha")

#: kinds whose documents each node receives in its own view (``fanout.views``)
PER_NODE = frozenset({"pod", "workloadendpoint", "block"})
MAX_MESSAGE = 1 << 20  # bytes of updates in one message (snapshot chunks, batches)


@dataclass(frozen=True)
class Bounds:
    history_events: int = 100_000  #: changes the history holds at most
    history_bytes: int = 64 << 20  #: and their encoded bytes at most
    keepalive: float = 10.0  #: seconds of quiet before a KEEPALIVE (with the position)
    #: seconds at least between two messages to one client: a change after a quiet spell
    #: goes at once, a churn's changes in batches (a message costs typha ~50 us of CPU per
    #: client whatever it holds: at 1000 nodes, one per change would be a core at 20
    #: changes a second)
    min_interval: float = 0.2


class Held:
    """One document as typha holds it: who gets it whole (``whole``), and the update the
    other nodes of ``to`` got (``remote``: the projection, at the revision it last changed;
    every node but the owner, unless the interest filter says fewer), each with its data's
    digest (``wire.content``: what tells a changed projection, and what ``digests``
    compare)."""

    __slots__ = ("owner", "remote", "remote_content", "to", "whole", "whole_content")

    def __init__(
        self,
        owner: str | None,
        whole: bytes,
        whole_content: int,
        remote: bytes,
        remote_content: int,
        to: Nodes = EVERY,
    ) -> None:
        self.owner = owner
        self.whole = whole
        self.whole_content = whole_content
        self.remote = remote
        self.remote_content = remote_content
        self.to = to

    def sent_to(self, node: str) -> bytes | None:
        if node == self.owner:
            return self.whole
        return self.remote if self.to.has(node) else None

    def content_for(self, node: str) -> int | None:
        if node == self.owner:
            return self.whole_content
        return self.remote_content if self.to.has(node) else None


class Change:
    """One entry of the history: the update ``owner`` gets (``whole``), the one the other
    nodes of ``to`` get (``remote``; None: nothing for them), and the previous owner, who is
    now another node (``remote`` is then not None: the projection names its node)."""

    __slots__ = ("owner", "remote", "seq", "size", "to", "whole")

    def __init__(
        self,
        seq: int,
        owner: str | None,
        whole: bytes,
        remote: bytes | None,
        to: Nodes = EVERY,
    ) -> None:
        self.seq = seq
        self.owner = owner
        self.whole = whole
        self.remote = remote
        self.to = to
        # (the names of ``to`` counted too, ~8 bytes each: the history's bound holds them)
        size = len(whole) + (len(remote) if remote is not None and remote is not whole else 0)
        self.size = size + 8 * len(to.names)

    def for_node(self, node: str) -> bytes | None:
        if node == self.owner:
            return self.whole
        return self.remote if self.to.has(node) else None


def canonical(data: JSON) -> bytes:
    return json.dumps(data, separators=(",", ":"), sort_keys=True).encode()


class Handshakes:
    """The TLS handshakes typha began and the connections that reached its service; the
    rest failed the handshake (no certificate, another CA's, not TLS at all) or never
    called (docs/typha.md "Who may connect").

    grpcio tells neither a failed handshake nor a connection's end. It calls the server's
    certificate fetcher once per TCP connection it accepts, before the handshake
    (``fanout.server``: ``begin``), and a connection that completed it reaches the service
    with its first call (``opened``, by the peer's address: the calls of one connection
    share it). The failures are the difference, counted once they settled: the handshakes
    begun at least ``settle`` seconds ago minus the connections that reached the service,
    never going back (a counter). Exact whenever no connection is being made; a connection
    whose first call comes more than ``settle`` s after it was accepted is counted as a
    failure (and the next real failure is then not), and so is a TCP connection that sends
    nothing (a check of the port). A peer's address is taken for the same connection while
    one of its calls is open and for ``peer_memory`` s after its last one ended: a new
    connection from the same address and port within that time is not counted (the
    client's side of a closed connection waits 60 s before its port is used again)."""

    def __init__(self, settle: float = 10.0, peer_memory: float = 60.0) -> None:
        self.settle = settle
        self.peer_memory = peer_memory
        self._lock = threading.Lock()
        self.begun = 0
        self.reached = 0
        #: the handshakes not settled yet, by tenths of a second: [first's time, last's
        #: time, how many] (at most 10 per second of ``settle``)
        self._unsettled: deque[list[float]] = deque()
        self._settled = 0
        self._failed = 0
        self._open: dict[str, int] = {}  #: calls open, by peer
        self._ended: dict[str, float] = {}  #: when the peer's last call ended, oldest first

    def begin(self) -> None:
        """A handshake begins (grpcio's thread)."""
        now = time.monotonic()
        with self._lock:
            self.begun += 1
            if self._unsettled and now - self._unsettled[-1][0] < 0.1:
                self._unsettled[-1][1:] = [now, self._unsettled[-1][2] + 1]
            else:
                self._unsettled.append([now, now, 1])

    def opened(self, peer: str) -> None:
        """A call from ``peer`` reached the service."""
        now = time.monotonic()
        with self._lock:
            while self._ended:
                oldest, ended = next(iter(self._ended.items()))
                if now - ended < self.peer_memory:
                    break
                del self._ended[oldest]
            if peer not in self._open and self._ended.pop(peer, None) is None:
                self.reached += 1
            self._open[peer] = self._open.get(peer, 0) + 1

    def closed(self, peer: str) -> None:
        """A call from ``peer`` ended."""
        with self._lock:
            left = self._open.get(peer, 0) - 1
            if left > 0:
                self._open[peer] = left
            else:
                self._open.pop(peer, None)
                self._ended[peer] = time.monotonic()

    def failed(self) -> int:
        """Handshakes that did not become a connection calling the service (settled)."""
        now = time.monotonic()
        with self._lock:
            while self._unsettled and now - self._unsettled[0][1] >= self.settle:
                self._settled += int(self._unsettled.popleft()[2])
            self._failed = max(self._failed, self._settled - self.reached)
            return self._failed


@dataclass
class Stats:
    """What ``/metrics`` reads (``typha.metrics``)."""

    connections: int = 0
    snapshots: int = 0
    snapshot_bytes: int = 0
    snapshot_seconds: float = 0.0
    resumes: int = 0
    resyncs: int = 0  #: reconnections from another position, by digests
    updates_sent: int = 0
    bytes_sent: int = 0
    behind: int = 0  #: clients not sent every change (updated by ``Hub.tick``)
    refused: dict[str, int] = field(default_factory=dict)
    handshakes: Handshakes = field(default_factory=Handshakes)


class Client:
    """One connected stream: its node and the position sent to it."""

    __slots__ = ("acked", "node", "seq")

    def __init__(self, node: str) -> None:
        self.node = node
        self.seq = 0  #: the history position sent so far
        self.acked = 0  #: the position the client says it applied


class Hub:
    def __init__(
        self,
        bounds: Bounds | None = None,
        epoch: str | None = None,
        kinds: Sequence[str] = (),
        *,
        interest: bool = True,
    ) -> None:
        self.bounds = bounds or Bounds()
        self.epoch = epoch or os.urandom(8).hex()
        #: the kinds it syncs and serves (empty: whatever its events bring)
        self.kinds = frozenset(kinds)
        self.docs: dict[str, dict[str, Held]] = {}
        self.seq = 0
        self.history: deque[Change] = deque()
        self.history_bytes = 0
        self.ready = False  #: the datastore's first snapshot is in
        #: which nodes each workload of another node goes to (``fanout.interest``; None:
        #: every node, Typha's way)
        self.interest = Interest() if interest else None
        self.clients: set[Client] = set()
        self.stats = Stats()
        self._wake = asyncio.Event()

    # -- the datastore's side -------------------------------------------------------------

    def apply(self, event: SyncEvent) -> None:
        """One event of the store's ``sync``. A snapshot (the first, or after the store's
        watch broke and was opened again) becomes the differences from what typha holds:
        clients never see typha's own re-reads."""
        if event.type == "snapshot":
            assert event.snapshot is not None
            self._snapshot(event.snapshot)
            self.ready = True
        elif event.type == "put":
            assert event.doc is not None
            self._put(event.kind, event.key, event.doc)
        else:
            self._delete(event.kind, event.key)
        self._notify()

    def _snapshot(self, snapshot: Mapping[str, dict[str, Doc] | Undecoded]) -> None:
        """(The interest is settled once, at the end: not once per document.)"""
        interest = self.interest
        if interest is not None:
            interest.batch = True
        try:
            for kind, docs in snapshot.items():
                held = self.docs.setdefault(kind, {})
                for key in [k for k in held if k not in docs]:
                    self._delete(kind, key)
                for key in list(docs):
                    doc = docs.pop(key) if hasattr(docs, "pop") else docs[key]
                    self._put(kind, key, doc)
        finally:
            if interest is not None:
                interest.batch = False
        self._redeliver()

    def _put(self, kind: str, key: str, doc: Doc) -> None:
        held = self.docs.setdefault(kind, {})
        old = held.get(key)
        data = canonical(doc.data)
        whole = wire.update_field(kind, key, doc.revision, data)
        if old is not None and old.whole == whole:
            return  # the same revision again (a re-read)
        digest = wire.content(data)
        interest = self.interest
        if interest is not None and kind in KINDS:
            interest.put(kind, key, doc.data)
        if kind not in PER_NODE:
            held[key] = Held(None, whole, digest, whole, digest)
            self._record(Change(self.seq + 1, None, whole, whole))
            self._redeliver()
            return
        owner = views.owner(kind, doc.data)
        projected = canonical(views.projection(kind, doc.data))
        projected_digest = wire.content(projected)
        # the nodes that held it keep it until ``_redeliver`` says otherwise
        had = old.to if old is not None else Nodes() if self._filtered(kind) else EVERY
        if old is not None and old.remote_content == projected_digest and old.owner == owner:
            # the others' view is as it was: they keep the update they had
            held[key] = Held(owner, whole, digest, old.remote, projected_digest, had)
            if owner is not None:
                self._record(Change(self.seq + 1, owner, whole, None))
            self._redeliver((kind, key))
            return
        remote = wire.update_field(kind, key, doc.revision, projected)
        held[key] = Held(owner, whole, digest, remote, projected_digest, had)
        now = self._to(kind, key)
        self._record(Change(self.seq + 1, owner, whole, remote, had & now))
        self._redeliver((kind, key))

    def _delete(self, kind: str, key: str) -> None:
        old = self.docs.get(kind, {}).pop(key, None)
        if self.interest is not None and kind in KINDS:
            self.interest.delete(kind, key)
        if old is None:
            return
        gone = wire.update_field(kind, key, 0, None)
        self._record(Change(self.seq + 1, old.owner, gone, gone, old.to))
        self._redeliver()

    def _redeliver(self, doc: tuple[str, str] | None = None) -> None:
        """The workload documents whose nodes changed (``fanout.interest``) sent to the
        nodes they gained, deleted from those they lost (and ``doc``'s, just put)."""
        interest = self.interest
        if interest is None:
            return
        docs = {doc} if doc is not None and doc[0] in WORKLOAD_KINDS else set()
        for name in interest.take_changed():
            docs.update(interest.docs(name))
        for kind, key in sorted(docs):
            held = self.docs.get(kind, {}).get(key)
            if held is None:
                continue
            now = interest.to(kind, key)
            own = Nodes((held.owner,)) if held.owner is not None else Nodes()
            gained, lost = now - held.to - own, held.to - now - own
            held.to = now
            if not gained.empty():
                self._record(Change(self.seq + 1, None, held.remote, held.remote, gained))
            if not lost.empty():
                gone = wire.update_field(kind, key, 0, None)
                self._record(Change(self.seq + 1, None, gone, gone, lost))

    def _filtered(self, kind: str) -> bool:
        return self.interest is not None and kind in WORKLOAD_KINDS

    def _to(self, kind: str, key: str) -> Nodes:
        """The nodes other than its owner that get a document now."""
        if self.interest is None or kind not in WORKLOAD_KINDS:
            return EVERY
        return self.interest.to(kind, key)

    def _record(self, change: Change) -> None:
        self.seq = change.seq
        self.history.append(change)
        self.history_bytes += change.size
        bounds = self.bounds
        while self.history and (
            len(self.history) > bounds.history_events or self.history_bytes > bounds.history_bytes
        ):
            self.history_bytes -= self.history.popleft().size

    def _notify(self) -> None:
        self._wake.set()
        self._wake = asyncio.Event()

    # -- the clients' side ----------------------------------------------------------------

    def unserved(self, kinds: Iterable[str]) -> list[str]:
        """The kinds of ``kinds`` this hub does not sync: a client that asks for one would
        take its absence for none of it (a tabby-node newer than its typha)."""
        if not self.kinds:
            return []
        return sorted(set(kinds) - self.kinds)

    def holds(self, epoch: str, seq: int) -> bool:
        """The history can bring a client at this position up to date."""
        if epoch != self.epoch or seq > self.seq:
            return False
        first = self.history[0].seq if self.history else self.seq + 1
        return seq >= first - 1

    def since(self, seq: int) -> list[Change] | None:
        """The changes after ``seq`` (None: the history no longer holds them all)."""
        if seq >= self.seq:
            return []
        if not self.holds(self.epoch, seq):
            return None
        start = seq + 1 - self.history[0].seq
        return [self.history[i] for i in range(start, len(self.history))]

    def snapshot_fields(
        self, node: str, kinds: Sequence[str] = (), buckets: Iterable[int] = ()
    ) -> list[bytes]:
        """Every document as ``node`` receives it (at ``self.seq``); with ``buckets`` (of
        ``kinds``, ``wire.digests``' numbering), those buckets' documents only."""
        wanted = set(buckets)
        out = []
        for i, kind in enumerate(kinds or list(self.docs)):
            for key, held in self.docs.get(kind, {}).items():
                if wanted and i * wire.BUCKETS + wire.bucket(key) not in wanted:
                    continue
                update = held.sent_to(node)
                if update is not None:
                    out.append(update)
        return out

    def digests(self, node: str, kinds: Sequence[str]) -> bytes:
        """``wire.digests`` of what ``node`` is sent of ``kinds``."""
        contents: dict[str, dict[str, int]] = {}
        for kind in kinds:
            mine = contents[kind] = {}
            for key, held in self.docs.get(kind, {}).items():
                content = held.content_for(node)
                if content is not None:
                    mine[key] = content
        return wire.digests(kinds, contents)

    def differing(self, node: str, hello: wire.ClientMessage) -> list[int] | None:
        """The buckets (``wire.digests``' numbering) where what ``hello`` says its client
        holds differs from what ``node`` is sent now (None: it says nothing usable)."""
        size = wire.DIGEST_SIZE
        if not hello.kinds or len(hello.digests) != len(hello.kinds) * wire.BUCKETS * size:
            return None
        mine = self.digests(node, hello.kinds)
        return [
            i
            for i in range(len(hello.kinds) * wire.BUCKETS)
            if mine[i * size : (i + 1) * size] != hello.digests[i * size : (i + 1) * size]
        ]

    def tick(self) -> None:
        """Bring the numbers read from other threads up to date (``/metrics``)."""
        self.stats.behind = sum(1 for c in self.clients if c.seq < self.seq)

    async def stream(self, client: Client, hello: wire.ClientMessage) -> AsyncIterator[bytes]:
        """The messages of one client's stream (encoded ``ServerMessage``s), forever: a
        snapshot or what it missed, then the changes of its view."""
        self.clients.add(client)
        self.stats.connections += 1
        try:
            if hello.epoch and self.holds(hello.epoch, hello.seq):
                client.seq = hello.seq
                self.stats.resumes += 1
            elif hello.epoch and (differing := self.differing(client.node, hello)) is not None:
                # another replica's (or an older) position: only the buckets that differ
                self.stats.resyncs += 1
                client.seq = self.seq
                if differing:
                    for message in self._snapshot_messages(client, hello.kinds, differing):
                        yield message
                else:
                    yield wire.encode_server(wire.KEEPALIVE, self.epoch, client.seq)
            else:
                for message in self._snapshot_messages(client):
                    yield message
            sent = 0.0
            while True:
                wait = sent + self.bounds.min_interval - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                wake = self._wake
                changes = self.since(client.seq)
                if changes is None:  # fell out of the history: a snapshot again
                    for message in self._snapshot_messages(client):
                        yield message
                    continue
                if not changes:
                    try:
                        await asyncio.wait_for(wake.wait(), self.bounds.keepalive)
                    except TimeoutError:
                        yield wire.encode_server(wire.KEEPALIVE, self.epoch, client.seq)
                    continue
                for message in self._update_messages(client, changes):
                    sent = time.monotonic()
                    yield message
        finally:
            self.clients.discard(client)
            self.stats.connections -= 1

    def _update_messages(self, client: Client, changes: list[Change]) -> Iterable[bytes]:
        node = client.node
        parts: list[bytes] = []
        size = 0
        for change in changes:
            update = change.for_node(node)
            if update is not None:
                parts.append(update)
                size += len(update)
                self.stats.updates_sent += 1
            client.seq = change.seq
            if size >= MAX_MESSAGE:
                yield self._message(wire.UPDATES, client.seq, parts)
                parts, size = [], 0
        if parts:
            yield self._message(wire.UPDATES, client.seq, parts)

    def _snapshot_messages(
        self, client: Client, kinds: Sequence[str] = (), buckets: Sequence[int] = ()
    ) -> Iterable[bytes]:
        """A snapshot, of every document or (``buckets``) of those buckets' only."""
        started = time.monotonic()
        seq = self.seq
        fields = self.snapshot_fields(client.node, kinds, buckets)
        client.seq = seq
        total = 0
        yield wire.encode_server(wire.SNAPSHOT_BEGIN, self.epoch, seq, buckets=buckets)
        parts: list[bytes] = []
        size = 0
        for f in fields:
            parts.append(f)
            size += len(f)
            if size >= MAX_MESSAGE:
                total += size
                yield self._message(wire.SNAPSHOT_CHUNK, seq, parts)
                parts, size = [], 0
        total += size
        yield self._message(wire.SNAPSHOT_CHUNK, seq, parts)
        if not buckets:
            self.stats.snapshots += 1
        self.stats.snapshot_bytes += total
        self.stats.snapshot_seconds += time.monotonic() - started
        yield wire.encode_server(wire.SNAPSHOT_END, self.epoch, seq)

    def _message(self, type: int, seq: int, updates: list[bytes]) -> bytes:
        message = wire.encode_server(type, self.epoch, seq, b"".join(updates))
        self.stats.bytes_sent += len(message)
        return message
