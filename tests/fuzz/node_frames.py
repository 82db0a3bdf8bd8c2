"""tabby-node's socket frames (the wire protocol of ``tabby_node``), from both ends.

Properties:

- ``decode_header`` of any bytes gives (version, role, environment), never an exception;
  ``encode_header`` then ``decode_header`` gives back what was encoded (environment keys
  as a process can have them: no ``=``, no NUL);
- ``client.lock_timeout`` of any stdin is a number in (0, 1e7], never an exception;
- the client's reading of a node's answer (``client._answer``) turns any bytes a node may
  send after "A" into (exit status, stdout) or a code 11 error object, never an exception.

The node's side (any frame a local process may send) is a property test against the
real server: tests/unit/tabby_node/test_fuzz_frames.py.

Input bytes (atheris): the first byte picks the part, the rest is its input.
"""

from __future__ import annotations

import json
import math
import socket

from hypothesis import strategies as st

from tabby_node import client, decode_header, encode_header


def check_header(raw: bytes) -> None:
    version, role, env = decode_header(raw)
    again = decode_header(encode_header(version, role, env))
    if "\0" not in version + role and "=" not in version + role:
        clean = {k: v for k, v in env.items() if "\0" not in k + v}
        assert again == (version, role, clean), (again, version, role, env)


def check_lock_timeout(stdin: bytes) -> None:
    value = client.lock_timeout(stdin)
    assert isinstance(value, float), value
    assert math.isfinite(value), value
    assert 0 < value <= 1e7, value


def check_answer(answer: bytes, stdin: bytes = b'{"cniVersion":"1.0.0"}') -> None:
    """A node that accepted the call, then sent ``answer`` and closed."""
    ours, theirs = socket.socketpair()
    try:
        theirs.sendall(answer)
        theirs.close()
        rc, out = client._answer(ours, stdin)
    finally:
        ours.close()
    assert 0 <= rc < 1 << 32
    if rc == 1 and out.startswith(b'{"cniVersion"') and b'"code":11' in out:
        assert json.loads(out)["code"] == 11


PARTS = (check_header, check_lock_timeout, check_answer)


def fuzz_one(data: bytes) -> None:
    if data:
        PARTS[data[0] % len(PARTS)](data[1:])


# -- hypothesis ---------------------------------------------------------------------------

env_keys = st.text(min_size=1, max_size=12).filter(lambda k: "=" not in k and "\0" not in k)
environments = st.dictionaries(env_keys, st.text(max_size=20), max_size=5)
numbers = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True).map(lambda f: repr(f).encode()),
    st.sampled_from([b"-1", b"1e999", b"0", b"+", b"..", b"1e", b"nan", b"5" * 400]),
)
#: A node's answer after "A": the 12-byte head, then bodies shorter or longer than it says.
answers = st.tuples(
    st.integers(0, (1 << 32) - 1),
    st.integers(0, 64),
    st.integers(0, 64),
    st.binary(max_size=80),
).map(lambda t: t[0].to_bytes(4, "big") + t[1].to_bytes(4, "big") + t[2].to_bytes(4, "big") + t[3])


def stdin_with(value: bytes) -> bytes:
    return b'{"ipam": {"lock_timeout_seconds" :' + value + b"}}"


if __name__ == "__main__":
    from tests.fuzz.runner import main

    main(fuzz_one, ["tabby_node"])
