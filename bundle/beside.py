"""A call run on a thread of its own, beside the caller's work: :class:`Beside`.

Standard library only (layer 0): the dataplane makes a veth pair beside the caller's IPAM
call with it, the plugin records and removes endpoints and tears the kernel side down with
it. The thread inherits the calling thread's namespaces (clone copies them): a call that
entered a pod's or a caller's namespace before starting one runs it there too.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class Beside(Generic[T]):
    """``fn()`` started at once on a daemon thread named ``name``; :meth:`join` waits for it
    and returns its result or what it raised (any ``BaseException``: the caller decides).
    ``seconds``: its wall time, once joined."""

    def __init__(self, fn: Callable[[], T], name: str) -> None:
        self._fn = fn
        self._out: T | BaseException | None = None
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        started = time.perf_counter()
        try:
            self._out = self._fn()
        except BaseException as e:  # handed to the caller by join()
            self._out = e
        finally:
            self.seconds = time.perf_counter() - started

    def join(self) -> T | BaseException:
        self._thread.join()
        return self._out  # type: ignore[return-value]  # set by _run before it ended
