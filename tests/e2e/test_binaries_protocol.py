"""The installed binaries answer protocol errors as cni_protocol/CONFORMANCE.md says.

Exec'd exactly as a runtime does; each failure gives exit 1 and one error JSON on stdout
with the code docs/configuration.md "Error codes" gives, for both binaries.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import ALL_SPEC_VERSIONS
from tests.e2e.conftest import PLUGINS, exec_plugin

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("installed")]

SUPPORTED = ["0.3.0", "0.3.1", "0.4.0", "1.0.0", "1.1.0"]
GOOD_ENV = {
    "CNI_CONTAINERID": "e2e1",
    "CNI_NETNS": "/nonexistent/netns",
    "CNI_IFNAME": "eth0",
    "CNI_PATH": "/opt/cni/bin",
}


def conf(tmp_path: Path, version: str = "1.1.0") -> dict[str, object]:
    return {
        "cniVersion": version,
        "name": "e2e-proto",
        "type": "tabby",
        "log_file_path": str(tmp_path / "cni.log"),
        "ipam": {"type": "tabby-ipam", "data_dir": str(tmp_path / "ipam")},
    }


@pytest.mark.parametrize("binary", PLUGINS)
def test_version_with_podman_dummy_env(binary: str) -> None:
    """ENV-8, VER-1..4: podman's probe works with no store and no container id."""
    call = exec_plugin(
        binary,
        "VERSION",
        b'{"cniVersion":"1.1.0"}',
        env={"CNI_PATH": "dummy", "CNI_NETNS": "dummy", "CNI_IFNAME": "dummy"},
    )
    assert call.rc == 0, call
    assert call.out == {"cniVersion": "1.1.0", "supportedVersions": SUPPORTED}
    assert call.raw.count(b"\n") == 1


@pytest.mark.parametrize("binary", PLUGINS)
@pytest.mark.parametrize("version", ALL_SPEC_VERSIONS)
def test_version_echoes_each_version(binary: str, version: str) -> None:
    call = exec_plugin(binary, "VERSION", json.dumps({"cniVersion": version}).encode())
    assert (call.rc, call.out["cniVersion"]) == (0, version)


CASES = {
    "missing env": ("ADD", {"CNI_CONTAINERID": ""}, None, 4),
    "bad container id": ("ADD", {"CNI_CONTAINERID": "-bad/id"}, None, 4),
    "16-char ifname": ("ADD", {"CNI_IFNAME": "a" * 16}, None, 4),
    "bad JSON": ("ADD", {}, b"{not json", 6),
    "unknown version": ("ADD", {}, "9.9.9", 1),
    "CHECK at 0.3.1": ("CHECK", {}, "0.3.1", 1),
    "GC at 1.0.0": ("GC", {}, "1.0.0", 1),
    "STATUS at 1.0.0": ("STATUS", {}, "1.0.0", 1),
    "unknown command": ("FOO", {}, None, 4),
    "bad network name": ("ADD", {}, "badname", 7),
}


@pytest.mark.parametrize("binary", PLUGINS)
@pytest.mark.parametrize("case", sorted(CASES))
def test_protocol_errors(binary: str, case: str, tmp_path: Path) -> None:
    """GEN-1..3, GEN-6, GEN-7, GEN-9, ENV-1..4, CHK-1, GC-1, STA-1."""
    command, env_over, stdin_spec, code = CASES[case]
    env = {**GOOD_ENV, **env_over}
    if isinstance(stdin_spec, bytes):
        stdin: bytes | dict[str, object] = stdin_spec
    elif stdin_spec == "badname":
        stdin = {**conf(tmp_path), "name": "../escape"}
    elif stdin_spec:
        stdin = conf(tmp_path, stdin_spec)
    else:
        stdin = conf(tmp_path)
    call = exec_plugin(binary, command, stdin, env=env)
    assert call.rc == 1, call
    assert isinstance(call.out["code"], int)
    assert call.out["code"] == code, call
    assert call.out["msg"]
    assert set(call.out) <= {"cniVersion", "code", "msg", "details"}
    assert not (tmp_path / "ipam").exists()  # failed before touching the store


@pytest.mark.parametrize("binary", PLUGINS)
def test_debug_logging_never_reaches_stdout(binary: str, tmp_path: Path) -> None:
    """GEN-5: with debug logging, DEL's stdout is still empty; logs go to the file."""
    c = {**conf(tmp_path), "log_level": "debug"}
    call = exec_plugin(binary, "DEL", c, env=GOOD_ENV)
    assert call.rc == 0, call
    assert call.raw == b""
    assert (tmp_path / "cni.log").exists()
