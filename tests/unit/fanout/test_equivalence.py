"""A node's view through tabby-typha gives it the same routes and the same policy state
(``policy.engine.compute``'s IR for its endpoints) as the whole datastore watch: the
per-node projections and the interest filter leave out only what cannot change them.
Checked on a cluster written by tabby's own writers (``tests.unit.cluster_world``), at the
first snapshot and after changes fed through the hub's history."""

from __future__ import annotations

from typing import Any

from datastore.base import Doc, SyncEvent
from datastore.engine import Reported
from fanout import wire
from fanout.hub import Hub
from policy.engine import compute
from policy.inputs import PolicyInputs
from resources.index import NODE_KINDS, PODS, Documents
from resources.remote import RemotePod
from tabby_node.cache import Cache
from tabby_node.cluster import Cluster
from tests.unit.cluster_world import World

NODES = ("n1", "n2", "n3")


def pod(name: str, node: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": "shop",
            "uid": f"uid-{name}",
            "labels": labels,
            "annotations": {"note": "x" * 50},
        },
        "spec": {
            "nodeName": node,
            "containers": [
                {
                    "name": "c",
                    "ports": [{"name": "http", "containerPort": 8080}, {"containerPort": 9}],
                }
            ],
        },
        "status": {"podIPs": [{"ip": "10.244.0.1"}]},
    }


def endpoint(name: str, node: str, address: str, **labels: str) -> dict[str, Any]:
    return {
        "apiVersion": "tabby.io/v1",
        "kind": "WorkloadEndpoint",
        "metadata": {"name": f"{node}-k8s-{name}-eth0", "namespace": "shop", "labels": labels},
        "spec": {
            "node": node,
            "pod": name,
            "containerID": f"c-{name}",
            "interface": "eth0",
            "hostInterface": f"cali{name[:11]}",
            "ipNetworks": [f"{address}/32"],
        },
    }


def docs(world: World) -> dict[str, dict[str, Doc]]:
    return {kind: dict(world.store.list(kind)) for kind in NODE_KINDS}


def views(cache: Cache, me: str) -> tuple[Cluster, object]:
    documents: Documents = cache.view()
    state, _ = PolicyInputs().convert(documents)
    return Cluster.from_documents(documents, me), compute(state, me)


def remote_pods(cache: Cache, me: str) -> set[str]:
    return {
        key
        for key, e in cache.view().of(PODS).items()
        if isinstance(e.value, RemotePod) and not key.startswith(me)
    }


class ViaTypha:
    """A node's cache fed from the hub as the typha client feeds it."""

    def __init__(self, hub: Hub, me: str) -> None:
        self.hub, self.me = hub, me
        self.cache = Cache(me)
        self.reported = Reported()
        snapshot: dict[str, dict[str, Doc]] = {kind: {} for kind in NODE_KINDS}
        message = wire.decode_server(
            wire.encode_server(wire.SNAPSHOT_CHUNK, "", 0, b"".join(hub.snapshot_fields(me)))
        )
        for u in message.updates:
            snapshot[u.kind][u.key] = Doc(_json(u.data), u.revision)
        self.cache.apply(self.reported.snapshot(snapshot))
        self.seq = hub.seq

    def catch_up(self) -> int:
        """Apply what the hub sends this node; the number of updates."""
        changes = self.hub.since(self.seq)
        assert changes is not None
        fields = [f for c in changes if (f := c.for_node(self.me)) is not None]
        self.seq = self.hub.seq
        message = wire.decode_server(wire.encode_server(wire.UPDATES, "", 0, b"".join(fields)))
        for u in message.updates:
            doc = None if u.deleted else Doc(_json(u.data), u.revision)
            event = self.reported.change(u.kind, u.key, doc)
            if event is not None:
                self.cache.apply(event)
        return len(fields)


def _json(data: bytes) -> dict[str, Any]:
    import json

    return json.loads(data)  # type: ignore[no-any-return]


def feed(hub: Hub, before: dict[str, dict[str, Doc]], after: dict[str, dict[str, Doc]]) -> None:
    """The datastore's changes from ``before`` to ``after``, as its watch gives them."""
    for kind in NODE_KINDS:
        old, new = before.get(kind, {}), after.get(kind, {})
        for key in sorted(old.keys() - new.keys()):
            hub.apply(SyncEvent("delete", kind, key, None, None))
        for key in sorted(new):
            if key not in old or old[key].revision != new[key].revision:
                hub.apply(SyncEvent("put", kind, key, new[key], None))


def check(world: World, hub: Hub, nodes: dict[str, ViaTypha]) -> None:
    for me, via in nodes.items():
        full = Cache(me)
        full.apply(SyncEvent("snapshot", "", "", None, docs(world)))
        assert views(via.cache, me) == views(full, me), me


def test_typhas_views_give_each_node_the_routes_and_policy_of_the_whole_watch() -> None:
    world = World("vxlan")
    world.pool("default", "10.244.0.0/16", blockSize=26, vxlanMode="Always")
    for i, name in enumerate(NODES):
        world.node(name, f"192.0.2.{i + 1}/24")
    world.apply(
        {
            "apiVersion": "v1",
            "kind": "Namespace",
            "metadata": {"name": "shop", "labels": {"team": "a"}},
        }
    )
    addresses = {}
    for i, name in enumerate(("web-1", "web-2", "db-1")):
        node = NODES[i]
        addresses[name] = str(world.pod(node))
        world.apply(pod(name, node, app=name.split("-")[0]))
        world.apply(endpoint(name, node, addresses[name], app=name.split("-")[0]))
    # n3 borrows an address in n1's block: n1 and n2 route it to n3
    borrowed = world.free_address(world.block_of("n1"))
    world.pod("n3", borrowed)
    world.apply(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "db", "namespace": "shop"},
            "spec": {
                "podSelector": {"matchLabels": {"app": "db"}},
                "ingress": [{"from": [{"podSelector": {"matchLabels": {"app": "web"}}}]}],
            },
        }
    )
    hub = Hub(epoch="e")
    hub.apply(SyncEvent("snapshot", "", "", None, docs(world)))
    nodes = {me: ViaTypha(hub, me) for me in NODES}
    check(world, hub, nodes)
    # only n3 runs a pod a policy selects (db-1): only n3 holds the web pods it allows
    assert remote_pods(nodes["n3"].cache, "n3") == {"shop/web-1", "shop/web-2"}
    assert remote_pods(nodes["n1"].cache, "n1") == set()
    assert remote_pods(nodes["n2"].cache, "n2") == set()

    before = docs(world)
    # pods come and go on n1 (its own block), a label changes on n2, n2 borrows from n3
    world.pod("n1")
    world.pod("n1")
    world.apply(pod("web-2", "n2", app="web", tier="front"))
    world.pod("n2", world.free_address(world.block_of("n3")))
    world.apply(pod("web-3", "n1", app="web"))
    after = docs(world)
    feed(hub, before, after)
    sent = {me: via.catch_up() for me, via in nodes.items()}
    check(world, hub, nodes)
    # n1's own ADDs (block writes) reached n1 alone: the others got fewer updates
    assert sent["n1"] > sent["n3"]

    # a node leaves: its Node, heartbeat and blocks go
    before = after
    world.lease_expires("n3")
    after = docs(world)
    feed(hub, before, after)
    for via in nodes.values():
        via.catch_up()
    check(world, hub, nodes)
