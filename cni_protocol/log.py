"""Logging for short-lived CNI processes: a size-rotated file shared by many processes.

Never stdout (CONFORMANCE.md GEN-5). Warnings and errors also go to stderr (docs/configuration.md
"`tabby` fields", ``log_file_path``).
``logging.handlers.RotatingFileHandler`` is not safe when many processes append and
rotate the same file at once; this handler appends with O_APPEND (one write per record,
so records never interleave) and rotates under an flock, re-checking the size after
taking it so that only one process rotates.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading

DEFAULT_LOG_FILE = "/var/log/tabby/cni.log"
MAX_BYTES = 10 * 1024 * 1024
BACKUPS = 5
LEVELS = {
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warning": logging.WARNING,
    "error": logging.ERROR,
}

_FORMAT = "%(asctime)s %(process)d %(levelname)s %(name)s [%(cni)s] %(message)s"


class _ContextFilter(logging.Filter):
    """Stamps every record with the call it belongs to (verb and container id).

    Per thread: tabby-node serves several calls at once.
    """

    def __init__(self) -> None:
        super().__init__()
        self.local = threading.local()

    def filter(self, record: logging.LogRecord) -> bool:
        record.cni = getattr(self.local, "context", "-")
        return True


class SharedRotatingFileHandler(logging.Handler):
    def __init__(self, path: str, max_bytes: int = MAX_BYTES, backups: int = BACKUPS) -> None:
        super().__init__()
        self.path = path
        self.max_bytes = max_bytes
        self.backups = backups

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode("utf-8", "replace")
            fd = self._open()
            if fd is None:
                return  # no writable log directory (e.g. not root): stderr still gets warnings
            try:
                os.write(fd, data)
                if os.fstat(fd).st_size > self.max_bytes:
                    self._rotate(fd)
            finally:
                os.close(fd)
        except Exception:  # a log failure must never fail a CNI call
            self.handleError(record)

    def _open(self) -> int | None:
        """The file, opened for appending; its directory (mode 0700) is made by the first
        record, not before: a process that writes nothing to a file creates nothing for it
        (a CNI call reads its ``log_file_path`` only after its logging is set up)."""
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            return os.open(self.path, flags, 0o600)
        except FileNotFoundError:
            pass
        except OSError:
            return None
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o700, exist_ok=True)
            return os.open(self.path, flags, 0o600)
        except OSError:
            return None

    def _rotate(self, fd: int) -> None:
        fcntl.flock(fd, fcntl.LOCK_EX)
        try:
            try:
                if os.stat(self.path).st_size <= self.max_bytes:
                    return  # another process rotated while we waited
            except FileNotFoundError:
                return
            for i in range(self.backups - 1, 0, -1):
                src = f"{self.path}.{i}"
                if os.path.exists(src):
                    os.replace(src, f"{self.path}.{i + 1}")
            os.replace(self.path, f"{self.path}.1")
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)


class _NoTracebackFormatter(logging.Formatter):
    """For stderr: the message only. Tracebacks go to the log file, never to stderr."""

    def format(self, record: logging.LogRecord) -> str:
        plain = logging.makeLogRecord(record.__dict__)
        plain.exc_info = None
        plain.exc_text = None
        plain.stack_info = None
        return super().format(plain)


# Until setup() runs, tabby's records go nowhere: without a handler Python's last-resort
# handler would print them, tracebacks included, on stderr.
logging.getLogger("tabby").addHandler(logging.NullHandler())
logging.getLogger("tabby").propagate = False

_context = _ContextFilter()
_configured: list[logging.Handler] = []
_current: list[tuple[str, str | None, bool]] = []
_setup_lock = threading.Lock()


def setup(level: str = "info", path: str | None = DEFAULT_LOG_FILE, *, stderr: bool = True) -> None:
    """(Re)configure the ``tabby`` logger. Safe to call more than once, from any thread."""
    with _setup_lock:
        if _current == [(level, path, stderr)]:
            return
        _current[:] = [(level, path, stderr)]
        _setup(level, path, stderr)


def _setup(level: str, path: str | None, stderr: bool) -> None:
    root = logging.getLogger("tabby")
    for h in _configured:
        root.removeHandler(h)
    _configured.clear()
    root.setLevel(LEVELS.get(level.lower(), logging.INFO))
    root.propagate = False
    fmt = logging.Formatter(_FORMAT)
    if path:
        fh = SharedRotatingFileHandler(path)
        fh.setFormatter(fmt)
        fh.addFilter(_context)
        _configured.append(fh)
    if stderr:
        sh = logging.StreamHandler(sys.stderr)
        sh.setLevel(logging.WARNING)
        sh.setFormatter(_NoTracebackFormatter(_FORMAT))
        sh.addFilter(_context)
        _configured.append(sh)
    for h in _configured:
        root.addHandler(h)


def set_context(text: str) -> None:
    _context.local.context = text


def configure_for_call(level: str, path: str, command: str, container_id: str, ifname: str) -> None:
    """Apply a call's validated ``log_level``/``log_file_path``; tag records with the call."""
    level_s = level
    path_s = path or DEFAULT_LOG_FILE
    set_context(f"{command} {container_id[:12] or '-'} {ifname or '-'}")
    if _resident:
        # tabby-node: this thread's records go to this call's file at this call's level;
        # the process-wide handlers stay as the daemon set them.
        _call.target = (LEVELS.get(level_s.lower(), logging.INFO), path_s)
        return
    setup(level_s, path_s)


_call = threading.local()
_resident: list[bool] = []


class _PerCallFileHandler(logging.Handler):
    """In tabby-node, each call's records go to the file its network config names."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.files: dict[str, SharedRotatingFileHandler] = {}
        self.guard = threading.Lock()

    def emit(self, record: logging.LogRecord) -> None:
        target = getattr(_call, "target", None)
        if target is None or record.levelno < target[0]:
            return
        with self.guard:
            handler = self.files.get(target[1])
            if handler is None:
                try:
                    os.makedirs(os.path.dirname(target[1]) or ".", mode=0o700, exist_ok=True)
                except OSError:
                    return
                handler = SharedRotatingFileHandler(target[1])
                handler.setFormatter(logging.Formatter(_FORMAT))
                self.files[target[1]] = handler
        handler.emit(record)


def setup_resident(level: str, path: str | None) -> None:
    """Logging for a long-lived process that serves many calls (tabby-node). Without a
    log file stderr is its only log (a container's: ``kubectl logs``), at ``level``."""
    setup(level, path)
    if not path:
        for h in _configured:
            if type(h) is logging.StreamHandler:
                h.setLevel(LEVELS.get(level.lower(), logging.INFO))
    _resident.append(True)
    handler = _PerCallFileHandler()
    handler.addFilter(_context)
    root = logging.getLogger("tabby")
    root.addHandler(handler)
    root.addHandler(call_stderr_handler())
    root.setLevel(logging.DEBUG)
    for h in _configured:
        if h.level == logging.NOTSET:
            h.setLevel(LEVELS.get(level.lower(), logging.INFO))


def end_call() -> None:
    _call.target = None
    set_context("-")


# -- a call's stderr, captured (tabby-node) -------------------------------------------------
# Standalone, a call's stderr is the caller's: a delegated plugin inherits it and the stderr
# handler above writes tabby's warnings and errors there. tabby-node serves the call in one
# of its threads; it captures the same output in a memory file per call and sends it back
# with the answer, for the client to write to its caller's stderr.


def begin_stderr_capture() -> None:
    """From here on, what this thread's call writes to stderr goes to a per-call buffer."""
    end_stderr_capture()
    _call.stderr_fd = os.memfd_create("tabby-call-stderr", os.MFD_CLOEXEC)


def stderr_capture_fd() -> int | None:
    """The fd a delegated plugin gets as its stderr, when this thread captures stderr."""
    fd: int | None = getattr(_call, "stderr_fd", None)
    return fd


def end_stderr_capture(limit: int = 1 << 20) -> bytes:
    """Stop capturing; what was captured (at most ``limit`` bytes, then a note of the rest)."""
    fd = stderr_capture_fd()
    if fd is None:
        return b""
    _call.stderr_fd = None
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, min(size, limit), 0)
    except OSError:
        return b""
    finally:
        os.close(fd)
    if size > len(data):
        data += f"\n[{size - len(data)} more bytes of stderr not relayed]\n".encode()
    return data


class _CallStderrHandler(logging.Handler):
    """In tabby-node, each call's warnings and errors go to that call's captured stderr,
    formatted as the stderr handler formats them standalone."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        fd = stderr_capture_fd()
        target = getattr(_call, "target", None)
        if fd is None or (target is not None and record.levelno < target[0]):
            return
        try:
            os.write(fd, (self.format(record) + "\n").encode("utf-8", "replace"))
        except Exception:
            self.handleError(record)


def call_stderr_handler() -> logging.Handler:
    """The handler that copies a call's warnings and errors to its captured stderr."""
    relay = _CallStderrHandler()
    relay.setFormatter(_NoTracebackFormatter(_FORMAT))
    relay.addFilter(_context)
    return relay
