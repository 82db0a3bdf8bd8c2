"""tabbyctl apply / get / delete of Calico's policy kinds (``resources.calico``) on a file
store: every kind round-trips (``-o yaml``/``json`` applies back unchanged), Calico's own
documents apply unchanged as ``projectcalico.org/v3`` and are stored as ``tabby.io/v1``,
Calico's NetworkPolicy and Kubernetes' live side by side under their own names, and the
tier rules hold (the default tier always there, a tier in use kept, a policy's tier must
exist)."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

from resources.storage import BY_STORE_KIND, validate
from tests.unit.resources.test_calico import CALICO_EXAMPLES, CALICO_VALID
from tests.unit.resources.test_models import VALID
from tests.unit.tabbyctl.test_resources import Ctl

TIER = CALICO_VALID["tier"]


@pytest.fixture
def ctl(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Ctl:
    return Ctl(tmp_path, monkeypatch)


def where(doc: dict[str, Any]) -> list[str]:
    meta = doc["metadata"]
    ns = meta.get("namespace")
    return [meta["name"], *(["-n", ns] if ns else [])]


@pytest.mark.parametrize("store_kind", sorted(CALICO_VALID))
def test_round_trip_every_calico_kind(ctl: Ctl, store_kind: str) -> None:
    info = BY_STORE_KIND[store_kind]
    doc = CALICO_VALID[store_kind]
    kind, name = doc["kind"], doc["metadata"]["name"]
    docs = [doc] if store_kind == "tier" else [TIER, doc]  # some policies sit in that tier
    out = ctl.ok("apply", "-f", ctl.file("one.yaml", docs)).splitlines()
    assert out[-1] == f"{kind}/{name} created"
    got = yaml.safe_load(ctl.ok("get", info.name, *where(doc), "-o", "yaml"))
    assert got["apiVersion"] == "tabby.io/v1"
    assert got["kind"] == kind
    assert got == json.loads(ctl.ok("get", info.plural, *where(doc), "-o", "json"))
    assert got["spec"] == validate(info, doc).wire()["spec"]  # defaults spelt out
    listing = json.loads(ctl.ok("get", info.plural, "-o", "json"))["items"]
    assert got in listing
    table = ctl.ok("get", info.short[0] if info.short else info.plural).splitlines()
    assert "NAME" in table[0].split()
    assert any(name in line.split() for line in table[1:])
    assert ctl.ok("apply", "-f", ctl.file("again.yaml", [got])) == f"{kind}/{name} unchanged\n"
    assert ctl.ok("delete", info.name, *where(doc)) == f"{kind}/{name} deleted\n"
    assert "not found" in ctl.fails("get", info.name, *where(doc))
    if store_kind != "tier":
        ctl.ok("delete", "tier", TIER["metadata"]["name"])
    assert ctl.everything() == {}


def test_calico_documents_apply_unchanged_and_are_stored_as_tabby_kinds(ctl: Ctl) -> None:
    path = ctl.file("calico.yaml", CALICO_EXAMPLES)
    out = ctl.ok("apply", "-f", path).splitlines()
    assert len(out) == CALICO_EXAMPLES.count("\n---\n") + 1
    assert all(line.endswith(" created") for line in out)
    stored = ctl.everything()
    assert ("globalnetworkpolicy", "allow-tcp-6379") in stored
    assert ("calico-networkpolicy", "production/allow-tcp-6379") in stored
    assert ("hostendpoint", "some.name") in stored
    got = json.loads(ctl.ok("get", "gnp", "allow-tcp-6379", "-o", "json"))
    assert got["apiVersion"] == "tabby.io/v1"
    assert got["spec"]["ingress"][0]["destination"]["ports"] == [6379]
    assert ctl.ok("apply", "-f", path).splitlines() == [
        line.replace(" created", " unchanged") for line in out
    ]
    assert ctl.ok("delete", "-f", path).count(" deleted\n") == len(out)
    assert ctl.everything() == {}


def test_both_network_policies_side_by_side(ctl: Ctl) -> None:
    k8s = copy.deepcopy(VALID["NetworkPolicy"])
    calico = {
        "apiVersion": "projectcalico.org/v3",
        "kind": "NetworkPolicy",
        "metadata": dict(k8s["metadata"]),  # the same namespace and name
        "spec": {"selector": "app == 'web'", "ingress": [{"action": "Deny"}]},
    }
    ctl.ok("apply", "-f", ctl.file("both.yaml", [k8s, calico]))
    ns, name = k8s["metadata"]["namespace"], k8s["metadata"]["name"]
    kube = json.loads(ctl.ok("get", "netpol", name, "-n", ns, "-o", "json"))
    assert kube["apiVersion"] == "networking.k8s.io/v1"
    ours = json.loads(ctl.ok("get", "networkpolicies.tabby.io", name, "-n", ns, "-o", "json"))
    assert ours["apiVersion"] == "tabby.io/v1"
    assert ours["spec"]["tier"] == "default"
    kube_table = ctl.ok("get", "networkpolicy").splitlines()
    calico_table = ctl.ok("get", "cnp").splitlines()
    assert "POD-SELECTOR" in kube_table[0]
    assert kube_table[0].split()[:3] == ["NAMESPACE", "NAME", "POD-SELECTOR"]
    assert calico_table[0].split() == ["NAMESPACE", "TIER", "NAME", "ORDER", "SELECTOR", "TYPES"]
    assert calico_table[1].split() == [ns, "default", name, "-", "app", "==", "'web'", "Ingress"]
    ctl.ok("delete", "networkpolicy.projectcalico.org", name, "-n", ns)
    assert ctl.ok("get", "netpol", name, "-n", ns, "-o", "json")  # Kubernetes' stays
    assert "not found" in ctl.fails("get", "cnp", name, "-n", ns)


def test_the_default_tier_always_exists(ctl: Ctl) -> None:
    tiers = json.loads(ctl.ok("get", "tiers", "-o", "json"))["items"]
    assert [(t["metadata"]["name"], t["spec"]) for t in tiers] == [
        ("default", {"order": 1000000.0, "defaultAction": "Deny"})
    ]
    assert "always exists" in ctl.fails("delete", "tier", "default")
    ctl.ok("apply", "-f", ctl.file("t.yaml", [TIER]))
    names = [
        t["metadata"]["name"] for t in json.loads(ctl.ok("get", "tier", "-o", "json"))["items"]
    ]
    assert names == ["default", "internal-access"]
    table = ctl.ok("get", "tier").splitlines()
    assert table[0].split() == ["NAME", "ORDER", "DEFAULT", "ACTION"]
    assert table[1].split() == ["default", "1e+06", "Deny"]
    assert table[2].split() == ["internal-access", "100", "Pass"]


def test_a_policy_needs_its_tier_and_a_tier_in_use_stays(ctl: Ctl) -> None:
    policy = CALICO_VALID["globalnetworkpolicy"]
    error = ctl.fails("apply", "-f", ctl.file("p.yaml", [policy]))
    assert error == (
        "GlobalNetworkPolicy/internal-access.allow-tcp-6379: spec.tier: Not found: tier "
        '"internal-access" does not exist (apply it first)'
    )
    assert ctl.everything() == {}
    ctl.ok("apply", "-f", ctl.file("both.yaml", [TIER, policy]))
    error = ctl.fails("delete", "tier", "internal-access")
    assert "holds GlobalNetworkPolicy internal-access.allow-tcp-6379" in error
    ctl.ok("delete", "gnp", "internal-access.allow-tcp-6379")
    ctl.ok("delete", "tier", "internal-access")
    assert ctl.everything() == {}


def test_a_bad_calico_document_fails_the_file_naming_the_field(ctl: Ctl) -> None:
    bad = copy.deepcopy(CALICO_VALID["calico-networkpolicy"])
    bad["apiVersion"] = "projectcalico.org/v3"
    bad["spec"]["ingress"][0]["source"]["selector"] = "role == 'frontend' &&"
    path = ctl.file("bad.yaml", [CALICO_VALID["networkset"], bad])
    error = ctl.fails("apply", "-f", path)
    assert error.startswith("NetworkPolicy/allow-tcp-6379: spec.ingress[0].source.selector: ")
    assert "invalid selector at offset 21" in error
    assert ctl.everything() == {}  # all or nothing
