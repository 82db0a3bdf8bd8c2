"""The binaries' side of the tabby-node fast path: forward the call, relay the answer.

Standard library only, imported before anything else in a CNI process: this path must cost
less than the work it saves.
"""

from __future__ import annotations

import json
import os
import socket
import struct
from collections.abc import Mapping

from cni_plugin.node import ACCEPT, DEFAULT_SOCKET, SOCKET_ENV

_U32x2 = struct.Struct("!II")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def _died(stdin: bytes) -> bytes:
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
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    except OSError:
        return None
    accepted = False
    try:
        try:
            sock.connect(path)
            header = json.dumps({"version": version, "role": role, "env": dict(env)}).encode()
            msg = _U32x2.pack(len(header), len(stdin)) + header + stdin
            ns_fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                sent = socket.send_fds(sock, [msg], [ns_fd])
            finally:
                os.close(ns_fd)
            if sent < len(msg):
                sock.sendall(msg[sent:])
            if _recv_exact(sock, 1) != ACCEPT:
                return None  # rejected (other version): not run there, run it here
            accepted = True
            rc, n = _U32x2.unpack(_recv_exact(sock, 8))
            return rc, _recv_exact(sock, n)
        except (OSError, EOFError):
            if accepted:
                return 1, _died(stdin)
            return None
    finally:
        sock.close()
