"""The stall trace: a call that keeps the main thread longer than the threshold is logged with its stack, once."""

from __future__ import annotations

import logging
import threading
import time

import pytest

from vllm_lora_ext.stall_trace import StallTrace


def _spin(seconds: float) -> int:
    end, n = time.monotonic() + seconds, 0
    while time.monotonic() < end:
        n += sum(range(100))
    return n


def test_a_long_call_is_logged_once_with_its_stack_and_how_long_it_lasted(caplog: pytest.LogCaptureFixture) -> None:
    trace = StallTrace(0.2, period_s=0.02).start()
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.stall_trace"):
        _spin(0.6)
        threading.Event().wait(0.1)  # a different call on top: the stall has ended
        trace.stop()
    stalls = [r.getMessage() for r in caplog.records if "in one place" in r.getMessage()]
    assert trace.stalls == 1 and len(stalls) == 1 and "_spin" in stalls[0]
    assert any("that stall ended after" in r.getMessage() for r in caplog.records)


def test_waiting_for_work_is_not_a_stall(caplog: pytest.LogCaptureFixture) -> None:
    trace = StallTrace(0.1, period_s=0.02).start()
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.stall_trace"):
        threading.Event().wait(0.5)  # the engine waits on its input queue like this
        trace.stop()
    assert trace.stalls == 0 and not caplog.records


def test_profiled_logs_a_slow_calls_top_functions_and_its_collections_only_when_the_trace_is_on(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    import cProfile
    import gc

    from vllm_lora_ext import stall_trace
    from vllm_lora_ext.stall_trace import profiled

    def slow() -> int:
        gc.collect()
        return _spin(0.05)

    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.stall_trace"):
        monkeypatch.setattr(stall_trace, "_GLOBAL", None)  # no trace running in this process
        assert profiled(slow, lambda: "off") > 0
        monkeypatch.setattr(stall_trace, "_GLOBAL", StallTrace(0.01))  # VLLM_LORA_EXT_STALL_TRACE_S=0.01
        assert profiled(slow, lambda: "registering X") > 0
        assert profiled(lambda: 7, lambda: "fast") == 7  # under the threshold: nothing logged
        with pytest.raises(ZeroDivisionError):  # the call's own error, unchanged
            profiled(lambda: 1 // 0, lambda: "failing")
        outer = cProfile.Profile()
        outer.enable()  # another profiler on this thread: the call still runs, unprofiled, and the other goes on
        try:
            assert profiled(lambda: 8, lambda: "under another profiler") == 8
            _spin(0.001)
        finally:
            outer.disable()
        assert "_spin" in {getattr(entry.code, "co_name", None) for entry in outer.getstats()}
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 1 and logged[0].startswith("registering X took ") and "_spin" in logged[0]
    assert "1 garbage collections" in logged[0] or "garbage collections" in logged[0]
