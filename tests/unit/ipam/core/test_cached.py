"""The IPAM core run as tabby-node runs it: each operation reads through what a node knows
(a watch that lags, its own writes, guesses that are wrong) and writes to the store, every
write one compare-and-swap at the revision read (``datastore.cached``).

The core's cluster races are run again this way: nodes without a shared lock churning on
one store must never hand out an address twice and must leave a consistent store, whether
their knowledge is fresh, late, or wrong; and the fast path (no read, one write) must
actually be taken."""

from __future__ import annotations

import random
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import pytest

from datastore.base import Doc, Store
from datastore.cached import UNKNOWN, Cached, Counts, Unknown, run
from datastore.memory import MemoryStore
from ipam.core import Allocation, AssignRequest, Ipam, PoolSpec
from ipam.core.errors import RevisionConflict

from .helpers import assert_one_affinity_per_block, errors, hid, req
from .test_cluster import POOL, POOL6, Held, Ledger, check_holdings, churn, run_threads

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

    def _run(self, fn: Callable[[Ipam], T]) -> T:
        return run(self.store, self.known, lambda s: fn(Ipam(s, self.node)), self.counts)

    def assign(self, r: AssignRequest) -> list[Allocation]:
        return self._run(lambda i: i.assign(r))

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
@pytest.mark.slow
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
    # both ways were taken: straight through, and again when the knowledge was stale
    assert done["cached"] > 100, done
    assert done["retried"] + done["fresh"] > 0, done


def test_an_assign_on_fresh_knowledge_reads_nothing_and_writes_once(
    knowns: list[WatchKnown],
) -> None:
    """Once the node's block exists and its affinity document is known (here: learnt from
    the first ADD, which claimed the block), an ADD reads nothing from the store and writes
    one document: the block, holding the allocation (and so the handle). A DEL too."""
    inner = _store()
    known = WatchKnown(inner)
    knowns.append(known)
    counts = Counts()
    fast = FastIpam(inner, "node-a", known, counts)
    first = fast.assign(req(hid(1), v4_pools=[POOL], v6_pools=[POOL6]))  # claims two blocks
    writes: list[tuple[str, str]] = []
    gets: list[tuple[str, str]] = []
    real_put, real_get = inner.put, inner.get

    def counting_put(kind: str, key: str, data: Any, rev: int | None) -> int:
        writes.append((kind, key))
        return real_put(kind, key, data, rev)

    def counting_get(kind: str, key: str) -> Doc | None:
        gets.append((kind, key))
        return real_get(kind, key)

    inner.put = counting_put  # type: ignore[method-assign]
    inner.get = counting_get  # type: ignore[method-assign]
    second = fast.assign(req(hid(2), v4_pools=[POOL]))
    assert gets == [], (gets, counts.as_dict())
    assert writes == [("block", str(first[0].block_cidr))]
    assert second[0].block_cidr == first[0].block_cidr
    assert second[0].ip != first[0].ip
    writes.clear()
    assert fast.release_handle(hid(2)) == second
    assert gets == []
    assert writes == [("block", str(first[0].block_cidr))]
    assert counts.as_dict()["cached"] == 3
    inner.put, inner.get = real_put, real_get  # type: ignore[method-assign]
    assert errors(inner) == []


def test_a_repeated_add_finds_what_it_holds(knowns: list[WatchKnown]) -> None:
    """A repeated ADD gets the addresses its attachment holds (ADD-7 in
    cni_protocol/CONFORMANCE.md), also when tabby-node restarted and knows nothing but
    its watch: no second address."""
    inner = _store()
    known = WatchKnown(inner)
    knowns.append(known)
    counts = Counts()
    fast = FastIpam(inner, "node-a", known, counts)
    first = fast.assign(req(hid(1), v4_pools=[POOL]))
    known.memo.clear()  # tabby-node restarted: it knows its watch only
    again = fast.assign(req(hid(1), v4_pools=[POOL]))
    assert again == first
    assert errors(inner) == []


class Remember:
    def __init__(self) -> None:
        self.docs: dict[tuple[str, str], Doc | None] = {}

    def lookup(self, kind: str, key: str) -> Doc | Unknown | None:
        return self.docs.get((kind, key), UNKNOWN)

    def learn(self, kind: str, key: str, doc: Doc | None) -> None:
        self.docs[(kind, key)] = doc

    def forget(self, kind: str, key: str) -> None:
        self.docs.pop((kind, key), None)


def test_a_stale_read_costs_a_conflict_never_a_wrong_write() -> None:
    """A document changed since it was known: the write at the revision read loses, the
    document is forgotten, and the next read comes from the store."""
    inner = MemoryStore()
    r1 = inner.put("pool", "p", {"v": 1}, None)
    known = Remember()
    view = Cached(inner, known)
    assert view.get("pool", "p") == Doc({"v": 1}, r1)  # read through, learnt
    inner.put("pool", "p", {"v": 2}, r1)  # someone else
    assert view.get("pool", "p") == Doc({"v": 1}, r1)  # stale, from knowledge
    with pytest.raises(RevisionConflict):
        view.put("pool", "p", {"v": 3}, r1)
    assert view.conflicts == 1
    fresh = view.get("pool", "p")
    assert fresh is not None
    assert fresh.data == {"v": 2}
    r3 = view.put("pool", "p", {"v": 3}, fresh.revision)
    assert known.docs[("pool", "p")] == Doc({"v": 3}, r3)  # its own write, learnt


def test_a_refusal_on_stale_knowledge_is_asked_of_the_store() -> None:
    """What fails on the view runs again on the store: a pool the watch has not delivered
    yet does not refuse the ADD. A failure of the store itself is not run twice."""
    inner = MemoryStore()
    Ipam(inner, "").ensure_pools([PoolSpec(POOL, 29)])
    known = Remember()
    known.docs[("pool", POOL)] = None  # "absent": the watch is behind
    counts = Counts()
    request = req(hid(1), v4_pools=[POOL])
    got = run(inner, known, lambda s: Ipam(s, "node-a").assign(request), counts)
    assert got
    assert counts.as_dict()["fresh"] == 1
    calls = []

    def unavailable(store: Store) -> None:
        from datastore.errors import StoreUnavailable

        calls.append(store)
        raise StoreUnavailable("etcd", "down")

    with pytest.raises(Exception, match="down"):
        run(inner, known, unavailable, counts)
    assert len(calls) == 1


def test_the_pool_gate_reads_the_store_not_the_knowledge() -> None:
    """A block is admitted only while its pool exists now: a pool deleted behind the
    knowledge's back does not let a new block of it receive an address."""
    inner = MemoryStore()
    Ipam(inner, "").ensure_pools([PoolSpec(POOL, 29)])
    known = Remember()
    view = Cached(inner, known)
    assert view.get("pool", POOL) is not None  # known to exist
    Ipam(inner, "").delete_pool(POOL)  # gone from the store
    with pytest.raises(Exception, match="pool"):
        Ipam(view, "node-a").assign(req(hid(1), v4_pools=[POOL]))
    assert [k for k, _ in inner.list("block")] == []


def test_a_known_document_is_copied_whole_for_its_reader() -> None:
    """What a served operation reads it may change: never what tabby-node knows."""
    from datastore.cached import copy_json

    known = {"a": [{"b": {"c": [1, 2]}}, None, "s"], "n": 1.5, "t": True}
    copy = copy_json(known)
    assert copy == known
    copy["a"][0]["b"]["c"].append(3)
    copy["a"][0]["x"] = 1
    copy["a"].append(4)
    assert known == {"a": [{"b": {"c": [1, 2]}}, None, "s"], "n": 1.5, "t": True}
