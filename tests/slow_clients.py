"""Clients that take a server's resources without finishing (the limits tests of
``daemon.limits``' users: the node socket, the HTTP endpoints), and waiting for what a
server does about them."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from types import TracebackType


class SlowClient:
    """``conn`` (connected at ``since``, monotonic) sending ``data`` one byte every
    ``every`` seconds from a thread of its own (nothing at all when ``data`` is empty),
    until all is sent, the server closes on it, or the ``with`` block ends (then closed)."""

    def __init__(
        self, conn: socket.socket, since: float, data: bytes = b"", every: float = 0.02
    ) -> None:
        self.conn = conn
        self.since = since
        self.stop = threading.Event()
        if data:
            threading.Thread(target=self._send, args=(data, every), daemon=True).start()

    def _send(self, data: bytes, every: float) -> None:
        for i in range(len(data)):
            if self.stop.wait(every):
                return
            try:
                self.conn.send(data[i : i + 1])
            except OSError:
                return

    def closed_after(self, within: float = 5.0) -> float:
        """Seconds from its connection until the server closed it (what the server sent
        before is read and dropped); socket.timeout after ``within``."""
        seconds_until_closed(self.conn, within)
        return time.monotonic() - self.since

    def __enter__(self) -> SlowClient:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop.set()
        self.conn.close()


def seconds_until_closed(conn: socket.socket, within: float) -> float:
    """Seconds until the peer closes ``conn`` (EOF or a reset), reading and dropping what it
    sends meanwhile."""
    t0 = time.monotonic()
    conn.settimeout(within)
    try:
        while conn.recv(65536):
            pass
    except ConnectionResetError:
        pass
    return time.monotonic() - t0


def wait_for(what: Callable[[], bool], within: float = 5.0) -> None:
    """Until ``what()`` holds; AssertionError after ``within`` seconds."""
    deadline = time.monotonic() + within
    while not what():
        if time.monotonic() > deadline:
            raise AssertionError("not in time")
        time.sleep(0.005)
