"""The rtnetlink transport's framing, against a scripted socket (no root, no kernel).

The privileged tier runs it against the kernel; these cover what the kernel will not do on
demand: an interrupted dump (NLM_F_DUMP_INTR), several messages in one read, replies of an
earlier request still queued, a truncated message.
"""

from __future__ import annotations

import errno
import struct
from typing import Any

import pytest

from dataplane import rtnl
from dataplane.errors import NetlinkFailure

HDR = struct.Struct("=IHHII")


def link_reply(seq: int, index: int, name: str, flags: int = rtnl.NLM_F_DUMP) -> bytes:
    msg = rtnl.ifinfmsg()
    msg["index"] = index
    msg["attrs"] = [("IFLA_IFNAME", name)]
    msg["header"]["type"] = rtnl.RTM_NEWLINK
    msg["header"]["flags"] = flags
    msg["header"]["sequence_number"] = seq
    msg.encode()
    return bytes(msg.data)


def done(seq: int, err: int = 0) -> bytes:
    return HDR.pack(20, rtnl.NLMSG_DONE, 0, seq, 0) + struct.pack("=i", err)


def ack(seq: int, err: int = 0) -> bytes:
    # nlmsgerr: errno + the request's header (capped ack)
    return HDR.pack(36, rtnl.NLMSG_ERROR, 0x100, seq, 0) + struct.pack("=i", err) + bytes(16)


class ScriptedSocket:
    """Answers the n-th request with script[n](seq): a list of datagrams."""

    def __init__(self, *script: Any) -> None:
        self.script = list(script)
        self.sent: list[bytes] = []
        self.queue: list[bytes] = []

    def send(self, data: bytes) -> int:
        self.sent.append(bytes(data))
        length, _type, _flags, seq, _pid = HDR.unpack_from(data)
        assert length == len(data), "one request, one message: its length is the datagram's"
        self.queue += self.script.pop(0)(seq)
        return len(data)

    def recv(self, size: int) -> bytes:
        return self.queue.pop(0)

    def close(self) -> None:
        pass


def make(sock: ScriptedSocket) -> rtnl.Rtnl:
    return rtnl.Rtnl(sock, "test")  # type: ignore[arg-type]


def test_interrupted_dump_is_redone_with_the_same_request() -> None:
    sock = ScriptedSocket(
        lambda seq: [link_reply(seq, 1, "lo", rtnl.NLM_F_DUMP_INTR) + done(seq)],
        lambda seq: [link_reply(seq, 1, "lo"), link_reply(seq, 2, "eth0") + done(seq)],
    )
    links = make(sock).links()
    assert [(x.index, x.name) for x in links] == [(1, "lo"), (2, "eth0")]
    first, second = sock.sent
    assert len(first) == len(second)
    assert first[:8] == second[:8]
    assert first[12:] == second[12:]  # only the sequence number differs
    assert HDR.unpack_from(first)[3] != HDR.unpack_from(second)[3]


def test_a_dump_interrupted_every_time_fails_with_eagain() -> None:
    always = [lambda seq: [link_reply(seq, 1, "lo", rtnl.NLM_F_DUMP_INTR) + done(seq)]]
    sock = ScriptedSocket(*(always * rtnl._DUMP_ATTEMPTS))
    with pytest.raises(NetlinkFailure) as info:
        make(sock).links()
    assert info.value.errno == errno.EAGAIN
    assert len(sock.sent) == rtnl._DUMP_ATTEMPTS


def test_stale_replies_of_an_earlier_request_are_skipped() -> None:
    # A leftover of sequence 999 (say, the rest of a dump whose request failed) comes first.
    sock = ScriptedSocket(
        lambda seq: [link_reply(999, 7, "old") + link_reply(seq, 1, "lo", 0), ack(seq)]
    )
    link = make(sock).link_by_name("lo")
    assert link is not None
    assert (link.index, link.name) == (1, "lo")


def test_negative_ack_raises_with_errno_and_enodev_get_is_none() -> None:
    sock = ScriptedSocket(
        lambda seq: [ack(seq, -errno.ENODEV)], lambda seq: [ack(seq, -errno.EPERM)]
    )
    r = make(sock)
    assert r.link_by_name("nosuch") is None
    with pytest.raises(NetlinkFailure) as info:
        r.link_by_name("lo")
    assert info.value.errno == errno.EPERM
    assert "get link lo (in test netns): errno 1 EPERM" in info.value.details


def test_dump_error_in_done_raises() -> None:
    sock = ScriptedSocket(lambda seq: [done(seq, -errno.EINVAL)])
    with pytest.raises(NetlinkFailure) as info:
        make(sock).links()
    assert info.value.errno == errno.EINVAL


def test_truncated_message_is_ebadmsg_not_a_crash() -> None:
    sock = ScriptedSocket(lambda seq: [link_reply(seq, 1, "lo", 0)[:-4]])
    with pytest.raises(NetlinkFailure) as info:
        make(sock).link_by_name("lo")
    assert info.value.errno == errno.EBADMSG


def nla(kind: int, payload: bytes) -> bytes:
    """One netlink attribute, padded to 4 bytes."""
    raw = struct.pack("=HH", 4 + len(payload), kind) + payload
    return raw + bytes(-len(raw) % 4)


def newlink(index: int, flags: int, *attrs: bytes) -> bytes:
    body = struct.pack("=BxHiII", 0, 1, index, flags, 0) + b"".join(attrs)
    return HDR.pack(HDR.size + len(body), rtnl.RTM_NEWLINK, 0, 1, 0) + body


def inet6_conf(disable_ipv6: int) -> bytes:
    conf = [0] * 40
    conf[rtnl.DEVCONF_DISABLE_IPV6] = disable_ipv6
    return struct.pack(f"={len(conf)}I", *conf)


def test_a_link_is_read_from_its_bytes_with_each_attribute() -> None:
    nested = 0x8000  # NLA_F_NESTED, as the kernel sets it
    data = newlink(
        42,
        rtnl.IFF_UP,
        nla(rtnl.IFLA_IFNAME, b"cali12345\0"),
        nla(rtnl.IFLA_ADDRESS, bytes.fromhex("eeeeeeeeeeee")),
        nla(rtnl.IFLA_MTU, struct.pack("=I", 1450)),
        nla(rtnl.IFLA_LINK, struct.pack("=I", 3)),
        nla(rtnl.IFLA_LINK_NETNSID, struct.pack("=i", 0)),
        nla(rtnl.IFLA_IFALIAS, b"ns/pod\0"),
        nla(rtnl.IFLA_LINKINFO | nested, nla(rtnl.IFLA_INFO_KIND, b"veth\0")),
        nla(
            rtnl.IFLA_AF_SPEC | nested,
            nla(2, nla(1, b"\0" * 8))  # AF_INET's configuration: not the one read
            + nla(10 | nested, nla(1, struct.pack("=I", 0)) + nla(2, inet6_conf(1))),
        ),
    )
    link = rtnl.parse_link(data)
    assert link == rtnl.Link(
        index=42,
        name="cali12345",
        kind="veth",
        mac="ee:ee:ee:ee:ee:ee",
        up=True,
        mtu=1450,
        peer_index=3,
        peer_netnsid=0,
        ipv6_disabled=True,
        alias="ns/pod",
    )


def test_a_link_without_the_optional_attributes_and_a_truncated_one() -> None:
    """What the kernel leaves out stays None (no kind, no peer, no IPv6 state); an attribute
    whose length runs past the message ends the reading, it does not read past it."""
    bare = rtnl.parse_link(newlink(1, 0, nla(rtnl.IFLA_IFNAME, b"lo\0")))
    assert bare == rtnl.Link(1, "lo", None, None, False, 0, None, None, None, "")
    cut = newlink(1, 0, nla(rtnl.IFLA_IFNAME, b"lo\0")) + struct.pack("=HH", 64, rtnl.IFLA_MTU)
    cut = struct.pack("=I", len(cut)) + cut[4:]
    assert rtnl.parse_link(cut).mtu == 0


def test_a_link_reply_is_what_pyroute2_decodes_too() -> None:
    """Beside the Link read from its bytes, a reply answers what is asked of it by name
    (``dataplane.rtnl_routing`` reads a VXLAN's attributes so), decoded by pyroute2."""
    sock = ScriptedSocket(lambda seq: [link_reply(seq, 5, "eth0", 0), ack(seq)])
    r = make(sock)
    (reply,) = r.results(r.send([rtnl.link_request("eth0")]))[0]  # type: ignore[misc]
    assert reply.get("ifname") == "eth0"
    assert reply["index"] == 5
    assert r.link_of([reply]) == rtnl.parse_link(bytes(reply.data))
