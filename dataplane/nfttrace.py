"""One packet traced through nftables: the trace armed, its events read, a table's rules
listed with their handles.

Arming (:class:`Trace`): a table of its own, ``inet tabby-trace-<pid>-<n>``, with two base
chains at priority ``raw - 10`` (``prerouting``: what a node forwards or receives;
``output``: what it sends itself), each with one rule that matches only the probe (its
addresses, protocol, source and destination port, or ICMP echo id) and sets ``meta nftrace
set 1``. The kernel then reports every rule that packet meets in every table of this
namespace to the trace group, which :class:`~dataplane.nfnetlink.TraceListener` reads (it
is joined before the rule exists, so nothing is missed). Leaving the context deletes the
table, on errors too; a table whose creating process is gone (killed while tracing) is
deleted by the next trace in that namespace (:func:`sweep`). The arming rule matches one
source port of one probe: a leftover would trace nothing else.

Reading: :meth:`Trace.collect` gives the probe's events, :func:`table_rules` a table's rules
by ``(chain, handle)``, what the events name. What they say about tabby's policy (which
chain and rule accepted or dropped the packet) is read by :mod:`policy.trace`.

Everything runs in the calling thread's network namespace.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import itertools
import os
import re
import secrets
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Literal

from dataplane.errors import NftError
from dataplane.names import NFT_TABLE
from dataplane.nfnetlink import Packet, TraceEvent, TraceListener
from dataplane.nft import NftBackend, default_backend

TRACE_TABLE_PREFIX = "tabby-trace-"
_COUNTER = itertools.count(1)

ProbeProtocol = Literal["TCP", "UDP", "ICMP"]


@dataclasses.dataclass(frozen=True)
class Probe:
    """The one packet to trace: a TCP SYN or a UDP datagram from ``sport`` to ``dport``, or
    an ICMP echo request with id ``icmp_id`` (the arming rule matches that packet only:
    not the rest of a connection it opens)."""

    family: int
    src: str
    dst: str
    protocol: ProbeProtocol
    sport: int | None = None
    dport: int | None = None
    icmp_id: int | None = None

    def nft_match(self) -> str:
        ip = "ip" if self.family == 4 else "ip6"
        where = f"{ip} saddr {self.src} {ip} daddr {self.dst}"
        if self.protocol == "ICMP":
            icmp = "icmp" if self.family == 4 else "icmpv6"
            return f"{where} {icmp} type echo-request {icmp} id {self.icmp_id}"
        proto = self.protocol.lower()
        first = " tcp flags & (syn | ack) == syn" if proto == "tcp" else ""  # the SYN only
        return f"{where} {proto} sport {self.sport} {proto} dport {self.dport}{first}"

    def matches(self, p: Packet) -> bool:
        if (p.family, p.src, p.dst) != (self.family, self.src, self.dst):
            return False
        if self.protocol == "ICMP":
            echo = 8 if self.family == 4 else 128
            return p.protocol in (1, 58) and (p.icmp_type, p.icmp_id) == (echo, self.icmp_id)
        number = 6 if self.protocol == "TCP" else 17
        return (p.protocol, p.sport, p.dport) == (number, self.sport, self.dport)


class ProbeSocket:
    """The probe's socket, made in the source's network namespace (``make`` runs in a
    thread that entered it; the socket stays there) and bound before anything is sent, so
    that its source port (or ICMP echo id) is known when the trace is armed."""

    def __init__(self, family: int, src: str, dst: str, protocol: ProbeProtocol) -> None:
        self.family, self.src, self.dst, self.protocol = family, src, dst, protocol
        af = socket.AF_INET if family == 4 else socket.AF_INET6
        self.icmp_id: int | None = None
        if protocol == "ICMP":
            proto = socket.IPPROTO_ICMP if family == 4 else socket.IPPROTO_ICMPV6
            self.sock = socket.socket(af, socket.SOCK_RAW, proto)
            self.icmp_id = secrets.randbelow(0xFFFF) + 1
        else:
            kind = socket.SOCK_STREAM if protocol == "TCP" else socket.SOCK_DGRAM
            self.sock = socket.socket(af, kind)
        self.sock.setblocking(False)
        self.sock.bind((src, 0))
        self.sport: int | None = None if protocol == "ICMP" else self.sock.getsockname()[1]

    def probe(self, dport: int | None) -> Probe:
        return Probe(
            self.family, self.src, self.dst, self.protocol, self.sport, dport, self.icmp_id
        )

    def send(self, dport: int | None) -> None:
        if self.protocol == "TCP":
            self.sock.connect_ex((self.dst, dport or 0))
        elif self.protocol == "UDP":
            self.sock.connect((self.dst, dport or 0))  # connected: ICMP errors come back
            try:
                self.sock.send(b"tabby policy trace\n")
            except OSError:
                pass  # the answer says what happened
        else:
            assert self.icmp_id is not None
            self.sock.sendto(_echo(self.family, self.icmp_id), (self.dst, 0))

    def answer(self, timeout: float) -> str:
        """``connected`` (TCP), ``answered`` (UDP reply, ICMP echo reply), ``refused`` (a
        TCP reset or ICMP port unreachable: it got there, nothing listens), or ``no
        answer`` within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            want_write = self.protocol == "TCP"
            ready = select.select(
                [] if want_write else [self.sock], [self.sock] if want_write else [], [], left
            )
            if not (ready[0] or ready[1]):
                break
            if self.protocol == "TCP":
                err = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                if err == 0:
                    return "connected"
                return "refused" if err == errno.ECONNREFUSED else os.strerror(err)
            try:
                data, peer = self.sock.recvfrom(2048)
            except ConnectionRefusedError:
                return "refused"
            except OSError as e:
                return e.strerror or str(e)
            if peer[0] != self.dst:
                continue
            if self.protocol == "UDP" or _is_echo_reply(self.family, data, self.icmp_id):
                return "answered"
        return "no answer"

    def close(self) -> None:
        self.sock.close()


def _echo(family: int, ident: int) -> bytes:
    """An ICMP (v4: with its checksum) or ICMPv6 (the kernel sums it) echo request."""
    kind = 8 if family == 4 else 128
    payload = b"tabby policy trace"
    head = struct.pack("!BBHHH", kind, 0, 0, ident, 1)
    if family == 6:
        return head + payload
    data = head + payload
    data += b"\0" * (len(data) % 2)
    total = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return struct.pack("!BBHHH", kind, 0, ~total & 0xFFFF, ident, 1) + payload


def _is_echo_reply(family: int, data: bytes, ident: int | None) -> bool:
    if family == 4:  # a raw IPv4 socket hands over the IP header too
        data = data[(data[0] & 0xF) * 4 :] if data else data
        reply = 0
    else:
        reply = 129
    return len(data) >= 8 and data[0] == reply and struct.unpack_from("!H", data, 4)[0] == ident


def sweep(backend: NftBackend) -> list[str]:
    """Delete the trace tables of processes that are gone; their names."""
    try:
        listing = backend.run("list tables inet")
    except NftError:
        return []
    gone = []
    for name in re.findall(rf"table inet ({re.escape(TRACE_TABLE_PREFIX)}\d+-\d+)", listing):
        pid = int(name[len(TRACE_TABLE_PREFIX) :].split("-")[0])
        if pid != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            try:
                backend.run(f"delete table inet {name}")
                gone.append(name)
            except NftError:
                continue
    return gone


@contextlib.contextmanager
def _uninterrupted() -> Iterator[None]:
    """Hold SIGINT, SIGTERM and SIGHUP while a trace table is made or deleted (in the main
    thread, where Python runs its handlers), and deliver them afterwards: an interrupt
    never falls between making a table and knowing to delete it."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    old = {
        sig: signal.signal(sig, lambda signum, _frame: held.append(signum))
        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    }
    try:
        yield
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        for num in dict.fromkeys(held):
            signal.raise_signal(num)  # as if it came now: its own handler runs


class Trace:
    """``with Trace(probe) as trace: <send the probe>; events = trace.collect(...)``.
    The table is deleted on the way out, whatever ends the block (an interrupt too)."""

    def __init__(self, probe: Probe, backend: NftBackend | None = None) -> None:
        self.probe = probe
        self.backend = backend if backend is not None else default_backend()
        self.table = f"{TRACE_TABLE_PREFIX}{os.getpid()}-{next(_COUNTER)}"
        self.listener: TraceListener | None = None
        self.events: list[TraceEvent] = []
        self._ids: set[int] = set()
        #: tabby's rules when the trace was armed (see :meth:`rules`)
        self.rules_before: dict[tuple[str, int], Rule] = {}

    def __enter__(self) -> Trace:
        try:
            with _uninterrupted():
                self._arm()
        except BaseException:
            self.close()
            raise
        return self

    def _arm(self) -> None:
        sweep(self.backend)
        self.listener = TraceListener()
        t = f"inet {self.table}"
        match = self.probe.nft_match()
        self.backend.run(
            "\n".join(
                [
                    f"add table {t}",
                    f"add chain {t} pre {{ type filter hook prerouting priority raw - 10;"
                    " policy accept; }",
                    f"add chain {t} out {{ type filter hook output priority raw - 10;"
                    " policy accept; }",
                    f"add rule {t} pre {match} meta nftrace set 1",
                    f"add rule {t} out {match} meta nftrace set 1",
                ]
            )
            + "\n"
        )
        self.rules_before = table_rules()

    def rules(self) -> list[dict[tuple[str, int], Rule]]:
        """The rules of tabby's table now and when the trace was armed: tabby-node may
        have replaced its table (a resync) in between, which renumbers every rule.
        :func:`policy.trace.decisions` takes, per event, the listing whose rule fits what
        the event says it did."""
        return [table_rules(), self.rules_before]

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        with _uninterrupted():
            try:
                self.backend.run(f"delete table inet {self.table}\n")
            except NftError:
                pass  # never made, or gone already
            finally:
                if self.listener is not None:
                    self.listener.close()
                    self.listener = None

    def collect(
        self, timeout: float, done: Callable[[list[TraceEvent]], bool] | None = None
    ) -> list[TraceEvent]:
        """The probe's events that arrive within ``timeout`` seconds (added to those read
        before); returns early once ``done(events)`` says so."""
        assert self.listener is not None, "collect inside the with block"
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            for e in self.listener.read(min(left, 0.1)):
                if e.packet is not None and self.probe.matches(e.packet):
                    self._ids.add(e.id)
                if e.id in self._ids:
                    self.events.append(e)
            if done is not None and done(self.events):
                break
        return list(self.events)


# -- what the events say --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Rule:
    chain: str
    handle: int
    text: str

    @property
    def comment(self) -> str:
        m = re.search(r'comment "((?:[^"\\]|\\.)*)"\s*$', self.text)
        return m[1] if m else ""


def parse_rules(listing: str) -> dict[tuple[str, int], Rule]:
    """``nft -a list table ...`` text -> (chain, handle) -> rule."""
    out: dict[tuple[str, int], Rule] = {}
    chain = ""
    for line in listing.splitlines():
        text = line.strip()
        head = re.match(r"chain (\S+) \{", text)
        if head:
            chain = head[1]
            continue
        m = re.match(r"(.*\S)\s+# handle (\d+)$", text)
        if m and chain and not text.startswith(("chain ", "table ", "set ", "map ")):
            out[(chain, int(m[2]))] = Rule(chain, int(m[2]), m[1])
    return out


def table_rules(table: str = NFT_TABLE, nft: str = "nft") -> dict[tuple[str, int], Rule]:
    """The rules of ``inet <table>`` with their handles, now (``nft -a``; the library's
    output carries no handles). Empty when there is no such table."""
    proc = subprocess.run(
        [nft, "-a", "list", "table", "inet", table], capture_output=True, text=True, check=False
    )
    return parse_rules(proc.stdout) if proc.returncode == 0 else {}


__all__ = [
    "TRACE_TABLE_PREFIX",
    "Probe",
    "ProbeSocket",
    "Rule",
    "Trace",
    "parse_rules",
    "sweep",
    "table_rules",
]
