"""The installed bundle hands its children the environment the runtime gave it.

PyInstaller's bootloader puts the bundle's ``_internal`` in front of ``LD_LIBRARY_PATH``;
bundle/environ.py takes it out again at the entry, so a delegated plugin (here a shell
script standing in for any IPAM plugin, which DEL runs without a network namespace) sees
exactly what the runtime passed: containerd's own library path, or none. With
TABBY_E2E_NODE=1 the call goes through tabby-node, which execs the delegate with the
caller's environment.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.conftest import TABBY, exec_plugin

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("installed")]

DUMP = """#!/bin/sh
env > "$(dirname "$0")/env.$CNI_COMMAND"
echo '{"cniVersion": "1.0.0"}'
"""


@pytest.mark.parametrize(
    "given", [None, "/var/lib/containerd/opt/lib:"], ids=["no-library-path", "containerd"]
)
def test_a_delegate_gets_the_runtimes_library_path(tmp_path: Path, given: str | None) -> None:
    plugin = tmp_path / "envdump"
    plugin.write_text(DUMP)
    plugin.chmod(0o755)
    env = {
        "CNI_CONTAINERID": "bundle-env",
        "CNI_NETNS": "",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": str(tmp_path),
    }
    if given is not None:
        env["LD_LIBRARY_PATH"] = given
    conf = {
        "cniVersion": "1.0.0",
        "name": "bundle-env",
        "type": "tabby",
        "log_file_path": str(tmp_path / "cni.log"),
        "ipam": {"type": "envdump"},
    }
    call = exec_plugin(TABBY, "DEL", conf, env=env)
    assert call.rc == 0, call
    seen = dict(
        line.split("=", 1)
        for line in (tmp_path / "env.DEL").read_text().splitlines()
        if "=" in line
    )
    assert "LD_LIBRARY_PATH_ORIG" not in seen
    assert seen.get("LD_LIBRARY_PATH") == given
