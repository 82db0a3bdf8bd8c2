"""What tabby-node publishes for operators: ``<run-dir>/status.json``, rewritten after the
dataplane passes (at most once a second) and at least every ``RESYNC_SECONDS``, which
``tabbyctl node status`` and ``tabbyctl node diags`` read. What goes in it:
``tabby_node.node_status``.

This module is tabby-node's interface to tabbyctl (the layering test allows tabbyctl to
import it, and nothing else of tabby-node but the package's constants): standard library
only, no import of tabby-node's other modules.
"""

from __future__ import annotations

import json
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bundle.types import JSON

#: The status file is rewritten at least this often while tabby-node runs (tabbyctl calls
#: a file older than a few of these stale).
RESYNC_SECONDS = 30.0
STATUS_FILE = "status.json"


#: Fields whose value grows with the cluster (``vxlan``: one peer per other node; ``peers``:
#: BIRD's sessions). They are written compact, after the others, and encoded again only when
#: the value is another object (tabby-node's routing hands out the same list until the
#: peers change), so that the write after every dataplane pass costs the same with 10 and
#: with 1000 nodes.
BIG_FIELDS = ("peers", "vxlan")


class StatusWriter:
    """Writes ``status.json``; keeps the encoding of each of ``BIG_FIELDS`` with the object
    it encodes (held, so that an equal ``is`` means the same, unchanged value)."""

    def __init__(self) -> None:
        self._encoded: dict[str, tuple[object, str]] = {}
        self.encodings = 0  # big fields encoded so far (tests)

    def encode(self, status: JSON) -> str:
        small = {k: v for k, v in status.items() if k not in BIG_FIELDS}
        text = json.dumps(small, indent=1, sort_keys=True, default=str)
        big = []
        for field in BIG_FIELDS:
            if field not in status:
                continue
            value = status[field]
            memo = self._encoded.get(field)
            if memo is None or memo[0] is not value:
                memo = (value, json.dumps(value, sort_keys=True, default=str))
                self._encoded[field] = memo
                self.encodings += 1
            big.append(f" {json.dumps(field)}: {memo[1]}")
        if not big:
            return text
        head = text[:-1].rstrip()  # "{" or "{\n ..." without its closing brace
        sep = ",\n" if small else "\n"
        return head + sep + ",\n".join(big) + "\n}"

    def write(self, run_dir: str, status: JSON) -> None:
        text = self.encode(status)
        path = os.path.join(run_dir, STATUS_FILE)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)


def write_status(run_dir: str, status: JSON) -> None:
    """``status.json`` (a writer of its own: nothing kept between calls)."""
    StatusWriter().write(run_dir, status)


def read_status(run_dir: str) -> JSON | None:
    try:
        with open(os.path.join(run_dir, STATUS_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
