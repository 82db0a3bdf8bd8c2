"""Privileged tier fixtures: throwaway network namespaces (needs root / CAP_NET_ADMIN).

``--run-privileged`` and the skip hook live in the top-level ``tests/conftest.py``.
Fixtures: ``netns_pool`` (unique namespaces, all deleted after the test, pass or fail),
``node`` (a namespace acting as the host) and ``make_pod`` (a factory of pod namespaces).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator

import pytest

from tests.privileged import netns_util


@pytest.fixture(scope="session", autouse=True)
def _sweep_leaked_namespaces() -> Iterator[None]:
    yield
    leaked = netns_util.sweep_leftovers(os.getpid())
    assert not leaked, f"tests left network namespaces behind: {leaked}"


@pytest.fixture
def netns_pool() -> Iterator[netns_util.NetnsPool]:
    with netns_util.netns_pool() as pool:
        yield pool


@pytest.fixture
def node(netns_pool: netns_util.NetnsPool) -> netns_util.Node:
    return netns_pool.node()


@pytest.fixture
def make_pod(netns_pool: netns_util.NetnsPool) -> Callable[[], netns_util.Netns]:
    return netns_pool.pod
