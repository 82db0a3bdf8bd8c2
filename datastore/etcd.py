"""The etcd v3 store (cluster mode): every document one key under ``etcd_prefix``.

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

A value is the document's JSON (UTF-8), nothing else; its revision is the key's
``mod_revision``. Mapping of the contract:

- ``put(None)``: txn comparing ``create_revision == 0``; ``put(rev)``/``delete(rev)``: txn
  comparing ``mod_revision == rev``. A failed compare answers with the key's current value
  (the txn's failure branch), so a conflict costs no extra round trip and a conflict with a
  value that is not JSON is reported as ``StoreCorrupt``.
- ``commit``: one txn (etcd allows at most 128 ops in one: more is ``InvalidConfig``).
- ``list``/``list_keys``/``sync``'s snapshot: one range (pages of 1000 keys, all read at the
  first page's revision, so still one consistent view).
- ``put(ttl=s)``: a new lease of ``ceil(s)`` seconds (at least 1; etcd may round a very short
  ttl up to its minimum) is granted, then the txn puts with it. A write without ttl detaches
  the key from its lease. An unused lease (a lost CAS) just expires.
- ``sync``: one range over the smallest key range holding every wanted kind, then one watch
  from the next revision (events of other kinds in that range are dropped). A broken stream,
  a compaction, or a member that loses its leader gives a fresh snapshot.
- ``lock``: node-local only (a thread lock + flock on ``<lock_dir>/etcd-<hash>.lock``, the
  hash over the sorted endpoints, the prefix, and the inode of the process's network
  namespace). Correctness across nodes rests on the compare-and-swap of every write.
- ``check_usable``: one linearizable read of one key.
- A write retried after an attempt with an unknown outcome (connection lost after sending,
  "request timed out"), whose compare then fails, is checked against the current values: if
  every put key holds exactly the value written and every deleted key is gone, it succeeded
  (``stats["resolved"]``); otherwise the outcome stays unknown and it raises
  ``StoreUnavailable``, never ``RevisionConflict`` (``stats["unknown"]``).
- Unreachable endpoints or no quorum: ``StoreUnavailable`` naming the endpoints, after at
  most ``lock_timeout`` seconds per operation.
"""

from __future__ import annotations

import binascii
import builtins
import errno
import fcntl
import json
import math
import os
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from datastore.base import (
    KINDS,
    Doc,
    Op,
    SyncEvent,
    check_key,
    check_kind,
    check_ops,
    check_ttl,
    sync_kinds,
)
from datastore.errors import (
    InvalidConfig,
    LockTimeout,
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

LAYOUT = {
    "pool": "ipam/v1/pools/",
    "block": "ipam/v1/blocks/",
    "handle": "ipam/v1/handles/",
    "affinity": "ipam/v1/affinities/",
    "node": "resources/v1/nodes/",
    "bgpconfiguration": "resources/v1/bgpconfigurations/",
    "bgppeer": "resources/v1/bgppeers/",
    "networkpolicy": "resources/v1/networkpolicies/",
    "namespace": "resources/v1/namespaces/",
    "pod": "resources/v1/pods/",
    "workloadendpoint": "resources/v1/workloadendpoints/",
    "heartbeat": "heartbeats/",
}
DEFAULT_PREFIX = "/tabby"
DEFAULT_LOCK_DIR = "/run/tabby/locks"
MAX_TXN_OPS = 128  # etcd's --max-txn-ops default
PAGE = 1000
RETRY_PAUSE = (0.2, 2.0)  # sync: first and longest pause before a new snapshot after a failure
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC


def _log_warning(msg: str, *args: object) -> None:
    import logging  # only on unusual paths: logging costs ~4 ms of start-up

    logging.getLogger("tabby.ipam").warning(msg, *args)


def _netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0


class _EtcdLock:
    def __init__(self, store: EtcdStore) -> None:
        self._store = store
        self._fd: int | None = None
        self._plock: threading.Lock | None = None

    def __enter__(self) -> None:
        store = self._store
        held = store._held
        if getattr(held, "on", False):
            raise RuntimeError("EtcdStore.lock() is not re-entrant")
        path = store.lock_path
        deadline = time.monotonic() + store.lock_timeout
        plock = _process_lock(path)
        if not plock.acquire(timeout=store.lock_timeout):
            raise LockTimeout(path, f"held by another call for more than {store.lock_timeout} s")
        try:
            fd = _open_lock_file(store.lock_dir, path)
            delay = 0.001
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    now = time.monotonic()
                    if now >= deadline:
                        os.close(fd)
                        raise LockTimeout(
                            path, f"held by another process for more than {store.lock_timeout} s"
                        ) from None
                    time.sleep(min(delay, deadline - now))
                    delay = min(delay * 2, 0.005)
                except OSError as e:
                    os.close(fd)
                    raise StoreUnavailable(path, e.strerror or str(e)) from None
        except BaseException:
            plock.release()
            raise
        self._fd = fd
        self._plock = plock
        held.on = True

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._store._held.on = False
        fd, self._fd = self._fd, None
        plock, self._plock = self._plock, None
        try:
            if fd is not None:
                os.close(fd)  # drops the flock
        finally:
            if plock is not None:
                plock.release()


def _open_lock_file(directory: str, path: str) -> int:
    try:
        os.makedirs(directory, mode=0o700, exist_ok=True)
        return os.open(path, _LOCK_FLAGS, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise StoreCorrupt(path, "is a symlink (refused)") from None
        raise StoreUnavailable(path, e.strerror or str(e)) from None


class EtcdStore:
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
        return self._kp[kind] + key.encode("utf-8", "surrogateescape")

    def location(self, kind: str, key: str) -> str:
        return "etcd:" + self.raw_key(kind, key).decode("utf-8", "replace")

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
        try:
            data = json.loads(value)
        except ValueError:  # includes UnicodeDecodeError
            reason = "empty value" if not value else f"not JSON ({len(value)} bytes)"
            raise StoreCorrupt(self.location(kind, key), reason) from None
        if not isinstance(data, dict):
            raise StoreCorrupt(self.location(kind, key), "not a JSON object")
        return data

    def _key_of(self, kind: str, raw: bytes) -> str:
        return raw[len(self._kp[kind]) :].decode("utf-8", "surrogateescape")

    # -- reads --------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Doc | None:
        k = self.raw_key(kind, key)
        try:
            result = self.client.range(k, deadline=self._deadline())
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

    def list_keys(self, kind: str) -> builtins.list[str]:
        check_kind(kind)
        start = self._kp[kind]
        try:
            kvs, _ = self._range_all(start, prefix_end(start), self._deadline(), keys_only=True)
        except EtcdError as e:
            raise self._error(e) from None
        return [self._key_of(kind, kv.key) for kv in kvs]

    def list(self, kind: str, prefix: str = "") -> builtins.list[tuple[str, Doc]]:
        check_kind(kind)
        start = self._kp[kind] + prefix.encode("utf-8", "surrogateescape")
        try:
            kvs, _ = self._range_all(start, prefix_end(start), self._deadline())
        except EtcdError as e:
            raise self._error(e) from None
        out = []
        for kv in kvs:
            key = self._key_of(kind, kv.key)
            out.append((key, Doc(self._decode(kind, key, kv.value), kv.mod_revision)))
        return out

    # -- writes -------------------------------------------------------------------------

    def put(
        self,
        kind: str,
        key: str,
        data: dict[str, Any],
        expected_revision: int | None,
        *,
        ttl: float | None = None,
    ) -> int:
        k = self.raw_key(kind, key)
        check_ttl(ttl)
        value = _encode(data)
        deadline = self._deadline()
        try:
            lease = 0
            if ttl is not None:
                lease, _ = self.client.lease_grant(max(1, math.ceil(ttl)), deadline=deadline)
            compare = cmp_absent(k) if expected_revision is None else cmp_mod(k, expected_revision)
            result = self.client.txn(
                [compare], [op_put(k, value, lease)], [op_get(k)], deadline=deadline
            )
        except EtcdError as e:
            raise self._error(e) from None
        self._count("txns")
        if result.succeeded:
            return result.revision
        current = _current(result.responses)[0]
        if result.ambiguous:
            if current is not None and current.value == value and current.lease == lease:
                self._count("resolved")
                return current.mod_revision
            raise self._unknown(kind, key)
        raise self._conflict(kind, key, current, expected_revision)

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        k = self.raw_key(kind, key)
        try:
            result = self.client.txn(
                [cmp_mod(k, expected_revision)],
                [op_delete(k)],
                [op_get(k)],
                deadline=self._deadline(),
            )
        except EtcdError as e:
            raise self._error(e) from None
        self._count("txns")
        if result.succeeded:
            return
        current = _current(result.responses)[0]
        if result.ambiguous:
            if current is None:
                self._count("resolved")
                return
            raise self._unknown(kind, key)
        raise self._conflict(kind, key, current, expected_revision)

    def commit(self, ops: Sequence[Op]) -> builtins.list[int]:
        check_ops(ops)
        if not ops:
            return []
        if len(ops) > MAX_TXN_OPS:
            raise InvalidConfig(
                "too many writes for one etcd transaction", f"{len(ops)} > {MAX_TXN_OPS}"
            )
        keys = [self.raw_key(op.kind, op.key) for op in ops]
        values = [None if op.data is None else _encode(op.data) for op in ops]
        compare = []
        success = []
        for op, k, value in zip(ops, keys, values, strict=True):
            if op.expected_revision is None:
                compare.append(cmp_absent(k))
            else:
                compare.append(cmp_mod(k, op.expected_revision))
            if value is not None:
                success.append(op_put(k, value))
            elif op.expected_revision is not None:
                success.append(op_delete(k))
        try:
            result = self.client.txn(
                compare, success, [op_get(k) for k in keys], deadline=self._deadline()
            )
        except EtcdError as e:
            raise self._error(e) from None
        self._count("txns")
        if result.succeeded:
            return [0 if v is None else result.revision for v in values]
        current = _current(result.responses)
        if result.ambiguous:
            revs = _applied(values, current)
            if revs is not None:
                self._count("resolved")
                return revs
            raise self._unknown(ops[0].kind, ops[0].key)
        for op, kv in zip(ops, current, strict=True):
            if kv is not None:
                self._decode(op.kind, op.key, kv.value)  # StoreCorrupt for a bad value
        for op, kv in zip(ops, current, strict=True):
            actual = None if kv is None else kv.mod_revision
            if actual != op.expected_revision:
                raise self._conflict(op.kind, op.key, kv, op.expected_revision)
        raise self._conflict(ops[0].kind, ops[0].key, current[0], ops[0].expected_revision)

    def _unknown(self, kind: str, key: str) -> StoreUnavailable:
        """A retried write whose compare failed, and etcd does not hold what it wrote: the
        first attempt may have been applied and then overwritten, or never applied. Not a
        RevisionConflict (that promises nothing was written): the caller gives up and its
        caller retries the whole operation (the allocator's operations are idempotent)."""
        self._count("unknown")
        return StoreUnavailable(
            ", ".join(self.endpoints),
            f"outcome of the write of {self.location(kind, key)} unknown "
            "(etcd failed while it was in flight)",
        )

    def _conflict(
        self, kind: str, key: str, current: KeyValue | None, expected: int | None
    ) -> RevisionConflict:
        self._count("conflicts")
        where = self.location(kind, key)
        if current is not None:
            self._decode(kind, key, current.value)  # a conflict with garbage: StoreCorrupt
        if expected is None:
            return RevisionConflict("document already exists", where)
        if current is None:
            return RevisionConflict("document vanished", where)
        return RevisionConflict(
            "document changed", f"{where}: revision {current.mod_revision}, expected {expected}"
        )

    # -- lock, health, life cycle -------------------------------------------------------

    def lock(self) -> _EtcdLock:
        return _EtcdLock(self)

    def check_usable(self) -> None:
        """One linearizable read (it needs a leader and a quorum)."""
        try:
            self.client.range(self.prefix.encode() + b"/", deadline=self._deadline())
        except EtcdError as e:
            raise self._error(e) from None

    def close(self) -> None:
        self.client.close()

    # -- sync ---------------------------------------------------------------------------

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        wanted = sync_kinds(kinds)
        return self._sync(wanted, stop)

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        prefixes = [(kind, self._kp[kind]) for kind in kinds]
        start = min(p for _, p in prefixes)
        end = max(prefix_end(p) for _, p in prefixes)
        known: dict[str, set[str]] = {}
        pause = RETRY_PAUSE[0]
        failure = ""
        while not stop.is_set():
            try:
                kvs, rev = self._range_all(start, end, self._deadline(), cancel=stop)
            except EtcdCancelled:
                break
            except EtcdError as e:
                failure = _note_failure(failure, f"sync snapshot: {self._error(e)}")
                stop.wait(pause)
                pause = min(pause * 2, RETRY_PAUSE[1])
                continue
            snapshot: dict[str, dict[str, Doc]] = {kind: {} for kind in kinds}
            for kv in kvs:
                found = self._classify(prefixes, kv)
                if found is not None and found[2] is not None:
                    snapshot[found[0]][found[1]] = found[2]
            known = {kind: set(docs) for kind, docs in snapshot.items()}
            yield SyncEvent("snapshot", "", "", None, snapshot)
            failure = ""
            try:
                for resp in self.client.watch(start, end, rev + 1, stop, deadline=self._deadline()):
                    if resp.canceled:
                        if resp.compact_revision:
                            reason = f"history compacted up to {resp.compact_revision}"
                        else:
                            reason = resp.reason or "cancelled by etcd"
                        _log_warning("sync of %s: watch ended (%s); reading again", start, reason)
                        break
                    pause = RETRY_PAUSE[0]
                    for ev in resp.events:
                        found = self._classify(prefixes, ev.kv, deleted=ev.type == "DELETE")
                        if found is None:
                            continue
                        kind, key, doc = found
                        if doc is None:
                            if key in known[kind]:
                                known[kind].discard(key)
                                yield SyncEvent("delete", kind, key, None, None)
                        else:
                            known[kind].add(key)
                            yield SyncEvent("put", kind, key, doc, None)
            except EtcdCancelled:
                break
            except EtcdError as e:
                if stop.is_set():
                    break
                failure = _note_failure(failure, f"sync watch: {self._error(e)}")
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
                    _log_warning("sync: left out %s", e)
                    return kind, key, None
        return None


def _note_failure(previous: str, message: str) -> str:
    if message != previous:
        _log_warning("%s (retrying)", message)
    return message


def _encode(data: dict[str, Any]) -> bytes:
    if not isinstance(data, dict):
        raise TypeError(f"document data must be a dict, not {type(data).__name__}")
    return json.dumps(data, separators=(",", ":"), allow_nan=False).encode()


def _current(responses: builtins.list[dict[str, Any]]) -> builtins.list[KeyValue | None]:
    """The key values read by a failed txn's ``op_get`` branch, in order."""
    out: list[KeyValue | None] = []
    for resp in responses:
        kvs = resp.get("response_range", {}).get("kvs", ())
        out.append(kv_from_json(kvs[0]) if kvs else None)
    return out


def _applied(
    values: builtins.list[bytes | None], current: builtins.list[KeyValue | None]
) -> builtins.list[int] | None:
    """The revisions of a commit if what etcd holds now is exactly what it wrote."""
    revs = []
    for value, kv in zip(values, current, strict=True):
        if value is None:
            if kv is not None:
                return None
            revs.append(0)
        elif kv is None or kv.value != value:
            return None
        else:
            revs.append(kv.mod_revision)
    return revs


_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


def _process_lock(path: str) -> threading.Lock:
    with _process_locks_guard:
        lock = _process_locks.get(path)
        if lock is None:
            lock = _process_locks[path] = threading.Lock()
        return lock
