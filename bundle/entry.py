"""Process entry for every tabby program, chosen by the name it was exec'd as.

One frozen bundle serves ``tabby``, ``tabby-ipam``, ``tabbyctl``, ``tabby-node``,
``tabby-kube-controllers`` and ``tabby-typha`` (Calico
does the same with calico/calico-ipam): ``/opt/cni/bin/tabby`` and ``tabby-ipam`` are
symlinks into the bundle. Everything heavy is imported only by the role that needs it;
VERSION imports nothing beyond the skel.
"""

from __future__ import annotations

import os
import sys

ROLES = (
    "tabby",
    "tabby-ipam",
    "tabbyctl",
    "tabby-node",
    "tabby-kube-controllers",
    "tabby-typha",
)
ABOUT = {
    "tabby": "tabby CNI plugin: Calico-style veth + /32 routes, delegates IPAM",
    "tabby-ipam": "tabby-ipam CNI IPAM plugin: node-affine address blocks",
}


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]


def _read_stdin() -> bytes | None:
    chunks: list[bytes] = []
    try:
        while True:
            chunk = os.read(0, 65536)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
    except OSError:
        return None


def cni_main(role: str) -> int:
    """Run one CNI call as ``role``. Only the result (or error) JSON reaches fd 1."""
    # Anything written to fd 1 by any library (or C code) lands on stderr from here on; the
    # one JSON document goes to the saved descriptor (GEN-5 of cni_protocol/CONFORMANCE.md).
    out_fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    env = os.environ
    command = env.get("CNI_COMMAND", "")
    stdin = _read_stdin() if command else b""
    if stdin is not None and command == "VERSION":
        # Answered here with the fewest imports: runtimes probe every plugin with VERSION
        # (podman does it for every network at every start), and it must work on a broken
        # node (no store, no log directory: VER-4).
        _write_all(out_fd, _version_answer(stdin))
        return 0
    node_absent = True  # no tabby-node asked (VERSION, no command)
    if stdin is not None and command in ("ADD", "DEL", "CHECK", "GC", "STATUS"):
        # Fast path: a resident tabby-node runs the call with everything warm.
        import time

        from bundle import __version__
        from tabby_node import SOCKET_ENV
        from tabby_node.client import ABSENT, try_node

        asked = time.monotonic()
        why: list[str] = []
        served = try_node(role, env, stdin, __version__, why=why)
        node_absent = why == [ABSENT]
        if served is not None:
            _write_all(out_fd, served[1])
            return served[0]
        if time.monotonic() - asked > 1.0:
            # The node did not take the call in time (wedged): the delegate this call execs
            # (tabby-ipam) inherits our environment and must not wait for it again.
            os.environ[SOCKET_ENV] = "off"

    from cni_protocol import log, skel
    from cni_protocol.errors import CniError, Code

    log.setup(stderr=True, path=None)
    if not command:
        sys.stderr.write(
            f"{ABOUT.get(role, role)}\nCNI protocol versions supported: "
            "0.3.0, 0.3.1, 0.4.0, 1.0.0, 1.1.0\n"
        )
    if stdin is None:
        err = CniError(Code.IO_FAILURE, "failed to read network configuration from stdin")
        _write_all(out_fd, skel.dump(err.to_dict("1.1.0")))
        return 1
    rc, out = _dispatch(role, env, stdin, node_absent)
    _write_all(out_fd, out)
    return rc


def _version_answer(stdin: bytes) -> bytes:
    import json

    from cni_protocol.version import version_reply

    try:
        requested = json.loads(stdin).get("cniVersion") if stdin.strip() else None
    except Exception:
        requested = None
    return json.dumps(version_reply(requested), separators=(",", ":")).encode() + b"\n"


def _dispatch(
    role: str, env: os._Environ[str], stdin: bytes, node_absent: bool
) -> tuple[int, bytes]:
    """Run the call here; ``node_absent``: no tabby-node listens (not one that did not take
    the call), so an ADD must mind tabby-node's policy table (``cni_plugin.plugin``)."""
    from cni_protocol import skel
    from cni_protocol.errors import CniError, Code

    try:
        if role == "tabby-ipam":
            from ipam import plugin as ipam_plugin

            handlers, configure = ipam_plugin.HANDLERS, ipam_plugin.configure_logging
        else:
            from cni_plugin import plugin

            handlers, configure = plugin.unserved_handlers(node_absent), plugin.configure_logging
    except Exception as e:  # a broken install must still answer with one error JSON
        import logging

        logging.getLogger("tabby").exception("cannot load the %s handlers", role)
        err = CniError(
            Code.INTERNAL, f"{role} is broken: cannot load its code", f"{type(e).__name__}: {e}"
        )
        return 1, skel.dump(err.to_dict(skel.sniff_version(stdin)))
    return skel.run(handlers, env, stdin, own_netns=skel.own_netns_id(), before_dispatch=configure)


def role_from_argv0(argv0: str) -> str:
    name = os.path.basename(argv0)
    return name if name in ROLES else os.environ.get("TABBY_ROLE", "tabby")


def main() -> None:
    from bundle import environ

    # Children (BIRD, nft, delegated plugins) get the environment we were given, not the
    # bundle's library path (bundle/environ.py).
    environ.restore()
    role = role_from_argv0(sys.argv[0])
    if role == "tabbyctl":
        main_ctl()
    elif role == "tabby-node":
        main_node()
    elif role == "tabby-kube-controllers":
        main_controllers()
    elif role == "tabby-typha":
        main_typha()
    else:
        _exit_now(cni_main(role))


def main_ipam() -> None:
    from bundle import environ

    environ.restore()
    _exit_now(cni_main("tabby-ipam"))


def _exit_now(rc: int) -> None:
    """Leave without interpreter teardown (~5 ms per call): every byte of output was
    written with os.write, and the log handlers write each record the same way."""
    try:
        sys.stderr.flush()
    finally:
        os._exit(rc)


def main_ctl() -> None:
    try:
        from tabbyctl.cli import main as ctl
    except KeyboardInterrupt:  # Ctrl-C while starting: nothing done yet, no traceback
        sys.exit(130)
    ctl()


def main_node() -> None:
    from tabby_node.main import main as node

    sys.exit(node())


def main_controllers() -> None:
    from kube_controllers.controller import main as controllers

    sys.exit(controllers())


def main_typha() -> None:
    from typha.main import main as typha

    sys.exit(typha())
