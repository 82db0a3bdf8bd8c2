"""Read and write ``/proc/sys/net`` entries of the *calling thread's* network namespace.

``/proc/sys/net`` is resolved against the namespace of the thread that opens the file (see
:mod:`dataplane.netns`), so the host side is written from the calling thread and
the pod side from a thread that entered the pod (``run_in_netns``).
"""

from __future__ import annotations

import os

from dataplane.errors import SysctlFailure

ROOT = "/proc/sys/net"


def path(key: str) -> str:
    """``"ipv4/conf/eth0/forwarding"`` -> ``"/proc/sys/net/ipv4/conf/eth0/forwarding"``.

    Keys use ``/`` as separator, so interface names that contain dots need no escaping.
    """
    return f"{ROOT}/{key}"


def _fail(op: str, key: str, exc: OSError) -> SysctlFailure:
    return SysctlFailure(op, key, path(key), exc)


def write(key: str, value: str, *, missing_ok: bool = False) -> bool:
    """Write ``value`` to ``net/<key>``. Returns False if the entry does not exist and
    ``missing_ok`` (e.g. IPv6 disabled); raises :class:`~dataplane.errors.SysctlFailure`
    otherwise."""
    try:
        fd = os.open(path(key), os.O_WRONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        if missing_ok:
            return False
        raise _fail("write", key, exc) from None
    except OSError as exc:
        raise _fail("write", key, exc) from None
    try:
        os.write(fd, value.encode())
    except OSError as exc:
        raise _fail("write", key, exc) from None
    finally:
        os.close(fd)
    return True


def read(key: str) -> str | None:
    """The stripped value of ``net/<key>``, or None if the entry does not exist."""
    try:
        with open(path(key), encoding="ascii") as f:
            return f.read().strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise _fail("read", key, exc) from None
