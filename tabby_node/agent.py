"""tabby-node, the node agent (calico-node's role): registration, datastore watch, routing,
NetworkPolicy, and the CNI calls of the plugins.

Threads::

    watcher      store.sync() -> the cache (a fresh snapshot after a broken watch)
    heartbeat    this node's liveness document (ttl --node-ttl), every ttl/3; re-registers
                 the Node if an operator deleted it while the node runs
    dataplane    the one thread that changes the kernel: on every cache change (debounced)
                 it recomputes the cluster view and reconciles the routing backend (BIRD or
                 VXLAN) and the nftables table; it also programs a new pod's policy before
                 that pod's ADD answers (requests from the CNI threads)
    cni server   one thread per CNI call (tabby_node.server)
    http         /metrics, /liveness, /readiness, /policy/log
    policy log   denied flows from NFLOG into a ring (tabby_node.policylog)
    tracer       this node's half of a policy trace from another node (tabby_node.tracer)

The dataplane thread lives in tabby-node's own network namespace (the node's), so every
kernel change lands there even when the CNI thread asking for it has entered a caller's
namespace. Reconciling reads the kernel and changes only the difference (the overlay
reconciler, BIRD's configure, nftables transactions), so a restart adopts what is there.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
import logging
import os
import queue
import random
import socket
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypeVar

from bundle import __version__
from cni_protocol.errors import CniError, Code
from dataplane.errors import DataplaneError
from datastore.base import Doc, Store
from ipam.core.errors import DatastoreError, RevisionConflict
from policy.inputs import PolicyInputs, pod_key
from resources.index import ENDPOINTS, HEARTBEATS, NODES, PODS, POOLS, Change, Documents
from tabby_node.cache import WATCHED_KINDS, Cache
from tabby_node.cluster import Cluster, PoolInfo, Underlay, pool_info, vxlan_state
from tabby_node.facts import Facts
from tabby_node.options import NodeOptions
from tabby_node.status import RESYNC_SECONDS, StatusWriter

if TYPE_CHECKING:
    from http.server import ThreadingHTTPServer

    from bundle.types import IPAddress
    from cni_config.common import DatastoreSettings
    from cni_plugin.values import PluginValues
    from cni_protocol import skel
    from dataplane.nodeinfo import NodeAddress
    from dataplane.overlay_model import DesiredState
    from datastore import Served
    from policy.state import PolicyDataplane
    from tabby_node.metrics import Metrics
    from tabby_node.policylog import DeniedFlows
    from tabby_node.server import NodeServer
    from tabby_node.view import RoutingBackend

T = TypeVar("T")
#: A function for the dataplane thread, and where its outcome goes (ok, value or exception).
Request = tuple[Callable[[], object], "queue.Queue[tuple[bool, object]]"]

log = logging.getLogger("tabby.node")

TUNNEL_NETWORK = "tabby-tunnel"
DEBOUNCE_SECONDS = 0.02
ENDPOINT_WAIT_SECONDS = 10.0
#: How long a pod's ADD waits for tabby-kube-controllers to mirror the pod's labels.
MIRROR_WAIT_SECONDS = 10.0
#: The periodic check (everything recomputed and compared; the kernel reconciled whole, the
#: nftables table replaced): it repairs drift behind tabby's back. felix's default refresh.
CHECK_SECONDS = 90.0
#: After a failed pass, the check comes this soon.
RETRY_SECONDS = 1.0
#: The status file is rewritten at most this often after passes.
STATUS_SECONDS = 1.0


def _jittered(seconds: float) -> float:
    """``seconds`` +- 10 %: the nodes' checks do not fall into step."""
    return seconds * random.uniform(0.9, 1.1)  # noqa: S311 (spreading, not secrecy)


# -- the agent -------------------------------------------------------------------------------


class Agent:
    def __init__(self, options: NodeOptions, datastore: DatastoreSettings) -> None:
        self.options = options
        self.datastore = datastore
        self.store: Store | None = None
        self.cache = Cache(options.nodename)
        self.stopping = threading.Event()
        self.requests: queue.Queue[Request] = queue.Queue()
        self.facts: Facts | None = None
        self.policy: PolicyDataplane | None = None
        self.routing: RoutingBackend | None = None
        self.server: NodeServer | None = None
        self.threads: list[threading.Thread] = []
        self.last_reconcile: float = 0.0
        self.reconciles = 0
        self.reconcile_failures = 0
        self.loop_beat: dict[str, float] = {}
        self.problems: dict[str, str] = {}
        self.in_sync = False
        self.metrics: Metrics | None = None
        self.http_servers: list[ThreadingHTTPServer] = []
        self.mtu: int | None = None
        self.policy_memo = PolicyInputs()
        self.denied_flows: DeniedFlows | None = None
        self._status_due = False
        self._status_written = 0.0
        self._status_writer = StatusWriter()
        self.served: Served | None = None

    # -- start-up ------------------------------------------------------------------------

    def node_name(self) -> str:
        if self.options.nodename:
            return self.options.nodename
        from cni_config.values import node_name_problem

        try:
            with open(self.options.nodename_file, encoding="utf-8") as f:
                text = f.read().strip()
        except OSError:
            text = ""
        if text and node_name_problem(text) is None:
            return text
        return socket.gethostname().lower()

    def discover(self) -> Facts:
        from dataplane import nodeinfo

        name = self.node_name()
        v4: NodeAddress | None = None
        v6: NodeAddress | None = None
        try:
            v4 = nodeinfo.detect_address(self.options.node_ip, 4)
        except nodeinfo.AutodetectError as e:
            if self.options.backend != "none":
                raise CniError(
                    Code.INVALID_CONFIG, "cannot find the node's IPv4 address", str(e)
                ) from None
            log.warning("no node IPv4 address (%s); fine for --backend none", e)
        if self.options.node_ip6:
            try:
                v6 = nodeinfo.detect_address(self.options.node_ip6, 6)
            except nodeinfo.AutodetectError as e:
                raise CniError(
                    Code.INVALID_CONFIG, "cannot find the node's IPv6 address", str(e)
                ) from None
        uplink = nodeinfo.uplink_mtu([a for a in (v4, v6) if a is not None])
        ipip = nodeinfo.ipip_support()
        return Facts(name, v4, v6, uplink, ipip.available, ipip.reason)

    def start(self) -> None:
        """Everything up to serving: facts, state files, registration, first sync."""
        from datastore import open_store

        os.makedirs(self.options.run_dir, mode=0o755, exist_ok=True)
        os.makedirs(self.options.state_dir, mode=0o755, exist_ok=True)
        self.facts = facts = self.discover()
        self.cache.me = facts.name  # before the watch: whose Pods' stored forms are kept
        _write_file(self.options.nodename_file, facts.name + "\n")
        self.store = store = open_store(self.datastore)
        log.warning(
            "tabby-node %s: node %s, %s, backend %s, datastore %s",
            __version__,
            facts.name,
            ", ".join(str(a) for a in (facts.ipv4, facts.ipv6) if a) or "no underlay address",
            self.options.backend,
            self.datastore.describe(),
        )
        self._retry("register", lambda: self.register(store))
        self._retry("default pools", lambda: self.ensure_default_pools(store))
        self._spawn("watcher", self._watch)
        self._spawn("heartbeat", self._heartbeat)
        self.serve_calls(store)
        if not self.cache.synced.wait(self.datastore.lock_timeout_seconds):
            log.warning("no datastore snapshot yet: starting with an empty view")
        self._retry("tunnel addresses", lambda: self.ensure_tunnels(store))
        self.write_mtu()
        self.routing = routing = self._routing_backend()
        routing.start()
        from policy.state import PolicyDataplane

        visibility = self.options.policy_visibility == "on"
        self.policy = PolicyDataplane(facts.name, visibility=visibility)
        self.reconcile(full=True)
        if visibility:
            from tabby_node import policylog

            self.denied_flows = policylog.DeniedFlows(facts.name)
            policylog.start(self.policy, self.denied_flows, self.stopping, self.problems)
        from tabby_node import tracer

        tracer.start(facts.name, self.cache, store, self.stopping)

    def serve_calls(self, store: Store) -> None:
        """The CNI calls this node serves use its store (warm connections) when their
        configuration names the same datastore, read through what the watch and this
        node's own writes tell it (``datastore.cached``: a stale read costs a
        compare-and-swap retry, never a wrong answer)."""
        from datastore import Served
        from tabby_node.knowledge import Knowledge

        self.served = Served(self.datastore, store, Knowledge(self.cache))

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Datastore work at start-up: retried until it works or tabby-node is stopped
        (etcd may still be electing a leader, or not be up yet)."""
        delay = 0.2
        while True:
            try:
                value = fn()
            except DatastoreError as e:
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error(what)
                if self.stopping.is_set():
                    raise
                log.warning("%s: %s (retrying in %.1f s)", what, e, delay)
                self.problems[f"datastore: {what}"] = str(e)
                self.stopping.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            self.problems.pop(f"datastore: {what}", None)
            return value

    def _spawn(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=self._guarded, args=(name, fn), name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def _guarded(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("tabby-node: the %s loop failed", name)
            self.problems[f"loop {name}"] = "crashed (see the log)"

    # -- registration ----------------------------------------------------------------------

    def node_spec(self, existing: Mapping[str, Any] | None) -> dict[str, Any]:
        """The Node document: the operator's fields (labels, BGP AS, route reflector id)
        kept, tabby-node's own fields set from what it found."""
        facts = self.facts
        assert facts is not None
        data: dict[str, Any] = json.loads(json.dumps(existing or {}))
        meta = data.setdefault("metadata", {})
        meta["name"] = facts.name
        meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
        spec = data.setdefault("spec", {})
        spec["backend"] = self.options.backend
        for key, addr in (("ipv4Address", facts.ipv4), ("ipv6Address", facts.ipv6)):
            if addr is not None:
                spec[key] = str(addr)
            else:
                spec.pop(key, None)
        return data

    def register(self, store: Store) -> None:
        facts = self.facts
        assert facts is not None
        if facts.ipv4 is not None:
            for key, entry in Documents.read(store, (NODES,)).of(NODES).items():
                other = entry.value.spec.ipv4Address or ""
                same = other.split("/")[0] == str(facts.ipv4.address)
                if key != facts.name and same and store.get(HEARTBEATS.name, key) is not None:
                    raise CniError(
                        Code.INVALID_CONFIG,
                        f"node {key} already has address {facts.ipv4.address}",
                        "two nodes with one address would break routing: fix --node-ip",
                    )
        _cas(store, "node", facts.name, self.node_spec)
        self.beat(store)

    def beat(self, store: Store) -> None:
        """Liveness (``resources.heartbeat.beat``)."""
        from datastore.base import leases
        from resources.heartbeat import beat

        facts = self.facts
        assert facts is not None
        beat(leases(store), facts.name, self.options.node_ttl)

    def _heartbeat(self) -> None:
        store = self.store
        assert store is not None
        period = max(self.options.node_ttl / 3, 1.0)
        while not self.stopping.wait(period):
            self.loop_beat["heartbeat"] = time.monotonic()
            try:
                self.beat(store)
                facts = self.facts
                assert facts is not None
                # the watch says when the Node goes; the datastore confirms before acting
                if (
                    self.cache.get(NODES, facts.name) is None
                    and store.get("node", facts.name) is None
                ):
                    log.warning(
                        "the Node %s was deleted while it runs: registering again", facts.name
                    )
                    self.register(store)
                    self.ensure_tunnels(store)
                self.problems.pop("datastore: heartbeat", None)
            except DatastoreError as e:
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error("heartbeat")
                self.problems["datastore: heartbeat"] = str(e)
                log.warning("heartbeat: %s", e)

    def ensure_default_pools(self, store: Store) -> None:
        """A datastore without pools gets the default ones (Calico does the same)."""
        if store.list("pool"):
            return
        from resources.client import ResourceClient

        docs: list[dict[str, object]] = [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "IPPool",
                "metadata": {"name": "default-ipv4-ippool"},
                "spec": {"cidr": self.options.ipv4_pool, "blockSize": 26},
            }
        ]
        if self.options.ipv6_pool:
            docs.append(
                {
                    "apiVersion": "tabby.io/v1",
                    "kind": "IPPool",
                    "metadata": {"name": "default-ipv6-ippool"},
                    "spec": {"cidr": self.options.ipv6_pool, "blockSize": 122},
                }
            )
        try:
            ResourceClient(store).apply(docs)
            cidrs = [
                self.options.ipv4_pool,
                *([self.options.ipv6_pool] if self.options.ipv6_pool else []),
            ]
            log.warning("created the default pools: %s", ", ".join(cidrs))
        except (RevisionConflict, Exception) as e:  # another node was faster: theirs stand
            if store.list("pool"):
                return
            raise DatastoreError("cannot create the default pools", str(e)) from None

    def _vxlan_families(self, cluster: Cluster) -> list[int]:
        facts = self.facts
        assert facts is not None
        out = []
        for version, addr in ((4, facts.ipv4), (6, facts.ipv6)):
            if addr is None:
                continue
            if any(
                p.cidr.version == version and p.encap(self.options.backend)[0] == "vxlan"
                for p in cluster.pools
            ):
                out.append(version)
        return out

    def ensure_tunnels(self, store: Store) -> None:
        """The VXLAN tunnel address of each family in use (from IPAM, handle
        ``vxlan-tunnel-addr-<node>``, out of the node's own block) and the MAC, on the
        Node (felix's role)."""
        from dataplane.nodeinfo import vxlan_mac
        from ipam.core import AssignRequest, Ipam, handle_id

        facts = self.facts
        assert facts is not None
        cluster = Cluster.from_documents(self.cache.view(), facts.name)
        families = self._vxlan_families(cluster)
        if not families:
            return
        ipam = Ipam(store, facts.name)
        tunnels: dict[int, str] = {}
        for version in families:
            device = "vxlan.tabby" if version == 4 else "vxlan-v6.tabby"
            pools = [
                str(p.cidr)
                for p in cluster.pools
                if p.cidr.version == version
                and not p.disabled
                and p.encap(self.options.backend)[0] == "vxlan"
            ]
            req = AssignRequest(
                handle_id=handle_id(TUNNEL_NETWORK, f"vxlan-tunnel-addr-{facts.name}", device),
                attrs={"node": facts.name, "network": TUNNEL_NETWORK, "purpose": "vxlan-tunnel"},
                want_v4=version == 4,
                want_v6=version == 6,
                v4_pools=pools if version == 4 else (),
                v6_pools=pools if version == 6 else (),
            )
            (alloc,) = ipam.assign(req)
            tunnels[version] = str(alloc.ip)

        def change(existing: Mapping[str, Any] | None) -> dict[str, Any]:
            data = self.node_spec(existing)
            spec = data["spec"]
            for version, (addr_key, mac_key) in {
                4: ("ipv4VXLANTunnelAddr", "vxlanTunnelMACAddr"),
                6: ("ipv6VXLANTunnelAddr", "vxlanTunnelMACAddrV6"),
            }.items():
                if version in tunnels:
                    spec[addr_key] = tunnels[version]
                    spec[mac_key] = vxlan_mac(facts.name, version)
                else:
                    spec.pop(addr_key, None)
                    spec.pop(mac_key, None)
            return data

        doc = _cas(store, "node", facts.name, change)
        self.cache.put_local("node", facts.name, doc)

    def write_mtu(self) -> None:
        """``<state-dir>/mtu``: what a pod whose conflist says ``"mtu": 0`` gets."""
        from dataplane.nodeinfo import pod_mtu

        facts = self.facts
        assert facts is not None
        cluster = Cluster.from_documents(self.cache.view(), facts.name)
        families = self._vxlan_families(cluster)
        ipip = facts.ipip_available and any(
            p.encap(self.options.backend)[0] == "ipip" for p in cluster.pools
        )
        mtu = pod_mtu(facts.uplink_mtu, vxlan=4 in families, vxlan_v6=6 in families, ipip=ipip)
        self.mtu = mtu
        _write_file(self.options.mtu_file, f"{mtu}\n")

    # -- the loops -------------------------------------------------------------------------

    def _watch(self) -> None:
        store = self.store
        assert store is not None
        delay = 0.2
        while not self.stopping.is_set():
            try:
                for event in store.sync(WATCHED_KINDS, self.stopping):
                    self.cache.apply(event)
                    self.loop_beat["watcher"] = time.monotonic()
                    delay = 0.2
                    snapshot = event.type == "snapshot"
                    # not held until the next event (at rest: none for long): a snapshot
                    # holds every document the cache chose not to keep
                    del event
                    if snapshot:
                        _release_freed_memory()
            except DatastoreError as e:
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error("watch")
                self.cache.last_error = str(e)
                log.warning("datastore watch: %s (again in %.1f s)", e, delay)
                self.stopping.wait(delay)
                delay = min(delay * 2, 5.0)

    def run(self) -> None:
        """The dataplane loop: serve endpoint requests at once, a pass on change (a burst
        of watch events debounced into one; the pass costs what the changes touch), the
        whole check periodically (sooner again after a failed pass)."""
        next_check = time.monotonic() + _jittered(CHECK_SECONDS)
        cache = self.cache
        while not self.stopping.is_set():
            self.loop_beat["dataplane"] = time.monotonic()
            if cache.wake.wait(0.1):
                cache.wake.clear()
            self._serve_requests()
            ok = True
            if cache.changed.is_set():
                # Debounce, but a CNI call waiting for its pod's rules is never kept
                # waiting for it, nor for the pass its own endpoint write triggered.
                until = time.monotonic() + DEBOUNCE_SECONDS
                while (left := until - time.monotonic()) > 0:
                    if cache.wake.wait(left):
                        cache.wake.clear()
                        self._serve_requests()
                cache.changed.clear()
                self._serve_requests()
                ok = self.reconcile()
            now = time.monotonic()
            if now >= next_check:
                ok = self.reconcile(full=True)
                next_check = now + _jittered(CHECK_SECONDS)
            if not ok:  # what a failed pass took from the journal is redone by a check
                next_check = min(next_check, time.monotonic() + RETRY_SECONDS)
            self._maybe_write_status()

    def _serve_requests(self) -> None:
        while True:
            try:
                fn, reply = self.requests.get_nowait()
            except queue.Empty:
                return
            try:
                reply.put((True, fn()))
            except BaseException as e:  # handed to the waiting CNI thread
                reply.put((False, e))

    def on_dataplane_thread(self, fn: Callable[[], None], timeout: float) -> None:
        """Run ``fn`` on the dataplane thread (the node's network namespace) and wait."""
        reply: queue.Queue[tuple[bool, object]] = queue.Queue(maxsize=1)
        self.requests.put((fn, reply))
        self.cache.wake.set()
        ok, value = reply.get(timeout=timeout)
        if not ok:
            assert isinstance(value, BaseException)
            raise value

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
        assert self.routing is not None
        assert self.policy is not None
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
            self.policy_pass(changes, docs)
        except Exception as e:
            ok = False
            self.problems["policy"] = str(e)
            log.exception("policy pass failed")
        else:
            self.problems.pop("policy", None)
        if docs is not None or any(ch.kind == POOLS.name for ch in changes):
            self._ipip_notice([pool_info(p) for p in self.cache.values(POOLS)])
        self.reconciles += 1
        if not ok:
            self.reconcile_failures += 1
        self.in_sync = ok
        self.last_reconcile = time.monotonic() - start
        if self.metrics is not None:
            self.metrics.reconciled(self.last_reconcile, ok)
        self._status_due = True
        if full:
            self._write_status()
        return ok

    def _ipip_notice(self, pools: list[PoolInfo]) -> None:
        """A pool asks for IP-in-IP on a kernel without it: said once in the log, and kept
        in the status (node status) and in readiness while it lasts; the pool's routes stay
        direct."""
        facts = self.facts
        assert facts is not None
        wanted = [str(p.cidr) for p in pools if p.encap(self.options.backend)[0] == "ipip"]
        if not wanted or facts.ipip_available:
            self.problems.pop("ipip", None)
            return
        text = (
            f"pool(s) {', '.join(wanted)} ask for IP-in-IP, which this kernel cannot do "
            f"({facts.ipip_reason}); their routes stay direct"
        )
        if self.problems.get("ipip") != text:
            log.warning("%s", text)
        self.problems["ipip"] = text

    def policy_pass(self, changes: list[Change], docs: Documents | None) -> None:
        """The changed documents' updates to the policy dataplane (it sends their delta);
        with ``docs``, then the whole check from them (the first pass loads them)."""
        policy = self.policy
        assert policy is not None
        if policy.synced:
            updates = self.policy_memo.updates(changes)
            if updates:
                result = policy.update(updates)
                if self.metrics is not None:  # metrics
                    self.metrics.policy_applied(result)
        if docs is not None:
            state, nat = self.policy_memo.convert(docs)
            result = policy.sync(state, nat, full=True)
            if self.metrics is not None:  # metrics
                self.metrics.policy_applied(result)

    def _maybe_write_status(self) -> None:
        """The status file after passes, at most every ``STATUS_SECONDS`` (reading BIRD's
        sessions and the vxlan peers is not for every pod started anywhere), and at least
        every ``RESYNC_SECONDS``."""
        since = time.monotonic() - self._status_written
        if (self._status_due and since >= STATUS_SECONDS) or since >= RESYNC_SECONDS:
            self._write_status()

    def _write_status(self) -> None:
        self._status_due = False
        self._status_written = time.monotonic()
        facts = self.facts
        assert facts is not None
        assert self.routing is not None
        status: dict[str, object] = {
            "node": facts.name,
            "backend": self.options.backend,
            "node_ip": str(facts.ipv4.address) if facts.ipv4 else None,
            "node_ip6": str(facts.ipv6.address) if facts.ipv6 else None,
            "mtu": self.mtu,
            "ipip": {"available": facts.ipip_available, "reason": facts.ipip_reason},
            "updated": time.time(),
            "problems": dict(self.problems),
            "pid": os.getpid(),
        }
        status.update(self.routing.status())
        try:
            self._status_writer.write(self.options.run_dir, status)
        except OSError as e:
            log.warning("cannot write the status file: %s", e)

    # -- the no-window path: a pod's policy before its ADD answers -----------------------------

    def endpoint_added(self, key: str, doc: Doc | None) -> None:
        """The plugin recorded an endpoint (in a CNI thread): program its policy now
        (``doc``: as stored, when the cache may not have it yet)."""

        def program() -> None:
            if doc is not None:
                self.cache.put_local(ENDPOINTS.name, key, doc)
            self._program_endpoint(key)

        self.on_dataplane_thread(program, ENDPOINT_WAIT_SECONDS)

    def _program_endpoint(self, key: str) -> None:
        from policy import inputs

        # ``synced``, not ``state``: the state is every endpoint's inputs, materialised
        # (O(endpoints in the cluster): ~8 ms at 20,000, on the path of every ADD served)
        if self.policy is None or not self.policy.synced:
            return  # the first full sync will include it
        wep = self.cache.get(ENDPOINTS, key)
        if wep is None:
            return  # did not parse (logged): the next pass leaves it out as well
        pod = self.cache.get(PODS, pod_key(wep))
        result = self.policy.add_endpoint(
            inputs.endpoint(wep), inputs.pod(pod) if pod is not None else None
        )
        if self.metrics is not None:  # metrics
            self.metrics.policy_applied(result)

    def endpoint_removed(self, key: str) -> None:
        def unprogram() -> None:
            self.cache.put_local(ENDPOINTS.name, key, None)
            if self.policy is not None and self.policy.synced:
                namespace, _, name = key.partition("/")
                result = self.policy.remove_endpoint(namespace, name)
                if self.metrics is not None:  # metrics
                    self.metrics.policy_applied(result)

        self.on_dataplane_thread(unprogram, ENDPOINT_WAIT_SECONDS)

    # -- routing backends ------------------------------------------------------------------

    def _routing_backend(self) -> RoutingBackend:
        facts = self.facts
        assert facts is not None
        if self.options.backend == "bird":
            from tabby_node.routing import BirdRouting

            return BirdRouting(self)
        if self.options.backend == "vxlan":
            from tabby_node.routing import VxlanRouting

            return VxlanRouting(self)
        from tabby_node.routing import NoRouting

        return NoRouting(self)

    def underlay(self) -> Underlay:
        facts = self.facts
        assert facts is not None
        v4, v6 = facts.ipv4, facts.ipv6
        return Underlay(
            ipv4=ipaddress.IPv4Interface(f"{v4.address}/{v4.prefixlen}") if v4 else None,
            ipv6=ipaddress.IPv6Interface(f"{v6.address}/{v6.prefixlen}") if v6 else None,
            uplink_v4=facts.ipv4.interface if facts.ipv4 else None,
            uplink_v6=facts.ipv6.interface if facts.ipv6 else None,
            mtu=facts.uplink_mtu,
        )

    def vxlan_state(self, cluster: Cluster) -> DesiredState:
        facts = self.facts
        assert facts is not None
        return vxlan_state(cluster, facts.name, self.underlay(), self.options.backend)

    # -- stop ------------------------------------------------------------------------------

    def stop(self, *, stop_bird: bool = True) -> None:
        self.stopping.set()
        if self.server is not None:
            self.server.stop()
        from tabby_node import http

        http.stop(self)
        if self.routing is not None:
            with contextlib.suppress(Exception):
                self.routing.stop(stop_bird=stop_bird)
        for t in self.threads:
            t.join(timeout=2)
        if self.store is not None:
            with contextlib.suppress(Exception):
                self.store.close()


# -- helpers ----------------------------------------------------------------------------------


def _write_file(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _cas(
    store: Store, kind: str, key: str, change: Callable[[Mapping[str, Any] | None], dict[str, Any]]
) -> Doc:
    """The core's compare-and-swap (``datastore.cas.update``) over ``change(data)``;
    returns what the document holds afterwards."""
    from datastore.cas import update

    written: list[dict[str, Any]] = []

    def apply(doc: Doc | None) -> dict[str, Any] | None:
        data = change(doc.data if doc is not None else None)
        written[:] = [data]
        return None if doc is not None and doc.data == data else data

    rev = update(store, kind, key, apply)
    assert rev is not None
    return Doc(written[0], rev)


# -- main ----------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    import sys

    from cni_protocol import log as cni_log
    from daemon.signals import stop_on_signals
    from tabby_node import options as node_options

    try:
        options, datastore = node_options.parse(argv)
    except CniError as e:
        print(f"tabby-node: {e}", file=sys.stderr)
        return 2
    cni_log.setup_resident(options.log_level, options.log_file)
    if os.geteuid() != 0:
        print("tabby-node: must run as root", file=sys.stderr)
        return 1
    from tabby_node.server import NodeServer, warm_up

    t0 = time.perf_counter()
    warm_up()
    agent = Agent(options, datastore)
    server = NodeServer(options.socket_path, mtu_file=options.mtu_file)
    if options.metrics_port:  # metrics: before start-up, so that start-up is counted too
        from tabby_node import metrics

        agent.metrics = server.metrics = metrics.create(agent)
    try:
        server.claim()
    except SystemExit as e:
        print(e, file=sys.stderr)
        return 1
    with stop_on_signals(agent.stopping):
        try:
            agent.start()
        except (CniError, DataplaneError, DatastoreError) as e:
            print(f"tabby-node: {e}", file=sys.stderr)
            server.stop()
            agent.stop()
            return 1
        except Exception as e:
            log.exception("tabby-node failed to start")
            print(f"tabby-node: failed to start: {type(e).__name__}: {e}", file=sys.stderr)
            server.stop()
            agent.stop()
            return 1
        if agent.stopping.is_set():
            server.stop()
            agent.stop()
            return 0
        from tabby_node import http

        http.start(agent)
        assert agent.served is not None
        server.serve(agent.served, AgentEndpoints(agent))
        server.bind()
        agent.server = server
        agent._spawn("cni server", server.serve_forever)
        log.warning(
            "tabby-node %s serving %s (ready in %.0f ms)",
            __version__,
            options.socket_path,
            (time.perf_counter() - t0) * 1000,
        )
        try:
            agent.run()
        finally:
            agent.stop()
            log.warning("tabby-node stopped after %d calls", server.served)
    return 0


class AgentEndpoints:
    """tabby-node's endpoint recorder: the plugin's (the WorkloadEndpoint in the datastore),
    then the pod's policy programmed by the agent before the ADD answers."""

    def __init__(self, agent: Agent) -> None:
        from cni_plugin.plugin import DatastoreEndpoints

        self.agent = agent
        self.inner = DatastoreEndpoints(agent.served)

    def added(
        self,
        args: skel.CmdArgs,
        conf: PluginValues,
        addresses: list[IPAddress],
        host_ifname: str,
    ) -> None:
        self.wait_mirrored(args)
        # the write was learnt by the served store's knowledge: the cache holds it now
        key = self.inner.record(args, conf, addresses, host_ifname)
        try:
            self.agent.endpoint_added(key, None)
        except Exception as e:
            raise CniError(
                Code.DATAPLANE, "cannot program the pod's network policy", str(e)
            ) from None

    def wait_mirrored(self, args: skel.CmdArgs) -> None:
        """No window: in Kubernetes mode the pod's rules must come from its labels, which
        tabby-kube-controllers mirror. Hold the ADD (bounded) until they are here; with the
        controllers down the pod starts at once, unlabelled until they arrive."""
        from cni_protocol.args import parse_cni_args

        cni_args = parse_cni_args(args.args)
        name = cni_args.get("K8S_POD_NAME", "")
        if not name:
            return
        namespace = cni_args.get("K8S_POD_NAMESPACE") or "default"
        uid = cni_args.get("K8S_POD_UID", "")
        started = time.monotonic()
        if not self.agent.cache.wait_mirrored(namespace, name, uid, MIRROR_WAIT_SECONDS):
            log.warning(
                "pod %s/%s: its labels were not mirrored within %.0f s: starting it with what "
                "the datastore has (its rules follow when they arrive)",
                namespace,
                name,
                MIRROR_WAIT_SECONDS,
            )
        elif time.monotonic() - started > 0.05:
            log.info(
                "pod %s/%s: waited %.0f ms for its labels",
                namespace,
                name,
                (time.monotonic() - started) * 1000,
            )

    def removed(self, args: skel.CmdArgs, conf: PluginValues) -> None:
        key = self.inner.erase(args, conf)
        if key is not None:
            with contextlib.suppress(Exception):
                self.agent.endpoint_removed(key)


def _release_freed_memory() -> None:
    """Give the C allocator's free pages back to the system (glibc's ``malloc_trim``): the
    bytes a snapshot's documents were read into are freed once the cache has parsed them,
    but stay in this thread's malloc arena otherwise."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
