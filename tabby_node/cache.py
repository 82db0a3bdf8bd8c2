"""tabby-node's mirror of the datastore: the documents it watches, fed by ``store.sync`` and
parsed once per revision (``resources.index``)."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterable
from typing import TypeVar

from bundle.types import JSON
from datastore.base import Doc, SyncEvent
from datastore.cached import UNKNOWN, Unknown
from resources.heartbeat import CONTROLLERS_KEY
from resources.index import (
    BLOCKS,
    ENDPOINTS,
    HEARTBEATS,
    NAMESPACES,
    NODE_KINDS,
    PODS,
    POLICY,
    ROUTING,
    TRACES,
    Change,
    Documents,
    Entry,
    Index,
    Kind,
)
from resources.remote import RemoteEndpoint, RemotePod, reduce_pod

T = TypeVar("T")

#: The handle of every allocation in another node's block as this node keeps it (its owner's
#: handles are read from the store, never from this copy).
REMOTE_HANDLE = "(another node's)"

#: The store kinds tabby-node watches: routing's, policy's, and the policy traces other
#: nodes ask of it (which the dataplane does not depend on: no reconcile for them).
WATCHED_KINDS = NODE_KINDS


class Cache:
    """The watched documents, typed; ``version`` grows with every change, ``changed`` and
    ``wake`` wake the dataplane thread."""

    def __init__(self, me: str | None = None, *, pods_from_api: bool = False) -> None:
        self.lock = threading.Lock()
        #: This node's name (None: not known yet, every stored document is kept).
        self.me = me
        #: Pods come from the Kubernetes API itself (the Kubernetes datastore), not from
        #: tabby-kube-controllers' mirror: a new pod is always on its way.
        self.pods_from_api = pods_from_api
        #: Notified on every change (``wait_mirrored`` waits on it).
        self.updated = threading.Condition(self.lock)
        self.index = Index(
            (*ROUTING, *POLICY, TRACES),
            keep_raw={
                PODS.name: self._pod,
                ENDPOINTS.name: self._endpoint,
                BLOCKS.name: self._block,
            },
            # other nodes' held as what policy reads of them, not as models
            compact={PODS.name: RemotePod.of, ENDPOINTS.name: RemoteEndpoint.of},
        )
        self.version = 0
        self.synced = threading.Event()
        #: Set when a document changed that the dataplane depends on (a reconcile is due).
        self.changed = threading.Event()
        #: Wakes the dataplane loop: a change, or a CNI call waiting for its pod's rules.
        self.wake = threading.Event()
        self.resyncs = 0
        self.last_error: str | None = None
        #: node -> its allocations in other nodes' reduced blocks (None: none named)
        self._holders: dict[str | None, JSON] = {}

    def _mine(self, doc: Doc, field: str) -> bool:
        """The document is this node's (``spec.<field>``), or whose it is cannot be told."""
        spec = doc.data.get("spec")
        node = spec.get(field) if isinstance(spec, dict) else None
        return self.me is None or not isinstance(node, str) or node == self.me

    def _endpoint(self, doc: Doc) -> tuple[Doc, bool]:
        """A WorkloadEndpoint: this node's kept whole (its CNI calls read them through the
        optimistic path: ``tabby_node.knowledge``); another node's held as what policy
        reads of it (``resources.remote.RemoteEndpoint``: neither its stored form nor its
        model)."""
        return doc, self._mine(doc, "node")

    def _pod(self, doc: Doc) -> tuple[Doc, bool]:
        """A Pod: this node's kept whole (the CNI ADD reads its labels, ``wait_mirrored``
        its uid); of another node's only what policy reads is parsed (name, namespace,
        labels, node, the containers' named ports: ``policy.inputs.pod``), held as
        ``resources.remote.RemotePod``, and nothing kept of its stored form. Its
        annotations, uid, addresses and unnamed ports were half of the model's memory, and
        the model the rest, for nothing on this node."""
        if self._mine(doc, "nodeName"):
            return doc, True
        reduced = reduce_pod(doc.data)
        if reduced is None:
            return doc, False  # malformed: parsed as it is (and refused there)
        return Doc(reduced, doc.revision), False

    def _block(self, doc: Doc) -> tuple[Doc, bool]:
        """Another node's IPAM block, reduced to what this node reads of it: routing (its
        affinity, who holds each address) and the IPAM gauges (how many are in use). An
        allocation's handle, sequence number and other attributes (pod, container,
        namespace, netns: ~1.2 KB each) are its owner's: each allocation becomes the one
        shared record of its holder (``REMOTE_HANDLE``, seq 0, the holder's node); this
        node's CNI calls read such a block from the store (``raw_kept``), never from this
        copy. A malformed allocation stays as it is (the block is refused as the stored
        one would be)."""
        data = doc.data
        allocations = data.get("allocations")
        if self.me is None or data.get("affinity") == f"host:{self.me}":
            return doc, True
        if not isinstance(allocations, list):
            return doc, True  # malformed: kept as is, for the views to report
        reduced = []
        for a in allocations:
            if (
                isinstance(a, dict)
                and isinstance(a.get("handle"), str)
                and type(a.get("seq")) is int
                and isinstance(a.get("attrs", {}), dict)
            ):
                a = self._allocation((a.get("attrs") or {}).get("node"))
            reduced.append(a)
        return Doc({**data, "allocations": reduced}, doc.revision), True

    def _allocation(self, node: object) -> JSON:
        """The reduced allocation of a holder: one dict per node, shared by all of its
        allocations in other nodes' blocks (read only), or a new one for an odd value."""
        if node is not None and not isinstance(node, str):
            return {"handle": REMOTE_HANDLE, "seq": 0, "attrs": {"node": node}}
        shared = self._holders.get(node)
        if shared is None:
            if len(self._holders) >= 10_000:  # names of nodes long gone
                self._holders.clear()
            attrs = {} if node is None else {"node": sys.intern(node)}
            shared = self._holders[node] = {"handle": REMOTE_HANDLE, "seq": 0, "attrs": attrs}
        return shared

    def apply(self, event: SyncEvent) -> None:
        with self.lock:
            if event.type == "snapshot":
                self.resyncs += 1
            elif (
                event.type == "put"
                and event.kind == HEARTBEATS.name
                and self.index.has(event.kind, event.key)
            ):
                # A live node's heartbeat renewed: nothing the dataplane depends on changed
                # (a node appearing or expiring does). No reconcile for it: with many nodes
                # these are most of the watch events.
                self.index.apply(event)
                self.last_error = None
                self.synced.set()
                return
            if event.kind == TRACES.name:  # for the tracer alone (tabby_node.tracer)
                if self.index.apply(event):
                    self.version += 1
                    self.updated.notify_all()
                self.last_error = None
                self.synced.set()
                return
            # a snapshot is the watch's to give away: consumed as it is parsed
            changed = self.index.apply(event, consume=True)
            if changed:
                self.version += 1
                self.updated.notify_all()
            self.last_error = None
        self.synced.set()
        if changed:
            self.changed.set()
            self.wake.set()

    def put_local(self, kind: str, key: str, doc: Doc | None) -> None:
        """What this node just wrote, ahead of the watch (which will say the same, and
        then changes nothing: so the change is due to the dataplane now)."""
        with self.lock:
            if doc is None:
                changed = self.index.delete(kind, key)
            else:
                changed = self.index.put(kind, key, doc)
            if changed:
                self.version += 1
                self.updated.notify_all()
        if changed:
            self.changed.set()
            self.wake.set()

    def endpoint_of_blocks(self, key: str, addresses: Iterable[str]) -> Doc | None:
        """The Kubernetes datastore's endpoint ``key`` as its watch will make it of this
        node's blocks holding ``addresses`` (``stores.kube.kinds.endpoints_of``), at the
        latest of their revisions: what a served ADD's own block write makes, ahead of the
        watch (None: a block is not held whole)."""
        import ipaddress

        from stores.kube.kinds import endpoints_of

        ips = [ipaddress.ip_address(a) for a in addresses]
        with self.lock:
            found: dict[str, JSON] = {}
            revision = 0
            for cidr in self.index.whole("block"):  # this node's blocks: a few
                doc = self.index.raw_get("block", cidr)
                net = ipaddress.ip_network(cidr)
                if doc is not None and any(ip in net for ip in ips):
                    found[cidr] = doc.data
                    revision = max(revision, doc.revision)
        data = endpoints_of(found).get(key)
        return None if data is None else Doc(data, revision)

    def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
        """A watched document as stored (None: it does not exist), once the first snapshot
        is in; ``UNKNOWN`` for other kinds or before, and for a document whose stored form
        is not kept whole (another node's Pod, WorkloadEndpoint or block)."""
        with self.lock:
            if not self.synced.is_set() or not self.index.watches(kind):
                return UNKNOWN
            if not self.index.raw_kept(kind, key):
                return UNKNOWN
            return self.index.raw_get(kind, key)

    def watches(self, kind: str) -> bool:
        return self.index.watches(kind)

    def get(self, kind: Kind[T], key: str) -> T | None:
        """One document, typed (no snapshot of the rest)."""
        with self.lock:
            return self.index.get(kind, key)

    def wait_mirrored(self, namespace: str, name: str, uid: str, timeout: float) -> bool:
        """Wait until the Pod ``namespace/name`` (of this ``uid``, when given) and its
        Namespace are in the cache, so that a new pod's rules are made from its labels.
        True at once when tabby-kube-controllers are not running (nothing mirrors them:
        the pod starts with what the datastore has), unless the pods come from the API
        itself (``pods_from_api``); False when ``timeout`` passed."""
        deadline = time.monotonic() + timeout
        with self.updated:
            while True:
                if not self.pods_from_api and not self.index.has(HEARTBEATS.name, CONTROLLERS_KEY):
                    return True
                pod = self.index.get(PODS, f"{namespace}/{name}")
                if (
                    pod is not None
                    # another node's (its uid is not held): not the pod starting here
                    and (not uid or (not isinstance(pod, RemotePod) and pod.metadata.uid == uid))
                    and self.index.has(NAMESPACES.name, namespace)
                ):
                    return True
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.updated.wait(left)

    def of(self, kind: Kind[T]) -> dict[str, Entry[T]]:
        """One kind's documents, typed (no snapshot of the rest)."""
        with self.lock:
            return self.index.of(kind)

    def view(self) -> Documents:
        with self.lock:
            return self.index.snapshot()

    def drain(self, *, snapshot: bool = False) -> tuple[list[Change], Documents | None]:
        """The documents that changed since the last drain (each once, typed, as they are
        now) and, with ``snapshot``, every document at the same instant: the changes
        applied to what the previous drains gave make exactly that snapshot."""
        with self.lock:
            return self.index.drain(), (self.index.snapshot() if snapshot else None)

    def has(self, kind: str, key: str) -> bool:
        """A document is held (also one that did not parse)."""
        with self.lock:
            return self.index.has(kind, key)

    def values(self, kind: Kind[T]) -> list[T]:
        """Every parsed document of a kind (for small kinds: pools)."""
        with self.lock:
            return self.index.values(kind)
