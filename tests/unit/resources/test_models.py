"""The resource models: every invalid field gives its field path; NetworkPolicy defaulting as
the API server does it; name/label syntax; Calico selectors; the storage mapping.

Pure functions, no store (the client and tabbyctl are in test_client.py and
tests/unit/tabbyctl/test_resources.py).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
from pydantic import ValidationError

from datastore.base import Doc
from resources import names
from resources.k8s import LabelSelector, NetworkPolicy, Pod
from resources.meta import problems
from resources.poolform import pool_name
from resources.storage import (
    BY_KIND,
    RESOURCE_KINDS,
    resolve_kind,
    stored_data,
    stored_raw,
    to_resource,
    validate,
)
from resources.tabby import IPPool

# -- one valid document of every kind --------------------------------------------------------

VALID: dict[str, dict[str, Any]] = {
    "IPPool": {
        "apiVersion": "tabby.io/v1",
        "kind": "IPPool",
        "metadata": {"name": "pool-a"},
        "spec": {"cidr": "10.50.0.0/16", "blockSize": 26, "vxlanMode": "Always"},
    },
    "BGPConfiguration": {
        "apiVersion": "tabby.io/v1",
        "kind": "BGPConfiguration",
        "metadata": {"name": "default"},
        "spec": {"asNumber": 64513, "nodeToNodeMeshEnabled": False},
    },
    "BGPPeer": {
        "apiVersion": "tabby.io/v1",
        "kind": "BGPPeer",
        "metadata": {"name": "tor"},
        "spec": {"peerIP": "192.0.2.1", "asNumber": 65000, "nodeSelector": "rack == 'a'"},
    },
    "Node": {
        "apiVersion": "tabby.io/v1",
        "kind": "Node",
        "metadata": {"name": "node-a", "labels": {"rack": "a"}},
        "spec": {
            "backend": "vxlan",
            "ipv4Address": "192.168.1.5/24",
            "ipv6Address": "fd00::5/64",
            "ipv4VXLANTunnelAddr": "10.50.0.1",
            "vxlanTunnelMACAddr": "66:aa:bb:cc:dd:ee",
            "bgp": {"asNumber": 64600, "routeReflectorClusterID": "224.0.0.1"},
        },
    },
    "NetworkPolicy": {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "allow-web", "namespace": "shop"},
        "spec": {
            "podSelector": {"matchLabels": {"app": "web"}},
            "ingress": [
                {
                    "from": [
                        {
                            "namespaceSelector": {"matchLabels": {"team": "a"}},
                            "podSelector": {
                                "matchExpressions": [
                                    {"key": "role", "operator": "In", "values": ["fe"]}
                                ]
                            },
                        },
                        {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                    ],
                    "ports": [{"port": "http"}, {"port": 8000, "endPort": 8080}],
                }
            ],
            "egress": [{"to": [{"podSelector": {}}], "ports": [{"protocol": "UDP", "port": 53}]}],
        },
    },
    "Namespace": {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": "shop", "labels": {"team": "a"}},
    },
    "ServiceAccount": {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": "web", "namespace": "shop", "labels": {"role": "frontend"}},
    },
    "Pod": {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": "web-0", "namespace": "shop", "labels": {"app": "web"}},
        "spec": {
            "containers": [
                {"name": "web", "image": "nginx", "ports": [{"name": "http", "containerPort": 80}]},
                {"name": "dns", "ports": [{"containerPort": 53, "protocol": "UDP"}]},
            ]
        },
    },
    "WorkloadEndpoint": {
        "apiVersion": "tabby.io/v1",
        "kind": "WorkloadEndpoint",
        "metadata": {"name": "node--a-k8s-web--0-eth0", "namespace": "shop"},
        "spec": {
            "node": "node-a",
            "pod": "web-0",
            "containerID": "abc123",
            "interface": "eth0",
            "hostInterface": "cali0123456789a",
            "ipNetworks": ["10.50.0.7/32", "fd00:50::7/128"],
        },
    },
}


def doc(kind: str, **changes: Any) -> dict[str, Any]:
    """A valid document of ``kind`` with ``changes`` applied: keys are dotted paths (list
    indexes as numbers), a value of ``DROP`` removes the field."""
    out = copy.deepcopy(VALID[kind])
    for path, value in changes.items():
        parts: list[Any] = [int(p) if p.isdigit() else p for p in path.split("__")]
        target: Any = out
        for p in parts[:-1]:
            target = target[p]
        if value is DROP:
            del target[parts[-1]]
        else:
            target[parts[-1]] = value
    return out


DROP = object()


def errors_of(data: dict[str, Any]) -> list[tuple[str, str]]:
    with pytest.raises(ValidationError) as info:
        validate(BY_KIND[data["kind"]], data)
    return problems(info.value)


@pytest.mark.parametrize("kind", sorted(VALID))
def test_every_kind_validates_and_round_trips(kind: str) -> None:
    model = validate(BY_KIND[kind], VALID[kind])
    again = validate(BY_KIND[kind], model.wire())
    assert again == model
    assert model.wire()["apiVersion"] == VALID[kind]["apiVersion"]
    assert list(model.wire())[:3] == ["apiVersion", "kind", "metadata"]


NP = "NetworkPolicy"
IN0 = "spec__ingress__0"
P0 = f"{IN0}__ports__0"
F0 = f"{IN0}__from__0"
E0 = "spec__egress__0"

# (kind, changes, field path, a fragment of the message)
INVALID: list[tuple[str, dict[str, Any], str, str]] = [
    # identity and metadata
    (NP, {"apiVersion": "v1"}, "apiVersion", "networking.k8s.io/v1"),
    (NP, {"apiVersion": DROP}, "apiVersion", "Required value"),
    (NP, {"metadata__name": DROP}, "metadata.name", "Required value"),
    (NP, {"metadata__name": "Allow_Web"}, "metadata.name", "RFC 1123 subdomain"),
    (NP, {"metadata__name": "a" * 254}, "metadata.name", "no more than 253"),
    (NP, {"metadata__namespace": "shop.x"}, "metadata.namespace", "RFC 1123 label"),
    (NP, {"metadata__labels": {"tier": 1}}, "metadata.labels[tier]", "must be a string"),
    (NP, {"metadata__labels": {"-x": "a"}}, "metadata.labels[-x]", "name part"),
    (NP, {"metadata__labels": {"a/b/c": "a"}}, "metadata.labels[a/b/c]", "prefix part"),
    (NP, {"metadata__labels": {"app": "a b"}}, "metadata.labels[app]", "valid label"),
    (NP, {"metadata__labels": {"app": "x" * 64}}, "metadata.labels[app]", "no more than 63"),
    (NP, {"metadata__annotations": {"a": 5}}, "metadata.annotations[a]", "must be a string"),
    (NP, {"metadata__uid": 5}, "metadata.uid", "valid string"),
    (NP, {"metadata__color": "red"}, "metadata.color", "unknown field"),
    (NP, {"status": {}}, "status", "unknown field"),
    (NP, {"spec__foo": 1}, "spec.foo", "unknown field"),
    # ports
    (NP, {f"{P0}__port": 0}, "spec.ingress[0].ports[0].port", "between 1 and 65535"),
    (NP, {f"{P0}__port": 70000}, "spec.ingress[0].ports[0].port", "between 1 and 65535"),
    (NP, {f"{P0}__port": True}, "spec.ingress[0].ports[0].port", "integer or a string"),
    (NP, {f"{P0}__port": 8.5}, "spec.ingress[0].ports[0].port", "integer or a string"),
    (NP, {f"{P0}__port": "HTTP"}, "spec.ingress[0].ports[0].port", "alpha-numeric"),
    (NP, {f"{P0}__port": "80"}, "spec.ingress[0].ports[0].port", "at least one letter"),
    (NP, {f"{P0}__port": "a--b"}, "spec.ingress[0].ports[0].port", "consecutive hyphens"),
    (NP, {f"{P0}__port": "-ab"}, "spec.ingress[0].ports[0].port", "alpha-numeric"),
    (NP, {f"{P0}__port": "a" * 16}, "spec.ingress[0].ports[0].port", "no more than 15"),
    (NP, {f"{P0}__protocol": "ICMP"}, "spec.ingress[0].ports[0].protocol", "TCP"),
    (NP, {f"{P0}__endPort": 90}, "spec.ingress[0].ports[0].endPort", "non-numeric"),
    (
        NP,
        {f"{P0}__port": DROP, f"{P0}__endPort": 90},
        "spec.ingress[0].ports[0].endPort",
        "not specified",
    ),
    (
        NP,
        {f"{IN0}__ports__1__endPort": 7999},
        "spec.ingress[0].ports[1].endPort",
        "greater than or equal",
    ),
    (
        NP,
        {f"{IN0}__ports__1__endPort": 65536},
        "spec.ingress[0].ports[1].endPort",
        "between 1 and 65535",
    ),
    (
        NP,
        {f"{IN0}__ports__1__endPort": "9000"},
        "spec.ingress[0].ports[1].endPort",
        "valid integer",
    ),
    (NP, {f"{E0}__ports__0__port": 0}, "spec.egress[0].ports[0].port", "between 1 and 65535"),
    # peers
    (NP, {F0: {}}, "spec.ingress[0].from[0]", "must specify a peer"),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__cidr": "10.0.0.0"},
        "spec.ingress[0].from[1].ipBlock.cidr",
        "valid CIDR",
    ),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__cidr": "10.0.0.0/33"},
        "spec.ingress[0].from[1].ipBlock.cidr",
        "valid CIDR",
    ),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__cidr": DROP},
        "spec.ingress[0].from[1].ipBlock.cidr",
        "Required value",
    ),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__except": ["11.0.0.0/16"]},
        "spec.ingress[0].from[1].ipBlock.except[0]",
        "strict subset",
    ),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__except": ["10.1.0.0/16", "10.0.0.0/8"]},
        "spec.ingress[0].from[1].ipBlock.except[1]",
        "strict subset",
    ),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__except": ["fd00::/64"]},
        "spec.ingress[0].from[1].ipBlock.except[0]",
        "strict subset",
    ),
    (
        NP,
        {f"{IN0}__from__1__ipBlock__except": ["bogus"]},
        "spec.ingress[0].from[1].ipBlock.except[0]",
        "valid CIDR",
    ),
    (
        NP,
        {f"{IN0}__from__1__podSelector": {}},
        "spec.ingress[0].from[1]",
        "both ipBlock and another peer",
    ),
    (
        NP,
        {f"{E0}__to__0": {"ipBlock": {"cidr": "0.0.0.0/0"}, "namespaceSelector": {}}},
        "spec.egress[0].to[0]",
        "both ipBlock",
    ),
    # selectors
    (
        NP,
        {"spec__podSelector__matchLabels": {"app": 1}},
        "spec.podSelector.matchLabels[app]",
        "must be a string",
    ),
    (
        NP,
        {"spec__podSelector__matchLabels": {"a b": "x"}},
        "spec.podSelector.matchLabels[a b]",
        "name part",
    ),
    (
        NP,
        {"spec__podSelector__matchLabels": "app=web"},
        "spec.podSelector.matchLabels",
        "map of strings",
    ),
    (NP, {"spec__podSelector__matchLabel": {}}, "spec.podSelector.matchLabel", "unknown field"),
    (
        NP,
        {f"{F0}__podSelector__matchExpressions__0__operator": "Equals"},
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].operator",
        "In",
    ),
    (
        NP,
        {f"{F0}__podSelector__matchExpressions__0__values": []},
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
        "must be specified",
    ),
    (
        NP,
        {
            f"{F0}__podSelector__matchExpressions__0": {
                "key": "a",
                "operator": "Exists",
                "values": ["x"],
            }
        },
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].values",
        "may not be specified",
    ),
    (
        NP,
        {f"{F0}__podSelector__matchExpressions__0__key": "a b"},
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].key",
        "name part",
    ),
    (
        NP,
        {f"{F0}__podSelector__matchExpressions__0__values": ["a b"]},
        "spec.ingress[0].from[0].podSelector.matchExpressions[0].values[0]",
        "valid label",
    ),
    (
        NP,
        {f"{F0}__namespaceSelector__matchExpressions": [{"operator": "Exists"}]},
        "spec.ingress[0].from[0].namespaceSelector.matchExpressions[0].key",
        "Required value",
    ),
    # policyTypes
    (NP, {"spec__policyTypes": ["Inbound"]}, "spec.policyTypes[0]", "Ingress"),
    (
        NP,
        {"spec__policyTypes": ["Ingress", "Egress", "Ingress"]},
        "spec.policyTypes",
        "more than two",
    ),
    (NP, {"spec__ingress": {"from": []}}, "spec.ingress", "valid list"),
    # Namespace
    ("Namespace", {"metadata__name": "shop.eu"}, "metadata.name", "RFC 1123 label"),
    ("Namespace", {"metadata__namespace": "x"}, "metadata.namespace", "not allowed"),
    ("Namespace", {"spec": {}}, "spec", "unknown field"),
    # Pod
    (
        "Pod",
        {"spec__containers__0__ports__0__containerPort": 0},
        "spec.containers[0].ports[0].containerPort",
        "between 1 and 65535",
    ),
    (
        "Pod",
        {"spec__containers__0__ports__0__containerPort": "80"},
        "spec.containers[0].ports[0].containerPort",
        "valid integer",
    ),
    (
        "Pod",
        {"spec__containers__0__ports__0__name": "Http"},
        "spec.containers[0].ports[0].name",
        "alpha-numeric",
    ),
    (
        "Pod",
        {"spec__containers__0__ports__0__protocol": "tcp"},
        "spec.containers[0].ports[0].protocol",
        "TCP",
    ),
    ("Pod", {"spec__containers__1__name": "web"}, "spec.containers[1].name", "Duplicate"),
    ("Pod", {"spec__containers__0__name": "Web"}, "spec.containers[0].name", "RFC 1123 label"),
    ("Pod", {"spec__containers__0__name": DROP}, "spec.containers[0].name", "Required value"),
    (
        "Pod",
        {
            "spec__containers__0__ports": [
                {"name": "a", "containerPort": 1},
                {"name": "a", "containerPort": 2},
            ]
        },
        "spec.containers[0].ports[1].name",
        "Duplicate",
    ),
    ("Pod", {"spec__containers__0__command": ["x"]}, "spec.containers[0].command", "unknown field"),
    # IPPool
    ("IPPool", {"spec__cidr": "10.50.0.0"}, "spec.cidr", "must be a CIDR"),
    ("IPPool", {"spec__cidr": "10.50.0.1/16"}, "spec.cidr", "host bits set"),
    ("IPPool", {"spec__cidr": "banana"}, "spec.cidr", "banana"),
    ("IPPool", {"spec__cidr": DROP}, "spec.cidr", "Required value"),
    ("IPPool", {"spec__blockSize": 19}, "spec.blockSize", "20-32"),
    ("IPPool", {"spec__cidr": "10.50.0.0/28"}, "spec.blockSize", "smaller than one block"),
    ("IPPool", {"spec__blockSize": "26"}, "spec.blockSize", "valid integer"),
    ("IPPool", {"spec__ipipMode": "Sometimes"}, "spec.ipipMode", "CrossSubnet"),
    ("IPPool", {"spec__ipipMode": "Always"}, "spec.vxlanMode", "cannot both be enabled"),
    (
        "IPPool",
        {
            "spec__cidr": "fd00:50::/48",
            "spec__blockSize": 122,
            "spec__vxlanMode": DROP,
            "spec__ipipMode": "Always",
        },
        "spec.ipipMode",
        "IPv6",
    ),
    ("IPPool", {"spec__natOutgoing": "true"}, "spec.natOutgoing", "valid boolean"),
    (
        "IPPool",
        {"spec__nodeSelector": "rack == "},
        "spec.nodeSelector",
        "invalid selector at offset 8: expected a quoted string after '=='",
    ),
    (
        "IPPool",
        {"spec__nodeSelector": "has(a) || global()"},
        "spec.nodeSelector",
        "at offset 10: global() is valid only in a rule's namespaceSelector",
    ),
    ("IPPool", {"metadata__namespace": "x"}, "metadata.namespace", "not allowed"),
    # BGPConfiguration
    ("BGPConfiguration", {"metadata__name": "global"}, "metadata.name", '"default"'),
    ("BGPConfiguration", {"spec__asNumber": 0}, "spec.asNumber", "between 1 and 4294967295"),
    ("BGPConfiguration", {"spec__asNumber": 4294967296}, "spec.asNumber", "between 1"),
    ("BGPConfiguration", {"spec__logSeverityScreen": "Loud"}, "spec.logSeverityScreen", "Info"),
    (
        "BGPConfiguration",
        {"spec__nodeToNodeMeshEnabled": "no"},
        "spec.nodeToNodeMeshEnabled",
        "valid boolean",
    ),
    # BGPPeer
    ("BGPPeer", {"spec__peerIP": DROP}, "spec.peerIP", "peerSelector"),
    ("BGPPeer", {"spec__asNumber": DROP}, "spec.asNumber", "Required value"),
    ("BGPPeer", {"spec__peerIP": "192.0.2.1:179"}, "spec.peerIP", "IPv4 or IPv6 address"),
    ("BGPPeer", {"spec__peerSelector": "rr == 'true'"}, "spec.peerIP", "cannot both"),
    (
        "BGPPeer",
        {"spec__peerIP": DROP, "spec__peerSelector": "rr == 'true'"},
        "spec.asNumber",
        "peerSelector",
    ),
    ("BGPPeer", {"spec__peerSelector": "rr =="}, "spec.peerSelector", "invalid selector at offset"),
    ("BGPPeer", {"spec__node": "node-a"}, "spec.nodeSelector", "cannot both"),
    ("BGPPeer", {"spec__node": "Node_A", "spec__nodeSelector": DROP}, "spec.node", "RFC 1123"),
    # Node
    ("Node", {"spec__ipv4Address": "192.168.1.5"}, "spec.ipv4Address", "prefix length"),
    ("Node", {"spec__ipv4Address": "fd00::5/64"}, "spec.ipv4Address", "IPv4"),
    ("Node", {"spec__ipv6Address": "192.168.1.5/24"}, "spec.ipv6Address", "IPv6"),
    (
        "Node",
        {"spec__ipv4VXLANTunnelAddr": "10.50.0.1/32"},
        "spec.ipv4VXLANTunnelAddr",
        "IPv4 address",
    ),
    ("Node", {"spec__vxlanTunnelMACAddr": "66:aa:bb"}, "spec.vxlanTunnelMACAddr", "MAC"),
    ("Node", {"spec__backend": "ipip"}, "spec.backend", "vxlan"),
    (
        "Node",
        {"spec__bgp__routeReflectorClusterID": "rr1"},
        "spec.bgp.routeReflectorClusterID",
        "IPv4",
    ),
    ("Node", {"spec__bgp__asNumber": -1}, "spec.bgp.asNumber", "between 1"),
    ("Node", {"metadata__labels": {"rack": ["a"]}}, "metadata.labels[rack]", "must be a string"),
    # WorkloadEndpoint
    (
        "WorkloadEndpoint",
        {"spec__ipNetworks": ["10.50.0.7/32", "10.50.0.7/24"]},
        "spec.ipNetworks[1]",
        "host bits",
    ),
    ("WorkloadEndpoint", {"spec__node": DROP}, "spec.node", "Required value"),
    ("WorkloadEndpoint", {"spec__pod": "Web"}, "spec.pod", "RFC 1123"),
    ("WorkloadEndpoint", {"spec__interface": ""}, "spec.interface", "Required value"),
    # found by fuzzing (tests/fuzz/nft_render.py): the host interface names nft chains,
    # maps and counters, and was not checked: "x;flush ruleset" ended an nft command
    ("WorkloadEndpoint", {"spec__hostInterface": "x;flush"}, "spec.hostInterface", "alphanum"),
    ("WorkloadEndpoint", {"spec__hostInterface": "a b"}, "spec.hostInterface", "alphanum"),
    ("WorkloadEndpoint", {"spec__hostInterface": "-x"}, "spec.hostInterface", "alphanum"),
    ("WorkloadEndpoint", {"spec__hostInterface": "c" * 16}, "spec.hostInterface", "15 char"),
]


@pytest.mark.parametrize(
    ("kind", "changes", "path", "fragment"),
    INVALID,
    ids=[f"{k}:{p}:{i}" for i, (k, _c, p, _f) in enumerate(INVALID)],
)
def test_invalid_field_gives_its_path(
    kind: str, changes: dict[str, Any], path: str, fragment: str
) -> None:
    found = errors_of(doc(kind, **changes))
    assert path in [p for p, _ in found], found
    message = dict(found)[path]
    assert fragment in message, found


def test_every_error_of_a_document_is_reported() -> None:
    found = errors_of(
        doc(
            NP,
            **{
                "metadata__labels": {"app": "a b"},
                f"{P0}__port": 0,
                f"{E0}__to__0": {},
                "spec__policyTypes": ["Sideways"],
            },
        )
    )
    assert [p for p, _ in found] == [
        "metadata.labels[app]",
        "spec.ingress[0].ports[0].port",
        "spec.egress[0].to[0]",
        "spec.policyTypes[0]",
    ]


def test_unknown_namespaced_default_and_cluster_scope() -> None:
    policy = validate(BY_KIND[NP], doc(NP, metadata__namespace=DROP))
    assert policy.namespace == "default"
    pool = validate(BY_KIND["IPPool"], VALID["IPPool"])
    assert pool.namespace is None


# -- NetworkPolicy defaulting -----------------------------------------------------------------


def policy(spec: dict[str, Any] | None) -> NetworkPolicy:
    data: dict[str, Any] = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": "p"},
    }
    if spec is not None:
        data["spec"] = spec
    model = validate(BY_KIND[NP], data)
    assert isinstance(model, NetworkPolicy)
    return model


@pytest.mark.parametrize(
    ("spec", "types"),
    [
        (None, ["Ingress"]),
        ({}, ["Ingress"]),
        ({"podSelector": {}}, ["Ingress"]),
        ({"ingress": [{}]}, ["Ingress"]),
        ({"egress": []}, ["Ingress"]),
        ({"egress": None}, ["Ingress"]),
        ({"egress": [{}]}, ["Ingress", "Egress"]),
        ({"ingress": [{}], "egress": [{"to": [{"podSelector": {}}]}]}, ["Ingress", "Egress"]),
        ({"policyTypes": []}, ["Ingress"]),
        ({"policyTypes": ["Egress"]}, ["Egress"]),
        ({"policyTypes": ["Egress"], "ingress": [{}]}, ["Egress"]),
        ({"policyTypes": ["Ingress", "Egress"]}, ["Ingress", "Egress"]),
    ],
)
def test_policy_types_default_like_the_api_server(
    spec: dict[str, Any] | None, types: list[str]
) -> None:
    assert policy(spec).spec.policyTypes == types


def test_port_protocol_defaults_to_tcp_and_empty_selector_selects_all() -> None:
    p = policy({"ingress": [{"ports": [{"port": 80}, {}, {"protocol": "SCTP"}]}]})
    ports = p.spec.ingress[0].ports if p.spec.ingress else None
    assert ports is not None
    assert [(x.protocol, x.port) for x in ports] == [("TCP", 80), ("TCP", None), ("SCTP", None)]
    assert p.spec.podSelector.matches({"anything": "x"})
    wire = p.wire()["spec"]
    assert wire["podSelector"] == {}
    assert wire["ingress"][0]["ports"][1] == {"protocol": "TCP"}


def test_ip_block_accepts_host_bits_like_the_api_server() -> None:
    p = policy(
        {"egress": [{"to": [{"ipBlock": {"cidr": "10.1.2.3/8", "except": ["10.9.9.9/16"]}}]}]}
    )
    block = p.spec.egress[0].to[0].ipBlock if p.spec.egress and p.spec.egress[0].to else None
    assert block is not None
    assert str(block.network) == "10.0.0.0/8"
    assert [str(n) for n in block.excepted] == ["10.9.0.0/16"]
    assert block.wire() == {"cidr": "10.1.2.3/8", "except": ["10.9.9.9/16"]}


@pytest.mark.parametrize(
    ("selector", "labels", "expected"),
    [
        ({}, {}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "1", "b": "2"}, True),
        ({"matchLabels": {"a": "1"}}, {"a": "2"}, False),
        (
            {"matchExpressions": [{"key": "a", "operator": "In", "values": ["1", "2"]}]},
            {"a": "2"},
            True,
        ),
        ({"matchExpressions": [{"key": "a", "operator": "In", "values": ["1"]}]}, {}, False),
        ({"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]}, {}, True),
        (
            {"matchExpressions": [{"key": "a", "operator": "NotIn", "values": ["1"]}]},
            {"a": "1"},
            False,
        ),
        ({"matchExpressions": [{"key": "a", "operator": "Exists"}]}, {"a": ""}, True),
        ({"matchExpressions": [{"key": "a", "operator": "DoesNotExist"}]}, {"a": ""}, False),
        (
            {"matchLabels": {"a": "1"}, "matchExpressions": [{"key": "b", "operator": "Exists"}]},
            {"a": "1"},
            False,
        ),
    ],
)
def test_label_selector_semantics(
    selector: dict[str, Any], labels: dict[str, str], expected: bool
) -> None:
    assert LabelSelector.model_validate(selector).matches(labels) is expected


def test_namespace_always_carries_its_name_label() -> None:
    ns = validate(
        BY_KIND["Namespace"],
        doc("Namespace", metadata__labels={"kubernetes.io/metadata.name": "other", "team": "a"}),
    )
    assert ns.labels == {"team": "a", "kubernetes.io/metadata.name": "shop"}
    bare = validate(BY_KIND["Namespace"], doc("Namespace", metadata__labels=DROP))
    assert bare.labels == {"kubernetes.io/metadata.name": "shop"}
    assert names.namespace_labels("never-applied") == {
        "kubernetes.io/metadata.name": "never-applied"
    }


def test_pod_named_ports() -> None:
    pod = validate(BY_KIND["Pod"], VALID["Pod"])
    assert isinstance(pod, Pod)
    assert pod.named_ports() == [("http", "TCP", 80)]


def test_defaults_of_tabby_kinds() -> None:
    pool = validate(BY_KIND["IPPool"], doc("IPPool", spec={"cidr": "fd00:50::/48"}))
    assert isinstance(pool, IPPool)
    assert (pool.spec.blockSize, pool.spec.ipipMode, pool.spec.vxlanMode) == (122, None, None)
    assert (pool.spec.natOutgoing, pool.spec.disabled, pool.spec.nodeSelector) == (
        False,
        False,
        "all()",
    )
    canonical = validate(BY_KIND["IPPool"], doc("IPPool", spec={"cidr": "fd00:0050:0::/48"}))
    assert isinstance(canonical, IPPool)
    assert canonical.spec.cidr == "fd00:50::/48"
    bgp = validate(BY_KIND["BGPConfiguration"], doc("BGPConfiguration", spec=DROP)).wire()
    assert bgp["spec"] == {
        "asNumber": 64512,
        "nodeToNodeMeshEnabled": True,
        "logSeverityScreen": "Info",
    }


# -- names -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("check", "value", "ok"),
    [
        (names.dns1123_label, "a", True),
        (names.dns1123_label, "a-1", True),
        (names.dns1123_label, "a.b", False),
        (names.dns1123_label, "-a", False),
        (names.dns1123_label, "a" * 63, True),
        (names.dns1123_label, "a" * 64, False),
        (names.dns1123_subdomain, "a.b-c.d", True),
        (names.dns1123_subdomain, "a..b", False),
        (names.dns1123_subdomain, "A", False),
        (names.qualified_name, "app", True),
        (names.qualified_name, "example.com/app_1.x", True),
        (names.qualified_name, "/app", False),
        (names.qualified_name, "example.com/", False),
        (names.qualified_name, "Example.com/app", False),
        (names.qualified_name, "a" * 64, False),
        (names.label_value, "", True),
        (names.label_value, "A_b.c-1", True),
        (names.label_value, "a b", False),
        (names.label_value, "_a", False),
        (names.port_name, "http", True),
        (names.port_name, "h2c-8080", True),
        (names.port_name, "8080", False),
        (names.port_name, "a_b", False),
        (names.port_name, "a" * 15, True),
    ],
)
def test_name_syntax(check: Callable[[str], str | None], value: str, ok: bool) -> None:
    assert (check(value) is None) is ok


# -- kinds and the storage mapping -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("alias", "kind"),
    [
        ("ippool", "IPPool"),
        ("IPPools", "IPPool"),
        ("node", "Node"),
        ("nodes", "Node"),
        ("bgpconfiguration", "BGPConfiguration"),
        ("bgpconfigurations", "BGPConfiguration"),
        ("bgppeer", "BGPPeer"),
        ("bgppeers", "BGPPeer"),
        ("networkpolicy", "NetworkPolicy"),
        ("networkpolicies", "NetworkPolicy"),
        ("netpol", "NetworkPolicy"),
        ("namespace", "Namespace"),
        ("namespaces", "Namespace"),
        ("ns", "Namespace"),
        ("pod", "Pod"),
        ("pods", "Pod"),
        ("workloadendpoint", "WorkloadEndpoint"),
        ("workloadendpoints", "WorkloadEndpoint"),
        ("wep", "WorkloadEndpoint"),
    ],
)
def test_kind_aliases(alias: str, kind: str) -> None:
    assert resolve_kind(alias).kind == kind


def test_store_kinds_are_the_store_contracts() -> None:
    from datastore.base import KINDS

    assert {i.store_kind for i in RESOURCE_KINDS} <= set(KINDS)
    assert len({i.store_kind for i in RESOURCE_KINDS}) == len(RESOURCE_KINDS)


def test_pool_document_keeps_allocator_keys_and_unknown_ones() -> None:
    info = BY_KIND["IPPool"]
    existing = {"cidr": "10.50.0.0/16", "block_size": 26, "disabled": False, "future": 1}
    raw = stored_raw(info, "10.50.0.0/16", existing)
    assert raw == {
        "metadata": {"name": "ippool-10-50-0-0-16"},
        "spec": {"cidr": "10.50.0.0/16", "blockSize": 26, "disabled": False},
    }
    pool = validate(info, {**VALID["IPPool"], "metadata": {"name": "pool-a"}})
    data = stored_data(info, VALID["IPPool"], pool, existing)
    assert data == {
        "cidr": "10.50.0.0/16",
        "block_size": 26,
        "disabled": False,
        "future": 1,
        "name": "pool-a",
        "vxlan_mode": "Always",
        "nat_outgoing": False,
        "node_selector": "all()",
    }
    back = to_resource(info, "10.50.0.0/16", Doc(data, 42), "memory:pool/10.50.0.0/16")
    assert back.metadata.resourceVersion == "42"
    assert back.name == "pool-a"
    assert pool_name({}, "fd00:10:244::/48") == "ippool-fd00-10-244---48"
    assert names.dns1123_subdomain(pool_name({}, "fd00:10:244::/48")) is None


def test_a_stored_document_that_does_not_validate_is_store_corrupt() -> None:
    from ipam.core.errors import StoreCorrupt

    info = BY_KIND[NP]
    bad = {
        "metadata": {"name": "x", "namespace": "a"},
        "spec": {"ingress": [{"ports": [{"port": 0}]}]},
    }
    with pytest.raises(StoreCorrupt, match=r"spec\.ingress\[0\]\.ports\[0\]\.port"):
        to_resource(info, "a/x", Doc(bad, 3), "somewhere")


# -- layering ---------------------------------------------------------------------------------


def test_layering_plugin_side_modules_import_no_heavy_library() -> None:
    """What the CNI binaries may use (WorkloadEndpoint helpers, names, selectors, migration)
    imports neither pydantic nor yaml nor click; and the binaries' own modules import nothing
    of resources at module level."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import resources.wep, resources.names, resources.selector\n"
        "import resources.migrate, resources.errors\n"
        "heavy = {'pydantic', 'pydantic_core', 'yaml', 'click'}\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
        "import ipam.core, datastore, ipam.plugin, cni_plugin.plugin\n"
        "light = {'wep', 'names', 'selector', 'migrate', 'errors'}\n"
        "print(sorted(m for m in sys.modules\n"
        "             if m.startswith('resources.') and m.split('.')[1] not in light))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.splitlines() == ["[]", "[]"]
