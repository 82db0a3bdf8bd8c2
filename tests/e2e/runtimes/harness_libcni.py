"""The libcni driver: cnitool bound to one node, and a helper that serves a command until a
block ends."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .harness_base import TOOLS_BIN, stop_pid
from .harness_node import Node


@dataclass
class CniReply:
    verb: str
    returncode: int
    stdout: str
    stderr: str

    @property
    def ok(self) -> bool:
        return self.returncode == 0

    def json(self) -> dict[str, Any]:
        return dict(json.loads(self.stdout))

    def expect_ok(self) -> CniReply:
        assert self.ok, f"cnitool {self.verb} failed ({self.returncode}): {self.stderr.strip()}"
        return self

    def error(self) -> dict[str, Any]:
        """The plugin's CNI error (code, msg, details) of a failed call."""
        assert not self.ok, f"cnitool {self.verb} unexpectedly succeeded: {self.stdout}"
        assert self.stdout.strip(), f"no CNI error JSON from cnitool {self.verb}: {self.stderr}"
        return self.json()


@dataclass
class CniTool:
    """cnitool bound to one node, conflist dir, plugin path and cache dir."""

    node: Node
    conf_dir: Path
    cache_dir: Path
    plugin_dirs: list[str]
    binary: Path = TOOLS_BIN / "cnitool"
    # Attachments added and not yet deleted:
    # (network, container id, ifname) -> (netns, CNI_ARGS/CAP_ARGS env, conflist dir).
    attached: dict[tuple[str, str, str], tuple[str, dict[str, str], Path]] = field(
        default_factory=dict
    )

    def install(self, conf: dict[str, Any], filename: str = "10-tabby.conflist") -> Path:
        self.conf_dir.mkdir(parents=True, exist_ok=True)
        path = self.conf_dir / filename
        path.write_text(json.dumps(conf, indent=2) + "\n")
        return path

    def __call__(
        self,
        verb: str,
        network: str,
        netns: str,
        *,
        container_id: str,
        ifname: str = "eth0",
        cni_args: dict[str, str] | None = None,
        cap_args: dict[str, Any] | None = None,
    ) -> CniReply:
        env = dict(os.environ)
        env.pop("CNI_ARGS", None)
        env.pop("CAP_ARGS", None)
        if cni_args:
            env["CNI_ARGS"] = ";".join(f"{k}={v}" for k, v in cni_args.items())
        if cap_args:
            env["CAP_ARGS"] = json.dumps(cap_args)
        args = [
            str(self.binary),
            "--conf-dir",
            str(self.conf_dir),
            "--path",
            ":".join(self.plugin_dirs),
            "--cache-dir",
            str(self.cache_dir),
            "--ifname",
            ifname,
            "--container-id",
            container_id,
            verb,
            network,
            netns,
        ]
        proc = self.node.run(args, check=False, env=env, timeout=120)
        key = (network, container_id, ifname)
        if verb == "add":
            # Like a runtime: whatever it tried to add, it deletes (a failed ADD too).
            self.attached[key] = (
                netns,
                {k: env[k] for k in ("CNI_ARGS", "CAP_ARGS") if k in env},
                self.conf_dir,
            )
        elif verb == "del" and proc.returncode == 0:
            self.attached.pop(key, None)
        return CniReply(verb, proc.returncode, proc.stdout, proc.stderr)

    def cleanup(self) -> list[str]:
        """DEL every attachment a test left behind (after a failure); return the failures."""
        failures = []
        for (network, cid, ifname), (netns, extra, conf_dir) in list(self.attached.items()):
            env = dict(os.environ)
            env.pop("CNI_ARGS", None)
            env.pop("CAP_ARGS", None)
            env.update(extra)
            args = [
                str(self.binary),
                "--conf-dir",
                str(conf_dir),
                "--path",
                ":".join(self.plugin_dirs),
                "--cache-dir",
                str(self.cache_dir),
                "--ifname",
                ifname,
                "--container-id",
                cid,
                "del",
                network,
                netns,
            ]
            proc = self.node.run(args, check=False, env=env, timeout=120)
            if proc.returncode != 0:
                failures.append(f"DEL {network}/{cid}/{ifname}: {proc.stderr.strip()}")
            self.attached.pop((network, cid, ifname), None)
        return failures

    def validate(self, network: str) -> CniReply:
        args = [
            str(self.binary),
            "--conf-dir",
            str(self.conf_dir),
            "--path",
            ":".join(self.plugin_dirs),
            "validate",
            network,
        ]
        proc = self.node.run(args, check=False)
        return CniReply("validate", proc.returncode, proc.stdout, proc.stderr)

    def cache_file(self, network: str, container_id: str, ifname: str = "eth0") -> Path:
        return self.cache_dir / "results" / f"{network}-{container_id}-{ifname}"


@contextlib.contextmanager
def serving(
    cmd: Sequence[str], *, ready: str = "ready", timeout: float = 10.0
) -> Iterator[subprocess.Popen[str]]:
    """Run a server command (e.g. Node.in_pod(...)) until the block ends; it must print the
    line `ready` once it listens. Stopped by its PID, pipes closed."""
    with subprocess.Popen(
        list(cmd),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline().strip()
            if line != ready:
                stop_pid(proc, grace=1)
                err = proc.stderr.read() if proc.stderr else ""
                raise AssertionError(f"server did not start: {line!r} {err!r}")
            yield proc
        finally:
            stop_pid(proc, grace=3)
