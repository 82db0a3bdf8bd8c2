"""Measured numbers live in one place: docs/performance.md is rendered from the benches'
results files (bench/results/*.json) by bench/report.py, which bench/record.py's ``--record``
writes; README.md quotes none. No root, no bench run."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from bench import record, report
from tests import REPO_ROOT as ROOT

PAGE = ROOT / "docs" / "performance.md"
RESULTS = ROOT / "bench" / "results"


# -- the page and the files ----------------------------------------------------------------------


def test_the_page_is_what_the_results_render() -> None:
    """Change a number in bench/results/ (a bench's --record), then run
    ``python -m bench.report``; never edit the numbers on the page."""
    text = PAGE.read_text()
    assert report.render(text) == text, "docs/performance.md is stale: python -m bench.report"


def test_every_results_file_is_on_the_page_and_every_marker_has_a_file() -> None:
    named = report.names(PAGE.read_text())
    assert len(named) == len(set(named)), "a results file rendered twice"
    files = set(report.result_files())
    assert set(named) == files, (
        f"markers without a file: {sorted(set(named) - files)}; "
        f"files on no page: {sorted(files - set(named))}"
    )


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.stem)
def test_a_results_file_says_where_its_numbers_come_from(path: Path) -> None:
    doc = json.loads(path.read_text())
    assert doc["name"] == path.stem
    for key in ("command", "date", "load", "machine"):
        assert doc.get(key), f"{path.name}: no {key}"
    assert doc.get("output") or doc.get("tables") or doc.get("notes"), f"{path.name}: no numbers"
    if "transcribed" not in doc:  # a recording: bench/record.py's fields
        assert set(doc["load"]) == {"start", "end", "min", "max"}
        assert doc["exit_status"] == 0
        assert doc["command"].startswith("python -m bench.")
    for table in doc.get("tables", []):
        assert all(len(row) == len(table["columns"]) for row in table["rows"]), path.name


def test_the_check_command_agrees() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.report", "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr


# -- rendering ------------------------------------------------------------------------------------


def _write(directory: Path, doc: dict[str, object]) -> None:
    (directory / f"{doc['name']}.json").write_text(json.dumps(doc))


def test_render_replaces_only_what_is_between_the_markers(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "name": "one",
            "command": "python -m bench.x.y",
            "date": "2026-12-01 10:00 UTC",
            "seconds": 12.3,
            "load": {"start": 1.0, "end": 2.5, "min": 0.5, "max": 3.0},
            "machine": "2 CPUs",
            "commit": "abc1234",
            "exit_status": 0,
            "output": "a  1   \nb  2\n",
        },
    )
    text = "# T\n\nbefore\n\n<!-- results: one -->\nstale 99 ms\n<!-- /results: one -->\n\nafter\n"
    out = report.render(text, tmp_path)
    assert out.startswith("# T\n\nbefore\n\n<!-- results: one -->\n")
    assert out.endswith("<!-- /results: one -->\n\nafter\n")
    assert "stale" not in out
    assert "`python -m bench.x.y`" in out
    assert "load average 1 at the start, 2.5 at the end (0.5-3)" in out
    assert "```text\na  1\nb  2\n```" in out  # trailing blanks dropped
    assert report.render(out, tmp_path) == out


def test_render_tables_notes_and_transcriptions(tmp_path: Path) -> None:
    _write(
        tmp_path,
        {
            "name": "old",
            "command": "python -m bench.x.y --n 3",
            "transcribed": 'README.md "Performance"',
            "date": "2026-11-26",
            "load": "0.7-1.0",
            "machine": "a VM",
            "tables": [{"title": "t", "columns": ["", "p50"], "rows": [["a|b", "1 ms"]]}],
            "notes": ["x " * 60 + "1. not a list item"],
        },
    )
    out = report.render("<!-- results: old -->\n<!-- /results: old -->", tmp_path)
    assert 'transcribed from README.md "Performance"' in out
    assert "load average 0.7-1.0" in out
    assert "|  | p50 |\n|---|---|\n| a\\|b | 1 ms |" in out
    assert not any(re.match(r"\d+\. ", line) for line in out.splitlines())


def test_render_refuses_broken_markers_and_bad_rows(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="closing marker"):
        report.render("<!-- results: one -->\nno end\n", tmp_path)
    _write(tmp_path, {"name": "bad", "tables": [{"columns": ["a", "b"], "rows": [["1"]]}]})
    with pytest.raises(ValueError, match="cells"):
        report.render("<!-- results: bad -->\n<!-- /results: bad -->", tmp_path)
    (tmp_path / "renamed.json").write_text(json.dumps({"name": "other"}))
    with pytest.raises(ValueError, match="its name"):
        report.render("<!-- results: renamed -->\n<!-- /results: renamed -->", tmp_path)


# -- recording ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("argv", "name", "rest"),
    [
        ([], None, []),
        (["-n", "3"], None, ["-n", "3"]),
        (["--record"], "dflt", []),
        (["-n", "3", "--record"], "dflt", ["-n", "3"]),
        (["--record", "mine", "-n", "3"], "mine", ["-n", "3"]),
        (["--record", "-n", "3"], "dflt", ["-n", "3"]),
        (["--record=mine", "agent"], "mine", ["agent"]),
    ],
)
def test_record_argument(argv: list[str], name: str | None, rest: list[str]) -> None:
    assert record.requested(argv, "dflt") == (name, rest)


def test_a_run_is_recorded_with_its_output_and_facts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(record, "RESULTS", tmp_path)

    def main() -> int:
        print("verb  p50\nADD   1.5 ms")
        return 0

    assert record.run(main, "x", ["-n", "3", "--record"]) == 0
    assert "ADD   1.5 ms" in capsys.readouterr().out  # still printed
    doc = json.loads((tmp_path / "x.json").read_text())
    assert doc["output"] == "verb  p50\nADD   1.5 ms\n"
    assert doc["command"] == f"python -m {__name__} -n 3"
    assert doc["exit_status"] == 0
    assert set(doc["load"]) == {"start", "end", "min", "max"}
    assert doc["machine"]
    assert doc["date"].endswith("UTC")


def test_a_failed_run_or_none_asked_is_not_recorded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    assert record.run(lambda: 1, "x", ["--record"]) == 1
    assert record.run(lambda: 0, "y", []) == 0

    def exits() -> int:
        raise SystemExit(2)

    assert record.run(exits, "z", ["--record"]) == 2
    assert list(tmp_path.iterdir()) == []
    assert record.run(lambda: None, lambda argv: "named-" + argv[0], ["a", "--record"]) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["named-a.json"]
    with pytest.raises(ValueError):
        record.path_of("../x")


def _benches() -> list[str]:
    """Every bench bench/README.md's table lists (``python -m bench.<group>.<name>``)."""
    text = (ROOT / "bench" / "README.md").read_text()
    table = text[text.index("## The benches") : text.index("## Results")]
    return sorted(set(re.findall(r"`python -m (bench\.\w+\.\w+)", table)))


def test_bench_readme_lists_every_bench_and_each_can_record() -> None:
    listed = _benches()
    modules = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for p in (ROOT / "bench").glob("*/*.py")
        if p.name != "__init__.py"
    }
    parts = {  # imported by a bench or started by one, never run by hand
        "bench.cni.cni_bench_exec",
        "bench.cni.cni_bench_pure",
        "bench.cni.cni_bench_run",
        "bench.cni.client_floor_main",
        "bench.scale.scale_populate",
        "bench.scale.scale_sim",
        "bench.scale.scale_wire",
        "bench.scale.scale_writer",
    }
    assert set(listed) == modules - parts
    for module in listed:
        if module == "bench.cni.client_floor":  # builds a program, measures nothing
            continue
        source = (ROOT / Path(*module.split("."))).with_suffix(".py").read_text()
        assert "record.add_argument(" in source, module
        assert "sys.exit(record.run(main, " in source, module


# -- README ---------------------------------------------------------------------------------------

#: A measured quantity: a number with a unit of time, size or rate, or a ratio like "3.8x".
MEASURED = re.compile(
    r"\b\d[\d,.]*\s?(?:ms|us|µs|ns|s|min|MB|KB|GB|MiB|%|calls/s|x)(?![\w/])", re.IGNORECASE
)


def test_readme_quotes_no_measured_number() -> None:
    text = (ROOT / "README.md").read_text()
    found = MEASURED.findall(text)
    assert not found, f"README.md quotes measured numbers {found}: link docs/performance.md"
    assert "docs/performance.md" in text
