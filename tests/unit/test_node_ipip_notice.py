"""IP-in-IP asked for on a kernel without it: said once, kept in status and readiness."""

from __future__ import annotations

import ipaddress
import logging

import pytest

from cni_config.common import DatastoreSettings
from tabby_node.agent import Agent, Facts
from tabby_node.cluster import PoolInfo
from tabby_node.http import Health
from tabby_node.options import NodeOptions


def _agent(available: bool) -> Agent:
    agent = Agent(NodeOptions(backend="bird"), DatastoreSettings())
    agent.facts = Facts("node-a", None, None, 1500, available, "no ipip module")
    return agent


def _cluster(*modes: str | None) -> list[PoolInfo]:
    """The pools a pass hands the notice."""
    return [
        PoolInfo(ipaddress.ip_network(f"10.{i}.0.0/16"), 26, ipip_mode=m)
        for i, m in enumerate(modes)
    ]


def test_said_once_and_kept_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    agent = _agent(available=False)
    with caplog.at_level(logging.WARNING, logger="tabby.node"):
        agent._ipip_notice(_cluster("Always", None))
        agent._ipip_notice(_cluster("Always", None))
    warnings = [r for r in caplog.records if "IP-in-IP" in r.getMessage()]
    assert len(warnings) == 1
    assert "10.0.0.0/16" in agent.problems["ipip"]
    assert "no ipip module" in agent.problems["ipip"]
    health = Health(agent)
    health._datastore = lambda: None  # type: ignore[method-assign]
    agent.reconciles = 1
    agent.in_sync = True
    assert any(r.startswith("ipip: ") for r in health.readiness())
    agent._ipip_notice(_cluster(None))
    assert "ipip" not in agent.problems


def test_nothing_said_when_the_kernel_can_or_no_pool_asks() -> None:
    agent = _agent(available=True)
    agent._ipip_notice(_cluster("CrossSubnet"))
    assert "ipip" not in agent.problems
    agent = _agent(available=False)
    agent._ipip_notice(_cluster("Never", None))
    assert "ipip" not in agent.problems
