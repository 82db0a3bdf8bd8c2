"""The policy engine against the Kubernetes e2e NetworkPolicy truth table, plus the subtle rules.

Every truth-table step is checked three ways over the full matrix (9 pods x 8 peers x TCP,
UDP, SCTP x 80, 81): the direct evaluation (``explain``), the IR on one node, and the IR with
the pods spread over three nodes (egress decided on the source's node, ingress on the
destination's), so the compilation into sets and chains is checked, not only the semantics.
"""

from __future__ import annotations

import dataclasses
import ipaddress

import pytest

from policy import engine
from policy.engine import (
    ClusterState,
    ContainerPort,
    DesiredState,
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
from tests import policy_truth_table as tt
from tests.policy_truth_table import (
    ALL,
    CASES,
    Case,
    address,
    build_state,
    default_iface,
    matrix,
    pol,
    rule,
    sel,
    tcp,
    udp,
)

STEPS = [
    pytest.param(case, i, id=f"{case.id}[step{i}]")
    for case in CASES
    for i in range(len(case.steps))
]


def _split(pod: str) -> tuple[str, str]:
    ns, name = pod.split("/")
    return ns, name


def _diff(
    got: dict[tuple[str, str, str, int], bool], want: dict[tuple[str, str, str, int], bool]
) -> list[str]:
    return [
        f"{s} -> {d} {pr}/{po}: got {'allow' if got[k] else 'deny'}"
        for k, w in sorted(want.items())
        if got[k] != w
        for s, d, pr, po in [k]
    ]


def test_truth_table_has_the_40_e2e_cases_and_derived_extras() -> None:
    numbered = {c.number for c in CASES if isinstance(c.number, int)}
    assert numbered == set(range(1, 41))
    assert len(CASES) >= 46
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize(("case", "step"), STEPS)
def test_e2e_netpol_direct(case: Case, step: int) -> None:
    st = case.steps[step]
    state = build_state(st)
    want = matrix(st.expect)
    got = {k: engine.allowed(state, _split(k[0]), _split(k[1]), k[2], k[3]) for k in want}
    assert not _diff(got, want)


def _ir_matrix(
    states: dict[str, DesiredState], node_of: dict[str, str], keys: list[tuple[str, str, str, int]]
) -> dict[tuple[str, str, str, int], bool]:
    out = {}
    for s, d, pr, po in keys:
        src_ir, dst_ir = states[node_of[s]], states[node_of[d]]
        ok = src_ir.evaluate(address(s), address(d), pr, po, default_iface(s), None)
        ok = ok and dst_ir.evaluate(address(s), address(d), pr, po, None, default_iface(d))
        out[(s, d, pr, po)] = ok
    return out


@pytest.mark.parametrize(("case", "step"), STEPS)
def test_e2e_netpol_ir_one_node(case: Case, step: int) -> None:
    st = case.steps[step]
    ir = engine.compute(build_state(st), "node1", families=(4,))
    want = matrix(st.expect)
    got = _ir_matrix({"node1": ir}, dict.fromkeys(tt.PODS, "node1"), list(want))
    assert not _diff(got, want)


@pytest.mark.parametrize(("case", "step"), STEPS)
def test_e2e_netpol_ir_three_nodes(case: Case, step: int) -> None:
    st = case.steps[step]
    node_of = {p: f"node{i % 3}" for i, p in enumerate(tt.PODS)}
    state = build_state(st, node_of=node_of.__getitem__)
    irs = {n: engine.compute(state, n) for n in set(node_of.values())}
    for n, ir in irs.items():  # each node programs only its own endpoints
        assert {p.interface for p in ir.endpoints.values()} == {
            default_iface(p) for p, pn in node_of.items() if pn == n
        }
    want = matrix(st.expect)
    assert not _diff(_ir_matrix(irs, node_of, list(want)), want)


# --- focused: defaulting and emptiness ---------------------------------------------------------


def _state(*policies: Policy, pods: tuple[Pod, ...] = ()) -> ClusterState:
    base = build_state(tt.Step(policies, tt.everything))
    if pods:
        keep = {(p.namespace, p.name) for p in pods}
        base = dataclasses.replace(
            base, pods=tuple(p for p in base.pods if (p.namespace, p.name) not in keep) + pods
        )
    return base


def test_policy_types_default_to_ingress_plus_egress_only_with_egress_rules() -> None:
    assert pol("p").types == {"ingress"}
    assert pol("p", egress=()).types == {"ingress"}
    assert pol("p", egress=(rule(),)).types == {"ingress", "egress"}
    assert pol("p", types=("Egress",)).types == {"egress"}
    # a deny-egress policy written without policyTypes only isolates ingress
    st = _state(pol("p", tt.A))
    assert not engine.allowed(st, ("y", "a"), ("x", "a"), "TCP", 80)
    assert engine.allowed(st, ("x", "a"), ("y", "a"), "TCP", 80)


def test_empty_rule_list_isolates_and_empty_rule_allows_all() -> None:
    assert not engine.allowed(_state(pol("p", tt.A, ingress=())), ("x", "b"), ("x", "a"))
    assert engine.allowed(_state(pol("p", tt.A, ingress=(rule(),))), ("z", "c"), ("x", "a"))


def test_empty_pod_selector_peer_means_the_policys_own_namespace_only() -> None:
    st = _state(pol("p", tt.A, ingress=(rule(Peer(ALL)),)))
    assert engine.allowed(st, ("x", "c"), ("x", "a"))
    assert not engine.allowed(st, ("y", "c"), ("x", "a"))
    st = _state(pol("p", tt.A, ingress=(rule(Peer(None, ALL)),)))
    assert engine.allowed(st, ("y", "c"), ("x", "a"))


def test_selectors_do_not_match_addresses_outside_pods() -> None:
    st = _state(pol("p", tt.A, ingress=(rule(Peer(None, ALL)),)))
    assert not engine.allowed(st, "192.0.2.1", ("x", "a"))
    st = _state(pol("p", tt.A, ingress=(rule(Peer(ip_block=IPBlock("192.0.2.0/24"))),)))
    assert engine.allowed(st, "192.0.2.1", ("x", "a"))
    assert not engine.allowed(st, "192.0.3.1", ("x", "a"))


def test_not_in_and_does_not_exist_match_absent_keys() -> None:
    r = Requirement("tier", "NotIn", ("db",))
    assert r.matches({})
    assert r.matches({"tier": "web"})
    assert not r.matches({"tier": "db"})
    assert Requirement("tier", "DoesNotExist").matches({})
    assert not Requirement("tier", "Exists").matches({})
    s = LabelSelector.of({"a": "1"}, Requirement("b", "In", ("x", "y")))
    labels = {"a": "1", "b": "y"}
    assert s.matches(labels, frozenset(labels.items()))
    labels = {"a": "1"}
    assert not s.matches(labels, frozenset(labels.items()))
    assert s.text() == "a=1,b in (x,y)"


def test_every_namespace_carries_its_name_label_even_without_a_resource() -> None:
    st = _state(
        pol("p", tt.A, ingress=(rule(Peer(None, sel(**{"kubernetes.io/metadata.name": "q"}))),))
    )
    st = st.with_endpoint(Endpoint("q", "qa", "node1", "caliqa", ("10.244.9.1",)))
    assert engine.allowed(st, ("q", "qa"), ("x", "a"))
    assert not engine.allowed(st, ("y", "a"), ("x", "a"))


# --- focused: ports ------------------------------------------------------------------------------


def test_port_without_protocol_is_tcp() -> None:
    assert PortSpec(port=80).protocol == "TCP"


def test_named_ports_resolve_on_the_selected_pod_for_ingress_and_the_peer_for_egress() -> None:
    # "web" is 8080 on x/a and 9090 on y/b: each side uses its own number.
    pods = (
        Pod("x", "a", (("pod", "a"),), (ContainerPort("web", 8080),)),
        Pod("y", "b", (("pod", "b"),), (ContainerPort("web", 9090),)),
    )
    ing = _state(pol("in", tt.A, ingress=(rule(ports=(tcp("web"),)),)), pods=pods)
    assert engine.allowed(ing, ("y", "b"), ("x", "a"), "TCP", 8080)
    assert not engine.allowed(ing, ("y", "b"), ("x", "a"), "TCP", 9090)
    egr = _state(
        pol("out", tt.A, egress=(rule(ports=(tcp("web"),)),), types=("Egress",)), pods=pods
    )
    assert engine.allowed(egr, ("x", "a"), ("y", "b"), "TCP", 9090)
    assert not engine.allowed(egr, ("x", "a"), ("y", "b"), "TCP", 8080)
    # a peer without the name is not reachable on any port by name
    assert not engine.allowed(egr, ("x", "a"), ("z", "c"), "TCP", 8080)
    for st in (ing, egr):
        ir = engine.compute(st, "node1", (4,))
        named = [n for n, d in ir.sets.items() if d.kind == "named-port"]
        assert len(named) == 1
        assert ir.elements[named[0]] == {
            (address("x/a"), "tcp", 8080),
            (address("y/b"), "tcp", 9090),
        }
    ir = engine.compute(egr, "node1", (4,))
    assert ir.evaluate(address("x/a"), address("y/b"), "TCP", 9090, "calixa", None)
    assert not ir.evaluate(address("x/a"), address("y/b"), "TCP", 8080, "calixa", None)


def test_end_port_is_inclusive_and_validated() -> None:
    st = _state(pol("p", tt.A, ingress=(rule(ports=(tcp(80, 90),)),)))
    assert engine.allowed(st, ("x", "b"), ("x", "a"), "TCP", 90)
    assert not engine.allowed(st, ("x", "b"), ("x", "a"), "TCP", 91)
    with pytest.raises(ValueError, match="numeric"):
        PortSpec("TCP", "web", 90)
    with pytest.raises(ValueError, match="endPort"):
        PortSpec("TCP", 90, 80)
    with pytest.raises(ValueError, match="protocol"):
        PortSpec("ICMP", 80)  # type: ignore[arg-type]


def test_port_ranges_merge_and_a_whole_protocol_absorbs_its_ports() -> None:
    p = pol(
        "p",
        tt.A,
        ingress=(rule(ports=(tcp(80), tcp(81), tcp(85, 90), tcp(88, 95), udp(53), udp())),),
    )
    ir = engine.compute(_state(p), "node1", (4,))
    (chain,) = ir.chains.values()
    assert [(r.protocol, r.ports) for r in chain.rules] == [
        ("tcp", ((80, 81), (85, 95))),
        ("udp", ()),
    ]


def test_portless_traffic_matches_only_rules_without_ports() -> None:
    st = _state(pol("p", tt.A, ingress=(rule(Peer(sel(pod="b"))), rule(ports=(tcp(80),)))))
    assert engine.allowed(st, ("x", "b"), ("x", "a"), "ICMP", None)
    assert not engine.allowed(st, ("x", "c"), ("x", "a"), "ICMP", None)


# --- focused: ipBlock ----------------------------------------------------------------------


def test_ip_block_prefixes_exclude_the_excepts() -> None:
    b = IPBlock("10.0.0.0/24", ("10.0.0.128/25", "10.0.0.5/32"))
    nets = [str(n) for n in b.prefixes()]
    covered = {a for n in b.prefixes() for a in ipaddress.ip_network(n)}
    want = {a for a in ipaddress.ip_network("10.0.0.0/24") if b.contains(a)}
    assert covered == want
    assert "10.0.0.0/30" in nets
    assert IPBlock("10.0.0.0/24", ("10.0.0.0/16",)).prefixes() == ()
    assert IPBlock("10.0.0.7/24").cidr == "10.0.0.0/24"


def test_ip_block_is_exclusive_with_selectors_and_a_peer_needs_something() -> None:
    with pytest.raises(ValueError, match="ipBlock"):
        Peer(ALL, None, IPBlock("10.0.0.0/8"))
    with pytest.raises(ValueError, match="needs"):
        Peer()


# --- focused: labels, live changes, IR structure -------------------------------------------------


def test_pod_resource_labels_win_over_the_endpoint_labels() -> None:
    ep = Endpoint("x", "n", "node1", "calin", ("10.244.1.99",), labels=(("pod", "a"),))
    st = _state(pol("p", tt.A, types=("Ingress",))).with_endpoint(ep)
    assert not engine.allowed(st, ("x", "b"), ("x", "n"))  # endpoint labels: selected
    st = st.with_endpoint(ep, Pod("x", "n", (("pod", "other"),)))
    assert engine.allowed(st, ("x", "b"), ("x", "n"))


def test_pod_churn_changes_set_elements_not_chains() -> None:
    p = pol("p", tt.A, ingress=(rule(Peer(sel(pod="b"), ALL)),))
    before = engine.compute(_state(p), "node1")
    new = Endpoint(
        "z", "b2", "node7", "calizb2", ("10.244.3.99", "fd00::99"), labels=(("pod", "b"),)
    )
    after = engine.compute(_state(p).with_endpoint(new), "node1")
    assert after.chains == before.chains
    assert after.endpoints == before.endpoints  # remote pod: no chain here
    changed = {n for n in after.elements if after.elements[n] != before.elements[n]}
    assert len(changed) == 2  # the selector's IPv4 and IPv6 sets
    assert all(after.sets[n].kind == "addr" for n in changed)
    assert engine.compute(_state(p).with_endpoint(new), "node1") == after  # deterministic


def test_relabelling_a_namespace_changes_only_elements() -> None:
    p = pol("p", tt.A, ingress=(rule(Peer(None, sel(team="blue"))),))
    before = engine.compute(_state(p), "node1")
    st = dataclasses.replace(
        _state(p),
        namespaces=tuple(
            Namespace(n.name, (*n.labels, ("team", "blue"))) if n.name == "y" else n
            for n in _state(p).namespaces
        ),
    )
    after = engine.compute(st, "node1")
    assert after.chains == before.chains
    assert after.sets == before.sets
    (name,) = [n for n in after.elements if after.elements[n] != before.elements[n]]
    assert after.elements[name] == {address(f"y/{x}") for x in "abc"}


def test_a_policy_that_selects_nothing_changes_nothing() -> None:
    base = engine.compute(_state(), "node1")
    nothing = pol("nothing", sel(pod="nobody"), ingress=(rule(Peer(sel(pod="b"))),))
    got = engine.compute(_state(nothing), "node1")
    assert got.chains == base.chains == {}
    assert got.sets == base.sets
    assert got.endpoints == base.endpoints
    assert all(p.ingress is None and p.egress is None for p in got.endpoints.values())


def test_policy_chains_are_shared_and_endpoint_programs_list_them() -> None:
    st = _state(tt.DENY_INGRESS, pol("allow-a", tt.A, ingress=(rule(Peer(ALL, ALL)),)))
    ir = engine.compute(st, "node1")
    assert len(ir.chains) == 2
    xa, xb, ya = ir.endpoints["calixa"], ir.endpoints["calixb"], ir.endpoints["caliya"]
    assert xa.ingress is not None
    assert len(xa.ingress) == 2
    assert xb.ingress is not None
    assert len(xb.ingress) == 1
    assert xa.egress is None
    assert ya.ingress is None
    deny = ir.chains[xb.ingress[0]]
    assert deny.rules == ()
    assert deny.policy == "x/default-deny-ingress"
    assert ir.rule_count == 2  # allow-a: one rule per family


def test_distinct_selectors_share_one_set() -> None:
    p1 = pol("p1", tt.A, ingress=(rule(Peer(sel(pod="b"))),))
    p2 = pol("p2", sel(pod="c"), ingress=(rule(Peer(sel(pod="b"))),))
    p3 = pol("p3", sel(pod="c"), ingress=(rule(Peer(sel(pod="b"), sel(ns="x"))),))
    ir = engine.compute(_state(p1, p2, p3), "node1", (4,))
    addr_sets = sorted(n for n, d in ir.sets.items() if d.kind == "addr")
    assert len(addr_sets) == 2  # same-namespace {pod=b}; nsSel {ns=x} AND {pod=b}
    assert ir.elements[addr_sets[0]] == ir.elements[addr_sets[1]] == {address("x/b")}


def test_explain_names_policies_and_rules() -> None:
    st = build_state(tt.CASES[13].steps[0])  # 14: from y on TCP 81
    ex = engine.explain(st, ("y", "c"), ("x", "a"), "tcp", 81)
    assert ex.allowed
    assert ex.ingress is not None
    assert ex.ingress.allowed_by == ("x/x-a-y-81 ingress[0]",)
    assert ex.egress is not None
    assert not ex.egress.isolated
    ex = engine.explain(st, ("y", "c"), ("x", "a"), "TCP", 80)
    assert not ex.allowed
    text = "\n".join(ex.lines())
    assert "DENIED" in text
    assert "x/x-a-y-81" in text
    assert "none of their 1 ingress rule" in text
    ex = engine.explain(st, address("y/c"), address("x/a"), "TCP", 81)
    assert ex.src == f"y/c ({address('y/c')})"
    assert ex.allowed
    with pytest.raises(LookupError):
        engine.explain(st, ("y", "nope"), ("x", "a"))
    assert engine.selecting_policies(st, "x", "a") == {"ingress": ["x/x-a-y-81"], "egress": []}


def test_explain_an_outside_address_decides_only_the_pod_side() -> None:
    st = _state(tt.DENY_ALL)
    ex = engine.explain(st, ("x", "a"), "198.51.100.7", "UDP", 53)
    assert ex.ingress is None
    assert ex.egress is not None
    assert not ex.allowed
    assert engine.allowed(st, ("y", "a"), "198.51.100.7", "UDP", 53)


def test_unknown_interface_is_dropped_by_the_ir() -> None:
    ir = engine.compute(_state(), "node1")
    assert ir.evaluate(address("x/a"), address("x/b"), "TCP", 80, "calixa", "calixb")
    assert not ir.evaluate(address("x/a"), address("x/b"), "TCP", 80, "calixa", "calinew")


def test_rules_cover_both_families_for_selector_peers_and_one_for_ip_blocks() -> None:
    p = pol(
        "p",
        tt.A,
        ingress=(rule(Peer(sel(pod="b")), Peer(ip_block=IPBlock("fd00::/64")), ports=(tcp(80),)),),
    )
    ir = engine.compute(_state(p), "node1")
    (chain,) = ir.chains.values()
    assert sorted((r.family, ir.sets[r.peer_set].kind) for r in chain.rules if r.peer_set) == [
        (4, "addr"),
        (6, "addr"),
        (6, "cidr"),
    ]
    assert all(r.protocol == "tcp" and r.ports == ((80, 80),) for r in chain.rules)


def test_invalid_inputs_are_refused() -> None:
    with pytest.raises(ValueError, match="operator"):
        Requirement("a", "Has", ())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="values"):
        Requirement("a", "In", ())
    with pytest.raises(ValueError, match="policy type"):
        Policy("x", "p", policy_types=("Both",))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="family"):
        IPBlock("10.0.0.0/8", ("fd00::/64",))
    assert Rule().peers == ()


# --- adapter: resource models -> engine inputs -------------------------------------------------


def test_adapter_from_resource_models() -> None:
    k8s = pytest.importorskip("resources.k8s")
    adapter = pytest.importorskip("policy.inputs")

    np = k8s.NetworkPolicy.model_validate(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": {"name": "web", "namespace": "x"},
            "spec": {
                "podSelector": {"matchLabels": {"pod": "a"}},
                "ingress": [
                    {
                        "from": [
                            {
                                "namespaceSelector": {
                                    "matchExpressions": [
                                        {"key": "ns", "operator": "NotIn", "values": ["x"]}
                                    ]
                                },
                                "podSelector": {"matchLabels": {"pod": "b"}},
                            },
                            {"ipBlock": {"cidr": "10.0.0.0/8", "except": ["10.1.0.0/16"]}},
                        ],
                        "ports": [{"port": "serve-80-tcp"}, {"port": 81, "endPort": 90}],
                    }
                ],
                "egress": [{}],
            },
        }
    )
    got = adapter.policy(np)
    assert got.types == {"ingress", "egress"}  # the model's defaulting
    assert got.pod_selector == tt.sel(pod="a")
    (r,) = got.ingress
    assert r.peers[0] == Peer(sel(pod="b"), tt.expr("ns", "NotIn", "x"))
    assert r.peers[1] == Peer(ip_block=IPBlock("10.0.0.0/8", ("10.1.0.0/16",)))
    assert r.ports == (PortSpec("TCP", "serve-80-tcp"), PortSpec("TCP", 81, 90))
    assert got.egress == (Rule(),)
    ns = adapter.namespace(
        k8s.Namespace.model_validate(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": "y"}}
        )
    )
    assert ns.effective_labels == {"kubernetes.io/metadata.name": "y"}
    pod = adapter.pod(
        k8s.Pod.model_validate(
            {
                "apiVersion": "v1",
                "kind": "Pod",
                "metadata": {"name": "a", "namespace": "x", "labels": {"pod": "a"}},
                "spec": {
                    "containers": [
                        {
                            "name": "c",
                            "ports": [{"name": "dns", "containerPort": 53, "protocol": "UDP"}],
                        }
                    ]
                },
            }
        )
    )
    assert pod.ports == (ContainerPort("dns", 53, "UDP"),)
    from resources.tabby import WorkloadEndpoint

    wep = {
        "apiVersion": "tabby.io/v1",
        "kind": "WorkloadEndpoint",
        "metadata": {"name": "n1-k8s-a-eth0", "namespace": "x", "labels": {"pod": "a"}},
        "spec": {
            "node": "n1",
            "pod": "a",
            "containerID": "c1",
            "interface": "eth0",
            "hostInterface": "cali0123456789a",
            "ipNetworks": ["10.244.0.5/32"],
        },
    }
    ep = adapter.endpoint(WorkloadEndpoint.model_validate(wep))
    assert ep == Endpoint(
        "x", "a", "n1", "cali0123456789a", ("10.244.0.5",), "n1-k8s-a-eth0", (("pod", "a"),)
    )
    state = adapter.cluster_state([np], [], [], [])
    assert state.policies == (got,)


def test_an_endpoint_without_host_interface_counts_for_sets_but_gets_no_chains() -> None:
    p = pol("p", tt.A, ingress=(rule(Peer(sel(pod="b"))),))
    ep = Endpoint("x", "b9", "node1", "", ("10.244.1.99",), labels=(("pod", "b"),))
    ir = engine.compute(_state(p).with_endpoint(ep), "node1", (4,))
    assert "" not in ir.endpoints
    assert any("10.244.1.99" in e for e in ir.elements.values())


def test_explain_node_traffic_cidrs_and_pods_without_endpoints() -> None:
    st = _state(tt.DENY_INGRESS)
    ex = engine.explain(
        st, "10.99.0.1", ("x", "a"), "TCP", 80, node="node1", host_addresses=["10.99.0.1"]
    )
    assert ex.allowed
    assert ex.ingress is not None
    assert "not policed" in ex.ingress.reason
    # another node's address is policed like any outside address
    assert not engine.explain(
        st, "10.99.0.2", ("x", "a"), "TCP", 80, node="node1", host_addresses=["10.99.0.1"]
    ).allowed
    ex = engine.explain(st, f"{address('y/a')}/32", ("x", "a"))
    assert ex.src.startswith("y/a")
    st = dataclasses.replace(st, pods=(*st.pods, Pod("x", "lonely", (("pod", "a"),))))
    assert engine.selecting_policies(st, "x", "lonely") == {
        "ingress": ["x/default-deny-ingress"],
        "egress": [],
    }
    assert engine.selecting_policies(st, "x", "nobody") == {"ingress": [], "egress": []}


def test_adapter_from_endpoint_and_pool_models() -> None:
    models = pytest.importorskip("resources.tabby")
    adapter = pytest.importorskip("policy.inputs")
    wep = models.WorkloadEndpoint.model_validate(
        {
            "apiVersion": "tabby.io/v1",
            "kind": "WorkloadEndpoint",
            "metadata": {"name": "n1-k8s-a-eth0", "namespace": "x", "labels": {"pod": "a"}},
            "spec": {
                "node": "n1",
                "pod": "a",
                "containerID": "c1",
                "interface": "eth0",
                "ipNetworks": ["10.244.0.5/32"],
            },
        }
    )
    ep = adapter.endpoint(wep)
    assert (ep.node, ep.interface, ep.addresses) == ("n1", "", ("10.244.0.5",))
    pools = [
        models.IPPool.model_validate(
            {
                "apiVersion": "tabby.io/v1",
                "kind": "IPPool",
                "metadata": {"name": n},
                "spec": {"cidr": c, "natOutgoing": nat},
            }
        )
        for n, c, nat in (("p1", "10.244.0.0/16", True), ("p2", "10.250.0.0/16", False))
    ]
    assert adapter.nat(pools).pools == (("10.244.0.0/16", True), ("10.250.0.0/16", False))
