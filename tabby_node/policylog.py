"""Denied flows on this node: what ``tabbyctl policy log`` shows.

The kernel sends the first packet of every denied flow to NFLOG group ``LOG_GROUP`` (an
endpoint chain's default deny jumps to ``log-ingress``/``log-egress``: once per flow in
``LOG_FLOW_SECONDS``, at most ``LOG_RATE`` a second node-wide; ``policy.render``). The
``policy log`` thread reads them (``dataplane.nfnetlink``), names both ends when they are
pods (by address, from the endpoints of the policy state, every node's) and the isolating
policies of the direction that denied it (the policy chains the endpoint's chain jumps to,
as programmed), and keeps the last ``RING_SIZE`` in :class:`DeniedFlows`, a ring in memory.

tabbyctl reads the ring over HTTP from the health port (127.0.0.1 only): ``GET
/policy/log?since=SEQ&wait=S`` answers ``{"node", "capacity", "first", "next",
"overruns", "entries": [...]}`` with the entries after ``SEQ`` (oldest first), waiting up to ``S``
seconds (at most 10) for one when there is none yet; ``next`` is the ``since`` of the next
request (``--follow`` asks again and again). Entries hold addresses and pod names: the
same a local process can read from the node anyway.
"""

from __future__ import annotations

import collections
import dataclasses
import json
import logging
import socket
import threading
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bundle.types import JSON

if TYPE_CHECKING:
    from daemon.http import Route
    from dataplane.nfnetlink import LoggedPacket
    from policy.engine import ClusterState
    from policy.state import PolicyDataplane

log = logging.getLogger("tabby.node")

#: Denied flows kept in memory (the newest); about 0.5 KiB each.
RING_SIZE = 1000
#: The longest a /policy/log request waits for a new entry.
MAX_WAIT = 10.0


@dataclasses.dataclass(frozen=True)
class DeniedFlow:
    """One denied flow, as ``tabbyctl policy log -o json`` prints it (``seq`` aside)."""

    seq: int
    time: float
    node: str
    src: str
    dst: str
    src_pod: str | None
    dst_pod: str | None
    protocol: str
    dport: int | None
    direction: str
    policies: tuple[str, ...]
    verdict: str = "deny"

    def to_json(self) -> dict[str, object]:
        return {
            "seq": self.seq,
            "time": iso_time(self.time),
            "node": self.node,
            "src": self.src,
            "dst": self.dst,
            "src_pod": self.src_pod,
            "dst_pod": self.dst_pod,
            "protocol": self.protocol,
            "dport": self.dport,
            "direction": self.direction,
            "verdict": self.verdict,
            "policies": list(self.policies),
        }


def iso_time(t: float) -> str:
    """``2025-01-31T12:34:56.789Z``"""
    whole = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t))
    return f"{whole}.{int(t * 1000) % 1000:03d}Z"


class DeniedFlows:
    """The ring: the newest ``capacity`` flows, numbered from 1; readers wait for new ones."""

    def __init__(self, node: str, capacity: int = RING_SIZE) -> None:
        self.node = node
        self.capacity = capacity
        self._ring: collections.deque[DeniedFlow] = collections.deque(maxlen=capacity)
        self._cond = threading.Condition()
        self.last_seq = 0
        #: Times the kernel could not hand over denied packets (tabby-node fell behind).
        self.overruns = 0

    def __len__(self) -> int:
        with self._cond:
            return len(self._ring)

    def add(
        self,
        *,
        time: float,
        src: str,
        dst: str,
        src_pod: str | None,
        dst_pod: str | None,
        protocol: str,
        dport: int | None,
        direction: str,
        policies: tuple[str, ...],
        verdict: str = "deny",
    ) -> DeniedFlow:
        """Number a denied flow (this node's) and keep it, the oldest one going (or a flow a
        Calico Log rule logged, ``verdict`` ``log``, or a staged policy would have denied,
        ``would-deny``)."""
        with self._cond:
            self.last_seq += 1
            flow = DeniedFlow(
                self.last_seq,
                time,
                self.node,
                src,
                dst,
                src_pod,
                dst_pod,
                protocol,
                dport,
                direction,
                policies,
                verdict,
            )
            self._ring.append(flow)
            self._cond.notify_all()
        return flow

    def since(self, seq: int, wait: float = 0.0) -> JSON:
        """The answer to ``GET /policy/log?since=seq&wait=wait``."""
        deadline = time.monotonic() + min(max(wait, 0.0), MAX_WAIT)
        with self._cond:
            while self.last_seq <= seq and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)
            entries = [f.to_json() for f in self._ring if f.seq > seq]
            first = self._ring[0].seq if self._ring else self.last_seq + 1
            return {
                "node": self.node,
                "capacity": self.capacity,
                "first": first,
                "next": self.last_seq,
                "overruns": self.overruns,
                "entries": entries,
            }


class Namer:
    """Pods by address and the isolating policies of an endpoint, for one policy state
    (computed again when the state changes)."""

    def __init__(self, policy: PolicyDataplane) -> None:
        self.policy = policy
        self._state: ClusterState | None = None
        self._pods: dict[str, str] = {}

    def pod(self, address: str) -> str | None:
        state = self.policy.state
        if state is not self._state:
            self._state = state
            self._pods = {}
            for e in state.endpoints if state is not None else ():
                for a in e.addresses:
                    self._pods[a] = f"{e.namespace}/{e.pod}"
        return self._pods.get(address)

    def policies(self, ifindex: int, direction: str) -> tuple[str, ...]:
        if not ifindex:
            return ()
        try:
            name = socket.if_indextoname(ifindex)
        except OSError:
            return ()  # the pod went in the meantime
        return self.policy.isolating(name, direction)


def _rule_logged(logged: LoggedPacket, namer: Namer) -> tuple[str, str, str] | None:
    """(direction, verdict, rule) of a packet a Calico Log rule or a staged policy's
    denying rule sent (``<prefix><direction> <counter>``), or None."""
    from policy.render import RULE_LOG_PREFIX, STAGED_LOG_PREFIX

    for prefix, verdict in ((RULE_LOG_PREFIX, "log"), (STAGED_LOG_PREFIX, "would-deny")):
        if logged.prefix.startswith(prefix):
            direction, _, counter = logged.prefix[len(prefix) :].strip().partition(" ")
            rule = namer.policy.rule_of_counter(counter) or counter
            return direction, verdict, rule
    return None


def record(flows: DeniedFlows, namer: Namer, logged: LoggedPacket) -> DeniedFlow | None:
    """One logged packet into the ring (None: not one of tabby's, or unreadable)."""
    from policy.render import LOG_PREFIX

    if logged.packet is None:
        return None
    by_rule = _rule_logged(logged, namer)
    if by_rule is not None:
        direction, verdict, rule = by_rule
        policies: tuple[str, ...] | None = (rule,)
    elif logged.prefix.startswith(LOG_PREFIX):
        direction, verdict, policies = logged.prefix[len(LOG_PREFIX) :].strip(), "deny", None
    else:
        return None
    if direction not in ("ingress", "egress"):
        return None
    p = logged.packet
    # the endpoint whose chain denied it: ingress dispatches on the out-interface
    ifindex = logged.outdev if direction == "ingress" else logged.indev
    if policies is None:
        policies = namer.policies(ifindex, direction)
    return flows.add(
        time=logged.received,
        src=p.src,
        dst=p.dst,
        src_pod=namer.pod(p.src),
        dst_pod=namer.pod(p.dst),
        protocol=p.protocol_name,
        dport=p.dport,
        direction=direction,
        policies=policies,
        verdict=verdict,
    )


def start(
    policy: PolicyDataplane,
    flows: DeniedFlows,
    stopping: threading.Event,
    problems: dict[str, str],
) -> threading.Thread | None:
    """The ``policy log`` thread, in the calling thread's namespace (the node's): binds
    NFLOG group LOG_GROUP at once (else says why in ``problems``: node status shows it)
    and reads it until ``stopping`` is set."""
    from dataplane.nfnetlink import NflogListener
    from policy.render import LOG_GROUP

    try:
        listener = NflogListener(LOG_GROUP)
    except OSError as e:
        what = f"cannot read denied flows from NFLOG group {LOG_GROUP}: {e}"
        log.warning("policy log: %s", what)
        problems["policy log"] = what
        return None
    namer = Namer(policy)

    def loop() -> None:
        try:
            while not stopping.is_set():
                for logged in listener.read(0.5):
                    try:
                        record(flows, namer, logged)
                    except Exception:  # one odd packet never ends the log
                        log.exception("policy log: cannot record %s", logged)
                flows.overruns = listener.overruns
        finally:
            listener.close()

    thread = threading.Thread(target=loop, name="policy log", daemon=True)
    thread.start()
    return thread


def http_route(flows: DeniedFlows) -> Route:
    """``/policy/log`` for ``daemon.http``: query -> (status, content type, body)."""

    def route(query: Mapping[str, str]) -> tuple[int, str, bytes]:
        try:
            since = int(query.get("since", "0"))
            wait = float(query.get("wait", "0"))
        except ValueError:
            return 400, "text/plain", b"since and wait are numbers\n"
        body = json.dumps(flows.since(since, wait)).encode()
        return 200, "application/json", body

    return route


__all__ = ["RING_SIZE", "DeniedFlow", "DeniedFlows", "Namer", "http_route", "iso_time", "record"]
