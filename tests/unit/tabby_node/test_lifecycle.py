"""How tabby-node's parts run and stop (tabby_node.lifecycle) and how a CNI thread has
work done on the dataplane thread (tabby_node.passes.Requests)."""

from __future__ import annotations

import threading

import pytest

from ipam.core.errors import DatastoreError
from tabby_node.lifecycle import Retry, Shutdown, Threads
from tabby_node.passes import Requests


def test_shutdown_runs_its_phases_in_order_whatever_was_started() -> None:
    """The stop event first, then the socket (the server before the run directory it
    holds), HTTP, routing, the threads, the served store, the store; a phase nothing was
    added to is skipped, and a second run does nothing again."""
    stopping = threading.Event()
    shutdown = Shutdown(stopping)
    done: list[str] = []
    shutdown.on("store", lambda: done.append(f"store {stopping.is_set()}"))
    shutdown.on("socket", lambda: done.append("run dir"))
    shutdown.on("threads", lambda: done.append("threads"))
    shutdown.on("routing", lambda: done.append("routing"))
    shutdown.on("served", lambda: done.append("served"))
    shutdown.on("http", lambda: done.append("http"))
    shutdown.on("socket", lambda: done.append("server"))
    shutdown.run()
    assert done == [
        "server",
        "run dir",
        "http",
        "routing",
        "threads",
        "served",
        "store True",
    ]
    shutdown.run()
    assert len(done) == 7
    partial = Shutdown(threading.Event())
    partial.on("store", lambda: done.append("only the store"))
    partial.run()
    assert done[-1] == "only the store"


def test_a_loop_that_raises_is_a_problem_and_the_others_run_on(
    caplog: pytest.LogCaptureFixture,
) -> None:
    problems: dict[str, str] = {}
    threads = Threads(problems)
    ran = threading.Event()

    def broken() -> None:
        raise RuntimeError("boom")

    threads.spawn("watcher", broken)
    other = threads.spawn("heartbeat", ran.set)
    threads.join(timeout=5)
    assert other.name == "heartbeat"
    assert ran.is_set()
    assert problems == {"loop watcher": "crashed (see the log)"}
    assert "the watcher loop failed" in caplog.text


def test_start_up_datastore_work_is_retried_until_it_works() -> None:
    stopping = threading.Event()
    problems: dict[str, str] = {}
    counted: list[str] = []

    class Counting:
        def datastore_error(self, op: str) -> None:
            counted.append(op)

    seen: list[dict[str, str]] = []  # the problems as each attempt found them

    def register() -> str:
        seen.append(dict(problems))
        if len(seen) < 3:
            raise DatastoreError("no leader")
        return "registered"

    delays: list[float] = []

    def wait(delay: float | None = None) -> bool:
        delays.append(delay or 0.0)
        return False

    stopping.wait = wait  # type: ignore[method-assign]
    assert Retry(stopping, problems, Counting())("register", register) == "registered"
    assert seen == [{}, {"datastore: register": "no leader"}, {"datastore: register": "no leader"}]
    assert delays == [0.2, 0.4]
    assert counted == ["register", "register"]
    assert problems == {}  # cleared once it worked


def test_retrying_ends_when_the_node_stops() -> None:
    stopping = threading.Event()
    stopping.set()

    def never() -> None:
        raise DatastoreError("unreachable")

    with pytest.raises(DatastoreError):
        Retry(stopping, {})("default pools", never)


def test_requests_run_on_the_serving_thread_and_hand_back_what_they_raise() -> None:
    """A CNI thread's request is run by the thread that serves the queue (the dataplane
    thread, in the node's namespace), which it wakes; what the function raises is raised
    in the CNI thread."""
    wake = threading.Event()
    requests = Requests(wake)
    ran_on: list[str] = []
    stop = threading.Event()

    def dataplane() -> None:
        while not stop.is_set():
            if wake.wait(0.05):
                wake.clear()
            requests.serve()

    loop = threading.Thread(target=dataplane, name="dataplane")
    loop.start()
    try:
        requests.call(lambda: ran_on.append(threading.current_thread().name), timeout=5)
        assert ran_on == ["dataplane"]

        def fails() -> None:
            raise ValueError("no such endpoint")

        with pytest.raises(ValueError, match="no such endpoint"):
            requests.call(fails, timeout=5)
    finally:
        stop.set()
        loop.join(5)


def test_a_request_nobody_serves_times_out() -> None:
    import queue

    with pytest.raises(queue.Empty):
        Requests(threading.Event()).call(lambda: None, timeout=0.05)


def test_the_backend_flag_chooses_the_routing(tmp_path: object) -> None:
    from bird import BirdSupervisor
    from tabby_node import routing
    from tabby_node.facts import Facts

    facts = Facts("node-a", None, None, 1500, False, "")
    bird = routing.choose("bird", facts, str(tmp_path), None)
    assert isinstance(bird, routing.BirdRouting)
    assert isinstance(bird.bird, BirdSupervisor)
    assert not bird.started  # BIRD starts with the first configuration, not before
    vxlan = routing.choose("vxlan", facts, str(tmp_path), None)
    assert type(vxlan) is routing.VxlanRouting
    assert vxlan.overlay.backend == "vxlan"
    none = routing.choose("none", facts, str(tmp_path), None)
    assert type(none) is routing.NoRouting
    assert none.overlay.backend == "none"
