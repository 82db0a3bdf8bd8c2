"""tabby-node, the node agent (calico-node's role): registration, datastore watch, routing,
NetworkPolicy, and the CNI calls of the plugins. :func:`main` builds its parts, each
complete when made and given only what it uses, in the order a node starts, and runs it.

Threads::

    watcher      store.sync() -> the cache (a fresh snapshot after a broken watch;
                 tabby_node.watcher)
    heartbeat    this node's liveness document (ttl --node-ttl), every ttl/3; re-registers
                 the Node if an operator deleted it while the node runs
                 (tabby_node.registration)
    dataplane    the one thread that changes the kernel (tabby-node's main thread): on
                 every cache change (debounced) it reconciles the routing backend (BIRD or
                 VXLAN) and the nftables table; it also programs a new pod's policy before
                 that pod's ADD answers (requests from the CNI threads: tabby_node.passes,
                 tabby_node.pod_policy)
    cni server   one thread per CNI call (tabby_node.server)
    http         /metrics, /liveness, /readiness, /policy/log (tabby_node.http)
    policy log   denied flows from NFLOG into a ring (tabby_node.policylog)
    tracer       this node's half of a policy trace from another node (tabby_node.tracer)

Start-up: the node's facts (discovery), its name file, the store; the Node and its
heartbeat, the default pools (both retried until the datastore answers); the watcher and
heartbeat threads; the calls this node serves given its store; the first snapshot (waited
for, bounded); the VXLAN tunnel addresses, the MTU file; the routing backend, the policy
dataplane, the first full pass; the policy log and the tracer; then the HTTP endpoints, and
last the CNI socket. It stops in the order :class:`~tabby_node.lifecycle.Shutdown` says; in
Kubernetes (``--daemonset``) a stop that is an uninstall leaves the node clean for new pods
(``tabby_node.uninstall``).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, NamedTuple

from bundle import __version__
from cni_protocol.errors import CniError
from dataplane.errors import DataplaneError
from ipam.core.errors import DatastoreError
from tabby_node.lifecycle import Retry, Shutdown, Threads

if TYPE_CHECKING:
    import ssl

    from cni_config.common import DatastoreSettings
    from datastore.base import Store
    from fanout.client import TyphaSync
    from policy.state import PolicyDataplane
    from stores import Served
    from tabby_node import access
    from tabby_node.cache import Cache
    from tabby_node.facts import Facts
    from tabby_node.metrics import Metrics
    from tabby_node.options import NodeOptions
    from tabby_node.passes import DataplaneLoop, Requests
    from tabby_node.policylog import DeniedFlows
    from tabby_node.server import NodeServer
    from tabby_node.view import RoutingBackend

log = logging.getLogger("tabby.node")


def main(argv: list[str] | None = None) -> int:
    import sys

    from cni_protocol import log as cni_log
    from daemon.signals import stop_on_signals
    from tabby_node import options as node_options
    from tabby_node import server as call_server

    try:
        options, settings = node_options.parse(argv)
    except CniError as e:
        print(f"tabby-node: {e}", file=sys.stderr)
        return 2
    cni_log.setup_resident(options.log_level, options.log_file)
    if os.geteuid() != 0:
        print("tabby-node: must run as root", file=sys.stderr)
        return 1
    tls = None
    if options.metrics_cert_file and options.metrics_key_file:
        import ssl

        from tabby_node.http import tls_context

        try:  # a certificate that cannot be used is a start-up error, not a silent plain port
            tls = tls_context(
                options.metrics_cert_file, options.metrics_key_file, options.metrics_client_ca_file
            )
        except (OSError, ssl.SSLError) as e:
            print(f"tabby-node: the metrics port's TLS: {e}", file=sys.stderr)
            return 2

    t0 = time.perf_counter()
    call_server.warm_up()
    metrics: Metrics | None = None
    if options.metrics_port:  # metrics: before start-up, so that start-up is counted too
        from tabby_node.metrics import Metrics

        metrics = Metrics()
    try:
        run_dir = call_server.claim_run_dir(options.socket_path)
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 1
    stopping = threading.Event()
    problems: dict[str, str] = {}  # what node status and readiness report
    beats: dict[str, float] = {}  # loop -> when it last went round (liveness)
    shutdown = Shutdown(stopping)
    shutdown.on("socket", lambda: call_server.release_run_dir(options.socket_path, run_dir))
    threads = Threads(problems)
    shutdown.on("threads", threads.join)

    with stop_on_signals(stopping):
        try:
            node = start_up(
                options,
                settings,
                metrics=metrics,
                stopping=stopping,
                problems=problems,
                beats=beats,
                threads=threads,
                shutdown=shutdown,
            )
        except (CniError, DataplaneError, DatastoreError) as e:
            print(f"tabby-node: {e}", file=sys.stderr)
            shutdown.run()
            return 1
        except Exception as e:
            log.exception("tabby-node failed to start")
            print(f"tabby-node: failed to start: {type(e).__name__}: {e}", file=sys.stderr)
            shutdown.run()
            return 1
        if stopping.is_set():
            shutdown.run()
            return 0
        server = serve(
            options,
            settings,
            node,
            metrics=metrics,
            problems=problems,
            beats=beats,
            shutdown=shutdown,
            tls=tls,
        )
        server.bind()
        shutdown.on("socket", server.stop)
        threads.spawn("cni server", server.serve_forever)
        log.warning(
            "tabby-node %s serving %s (ready in %.0f ms)",
            __version__,
            options.socket_path,
            (time.perf_counter() - t0) * 1000,
        )
        try:
            node.passes.run()
        finally:
            shutdown.run()
            log.warning("tabby-node stopped after %d calls", server.served)
    return 0


class Node(NamedTuple):
    """What start-up made, for :func:`serve` and the dataplane loop."""

    facts: Facts
    cache: Cache
    store: Store
    served: Served
    routing: RoutingBackend
    policy: PolicyDataplane
    requests: Requests
    passes: DataplaneLoop
    denied_flows: DeniedFlows | None
    #: what the watcher reads: the store, or tabby-typha's client
    watch: Store | TyphaSync


def start_up(
    options: NodeOptions,
    settings: DatastoreSettings,
    *,
    metrics: Metrics | None,
    stopping: threading.Event,
    problems: dict[str, str],
    beats: dict[str, float],
    threads: Threads,
    shutdown: Shutdown,
) -> Node:
    """Everything up to serving, in this order: the node's facts, its name file, the
    store, the Node and heartbeat, the default pools, the watcher and heartbeat threads,
    the served calls' store, the first snapshot, the tunnel addresses, the MTU file, the
    routing backend, the policy dataplane and the first full pass, the policy log and the
    tracer. What it started is stopped by ``shutdown``."""
    from stores import open_store
    from tabby_node import policylog, tracer
    from tabby_node.cache import Cache
    from tabby_node.facts import discover, write_file
    from tabby_node.registration import Liveness, ensure_default_pools
    from tabby_node.tunnels import Tunnels
    from tabby_node.watcher import Watcher

    retry = Retry(stopping, problems, metrics)
    os.makedirs(options.run_dir, mode=0o755, exist_ok=True)
    os.makedirs(options.state_dir, mode=0o755, exist_ok=True)
    facts = discover(options)
    kubernetes = settings.datastore_type == "kubernetes"
    # before the watch: whose Pods' stored forms are kept
    cache = Cache(facts.name, pods_from_api=kubernetes)
    write_file(options.nodename_file, facts.name + "\n")
    store = open_store(settings)
    shutdown.on("store", lambda: _quietly(store.close))
    log.warning(
        "tabby-node %s: node %s, %s, backend %s, datastore %s",
        __version__,
        facts.name,
        ", ".join(str(a) for a in (facts.ipv4, facts.ipv6) if a) or "no underlay address",
        options.backend,
        settings.describe(),
    )
    tunnels = Tunnels(facts, options.backend, store, cache)
    liveness = Liveness(
        facts,
        options.backend,
        store,
        node_ttl=options.node_ttl,
        cache=cache,
        ensure_tunnels=tunnels.ensure,
        stopping=stopping,
        beats=beats,
        problems=problems,
        metrics=metrics,
        by_kubelet=kubernetes,
    )
    retry("register", liveness.register)
    retry(
        "default pools", lambda: ensure_default_pools(store, options.ipv4_pool, options.ipv6_pool)
    )
    source: Store | TyphaSync = store
    if options.typha:
        from tabby_node.typha import source as typha_source

        source = typha_source(options, facts.name, settings.kubeconfig, problems)
        log.warning("reading the cluster from tabby-typha, not the datastore's watch")
    watcher = Watcher(source, cache, stopping=stopping, beats=beats, metrics=metrics)
    threads.spawn("watcher", watcher.run)
    threads.spawn("heartbeat", liveness.run)
    served = serve_calls(settings, store, cache)
    if not cache.synced.wait(settings.lock_timeout_seconds):
        log.warning("no datastore snapshot yet: starting with an empty view")
    retry("tunnel addresses", tunnels.ensure)
    mtu = tunnels.write_mtu(options.mtu_file)

    from policy.state import PolicyDataplane
    from tabby_node import routing as routing_backends
    from tabby_node.node_status import StatusReport
    from tabby_node.passes import DataplaneLoop, IpipNotice, PolicyPass, Requests

    routing = routing_backends.choose(options.backend, facts, options.run_dir, metrics)
    shutdown.on("routing", lambda: _quietly(routing.stop))
    routing.start()
    visibility = options.policy_visibility == "on"
    from tabby_node.failsafes import node_failsafes

    api_server = getattr(store, "server", None) if kubernetes else None
    failsafes = node_failsafes(options, settings, api_server=api_server)
    log.info(
        "failsafe ports: in %s; out %s",
        ",".join(f.text() for f in failsafes.inbound),
        ",".join(f.text() for f in failsafes.outbound),
    )
    policy = PolicyDataplane(facts.name, visibility=visibility, failsafes=failsafes)
    requests = Requests(cache.wake)
    status = StatusReport(
        facts,
        backend=options.backend,
        mtu=mtu,
        problems=problems,
        routing=routing,
        run_dir=options.run_dir,
    )
    passes = DataplaneLoop(
        cache,
        routing,
        PolicyPass(policy, metrics),
        ipip=IpipNotice(facts, options.backend, problems),
        status=status,
        requests=requests,
        stopping=stopping,
        beats=beats,
        problems=problems,
        metrics=metrics,
    )
    passes.reconcile(full=True)
    if options.daemonset is not None:
        from tabby_node.uninstall import Uninstall

        shutdown.on(
            "uninstall",
            Uninstall(
                options.daemonset,
                options.cni_conf_dir,
                kubeconfig=settings.kubeconfig if kubernetes else None,
                store_removed=lambda: watcher.removed,
                delete_table=policy.delete_table,
            ),
        )
    denied_flows = None
    if visibility:
        denied_flows = policylog.DeniedFlows(facts.name)
        policylog.start(policy, denied_flows, stopping, problems)
    tracer.start(facts.name, cache, store, stopping)
    return Node(
        facts, cache, store, served, routing, policy, requests, passes, denied_flows, source
    )


def serve(
    options: NodeOptions,
    settings: DatastoreSettings,
    node: Node,
    *,
    metrics: Metrics | None,
    problems: dict[str, str],
    beats: dict[str, float],
    shutdown: Shutdown,
    tls: ssl.SSLContext | None = None,
) -> NodeServer:
    """The call server (not bound yet: :meth:`NodeServer.bind`) with the per-pod policy,
    the state the metrics read, and the HTTP endpoints (serving already, the metrics port
    over ``tls`` when given; stopped by ``shutdown``)."""
    from daemon.limits import Refusals
    from tabby_node import http
    from tabby_node.pod_policy import PodEndpoints, PodPolicy
    from tabby_node.server import NodeServer

    pods = PodPolicy(node.cache, node.policy, node.requests, metrics)
    refusals = Refusals()  # limits: what the node socket and the HTTP endpoints refused
    server = NodeServer(
        options.socket_path,
        endpoints=PodEndpoints(node.cache, pods, node.served),
        stores=node.served,
        mtu_file=options.mtu_file,
        metrics=metrics,
        claimed=True,
        limits=options.call_limits,
        refusals=refusals,
    )
    if metrics is not None:
        from tabby_node.metrics import NodeCollector
        from tabby_node.options import conf_reserved
        from tabby_node.routing import BirdRouting

        routing = node.routing
        metrics.registry.register(
            NodeCollector(
                node=node.facts.name,
                backend=options.backend,
                started=metrics.started,
                problems=problems,
                calls=server,
                cache=node.cache,
                reserved=conf_reserved(options.conf),
                bgp=routing if isinstance(routing, BirdRouting) else None,
                policy=node.policy,
                denied_flows=node.denied_flows,
                store=node.store,
                watch=node.watch,
                served=node.served,
                refusals=refusals,
            )
        )
    health = http.Health(
        node_ttl=options.node_ttl,
        datastore=settings,
        passes=node.passes,
        routing=node.routing,
        beats=beats,
        problems=problems,
        metrics=metrics,
    )
    ipv4 = node.facts.ipv4
    servers = http.start(
        health,
        health_port=options.health_port,
        metrics_port=options.metrics_port,
        node_ip=str(ipv4.address) if ipv4 is not None else None,
        exposition=metrics.exposition if metrics is not None else None,
        denied_flows=node.denied_flows,
        problems=problems,
        refusals=refusals,
        guard=_door(options, settings, node.facts.name, metrics, shutdown),
        tls=tls,
    )
    shutdown.on("http", lambda: http.stop(servers))
    return server


def _door(
    options: NodeOptions,
    settings: DatastoreSettings,
    node: str,
    metrics: Metrics | None,
    shutdown: Shutdown,
) -> access.Door:
    """Who may read the policy log from elsewhere (tabby_node.access): client certificates
    (when the metrics port asks for them), and bearer tokens when a Kubernetes API reviews
    them (the datastore's, else the pod's service account)."""
    from tabby_node import access

    kubeconfig = settings.kubeconfig if settings.datastore_type == "kubernetes" else None
    client = access.kube_client(kubeconfig)
    reviewer = None
    if client is not None:
        shutdown.on("http", client.close)  # after the servers (the last added goes first)
        reviewer = access.TokenReviewer(client, node, options.log_audiences)
    return access.Door(
        client_cns=options.log_client_cns if options.metrics_client_ca_file else (),
        reviewer=reviewer,
        refused=metrics.http_refused if metrics is not None else None,
    )


def serve_calls(settings: DatastoreSettings, store: Store, cache: Cache) -> Served:
    """The CNI calls this node serves use its store (warm connections) when their
    configuration names the same datastore, read through what the watch and this node's
    own writes tell it (``datastore.cached``: a stale read costs a compare-and-swap retry,
    never a wrong answer)."""
    from stores import Served
    from tabby_node.knowledge import Knowledge

    return Served(settings, store, Knowledge(cache))


def _quietly(step: Callable[[], object]) -> None:
    """``step()``, whatever it raises (stopping goes on)."""
    with contextlib.suppress(Exception):
        step()
