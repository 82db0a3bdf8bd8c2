"""tabby's IPAM core: pools cut into node-affine blocks, one handle per attachment.

Pure Python, standard library only, no CNI protocol code. See ``ipam/DESIGN.md``.

What a CNI call never needs (the consistency check, the operator's report types) is loaded
on first access, to keep the plugins' start-up short.
"""

from typing import TYPE_CHECKING

from ipam.core.allocator import Ipam
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
from ipam.core.model import (
    Allocation,
    AssignRequest,
    GcReport,
    PoolSpec,
    handle_id,
    split_handle_id,
)

if TYPE_CHECKING:  # at run time: ``__getattr__`` below
    from ipam.core.check import check_consistency
    from ipam.core.reports import BlockUsage, IpOwner, NodeRelease, PoolUsage, Problem

_LAZY = {
    "check_consistency": "ipam.core.check",
    "BlockUsage": "ipam.core.reports",
    "IpOwner": "ipam.core.reports",
    "NodeRelease": "ipam.core.reports",
    "PoolUsage": "ipam.core.reports",
    "Problem": "ipam.core.reports",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "AddressUnavailable",
    "Allocation",
    "AssignRequest",
    "BlockUsage",
    "DatastoreError",
    "GcReport",
    "InvalidConfig",
    "IpOwner",
    "Ipam",
    "IpamError",
    "LockTimeout",
    "NoAddressAvailable",
    "NodeRelease",
    "PoolSpec",
    "PoolUsage",
    "Problem",
    "RevisionConflict",
    "StoreCorrupt",
    "StoreError",
    "StoreUnavailable",
    "check_consistency",
    "handle_id",
    "split_handle_id",
]
