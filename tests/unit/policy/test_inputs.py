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

Docs = dict[str, dict[str, Doc]]


class World:
    def __init__(self) -> None:
        self.docs: Docs = {
            k: {} for k in ("networkpolicy", "namespace", "pod", "workloadendpoint", "pool")
        }
        self.rev = 0

    def put(self, kind: str, key: str, doc: dict[str, Any]) -> None:
        self.rev += 1
        data = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
        self.docs[kind][key] = Doc(data, self.rev)

    def wep(self, pod: str, iface: str, address: str | None = None) -> None:
        ns, name = pod.split("/")
        self.put(
            "workloadendpoint",
            f"{ns}/{name}-eth0",
            {
                "metadata": {"name": f"{name}-eth0", "namespace": ns, "labels": {"pod": name}},
                "spec": {
                    "pod": name,
                    "node": "node-1",
                    "hostInterface": iface,
                    "ipNetworks": [f"{address or tt.address(pod)}/32"],
                },
            },
        )


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
def world() -> World:
    w = World()
    for doc in tt.setup_docs():
        meta = doc["metadata"]
        assert isinstance(meta, dict)
        key = f"{meta['namespace']}/{meta['name']}" if "namespace" in meta else meta["name"]
        w.put(str(doc["kind"]).lower(), key, doc)
    for i, pod in enumerate(tt.PODS):
        w.wep(pod, f"cali{i:011x}")
    for case in tt.CASES[:12]:
        for p in case.steps[0].policies:
            w.put("networkpolicy", f"{p.namespace}/{p.name}", tt.network_policy(p))
    w.rev += 1  # the IPAM pool document, keyed by its CIDR
    pool = {"cidr": "10.244.0.0/16", "block_size": 26, "name": "p", "nat_outgoing": True}
    w.docs["pool"]["10.244.0.0/16"] = Doc(pool, w.rev)
    return w


def test_memoised_inputs_equal_a_fresh_conversion(
    world: World, monkeypatch: pytest.MonkeyPatch
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
