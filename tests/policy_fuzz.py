"""Random policy inputs and changes, for replaying against the incremental engine.

A small world where collisions are likely: four namespaces (not all with a Namespace
resource), three label keys with few values, twelve pod names per namespace (a Pod resource
for some), endpoints on three nodes with addresses drawn from 16 IPv4 and 8 IPv6 addresses
(duplicates happen), interfaces from 26 names (two local endpoints on one interface
happen), some without an interface; policies with pod and namespace selectors (labels and
expressions), ipBlocks with excepts in both families, numeric ports, ranges, named ports,
whole protocols, every ``policyTypes`` form; the NAT pools. :func:`random_update` draws one
change, biased to touch what exists (relabel, move, readdress, delete). With ``calico``, also
Calico's kinds: namespaced, global and staged policies in three tiers with every action and
match field, network sets (namespaced and global, overlapping nets), tiers with either
``defaultAction``, host endpoints; pods' service accounts, read by Calico's selectors.
"""

from __future__ import annotations

import dataclasses
import random

from policy.calico import (
    CalicoPolicy,
    CalicoRule,
    Direction,
    EntityMatch,
    HostEndpoint,
    IcmpMatch,
    NetworkSet,
    PortMatch,
    Tier,
)
from policy.engine import (
    NAMESPACE_NAME_LABEL,
    PROTOCOLS,
    ClusterState,
    ContainerPort,
    Endpoint,
    IPBlock,
    Labels,
    LabelSelector,
    Namespace,
    NatConfig,
    Peer,
    Pod,
    Policy,
    PortSpec,
    Requirement,
    Rule,
    ServiceAccount,
)
from policy.incremental import Update
from resources.selector import parse_selector, policy_selector, rule_selector

NODE = "n1"
NODES = (NODE, NODE, "n2", "n3")
NAMESPACES = ("a", "b", "c", "d")
KEYS = {"app": ("x", "y", "z"), "tier": ("web", "db"), "env": ("prod", "dev")}
PORTS = (
    ContainerPort("http", 8080),
    ContainerPort("http", 8081),
    ContainerPort("dns", 53, "UDP"),
    ContainerPort("metrics", 9090),
)


def labels(r: random.Random) -> Labels:
    return tuple((k, r.choice(v)) for k, v in KEYS.items() if r.random() < 0.6)


def selector(r: random.Random) -> LabelSelector:
    if r.random() < 0.2:
        return LabelSelector()
    match = tuple((k, r.choice(v)) for k, v in KEYS.items() if r.random() < 0.35)
    exprs: list[Requirement] = []
    if r.random() < 0.4:
        key = r.choice(list(KEYS))
        op = r.choice(("In", "NotIn", "Exists", "DoesNotExist"))
        values = (
            tuple(r.sample(KEYS[key], r.randint(1, len(KEYS[key]))))
            if op in ("In", "NotIn")
            else ()
        )
        exprs.append(Requirement(key, op, values))  # type: ignore[arg-type]
    return LabelSelector(match, tuple(exprs))


def namespace_selector(r: random.Random) -> LabelSelector:
    c = r.random()
    if c < 0.2:
        return LabelSelector()
    if c < 0.4:
        return LabelSelector(((NAMESPACE_NAME_LABEL, r.choice(NAMESPACES)),))
    if c < 0.5:
        return LabelSelector((), (Requirement("env", "NotIn", ("dev",)),))
    return LabelSelector((("team", r.choice(("red", "blue"))),))


def peer(r: random.Random) -> Peer:
    c = r.random()
    if c < 0.25:
        if r.random() < 0.5:
            excepts = tuple(r.sample(["10.0.0.4/30", "10.0.0.8/32"], r.randint(0, 2)))
            return Peer(ip_block=IPBlock("10.0.0.0/28", excepts))
        return Peer(ip_block=IPBlock("fd00::/125", ("fd00::4/126",) if r.random() < 0.5 else ()))
    if c < 0.55:
        return Peer(selector(r), None)
    if c < 0.75:
        return Peer(None, namespace_selector(r))
    return Peer(selector(r), namespace_selector(r))


def port_spec(r: random.Random) -> PortSpec:
    c = r.random()
    if c < 0.3:
        return PortSpec(r.choice(("TCP", "UDP")), r.choice(("http", "dns", "metrics")))
    if c < 0.6:
        return PortSpec(r.choice(PROTOCOLS), r.randint(1, 100))
    if c < 0.8:
        lo = r.randint(1, 100)
        return PortSpec("TCP", lo, lo + r.randint(0, 20))
    return PortSpec(r.choice(PROTOCOLS), None)


def rule(r: random.Random) -> Rule:
    peers = tuple(peer(r) for _ in range(r.choice((0, 1, 1, 2))))
    return Rule(peers, tuple(port_spec(r) for _ in range(r.choice((0, 1, 2)))))


def policy(r: random.Random) -> Policy:
    types = r.choice(((), ("Ingress",), ("Egress",), ("Ingress", "Egress")))
    return Policy(
        r.choice(NAMESPACES),
        f"p{r.randint(0, 7)}",
        selector(r),
        tuple(rule(r) for _ in range(r.choice((0, 1, 2)))),
        tuple(rule(r) for _ in range(r.choice((0, 0, 1, 2)))),
        types,  # type: ignore[arg-type]
    )


def namespace(r: random.Random) -> Namespace:
    labs = [("team", r.choice(("red", "blue")))] if r.random() < 0.7 else []
    if r.random() < 0.5:
        labs.append(("env", r.choice(("prod", "dev"))))
    return Namespace(r.choice(NAMESPACES), tuple(labs))


def pod(r: random.Random) -> Pod:
    """A pod, with a service account (what Calico's selectors may read) or none."""
    ports = tuple(r.sample(PORTS, r.randint(0, 2)))
    account = r.choice(("", "", "sa1", "sa2"))
    return Pod(r.choice(NAMESPACES), f"pod{r.randint(0, 9)}", labels(r), ports, account)


def service_account(r: random.Random) -> ServiceAccount:
    """A ServiceAccount of a pod's (its labels are Calico's ``pcsa.``)."""
    labs = (("role", r.choice(("web", "db"))),) if r.random() < 0.7 else ()
    return ServiceAccount(r.choice(NAMESPACES), r.choice(("sa1", "sa2")), labs)


def addresses(r: random.Random) -> tuple[str, ...]:
    out = []
    if r.random() < 0.9:
        out.append(f"10.0.0.{r.randint(0, 15)}")
    if r.random() < 0.5:
        out.append(f"fd00::{r.randint(0, 7):x}")
    if out and r.random() < 0.05:  # the same address twice, as a host CIDR
        out.append(out[0] + ("/128" if ":" in out[0] else "/32"))
    return tuple(out)


def interface(r: random.Random) -> str:
    return "" if r.random() < 0.1 else f"cali{r.randint(0, 25):02d}"


def endpoint(r: random.Random) -> Endpoint:
    """Pods pod10 and pod11 never have a Pod resource: their own labels count."""
    ns, name = r.choice(NAMESPACES), f"pod{r.randint(0, 11)}"
    return Endpoint(
        ns,
        name,
        r.choice(NODES),
        interface(r),
        addresses(r),
        f"{name}-e{r.randint(0, 1)}",
        labels(r),
    )


def nat(r: random.Random) -> NatConfig:
    pools = []
    if r.random() < 0.7:
        pools.append(("10.0.0.0/16", r.random() < 0.5))
    if r.random() < 0.5:
        pools.append(("fd00::/64", r.random() < 0.5))
    if r.random() < 0.3:
        pools.append(("10.9.0.0/16", False))
    return NatConfig(tuple(pools))


def changed_endpoint(r: random.Random, ep: Endpoint) -> Endpoint:
    """The same endpoint moved to another node, readdressed, relabelled or re-plugged."""
    c = r.random()
    if c < 0.4:
        return dataclasses.replace(ep, node=r.choice(NODES))
    if c < 0.7:
        return dataclasses.replace(ep, addresses=addresses(r))
    return dataclasses.replace(ep, labels=labels(r), interface=interface(r))


CALICO_SELECTORS = (
    "all()",
    "app == 'x'",
    "has(tier)",
    "env in {'prod'}",
    "!has(app)",
    "tier == 'db' || app == 'y'",
)
NAMESPACE_SELECTORS = (None, None, "all()", "env == 'prod'", "global()")
ACCOUNT_SELECTORS = (
    None, None, None, None, "all()", "projectcalico.org/name == 'sa1'", "role == 'web'"
)  # fmt: skip
TIERS = ("default", "security", "platform")
NETS = ("10.0.0.0/30", "10.0.0.8/29", "10.0.0.0/28", "192.168.0.0/24", "fd00::/126", "fd00::4/127")


def _entity(r: random.Random, protocol: int | None, namespace: str | None) -> EntityMatch:
    nets = tuple(n for n in NETS if r.random() < 0.1)
    not_nets = tuple(n for n in NETS if r.random() < 0.05)
    sel = r.choice(CALICO_SELECTORS) if r.random() < 0.4 else None
    not_sel = r.choice(CALICO_SELECTORS) if r.random() < 0.15 else None
    ns_sel = r.choice(NAMESPACE_SELECTORS) if r.random() < 0.3 else None
    accounts = ("sa1",) if r.random() < 0.05 else ()
    selector = rule_selector(
        sel,
        not_selector=not_sel,
        namespace_selector=ns_sel,
        service_account_selector=r.choice(ACCOUNT_SELECTORS),
        service_account_names=accounts,
        policy_namespace=namespace,
    )
    ports: tuple[PortMatch, ...] = ()
    not_ports: tuple[PortMatch, ...] = ()
    if protocol in (6, 17) and r.random() < 0.5:
        choices = (80, "8000:8100", "http", "dns", 53, 8080)
        ports = tuple(PortMatch.parse(p) for p in r.sample(choices, r.randint(1, 2)))
    if protocol in (6, 17) and r.random() < 0.2:
        not_ports = (PortMatch.parse(r.choice((8080, "http", "9000:9100"))),)
    not_parsed = parse_selector(not_sel) if not_sel else None
    return EntityMatch(nets, not_nets, selector, not_parsed, ports, not_ports)


def calico_rule(r: random.Random, namespace: str | None) -> CalicoRule:
    action = r.choice(("Allow", "Allow", "Deny", "Log", "Pass"))
    protocol = r.choice((None, None, 6, 17, 1, 58))
    icmp = not_icmp = None
    if protocol in (1, 58) and r.random() < 0.5:
        match = IcmpMatch(r.choice((0, 8)), r.choice((None, 0)))
        icmp, not_icmp = (match, None) if r.random() < 0.5 else (None, match)
    not_protocol = r.choice((17, 6)) if protocol is None and r.random() < 0.15 else None
    return CalicoRule(
        action,  # type: ignore[arg-type]
        protocol,
        not_protocol,
        icmp,
        not_icmp,
        r.choice((None, None, None, 4, 6)),  # type: ignore[arg-type]
        _entity(r, protocol, namespace),
        _entity(r, protocol, namespace),
    )


def calico_policy(r: random.Random) -> CalicoPolicy:
    namespace = r.choice((*NAMESPACES, None))
    sel = r.choice(CALICO_SELECTORS)
    ns_sel = r.choice(NAMESPACE_SELECTORS[:4]) if namespace is None else None
    selector = policy_selector(
        sel,
        namespace=namespace,
        namespace_selector=ns_sel,
        service_account_selector=r.choice(ACCOUNT_SELECTORS),
    )
    ingress = tuple(calico_rule(r, namespace) for _ in range(r.randint(0, 3)))
    egress = tuple(calico_rule(r, namespace) for _ in range(r.randint(0, 2)))
    types: frozenset[Direction] = r.choice(
        (frozenset({"ingress"}), frozenset({"egress"}), frozenset({"ingress", "egress"}))
    )
    # a global policy may be a host endpoint's kind: untracked, pre-DNAT (ingress only), or
    # normal with applyOnForward
    stage = r.choice(("normal", "normal", "untracked", "prednat")) if namespace is None else ""
    if stage == "prednat":
        types, egress = frozenset({"ingress"}), ()
    return CalicoPolicy(
        r.choice(("p1", "p2", "p3")),
        namespace,
        selector,
        r.choice(TIERS),
        r.choice((None, 1.0, 100.0, 1000.0, 1000.0)),
        types,
        ingress,
        egress,
        r.random() < 0.15,
        pre_dnat=stage == "prednat",
        do_not_track=stage == "untracked",
        apply_on_forward=stage in ("untracked", "prednat") or r.random() < 0.3,
    )


def host_endpoint(r: random.Random) -> HostEndpoint:
    """A host endpoint of this node or another: an interface (``*`` too) or none, expected
    IPs of the nodes' own range (one may be a pod's address)."""
    ips = tuple(a for a in ("192.168.0.1", "192.168.0.2", "fd00:1::1") if r.random() < 0.4)
    if r.random() < 0.1:
        ips += ("10.0.0.1",)
    iface = r.choice(("eth0", "eth1", "*", None))
    if iface is None and not ips:
        iface = "eth0"
    # (labels the policies' selectors read: so that they select host endpoints often)
    own = r.choice(((("app", "x"),), (("tier", "db"),), (("app", "y"), ("tier", "web")), ()))
    return HostEndpoint(r.choice(("h1", "h2", "h3")), r.choice(NODES), iface, ips, own)


def network_set(r: random.Random) -> NetworkSet:
    nets = tuple(n for n in NETS if r.random() < 0.3)
    return NetworkSet(r.choice(("s1", "s2")), r.choice((None, *NAMESPACES)), labels(r), nets)


def tier(r: random.Random) -> Tier:
    order = r.choice((None, 10.0, 50.0, 2_000_000.0))
    return Tier(r.choice(TIERS), order, r.choice(("Deny", "Pass")))  # type: ignore[arg-type]


def put(value: Policy | Namespace | Pod | Endpoint) -> Update:
    """The update that puts ``value``, with its key."""
    if isinstance(value, Namespace):
        return Update("namespace", value.name, value)
    kind = (
        "policy" if isinstance(value, Policy) else "pod" if isinstance(value, Pod) else "endpoint"
    )
    return Update(kind, f"{value.namespace}/{value.name}", value)  # type: ignore[arg-type]


def random_calico_update(r: random.Random, st: ClusterState) -> Update:
    """One change of Calico's kinds to the world ``st``."""
    c = r.random()
    if c < 0.05:  # a staged Delete of one of the policies the fuzz draws
        from policy.inputs import staged_delete

        p = staged_delete(r.choice(("p1", "p2", "p3")), r.choice((*NAMESPACES, None)), "default")
        return Update("calico-policy", p.key, p)
    if c < 0.45:
        p = calico_policy(r)
        return Update("calico-policy", p.key, p)
    if c < 0.65 and st.calico_policies:
        return Update("calico-policy", r.choice(st.calico_policies).key, None)
    if c < 0.8:
        s = network_set(r)
        return Update("network-set", s.key, s)
    if c < 0.85 and st.network_sets:
        return Update("network-set", r.choice(st.network_sets).key, None)
    if c < 0.9:
        t = tier(r)
        return Update("tier", t.name, t)
    if c < 0.92:
        return Update("tier", r.choice(TIERS), None)
    if c < 0.95 or not st.host_endpoints:
        h = host_endpoint(r)
        return Update("host-endpoint", h.key, h)
    if c < 0.96:
        return Update("host-endpoint", r.choice(st.host_endpoints).key, None)
    if c < 0.99 or not st.service_accounts:
        a = service_account(r)
        return Update("service-account", a.key, a)
    return Update("service-account", r.choice(st.service_accounts).key, None)


def random_update(r: random.Random, st: ClusterState, *, calico: bool = False) -> Update:
    """One change to the world ``st`` (of Calico's kinds too, with ``calico``)."""
    if calico and r.random() < 0.25:
        return random_calico_update(r, st)
    c = r.random()
    if c < 0.12:
        return put(policy(r))
    if c < 0.17 and st.policies:
        p = r.choice(st.policies)
        return Update("policy", f"{p.namespace}/{p.name}", None)
    if c < 0.22:
        if r.random() < 0.2:
            return Update("namespace", r.choice(NAMESPACES), None)
        return put(namespace(r))
    if c < 0.35:
        return put(pod(r))
    if c < 0.40 and st.pods:
        p2 = r.choice(st.pods)
        return Update("pod", f"{p2.namespace}/{p2.name}", None)
    if c < 0.72:
        return put(endpoint(r))
    if c < 0.82 and st.endpoints:
        return put(changed_endpoint(r, r.choice(st.endpoints)))
    if c < 0.95 and st.endpoints:
        e = r.choice(st.endpoints)
        return Update("endpoint", f"{e.namespace}/{e.name}", None)
    return Update("nat", "", nat(r))


def calico_mode(world: World) -> bool:
    """Whether the incremental engine computes ``world`` whole: a Calico policy, or a host
    endpoint of :data:`NODE` with an interface."""
    mine = any(h.node == NODE and h.interface for h in world.host_endpoints.values())
    return bool(world.calico) or mine


class World:
    """The inputs as plain dictionaries, changed by :class:`Update` s independently of the
    engine under test: the reference its ``state()`` is compared with."""

    def __init__(self) -> None:
        self.policies: dict[str, Policy] = {}
        self.namespaces: dict[str, Namespace] = {}
        self.pods: dict[str, Pod] = {}
        self.endpoints: dict[str, Endpoint] = {}
        self.nat = NatConfig()
        self.calico: dict[str, CalicoPolicy] = {}
        self.network_sets: dict[str, NetworkSet] = {}
        self.tiers: dict[str, Tier] = {}
        self.host_endpoints: dict[str, HostEndpoint] = {}
        self.service_accounts: dict[str, ServiceAccount] = {}

    def apply(self, u: Update) -> None:
        if u.kind == "nat":
            assert isinstance(u.value, NatConfig)
            self.nat = u.value
            return
        table: dict[str, object] = {
            "policy": self.policies,
            "namespace": self.namespaces,
            "pod": self.pods,
            "endpoint": self.endpoints,
            "calico-policy": self.calico,
            "network-set": self.network_sets,
            "tier": self.tiers,
            "host-endpoint": self.host_endpoints,
            "service-account": self.service_accounts,
        }[u.kind]  # type: ignore[assignment]
        if u.value is None:
            table.pop(u.key, None)
        else:
            table[u.key] = u.value

    def state(self) -> ClusterState:
        return ClusterState(
            tuple(self.policies.values()),
            tuple(self.namespaces.values()),
            tuple(self.pods.values()),
            tuple(self.endpoints.values()),
            tuple(self.calico.values()),
            tuple(self.network_sets.values()),
            tuple(self.tiers.values()),
            tuple(self.host_endpoints.values()),
            tuple(self.service_accounts.values()),
        )
