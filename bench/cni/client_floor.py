#!/usr/bin/env python3
"""The client floor: a frozen Python program that does nothing, built the way tabby's bundle
is (PyInstaller onedir, modules as plain files, the same start-up hooks dropped, the same
interpreter), so that a benchmark
can show beside every number the least any frozen Python process costs on this machine.

    .venv/bin/python -m bench.cni.client_floor            # builds it once, prints its path
    .venv/bin/python -m bench.cni.client_floor --rebuild
    .venv/bin/python -m bench.cni.client_floor --compare 150 [--record]

``--compare N``: what the floor is made of. N interleaved rounds (CPU and wall per process) of
the interpreter alone (``-I -S -c pass``: no site, nothing imported but what it needs to
start), the same plus the modules a call served by tabby-node imports (``bundle.entry``,
``tabby_node.client``: the plugin's whole fast path), the floor, and the floor built with
bytecode optimisation (``optimize=2``) and with the bootloader's options too (UTF-8 mode,
unbuffered): what each trim can take off; the interpreter with ``ctypes`` imported too
(PyInstaller's bootstrap imports it at the start of every process of a bundle that holds it,
as tabby's does, and the floor's does not); and the installed plugin (``/opt/cni/bin/tabby``)
itself, a CHECK it forwards to a stand-in node that answers at once: the client process of a
served call, whole.

The program (``bench/cni/client_floor_main.py``, an empty module) lands in
``build/client-floor/dist/floor/floor`` (``build/`` is not tracked); it is rebuilt when it is
missing, or older than its source or this script. Building takes ~20-60 s with the
PyInstaller of the environment running this script (``.venv``: ``pip install -e '.[dev]'``).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

from bench import record

ROOT = Path(__file__).resolve().parents[2]
SOURCE = Path(__file__).resolve().parent / "client_floor_main.py"
OUT = ROOT / "build" / "client-floor"
BINARY = OUT / "dist" / "floor" / "floor"

#: ``--compare``'s builds: name -> (optimize, the bootloader's options)
VARIANTS: dict[str, tuple[int, list[str]]] = {
    "floor": (0, []),
    "floor-optimize2": (2, []),
    "floor-optimize2-options": (2, ["X utf8_mode=1", "u"]),
}


def binary(name: str = "floor") -> Path:
    return OUT / "dist" / name / name


def stale(name: str = "floor") -> bool:
    path = binary(name)
    if not path.exists():
        return True
    built = path.stat().st_mtime
    return any(p.stat().st_mtime > built for p in (SOURCE, Path(__file__)))


#: The spec: as packaging/tabby.spec builds tabby (onedir, modules as plain files, the
#: start-up hooks tabby drops dropped too), around the empty program.
SPEC = """
a = Analysis([{source!r}], noarchive=True, optimize={optimize},
             excludes=["tkinter", "pydoc", "doctest", "setuptools", "pip"])
a.scripts = [s for s in a.scripts
             if s[0] not in ("pyi_rth_inspect", "pyi_rth_multiprocessing", "pyi_rth_pkgutil")]
pyz = PYZ(a.pure)
exe = EXE(pyz, a.scripts, {options!r}, exclude_binaries=True, name={name!r}, debug=False,
          strip=True, upx=False, console=True)
coll = COLLECT(exe, a.binaries, a.datas, strip=True, upx=False, name={name!r})
"""


def build(force: bool = False, name: str = "floor") -> str:
    """The floor binary's path (``name``: one of ``VARIANTS``), built first when needed."""
    path = binary(name)
    if force or stale(name):
        optimize, options = VARIANTS[name]
        OUT.mkdir(parents=True, exist_ok=True)
        spec = OUT / f"{name}.spec"
        spec.write_text(
            SPEC.format(
                source=str(SOURCE),
                optimize=optimize,
                options=[(o, None, "OPTION") for o in options],
                name=name,
            )
        )
        env = {**os.environ, "PYINSTALLER_CONFIG_DIR": str(OUT / "pyi-config")}
        argv = [
            sys.executable,
            *("-m", "PyInstaller", "--noconfirm", "--clean", "--log-level", "WARN"),
            *("--distpath", str(OUT / "dist"), "--workpath", str(OUT / "work" / name)),
            str(spec),
        ]
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0 or not path.exists():
            raise RuntimeError(f"cannot build the client floor: {proc.stderr[-1500:]}")
    check = subprocess.run([str(path)], capture_output=True, check=False)
    if check.returncode != 0 or check.stdout or check.stderr:
        raise RuntimeError(f"the client floor {path} is not silent: {check.stderr[-500:]!r}")
    return str(path)


#: What a call served by tabby-node imports before it forwards the call (bundle/entry.py)
SERVED_PATH = "import sys; sys.path.insert(0, {root!r}); import os, struct, time{more}"
SERVED_IMPORTS = (
    "; import bundle.entry; from bundle import __version__; from tabby_node import SOCKET_ENV; "
    "from tabby_node.client import try_node"
)


#: The installed plugin's whole fast path (``--compare``): a CHECK forwarded to a node that
#: answers at once, so what is timed is the client process alone.
PLUGIN = "/opt/cni/bin/tabby"
FORWARDED_CONF = b'{"cniVersion":"1.0.0","name":"floor","type":"tabby"}'


class InstantNode:
    """A stand-in for tabby-node on a socket of its own (``path``): takes each call
    (tabby_node's framing: "A", then the answer) and answers it at once, success and an
    empty result, in a thread of this process (so the client's CPU is all that
    RUSAGE_CHILDREN counts)."""

    def __init__(self, directory: str) -> None:
        import socket
        import threading

        self.path = os.path.join(directory, "node.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.bind(self.path)
        self.sock.listen(16)
        threading.Thread(target=self._serve, name="instant-node", daemon=True).start()

    def _serve(self) -> None:
        import socket
        import struct

        from tabby_node import ACCEPT

        answer = ACCEPT + struct.pack("!III", 0, 0, 0)
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:  # closed
                return
            with conn:
                _msg, fds, _flags, _addr = socket.recv_fds(conn, 65536, 2)
                for fd in fds:
                    os.close(fd)
                conn.sendall(answer)

    def close(self) -> None:
        self.sock.close()


def forwarded_call(node: InstantNode) -> tuple[list[str], dict[str, str], bytes]:
    """The argv, environment and stdin of a CHECK the installed plugin forwards to ``node``."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "CNI_COMMAND": "CHECK",
        "CNI_CONTAINERID": "client-floor",
        "CNI_NETNS": "/proc/self/ns/net",
        "CNI_IFNAME": "eth0",
        "CNI_PATH": os.path.dirname(PLUGIN),
        "TABBY_NODE_SOCKET": node.path,
    }
    return [PLUGIN], env, FORWARDED_CONF


def compare(rounds: int) -> None:
    """``--compare``: the programs below, one after the other, ``rounds`` times."""
    import resource
    import tempfile
    import time

    from bench.stats import pct

    python = getattr(sys, "_base_executable", sys.executable)
    programs = {
        "the interpreter (-I -S)": [
            python,
            "-I",
            "-S",
            "-c",
            SERVED_PATH.format(root=str(ROOT), more=""),
        ],
        "+ the served call's imports": [
            python,
            "-I",
            "-S",
            "-c",
            SERVED_PATH.format(root=str(ROOT), more=SERVED_IMPORTS),
        ],
        # PyInstaller's bootstrap imports ctypes in every process of a bundle that holds it
        # (pyimod03_ctypes.install); tabby's does (dataplane.netns, pyroute2), the floor not
        "+ ctypes": [
            python,
            "-I",
            "-S",
            "-c",
            SERVED_PATH.format(root=str(ROOT), more=SERVED_IMPORTS + "; import ctypes"),
        ],
        **{name: [build(name=name)] for name in VARIANTS},
    }
    directory = tempfile.mkdtemp(prefix="tabby-client-floor-")
    node = InstantNode(directory)
    calls: dict[str, tuple[list[str], dict[str, str] | None, bytes | None]] = {
        name: (argv, None, None) for name, argv in programs.items()
    }
    if os.path.exists(PLUGIN):
        calls["the plugin, forwarding"] = forwarded_call(node)
    cpu: dict[str, list[float]] = {k: [] for k in calls}
    wall: dict[str, list[float]] = {k: [] for k in calls}
    try:
        for _ in range(rounds):
            for name, (argv, env, stdin) in calls.items():
                before = resource.getrusage(resource.RUSAGE_CHILDREN)
                t0 = time.perf_counter()
                subprocess.run(argv, input=stdin, env=env, capture_output=True, check=True)
                wall[name].append((time.perf_counter() - t0) * 1000)
                after = resource.getrusage(resource.RUSAGE_CHILDREN)
                used = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
                cpu[name].append(used * 1000)
    finally:
        node.close()
        shutil.rmtree(directory, ignore_errors=True)
    print(
        f"client floor, what it is made of: {rounds} interleaved rounds, ms per process "
        f"(CPU p10 is the least disturbed by the load); load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'program':30} {'cpu p10':>8} {'cpu p50':>8} {'wall p50':>9}")
    for name in calls:
        print(
            f"{name:30} {pct(cpu[name], 10):8.1f} {pct(cpu[name], 50):8.1f} "
            f"{pct(wall[name], 50):9.1f}"
        )
    print(f"load {os.getloadavg()[0]:.2f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rebuild", action="store_true")
    ap.add_argument("--compare", type=int, metavar="N", help="time what the floor is made of")
    record.add_argument(ap, "client_floor")
    args = ap.parse_args()
    try:
        if args.compare:
            if args.rebuild:
                for name in VARIANTS:
                    build(True, name)
            compare(args.compare)
        else:
            print(build(args.rebuild))
    except RuntimeError as e:
        print(f"client_floor: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(record.run(main, "client_floor"))
