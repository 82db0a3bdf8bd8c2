"""The dataplane's errors: what failed in the kernel, in the kernel's terms.

The dataplane knows no CNI: its callers choose what an error means to them. The ``tabby``
plugin maps these to CNI codes at its edge (``cni_plugin.cni_codes``); tabby-node and
tabbyctl report them as they are. Every error has a short ``msg`` and the longer
``details``, and reads ``"<msg>: <details>"``. Standard library only: cheap to import.
"""

from __future__ import annotations

import errno as errno_mod
import os


class DataplaneError(Exception):
    """A failure of the kernel side (the base of every error here)."""

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details

    def __str__(self) -> str:
        return f"{self.msg}: {self.details}" if self.details else self.msg

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.msg!r}, {self.details!r})"


class NetNSNotFound(DataplaneError):
    """The network namespace does not exist (the container is gone)."""

    def __init__(self, path: str) -> None:
        super().__init__(f"network namespace {path} not found", path)
        self.path = path


class InvalidNetNS(DataplaneError):
    """The network namespace exists but is not usable: not a network namespace, or the
    caller's own."""

    def __init__(self, path: str, why: str, *, own: bool = False) -> None:
        super().__init__(f"invalid network namespace {path}", why)
        self.path = path
        #: True when the path is the caller's own namespace (GEN-16 of
        #: cni_protocol/CONFORMANCE.md), not merely unusable.
        self.own = own


class InvalidVethPrefix(DataplaneError):
    """A prefix that cannot start host veth names."""

    def __init__(self, prefix: str, problem: str) -> None:
        super().__init__(f"unsupported value for field 'veth_prefix': {prefix!r}", problem)
        self.prefix = prefix


class NetlinkFailure(DataplaneError):
    """A netlink request failed. ``errno`` is the kernel's error number."""

    def __init__(self, op: str, where: str, err: int, kernel_msg: str = "") -> None:
        name = errno_mod.errorcode.get(err, str(err))
        said = f": the kernel says {kernel_msg!r}" if kernel_msg else ""
        super().__init__(
            f"netlink: {op} failed",
            f"{op} (in {where} netns): errno {err} {name} ({os.strerror(err)}){said}",
        )
        self.op = op
        self.where = where
        self.errno = err


class SysctlFailure(DataplaneError):
    """A ``/proc/sys/net`` entry could not be read or written."""

    def __init__(self, op: str, key: str, path: str, exc: OSError) -> None:
        super().__init__(
            f"sysctl {op} failed: net/{key}", f"{op} {path}: errno {exc.errno} ({exc.strerror})"
        )
        self.key = key


class InterfaceConflict(DataplaneError):
    """An interface of the name tabby wants exists and is not tabby's to replace or
    delete; it is left untouched."""


class CheckMismatch(DataplaneError):
    """The kernel differs from what ``setup`` built (CHECK)."""

    def __init__(self, what: str, details: str) -> None:
        super().__init__(f"check failed: {what}", details)


class NftError(DataplaneError):
    """nft refused a transaction (nothing of it was applied)."""


__all__ = [
    "CheckMismatch",
    "DataplaneError",
    "InterfaceConflict",
    "InvalidNetNS",
    "InvalidVethPrefix",
    "NetNSNotFound",
    "NetlinkFailure",
    "NftError",
    "SysctlFailure",
]
