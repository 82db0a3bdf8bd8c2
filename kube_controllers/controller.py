"""tabby-kube-controllers: the Kubernetes API mirrored into tabby's datastore (calico-kube-
controllers' role in etcd mode).

Threads::

    reflector <kind>   list + watch one kind of Kubernetes object (``reflector``); every
                       replica keeps them warm, so a standby that takes over starts at once
    elector            the Lease (``leader``); only the holder writes
    worker             the holder's writes: one key at a time, the difference between a
                       reflector's object and the datastore (``mirror``); a key that failed
                       (datastore unreachable) is tried again with back-off
    datastore nodes    watches tabby's Nodes, so a node that registers gets its labels at once
    housekeeping       the holder's liveness document (``_kube-controllers``, read by
                       tabby-node), the ``ipam`` controller's pass (``ipamgc``) every 30 s, and
                       a full comparison every 5 min (nothing should be found: it is counted)
    http               /liveness, /readiness, /metrics

On becoming the holder (and after each relist) every key of every kind is compared once, so
changes made while no replica led (controllers down, restarted, a new leader) converge:
mirrored documents whose object is gone are deleted.

On the Kubernetes datastore (``datastore_type: kubernetes``) nothing is mirrored and nothing
periodic is written (no liveness document: tabby-node reads the pods from the API itself):
the reflectors are the ipam controller's (Nodes, Pods), the worker's writer is
``collect.NodeCollector`` (a deleted Kubernetes Node's tabby Node), and housekeeping runs the
ipam pass; leader election is the same.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
from typing import TYPE_CHECKING

from daemon.limits import Refusals
from datastore.base import leases
from datastore.errors import DatastoreError, RevisionConflict
from kube_controllers import mirror
from kube_controllers.leader import Elector
from kube_controllers.options import LEASE_NAME, ControllerOptions
from kube_controllers.reflector import Reflector
from stores.kube.client import ApiError, KubeClient, KubeConfig

if TYPE_CHECKING:
    from http.server import ThreadingHTTPServer

    from cni_config.common import DatastoreSettings
    from datastore.base import Store
    from kube_controllers.ipamgc import IpamGc
    from kube_controllers.metrics import Metrics

log = logging.getLogger("tabby.controllers")

HEARTBEAT_EVERY = 5.0
HEARTBEAT_TTL = 15.0
IPAM_EVERY = 30.0
RESYNC_EVERY = 300.0
RETRY = (0.5, 10.0)


class Controllers:
    def __init__(self, options: ControllerOptions, datastore: DatastoreSettings) -> None:
        self.options = options
        self.datastore = datastore
        self.stopping = threading.Event()
        self.store: Store | None = None
        self.api: KubeClient | None = None
        self.reflectors: dict[str, Reflector] = {}
        self.elector: Elector | None = None
        self.leading = threading.Event()
        self.mirror: mirror.Writer | None = None
        #: the store is the Kubernetes API itself: collect, never mirror
        self.kubernetes_datastore = datastore.datastore_type == "kubernetes"
        self.ipam: IpamGc | None = None
        self.metrics: Metrics | None = None
        self.http_servers: list[ThreadingHTTPServer] = []
        self.threads: list[threading.Thread] = []
        self.loop_beat: dict[str, float] = {}
        self.problems: dict[str, str] = {}
        self.events: collections.Counter[str] = collections.Counter()
        #: what the HTTP endpoints refused at their limits (``daemon.limits``)
        self.refusals = Refusals()
        self.resync_fixes = 0
        self._queue: dict[tuple[str, str], float] = {}  # (kind, key) -> not before (monotonic)
        self._cond = threading.Condition()

    # -- start-up -------------------------------------------------------------------------------

    def start(self) -> None:
        from resources.client import ResourceClient
        from resources.mirror import KUBERNETES
        from stores import open_store

        self.api = api = KubeClient(KubeConfig.load(self.options.kubeconfig))
        self.store = store = open_store(self.datastore)
        wanted = set(self.options.controllers)
        writer: mirror.Writer
        if self.kubernetes_datastore:
            from kube_controllers.collect import NodeCollector

            writer = NodeCollector(store, api)
        else:
            writer = mirror.Mirror(store, ResourceClient(store, owner=KUBERNETES))
        self.mirror = writer
        kinds = [k for k in mirror.KINDS if k in wanted and k in writer.kinds]
        if "ipam" in wanted:  # it reads Nodes and Pods, mirrored or not
            kinds += [k for k in ("node", "pod") if k not in kinds]
        for kind in kinds:
            path = mirror.KINDS[kind][0]
            self.reflectors[kind] = Reflector(
                api, kind, path, mirror.PROJECTIONS[kind], self._changed, on_event=self._event
            )
        if "ipam" in wanted:
            from kube_controllers.ipamgc import IpamGc

            self.ipam = IpamGc(
                store,
                api,
                self.reflectors["node"],
                self.reflectors["pod"],
                self.options.node_grace,
                self.options.leak_grace,
                kubernetes_datastore=self.kubernetes_datastore,
            )
        log.warning(
            "tabby-kube-controllers: %s; API server %s (%s); datastore %s",
            ", ".join(self.options.controllers),
            api.config.server,
            api.config.source,
            self.datastore.describe(),
        )
        for kind, reflector in self.reflectors.items():
            self._spawn(f"reflector {kind}", reflector.run)
        if "node" in wanted and not self.kubernetes_datastore:
            self._spawn("datastore nodes", self._watch_tabby_nodes)
        self._spawn("worker", self._work)
        self._spawn("housekeeping", self._housekeeping)
        if self.options.typha_certs:
            self._spawn("typha certs", self._typha_certs)
        if self.options.leader_elect:
            self.elector = Elector(
                api,
                self.options.lease_namespace,
                LEASE_NAME,
                self.options.identity,
                on_change=self._leadership,
            )
            self._spawn("elector", self.elector.run)
        else:
            self._leadership(True)

    def _spawn(self, name: str, fn: object) -> None:
        def guarded() -> None:
            try:
                fn(self.stopping)  # type: ignore[operator]
            except Exception:
                log.exception("tabby-kube-controllers: the %s loop failed", name)
                self.problems[f"loop {name}"] = "crashed (see the log)"

        t = threading.Thread(target=guarded, name=name, daemon=True)
        self.threads.append(t)
        t.start()

    # -- events ---------------------------------------------------------------------------------

    def _event(self, kind: str) -> None:
        self.events[kind] += 1
        self.loop_beat[f"reflector {kind}"] = time.monotonic()

    def _changed(self, kind: str, key: str) -> None:
        if (
            self.mirror is not None
            and kind in self.mirror.kinds
            and kind in self.options.controllers
        ):
            self.enqueue(kind, key)

    def enqueue(self, kind: str, key: str, delay: float = 0.0) -> None:
        with self._cond:
            due = time.monotonic() + delay
            self._queue[(kind, key)] = min(self._queue.get((kind, key), due), due)
            self._cond.notify()

    def _leadership(self, leading: bool) -> None:
        if leading:
            self.leading.set()
            with self._cond:
                self._cond.notify_all()  # the worker sleeps while it does not lead
            self._beat()  # tabby-node waits for mirrored pods from now on (etcd mode)
            self.full_sync()
        else:
            self.leading.clear()
        if self.metrics is not None:
            self.metrics.leader.set(1 if leading else 0)

    def full_sync(self) -> int:
        """Every key of every mirrored kind queued (the reflectors' and the datastore's
        mirrored ones, so deletions missed while nobody led are found); how many."""
        assert self.mirror is not None
        count = 0
        for kind in mirror.KINDS:
            reflector = self.reflectors.get(kind)
            if reflector is None or kind not in self.options.controllers:
                continue
            if kind not in self.mirror.kinds:
                continue
            keys = set(reflector.keys())
            try:
                keys |= set(self.mirror.mirrored_keys(kind))
            except DatastoreError as e:
                log.warning("full sync of %s: %s", kind, e)
            for key in keys:
                self.enqueue(kind, key)
            count += len(keys)
        return count

    # -- the worker ------------------------------------------------------------------------------

    def _next(self) -> tuple[str, str] | None:
        with self._cond:
            while not self.stopping.is_set():
                if not self.leading.is_set():
                    # A standby keeps its queue (what it takes over with) but works none of
                    # it: it sleeps until it leads (_leadership wakes it). Waiting for the
                    # earliest due item instead spun it every 10 ms once one was due.
                    self._cond.wait(1.0)
                    continue
                now = time.monotonic()
                due = [(at, item) for item, at in self._queue.items() if at <= now]
                if due:
                    _, item = min(due)
                    del self._queue[item]
                    return item
                wait = min((at - now for at in self._queue.values()), default=1.0)
                self._cond.wait(max(0.01, min(wait, 1.0)))
        return None

    def _work(self, stop: threading.Event) -> None:
        assert self.mirror is not None
        failures: dict[tuple[str, str], int] = {}
        while (item := self._next()) is not None:
            self.loop_beat["worker"] = time.monotonic()
            kind, key = item
            reflector = self.reflectors[kind]
            if not reflector.synced.is_set():
                self.enqueue(kind, key, 0.5)  # absence means nothing before the first list
                continue
            try:
                self.mirror.sync(kind, key, reflector.get(key))
                failures.pop(item, None)
                self.problems.pop("datastore", None)
            except (DatastoreError, RevisionConflict) as e:
                n = failures[item] = failures.get(item, 0) + 1
                delay = min(RETRY[0] * 2 ** (n - 1), RETRY[1])
                self.problems["datastore"] = str(e)
                log.warning("mirroring %s %s: %s (again in %.1f s)", kind, key, e, delay)
                self.enqueue(kind, key, delay)

    def _watch_tabby_nodes(self, stop: threading.Event) -> None:
        """A tabby Node that appears (tabby-node registered it) gets its labels now."""
        assert self.store is not None
        while not stop.is_set():
            try:
                for event in self.store.sync(["node"], stop):
                    if event.type == "put":
                        self.enqueue("node", event.key)
                    elif event.type == "snapshot":
                        for key in (event.snapshot or {}).get("node", {}):
                            self.enqueue("node", key)
            except DatastoreError as e:
                self.problems["datastore"] = str(e)
                stop.wait(2.0)

    # -- housekeeping ------------------------------------------------------------------------------

    def _ipam_every(self) -> float:
        """The ipam pass: every 30 s, more often when a grace is short (a grace of a few
        seconds is meant to end in a few seconds)."""
        shortest = min(self.options.node_grace, self.options.leak_grace)
        return max(1.0, min(IPAM_EVERY, shortest / 3))

    def _housekeeping(self, stop: threading.Event) -> None:
        next_ipam = time.monotonic() + self._ipam_every()
        next_resync = time.monotonic() + RESYNC_EVERY
        tick = min(HEARTBEAT_EVERY, self._ipam_every())
        next_beat = 0.0
        while not stop.wait(tick):
            self.loop_beat["housekeeping"] = time.monotonic()
            if not self.leading.is_set():
                # a pass that failed while it led is no standby's problem: kept, it made
                # this replica unready for good (the pass runs only while leading)
                self.problems.pop("ipam", None)
                continue
            now = time.monotonic()
            if now >= next_beat:
                next_beat = now + HEARTBEAT_EVERY
                self._beat()
            synced = all(r.synced.is_set() for r in self.reflectors.values())
            if self.ipam is not None and synced and now >= next_ipam:
                next_ipam = now + self._ipam_every()
                try:
                    self.ipam.run_once()
                    self.problems.pop("ipam", None)
                except (DatastoreError, ApiError) as e:
                    self.problems["ipam"] = str(e)
                    log.warning("ipam controller: %s", e)
            if synced and now >= next_resync:
                next_resync = now + RESYNC_EVERY
                self.full_sync()

    def _typha_certs(self, stop: threading.Event) -> None:
        """tabby-typha's Secrets ensured now and every 12 h, by every replica (made only if
        absent: ``typha_certs``); tried again after 1 s doubling to 60 s while the API
        fails (the pods that mount them wait in ContainerCreating meanwhile)."""
        from kube_controllers import typha_certs

        assert self.api is not None
        namespace, delay = self.options.typha_certs, 1.0
        while not stop.is_set():
            try:
                done = typha_certs.ensure(self.api, namespace)
            except (ApiError, OSError, typha_certs.CertError) as e:
                self.problems["typha certs"] = str(e)
                log.warning("typha certificates in %s: %s (again in %.0f s)", namespace, e, delay)
                stop.wait(delay)
                delay = min(delay * 2, 60.0)
                continue
            self.problems.pop("typha certs", None)
            if done:
                log.warning("typha certificates in %s: %s", namespace, ", ".join(done))
            delay = 1.0
            stop.wait(typha_certs.CHECK_EVERY)

    def _beat(self) -> None:
        """The leader's liveness document: tabby-node waits for mirrored pods while it lives
        (none on the Kubernetes datastore: nothing is mirrored, the pods come from the API)."""
        from resources.heartbeat import CONTROLLERS_KEY, beat

        if self.kubernetes_datastore:
            return
        assert self.store is not None
        try:
            # Kept alive by its lease: every tabby-node watches heartbeats, and a rewrite
            # would be an event for each of them every beat. A new leader keeps the
            # previous one's document alive (it says the same: a leader lives).
            beat(leases(self.store), CONTROLLERS_KEY, HEARTBEAT_TTL)
        except (DatastoreError, RevisionConflict) as e:
            self.problems["datastore"] = str(e)

    def _drop_beat(self) -> None:
        from resources.heartbeat import CONTROLLERS_KEY, KIND

        if self.store is None or self.kubernetes_datastore:
            return
        with contextlib.suppress(DatastoreError):
            current = self.store.get(KIND, CONTROLLERS_KEY)
            if current is not None and current.data.get("pid") == os.getpid():
                self.store.delete(KIND, CONTROLLERS_KEY, current.revision)

    # -- health ----------------------------------------------------------------------------------

    def liveness(self) -> list[str]:
        return [f"{k}: {v}" for k, v in self.problems.items() if k.startswith("loop ")]

    def readiness(self) -> list[str]:
        reasons = self.liveness()
        for kind, r in self.reflectors.items():
            if not r.synced.is_set():
                reasons.append(
                    f"{kind}: not listed yet{f' ({r.last_error})' if r.last_error else ''}"
                )
        reasons += [f"{k}: {v}" for k, v in self.problems.items() if not k.startswith("loop ")]
        if self.elector is not None and self.elector.last_error:
            reasons.append(f"leader election: {self.elector.last_error}")
        return reasons

    def queue_length(self) -> int:
        with self._cond:
            return len(self._queue)

    # -- stop ------------------------------------------------------------------------------------

    def stop(self) -> None:
        self.stopping.set()
        with self._cond:
            self._cond.notify_all()
        # The elector first: it gives the Lease up on its way out, over the API client that
        # closing (which ends the watches) would take from under it.
        for t in self.threads:
            if t.name == "elector":
                t.join(timeout=5)
        if self.api is not None:
            self.api.close()
        for t in self.threads:
            t.join(timeout=5)
        if self.leading.is_set() and self.elector is None:
            self.leading.clear()
        self._drop_beat()
        if self.api is not None:
            # A connection a thread opened after the first close (a Lease given up late)
            # is closed too, not left to the garbage collector, whose ResourceWarning
            # would land in whatever runs then.
            self.api.close()
        from daemon.http import stop as stop_servers

        stop_servers(self.http_servers)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()


def main(argv: list[str] | None = None) -> int:
    import sys

    from cni_protocol import log as cni_log
    from cni_protocol.errors import CniError
    from daemon.signals import stop_on_signals
    from kube_controllers.options import parse

    try:
        options, datastore = parse(argv)
    except CniError as e:
        print(f"tabby-kube-controllers: {e}", file=sys.stderr)
        return 2
    cni_log.setup_resident(options.log_level, options.log_file)
    controllers = Controllers(options, datastore)
    if options.metrics_port:
        from kube_controllers.metrics import Metrics

        controllers.metrics = Metrics(controllers)
    with stop_on_signals(controllers.stopping):
        try:
            controllers.start()
        except (ApiError, DatastoreError, CniError) as e:
            print(f"tabby-kube-controllers: {e}", file=sys.stderr)
            controllers.stop()
            return 1
        _serve_http(controllers)
        while not controllers.stopping.wait(1.0):
            pass
        controllers.stop()
    log.warning("tabby-kube-controllers stopped")
    return 0


def _serve_http(controllers: Controllers) -> None:
    from daemon.http import Endpoints, serve

    options = controllers.options
    metrics = controllers.metrics.exposition if controllers.metrics is not None else None
    wanted = [("health", options.health_port, ["127.0.0.1"])]
    wanted.append(("metrics", options.metrics_port, ["127.0.0.1", *_pod_ip()]))
    for what, port, hosts in wanted:
        if not port:
            continue
        for host in hosts:
            try:
                controllers.http_servers.append(
                    serve(
                        host,
                        port,
                        Endpoints(controllers.liveness, controllers.readiness, metrics),
                        "tabby-kube-controllers",
                        refusals=controllers.refusals,
                        label=what,
                    )
                )
            except OSError as e:
                controllers.problems[f"http {what}"] = f"cannot listen on {host}:{port}: {e}"


def _pod_ip() -> list[str]:
    """Where Prometheus reaches a controller in a pod (``POD_IP`` from the downward API)."""
    ip = os.environ.get("POD_IP", "")
    return [ip] if ip and ip != "127.0.0.1" else []
