"""``tabbyctl policy trace`` across nodes: the request to the destination's node and its
answer (kind ``trace``, written with a ttl; standard library only).

A probe that leaves one node is decided twice: its egress on the source's node (which
tabbyctl traces itself, where it runs) and its ingress on the destination's node. For the
latter tabbyctl asks that node's tabby-node through the datastore, as it asks everything
else of the cluster (no port of tabby-node is reachable from other nodes but metrics):

- key ``<id>`` (16 hex digits): the request, :class:`TraceRequest`: which node, the probe
  (addresses, protocol, ports or ICMP echo id), for how long to trace;
- key ``<id>.<node>``: that node's answer, :class:`TraceAnswer`: ``armed`` once the trace
  is in its kernel (tabbyctl sends the probe then), then ``done`` with what tabby's table
  decided, or ``failed`` with why.

Every field is checked here, strictly: a request's addresses and numbers become an
nftables match on a node (``dataplane.nfttrace.Probe``).
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
from collections.abc import Mapping

from bundle.types import JSON
from datastore.errors import StoreCorrupt

KIND = "trace"
#: The longest a node traces for one request.
MAX_SECONDS = 30.0
STATES = ("armed", "done", "failed")
_ID = re.compile(r"[0-9a-f]{16}")


def answer_key(trace_id: str, node: str) -> str:
    return f"{trace_id}.{node}"


def _int(data: Mapping[str, object], name: str, lo: int, hi: int, where: str) -> int | None:
    value = data.get(name)
    if value is None:
        return None
    if type(value) is not int or not lo <= value <= hi:
        raise StoreCorrupt(where, f"malformed trace: {name}")
    return value


def _str(data: Mapping[str, object], name: str, where: str) -> str:
    value = data.get(name)
    if not isinstance(value, str) or not value:
        raise StoreCorrupt(where, f"malformed trace: {name}")
    return value


@dataclasses.dataclass(frozen=True, slots=True)
class TraceRequest:
    """Trace the probe on ``node`` for ``seconds``."""

    id: str
    node: str
    family: int
    src: str
    dst: str
    protocol: str
    sport: int | None
    dport: int | None
    icmp_id: int | None
    seconds: float

    @classmethod
    def from_data(cls, data: Mapping[str, object], where: str) -> TraceRequest:
        trace_id, node = _str(data, "id", where), _str(data, "node", where)
        if not _ID.fullmatch(trace_id):
            raise StoreCorrupt(where, "malformed trace: id")
        protocol = _str(data, "protocol", where)
        if protocol not in ("TCP", "UDP", "ICMP"):
            raise StoreCorrupt(where, "malformed trace: protocol")
        family = _int(data, "family", 4, 6, where)
        addrs = []
        for name in ("src", "dst"):
            try:
                addr = ipaddress.ip_address(_str(data, name, where))
            except ValueError:
                raise StoreCorrupt(where, f"malformed trace: {name}") from None
            if addr.version != family:
                raise StoreCorrupt(where, f"malformed trace: {name} is not IPv{family}")
            addrs.append(str(addr))
        sport = _int(data, "sport", 1, 65535, where)
        dport = _int(data, "dport", 1, 65535, where)
        icmp_id = _int(data, "icmp_id", 0, 65535, where)
        if protocol == "ICMP" and icmp_id is None:
            raise StoreCorrupt(where, "malformed trace: an ICMP probe needs icmp_id")
        if protocol != "ICMP" and (sport is None or dport is None):
            raise StoreCorrupt(where, "malformed trace: a TCP or UDP probe needs both ports")
        seconds = data.get("seconds")
        if not isinstance(seconds, int | float) or isinstance(seconds, bool):
            raise StoreCorrupt(where, "malformed trace: seconds")
        if not 0 < seconds <= MAX_SECONDS:
            raise StoreCorrupt(where, f"malformed trace: seconds (at most {MAX_SECONDS:.0f})")
        assert family in (4, 6)
        return cls(
            trace_id, node, family, addrs[0], addrs[1], protocol, sport, dport, icmp_id, seconds
        )

    def to_data(self) -> JSON:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True, slots=True)
class TraceAnswer:
    """A node's answer: ``decisions`` and ``foreign`` as ``dataplane.nfttrace`` gives them
    (``Decision.to_json``), ``events`` how many trace events the probe caused there."""

    id: str
    node: str
    state: str
    decisions: tuple[JSON, ...] = ()
    foreign: tuple[JSON, ...] = ()
    events: int = 0
    error: str = ""

    @classmethod
    def from_data(cls, data: Mapping[str, object], where: str) -> TraceAnswer:
        state = _str(data, "state", where)
        if state not in STATES:
            raise StoreCorrupt(where, "malformed trace answer: state")
        lists = []
        for name in ("decisions", "foreign"):
            value = data.get(name, [])
            if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
                raise StoreCorrupt(where, f"malformed trace answer: {name}")
            lists.append(tuple(value))
        events = data.get("events", 0)
        error = data.get("error", "")
        if type(events) is not int or not isinstance(error, str):
            raise StoreCorrupt(where, "malformed trace answer")
        return cls(
            _str(data, "id", where),
            _str(data, "node", where),
            state,
            lists[0],
            lists[1],
            events,
            error,
        )

    def to_data(self) -> JSON:
        out = dataclasses.asdict(self)
        out["decisions"] = [dict(d) for d in self.decisions]
        out["foreign"] = [dict(f) for f in self.foreign]
        return out


def parse(key: str, data: Mapping[str, object], where: str) -> TraceRequest | TraceAnswer:
    """A request (key ``<id>``) or an answer (key ``<id>.<node>``)."""
    if "." in key:
        return TraceAnswer.from_data(data, where)
    request = TraceRequest.from_data(data, where)
    if request.id != key:
        raise StoreCorrupt(where, "malformed trace: its id is not its key")
    return request


__all__ = ["KIND", "MAX_SECONDS", "TraceAnswer", "TraceRequest", "answer_key", "parse"]
