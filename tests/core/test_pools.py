"""The kept thread pools a worker starts ahead (``transport.pools.start_pools``): the very pools the first read lends,
their threads alive and each on one OpenMP thread (no vLLM)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from moe_factories import make_truth, write_moe_adapter
from vllm_lora_ext import _util
from vllm_lora_ext.transport import pools


@pytest.mark.parametrize("cores", [2, 8, 16])
def test_the_pools_started_ahead_are_the_ones_a_many_block_read_lends(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                       cores: int) -> None:
    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_plan import plan_experts
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks, read_pools
    from vllm_lora_ext.reader import SafetensorsReader

    write_moe_adapter(tmp_path, [make_truth(4, 8, 6, 2, seed) for seed in range(6)], ["2d"] * 6, rank=2)
    monkeypatch.setattr(_util, "usable_cores", lambda: cores)
    lent: list[tuple[str, int]] = []

    class Spy(_util.FreshPools):
        @staticmethod
        def lent_pool(name: str, workers: int):  # type: ignore[no-untyped-def]
            lent.append((name, workers))
            return _util.FreshPools.lent_pool(name, workers)

        @staticmethod
        def run_in_pool(name, workers, fn, items):  # type: ignore[no-untyped-def]
            lent.append((name, workers))
            return _util.FreshPools.run_in_pool(name, workers, fn, items)

    reader = SafetensorsReader(tmp_path / "adapter_model.safetensors")
    cfg = config_from_dict(json.loads((tmp_path / "adapter_config.json").read_text()))
    plans = {p: plan_experts(g, MoESpec(p, 4, 8, 6), config=cfg) for p, g in group_moe_keys(reader.header.shapes).items()}
    read_blocks(plans, reader, config=cfg, options=ReadOptions(check_finite_as="x", pools=Spy))
    assert sorted(lent) == sorted(read_pools(cores))


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
