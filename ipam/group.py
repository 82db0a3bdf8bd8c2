"""Group commit of the ADDs a long-lived process serves (tabby-node).

The kubelet starts many pods at once; each pod's ADD would write its node's block once, one
write after the other under the node's lock. ``GroupCommit`` lets the ADDs that arrive while
one batch is being written wait for the next: one of them leads and runs
``Ipam.assign_many`` for all (``ipam.core.batch``: one write per block they land in), the
others get their outcome. So the writes of a burst fall from one per pod to about one per
batch, and the calls run in parallel where the datastore allows it (each batch's write is
what they wait for together, not each other's).

Leadership passes on: a leader whose own ADD is answered hands the queue to the next waiter,
so no call serves others for long. An ADD that its batch refused (no address, a conflict it
could not resolve) is run again on its own through the process's stores (``Stores.run``,
which asks the store itself when the watch's view may have been stale): a refusal never
rests on the batch.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from ipam.core import Allocation, AssignRequest, DatastoreError, Ipam, PoolSpec
from ipam.core.errors import LockTimeout, StoreUnavailable

if TYPE_CHECKING:
    from datastore.base import Store, StoreSettings
    from stores import Stores


class _Waiter:
    __slots__ = ("done", "lead", "req", "result")

    def __init__(self, req: AssignRequest) -> None:
        self.req = req
        self.result: list[Allocation] | BaseException | None = None
        self.done = threading.Event()  #: the outcome is in ``result``, or it leads now
        self.lead = False


class GroupCommit:
    """The ADDs of one datastore, node and pool configuration, assigned in batches."""

    def __init__(self, stores: Stores) -> None:
        self.stores = stores
        self.lock = threading.Lock()
        #: (store, node, pools) -> the waiters not taken by a batch yet
        self.queues: dict[tuple[object, ...], list[_Waiter]] = {}
        self.leading: set[tuple[object, ...]] = set()
        self.batches = 0  #: batches run (metrics, tests)
        self.assigned = 0  #: attachments assigned by them
        self.writing = 0  #: ADDs in the batches being written now

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

        key = (identity(settings), node, tuple(pools))
        me = _Waiter(req)
        with self.lock:
            self.queues.setdefault(key, []).append(me)
            if key not in self.leading:
                self.leading.add(key)
                me.lead = True
        if not me.lead and not me.done.wait(settings.lock_timeout_seconds * 2 + 5):
            with self.lock:  # the lock orders this against a hand-over to this waiter
                queued = not me.lead and me in self.queues.get(key, ())
                if queued:
                    self.queues[key].remove(me)
            if queued:
                raise LockTimeout(node, "no batch took this ADD in time")
            me.done.wait()  # a batch has it or it leads now (a batch's store calls are bounded)
        while me.lead and me.result is None:
            self._run_batch(settings, node, pools, key)
        if isinstance(me.result, BaseException):
            raise me.result
        assert me.result is not None
        return me.result

    def _run_batch(
        self, settings: StoreSettings, node: str, pools: Sequence[PoolSpec], key: tuple[object, ...]
    ) -> None:
        with self.lock:
            batch = self.queues.pop(key, [])
        if batch:
            with self.lock:
                self.writing += len(batch)
            try:
                self._assign(settings, node, pools, batch)
            finally:
                with self.lock:
                    self.writing -= len(batch)
        with self.lock:  # hand over: the next waiter leads (the leader's own ADD is done)
            waiting = self.queues.get(key)
            if waiting:
                nxt = waiting[0]
                if nxt.result is None and not nxt.lead:
                    nxt.lead = True
                    nxt.done.set()
            else:
                self.leading.discard(key)
        for w in batch:
            w.lead = False
            w.done.set()

    def _assign(
        self, settings: StoreSettings, node: str, pools: Sequence[PoolSpec], batch: list[_Waiter]
    ) -> None:
        reqs = [w.req for w in batch]

        def run(store: Store) -> list[list[Allocation] | DatastoreError]:
            ipam = Ipam(store, node)
            ipam.ensure_pools(pools)
            return ipam.assign_many(reqs)

        try:
            results = self.stores.run(settings, run)
        except (StoreUnavailable, LockTimeout) as e:  # the store itself: every one fails
            for w in batch:
                w.result = e
            return
        except DatastoreError:
            results = [DatastoreError("batch failed")] * len(batch)
        self.batches += 1
        for w, got in zip(batch, results, strict=True):
            if isinstance(got, list):
                w.result = got
                self.assigned += 1
                continue
            if isinstance(got, (StoreUnavailable, LockTimeout)):
                w.result = got  # the store itself: asking again would only double the wait
                continue
            # refused in the batch: asked again on its own, of the store itself if need be
            try:
                w.result = self.stores.run(settings, _Single(node, pools, w.req))
            except DatastoreError as e:
                w.result = e


class _Single:
    """One ADD on its own (``Ipam.assign``), as ``Stores.run`` runs it."""

    def __init__(self, node: str, pools: Sequence[PoolSpec], req: AssignRequest) -> None:
        self.node, self.pools, self.req = node, pools, req

    def __call__(self, store: Store) -> list[Allocation]:
        ipam = Ipam(store, self.node)
        ipam.ensure_pools(self.pools)
        return ipam.assign(self.req)
