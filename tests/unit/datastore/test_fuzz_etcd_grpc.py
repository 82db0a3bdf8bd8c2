"""What a hostile etcd sends (tests/fuzz/etcd_grpc.py): the hand-written protobuf decoder
round-trips etcd's messages and refuses anything else with ProtoError; the watch stream's
HTTP/2 and gRPC framing and the gateway's JSON lines end in EtcdUnavailable at worst."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datastore.etcd import grpc
from datastore.etcd.client import WatchResponse
from tests.fuzz import etcd_grpc, seed_ids, seeds


@pytest.mark.parametrize("data", seeds("etcd_grpc"), ids=seed_ids("etcd_grpc"))
def test_corpus(data: bytes) -> None:
    etcd_grpc.fuzz_one(data)


@given(watch_id=etcd_grpc.int64s, resp=etcd_grpc.responses)
def test_responses_round_trip(watch_id: int, resp: WatchResponse) -> None:
    got_id, got = grpc.decode_response(etcd_grpc.encode_response(watch_id, resp))
    assert got_id == watch_id
    assert etcd_grpc.same(got, resp)


@given(data=st.binary(max_size=120))
def test_any_bytes_decode_or_refuse(data: bytes) -> None:
    etcd_grpc.check_decode(data)


@given(
    resp=etcd_grpc.responses,
    cut=st.integers(0, 400),
    flip=st.tuples(st.integers(0, 400), st.integers(1, 255)),
)
def test_the_stream_refuses_damaged_frames_cleanly(
    resp: WatchResponse, cut: int, flip: tuple[int, int]
) -> None:
    """A real server's bytes, cut short or with one byte changed."""
    data = bytearray(etcd_grpc.server_bytes([etcd_grpc.encode_response(1, resp)]))
    etcd_grpc.check_stream(bytes(data[:cut]))
    at, xor = flip
    data[at % len(data)] ^= xor
    etcd_grpc.check_stream(bytes(data))


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)
fields = st.sampled_from(
    ["header", "events", "compact_revision", "canceled", "created", "cancel_reason"]
)


@given(
    result=st.dictionaries(fields, json_values, max_size=4),
    kv=st.dictionaries(
        st.sampled_from(["key", "value", "create_revision", "mod_revision", "version", "lease"]),
        json_values,
        max_size=3,
    ),
)
def test_gateway_watch_lines(result: dict[str, object], kv: dict[str, object]) -> None:
    etcd_grpc.check_gateway_line(json.dumps({"result": result}).encode())
    line = {"result": {"events": [{"type": "PUT", "kv": kv}]}}
    etcd_grpc.check_gateway_line(json.dumps(line).encode())
