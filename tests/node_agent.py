"""tabby-node for tests that only need it to serve CNI calls: in a network namespace of its
own (its nftables table and anything else it programs stay there, never on the machine),
backend ``none``, its state, run directory and datastore under the test's directory, no
HTTP ports. The CNI calls it serves still run in their callers' namespaces (the client
passes them), and use the datastore their own configuration names.

Stopped by PID (SIGTERM, then SIGKILL), and its namespace deleted, also on failure.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from collections.abc import Sequence


def agent_argv(
    binary: Sequence[str], workdir: str, socket: str, log: str, nodename: str = "test-node"
) -> list[str]:
    return [
        *binary,
        "--socket",
        socket,
        "--log-file",
        log,
        "--backend",
        "none",
        "--nodename",
        nodename,
        "--state-dir",
        os.path.join(workdir, "agent-state"),
        "--run-dir",
        os.path.dirname(socket),
        "--data-dir",
        os.path.join(workdir, "agent-store"),
        "--metrics-port",
        "0",
        "--health-port",
        "0",
    ]


class IsolatedNode:
    """One tabby-node in its own namespace; ``stop()`` returns what it wrote on stderr."""

    def __init__(
        self,
        binary: Sequence[str],
        workdir: str,
        socket: str,
        log: str,
        *,
        cwd: str | None = None,
        wait: bool = True,
    ) -> None:
        self.socket = socket
        self.stderr: str | None = None
        self.netns = f"tby{os.getpid()}-agent-{secrets.token_hex(3)}"
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        subprocess.run(["ip", "-n", self.netns, "link", "set", "lo", "up"], check=True)
        os.makedirs(os.path.dirname(socket), mode=0o700, exist_ok=True)
        try:
            self.proc = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, *agent_argv(binary, workdir, socket, log)],
                cwd=cwd,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
            )
        except BaseException:
            self._delete_netns()
            raise
        if wait:
            self.wait_serving()

    def wait_serving(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"tabby-node did not start: {self.stop()}")
            time.sleep(0.05)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> str:
        if self.stderr is not None:
            return self.stderr
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)
                try:
                    self.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
            assert self.proc.stderr is not None
            with self.proc.stderr:
                self.stderr = self.proc.stderr.read().decode(errors="replace")
        finally:
            self._delete_netns()
        return self.stderr

    def _delete_netns(self) -> None:
        subprocess.run(["ip", "netns", "delete", self.netns], check=False, capture_output=True)
