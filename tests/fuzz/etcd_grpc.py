"""What an etcd (or anything listening at its address) sends tabby's etcd client.

Properties:

- ``grpc.decode_response`` of any bytes is a ``WatchResponse`` whose integers are int64,
  or ``ProtoError``; a response encoded (:func:`encode_response`, the test's encoder of
  etcd's messages) decodes to what was encoded;
- the watch stream's HTTP/2 and gRPC framing (``grpc._Stream._events``: any bytes from the
  server after the client's preface) gives decoded responses or ``EtcdUnavailable``, never
  another exception;
- a line of the JSON gateway's watch stream (``client._watch_response``) gives a
  ``WatchResponse``, ``None`` or ``EtcdUnavailable``.

Input bytes (atheris): the first byte picks the part, the rest is its input.
"""

from __future__ import annotations

import socket
import time

from hypothesis import strategies as st

from datastore import protobuf
from datastore.etcd import client, grpc
from datastore.etcd.client import EtcdUnavailable, KeyValue, WatchResponse

INT64 = (-(1 << 63), (1 << 63) - 1)


def _int64s(resp: WatchResponse) -> list[int]:
    values = [resp.revision, resp.compact_revision]
    for ev in resp.events:
        kv = ev.kv
        values += [kv.create_revision, kv.mod_revision, kv.version, kv.lease]
    return values


def check_decode(data: bytes) -> None:
    try:
        watch_id, resp = grpc.decode_response(data)
    except protobuf.ProtoError:
        return
    for value in [watch_id, *_int64s(resp)]:
        assert INT64[0] <= value <= INT64[1], value


# -- an encoder of etcd's messages (the product only decodes them) -------------------------


def _field(number: int, value: int | bytes) -> bytes:
    if isinstance(value, bytes):
        return protobuf.len_field(number, value)
    return protobuf.int_field(number, value)


def encode_kv(kv: KeyValue) -> bytes:
    return b"".join(
        _field(n, v)
        for n, v in (
            (1, kv.key),
            (2, kv.create_revision),
            (3, kv.mod_revision),
            (4, kv.version),
            (5, kv.value),
            (6, kv.lease),
        )
    )


def encode_response(watch_id: int, resp: WatchResponse) -> bytes:
    out = _field(1, _field(3, resp.revision)) + _field(2, watch_id)
    out += _field(3, int(resp.created)) + _field(4, int(resp.canceled))
    out += _field(5, resp.compact_revision) + _field(6, resp.reason.encode())
    for ev in resp.events:
        out += _field(11, _field(1, int(ev.type == "DELETE")) + _field(2, encode_kv(ev.kv)))
    return out


def same(a: WatchResponse, b: WatchResponse) -> bool:
    def flat(r: WatchResponse) -> tuple[object, ...]:
        evs = [(e.type, repr(e.kv)) for e in r.events]
        return (r.revision, r.created, r.canceled, r.compact_revision, r.reason, evs)

    return flat(a) == flat(b)


# -- the watch stream ---------------------------------------------------------------------

_listener: socket.socket | None = None


def new_stream() -> tuple[grpc._Stream, bytes]:
    """A watch stream as the client opens it, to a loopback listener that never answers
    (what it would answer is the input), and the bytes the client sent."""
    global _listener
    if _listener is None:
        _listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = _listener.getsockname()[1]
    stream = grpc._Stream(f"http://127.0.0.1:{port}", "127.0.0.1", port, None, time.monotonic() + 5)
    conn, _ = _listener.accept()
    with conn:
        conn.settimeout(5)
        sent = conn.recv(65536)
    return stream, sent


def check_stream(data: bytes) -> None:
    stream, _ = new_stream()
    try:
        for watch_id, resp in stream._events(data):
            assert isinstance(watch_id, int)
            assert isinstance(resp, WatchResponse)
    except EtcdUnavailable:
        pass
    finally:
        stream.close()


def check_gateway_line(line: bytes) -> None:
    try:
        resp = client._watch_response("http://etcd:2379", line)
    except EtcdUnavailable:
        return
    assert resp is None or isinstance(resp, WatchResponse)


PARTS = (check_decode, check_stream, check_gateway_line)


def fuzz_one(data: bytes) -> None:
    if data:
        PARTS[data[0] % len(PARTS)](data[1:])


# -- hypothesis ---------------------------------------------------------------------------

int64s = st.integers(*INT64)
key_values = st.builds(
    KeyValue,
    st.binary(max_size=20),
    st.binary(max_size=40),
    int64s,
    int64s,
    int64s,
    int64s,
)
responses = st.builds(
    lambda rev, evs, created, canceled, compact, reason: WatchResponse.of(
        revision=rev,
        events=evs,
        created=created,
        canceled=canceled,
        compact_revision=compact,
        reason=reason,
    ),
    int64s,
    st.lists(
        st.builds(client.WatchEvent, st.sampled_from(["PUT", "DELETE"]), key_values), max_size=3
    ),
    st.booleans(),
    st.booleans(),
    int64s,
    st.text(max_size=20),
)


def server_bytes(messages: list[bytes], *, trailers: bool = True) -> bytes:
    """What an etcd sends on the watch: its preface, the response headers, each gRPC
    message, the trailers (made by h2's server side, for the seeds and the properties)."""
    from h2.config import H2Configuration
    from h2.connection import H2Connection

    stream, request = new_stream()
    stream.close()
    server = H2Connection(H2Configuration(client_side=False))
    server.initiate_connection()
    server.receive_data(request)
    server.send_headers(1, [(":status", "200"), ("content-type", "application/grpc")])
    for m in messages:
        server.send_data(1, b"\0" + len(m).to_bytes(4, "big") + m)
    if trailers:
        server.send_headers(1, [("grpc-status", "0")], end_stream=True)
    return server.data_to_send()


if __name__ == "__main__":
    from tests.fuzz.runner import main

    check_stream(b"")  # h2, loaded
    main(fuzz_one, ["datastore"])
