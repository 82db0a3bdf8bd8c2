"""Resources over a Store: get, list, apply, delete.

``apply`` works like ``kubectl apply`` for these kinds: the fields a document sets are merged
into the existing resource (maps key by key, a ``null`` removes a field, lists and scalars
replace), and the result is validated as a whole. Every document of one call is checked
against what is stored before any is written (an invalid one refuses the call with nothing
written); then each document is written on its own, as one compare-and-swap of one stored
document (the store protocol has no transaction: ``datastore.base``), read again and
redone when another writer got in between. A document's ``metadata.resourceVersion`` must
equal the stored revision (else ``Conflict``); without one the last writer wins.

Who may write what is ``resources.mirror``'s: on the Kubernetes datastore
(``kubernetes_datastore``) a write of what Kubernetes owns there (Pods, Namespaces,
NetworkPolicies, a Node's labels) or of a WorkloadEndpoint (made of the allocations there)
is refused while the call is checked, so nothing of it is written.

- A WorkloadEndpoint's labels are its Pod's whenever the Pod exists
  (``resources.wep.effective_labels``, applied when it is read): a Pod's write changes
  nothing else.
- An IPPool is the IPAM pool document: its name and CIDR are unique (a second pool with the
  same name is the same pool; an overlapping CIDR is refused) and its ``cidr`` and
  ``blockSize`` cannot change.

Deleting an IPPool is refused while any of its blocks holds an address (checked before
anything is written); the pool itself is then removed by the IPAM core's
``Ipam.delete_pool`` (it disables the pool first so that no node claims a new block
meanwhile). A block that gets an address in between makes that last step fail
(``Conflict``).
"""

from __future__ import annotations

import builtins
import copy
import ipaddress
import time
import uuid
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

from pydantic import ValidationError

from bundle.types import JSON
from datastore.base import Doc, Store
from datastore.cas import cas
from ipam.core.block import Block
from resources import mirror, wep
from resources.calico import DEFAULT_TIER, Tier, default_tier
from resources.errors import Conflict, InvalidDocument, NotFound, NotOwned
from resources.meta import Resource, effective_namespace, problems, show
from resources.names import namespaced_key, split_namespaced_key
from resources.poolform import pool_name
from resources.storage import (
    BY_MODEL,
    BY_STORE_KIND,
    RESOURCE_KINDS,
    TIERED_STORE_KINDS,
    KindInfo,
    document,
    document_kind,
    key_of,
    resolve_kind,
    stored_data,
    stored_raw,
    to_resource,
    validate,
)
from resources.tabby import IPPool

T = TypeVar("T")


class Applied(NamedTuple):
    """One document's outcome: ``created``, ``configured`` or ``unchanged``."""

    label: str
    action: str
    resource: Resource


class Deleted(NamedTuple):
    label: str
    resource: Resource


def document_label(index: int, doc: object) -> str:
    """``Kind/name`` of the ``index``-th document (from 1), else ``document <index>``."""
    if isinstance(doc, dict):
        kind, meta = doc.get("kind"), doc.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        if isinstance(kind, str) and kind and isinstance(name, str) and name:
            return f"{kind}/{name}"
    return f"document {index}"


def merge(base: JSON, patch: JSON) -> JSON:
    """``patch`` merged into (a copy of) ``base``: maps recursively, ``None`` removes a key,
    everything else replaces."""
    out = copy.deepcopy(base)
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        elif isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merge(out[key], value)
        elif isinstance(value, dict):
            out[key] = merge({}, value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class _Tx:
    """One document's change: reads through to the store, remembering each document's
    revision as first read, and holds the write back; ``write()`` makes it, a
    compare-and-swap at the revision read."""

    def __init__(self, store: Store, *, dry_run: bool = False) -> None:
        self.store = store
        self.dry_run = dry_run  #: plans several changes, each seeing the ones before
        self.read: dict[tuple[str, str], int | None] = {}
        self.pending: dict[tuple[str, str], JSON | None] = {}
        self.after: builtins.list[Callable[[], None]] = []  # run after the write, unlocked

    def get(self, kind: str, key: str) -> tuple[JSON | None, int | None]:
        if (kind, key) not in self.pending:
            doc = self.store.get(kind, key)
            self.read.setdefault((kind, key), None if doc is None else doc.revision)
            if doc is None:
                return None, None
            return doc.data, self.read[(kind, key)]
        return copy.deepcopy(self.pending[(kind, key)]), self.read[(kind, key)]

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, JSON]]:
        found: dict[str, JSON | None] = {}
        for key, doc in self.store.list(kind, prefix):
            self.read.setdefault((kind, key), doc.revision)
            found[key] = doc.data
        for (k, key), data in self.pending.items():
            if k == kind and key.startswith(prefix):
                found[key] = copy.deepcopy(data)
        return [(key, data) for key, data in sorted(found.items()) if data is not None]

    def put(self, kind: str, key: str, data: JSON) -> None:
        self._hold(kind, key, data)

    def delete(self, kind: str, key: str) -> None:
        self._hold(kind, key, None)

    def _hold(self, kind: str, key: str, data: JSON | None) -> None:
        if self.pending and (kind, key) not in self.pending and not self.dry_run:
            raise AssertionError("one document per change")  # the store has no transaction
        if (kind, key) not in self.read:
            self.get(kind, key)
        self.pending[(kind, key)] = data

    def write(self) -> None:
        """The held write, as a compare-and-swap (``RevisionConflict`` when it lost)."""
        assert not self.dry_run
        for (kind, key), data in self.pending.items():
            rev = self.read[(kind, key)]
            if data is not None:
                self.store.put(kind, key, data, rev)
            elif rev is not None:
                self.store.delete(kind, key, rev)


class _Found(NamedTuple):
    key: str
    data: JSON
    revision: int | None


class ResourceClient:
    """Resources in ``store``. ``clock`` and ``new_uid`` stamp created resources; ``owner``
    is who writes (``resources.mirror``: the operator, or the controllers mirroring
    Kubernetes), and what the other owner keeps is refused (``NotOwned``);
    ``kubernetes_datastore``: ``store`` is the Kubernetes datastore, where Kubernetes' own
    kinds are refused (``NotOwned``, one line)."""

    def __init__(
        self,
        store: Store,
        *,
        clock: Callable[[], float] = time.time,
        new_uid: Callable[[], str] = lambda: str(uuid.uuid4()),
        owner: str = mirror.OPERATOR,
        kubernetes_datastore: bool = False,
    ) -> None:
        self.store = store
        self.clock = clock
        self.new_uid = new_uid
        self.owner = owner
        self.kubernetes_datastore = kubernetes_datastore

    # == read =================================================================================

    def get(self, kind: str | KindInfo, name: str, namespace: str | None = None) -> Resource:
        """One resource (``NotFound`` if absent). A namespaced kind defaults to ``default``."""
        info = _info(kind)
        ns = effective_namespace(info.namespaced, {"namespace": namespace})
        found = self._find(_Tx(self.store), info, name, ns)
        if found is None:
            if info.model is Tier and name == DEFAULT_TIER:
                return default_tier()  # always there, applied or not
            raise NotFound(_missing(info, name, ns))
        return self._resource(info, found.key, found.data, found.revision)

    def list(self, kind: str | KindInfo, namespace: str | None = None) -> list[Resource]:
        """Every resource of a kind (of one namespace when given), sorted by namespace and
        name (IPPools by CIDR)."""
        info = _info(kind)
        prefix = namespaced_key(namespace, "") if namespace and info.namespaced else ""
        pods: dict[str, JSON] = {}
        if info.store_kind == wep.KIND:
            pods = {k: d.data for k, d in self.store.list(wep.POD_KIND, prefix)}
        out = []
        for key, doc in self.store.list(info.store_kind, prefix):
            data = doc.data
            if info.store_kind == wep.KIND:
                data = _with_effective_labels(data, pods.get(_pod_key(key, data)))
            out.append(to_resource(info, key, doc._replace(data=data), self._where(info, key)))
        if info.model is Tier and all(r.name != DEFAULT_TIER for r in out):
            out = sorted([*out, default_tier()], key=lambda r: r.name)
        return out

    def _resource(self, info: KindInfo, key: str, data: JSON, revision: int | None) -> Resource:
        if info.store_kind == wep.KIND:
            pod, _ = _Tx(self.store).get(wep.POD_KIND, _pod_key(key, data))
            data = _with_effective_labels(data, pod)
        return to_resource(info, key, Doc(data, revision or 0), self._where(info, key))

    def _where(self, info: KindInfo, key: str) -> str:
        return self.store.location(info.store_kind, key)

    def _find(self, tx: _Tx, info: KindInfo, name: str, namespace: str | None) -> _Found | None:
        if info.model is IPPool:
            for key, data in tx.list("pool"):
                if pool_name(data, str(data.get("cidr", key))) == name:
                    return _Found(key, data, tx.read[("pool", key)])
            return None
        key = key_of(info, name, namespace)
        got, rev = tx.get(info.store_kind, key)
        return None if got is None else _Found(key, got, rev)

    # == apply ================================================================================

    def apply(
        self, documents: Sequence[object], *, replace: bool = False
    ) -> builtins.list[Applied]:
        """Apply every document (``InvalidDocument``, ``Conflict``, ``NotOwned``): each is
        checked first, then each written on its own. ``replace``: each document is the whole
        resource (the controllers' mirror), not fields merged into what is stored."""

        def one(i: int, doc: object) -> Callable[[_Tx], Applied]:
            return lambda tx: self._apply_one(tx, i, doc, replace=replace)

        changes = [one(i, doc) for i, doc in enumerate(documents, 1)]
        self._check(changes)
        return [self._transact(change) for change in changes]

    def _check(self, changes: Sequence[Callable[[_Tx], object]]) -> None:
        """The changes planned in order on the store as it is (each seeing the ones before
        it), none written: a refusal of any one refuses them all before anything is written
        (one change needs no dry run)."""
        if len(changes) > 1:
            with self.store.lock():
                plan = _Tx(self.store, dry_run=True)
                for change in changes:
                    change(plan)

    def _transact(self, change: Callable[[_Tx], T]) -> T:
        """``change`` planned on fresh reads and its one write made, as compare-and-swap:
        planned again when another writer got in between."""

        def read() -> tuple[_Tx, T]:
            tx = _Tx(self.store)
            return tx, change(tx)

        def write(planned: tuple[_Tx, T]) -> tuple[_Tx, T]:
            planned[0].write()
            return planned

        with self.store.lock():
            tx, result = cas(read, write, "resource", "")
        for action in tx.after:
            action()
        return result

    def _apply_one(self, tx: _Tx, index: int, doc: object, *, replace: bool = False) -> Applied:
        label = document_label(index, doc)
        if not isinstance(doc, dict):
            raise InvalidDocument(label, [("", "not an object (a mapping of fields)")])
        info = _document_kind(label, doc)
        self._check_kubernetes_own(label, info)
        meta = doc.get("metadata")
        name = meta.get("name") if isinstance(meta, dict) else None
        namespace = effective_namespace(info.namespaced, meta)
        found = self._find(tx, info, name, namespace) if isinstance(name, str) and name else None
        rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
        _check_resource_version(info, label, rv, found)

        patch = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
        base = stored_raw(info, found.key, found.data) if found is not None else {}
        merged = merge({} if replace else base, patch)
        merged_meta = merged.setdefault("metadata", {})
        if isinstance(merged_meta, dict):
            merged_meta.pop("resourceVersion", None)
            old_meta = base.get("metadata") or {}
            for field, make in (("uid", self.new_uid), ("creationTimestamp", self._now)):
                given = merged_meta.get(field) if replace else None
                merged_meta[field] = given or old_meta.get(field) or make()
        self._check_owner(label, info, found, merged)
        if self.kubernetes_datastore and info.kind == "Node":
            old_labels = (base.get("metadata") or {}).get("labels") or {}
            if ((merged.get("metadata") or {}).get("labels") or {}) != old_labels:
                raise NotOwned(mirror.node_labels_refusal(label, str(name)))
        full = {"apiVersion": doc.get("apiVersion"), "kind": doc.get("kind"), **merged}
        try:
            resource = validate(info, full)
        except ValidationError as e:
            raise InvalidDocument(label, problems(e)) from None

        _check_tier_exists(tx, label, resource)
        if isinstance(resource, IPPool):
            key = self._pool_key(tx, label, resource, found)
        else:
            key = key_of(info, resource.name, resource.namespace)
        data = stored_data(info, merged, resource, found.data if found is not None else None)
        if found is not None and (found.data == data or _same(info, base, resource)):
            action = "unchanged"  # nothing written (also when only defaults were spelt out)
        else:
            action = "configured" if found is not None else "created"
            tx.put(info.store_kind, key, data)
        return Applied(label, action, resource)

    def _now(self) -> str:
        return wep.timestamp(self.clock())

    def _check_kubernetes_own(self, label: str, info: KindInfo) -> None:
        """On the Kubernetes datastore: a kind tabbyctl may not write there is refused."""
        if self.kubernetes_datastore:
            why = mirror.kubernetes_own_refusal(label, info.store_kind)
            if why is not None:
                raise NotOwned(why)

    def _check_owner(
        self, label: str, info: KindInfo, found: _Found | None, new: JSON | None
    ) -> None:
        """``resources.mirror``'s rules for a write (``new``: the document to store, None
        for a delete) of ``found``."""
        was = mirror.is_mirrored(found.data if found is not None else None)
        will = new is not None and mirror.is_mirrored(new)
        if self.owner == mirror.OPERATOR:
            if not was and not will:
                return
            if was and will and new is not None and found is not None and info.kind == "Node":
                old_meta = stored_raw(info, found.key, found.data).get("metadata") or {}
                new_meta = new.get("metadata") or {}
                if all(old_meta.get(f) == new_meta.get(f) for f in ("labels", "annotations")):
                    return  # spec.bgp of a mirrored Node: the operator's to set
            raise NotOwned(mirror.refusal(label, self.owner))
        if new is None:  # a delete: only what the controllers marked
            if found is not None and not was:
                raise NotOwned(mirror.refusal(label, self.owner))
            return
        if not will:
            raise NotOwned(f"{label}: the controllers write marked resources only")
        if found is not None and not was and info.kind != "Node":  # a Node: tabby-node's
            raise NotOwned(mirror.refusal(label, self.owner))

    def _pool_key(self, tx: _Tx, label: str, pool: IPPool, found: _Found | None) -> str:
        spec = pool.spec
        if found is not None:
            old = found.data
            if spec.cidr != str(old.get("cidr", found.key)):
                raise InvalidDocument(
                    label,
                    [("spec.cidr", f"Forbidden: may not be changed (the pool is {found.key})")],
                )
            if spec.blockSize != old.get("block_size"):
                raise InvalidDocument(
                    label,
                    [
                        (
                            "spec.blockSize",
                            f"Forbidden: may not be changed (it is {old.get('block_size')})",
                        )
                    ],
                )
            return found.key
        net = spec.network
        for key, data in tx.list("pool"):
            try:
                other = ipaddress.ip_network(str(data.get("cidr", key)))
            except ValueError:
                continue
            if other.version == net.version and other.overlaps(net):
                raise InvalidDocument(
                    label,
                    [
                        (
                            "spec.cidr",
                            f"Invalid value: {show(spec.cidr)}: overlaps IPPool "
                            f"{pool_name(data, str(other))} ({other})",
                        )
                    ],
                )
        return spec.cidr

    # == delete ===============================================================================

    def delete(
        self,
        kind: str | KindInfo,
        name: str,
        namespace: str | None = None,
        *,
        resource_version: str | None = None,
    ) -> Deleted:
        """Delete one resource (``NotFound``; ``Conflict`` on a resourceVersion mismatch or
        an IPPool still in use)."""
        info = _info(kind)
        ns = effective_namespace(info.namespaced, {"namespace": namespace})
        label = f"{info.kind}/{name}"
        out = self._transact(
            lambda tx: self._delete_one(tx, info, label, name, ns, resource_version, False)
        )
        assert out is not None
        return out

    def delete_documents(
        self, documents: Sequence[object], *, ignore_not_found: bool = False
    ) -> builtins.list[Deleted]:
        """Delete the resource each document names (each checked first, then each
        deleted on its own; Tiers last, after the policies they may hold)."""

        def one(i: int, doc: object) -> Callable[[_Tx], Deleted | None]:
            label = document_label(i, doc)
            if not isinstance(doc, dict):
                raise InvalidDocument(label, [("", "not an object (a mapping of fields)")])
            info = _document_kind(label, doc)
            meta = doc.get("metadata")
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str) or not name:
                raise InvalidDocument(label, [("metadata.name", "Required value")])
            rv = meta.get("resourceVersion") if isinstance(meta, dict) else None
            ns = effective_namespace(info.namespaced, meta)
            return lambda tx: self._delete_one(tx, info, label, name, ns, rv, ignore_not_found)

        # a Tier after the policies of the same call (it cannot go while it holds one)
        ordered = sorted(enumerate(documents, 1), key=lambda d: _is_tier(d[1]))
        changes = [one(i, doc) for i, doc in ordered]
        self._check(changes)
        out = []
        for change in changes:
            done = self._transact(change)
            if done is not None:
                out.append(done)
        return out

    def _delete_one(
        self,
        tx: _Tx,
        info: KindInfo,
        label: str,
        name: str,
        namespace: str | None,
        rv: object,
        ignore_not_found: bool,
    ) -> Deleted | None:
        self._check_kubernetes_own(label, info)
        if info.model is Tier and name == DEFAULT_TIER:
            raise Conflict(f"{label}: the default tier always exists: it cannot be deleted")
        found = self._find(tx, info, name, namespace)
        if found is None:
            if ignore_not_found:
                return None
            raise NotFound(_missing(info, name, namespace))
        _check_resource_version(info, label, rv, found)
        self._check_owner(label, info, found, None)
        resource = self._resource(info, found.key, found.data, found.revision)
        if info.model is IPPool:
            self._delete_pool(tx, label, found)
        else:
            if info.model is Tier:
                _check_tier_unused(tx, label, name)
            tx.delete(info.store_kind, found.key)
        return Deleted(label, resource)

    def _delete_pool(self, tx: _Tx, label: str, found: _Found) -> None:
        """Refuse while a block of the pool holds an address (checked before anything is
        written); the deletion itself is the IPAM core's (``Ipam.delete_pool``: it disables
        the pool first, so no node claims a new block of it meanwhile, then deletes its empty
        blocks, their affinities and the pool), run afterwards."""
        cidr = str(found.data.get("cidr", found.key))
        for key, data in tx.list("block"):
            block = Block.from_data(data, self.store.location("block", key))
            if block.pool == cidr and not block.is_empty():
                raise Conflict(
                    f"{label}: pool {cidr} is in use: block {key} holds addresses "
                    "(release them first)"
                )
        tx.after.append(lambda: _delete_pool_now(self.store, label, cidr))


# -- helpers -----------------------------------------------------------------------------------


def _info(kind: str | KindInfo) -> KindInfo:
    return kind if isinstance(kind, KindInfo) else resolve_kind(kind)


def _document_kind(label: str, doc: JSON) -> KindInfo:
    kind = doc.get("kind")
    if kind is None:
        raise InvalidDocument(label, [("kind", "Required value")])
    info = document_kind(doc.get("apiVersion"), kind) if isinstance(kind, str) else None
    if info is None:
        known = ", ".join(dict.fromkeys(i.kind for i in RESOURCE_KINDS))
        raise InvalidDocument(
            label, [("kind", f"Unsupported value: {show(kind)}: supported kinds: {known}")]
        )
    return info


# -- Calico's tiers ---------------------------------------------------------------------------


def _is_tier(doc: object) -> bool:
    return isinstance(doc, dict) and doc.get("kind") == Tier.KIND


def _tier_of(data: JSON) -> str:
    spec = data.get("spec")
    tier = spec.get("tier") if isinstance(spec, dict) else None
    return tier if isinstance(tier, str) and tier else DEFAULT_TIER


def _check_tier_exists(tx: _Tx, label: str, resource: Resource) -> None:
    """A Calico policy's tier must exist (Calico's rule): ``default``, or a Tier stored or
    applied before it in the same call."""
    if BY_MODEL[type(resource)].store_kind not in TIERED_STORE_KINDS:
        return
    tier = _tier_of(resource.wire())
    if tier != DEFAULT_TIER and tx.get("tier", tier)[0] is None:
        raise InvalidDocument(
            label, [("spec.tier", f"Not found: tier {show(tier)} does not exist (apply it first)")]
        )


def _check_tier_unused(tx: _Tx, label: str, name: str) -> None:
    """A tier that holds a policy cannot be deleted (Calico's rule)."""
    for kind in TIERED_STORE_KINDS:
        for key, data in tx.list(kind):
            if _tier_of(data) == name:
                raise Conflict(
                    f"{label}: the tier holds {BY_STORE_KIND[kind].kind} {key}: delete its "
                    "policies first"
                )


def _check_resource_version(info: KindInfo, label: str, rv: object, found: _Found | None) -> None:
    if rv is None:
        return
    if not isinstance(rv, str):
        raise InvalidDocument(
            label, [("metadata.resourceVersion", f"Invalid value: {show(rv)}: must be a string")]
        )
    if found is None:
        raise Conflict(
            f"{label}: metadata.resourceVersion {rv} given but there is no such {info.kind} "
            "(leave it out to create one)"
        )
    if rv != str(found.revision):
        raise Conflict(
            f"{label}: the object has been modified (resourceVersion {rv}, now "
            f"{found.revision}): get it again and re-apply your change"
        )


def _delete_pool_now(store: Store, label: str, cidr: str) -> None:
    from ipam.core import InvalidConfig, Ipam

    try:
        Ipam(store, "").delete_pool(cidr)
    except InvalidConfig as e:
        raise Conflict(f"{label}: {e}") from None


def _same(info: KindInfo, stored: JSON, resource: Resource) -> bool:
    """Whether the stored resource reads as ``resource`` (defaults applied)."""
    try:
        return validate(info, document(info, stored, None)).wire() == resource.wire()
    except ValidationError:
        return False


def _missing(info: KindInfo, name: str, namespace: str | None) -> str:
    where = f" in namespace {namespace}" if info.namespaced and namespace else ""
    return f"{info.kind} {name!r} not found{where}"


def _pod_key(endpoint_key: str, data: JSON) -> str:
    namespace, _ = split_namespaced_key(endpoint_key)
    spec = data.get("spec")
    pod = spec.get("pod") if isinstance(spec, dict) else None
    return namespaced_key(namespace, str(pod or ""))


def _with_effective_labels(data: JSON, pod: JSON | None) -> JSON:
    out = dict(data)
    meta = dict(out.get("metadata") or {})
    labels = wep.effective_labels(data, pod)
    if labels:
        meta["labels"] = labels
    else:
        meta.pop("labels", None)
    out["metadata"] = meta
    return out
