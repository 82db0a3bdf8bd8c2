"""Calico label selectors (``resources.selector``: IPPool and BGPPeer ``nodeSelector``,
``peerSelector``), as written by whoever may write those resources.

Properties: ``parse_selector`` of any text is a ``Selector`` that keeps that text and whose
canonical ``str()`` parses back to an equal selector, or ``SelectorError`` (never another
exception, at any nesting); a selector generated from
the grammar (:data:`expressions`, each with its own meaning computed here) matches exactly
the label sets its meaning says.

Input bytes (atheris): the selector text (UTF-8, undecodable bytes replaced).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from hypothesis import strategies as st

from resources.selector import Selector, SelectorError, parse_selector

Labels = Mapping[str, str]
Meaning = Callable[[Labels], bool]


def check_text(text: str) -> Selector | None:
    try:
        sel = parse_selector(text)
    except SelectorError:
        return None
    assert sel.text == text
    assert parse_selector(str(sel)) == sel
    sel.matches({})
    sel.matches({"a": "x", "rack": "r1"})
    return sel


def fuzz_one(data: bytes) -> None:
    check_text(data.decode("utf-8", "replace"))


# -- hypothesis: expressions with their meaning --------------------------------------------

keys = st.sampled_from(["a", "rack", "k8s.io/zone", "x-y_z"])
values = st.text(alphabet=st.characters(blacklist_characters="\"'"), max_size=6)
label_sets = st.dictionaries(keys, st.sampled_from(["", "x", "r1", "a b", "x'\""]), max_size=3)


def _q(value: str) -> str:
    return f'"{value}"'


@st.composite
def _leaf(draw: st.DrawFn) -> tuple[str, Meaning]:
    key = draw(keys)
    op = draw(
        st.sampled_from(["==", "!=", "in", "not in", "has", "all", "contains", "starts", "ends"])
    )
    if op == "all":
        return "all()", lambda lb: True
    if op == "has":
        return f"has({key})", lambda lb: key in lb
    if op in ("in", "not in"):
        vals = draw(st.lists(values, max_size=3))
        text = f"{key} {op} {{{', '.join(_q(v) for v in vals)}}}"
        if op == "in":
            return text, lambda lb: lb.get(key) in vals
        return text, lambda lb: lb.get(key) not in vals
    v = draw(values)
    if op == "==":
        return f"{key} == {_q(v)}", lambda lb: lb.get(key) == v
    if op == "!=":
        return f"{key} != {_q(v)}", lambda lb: lb.get(key) != v
    if op == "contains":
        return f"{key} contains {_q(v)}", lambda lb: key in lb and v in lb[key]
    if op == "starts":
        return f"{key} starts with {_q(v)}", lambda lb: key in lb and lb[key].startswith(v)
    return f"{key} ends with {_q(v)}", lambda lb: key in lb and lb[key].endswith(v)


def _combine(
    inner: st.SearchStrategy[tuple[str, Meaning]],
) -> st.SearchStrategy[tuple[str, Meaning]]:
    def neg(e: tuple[str, Meaning]) -> tuple[str, Meaning]:
        text, m = e
        return f"!({text})", lambda lb: not m(lb)

    def both(pair: tuple[tuple[str, Meaning], tuple[str, Meaning]], op: str) -> tuple[str, Meaning]:
        (ta, ma), (tb, mb) = pair
        if op == "&&":
            return f"({ta}) && ({tb})", lambda lb: ma(lb) and mb(lb)
        return f"({ta}) || ({tb})", lambda lb: ma(lb) or mb(lb)

    return st.one_of(
        inner.map(neg),
        st.tuples(inner, inner).map(lambda p: both(p, "&&")),
        st.tuples(inner, inner).map(lambda p: both(p, "||")),
    )


expressions = st.recursive(_leaf(), _combine, max_leaves=8)


if __name__ == "__main__":
    from tests.fuzz.runner import main

    main(fuzz_one, ["resources"])
