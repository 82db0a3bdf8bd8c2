"""Calico's policy kinds in the Kubernetes datastore (``stores.kube``): custom resources of
``tabby.io`` (the namespaced ones in their namespace), written and read through
``ResourceClient`` as in every other store, what kubectl made read back as tabby's
documents, and a document the schema refuses refused by the (fake) API server."""

from __future__ import annotations

import copy
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from datastore.errors import InvalidConfig
from resources.client import ResourceClient
from resources.storage import BY_STORE_KIND
from stores.kube.kinds import CRDS
from stores.kube.store import KubeStore
from tests.kube_fake import FakeApi, fake_api
from tests.unit.resources.test_calico import CALICO_VALID
from tests.unit.stores.test_kube_store import store_of


@pytest.fixture
def api() -> Iterator[tuple[FakeApi, str]]:
    with fake_api() as made:
        yield made


@pytest.fixture
def store(api: tuple[FakeApi, str], tmp_path: Path) -> Iterator[KubeStore]:
    made = store_of(api[1], tmp_path)
    yield made
    made.close()


def test_every_calico_kind_round_trips_as_a_custom_resource(
    api: tuple[FakeApi, str], store: KubeStore
) -> None:
    fake = api[0]
    client = ResourceClient(store, kubernetes_datastore=True)
    applied = client.apply(list(CALICO_VALID.values()))
    assert [a.action for a in applied] == ["created"] * len(CALICO_VALID)
    for kind, doc in CALICO_VALID.items():
        crd = CRDS[kind]
        meta = doc["metadata"]
        key = f"{meta['namespace']}/{meta['name']}" if crd.namespaced else meta["name"]
        obj = fake.objects[crd.path][key]  # where kubectl sees it
        assert obj["apiVersion"] == "tabby.io/v1"
        assert obj["kind"] == doc["kind"]
        assert obj["metadata"].get("namespace") == (meta["namespace"] if crd.namespaced else None)
        assert obj["spec"] == doc["spec"]
        info = BY_STORE_KIND[kind]
        got = client.get(info, meta["name"], meta.get("namespace"))
        assert got.wire()["spec"] == info.model.model_validate(doc).wire()["spec"]
        assert got.metadata.resourceVersion == obj["metadata"]["resourceVersion"]
    # applying again changes nothing; deleting (tiers last) empties every collection
    assert {a.action for a in client.apply(list(CALICO_VALID.values()))} == {"unchanged"}
    client.delete_documents(list(CALICO_VALID.values()))
    assert all(fake.objects[CRDS[kind].path] == {} for kind in CALICO_VALID)


def test_what_kubectl_made_is_read_and_watched(api: tuple[FakeApi, str], store: KubeStore) -> None:
    fake = api[0]
    doc = copy.deepcopy(CALICO_VALID["networkset"])
    fake.put(CRDS["networkset"].path, doc)  # kubectl apply
    client = ResourceClient(store, kubernetes_datastore=True)
    [found] = client.list("networksets")
    assert (found.namespace, found.name) == ("staging", "external-database")
    assert found.labels == {"role": "db"}
    stop = threading.Event()
    events = store.sync(["networkset", "tier"], stop)
    try:
        first = next(events)
        assert first.type == "snapshot"
        assert first.snapshot is not None
        assert list(first.snapshot["networkset"]) == ["staging/external-database"]
        assert dict(first.snapshot["tier"]) == {}
        fake.put(CRDS["tier"].path, copy.deepcopy(CALICO_VALID["tier"]))
        event = next(e for e in events if e.type != "snapshot")
        assert (event.type, event.kind, event.key) == ("put", "tier", "internal-access")
        assert event.doc is not None
        assert event.doc.data["spec"] == {"order": 100, "defaultAction": "Pass"}
    finally:
        stop.set()
        events.close()


def test_a_document_the_schema_refuses_is_refused_by_the_api_server(store: KubeStore) -> None:
    bad = {"metadata": {"name": "t"}, "spec": {"defaultAction": "Allow"}}
    with pytest.raises(InvalidConfig, match=r"spec\.defaultAction"):
        store.put("tier", "t", bad, None)
