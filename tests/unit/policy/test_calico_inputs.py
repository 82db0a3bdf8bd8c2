"""Calico's kinds as the datastore holds them -> the engine's inputs (``policy.inputs``): the
documents tabby-node watches (``resources.index.POLICY``) decide traffic with Calico's
semantics, through a full conversion and through changes (``PolicyInputs.updates``)."""

from __future__ import annotations

import dataclasses
import random
from typing import Any

import pytest

from policy import calico, engine, inputs
from policy.incremental import IncrementalPolicy
from resources.index import BY_NAME, POLICY, Change, Documents
from tests import policy_fuzz as fz
from tests import policy_truth_table as tt
from tests.unit.policy.world import NODE, PolicyWorld

# x/a, x/b, x/c, y/a, ... as the truth table has them (labels pod=<name>; namespaces ns=<ns>)
XA, YA, ZB = ("x", "a"), ("y", "a"), ("z", "b")

TIER = {"metadata": {"name": "security"}, "spec": {"order": 10, "defaultAction": "Pass"}}
#: security tier: from namespace y, deny; from the corp network set, pass; else (tier end) pass
GNP = {
    "metadata": {"name": "security.guard"},
    "spec": {
        "tier": "security",
        "selector": "pod == 'a'",
        "namespaceSelector": "ns == 'x'",
        "ingress": [
            {"action": "Log", "protocol": "TCP"},
            {"action": "Deny", "source": {"namespaceSelector": "ns == 'y'"}},
            {"action": "Pass", "source": {"selector": "role == 'corp'"}},
            {"action": "Allow", "protocol": "UDP", "destination": {"ports": ["53"]}},
        ],
    },
}
#: tier default, in x: allow TCP 80-81 from everything in the cluster or corp
CNP = {
    "metadata": {"name": "web", "namespace": "x"},
    "spec": {
        "order": 10,
        "selector": "pod == 'a'",
        "ingress": [
            {
                "action": "Allow",
                "protocol": "TCP",
                "source": {"namespaceSelector": "all()"},
                "destination": {"ports": ["80:81"]},
            },
            {
                "action": "Allow",
                "source": {"selector": "role == 'corp'", "namespaceSelector": "global()"},
            },
        ],
    },
}
GNS = {"metadata": {"name": "corp", "labels": {"role": "corp"}}, "spec": {"nets": ["192.0.2.0/24"]}}
STAGED = {
    "metadata": {"name": "would-deny", "namespace": "x"},
    "spec": {"order": 1, "selector": "all()", "ingress": [{"action": "Deny"}]},
}
STAGED_DELETE = {
    "metadata": {"name": "web", "namespace": "x"},
    "spec": {"stagedAction": "Delete"},
}


def world() -> PolicyWorld:
    w = PolicyWorld()
    for kind in ("tier", "globalnetworkpolicy", "calico-networkpolicy", "globalnetworkset"):
        w.docs.setdefault(kind, {})
    w.docs.setdefault("stagednetworkpolicy", {})
    w.put("tier", "security", TIER)
    w.put("globalnetworkpolicy", "security.guard", GNP)
    w.put("calico-networkpolicy", "x/web", CNP)
    w.put("globalnetworkset", "corp", GNS)
    w.put("stagednetworkpolicy", "x/would-deny", STAGED)
    return w


def _state(w: PolicyWorld) -> engine.ClusterState:
    state, _ = inputs.PolicyInputs().convert(Documents.from_raw(w.docs))
    return state


def test_tabby_node_watches_calicos_kinds() -> None:
    names = {k.name for k in POLICY}
    assert {"globalnetworkpolicy", "calico-networkpolicy", "tier", "networkset"} <= names
    assert {"globalnetworkset", "stagednetworkpolicy", "stagedglobalnetworkpolicy"} <= names
    assert "stagedkubernetesnetworkpolicy" in names


def test_the_documents_decide_with_calicos_semantics() -> None:
    state = _state(world())
    assert {p.key for p in state.calico_policies} == {
        "security.guard",
        "x/web",
        "staged:x/would-deny",
    }
    assert [(t.name, t.order, t.default_action) for t in state.tiers] == [
        ("security", 10.0, "Pass")
    ]

    def ingress(src: engine.Target, proto: str, port: int | None) -> engine.DirectionVerdict:
        got = engine.explain(state, src, XA, proto, port).ingress
        assert got is not None
        return got

    # y is denied in tier security, whatever tier default would say
    v = ingress(YA, "TCP", 80)
    assert (v.allowed, v.tier, v.decided_by) == (
        False,
        "security",
        "security/security.guard ingress[1]",
    )
    assert v.logged == ("security/security.guard ingress[0]",)
    # z: the guard decides nothing, its tier passes; x/web allows 80 and 81, not 82
    v = ingress(ZB, "TCP", 81)
    assert (v.allowed, v.tier, v.decided_by) == (True, "default", "default/x/web ingress[0]")
    v = ingress(ZB, "TCP", 82)
    assert (v.allowed, v.tier) == (False, "default")
    # UDP 53: allowed in tier security
    assert ingress(ZB, "UDP", 53).decided_by == "security/security.guard ingress[3]"
    # the corp network set: passed by the guard, allowed by x/web's global() rule
    v = ingress(tt.address("z/b").replace("10.244.3", "192.0.2"), "TCP", 9)
    assert (v.allowed, v.decided_by) == (True, "default/x/web ingress[1]")
    # the staged policy says what it would have done, without deciding
    assert ingress(ZB, "TCP", 80).staged.startswith("would have denied")
    # the IR programs the same
    ir = engine.compute(state, NODE)
    src, dst = tt.address("y/a"), tt.address("x/a")
    by_addr = {p.addresses[0]: i for i, p in ir.endpoints.items()}
    assert not ir.evaluate(src, dst, "TCP", 80, by_addr[src], by_addr[dst])
    zb = tt.address("z/b")
    assert ir.evaluate(zb, dst, "TCP", 80, by_addr[zb], by_addr[dst])
    assert not ir.evaluate(zb, dst, "TCP", 82, by_addr[zb], by_addr[dst])


def test_a_staged_delete_shows_what_deleting_its_policy_would_do() -> None:
    """A staged Delete is a staged policy that selects nothing and has no rules: the kernel
    holds nothing of it, and explain's "would" walks the tiers without the enforced policy
    of its name (x/web allows x/a TCP 80-81 and isolates it for the rest: without it, the
    security tier passes and the profile allows)."""
    w = world()
    del w.docs["stagednetworkpolicy"]["x/would-deny"]
    w.put("stagednetworkpolicy", "x/web", STAGED_DELETE)
    state = _state(w)
    (marker,) = [p for p in state.calico_policies if p.key == "staged:x/web"]
    assert marker.staged_delete
    assert (marker.ingress, marker.egress, marker.types) == ((), (), frozenset())
    denied = engine.explain(state, ZB, XA, "TCP", 82).ingress
    assert denied is not None
    assert not denied.allowed
    assert denied.staged.startswith("would have allowed")
    without = dataclasses.replace(
        state, calico_policies=tuple(p for p in state.calico_policies if p is not marker)
    )
    got, want = engine.compute(state, NODE), engine.compute(without, NODE)
    # nothing of it in the kernel's state (it counts as a policy)
    assert dataclasses.replace(got, policies=want.policies) == want


def test_changes_of_calicos_kinds_become_engine_updates() -> None:
    """A change at a time, through the incremental engine, gives the full conversion's IR."""
    w = world()
    memo = inputs.PolicyInputs()
    eng = IncrementalPolicy(NODE)
    start = dict(w.docs)
    w.docs = {k: {} if k in ("tier", "globalnetworkpolicy", "calico-networkpolicy",
                            "globalnetworkset", "stagednetworkpolicy") else v
              for k, v in start.items()}  # fmt: skip
    state, nat = memo.convert(Documents.from_raw(w.docs))
    eng.load(state, nat)
    for kind in ("tier", "globalnetworkset", "globalnetworkpolicy", "calico-networkpolicy"):
        for key, doc in start[kind].items():
            w.docs[kind] = {**w.docs[kind], key: doc}
            model: Any = Documents.from_raw(w.docs).of(BY_NAME[kind])[key].value
            eng.apply(memo.updates([Change(kind, key, model)]))
            eng.take_delta()
            assert eng.desired() == engine.compute(_state(w), NODE)
    # and away again
    eng.apply(memo.updates([Change("globalnetworkpolicy", "security.guard", None)]))
    del w.docs["globalnetworkpolicy"]["security.guard"]
    assert eng.desired() == engine.compute(_state(w), NODE)
    assert "security.guard" not in eng.calico_policies


def test_a_staged_delete_changed_or_deleted_never_removes_the_enforced_policy() -> None:
    """A staged Delete put, changed and deleted is the staged policy ``staged:x/web`` each
    time, never the enforced ``x/web`` of the same store key."""
    w = world()
    memo = inputs.PolicyInputs()
    memo.convert(Documents.from_raw(w.docs))
    w.put("stagednetworkpolicy", "x/web", STAGED_DELETE)
    model: Any = Documents.from_raw(w.docs).of(BY_NAME["stagednetworkpolicy"])["x/web"].value
    for value in (model, model, None):
        (u,) = memo.updates([Change("stagednetworkpolicy", "x/web", value)])
        assert (u.kind, u.key) == ("calico-policy", "staged:x/web")
        assert (u.value is None) == (value is None)
    # a staged Set deleted removes the staged policy, by its engine key
    memo.convert(Documents.from_raw(world().docs))
    (u,) = memo.updates([Change("stagednetworkpolicy", "x/would-deny", None)])
    assert (u.kind, u.key, u.value) == ("calico-policy", "staged:x/would-deny", None)


def test_load_of_other_calico_inputs_is_followed() -> None:
    """``load`` (tabby-node's periodic check) with other Calico inputs and nothing else
    changed: the next delta brings the programs to the full computation's."""
    state = _state(world())
    eng = IncrementalPolicy(NODE)
    eng.load(state)
    eng.take_delta()
    other = dataclasses.replace(state, tiers=(calico.Tier("security", 10, "Deny"),))
    assert eng.load(other) == 1
    d = eng.take_delta()
    assert not d.empty
    assert eng.programs == engine.compute(other, NODE).endpoints


#: x/a isolated for ingress: only from namespace y, TCP 80 (staged: nothing enforced)
SKNP = {
    "metadata": {"name": "only-y", "namespace": "x"},
    "spec": {
        "podSelector": {"matchLabels": {"pod": "a"}},
        "ingress": [
            {
                "from": [{"namespaceSelector": {"matchLabels": {"ns": "y"}}}],
                "ports": [{"protocol": "TCP", "port": 80}],
            }
        ],
    },
}


def test_a_staged_kubernetes_policy_is_evaluated_never_enforced() -> None:
    """A StagedKubernetesNetworkPolicy is the Kubernetes policy it stages in Calico's form,
    staged (tier default, order 1000, ``knp.default.<name>``): explain says what it would
    do, the kernel's program counts it (a tier of staged policies alone: its end counted),
    nothing it would deny is denied. Its staged ``Delete`` is no input."""
    w = PolicyWorld()
    w.docs.setdefault("stagedkubernetesnetworkpolicy", {})
    w.put("stagedkubernetesnetworkpolicy", "x/only-y", SKNP)
    state = _state(w)
    (staged,) = state.calico_policies
    assert (staged.key, staged.tier, staged.order) == (
        "staged:x/knp.default.only-y",
        "default",
        1000,
    )
    denied = engine.explain(state, ZB, XA, "TCP", 80).ingress
    assert denied is not None
    assert denied.allowed
    assert denied.staged.startswith("would have denied")
    allowed = engine.explain(state, YA, XA, "TCP", 80).ingress
    assert allowed is not None
    assert allowed.allowed
    assert allowed.staged.startswith("would have allowed")
    ir = engine.compute(state, NODE)
    (prog,) = [p for p in ir.endpoints.values() if p.tiers("ingress")]
    (span,) = prog.tiers("ingress")
    assert (span.tier, span.enforced, len(span.staged)) == ("default", False, 1)
    src, dst = tt.address("z/b"), tt.address("x/a")
    assert ir.evaluate(src, dst, "TCP", 80, None, prog.interface)

    # its staged Delete: what deleting the Kubernetes policy of its name would do
    w.put("stagedkubernetesnetworkpolicy", "x/only-y", {**SKNP, "spec": {"stagedAction": "Delete"}})
    (marker,) = _state(w).calico_policies
    assert marker.staged_delete
    enforced = tt.pol("only-y", tt.A, types=("Ingress",))  # x/a isolated: nothing allowed
    w.put("networkpolicy", enforced.key, tt.network_policy(enforced))
    verdict = engine.explain(_state(w), ZB, XA, "TCP", 80).ingress
    assert verdict is not None
    assert not verdict.allowed
    assert verdict.staged.startswith("would have allowed")


@pytest.mark.parametrize("seed", range(8))
def test_a_kubernetes_policy_in_calicos_form_decides_as_itself(seed: int) -> None:
    """Random Kubernetes policies (``tests/policy_fuzz.py``: selectors with every operator,
    namespace selectors, ipBlocks with excepts, numbered, ranged and named ports of several
    protocols) replaced by their Calico form (``inputs.as_calico``, enforced) decide every
    connection between the world's pods, and from addresses in and out of the ipBlocks,
    exactly as the policies themselves: the conversion StagedKubernetesNetworkPolicy uses."""
    r = random.Random(seed)
    world = fz.World()
    for _ in range(200):
        world.apply(fz.random_update(r, world.state()))
    names = [(ns, f"pod{j}") for ns in fz.NAMESPACES for j in range(8)]
    endpoints = tuple(
        engine.Endpoint(
            ns, pod, fz.NODE, f"calx{i}",
            (f"10.0.0.{i + 1}" if i < 14 else f"10.1.0.{i + 1}", f"fd00::{i + 1:x}"),
            labels=fz.labels(r),
        )
        for i, (ns, pod) in enumerate(names)
    )  # fmt: skip
    k8s = dataclasses.replace(world.state(), endpoints=endpoints)
    assert k8s.policies
    converted = dataclasses.replace(
        k8s, policies=(), calico_policies=tuple(inputs.as_calico(p) for p in k8s.policies)
    )
    packets: list[tuple[str, int | None]] = [
        ("TCP", 8080), ("TCP", 8081), ("UDP", 53), ("TCP", 9090), ("SCTP", 50), ("ICMP", None)
    ]  # fmt: skip
    for pol in k8s.policies:  # each numbered port's edges, and just outside them
        for rule in (*pol.ingress, *pol.egress):
            for spec in rule.ports:
                if isinstance(spec.port, int):
                    last = spec.end_port or spec.port
                    edges = (spec.port - 1, spec.port, last, last + 1)
                    packets += [(spec.protocol, p) for p in edges if 0 < p < 65536]
    checked = 0
    for _ in range(600):
        a, b = r.choice(endpoints), r.choice(endpoints)
        proto, port = r.choice(packets)
        src: engine.Target = (a.namespace, a.pod)
        if r.random() < 0.2:
            src = r.choice(("10.0.0.3", "10.0.0.9", "10.0.0.20", "fd00::2", "fd00::5"))
        want = engine.explain(k8s, src, (b.namespace, b.pod), proto, port)
        got = engine.explain(converted, src, (b.namespace, b.pod), proto, port)
        assert got.allowed is want.allowed, (seed, src, b.key, proto, port, want.lines())
        checked += 1
    assert checked == 600


def _give_accounts(w: PolicyWorld) -> None:
    """y/a runs as service account ``frontend``, z/b as ``batch``."""
    for key, account in (("y/a", "frontend"), ("z/b", "batch")):
        doc = w.docs["pod"][key].data
        w.put("pod", key, {**doc, "spec": {**doc.get("spec", {}), "serviceAccountName": account}})


def _only_from_accounts(name: str, accounts: dict[str, Any]) -> dict[str, Any]:
    """A GlobalNetworkPolicy of tier security: x/a only from ``accounts``."""
    return {
        "metadata": {"name": name},
        "spec": {
            "tier": "security",
            "order": 1,
            "selector": "pod == 'a'",
            "namespaceSelector": "ns == 'x'",
            "ingress": [
                {"action": "Allow", "source": {"serviceAccounts": accounts}},
                {"action": "Deny"},
            ],
        },
    }


def test_service_accounts_of_the_pods_documents_are_matched() -> None:
    """A pod's ``spec.serviceAccountName`` (as the API server stores it) is what a rule's
    ``serviceAccounts`` names and a policy's ``serviceAccountSelector`` reads."""
    w = world()
    _give_accounts(w)
    gnp = _only_from_accounts("security.frontend-only", {"names": ["frontend"]})
    w.put("globalnetworkpolicy", "security.frontend-only", gnp)
    state = _state(w)
    assert engine.allowed(state, YA, XA, "UDP", 99)
    assert not engine.allowed(state, ZB, XA, "UDP", 99)
    # a policy for the pods of one account
    batch = {
        "metadata": {"name": "batch-isolated"},
        "spec": {"serviceAccountSelector": "projectcalico.org/name == 'batch'", "ingress": []},
    }
    w.put("globalnetworkpolicy", "batch-isolated", batch)
    state = _state(w)
    assert not engine.allowed(state, XA, ZB, "UDP", 99)
    assert engine.allowed(state, XA, YA, "UDP", 99)


def test_a_service_accounts_labels_are_what_its_selectors_read() -> None:
    """A ServiceAccount's labels are its pods' endpoints' ``pcsa.`` labels: a policy's
    ``serviceAccountSelector`` and a rule's ``serviceAccounts.selector`` match over them, and
    a relabelled account moves its pods in and out, through the incremental engine too."""
    w = world()
    w.docs.setdefault("serviceaccount", {})
    _give_accounts(w)
    labels = {"y/frontend": {"role": "web"}, "z/batch": {"role": "jobs"}}
    for key, account_labels in labels.items():
        ns, name = key.split("/")
        meta = {"name": name, "namespace": ns, "labels": account_labels}
        w.put("serviceaccount", key, {"metadata": meta})
    gnp = _only_from_accounts("security.web-only", {"selector": "role == 'web'"})
    w.put("globalnetworkpolicy", "security.web-only", gnp)
    jobs = {
        "metadata": {"name": "jobs-isolated"},
        "spec": {"serviceAccountSelector": "role == 'jobs'", "ingress": []},
    }
    w.put("globalnetworkpolicy", "jobs-isolated", jobs)
    memo = inputs.PolicyInputs()
    state, nat = memo.convert(Documents.from_raw(w.docs))
    assert engine.allowed(state, YA, XA, "UDP", 99)
    assert not engine.allowed(state, ZB, XA, "UDP", 99)
    assert not engine.allowed(state, XA, ZB, "UDP", 99)  # batch's pods isolated
    eng = IncrementalPolicy(NODE)
    eng.load(state, nat)
    eng.take_delta()
    # the accounts swap roles: the verdicts follow, and the engine's IR is the full one's
    for key, role in (("y/frontend", "jobs"), ("z/batch", "web")):
        ns, name = key.split("/")
        w.put(
            "serviceaccount",
            key,
            {"metadata": {"name": name, "namespace": ns, "labels": {"role": role}}},
        )
        model: Any = Documents.from_raw(w.docs).of(BY_NAME["serviceaccount"])[key].value
        eng.apply(memo.updates([Change("serviceaccount", key, model)]))
    eng.take_delta()
    state = _state(w)
    assert not engine.allowed(state, YA, XA, "UDP", 99)
    assert engine.allowed(state, ZB, XA, "UDP", 99)
    assert eng.desired() == engine.compute(state, NODE)
