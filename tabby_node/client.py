"""The binaries' side of the tabby-node fast path: forward the call, relay the answer.

Imported first in every CNI process, so it uses only C modules (``_socket``, ``struct``,
``time``): ``socket.py`` and ``json`` would pull in enum, selectors and re (~8 ms per call,
measured), which is a third of what the whole fast path may cost. ``json`` is imported only
to write an error answer.

A wedged node never hangs the caller (the bounds are described in ``tabby_node``):
every socket operation runs against a deadline, ACCEPT_WITHIN before "A", the call's
lock_timeout_seconds + ANSWER_GRACE after it.
"""

from __future__ import annotations

import _socket
import os
import struct
import time

from tabby_node import (
    ACCEPT,
    ACCEPT_WITHIN,
    ANSWER_GRACE,
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_SOCKET,
    MAGIC,
    SOCKET_ENV,
    encode_header,
    recv_exact,
)

TYPE_CHECKING = False  # typing itself costs ~2 ms on the fast path
if TYPE_CHECKING:
    from collections.abc import Mapping

_U32x2 = struct.Struct("!II")
_U32x3 = struct.Struct("!III")
_KEY = b'"lock_timeout_seconds"'
_BLANK = b" \t\r\n"
_NUMBER = b"0123456789.eE+-"
#: A config may ask for a long lock wait, but not for an endless one.
_MAX_LOCK_TIMEOUT = 1e7


def lock_timeout(stdin: bytes) -> float:
    """The call's ``lock_timeout_seconds``, read from the raw config without a JSON parser.

    The key may appear more than once (the ``ipam`` section is where it counts, but a
    config may carry it elsewhere too): the largest number wins, since waiting longer is
    the safe side. DEFAULT_LOCK_TIMEOUT when no occurrence reads as a number > 0.
    """
    found = 0.0
    n = len(stdin)
    at = stdin.find(_KEY)
    while at >= 0:
        i = at + len(_KEY)
        while i < n and stdin[i] in _BLANK:
            i += 1
        if i < n and stdin[i] == 0x3A:  # ":"
            i += 1
            while i < n and stdin[i] in _BLANK:
                i += 1
            j = i
            while j < n and stdin[j] in _NUMBER:
                j += 1
            try:
                value = float(stdin[i:j])
            except ValueError:
                value = 0.0
            if value > found:
                found = value
        at = stdin.find(_KEY, at + 1)
    if found <= 0:
        return DEFAULT_LOCK_TIMEOUT
    return min(found, _MAX_LOCK_TIMEOUT)


def _send_request(
    sock: _socket.socket,
    role: str,
    env: Mapping[str, str],
    stdin: bytes,
    version: str,
    deadline: float,
) -> None:
    header = encode_header(version, role, env)
    msg = MAGIC + _U32x2.pack(len(header), len(stdin)) + header + stdin
    # The node works in our namespaces: network (host-side work lands here) and
    # mount (CNI_NETNS, data_dir and log paths mean what they mean here).
    net_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
    mnt_fd = os.open("/proc/thread-self/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        fds = struct.pack("ii", net_fd, mnt_fd)
        sent = sock.sendmsg([msg], [(_socket.SOL_SOCKET, _socket.SCM_RIGHTS, fds)])
    finally:
        os.close(net_fd)
        os.close(mnt_fd)
    view = memoryview(msg)
    while sent < len(msg):
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        sock.settimeout(left)
        sent += sock.send(view[sent:])


def _error(stdin: bytes, msg: str, details: str) -> bytes:
    import json

    try:
        version = json.loads(stdin).get("cniVersion") or "1.1.0"
    except Exception:
        version = "1.1.0"
    err = {"cniVersion": version, "code": 11, "msg": msg, "details": details}
    return json.dumps(err, separators=(",", ":")).encode() + b"\n"


def _write_stderr(data: bytes) -> None:
    view = memoryview(data)
    try:
        while view:
            view = view[os.write(2, view) :]
    except OSError:
        pass  # no stderr to write to: the call's answer still goes out


def _not_accepted(sock: _socket.socket, stdin: bytes) -> tuple[int, bytes] | None:
    """No "A" in time, or the connection failed before it. Shut our side down first: from
    then on a node that gets to the call late can no longer send "A" (its send fails), so it
    never starts the call. Then look whether "A" arrived just before: only then may the
    call be running there, and running it here too would do it twice."""
    try:
        sock.shutdown(_socket.SHUT_RD)
        sock.setblocking(False)
        late = sock.recv(1)
    except OSError:  # never connected, or nothing arrived
        return None
    if late != ACCEPT:
        return None
    return 1, _error(
        stdin,
        "tabby-node accepted this call too late",
        f"not accepted within {ACCEPT_WITHIN:g} s; it may have been partly done there; "
        "the runtime should retry",
    )


def _answer(sock: _socket.socket, stdin: bytes) -> tuple[int, bytes]:
    """After "A": the node's answer within the call's bounds, or code 11."""
    wait = lock_timeout(stdin) + ANSWER_GRACE
    deadline = time.monotonic() + wait
    try:
        rc, n_out, n_err = _U32x3.unpack(recv_exact(sock, 12, deadline))
        out = recv_exact(sock, n_out, deadline)
        err = recv_exact(sock, n_err, deadline)
    except TimeoutError:
        return 1, _error(
            stdin,
            f"tabby-node did not answer this call within {wait:g} s",
            "lock_timeout_seconds + 5 s; the call may still be running there; "
            "the runtime should retry",
        )
    except (OSError, EOFError):
        return 1, _error(
            stdin,
            "tabby-node stopped while serving this call",
            "the call may have been partly done; the runtime should retry",
        )
    if err:
        _write_stderr(err)
    return rc, out


#: Why a call runs in-process (``try_node``'s ``why``): no tabby-node listens on the socket
#: (or the fast path is off), or one is there but did not take the call (slow, another
#: version): it will program the pod's policy from its watch.
ABSENT, NOT_TAKEN = "absent", "not taken"


def try_node(
    role: str,
    env: Mapping[str, str],
    stdin: bytes,
    version: str,
    *,
    accept_within: float = ACCEPT_WITHIN,
    why: list[str] | None = None,
) -> tuple[int, bytes] | None:
    """(exit status, stdout) from tabby-node, or None when the call must run in-process
    (then ``why``, when given, gets ABSENT or NOT_TAKEN).

    What the call wrote to stderr there has been written to our stderr when this returns.
    """
    path = env.get(SOCKET_ENV, DEFAULT_SOCKET)
    reason = why if why is not None else []
    if not path or path == "off":
        reason.append(ABSENT)
        return None
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    except OSError:
        reason.append(ABSENT)
        return None
    try:
        deadline = time.monotonic() + accept_within
        try:
            sock.settimeout(accept_within)
            sock.connect(path)
        except OSError as e:  # no socket, or nobody listens on it (a node killed)
            # (a connect that timed out met a full backlog: a node, a slow one)
            reason.append(NOT_TAKEN if isinstance(e, TimeoutError) else ABSENT)
            return None
        reason.append(NOT_TAKEN)  # unless it answers below
        try:
            _send_request(sock, role, env, stdin, version, deadline)
            first = recv_exact(sock, 1, deadline)
        except (OSError, EOFError):  # TimeoutError is an OSError
            return _not_accepted(sock, stdin)
        if first != ACCEPT:
            return None  # rejected (another version): not run there, so run it here
        return _answer(sock, stdin)
    finally:
        sock.close()
