"""The kept thread pools a worker starts ahead (``transport.pools.start_pools``): the very pools the first read lends,
their threads alive and each on one OpenMP thread (no vLLM)."""

from __future__ import annotations

import threading
import time

import pytest

from vllm_lora_ext.transport import pools


def test_started_pools_are_lent_next_with_every_thread_alive_and_the_openmp_runtime_found() -> None:
    pools._openmp.cache_clear()
    pools._IDLE.pop(("test-started", 3), None)
    pools.start_pools([("test-started", 3)])
    assert pools._openmp.cache_info().currsize == 1  # found (or not) once, by the first thread, not by a load
    (kept,) = pools._IDLE[("test-started", 3)]
    with pools.lent_pool("test-started", 3) as pool:
        assert pool is kept and len(pool._threads) == 3 and all(t.is_alive() for t in pool._threads)
        seen = set(pool.map(lambda _: threading.current_thread().name, range(30)))
    assert seen <= {t.name for t in kept._threads}


def test_a_thread_that_cannot_start_fails_neither_start_up_nor_the_next_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """Start-up goes on where the host's thread limit stops a pool's second thread, and no pool with a thread still
    waiting at its gate is kept for the next load (r34's second review: start-up failed, then a load waited 5 s)."""
    name = "test-no-thread"
    pools._IDLE.pop((name, 4), None)
    real, started = threading.Thread.start, []

    def start(self: threading.Thread) -> None:
        if self.name.startswith(name):
            started.append(self.name)
            if len(started) == 2:
                raise RuntimeError("can't start new thread")
        real(self)

    monkeypatch.setattr(threading.Thread, "start", start)
    pools.start_pools([(name, 4)])
    monkeypatch.setattr(threading.Thread, "start", real)
    assert not pools._IDLE.get((name, 4))
    t0 = time.perf_counter()
    assert pools.run_in_pool(name, 4, lambda x: x, [1]) == [1]
    assert time.perf_counter() - t0 < 1.0


def test_a_pool_whose_thread_initializer_raised_is_not_kept(monkeypatch: pytest.MonkeyPatch) -> None:
    name = "test-broken"
    pools._IDLE.pop((name, 2), None)
    monkeypatch.setattr(pools, "one_intra_op_thread", lambda: 1 / 0)
    pools.start_pools([(name, 2)])
    with pytest.raises(Exception):
        pools.run_in_pool(name, 2, lambda x: x, [1])
    assert not pools._IDLE.get((name, 2))
    monkeypatch.undo()
    assert pools.run_in_pool(name, 2, lambda x: x, [1]) == [1]


def _on_a_thread_of(count: int, fn: object) -> list[object]:
    """Run ``fn()`` on a new thread whose OpenMP count is ``count``; its result (or error) in a list."""
    import torch

    out: list[object] = []

    def run() -> None:
        torch.get_num_threads()  # torch's per-thread set-up first
        pools._openmp().omp_set_num_threads(count)
        try:
            out.append(fn())  # type: ignore[operator]
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out.append(e)

    t = threading.Thread(target=run)
    t.start()
    t.join()
    return out


def test_intra_op_threads_lowers_the_calling_threads_count_for_the_block_and_gives_it_back() -> None:
    """The staging copy's fills run on at most `transport.pools.copy_threads` OpenMP threads of the thread that
    stages (r35): inside the block torch's ops on that thread see that count, after it the thread's own count, and
    another thread meanwhile keeps its own."""
    import torch

    if pools._openmp() is None:
        pytest.skip("torch's OpenMP runtime not found")
    own = torch.get_num_threads()

    def inside() -> tuple[int, int, int]:
        with pools.intra_op_threads(2):
            during = torch.get_num_threads()
            elsewhere = _on_a_thread_of(3, torch.get_num_threads)[0]
        return during, int(elsewhere), torch.get_num_threads()  # type: ignore[call-overload]

    assert _on_a_thread_of(4, inside) == [(2, 3, 4)]
    assert torch.get_num_threads() == own


def test_intra_op_threads_never_raises_the_count() -> None:
    """vLLM 0.33's workers run torch on one thread (TP > 1 workers on their share of the cores): the staging copy
    keeps that count rather than starting more threads than the user or vLLM allowed."""
    import torch

    if pools._openmp() is None:
        pytest.skip("torch's OpenMP runtime not found")

    def inside() -> int:
        with pools.intra_op_threads(8):
            return torch.get_num_threads()

    assert _on_a_thread_of(1, inside) == [1]
    assert _on_a_thread_of(3, inside) == [3]


def test_intra_op_threads_gives_the_count_back_when_the_block_raises() -> None:
    import torch

    if pools._openmp() is None:
        pytest.skip("torch's OpenMP runtime not found")

    def inside() -> int:
        with pytest.raises(ZeroDivisionError), pools.intra_op_threads(1):
            1 / 0
        return torch.get_num_threads()

    assert _on_a_thread_of(4, inside) == [4]


@pytest.mark.parametrize(("cores", "threads"), [(1, 1), (2, 1), (3, 1), (16, 8), (32, 16), (128, 16)])
def test_the_staging_copy_fills_on_half_the_cores_up_to_16(cores: int, threads: int) -> None:
    from vllm_lora_ext.transport.pools import copy_threads

    assert copy_threads(cores) == threads
