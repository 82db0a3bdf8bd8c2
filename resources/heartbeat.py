"""A node's liveness document (kind ``heartbeat``, key: the node's name), written by
tabby-node with a ttl: while it exists the node counts as alive (standard library only).

Stored data: ``{"node": <name>, "time": <unix seconds>, "pid": <tabby-node's pid>}``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

from datastore.errors import StoreCorrupt

KIND = "heartbeat"


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
