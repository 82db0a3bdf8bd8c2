"""The store contract: generic JSON documents by kind and key, every write compare-and-swap.

The narrow protocol every backend implements (``Store``): read (``get``, ``list``,
``list_keys``), conditional write of ONE document (``put``, ``delete``), watch (``sync``),
and the node-local writers' lock (``lock``). Nothing spans two documents: the Kubernetes API
offers compare-and-swap on one object and no transaction, so no caller may need one (the
IPAM design makes every allocation and release one conditional write of one block:
``ipam/DESIGN.md``). Leases (a document that expires unless kept alive: node liveness,
leader election, policy trace requests) are the optional ``Leases`` protocol, which the
file, memory and etcd stores implement and the Kubernetes store does not (liveness and
leader election are Kubernetes' own there).

``memory``, ``file`` and ``etcd`` implement it, each over ``engine`` (what they share:
argument checks, encoding, the compare-and-swap rule, listing order, the lock session, sync
bookkeeping), and ``datastore.open_store(settings)`` builds the configured one.

Rules every implementation keeps (checked by ``tests/unit/datastore/test_store_contract.py``
against each of them):

- ``get`` returns a fresh copy of the data (the caller may mutate it) and its revision, or
  ``None`` when the document does not exist. An unreadable, truncated or malformed document
  raises ``StoreCorrupt`` naming its location; other documents stay usable.
- ``put(kind, key, data, None)`` creates and fails with ``RevisionConflict`` if the document
  exists; ``put(..., rev)`` replaces only if the current revision is ``rev``. It returns the
  new revision. Revisions are positive ints, never reused for one key (not even after a delete
  and re-create), so a stale revision can never match again.
- ``delete(kind, key, rev)`` removes only if the current revision is ``rev``; a missing
  document is a ``RevisionConflict`` too.
- ``list(kind, prefix)`` returns every document of a kind whose key starts with ``prefix``,
  sorted by key; a document that cannot be parsed raises ``StoreCorrupt`` naming it.
  ``list_keys(kind)`` the keys alone (etcd: no values sent).
- ``sync(kinds, stop)`` yields exactly one ``"snapshot"`` event, first, holding every
  document of ``kinds``; then only ``"put"``/``"delete"`` events, as changes happen. A
  broken watch resumes where it left off (etcd: each watched range from the last revision
  it delivered), missing nothing and reading nothing again. When the store cannot say what
  changed (etcd's history compacted past that revision, a failed poll of the file store,
  the memory store's ``resync``) it reads the kinds again and yields only the differences
  from what it reported, as puts and deletes: once caught up, a consumer that applied every
  event holds exactly the store's documents. ``sync_stats`` counts first reads
  (``snapshots``), such re-reads (``rereads``) and etcd's resumed streams (``resumes``),
  over every ``sync`` of the object. Documents that cannot be parsed are left out of
  ``sync`` (logged). The iterator ends within about a second after ``stop`` is set.
- ``lock()`` serialises the writers of one node (threads and processes sharing the store
  object's location); it is not re-entrant and raises ``LockTimeout`` when not had in time.
  Correctness across nodes never rests on it: every write is a compare-and-swap.
- ``check_usable()`` is read-only and cheap (for STATUS); it raises a ``StoreError`` subclass.
- No operation waits longer than the store's lock timeout in total; a datastore that cannot
  be reached raises ``StoreUnavailable``.
- Data must be JSON-serialisable (``str`` keys; no NaN); anything else is a programming error
  (``TypeError``/``ValueError``).
- ``close()`` releases connections and threads; the object is not used afterwards.

``Leases`` (file, memory, etcd):

- ``put_leased(kind, key, data, rev, ttl=s)``: ``put``, and the document disappears ``s``
  seconds after this write unless it is written again or kept alive (a plain ``put`` makes
  it permanent).
- ``keepalive(kind, key)``: the document's ttl starts again (the ttl it was last written
  with), with no new revision and no ``sync`` event (a node's liveness costs its watchers
  nothing while it lives); False when the document is gone or has no ttl (write it again).
- An expired document reads as absent everywhere (``get``, ``list_keys``, ``list``, CAS
  checks), and ``sync`` reports its deletion.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, NamedTuple, Protocol

if TYPE_CHECKING:
    import threading
    from collections.abc import Iterable, Sequence
    from contextlib import AbstractContextManager

    from bundle.types import JSON

#: IPAM documents, resources, node liveness ("heartbeat", written with a ttl), and the
#: requests and results of ``tabbyctl policy trace`` across nodes ("trace", with a ttl).
IPAM_KINDS = ("pool", "block", "handle", "affinity")
RESOURCE_KINDS = (
    "node",
    "bgpconfiguration",
    "bgppeer",
    "networkpolicy",
    "namespace",
    "serviceaccount",
    "pod",
    "workloadendpoint",
)
#: Calico's policy model (``resources.calico``): one key range of its own in etcd
CALICO_KINDS = (
    "calico-networkpolicy",
    "globalnetworkpolicy",
    "stagednetworkpolicy",
    "stagedglobalnetworkpolicy",
    "stagedkubernetesnetworkpolicy",
    "tier",
    "networkset",
    "globalnetworkset",
    "hostendpoint",
)
KINDS = (*IPAM_KINDS, *RESOURCE_KINDS, *CALICO_KINDS, "heartbeat", "trace")
_KIND_SET = frozenset(KINDS)


class Doc(NamedTuple):
    """One document as read: its data and the revision to pass back to ``put``/``delete``."""

    data: JSON
    revision: int


class _Record:
    """A small immutable record (cheaper to define than a NamedTuple: ~20 µs, not ~200 µs,
    and this module is on the CNI binaries' start-up path)."""

    __slots__ = ()
    _fields: tuple[str, ...] = ()

    def __init__(self, *args: object) -> None:
        if len(args) != len(self._fields):
            raise TypeError(f"{type(self).__name__} takes {len(self._fields)} arguments")
        for name, value in zip(self._fields, args, strict=True):
            object.__setattr__(self, name, value)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"{type(self).__name__} is immutable")

    def _tuple(self) -> tuple[object, ...]:
        return tuple(getattr(self, name) for name in self._fields)

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        assert isinstance(other, _Record)
        return self._tuple() == other._tuple()

    def __hash__(self) -> int:
        return hash(self._tuple())

    def __repr__(self) -> str:
        inner = ", ".join(f"{n}={getattr(self, n)!r}" for n in self._fields)
        return f"{type(self).__name__}({inner})"


class Undecoded(Mapping[str, Doc]):
    """One kind's documents of a ``sync`` snapshot as stored (JSON bytes), decoded when read.

    A consumer that takes the documents one at a time (``pop``: ``resources.index``) never
    holds all of them decoded at once: with 20k endpoints in the cluster, the decoded
    snapshot was ~150 MB at once on every tabby-node, and Python's allocator kept most of
    that after it was freed (bench/scale/node_memory_bench.py). The store decoded every value
    once when it made the snapshot and left out what does not decode, as from any snapshot;
    each read decodes again (a fresh copy, as ``get`` gives)."""

    __slots__ = ("_decode", "_raw")

    def __init__(
        self, decode: Callable[[str, bytes], JSON], raw: dict[str, tuple[bytes, int]]
    ) -> None:
        self._decode = decode  #: (key, value) -> data
        self._raw = raw  #: key -> (value, revision)

    def __getitem__(self, key: str) -> Doc:
        value, revision = self._raw[key]
        return Doc(self._decode(key, value), revision)

    def __iter__(self) -> Iterator[str]:
        return iter(self._raw)

    def __len__(self) -> int:
        return len(self._raw)

    def __contains__(self, key: object) -> bool:
        return key in self._raw

    def pop(self, key: str) -> Doc:
        """The document, no longer held here."""
        value, revision = self._raw.pop(key)
        return Doc(self._decode(key, value), revision)

    def revisions(self) -> dict[str, int]:
        return {key: revision for key, (_, revision) in self._raw.items()}


class SyncEvent(_Record):
    """What ``sync`` yields.

    ``type`` is ``"snapshot"`` (the first event only: ``snapshot`` holds every document of
    the watched kinds, by kind then key, a kind's as a dict or, from etcd, as
    :class:`Undecoded`; ``kind``/``key`` are ``""`` and ``doc`` is None),
    ``"put"`` (``doc`` is the new document) or ``"delete"`` (``doc`` is None).
    """

    __slots__ = ("doc", "key", "kind", "snapshot", "type")
    _fields = ("type", "kind", "key", "doc", "snapshot")
    type: str
    kind: str
    key: str
    doc: Doc | None
    snapshot: Mapping[str, dict[str, Doc] | Undecoded] | None

    def __init__(
        self,
        type: str,
        kind: str,
        key: str,
        doc: Doc | None,
        snapshot: Mapping[str, dict[str, Doc] | Undecoded] | None,
    ) -> None:
        super().__init__(type, kind, key, doc, snapshot)


class Store(Protocol):
    """The narrow protocol (see the module docstring)."""

    def lock(self) -> AbstractContextManager[None]: ...

    def get(self, kind: str, key: str) -> Doc | None: ...

    def list_keys(self, kind: str) -> list[str]: ...

    def list(self, kind: str, prefix: str = "") -> list[tuple[str, Doc]]: ...

    def put(
        self,
        kind: str,
        key: str,
        data: JSON,
        expected_revision: int | None,  # None: create (the document must not exist)
    ) -> int: ...

    def delete(self, kind: str, key: str, expected_revision: int) -> None: ...

    def sync(self, kinds: Iterable[str], stop: threading.Event) -> Iterator[SyncEvent]: ...

    @property
    def sync_stats(self) -> Mapping[str, int]:
        """``snapshots``, ``rereads``, ``resumes`` of every ``sync`` so far (see above)."""
        ...

    def check_usable(self) -> None: ...

    def location(self, kind: str, key: str) -> str:
        """Where the document lives (a path for the file store), for error messages."""
        ...

    def close(self) -> None: ...


class Leases(Store, Protocol):
    """A store whose documents can expire (file, memory, etcd; see the module docstring)."""

    def put_leased(
        self,
        kind: str,
        key: str,
        data: JSON,
        expected_revision: int | None,
        *,
        ttl: float,  # seconds the document lives unless written again or kept alive
    ) -> int: ...

    def keepalive(self, kind: str, key: str) -> bool: ...


def write_batch(store: Store) -> AbstractContextManager[None]:
    """Inside ``store.lock()``: the independent documents written in the block are durable
    when it exits, not each when its write returns (the file store: one fsync of each
    directory for them all, ``FileStore.write_batch``; every other store: each write as
    always). Each write is still its own compare-and-swap and visible at once; only for
    writes no invariant orders against each other, whose callers answer after the block."""
    batch = getattr(store, "write_batch", None)
    if callable(batch):
        got: AbstractContextManager[None] = batch()
        return got
    import contextlib

    return contextlib.nullcontext()


def leases(store: Store) -> Leases:
    """``store`` as a ``Leases`` (``TypeError`` for a store without leases: a caller that
    needs them runs only on the stores that have them)."""
    if not callable(getattr(store, "keepalive", None)):
        raise TypeError(f"{type(store).__name__} has no leases")
    return store  # type: ignore[return-value]


class StoreSettings(Protocol):
    """What ``open_store`` reads (docs/cluster.md "Datastore settings"); any object with these
    attributes will do (the plugins' config, tabby-node's and tabbyctl's options)."""

    @property
    def datastore_type(self) -> str:
        """``"file"``, ``"etcdv3"`` or ``"kubernetes"``."""
        ...

    @property
    def data_dir(self) -> str: ...

    @property
    def lock_timeout_seconds(self) -> float: ...

    @property
    def etcd_endpoints(self) -> Sequence[str]: ...

    @property
    def etcd_prefix(self) -> str: ...

    @property
    def etcd_ca_cert_file(self) -> str | None: ...

    @property
    def etcd_cert_file(self) -> str | None: ...

    @property
    def etcd_key_file(self) -> str | None: ...

    @property
    def etcd_watch_transport(self) -> str:
        """``"grpc"`` or ``"gateway"``: how tabby-node watches etcd."""
        ...

    @property
    def etcd_watch_endpoints(self) -> Sequence[str]:
        """Where tabby-node watches (empty: ``etcd_endpoints``)."""
        ...

    @property
    def kubeconfig(self) -> str | None:
        """The Kubernetes datastore's API access (None: ``$KUBECONFIG``, else the pod's
        service account)."""
        ...


def check_kind(kind: str) -> None:
    if kind not in _KIND_SET:
        raise ValueError(f"unknown document kind {kind!r}")


def check_key(key: str) -> None:
    if not isinstance(key, str) or not key:
        raise ValueError(f"invalid document key {key!r}")


def check_ttl(ttl: float | None) -> None:
    if ttl is not None and not (isinstance(ttl, int | float) and 0 < ttl < float("inf")):
        raise ValueError(f"invalid ttl {ttl!r} (seconds > 0)")


def sync_kinds(kinds: Iterable[str]) -> tuple[str, ...]:
    """The distinct, valid kinds of a ``sync`` call, in the order given."""
    out: list[str] = []
    for kind in kinds:
        check_kind(kind)
        if kind not in out:
            out.append(kind)
    if not out:
        raise ValueError("sync needs at least one kind")
    return tuple(out)
