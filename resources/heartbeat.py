"""Liveness documents (kind ``heartbeat``), written with a ttl: while one exists, its writer
counts as alive (standard library only).

- key ``<node name>``: tabby-node on that node;
- key ``_kube-controllers`` (not a node name: a DNS-1123 name has no ``_``): the leading
  tabby-kube-controllers. While it lives, tabby-node holds a pod's ADD until the pod's
  labels are mirrored (bounded), so that no pod is reachable against a policy for a moment.

Stored data: ``{"node": <key>, "time": <unix seconds>, "pid": <the writer's pid>}``, where
``time`` is when the document was written: its writer then keeps its ttl (lease) alive
without writing it again (``Leases.keepalive``: ``beat``), so a live node costs the other nodes no
watch event.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from datastore.cas import cas
from datastore.errors import StoreCorrupt

if TYPE_CHECKING:
    from datastore.base import Doc, Leases

KIND = "heartbeat"
CONTROLLERS_KEY = "_kube-controllers"


@dataclasses.dataclass(frozen=True, slots=True)
class Heartbeat:
    node: str
    time: float
    pid: int

    @classmethod
    def from_data(cls, data: Mapping[str, object], where: str) -> Heartbeat:
        node, when, pid = data.get("node"), data.get("time"), data.get("pid", 0)
        if not isinstance(node, str) or not node:
            raise StoreCorrupt(where, "malformed heartbeat: node")
        if not isinstance(when, int | float) or isinstance(when, bool):
            raise StoreCorrupt(where, "malformed heartbeat: time")
        if not isinstance(pid, int) or isinstance(pid, bool):
            raise StoreCorrupt(where, "malformed heartbeat: pid")
        return cls(node, float(when), pid)

    def to_data(self) -> dict[str, object]:
        return {"node": self.node, "time": self.time, "pid": self.pid}


def beat(store: Leases, key: str, ttl: float) -> None:
    """``key`` is alive: its document's lease kept alive, which no watcher hears of (no new
    revision, no event); written again, with a new lease, only when it is gone (first start,
    or it expired while its writer could not reach the datastore). Its ``time`` is when it
    was last written."""
    if store.keepalive(KIND, key):
        return
    data: dict[str, object] = Heartbeat(key, time.time(), os.getpid()).to_data()

    def write(doc: Doc | None) -> int:
        return store.put_leased(KIND, key, data, None if doc is None else doc.revision, ttl=ttl)

    cas(lambda: store.get(KIND, key), write, KIND, key)
