"""The OCI packer: deterministic layers and OCI image layout archives, standard library only.

Build tooling, not shipped: the product image (``packaging/image.py``) and the lab's test
images (``lab.kubernetes.images``) are packed with it. ``write_oci_archive`` writes any
number of layers (plain or gzip-compressed, held in memory or streamed from files) with a
configurable entrypoint, environment and labels, as an OCI image layout tar that ``ctr -n
k8s.io images import`` and ``podman load`` accept (named by the ``io.containerd.image.name``
annotation); ``write_layer`` packs a layer blob into a file (deterministic gzip: no name,
no time); ``add_tree`` adds a directory tree deterministically (entries in name order, one
mtime, numeric owners, hard links kept, file capabilities as PAX xattrs) and ``add_entry``
one entry.

``packaging/`` is not a package (a ``packaging/__init__.py`` would shadow PyPI's
``packaging``): this module is imported by its name with ``packaging/`` on ``sys.path``
(``packaging/image.py`` as a script, ``lab`` on import, the tests by pytest's
``pythonpath``).
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import stat
import tarfile
from collections.abc import Callable, Collection, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, NamedTuple, Protocol

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

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
    entrypoint: Sequence[str] = (),
    env: Sequence[str] = (),
    labels: Mapping[str, str] | None = None,
    history: Sequence[str],
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
