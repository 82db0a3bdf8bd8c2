"""Throwaway network namespaces for privileged tests: a "node" acting as the host, and pods.

Everything a test builds lives inside namespaces with unique names (``tby<pid>-<hex>-...``),
so nothing touches the real host's network, and deleting the node namespace removes every
host veth and route the test made. Namespaces are deleted even when a test fails
(:class:`NetnsPool` is used as a context manager by the fixtures in ``conftest.py``).

Code under test runs "on the node" through :meth:`Node.run`: a worker thread that entered
the node namespace calls it, so the test process itself never leaves the real host netns.
This helper deliberately does not use the dataplane's own netns code (independent harness).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import secrets
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
NETNS_RUN_DIR = "/run/netns"
#: Prefix of every namespace these helpers create (also used by the leak sweep).
PREFIX = "tby"

#: Addresses the node owns on ``lo`` (so it has a source address towards pods).
NODE_V4 = "10.99.0.1"
NODE_V6 = "fd99::1"

_libc = ctypes.CDLL(None, use_errno=True)


def _setns(fd: int) -> None:
    if _libc.setns(fd, CLONE_NEWNET) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def run(*cmd: str, check: bool = True, timeout: float = 20) -> subprocess.CompletedProcess[str]:
    """Run a command, capture its output; raise with the output on failure if ``check``."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(cmd)} -> rc {proc.returncode}\nstdout: {proc.stdout}\nstderr: {proc.stderr}"
        )
    return proc


def run_in_thread_netns(path: str, fn: Callable[[], T]) -> T:
    """Call ``fn()`` in a new thread that has entered the network namespace at ``path``."""
    out: list[T] = []
    err: list[BaseException] = []

    def worker() -> None:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd)
            finally:
                os.close(fd)
            out.append(fn())
        except BaseException as exc:
            err.append(exc)
        # The thread ends here, inside the namespace: nothing else runs on it.

    t = threading.Thread(target=worker, name="test-netns")
    t.start()
    t.join()
    if err:
        raise err[0]
    return out[0]


def thread_netns_id() -> str:
    """``net:[inode]`` of the calling thread."""
    return os.readlink("/proc/thread-self/ns/net")


def list_netns() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_RUN_DIR))
    except FileNotFoundError:
        return []


class Netns:
    """A named namespace created with ``ip netns add``."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.path = f"{NETNS_RUN_DIR}/{name}"

    def exec(self, *cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run("ip", "netns", "exec", self.name, *cmd, check=check)

    def ip(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return run("ip", "-n", self.name, *args, check=check)

    def sysctl(self, key: str) -> str:
        """Read ``key`` (``net/ipv4/...`` slash form) as seen inside this namespace."""
        return self.exec("cat", f"/proc/sys/{key}").stdout.strip()

    def links(self) -> list[str]:
        out = self.ip("-o", "link", "show").stdout
        return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines()]

    def link_line(self, name: str) -> str:
        return self.ip("-o", "link", "show", "dev", name).stdout.strip()

    def ping(self, address: str, *, attempts: int = 3) -> float:
        """Ping once (retrying ``attempts`` times); return the seconds until success."""
        start = time.monotonic()
        last = None
        for _ in range(attempts):
            last = self.exec("ping", "-c1", "-W1", "-q", address, check=False)
            if last.returncode == 0:
                return time.monotonic() - start
        assert last is not None
        raise AssertionError(f"{self.name}: ping {address} failed:\n{last.stdout}{last.stderr}")

    def __repr__(self) -> str:
        return f"Netns({self.name!r})"


class Node(Netns):
    """A namespace that plays the host: lo up with a /32 and /128, forwarding on, and a route
    to 169.254.1.1 out of ``lo`` so proxy ARP answers for the pods' gateway (lab notes)."""

    def configure(self) -> None:
        self.ip("link", "set", "lo", "up")
        self.ip("addr", "add", f"{NODE_V4}/32", "dev", "lo")
        self.ip("-6", "addr", "add", f"{NODE_V6}/128", "dev", "lo")
        self.ip("route", "add", "169.254.1.1/32", "dev", "lo")
        self.exec("sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward")
        self.exec("sh", "-c", "echo 1 > /proc/sys/net/ipv6/conf/all/forwarding")

    def run(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``fn(*args, **kwargs)`` from a thread inside this node namespace."""
        return run_in_thread_netns(self.path, lambda: fn(*args, **kwargs))


class NetnsPool:
    """Creates uniquely named namespaces and deletes all of them on ``close()``."""

    def __init__(self) -> None:
        self.tag = f"{PREFIX}{os.getpid()}-{secrets.token_hex(3)}"
        self._made: list[Netns] = []
        self._count = 0

    def _name(self, role: str) -> str:
        self._count += 1
        return f"{self.tag}-{role}{self._count}"

    def _add(self, ns: Netns) -> None:
        run("ip", "netns", "add", ns.name)
        self._made.append(ns)

    def node(self) -> Node:
        node = Node(self._name("node"))
        self._add(node)
        node.configure()
        return node

    def pod(self) -> Netns:
        pod = Netns(self._name("pod"))
        self._add(pod)
        return pod

    def delete(self, ns: Netns) -> None:
        """Delete one namespace now (e.g. to simulate a vanished pod)."""
        run("ip", "netns", "del", ns.name, check=False)

    def close(self) -> None:
        # Pods first, then nodes: deleting a node takes its veths (and their pod ends) along.
        for ns in sorted(self._made, key=lambda n: isinstance(n, Node)):
            if os.path.exists(ns.path):
                run("ip", "netns", "del", ns.name, check=False)
        self._made.clear()

    def __enter__(self) -> NetnsPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


@contextlib.contextmanager
def netns_pool() -> Iterator[NetnsPool]:
    pool = NetnsPool()
    try:
        yield pool
    finally:
        pool.close()


def sweep_leftovers(pid: int) -> list[str]:
    """Delete namespaces that process ``pid`` left behind (only its own: other test runs may
    be going on at the same time); return their names."""
    mine = f"{PREFIX}{pid}-"
    gone = []
    for name in list_netns():
        if name.startswith(mine):
            run("ip", "netns", "del", name, check=False)
            gone.append(name)
    return gone
