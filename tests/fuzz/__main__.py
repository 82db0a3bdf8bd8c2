"""Every atheris target for a bounded time, from its corpus: ``python -m tests.fuzz
[--seconds N] [target ...]`` (tests/run.sh runs it in CI with TABBY_FUZZ_SECONDS, 20 by
default). Each target runs in a process of its own on a scratch copy of its corpus
(libFuzzer adds the inputs it finds to its first corpus directory; the kept corpus is the
small seed set in the tree). Prints the executions of every target; exits 1 when a target
crashed, with the input that did it (left in the scratch directory, printed here)."""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests.fuzz import CORPUS, TARGETS

REPO = CORPUS.parents[2]
_DONE = re.compile(r"Done (\d+) runs in (\d+) second")


def run_target(
    target: str, seconds: int, scratch: Path, seed: int
) -> tuple[int, float, Path | None, str]:
    """(executions, wall seconds, crash input or None, the run's last lines)."""
    work = scratch / target
    corpus = work / "corpus"
    shutil.copytree(CORPUS / target, corpus)
    env = dict(os.environ, PYTHONPATH=str(REPO), TABBY_CONFIG_CACHE="off")
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            f"tests.fuzz.{target}",
            f"-max_total_time={seconds}",
            f"-seed={seed}",
            "-rss_limit_mb=2048",
            "-timeout=30",
            "-print_final_stats=1",
            f"-artifact_prefix={work}/",
            str(corpus),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=seconds + 600,
        check=False,
    )
    wall = time.monotonic() - started
    log = done.stderr
    m = _DONE.search(log)
    runs = int(m.group(1)) if m else 0
    if not m:
        stat = re.search(r"stat::number_of_executed_units:\s*(\d+)", log)
        runs = int(stat.group(1)) if stat else 0
    crashes = sorted(p for p in work.iterdir() if p.name.startswith(("crash-", "timeout-", "oom-")))
    crash = crashes[0] if crashes else (None if done.returncode == 0 else work)
    tail = "\n".join(log.splitlines()[-40:])
    return runs, wall, crash, tail


def main() -> int:
    ap = argparse.ArgumentParser(prog="python -m tests.fuzz", description=__doc__)
    ap.add_argument("targets", nargs="*", metavar="target", help=f"of {', '.join(TARGETS)}")
    ap.add_argument("--seconds", type=int, default=int(os.environ.get("TABBY_FUZZ_SECONDS", "20")))
    ap.add_argument(
        "--seed",
        type=int,
        default=int(os.environ.get("TABBY_FUZZ_SEED", "1")),
        help="libFuzzer's seed (TABBY_FUZZ_SEED; 1 by default, so a run's path is repeatable; "
        "0 draws one: for exploring, not for CI)",
    )
    args = ap.parse_args()
    unknown = sorted(set(args.targets) - set(TARGETS))
    if unknown:
        ap.error(f"no such target: {', '.join(unknown)}")
    args.targets = args.targets or list(TARGETS)
    scratch = Path(tempfile.mkdtemp(prefix="tabby-fuzz-"))
    failed = []
    print(
        f"fuzzing {len(args.targets)} targets, {args.seconds} s each, seed {args.seed} "
        f"(scratch: {scratch})"
    )
    for target in args.targets:
        runs, wall, crash, tail = run_target(target, args.seconds, scratch, args.seed)
        verdict = "ok" if crash is None else f"CRASH: {crash}"
        print(f"  {target:12} {runs:>9,} executions in {wall:5.1f} s  {verdict}", flush=True)
        if crash is not None:
            failed.append(target)
            print(tail)
            if crash.is_file():
                print(f"  input ({crash.stat().st_size} bytes): {crash.read_bytes()[:2000]!r}")
    if failed:
        print(f"fuzzing: {len(failed)} target(s) crashed: {', '.join(failed)}; inputs in {scratch}")
        return 1
    shutil.rmtree(scratch, ignore_errors=True)
    print(f"fuzzing: {len(args.targets)} targets, no crash")
    return 0


if __name__ == "__main__":
    sys.exit(main())
