"""Hostile CNI calls (tests/fuzz/cni.py): skel and the plugins' parsing answer every one
with exit status 0 or one CNI error object of a known code, never 999 and never a
traceback, in-process and from a real process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cni_protocol import skel
from cni_protocol.errors import CniError
from tests import REPO_ROOT
from tests.fuzz import cni, seed_ids, seeds


@given(env=cni.environments(), stdin=cni.configs())
def test_hostile_calls_answer_with_one_cni_error(env: dict[str, str], stdin: bytes) -> None:
    cni.call(env, stdin)


@pytest.mark.parametrize("data", seeds("cni"), ids=seed_ids("cni"))
def test_corpus(data: bytes) -> None:
    cni.fuzz_one(data)


@given(raw=st.text(max_size=60))
def test_cni_args_parse_to_what_they_say(raw: str) -> None:
    parsed = cni.parse_cni_args(raw)
    for key, value in parsed.items():
        assert key, parsed
        assert key == key.strip(), parsed
        assert ";" not in key + value, parsed
        assert "=" not in key


def _run_binary(env: dict[str, str], stdin: bytes, tmp: Path) -> subprocess.CompletedProcess[bytes]:
    """The plugin as a runtime execs it (the bundle's entry, from this checkout)."""
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(REPO_ROOT)}
    clean |= {"TABBY_NODE_SOCKET": "off", "TABBY_CONFIG_CACHE": "off", "HOME": str(tmp)}
    code = "import sys; sys.argv[0] = 'tabby'; from bundle.entry import main; main()"
    return subprocess.run(
        [sys.executable, "-c", code],
        input=stdin,
        env=clean | env,
        capture_output=True,
        timeout=60,
        check=False,
    )


@settings(max_examples=8)
@given(env=cni.environments(), stdin=cni.configs())
def test_hostile_calls_to_the_binary(
    env: dict[str, str], stdin: bytes, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """GEN-5 (cni_protocol/CONFORMANCE.md): the exec'd plugin refuses what skel refuses
    with the same one error object on stdout and no traceback on stderr. Only calls skel
    refuses are exec'd: a call that parses would go on to the datastore and the kernel."""
    try:
        skel.build_args(env, stdin)
    except CniError as e:
        want = e.code
    else:
        return
    env = {k: v for k, v in env.items() if "\0" not in k + v}
    done = _run_binary(env, stdin, tmp_path_factory.mktemp("cni-exec"))
    assert b"Traceback" not in done.stderr, done.stderr.decode(errors="replace")
    err = cni.check_answer(done.returncode, done.stdout, env.get("CNI_COMMAND", ""))
    if err is not None:
        assert err["code"] == want, (err, want)
    assert json.loads(done.stdout)
