"""Hostile datastore documents and API objects (tests/fuzz/documents.py): every kind's
parser gives its model or an error the index skips the document for; the Kubernetes
datastore's projections never raise."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import documents, hostile, seed_ids, seeds

#: One valid document of every kind (the corpus' seeds; ``regress-*`` are crashes found).
SEEDS = {
    name: json.loads(data)
    for name, data in zip(seed_ids("documents"), seeds("documents"), strict=True)
    if not name.startswith("regress")
}


@pytest.mark.parametrize("data", seeds("documents"), ids=seed_ids("documents"))
def test_corpus(data: bytes) -> None:
    documents.fuzz_one(data)


@pytest.mark.parametrize("kind", sorted(SEEDS))
@given(data=st.data())
def test_documents_with_hostile_values(kind: str, data: st.DataObject) -> None:
    envelope = SEEDS[kind]
    doc = data.draw(hostile.mutated(envelope["data"]))
    documents.check_envelope({"kind": kind, "key": envelope["key"], "data": doc})


@given(raw=st.binary(max_size=100))
def test_any_bytes_at_the_store_edge(raw: bytes) -> None:
    documents.fuzz_one(raw)
