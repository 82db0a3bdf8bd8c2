"""Network namespaces by file descriptor, and running code inside one from a worker thread.

Rules this module enforces (GEN-15 and GEN-16 of cni_protocol/CONFORMANCE.md):

* ``CNI_NETNS`` is opened with ``os.open(O_RDONLY | O_CLOEXEC)`` and never created: a missing
  path raises :class:`~dataplane.errors.NetNSNotFound` (the plugin's DEL treats that as
  "already gone"); a path that is not a network namespace raises
  :class:`~dataplane.errors.InvalidNetNS` (the plugin answers code 8).
* The namespace of the *calling thread* is "the host". A ``CNI_NETNS`` that is that same
  namespace is refused (``InvalidNetNS`` with ``own``), so a wrong path cannot make us
  reconfigure the host.
* ``setns(2)`` changes only the calling thread, so namespace work runs in a short-lived worker
  thread (:func:`run_in_netns`); the caller's namespace never changes.

Kernel facts (measured on Linux 6.x, see tests/privileged/test_dataplane.py):

* ``/proc/sys/net/...`` resolves against the network namespace of the *thread that opens the
  file*; a thread that setns'd sees and writes the pod's sysctls.
* ``/proc/net`` (= ``/proc/self/net``) follows the thread-group leader; use
  ``/proc/thread-self/net`` for the calling thread's view.
* A netlink socket stays bound to the namespace it was created in, whichever thread uses it.
"""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable
from typing import TypeVar

from dataplane.errors import InvalidNetNS, NetNSNotFound

T = TypeVar("T")

CLONE_NEWNET = 0x40000000
#: ioctl(2) on an nsfs file descriptor: returns the CLONE_NEW* type of the namespace.
NS_GET_NSTYPE = 0xB703
#: The calling thread's own network namespace (differs from /proc/self/... after setns).
THREAD_NETNS = "/proc/thread-self/ns/net"


def _libc_setns() -> Callable[[int, int], None]:
    """libc's setns(2) through ctypes (Python 3.11 has no ``os.setns``)."""
    import ctypes  # ~1.5 ms; pyroute2 loads it anyway

    raw = ctypes.CDLL(None, use_errno=True).setns
    raw.argtypes = (ctypes.c_int, ctypes.c_int)
    raw.restype = ctypes.c_int

    def setns(fd: int, nstype: int) -> None:
        if raw(fd, nstype) != 0:
            err = ctypes.get_errno()
            raise OSError(err, os.strerror(err))

    return setns


# Resolved at import, not on first use, so that setns() is also safe in a forked child
# (e.g. a subprocess preexec_fn), where importing modules is not.
_setns: Callable[[int, int], None] = getattr(os, "setns", None) or _libc_setns()


def setns(fd: int) -> None:
    """Move the *calling thread* into the network namespace ``fd``."""
    _setns(fd, CLONE_NEWNET)


CLONE_FS = 0x00000200
CLONE_NEWNS = 0x00020000


def enter_mount_namespace(fd: int) -> None:
    """Move the *calling thread* (and the threads it starts) into the mount namespace ``fd``.

    A thread shares its filesystem attributes with the whole process, and setns(2) refuses
    a mount namespace while they are shared, so the thread first unshares them
    (unshare(CLONE_FS)). Meant for a thread that ends after its job (tabby-node's per-call
    threads): there is no way back short of another setns.
    """
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_FS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_FS): {os.strerror(err)}")
    _setns(fd, CLONE_NEWNS)


class NetNS:
    """An open network namespace file descriptor. Use as a context manager or ``close()``."""

    def __init__(self, path: str, fd: int) -> None:
        self.path = path
        self.fd = fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def __enter__(self) -> NetNS:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"NetNS({self.path!r}, fd={self.fd})"


def _same_file(a: os.stat_result, b: os.stat_result) -> bool:
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def open_netns(path: str) -> NetNS:
    """Open ``path`` as a network namespace without ever creating anything.

    Raises :class:`NetNSNotFound` if the path does not exist, :class:`InvalidNetNS` if it is
    not a network namespace or if it is the calling thread's own namespace (GEN-16).
    """
    if not path:
        raise NetNSNotFound(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise NetNSNotFound(path) from None
    except OSError as exc:
        raise InvalidNetNS(path, f"open {path}: {exc.strerror} (errno {exc.errno})") from None
    try:
        _check_netns_fd(path, fd)
    except BaseException:
        os.close(fd)
        raise
    return NetNS(path, fd)


def _check_netns_fd(path: str, fd: int) -> None:
    import fcntl

    try:
        nstype = fcntl.ioctl(fd, NS_GET_NSTYPE)
    except OSError as exc:
        # ENOTTY/EINVAL: a plain file or directory (e.g. an unmounted /run/netns entry).
        raise InvalidNetNS(
            path, f"{path} is not a namespace ({os.strerror(exc.errno or errno.ENOTTY)})"
        ) from None
    if nstype != CLONE_NEWNET:
        raise InvalidNetNS(path, f"{path} is a namespace, but not a network namespace")
    if _same_file(os.fstat(fd), os.stat(THREAD_NETNS)):
        raise InvalidNetNS(
            path,
            f"{path} is the plugin's own network namespace; refusing to configure the host",
            own=True,
        )


def run_in_netns(fd: int, fn: Callable[[], T]) -> T:
    """Run ``fn()`` in a new thread that has entered the network namespace ``fd``.

    Returns what ``fn`` returns and re-raises what it raises. The calling thread's namespace
    is never touched. The worker thread switches back before it ends (not strictly needed,
    since the thread dies, but it keeps any thread-exit code in the original namespace).
    """
    result: list[T] = []
    failure: list[BaseException] = []

    def worker() -> None:
        try:
            home = os.open(THREAD_NETNS, os.O_RDONLY | os.O_CLOEXEC)
            try:
                setns(fd)
                try:
                    result.append(fn())
                finally:
                    try:
                        setns(home)
                    except OSError:
                        pass  # harmless: this thread ends now and runs no network code
            finally:
                os.close(home)
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=worker, name="tabby-netns", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


def call_in_netns(fd: int, fn: Callable[[], T]) -> T:
    """Run ``fn()`` in the *calling thread*, switched into the network namespace ``fd``
    and back before this returns (or raises): for short work that must not wait for a
    thread to start and end (:func:`run_in_netns`), such as creating a netlink socket
    there or writing its ``/proc/sys/net``. ``fn`` must not block on other threads.

    Switching back is to the thread's own namespace, held open meanwhile; should even
    that fail, the thread is left in the other namespace and :class:`NamespaceStuck` is
    raised: a BaseException, which no handler of ordinary errors catches."""
    home = os.open(THREAD_NETNS, os.O_RDONLY | os.O_CLOEXEC)
    try:
        setns(fd)
        try:
            return fn()
        finally:
            try:
                setns(home)
            except OSError as exc:
                raise NamespaceStuck(f"cannot return to the thread's namespace: {exc}") from None
    finally:
        os.close(home)


class NamespaceStuck(BaseException):
    """The calling thread could not return to its own network namespace
    (:func:`call_in_netns`): nothing more may run in it."""


def own_netns_fd() -> int:
    """A new fd for the calling thread's own network namespace (caller closes it)."""
    return os.open(THREAD_NETNS, os.O_RDONLY | os.O_CLOEXEC)
