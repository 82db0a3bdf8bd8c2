"""manifests/tabby.yaml's RBAC is what each component calls, no more: each component's own
code runs against the in-memory API server (tests/kube_fake.py), whose request log is read
as verbs on resources; every request is granted by the component's ClusterRole (and Role),
and every rule (each verb on each resource) is used by one of its requests.

- the CNI plugins without tabby-node (service account tabby-cni): tabby-ipam's ADD, CHECK,
  DEL, GC and STATUS in-process on the Kubernetes datastore (tabby itself writes nothing
  there: ``cni_plugin.plugin.DatastoreEndpoints``);
- tabby-node: registering its Node, the default pools, its watch of every kind it keeps,
  the IPAM of the calls it serves, its VXLAN tunnel address, policy trace answers (and an
  expired one met on the way), the review of a bearer token for ``/policy/log`` (a
  TokenReview and a SubjectAccessReview), and what that review allows its own token (the
  ``nodes/policylog`` of another node: tabbyctl in its pod reads other nodes' logs);
- tabby-kube-controllers, in both datastores the manifest can run (one role serves both):
  the program itself, leading, with its node and ipam controllers (the Kubernetes
  datastore) or every controller (etcd mode, the same calls to the API as with any other
  store), releasing a gone node's blocks and a leaked address, and removing a deleted node's
  tabby Node.

The Kubernetes tier checks the same roles against a real API server's RBAC
(tests/kubernetes/test_manifest.py)."""

from __future__ import annotations

import ipaddress
import json
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from cni_config.common import DatastoreSettings
from cni_protocol import skel
from daemon.http import Caller
from dataplane.nodeinfo import NodeAddress
from datastore.base import SyncEvent
from ipam import plugin as ipam_plugin
from stores import Served
from stores.kube import kinds
from stores.kube import store as kube_store
from stores.kube.client import KubeClient, KubeConfig
from stores.kube.store import KubeStore
from tests.kube_fake import FakeApi, fake_api, node, pod
from tests.rbac import NAMESPACE, Atom, Call, call_of, granted

POOL = "10.50.0.0/24"
NODE = "node-a"


def check_least_privilege(account: str, calls: set[Call]) -> None:
    atoms = granted(account)
    assert atoms, f"nothing granted to {account}"
    denied = sorted(c for c in calls if not any(a.grants(c) for a in atoms))
    assert not denied, f"{account} is denied what it calls: {denied}"
    unused = sorted(
        (a.group, a.resource, a.verb, sorted(a.names))
        for a in atoms
        if not any(a.grants(c) for c in calls)
    )
    assert not unused, f"{account} is granted what it never calls: {unused}"


# -- the fake API and the stores ---------------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[FakeApi, str]]:
    """The fake API server and a kubeconfig for it (what the installer writes, minus the
    token: the fake checks none)."""
    monkeypatch.setattr(kube_store, "DEFAULT_LOCK_DIR", str(tmp_path / "locks"))
    with fake_api() as (fake, url):
        path = tmp_path / "kubeconfig"
        path.write_text(
            json.dumps(
                {
                    "clusters": [{"name": "k", "cluster": {"server": url}}],
                    "users": [{"name": "u", "user": {}}],
                    "contexts": [{"name": "c", "context": {"cluster": "k", "user": "u"}}],
                    "current-context": "c",
                }
            )
        )
        yield fake, str(path)


def settings(kubeconfig: str) -> DatastoreSettings:
    return DatastoreSettings(datastore_type="kubernetes", kubeconfig=kubeconfig)


def store_of(kubeconfig: str, tmp_path: Path) -> KubeStore:
    client = KubeClient(KubeConfig.from_kubeconfig(kubeconfig), timeout=5.0)
    return KubeStore(client, lock_timeout=5.0, lock_dir=str(tmp_path / "locks"))


def seed(fake: FakeApi) -> None:
    """What is there before a component runs (written as kubectl would: not logged)."""
    fake.put(
        kinds.CRDS["pool"].path,
        kinds.to_object(
            "pool",
            POOL,
            {"cidr": POOL, "block_size": 30, "disabled": False, "name": "default-ipv4-ippool"},
            None,
        ),
    )
    ready = node(NODE)
    ready["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    fake.put(kinds.V1_NODES, ready)


def calls(fake: FakeApi) -> set[Call]:
    return {call_of(r) for r in fake.requests}


def wait(what: str, cond: Callable[[], object], timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.05)


# -- the CNI plugins -----------------------------------------------------------------------------


def cni_calls(kubeconfig: str, handlers: skel.Handlers) -> None:
    """A node's CNI calls: ADDs that fill one block and claim a second, CHECK, DELs, GC (which
    finds an empty block of a deleted pool, left by a killed claim) and STATUS."""
    conf = {
        "cniVersion": "1.1.0",
        "name": "net",
        "type": "tabby",
        "nodename": NODE,
        "log_file_path": "/dev/null",
        "ipam": {
            "type": "tabby-ipam",
            "datastore_type": "kubernetes",
            "kubeconfig": kubeconfig,
            "ipv4_pools": [POOL],
            "block_size_ipv4": 30,
        },
    }

    def cni(command: str, cid: str = "", **extra: Any) -> Any:
        env = {
            "CNI_COMMAND": command,
            "CNI_CONTAINERID": cid,
            "CNI_NETNS": "/run/netns/x",
            "CNI_IFNAME": "eth0",
            "CNI_PATH": "/opt/cni/bin",
            "CNI_ARGS": f"K8S_POD_NAMESPACE=shop;K8S_POD_NAME=pod-{cid}",
        }
        rc, out = skel.run(handlers, env, json.dumps({**conf, **extra}).encode())
        assert rc == 0, out
        return json.loads(out) if out.strip() else None

    results = {cid: cni("ADD", cid) for cid in ("c1", "c2", "c3", "c4", "c5")}
    cni("CHECK", "c1", prevResult=results["c1"])
    for cid in results:
        cni("DEL", cid)
    cni("GC", **{"cni.dev/valid-attachments": []})
    cni("STATUS")


def leftover_block(fake: FakeApi) -> None:
    """An empty block of this node, of a pool deleted since, listed in no index."""
    from ipaddress import ip_network

    from ipam.core.block import Block

    block = Block.new(ip_network("10.60.0.0/30"), "10.60.0.0/24", NODE)
    fake.put(
        kinds.CRDS["block"].path, kinds.to_object("block", "10.60.0.0/30", block.to_data(), None)
    )


def test_the_plugins_token_grants_what_the_plugins_call_and_nothing_else(
    api: tuple[FakeApi, str],
) -> None:
    fake, kubeconfig = api
    seed(fake)
    leftover_block(fake)
    cni_calls(kubeconfig, ipam_plugin.HANDLERS)
    found = calls(fake)
    assert Call("tabby.io", "ipamblocks", "delete", None, "10-60-0-0-30") in found
    assert not [c for c in found if c.group == ""], "the plugins read nothing of Kubernetes'"
    check_least_privilege("tabby-cni", found)


# -- tabby-node ------------------------------------------------------------------------------------


def tabby_node_calls(fake: FakeApi, kubeconfig: str, tmp_path: Path) -> None:
    from resources.trace import TraceRequest
    from tabby_node.cache import WATCHED_KINDS, Cache
    from tabby_node.facts import Facts
    from tabby_node.registration import Liveness, ensure_default_pools
    from tabby_node.tracer import Tracer
    from tabby_node.tunnels import Tunnels

    store = store_of(kubeconfig, tmp_path)
    stopping = threading.Event()
    address = NodeAddress(ipaddress.ip_address("192.168.1.5"), 24, "eth0")
    facts = Facts(NODE, address, None, 1500, False, "")
    cache = Cache(NODE, pods_from_api=True)
    # the default pools (none yet), the Node
    ensure_default_pools(store, "10.70.0.0/16", None)
    Liveness(
        facts,
        "vxlan",
        store,
        node_ttl=30.0,
        cache=cache,
        ensure_tunnels=lambda: None,
        stopping=stopping,
        beats={},
        problems={},
        by_kubelet=True,
    ).register()
    # the watch of every kind it keeps, up to its first snapshot
    for event in store.sync(WATCHED_KINDS, stopping):
        cache.apply(event)
        if event.type == "snapshot":
            stopping.set()  # (before the watch's end: its threads then stop at once)
            break
    # the VXLAN tunnel address (out of its own block), on its Node
    Tunnels(facts, "vxlan", store, cache).ensure()
    # the calls it serves, on its own store
    cni_calls(kubeconfig, ipam_plugin.IpamVerbs(Served(settings(kubeconfig), store)).handlers())
    # policy trace answers: a new one, then the same again; an expired one met on the way
    request = TraceRequest(
        "0123456789abcdef", NODE, 4, "10.0.0.1", "10.0.0.2", "TCP", 1000, 80, None, 5.0
    )
    tracer = Tracer(NODE, cache, store, stopping)
    tracer.answer(request, "armed")
    tracer.answer(request, "done")
    stale = kinds.to_object("trace", "fedcba9876543210.node-a", {"node": NODE}, None)
    stale["metadata"]["annotations"] = {kinds.EXPIRES_ANNOTATION: "1"}
    fake.put(kinds.CRDS["trace"].path, stale)
    tracer.answer(TraceRequest("fedcba9876543210", NODE, 4, "10.0.0.1", "10.0.0.2", "ICMP",
                               None, None, 7, 1.0), "armed")  # fmt: skip
    # stopping: its DaemonSet and namespace read (an uninstall or a restart?)
    from tabby_node.uninstall import Uninstall

    meta = {"name": "tabby-node", "namespace": NAMESPACE}
    fake.put("/apis/apps/v1/daemonsets", {"kind": "DaemonSet", "metadata": meta})

    Uninstall(
        f"{NAMESPACE}/tabby-node",
        str(tmp_path / "net.d"),
        kubeconfig=kubeconfig,
        store_removed=lambda: None,
        delete_table=lambda: None,
    ).verdict()
    store.close()
    # a bearer token for /policy/log reviewed, then authorized, with its own client
    from tabby_node.access import Door, TokenReviewer, kube_client

    # behind typha (the manifest's TABBY_TYPHA_SERVICE): the Service's endpoints
    from tabby_node.typha import service_endpoints

    subset = {"addresses": [{"ip": "192.0.2.7"}], "ports": [{"name": "typha", "port": 5473}]}
    meta = {"name": "tabby-typha", "namespace": NAMESPACE}
    fake.put("/api/v1/endpoints", {"kind": "Endpoints", "metadata": meta, "subsets": [subset]})
    assert service_endpoints(f"{NAMESPACE}/tabby-typha", kubeconfig) == ["192.0.2.7:5473"]
    client = kube_client(kubeconfig)
    assert client is not None
    fake.tokens["a-token"] = ("someone", (), ("tabby-node",))
    door = Door(reviewer=TokenReviewer(client, NODE, ("tabby-node",)))
    assert door(Caller("/policy/log", "192.0.2.1", "Bearer a-token"))[0] == 403
    client.close()


#: What tabby-node's token is allowed through the review above: another node's log read by
#: tabbyctl in tabby-node's pod (tabby_node.access asks it as this subresource).
OWN_TOKEN = Call("tabby.io", "nodes/policylog", "get", None, "node-b")


def test_tabby_node_is_granted_what_it_calls_and_nothing_else(
    api: tuple[FakeApi, str], tmp_path: Path
) -> None:
    fake, kubeconfig = api
    ready = node(NODE)
    ready["status"] = {"conditions": [{"type": "Ready", "status": "True"}]}
    fake.put(kinds.V1_NODES, ready)
    fake.put("/api/v1/pods", pod("shop", "web"))
    leftover_block(fake)
    tabby_node_calls(fake, kubeconfig, tmp_path)
    found = calls(fake)
    assert Call("tabby.io", "ippools", "create", None, None) in found  # the default pools
    assert Call("tabby.io", "policytraces", "delete", None, "fedcba9876543210.node-a") in found
    assert Call("authentication.k8s.io", "tokenreviews", "create", None, None) in found
    assert Call("", "endpoints", "get", NAMESPACE, "tabby-typha") in found
    check_least_privilege("tabby-node", found | {OWN_TOKEN})


# -- tabby-kube-controllers ------------------------------------------------------------------------


def controllers_calls(
    fake: FakeApi, datastore: DatastoreSettings, tmp_path: Path, kubeconfig: str
) -> None:
    """The program, leading, until it released a gone node's blocks and a leaked address
    and (the node controller) removed the tabby Node of a deleted node."""
    from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
    from kube_controllers.controller import Controllers
    from kube_controllers.options import parse

    kdd = datastore.datastore_type == "kubernetes"
    argv = [
        *("--kubeconfig", kubeconfig, "--lease-namespace", NAMESPACE),
        *("--identity", "replica-1", "--node-grace", "0", "--leak-grace", "0"),
        *("--health-port", "0", "--metrics-port", "0", "--typha-certs", NAMESPACE),
        *("--datastore-type", "kubernetes" if kdd else "etcdv3"),
    ]
    options, parsed = parse(argv, {})
    if not kdd:  # etcd mode's calls to the API, with a store of the test's own
        parsed = datastore
    ctl = Controllers(options, parsed)
    # the datastore: a block of a node that is gone, and a leaked address on a live node
    from stores import open_store

    store = open_store(parsed)
    Ipam(store, "").ensure_pools([PoolSpec(POOL, 30)])
    gone = Ipam(store, "node-gone")
    gone.assign(AssignRequest(handle_id("net", "g1", "eth0"), {"node": "node-gone"},
                              v4_pools=[POOL]))  # fmt: skip
    leaked = Ipam(store, NODE)
    (alloc,) = leaked.assign(
        AssignRequest(
            handle_id("net", "l1", "eth0"),
            {"node": NODE, "pod_namespace": "shop", "pod_name": "gone", "pod_uid": "u"},
            v4_pools=[POOL],
        )
    )
    if kdd:
        # a tabby Node whose v1 Node is about to go (tabby-node registered it)
        fake.put(
            kinds.CRDS["node"].path,
            kinds.to_object("node", "node-b", {"metadata": {"name": "node-b"}, "spec": {}}, None),
        )
        fake.put(kinds.V1_NODES, node("node-b"))
    fake.requests.clear()
    ctl.start()
    try:
        wait("the leader", ctl.leading.is_set)
        if kdd:
            marked = kinds.CRDS["node"].path
            wait("the node reflector synced", ctl.reflectors["node"].synced.is_set)
            fake.delete(kinds.V1_NODES, "node-b")
            wait("node-b's tabby Node removed", lambda: "node-b" not in fake.objects[marked])
        assert ctl.ipam is not None
        wait("the gone node released", lambda: ctl.ipam is not None and ctl.ipam.released["node"])
        wait("the leak released", lambda: ctl.ipam is not None and ctl.ipam.released["leak"])
        assert str(alloc.ip)
        # typha's Secrets made; then, as another replica finds them, read and one renewed
        from kube_controllers import typha_certs

        secrets = "/api/v1/secrets"
        wait("typha's Secrets", lambda: len(fake.objects[secrets]) == 3)
        wait("the certificates thread done", lambda: "typha certs" not in ctl.problems)
        assert ctl.api is not None
        server = fake.objects[secrets][f"{NAMESPACE}/{typha_certs.SERVER_SECRET}"]
        server["data"]["tls.crt"] = server["data"]["ca.crt"]  # not a leaf of its name
        assert typha_certs.ensure(ctl.api, NAMESPACE)[0].startswith("tabby-typha-server renewed")
    finally:
        ctl.stop()
        store.close()


@pytest.fixture
def seeded(api: tuple[FakeApi, str]) -> tuple[FakeApi, str]:
    fake, kubeconfig = api
    seed(fake)
    fake.put("/api/v1/pods", pod("shop", "web"))
    return fake, kubeconfig


def test_the_controllers_are_granted_what_they_call_in_either_datastore(
    seeded: tuple[FakeApi, str], tmp_path: Path
) -> None:
    fake, kubeconfig = seeded
    controllers_calls(fake, settings(kubeconfig), tmp_path, kubeconfig)
    kubernetes = calls(fake)
    mirrored = ("namespaces", "serviceaccounts", "networkpolicies")
    assert not [c for c in kubernetes if c.resource in mirrored]
    assert Call("", "secrets", "update", NAMESPACE, "tabby-typha-server") in kubernetes
    with fake_api() as (etcd_fake, url):  # etcd mode: the same calls as with any store
        seed(etcd_fake)
        etcd_fake.put("/api/v1/pods", pod("shop", "web"))
        conf = tmp_path / "etcd-kubeconfig"
        conf.write_text(Path(kubeconfig).read_text().replace(_server(kubeconfig), url))
        file_store = DatastoreSettings(datastore_type="file", data_dir=str(tmp_path / "store"))
        controllers_calls(etcd_fake, file_store, tmp_path, str(conf))
        etcd_mode = calls(etcd_fake)
    assert {c.resource for c in etcd_mode if c.group != "coordination.k8s.io"} == {
        "namespaces",
        "serviceaccounts",
        "pods",
        "nodes",
        "networkpolicies",
        "secrets",
    }
    check_least_privilege("tabby-kube-controllers", kubernetes | etcd_mode)


# -- tabby-typha ---------------------------------------------------------------------------------


def test_typha_is_granted_what_it_calls_and_nothing_else(
    seeded: tuple[FakeApi, str], tmp_path: Path
) -> None:
    """Its own watch (``Typha.watch``: every kind it serves, which are the kinds a node
    keeps, tests/unit/typha/test_kinds.py) up to the snapshot, then a deletion followed (the
    definitions read: an uninstall is not a change to fan out)."""
    from typha.main import Typha
    from typha.options import parse

    fake, kubeconfig = seeded
    store = store_of(kubeconfig, tmp_path)
    options, _ = parse(["--plaintext", "--datastore-type", "kubernetes"], {})
    typha = Typha(options, store)
    pools = kinds.CRDS["pool"].path

    class Loop:
        """The asyncio loop's one method typha's watch calls, run at once."""

        def call_soon_threadsafe(
            self, apply: Callable[[SyncEvent], None], event: SyncEvent
        ) -> None:
            if event.type == "snapshot":
                fake.delete(pools, next(iter(fake.objects[pools])))
            elif event.type == "delete":
                typha.stopping.set()

    try:
        typha.watch(Loop())  # type: ignore[arg-type]
    finally:
        store.close()
    found = calls(fake)
    assert {c.verb for c in found} == {"list", "watch", "get"}
    check_least_privilege("tabby-typha", found)


def _server(kubeconfig: str) -> str:
    return str(json.loads(Path(kubeconfig).read_text())["clusters"][0]["cluster"]["server"])


def test_the_roles_are_read_as_rbac_reads_them() -> None:
    """The reading of the log and of the rules (so that what the tests above find means
    something)."""
    assert call_of("GET /api/v1/pods?watch") == Call("", "pods", "watch", None, None)
    assert call_of("GET /api/v1/namespaces/x/pods/p") == Call("", "pods", "get", "x", "p")
    assert call_of("GET /api/v1/namespaces") == Call("", "namespaces", "list", None, None)
    assert call_of("PUT /apis/coordination.k8s.io/v1/namespaces/tabby-system/leases/l") == Call(
        "coordination.k8s.io", "leases", "update", "tabby-system", "l"
    )
    assert call_of("DELETE /apis/tabby.io/v1/ipamblocks/b") == Call(
        "tabby.io", "ipamblocks", "delete", None, "b"
    )
    lease = Atom(
        "coordination.k8s.io", "leases", "get", NAMESPACE, frozenset({"tabby-kube-controllers"})
    )
    assert lease.grants(
        Call("coordination.k8s.io", "leases", "get", NAMESPACE, "tabby-kube-controllers")
    )
    assert not lease.grants(Call("coordination.k8s.io", "leases", "get", NAMESPACE, "other"))
    assert not lease.grants(
        Call("coordination.k8s.io", "leases", "get", "kube-system", "tabby-kube-controllers")
    )
    with pytest.raises(AssertionError, match="granted what it never calls"):
        check_least_privilege("tabby-cni", {call_of("GET /apis/tabby.io/v1/ippools/p")})
    with pytest.raises(AssertionError, match="denied what it calls"):
        check_least_privilege("tabby-cni", {call_of("GET /api/v1/pods")})
