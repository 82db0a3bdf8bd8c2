"""tabby-node: serve CNI calls for the thin binaries, with pyroute2 and the IPAM warm.

Each connection is one CNI call, handled in its own thread. The thread enters the
*caller's* network namespace (an fd passed over the socket) before doing anything, so the
host-side work lands where the binary was run, never in the node process's own namespace;
setns(2) is per thread, so concurrent calls do not disturb each other. When a ``tabby`` ADD
delegates to ``tabby-ipam`` the IPAM runs in-process through the very same handlers the
binary would run, so results are identical; any other IPAM type is exec'd as the spec says.
What a call writes to stderr (a delegate's stderr, tabby's warnings) is captured per call
and relayed to the caller with the answer. One tabby-node per run directory (the socket's
directory): a second one exits with one line instead of racing the first for the socket.

Its bounds (``daemon.limits``; docs/node.md "Limits"): at most ``max_calls`` connections
at once (one more is answered "R" at once: its client runs the call itself), a request of
at most ``max_request_bytes`` read whole within REQUEST_WITHIN seconds of its connection
(else "R", or the connection dropped), and the answer sent only within the time its client
waits for it (the call's lock_timeout_seconds + ANSWER_GRACE).
"""

from __future__ import annotations

import logging
import os
import socket
import struct
import threading
import time
from typing import TYPE_CHECKING

from filelock import FileLock, Timeout

from bundle import __version__
from cni_plugin import plugin
from cni_protocol import phases, skel
from daemon.limits import Gate, Limits, Refusals, send_now
from tabby_node import (
    ACCEPT,
    ANSWER_GRACE,
    MAGIC,
    MAX_CALLS,
    MAX_REQUEST,
    MAX_STDERR,
    REJECT,
    REQUEST_WITHIN,
    decode_header,
    recv_exact,
)
from tabby_node.client import lock_timeout

if TYPE_CHECKING:
    from stores import Stores
    from tabby_node.view import CallHooks

log = logging.getLogger("tabby.node")
_U32x2 = struct.Struct("!II")
_U32x3 = struct.Struct("!III")
_PEERCRED = struct.Struct("3i")
#: The node socket's bounds; ``answer_within`` is beyond the call's lock_timeout_seconds.
LIMITS = Limits(MAX_CALLS, MAX_REQUEST, REQUEST_WITHIN, ANSWER_GRACE)
#: The node socket's name where refusals are counted (the ``server`` label).
SERVER_NAME = "cni"
#: In the run directory: held (flock) by the tabby-node that serves it, while it runs.
LOCK_NAME = "tabby-node.lock"


class InProcessIpam:
    """tabby-node's IPAM invoker: tabby-ipam's verbs run in this thread on the call's
    already parsed and validated arguments (nothing is parsed twice), their datastore work
    on ``stores`` (tabby-node's served store), so the results are the binary's; any other
    IPAM type is exec'd as the spec says. ``verbs``: tabby-ipam's, when the caller has
    them (tabby-node: with the group commit its ADDs share)."""

    def __init__(self, stores: Stores | None = None, verbs: skel.Handlers | None = None) -> None:
        from ipam.plugin import IpamVerbs
        from stores import STANDALONE

        self.verbs = verbs if verbs is not None else IpamVerbs(stores or STANDALONE).handlers()

    def start(self, ipam_type: str, command: str, args: skel.CmdArgs) -> plugin.Pending:
        if ipam_type != "tabby-ipam":
            return plugin.ExecIpam().start(ipam_type, command, args)
        from cni_protocol.invoke import delegate_env

        result = skel.call(self.verbs, args.delegated(command, delegate_env(args.env, command)))
        return lambda: result


def node_handlers(
    stores: Stores | None = None,
    endpoints: plugin.EndpointRecorder | None = None,
    mtu_file: str | None = None,
    ipam_verbs: skel.Handlers | None = None,
) -> skel.Handlers:
    """tabby's handlers as tabby-node runs them: tabby-ipam in-process, both on the node's
    ``stores``; the endpoint recorder tabby-node gives (``tabby_node.pod_policy.PodEndpoints``:
    it programs a new pod's policy before the ADD answers), and the node's own MTU file for
    pods whose conflist says ``"mtu": 0``."""
    return plugin.Plugin(
        ipam=InProcessIpam(stores, ipam_verbs),
        endpoints=endpoints,
        mtu_file=mtu_file,
        validate_first=True,
    ).handlers()


def execute(
    role: str,
    env: dict[str, str],
    stdin: bytes,
    netns_fd: int,
    mnt_fd: int | None = None,
    handlers: skel.Handlers | None = None,
    ipam_handlers: skel.Handlers | None = None,
) -> tuple[int, bytes]:
    """Run one CNI call in the calling thread, inside the caller's network namespace (and
    mount namespace, when it differs from ours: then paths in env and config mean what
    they mean to the caller). The thread must not be reused after a mount switch."""
    from cni_protocol import log as cni_log
    from dataplane.netns import THREAD_NETNS, enter_mount_namespace, setns

    st = os.fstat(netns_fd)
    caller_ns = (st.st_dev, st.st_ino)
    home = os.open(THREAD_NETNS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        if mnt_fd is not None:
            mine, theirs = os.stat("/proc/thread-self/ns/mnt"), os.fstat(mnt_fd)
            if (mine.st_dev, mine.st_ino) != (theirs.st_dev, theirs.st_ino):
                enter_mount_namespace(mnt_fd)
        setns(netns_fd)
        try:
            if role == "tabby-ipam":
                from ipam import plugin as ipam_plugin

                return skel.run(
                    ipam_handlers if ipam_handlers is not None else ipam_plugin.HANDLERS,
                    env,
                    stdin,
                    own_netns=caller_ns,
                    before_dispatch=ipam_plugin.configure_logging,
                )
            return skel.run(
                handlers if handlers is not None else node_handlers(),
                env,
                stdin,
                own_netns=caller_ns,
                before_dispatch=plugin.configure_logging,
            )
        finally:
            setns(home)
            cni_log.end_call()
    finally:
        os.close(home)


def claim_run_dir(path: str) -> FileLock:
    """Own the directory of socket ``path`` (one tabby-node per run directory) for as long
    as the returned lock is held; SystemExit with one line when another tabby-node holds
    it. Probing the socket alone races: two nodes starting together both find no live
    socket, both bind, and the first one ends up serving a path the second one unlinked."""
    directory = os.path.dirname(path)
    os.makedirs(directory, mode=0o700, exist_ok=True)
    lock = FileLock(os.path.join(directory, LOCK_NAME), mode=0o600, thread_local=False)
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise SystemExit(
            f"tabby-node: another tabby-node is running in {directory} (it holds {lock.lock_file})"
        ) from None
    return lock


def release_run_dir(path: str, lock: FileLock) -> None:
    """Give the run directory of socket ``path`` up (``lock``: :func:`claim_run_dir`'s),
    with the socket left there by a node that served it before."""
    try:
        os.unlink(path)
    except OSError:
        pass
    lock.release()


class NodeServer:
    """The socket the plugins' calls come in on (``path``). ``metrics``: counts every call
    served. ``claimed``: the caller holds the run directory (:func:`claim_run_dir`) and
    gives it up; else :meth:`bind` claims it and :meth:`stop` gives it up. ``limits``
    (default :data:`LIMITS`): what it serves at once, how large and how fast a request;
    ``refusals``: where what it refused is counted."""

    def __init__(
        self,
        path: str,
        endpoints: plugin.EndpointRecorder | None = None,
        mtu_file: str | None = None,
        stores: Stores | None = None,
        *,
        metrics: CallHooks | None = None,
        claimed: bool = False,
        limits: Limits = LIMITS,
        refusals: Refusals | None = None,
    ) -> None:
        from ipam.group import GroupCommit
        from ipam.plugin import IpamVerbs

        self.path = path
        #: tabby-ipam's verbs, the in-process ones and a tabby-ipam binary's served alike:
        #: one group commit for the ADDs of both (``ipam.group``)
        self.group = GroupCommit(stores) if stores is not None else None
        self.ipam_handlers = (
            IpamVerbs(stores, self.group).handlers() if stores is not None else None
        )
        self.handlers = node_handlers(stores, endpoints, mtu_file, self.ipam_handlers)
        self.sock: socket.socket | None = None
        self.stopping = threading.Event()
        self.inflight: set[threading.Thread] = set()
        self.lock = threading.Lock()
        self.served = 0
        self.claimed = claimed
        self.run_dir_lock: FileLock | None = None
        self.metrics = metrics
        self.limits = limits
        self.gate = Gate(limits.max_connections)
        self.refusals = refusals if refusals is not None else Refusals()
        self.refusals.register(SERVER_NAME)

    # -- lifecycle ---------------------------------------------------------------------

    def claim(self) -> None:
        """Own the socket's directory (:func:`claim_run_dir`), unless the caller or this
        server does."""
        if not self.claimed and self.run_dir_lock is None:
            self.run_dir_lock = claim_run_dir(self.path)

    def bind(self) -> None:
        self.claim()
        if os.path.lexists(self.path):
            probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                probe.connect(self.path)
            except OSError:
                os.unlink(self.path)  # stale socket of a dead node
            else:
                raise SystemExit(f"tabby-node: another tabby-node serves {self.path}")
            finally:
                probe.close()
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            sock.bind(self.path)
        finally:
            os.umask(old)
        os.chmod(self.path, 0o600)
        sock.listen(128)
        self.sock = sock

    def serve_forever(self) -> None:
        assert self.sock is not None
        self.sock.settimeout(0.5)
        while not self.stopping.is_set():
            try:
                conn, _ = self.sock.accept()
            except TimeoutError:
                continue
            except OSError:
                if self.stopping.is_set():
                    break
                raise
            if not self.gate.enter():  # limits: refused here, no thread for it
                self.refusals.count(SERVER_NAME, "busy", f"{self.gate.limit} calls at once")
                send_now(conn, REJECT + b"busy")
                conn.close()
                continue
            conn.settimeout(None)
            t = threading.Thread(target=self._handle, args=(conn,), daemon=True)
            with self.lock:
                self.inflight.add(t)
            t.start()

    def stop(self, grace: float = 30.0) -> None:
        """Stop accepting (new calls fall back in-process), finish the calls in flight."""
        self.stopping.set()
        try:
            os.unlink(self.path)
        except OSError:
            pass
        if self.sock is not None:
            self.sock.close()
        deadline = time.monotonic() + grace
        while True:
            with self.lock:
                alive = [t for t in self.inflight if t.is_alive()]
            if not alive or time.monotonic() > deadline:
                break
            alive[0].join(timeout=0.1)
        if self.run_dir_lock is not None:
            self.run_dir_lock.release()
            self.run_dir_lock = None

    # -- one call ------------------------------------------------------------------------

    def _peer_ok(self, conn: socket.socket) -> bool:
        raw = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size)
        _pid, uid, _gid = _PEERCRED.unpack(raw)
        return uid in (0, os.geteuid())

    def _handle(self, conn: socket.socket) -> None:
        from cni_protocol import log as cni_log

        fds: list[int] = []
        call = ""
        # the call's time from here to its answer, and the process's CPU meanwhile (every
        # thread's: the policy's and the group commit's work for this call too)
        started, cpu = time.perf_counter(), time.process_time()
        try:
            if not self._peer_ok(conn):
                log.warning("refused a connection from a non-root peer")
                return
            read_by = time.monotonic() + self.limits.read_within  # limits
            conn.settimeout(self.limits.read_within)
            first, fds, _flags, _addr = socket.recv_fds(conn, 65536, 2)
            if not first:
                log.debug("a client connected and left without a request")
                return
            head = recv_exact(conn, 12, read_by, first[:12]) if len(first) < 12 else first[:12]
            if head[:4] != MAGIC:
                conn.sendall(REJECT + b"not a tabby-node request")
                return
            hlen, slen = _U32x2.unpack(head[4:])
            if hlen + slen > self.limits.max_request_bytes:
                self.refusals.count(SERVER_NAME, "too_large", f"{hlen + slen} bytes")
                conn.sendall(REJECT + b"request too large")
                return
            if len(fds) != 2:
                conn.sendall(REJECT + b"malformed request")
                return
            body = recv_exact(conn, hlen + slen, read_by, first[12:])
            version, role, env = decode_header(body[:hlen])
            stdin = body[hlen:]
            if version != __version__:
                conn.sendall(REJECT + f"tabby-node is {__version__}".encode())
                return
            netns_fd, mnt_fd = fds
            if _ns_kind(netns_fd) != "net" or _ns_kind(mnt_fd) != "mnt":
                conn.sendall(REJECT + b"not namespace fds")
                return
            # A client that gave up waiting has shut its side down: this send fails, and the
            # call, which the client now runs itself, is not started here.
            conn.sendall(ACCEPT)
            call = f"{role} {env.get('CNI_COMMAND', '')} {env.get('CNI_CONTAINERID', '')[:12]}"
            answer_by = time.monotonic() + lock_timeout(stdin) + self.limits.answer_within
            cni_log.begin_stderr_capture()
            phases.begin()
            try:
                rc, out = execute(
                    role, env, stdin, netns_fd, mnt_fd, self.handlers, self.ipam_handlers
                )
            finally:
                err = cni_log.end_stderr_capture(MAX_STDERR)
            if self.metrics is not None:  # metrics (counted before the answer goes out)
                seconds = time.perf_counter() - started
                self.metrics.cni_request(
                    env.get("CNI_COMMAND", ""),
                    rc,
                    out,
                    seconds,
                    phases.end(seconds),
                    time.process_time() - cpu,
                )
            self._send_answer(
                conn, _U32x3.pack(rc, len(out), len(err)) + out + err, answer_by, call
            )
            with self.lock:
                self.served += 1
        except (EOFError, ConnectionError, TimeoutError) as e:
            # Probes, a caller killed or timed out mid-call: normal life for a daemon.
            if isinstance(e, TimeoutError) and not call:  # limits: its request too slow
                self.refusals.count(SERVER_NAME, "timeout", "request not read in time")
                return
            if call:
                log.info("the caller of %s left before its answer (%s)", call, _why(e))
            else:
                log.debug("a client left before its call was accepted (%s)", _why(e))
        except Exception:
            log.exception("tabby-node: a call failed outside the CNI error path")
        finally:
            for fd in fds:
                os.close(fd)
            conn.close()
            with self.lock:
                self.inflight.discard(threading.current_thread())
            self.gate.leave()

    def _send_answer(self, conn: socket.socket, answer: bytes, by: float, call: str) -> None:
        """The answer, sent by ``by`` (when its client stops waiting): a call that ran past
        it, or a client that does not read its answer, holds the worker no longer."""
        left = by - time.monotonic()
        if left <= 0:
            self.refusals.count(SERVER_NAME, "overdue", f"{call} answered {-left:.1f} s late")
            send_now(conn, answer)
            return
        conn.settimeout(left)
        try:
            conn.sendall(answer)
        except TimeoutError:
            self.refusals.count(SERVER_NAME, "overdue", f"the caller of {call} did not read")


def _why(e: BaseException) -> str:
    return str(e) or type(e).__name__


def _ns_kind(fd: int) -> str:
    """ "net" or "mnt" for a namespace fd (its /proc link reads "net:[4026531840]")."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}").partition(":")[0]
    except OSError:
        return ""


def warm_up() -> None:
    """Import everything a call needs now, so no call pays for it."""
    import dataplane  # noqa: F401
    from cni_plugin import cni_codes, plugin  # noqa: F401
    from dataplane import linux  # noqa: F401  (pyroute2)
    from ipam import plugin as ipam_plugin  # noqa: F401
