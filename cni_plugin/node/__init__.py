"""tabby-node: the resident per-node process that serves CNI calls over a unix socket.

Wire protocol (one call per connection; all integers are unsigned 32-bit big-endian):

  client -> node   u32 header length, u32 stdin length, header JSON, stdin bytes;
                   one SCM_RIGHTS fd with the first chunk: the caller's network namespace
                   header = {"version": <tabby version>, "role": "tabby"|"tabby-ipam",
                             "env": {...the caller's environment...}}
  node -> client   b"A" (accepted: from here on the call runs exactly once, here)
                   or b"R" + reason (rejected, e.g. another version: the client runs the
                   call in-process), then for "A": u32 exit status, u32 length, stdout bytes.

A client that gets EOF or an error before "A" falls back to in-process; after "A" it never
does (the node may have done part of the work), and answers code 11 instead.
"""

DEFAULT_SOCKET = "/run/tabby/node.sock"
SOCKET_ENV = "TABBY_NODE_SOCKET"
ACCEPT = b"A"
REJECT = b"R"
