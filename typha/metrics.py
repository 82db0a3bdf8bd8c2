"""tabby-typha's Prometheus metrics (``/metrics`` on ``--metrics-port``), read at scrape time
from the hub's counters (``fanout.hub.Stats``); a registry of their own.

===========================================  =======  ==============================================
name                                         type     meaning
===========================================  =======  ==============================================
``tabby_typha_connections``                  gauge    clients connected now
``tabby_typha_snapshots_total``              counter  snapshots sent (a first connection, a client
                                                      the history could not bring up to date)
``tabby_typha_snapshot_bytes_total``         counter  their bytes
``tabby_typha_snapshot_seconds_total``       counter  the time spent making and sending them
``tabby_typha_resumes_total``                counter  reconnections served from the history alone
``tabby_typha_resyncs_total``                counter  reconnections from another replica's (or a
                                                      lost) position, by digests: only the
                                                      buckets that differ sent
``tabby_typha_updates_sent_total``           counter  updates sent (one per node it went to)
``tabby_typha_bytes_sent_total``             counter  bytes of the messages sent
``tabby_typha_clients_behind``               gauge    clients not yet sent every change
``tabby_typha_history_depth``                gauge    changes the history holds
``tabby_typha_history_bytes``                gauge    their bytes
``tabby_typha_position``                     gauge    changes applied since start (the newest seq)
``tabby_typha_tls_handshakes_total``         counter  TLS handshakes begun (one per connection
                                                      accepted on the stream's port)
``tabby_typha_connections_refused_total``    counter  ``reason``: clients refused: ``handshake``
                                                      (the handshakes that did not become a
                                                      connection calling the service, counted
                                                      10 s after they began:
                                                      ``fanout.hub.Handshakes``), ``identity``
                                                      (a certificate of the CA, not a name
                                                      allowed), ``kinds`` (a client asking for
                                                      kinds this typha does not serve)
===========================================  =======  ==============================================

plus the process's own (``process_cpu_seconds_total``, ``process_resident_memory_bytes``).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, ProcessCollector, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from fanout.hub import Hub


class _State(Collector):
    def __init__(self, hub: Hub) -> None:
        self.hub = hub

    def collect(self) -> Iterable[Metric]:
        return collect(self.hub)


def collect(hub: Hub) -> Iterator[Metric]:
    s = hub.stats
    yield GaugeMetricFamily("tabby_typha_connections", "clients connected", value=s.connections)
    yield CounterMetricFamily("tabby_typha_snapshots", "snapshots sent", value=s.snapshots)
    yield CounterMetricFamily(
        "tabby_typha_snapshot_bytes", "bytes of the snapshots sent", value=s.snapshot_bytes
    )
    yield CounterMetricFamily(
        "tabby_typha_snapshot_seconds",
        "time spent making and sending snapshots",
        value=s.snapshot_seconds,
    )
    yield CounterMetricFamily(
        "tabby_typha_resumes", "reconnections served from the history alone", value=s.resumes
    )
    yield CounterMetricFamily(
        "tabby_typha_resyncs",
        "reconnections from another position, by digests (the buckets that differ sent)",
        value=s.resyncs,
    )
    yield CounterMetricFamily(
        "tabby_typha_updates_sent", "document updates sent, one per node", value=s.updates_sent
    )
    yield CounterMetricFamily("tabby_typha_bytes_sent", "bytes sent", value=s.bytes_sent)
    yield GaugeMetricFamily(
        "tabby_typha_clients_behind", "clients not yet sent every change", value=s.behind
    )
    yield GaugeMetricFamily(
        "tabby_typha_history_depth", "changes the history holds", value=len(hub.history)
    )
    yield GaugeMetricFamily(
        "tabby_typha_history_bytes", "bytes of the history", value=hub.history_bytes
    )
    yield GaugeMetricFamily("tabby_typha_position", "changes applied since start", value=hub.seq)
    yield CounterMetricFamily(
        "tabby_typha_tls_handshakes",
        "TLS handshakes begun, one per connection accepted",
        value=s.handshakes.begun,
    )
    if hub.interest is not None:
        yield GaugeMetricFamily(
            "tabby_typha_interest_sets",
            "distinct sets of the nodes' interest (fanout.interest)",
            value=len(hub.interest.items),
        )
        yield CounterMetricFamily(
            "tabby_typha_interest_evaluations",
            "evaluations of a workload against one set of the interest",
            value=hub.interest.counts.evaluations,
        )
    refused = CounterMetricFamily(
        "tabby_typha_connections_refused", "clients refused, by reason", labels=["reason"]
    )
    reasons = dict(s.refused)
    if s.handshakes.begun:
        reasons["handshake"] = s.handshakes.failed()
    for reason, n in sorted(reasons.items()):
        refused.add_metric([reason], n)
    yield refused


class Metrics:
    def __init__(self, hub: Hub) -> None:
        disable_created_metrics()  # type: ignore[no-untyped-call]
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_State(hub))

    def exposition(self, accept: str | None) -> tuple[str, bytes]:
        encoder, content_type = choose_encoder(accept or "")
        return content_type, encoder(self.registry)
