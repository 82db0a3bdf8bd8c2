"""Hostile files for ``tabbyctl apply`` (tests/fuzz/apply_yaml.py): refused in one line or
applied, never a traceback."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fuzz import apply_yaml, seed_ids, seeds


@pytest.mark.parametrize("data", seeds("apply_yaml"), ids=seed_ids("apply_yaml"))
def test_corpus(data: bytes) -> None:
    apply_yaml.fuzz_one(data)


@given(text=apply_yaml.files())
def test_resources_with_hostile_values(text: str) -> None:
    apply_yaml.check_file(text)


@given(text=st.text(alphabet=st.sampled_from(list("&*[]{}:-!|>'\"#\n abk,?%@")), max_size=60))
def test_text_of_yaml_s_syntax(text: str) -> None:
    apply_yaml.check_file(text)
