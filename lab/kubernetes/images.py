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

The packer itself is general and shared with the product's image (packaging/image.py):
``write_oci_archive`` writes any number of layers (plain or gzip-compressed, held in memory
or streamed from files) with a configurable entrypoint, environment and labels,
``write_layer`` packs a layer blob into a file (deterministic gzip: no name, no time) and
``add_tree`` adds a directory tree deterministically (entries in name order, one mtime,
numeric owners, hard links kept, file capabilities as PAX xattrs).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple, Protocol

from lab.kubernetes.build import DEFAULT_ROOT

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

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


# -- tar and OCI layout ------------------------------------------------------------------------

#: Media types of a layer blob: a plain tar, or a gzip-compressed one.
LAYER_TAR = "application/vnd.oci.image.layer.v1.tar"
LAYER_TAR_GZIP = "application/vnd.oci.image.layer.v1.tar+gzip"
EPOCH = "1970-01-01T00:00:00Z"
#: The only extended attribute a layer carries (file capabilities); others (SELinux labels)
#: belong to the machine that built it.
CAPABILITY_XATTR = "security.capability"


def add_entry(
    tar: tarfile.TarFile,
    name: str,
    *,
    data: bytes | None = None,
    mode: int = 0o755,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
    mtime: int = 0,
) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = mtime
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    info.mode = mode
    info.type = kind
    info.linkname = link
    if data is not None:
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    else:
        tar.addfile(info)


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


def add_tree(
    tar: tarfile.TarFile,
    top: Path,
    arcname: str,
    *,
    mtime: int = 0,
    root_owned: bool = False,
    prune: Collection[str] = (),
) -> int:
    """Add directory ``top`` as ``arcname`` (``""``: its contents at the top of the layer, a
    root file system) and everything below it, deterministically: the entries of every
    directory in name order, every mtime ``mtime``, numeric owners only, hard links as links
    to the first name. ``root_owned``: owner root and modes 0755/0644 whatever they are on
    disk (a build's output); else owners and modes as they are (a root file system).
    ``prune``: arcnames whose contents are left out (the directory stays). Sockets are left
    out. Returns the bytes of file data added (each inode once)."""
    seen: dict[tuple[int, int], str] = {}
    total = 0

    def entry(path: Path, name: str) -> None:
        nonlocal total
        st = os.lstat(path)
        info = tarfile.TarInfo(name)
        info.mtime = mtime
        info.uname = info.gname = ""
        info.uid, info.gid = (0, 0) if root_owned else (st.st_uid, st.st_gid)
        if root_owned:
            info.mode = 0o755 if stat.S_ISDIR(st.st_mode) or st.st_mode & 0o111 else 0o644
        else:
            info.mode = stat.S_IMODE(st.st_mode)
        if not stat.S_ISLNK(st.st_mode) and not stat.S_ISSOCK(st.st_mode):
            with contextlib.suppress(OSError):
                if CAPABILITY_XATTR in os.listxattr(path, follow_symlinks=False):
                    value = os.getxattr(path, CAPABILITY_XATTR, follow_symlinks=False)
                    info.pax_headers = {
                        f"SCHILY.xattr.{CAPABILITY_XATTR}": value.decode("utf-8", "surrogateescape")
                    }
        if stat.S_ISDIR(st.st_mode):
            info.type = tarfile.DIRTYPE
            if name:  # arcname "": the contents at the top, with no entry named "/"
                tar.addfile(info)
            if name in prune:
                return
            for child in sorted(os.listdir(path)):
                entry(path / child, f"{name}/{child}" if name else child)
        elif stat.S_ISREG(st.st_mode):
            key = (st.st_dev, st.st_ino)
            if st.st_nlink > 1 and key in seen:
                info.type = tarfile.LNKTYPE
                info.linkname = seen[key]
                tar.addfile(info)
                return
            seen[key] = name
            info.size = st.st_size
            total += st.st_size
            with open(path, "rb") as f:
                tar.addfile(info, f)
        elif stat.S_ISLNK(st.st_mode):
            info.type = tarfile.SYMTYPE
            info.linkname = os.readlink(path)
            tar.addfile(info)
        elif stat.S_ISFIFO(st.st_mode):
            info.type = tarfile.FIFOTYPE
            tar.addfile(info)
        elif stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode):
            info.type = tarfile.CHRTYPE if stat.S_ISCHR(st.st_mode) else tarfile.BLKTYPE
            info.devmajor, info.devminor = os.major(st.st_rdev), os.minor(st.st_rdev)
            tar.addfile(info)
        # sockets: left out

    entry(top, arcname.strip("/"))
    return total


class _Writable(Protocol):
    def write(self, data: bytes, /) -> object: ...


class _Hashing(io.RawIOBase):
    """A write-only stream that hashes and counts what goes through it to ``out``."""

    def __init__(self, out: _Writable | None) -> None:
        super().__init__()
        self.out = out
        self.sha = hashlib.sha256()
        self.size = 0

    def writable(self) -> bool:
        return True

    def write(self, data: ReadableBuffer, /) -> int:
        chunk = bytes(data)
        self.sha.update(chunk)
        self.size += len(chunk)
        if self.out is not None:
            self.out.write(chunk)
        return len(chunk)

    @property
    def digest(self) -> str:
        return "sha256:" + self.sha.hexdigest()


class Layer(NamedTuple):
    """One layer of an image: its blob (bytes, or the file holding them), the blob's digest
    and size as the manifest lists them, the digest of the uncompressed tar (the config's
    ``diff_id``), and the blob's media type."""

    blob: bytes | Path
    digest: str
    size: int
    diff_id: str
    media_type: str = LAYER_TAR

    @classmethod
    def of_tar(cls, data: bytes) -> Layer:
        """An uncompressed layer held in memory."""
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        return cls(data, digest, len(data), digest)


def write_layer(
    path: Path, fill: Callable[[tarfile.TarFile], object], *, gzip_level: int | None = 6
) -> Layer:
    """Write a layer blob to ``path``: the tar that ``fill(tar)`` makes, gzip-compressed at
    ``gzip_level`` (None: plain tar). The gzip header carries no name and no time, so the
    same entries give the same blob. Written beside ``path`` and renamed into place."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            blob = _Hashing(f)
            gz = None
            if gzip_level is not None:
                gz = gzip.GzipFile(
                    filename="", mode="wb", fileobj=blob, compresslevel=gzip_level, mtime=0
                )
            plain = _Hashing(gz if gz is not None else blob)
            with tarfile.open(fileobj=plain, mode="w|", format=tarfile.PAX_FORMAT) as tar:
                fill(tar)
            if gz is not None:
                gz.close()
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    media_type = LAYER_TAR if gzip_level is None else LAYER_TAR_GZIP
    return Layer(path, blob.digest, blob.size, plain.digest, media_type)


def _canon(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def write_oci_archive(
    out: BinaryIO,
    layers: Sequence[Layer],
    ref: str,
    *,
    entrypoint: Sequence[str] = ("/pause",),
    env: Sequence[str] = ("PATH=/bin",),
    labels: Mapping[str, str] | None = None,
    history: Sequence[str] = ("tabby lab.kubernetes.images",),
    created: str = EPOCH,
    architecture: str = "amd64",
) -> None:
    """Write an OCI image layout tar of ``layers`` (lowest first) named ``ref`` to ``out``:
    one manifest, its config (``history``: what made each layer, one per layer), the blobs
    in digest order. Layers held in files are streamed, never read into memory."""
    if len(history) != len(layers):
        raise ValueError(f"{len(layers)} layers but {len(history)} history entries")
    blobs: dict[str, bytes | Path] = {}

    def blob(data: bytes) -> tuple[str, int]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[digest] = data
        return digest, len(data)

    for layer in layers:
        blobs[layer.digest] = layer.blob
    image: dict[str, object] = {"Entrypoint": list(entrypoint), "Env": list(env), "WorkingDir": "/"}
    if labels:
        image["Labels"] = dict(labels)
    config = {
        "architecture": architecture,
        "os": "linux",
        "created": created,
        "config": image,
        "rootfs": {"type": "layers", "diff_ids": [layer.diff_id for layer in layers]},
        "history": [{"created": created, "created_by": what} for what in history],
    }
    config_digest, config_size = blob(_canon(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {"mediaType": layer.media_type, "digest": layer.digest, "size": layer.size}
            for layer in layers
        ],
    }
    manifest_digest, manifest_size = blob(_canon(manifest))
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": architecture, "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_entry(tar, "oci-layout", data=_canon({"imageLayoutVersion": "1.0.0"}), mode=0o644)
        add_entry(tar, "index.json", data=_canon(index), mode=0o644)
        add_entry(tar, "blobs", kind=tarfile.DIRTYPE)
        add_entry(tar, "blobs/sha256", kind=tarfile.DIRTYPE)
        for digest in sorted(blobs):
            info = tarfile.TarInfo("blobs/sha256/" + digest.split(":", 1)[1])
            info.uname = info.gname = "root"
            info.mode = 0o644
            data = blobs[digest]
            if isinstance(data, bytes):
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                info.size = data.stat().st_size
                with open(data, "rb") as f:
                    tar.addfile(info, f)


def oci_archive(layer: bytes, ref: str) -> bytes:
    """An OCI image layout tar of one uncompressed layer, named ``ref``."""
    buf = io.BytesIO()
    write_oci_archive(buf, [Layer.of_tar(layer)], ref)
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
