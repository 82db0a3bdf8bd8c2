"""What a run selects (tests/selection.py): a full run (tests/run.sh, and so CI's .ci/run)
runs every test of every marker, nothing deselected or skipped for want of an option; a
developer's run leaves out exactly the slow tests, and says which option brings back any
test it skips."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib

import pytest

from tests import REPO_ROOT
from tests.selection import DESELECT, SLOW_OPTION, TIER_OPTIONS, Run, quick_first, verdict

MARKERS = [
    m.split(":")[0]
    for m in tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["tool"]["pytest"][
        "ini_options"
    ]["markers"]
]
#: What the full run passes (tests/run.sh below), on a machine without etcd too.
FULL = Run(privileged=True, e2e=True, kubernetes=True, have_etcd=False)
#: A developer's plain run (``pytest tests/unit``, tests/run.sh --quick).
PLAIN = Run()
#: Folders whose name makes a keyword of the same meaning as a marker.
TIER_FOLDERS = ["privileged", "e2e", "kubernetes"]


def pytest_runs(script: str) -> list[list[str]]:
    """The argument lists of every ``python -m pytest`` line of a shell script."""
    runs = []
    for line in (REPO_ROOT / script).read_text().splitlines():
        if "-m pytest" in line and not line.lstrip().startswith("#"):
            runs.append(shlex.split(line.split("-m pytest", 1)[1]))
    return runs


def test_the_markers_are_the_ones_the_selection_knows() -> None:
    assert sorted(MARKERS) == ["e2e", "etcd", "kubernetes", "privileged", "slow"]


@pytest.mark.parametrize("marker", MARKERS)
@pytest.mark.parametrize("folder", [None, *TIER_FOLDERS])
def test_a_full_run_runs_every_marker(marker: str, folder: str | None) -> None:
    keywords = {marker, folder} if folder else {marker}
    assert verdict({marker}, keywords, FULL) is None
    assert verdict({marker, "slow"}, {*keywords, "slow"}, FULL) is None


@pytest.mark.parametrize("option", [*TIER_OPTIONS, SLOW_OPTION])
def test_any_tier_option_makes_a_full_run(option: str) -> None:
    run = Run(**{option.removeprefix("--run-"): True})
    assert run.full
    assert verdict({"slow"}, {"slow"}, run) is None


def test_a_plain_run_leaves_out_the_slow_tests_and_names_the_option_of_a_skip() -> None:
    assert verdict({"slow"}, {"slow"}, PLAIN) == DESELECT
    assert verdict(set(), {"test_x.py"}, PLAIN) is None
    for marker, option in [
        ("privileged", "--run-privileged"),
        ("e2e", "--run-e2e"),
        ("kubernetes", "--run-kubernetes"),
    ]:
        why = verdict({marker}, {marker}, PLAIN)
        assert option in str(why), (marker, why)
    assert verdict({"etcd"}, {"etcd"}, PLAIN) is None
    assert "etcd binary" in str(verdict({"etcd"}, {"etcd"}, Run(have_etcd=False)))


def test_the_full_run_passes_tier_options_to_every_pytest_it_starts() -> None:
    """tests/run.sh: every run of the full suite has a tier option (so nothing is
    deselected), --unit runs the slow tests, and only --quick leaves them out."""
    runs = pytest_runs("tests/run.sh")
    quick = [r for r in runs if "-n" in r]
    unit = [r for r in runs if r[0] == "tests/unit" and "-n" not in r]
    full = [r for r in runs if r not in quick and r not in unit]
    assert (len(quick), len(unit), len(full)) == (1, 1, 2), runs
    assert SLOW_OPTION in unit[0]
    for r in full:
        assert set(r) & set(TIER_OPTIONS), r


def test_ci_runs_the_full_suite() -> None:
    """.ci/run ends in ``bash tests/run.sh`` with no option that narrows it."""
    commands = [
        line.strip()
        for line in (REPO_ROOT / ".ci" / "run").read_text().splitlines()
        if re.match(r"\s*bash tests/run\.sh\b", line)
    ]
    assert commands == ["bash tests/run.sh"]


def test_quick_first_marks_all_but_the_first_seeds_slow() -> None:
    params = quick_first(5, 2)
    assert [p.values for p in params] == [(i,) for i in range(5)]  # type: ignore[attr-defined]
    slow = [any(m.name == "slow" for m in p.marks) for p in params]  # type: ignore[attr-defined]
    assert slow == [False, False, True, True, True]


@pytest.mark.slow
def test_the_hook_deselects_slow_tests_only_in_a_plain_run() -> None:
    """tests/conftest.py applies the verdicts: pytest's own collection of one slow test."""
    crash = "tests/unit/ipam/core/test_crash.py"

    def collect(*options: str) -> str:
        argv = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider"]
        proc = subprocess.run(
            [*argv, *options, crash],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        )
        return proc.stdout.strip().splitlines()[-1]

    assert "1 deselected" in collect()
    assert collect(SLOW_OPTION).startswith("1 test collected")
    assert collect("--run-privileged").startswith("1 test collected")
    assert collect(f"{crash}::test_sigkill_at_random_instants").startswith("1 test collected")
