"""tabby's IPAM core: pools cut into node-affine blocks, one handle per attachment.

Pure Python, standard library only, no CNI protocol code. See ``ipam/DESIGN.md``.
"""

from ipam.core.allocator import Ipam
from ipam.core.check import check_consistency
from ipam.core.errors import (
    AddressUnavailable,
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
    BlockUsage,
    GcReport,
    IpOwner,
    NodeRelease,
    PoolSpec,
    PoolUsage,
    Problem,
    handle_id,
    split_handle_id,
)

__all__ = [
    "AddressUnavailable",
    "Allocation",
    "AssignRequest",
    "BlockUsage",
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
