"""tabby-kube-controllers' Prometheus metrics (``/metrics`` on ``--metrics-port``), read at
scrape time from what the controllers already hold; a registry of their own.

===============================================  =======  ==========================================
name                                             type     meaning
===============================================  =======  ==========================================
``tabby_controllers_leader``                     gauge    1 on the replica holding the Lease
``tabby_controllers_sync_events_total``          counter  ``kind``: watch events and lists received
``tabby_controllers_relists_total``              counter  ``kind``: full lists (first one, 410 Gone)
``tabby_controllers_writes_total``               counter  ``kind``, ``action``: datastore writes
                                                          (created, configured, deleted, invalid)
``tabby_controllers_releases_total``             counter  ``reason`` (``node``, ``leak``): addresses
                                                          released
``tabby_controllers_queue``                      gauge    keys waiting to be written
``tabby_controllers_api_requests_total``         counter  requests sent to the API server
``tabby_controllers_connections_refused_total``  counter  ``server`` (health, metrics), ``reason``:
                                                          connections the HTTP endpoints refused
                                                          or cut at their limits
===============================================  =======  ==========================================

plus the process's own (``process_cpu_seconds_total``, ``process_resident_memory_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Gauge, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from daemon.limits import Refusals
    from kube_controllers.ipamgc import IpamGc
    from kube_controllers.mirror import Writer
    from kube_controllers.reflector import Reflector
    from stores.kube.client import KubeClient


class Controllers(Protocol):
    """What the metrics read of the running controllers (``controller.Controllers``)."""

    @property
    def reflectors(self) -> Mapping[str, Reflector]: ...

    @property
    def events(self) -> Mapping[str, int]: ...

    @property
    def mirror(self) -> Writer | None: ...

    @property
    def ipam(self) -> IpamGc | None: ...

    @property
    def api(self) -> KubeClient | None: ...

    @property
    def refusals(self) -> Refusals: ...

    def queue_length(self) -> int: ...


REASONS = ("node", "leak")


class _State(Collector):
    def __init__(self, controllers: Controllers) -> None:
        self.controllers = controllers

    def collect(self) -> Iterable[Metric]:
        return collect(self.controllers)


def collect(c: Controllers) -> Iterator[Metric]:
    events = CounterMetricFamily(
        "tabby_controllers_sync_events",
        "Kubernetes watch events and lists received, by kind",
        labels=["kind"],
    )
    relists = CounterMetricFamily(
        "tabby_controllers_relists",
        "full lists of a kind (the first one, and after a 410 Gone)",
        labels=["kind"],
    )
    for kind, reflector in sorted(c.reflectors.items()):
        events.add_metric([kind], c.events.get(kind, 0))
        relists.add_metric([kind], reflector.lists)
    yield events
    yield relists
    writes = CounterMetricFamily(
        "tabby_controllers_writes", "datastore writes by kind and action", labels=["kind", "action"]
    )
    for (kind, action), n in sorted((c.mirror.writes if c.mirror else {}).items()):
        writes.add_metric([kind, action], n)
    yield writes
    releases = CounterMetricFamily(
        "tabby_controllers_releases", "addresses released, by reason", labels=["reason"]
    )
    released = c.ipam.released if c.ipam is not None else {}
    for reason in REASONS:
        releases.add_metric([reason], released.get(reason, 0))
    yield releases
    yield GaugeMetricFamily(
        "tabby_controllers_queue", "keys waiting to be written", value=c.queue_length()
    )
    yield CounterMetricFamily(
        "tabby_controllers_api_requests",
        "requests sent to the Kubernetes API server",
        value=c.api.requests if c.api is not None else 0,
    )
    refused = CounterMetricFamily(
        "tabby_controllers_connections_refused",
        "connections the HTTP endpoints refused or cut at their limits, by server and reason",
        labels=["server", "reason"],
    )
    for (server, reason), n in sorted(c.refusals.snapshot().items()):
        refused.add_metric([server, reason], n)
    yield refused


class Metrics:
    def __init__(self, controllers: Controllers) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        self.leader = Gauge(
            "tabby_controllers_leader",
            "1 on the replica that holds the Lease (the one that writes)",
            registry=self.registry,
        )
        ProcessCollector(registry=self.registry)
        self.registry.register(_State(controllers))

    def exposition(self, accept: str | None) -> tuple[str, bytes]:
        encoder, content_type = choose_encoder(accept or "")
        return content_type, encoder(self.registry)
