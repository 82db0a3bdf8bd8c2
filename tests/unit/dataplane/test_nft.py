"""The nft applier (``dataplane.nft``) without a kernel: what it does with the text it is
given is the kernel tier's (tests/privileged/test_policy_nft.py)."""

from __future__ import annotations

import pytest

from dataplane import nft


class Recorder:
    name = "recorder"

    def __init__(self) -> None:
        self.sent: list[str] = []

    def run(self, text: str) -> str:
        self.sent.append(text)
        return ""


def test_libnftables_hands_over_to_the_cli_when_descriptors_run_high() -> None:
    """libnftables select()s on its socket: a descriptor >= 1024 would abort the process,
    so no context is made then and the namespace is served by the CLI."""
    try:
        lib = nft.LibNftables()
    except OSError:
        pytest.skip("libnftables.so.1 not installed")
    rec = Recorder()
    lib.FD_LIMIT = 0
    lib._cli = rec  # type: ignore[assignment]
    assert lib.run("list tables\n") == ""
    assert rec.sent == ["list tables\n"]
    assert list(lib._ctx.values()) == [None]
    lib.close()


def test_default_backend_is_one_per_process() -> None:
    assert nft.default_backend() is nft.default_backend()
