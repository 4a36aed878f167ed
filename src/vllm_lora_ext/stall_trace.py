"""Log what a process's main thread was doing when it stayed in one place too long (a diagnostic).

``VLLM_LORA_EXT_STALL_TRACE_S=0.5`` starts, in every process the plugin registers in (the API
server, the engine core, the workers), a daemon thread that looks at the main thread's stack every
50 ms. When one call of one function has stayed on top for longer than the threshold (a long C call
such as a copy, a wait for the GIL, or a Python loop in that function), and the main thread is not
waiting for work (a queue, a selector, a sleep), it logs that stack once, with the stacks of the
other threads: that is what made the engine or the server stall. When that call returns, it logs
how long the stall lasted. A pause it finds this way is, for example, Triton compiling a kernel inside
the engine step.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, TypeVar

__all__ = ["StallTrace", "profiled", "start"]

T = TypeVar("T")

logger = logging.getLogger(__name__)

# Top functions that mean "waiting for work", not stalled (the engine's input queue, asyncio's selector, ...).
_IDLE_FUNCTIONS = frozenset({"wait", "get", "select", "poll", "sleep", "acquire", "_worker", "recv", "recv_multipart",
                             "_recv", "accept", "run_forever", "_run_once", "epoll", "join", "read", "readinto"})
_GLOBAL: StallTrace | None = None


class StallTrace:
    """A sampler of the main thread's stack; [`start`] and [`stop`] it.

    Example:
        >>> trace = StallTrace(0.5).start()
        >>> trace.stop()
    """

    def __init__(self, threshold_s: float, *, period_s: float = 0.05) -> None:
        self.threshold_s = threshold_s
        self.period_s = period_s
        self.thread_id = threading.main_thread().ident
        self.stalls = 0  # stalls logged so far
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> StallTrace:
        self._thread = threading.Thread(target=self._sample, name="vllm-lora-ext-stall-trace", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _sample(self) -> None:
        last: tuple[int, str, str] | None = None
        since = time.monotonic()
        logged = False
        while not self._stop.wait(self.period_s):
            frame = sys._current_frames().get(self.thread_id) if self.thread_id is not None else None
            if frame is None:
                return
            where = (id(frame), frame.f_code.co_filename, frame.f_code.co_name)  # one call of one function
            now = time.monotonic()
            if where != last:
                if logged:
                    logger.warning("main thread of process %d: that stall ended after %.2f s", os.getpid(),
                                   now - since)
                last, since, logged = where, now, False
                continue
            if logged or now - since < self.threshold_s or where[2] in _IDLE_FUNCTIONS:
                continue
            logged = True
            self.stalls += 1
            frames = sys._current_frames()
            others = [f"--- thread {t.name}\n{''.join(traceback.format_stack(frames[t.ident])[-6:])}"
                      for t in threading.enumerate()
                      if t.ident not in (self.thread_id, threading.get_ident()) and t.ident in frames]
            logger.warning("main thread of process %d in one place for %.2f s so far:\n%s%s", os.getpid(),
                           now - since, "".join(traceback.format_stack(frame)[-14:]), "\n".join(others)[:20000])


def start(threshold_s: float, *, period_s: float = 0.05) -> bool:
    """Start the sampler on this process's main thread (once); return whether it was started now."""
    global _GLOBAL
    if _GLOBAL is not None or threshold_s <= 0:
        return False
    _GLOBAL = StallTrace(threshold_s, period_s=period_s).start()
    logger.info("stall trace on in process %d: the main thread's stack is logged when it stays in one place "
                "longer than %.2f s", os.getpid(), threshold_s)
    return True


def profiled(call: Callable[[], T], what: Callable[[], str]) -> T:
    """Run ``call``; with the stall trace running in this process ([`start`]: ``VLLM_LORA_EXT_STALL_TRACE_S`` > 0),
    under ``cProfile``, and log its top functions by cumulative time, with the garbage collections that ran inside
    it, when it took longer than the trace's threshold (a diagnostic for work in the engine step, such as registering
    an adapter, that a 50 ms sampler cannot resolve); ``what()`` names it then. Off, it only calls ``call``."""
    trace = _GLOBAL
    if trace is None or sys.getprofile() is not None:  # off, or another profiler is on (3.11 would replace it)
        return call()
    threshold = trace.threshold_s
    import cProfile
    import gc

    pauses: list[float] = []
    started = [0.0]

    def on_gc(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            pauses.append(time.perf_counter() - started[0])

    profile = cProfile.Profile()
    try:
        profile.enable()
    except ValueError:  # another profiler is on in this thread (3.12+ refuses a second): it gets the call
        return call()
    gc.callbacks.append(on_gc)
    t0 = time.perf_counter()
    try:
        try:
            return call()
        finally:
            profile.disable()
    finally:
        gc.callbacks.remove(on_gc)
        took = time.perf_counter() - t0
        if took >= threshold:
            _report(profile, what, took, pauses)


def _report(profile: Any, what: Callable[[], str], took: float, pauses: list[float]) -> None:
    """Log a profiled call; a diagnostic never fails the call it watched."""
    import io
    import pstats

    try:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(18)
        logger.warning("%s took %.4f s (profiled; %d garbage collections in this process, %.4f s):\n%s", what(), took,
                       len(pauses), sum(pauses), text.getvalue()[-6000:])
    except Exception:
        logger.debug("could not report a profiled call", exc_info=True)
