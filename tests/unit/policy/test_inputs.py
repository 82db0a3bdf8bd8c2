"""tabby-node's memoised policy inputs (``policy.inputs.PolicyInputs``): the same engine inputs as
converting every document again, through changes, deletions and invalid documents, while
converting only the documents whose revision changed."""

from __future__ import annotations

from typing import Any

import pytest

from datastore.base import Doc
from policy import inputs
from policy import inputs as adapter
from resources.index import Documents
from tests import policy_truth_table as tt
from tests.unit.policy.world import PolicyWorld

Docs = dict[str, dict[str, Doc]]


def _fresh(docs: Docs) -> tuple[Any, Any]:
    """Everything converted from scratch, the way the engine's inputs are defined: every
    model validated by resources, then the adapter."""
    from ipam.core.errors import DatastoreError
    from resources.storage import BY_KIND, to_resource

    def models(kind: str, store_kind: str) -> list[Any]:
        out = []
        for key, doc in sorted((docs.get(store_kind) or {}).items()):
            try:
                out.append(to_resource(BY_KIND[kind], key, doc, key))
            except DatastoreError:
                continue
        return out

    state = adapter.cluster_state(
        models("NetworkPolicy", "networkpolicy"),
        models("Namespace", "namespace"),
        models("Pod", "pod"),
        models("WorkloadEndpoint", "workloadendpoint"),
    )
    return state, inputs.nat(models("IPPool", "pool"))


def _typed(docs: Docs) -> Documents:
    return Documents.from_raw(docs)


@pytest.fixture
def world() -> PolicyWorld:
    """The truth table's documents with the policies of its first 12 cases."""
    return PolicyWorld(p for case in tt.CASES[:12] for p in case.steps[0].policies)


def test_memoised_inputs_equal_a_fresh_conversion(
    world: PolicyWorld, monkeypatch: pytest.MonkeyPatch
) -> None:
    memo = adapter.PolicyInputs()
    assert memo.convert(_typed(world.docs)) == _fresh(world.docs)
    assert memo.convert(_typed(world.docs)) == _fresh(world.docs)

    # only what changed is converted again
    calls: list[str] = []
    real = inputs.policy

    def counting(model: Any) -> Any:
        calls.append(model.metadata.name)
        return real(model)

    monkeypatch.setattr(adapter, "policy", counting)
    deny = tt.network_policy(tt.DENY_ALL)
    world.put("networkpolicy", "x/default-deny-all", deny)  # a new revision of one policy
    world.put("pod", "x/b", tt.pod_doc("x/b", {"pod": "b", "pod2": "updated"}))
    world.wep("x/d", "cali00000000099", "10.244.1.20")
    got = memo.convert(_typed(world.docs))
    assert calls == ["default-deny-all"]
    assert got == _fresh(world.docs)

    # deletions, and a document that does not validate (skipped)
    del world.docs["networkpolicy"]["x/default-deny-all"]
    del world.docs["workloadendpoint"]["x/a-eth0"]
    world.put("networkpolicy", "x/broken", {"metadata": {"name": "broken"}, "spec": {"x": 1}})
    assert memo.convert(_typed(world.docs)) == _fresh(world.docs)
