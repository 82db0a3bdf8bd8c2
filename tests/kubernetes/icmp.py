"""An ICMP echo prober that runs inside a namespace (a thread that entered it): every reply
is recorded with its time. The kernel answers pings as soon as a pod's interface has its
address, before any container runs: the earliest moment a pod can be reached at all, so
the sharpest test that a policy is in force from the start."""

from __future__ import annotations

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
