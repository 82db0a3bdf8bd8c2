#!/usr/bin/env python3
"""The client floor: a frozen Python program that does nothing, built the way tabby's bundle
is (PyInstaller onedir, modules as plain files, the same start-up hooks dropped, the same
interpreter), so that a benchmark
can show beside every number the least any frozen Python process costs on this machine.

    .venv/bin/python -m bench.cni.client_floor            # builds it once, prints its path
    .venv/bin/python -m bench.cni.client_floor --rebuild

The program (``bench/cni/client_floor_main.py``, an empty module) lands in
``build/client-floor/dist/floor/floor`` (``build/`` is not tracked); it is rebuilt when it is
missing, or older than its source or this script. Building takes ~20-60 s with the
PyInstaller of the environment running this script (``.venv``: ``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "client_floor_main.py"
OUT = ROOT / "build" / "client-floor"
BINARY = OUT / "dist" / "floor" / "floor"


def stale() -> bool:
    if not BINARY.exists():
        return True
    built = BINARY.stat().st_mtime
    return any(p.stat().st_mtime > built for p in (SOURCE, Path(__file__)))


#: The spec: as packaging/tabby.spec builds tabby (onedir, modules as plain files, the
#: start-up hooks tabby drops dropped too), around the empty program.
SPEC = """
a = Analysis([{source!r}], noarchive=True, optimize=0,
             excludes=["tkinter", "pydoc", "doctest", "setuptools", "pip"])
a.scripts = [s for s in a.scripts
             if s[0] not in ("pyi_rth_inspect", "pyi_rth_multiprocessing", "pyi_rth_pkgutil")]
pyz = PYZ(a.pure)
exe = EXE(pyz, a.scripts, [], exclude_binaries=True, name="floor", debug=False, strip=True,
          upx=False, console=True)
coll = COLLECT(exe, a.binaries, a.datas, strip=True, upx=False, name="floor")
"""


def build(force: bool = False) -> str:
    """The floor binary's path, built first when needed."""
    if force or stale():
        OUT.mkdir(parents=True, exist_ok=True)
        spec = OUT / "floor.spec"
        spec.write_text(SPEC.format(source=str(SOURCE)))
        env = {**os.environ, "PYINSTALLER_CONFIG_DIR": str(OUT / "pyi-config")}
        argv = [
            sys.executable,
            *("-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN"),
            *("--distpath", str(OUT / "dist"), "--workpath", str(OUT / "work")),
            str(spec),
        ]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not BINARY.exists():
            raise RuntimeError(f"cannot build the client floor: {proc.stderr[-1500:]}")
    check = subprocess.run([str(BINARY)], capture_output=True, check=False)
    if check.returncode != 0 or check.stdout or check.stderr:
        raise RuntimeError(f"the client floor {BINARY} is not silent: {check.stderr[-500:]!r}")
    return str(BINARY)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rebuild", action="store_true")
    args = ap.parse_args()
    try:
        print(build(args.rebuild))
    except RuntimeError as e:
        print(f"client_floor: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
