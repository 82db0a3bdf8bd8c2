"""tabby-node: the resident per-node process that serves CNI calls over a unix socket.

Wire protocol (one call per connection; all integers are unsigned 32-bit big-endian):

  client -> node   b"TBY1", u32 header length, u32 stdin length, header, stdin bytes;
                   SCM_RIGHTS with the first chunk: the caller's network and mount
                   namespaces (the node does the call's work in both)
                   header = NUL-separated: tabby version, role ("tabby" | "tabby-ipam"),
                            then the caller's environment as KEY=VALUE entries
  node -> client   b"A" (accepted: from here on the call runs exactly once, here)
                   or b"R" + reason (rejected, e.g. another version: the client runs the
                   call in-process), then for "A": u32 exit status, u32 length, stdout bytes.

A client that gets EOF or an error before "A" falls back to in-process; after "A" it never
does (the node may have done part of the work), and answers code 11 instead.
"""

from __future__ import annotations

TYPE_CHECKING = False  # typing itself costs ~2 ms on the fast path
if TYPE_CHECKING:
    from collections.abc import Mapping

DEFAULT_SOCKET = "/run/tabby/node.sock"
SOCKET_ENV = "TABBY_NODE_SOCKET"
ACCEPT = b"A"
REJECT = b"R"
MAGIC = b"TBY1"


def encode_header(version: str, role: str, env: Mapping[str, str]) -> bytes:
    fields = [version, role, *(f"{k}={v}" for k, v in env.items() if "\0" not in k + v)]
    return "\0".join(fields).encode("utf-8", "surrogateescape")


def decode_header(raw: bytes) -> tuple[str, str, dict[str, str]]:
    fields = raw.decode("utf-8", "surrogateescape").split("\0")
    if len(fields) < 2:
        raise ValueError("short header")
    env = {}
    for item in fields[2:]:
        key, sep, value = item.partition("=")
        if sep:
            env[key] = value
    return fields[0], fields[1], env
