"""The Kubernetes datastore: tabby's documents on the Kubernetes API, no etcd of tabby's own.

``KubeStore`` keeps the store protocol (``datastore.base``) on the API server: every write is
the API's compare-and-swap of ONE object (a create fails when the object exists, a replace
or a delete when its ``resourceVersion`` moved: 409), which is all the protocol asks; where
each kind lives is ``stores.kube.kinds``. What Kubernetes owns (Pods, Namespaces,
NetworkPolicies, Nodes) is read where it lives and never written: a write of it is refused
with one line. The node-local lock is a lock file, as etcd's (``<run_dir>/locks``).

- ``get`` is one GET (a ``node`` two: tabby's Node and the v1 Node's labels); ``list`` one
  LIST (``workloadendpoint``: the blocks'); an IPPool is found by its CIDR through the name a
  pool of that CIDR has (remembered on disk, beside the lock file, so that a CNI call of its
  own does not list the pools: the first call on a node does, and a pool renamed or added
  since).
- ``put_leased``/``keepalive`` only for ``trace`` (its lease is an annotation; expired ones
  read as absent and are deleted when met); liveness and leader election are Kubernetes'
  own in this datastore (the v1 Node's Ready condition, the coordination Lease).
- ``sync`` is ``stores.kube.sync``: a list and a watch per collection, resumed from the last
  resourceVersion (bookmarks on), a ``410 Gone`` one re-list after a random pause.
- Errors: no answer (or 429, 5xx) is ``StoreUnavailable`` (the runtime tries again: code
  11), after at most the lock timeout; 409 and a vanished object on a replace are
  ``RevisionConflict``; the API refusing a document (400, 422) or tabby (401, 403) is
  ``InvalidConfig`` with the API's message.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import threading
import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, TypeVar

from datastore.base import Doc, SyncEvent
from datastore.engine import LOCK_FLAGS, Engine, Write, refused
from datastore.errors import (
    AccessDenied,
    InvalidConfig,
    RevisionConflict,
    StoreCorrupt,
    StoreUnavailable,
)
from resources.poolform import pool_name
from stores.kube import kinds
from stores.kube.client import ApiError, Conflict, KubeClient, KubeConfig, NotFound

if TYPE_CHECKING:
    from bundle.types import JSON
    from datastore.base import StoreSettings

T = TypeVar("T")

DEFAULT_LOCK_DIR = "/run/tabby/locks"
#: pauses before a request that got "not now" (429, 5xx) or no answer is sent again
RETRY_PAUSES = (0.1, 0.3, 1.0, 2.0)
#: the heartbeat document of a Ready node (``time``: when it was seen Ready)
LIVENESS = "heartbeat"


def kube_error(e: ApiError, where: str) -> Exception:
    """The store's error for an API answer."""
    if isinstance(e, Conflict):
        return RevisionConflict("document changed", f"{where}: {e.message or e.reason}")
    if e.status in (401, 403):
        return AccessDenied(
            f"the API server refused tabby's credentials ({e.status} {e.reason})",
            f"{where}: {e.message}",
        )
    if e.status in (400, 422):
        return InvalidConfig(
            f"the API server refused it ({e.status} {e.reason})", f"{where}: {e.message}"
        )
    return StoreUnavailable(where, str(e))


class KubeStore(Engine):
    """The store protocol on the Kubernetes API (see the module)."""

    _ephemeral_lock_file = True

    def __init__(
        self,
        client: KubeClient,
        *,
        lock_timeout: float = 30.0,
        lock_dir: str | None = None,
    ) -> None:
        super().__init__()
        self.client = client
        self.lock_timeout = lock_timeout
        self.server = client.config.server
        self.lock_dir = lock_dir or DEFAULT_LOCK_DIR
        import binascii

        raw = f"{self.server}\n{_netns_inode()}".encode()
        digest = f"{binascii.crc32(raw):08x}{binascii.crc32(raw[::-1]):08x}"
        self.lock_path = os.path.join(self.lock_dir, f"kube-{digest}.lock")
        self._pool_names_path = os.path.join(self.lock_dir, f"kube-{digest}.pools.json")
        self._pool_names: dict[str, str] | None = None  # CIDR -> the IPPool's name
        self._held = threading.local()
        self._stats_lock = threading.Lock()
        #: requests by what they did (the benches and the metrics count the API's cost)
        self.stats = {"reads": 0, "lists": 0, "writes": 0, "conflicts": 0}

    @classmethod
    def from_settings(cls, settings: StoreSettings) -> KubeStore:
        agent = getattr(settings, "user_agent", None) or "tabby"
        try:
            config = KubeConfig.load(settings.kubeconfig)
            client = KubeClient(config, timeout=settings.lock_timeout_seconds, agent=agent)
        except ApiError as e:
            raise InvalidConfig("no Kubernetes API access", e.message or e.reason) from None
        run_dir = getattr(settings, "run_dir", None)
        return cls(
            client,
            lock_timeout=settings.lock_timeout_seconds,
            lock_dir=os.path.join(run_dir, "locks") if run_dir else None,
        )

    def _count(self, what: str) -> None:
        with self._stats_lock:
            self.stats[what] += 1

    def location(self, kind: str, key: str) -> str:
        crd = kinds.CRDS.get(kind)
        if crd is not None:
            return f"{self.server} {crd.name}/{kinds.object_name(kind, key, None)}"
        native = kinds.NATIVE.get(kind)
        if native is not None:
            return f"{self.server}{kinds.native_path(native, key)}"
        return f"{self.server} {kind} {key}"

    # -- requests --------------------------------------------------------------------------

    def _call(self, what: str, fn: Callable[[], T], where: str) -> T:
        """``fn()``, sent again after "not now" or no answer while the lock timeout allows."""
        deadline = time.monotonic() + self.lock_timeout
        for pause in (*RETRY_PAUSES, None):
            try:
                self._count(what)
                return fn()
            except (NotFound, Conflict):
                raise
            except ApiError as e:
                transient = e.status == 0 or e.status == 429 or e.status >= 500
                if not transient or pause is None or time.monotonic() + pause > deadline:
                    raise kube_error(e, where) from None
                time.sleep(pause)
        raise AssertionError("unreachable")  # pragma: no cover

    def _get_object(self, path: str, where: str) -> JSON | None:
        try:
            obj: JSON = self._call("reads", lambda: self.client.get(path), where)
        except NotFound:
            return None
        except Conflict as e:  # pragma: no cover - a GET does not conflict
            raise kube_error(e, where) from None
        return obj

    def _list_objects(self, path: str, where: str) -> list[JSON]:
        try:
            items: list[JSON] = self._call("lists", lambda: self.client.list(path)[0], where)
        except (NotFound, Conflict) as e:
            raise kube_error(e, where) from None
        return items

    # -- reads ---------------------------------------------------------------------------

    def _get(self, kind: str, key: str) -> Doc | None:
        if kind in kinds.CRDS:
            return self._get_crd(kind, key)
        native = kinds.NATIVE.get(kind)
        if native is not None:
            obj = self._get_object(kinds.native_path(native, key), self.location(kind, key))
            projected = None if obj is None else native.project(obj)
            if obj is None or projected is None:
                return None
            return Doc(kinds.stored(projected), kinds.revision_of(obj))
        if kind == LIVENESS:
            obj = self._get_object(f"{kinds.V1_NODES}/{key}", self.location(kind, key))
            if obj is None or not kinds.ready(obj):
                return None
            return Doc(kinds.alive(key), kinds.revision_of(obj))
        if kind == "workloadendpoint":
            return dict(self._items(kind, key)).get(key)
        return None  # "handle": format 1 only, never on the API

    def _get_crd(self, kind: str, key: str) -> Doc | None:
        crd = kinds.CRDS[kind]
        where = self.location(kind, key)
        if kind == "pool":
            obj = self._pool_object(key)
        else:
            obj = self._get_object(crd.object_path(key, kinds.object_name(kind, key, None)), where)
        if obj is None or kinds.key_of(kind, obj) != key:
            return None
        if kind == "trace" and kinds.expired(obj):
            self._drop_expired(kind, obj)
            return None
        data = kinds.to_data(kind, obj)
        revision = kinds.revision_of(obj)
        if kind == "node":
            v1 = self._get_object(f"{kinds.V1_NODES}/{key}", where)
            labels = kinds.node_labels(v1) if v1 is not None else None
            data = kinds.joined_node(data, labels)
            revision = kinds.joined_revision(revision, kinds.revision_of(v1) if v1 else 0)
        return Doc(data, revision)

    def _pool_object(self, cidr: str) -> JSON | None:
        """The IPPool of ``cidr``: by the name a pool of that CIDR has (its default name,
        else the one remembered), else found in the list of pools (and remembered)."""
        crd = kinds.CRDS["pool"]
        where = self.location("pool", cidr)
        names = self._known_pool_names()
        for name in dict.fromkeys((names.get(cidr), pool_name({}, cidr))):
            if name is None:
                continue
            obj = self._get_object(f"{crd.path}/{name}", where)
            if obj is not None and kinds.key_of("pool", obj) == cidr:
                return obj
        found = None
        remembered: dict[str, str] = {}
        for obj in self._list_objects(crd.path, where):
            key = kinds.key_of("pool", obj)
            name = (obj.get("metadata") or {}).get("name")
            if key and isinstance(name, str):
                remembered[key] = name
                if key == cidr:
                    found = obj
        self._remember_pool_names(remembered)
        return found

    def _known_pool_names(self) -> dict[str, str]:
        if self._pool_names is None:
            try:
                with open(self._pool_names_path, encoding="utf-8") as f:
                    loaded = json.load(f)
                self._pool_names = (
                    {str(k): str(v) for k, v in loaded.items() if isinstance(v, str)}
                    if isinstance(loaded, dict)
                    else {}
                )
            except (OSError, ValueError):
                self._pool_names = {}
        return self._pool_names

    def _remember_pool_names(self, names: dict[str, str]) -> None:
        self._pool_names = names
        with contextlib.suppress(OSError):
            os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
            tmp = f"{self._pool_names_path}.{os.getpid()}.tmp"
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(names, f)
            os.replace(tmp, self._pool_names_path)

    def _keys(self, kind: str) -> builtins.list[str]:
        return [key for key, _ in self._items(kind, "")]

    def _items(self, kind: str, prefix: str) -> builtins.list[tuple[str, Doc]]:
        where = self.location(kind, prefix or "*")
        if kind in kinds.CRDS:
            return self._crd_items(kind, prefix, where)
        native = kinds.NATIVE.get(kind)
        if native is not None:
            out = []
            for obj in self._list_objects(native.path, where):
                projected = native.project(obj)
                meta = obj.get("metadata") or {}
                key = (
                    f"{meta.get('namespace')}/{meta.get('name')}"
                    if native.namespaced
                    else str(meta.get("name"))
                )
                if projected is not None and key.startswith(prefix):
                    out.append((key, Doc(kinds.stored(projected), kinds.revision_of(obj))))
            return out
        if kind == LIVENESS:
            return [
                (name, Doc(kinds.alive(name), kinds.revision_of(obj)))
                for obj in self._list_objects(kinds.V1_NODES, where)
                if kinds.ready(obj)
                and (name := str((obj.get("metadata") or {}).get("name"))).startswith(prefix)
            ]
        if kind == "workloadendpoint":
            blocks = self._crd_items("block", "", where)
            revs = {k: d.revision for k, d in blocks}
            found = endpoint_docs({k: d.data for k, d in blocks}, revs)
            return [(k, d) for k, d in found.items() if k.startswith(prefix)]
        return []

    def _crd_items(self, kind: str, prefix: str, where: str) -> builtins.list[tuple[str, Doc]]:
        crd = kinds.CRDS[kind]
        out = []
        labels: dict[str, tuple[dict[str, str], int]] = {}
        if kind == "node":
            for v1 in self._list_objects(kinds.V1_NODES, where):
                name = (v1.get("metadata") or {}).get("name")
                if isinstance(name, str):
                    labels[name] = (kinds.node_labels(v1), kinds.revision_of(v1))
        names: dict[str, str] = {}
        for obj in self._list_objects(crd.path, where):
            key = kinds.key_of(kind, obj)
            if key is None or not key.startswith(prefix):
                continue
            if kind == "trace" and kinds.expired(obj):
                self._drop_expired(kind, obj)
                continue
            data, revision = kinds.to_data(kind, obj), kinds.revision_of(obj)
            if kind == "node":
                v1_labels, v1_rev = labels.get(key, (None, 0))
                data = kinds.joined_node(data, v1_labels)
                revision = kinds.joined_revision(revision, v1_rev)
            if kind == "pool":
                names[key] = str((obj.get("metadata") or {}).get("name"))
            out.append((key, Doc(data, revision)))
        if kind == "pool" and not prefix:
            self._remember_pool_names(names)
        return out

    # -- writes --------------------------------------------------------------------------

    def _apply(self, w: Write) -> int:
        if w.kind not in kinds.CRDS:
            raise InvalidConfig(
                f"{w.kind} is Kubernetes' own in the Kubernetes datastore",
                f"{w.key}: change it with kubectl",
            )
        if w.ttl is not None and w.kind != "trace":
            raise InvalidConfig("no leases in the Kubernetes datastore", f"{w.kind} {w.key}")
        where = self.location(w.kind, w.key)
        crd = kinds.CRDS[w.kind]
        expected = w.expected
        if expected is not None and w.kind == "node":
            expected = kinds.tabby_revision(expected)
        if w.value is None:
            return self._delete(w, crd, expected, where)
        data = json.loads(w.value)
        obj = kinds.to_object(w.kind, w.key, data, expected)
        if w.ttl is not None:
            meta = obj["metadata"]
            meta["annotations"] = {
                **(meta.get("annotations") or {}),
                kinds.EXPIRES_ANNOTATION: f"{time.time() + w.ttl:.3f}",
                kinds.TTL_ANNOTATION: f"{w.ttl:g}",
            }
        name = obj["metadata"]["name"]
        try:
            if expected is None:
                written = self._call(
                    "writes", lambda: self.client.create(crd.create_path(w.key), obj), where
                )
            else:
                written = self._call(
                    "writes", lambda: self.client.update(crd.object_path(w.key, name), obj), where
                )
        except Conflict as e:
            self._count("conflicts")
            raise kube_error(e, where) from None
        except NotFound:
            self._count("conflicts")
            raise RevisionConflict("document vanished", where) from None
        if w.kind == "pool":
            names = dict(self._known_pool_names())
            if names.get(w.key) != name:
                names[w.key] = name
                self._remember_pool_names(names)
        revision = kinds.revision_of(written)
        if w.kind == "node":
            revision = kinds.joined_revision(revision, 0)
        return revision

    def _delete(self, w: Write, crd: kinds.Crd, expected: int | None, where: str) -> int:
        if w.kind == "pool":
            obj = self._pool_object(w.key)
            if obj is None:
                raise RevisionConflict("document vanished", where)
            name = str(obj["metadata"]["name"])
        else:
            name = kinds.object_name(w.kind, w.key, None)
        try:
            self._call(
                "writes",
                lambda: self.client.delete(
                    crd.object_path(w.key, name),
                    resource_version=None if expected is None else str(expected),
                ),
                where,
            )
        except Conflict as e:
            self._count("conflicts")
            raise kube_error(e, where) from None
        except NotFound:
            self._count("conflicts")
            raise RevisionConflict("document vanished", where) from None
        return 0

    def _keepalive(self, kind: str, key: str) -> bool:
        """A trace's lease begins again (its annotation moved on): the other kinds have
        none."""
        if kind != "trace":
            return False
        crd = kinds.CRDS[kind]
        where = self.location(kind, key)
        obj = self._get_object(f"{crd.path}/{key}", where)
        if obj is None or kinds.expired(obj):
            return False
        meta = obj.setdefault("metadata", {})
        annotations = meta.setdefault("annotations", {})
        try:
            started = float(annotations.get(kinds.TTL_ANNOTATION, "0"))
        except ValueError:
            started = 0.0
        if started <= 0:
            return False
        annotations[kinds.EXPIRES_ANNOTATION] = f"{time.time() + started:.3f}"
        try:
            self._call("writes", lambda: self.client.update(f"{crd.path}/{key}", obj), where)
        except (Conflict, NotFound):
            return False
        return True

    def _drop_expired(self, kind: str, obj: JSON) -> None:
        """Delete an expired lease met on the way (the API has no expiry of its own): only
        at the version seen (a writer that renewed it meanwhile keeps it)."""
        crd = kinds.CRDS[kind]
        meta = obj.get("metadata") or {}
        with contextlib.suppress(ApiError):
            self.client.delete(
                f"{crd.path}/{meta.get('name')}", resource_version=str(meta.get("resourceVersion"))
            )

    # -- sync, lock, health --------------------------------------------------------------

    def _sync(self, kinds_: tuple[str, ...], stop: threading.Event) -> Iterator[SyncEvent]:
        from stores.kube.sync import KubeSync

        # a client of its own: ending the sync closes its connections, not the store's
        client = KubeClient(
            self.client.config, timeout=self.client.timeout, agent=self.client.agent
        )
        events = KubeSync(client, self.count_sync, kinds_, stop).run()
        return self._noting_pool_names(events) if "pool" in kinds_ else events

    def _noting_pool_names(self, events: Iterator[SyncEvent]) -> Iterator[SyncEvent]:
        """``events``, passed on, keeping the on-disk CIDR -> IPPool name file current: a
        node whose tabby-node watches the pools answers a standalone CNI call (tabby-node
        down) with GETs only, whatever the pools are named."""
        names: dict[str, str] = {}
        for ev in events:
            before = dict(names)
            if ev.type == "snapshot" and ev.snapshot is not None:
                pools = ev.snapshot.get("pool")
                if isinstance(pools, dict):
                    names = {k: str(d.data.get("name")) for k, d in pools.items()}
            elif ev.kind == "pool" and ev.type == "put" and ev.doc is not None:
                names[ev.key] = str(ev.doc.data.get("name"))
            elif ev.kind == "pool" and ev.type == "delete":
                names.pop(ev.key, None)
            if names != before:
                self._remember_pool_names(dict(names))
            yield ev

    def _open_lock_file(self) -> int:
        try:
            os.makedirs(self.lock_dir, mode=0o700, exist_ok=True)
            return os.open(self.lock_path, LOCK_FLAGS, 0o600)
        except OSError as e:
            raise refused(self.lock_path, e) from None

    def check_usable(self) -> None:
        """One LIST of at most one IPPool: the API answers and tabby's kinds are installed."""
        crd = kinds.CRDS["pool"]
        try:
            self._call(
                "reads", lambda: self.client.request("GET", crd.path, params={"limit": 1}), crd.name
            )
        except NotFound:
            raise StoreCorrupt(
                f"{self.server} {crd.name}", "not installed (apply manifests/tabby.yaml)"
            ) from None

    def close(self) -> None:
        self.client.close()


def endpoint_docs(blocks: dict[str, JSON], revisions: dict[str, int]) -> dict[str, Doc]:
    """The WorkloadEndpoint documents of ``blocks`` (``kinds.endpoints_of``), each at the
    latest revision of the blocks holding its addresses."""
    out: dict[str, Doc] = {}
    for cidr, data in blocks.items():
        for key, doc in kinds.endpoints_of({cidr: data}).items():
            held = out.get(key)
            rev = revisions.get(cidr, 0)
            if held is None:
                out[key] = Doc(doc, rev)
            else:
                out[key] = Doc(held.data, max(held.revision, rev))
    whole = kinds.endpoints_of(blocks)
    return {key: Doc(data, out[key].revision) for key, data in whole.items() if key in out}


def _netns_inode() -> int:
    try:
        return os.stat("/proc/self/ns/net").st_ino
    except OSError:
        return 0
