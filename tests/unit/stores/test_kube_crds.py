"""tabby's CustomResourceDefinitions (``stores.kube.crds``): structural schemas that refuse what
``tabbyctl apply`` refuses, naming the same field (tests/crd_cases.py's table, against the
models and against the schemas as a Kubernetes 1.20 API server applies them:
tests/structural.py), that take what tabby itself writes, and that the manifest carries as
generated."""

from __future__ import annotations

import ipaddress
import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from ipam.core.block import Block
from resources.meta import problems
from resources.storage import BY_KIND, document_kind, validate
from stores.kube import crds, kinds
from tests import crd_cases
from tests.crd_cases import Case
from tests.structural import admit, go_regexp, structural_problems

ROOT = Path(__file__).resolve().parents[3]
KIND_OF = {crd.kind: kind for kind, crd in kinds.CRDS.items()}  # IPPool -> pool


def schema_of(kind: str) -> dict[str, Any]:
    return crds.schema(KIND_OF[kind])


def model_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """What ``tabbyctl apply`` says of ``doc`` (no problem: [])."""
    try:
        info = document_kind(doc["apiVersion"], doc["kind"])  # Calico's NetworkPolicy: its own
        assert info is not None
        validate(info, doc)
    except ValidationError as e:
        return problems(e)
    return []


def api_problems(doc: dict[str, Any]) -> list[tuple[str, str]]:
    """What the API server says of ``doc`` (no problem: [])."""
    return admit(doc, schema_of(doc["kind"]))[1]


# -- the definitions -----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(kinds.CRDS))
def test_every_kind_is_a_crd_with_a_structural_schema(kind: str) -> None:
    crd = crds.definition(kind)
    spec = crd["spec"]
    assert crd["metadata"]["name"] == kinds.CRDS[kind].name
    scope = "Namespaced" if kinds.CRDS[kind].namespaced else "Cluster"  # Calico's namespaced
    assert (spec["group"], spec["scope"]) == ("tabby.io", scope)
    assert spec["names"]["kind"] == kinds.CRDS[kind].kind
    assert spec["names"]["plural"] == kinds.CRDS[kind].plural
    (version,) = spec["versions"]
    assert (version["name"], version["served"], version["storage"]) == ("v1", True, True)
    schema = version["schema"]["openAPIV3Schema"]
    assert structural_problems(schema) == []
    assert schema["properties"]["spec"]["type"] == "object"
    for column in version.get("additionalPrinterColumns", []):
        path = column["jsonPath"].lstrip(".").split(".")
        if path[0] == "spec":
            assert path[1] in schema["properties"]["spec"]["properties"], column


def test_the_structural_rules_are_checked() -> None:
    """The checker finds what makes a schema not structural (so its silence means
    something)."""
    bad = {
        "type": "object",
        "properties": {
            "metadata": {"type": "object", "properties": {"labels": {"type": "object"}}},
            "spec": {
                "properties": {"a": {"type": "string"}},
                "anyOf": [
                    {"type": "string"},
                    {"properties": {"b": {"pattern": "^x$"}}},
                    {"properties": {"a": {"pattern": "(?=x)"}}},
                ],
            },
        },
    }
    found = structural_problems(bad)
    assert any("metadata" in p for p in found), found
    assert any(p.startswith("spec: no type") for p in found), found
    assert any("['type'] may only be said outside" in p for p in found), found
    assert any("properties.b: not declared" in p for p in found), found
    assert any("not an RE2 pattern" in p for p in found), found


def test_the_manifest_carries_the_generated_definitions() -> None:
    """crds.py is the one place: the manifest's CRDs are what it generates, in its order,
    and the text between the markers is what ``python -m stores.kube.crds`` prints."""
    text = (ROOT / "manifests" / "tabby.yaml").read_text()
    docs = [d for d in yaml.safe_load_all(text) if d]
    in_manifest = [d for d in docs if d["kind"] == "CustomResourceDefinition"]
    assert in_manifest == crds.definitions(), "regenerate: python -m stores.kube.crds"
    assert crds.render() in text, "the manifest's block differs from python -m stores.kube.crds"
    assert docs.index(in_manifest[0]) < min(
        i for i, d in enumerate(docs) if d["kind"] in ("DaemonSet", "Deployment")
    ), "the CRDs come before the workloads that use them"


def test_python_m_prints_the_definitions() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "stores.kube.crds"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert out == crds.render()
    assert [d for d in yaml.safe_load_all(out) if d] == crds.definitions()


# -- what the models and the schemas say ---------------------------------------------------------


@pytest.mark.parametrize("case", crd_cases.REFUSED, ids=[c.label for c in crd_cases.REFUSED])
def test_the_api_server_refuses_what_tabbyctl_refuses_naming_the_field(case: Case) -> None:
    doc = case.document()
    model = model_problems(doc)
    assert case.field in [p for p, _ in model], model
    api = api_problems(doc)
    assert case.field in [p for p, _ in api], api


@pytest.mark.parametrize("case", crd_cases.ACCEPTED, ids=[c.label for c in crd_cases.ACCEPTED])
def test_both_accept_a_good_document(case: Case) -> None:
    doc = case.document()
    assert model_problems(doc) == []
    kept, errors = admit(doc, schema_of(case.kind))
    assert errors == []
    spec = {k: v for k, v in (case.spec or {}).items() if v is not None}
    assert kept["spec"] == spec  # nothing dropped but the nulls


@pytest.mark.parametrize("case", crd_cases.STRICTER, ids=[c.label for c in crd_cases.STRICTER])
def test_the_api_server_refuses_the_notations_tabbyctl_rewrites(case: Case) -> None:
    assert model_problems(case.document()) == []
    assert case.field in [p for p, _ in api_problems(case.document())]


@pytest.mark.parametrize("case", crd_cases.LAXER, ids=[c.label for c in crd_cases.LAXER])
def test_what_a_schema_of_kubernetes_1_20_cannot_refuse(case: Case) -> None:
    """Documented in docs/kubernetes.md: the API server takes these (an unknown field is
    dropped), the models refuse them."""
    assert case.field in [p for p, _ in model_problems(case.document())]
    kept, errors = admit(case.document(), schema_of(case.kind))
    assert errors == []
    assert _at(case.document(), case.field) is not None  # a field the document sets
    if "unknown" in case.why:
        assert case.field.split(".")[-1] not in kept["spec"]


def _at(doc: Any, path: str) -> Any:
    """The value at a field path (``spec.ingress[0].source.selector``); None if absent."""
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            index = int(part[1:-1])
            doc = doc[index] if isinstance(doc, list) and index < len(doc) else None
        else:
            doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def _documented() -> list[dict[str, Any]]:
    """Every document of tabby's resource kinds in the docs' YAML examples."""
    out = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for block in re.findall(r"```[a-z]*\n(.*?)```", page.read_text(), re.S):
            if "apiVersion: tabby.io/v1" not in block:
                continue
            body = block[block.index("apiVersion") :]
            body = body.split("\nYAML", 1)[0]  # a heredoc's end
            for doc in yaml.safe_load_all(body):
                if isinstance(doc, dict) and doc.get("kind") in KIND_OF:
                    out.append(doc)
    return out


def test_the_documented_examples_pass_both() -> None:
    examples = _documented()
    assert {d["kind"] for d in examples} >= {"Node", "BGPPeer", "BGPConfiguration"}
    for doc in examples:
        assert model_problems(doc) == [], doc
        assert api_problems(doc) == [], doc


# -- what tabby writes ---------------------------------------------------------------------------


def _written() -> list[dict[str, Any]]:
    """Objects as the Kubernetes store writes them (``kinds.to_object``)."""
    block = Block.new(ipaddress.ip_network("10.244.1.0/30"), "10.244.0.0/16", "node-a")
    block.allocations[1] = {"handle": "net.c1.eth0", "seq": 1, "attrs": {"pod_name": "p"}}
    block.unallocated.remove(1)
    v6 = Block.new(ipaddress.ip_network("fd00:1::/126"), "fd00:1::/48", None)
    affinity = {
        "node": "node-a",
        "format": 2,
        "blocks": ["10.244.1.0/30"],
        "borrowed": [],
        "cursor": {"10.244.0.0/16": 3},
    }
    request = {
        "id": "0123456789abcdef",
        "node": "node-a",
        "family": 4,
        "src": "10.0.0.1",
        "dst": "10.0.0.2",
        "protocol": "TCP",
        "sport": 1000,
        "dport": 80,
        "icmp_id": None,
        "seconds": 5.0,
    }
    answer = {"id": "0123456789abcdef", "node": "node-a", "state": "armed", "decisions": []}
    pool = {
        "cidr": "10.244.0.0/16",
        "block_size": 26,
        "disabled": False,
        "name": "p",
        "vxlan_mode": "Always",
    }
    node = {
        "metadata": {"name": "node-a", "creationTimestamp": "2026-01-01T00:00:00Z"},
        "spec": {"backend": "bird", "ipv4Address": "192.168.1.5/24"},
    }
    peer = {"metadata": {"name": "tor"}, "spec": {"peerIP": "192.0.2.1", "asNumber": 65000}}
    bgp = {"metadata": {"name": "default"}, "spec": {"asNumber": 64512}}
    return [
        kinds.to_object("block", "10.244.1.0/30", block.to_data(), None),
        kinds.to_object("block", "fd00:1::/126", v6.to_data(), 7),
        kinds.to_object("affinity", "node-a", affinity, None),
        kinds.to_object("trace", "0123456789abcdef", request, None),
        kinds.to_object("trace", "0123456789abcdef.node-a", answer, None),
        kinds.to_object("pool", "10.244.0.0/16", pool, None),
        kinds.to_object("node", "node-a", node, 3),
        kinds.to_object("bgppeer", "tor", peer, None),
        kinds.to_object("bgpconfiguration", "default", bgp, None),
    ]


@pytest.mark.parametrize("obj", _written(), ids=lambda o: f"{o['kind']}:{o['metadata']['name']}")
def test_what_tabby_writes_is_taken_whole(obj: dict[str, Any]) -> None:
    kept, errors = admit(obj, crds.schema(KIND_OF[obj["kind"]]))
    assert errors == []
    assert kept == obj


def test_a_block_needs_its_cidr() -> None:
    obj = _written()[0]
    del obj["spec"]["cidr"]
    assert ("spec.cidr", "Required value") in admit(obj, crds.schema("block"))[1]


# -- the patterns ----------------------------------------------------------------------------------


def test_number_set_matches_exactly_its_numbers() -> None:
    rnd = random.Random(7)
    for _ in range(200):
        values = set(rnd.sample(range(300), rnd.randint(1, 60)))
        pattern = go_regexp(f"^(?:{crds.number_set(values)})$")
        for n in range(400):
            assert bool(pattern.search(str(n))) == (n in values), (sorted(values), n)
            assert not pattern.search(f"0{n}")  # never a leading zero


def _strict_network(text: str) -> bool:
    try:
        ipaddress.ip_network(text)
    except ValueError:
        return False
    return True


def test_the_ipv4_network_pattern_is_ipaddress_strict() -> None:
    """A valid IPv4 address, a prefix length of 0-32 and no host bits: what
    ``ipaddress.ip_network(strict=True)`` takes, for 50,000 random ones (half of them
    without host bits)."""
    pattern = go_regexp(f"^{crds.V4_NETWORK}$")
    rnd = random.Random(11)
    for _ in range(50_000):
        address, prefix = rnd.getrandbits(32), rnd.randint(0, 32)
        if rnd.random() < 0.5:
            address &= (0xFFFFFFFF << (32 - prefix)) & 0xFFFFFFFF
        text = f"{ipaddress.IPv4Address(address)}/{prefix}"
        assert bool(pattern.search(text)) == _strict_network(text), text


def _ipv6_ok(text: str) -> bool:
    try:
        ipaddress.IPv6Address(text)
    except ValueError:
        return False
    return "%" not in text


def test_the_ipv6_pattern_reads_what_ipaddress_reads() -> None:
    """Every form: full, compressed anywhere, with an IPv4 tail, and the malformed ones."""
    pattern = go_regexp(f"^{crds.IPV6}$")
    samples = [
        "::", "::1", "1::", "fe80::1", "2001:db8::", "1:2:3:4:5:6:7:8", "1:2:3:4:5:6:7::",
        "::2:3:4:5:6:7:8", "::ffff:1.2.3.4", "1:2:3:4:5:6:1.2.3.4", "1::1.2.3.4",
        "1:2:3:4:5::1.2.3.4", "FE80::A", "1:2:3:4:5:6:7:8:9", "1::2::3", ":::", "1:2:3:4:5:6:7",
        "12345::", "1:2:3:4:5:6::1.2.3.4", "::1.2.3.256", "g::", "1:2:3:4:5:6:7::8", ":1::",
        "1::2:", "1:2:3:4:5:6:7:1.2.3.4", "::01.2.3.4", "fe80::1%eth0",
    ]  # fmt: skip
    for text in samples:
        assert bool(pattern.search(text)) == _ipv6_ok(text), text
    rnd = random.Random(13)
    for _ in range(20_000):
        groups = ipaddress.IPv6Address(rnd.getrandbits(128)).exploded.split(":")
        groups = [g.lstrip("0") or "0" if rnd.random() < 0.5 else g for g in groups]
        i = rnd.randint(0, 8)
        j = rnd.randint(i, 8)
        text = ":".join(groups[:i]) + "::" + ":".join(groups[j:]) if j > i else ":".join(groups)
        assert bool(pattern.search(text)) == _ipv6_ok(text), text


def test_every_pattern_is_re2_and_survives_json() -> None:
    """Every pattern in the definitions compiles as RE2 and survives JSON (what the
    manifest carries, and what the API server reads)."""
    dumped = json.dumps(crds.definitions())
    for pattern in re.findall(r'"pattern": "((?:[^"\\]|\\.)*)"', dumped):
        go_regexp(json.loads(f'"{pattern}"'))


@pytest.mark.parametrize(("cidr", "size"), [("10.244.0.0/16", 26), ("fd00:10:244::/48", 122)])
def test_a_pool_applied_without_a_block_size_gets_the_familys_default(cidr: str, size: int) -> None:
    """The schema takes a pool without ``blockSize`` (the model defaults it, and a schema
    cannot default by family): the store reads it as tabbyctl apply would have written it."""
    doc = Case("IPPool", {"cidr": cidr}, name="no-size").document()
    kept, errors = admit(doc, schema_of("IPPool"))
    assert errors == []
    model = validate(BY_KIND["IPPool"], doc)
    assert model.wire()["spec"]["blockSize"] == size
    assert kinds.to_data("pool", kept)["block_size"] == size
