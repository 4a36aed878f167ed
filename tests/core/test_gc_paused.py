"""`gc_paused` is one pause shared by every block inside it, nested or on other threads."""

from __future__ import annotations

import gc
import threading
from collections.abc import Iterator

import pytest

from vllm_lora_ext._util import gc_paused


@pytest.fixture(autouse=True)
def _collector_on() -> Iterator[None]:
    was = gc.isenabled()
    gc.enable()
    yield
    (gc.enable if was else gc.disable)()


def _inside(entered: threading.Event, leave: threading.Event, seen: list[bool]) -> None:
    with gc_paused():
        entered.set()
        leave.wait(10)
        seen.append(gc.isenabled())


def test_the_collector_stays_off_until_the_last_of_two_threads_leaves_in_either_order() -> None:
    for first_out in (0, 1):
        entered = [threading.Event(), threading.Event()]
        leave = [threading.Event(), threading.Event()]
        seen: list[bool] = []
        threads = [threading.Thread(target=_inside, args=(entered[i], leave[i], seen)) for i in (0, 1)]
        threads[0].start()
        assert entered[0].wait(10)
        threads[1].start()  # enters while the collector is already off
        assert entered[1].wait(10)
        leave[first_out].set()
        threads[first_out].join(10)
        assert not gc.isenabled()  # the other thread is still inside
        leave[1 - first_out].set()
        threads[1 - first_out].join(10)
        assert gc.isenabled() and seen == [False, False]


def test_many_threads_nesting_at_random_leave_the_collector_on_only_at_the_end() -> None:
    start = threading.Barrier(8)
    inside_seen: list[bool] = []

    def work(depth: int) -> None:
        start.wait(10)
        for _ in range(200):
            with gc_paused():
                for _ in range(depth):
                    with gc_paused():
                        inside_seen.append(gc.isenabled())
                inside_seen.append(gc.isenabled())

    threads = [threading.Thread(target=work, args=(i % 3,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not any(inside_seen) and len(inside_seen) == 200 * sum(1 + i % 3 for i in range(8))
    assert gc.isenabled()


def test_a_collector_that_was_off_stays_off_and_an_error_inside_still_ends_the_pause() -> None:
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()
    gc.enable()
    with pytest.raises(RuntimeError), gc_paused():
        with gc_paused():
            raise RuntimeError("boom")
    assert gc.isenabled()
