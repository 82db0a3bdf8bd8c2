"""Calico's selector language (resources/selector.py): every operator, quoting, precedence,
absent labels, ``global()``; malformed selectors refused at a named offset; the canonical text;
``keys()``; the namespace and service-account scopes the policy model builds on."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from resources.selector import (
    MAX_DEPTH,
    MAX_LABEL_LENGTH,
    MAX_SELECTOR_LENGTH,
    NAMESPACE_LABEL,
    All,
    And,
    Compare,
    Global,
    Has,
    In,
    Node,
    Not,
    Or,
    Selector,
    SelectorError,
    endpoint_labels,
    parse_selector,
    policy_selector,
    rule_selector,
)

NS = {NAMESPACE_LABEL: "prod"}

MATCHES: list[tuple[str, dict[str, str], bool]] = [
    # empty and all()
    ("", {}, True),
    ("   ", {"a": "b"}, True),
    ("all()", {"a": "b"}, True),
    ("all( )", {}, True),
    ("!all()", {}, False),
    # ==
    ("rack == 'a'", {"rack": "a"}, True),
    ('rack == "a"', {"rack": "b"}, False),
    ("rack == 'a'", {}, False),
    ("rack == ''", {"rack": ""}, True),
    ("rack == ''", {}, False),
    ("rack=='a'", {"rack": "a"}, True),
    ("rack == 'A'", {"rack": "a"}, False),
    # !=: an absent label is not equal
    ("rack != 'a'", {}, True),
    ("rack != 'a'", {"rack": "a"}, False),
    ("rack != 'a'", {"rack": "b"}, True),
    ("rack != ''", {"rack": ""}, False),
    # in / not in
    ("rack in {'a', 'b'}", {"rack": "b"}, True),
    ("rack in {'a', 'b'}", {"rack": "c"}, False),
    ("rack in {'a', 'b'}", {}, False),
    ("rack in {}", {"rack": "b"}, False),
    ("rack in {}", {}, False),
    ("rack in {''}", {"rack": ""}, True),
    ("rack in {'a',}", {"rack": "a"}, True),
    ("rack in{'a'}", {"rack": "a"}, True),
    ("rack not in {'a'}", {}, True),
    ("rack not in {'a'}", {"rack": "a"}, False),
    ("rack not in {'a'}", {"rack": "b"}, True),
    ("rack not in {}", {}, True),
    ("rack not in {}", {"rack": "x"}, True),
    ("rack notin {'a'}", {"rack": "a"}, False),
    ("rack not\t in {'a'}", {"rack": "b"}, True),
    # has / !has
    ("has(rack)", {"rack": ""}, True),
    ("has(rack)", {}, False),
    ("has( rack )", {"rack": "x"}, True),
    ("!has(rack)", {}, True),
    ("!has(rack)", {"rack": "x"}, False),
    ("! has(rack)", {}, True),
    # contains / starts with / ends with: false where the label is absent
    ("name contains 'eb'", {"name": "web"}, True),
    ("name contains 'x'", {"name": "web"}, False),
    ("name contains ''", {"name": ""}, True),
    ("name contains ''", {}, False),
    ("name starts with 'we'", {"name": "web"}, True),
    ("name starts with 'eb'", {"name": "web"}, False),
    ("name startswith 'we'", {"name": "web"}, True),
    ("name starts with ''", {}, False),
    ("name ends with 'eb'", {"name": "web"}, True),
    ("name ends with 'we'", {"name": "web"}, False),
    ("name ends   with 'b'", {"name": "web"}, True),
    ("name ends with 'b'", {}, False),
    ("!name contains 'x'", {}, True),
    # quoting: no escapes; each kind of quote holds the other
    ("""msg == "it's" """, {"msg": "it's"}, True),
    ("""msg == 'say "hi"'""", {"msg": 'say "hi"'}, True),
    ("msg == 'a && b || !(c)'", {"msg": "a && b || !(c)"}, True),
    ("msg == 'two  spaces'", {"msg": "two  spaces"}, True),
    ("msg == 'ünïcode'", {"msg": "ünïcode"}, True),
    ("msg == '\\n'", {"msg": "\\n"}, True),
    ("a ==\n'b'\n", {"a": "b"}, True),  # a YAML block scalar's line breaks
    ("msg in {'x,y'}", {"msg": "x,y"}, True),
    ("msg in {'x,y'}", {"msg": "x"}, False),
    # double quotes with every operator that takes a string, and both kinds in one set
    ('rack != "a"', {"rack": "a"}, False),
    ("rack in {\"a\", 'b'}", {"rack": "b"}, True),
    ("rack in {\"a\", 'b'}", {"rack": "a"}, True),
    ("rack not in {\"a\", 'b'}", {"rack": "b"}, False),
    ('name contains "e"', {"name": "web"}, True),
    ('name starts with "w"', {"name": "web"}, True),
    ('name ends with "w"', {"name": "web"}, False),
    ('msg in {"it\'s", \'say "hi"\'}', {"msg": 'say "hi"'}, True),
    # label keys: prefixes, dots, dashes, digits, operator words as keys
    ("projectcalico.org/namespace == 'prod'", NS, True),
    ("k8s.io/app-name_1 == 'x'", {"k8s.io/app-name_1": "x"}, True),
    ("route-reflector == 'true'", {"route-reflector": "true"}, True),
    ("9lives == 'y'", {"9lives": "y"}, True),
    ("in in {'in'}", {"in": "in"}, True),
    ("has == 'x'", {"has": "x"}, True),
    ("all == 'x'", {"all": "x"}, True),
    ("not not in {'x'}", {"not": "y"}, True),
    ("contains contains 'on'", {"contains": "cnt"}, False),
    ("global == 'g'", {"global": "g"}, True),
    # ! binds tightest, then &&, then ||
    ("a == 'x' || b == 'y' && c == 'z'", {"a": "x"}, True),
    ("a == 'x' || b == 'y' && c == 'z'", {"b": "y"}, False),
    ("a == 'x' && b == 'y' || c == 'z'", {"c": "z"}, True),
    ("(a == 'x' || b == 'y') && c == 'z'", {"a": "x"}, False),
    ("(a == 'x' || b == 'y') && c == 'z'", {"b": "y", "c": "z"}, True),
    ("!a == 'x' && b == 'y'", {"b": "y"}, True),
    ("!(a == 'x' && b == 'y')", {"b": "y"}, True),
    ("!(a == 'x' && b == 'y')", {"a": "x", "b": "y"}, False),
    ("!a == 'x' || has(b)", {"a": "x"}, False),
    ("!!has(a)", {"a": ""}, True),
    ("!!!has(a)", {"a": ""}, False),
    ("((((has(a)))))", {"a": ""}, True),
    ("!(example.com/role == 'rr') && has(b)", {"b": "1"}, True),
    ("has(a)&&has(b)||has(c)", {"c": ""}, True),
    ("has(a)\t&&\thas(b)", {"a": "", "b": ""}, True),
    # global(): only objects outside every namespace
    ("global()", {}, True),
    ("global()", {"role": "db"}, True),
    ("global()", NS, False),
    ("!global()", NS, True),
    ("global( )", {}, True),
    ("global() || role == 'db'", {**NS, "role": "db"}, True),
]


@pytest.mark.parametrize(("text", "labels", "expected"), MATCHES)
def test_matches(text: str, labels: dict[str, str], expected: bool) -> None:
    sel = parse_selector(text)
    assert sel.matches(labels) is expected
    again = parse_selector(str(sel))
    assert again == sel
    assert again.matches(labels) is expected


# (selector, offset of the error, words of the reason)
MALFORMED: list[tuple[str, int, str]] = [
    ("rack ==", 7, "expected a quoted string after '=='"),
    ("rack = 'a'", 5, "expected '=='"),
    ("rack =! 'a'", 5, "expected '=='"),
    ("a & b", 2, "expected '&&'"),
    ("has(a) | has(b)", 7, "expected '||'"),
    ("has(", 4, "expected a label"),
    ("has()", 4, "expected a label"),
    ("has(a", 5, "expected ')' to close has("),
    ("has(a b)", 6, "expected ')' to close has("),
    ("has (a)", 4, "after label 'has'"),
    ("all(", 4, "expected ')' to close all("),
    ("all(x)", 4, "expected ')' to close all("),
    ("global(x)", 7, "expected ')' to close global("),
    ("(a == 'x'", 9, "expected ')' to close the '(' at offset 0"),
    ("a == 'x')", 8, "expected '&&', '||' or the end"),
    ("a == 'x' b == 'y'", 9, "expected '&&', '||' or the end"),
    ("a == 'x' 'y'", 9, "expected '&&', '||' or the end"),
    ("a in {'x'", 9, "expected a quoted string, ',' or '}'"),
    ("a in {'x' 'y'}", 10, "expected a quoted string, ',' or '}'"),
    ("a in {,}", 6, "expected a quoted string, ',' or '}'"),
    ("a in {'x',,}", 10, "expected a quoted string, ',' or '}'"),
    ("a in 'x'", 5, "expected '{' after 'in'"),
    ("a not in ('x')", 9, "expected '{' after 'not in'"),
    ("a in {x}", 6, "expected a quoted string, ',' or '}'"),
    ("&&", 0, "expected a label, has(), all(), global(), '!' or '('"),
    ("has(a) &&", 9, "expected a label, has(), all(), global(), '!' or '(', found the end"),
    ("|| has(a)", 0, "expected a label"),
    ("!", 1, "found the end"),
    ("()", 1, "found ')'"),
    ("'x' == a", 0, "found the string"),
    ("a ~ 'b'", 2, "expected an operator"),
    ("a", 1, "after label 'a', found the end"),
    ("a b == 'c'", 2, "after label 'a'"),
    ("a && b == 'c'", 2, "after label 'a', found '&&'"),
    ("a == x", 5, "expected a quoted string after '==', found label 'x'"),
    ("a contains x", 11, "expected a quoted string after 'contains'"),
    ("a startswithx 'y'", 2, "expected an operator"),
    ("a starts 'y'", 2, "expected an operator"),
    ("a inx {'y'}", 2, "expected an operator"),
    ("a == 'x", 5, "unterminated string"),
    ('a == "x', 5, "unterminated string"),
    ("a == 'x\"", 5, "unterminated string"),
    ("a in {\"x', 'y'}", 6, "unterminated string"),
    ('a contains "x', 11, "unterminated string"),
    ("a\v== 'b'", 1, "only spaces, tabs and line breaks"),
    ("a == 'b'\u00a0", 8, "only spaces, tabs and line breaks"),
    ("a: == 'b'", 1, "expected an operator"),
    ("é == 'b'", 0, "expected a label, found 'é'"),
    ("a == 'b' && (has(c) || ", 23, "found the end"),
    ("x" * (MAX_LABEL_LENGTH + 1) + " == 'y'", 0, "label longer than 512"),
    ("has(" + "x" * (MAX_LABEL_LENGTH + 1) + ")", 4, "label longer than 512"),
    ("(" * (MAX_DEPTH + 1) + "all()" + ")" * (MAX_DEPTH + 1), MAX_DEPTH, "nested deeper"),
    ("has(a) || " * 7000 + "has(a)", MAX_SELECTOR_LENGTH, "longer than 65536"),
]


@pytest.mark.parametrize(("text", "offset", "reason"), MALFORMED)
def test_malformed(text: str, offset: int, reason: str) -> None:
    with pytest.raises(SelectorError) as caught:
        parse_selector(text)
    err = caught.value
    assert (err.offset, err.text) == (offset, text)
    assert reason in err.reason
    message = str(err)
    assert "\n" not in message
    assert len(message) < 400
    assert message.startswith(f"invalid selector at offset {offset}: {err.reason}")
    line, caret = err.caret().split("\n")
    assert caret.endswith("^")
    assert len(caret) - 1 <= len(line)


def test_caret_points_at_the_offset() -> None:
    with pytest.raises(SelectorError) as caught:
        parse_selector("rack = 'a'")
    assert caught.value.caret() == "rack = 'a'\n     ^"


def test_nesting_and_negation_are_bounded_not_recursive() -> None:
    deep = "(" * MAX_DEPTH + "has(a)" + ")" * MAX_DEPTH
    assert parse_selector(deep).matches({"a": ""})
    assert str(parse_selector(deep)) == "has(a)"
    nots = "!" * 20001 + "has(a)"
    assert parse_selector(nots).matches({})
    assert str(parse_selector(nots)) == "!has(a)"
    wide = " && ".join(f"has(k{i})" for i in range(2000))
    sel = parse_selector(wide)
    assert sel.matches({f"k{i}": "" for i in range(2000)})
    assert len(sel.keys()) == 2000


def test_global_refused_where_calico_refuses_it() -> None:
    assert parse_selector("global()").uses_global
    assert not parse_selector("global == 'x'").uses_global
    with pytest.raises(SelectorError) as caught:
        parse_selector("has(a) || !global()", allow_global=False)
    assert caught.value.offset == 11
    assert "namespaceSelector" in caught.value.reason


CANONICAL: list[tuple[str, str]] = [
    ("", "all()"),
    ("rack=='a'", 'rack == "a"'),
    ("""msg == 'say "hi"'""", """msg == 'say "hi"'"""),
    ("a in {'z','y','z',}", 'a in {"y", "z"}'),
    ("a in {}", "a in {}"),
    ("a notin {'x'}", 'a not in {"x"}'),
    ("a startswith 'x'", 'a starts with "x"'),
    ("has( a )", "has(a)"),
    ("!!has(a)", "has(a)"),
    ("(has(a) && has(b)) && has(c)", "has(a) && has(b) && has(c)"),
    ("has(a) || (has(b) || has(c))", "has(a) || has(b) || has(c)"),
    ("has(a) || has(b) && has(c)", "has(a) || has(b) && has(c)"),
    ("(has(a) || has(b)) && has(c)", "(has(a) || has(b)) && has(c)"),
    ("!(has(a) || has(b))", "!(has(a) || has(b))"),
    ("!(has(a))", "!has(a)"),
    ("!(!(has(a) && has(b)))", "has(a) && has(b)"),
    ("global( )", "global()"),
]


@pytest.mark.parametrize(("text", "canonical"), CANONICAL)
def test_canonical_text(text: str, canonical: str) -> None:
    sel = parse_selector(text)
    assert str(sel) == canonical
    assert sel == parse_selector(canonical)
    assert hash(sel) == hash(parse_selector(canonical))
    assert sel.text == text


def test_equality_is_by_canonical_text() -> None:
    assert parse_selector("a=='x'&&b in {'2','1'}") == parse_selector('a == "x" && b in {"1", "2"}')
    assert parse_selector("has(a) && has(b)") != parse_selector("has(b) && has(a)")
    assert len({parse_selector(t) for t in ("has(a)", " has(a) ", "!!has(a)", "has( a)")}) == 1
    assert parse_selector("has(a)") != "has(a)"


KEYS: list[tuple[str, set[str]]] = [
    ("", set()),
    ("all()", set()),
    ("global()", {NAMESPACE_LABEL}),
    ("has(a) && !b == 'x' || c in {} || d not in {'y'}", {"a", "b", "c", "d"}),
    ("e contains 'x' && f starts with 'y' && g ends with 'z' && h != ''", {"e", "f", "g", "h"}),
    ("k8s.io/app == 'x' && k8s.io/app != 'y'", {"k8s.io/app"}),
]


@pytest.mark.parametrize(("text", "keys"), KEYS)
def test_keys(text: str, keys: set[str]) -> None:
    assert parse_selector(text).keys() == keys


def test_tree_is_typed_and_frozen() -> None:
    sel = parse_selector("!(a == 'x' || b in {'y'}) && has(c) && global() && all()")
    assert sel.root == And(
        (
            Not(Or((Compare("a", "==", "x"), In("b", frozenset({"y"}))))),
            Has("c"),
            Global(),
            All(),
        )
    )
    with pytest.raises(AttributeError):
        sel.root.operands = ()  # type: ignore[attr-defined, misc]
    assert Selector(sel.root) == sel
    for bad in (lambda: Has("a b"), lambda: Compare("a", "=", "x"), lambda: Has("")):
        with pytest.raises(ValueError):
            bad()
    with pytest.raises(ValueError, match="both kinds of quote"):
        Compare("a", "==", "'\"")


# -- the canonical text round-trips (property) ---------------------------------------------------

_KEYS = st.sampled_from(["a", "b", "k8s.io/app", "projectcalico.org/namespace", "in", "x-1_2.z"])
_VALUES = st.text(st.characters(codec="utf-8", exclude_characters='"'), max_size=6) | st.text(
    st.characters(codec="utf-8", exclude_characters="'"), max_size=6
)


def _leaves() -> st.SearchStrategy[Node]:
    return st.one_of(
        st.just(All()),
        st.just(Global()),
        st.builds(Has, _KEYS),
        st.builds(Compare, _KEYS, st.sampled_from(Compare.OPS), _VALUES),
        st.builds(In, _KEYS, st.frozensets(_VALUES, max_size=3), st.booleans()),
    )


_TREES = st.recursive(
    _leaves(),
    lambda inner: st.one_of(
        st.builds(Not, inner),
        st.builds(And, st.tuples(inner, inner)),
        st.builds(Or, st.tuples(inner, inner, inner)),
    ),
    max_leaves=12,
)
_LABELS = st.dictionaries(_KEYS, _VALUES, max_size=4)


@settings(max_examples=400, deadline=None, database=None)
@given(_TREES, _LABELS)
def test_canonical_text_round_trips(root: Node, labels: dict[str, str]) -> None:
    sel = Selector(root)
    again = parse_selector(str(sel))
    assert again == sel
    assert str(again) == str(sel)
    assert again.root == sel.root
    assert again.matches(labels) is sel.matches(labels) is _reference(root, labels)
    assert again.keys() == sel.keys()


def _reference(node: Node, labels: dict[str, str]) -> bool:
    """The semantics written out plainly, to check the compiled predicates against."""
    match node:
        case All():
            return True
        case Global():
            return NAMESPACE_LABEL not in labels
        case Has(key):
            return key in labels
        case Compare(key, op, value):
            if key not in labels:
                return op == "!="
            got = labels[key]
            return {
                "==": got == value,
                "!=": got != value,
                "contains": value in got,
                "starts with": got.startswith(value),
                "ends with": got.endswith(value),
            }[op]
        case In(key, values, negated):
            return (key in labels and labels[key] in values) is not negated
        case Not(operand):
            return not _reference(operand, labels)
        case And(operands):
            return all(_reference(op, labels) for op in operands)
        case Or(operands):
            return any(_reference(op, labels) for op in operands)
    raise AssertionError(node)


# -- namespace and service-account scopes ---------------------------------------------------------

WEB = endpoint_labels(
    {"app": "web"},
    namespace="prod",
    namespace_labels={"team": "blue"},
    service_account="web-sa",
    service_account_labels={"role": "frontend"},
)
HOST = endpoint_labels({"role": "db"})


def test_endpoint_labels() -> None:
    assert WEB == {
        "app": "web",
        "projectcalico.org/namespace": "prod",
        "pcns.team": "blue",
        "pcns.projectcalico.org/name": "prod",
        "projectcalico.org/serviceaccount": "web-sa",
        "pcsa.role": "frontend",
        "pcsa.projectcalico.org/name": "web-sa",
    }
    assert HOST == {"role": "db"}
    spoof = endpoint_labels({"pcns.team": "red", NAMESPACE_LABEL: "x"}, namespace="prod")
    assert spoof["pcns.team"] == "red"
    assert spoof[NAMESPACE_LABEL] == "prod"
    assert (
        endpoint_labels({}, namespace="a", namespace_labels={"team": "red"})["pcns.team"] == "red"
    )


@pytest.mark.parametrize(
    ("kwargs", "text", "web", "host"),
    [
        ({"selector": "app == 'web'"}, 'app == "web"', True, False),
        ({}, "all()", True, True),
        ({"namespace": "prod"}, 'projectcalico.org/namespace == "prod"', True, False),
        ({"namespace": "dev", "selector": "app == 'web'"}, None, False, False),
        ({"namespace_selector": "all()"}, "has(projectcalico.org/namespace)", True, False),
        ({"namespace_selector": "team == 'blue'"}, 'pcns.team == "blue"', True, False),
        ({"namespace_selector": "projectcalico.org/name == 'prod'"}, None, True, False),
        ({"service_account_selector": "all()"}, None, True, False),
        (
            {"service_account_selector": "role == 'frontend'"},
            'pcsa.role == "frontend"',
            True,
            False,
        ),
        (
            {"selector": "app == 'web'", "namespace_selector": "team in {'blue'}"},
            'app == "web" && pcns.team in {"blue"}',
            True,
            False,
        ),
        # as in Calico, a negative namespaceSelector also holds for objects without a namespace
        ({"selector": "!has(app)", "namespace_selector": "!has(team)"}, None, False, True),
    ],
)
def test_policy_selector(kwargs: dict[str, str], text: str | None, web: bool, host: bool) -> None:
    sel = policy_selector(**kwargs)
    if text is not None:
        assert str(sel) == text
    assert (sel.matches(WEB), sel.matches(HOST)) == (web, host)


def test_policy_selector_refuses_global() -> None:
    with pytest.raises(SelectorError):
        policy_selector("global()")
    with pytest.raises(SelectorError):
        policy_selector(namespace_selector="global()")


@pytest.mark.parametrize(
    ("kwargs", "text", "web", "host"),
    [
        # no endpoint field: the rule names no endpoints at all (address/port match only)
        ({}, None, None, None),
        ({"policy_namespace": "prod"}, None, None, None),
        # a namespaced policy's selector stays in its namespace
        (
            {"selector": "app == 'web'", "policy_namespace": "prod"},
            'projectcalico.org/namespace == "prod" && app == "web"',
            True,
            False,
        ),
        ({"selector": "app == 'web'", "policy_namespace": "dev"}, None, False, False),
        ({"selector": "all()", "policy_namespace": "prod"}, None, True, False),
        ({"not_selector": "app == 'x'", "policy_namespace": "prod"}, None, True, False),
        # a global policy's selector spans namespaces and global objects
        ({"selector": "has(role)"}, "has(role)", False, True),
        # namespaceSelector: all() every namespace, global() none, else the namespace's labels
        (
            {"selector": "has(app)", "namespace_selector": "all()", "policy_namespace": "x"},
            "has(projectcalico.org/namespace) && has(app)",
            True,
            False,
        ),
        ({"namespace_selector": "global()"}, "global()", False, True),
        ({"namespace_selector": "global()", "selector": "role == 'db'"}, None, False, True),
        ({"namespace_selector": "!global()"}, None, True, False),
        ({"namespace_selector": "team == 'blue'"}, 'pcns.team == "blue"', True, False),
        ({"namespace_selector": "team == 'red'", "policy_namespace": "prod"}, None, False, False),
        # serviceAccounts: names and/or selector, ANDed with the selector
        (
            {"service_account_names": ["web-sa", "api-sa"], "policy_namespace": "prod"},
            'projectcalico.org/namespace == "prod"'
            ' && projectcalico.org/serviceaccount in {"api-sa", "web-sa"}',
            True,
            False,
        ),
        ({"service_account_names": ["other"]}, None, False, False),
        (
            {"service_account_selector": "role == 'frontend'", "selector": "app == 'web'"},
            'pcsa.role == "frontend" && app == "web"',
            True,
            False,
        ),
        ({"service_account_selector": "role == 'backend'"}, None, False, False),
    ],
)
def test_rule_selector(
    kwargs: dict[str, object], text: str | None, web: bool | None, host: bool | None
) -> None:
    sel = rule_selector(**kwargs)  # type: ignore[arg-type]
    if web is None:
        assert sel is None
        return
    assert sel is not None
    if text is not None:
        assert str(sel) == text
    assert (sel.matches(WEB), sel.matches(HOST)) == (web, host)


def test_rule_selector_refuses_global_outside_namespace_selector() -> None:
    for field in ("selector", "not_selector", "service_account_selector"):
        with pytest.raises(SelectorError):
            rule_selector(**{field: "global()"})  # type: ignore[arg-type]
