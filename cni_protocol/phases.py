"""Where one CNI call's time goes: wall time per phase, kept for the calling thread.

tabby-node times every call it serves (:func:`begin`, then :func:`end` with the whole
call's time): the verbs add the phases they run in that thread (:func:`timed`, :func:`add`)
and the server derives the rest, its own work (framing, namespace entry, the thread
hand-offs, parsing and rendering). A standalone binary never calls :func:`begin`: then
recording costs one attribute lookup and keeps nothing.

Phases (``PHASES``):

* ``ipam``: the IPAM verb, its durable write included.
* ``netlink``: the kernel side of the attachment (veth, addresses, routes, sysctls);
  ``netlink_wait``: the part of it on the call's path. An ADD makes the veth pair beside
  the IPAM call (only the configuration that follows, and the wait for the pair, count); a
  DEL tears the attachment down beside the IPAM call (only the wait once the IPAM call is
  done counts); CHECK's is all on the path (:func:`on_path`).
* ``endpoint``: the WorkloadEndpoint write (a DEL: its removal) and, in tabby-node, the
  pod's policy. An ADD and a DEL run it beside ``netlink``: only ``endpoint_wait``, the
  time the call waited for it once the kernel side was done, is on the call's path.
* ``server``: the rest of the call (:func:`end` computes it).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

PHASES = ("ipam", "netlink", "netlink_wait", "endpoint", "endpoint_wait", "server")
#: The phases on a call's path (``netlink`` and ``endpoint`` overlap others: their waits are).
ON_PATH = ("ipam", "netlink_wait", "endpoint_wait")

_call = threading.local()


def begin() -> None:
    """Record the phases of the call this thread runs from now on."""
    _call.phases = {}


def add(phase: str, seconds: float) -> None:
    """Count ``seconds`` to ``phase`` of this thread's call (nothing when not recording)."""
    phases: dict[str, float] | None = getattr(_call, "phases", None)
    if phases is not None:
        phases[phase] = phases.get(phase, 0.0) + seconds


def on_path(phase: str, seconds: float) -> None:
    """``seconds`` of ``phase`` that the call waited for whole: to ``phase`` and to
    ``<phase>_wait``."""
    add(phase, seconds)
    add(f"{phase}_wait", seconds)


@contextmanager
def timed(phase: str, *, waited: bool = False) -> Iterator[None]:
    """The block's wall time counts to ``phase``, also when it raises; ``waited``: the call
    waited for all of it (:func:`on_path`)."""
    started = time.perf_counter()
    try:
        yield
    finally:
        (on_path if waited else add)(phase, time.perf_counter() - started)


def end(total: float) -> dict[str, float]:
    """Stop recording; the call's phases, with ``server``: ``total`` less the phases on the
    call's path."""
    phases: dict[str, float] = getattr(_call, "phases", None) or {}
    _call.phases = None
    phases["server"] = max(0.0, total - sum(phases.get(p, 0.0) for p in ON_PATH))
    return phases
