"""SIGTERM and SIGINT as a daemon's stop request: they set an event its loops watch."""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def stop_on_signals(stopping: threading.Event) -> Iterator[None]:
    """Inside the block SIGTERM and SIGINT set ``stopping``; the old handlers come back
    after it."""

    def on_signal(signum: int, _frame: object) -> None:
        stopping.set()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
