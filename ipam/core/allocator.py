"""The IPAM client: a thin facade over the core's modules, one per concern.

=================  ============================================================
``pooladmin``      create, list, disable, delete pools (and the overlap rule)
``assign``         one attachment's addresses: plan, then one CAS per allocation
``batch``          several attachments at once, one CAS per block (group commit)
``candidates``     where an address can come from (assignment and STATUS)
``release``        release by handle, by address, GC of stale attachments (and repair of
                   this node's index), every address and block of a gone node
``status``         readiness (CNI STATUS)
``views``          lookups and the operator's usage tables
``affinity``       the affinity documents: each node's index of its blocks
``legacy``         the migration from handle documents (format 1)
``docs``           typed reads, per-operation state, the pool gate
``reports``        the operator's value types (loaded only when used)
=================  ============================================================

Each operation module is imported when first used, so a CNI call loads only its own.
Every write is compare-and-swap of one document (``datastore.cas``); ``store.lock()`` only
serialises this node's writers (see ``ipam/DESIGN.md``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING

from ipam.core.docs import Docs
from ipam.core.errors import DatastoreError, InvalidConfig

if TYPE_CHECKING:
    from bundle.types import IPAddress, IPNetwork
    from datastore.base import Store
    from ipam.core.model import (
        Allocation,
        AssignRequest,
        GcReport,
        Pool,
        PoolSpec,
    )
    from ipam.core.reports import BlockUsage, IpOwner, NodeRelease, PoolUsage, Problem


class Ipam:
    """Block IPAM over a ``Store`` for one node.

    ``node`` may be "" for the operator's operations (release and lookup by handle then look
    at every block, GC at every node's attachments; views, release_node); ``assign`` and
    ``can_allocate`` need it. A release or lookup by handle with a node looks at the
    blocks the node's index lists (where every allocation made for it lies).
    """

    def __init__(self, store: Store, node: str, *, clock: Callable[[], float] = time.time) -> None:
        if not isinstance(node, str) or ":" in node:
            raise InvalidConfig("invalid node name", repr(node))
        self._docs = Docs(store, node, clock)

    @property
    def store(self) -> Store:
        return self._docs.store

    @property
    def node(self) -> str:
        return self._docs.node

    @property
    def clock(self) -> Callable[[], float]:
        return self._docs.clock

    # == pools ============================================================================

    def ensure_pools(self, pools: Sequence[PoolSpec]) -> None:
        """Create the configured pools the store lacks (validated; overlap = InvalidConfig).

        An existing pool keeps its stored block size and disabled flag.
        """
        from ipam.core import pooladmin

        pooladmin.ensure_pools(self._docs, pools)

    def list_pools(self) -> list[Pool]:
        from ipam.core import pooladmin

        return pooladmin.list_pools(self._docs)

    def add_pool(self, spec: PoolSpec) -> None:
        """Create one pool; InvalidConfig if it exists or overlaps another."""
        from ipam.core import pooladmin

        pooladmin.add_pool(self._docs, spec)

    def set_pool_disabled(self, cidr: str, disabled: bool) -> None:
        """A disabled pool serves no new address; existing allocations stay."""
        from ipam.core import pooladmin

        pooladmin.set_pool_disabled(self._docs, cidr, disabled)

    def delete_pool(self, cidr: str) -> int:
        """Delete a pool and its (empty) blocks; InvalidConfig while any address is in use.

        Returns the number of blocks removed.
        """
        from ipam.core import pooladmin

        return pooladmin.delete_pool(self._docs, cidr)

    # == assign ===========================================================================

    def assign(self, req: AssignRequest) -> list[Allocation]:
        """Addresses for one attachment (see ``AssignRequest``).

        - ``specific_ips``: exactly those, from whatever block holds them (affine, unclaimed
          = claim it, another node's = borrow unless strict); one unavailable = nothing.
        - else one address per wanted family: affine blocks (FIFO), a newly claimed block,
          then one address borrowed from another node's block (unless strict_affinity).
        - all or nothing; a handle that already holds addresses gets them back unchanged.
        """
        from ipam.core import assign

        return assign.assign(self._docs, req)

    def assign_many(self, reqs: Sequence[AssignRequest]) -> list[list[Allocation] | DatastoreError]:
        """Several attachments at once, each block they land in written once (group commit:
        ``ipam.core.batch``); each request's allocations or the error it alone failed with,
        in order. The same outcome as ``assign`` of each, one after the other."""
        from ipam.core import batch

        return batch.assign_many(self._docs, reqs)

    # == release ==========================================================================

    def release_handle(self, handle_id: str) -> list[Allocation]:
        """Release every address of the handle. Not found = [] (success)."""
        from ipam.core import release

        return release.release_handle(self._docs, handle_id)

    def release_ip(self, ip: IPAddress | str, *, expected_seq: int | None = None) -> bool:
        """Release one address. False when it was not allocated, or when ``expected_seq``
        is given and the allocation there is a newer one (a stale release)."""
        from ipam.core import release

        return release.release_ip(self._docs, ip, expected_seq)

    def release_node(self, node: str) -> NodeRelease:
        """For a node that is gone: release every allocation recorded for it (allocation
        attribute "node"), delete its empty blocks, make its blocks that still hold other
        nodes' (borrowed) addresses affine to no node, delete its affinity document.
        Safe against the node being active after all (it then keeps what it takes
        meanwhile). Goes on after individual errors and reports them."""
        from ipam.core import release

        return release.release_node(self._docs, node)

    # == lookups ==========================================================================

    def get_handle(self, handle_id: str) -> list[Allocation]:
        """The handle's addresses (for CHECK); read-only, no lock. Unknown = []."""
        from ipam.core import views

        return views.get_handle(self._docs, handle_id)

    def who_owns(self, ip: IPAddress | str) -> IpOwner | None:
        from ipam.core import views

        return views.who_owns(self._docs, ip)

    # == GC ===============================================================================

    def gc(
        self, network: str, valid: Collection[tuple[str, str]], *, grace_seconds: float
    ) -> GcReport:
        """Release this network's attachments whose (container id, ifname) is not in
        ``valid`` and that are older than ``grace_seconds``. Only this node's (every node's
        when ``node`` is ""). Goes on after individual errors and reports them. Also repairs
        this node's index and adopts its orphan blocks."""
        from ipam.core import release

        return release.gc(self._docs, network, valid, grace_seconds)

    # == readiness (STATUS) ===============================================================

    def can_allocate(
        self,
        v4_pools: Sequence[str],
        v6_pools: Sequence[str],
        *,
        need_v4: bool,
        need_v6: bool,
        strict_affinity: bool,
        max_blocks_per_host: int,
        reserved: Sequence[str | IPNetwork | IPAddress],
        block_size_v4: int | None = None,
        block_size_v6: int | None = None,
    ) -> str | None:
        """None when an ADD could get its addresses now, else why not. Read-only, no lock.

        A configured pool the store lacks counts as a fresh pool (ADD creates it).
        """
        from ipam.core import status

        return status.can_allocate(
            self._docs,
            v4_pools,
            v6_pools,
            need_v4=need_v4,
            need_v6=need_v6,
            strict_affinity=strict_affinity,
            max_blocks_per_host=max_blocks_per_host,
            reserved=reserved,
            block_size_v4=block_size_v4,
            block_size_v6=block_size_v6,
        )

    # == operator views ===================================================================

    def pool_usage(self, reserved: Sequence[str | IPNetwork | IPAddress] = ()) -> list[PoolUsage]:
        """Per pool: TOTAL / IN USE / RESERVED (not in use) / FREE, and blocks in the store."""
        from ipam.core import views

        return views.pool_usage(self._docs, reserved)

    def block_usage(self, reserved: Sequence[str | IPNetwork | IPAddress] = ()) -> list[BlockUsage]:
        from ipam.core import views

        return views.block_usage(self._docs, reserved)

    def allocations(self) -> list[IpOwner]:
        """Every allocation in the store (unreadable blocks skipped), by address."""
        from ipam.core import views

        return views.allocations(self._docs)

    def check(self) -> list[Problem]:
        from ipam.core.check import check_consistency

        return check_consistency(self.store)
