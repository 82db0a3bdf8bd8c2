"""tabby-node's Prometheus metrics: ``/metrics`` on ``--metrics-port`` (tabby_node.http).

One :class:`Metrics` per tabby-node, with a registry of its own (never the library's global
one). Two kinds of numbers:

* events, counted where they happen through the hooks the node's parts call: a CNI call
  served (:meth:`Metrics.cni_request`, from the call server), a reconcile pass
  (:meth:`Metrics.reconciled`), a routing pass (:meth:`Metrics.routes`), a policy apply
  (:meth:`Metrics.policy_applied`), a datastore error a part caught
  (:meth:`Metrics.datastore_error`). :class:`Metrics` exists before anything else (start-up
  is counted too);
* state, read at scrape time by a :class:`NodeCollector` from what the parts already hold,
  registered once they exist (before ``/metrics`` is served): the IPAM gauges from the
  cache's pool and block documents (``tabby_node.ipam_usage``: through the very views
  ``tabbyctl ipam show`` uses, recomputed only when the cache changed), BGP sessions from
  BIRD's control socket, the nftables counters, the store's watch counters (re-reads,
  resumed streams), the etcd store's transaction counters.

Only tabby-node imports this module: the per-call binaries never load prometheus_client
(tests/unit/repository/test_layers.py). A call a binary runs itself (no tabby-node, or
``TABBY_NODE_SOCKET=off``) is not counted anywhere.

Every name and its meaning: :data:`CATALOGUE` (docs/cluster.md's metrics table is made from it).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    ProcessCollector,
    disable_created_metrics,
)
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from bundle import __version__
from tabby_node.ipam_usage import IpamNumbers, live_nodes

if TYPE_CHECKING:
    from daemon.limits import Refusals
    from dataplane.overlay import Changes
    from policy.counters import CounterKey
    from policy.state import ApplyResult, PolicyCounters
    from stores import Served
    from tabby_node.cache import Cache
    from tabby_node.policylog import DeniedFlows
    from tabby_node.view import BgpSpeaker, CallServer

log = logging.getLogger("tabby.node")

#: The CNI verbs a node serves; anything else a client sends is counted as "other".
VERBS = ("ADD", "DEL", "CHECK", "GC", "STATUS")
#: CNI call latency: resolves 5 ms to 5 s (and the lock timeouts above).
CNI_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
RECONCILE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: One phase of a CNI call: 0.25 ms to 1 s.
PHASE_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.25, 1.0)
APPLY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)
#: Route kinds the routing backends report (``routes(programmed, ...)``).
ROUTE_KINDS = ("block", "borrowed", "blackhole", "tunnel")
#: BGP states always exported (zero when no session is in them).
BGP_STATES = ("Established", "Active", "Connect", "OpenSent", "OpenConfirm", "Idle")
#: Datastore operations whose errors tabby-node counts (pre-set to zero).
DATASTORE_OPS = (
    "register",
    "default_pools",
    "tunnel_addresses",
    "heartbeat",
    "watch",
    "health_check",
    "cni",
)
#: CNI result codes that mean the datastore failed the call (try again later, corrupt).
DATASTORE_CODES = (11, 101)

#: name -> (type, labels, help). Every metric tabby-node exports (process_* aside).
CATALOGUE: dict[str, tuple[str, str, str]] = {
    # CNI calls
    "tabby_cni_requests_total": (
        "counter",
        "verb, code",
        "CNI calls served by tabby-node (either binary), by verb and result code (0 = success)",
    ),
    "tabby_cni_request_duration_seconds": (
        "histogram",
        "verb",
        "time tabby-node spent on one CNI call",
    ),
    "tabby_cni_phase_duration_seconds": (
        "histogram",
        "verb, phase",
        "where a served CNI call's time went: ipam (the IPAM verb and its durable write), "
        "netlink (the kernel side; an ADD makes the veth pair beside ipam, a DEL deletes "
        "it beside ipam), netlink_wait (the part of it the call waited for), endpoint (the "
        "WorkloadEndpoint write and the pod's policy; beside netlink), endpoint_wait (the "
        "part of it the call waited for), server (the rest: framing, namespace entry, "
        "thread hand-offs, parsing, rendering)",
    ),
    "tabby_cni_cpu_seconds_total": (
        "counter",
        "verb",
        "CPU tabby-node used (all its threads) while it served CNI calls, by verb: per call "
        "when calls come one at a time",
    ),
    "tabby_cni_requests_in_flight": ("gauge", "", "CNI calls being served now"),
    "tabby_connections_refused_total": (
        "counter",
        "server, reason",
        "connections the node socket (server cni) and the HTTP endpoints (health, metrics) "
        "refused or cut at their limits: busy (at the connection limit), too_large (a request"
        " over the size limit), timeout (the request not read in time), overdue (the answer "
        "not delivered in time)",
    ),
    # IPAM (from the datastore cache)
    "tabby_ipam_pool_size": ("gauge", "pool", "addresses in the pool"),
    "tabby_ipam_pool_reserved": (
        "gauge",
        "pool",
        "reserved addresses of the pool not in use (the reserved list of --conf)",
    ),
    "tabby_ipam_pool_addresses_in_use": ("gauge", "pool", "allocations in the pool, every node"),
    "tabby_ipam_pool_addresses_free": ("gauge", "pool", "size - in use - reserved"),
    "tabby_ipam_pool_blocks": ("gauge", "pool", "blocks of the pool, every node"),
    "tabby_ipam_pool_disabled": ("gauge", "pool", "1 when the pool serves no new addresses"),
    "tabby_ipam_addresses_in_use": (
        "gauge",
        "pool, node",
        "allocations held by this node (pods and tunnel addresses), its own blocks or borrowed",
    ),
    "tabby_ipam_addresses_borrowed": (
        "gauge",
        "pool, node",
        "allocations held by this node in blocks not affine to it",
    ),
    "tabby_ipam_blocks": ("gauge", "pool, node", "blocks affine to this node"),
    # routing
    "tabby_routes_programmed": (
        "gauge",
        "kind",
        "kernel routes tabby-node programmed: block, borrowed, blackhole, tunnel",
    ),
    "tabby_neighbours_programmed": ("gauge", "", "VXLAN neighbour entries programmed"),
    "tabby_fdb_entries_programmed": ("gauge", "", "VXLAN FDB entries programmed"),
    "tabby_dataplane_changes_total": (
        "counter",
        "kind, action",
        "kernel objects added, replaced or removed by the routing reconciler",
    ),
    "tabby_dataplane_problems": (
        "gauge",
        "type",
        "items the last routing pass could not program (conflict: not tabby's; failure)",
    ),
    "tabby_routing_check_fixes_total": (
        "counter",
        "what",
        "what the periodic routing check had to fix (0 while the per-change passes keep "
        "everything right): kernel objects the whole reconcile changed, model facts or objects"
        " the passes kept wrong, bird configurations that differed",
    ),
    "tabby_bgp_peers": ("gauge", "state", "BGP sessions by BIRD state"),
    "tabby_bgp_announced_prefixes": (
        "gauge",
        "kind",
        "prefixes this node announces over BGP: block, borrowed",
    ),
    "tabby_bird_up": ("gauge", "", "1 while the supervised BIRD runs (bird backend)"),
    "tabby_bird_restarts_total": ("counter", "", "times BIRD was started again after it died"),
    # reconcile
    "tabby_reconcile_passes_total": ("counter", "", "reconcile passes (routing + policy)"),
    "tabby_reconcile_failures_total": ("counter", "", "reconcile passes that failed"),
    "tabby_reconcile_duration_seconds": ("histogram", "", "duration of one reconcile pass"),
    "tabby_dataplane_in_sync": ("gauge", "", "1 when the last reconcile pass succeeded"),
    # policy
    "tabby_policy_endpoints": ("gauge", "", "pod endpoints with policy programmed"),
    "tabby_policy_networkpolicies": (
        "gauge",
        "",
        "NetworkPolicies in the cluster the engine knows",
    ),
    "tabby_policy_rules": ("gauge", "", "nftables rules in the policy and endpoint chains"),
    "tabby_policy_sets": ("gauge", "", "nftables sets"),
    "tabby_policy_set_elements": ("gauge", "", "elements in the nftables sets"),
    "tabby_policy_applies_total": ("counter", "mode", "nftables transactions: full, incremental"),
    "tabby_policy_apply_errors_total": ("counter", "", "nftables transactions that failed"),
    "tabby_policy_apply_duration_seconds": (
        "histogram",
        "",
        "time to compute and program one policy change",
    ),
    "tabby_policy_last_apply_duration_seconds": ("gauge", "", "duration of the last apply"),
    "tabby_policy_packets_total": (
        "counter",
        "namespace, policy, direction, verdict, tier, rule, staged",
        "packets that opened a connection (or were denied) on this node, by the policy whose "
        "rule allowed them (verdict allow) or, policy default-deny, the namespace whose "
        "isolated pod denied them (verdict deny); direction ingress or egress; a Calico "
        "policy's per rule (tier, rule, verdict allow, deny, log or pass; staged true: what "
        "a staged policy would have decided, never enforced)",
    ),
    "tabby_policy_denied_flows_total": (
        "counter",
        "",
        "denied flows the kernel logged to tabby-node (once per flow in 10 s, at most 100 a "
        "second: tabbyctl policy log)",
    ),
    "tabby_policy_checks_total": (
        "counter",
        "",
        "periodic full computations checked against the incrementally kept policy state",
    ),
    "tabby_policy_check_fixes_total": (
        "counter",
        "",
        "differences those checks found and fixed (sets, elements, chains, programs): 0 "
        "unless a change was missed",
    ),
    # datastore
    "tabby_datastore_errors_total": (
        "counter",
        "op",
        "datastore errors tabby-node met: register, default_pools, tunnel_addresses, "
        "heartbeat, watch, health_check, cni (a served call answered 11 or 101)",
    ),
    "tabby_datastore_watch_resyncs_total": (
        "counter",
        "",
        "times the watch read its kinds again because the store could not say what changed "
        "(etcd's history compacted, a failed poll of the file store; behind tabby-typha: a "
        "snapshot, whole or of the buckets that differ, from a typha that could not resume "
        "it); the first read not counted; only the differences were applied",
    ),
    "tabby_datastore_watch_resumes_total": (
        "counter",
        "",
        "times the etcd watch streams were opened again after a break (member restarted, "
        "connection lost, no leader), every range from the last revision it had delivered "
        "(behind tabby-typha: reconnections typha resumed from its history): nothing read "
        "again",
    ),
    "tabby_datastore_synced": ("gauge", "", "1 when the watch has a snapshot and no error"),
    "tabby_datastore_requests_total": (
        "counter",
        "op, kind",
        "calls the agent made of its datastore (op: get, list, put, delete; kind: pool, "
        "block, affinity, node, ...); what its watch answered is not among them. On the "
        "Kubernetes datastore one call is one API request (a node's get: two)",
    ),
    "tabby_datastore_transactions_total": ("counter", "", "etcd transactions the agent sent"),
    "tabby_datastore_conflicts_total": (
        "counter",
        "",
        "compare-and-swap conflicts the agent met (then retried)",
    ),
    "tabby_datastore_retried_writes_total": (
        "counter",
        "outcome",
        "writes retried after an unknown outcome: applied, unknown",
    ),
    "tabby_datastore_fast_path_total": (
        "counter",
        "outcome",
        "served CNI calls' datastore operations: cached (read through the watch, no read of "
        "the datastore), retried (a write lost its compare-and-swap: the watch was behind), "
        "fresh (it failed on the watch's view: run again on the datastore's)",
    ),
    # the node
    "tabby_node_up": ("gauge", "", "1: tabby-node runs"),
    "tabby_node_info": ("gauge", "node, version, backend", "always 1; who this node is"),
    "tabby_node_start_time_seconds": ("gauge", "", "when tabby-node started (Unix time)"),
    "tabby_node_problems": ("gauge", "", "problems tabby-node reports in node status"),
    "tabby_http_refusals_total": (
        "counter",
        "path, code",
        "requests for what names pods or flows (/policy/log) refused: 401 (no credential "
        "accepted), 403 (authenticated, not allowed), 503 (the API server could not review)",
    ),
    "tabby_cluster_nodes": ("gauge", "", "live nodes this node sees (itself included)"),
}


def _help(name: str) -> str:
    return CATALOGUE[name][2]


def result_code(rc: int, out: bytes) -> str:
    """The CNI result code of a finished call: "0" on success, else the error JSON's code."""
    if rc == 0:
        return "0"
    try:
        code = json.loads(out).get("code")
    except (ValueError, AttributeError):
        return "unknown"
    return str(code) if type(code) is int else "unknown"


def verb_label(command: str) -> str:
    return command if command in VERBS else "other"


def op_label(what: str) -> str:
    return what.strip().replace(" ", "_").replace("-", "_") or "unknown"


# -- the metrics -------------------------------------------------------------------------------


class Metrics:
    """tabby-node's metrics: the registry, and the hooks that count events. The state a
    scrape reads comes from a :class:`NodeCollector` registered on :attr:`registry`."""

    def __init__(self) -> None:
        # no *_created series (this process has no other prometheus_client user)
        disable_created_metrics()  # type: ignore[no-untyped-call]
        #: when tabby-node started (``tabby_node_start_time_seconds``)
        self.started = time.time()
        self.registry = CollectorRegistry()
        r = self.registry
        self.cni_requests = Counter(
            "tabby_cni_requests", _help("tabby_cni_requests_total"), ["verb", "code"], registry=r
        )
        self.cni_duration = Histogram(
            "tabby_cni_request_duration_seconds",
            _help("tabby_cni_request_duration_seconds"),
            ["verb"],
            buckets=CNI_BUCKETS,
            registry=r,
        )
        self.cni_phases = Histogram(
            "tabby_cni_phase_duration_seconds",
            _help("tabby_cni_phase_duration_seconds"),
            ["verb", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.cni_cpu = Counter(
            "tabby_cni_cpu_seconds", _help("tabby_cni_cpu_seconds_total"), ["verb"], registry=r
        )
        for verb in VERBS:
            self.cni_requests.labels(verb=verb, code="0")
            self.cni_duration.labels(verb=verb)
            self.cni_cpu.labels(verb=verb)
        self.reconcile_passes = Counter(
            "tabby_reconcile_passes", _help("tabby_reconcile_passes_total"), registry=r
        )
        self.reconcile_failures = Counter(
            "tabby_reconcile_failures", _help("tabby_reconcile_failures_total"), registry=r
        )
        self.reconcile_duration = Histogram(
            "tabby_reconcile_duration_seconds",
            _help("tabby_reconcile_duration_seconds"),
            buckets=RECONCILE_BUCKETS,
            registry=r,
        )
        self.in_sync = Gauge(
            "tabby_dataplane_in_sync", _help("tabby_dataplane_in_sync"), registry=r
        )
        self.routes_programmed = Gauge(
            "tabby_routes_programmed", _help("tabby_routes_programmed"), ["kind"], registry=r
        )
        for kind in ROUTE_KINDS:
            self.routes_programmed.labels(kind=kind)
        self.neighbours = Gauge(
            "tabby_neighbours_programmed", _help("tabby_neighbours_programmed"), registry=r
        )
        self.fdb = Gauge(
            "tabby_fdb_entries_programmed", _help("tabby_fdb_entries_programmed"), registry=r
        )
        self.changes = Counter(
            "tabby_dataplane_changes",
            _help("tabby_dataplane_changes_total"),
            ["kind", "action"],
            registry=r,
        )
        self.problems = Gauge(
            "tabby_dataplane_problems", _help("tabby_dataplane_problems"), ["type"], registry=r
        )
        for kind in ("conflict", "failure"):
            self.problems.labels(type=kind)
        self.check_fixes = Counter(
            "tabby_routing_check_fixes",
            _help("tabby_routing_check_fixes_total"),
            ["what"],
            registry=r,
        )
        for what in ("kernel", "model", "bird"):
            self.check_fixes.labels(what=what)
        self.policy_apply = Histogram(
            "tabby_policy_apply_duration_seconds",
            _help("tabby_policy_apply_duration_seconds"),
            buckets=APPLY_BUCKETS,
            registry=r,
        )
        self.datastore_errors = Counter(
            "tabby_datastore_errors", _help("tabby_datastore_errors_total"), ["op"], registry=r
        )
        for op in DATASTORE_OPS:
            self.datastore_errors.labels(op=op)
        self.http_refusals = Counter(
            "tabby_http_refusals", _help("tabby_http_refusals_total"), ["path", "code"], registry=r
        )
        ProcessCollector(registry=r)

    # -- hooks (the loops, the routing backends, the call server) -------------------------------

    def cni_request(
        self,
        command: str,
        rc: int,
        out: bytes,
        seconds: float,
        phases: Mapping[str, float] | None = None,
        cpu: float | None = None,
    ) -> None:
        """One CNI call served (called once its answer is sent): its time, where the time
        went (``cni_protocol.phases``), the process's CPU while it ran."""
        try:
            verb = verb_label(command)
            code = result_code(rc, out)
            self.cni_requests.labels(verb=verb, code=code).inc()
            self.cni_duration.labels(verb=verb).observe(seconds)
            for phase, spent in (phases or {}).items():
                self.cni_phases.labels(verb=verb, phase=phase).observe(spent)
            if cpu is not None:
                self.cni_cpu.labels(verb=verb).inc(max(0.0, cpu))
            if code in {str(c) for c in DATASTORE_CODES}:
                self.datastore_errors.labels(op="cni").inc()
        except Exception:  # a metric never fails a call
            log.exception("metrics: cannot count a CNI call")

    def reconciled(self, seconds: float, ok: bool) -> None:
        self.reconcile_passes.inc()
        if not ok:
            self.reconcile_failures.inc()
        self.reconcile_duration.observe(seconds)
        self.in_sync.set(1 if ok else 0)

    def routes(self, programmed: Mapping[str, int], changes: Changes) -> None:
        """A routing pass: what is programmed now, and what this pass changed."""
        for kind, n in programmed.items():
            if kind == "fdb":
                self.fdb.set(n)
                continue
            if kind == "tunnel":
                self.neighbours.set(n)
            self.routes_programmed.labels(kind=kind).set(n)
        for kind, actions in changes.counts().items():
            for action, n in actions.items():
                if n:
                    self.changes.labels(kind=kind, action=action).inc(n)
        self.problems.labels(type="conflict").set(len(changes.conflicts))
        self.problems.labels(type="failure").set(len(changes.failures))

    def routing_checked(self, fixes: Mapping[str, int]) -> None:
        """The periodic routing check: what it had to fix, by kind."""
        for what, n in fixes.items():
            if n:
                self.check_fixes.labels(what=what).inc(n)

    def policy_applied(self, result: ApplyResult | None) -> None:
        """A policy sync or endpoint change: its duration when it programmed something."""
        if result is not None and result.changed:
            self.policy_apply.observe(result.seconds)

    def datastore_error(self, op: str) -> None:
        self.datastore_errors.labels(op=op_label(op)).inc()

    def http_refused(self, path: str, code: int) -> None:
        """A request for a private route refused (tabby_node.access)."""
        self.http_refusals.labels(path=path, code=str(code)).inc()

    # -- exposition ----------------------------------------------------------------------------

    def exposition(self, accept: str | None) -> tuple[str, bytes]:
        """(content type, body) for a scrape: Prometheus text, or OpenMetrics if asked."""
        encoder, content_type = choose_encoder(accept or "")
        return content_type, encoder(self.registry)


class Policy(Protocol):
    """The policy dataplane (``policy.state.PolicyDataplane``), as a scrape reads it."""

    @property
    def counters(self) -> PolicyCounters: ...

    def packet_counts(self) -> dict[CounterKey, tuple[int, int]]: ...


class NodeCollector(Collector):
    """The state a scrape reads, from the parts of a running tabby-node: who it is
    (``node``, ``backend``, since ``started``), its ``problems`` and the calls in flight
    (``calls``), the IPAM gauges from the ``cache`` (pool reservations ``reserved``: those of
    ``--conf``, as ``tabbyctl ipam show --conf`` counts them), BGP from the bird backend
    (``bgp``; None under the other backends), the ``policy`` dataplane and the
    ``denied_flows`` log, the ``store``'s counters and what the served calls did
    (``served``), what the node's servers refused (``refusals``). A section that fails is
    left out of that scrape (and logged)."""

    def __init__(
        self,
        *,
        node: str,
        backend: str,
        started: float,
        problems: Mapping[str, str],
        calls: CallServer,
        cache: Cache,
        reserved: Sequence[str] = (),
        bgp: BgpSpeaker | None = None,
        policy: Policy | None = None,
        denied_flows: DeniedFlows | None = None,
        store: object = None,
        watch: object = None,
        served: Served | None = None,
        refusals: Refusals | None = None,
    ) -> None:
        self.node = node
        self.backend = backend
        self.started = started
        self.problems = problems
        self.calls = calls
        self.cache = cache
        self.reserved = list(reserved)
        self.bgp = bgp
        self.policy = policy
        self.denied_flows = denied_flows
        self.store = store
        #: what the watch reads: tabby-typha's client (None: the store)
        self.watch = watch
        self.served = served
        self.refusals = refusals
        self._ipam_lock = threading.Lock()
        self._ipam_version: int | None = None
        self._ipam: IpamNumbers | None = None
        self._nodes = 0

    def collect(self) -> Iterator[Metric]:
        for section in (
            self._node_families,
            self._ipam_families,
            self._bgp_families,
            self._policy_families,
            self._datastore_families,
        ):
            try:
                yield from section()
            except Exception as e:  # a scrape shows what it can
                log.warning("metrics: %s failed: %s", section.__name__.strip("_"), e)

    def _node_families(self) -> Iterator[Metric]:
        yield _gauge("tabby_node_up", 1)
        info = GaugeMetricFamily(
            "tabby_node_info", _help("tabby_node_info"), labels=["node", "version", "backend"]
        )
        info.add_metric([self.node, __version__, self.backend], 1)
        yield info
        yield _gauge("tabby_node_start_time_seconds", self.started)
        yield _gauge("tabby_node_problems", len(self.problems))
        yield _gauge("tabby_cni_requests_in_flight", len(self.calls.inflight))
        refused = CounterMetricFamily(
            "tabby_connections_refused",
            _help("tabby_connections_refused_total"),
            labels=["server", "reason"],
        )
        counts = self.refusals.snapshot() if self.refusals is not None else {}
        for (server, reason), n in sorted(counts.items()):
            refused.add_metric([server, reason], n)
        yield refused

    def _ipam_numbers(self) -> IpamNumbers:
        cache = self.cache
        with self._ipam_lock:
            if self._ipam is None or cache.version != self._ipam_version:
                version = cache.version
                docs = cache.view()
                self._ipam = IpamNumbers(docs, self.node, self.reserved)
                self._nodes = live_nodes(docs, self.node)
                self._ipam_version = version
            return self._ipam

    def _ipam_families(self) -> Iterator[Metric]:
        numbers = self._ipam_numbers()
        fams = {
            name: GaugeMetricFamily(name, _help(name), labels=["pool"])
            for name in (
                "tabby_ipam_pool_size",
                "tabby_ipam_pool_reserved",
                "tabby_ipam_pool_addresses_in_use",
                "tabby_ipam_pool_addresses_free",
                "tabby_ipam_pool_blocks",
                "tabby_ipam_pool_disabled",
            )
        }
        per_node = {
            name: GaugeMetricFamily(name, _help(name), labels=["pool", "node"])
            for name in (
                "tabby_ipam_addresses_in_use",
                "tabby_ipam_addresses_borrowed",
                "tabby_ipam_blocks",
            )
        }
        for p in numbers.pools:
            fams["tabby_ipam_pool_size"].add_metric([p.cidr], p.total)
            fams["tabby_ipam_pool_reserved"].add_metric([p.cidr], p.reserved)
            fams["tabby_ipam_pool_addresses_in_use"].add_metric([p.cidr], p.in_use)
            fams["tabby_ipam_pool_addresses_free"].add_metric([p.cidr], p.free)
            fams["tabby_ipam_pool_blocks"].add_metric([p.cidr], p.blocks)
            fams["tabby_ipam_pool_disabled"].add_metric([p.cidr], 1 if p.disabled else 0)
            labels = [p.cidr, self.node]
            per_node["tabby_ipam_addresses_in_use"].add_metric(labels, numbers.in_use[p.cidr])
            per_node["tabby_ipam_addresses_borrowed"].add_metric(labels, numbers.borrowed[p.cidr])
            per_node["tabby_ipam_blocks"].add_metric(labels, numbers.blocks[p.cidr])
        yield from fams.values()
        yield from per_node.values()
        yield _gauge("tabby_cluster_nodes", self._nodes)

    def _bgp_families(self) -> Iterator[Metric]:
        states = dict.fromkeys(BGP_STATES, 0)
        up = 0
        restarts = 0
        announced = {"block": 0, "borrowed": 0}
        if self.bgp is not None:
            bird = self.bgp.bird
            restarts = bird.restarts
            up = 1 if bird.running() else 0
            if up:
                try:
                    for peer in bird.peers():
                        states[peer.state] = states.get(peer.state, 0) + 1
                except Exception as e:
                    log.debug("metrics: no BGP sessions from BIRD: %s", e)
            announced = self.bgp.announced()
        peers = GaugeMetricFamily("tabby_bgp_peers", _help("tabby_bgp_peers"), labels=["state"])
        for state, n in states.items():
            peers.add_metric([state], n)
        yield peers
        prefixes = GaugeMetricFamily(
            "tabby_bgp_announced_prefixes", _help("tabby_bgp_announced_prefixes"), labels=["kind"]
        )
        for kind, n in announced.items():
            prefixes.add_metric([kind], n)
        yield prefixes
        yield _gauge("tabby_bird_up", up)
        yield CounterMetricFamily(
            "tabby_bird_restarts", _help("tabby_bird_restarts_total"), value=restarts
        )

    def _policy_families(self) -> Iterator[Metric]:
        policy = self.policy
        c = policy.counters if policy is not None else None
        yield _gauge("tabby_policy_endpoints", c.endpoints if c else 0)
        yield _gauge("tabby_policy_networkpolicies", c.policies if c else 0)
        yield _gauge("tabby_policy_rules", c.rules if c else 0)
        yield _gauge("tabby_policy_sets", c.sets if c else 0)
        yield _gauge("tabby_policy_set_elements", c.set_elements if c else 0)
        yield _gauge("tabby_policy_last_apply_duration_seconds", c.last_apply_seconds if c else 0)
        applies = CounterMetricFamily(
            "tabby_policy_applies", _help("tabby_policy_applies_total"), labels=["mode"]
        )
        full = c.full_applies if c else 0
        applies.add_metric(["full"], full)
        applies.add_metric(["incremental"], (c.applies - full) if c else 0)
        yield applies
        yield CounterMetricFamily(
            "tabby_policy_apply_errors",
            _help("tabby_policy_apply_errors_total"),
            value=c.apply_errors if c else 0,
        )
        packets = CounterMetricFamily(
            "tabby_policy_packets",
            _help("tabby_policy_packets_total"),
            labels=["namespace", "policy", "direction", "verdict", "tier", "rule", "staged"],
        )
        for key, (n, _bytes) in sorted(policy.packet_counts().items() if policy else ()):
            staged = "true" if key.staged else "false"
            values = [key.namespace, key.policy, key.direction, key.verdict, key.tier, key.rule]
            packets.add_metric([*values, staged], n)
        yield packets
        flows = self.denied_flows
        yield CounterMetricFamily(
            "tabby_policy_denied_flows",
            _help("tabby_policy_denied_flows_total"),
            value=flows.last_seq if flows is not None else 0,
        )
        yield CounterMetricFamily(
            "tabby_policy_checks", _help("tabby_policy_checks_total"), value=c.checks if c else 0
        )
        yield CounterMetricFamily(
            "tabby_policy_check_fixes",
            _help("tabby_policy_check_fixes_total"),
            value=c.check_fixes if c else 0,
        )

    def _datastore_families(self) -> Iterator[Metric]:
        cache = self.cache
        store = self.store
        watched = self.watch if self.watch is not None else store
        # behind typha: its client's error (typha cannot be read) counts as the watch's
        watch_error = getattr(watched, "last_error", None)
        synced = cache.synced.is_set() and cache.last_error is None and watch_error is None
        sync_stats = getattr(watched, "sync_stats", None)
        watch: Mapping[str, int] = sync_stats if isinstance(sync_stats, Mapping) else {}
        yield CounterMetricFamily(
            "tabby_datastore_watch_resyncs",
            _help("tabby_datastore_watch_resyncs_total"),
            value=watch.get("rereads", 0),
        )
        yield CounterMetricFamily(
            "tabby_datastore_watch_resumes",
            _help("tabby_datastore_watch_resumes_total"),
            value=watch.get("resumes", 0),
        )
        yield _gauge("tabby_datastore_synced", 1 if synced else 0)
        requests = CounterMetricFamily(
            "tabby_datastore_requests",
            _help("tabby_datastore_requests_total"),
            labels=["op", "kind"],
        )
        counted = getattr(store, "requests", None)
        for (op, kind), n in sorted(counted.items() if isinstance(counted, Mapping) else ()):
            requests.add_metric([op, kind], n)
        yield requests
        store_stats = getattr(store, "stats", None)
        stats: dict[str, int] = dict(store_stats) if isinstance(store_stats, dict) else {}
        yield CounterMetricFamily(
            "tabby_datastore_transactions",
            _help("tabby_datastore_transactions_total"),
            value=stats.get("txns", 0),
        )
        yield CounterMetricFamily(
            "tabby_datastore_conflicts",
            _help("tabby_datastore_conflicts_total"),
            value=stats.get("conflicts", 0),
        )
        retried = CounterMetricFamily(
            "tabby_datastore_retried_writes",
            _help("tabby_datastore_retried_writes_total"),
            labels=["outcome"],
        )
        retried.add_metric(["applied"], stats.get("resolved", 0))
        retried.add_metric(["unknown"], stats.get("unknown", 0))
        yield retried
        served = self.served
        counts = served.counts.as_dict() if served is not None else {}
        fast = CounterMetricFamily(
            "tabby_datastore_fast_path",
            _help("tabby_datastore_fast_path_total"),
            labels=["outcome"],
        )
        for outcome in ("cached", "retried", "fresh"):
            fast.add_metric([outcome], counts.get(outcome, 0))
        yield fast


def _gauge(name: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, _help(name), value=value)


def metric_names(registry: CollectorRegistry) -> set[str]:
    """Every family and sample name the registry exports now (tests, conf-examples)."""
    names: set[str] = set()
    for family in registry.collect():
        names.add(family.name)
        names.update(s.name for s in family.samples)
        if family.type == "counter":
            names.add(family.name + "_total")
        elif family.type == "histogram":
            names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
    return names


__all__ = [
    "CATALOGUE",
    "Metrics",
    "NodeCollector",
    "metric_names",
    "result_code",
]
