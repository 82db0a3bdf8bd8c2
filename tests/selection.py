"""Which tests a run selects: the tiers' options and the slow marker (tests/conftest.py
applies this to every collected test; tests/unit/repository/test_selection.py checks it).

- A tier runs with its option: ``--run-privileged`` (root, network namespaces),
  ``--run-e2e`` (the installed binaries), ``--run-kubernetes``; without it its tests skip,
  saying which option runs them. Tests that start etcd skip where the binary is missing,
  except under ``--run-privileged`` (CI), where their fixture fails and says what is missing.
- ``slow`` tests (failure injection against real etcd clusters, stress, timeouts waited out,
  the later seeds of the random replays) are left out of a developer's run, which then stays
  under a minute: they are *deselected* (pytest's last line counts them). ``--run-slow``
  runs them, and so does any tier option: a run with a tier option is a full run
  (tests/run.sh, CI), and nothing in it is deselected. A slow test named by its node id
  (``path::name``) runs anyway, and so do the slow tests of a ``-m`` expression naming
  ``slow``.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass

import pytest

#: The options of the test tiers; any of them (or --run-slow) makes a full run.
TIER_OPTIONS = ("--run-privileged", "--run-e2e", "--run-kubernetes")
#: The option that runs the slow tests in a developer's run.
SLOW_OPTION = "--run-slow"
DESELECT = "deselect"


@dataclass(frozen=True)
class Run:
    privileged: bool = False
    e2e: bool = False
    kubernetes: bool = False
    slow: bool = False
    have_etcd: bool = True

    @property
    def full(self) -> bool:
        """Every test selected: a tier's option or --run-slow was given."""
        return self.slow or self.privileged or self.e2e or self.kubernetes


def verdict(markers: Container[str], keywords: Container[str], run: Run) -> str | None:
    """None when the test runs; :data:`DESELECT`; or why it skips. ``markers`` are the
    test's markers, ``keywords`` pytest's keywords (markers and the names of the test's
    module, class and folders: every test under tests/privileged/ is "privileged")."""
    if "slow" in markers and not run.full:
        return DESELECT
    if "kubernetes" in markers:
        return None if run.kubernetes else "needs --run-kubernetes (a real Kubernetes, root)"
    if "e2e" in keywords and not run.e2e:
        return "needs --run-e2e (installed binaries, root)"
    if "privileged" in keywords and not run.privileged:
        return "needs --run-privileged (root, netns)"
    if "etcd" in keywords and not run.have_etcd and not run.privileged:
        return "needs the etcd binary (apt-get install etcd-server)"
    return None


def quick_first(count: int, quick: int) -> list[object]:
    """``range(count)`` as parameters (seeds of a random replay), those from ``quick`` on
    marked slow: a developer's run replays the first few, a full run every one."""
    return [pytest.param(i, marks=() if i < quick else pytest.mark.slow) for i in range(count)]
