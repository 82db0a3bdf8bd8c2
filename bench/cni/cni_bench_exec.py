"""Executing one plugin the way libcni does (timed), and the namespace and iproute2 plumbing
around it (untimed), for cni_bench.py."""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import json
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from bench.cni.cni_bench_pure import (
    CLONE_NEWNET,
    GNU_TIME,
    READ_CHUNK,
)

_libc: ctypes.CDLL | None = None


def setns_thread(fd: int) -> None:
    """Move the *calling thread* (only it: setns(2) is per thread) into a network namespace.

    Python 3.11 has no os.setns, so this goes through libc.
    """
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


@dataclass
class ExecResult:
    rc: int
    stdout: bytes
    stderr: bytes
    wall_ms: float
    cpu_ms: float
    rss_kb: int | None
    timed_out: bool = False


class Spawner:
    """fork+exec of one binary with stdin/stdout/stderr pipes, then wait4 for its rusage.

    ``os.posix_spawn`` (glibc: clone(CLONE_VM|CLONE_VFORK), as Go's os/exec does) is thread
    safe and its cost does not grow with the harness's heap; the child starts in the network
    namespace of the calling thread. Each child gets its own session so a terminal Ctrl-C
    never kills a plugin half-way through an ADD; on timeout the session is SIGKILLed.
    """

    def __init__(self, timeout: float, rss_dir: str | None = None) -> None:
        self.timeout = timeout
        self.rss_dir = rss_dir
        self._seq = 0
        self._lock = threading.Lock()

    def _rss_file(self) -> str:
        assert self.rss_dir is not None
        with self._lock:
            self._seq += 1
            seq = self._seq
        return os.path.join(self.rss_dir, f"call-{seq}")

    def run(self, path: str, env: Mapping[str, str], stdin: bytes) -> ExecResult:
        argv = [path]
        rss_file = None
        if self.rss_dir is not None:
            rss_file = self._rss_file()
            argv = [GNU_TIME, "-q", "-f", "%M", "-o", rss_file, path]
        in_r, in_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        parent_fds = [in_w, out_r, err_r]
        try:
            actions = [
                (os.POSIX_SPAWN_DUP2, in_r, 0),
                (os.POSIX_SPAWN_DUP2, out_w, 1),
                (os.POSIX_SPAWN_DUP2, err_w, 2),
            ]
            t0 = time.perf_counter_ns()
            try:
                pid = os.posix_spawn(
                    argv[0],
                    argv,
                    dict(env),
                    file_actions=actions,
                    setsid=True,
                    setsigmask=(),
                    setsigdef=(signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE),
                )
            finally:
                for fd in (in_r, out_w, err_w):
                    os.close(fd)
            parent_fds = []  # _communicate owns (and always closes) them from here on
            stdout, stderr, timed_out = self._communicate(pid, in_w, out_r, err_r, stdin)
            _, status, usage = os.wait4(pid, 0)
            t1 = time.perf_counter_ns()
        finally:
            for fd in parent_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        rss_kb = None
        if rss_file is not None:
            rss_kb = _read_rss(rss_file)
        return ExecResult(
            rc=os.waitstatus_to_exitcode(status),
            stdout=stdout,
            stderr=stderr,
            wall_ms=(t1 - t0) / 1e6,
            cpu_ms=(usage.ru_utime + usage.ru_stime) * 1000.0,
            rss_kb=rss_kb,
            timed_out=timed_out,
        )

    def _communicate(
        self, pid: int, in_w: int, out_r: int, err_r: int, data: bytes
    ) -> tuple[bytes, bytes, bool]:
        """Write stdin and drain stdout/stderr without deadlock; closes the three fds."""
        bufs: dict[int, list[bytes]] = {out_r: [], err_r: []}
        poller = select.poll()
        open_fds = {out_r, err_r}
        poller.register(out_r, select.POLLIN)
        poller.register(err_r, select.POLLIN)
        view = memoryview(data)
        offset = 0
        if data:
            os.set_blocking(in_w, False)
            poller.register(in_w, select.POLLOUT)
            open_fds.add(in_w)
        else:
            os.close(in_w)
        deadline = time.monotonic() + self.timeout
        timed_out = False
        try:
            while open_fds:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    if timed_out:  # killed and still not drained: a daemon holds the pipe
                        break
                    timed_out = True
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(pid, signal.SIGKILL)
                    deadline = time.monotonic() + 5.0
                    continue
                for fd, ev in poller.poll(max(1, int(remaining * 1000))):
                    if fd == in_w:
                        if ev & (select.POLLERR | select.POLLHUP):
                            done = True
                        else:
                            try:
                                offset += os.write(in_w, view[offset : offset + READ_CHUNK])
                            except BlockingIOError:
                                pass
                            except BrokenPipeError:
                                offset = len(view)
                            done = offset >= len(view)
                        if done:
                            poller.unregister(in_w)
                            open_fds.discard(in_w)
                            os.close(in_w)
                        continue
                    chunk = os.read(fd, READ_CHUNK)
                    if chunk:
                        bufs[fd].append(chunk)
                    else:
                        poller.unregister(fd)
                        open_fds.discard(fd)
                        os.close(fd)
        finally:
            for fd in open_fds:
                with contextlib.suppress(OSError):
                    os.close(fd)
        return b"".join(bufs[out_r]), b"".join(bufs[err_r]), timed_out


def _read_rss(path: str) -> int | None:
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            lines = [ln.strip() for ln in f if ln.strip()]
        os.unlink(path)
    except OSError:
        return None
    if lines and lines[-1].isdigit():
        return int(lines[-1])
    return None


class BenchError(Exception):
    """A usage or setup problem (exit 2)."""


class Interrupted(KeyboardInterrupt):
    """SIGTERM/SIGHUP, treated like Ctrl-C."""


def run_ip(args: Sequence[str], *, stdin: str | None = None, check: bool = True) -> str:
    proc = subprocess.run(
        ["ip", *args], input=stdin, capture_output=True, text=True, timeout=120, check=False
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def ip_json(netns: str | None, *args: str) -> list[dict[str, Any]]:
    prefix = ["-n", netns] if netns else []
    out = run_ip(["-j", *prefix, *args])
    data = json.loads(out) if out.strip() else []
    return [d for d in data if isinstance(d, dict)]


def host_route_ips(netns: str | None) -> set[str]:
    """Addresses that have a host route (/32, /128) in any routing table of the namespace."""
    found: set[str] = set()
    for family in ("-4", "-6"):
        try:
            routes = ip_json(netns, family, "route", "show", "table", "all")
        except RuntimeError:
            if family == "-4":
                raise
            continue  # IPv6 disabled on this kernel
        for route in routes:
            dst = route.get("dst")
            if not dst or dst == "default":
                continue
            with contextlib.suppress(ValueError):
                net = ipaddress.ip_network(dst, strict=False)
                if net.prefixlen == net.max_prefixlen:
                    found.add(str(net.network_address))
    return found
