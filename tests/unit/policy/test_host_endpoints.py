"""Host endpoints in the engine: Calico's semantics for traffic to, from and through the node
(normal, applyOnForward, preDNAT and doNotTrack policy, the ``"*"`` interface, expected IPs
in selectors, the failsafe ports), as ``explain`` gives them; the IR and its nft text; the
incremental engine's deltas for host endpoints; the inputs from the resources.

The node ``n1`` has a pod (``a/web``, 10.244.0.5 on ``cali1``) and the host endpoint
``n1-eth0`` (``eth0``, 192.168.0.10, ``role=node``); ``n2`` has ``n2-eth0`` (192.168.0.20).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from policy import engine
from policy.calico import (
    CalicoPolicy,
    CalicoRule,
    EntityMatch,
    FailsafePort,
    Failsafes,
    HostEndpoint,
    PortMatch,
    parse_failsafe_ports,
    protocol_number,
)
from policy.engine import ClusterState, Endpoint, Namespace, Pod
from policy.incremental import IncrementalPolicy, Update
from policy.render import Renderer, Snapshot
from resources.selector import parse_selector, rule_selector

TCP, UDP = protocol_number("TCP"), protocol_number("UDP")
NODE = "n1"
HOST = "192.168.0.10"
PEER = "192.168.0.99"  # outside the cluster
WEB = "10.244.0.5"
NODES = parse_selector("role == 'node'")
ME = HostEndpoint("n1-eth0", NODE, "eth0", (HOST,), (("role", "node"),))
OTHER = HostEndpoint("n2-eth0", "n2", "eth0", ("192.168.0.20",), (("role", "node"),))
STAR = HostEndpoint("n1-all", NODE, "*", (), (("role", "node"), ("all", "yes")))


def both() -> frozenset[engine.Direction]:
    return frozenset({"ingress", "egress"})


def deny_all(**flags: Any) -> CalicoPolicy:
    """Every direction the flags allow (preDNAT: ingress only)."""
    rules = (CalicoRule("Deny"),)
    types: frozenset[engine.Direction] = frozenset({"ingress"}) if flags.get("pre_dnat") else both()
    egress = () if flags.get("pre_dnat") else rules
    return CalicoPolicy("deny-all", None, NODES, types=types, ingress=rules, egress=egress, **flags)


def allow_port(name: str, protocol: int, port: int, **flags: Any) -> CalicoPolicy:
    rule = CalicoRule("Allow", protocol, destination=EntityMatch(ports=(PortMatch(port, port),)))
    return CalicoPolicy(name, None, NODES, order=10, ingress=(rule,), **flags)


def state(*policies: CalicoPolicy, hosts: tuple[HostEndpoint, ...] = (ME, OTHER)) -> ClusterState:
    return ClusterState(
        namespaces=(Namespace("a"),),
        pods=(Pod("a", "web", (("app", "web"),)),),
        endpoints=(Endpoint("a", "web", NODE, "cali1", (WEB,)),),
        calico_policies=policies,
        host_endpoints=hosts,
    )


def explain(
    st: ClusterState, src: str, dst: str, proto: str, port: int, **kw: Any
) -> engine.Explanation:
    kw.setdefault("node", NODE)
    kw.setdefault("workload_prefix", "cali")
    return engine.explain(st, src, dst, proto, port, **kw)


# --- the semantics table -------------------------------------------------------------------

AOF: dict[str, Any] = {"apply_on_forward": True}
PREDNAT: dict[str, Any] = {"pre_dnat": True, "apply_on_forward": True}
UNTRACKED: dict[str, Any] = {"do_not_track": True, "apply_on_forward": True}

#: (what, policies, hosts, src, dst, protocol, port, extra, allowed, the deciding stage text)
CASES: list[
    tuple[
        str,
        tuple[CalicoPolicy, ...],
        tuple[HostEndpoint, ...],
        str,
        str,
        str,
        int,
        dict[str, object],
        bool,
        str,
    ]
] = [
    (
        "no policy: the host's own traffic denied",
        (),
        (ME,),
        PEER,
        HOST,
        "TCP",
        80,
        {},
        False,
        "ingress: no policy selects it",
    ),
    (
        "no policy: failsafe SSH in",
        (),
        (ME,),
        PEER,
        HOST,
        "TCP",
        22,
        {},
        True,
        "failsafe port tcp:22",
    ),
    (
        "no policy: failsafe DHCP in",
        (),
        (ME,),
        PEER,
        HOST,
        "UDP",
        68,
        {},
        True,
        "failsafe port udp:68",
    ),
    ("no policy: out to DNS", (), (ME,), HOST, PEER, "UDP", 53, {}, True, "failsafe port udp:53"),
    (
        "no policy: out elsewhere",
        (),
        (ME,),
        HOST,
        PEER,
        "TCP",
        443,
        {},
        False,
        "egress: no policy selects it",
    ),
    (
        "no policy: forwarded in to a pod allowed",
        (),
        (ME,),
        PEER,
        WEB,
        "TCP",
        80,
        {"in_interface": "eth0"},
        True,
        "forward-ingress: no applyOnForward policy",
    ),
    ("deny-all: API server", (deny_all(),), (ME,), PEER, HOST, "TCP", 6443, {}, True, "tcp:6443"),
    ("deny-all: etcd", (deny_all(),), (ME,), PEER, HOST, "TCP", 2379, {}, True, "tcp:2379"),
    ("deny-all: BGP", (deny_all(),), (ME,), PEER, HOST, "TCP", 179, {}, True, "tcp:179"),
    ("deny-all: typha", (deny_all(),), (ME,), PEER, HOST, "TCP", 5473, {}, True, "tcp:5473"),
    (
        "deny-all: another port",
        (deny_all(),),
        (ME,),
        PEER,
        HOST,
        "TCP",
        8080,
        {},
        False,
        "ingress: by default/deny-all ingress[0] (Deny)",
    ),
    ("deny-all: out to etcd", (deny_all(),), (ME,), HOST, PEER, "TCP", 2379, {}, True, "tcp:2379"),
    (
        "deny-all: out elsewhere",
        (deny_all(),),
        (ME,),
        HOST,
        PEER,
        "TCP",
        443,
        {},
        False,
        "egress: by default/deny-all egress[0] (Deny)",
    ),
    (
        "deny-all without applyOnForward: forwarded allowed",
        (deny_all(),),
        (ME,),
        PEER,
        WEB,
        "TCP",
        80,
        {"in_interface": "eth0"},
        True,
        "forward-ingress: no applyOnForward policy",
    ),
    (
        "deny-all with applyOnForward: forwarded denied",
        (deny_all(**AOF),),
        (ME,),
        PEER,
        WEB,
        "TCP",
        80,
        {"in_interface": "eth0"},
        False,
        "forward-ingress: by default/deny-all",
    ),
    (
        "applyOnForward: a pod out through eth0 denied",
        (deny_all(**AOF),),
        (ME,),
        WEB,
        PEER,
        "TCP",
        80,
        {"out_interface": "eth0"},
        False,
        "forward-egress: by default/deny-all",
    ),
    (
        "applyOnForward allow beats nothing",
        (deny_all(**AOF), allow_port("web", TCP, 80, **AOF)),
        (ME,),
        PEER,
        WEB,
        "TCP",
        80,
        {"in_interface": "eth0"},
        True,
        "forward-ingress: by default/web",
    ),
    (
        "preDNAT allow skips normal policy",
        (deny_all(), allow_port("pre", TCP, 8080, **PREDNAT)),
        (ME,),
        PEER,
        HOST,
        "TCP",
        8080,
        {},
        True,
        "prednat-ingress: by default/pre ingress[0]",
    ),
    (
        "preDNAT no match: on to normal policy",
        (deny_all(), allow_port("pre", TCP, 8080, **PREDNAT)),
        (ME,),
        PEER,
        HOST,
        "TCP",
        8081,
        {},
        False,
        "ingress: by default/deny-all",
    ),
    (
        "preDNAT deny: forwarded to a pod",
        (deny_all(**PREDNAT),),
        (ME,),
        PEER,
        WEB,
        "TCP",
        80,
        {"in_interface": "eth0"},
        False,
        "prednat-ingress: by default/deny-all ingress[0] (Deny)",
    ),
    (
        "preDNAT deny cannot close a failsafe port",
        (deny_all(**PREDNAT),),
        (ME,),
        PEER,
        HOST,
        "TCP",
        22,
        {},
        True,
        "failsafe port tcp:22",
    ),
    (
        "doNotTrack allow skips the rest",
        (deny_all(), allow_port("raw", UDP, 9000, **UNTRACKED)),
        (ME,),
        PEER,
        HOST,
        "UDP",
        9000,
        {},
        True,
        "untracked-ingress: by default/raw ingress[0]",
    ),
    (
        "doNotTrack deny",
        (deny_all(**UNTRACKED),),
        (ME,),
        PEER,
        HOST,
        "TCP",
        80,
        {},
        False,
        "untracked-ingress: by default/deny-all ingress[0] (Deny)",
    ),
    (
        "doNotTrack deny cannot close a failsafe port",
        (deny_all(**UNTRACKED),),
        (ME,),
        PEER,
        HOST,
        "TCP",
        2379,
        {},
        True,
        "failsafe port tcp:2379",
    ),
    (
        "doNotTrack egress deny",
        (deny_all(**UNTRACKED),),
        (ME,),
        HOST,
        PEER,
        "TCP",
        443,
        {},
        False,
        "untracked-egress: by default/deny-all egress[0] (Deny)",
    ),
    (
        "* endpoint: any interface",
        (deny_all(),),
        (STAR,),
        PEER,
        HOST,
        "TCP",
        80,
        {"in_interface": "eth1", "host_addresses": [HOST]},
        False,
        "ingress: by default/deny-all",
    ),
    (
        "* endpoint: a named one wins on its interface",
        (allow_port("eth0", TCP, 80),),
        (
            dataclasses.replace(ME, labels=(("role", "node"),)),
            dataclasses.replace(STAR, labels=(("x", "y"),)),
        ),
        PEER,
        HOST,
        "TCP",
        80,
        {"in_interface": "eth0"},
        True,
        "ingress: by default/eth0",
    ),
    (
        "* endpoint: not a workload's interface",
        (deny_all(),),
        (STAR,),
        WEB,
        HOST,
        "TCP",
        80,
        {"in_interface": "cali1"},
        True,
        "",
    ),
    (
        "a pod to its host: workload policy only",
        (deny_all(),),
        (ME,),
        WEB,
        HOST,
        "TCP",
        80,
        {},
        True,
        "",
    ),
]


@pytest.mark.parametrize(
    ("what", "policies", "hosts", "src", "dst", "proto", "port", "extra", "allowed", "reason"),
    CASES,
    ids=[c[0] for c in CASES],
)
def test_semantics(
    what: str,
    policies: tuple[CalicoPolicy, ...],
    hosts: tuple[HostEndpoint, ...],
    src: str,
    dst: str,
    proto: str,
    port: int,
    extra: dict[str, object],
    allowed: bool,
    reason: str,
) -> None:
    ex = explain(state(*policies, hosts=hosts), src, dst, proto, port, **extra)
    assert ex.allowed is allowed, ex.lines()
    if reason:
        assert ex.host, ex.lines()
        assert reason in ex.host[-1].reason, ex.lines()
    else:
        assert not ex.host, ex.lines()


def test_untracked_and_prednat_policies_do_not_apply_to_workloads() -> None:
    pol = CalicoPolicy(
        "raw", None, parse_selector("all()"), ingress=(CalicoRule("Deny"),), **UNTRACKED
    )
    pre = dataclasses.replace(pol, name="pre", do_not_track=False, pre_dnat=True)
    st = state(pol, pre)
    ex = explain(st, PEER, WEB, "TCP", 80, node=None)
    assert ex.allowed
    assert ex.ingress is not None
    assert not ex.ingress.selecting
    assert engine.selecting_policies(st, "a", "web") == {"ingress": [], "egress": []}


def test_a_rule_selector_matches_a_host_endpoints_expected_ips() -> None:
    """A workload's egress to ``role == 'node'``: the host endpoints' expected IPs, every
    node's; nothing else."""
    to_nodes = CalicoRule(
        "Allow", destination=EntityMatch(selector=rule_selector("role == 'node'"))
    )
    pol = CalicoPolicy(
        "to-nodes",
        None,
        parse_selector("app == 'web'"),
        types=frozenset({"egress"}),
        egress=(to_nodes,),
    )
    st = state(pol)
    assert explain(st, WEB, HOST, "TCP", 80, node=None).allowed
    assert explain(st, WEB, "192.168.0.20", "TCP", 80, node=None).allowed
    assert not explain(st, WEB, PEER, "TCP", 80, node=None).allowed
    ir = engine.compute(st, NODE, (4,))
    chain = next(c for c in ir.chains.values() if c.policy == "to-nodes")
    rule = chain.rules[0]
    assert isinstance(rule, engine.TierRule)
    in_set = rule.dst.in_set
    assert in_set is not None
    assert ir.elements[in_set] == {HOST, "192.168.0.20"}


def test_failsafes_are_configurable() -> None:
    st = state(deny_all())
    none = Failsafes((), ())
    assert not explain(st, PEER, HOST, "TCP", 22, failsafes=none).allowed
    mine = Failsafes(parse_failsafe_ports("tcp:192.168.0.0/24:2222"), ())
    assert explain(st, PEER, HOST, "TCP", 2222, failsafes=mine).allowed
    assert not explain(st, "10.9.9.9", HOST, "TCP", 2222, failsafes=mine).allowed


def test_failsafe_port_text() -> None:
    for text in ("tcp:22", "udp:68", "tcp:10.0.0.0/8:2379", "tcp:[fd00::/64]:179"):
        assert FailsafePort.parse(text).text() == text
    assert parse_failsafe_ports("none") == ()
    assert parse_failsafe_ports(" TCP:22 , udp:53") == (
        FailsafePort("tcp", 22),
        FailsafePort("udp", 53),
    )
    for bad in ("22", "icmp:1", "tcp:0", "tcp:x", "tcp:10.0.0.300/8:22"):
        with pytest.raises(ValueError):
            FailsafePort.parse(bad)
    assert {f.text() for f in Failsafes().inbound} == {
        "tcp:22",
        "tcp:179",
        "tcp:2379",
        "tcp:2380",
        "tcp:5473",
        "tcp:6443",
        "tcp:6666",
        "tcp:6667",
        "udp:68",
    }
    assert {f.text() for f in Failsafes().outbound} == {
        "tcp:53",
        "tcp:179",
        "tcp:2379",
        "tcp:2380",
        "tcp:6443",
        "tcp:6666",
        "tcp:6667",
        "udp:53",
        "udp:67",
    }


def test_flags_need_apply_on_forward_and_a_global_policy() -> None:
    with pytest.raises(ValueError, match="applyOnForward"):
        CalicoPolicy("x", None, NODES, pre_dnat=True)
    with pytest.raises(ValueError, match="ingress only"):
        CalicoPolicy("x", None, NODES, types=both(), pre_dnat=True, apply_on_forward=True)
    with pytest.raises(ValueError, match="GlobalNetworkPolicy"):
        CalicoPolicy("x", "a", NODES, do_not_track=True, apply_on_forward=True)


# --- the IR and its text -------------------------------------------------------------------


def test_the_ir_holds_this_nodes_host_endpoints_by_stage() -> None:
    st = state(
        deny_all(),
        allow_port("pre", TCP, 8080, **PREDNAT),
        allow_port("raw", UDP, 9000, **UNTRACKED),
    )
    ir = engine.compute(st, NODE, (4,))
    assert list(ir.hosts) == ["n1-eth0"]  # n2's is not this node's
    h = ir.hosts["n1-eth0"]
    assert [s.chains for s in h.spans("ingress")]
    assert h.spans("forward-ingress") == ()
    assert len(h.spans("prednat-ingress")) == 1
    assert h.spans("prednat-ingress")[0].default_action == "Pass"
    assert len(h.spans("untracked-ingress")) == 1
    assert h.spans("untracked-egress") == ()
    assert h.spans("ingress")[0].default_action == "Deny"
    assert engine.compute(state(), NODE, (4,)).hosts["n1-eth0"].spans("ingress") == ()
    assert engine.compute(dataclasses.replace(st, host_endpoints=()), NODE).hosts == {}


def test_the_text_accepts_failsafes_before_policy_in_every_hook() -> None:
    st = state(
        deny_all(),
        allow_port("pre", TCP, 8080, **PREDNAT),
        allow_port("raw", UDP, 9000, **UNTRACKED),
    )
    text = Renderer().full(Snapshot(engine.compute(st, NODE, (4,)), engine.NatConfig()))
    lines = text.splitlines()
    for chain, hook in (
        ("host-raw-pre", "prerouting priority raw"),
        ("host-raw-out", "output priority raw"),
        ("host-prednat", "prerouting priority mangle"),
        ("host-input", "input priority filter + 2"),
        ("host-output", "output priority filter + 2"),
        ("host-forward", "forward priority filter + 2"),
    ):
        assert (
            f"add chain inet tabby {chain} {{ type filter hook {hook}; policy accept; }}" in lines
        )
        rules = [x for x in lines if x.startswith(f"add rule inet tabby {chain} ")]
        failsafe = [i for i, x in enumerate(rules) if "failsafe" in x]
        endpoint = [i for i, x in enumerate(rules) if "goto" in x or "jump host-fwd" in x]
        assert endpoint, chain
        if chain != "host-forward":
            assert failsafe, chain
            assert max(failsafe) < min(endpoint), chain
    assert any(
        "tcp dport { 22, 179, 2379, 2380, 5473, 6443, 6666, 6667 } accept"
        in x.replace("meta l4proto tcp th", "tcp")
        for x in lines
    )
    raw = [x for x in lines if "notrack accept" in x]
    assert raw
    assert all("meta mark set meta mark or 0x02000000" in x for x in raw)
    pre = [x for x in lines if "default/pre ingress[0]" in x and "0x02000000" in x]
    assert pre
    assert "notrack" not in pre[0]
    # a host endpoint's chain without policy drops; its forward chain without policy is empty
    h = engine.host_chain_name("n1-eth0", "egress")
    assert any(x.startswith(f"add rule inet tabby {h} drop") for x in lines)
    f = engine.host_chain_name("n1-eth0", "forward-ingress")
    assert not any(x.startswith(f"add rule inet tabby {f} ") for x in lines)


def test_no_host_endpoint_no_host_chains() -> None:
    text = Renderer().full(
        Snapshot(engine.compute(state(deny_all(), hosts=(OTHER,)), NODE), engine.NatConfig())
    )
    assert "host-" not in text


# --- incremental ---------------------------------------------------------------------------


def test_host_endpoint_changes_as_deltas() -> None:
    """The first host endpoint replaces the table; later changes send the host chains
    again, the very lines a diff of the two states gives; the IR equals the full
    computation after each change."""
    eng = IncrementalPolicy(NODE, (4,))
    base = state()
    eng.load(dataclasses.replace(base, host_endpoints=()))
    eng.take_delta()
    renderer = Renderer()
    prev = eng.desired()
    steps = [
        Update("host-endpoint", ME.key, ME),
        Update("calico-policy", "deny-all", deny_all()),
        Update("calico-policy", "pre", allow_port("pre", TCP, 8080, **PREDNAT)),
        Update("host-endpoint", STAR.key, STAR),
        Update("host-endpoint", OTHER.key, OTHER),
        Update("calico-policy", "deny-all", None),
        Update("host-endpoint", STAR.key, None),
        Update("host-endpoint", ME.key, None),
    ]
    replaced = []
    for u in steps:
        eng.apply([u])
        d = eng.take_delta()
        now = eng.desired()
        assert now == engine.compute(eng.state(), NODE, (4,)), u
        lines = renderer.incremental(d)
        old, new = Snapshot(prev, engine.NatConfig()), Snapshot(now, engine.NatConfig())
        if lines is None:
            replaced.append(u.key)
            assert renderer.delta(old, new) is None
        else:
            assert lines == renderer.delta(old, new), u
        prev = now
    # the first of this node's host endpoints, and the last gone (with a policy left: the
    # table stays in Calico's model)
    assert replaced == [ME.key, ME.key]


def test_inputs_convert_host_endpoints_and_the_flags() -> None:
    from policy import inputs
    from resources import calico as models

    hep = models.HostEndpoint.model_validate(
        {
            "apiVersion": "tabby.io/v1",
            "kind": "HostEndpoint",
            "metadata": {"name": "n1-eth0", "labels": {"role": "node"}},
            "spec": {"node": NODE, "interfaceName": "eth0", "expectedIPs": [HOST]},
        }
    )
    assert inputs.host_endpoint(hep) == ME
    gnp = models.GlobalNetworkPolicy.model_validate(
        {
            "apiVersion": "tabby.io/v1",
            "kind": "GlobalNetworkPolicy",
            "metadata": {"name": "pre"},
            "spec": {
                "selector": "role == 'node'",
                "preDNAT": True,
                "applyOnForward": True,
                "ingress": [{"action": "Deny"}],
            },
        }
    )
    got = inputs.calico_policy(gnp)
    assert got is not None
    assert got.stage == "prednat"
    assert got.apply_on_forward
