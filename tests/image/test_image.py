"""The container image ``tabby:<version>`` (packaging/image.py), taken as a cluster takes it.

The image is built from the installed bundle (``TABBY_BUNDLE_DIR``, default /opt/tabby) with
the Debian root cached under /var/cache/tabby/image-root (made the first time: ~40 s and the
machine's mirror), or ``TABBY_IMAGE_ARCHIVE`` names an archive to check instead (e.g. the
one ``./build.sh --image`` wrote). Then:

* the archive: an OCI layout whose index names the image, whose blobs match their digests,
  whose config runs tabby-node; two gzip layers; building it again gives the same bytes;
* what it holds: the bundle in /opt/tabby with the usual links, BIRD, nft, libnftables and
  ip; no apt lists or caches, no documentation but copyright files, no man pages or
  translations, none of the build machine's files;
* a private containerd (its own root, state and socket, inside a throwaway node: a network
  and mount namespace held by one process) imports it with ``ctr -n k8s.io images import``
  and runs each program in a container (``ctr run --rm``), tabby-node also as the node
  agent it is (privileged in the container's own network namespace: its socket, its
  nftables table through the image's libnftables, BIRD); the containers' cgroups live
  under a root of this module's, removed afterwards;
* ``podman load`` takes it into a private storage root.

Everything is stopped by PID and removed; the module fails if a process, mount or cgroup
of its own is left. e2e tier: ``--run-e2e`` as root.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import secrets
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from lab.kubernetes.node import hierarchies, remove_cgroup_root
from tests import packaging_image
from tests.e2e.runtimes.harness_base import (
    kill_pid,
    mounts_under,
    pids_with_cmdline,
    stop_pid,
    unmount_under,
    wait_for,
)
from tests.e2e.runtimes.harness_node import Node

pytestmark = pytest.mark.e2e

REPO = Path(__file__).resolve().parents[2]
BUNDLE = Path(os.environ.get("TABBY_BUNDLE_DIR", "/opt/tabby"))


IMAGE = packaging_image.load()


@dataclass
class Archive:
    ref: str
    path: Path
    blobs: dict[str, bytes]  # digest -> blob
    index: dict[str, Any]
    manifest: dict[str, Any]
    config: dict[str, Any]
    layers: list[bytes]  # uncompressed layer tars, lowest first

    def members(self) -> dict[str, tarfile.TarInfo]:
        """The merged view of every layer (upper layers win), by name without a leading ./"""
        merged: dict[str, tarfile.TarInfo] = {}
        for layer in self.layers:
            with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
                for m in tar.getmembers():
                    merged[m.name.removeprefix("./").rstrip("/")] = m
        return merged


def read_archive(path: Path) -> Archive:
    blobs: dict[str, bytes] = {}
    with tarfile.open(path) as tar:
        layout = json.loads(tar.extractfile("oci-layout").read())  # type: ignore[union-attr]
        assert layout == {"imageLayoutVersion": "1.0.0"}
        index = json.loads(tar.extractfile("index.json").read())  # type: ignore[union-attr]
        for m in tar.getmembers():
            if m.isfile() and m.name.startswith("blobs/sha256/"):
                blobs["sha256:" + m.name.rsplit("/", 1)[1]] = tar.extractfile(m).read()  # type: ignore[union-attr]
    for digest, data in blobs.items():
        assert "sha256:" + hashlib.sha256(data).hexdigest() == digest, f"blob {digest} is corrupt"
    (entry,) = index["manifests"]
    manifest = json.loads(blobs[entry["digest"]])
    config = json.loads(blobs[manifest["config"]["digest"]])
    layers = []
    for layer in manifest["layers"]:
        data = blobs[layer["digest"]]
        assert layer["size"] == len(data)
        gzipped = layer["mediaType"].endswith("+gzip")
        layers.append(gzip.decompress(data) if gzipped else data)
    ref = entry["annotations"]["io.containerd.image.name"]
    return Archive(ref, path, blobs, index, manifest, config, layers)


@pytest.fixture(scope="module")
def workdir() -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.fail("the image tier needs root (mmdebstrap, containerd, podman)")
    path = Path(tempfile.mkdtemp(prefix="tabby-image-e2e."))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def archive(workdir: Path) -> Archive:
    given = os.environ.get("TABBY_IMAGE_ARCHIVE")
    if given:
        return read_archive(Path(given))
    if not os.access(BUNDLE / "tabby", os.X_OK):
        pytest.fail(f"no bundle in {BUNDLE}: run ./build.sh --no-demo (or set TABBY_BUNDLE_DIR)")
    built = IMAGE.build_image(
        BUNDLE, workdir / "tabby.oci.tar", IMAGE.DEFAULT_NAME, None, Path(IMAGE.DEFAULT_CACHE)
    )
    for line in IMAGE.summary(built):
        print(line)
    return read_archive(built.archive)


# -- the archive ---------------------------------------------------------------------------------


def test_archive_names_the_image_and_runs_tabby_node(archive: Archive) -> None:
    (entry,) = archive.index["manifests"]
    name, _, tag = archive.ref.rpartition(":")
    assert entry["annotations"]["org.opencontainers.image.ref.name"] == tag
    assert name
    assert tag
    assert entry["platform"]["os"] == "linux"
    cfg = archive.config["config"]
    assert cfg["Entrypoint"] == ["/usr/local/bin/tabby-node"]
    assert any(e.startswith("PATH=") and "/usr/sbin" in e for e in cfg["Env"])
    assert cfg["Labels"]["org.opencontainers.image.version"] in tag
    layers = archive.manifest["layers"]
    assert [layer["mediaType"] for layer in layers] == [
        "application/vnd.oci.image.layer.v1.tar+gzip"
    ] * 2
    assert len(archive.config["history"]) == len(layers)
    assert archive.config["rootfs"]["diff_ids"] == [
        "sha256:" + hashlib.sha256(layer).hexdigest() for layer in archive.layers
    ]


def test_archive_is_deterministic(archive: Archive, workdir: Path) -> None:
    """Fixed mtimes and owners, sorted entries: the same bundle gives the same bytes."""
    for layer in archive.layers:
        with tarfile.open(fileobj=io.BytesIO(layer)) as tar:
            members = tar.getmembers()
        assert {m.mtime for m in members} == {0}
        assert all(
            not m.name.startswith(("/", "./")) and ".." not in m.name.split("/") for m in members
        )
        names = [m.name.rstrip("/").split("/") for m in members]
        assert names == sorted(names), "entries not in name order"
    if os.environ.get("TABBY_IMAGE_ARCHIVE"):
        pytest.skip("a given archive: its bundle is not at hand to build it again")
    again = IMAGE.build_image(
        BUNDLE, workdir / "again.oci.tar", IMAGE.DEFAULT_NAME, None, Path(IMAGE.DEFAULT_CACHE)
    )
    assert not again.root.made, "the cached root was made again"
    assert again.archive.read_bytes() == archive.path.read_bytes()
    again.archive.unlink()


def test_image_holds_the_bundle_and_the_node_tools(archive: Archive) -> None:
    members = archive.members()
    exe = members["opt/tabby/tabby"]
    assert exe.isfile()
    assert exe.mode == 0o755
    assert members["opt/tabby/_internal"].isdir()
    for link in IMAGE.LINKS:
        assert members[link].issym(), link
        assert members[link].linkname == "/opt/tabby/tabby", link
    bundle = [m for name, m in members.items() if name.startswith("opt/tabby")]
    assert {(m.uid, m.gid) for m in bundle} == {(0, 0)}
    for tool in ("usr/sbin/bird", "usr/sbin/birdc", "usr/sbin/nft", "usr/bin/ip"):
        assert members[tool].isfile(), tool
    assert any(n.endswith("/libnftables.so.1") for n in members), "no libnftables.so.1"
    assert members["bin"].issym()  # merged /usr
    assert members["bin"].linkname == "usr/bin"
    status = members["var/lib/dpkg/status"]
    assert status.isfile()


def test_image_carries_no_apt_state_docs_or_machine_files(archive: Archive) -> None:
    members = archive.members()
    files = {n for n, m in members.items() if not m.isdir()}
    apt = [n for n in files if n.startswith(("var/lib/apt", "var/cache/apt", "var/log/apt"))]
    assert not apt, apt
    assert not [n for n in files if n.startswith("etc/apt/sources.list")]
    docs = [
        n for n in files if n.startswith("usr/share/doc/") and n.rsplit("/", 1)[1] != "copyright"
    ]
    assert all(members[n].issym() for n in docs), [n for n in docs if not members[n].issym()]
    assert any(n.endswith("/copyright") for n in files), "copyright files are kept"
    for top in ("usr/share/man/", "usr/share/locale/", "usr/share/lintian/"):
        assert not [n for n in files if n.startswith(top)], top
    assert {n for n in files if n.startswith("usr/share/info/")} <= {"usr/share/info/dir"}
    for machine in ("etc/hostname", "etc/resolv.conf", "etc/shadow-", "etc/passwd-"):
        assert machine not in files, machine
    assert not [n for n in files if n.endswith("-old") and n.startswith("var/")]
    assert not [n for n in files if n.startswith(("dev/", "proc/", "sys/", "tmp/", "run/"))]
    # Nothing but the bundle and its links is added to Debian's /usr/local and /opt (which
    # hold only base-files' usr/local/man link).
    extra = [n for n in files if n.startswith(("usr/local/", "opt/"))]
    outside = {n for n in extra if not n.startswith("opt/tabby/") and n not in IMAGE.LINKS}
    assert outside <= {"usr/local/man"}, outside


# -- a private containerd --------------------------------------------------------------------------


class PrivateContainerd:
    """containerd without CRI inside a throwaway node: its own root, state, socket and opt
    dirs under base (harness_containerd.Containerd has the same, with CRI and CNI)."""

    def __init__(self, node: Node, base: Path) -> None:
        self.node = node
        self.base = base
        self.socket = base / "containerd.sock"
        self.cgroup = f"/tabby-image-e2e-{secrets.token_hex(4)}"
        for d in ("root", "state", "opt"):
            (base / d).mkdir(parents=True, exist_ok=True)
        q = json.dumps
        (base / "config.toml").write_text(f"""\
version = 2
root = {q(str(base / "root"))}
state = {q(str(base / "state"))}
disabled_plugins = [
  "io.containerd.grpc.v1.cri",
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]
[grpc]
  address = {q(str(self.socket))}
[ttrpc]
  address = {q(str(self.socket) + ".ttrpc")}
[debug]
  address = ""
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = {q(str(base / "opt"))}
""")
        self.log = open(base / "containerd.log", "wb")  # noqa: SIM115
        self.proc = node.popen(
            ["containerd", "--config", str(base / "config.toml")],
            stdout=self.log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )

        def up() -> bool:
            assert self.proc.poll() is None, f"containerd exited:\n{self.log_tail()}"
            return self.ctr("version", check=False).returncode == 0

        wait_for("containerd", up, timeout=30, interval=0.2)

    def ctr(
        self, *args: str, check: bool = True, timeout: float = 120
    ) -> subprocess.CompletedProcess[str]:
        return self.node.run(
            ["ctr", "--address", str(self.socket), "--namespace", "k8s.io", *args],
            check=check,
            timeout=timeout,
        )

    def run(
        self, ref: str, *cmd: str, privileged: bool = False
    ) -> subprocess.CompletedProcess[str]:
        """``ctr run --rm`` one command in a container of the image (its own namespaces)."""
        cid = f"tabby-image-{secrets.token_hex(4)}"
        return self.ctr(
            "run", "--rm", "--snapshotter", "native", "--cgroup", f"{self.cgroup}/{cid}",
            *(["--privileged"] if privileged else []),
            ref, cid, *cmd,
            check=False,
        )  # fmt: skip

    def log_tail(self, lines: int = 30) -> str:
        text = (self.base / "containerd.log").read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def stop(self) -> list[str]:
        """Stop containerd by PID, end what outlived it (by PID, matched on base), unmount
        what is left under base, remove the containers' cgroup root. Returns problems."""
        problems: list[str] = []
        stop_pid(self.proc, grace=15)
        self.log.close()
        for pid in pids_with_cmdline(str(self.base)):
            problems.append(f"process {pid} outlived containerd")
            kill_pid(pid)
        if mounts := unmount_under(self.base):
            problems.append(f"mounts left under {self.base}: {mounts}")
        if left := remove_cgroup_root(self.cgroup):
            problems.append(f"cgroups left: {left}")
        return problems


@pytest.fixture(scope="module")
def containerd(archive: Archive, workdir: Path) -> Iterator[PrivateContainerd]:
    node = Node()
    node.start()
    c: PrivateContainerd | None = None
    problems: list[str] = []
    try:
        c = PrivateContainerd(node, workdir / "containerd")
        c.ctr("images", "import", "--snapshotter", "native", str(archive.path), timeout=300)
        yield c
    finally:
        if c is not None:
            problems += c.stop()
        node.stop()
        base = workdir / "containerd"
        if mounts := mounts_under(base):
            problems.append(f"mounts left: {mounts}")
        if pids := pids_with_cmdline(str(base)):
            problems.append(f"processes left: {pids}")
        if c is not None:
            problems += [h + c.cgroup for h in hierarchies() if os.path.isdir(h + c.cgroup)]
    if problems:
        pytest.fail(f"the containerd check left state behind: {problems}")


def test_containerd_imports_the_image(containerd: PrivateContainerd, archive: Archive) -> None:
    refs = containerd.ctr("images", "ls", "-q").stdout.split()
    assert archive.ref in refs
    assert containerd.ctr("images", "check").returncode == 0


@pytest.mark.parametrize(
    ("cmd", "expect"),
    [
        (["tabby-node", "--help"], "usage: tabby-node"),
        (["bird", "--version"], "BIRD version 2."),
        (["nft", "--version"], "nftables v1."),
        (["ip", "-V"], "iproute2"),
        (["tabbyctl", "version"], "tabby "),
    ],
    ids=["tabby-node", "bird", "nft", "ip", "tabbyctl"],
)
def test_programs_run_in_a_container(
    containerd: PrivateContainerd, archive: Archive, cmd: list[str], expect: str
) -> None:
    proc = containerd.run(archive.ref, *cmd)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert expect in said, said


def test_cni_plugins_answer_version_in_a_container(
    containerd: PrivateContainerd, archive: Archive
) -> None:
    script = (
        "for p in /opt/cni/bin/tabby /opt/cni/bin/tabby-ipam; do "
        'echo \'{"cniVersion":"1.1.0"}\' | CNI_COMMAND=VERSION "$p" || exit 1; echo; done'
    )
    proc = containerd.run(archive.ref, "sh", "-c", script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    answers = [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]
    assert len(answers) == 2
    assert all("1.1.0" in a["supportedVersions"] for a in answers)


NODE_SCRIPT = """
ip link set lo up
tabby-node --backend bird --nodename image-node --node-ip 10.9.9.1 --ipv4-pool 10.244.0.0/16 \\
    --state-dir /tmp/state --run-dir /tmp/run --socket /tmp/run/node.sock --data-dir /tmp/data \\
    --metrics-port 0 --health-port 0 --log-file /tmp/node.log &
pid=$!
for i in $(seq 300); do [ -S /tmp/run/node.sock ] && break; sleep 0.1; done
grep -o '/[^ ]*libnftables[^ ]*' /proc/$pid/maps | sort -u
nft list tables
tabbyctl node status --run-dir /tmp/run
kill $pid; wait $pid
cat /tmp/node.log
"""


def test_tabby_node_serves_in_a_container(containerd: PrivateContainerd, archive: Archive) -> None:
    """tabby-node as the DaemonSet runs it, in the container's own network namespace
    (privileged there): it serves its socket, programs its nftables table through the
    image's libnftables (mapped into the process) and supervises the image's BIRD."""
    proc = containerd.run(archive.ref, "sh", "-c", NODE_SCRIPT, privileged=True)
    said = proc.stdout + proc.stderr
    assert proc.returncode == 0, said
    assert re.search(r"^/usr/lib/\S+/libnftables\.so\.1", said, re.M), said
    assert "table inet tabby" in said, said
    assert "BACKEND    bird" in said, said
    assert "started BIRD" in said, said
    assert "serving /tmp/run/node.sock" in said, said
    assert "tabby-node stopped after" in said, said


def test_bundle_is_relocatable(containerd: PrivateContainerd, archive: Archive) -> None:
    """What the install step does: copy /opt/tabby elsewhere and run it from there."""
    script = (
        "cp -a /opt/tabby /tmp/moved && ln -s /tmp/moved/tabby /tmp/tabbyctl && "
        "/tmp/tabbyctl version"
    )
    proc = containerd.run(archive.ref, "sh", "-c", script)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("tabby "), proc.stdout


# -- podman ----------------------------------------------------------------------------------------


def test_podman_loads_the_image(archive: Archive, workdir: Path) -> None:
    base = workdir / "podman"
    for d in ("root", "runroot", "tmp", "bigtmp"):
        (base / d).mkdir(parents=True)
    node = Node()
    node.start()
    try:
        podman = [
            "env", f"TMPDIR={base / 'bigtmp'}",
            "podman", "--root", str(base / "root"), "--runroot", str(base / "runroot"),
            "--tmpdir", str(base / "tmp"), "--storage-driver", "vfs",
            "--events-backend", "none", "--cgroup-manager", "cgroupfs",
        ]  # fmt: skip
        loaded = node.run([*podman, "load", "-i", str(archive.path)], timeout=300)
        assert archive.ref in loaded.stdout + loaded.stderr
        listed = node.run([*podman, "images", "--format", "{{.Repository}}:{{.Tag}}"]).stdout
        assert archive.ref in listed.split()
        inspected = node.run([*podman, "image", "inspect", archive.ref]).stdout
        (info,) = json.loads(inspected)
        assert info["Config"]["Entrypoint"] == ["/usr/local/bin/tabby-node"]
        assert len(info["RootFS"]["Layers"]) == 2
    finally:
        node.stop()
        left = mounts_under(base) + [str(p) for p in pids_with_cmdline(str(base))]
        shutil.rmtree(base, ignore_errors=True)
    assert not left, f"podman left state behind: {left}"
