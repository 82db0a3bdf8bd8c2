"""The binaries' side of the tabby-node fast path: forward the call, relay the answer.

Imported first in every CNI process, so it uses only C modules (``_socket``, ``struct``):
``socket.py`` and ``json`` would pull in enum, selectors and re (~8 ms per call, measured),
which is a third of what the whole fast path may cost.
"""

from __future__ import annotations

import _socket
import os
import struct

from cni_plugin.node import ACCEPT, DEFAULT_SOCKET, MAGIC, SOCKET_ENV, encode_header

TYPE_CHECKING = False  # typing itself costs ~2 ms on the fast path
if TYPE_CHECKING:
    from collections.abc import Mapping

_U32x2 = struct.Struct("!II")


def _recv_exact(sock: _socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _died(stdin: bytes) -> bytes:
    import json

    try:
        version = json.loads(stdin).get("cniVersion") or "1.1.0"
    except Exception:
        version = "1.1.0"
    err = {
        "cniVersion": version,
        "code": 11,
        "msg": "tabby-node stopped while serving this call",
        "details": "the call may have been partly done; the runtime should retry",
    }
    return json.dumps(err, separators=(",", ":")).encode() + b"\n"


def try_node(
    role: str, env: Mapping[str, str], stdin: bytes, version: str
) -> tuple[int, bytes] | None:
    """(exit status, stdout) from tabby-node, or None when the call must run in-process."""
    path = env.get(SOCKET_ENV, DEFAULT_SOCKET)
    if not path or path == "off":
        return None
    try:
        sock = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)
    except OSError:
        return None
    accepted = False
    try:
        try:
            sock.connect(path)
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
            if sent < len(msg):
                sock.sendall(msg[sent:])
            if _recv_exact(sock, 1) != ACCEPT:
                return None  # rejected (another version): not run there, so run it here
            accepted = True
            rc, n = _U32x2.unpack(_recv_exact(sock, 8))
            return rc, _recv_exact(sock, n)
        except (OSError, EOFError):
            if accepted:
                return 1, _died(stdin)
            return None
    finally:
        sock.close()
