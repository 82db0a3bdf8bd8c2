"""The ``dataplane`` thread: the one thread that changes the kernel.

On every cache change (debounced) it takes the documents that changed to the routing
backend (BIRD or VXLAN) and the policy dataplane (nftables), which change in the kernel what
those documents touch; every ``CHECK_SECONDS`` it has everything recomputed and checked. It
also runs what the CNI threads ask of it (a new pod's policy before that pod's ADD answers:
``tabby_node.pod_policy``), and writes the status file after its passes.

The thread is tabby-node's main thread, in tabby-node's own network namespace (the node's),
so every kernel change lands there even when the CNI thread asking for it has entered a
caller's namespace. Reconciling reads the kernel and changes only the difference (the overlay
reconciler, BIRD's configure, nftables transactions), so a restart adopts what is there.
"""

from __future__ import annotations

import logging
import queue
import random
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from policy.inputs import PolicyInputs
from resources.index import POOLS, Change, Documents
from tabby_node.cluster import PoolInfo, pool_info

if TYPE_CHECKING:
    from policy.state import PolicyDataplane
    from tabby_node.cache import Cache
    from tabby_node.facts import Facts
    from tabby_node.node_status import StatusReport
    from tabby_node.view import PassHooks, PolicyHooks, RoutingBackend

log = logging.getLogger("tabby.node")

#: A function for the dataplane thread, and where its outcome goes (ok, value or exception).
Request = tuple[Callable[[], object], "queue.Queue[tuple[bool, object]]"]

DEBOUNCE_SECONDS = 0.02
#: The periodic check (everything recomputed and compared; the kernel reconciled whole, the
#: nftables table replaced): it repairs drift behind tabby's back. felix's default refresh.
CHECK_SECONDS = 90.0
#: After a failed pass, the check comes this soon.
RETRY_SECONDS = 1.0


def _jittered(seconds: float) -> float:
    """``seconds`` +- 10 %: the nodes' checks do not fall into step."""
    return seconds * random.uniform(0.9, 1.1)  # noqa: S311 (spreading, not secrecy)


class Requests:
    """Functions the CNI threads run on the dataplane thread: :meth:`call` (a CNI thread)
    queues one, wakes the loop (``wake``: the cache's) and waits for its outcome; the loop
    runs them (:meth:`serve`)."""

    def __init__(self, wake: threading.Event) -> None:
        self.wake = wake
        self._queue: queue.Queue[Request] = queue.Queue()

    def call(self, fn: Callable[[], None], timeout: float) -> None:
        """Run ``fn`` on the dataplane thread (the node's network namespace) and wait."""
        reply: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=1)
        self._queue.put((fn, reply))
        self.wake.set()
        ok, value = reply.get(timeout=timeout)
        if not ok:
            assert isinstance(value, BaseException)
            raise value

    def serve(self) -> None:
        """Run every queued function (the dataplane thread)."""
        while True:
            try:
                fn, reply = self._queue.get_nowait()
            except queue.Empty:
                return
            try:
                reply.put((True, fn()))
            except BaseException as e:  # handed to the waiting CNI thread
                reply.put((False, e))


class PolicyPass:
    """A pass's part for NetworkPolicy: the changed documents' updates to the policy
    dataplane (it sends their delta); with a snapshot, the whole check from it (the first
    pass loads it)."""

    def __init__(self, policy: PolicyDataplane, metrics: PolicyHooks | None = None) -> None:
        self.policy = policy
        self.metrics = metrics
        self.inputs = PolicyInputs()

    @property
    def synced(self) -> bool:
        """The policy dataplane has had its first whole load."""
        return self.policy.synced

    def apply(self, changes: list[Change], docs: Documents | None) -> None:
        policy = self.policy
        if policy.synced:
            updates = self.inputs.updates(changes)
            if updates:
                result = policy.update(updates)
                if self.metrics is not None:  # metrics
                    self.metrics.policy_applied(result)
        if docs is not None:
            state, nat = self.inputs.convert(docs)
            result = policy.sync(state, nat, full=True)
            if self.metrics is not None:  # metrics
                self.metrics.policy_applied(result)


class IpipNotice:
    """A pool asks for IP-in-IP on a kernel without it: said once in the log, and kept in
    the status (node status) and in readiness (``problems["ipip"]``) while it lasts; the
    pool's routes stay direct."""

    def __init__(self, facts: Facts, backend: str, problems: dict[str, str]) -> None:
        self.facts = facts
        self.backend = backend
        self.problems = problems

    def update(self, pools: list[PoolInfo]) -> None:
        wanted = [str(p.cidr) for p in pools if p.encap(self.backend)[0] == "ipip"]
        if not wanted or self.facts.ipip_available:
            self.problems.pop("ipip", None)
            return
        text = (
            f"pool(s) {', '.join(wanted)} ask for IP-in-IP, which this kernel cannot do "
            f"({self.facts.ipip_reason}); their routes stay direct"
        )
        if self.problems.get("ipip") != text:
            log.warning("%s", text)
        self.problems["ipip"] = text


class DataplaneLoop:
    """The passes (:meth:`reconcile`) and the loop that runs them (:meth:`run`); the
    counts readiness reads (``reconciles``, ``in_sync``)."""

    def __init__(
        self,
        cache: Cache,
        routing: RoutingBackend,
        policy: PolicyPass,
        *,
        ipip: IpipNotice,
        status: StatusReport,
        requests: Requests,
        stopping: threading.Event,
        beats: dict[str, float],
        problems: dict[str, str],
        metrics: PassHooks | None = None,
    ) -> None:
        self.cache = cache
        self.routing = routing
        self.policy = policy
        self.ipip = ipip
        self.status = status
        self.requests = requests
        self.stopping = stopping
        self.beats = beats
        self.problems = problems
        self.metrics = metrics
        self.reconciles = 0
        self.reconcile_failures = 0
        self.in_sync = False
        self.last_reconcile = 0.0

    def run(self) -> None:
        """The dataplane loop: serve endpoint requests at once, a pass on change (a burst
        of watch events debounced into one; the pass costs what the changes touch), the
        whole check periodically (sooner again after a failed pass)."""
        next_check = time.monotonic() + _jittered(CHECK_SECONDS)
        cache = self.cache
        serve = self.requests.serve
        while not self.stopping.is_set():
            self.beats["dataplane"] = time.monotonic()
            if cache.wake.wait(0.1):
                cache.wake.clear()
            serve()
            ok = True
            if cache.changed.is_set():
                # Debounce, but a CNI call waiting for its pod's rules is never kept
                # waiting for it, nor for the pass its own endpoint write triggered.
                until = time.monotonic() + DEBOUNCE_SECONDS
                while (left := until - time.monotonic()) > 0:
                    if cache.wake.wait(left):
                        cache.wake.clear()
                        serve()
                cache.changed.clear()
                serve()
                ok = self.reconcile()
            now = time.monotonic()
            if now >= next_check:
                ok = self.reconcile(full=True)
                next_check = now + _jittered(CHECK_SECONDS)
            if not ok:  # what a failed pass took from the journal is redone by a check
                next_check = min(next_check, time.monotonic() + RETRY_SECONDS)
            self.status.maybe_write()

    def reconcile(self, *, full: bool = False) -> bool:
        """One dataplane pass; True when every part of it succeeded.

        A pass takes the documents that changed since the last one (the cache's journal)
        to the routing backend and the policy dataplane, which change in the kernel (and
        in BIRD) what those documents touch: its cost does not grow with the cluster.
        ``full`` (the first pass, then every ``CHECK_SECONDS``, and after a failed pass):
        then everything is recomputed from a snapshot taken with the journal and checked
        against what the passes kept, the kernel reconciled whole and the nftables table
        replaced; what the check had to fix is counted (expected 0)."""
        start = time.monotonic()
        full = full or not self.policy.synced
        changes, docs = self.cache.drain(snapshot=full)
        ok = True
        routing_error: str | None = None
        try:
            self.routing.sync(changes, self.cache.has)
        except Exception as e:
            routing_error = str(e)
            log.exception("routing pass failed")
        if docs is not None:  # the check rebuilds from the documents: it covers a failed sync
            try:
                self.routing.check(docs)
                routing_error = None
            except Exception as e:
                routing_error = str(e)
                log.exception("routing check failed")
        if routing_error is not None:
            ok = False
            self.problems["routing"] = routing_error
        else:
            self.problems.pop("routing", None)
        try:
            self.policy.apply(changes, docs)
        except Exception as e:
            ok = False
            self.problems["policy"] = str(e)
            log.exception("policy pass failed")
        else:
            self.problems.pop("policy", None)
        if docs is not None or any(ch.kind == POOLS.name for ch in changes):
            self.ipip.update([pool_info(p) for p in self.cache.values(POOLS)])
        self.reconciles += 1
        if not ok:
            self.reconcile_failures += 1
        self.in_sync = ok
        self.last_reconcile = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.reconciled(self.last_reconcile, ok)
        self.status.due()
        if full:
            self.status.write()
        return ok
