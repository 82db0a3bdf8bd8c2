"""docs/performance.md's numbers, rendered from bench/results/*.json.

    python -m bench.report            # rewrite the generated parts of docs/performance.md
    python -m bench.report --check    # exit 1 when the page differs from the results files

The page is written by hand except between marker comments::

    <!-- results: NAME -->
    ...rendered from bench/results/NAME.json...
    <!-- /results: NAME -->

Everything between a pair is replaced by what the results file says: where the numbers come
from (the command, date, load, machine, commit; or the document they were transcribed
from), its tables, its notes and the bench's own output. A number is never typed into the
page: a bench run with ``--record`` (bench/record.py) writes its file, this renders it.
tests/unit/bench/test_report.py fails when the page and the files disagree, when a marker
names no file, and when a file is on no page.

Standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
PAGE = ROOT / "docs" / "performance.md"

BLOCK = re.compile(
    r"(?P<open><!-- results: (?P<name>[A-Za-z0-9_-]+) -->\n)"
    r"(?P<body>.*?)"
    r"(?P<close><!-- /results: (?P=name) -->)",
    re.S,
)


def load(name: str, results: Path = RESULTS) -> dict[str, Any]:
    path = results / f"{name}.json"
    doc: dict[str, Any] = json.loads(path.read_text())
    if doc.get("name") != name:
        raise ValueError(f"{path}: its name is {doc.get('name')!r}")
    return doc


def names(text: str) -> list[str]:
    """The results the page's markers name, in order."""
    return [m.group("name") for m in BLOCK.finditer(text)]


def render(text: str, results: Path = RESULTS) -> str:
    """``text`` with every marked block rendered from its results file."""
    unclosed = set(re.findall(r"<!-- results: ([A-Za-z0-9_-]+) -->", text)) - set(names(text))
    if unclosed:
        raise ValueError(f"results markers without their closing marker: {sorted(unclosed)}")

    def block(m: re.Match[str]) -> str:
        body = render_results(load(m.group("name"), results))
        return f"{m.group('open')}{body}{m.group('close')}"

    return BLOCK.sub(block, text)


def render_results(doc: dict[str, Any]) -> str:
    """One results file as Markdown (ends with a newline)."""
    parts = [_provenance(doc)]
    for table in doc.get("tables", []):
        parts.append(_table(table))
    for note in doc.get("notes", []):
        parts.append(_wrap(note))
    if doc.get("output"):
        lines = [line.rstrip() for line in doc["output"].strip("\n").split("\n")]
        parts.append("```text\n" + "\n".join(lines) + "\n```")
    return "\n\n".join(parts) + "\n"


def _provenance(doc: dict[str, Any]) -> str:
    name = doc["name"]
    where = f"[`bench/results/{name}.json`](../bench/results/{name}.json)"
    facts = []
    if doc.get("command"):
        facts.append(f"`{doc['command']}`")
    if doc.get("transcribed"):
        facts.append(f"transcribed from {doc['transcribed']}")
    if doc.get("date"):
        when = str(doc["date"])
        if doc.get("seconds") is not None:
            when += f", {_seconds(doc['seconds'])}"
        facts.append(when)
    if doc.get("load") is not None:
        facts.append(_load(doc["load"]))
    if doc.get("machine"):
        facts.append(str(doc["machine"]))
    if doc.get("commit"):
        facts.append(f"commit {doc['commit']}")
    return _wrap(f"*{where}*: " + "; ".join(facts) + ".")


def _seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 600 else f"{s / 60:.0f} min"


def _load(load: Any) -> str:
    if isinstance(load, dict):
        return (
            f"load average {load['start']:g} at the start, {load['end']:g} at the end "
            f"({load['min']:g}-{load['max']:g})"
        )
    return f"load average {load}"


def _cell(value: Any) -> str:
    text = "" if value is None else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def _table(table: dict[str, Any]) -> str:
    columns = table["columns"]
    lines = []
    if table.get("title"):
        lines += [_wrap(table["title"]), ""]
    lines.append("| " + " | ".join(_cell(c) for c in columns) + " |")
    lines.append("|" + "---|" * len(columns))
    for row in table["rows"]:
        if len(row) != len(columns):
            raise ValueError(f"a row of {table.get('title', columns)!r} has {len(row)} cells")
        lines.append("| " + " | ".join(_cell(c) for c in row) + " |")
    return "\n".join(lines)


#: A word that would make Markdown of a line it starts: a list item, a heading, a quote.
LINE_START = re.compile(r"^(\d+[.)]|[-*+]|#+|>|\|)$")


def _wrap(text: str, width: int = 96) -> str:
    """A paragraph wrapped at ``width``; its own line breaks (a list's items) are kept, and
    no wrapped line starts with a word Markdown would read as a list item or a heading."""
    out = []
    for para in text.split("\n"):
        line = ""
        for word in para.split(" "):
            if line and len(line) + 1 + len(word) > width and not LINE_START.match(word):
                out.append(line)
                line = word
            else:
                line = f"{line} {word}" if line else word
        out.append(line)
    return "\n".join(out)


def result_files(results: Path = RESULTS) -> Iterator[str]:
    for path in sorted(results.glob("*.json")):
        yield path.stem


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when the page is not current")
    args = ap.parse_args()
    text = PAGE.read_text()
    new = render(text)
    unused = sorted(set(result_files()) - set(names(text)))
    if unused:
        print(f"results on no page: {', '.join(unused)}", file=sys.stderr)
    if args.check:
        if new != text:
            where = PAGE.relative_to(ROOT)
            print(f"{where} is not what python -m bench.report renders", file=sys.stderr)
            return 1
        return 1 if unused else 0
    if new != text:
        PAGE.write_text(new)
        print(f"rewrote {PAGE.relative_to(ROOT)}")
    return 1 if unused else 0


if __name__ == "__main__":
    sys.exit(main())
