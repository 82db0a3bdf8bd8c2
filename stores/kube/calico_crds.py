"""The structural schemas of Calico's policy kinds (``resources.calico``) as tabby's
CustomResourceDefinitions (``stores.kube.crds`` makes the definitions of them).

They hold a document to what ``tabbyctl apply`` holds it to, as far as a schema of
Kubernetes 1.20 can say (no CEL): every field's type; the enums (``action``, ``types``,
``defaultAction``, ``stagedAction``, ``ipVersion``, protocols by name); number ranges
(protocol numbers, ICMP type and code, ports); CIDRs and addresses by pattern; ports only
with TCP, UDP or SCTP and ICMP fields only with ICMP or ICMPv6; ``preDNAT`` not with
``doNotTrack`` nor with egress rules, and either only with ``applyOnForward``; a host
endpoint's ``interfaceName`` or ``expectedIPs``; ``http`` and ``services`` refused (tabby
does not enforce them). What a schema cannot say is checked where the documents are read
(tabby-node parses them through the models and leaves out, logged, one that does not
validate): a selector's syntax, a port range's order (``"90:80"``), a number in a string
above 65535, one IP version per rule, a tier's existence, the tier prefix of a policy's
name, a staged ``Delete`` with other fields, CIDR host bits in ``nets``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, get_args

from resources.calico import (
    ICMP_CODE_MAX,
    ICMP_TYPE_MAX,
    PORT_PROTOCOLS,
    PROTOCOLS,
    Action,
    PolicyType,
    StagedAction,
    TierAction,
)

if TYPE_CHECKING:
    from bundle.types import JSON

#: an address or a CIDR of either family (host bits not checked)
_V4 = r"(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])(?:\.(?:25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])){3}"  # noqa: E501
_V4_PREFIX = r"(?:3[0-2]|[12]?[0-9])"
_V6 = r"[0-9a-fA-F:.]*:[0-9a-fA-F:.]*"
_V6_PREFIX = r"(?:12[0-8]|1[01][0-9]|[1-9]?[0-9])"
NET = rf"^(?:{_V4}(?:/{_V4_PREFIX})?|{_V6}(?:/{_V6_PREFIX})?)$"
ADDRESS = rf"^(?:{_V4}|{_V6})$"
#: a port as a string: a number, a range "first:last" or a port name (at most 15 of
#: [a-z0-9-] with a letter; the numbers' upper bound and a range's order are the models')
PORT_TEXT = r"^(?:[1-9][0-9]{0,4}(?::[1-9][0-9]{0,4})?|[a-z0-9-]*[a-z][a-z0-9-]*)$"
PROTOCOL_NAME = f"^(?:{'|'.join(PROTOCOLS)})$"
LABEL = r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?$"
INTERFACE = r"^(?:\*|[a-zA-Z0-9_.-]{1,15})$"
PORT_NAMES_OF = {"TCP": 6, "UDP": 17, "SCTP": 132}


def _string(description: str, **checks: object) -> JSON:
    return {"type": "string", "description": description, **checks}


def _strings(description: str, **item: object) -> JSON:
    return {"type": "array", "description": description, "items": {"type": "string", **item}}


def _int_or_string(description: str, number: JSON, text: JSON) -> JSON:
    """A number or a string, each checked as such (a check of one type is void for the
    other)."""
    return {
        "x-kubernetes-int-or-string": True,
        "description": description,
        "anyOf": [{"type": "integer"}, {"type": "string"}],
        "allOf": [number, text],
    }


def _ports(description: str) -> JSON:
    return {
        "type": "array",
        "description": description,
        "items": _int_or_string(
            "A port, a range first:last, or a port name.",
            {"minimum": 1, "maximum": 65535},
            {"pattern": PORT_TEXT},
        ),
    }


def _protocol(description: str) -> JSON:
    return _int_or_string(description, {"minimum": 1, "maximum": 255}, {"pattern": PROTOCOL_NAME})


def _icmp(description: str) -> JSON:
    return {
        "type": "object",
        "description": description,
        "properties": {
            "type": {"type": "integer", "minimum": 0, "maximum": ICMP_TYPE_MAX},
            "code": {"type": "integer", "minimum": 0, "maximum": ICMP_CODE_MAX},
        },
        # a code only with a type (named: code, as the model does)
        "anyOf": [{"properties": {"code": {"not": {}}}}, {"required": ["type"]}],
    }


def _forbidden(description: str) -> JSON:
    return {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
    }


def entity_rule() -> JSON:
    return {
        "type": "object",
        "description": "A rule's source or destination (resources.calico.EntityRule).",
        "properties": {
            "nets": _strings("CIDRs the peer is in.", pattern=NET),
            "notNets": _strings("CIDRs the peer is not in.", pattern=NET),
            "selector": _string("Endpoints and network sets, by label."),
            "notSelector": _string("Not these endpoints and network sets."),
            "namespaceSelector": _string("Their namespaces (global(): global objects)."),
            "ports": _ports("Ports (with protocol TCP, UDP or SCTP)."),
            "notPorts": _ports("Not these ports (with protocol TCP, UDP or SCTP)."),
            "serviceAccounts": {
                "type": "object",
                "properties": {
                    "names": _strings("Service account names."),
                    "selector": _string("Service accounts, by label."),
                },
            },
            "services": _forbidden("Refused: tabby does not enforce Service matches."),
        },
        "allOf": [{"properties": {"services": {"not": {}}}}],
    }


def _without(field: str) -> JSON:
    """A rule whose source and destination have no ``field``."""
    side: JSON = {"properties": {field: {"not": {}}}}
    return {"properties": {"source": side, "destination": side}}


def rule() -> JSON:
    port_protocols = [*PORT_NAMES_OF, *sorted(PORT_PROTOCOLS)]
    icmp_protocols = ["ICMP", "ICMPv6", PROTOCOLS["ICMP"], PROTOCOLS["ICMPv6"]]
    with_protocol = {"required": ["protocol"], "properties": {"protocol": {"enum": port_protocols}}}
    with_icmp = {"required": ["protocol"], "properties": {"protocol": {"enum": icmp_protocols}}}
    return {
        "type": "object",
        "description": "One rule (resources.calico.Rule).",
        "required": ["action"],
        "properties": {
            "action": _string("Allow, Deny, Log or Pass.", enum=list(get_args(Action))),
            "ipVersion": {"type": "integer", "enum": [4, 6]},
            "protocol": _protocol("A protocol name or number."),
            "notProtocol": _protocol("Not this protocol."),
            "icmp": _icmp("ICMP type and code (with protocol ICMP or ICMPv6)."),
            "notICMP": _icmp("Not this ICMP type and code."),
            "source": entity_rule(),
            "destination": entity_rule(),
            "metadata": {
                "type": "object",
                "properties": {
                    "annotations": {"type": "object", "additionalProperties": {"type": "string"}}
                },
            },
            "http": _forbidden("Refused: tabby does not enforce application-layer matches."),
        },
        "allOf": [
            {"properties": {"http": {"not": {}}}},
            # each rule first, its escape second: the API server names the rule's field
            {"anyOf": [_without("ports"), with_protocol]},
            {"anyOf": [_without("notPorts"), with_protocol]},
            {"anyOf": [{"properties": {"icmp": {"not": {}}}}, with_icmp]},
            {"anyOf": [{"properties": {"notICMP": {"not": {}}}}, with_icmp]},
        ],
    }


def _rules(description: str) -> JSON:
    return {"type": "array", "description": description, "items": rule()}


def policy_properties() -> JSON:
    return {
        "tier": _string("Its tier (default: default).", pattern=LABEL, maxLength=63),
        "order": {"type": "number", "description": "Lower first; none: last."},
        "selector": _string("The endpoints it applies to (empty: all)."),
        "types": {
            "type": "array",
            "description": "Ingress and/or Egress (defaulted from the rules).",
            "items": {"type": "string", "enum": list(get_args(PolicyType))},
        },
        "ingress": _rules("Ingress rules, in order."),
        "egress": _rules("Egress rules, in order."),
        "serviceAccountSelector": _string("Only endpoints of the service accounts it selects."),
        "performanceHints": _strings("Accepted, no effect.", enum=["AssumeNeededOnEveryNode"]),
    }


def global_properties() -> JSON:
    return {
        **policy_properties(),
        "namespaceSelector": _string("Only endpoints of the namespaces it selects."),
        "doNotTrack": {"type": "boolean", "description": "Before connection tracking."},
        "preDNAT": {"type": "boolean", "description": "Ingress before DNAT."},
        "applyOnForward": {"type": "boolean", "description": "Also forwarded traffic."},
    }


def _false(field: str) -> JSON:
    return {"properties": {field: {"enum": [False]}}}


def global_rules() -> list[JSON]:
    """preDNAT and doNotTrack as Calico allows them (named: the field the model names)."""
    on = {"required": ["applyOnForward"], "properties": {"applyOnForward": {"enum": [True]}}}
    return [
        {"anyOf": [_false("preDNAT"), _false("doNotTrack")]},
        {"anyOf": [{"properties": {"egress": {"not": {}}}}, _false("preDNAT")]},
        {
            "anyOf": [
                {"properties": {"types": {"items": {"enum": ["Ingress"]}}}},
                _false("preDNAT"),
            ]
        },
        {"anyOf": [on, _false("preDNAT")]},
        {"anyOf": [on, _false("doNotTrack")]},
    ]


def _staged(properties: JSON) -> JSON:
    action = _string("Set (what it would do) or Delete.", enum=list(get_args(StagedAction)))
    return {**properties, "stagedAction": action}


def networkpolicy_spec() -> JSON:
    return {
        "type": "object",
        "description": "Calico's namespaced NetworkPolicy (resources.calico).",
        "properties": policy_properties(),
    }


def globalnetworkpolicy_spec() -> JSON:
    return {
        "type": "object",
        "description": "Calico's GlobalNetworkPolicy (resources.calico).",
        "properties": global_properties(),
        "allOf": global_rules(),
    }


def stagednetworkpolicy_spec() -> JSON:
    return {
        "type": "object",
        "description": "A NetworkPolicy evaluated, never enforced (resources.calico).",
        "properties": _staged(policy_properties()),
    }


def stagedglobalnetworkpolicy_spec() -> JSON:
    return {
        "type": "object",
        "description": "A GlobalNetworkPolicy evaluated, never enforced (resources.calico).",
        "properties": _staged(global_properties()),
        "allOf": global_rules(),
    }


def _label_selector() -> JSON:
    return {
        "type": "object",
        "properties": {
            "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
            "matchExpressions": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["key", "operator"],
                    "properties": {
                        "key": {"type": "string"},
                        "operator": _string(
                            "In, NotIn, Exists or DoesNotExist.",
                            enum=["In", "NotIn", "Exists", "DoesNotExist"],
                        ),
                        "values": _strings("The values (In, NotIn)."),
                    },
                },
            },
        },
    }


def _peers() -> JSON:
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "podSelector": _label_selector(),
                "namespaceSelector": _label_selector(),
                "ipBlock": {
                    "type": "object",
                    "required": ["cidr"],
                    "properties": {
                        "cidr": _string("A CIDR.", pattern=NET),
                        "except": _strings("CIDRs inside it left out.", pattern=NET),
                    },
                },
            },
        },
    }


def _k8s_ports() -> JSON:
    return {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {
                "protocol": _string("TCP (default), UDP or SCTP.", enum=["TCP", "UDP", "SCTP"]),
                "port": _int_or_string(
                    "A port number or name.",
                    {"minimum": 1, "maximum": 65535},
                    {"pattern": r"^[a-z0-9-]*[a-z][a-z0-9-]*$", "maxLength": 15},
                ),
                "endPort": {"type": "integer", "minimum": 1, "maximum": 65535},
            },
        },
    }


def stagedkubernetesnetworkpolicy_spec() -> JSON:
    return {
        "type": "object",
        "description": "A Kubernetes NetworkPolicy evaluated, never enforced.",
        "properties": {
            "podSelector": _label_selector(),
            "policyTypes": _strings("Ingress and/or Egress.", enum=list(get_args(PolicyType))),
            "ingress": {
                "type": "array",
                "items": {
                    "type": "object",
                    "properties": {"from": _peers(), "ports": _k8s_ports()},
                },
            },
            "egress": {
                "type": "array",
                "items": {"type": "object", "properties": {"to": _peers(), "ports": _k8s_ports()}},
            },
            "stagedAction": _string(
                "Set (what it would do) or Delete.", enum=list(get_args(StagedAction))
            ),
        },
    }


def tier_spec() -> JSON:
    return {
        "type": "object",
        "description": "A tier of policies (resources.calico.Tier).",
        "properties": {
            "order": {"type": "number", "description": "Lower first; none: last."},
            "defaultAction": _string(
                "Deny (default) or Pass: what becomes of traffic no rule of the tier decides.",
                enum=list(get_args(TierAction)),
            ),
        },
    }


def networkset_spec() -> JSON:
    return {
        "type": "object",
        "description": "Networks that rules select by the set's labels.",
        "properties": {"nets": _strings("CIDRs or addresses.", pattern=NET)},
    }


def hostendpoint_spec() -> JSON:
    return {
        "type": "object",
        "description": "One of a node's own interfaces, or all (*) (resources.calico).",
        "required": ["node"],
        "properties": {
            "node": _string("Its node.", maxLength=253),
            "interfaceName": _string("The interface, or * for all.", pattern=INTERFACE),
            "expectedIPs": _strings("Its addresses.", pattern=ADDRESS),
            "profiles": _strings("Profile names (carried)."),
            "ports": {
                "type": "array",
                "items": {
                    "type": "object",
                    "required": ["name", "protocol", "port"],
                    "properties": {
                        "name": _string("The port's name.", maxLength=15),
                        "protocol": _string("TCP, UDP or SCTP.", enum=list(PORT_NAMES_OF)),
                        "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                    },
                },
            },
        },
        "anyOf": [{"required": ["interfaceName"]}, {"required": ["expectedIPs"]}],
    }


_POLICY_COLUMNS = [
    ("Tier", ".spec.tier", "string"),
    ("Order", ".spec.order", "number"),
    ("Selector", ".spec.selector", "string"),
]
_STAGED = ("Staged action", ".spec.stagedAction", "string")

#: store kind -> (spec schema, restricted names, printer columns), as ``crds.SPECS``
CALICO_SPECS = {
    "calico-networkpolicy": (networkpolicy_spec, None, _POLICY_COLUMNS),
    "globalnetworkpolicy": (globalnetworkpolicy_spec, None, _POLICY_COLUMNS),
    "stagednetworkpolicy": (stagednetworkpolicy_spec, None, [*_POLICY_COLUMNS, _STAGED]),
    "stagedglobalnetworkpolicy": (
        stagedglobalnetworkpolicy_spec,
        None,
        [*_POLICY_COLUMNS, _STAGED],
    ),
    "stagedkubernetesnetworkpolicy": (stagedkubernetesnetworkpolicy_spec, None, [_STAGED]),
    "tier": (
        tier_spec,
        None,
        [("Order", ".spec.order", "number"), ("Default action", ".spec.defaultAction", "string")],
    ),
    "networkset": (networkset_spec, None, []),
    "globalnetworkset": (networkset_spec, None, []),
    "hostendpoint": (
        hostendpoint_spec,
        None,
        [("Node", ".spec.node", "string"), ("Interface", ".spec.interfaceName", "string")],
    ),
}
