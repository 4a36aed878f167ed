"""The kept thread pools a worker starts ahead (``transport.pools.start_pools``): the very pools the first read lends,
their threads alive and each on one OpenMP thread (no vLLM)."""

from __future__ import annotations

import threading

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
