"""Test tiers: unit (default), privileged (--run-privileged), e2e (--run-e2e), Kubernetes
(--run-kubernetes); slow tests only in a full run (--run-slow, or any tier's option).
What each option selects: tests/selection.py.

In CI the flags are given explicitly, so a missing capability fails instead of skipping.
"""

from __future__ import annotations

import os
import shutil
import sys

import pytest
from hypothesis import settings

from tests.selection import DESELECT, SLOW_OPTION, Run, verdict

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
    parser.addoption(
        SLOW_OPTION,
        action="store_true",
        default=False,
        help="run the slow tests too (any tier option does): without, they are deselected",
    )


def _run(config: pytest.Config) -> Run:
    return Run(
        privileged=config.getoption("--run-privileged"),
        e2e=config.getoption("--run-e2e"),
        kubernetes=config.getoption("--run-kubernetes"),
        slow=config.getoption(SLOW_OPTION) or "slow" in (config.option.markexpr or ""),
        have_etcd=shutil.which("etcd") is not None,
    )


def _named(config: pytest.Config) -> tuple[str, ...]:
    """The node ids given on the command line (``path::name``), relative to the root dir."""
    root = config.rootpath
    out = []
    for arg in config.args:
        path, sep, rest = arg.partition("::")
        if sep:
            rel = os.path.relpath(os.path.abspath(path), root).replace(os.sep, "/")
            out.append(f"{rel}::{rest}")
    return tuple(out)


def pytest_configure(config: pytest.Config) -> None:
    """A full run (a tier's option or --run-slow) gives the fuzz targets' properties more
    examples than a developer's run (tests/fuzz/__init__.py)."""
    if _run(config).full:
        from tests.fuzz import FULL_PROFILE

        settings.load_profile(FULL_PROFILE)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run = _run(config)
    named = _named(config)
    keep: list[pytest.Item] = []
    deselected: list[pytest.Item] = []
    for item in items:
        markers = {m.name for m in item.iter_markers()}
        why = verdict(markers, item.keywords, run)
        if why == DESELECT and not any(item.nodeid.startswith(n) for n in named):
            deselected.append(item)
            continue
        if why is not None and why != DESELECT:
            item.add_marker(pytest.mark.skip(reason=why))
        keep.append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = keep


def pytest_report_header(config: pytest.Config) -> str | None:
    if _run(config).full:
        return None
    return f"slow tests deselected ({SLOW_OPTION} or any tier option runs them)"
