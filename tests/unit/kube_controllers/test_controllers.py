"""tabby-kube-controllers against an in-memory API server (tests/kube_fake.py) and a memory
store: the client (list pages, watch, bookmarks, 410), the reflector (a relist finds the
deletions of the gap), leader election (one writer; release; takeover after the lease), the
mirror (what is written, marked, and never touched), the ipam controller (a leak and a gone
node released after their grace, never a live pod's address), and tabby-node's wait for a
mirrored pod. The Kubernetes tier runs the same program against a real API server."""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from datastore.memory import MemoryStore
from kube_controllers import mirror
from kube_controllers.leader import Elector
from kube_controllers.reflector import Reflector
from resources import mirror as marks
from resources.client import ResourceClient
from resources.errors import NotOwned
from stores.kube import kinds
from stores.kube.client import Gone, KubeClient, KubeConfig
from tests.kube_fake import FakeApi, fake_api, namespace, node, pod, policy

PODS = "/api/v1/pods"
NAMESPACES = "/api/v1/namespaces"
POLICIES = "/apis/networking.k8s.io/v1/networkpolicies"
NODES = "/api/v1/nodes"


def wait(cond: Callable[[], object], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, KubeClient]]:
    with fake_api() as (fake, url):
        client = KubeClient(KubeConfig(server=url))
        yield fake, client
        client.close()


# == the client ===================================================================================


def test_list_reads_every_page_at_one_version(api: tuple[FakeApi, KubeClient]) -> None:
    fake, client = api
    for i in range(1203):
        fake.put(PODS, pod("x", f"p{i}"))
    items, version = client.list(PODS)
    assert len(items) == 1203
    assert version == str(fake.rv)
    assert sum(r.startswith("GET /api/v1/pods") for r in fake.requests) == 3  # pages of 500


def test_watch_sends_changes_bookmarks_and_410(api: tuple[FakeApi, KubeClient]) -> None:
    fake, client = api
    _, version = client.list(PODS)
    stop = threading.Event()
    got: list[tuple[str, str]] = []

    def consume() -> None:
        for e in client.watch(PODS, version, stop, timeout_seconds=30):
            got.append((e["type"], e["object"]["metadata"].get("name", "")))

    t = threading.Thread(target=consume, daemon=True)
    t.start()
    fake.put(PODS, pod("x", "a"))
    fake.put(PODS, pod("x", "a", {"v": "2"}))
    fake.delete(PODS, "x/a")
    fake.put(NAMESPACES, namespace("other"))  # another collection: a bookmark for pods
    wait(lambda: ("BOOKMARK", "") in got)
    assert got[:3] == [("ADDED", "a"), ("MODIFIED", "a"), ("DELETED", "a")]
    stop.set()
    client.close()
    t.join(3)
    assert not t.is_alive()
    fake.compact()
    with pytest.raises(Gone):
        list(client.watch(PODS, version, threading.Event(), timeout_seconds=5))


def test_a_request_after_close_leaves_no_connection_open(
    api: tuple[FakeApi, KubeClient], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A thread that asks again after close() (the elector gives its Lease up so, as its
    thread ends) is answered, and its connection is closed again: left open, it would be
    found unclosed by the garbage collector, whose ResourceWarning fails whatever test runs
    at that moment (pytest turns warnings into errors here)."""
    fake, client = api
    fake.put(NAMESPACES, namespace("x"))
    made: list[http.client.HTTPConnection] = []
    connect = client._connect
    monkeypatch.setattr(
        client, "_connect", lambda timeout: made.append(connect(timeout)) or made[-1]
    )
    asked, closed = threading.Event(), threading.Event()
    answers: list[str] = []

    def ask_twice() -> None:
        answers.append(client.get(f"{NAMESPACES}/x")["metadata"]["name"])
        asked.set()
        closed.wait(5)
        answers.append(client.get(f"{NAMESPACES}/x")["metadata"]["name"])

    t = threading.Thread(target=ask_twice, daemon=True)
    t.start()
    assert asked.wait(5)
    client.close()
    closed.set()
    t.join(5)
    assert answers == ["x", "x"]
    (conn,) = made  # the thread's keep-alive connection, opened again for the second request
    assert conn.sock is None


def test_a_kubeconfig_is_read(tmp_path: object) -> None:
    import base64
    from pathlib import Path

    path = Path(str(tmp_path)) / "kubeconfig"
    token = base64.b64encode(b"not a certificate").decode()
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "clusters: [{name: k, cluster: {server: 'https://10.0.0.1:6443', "
        f"certificate-authority: ca.crt, certificate-authority-data: {token}}}}}]\n"
        "users: [{name: u, user: {token: sekret}}]\n"
    )
    config = KubeConfig.from_kubeconfig(str(path))
    assert config.server == "https://10.0.0.1:6443"
    assert config.ca_file == str(path.parent / "ca.crt")
    assert config.token == "sekret"
    env = {"KUBERNETES_SERVICE_HOST": "10.96.0.1", "KUBERNETES_SERVICE_PORT": "443"}
    inside = KubeConfig.load(None, env)
    assert inside.server == "https://10.96.0.1:443"
    assert inside.token_file is not None
    assert inside.token_file.endswith("/token")


# == the reflector ================================================================================


def test_a_relist_after_410_reports_the_deletions_of_the_gap(
    api: tuple[FakeApi, KubeClient],
) -> None:
    fake, client = api
    fake.put(PODS, pod("x", "keep"))
    fake.put(PODS, pod("x", "gone"))
    changes: list[str] = []
    r = Reflector(client, "pod", PODS, kinds.project_pod, lambda kind, key: changes.append(key))
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    wait(r.synced.is_set)
    assert sorted(r.keys()) == ["x/gone", "x/keep"]
    # The watch breaks, and while nobody watches: a deletion, then the history is compacted.
    fake.break_watches()
    fake.delete(PODS, "x/gone")
    fake.put(PODS, pod("x", "new"))
    fake.compact()
    wait(lambda: sorted(r.keys()) == ["x/keep", "x/new"])
    assert "x/gone" in changes
    assert "x/new" in changes
    assert r.lists == 2
    fake.put(PODS, pod("x", "after", {"a": "b"}))  # the watch runs again after the relist
    wait(lambda: r.get("x/after") is not None)
    stop.set()
    client.close()
    t.join(3)


def test_bookmarks_move_the_version_so_a_reconnect_needs_no_list(
    api: tuple[FakeApi, KubeClient],
) -> None:
    fake, client = api
    r = Reflector(client, "pod", PODS, kinds.project_pod, lambda kind, key: None)
    stop = threading.Event()
    t = threading.Thread(target=r.run, args=(stop,), daemon=True)
    t.start()
    wait(r.synced.is_set)
    for i in range(5):
        fake.put(NAMESPACES, namespace(f"n{i}"))  # only other kinds change
    wait(lambda: r.resource_version == str(fake.rv))
    fake.compact()  # history gone, but the pods' watch is at the newest version already
    fake.break_watches()
    fake.put(PODS, pod("x", "p"))
    wait(lambda: r.get("x/p") is not None)
    assert r.lists == 1
    stop.set()
    client.close()
    t.join(3)


def test_a_pods_service_account_is_mirrored() -> None:
    """Calico's ``serviceAccounts`` rules read it (etcd mode mirrors it; the Kubernetes
    datastore projects the same); the API server's deprecated ``serviceAccount`` is not."""
    from policy import inputs
    from resources.k8s import Pod

    p = pod("x", "a")
    p["spec"]["serviceAccountName"] = "web-sa"
    p["spec"]["serviceAccount"] = "web-sa"
    projected = kinds.project_pod(p)
    assert projected is not None
    assert projected["spec"]["serviceAccountName"] == "web-sa"
    assert "serviceAccount" not in projected["spec"]
    model = Pod.model_validate(projected)
    assert inputs.pod(model).service_account == "web-sa"


def test_host_network_pods_are_not_mirrored() -> None:
    p = pod("x", "h")
    p["spec"]["hostNetwork"] = True
    assert kinds.project_pod(p) is None


# == leader election ===============================================================================


def _elector(client: KubeClient, name: str, changes: list[tuple[str, bool]]) -> Elector:
    return Elector(
        client,
        "kube-system",
        "tabby-kube-controllers",
        name,
        on_change=lambda leading: changes.append((name, leading)),
        lease_seconds=2,
        renew_deadline=1.5,
        retry=0.2,
    )


@pytest.mark.slow
def test_one_leader_a_release_and_a_takeover_after_the_lease(
    api: tuple[FakeApi, KubeClient],
) -> None:
    fake, client = api
    changes: list[tuple[str, bool]] = []
    a, b = _elector(client, "a", changes), _elector(client, "b", changes)
    stop_a, stop_b = threading.Event(), threading.Event()
    ta = threading.Thread(target=a.run, args=(stop_a,), daemon=True)
    ta.start()
    wait(a.leading.is_set)
    tb = threading.Thread(target=b.run, args=(stop_b,), daemon=True)
    tb.start()
    time.sleep(1.0)
    assert a.leading.is_set()
    assert not b.leading.is_set()
    stop_a.set()  # a clean stop releases the Lease: b takes over at once
    ta.join(3)
    started = time.monotonic()
    wait(b.leading.is_set)
    assert time.monotonic() - started < 1.0
    # b dies without releasing: a newcomer waits for the lease to run out, then takes it
    b.release = lambda: None  # type: ignore[method-assign]
    stop_b.set()
    tb.join(3)
    c = _elector(client, "c", changes)
    stop_c = threading.Event()
    tc = threading.Thread(target=c.run, args=(stop_c,), daemon=True)
    started = time.monotonic()
    tc.start()
    wait(c.leading.is_set, timeout=6)
    assert 1.8 < time.monotonic() - started < 4.0
    lease = client.get(
        "/apis/coordination.k8s.io/v1/namespaces/kube-system/leases/tabby-kube-controllers"
    )
    assert lease["spec"]["holderIdentity"] == "c"
    assert lease["spec"]["leaseTransitions"] == 2
    stop_c.set()
    tc.join(3)
    del fake


# == the mirror ====================================================================================


def _mirror() -> tuple[MemoryStore, mirror.Mirror]:
    store = MemoryStore()
    return store, mirror.Mirror(store, ResourceClient(store, owner=marks.KUBERNETES))


def test_objects_are_mirrored_marked_and_deleted() -> None:
    store, m = _mirror()
    p = kinds.project_pod(pod("x", "a", {"app": "web"}, ips=("10.244.0.5",), ports=(("http", 80),)))
    m.sync("pod", "x/a", p)
    data = store.get("pod", "x/a")
    assert data is not None
    assert data.data["metadata"]["labels"] == {"app": "web"}
    assert data.data["metadata"]["annotations"] == {"tabby.io/source": "kubernetes"}
    assert data.data["spec"]["nodeName"] == "node-1"
    assert data.data["status"]["podIPs"] == [{"ip": "10.244.0.5"}]
    m.sync("pod", "x/a", p)  # the same again: nothing written
    assert m.writes == {("pod", "created"): 1}
    m.sync("namespace", "x", kinds.project_namespace(namespace("x", {"team": "a"})))
    np = policy("x", "deny", {"podSelector": {"matchLabels": {"app": "web"}}})
    m.sync("policy", "x/deny", kinds.project_policy(np))
    assert store.get("networkpolicy", "x/deny") is not None
    m.sync("pod", "x/a", None)
    m.sync("policy", "x/deny", None)
    assert store.get("pod", "x/a") is None
    assert store.get("networkpolicy", "x/deny") is None
    assert sorted(m.mirrored_keys("namespace")) == ["x"]


def test_what_an_operator_made_is_never_touched_and_tabbyctl_cannot_change_mirrors() -> None:
    store, m = _mirror()
    operator = ResourceClient(store)
    operator.apply(
        [{"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "own", "namespace": "x"}}]
    )
    m.sync("pod", "x/own", kinds.project_pod(pod("x", "own", {"k8s": "says"})))
    m.sync("pod", "x/own", None)
    kept = store.get("pod", "x/own")
    assert kept is not None
    assert "labels" not in kept.data["metadata"]
    m.sync("pod", "x/m", kinds.project_pod(pod("x", "m")))
    change = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "m", "namespace": "x", "labels": {"a": "b"}},
    }
    with pytest.raises(NotOwned, match="change it with kubectl"):
        operator.apply([change])
    with pytest.raises(NotOwned, match="change it with kubectl"):
        operator.delete("pod", "m", "x")
    marked = {
        **change,
        "metadata": {
            **change["metadata"],
            "name": "n",
            "annotations": {"tabby.io/source": "kubernetes"},
        },
    }
    with pytest.raises(NotOwned):
        operator.apply([marked])  # only the controllers mark


def test_node_labels_are_merged_into_the_node_tabby_node_registered() -> None:
    store, m = _mirror()
    m.sync("node", "node-1", {"labels": {"zone": "a"}})  # not registered yet: nothing
    assert store.get("node", "node-1") is None
    spec = {"backend": "bird", "ipv4Address": "10.0.0.1/24"}
    store.put("node", "node-1", {"metadata": {"name": "node-1"}, "spec": spec}, None)
    m.sync("node", "node-1", {"labels": {"zone": "a"}})
    doc = store.get("node", "node-1")
    assert doc is not None
    assert doc.data["metadata"]["labels"] == {"zone": "a"}
    assert doc.data["spec"] == spec  # tabby-node's part as it was
    # An operator may still set the BGP fields of a mirrored Node, not its labels.
    operator = ResourceClient(store)
    operator.apply(
        [
            {
                "apiVersion": "tabby.io/v1",
                "kind": "Node",
                "metadata": {"name": "node-1"},
                "spec": {"bgp": {"asNumber": 65001}},
            }
        ]
    )
    with pytest.raises(NotOwned):
        operator.apply(
            [
                {
                    "apiVersion": "tabby.io/v1",
                    "kind": "Node",
                    "metadata": {"name": "node-1", "labels": {"zone": "b"}},
                }
            ]
        )
    m.sync("node", "node-1", None)  # the Kubernetes Node was deleted
    assert store.get("node", "node-1") is None


# == the ipam controller ===========================================================================


def test_a_leak_is_released_after_its_grace_and_a_live_pod_never(
    api: tuple[FakeApi, KubeClient],
) -> None:
    from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
    from kube_controllers.ipamgc import IpamGc

    fake, client = api
    store = MemoryStore()
    ipam = Ipam(store, "node-1")
    ipam.ensure_pools([PoolSpec("10.244.0.0/16", 26)])

    def attach(name: str) -> str:
        req = AssignRequest(
            handle_id=handle_id("k8s-pod-network", f"c-{name}", "eth0"),
            attrs={"node": "node-1", "pod_namespace": "x", "pod_name": name, "pod_uid": ""},
            want_v4=True,
            want_v6=False,
            v4_pools=["10.244.0.0/16"],
        )
        return str(ipam.assign(req)[0].ip)

    live_ip = attach("live")
    attach("leaked")
    fake.put(PODS, pod("x", "live", ips=(live_ip,)))
    now = [0.0]
    nodes = Reflector(client, "node", NODES, mirror.project_node, lambda k, key: None)
    pods = Reflector(client, "pod", PODS, kinds.project_pod, lambda k, key: None)
    nodes.relist()
    pods.relist()
    fake.put(NODES, node("node-1"))
    nodes.relist()
    gc = IpamGc(store, client, nodes, pods, node_grace=60, leak_grace=100, clock=lambda: now[0])
    gc.run_once()
    assert len(ipam.allocations()) == 2  # within the grace
    now[0] = 150
    gc.run_once()
    held = [o.attrs["pod_name"] for o in ipam.allocations()]
    assert held == ["live"]
    assert gc.released == {"node": 0, "leak": 1}
    # A pod the reflector missed (created just now) but the API server has: not released
    attach("fresh")
    gc.run_once()
    now[0] = 300
    fake.put(PODS, pod("x", "fresh"))
    gc.run_once()
    assert sorted(o.attrs["pod_name"] for o in ipam.allocations()) == ["fresh", "live"]


def test_a_gone_node_s_blocks_are_released_after_the_node_grace(
    api: tuple[FakeApi, KubeClient],
) -> None:
    from ipam.core import AssignRequest, Ipam, PoolSpec, handle_id
    from kube_controllers.ipamgc import IpamGc

    fake, client = api
    store = MemoryStore()
    ipam = Ipam(store, "node-2")
    ipam.ensure_pools([PoolSpec("10.244.0.0/16", 26)])
    req = AssignRequest(
        handle_id=handle_id("n", "c", "eth0"),
        attrs={"node": "node-2"},
        want_v4=True,
        want_v6=False,
        v4_pools=["10.244.0.0/16"],
    )
    ipam.assign(req)
    now = [0.0]
    nodes = Reflector(client, "node", NODES, mirror.project_node, lambda k, key: None)
    pods = Reflector(client, "pod", PODS, kinds.project_pod, lambda k, key: None)
    fake.put(NODES, node("node-2"))
    nodes.relist()
    pods.relist()
    gc = IpamGc(store, client, nodes, pods, node_grace=60, leak_grace=100, clock=lambda: now[0])
    gc.run_once()
    fake.delete(NODES, "node-2")
    nodes.relist()
    gc.run_once()
    now[0] = 30
    gc.run_once()
    assert ipam.allocations()
    now[0] = 61
    gc.run_once()
    assert ipam.allocations() == []
    assert gc.released["node"] == 1
    assert ipam.block_usage() == []


# == tabby-node waits for a mirrored pod ==============================================


def test_tabby_node_waits_for_the_pod_while_the_controllers_run() -> None:
    from datastore.base import Doc, SyncEvent
    from resources.heartbeat import CONTROLLERS_KEY, Heartbeat
    from tabby_node.cache import Cache

    cache = Cache()
    assert cache.wait_mirrored("x", "a", "u1", 0.01)  # no controllers: no wait
    beat = Heartbeat(CONTROLLERS_KEY, 1.0, 1).to_data()
    cache.apply(SyncEvent("put", "heartbeat", CONTROLLERS_KEY, Doc(beat, 1), None))
    assert not cache.wait_mirrored("x", "a", "u1", 0.05)
    p = kinds.project_pod({**pod("x", "a"), "metadata": {**pod("x", "a")["metadata"], "uid": "u1"}})
    assert p is not None
    results: list[bool] = []
    t = threading.Thread(target=lambda: results.append(cache.wait_mirrored("x", "a", "u1", 5)))
    t.start()
    time.sleep(0.1)
    cache.apply(
        SyncEvent(
            "put",
            "pod",
            "x/a",
            Doc({k: v for k, v in p.items() if k in ("metadata", "spec", "status")}, 2),
            None,
        )
    )
    time.sleep(0.1)
    assert not results  # the pod, but not its namespace yet
    ns = kinds.project_namespace(namespace("x"))
    assert ns is not None
    cache.apply(SyncEvent("put", "namespace", "x", Doc({"metadata": ns["metadata"]}, 3), None))
    t.join(2)
    assert results == [True]
    assert not cache.wait_mirrored("x", "a", "another-incarnation", 0.05)


class _CountingCondition(threading.Condition):
    """A Condition that counts how often a waiter woke up (each ``wait`` returned)."""

    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def wait(self, timeout: float | None = None) -> bool:
        got = super().wait(timeout)
        self.wakeups += 1
        return got


def test_a_standby_worker_sleeps_on_a_due_queue_and_works_it_once_it_leads() -> None:
    """kube_bench found a standby at ~110 wake-ups/s at rest: its queue holds due items it
    may not work, and the worker waited for the earliest of them (already past: 10 ms)."""
    from cni_config.common import DatastoreSettings
    from kube_controllers.controller import Controllers
    from kube_controllers.options import ControllerOptions

    ctl = Controllers(ControllerOptions(identity="standby"), DatastoreSettings())
    cond = _CountingCondition()
    ctl._cond = cond
    ctl.enqueue("pod", "x/a")  # due at once
    got: list[tuple[str, str] | None] = []
    worker = threading.Thread(target=lambda: got.append(ctl._next()), daemon=True)
    worker.start()
    time.sleep(0.5)
    assert not got, "a standby worked an item"
    assert cond.wakeups <= 2, f"the standby woke {cond.wakeups} times in 0.5 s"
    ctl.leading.set()
    with cond:
        cond.notify_all()  # what _leadership(True) does
    worker.join(2)
    assert got == [("pod", "x/a")]
    ctl.stopping.set()


def test_a_replica_that_stops_leading_drops_the_ipam_pass_it_failed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The Kubernetes tier: an API server blackholed while replica-2 led failed its IPAM pass
    ("not writable"); it stopped leading, and its readiness said so until the end (the pass
    that would clear it runs only while leading), so the next test waited for it in vain."""
    from cni_config.common import DatastoreSettings
    from kube_controllers import controller as module
    from kube_controllers.controller import Controllers
    from kube_controllers.options import ControllerOptions

    monkeypatch.setattr(module, "HEARTBEAT_EVERY", 0.05)
    ctl = Controllers(
        ControllerOptions(identity="standby", node_grace=0.1, leak_grace=0.1), DatastoreSettings()
    )
    ctl.problems["ipam"] = "IPAM datastore not writable: the read operation timed out"
    assert any(r.startswith("ipam: ") for r in ctl.readiness())
    stop = threading.Event()
    loop = threading.Thread(target=ctl._housekeeping, args=(stop,), daemon=True)
    loop.start()
    try:
        deadline = time.monotonic() + 5
        while "ipam" in ctl.problems:
            assert time.monotonic() < deadline, ctl.problems
            time.sleep(0.02)
    finally:
        stop.set()
        loop.join(2)
    assert not any(r.startswith("ipam: ") for r in ctl.readiness())
