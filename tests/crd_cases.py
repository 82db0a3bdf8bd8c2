"""Documents of tabby's kinds and what ``tabbyctl apply`` (the models of ``resources.tabby``
and ``resources.calico``) and the API server (the CRDs of ``stores.kube.crds``) each say of
them: the unit tier checks
the models and the schemas (tests/unit/stores/test_kube_crds.py, the schemas through
tests/structural.py), the Kubernetes tier sends the same documents to a real API server
(tests/kubernetes/test_manifest.py).

- ``REFUSED``: both refuse, and both name ``field``;
- ``ACCEPTED``: both accept;
- ``STRICTER``: the API server refuses (naming ``field``) a notation the models turn into the
  canonical one;
- ``LAXER``: the models refuse what a schema of Kubernetes 1.20 cannot (docs/kubernetes.md
  "tabby's kinds as CustomResourceDefinitions"): the API server takes it (``field`` is what
  the model names).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any

API_VERSION = "tabby.io/v1"


@dataclass(frozen=True)
class Case:
    kind: str
    spec: dict[str, Any] | None
    field: str | None = None  # the field named (None: accepted)
    name: str = "case"
    why: str = ""

    def document(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "apiVersion": API_VERSION,
            "kind": self.kind,
            "metadata": {"name": self.name},
        }
        if self.spec is not None:
            doc["spec"] = copy.deepcopy(self.spec)
        return doc

    @property
    def label(self) -> str:
        return f"{self.kind}:{self.why or self.field or 'ok'}"


def _pool(**spec: Any) -> dict[str, Any]:
    return {"cidr": "10.244.0.0/16", **spec}


PEER = {"peerIP": "192.0.2.1", "asNumber": 65000}


def _rule(**rule: Any) -> dict[str, Any]:
    """A GlobalNetworkPolicy spec with one ingress rule."""
    return {"ingress": [{"action": "Allow", **rule}]}


TCP_80 = {"protocol": "TCP", "destination": {"ports": [80]}}
G = "GlobalNetworkPolicy"
HEP = {"node": "node-a", "interfaceName": "eth0"}

REFUSED = [
    # IPPool: the CIDR
    Case("IPPool", _pool(cidr="10.0.0.0/33"), "spec.cidr", why="IPv4 prefix over 32"),
    Case("IPPool", _pool(cidr="fd00::/129"), "spec.cidr", why="IPv6 prefix over 128"),
    Case("IPPool", _pool(cidr="10.244.0.1/16"), "spec.cidr", why="IPv4 host bits"),
    Case("IPPool", _pool(cidr="10.244.0.0"), "spec.cidr", why="no prefix length"),
    Case("IPPool", _pool(cidr="banana"), "spec.cidr", why="not a CIDR"),
    Case("IPPool", _pool(cidr="300.1.0.0/16"), "spec.cidr", why="octet over 255"),
    Case("IPPool", _pool(cidr="10.1.0/16"), "spec.cidr", why="three octets"),
    Case("IPPool", _pool(cidr="fd00::zz/64"), "spec.cidr", why="IPv6 not hex"),
    Case("IPPool", _pool(cidr="fd00:1:2:3:4:5:6:7:8/64"), "spec.cidr", why="nine groups"),
    Case("IPPool", _pool(cidr="fd00::1::/64"), "spec.cidr", why="two ::"),
    Case("IPPool", _pool(cidr="10.244.0.0/16\n"), "spec.cidr", why="trailing newline"),
    Case("IPPool", _pool(cidr=42), "spec.cidr", why="not a string"),
    Case("IPPool", {"blockSize": 26}, "spec.cidr", why="no cidr"),
    Case("IPPool", None, "spec", why="no spec"),
    # IPPool: the block size, of the pool's family and no smaller than the pool
    Case("IPPool", _pool(blockSize=19), "spec.blockSize", why="IPv4 block under 20"),
    Case("IPPool", _pool(blockSize=33), "spec.blockSize", why="IPv4 block over 32"),
    Case("IPPool", _pool(blockSize=122), "spec.blockSize", why="an IPv6 size on IPv4"),
    Case("IPPool", _pool(cidr="fd00::/48", blockSize=26), "spec.blockSize", why="IPv4 size, IPv6"),
    Case("IPPool", _pool(cidr="fd00::/48", blockSize=129), "spec.blockSize", why="IPv6 over 128"),
    Case("IPPool", _pool(cidr="10.244.0.0/28", blockSize=26), "spec.blockSize", why="pool < block"),
    Case("IPPool", _pool(cidr="fd00::/124", blockSize=122), "spec.blockSize", why="IPv6 < block"),
    Case("IPPool", _pool(blockSize="26"), "spec.blockSize", why="a string"),
    Case("IPPool", _pool(blockSize=26.5), "spec.blockSize", why="not whole"),
    Case("IPPool", _pool(blockSize=True), "spec.blockSize", why="a boolean"),
    # IPPool: the rest
    Case("IPPool", _pool(ipipMode="Sometimes"), "spec.ipipMode", why="unknown ipipMode"),
    Case("IPPool", _pool(vxlanMode="always"), "spec.vxlanMode", why="enum is case-sensitive"),
    Case("IPPool", _pool(ipipMode="Always", vxlanMode="CrossSubnet"), "spec.vxlanMode", why="both"),
    Case("IPPool", _pool(cidr="fd00::/48", ipipMode="Always"), "spec.ipipMode", why="IPv6 IPIP"),
    Case("IPPool", _pool(natOutgoing="true"), "spec.natOutgoing", why="natOutgoing a string"),
    Case("IPPool", _pool(disabled=1), "spec.disabled", why="disabled a number"),
    Case("IPPool", _pool(nodeSelector=["all()"]), "spec.nodeSelector", why="selector a list"),
    # BGPConfiguration
    Case("BGPConfiguration", {}, "metadata.name", name="global", why="not named default"),
    Case("BGPConfiguration", {"asNumber": 0}, "spec.asNumber", name="default", why="AS 0"),
    Case("BGPConfiguration", {"asNumber": 4294967296}, "spec.asNumber", name="default"),
    Case("BGPConfiguration", {"asNumber": "64512"}, "spec.asNumber", name="default", why="string"),
    Case("BGPConfiguration", {"logSeverityScreen": "Loud"}, "spec.logSeverityScreen", "default"),
    Case(
        "BGPConfiguration", {"nodeToNodeMeshEnabled": "no"}, "spec.nodeToNodeMeshEnabled", "default"
    ),
    # BGPPeer
    Case("BGPPeer", {"asNumber": 65000}, "spec.peerIP", why="no peer"),
    Case("BGPPeer", {"peerIP": "192.0.2.1"}, "spec.asNumber", why="no AS"),
    Case("BGPPeer", {**PEER, "peerIP": "192.0.2.1:179"}, "spec.peerIP", why="a port"),
    Case("BGPPeer", {**PEER, "peerIP": "192.0.2.256"}, "spec.peerIP", why="octet over 255"),
    Case("BGPPeer", {**PEER, "peerIP": "192.0.2.0/24"}, "spec.peerIP", why="a CIDR"),
    Case("BGPPeer", {**PEER, "asNumber": 0}, "spec.asNumber", why="AS 0"),
    Case("BGPPeer", {**PEER, "asNumber": 4294967296}, "spec.asNumber", why="AS over 32 bits"),
    Case("BGPPeer", {**PEER, "peerSelector": "rr == 'true'"}, "spec.peerIP", why="IP + selector"),
    Case("BGPPeer", {"peerSelector": "all()", "asNumber": 65000}, "spec.asNumber", why="AS + sel"),
    Case(
        "BGPPeer",
        {**PEER, "node": "node-a", "nodeSelector": "all()"},
        "spec.nodeSelector",
        why="node + nodeSelector",
    ),
    Case("BGPPeer", {**PEER, "node": "Node_A"}, "spec.node", why="node not a DNS name"),
    Case("BGPPeer", {**PEER, "node": "a" * 254}, "spec.node", why="node over 253"),
    # Node
    Case("Node", {"ipv4Address": "192.168.1.5"}, "spec.ipv4Address", why="no prefix length"),
    Case("Node", {"ipv4Address": "192.168.1.5/33"}, "spec.ipv4Address", why="prefix over 32"),
    Case("Node", {"ipv4Address": "fd00::5/64"}, "spec.ipv4Address", why="IPv6 as IPv4"),
    Case("Node", {"ipv6Address": "192.168.1.5/24"}, "spec.ipv6Address", why="IPv4 as IPv6"),
    Case("Node", {"ipv6Address": "fd00::5/129"}, "spec.ipv6Address", why="prefix over 128"),
    Case("Node", {"ipv4VXLANTunnelAddr": "10.50.0.1/32"}, "spec.ipv4VXLANTunnelAddr"),
    Case("Node", {"ipv6VXLANTunnelAddr": "10.50.0.1"}, "spec.ipv6VXLANTunnelAddr"),
    Case("Node", {"vxlanTunnelMACAddr": "66:aa:bb"}, "spec.vxlanTunnelMACAddr"),
    Case("Node", {"vxlanTunnelMACAddrV6": "66-aa-bb-cc-dd-ee"}, "spec.vxlanTunnelMACAddrV6"),
    Case("Node", {"backend": "ipip"}, "spec.backend", why="unknown backend"),
    Case("Node", {"bgp": {"routeReflectorClusterID": "rr1"}}, "spec.bgp.routeReflectorClusterID"),
    Case("Node", {"bgp": {"ipv4IPIPTunnelAddr": "fd00::1"}}, "spec.bgp.ipv4IPIPTunnelAddr"),
    Case("Node", {"bgp": {"asNumber": -1}}, "spec.bgp.asNumber", why="negative AS"),
    Case("Node", {"bgp": "65000"}, "spec.bgp", why="bgp not an object"),
    # Calico's policy kinds (resources.calico)
    Case(G, {"ingress": [{"action": "Accept"}]}, "spec.ingress[0].action", why="action"),
    Case(G, _rule(protocol="TCPX"), "spec.ingress[0].protocol", why="protocol name"),
    Case(G, _rule(protocol=256), "spec.ingress[0].protocol", why="protocol over 255"),
    Case(G, _rule(destination={"ports": [80]}), "spec.ingress[0].destination.ports", why="ports"),
    Case(
        G,
        _rule(protocol="TCP", destination={"ports": [70000]}),
        "spec.ingress[0].destination.ports[0]",
        why="port over 65535",
    ),
    Case(
        G,
        _rule(protocol="UDP", source={"notPorts": ["no_such_port"]}),
        "spec.ingress[0].source.notPorts[0]",
        why="port text",
    ),
    Case(G, _rule(icmp={"type": 8}), "spec.ingress[0].icmp", why="icmp without ICMP"),
    Case(G, _rule(protocol="ICMP", icmp={"type": 255}), "spec.ingress[0].icmp.type", why="type"),
    Case(G, _rule(protocol="ICMP", icmp={"code": 1}), "spec.ingress[0].icmp.code", why="no type"),
    Case(G, _rule(ipVersion=5), "spec.ingress[0].ipVersion", why="ipVersion"),
    Case(G, _rule(source={"nets": ["10.0.0.0/33"]}), "spec.ingress[0].source.nets[0]", why="net"),
    Case(G, _rule(http={"methods": ["GET"]}), "spec.ingress[0].http", why="http"),
    Case(
        G,
        _rule(destination={"services": {"name": "x"}}),
        "spec.ingress[0].destination.services",
        why="services",
    ),
    Case(G, {"types": ["Inbound"]}, "spec.types[0]", why="types"),
    Case(G, {"order": "10"}, "spec.order", why="order a string"),
    Case(G, {"preDNAT": True}, "spec.applyOnForward", why="preDNAT alone"),
    Case(G, {"doNotTrack": True}, "spec.applyOnForward", why="doNotTrack alone"),
    Case(
        G,
        {"preDNAT": True, "doNotTrack": True, "applyOnForward": True},
        "spec.preDNAT",
        why="preDNAT and doNotTrack",
    ),
    Case(
        G,
        {"preDNAT": True, "applyOnForward": True, "egress": [{"action": "Allow"}]},
        "spec.egress",
        why="preDNAT egress",
    ),
    Case("NetworkPolicy", {"tier": "Bad_Tier"}, "spec.tier", why="tier name"),
    Case("StagedGlobalNetworkPolicy", {"stagedAction": "Learn"}, "spec.stagedAction"),
    Case("Tier", {"defaultAction": "Allow"}, "spec.defaultAction", why="defaultAction"),
    Case("Tier", {"order": True}, "spec.order", why="order a boolean"),
    Case("GlobalNetworkSet", {"nets": ["10.0.0.300/8"]}, "spec.nets[0]", why="net"),
    Case("NetworkSet", {"nets": "10.0.0.0/8"}, "spec.nets", why="nets not a list"),
    Case("HostEndpoint", {"interfaceName": "eth0"}, "spec.node", why="no node"),
    Case("HostEndpoint", {**HEP, "interfaceName": "a" * 16}, "spec.interfaceName"),
    Case("HostEndpoint", {**HEP, "expectedIPs": ["10.0.0.1/32"]}, "spec.expectedIPs[0]"),
    Case(
        "HostEndpoint",
        {**HEP, "ports": [{"name": "web", "protocol": "ICMP", "port": 80}]},
        "spec.ports[0].protocol",
        why="port protocol",
    ),
    Case(
        "StagedKubernetesNetworkPolicy",
        {"policyTypes": ["Inbound"]},
        "spec.policyTypes[0]",
        why="policyTypes",
    ),
]

ACCEPTED = [
    Case("IPPool", _pool()),
    Case("IPPool", _pool(blockSize=26, ipipMode="Always", natOutgoing=True)),
    Case("IPPool", _pool(cidr="10.244.0.0/20", blockSize=20, vxlanMode="CrossSubnet")),
    Case("IPPool", _pool(cidr="0.0.0.0/0", blockSize=32, disabled=True)),
    Case("IPPool", _pool(cidr="10.244.0.0/26")),
    Case("IPPool", _pool(cidr="10.244.1.128/25", blockSize=28)),
    Case("IPPool", _pool(cidr="fd00:10:244::/48")),
    Case("IPPool", _pool(cidr="fd00::/122")),
    Case("IPPool", _pool(cidr="FD00:10:244::/48", blockSize=128, ipipMode="Never")),
    Case("IPPool", _pool(cidr="::ffff:10.0.0.0/120", blockSize=122)),
    Case("IPPool", _pool(vxlanMode="Always", ipipMode="Never", nodeSelector="rack == 'a'")),
    Case("IPPool", _pool(ipipMode=None), why="null: unset"),
    Case("BGPConfiguration", {}, name="default"),
    Case(
        "BGPConfiguration",
        {"asNumber": 4294967295, "nodeToNodeMeshEnabled": False, "logSeverityScreen": "Debug"},
        name="default",
    ),
    Case("BGPPeer", PEER),
    Case("BGPPeer", {"peerIP": "fd00::1", "asNumber": 1, "node": "node-a.example"}),
    Case("BGPPeer", {"peerSelector": "route-reflector == 'true'", "nodeSelector": "all()"}),
    Case("Node", {}),
    Case(
        "Node",
        {
            "backend": "vxlan",
            "ipv4Address": "192.168.1.5/24",
            "ipv6Address": "fd00::5/64",
            "ipv4VXLANTunnelAddr": "10.50.0.1",
            "ipv6VXLANTunnelAddr": "fd00:50::1",
            "vxlanTunnelMACAddr": "66:aa:bb:cc:dd:ee",
            "vxlanTunnelMACAddrV6": "66:AA:BB:CC:DD:EF",
            "bgp": {
                "asNumber": 64600,
                "routeReflectorClusterID": "224.0.0.1",
                "ipv4IPIPTunnelAddr": "10.244.3.1",
            },
        },
    ),
    Case(
        "GlobalNetworkPolicy",
        {
            "order": 10.5,
            "selector": "role == 'db'",
            "namespaceSelector": "has(team)",
            "types": ["Ingress", "Egress"],
            "ingress": [
                {
                    "action": "Allow",
                    "protocol": "TCP",
                    "source": {
                        "nets": ["10.0.0.0/8", "192.0.2.1"],
                        "selector": "role == 'fe'",
                        "serviceAccounts": {"names": ["api"], "selector": "a == 'b'"},
                    },
                    "destination": {"ports": [80, "8000:8080", "http"], "notPorts": [8001]},
                    "metadata": {"annotations": {"from": "frontend"}},
                },
                {"action": "Allow", "protocol": "ICMPv6", "icmp": {"type": 128, "code": 0}},
                {"action": "Log", "protocol": 132, "ipVersion": 6},
                {"action": "Deny", "notProtocol": "UDPLite"},
            ],
            "egress": [{"action": "Pass", "destination": {"namespaceSelector": "global()"}}],
        },
    ),
    Case(
        "GlobalNetworkPolicy",
        {
            "preDNAT": True,
            "applyOnForward": True,
            "selector": "has(host-endpoint)",
            "ingress": [{"action": "Allow", "source": {"nets": ["10.240.0.0/16"]}}],
        },
    ),
    Case(
        "GlobalNetworkPolicy",
        {"doNotTrack": True, "applyOnForward": True, "egress": [{"action": "Allow", **TCP_80}]},
    ),
    Case("NetworkPolicy", {"selector": "app == 'web'", "ingress": [{"action": "Allow", **TCP_80}]}),
    Case("NetworkPolicy", {"tier": "security"}, name="security.case"),
    Case("StagedNetworkPolicy", {"stagedAction": "Delete"}),
    Case("StagedGlobalNetworkPolicy", {"stagedAction": "Set", "egress": [{"action": "Deny"}]}),
    Case(
        "StagedKubernetesNetworkPolicy",
        {
            "stagedAction": "Set",
            "podSelector": {"matchLabels": {"app": "db"}},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"ipBlock": {"cidr": "172.17.0.0/16", "except": ["172.17.1.0/24"]}}],
                    "ports": [{"protocol": "TCP", "port": 6379}],
                }
            ],
        },
    ),
    Case("Tier", {"order": 100, "defaultAction": "Pass"}),
    Case("Tier", {}),
    Case("NetworkSet", {"nets": ["198.51.100.0/28", "10.1.2.3"]}),
    Case("GlobalNetworkSet", {"nets": ["fd00::/8"]}),
    Case(
        "HostEndpoint",
        {
            **HEP,
            "expectedIPs": ["192.168.0.1", "fd00::1"],
            "profiles": ["p1"],
            "ports": [{"name": "some-port", "protocol": "TCP", "port": 1234}],
        },
    ),
    Case("HostEndpoint", {"node": "node-a", "interfaceName": "*"}),
    Case("HostEndpoint", {"node": "node-a", "expectedIPs": ["10.0.0.1"]}),
]

STRICTER = [
    Case("IPPool", _pool(cidr="10.244.0.0/255.255.0.0"), "spec.cidr", why="netmask"),
    Case("IPPool", _pool(cidr="10.244.0.0/016"), "spec.cidr", why="prefix with a leading zero"),
    Case("Node", {"ipv4Address": "192.168.1.5/255.255.255.0"}, "spec.ipv4Address", why="mask"),
]

LAXER = [
    Case("IPPool", _pool(cidr="fd00::1/64"), "spec.cidr", why="IPv6 host bits"),
    Case("IPPool", _pool(nodeSelector="rack == "), "spec.nodeSelector", why="selector syntax"),
    Case("BGPPeer", {**PEER, "nodeSelector": "rack =="}, "spec.nodeSelector", why="selector"),
    Case("IPPool", _pool(blockSzie=24), "spec.blockSzie", why="unknown field (dropped)"),
    Case(
        "GlobalNetworkPolicy",
        _rule(source={"selector": "a =="}),
        "spec.ingress[0].source.selector",
        why="rule selector",
    ),
    Case(
        "GlobalNetworkPolicy",
        _rule(protocol="TCP", destination={"ports": ["90:80"]}),
        "spec.ingress[0].destination.ports[0]",
        why="port range order",
    ),
    Case(
        "GlobalNetworkPolicy",
        _rule(source={"nets": ["10.0.0.0/8"]}, destination={"nets": ["fd00::/8"]}),
        "spec.ingress[0].destination.nets",
        why="two IP versions",
    ),
    Case("GlobalNetworkPolicy", {"tier": "security"}, "metadata.name", why="tier prefix"),
    Case("Tier", {"ordre": 1}, "spec.ordre", why="unknown field (dropped)"),
]
