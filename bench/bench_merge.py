"""Time vLLM's merge of a new adapter's packed modules, stock against the plugin's (issue 39 item 4; CPU only).

vLLM's ``_create_merged_loras_inplace`` looks every part of every packed module up in the adapter: 18,576 lookups on
the Qwen3-30B-A3B shape (48 layers, 128 per-expert parts of each experts block, and q/k/v), though a prepacked MoE
adapter has none of the per-expert parts. The plugin runs the same vLLM function over only the packed modules the
adapter has parts of (``integration.worker_patches._parts_only``), on the build's thread for a background build and
in the step otherwise. On the H200 host, r31's no-stall runs spent 25-35 ms between staging and the slot-write plan
on that thread with 32 requests decoding (the merge, slowed by the engine thread's hold on the GIL).

Both run here on vLLM's own manager class (made with ``object.__new__``, as ``tests/integration/test_merge_ahead.py``
does) and the same adapter, interleaved rep by rep; each rep's two models are checked equal. Prints a table and
writes JSON with the medians and the ratio.

Usage: python bench/bench_merge.py [--layers 48] [--experts 128] [--reps 30] [--out FILE]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from _common import median, print_table, write_json  # noqa: E402


def _factors(model: Any) -> list[tuple[str, str, list[Any]]]:
    """Each module's name, class and factors (A then B, ``None`` kept) in the model's order."""
    out = []
    for name, w in model.loras.items():
        factors = [t for attr in ("lora_a", "lora_b") for t in (getattr(w, attr) if isinstance(getattr(w, attr), list)
                                                               else [getattr(w, attr)])]
        out.append((name, type(w).__name__, factors))
    return out


def _equal(x: Any, y: Any) -> bool:
    import torch

    return x is y if x is None or y is None else bool(x.shape == y.shape and torch.equal(x, y))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48)
    ap.add_argument("--experts", type=int, default=128)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from factories import unpin_vllm
    from moe_factories import merge_adapter, merge_manager

    unpin_vllm()  # (vLLM 0.33's merge pins the factors when it believes it can)
    from vllm.lora.model_manager import LoRAModelManager

    from vllm_lora_ext.integration.worker_patches import _parts_only

    merge = LoRAModelManager._create_merged_loras_inplace
    merge = getattr(merge, "__wrapped__", merge)  # vLLM's own
    manager = merge_manager(args.layers, args.experts)
    times: dict[str, list[float]] = {"stock": [], "plugin": []}
    for rep in range(args.reps + 1):  # the first rep warms both (the plugin's index of parts is built there)
        models = {}
        for mode in ("stock", "plugin") if rep % 2 else ("plugin", "stock"):
            model = merge_adapter(args.layers, args.experts)
            t0 = time.perf_counter()
            merge(manager if mode == "stock" else _parts_only(manager, model), model)
            if rep:
                times[mode].append(time.perf_counter() - t0)
            models[mode] = model
        a, b = _factors(models["stock"]), _factors(models["plugin"])
        assert [(n, c, len(f)) for n, c, f in a] == [(n, c, len(f)) for n, c, f in b], "the two merges differ"
        assert all(_equal(x, y) for (_, _, fa), (_, _, fb) in zip(a, b) for x, y in zip(fa, fb)), "the merges differ"
    med = {mode: median(t) for mode, t in times.items()}
    ratio = med["plugin"] / med["stock"]
    rows = [[mode, f"{med[mode] * 1e3:.2f}", f"{min(times[mode]) * 1e3:.2f}"] for mode in times]
    rows.append(["plugin / stock", f"{ratio:.3f}x", ""])
    print(f"{args.layers} layers, {args.experts} experts a block, {args.reps} reps (interleaved), models equal")
    print_table(rows, ["merge", "median ms", "min ms"])
    write_json("merge", {"layers": args.layers, "experts": args.experts, "reps": args.reps, "median_s": med,
                         "ratio_plugin_to_stock": ratio, "times_s": times}, args.out)


if __name__ == "__main__":
    main()
