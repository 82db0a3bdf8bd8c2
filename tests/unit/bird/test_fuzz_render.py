"""Names others choose in BIRD's configuration (tests/fuzz/bird_render.py): refused by the
model, or confined to their comment or string."""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.fuzz import bird_render, seed_ids, seeds


@pytest.mark.parametrize("data", seeds("bird_render"), ids=seed_ids("bird_render"))
def test_corpus(data: bytes) -> None:
    bird_render.fuzz_one(data)


@given(node=bird_render.names, peer=bird_render.names)
def test_a_name_never_changes_the_configuration_s_structure(node: str, peer: str) -> None:
    bird_render.check_names(node or bird_render.BENIGN, peer)


def test_the_structure_check_sees_an_injection() -> None:
    """The property can fail: a name that ended its string would add a protocol."""
    text = bird_render.render(bird_render.config("n", "p"))
    evil = text.replace('description "p";', 'description "p"; } protocol static x { ipv4;')
    assert bird_render.tokens(evil) != bird_render.tokens(text)
