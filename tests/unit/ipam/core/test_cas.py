"""The CAS helper (``datastore.cas``) and the candidate generator (``ipam.core.candidates``)."""

from __future__ import annotations

import random
import re
from typing import Any

import pytest

from datastore.base import Doc
from datastore.cas import DELETE, RETRIES, cas, update
from datastore.memory import MemoryStore
from ipam.core import Ipam, NoAddressAvailable, RevisionConflict
from ipam.core.candidates import (
    BORROW,
    CLAIM,
    GONE,
    ORPHAN,
    OWN,
    PROBES,
    Candidates,
    ClaimWalk,
)
from ipam.core.docs import Docs
from ipam.core.model import Affinity, Pool, Reserved
from ipam.core.pools import start_index
from tests import REPO_ROOT

from .helpers import CountingStore, hid, small, sreq

# -- cas ------------------------------------------------------------------------------------


def test_cas_rereads_after_a_lost_write() -> None:
    reads: list[int] = []
    writes: list[int] = []

    def read() -> int:
        reads.append(len(reads))
        return reads[-1]

    def write(state: int) -> str:
        writes.append(state)
        if state < 2:
            raise RevisionConflict("document changed", "k")
        return f"done at {state}"

    assert cas(read, write, "thing", "k") == "done at 2"
    assert reads == [0, 1, 2]
    assert writes == [0, 1, 2]


def test_cas_gives_up_after_bounded_retries() -> None:
    calls = []

    def write(state: None) -> None:
        calls.append(state)
        raise RevisionConflict("document changed", "k")

    with pytest.raises(RevisionConflict, match="thing changed too often"):
        cas(lambda: None, write, "thing", "k")
    assert len(calls) == RETRIES


def test_cas_does_not_retry_a_conflict_raised_while_reading() -> None:
    """A nested helper's exhausted retries are not multiplied by the outer one."""
    reads = []

    def read() -> None:
        reads.append(1)
        raise RevisionConflict("inner changed too often", "x")

    with pytest.raises(RevisionConflict, match="inner"):
        cas(read, lambda s: s, "outer", "k")
    assert reads == [1]


def test_cas_passes_other_errors_through_at_once() -> None:
    calls = []

    def write(state: None) -> None:
        calls.append(state)
        raise ValueError("boom")

    with pytest.raises(ValueError, match="boom"):
        cas(lambda: None, write, "thing", "k")
    assert calls == [None]


class RacingStore(CountingStore):
    """Before the first ``n`` puts of ``kind``, another writer changes the document."""

    def __init__(self, inner: MemoryStore, kind: str, n: int) -> None:
        super().__init__(inner)
        self.kind = kind
        self.n = n
        self.puts = 0

    def put(self, kind: str, key: str, data: dict[str, Any], expected_revision: int | None) -> int:
        if kind == self.kind and self.n > 0:
            self.n -= 1
            cur = self.inner.get(kind, key)
            if cur is not None:
                bumped = dict(cur.data, racer=cur.data.get("racer", 0) + 1)
                self.inner.put(kind, key, bumped, cur.revision)
        self.puts += 1
        return self.inner.put(kind, key, data, expected_revision)


def test_update_creates_changes_deletes_and_keeps() -> None:
    store = MemoryStore()
    assert update(store, "pool", "k", lambda d: None) is None  # absent, nothing to write
    rev = update(store, "pool", "k", lambda d: {"n": 1})
    assert rev is not None
    doc = store.get("pool", "k")
    assert doc == Doc({"n": 1}, rev)
    assert update(store, "pool", "k", lambda d: None) == rev  # kept as it is
    rev2 = update(store, "pool", "k", lambda d: {"n": d.data["n"] + 1} if d else None)
    assert rev2 is not None
    assert rev2 > rev
    assert store.get("pool", "k") == Doc({"n": 2}, rev2)
    assert update(store, "pool", "k", lambda d: DELETE) is None
    assert store.get("pool", "k") is None
    assert update(store, "pool", "k", lambda d: DELETE) is None  # already gone


def test_update_applies_the_change_to_the_fresh_document_after_a_conflict() -> None:
    inner = MemoryStore()
    inner.put("pool", "k", {"n": 1}, None)
    racing = RacingStore(inner, "pool", n=2)
    seen: list[dict[str, Any]] = []

    def change(doc: Doc | None) -> dict[str, Any]:
        assert doc is not None
        seen.append(doc.data)
        return dict(doc.data, n=doc.data["n"] + 1)

    update(racing, "pool", "k", change)  # type: ignore[arg-type]
    assert [d.get("racer", 0) for d in seen] == [0, 1, 2]
    final = inner.get("pool", "k")
    assert final is not None
    assert final.data == {"n": 2, "racer": 2}  # the racer's change is kept, ours on top


def test_update_change_may_abort() -> None:
    store = MemoryStore()
    store.put("pool", "k", {"n": 1}, None)

    def change(doc: Doc | None) -> dict[str, Any]:
        raise KeyError("no")

    with pytest.raises(KeyError):
        update(store, "pool", "k", change)
    doc = store.get("pool", "k")
    assert doc is not None
    assert doc.data == {"n": 1}


def test_the_product_has_one_retry_loop() -> None:
    """Every read-modify-write goes through ``datastore.cas``: no other module of the
    product loops on a number of tries or catches a RevisionConflict to go round again."""
    packages = [p for p in REPO_ROOT.iterdir() if (p / "__init__.py").exists()]
    packages = [p for p in packages if p.name not in ("tests", "bench", "lab")]
    assert packages
    for path in sorted(f for p in packages for f in p.rglob("*.py")):
        text = path.read_text()
        if path == REPO_ROOT / "datastore" / "cas.py":
            assert text.count("for _ in range(RETRIES)") == 1
            continue
        assert "RETRIES" not in text, path
        assert not re.search(r"except RevisionConflict:\s*\n\s*continue", text), path


def test_a_conflict_during_assign_is_retried_through_the_helper() -> None:
    """Another writer changes the block between the pick and the write: the assign picks
    again from a fresh read and succeeds."""
    inner = MemoryStore()
    ipam = small(inner)
    first = ipam.assign(sreq(hid(0)))[0]
    racing = RacingStore(inner, "block", n=1)
    got = Ipam(racing, "node-a").assign(sreq(hid(1)))[0]  # type: ignore[arg-type]
    assert got.ip != first.ip
    assert racing.puts >= 2


# -- the claim walk -------------------------------------------------------------------------


def test_claim_walk_starts_at_the_cursor_and_skips_known_blocks() -> None:
    store = MemoryStore()
    pool = Pool.from_spec("10.9.0.0/24", 28)
    aff = Affinity.new("n1")
    first = [idx for idx, _ in ClaimWalk(store, "n1", pool, aff, Reserved.parse(()))]
    start = start_index("n1", pool)
    assert first == [(start + k) % 16 for k in range(16)]
    aff.cursor[pool.cidr] = 5
    aff.blocks = [str(pool.block_network(6))]
    got = [idx for idx, _ in ClaimWalk(store, "n1", pool, aff, Reserved.parse(()))]
    assert got[:3] == [5, 7, 8]
    assert len(got) == 15
    aff.cursor[pool.cidr] = 99  # out of range: back to the node's own start
    assert next(iter(ClaimWalk(store, "n1", pool, aff, Reserved.parse(()))))[0] == start


def test_claim_walk_lists_the_keys_after_a_few_taken_candidates() -> None:
    store = CountingStore(MemoryStore())
    pool = Pool.from_spec("10.9.0.0/24", 28)
    for i in range(0, 16, 2):
        store.inner.put("block", str(pool.block_network(i)), {}, None)
    aff = Affinity.new("n1")
    aff.cursor[pool.cidr] = 0
    walker = ClaimWalk(store, "n1", pool, aff, Reserved.parse(()))  # type: ignore[arg-type]
    seen = []
    for idx, _net in walker:
        seen.append(idx)
        if idx % 2 == 0:
            walker.taken()
    assert store.lists == 1
    # the first PROBES existing ones were offered, then the listing skipped the rest
    assert [i for i in seen if i % 2 == 0] == [0, 2, 4][:PROBES]
    assert [i for i in seen if i % 2] == list(range(1, 16, 2))


# -- the candidate generator ------------------------------------------------------------------


def snapshot(store: MemoryStore) -> dict[str, dict[str, Any]]:
    return {
        kind: {k: store.get(kind, k) for k in store.list_keys(kind)}
        for kind in ("pool", "block", "affinity")
    }


def kinds(store: MemoryStore, node: str, **kw: Any) -> list[tuple[str, str]]:
    docs = Docs(store, node, lambda: 0.0)
    pools = [p for p in docs.all_pools().values() if p.version == 4]
    aff = docs.affinity(node)[0]
    params: dict[str, Any] = {"strict": False, "max_blocks": 0}
    params.update(kw)
    cands = Candidates(docs, 4, pools, Reserved.parse(()), aff=lambda: aff, **params)
    return [(c.kind, c.cidr) for c in cands]


def test_candidates_in_order_and_read_only() -> None:
    store = MemoryStore()
    a = small(store, "node-a", pool="10.1.0.0/28")  # four /30 blocks
    b = Ipam(store, "node-b")
    a1 = a.assign(sreq(hid("a1"), "10.1.0.0/28"))[0].block_cidr  # node-a: room
    for i in range(4):  # node-b: one full block
        b.assign(sreq(hid(f"b{i}"), "10.1.0.0/28"))
    b.release_handle(hid("b0"))  # ... with room again
    before = snapshot(store)
    got = kinds(store, "node-a")
    assert snapshot(store) == before  # the generator never writes
    assert got[0] == (OWN, str(a1))
    claims = [c for k, c in got if k == CLAIM]
    assert len(claims) == 2  # the two blocks nobody has
    assert got[1 : 1 + len(claims)] == [(CLAIM, c) for c in claims]
    assert got[-1][0] == BORROW  # node-b's block with room, last
    # strict affinity: nothing to borrow; a block limit: nothing to claim
    assert BORROW not in {k for k, _ in kinds(store, "node-a", strict=True)}
    assert CLAIM not in {k for k, _ in kinds(store, "node-a", max_blocks=1)}


def test_candidates_skip_full_own_blocks_and_report_gone_ones() -> None:
    store = MemoryStore()
    a = small(store, "node-a", pool="10.1.0.0/29")  # two /30 blocks
    got = [a.assign(sreq(hid(i)))[0] for i in range(5)]  # block 1 full, block 2 has room
    full, roomy = str(got[0].block_cidr), str(got[4].block_cidr)
    assert kinds(store, "node-a") == [(OWN, roomy)]
    a.release_handle(hid(1))  # block 1 has room again: first in claim order
    assert kinds(store, "node-a") == [(OWN, full), (OWN, roomy)]
    # a block that is not ours any more is reported gone
    blk = store.get("block", roomy)
    assert blk is not None
    blk.data["affinity"] = "host:node-z"
    store.put("block", roomy, blk.data, blk.revision)
    assert kinds(store, "node-a")[1] == (GONE, roomy)


def test_candidates_offer_orphans_for_adoption() -> None:
    store = MemoryStore()
    a = small(store, "node-a", pool="10.1.0.0/29")
    got = a.assign(sreq(hid(0)))[0]
    store.delete("affinity", "node-a", store.get("affinity", "node-a").revision)  # type: ignore[union-attr]
    found = kinds(store, "node-a")
    assert (ORPHAN, str(got.block_cidr)) in found


def test_candidates_skip_closed_pools() -> None:
    store = MemoryStore()
    a = small(store, "node-a", pool="10.1.0.0/29")
    a.assign(sreq(hid(0)))
    docs = Docs(store, "node-a", lambda: 0.0)
    pools = list(docs.all_pools().values())
    aff = docs.affinity("node-a")[0]
    cands = Candidates(
        docs,
        4,
        pools,
        Reserved.parse(()),
        strict=False,
        max_blocks=0,
        aff=lambda: aff,
        closed={pools[0].cidr},
    )
    assert list(cands) == []


def clone(store: MemoryStore) -> MemoryStore:
    out = MemoryStore()
    for kind, docs in snapshot(store).items():
        for key, doc in docs.items():
            assert doc is not None
            out.put(kind, key, doc.data, None)
    return out


@pytest.mark.parametrize("seed", range(12))
def test_status_and_assign_agree(seed: int) -> None:
    """STATUS says ready exactly when an ADD would get an address: both decide with the one
    generator, on random multi-node states of a small pool."""
    rnd = random.Random(seed)
    pool = "10.1.0.0/28"
    store = MemoryStore()
    nodes = {n: small(store, n, pool=pool) for n in ("node-a", "node-b", "node-c")}
    live: list[tuple[str, str]] = []
    for step in range(rnd.randrange(4, 24)):
        node = rnd.choice(list(nodes))
        if live and rnd.random() < 0.3:
            n, h = live.pop(rnd.randrange(len(live)))
            nodes[n].release_handle(h)
            continue
        h = hid(f"{node}-{step}")
        try:
            nodes[node].assign(sreq(h, pool, max_blocks_per_host=rnd.choice([0, 1, 2])))
            live.append((node, h))
        except NoAddressAvailable:
            pass
    for node in nodes:
        for strict in (False, True):
            for mb in (0, 1):
                why = nodes[node].can_allocate(
                    [pool],
                    [],
                    need_v4=True,
                    need_v6=False,
                    strict_affinity=strict,
                    max_blocks_per_host=mb,
                    reserved=[],
                )
                trial = clone(store)
                try:
                    Ipam(trial, node).assign(
                        sreq(hid("probe"), pool, strict_affinity=strict, max_blocks_per_host=mb)
                    )
                    ok = True
                except NoAddressAvailable:
                    ok = False
                assert (why is None) == ok, (node, strict, mb, why)
