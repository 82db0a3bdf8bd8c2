"""The IPAM core run as tabby-node runs it on etcd: each operation on an optimistic view of
the store, based on what a node knows (a watch that lags, its own writes, guesses that are
wrong), and one commit that proves every document it relied on (``datastore.optimistic``).

The core's cluster races are run again this way: nodes without a shared lock churning on
one store must never hand out an address twice and must leave a consistent store, whether
their knowledge is fresh, late, or wrong; and the fast path must actually be taken."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from datastore.base import Doc, Store
from datastore.memory import MemoryStore
from datastore.optimistic import UNKNOWN, Counts, Optimistic, Speculation, Unknown, attempt
from ipam.core import Allocation, AssignRequest, Ipam, PoolSpec
from ipam.core.errors import RevisionConflict

from .helpers import assert_one_affinity_per_block, errors, hid, req
from .test_ipam_cluster import POOL, POOL6, Held, Ledger, check_holdings, churn, run_threads

T = TypeVar("T")
WATCHED = ("block", "pool")


class WatchKnown:
    """What a tabby-node knows: blocks and pools from a watch of the store (applied by its
    own thread, so behind the store by however the threads interleave), handles and
    affinities from its own reads and writes. ``wrong``: the chance that a lookup answers
    an older revision it saw, or claims a document absent, or present when it is not."""

    def __init__(self, store: MemoryStore, *, wrong: float = 0.0, seed: int = 0) -> None:
        self.mirror: dict[tuple[str, str], Doc] = {}
        self.history: dict[tuple[str, str], list[Doc]] = {}
        self.memo: dict[tuple[str, str], Doc | None] = {}
        self.lock = threading.Lock()
        self.synced = threading.Event()
        self.stop = threading.Event()
        self.wrong = wrong
        self.rnd = random.Random(seed)
        self.thread = threading.Thread(target=self._watch, args=(store,), daemon=True)
        self.thread.start()
        assert self.synced.wait(10)

    def _watch(self, store: MemoryStore) -> None:
        for ev in store.sync(WATCHED, self.stop):
            with self.lock:
                if ev.type == "snapshot":
                    assert ev.snapshot is not None
                    for kind, docs in ev.snapshot.items():
                        for key, doc in docs.items():
                            self._put(kind, key, doc)
                    self.synced.set()
                elif ev.doc is not None:
                    self._put(ev.kind, ev.key, ev.doc)
                else:
                    self.mirror.pop((ev.kind, ev.key), None)

    def _put(self, kind: str, key: str, doc: Doc) -> None:
        old = self.mirror.get((kind, key))
        if old is None or old.revision < doc.revision:
            self.mirror[(kind, key)] = doc
            self.history.setdefault((kind, key), []).append(doc)

    def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
        with self.lock:
            if self.wrong and self.rnd.random() < self.wrong:
                seen = self.history.get((kind, key)) or []
                choice = self.rnd.random()
                if seen and choice < 0.5:
                    return self.rnd.choice(seen)  # an older revision
                if choice < 0.8:
                    return None  # "absent"
                return UNKNOWN
            if kind in WATCHED:
                return self.mirror.get((kind, key))
            return self.memo.get((kind, key), UNKNOWN)

    def learn(self, kind: str, key: str, doc: Doc | None) -> None:
        with self.lock:
            if kind in WATCHED:
                if doc is None:
                    self.mirror.pop((kind, key), None)
                else:
                    self._put(kind, key, doc)
            else:
                self.memo[(kind, key)] = doc

    def forget(self, kind: str, key: str) -> None:
        with self.lock:
            self.memo.pop((kind, key), None)

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)


class FastIpam:
    """The core's operations as tabby-node's CNI calls run them."""

    def __init__(self, store: Store, node: str, known: WatchKnown, counts: Counts) -> None:
        self.store = store
        self.node = node
        self.known = known
        self.counts = counts

    def _run(self, fn: Callable[[Ipam], T], **kw: Any) -> T:
        return attempt(
            self.store, self.known, lambda s: fn(Ipam(s, self.node)), counts=self.counts, **kw
        )[0]

    def assign(self, r: AssignRequest) -> list[Allocation]:
        return self._run(lambda i: i.assign(r), absent=("handle",), creatable=("handle",))

    def release_handle(self, h: str) -> list[Allocation]:
        return self._run(lambda i: i.release_handle(h))

    def release_ip(self, ip: str, expected_seq: int | None = None) -> Any:
        return self._run(lambda i: i.release_ip(ip, expected_seq=expected_seq))

    def get_handle(self, h: str) -> list[Allocation]:
        return self._run(lambda i: i.get_handle(h))


@pytest.fixture
def knowns() -> Iterator[list[WatchKnown]]:
    made: list[WatchKnown] = []
    yield made
    for k in made:
        k.close()


def _store() -> MemoryStore:
    inner = MemoryStore()
    Ipam(inner, "").ensure_pools([PoolSpec(POOL, 29), PoolSpec(POOL6, 124)])
    return inner


@pytest.mark.parametrize("wrong", [0.0, 0.2])
def test_nodes_on_the_fast_path_never_hand_out_an_address_twice(
    knowns: list[WatchKnown], wrong: float
) -> None:
    """Three nodes, two writers each, on their own (lagging, sometimes wrong) knowledge."""
    inner = _store()
    ledger = Ledger()
    failures: list[str] = []
    helds: list[Held] = []
    counts = Counts()
    targets = []
    for i, name in enumerate(("node-a", "node-b", "node-c")):
        known = WatchKnown(inner, wrong=wrong, seed=i)
        knowns.append(known)
        fast = FastIpam(inner, name, known, counts)
        for t in range(2):
            held: Held = {}
            helds.append(held)
            targets.append(
                lambda fast=fast, name=name, seed=i * 10 + t, held=held: churn(
                    fast,  # type: ignore[arg-type]  # the core's operations, run fast
                    name,
                    seed,
                    200,
                    ledger,
                    held,
                    failures,
                )
            )
    run_threads(targets)
    assert failures == []
    assert ledger.doubles == []
    assert errors(inner) == []
    assert_one_affinity_per_block(inner)
    check_holdings(inner, {h: ips for held in helds for h, ips in held.items()})
    done = counts.as_dict()
    # both ways were taken: one commit, and the store when the knowledge was stale
    assert done["committed"] > 100, done
    assert done["retried"] + done["declined"] + done["failed"] > 0, done


def test_an_assign_on_fresh_knowledge_is_one_commit(knowns: list[WatchKnown]) -> None:
    """Once the node's block exists and its affinity document is known (here: learnt from
    the first ADD, which claimed the block on the store), an ADD reads nothing from the
    store and writes once: the handle and the allocation, with every document it relied on
    compared."""
    inner = _store()
    known = WatchKnown(inner)
    knowns.append(known)
    counts = Counts()
    fast = FastIpam(inner, "node-a", known, counts)
    first = fast.assign(req(hid(1), v4_pools=[POOL], v6_pools=[POOL6]))  # claims: the store
    assert counts.as_dict()["declined"] == 1
    commits: list[list[Any]] = []
    gets: list[tuple[str, str]] = []
    real_commit, real_get = inner.commit, inner.get

    def counting_commit(ops: Any) -> list[int]:
        commits.append(list(ops))
        return real_commit(ops)

    def counting_get(kind: str, key: str) -> Doc | None:
        gets.append((kind, key))
        return real_get(kind, key)

    inner.commit = counting_commit  # type: ignore[method-assign]
    inner.get = counting_get  # type: ignore[method-assign]
    gets.clear()
    second = fast.assign(req(hid(2), v4_pools=[POOL], v6_pools=[POOL6]))
    assert gets == [], (gets, counts.as_dict())
    assert len(commits) == 1
    kinds = sorted((op.kind, op.data is not None) for op in commits[0])
    assert ("handle", True) in kinds
    assert ("block", True) in kinds
    assert counts.as_dict()["committed"] == 1
    assert second[0].block_cidr == first[0].block_cidr
    assert second[0].ip != first[0].ip
    assert fast.get_handle(hid(2)) == second
    assert errors(inner) == []


def test_a_repeated_add_finds_its_handle_on_the_store(knowns: list[WatchKnown]) -> None:
    """The handle is assumed absent; when it exists, the commit fails and the store answers
    what the handle holds (ADD-7 in cni_protocol/CONFORMANCE.md): no second address."""
    inner = _store()
    known = WatchKnown(inner)
    knowns.append(known)
    counts = Counts()
    fast = FastIpam(inner, "node-a", known, counts)
    first = fast.assign(req(hid(1), v4_pools=[POOL]))
    known.memo.clear()  # tabby-node restarted: it knows no handle
    again = fast.assign(req(hid(1), v4_pools=[POOL]))
    assert again == first
    assert counts.as_dict()["retried"] + counts.as_dict()["failed"] >= 1


def test_the_view_declines_what_one_commit_cannot_prove() -> None:
    inner = MemoryStore()
    inner.put("pool", "p", {"v": 1}, None)

    class Nothing:
        def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
            return UNKNOWN

        def learn(self, kind: str, key: str, doc: Doc | None) -> None:
            pass

        def forget(self, kind: str, key: str) -> None:
            pass

    def view() -> Optimistic:
        return Optimistic(inner, Nothing(), creatable=("handle",))

    for act in (
        lambda v: v.list_keys("pool"),
        lambda v: v.list("pool"),
        lambda v: v.put("heartbeat", "n", {}, None, ttl=5),
        lambda v: v.put("block", "10.0.0.0/26", {}, None),  # a create of a kind not declared
        lambda v: (v.put("handle", "h", {}, None), v.put("handle", "h", {}, -1)),
        lambda v: v.put("pool", "p", {}, 12345),  # not the revision it read
    ):
        with pytest.raises(Speculation):
            act(view())
    v = view()
    v.put("handle", "h", {"a": 1}, None)
    assert v.get("handle", "h") == Doc({"a": 1}, -1)  # its own write, provisional
    assert inner.get("handle", "h") is None  # held back until the commit
    v.finish()
    assert inner.get("handle", "h") is not None


def test_a_commit_proves_every_document_read() -> None:
    """A document read and not written is compared: a change made meanwhile by someone
    else makes the commit fail, and the operation runs again on the store."""
    inner = MemoryStore()
    inner.put("pool", "p", {"v": 1}, None)
    counts = Counts()

    class Remember:
        def __init__(self) -> None:
            self.docs: dict[tuple[str, str], Doc | None] = {}

        def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
            return self.docs.get((kind, key), UNKNOWN)

        def learn(self, kind: str, key: str, doc: Doc | None) -> None:
            self.docs[(kind, key)] = doc

        def forget(self, kind: str, key: str) -> None:
            self.docs.pop((kind, key), None)

    known = Remember()
    runs = []

    def copy_pool(store: Store) -> int:
        runs.append(isinstance(store, Optimistic))
        doc = store.get("pool", "p")
        assert doc is not None
        if len(runs) == 1:  # someone changes the pool meanwhile
            inner.put("pool", "p", {"v": 2}, doc.revision)
        return store.put("handle", "copy", {"v": doc.data["v"]}, None)

    attempt(inner, known, copy_pool, creatable=("handle",), counts=counts)
    assert runs == [True, False]  # the view, then the store
    stored = inner.get("handle", "copy")
    assert stored is not None
    assert stored.data == {"v": 2}
    assert counts.as_dict()["retried"] == 1
    with pytest.raises(RevisionConflict):  # the store itself still refuses a stale write
        inner.put("handle", "copy", {}, stored.revision - 1)
