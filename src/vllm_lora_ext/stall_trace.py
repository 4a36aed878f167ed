"""Log what a process's main thread was doing when it stayed in one place too long (a diagnostic).

``VLLM_LORA_EXT_STALL_TRACE_S=0.5`` starts, in every process the plugin registers in (the API
server, the engine core, the workers), a daemon thread that looks at the main thread's stack every
50 ms. When one call of one function has stayed on top for longer than the threshold (a long C call
such as a copy, a wait for the GIL, or a Python loop in that function), and the main thread is not
waiting for work (a queue, a selector, a sleep), it logs that stack once, with the stacks of the
other threads: that is what made the engine or the server stall.
"""

from __future__ import annotations

import logging
import os
import sys
import threading
import time
import traceback

__all__ = ["start"]

logger = logging.getLogger(__name__)

_IDLE_FUNCTIONS = frozenset({"wait", "get", "select", "poll", "sleep", "acquire", "_worker", "recv", "recv_multipart",
                             "_recv", "accept", "run_forever", "_run_once", "epoll", "join", "read", "readinto"})
_STARTED = False


def start(threshold_s: float, *, period_s: float = 0.05) -> bool:
    """Start the sampler in this process (once); return whether it was started now."""
    global _STARTED
    if _STARTED or threshold_s <= 0:
        return False
    _STARTED = True
    main = threading.main_thread().ident
    threading.Thread(target=_sample, args=(main, threshold_s, period_s), name="vllm-lora-ext-stall-trace",
                     daemon=True).start()
    logger.info("stall trace on in process %d: the main thread's stack is logged when it stays in one place "
                "longer than %.2f s", os.getpid(), threshold_s)
    return True


def _sample(main: int | None, threshold_s: float, period_s: float) -> None:
    last: tuple[int, str, str] | None = None
    since = time.monotonic()
    logged = False
    while True:
        time.sleep(period_s)
        frame = sys._current_frames().get(main) if main is not None else None
        if frame is None:
            return
        where = (id(frame), frame.f_code.co_filename, frame.f_code.co_name)  # one call of one function
        now = time.monotonic()
        if where != last:
            if logged:
                logger.warning("main thread of process %d: that stall ended after %.2f s", os.getpid(), now - since)
            last, since, logged = where, now, False
            continue
        if logged or now - since < threshold_s or where[2] in _IDLE_FUNCTIONS:
            continue
        logged = True
        others = [f"--- thread {t.name}\n{''.join(traceback.format_stack(sys._current_frames()[t.ident])[-6:])}"
                  for t in threading.enumerate() if t.ident not in (main, threading.get_ident())
                  and t.ident in sys._current_frames()]
        logger.warning("main thread of process %d in one place for %.2f s so far:\n%s%s", os.getpid(), now - since,
                       "".join(traceback.format_stack(frame)[-14:]), "\n".join(others)[:20000])
