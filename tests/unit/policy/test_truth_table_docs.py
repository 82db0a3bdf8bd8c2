"""The truth table as resources (tests/policy_truth_table.py): every case's policies become
NetworkPolicy documents that the resource models accept and that come back, through the
adapter, as the same engine policies; the cluster tier relies on it."""

from __future__ import annotations

import dataclasses
import json

import pytest

from policy import engine, inputs
from resources.client import merge
from resources.k8s import Namespace, NetworkPolicy, Pod
from tests import policy_truth_table as tt

POLICIES = {
    json.dumps(tt.network_policy(p), sort_keys=True): p  # each distinct policy once
    for c in tt.CASES
    for s in c.steps
    for p in s.policies
}


def _same(a: engine.Policy, b: engine.Policy) -> bool:
    """Equal up to ``policyTypes`` defaulting (the models apply the API server's)."""
    return a.types == b.types and dataclasses.replace(a, policy_types=()) == dataclasses.replace(
        b, policy_types=()
    )


@pytest.mark.parametrize("policy", list(POLICIES.values()), ids=lambda p: p.name)
def test_every_policy_round_trips_through_the_resource_model(policy: engine.Policy) -> None:
    doc = tt.network_policy(policy)
    model = NetworkPolicy.model_validate(doc)
    assert _same(inputs.policy(model), policy)


def test_replacing_clears_what_an_earlier_version_set() -> None:
    """Case 20: ``allow-all`` then ``ingress: []`` under one name; a merge of the second
    over the first must be the second."""
    first, second = (s.policies[0] for s in next(c for c in tt.CASES if c.number == 20).steps)
    stored = tt.network_policy(first)
    merged = merge(stored, tt.replacing(tt.network_policy(second)))
    assert _same(inputs.policy(NetworkPolicy.model_validate(merged)), second)
    selective = tt.pol("p", tt.A, ingress=(tt.rule(tt.peer(tt.sel(pod="b"))),), types=("Ingress",))
    merged = merge(tt.network_policy(selective), tt.replacing(tt.network_policy(second)))
    assert _same(inputs.policy(NetworkPolicy.model_validate(merged)), second)


def test_setup_documents_and_label_changes() -> None:
    docs = tt.setup_docs()
    namespaces = [Namespace.model_validate(d) for d in docs if d["kind"] == "Namespace"]
    pods = [inputs.pod(Pod.model_validate(d)) for d in docs if d["kind"] == "Pod"]
    assert [n.metadata.name for n in namespaces] == list(tt.NAMESPACES)
    assert namespaces[1].metadata.labels == {"ns": "y", "kubernetes.io/metadata.name": "y"}
    assert [f"{p.namespace}/{p.name}" for p in pods] == list(tt.PODS)
    assert {p.name for p in pods[0].ports} == {c.name for c in tt.NAMED_PORTS}
    assert tt.label_changes({"pod": "b"}, {"pod": "b", "pod2": "updated"}) == {"pod2": "updated"}
    assert tt.label_changes({"pod": "b", "pod2": "updated"}, {"pod": "b"}) == {"pod2": None}
    stored = tt.pod_doc("x/b", {"pod": "b", "pod2": "updated"})
    back = merge(stored, tt.pod_doc("x/b", {"pod2": None}, ports=False))
    assert Pod.model_validate(back).metadata.labels == {"pod": "b"}
