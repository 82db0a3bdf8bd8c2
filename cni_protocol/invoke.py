"""Exec a delegated plugin the way the spec says (CNI spec §4; CONFORMANCE.md
"IPAM delegation").

Same environment with only CNI_COMMAND changed (and IgnoreUnknown=1 added to CNI_ARGS,
IPM-6), the same stdin bytes, the delegate's stderr passed through to ours (IPM-3; in
tabby-node, to the call's captured stderr, which the node relays to its caller); its
error is passed on with its own code, never re-wrapped (IPM-4).
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from . import log
from .args import with_ignore_unknown
from .errors import CniError, Code

if TYPE_CHECKING:
    from bundle.types import JSON


def find_plugin(plugin_type: str, path: Sequence[str]) -> str:
    if not plugin_type or "/" in plugin_type or plugin_type in (".", ".."):
        raise CniError(
            Code.INVALID_CONFIG,
            "invalid plugin type",
            f"type {plugin_type!r} must be a plain binary name",
        )
    for d in path:
        candidate = os.path.join(d, plugin_type)
        if os.path.isfile(candidate) and os.access(candidate, os.X_OK):
            return candidate
    raise CniError(
        Code.DELEGATE_FAILED,
        f"failed to find plugin {plugin_type!r} in path",
        f"searched CNI_PATH {list(path)}",
    )


def delegate_env(env: Mapping[str, str], command: str) -> dict[str, str]:
    """The caller's environment with only CNI_COMMAND changed and IgnoreUnknown=1 (IPM-6)."""
    child_env = dict(env)
    child_env["CNI_COMMAND"] = command
    child_env["CNI_ARGS"] = with_ignore_unknown(env.get("CNI_ARGS", ""))
    return child_env


class Running:
    """A delegate started with its stdin written; ``result()`` waits for its answer."""

    def __init__(
        self, plugin_type: str, command: str, binary: str, proc: subprocess.Popen[bytes]
    ) -> None:
        self.plugin_type = plugin_type
        self.command = command
        self.binary = binary
        self.proc = proc

    def result(self) -> JSON | None:
        assert self.proc.stdout is not None
        with self.proc.stdout:
            out = self.proc.stdout.read()
        returncode = self.proc.wait()
        return parse_output(self.plugin_type, self.command, returncode, out)


def start_plugin(
    plugin_type: str, command: str, stdin: bytes, env: Mapping[str, str], path: Sequence[str]
) -> Running:
    """Exec the delegate and hand it its stdin, without waiting for it: the caller can do
    other work (tabby imports its dataplane) while the delegate runs."""
    binary = find_plugin(plugin_type, path)
    try:
        proc = subprocess.Popen(
            [binary],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=log.stderr_capture_fd(),  # None: ours, inherited
            env=delegate_env(env, command),
        )
    except OSError as e:
        raise CniError(
            Code.DELEGATE_FAILED, f"failed to execute {plugin_type}", f"{binary}: {e}"
        ) from None
    assert proc.stdin is not None
    try:
        # The delegate reads all of stdin first thing, so this never waits for long.
        proc.stdin.write(stdin)
    except BrokenPipeError:
        pass  # it exited early; its exit status and stdout tell why
    finally:
        try:
            proc.stdin.close()
        except BrokenPipeError:
            pass
    return Running(plugin_type, command, binary, proc)


def exec_plugin(
    plugin_type: str, command: str, stdin: bytes, env: Mapping[str, str], path: Sequence[str]
) -> JSON | None:
    """Run the delegate; return its parsed stdout (None if empty) or raise its CniError."""
    return start_plugin(plugin_type, command, stdin, env, path).result()


def parse_output(plugin_type: str, command: str, returncode: int, stdout: bytes) -> JSON | None:
    """A delegate's answer: its result, or its own CniError passed on unchanged (IPM-4)."""
    out = stdout.strip()
    parsed: object = None
    if out:
        try:
            parsed = json.loads(out)
        except ValueError:
            raise CniError(
                Code.DELEGATE_FAILED,
                f"{plugin_type} {command} printed garbage",
                f"exit {returncode}, stdout {out[:500]!r}",
            ) from None
    if returncode != 0:
        if isinstance(parsed, dict) and isinstance(parsed.get("code"), int):
            raise CniError(
                parsed["code"], str(parsed.get("msg", "")), str(parsed.get("details", ""))
            )
        raise CniError(
            Code.DELEGATE_FAILED,
            f"{plugin_type} {command} failed",
            f"exit status {returncode}, no CNI error on stdout",
        )
    if parsed is not None and not isinstance(parsed, dict):
        raise CniError(
            Code.DELEGATE_FAILED,
            f"{plugin_type} {command} printed a non-object",
            repr(parsed)[:500],
        )
    return parsed
