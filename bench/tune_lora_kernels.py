"""Tune vLLM's multi-LoRA shrink/expand Triton kernels on this GPU and write the files vLLM reads.

vLLM (0.26-0.33, ``vllm/lora/ops/triton_ops/utils.py``) looks in ``VLLM_TUNED_CONFIG_FOLDER`` for
``{gpu}_SHRINK.json`` and ``{gpu}_EXPAND_{TRUE,FALSE}.json``, each ``table[max_loras][num_slices][m][k][n]``,
where ``max_loras`` is the engine's slots + 1, ``m`` the tokens in the batch, and (k, n) = (hidden, rank) for
shrink, (rank, largest slice) for expand. Every key but ``num_slices`` is matched to the nearest one.

How a candidate is timed: it is written as a one-entry table in that format, vLLM's own launcher
(``_lora_shrink`` / ``_lora_expand``) reads it, and ten launches are replayed in a CUDA graph (the engine
decodes in graphs). The batch metadata comes from vLLM's ``LoRAKernelMeta`` as the engine makes it, without
active-LoRA specialisation (vLLM's default): the grid always spans every slot, and a shape is timed twice,
with all tokens on one adapter and with the tokens spread over as many adapters as there are slots. A
candidate wins on the sum of its two times relative to vLLM's default config, and only if neither is more
than 2% slower than the default. The search starts from vLLM's default and changes one parameter at a
time, twice over. The winner's output is compared with the default's (bf16 tolerance); a mismatch keeps
the default.

The table written covers ``num_slices`` 1..16 (vLLM matches that key exactly: a missing one would fail in
the kernel launch), copying the nearest tuned slice count. ``EXPAND_FALSE`` copies ``EXPAND_TRUE``: the
kernel differs only by not adding the output it writes.

Usage (on the GPU machine)::

    python bench/tune_lora_kernels.py --out-dir src/vllm_lora_ext/kernel_configs --json tune.json
    python bench/tune_lora_kernels.py --grid quick ...   # the 1B decode shapes only (minutes)
    python bench/tune_lora_kernels.py --grid decode ...  # 16-64-token decode batches, 16 and 64 slots
    python bench/tune_lora_kernels.py --rebuild r1.json r2.json --out-dir DIR   # tables from results (CPU)

Shapes of the grid left untuned (``--budget-s`` ran out) are written with vLLM's default config, so that
the nearest-key lookup falls back to vLLM's behaviour there rather than to a neighbour's tuned config.

Prints, per shape, vLLM's default and the tuned time (µs, one adapter / all slots).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import graph_time_us, print_table, write_json  # noqa: E402

from vllm_lora_ext.kernel_configs import SLICE_KEYS, check_table, config_file_names, file_stem  # noqa: E402

SPACE = {
    "shrink": {"block_m": [16, 32, 64, 128], "block_n": [16, 32, 64], "block_k": [32, 64, 128, 256],
               "split_k": [1, 2, 4, 8, 16, 32, 64], "num_warps": [2, 4, 8], "num_stages": [2, 3, 4]},
    "expand": {"block_m": [16, 32, 64, 128], "block_n": [32, 64, 128, 256], "block_k": [16, 32, 64],
               "num_warps": [2, 4, 8], "num_stages": [2, 3, 4]},
}
# Shapes: (slots, num_slices, m, k_or_hidden, rank). Decode first, so a cut-short run has what matters most.
GRIDS = {
    "quick": {"slots": [64], "slices": [1, 3], "m": [32], "hidden": [2048, 8192], "rank": [16]},
    "full": {"slots": [1, 16, 64], "slices": [1, 3], "m": [1, 16, 32, 64, 256, 2048],
             "hidden": [2048, 4096, 8192], "rank": [16, 64]},
    # Batches of 16-64 decode tokens over many slots (issue 12 P4), where a run of "full" that stopped after
    # m = 1 left vLLM's defaults; its shapes are all in "full", so `--rebuild` merges the two runs' results.
    "decode": {"slots": [64, 16], "slices": [1, 3], "m": [32, 16, 64], "hidden": [2048, 4096, 8192],
               "rank": [16]},
}
REPS = 10


class Bench:
    """Times one op on one shape with any config, through vLLM's launcher."""

    def __init__(self, op: str, slots: int, slices: int, m: int, hidden: int, rank: int, folder: Path) -> None:
        import torch
        from vllm.lora.ops.triton_ops import utils
        from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

        self.op, self.slots, self.slices, self.m, self.hidden, self.rank = op, slots, slices, m, hidden, rank
        self.folder = folder
        utils._LORA_A_PTR_DICT.clear()  # keyed by data_ptr: a new tensor at an old address would reuse old strides
        utils._LORA_B_PTR_DICT.clear()
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(0)
        if op == "shrink":
            self.x = torch.randn(m, hidden, device=dev, generator=g).bfloat16()
            self.w = [(torch.randn(slots, 1, rank, hidden, device=dev, generator=g) * 0.05).bfloat16()
                      for _ in range(slices)]
            self.y = torch.empty(slices, m, rank, device=dev, dtype=torch.float32)
        else:
            self.x = torch.randn(slices, m, rank, device=dev, generator=g)
            self.w = [(torch.randn(slots, 1, hidden, rank, device=dev, generator=g) * 0.05).bfloat16()
                      for _ in range(slices)]
            self.y = torch.zeros(m, hidden * slices, device=dev, dtype=torch.bfloat16)
        self.metas = {}
        for label, active in (("one", 1), ("all", min(slots, m))):
            meta = LoRAKernelMeta.make(slots, m, dev)
            meta.prepare_tensors((torch.arange(m, device=dev) % active).to(torch.int32))
            self.metas[label] = meta.meta_args(m, False)

    def key(self) -> tuple[int, int, int, int, int]:
        k, n = (self.hidden, self.rank) if self.op == "shrink" else (self.rank, self.hidden)
        return self.slots + 1, self.slices, self.m, k, n

    def _use(self, config: dict[str, Any]) -> None:
        from vllm.lora.ops.triton_ops import utils

        slots1, slices, m, k, n = self.key()
        table = {str(slots1): {str(slices): {str(m): {str(k): {str(n): config}}}}}
        for name in file_names(gpu_name(), self.op):
            (self.folder / name).write_text(json.dumps(table))
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()

    def _launch(self, label: str) -> None:
        from vllm.lora.ops.triton_ops.lora_expand_op import _lora_expand
        from vllm.lora.ops.triton_ops.lora_shrink_op import _lora_shrink

        meta = self.metas[label]
        if self.op == "shrink":
            _lora_shrink(self.x, self.w, self.y, *meta, 1.0)
        else:
            _lora_expand(self.x, self.w, self.y, *meta, offset_start=0, add_inputs=True)

    def output(self, config: dict[str, Any], label: str = "all") -> Any:
        import torch

        self._use(config)
        self.y.zero_()
        self._launch(label)
        torch.cuda.synchronize()
        return self.y.float().clone()

    def time_us(self, config: dict[str, Any]) -> dict[str, float] | None:
        """Microseconds per launch for both token spreads, or None if the config does not compile/launch."""
        self._use(config)
        out = {}
        for label in self.metas:
            t = graph_time_us(functools.partial(self._launch, label), REPS, what=config)
            if t is None:
                return None
            out[label] = t
        return out


def gpu_name() -> str:
    import torch

    return file_stem(torch.cuda.get_device_name())


def file_names(gpu: str, op: str) -> list[str]:
    shrink, expand_true, expand_false = config_file_names(gpu)
    return [shrink] if op == "shrink" else [expand_true, expand_false]


def default_config(op: str, slots: int, slices: int, m: int, hidden: int, rank: int) -> dict[str, Any]:
    """vLLM's own default for this shape (read with no tuned folder set)."""
    from vllm.lora.ops.triton_ops import utils

    saved = os.environ.pop("VLLM_TUNED_CONFIG_FOLDER", None)
    try:
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()
        return dict(utils.get_lora_op_configs(op, slots + 1, m, hidden, rank, slices,
                                              add_inputs=True if op == "expand" else None))
    finally:
        if saved is not None:
            os.environ["VLLM_TUNED_CONFIG_FOLDER"] = saved


def score(t: dict[str, float], base: dict[str, float]) -> float | None:
    ratios = [t[k] / base[k] for k in base]
    return None if max(ratios) > 1.02 else sum(ratios)


def tune_shape(bench: Bench, default: dict[str, Any], budget_left: float) -> dict[str, Any]:
    import torch

    base = bench.time_us(default)
    assert base is not None, "vLLM's default config failed to launch"
    best, best_t, best_score = dict(default), base, score(base, base)
    tried = {json.dumps(default, sort_keys=True)}
    deadline = time.monotonic() + budget_left
    for _ in range(2):
        for param, values in SPACE[bench.op].items():
            for v in values:
                if time.monotonic() > deadline:
                    break
                cand = dict(best, **{param: v})
                sig = json.dumps(cand, sort_keys=True)
                if sig in tried:
                    continue
                tried.add(sig)
                t = bench.time_us(cand)
                s = score(t, base) if t is not None else None
                if s is not None and best_score is not None and s < best_score:
                    best, best_t, best_score = cand, t, s
    ok = True
    if best != default:
        for label in ("one", "all"):
            ref, got = bench.output(default, label), bench.output(best, label)
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()) + 1e-3):
                ok = False
        if not ok:
            print(f"  {bench.op} {bench.key()}: tuned output differs from the default's; keeping the default")
            best, best_t = dict(default), base
    return {"op": bench.op, "key": list(bench.key()), "default": default, "tuned": best, "default_us": base,
            "tuned_us": best_t, "tried": len(tried), "output_matches_default": ok}


def build_tables(results: list[dict[str, Any]]) -> dict[str, dict]:
    """vLLM's nested tables from the tuned shapes, every slice count 1..16 filled from the nearest tuned one."""
    tables: dict[str, dict] = {}
    tuned_keys = {(r["op"], tuple(r["key"])) for r in results if not r.get("untuned")}
    for r in results:
        if r.get("untuned") and (r["op"], tuple(r["key"])) in tuned_keys:
            continue  # another run tuned this shape: its config wins over the default, whatever the order
        slots1, slices, m, k, n = r["key"]
        t = tables.setdefault(r["op"], {}).setdefault(str(slots1), {})
        t.setdefault(str(slices), {}).setdefault(str(m), {}).setdefault(str(k), {})[str(n)] = r["tuned"]
    for per_slots in (s for op in tables.values() for s in op.values()):
        tuned = sorted(int(s) for s in per_slots)
        for key in SLICE_KEYS:
            if key not in per_slots:
                per_slots[key] = per_slots[str(min(tuned, key=lambda x: (abs(x - int(key)), -x)))]
    for op, table in tables.items():
        check_table(table, op, name=op)
    return tables


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="full")
    ap.add_argument("--ops", default="shrink,expand")
    ap.add_argument("--budget-s", type=float, default=480.0, help="stop tuning new shapes after this long")
    ap.add_argument("--out-dir", default=None, help="write the vLLM config files here")
    ap.add_argument("--json", default=None, help="results file (default bench/results/tune_lora_<gpu>.json)")
    ap.add_argument("--rebuild", nargs="*", default=None, help="write the tables from these results files")
    args = ap.parse_args()
    gpu = gpu_name() if torch.cuda.is_available() else ""
    grid = GRIDS[args.grid]
    ops = [o for o in args.ops.split(",") if o]
    shapes = [(op, slots, slices, m, h, r) for m in grid["m"] for op in ops for slots in grid["slots"]
              for slices in grid["slices"] for h in grid["hidden"] for r in grid["rank"]]
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    if args.rebuild:  # tables from earlier runs' results (CPU is enough: vLLM's defaults need no GPU)
        for f in args.rebuild:
            data = json.loads(Path(f).read_text())
            gpu = data["gpu"]
            results += [r for r in data["results"] if r["op"] in ops]
        shapes = [s for s in shapes if s[0] in {r["op"] for r in results}]
    elif not torch.cuda.is_available():
        sys.exit("tune_lora_kernels needs a CUDA GPU (or --rebuild)")
    with tempfile.TemporaryDirectory(prefix="lora-tune-") as tmp:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = tmp
        for i, (op, slots, slices, m, h, r) in enumerate(shapes):
            if args.rebuild:
                break
            left = args.budget_s - (time.monotonic() - t0)
            if left <= 0:
                print(f"budget spent: {len(shapes) - i} of {len(shapes)} shapes not tuned (vLLM's default kept)")
                break
            default = default_config(op, slots, slices, m, h, r)
            res = tune_shape(Bench(op, slots, slices, m, h, r, Path(tmp)), default, min(left, 60.0))
            results.append(res)
            d, t = res["default_us"], res["tuned_us"]
            print(f"[{time.monotonic() - t0:6.0f}s] {op:6s} slots={slots:2d} slices={slices} m={m:5d} hidden={h:5d} "
                  f"r={r:2d}: default {d['one']:7.1f}/{d['all']:7.1f} us -> tuned {t['one']:7.1f}/{t['all']:7.1f} "
                  f"({res['tried']} tried)", flush=True)
    tuned_keys = {(r["op"], tuple(r["key"])) for r in results}
    for op, slots, slices, m, h, r in shapes:  # the grid's untuned shapes keep vLLM's default, so that the
        key = (slots + 1, slices, m) + ((h, r) if op == "shrink" else (r, h))  # nearest lookup finds it there
        if (op, key) not in tuned_keys:
            d = default_config(op, slots, slices, m, h, r)
            results.append({"op": op, "key": list(key), "default": d, "tuned": d, "default_us": None,
                            "tuned_us": None, "tried": 0, "output_matches_default": True, "untuned": True})
    tables = build_tables(results)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for op, table in tables.items():
            for name in file_names(gpu, op):
                (out / name).write_text(json.dumps(table, sort_keys=True, separators=(",", ":")) + "\n")
                print("wrote", out / name)
    rows = [[r["op"], *r["key"], r["default_us"]["one"], r["tuned_us"]["one"], r["default_us"]["all"],
             r["tuned_us"]["all"]] for r in results if not r.get("untuned")]
    print(f"{sum(1 for r in results if r.get('untuned'))} grid shapes untuned (vLLM's default written)")
    print_table(rows, ["op", "slots+1", "slices", "m", "k", "n", "default us (1 adapter)", "tuned us (1)",
                       "default us (all slots)", "tuned us (all)"])
    write_json(f"tune_lora_{gpu.lower()}", {"gpu": gpu, "grid": args.grid, "reps_per_graph": REPS,
                                            "seconds": time.monotonic() - t0, "results": results}, args.json)


if __name__ == "__main__":
    main()
