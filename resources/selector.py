"""Calico's label-selector expressions (IPPool/BGPPeer ``nodeSelector``, ``peerSelector``).

Standard library only. Grammar (``&&`` binds tighter than ``||``)::

    expr   := term ("||" term)*
    term   := factor ("&&" factor)*
    factor := "!" factor | "(" expr ")" | "all()" | "has(" KEY ")"
            | KEY ("==" | "!=") STRING
            | KEY ["not"] "in" "{" [STRING ("," STRING)*] "}"
            | KEY ("contains" | "starts with" | "ends with") STRING

Strings are single- or double-quoted. An empty selector selects everything. A comparison
with a label the object lacks is false, except ``!=`` and ``not in`` (true).

>>> parse_selector("rack == 'a' && !has(edge)").matches({"rack": "a"})
True
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping

Labels = Mapping[str, str]
_Pred = Callable[[Labels], bool]

_TOKEN = re.compile(
    r"""\s*(?:
        (?P<str>"[^"]*"|'[^']*')
      | (?P<op>&&|\|\||==|!=|!|\(|\)|\{|\}|,)
      | (?P<word>[A-Za-z0-9_./-]+)
    )""",
    re.VERBOSE,
)


#: The deepest nesting of ``!`` and parentheses a selector may have: deeper ones are
#: refused (SelectorError) instead of exhausting the parser's and the matcher's stack.
MAX_DEPTH = 64


class SelectorError(ValueError):
    """A selector that does not parse; ``str()`` says where and why."""


class Selector:
    """A parsed selector: ``matches(labels)``; ``str()`` is the text it was parsed from."""

    __slots__ = ("_pred", "text")

    def __init__(self, text: str, pred: _Pred) -> None:
        self.text = text
        self._pred = pred

    def matches(self, labels: Labels) -> bool:
        return self._pred(labels)

    def __str__(self) -> str:
        return self.text


def parse_selector(text: str) -> Selector:
    """Parse ``text`` (raises ``SelectorError``)."""
    tokens = _tokenize(text)
    if not tokens:
        return Selector(text, lambda labels: True)
    parser = _Parser(text, tokens)
    pred = parser.expr()
    if parser.pos != len(tokens):
        raise parser.error("unexpected " + repr(tokens[parser.pos][1]))
    return Selector(text, pred)


def _tokenize(text: str) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    pos = 0
    while pos < len(text):
        if text[pos:].strip() == "":
            break
        m = _TOKEN.match(text, pos)
        if m is None or m.end() == pos:
            raise SelectorError(f"unexpected character at offset {pos}: {text[pos : pos + 10]!r}")
        kind = m.lastgroup or ""
        out.append((kind, m.group(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str, tokens: list[tuple[str, str]]) -> None:
        self.text = text
        self.tokens = tokens
        self.pos = 0
        self.depth = 0

    def error(self, why: str) -> SelectorError:
        return SelectorError(f"invalid selector {self.text!r}: {why}")

    def peek(self, offset: int = 0) -> tuple[str, str]:
        i = self.pos + offset
        return self.tokens[i] if i < len(self.tokens) else ("end", "")

    def take(self, kind: str, value: str | None = None) -> str:
        k, v = self.peek()
        if k != kind or (value is not None and v != value):
            wanted = (
                repr(value) if value is not None else {"str": "a quoted string"}.get(kind, kind)
            )
            found = repr(v) if k != "end" else "the end"
            raise self.error(f"expected {wanted}, found {found}")
        self.pos += 1
        return v

    def expr(self) -> _Pred:
        terms = [self.term()]
        while self.peek() == ("op", "||"):
            self.pos += 1
            terms.append(self.term())
        return terms[0] if len(terms) == 1 else (lambda lb: any(t(lb) for t in terms))

    def term(self) -> _Pred:
        factors = [self.factor()]
        while self.peek() == ("op", "&&"):
            self.pos += 1
            factors.append(self.factor())
        return factors[0] if len(factors) == 1 else (lambda lb: all(f(lb) for f in factors))

    def factor(self) -> _Pred:
        kind, value = self.peek()
        if (kind, value) in (("op", "!"), ("op", "(")):
            self.depth += 1
            if self.depth > MAX_DEPTH:
                raise self.error(f"nested deeper than {MAX_DEPTH} levels")
            self.pos += 1
            if value == "!":
                negated = self.factor()
                self.depth -= 1
                return lambda lb: not negated(lb)
            inner = self.expr()
            self.take("op", ")")
            self.depth -= 1
            return inner
        if kind != "word":
            raise self.error(f"expected a label, all() or has(), found {value or 'the end'!r}")
        self.pos += 1
        if value in ("all", "has") and self.peek() == ("op", "("):
            self.pos += 1
            if value == "all":
                self.take("op", ")")
                return lambda lb: True
            key = self.take("word")
            self.take("op", ")")
            return lambda lb: key in lb
        return self.comparison(value)

    def comparison(self, key: str) -> _Pred:
        kind, op = self.peek()
        if (kind, op) in (("op", "=="), ("op", "!=")):
            self.pos += 1
            want = self.string()
            if op == "==":
                return lambda lb: lb.get(key) == want
            return lambda lb: lb.get(key) != want
        if (kind, op) == ("word", "not"):
            self.pos += 1
            self.take("word", "in")
            values = self.string_set()
            return lambda lb: lb.get(key) not in values
        if (kind, op) == ("word", "in"):
            self.pos += 1
            values = self.string_set()
            return lambda lb: lb.get(key) in values
        if (kind, op) == ("word", "contains"):
            self.pos += 1
            part = self.string()
            return lambda lb: key in lb and part in lb[key]
        if kind == "word" and op in ("starts", "ends"):
            self.pos += 1
            self.take("word", "with")
            part = self.string()
            if op == "starts":
                return lambda lb: key in lb and lb[key].startswith(part)
            return lambda lb: key in lb and lb[key].endswith(part)
        found = repr(op) if kind != "end" else "the end"
        raise self.error(f"expected an operator after {key!r}, found {found}")

    def string(self) -> str:
        return self.take("str")[1:-1]

    def string_set(self) -> frozenset[str]:
        self.take("op", "{")
        values: set[str] = set()
        if self.peek() != ("op", "}"):
            values.add(self.string())
            while self.peek() == ("op", ","):
                self.pos += 1
                values.add(self.string())
        self.take("op", "}")
        return frozenset(values)
