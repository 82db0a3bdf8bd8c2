"""Processes of the labs and demos: signal-safe children, and the one error type.

A demo or a lab (``tabbyctl.demo.lab``, the repository's ``lab.kubernetes``) makes
namespaces and starts daemons; an interrupt must never lose one of them. :data:`INTERRUPTS`
turns Ctrl-C and SIGTERM into ``KeyboardInterrupt`` but holds it back while a child starts
or runs (:func:`run`).
"""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, AnyStr

Echo = Callable[[str], None]


class LabError(Exception):
    """A lab or demo step that failed (one line for the operator)."""


class Interrupts:
    """Ctrl-C and SIGTERM as KeyboardInterrupt, held back while a child process starts.

    A signal that lands inside ``subprocess`` (after fork, before the Popen object is
    returned) would lose the child: a tabby-node nobody stops, an ``ip netns add`` that
    finishes after the cleanup deleted its namespace, an ADD that creates a veth after
    its DEL ran. So each child runs to its end inside ``deferred()`` and the interrupt is
    raised as soon as it has (children are short: a CNI call, an ``ip`` command, a ping).
    """

    def __init__(self) -> None:
        self._depth = 0
        self._pending = False
        self._fired = False

    def handler(self, signum: int, frame: object) -> None:
        if self._fired:
            return  # one interrupt is enough: the cleanup is already on its way
        if self._depth:
            self._pending = True
            return
        self._fired = True
        raise KeyboardInterrupt

    @contextmanager
    def deferred(self) -> Iterator[None]:
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1
            if not self._depth and self._pending and not self._fired:
                self._pending = False
                self._fired = True
                raise KeyboardInterrupt

    @contextmanager
    def installed(self) -> Iterator[None]:
        """Interrupts raise inside the block; after it they are ignored (cleanup time)."""
        self._depth, self._pending, self._fired = 0, False, False
        for s in (signal.SIGINT, signal.SIGTERM):
            signal.signal(s, self.handler)
        try:
            yield
        finally:
            ignore_signals()


INTERRUPTS = Interrupts()


def run(cmd: list[str], **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    """subprocess.run that an interrupt never cuts off (see Interrupts)."""
    with INTERRUPTS.deferred():
        return subprocess.run(cmd, check=False, **kwargs)


@contextmanager
def signals_restored() -> Iterator[None]:
    """SIGINT's and SIGTERM's handlers put back after the block as they were before it (a
    demo installs :data:`INTERRUPTS` and ignores both while it cleans up)."""
    old = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h if h is not None else signal.SIG_DFL)


def ignore_signals() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def stop_process(
    proc: subprocess.Popen[AnyStr], sig: int = signal.SIGTERM, grace: float = 40.0
) -> None:
    """Signal a child (by its PID) and wait; SIGKILL when it is still there after ``grace``."""
    if proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
