"""A bench run recorded: ``--record [NAME]`` writes ``bench/results/NAME.json``.

The file holds what the bench printed on its standard output, verbatim (its tables: the
numbers are the bench's own, never retyped), with what is needed to judge them: the command
line, when it ran (UTC) and for how long, the machine's 1-minute load average at the start,
at the end and its range over the run (sampled every few seconds: the machine is shared),
the machine (CPUs, kernel, Python) and the commit it ran. ``docs/performance.md`` is rendered
from these files by ``python -m bench.report``; a unit test fails when the page differs
from them (tests/unit/bench/test_report.py).

A bench takes part with two lines: ``add_argument(parser, NAME)`` for its ``--help``, and
``sys.exit(run(main, NAME))`` instead of ``sys.exit(main())``. Only a run that exits 0 is
recorded (an interrupted or failed run leaves the previous file alone). Output a bench's
children write to the terminal themselves is not captured: a bench prints its tables itself.

The files' format (``bench/README.md``, "Results"): ``name``, ``command``, ``date``,
``seconds``, ``load`` (``{"start", "end", "min", "max"}``), ``machine``, ``commit``,
``exit_status``, ``output``; files transcribed from an earlier document instead carry
``transcribed`` (where from), ``load`` as it was stated there, ``tables`` and ``notes``.

Standard library only.
"""

from __future__ import annotations

import datetime
import io
import json
import os
import platform
import shlex
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"
LOAD_EVERY = 5.0  # s between two samples of the load average


def add_argument(parser: Any, name: str) -> None:
    """``--record [NAME]`` on an argparse parser (the bench's ``--help`` shows it); ``name``
    says what the default NAME is."""
    parser.add_argument(
        "--record",
        nargs="?",
        const=name,
        metavar="NAME",
        help=(
            f"write this run's output, command line, load and date to bench/results/NAME.json "
            f"(default NAME: {name}), which docs/performance.md is rendered from "
            f"(python -m bench.report)"
        ),
    )


def requested(argv: list[str], default: str) -> tuple[str | None, list[str]]:
    """The results name ``--record`` asks for (None: not asked) and the other arguments."""
    name: str | None = None
    rest: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--record":
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and not nxt.startswith("-") and _is_name(nxt):
                name = nxt
                i += 1
            else:
                name = default
        elif arg.startswith("--record="):
            name = arg.split("=", 1)[1] or default
        else:
            rest.append(arg)
        i += 1
    return name, rest


def _is_name(text: str) -> bool:
    return all(c.isalnum() or c in "-_" for c in text)


def path_of(name: str) -> Path:
    if not name or not _is_name(name):
        raise ValueError(f"a results name is letters, digits, - and _: {name!r}")
    return RESULTS / f"{name}.json"


class _Tee(io.TextIOBase):
    """Standard output that also keeps what was written."""

    def __init__(self, out: TextIO) -> None:
        self.out = out
        self.kept = io.StringIO()

    def write(self, text: str) -> int:
        self.kept.write(text)
        return self.out.write(text)

    def flush(self) -> None:
        self.out.flush()

    def isatty(self) -> bool:
        return self.out.isatty()

    def fileno(self) -> int:
        return self.out.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self.out.encoding


class _Load:
    """The 1-minute load average, sampled every LOAD_EVERY s on a daemon thread."""

    def __init__(self) -> None:
        self.samples = [os.getloadavg()[0]]
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="record-load", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.wait(LOAD_EVERY):
            self.samples.append(os.getloadavg()[0])

    def done(self) -> dict[str, float]:
        self.stop.set()
        self.samples.append(os.getloadavg()[0])
        s = self.samples
        return {"start": s[0], "end": s[-1], "min": min(s), "max": max(s)}


def machine() -> str:
    return (
        f"{os.cpu_count()} CPUs, {platform.system()} {platform.release()}, "
        f"Python {platform.python_version()}"
    )


def commit() -> str | None:
    """The checkout's commit, ``-dirty`` when tracked files (but the results) differ from it."""
    try:
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        dirty = subprocess.run(
            # (a changed results file does not make the code dirty)
            [
                *("git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"),
                *("--", ".", ":!bench/results"),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None
    return head + ("-dirty" if dirty else "")


def command(module: str, args: list[str]) -> str:
    return shlex.join(["python", "-m", module, *args])


def run(
    main: Callable[[], int | None],
    default: str | Callable[[list[str]], str],
    argv: list[str] | None = None,
) -> int:
    """``main()``; with ``--record [NAME]`` among the arguments, its output recorded. The
    default NAME is ``default``, or what ``default(arguments)`` makes of the arguments (a
    bench whose modes are recorded apart)."""
    argv = sys.argv[1:] if argv is None else argv
    name, rest = requested(argv, default if isinstance(default, str) else default(argv))
    if name is None:
        return main() or 0
    path = path_of(name)
    module = main.__globals__.get("__spec__")
    module_name = module.name if module is not None else main.__module__
    load = _Load()
    started = time.time()
    tee = _Tee(sys.stdout)
    sys.stdout = tee
    try:
        status = main() or 0
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.stdout = tee.out
    loads = load.done()
    if status != 0:
        print(f"not recorded ({path}): exit status {status}", file=sys.stderr)
        return status
    doc: dict[str, Any] = {
        "name": name,
        "command": command(module_name, rest),
        "date": datetime.datetime.fromtimestamp(started, datetime.UTC).strftime(
            "%Y-%m-%d %H:%M UTC"
        ),
        "seconds": round(time.time() - started, 1),
        "load": {k: round(v, 2) for k, v in loads.items()},
        "machine": machine(),
        "commit": commit(),
        "exit_status": status,
        "output": tee.kept.getvalue(),
    }
    write(path, doc)
    where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
    print(f"recorded: {where} (python -m bench.report puts it on its page)", file=sys.stderr)
    return status


def write(path: Path, doc: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(doc, indent=1, ensure_ascii=False) + "\n")
    tmp.replace(path)
