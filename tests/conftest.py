"""Test tiers: unit (default), privileged (--run-privileged), e2e (--run-e2e), Kubernetes
(--run-kubernetes).

In CI the flags are given explicitly, so a missing capability fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

ALL_SPEC_VERSIONS = ("0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-privileged",
        action="store_true",
        default=False,
        help="run tests that need root and network namespaces",
    )
    parser.addoption(
        "--run-e2e",
        action="store_true",
        default=False,
        help="run tests that exec the installed binaries (after ./build.sh)",
    )
    parser.addoption(
        "--run-kubernetes",
        action="store_true",
        default=False,
        help="run the Kubernetes tier (root, the installed binaries, Kubernetes built by "
        "python -m lab.kubernetes.build): a real cluster per backend",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_priv = config.getoption("--run-privileged")
    run_e2e = config.getoption("--run-e2e")
    run_kubernetes = config.getoption("--run-kubernetes")
    skip_priv = pytest.mark.skip(reason="needs --run-privileged (root, netns)")
    skip_e2e = pytest.mark.skip(reason="needs --run-e2e (installed binaries, root)")
    skip_kubernetes = pytest.mark.skip(reason="needs --run-kubernetes (a real Kubernetes, root)")
    # etcd tests run wherever the etcd binary is; without it they skip, except under
    # --run-privileged (CI), where the fixture fails and says what is missing.
    skip_etcd = pytest.mark.skip(reason="needs the etcd binary (apt-get install etcd-server)")
    have_etcd = shutil.which("etcd") is not None
    for item in items:
        if item.get_closest_marker("kubernetes") is not None:
            if not run_kubernetes:
                item.add_marker(skip_kubernetes)
        elif "e2e" in item.keywords and not run_e2e:
            item.add_marker(skip_e2e)
        elif "privileged" in item.keywords and not run_priv:
            item.add_marker(skip_priv)
        elif "etcd" in item.keywords and not have_etcd and not run_priv:
            item.add_marker(skip_etcd)
