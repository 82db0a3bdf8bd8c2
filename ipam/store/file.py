"""The default store: one JSON file per document under ``data_dir``.

Layout (``data_dir`` and every directory 0700, files 0600)::

    <data_dir>/lock                      flock(2) target; non-empty = a writer may have died
    <data_dir>/pools/<key>.json          kind "pool"      key: pool CIDR
    <data_dir>/blocks/<key>.json         kind "block"     key: block CIDR
    <data_dir>/handles/<key>.json        kind "handle"    key: "<network>:<container id>:<ifname>"
    <data_dir>/affinities/<key>.json     kind "affinity"  key: node name

A key is kept as is except characters outside ``[A-Za-z0-9_.:-]`` (and a leading ``.``),
which are percent-encoded (UTF-8), so ``10.244.0.64/26`` is ``10.244.0.64%2F26.json``. Names
starting with ``.`` are temp files only. A file holds
``{"format": 1, "kind": ..., "key": ..., "revision": N, "data": {...}}``.

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
always does); an unlocked ``put`` works, but may race with the temp-file cleanup.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import stat
import threading
import time
from types import TracebackType
from typing import Any

from ipam.core.errors import (
    InvalidConfig,
    LockTimeout,
    RevisionConflict,
    StoreCorrupt,
    StoreUnavailable,
)
from ipam.store.base import Doc, check_key, check_kind

FORMAT = 1
DIRS = {"pool": "pools", "block": "blocks", "handle": "handles", "affinity": "affinities"}
LOCK_NAME = "lock"
_SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_.:-")
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
_TMP_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_LOCK_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
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
            return self._read(dfd, kind, key, name)
        finally:
            os.close(dfd)

    def _read(self, dfd: int, kind: str, key: str, name: str) -> Doc | None:
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
        return Doc(data, rev)

    def list_keys(self, kind: str) -> list[str]:
        check_kind(kind)
        dfd = self._kind_fd(kind, create=False)
        if dfd is None:
            return []
        try:
            names = os.listdir(dfd)
        except OSError as e:
            path = os.path.join(self.data_dir, DIRS[kind])
            raise StoreCorrupt(path, e.strerror or str(e)) from None
        finally:
            os.close(dfd)
        keys = []
        for name in names:
            key = unescape_name(name)
            if key is not None:
                keys.append(key)
        keys.sort()
        return keys

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        check_kind(kind)
        check_key(key)
        name = escape_key(key)
        dfd = self._kind_fd(kind, create=True)
        if dfd is None:  # pragma: no cover - created just above
            raise StoreUnavailable(os.path.join(self.data_dir, DIRS[kind]), "missing")
        try:
            current = self._read(dfd, kind, key, name)
            path = os.path.join(self.data_dir, DIRS[kind], name)
            _check_revision(path, current, expected_revision)
            rev = max(current.revision + 1 if current else 1, time.time_ns() // 1000)
            doc = {"format": FORMAT, "kind": kind, "key": key, "revision": rev, "data": data}
            payload = json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()
            self._write(dfd, name, path, payload)
            return rev
        finally:
            os.close(dfd)

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

    def delete(self, kind: str, key: str, expected_revision: int) -> None:
        check_kind(kind)
        check_key(key)
        name = escape_key(key)
        path = os.path.join(self.data_dir, DIRS[kind], name)
        dfd = self._kind_fd(kind, create=False)
        if dfd is None:
            raise RevisionConflict("document vanished", path)
        try:
            current = self._read(dfd, kind, key, name)
            if current is None:
                raise RevisionConflict("document vanished", path)
            _check_revision(path, current, expected_revision)
            try:
                self._mark_dirty()
                os.unlink(name, dir_fd=dfd)
                os.fsync(dfd)
            except OSError as e:
                raise StoreUnavailable(path, e.strerror or str(e)) from None
        finally:
            os.close(dfd)

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
