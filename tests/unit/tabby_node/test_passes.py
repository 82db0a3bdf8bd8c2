"""tabby-node's dataplane passes (``DataplaneLoop.reconcile``): a pass hands routing and policy only
the documents that changed since the last one; the whole check comes first, then only
periodically (or after a failed pass), and then finds nothing to fix."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from typing import Any

import pytest

from datastore.base import SyncEvent
from policy import engine
from policy import state as nft
from policy.render import Snapshot
from policy.state import PolicyDataplane
from resources.index import Change, Documents
from tabby_node import passes as passes_mod
from tabby_node.cache import Cache
from tabby_node.cluster_index import Present, Touched
from tabby_node.facts import Facts
from tabby_node.node_status import StatusReport
from tabby_node.passes import DataplaneLoop, IpipNotice, PolicyPass, Requests
from tabby_node.pod_policy import PodPolicy
from tabby_node.view import RoutingCheck, RoutingPass
from tests import policy_truth_table as tt
from tests.nft_model import NftModel
from tests.unit.policy.world import TWO_POLICIES, PolicyWorld, full_table


class Routing:
    """Records what the dataplane passes hand the routing backend."""

    def __init__(self, fail: bool = False) -> None:
        self.passes: list[list[tuple[str, str]]] = []
        self.checks = 0
        self.fail = fail

    def start(self) -> None: ...

    def sync(self, changes: Iterable[Change], present: Present | None = None) -> RoutingPass:
        self.passes.append([(c.kind, c.key) for c in changes])
        if self.fail:
            raise RuntimeError("netlink said no")
        return RoutingPass(Touched())

    def check(self, docs: Documents) -> RoutingCheck:
        self.checks += 1
        return RoutingCheck()

    def status(self, cluster: object = None) -> dict[str, Any]:
        return {}

    def readiness(self) -> list[str]:
        return []

    def announced(self) -> dict[str, int]:
        return {}

    def stop(self, *, stop_bird: bool = True) -> None: ...


def _loop(tmp_path: Any, routing: Routing) -> tuple[DataplaneLoop, NftModel]:
    """The dataplane passes of node1 (backend vxlan) on a snapshot of the truth table."""
    facts = Facts("node1", None, None, 1500, False, "")
    cache = Cache("node1")
    model = NftModel()
    policy = nft.PolicyDataplane("node1", backend=model, families=(4,))
    problems: dict[str, str] = {}
    loop = DataplaneLoop(
        cache,
        routing,  # type: ignore[arg-type]
        PolicyPass(policy),
        ipip=IpipNotice(facts, "vxlan", problems),
        status=StatusReport(
            facts,
            backend="vxlan",
            mtu=1450,
            problems=problems,
            routing=routing,
            run_dir=str(tmp_path),
        ),
        requests=Requests(cache.wake),
        stopping=threading.Event(),
        beats={},
        problems=problems,
    )
    cache.apply(SyncEvent("snapshot", "", "", None, PolicyWorld(TWO_POLICIES).docs))
    return loop, model


def test_a_pass_takes_only_what_changed_and_the_check_finds_nothing(tmp_path: Any) -> None:
    routing = Routing()
    loop, model = _loop(tmp_path, routing)
    assert loop.reconcile()  # the first pass: everything, then the check
    assert routing.checks == 1
    assert len(routing.passes[0]) > 10
    policy = loop.policy.policy
    assert policy.synced
    first = len(model.transactions)

    # A pod on this node goes: that one document, no check, the policy delta sent.
    pod = next(iter(tt.PODS))
    ns, name = pod.split("/")
    key = f"{ns}/{name}-eth0"
    assert loop.cache.has("workloadendpoint", key)
    loop.cache.apply(SyncEvent("delete", "workloadendpoint", key, None, None))
    assert loop.reconcile()
    assert routing.passes[-1] == [("workloadendpoint", key)]
    assert routing.checks == 1
    assert len(model.transactions) == first + 1
    assert "delete" in model.transactions[-1]
    assert "add table" not in model.transactions[-1]  # a delta, not the table again

    # Nothing changed: an empty pass sends nothing.
    sent = len(model.transactions)
    assert loop.reconcile()
    assert routing.passes[-1] == []
    assert len(model.transactions) == sent

    # The periodic check: recomputed from the documents, nothing to fix.
    assert loop.reconcile(full=True)
    assert routing.checks == 2
    state = policy.state
    assert state is not None
    assert model.canonical() == _table_of(policy)
    counters = policy.counters
    assert (counters.checks, counters.check_fixes) == (1, 0)  # the first sync is no check


def _table_of(policy: PolicyDataplane) -> object:
    state = policy.state
    assert state is not None
    return full_table(Snapshot(engine.compute(state, "node1", (4,)), policy._engine.nat))


def test_a_failed_pass_brings_the_check_forward(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a failed pass took from the journal is not lost: the loop runs the whole check
    within ``RETRY_SECONDS``, which rebuilds from the documents."""
    routing = Routing()
    loop, _ = _loop(tmp_path, routing)
    assert loop.reconcile()
    routing.fail = True
    loop.cache.apply(SyncEvent("delete", "pool", "10.244.0.0/16", None, None))
    assert not loop.reconcile()
    assert "routing" in loop.problems
    routing.fail = False
    monkeypatch.setattr(passes_mod, "CHECK_SECONDS", 3600.0)
    monkeypatch.setattr(passes_mod, "RETRY_SECONDS", 0.0)
    checks = routing.checks

    original = DataplaneLoop.reconcile

    def stop_after_a_check(self: DataplaneLoop, *, full: bool = False) -> bool:
        ok = original(self, full=full)
        if full:
            self.stopping.set()
        return ok

    routing.fail = True
    loop.cache.changed.set()
    monkeypatch.setattr(DataplaneLoop, "reconcile", stop_after_a_check)
    loop.run()  # a failed change pass, then the check at once
    assert routing.checks == checks + 1
    assert routing.passes[-1] == []  # the check's own pass: the journal was drained
    assert "routing" not in loop.problems  # the check rebuilt from the documents


def test_a_served_pods_policy_does_not_materialise_the_policy_state(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CNI call tabby-node serves programs its pod's policy (``endpoint_added``, and
    ``endpoint_removed`` for a DEL) without reading ``PolicyDataplane.state``: that is every
    endpoint's inputs materialised, whose cost grows with the cluster (~8 ms per call at
    1,000 nodes of 20 pods). A count, not a timing."""
    from resources.index import ENDPOINTS

    loop, _model = _loop(tmp_path, Routing())
    assert loop.reconcile()
    reads: list[int] = []
    calls: list[str] = []
    state = PolicyDataplane.state
    add, remove = PolicyDataplane.add_endpoint, PolicyDataplane.remove_endpoint

    def counted_state(self: PolicyDataplane) -> Any:
        reads.append(1)
        return state.fget(self)  # type: ignore[attr-defined]

    def counted_add(self: PolicyDataplane, *args: Any) -> Any:
        calls.append("add")
        return add(self, *args)

    def counted_remove(self: PolicyDataplane, *args: Any) -> Any:
        calls.append("remove")
        return remove(self, *args)

    monkeypatch.setattr(nft.PolicyDataplane, "state", property(counted_state))
    monkeypatch.setattr(nft.PolicyDataplane, "add_endpoint", counted_add)
    monkeypatch.setattr(nft.PolicyDataplane, "remove_endpoint", counted_remove)

    class Inline:
        """The dataplane thread, as the CNI thread's own."""

        def call(self, fn: Callable[[], None], timeout: float) -> None:
            fn()

    pods = PodPolicy(loop.cache, loop.policy.policy, Inline())
    key = next(iter(loop.cache.of(ENDPOINTS)))
    pods.endpoint_added(key, None)
    pods.endpoint_removed(key)
    assert calls == ["add", "remove"]  # programmed, and taken away
    assert reads == []
