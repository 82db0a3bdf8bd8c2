"""NetworkPolicy probes shared by the kernel tier (tests/privileged/test_policy_nft.py), the
cluster tier (tests/cluster/policy_lab.py) and bench/policy/policy_cluster_bench.py.

* Servers: a small Python process per pod (started inside the pod's namespace, stopped by
  PID, SIGKILLed by the kernel if the test process dies) answering TCP and UDP.
* Probes: from a thread that entered a pod's namespace, many non-blocking TCP connects and
  UDP datagrams at once with a short timeout. Every UDP probe leaves from a source port of
  its own (a counter over a large range): a datagram that reused the 5-tuple of an earlier
  allowed probe would match that probe's conntrack entry and pass as "established" after
  the policy changed to deny it.
"""

from __future__ import annotations

import contextlib
import ctypes
import itertools
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

from dataplane.netns import open_netns, run_in_netns

T = TypeVar("T")
Job = tuple[str, str, int]  # destination address, protocol, port

SERVER = r"""
import selectors, socket, sys
ports = [int(p) for p in sys.argv[1:]] or [80, 81]
sel = selectors.DefaultSelector()
for port in ports:
    for kind in (socket.SOCK_STREAM, socket.SOCK_DGRAM):
        s = socket.socket(socket.AF_INET6, kind)
        s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("::", port))
        if kind == socket.SOCK_STREAM:
            s.listen(1024)
        s.setblocking(False)
        sel.register(s, selectors.EVENT_READ, kind)
print("ready", flush=True)
while True:
    for key, _ in sel.select():
        s = key.fileobj
        try:
            if key.data == socket.SOCK_STREAM:
                c, _ = s.accept()
                try:
                    c.send(b"ok")
                finally:
                    c.close()
            else:
                data, addr = s.recvfrom(2048)
                s.sendto(b"ok", addr)
        except OSError:
            pass
"""


def die_with_parent() -> None:
    """In a child before exec: SIGKILL when the test process dies, even if it aborts."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def netns_path(netns: str) -> str:
    """A namespace by name (``/run/netns/<name>``) or by path (a pod's in a Kubernetes lab
    node: ``/proc/<holder>/root/run/netns/cni-...``)."""
    return netns if netns.startswith("/") else f"/run/netns/{netns}"


def start_server(netns: str, ports: Iterable[int] = (80, 81)) -> subprocess.Popen[str]:
    """The TCP+UDP server inside namespace ``netns``, listening when this returns."""
    proc = subprocess.Popen(
        [
            "nsenter",
            f"--net={netns_path(netns)}",
            "--",
            sys.executable,
            "-c",
            SERVER,
            *list(map(str, ports)),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        preexec_fn=die_with_parent,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    if line.strip() != "ready":
        stop_process(proc)
        raise RuntimeError(f"the server in {netns} did not start: {line!r}")
    return proc


def stop_process(proc: subprocess.Popen[Any]) -> None:
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    for f in (proc.stdout, proc.stderr, proc.stdin):
        if f is not None:
            f.close()


def in_netns(netns: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread that entered namespace ``netns``."""
    with open_netns(netns_path(netns)) as handle:
        return run_in_netns(handle.fd, fn)


_UDP_PORTS = itertools.count()
_UDP_BASE, _UDP_SPAN = 20000, 12000  # below the kernel's ephemeral range (32768-60999)
_UDP_LOCK = threading.Lock()


def _udp_source_port() -> int:
    with _UDP_LOCK:
        return _UDP_BASE + next(_UDP_PORTS) % _UDP_SPAN


def probe_many(jobs: Iterable[Job], timeout: float) -> dict[Job, bool]:
    """Every job at once from the calling thread's namespace; True when it was answered
    (TCP: the connection was accepted; UDP: the server's reply came back)."""
    sel = selectors.DefaultSelector()
    results: dict[Job, bool] = {}
    jobs = list(jobs)
    try:
        for job in jobs:
            dst, proto, port = job
            family = socket.AF_INET6 if ":" in dst else socket.AF_INET
            if proto == "TCP":
                s = socket.socket(family, socket.SOCK_STREAM)
                s.setblocking(False)
                s.connect_ex((dst, port))
                sel.register(s, selectors.EVENT_WRITE, job)
            else:
                s = socket.socket(family, socket.SOCK_DGRAM)
                s.setblocking(False)
                for _ in range(10):
                    try:
                        s.bind(
                            ("::" if family == socket.AF_INET6 else "0.0.0.0", _udp_source_port())
                        )
                        break
                    except OSError:
                        continue
                s.connect((dst, port))
                with contextlib.suppress(OSError):
                    s.send(b"probe")
                sel.register(s, selectors.EVENT_READ, job)
        deadline = time.monotonic() + timeout
        while len(results) < len(jobs):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            for key, _ in sel.select(left):
                sock, job = key.fileobj, key.data
                assert isinstance(sock, socket.socket)
                if job[1] == "TCP":
                    ok = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                else:
                    try:
                        ok = sock.recv(64) == b"ok"
                    except OSError:
                        ok = False
                results[job] = ok
                sel.unregister(sock)
                sock.close()
    finally:
        for key in list(sel.get_map().values()):
            results.setdefault(key.data, False)
            key.fileobj.close()  # type: ignore[union-attr]
        sel.close()
    return results


# -- ICMP echo (the kernel answers it: no server needed) ----------------------------------------


def icmp_echo(ident: int, seq: int, payload: bytes) -> bytes:
    """An ICMP echo request (type 8) with its checksum, for a raw socket."""
    head = struct.pack("!BBHHH", 8, 0, 0, ident, seq & 0xFFFF)
    data = head + payload
    if len(data) % 2:
        data += b"\0"
    total: int = sum(struct.unpack(f"!{len(data) // 2}H", data))
    total = (total >> 16) + (total & 0xFFFF)
    total += total >> 16
    return struct.pack("!BBHHH", 8, 0, ~total & 0xFFFF, ident, seq & 0xFFFF) + payload
