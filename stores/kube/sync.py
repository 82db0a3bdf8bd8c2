"""``KubeStore.sync``: the watched kinds from a list and a watch per Kubernetes collection.

One thread per collection lists it (``resourceVersion=0``: from the API server's watch cache,
not etcd) and watches from the list's version with bookmarks; a broken watch resumes from
the last version it delivered (a bookmark's included: ``sync_stats["resumes"]``), a
``410 Gone`` lists again after a random pause of up to ``RELIST_JITTER`` seconds (a
restarted API server must not be listed by every node at once) and only the differences
from what was reported are yielded (``sync_stats["rereads"]``). The iterator's own thread
turns the collections' events into the store's documents (``stores.kube.kinds``):

- one document per object for tabby's own kinds and Kubernetes' (a Pod, Namespace or
  NetworkPolicy event whose document did not change, e.g. a pod's status, yields nothing);
- ``node``: tabby's Node joined with the v1 Node's labels (either changing yields it);
- ``heartbeat``: a v1 Node while its Ready condition is True (only a change of readiness
  yields: the kubelet's status updates do not);
- ``workloadendpoint``: from the blocks' allocations, per attachment (a block event yields
  the endpoints whose addresses it changed). Held per block: the attachments' few
  attributes, not the block.

The first event is one snapshot of every watched kind, once every collection has been
listed once.

Deleting a CustomResourceDefinition deletes every object of its kind (``kubectl delete -f
manifests/tabby.yaml`` does): what tabby holds must not follow, or an uninstall would withdraw
every route and endpoint of the pods still running. So before a deletion of one of tabby's
objects is reported (and before a snapshot or a re-list, which may lack some), the kind's
definition is read (``GET``, one per such event: deletions of pools, blocks and Nodes are
rare); when it is gone or being deleted the iterator raises ``StoreRemoved`` instead, and
the reader keeps what it had (tabby-node: its dataplane as it is).
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import random
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING

from datastore.base import Doc, SyncEvent
from datastore.engine import Reported
from datastore.errors import StoreRemoved
from stores.kube import kinds
from stores.kube.client import ApiError, Gone, NotFound

if TYPE_CHECKING:
    from collections.abc import Callable

    from bundle.types import JSON
    from stores.kube.client import KubeClient

log = logging.getLogger("tabby.datastore")

#: seconds, at most, a re-list after a 410 Gone waits (a random pause in [0, this])
RELIST_JITTER = 5.0
#: the first and the longest pause before a failed list or watch is tried again
RETRY_PAUSE = (0.2, 5.0)
#: seconds the server keeps a watch open before ending it (it is then opened again)
WATCH_SECONDS = 300
#: where a CustomResourceDefinition is read (tabby-node may ``get`` its own kinds' only)
CRD_PATH = "/apis/apiextensions.k8s.io/v1/customresourcedefinitions/"


def _collections(kind: str) -> tuple[str, ...]:
    """The collection paths a store kind is made from."""
    if kind == "node":
        return (kinds.CRDS["node"].path, kinds.V1_NODES)
    if kind in kinds.CRDS:
        return (kinds.CRDS[kind].path,)
    if kind in kinds.NATIVE:
        return (kinds.NATIVE[kind].path,)
    if kind == "heartbeat":
        return (kinds.V1_NODES,)
    if kind == "workloadendpoint":
        return (kinds.CRDS["block"].path,)
    return ()  # "handle": never on the API


_KIND_OF_PATH = {crd.path: kind for kind, crd in kinds.CRDS.items()}
#: the kinds made of several objects (or of part of one)
_MADE = frozenset({"node", "heartbeat", "workloadendpoint"})
_NATIVE_OF_PATH = {native.path: kind for kind, native in kinds.NATIVE.items()}


def _digest(data: object) -> bytes:
    return hashlib.blake2b(
        json.dumps(data, sort_keys=True, separators=(",", ":")).encode(), digest_size=12
    ).digest()


class _Attachment:
    """What an endpoint is made of, of one allocation: its attributes and address."""

    __slots__ = ("address", "attrs", "handle")

    def __init__(self, handle: str, attrs: JSON, address: str) -> None:
        self.handle = handle
        self.attrs = attrs
        self.address = address


class KubeSync:
    """One ``sync`` iterator (``run``) of a store whose API ``client`` it reads, counting
    in ``count`` (``Engine.count_sync``) what it read and why."""

    def __init__(
        self,
        client: KubeClient,
        count: Callable[[str], None],
        watched: tuple[str, ...],
        stop: threading.Event,
    ) -> None:
        self.client = client
        self.count = count
        self.watched = watched
        self.stop = stop
        self.paths = tuple(dict.fromkeys(p for k in watched for p in _collections(k)))
        self.events: queue.Queue[tuple[str, str, JSON | list[JSON]]] = queue.Queue()
        self.reported = Reported()
        #: per kind and key, the digest of the document reported (the kinds whose events
        #: are not all changes: Kubernetes' own, and those made of several objects)
        self.digests: dict[str, dict[str, bytes]] = {k: {} for k in watched}
        # -- what is held of the collections ---------------------------------------------
        self.v1: dict[str, tuple[dict[str, str], int, bool, int]] = {}  # labels, rv, ready, rv
        self.tabby_nodes: dict[str, Doc] = {}
        #: block CIDR -> (its revision, its attachments' allocations by handle)
        self.blocks: dict[str, tuple[int, dict[str, list[_Attachment]]]] = {}
        self.handle_blocks: dict[str, set[str]] = {}  # handle -> blocks holding it
        self.endpoint_handles: dict[str, set[str]] = {}  # endpoint key -> its handles
        self.threads: list[threading.Thread] = []
        self.listed: set[str] = set()
        #: the collections listed since the documents were last made from them
        self._listed_items: dict[str, list[JSON]] = {}
        self._unchecked = False  # a definition could not be read (warned once)

    # -- the collections' threads ---------------------------------------------------------

    def _follow(self, path: str) -> None:
        """List, then watch from the list's version; resume after a break, list again
        after a 410 Gone (only then)."""
        client = self.client
        pause = RETRY_PAUSE[0]
        version = ""
        while not self.stop.is_set():
            try:
                if not version:
                    items, version = client.list(path, params={"resourceVersion": "0"})
                    self.events.put(("list", path, items))
                    pause = RETRY_PAUSE[0]
                for event in client.watch(path, version, self.stop, timeout_seconds=WATCH_SECONDS):
                    obj = event.get("object")
                    if isinstance(obj, dict):
                        rv = (obj.get("metadata") or {}).get("resourceVersion")
                        if rv:
                            version = str(rv)
                        if event.get("type") != "BOOKMARK":
                            self.events.put((str(event.get("type")), path, obj))
                    pause = RETRY_PAUSE[0]
                if not self.stop.is_set():
                    self.count("resumes")  # the server ended it: from `version`
            except Gone:
                log.warning("watch of %s: history gone: listing it again", path)
                version = ""
                self.stop.wait(random.uniform(0, RELIST_JITTER))  # noqa: S311 - spreading
                self.count("rereads")
            except ApiError as e:
                if self.stop.is_set():
                    return
                log.warning("watch of %s: %s (again in %.1f s)", path, e, pause)
                self.stop.wait(random.uniform(0, pause))  # noqa: S311 - spreading
                pause = min(pause * 2, RETRY_PAUSE[1])
                if version:
                    self.count("resumes")

    # -- the iterator ---------------------------------------------------------------------

    def run(self) -> Iterator[SyncEvent]:
        try:
            # checked first too: a reader that starts again while tabby's kinds are being
            # deleted costs the API one GET, not a list of every collection
            self._check_installed(*self.paths)
            for path in self.paths:
                t = threading.Thread(
                    target=self._follow, args=(path,), name="kube-watch", daemon=True
                )
                self.threads.append(t)
                t.start()
            yield from self._events()
        finally:
            self.client.close()  # ends the watches (their threads see `stop` too)
            for t in self.threads:
                t.join(timeout=2)

    def _events(self) -> Iterator[SyncEvent]:
        lists: dict[str, list[JSON]] = {}
        #: what the collections listed already delivered while others were being listed:
        #: changes after their lists, reported after the snapshot (dropped, a Node
        #: registered then was never seen)
        early: list[tuple[str, str, JSON]] = []
        snapshot_sent = not self.paths
        if snapshot_sent:
            self.count("snapshots")
            yield self.reported.snapshot({k: {} for k in self.watched})
        while not self.stop.is_set():
            try:
                what, path, payload = self.events.get(timeout=0.5)
            except queue.Empty:
                continue
            if isinstance(payload, list) != (what == "list"):
                continue  # pragma: no cover - a list is a list, an event an object
            if not snapshot_sent:
                if isinstance(payload, list):
                    lists[path] = payload
                    self.listed.add(path)
                    early = [e for e in early if e[1] != path]  # the list is newer
                else:
                    early.append((what, path, payload))
                if self.listed >= set(self.paths):
                    self._check_installed(*self.paths)
                    for p, items in lists.items():
                        self._take_list(p, items)
                    lists.clear()
                    self.count("snapshots")
                    snapshot_sent = True
                    yield self.reported.snapshot(self._documents())
                    for event in early:
                        yield from self._change(*event)
                    early.clear()
                continue
            yield from self._change(what, path, payload)

    def _change(self, what: str, path: str, payload: JSON | list[JSON]) -> Iterator[SyncEvent]:
        """The events of one collection's list again or one change of it, after the
        snapshot."""
        if isinstance(payload, list):
            self._check_installed(path)
            self._take_list(path, payload)
            yield from self._relisted(path)
        else:
            if what == "DELETED":
                self._check_installed(path)
            yield from self._event(what, path, payload)

    def _check_installed(self, *paths: str) -> None:
        """Raise ``StoreRemoved`` if the definition of one of tabby's kinds read from
        ``paths`` is gone or being deleted: its objects' deletions are an uninstall's, not
        a change to follow. Refused or failing reads decide nothing (the event is taken)."""
        for path in paths:
            kind = _KIND_OF_PATH.get(path)
            if kind is None:
                continue
            crd = kinds.CRDS[kind]
            try:
                obj = self.client.get(CRD_PATH + crd.name)
            except NotFound:
                gone = True
            except ApiError as e:
                if not self._unchecked:
                    log.warning("cannot read the definition %s: %s", crd.name, e)
                self._unchecked = True
                continue
            else:
                gone = bool((obj.get("metadata") or {}).get("deletionTimestamp"))
            if gone:
                raise StoreRemoved(
                    f"{self.client.config.server} {crd.name}",
                    "being deleted (tabby uninstalled?): what was read is kept",
                )

    # -- a whole collection (the first list, a re-list) -----------------------------------

    def _take_list(self, path: str, items: list[JSON]) -> None:
        """Hold what the derived kinds need of a listed collection."""
        if path == kinds.V1_NODES:
            self.v1 = {}
            for obj in items:
                self._hold_v1(obj)
        elif path == kinds.CRDS["node"].path:
            self.tabby_nodes = {}
            for obj in items:
                key = kinds.key_of("node", obj)
                if key is not None:
                    self.tabby_nodes[key] = Doc(kinds.to_data("node", obj), kinds.revision_of(obj))
        elif path == kinds.CRDS["block"].path:
            self.blocks, self.handle_blocks, self.endpoint_handles = {}, {}, {}
            for obj in items:
                key = kinds.key_of("block", obj)
                if key is not None:
                    self._hold_block(key, kinds.to_data("block", obj), kinds.revision_of(obj))
        self._listed_items[path] = items

    def _documents(self) -> dict[str, dict[str, Doc]]:
        """Every watched kind's documents, from what the collections hold."""
        out: dict[str, dict[str, Doc]] = {}
        items = self._listed_items
        for kind in self.watched:
            out[kind] = self._kind_documents(kind, items)
        self._listed_items = {}
        return out

    def _kind_documents(self, kind: str, items: Mapping[str, list[JSON]]) -> dict[str, Doc]:
        docs = self._made(kind) if kind in _MADE else self._listed(kind, items)
        self.digests[kind] = {key: _digest(doc.data) for key, doc in docs.items()}
        return docs

    def _made(self, kind: str) -> dict[str, Doc]:
        """The documents of a kind made of several objects, from what is held."""
        docs: dict[str, Doc] = {}
        if kind == "node":
            for name, tabby in self.tabby_nodes.items():
                docs[name] = self._joined(name, tabby)
        elif kind == "heartbeat":
            for name, (_labels, _rv, is_ready, ready_rv) in self.v1.items():
                if is_ready:
                    docs[name] = Doc(kinds.alive(name), ready_rv)
        else:
            for endpoint in list(self.endpoint_handles):
                made = self._endpoint(endpoint)
                if made is not None:
                    docs[endpoint] = made
        return docs

    @staticmethod
    def _listed(kind: str, items: Mapping[str, list[JSON]]) -> dict[str, Doc]:
        """The documents of a kind with one object each, from its listed collection."""
        docs: dict[str, Doc] = {}
        native = kinds.NATIVE.get(kind)
        if native is not None:
            for obj in items.get(native.path, ()):
                projected = native.project(obj)
                if projected is not None:
                    docs[_native_key(native, obj)] = Doc(
                        kinds.stored(projected), kinds.revision_of(obj)
                    )
        elif kind in kinds.CRDS:
            for obj in items.get(kinds.CRDS[kind].path, ()):
                found = kinds.key_of(kind, obj)
                if found is not None and not (kind == "trace" and kinds.expired(obj)):
                    docs[found] = Doc(kinds.to_data(kind, obj), kinds.revision_of(obj))
        return docs

    def _relisted(self, path: str) -> Iterator[SyncEvent]:
        """After a re-list: only what differs from what was reported."""
        items = self._listed_items
        for kind in self.watched:
            if path in _collections(kind):
                docs = self._kind_documents(kind, items)
                yield from self.reported.changes(kind, docs)
        self._listed_items = {}

    # -- one event ------------------------------------------------------------------------

    def _event(self, what: str, path: str, obj: JSON) -> Iterator[SyncEvent]:
        deleted = what == "DELETED"
        if path == kinds.V1_NODES:
            yield from self._v1_event(obj, deleted)
            return
        kind = _KIND_OF_PATH.get(path)
        if kind is not None:
            key = kinds.key_of(kind, obj)
            if key is None:
                return
            data = None if deleted else kinds.to_data(kind, obj)
            doc = None if data is None else Doc(data, kinds.revision_of(obj))
            if kind == "trace" and doc is not None and kinds.expired(obj):
                doc = None
            if kind == "node":
                if doc is None:
                    self.tabby_nodes.pop(key, None)
                else:
                    self.tabby_nodes[key] = doc
                if "node" in self.watched:
                    yield from self._report(
                        "node", key, None if doc is None else self._joined(key, doc)
                    )
                return
            if kind == "block":
                yield from self._block_event(key, doc)
            if kind in self.watched:
                yield from self._report(kind, key, doc, digest=False)
            return
        native_kind = _NATIVE_OF_PATH.get(path)
        if native_kind is not None and native_kind in self.watched:
            native = kinds.NATIVE[native_kind]
            projected = None if deleted else native.project(obj)
            doc = (
                None if projected is None else Doc(kinds.stored(projected), kinds.revision_of(obj))
            )
            yield from self._report(native_kind, _native_key(native, obj), doc)

    def _report(
        self, kind: str, key: str, doc: Doc | None, *, digest: bool = True
    ) -> Iterator[SyncEvent]:
        """The event for ``doc`` now (None: gone), unless its document did not change."""
        digests = self.digests.setdefault(kind, {})
        if doc is None:
            digests.pop(key, None)
        elif digest:
            new = _digest(doc.data)
            if digests.get(key) == new:
                return
            digests[key] = new
        event = self.reported.change(kind, key, doc)
        if event is not None:
            yield event

    # -- v1 Nodes: labels (node) and readiness (heartbeat) --------------------------------

    def _hold_v1(self, obj: JSON) -> tuple[bool, bool]:
        """Hold a v1 Node; whether its labels, whether its readiness changed."""
        name = str((obj.get("metadata") or {}).get("name") or "")
        rv = kinds.revision_of(obj)
        labels, is_ready = kinds.node_labels(obj), kinds.ready(obj)
        old = self.v1.get(name)
        labels_rv = rv if old is None or old[0] != labels else old[1]
        ready_rv = rv if old is None or old[2] != is_ready else old[3]
        self.v1[name] = (labels, labels_rv, is_ready, ready_rv)
        return old is None or old[0] != labels, old is None or old[2] != is_ready

    def _v1_event(self, obj: JSON, deleted: bool) -> Iterator[SyncEvent]:
        name = str((obj.get("metadata") or {}).get("name") or "")
        if deleted:
            self.v1.pop(name, None)
            labels_changed = ready_changed = True
        else:
            labels_changed, ready_changed = self._hold_v1(obj)
        if labels_changed and "node" in self.watched and name in self.tabby_nodes:
            yield from self._report("node", name, self._joined(name, self.tabby_nodes[name]))
        if ready_changed and "heartbeat" in self.watched:
            held = self.v1.get(name)
            alive = held is not None and held[2]
            doc = Doc(kinds.alive(name), held[3]) if alive and held is not None else None
            yield from self._report("heartbeat", name, doc)

    def _joined(self, key: str, doc: Doc) -> Doc:
        held = self.v1.get(key)
        labels, labels_rv = (held[0], held[1]) if held is not None else (None, 0)
        return Doc(
            kinds.joined_node(doc.data, labels),
            kinds.joined_revision(doc.revision, labels_rv),
        )

    # -- blocks: their attachments (workloadendpoint) -------------------------------------

    def _hold_block(self, cidr: str, data: JSON | None, rev: int) -> set[str]:
        """Hold a block's attachments (None: the block is gone); the endpoint keys whose
        addresses may have changed."""
        touched: set[str] = set()
        old = self.blocks.pop(cidr, None)
        if old is not None:
            for handle in old[1]:
                self.handle_blocks.get(handle, set()).discard(cidr)
                touched |= self._keys_of_handle(handle)
        if data is None:
            return touched
        found: dict[str, list[_Attachment]] = {}
        base = _base(cidr)
        if base is not None:
            version, first = base
            for ordinal, alloc in enumerate(data.get("allocations") or ()):
                if not isinstance(alloc, Mapping):
                    continue
                attrs = alloc.get("attrs")
                if not isinstance(attrs, dict) or not attrs.get("pod_name"):
                    continue
                handle = str(alloc.get("handle", ""))
                address = _address(version, first + ordinal)
                found.setdefault(handle, []).append(_Attachment(handle, _slim(attrs), address))
        self.blocks[cidr] = (rev, found)
        for handle, held in found.items():
            self.handle_blocks.setdefault(handle, set()).add(cidr)
            key = _endpoint_key(handle, held[0].attrs)
            if key is not None:
                self.endpoint_handles.setdefault(key, set()).add(handle)
                touched.add(key)
        return touched

    def _keys_of_handle(self, handle: str) -> set[str]:
        return {key for key, handles in self.endpoint_handles.items() if handle in handles}

    def _block_event(self, cidr: str, doc: Doc | None) -> Iterator[SyncEvent]:
        touched = self._hold_block(
            cidr, None if doc is None else doc.data, doc.revision if doc else 0
        )
        if "workloadendpoint" not in self.watched:
            return
        for key in sorted(touched):
            yield from self._report("workloadendpoint", key, self._endpoint(key))

    def _endpoint(self, key: str) -> Doc | None:
        """The endpoint ``key`` as its handles' allocations make it now (None: none left)."""
        handles = self.endpoint_handles.get(key, set())
        live = {h for h in handles if self.handle_blocks.get(h)}
        if not live:
            self.endpoint_handles.pop(key, None)
            return None
        self.endpoint_handles[key] = live
        blocks: dict[str, JSON] = {}
        rev = 0
        for handle in live:
            for cidr in self.handle_blocks[handle]:
                block_rev, held = self.blocks[cidr]
                rev = max(rev, block_rev)
                entries = blocks.setdefault(cidr, {"allocations": []})["allocations"]
                for att in held.get(handle, ()):
                    entries.append((att.address, att))
        made = kinds.endpoints_of(_as_blocks(blocks))
        data = made.get(key)
        return None if data is None else Doc(data, rev)


# -- helpers -----------------------------------------------------------------------------------

_SLIM = (
    "pod_namespace",
    "pod_name",
    "node",
    "ifname",
    "container_id",
    "host_interface",
    "network",
    "time",
)


def _slim(attrs: JSON) -> JSON:
    return {k: attrs[k] for k in _SLIM if k in attrs}


def _endpoint_key(handle: str, attrs: JSON) -> str | None:
    from resources.wep import endpoint_key

    node, pod, ifname = attrs.get("node"), attrs.get("pod_name"), attrs.get("ifname")
    if not (isinstance(node, str) and node and isinstance(pod, str) and isinstance(ifname, str)):
        return None
    if not ifname or not attrs.get("container_id"):
        return None
    return endpoint_key(str(attrs.get("pod_namespace") or "default"), node, pod, ifname)


def _as_blocks(blocks: dict[str, JSON]) -> dict[str, JSON]:
    """Held attachments as the block documents ``kinds.endpoints_of`` reads (each block's
    allocations at their ordinals)."""
    out: dict[str, JSON] = {}
    for cidr, held in blocks.items():
        base = _base(cidr)
        if base is None:
            continue
        _version, first = base
        allocations: list[object] = []
        for address, att in held["allocations"]:
            import ipaddress

            ordinal = int(ipaddress.ip_address(address)) - first
            while len(allocations) <= ordinal:
                allocations.append(None)
            allocations[ordinal] = {"handle": att.handle, "attrs": att.attrs}
        out[cidr] = {"allocations": allocations}
    return out


def _base(cidr: str) -> tuple[int, int] | None:
    import ipaddress

    try:
        net = ipaddress.ip_network(cidr)
    except ValueError:
        return None
    return net.version, int(net.network_address)


def _address(version: int, value: int) -> str:
    import ipaddress

    return str(ipaddress.IPv4Address(value) if version == 4 else ipaddress.IPv6Address(value))


def _native_key(native: kinds.Native, obj: JSON) -> str:
    meta = obj.get("metadata") or {}
    if native.namespaced:
        return f"{meta.get('namespace')}/{meta.get('name')}"
    return str(meta.get("name"))
