"""The OCI packer (packaging/ocipack.py) and the product image's pure parts
(packaging/image.py), without root, mmdebstrap or a runtime: trees packed
deterministically, gzip layers whose digests hold, multi-layer archives, the reference
rules, the root's trimming and cache key, the bundle layer's layout. The image itself is
checked by tests/image (e2e tier)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import debbuild as apt_sources
import pytest
from ocipack import (
    LAYER_TAR_GZIP,
    Layer,
    add_tree,
    write_layer,
    write_oci_archive,
)

from lab.kubernetes.images import oci_archive
from tests import packaging_image

IMAGE = packaging_image.load()


def make_tree(top: Path) -> None:
    (top / "b").mkdir(parents=True)
    (top / "a.txt").write_text("a\n")
    (top / "b" / "run").write_text("#!/bin/sh\n")
    (top / "b" / "run").chmod(0o775)
    os.link(top / "a.txt", top / "b" / "same.txt")
    (top / "link").symlink_to("b/run")
    (top / "dev").mkdir()
    (top / "dev" / "null-ish").write_text("")


def pack(top: Path, arcname: str, **kw: Any) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        add_tree(tar, top, arcname, **kw)
    return buf.getvalue()


def members(data: bytes) -> list[tarfile.TarInfo]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        return tar.getmembers()


def test_add_tree_is_deterministic_and_keeps_links(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")
    first = pack(tmp_path / "t", "", prune={"dev"})
    os.utime(tmp_path / "t" / "a.txt", (1, 1))  # mtimes never reach the tar
    assert pack(tmp_path / "t", "", prune={"dev"}) == first
    ms = members(first)
    names = [m.name for m in ms]
    # The top has no entry ("/"); every directory's entries in name order; dev's contents pruned.
    assert names == ["a.txt", "b", "b/run", "b/same.txt", "dev", "link"]
    by = {m.name: m for m in ms}
    assert by["b/same.txt"].islnk()
    assert by["b/same.txt"].linkname == "a.txt"
    assert by["link"].issym()
    assert by["link"].linkname == "b/run"
    assert by["b/run"].mode == 0o775  # as on disk
    assert {m.mtime for m in ms} == {0}
    assert {m.uname for m in ms} == {""}


def test_add_tree_root_owned_normalises_modes(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")
    ms = {m.name: m for m in members(pack(tmp_path / "t", "opt/x", root_owned=True))}
    assert ms["opt/x"].isdir()
    assert ms["opt/x/b/run"].mode == 0o755
    assert ms["opt/x/a.txt"].mode == 0o644
    assert {(m.uid, m.gid) for m in ms.values()} == {(0, 0)}


def test_write_layer_gzip_digests(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")

    def fill(tar: tarfile.TarFile) -> None:
        add_tree(tar, tmp_path / "t", "")

    layer = write_layer(tmp_path / "l.tar.gz", fill)
    again = write_layer(tmp_path / "l2.tar.gz", fill)
    blob = (tmp_path / "l.tar.gz").read_bytes()
    assert blob == (tmp_path / "l2.tar.gz").read_bytes()
    assert layer.digest == again.digest == "sha256:" + hashlib.sha256(blob).hexdigest()
    assert layer.size == len(blob)
    plain = gzip.decompress(blob)
    assert layer.diff_id == "sha256:" + hashlib.sha256(plain).hexdigest()
    assert layer.media_type == LAYER_TAR_GZIP
    assert blob[4:8] == b"\0\0\0\0"  # gzip header: no time
    assert not list(tmp_path.glob(".l.tar.gz.*"))
    plain_layer = write_layer(tmp_path / "p.tar", fill, gzip_level=None)
    assert plain_layer.digest == plain_layer.diff_id == layer.diff_id


def read_layout(data: bytes) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}  # type: ignore[union-attr]
    index = json.loads(files["index.json"])
    manifest = json.loads(files["blobs/sha256/" + index["manifests"][0]["digest"][7:]])
    config = json.loads(files["blobs/sha256/" + manifest["config"]["digest"][7:]])
    for name, blob in files.items():
        if name.startswith("blobs/"):
            assert hashlib.sha256(blob).hexdigest() == name.rsplit("/", 1)[1]
    return index, manifest, config


def test_write_oci_archive_two_layers(tmp_path: Path) -> None:
    make_tree(tmp_path / "t")
    file_layer = write_layer(tmp_path / "l.tar.gz", lambda tar: add_tree(tar, tmp_path / "t", ""))
    mem_layer = Layer.of_tar(pack(tmp_path / "t", "opt"))
    buf = io.BytesIO()
    write_oci_archive(
        buf,
        [file_layer, mem_layer],
        "registry.example:5000/team/tabby:1.2",
        entrypoint=("/x",),
        env=("PATH=/usr/bin",),
        labels={"k": "v"},
        history=("root", "bundle"),
        architecture="arm64",
    )
    index, manifest, config = read_layout(buf.getvalue())
    (entry,) = index["manifests"]
    assert entry["annotations"] == {
        "io.containerd.image.name": "registry.example:5000/team/tabby:1.2",
        "org.opencontainers.image.ref.name": "1.2",
    }
    assert entry["platform"] == {"architecture": "arm64", "os": "linux"}
    assert [layer["digest"] for layer in manifest["layers"]] == [
        file_layer.digest,
        mem_layer.digest,
    ]
    assert config["rootfs"]["diff_ids"] == [file_layer.diff_id, mem_layer.diff_id]
    assert config["config"] == {
        "Entrypoint": ["/x"],
        "Env": ["PATH=/usr/bin"],
        "Labels": {"k": "v"},
        "WorkingDir": "/",
    }
    assert [h["created_by"] for h in config["history"]] == ["root", "bundle"]
    with pytest.raises(ValueError, match="history"):
        write_oci_archive(io.BytesIO(), [mem_layer], "x:1", history=())


def test_oci_archive_single_layer_unchanged() -> None:
    """The lab's images: one plain layer, Entrypoint /pause (their cache keys assume it)."""
    layer = b"\0" * 1024
    index, manifest, config = read_layout(oci_archive(layer, "localhost/tabby/pause:1"))
    assert manifest["layers"][0]["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    assert config["config"] == {"Entrypoint": ["/pause"], "Env": ["PATH=/bin"], "WorkingDir": "/"}
    assert index["manifests"][0]["annotations"]["org.opencontainers.image.ref.name"] == "1"


# -- packaging/image.py ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "tag", "ok"),
    [
        ("localhost/tabby", "0.1.0", True),
        ("registry.local:5000/net/tabby", "0.1.0-upgrade", True),
        ("tabby", "v1_2", True),
        ("Localhost/Tabby", "1", False),  # repository path components are lower case
        ("localhost/tabby", "-bad", False),
        ("localhost/tabby", "a/b", False),
        ("localhost/tabby", "", False),
    ],
)
def test_reference_rules(name: str, tag: str, ok: bool) -> None:
    if ok:
        assert IMAGE.reference(name, tag) == f"{name}:{tag}"
    else:
        with pytest.raises(IMAGE.ImageError):
            IMAGE.reference(name, tag)


def test_root_key_follows_the_recipe(monkeypatch: pytest.MonkeyPatch) -> None:
    key = IMAGE.root_key("amd64")
    assert key == IMAGE.root_key("amd64")
    assert key != IMAGE.root_key("arm64")
    monkeypatch.setattr(IMAGE, "PACKAGES", (*IMAGE.PACKAGES, "tcpdump"))
    assert IMAGE.root_key("amd64") != key


def test_sources_come_from_the_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    machine = apt_sources.parse_deb822_sources(
        "Types: deb\nURIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By: /usr/share/keyrings/debian-archive-keyring.gpg\n\n"
        "Types: deb\nURIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n"
        "Components: main\n"
    )
    monkeypatch.setattr(apt_sources, "machine_apt_sources", lambda: machine)
    text = IMAGE.sources_text()
    assert "Types: deb\n" in text
    assert "deb-src" not in text
    assert "URIs: http://mirror.invalid/debian\nSuites: bookworm bookworm-updates\n" in text
    assert "URIs: http://mirror.invalid/debian-security\nSuites: bookworm-security\n" in text
    assert "Signed-By: /usr/share/keyrings/debian-archive-keyring.gpg" in text
    cmd = IMAGE.mmdebstrap_command(Path("/t/root"), Path("/t/s.sources"))
    assert cmd[-3:] == ["bookworm", "/t/root", "/t/s.sources"]
    assert "--variant=essential" in cmd
    assert "--include=bird2,iproute2,nftables" in cmd
    assert "--dpkgopt=path-include=/usr/share/doc/*/copyright" in cmd


def test_trim_removes_what_no_package_owns(tmp_path: Path) -> None:
    root = tmp_path / "root"
    for rel in (
        "etc/apt/apt.conf.d/70debconf",  # debconf's: kept
        "etc/apt/apt.conf.d/99mmdebstrap",
        "etc/apt/sources.list.d/0000sources.sources",
        "var/lib/apt/lists/lock",
        "var/cache/apt/archives/partial/x.deb",
        "var/log/apt/eipp.log.xz",
        "etc/hostname",
        "etc/resolv.conf",
        "etc/passwd",
        "etc/passwd-",
        "var/lib/dpkg/status",
        "var/lib/dpkg/status-old",
        "var/cache/debconf/templates.dat-old",
    ):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text("x")
    info = root / "var/lib/dpkg/info"
    info.mkdir(parents=True)
    (info / "debconf.list").write_text("/.\n/etc\n/etc/apt\n/etc/apt/apt.conf.d\n"
                                       "/etc/apt/apt.conf.d/70debconf\n")  # fmt: skip
    removed = IMAGE.trim(root)
    left = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())
    assert left == [
        "etc/apt/apt.conf.d/70debconf",
        "etc/passwd",
        "var/lib/dpkg/info/debconf.list",
        "var/lib/dpkg/status",
    ]
    assert not (root / "var/lib/apt").exists()
    assert not (root / "etc/apt/sources.list.d").exists()
    assert "/etc/resolv.conf" in removed


def test_bundle_layer_layout(tmp_path: Path) -> None:
    bundle = tmp_path / "tabby"
    (bundle / "_internal").mkdir(parents=True)
    (bundle / "tabby").write_bytes(b"\x7fELF")
    (bundle / "tabby").chmod(0o700)
    (bundle / "_internal" / "lib.so").write_bytes(b"so")
    layer, file_bytes = IMAGE.bundle_layer(bundle, tmp_path / "b.tar.gz")
    assert file_bytes == 6
    ms = members(gzip.decompress((tmp_path / "b.tar.gz").read_bytes()))
    assert [m.name for m in ms] == [
        "opt",
        "opt/cni",
        "opt/cni/bin",
        "opt/cni/bin/tabby",
        "opt/cni/bin/tabby-ipam",
        "opt/tabby",
        "opt/tabby/_internal",
        "opt/tabby/_internal/lib.so",
        "opt/tabby/tabby",
        "usr",
        "usr/local",
        "usr/local/bin",
        "usr/local/bin/tabby-kube-controllers",
        "usr/local/bin/tabby-node",
        "usr/local/bin/tabby-typha",
        "usr/local/bin/tabbyctl",
    ]
    by = {m.name: m for m in ms}
    assert by["opt/tabby/tabby"].mode == 0o755
    assert by["usr/local/bin/tabby-node"].linkname == "/opt/tabby/tabby"
    assert layer.diff_id == IMAGE.bundle_layer(bundle, tmp_path / "c.tar.gz")[0].diff_id


@pytest.mark.parametrize(
    ("machine", "ok"),
    [
        ("2.36-9+deb12u10", True),  # a newer Debian revision of the same glibc
        ("2.35-0ubuntu3", True),
        ("2.41-12", False),  # frozen on a newer Debian: the bundle needs a newer glibc
    ],
)
def test_glibc_guard(machine: str, ok: bool, tmp_path: Path) -> None:
    root = IMAGE.Root(tmp_path, Layer.of_tar(b""), 0, [("libc6", "2.36-9+deb12u9", 13001)])
    if ok:
        IMAGE.check_glibc(machine, root)
    else:
        with pytest.raises(IMAGE.ImageError, match="newer"):
            IMAGE.check_glibc(machine, root)
