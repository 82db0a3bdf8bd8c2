"""The manual: README.md is the way in (at most ~300 lines) and links every page of docs/;
every relative link of README.md, docs/*.md and bench/README.md reaches a file, and its
``#anchor`` a heading there (as GitHub makes anchors); every tabbyctl command and option is
documented in docs/tabbyctl.md."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import click
import pytest

from tabbyctl.cli import cli
from tests import REPO_ROOT as ROOT

DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", ROOT / "bench" / "README.md", *sorted(DOCS.glob("*.md"))]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def prose(text: str) -> str:
    """``text`` without its fenced code blocks."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (``-`` and ``_``
    kept), spaces made hyphens."""
    text = heading.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in " -_")
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.+)", line)
        if not m:
            continue
        base = slug(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def links(path: Path) -> Iterator[str]:
    for m in LINK.finditer(prose(path.read_text())):
        target = m.group(1)
        if not re.match(r"[a-z]+:", target):
            yield target


def test_slugs_are_githubs() -> None:
    assert slug("`tabby-ipam` fields (inside `ipam`)") == "tabby-ipam-fields-inside-ipam"
    assert slug("Resources (`tabbyctl apply -f FILE|-`, `get`, `delete`)") == (
        "resources-tabbyctl-apply--f-file--get-delete"
    )
    assert slug("Issue 21's table: `x --table`") == "issue-21s-table-x---table"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_link_reaches_its_file_and_heading(page: Path) -> None:
    bad = []
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no such heading in {dest.relative_to(ROOT)}")
    assert not bad, f"{page.relative_to(ROOT)}: {bad}"


def test_readme_is_short_and_leads_to_every_page() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 300
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in links(ROOT / "README.md")}
    missing = [p.name for p in DOCS.glob("*.md") if p.resolve() not in linked]
    assert not missing, f"README.md does not link {missing}"
    for command in ("./build.sh", "bash tests/run.sh"):
        assert f"\n{command} " in text, command


# -- tabbyctl -------------------------------------------------------------------------------------


def commands(group: click.Group, path: tuple[str, ...] = ()) -> Iterator[tuple[str, click.Command]]:
    for name, cmd in sorted(group.commands.items()):
        if isinstance(cmd, click.Group):
            yield from commands(cmd, (*path, name))
        else:
            yield " ".join((*path, name)), cmd


def option_names(cmd: click.Command) -> list[list[str]]:
    """Every option's names (``["-o", "--output"]``), ``--help`` left out."""
    return [
        p.opts + p.secondary_opts
        for p in cmd.params
        if isinstance(p, click.Option) and "--help" not in p.opts
    ]


DOC = (DOCS / "tabbyctl.md").read_text()
ROWS = [line for line in DOC.splitlines() if line.startswith("| `tabbyctl ")]


@pytest.mark.parametrize(("path", "cmd"), list(commands(cli)), ids=lambda v: str(v))
def test_every_command_and_option_is_documented(path: str, cmd: click.Command) -> None:
    command = re.compile(rf"`tabbyctl {re.escape(path)}[ `]")
    rows = [r for r in ROWS if command.search(r.split(" | ")[0])]
    assert rows, f"docs/tabbyctl.md has no row for tabbyctl {path}"
    text = " ".join(rows)
    missing = [o for o in option_names(cmd) if not any(mentions(text, n) for n in o)]
    assert not missing, f"tabbyctl {path}: {missing} not in its row of docs/tabbyctl.md"


def mentions(text: str, option: str) -> bool:
    return re.search(rf"(?<![\w-]){re.escape(option)}(?![\w-])", text) is not None


def test_every_global_option_is_documented() -> None:
    table = DOC[DOC.index("## Global options") : DOC.index("## Commands")]
    missing = [o for o in option_names(cli) if not any(mentions(table, n) for n in o)]
    assert not missing, missing
