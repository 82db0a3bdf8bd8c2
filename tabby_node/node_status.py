"""What tabby-node writes to its status file (``tabby_node.status``: ``<run-dir>/status.json``,
which ``tabbyctl node status`` reads): who the node is, its problems, its routing."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from tabby_node.status import RESYNC_SECONDS, StatusWriter

if TYPE_CHECKING:
    from tabby_node.facts import Facts
    from tabby_node.view import Reporting

log = logging.getLogger("tabby.node")

#: The status file is rewritten at most this often after passes.
STATUS_SECONDS = 1.0


class StatusReport:
    """The status file, written by the dataplane thread: after the full passes, after the
    others at most every ``STATUS_SECONDS`` (reading BIRD's sessions and the vxlan peers is
    not for every pod started anywhere), and at least every ``RESYNC_SECONDS``."""

    def __init__(
        self,
        facts: Facts,
        *,
        backend: str,
        mtu: int,
        problems: Mapping[str, str],
        routing: Reporting,
        run_dir: str,
    ) -> None:
        self.facts = facts
        self.backend = backend
        self.mtu = mtu
        self.problems = problems
        self.routing = routing
        self.run_dir = run_dir
        self._due = False
        self._written = 0.0
        self._writer = StatusWriter()

    def due(self) -> None:
        """A pass happened: the next :meth:`maybe_write` writes when it may."""
        self._due = True

    def maybe_write(self) -> None:
        since = time.monotonic() - self._written
        if (self._due and since >= STATUS_SECONDS) or since >= RESYNC_SECONDS:
            self.write()

    def write(self) -> None:
        self._due = False
        self._written = time.monotonic()
        facts = self.facts
        status: dict[str, object] = {
            "node": facts.name,
            "backend": self.backend,
            "node_ip": str(facts.ipv4.address) if facts.ipv4 else None,
            "node_ip6": str(facts.ipv6.address) if facts.ipv6 else None,
            "mtu": self.mtu,
            "ipip": {"available": facts.ipip_available, "reason": facts.ipip_reason},
            "updated": time.time(),
            "problems": dict(self.problems),
            "pid": os.getpid(),
        }
        status.update(self.routing.status())
        try:
            self._writer.write(self.run_dir, status)
        except OSError as e:
            log.warning("cannot write the status file: %s", e)
