"""Documents of tabby's kinds and what ``tabbyctl apply`` (the models of ``resources.tabby``)
and the API server (the CRDs of ``stores.kube.crds``) each say of them: the unit tier checks
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
]
