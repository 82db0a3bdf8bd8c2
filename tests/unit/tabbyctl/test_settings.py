"""tabbyctl's settings and helpful errors: --conf (missing, without tabby, unusable), the default
conflist, built-in defaults, overrides, and a corrupt or unreadable store named in one line."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from datastore.file import FileStore, _dir_error
from tabbyctl import views
from tabbyctl.cli import cli
from tests.unit.tabbyctl.helpers import (
    NET,
    NODE,
    V4,
    Ctl,
    ctl_fixture,  # noqa: F401  (the ``ctl`` fixture)
    findings,
    ok,
    one_line_error,
)

# == settings and helpful errors ============================================================


def test_conf_missing_file(ctl: Ctl) -> None:
    missing = ctl.tmp / "nope.conflist"
    line = one_line_error(CliRunner().invoke(cli, ["--conf", str(missing), "ipam", "show"]))
    assert line == f"Error: cannot read {missing}: No such file or directory"


def test_conf_without_tabby(ctl: Ctl) -> None:
    other = ctl.tmp / "87-bridge.conflist"
    other.write_text(
        json.dumps({"cniVersion": "1.0.0", "name": "b", "plugins": [{"type": "bridge"}]})
    )
    line = one_line_error(CliRunner().invoke(cli, ["--conf", str(other), "pool", "list"]))
    assert line == f"Error: {other} has no plugin of type tabby"


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("{not json", "is not valid JSON"),
        ('["a list"]', "has no plugin of type tabby"),
        ('{"name": "n", "plugins": [{"type": "tabby", "ipam": "file"}]}', "not a JSON object"),
        (
            '{"name": "n", "plugins": [{"type": "tabby", "ipam": {"block_size_ipv4": 99}}]}',
            "block_size_ipv4",
        ),
        (
            '{"name": "n", "plugins": [{"type": "tabby", "ipam": {"datastore_type": "zk"}}]}',
            "datastore_type",
        ),
        (
            '{"name": "n", "plugins": [{"type": "tabby", "ipam": {"data_dir": "rel/dir"}}]}',
            "absolute",
        ),
    ],
)
def test_conf_unusable(ctl: Ctl, text: str, needle: str) -> None:
    ctl.conf.write_text(text)
    line = one_line_error(ctl.run("ipam", "show"))
    assert needle in line
    assert str(ctl.conf) in line


def test_single_plugin_conf_is_accepted(ctl: Ctl) -> None:
    """A .conf (one plugin, no "plugins" list) as the runtimes' test tools write it."""
    ctl.add("pod-a")
    single = ctl.tmp / "tabby.conf"
    single.write_text(
        json.dumps(
            {
                "name": NET,
                "type": "tabby",
                "nodename": NODE,
                "ipam": {"data_dir": str(ctl.data_dir)},
            }
        )
    )
    result = CliRunner().invoke(cli, ["--conf", str(single), "ipam", "show", "-o", "json"])
    assert len(json.loads(result.stdout)["allocations"]) == 2


def test_corrupt_store_file_is_named(ctl: Ctl) -> None:
    """Store unreadable: exit 1, one line naming the file, no traceback, for every command
    that needs the document."""
    ctl.add("pod-a")
    pool_file = Path(ctl.store().location("pool", V4))
    pool_file.write_text("{truncat")
    for args in (
        ["ipam", "show"],
        ["ipam", "show", "-o", "json"],
        ["ipam", "show", "--ip", "10.244.9.9"],
        ["pool", "list"],
        ["pool", "add", "10.70.0.0/16"],
        ["pool", "disable", V4],
        ["pool", "delete", V4],
    ):
        line = one_line_error(ctl.run(*args))
        assert str(pool_file) in line, (args, line)
        assert "truncated or not JSON" in line
    # check lists it instead of failing on it
    data = ctl.json("ipam", "check")
    assert ("corrupt", str(pool_file)) in findings(data)
    assert ctl.run("ipam", "check").exit_code == 1


def test_corrupt_block_fails_release_naming_it(ctl: Ctl) -> None:
    ips = ctl.add("pod-a")
    block_file = Path(ctl.store().location("block", ctl.block_of(ips[0])))
    block_file.write_text("")
    line = one_line_error(ctl.run("ipam", "release", "--handle", f"{NET}:pod-a:eth0"))
    assert f"{block_file}: empty file" in line
    line = one_line_error(ctl.run("ipam", "show", "--ip", ips[0]))
    assert str(block_file) in line


def test_store_not_readable_without_root(ctl: Ctl, monkeypatch: pytest.MonkeyPatch) -> None:
    """As a non-root user the 0700 store cannot be opened: say so, name it, suggest root."""
    ctl.add("pod-a")

    def denied(self: FileStore, *, create: bool) -> int | None:
        raise _dir_error(self.data_dir, PermissionError(errno.EACCES, os.strerror(errno.EACCES)))

    monkeypatch.setattr(FileStore, "_open_root", denied)
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    for args in (["ipam", "show"], ["ipam", "check"], ["pool", "list"], ["ipam", "gc"]):
        line = one_line_error(ctl.run(*args))
        assert str(ctl.data_dir) in line
        assert line.endswith("Permission denied: run tabbyctl as root"), line
    # as root the same failure is not blamed on privileges
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    line = one_line_error(ctl.run("ipam", "show"))
    assert line.endswith(f"{ctl.data_dir}: Permission denied")


def test_no_conflist_means_built_in_defaults(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "net.d"
    conf_dir.mkdir()
    (conf_dir / "87-bridge.conflist").write_text(
        json.dumps({"name": "b", "plugins": [{"type": "bridge"}]})
    )
    monkeypatch.setattr(views, "DEFAULT_CONF_DIR", str(conf_dir))
    data_dir = tmp_path / "store"
    result = CliRunner().invoke(cli, ["--data-dir", str(data_dir), "ipam", "show"])
    assert ok(result)[0] == f"file store {data_dir} (built-in defaults)"
    s = views.load_settings(None)
    assert (s.source, s.network, s.ipam.data_dir) == (
        "built-in defaults",
        "k8s-pod-network",
        "/var/lib/tabby/ipam",
    )
    assert s.ipam.ipv4_pools == ["10.244.0.0/16"]
    monkeypatch.setattr(views, "DEFAULT_CONF_DIR", str(tmp_path / "absent"))
    assert views.load_settings(None).source == f"built-in defaults (no {tmp_path / 'absent'})"


def test_default_conflist_is_the_first_with_tabby(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    conf_dir = tmp_path / "net.d"
    conf_dir.mkdir()
    (conf_dir / "05-broken.conflist").write_text("{nope")
    (conf_dir / "07-bridge.conflist").write_text(json.dumps({"plugins": [{"type": "bridge"}]}))
    for n, node in (("10", "first"), ("20", "second")):
        (conf_dir / f"{n}-tabby.conflist").write_text(
            json.dumps(
                {
                    "name": f"net-{n}",
                    "plugins": [
                        {"type": "tabby", "nodename": node, "ipam": {"data_dir": f"/x/{n}"}}
                    ],
                }
            )
        )
    monkeypatch.setattr(views, "DEFAULT_CONF_DIR", str(conf_dir))
    result = CliRunner().invoke(cli, ["--data-dir", str(tmp_path / "s"), "ipam", "show"])
    assert ok(result)[0] == f"file store {tmp_path / 's'} ({conf_dir / '10-tabby.conflist'})"
    s = views.load_settings(None)
    assert (s.network, s.node, s.datastore.data_dir) == ("net-10", "first", "/x/10")
    s = views.load_settings(None, data_dir="/y", node="other")
    assert (s.node, s.datastore.data_dir) == ("other", "/y")


def test_data_dir_and_node_overrides(ctl: Ctl) -> None:
    ctl.add("pod-a")
    elsewhere = ctl.tmp / "elsewhere"
    result = ctl.run("--data-dir", str(elsewhere), "ipam", "show", "-o", "json")
    data = json.loads(result.stdout)
    assert (data["store"], data["allocations"]) == (f"file store {elsewhere}", [])
    assert (
        json.loads(ctl.run("--node", "n9", "ipam", "check", "-o", "json").stdout)["node_name"]
        == "n9"
    )
