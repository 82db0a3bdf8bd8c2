"""Selectors from anyone who may write a pool or a peer (tests/fuzz/selector.py): any text
parses or is a SelectorError, and a selector means what its grammar says."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from resources.selector import MAX_DEPTH, SelectorError, parse_selector
from tests.fuzz import seed_ids, seeds, selector


@pytest.mark.parametrize("data", seeds("selector"), ids=seed_ids("selector"))
def test_corpus(data: bytes) -> None:
    selector.fuzz_one(data)


@given(text=st.text(max_size=60))
def test_any_text(text: str) -> None:
    selector.check_text(text)


@given(text=st.text(alphabet=st.sampled_from(list("()!&|{},=' \"ahsin")), max_size=60))
def test_any_text_of_the_grammar_s_characters(text: str) -> None:
    selector.check_text(text)


@given(expr=selector.expressions, labels=st.lists(selector.label_sets, min_size=1, max_size=4))
def test_a_selector_means_what_its_grammar_says(
    expr: tuple[str, selector.Meaning], labels: list[dict[str, str]]
) -> None:
    text, meaning = expr
    sel = parse_selector(text)
    for lb in labels:
        assert sel.matches(lb) == meaning(lb), (text, lb)


@pytest.mark.parametrize("text", ["(" * 3000, "(" * 65 + "all()" + ")" * 65])
def test_deep_nesting_is_a_selector_error(text: str) -> None:
    """Found by fuzzing: nesting past the stack raised RecursionError, which escaped the
    resources' validation (a traceback from tabbyctl apply) and tabby-node's routing,
    which catches ValueError only."""
    with pytest.raises(SelectorError, match="nested deeper"):
        parse_selector(text)
    assert parse_selector("(" * MAX_DEPTH + "all()" + ")" * MAX_DEPTH).matches({})


def test_a_run_of_negations_is_no_nesting() -> None:
    """``!`` repeated is taken without recursion (the parser collapses the run), at any
    length: no RecursionError, and its meaning by its parity."""
    assert parse_selector("!" * 3000 + "all()").matches({})
    assert not parse_selector("!" * 3001 + "all()").matches({})
