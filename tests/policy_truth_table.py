"""The NetworkPolicy truth table: cases of the Kubernetes e2e suite (``[sig-network] Netpol``).

Setup as in the e2e suite: namespaces x, y, z (label ``ns=<name>``, plus the automatic
``kubernetes.io/metadata.name``), pods a, b, c in each (label ``pod=<name>``), every pod
serving TCP, UDP and SCTP on 80 and 81 with the named container ports ``serve-80-tcp``,
``serve-81-udp``, ... Policies live in namespace x unless said otherwise.

Each case is a sequence of steps (a policy set, maybe label changes) with the expected
reachability: ``expect(src, dst, protocol, port)`` for pods written ``"x/a"``. Shared by the
engine's unit tests and the kernel tier (tests/privileged/test_policy_nft.py).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

from policy.engine import (
    ClusterState,
    ContainerPort,
    Endpoint,
    IPBlock,
    LabelSelector,
    Namespace,
    Peer,
    Pod,
    Policy,
    PortSpec,
    Requirement,
    Rule,
)

NAMESPACES = ("x", "y", "z")
POD_NAMES = ("a", "b", "c")
PODS = tuple(f"{ns}/{p}" for ns in NAMESPACES for p in POD_NAMES)
PORTS = (80, 81)
PROTOCOLS = ("TCP", "UDP", "SCTP")
NAMED_PORTS = tuple(
    ContainerPort(f"serve-{port}-{proto.lower()}", port, proto)  # type: ignore[arg-type]
    for port in PORTS
    for proto in PROTOCOLS
)


def address(pod: str) -> str:
    ns, name = pod.split("/")
    return f"10.244.{NAMESPACES.index(ns) + 1}.{POD_NAMES.index(name) + 10}"


def default_iface(pod: str) -> str:
    return "cali" + pod.replace("/", "")


Expect = Callable[[str, str, str, int], bool]


@dataclasses.dataclass(frozen=True)
class Step:
    policies: tuple[Policy, ...]
    expect: Expect
    ns_labels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    pod_labels: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Case:
    number: int | str
    name: str
    steps: tuple[Step, ...]

    @property
    def id(self) -> str:
        num = f"{self.number:02d}" if isinstance(self.number, int) else self.number
        words = "".join(c if c.isalnum() else "-" for c in self.name.lower()).split("-")
        return f"{num}-" + "-".join(w for w in words if w)


def build_state(
    step: Step,
    iface: Callable[[str], str] = default_iface,
    node_of: Callable[[str], str] = lambda pod: "node1",
) -> ClusterState:
    namespaces = tuple(
        Namespace(ns, tuple({"ns": ns, **step.ns_labels.get(ns, {})}.items())) for ns in NAMESPACES
    )
    pods = []
    endpoints = []
    for pod in PODS:
        ns, name = pod.split("/")
        labels = {"pod": name, **step.pod_labels.get(pod, {})}
        pods.append(Pod(ns, name, tuple(labels.items()), NAMED_PORTS))
        endpoints.append(
            Endpoint(ns, name, node_of(pod), iface(pod), (f"{address(pod)}/32",), f"{name}-eth0")
        )
    return ClusterState(step.policies, namespaces, tuple(pods), tuple(endpoints))


# --- policy builders ---------------------------------------------------------------------------


def sel(**labels: str) -> LabelSelector:
    return LabelSelector.of(labels)


def expr(key: str, op: str, *values: str) -> LabelSelector:
    return LabelSelector((), (Requirement(key, op, values),))  # type: ignore[arg-type]


ALL = LabelSelector()


def pol(
    name: str,
    selector: LabelSelector = ALL,
    *,
    ingress: tuple[Rule, ...] = (),
    egress: tuple[Rule, ...] = (),
    types: tuple[str, ...] = (),
    ns: str = "x",
) -> Policy:
    return Policy(ns, name, selector, ingress, egress, types)  # type: ignore[arg-type]


def rule(*peers: Peer, ports: tuple[PortSpec, ...] = ()) -> Rule:
    return Rule(peers, ports)


def peer(pods: LabelSelector | None = None, nss: LabelSelector | None = None) -> Peer:
    return Peer(pods, nss)


def block(cidr: str, *excepts: str) -> Peer:
    return Peer(ip_block=IPBlock(cidr, excepts))


def tcp(port: int | str | None = None, end: int | None = None) -> PortSpec:
    return PortSpec("TCP", port, end)


def udp(port: int | str | None = None) -> PortSpec:
    return PortSpec("UDP", port)


def sctp(port: int | str | None = None) -> PortSpec:
    return PortSpec("SCTP", port)


def ns_of(pod: str) -> str:
    return pod.split("/")[0]


def in_x(pod: str) -> bool:
    return ns_of(pod) == "x"


def everything(s: str, d: str, proto: str, port: int) -> bool:
    return True


DENY_INGRESS = pol("default-deny-ingress", types=("Ingress",))
DENY_ALL = pol("default-deny-all", types=("Ingress", "Egress"))
A = sel(pod="a")
CASES: list[Case] = []


def case(number: int | str, name: str, *steps: Step) -> None:
    CASES.append(Case(number, name, steps))


case(
    1,
    "should support a default-deny-ingress policy",
    Step((DENY_INGRESS,), lambda s, d, pr, po: not in_x(d)),
)
case(
    2,
    "should support a default-deny-all policy",
    Step((DENY_ALL,), lambda s, d, pr, po: not in_x(d) and not in_x(s)),
)
case(
    3,
    "should enforce policy to allow traffic from pods within server namespace based on PodSelector",
    Step(
        (pol("x-a-from-b", A, ingress=(rule(peer(sel(pod="b"))),)),),
        lambda s, d, pr, po: d != "x/a" or s == "x/b",
    ),
)
case(
    4,
    "should enforce policy based on PodSelector with MatchExpressions",
    Step(
        (pol("x-a-from-b", A, ingress=(rule(peer(expr("pod", "In", "b"))),)),),
        lambda s, d, pr, po: d != "x/a" or s == "x/b",
    ),
)
case(
    5,
    "should enforce policy to allow ingress traffic for a target",
    Step(
        (DENY_INGRESS, pol("allow-a", A, ingress=(rule(peer(ALL, ALL)),))),
        lambda s, d, pr, po: not in_x(d) or d == "x/a",
    ),
)
case(
    6,
    "should enforce policy to allow ingress traffic from pods in all namespaces",
    Step((pol("x-a-all-ns", A, ingress=(rule(peer(None, ALL)),)),), everything),
)
case(
    7,
    "should enforce policy to allow traffic only from a different namespace, based on "
    "NamespaceSelector",
    Step(
        (pol("x-a-from-y", A, ingress=(rule(peer(None, sel(ns="y"))),)),),
        lambda s, d, pr, po: d != "x/a" or ns_of(s) == "y",
    ),
)
case(
    8,
    "should enforce policy based on NamespaceSelector with MatchExpressions",
    Step(
        (pol("x-a-from-y", A, ingress=(rule(peer(None, expr("ns", "In", "y"))),)),),
        lambda s, d, pr, po: d != "x/a" or ns_of(s) == "y",
    ),
)
case(
    9,
    "should enforce policy based on PodSelector or NamespaceSelector",
    Step(
        (
            pol(
                "x-a-or",
                A,
                ingress=(rule(peer(None, expr("ns", "NotIn", "x")), peer(sel(pod="b"))),),
            ),
        ),
        lambda s, d, pr, po: d != "x/a" or s != "x/c",
    ),
)
case(
    10,
    "should enforce policy based on PodSelector and NamespaceSelector",
    Step(
        (pol("x-a-and", A, ingress=(rule(peer(sel(pod="b"), expr("ns", "NotIn", "x"))),)),),
        lambda s, d, pr, po: d != "x/a" or s in ("y/b", "z/b"),
    ),
)
case(
    11,
    "should enforce policy based on Multiple PodSelectors and NamespaceSelectors",
    Step(
        (
            pol(
                "x-a-multi",
                A,
                ingress=(rule(peer(expr("pod", "In", "b", "c"), expr("ns", "NotIn", "x"))),),
            ),
        ),
        lambda s, d, pr, po: d != "x/a" or s in ("y/b", "y/c", "z/b", "z/c"),
    ),
)
case(
    12,
    "should enforce policy based on any PodSelectors",
    Step(
        (pol("x-a-any", A, ingress=(rule(peer(sel(pod="b")), peer(sel(pod="c"))),)),),
        lambda s, d, pr, po: d != "x/a" or s in ("x/b", "x/c"),
    ),
)
case(
    13,
    "should enforce policy to allow traffic only from a pod in a different namespace based on "
    "PodSelector and NamespaceSelector",
    Step(
        (pol("x-a-from-ya", A, ingress=(rule(peer(sel(pod="a"), sel(ns="y"))),)),),
        lambda s, d, pr, po: d != "x/a" or s == "y/a",
    ),
)
FROM_Y_81 = pol("x-a-y-81", A, ingress=(rule(peer(None, sel(ns="y")), ports=(tcp(81),)),))
FROM_Y_80 = pol("x-a-y-80", A, ingress=(rule(peer(None, sel(ns="y")), ports=(tcp(80),)),))
case(
    14,
    "should enforce policy based on Ports",
    Step(
        (FROM_Y_81,),
        lambda s, d, pr, po: d != "x/a" or (ns_of(s) == "y" and pr == "TCP" and po == 81),
    ),
)
case(
    15,
    "should enforce multiple, stacked policies with overlapping podSelectors",
    Step(
        (FROM_Y_81,),
        lambda s, d, pr, po: d != "x/a" or (ns_of(s) == "y" and pr == "TCP" and po == 81),
    ),
    Step(
        (FROM_Y_81, FROM_Y_80),
        lambda s, d, pr, po: d != "x/a" or (ns_of(s) == "y" and pr == "TCP"),
    ),
)
ALLOW_ALL = pol("allow-all", ingress=(rule(),))
case(16, "should support allow-all policy", Step((ALLOW_ALL,), everything))
case(
    17,
    "should allow ingress access on one named port",
    Step(
        (pol("allow-81-named", ingress=(rule(ports=(tcp("serve-81-tcp"),)),)),),
        lambda s, d, pr, po: not in_x(d) or (pr == "TCP" and po == 81),
    ),
)
case(
    18,
    "should allow ingress access from namespace on one named port",
    Step(
        (
            pol(
                "x-a-y-named-80",
                A,
                ingress=(rule(peer(None, sel(ns="y")), ports=(tcp("serve-80-tcp"),)),),
            ),
        ),
        lambda s, d, pr, po: d != "x/a" or (ns_of(s) == "y" and pr == "TCP" and po == 80),
    ),
)
case(
    19,
    "should allow egress access on one named port",
    Step(
        (pol("egress-80-named", egress=(rule(ports=(tcp("serve-80-tcp"),)),), types=("Egress",)),),
        lambda s, d, pr, po: not in_x(s) or (pr == "TCP" and po == 80),
    ),
)
case(
    20,
    "should enforce updated policy",
    Step((pol("update-me", ingress=(rule(),)),), everything),
    Step((pol("update-me"),), lambda s, d, pr, po: not in_x(d)),
)
UPDATED_NS = pol("x-a-updated-ns", A, ingress=(rule(peer(None, sel(ns2="updated"))),))
case(
    21,
    "should allow ingress access from updated namespace",
    Step((UPDATED_NS,), lambda s, d, pr, po: d != "x/a"),
    Step(
        (UPDATED_NS,),
        lambda s, d, pr, po: d != "x/a" or ns_of(s) == "y",
        ns_labels={"y": {"ns2": "updated"}},
    ),
)
UPDATED_POD = pol("x-a-updated-pod", A, ingress=(rule(peer(sel(pod="b", pod2="updated"))),))
case(
    22,
    "should allow ingress access from updated pod",
    Step((UPDATED_POD,), lambda s, d, pr, po: d != "x/a"),
    Step(
        (UPDATED_POD,),
        lambda s, d, pr, po: d != "x/a" or s == "x/b",
        pod_labels={"x/b": {"pod2": "updated"}},
    ),
)
case(
    23,
    "should deny ingress from pods on other namespaces",
    Step(
        (pol("same-ns-only", ingress=(rule(peer(ALL)),)),),
        lambda s, d, pr, po: not in_x(d) or in_x(s),
    ),
)
ISOLATED = pol("isolate-target", sel(target="isolated"), types=("Ingress",))
case(
    24,
    "should deny ingress access to updated pod",
    Step((ISOLATED,), everything),
    Step(
        (ISOLATED,),
        lambda s, d, pr, po: d != "x/a",
        pod_labels={"x/a": {"target": "isolated"}},
    ),
)
case(
    25,
    "should deny egress from pods based on PodSelector",
    Step((pol("deny-egress-a", A, types=("Egress",)),), lambda s, d, pr, po: s != "x/a"),
)
case(
    26,
    "should deny egress from all pods in a namespace",
    Step((pol("deny-egress-all", types=("Egress",)),), lambda s, d, pr, po: not in_x(s)),
)
case(
    27,
    "should work with Ingress, Egress specified together",
    Step(
        (
            pol(
                "a-in-b-out-80",
                A,
                ingress=(rule(peer(sel(pod="b"))),),
                egress=(rule(ports=(tcp(80),)),),
            ),
        ),
        lambda s, d, pr, po: (
            (d != "x/a" or s == "x/b") and (s != "x/a" or (pr == "TCP" and po == 80))
        ),
    ),
)
TO_YA = rule(peer(sel(pod="a"), sel(ns="y")))
case(
    28,
    "should support denying of egress traffic on the client side (even if the server explicitly "
    "allows this traffic)",
    Step(
        (
            pol("x-a-to-ya", A, egress=(TO_YA,), types=("Egress",)),
            pol("y-a-from-xa", A, ingress=(rule(peer(sel(pod="a"), sel(ns="x"))),), ns="y"),
        ),
        lambda s, d, pr, po: (s != "x/a" or d == "y/a") and (d != "y/a" or s == "x/a"),
    ),
)
case(
    29,
    "should enforce egress policy allowing traffic to a server in a different namespace based "
    "on PodSelector and NamespaceSelector",
    Step(
        (pol("x-a-to-ya", A, egress=(TO_YA,), types=("Egress",)),),
        lambda s, d, pr, po: s != "x/a" or d == "y/a",
    ),
)
case(
    30,
    "should enforce ingress policy allowing any port traffic to a server on a specific protocol",
    Step(
        (pol("x-a-tcp", A, ingress=(rule(ports=(tcp(),)),)),),
        lambda s, d, pr, po: d != "x/a" or pr == "TCP",
    ),
)
ONLY_80 = pol("only-80", ingress=(rule(ports=(tcp(80),)),))
case(
    31,
    "should enforce multiple ingress policies with ingress allow-all policy taking precedence",
    Step((ONLY_80,), lambda s, d, pr, po: not in_x(d) or (pr == "TCP" and po == 80)),
    Step((ONLY_80, pol("allow-all-in", ingress=(rule(),))), everything),
)
ONLY_80_OUT = pol("only-80-out", egress=(rule(ports=(tcp(80),)),), types=("Egress",))
case(
    32,
    "should enforce multiple egress policies with egress allow-all policy taking precedence",
    Step((ONLY_80_OUT,), lambda s, d, pr, po: not in_x(s) or (pr == "TCP" and po == 80)),
    Step(
        (ONLY_80_OUT, pol("allow-all-out", egress=(rule(),), types=("Egress",))),
        everything,
    ),
)
case(
    33,
    "should stop enforcing policies after they are deleted",
    Step((DENY_ALL,), lambda s, d, pr, po: not in_x(d) and not in_x(s)),
    Step((), everything),
)
case(
    34,
    "should allow egress access to server in CIDR block",
    Step(
        (pol("x-a-to-yb", A, egress=(rule(block(address("y/b") + "/32")),), types=("Egress",)),),
        lambda s, d, pr, po: s != "x/a" or d == "y/b",
    ),
)
EXCEPT_XB = pol(
    "x-a-except-xb",
    A,
    egress=(rule(block(address("x/b") + "/4", address("x/b") + "/32")),),
    types=("Egress",),
)
ONLY_XB = pol("x-a-to-xb", A, egress=(rule(block(address("x/b") + "/32")),), types=("Egress",))
case(
    35,
    "should enforce except clause while egress access to server in CIDR block",
    Step((EXCEPT_XB,), lambda s, d, pr, po: not (s == "x/a" and d == "x/b")),
)
case(
    36,
    "should ensure an IP overlapping both IPBlock.CIDR and IPBlock.Except is allowed",
    Step((EXCEPT_XB,), lambda s, d, pr, po: not (s == "x/a" and d == "x/b")),
    Step((EXCEPT_XB, ONLY_XB), everything),
    Step((ONLY_XB,), lambda s, d, pr, po: s != "x/a" or d == "x/b"),
)
A_OUT_ALL = pol("x-a-out-all", A, egress=(rule(),), types=("Egress",))
case(
    37,
    "should enforce policies to check ingress and egress policies can be controlled "
    "independently based on PodSelector",
    Step((A_OUT_ALL,), everything),
    Step(
        (A_OUT_ALL, pol("x-a-in-none", A, types=("Ingress",))),
        lambda s, d, pr, po: d != "x/a",
    ),
)
case(
    38,
    "should not mistakenly treat 'protocol: SCTP' as 'protocol: TCP'",
    Step(
        (DENY_INGRESS, pol("x-a-sctp-81", A, ingress=(rule(ports=(sctp(81),)),))),
        lambda s, d, pr, po: not in_x(d) or (d == "x/a" and pr == "SCTP" and po == 81),
    ),
)
case(
    39,
    "should properly isolate pods that are selected by a policy allowing SCTP",
    Step(
        (pol("x-a-sctp-80", A, ingress=(rule(ports=(sctp(80),)),)),),
        lambda s, d, pr, po: d != "x/a" or (pr == "SCTP" and po == 80),
    ),
)
case(
    40,
    "should not allow access by TCP when a policy specifies only UDP",
    Step(
        (pol("x-a-udp-81", A, ingress=(rule(ports=(udp(81),)),)),),
        lambda s, d, pr, po: d != "x/a" or (pr == "UDP" and po == 81),
    ),
)
case(
    "d1",
    "derived: endPort range 80-81 on TCP",
    Step(
        (pol("x-a-80-81", A, ingress=(rule(ports=(tcp(80, 81),)),)),),
        lambda s, d, pr, po: d != "x/a" or pr == "TCP",
    ),
)
case(
    "d2",
    "derived: a port without protocol is TCP",
    Step(
        (pol("x-a-81", A, ingress=(rule(ports=(PortSpec(port=81),)),)),),
        lambda s, d, pr, po: d != "x/a" or (pr == "TCP" and po == 81),
    ),
)
case(
    "d3",
    "derived: egress on a named UDP port",
    Step(
        (
            pol(
                "x-a-out-udp-81", A, egress=(rule(ports=(udp("serve-81-udp"),)),), types=("Egress",)
            ),
        ),
        lambda s, d, pr, po: s != "x/a" or (pr == "UDP" and po == 81),
    ),
)
case(
    "d4",
    "derived: a named port with the wrong protocol matches nothing",
    Step(
        (pol("x-a-udp-named-tcp", A, ingress=(rule(ports=(udp("serve-80-tcp"),)),)),),
        lambda s, d, pr, po: d != "x/a",
    ),
)
case(
    "d5",
    "derived: egress without policyTypes isolates ingress too",
    Step(
        (pol("x-a-both", A, egress=(rule(ports=(tcp(80),)),)),),
        lambda s, d, pr, po: d != "x/a" and (s != "x/a" or (pr == "TCP" and po == 80)),
    ),
)
case(
    "d6",
    "derived: ipBlock except with another peer allowing the excepted address",
    Step(
        (
            pol(
                "x-a-ipblock-or-pod",
                A,
                egress=(rule(block(address("x/b") + "/24", address("x/b") + "/32"), peer(ALL)),),
                types=("Egress",),
            ),
        ),
        lambda s, d, pr, po: s != "x/a" or ns_of(d) == "x",
    ),
)


def matrix(expect: Expect) -> dict[tuple[str, str, str, int], bool]:
    return {
        (s, d, pr, po): expect(s, d, pr, po)
        for s in PODS
        for d in PODS
        if s != d
        for pr in PROTOCOLS
        for po in PORTS
    }


# --- the same cases as resources (networking.k8s.io/v1 NetworkPolicy, v1 Namespace and Pod) ---
#
# The cluster tier applies the truth table with ``tabbyctl apply``: the engine's policies
# become the documents a user would write, the step's labels Namespace and Pod documents.
# ``tabbyctl apply`` merges into what is stored (maps key by key, ``null`` removes a key, lists
# replace), so :func:`replacing` turns a document into one that also clears the fields an
# earlier version of the same policy set.

Doc = dict[str, object]


def _selector_doc(s: LabelSelector) -> Doc:
    out: Doc = {}
    if s.match_labels:
        out["matchLabels"] = dict(s.match_labels)
    if s.match_expressions:
        out["matchExpressions"] = [
            {
                "key": r.key,
                "operator": r.operator,
                **({"values": list(r.values)} if r.values else {}),
            }
            for r in s.match_expressions
        ]
    return out


def _peer_doc(p: Peer) -> Doc:
    if p.ip_block is not None:
        block: Doc = {"cidr": p.ip_block.cidr}
        if p.ip_block.except_:
            block["except"] = list(p.ip_block.except_)
        return {"ipBlock": block}
    out: Doc = {}
    if p.pod_selector is not None:
        out["podSelector"] = _selector_doc(p.pod_selector)
    if p.namespace_selector is not None:
        out["namespaceSelector"] = _selector_doc(p.namespace_selector)
    return out


def _port_doc(p: PortSpec) -> Doc:
    out: Doc = {"protocol": p.protocol}
    if p.port is not None:
        out["port"] = p.port
    if p.end_port is not None:
        out["endPort"] = p.end_port
    return out


def _rule_doc(r: Rule, peers_key: str) -> Doc:
    out: Doc = {}
    if r.peers:
        out[peers_key] = [_peer_doc(p) for p in r.peers]
    if r.ports:
        out["ports"] = [_port_doc(p) for p in r.ports]
    return out


def network_policy(p: Policy) -> Doc:
    """The ``networking.k8s.io/v1`` NetworkPolicy a user would write for ``p`` (no
    ``policyTypes`` when the engine policy leaves them to the API server's default)."""
    spec: Doc = {"podSelector": _selector_doc(p.pod_selector)}
    if p.ingress:
        spec["ingress"] = [_rule_doc(r, "from") for r in p.ingress]
    if p.egress:
        spec["egress"] = [_rule_doc(r, "to") for r in p.egress]
    if p.policy_types:
        spec["policyTypes"] = list(p.policy_types)
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": p.name, "namespace": p.namespace},
        "spec": spec,
    }


def replacing(doc: Doc) -> Doc:
    """``doc`` with ``null`` for every spec field it leaves out, so that applying it over an
    earlier version of the policy leaves no field of that version behind."""
    spec = dict(doc["spec"])  # type: ignore[call-overload]
    selector = dict(spec.get("podSelector") or {})
    for key in ("matchLabels", "matchExpressions"):
        selector.setdefault(key, None)
    spec["podSelector"] = selector
    for key in ("ingress", "egress", "policyTypes"):
        spec.setdefault(key, None)
    return {**doc, "spec": spec}


def namespace_labels(step: Step, ns: str) -> dict[str, str]:
    return {"ns": ns, **step.ns_labels.get(ns, {})}


def pod_labels(step: Step, pod: str) -> dict[str, str]:
    return {"pod": pod.split("/")[1], **step.pod_labels.get(pod, {})}


def namespace_doc(ns: str, labels: Mapping[str, str | None]) -> Doc:
    """A Namespace document (a ``None`` label value removes that label)."""
    return {
        "apiVersion": "v1",
        "kind": "Namespace",
        "metadata": {"name": ns, "labels": dict(labels)},
    }


def pod_doc(pod: str, labels: Mapping[str, str | None], *, ports: bool = True) -> Doc:
    """A Pod document: the pod's labels and (with ``ports``) one container serving the
    named ports of :data:`NAMED_PORTS`."""
    ns, name = pod.split("/")
    doc: Doc = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "namespace": ns, "labels": dict(labels)},
    }
    if ports:
        container = {
            "name": "server",
            "ports": [
                {"name": p.name, "containerPort": p.port, "protocol": p.protocol}
                for p in NAMED_PORTS
            ],
        }
        doc["spec"] = {"containers": [container]}
    return doc


def label_changes(old: Mapping[str, str], new: Mapping[str, str]) -> dict[str, str | None]:
    """The labels to apply to go from ``old`` to ``new`` (``None`` removes one)."""
    out: dict[str, str | None] = {k: None for k in old if k not in new}
    out.update({k: v for k, v in new.items() if old.get(k) != v})
    return out


def setup_docs(step: Step | None = None) -> list[Doc]:
    """Namespaces x, y, z and pods x/a .. z/c as a step labels them (the base labels when
    ``step`` is None)."""
    step = step or Step((), everything)
    docs = [namespace_doc(ns, namespace_labels(step, ns)) for ns in NAMESPACES]
    docs += [pod_doc(pod, pod_labels(step, pod)) for pod in PODS]
    return docs
