"""The datastore's documents as typed objects, parsed once per revision.

A document leaves the JSON edge here: :class:`Index` keeps, for every watched document, what
the store holds (its :class:`~datastore.base.Doc`, which the IPAM core's views still read)
and the typed object parsed from it, the first time that revision is seen. A revision is
never reused for a key, so an object parsed once is good until the next write. Readers take
a :class:`Documents` snapshot and ask it for a kind by its typed handle::

    docs = index.snapshot()
    for name, entry in docs.of(NODES).items():      # Mapping[str, Entry[Node]]
        entry.value.spec.ipv4Address, entry.revision

Kinds and what they parse into: resources through their models (``IPPool``, ``Node``,
``BGPConfiguration``, ``BGPPeer``, ``NetworkPolicy``, ``Namespace``, ``Pod``,
``WorkloadEndpoint``, and Calico's policy kinds of ``resources.calico``: defaults applied,
validated), blocks through the IPAM core
(:class:`~ipam.core.block.Block`), heartbeats as :class:`~resources.heartbeat.Heartbeat`,
policy traces as :mod:`resources.trace`'s request and answer. A
document that does not parse is left out of the typed view and logged once per revision
(its raw document stays, so the IPAM views can still report it).

Measured (2-core VM): parsing a WorkloadEndpoint through its model ~28 µs, a Pod ~22 µs, a
Node ~35 µs; the engine conversions after it cost as much. Parsed once per revision, a pass
over 1,000 nodes no longer validates 1,000 documents.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from datastore.base import Doc, SyncEvent, Undecoded
from datastore.errors import StoreCorrupt

if TYPE_CHECKING:
    from datastore.base import Store
    from ipam.core.block import Block
    from resources.calico import (
        CalicoNetworkPolicy,
        GlobalNetworkPolicy,
        GlobalNetworkSet,
        HostEndpoint,
        NetworkSet,
        StagedGlobalNetworkPolicy,
        StagedKubernetesNetworkPolicy,
        StagedNetworkPolicy,
        Tier,
    )
    from resources.heartbeat import Heartbeat
    from resources.k8s import Namespace, NetworkPolicy, Pod
    from resources.remote import RemoteEndpoint, RemotePod
    from resources.tabby import BGPConfiguration, BGPPeer, IPPool, Node, WorkloadEndpoint
    from resources.trace import TraceAnswer, TraceRequest

log = logging.getLogger("tabby.resources")

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclasses.dataclass(frozen=True, slots=True)
class Change:
    """One document that changed since the consumer last drained the index: ``value`` is
    its typed object now, None when it is gone (deleted, expired, or no longer parses).
    The consumer keeps what it derived from the previous value itself."""

    kind: str
    key: str
    value: object | None


@dataclasses.dataclass(frozen=True, slots=True)
class Entry(Generic[T_co]):
    """One document: the typed object and the store revision it was parsed from."""

    value: T_co
    revision: int


class Kind(Generic[T_co]):
    """A store kind and how its documents become typed objects."""

    __slots__ = ("label", "name", "parse")

    def __init__(self, name: str, parse: Callable[[str, Doc], T_co], label: str = "") -> None:
        self.name = name
        self.parse = parse
        self.label = label or name  #: as operators call it (``NetworkPolicy``)

    def __repr__(self) -> str:
        return f"Kind({self.name})"


def _resource(label: str, store_kind: str) -> Kind[Any]:
    """The kind of a resource model, parsed through ``resources.storage`` (the model class
    is looked up by name when the first document arrives, so that importing this module
    does not import pydantic; its annotation below says which model it is)."""

    def parse(key: str, doc: Doc) -> object:
        from resources.storage import BY_STORE_KIND, to_resource

        return to_resource(BY_STORE_KIND[store_kind], key, doc, f"{store_kind} {key}")

    return Kind(store_kind, parse, label)


def _block(key: str, doc: Doc) -> Block:
    from ipam.core.block import Block

    return Block.from_data(doc.data, f"block {key}")


def _heartbeat(key: str, doc: Doc) -> Heartbeat:
    from resources.heartbeat import Heartbeat

    return Heartbeat.from_data(doc.data, f"heartbeat {key}")


def _trace(key: str, doc: Doc) -> TraceRequest | TraceAnswer:
    from resources.trace import parse

    return parse(key, doc.data, f"trace {key}")


NODES: Kind[Node] = _resource("Node", "node")
HEARTBEATS: Kind[Heartbeat] = Kind("heartbeat", _heartbeat)
POOLS: Kind[IPPool] = _resource("IPPool", "pool")
BLOCKS: Kind[Block] = Kind("block", _block)
BGP_CONFIGURATIONS: Kind[BGPConfiguration] = _resource("BGPConfiguration", "bgpconfiguration")
BGP_PEERS: Kind[BGPPeer] = _resource("BGPPeer", "bgppeer")
POLICIES: Kind[NetworkPolicy] = _resource("NetworkPolicy", "networkpolicy")
NAMESPACES: Kind[Namespace] = _resource("Namespace", "namespace")
#: Of an index with ``compact`` (tabby-node): other nodes' as ``resources.remote``'s records.
PODS: Kind[Pod | RemotePod] = _resource("Pod", "pod")
ENDPOINTS: Kind[WorkloadEndpoint | RemoteEndpoint] = _resource(
    "WorkloadEndpoint", "workloadendpoint"
)
TRACES: Kind[TraceRequest | TraceAnswer] = Kind("trace", _trace)
# Calico's policy model (resources.calico)
CALICO_POLICIES: Kind[CalicoNetworkPolicy] = _resource("NetworkPolicy", "calico-networkpolicy")
GLOBAL_POLICIES: Kind[GlobalNetworkPolicy] = _resource("GlobalNetworkPolicy", "globalnetworkpolicy")
STAGED_POLICIES: Kind[StagedNetworkPolicy] = _resource("StagedNetworkPolicy", "stagednetworkpolicy")
STAGED_GLOBAL_POLICIES: Kind[StagedGlobalNetworkPolicy] = _resource(
    "StagedGlobalNetworkPolicy", "stagedglobalnetworkpolicy"
)
STAGED_KUBERNETES_POLICIES: Kind[StagedKubernetesNetworkPolicy] = _resource(
    "StagedKubernetesNetworkPolicy", "stagedkubernetesnetworkpolicy"
)
TIERS: Kind[Tier] = _resource("Tier", "tier")
NETWORK_SETS: Kind[NetworkSet] = _resource("NetworkSet", "networkset")
GLOBAL_NETWORK_SETS: Kind[GlobalNetworkSet] = _resource("GlobalNetworkSet", "globalnetworkset")
HOST_ENDPOINTS: Kind[HostEndpoint] = _resource("HostEndpoint", "hostendpoint")

#: What Calico's policy model adds (the same store kinds as ``datastore.base.CALICO_KINDS``).
CALICO_POLICY: tuple[Kind[object], ...] = (
    CALICO_POLICIES,
    GLOBAL_POLICIES,
    STAGED_POLICIES,
    STAGED_GLOBAL_POLICIES,
    STAGED_KUBERNETES_POLICIES,
    TIERS,
    NETWORK_SETS,
    GLOBAL_NETWORK_SETS,
    HOST_ENDPOINTS,
)
ALL: tuple[Kind[object], ...] = (
    NODES,
    HEARTBEATS,
    POOLS,
    BLOCKS,
    BGP_CONFIGURATIONS,
    BGP_PEERS,
    POLICIES,
    NAMESPACES,
    PODS,
    ENDPOINTS,
    TRACES,
    *CALICO_POLICY,
)
BY_NAME: dict[str, Kind[object]] = {k.name: k for k in ALL}
#: What routing reads, and what policy reads (tabby-node watches both).
ROUTING: tuple[Kind[object], ...] = tuple(
    BY_NAME[n] for n in ("node", "heartbeat", "pool", "block", "bgpconfiguration", "bgppeer")
)
#: What the policy engine reads (tabby-node watches it; ``tabbyctl policy`` reads it): the
#: Kubernetes kinds and Calico's policies (staged ones and staged Kubernetes policies
#: included), network sets, tiers and host endpoints.
POLICY: tuple[Kind[object], ...] = (
    *(BY_NAME[n] for n in ("networkpolicy", "namespace", "pod", "workloadendpoint")),
    *CALICO_POLICY,
)
#: The store kinds a tabby-node watches (directly, or through tabby-typha): routing's,
#: policy's, and the policy traces other nodes ask of it.
NODE_KINDS: tuple[str, ...] = tuple(k.name for k in (*ROUTING, *POLICY, TRACES))


class Documents:
    """A read-only snapshot of an :class:`Index` (what one reconcile pass works on)."""

    __slots__ = ("_raw", "_typed")

    def __init__(
        self,
        typed: Mapping[str, Mapping[str, Entry[object]]],
        raw: Mapping[str, Mapping[str, Doc]],
    ) -> None:
        self._typed = typed
        self._raw = raw

    def of(self, kind: Kind[T]) -> Mapping[str, Entry[T]]:
        """The documents of ``kind`` that parsed, by key."""
        return cast("Mapping[str, Entry[T]]", self._typed.get(kind.name, {}))

    def get(self, kind: Kind[T], key: str) -> T | None:
        entry = self.of(kind).get(key)
        return None if entry is None else entry.value

    def raw(self, kind: str) -> Mapping[str, Doc]:
        """The documents of a store kind as stored (also those that did not parse; of an
        index with ``keep_raw``, only those it kept)."""
        return self._raw.get(kind, {})

    def raw_kinds(self) -> Mapping[str, Mapping[str, Doc]]:
        return self._raw

    @classmethod
    def read(cls, store: Store, kinds: Iterable[Kind[object]]) -> Documents:
        """A snapshot straight from a store (tabbyctl: no watch, parse what is read)."""
        kinds = tuple(kinds)
        return cls.from_raw({k.name: dict(store.list(k.name)) for k in kinds}, kinds)

    @classmethod
    def from_raw(
        cls, raw: Mapping[str, Mapping[str, Doc]], kinds: Iterable[Kind[object]] = ()
    ) -> Documents:
        """A snapshot of stored documents, parsed now (``kinds``: every known one)."""
        index = Index(kinds or ALL)
        index.replace(raw)
        return index.snapshot()


#: What to parse of a stored document, and whether to keep that besides its typed object:
#: ``(doc, True)`` the document whole; ``(reduced, True)`` a reduced copy, kept for
#: read-only views (``raw``) and parsed instead of the whole one (its typed object then
#: holds no more); ``(doc or reduced, False)`` the typed object only.
KeepRaw = Callable[[Doc], tuple[Doc, bool]]
#: What to hold of a parsed document whose stored form is not kept whole (``keep_raw``):
#: the typed object made smaller (``resources.remote``), from the validated model (untyped:
#: each kind's own model, one mapping holds them all).
Compact = Callable[[Any], object]


class Index:
    """The typed mirror of some kinds of the datastore (not thread-safe: the caller locks).

    ``apply(event)`` takes ``store.sync`` events; ``put``/``delete`` what the caller just
    wrote itself. Each returns whether anything changed. Every change is also journalled:
    ``drain()`` returns the documents that changed since the last ``drain`` (a fresh
    snapshot only journals what differs from what was held), so that a consumer's work per
    event is for what that event touched.

    ``keep_raw``: for the kinds it names, what is kept of the stored document (its JSON
    data) and parsed is what the function returns (tabby-node: the Pods and
    WorkloadEndpoints of its own node whole, which its CNI calls read through the optimistic
    path; of other nodes' only the typed object, of a Pod the part policy reads; other
    nodes' IPAM blocks reduced to what routing and the IPAM gauges read). Of a
    document not kept whole, ``raw_kept`` is False: ``raw_get`` is not the document as
    stored, and a caller that writes reads the store. A remote pod's stored form is as big
    as its typed object: with 20k endpoints in the cluster, keeping both would double the
    agent's memory for nothing.

    ``compact``: for the kinds it names, a document not kept whole is held as what the
    function makes of its model (parsed and validated first), not as the model: tabby-node
    holds other nodes' Pods and WorkloadEndpoints as ``resources.remote``'s records, what
    policy reads of them (a model and the strings it references cost ~20 times more).
    """

    def __init__(
        self,
        kinds: Iterable[Kind[object]],
        keep_raw: Mapping[str, KeepRaw] | None = None,
        compact: Mapping[str, Compact] | None = None,
    ) -> None:
        self.kinds = tuple(kinds)
        self._kinds = {k.name: k for k in self.kinds}
        self._keep_raw = dict(keep_raw or {})
        self._compact = dict(compact or {})
        self._typed: dict[str, dict[str, Entry[object]]] = {k: {} for k in self._kinds}
        #: the stored documents kept (all, but for the kinds of ``keep_raw``)
        self._raw: dict[str, dict[str, Doc]] = {k: {} for k in self._kinds}
        #: the revision of every document held
        self._revs: dict[str, dict[str, int]] = {k: {} for k in self._kinds}
        #: of the kinds of ``keep_raw``: the keys whose stored form is kept whole (the few
        #: of this node: a set of every other one cost more than the records themselves)
        self._whole: dict[str, set[str]] = {k: set() for k in self._keep_raw}
        #: (kind, key) -> revision that did not parse: logged once, not parsed again.
        self._bad: dict[tuple[str, str], int] = {}
        self.parsed = 0  # documents parsed so far (tests, metrics)
        #: (kind, key) changed since the last drain, in order of first change
        self._dirty: dict[tuple[str, str], None] = {}

    def drain(self) -> list[Change]:
        """The documents that changed since the last call, each once, with its value now."""
        dirty, self._dirty = self._dirty, {}
        out = []
        for kind, key in dirty:
            entry = self._typed[kind].get(key)
            out.append(Change(kind, key, None if entry is None else entry.value))
        return out

    def pending(self) -> int:
        """How many documents changed since the last ``drain``."""
        return len(self._dirty)

    def apply(self, event: SyncEvent, *, consume: bool = False) -> bool:
        """Take one ``store.sync`` event; ``consume``: a snapshot's dicts are emptied as
        they are taken (see ``replace``)."""
        if event.type == "snapshot":
            self.replace(event.snapshot or {}, consume=consume)
            return True
        if event.type == "put" and event.doc is not None:
            return self.put(event.kind, event.key, event.doc)
        if event.type == "delete":
            return self.delete(event.kind, event.key)
        return False

    def replace(self, snapshot: Mapping[str, Mapping[str, Doc]], *, consume: bool = False) -> None:
        """Everything anew (a fresh snapshot): entries whose revision did not change keep
        their parsed object. ``consume`` (the snapshot is the caller's to give away: its
        kinds must then be ``dict`` or ``datastore.base.Undecoded``): each document is
        removed from it as it is taken, so that what is not kept of it is freed at once,
        not after the whole snapshot was parsed (the memory peak of a first sync is then
        the larger of the documents and what is kept of them, not their sum; of an
        ``Undecoded`` snapshot, one document decoded at a time)."""
        old_typed = self._typed
        old_revs = self._revs
        self._typed = {k: {} for k in self._kinds}
        self._raw = {k: {} for k in self._kinds}
        self._revs = {k: {} for k in self._kinds}
        bad = self._bad
        self._bad = {}
        self._whole = {k: set() for k in self._keep_raw}
        for name in self._kinds:
            before = old_typed[name]
            held = old_revs[name]
            now = snapshot.get(name) or {}
            keys = list(now)
            given = now if consume and isinstance(now, dict | Undecoded) else None
            for key in keys:
                try:
                    taken = given.pop(key) if given is not None else now[key]
                except StoreCorrupt as e:  # an Undecoded value: decoded once by the store
                    log.warning("skipping %s %s: %s", self._kinds[name].label, key, e.reason)
                    continue
                doc = self._hold(name, key, taken)
                entry = before.get(key)
                if entry is not None and entry.revision == doc.revision:
                    self._typed[name][key] = entry
                    continue
                if bad.get((name, key)) == doc.revision:
                    self._bad[(name, key)] = doc.revision
                else:
                    self._parse(name, key, doc)
                if held.get(key) != doc.revision:
                    self._dirty[(name, key)] = None
            for key in held.keys() - set(keys):
                self._dirty[(name, key)] = None

    def put(self, kind: str, key: str, doc: Doc) -> bool:
        """Take a document (from the watch, or what the caller just wrote); an older
        revision than the one held is ignored."""
        if kind not in self._kinds:
            return False
        current = self._revs[kind].get(key)
        if current is not None and current >= doc.revision:
            return False
        doc = self._hold(kind, key, doc)
        self._typed[kind].pop(key, None)
        self._bad.pop((kind, key), None)
        self._parse(kind, key, doc)
        self._dirty[(kind, key)] = None
        return True

    def delete(self, kind: str, key: str) -> bool:
        if kind not in self._kinds:
            return False
        self._typed[kind].pop(key, None)
        self._bad.pop((kind, key), None)
        self._raw[kind].pop(key, None)
        whole = self._whole.get(kind)
        if whole is not None:
            whole.discard(key)
        if self._revs[kind].pop(key, None) is None:
            return False
        self._dirty[(kind, key)] = None
        return True

    def get(self, kind: Kind[T], key: str) -> T | None:
        entry = self._typed.get(kind.name, {}).get(key)
        return None if entry is None else cast("T", entry.value)

    def has(self, kind: str, key: str) -> bool:
        return key in self._revs.get(kind, {})

    def of(self, kind: Kind[T]) -> dict[str, Entry[T]]:
        """One kind's typed documents (a copy)."""
        return cast("dict[str, Entry[T]]", dict(self._typed.get(kind.name, {})))

    def values(self, kind: Kind[T]) -> list[T]:
        """Every parsed document of ``kind``, in key order."""
        held = self._typed.get(kind.name, {})
        return [cast("T", held[key].value) for key in sorted(held)]

    def watches(self, kind: str) -> bool:
        return kind in self._kinds

    def raw_get(self, kind: str, key: str) -> Doc | None:
        """A document of a kind this index holds, as stored (None: not held, or its
        stored form not kept: ``raw_kept``)."""
        return self._raw[kind].get(key)

    def whole(self, kind: str) -> list[str]:
        """The keys of ``kind`` whose stored form is kept whole (of a kind of ``keep_raw``:
        the few the caller chose; else every one)."""
        kept = self._whole.get(kind)
        return list(kept) if kept is not None else list(self._raw.get(kind, ()))

    def raw_kept(self, kind: str, key: str) -> bool:
        """``raw_get`` knows: the document is not held, or its stored form is kept whole."""
        if key not in self._revs[kind]:
            return True
        return self._is_whole(kind, key)

    def _is_whole(self, kind: str, key: str) -> bool:
        whole = self._whole.get(kind)
        return whole is None or key in whole

    def _hold(self, kind: str, key: str, doc: Doc) -> Doc:
        """Record ``doc`` (its revision, and what is kept of it); returns what to parse."""
        self._revs[kind][key] = doc.revision
        how = self._keep_raw.get(kind)
        parsed, keep = (doc, True) if how is None else how(doc)
        if not keep:
            self._raw[kind].pop(key, None)
        else:
            self._raw[kind][key] = parsed
        whole = self._whole.get(kind)
        if whole is not None:
            if keep and parsed is doc:
                whole.add(key)
            else:
                whole.discard(key)
        return parsed

    def snapshot(self) -> Documents:
        return Documents(
            {k: dict(v) for k, v in self._typed.items()},
            {k: dict(v) for k, v in self._raw.items()},
        )

    def _parse(self, kind: str, key: str, doc: Doc) -> None:
        self.parsed += 1
        handle = self._kinds[kind]
        try:
            value = handle.parse(key, doc)
            compact = self._compact.get(kind)
            if compact is not None and not self._is_whole(kind, key):
                value = compact(value)
        except StoreCorrupt as e:
            log.warning("skipping %s %s: %s", handle.label, key, e.reason)
        except (ValueError, TypeError) as e:  # e.g. "metadata" that is not a map
            log.warning("skipping %s %s: %s", handle.label, key, e)
        else:
            self._typed[kind][key] = Entry(value, doc.revision)
            return
        self._bad[(kind, key)] = doc.revision
