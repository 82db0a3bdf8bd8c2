"""The store engine: what the memory, file and etcd stores share, written once.

Each store subclasses ``Engine``, which implements the ``Store`` protocol (``base``) and leaves
to the store only its storage. ``Engine`` does:

- the argument checks of every call (kinds, keys, ttl), before the store runs;
- the encoding of documents: ``encode`` (compact JSON, no NaN; ``TypeError`` for data that is
  not a dict) and ``loads`` (JSON or ``StoreCorrupt`` naming the document);
- the writes: ``put``, ``put_leased`` and ``delete`` become one ``Write`` (encoded once), which
  the store applies in its ``_apply``; ``_compare`` is the one compare-and-swap rule and
  ``conflict`` its ``RevisionConflict`` messages, used by the stores that compare themselves
  (memory, file) and by etcd to explain a txn whose compare failed;
- the listing order: ``list_keys`` and ``list`` are sorted here;
- ``lock()``: a ``StoreLock`` session: first a thread lock (the one this process keeps for
  the store's lock file, so the threads of tabby-node wake as soon as it is free instead of
  polling; the memory store's own), then ``flock(2)`` on the lock file (file, etcd), polled
  until the same deadline; ``RuntimeError`` for a thread that takes it again while it holds
  it (file, etcd; the memory store's second take waits and times out);
- the bookkeeping of ``sync``: ``Reported`` (the documents an iterator has reported, and the
  events that bring a consumer from there to the store's state: after a re-read only the
  differences), ``note_failure`` (a failure logged once, not at every retry), and the
  ``sync_stats`` counters (``count_sync``).

What a store supplies (each documented where it is defined below): ``location``, ``_get``,
``_keys``, ``_items``, ``_apply``, ``_sync``, ``check_usable``; for its lock ``lock_path``,
``_held`` (a ``threading.local`` to refuse re-entry, or None), and optionally
``_thread_lock``, ``_open_lock_file``, ``_locked``, ``_unlocking``; ``_keepalive`` for leases;
``close`` when it has something to add. Its ``__init__`` calls ``Engine.__init__``.

This module is imported by every store, so by every CNI call: no ``logging`` at import
(``log_warning`` imports it when a warning is due), no NamedTuple or dataclass.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fcntl
import json
import os
import threading
import time
from typing import TYPE_CHECKING

from datastore.base import (
    Doc,
    SyncEvent,
    Undecoded,
    check_key,
    check_kind,
    check_ttl,
    sync_kinds,
)
from datastore.errors import (
    LockTimeout,
    RevisionConflict,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
)

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping
    from types import TracebackType

    from bundle.types import JSON
    from datastore.base import Leases

#: The plural of each kind: the file store's directories, the last step of etcd's prefixes.
PLURALS = {
    "pool": "pools",
    "block": "blocks",
    "handle": "handles",
    "affinity": "affinities",
    "node": "nodes",
    "bgpconfiguration": "bgpconfigurations",
    "bgppeer": "bgppeers",
    "networkpolicy": "networkpolicies",
    "namespace": "namespaces",
    "serviceaccount": "serviceaccounts",
    "pod": "pods",
    "workloadendpoint": "workloadendpoints",
    "calico-networkpolicy": "calico-networkpolicies",
    "globalnetworkpolicy": "globalnetworkpolicies",
    "stagednetworkpolicy": "stagednetworkpolicies",
    "stagedglobalnetworkpolicy": "stagedglobalnetworkpolicies",
    "stagedkubernetesnetworkpolicy": "stagedkubernetesnetworkpolicies",
    "tier": "tiers",
    "networkset": "networksets",
    "globalnetworkset": "globalnetworksets",
    "hostendpoint": "hostendpoints",
    "heartbeat": "heartbeats",
    "trace": "traces",
}
LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_SEPARATORS = (",", ":")


def log_warning(msg: str, *args: object) -> None:
    import logging  # only on unusual paths: logging costs ~4 ms of start-up

    logging.getLogger("tabby.ipam").warning(msg, *args)


def reason(e: OSError) -> str:
    return e.strerror or str(e)


def refused(path: str, e: OSError) -> StoreError:
    """A lock file (or its directory) that cannot be opened: ``StoreCorrupt`` for a symlink
    (never followed), ``StoreUnavailable`` otherwise."""
    if e.errno == errno.ELOOP:  # O_NOFOLLOW met a symlink
        return StoreCorrupt(path, "is a symlink (refused)")
    return StoreUnavailable(path, reason(e))


# == documents ===========================================================================


def encode(data: JSON) -> bytes:
    """A document's data as stored: compact JSON (``TypeError``/``ValueError`` for data that
    is not a JSON object: a programming error)."""
    if not isinstance(data, dict):
        raise TypeError(f"document data must be a dict, not {type(data).__name__}")
    return json.dumps(data, separators=_SEPARATORS, allow_nan=False).encode()


def loads(where: str, raw: bytes, *, empty: str, garbage: str) -> object:
    """``raw`` parsed, or ``StoreCorrupt(where, ...)``: ``empty`` when there are no bytes,
    ``"<garbage> (<n> bytes)"`` when they are not JSON (or not UTF-8)."""
    try:
        return json.loads(raw)
    except ValueError:  # includes UnicodeDecodeError
        raise StoreCorrupt(where, empty if not raw else f"{garbage} ({len(raw)} bytes)") from None
    except RecursionError:  # nested past the parser's stack: no document tabby wrote
        raise StoreCorrupt(where, f"{garbage} (nested too deeply, {len(raw)} bytes)") from None


class Write:
    """One change of a ``put``, ``put_leased`` or ``delete``: compare ``expected`` (None: the
    document must not exist), then store ``value`` (the encoded data; None deletes) with
    ``ttl`` (``put_leased``)."""

    __slots__ = ("expected", "key", "kind", "ttl", "value")

    def __init__(
        self,
        kind: str,
        key: str,
        value: bytes | None,
        expected: int | None,
        ttl: float | None = None,
    ) -> None:
        self.kind = kind
        self.key = key
        self.value = value
        self.expected = expected
        self.ttl = ttl


def conflict(where: str, current: int | None, expected: int | None) -> RevisionConflict:
    """The error of a compare-and-swap that found revision ``current`` (None: no document)
    where the write expected ``expected`` (None: no document)."""
    if expected is None:
        return RevisionConflict("document already exists", where)
    if current is None:
        return RevisionConflict("document vanished", where)
    return RevisionConflict("document changed", f"{where}: revision {current}, expected {expected}")


def _by_key(item: tuple[str, Doc]) -> str:
    return item[0]


# == lock ================================================================================


_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


def process_lock(path: str) -> threading.Lock:
    """The thread lock every store object of this process uses for the lock file ``path``."""
    with _process_locks_guard:
        lock = _process_locks.get(path)
        if lock is None:
            lock = _process_locks[path] = threading.Lock()
        return lock


def _flock(fd: int, path: str, deadline: float, timeout: float) -> None:
    """flock(2) ``fd``, polled (1 ms, doubling to 5 ms) until ``deadline``; on failure the
    fd is closed."""
    delay = 0.001
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            now = time.monotonic()
            if now >= deadline:
                os.close(fd)
                raise LockTimeout(
                    path, f"held by another process for more than {timeout} s"
                ) from None
            time.sleep(min(delay, deadline - now))
            delay = min(delay * 2, 0.005)
        except OSError as e:
            os.close(fd)
            raise StoreUnavailable(path, reason(e)) from None


def _names(path: str, fd: int) -> bool:
    """Whether ``path`` is the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


class StoreLock:
    """One ``lock()`` session (a context manager): the thread lock, the lock file's fd (None
    without a lock file), and ``dirty`` and ``deferred`` for the store's own use (the file
    store: "this session wrote"; the kinds whose directory a ``write_batch`` syncs at its
    end)."""

    __slots__ = ("deferred", "dirty", "fd", "store", "thread_lock")

    def __init__(self, store: Engine) -> None:
        self.store = store
        self.fd: int | None = None
        self.thread_lock: threading.Lock | None = None
        self.dirty = False
        self.deferred: set[str] | None = None

    def __enter__(self) -> None:
        self.store._acquire(self)

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.store._release(self)


# == sync ================================================================================


class Reported:
    """What one ``sync`` iterator has reported: the revision of each document of each
    watched kind, as its consumer holds them. It turns what the store sees into the events
    to yield. Only revisions are kept: the documents are the consumer's (an iterator
    that kept them too would hold a second copy of the whole watched datastore for as
    long as it runs: ~6 KB per endpoint of a cluster's pods)."""

    __slots__ = ("docs",)

    def __init__(self) -> None:
        #: kind -> key -> revision reported
        self.docs: dict[str, dict[str, int]] = {}

    def snapshot(self, docs: Mapping[str, dict[str, Doc] | Undecoded]) -> SyncEvent:
        """A ``"snapshot"`` of ``docs`` (every watched kind, by kind then key); the consumer
        gets them (the caller does not keep ``docs``)."""
        self.docs = {kind: _revisions(d) for kind, d in docs.items()}
        return SyncEvent("snapshot", "", "", None, docs)

    def change(self, kind: str, key: str, doc: Doc | None) -> SyncEvent | None:
        """A ``"put"`` of ``doc``, or for None (deleted, or now unreadable) a ``"delete"``
        if the consumer holds the document (else nothing)."""
        if doc is not None:
            self.docs[kind][key] = doc.revision
            return SyncEvent("put", kind, key, doc, None)
        if self.docs[kind].pop(key, None) is None:
            return None
        return SyncEvent("delete", kind, key, None, None)

    def changes(self, kind: str, docs: dict[str, Doc]) -> builtins.list[SyncEvent]:
        """The events from the documents of ``kind`` reported to ``docs``: deletions, then
        new and changed documents (a new revision), each in key order."""
        old = self.docs[kind]
        events = [SyncEvent("delete", kind, key, None, None) for key in sorted(old.keys() - docs)]
        for key in sorted(docs):
            if old.get(key) != docs[key].revision:
                events.append(SyncEvent("put", kind, key, docs[key], None))
        self.docs[kind] = _revisions(docs)
        return events


def _revisions(docs: dict[str, Doc] | Undecoded) -> dict[str, int]:
    if isinstance(docs, Undecoded):
        return docs.revisions()  # without decoding them
    return {key: doc.revision for key, doc in docs.items()}


#: ``Engine.sync_stats``: how the store's ``sync`` iterators got their documents.
#: snapshots: first reads (one per ``sync`` call that got that far);
#: rereads: reads again because the store could not say what changed (etcd's history
#: compacted, a failed poll of the file store, the memory store's ``resync``), each
#: followed by only the differences;
#: resumes: etcd watches opened again after a break, every range from where it had got
#: to, nothing read again (a range whose history turns out compacted is then a re-read).
SYNC_STATS = ("snapshots", "rereads", "resumes")


def note_failure(previous: str, message: str) -> str:
    """Log ``message`` unless it is the failure logged last (``previous``); returns it, to
    pass as ``previous`` next time (``""`` after a success)."""
    if message != previous:
        log_warning("%s", message)
    return message


# == the engine ==========================================================================


class Engine:
    """The ``Store`` protocol over a store's primitives (see the module docstring)."""

    lock_timeout: float
    #: where the lock lives: the lock file (its thread lock's key), or a name; LockTimeout's path
    lock_path: str
    #: per thread: the ``StoreLock`` it holds (``lock`` attribute); None: re-entry not refused
    _held: threading.local | None = None
    #: The lock file exists only while held: the holder unlinks it before it lets go, and a
    #: waiter that then gets the flock of the unlinked file opens the path again. For lock
    #: files named after settings (etcd: endpoints, prefix, network namespace), which would
    #: otherwise pile up in the lock directory forever.
    _ephemeral_lock_file = False

    def __init__(self) -> None:
        self._sync_guard = threading.Lock()
        self._sync_counts = dict.fromkeys(SYNC_STATS, 0)
        self._requests_guard = threading.Lock()
        #: (op, kind) -> the calls made of this store: op ``get``, ``list`` (``list`` and
        #: ``list_keys``), ``put`` or ``delete`` (tabby-node's tabby_datastore_requests_total)
        self._requests: dict[tuple[str, str], int] = {}

    @property
    def requests(self) -> dict[tuple[str, str], int]:
        """A copy of the request counts (see ``_requests``)."""
        with self._requests_guard:
            return dict(self._requests)

    def _count_request(self, op: str, kind: str) -> None:
        with self._requests_guard:
            self._requests[(op, kind)] = self._requests.get((op, kind), 0) + 1

    # -- what a store supplies ------------------------------------------------------------

    def location(self, kind: str, key: str) -> str:
        """Where the document lives (a path for the file store), for error messages."""
        raise NotImplementedError

    def _get(self, kind: str, key: str) -> Doc | None:
        """``get`` with checked arguments."""
        raise NotImplementedError

    def _keys(self, kind: str) -> builtins.list[str]:
        """The keys of a kind, in any order (sorted by ``list_keys``)."""
        raise NotImplementedError

    def _items(self, kind: str, prefix: str) -> builtins.list[tuple[str, Doc]]:
        """The documents of a kind whose key starts with ``prefix``, in any order."""
        raise NotImplementedError

    def _apply(self, write: Write) -> int:
        """Compare the write's expected revision (``RevisionConflict`` and nothing written if
        it differs), then write; the new revision (0 for a delete)."""
        raise NotImplementedError

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        """``sync`` with checked, distinct kinds."""
        raise NotImplementedError

    def check_usable(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Nothing to release (a store with connections says otherwise)."""

    # -- reads ----------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Doc | None:
        check_kind(kind)
        check_key(key)
        self._count_request("get", kind)
        return self._get(kind, key)

    def list_keys(self, kind: str) -> builtins.list[str]:
        check_kind(kind)
        self._count_request("list", kind)
        keys = self._keys(kind)
        keys.sort()
        return keys

    def list(self, kind: str, prefix: str = "") -> builtins.list[tuple[str, Doc]]:
        check_kind(kind)
        self._count_request("list", kind)
        items = self._items(kind, prefix)
        items.sort(key=_by_key)
        return items

    # -- writes ---------------------------------------------------------------------------

    def put(self, kind: str, key: str, data: JSON, expected_revision: int | None) -> int:
        check_kind(kind)
        check_key(key)
        self._count_request("put", kind)
        return self._apply(Write(kind, key, encode(data), expected_revision))

    def put_leased(
        self,
        kind: str,
        key: str,
        data: JSON,
        expected_revision: int | None,
        *,
        ttl: float,
    ) -> int:
        check_kind(kind)
        check_key(key)
        check_ttl(ttl)
        self._count_request("put", kind)
        return self._apply(Write(kind, key, encode(data), expected_revision, ttl))

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        check_kind(kind)
        check_key(key)
        if type(expected_revision) is not int:
            raise TypeError(f"delete needs the document's revision, not {expected_revision!r}")
        self._count_request("delete", kind)
        self._apply(Write(kind, key, None, expected_revision))

    def keepalive(self, kind: str, key: str) -> bool:
        check_kind(kind)
        check_key(key)
        return self._keepalive(kind, key)

    def _keepalive(self, kind: str, key: str) -> bool:
        """The store's renewal of a document's ttl (no revision, no event)."""
        raise NotImplementedError

    def _compare(self, write: Write, current: int | None) -> None:
        """Raise the ``RevisionConflict`` of ``write`` unless its expected revision is
        ``current`` (the document's revision now, None: no document)."""
        if current != write.expected:
            raise conflict(self.location(write.kind, write.key), current, write.expected)

    # -- sync -----------------------------------------------------------------------------

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        return self._sync(sync_kinds(kinds), stop)

    @property
    def sync_stats(self) -> dict[str, int]:
        """The ``SYNC_STATS`` counters of every ``sync`` of this object so far (a copy)."""
        with self._sync_guard:
            return dict(self._sync_counts)

    def count_sync(self, name: str) -> None:
        """One more of ``SYNC_STATS``' ``name`` (from any thread)."""
        with self._sync_guard:
            self._sync_counts[name] += 1

    # -- lock -----------------------------------------------------------------------------

    def lock(self) -> StoreLock:
        return StoreLock(self)

    def _thread_lock(self) -> threading.Lock:
        """The thread lock taken first: the process's one for ``lock_path``."""
        return process_lock(self.lock_path)

    def _open_lock_file(self) -> int | None:
        """An fd of the lock file to flock, or None (no lock file: the thread lock is all)."""
        return None

    def _locked(self, session: StoreLock) -> None:
        """Called once the lock is had (the file store cleans up after a killed writer)."""

    def _unlocking(self, session: StoreLock) -> None:
        """Called before the lock is released (errors here do not keep it held)."""

    def _holding(self) -> StoreLock | None:
        """The session this thread holds on this store (None where re-entry is not tracked)."""
        held = self._held
        return None if held is None else getattr(held, "lock", None)

    def _acquire(self, session: StoreLock) -> None:
        held = self._held
        if held is not None and getattr(held, "lock", None) is not None:
            raise RuntimeError(f"{type(self).__name__}.lock() is not re-entrant")
        timeout = self.lock_timeout
        deadline = time.monotonic() + timeout
        thread_lock = self._thread_lock()
        # Threads of one process (tabby-node serves calls concurrently) queue on a thread
        # lock first: they wake as soon as it is free instead of polling the flock.
        if not thread_lock.acquire(timeout=timeout):
            raise LockTimeout(self.lock_path, f"held by another call for more than {timeout} s")
        try:
            fd = self._open_lock_file()
            while fd is not None:
                _flock(fd, self.lock_path, deadline, timeout)
                if not self._ephemeral_lock_file or _names(self.lock_path, fd):
                    break
                os.close(fd)  # its holder unlinked it: the lock is the file the path names now
                fd = self._open_lock_file()
        except BaseException:
            thread_lock.release()
            raise
        session.fd = fd
        session.thread_lock = thread_lock
        session.dirty = False
        if held is not None:
            held.lock = session
        try:
            self._locked(session)
        except BaseException:
            self._release(session)
            raise

    def _release(self, session: StoreLock) -> None:
        thread_lock = session.thread_lock
        if thread_lock is None:
            return
        try:
            self._unlocking(session)
        finally:
            if self._held is not None:
                self._held.lock = None
            fd, session.fd, session.thread_lock = session.fd, None, None
            session.dirty = False
            try:
                if fd is not None:
                    if self._ephemeral_lock_file:
                        with contextlib.suppress(OSError):
                            os.unlink(self.lock_path)  # still held: no one else's file
                    os.close(fd)  # closing drops the flock
            finally:
                thread_lock.release()


if TYPE_CHECKING:  # mypy checks that the engine, so every store, keeps the protocol

    def _conforms(store: Engine) -> Leases:
        return store
