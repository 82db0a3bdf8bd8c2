"""conf-examples/calico/: tabby's examples of Calico's policy kinds, as Calico users write
them (``projectcalico.org/v3``). ``tabbyctl apply`` takes every file unchanged, in order,
and stores the documents as ``tabby.io/v1``; the models and the API server's schemas (the
CRDs of ``stores.kube.crds``, as a Kubernetes 1.20 API server applies them) accept every
document; the README names every file. The cluster tier enforces some of them on real pods
(tests/cluster/test_calico.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from resources.calico import CALICO_API_VERSION
from resources.storage import document_kind
from tests import REPO_ROOT as ROOT
from tests.unit.stores.test_kube_crds import api_problems, model_problems
from tests.unit.tabbyctl.test_resources import Ctl

EXAMPLES = ROOT / "conf-examples" / "calico"
FILES = sorted(EXAMPLES.glob("*.yaml"))


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def test_there_are_examples_and_the_readme_names_each() -> None:
    assert len(FILES) >= 5
    readme = (EXAMPLES / "README.md").read_text()
    for path in FILES:
        assert f"`{path.name}`" in readme, path.name
    kinds = {d["kind"] for path in FILES for d in documents(path)}
    assert kinds >= {
        "NetworkPolicy",
        "GlobalNetworkPolicy",
        "Tier",
        "GlobalNetworkSet",
        "StagedNetworkPolicy",
    }


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_every_document_is_calicos_and_passes_the_models_and_the_schemas(path: Path) -> None:
    for doc in documents(path):
        assert doc["apiVersion"] == CALICO_API_VERSION, doc["metadata"]
        assert document_kind(doc["apiVersion"], doc["kind"]) is not None
        assert model_problems(doc) == [], doc["metadata"]
        # what tabbyctl writes to the API server in KDD mode: the same spec as tabby.io/v1
        assert api_problems({**doc, "apiVersion": "tabby.io/v1"}) == [], doc["metadata"]


def test_tabbyctl_applies_every_file_unchanged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """In order (the tier before the policies naming it): every document created, stored
    as tabby.io/v1, unchanged when applied again; deleted in reverse order, nothing left."""
    ctl = Ctl(tmp_path, monkeypatch)
    made = 0
    for path in FILES:
        docs = documents(path)
        out = ctl.ok("apply", "-f", str(path)).splitlines()
        assert out == [f"{d['kind']}/{d['metadata']['name']} created" for d in docs], out
        assert ctl.ok("apply", "-f", str(path)).splitlines() == [
            line.replace(" created", " unchanged") for line in out
        ]
        made += len(docs)
    got = json.loads(ctl.ok("get", "gnp", "security.block-untrusted", "-o", "json"))
    assert got["apiVersion"] == "tabby.io/v1"
    assert [r["action"] for r in got["spec"]["ingress"]] == ["Log", "Deny", "Pass"]
    assert len(ctl.everything()) == made
    for path in reversed(FILES):
        ctl.ok("delete", "-f", str(path))
    assert ctl.everything() == {}
