"""tabby-node's dataplane passes (``Agent.reconcile``): a pass hands routing and policy only
the documents that changed since the last one; the whole check comes first, then only
periodically (or after a failed pass), and then finds nothing to fix."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from cni_config.common import DatastoreSettings
from datastore.base import SyncEvent
from policy import engine
from policy.render import Snapshot
from policy.state import PolicyDataplane
from resources.index import Change, Documents
from tabby_node import agent as agent_mod
from tabby_node.agent import Agent, Facts
from tabby_node.cluster_index import Present, Touched
from tabby_node.options import NodeOptions
from tabby_node.view import RoutingCheck, RoutingPass
from tests import policy_truth_table as tt
from tests.nft_model import NftModel
from tests.unit.test_policy_incremental import _docs


class Routing:
    """Records what the agent hands the routing backend."""

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


def _agent(tmp_path: Any, routing: Routing) -> tuple[Agent, NftModel]:
    agent = Agent(NodeOptions(backend="vxlan", run_dir=str(tmp_path)), DatastoreSettings())
    agent.facts = Facts("node1", None, None, 1500, False, "")
    agent.routing = routing  # type: ignore[assignment]
    model = NftModel()
    agent.policy = PolicyDataplane("node1", backend=model, families=(4,))
    agent.cache.apply(SyncEvent("snapshot", "", "", None, _docs()))
    return agent, model


def test_a_pass_takes_only_what_changed_and_the_check_finds_nothing(tmp_path: Any) -> None:
    routing = Routing()
    agent, model = _agent(tmp_path, routing)
    assert agent.reconcile()  # the first pass: everything, then the check
    assert routing.checks == 1
    assert len(routing.passes[0]) > 10
    assert agent.policy is not None
    assert agent.policy.synced
    first = len(model.transactions)

    # A pod on this node goes: that one document, no check, the policy delta sent.
    pod = next(iter(tt.PODS))
    ns, name = pod.split("/")
    key = f"{ns}/{name}-eth0"
    assert agent.cache.has("workloadendpoint", key)
    agent.cache.apply(SyncEvent("delete", "workloadendpoint", key, None, None))
    assert agent.reconcile()
    assert routing.passes[-1] == [("workloadendpoint", key)]
    assert routing.checks == 1
    assert len(model.transactions) == first + 1
    assert "delete" in model.transactions[-1]
    assert "add table" not in model.transactions[-1]  # a delta, not the table again

    # Nothing changed: an empty pass sends nothing.
    sent = len(model.transactions)
    assert agent.reconcile()
    assert routing.passes[-1] == []
    assert len(model.transactions) == sent

    # The periodic check: recomputed from the documents, nothing to fix.
    assert agent.reconcile(full=True)
    assert routing.checks == 2
    state = agent.policy.state
    assert state is not None
    assert model.canonical() == _table_of(agent.policy)
    counters = agent.policy.counters
    assert (counters.checks, counters.check_fixes) == (1, 0)  # the first sync is no check


def _table_of(policy: PolicyDataplane) -> object:
    state = policy.state
    assert state is not None
    from tests.unit.test_policy_incremental import _table

    return _table(Snapshot(engine.compute(state, "node1", (4,)), policy._engine.nat))


def test_a_failed_pass_brings_the_check_forward(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What a failed pass took from the journal is not lost: the loop runs the whole check
    within ``RETRY_SECONDS``, which rebuilds from the documents."""
    routing = Routing()
    agent, _ = _agent(tmp_path, routing)
    assert agent.reconcile()
    routing.fail = True
    agent.cache.apply(SyncEvent("delete", "pool", "10.244.0.0/16", None, None))
    assert not agent.reconcile()
    assert "routing" in agent.problems
    routing.fail = False
    monkeypatch.setattr(agent_mod, "CHECK_SECONDS", 3600.0)
    monkeypatch.setattr(agent_mod, "RETRY_SECONDS", 0.0)
    checks = routing.checks

    original = Agent.reconcile

    def stop_after_a_check(self: Agent, *, full: bool = False) -> bool:
        ok = original(self, full=full)
        if full:
            self.stopping.set()
        return ok

    routing.fail = True
    agent.cache.changed.set()
    monkeypatch.setattr(Agent, "reconcile", stop_after_a_check)
    agent.run()  # a failed change pass, then the check at once
    assert routing.checks == checks + 1
    assert routing.passes[-1] == []  # the check's own pass: the journal was drained
    assert "routing" not in agent.problems  # the check rebuilt from the documents


def test_a_served_pods_policy_does_not_materialise_the_policy_state(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The CNI call tabby-node serves programs its pod's policy (``endpoint_added``, and
    ``endpoint_removed`` for a DEL) without reading ``PolicyDataplane.state``: that is every
    endpoint's inputs materialised, whose cost grows with the cluster (~8 ms per call at
    1,000 nodes of 20 pods). A count, not a timing."""
    from resources.index import ENDPOINTS

    agent, _model = _agent(tmp_path, Routing())
    assert agent.reconcile()
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

    monkeypatch.setattr(PolicyDataplane, "state", property(counted_state))
    monkeypatch.setattr(PolicyDataplane, "add_endpoint", counted_add)
    monkeypatch.setattr(PolicyDataplane, "remove_endpoint", counted_remove)
    monkeypatch.setattr(agent, "on_dataplane_thread", lambda fn, timeout: fn())
    key = next(iter(agent.cache.of(ENDPOINTS)))
    agent.endpoint_added(key, None)
    agent.endpoint_removed(key)
    assert calls == ["add", "remove"]  # programmed, and taken away
    assert reads == []
