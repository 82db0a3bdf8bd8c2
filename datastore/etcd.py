"""The etcd v3 store (cluster mode): every document one key under ``etcd_prefix``.

What is common to every store (argument checks, encoding, the compare-and-swap rule and its
errors, listing order, the lock session, sync bookkeeping) is ``datastore.engine``; this
module keeps keys, txns, leases and the watch.

Key layout (``<p>`` = the prefix without a trailing ``/``, default ``/tabby``; a document's
key is appended as is, UTF-8)::

    <p>/heartbeats/<node>                        kind "heartbeat" (written with a ttl: a lease)
    <p>/ipam/v1/affinities/<node>                kind "affinity"
    <p>/ipam/v1/blocks/<block cidr>              kind "block"      e.g. .../blocks/10.244.0.64/26
    <p>/ipam/v1/handles/<net>:<cid>:<ifname>     kind "handle"
    <p>/ipam/v1/pools/<pool cidr>                kind "pool"
    <p>/resources/v1/<plural>/<key>              nodes, bgpconfigurations, bgppeers,
                                                 networkpolicies, namespaces, pods,
                                                 workloadendpoints (key "<ns>/<name>" or name)
    <p>/traces/<id>[.<node>]                     kind "trace" (with a ttl): policy trace requests
                                                 and their results

A value is the document's JSON (UTF-8), nothing else; its revision is the key's
``mod_revision``. Mapping of the contract:

- ``put``, ``delete`` and ``commit`` are one txn each: an expected revision None compares
  ``create_revision == 0``, ``rev`` compares ``mod_revision == rev``. A failed compare
  answers with the keys' current values (the txn's failure branch), so a conflict costs no
  extra round trip, its ``RevisionConflict`` is the engine's, and a conflict with a value
  that is not JSON is reported as ``StoreCorrupt``. etcd allows at most 128 ops in one txn:
  a bigger ``commit`` is ``InvalidConfig``.
- ``list``/``list_keys``/``sync``'s snapshot: one range (pages of 1000 keys, all read at the
  first page's revision, so still one consistent view).
- ``put(ttl=s)``: a new lease of ``ceil(s)`` seconds (at least 1; etcd may round a very short
  ttl up to its minimum) is granted, then the txn puts with it. A write without ttl detaches
  the key from its lease. An unused lease (a lost CAS) just expires.
- ``sync``: one range over the smallest key range holding every wanted kind, then one watch
  from the next revision (events of other kinds in that range are dropped). A broken stream,
  a compaction, or a member that loses its leader gives a fresh snapshot.
- ``lock``: node-local only (the engine's session: the process's thread lock for, then
  flock on, ``<lock_dir>/etcd-<hash>.lock``, the hash over the sorted endpoints, the prefix,
  and the inode of the process's network namespace). One object may serve many threads, a
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
import math
import os
import threading
import time
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from datastore.base import (
    IPAM_KINDS,
    KINDS,
    RESOURCE_KINDS,
    Doc,
    SyncEvent,
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
from datastore.etcd_client import (
    EtcdCancelled,
    EtcdClient,
    EtcdCompacted,
    EtcdConfigError,
    EtcdError,
    EtcdRequestError,
    EtcdUnavailable,
    KeyValue,
    cmp_absent,
    cmp_mod,
    kv_from_json,
    op_delete,
    op_get,
    op_put,
    prefix_end,
)

if TYPE_CHECKING:
    from datastore.base import StoreSettings

_GROUPS = {
    **dict.fromkeys(IPAM_KINDS, "ipam/v1/"),
    **dict.fromkeys(RESOURCE_KINDS, "resources/v1/"),
    "heartbeat": "",
    "trace": "",
}
#: kind -> key prefix below ``<p>/`` (see the module docstring)
LAYOUT = {kind: f"{_GROUPS[kind]}{PLURALS[kind]}/" for kind in KINDS}
DEFAULT_PREFIX = "/tabby"
DEFAULT_LOCK_DIR = "/run/tabby/locks"
MAX_TXN_OPS = 128  # etcd's --max-txn-ops default
PAGE = 1000
RETRY_PAUSE = (0.2, 2.0)  # sync: first and longest pause before a new snapshot after a failure


def _netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


class EtcdStore(Engine):
    """Store over etcd v3 (see the module docstring). Thread-safe: one object may serve
    many threads (each gets its own keep-alive connection)."""

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
    ) -> None:
        self.lock_timeout = float(lock_timeout)
        try:
            self.client = EtcdClient(
                endpoints,
                timeout=self.lock_timeout,
                ca_file=ca_file,
                cert_file=cert_file,
                key_file=key_file,
            )
        except EtcdConfigError as e:
            raise InvalidConfig("bad etcd settings", str(e)) from None
        self.endpoints = self.client.urls
        self.prefix = prefix.rstrip("/")
        self._kp = {kind: f"{self.prefix}/{LAYOUT[kind]}".encode() for kind in KINDS}
        self.lock_dir = lock_dir or DEFAULT_LOCK_DIR
        ident = "\n".join([*sorted(self.endpoints), self.prefix, str(_netns_inode())])
        raw = ident.encode()  # hashlib would load OpenSSL (~3.5 ms); a name needs no more
        digest = f"{binascii.crc32(raw):08x}{binascii.crc32(raw[::-1]):08x}"
        self.lock_path = os.path.join(self.lock_dir, f"etcd-{digest}.lock")
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
        )

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

    def _decode(self, kind: str, key: str, value: bytes) -> dict[str, Any]:
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
        cancel: threading.Event | None = None,
    ) -> tuple[builtins.list[KeyValue], int]:
        """Every key in [start, end) at one revision (pages pinned to the first one's)."""
        while True:
            out: list[KeyValue] = []
            rev = 0
            key = start
            try:
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
            except EtcdCompacted:
                continue  # compacted between pages: read again at a newer revision

    def _range_kind(
        self, kind: str, prefix: str, *, keys_only: bool = False
    ) -> builtins.list[KeyValue]:
        start = self._kp[kind] + prefix.encode("utf-8", "surrogateescape")
        try:
            kvs, _ = self._range_all(
                start, prefix_end(start), self._deadline(), keys_only=keys_only
            )
        except EtcdError as e:
            raise self._error(e) from None
        return kvs

    def _keys(self, kind: str) -> builtins.list[str]:
        return [self._key_of(kind, kv.key) for kv in self._range_kind(kind, "", keys_only=True)]

    def _items(self, kind: str, prefix: str) -> builtins.list[tuple[str, Doc]]:
        out = []
        for kv in self._range_kind(kind, prefix):
            key = self._key_of(kind, kv.key)
            out.append((key, Doc(self._decode(kind, key, kv.value), kv.mod_revision)))
        return out

    # -- writes: one txn each -----------------------------------------------------------

    def _apply(self, writes: builtins.list[Write]) -> builtins.list[int]:
        """One txn: compare every write's revision, then put (with a new lease for a ttl)
        or delete; a failed compare reads the keys back (the txn's failure branch)."""
        if len(writes) > MAX_TXN_OPS:
            raise InvalidConfig(
                "too many writes for one etcd transaction", f"{len(writes)} > {MAX_TXN_OPS}"
            )
        keys = [self._key(w.kind, w.key) for w in writes]
        deadline = self._deadline()
        try:
            leases = [
                0
                if w.ttl is None
                else self.client.lease_grant(max(1, math.ceil(w.ttl)), deadline=deadline)[0]
                for w in writes
            ]
            compare = []
            success = []
            for w, k, lease in zip(writes, keys, leases, strict=True):
                compare.append(cmp_absent(k) if w.expected is None else cmp_mod(k, w.expected))
                if w.value is not None:
                    success.append(op_put(k, w.value, lease))
                elif w.expected is not None:
                    success.append(op_delete(k))
            result = self.client.txn(compare, success, [op_get(k) for k in keys], deadline=deadline)
        except EtcdError as e:
            raise self._error(e) from None
        self._count("txns")
        if result.succeeded:
            return [0 if w.value is None else result.revision for w in writes]
        current = _current(result.responses)
        if result.ambiguous:
            revs = _applied(writes, leases, current)
            if revs is not None:
                self._count("resolved")
                return revs
            raise self._unknown(writes[0])
        for w, kv in zip(writes, current, strict=True):
            if kv is not None:
                self._decode(w.kind, w.key, kv.value)  # a conflict with garbage: StoreCorrupt
        self._count("conflicts")
        self._compare(writes, [None if kv is None else kv.mod_revision for kv in current])
        raise RevisionConflict("document changed", self.location(writes[0].kind, writes[0].key))

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
        prefixes = [(kind, self._kp[kind]) for kind in kinds]
        start = min(p for _, p in prefixes)
        end = max(prefix_end(p) for _, p in prefixes)
        reported = Reported()
        pause = RETRY_PAUSE[0]
        failure = ""
        while not stop.is_set():
            try:
                kvs, rev = self._range_all(start, end, self._deadline(), cancel=stop)
            except EtcdCancelled:
                break
            except EtcdError as e:
                failure = note_failure(failure, f"sync snapshot: {self._error(e)} (retrying)")
                stop.wait(pause)
                pause = min(pause * 2, RETRY_PAUSE[1])
                continue
            snapshot: dict[str, dict[str, Doc]] = {kind: {} for kind in kinds}
            for kv in kvs:
                found = self._classify(prefixes, kv)
                if found is not None and found[2] is not None:
                    snapshot[found[0]][found[1]] = found[2]
            yield reported.snapshot(snapshot)
            failure = ""
            try:
                for resp in self.client.watch(start, end, rev + 1, stop, deadline=self._deadline()):
                    if resp.canceled:
                        if resp.compact_revision:
                            reason = f"history compacted up to {resp.compact_revision}"
                        else:
                            reason = resp.reason or "cancelled by etcd"
                        log_warning("sync of %s: watch ended (%s); reading again", start, reason)
                        break
                    pause = RETRY_PAUSE[0]
                    for ev in resp.events:
                        found = self._classify(prefixes, ev.kv, deleted=ev.type == "DELETE")
                        event = None if found is None else reported.change(*found)
                        if event is not None:
                            yield event
            except EtcdCancelled:
                break
            except EtcdError as e:
                if stop.is_set():
                    break
                failure = note_failure(failure, f"sync watch: {self._error(e)} (retrying)")
                stop.wait(pause)
                pause = min(pause * 2, RETRY_PAUSE[1])

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


def _current(responses: builtins.list[dict[str, Any]]) -> builtins.list[KeyValue | None]:
    """The key values read by a failed txn's ``op_get`` branch, in order."""
    out: list[KeyValue | None] = []
    for resp in responses:
        kvs = resp.get("response_range", {}).get("kvs", ())
        out.append(kv_from_json(kvs[0]) if kvs else None)
    return out


def _applied(
    writes: builtins.list[Write],
    leases: builtins.list[int],
    current: builtins.list[KeyValue | None],
) -> builtins.list[int] | None:
    """The revisions of the writes if what etcd holds now is exactly what they wrote (each
    put key holds the value written, with the lease written; each deleted key is gone)."""
    revs = []
    for w, lease, kv in zip(writes, leases, current, strict=True):
        if w.value is None:
            if kv is not None:
                return None
            revs.append(0)
        elif kv is None or kv.value != w.value or kv.lease != lease:
            return None
        else:
            revs.append(kv.mod_revision)
    return revs
