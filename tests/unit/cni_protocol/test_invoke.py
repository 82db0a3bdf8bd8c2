"""Delegation to an IPAM plugin by exec (cni_protocol/CONFORMANCE.md IPM-1..4, IPM-6, ENV-6)."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path

import pytest

from cni_protocol import invoke
from cni_protocol.errors import CniError

STUB = """#!{python}
import json, os, sys
data = sys.stdin.buffer.read()
rec = {{"env": dict(os.environ), "stdin": data.decode()}}
open({record!r}, "w").write(json.dumps(rec))
sys.stderr.write("stub stderr line\\n")
mode = os.environ.get("STUB_MODE", "ok")
if mode == "ok":
    print(json.dumps({{"cniVersion": "1.0.0", "ips": [{{"address": "10.0.0.1/32"}}]}}))
elif mode == "error":
    print(json.dumps({{"cniVersion": "1.0.0", "code": 11, "msg": "busy", "details": "lock"}}))
    sys.exit(1)
elif mode == "garbage":
    print("not json")
elif mode == "silent-fail":
    sys.exit(3)
elif mode == "empty":
    pass
"""


@pytest.fixture
def stub(tmp_path: Path) -> tuple[Path, Path]:
    bindir = tmp_path / "bin"
    bindir.mkdir()
    record = tmp_path / "record.json"
    script = bindir / "stub-ipam"
    script.write_text(STUB.format(python=sys.executable, record=str(record)))
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return bindir, record


ENV = {
    "CNI_COMMAND": "ADD",
    "CNI_CONTAINERID": "c1",
    "CNI_NETNS": "/x",
    "CNI_IFNAME": "eth0",
    "CNI_ARGS": "K8S_POD_NAME=p;K8S_POD_NAMESPACE=n",
    "PATH": os.environ.get("PATH", ""),
}


def test_same_env_and_byte_identical_stdin(stub: tuple[Path, Path]) -> None:
    """IPM-2 (same env, only CNI_COMMAND changed, identical stdin), IPM-6, ENV-6."""
    bindir, record = stub
    stdin = b'{"cniVersion": "1.0.0",  "name": "n", "ipam": {"type": "stub-ipam"}}\n'
    path = ["/nonexistent", "", str(bindir)]
    out = invoke.exec_plugin("stub-ipam", "DEL", stdin, {**ENV, "CNI_PATH": ":".join(path)}, path)
    assert out is not None
    assert out["ips"] == [{"address": "10.0.0.1/32"}]
    rec = json.loads(record.read_text())
    assert rec["stdin"].encode() == stdin
    env = rec["env"]
    assert env["CNI_COMMAND"] == "DEL"
    for k in ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME"):
        assert env[k] == ENV[k]
    assert env["CNI_ARGS"] == "IgnoreUnknown=1;K8S_POD_NAME=p;K8S_POD_NAMESPACE=n"


def test_delegate_error_code_passes_through(
    stub: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """IPM-4: a code 11 stays 11 (no double wrapping)."""
    bindir, _ = stub
    with pytest.raises(CniError) as e:
        invoke.exec_plugin("stub-ipam", "ADD", b"{}", {**ENV, "STUB_MODE": "error"}, [str(bindir)])
    assert (e.value.code, e.value.msg, e.value.details) == (11, "busy", "lock")


@pytest.mark.parametrize("mode", ["garbage", "silent-fail"])
def test_delegate_without_cni_error_is_104(stub: tuple[Path, Path], mode: str) -> None:
    bindir, _ = stub
    with pytest.raises(CniError) as e:
        invoke.exec_plugin("stub-ipam", "ADD", b"{}", {**ENV, "STUB_MODE": mode}, [str(bindir)])
    assert e.value.code == 104


def test_empty_stdout_is_none(stub: tuple[Path, Path]) -> None:
    bindir, _ = stub
    assert (
        invoke.exec_plugin("stub-ipam", "DEL", b"{}", {**ENV, "STUB_MODE": "empty"}, [str(bindir)])
        is None
    )


def test_not_found_lists_searched_paths() -> None:
    """IPM-1."""
    with pytest.raises(CniError) as e:
        invoke.exec_plugin("nope-ipam", "ADD", b"{}", ENV, ["/a", "/b"])
    assert e.value.code == 104
    assert "/a" in e.value.details
    assert "/b" in e.value.details


@pytest.mark.parametrize("bad", ["../x", "a/b", "", ".."])
def test_type_with_path_characters_is_code_7(bad: str) -> None:
    """CFG-4."""
    with pytest.raises(CniError) as e:
        invoke.find_plugin(bad, ["/opt/cni/bin"])
    assert e.value.code == 7
