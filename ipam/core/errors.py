"""The IPAM core's exceptions. They know nothing of CNI: the plugins' adapters map each
class to a CNI error code at their edge (``ipam/plugin.py: CODES``), so the core and the
stores stay free of the protocol layer.

::

    IpamError                      base; never raised itself
     +-- InvalidConfig             bad pool, block size, handle id, request
     +-- NoAddressAvailable        pools exhausted, or strict affinity and no block
     +-- AddressUnavailable        requested address in use, reserved, outside every pool
     +-- RevisionConflict          compare-and-swap lost; retried (bounded) by the core
     +-- StoreError                the datastore itself failed
          +-- StoreCorrupt(path)   unreadable, truncated or malformed document, symlink
          +-- StoreUnavailable     cannot write or reach it (read-only fs, disk full,
          |                        EACCES, etcd without quorum)
          +-- LockTimeout          the store lock was not had within the timeout

``str(e)`` is ``"msg: details"``. The core never prints and never exits; it only raises these.
"""

from __future__ import annotations


class IpamError(Exception):
    """Base of every error the IPAM core raises on purpose."""

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details

    def __str__(self) -> str:
        return f"{self.msg}: {self.details}" if self.details else self.msg


class InvalidConfig(IpamError):
    """A pool, block size, reserved range, handle id or request that cannot be honoured."""


class NoAddressAvailable(IpamError):
    """No free address in the usable pools for this node (code 100)."""


class AddressUnavailable(IpamError):
    """A requested address is in use, reserved, or outside every (enabled) pool (code 102)."""


class RevisionConflict(IpamError):
    """A compare-and-swap write found another revision (or a missing/extra document).

    Transient: the core re-reads and retries a bounded number of times; if it still escapes,
    the caller may retry the whole operation later (code 11).
    """


class StoreError(IpamError):
    """The datastore failed; ``path`` names the file (or location) concerned."""

    def __init__(self, path: str, reason: str = "") -> None:
        super().__init__(self.summary, f"{path}: {reason}" if reason else path)
        self.path = path
        self.reason = reason

    summary = "IPAM datastore failure"


class StoreCorrupt(StoreError):
    """A document cannot be read or parsed, or a path is a symlink (code 101)."""

    summary = "IPAM datastore unreadable or corrupt"


class StoreUnavailable(StoreError):
    """Writing to the datastore failed (read-only, full, permission denied): code 11."""

    summary = "IPAM datastore not writable"


class LockTimeout(StoreError):
    """The store lock was not acquired within ``lock_timeout_seconds`` (code 11)."""

    summary = "IPAM datastore lock timeout"
