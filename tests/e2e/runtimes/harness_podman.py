"""podman (CNI backend) inside the node, with a private configuration, storage and state."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .harness_base import pids_with_cmdline, run
from .harness_node import Node


class Podman:
    """podman inside the node, configured only by files under base: containers.conf (CNI
    backend, plugin dirs, cgroupfs, runc, file events, ulimits root may set), storage.conf (vfs
    under base), its own --root/--runroot/--tmpdir and network config dir. The machine's
    /etc/containers is never read for these settings nor written."""

    IMAGE = "localhost/tabby-e2e/busybox:1"

    def __init__(self, node: Node, base: Path, plugin_dirs: list[str]) -> None:
        self.node = node
        self.base = base
        self.root = base / "root"
        self.runroot = base / "run"
        self.tmpdir = base / "tmp"
        self.net_dir = base / "net.d"
        for d in (self.root, self.runroot, self.tmpdir, self.net_dir):
            d.mkdir(parents=True, exist_ok=True)
        dirs = ", ".join(json.dumps(d) for d in plugin_dirs)
        self.containers_conf = base / "containers.conf"
        self.containers_conf.write_text(f"""\
[containers]
default_ulimits = ["nofile=20000:20000", "nproc=32768:32768"]
log_driver = "k8s-file"

[engine]
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = {json.dumps(str(base / "events.log"))}
runtime = "runc"
tmp_dir = {json.dumps(str(self.tmpdir))}

[network]
network_backend = "cni"
cni_plugin_dirs = [{dirs}]
network_config_dir = {json.dumps(str(self.net_dir))}
""")
        self.storage_conf = base / "storage.conf"
        self.storage_conf.write_text(f"""\
[storage]
driver = "vfs"
graphroot = {json.dumps(str(self.root))}
runroot = {json.dumps(str(self.runroot))}
""")
        self.registries_conf = base / "registries.conf"
        self.registries_conf.write_text("unqualified-search-registries = []\n")

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            CONTAINERS_CONF=str(self.containers_conf),
            CONTAINERS_STORAGE_CONF=str(self.storage_conf),
            CONTAINERS_REGISTRIES_CONF=str(self.registries_conf),
        )
        return env

    def cmd(self, args: Sequence[str]) -> list[str]:
        return self.node.cmd(
            [
                "podman",
                "--root",
                str(self.root),
                "--runroot",
                str(self.runroot),
                "--tmpdir",
                str(self.tmpdir),
                "--storage-driver",
                "vfs",
                "--network-config-dir",
                str(self.net_dir),
                "--cgroup-manager",
                "cgroupfs",
                "--events-backend",
                "file",
                "--runtime",
                "runc",
                *args,
            ]
        )

    def __call__(
        self,
        *args: str,
        check: bool = True,
        timeout: float = 120,
    ) -> subprocess.CompletedProcess[str]:
        return run(self.cmd(args), check=check, timeout=timeout, env=self.env())

    def import_image(self, rootfs_tar: Path) -> None:
        self(
            "import",
            "--change",
            "ENTRYPOINT []",
            "--change",
            'CMD ["/pause"]',
            str(rootfs_tar),
            self.IMAGE,
        )

    def install_network(self, conf: dict[str, Any], filename: str = "10-tabby.conflist") -> None:
        (self.net_dir / filename).write_text(json.dumps(conf, indent=2) + "\n")

    def inspect(self, name: str) -> dict[str, Any]:
        return dict(json.loads(self("container", "inspect", name).stdout)[0])

    def ip_of(self, name: str, network: str) -> str:
        nets = self.inspect(name)["NetworkSettings"]["Networks"]
        assert network in nets, nets
        return str(nets[network]["IPAddress"])

    def container_ids(self) -> list[str]:
        out = self("ps", "-a", "--format", "{{.ID}}", "--no-trunc").stdout
        return out.split()

    def remove_all(self) -> None:
        if self.container_ids():
            self("rm", "--all", "--force", "--time", "0", check=False)

    def leftover_processes(self) -> list[int]:
        """conmon and container processes still tied to this podman's private dirs."""
        return pids_with_cmdline(str(self.base))
