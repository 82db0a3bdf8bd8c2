"""The types every layer shares are defined once (bundle/types.py), the route scopes once
(dataplane/model.py): no module of the repository defines its own copy.

A definition is an assignment whose value is one of the shared unions (either order), a
``dict[str, Any]`` alias, or a name for the link route scope.
"""

from __future__ import annotations

import ast
from pathlib import Path

from tests import REPO_ROOT as ROOT

SKIP = {".venv", "build", "dist", ".git"}

#: The shared aliases: the home of each and the members of its union.
UNIONS = {
    "IPAddress": {"ipaddress.IPv4Address", "ipaddress.IPv6Address"},
    "IPNetwork": {"ipaddress.IPv4Network", "ipaddress.IPv6Network"},
    "IPInterface": {"ipaddress.IPv4Interface", "ipaddress.IPv6Interface"},
}
TYPES_HOME = "bundle/types.py"
SCOPES_HOME = "dataplane/model.py"
HOMES = (TYPES_HOME, SCOPES_HOME)


def _sources() -> list[Path]:
    return sorted(p for p in ROOT.rglob("*.py") if not SKIP.intersection(p.relative_to(ROOT).parts))


def _members(node: ast.expr) -> set[str] | None:
    """The operands of ``a | b | ...`` (unparsed), None when it is not such a union."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr)):
        return None
    out: set[str] = set()
    for side in (node.left, node.right):
        inner = _members(side)
        out |= inner if inner is not None else {ast.unparse(side)}
    return out


def definitions(tree: ast.Module) -> list[tuple[int, str, str]]:
    """(line, name, what) for every assignment in ``tree`` that defines a shared type or the
    link scope."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        members = _members(value)
        for alias, union in UNIONS.items():
            if members == union:
                found.append((node.lineno, target.id, alias))
        if ast.unparse(value) == "dict[str, Any]":
            found.append((node.lineno, target.id, "JSON"))
        if target.id.endswith("SCOPE_LINK") or (
            "SCOPE" in target.id and isinstance(value, ast.Constant) and value.value == 253
        ):
            found.append((node.lineno, target.id, "SCOPE_LINK"))
    return found


def test_each_shared_type_is_defined_once() -> None:
    homes: dict[str, list[str]] = {}
    for path in _sources():
        rel = path.relative_to(ROOT).as_posix()
        for line, name, what in definitions(ast.parse(path.read_text(), rel)):
            homes.setdefault(what, []).append(
                f"{rel} {name}" + ("" if rel in HOMES else f":{line}")
            )
    assert homes == {
        "IPAddress": [f"{TYPES_HOME} IPAddress"],
        "IPNetwork": [f"{TYPES_HOME} IPNetwork"],
        "IPInterface": [f"{TYPES_HOME} IPInterface"],
        "JSON": [f"{TYPES_HOME} JSON"],
        "SCOPE_LINK": [f"{SCOPES_HOME} SCOPE_LINK"],
    }


def test_the_finder_can_fail() -> None:
    tree = ast.parse(
        "import ipaddress\n"
        "Address = ipaddress.IPv6Address | ipaddress.IPv4Address\n"
        "Net: TypeAlias = ipaddress.IPv4Network | ipaddress.IPv6Network\n"
        "Doc = dict[str, Any]\n"
        "RT_SCOPE_LINK = 253\n"
        "SCOPE_HOST = 254\n"
        "Other = ipaddress.IPv4Address | None\n"
    )
    assert definitions(tree) == [
        (2, "Address", "IPAddress"),
        (3, "Net", "IPNetwork"),
        (4, "Doc", "JSON"),
        (5, "RT_SCOPE_LINK", "SCOPE_LINK"),
    ]
