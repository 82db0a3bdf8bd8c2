"""A model of one nftables table for unit tests: an ``NftBackend`` that keeps the ruleset.

It understands the flat commands :class:`policy.render.Renderer` writes (``add``/``delete``
``table``, ``add``/``delete set``, ``add map``, ``add``/``delete element``, ``add``/``flush``/
``delete chain``, ``add rule``, ``add``/``delete`` named ``counter`` and ``limit``) and is as
strict as the kernel where the kernel refuses: elements of a missing set, deleting an
element that is not there, a rule in a missing chain or naming a missing set, jump target,
counter or limit, deleting a chain that still has rules or is jumped to, deleting a set or
a named object a rule still uses. Stricter than the kernel in one way: adding an element
that is already there is counted (``redundant``), as a delta that re-adds what exists is not
the exact difference. A transaction applies whole or not at all (:class:`NftError`).

:meth:`NftModel.canonical` is the table independent of the order it was built in, for
comparing an incrementally updated table with a freshly replaced one.
"""

from __future__ import annotations

import copy
import dataclasses
import re

from dataplane.nft import NftError


@dataclasses.dataclass
class _Table:
    sets: dict[str, tuple[str, set[str]]] = dataclasses.field(default_factory=dict)
    maps: dict[str, tuple[str, dict[str, str]]] = dataclasses.field(default_factory=dict)
    chains: dict[str, tuple[str, list[str]]] = dataclasses.field(default_factory=dict)
    #: named stateful objects: ("counter" | "limit", name) -> declaration
    objects: dict[tuple[str, str], str] = dataclasses.field(default_factory=dict)


_CMD = re.compile(
    r"^(add|delete|flush) (table|set|map|element|chain|rule|counter|limit) (\S+) (\S+)(?: (.*))?$"
)
_NAMED = re.compile(r'\b(counter|limit) name "([^"]+)"')


def _items(body: str) -> list[str]:
    body = body.strip()
    if not (body.startswith("{") and body.endswith("}")):
        raise NftError(f"Error: syntax error, expected {{ ... }}: {body}")
    inner = body[1:-1].strip()
    return [i.strip() for i in inner.split(", ")] if inner else []


class NftModel:
    """An ``NftBackend`` holding tables in memory (one namespace's worth)."""

    name = "nft-model"

    def __init__(self) -> None:
        self.tables: dict[str, _Table] = {}
        self.transactions: list[str] = []
        self.redundant = 0
        self.fail_next = 0

    def run(self, text: str) -> str:
        if self.fail_next:
            self.fail_next -= 1
            raise NftError("Error: Could not process rule: No such file or directory")
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if len(lines) == 1 and lines[0].startswith("list table "):
            return self.listing(lines[0].split(" ", 2)[2])
        tables = copy.deepcopy(self.tables)
        redundant = self.redundant
        for ln in lines:
            redundant += self._one(tables, ln)
        self.tables, self.redundant = tables, redundant
        self.transactions.append(text)
        return ""

    def _one(self, tables: dict[str, _Table], line: str) -> int:
        m = _CMD.match(line)
        if m is None:
            raise NftError(f"Error: syntax error: {line}")
        verb, obj, family, rest = m.group(1), m.group(2), m.group(3), m.group(4)
        tail = m.group(5) or ""
        if obj == "table":
            name = f"{family} {rest}"
            if verb == "add":
                tables.setdefault(name, _Table())
            elif verb == "delete":
                if name not in tables:
                    raise NftError(f"Error: No such file or directory: {line}")
                del tables[name]
            else:
                raise NftError(f"Error: unsupported: {line}")
            return 0
        tname = f"{family} {rest}"
        t = tables.get(tname)
        if t is None:
            raise NftError(f"Error: No such file or directory (table): {line}")
        oname, _, body = tail.partition(" ")
        if obj in ("set", "map"):
            return self._set(t, verb, obj, oname, body, line)
        if obj == "element":
            return self._element(t, verb, oname, body, line)
        if obj == "chain":
            return self._chain(t, verb, oname, body, line)
        if obj in ("counter", "limit"):
            return self._object(t, verb, obj, oname, body, line)
        if verb != "add":
            raise NftError(f"Error: unsupported: {line}")
        chain = t.chains.get(oname)
        if chain is None:
            raise NftError(f"Error: No such file or directory (chain): {line}")
        for ref in re.findall(r"@([\w.-]+)", body):
            if ref not in t.sets and ref not in t.maps:
                raise NftError(f"Error: No such file or directory (set {ref}): {line}")
        for kind, ref in _NAMED.findall(body):
            if (kind, ref) not in t.objects:
                raise NftError(f"Error: No such file or directory ({kind} {ref}): {line}")
        for ref in re.findall(r"\bjump (\S+)", body):
            if ref not in t.chains:
                raise NftError(f"Error: No such file or directory (chain {ref}): {line}")
        chain[1].append(body)
        return 0

    @staticmethod
    def _set(t: _Table, verb: str, obj: str, name: str, body: str, line: str) -> int:
        if verb == "add":
            held = t.sets.get(name) if obj == "set" else t.maps.get(name)
            if held is not None:
                if held[0] != body:
                    raise NftError(f"Error: Could not process rule: File exists: {line}")
                return 0
            if obj == "set":
                t.sets[name] = (body, set())
            else:
                t.maps[name] = (body, {})
            return 0
        if verb != "delete" or obj != "set":
            raise NftError(f"Error: unsupported: {line}")
        if name not in t.sets:
            raise NftError(f"Error: No such file or directory: {line}")
        used = re.compile(rf"@{re.escape(name)}(\s|$)")
        if any(used.search(r) for _, rs in t.chains.values() for r in rs):
            raise NftError(f"Error: Could not process rule: Device or resource busy: {line}")
        del t.sets[name]
        return 0

    @staticmethod
    def _object(t: _Table, verb: str, kind: str, name: str, body: str, line: str) -> int:
        key = (kind, name)
        if verb == "add":
            held = t.objects.get(key)
            if held is not None and held != body:
                raise NftError(f"Error: Could not process rule: File exists: {line}")
            t.objects[key] = body
            return 0
        if verb != "delete" or key not in t.objects:
            raise NftError(f"Error: No such file or directory: {line}")
        if any((kind, name) in _NAMED.findall(r) for _, rs in t.chains.values() for r in rs):
            raise NftError(f"Error: Could not process rule: Device or resource busy: {line}")
        del t.objects[key]
        return 0

    @staticmethod
    def _element(t: _Table, verb: str, name: str, body: str, line: str) -> int:
        items = _items(body)
        redundant = 0
        if name in t.maps:
            entries = t.maps[name][1]
            for item in items:
                key, _, value = item.partition(" : ")
                if verb == "add":
                    target = value.split()[-1]
                    if target not in t.chains:
                        raise NftError(f"Error: No such file or directory (chain): {line}")
                    redundant += key in entries
                    entries[key] = value
                elif key not in entries:
                    raise NftError(
                        f"Error: Could not process rule: No such file or directory: {line}"
                    )
                else:
                    del entries[key]
            return redundant
        if name not in t.sets:
            raise NftError(f"Error: No such file or directory (set): {line}")
        elems = t.sets[name][1]
        for item in items:
            if verb == "add":
                redundant += item in elems
                elems.add(item)
            elif item not in elems:
                raise NftError(f"Error: No such file or directory: {line}")
            else:
                elems.discard(item)
        return redundant

    @staticmethod
    def _chain(t: _Table, verb: str, name: str, body: str, line: str) -> int:
        if verb == "add":
            t.chains.setdefault(name, (body, []))
            return 0
        if name not in t.chains:
            raise NftError(f"Error: No such file or directory: {line}")
        if verb == "flush":
            t.chains[name][1].clear()
            return 0
        if t.chains[name][1]:
            raise NftError(f"Error: Could not process rule: Device or resource busy: {line}")
        jump = re.compile(rf"\bjump {re.escape(name)}(\s|$)")
        jumped = any(jump.search(r) for _, rs in t.chains.values() for r in rs)
        jumped = jumped or any(
            jump.search(v) for _, entries in t.maps.values() for v in entries.values()
        )
        if jumped:
            raise NftError(f"Error: Could not process rule: Device or resource busy: {line}")
        del t.chains[name]
        return 0

    def canonical(self, table: str = "inet tabby") -> dict[str, object]:
        """The table's content: sets and maps with their elements, chains with their rules
        in order; None when there is no such table."""
        t = self.tables.get(table)
        if t is None:
            return {}
        return {
            "sets": {n: (d, frozenset(e)) for n, (d, e) in t.sets.items()},
            "maps": {n: (d, dict(e)) for n, (d, e) in t.maps.items()},
            "chains": {n: (d, tuple(r)) for n, (d, r) in t.chains.items()},
            "objects": dict(t.objects),
        }

    def listing(self, table: str) -> str:
        t = self.tables.get(table)
        if t is None:
            raise NftError(f"Error: No such file or directory: table {table}")
        out = [f"table {table} {{"]
        for n in sorted(t.sets):
            out.append(f"  set {n} {t.sets[n][0]} = {sorted(t.sets[n][1])}")
        for n in sorted(t.maps):
            out.append(f"  map {n} {t.maps[n][0]} = {sorted(t.maps[n][1].items())}")
        for n in sorted(t.chains):
            out.append(f"  chain {n} {t.chains[n][0]}")
            out.extend(f"    {r}" for r in t.chains[n][1])
        out.append("}")
        return "\n".join(out) + "\n"
