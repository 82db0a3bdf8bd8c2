"""The IPAM core's exceptions, beside the datastore's (re-exported here: the core raises both).

::

    DatastoreError                 (datastore.errors) base; never raised itself
     +-- InvalidConfig             bad pool, block size, handle id, request
     +-- RevisionConflict          compare-and-swap lost; retried (bounded) by the core
     +-- StoreError                the datastore itself failed (StoreCorrupt,
     |                             StoreUnavailable, LockTimeout)
     +-- IpamError                 an allocation that cannot be made
          +-- NoAddressAvailable   pools exhausted, or strict affinity and no block
          +-- AddressUnavailable   requested address in use, reserved, outside every pool

They know nothing of CNI: the plugins' adapters map each class to a CNI error code at their
edge (``ipam/cni_codes.py``). The core never prints and never exits; it only raises these.
"""

from __future__ import annotations

from datastore.errors import (
    DatastoreError,
    InvalidConfig,
    LockTimeout,
    RevisionConflict,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
)

__all__ = [
    "AddressUnavailable",
    "DatastoreError",
    "InvalidConfig",
    "IpamError",
    "LockTimeout",
    "NoAddressAvailable",
    "RevisionConflict",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
]


class IpamError(DatastoreError):
    """An address that cannot be allocated as asked."""


class NoAddressAvailable(IpamError):
    """No free address in the usable pools for this node (code 100)."""


class AddressUnavailable(IpamError):
    """A requested address is in use, reserved, or outside every (enabled) pool (code 102)."""
