"""conf-examples/prometheus-alerts.yaml through Prometheus's own tool: ``promtool check
rules`` accepts it, and ``promtool test rules`` runs prometheus/alerts.test.yaml beside this file,
where every alert has a case that fires it and a near miss that does not (checked here, so
a new rule without its two cases fails).

promtool comes with Debian's ``prometheus`` package (tests/run.sh installs it). Without it
these tests skip, except under --run-privileged (CI), where they fail and say what is
missing, as the etcd tests do.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests import REPO_ROOT as ROOT

ALERTS = ROOT / "conf-examples" / "prometheus-alerts.yaml"
RULE_TESTS = Path(__file__).resolve().parent / "prometheus" / "alerts.test.yaml"


@pytest.fixture
def promtool(request: pytest.FixtureRequest) -> str:
    path = shutil.which("promtool")
    if path is None:
        why = "promtool is not installed (apt-get install prometheus; tests/run.sh does)"
        if request.config.getoption("--run-privileged"):
            pytest.fail(why)
        pytest.skip(why)
    return path


def run(*argv: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, cwd=cwd, timeout=120)


def alert_names() -> list[str]:
    rules = yaml.safe_load(ALERTS.read_text())
    return [r["alert"] for g in rules["groups"] for r in g["rules"] if "alert" in r]


def rule_tests() -> dict[str, Any]:
    data: dict[str, Any] = yaml.safe_load(RULE_TESTS.read_text())
    return data


def test_promtool_check_rules_accepts_the_alerts(promtool: str) -> None:
    proc = run(promtool, "check", "rules", str(ALERTS))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"SUCCESS: {len(alert_names())} rules found" in proc.stdout


def test_promtool_rule_tests_pass(promtool: str) -> None:
    proc = run(promtool, "test", "rules", RULE_TESTS.name, cwd=RULE_TESTS.parent)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout


def test_the_rule_tests_load_the_example_file() -> None:
    files = [(RULE_TESTS.parent / f).resolve() for f in rule_tests()["rule_files"]]
    assert files == [ALERTS]


def test_every_alert_has_a_case_that_fires_it_and_one_that_does_not() -> None:
    fires: set[str] = set()
    quiet: set[str] = set()
    for case in rule_tests()["tests"]:
        for check in case["alert_rule_test"]:
            (fires if check["exp_alerts"] else quiet).add(check["alertname"])
            for alert in check["exp_alerts"]:
                # the annotations are part of the expectation: templates are checked too
                assert alert.get("exp_annotations", {}).get("summary"), check["alertname"]
    names = set(alert_names())
    assert len(names) >= 10
    assert names - fires == set(), "alerts no test fires"
    assert names - quiet == set(), "alerts with no near miss"
    assert (fires | quiet) - names == set(), "tests of alerts the file does not have"


@pytest.mark.parametrize("alert", ["TabbyIPPoolNearlyFull", "TabbyBirdRestarting"])
def test_promtool_fails_on_a_wrong_expectation(promtool: str, tmp_path: Path, alert: str) -> None:
    """The harness can fail: the same tests with one expected summary changed."""
    data = rule_tests()
    data["rule_files"] = [str(ALERTS)]
    changed = 0
    for case in data["tests"]:
        for check in case["alert_rule_test"]:
            if check["alertname"] == alert:
                for expected in check["exp_alerts"]:
                    expected["exp_annotations"]["summary"] += " (not what it says)"
                    changed += 1
    assert changed
    path = tmp_path / "wrong.test.yaml"
    path.write_text(yaml.safe_dump(data))
    proc = run(promtool, "test", "rules", str(path))
    assert proc.returncode != 0
    assert f"alertname: {alert}" in proc.stdout + proc.stderr
    assert "not what it says" in proc.stdout + proc.stderr
