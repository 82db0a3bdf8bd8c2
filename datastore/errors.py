"""The datastore's exceptions, and the base every layer above derives its own from.

They know nothing of CNI: the plugins map each class to a CNI error code at their edge
(``ipam/cni_codes.py``), so the stores, the IPAM core and the resources stay free of the
protocol layer.

::

    DatastoreError                 base; never raised itself (``msg``, ``details``)
     +-- InvalidConfig             a setting, key or request that cannot be honoured
     |    +-- AccessDenied         the datastore refused the credentials (401, 403)
     +-- RevisionConflict          a compare-and-swap lost; callers re-read and retry
     +-- StoreError                the datastore itself failed (``path`` names where)
          +-- StoreCorrupt         unreadable, truncated or malformed document, symlink
          +-- StoreUnavailable     cannot write or reach it (read-only fs, disk full,
          |    |                   EACCES, etcd without quorum)
          |    +-- StoreRemoved    its kinds are being deleted (an uninstall)
          +-- LockTimeout          the store lock was not had within the timeout

The IPAM core adds ``IpamError`` (``ipam.core.errors``) below ``DatastoreError``. ``str(e)``
is ``"msg: details"``. Nothing here prints or exits.
"""

from __future__ import annotations


class DatastoreError(Exception):
    """Base of every error the datastore, the IPAM core and the resources raise on purpose."""

    def __init__(self, msg: str, details: str = "") -> None:
        super().__init__(msg)
        self.msg = msg
        self.details = details

    def __str__(self) -> str:
        return f"{self.msg}: {self.details}" if self.details else self.msg


class InvalidConfig(DatastoreError):
    """A pool, block size, reserved range, handle id, store key or setting that cannot be
    honoured."""


class AccessDenied(InvalidConfig):
    """The datastore refused who is asking (the Kubernetes API's 401 or 403: a token
    revoked, a role removed). Retrying does not help; a DEL lets its pod go on it (what it
    held is the controllers' to collect)."""


class RevisionConflict(DatastoreError):
    """A compare-and-swap write found another revision (or a missing/extra document).

    Transient: callers re-read and retry a bounded number of times; if it still escapes, the
    caller may retry the whole operation later (CNI code 11).
    """


class StoreError(DatastoreError):
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


class StoreRemoved(StoreUnavailable):
    """The datastore's kinds are being deleted (the Kubernetes datastore's definitions, as
    ``kubectl delete -f manifests/tabby.yaml`` deletes them): a watcher keeps what it read
    rather than follow the deletions of every object (code 11)."""

    summary = "datastore being removed"


class LockTimeout(StoreError):
    """The store lock was not acquired within ``lock_timeout_seconds`` (code 11)."""

    summary = "IPAM datastore lock timeout"
