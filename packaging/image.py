#!/usr/bin/env python3
"""The container image ``tabby:<version>``: a minimal Debian root and the frozen bundle, as
an OCI image layout archive that ``ctr -n k8s.io images import`` and ``podman load`` accept
(many clusters reach no registry: the archive is carried to the nodes).

    .venv/bin/python packaging/image.py [--bundle build/dist/tabby] [--name localhost/tabby]
        [--tag VERSION] [--out build/tabby-<tag>.oci.tar] [--cache-dir DIR] [--rebuild-root]

``./build.sh --image`` runs it on the bundle it froze. It prints the image's reference on
stdout (progress and sizes on stderr). The reference is ``<name>:<tag>``: ``--name`` (or
``TABBY_IMAGE_NAME``, default ``localhost/tabby``) and ``--tag`` (or ``TABBY_IMAGE_TAG``,
default the bundle's version), so a second tag of the same content is one more run.

Two layers, lowest first:

1. **the Debian root**, made by Debian's own ``mmdebstrap`` (unshare mode: its mounts die
   with it) from the machine's own mirror (the ``deb`` entries of its apt sources for SUITE,
   -updates and -security, derived by packaging/debbuild.py as the lab's Kubernetes build
   derives its deb-src entry): variant ``essential`` (the ``Essential: yes`` packages; no apt)
   with merged /usr, plus ``bird2``, ``nftables`` and ``iproute2`` and what they depend on,
   without Recommends. dpkg leaves out documentation (copyright files kept), man and info
   pages, translations and lintian overrides; what a bootstrap leaves that an image must not
   carry goes afterwards (apt's sources, lists and caches, which no package owns here, the
   build machine's hostname and resolv.conf, ``-old`` and ``-`` backups). Built once per
   (suite, packages, recipe) under ``<cache-dir>/<key>/``: ``root/`` (the tree), ``root.json``
   (how and when it was made), ``layer-v<format>.tar.gz`` and its ``.json`` (its layer, packed
   once per packing format), ``packages.txt`` (what is installed, with sizes) and
   ``mmdebstrap.log``. The packages are those of the mirror on the day the root was made:
   ``--rebuild-root`` makes it again (security updates).
2. **the bundle**: ``/opt/tabby`` (the onedir bundle, root-owned, modes 0755/0644),
   ``/usr/local/bin/{tabby-node,tabbyctl,tabby-kube-controllers,tabby-typha}`` and
   ``/opt/cni/bin/{tabby,tabby-ipam}``, symlinks to ``/opt/tabby/tabby``: the installed
   layout of build.sh, so an init container can copy ``/opt/tabby`` to the host as it is.

The bundle's native code was linked against this machine's glibc, so the root's glibc must
be at least as new (checked: freeze on SUITE). The same holds for the hosts the install step
copies ``/opt/tabby`` to (glibc 2.35 for a bookworm-built bundle).

Entrypoint ``/usr/local/bin/tabby-node``. Both layers are deterministic (entries in name
order, mtime 0, numeric owners, gzip without name or time): the same root and bundle give
the same archive, byte for byte; a changed bundle changes only the second layer.

Packed by the OCI packer beside this file (``ocipack.py``), from the machine's apt sources
as ``debbuild.py`` reads them: build tooling, shared with the repository's lab, not shipped.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))  # also when loaded from a file by the tests

import debbuild  # noqa: E402
from ocipack import (  # noqa: E402
    Layer,
    add_entry,
    add_tree,
    write_layer,
    write_oci_archive,
)

SUITE = debbuild.SUITE
VARIANT = "essential"
#: What tabby-node runs in a pod, besides the bundle: BIRD 2, nft and libnftables, ip.
PACKAGES = ("bird2", "iproute2", "nftables")
DPKG_OPTIONS = (
    "path-exclude=/usr/share/doc/*",
    "path-include=/usr/share/doc/*/copyright",
    "path-exclude=/usr/share/man/*",
    "path-exclude=/usr/share/info/*",
    "path-exclude=/usr/share/locale/*",
    "path-exclude=/usr/share/lintian/*",
)
MERGED_USR_HOOK = Path("/usr/share/mmdebstrap/hooks/merged-usr")
#: mmdebstrap's clock (bookworm's release day, 2023-06-10): the one date a root records
#: (the last-change day of every account in /etc/shadow), so the same mirror content makes
#: the same root on any day.
SOURCE_DATE_EPOCH = 1686355200
#: Bump when the root's recipe changes (part of the cache key: a new root is made).
ROOT_FORMAT = "1"
#: Bump when the root's layer is packed differently (the cached root is packed again).
LAYER_FORMAT = "2"
DEFAULT_CACHE = "/var/cache/tabby/image-root"
DEFAULT_NAME = "localhost/tabby"
DEFAULT_BUNDLE = REPO / "build" / "dist" / "tabby"
GZIP_LEVEL = 6

BUNDLE_DIR = "opt/tabby"
EXECUTABLE = "/opt/tabby/tabby"
LINKS = (
    "opt/cni/bin/tabby",
    "opt/cni/bin/tabby-ipam",
    "usr/local/bin/tabby-kube-controllers",
    "usr/local/bin/tabby-node",
    "usr/local/bin/tabby-typha",
    "usr/local/bin/tabbyctl",
)
ENTRYPOINT = ("/usr/local/bin/tabby-node",)
ENV = ("PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",)
#: Directories whose contents a root layer never carries (the runtime provides them).
PRUNE = ("dev", "proc", "sys")
#: apt's directories: what no package owns in them is the bootstrap's, not the image's.
APT_DIRS = ("etc/apt", "var/lib/apt", "var/cache/apt", "var/log/apt")
#: The build machine's files that mmdebstrap copies in; the runtime provides its own.
MACHINE_FILES = ("etc/hostname", "etc/resolv.conf")
BACKUPS = tuple(
    f"etc/{name}-" for name in ("passwd", "group", "shadow", "gshadow", "subuid", "subgid")
)
OLD_DIRS = ("var/cache/debconf", "var/lib/dpkg")

_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}")
_COMPONENT = r"[a-z0-9]+(?:[._-]+[a-z0-9]+)*"
_NAME = re.compile(rf"(?:[A-Za-z0-9.-]+(?::[0-9]+)?/)?{_COMPONENT}(?:/{_COMPONENT})*")
_OCI_ARCH = {
    "amd64": "amd64",
    "arm64": "arm64",
    "armhf": "arm",
    "i386": "386",
    "ppc64el": "ppc64le",
    "s390x": "s390x",
    "riscv64": "riscv64",
}

Log = Callable[[str], None]


class ImageError(RuntimeError):
    """The image could not be built; the message says why and what to do."""


def _stderr(message: str) -> None:
    print(f"image: {message}", file=sys.stderr, flush=True)


# -- naming ----------------------------------------------------------------------------------------


def reference(name: str, tag: str) -> str:
    """``name:tag`` after checking both (a registry host and port may lead the name)."""
    if not _NAME.fullmatch(name):
        raise ImageError(f"not an image name: {name!r} (e.g. localhost/tabby, registry:5000/x)")
    if not _TAG.fullmatch(tag):
        raise ImageError(f"not an image tag: {tag!r} (letters, digits, '_', '.', '-')")
    return f"{name}:{tag}"


def bundle_version(bundle: Path) -> str:
    """The version the bundle says it is (``tabbyctl version``): also proves it runs."""
    exe = bundle / "tabby"
    if not os.access(exe, os.X_OK):
        raise ImageError(f"no bundle at {bundle} ({exe} missing): run ./build.sh first")
    proc = subprocess.run(
        ["tabbyctl", "version", "-o", "json"],
        executable=exe,
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
    )
    try:
        version = json.loads(proc.stdout)["version"]
    except (ValueError, KeyError, TypeError):
        raise ImageError(
            f"{exe} as tabbyctl version failed ({proc.returncode}): {proc.stderr.strip()[-500:]}"
        ) from None
    return str(version)


def architecture() -> str:
    """The OCI architecture of this machine's Debian (the bundle's and the root's)."""
    proc = subprocess.run(
        ["dpkg", "--print-architecture"], capture_output=True, text=True, check=False
    )
    arch = proc.stdout.strip()
    if arch not in _OCI_ARCH:
        raise ImageError(f"no OCI architecture for Debian's {arch or '?'!r}")
    return _OCI_ARCH[arch]


# -- the Debian root -------------------------------------------------------------------------------


def root_key(arch: str) -> str:
    """The cache key of the root: everything that decides what mmdebstrap makes (the mirror
    does not: any mirror of SUITE serves the same packages)."""
    h = hashlib.sha256()
    parts = (ROOT_FORMAT, SUITE, VARIANT, arch, str(SOURCE_DATE_EPOCH), *sorted(PACKAGES))
    for part in (*parts, *DPKG_OPTIONS):
        h.update(part.encode() + b"\0")
    return h.hexdigest()


def sources_text() -> str:
    """deb822 ``deb`` entries for SUITE, -updates and -security from the machine's sources."""
    try:
        entries = debbuild.suite_entries(debbuild.machine_apt_sources(), SUITE, "deb")
    except debbuild.SourcesError as e:
        raise ImageError(str(e)) from None
    return debbuild.render_deb822(entries)


def mmdebstrap_command(target: Path, sources: Path) -> list[str]:
    return [
        "mmdebstrap",
        "--mode=unshare",
        f"--variant={VARIANT}",
        "--format=directory",
        f"--hook-dir={MERGED_USR_HOOK}",
        '--aptopt=APT::Install-Recommends "false"',
        f"--include={','.join(PACKAGES)}",
        *(f"--dpkgopt={option}" for option in DPKG_OPTIONS),
        SUITE,
        str(target),
        str(sources),
    ]


def _owned_paths(root: Path) -> set[str]:
    """Every path some installed package owns (from dpkg's file lists), without the root."""
    owned: set[str] = set()
    for listing in (root / "var/lib/dpkg/info").glob("*.list"):
        owned.update(line.strip() for line in listing.read_text(errors="replace").splitlines())
    return owned


def trim(root: Path) -> list[str]:
    """Remove what a bootstrap leaves that an image must not carry; what was removed."""
    removed: list[str] = []

    def remove(path: Path) -> None:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append("/" + str(path.relative_to(root)))

    owned = _owned_paths(root)
    for top in APT_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        # Deepest first, so a directory is judged after its contents.
        for dirpath, _, filenames in sorted(os.walk(base), key=lambda w: -len(w[0])):
            here = Path(dirpath)
            for name in filenames:
                path = here / name
                if "/" + str(path.relative_to(root)) not in owned:
                    remove(path)
            rel = "/" + str(here.relative_to(root))
            if rel not in owned and not any(here.iterdir()):
                remove(here)
    for rel in (*MACHINE_FILES, *BACKUPS):
        path = root / rel
        if path.is_file() or path.is_symlink():
            remove(path)
    for rel in OLD_DIRS:
        for path in sorted((root / rel).glob("*-old")):
            remove(path)
    return removed


def installed_packages(root: Path) -> list[tuple[str, str, int]]:
    """(package, version, installed KiB) of every package in root, largest first."""
    proc = subprocess.run(
        [
            "dpkg-query",
            f"--admindir={root / 'var/lib/dpkg'}",
            "-W",
            "-f=${Package} ${Version} ${Installed-Size}\\n",
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise ImageError(f"dpkg-query in {root} failed: {proc.stderr.strip()}")
    rows = []
    for line in proc.stdout.splitlines():
        parts = line.split()
        if len(parts) >= 2:
            size = parts[2] if len(parts) > 2 and parts[2].isdigit() else "0"
            rows.append((parts[0], parts[1], int(size)))
    return sorted(rows, key=lambda r: (-r[2], r[0]))


@dataclass(frozen=True)
class Root:
    """A cached root: its tree, its layer, and what it holds."""

    dir: Path
    layer: Layer
    file_bytes: int
    packages: list[tuple[str, str, int]]
    made: bool = False  # the tree was made by this run
    packed: bool = False  # the layer was packed by this run


def _run_logged(cmd: Sequence[str], log_path: Path, env: dict[str, str] | None = None) -> None:
    """Run cmd with its output in log_path; its whole process group goes if we are stopped."""
    with open(log_path, "w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(
            list(cmd),
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            rc = proc.wait()
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, 9)
                proc.wait()
            raise
    if rc != 0:
        tail = log_path.read_text(errors="replace").splitlines()[-25:]
        raise ImageError(
            f"{cmd[0]} exited with status {rc}; last lines of {log_path}:\n" + "\n".join(tail)
        )


def _layer_files(here: Path) -> tuple[Path, Path]:
    return here / f"layer-v{LAYER_FORMAT}.tar.gz", here / f"layer-v{LAYER_FORMAT}.json"


def _cached(here: Path) -> Root | None:
    """The root in ``here`` if it is complete and packed in the current layer format."""
    path, meta = _layer_files(here)
    try:
        info = json.loads(meta.read_text())
        layer = Layer(path, info["digest"], int(info["size"]), info["diff_id"], info["media_type"])
        if path.stat().st_size != layer.size or not (here / "root.json").is_file():
            return None
        return Root(here, layer, int(info["file_bytes"]), _packages_from(here))
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _packages_from(here: Path) -> list[tuple[str, str, int]]:
    rows = []
    with contextlib.suppress(OSError, ValueError):
        for line in (here / "packages.txt").read_text().splitlines():
            name, version, size = line.split()
            rows.append((name, version, int(size)))
    return rows


def ensure_root(cache: Path, arch: str, log: Log, *, rebuild: bool = False) -> Root:
    """The Debian root and its layer: made when missing (or when ``rebuild``), packed again
    when only the layer's format changed."""
    here = cache / root_key(arch)[:16]
    if not rebuild and (found := _cached(here)):
        return found
    if os.geteuid() != 0:
        raise ImageError(f"{here} is missing or incomplete; making it needs root (mmdebstrap)")
    lock = cache / ".lock"
    with debbuild.cache_lock(lock, log, f"waiting for another build of the root ({lock})"):
        if not rebuild and (found := _cached(here)):
            log(f"another run made the root in {here}")
            return found
        made = rebuild or not (here / "root.json").is_file()
        if made:
            _make_root(here, log)
        return _pack_root(here, log, made=made)


def _make_root(here: Path, log: Log) -> None:
    if shutil.which("mmdebstrap") is None:
        raise ImageError("mmdebstrap is missing: apt-get install mmdebstrap")
    if not MERGED_USR_HOOK.is_dir():
        raise ImageError(f"{MERGED_USR_HOOK} is missing (mmdebstrap >= 1.1 has it)")
    started = time.monotonic()
    here.mkdir(parents=True, exist_ok=True)
    here.chmod(0o755)
    (here / "root.json").unlink(missing_ok=True)
    tmp = here / "root.tmp"
    shutil.rmtree(tmp, ignore_errors=True)  # a killed run's
    sources = here / "sources.sources"
    sources.write_text(sources_text())
    log_path = here / "mmdebstrap.log"
    log(
        f"making the Debian root ({SUITE}, {VARIANT} + {' '.join(PACKAGES)}) with mmdebstrap "
        f"from the machine's mirror into {here} (log: {log_path})"
    )
    try:
        env = {**os.environ, "SOURCE_DATE_EPOCH": str(SOURCE_DATE_EPOCH)}
        _run_logged(mmdebstrap_command(tmp, sources), log_path, env)
        removed = trim(tmp)
        log(f"trimmed {len(removed)} paths no image needs: {' '.join(removed)}")
        packages = installed_packages(tmp)
        final = here / "root"
        if final.exists():
            shutil.rmtree(final)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        sources.unlink(missing_ok=True)
    (here / "packages.txt").write_text("".join(f"{n} {v} {s}\n" for n, v, s in packages))
    info = {
        "made": datetime.now(UTC).isoformat(timespec="seconds"),
        "seconds": round(time.monotonic() - started, 1),
        "command": mmdebstrap_command(Path("root"), Path("sources.sources")),
        "packages": len(packages),
        "removed": removed,
    }
    _write_json(here / "root.json", info)  # last: marks the root complete
    log(f"root made in {time.monotonic() - started:.1f} s: {len(packages)} packages")


def _pack_root(here: Path, log: Log, *, made: bool) -> Root:
    path, meta = _layer_files(here)
    for old in here.glob("layer-v*"):
        if old not in (path, meta):
            old.unlink()
    started = time.monotonic()
    file_bytes = 0

    def fill(tar: tarfile.TarFile) -> None:
        nonlocal file_bytes
        file_bytes = add_tree(tar, here / "root", "", prune=PRUNE)

    layer = write_layer(path, fill, gzip_level=GZIP_LEVEL)
    info = {
        "digest": layer.digest,
        "size": layer.size,
        "diff_id": layer.diff_id,
        "media_type": layer.media_type,
        "file_bytes": file_bytes,
    }
    _write_json(meta, info)
    if not made:
        log(
            f"root layer packed again (format {LAYER_FORMAT}) in {time.monotonic() - started:.1f} s"
        )
    return Root(here, layer, file_bytes, _packages_from(here), made=made, packed=True)


def _write_json(path: Path, info: dict[str, object]) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(info, indent=2) + "\n")
    tmp.rename(path)


def _upstream(version: str) -> str:
    return version.split(":", 1)[-1].rsplit("-", 1)[0]


def machine_glibc() -> str:
    """The Debian version of this machine's libc6 (the bundle's native code links to it)."""
    proc = subprocess.run(
        ["dpkg-query", "-W", "-f=${Version}", "libc6"], capture_output=True, text=True, check=False
    )
    return proc.stdout.strip()


def check_glibc(machine: str, root: Root) -> None:
    """The bundle was frozen against this machine's glibc: the root's must be no older, or
    the bundle would not start in the image (a machine newer than SUITE)."""
    in_root = next((v for n, v, _ in root.packages if n == "libc6"), "")
    if not machine or not in_root:
        return
    if debbuild.compare_debian_versions(_upstream(machine), _upstream(in_root)) > 0:
        raise ImageError(
            f"this machine's glibc ({machine}) is newer than the {SUITE} root's ({in_root}): "
            f"freeze the bundle on {SUITE}"
        )


# -- the bundle layer ------------------------------------------------------------------------------


def bundle_layer(bundle: Path, path: Path) -> tuple[Layer, int]:
    """The bundle under /opt/tabby and the links to it; (layer, bytes of file data)."""
    file_bytes = 0

    def fill(tar: tarfile.TarFile) -> None:
        nonlocal file_bytes
        dirs = {str(Path(link).parent) for link in LINKS} | {"opt"}
        dirs |= {str(p) for d in list(dirs) for p in Path(d).parents if str(p) != "."}
        entries: list[tuple[str, str]] = [(d, "dir") for d in dirs]
        entries += [(link, "link") for link in LINKS] + [(BUNDLE_DIR, "bundle")]
        for name, kind in sorted(entries, key=lambda e: e[0].split("/")):
            if kind == "dir":
                add_entry(tar, name, kind=tarfile.DIRTYPE)
            elif kind == "link":
                add_entry(tar, name, kind=tarfile.SYMTYPE, link=EXECUTABLE, mode=0o777)
            else:
                file_bytes = add_tree(tar, bundle, BUNDLE_DIR, root_owned=True)

    layer = write_layer(path, fill, gzip_level=GZIP_LEVEL)
    return layer, file_bytes


# -- the image -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Built:
    ref: str
    archive: Path
    archive_bytes: int
    root: Root
    bundle_layer: Layer
    bundle_bytes: int
    seconds: float


def build_image(
    bundle: Path,
    out: Path | None,
    name: str,
    tag: str | None,
    cache: Path,
    log: Log = _stderr,
    *,
    rebuild_root: bool = False,
) -> Built:
    started = time.monotonic()
    version = bundle_version(bundle)
    tag = tag or version
    ref = reference(name, tag)
    out = out or REPO / "build" / f"tabby-{tag}.oci.tar"
    arch = architecture()
    root = ensure_root(cache, arch, log, rebuild=rebuild_root)
    if not root.made:
        log(f"reusing the Debian root {root.dir}")
    check_glibc(machine_glibc(), root)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".tabby-image.", dir=out.parent))
    try:
        blayer, bundle_bytes = bundle_layer(bundle, work / "bundle.tar.gz")
        labels = {
            "org.opencontainers.image.title": "tabby",
            "org.opencontainers.image.description": (
                "tabby-node (BIRD 2, nftables, iproute2) and the tabby CNI plugins"
            ),
            "org.opencontainers.image.version": version,
            "org.opencontainers.image.licenses": "Apache-2.0",
        }
        history = (
            f"mmdebstrap --variant={VARIANT} {SUITE} + {' '.join(PACKAGES)} (packaging/image.py)",
            f"tabby {version} bundle in /{BUNDLE_DIR} (packaging/image.py)",
        )
        tmp = work / "image.tar"
        with open(tmp, "wb") as f:
            write_oci_archive(
                f,
                [root.layer, blayer],
                ref,
                entrypoint=ENTRYPOINT,
                env=ENV,
                labels=labels,
                history=history,
                architecture=arch,
            )
        tmp.chmod(0o644)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return Built(
        ref,
        out,
        out.stat().st_size,
        root,
        blayer,
        bundle_bytes,
        time.monotonic() - started,
    )


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def summary(b: Built) -> list[str]:
    unpacked = b.root.file_bytes + b.bundle_bytes
    lines = [
        f"{b.ref} -> {b.archive} in {b.seconds:.1f} s "
        f"({'root made' if b.root.made else 'root packed' if b.root.packed else 'root reused'})",
        f"archive {_mb(b.archive_bytes)}; unpacked {_mb(unpacked)} of files: Debian root "
        f"{_mb(b.root.file_bytes)} ({len(b.root.packages)} packages; layer "
        f"{_mb(b.root.layer.size)} gzip), bundle {_mb(b.bundle_bytes)} (layer "
        f"{_mb(b.bundle_layer.size)} gzip)",
    ]
    if b.root.packages:
        top = ", ".join(f"{n} {s / 1000:.1f}" for n, _, s in b.root.packages[:8])
        lines.append(f"largest packages (MB installed): {top}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="packaging/image.py",
        description="Build the tabby container image (an OCI archive) from Debian packages "
        "and the frozen bundle; print its reference.",
    )
    parser.add_argument("--bundle", type=Path, default=DEFAULT_BUNDLE, metavar="DIR")
    parser.add_argument(
        "--name",
        default=os.environ.get("TABBY_IMAGE_NAME") or DEFAULT_NAME,
        help=f"repository of the reference (env TABBY_IMAGE_NAME; default {DEFAULT_NAME})",
    )
    parser.add_argument(
        "--tag",
        default=os.environ.get("TABBY_IMAGE_TAG") or None,
        help="tag of the reference (env TABBY_IMAGE_TAG; default the bundle's version)",
    )
    parser.add_argument(
        "--out", type=Path, metavar="FILE", help="the archive (default build/tabby-<tag>.oci.tar)"
    )
    parser.add_argument(
        "--cache-dir",
        type=Path,
        default=Path(DEFAULT_CACHE),
        metavar="DIR",
        help=f"where Debian roots are kept (default {DEFAULT_CACHE})",
    )
    parser.add_argument(
        "--rebuild-root", action="store_true", help="make the Debian root again (newer packages)"
    )
    args = parser.parse_args(argv)
    try:
        built = build_image(
            args.bundle,
            args.out,
            args.name,
            args.tag,
            args.cache_dir,
            rebuild_root=args.rebuild_root,
        )
    except ImageError as e:
        _stderr(f"error: {e}")
        return 1
    except KeyboardInterrupt:
        _stderr("interrupted")
        return 130
    for line in summary(built):
        _stderr(line)
    print(built.ref)
    return 0


if __name__ == "__main__":
    sys.exit(main())
