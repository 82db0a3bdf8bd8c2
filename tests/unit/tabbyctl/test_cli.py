"""tabbyctl as a program: version, help for every command, and the demo's refusals (the demo
itself runs in tests/e2e/test_ctl_e2e.py). No store, no root."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from bundle import __version__
from cni_protocol.version import SUPPORTED_VERSIONS
from tabbyctl.cli import cli
from tests.unit.tabbyctl.helpers import (
    ok,
    one_line_error,
)

# == version ================================================================================


def test_version_table() -> None:
    result = CliRunner().invoke(cli, ["version"])
    (line,) = ok(result)
    assert line.startswith(f"tabby {__version__} (CNI ")
    assert ", ".join(SUPPORTED_VERSIONS) in line


def test_version_json() -> None:
    result = CliRunner().invoke(cli, ["version", "-o", "json"])
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["version"] == __version__
    assert data["cniVersions"] == list(SUPPORTED_VERSIONS)
    assert data["python"].count(".") == 2


def test_version_needs_no_conflist(tmp_path: Path) -> None:
    """version reads no configuration: a broken --conf does not matter."""
    result = CliRunner().invoke(cli, ["--conf", str(tmp_path / "missing"), "version"])
    assert ok(result)[0].startswith("tabby ")


@pytest.mark.parametrize(
    "command",
    [
        [],
        ["version"],
        ["ipam"],
        ["ipam", "show"],
        ["ipam", "check"],
        ["ipam", "release"],
        ["ipam", "gc"],
        ["pool"],
        ["pool", "list"],
        ["pool", "add"],
        ["pool", "disable"],
        ["pool", "enable"],
        ["pool", "delete"],
        ["demo"],
    ],
)
def test_every_command_has_help(command: list[str]) -> None:
    result = CliRunner().invoke(cli, [*command, "--help"])
    assert result.exit_code == 0, result.output
    assert "Usage:" in result.stdout


# == demo (its refusals; the demo itself runs in tests/e2e/test_ctl_e2e.py) ================


def test_demo_needs_root(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    line = one_line_error(CliRunner().invoke(cli, ["demo"]))
    assert line == "Error: the demo creates network namespaces: run it as root"


def test_demo_needs_the_installed_plugins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    line = one_line_error(CliRunner().invoke(cli, ["demo", "--cni-bin-dir", str(tmp_path)]))
    assert line == f"Error: {tmp_path / 'tabby'} not found or not executable: run ./build.sh first"
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("pods", ["0", "51", "x"])
def test_demo_pod_count_is_checked(pods: str) -> None:
    result = CliRunner().invoke(cli, ["demo", "--pods", pods])
    assert result.exit_code == 2
    assert "--pods" in result.stderr
