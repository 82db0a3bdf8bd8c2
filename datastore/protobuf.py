"""Protocol buffers' wire format, by hand (standard library only): what tabby needs to speak
etcd's Watch (``datastore.etcd.grpc``) and tabby-typha's stream (``fanout.wire``) without a
protobuf runtime or a code generator.

Varints (``int64`` as two's complement in ten bytes, ``uint64``, ``bool``, enums) and
length-delimited fields (``string``, ``bytes``, embedded messages, repeated ones one field
each) are written and read; fixed-width fields are skipped when read (none is used).
"""

from __future__ import annotations

from collections.abc import Generator


class ProtoError(ValueError):
    """A message that is not the protobuf it should be."""


def varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64: two's complement in ten bytes
    out = bytearray()
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def len_field(number: int, data: bytes) -> bytes:
    """A length-delimited field (wire type 2), also when ``data`` is empty."""
    return varint(number << 3 | 2) + varint(len(data)) + data


def str_field(number: int, text: str) -> bytes:
    """A ``string`` field, left out when empty (proto3's default)."""
    return len_field(number, text.encode()) if text else b""


def int_field(number: int, value: int) -> bytes:
    """A varint field (wire type 0), left out when 0 (proto3's default)."""
    return varint(number << 3) + varint(value) if value else b""


def read_varint(buf: bytes, i: int) -> tuple[int, int]:
    n = 0
    shift = 0
    try:
        while True:
            b = buf[i]
            i += 1
            n |= (b & 0x7F) << shift
            if b < 0x80:
                # a ten-byte varint carries 70 bits: a uint64's are the low 64 (protobuf
                # drops the rest), so every int64 decoded is one
                return n & 0xFFFF_FFFF_FFFF_FFFF, i
            shift += 7
            if shift > 63:
                raise ProtoError("varint longer than ten bytes")
    except IndexError:
        raise ProtoError("truncated varint") from None


def fields(buf: bytes) -> Generator[tuple[int, int | bytes], None, None]:
    """``(field number, value)`` of a message: an int for a varint, bytes for a
    length-delimited field; fixed-width fields are skipped."""
    i = 0
    end = len(buf)
    while i < end:
        tag, i = read_varint(buf, i)
        number, wire = tag >> 3, tag & 7
        if wire == 0:
            value, i = read_varint(buf, i)
            yield number, value
        elif wire == 2:
            size, i = read_varint(buf, i)
            if i + size > end:
                raise ProtoError("truncated field")
            yield number, buf[i : i + size]
            i += size
        elif wire == 1:
            i += 8
        elif wire == 5:
            i += 4
        else:
            raise ProtoError(f"wire type {wire} not supported")
    if i != end:
        raise ProtoError("truncated fixed-width field")


def as_int64(value: int | bytes) -> int:
    if not isinstance(value, int):
        raise ProtoError("expected a varint")
    return value - (1 << 64) if value >= 1 << 63 else value


def as_bytes(value: int | bytes) -> bytes:
    if not isinstance(value, bytes):
        raise ProtoError("expected a length-delimited field")
    return value


def as_str(value: int | bytes) -> str:
    try:
        return as_bytes(value).decode()
    except UnicodeDecodeError:
        raise ProtoError("a string field that is not UTF-8") from None
