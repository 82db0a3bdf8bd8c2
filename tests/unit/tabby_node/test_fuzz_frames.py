"""Hostile socket frames (tests/fuzz/node_frames.py): the header codec and the client's
readings never raise; the real server answers any frame a local process may send with a
rejection or by closing, logs no failure, and goes on serving."""

from __future__ import annotations

import logging
import socket
import struct
import threading
from collections.abc import Iterator

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from bundle import __version__
from tabby_node import MAGIC, REJECT, encode_header
from tabby_node.server import NodeServer
from tests.fuzz import node_frames, seed_ids, seeds
from tests.unit.tabby_node.test_server import Records, send_with_fds


@pytest.mark.parametrize("data", seeds("node_frames"), ids=seed_ids("node_frames"))
def test_corpus(data: bytes) -> None:
    node_frames.fuzz_one(data)


@given(version=st.text(max_size=8), role=st.text(max_size=12), env=node_frames.environments)
def test_header_round_trip(version: str, role: str, env: dict[str, str]) -> None:
    node_frames.check_header(encode_header(version, role, env))


@given(raw=st.binary(max_size=200))
def test_any_header_bytes(raw: bytes) -> None:
    node_frames.check_header(raw)


@given(value=node_frames.numbers, junk=st.binary(max_size=40))
def test_lock_timeout_of_any_stdin(value: bytes, junk: bytes) -> None:
    node_frames.check_lock_timeout(node_frames.stdin_with(value) + junk)
    node_frames.check_lock_timeout(junk)


@given(answer=node_frames.answers)
def test_any_answer_after_accept(answer: bytes) -> None:
    node_frames.check_answer(answer)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[NodeServer, Records]]:
    """One real server for the module's frames, its log recorded."""
    srv = NodeServer(str(tmp_path_factory.mktemp("fuzz-node") / "run" / "node.sock"))
    srv.bind()
    logger = logging.getLogger("tabby.node")
    handler = Records()
    logger.addHandler(handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield srv, handler
    finally:
        logger.removeHandler(handler)
        srv.stop(grace=5)
        t.join(5)


#: Frames a local process may send: the magic or not, lengths that lie (a header of
#: another version always: the right one would be served, and run a call), any bytes.
frames = st.one_of(
    st.binary(max_size=64),
    st.tuples(
        st.sampled_from([MAGIC, b"TBY1", b"TBY2\0"]),
        st.integers(0, (1 << 32) - 1),
        st.integers(0, (1 << 32) - 1),
        st.binary(max_size=64),
    ).map(lambda t: t[0] + struct.pack("!II", t[1] % (1 << 21), t[2] % (1 << 25)) + t[3]),
    st.tuples(st.text(max_size=6), st.text(max_size=10), node_frames.environments)
    .filter(lambda t: t[0] != __version__)
    .map(lambda t: MAGIC + struct.pack("!II", len(h := encode_header(*t)), 2) + h + b"{}"),
)


@given(frame=frames, with_fds=st.booleans())
@example(frame=MAGIC + struct.pack("!II", 0, 0), with_fds=True)  # found: a logged traceback
def test_the_server_refuses_any_frame_cleanly(
    served: tuple[NodeServer, Records], frame: bytes, with_fds: bool
) -> None:
    srv, log = served
    before = len(log.records)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.settimeout(15)
        conn.connect(srv.path)
        if with_fds:
            send_with_fds(conn, frame)
        else:
            conn.sendall(frame)
        conn.shutdown(socket.SHUT_WR)
        answer = b""
        while chunk := conn.recv(4096):
            answer += chunk
    assert answer == b"" or answer.startswith(REJECT), answer
    failures = [r for r in log.records[before:] if r.levelno >= logging.WARNING]
    assert not failures, [r.getMessage() for r in failures]
