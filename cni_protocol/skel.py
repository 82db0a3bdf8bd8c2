"""The protocol skeleton shared by ``tabby`` and ``tabby-ipam``.

All I/O is injected (env mapping, stdin bytes, stdout/stderr writers) so every path is
testable in-process and the same code can later be served by a resident process.
``run`` validates the call (env table, container id, ifname, JSON, version gates, network
name, netns), dispatches to a handler, and turns every failure into exactly one error JSON
on stdout with exit status 1. It never raises and never prints a traceback.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from . import version as ver
from .errors import CniError, Code

if TYPE_CHECKING:
    from bundle.types import JSON

log = logging.getLogger("tabby.skel")

VERBS = ("ADD", "DEL", "CHECK", "GC", "STATUS", "VERSION")

# Required variables per verb (CONFORMANCE.md ENV-2). CNI_PATH is required where a plugin may
# delegate (libcni's skel requires it for all but VERSION; so do we).
REQUIRED_ENV: dict[str, tuple[str, ...]] = {
    "ADD": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "DEL": ("CNI_CONTAINERID", "CNI_IFNAME", "CNI_PATH"),
    "CHECK": ("CNI_CONTAINERID", "CNI_NETNS", "CNI_IFNAME", "CNI_PATH"),
    "GC": ("CNI_PATH",),
    "STATUS": ("CNI_PATH",),
    "VERSION": (),
}
# Minimum config version per verb (CHK-1, GC-1, STA-1).
MIN_VERSION = {"CHECK": "0.4.0", "GC": "1.1.0", "STATUS": "1.1.0"}

_ID_RE = re.compile(r"^[a-zA-Z0-9][a-zA-Z0-9_.\-]*$")
#: The deepest nesting of lists and objects a configuration may have (a conflist's is 4-6:
#: prevResult's routes, runtimeConfig's port mappings); deeper is refused as undecodable
#: before any code walks it (recursion in the models, the known-configuration hash).
MAX_DEPTH = 32
_TOO_DEEP = object()


class CmdArgs:
    """One validated CNI call."""

    __slots__ = (
        "args",
        "cni_version",
        "command",
        "config",
        "container_id",
        "env",
        "ifname",
        "netns",
        "parsed",
        "path",
        "stdin",
    )

    def __init__(
        self,
        *,
        command: str,
        container_id: str,
        netns: str,
        ifname: str,
        args: str,
        path: list[str],
        stdin: bytes,
        config: JSON,
        cni_version: str,
        env: Mapping[str, str],
    ) -> None:
        self.command = command
        self.container_id = container_id
        self.netns = netns
        self.ifname = ifname
        self.args = args
        self.path = path
        self.stdin = stdin
        self.config = config
        self.cni_version = cni_version
        self.env = env
        #: The plugin's validated configuration model, once a plugin has parsed it (cached
        #: here so that logging set-up and the verb share one validation).
        self.parsed: object = None

    @property
    def network(self) -> str:
        return str(self.config.get("name", ""))

    def delegated(self, command: str, env: Mapping[str, str]) -> CmdArgs:
        """The same call as a delegated plugin gets it (``command``, ``env``: the
        caller's environment as ``invoke.delegate_env`` makes it), its stdin already
        parsed (the configuration is shared: no plugin changes it); the delegate's own
        configuration model is not cached yet."""
        return CmdArgs(
            command=command,
            container_id=self.container_id,
            netns=self.netns,
            ifname=self.ifname,
            args=env.get("CNI_ARGS", ""),
            path=self.path,
            stdin=self.stdin,
            config=self.config,
            cni_version=self.cni_version,
            env=env,
        )


Handler = Callable[[CmdArgs], "JSON | None"]


class Handlers:
    """The verbs a plugin implements. A handler returns the result object to print, or None."""

    def __init__(
        self, *, add: Handler, delete: Handler, check: Handler, gc: Handler, status: Handler
    ) -> None:
        self.by_verb: dict[str, Handler] = {
            "ADD": add,
            "DEL": delete,
            "CHECK": check,
            "GC": gc,
            "STATUS": status,
        }


def validate_container_id(value: str) -> None:
    if not _ID_RE.match(value):
        raise CniError(
            Code.INVALID_ENV,
            "invalid CNI_CONTAINERID",
            f"CNI_CONTAINERID {value!r} must match {_ID_RE.pattern}",
        )


def validate_ifname(value: str) -> None:
    problem = ""
    # surrogateescape: the environment's bytes as the kernel will see them (a name that is
    # not UTF-8 arrives as lone surrogates, which plain encode() refuses)
    if len(value.encode("utf-8", "surrogateescape")) > 15:
        problem = "longer than 15 bytes"
    elif value in (".", ".."):
        problem = "'.' and '..' are not interface names"
    elif any(c in value for c in "/:") or any(c.isspace() for c in value):
        problem = "contains '/', ':' or whitespace"
    if problem:
        raise CniError(Code.INVALID_ENV, "invalid CNI_IFNAME", f"CNI_IFNAME {value!r}: {problem}")


def validate_network_name(name: object) -> None:
    if not isinstance(name, str) or not _ID_RE.match(name):
        raise CniError(
            Code.INVALID_CONFIG,
            "invalid network name",
            f"name {name!r} must be non-empty and match {_ID_RE.pattern}",
        )


def _too_deep(value: object) -> bool:
    """True when lists and objects nest deeper than MAX_DEPTH in ``value`` (iterative)."""
    level: list[object] = [value]
    for _ in range(MAX_DEPTH):
        level = [
            child
            for v in level
            if isinstance(v, dict | list)
            for child in (v.values() if isinstance(v, dict) else v)
        ]
        if not level:
            return False
    return any(isinstance(v, dict | list) for v in level)


def _same_netns(path: str, own: tuple[int, int] | None) -> bool:
    if own is None:
        return False
    try:
        st = os.stat(path)
    except OSError:
        return False  # a missing netns is judged by the verb (DEL: success)
    return (st.st_dev, st.st_ino) == own


def own_netns_id() -> tuple[int, int] | None:
    try:
        st = os.stat("/proc/self/ns/net")
    except OSError:
        return None
    return st.st_dev, st.st_ino


def build_args(
    env: Mapping[str, str], stdin: bytes, *, own_netns: tuple[int, int] | None = None
) -> CmdArgs:
    """Validate one call. Raises CniError; ``cni_version`` is filled in as early as known."""
    command = env.get("CNI_COMMAND", "")
    if command not in VERBS:
        raise CniError(
            Code.INVALID_ENV,
            "invalid CNI_COMMAND",
            f"CNI_COMMAND {command!r} is not one of {', '.join(VERBS)}",
        )
    missing = [k for k in REQUIRED_ENV[command] if not env.get(k)]
    if missing:
        raise CniError(
            Code.INVALID_ENV,
            f"required env variables missing: {', '.join(missing)}",
            f"{command} needs {', '.join(REQUIRED_ENV[command])}",
        )
    container_id = env.get("CNI_CONTAINERID", "")
    ifname = env.get("CNI_IFNAME", "")
    if command in ("ADD", "DEL", "CHECK"):
        validate_container_id(container_id)
        validate_ifname(ifname)
    try:
        config = json.loads(stdin)
    except (ValueError, UnicodeDecodeError) as e:
        raise CniError(
            Code.DECODE_FAILURE, "failed to parse network configuration", str(e)
        ) from None
    except RecursionError:
        config = _TOO_DEEP  # nested past the parser's own stack
    if config is _TOO_DEEP or (isinstance(config, dict) and _too_deep(config)):
        raise CniError(
            Code.DECODE_FAILURE,
            "network configuration is nested too deeply",
            f"lists and objects nest at most {MAX_DEPTH} levels deep",
        )
    if not isinstance(config, dict):
        raise CniError(Code.DECODE_FAILURE, "network configuration is not a JSON object")
    if "cniVersion" not in config:
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            "incompatible CNI versions",
            f"config has no cniVersion (means 0.1.0); plugin supports "
            f"{list(ver.SUPPORTED_VERSIONS)}",
        )
    cni_version = config["cniVersion"]
    ver.parse(cni_version)
    if cni_version not in ver.SUPPORTED_VERSIONS:
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            "incompatible CNI versions",
            f"config is {cni_version!r}, plugin supports {list(ver.SUPPORTED_VERSIONS)}",
        )
    minimum = MIN_VERSION.get(command)
    if minimum and not ver.at_least(cni_version, minimum):
        raise CniError(
            Code.INCOMPATIBLE_VERSION,
            f"config version does not allow {command}",
            f"{command} needs cniVersion >= {minimum}, config is {cni_version}",
        )
    validate_network_name(config.get("name"))
    netns = env.get("CNI_NETNS", "")
    if (
        command in ("ADD", "DEL", "CHECK")
        and netns
        and not env.get("CNI_NETNS_OVERRIDE")
        and _same_netns(netns, own_netns)
    ):
        raise CniError(
            Code.INVALID_NETNS,
            "invalid netns",
            f"CNI_NETNS {netns!r} is the plugin's own network namespace",
        )
    path = [p for p in env.get("CNI_PATH", "").split(":") if p]
    return CmdArgs(
        command=command,
        container_id=container_id,
        netns=netns,
        ifname=ifname,
        args=env.get("CNI_ARGS", ""),
        path=path,
        stdin=stdin,
        config=config,
        cni_version=cni_version,
        env=env,
    )


def sniff_version(stdin: bytes) -> str:
    """The version to write an error in: the request's, if it is one we speak (GEN-8)."""
    try:
        v = json.loads(stdin).get("cniVersion")
    except Exception:
        return ver.CURRENT
    return v if v in ver.SUPPORTED_VERSIONS else ver.CURRENT


def dump(obj: Mapping[str, object]) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode() + b"\n"


def call(handlers: Handlers, args: CmdArgs) -> JSON | None:
    """One verb on arguments already built (a delegate run in-process: ``CmdArgs.delegated``):
    its result, or its ``CniError``; anything else it raises is the internal error ``run``
    would have printed."""
    try:
        return handlers.by_verb[args.command](args)
    except CniError:
        raise
    except Exception as e:
        log.exception("internal error")
        raise CniError(Code.INTERNAL, "internal error", f"{type(e).__name__}: {e}") from None


def run(
    handlers: Handlers,
    env: Mapping[str, str],
    stdin: bytes,
    *,
    own_netns: tuple[int, int] | None = None,
    before_dispatch: Callable[[CmdArgs], None] | None = None,
) -> tuple[int, bytes]:
    """Execute one CNI call. Returns (exit status, bytes for stdout). Never raises."""
    if env.get("CNI_COMMAND") == "VERSION":
        # VERSION touches nothing and validates nothing (ENV-8, VER-4).
        try:
            requested = json.loads(stdin).get("cniVersion") if stdin.strip() else None
        except Exception:
            requested = None
        return 0, dump(ver.version_reply(requested))
    cni_version = sniff_version(stdin)
    try:
        args = build_args(env, stdin, own_netns=own_netns)
        cni_version = args.cni_version
        if before_dispatch is not None:
            before_dispatch(args)
        result = handlers.by_verb[args.command](args)
        return 0, (dump(result) if result is not None else b"")
    except CniError as e:
        log.error("%s failed: code %d: %s", env.get("CNI_COMMAND"), e.code, e)
        return 1, dump(e.to_dict(cni_version))
    except Exception as e:
        log.exception("internal error")
        err = CniError(Code.INTERNAL, "internal error", f"{type(e).__name__}: {e}")
        return 1, dump(err.to_dict(cni_version))
