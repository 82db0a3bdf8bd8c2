"""The unit tier's own fixtures."""

from __future__ import annotations

from pathlib import Path

import pytest

from cni_config.known import CACHE_ENV


@pytest.fixture(autouse=True)
def config_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Each test keeps validated configurations in a directory of its own
    (``cni_config.known``), never in the machine's /run/tabby."""
    where = tmp_path / "config-cache"
    monkeypatch.setenv(CACHE_ENV, str(where))
    return where
