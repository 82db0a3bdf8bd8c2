"""tabby's kinds as CustomResourceDefinitions (``apiextensions.k8s.io/v1``): the one place
they are written. ``manifests/tabby.yaml`` carries what :func:`definitions` gives (a unit
test compares them); ``python -m stores.kube.crds`` prints them, for pasting there.

Every kind of ``kinds.CRDS`` is of group ``tabby.io``, version ``v1``, cluster-scoped (but
Calico's namespaced kinds: ``kinds.Crd.namespaced``), with a structural schema (Kubernetes
1.20: no CEL rules, so only ``type``, ``pattern``, ``enum``, ``minimum``/``maximum``,
``maxLength``, ``required`` and value validations in ``oneOf``, ``anyOf``, ``allOf`` and
``not``, whose types are declared outside them). The resources an operator writes (IPPool,
Node, BGPConfiguration, BGPPeer, and Calico's policy kinds: ``stores.kube.calico_crds``) are
held to what ``tabbyctl apply`` holds them to (``resources.tabby``'s and
``resources.calico``'s models), so that ``kubectl apply`` of a pool with ``cidr:
10.0.0.0/33`` fails at the API server, naming ``spec.cidr``. What a schema of Kubernetes 1.20
cannot say (docs/kubernetes.md "tabby's kinds as CustomResourceDefinitions"; Calico's kinds:
``stores.kube.calico_crds``):

- an unknown field is dropped by the API server (it prunes), not refused;
- a selector's syntax (``nodeSelector``, ``peerSelector``) is not checked;
- an IPv6 pool CIDR with host bits set is not refused (an IPv4 one is);
- the notations the models turn into the canonical one (a netmask after the slash, a prefix
  length with a leading zero) are refused, not rewritten.

The IPAM state and the policy traces (IPAMBlock, IPAMAffinity, PolicyTrace) are written by
tabby alone: their ``spec`` keeps whatever tabby writes, with the few fields the store reads
declared (a block's ``cidr``, its key, and its ``affinity``; the ``node`` of an affinity and
of a trace).

Patterns are Go regular expressions (RE2) searched in the value, as the API server does: each
is anchored, and uses nothing RE2 and Python's ``re`` read differently.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ipam.core.model import BLOCK_SIZE_LIMITS, DEFAULT_BLOCK_SIZE
from stores.kube.calico_crds import CALICO_SPECS
from stores.kube.kinds import CRDS, GROUP, VERSION

if TYPE_CHECKING:
    from bundle.types import JSON

#: AS numbers, as ``resources.tabby`` bounds them (4-byte ASNs)
AS_NUMBER_MIN, AS_NUMBER_MAX = 1, 4294967295
ENCAP_MODES = ["Never", "Always", "CrossSubnet"]
LOG_SEVERITIES = ["Debug", "Info", "Warning", "Error", "Fatal"]
BACKENDS = ["bird", "vxlan", "none"]

# -- the patterns ------------------------------------------------------------------------------


def _digit_class(digits: set[int]) -> str:
    """One character class for a set of decimal digits (``[0-4]``, ``[048]``, ``7``)."""
    ordered = sorted(digits)
    if len(ordered) == 1:
        return str(ordered[0])
    runs: list[list[int]] = []
    for d in ordered:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    body = "".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else "".join(map(str, r)) for r in runs)
    return f"[{body}]"


def number_set(values: set[int]) -> str:
    """An alternation matching exactly the decimal forms (no leading zero) of ``values``:
    numbers grouped by their last digit's class, and their heads (the number without its
    last digit) the same way."""
    last: dict[int | None, set[int]] = {}  # head (None: a one-digit number) -> last digits
    for v in values:
        last.setdefault(v // 10 if v >= 10 else None, set()).add(v % 10)
    heads: dict[str, set[int | None]] = {}  # last-digit class -> the heads ending in it
    for head, digits in last.items():
        heads.setdefault(_digit_class(digits), set()).add(head)
    parts = []
    for cls, group in sorted(heads.items()):
        numbered = {h for h in group if h is not None}
        if not numbered:
            parts.append(cls)
            continue
        optional = None in group
        inner = number_set(numbered)
        if "|" in inner or (optional and not _atom(inner)):
            inner = f"(?:{inner})"
        parts.append(f"{inner}{'?' if optional else ''}{cls}")
    return "|".join(parts)


def _atom(text: str) -> bool:
    """``text`` is one character or one character class (a quantifier binds to all of it)."""
    return len(text) == 1 or (text[0] == "[" and text.index("]") == len(text) - 1)


def number_range(lo: int, hi: int) -> str:
    """:func:`number_set` of ``lo`` to ``hi``, grouped ``(?:...)``."""
    return f"(?:{number_set(set(range(lo, hi + 1)))})"


OCTET = number_range(0, 255)
IPV4 = rf"{OCTET}(?:\.{OCTET}){{3}}"
_HEX = "[0-9a-fA-F]{1,4}"


def _ipv6() -> str:
    """Every textual form ``ipaddress`` reads as an IPv6 address (RFC 4291 2.2: eight
    groups, ``::`` for a run of at least one zero group, the last two groups as an IPv4
    address), no zone index."""
    forms = [f"{_HEX}(?::{_HEX}){{7}}", f"(?:{_HEX}:){{6}}{IPV4}"]
    for left in range(8):  # groups before "::", with at most 7 - left after it
        head = "" if left == 0 else f"{_HEX}(?::{_HEX}){{{left - 1}}}"
        after = 7 - left
        tail = "" if after == 0 else f"(?:{_HEX}(?::{_HEX}){{0,{after - 1}}})?"
        forms.append(f"{head}::{tail}")
        if left <= 5:  # an IPv4 tail is two groups
            forms.append(f"{head}::(?:{_HEX}:){{0,{5 - left}}}{IPV4}")
    return f"(?:{'|'.join(forms)})"


IPV6 = _ipv6()
V4_PREFIX = number_range(0, 32)
V6_PREFIX = number_range(0, 128)


def _v4_network() -> str:
    """An IPv4 network: the address's bits past the prefix length all zero (``strict``)."""
    alternatives = [r"0\.0\.0\.0/0"]
    for octet in range(4):  # the octet where the prefix ends
        rest = rf"(?:\.0){{{3 - octet}}}" if octet < 3 else ""
        ends = []
        for bits in range(1, 9):  # prefix bits in that octet
            step = 1 << (8 - bits)
            values = number_set(set(range(0, 256, step)))
            ends.append(f"(?:{values}){rest}/{8 * octet + bits}")
        head = f"(?:{OCTET}\\.){{{octet}}}" if octet else ""
        alternatives.append(f"{head}(?:{'|'.join(ends)})")
    return f"(?:{'|'.join(alternatives)})"


V4_NETWORK = _v4_network()


def anchored(pattern: str) -> str:
    return f"^(?:{pattern})$"


def suffix_not(lo: int, hi: int) -> str:
    """A pattern matching a CIDR whose text after its last slash is anything but a prefix
    length from ``lo`` to ``hi`` (the whole text, when it has no slash)."""
    others = number_set(set(range(lo)) | set(range(hi + 1, 1000)))
    return rf"/(?:{others}|[1-9][0-9]{{3,}}|0[0-9]+)?$|/[^/]*[^0-9/][^/]*$|^[^/]*$"


#: A pool CIDR's checks, each with a message of its own (the API server quotes the pattern
#: that failed): the prefix length, the IPv6 address, the IPv4 network.
CIDR_PREFIX = rf"^[0-9.]+/{V4_PREFIX}$|^[0-9a-fA-F.:]*:[0-9a-fA-F.:]*/{V6_PREFIX}$"
V6_CIDR_ADDRESS = rf"^[^:]*$|^{IPV6}/"  # (no colon: not IPv6, the next check's)
#: a valid IPv4 address without host bits (or not IPv4, or a prefix length refused above)
V4_CIDR_NETWORK = rf"^{V4_NETWORK}$|:|{suffix_not(0, 32)}"
NOT_IPV4 = ":"
NOT_IPV6 = "^[^:]*$"

MAC = r"^[0-9a-fA-F]{2}(?::[0-9a-fA-F]{2}){5}$"
#: a DNS-1123 subdomain (``resources.names.dns1123_subdomain``), at most 253 characters
SUBDOMAIN_LABEL = "[a-z0-9](?:[-a-z0-9]*[a-z0-9])?"
SUBDOMAIN = rf"^{SUBDOMAIN_LABEL}(?:\.{SUBDOMAIN_LABEL})*$"


# -- schemas -----------------------------------------------------------------------------------


def _string(description: str, **checks: object) -> JSON:
    return {"type": "string", "description": description, **checks}


def _ipv4(description: str) -> JSON:
    return _string(description, pattern=anchored(IPV4))


def _ipv6_address(description: str) -> JSON:
    return _string(description, pattern=anchored(IPV6))


def _as_number(description: str) -> JSON:
    return {
        "type": "integer",
        "description": description,
        "minimum": AS_NUMBER_MIN,
        "maximum": AS_NUMBER_MAX,
    }


def _forbidden() -> JSON:
    """In a junctor: the field may not be there (whatever its value)."""
    return {"not": {}}


def _absent(field: str) -> JSON:
    return {"not": {"required": [field]}}


def _pool_rules() -> list[JSON]:
    """The rules of an IPPool spec that tie its fields, each an implication "if the CIDR is
    of this kind, then this" (``anyOf``: the rule, or the CIDR not of this kind): a block
    size of the pool's family, no IP-in-IP on IPv6, and no pool smaller than one block (a
    pool of prefix length P needs blocks of at least P, the default size included).

    Implications, not a ``oneOf`` over the two families: when no branch of a ``oneOf``
    holds, the API server reports the errors of the first one (the IPv4 branch, for an
    IPv6 pool too), where an implication reports its own rule."""
    rules: list[JSON] = []
    for version, other in ((4, NOT_IPV4), (6, NOT_IPV6)):
        lo, hi = BLOCK_SIZE_LIMITS[version]
        family: JSON = {"blockSize": {"minimum": lo, "maximum": hi}}
        if version == 6:
            family["ipipMode"] = {"enum": ["Never"]}  # no IP-in-IP for IPv6
        rules.append(
            {"anyOf": [{"properties": family}, {"properties": {"cidr": {"pattern": other}}}]}
        )
        for prefix in range(lo + 1, hi + 1):
            size: JSON = {"properties": {"blockSize": {"minimum": prefix}}}
            if prefix > DEFAULT_BLOCK_SIZE[version]:
                size["required"] = ["blockSize"]  # the default size is too small
            elsewhere = {
                "properties": {"cidr": {"pattern": f"{other}|{suffix_not(prefix, prefix)}"}}
            }
            rules.append({"anyOf": [size, elsewhere]})
    # IP-in-IP and VXLAN cannot both be enabled (named: vxlanMode, as the model does)
    never = {"enum": ["Never"]}
    rules.append(
        {"anyOf": [{"properties": {"vxlanMode": never}}, {"properties": {"ipipMode": never}}]}
    )
    return rules


def ippool_spec() -> JSON:
    return {
        "type": "object",
        "description": "An address pool, cut into blocks affine to nodes (resources.tabby.IPPool).",
        "required": ["cidr"],
        "properties": {
            "cidr": _string(
                "The pool, as a CIDR without host bits (10.244.0.0/16, fd00:10:244::/48).",
                pattern=CIDR_PREFIX,
                maxLength=49,
                allOf=[{"pattern": V6_CIDR_ADDRESS}, {"pattern": V4_CIDR_NETWORK}],
            ),
            "blockSize": {
                "type": "integer",
                "description": "Prefix length of its blocks: 20-32 for IPv4 (default 26), "
                "116-128 for IPv6 (default 122); at least the pool's own.",
                "minimum": BLOCK_SIZE_LIMITS[4][0],
                "maximum": BLOCK_SIZE_LIMITS[6][1],
            },
            "ipipMode": _string("IP-in-IP: Never, Always or CrossSubnet.", enum=ENCAP_MODES),
            "vxlanMode": _string("VXLAN: Never, Always or CrossSubnet.", enum=ENCAP_MODES),
            "natOutgoing": {"type": "boolean", "description": "Masquerade traffic leaving it."},
            "disabled": {"type": "boolean", "description": "No new blocks are cut from it."},
            "nodeSelector": _string("The nodes that take blocks from it (default all())."),
        },
        "allOf": _pool_rules(),
    }


def node_spec() -> JSON:
    v4_interface = rf"^{IPV4}/{V4_PREFIX}$"
    v6_interface = rf"^{IPV6}/{V6_PREFIX}$"
    return {
        "type": "object",
        "description": "tabby's per-node data (resources.tabby.Node); its labels are the v1 "
        "Node's.",
        "properties": {
            "bgp": {
                "type": "object",
                "properties": {
                    "asNumber": _as_number("The node's AS (default: the BGPConfiguration's)."),
                    "routeReflectorClusterID": _ipv4(
                        "Set: the node is a route reflector with this cluster id."
                    ),
                    "ipv4IPIPTunnelAddr": _ipv4("tunl0's address (set by tabby-node)."),
                },
            },
            "backend": _string("How it reaches other nodes' pods.", enum=BACKENDS),
            "ipv4Address": _string(
                "The underlay IPv4 address with its prefix length (192.168.1.5/24).",
                pattern=v4_interface,
            ),
            "ipv6Address": _string(
                "The underlay IPv6 address with its prefix length.", pattern=v6_interface
            ),
            "ipv4VXLANTunnelAddr": _ipv4("vxlan.tabby's IPv4 address."),
            "ipv6VXLANTunnelAddr": _ipv6_address("vxlan-v6.tabby's IPv6 address."),
            "vxlanTunnelMACAddr": _string("vxlan.tabby's MAC.", pattern=MAC),
            "vxlanTunnelMACAddrV6": _string("vxlan-v6.tabby's MAC.", pattern=MAC),
        },
    }


def bgpconfiguration_spec() -> JSON:
    return {
        "type": "object",
        "description": "The cluster's BGP settings (one, named default).",
        "properties": {
            "asNumber": _as_number("The nodes' AS (default 64512)."),
            "nodeToNodeMeshEnabled": {"type": "boolean", "description": "Full mesh (default)."},
            "logSeverityScreen": _string("BIRD's log level.", enum=LOG_SEVERITIES),
        },
    }


def bgppeer_spec() -> JSON:
    return {
        "type": "object",
        "description": "Who peers (node or nodeSelector; unset: every node) with whom (peerIP "
        "and asNumber, or the nodes peerSelector selects).",
        "properties": {
            "node": _string("One node.", pattern=SUBDOMAIN, maxLength=253),
            "nodeSelector": _string("The nodes that peer."),
            "peerIP": _string("A router's address.", pattern=anchored(f"{IPV4}|{IPV6}")),
            "asNumber": _as_number("The router's AS."),
            "peerSelector": _string("The nodes peered with, at their own AS."),
        },
        # the model's rules, each an implication that names the field the model names
        "allOf": [
            {"anyOf": [{"properties": {"nodeSelector": _forbidden()}}, _absent("node")]},
            {"anyOf": [{"properties": {"peerIP": _forbidden()}}, _absent("peerSelector")]},
            {"anyOf": [{"properties": {"asNumber": _forbidden()}}, _absent("peerSelector")]},
            {"anyOf": [{"required": ["peerIP"]}, {"required": ["peerSelector"]}]},
            {"anyOf": [{"required": ["asNumber"]}, {"required": ["peerSelector"]}]},
        ],
    }


def _kept(description: str, properties: JSON, required: list[str] | None = None) -> JSON:
    """A spec tabby alone writes: kept as written, with the fields the store reads."""
    spec: JSON = {
        "type": "object",
        "description": description,
        "x-kubernetes-preserve-unknown-fields": True,
        "properties": properties,
    }
    if required:
        spec["required"] = required
    return spec


def ipamblock_spec() -> JSON:
    return _kept(
        "One block of a pool and its allocations (ipam.core.block), written by tabby.",
        {
            "cidr": _string(
                "The block (its key).",
                pattern=anchored(f"{IPV4}/{V4_PREFIX}|{IPV6}/{V6_PREFIX}"),
            ),
            "affinity": {
                "type": "string",
                "nullable": True,
                "description": "host:<node>, or null: no node's",
            },
        },
        ["cidr"],
    )


def ipamaffinity_spec() -> JSON:
    return _kept(
        "A node's IPAM index: its blocks and those it borrowed from, written by tabby.",
        {"node": _string("The node (the object's name).")},
    )


def policytrace_spec() -> JSON:
    return _kept(
        "A policy trace request or a node's answer (resources.trace), written by tabby.",
        {"node": _string("The node that traces.")},
    )


def _metadata(names: list[str] | None = None) -> JSON:
    meta: JSON = {"type": "object"}
    if names:
        meta["properties"] = {"name": {"type": "string", "enum": names}}
    return meta


#: store kind -> (spec schema, restricted names, printer columns (name, JSON path, type))
SPECS = {
    "pool": (ippool_spec, None, [("CIDR", ".spec.cidr", "string"),
                                 ("Block size", ".spec.blockSize", "integer"),
                                 ("Disabled", ".spec.disabled", "boolean")]),
    "block": (ipamblock_spec, None, [("CIDR", ".spec.cidr", "string"),
                                     ("Affinity", ".spec.affinity", "string")]),
    "affinity": (ipamaffinity_spec, None, []),
    "node": (node_spec, None, [("Backend", ".spec.backend", "string"),
                               ("IPv4", ".spec.ipv4Address", "string"),
                               ("IPv6", ".spec.ipv6Address", "string")]),
    "bgpconfiguration": (bgpconfiguration_spec, ["default"],
                         [("AS", ".spec.asNumber", "integer"),
                          ("Mesh", ".spec.nodeToNodeMeshEnabled", "boolean")]),
    "bgppeer": (bgppeer_spec, None, [("Peer IP", ".spec.peerIP", "string"),
                                     ("AS", ".spec.asNumber", "integer"),
                                     ("Node", ".spec.node", "string"),
                                     ("Peer selector", ".spec.peerSelector", "string")]),
    "trace": (policytrace_spec, None, [("Node", ".spec.node", "string")]),
    **CALICO_SPECS,
}  # fmt: skip


def schema(kind: str) -> JSON:
    """The ``openAPIV3Schema`` of store kind ``kind``."""
    spec, names, _columns = SPECS[kind]
    return {
        "type": "object",
        "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"},
            "kind": {"type": "string"},
            "metadata": _metadata(names),
            "spec": spec(),
        },
    }


def definition(kind: str) -> JSON:
    """The CustomResourceDefinition of store kind ``kind``."""
    crd = CRDS[kind]
    _spec, _names, columns = SPECS[kind]
    version: JSON = {
        "name": VERSION,
        "served": True,
        "storage": True,
        "schema": {"openAPIV3Schema": schema(kind)},
    }
    if columns:
        version["additionalPrinterColumns"] = [
            *({"name": n, "type": t, "jsonPath": p} for n, p, t in columns),
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ]
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": crd.name, "labels": {"app.kubernetes.io/part-of": "tabby"}},
        "spec": {
            "group": GROUP,
            "scope": "Namespaced" if crd.namespaced else "Cluster",
            "names": {
                "kind": crd.kind,
                "listKind": f"{crd.kind}List",
                "plural": crd.plural,
                "singular": crd.kind.lower(),
                "categories": ["tabby"],
            },
            "versions": [version],
        },
    }


def definitions() -> list[JSON]:
    """Every kind's CustomResourceDefinition, in ``kinds.CRDS``'s order."""
    return [definition(kind) for kind in CRDS]


HEADER = (
    "# tabby's kinds as CustomResourceDefinitions: generated by `python -m stores.kube.crds`\n"
    "# (stores/kube/crds.py), do not edit here.\n"
)
FOOTER = "# (the end of the generated CustomResourceDefinitions)\n"


def render() -> str:
    """The definitions as YAML documents (what manifests/tabby.yaml carries)."""
    import yaml

    class Dumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True  # every value written out where it is (no &anchors)

    docs = [yaml.dump(d, Dumper=Dumper, sort_keys=False, width=100) for d in definitions()]
    return HEADER + "".join(f"---\n{doc}" for doc in docs) + FOOTER


if __name__ == "__main__":
    print(render(), end="")
