"""Group commit of the ADDs a long-lived process serves (tabby-node).

The kubelet starts many pods at once; each pod's ADD would write its node's block once, one
write after the other under the node's lock. ``GroupCommit`` lets the ADDs that arrive while
one batch is being written wait for the next: one of them leads and runs
``Ipam.assign_many`` for all (``ipam.core.batch``: one write per block they land in), the
others get their outcome. So the writes of a burst fall from one per pod to about one per
batch, and the calls run in parallel where the datastore allows it (each batch's write is
what they wait for together, not each other's).

Who leads, who waits and the hand-over are ``datastore.group``'s (the WorkloadEndpoints the
ADDs record are batched the same way). An ADD that its batch refused (no address, a conflict it
could not resolve) is run again on its own through the process's stores (``Stores.run``,
which asks the store itself when the watch's view may have been stale): a refusal never
rests on the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from datastore.group import Batches
from ipam.core import Allocation, AssignRequest, DatastoreError, Ipam, PoolSpec
from ipam.core.errors import LockTimeout, StoreUnavailable

if TYPE_CHECKING:
    from datastore.base import Store, StoreSettings
    from stores import Stores

Outcome = list[Allocation] | BaseException


class GroupCommit:
    """The ADDs of one datastore, node and pool configuration, assigned in batches
    (``datastore.group.Batches``: who leads, who waits, the hand-over)."""

    def __init__(self, stores: Stores) -> None:
        self.stores = stores
        #: keyed by (store, node, pools)
        self.group: Batches[AssignRequest, list[Allocation]] = Batches()
        self.batches = 0  #: batches written (metrics, tests)
        self.assigned = 0  #: attachments assigned by them

    def assign(
        self,
        settings: StoreSettings,
        node: str,
        pools: Sequence[PoolSpec],
        req: AssignRequest,
    ) -> list[Allocation]:
        """``req``'s addresses (``Ipam.ensure_pools(pools)`` first), in a batch with the
        concurrent ADDs of the same datastore, node and pools."""
        from stores import identity

        return self.group.submit(
            (identity(settings), node, tuple(pools)),
            req,
            lambda reqs: self._assign(settings, node, pools, reqs),
            wait=settings.lock_timeout_seconds * 2 + 5,
            timeout_error=lambda: LockTimeout(node, "no batch took this ADD in time"),
        )

    def _assign(
        self,
        settings: StoreSettings,
        node: str,
        pools: Sequence[PoolSpec],
        reqs: list[AssignRequest],
    ) -> list[Outcome]:
        def run(store: Store) -> list[list[Allocation] | DatastoreError]:
            ipam = Ipam(store, node)
            ipam.ensure_pools(pools)
            return ipam.assign_many(reqs)

        try:
            results = self.stores.run(settings, run)
        except (StoreUnavailable, LockTimeout) as e:  # the store itself: every one fails
            return [e] * len(reqs)
        except DatastoreError:
            results = [DatastoreError("batch failed")] * len(reqs)
        self.batches += 1
        out: list[Outcome] = []
        for req, got in zip(reqs, results, strict=True):
            if isinstance(got, list):
                out.append(got)
                self.assigned += 1
            elif isinstance(got, (StoreUnavailable, LockTimeout)):
                out.append(got)  # the store itself: asking again would only double the wait
            else:  # refused in the batch: asked again on its own, of the store itself if need be
                try:
                    out.append(self.stores.run(settings, _Single(node, pools, req)))
                except DatastoreError as e:
                    out.append(e)
        return out


class _Single:
    """One ADD on its own (``Ipam.assign``), as ``Stores.run`` runs it."""

    def __init__(self, node: str, pools: Sequence[PoolSpec], req: AssignRequest) -> None:
        self.node, self.pools, self.req = node, pools, req

    def __call__(self, store: Store) -> list[Allocation]:
        ipam = Ipam(store, self.node)
        ipam.ensure_pools(self.pools)
        return ipam.assign(self.req)
