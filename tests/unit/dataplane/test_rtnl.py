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
