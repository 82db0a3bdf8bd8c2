"""Container images for the labs, built offline: no registry is reachable from a lab machine.

::

    pause image   /pause only (static, from pause.c beside this file); Entrypoint /pause.
                  containerd's CRI sandbox image in the Kubernetes lab.
    busybox image Debian's busybox-static with every applet as a symlink in /bin, /pause,
                  /etc/passwd and /etc/group, and /www/index.html (body INDEX_HTML) for
                  ``httpd -h /www``; Entrypoint /pause. The lab's pods and the e2e runtime tier.

Each image is one uncompressed layer packed as an OCI image layout tar that
``ctr -n k8s.io images import`` (and ``podman load``) accept, named by the
``io.containerd.image.name`` annotation. The archives are deterministic (fixed mtimes and
owners, sorted entries) and cached outside the checkout under
``<cache>/images/<name>-<hash>/``, keyed by a hash of every input (pause.c, gcc's version,
the busybox binary, the reference, this module's format version), so they are built once
per machine and rebuilt only when an input changes. The image's tag is that hash: a changed
image is a new reference, never a stale one a node already holds.

    python3 -m lab.kubernetes.images                  build (if missing) and print both
    python3 -m lab.kubernetes.images --e2e OUT_DIR    the e2e runtime tier's files (below)

``--e2e`` writes the files the e2e tier reads: ``pause`` (the binary), ``rootfs.tar`` (the
busybox image's layer, for ``podman import``), ``pause-oci.tar`` (the busybox image named
``localhost/tabby-e2e/pause:1``, containerd's sandbox image there) and ``image-ref``.

The packer is the product image's (``packaging/ocipack.py``, build tooling shared with
``packaging/image.py``).
"""

from __future__ import annotations

import argparse
import hashlib
import io
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from ocipack import Layer, add_entry, write_oci_archive

from lab.kubernetes.build import DEFAULT_ROOT

#: Bump when the archives' layout changes (part of every cache key).
FORMAT = "1"
PAUSE_SOURCE = Path(__file__).with_name("pause.c")
BUSYBOX = Path("/bin/busybox")  # Debian's busybox-static
INDEX_HTML = b"tabby-httpd\n"
E2E_REF = "localhost/tabby-e2e/pause:1"
PACKAGES = ("busybox-static", "gcc", "libc6-dev")
EXECUTABLE = 0o755


class ImageError(RuntimeError):
    """An image could not be built (what is missing and how to get it)."""


class Image(NamedTuple):
    ref: str
    archive: Path  # OCI layout tar


def images_root(root: str = DEFAULT_ROOT) -> Path:
    return Path(root) / "images"


# -- inputs ----------------------------------------------------------------------------------


def _read(path: Path, what: str) -> bytes:
    try:
        return path.read_bytes()
    except OSError as e:
        raise ImageError(
            f"{what} {path} is missing ({e.strerror}): apt-get install {PACKAGES[0]}"
        ) from None


def _gcc_version() -> str:
    if shutil.which("gcc") is None:
        raise ImageError("gcc is missing: apt-get install gcc libc6-dev")
    out = subprocess.run(["gcc", "--version"], capture_output=True, text=True, check=False)
    return out.stdout.splitlines()[0] if out.stdout else "gcc"


def _applets(busybox: Path) -> list[str]:
    out = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise ImageError(f"{busybox} --list failed: {out.stderr.strip()}")
    return sorted(set(out.stdout.split()) - {"busybox"})


def _key(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        data = p.encode() if isinstance(p, str) else p
        h.update(len(data).to_bytes(8, "big"))
        h.update(data)
    return h.hexdigest()


# -- the pause binary --------------------------------------------------------------------------


def pause_binary(root: str = DEFAULT_ROOT) -> Path:
    """The static pause binary, compiled once per source and compiler."""
    source = _read(PAUSE_SOURCE, "the pause source")
    key = _key(FORMAT, source, _gcc_version())
    out = images_root(root) / f"pause-bin-{key[:16]}" / "pause"
    if out.is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".pause.{os.getpid()}")
    proc = subprocess.run(
        ["gcc", "-static", "-Os", "-s", "-Wall", "-Werror", "-o", str(tmp), str(PAUSE_SOURCE)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        tmp.unlink(missing_ok=True)
        raise ImageError(
            f"gcc -static pause.c failed (apt-get install gcc libc6-dev): {proc.stderr.strip()}"
        )
    os.replace(tmp, out)
    return out


def pause_layer(pause: bytes) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_entry(tar, "pause", data=pause)
    return buf.getvalue()


def busybox_layer(pause: bytes, busybox: bytes, applets: list[str]) -> bytes:
    """busybox with its applets, /pause, a root user, and /www for httpd."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "www"):
            add_entry(tar, d, kind=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        add_entry(tar, "bin/busybox", data=busybox)
        add_entry(tar, "pause", data=pause)
        for applet in sorted(set(applets) - {"busybox"}):
            add_entry(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox", mode=0o777)
        add_entry(tar, "etc/passwd", data=b"root:x:0:0:root:/:/bin/sh\n", mode=0o644)
        add_entry(tar, "etc/group", data=b"root:x:0:\n", mode=0o644)
        add_entry(tar, "www/index.html", data=INDEX_HTML, mode=0o644)
    return buf.getvalue()


def oci_archive(layer: bytes, ref: str) -> bytes:
    """An OCI image layout tar of one uncompressed layer, named ``ref``: Entrypoint /pause,
    PATH=/bin (the cache keys assume this layout: FORMAT)."""
    buf = io.BytesIO()
    write_oci_archive(
        buf,
        [Layer.of_tar(layer)],
        ref,
        entrypoint=("/pause",),
        env=("PATH=/bin",),
        history=("tabby lab.kubernetes.images",),
    )
    return buf.getvalue()


def _write_atomic(path: Path, data: bytes, mode: int = 0o644) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


# -- the images ------------------------------------------------------------------------------------


def _cached(root: str, name: str, key: str, ref: str, layer: Callable[[], bytes]) -> Image:
    """The archive of ``name`` for ``key`` (named ``ref``), written when missing."""
    archive = images_root(root) / f"{name}-{key[:16]}" / "image.tar"
    if not archive.is_file():
        _write_atomic(archive, oci_archive(layer(), ref))
    return Image(ref, archive)


def pause_image(root: str = DEFAULT_ROOT) -> Image:
    pause = pause_binary(root).read_bytes()
    key = _key(FORMAT, "pause", pause)
    return _cached(
        root, "pause", key, f"localhost/tabby/pause:{key[:12]}", lambda: pause_layer(pause)
    )


def busybox_image(root: str = DEFAULT_ROOT, ref: str | None = None) -> Image:
    """The busybox test image (``ref``: a fixed name instead of the hash-tagged one)."""
    pause = pause_binary(root).read_bytes()
    busybox = _read(BUSYBOX, "busybox")
    applets = _applets(BUSYBOX)
    key = _key(FORMAT, "test", pause, busybox, "\n".join(applets), INDEX_HTML, ref or "")
    return _cached(
        root,
        "busybox",
        key,
        ref or f"localhost/tabby/busybox:{key[:12]}",
        lambda: busybox_layer(pause, busybox, applets),
    )


def e2e_files(out_dir: Path, root: str = DEFAULT_ROOT) -> None:
    """The e2e runtime tier's image files (module docstring), from the cached builds."""
    pause = pause_binary(root)
    busybox = _read(BUSYBOX, "busybox")
    image = busybox_image(root, ref=E2E_REF)
    out_dir.mkdir(parents=True, exist_ok=True)
    _write_atomic(out_dir / "pause", pause.read_bytes(), mode=EXECUTABLE)
    _write_atomic(
        out_dir / "rootfs.tar", busybox_layer(pause.read_bytes(), busybox, _applets(BUSYBOX))
    )
    _write_atomic(out_dir / "pause-oci.tar", image.archive.read_bytes())
    _write_atomic(out_dir / "image-ref", image.ref.encode() + b"\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python3 -m lab.kubernetes.images",
        description="Build the labs' pause and busybox images (cached; only when missing).",
    )
    parser.add_argument("--cache-dir", default=DEFAULT_ROOT, metavar="DIR")
    parser.add_argument("--e2e", metavar="OUT_DIR", help="write the e2e runtime tier's files")
    args = parser.parse_args(argv)
    try:
        if args.e2e:
            e2e_files(Path(args.e2e), args.cache_dir)
            print(f"images: e2e files in {args.e2e}")
        else:
            for image in (pause_image(args.cache_dir), busybox_image(args.cache_dir)):
                print(f"{image.ref} {image.archive}")
    except ImageError as e:
        print(f"images: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
