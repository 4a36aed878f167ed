"""The host time a decode step spends making its batch's adapters active, with and without the plugin (CPU).

Every engine step, vLLM's LoRA worker manager calls ``add_adapter`` once for each distinct adapter of the batch
(``LRUCacheWorkerLoRAManager._apply_adapters``): for adapters already in GPU slots that only touches its caches.
The plugin wraps ``add_adapter`` (PATCHES.md #2, #3), so this cost grows with the number of distinct adapters of a
batch, which is P4's case (issue 12): ``profile_decode.py`` found the 32-adapter step's wall time growing by more
than its GPU time.

This runs vLLM's own ``LRUCacheWorkerLoRAManager._apply_adapters`` on vLLM's own manager classes (their fields
filled in directly: their constructors need a model on a GPU) holding 64 registered adapters in 64 slots, all
active, as a warm decode batch finds them, for a batch with no adapter (base requests), on one adapter and on 32
distinct ones: stock (plugin not registered) and plugin (registered), interleaved, medians of ``--reps`` rounds of
``--steps`` steps.

It also times what the plugin adds to each base request's admission (``LLMEngine.add_request``, patch 5, with no
``lora_request``): the plugin's wrapper around a no-op against the no-op alone. With the step's activation, this is
all the plugin's host code a base request meets in an offline engine (issue 12: base requests ≤ 1% slower).

Usage: python bench/bench_step_adapters.py [--steps 2000] [--reps 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402

SLOTS, N_DISTINCT = 64, 32


def make_manager() -> tuple[Any, list[Any]]:
    """vLLM's LRU worker manager around vLLM's LRU model manager, 64 adapters registered and active."""
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    config = LoRAConfig(max_lora_rank=16, max_loras=SLOTS, max_cpu_loras=SLOTS + 8, lora_dtype=torch.bfloat16)
    model_mgr = object.__new__(LRUCacheLoRAModelManager)
    model_mgr.lora_config = config
    model_mgr._registered_adapters = AdapterLRUCache(config.max_cpu_loras, lambda i: None)
    model_mgr._active_adapters = AdapterLRUCache(SLOTS, lambda i: None)
    model_mgr.lora_index_to_id = [None] * SLOTS
    requests = []
    for i in range(SLOTS):
        lora_id = i + 1
        model_mgr._registered_adapters[lora_id] = LoRAModel(lora_id, 8, {})
        model_mgr._active_adapters[lora_id] = None
        model_mgr.lora_index_to_id[i] = lora_id
        requests.append(LoRARequest(f"a{lora_id}", lora_id, f"/adapters/a{lora_id}"))
    worker = object.__new__(LRUCacheWorkerLoRAManager)
    worker._adapter_manager = model_mgr
    worker.lora_config = config
    return worker, requests


def time_steps(worker: Any, batch: set[Any], steps: int) -> float:
    """Seconds per step of ``_apply_adapters(batch)``."""
    apply = worker._apply_adapters
    t = time.perf_counter()
    for _ in range(steps):
        apply(batch)
    return (time.perf_counter() - t) / steps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=2000)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from vllm_lora_ext.integration import plugin

    worker, requests = make_manager()
    cases = {"none": set(), "one": {requests[0]}, "distinct": set(requests[:N_DISTINCT])}
    secs: dict[str, dict[str, list[float]]] = {v: {c: [] for c in cases} for v in ("stock", "plugin")}
    for rep in range(args.reps + 1):  # the first round warms up and is not kept
        for v in (("stock", "plugin") if rep % 2 else ("plugin", "stock")):
            if v == "plugin":
                plugin.register()
            else:
                plugin.unregister()
            for c, batch in cases.items():
                s = time_steps(worker, batch, args.steps)
                if rep:
                    secs[v][c].append(s)
    plugin.unregister()
    rows, summary = [], {}
    for c in cases:
        st, pl = median(secs["stock"][c]) * 1e6, median(secs["plugin"][c]) * 1e6
        per = (pl - st) / len(cases[c]) if cases[c] else None
        summary[c] = {"stock_us_per_step": st, "plugin_us_per_step": pl, "plugin_vs_stock": pl / st,
                      "plugin_extra_us_per_adapter": per}
        rows.append([c, len(cases[c]), st, pl, pl / st, "-" if per is None else per])
    print_table(rows, ["batch", "adapters", "stock µs/step", "plugin µs/step", "plugin / stock",
                       "plugin extra µs per adapter"])
    summary["base_request_admission"] = admission = time_admission(args.steps * 50, args.reps)
    print(f"base request admission (LLMEngine.add_request, no lora_request): the plugin's wrapper adds "
          f"{admission['plugin_extra_us']:.3f} µs a request ({admission['wrapped_us']:.3f} µs against "
          f"{admission['bare_us']:.3f} µs for the no-op it wraps)")
    write_json("step_adapters", {"slots": SLOTS, "steps": args.steps, "reps": args.reps, "seconds": secs,
                                 "summary": summary}, args.out)


def time_admission(calls: int, reps: int) -> dict[str, float]:
    """µs per call of the plugin's ``add_request`` wrapper around a no-op, and of the no-op alone (medians)."""
    from vllm_lora_ext.integration.engine_patches import make_add_request as _make_add_request

    def bare(self: Any, request_id: str, prompt: Any, params: Any, arrival_time: Any = None,
             lora_request: Any = None, *args: Any, **kwargs: Any) -> None:
        return None

    wrapped = _make_add_request(bare)
    out: dict[str, list[float]] = {"bare": [], "wrapped": []}
    for rep in range(reps + 1):
        for name, fn in (("bare", bare), ("wrapped", wrapped)) if rep % 2 else (("wrapped", wrapped), ("bare", bare)):
            t = time.perf_counter()
            for i in range(calls):
                fn(None, "r", None, None, None, None)
            if rep:
                out[name].append((time.perf_counter() - t) / calls * 1e6)
    b, w = median(out["bare"]), median(out["wrapped"])
    return {"bare_us": b, "wrapped_us": w, "plugin_extra_us": w - b}


if __name__ == "__main__":
    main()
