"""Keep one BIRD running for tabby-node: start or adopt it, reload it on change, restart it
when it dies, stop it on request.

Files, all under the run directory the agent passes in: ``bird.conf`` (the configuration
BIRD runs), ``bird.conf.new`` (a candidate while ``bird -p`` checks it), ``bird.ctl`` (the
control socket), ``bird.pid`` and ``bird.log`` (BIRD's stderr; one older ``bird.log.1``).

* BIRD runs as ``bird -f -c bird.conf -s bird.ctl -P bird.pid`` in its own session with its
  output in a file, so it outlives a SIGKILLed tabby-node (no pipe to break, no terminal).
* :meth:`BirdSupervisor.start` first looks for a BIRD already serving the control socket (a
  previous tabby-node's): it adopts it (its PID from the socket's peer credentials) and
  reconfigures it; BGP sessions stay up. Otherwise it starts one, with ``-R`` (graceful
  restart recovery: kernel routes kept until the peers re-sent theirs) when a BIRD ran in
  this run directory before, i.e. its routes may still be in the kernel.
* Every text is checked with ``bird -p`` before BIRD may read it; a rejected text raises
  :class:`BirdConfigError` with BIRD's message and never replaces the running one.
* A change is a ``configure`` over the control socket, never a restart.
* A monitor thread waits on a pidfd; when BIRD dies it is started again with ``-R`` after a
  back-off (0.5 s doubling to 30 s; reset once a BIRD stayed up 30 s). It also keeps
  ``bird.log`` under 10 MiB (copy to ``bird.log.1``, truncate).
* :meth:`BirdSupervisor.stop` stops BIRD with SIGTERM (it closes its sessions with a
  notification: peers withdraw this node's routes at once; ``persist`` leaves its kernel
  routes in place); ``stop(graceful=True)`` (tabby-node's SIGTERM: a restart, an upgrade)
  with BIRD's ``graceful restart`` command instead: sessions closed without a notification,
  so peers keep this node's routes as stale until the next BIRD (started with ``-R``) has
  sent them again, for at most their graceful-restart time (BIRD's default 120 s); the
  kernel routes stay too. :meth:`BirdSupervisor.detach` stops supervising and leaves BIRD
  running for a successor.

The monitor thread and BIRD inherit the network namespace of the thread that calls
:meth:`BirdSupervisor.start`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import logging
import os
import select
import shutil
import signal
import subprocess
import threading
import time

from bird.control import (
    DEFAULT_SETTLE_SECONDS,
    BirdControl,
    BirdError,
    BirdStatus,
    BirdUnavailable,
    PeerStatus,
    SinceMemo,
    peer_statuses,
    readiness,
)
from bird.model import BirdConfig
from bird.render import render

log = logging.getLogger("tabby.node.bird")

CONF_NAME = "bird.conf"
CTL_NAME = "bird.ctl"
PID_NAME = "bird.pid"
LOG_NAME = "bird.log"
LOG_ROTATE_BYTES = 10 << 20
#: How often the monitor thread looks at the size of ``bird.log``.
LOG_CHECK_SECONDS = 60.0
_SUN_PATH_MAX = 107
_EXTRA_SBIN = ("/usr/local/sbin", "/usr/sbin", "/sbin")


class BirdConfigError(BirdError):
    """``bird -p`` rejected a configuration text; ``message`` is BIRD's."""

    def __init__(self, message: str) -> None:
        super().__init__(f"BIRD rejected the configuration: {message}")
        self.message = message


class BirdStartError(BirdError):
    """BIRD did not come up (it exited, or its control socket never answered)."""


def find_bird() -> str:
    """The ``bird`` binary on PATH (or in the usual sbin directories)."""
    found = shutil.which("bird")
    if found is None:
        path = os.pathsep.join([os.environ.get("PATH", ""), *_EXTRA_SBIN])
        found = shutil.which("bird", path=path)
    if found is None:
        raise BirdError("bird (BIRD 2) not found on PATH: install the bird2 package")
    return found


def check_config(path: str, bird: str | None = None, timeout: float = 30.0) -> None:
    """Raise :class:`BirdConfigError` unless ``bird -p -c path`` accepts the file."""
    proc = subprocess.run(
        [bird or find_bird(), "-p", "-c", path],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    if proc.returncode != 0:
        message = (proc.stderr.strip() or proc.stdout.strip()) or f"exit status {proc.returncode}"
        raise BirdConfigError(message.removeprefix("bird: "))


@dataclasses.dataclass(frozen=True)
class RunPaths:
    run_dir: str
    conf: str
    ctl: str
    pidfile: str
    log: str

    @classmethod
    def under(cls, run_dir: str) -> RunPaths:
        run_dir = os.path.abspath(run_dir)
        return cls(
            run_dir=run_dir,
            conf=os.path.join(run_dir, CONF_NAME),
            ctl=os.path.join(run_dir, CTL_NAME),
            pidfile=os.path.join(run_dir, PID_NAME),
            log=os.path.join(run_dir, LOG_NAME),
        )


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode("utf-8", "replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _is_our_bird(pid: int, ctl: str) -> bool:
    """Is ``pid`` a BIRD started with ``-s ctl`` (not a recycled PID)?"""
    args = _cmdline(pid)
    return any(a == "-s" and b == ctl for a, b in itertools.pairwise(args))


def _reap(pid: int) -> int | None:
    """Collect ``pid``'s exit status if it is our exited child; None otherwise."""
    try:
        done, status = os.waitpid(pid, os.WNOHANG)
    except ChildProcessError:
        return None
    return os.waitstatus_to_exitcode(status) if done == pid else None


def _pidfd_open(pid: int) -> int | None:
    """A pidfd for ``pid``; None when the process is gone."""
    try:
        return os.pidfd_open(pid)
    except ProcessLookupError:
        return None


def _wait_pidfd(pidfd: int, timeout: float | None) -> bool:
    """True once the process behind ``pidfd`` has exited (zombie or reaped)."""
    ready, _, _ = select.select([pidfd], [], [], timeout)
    return bool(ready)


class BirdSupervisor:
    """Starts (or adopts), reloads, restarts and stops one BIRD for tabby-node::

    sup = BirdSupervisor("/run/tabby")
    sup.start(config)          # adopt a running BIRD or start one
    sup.apply(new_config)      # True if the text changed and BIRD reloaded it
    sup.peers()                # BGP sessions for node status
    sup.readiness()            # [] when ready, else the reasons
    sup.stop(graceful=True)    # on SIGTERM; detach() leaves BIRD to a successor
    """

    def __init__(
        self,
        run_dir: str,
        *,
        bird: str | None = None,
        backoff_initial: float = 0.5,
        backoff_max: float = 30.0,
        stable_after: float = 30.0,
        start_timeout: float = 10.0,
        stop_timeout: float = 10.0,
    ) -> None:
        self.paths = RunPaths.under(run_dir)
        if len(self.paths.ctl.encode()) > _SUN_PATH_MAX:
            raise ValueError(f"control socket path too long for AF_UNIX: {self.paths.ctl}")
        self.bird = bird or find_bird()
        self.backoff_initial = backoff_initial
        self.backoff_max = backoff_max
        self.stable_after = stable_after
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        #: How many times BIRD was started again after it died.
        self.restarts = 0
        #: True if the running BIRD was found running (adopted), not started by us.
        self.adopted = False
        self.last_exit = ""

        self._lock = threading.RLock()
        self._pid: int | None = None
        self._pidfd: int | None = None
        self._started_at = 0.0
        self._text: str | None = None
        self._closing = False
        self._monitor: threading.Thread | None = None
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._memo = SinceMemo()
        self._memo_lock = threading.Lock()

    # ---- public API ------------------------------------------------------------------

    @property
    def pid(self) -> int | None:
        """PID of the BIRD being supervised (None while it is down)."""
        return self._pid

    @property
    def text(self) -> str | None:
        """The configuration text BIRD runs (the last one applied)."""
        return self._text

    def running(self) -> bool:
        with self._lock:
            return self._pidfd is not None and not _wait_pidfd(self._pidfd, 0)

    def start(self, config: BirdConfig | str) -> None:
        """Adopt the BIRD serving this run directory's control socket, or start one, and
        make it run ``config`` (a :class:`BirdConfig`, or text from :func:`render`).
        Raises :class:`BirdConfigError` (text rejected, nothing started or changed) or
        :class:`BirdStartError`."""
        text = config if isinstance(config, str) else render(config)
        with self._lock:
            if self._monitor is not None:
                raise RuntimeError("BirdSupervisor.start() called twice")
            os.makedirs(self.paths.run_dir, mode=0o755, exist_ok=True)
            # A BIRD ran here since boot (/run is emptied at boot, like the kernel's routes):
            # its routes may be in the kernel, so a new BIRD starts in graceful restart.
            recover = os.path.exists(self.paths.conf)
            self._write_checked(text)
            pid = self._find_running()
            if pid is not None:
                self._attach(pid, child=False)
                try:
                    self._configure()
                except BaseException:
                    self._forget_process()  # left running: a later start() adopts it again
                    raise
                log.info("adopted the running BIRD (pid %d) and reloaded it", pid)
            else:
                self._spawn(recover=recover)
            self._text = text
            self._monitor = threading.Thread(target=self._watch, name="bird-monitor", daemon=True)
            self._monitor.start()

    def apply(self, config: BirdConfig | str) -> bool:
        """Make BIRD run ``config``: False if the text is what it already runs; else check
        it, write it and reload BIRD (``configure``, sessions stay up). Raises
        :class:`BirdConfigError` for a text BIRD rejects (the old one stays in force)."""
        text = config if isinstance(config, str) else render(config)
        with self._lock:
            if self._monitor is None or self._closing:
                raise RuntimeError("BirdSupervisor is not running (start() first)")
            if text == self._text:
                return False
            self._write_checked(text)
            try:
                self._configure()
            except BirdUnavailable:
                if self.running():
                    raise
                log.info("BIRD is down; the new configuration applies when it restarts")
            self._text = text
            return True

    def stop(self, *, graceful: bool = False) -> None:
        """Stop BIRD and the monitor thread: SIGTERM (peers withdraw this node's routes),
        or with ``graceful`` BIRD's ``graceful restart`` (peers keep them until the next
        BIRD sent them again; module docstring); SIGKILL after ``stop_timeout``, which
        also leaves every route in place."""
        pid, pidfd = self._close_monitor()
        if pid is None or pidfd is None:
            return
        if graceful:
            log.info("stopping BIRD (pid %d) for a graceful restart: routes kept", pid)
            try:
                with self.control() as bird:
                    bird.graceful_restart()
            except BirdError as exc:
                # SIGKILL closes the sessions without a notification too (peers keep the
                # routes) and cannot clean the kernel up: the graceful outcome either way.
                log.warning("BIRD (pid %d) refused a graceful restart (%s): SIGKILL", pid, exc)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        else:
            log.info("stopping BIRD (pid %d)", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        if not _wait_pidfd(pidfd, self.stop_timeout):
            log.warning("BIRD (pid %d) ignored SIGTERM for %.0f s: SIGKILL", pid, self.stop_timeout)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            _wait_pidfd(pidfd, self.stop_timeout)
        _reap(pid)
        os.close(pidfd)
        with self._lock:
            self._pid = None

    def detach(self) -> None:
        """Stop supervising and leave BIRD running (a successor adopts it)."""
        _pid, pidfd = self._close_monitor()
        if pidfd is not None:
            os.close(pidfd)
        with self._lock:
            self._pid = None

    def control(self, timeout: float = 5.0) -> BirdControl:
        """A (not yet opened) client of this BIRD's control socket."""
        return BirdControl(self.paths.ctl, timeout)

    def peers(self) -> list[PeerStatus]:
        """tabby's BGP sessions; "since" stays fixed while a session keeps its state."""
        with self.control() as bird:
            protocols = bird.show_protocols()
        with self._memo_lock:
            return peer_statuses(protocols, self._memo)

    def status(self) -> BirdStatus:
        with self.control() as bird:
            return bird.show_status()

    def readiness(self, settle_seconds: float = DEFAULT_SETTLE_SECONDS) -> list[str]:
        """Why BGP is not ready; empty when it is (see :func:`control.readiness`)."""
        if not self.running():
            return ["BIRD is not running" + (f" ({self.last_exit})" if self.last_exit else "")]
        try:
            with self.control() as bird:
                status = bird.show_status()
                protocols = bird.show_protocols()
        except BirdError as exc:
            return [str(exc)]
        with self._memo_lock:
            peers = peer_statuses(protocols, self._memo)
        return readiness(status, peers, settle_seconds=settle_seconds)

    # ---- configuration ---------------------------------------------------------------

    def _write_checked(self, text: str) -> None:
        """Check ``text`` with ``bird -p`` and move it into place (atomically)."""
        candidate = self.paths.conf + ".new"
        with open(candidate, "w", encoding="utf-8") as f:
            f.write(text)
        try:
            check_config(candidate, self.bird)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(candidate)
            raise
        os.replace(candidate, self.paths.conf)

    def _configure(self) -> None:
        with self.control() as bird:
            answer = bird.configure(self.paths.conf)
        log.debug("BIRD reconfigured: %s", answer)

    # ---- process ---------------------------------------------------------------------

    def _find_running(self) -> int | None:
        """The PID of a BIRD already serving our control socket, or None. A BIRD of ours
        that is alive but does not answer within ``start_timeout`` is killed."""
        deadline = time.monotonic() + self.start_timeout
        while True:
            try:
                with self.control(timeout=2.0) as bird:
                    pid = bird.server_pid()
                    if _is_our_bird(pid, self.paths.ctl):
                        return pid
                    log.warning("pid %d answers on %s but is not our BIRD", pid, self.paths.ctl)
                    return None
            except BirdError:
                pass
            stale = self._pidfile_pid()
            if stale is None or not _is_our_bird(stale, self.paths.ctl):
                return None
            if time.monotonic() >= deadline:
                log.warning("BIRD (pid %d) does not answer on its control socket: SIGKILL", stale)
                pidfd = _pidfd_open(stale)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(stale, signal.SIGKILL)
                if pidfd is not None:
                    _wait_pidfd(pidfd, self.stop_timeout)
                    os.close(pidfd)
                _reap(stale)
                return None
            time.sleep(0.05)

    def _pidfile_pid(self) -> int | None:
        try:
            with open(self.paths.pidfile, encoding="ascii") as f:
                return int(f.read().strip() or "0") or None
        except (OSError, ValueError):
            return None

    def _attach(self, pid: int, *, child: bool) -> None:
        pidfd = _pidfd_open(pid)
        if pidfd is None:
            raise BirdStartError(f"BIRD (pid {pid}) exited before it could be supervised")
        self._pid, self._pidfd = pid, pidfd
        self._started_at = time.monotonic()
        self.adopted = not child

    def _rotate_log(self) -> None:
        """Keep ``bird.log`` under :data:`LOG_ROTATE_BYTES` (the run directory is usually a
        tmpfs): copy it to ``bird.log.1`` and truncate it in place; BIRD writes to it with
        O_APPEND, so its next line lands at the new end."""
        try:
            if os.path.getsize(self.paths.log) > LOG_ROTATE_BYTES:
                shutil.copyfile(self.paths.log, self.paths.log + ".1")
                os.truncate(self.paths.log, 0)
        except OSError as exc:
            log.debug("could not rotate %s: %s", self.paths.log, exc)

    def _open_log(self) -> int:
        self._rotate_log()
        return os.open(self.paths.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o644)

    def _log_tail(self, limit: int = 2000) -> str:
        try:
            with open(self.paths.log, "rb") as f:
                f.seek(max(0, os.path.getsize(self.paths.log) - limit))
                return f.read().decode("utf-8", "replace").strip()
        except OSError:
            return ""

    def _spawn(self, *, recover: bool) -> None:
        """Start BIRD and wait until it answers on its control socket."""
        args = [self.bird, "-f", "-c", self.paths.conf, "-s", self.paths.ctl]
        args += ["-P", self.paths.pidfile]
        if recover:
            args.append("-R")
        logfd = self._open_log()
        try:
            os.write(logfd, f"---- tabby-node: {' '.join(args)}\n".encode())
            pid = os.posix_spawn(
                self.bird,
                args,
                os.environ,
                file_actions=[
                    (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
                    (os.POSIX_SPAWN_DUP2, logfd, 1),
                    (os.POSIX_SPAWN_DUP2, logfd, 2),
                ],
                setsid=True,
                setsigmask=(),
                setsigdef=(signal.SIGPIPE, signal.SIGINT, signal.SIGTERM, signal.SIGHUP),
            )
        finally:
            os.close(logfd)
        self._attach(pid, child=True)
        assert self._pidfd is not None
        deadline = time.monotonic() + self.start_timeout
        while True:
            if _wait_pidfd(self._pidfd, 0.02):
                code = _reap(pid)
                self._forget_process()
                raise BirdStartError(f"BIRD exited at start (status {code}): {self._log_tail()}")
            try:
                with self.control(timeout=1.0) as bird:
                    if bird.server_pid() == pid:
                        break
            except BirdError:
                pass
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                _wait_pidfd(self._pidfd, self.stop_timeout)
                _reap(pid)
                self._forget_process()
                raise BirdStartError(
                    f"BIRD did not answer on {self.paths.ctl} within {self.start_timeout} s"
                )
        log.info("started BIRD (pid %d%s)", pid, ", graceful restart" if recover else "")

    def _forget_process(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
        self._pid = self._pidfd = None

    # ---- monitor thread ----------------------------------------------------------------

    def _close_monitor(self) -> tuple[int | None, int | None]:
        """Stop the monitor thread; the process it watched (pid, pidfd) is handed over."""
        with self._lock:
            self._closing = True
            monitor = self._monitor
        with contextlib.suppress(BlockingIOError):
            os.write(self._wake_w, b"x")
        if monitor is not None and monitor is not threading.current_thread():
            monitor.join()
        with self._lock:
            pid, pidfd = self._pid, self._pidfd
            self._pidfd = None
        return pid, pidfd

    def _sleep(self, seconds: float) -> bool:
        """Wait ``seconds``; False if woken to close."""
        ready, _, _ = select.select([self._wake_r], [], [], seconds)
        return not ready

    def _is_closing(self) -> bool:
        return self._closing

    def _watch(self) -> None:
        backoff = 0.0
        while True:
            with self._lock:
                if self._is_closing():
                    return
                pidfd, pid = self._pidfd, self._pid
            if pidfd is not None and pid is not None:
                ready, _, _ = select.select([pidfd, self._wake_r], [], [], LOG_CHECK_SECONDS)
                if self._wake_r in ready:
                    return
                if not ready:
                    self._rotate_log()
                    continue
                code = _reap(pid)
                with self._lock:
                    if self._is_closing():
                        return
                    lived = time.monotonic() - self._started_at
                    self._forget_process()
                    self.last_exit = f"pid {pid} exited" + (
                        f" with status {code}" if code is not None else ""
                    )
                backoff = (
                    self.backoff_initial
                    if lived >= self.stable_after or backoff == 0
                    else min(backoff * 2, self.backoff_max)
                )
                log.warning("BIRD %s; starting it again in %.1f s", self.last_exit, backoff)
            else:
                backoff = min(max(backoff * 2, self.backoff_initial), self.backoff_max)
            if not self._sleep(backoff):
                return
            with self._lock:
                if self._is_closing():
                    return
                try:
                    self._spawn(recover=True)
                    self.restarts += 1
                except (BirdError, OSError) as exc:
                    self.last_exit = str(exc)
                    log.error("could not start BIRD again: %s", exc)

    def __del__(self) -> None:
        for name in ("_wake_r", "_wake_w"):
            fd = getattr(self, name, None)
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


__all__ = [
    "BirdConfigError",
    "BirdStartError",
    "BirdSupervisor",
    "RunPaths",
    "check_config",
    "find_bird",
]
