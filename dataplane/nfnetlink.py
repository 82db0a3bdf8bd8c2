"""What nftables tells userspace about packets, over netlink (``NETLINK_NETFILTER``):

* **NFLOG** (``nfnetlink_log``): a rule with ``log group N`` copies the packet (its first
  bytes) to whoever bound group N in that network namespace. :class:`NflogListener` binds a
  group and reads :class:`LoggedPacket` s: the rule's prefix, the interfaces, the addresses,
  protocol and ports.
* **Trace events** (``nf_tables`` trace, what ``nft monitor trace`` prints): a packet with
  ``meta nftrace set 1`` makes every rule it meets in every nftables chain report itself to
  the multicast group ``NFNLGRP_NFTRACE``. :class:`TraceListener` joins the group and reads
  :class:`TraceEvent` s: table, chain, rule handle, verdict.

Standard library only: the messages are small and fixed (libnetfilter_log is not needed,
and pyroute2 has no NFLOG). Like every netlink socket, a listener belongs to the network
namespace of the thread that made it.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import select
import socket
import struct
import time
from collections.abc import Collection, Iterator

# Kernel ABI: linux/netlink.h, linux/netfilter/nfnetlink.h, nfnetlink_log.h, nf_tables.h.
NETLINK_NETFILTER = 12
SOL_NETLINK = 270
NETLINK_ADD_MEMBERSHIP = 1
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP = 0x300
NFNL_SUBSYS_ULOG = 4
NFNL_SUBSYS_NFTABLES = 10
NFULNL_MSG_PACKET = 0
NFULNL_MSG_CONFIG = 1
NFULA_CFG_CMD, NFULA_CFG_MODE, NFULA_CFG_TIMEOUT, NFULA_CFG_QTHRESH = 1, 2, 3, 4
NFULNL_CFG_CMD_BIND, NFULNL_CFG_CMD_UNBIND = 1, 2
NFULNL_COPY_PACKET = 2
NFULA_PACKET_HDR, NFULA_IFINDEX_INDEV, NFULA_IFINDEX_OUTDEV = 1, 4, 5
NFULA_PAYLOAD, NFULA_PREFIX = 9, 10
NFT_MSG_NEWTABLE, NFT_MSG_GETTABLE = 0, 1
NFTA_TABLE_NAME = 1
NFT_MSG_TRACE = 17
NFT_MSG_NEWOBJ, NFT_MSG_GETOBJ_RESET = 18, 21
NFPROTO_INET = 1
NFT_OBJECT_COUNTER = 1
NFTA_OBJ_TABLE, NFTA_OBJ_NAME, NFTA_OBJ_TYPE, NFTA_OBJ_DATA = 1, 2, 3, 4
NFTA_COUNTER_BYTES, NFTA_COUNTER_PACKETS = 1, 2
NFNLGRP_NFTRACE = 9
NFTA_TRACE_TABLE, NFTA_TRACE_CHAIN, NFTA_TRACE_RULE_HANDLE, NFTA_TRACE_TYPE = 1, 2, 3, 4
NFTA_TRACE_VERDICT, NFTA_TRACE_ID = 5, 6
NFTA_TRACE_NETWORK_HEADER, NFTA_TRACE_TRANSPORT_HEADER = 8, 9
NFTA_TRACE_IIF, NFTA_TRACE_OIF, NFTA_TRACE_NFPROTO, NFTA_TRACE_POLICY = 10, 12, 15, 16
NFTA_VERDICT_CODE, NFTA_VERDICT_CHAIN = 1, 2
NLA_F_MASK = 0x3FFF  # attribute type without NLA_F_NESTED / NLA_F_NET_BYTEORDER

TRACE_TYPES = {1: "policy", 2: "return", 3: "rule"}
VERDICTS = {
    0: "drop",
    1: "accept",
    2: "stolen",
    3: "queue",
    4: "repeat",
    -1: "continue",
    -2: "break",
    -3: "jump",
    -4: "goto",
    -5: "return",
}
PROTOCOL_NAMES = {1: "ICMP", 6: "TCP", 17: "UDP", 58: "ICMPv6", 132: "SCTP", 136: "UDPLite"}
_PORTED = frozenset((6, 17, 132, 136))
_V6_EXTENSIONS = frozenset((0, 43, 60))  # hop-by-hop, routing, destination options
_HDR = struct.Struct("=IHHII")
_NFGEN = struct.Struct("=BBH")
_ATTR = struct.Struct("=HH")
_RECV_BUFFER = 1 << 16


# -- packets -----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Packet:
    """The headers of one IPv4 or IPv6 packet, as far as policy cares."""

    family: int
    src: str
    dst: str
    protocol: int
    sport: int | None = None
    dport: int | None = None
    icmp_type: int | None = None
    icmp_id: int | None = None

    @property
    def protocol_name(self) -> str:
        return PROTOCOL_NAMES.get(self.protocol, str(self.protocol))


def parse_packet(data: bytes) -> Packet | None:
    """The network header (and what follows of the transport header) of a packet; None
    when it is neither a whole IPv4 nor IPv6 header."""
    if not data:
        return None
    version = data[0] >> 4
    if version == 4 and len(data) >= 20:
        ihl = (data[0] & 0xF) * 4
        proto = data[9]
        src = str(ipaddress.IPv4Address(data[12:16]))
        dst = str(ipaddress.IPv4Address(data[16:20]))
        fragment = struct.unpack_from("!H", data, 6)[0] & 0x1FFF
        if fragment:
            return Packet(4, src, dst, proto)
        return _transport(Packet(4, src, dst, proto), data[ihl:])
    if version == 6 and len(data) >= 40:
        proto, offset = data[6], 40
        src = str(ipaddress.IPv6Address(data[8:24]))
        dst = str(ipaddress.IPv6Address(data[24:40]))
        while proto in _V6_EXTENSIONS or proto in (44, 51):
            if offset + 8 > len(data):
                return Packet(6, src, dst, proto)
            nxt = data[offset]
            if proto == 44:  # fragment: a later fragment has no transport header
                if struct.unpack_from("!H", data, offset + 2)[0] & 0xFFF8:
                    return Packet(6, src, dst, nxt)
                offset += 8
            elif proto == 51:  # AH counts in 4-octet units
                offset += (data[offset + 1] + 2) * 4
            else:
                offset += (data[offset + 1] + 1) * 8
            proto = nxt
        return _transport(Packet(6, src, dst, proto), data[offset:])
    return None


def _transport(p: Packet, th: bytes) -> Packet:
    if p.protocol in _PORTED and len(th) >= 4:
        sport, dport = struct.unpack_from("!HH", th)
        return dataclasses.replace(p, sport=sport, dport=dport)
    if p.protocol in (1, 58) and len(th) >= 8:
        kind = th[0]
        ident = struct.unpack_from("!H", th, 4)[0]
        return dataclasses.replace(p, icmp_type=kind, icmp_id=ident)
    return p


# -- messages ---------------------------------------------------------------------------------


def _attr(kind: int, value: bytes) -> bytes:
    length = _ATTR.size + len(value)
    return _ATTR.pack(length, kind) + value + b"\0" * ((4 - length % 4) % 4)


def attributes(
    data: bytes | memoryview, start: int = 0, end: int | None = None
) -> dict[int, bytes]:
    """The netlink attributes between ``start`` and ``end`` (type -> payload; the last one
    wins when a type repeats)."""
    end = len(data) if end is None else end
    out: dict[int, bytes] = {}
    pos = start
    while pos + _ATTR.size <= end:
        length, kind = _ATTR.unpack_from(data, pos)
        if length < _ATTR.size or pos + length > end:
            break
        out[kind & NLA_F_MASK] = bytes(data[pos + _ATTR.size : pos + length])
        pos += (length + 3) & ~3
    return out


@dataclasses.dataclass(frozen=True)
class Message:
    """One nfnetlink message: subsystem, message type, the nfgenmsg's family and resource
    id (an NFLOG group), and its attributes."""

    subsystem: int
    type: int
    family: int
    res_id: int
    attrs: dict[int, bytes]


def split_messages(data: bytes) -> Iterator[Message | int]:
    """The messages of one datagram; a netlink error (an ack) is yielded as its errno (0
    for a positive ack, and for the end of a dump)."""
    offset = 0
    while offset + _HDR.size <= len(data):
        length, mtype, _flags, _seq, _pid = _HDR.unpack_from(data, offset)
        if length < _HDR.size or offset + length > len(data):
            return
        if mtype == NLMSG_ERROR:
            (err,) = struct.unpack_from("=i", data, offset + _HDR.size)
            yield -err
        elif mtype == NLMSG_DONE:
            yield 0
        elif length >= _HDR.size + _NFGEN.size:
            family, _version, res_id = _NFGEN.unpack_from(data, offset + _HDR.size)
            yield Message(
                mtype >> 8,
                mtype & 0xFF,
                family,
                socket.ntohs(res_id),
                attributes(data, offset + _HDR.size + _NFGEN.size, offset + length),
            )
        offset += (length + 3) & ~3


class NetfilterSocket:
    """One ``NETLINK_NETFILTER`` socket in the calling thread's network namespace."""

    def __init__(self, rcvbuf: int = 1 << 20) -> None:
        self.sock = socket.socket(
            socket.AF_NETLINK, socket.SOCK_RAW | socket.SOCK_CLOEXEC, NETLINK_NETFILTER
        )
        try:
            self.sock.bind((0, 0))
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        except OSError:
            self.sock.close()
            raise
        self._seq = 0
        #: Datagrams the kernel could not deliver because this socket's buffer was full.
        self.overruns = 0

    def fileno(self) -> int:
        return self.sock.fileno()

    def request(
        self,
        subsystem: int,
        mtype: int,
        family: int,
        res_id: int,
        body: bytes,
        *,
        dump: bool = False,
    ) -> list[Message]:
        """Send one request and wait for its ack (or, ``dump``, the end of its dump); the
        messages that came before; OSError with the kernel's errno."""
        self._seq += 1
        payload = _NFGEN.pack(family, 0, socket.htons(res_id)) + body
        flags = NLM_F_REQUEST | (NLM_F_DUMP if dump else NLM_F_ACK)
        header = _HDR.pack(_HDR.size + len(payload), (subsystem << 8) | mtype, flags, self._seq, 0)
        self.sock.send(header + payload)
        deadline = time.monotonic() + 5
        out: list[Message] = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self.sock], [], [], left)[0]:
                raise OSError(errno.ETIMEDOUT, "no answer from nfnetlink")
            for item in split_messages(self.sock.recv(_RECV_BUFFER)):
                if isinstance(item, int):
                    if item:
                        raise OSError(item, os.strerror(item))
                    return out
                out.append(item)

    def read(self, timeout: float) -> list[Message]:
        """The messages that arrive within ``timeout`` seconds of the first wait (what is
        queued already, else the first datagram to come); [] when none came."""
        out: list[Message] = []
        wait = timeout
        while select.select([self.sock], [], [], wait)[0]:
            try:
                data = self.sock.recv(_RECV_BUFFER)
            except OSError as e:
                if e.errno == errno.ENOBUFS:  # the kernel dropped some: go on with the rest
                    self.overruns += 1
                    continue
                raise
            out += [m for m in split_messages(data) if isinstance(m, Message)]
            wait = 0
        return out

    def close(self) -> None:
        self.sock.close()


def reset_counters(table: str, names: Collection[str] | None = None) -> list[tuple[str, int, int]]:
    """(name, packets, bytes) of every named counter of ``inet <table>`` in the calling
    thread's namespace, or of those of ``names`` that exist, read and zeroed in one step by
    the kernel (what ``nft reset counters`` asks for; libnftables may answer a repeated
    reset from its cache, with the values of the previous one). OSError when the table does
    not exist."""
    nl = NetfilterSocket(rcvbuf=1 << 18)
    try:
        body = _attr(NFTA_OBJ_TABLE, table.encode() + b"\0") + _attr(
            NFTA_OBJ_TYPE, struct.pack(">I", NFT_OBJECT_COUNTER)
        )
        if names is None:
            replies = nl.request(
                NFNL_SUBSYS_NFTABLES, NFT_MSG_GETOBJ_RESET, NFPROTO_INET, 0, body, dump=True
            )
        else:  # the few a change removes: not the whole table's (two per pod)
            replies = []
            for name in names:
                one = body + _attr(NFTA_OBJ_NAME, name.encode() + b"\0")
                try:
                    replies += nl.request(
                        NFNL_SUBSYS_NFTABLES, NFT_MSG_GETOBJ_RESET, NFPROTO_INET, 0, one
                    )
                except FileNotFoundError:
                    continue  # not there (any more): nothing counted to keep
    finally:
        nl.close()
    out = []
    for m in replies:
        if m.type != NFT_MSG_NEWOBJ or NFTA_OBJ_DATA not in m.attrs:
            continue
        data = attributes(m.attrs[NFTA_OBJ_DATA])
        name = m.attrs.get(NFTA_OBJ_NAME, b"").split(b"\0", 1)[0].decode(errors="replace")
        packets = struct.unpack(">Q", data.get(NFTA_COUNTER_PACKETS, bytes(8))[:8])[0]
        nbytes = struct.unpack(">Q", data.get(NFTA_COUNTER_BYTES, bytes(8))[:8])[0]
        out.append((name, packets, nbytes))
    return out


def table_exists(table: str) -> bool:
    """Whether the nftables table ``inet <table>`` is in the calling thread's network
    namespace (one netlink request, no dump); OSError when the kernel could not be asked."""
    nl = NetfilterSocket(rcvbuf=1 << 16)
    try:
        body = _attr(NFTA_TABLE_NAME, table.encode() + b"\0")
        nl.request(NFNL_SUBSYS_NFTABLES, NFT_MSG_GETTABLE, NFPROTO_INET, 0, body)
    except OSError as e:
        if e.errno == errno.ENOENT:
            return False
        raise
    finally:
        nl.close()
    return True


# -- NFLOG --------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LoggedPacket:
    """One packet a ``log group`` rule sent: the rule's prefix, the interfaces (ifindex, 0
    when none), the packet's headers (None if they could not be read), when it came."""

    prefix: str
    indev: int
    outdev: int
    packet: Packet | None
    received: float


class NflogListener:
    """Binds NFLOG ``group`` in the calling thread's namespace (one listener per group and
    namespace: the kernel refuses a second with EBUSY) and asks for the first ``copy``
    bytes of each packet, sent as soon as ``qthreshold`` packets are queued or ``flush``
    seconds passed. The default sends each packet at once: the rules that log are
    rate-limited, and a packet's time is when it comes."""

    def __init__(
        self, group: int, *, copy: int = 128, qthreshold: int = 1, flush: float = 0.1
    ) -> None:
        self.group = group
        self.nl = NetfilterSocket()
        try:
            self._config(_attr(NFULA_CFG_CMD, struct.pack("B", NFULNL_CFG_CMD_BIND)))
            self._config(
                _attr(NFULA_CFG_MODE, struct.pack(">IBB", copy, NFULNL_COPY_PACKET, 0))
                + _attr(NFULA_CFG_QTHRESH, struct.pack(">I", qthreshold))
                + _attr(NFULA_CFG_TIMEOUT, struct.pack(">I", max(1, round(flush * 100))))
            )
        except OSError:
            self.nl.close()
            raise

    def _config(self, body: bytes) -> None:
        self.nl.request(NFNL_SUBSYS_ULOG, NFULNL_MSG_CONFIG, socket.AF_UNSPEC, self.group, body)

    @property
    def overruns(self) -> int:
        return self.nl.overruns

    def read(self, timeout: float) -> list[LoggedPacket]:
        messages = self.nl.read(timeout)
        now = time.time()
        out = []
        for m in messages:
            if (m.subsystem, m.type) != (NFNL_SUBSYS_ULOG, NFULNL_MSG_PACKET):
                continue
            a = m.attrs
            out.append(
                LoggedPacket(
                    a.get(NFULA_PREFIX, b"").split(b"\0", 1)[0].decode(errors="replace"),
                    _be32(a.get(NFULA_IFINDEX_INDEV)),
                    _be32(a.get(NFULA_IFINDEX_OUTDEV)),
                    parse_packet(a.get(NFULA_PAYLOAD, b"")),
                    now,
                )
            )
        return out

    def close(self) -> None:
        try:
            self._config(_attr(NFULA_CFG_CMD, struct.pack("B", NFULNL_CFG_CMD_UNBIND)))
        except OSError:
            pass  # closing the socket unbinds it as well
        self.nl.close()

    def __enter__(self) -> NflogListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _be32(raw: bytes | None) -> int:
    return struct.unpack(">I", raw[:4])[0] if raw and len(raw) >= 4 else 0


# -- nftables trace -------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class TraceEvent:
    """One step of a traced packet: ``type`` is ``rule`` (a rule matched; ``handle`` is
    its handle), ``return`` (the end of a regular chain) or ``policy`` (the end of a base
    chain: its policy). ``verdict`` is what happened (``accept``, ``drop``, ``continue``,
    ``jump``, ``goto``, ``return``); ``target`` the chain of a jump or goto. ``packet``:
    the headers, on the first event of each hook the packet passes."""

    id: int
    family: int
    table: str
    chain: str
    type: str
    handle: int | None
    verdict: str
    target: str | None
    iif: int
    oif: int
    packet: Packet | None


def trace_event(m: Message) -> TraceEvent | None:
    if (m.subsystem, m.type) != (NFNL_SUBSYS_NFTABLES, NFT_MSG_TRACE):
        return None
    a = m.attrs
    kind = TRACE_TYPES.get(_be32(a.get(NFTA_TRACE_TYPE)), "unknown")
    verdict, target = "continue", None
    if NFTA_TRACE_VERDICT in a:
        nested = attributes(a[NFTA_TRACE_VERDICT])
        code = struct.unpack(">i", nested[NFTA_VERDICT_CODE][:4])[0] if 1 in nested else -1
        verdict = VERDICTS.get(code if code < 0 else code & 0xFF, str(code))
        if NFTA_VERDICT_CHAIN in nested:
            target = nested[NFTA_VERDICT_CHAIN].split(b"\0", 1)[0].decode(errors="replace")
    if kind == "policy" and NFTA_TRACE_POLICY in a:
        verdict = VERDICTS.get(_be32(a[NFTA_TRACE_POLICY]) & 0xFF, "?")
    handle = None
    if NFTA_TRACE_RULE_HANDLE in a and len(a[NFTA_TRACE_RULE_HANDLE]) >= 8:
        handle = struct.unpack(">Q", a[NFTA_TRACE_RULE_HANDLE][:8])[0]
    packet = None
    if NFTA_TRACE_NETWORK_HEADER in a:
        raw = a[NFTA_TRACE_NETWORK_HEADER] + a.get(NFTA_TRACE_TRANSPORT_HEADER, b"")
        packet = parse_packet(raw)
    nfproto = _be32(a.get(NFTA_TRACE_NFPROTO))
    return TraceEvent(
        id=_be32(a.get(NFTA_TRACE_ID)),
        family=4 if nfproto == socket.AF_INET else 6 if nfproto == socket.AF_INET6 else 0,
        table=a.get(NFTA_TRACE_TABLE, b"").split(b"\0", 1)[0].decode(errors="replace"),
        chain=a.get(NFTA_TRACE_CHAIN, b"").split(b"\0", 1)[0].decode(errors="replace"),
        type=kind,
        handle=handle,
        verdict=verdict,
        target=target,
        iif=_be32(a.get(NFTA_TRACE_IIF)),
        oif=_be32(a.get(NFTA_TRACE_OIF)),
        packet=packet,
    )


class TraceListener:
    """Joins the nftables trace group of the calling thread's namespace: every event of
    every traced packet there (filter them by the packet's headers and the trace id)."""

    def __init__(self) -> None:
        self.nl = NetfilterSocket()
        try:
            self.nl.sock.setsockopt(SOL_NETLINK, NETLINK_ADD_MEMBERSHIP, NFNLGRP_NFTRACE)
        except OSError:
            self.nl.close()
            raise

    def read(self, timeout: float) -> list[TraceEvent]:
        return [e for m in self.nl.read(timeout) if (e := trace_event(m)) is not None]

    def close(self) -> None:
        self.nl.close()

    def __enter__(self) -> TraceListener:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = [
    "LoggedPacket",
    "Message",
    "NetfilterSocket",
    "NflogListener",
    "Packet",
    "TraceEvent",
    "TraceListener",
    "attributes",
    "parse_packet",
    "reset_counters",
    "split_messages",
    "table_exists",
    "trace_event",
]
