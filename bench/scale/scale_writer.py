#!/usr/bin/env python3
"""The datastore writer of bench/scale/scale_bench.py: the simulated cluster's contents and its
churn, written by tabby's own code paths. Started inside the control node's namespace,
driven by JSON lines on stdin, answering on stdout. Not meant to be run by hand.

What it writes, and through what:

- a simulated node registers as tabby-node does: its ``Node`` through tabby-node's own
  ``registration.node_spec`` and compare-and-swap, then ``Tunnels.ensure`` (the VXLAN tunnel
  address from IPAM, which claims the node's block, and the MAC, on the Node); its
  heartbeat is the simulated node's own (bench/scale/scale_sim.py);
- a pod ADD on a simulated node is the CNI call tabby-node serves, run through the same
  handlers (``cni_plugin.plugin.Plugin`` with tabby-node's in-process tabby-ipam and the
  datastore endpoint recorder): IPAM handle and block allocation, WorkloadEndpoint; only the
  kernel is left out (``NoKernel``: a simulated node has none). In Kubernetes mode the Pod
  is mirrored first, as tabby-kube-controllers do when it is scheduled
  (``kube_controllers.mirror``), and again once it has its address (``status.podIPs``);
- a DEL is the CNI DEL through the same handlers (WorkloadEndpoint, allocation, handle),
  then the Pod's mirror deleted;
- NetworkPolicies and Namespaces as the controllers mirror them (Kubernetes mode) or as
  ``tabbyctl apply`` writes them; the pool as ``tabbyctl apply`` writes it.

Every write's revision and start time is recorded (``EtcdStore._apply`` is wrapped in
this process only), so that the bench can tell when each one reached every watcher.

Each simulated node's conflist names one of several client ports of the same etcd
(``lanes``): tabby's node-local store lock is per endpoint list, so nodes on different
lanes write concurrently, as separate machines would.
"""

from __future__ import annotations

import base64
import concurrent.futures
import ipaddress
import json
import os
import random
import secrets
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from datastore.etcd import client as etcd_client
from datastore.etcd import store as etcd_store

if TYPE_CHECKING:
    from stores import Stores

NETWORK = "k8s-pod-network"
PROBE_NAMESPACE = "bench-probe"
CHURN_LABELS = {"app": "churn"}
STATIC_LABELS = {"app": "static"}
PROBE_LABELS = {"role": "probe"}

_OP = threading.local()  # the current operation's write log
_WRITES: list[list[Any]] = []  # every write while recording (any thread)
_WRITES_LOCK = threading.Lock()
_RECORDING = threading.Event()


def now() -> float:
    return time.monotonic()


# == every write's revision ========================================================================


def _instrument() -> None:
    """Record (kind, raw key, revision, start) of every write this process makes."""
    txn = etcd_client.EtcdClient.txn
    apply = etcd_store.EtcdStore._apply

    def recording_txn(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = txn(self, *args, **kwargs)
        _OP.txn_revision = result.revision if result.succeeded else 0
        return result

    def recording_apply(self: Any, w: Any) -> Any:
        t0 = now()
        _OP.txn_revision = 0
        out = apply(self, w)
        log = getattr(_OP, "log", None)
        rev = getattr(_OP, "txn_revision", 0) or out
        if rev and (log is not None or _RECORDING.is_set()):
            records = [[w.kind, base64.b64encode(self._key(w.kind, w.key)).decode(), rev, t0]]
            if log is not None:
                log.extend(records)
            if _RECORDING.is_set():
                with _WRITES_LOCK:
                    _WRITES.extend(records)
        return out

    etcd_client.EtcdClient.txn = recording_txn  # type: ignore[method-assign]
    etcd_store.EtcdStore._apply = recording_apply  # type: ignore[method-assign]


class Op:
    """One operation's record: what it was and every write it made."""

    def __init__(self, kind: str, **info: Any) -> None:
        self.record: dict[str, Any] = {"op": kind, **info, "writes": []}

    def __enter__(self) -> dict[str, Any]:
        self.record["t0"] = now()
        _OP.log = self.record["writes"]
        return self.record

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.record["t1"] = now()
        _OP.log = None
        if exc is not None:
            self.record["error"] = f"{type(exc).__name__}: {exc}"


# == a simulated node's CNI calls, through tabby-node's handlers ===================================


def cni_env(verb: str, pod: dict[str, Any], extra: str = "") -> dict[str, str]:
    """A simulated pod's CNI call environment (``pod``: cid, namespace, name, uid)."""
    return {
        "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
        "CNI_COMMAND": verb,
        "CNI_CONTAINERID": pod["cid"],
        "CNI_NETNS": f"/run/netns/tbysim-{pod['cid'][:12]}",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": "/opt/cni/bin",
        "CNI_ARGS": f"K8S_POD_NAMESPACE={pod['namespace']};K8S_POD_NAME={pod['name']};"
        f"K8S_POD_UID={pod['uid']}" + (f";{extra}" if extra else ""),
    }


class NoKernel:
    """The dataplane of a simulated node: it has no kernel; tabby's handlers do the rest."""

    def setup(self, spec: Any, addresses: Any = None) -> Any:
        from dataplane.model import SetupResult

        if addresses is not None:
            addresses()
        return SetupResult(
            host_ifname=spec.host_ifname,
            host_mac="ee:ee:ee:ee:ee:ee",
            host_index=1,
            container_ifname=spec.ifname,
            container_mac="02:00:00:00:00:01",
            container_index=1,
            routes=(),
        )

    def teardown(
        self, netns_path: Any, ifname: str, host_ifname: str, addresses: Any = None
    ) -> None:
        return None


class Writer:
    def __init__(self, cfg: dict[str, Any], stores: Stores | None = None) -> None:
        """``stores``: where the simulated nodes' CNI calls do their datastore work (a store
        of each call's own by default, the lane its conflist names)."""
        from cni_plugin.plugin import DatastoreEndpoints, Plugin
        from tabby_node.server import InProcessIpam

        self.cfg = cfg
        self.prefix: str = cfg["prefix"]
        self.pool: str = cfg["pool"]
        self.kubernetes: bool = cfg["kubernetes"]
        self.lanes: list[str] = cfg["lanes"]  # etcd URLs, one per lane
        self.handlers = Plugin(
            dataplane=NoKernel,
            ipam=InProcessIpam(stores),
            endpoints=DatastoreEndpoints(stores),
            validate_first=True,
        ).handlers()
        self.lane_locks = [threading.Lock() for _ in self.lanes]
        self.pool_exec = concurrent.futures.ThreadPoolExecutor(max_workers=len(self.lanes))
        self.store = etcd_store.EtcdStore(cfg["endpoint"], prefix=self.prefix)
        # the Pod mirror writes of a node go through its lane too (tabby's store lock is
        # per endpoint: one shared store would serialise every lane behind it)
        self.lane_stores = [etcd_store.EtcdStore(url, prefix=self.prefix) for url in self.lanes]
        self.pods: dict[str, dict[str, Any]] = {}  # churn pods alive: name -> pod
        self.pods_lock = threading.Lock()
        self.seq = 0
        self.fresh_block = 0  # blocks counted down from the top of the pool
        self.policy_gen = 0
        self.sims: list[str] = []
        self.lane_of: dict[str, int] = {}

    # -- helpers ---------------------------------------------------------------------------

    def lane(self, node: str) -> int:
        if node not in self.lane_of:
            self.lane_of[node] = len(self.lane_of) % len(self.lanes)
        return self.lane_of[node]

    def conflist(self, node: str, prev: dict[str, Any] | None = None) -> bytes:
        conf: dict[str, Any] = {
            "cniVersion": "1.0.0",
            "name": NETWORK,
            "type": "tabby",
            "nodename": node,
            "mtu": 1450,
            "log_level": "warning",
            "log_file_path": self.cfg["cni_log"],
            "ipam": {
                "type": "tabby-ipam",
                "assign_ipv4": True,
                "assign_ipv6": False,
                "ipv4_pools": [self.pool],
                "datastore_type": "etcdv3",
                "etcd_endpoints": [self.lanes[self.lane(node)]],
                "etcd_prefix": self.prefix,
                "lock_timeout_seconds": 30,
            },
        }
        if prev is not None:
            conf["prevResult"] = prev
        return json.dumps(conf).encode()

    def cni(self, verb: str, pod: dict[str, Any], extra: str = "") -> dict[str, Any] | None:
        from cni_protocol import skel

        env = cni_env(verb, pod, extra)
        stdin = self.conflist(pod["node"], pod.get("result") if verb == "DEL" else None)
        rc, out = skel.run(self.handlers, env, stdin)
        if rc != 0:
            raise RuntimeError(f"{verb} {pod['namespace']}/{pod['name']}: {out[:300]!r}")
        return json.loads(out) if out.strip() else None

    def mirror(self, store: Any = None) -> Any:
        from kube_controllers.mirror import Mirror
        from resources.client import ResourceClient
        from resources.mirror import KUBERNETES

        store = store or self.store
        mirrors = getattr(_OP, "mirrors", None)
        if mirrors is None:
            mirrors = _OP.mirrors = {}
        m = mirrors.get(id(store))
        if m is None or m.store is not store:
            m = mirrors[id(store)] = Mirror(store, ResourceClient(store, owner=KUBERNETES))
        return m

    def k8s_pod(self, pod: dict[str, Any], ips: list[str]) -> dict[str, Any]:
        obj: dict[str, Any] = {
            "metadata": {
                "name": pod["name"],
                "namespace": pod["namespace"],
                "uid": pod["uid"],
                "labels": pod["labels"],
            },
            "spec": {
                "nodeName": pod["node"],
                "containers": [{"name": "web", "ports": [{"name": "http", "containerPort": 8080}]}],
            },
        }
        if ips:
            obj["status"] = {"podIPs": [{"ip": ip} for ip in ips]}
        return obj

    def mirror_pod(self, pod: dict[str, Any], ips: list[str] | None) -> None:
        """The Pod as tabby-kube-controllers mirror it (None: deleted); outside Kubernetes
        mode, the labels as an operator applies them (once)."""
        from kube_controllers.mirror import project_pod

        key = f"{pod['namespace']}/{pod['name']}"
        store = self.lane_stores[self.lane(pod["node"])]
        if self.kubernetes:
            desired = None if ips is None else project_pod(self.k8s_pod(pod, ips))
            self.mirror(store).sync("pod", key, desired)
            return
        from resources.client import ResourceClient

        client = ResourceClient(store)
        if ips is None:
            client.delete("Pod", pod["name"], pod["namespace"])
        elif not ips:
            doc = {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {
                    "name": pod["name"],
                    "namespace": pod["namespace"],
                    "labels": pod["labels"],
                },
            }
            client.apply([doc])

    def namespace(self, name: str) -> None:
        from kube_controllers.mirror import project_namespace

        obj = {"metadata": {"name": name, "uid": secrets.token_hex(8)}}
        if self.kubernetes:
            self.mirror().sync("namespace", name, project_namespace(obj))
            return
        from resources.client import ResourceClient

        ResourceClient(self.store).apply(
            [{"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}]
        )

    def policy(self, namespace: str, name: str, spec: dict[str, Any]) -> None:
        from kube_controllers.mirror import project_policy

        obj = {"metadata": {"name": name, "namespace": namespace, "uid": name}, "spec": spec}
        if self.kubernetes:
            self.mirror().sync("policy", f"{namespace}/{name}", project_policy(obj))
            return
        from resources.client import ResourceClient

        doc = {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": name, "namespace": namespace},
            "spec": spec,
        }
        ResourceClient(self.store).apply([doc], replace=True)

    def new_pod(
        self, node: str, namespace: str, name: str, labels: dict[str, str]
    ) -> dict[str, Any]:
        return {
            "node": node,
            "namespace": namespace,
            "name": name,
            "uid": secrets.token_hex(16),
            "cid": secrets.token_hex(32),
            "labels": dict(labels),
        }

    # -- operations ----------------------------------------------------------------------------

    def add(self, pod: dict[str, Any], extra: str = "") -> list[str]:
        """A pod's ADD on its (simulated) node, as the kubelet and tabby-node make it."""
        with self.lane_locks[self.lane(pod["node"])]:
            self.mirror_pod(pod, [])  # scheduled: the Pod (its labels) is there first
            result = self.cni("ADD", pod, extra)
            pod["result"] = result
            ips = [ip["address"].split("/")[0] for ip in (result or {}).get("ips", [])]
            if self.kubernetes:
                self.mirror_pod(pod, ips)  # the kubelet reports its address
            return ips

    def delete(self, pod: dict[str, Any]) -> None:
        with self.lane_locks[self.lane(pod["node"])]:
            self.cni("DEL", pod)
            self.mirror_pod(pod, None)

    def register(self, node: str, index: int) -> None:
        """A simulated node's registration, as tabby-node's start-up writes it."""
        from dataplane.nodeinfo import NodeAddress
        from stores import open_store
        from tabby_node import options as node_options
        from tabby_node.cache import Cache
        from tabby_node.facts import Facts
        from tabby_node.registration import cas, node_spec
        from tabby_node.tunnels import Tunnels

        lane = self.lanes[self.lane(node)]
        argv = [
            a.replace("{node}", node).replace("{endpoint}", lane) for a in self.cfg["node_argv"]
        ]
        options, datastore = node_options.parse(argv)
        address = ipaddress.ip_address(self.cfg["sim_underlay"]) + index
        facts = Facts(node, NodeAddress(address, 16, None), None, 1500, False, "")
        cache = Cache(node)
        store = open_store(datastore)
        try:
            cas(store, "node", node, lambda existing: node_spec(facts, options.backend, existing))
            for key, doc in store.list("pool"):
                cache.put_local("pool", key, doc)
            Tunnels(facts, options.backend, store, cache).ensure()
        finally:
            store.close()

    # -- commands --------------------------------------------------------------------------------

    def setup(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The pool, the namespaces, the simulated nodes with their pods, the probe
        namespace and its standing policy."""
        from resources.client import ResourceClient

        t0 = now()
        ResourceClient(self.store).apply(
            [
                {
                    "apiVersion": "tabby.io/v1",
                    "kind": "IPPool",
                    "metadata": {"name": "bench-pool"},
                    "spec": {"cidr": self.pool, "blockSize": 26},
                }
            ]
        )
        namespaces = [f"bench-ns-{i}" for i in range(int(cmd["namespaces"]))]
        for ns in [*namespaces, PROBE_NAMESPACE]:
            self.namespace(ns)
        self.policy(
            PROBE_NAMESPACE,
            "probe-from-churn",
            {
                "podSelector": {"matchLabels": PROBE_LABELS},
                "ingress": [
                    {
                        "from": [
                            {"namespaceSelector": {}, "podSelector": {"matchLabels": CHURN_LABELS}}
                        ]
                    }
                ],
            },
        )
        self.marker_policy()
        self.sims = list(cmd["sims"])
        for node in self.sims:
            self.lane(node)
        pods_per_node = int(cmd["pods_per_node"])
        failures: list[str] = []

        def one(item: tuple[int, str]) -> None:
            index, node = item
            try:
                self.register(node, index)
                for j in range(pods_per_node):
                    ns = namespaces[(index * pods_per_node + j) % len(namespaces)]
                    pod = self.new_pod(node, ns, f"{node}-p{j}", STATIC_LABELS)
                    self.add(pod)
            except Exception as e:
                failures.append(f"{node}: {type(e).__name__}: {e}")

        if cmd.get("populate") == "bulk":
            self.populate(pods_per_node, namespaces)
        else:
            list(self.pool_exec.map(one, enumerate(self.sims)))
        if failures:
            raise RuntimeError(f"{len(failures)} nodes failed to set up: {failures[:3]}")
        return {"setup_s": round(now() - t0, 1), "revision": self.revision()}

    def populate(self, pods_per_node: int, namespaces: list[str]) -> None:
        """The simulated nodes and their pods in bulk (bench/scale/scale_populate.py): the same
        documents ``register`` and ``add`` write, made in memory by the same code."""
        import scale_populate

        argv = [a.replace("{endpoint}", self.cfg["endpoint"]) for a in self.cfg["node_argv"]]
        made = scale_populate.populate(
            self.store,
            self.sims,
            pool=self.pool,
            pods_per_node=pods_per_node,
            namespaces=namespaces,
            node_argv=argv,
            underlay=self.cfg["sim_underlay"],
            kubernetes=self.kubernetes,
            labels=STATIC_LABELS,
        )
        print(f"writer: bulk {made}", file=sys.stderr, flush=True)

    def marker_policy(self) -> dict[str, Any]:
        """The policy whose ipBlock changes every time (its CIDR: a new nft set element)."""
        k = self.policy_gen
        self.policy_gen += 1
        cidr = f"10.{99 - k // 256}.{k % 256}.0/24"
        with Op("policy", cidr=cidr) as rec:
            self.policy(
                PROBE_NAMESPACE,
                "probe-marker",
                {
                    "podSelector": {"matchLabels": PROBE_LABELS},
                    "ingress": [{"from": [{"ipBlock": {"cidr": cidr}}]}],
                },
            )
        return rec

    def probe_pod(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """The labels of a probe's own pod, before the bench ADDs it on the probe."""
        pod = self.new_pod(cmd["node"], PROBE_NAMESPACE, cmd["name"], PROBE_LABELS)
        pod["uid"] = cmd["uid"]
        self.mirror_pod(pod, [])
        if self.kubernetes and cmd.get("ips"):
            self.mirror_pod(pod, cmd["ips"])
        return {"ok": True}

    def wep_key(self, pod: dict[str, Any]) -> str:
        """The raw etcd key of the pod's WorkloadEndpoint (written by the plugin on a
        thread of its own: found among all writes by this key)."""
        from resources.wep import KIND, endpoint_key

        key = endpoint_key(pod["namespace"], pod["node"], pod["name"], "eth0")
        return base64.b64encode(self.store.raw_key(KIND, key)).decode()

    def next_fresh_block(self) -> ipaddress.IPv4Network:
        pool = ipaddress.ip_network(self.pool)
        blocks = 1 << (26 - pool.prefixlen)
        while True:
            self.fresh_block += 1
            index = blocks - self.fresh_block
            if index < 0:
                raise RuntimeError("no unclaimed block left in the bench pool")
            block = ipaddress.ip_network(f"{pool.network_address + index * 64}/26")
            if self.store.get("block", str(block)) is None:
                return block

    def block_op(self, node: str | None = None) -> dict[str, Any]:
        """A new pod that claims a new block (CNI_ARGS IP= an address in a block nobody
        has): every other node must route the block."""
        node = node or random.choice(self.sims)  # noqa: S311 - a benchmark, not crypto
        block = self.next_fresh_block()
        ip = str(block.network_address + 1)
        self.seq += 1
        pod = self.new_pod(node, "bench-ns-0", f"block-{self.seq}", CHURN_LABELS)
        with Op("block", node=node, block=str(block), ip=ip) as rec:
            self.add(pod, extra=f"IP={ip}")
        with self.pods_lock:
            self.pods[pod["name"]] = pod
        return rec

    def add_op(self) -> dict[str, Any]:
        node = random.choice(self.sims)  # noqa: S311 - a benchmark, not crypto
        self.seq += 1
        ns = f"bench-ns-{self.seq % max(1, int(self.cfg['namespaces']))}"
        pod = self.new_pod(node, ns, f"churn-{self.seq}", CHURN_LABELS)
        with Op("add", node=node, pod=f"{ns}/{pod['name']}") as rec:
            rec["wep_key"] = self.wep_key(pod)
            rec["ips"] = self.add(pod)
        with self.pods_lock:
            self.pods[pod["name"]] = pod
        return rec

    def del_op(self) -> dict[str, Any] | None:
        with self.pods_lock:
            if not self.pods:
                return None
            name = next(iter(self.pods))
            pod = self.pods.pop(name)
        with Op("del", node=pod["node"], pod=f"{pod['namespace']}/{name}") as rec:
            self.delete(pod)
            rec["ips"] = [
                ip["address"].split("/")[0] for ip in (pod.get("result") or {}).get("ips", [])
            ]
        return rec

    def churn(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Pod changes at ``rate`` a second (ADD and DEL alternating, open loop: an
        operation starts on schedule whether or not the last one finished), a block claim
        every ``block_every`` s, a policy change every ``policy_every`` s."""
        rate = float(cmd["rate"])
        duration = float(cmd["duration"])
        block_every = float(cmd.get("block_every") or 0)
        policy_every = float(cmd.get("policy_every") or 0)
        t0 = now()
        schedule: list[tuple[float, str]] = []
        n = int(duration * rate)
        schedule += [(i / rate, "add" if i % 2 == 0 else "del") for i in range(n)]
        if block_every:
            schedule += [
                (block_every * (i + 0.5), "block") for i in range(int(duration / block_every))
            ]
        if policy_every:
            schedule += [
                (policy_every * (i + 0.25), "policy") for i in range(int(duration / policy_every))
            ]
        schedule.sort()
        futures = []
        late = 0.0
        with _WRITES_LOCK:
            _WRITES.clear()
        _RECORDING.set()
        for offset, kind in schedule:
            wait = t0 + offset - now()
            if wait > 0:
                time.sleep(wait)
            else:
                late = max(late, -wait)
            fn = {
                "add": self.add_op,
                "del": self.del_op,
                "block": self.block_op,
                "policy": self.marker_policy,
            }[kind]
            futures.append((offset, self.pool_exec.submit(_safe, fn)))
        ops = []
        for offset, fut in futures:
            rec = fut.result()
            if rec is not None:
                rec["scheduled"] = t0 + offset
                ops.append(rec)
        _RECORDING.clear()
        with _WRITES_LOCK:
            writes = list(_WRITES)
            _WRITES.clear()
        return {"ops": ops, "writes": writes, "t0": t0, "t1": now(), "late_s": round(late, 3)}

    def revision(self) -> int:
        status = self.store.client.status(deadline=now() + 10)
        return int(status.get("header", {}).get("revision", 0))

    def compact(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """Compact etcd's history up to its current revision (as an operator's or the API
        server's compaction does)."""
        client = etcd_client.EtcdClient([cmd.get("endpoint") or self.cfg["endpoint"]], timeout=30)
        try:
            status = client.status(deadline=now() + 30)
            rev = int(status.get("header", {}).get("revision", 0))
            client.call("/v3/kv/compaction", {"revision": str(rev), "physical": True})
        finally:
            client.close()
        return {"compacted": rev}

    def marker(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """A new block claimed by a simulated node: the write every watcher (and every
        probe's routing table) must see."""
        endpoint = cmd.get("endpoint")
        if endpoint:  # the outage scenario: etcd answers only on a side port
            saved = self.lanes, self.store, self.lane_stores
            self.lanes = [endpoint] * len(self.lanes)
            self.store = etcd_store.EtcdStore(endpoint, prefix=self.prefix)
            self.lane_stores = [self.store] * len(self.lanes)
            try:
                return self.block_op(cmd.get("node"))
            finally:
                self.store.close()
                self.lanes, self.store, self.lane_stores = saved
        return self.block_op(cmd.get("node"))

    def handle(self, cmd: dict[str, Any]) -> dict[str, Any]:
        op = cmd["op"]
        if op == "setup":
            return self.setup(cmd)
        if op == "churn":
            return self.churn(cmd)
        if op == "marker":
            return self.marker(cmd)
        if op == "policy":
            return self.marker_policy()
        if op == "compact":
            return self.compact(cmd)
        if op == "probe_pod":
            return self.probe_pod(cmd)
        if op == "revision":
            return {"revision": self.revision()}
        raise RuntimeError(f"unknown command {op!r}")


def _safe(fn: Any) -> Any:
    try:
        return fn()
    except Exception as e:
        return {"op": getattr(fn, "__name__", "?"), "error": f"{type(e).__name__}: {e}"}


def main() -> int:
    cfg = json.loads(Path(sys.argv[1]).read_text())
    from cni_protocol import log as cni_log

    cni_log.setup_resident("warning", cfg["cni_log"])
    _instrument()
    writer = Writer(cfg)
    out = sys.stdout
    for line in sys.stdin:
        if not line.strip():
            continue
        cmd = json.loads(line)
        if cmd.get("op") == "stop":
            break
        try:
            reply = {"id": cmd.get("id"), **writer.handle(cmd)}
        except Exception as e:
            reply = {"id": cmd.get("id"), "error": f"{type(e).__name__}: {e}"}
        out.write(json.dumps(reply, separators=(",", ":")) + "\n")
        out.flush()
    writer.pool_exec.shutdown(wait=True)
    writer.store.close()
    for store in writer.lane_stores:
        store.close()
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
