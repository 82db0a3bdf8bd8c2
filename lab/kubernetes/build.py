#!/usr/bin/env python3
"""Build Kubernetes' server binaries from Debian's own source package, cached outside the checkout.

    python3 lab/kubernetes/build.py [--cache-dir DIR] [--print-dir] [--force]
    python3 -m lab.kubernetes.build ...

No package registry reachable from the lab machines ships kube-apiserver or a kubelet, but
Debian bookworm's ``kubernetes`` source package (1.20.5+really1.20.2, of which bookworm only
ships kubectl as ``kubernetes-client``) builds with Debian's Go 1.19. This script:

* installs the build dependencies (``golang-go``, ``rsync``, ``make``, ``dpkg-dev``,
  ``golang-github-modern-go-reflect2-dev``) with apt-get;
* derives a ``deb-src`` entry from the machine's own apt sources (same mirror as the
  ``deb ... bookworm main`` entry), writes it to a file of its own under
  /etc/apt/sources.list.d/, runs an ``apt-get update`` restricted to that file, fetches the
  source with ``apt-get source`` into a temporary directory, then removes the file and the
  index files that update added;
* replaces the vendored ``github.com/modern-go/reflect2`` v1.0.1 (it crashes under Go 1.19:
  json-iterator segfaults encoding a map) with Debian's packaged copy;
* runs ``make WHAT="cmd/kube-apiserver ..."`` with ``GOPROXY=off CGO_ENABLED=0`` and the
  ``KUBE_GIT_*`` variables the tarball cannot provide (derived from the Debian version);
* copies kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and kubectl (the
  lab's client: the same version as the server, whatever kubectl the machine has) into
  ``<root>/<debian version>/bin`` (written as ``bin.tmp``, checked with ``--version``, then
  renamed), beside ``BUILD-INFO`` and ``build.log``.

It builds only when that ``bin`` directory is missing (or with --force), under an flock on
``<root>/.lock``; the temporary tree (peak ~3.5 GB) is removed also on failure and Ctrl-C. A full
build takes about 7 minutes on 2 cores. Building needs root; using a built cache does not.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import os
import pwd
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import IO, NamedTuple

from debbuild import (
    APT_SOURCES_DIR,
    SUITE,
    AptSource,
    SourcesError,
    cache_lock,
    compare_debian_versions,
    machine_apt_sources,
    render_deb822,
    suite_entries,
)

DEFAULT_ROOT = "/var/cache/tabby/kubernetes"
BINARIES = ("kube-apiserver", "kube-controller-manager", "kube-scheduler", "kubelet", "kubectl")
SOURCE_PACKAGE = "kubernetes"
CLIENT_PACKAGE = "kubernetes-client"  # kubectl; its Source/Version name the source to build
BUILD_PACKAGES = (
    "golang-go",
    "rsync",
    "make",
    "dpkg-dev",
    "golang-github-modern-go-reflect2-dev",
)
REFLECT2_PACKAGE = "golang-github-modern-go-reflect2-dev"
REFLECT2_DIR = Path("/usr/share/gocode/src/github.com/modern-go/reflect2")
VENDORED_REFLECT2 = Path("vendor/github.com/modern-go/reflect2")
DEBIAN_GO_BIN = Path("/usr/lib/go/bin")
APT_LISTS_DIR = Path("/var/lib/apt/lists")
SRC_LIST_PREFIX = "tabby-kubernetes-build-"
TEMP_PREFIX = "tabby-kubernetes-build."
TEMP_BYTES_NEEDED = 5_000_000_000  # peak ~3.5 GB measured (2.8 GB left at the end), plus room
CACHE_BYTES_NEEDED = 500_000_000  # the four binaries are ~360 MB
PREFIX = "build-kubernetes:"
LOG_TAIL_LINES = 40
HEARTBEAT_SECONDS = 60.0

Log = Callable[[str], None]


class BuildError(RuntimeError):
    """The build could not be done; the message says why (and where the log is)."""


class KubeVersion(NamedTuple):
    git_version: str  # "v1.20.2"
    major: str
    minor: str


# --- versions ---------------------------------------------------------------------------------

_VERSION_RE = re.compile(r"^[0-9][A-Za-z0-9.+~:-]*$")


def kube_version(debian_version: str) -> KubeVersion:
    """The upstream Kubernetes version a Debian version builds: the part after "really" if any.

    >>> kube_version("1.20.5+really1.20.2-1.1+deb12u1")
    KubeVersion(git_version='v1.20.2', major='1', minor='20')
    """
    upstream = debian_version.split(":", 1)[-1].rsplit("-", 1)[0]
    m = re.match(r"(\d+)\.(\d+)\.(\d+)", upstream.rsplit("really", 1)[-1])
    if not m:
        raise BuildError(f"no upstream x.y.z in Debian version {debian_version!r}")
    return KubeVersion(f"v{m[1]}.{m[2]}.{m[3]}", m[1], m[2])


def _check_version(version: str) -> str:
    if not _VERSION_RE.match(version):
        raise BuildError(f"not a Debian version: {version!r}")
    return version


def candidate_version() -> str | None:
    """The version of the ``kubernetes`` source apt would install kubectl from, or None."""
    proc = subprocess.run(
        ["apt-cache", "show", "--no-all-versions", CLIENT_PACKAGE],
        capture_output=True,
        text=True,
        check=False,
    )
    fields: dict[str, str] = {}
    for line in proc.stdout.splitlines():
        if not line.strip():
            break  # only the candidate's record
        key, sep, value = line.partition(":")
        if sep and not key.startswith(" "):
            fields[key] = value.strip()
    if proc.returncode != 0 or "Version" not in fields:
        return None
    # "Source: kubernetes (1.2-3)" names the source version of a binNMU; else it is Version.
    m = re.match(r"(\S+)(?:\s+\((\S+)\))?$", fields.get("Source", SOURCE_PACKAGE))
    if not m or m[1] != SOURCE_PACKAGE:
        raise BuildError(f"{CLIENT_PACKAGE} does not come from source {SOURCE_PACKAGE}: {m}")
    return _check_version(m[2] or fields["Version"])


# --- the cache --------------------------------------------------------------------------------


def cache_dir(version: str | None = None, root: str = DEFAULT_ROOT) -> Path:
    """The directory holding ``bin/<the four binaries>`` built from that Debian source version
    (None: the candidate version apt knows now). It may not exist yet."""
    if version is None:
        version = candidate_version()
        if version is None:
            raise BuildError(f"apt knows no candidate for {CLIENT_PACKAGE} (apt-get update?)")
    return Path(root) / _check_version(version)


def _complete(bin_dir: Path) -> bool:
    return all(
        (bin_dir / name).is_file() and os.access(bin_dir / name, os.X_OK) for name in BINARIES
    )


def find_binaries(root: str = DEFAULT_ROOT) -> Path | None:
    """A complete cached bin directory (the newest Debian version first), or None. No apt call."""
    try:
        entries = list(Path(root).iterdir())
    except OSError:
        return None
    versions = [p.name for p in entries if _VERSION_RE.match(p.name) and _complete(p / "bin")]
    if not versions:
        return None
    newest = max(versions, key=functools.cmp_to_key(compare_debian_versions))
    return Path(root) / newest / "bin"


# --- processes ------------------------------------------------------------------------------


def _run(
    cmd: Sequence[str],
    out: IO[str],
    log: Log,
    *,
    cwd: Path | None = None,
    env: dict[str, str] | None = None,
    heartbeat: str | None = None,
) -> None:
    """Run cmd with its output appended to out; kill its process group if we are interrupted."""
    out.write(f"\n$ {shlex.join(cmd)}\n")
    out.flush()
    started = time.monotonic()
    proc = subprocess.Popen(
        list(cmd),
        cwd=cwd,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=out,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        while True:
            try:
                rc = proc.wait(timeout=HEARTBEAT_SECONDS)
                break
            except subprocess.TimeoutExpired:
                if heartbeat:
                    log(f"{PREFIX} {heartbeat}: {time.monotonic() - started:.0f} s so far")
    except BaseException:
        _kill_group(proc)
        raise
    if rc != 0:
        raise BuildError(f"{cmd[0]} {' '.join(cmd[1:3])} ... exited with status {rc}")


def _kill_group(proc: subprocess.Popen[bytes]) -> None:
    for sig, grace in ((signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _apt_env() -> dict[str, str]:
    return {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}


# --- packages -------------------------------------------------------------------------------


def _missing_packages(packages: Sequence[str]) -> list[str]:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Package} ${db:Status-Abbrev}\n", *packages],
        capture_output=True,
        text=True,
        check=False,
    )
    installed = {
        name
        for name, _, status in (line.partition(" ") for line in proc.stdout.splitlines())
        if status.startswith("ii")
    }
    return [p for p in packages if p not in installed]


def _has_candidate(package: str) -> bool:
    proc = subprocess.run(
        ["apt-cache", "policy", package], capture_output=True, text=True, check=False
    )
    m = re.search(r"^\s*Candidate:\s*(\S+)", proc.stdout, re.M)
    return bool(m and m[1] != "(none)")


_STALE_LISTS = re.compile(
    r"Failed to fetch|Unable to fetch|404\s+Not Found|Unable to locate package"
    r"|has no installation candidate"
)


def _install_packages(packages: Sequence[str], out: IO[str], log: Log) -> None:
    missing = _missing_packages(packages)
    if not missing:
        return
    updated = False
    if not all(_has_candidate(p) for p in missing):
        log(f"{PREFIX} apt-get update (apt knows no candidate for some of {' '.join(missing)})")
        _run(["apt-get", "update"], out, log, env=_apt_env())
        updated = True
    log(f"{PREFIX} apt-get install {' '.join(missing)}")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *missing]
    out.flush()
    offset = os.lseek(out.fileno(), 0, os.SEEK_CUR)
    try:
        _run(cmd, out, log, env=_apt_env())
    except BuildError:
        if updated or not _STALE_LISTS.search(_output_since(out, offset)):
            raise
        log(f"{PREFIX} apt's lists look stale: apt-get update and one more try")
        _run(["apt-get", "update"], out, log, env=_apt_env())
        _run(cmd, out, log, env=_apt_env())


def _output_since(out: IO[str], offset: int) -> str:
    out.flush()
    with open(out.name, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


# --- apt sources ----------------------------------------------------------------------------


def deb_src_entries(sources: Sequence[AptSource], suite: str = SUITE) -> list[AptSource]:
    """deb-src entries for `suite` and `suite`-updates (main), on the mirror that serves `suite`
    main, plus `suite`-security on its own mirror if the machine uses one."""
    try:
        return suite_entries(sources, suite, "deb-src")
    except SourcesError as e:
        raise BuildError(str(e)) from None


def _remove_stale_src_lists(log: Log) -> None:
    """Remove a deb-src file of ours left by a run that was killed (its pid is gone)."""
    with contextlib.suppress(OSError):
        for path in APT_SOURCES_DIR.glob(f"{SRC_LIST_PREFIX}*.sources"):
            pid = path.stem.removeprefix(SRC_LIST_PREFIX)
            if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
                log(f"{PREFIX} removing a leftover {path}")
                path.unlink(missing_ok=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _fetch_source(version: str, dest: Path, out: IO[str], log: Log) -> Path:
    """apt-get source kubernetes=<version> into dest; returns the unpacked tree."""
    _remove_stale_src_lists(log)
    entries = deb_src_entries(machine_apt_sources(skip_prefix=SRC_LIST_PREFIX))
    src_list = APT_SOURCES_DIR / f"{SRC_LIST_PREFIX}{os.getpid()}.sources"
    # Restrict apt to our file: the update fetches only our indexes and keeps everyone
    # else's lists; no cache file is written that mentions only our sources.
    restricted = [
        "-o", f"Dir::Etc::sourcelist={src_list}",
        "-o", "Dir::Etc::sourceparts=-",
        "-o", "APT::Get::List-Cleanup=0",
        "-o", "Dir::Cache::pkgcache=",
        "-o", "Dir::Cache::srcpkgcache=",
    ]  # fmt: skip
    lists_before = set(os.listdir(APT_LISTS_DIR)) if APT_LISTS_DIR.is_dir() else set()
    try:
        src_list.write_text(render_deb822(entries))
        suites = ", ".join(f"{' '.join(e.suites)}" for e in entries)
        log(f"{PREFIX} deb-src for {suites} (from the machine's apt sources) in {src_list}")
        _run(["apt-get", "update", *restricted], out, log, env=_apt_env())
        log(f"{PREFIX} apt-get source {SOURCE_PACKAGE}={version}")
        dest.mkdir()
        with contextlib.suppress(KeyError, OSError):
            os.chown(dest, pwd.getpwnam("_apt").pw_uid, -1)  # apt downloads as _apt
        _run(
            ["apt-get", *restricted, "source", f"{SOURCE_PACKAGE}={version}"],
            out,
            log,
            cwd=dest,
            env=_apt_env(),
        )
    finally:
        src_list.unlink(missing_ok=True)
        if APT_LISTS_DIR.is_dir():
            for name in set(os.listdir(APT_LISTS_DIR)) - lists_before:
                path = APT_LISTS_DIR / name
                if path.is_file():
                    path.unlink(missing_ok=True)
    trees = [p for p in dest.iterdir() if p.is_dir() and p.name.startswith(f"{SOURCE_PACKAGE}-")]
    if len(trees) != 1:
        raise BuildError(f"expected one unpacked {SOURCE_PACKAGE}-* tree in {dest}: {trees}")
    return trees[0]


# --- the build ------------------------------------------------------------------------------


def _package_version(package: str) -> str:
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip() or "?"


def _replace_reflect2(tree: Path, log: Log) -> None:
    vendored = tree / VENDORED_REFLECT2
    if not vendored.is_dir():
        raise BuildError(f"no {VENDORED_REFLECT2} in the source tree")
    new = sorted(
        p
        for p in REFLECT2_DIR.glob("*")
        if p.suffix in (".go", ".s") and not p.name.endswith("_test.go") and p.is_file()
    )
    if not new:
        raise BuildError(f"no Go files in {REFLECT2_DIR} ({REFLECT2_PACKAGE} installed?)")
    for p in vendored.iterdir():
        if p.suffix in (".go", ".s"):
            p.unlink()
    for p in new:
        shutil.copyfile(p, vendored / p.name)
    log(
        f"{PREFIX} vendored reflect2 replaced by {REFLECT2_PACKAGE} "
        f"{_package_version(REFLECT2_PACKAGE)} ({len(new)} files)"
    )


def _go_env(version: str, kv: KubeVersion, tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("GO", "KUBE_", "CGO_"))}
    path = env.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
    if DEBIAN_GO_BIN.is_dir():
        path = f"{DEBIAN_GO_BIN}:{path}"  # Debian's Go, whatever else is on PATH
    commit = hashlib.sha1(  # a fixed stand-in: the tarball has no git metadata
        f"debian:{SOURCE_PACKAGE}:{version}".encode(), usedforsecurity=False
    ).hexdigest()
    env.update(
        PATH=path,
        GOPROXY="off",
        GOFLAGS="-mod=vendor",
        CGO_ENABLED="0",
        GOCACHE=str(tmp / "gocache"),
        GOPATH=str(tmp / "gopath"),
        TMPDIR=str(tmp / "tmp"),  # go's work and link files, too
        KUBE_GIT_VERSION=kv.git_version,
        KUBE_GIT_MAJOR=kv.major,
        KUBE_GIT_MINOR=kv.minor,
        KUBE_GIT_TREE_STATE="clean",
        KUBE_GIT_COMMIT=commit,
    )
    return env


def _go_version(env: dict[str, str]) -> str:
    proc = subprocess.run(["go", "version"], env=env, capture_output=True, text=True, check=False)
    return proc.stdout.strip() or "?"


def _built(tree: Path, name: str) -> Path:
    for candidate in (tree / "_output" / "bin" / name, *tree.glob(f"_output/local/bin/*/*/{name}")):
        if candidate.is_file():
            return candidate
    raise BuildError(f"make succeeded but {name} is not under {tree / '_output'}")


def _disk_bytes(top: Path) -> int:
    seen: set[tuple[int, int]] = set()
    total = 0
    for dirpath, dirnames, filenames in os.walk(top):
        for name in dirnames + filenames:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_blocks * 512
    return total


def _temp_parent(repo: Path) -> Path:
    candidates = [os.environ.get("TMPDIR"), "/var/tmp", tempfile.gettempdir()]
    tried = []
    for c in candidates:
        if not c or not os.path.isdir(c):
            continue
        p = Path(c).resolve()
        if p == repo or repo in p.parents:
            continue  # never inside the checkout
        free = shutil.disk_usage(p).free
        if free >= TEMP_BYTES_NEEDED:
            return p
        tried.append(f"{p} ({free / 1e9:.1f} GB free)")
    raise BuildError(
        f"the build needs {TEMP_BYTES_NEEDED / 1e9:.1f} GB of temporary disk: "
        f"{', '.join(tried) or 'no candidate'}; set TMPDIR"
    )


def _install_binaries(tree: Path, dest: Path, kv: KubeVersion, log: Log) -> None:
    staging = dest / "bin.tmp"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    for name in BINARIES:
        target = staging / name
        shutil.copyfile(_built(tree, name), target)
        target.chmod(0o755)
        asks = ["version", "--client"] if name == "kubectl" else ["--version"]
        proc = subprocess.run(
            [str(target), *asks], capture_output=True, text=True, check=False, timeout=60
        )
        said = (proc.stdout + proc.stderr).strip()
        if kv.git_version not in said:
            raise BuildError(f"{name} --version said {said!r}, not Kubernetes {kv.git_version}")
    final = dest / "bin"
    old = dest / "bin.old"
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    staging.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def _tail(path: Path, lines: int = LOG_TAIL_LINES) -> list[str]:
    try:
        with open(path, errors="replace") as f:
            return f.read().splitlines()[-lines:]
    except OSError:
        return []


def _build(version: str, root: Path, log: Log) -> Path:
    started = time.monotonic()
    started_at = datetime.now(UTC)
    kv = kube_version(version)
    dest = cache_dir(version, str(root))
    dest.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(dest).free
    if free < CACHE_BYTES_NEEDED:
        raise BuildError(f"{dest} has {free / 1e6:.0f} MB free, the binaries need ~400 MB")
    repo = Path(__file__).resolve().parents[2]
    log_path = dest / "build.log"
    marker = dest / "build.tmpdir"  # the temp tree of a run in progress (or killed)
    with contextlib.suppress(OSError):
        stale = Path(marker.read_text().strip())
        if stale.name.startswith(TEMP_PREFIX) and stale.is_dir():
            log(f"{PREFIX} removing a killed build's {stale}")
            shutil.rmtree(stale, ignore_errors=True)
    log(
        f"{PREFIX} building {SOURCE_PACKAGE} {version} (Kubernetes {kv.git_version}) "
        f"into {dest}; make output in {log_path}"
    )
    with open(log_path, "w") as out:
        try:
            _install_packages(BUILD_PACKAGES, out, log)
            tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=_temp_parent(repo)))
            marker.write_text(f"{tmp}\n")
            try:
                tmp.chmod(0o755)  # so apt's sandbox user (_apt) may reach tmp/src
                log(f"{PREFIX} temporary tree {tmp}")
                tree = _fetch_source(version, tmp / "src", out, log)
                _replace_reflect2(tree, log)
                env = _go_env(version, kv, tmp)
                Path(env["TMPDIR"]).mkdir()
                go = _go_version(env)
                what = " ".join(f"cmd/{name}" for name in BINARIES)
                log(f"{PREFIX} make WHAT='{what}' with {go} (~7 min on 2 cores)")
                make_started = time.monotonic()
                _run(
                    ["make", f"WHAT={what}", "GOLDFLAGS=-s -w"],
                    out,
                    log,
                    cwd=tree,
                    env=env,
                    heartbeat="make",
                )
                make_seconds = time.monotonic() - make_started
                temp_bytes = _disk_bytes(tmp)
                info = [
                    f"what: {', '.join(BINARIES)} from Debian source package "
                    f"{SOURCE_PACKAGE} {version} (Kubernetes {kv.git_version})",
                    f"built: {started_at.isoformat(timespec='seconds')}",
                    f"seconds: {time.monotonic() - started:.0f} (make: {make_seconds:.0f})",
                    f"go: {go}",
                    f"reflect2: vendored copy replaced by {REFLECT2_PACKAGE} "
                    f"{_package_version(REFLECT2_PACKAGE)}",
                    f"env: GOPROXY=off CGO_ENABLED=0 KUBE_GIT_VERSION={kv.git_version} "
                    f"KUBE_GIT_COMMIT={env['KUBE_GIT_COMMIT']}",
                    f"make: make WHAT='{what}' GOLDFLAGS='-s -w'",
                    f"temporary disk after make: {temp_bytes / 1e9:.2f} GB",
                    f"host: {os.uname().nodename} {os.uname().machine} {os.cpu_count()} cpus",
                ]
                tmp_info = dest / "BUILD-INFO.tmp"
                tmp_info.write_text("\n".join(info) + "\n")
                tmp_info.rename(dest / "BUILD-INFO")
                _install_binaries(tree, dest, kv, log)
            finally:
                log(f"{PREFIX} removing {tmp}")
                shutil.rmtree(tmp, ignore_errors=True)
                marker.unlink(missing_ok=True)
        except BuildError:
            out.flush()
            log(f"{PREFIX} last lines of {log_path}:")
            for line in _tail(log_path):
                log(f"{PREFIX} | {line}")
            raise
    log(
        f"{PREFIX} done in {time.monotonic() - started:.0f} s "
        f"({temp_bytes / 1e9:.1f} GB temporary disk): {dest / 'bin'}"
    )
    return dest / "bin"


def ensure(root: str = DEFAULT_ROOT, log: Log = print, *, force: bool = False) -> Path:
    """The bin directory of the binaries for apt's candidate version, built if missing."""
    version = candidate_version()
    if version is None and os.geteuid() == 0:
        log(f"{PREFIX} apt knows no {CLIENT_PACKAGE}: apt-get update")
        subprocess.run(
            ["apt-get", "update"], env=_apt_env(), check=False, stdout=subprocess.DEVNULL
        )
        version = candidate_version()
    if version is None:
        raise BuildError(f"apt knows no candidate for {CLIENT_PACKAGE}")
    bin_dir = cache_dir(version, root) / "bin"
    if not force and _complete(bin_dir):
        return bin_dir
    if os.geteuid() != 0:
        raise BuildError(f"{bin_dir} is missing and building it needs root (apt-get)")
    lock = Path(root) / ".lock"
    with cache_lock(lock, log, f"{PREFIX} waiting for another build ({lock})"):
        if not force and _complete(bin_dir):
            log(f"{PREFIX} another run built {bin_dir}")
            return bin_dir
        return _build(version, Path(root), log)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="build.py",
        description="Build kube-apiserver, kube-controller-manager, kube-scheduler, kubelet and "
        "kubectl "
        "from Debian's kubernetes source package, cached by its version; only if missing.",
    )
    parser.add_argument(
        "--cache-dir",
        default=DEFAULT_ROOT,
        metavar="DIR",
        help=f"cache root (default {DEFAULT_ROOT})",
    )
    parser.add_argument(
        "--print-dir",
        action="store_true",
        help="print the bin directory on stdout (progress goes to stderr)",
    )
    parser.add_argument("--force", action="store_true", help="build even if already cached")
    args = parser.parse_args(argv)
    stream = sys.stderr if args.print_dir else sys.stdout

    def log(message: str) -> None:
        print(message, file=stream, flush=True)

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        raise SystemExit(128 + signum)  # so the temporary tree is removed on the way out

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    try:
        bin_dir = ensure(args.cache_dir, log, force=args.force)
    except BuildError as e:
        log(f"{PREFIX} error: {e}")
        return 1
    except KeyboardInterrupt:
        log(f"{PREFIX} interrupted")
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)
    if args.print_dir:
        print(bin_dir)
    else:
        log(f"{PREFIX} binaries in {bin_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
