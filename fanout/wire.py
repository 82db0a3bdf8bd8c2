"""The messages of ``typha.proto``, encoded and decoded by hand (``datastore.protobuf``): no
protobuf runtime, no generated code. A field number here is the one in the .proto
(``tests/unit/fanout/test_wire.py`` parses the file and checks)."""

from __future__ import annotations

import hashlib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from datastore.protobuf import (
    ProtoError,
    as_bytes,
    as_int64,
    as_str,
    fields,
    int_field,
    len_field,
    read_varint,
    str_field,
    varint,
)

# ServerMessage.Type
UPDATES = 0
SNAPSHOT_BEGIN = 1
SNAPSHOT_CHUNK = 2
SNAPSHOT_END = 3
KEEPALIVE = 4
TYPES = {
    "UPDATES": UPDATES,
    "SNAPSHOT_BEGIN": SNAPSHOT_BEGIN,
    "SNAPSHOT_CHUNK": SNAPSHOT_CHUNK,
    "SNAPSHOT_END": SNAPSHOT_END,
    "KEEPALIVE": KEEPALIVE,
}

#: message -> field name -> number (what the encoders below write; the .proto's)
FIELDS = {
    "ClientMessage": {"node": 1, "epoch": 2, "seq": 3, "ack": 4, "kinds": 5, "digests": 6},
    "Update": {"kind": 1, "key": 2, "revision": 3, "data": 4, "deleted": 5},
    "ServerMessage": {"type": 1, "epoch": 2, "seq": 3, "updates": 4, "buckets": 5},
}

#: Buckets of each kind's keys in a digest (``digests``)
BUCKETS = 64
DIGEST_SIZE = 8


@dataclass(frozen=True)
class ClientMessage:
    node: str = ""
    epoch: str = ""
    seq: int = 0
    ack: int = 0
    kinds: tuple[str, ...] = ()
    digests: bytes = b""


@dataclass(frozen=True)
class Update:
    kind: str
    key: str
    revision: int = 0
    data: bytes = b""  # JSON; empty when deleted
    deleted: bool = False


@dataclass(frozen=True)
class ServerMessage:
    type: int
    epoch: str = ""
    seq: int = 0
    updates: list[Update] = field(default_factory=list)
    buckets: tuple[int, ...] = ()


def encode_client(m: ClientMessage) -> bytes:
    out = str_field(1, m.node) + str_field(2, m.epoch) + int_field(3, m.seq) + int_field(4, m.ack)
    out += b"".join(len_field(5, kind.encode()) for kind in m.kinds)
    return out + (len_field(6, m.digests) if m.digests else b"")


def decode_client(buf: bytes) -> ClientMessage:
    node = epoch = ""
    seq = ack = 0
    kinds: list[str] = []
    digests = b""
    for number, v in fields(buf):
        if number == 1:
            node = as_str(v)
        elif number == 2:
            epoch = as_str(v)
        elif number == 3:
            seq = _uint(v)
        elif number == 4:
            ack = _uint(v)
        elif number == 5:
            kinds.append(as_str(v))
        elif number == 6:
            digests = as_bytes(v)
    return ClientMessage(node, epoch, seq, ack, tuple(kinds), digests)


def update_field(kind: str, key: str, revision: int, data: bytes | None) -> bytes:
    """One ``Update`` as the ``updates`` field of a ``ServerMessage`` (None: deleted): the
    server encodes each document's once and sends the same bytes to every node it goes to."""
    body = str_field(1, kind) + str_field(2, key) + int_field(3, revision)
    body += int_field(5, 1) if data is None else len_field(4, data)
    return len_field(4, body)


def encode_server(
    type: int, epoch: str, seq: int, updates: bytes = b"", buckets: Sequence[int] = ()
) -> bytes:
    """A ``ServerMessage``; ``updates``: ``update_field``s, concatenated."""
    out = int_field(1, type) + str_field(2, epoch) + int_field(3, seq) + updates
    if buckets:  # packed, as proto3 packs a repeated scalar
        out += len_field(5, b"".join(varint(b) for b in buckets))
    return out


def decode_server(buf: bytes) -> ServerMessage:
    type = 0
    epoch = ""
    seq = 0
    updates: list[Update] = []
    buckets: list[int] = []
    for number, v in fields(buf):
        if number == 1:
            type = _uint(v)
        elif number == 2:
            epoch = as_str(v)
        elif number == 3:
            seq = _uint(v)
        elif number == 4:
            updates.append(_decode_update(as_bytes(v)))
        elif number == 5:
            if isinstance(v, int):  # unpacked, as a proto3 reader must also accept
                buckets.append(v)
            else:
                i = 0
                while i < len(v):
                    b, i = read_varint(v, i)
                    buckets.append(b)
    return ServerMessage(type, epoch, seq, updates, tuple(buckets))


def _decode_update(buf: bytes) -> Update:
    kind = key = ""
    revision = 0
    data = b""
    deleted = False
    for number, v in fields(buf):
        if number == 1:
            kind = as_str(v)
        elif number == 2:
            key = as_str(v)
        elif number == 3:
            revision = as_int64(v)
        elif number == 4:
            data = as_bytes(v)
        elif number == 5:
            deleted = bool(_uint(v))
    if not kind or not key:
        raise ProtoError("an update without its kind or key")
    return Update(kind, key, revision, data, deleted)


def _uint(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise ProtoError("expected a varint")
    return value


# == resync by digests ===================================================================


def bucket(key: str) -> int:
    return zlib.crc32(key.encode()) % BUCKETS


def digests(kinds: Sequence[str], held: Mapping[str, Mapping[str, int]]) -> bytes:
    """What a view holds, compactly: for each kind (in order) and each of its ``BUCKETS``
    buckets of keys, ``DIGEST_SIZE`` bytes of BLAKE2b over the bucket's ``key NUL content
    NUL`` in key order. ``held``: kind -> key -> ``content(data)`` of the update held."""
    out = []
    for kind in kinds:
        buckets: list[list[tuple[str, int]]] = [[] for _ in range(BUCKETS)]
        for key, revision in held.get(kind, {}).items():
            buckets[bucket(key)].append((key, revision))
        for entries in buckets:
            h = hashlib.blake2b(digest_size=DIGEST_SIZE)
            for key, revision in sorted(entries):
                h.update(f"{key}\0{revision}\0".encode())
            out.append(h.digest())
    return b"".join(out)


def content(data: bytes) -> int:
    """An update's data as a digest: what ``digests`` compares. Not its revision: a
    projection that did not change keeps the update a node was sent, whose revision is
    the datastore's when the projection last changed, which another replica (started
    after) cannot know; its content is the same on every replica."""
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "big")
