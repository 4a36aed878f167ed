"""The build-ahead table: one build per adapter, errors surfaced once, bounded work and memory."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from vllm_lora_ext.prebuild import PrebuildTable, RecentlyUsed


def _wait(table: PrebuildTable[Any], key: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not table.poll(key):
        assert time.monotonic() < deadline, f"{key} never built"
        time.sleep(0.005)


class _Builds:
    """A build function that records calls and can be held until released."""

    def __init__(self, make: Callable[[str], Any] = lambda k: bytearray(4)) -> None:
        self.calls: list[str] = []
        self.release = threading.Event()
        self.release.set()
        self.running = 0
        self.most_at_once = 0
        self._lock = threading.Lock()
        self.make = make

    def __call__(self, key: str) -> Any:
        with self._lock:
            self.calls.append(key)
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            assert self.release.wait(10)
            return self.make(key)
        finally:
            with self._lock:
                self.running -= 1


def test_concurrent_requests_for_one_adapter_share_one_build() -> None:
    builds = _Builds()
    builds.release.clear()
    table = PrebuildTable(builds, size_of=len, max_builds=2, budget_bytes=1 << 20)
    results: list[Any] = []
    takers = [threading.Thread(target=lambda: results.append(table.take("a"))) for _ in range(2)]
    assert table.poll("a") is False and table.poll("a") is False
    for t in takers:
        t.start()
    time.sleep(0.05)
    builds.release.set()
    for t in takers:
        t.join(10)
    assert builds.calls == ["a"] and table.builds_started == 1
    # the build is handed out once: one taker got it, the other found it taken (and would build again)
    assert sorted(r is None for r in results) == [False, True]
    assert table.state("a") == "absent"


def test_a_failed_build_raises_its_error_once_then_can_be_built_again() -> None:
    fail = [True]

    def build(key: str) -> bytes:
        if fail[0]:
            raise ValueError(f"bad adapter {key}")
        return b"ok"

    table = PrebuildTable(build, size_of=len, max_builds=1, budget_bytes=100)
    assert table.poll("a") is False
    deadline = time.monotonic() + 10
    while table.state("a") == "building":
        assert time.monotonic() < deadline
        time.sleep(0.005)
    with pytest.raises(ValueError, match="bad adapter a"):
        table.poll("a")
    fail[0] = False
    _wait(table, "a")  # the error was reported once; the next poll built it again
    assert table.take("a") == b"ok"


def test_take_of_a_failing_build_in_flight_raises_and_keeps_nothing() -> None:
    builds = _Builds(make=lambda k: (_ for _ in ()).throw(RuntimeError("nan in block 3")))
    builds.release.clear()
    table = PrebuildTable(builds, size_of=len, max_builds=1, budget_bytes=100)
    table.poll("a")
    threading.Timer(0.05, builds.release.set).start()
    with pytest.raises(RuntimeError, match="nan in block 3"):
        table.take("a")
    time.sleep(0.05)
    assert table.state("a") == "absent"


def test_ready_results_stay_within_the_memory_budget_oldest_dropped_first() -> None:
    table = PrebuildTable(lambda k: bytearray(6), size_of=len, max_builds=1, budget_bytes=13)
    for key in ("a", "b", "c"):
        _wait(table, key)
        assert table.ready_bytes <= 13
    assert [table.state(k) for k in "abc"] == ["absent", "ready", "ready"] and table.dropped == 1
    assert table.take("a") is None  # dropped: the engine builds it again if asked


def test_a_result_larger_than_the_budget_is_kept_alone_for_the_request_waiting_on_it() -> None:
    table = PrebuildTable(lambda k: bytearray(50 if k == "big" else 6), size_of=len, max_builds=1, budget_bytes=13)
    _wait(table, "small")
    _wait(table, "big")
    assert table.state("small") == "absent" and table.state("big") == "ready"
    assert len(table.take("big")) == 50


def test_discarding_an_adapter_while_it_builds_keeps_nothing_of_that_build() -> None:
    builds = _Builds()
    builds.release.clear()
    table = PrebuildTable(builds, size_of=len, max_builds=1, budget_bytes=100)
    table.poll("a")
    time.sleep(0.02)
    table.discard("a")  # e.g. the mix was evicted from the registry meanwhile
    builds.release.set()
    time.sleep(0.1)
    assert table.state("a") == "absent" and table.take("a") is None and table.ready_bytes == 0


def test_at_most_max_builds_run_at_once() -> None:
    builds = _Builds()
    builds.release.clear()
    table = PrebuildTable(builds, size_of=len, max_builds=2, budget_bytes=1 << 20)
    for key in "abcde":
        table.poll(key)
    time.sleep(0.1)
    assert builds.running == 2
    builds.release.set()
    for key in "abcde":
        _wait(table, key)
    assert builds.most_at_once == 2 and sorted(builds.calls) == list("abcde")


def test_recently_used_is_an_lru_of_the_last_capacity_keys() -> None:
    seen = RecentlyUsed(2)
    assert [seen.touch(k) for k in ("a", "b", "a", "c", "b")] == [False, False, True, False, False]
    assert "a" not in seen and "b" in seen and "c" in seen
    seen.forget("c")
    assert "c" not in seen


def test_a_result_nobody_takes_is_dropped_after_its_time_to_live() -> None:
    now = [0.0]
    table = PrebuildTable(lambda k: bytearray(4), size_of=len, max_builds=1, budget_bytes=100, ttl_s=300,
                          clock=lambda: now[0])
    _wait(table, "a")
    now[0] = 299.0
    assert table.poll("a") is True  # still kept
    now[0] = 301.0
    assert table.take("a") is None and table.state("a") == "absent" and table.dropped == 1


def test_failed_builds_polled_once_are_dropped_after_ttl_and_free_what_their_frames_held() -> None:
    """A key polled once whose build fails (a client naming bad adapters) was kept forever, with the tensors its
    build had read alive in the error's frames."""
    import gc
    import weakref

    import torch

    alive: list[Any] = []
    now = [0.0]

    def build(key: str) -> Any:
        read = torch.ones(1 << 16)  # read before the check that fails
        alive.append(weakref.ref(read))
        raise ValueError(f"adapter {key}: non-finite values")

    table = PrebuildTable(build, size_of=lambda v: 0, max_builds=1, budget_bytes=1 << 20, ttl_s=10,
                          clock=lambda: now[0])
    for i in range(300):
        table.poll(f"bad-{i}")
    deadline = time.monotonic() + 10
    while table.state("bad-299") == "building" and time.monotonic() < deadline:
        time.sleep(0.01)
    gc.collect()
    assert sum(r() is not None for r in alive) == 0  # frames cleared: nothing a failure read stays alive
    assert sum(table.state(f"bad-{i}") == "failed" for i in range(300)) <= 256
    with pytest.raises(ValueError, match="bad-299"):  # the newest failure still answers its poller
        table.take("bad-299")
    now[0] = 100.0
    table.poll("later")  # later traffic expires the rest
    assert all(table.state(f"bad-{i}") == "absent" for i in range(299))
