"""Liveness documents (kind ``heartbeat``), written with a ttl: while one exists, its writer
counts as alive (standard library only).

- key ``<node name>``: tabby-node on that node;
- key ``_kube-controllers`` (not a node name: a DNS-1123 name has no ``_``): the leading
  tabby-kube-controllers. While it lives, tabby-node holds a pod's ADD until the pod's
  labels are mirrored (bounded), so that no pod is reachable against a policy for a moment.

Stored data: ``{"node": <key>, "time": <unix seconds>, "pid": <the writer's pid>}``, where
``time`` is when the document was written: its writer then keeps its ttl (lease) alive
without writing it again (``Store.keepalive``), so a live node costs the other nodes no
watch event.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from datastore.errors import StoreCorrupt

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
