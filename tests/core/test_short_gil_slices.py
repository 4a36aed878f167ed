"""`short_gil_slices`: one shorter switch interval shared by every block inside it, nested or on other threads, and
what it is for: a helper thread's short Python steps beside a thread that holds the GIL."""

from __future__ import annotations

import sys
import threading
import time

from vllm_lora_ext._util import GIL_SLICE_S, short_gil_slices


def test_the_interval_is_short_until_the_last_of_two_threads_leaves_in_either_order() -> None:
    default = sys.getswitchinterval()
    for first_out in (0, 1):
        entered = [threading.Event(), threading.Event()]
        leave = [threading.Event(), threading.Event()]
        seen: list[float] = []

        def inside(i: int) -> None:
            with short_gil_slices():
                entered[i].set()
                leave[i].wait(10)
                seen.append(sys.getswitchinterval())

        threads = [threading.Thread(target=inside, args=(i,)) for i in (0, 1)]
        threads[0].start()
        assert entered[0].wait(10)
        threads[1].start()
        assert entered[1].wait(10)
        assert sys.getswitchinterval() == GIL_SLICE_S
        leave[first_out].set()
        threads[first_out].join(10)
        assert sys.getswitchinterval() == GIL_SLICE_S  # the other is still inside
        leave[1 - first_out].set()
        threads[1 - first_out].join(10)
        assert seen == [GIL_SLICE_S, GIL_SLICE_S]
        assert sys.getswitchinterval() == default


def test_it_never_raises_a_shorter_interval_and_restores_it_after_an_error() -> None:
    default = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SLICE_S / 5)
    shorter = sys.getswitchinterval()  # (the interpreter keeps whole microseconds)
    try:
        with short_gil_slices():
            assert sys.getswitchinterval() == shorter
        try:
            with short_gil_slices(), short_gil_slices():
                raise ValueError("a failed build")
        except ValueError:
            pass
        assert sys.getswitchinterval() == shorter
    finally:
        sys.setswitchinterval(default)


def _steps_beside_a_busy_thread(short: bool) -> float:
    """Seconds for 200 short steps that each give up the GIL (a sleep of 0, as a torch call does) on this thread,
    while another thread runs Python without pause."""
    stop = threading.Event()

    def busy() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    spinner = threading.Thread(target=busy, daemon=True)
    spinner.start()
    try:
        t0 = time.perf_counter()
        if short:
            with short_gil_slices():
                for _ in range(200):
                    time.sleep(0)
        else:
            for _ in range(200):
                time.sleep(0)
        return time.perf_counter() - t0
    finally:
        stop.set()
        spinner.join(10)


def test_short_slices_let_a_helper_threads_steps_run_beside_a_thread_that_holds_the_gil() -> None:
    """The control (the default 5 ms interval) waits for the busy thread at every step; with short slices the same
    steps finish several times sooner. (A ratio of two runs of one machine, not a time limit.)"""
    slow = _steps_beside_a_busy_thread(short=False)
    fast = _steps_beside_a_busy_thread(short=True)
    assert fast * 3 < slow, (fast, slow)
