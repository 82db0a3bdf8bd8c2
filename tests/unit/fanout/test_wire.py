"""The hand-written protobuf of tabby-typha's stream agrees with the .proto that documents
it, and round-trips."""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from datastore.protobuf import ProtoError, len_field
from fanout import METHOD, wire
from tests import REPO_ROOT

PROTO = (REPO_ROOT / "fanout" / "typha.proto").read_text()


def proto_messages() -> dict[str, dict[str, int]]:
    """message -> field -> number, parsed from typha.proto (comments dropped)."""
    text = re.sub(r"//[^\n]*", "", PROTO)
    out: dict[str, dict[str, int]] = {}
    for name, body in re.findall(r"message\s+(\w+)\s*\{(.*?)\n\}", text, re.S):
        body = re.sub(r"enum\s+\w+\s*\{.*?\}", "", body, flags=re.S)
        out[name] = {
            field: int(number)
            for field, number in re.findall(
                r"^\s*(?:repeated\s+)?\w+\s+(\w+)\s*=\s*(\d+);", body, re.M
            )
        }
    return out


def test_field_numbers_are_the_protos() -> None:
    assert proto_messages() == wire.FIELDS


def test_message_types_are_the_protos() -> None:
    enum = re.search(r"enum Type \{(.*?)\}", PROTO, re.S)
    assert enum is not None
    declared = {n: int(v) for n, v in re.findall(r"(\w+)\s*=\s*(\d+);", enum.group(1))}
    assert declared == wire.TYPES


def test_method_is_the_protos() -> None:
    package = re.search(r"^package ([\w.]+);", PROTO, re.M)
    service = re.search(
        r"service (\w+) \{\s*rpc (\w+)\(stream ClientMessage\) returns \(stream ServerMessage\)",
        PROTO,
    )
    assert package
    assert service
    assert f"/{package.group(1)}.{service.group(1)}/{service.group(2)}" == METHOD


@given(
    node=st.text(max_size=30),
    epoch=st.text(alphabet="0123456789abcdef", max_size=16),
    seq=st.integers(0, 2**64 - 1),
    ack=st.integers(0, 2**64 - 1),
)
def test_client_message_round_trip(node: str, epoch: str, seq: int, ack: int) -> None:
    m = wire.ClientMessage(node, epoch, seq, ack)
    assert wire.decode_client(wire.encode_client(m)) == m


@given(
    type=st.sampled_from(sorted(wire.TYPES.values())),
    seq=st.integers(0, 2**64 - 1),
    updates=st.lists(
        st.tuples(
            st.sampled_from(["pod", "block", "node"]),
            st.text(min_size=1, max_size=20),
            st.integers(-(2**63), 2**63 - 1),
            st.one_of(st.none(), st.binary(max_size=50)),
        ),
        max_size=5,
    ),
)
def test_server_message_round_trip(
    type: int, seq: int, updates: list[tuple[str, str, int, bytes | None]]
) -> None:
    body = b"".join(wire.update_field(k, key, rev, data) for k, key, rev, data in updates)
    m = wire.decode_server(wire.encode_server(type, "e1", seq, body))
    assert (m.type, m.epoch, m.seq) == (type, "e1", seq)
    assert [(u.kind, u.key, u.revision, None if u.deleted else u.data) for u in m.updates] == [
        (k, key, rev, data) for k, key, rev, data in updates
    ]


def test_an_update_without_a_key_is_refused() -> None:
    with pytest.raises(ProtoError):
        wire.decode_server(len_field(4, len_field(1, b"pod")))


def test_a_truncated_message_is_refused() -> None:
    whole = wire.encode_server(wire.UPDATES, "e", 3, wire.update_field("pod", "a/b", 1, b"{}"))
    with pytest.raises(ProtoError):
        wire.decode_server(whole[:-1])
