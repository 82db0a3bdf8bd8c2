"""Calico's policy kinds (``resources.calico``): Calico's documentation examples accepted
unchanged as ``projectcalico.org/v3`` (held as ``tabby.io/v1``), Calico's defaulting, and
every refusal naming its field path (a selector's with its offset)."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import yaml
from pydantic import ValidationError

from resources.calico import (
    CALICO_MODELS,
    DEFAULT_TIER_ORDER,
    CalicoNetworkPolicy,
    GlobalNetworkPolicy,
    HostEndpoint,
    NetworkSet,
    PortMatch,
    Tier,
    default_tier,
    parse_port,
)
from resources.meta import Resource, problems

MODELS: dict[str, type[Resource]] = {m.KIND: m for m in CALICO_MODELS}

# Calico's documentation examples (reference pages of each kind, host protection, ICMP and
# service-account how-tos), as an operator would paste them.
CALICO_EXAMPLES = """
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: allow-tcp-6379
spec:
  selector: role == 'database'
  types:
  - Ingress
  - Egress
  ingress:
  - action: Allow
    metadata:
      annotations:
        from: frontend
        to: database
    protocol: TCP
    source:
      selector: role == 'frontend'
    destination:
      ports:
      - 6379
  egress:
  - action: Allow
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: allow-tcp-6379
  namespace: production
spec:
  selector: role == 'database'
  types:
  - Ingress
  - Egress
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'frontend'
    destination:
      ports:
      - 6379
  egress:
  - action: Allow
---
apiVersion: projectcalico.org/v3
kind: Tier
metadata:
  name: internal-access
spec:
  order: 100
  defaultAction: Pass
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: internal-access.allow-tcp-6379
spec:
  tier: internal-access
  selector: role == 'database'
  types:
  - Ingress
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'frontend'
    destination:
      ports:
      - 6379
---
apiVersion: projectcalico.org/v3
kind: NetworkSet
metadata:
  name: external-database
  namespace: staging
  labels:
    role: db
spec:
  nets:
  - 198.51.100.0/28
  - 203.0.113.0/24
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkSet
metadata:
  name: a-name-for-the-set
  labels:
    role: external-database
spec:
  nets:
  - 198.51.100.0/28
  - 203.0.113.0/24
---
apiVersion: projectcalico.org/v3
kind: HostEndpoint
metadata:
  name: some.name
  labels:
    type: production
spec:
  interfaceName: eth0
  node: myhost
  expectedIPs:
  - 192.168.0.1
  - 192.168.0.2
  profiles:
  - profile1
  - profile2
  ports:
  - name: some-port
    port: 1234
    protocol: TCP
  - name: another-port
    port: 5432
    protocol: UDP
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: allow-cluster-internal-ingress
spec:
  order: 10
  preDNAT: true
  applyOnForward: true
  ingress:
  - action: Allow
    source:
      nets: [10.240.0.0/16, 192.168.0.0/16]
  selector: has(host-endpoint)
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: memcached-server
spec:
  selector: role == 'memcached'
  applyOnForward: true
  doNotTrack: true
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'memcached-client'
    destination:
      ports:
      - 12211
  egress:
  - action: Allow
    protocol: TCP
    source:
      ports:
      - 12211
    destination:
      selector: role == 'memcached-client'
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: allow-ping-in-cluster
spec:
  selector: all()
  types:
  - Ingress
  ingress:
  - action: Allow
    protocol: ICMP
    source:
      selector: all()
    icmp:
      type: 8 # Ping request
  - action: Allow
    protocol: ICMPv6
    source:
      selector: all()
    icmp:
      type: 128 # Ping request
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: demo-calico
  namespace: prod-engineering
spec:
  ingress:
  - action: Allow
    source:
      serviceAccounts:
        names:
        - api-service
        - user-auth-service
  selector: 'app == "db"'
---
apiVersion: projectcalico.org/v3
kind: NetworkPolicy
metadata:
  name: allow-from-labelled-accounts
  namespace: prod-engineering
spec:
  ingress:
  - action: Allow
    source:
      serviceAccounts:
        selector: 'app == "web-frontend"'
  - action: Deny
  selector: 'app == "db"'
  serviceAccountSelector: 'role == "db"'
---
apiVersion: projectcalico.org/v3
kind: GlobalNetworkPolicy
metadata:
  name: deny-egress-except-dns
spec:
  namespaceSelector: has(projectcalico.org/name) && projectcalico.org/name not in {"kube-system"}
  types:
  - Egress
  egress:
  - action: Allow
    protocol: UDP
    destination:
      selector: k8s-app == "kube-dns"
      namespaceSelector: projectcalico.org/name == "kube-system"
      ports:
      - 53
  - action: Log
  - action: Pass
    destination:
      namespaceSelector: global()
  - action: Deny
    protocol: TCP
    destination:
      notNets: [10.0.0.0/8]
      notPorts: ["8000:8080", http, "9090"]
  - action: Deny
    notProtocol: SCTP
---
apiVersion: projectcalico.org/v3
kind: StagedGlobalNetworkPolicy
metadata:
  name: allow-tcp-6379
spec:
  selector: role == 'database'
  types:
  - Ingress
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'frontend'
    destination:
      ports:
      - 6379
---
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata:
  name: allow-tcp-6379
  namespace: production
spec:
  stagedAction: Set
  selector: role == 'database'
  ingress:
  - action: Allow
    protocol: TCP
    source:
      selector: role == 'frontend'
---
apiVersion: projectcalico.org/v3
kind: StagedNetworkPolicy
metadata:
  name: internal-access.gone
  namespace: production
spec:
  stagedAction: Delete
  tier: internal-access
---
apiVersion: projectcalico.org/v3
kind: StagedKubernetesNetworkPolicy
metadata:
  name: test-network-policy
  namespace: default
spec:
  podSelector:
    matchLabels:
      role: db
  policyTypes:
  - Ingress
  - Egress
  ingress:
  - from:
    - ipBlock:
        cidr: 172.17.0.0/16
        except:
        - 172.17.1.0/24
    - namespaceSelector:
        matchLabels:
          project: myproject
    - podSelector:
        matchLabels:
          role: frontend
    ports:
    - protocol: TCP
      port: 6379
  egress:
  - to:
    - ipBlock:
        cidr: 10.0.0.0/24
    ports:
    - protocol: TCP
      port: 5978
"""

EXAMPLES: list[dict[str, Any]] = list(yaml.safe_load_all(CALICO_EXAMPLES))


def build(doc: dict[str, Any]) -> Resource:
    return MODELS[doc["kind"]].model_validate(copy.deepcopy(doc))


def refusal(doc: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as err:
        build(doc)
    return problems(err.value)


@pytest.mark.parametrize(
    "doc", EXAMPLES, ids=[f"{d['kind']}/{d['metadata']['name']}" for d in EXAMPLES]
)
def test_calico_documentation_examples_are_accepted_unchanged(doc: dict[str, Any]) -> None:
    model = build(doc)
    assert model.apiVersion == "tabby.io/v1"  # held as tabby's own
    again = build({**doc, "apiVersion": "tabby.io/v1"})
    assert again.wire() == model.wire()
    # the wire form reads back as the same resource (defaults spelt out change nothing)
    assert build(model.wire()).wire() == model.wire()


def test_every_calico_kind_has_an_example() -> None:
    assert {d["kind"] for d in EXAMPLES} == set(MODELS)


def by_name(kind: str, name: str) -> dict[str, Any]:
    return copy.deepcopy(
        next(d for d in EXAMPLES if d["kind"] == kind and d["metadata"]["name"] == name)
    )


def test_defaults_tier_and_types_as_calico() -> None:
    doc = by_name("NetworkPolicy", "demo-calico")
    p = build(doc)
    assert isinstance(p, CalicoNetworkPolicy)
    assert p.spec.tier == "default"
    assert p.spec.types == ["Ingress"]
    assert p.spec.order is None
    assert p.sort_key[0] == float("inf")
    doc["spec"]["egress"] = [{"action": "Allow"}]
    assert build(doc).spec.types == ["Ingress", "Egress"]  # type: ignore[attr-defined]
    del doc["spec"]["ingress"]
    assert build(doc).spec.types == ["Egress"]  # type: ignore[attr-defined]
    doc["spec"] = {}
    assert build(doc).spec.types == ["Ingress"]  # type: ignore[attr-defined]
    doc["spec"] = {"types": ["Egress"], "ingress": [{"action": "Deny"}]}
    assert build(doc).spec.types == ["Egress"]  # type: ignore[attr-defined]


def test_the_wrong_api_version_is_refused() -> None:
    doc = by_name("Tier", "internal-access")
    doc["apiVersion"] = "networking.k8s.io/v1"
    assert refusal(doc)[0][0] == "apiVersion"


def test_tiers() -> None:
    t = build(by_name("Tier", "internal-access"))
    assert isinstance(t, Tier)
    assert t.spec.order == 100
    assert t.spec.defaultAction == "Pass"
    assert default_tier().spec.order == DEFAULT_TIER_ORDER
    assert default_tier().spec.defaultAction == "Deny"
    bare = {"apiVersion": "projectcalico.org/v3", "kind": "Tier", "metadata": {"name": "x"}}
    assert build(bare).sort_key == (float("inf"), "x")  # type: ignore[attr-defined]
    moved = {**bare, "metadata": {"name": "default"}, "spec": {"order": 5}}
    assert refusal(moved) == [
        ("spec.order", "Invalid value: 5.0: the default tier's order must be 1e+06")
    ]
    dotted = {**bare, "metadata": {"name": "a.b"}}
    assert refusal(dotted)[0][0] == "metadata.name"
    assert refusal({**bare, "spec": {"defaultAction": "Allow"}})[0][0] == "spec.defaultAction"


def test_port_forms() -> None:
    assert parse_port(80) == PortMatch(80, 80)
    assert parse_port("80") == PortMatch(80, 80)
    assert parse_port("8000:8080") == PortMatch(8000, 8080)
    assert parse_port("http") == PortMatch(name="http")
    for bad in (0, 65536, "9:8", "1:", ":2", "a:b", "Not_A_Name", "70000"):
        with pytest.raises(ValueError):
            parse_port(bad)


def rule_doc(rule: dict[str, Any], **spec: Any) -> dict[str, Any]:
    return {
        "apiVersion": "projectcalico.org/v3",
        "kind": "GlobalNetworkPolicy",
        "metadata": {"name": "p"},
        "spec": {"ingress": [rule], **spec},
    }


@pytest.mark.parametrize(
    ("rule", "path", "words"),
    [
        ({"action": "Accept"}, "spec.ingress[0].action", "Allow"),
        (
            {"action": "Allow", "destination": {"ports": [80]}},
            "spec.ingress[0].destination.ports",
            "TCP, UDP or SCTP",
        ),
        (
            {"action": "Allow", "protocol": "ICMP", "source": {"notPorts": [80]}},
            "spec.ingress[0].source.notPorts",
            "TCP, UDP or SCTP",
        ),
        (
            {"action": "Allow", "protocol": "TCP", "destination": {"ports": [80, "9:1"]}},
            "spec.ingress[0].destination.ports[1]",
            "port range invalid",
        ),
        (
            {"action": "Allow", "protocol": 6, "destination": {"ports": [True]}},
            "spec.ingress[0].destination.ports[0]",
            "integer or a string",
        ),
        ({"action": "Allow", "protocol": "tcpx"}, "spec.ingress[0].protocol", "ICMPv6"),
        ({"action": "Allow", "protocol": 0}, "spec.ingress[0].protocol", "1 and 255"),
        ({"action": "Allow", "notProtocol": 256}, "spec.ingress[0].notProtocol", "1 and 255"),
        ({"action": "Allow", "icmp": {"type": 8}}, "spec.ingress[0].icmp", "ICMP or ICMPv6"),
        (
            {"action": "Allow", "protocol": "TCP", "notICMP": {"type": 8}},
            "spec.ingress[0].notICMP",
            "ICMP or ICMPv6",
        ),
        (
            {"action": "Allow", "protocol": "ICMP", "icmp": {"code": 0}},
            "spec.ingress[0].icmp.code",
            "without an ICMP type",
        ),
        (
            {"action": "Allow", "protocol": "ICMP", "icmp": {"type": 255}},
            "spec.ingress[0].icmp.type",
            "between 0 and 254",
        ),
        (
            {"action": "Allow", "protocol": "ICMP", "ipVersion": 6},
            "spec.ingress[0].ipVersion",
            "must be 4",
        ),
        (
            {"action": "Allow", "notProtocol": "ICMPv6", "ipVersion": 4},
            "spec.ingress[0].ipVersion",
            "must be 6",
        ),
        ({"action": "Allow", "ipVersion": 5}, "spec.ingress[0].ipVersion", "Invalid value"),
        (
            {"action": "Allow", "source": {"nets": ["10.0.0.1/8"]}},
            "spec.ingress[0].source.nets[0]",
            "without host bits",
        ),
        (
            {"action": "Allow", "ipVersion": 6, "source": {"nets": ["10.0.0.0/8"]}},
            "spec.ingress[0].source.nets",
            "doesn't match",
        ),
        (
            {
                "action": "Allow",
                "source": {"nets": ["10.0.0.0/8"]},
                "destination": {"notNets": ["fd00::/8"]},
            },
            "spec.ingress[0].destination.notNets",
            "both IPv4 and IPv6",
        ),
        (
            {"action": "Allow", "source": {"selector": "app == 'a' &&"}},
            "spec.ingress[0].source.selector",
            "at offset 13",
        ),
        (
            {"action": "Allow", "source": {"selector": "global()"}},
            "spec.ingress[0].source.selector",
            "at offset 0",
        ),
        (
            {"action": "Allow", "destination": {"namespaceSelector": "global() && a == 'b'"}},
            "spec.ingress[0].destination.namespaceSelector",
            "cannot be combined",
        ),
        (
            {"action": "Allow", "source": {"serviceAccounts": {"selector": "a ==="}}},
            "spec.ingress[0].source.serviceAccounts.selector",
            "offset",
        ),
        (
            {"action": "Allow", "source": {"serviceAccounts": {"names": ["Bad_Name"]}}},
            "spec.ingress[0].source.serviceAccounts.names[0]",
            "RFC 1123",
        ),
        (
            {"action": "Allow", "http": {"methods": ["GET"]}},
            "spec.ingress[0].http",
            "does not enforce",
        ),
        (
            {"action": "Allow", "destination": {"services": {"name": "x"}}},
            "spec.ingress[0].destination.services",
            "does not enforce",
        ),
        ({"action": "Allow", "sauce": {}}, "spec.ingress[0].sauce", "unknown field"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(
    rule: dict[str, Any], path: str, words: str
) -> None:
    found = refusal(rule_doc(rule))
    assert found[0][0] == path, found
    assert words in found[0][1], found


@pytest.mark.parametrize(
    ("spec", "path", "words"),
    [
        ({"preDNAT": True, "doNotTrack": True, "applyOnForward": True}, "spec.preDNAT", "both"),
        (
            {"preDNAT": True, "applyOnForward": True, "egress": [{"action": "Allow"}]},
            "spec.egress",
            "egress rules",
        ),
        (
            {"preDNAT": True, "applyOnForward": True, "types": ["Ingress", "Egress"]},
            "spec.types",
            "type Egress",
        ),
        ({"preDNAT": True}, "spec.applyOnForward", "applyOnForward must be true"),
        ({"doNotTrack": True}, "spec.applyOnForward", "applyOnForward must be true"),
        ({"types": ["Ingress", "Ingress"]}, "spec.types[1]", "more than once"),
        ({"types": ["Inbound"]}, "spec.types[0]", "Invalid value"),
        ({"selector": "global()"}, "spec.selector", "offset 0"),
        ({"namespaceSelector": "global()"}, "spec.namespaceSelector", "offset 0"),
        ({"serviceAccountSelector": "a in {"}, "spec.serviceAccountSelector", "offset"),
        ({"order": "10"}, "spec.order", "Invalid value"),
        ({"order": float("nan")}, "spec.order", "finite"),
        ({"tier": "Bad.Tier"}, "spec.tier", "RFC 1123"),
        ({"performanceHints": ["Fast"]}, "spec.performanceHints[0]", "Invalid value"),
    ],
)
def test_bad_policy_specs_are_refused_naming_the_field(
    spec: dict[str, Any], path: str, words: str
) -> None:
    found = refusal(rule_doc({"action": "Allow"}, **spec))
    assert found[0][0] == path, found
    assert words in found[0][1], found


def test_namespaced_policies_have_no_global_fields() -> None:
    doc = by_name("NetworkPolicy", "demo-calico")
    doc["spec"]["doNotTrack"] = False
    assert refusal(doc)[0] == ("spec.doNotTrack", "unknown field")


@pytest.mark.parametrize(
    ("name", "tier", "ok"),
    [
        ("allow", "default", True),
        ("default.allow", "default", True),
        ("other.allow", "default", False),  # names another tier
        ("allow", "security", False),  # Calico: <tier>.<name> outside the default tier
        ("security.allow", "security", True),
        ("sec.allow", "security", False),
        ("a.b.c", "a", False),  # one dot at most
        ("knp.default.x", "default", False),  # reserved for Kubernetes policies
        ("Allow", "default", False),
    ],
)
def test_policy_names_carry_their_tier(name: str, tier: str, ok: bool) -> None:
    for kind in ("GlobalNetworkPolicy", "NetworkPolicy", "StagedGlobalNetworkPolicy"):
        doc = {
            "apiVersion": "projectcalico.org/v3",
            "kind": kind,
            "metadata": {"name": name},
            "spec": {"tier": tier},
        }
        if ok:
            assert build(doc).name == name
        else:
            assert refusal(doc)[0][0] == "metadata.name"


def test_staged_delete_holds_only_its_tier() -> None:
    doc = by_name("StagedNetworkPolicy", "internal-access.gone")
    assert build(doc).spec.stagedAction == "Delete"  # type: ignore[attr-defined]
    doc["spec"]["selector"] = "all()"
    assert refusal(doc)[0][0] == "spec.selector"
    k8s = by_name("StagedKubernetesNetworkPolicy", "test-network-policy")
    k8s["spec"]["stagedAction"] = "Delete"
    assert refusal(k8s)[0][0] == "spec.egress"  # the first field it may not hold
    k8s["spec"] = {"stagedAction": "Delete"}
    assert build(k8s).spec.stagedAction == "Delete"  # type: ignore[attr-defined]
    k8s["spec"] = {"stagedAction": "Learn"}
    assert refusal(k8s)[0][0] == "spec.stagedAction"


def test_staged_set_is_validated_as_the_enforced_kind() -> None:
    doc = by_name("StagedGlobalNetworkPolicy", "allow-tcp-6379")
    doc["spec"]["preDNAT"] = True
    assert refusal(doc)[0][0] == "spec.applyOnForward"
    k8s = by_name("StagedKubernetesNetworkPolicy", "test-network-policy")
    k8s["spec"]["ingress"][0]["from"][0]["ipBlock"]["except"] = ["10.0.0.0/24"]
    assert refusal(k8s)[0][0] == "spec.ingress[0].from[0].ipBlock.except[0]"


def test_network_sets() -> None:
    doc = by_name("NetworkSet", "external-database")
    s = build(doc)
    assert isinstance(s, NetworkSet)
    assert s.namespace == "staging"
    assert [str(n) for n in s.spec.networks()] == ["198.51.100.0/28", "203.0.113.0/24"]
    doc["spec"]["nets"].append("10.1.2.3")  # an address alone, host bits: Calico takes both
    doc["spec"]["nets"].append("10.1.2.3/8")
    assert [str(n) for n in build(doc).spec.networks()][2:] == [  # type: ignore[attr-defined]
        "10.1.2.3/32",
        "10.0.0.0/8",
    ]
    doc["spec"]["nets"].append("10.1.2.300/8")
    assert refusal(doc)[0][0] == "spec.nets[4]"
    glob = by_name("GlobalNetworkSet", "a-name-for-the-set")
    glob["metadata"]["labels"]["projectcalico.org/namespace"] = "x"
    assert refusal(glob)[0][0] == "metadata.labels"
    glob = by_name("GlobalNetworkSet", "a-name-for-the-set")
    glob["metadata"]["namespace"] = "x"
    assert refusal(glob)[0][0] == "metadata.namespace"


@pytest.mark.parametrize(
    ("change", "path"),
    [
        ({"node": "My_Host"}, "spec.node"),
        ({"interfaceName": "an-interface-name-too-long"}, "spec.interfaceName"),
        ({"interfaceName": None, "expectedIPs": None}, "spec.interfaceName"),
        ({"expectedIPs": ["192.168.0.300"]}, "spec.expectedIPs[0]"),
        ({"ports": [{"name": "p", "port": 1, "protocol": "ICMP"}]}, "spec.ports[0].protocol"),
        ({"ports": [{"name": "p", "port": 0, "protocol": "TCP"}]}, "spec.ports[0].port"),
        ({"ports": [{"name": "P_x", "port": 1, "protocol": "TCP"}]}, "spec.ports[0].name"),
        (
            {
                "ports": [
                    {"name": "p", "port": 1, "protocol": "TCP"},
                    {"name": "p", "port": 2, "protocol": "UDP"},
                ]
            },
            "spec.ports[1].name",
        ),
    ],
)
def test_bad_host_endpoints_are_refused(change: dict[str, Any], path: str) -> None:
    doc = by_name("HostEndpoint", "some.name")
    doc["spec"].update(change)
    doc["spec"] = {k: v for k, v in doc["spec"].items() if v is not None}
    assert refusal(doc)[0][0] == path


def test_host_endpoint_on_every_interface() -> None:
    doc = by_name("HostEndpoint", "some.name")
    doc["spec"] = {"node": "myhost", "interfaceName": "*"}
    hep = build(doc)
    assert isinstance(hep, HostEndpoint)
    assert hep.spec.all_interfaces
    doc["spec"] = {"node": "myhost", "expectedIPs": ["fd00::1"]}
    assert not build(doc).spec.all_interfaces  # type: ignore[attr-defined]


def test_rule_helpers() -> None:
    p = build(by_name("GlobalNetworkPolicy", "deny-egress-except-dns"))
    assert isinstance(p, GlobalNetworkPolicy)
    egress = p.spec.egress or []
    assert egress[0].protocol_number == 17
    assert egress[4].not_protocol_number == 132
    assert egress[4].protocol_number is None
    assert [str(n) for n in egress[3].destination.networks("notNets")] == ["10.0.0.0/8"]
    assert [parse_port(x) for x in egress[3].destination.notPorts or ()] == [
        PortMatch(8000, 8080),
        PortMatch(name="http"),
        PortMatch(9090, 9090),
    ]


#: one tabby.io/v1 document of every Calico kind, by store kind, in an order that applies
#: (the tier before the policies in it); other tests build on them
CALICO_VALID: dict[str, dict[str, Any]] = {
    "tier": {**by_name("Tier", "internal-access"), "apiVersion": "tabby.io/v1"},
    "calico-networkpolicy": by_name("NetworkPolicy", "allow-tcp-6379"),
    "globalnetworkpolicy": by_name("GlobalNetworkPolicy", "internal-access.allow-tcp-6379"),
    "stagednetworkpolicy": by_name("StagedNetworkPolicy", "allow-tcp-6379"),
    "stagedglobalnetworkpolicy": by_name("StagedGlobalNetworkPolicy", "allow-tcp-6379"),
    "stagedkubernetesnetworkpolicy": by_name(
        "StagedKubernetesNetworkPolicy", "test-network-policy"
    ),
    "networkset": by_name("NetworkSet", "external-database"),
    "globalnetworkset": by_name("GlobalNetworkSet", "a-name-for-the-set"),
    "hostendpoint": by_name("HostEndpoint", "some.name"),
}
for _doc in CALICO_VALID.values():
    _doc["apiVersion"] = "tabby.io/v1"
