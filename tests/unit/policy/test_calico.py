"""Calico's policy semantics in the engine: a table of rule fields, tiers, Pass, defaultAction,
order ties, Log, staged policies, network sets, with Kubernetes NetworkPolicy as the special
case it is in Calico (tier ``default``, order 1000, Allow rules).

Each case is one cluster (two namespaces, three pods on one node, a global and a namespaced
network set) plus the policies of the case, and one packet; the engine's ``explain`` must
give the verdict, and name the tier and the rule that decided it.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import random
from collections.abc import Sequence
from typing import Any

import pytest

from policy import engine
from policy.calico import (
    CalicoPolicy,
    CalicoRule,
    Direction,
    EntityMatch,
    IcmpMatch,
    NetworkSet,
    PortMatch,
    Tier,
    protocol_number,
)
from policy.counters import END_OF_TIER, CounterKey, counters_of, staged_end_counter
from policy.engine import (
    ClusterState,
    ContainerPort,
    Endpoint,
    LabelSelector,
    Namespace,
    Pod,
    Policy,
    Rule,
    compute,
)
from resources.selector import parse_selector, policy_selector, rule_selector
from tests import policy_fuzz as fz

TCP, UDP, ICMP = protocol_number("TCP"), protocol_number("UDP"), protocol_number("ICMP")

WEB = ("a", "web")  # 10.0.0.1, app=web, port http = TCP 8080, service account web-sa
DB = ("a", "db")  # 10.0.0.2, app=db
CLIENT = ("b", "client")  # 10.0.1.1, app=client
CORP = "192.168.7.7"  # in GlobalNetworkSet corp (role=corp)
PARTNER = "172.16.0.5"  # in NetworkSet a/partners (role=partner)
OUTSIDE = "203.0.113.9"  # in nothing


def base() -> ClusterState:
    namespaces = (Namespace("a", (("team", "a"),)), Namespace("b", (("team", "b"),)))
    pods = (
        Pod("a", "web", (("app", "web"),), (ContainerPort("http", 8080),), "web-sa"),
        Pod("a", "db", (("app", "db"),)),
        Pod("b", "client", (("app", "client"),)),
    )
    endpoints = (
        Endpoint("a", "web", "n1", "caliweb", ("10.0.0.1",)),
        Endpoint("a", "db", "n1", "calidb", ("10.0.0.2",)),
        Endpoint("b", "client", "n1", "caliclient", ("10.0.1.1", "fd00::11")),
    )
    sets = (
        NetworkSet("corp", None, (("role", "corp"),), ("192.168.0.0/16",)),
        NetworkSet("partners", "a", (("role", "partner"),), ("172.16.0.0/12",)),
    )
    return ClusterState((), namespaces, pods, endpoints, network_sets=sets)


def gnp(
    name: str,
    ingress: Sequence[CalicoRule] = (),
    egress: Sequence[CalicoRule] = (),
    *,
    selector: str = "all()",
    namespace_selector: str | None = None,
    tier: str = "default",
    order: float | None = None,
    staged: bool = False,
    namespace: str | None = None,
) -> CalicoPolicy:
    """A GlobalNetworkPolicy, or with ``namespace`` a NetworkPolicy (types: as Calico
    defaults them)."""
    sel = policy_selector(selector, namespace=namespace, namespace_selector=namespace_selector)
    types: frozenset[Direction] = frozenset(("ingress", "egress") if egress else ("ingress",))
    ing, eg = tuple(ingress), tuple(egress)
    return CalicoPolicy(name, namespace, sel, tier, order, types, ing, eg, staged)


def np(namespace: str, name: str, ingress: Sequence[CalicoRule] = (), **kw: Any) -> CalicoPolicy:
    """A namespaced Calico NetworkPolicy."""
    return gnp(name, ingress, namespace=namespace, **kw)


def src(
    *,
    nets: Sequence[str] = (),
    not_nets: Sequence[str] = (),
    selector: str | None = None,
    not_selector: str | None = None,
    namespace_selector: str | None = None,
    service_accounts: Sequence[str] = (),
    ports: Sequence[int | str] = (),
    not_ports: Sequence[int | str] = (),
    namespace: str | None = None,
) -> EntityMatch:
    rule_sel = rule_selector(
        selector,
        not_selector=not_selector,
        namespace_selector=namespace_selector,
        service_account_names=service_accounts,
        policy_namespace=namespace,
    )
    return EntityMatch(
        tuple(nets),
        tuple(not_nets),
        rule_sel,
        parse_selector(not_selector) if not_selector else None,
        tuple(PortMatch.parse(p) for p in ports),
        tuple(PortMatch.parse(p) for p in not_ports),
    )


dst = src


def allow(**kw: Any) -> CalicoRule:
    return CalicoRule("Allow", **kw)


def deny(**kw: Any) -> CalicoRule:
    return CalicoRule("Deny", **kw)


def knp(namespace: str, name: str, *rules: Rule, labels: dict[str, str] | None = None) -> Policy:
    return Policy(namespace, name, LabelSelector.of(labels), tuple(rules))


@dataclasses.dataclass(frozen=True)
class Case:
    id: str
    policies: tuple[CalicoPolicy | Policy, ...]
    src: engine.Target
    dst: engine.Target
    protocol: str
    port: int | None
    allowed: bool
    #: the tier and rule named for the destination's ingress (None/"": none named)
    tier: str | None = None
    rule: str = ""
    tiers: tuple[Tier, ...] = ()
    icmp: tuple[int, int] | None = None
    sport: int | None = None

    def state(self) -> ClusterState:
        k8s = tuple(p for p in self.policies if isinstance(p, Policy))
        calico = tuple(p for p in self.policies if isinstance(p, CalicoPolicy))
        return dataclasses.replace(base(), policies=k8s, calico_policies=calico, tiers=self.tiers)

    def explain(self) -> engine.Explanation:
        icmp_type, icmp_code = self.icmp if self.icmp is not None else (None, None)
        return engine.explain(
            self.state(),
            self.src,
            self.dst,
            self.protocol,
            self.port,
            source_port=self.sport,
            icmp_type=icmp_type,
            icmp_code=icmp_code,
        )


C = Case
web_only = "app == 'web'"


def F(
    id: str,
    rule: CalicoRule,
    src: engine.Target,
    dst: engine.Target,
    protocol: str,
    port: int | None,
    allowed: bool,
    **kw: Any,
) -> Case:
    """A case of one rule field: a GlobalNetworkPolicy ``p`` (tier default) of that one
    rule, which decides when it matches, else the tier's end denies."""
    decided = "p ingress[0]" if allowed else ""
    return Case(
        id, (gnp("p", [rule]),), src, dst, protocol, port, allowed, "default", decided, **kw
    )


def P(id: str, policy: CalicoPolicy, src: engine.Target, allowed: bool) -> Case:
    """A case of one policy (tier default) and a TCP/80 connection to web."""
    decided = f"{policy.key} ingress[0]" if allowed else ""
    return Case(id, (policy,), src, WEB, "TCP", 80, allowed, "default", decided)


TCP80 = allow(protocol=TCP, destination=dst(ports=[80, 443]))
RANGE = allow(protocol=TCP, destination=dst(ports=["8000:8100"]))
NAMED = allow(protocol=TCP, destination=dst(ports=["http"]))
NOT_NAMED = allow(protocol=TCP, destination=dst(not_ports=["http"]))
FROM_B = allow(source=src(nets=["10.0.1.0/24"]))
NOT_FROM_B = allow(source=src(not_nets=["10.0.1.0/24"]))
CLIENTS = allow(source=src(selector="app == 'client'"))
NOT_CLIENTS = allow(source=src(not_selector="app == 'client'"))
TEAM_B = allow(source=src(namespace_selector="team == 'b'"))
SPORT = allow(protocol=TCP, source=src(ports=[5000]))
IS_ECHO = allow(protocol=ICMP, icmp=IcmpMatch(8, 0))
NOT_ECHO = allow(protocol=ICMP, not_icmp=IcmpMatch(8, 0))
IS_UNREACHABLE = allow(protocol=ICMP, icmp=IcmpMatch(3))
TO_WEB = allow(destination=dst(nets=["10.0.0.1/32"]))
ANY_ENDPOINT = allow(source=src(selector="all()"))
WEB_SA = allow(source=src(service_accounts=["web-sa"]))
CORP_SEL = allow(source=src(selector="role == 'corp'"))
PARTNERS_A = allow(source=src(selector="role == 'partner'", namespace="a"))
PARTNERS_B = allow(source=src(selector="role == 'partner'", namespace="b"))
GLOBAL_PARTNERS = allow(source=src(selector="role == 'partner'", namespace_selector="global()"))

DEF, SEC = "default", "security"
S10, S10_PASS, S100 = Tier(SEC, 10), Tier(SEC, 10, "Pass"), Tier(SEC, 100)
T1_1, T1_3, T2_2 = Tier("t1", 1), Tier("t1", 3), Tier("t2", 2)
PASS = CalicoRule("Pass")
ALLOW_ALL = gnp("p", [allow()])
TEAM_B_DENY = gnp("p", [deny()], namespace_selector="team == 'b'")
SEC_DENY = gnp("sec", [deny()], tier=SEC)
SEC_DENY_CLIENTS = gnp("sec", [deny(source=src(selector="app == 'client'"))], tier=SEC)
SEC_PASS = gnp("sec", [PASS], tier=SEC)
SEC_PASS_1 = gnp("a1", [PASS], tier=SEC, order=1)
SEC_DENY_2 = gnp("a2", [deny()], tier=SEC, order=2)
SEC_UDP = gnp("sec", [allow(protocol=UDP)], tier=SEC)
SEC_DENY_DB = gnp("sec", [deny()], tier=SEC, selector="app == 'db'")
T2_DENY = gnp("first", [deny()], tier="t2")
T1_ALLOW = gnp("second", [allow()], tier="t1")
ALLOW_A = knp("a", "allow-all", Rule())


def T(
    id: str,
    policies: tuple[CalicoPolicy | Policy, ...],
    allowed: bool,
    tier: str | None = None,
    rule: str = "",
    tiers: tuple[Tier, ...] = (),
) -> Case:
    """A case of a TCP/80 connection from the client to web."""
    return Case(id, policies, CLIENT, WEB, "TCP", 80, allowed, tier, rule, tiers)


CASES = [
    # -- each rule field: a match allows, a miss ends the tier in Deny --------------------------
    F("protocol", allow(protocol=TCP), CLIENT, WEB, "TCP", 80, True),
    F("protocol-miss", allow(protocol=TCP), CLIENT, WEB, "UDP", 80, False),
    F("protocol-number", allow(protocol=17), CLIENT, WEB, "UDP", 53, True),
    F("notProtocol", allow(not_protocol=UDP), CLIENT, WEB, "TCP", 80, True),
    F("notProtocol-miss", allow(not_protocol=UDP), CLIENT, WEB, "UDP", 80, False),
    F("icmp", IS_ECHO, CLIENT, WEB, "ICMP", None, True, icmp=(8, 0)),
    F("icmp-type-miss", IS_ECHO, CLIENT, WEB, "ICMP", None, False, icmp=(0, 0)),
    F("icmp-code-miss", IS_ECHO, CLIENT, WEB, "ICMP", None, False, icmp=(8, 3)),
    F("icmp-any-code", IS_UNREACHABLE, CLIENT, WEB, "ICMP", None, True, icmp=(3, 3)),
    F("notICMP", NOT_ECHO, CLIENT, WEB, "ICMP", None, True, icmp=(8, 1)),
    F("notICMP-miss", NOT_ECHO, CLIENT, WEB, "ICMP", None, False, icmp=(8, 0)),
    F("ipVersion", allow(ip_version=4), CLIENT, WEB, "TCP", 80, True),
    F("ipVersion-miss", allow(ip_version=6), CLIENT, WEB, "TCP", 80, False),
    F("nets", FROM_B, CLIENT, WEB, "TCP", 80, True),
    F("nets-miss", FROM_B, DB, WEB, "TCP", 80, False),
    F("notNets", NOT_FROM_B, DB, WEB, "TCP", 80, True),
    F("notNets-miss", NOT_FROM_B, CLIENT, WEB, "TCP", 80, False),
    F("destination-nets", TO_WEB, CLIENT, WEB, "TCP", 80, True),
    F("selector", CLIENTS, CLIENT, WEB, "TCP", 80, True),
    F("selector-miss", CLIENTS, DB, WEB, "TCP", 80, False),
    F("selector-not-an-address", ANY_ENDPOINT, OUTSIDE, WEB, "TCP", 80, False),
    F("notSelector", NOT_CLIENTS, DB, WEB, "TCP", 80, True),
    F("notSelector-miss", NOT_CLIENTS, CLIENT, WEB, "TCP", 80, False),
    F("notSelector-outside", NOT_CLIENTS, OUTSIDE, WEB, "TCP", 80, True),
    F("namespaceSelector", TEAM_B, CLIENT, WEB, "TCP", 80, True),
    F("namespaceSelector-miss", TEAM_B, DB, WEB, "TCP", 80, False),
    F("ports", TCP80, CLIENT, WEB, "TCP", 443, True),
    F("ports-miss", TCP80, CLIENT, WEB, "TCP", 444, False),
    F("port-range", RANGE, CLIENT, WEB, "TCP", 8100, True),
    F("port-range-miss", RANGE, CLIENT, WEB, "TCP", 8101, False),
    F("named-port", NAMED, CLIENT, WEB, "TCP", 8080, True),
    F("named-port-other-pod", NAMED, CLIENT, DB, "TCP", 8080, False),
    F("notPorts", NOT_NAMED, CLIENT, WEB, "TCP", 22, True),
    F("notPorts-miss", NOT_NAMED, CLIENT, WEB, "TCP", 8080, False),
    F("source-ports", SPORT, CLIENT, WEB, "TCP", 80, True, sport=5000),
    F("source-ports-miss", SPORT, CLIENT, WEB, "TCP", 80, False, sport=5001),
    F("serviceAccounts", WEB_SA, WEB, DB, "TCP", 80, True),
    F("serviceAccounts-miss", WEB_SA, CLIENT, WEB, "TCP", 80, False),
    # -- network sets: their nets are in a selector's set when their labels match ---------------
    F("global-network-set", CORP_SEL, CORP, WEB, "TCP", 80, True),
    F("global-network-set-miss", CORP_SEL, OUTSIDE, WEB, "TCP", 80, False),
    P("network-set-in-namespace", np("a", "p", [PARTNERS_A]), PARTNER, True),
    C(
        "network-set-other-ns",
        (np("b", "p", [PARTNERS_B]),),
        PARTNER,
        CLIENT,
        "TCP",
        80,
        False,
        "default",
    ),
    F("global-skips-namespaced-set", GLOBAL_PARTNERS, PARTNER, WEB, "TCP", 80, False),
    # -- which endpoints a policy applies to ----------------------------------------------------
    T("gnp-selector-other-pod", (gnp("p", [deny()], selector="app == 'db'"),), True),
    C("gnp-namespaceSelector", (TEAM_B_DENY,), WEB, CLIENT, "TCP", 80, False, DEF, "p ingress[0]"),
    T("gnp-namespaceSelector-other", (TEAM_B_DENY,), True),
    T("np-own-namespace-only", (np("b", "p", [deny()]),), True),
    # -- tiers, Pass, defaultAction, the profile ---------------------------------------------------
    T("deny-in-earlier-tier", (SEC_DENY_CLIENTS, ALLOW_ALL), False, SEC, "sec ingress[0]", (S10,)),
    T("pass-to-next-tier", (SEC_PASS, ALLOW_ALL), True, DEF, "p ingress[0]", (S10,)),
    T("pass-then-deny", (SEC_PASS, gnp("p", [deny()])), False, DEF, "p ingress[0]", (S10,)),
    T("pass-skips-rest-of-tier", (SEC_PASS_1, SEC_DENY_2), True, None, "", (S10,)),
    T("end-of-tier-deny", (SEC_UDP, ALLOW_ALL), False, SEC, "", (S10,)),
    T("tier-defaultAction-pass", (SEC_UDP, ALLOW_ALL), True, DEF, "p ingress[0]", (S10_PASS,)),
    T("tier-not-selecting-is-skipped", (SEC_DENY_DB, ALLOW_ALL), True, DEF, "p ingress[0]", (S10,)),
    T("passed-by-last-tier-profile-allows", (gnp("p", [PASS]),), True),
    T("tier-order", (T2_DENY, T1_ALLOW), True, "t1", "second ingress[0]", (T1_1, T2_2)),
    T("tier-order-reversed", (T2_DENY, T1_ALLOW), False, "t2", "first ingress[0]", (T1_3, T2_2)),
    T("default-tier-last", (ALLOW_ALL, SEC_DENY), False, SEC, "sec ingress[0]", (S100,)),
    T("unknown-tier-last", (gnp("p", [PASS]), gnp("x", [], tier="missing")), False, "missing"),
    # -- order within a tier: lower first, ties by name, none last ---------------------------------
    T(
        "order",
        (gnp("b", [deny()], order=1), gnp("a", [allow()], order=2)),
        False,
        DEF,
        "b ingress[0]",
    ),
    T(
        "order-tie-name",
        (gnp("b", [deny()], order=1), gnp("a", [allow()], order=1)),
        True,
        DEF,
        "a ingress[0]",
    ),
    T(
        "order-none-last",
        (gnp("a", [deny()]), gnp("b", [allow()], order=9999)),
        True,
        DEF,
        "b ingress[0]",
    ),
    T(
        "first-rule-of-policy",
        (gnp("p", [deny(protocol=TCP), allow()]),),
        False,
        DEF,
        "p ingress[0]",
    ),
    T(
        "no-match-next-policy",
        (gnp("a", [deny(protocol=UDP)], order=1), gnp("b", [allow()], order=2)),
        True,
        DEF,
        "b ingress[0]",
    ),
    # -- Kubernetes NetworkPolicy: tier default, order 1000 ----------------------------------------
    T(
        "k8s-after-calico-500",
        (ALLOW_A, np("a", "deny", [deny()], order=500)),
        False,
        DEF,
        "a/deny ingress[0]",
    ),
    T(
        "k8s-before-calico-2000",
        (ALLOW_A, np("a", "deny", [deny()], order=2000)),
        True,
        DEF,
        "a/allow-all ingress[0]",
    ),
    T(
        "k8s-tie-knp-name-first",
        (knp("a", "zz", Rule()), np("a", "zzz", [deny()], order=1000)),
        True,
        DEF,
        "a/zz ingress[0]",
    ),
    T("k8s-isolation", (knp("a", "none"),), False, DEF),
    T("k8s-after-pass", (SEC_PASS, knp("a", "none")), False, DEF, "", (S10,)),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_calico_semantics(case: Case) -> None:
    got = case.explain()
    assert got.ingress is not None
    assert got.ingress.allowed is case.allowed, got.lines()
    rule = _label(case)
    assert (got.ingress.tier, got.ingress.decided_by) == (case.tier, rule), got.lines()
    assert got.ingress.allowed_by == ((rule,) if case.allowed and rule else ())


def _label(case: Case) -> str:
    """A case's deciding rule as explain names it: ``<tier>/<policy> <direction>[<i>]`` for
    a Calico policy's (the nft comment of the rule), ``<ns>/<name> ...`` for Kubernetes'."""
    key = case.rule.partition(" ")[0]
    for p in case.policies:
        if isinstance(p, CalicoPolicy) and p.key == key:
            return f"{p.tier}/{case.rule}"
    return case.rule


def test_log_is_logged_then_the_next_rule_decides() -> None:
    rules = [CalicoRule("Log", protocol=TCP), CalicoRule("Log", protocol=UDP), deny()]
    state = dataclasses.replace(base(), calico_policies=(gnp("p", rules),))
    got = engine.explain(state, CLIENT, WEB, "TCP", 80)
    assert got.ingress is not None
    assert got.ingress.logged == ("default/p ingress[0]",)
    assert (got.ingress.allowed, got.ingress.decided_by) == (False, "default/p ingress[2]")
    assert "    logged by default/p ingress[0]" in got.lines()


def test_egress_of_the_source_is_walked_too() -> None:
    to_a = dst(nets=["10.0.0.0/24"])
    pol = gnp("eg", egress=[deny(destination=to_a)], selector="app == 'client'")
    state = dataclasses.replace(base(), calico_policies=(pol,))
    got = engine.explain(state, CLIENT, WEB, "TCP", 80)
    assert got.egress is not None
    assert got.ingress is not None
    assert (got.egress.allowed, got.egress.decided_by) == (False, "default/eg egress[0]")
    assert (got.ingress.allowed, got.ingress.isolated) == (True, False)  # not selected: web
    assert not got.allowed
    # an egress to a network set by its labels
    pol = gnp("eg", egress=[allow(destination=dst(selector="role == 'corp'"))])
    state = dataclasses.replace(base(), calico_policies=(pol,))
    assert engine.allowed(state, CLIENT, CORP)
    assert not engine.allowed(state, CLIENT, OUTSIDE)


def test_staged_policies_are_never_enforced_but_say_what_they_would_do() -> None:
    staged = gnp("s", [deny()], tier="security", staged=True)
    state = dataclasses.replace(
        base(), calico_policies=(staged, gnp("p", [allow()])), tiers=(Tier("security", 10),)
    )
    got = engine.explain(state, CLIENT, WEB, "TCP", 80)
    assert got.ingress is not None
    assert (got.allowed, got.ingress.selecting) == (True, ("p",))
    assert got.ingress.staged == "would have denied: by security/staged:s ingress[0] (Deny)"
    assert "    staged: would have denied: by security/staged:s ingress[0] (Deny)" in (got.lines())
    # a staged policy that selects nothing says nothing
    other = dataclasses.replace(staged, selector=parse_selector("app == 'nobody'"))
    state = dataclasses.replace(state, calico_policies=(other, gnp("p", [allow()])))
    got = engine.explain(state, CLIENT, WEB, "TCP", 80)
    assert got.ingress is not None
    assert got.ingress.staged == ""


def test_kubernetes_only_clusters_keep_their_reasons() -> None:
    state = dataclasses.replace(base(), policies=(knp("a", "deny-all"),))
    got = engine.explain(state, CLIENT, WEB, "TCP", 80)
    assert got.ingress is not None
    assert got.ingress.reason == "isolated by 1 policy and none of their 0 ingress rules matches"
    assert got.ingress.tier == "default"
    state = dataclasses.replace(state, policies=(knp("a", "all", Rule(), Rule()),))
    got = engine.explain(state, CLIENT, WEB, "TCP", 80)
    assert got.ingress is not None
    assert got.ingress.reason == "by a/all ingress[0]"


def test_rule_fields_are_checked() -> None:
    with pytest.raises(ValueError, match="ports need protocol"):
        CalicoRule("Allow", destination=EntityMatch(ports=(PortMatch(80, 80),)))
    with pytest.raises(ValueError, match="need protocol ICMP"):
        CalicoRule("Allow", protocol=TCP, icmp=IcmpMatch(8))
    with pytest.raises(ValueError, match="unknown action"):
        CalicoRule("Reject")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="defaultAction"):
        Tier("t", 1, "Allow")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="bad port range"):
        PortMatch.parse("90:80")
    assert PortMatch.parse("8000:8080") == PortMatch(8000, 8080)
    assert PortMatch.parse("http") == PortMatch(name="http")
    assert protocol_number("icmpv6") == 58
    with pytest.raises(ValueError, match="unknown protocol"):
        protocol_number("GRE")


_ADDRESS = {
    WEB: ("10.0.0.1", "caliweb"),
    DB: ("10.0.0.2", "calidb"),
    CLIENT: ("10.0.1.1", "caliclient"),
}


def _end(t: engine.Target) -> tuple[str, str | None]:
    if isinstance(t, tuple):
        return _ADDRESS[t]
    return t, None


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_the_ir_decides_as_explain_does(case: Case) -> None:
    """The IR (sets, tiered programs, chains with verdicts) evaluated as the dataplane
    would gives the verdict of the direct evaluation, both directions."""
    want = case.explain().allowed
    ir = engine.compute(case.state(), "n1")
    (src, src_if), (dst, dst_if) = _end(case.src), _end(case.dst)
    got = ir.evaluate(
        src, dst, case.protocol, case.port, src_if, dst_if, source_port=case.sport, icmp=case.icmp
    )
    assert got is want


@pytest.mark.parametrize("seed", range(6))
def test_random_calico_worlds_the_ir_decides_as_explain_does(seed: int) -> None:
    """Random worlds of both models (``tests/policy_fuzz.py``): for connections between
    local endpoints (of pods with one endpoint and addresses no other endpoint has), and
    from outside addresses, the IR evaluated decides as explain."""
    r = random.Random(seed)
    world = fz.World()
    for _ in range(250):
        world.apply(fz.random_update(r, world.state(), calico=True))
    # the world's policies, namespaces, pods, network sets and tiers; one endpoint per pod
    # with addresses of its own (the fuzz world's collide on purpose), two of three local
    names = [(ns, f"pod{j}") for ns in fz.NAMESPACES for j in range(12)]
    endpoints = tuple(
        Endpoint(
            ns,
            pod,
            fz.NODE if i % 3 else "n2",
            f"calx{i}",
            (f"10.1.{i // 200}.{i % 200 + 1}", f"fd01::{i + 1:x}"),
            labels=fz.labels(r),  # read when the world has no Pod of that name
        )
        for i, (ns, pod) in enumerate(names)
    )
    state = dataclasses.replace(world.state(), endpoints=endpoints)
    ir = engine.compute(state, fz.NODE)
    usable = [e for e in endpoints if e.node == fz.NODE]
    assert len(usable) >= 4
    packets = [("TCP", 80, None), ("TCP", 8080, None), ("UDP", 53, None), ("ICMP", None, (8, 0))]
    checked = 0
    for _ in range(300):
        a, b = r.choice(usable), r.choice(usable)
        proto, port, icmp = r.choice(packets)
        fam = r.choice([4, 6])
        sa = [x for x in a.addresses if ipaddress.ip_address(x).version == fam]
        da = [x for x in b.addresses if ipaddress.ip_address(x).version == fam]
        if not sa or not da:
            continue
        outside = r.choice(("192.168.0.9", "10.0.0.9")) if fam == 4 else "fd00::5"
        src = sa[0] if r.random() < 0.8 else outside
        src_if = a.interface if src == sa[0] else None
        if proto == "ICMP" and fam == 6:
            proto = "ICMPV6"
        icmp_type, icmp_code = icmp if icmp is not None else (None, None)
        want = engine.explain(
            state, src, da[0], proto, port, icmp_type=icmp_type, icmp_code=icmp_code
        )
        got = ir.evaluate(src, da[0], proto, port, src_if, b.interface, icmp=icmp)
        assert got is want.allowed, (seed, src, da[0], proto, port, want.lines())
        checked += 1
    assert checked > 100


def test_log_rules_and_staged_denials_reach_the_policy_log_naming_the_rule() -> None:
    """A Log rule's packet and one a staged policy would have denied go to NFLOG with the
    rule's counter in the prefix (within the log's rate limit); tabby-node's policy log
    names the rule and says ``log`` / ``would-deny``; the counters carry tier, rule, staged."""
    from dataplane import nfnetlink as nfl
    from policy.state import PolicyDataplane
    from tabby_node import policylog
    from tests.unit.policy.test_visibility import Recorder

    rec = Recorder()
    dp = PolicyDataplane("n1", backend=rec, families=(4,), counter_reader=rec.reset_counters)
    logs = gnp("p", [CalicoRule("Log", protocol=TCP), allow()], selector="app == 'web'")
    staged = gnp("s", [allow(protocol=UDP), deny()], tier=SEC, staged=True)
    state = dataclasses.replace(base(), calico_policies=(logs, staged), tiers=(S10,))
    dp.sync(state)
    text = rec.sent[-1]  # the full table: the first sync replaces it
    keys = counters_of(dp.desired())
    (log_counter,) = [n for n, k in keys.items() if k.policy == "p" and k.verdict == "log"]
    (deny_counter,) = [
        n for n, k in keys.items() if k.staged and k.verdict == "deny" and k.rule != END_OF_TIER
    ]
    assert keys[deny_counter] == CounterKey("", "s", "ingress", "deny", SEC, "ingress[1]", True)
    assert f'log prefix "tabby-log ingress {log_counter}" group 116' in text
    assert f'log prefix "tabby-staged ingress {deny_counter}" group 116' in text
    assert text.count(f'limit name "log-denied" log prefix "tabby-log ingress {log_counter}"') == 1
    assert (
        text.count(f'limit name "log-denied" log prefix "tabby-staged ingress {deny_counter}"') == 1
    )

    flows = policylog.DeniedFlows("n1")
    namer = policylog.Namer(dp)
    tcp = nfl.Packet(4, "10.0.1.1", "10.0.0.1", 6, 40000, 80)
    at = 1_700_000_000.0
    got = policylog.record(
        flows, namer, nfl.LoggedPacket(f"tabby-log ingress {log_counter}", 0, 9, tcp, at)
    )
    assert got is not None
    assert (got.verdict, got.policies, got.src_pod) == (
        "log",
        ("default/p ingress[0]",),
        "b/client",
    )
    got = policylog.record(
        flows, namer, nfl.LoggedPacket(f"tabby-staged ingress {deny_counter}", 0, 9, tcp, at)
    )
    assert got is not None
    assert (got.verdict, got.policies) == ("would-deny", ("security/staged:s ingress[1]",))


def test_a_staged_tier_end_is_counted_and_logged_where_no_staged_rule_decided() -> None:
    """A tier only staged policies select the pod in decides nothing in the kernel; when
    none of their rules would have decided (nor a staged rule of an earlier tier), its end
    is counted into the last staged chain's ``-end`` counter (verdict: the tier's
    defaultAction) and, when it would deny, logged as that policy's ``would-deny``. An
    enforced tier's staged policies add no end: the tier's own end counts it."""
    from dataplane import nfnetlink as nfl
    from policy.state import PolicyDataplane
    from tabby_node import policylog
    from tests.unit.policy.test_visibility import Recorder

    rec = Recorder()
    dp = PolicyDataplane("n1", backend=rec, families=(4,), counter_reader=rec.reset_counters)
    web = "app == 'web'"
    first = gnp("a", [allow(protocol=UDP)], selector=web, tier=SEC, staged=True, order=1)
    last = gnp(
        "b", [CalicoRule("Pass", protocol=TCP)], selector=web, tier=SEC, staged=True, order=2
    )
    state = dataclasses.replace(base(), calico_policies=(first, last), tiers=(S10,))
    dp.sync(state)
    text = rec.sent[-1]
    ir = dp.desired()
    keys = counters_of(ir)
    ends = {n: k for n, k in keys.items() if k.rule == END_OF_TIER}
    assert {k.policy for k in ends.values()} == {"a", "b"}
    assert all(k.verdict == "deny" and k.staged and k.tier == SEC for k in ends.values())
    (prog,) = [p for p in ir.endpoints.values() if p.tiers("ingress")]
    (span,) = [s for s in prog.tiers("ingress") if s.tier == SEC]
    assert not span.enforced
    assert len(span.staged) == 2
    end = staged_end_counter(span.staged[-1])
    assert ends[end].policy == "b"  # the tier's last staged policy names its end
    end_rules = [line for line in text.splitlines() if f'counter name "{end}"' in line]
    assert len(end_rules) == 1
    (line,) = end_rules
    assert "meta mark and 0x0c000000 == 0x00000000" in line  # no staged rule decided
    assert f'log prefix "tabby-staged ingress {end}"' in line
    assert "drop" not in line  # it decides nothing
    assert "accept" not in line
    # the pod stays allowed in the kernel's model (the staged tier is not enforced)
    assert ir.evaluate("10.0.1.1", prog.addresses[0], "tcp", 80, None, prog.interface)

    namer = policylog.Namer(dp)
    tcp = nfl.Packet(4, "10.0.1.1", prog.addresses[0], 6, 40000, 80)
    got = policylog.record(
        policylog.DeniedFlows("n1"),
        namer,
        nfl.LoggedPacket(f"tabby-staged ingress {end}", 0, 9, tcp, 1_700_000_000.0),
    )
    assert got is not None
    assert (got.verdict, got.policies) == ("would-deny", (f"{SEC}/staged:b ingress end-of-tier",))

    # with an enforced policy of the same tier selecting the pod, the tier decides: no end
    enforced = gnp("c", [allow(protocol=UDP)], selector=web, tier=SEC, order=3)
    dp.sync(dataclasses.replace(state, calico_policies=(first, last, enforced)))
    (prog,) = [p for p in dp.desired().endpoints.values() if p.tiers("ingress")]
    (span,) = [s for s in prog.tiers("ingress") if s.tier == SEC]
    assert span.enforced
    text = rec.sent[-1]
    assert "staged end of tier" not in text


def test_a_tier_default_action_change_renames_its_staged_chains() -> None:
    """A staged chain's end counter carries its tier's defaultAction: changing it is a new
    chain (new counters), as an edited policy is."""
    staged = gnp("s", [allow(protocol=UDP)], tier=SEC, staged=True)
    deny_tier = dataclasses.replace(base(), calico_policies=(staged,), tiers=(S10,))
    pass_tier = dataclasses.replace(deny_tier, tiers=(S10_PASS,))
    one = {n for n, c in compute(deny_tier, "n1").chains.items() if c.staged}
    two = compute(pass_tier, "n1")
    assert one
    assert one.isdisjoint(n for n, c in two.chains.items() if c.staged)
    ends = [k for k in counters_of(two).values() if k.rule == END_OF_TIER]
    assert ends
    assert all(k.verdict == "pass" for k in ends)


def test_the_policies_selecting_a_pod_in_the_order_they_are_walked() -> None:
    state = dataclasses.replace(
        base(),
        policies=(knp("a", "k8s"),),
        calico_policies=(
            gnp("late", [allow()], order=2000),
            gnp("sec", [deny()], tier=SEC),
            np("a", "early", [allow()], order=5, egress=[allow()]),
            gnp("s", [deny()], staged=True, selector="app == 'db'"),
        ),
        tiers=(S10,),
    )
    assert engine.selecting_policies(state, "a", "web") == {
        "ingress": ["security/sec", "default/a/early", "a/k8s", "default/late"],
        "egress": ["default/a/early"],
    }
    assert engine.selecting_policies(state, "a", "db")["ingress"][-1] == "default/staged:s"


def test_a_staged_policy_stands_in_for_its_enforced_namesake_in_explains_would() -> None:
    """Calico's ``stagedAction: Set``: were it enforced, the staged policy would replace the
    policy of its name; explain's "would" walks it in that policy's place."""
    web = "app == 'web'"
    enforced = gnp("p", [deny()], selector=web)
    staged = gnp("p", [allow()], selector=web, staged=True)
    state = dataclasses.replace(base(), calico_policies=(enforced, staged))
    v = engine.explain(state, CLIENT, WEB, "TCP", 80).ingress
    assert v is not None
    assert not v.allowed
    assert v.staged.startswith("would have allowed")
    # another name: both in the walk, the enforced one's Deny first (by name)
    other = gnp("q", [allow()], selector=web, staged=True)
    state = dataclasses.replace(base(), calico_policies=(enforced, other))
    v = engine.explain(state, CLIENT, WEB, "TCP", 80).ingress
    assert v is not None
    assert v.staged.startswith("would have denied")
