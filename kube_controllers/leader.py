"""Leader election on a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does.

Every replica runs :meth:`Elector.run`; at most one holds the Lease and writes. The holder
renews every ``retry`` seconds; a replica takes a Lease over when its holder has not renewed
it for ``lease`` seconds of this replica's own clock (a remote clock is never trusted: the
time is when this replica saw the renewTime change), so a standby takes over within
``lease`` + ``retry`` seconds of the holder's death (15 + 2 by default: the contract says
20). A holder that cannot renew for ``renew_deadline`` seconds steps down on its own,
before anyone else may take over. Stopping releases the Lease (holder cleared), so the
standby takes over at once. Every update is an optimistic-concurrency PUT on the Lease's
resourceVersion: two replicas can never both win one round.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime

from bundle.types import JSON
from stores.kube.client import ApiError, Conflict, KubeClient, NotFound

log = logging.getLogger("tabby.controllers")

LEASE_SECONDS = 15
RENEW_DEADLINE_SECONDS = 10.0
RETRY_SECONDS = 2.0


def micro_time(now: float) -> str:
    """A ``MicroTime`` as the API writes it (``2026-11-26T10:00:00.123456Z``)."""
    return datetime.fromtimestamp(now, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class Elector:
    """One replica's side of the election. ``leading`` is set while this replica holds the
    Lease; ``on_change(leading)`` is called on every change (on the elector's thread)."""

    def __init__(
        self,
        api: KubeClient,
        namespace: str,
        name: str,
        identity: str,
        *,
        on_change: Callable[[bool], None] = lambda leading: None,
        lease_seconds: int = LEASE_SECONDS,
        renew_deadline: float = RENEW_DEADLINE_SECONDS,
        retry: float = RETRY_SECONDS,
        wall: Callable[[], float] = time.time,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.api = api
        self.path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/{name}"
        self.collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.on_change = on_change
        self.lease_seconds = lease_seconds
        self.renew_deadline = renew_deadline
        self.retry = retry
        self.wall = wall
        self.clock = clock
        self.leading = threading.Event()
        self.holder: str = ""  # the holder this replica last saw
        self.transitions = 0
        self._observed: tuple[str, str] = ("", "")  # (holder, renewTime) last seen
        self._observed_at = 0.0  # when it changed, on this replica's clock
        self._renewed_at = 0.0  # this replica's last successful renewal
        self.last_error = ""

    # -- one round ----------------------------------------------------------------------------

    def _spec(self, old: JSON | None) -> JSON:
        now = micro_time(self.wall())
        spec = dict((old or {}).get("spec") or {})
        taking_over = spec.get("holderIdentity") != self.identity
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=self.lease_seconds,
            renewTime=now,
        )
        if taking_over:
            spec["acquireTime"] = now
            spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + (1 if old else 0)
        return spec

    def try_acquire_or_renew(self) -> bool:
        """One round: True when this replica holds the Lease afterwards."""
        try:
            lease: JSON | None = self.api.get(self.path)
        except NotFound:
            lease = None
        if lease is None:
            body: JSON = {
                "apiVersion": "coordination.k8s.io/v1",
                "kind": "Lease",
                "metadata": {"name": self.name, "namespace": self.namespace},
                "spec": self._spec(None),
            }
            try:
                self.api.create(self.collection, body)
            except Conflict:
                return False  # another replica created it first
            self.holder = self.identity
            return True
        spec = lease.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        seen = (holder, str(spec.get("renewTime") or ""))
        now = self.clock()
        if seen != self._observed:
            self._observed, self._observed_at = seen, now
        self.holder = holder
        self.transitions = int(spec.get("leaseTransitions") or 0)
        duration = int(spec.get("leaseDurationSeconds") or self.lease_seconds)
        expired = now - self._observed_at > duration
        if holder and holder != self.identity and not expired:
            return False
        lease["spec"] = self._spec(lease)
        try:
            self.api.update(self.path, lease)
        except Conflict:
            return False  # someone else wrote it in between: look again next round
        self.holder = self.identity
        return True

    # -- the loop ------------------------------------------------------------------------------

    def run(self, stop: threading.Event) -> None:
        while not stop.is_set():
            try:
                held = self.try_acquire_or_renew()
                self.last_error = ""
            except ApiError as e:
                held = False
                if str(e) != self.last_error:
                    log.warning("leader election: %s", e)
                self.last_error = str(e)
            now = self.clock()
            if held:
                self._renewed_at = now
                if not self.leading.is_set():
                    log.warning("leader election: %s leads (Lease %s)", self.identity, self.name)
                    self.leading.set()
                    self.on_change(True)
            elif self.leading.is_set() and (
                self.holder not in ("", self.identity)
                or now - self._renewed_at > self.renew_deadline
            ):
                log.warning(
                    "leader election: %s stops leading (holder now %r)",
                    self.identity,
                    self.holder,
                )
                self.leading.clear()
                self.on_change(False)
            stop.wait(self.retry)
        self.release()

    def release(self) -> None:
        """Give the Lease up (holder cleared) if this replica holds it: the standby takes
        over at its next round instead of after the lease duration."""
        if not self.leading.is_set():
            return
        self.leading.clear()
        self.on_change(False)
        try:
            lease = self.api.get(self.path)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            spec.update(
                holderIdentity="", leaseDurationSeconds=1, renewTime=micro_time(self.wall())
            )
            lease["spec"] = spec
            self.api.update(self.path, lease)
            log.warning("leader election: %s released the Lease", self.identity)
        except ApiError as e:
            log.warning("leader election: could not release the Lease: %s", e)
