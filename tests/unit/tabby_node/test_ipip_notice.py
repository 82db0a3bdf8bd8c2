"""IP-in-IP asked for on a kernel without it: said once, kept in status and readiness."""

from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass

import pytest

from cni_config.common import DatastoreSettings
from tabby_node.cluster import PoolInfo
from tabby_node.facts import Facts
from tabby_node.http import Health
from tabby_node.passes import IpipNotice


def _notice(available: bool) -> IpipNotice:
    return IpipNotice(Facts("node-a", None, None, 1500, available, "no ipip module"), "bird", {})


def _cluster(*modes: str | None) -> list[PoolInfo]:
    """The pools a pass hands the notice."""
    return [
        PoolInfo(ipaddress.ip_network(f"10.{i}.0.0/16"), 26, ipip_mode=m)
        for i, m in enumerate(modes)
    ]


@dataclass
class Passes:
    reconciles: int = 1
    in_sync: bool = True


class Routing:
    def readiness(self) -> list[str]:
        return []


def test_said_once_and_kept_while_it_lasts(caplog: pytest.LogCaptureFixture) -> None:
    notice = _notice(available=False)
    problems = notice.problems
    with caplog.at_level(logging.WARNING, logger="tabby.node"):
        notice.update(_cluster("Always", None))
        notice.update(_cluster("Always", None))
    warnings = [r for r in caplog.records if "IP-in-IP" in r.getMessage()]
    assert len(warnings) == 1
    assert "10.0.0.0/16" in problems["ipip"]
    assert "no ipip module" in problems["ipip"]
    health = Health(
        node_ttl=90.0,
        datastore=DatastoreSettings(),
        passes=Passes(),
        routing=Routing(),
        beats={},
        problems=problems,
    )
    health._datastore = lambda: None  # type: ignore[method-assign]
    assert any(r.startswith("ipip: ") for r in health.readiness())
    notice.update(_cluster(None))
    assert "ipip" not in problems


def test_nothing_said_when_the_kernel_can_or_no_pool_asks() -> None:
    notice = _notice(available=True)
    notice.update(_cluster("CrossSubnet"))
    assert "ipip" not in notice.problems
    notice = _notice(available=False)
    notice.update(_cluster("Never", None))
    assert "ipip" not in notice.problems
