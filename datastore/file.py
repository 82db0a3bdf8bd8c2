"""The default store: one JSON file per document under ``data_dir``.

Layout (``data_dir`` and every directory 0700, files 0600)::

    <data_dir>/lock                      flock(2) target; non-empty = a writer may have died
    <data_dir>/pools/<key>.json          kind "pool"      key: pool CIDR
    <data_dir>/blocks/<key>.json         kind "block"     key: block CIDR
    <data_dir>/handles/<key>.json        kind "handle"    key: "<network>:<container id>:<ifname>"
    <data_dir>/affinities/<key>.json     kind "affinity"  key: node name
    <data_dir>/nodes/, bgpconfigurations/, bgppeers/, networkpolicies/, namespaces/, pods/,
        workloadendpoints/               resources (keys: name, or "<namespace>/<name>")
    <data_dir>/heartbeats/<key>.json     kind "heartbeat" key: node name (written with a ttl)

A key is kept as is except characters outside ``[A-Za-z0-9_.:-]`` (and a leading ``.``),
which are percent-encoded (UTF-8), so ``10.244.0.64/26`` is ``10.244.0.64%2F26.json``. Names
starting with ``.`` are temp files only. A file holds
``{"format": 1, "kind": ..., "key": ..., "revision": N, "data": {...}}``, plus
``"expires": <unix time>`` when written with a ttl. An expired document reads as absent; its
file stays until the next write of that key. A kind directory in which a ttl was ever used
holds an empty ``.ttl`` marker: only there does ``list_keys`` read the documents (to leave
out expired ones); elsewhere it lists names only.

Writes: temp file in the same directory (O_EXCL, O_NOFOLLOW, 0600), write, fsync,
``os.replace``, fsync of the directory. Before a locked session's first write, the lock file is
made non-empty; a clean unlock truncates it. The next locker that finds it non-empty removes
temp files a killed writer left behind. Every open uses O_NOFOLLOW relative to a directory fd
opened with O_NOFOLLOW: a symlinked data_dir, kind directory or document is refused
(StoreCorrupt), never followed.

Revisions are ``max(previous + 1, wall clock in µs)``: increasing per key and, unless the
clock steps back, not reused after a delete and re-create.

One FileStore object is meant for one thread (the lock session lives on the object); separate
objects, threads and processes are serialised by the flock. Writers hold ``lock()`` (the core
always does); an unlocked ``put`` works, but may race with the temp-file cleanup. ``commit``
takes the lock itself unless the caller holds it, checks every revision, then writes one
document after the other; if a write fails it puts back what it had written, then raises.

``sync`` polls every 0.2 s: a kind directory is listed again when its mtime changed (or is
less than two seconds old: the kernel's timestamps are coarse), when one of its documents
expired, and a document is read again when its inode, mtime or size changed (every write
is a new inode). ``list`` reads document after document: consistent per document, not across
them (hold ``lock()`` for that).
"""

from __future__ import annotations

import builtins
import errno
import fcntl
import json
import os
import stat
import threading
import time
from collections.abc import Iterable, Iterator, Sequence
from types import TracebackType
from typing import Any, NamedTuple

from datastore.base import (
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

FORMAT = 1
DIRS = {
    "pool": "pools",
    "block": "blocks",
    "handle": "handles",
    "affinity": "affinities",
    "node": "nodes",
    "bgpconfiguration": "bgpconfigurations",
    "bgppeer": "bgppeers",
    "networkpolicy": "networkpolicies",
    "namespace": "namespaces",
    "pod": "pods",
    "workloadendpoint": "workloadendpoints",
    "heartbeat": "heartbeats",
}
LOCK_NAME = "lock"
TTL_MARKER = ".ttl"
POLL = 0.2  # sync: seconds between polls
RECENT_NS = 2_000_000_000  # sync: a directory changed this recently is listed again
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
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


def _log_warning(msg: str, *args: object) -> None:
    import logging  # only on unusual paths: logging costs ~4 ms of start-up

    logging.getLogger("tabby.ipam").warning(msg, *args)


class _FileLock:
    def __init__(self, store: FileStore) -> None:
        self._store = store

    def __enter__(self) -> None:
        self._store._acquire()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._store._release()


class FileStore:
    """Store over a directory tree; see the module docstring for layout and guarantees."""

    def __init__(self, data_dir: str, *, lock_timeout: float = 30.0) -> None:
        self.data_dir = os.path.abspath(data_dir)
        self.lock_timeout = float(lock_timeout)
        self._lock_fd: int | None = None
        self._plock: threading.Lock | None = None
        self._dirty = False

    # -- paths and directories ----------------------------------------------------------

    def location(self, kind: str, key: str) -> str:
        return os.path.join(self.data_dir, DIRS[kind], escape_key(key))

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

    # -- lock ---------------------------------------------------------------------------

    def lock(self) -> _FileLock:
        return _FileLock(self)

    def _acquire(self) -> None:
        if self._lock_fd is not None:
            raise RuntimeError("FileStore.lock() is not re-entrant")
        lock_path = os.path.join(self.data_dir, LOCK_NAME)
        root = self._open_root(create=True)
        if root is None:  # pragma: no cover - created just above
            raise StoreUnavailable(self.data_dir, "missing")
        try:
            st = os.fstat(root)
            if st.st_mode & 0o077:
                try:
                    os.fchmod(root, 0o700)
                except OSError:
                    pass
            fd = os.open(LOCK_NAME, _LOCK_FLAGS, 0o600, dir_fd=root)
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreCorrupt(lock_path, "is a symlink (refused)") from None
            raise StoreUnavailable(lock_path, e.strerror or str(e)) from None
        finally:
            os.close(root)
        deadline = time.monotonic() + self.lock_timeout
        # Threads of one process (tabby-node serves calls concurrently) queue on a thread
        # lock first: they wake as soon as it is free instead of polling the flock.
        plock = _process_lock(self.data_dir)
        if not plock.acquire(timeout=self.lock_timeout):
            os.close(fd)
            raise LockTimeout(
                lock_path, f"held by another call for more than {self.lock_timeout} s"
            )
        self._plock = plock
        delay = 0.001
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                now = time.monotonic()
                if now >= deadline:
                    os.close(fd)
                    self._release_plock()
                    raise LockTimeout(
                        lock_path, f"held by another process for more than {self.lock_timeout} s"
                    ) from None
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, 0.005)
            except OSError as e:
                os.close(fd)
                self._release_plock()
                raise StoreUnavailable(lock_path, e.strerror or str(e)) from None
        self._lock_fd = fd
        self._dirty = False
        try:
            if os.fstat(fd).st_size > 0:
                self._remove_temp_files()
                os.ftruncate(fd, 0)
        except BaseException:
            self._release()
            raise

    def _release(self) -> None:
        fd = self._lock_fd
        if fd is None:
            return
        self._lock_fd = None
        try:
            if self._dirty:
                os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            self._dirty = False
            os.close(fd)  # closing drops the flock
            self._release_plock()

    def _release_plock(self) -> None:
        plock, self._plock = self._plock, None
        if plock is not None:
            plock.release()

    def _mark_dirty(self) -> None:
        if self._lock_fd is not None:
            if not self._dirty:
                os.pwrite(self._lock_fd, b"writing\n", 0)
                self._dirty = True
            return
        # A write outside lock() (not done by the core): mark and leave it marked.
        root = self._open_root(create=True)
        if root is None:  # pragma: no cover
            return
        try:
            fd = os.open(LOCK_NAME, _LOCK_FLAGS, 0o600, dir_fd=root)
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
            _log_warning("removed %d temp file(s) left by a killed writer", removed)

    # -- documents ------------------------------------------------------------------------

    def get(self, kind: str, key: str) -> Doc | None:
        check_kind(kind)
        check_key(key)
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
        path = os.path.join(self.data_dir, DIRS[kind], name)
        try:
            fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:
                raise StoreCorrupt(path, "is a symlink (refused)") from None
            raise StoreCorrupt(path, e.strerror or str(e)) from None
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise StoreCorrupt(path, "not a regular file")
            chunks = []
            while True:
                chunk = os.read(fd, max(st.st_size + 1, 4096))
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError as e:
            raise StoreCorrupt(path, e.strerror or str(e)) from None
        finally:
            os.close(fd)
        raw = b"".join(chunks)
        try:
            doc = json.loads(raw)
        except ValueError:  # includes UnicodeDecodeError
            reason = "empty file" if not raw else f"truncated or not JSON ({len(raw)} bytes)"
            raise StoreCorrupt(path, reason) from None
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

    def _names(self, dfd: int, kind: str) -> list[str]:
        try:
            return os.listdir(dfd)
        except OSError as e:
            path = os.path.join(self.data_dir, DIRS[kind])
            raise StoreCorrupt(path, e.strerror or str(e)) from None

    def list_keys(self, kind: str) -> list[str]:
        check_kind(kind)
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
        keys.sort()
        return keys

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]:
        check_kind(kind)
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
        out.sort(key=lambda item: item[0])
        return out

    def put(
        self,
        kind: str,
        key: str,
        data: dict[str, Any],
        expected_revision: int | None,
        *,
        ttl: float | None = None,
    ) -> int:
        check_kind(kind)
        check_key(key)
        check_ttl(ttl)
        name = escape_key(key)
        dfd = self._kind_fd(kind, create=True)
        if dfd is None:  # pragma: no cover - created just above
            raise StoreUnavailable(os.path.join(self.data_dir, DIRS[kind]), "missing")
        try:
            raw = self._read(dfd, kind, key, name)
            path = os.path.join(self.data_dir, DIRS[kind], name)
            _check_revision(path, _live(raw), expected_revision)
            rev, payload = _payload(kind, key, data, raw, ttl)
            if ttl is not None:
                self._mark_ttl(dfd, kind)
            self._write(dfd, name, path, payload)
            return rev
        finally:
            os.close(dfd)

    def _mark_ttl(self, dfd: int, kind: str) -> None:
        try:
            os.close(os.open(TTL_MARKER, _MARK_FLAGS, 0o600, dir_fd=dfd))
        except OSError as e:
            path = os.path.join(self.data_dir, DIRS[kind], TTL_MARKER)
            raise StoreUnavailable(path, e.strerror or str(e)) from None

    def _write(self, dfd: int, name: str, path: str, payload: bytes) -> None:
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
            os.fsync(dfd)
        except OSError as e:
            try:
                os.unlink(tmp, dir_fd=dfd)
            except OSError:
                pass
            raise StoreUnavailable(path, e.strerror or str(e)) from None

    def _unlink(self, dfd: int, name: str, path: str) -> None:
        try:
            self._mark_dirty()
            os.unlink(name, dir_fd=dfd)
            os.fsync(dfd)
        except OSError as e:
            raise StoreUnavailable(path, e.strerror or str(e)) from None

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        check_kind(kind)
        check_key(key)
        name = escape_key(key)
        path = os.path.join(self.data_dir, DIRS[kind], name)
        dfd = self._kind_fd(kind, create=False)
        if dfd is None:
            raise RevisionConflict("document vanished", path)
        try:
            current = _live(self._read(dfd, kind, key, name))
            if current is None:
                raise RevisionConflict("document vanished", path)
            _check_revision(path, current, expected_revision)
            self._unlink(dfd, name, path)
        finally:
            os.close(dfd)

    def commit(self, ops: Sequence[Op]) -> builtins.list[int]:
        check_ops(ops)
        if not ops:
            return []
        held = self._lock_fd is not None
        if not held:
            self._acquire()
        try:
            return self._commit(ops)
        finally:
            if not held:
                self._release()

    def _commit(self, ops: Sequence[Op]) -> builtins.list[int]:
        fds: dict[str, int | None] = {}
        try:
            for op in ops:
                if op.kind not in fds:
                    create = any(o.kind == op.kind and o.data is not None for o in ops)
                    fds[op.kind] = self._kind_fd(op.kind, create=create)
            plan: list[_Step] = []
            for op in ops:
                dfd = fds[op.kind]
                name = escape_key(op.key)
                path = os.path.join(self.data_dir, DIRS[op.kind], name)
                raw = None if dfd is None else self._read(dfd, op.kind, op.key, name)
                _check_revision(path, _live(raw), op.expected_revision)
                if op.data is not None:
                    rev, payload = _payload(op.kind, op.key, op.data, raw, None)
                    plan.append(_Step(dfd, name, path, raw, payload, rev))
                elif op.expected_revision is not None:
                    plan.append(_Step(dfd, name, path, raw, None, 0))
                else:
                    plan.append(_Step(None, name, path, raw, None, 0))  # asserts absence only
            done: list[_Step] = []
            try:
                for step in plan:
                    if step.dfd is None:
                        continue
                    if step.payload is not None:
                        self._write(step.dfd, step.name, step.path, step.payload)
                    else:
                        self._unlink(step.dfd, step.name, step.path)
                    done.append(step)
            except StoreError:
                self._undo(done)
                raise
            return [step.revision for step in plan]
        finally:
            for fd in fds.values():
                if fd is not None:
                    os.close(fd)

    def _undo(self, done: builtins.list[_Step]) -> None:
        """Put back what a failed commit had written (best effort: the disk just failed)."""
        for step in reversed(done):
            assert step.dfd is not None
            try:
                if step.before is not None:
                    self._write(step.dfd, step.name, step.path, step.before.payload)
                else:
                    self._unlink(step.dfd, step.name, step.path)
            except StoreError as e:
                _log_warning("commit failed and could not be undone: %s", e)

    # -- sync -----------------------------------------------------------------------------

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]:
        wanted = sync_kinds(kinds)
        return self._sync(wanted, stop)

    def _sync(self, kinds: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        watch = _Poller(self, kinds)
        fresh = True
        failure = ""
        while not stop.is_set():
            events: list[SyncEvent] = []
            try:
                if fresh:
                    events.append(SyncEvent("snapshot", "", "", None, watch.snapshot()))
                    fresh = False
                    failure = ""
                else:
                    events = watch.poll()
            except (OSError, StoreError) as e:
                fresh = True
                if str(e) != failure:
                    failure = str(e)
                    _log_warning("sync of %s: %s (polling on)", self.data_dir, e)
            yield from events
            stop.wait(POLL)

    def close(self) -> None:
        """Nothing to release: no connection, and the lock lives only inside ``lock()``."""

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
            raise StoreCorrupt(self.data_dir, e.strerror or str(e)) from None
        _check_dir(self.data_dir, st)
        entries = [(LOCK_NAME, False)] + [(d, True) for d in DIRS.values()]
        for name, is_dir in entries:
            path = os.path.join(self.data_dir, name)
            try:
                st = os.lstat(path)
            except FileNotFoundError:
                continue
            except OSError as e:
                raise StoreCorrupt(path, e.strerror or str(e)) from None
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
    return StoreCorrupt(path, e.strerror or str(e))


class _Raw(NamedTuple):
    """A document file as read: the document, its expiry stamp, the bytes (to restore)."""

    doc: Doc
    expires: float | None
    payload: bytes


class _Step(NamedTuple):
    """One planned write of a commit (``dfd`` None: nothing to write)."""

    dfd: int | None
    name: str
    path: str
    before: _Raw | None
    payload: bytes | None
    revision: int


def _live(raw: _Raw | None) -> Doc | None:
    if raw is None or (raw.expires is not None and raw.expires <= time.time()):
        return None
    return raw.doc


def _payload(
    kind: str, key: str, data: dict[str, Any], before: _Raw | None, ttl: float | None
) -> tuple[int, bytes]:
    """The next revision and the file content for a write (``before``: the file replaced)."""
    if not isinstance(data, dict):
        raise TypeError(f"document data must be a dict, not {type(data).__name__}")
    rev = max(before.doc.revision + 1 if before else 1, time.time_ns() // 1000)
    doc: dict[str, Any] = {"format": FORMAT, "kind": kind, "key": key, "revision": rev}
    if ttl is not None:
        doc["expires"] = round(time.time() + ttl, 6)
    doc["data"] = data
    return rev, json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


class _File(NamedTuple):
    """What the poller knows of one document file."""

    sig: tuple[int, int, int]  # inode, mtime, size: every write is a new inode
    key: str
    doc: Doc | None  # None: unreadable (skipped, logged once)
    expires: float | None


class _Poller:
    """``FileStore.sync``'s state: the files of each kind as last seen, and the documents
    last reported."""

    def __init__(self, store: FileStore, kinds: tuple[str, ...]) -> None:
        self.store = store
        self.kinds = kinds
        self.files: dict[str, dict[str, _File]] = {}
        self.dirs: dict[str, tuple[int, int] | None] = {}
        self.docs: dict[str, dict[str, Doc]] = {}

    def snapshot(self) -> dict[str, dict[str, Doc]]:
        self.files = {}
        for kind in self.kinds:
            self._scan(kind)
            self.docs[kind] = self._view(kind)
        return {kind: dict(docs) for kind, docs in self.docs.items()}

    def poll(self) -> list[SyncEvent]:
        events: list[SyncEvent] = []
        now = time.time()
        for kind in self.kinds:
            if self._changed(kind):
                self._scan(kind)
            elif not any(f.expires is not None and f.expires <= now for f in self._live(kind)):
                continue
            new = self._view(kind)
            old = self.docs[kind]
            for key in sorted(old.keys() - new.keys()):
                events.append(SyncEvent("delete", kind, key, None, None))
            for key in sorted(new):
                before = old.get(key)
                if before is None or before.revision != new[key].revision:
                    events.append(SyncEvent("put", kind, key, new[key], None))
            self.docs[kind] = new
        return events

    def _live(self, kind: str) -> Iterator[_File]:
        known = self.docs[kind]
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
                        _log_warning("sync: left out %s", e)
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


def _check_revision(path: str, current: Doc | None, expected: int | None) -> None:
    if expected is None:
        if current is not None:
            raise RevisionConflict("document already exists", path)
    elif current is None:
        raise RevisionConflict("document vanished", path)
    elif current.revision != expected:
        raise RevisionConflict(
            "document changed", f"{path}: revision {current.revision}, expected {expected}"
        )


_process_locks: dict[str, threading.Lock] = {}
_process_locks_guard = threading.Lock()


def _process_lock(data_dir: str) -> threading.Lock:
    with _process_locks_guard:
        lock = _process_locks.get(data_dir)
        if lock is None:
            lock = _process_locks[data_dir] = threading.Lock()
        return lock
