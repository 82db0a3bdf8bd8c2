"""Hostile values the targets share: text with controls, quotes, separators, lone
surrogates and other scripts' digits; JSON of any shape; a JSON document with a few of its
values replaced by those."""

from __future__ import annotations

import copy

from hypothesis import strategies as st

#: What nft, BIRD, a shell or a parser may read as syntax, and what Python reads oddly.
SPECIALS = list(";=,./\\\"'`\n\r\t\x00\x0b\x0c\x7f\x85{}[]()<>:#%$*&|! ²١\u2028\ufeff")
texts = st.one_of(
    st.text(max_size=40),
    st.text(alphabet=st.sampled_from(SPECIALS + list("az09-_")), max_size=30),
    st.sampled_from(
        ["", ".", "..", "-", "1.².0", "x" * 300, "\udcff", '"; flush ruleset; "', "*/ }"]
    ),
)
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | texts,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(texts, inner, max_size=4),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, base: object, most: int = 3) -> object:
    """``base`` with 1..``most`` of its values (at any depth) replaced by hostile JSON."""
    doc = copy.deepcopy(base)
    for _ in range(draw(st.integers(1, most))):
        parent: dict[object, object] | list[object] | None = None
        key: object = None
        node: object = doc
        while isinstance(node, dict | list) and node and (parent is None or draw(st.booleans())):
            keys = sorted(node, key=str) if isinstance(node, dict) else list(range(len(node)))
            key = draw(st.sampled_from(keys))
            parent, node = node, node[key]  # type: ignore[index]
        if parent is None:
            return draw(json_values)
        parent[key] = draw(json_values)  # type: ignore[index]
    return doc
