"""Build the e2e image offline: a busybox rootfs plus the static pause binary.

Writes into OUT_DIR:
  rootfs.tar      plain rootfs tar, for `podman import`
  pause-oci.tar   OCI image layout tar (one uncompressed layer, Entrypoint /pause), for
                  `ctr -n k8s.io images import`; named IMAGE_REF via the
                  io.containerd.image.name annotation

usage: mkimage.py OUT_DIR PAUSE_BINARY BUSYBOX_BINARY [IMAGE_REF]

Deterministic: fixed mtimes and owners, sorted entries, so the digests only change when the
binaries do.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile

DEFAULT_REF = "localhost/tabby-e2e/pause:1"
INDEX_HTML = b"tabby-e2e-httpd\n"


def _add(
    tar: tarfile.TarFile,
    name: str,
    *,
    data: bytes | None = None,
    mode: int = 0o755,
    kind: bytes = tarfile.REGTYPE,
    link: str = "",
) -> None:
    info = tarfile.TarInfo(name)
    info.mtime = 0
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


def rootfs_tar(pause: bytes, busybox: bytes, applets: list[str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for d in ("bin", "dev", "etc", "proc", "sys", "tmp", "var", "www"):
            _add(tar, d, kind=tarfile.DIRTYPE, mode=0o1777 if d == "tmp" else 0o755)
        _add(tar, "bin/busybox", data=busybox)
        _add(tar, "pause", data=pause)
        for applet in sorted(set(applets) - {"busybox"}):
            _add(tar, f"bin/{applet}", kind=tarfile.SYMTYPE, link="busybox", mode=0o777)
        _add(tar, "etc/passwd", data=b"root:x:0:0:root:/:/bin/sh\n", mode=0o644)
        _add(tar, "etc/group", data=b"root:x:0:\n", mode=0o644)
        _add(tar, "www/index.html", data=INDEX_HTML, mode=0o644)
    return buf.getvalue()


def _blob(blobs: dict[str, bytes], data: bytes) -> tuple[str, int]:
    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    blobs[digest] = data
    return digest, len(data)


def _canon(obj: object) -> bytes:
    return json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()


def oci_tar(layer: bytes, ref: str) -> bytes:
    blobs: dict[str, bytes] = {}
    layer_digest, layer_size = _blob(blobs, layer)
    config = {
        "architecture": "amd64",
        "os": "linux",
        "created": "1970-01-01T00:00:00Z",
        "config": {"Entrypoint": ["/pause"], "Env": ["PATH=/bin"], "WorkingDir": "/"},
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "history": [{"created": "1970-01-01T00:00:00Z", "created_by": "tabby e2e mkimage.py"}],
    }
    config_digest, config_size = _blob(blobs, _canon(config))
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {
            "mediaType": "application/vnd.oci.image.config.v1+json",
            "digest": config_digest,
            "size": config_size,
        },
        "layers": [
            {
                "mediaType": "application/vnd.oci.image.layer.v1.tar",
                "digest": layer_digest,
                "size": layer_size,
            }
        ],
    }
    manifest_digest, manifest_size = _blob(blobs, _canon(manifest))
    tag = ref.rsplit(":", 1)[1] if ":" in ref.rsplit("/", 1)[-1] else "latest"
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [
            {
                "mediaType": "application/vnd.oci.image.manifest.v1+json",
                "digest": manifest_digest,
                "size": manifest_size,
                "platform": {"architecture": "amd64", "os": "linux"},
                "annotations": {
                    "io.containerd.image.name": ref,
                    "org.opencontainers.image.ref.name": tag,
                },
            }
        ],
    }
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        _add(tar, "oci-layout", data=_canon({"imageLayoutVersion": "1.0.0"}), mode=0o644)
        _add(tar, "index.json", data=_canon(index), mode=0o644)
        _add(tar, "blobs", kind=tarfile.DIRTYPE)
        _add(tar, "blobs/sha256", kind=tarfile.DIRTYPE)
        for digest in sorted(blobs):
            _add(tar, "blobs/sha256/" + digest.split(":", 1)[1], data=blobs[digest], mode=0o644)
    return buf.getvalue()


def _write(path: str, data: bytes) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def main(argv: list[str]) -> int:
    if len(argv) not in (3, 4):
        print(__doc__, file=sys.stderr)
        return 2
    out_dir, pause_path, busybox_path = argv[:3]
    ref = argv[3] if len(argv) == 4 else DEFAULT_REF
    with open(pause_path, "rb") as f:
        pause = f.read()
    with open(busybox_path, "rb") as f:
        busybox = f.read()
    listing = subprocess.run([busybox_path, "--list"], check=True, capture_output=True, text=True)
    layer = rootfs_tar(pause, busybox, listing.stdout.split())
    os.makedirs(out_dir, exist_ok=True)
    _write(os.path.join(out_dir, "rootfs.tar"), layer)
    _write(os.path.join(out_dir, "pause-oci.tar"), oci_tar(layer, ref))
    _write(os.path.join(out_dir, "image-ref"), ref.encode() + b"\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
