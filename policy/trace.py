"""What a traced packet's events say about tabby's policy table: per base chain the packet
passed (``fwd-egress`` and ``input``: the sending pod's egress; ``fwd-ingress``: the
receiving pod's ingress), the chain and rule (``nft -a`` handle, rule text, comment) that
accepted or dropped it, and the chains on the way. A base chain the packet left at once
(not a pod's interface) decides nothing. A drop in another table is reported as such.

The trace itself (arming it, reading the events and the table's rules back) is the
kernel's: :mod:`dataplane.nfttrace`. Pure: no I/O.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping, Sequence

from dataplane.nfnetlink import TraceEvent
from dataplane.nfttrace import Rule
from policy.render import BASE_CHAINS, DEFAULT_TABLE, HOST_BASE_CHAINS

#: base chain -> what it decides: a pod's direction, or ``host`` (a host endpoint's stage)
_BASES: Mapping[str, str] = {**BASE_CHAINS, **dict.fromkeys(HOST_BASE_CHAINS, "host")}


@dataclasses.dataclass(frozen=True)
class Decision:
    """What one base chain of tabby's table did with the packet: ``verdict`` ``accept`` or
    ``drop`` by ``rule`` in ``chain`` (its comment says whose rule), after the chains in
    ``path``; or ``none`` (the base chain let it pass at once: not a pod's interface in
    this direction, or its policy)."""

    base: str
    direction: str
    verdict: str
    chain: str
    rule: Rule | None
    path: tuple[str, ...]

    @property
    def decided(self) -> bool:
        return self.verdict in ("accept", "drop")

    def to_json(self) -> dict[str, object]:
        return {
            "base_chain": self.base,
            "direction": self.direction,
            "verdict": self.verdict,
            "chain": self.chain,
            "handle": self.rule.handle if self.rule else None,
            "rule": self.rule.text if self.rule else None,
            "comment": self.rule.comment if self.rule else None,
            "path": list(self.path),
        }


@dataclasses.dataclass(frozen=True)
class Foreign:
    """A drop in a table that is not tabby's."""

    table: str
    chain: str
    handle: int | None


def _fits(rule: Rule, verdict: str, target: str | None) -> bool:
    """Could this rule have given this verdict? (a listing from before a renumbering may
    hold another rule under the same handle)"""
    words = rule.text.split()
    if verdict in ("jump", "goto"):
        return "vmap" in words or (verdict in words and target in words)
    return verdict in words


def _rule(
    listings: Sequence[Mapping[tuple[str, int], Rule]],
    chain: str,
    handle: int | None,
    verdict: str,
    target: str | None,
) -> Rule | None:
    if handle is None:
        return None
    found = [r for rules in listings if (r := rules.get((chain, handle))) is not None]
    fitting = [r for r in found if _fits(r, verdict, target)]
    pick = fitting or found
    return pick[0] if pick else None


def decisions(
    events: Iterable[TraceEvent],
    rules: Mapping[tuple[str, int], Rule] | Sequence[Mapping[tuple[str, int], Rule]],
    table: str = DEFAULT_TABLE,
) -> tuple[list[Decision], list[Foreign]]:
    """Per pass through one of ``table``'s base chains, in order: what it decided; and the
    drops of other tables. ``rules``: a listing (:func:`table_rules`), or several, the
    first that has a rule fitting an event's verdict under its handle wins."""
    listings = [rules] if isinstance(rules, Mapping) else list(rules)
    out: list[Decision] = []
    foreign: list[Foreign] = []
    base: str | None = None
    path: list[str] = []
    last: TraceEvent | None = None

    def finish(verdict: str, chain: str, handle: int | None) -> None:
        nonlocal base
        assert base is not None
        target = last.target if last is not None else None
        rule = _rule(listings, chain, handle, verdict, target)
        out.append(Decision(base, _BASES[base], verdict, chain, rule, tuple(path)))
        base = None

    for e in events:
        if e.table != table:
            if e.verdict == "drop":
                foreign.append(Foreign(e.table, e.chain, e.handle))
            continue
        if e.chain in _BASES and base is None:
            base, path = e.chain, [e.chain]
        if base is None:
            continue  # a chain entered before the listener saw its base chain
        if e.chain not in path:
            path.append(e.chain)
        last = e
        if e.verdict in ("accept", "drop") and e.type == "rule":
            finish(e.verdict, e.chain, e.handle)
        elif e.type == "policy":  # the end of the base chain (after a return rule too)
            finish("none", e.chain, None)
    return out, foreign


def verdict_of(ds: Sequence[Decision], direction: str) -> Decision | None:
    """The decision of ``direction``: the first pass that decided (a pod's chain), else
    the first pass."""
    chosen = [d for d in ds if d.direction == direction]
    decided = [d for d in chosen if d.decided]
    pick = decided or chosen
    return pick[0] if pick else None


__all__ = ["Decision", "Foreign", "decisions", "verdict_of"]
