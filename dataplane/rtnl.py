"""A small typed facade over rtnetlink: the only module that touches pyroute2.

pyroute2 is used for what it is best at, the rtnetlink message formats: requests are built
as its ``ifinfmsg``/``ifaddrmsg``/``rtmsg``/``nsidmsg`` messages and replies are decoded by
the same classes, except a link's: what a :class:`Link` holds is read straight from its bytes
(:func:`parse_link`; every call reads one or two links, and pyroute2's decoding of one was
~0.5 ms of CPU), the rest of it decoded by pyroute2 only when asked (:class:`LinkReply`).
The transport is ours: one blocking NETLINK_ROUTE socket, a request, then
its replies up to the ACK (or NLMSG_DONE for a dump). pyroute2's own ``IPRoute`` runs every
request through an asyncio event loop and its request filters: ~0.35 ms more per request and
~60 ms more to import (asyncio, its socket layer), measured. Requests that do not depend on
each other's answers go together (:meth:`Rtnl.send`): several in one datagram, and the
sockets of both namespaces under way at once, so an ADD waits for 3 round trips.

pyroute2 ships no type information: its messages are seen through :class:`Message` (what
is read of them is untyped), and everything they hold is converted here into the frozen
dataclasses below, so the untyped values stop at this module's border. Every failure becomes a
:class:`~dataplane.errors.NetlinkFailure` that names the operation, the namespace it ran in
and the errno.

Sockets: an :class:`Rtnl` owns one socket, created either in the calling thread
(:meth:`Rtnl.here`) or in a worker thread that entered another namespace
(:meth:`Rtnl.in_netns`); a netlink socket stays bound to the namespace it was created in,
so the object can then be used from the calling thread.
"""

from __future__ import annotations

import dataclasses
import errno as errno_mod
import ipaddress
import socket
import struct
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from dataplane import lazy_pyroute2

# Any pyroute2 submodule would run the package __init__ (it imports nearly every pyroute2
# family): registering the package lazily first saves ~80 ms per CNI process. Only this
# module, itself loaded lazily, imports pyroute2.
lazy_pyroute2.prepare("pyroute2")

from pyroute2.netlink.rtnl.ifaddrmsg import ifaddrmsg  # noqa: E402
from pyroute2.netlink.rtnl.ifinfmsg import ifinfmsg  # noqa: E402
from pyroute2.netlink.rtnl.nsidmsg import nsidmsg  # noqa: E402
from pyroute2.netlink.rtnl.rtmsg import rtmsg  # noqa: E402

from bundle.types import IPAddress, IPNetwork  # noqa: E402
from dataplane import netns as netns_mod  # noqa: E402
from dataplane.errors import NetlinkFailure  # noqa: E402

# Kernel ABI (linux/netlink.h, linux/rtnetlink.h).
NLMSG_ERROR = 2
NLMSG_DONE = 3
NLM_F_REQUEST = 0x1
NLM_F_ACK = 0x4
NLM_F_DUMP_INTR = 0x10
NLM_F_DUMP = 0x300
NLM_F_REPLACE = 0x100
NLM_F_EXCL = 0x200
NLM_F_CREATE = 0x400
RTM_NEWLINK, RTM_DELLINK, RTM_GETLINK = 16, 17, 18
RTM_NEWADDR, RTM_GETADDR = 20, 22
RTM_NEWROUTE, RTM_DELROUTE, RTM_GETROUTE = 24, 25, 26
RTM_NEWNSID, RTM_GETNSID = 88, 90


class Message(Protocol):
    """What tabby uses of a pyroute2 netlink message (``ifinfmsg``, ``rtmsg``, ...): its
    fields and attributes by name, its encoding. The values are what pyroute2 decoded
    (numbers, strings, nested messages and mappings): untyped, and read only by this module
    and :mod:`dataplane.rtnl_routing`, which convert them."""

    @property
    def data(self) -> bytes | bytearray: ...
    def __getitem__(self, key: str) -> Any: ...
    def __setitem__(self, key: str, value: object) -> None: ...
    def get(self, key: str | tuple[str, ...]) -> Any: ...
    def get_attr(self, name: str) -> Any: ...
    def encode(self) -> object: ...
    def decode(self) -> object: ...


#: A netlink attribute of a request: (its name, its value as pyroute2 encodes it).
Attr = tuple[str, object]
Decoder = Callable[..., Message]

_DECODERS: dict[int, Decoder] = {
    RTM_NEWLINK: lambda data, offset=0: LinkReply(data, offset),
    RTM_NEWADDR: ifaddrmsg,
    RTM_NEWROUTE: rtmsg,
    RTM_NEWNSID: nsidmsg,
}
_NLMSGHDR = struct.Struct("=IHHII")
_ERRNO = struct.Struct("=i")
_SEQ = struct.Struct("=I")
_SEQ_OFFSET = 8  # nlmsg_seq in struct nlmsghdr
_RECV_BUFFER = 1 << 18  # a dump part is at most ~32 KiB; several may come in one read
_DUMP_ATTEMPTS = 5  # a dump the kernel marks interrupted (NLM_F_DUMP_INTR) is redone

IFF_UP = 0x1
RTEXT_FILTER_SKIP_STATS = 1 << 3  # IFLA_EXT_MASK: no IFLA_STATS* in a link's answer
IFA_F_NODAD = 0x02
RT_TABLE_MAIN = 254
RT_SCOPE_UNIVERSE = 0
RT_SCOPE_NOWHERE = 255  # "any scope" when deleting an IPv4 route
RTPROT_BOOT = 3  # what `ip route add` uses
RTN_UNICAST = 1
SOL_NETLINK = 270
NETLINK_CAP_ACK = 10
NETLINK_EXT_ACK = 11
NETLINK_GET_STRICT_CHK = 12
NLM_F_CAPPED = 0x100  # in an ack: the echoed request is only its header
NLM_F_ACK_TLVS = 0x200  # in an ack: extended-ack TLVs follow
NLMSGERR_ATTR_MSG = 1


@dataclasses.dataclass(frozen=True)
class Link:
    index: int
    name: str
    kind: str | None
    mac: str | None
    up: bool
    mtu: int
    #: IFLA_LINK: for a veth, the peer's ifindex (in the peer's namespace).
    peer_index: int | None
    #: IFLA_LINK_NETNSID: set when the peer lives in another namespace (its nsid from here).
    peer_netnsid: int | None
    #: IPv6 ``disable_ipv6`` of this link; None if the kernel reports no IPv6 state for it.
    ipv6_disabled: bool | None = None
    #: IFLA_IFALIAS ("" if unset).
    alias: str = ""


@dataclasses.dataclass(frozen=True)
class Addr:
    index: int
    address: IPAddress
    prefixlen: int


@dataclasses.dataclass(frozen=True)
class Route:
    dst: IPNetwork
    gw: IPAddress | None
    oif: int | None
    scope: int
    table: int
    multipath: bool


@dataclasses.dataclass(frozen=True)
class Request:
    """One netlink request of a batch (:meth:`Rtnl.send`): what it does (for errors), its
    message, type and flags (NLM_F_REQUEST and NLM_F_ACK are added)."""

    op: str
    msg: Message
    msg_type: int
    flags: int = 0


# What a Link holds of a RTM_NEWLINK reply (linux/if_link.h, linux/ipv6.h), read by
# :func:`parse_link` without pyroute2.
_IFINFOMSG = struct.Struct("=BxHiII")  # family, type, index, flags, change
_NLA = struct.Struct("=HH")
_U32 = struct.Struct("=I")
_S32 = struct.Struct("=i")
_NLA_TYPE_MASK = 0x3FFF  # without NLA_F_NESTED / NLA_F_NET_BYTEORDER
IFLA_ADDRESS, IFLA_IFNAME, IFLA_MTU, IFLA_LINK = 1, 3, 4, 5
IFLA_LINKINFO, IFLA_IFALIAS, IFLA_AF_SPEC, IFLA_LINK_NETNSID = 18, 20, 26, 37
IFLA_INFO_KIND = 1
IFLA_INET6_CONF = 2
DEVCONF_DISABLE_IPV6 = 26  # index of disable_ipv6 in IFLA_INET6_CONF's array of u32


def _attrs(data: bytes, start: int, end: int) -> Iterator[tuple[int, int, int]]:
    """(type, payload start, payload end) of each netlink attribute in data[start:end]."""
    pos = start
    while pos + _NLA.size <= end:
        length, kind = _NLA.unpack_from(data, pos)
        if length < _NLA.size or pos + length > end:
            return
        yield kind & _NLA_TYPE_MASK, pos + _NLA.size, pos + length
        pos += (length + 3) & ~3


def _text(data: bytes, start: int, end: int) -> str:
    return data[start:end].split(b"\0", 1)[0].decode(errors="replace")


def _link_kind(data: bytes, start: int, end: int) -> str | None:
    """IFLA_INFO_KIND of an IFLA_LINKINFO payload."""
    for info, a, b in _attrs(data, start, end):
        if info == IFLA_INFO_KIND:
            return _text(data, a, b)
    return None


def _ipv6_disabled(data: bytes, start: int, end: int) -> bool | None:
    """disable_ipv6 of an IFLA_AF_SPEC payload (None: it has no IPv6 configuration)."""
    for family, a, b in _attrs(data, start, end):
        if family != socket.AF_INET6:
            continue
        for what, c, d in _attrs(data, a, b):
            at = c + 4 * DEVCONF_DISABLE_IPV6
            if what == IFLA_INET6_CONF and at + 4 <= d:
                return bool(_U32.unpack_from(data, at)[0])
    return None


def parse_link(data: bytes) -> Link:
    """The :class:`Link` one RTM_NEWLINK message (``data``: the message, its header
    first) describes. Read straight from the bytes: pyroute2's decoding of a link (its
    nested per-family configuration above all) was most of the netlink CPU of a call
    tabby-node serves (py-spy, bench.cni.datastore_cni_bench), and a Link needs a few
    attributes of it."""
    end = min(len(data), _NLMSGHDR.unpack_from(data, 0)[0])
    start = _NLMSGHDR.size
    _family, _type, index, flags, _change = _IFINFOMSG.unpack_from(data, start)
    name, kind, mac, alias = "", None, None, ""
    mtu = 0
    peer: int | None = None
    nsid: int | None = None
    v6off: bool | None = None
    for attr, a, b in _attrs(data, start + _IFINFOMSG.size, end):
        if attr == IFLA_IFNAME:
            name = _text(data, a, b)
        elif attr == IFLA_ADDRESS:
            mac = ":".join(f"{octet:02x}" for octet in data[a:b])
        elif attr == IFLA_MTU and b - a >= 4:
            mtu = _U32.unpack_from(data, a)[0]
        elif attr == IFLA_LINK and b - a >= 4:
            peer = _U32.unpack_from(data, a)[0]
        elif attr == IFLA_LINK_NETNSID and b - a >= 4:
            nsid = _S32.unpack_from(data, a)[0]
        elif attr == IFLA_IFALIAS:
            alias = _text(data, a, b)
        elif attr == IFLA_LINKINFO:
            kind = _link_kind(data, a, b)
        elif attr == IFLA_AF_SPEC:
            v6off = _ipv6_disabled(data, a, b)
    return Link(
        index=index,
        name=name,
        kind=kind,
        mac=mac,
        up=bool(flags & IFF_UP),
        mtu=mtu,
        peer_index=peer,
        peer_netnsid=nsid,
        ipv6_disabled=v6off,
        alias=alias,
    )


class LinkReply:
    """A RTM_NEWLINK reply, kept as its bytes: :meth:`Rtnl._link` reads it with
    :func:`parse_link`; what else a caller asks of it (:mod:`dataplane.rtnl_routing`: a
    VXLAN's attributes) pyroute2 decodes on first use."""

    __slots__ = ("_decoded", "raw")

    def __init__(self, data: bytes | bytearray, offset: int = 0) -> None:
        length = _NLMSGHDR.unpack_from(data, offset)[0]
        self.raw = bytes(data[offset : offset + length])
        self._decoded: Message | None = None

    def _message(self) -> Message:
        if self._decoded is None:
            msg: Message = ifinfmsg(self.raw)
            msg.decode()
            self._decoded = msg
        return self._decoded

    @property
    def data(self) -> bytes:
        return self.raw

    def __getitem__(self, key: str) -> object:
        return self._message()[key]

    def __setitem__(self, key: str, value: object) -> None:
        self._message()[key] = value

    def get(self, key: str | tuple[str, ...]) -> object:
        return self._message().get(key)

    def get_attr(self, name: str) -> object:
        return self._message().get_attr(name)

    def encode(self) -> object:
        return self._message().encode()

    def decode(self) -> object:
        """Nothing now: the reply is decoded when something other than a Link is read."""
        return None


@dataclasses.dataclass(frozen=True)
class Sent:
    """Requests sent and not yet answered (:meth:`Rtnl.send`)."""

    requests: tuple[Request, ...]
    seqs: tuple[int, ...]


def _encode(msg: Message, msg_type: int, flags: int) -> bytearray:
    """The request's bytes (its sequence number still to be set). Once per message:
    pyroute2 appends to ``msg.data`` on every encode()."""
    dump = flags & NLM_F_DUMP == NLM_F_DUMP
    msg["header"]["type"] = msg_type
    msg["header"]["flags"] = NLM_F_REQUEST | flags | (0 if dump else NLM_F_ACK)
    msg["header"]["pid"] = 0
    msg.encode()
    return bytearray(msg.data)


def _family(version: int) -> int:
    return socket.AF_INET if version == 4 else socket.AF_INET6


def _new_socket() -> socket.socket:
    sock = socket.socket(
        socket.AF_NETLINK, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC, socket.NETLINK_ROUTE
    )
    # Extended acks carry the kernel's own words ("Invalid MTU"...); capped acks echo only
    # the request's header, not the whole request; strict checking makes the kernel apply
    # a dump request's filters (table, interface). All harmless where unsupported.
    for option in (NETLINK_EXT_ACK, NETLINK_CAP_ACK, NETLINK_GET_STRICT_CHK):
        try:
            sock.setsockopt(SOL_NETLINK, option, 1)
        except OSError:
            pass
    return sock


def _ack_message(data: bytes, offset: int, length: int, flags: int) -> str:
    """NLMSGERR_ATTR_MSG of an extended ack: after the header, the errno and the echoed
    request (only its header when the ack is capped) come TLVs."""
    if not flags & NLM_F_ACK_TLVS:
        return ""
    pos = offset + _NLMSGHDR.size + _ERRNO.size
    if pos + _NLMSGHDR.size > offset + length:
        return ""
    echoed = _NLMSGHDR.unpack_from(data, pos)[0]
    pos += echoed if not flags & NLM_F_CAPPED else _NLMSGHDR.size
    end = offset + length
    while pos + 4 <= end:
        tlv_len, tlv_type = struct.unpack_from("=HH", data, pos)
        if tlv_len < 4 or pos + tlv_len > end:
            break
        if tlv_type & 0x3FFF == NLMSGERR_ATTR_MSG:
            return data[pos + 4 : pos + tlv_len].split(b"\0", 1)[0].decode(errors="replace")
        pos += (tlv_len + 3) & ~3
    return ""


class Rtnl:
    """One rtnetlink socket bound to one network namespace. Not thread-safe: use it from
    one thread at a time."""

    #: Reply decoders by message type; a subclass may extend it (e.g. with neighbours).
    _decoders: dict[int, Decoder] = _DECODERS

    def __init__(self, sock: socket.socket, where: str) -> None:
        self.where = where
        self._sock = sock
        self._seq = 0

    @classmethod
    def here(cls, where: str = "host") -> Rtnl:
        """A socket in the calling thread's namespace."""
        try:
            return cls(_new_socket(), where)
        except OSError as exc:
            raise NetlinkFailure("open socket", where, exc.errno or errno_mod.EIO) from None

    @classmethod
    def in_netns(cls, fd: int, where: str = "pod") -> Rtnl:
        """A socket in the namespace ``fd``, created by the calling thread switched there
        for that moment (``netns.call_in_netns``)."""
        try:
            sock = netns_mod.call_in_netns(fd, _new_socket)
        except OSError as exc:
            raise NetlinkFailure("open socket", where, exc.errno or errno_mod.EIO) from None
        return cls(sock, where)

    def close(self) -> None:
        self._sock.close()

    def __enter__(self) -> Rtnl:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- transport ---------------------------------------------------------------------

    def _request(self, op: str, msg: Message, msg_type: int, flags: int = 0) -> list[Message]:
        """Send ``msg`` and return the decoded replies. Requests that change something (and
        single gets) are ACKed: the ACK ends them, a negative one raises. A dump ends with
        NLMSG_DONE; one the kernel marks interrupted (the table changed while it was read)
        is done again, as iproute2 does."""
        dump = flags & NLM_F_DUMP == NLM_F_DUMP
        request = _encode(msg, msg_type, flags)
        for _ in range(_DUMP_ATTEMPTS if dump else 1):
            self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
            _SEQ.pack_into(request, _SEQ_OFFSET, self._seq)
            try:
                self._sock.send(request)
                replies, interrupted = self._replies(op, self._seq)
            except OSError as exc:
                raise NetlinkFailure(op, self.where, exc.errno or errno_mod.EIO) from None
            if not interrupted:
                return replies
        raise NetlinkFailure(op, self.where, errno_mod.EAGAIN)

    def send(self, requests: Sequence[Request]) -> Sent:
        """Send ``requests`` (no dumps) in one datagram, without waiting: the kernel runs
        them in order, each on its own (one that fails does not stop the next), and ACKs
        each. :meth:`results` reads the answers; meanwhile another socket's requests can be
        under way. One round trip for all of them, where one by one each would be one."""
        data = bytearray()
        seqs: list[int] = []
        for request in requests:
            encoded = _encode(request.msg, request.msg_type, request.flags)
            self._seq = (self._seq + 1) & 0xFFFFFFFF or 1
            _SEQ.pack_into(encoded, _SEQ_OFFSET, self._seq)
            seqs.append(self._seq)
            data += encoded
        try:
            self._sock.send(data)
        except OSError as exc:
            raise NetlinkFailure(
                requests[0].op if requests else "send", self.where, exc.errno or errno_mod.EIO
            ) from None
        return Sent(tuple(requests), tuple(seqs))

    def results(self, sent: Sent) -> list[list[Message] | NetlinkFailure]:
        """The answer to each request of ``sent`` (:meth:`send`), in order: its replies, or
        the failure the kernel answered it with."""
        out: list[list[Message] | NetlinkFailure] = []
        for request, seq in zip(sent.requests, sent.seqs, strict=True):
            try:
                out.append(self._replies(request.op, seq)[0])
            except NetlinkFailure as exc:
                out.append(exc)
            except OSError as exc:
                out.append(NetlinkFailure(request.op, self.where, exc.errno or errno_mod.EIO))
        return out

    def run(self, requests: Sequence[Request]) -> list[list[Message]]:
        """:meth:`send` then :meth:`results`; the first failure raised (once every answer
        is read: the socket stays usable)."""
        results = self.results(self.send(requests))
        for result in results:
            if isinstance(result, NetlinkFailure):
                raise result
        return [r for r in results if not isinstance(r, NetlinkFailure)]

    def _delete(
        self,
        op: str,
        msg: Message,
        msg_type: int,
        absent: tuple[int, ...] = (errno_mod.ESRCH, errno_mod.ENOENT),
    ) -> bool:
        """Send a delete; False (not an error) when the kernel answers with one of the
        errnos that mean it had no such object."""
        try:
            self._request(op, msg, msg_type)
        except NetlinkFailure as exc:
            if exc.errno in absent:
                return False
            raise
        return True

    def _replies(self, op: str, seq: int) -> tuple[list[Message], bool]:
        out: list[Message] = []
        interrupted = False
        while True:
            data = self._sock.recv(_RECV_BUFFER)
            offset = 0
            while offset + _NLMSGHDR.size <= len(data):
                length, mtype, mflags, mseq, _pid = _NLMSGHDR.unpack_from(data, offset)
                if length < _NLMSGHDR.size or offset + length > len(data):
                    raise NetlinkFailure(op, self.where, errno_mod.EBADMSG)
                if mseq == seq:
                    if mtype in (NLMSG_ERROR, NLMSG_DONE):
                        err = 0
                        if length >= _NLMSGHDR.size + _ERRNO.size:
                            (err,) = _ERRNO.unpack_from(data, offset + _NLMSGHDR.size)
                        if err < 0:
                            said = _ack_message(data, offset, length, mflags)
                            raise NetlinkFailure(op, self.where, -err, said)
                        return out, interrupted
                    interrupted |= bool(mflags & NLM_F_DUMP_INTR)
                    decoder = self._decoders.get(mtype)
                    if decoder is not None:
                        reply = decoder(data, offset=offset)
                        reply.decode()
                        out.append(reply)
                offset += (length + 3) & ~3

    # --- links -------------------------------------------------------------------------

    @staticmethod
    def _link(msg: Message) -> Link:
        return parse_link(bytes(msg.data))

    def link_by_name(self, name: str) -> Link | None:
        return self.link_of(self.results(self.send([link_request(name)]))[0])

    def link_of(self, result: list[Message] | NetlinkFailure) -> Link | None:
        """The link a :func:`link_request` answered, or None when it does not exist."""
        if isinstance(result, NetlinkFailure):
            if result.errno == errno_mod.ENODEV:
                return None
            raise result
        for reply in result:
            return self._link(reply)
        return None

    def link_by_index(self, index: int) -> Link | None:
        msg = ifinfmsg()
        msg["index"] = index
        return self._get_link(f"get link #{index}", msg)

    def _get_link(self, what: str, msg: Message) -> Link | None:
        """The one link the request names, or None when it does not exist (ENODEV)."""
        try:
            replies = self._request(what, msg, RTM_GETLINK)
        except NetlinkFailure as exc:
            if exc.errno == errno_mod.ENODEV:
                return None
            raise
        for reply in replies:
            return self._link(reply)
        return None

    def links(self) -> list[Link]:
        return [
            self._link(m) for m in self._request("dump links", ifinfmsg(), RTM_GETLINK, NLM_F_DUMP)
        ]

    def add_veth(
        self,
        name: str,
        *,
        mac: str,
        mtu: int,
        peer_name: str,
        peer_netns_fd: int,
        peer_mac: str | None,
    ) -> None:
        """Create veth ``name`` here, with its peer created directly in ``peer_netns_fd``
        (EEXIST: either name is taken, and nothing was created)."""
        peer: list[Attr] = [
            ("IFLA_IFNAME", peer_name),
            ("IFLA_NET_NS_FD", peer_netns_fd),
            ("IFLA_MTU", mtu),
        ]
        if peer_mac is not None:
            peer.append(("IFLA_ADDRESS", peer_mac))
        msg = ifinfmsg()
        msg["attrs"] = [
            ("IFLA_IFNAME", name),
            ("IFLA_ADDRESS", mac),
            ("IFLA_MTU", mtu),
            (
                "IFLA_LINKINFO",
                {
                    "attrs": [
                        ("IFLA_INFO_KIND", "veth"),
                        ("IFLA_INFO_DATA", {"attrs": [("VETH_INFO_PEER", {"attrs": peer})]}),
                    ]
                },
            ),
        ]
        self._request(
            f"create veth {name} (peer {peer_name} in the pod)",
            msg,
            RTM_NEWLINK,
            NLM_F_CREATE | NLM_F_EXCL,
        )

    def set_up(self, link: Link, *, alias: str | None = None) -> None:
        """Bring ``link`` up, setting its alias in the same request (the kernel ignores
        IFLA_IFALIAS when a link is created)."""
        self.run([set_up_request(link, alias=alias)])

    def delete_link(self, index: int, name: str) -> bool:
        """Delete a link; False if it was already gone."""
        msg = ifinfmsg()
        msg["index"] = index
        try:
            self._request(f"delete link {name}", msg, RTM_DELLINK)
        except NetlinkFailure as exc:
            if exc.errno == errno_mod.ENODEV:
                return False
            raise
        return True

    def netnsid_of(self, fd: int) -> int | None:
        """The nsid this namespace has assigned to the namespace ``fd`` (None if none)."""
        msg = nsidmsg()
        msg["attrs"] = [("NETNSA_FD", fd)]
        for reply in self._request("get netns id", msg, RTM_GETNSID):
            nsid = reply.get_attr("NETNSA_NSID")
            # NETNSA_NSID_NOT_ASSIGNED is -1, which pyroute2 decodes as an unsigned 32-bit
            if nsid is None or not 0 <= int(nsid) < 1 << 31:
                return None
            return int(nsid)
        return None

    # --- addresses ---------------------------------------------------------------------

    def add_address(self, link: Link, address: IPAddress) -> None:
        self.run([address_request(link, address)])

    def addresses(self, index: int) -> list[Addr]:
        msg = ifaddrmsg()
        msg["index"] = index  # the kernel filters by it only in strict mode: filtered below
        replies = self._request(f"dump addresses of #{index}", msg, RTM_GETADDR, NLM_F_DUMP)
        out: list[Addr] = []
        for reply in replies:
            if int(reply["index"]) != index:
                continue
            # IPv4 point-to-point style addresses carry IFA_LOCAL; IFA_ADDRESS is the peer.
            raw = reply.get_attr("IFA_LOCAL") or reply.get_attr("IFA_ADDRESS")
            if raw is None:
                continue
            out.append(Addr(index, ipaddress.ip_address(str(raw)), int(reply["prefixlen"])))
        return out

    # --- routes ------------------------------------------------------------------------

    def add_route(
        self,
        dst: IPNetwork,
        oif: int,
        *,
        gw: IPAddress | None = None,
        scope: int = RT_SCOPE_UNIVERSE,
        replace: bool = False,
    ) -> None:
        self.run([route_request(dst, oif, gw=gw, scope=scope, replace=replace)])

    def delete_route(self, dst: IPNetwork, oif: int) -> bool:
        """Delete the route to ``dst`` *through ``oif``* only; False if there was none."""
        msg = _route_msg(dst, oif, None, RT_SCOPE_NOWHERE, proto=0, rtype=0)
        return self._delete(f"delete route {dst} dev #{oif}", msg, RTM_DELROUTE)

    def routes(self, version: int, oif: int | None = None) -> list[Route]:
        """Main-table unicast routes of one family (only those out of ``oif``, if given).

        The socket asks for strict checking, so the kernel filters by table and interface
        and a node with hundreds of pods does not send (and we do not decode) every route;
        the filters are applied here again for kernels without strict checking (< 4.20).
        """
        query = rtmsg()
        query["family"] = _family(version)
        query["table"] = RT_TABLE_MAIN
        if oif is not None:
            query["attrs"] = [("RTA_OIF", oif)]
        msgs = self._request(f"dump IPv{version} routes", query, RTM_GETROUTE, NLM_F_DUMP)
        out: list[Route] = []
        for msg in msgs:
            table = msg.get("table")
            table = int(table) if table is not None else int(msg["table"])
            if table != RT_TABLE_MAIN or int(msg["type"]) != RTN_UNICAST:
                continue
            route_oif = msg.get("oif")
            if oif is not None and route_oif != oif:
                continue
            dst_raw = msg.get("dst")
            plen = int(msg["dst_len"])
            if dst_raw is None:
                dst_raw = "0.0.0.0" if version == 4 else "::"
            gw_raw = msg.get("gateway")
            out.append(
                Route(
                    dst=ipaddress.ip_network(f"{dst_raw}/{plen}", strict=False),
                    gw=ipaddress.ip_address(str(gw_raw)) if gw_raw is not None else None,
                    oif=int(route_oif) if route_oif is not None else None,
                    scope=int(msg["scope"]),
                    table=table,
                    multipath=msg.get("multipath") is not None,
                )
            )
        return out


# --- requests, sent one by one or several in one datagram (:meth:`Rtnl.send`) -------------


def link_request(name: str) -> Request:
    """Get the link named ``name`` (:meth:`Rtnl.link_of` reads the answer), without its
    statistics: less for the kernel to write and for us to decode."""
    msg = ifinfmsg()
    msg["attrs"] = [("IFLA_IFNAME", name), ("IFLA_EXT_MASK", RTEXT_FILTER_SKIP_STATS)]
    return Request(f"get link {name}", msg, RTM_GETLINK)


def set_up_request(link: Link, *, alias: str | None = None) -> Request:
    """Bring ``link`` up, setting its alias in the same request (the kernel ignores
    IFLA_IFALIAS when a link is created)."""
    msg = ifinfmsg()
    msg["index"] = link.index
    msg["flags"] = IFF_UP
    msg["change"] = IFF_UP
    if alias:
        # The kernel takes at most IFALIASZ - 1 = 255 bytes; a longer alias would make
        # the whole ADD fail, so keep its (meaningful) beginning.
        msg["attrs"] = [("IFLA_IFALIAS", alias.encode()[:255].decode(errors="ignore"))]
    return Request(f"set {link.name} up", msg, RTM_NEWLINK)


def address_request(link: Link, address: IPAddress) -> Request:
    """Add ``address`` (a /32 or /128) to ``link``."""
    plen = 32 if address.version == 4 else 128
    msg = ifaddrmsg()
    msg["family"] = _family(address.version)
    msg["prefixlen"] = plen
    msg["index"] = link.index
    if address.version == 4:
        msg["attrs"] = [("IFA_LOCAL", str(address)), ("IFA_ADDRESS", str(address))]
    else:
        msg["flags"] = IFA_F_NODAD  # usable at once, no DAD wait
        msg["attrs"] = [("IFA_ADDRESS", str(address))]
    return Request(
        f"add address {address}/{plen} to {link.name}",
        msg,
        RTM_NEWADDR,
        NLM_F_CREATE | NLM_F_EXCL,
    )


def _route_msg(
    dst: IPNetwork, oif: int, gw: IPAddress | None, scope: int, *, proto: int, rtype: int
) -> Message:
    msg: Message = rtmsg()
    msg["family"] = _family(dst.version)
    msg["dst_len"] = dst.prefixlen
    msg["table"] = RT_TABLE_MAIN
    msg["proto"] = proto
    msg["type"] = rtype
    msg["scope"] = scope if dst.version == 4 else RT_SCOPE_UNIVERSE
    attrs: list[Attr] = []
    if dst.prefixlen:
        attrs.append(("RTA_DST", str(dst.network_address)))
    attrs.append(("RTA_OIF", oif))
    if gw is not None:
        attrs.append(("RTA_GATEWAY", str(gw)))
    msg["attrs"] = attrs
    return msg


def route_request(
    dst: IPNetwork,
    oif: int,
    *,
    gw: IPAddress | None = None,
    scope: int = RT_SCOPE_UNIVERSE,
    replace: bool = False,
) -> Request:
    """Add (or ``replace``) the main-table route to ``dst`` out of ``oif``."""
    cmd = "replace" if replace else "add"
    via = f" via {gw}" if gw is not None else ""
    msg = _route_msg(dst, oif, gw, scope, proto=RTPROT_BOOT, rtype=RTN_UNICAST)
    flags = NLM_F_CREATE | (NLM_F_REPLACE if replace else NLM_F_EXCL)
    return Request(f"{cmd} route {dst}{via} dev #{oif}", msg, RTM_NEWROUTE, flags)
