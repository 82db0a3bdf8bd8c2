"""Incremental routing equals the whole recompute: random histories replayed op by op,
compared after every op (tests/unit/routing_replay.py says what is compared), against an
in-memory kernel. The privileged tier replays them against a real one.

``TABBY_REPLAY_SEEDS=N`` replays N seeds per backend instead of the default six (a
developer's run replays the first one, the rest are marked slow: tests/selection.py);
``TABBY_REPLAY_OPS`` sets the ops per seed.
"""

from __future__ import annotations

import os

import pytest

from tests.selection import quick_first
from tests.unit.routing_replay import replay

SEEDS = int(os.environ.get("TABBY_REPLAY_SEEDS", "6"))
OPS = int(os.environ.get("TABBY_REPLAY_OPS", "250"))


@pytest.mark.parametrize("seed", quick_first(SEEDS, 1))
@pytest.mark.parametrize("backend", ["vxlan", "bird"])
def test_incremental_equals_whole_after_every_op(backend: str, seed: int) -> None:
    r = replay(seed, backend, OPS)
    for view in r.views.values():
        assert view.table.rebuilds >= 1
        assert view.deltas > 0, "a history that never changed the vxlan state tests nothing"
