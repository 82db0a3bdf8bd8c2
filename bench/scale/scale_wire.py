"""Pure parts of the scale benchmark (bench/scale/scale_bench.py): no I/O, no root, unit-tested
(tests/unit/bench/test_scale.py).

- The watch streams' bytes read *minimally*: the simulated nodes must read every byte etcd
  sends them (etcd's cost depends on delivery) but must not pay tabby's full parse for each
  of tens of thousands of events per second. From the JSON gateway's stream (HTTP chunks of
  newline-delimited JSON) and from gRPC's WatchResponse messages (protobuf) they take only
  the header revision, created/canceled, and per event its key and mod_revision.
- A gRPC WatchRequest built from the JSON ``create_request`` tabby's own client sends
  (``datastore.etcd.client.EtcdClient.watch``), so the gRPC engines watch exactly the ranges
  and revisions tabby asks for; the field numbers are those of etcd's API reference
  (``etcdserverpb.WatchRequest``/``WatchResponse``, ``mvccpb.KeyValue``).
- A snapshot read (a multi-key range answer) reduced to its last key value, so that tabby's
  own paging code (``EtcdStore._range_all``) runs unchanged without parsing every document.
- The printed tables (percentiles are ``bench.stats``'s).
"""

from __future__ import annotations

import base64
import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from typing import Any

# == protobuf wire format (only what the Watch service needs) =============================

VARINT, I64, LEN, I32 = 0, 1, 2, 5

#: WatchCreateRequest: the gateway's JSON name -> (field number, type). JSON int64 fields
#: are strings, bytes are base64 (the gateway's mapping of the same message).
CREATE_FIELDS: dict[str, tuple[int, str]] = {
    "key": (1, "bytes"),
    "range_end": (2, "bytes"),
    "start_revision": (3, "int64"),
    "progress_notify": (4, "bool"),
    "filters": (5, "enum*"),
    "prev_kv": (6, "bool"),
    "watch_id": (7, "int64"),
    "fragment": (8, "bool"),
}
FILTERS = {"NOPUT": 0, "NODELETE": 1}
WATCH_CREATE = 1  # WatchRequest.create_request (oneof request_union)
WATCH_PROGRESS = 3  # WatchRequest.progress_request


class WireError(ValueError):
    """Bytes that are not the message they should be."""


def varint(n: int) -> bytes:
    if n < 0:
        n += 1 << 64  # int64 on the wire: two's complement in 10 bytes
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def _tag(field: int, wire: int) -> bytes:
    return varint(field << 3 | wire)


def _len_field(field: int, data: bytes) -> bytes:
    return _tag(field, LEN) + varint(len(data)) + data


def encode_create(create: Mapping[str, Any]) -> bytes:
    """A ``WatchRequest{create_request}`` from the gateway JSON of a create request."""
    body = bytearray()
    for name, value in create.items():
        if name not in CREATE_FIELDS:
            raise WireError(f"create_request field {name!r} is not in etcd's WatchCreateRequest")
        field, kind = CREATE_FIELDS[name]
        if kind == "bytes":
            data = base64.b64decode(value)
            if data:
                body += _len_field(field, data)
        elif kind == "int64":
            n = int(value)
            if n:
                body += _tag(field, VARINT) + varint(n)
        elif kind == "bool":
            if value:
                body += _tag(field, VARINT) + varint(1)
        else:  # repeated enum, packed
            packed = b"".join(varint(FILTERS[v] if isinstance(v, str) else int(v)) for v in value)
            if packed:
                body += _len_field(field, packed)
    return _len_field(WATCH_CREATE, bytes(body))


def _read_varint(buf: bytes, i: int) -> tuple[int, int]:
    shift = 0
    n = 0
    while True:
        if i >= len(buf):
            raise WireError("truncated varint")
        b = buf[i]
        i += 1
        n |= (b & 0x7F) << shift
        if b < 0x80:
            return n, i
        shift += 7
        if shift > 63:
            raise WireError("varint too long")


def _int64(n: int) -> int:
    return n - (1 << 64) if n >= 1 << 63 else n


def fields(buf: bytes, start: int = 0, end: int | None = None) -> Iterator[tuple[int, int, int]]:
    """(field number, value or offset, end offset) of each field in ``buf[start:end]``: a
    varint's value (and its end), a length-delimited field's start offset (and its end)."""
    i = start
    stop = len(buf) if end is None else end
    while i < stop:
        key, i = _read_varint(buf, i)
        field, wire = key >> 3, key & 7
        if wire == VARINT:
            value, i = _read_varint(buf, i)
            yield field, value, i
        elif wire == LEN:
            n, i = _read_varint(buf, i)
            if i + n > stop:
                raise WireError("truncated field")
            yield field, i, i + n
            i += n
        elif wire == I64:
            i += 8
        elif wire == I32:
            i += 4
        else:
            raise WireError(f"wire type {wire}")
    if i != stop:
        raise WireError("truncated message")


class WatchMessage:
    """What the simulated nodes take from one WatchResponse (either engine)."""

    __slots__ = ("cancel_reason", "canceled", "compact_revision", "created", "events", "revision")

    def __init__(self) -> None:
        self.revision = 0  # header.revision
        self.created = False
        self.canceled = False
        self.compact_revision = 0
        self.cancel_reason = ""
        self.events: list[tuple[bytes, int]] = []  # (key, mod_revision)


def decode_watch_response(buf: bytes) -> WatchMessage:
    """WatchResponse (protobuf): header.revision, created, canceled, compact_revision,
    cancel_reason and each event's kv key and mod_revision (values are skipped)."""
    msg = WatchMessage()
    for field, value, end in fields(buf):
        if field == 1:  # header: ResponseHeader{revision = 3}
            for f, v, _ in fields(buf, value, end):
                if f == 3:
                    msg.revision = _int64(v)
        elif field == 3:
            msg.created = bool(value)
        elif field == 4:
            msg.canceled = bool(value)
        elif field == 5:
            msg.compact_revision = _int64(value)
        elif field == 6:
            msg.cancel_reason = buf[value:end].decode("utf-8", "replace")
        elif field == 11:  # events: Event{type = 1, kv = 2, prev_kv = 3}
            for f, v, e in fields(buf, value, end):
                if f == 2:  # KeyValue{key = 1, mod_revision = 3, value = 5, ...}
                    key = b""
                    mod = 0
                    for kf, kv, ke in fields(buf, v, e):
                        if kf == 1:
                            key = buf[kv:ke]
                        elif kf == 3:
                            mod = _int64(kv)
                    msg.events.append((key, mod))
    return msg


def watch_response_json(buf: bytes) -> bytes:
    """A WatchResponse (protobuf) as the gateway would write it (one JSON line, values
    included), for tabby's own parser (``datastore.etcd.client._watch_response``)."""
    result: dict[str, Any] = {}
    events: list[dict[str, Any]] = []
    for field, value, end in fields(buf):
        if field == 1:
            for f, v, _ in fields(buf, value, end):
                if f == 3:
                    result["header"] = {"revision": str(_int64(v))}
        elif field == 2:
            result["watch_id"] = str(_int64(value))
        elif field == 3 and value:
            result["created"] = True
        elif field == 4 and value:
            result["canceled"] = True
        elif field == 5:
            result["compact_revision"] = str(_int64(value))
        elif field == 6:
            result["cancel_reason"] = buf[value:end].decode("utf-8", "replace")
        elif field == 11:
            event: dict[str, Any] = {}
            for f, v, e in fields(buf, value, end):
                if f == 1 and v == 1:
                    event["type"] = "DELETE"
                elif f == 2:
                    event["kv"] = _kv_json(buf, v, e)
            events.append(event)
    if events:
        result["events"] = events
    return json.dumps({"result": result}, separators=(",", ":")).encode()


_KV_NAMES = {
    1: "key",
    2: "create_revision",
    3: "mod_revision",
    4: "version",
    5: "value",
    6: "lease",
}


def _kv_json(buf: bytes, start: int, end: int) -> dict[str, str]:
    kv: dict[str, str] = {}
    for f, v, e in fields(buf, start, end):
        name = _KV_NAMES.get(f)
        if name is None:
            continue
        if f in (1, 5):
            kv[name] = base64.b64encode(buf[v:e]).decode("ascii")
        else:
            kv[name] = str(_int64(v))
    return kv


# == the JSON gateway's watch stream ======================================================


class ChunkedLines:
    """The body of a chunked HTTP/1.1 response, fed as it arrives, split into lines (the
    gateway writes one JSON WatchResponse per line). ``ended`` once the last chunk came."""

    __slots__ = ("_crlf", "_partial", "_raw", "_size", "ended")

    def __init__(self) -> None:
        self._raw = b""  # bytes of a chunk header not complete yet
        self._partial = b""  # de-chunked bytes after the last newline
        self._size = 0  # data bytes left in the current chunk
        self._crlf = 0  # bytes of the CRLF after the current chunk's data still to skip
        self.ended = False

    def feed(self, data: bytes) -> list[bytes]:
        raw = self._raw + data if self._raw else data
        parts = [self._partial]
        i = 0
        n = len(raw)
        while i < n and not self.ended:
            if self._size:
                take = min(self._size, n - i)
                parts.append(raw[i : i + take])
                i += take
                self._size -= take
                if not self._size:
                    self._crlf = 2
                continue
            if self._crlf:
                take = min(self._crlf, n - i)
                if raw[i : i + take] != b"\r\n"[2 - self._crlf : 2 - self._crlf + take]:
                    raise WireError("chunk without its CRLF")
                i += take
                self._crlf -= take
                continue
            j = raw.find(b"\r\n", i)
            if j < 0:
                break
            try:
                size = int(raw[i:j].split(b";", 1)[0], 16)
            except ValueError:
                raise WireError(f"bad chunk header {raw[i:j][:40]!r}") from None
            i = j + 2
            if size == 0:
                self.ended = True
            self._size = size
        self._raw = raw[i:] if not self.ended else b""
        body = b"".join(parts)
        lines = body.split(b"\n")
        self._partial = lines.pop()
        return [line for line in lines if line]


_KEY = re.compile(rb'"key":"([A-Za-z0-9+/=]*)"')
_MOD = re.compile(rb'"mod_revision":"(\d+)"')
_REV = re.compile(rb'"revision":"(\d+)"')
_COMPACT = re.compile(rb'"compact_revision":"(\d+)"')


def scan_gateway_line(line: bytes) -> WatchMessage:
    """One line of the gateway's watch stream, read as little as it can be: regular
    expressions over the bytes (keys and values are base64, so they hold no quotes).
    A line that is not a result (an error object) comes back with ``canceled`` and the
    text in ``cancel_reason``."""
    msg = WatchMessage()
    if not line.startswith(b'{"result":'):
        msg.canceled = True
        msg.cancel_reason = line[:200].decode("utf-8", "replace")
        return msg
    if b'"prev_kv"' in line:  # not asked for by tabby today: read it properly then
        return _json_line(line)
    m = _REV.search(line)
    if m:
        msg.revision = int(m.group(1))
    if b'"created":true' in line:
        msg.created = True
    if b'"canceled":true' in line:
        msg.canceled = True
        c = _COMPACT.search(line)
        if c:
            msg.compact_revision = int(c.group(1))
    if b'"kv"' in line:
        keys = _KEY.findall(line)
        mods = _MOD.findall(line)
        if len(keys) != len(mods):
            return _json_line(line)
        msg.events = [(base64.b64decode(k), int(r)) for k, r in zip(keys, mods, strict=True)]
    return msg


def _json_line(line: bytes) -> WatchMessage:
    msg = WatchMessage()
    result = json.loads(line).get("result", {})
    msg.revision = int(result.get("header", {}).get("revision", 0) or 0)
    msg.created = bool(result.get("created"))
    msg.canceled = bool(result.get("canceled"))
    msg.compact_revision = int(result.get("compact_revision", 0) or 0)
    msg.cancel_reason = str(result.get("cancel_reason", ""))
    for ev in result.get("events", ()):
        kv = ev.get("kv", {})
        msg.events.append((base64.b64decode(kv.get("key", "")), int(kv.get("mod_revision", 0))))
    return msg


# == snapshot reads, reduced ================================================================

_LAST_KV = re.compile(rb'\{"key":"[A-Za-z0-9+/=]*"[^{}]*\}')
_VALUE = re.compile(rb',?"value":"[A-Za-z0-9+/=]*"')
EMPTY_DOC = base64.b64encode(b"{}")


def reduce_range_answer(data: bytes) -> tuple[bytes, int]:
    """A gateway range answer with its ``kvs`` cut to the last one, whose value becomes
    ``{}``: what tabby's paging reads (header revision, ``more``, ``count``, the last key)
    without every document. Returns (answer, number of keys the answer held)."""
    n = data.count(b'{"key":"')
    if n == 0:
        return data, 0
    start = data.find(b'"kvs":[')
    last = data.rfind(b'{"key":"')
    close = data.find(b"}", last)
    if start < 0 or close < 0:
        return data, n
    kv = data[last : close + 1]
    kv = _VALUE.sub(b"", kv)
    kv = kv[:-1] + b',"value":"' + EMPTY_DOC + b'"}'
    end = data.find(b"]", close)
    if end < 0:
        return data, n
    return data[: start + 7] + kv + data[end:], n


# == key ranges ==============================================================================


def covers(ranges: Iterable[tuple[bytes, bytes]], key: bytes) -> bool:
    """Whether ``key`` is in one of the ``[start, end)`` ranges (end ``b""``: the key
    alone; ``b"\\0"``: every key from ``start``)."""
    for start, end in ranges:
        if not end:
            if key == start:
                return True
        elif key >= start and (end == b"\0" or key < end):
            return True
    return False


class KindOf:
    """A raw etcd key -> tabby's store kind, from tabby's own key layout
    (``datastore.etcd.LAYOUT``) and prefix: follows tabby when its layout changes."""

    def __init__(self, prefix: str, layout: Mapping[str, str]) -> None:
        base = prefix.rstrip("/").encode() + b"/"
        self._prefixes = sorted(
            ((base + sub.encode(), kind) for kind, sub in layout.items()),
            key=lambda p: -len(p[0]),
        )
        self._memo: dict[bytes, str] = {}

    def __call__(self, key: bytes) -> str:
        head = key[: key.rfind(b"/", 0, 80) + 1] if b"/" in key else key
        kind = self._memo.get(head)
        if kind is None:
            kind = "other"
            for p, k in self._prefixes:
                if key.startswith(p):
                    kind = k
                    break
            if len(self._memo) < 4096:
                self._memo[head] = kind
        return kind


# == tables (percentiles: bench.stats) ============================================================


def fmt(value: float | None, unit: str = "", digits: int = 1) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value:.{digits}f}{unit}"


def table(rows: Sequence[Sequence[str]], header: Sequence[str]) -> str:
    """A plain text table, columns left-aligned and padded to their widest cell."""
    cells = [list(header), *[list(r) for r in rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    out = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    out.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(out)
