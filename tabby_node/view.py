"""The interfaces between tabby-node's parts.

``tabby_node.main`` builds the parts and hands each one the others it uses. A part that
uses another through one of the protocols below does not import it: the routing backends,
the loops and the call server tell the metrics what happened without importing
prometheus_client, and the HTTP endpoints, the status file and the metrics read the
routing backend and the dataplane passes without importing them (which import the
routing). mypy checks, where ``main`` wires them, that the parts satisfy these.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Protocol

from bundle.types import JSON

if TYPE_CHECKING:
    from bird.control import PeerStatus
    from dataplane.overlay import Changes
    from policy.state import ApplyResult
    from resources.index import Change, Documents
    from tabby_node.cluster import Cluster
    from tabby_node.cluster_index import Present, Touched


@dataclasses.dataclass(frozen=True)
class RoutingPass:
    """What one :meth:`NoRouting.sync` did."""

    #: What the batch changed in the cluster view (``pools``: the IP-in-IP notice).
    touched: Touched
    #: What the kernel got (None: nothing to change).
    kernel: Changes | None = None
    #: BIRD's configuration was rendered again (and reloaded if it changed).
    bird: bool = False


@dataclasses.dataclass(frozen=True)
class RoutingCheck:
    """What the periodic check (:meth:`NoRouting.check`) had to fix; all 0 when the
    incremental passes kept everything right."""

    #: Kernel objects the whole reconcile changed (a route someone removed, or a delta
    #: that went wrong).
    kernel: int = 0
    #: Facts or desired objects where the kept state differed from the recompute from
    #: the documents (a bug in the incremental passes: logged, and the state rebuilt).
    model: int = 0
    #: BIRD's configuration differed from the one rendered from the whole cluster.
    bird: int = 0

    @property
    def fixes(self) -> int:
        return self.kernel + self.model + self.bird

    def as_dict(self) -> dict[str, int]:
        return {"kernel": self.kernel, "model": self.model, "bird": self.bird}


# -- what the parts tell the metrics (``tabby_node.metrics.Metrics``) ---------------------------


class DatastoreErrors(Protocol):
    """The start-up retries, the watcher, the heartbeat and the health check."""

    def datastore_error(self, op: str) -> None: ...


class PolicyHooks(Protocol):
    """The policy passes and the per-pod policy of the CNI calls."""

    def policy_applied(self, result: ApplyResult | None) -> None: ...


class PassHooks(PolicyHooks, Protocol):
    """The dataplane passes."""

    def reconciled(self, seconds: float, ok: bool) -> None: ...


class RoutingHooks(Protocol):
    """The routing backends."""

    def routes(self, programmed: Mapping[str, int], changes: Changes) -> None: ...

    def routing_checked(self, fixes: Mapping[str, int]) -> None: ...


class CallHooks(Protocol):
    """The CNI call server."""

    def cni_request(
        self,
        command: str,
        rc: int,
        out: bytes,
        seconds: float,
        phases: Mapping[str, float] | None = None,
        cpu: float | None = None,
    ) -> None: ...


# -- what the parts read of each other -----------------------------------------------------------


class CallServer(Protocol):
    """The CNI call server (``tabby_node.server.NodeServer``), as the metrics read it."""

    @property
    def inflight(self) -> set[threading.Thread]:
        """The calls being served now."""
        ...


class Ready(Protocol):
    """The routing backend, as readiness reads it."""

    def readiness(self) -> list[str]: ...


class Reporting(Protocol):
    """The routing backend, as the status file reads it."""

    def status(self, cluster: Cluster | None = None) -> JSON: ...


class RoutingBackend(Ready, Reporting, Protocol):
    """``--backend``: what reaches other nodes' pods (``tabby_node.routing``)."""

    def start(self) -> None: ...

    def sync(self, changes: Iterable[Change], present: Present | None = None) -> RoutingPass:
        """A dataplane pass: the routing documents that changed (``Index.drain``)."""
        ...

    def check(self, docs: Documents) -> RoutingCheck:
        """The periodic check: everything recomputed from the documents, the kernel
        reconciled whole; what it had to fix."""
        ...

    def stop(self, *, stop_bird: bool = True) -> None: ...


class Bird(Protocol):
    """The BIRD supervisor (``bird.BirdSupervisor``), as the metrics read it."""

    @property
    def restarts(self) -> int: ...

    def running(self) -> bool: ...

    def peers(self) -> list[PeerStatus]: ...


class BgpSpeaker(Protocol):
    """The bird backend (``tabby_node.routing.BirdRouting``), as the metrics read it."""

    @property
    def bird(self) -> Bird: ...

    def announced(self) -> dict[str, int]:
        """Prefixes announced over BGP, by kind (``block``, ``borrowed``)."""
        ...


class Passes(Protocol):
    """The dataplane passes (``tabby_node.passes.DataplaneLoop``), as readiness reads
    them."""

    @property
    def reconciles(self) -> int:
        """Passes so far (0: the dataplane is not programmed yet)."""
        ...

    @property
    def in_sync(self) -> bool:
        """The last pass succeeded."""
        ...


class DataplaneThread(Protocol):
    """Runs a function on the dataplane thread (``tabby_node.passes.Requests``)."""

    def call(self, fn: Callable[[], None], timeout: float) -> None: ...
