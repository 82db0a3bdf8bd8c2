"""What tabby-node writes about its node: the Node document, the heartbeat that says it is
alive (the ``heartbeat`` thread), and the default pools of a datastore without any."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from bundle.types import JSON
from cni_protocol.errors import CniError, Code
from datastore.base import Doc, Store
from ipam.core.errors import DatastoreError, RevisionConflict
from resources.index import HEARTBEATS, NODES, Documents

if TYPE_CHECKING:
    from tabby_node.cache import Cache
    from tabby_node.facts import Facts
    from tabby_node.view import DatastoreErrors

log = logging.getLogger("tabby.node")


def node_spec(facts: Facts, backend: str, existing: JSON | None) -> JSON:
    """The Node document: the operator's fields (labels, BGP AS, route reflector id)
    kept, tabby-node's own fields set from what it found."""
    data: JSON = json.loads(json.dumps(existing or {}))
    meta = data.setdefault("metadata", {})
    meta["name"] = facts.name
    meta.setdefault("creationTimestamp", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    spec = data.setdefault("spec", {})
    spec["backend"] = backend
    for key, addr in (("ipv4Address", facts.ipv4), ("ipv6Address", facts.ipv6)):
        if addr is not None:
            spec[key] = str(addr)
        else:
            spec.pop(key, None)
    return data


def cas(store: Store, kind: str, key: str, change: Callable[[JSON | None], JSON]) -> Doc:
    """The one compare-and-swap (``datastore.cas.update``) over ``change(data)``;
    returns what the document holds afterwards."""
    from datastore.cas import update

    written: list[JSON] = []

    def apply(doc: Doc | None) -> JSON | None:
        data = change(doc.data if doc is not None else None)
        written[:] = [data]
        return None if doc is not None and doc.data == data else data

    rev = update(store, kind, key, apply)
    assert rev is not None
    return Doc(written[0], rev)


class Liveness:
    """This node's Node and heartbeat in ``store``: :meth:`register` at start, then the
    ``heartbeat`` thread (:meth:`run`) keeps the heartbeat alive every ``node_ttl`` / 3 and
    registers the node again (``ensure_tunnels`` after) if an operator deleted its Node
    while it runs. ``by_kubelet``: the node's liveness is the kubelet's (the Kubernetes
    datastore: the v1 Node's Ready condition), and tabby writes none."""

    def __init__(
        self,
        facts: Facts,
        backend: str,
        store: Store,
        *,
        node_ttl: float,
        cache: Cache,
        ensure_tunnels: Callable[[], None],
        stopping: threading.Event,
        beats: dict[str, float],
        problems: dict[str, str],
        metrics: DatastoreErrors | None = None,
        by_kubelet: bool = False,
    ) -> None:
        self.facts = facts
        self.backend = backend
        self.by_kubelet = by_kubelet
        self.store = store
        self.node_ttl = node_ttl
        self.cache = cache
        self.ensure_tunnels = ensure_tunnels
        self.stopping = stopping
        self.beats = beats
        self.problems = problems
        self.metrics = metrics

    def node_spec(self, existing: JSON | None) -> JSON:
        return node_spec(self.facts, self.backend, existing)

    def register(self) -> None:
        """The Node (refused when a live node already has this node's address), then the
        heartbeat."""
        facts, store = self.facts, self.store
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
        cas(store, "node", facts.name, self.node_spec)
        self.beat()

    def beat(self) -> None:
        """Liveness (``resources.heartbeat.beat``: the lease kept alive, which no other node
        hears of; written again only when it is gone)."""
        if self.by_kubelet:
            return
        from datastore.base import leases
        from resources.heartbeat import beat

        beat(leases(self.store), self.facts.name, self.node_ttl)

    def run(self) -> None:
        """The ``heartbeat`` thread, until ``stopping``."""
        name, store = self.facts.name, self.store
        period = max(self.node_ttl / 3, 1.0)
        while not self.stopping.wait(period):
            self.beats["heartbeat"] = time.monotonic()
            try:
                self.beat()
                # the watch says when the Node goes; the datastore confirms before acting
                if self.cache.get(NODES, name) is None and store.get("node", name) is None:
                    log.warning("the Node %s was deleted while it runs: registering again", name)
                    self.register()
                    self.ensure_tunnels()
                self.problems.pop("datastore: heartbeat", None)
            except DatastoreError as e:
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error("heartbeat")
                self.problems["datastore: heartbeat"] = str(e)
                log.warning("heartbeat: %s", e)


def ensure_default_pools(store: Store, ipv4_pool: str, ipv6_pool: str | None) -> None:
    """A datastore without pools gets the default ones (Calico does the same)."""
    if store.list("pool"):
        return
    from resources.client import ResourceClient

    docs: list[dict[str, object]] = [
        {
            "apiVersion": "tabby.io/v1",
            "kind": "IPPool",
            "metadata": {"name": "default-ipv4-ippool"},
            "spec": {"cidr": ipv4_pool, "blockSize": 26},
        }
    ]
    if ipv6_pool:
        docs.append(
            {
                "apiVersion": "tabby.io/v1",
                "kind": "IPPool",
                "metadata": {"name": "default-ipv6-ippool"},
                "spec": {"cidr": ipv6_pool, "blockSize": 122},
            }
        )
    try:
        ResourceClient(store).apply(docs)
        cidrs = [ipv4_pool, *([ipv6_pool] if ipv6_pool else [])]
        log.warning("created the default pools: %s", ", ".join(cidrs))
    except (RevisionConflict, Exception) as e:  # another node was faster: theirs stand
        if store.list("pool"):
            return
        raise DatastoreError("cannot create the default pools", str(e)) from None
