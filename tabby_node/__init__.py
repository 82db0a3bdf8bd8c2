"""tabby-node, the agent on every node: it registers the node, keeps the node's routes and
NetworkPolicy in the kernel as the datastore says, and serves its pods' CNI calls over a
unix socket. This module is what tabby-node shares with its client and tabbyctl: the
default paths and ports, and the socket's wire protocol.

Wire protocol (one call per connection; all integers are unsigned 32-bit big-endian):

  client -> node   b"TBY2", u32 header length, u32 stdin length, header, stdin bytes;
                   SCM_RIGHTS with the first chunk: the caller's network and mount
                   namespaces (the node does the call's work in both)
                   header = NUL-separated: tabby version, role ("tabby" | "tabby-ipam"),
                            then the caller's environment as KEY=VALUE entries
  node -> client   b"A" (accepted: from here on the call runs exactly once, here)
                   or b"R" + reason (rejected, e.g. another version: the client runs the
                   call in-process), then for "A": u32 exit status, u32 stdout length,
                   u32 stderr length, stdout bytes, stderr bytes. stderr is what the call
                   wrote there (a delegated plugin's stderr, tabby's warnings and errors):
                   the client writes it to its own stderr, as the call would standalone.

The magic names the protocol: a node and a client of different protocols never talk (an
older node refuses "TBY2" as "not a tabby-node request"; this node refuses "TBY1"), so the
client runs the call in-process. The version in the header must match too.

Bounds, so that a wedged node never hangs a runtime: a client that has not read "A" within
ACCEPT_WITHIN seconds of connecting treats the node as absent and runs the call in-process
(it shuts its socket down first, so a node that accepts later can no longer start the
call); after "A" it waits at most the call's lock_timeout_seconds + ANSWER_GRACE seconds
for the answer. A client that gets EOF, an error or no answer in time after "A" never
falls back (the node may have done part of the work): it answers code 11 instead.

The node bounds its side too (docs/node.md "Limits"): a request over its size limit, or
beyond its limit of calls at once, is answered "R" (the client runs the call itself); a
request not read whole within its deadline is dropped; an answer is sent only within the
time its client waits for it.
"""

from __future__ import annotations

import time

TYPE_CHECKING = False  # typing itself costs ~2 ms on the fast path
if TYPE_CHECKING:
    from _socket import socket
    from collections.abc import Mapping

#: tabby-node's run directory (socket, BIRD files, status) and its log file, by default.
DEFAULT_RUN_DIR = "/run/tabby"
DEFAULT_NODE_LOG_FILE = "/var/log/tabby/node.log"
DEFAULT_SOCKET = f"{DEFAULT_RUN_DIR}/node.sock"
#: /liveness, /readiness and the denied-flow log /policy/log, on 127.0.0.1 (--health-port).
DEFAULT_HEALTH_PORT = 9099
#: /metrics (and /policy/log) on 127.0.0.1 and the node's IPv4 address (--metrics-port).
DEFAULT_METRICS_PORT = 9091
SOCKET_ENV = "TABBY_NODE_SOCKET"
#: What ``tabbyctl node install`` writes into the runtime's CNI configuration directory (its
#: defaults), and what tabby-node removes from there when tabby is uninstalled
#: (``tabby_node.uninstall``): the conflist, the plugins' kubeconfig, the etcd TLS files.
DEFAULT_CNI_CONF_DIR = "/etc/cni/net.d"
CONFLIST_NAME = "10-tabby.conflist"
CNI_KUBECONFIG_NAME = "tabby-kubeconfig"
CNI_TLS_DIR = "tabby-tls"
ACCEPT = b"A"
REJECT = b"R"
MAGIC = b"TBY2"
#: Seconds a node has to accept a call (read it and answer "A") before it counts as absent.
ACCEPT_WITHIN = 2.0
#: Seconds beyond the call's lock_timeout_seconds that a client waits for an accepted answer.
ANSWER_GRACE = 5.0
#: lock_timeout_seconds when the call's config does not say.
DEFAULT_LOCK_TIMEOUT = 30.0
#: The node relays at most this much of a call's stderr (the rest is counted, not sent).
MAX_STDERR = 1 << 20
#: Calls a node serves at once (--max-calls): several times the pods a kubelet starts at
#: once; one more is answered "R" at once.
MAX_CALLS = 256
#: Bytes of one request, header and stdin (--max-request-bytes); a larger one is answered "R".
MAX_REQUEST = 1 << 20
#: Seconds from a connection accepted to its whole request read (a client gives up on being
#: accepted after ACCEPT_WITHIN: a request read later is one nobody waits for).
REQUEST_WITHIN = 5.0


def encode_header(version: str, role: str, env: Mapping[str, str]) -> bytes:
    fields = [version, role, *(f"{k}={v}" for k, v in env.items() if "\0" not in k + v)]
    return "\0".join(fields).encode("utf-8", "surrogateescape")


def decode_header(raw: bytes) -> tuple[str, str, dict[str, str]]:
    """(version, role, environment) of a header; never raises. A header too short to name
    a version and a role decodes as version "" (no tabby-node's): the node refuses it as a
    request of another version, as it refuses every frame it cannot serve."""
    fields = raw.decode("utf-8", "surrogateescape").split("\0")
    if len(fields) < 2:
        return "", "", {}
    env = {}
    for item in fields[2:]:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
    return fields[0], fields[1], env


def recv_exact(sock: socket, n: int, deadline: float, first: bytes = b"") -> bytes:
    """``n`` bytes (``first`` of them already received) by ``deadline`` (monotonic), each
    read given only the time left: TimeoutError after it, EOFError when the peer closes."""
    buf = bytearray(first)
    while len(buf) < n:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("not received in time")
        sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            raise EOFError("the peer closed the connection")
        buf += chunk
    return bytes(buf)
