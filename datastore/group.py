"""Group commit: the datastore operations of concurrent calls run in batches.

A long-lived process (tabby-node) serves many CNI calls at once, and each would take the
node's lock and write on its own, one after the other. ``Batches`` lets the operations that
arrive while one batch runs wait for the next: the first caller of a key leads and runs the
batch function on every queued item at once (one lock session, one write per block: what
each user's batch function makes of it), the others get their own outcome from it.

Leadership passes on: a leader whose own item is done hands the queue to the next waiter,
so no call serves others for long. A waiter that no batch took within its bound leaves the
queue (``timeout_error``); one a batch took waits for it (a batch's store calls are bounded
by the store's lock timeout). The batch function returns one outcome per item, a value or
the exception that item alone failed with; what it raises fails its whole batch, and the
next waiter leads the next one all the same.

Standard library only. Users: ``ipam.group`` (the IPAM ADDs' allocations) and
``cni_plugin.plugin.EndpointGroup`` (the WorkloadEndpoints those ADDs record).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Hashable, Sequence
from typing import Generic, TypeVar

R = TypeVar("R")
T = TypeVar("T")

#: A batch function: the items of one batch in, one outcome per item out (in order).
Batch = Callable[[list[R]], Sequence["T | BaseException"]]


class _Waiter(Generic[R, T]):
    __slots__ = ("done", "finished", "item", "lead", "result")

    def __init__(self, item: R) -> None:
        self.item = item
        self.result: T | BaseException | None = None
        self.finished = False  #: ``result`` holds the item's outcome
        self.done = threading.Event()  #: finished, or it leads now
        self.lead = False


class Batches(Generic[R, T]):
    """Items of the same key run together (``submit``)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        #: key -> the waiters not taken by a batch yet
        self.queues: dict[Hashable, list[_Waiter[R, T]]] = {}
        self.leading: set[Hashable] = set()
        self.batches = 0  #: batches run (metrics, tests)
        self.writing = 0  #: items in the batches running now

    def pending(self) -> int:
        """Items queued or in a running batch."""
        with self.lock:
            return self.writing + sum(len(q) for q in self.queues.values())

    def submit(
        self,
        key: Hashable,
        item: R,
        run: Batch[R, T],
        *,
        wait: float,
        timeout_error: Callable[[], BaseException],
    ) -> T:
        """``item``'s outcome, run by ``run`` in a batch with the items of ``key`` submitted
        meanwhile (every caller of one key passes an equivalent ``run``: the leader's runs
        the batch). Raises what the batch gave the item, or ``timeout_error()`` when no
        batch took it within ``wait`` seconds."""
        me: _Waiter[R, T] = _Waiter(item)
        with self.lock:
            self.queues.setdefault(key, []).append(me)
            if key not in self.leading:
                self.leading.add(key)
                me.lead = True
        if not me.lead and not me.done.wait(wait):
            with self.lock:  # the lock orders this against a hand-over to this waiter
                queued = not me.lead and me in self.queues.get(key, ())
                if queued:
                    self.queues[key].remove(me)
            if queued:
                raise timeout_error()
            me.done.wait()  # a batch has it (its store calls are bounded), or it leads now
        while me.lead and not me.finished:
            self._run_batch(key, run)
        if isinstance(me.result, BaseException):
            raise me.result
        return me.result  # type: ignore[return-value]  # finished: the item's T

    def _run_batch(self, key: Hashable, run: Batch[R, T]) -> None:
        with self.lock:
            batch = self.queues.pop(key, [])
            self.writing += len(batch)
        try:
            if batch:
                try:
                    results: Sequence[T | BaseException] = run([w.item for w in batch])
                    if len(results) != len(batch):
                        raise RuntimeError(f"{len(results)} outcomes for {len(batch)} items")
                except BaseException as e:  # the whole batch failed; each caller is told
                    results = [e] * len(batch)
                for w, got in zip(batch, results, strict=True):
                    w.result, w.finished = got, True
                self.batches += 1
        finally:
            with self.lock:  # hand over: the next waiter leads (the leader's own item is done)
                self.writing -= len(batch)
                waiting = self.queues.get(key)
                if waiting:
                    nxt = waiting[0]
                    if not nxt.finished and not nxt.lead:
                        nxt.lead = True
                        nxt.done.set()
                else:
                    self.leading.discard(key)
            for w in batch:
                w.lead = False
                w.done.set()
