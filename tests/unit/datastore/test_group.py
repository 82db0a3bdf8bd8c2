"""``datastore.group.Batches``: concurrent items of one key run in batches, each caller gets
its own item's outcome, a failed batch fails only its own items, and leadership passes on."""

from __future__ import annotations

import threading
import time

import pytest

from datastore.group import Batches


class Boom(Exception):
    pass


def _until(cond: object, seconds: float = 10.0) -> None:
    deadline = time.monotonic() + seconds
    while not cond() and time.monotonic() < deadline:  # type: ignore[operator]
        time.sleep(0.002)


def test_items_that_arrive_during_a_batch_run_together_in_the_next() -> None:
    group: Batches[int, int] = Batches()
    release = threading.Event()
    seen: list[list[int]] = []

    def run(items: list[int]) -> list[int | BaseException]:
        seen.append(list(items))
        if len(seen) == 1:
            release.wait(10)  # the first batch runs until the others have queued behind it
        return [i * 10 if i != 7 else Boom(f"item {i}") for i in items]

    got: dict[int, int | BaseException] = {}

    def submit(i: int) -> None:
        try:
            got[i] = group.submit("k", i, run, wait=10, timeout_error=lambda: TimeoutError())
        except Boom as e:
            got[i] = e

    first = threading.Thread(target=submit, args=(0,))
    first.start()
    _until(lambda: group.writing == 1)
    others = [threading.Thread(target=submit, args=(i,)) for i in range(1, 10)]
    for t in others:
        t.start()
    _until(lambda: group.pending() == 10)
    release.set()
    for t in [first, *others]:
        t.join(10)
    assert seen == [[0], list(range(1, 10))]
    assert group.batches == 2
    assert {i: v for i, v in got.items() if i != 7} == {i: i * 10 for i in range(10) if i != 7}
    assert isinstance(got[7], Boom)  # only its own item failed
    assert group.pending() == 0
    assert not group.leading


def test_a_batch_that_raises_fails_its_items_and_the_next_one_still_runs() -> None:
    group: Batches[int, int] = Batches()

    def broken(items: list[int]) -> list[int | BaseException]:
        raise Boom("the store went away")

    with pytest.raises(Boom):
        group.submit("k", 1, broken, wait=1, timeout_error=lambda: TimeoutError())
    assert not group.leading  # handed over: nobody waits for a leader that is gone
    assert group.submit("k", 2, lambda items: list(items), wait=1, timeout_error=TimeoutError) == 2


def test_a_batch_with_a_wrong_number_of_outcomes_fails_instead_of_answering_wrongly() -> None:
    group: Batches[int, int] = Batches()
    with pytest.raises(RuntimeError, match="0 outcomes for 1 items"):
        group.submit("k", 1, lambda items: [], wait=1, timeout_error=TimeoutError)


def test_a_waiter_no_batch_took_in_time_leaves_the_queue() -> None:
    group: Batches[int, int] = Batches()
    release = threading.Event()
    ran: list[list[int]] = []

    def slow(items: list[int]) -> list[int | BaseException]:
        ran.append(list(items))
        release.wait(10)
        return list(items)

    leader = threading.Thread(
        target=group.submit, args=("k", 1, slow), kwargs={"wait": 10, "timeout_error": Boom}
    )
    leader.start()
    _until(lambda: group.writing == 1)
    with pytest.raises(Boom):
        group.submit("k", 2, slow, wait=0.05, timeout_error=Boom)
    release.set()
    leader.join(10)
    assert ran == [[1]]  # the one that gave up was never run
    assert not group.leading


def test_keys_do_not_wait_for_each_other() -> None:
    group: Batches[int, int] = Batches()
    release = threading.Event()

    def held(items: list[int]) -> list[int | BaseException]:
        release.wait(10)
        return list(items)

    t = threading.Thread(
        target=group.submit, args=("a", 1, held), kwargs={"wait": 10, "timeout_error": Boom}
    )
    t.start()
    _until(lambda: group.writing == 1)
    assert group.submit("b", 2, lambda items: list(items), wait=1, timeout_error=Boom) == 2
    release.set()
    t.join(10)
