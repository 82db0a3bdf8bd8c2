"""The agent as its parts see it: the interfaces between tabby-node's modules.

The routing backends, the HTTP endpoints and the metrics collector read the running agent;
the agent builds them. So that no module imports the agent (which imports them all), they
take it as an :class:`AgentView`, and the agent's parts as the protocols below. The agent
(``tabby_node.agent.Agent``) satisfies them; mypy checks it where the agent hands itself
over.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Mapping
from http.server import ThreadingHTTPServer
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from bird import BirdSupervisor
    from cni_config.common import DatastoreSettings
    from dataplane.overlay import Changes
    from dataplane.overlay_model import DesiredState
    from datastore import Served
    from datastore.base import Store
    from policy.state import ApplyResult, PolicyDataplane
    from resources.index import Change, Documents
    from tabby_node.cache import Cache
    from tabby_node.cluster import Cluster, Underlay
    from tabby_node.cluster_index import Present, Touched
    from tabby_node.facts import Facts
    from tabby_node.options import NodeOptions
    from tabby_node.policylog import DeniedFlows


@dataclasses.dataclass(frozen=True)
class RoutingPass:
    """What one :meth:`NoRouting.sync` did."""

    #: What the batch changed in the cluster view (``pools``: the agent's IP-in-IP notice).
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


class MetricsHooks(Protocol):
    """What the agent's parts tell the metrics (``tabby_node.metrics.Metrics``)."""

    def reconciled(self, seconds: float, ok: bool) -> None: ...

    def routes(self, programmed: Mapping[str, int], changes: Changes) -> None: ...

    def routing_checked(self, fixes: Mapping[str, int]) -> None: ...

    def bird(self, supervisor: BirdSupervisor) -> None: ...

    def policy_applied(self, result: ApplyResult | None) -> None: ...

    def datastore_error(self, op: str) -> None: ...

    def cni_request(self, command: str, rc: int, out: bytes, seconds: float) -> None: ...

    def exposition(self, accept: str | None) -> tuple[str, bytes]: ...


class CallServer(Protocol):
    """The CNI call server (``tabby_node.server.NodeServer``), as the metrics read it."""

    @property
    def inflight(self) -> set[threading.Thread]:
        """The calls being served now."""
        ...


class RoutingBackend(Protocol):
    """``--backend``: what reaches other nodes' pods (``tabby_node.routing``)."""

    def start(self) -> None: ...

    def sync(self, changes: Iterable[Change], present: Present | None = None) -> RoutingPass:
        """A dataplane pass: the routing documents that changed (``Index.drain``)."""
        ...

    def check(self, docs: Documents) -> RoutingCheck:
        """The periodic check: everything recomputed from the documents, the kernel
        reconciled whole; what it had to fix."""
        ...

    def reconcile(self, cluster: Cluster, *, full: bool = False) -> None: ...

    def status(self, cluster: Cluster | None = None) -> dict[str, Any]: ...

    def readiness(self) -> list[str]: ...

    def announced(self) -> dict[str, int]:
        """Prefixes announced over BGP, by kind (``block``, ``borrowed``)."""
        ...

    def stop(self, *, stop_bird: bool = True) -> None: ...


class AgentView(Protocol):
    """The running agent, read-only, as its parts need it."""

    @property
    def options(self) -> NodeOptions: ...

    @property
    def datastore(self) -> DatastoreSettings: ...

    @property
    def facts(self) -> Facts | None: ...

    @property
    def cache(self) -> Cache: ...

    @property
    def store(self) -> Store | None: ...

    @property
    def served(self) -> Served | None: ...

    @property
    def problems(self) -> dict[str, str]: ...

    @property
    def denied_flows(self) -> DeniedFlows | None:
        """The denied-flow log (None without policy visibility)."""
        ...

    @property
    def loop_beat(self) -> dict[str, float]: ...

    @property
    def reconciles(self) -> int: ...

    @property
    def in_sync(self) -> bool: ...

    @property
    def routing(self) -> RoutingBackend | None: ...

    @property
    def policy(self) -> PolicyDataplane | None: ...

    @property
    def server(self) -> CallServer | None: ...

    @property
    def metrics(self) -> MetricsHooks | None: ...

    @property
    def http_servers(self) -> list[ThreadingHTTPServer]: ...

    def underlay(self) -> Underlay:
        """This node's underlay addresses, uplinks and MTU."""
        ...

    def vxlan_state(self, cluster: Cluster) -> DesiredState:
        """The kernel state the vxlan backend wants on this node."""
        ...
