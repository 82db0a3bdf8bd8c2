"""The repository stands alone: every CNI rule ID it cites is defined in
cni_protocol/CONFORMANCE.md, a file that cites IDs says where they are defined, quoted
README, docs/ and CONFORMANCE.md sections exist, and nothing points at documents a clone does
not have (the project's private notes)."""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import REPO_ROOT as ROOT

DOC_PATH = "cni_protocol/CONFORMANCE.md"
DOC = ROOT / DOC_PATH

FAMILIES = (
    *("GEN", "ENV", "CFG", "CDEV", "CAP"),
    *("ADD", "DEL", "CHK", "STA", "GC", "VER"),
    *("IPM", "CHN", "KARG"),
)
#: ``ADD-5``, and ranges such as ``IPM-7..11`` (every number in between is cited).
ID_RE = re.compile(r"\b(" + "|".join(FAMILIES) + r")-(\d+)(?:\.\.(\d+))?\b")
ROW_RE = re.compile(r"^\| ((?:" + "|".join(FAMILIES) + r")-\d+) \|(.*)\|\s*$")

#: Documents that are not part of the repository (split so that this file does not name them).
PRIVATE = ("PRODUCT" + ".md", "STYLE" + ".md", "cni-spec-" + "checklist", "/wo" + "rk/shared")
#: The private list cited by its own numbering: the word, then "section", a number or an ID.
CHECKLIST_RE = re.compile(r"\bchecklist\s+(?:sections?\b|\d|[A-Z]+-\d)", re.IGNORECASE)
README_REF_RE = re.compile(r'\bREADME\s+"([^"]+)"')
#: ``docs/cluster.md "Datastore settings"``: a section of a page of the manual.
DOCS_REF_RE = re.compile(r'\b(docs/[\w-]+\.md)\s+"([^"]+)"')
DOC_REF_RE = re.compile(r'\bCONFORMANCE\.md\s+"([^"]+)"')

#: Files other engineers are editing while this test was written: they still cite a private
#: document or cite IDs without naming CONFORMANCE.md. Remove an entry once it is fixed
#: (``test_pending_files_still_need_fixing`` says when).
PENDING: set[str] = set()

SKIP_DIRS = {
    ".git",
    ".venv",
    "build",
    "dist",
    "__pycache__",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    "node_modules",
}
#: Downloaded and built tools of the e2e tier (ignored by git).
SKIP_PATHS = {"tests/e2e/tools/bin"}


def repo_files() -> Iterator[tuple[str, str]]:
    """(path relative to the root, text) of every text file of the repository."""
    for top, dirs, files in os.walk(ROOT):
        rel_top = os.path.relpath(top, ROOT)
        dirs[:] = sorted(
            d
            for d in dirs
            if d not in SKIP_DIRS
            and not d.endswith(".egg-info")
            and os.path.normpath(os.path.join(rel_top, d)) not in SKIP_PATHS
        )
        for name in sorted(files):
            path = Path(top) / name
            if path.is_symlink() or path.stat().st_size > 2_000_000:
                continue
            data = path.read_bytes()
            if b"\0" in data:
                continue
            yield os.path.normpath(os.path.join(rel_top, name)), data.decode(errors="replace")


FILES = dict(repo_files())


def cited(text: str) -> Iterator[tuple[int, str]]:
    """(line number, ID) of every ID the text cites, ranges expanded."""
    for m in ID_RE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        first = int(m.group(2))
        last = int(m.group(3)) if m.group(3) else first
        for n in range(first, last + 1):
            yield line, f"{m.group(1)}-{n}"


def doc_rows() -> list[tuple[str, list[str]]]:
    rows = []
    for line in DOC.read_text().splitlines():
        m = ROW_RE.match(line)
        if m:
            rows.append((m.group(1), [c.strip() for c in m.group(2).split("|")]))
    return rows


def headings(text: str) -> list[str]:
    return [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]


def names_a_heading(name: str, heads: list[str]) -> bool:
    """A heading, or its start before " (": "`tabby-ipam` fields" names
    "`tabby-ipam` fields (inside `ipam`)". Backticks do not count."""
    name = name.replace("`", "")
    plain = [h.replace("`", "") for h in heads]
    return any(h == name or h.startswith(name + " (") for h in plain)


def test_the_walk_sees_the_repository() -> None:
    assert DOC_PATH in FILES
    assert "cni_plugin/plugin.py" in FILES
    assert "README.md" in FILES
    assert not any(p.startswith((".venv/", "build/", ".git/")) for p in FILES)


def test_the_document_defines_each_id_once_with_source_and_tests() -> None:
    rows = doc_rows()
    assert len(rows) > 50
    ids = [i for i, _ in rows]
    assert len(ids) == len(set(ids)), "an ID is defined twice"
    for rule, cells in rows:
        assert len(cells) == 3, f"{rule}: expected rule | source | tested in"
        text, source, tested = cells
        assert text, f"{rule}: no rule text"
        assert source, f"{rule}: no source"
        for test_file in re.findall(r"`([^`]+\.py)`", tested):
            assert (ROOT / "tests" / test_file).is_file(), f"{rule}: tests/{test_file} is missing"
        assert tested == "none of its own yet" or "`" in tested, f"{rule}: no test file"


def test_every_cited_id_is_defined() -> None:
    defined = {i for i, _ in doc_rows()}
    missing = [
        f"{path}:{line}: {rule}"
        for path, text in FILES.items()
        for line, rule in cited(text)
        if rule not in defined
    ]
    assert not missing, f"IDs not defined in {DOC_PATH}: {missing}"


def test_files_that_cite_ids_say_where_they_are_defined() -> None:
    silent = [
        path
        for path, text in FILES.items()
        if path != DOC_PATH
        and path not in PENDING
        and any(True for _ in cited(text))
        and "CONFORMANCE.md" not in text
    ]
    assert not silent, f"these cite rule IDs but never name {DOC_PATH}: {silent}"


def private_references(text: str) -> list[tuple[int, str]]:
    found = []
    for n, line in enumerate(text.splitlines(), 1):
        found += [(n, name) for name in PRIVATE if name in line]
        found += [(n, m.group(0)) for m in CHECKLIST_RE.finditer(line)]
    return found


def test_no_reference_to_documents_a_clone_does_not_have() -> None:
    bad = [
        f"{path}:{n}: {what}"
        for path, text in FILES.items()
        if path not in PENDING
        for n, what in private_references(text)
    ]
    assert not bad, f"point at README, docs/ or {DOC_PATH} instead: {bad}"


def test_quoted_sections_exist() -> None:
    readme = headings(FILES["README.md"])
    doc = headings(DOC.read_text())
    bad = []
    for path, text in FILES.items():
        if path in PENDING:
            continue
        for regex, heads, where in ((README_REF_RE, readme, "README"), (DOC_REF_RE, doc, "doc")):
            for m in regex.finditer(text):
                name = " ".join(m.group(1).split())
                if not names_a_heading(name, heads):
                    bad.append(f"{path}: {where} section {name!r}")
            for m in DOCS_REF_RE.finditer(text):
                page, name = m.group(1), " ".join(m.group(2).split())
                if page not in FILES:
                    bad.append(f"{path}: no page {page}")
                elif not names_a_heading(name, headings(FILES[page])):
                    bad.append(f"{path}: {page} section {name!r}")
    assert not bad, f"no such section: {bad}"


def test_quoting_a_section_of_the_manual_is_checked() -> None:
    """A quoted section of a docs/ page must exist (what test_quoted_sections_exist reads)."""
    cited = [m.group(1) for text in FILES.values() for m in DOCS_REF_RE.finditer(text)]
    assert "docs/configuration.md" in cited
    assert "docs/cluster.md" in cited
    assert names_a_heading("Datastore settings", headings(FILES["docs/cluster.md"]))
    assert not names_a_heading("No such section", headings(FILES["docs/cluster.md"]))


@pytest.mark.parametrize("path", sorted(PENDING))
def test_pending_files_still_need_fixing(path: str) -> None:
    text = FILES.get(path)
    assert text is not None, f"{path} is gone: remove it from PENDING"
    still = bool(private_references(text)) or (
        any(True for _ in cited(text)) and "CONFORMANCE.md" not in text
    )
    assert still, f"{path} is fixed: remove it from PENDING"
