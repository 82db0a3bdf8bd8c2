"""An ICMP echo prober that runs inside a namespace (a thread that entered it): every reply
is recorded with its time. The kernel answers pings as soon as a pod's interface has its
address, before any container runs: the earliest moment a pod can be reached at all, so
the sharpest test that a policy is in force from the start."""

from __future__ import annotations

import itertools
import os
import socket
import struct
import threading
import time

from tests.policy_probes import icmp_echo, in_netns


class Pinger:
    """Pings ``address`` every ``interval`` seconds from namespace ``netns`` until stopped."""

    def __init__(self, netns: str, address: str, interval: float = 0.01) -> None:
        self.netns = netns
        self.address = address
        self.interval = interval
        self.sent = 0
        self.replies: list[float] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    def _loop(self) -> None:
        ident = os.getpid() & 0xFFFF
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
            s.settimeout(self.interval)
            seq = 0
            while not self._stop.is_set():
                seq = (seq + 1) & 0xFFFF
                s.sendto(icmp_echo(ident, seq, b"tabby-no-window"), (self.address, 0))
                self.sent += 1
                deadline = time.monotonic() + self.interval
                while (left := deadline - time.monotonic()) > 0:
                    s.settimeout(left)
                    try:
                        data, (src, _) = s.recvfrom(2048)
                    except TimeoutError:
                        break
                    ihl = (data[0] & 0x0F) * 4
                    kind, _, _, rid, _ = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                    if kind == 0 and rid == ident and src == self.address:
                        self.replies.append(time.monotonic())

    def start(self) -> Pinger:
        def run() -> None:
            try:
                in_netns(self.netns, self._loop)
            except BaseException as e:
                self.error = e

        self._thread = threading.Thread(target=run, daemon=True, name=f"ping {self.address}")
        self._thread.start()
        return self

    def stop(self) -> Pinger:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(10)
        if self.error is not None:
            raise self.error
        return self


class Stream:
    """A steady ICMP echo stream from namespace ``netns`` to ``address``: one request every
    ``1 / rate`` seconds (on a fixed schedule), each with its own sequence number, every
    reply recorded; :meth:`stop` stops sending and waits ``drain`` seconds for the last
    replies. ``lost`` are the requests never answered."""

    _idents = iter(range(0x7000, 0x8000))

    def __init__(self, netns: str, address: str, rate: float = 50.0, label: str = "") -> None:
        self.netns = netns
        self.address = address
        self.interval = 1.0 / rate
        self.label = label or address
        self.ident = next(Stream._idents)
        self.sent: dict[int, float] = {}
        self.answered: dict[int, float] = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._drain = 0.0
        self._thread: threading.Thread | None = None

    def _loop(self) -> None:
        with socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP) as s:
            seq, start = 0, time.monotonic()
            stop_at: float | None = None
            while True:
                now = time.monotonic()
                if stop_at is None and self._stop.is_set():
                    stop_at = now + self._drain
                if stop_at is not None and (now >= stop_at or len(self.answered) == len(self.sent)):
                    return
                due = start + seq * self.interval
                if stop_at is None and now >= due:
                    s.sendto(icmp_echo(self.ident, seq, b"tabby-upgrade"), (self.address, 0))
                    self.sent[seq] = now
                    seq += 1
                    continue
                wait = (stop_at if stop_at is not None else due) - now
                s.settimeout(max(0.001, min(wait, 0.05)))
                try:
                    data, (src, _) = s.recvfrom(2048)
                except TimeoutError:
                    continue
                ihl = (data[0] & 0x0F) * 4
                kind, _, _, rid, rseq = struct.unpack("!BBHHH", data[ihl : ihl + 8])
                if kind == 0 and rid == self.ident and src == self.address:
                    self.answered.setdefault(rseq, time.monotonic())

    def start(self) -> Stream:
        def run() -> None:
            try:
                in_netns(self.netns, self._loop)
            except BaseException as e:
                self.error = e

        self._thread = threading.Thread(target=run, daemon=True, name=f"stream {self.label}")
        self._thread.start()
        return self

    def stop(self, drain: float = 2.0) -> Stream:
        self._drain = drain
        self._stop.set()
        if self._thread is not None:
            self._thread.join(drain + 10)
        if self.error is not None:
            raise self.error
        return self

    @property
    def lost(self) -> list[int]:
        return sorted(set(self.sent) - set(self.answered))

    def longest_silence(self) -> float:
        """The longest time between two answers (the stream's worst moment)."""
        times = sorted(self.answered.values())
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def summary(self) -> str:
        return (
            f"{self.label}: {len(self.sent)} sent, {len(self.lost)} lost, longest silence "
            f"{self.longest_silence() * 1000:.0f} ms"
        )
