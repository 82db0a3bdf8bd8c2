"""How tabby-node's parts run and stop: its threads (a loop that crashes is a problem node
status and liveness show), the datastore work at start-up (retried until it works), and
the order in which a node stops."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Literal, TypeVar, get_args

from ipam.core.errors import DatastoreError

if TYPE_CHECKING:
    from tabby_node.view import DatastoreErrors

T = TypeVar("T")
#: The phases of a stop, in their order (:class:`Shutdown`).
Phase = Literal["socket", "uninstall", "http", "routing", "threads", "served", "store"]

log = logging.getLogger("tabby.node")


class Threads:
    """tabby-node's own loops, each in a daemon thread of its name; a loop that raises
    leaves ``problems["loop <name>"]``."""

    def __init__(self, problems: dict[str, str]) -> None:
        self.problems = problems
        self.threads: list[threading.Thread] = []

    def spawn(self, name: str, fn: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=self._guarded, args=(name, fn), name=name, daemon=True)
        self.threads.append(t)
        t.start()
        return t

    def _guarded(self, name: str, fn: Callable[[], None]) -> None:
        try:
            fn()
        except Exception:
            log.exception("tabby-node: the %s loop failed", name)
            self.problems[f"loop {name}"] = "crashed (see the log)"

    def join(self, timeout: float = 2.0) -> None:
        """Wait for each (its loop ends with the node's stop event) at most ``timeout``."""
        for t in self.threads:
            t.join(timeout=timeout)


class Retry:
    """Datastore work at start-up: retried until it works or tabby-node is stopped (etcd
    may still be electing a leader, or not be up yet); meanwhile the error is a problem
    (``problems["datastore: <what>"]``) and counted."""

    def __init__(
        self,
        stopping: threading.Event,
        problems: dict[str, str],
        metrics: DatastoreErrors | None = None,
    ) -> None:
        self.stopping = stopping
        self.problems = problems
        self.metrics = metrics

    def __call__(self, what: str, fn: Callable[[], T]) -> T:
        delay = 0.2
        while True:
            try:
                value = fn()
            except DatastoreError as e:
                if self.metrics is not None:  # metrics
                    self.metrics.datastore_error(what)
                if self.stopping.is_set():
                    raise
                log.warning("%s: %s (retrying in %.1f s)", what, e, delay)
                self.problems[f"datastore: {what}"] = str(e)
                self.stopping.wait(delay)
                delay = min(delay * 2, 5.0)
                continue
            self.problems.pop(f"datastore: {what}", None)
            return value


class Shutdown:
    """What a node started, undone in the order a node stops, whatever it got to: the
    stop event first, then the CNI socket (new calls fall back in-process; the calls in
    flight finish; the run directory is given up), in Kubernetes the check whether this
    stop is an uninstall (then the node is cleaned: ``tabby_node.uninstall``), the HTTP
    servers, the routing backend,
    the threads, the served calls' datastore, the store. Within a phase the last step
    added runs first."""

    PHASES: tuple[Phase, ...] = get_args(Phase)

    def __init__(self, stopping: threading.Event) -> None:
        self.stopping = stopping
        self._steps: dict[Phase, list[Callable[[], None]]] = {p: [] for p in self.PHASES}

    def on(self, phase: Phase, step: Callable[[], None]) -> None:
        self._steps[phase].append(step)

    def run(self) -> None:
        self.stopping.set()
        for phase in self.PHASES:
            steps, self._steps[phase] = self._steps[phase], []
            for step in reversed(steps):
                step()
