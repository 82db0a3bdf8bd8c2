"""Names, labels and ports others choose in the nftables ruleset (tests/fuzz/nft_render.py):
refused with their document, or confined to quoted strings that nft takes."""

from __future__ import annotations

import pytest
from hypothesis import given

from tests.fuzz import nft_render, seed_ids, seeds


@pytest.mark.parametrize("data", seeds("nft_render"), ids=seed_ids("nft_render"))
def test_corpus(data: bytes) -> None:
    nft_render.fuzz_one(data)


def test_the_world_renders_and_every_document_is_accepted() -> None:
    text, accepted = nft_render.ruleset(nft_render._world())
    assert accepted
    assert "jump pi-" in text
    nft_render.check_text(text)


@given(slot=nft_render.slots, value=nft_render.values)
def test_a_hostile_string_never_changes_the_ruleset_s_meaning(slot: int, value: str) -> None:
    nft_render.check_slot(slot, value)


def test_the_check_sees_an_injection() -> None:
    """The property can fail: a name that ends an nft command is seen."""
    text, _ = nft_render.ruleset(nft_render._world())
    injected = text.replace("to-cali", "to-x;flush ruleset;cali")
    assert nft_render.skeleton(injected) != nft_render.skeleton(text)
    with pytest.raises(AssertionError):
        nft_render.check_text(text.replace('comment "', 'comment #"', 1))
    with pytest.raises(AssertionError):
        nft_render.check_text(text.replace('comment "', 'comment "' + "x" * 200, 1))
