"""The real tools read what the fuzz targets render from hostile names (tests/fuzz/
bird_render.py, tests/fuzz/nft_render.py): ``bird -p`` parses every BIRD configuration
whose names the model accepted, and ``nft -c`` (in a network namespace of its own, made
and gone with the process) takes every full ruleset rendered with a hostile string in one
of the datastore's slots."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings

from bird import check_config
from tests.fuzz import bird_render, nft_render

pytestmark = pytest.mark.privileged


def _needs(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.fail(f"{tool} is not installed (tests/run.sh installs it)")
    return path


@settings(max_examples=30)
@given(node=bird_render.names, peer=bird_render.names)
def test_bird_parses_what_hostile_names_render(
    node: str, peer: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    text = bird_render.check_names(node or bird_render.BENIGN, peer)
    if text is None:
        return  # refused by the model
    path = tmp_path_factory.mktemp("bird-fuzz") / "bird.conf"
    path.write_text(text, encoding="utf-8")
    check_config(str(path), _needs("bird"))


def _nft_check(text: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    path = tmp / "ruleset.nft"
    path.write_text(text, encoding="utf-8")
    return subprocess.run(
        ["unshare", "--net", _needs("nft"), "-c", "-f", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@settings(max_examples=30)
@given(slot=nft_render.slots, value=nft_render.values)
def test_nft_takes_what_hostile_strings_render(
    slot: int, value: str, tmp_path_factory: pytest.TempPathFactory
) -> None:
    nft_render.check_slot(slot, value)
    text, _ = nft_render.ruleset(nft_render.with_value(slot, value))
    done = _nft_check(text, tmp_path_factory.mktemp("nft-fuzz"))
    assert done.returncode == 0, done.stderr[-2000:]


def test_nft_refuses_what_the_checks_refuse(tmp_path: Path) -> None:
    """The two facts the property rests on, from nft itself: a comment over 128 bytes and
    a ';' in a chain's name break the transaction."""
    text, _ = nft_render.ruleset(nft_render._world())
    long = text.replace('comment "', 'comment "' + "x" * 129, 1)
    assert "comment too long" in _nft_check(long, tmp_path).stderr
    injected = text.replace("add chain inet tabby to-cali", "add chain inet tabby to-x;cali", 1)
    assert _nft_check(injected, tmp_path).returncode != 0
