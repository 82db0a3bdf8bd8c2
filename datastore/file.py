"""The default store: one JSON file per document under ``data_dir``.

What is common to every store (argument checks, encoding, compare-and-swap and its errors,
listing order, the lock session, sync bookkeeping) is ``datastore.engine``; this module keeps
paths, ``O_NOFOLLOW`` opens, temp files, fsync, and the poller of ``sync``.

Layout (``data_dir`` and every directory 0700, files 0600)::

    <data_dir>/lock                      flock(2) target; non-empty = a writer may have died
    <data_dir>/pools/<key>.json          kind "pool"      key: pool CIDR
    <data_dir>/blocks/<key>.json         kind "block"     key: block CIDR
    <data_dir>/handles/<key>.json        kind "handle"    key: "<network>:<container id>:<ifname>"
    <data_dir>/affinities/<key>.json     kind "affinity"  key: node name
    <data_dir>/nodes/, bgpconfigurations/, bgppeers/, networkpolicies/, namespaces/,
        serviceaccounts/, pods/, workloadendpoints/
                                         resources (keys: name, or "<namespace>/<name>")
    <data_dir>/calico-networkpolicies/, globalnetworkpolicies/, stagednetworkpolicies/,
        stagedglobalnetworkpolicies/, stagedkubernetesnetworkpolicies/, tiers/,
        networksets/, globalnetworksets/,
        hostendpoints/                   Calico's policy kinds (keys as resources')
    <data_dir>/heartbeats/<key>.json     kind "heartbeat" key: node name (written with a ttl)
    <data_dir>/traces/<key>.json         kind "trace"     key: "<id>" or "<id>.<node>" (ttl)

A key is kept as is except characters outside ``[A-Za-z0-9_.:-]`` (and a leading ``.``),
which are percent-encoded (UTF-8), so ``10.244.0.64/26`` is ``10.244.0.64%2F26.json``. Names
starting with ``.`` are temp files only. A file holds
``{"format": 1, "kind": ..., "key": ..., "revision": N, "data": {...}}``, plus
``"expires": <unix time>`` and ``"ttl": <seconds>`` when written with a ttl (``keepalive``
writes the file again with a later ``expires`` and the same revision). An expired document
reads as absent; its file stays until the next write of that key. A kind directory in which
a ttl was ever used holds an empty ``.ttl`` marker: only there does ``list_keys`` read the
documents (to leave out expired ones); elsewhere it lists names only.

Writes: temp file in the same directory (O_EXCL, O_NOFOLLOW, 0600), write, fsync,
``os.replace``, fsync of the directory (in a ``write_batch``: once for the batch's documents,
at its end). Before a locked session's first write, the lock file is
made non-empty; a clean unlock truncates it. The next locker that finds it non-empty removes
temp files a killed writer left behind. Every open uses O_NOFOLLOW relative to a directory fd
opened with O_NOFOLLOW: a symlinked data_dir, kind directory or document is refused
(StoreCorrupt), never followed.

Revisions are ``max(previous + 1, wall clock in µs)``: increasing per key and, unless the
clock steps back, not reused after a delete and re-create.

``lock()`` is the engine's session: the process's thread lock for ``<data_dir>/lock``, then
its flock, so separate objects, threads and processes are serialised. The session belongs to
the thread that took it: a FileStore object may serve several threads, each with its own
session; taking the lock again in the thread that holds it is a ``RuntimeError``. Writers
hold ``lock()`` (the core always does); an unlocked ``put`` or ``delete`` works, but may race
with the temp-file cleanup.

``sync`` polls every 0.2 s: a kind directory is listed again when its mtime changed (or is
less than two seconds old: the kernel's timestamps are coarse), when one of its documents
expired, and a document is read again when its inode, mtime or size changed (every write
is a new inode). After a poll that failed, every kind is listed and read again and only
what differs from what was reported is yielded. ``list`` reads document after document:
consistent per document, not across them (hold ``lock()`` for that).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import stat
import threading
import time
from collections.abc import Iterator

from datastore.base import Doc, SyncEvent
from datastore.engine import (
    LOCK_FLAGS,
    PLURALS,
    Engine,
    Reported,
    StoreLock,
    Write,
    loads,
    log_warning,
    note_failure,
    reason,
    refused,
)
from datastore.errors import InvalidConfig, StoreCorrupt, StoreError, StoreUnavailable

FORMAT = 1
DIRS = PLURALS  # kind -> directory under data_dir
LOCK_NAME = "lock"
TTL_MARKER = ".ttl"
POLL = 0.2  # sync: seconds between polls
RECENT_NS = 2_000_000_000  # sync: a directory changed this recently is listed again
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_MARK_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_MAX_NAME = 255


def escape_key(key: str) -> str:
    """File name for a key (see the module docstring)."""
    out = []
    for i, ch in enumerate(key):
        if ch in _SAFE and not (i == 0 and ch == "."):
            out.append(ch)
        else:
            out.extend(f"%{b:02X}" for b in ch.encode("utf-8"))
    name = "".join(out) + ".json"
    if len(name.encode()) > _MAX_NAME:
        raise InvalidConfig("key too long for the file store", key[:100])
    return name


def unescape_name(name: str) -> str | None:
    """The key a document file name stands for, or None if it is not a document name."""
    if not name.endswith(".json") or name.startswith("."):
        return None
    body = name[:-5]
    if "%" not in body:
        return body
    raw = bytearray()
    i = 0
    while i < len(body):
        ch = body[i]
        if ch == "%":
            try:
                raw.append(int(body[i + 1 : i + 3], 16))
            except ValueError:
                return None
            i += 3
        else:
            raw.extend(ch.encode())
            i += 1
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return None


class FileStore(Engine):
    """Store over a directory tree; see the module docstring for layout and guarantees."""

    def __init__(self, data_dir: str, *, lock_timeout: float = 30.0) -> None:
        super().__init__()
        self.data_dir = os.path.abspath(data_dir)
        self.lock_timeout = float(lock_timeout)
        self.lock_path = os.path.join(self.data_dir, LOCK_NAME)
        self._held = threading.local()

    # -- paths and directories ----------------------------------------------------------

    def location(self, kind: str, key: str) -> str:
        return self._path(kind, escape_key(key))

    def _path(self, kind: str, name: str) -> str:
        return os.path.join(self.data_dir, DIRS[kind], name)

    def _make_data_dir(self) -> None:
        missing = []
        path = self.data_dir
        while not os.path.lexists(path):
            missing.append(path)
            path = os.path.dirname(path)
        for d in reversed(missing):
            try:
                os.mkdir(d, 0o700)
            except FileExistsError:
                continue
            except OSError as e:
                raise StoreUnavailable(d, f"cannot create: {e.strerror}") from None
            os.chmod(d, 0o700, follow_symlinks=False)

    def _open_root(self, *, create: bool) -> int | None:
        for attempt in (0, 1):
            try:
                return os.open(self.data_dir, _DIR_FLAGS)
            except FileNotFoundError:
                if not create or attempt:
                    return None
                self._make_data_dir()
            except OSError as e:
                raise _dir_error(self.data_dir, e) from None
        return None  # pragma: no cover

    def _open_kind(self, root_fd: int, kind: str, *, create: bool) -> int | None:
        name = DIRS[kind]
        for attempt in (0, 1):
            try:
                return os.open(name, _DIR_FLAGS, dir_fd=root_fd)
            except FileNotFoundError:
                if not create or attempt:
                    return None
                try:
                    os.mkdir(name, 0o700, dir_fd=root_fd)
                except FileExistsError:
                    pass
                except OSError as e:
                    path = os.path.join(self.data_dir, name)
                    raise StoreUnavailable(path, f"cannot create: {e.strerror}") from None
            except OSError as e:
                raise _dir_error(os.path.join(self.data_dir, name), e) from None
        return None  # pragma: no cover

    def _kind_fd(self, kind: str, *, create: bool) -> int | None:
        root = self._open_root(create=create)
        if root is None:
            return None
        try:
            return self._open_kind(root, kind, create=create)
        finally:
            os.close(root)

    # -- lock (the engine's session; what is the file store's own) ------------------------

    def _open_lock_file(self) -> int:
        root = self._open_root(create=True)
        if root is None:  # pragma: no cover - created just above
            raise StoreUnavailable(self.data_dir, "missing")
        try:
            if os.fstat(root).st_mode & 0o077:
                try:
                    os.fchmod(root, 0o700)
                except OSError:
                    pass
            return os.open(LOCK_NAME, LOCK_FLAGS, 0o600, dir_fd=root)
        except OSError as e:
            raise refused(self.lock_path, e) from None
        finally:
            os.close(root)

    def _locked(self, session: StoreLock) -> None:
        """A non-empty lock file: a writer died in its session; its temp files go."""
        assert session.fd is not None
        if os.fstat(session.fd).st_size > 0:
            self._remove_temp_files()
            os.ftruncate(session.fd, 0)

    def _unlocking(self, session: StoreLock) -> None:
        if session.dirty and session.fd is not None:
            try:
                os.ftruncate(session.fd, 0)
            except OSError:
                pass

    def _mark_dirty(self) -> None:
        session = self._holding()
        if session is not None and session.fd is not None:
            if not session.dirty:
                os.pwrite(session.fd, b"writing\n", 0)
                session.dirty = True
            return
        # A write outside lock() (not done by the core): mark and leave it marked.
        root = self._open_root(create=True)
        if root is None:  # pragma: no cover
            return
        try:
            fd = os.open(LOCK_NAME, LOCK_FLAGS, 0o600, dir_fd=root)
            try:
                os.pwrite(fd, b"writing\n", 0)
            finally:
                os.close(fd)
        finally:
            os.close(root)

    def _remove_temp_files(self) -> None:
        removed = 0
        for kind in DIRS:
            dfd = self._kind_fd(kind, create=False)
            if dfd is None:
                continue
            try:
                for name in os.listdir(dfd):
                    if name.startswith(".") and name.endswith(".tmp"):
                        try:
                            os.unlink(name, dir_fd=dfd)
                            removed += 1
                        except FileNotFoundError:
                            pass
            finally:
                os.close(dfd)
        if removed:
            log_warning("removed %d temp file(s) left by a killed writer", removed)

    # -- reads ----------------------------------------------------------------------------

    def _get(self, kind: str, key: str) -> Doc | None:
        name = escape_key(key)
        dfd = self._kind_fd(kind, create=False)
        if dfd is None:
            return None
        try:
            return _live(self._read(dfd, kind, key, name))
        finally:
            os.close(dfd)

    def _read(self, dfd: int, kind: str, key: str, name: str) -> _Raw | None:
        """The document file as stored (expired or not), or None if there is none."""
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            path = self._path(kind, name)
            if e.errno == errno.ELOOP:
                raise StoreCorrupt(path, "is a symlink (refused)") from None
            raise StoreCorrupt(path, reason(e)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreCorrupt(self._path(kind, name), "not a regular file")
            chunks = []
            while True:
                chunk = os.read(fd, max(st.st_size + 1, 4096))
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError as e:
            raise StoreCorrupt(self._path(kind, name), reason(e)) from None
        finally:
            os.close(fd)
        raw = b"".join(chunks)
        path = self._path(kind, name)
        doc = loads(path, raw, empty="empty file", garbage="truncated or not JSON")
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise StoreCorrupt(path, f"not a format-{FORMAT} document")
        rev = doc.get("revision")
        data = doc.get("data")
        if type(rev) is not int or rev <= 0 or not isinstance(data, dict):
            raise StoreCorrupt(path, "missing revision or data")
        if doc.get("key") != key or doc.get("kind") != kind:
            raise StoreCorrupt(path, f"holds {doc.get('kind')!r} {doc.get('key')!r}")
        expires = doc.get("expires")
        if expires is not None and type(expires) not in (int, float):
            raise StoreCorrupt(path, "bad expiry stamp")
        return _Raw(Doc(data, rev), expires, raw)

    def _names(self, dfd: int, kind: str) -> builtins.list[str]:
        try:
            return os.listdir(dfd)
        except OSError as e:
            raise StoreCorrupt(os.path.join(self.data_dir, DIRS[kind]), reason(e)) from None

    def _keys(self, kind: str) -> builtins.list[str]:
        dfd = self._kind_fd(kind, create=False)
        if dfd is None:
            return []
        keys = []
        try:
            names = self._names(dfd, kind)
            expiring = TTL_MARKER in names
            for name in names:
                key = unescape_name(name)
                if key is None:
                    continue
                if expiring:
                    try:
                        if _live(self._read(dfd, kind, key, name)) is None:
                            continue
                    except StoreCorrupt:
                        pass  # listed: the caller finds it unreadable when it reads it
                keys.append(key)
        finally:
            os.close(dfd)
        return keys

    def _items(self, kind: str, prefix: str) -> builtins.list[tuple[str, Doc]]:
        dfd = self._kind_fd(kind, create=False)
        if dfd is None:
            return []
        out = []
        try:
            for name in self._names(dfd, kind):
                key = unescape_name(name)
                if key is None or not key.startswith(prefix):
                    continue
                doc = _live(self._read(dfd, kind, key, name))
                if doc is not None:
                    out.append((key, doc))
        finally:
            os.close(dfd)
        return out

    # -- writes ---------------------------------------------------------------------------

    def _apply(self, w: Write) -> int:
        """Compare, then write the document's file (temp file, fsync, rename) or unlink it."""
        dfd = self._kind_fd(w.kind, create=w.value is not None)
        try:
            name = escape_key(w.key)
            raw = None if dfd is None else self._read(dfd, w.kind, w.key, name)
            self._compare(w, _revision(raw))
            if w.value is None:
                if dfd is not None:
                    self._unlink(dfd, w.kind, name)
                return 0
            if dfd is None:  # pragma: no cover - created above
                raise StoreUnavailable(os.path.join(self.data_dir, DIRS[w.kind]), "missing")
            rev, payload = _payload(w, w.value, raw)
            self._write(dfd, w.kind, name, payload)
            if w.ttl is not None:
                self._mark_ttl(dfd, w.kind)
            return rev
        finally:
            if dfd is not None:
                os.close(dfd)

    def _keepalive(self, kind: str, key: str) -> bool:
        """The document's file written again with a later ``expires`` and the same
        revision: the poller of ``sync`` sees a new file but no new revision, so no event."""
        with self.lock():
            dfd = self._kind_fd(kind, create=False)
            if dfd is None:
                return False
            try:
                name = escape_key(key)
                raw = self._read(dfd, kind, key, name)
                if _live(raw) is None or raw is None or raw.expires is None:
                    return False
                envelope = json.loads(raw.payload)
                ttl = envelope.get("ttl")
                if type(ttl) not in (int, float) or ttl <= 0:
                    return False  # written by a tabby without keepalive: write it again
                envelope["expires"] = round(time.time() + ttl, 6)
                payload = json.dumps(envelope, separators=(",", ":"), allow_nan=False).encode()
                self._write(dfd, kind, name, payload)
                return True
            finally:
                os.close(dfd)

    def _mark_ttl(self, dfd: int, kind: str) -> None:
        try:
            os.close(os.open(TTL_MARKER, _MARK_FLAGS, 0o600, dir_fd=dfd))
        except OSError as e:
            raise StoreUnavailable(self._path(kind, TTL_MARKER), reason(e)) from None

    def _write(self, dfd: int, kind: str, name: str, payload: bytes) -> None:
        tmp = f".{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
        try:
            self._mark_dirty()
            fd = os.open(tmp, _TMP_FLAGS, 0o600, dir_fd=dfd)
            try:
                os.fchmod(fd, 0o600)
                view = memoryview(payload)
                while view:
                    view = view[os.write(fd, view) :]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
            self._dir_written(dfd, kind)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise StoreUnavailable(self._path(kind, name), reason(e)) from None

    def _unlink(self, dfd: int, kind: str, name: str) -> None:
        try:
            self._mark_dirty()
            os.unlink(name, dir_fd=dfd)
            self._dir_written(dfd, kind)
        except OSError as e:
            raise StoreUnavailable(self._path(kind, name), reason(e)) from None

    def _dir_written(self, dfd: int, kind: str) -> None:
        """A name in ``kind``'s directory changed: fsync the directory now, or, in this
        thread's ``write_batch``, once at its end."""
        session = self._holding()
        if session is not None and session.deferred is not None:
            session.deferred.add(kind)
        else:
            self._fsync_dir(dfd)

    def _fsync_dir(self, dfd: int) -> None:
        os.fsync(dfd)

    @contextlib.contextmanager
    def write_batch(self) -> Iterator[None]:
        """In this thread's ``lock()`` session: the documents written (or deleted) in the
        block each have their temp file fsynced and renamed as always (visible at once, to
        every reader), and the directories they are in fsynced once at its end, not once
        per document: durable when the block exits. Nested: the outer one syncs."""
        session = self._holding()
        if session is None:
            raise RuntimeError("FileStore.write_batch() outside lock()")
        if session.deferred is not None:
            yield
            return
        session.deferred = set()
        try:
            yield
        finally:
            kinds, session.deferred = session.deferred, None
            self._sync_dirs(kinds)

    def _sync_dirs(self, kinds: set[str]) -> None:
        for kind in sorted(kinds):
            dfd = self._kind_fd(kind, create=False)
            if dfd is None:
                continue  # pragma: no cover - written to in this session
            try:
                self._fsync_dir(dfd)
            except OSError as e:
                raise StoreUnavailable(os.path.join(self.data_dir, DIRS[kind]), reason(e)) from None
            finally:
                os.close(dfd)

    # -- sync -----------------------------------------------------------------------------

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        reported = Reported()
        watch = _Poller(self, kinds, reported)
        first = True
        fresh = True  # read everything: at first, and after a failed poll
        failure = ""
        while not stop.is_set():
            events: list[SyncEvent] = []
            try:
                if fresh:
                    docs = watch.snapshot()
                    if first:
                        events.append(reported.snapshot(docs))
                        self.count_sync("snapshots")
                    else:  # only what differs from what was reported
                        events = [e for kind in kinds for e in reported.changes(kind, docs[kind])]
                        self.count_sync("rereads")
                    first = fresh = False
                    failure = ""
                else:
                    events = watch.poll()
            except (OSError, StoreError) as e:
                fresh = True
                failure = note_failure(failure, f"sync of {self.data_dir}: {e} (polling on)")
            yield from events
            stop.wait(POLL)

    # -- health -------------------------------------------------------------------------

    def check_usable(self) -> None:
        """Read-only: the directory tree is there (or can be made) and writable."""
        try:
            st = os.lstat(self.data_dir)
        except FileNotFoundError:
            parent = os.path.dirname(self.data_dir)
            while not os.path.lexists(parent):
                parent = os.path.dirname(parent)
            if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
                raise StoreUnavailable(parent, "cannot create the data directory here") from None
            return
        except OSError as e:
            raise StoreCorrupt(self.data_dir, reason(e)) from None
        _check_dir(self.data_dir, st)
        entries = [(LOCK_NAME, False)] + [(d, True) for d in DIRS.values()]
        for name, is_dir in entries:
            path = os.path.join(self.data_dir, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StoreCorrupt(path, reason(e)) from None
            if is_dir:
                _check_dir(path, st)
            elif not stat.S_ISREG(st.st_mode):
                raise StoreCorrupt(path, "not a regular file (symlinks are refused)")
            elif not os.access(path, os.R_OK | os.W_OK):
                raise StoreUnavailable(path, "not readable and writable")


def _check_dir(path: str, st: os.stat_result) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise StoreCorrupt(path, "is a symlink (refused)")
    if not stat.S_ISDIR(st.st_mode):
        raise StoreCorrupt(path, "not a directory")
    if not os.access(path, os.R_OK | os.W_OK | os.X_OK):
        raise StoreUnavailable(path, "not writable")


def _dir_error(path: str, e: OSError) -> StoreCorrupt:
    if e.errno in (errno.ELOOP, errno.ENOTDIR):
        return StoreCorrupt(path, "not a directory (symlinks are refused)")
    return StoreCorrupt(path, reason(e))


# Plain slotted classes, not NamedTuples: a NamedTuple costs ~200 µs of import.


class _Raw:
    """A document file as read: the document, its expiry stamp, the bytes (to restore)."""

    __slots__ = ("doc", "expires", "payload")

    def __init__(self, doc: Doc, expires: float | None, payload: bytes) -> None:
        self.doc = doc
        self.expires = expires
        self.payload = payload


def _live(raw: _Raw | None) -> Doc | None:
    if raw is None or (raw.expires is not None and raw.expires <= time.time()):
        return None
    return raw.doc


def _revision(raw: _Raw | None) -> int | None:
    doc = _live(raw)
    return None if doc is None else doc.revision


def _payload(w: Write, value: bytes, before: _Raw | None) -> tuple[int, bytes]:
    """The next revision and the file content for a write (``before``: the file replaced).
    The data is ``value`` as the engine encoded it, not encoded again."""
    rev = max(before.doc.revision + 1 if before else 1, time.time_ns() // 1000)
    head = f'{{"format":{FORMAT},"kind":"{w.kind}","key":{json.dumps(w.key)},"revision":{rev}'
    if w.ttl is not None:
        head += f',"expires":{json.dumps(round(time.time() + w.ttl, 6))},"ttl":{json.dumps(w.ttl)}'
    return rev, f'{head},"data":'.encode() + value + b"}"


class _File:
    """What the poller knows of one document file."""

    __slots__ = ("doc", "expires", "key", "sig")

    def __init__(
        self, sig: tuple[int, int, int], key: str, doc: Doc | None, expires: float | None
    ) -> None:
        self.sig = sig  # inode, mtime, size: every write is a new inode
        self.key = key
        self.doc = doc  # None: unreadable (skipped, logged once)
        self.expires = expires


class _Poller:
    """``FileStore.sync``'s state: the files of each kind as last seen (what was reported is
    the engine's ``Reported``)."""

    def __init__(self, store: FileStore, kinds: tuple[str, ...], reported: Reported) -> None:
        self.store = store
        self.kinds = kinds
        self.reported = reported
        self.files: dict[str, dict[str, _File]] = {}
        self.dirs: dict[str, tuple[int, int] | None] = {}

    def snapshot(self) -> dict[str, dict[str, Doc]]:
        self.files = {}
        docs = {}
        for kind in self.kinds:
            self._scan(kind)
            docs[kind] = self._view(kind)
        return docs

    def poll(self) -> list[SyncEvent]:
        """The changes since the last poll. Every directory is read before anything counts
        as reported: a poll that fails reports nothing (the re-read after it has to find
        every change)."""
        due = []
        now = time.time()
        for kind in self.kinds:
            if self._changed(kind):
                self._scan(kind)
            elif not any(f.expires is not None and f.expires <= now for f in self._live(kind)):
                continue
            due.append(kind)
        return [e for kind in due for e in self.reported.changes(kind, self._view(kind))]

    def _live(self, kind: str) -> Iterator[_File]:
        known = self.reported.docs[kind]
        return (f for f in self.files[kind].values() if f.key in known)

    def _changed(self, kind: str) -> bool:
        path = os.path.join(self.store.data_dir, DIRS[kind])
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return self.dirs.get(kind) is not None
        sig = (st.st_ino, st.st_mtime_ns)
        if sig != self.dirs.get(kind):
            return True
        return time.time_ns() - st.st_mtime_ns < RECENT_NS

    def _scan(self, kind: str) -> None:
        old = self.files.get(kind, {})
        new: dict[str, _File] = {}
        dfd = self.store._kind_fd(kind, create=False)
        if dfd is None:
            self.files[kind] = new
            self.dirs[kind] = None
            return
        try:
            st = os.fstat(dfd)
            self.dirs[kind] = (st.st_ino, st.st_mtime_ns)
            with os.scandir(dfd) as entries:
                for entry in entries:
                    key = unescape_name(entry.name)
                    if key is None:
                        continue
                    try:
                        est = entry.stat(follow_symlinks=False)
                    except FileNotFoundError:
                        continue
                    sig = (est.st_ino, est.st_mtime_ns, est.st_size)
                    prev = old.get(entry.name)
                    if prev is not None and prev.sig == sig:
                        new[entry.name] = prev
                        continue
                    try:
                        raw = self.store._read(dfd, kind, key, entry.name)
                    except StoreCorrupt as e:
                        log_warning("sync: left out %s", e)
                        new[entry.name] = _File(sig, key, None, None)
                        continue
                    if raw is not None:
                        new[entry.name] = _File(sig, key, raw.doc, raw.expires)
        finally:
            os.close(dfd)
        self.files[kind] = new

    def _view(self, kind: str) -> dict[str, Doc]:
        now = time.time()
        return {
            f.key: f.doc
            for f in self.files[kind].values()
            if f.doc is not None and (f.expires is None or f.expires > now)
        }
