"""The IPAM core's errors as CNI errors: the one table both plugins' adapters use at their
edge (the core and the stores know nothing of CNI codes; PRODUCT codes in docs/configuration.md).
Standard library and the protocol layer only: cheap for the CNI binaries to import."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from cni_protocol.errors import CniError, Code
from ipam.core.errors import (
    AddressUnavailable,
    DatastoreError,
    InvalidConfig,
    IpamError,
    LockTimeout,
    NoAddressAvailable,
    RevisionConflict,
    StoreCorrupt,
    StoreError,
    StoreUnavailable,
)

# The IPAM core's errors know nothing of CNI; this table is where they get their codes
# (docs/configuration.md "Error codes"). The most specific class wins (the table is walked along
# the MRO).
CODES: dict[type[DatastoreError], tuple[int, str]] = {
    InvalidConfig: (Code.INVALID_CONFIG, "invalid IPAM configuration"),
    IpamError: (Code.INTERNAL, "IPAM failure"),
    NoAddressAvailable: (Code.NO_ADDRESS, "no address available"),
    AddressUnavailable: (Code.ADDRESS_UNAVAILABLE, "requested address not available"),
    RevisionConflict: (Code.TRY_AGAIN_LATER, "IPAM datastore busy, try again later"),
    StoreCorrupt: (Code.STORE_CORRUPT, "IPAM datastore unreadable or corrupt"),
    StoreUnavailable: (Code.TRY_AGAIN_LATER, "IPAM datastore unavailable, try again later"),
    LockTimeout: (Code.TRY_AGAIN_LATER, "IPAM datastore busy, try again later"),
    StoreError: (Code.TRY_AGAIN_LATER, "IPAM datastore failure, try again later"),
}


def to_cni_error(e: DatastoreError) -> CniError:
    """The CNI error for an IPAM core error (code from ``CODES``; 999 if unlisted)."""
    for cls in type(e).__mro__:
        if cls in CODES:
            code, short = CODES[cls]
            return CniError(code, short, str(e))
    return CniError(Code.INTERNAL, "IPAM failure", str(e))


@contextmanager
def cni_errors() -> Iterator[None]:
    """The block's IPAM core and store errors raised as their CNI errors."""
    try:
        yield
    except DatastoreError as e:
        raise to_cni_error(e) from None
