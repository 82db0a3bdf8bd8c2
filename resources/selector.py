"""Calico's label-selector language: one implementation for pools, peers and policy.

Standard library only. The grammar and its semantics are documented once, in
``docs/selectors.md``; in short (``!`` binds tighter than ``&&``, which binds tighter than
``||``)::

    selector := "" | or
    or       := and ("||" and)*
    and      := unary ("&&" unary)*
    unary    := "!"* (primary)
    primary  := "(" or ")" | "all()" | "global()" | "has(" LABEL ")"
              | LABEL ("==" | "!=" | "contains" | "starts with" | "ends with") STRING
              | LABEL ("in" | "not in") "{" [STRING ("," STRING)* [","]] "}"

``parse_selector(text)`` gives a :class:`Selector`: a typed tree of frozen nodes with
``matches(labels)``, ``keys()`` (the label keys it reads) and a canonical ``str()`` (equal
selectors have equal text, and the text parses back to the same selector); equality and hash
are by that text. A selector that does not parse raises :class:`SelectorError` naming the
offset and what was expected.

The object a selector is evaluated against is a plain ``Mapping[str, str]`` of labels.
Namespaced objects carry ``projectcalico.org/namespace`` (:data:`NAMESPACE_LABEL`), as in
Calico; ``global()`` is true exactly when that label is absent. :func:`endpoint_labels`
builds the combined labels of an endpoint (its own, its namespace's under ``pcns.``, its
service account's under ``pcsa.``), and :func:`policy_selector` / :func:`rule_selector` fold a
policy's or a rule's ``namespaceSelector`` and ``serviceAccountSelector`` into one selector
over those labels, as Calico's datastore conversion does.

>>> parse_selector("rack == 'a' && !has(edge)").matches({"rack": "a"})
True
>>> str(parse_selector("!(a=='x'||b in {'z','y'})&&c"[:-3]))
'!(a == "x" || b in {"y", "z"})'
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import ClassVar, NoReturn, TypeAlias

# Calico's label scheme, defined in bundle (the engine builds endpoints' labels with it too),
# and part of this module's interface: re-exported explicitly.
from bundle.calico import NAME_LABEL as NAME_LABEL
from bundle.calico import NAMESPACE_LABEL as NAMESPACE_LABEL
from bundle.calico import NAMESPACE_PREFIX as NAMESPACE_PREFIX
from bundle.calico import SERVICE_ACCOUNT_LABEL as SERVICE_ACCOUNT_LABEL
from bundle.calico import SERVICE_ACCOUNT_PREFIX as SERVICE_ACCOUNT_PREFIX
from bundle.calico import endpoint_labels as endpoint_labels

Labels: TypeAlias = Mapping[str, str]
Predicate: TypeAlias = Callable[[Labels], bool]

#: Longest label key (Calico's limit).
MAX_LABEL_LENGTH = 512
#: Longest selector text accepted; longer ones are refused, not parsed.
MAX_SELECTOR_LENGTH = 65536
#: Deepest nesting of parentheses accepted.
MAX_DEPTH = 64

_LABEL_CHARS = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_./-")
#: what separates tokens: Calico takes spaces and tabs; line breaks are taken too (a YAML
#: block scalar ends its selector with one, and their meaning is plain)
_BLANK = " \t\r\n"


class SelectorError(ValueError):
    """A selector that does not parse: ``offset`` (0-based, into ``text``) and ``reason``.

    ``str()`` is one line naming both; :meth:`caret` shows the place under the text.
    """

    def __init__(self, text: str, offset: int, reason: str) -> None:
        self.text = text
        self.offset = offset
        self.reason = reason
        super().__init__(f"invalid selector at offset {offset}: {reason}: {_excerpt(text, offset)}")

    def caret(self) -> str:
        """Two lines: the text (or the part around the error) and a ``^`` under the offset."""
        start = max(0, self.offset - 40)
        line = self.text[start : self.offset + 40]
        shown = line.replace("\t", " ").replace("\n", " ").replace("\r", " ")
        return f"{shown}\n{' ' * (self.offset - start)}^"


def _excerpt(text: str, offset: int) -> str:
    if len(text) <= 80:
        return repr(text)
    start = max(0, offset - 30)
    return ("..." if start else "") + repr(text[start : offset + 30]) + "..."


# -- the tree ------------------------------------------------------------------------------------


def _quote(value: str) -> str:
    # Calico has no escapes: a string is quoted with the quote it does not contain.
    return f"'{value}'" if '"' in value else f'"{value}"'


def _check_label(key: str) -> None:
    if not key or len(key) > MAX_LABEL_LENGTH or not _LABEL_CHARS.issuperset(key):
        raise ValueError(f"not a selector label: {key!r}")


def _check_value(value: str) -> None:
    if '"' in value and "'" in value:
        raise ValueError(f"a selector string cannot hold both kinds of quote: {value!r}")


class Node:
    """A selector's tree node. Subclasses are frozen dataclasses."""

    __slots__ = ()
    #: How tightly the node's text binds (for parentheses): 3 leaf / ``!``, 2 ``&&``, 1 ``||``.
    strength: ClassVar[int] = 3

    def compile(self) -> Predicate:
        """A function of the labels: true where the node matches."""
        raise NotImplementedError

    def keys(self) -> frozenset[str]:
        """The label keys the node reads."""
        return frozenset()

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        """The node with ``prefix`` before every key; ``all()`` becomes ``all_means`` if given."""
        return self


@dataclass(frozen=True, slots=True)
class All(Node):
    """``all()``: everything."""

    def __str__(self) -> str:
        return "all()"

    def compile(self) -> Predicate:
        return _true

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        return all_means or self


@dataclass(frozen=True, slots=True)
class Global(Node):
    """``global()``: objects outside every namespace (no ``projectcalico.org/namespace``)."""

    def __str__(self) -> str:
        return "global()"

    def compile(self) -> Predicate:
        return lambda labels: NAMESPACE_LABEL not in labels

    def keys(self) -> frozenset[str]:
        return frozenset((NAMESPACE_LABEL,))


def _true(labels: Labels) -> bool:
    return True


@dataclass(frozen=True, slots=True)
class Has(Node):
    """``has(key)``: the label is present (any value, also empty)."""

    key: str

    def __post_init__(self) -> None:
        _check_label(self.key)

    def __str__(self) -> str:
        return f"has({self.key})"

    def compile(self) -> Predicate:
        key = self.key
        return lambda labels: key in labels

    def keys(self) -> frozenset[str]:
        return frozenset((self.key,))

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        return Has(prefix + self.key)


@dataclass(frozen=True, slots=True)
class Compare(Node):
    """``key <op> "value"``; an absent label matches only ``!=``."""

    key: str
    op: str
    value: str

    OPS: ClassVar[tuple[str, ...]] = ("==", "!=", "contains", "starts with", "ends with")

    def __post_init__(self) -> None:
        _check_label(self.key)
        _check_value(self.value)
        if self.op not in self.OPS:
            raise ValueError(f"not a selector comparison: {self.op!r}")

    def __str__(self) -> str:
        return f"{self.key} {self.op} {_quote(self.value)}"

    def compile(self) -> Predicate:
        key, value, op = self.key, self.value, self.op
        if op == "==":
            return lambda labels: labels.get(key) == value
        if op == "!=":
            return lambda labels: labels.get(key) != value
        if op == "contains":
            return lambda labels: (got := labels.get(key)) is not None and value in got
        if op == "starts with":
            return lambda labels: (got := labels.get(key)) is not None and got.startswith(value)
        return lambda labels: (got := labels.get(key)) is not None and got.endswith(value)

    def keys(self) -> frozenset[str]:
        return frozenset((self.key,))

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        return Compare(prefix + self.key, self.op, self.value)


@dataclass(frozen=True, slots=True)
class In(Node):
    """``key in {...}`` / ``key not in {...}`` (``negated``); an absent label is not in any set."""

    key: str
    values: frozenset[str]
    negated: bool = False

    def __post_init__(self) -> None:
        _check_label(self.key)
        for value in self.values:
            _check_value(value)

    def __str__(self) -> str:
        values = ", ".join(_quote(v) for v in sorted(self.values))
        return f"{self.key} {'not in' if self.negated else 'in'} {{{values}}}"

    def compile(self) -> Predicate:
        key, values = self.key, self.values
        if self.negated:
            return lambda labels: labels.get(key) not in values
        return lambda labels: labels.get(key) in values

    def keys(self) -> frozenset[str]:
        return frozenset((self.key,))

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        return In(prefix + self.key, self.values, self.negated)


@dataclass(frozen=True, slots=True)
class Not(Node):
    """``!operand``."""

    operand: Node

    def __str__(self) -> str:
        inner = str(self.operand)
        return f"!({inner})" if self.operand.strength < 3 else f"!{inner}"

    def compile(self) -> Predicate:
        inner = self.operand.compile()
        return lambda labels: not inner(labels)

    def keys(self) -> frozenset[str]:
        return self.operand.keys()

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        return Not(self.operand.relabel(prefix, all_means))


@dataclass(frozen=True, slots=True)
class _Chain(Node):
    """Two or more operands joined by one operator, none of them a chain of the same kind."""

    operands: tuple[Node, ...]
    JOIN: ClassVar[str] = ""
    #: True for ``&&`` (stop at the first false operand), False for ``||`` (at the first true).
    CONJUNCTIVE: ClassVar[bool] = True

    def __str__(self) -> str:
        return self.JOIN.join(
            f"({op})" if op.strength < self.strength else str(op) for op in self.operands
        )

    def compile(self) -> Predicate:
        preds = tuple(op.compile() for op in self.operands)
        if len(preds) > _FOLD:
            if self.CONJUNCTIVE:
                return lambda labels: all(pred(labels) for pred in preds)
            return lambda labels: any(pred(labels) for pred in preds)
        return functools.reduce(_both if self.CONJUNCTIVE else _either, reversed(preds))

    def keys(self) -> frozenset[str]:
        return frozenset().union(*(op.keys() for op in self.operands))

    def relabel(self, prefix: str, all_means: Node | None) -> Node:
        return type(self)(tuple(op.relabel(prefix, all_means) for op in self.operands))


# Up to this many operands a chain compiles to nested closures (``a and (b and c)``), the
# fastest Python has; longer chains loop, so evaluation never recurses deeply.
_FOLD = 8


def _both(rest: Predicate, first: Predicate) -> Predicate:
    return lambda labels: first(labels) and rest(labels)


def _either(rest: Predicate, first: Predicate) -> Predicate:
    return lambda labels: first(labels) or rest(labels)


@dataclass(frozen=True, slots=True)
class And(_Chain):
    """``a && b && ...``: every operand holds."""

    strength: ClassVar[int] = 2
    JOIN: ClassVar[str] = " && "


@dataclass(frozen=True, slots=True)
class Or(_Chain):
    """``a || b || ...``: some operand holds."""

    strength: ClassVar[int] = 1
    JOIN: ClassVar[str] = " || "
    CONJUNCTIVE: ClassVar[bool] = False


def _normal(node: Node) -> Node:
    """The canonical tree: ``&&``/``||`` chains flattened, ``!!x`` is ``x``."""
    if isinstance(node, Not):
        inner = _normal(node.operand)
        return inner.operand if isinstance(inner, Not) else Not(inner)
    if isinstance(node, _Chain):
        kind = type(node)
        flat: list[Node] = []
        for op in node.operands:
            op = _normal(op)
            flat.extend(op.operands if isinstance(op, kind) else (op,))
        return flat[0] if len(flat) == 1 else kind(tuple(flat))
    return node


def conjunction(nodes: Iterable[Node]) -> Node:
    """``a && b && ...`` of ``nodes`` (``all()`` for none)."""
    found = tuple(nodes)
    return All() if not found else _normal(And(found)) if len(found) > 1 else _normal(found[0])


# -- the selector ---------------------------------------------------------------------------------


class Selector:
    """A parsed selector: ``matches(labels)``, ``keys()``, canonical ``str()``.

    Equal (and hashed) by canonical text. ``text`` is the text it was parsed from (the
    canonical text for one built from a tree).
    """

    __slots__ = ("_keys", "_str", "matches", "root", "text")

    root: Node
    text: str
    matches: Predicate

    def __init__(self, root: Node, text: str | None = None) -> None:
        root = _normal(root)
        self.root = root
        self._str = str(root)
        self.text = self._str if text is None else text
        self.matches = root.compile()
        self._keys: frozenset[str] | None = None

    def keys(self) -> frozenset[str]:
        """The label keys the selector reads (``global()``: ``projectcalico.org/namespace``)."""
        if self._keys is None:
            self._keys = self.root.keys()
        return self._keys

    @property
    def uses_global(self) -> bool:
        """Whether ``global()`` occurs (Calico allows it only in a rule's namespaceSelector)."""
        return _has_global(self.root)

    def __str__(self) -> str:
        return self._str

    def __repr__(self) -> str:
        return f"Selector({self._str!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Selector) and other._str == self._str

    def __hash__(self) -> int:
        return hash(self._str)


def _has_global(node: Node) -> bool:
    if isinstance(node, Global):
        return True
    if isinstance(node, Not):
        return _has_global(node.operand)
    if isinstance(node, _Chain):
        return any(_has_global(op) for op in node.operands)
    return False


EVERYTHING = Selector(All())


def parse_selector(text: str, *, allow_global: bool = True) -> Selector:
    """Parse ``text`` (raises ``SelectorError``); the empty selector is ``all()``.

    ``allow_global=False`` refuses ``global()``, which Calico accepts only in a rule's
    ``namespaceSelector`` (never in a pool's or a peer's selector).
    """
    if len(text) <= _CACHED_LENGTH:
        return _parse_cached(text, allow_global)
    return _parse(text, allow_global)


_CACHED_LENGTH = 1024


@functools.lru_cache(maxsize=4096)
def _parse_cached(text: str, allow_global: bool) -> Selector:
    return _parse(text, allow_global)


def _parse(text: str, allow_global: bool) -> Selector:
    if len(text) > MAX_SELECTOR_LENGTH:
        raise SelectorError(
            text, MAX_SELECTOR_LENGTH, f"longer than {MAX_SELECTOR_LENGTH} characters"
        )
    parser = _Parser(text, allow_global)
    if parser.peek()[0] == "end":
        return Selector(All(), text)
    root = parser.disjunction(0)
    kind, _, offset = parser.peek()
    if kind != "end":
        parser.fail(offset, "expected '&&', '||' or the end of the selector")
    return Selector(root, text)


# -- tokens and parsing --------------------------------------------------------------------------

# A token: (kind, value, offset). Kinds: "label", "str", "op" (the value is the operator),
# "has" (the value is the label), "all", "global", "end".
_Token = tuple[str, str, int]

_AFTER_LABEL = (("contains",), ("starts", "with"), ("ends", "with"), ("not", "in"), ("in",))
_PUNCT = frozenset("(){},")
_OPERATORS = (*Compare.OPS, "in", "not in")


def _no_operator(key: str, found: str) -> str:
    return f"expected an operator ({', '.join(_OPERATORS)}) after label {key!r}, found {found}"


class _Parser:
    """Calico's tokenizer and recursive-descent parser, with every position kept."""

    def __init__(self, text: str, allow_global: bool) -> None:
        self.text = text
        self.allow_global = allow_global
        self.tokens = self._tokenize()
        self.pos = 0

    def fail(self, offset: int, reason: str) -> NoReturn:
        raise SelectorError(self.text, offset, reason)

    # tokens

    def _skip(self, i: int) -> int:
        text = self.text
        while i < len(text) and text[i] in _BLANK:
            i += 1
        return i

    def _label(self, i: int) -> tuple[str, int]:
        text, start = self.text, i
        while i < len(text) and text[i] in _LABEL_CHARS:
            i += 1
        if i == start:
            self.fail(i, f"expected a label, found {self._char(i)}")
        if i - start > MAX_LABEL_LENGTH:
            self.fail(start, f"label longer than {MAX_LABEL_LENGTH} characters")
        return text[start:i], i

    def _char(self, i: int) -> str:
        if i >= len(self.text):
            return "the end"
        c = self.text[i]
        return repr(c) + (
            " (only spaces, tabs and line breaks separate tokens)" if c.isspace() else ""
        )

    def _word_op(self, i: int) -> tuple[str, int] | None:
        """The operator word(s) after a label (``starts with`` also spelt ``startswith``)."""
        text = self.text
        for words in _AFTER_LABEL:
            j = i
            for n, word in enumerate(words):
                if not text.startswith(word, j):
                    break
                j = self._skip(j + len(word)) if n < len(words) - 1 else j + len(word)
            else:
                if j >= len(text) or text[j] not in _LABEL_CHARS:
                    return " ".join(words), j
        return None

    def _call(self, i: int, name: str) -> int:
        """After ``all(`` / ``global(``: the closing parenthesis."""
        j = self._skip(i)
        if not self.text.startswith(")", j):
            self.fail(j, f"expected ')' to close {name}(")
        return j + 1

    def _tokenize(self) -> list[_Token]:
        text = self.text
        out: list[_Token] = []
        i = self._skip(0)
        while i < len(text):
            c = text[i]
            start = i
            if c in _PUNCT:
                out.append(("op", c, i))
                i += 1
            elif c in "\"'":
                end = text.find(c, i + 1)
                if end < 0:
                    self.fail(i, f"unterminated string (no closing {c})")
                out.append(("str", text[i + 1 : end], i))
                i = end + 1
            elif c in "=&|":
                pair = c + c
                if not text.startswith(pair, i):
                    self.fail(i, f"expected {pair!r}")
                out.append(("op", pair, i))
                i += 2
            elif c == "!":
                op = "!=" if text.startswith("!=", i) else "!"
                out.append(("op", op, i))
                i += len(op)
            elif out and out[-1][0] == "label":
                found = self._word_op(i)
                if found is None:
                    self.fail(i, _no_operator(out[-1][1], self._char(i)))
                op, i = found
                out.append(("op", op, start))
            elif text.startswith("has(", i):
                key, i = self._label(self._skip(i + 4))
                i = self._skip(i)
                if not text.startswith(")", i):
                    self.fail(i, "expected ')' to close has(")
                out.append(("has", key, start))
                i += 1
            elif text.startswith("all(", i):
                i = self._call(i + 4, "all")
                out.append(("all", "all()", start))
            elif text.startswith("global(", i):
                if not self.allow_global:
                    self.fail(i, "global() is valid only in a rule's namespaceSelector")
                i = self._call(i + 7, "global")
                out.append(("global", "global()", start))
            else:
                key, i = self._label(i)
                out.append(("label", key, start))
            i = self._skip(i)
        out.append(("end", "", len(text)))
        return out

    # grammar

    def peek(self) -> _Token:
        return self.tokens[self.pos]

    def take(self) -> _Token:
        token = self.tokens[self.pos]
        if token[0] != "end":
            self.pos += 1
        return token

    def expect(self, kind: str, value: str, what: str) -> _Token:
        token = self.take()
        if token[0] != kind or token[1] != value:
            self.fail(token[2], f"expected {what}, found {_describe(token)}")
        return token

    def disjunction(self, depth: int) -> Node:
        ops = [self.conjunction(depth)]
        while self.peek()[:2] == ("op", "||"):
            self.pos += 1
            ops.append(self.conjunction(depth))
        return ops[0] if len(ops) == 1 else Or(tuple(ops))

    def conjunction(self, depth: int) -> Node:
        ops = [self.unary(depth)]
        while self.peek()[:2] == ("op", "&&"):
            self.pos += 1
            ops.append(self.unary(depth))
        return ops[0] if len(ops) == 1 else And(tuple(ops))

    def unary(self, depth: int) -> Node:
        negated = False
        while self.peek()[:2] == ("op", "!"):
            self.pos += 1
            negated = not negated
        node = self.primary(depth)
        return Not(node) if negated else node

    def primary(self, depth: int) -> Node:
        kind, value, offset = self.take()
        if kind == "has":
            return Has(value)
        if kind == "all":
            return All()
        if kind == "global":
            return Global()
        if (kind, value) == ("op", "("):
            if depth >= MAX_DEPTH:
                self.fail(offset, f"parentheses nested deeper than {MAX_DEPTH}")
            node = self.disjunction(depth + 1)
            self.expect("op", ")", f"')' to close the '(' at offset {offset}")
            return node
        if kind == "label":
            return self.operation(value)
        found = _describe((kind, value, offset))
        self.fail(offset, f"expected a label, has(), all(), global(), '!' or '(', found {found}")

    def operation(self, key: str) -> Node:
        kind, op, offset = self.take()
        if kind != "op" or op not in _OPERATORS:
            self.fail(offset, _no_operator(key, _describe((kind, op, offset))))
        if op in ("in", "not in"):
            return In(key, self.string_set(op), op == "not in")
        return Compare(key, op, self.string(f"a quoted string after {op!r}"))

    def string(self, what: str) -> str:
        kind, value, offset = self.take()
        if kind != "str":
            self.fail(offset, f"expected {what}, found {_describe((kind, value, offset))}")
        return value

    def string_set(self, op: str) -> frozenset[str]:
        self.expect("op", "{", f"'{{' after {op!r}")
        values: list[str] = []
        while self.peek()[0] == "str":
            values.append(self.take()[1])
            if self.peek()[:2] != ("op", ","):
                break
            self.pos += 1
        self.expect("op", "}", "a quoted string, ',' or '}' in the set")
        return frozenset(values)


def _describe(token: _Token) -> str:
    kind, value, _ = token
    if kind == "end":
        return "the end"
    if kind == "str":
        return f"the string {_quote(value)}"
    if kind == "has":
        return f"has({value})"
    if kind == "label":
        return f"label {value!r}"
    return repr(value)


# -- Calico's namespace and service-account scopes -----------------------------------------------


def _given(text: str | None, allow_global: bool = False) -> Node | None:
    return parse_selector(text, allow_global=allow_global).root if text else None


def _scoped(text: str | None, prefix: str, every: str, allow_global: bool = False) -> Node | None:
    """A namespace or service-account selector over an endpoint's combined labels: keys under
    ``prefix``; ``all()`` is "has a namespace / an account" (``every``); ``global()`` keeps its
    meaning, no namespace."""
    node = _given(text, allow_global)
    return None if node is None else node.relabel(prefix, Has(every))


def policy_selector(
    selector: str | None = None,
    *,
    namespace: str | None = None,
    namespace_selector: str | None = None,
    service_account_selector: str | None = None,
) -> Selector:
    """The endpoints a policy applies to, over :func:`endpoint_labels`.

    ``namespace``: a (namespaced) NetworkPolicy's own namespace, which limits it to that
    namespace; ``namespace_selector`` (GlobalNetworkPolicy) the namespaces whose endpoints it
    applies to (``all()``: every namespaced endpoint); ``service_account_selector`` the
    accounts (``all()``: every endpoint with one). All given parts must hold.
    """
    parts: list[Node | None] = [_given(selector)]
    if namespace is not None:
        parts.append(Compare(NAMESPACE_LABEL, "==", namespace))
    parts.append(_scoped(namespace_selector, NAMESPACE_PREFIX, NAMESPACE_LABEL))
    parts.append(_scoped(service_account_selector, SERVICE_ACCOUNT_PREFIX, SERVICE_ACCOUNT_LABEL))
    return Selector(conjunction(p for p in parts if p is not None))


def rule_selector(
    selector: str | None = None,
    *,
    not_selector: str | None = None,
    namespace_selector: str | None = None,
    service_account_selector: str | None = None,
    service_account_names: Iterable[str] = (),
    policy_namespace: str | None = None,
) -> Selector | None:
    """The endpoints a rule's ``source`` or ``destination`` names, over :func:`endpoint_labels`;
    ``None`` where it names none (the rule then matches by addresses and ports alone).

    Calico's rules: ``namespaceSelector`` picks namespaces (``all()``: every namespaced
    endpoint, ``global()``: only global objects, host endpoints and global network sets);
    without one, a namespaced policy's rule stays in ``policy_namespace`` as soon as it names
    endpoints at all (``selector``, ``notSelector``, ``namespaceSelector`` or service accounts).
    ``serviceAccounts`` (``service_account_selector`` and/or ``service_account_names``) AND the
    selector. ``not_selector`` is not folded in (it is the rule's separate negative match) but
    still scopes the rule to its namespace; parse it with :func:`parse_selector`.
    """
    _given(not_selector)
    names = frozenset(service_account_names)
    endpoint: list[Node] = []
    account = _scoped(service_account_selector, SERVICE_ACCOUNT_PREFIX, SERVICE_ACCOUNT_LABEL)
    if account is not None:
        endpoint.append(account)
    if names:
        endpoint.append(In(SERVICE_ACCOUNT_LABEL, names))
    own = _given(selector)
    if own is not None:
        endpoint.append(own)
    scope = _scoped(namespace_selector, NAMESPACE_PREFIX, NAMESPACE_LABEL, allow_global=True)
    if scope is None and policy_namespace is not None:
        scope = Compare(NAMESPACE_LABEL, "==", policy_namespace)
    if scope is not None and (endpoint or not_selector or namespace_selector):
        endpoint.insert(0, scope)
    return Selector(conjunction(endpoint)) if endpoint else None
