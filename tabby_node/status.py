"""What tabby-node publishes for operators: ``<run-dir>/status.json``, rewritten after the
dataplane passes (at most once a second) and at least every ``RESYNC_SECONDS``, which
``tabbyctl node status`` and ``tabbyctl node diags`` read.

This module is tabby-node's interface to tabbyctl (the layering test allows tabbyctl to
import it, and nothing else of tabby-node but the package's constants): standard library
only, no import of the agent.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

#: The status file is rewritten at least this often while tabby-node runs (tabbyctl calls
#: a file older than a few of these stale).
RESYNC_SECONDS = 30.0
STATUS_FILE = "status.json"


def write_status(run_dir: str, status: Mapping[str, Any]) -> None:
    path = os.path.join(run_dir, STATUS_FILE)
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(status, f, indent=1, sort_keys=True, default=str)
    os.replace(tmp, path)


def read_status(run_dir: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(run_dir, STATUS_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None
