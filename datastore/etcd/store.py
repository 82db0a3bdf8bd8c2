"""The etcd v3 store (cluster mode): every document one key under ``etcd_prefix``.

What is common to every store (argument checks, encoding, the compare-and-swap rule and its
errors, listing order, the lock session, sync bookkeeping) is ``datastore.engine``; this
module keeps keys, txns, leases and the watch.

Key layout (``<p>`` = the prefix without a trailing ``/``, default ``/tabby``; a document's
key is appended as is, UTF-8)::

    <p>/calico/v1/<plural>/<key>                 Calico's policy kinds: calico-networkpolicies,
                                                 globalnetworkpolicies, staged*, tiers,
                                                 networksets, globalnetworksets, hostendpoints
                                                 (before heartbeats: a range of their own that
                                                 splits no run tabby-node watches)
    <p>/heartbeats/<node>                        kind "heartbeat" (written with a ttl: a lease)
    <p>/ipam/v1/affinities/<node>                kind "affinity"
    <p>/ipam/v1/blocks/<block cidr>              kind "block"      e.g. .../blocks/10.244.0.64/26
    <p>/ipam/v1/handles/<net>:<cid>:<ifname>     kind "handle"
    <p>/ipam/v1/pools/<pool cidr>                kind "pool"
    <p>/resources/v1/<plural>/<key>              nodes, bgpconfigurations, bgppeers,
                                                 networkpolicies, namespaces, serviceaccounts,
                                                 pods, workloadendpoints (key "<ns>/<name>"
                                                 or name)
    <p>/traces/<id>[.<node>]                     kind "trace" (with a ttl): policy trace requests
                                                 and their results

A value is the document's JSON (UTF-8), nothing else; its revision is the key's
``mod_revision``. Mapping of the contract:

- ``put`` and ``delete`` are one txn each: an expected revision None compares
  ``create_revision == 0``, ``rev`` compares ``mod_revision == rev``. A failed compare
  answers with the key's current value (the txn's failure branch), so a conflict costs no
  extra round trip, its ``RevisionConflict`` is the engine's, and a conflict with a value
  that is not JSON is reported as ``StoreCorrupt``.
- ``list``/``list_keys``: one range (pages of 1000 keys, all read at the first page's
  revision, so still one consistent view).
- ``put_leased(ttl=s)``: a new lease of ``ceil(s)`` seconds (at least 1; etcd may round a very short
  ttl up to its minimum) is granted, then the txn puts with it. A write without ttl detaches
  the key from its lease. An unused lease (a lost CAS) just expires.
- ``sync``: the wanted kinds grouped into the fewest key ranges that hold no other kind
  (``watch_groups``: tabby-node's kinds make three, ``heartbeats/``, ``ipam/v1/blocks/``
  and ``ipam/v1/pools/`` to the end of ``resources/v1/``; IPAM handles and affinities are
  never in them). The snapshot reads every range at one revision (the later ranges pinned
  to the first one's), then one watch per range (one stream each, all read by the
  iterator's thread) from the next revision, with progress notifications. Each range keeps
  its progress: the last revision it delivered (its last event's, or a progress
  notification's). A broken stream (a member killed or restarted, the connection lost, a
  member without a leader) closes them all; they are opened again after a pause with full
  jitter, every range from its own progress + 1: nothing is read again
  (``sync_stats["resumes"]``). Only a compacted history (a watch cancelled with a
  ``compact_revision``) makes the store read the ranges whose history is gone, after a
  random delay of up to ``REREAD_JITTER`` seconds, and report only the differences
  (``sync_stats["rereads"]``).
- ``lock``: node-local only (the engine's session: the process's thread lock for, then
  flock on, ``<lock_dir>/etcd-<hash>.lock``, the hash over the sorted endpoints, the prefix,
  and the inode of the process's network namespace), which exists only while it is held
  (the holder unlinks it before letting go). One object may serve many threads, a
  session belongs to the thread that took it, and taking it again in that thread is a
  ``RuntimeError``. Correctness across nodes rests on the compare-and-swap of every write.
- ``check_usable``: one linearizable read of one key.
- A write retried after an attempt with an unknown outcome (connection lost after sending,
  "request timed out"), whose compare then fails, is checked against the current values: if
  every put key holds exactly the value written (and the lease written: none without a ttl)
  and every deleted key is gone, it succeeded (``stats["resolved"]``); otherwise the outcome
  stays unknown and it raises ``StoreUnavailable``, never ``RevisionConflict``
  (``stats["unknown"]``).
- Unreachable endpoints or no quorum: ``StoreUnavailable`` naming the endpoints, after at
  most ``lock_timeout`` seconds per operation.
"""

from __future__ import annotations

import binascii
import builtins
import functools
import math
import os
import random
import threading
import time
from collections.abc import Generator, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from datastore.base import (
    CALICO_KINDS,
    IPAM_KINDS,
    KINDS,
    RESOURCE_KINDS,
    Doc,
    SyncEvent,
    Undecoded,
    check_key,
    check_kind,
)
from datastore.engine import (
    LOCK_FLAGS,
    PLURALS,
    Engine,
    Reported,
    Write,
    loads,
    log_warning,
    note_failure,
    refused,
)
from datastore.errors import (
    InvalidConfig,
    RevisionConflict,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
)
from datastore.etcd.client import (
    EtcdCancelled,
    EtcdClient,
    EtcdCompacted,
    EtcdConfigError,
    EtcdError,
    EtcdRequestError,
    EtcdUnavailable,
    KeyValue,
    WatchResponse,
    cmp_absent,
    cmp_mod,
    kv_from_json,
    op_delete,
    op_get,
    op_put,
    parse_endpoint,
    prefix_end,
)

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import StoreSettings
    from datastore.etcd.grpc import GrpcWatcher

_GROUPS = {
    **dict.fromkeys(IPAM_KINDS, "ipam/v1/"),
    **dict.fromkeys(RESOURCE_KINDS, "resources/v1/"),
    **dict.fromkeys(CALICO_KINDS, "calico/v1/"),
    "heartbeat": "",
    "trace": "",
}
#: kind -> key prefix below ``<p>/`` (see the module docstring)
LAYOUT = {kind: f"{_GROUPS[kind]}{PLURALS[kind]}/" for kind in KINDS}
DEFAULT_PREFIX = "/tabby"
DEFAULT_LOCK_DIR = "/run/tabby/locks"
PAGE = 1000
#: sync: the first and the longest pause before a failed read is tried again or a broken
#: watch stream is opened again; each pause is random in [0, pause] (full jitter: the nodes
#: that lost the same member do not all come back in the same instant), doubling per failure.
RETRY_PAUSE = (0.2, 2.0)
#: sync: seconds, at most, that a re-read forced by a compacted history waits (a random
#: delay in [0, REREAD_JITTER]): a compaction cancels the watches of every node that was
#: away while it ran, and a thousand nodes must not read their kinds in the same instant.
#: Against the issue's "every node back in sync within 30 s" this leaves 25 s for the reads.
REREAD_JITTER = 5.0


def jittered(most: float) -> float:
    """A random delay in [0, most] (full jitter)."""
    return random.uniform(0, most)  # noqa: S311 - spreads nodes in time; no secret


class _Sync:
    """What one ``sync`` of :class:`EtcdStore` knows between its reads and its watches."""

    __slots__ = (
        "broken",
        "failure",
        "first",
        "groups",
        "jitter",
        "lost",
        "pause",
        "prefixes",
        "progress",
        "ranges",
        "reported",
    )

    def __init__(
        self,
        groups: list[tuple[str, ...]],
        ranges: list[tuple[bytes, bytes]],
        prefixes: list[tuple[str, bytes]],
    ) -> None:
        self.groups = groups  #: the kinds of each range
        self.ranges = ranges
        self.prefixes = prefixes  #: (kind, key prefix) of every kind
        self.reported = Reported()
        self.progress = [0] * len(ranges)  #: per range: the last revision it delivered
        self.lost = list(range(len(ranges)))  #: the ranges to read: every one at first
        self.first = True  #: nothing reported yet: the read is the snapshot
        self.jitter = False  #: a re-read is due: wait a random while first
        self.broken = False  #: the last stream broke: the next one resumes
        self.pause = RETRY_PAUSE[0]
        self.failure = ""


def watch_groups(kinds: Iterable[str]) -> builtins.list[tuple[str, ...]]:
    """The kinds grouped into the fewest key ranges that hold no other kind: runs of kinds
    next to each other in key order (``LAYOUT``), each run one watch of ``sync``.

    Never bridged over, although that would save a range: IPAM handles (written by every
    pod ADD and DEL anywhere: the watch would carry them to every node) and affinities.
    Bridging affinities would make tabby-node's heartbeats and blocks one range (two
    streams per node, not three), but an affinity is written when a block is claimed, when
    it fills and when it has room again: on a node at its blocks' capacity with every ADD
    and DEL, so every node would receive three events per pod change instead of two, each
    ~70 us of etcd's CPU through the gateway (measured) and the node's parsing. A range
    more costs a watch stream (a connection, a gRPC stream and a watcher in etcd: memory,
    and nothing while it is quiet). CPU with every pod change against a little memory per
    node: no bridging.
    """
    wanted = set(kinds)
    groups: list[tuple[str, ...]] = []
    run: list[str] = []
    for kind in sorted(KINDS, key=LAYOUT.__getitem__):
        if kind in wanted:
            run.append(kind)
        elif run:
            groups.append(tuple(run))
            run = []
    if run:
        groups.append(tuple(run))
    return groups


def _netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


class EtcdStore(Engine):
    """Store over etcd v3 (see the module docstring). Thread-safe: one object may serve
    many threads (they share its pool of keep-alive connections)."""

    _ephemeral_lock_file = True

    def __init__(
        self,
        endpoints: Sequence[str] | str,
        *,
        prefix: str = DEFAULT_PREFIX,
        lock_timeout: float = 30.0,
        ca_file: str | None = None,
        cert_file: str | None = None,
        key_file: str | None = None,
        lock_dir: str | None = None,
        watch_transport: str = "grpc",
        watch_endpoints: Sequence[str] | str = (),
    ) -> None:
        super().__init__()
        self.lock_timeout = float(lock_timeout)
        try:
            self.client = EtcdClient(
                endpoints,
                timeout=self.lock_timeout,
                ca_file=ca_file,
                cert_file=cert_file,
                key_file=key_file,
            )
            if isinstance(watch_endpoints, str):
                watch_endpoints = [e for e in watch_endpoints.split(",") if e.strip()]
            for url in watch_endpoints:
                parse_endpoint(url)
        except EtcdConfigError as e:
            raise InvalidConfig("bad etcd settings", str(e)) from None
        if watch_transport not in ("grpc", "gateway"):
            raise InvalidConfig("bad etcd settings", f"watch transport {watch_transport!r}")
        if watch_transport == "gateway" and watch_endpoints:
            raise InvalidConfig(
                "bad etcd settings", "etcd_watch_endpoints need etcd_watch_transport grpc"
            )
        self.watch_transport = watch_transport
        self.watch_endpoints = tuple(watch_endpoints)
        self._watcher: GrpcWatcher | None = None
        self.endpoints = self.client.urls
        self.prefix = prefix.rstrip("/")
        self._kp = {kind: f"{self.prefix}/{LAYOUT[kind]}".encode() for kind in KINDS}
        self.lock_dir = lock_dir or DEFAULT_LOCK_DIR
        ident = "\n".join([*sorted(self.endpoints), self.prefix, str(_netns_inode())])
        raw = ident.encode()  # hashlib would load OpenSSL (~3.5 ms); a name needs no more
        digest = f"{binascii.crc32(raw):08x}{binascii.crc32(raw[::-1]):08x}"
        self.lock_path = os.path.join(self.lock_dir, f"etcd-{digest}.lock")
        self._leases: dict[bytes, int] = {}  # key -> the lease its ttl put attached
        self._held = threading.local()
        self._stats_lock = threading.Lock()
        # txns sent; conflicts (RevisionConflict raised: a CAS the caller retries); writes
        # retried after an unknown outcome, then found applied (resolved) or not (unknown)
        self.stats = {"txns": 0, "conflicts": 0, "resolved": 0, "unknown": 0}

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> EtcdStore:
        run_dir = getattr(settings, "run_dir", None)
        return cls(
            settings.etcd_endpoints,
            prefix=settings.etcd_prefix or DEFAULT_PREFIX,
            lock_timeout=settings.lock_timeout_seconds,
            ca_file=settings.etcd_ca_cert_file,
            cert_file=settings.etcd_cert_file,
            key_file=settings.etcd_key_file,
            lock_dir=os.path.join(run_dir, "locks") if run_dir else None,
            watch_transport=settings.etcd_watch_transport,
            watch_endpoints=settings.etcd_watch_endpoints,
        )

    @property
    def watcher(self) -> GrpcWatcher | EtcdClient:
        """What ``sync`` watches with: native gRPC (default; on ``watch_endpoints``, e.g.
        ``etcd grpc-proxy`` listeners, else the client's endpoints), or the client's JSON
        gateway (``watch_transport="gateway"``). Made on first use: a CNI call never
        watches, so it never imports the gRPC transport."""
        if self.watch_transport == "gateway":
            return self.client
        if self._watcher is None:
            from datastore.etcd.grpc import GrpcWatcher

            self._watcher = GrpcWatcher(self.client, self.watch_endpoints)
        return self._watcher

    # -- keys and errors ----------------------------------------------------------------

    def raw_key(self, kind: str, key: str) -> bytes:
        """The etcd key of a document."""
        check_kind(kind)
        check_key(key)
        return self._key(kind, key)

    def _key(self, kind: str, key: str) -> bytes:
        return self._kp[kind] + key.encode("utf-8", "surrogateescape")

    def location(self, kind: str, key: str) -> str:
        return "etcd:" + self._key(kind, key).decode("utf-8", "replace")

    def _deadline(self) -> float:
        return time.monotonic() + self.lock_timeout

    def _error(self, e: EtcdError) -> StoreError | InvalidConfig:
        where = ", ".join(self.endpoints)
        if isinstance(e, EtcdUnavailable):
            return StoreUnavailable(where, e.reason)
        if isinstance(e, EtcdConfigError):
            return InvalidConfig("bad etcd settings", str(e))
        if isinstance(e, EtcdRequestError) and e.code in (3, 8):  # InvalidArgument, too big
            return InvalidConfig("etcd refused the request", str(e))
        return StoreUnavailable(where, str(e))

    def _count(self, name: str) -> None:
        with self._stats_lock:
            self.stats[name] += 1

    def _decode(self, kind: str, key: str, value: bytes) -> JSON:
        where = self.location(kind, key)
        data = loads(where, value, empty="empty value", garbage="not JSON")
        if not isinstance(data, dict):
            raise StoreCorrupt(where, "not a JSON object")
        return data

    def _key_of(self, kind: str, raw: bytes) -> str:
        return raw[len(self._kp[kind]) :].decode("utf-8", "surrogateescape")

    # -- reads --------------------------------------------------------------------------

    def _get(self, kind: str, key: str) -> Doc | None:
        try:
            result = self.client.range(self._key(kind, key), deadline=self._deadline())
        except EtcdError as e:
            raise self._error(e) from None
        if not result.kvs:
            return None
        kv = result.kvs[0]
        return Doc(self._decode(kind, key, kv.value), kv.mod_revision)

    def _range_all(
        self,
        start: bytes,
        end: bytes,
        deadline: float,
        *,
        keys_only: bool = False,
    ) -> builtins.list[KeyValue]:
        """Every key in [start, end) at one revision (pages pinned to the first one's)."""
        while True:
            try:
                return self._pages(start, end, 0, deadline, keys_only=keys_only)[0]
            except EtcdCompacted:
                continue  # compacted between pages: read again at a newer revision

    def _pages(
        self,
        start: bytes,
        end: bytes,
        rev: int,
        deadline: float,
        *,
        keys_only: bool = False,
        cancel: threading.Event | None = None,
    ) -> tuple[builtins.list[KeyValue], int]:
        """Every key in [start, end) at revision ``rev`` (0: the first page's), in pages of
        ``PAGE``; and that revision. ``EtcdCompacted`` when it is gone."""
        out: list[KeyValue] = []
        key = start
        while True:
            r = self.client.range(
                key,
                end,
                revision=rev,
                limit=PAGE,
                keys_only=keys_only,
                deadline=deadline,
                cancel=cancel,
            )
            rev = rev or r.revision
            out += r.kvs
            if not r.more or not r.kvs:
                return out, rev
            key = r.kvs[-1].key + b"\0"

    def _range_kind(
        self, kind: str, prefix: str, *, keys_only: bool = False
    ) -> builtins.list[KeyValue]:
        start = self._kp[kind] + prefix.encode("utf-8", "surrogateescape")
        try:
            return self._range_all(start, prefix_end(start), self._deadline(), keys_only=keys_only)
        except EtcdError as e:
            raise self._error(e) from None

    def _keys(self, kind: str) -> builtins.list[str]:
        return [self._key_of(kind, kv.key) for kv in self._range_kind(kind, "", keys_only=True)]

    def _items(self, kind: str, prefix: str) -> builtins.list[tuple[str, Doc]]:
        out = []
        for kv in self._range_kind(kind, prefix):
            key = self._key_of(kind, kv.key)
            out.append((key, Doc(self._decode(kind, key, kv.value), kv.mod_revision)))
        return out

    # -- writes: one txn each -----------------------------------------------------------

    def _apply(self, w: Write) -> int:
        """One txn: compare the revision, then put (with a new lease for a ttl) or delete; a
        failed compare reads the key back (the txn's failure branch)."""
        k = self._key(w.kind, w.key)
        deadline = self._deadline()
        try:
            lease = (
                0
                if w.ttl is None
                else self.client.lease_grant(max(1, math.ceil(w.ttl)), deadline=deadline)[0]
            )
            compare = [cmp_absent(k) if w.expected is None else cmp_mod(k, w.expected)]
            success = [op_delete(k) if w.value is None else op_put(k, w.value, lease)]
            result = self.client.txn(compare, success, [op_get(k)], deadline=deadline)
        except EtcdError as e:
            raise self._error(e) from None
        self._count("txns")
        if result.succeeded:
            if lease:
                self._leases[k] = lease
            return 0 if w.value is None else result.revision
        current = _current(result.responses)
        if result.ambiguous:
            rev = _applied(w, lease, current)
            if rev is not None:
                self._count("resolved")
                return rev
            raise self._unknown(w)
        if current is not None:
            self._decode(w.kind, w.key, current.value)  # a conflict with garbage: StoreCorrupt
        self._count("conflicts")
        self._compare(w, None if current is None else current.mod_revision)
        raise RevisionConflict("document changed", self.location(w.kind, w.key))

    def _keepalive(self, kind: str, key: str) -> bool:
        """One keep-alive of the lease the key was written with (learnt from the put, else
        read once): etcd sends no watch event for it."""
        k = self._key(kind, key)
        deadline = self._deadline()
        try:
            lease = self._leases.get(k)
            if lease is None:
                found = self.client.range(k, deadline=deadline)
                if not found.kvs or not found.kvs[0].lease:
                    return False
                lease = found.kvs[0].lease
            ttl = self.client.lease_keepalive(lease, deadline=deadline)
        except EtcdError as e:
            raise self._error(e) from None
        if ttl <= 0:
            self._leases.pop(k, None)
            return False
        self._leases[k] = lease
        return True

    def _unknown(self, first: Write) -> StoreUnavailable:
        """A retried write whose compare failed, and etcd does not hold what it wrote: the
        first attempt may have been applied and then overwritten, or never applied. Not a
        RevisionConflict (that promises nothing was written): the caller gives up and its
        caller retries the whole operation (the allocator's operations are idempotent)."""
        self._count("unknown")
        return StoreUnavailable(
            ", ".join(self.endpoints),
            f"outcome of the write of {self.location(first.kind, first.key)} unknown "
            "(etcd failed while it was in flight)",
        )

    # -- lock, health, life cycle -------------------------------------------------------

    def _open_lock_file(self) -> int:
        try:
            os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
            return os.open(self.lock_path, LOCK_FLAGS, 0o600)
        except OSError as e:
            raise refused(self.lock_path, e) from None

    def check_usable(self) -> None:
        """One linearizable read (it needs a leader and a quorum)."""
        try:
            self.client.range(self.prefix.encode() + b"/", deadline=self._deadline())
        except EtcdError as e:
            raise self._error(e) from None

    def close(self) -> None:
        self.client.close()

    # -- sync ---------------------------------------------------------------------------

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        groups = watch_groups(kinds)
        ranges = [(self._kp[g[0]], prefix_end(self._kp[g[-1]])) for g in groups]
        st = _Sync(groups, ranges, [(kind, self._kp[kind]) for kind in kinds])
        while not stop.is_set():
            if st.lost:
                outcome = yield from self._sync_read(st, stop)
                if outcome == "stop":
                    break
                if outcome == "retry":
                    continue
            if not (yield from self._sync_watch(st, stop)):
                break

    def _sync_read(self, st: _Sync, stop: threading.Event) -> Generator[SyncEvent, None, str]:
        """Read the ranges ``st.lost`` at one revision: the snapshot the first time, else
        what changed in them. ``stop``, ``retry`` (the read failed) or ``read``."""
        if st.jitter:
            st.jitter = False
            if stop.wait(jittered(REREAD_JITTER)):
                return "stop"
        try:
            kvs, rev = self._read_ranges([st.ranges[i] for i in st.lost], stop)
        except EtcdCancelled:
            return "stop"
        except EtcdError as e:
            where = self.prefix + "/"
            st.failure = note_failure(st.failure, f"sync of {where}: {self._error(e)} (retrying)")
            stop.wait(jittered(st.pause))
            st.pause = min(st.pause * 2, RETRY_PAUSE[1])
            return "retry"
        docs: dict[str, dict[str, Doc]] = {k: {} for i in st.lost for k in st.groups[i]}
        # the first snapshot: as stored, decoded again one at a time by the consumer
        # (all of them decoded at once were the agent's memory peak)
        stored: dict[str, dict[str, tuple[bytes, int]]] = {k: {} for k in docs}
        for kv in kvs:
            found = self._classify(st.prefixes, kv)  # decodes: leaves out garbage
            if found is not None and found[2] is not None:
                if st.first:
                    stored[found[0]][found[1]] = (kv.value, kv.mod_revision)
                else:
                    docs[found[0]][found[1]] = found[2]
        del kvs  # the raw values: not held while the consumer parses
        for i in st.lost:
            st.progress[i] = rev
        st.lost = []
        st.failure = ""
        if st.first:
            st.first = False
            self.count_sync("snapshots")
            yield st.reported.snapshot(
                {k: Undecoded(functools.partial(self._decode, k), v) for k, v in stored.items()}
            )
            del stored
        else:
            self.count_sync("rereads")
            for kind, now in docs.items():
                yield from st.reported.changes(kind, now)
        # the documents are the consumer's now: not held while the watch runs
        del docs
        return "read"

    def _sync_watch(self, st: _Sync, stop: threading.Event) -> Generator[SyncEvent, None, bool]:
        """Watch every range from the revision after the last it delivered, until the
        stream breaks (resumed by the next call) or the history it needs is compacted
        (``st.lost`` then says what to read again); False when the sync is to end."""
        resumed = st.broken
        created = 0
        watch = self.watcher.watch_ranges(
            [(start, end, st.progress[i] + 1) for i, (start, end) in enumerate(st.ranges)],
            stop,
            deadline=self._deadline(),
            progress_notify=True,
        )
        try:
            for resp in watch:
                i = resp.index
                if resp.canceled:
                    self._compacted(st, resp)
                    break
                if resp.created:
                    created += 1
                    if created == len(st.ranges):  # every stream is running
                        st.pause = RETRY_PAUSE[0]
                        st.failure = ""
                        if resumed:
                            resumed = st.broken = False
                            self.count_sync("resumes")
                    continue
                if not resp.events:  # a progress notification
                    st.progress[i] = max(st.progress[i], resp.revision)
                    continue
                for ev in resp.events:
                    st.progress[i] = max(st.progress[i], ev.kv.mod_revision)
                    found = self._classify(st.prefixes, ev.kv, deleted=ev.type == "DELETE")
                    event = None if found is None else st.reported.change(*found)
                    if event is not None:
                        yield event
        except EtcdCancelled:
            return False
        except EtcdError as e:
            if stop.is_set():
                return False
            st.broken = True
            st.failure = note_failure(st.failure, f"sync watch: {self._error(e)} (resuming)")
            stop.wait(jittered(st.pause))
            st.pause = min(st.pause * 2, RETRY_PAUSE[1])
        finally:
            watch.close()
        return True

    def _compacted(self, st: _Sync, resp: WatchResponse) -> None:
        """A cancelled watch: etcd keeps no revision before ``compact_revision``, so every
        range that has not delivered up to there must be read again; with no compaction
        named, an error."""
        if not resp.compact_revision:
            why = resp.reason or "no reason given"
            raise EtcdUnavailable(self.endpoints, f"watch cancelled ({why})")
        compacted = resp.compact_revision
        st.lost = [j for j, p in enumerate(st.progress) if j == resp.index or p + 1 < compacted]
        log_warning(
            "sync of %s: history compacted up to %d; reading %s again",
            self.prefix + "/",
            compacted,
            ", ".join("+".join(st.groups[j]) for j in st.lost),
        )
        st.jitter = True
        if st.broken and len(st.lost) < len(st.ranges):
            # the stream broke, and the cancel came before every range's stream was created:
            # the ranges not lost resume where they were (counted here, or never)
            self.count_sync("resumes")
        st.broken = False

    def _read_ranges(
        self, ranges: builtins.list[tuple[bytes, bytes]], stop: threading.Event
    ) -> tuple[builtins.list[KeyValue], int]:
        """Every key of ``ranges`` at one revision (the later ranges pinned to the first
        one's; read again from the start if that is compacted meanwhile)."""
        deadline = self._deadline()
        while True:
            kvs: list[KeyValue] = []
            rev = 0
            try:
                for start, end in ranges:
                    got, rev = self._pages(start, end, rev, deadline, cancel=stop)
                    kvs += got
            except EtcdCompacted:
                continue
            return kvs, rev

    def _classify(
        self, prefixes: builtins.list[tuple[str, bytes]], kv: KeyValue, *, deleted: bool = False
    ) -> tuple[str, str, Doc | None] | None:
        """(kind, key, doc) of a watched key; doc None for a deletion or a bad value."""
        for kind, p in prefixes:
            if kv.key.startswith(p) and len(kv.key) > len(p):
                key = self._key_of(kind, kv.key)
                if deleted:
                    return kind, key, None
                try:
                    return kind, key, Doc(self._decode(kind, key, kv.value), kv.mod_revision)
                except StoreCorrupt as e:
                    log_warning("sync: left out %s", e)
                    return kind, key, None
        return None


def _current(responses: builtins.list[JSON]) -> KeyValue | None:
    """The key value read by a failed txn's ``op_get`` branch."""
    kvs = responses[0].get("response_range", {}).get("kvs", ()) if responses else ()
    return kv_from_json(kvs[0]) if kvs else None


def _applied(w: Write, lease: int, kv: KeyValue | None) -> int | None:
    """The write's revision if what etcd holds now is exactly what it wrote (a put key holds
    the value written, with the lease written; a deleted key is gone)."""
    if w.value is None:
        return None if kv is not None else 0
    if kv is None or kv.value != w.value or kv.lease != lease:
        return None
    return kv.mod_revision
