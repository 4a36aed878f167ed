"""Tune vLLM's fused-MoE LoRA kernel configs on this GPU, for the Qwen3-30B-A3B shape, and write the files vLLM reads.

What vLLM reads (0.26-0.33, ``vllm/lora/punica_wrapper/punica_gpu.py``): ``add_lora_w13`` and ``add_lora_w2`` get
four configs, one per op type (``fused_moe_lora_{w13,w2}_{shrink,expand}``). By default (``use_tuned_config``
off) they are derived from the base MoE GEMM's config for the batch (``try_get_optimal_moe_lora_config``: vLLM's
fused_moe JSON for E and N on this GPU, else its default), called "stock" here. With the flag on they come from
``{gpu}_FUSED_MOE_LORA_*.json``, ``table[max_loras][num_slices][m][k][n][i]`` (see
``vllm_lora_ext.kernel_configs.moe``: max_loras = slots, k = stacked rank, n = hidden, i = intermediate).

What the configs change: a layer that is not fully sharded (in 0.33 also rank <= 128) runs vLLM's one-shot kernel,
or its small-batch kernel for few tokens spread over many adapters. These read only ``block_m``: the block
``moe_lora_align_block_size`` pads each expert's tokens to, and the one-shot kernel's tile (the small-batch path
reads none). block_n/k, warps, stages and group_size_m are read by the two-kernel path only (fully sharded,
larger ranks), which one GPU cannot run sharded. w2 reuses w13's alignment, so the four configs share block_m.
``--space block_m`` (the default) tries each block_m; ``--space full`` then walks the other parameters of each op
one at a time, for a vLLM whose launch reads them.

How a candidate is timed: its four configs are written as one-entry tables in vLLM's format into a temporary
``VLLM_TUNED_CONFIG_FOLDER``, and one layer's LoRA step (w13, then w2 on w13's alignment) is launched through
vLLM's ``PunicaWrapperGPU`` as its MoE experts launch it (``use_tuned_config`` on), ten steps replayed in a CUDA
graph. Stock is the same launch with the flag off, timed in the same run. The token-to-adapter mapping comes from
vLLM's ``LoRAKernelMeta`` with the engine's default (no active-LoRA specialisation); each shape is timed with all
tokens on one adapter and with tokens spread over min(slots, tokens) adapters, random top-8 experts per token.
A candidate wins on the sum of its two times relative to stock, if that sum is at least 1% lower and neither
time is more than 2% slower. The winner's w13 and w2 outputs, both spreads, are compared with stock's (bf16
tolerance); a mismatch keeps stock.

Tables written: every tuned shape, and stock at every (slots, rank) for the batch sizes of vLLM's own H200 file
for this MoE shape (1 to 4096) and the grid's, so that where nothing was tuned the nearest-key lookup gives
stock's config (shapes left when ``--budget-s`` runs out are written with stock too). num_slices 1 and 2 hold
the same configs (w13 looks up 2, or 1 on the 3D-fused layer; w2 looks up 1).

Grids (Qwen3-30B-A3B: hidden 2048, intermediate 768, 128 experts, top-8; ranks 16 and 32; slots 1, 4, 16):
    quick: tokens 1, 4, 8, 16, 32, 64 (decode) and 256, 1024 (prefill): 48 shapes, meant for one device call
           (``--budget-s 400`` caps the tuning; the shapes it leaves are written with stock)
    full:  tokens 1, 2, 4, 8, 16, 24, 32, 48, 64 and 128, 256, 512, 1024, 2048, 4096: 90 shapes (give it
           ``--budget-s 1500`` outside the device calls' 600 s limit, or merge runs with ``--rebuild``)

Usage (on the GPU machine)::

    python bench/tune_moe_lora_kernels.py --grid quick --out-dir src/vllm_lora_ext/kernel_configs --json r.json
    python bench/tune_moe_lora_kernels.py --rebuild r1.json r2.json --out-dir DIR   # tables from results (CPU)

Prints, per shape, stock's and the tuned time (µs per layer step, one adapter / spread) and block_m.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, graph_time_us, print_table, write_json  # noqa: E402

from vllm_lora_ext.kernel_configs import file_stem  # noqa: E402
from vllm_lora_ext.kernel_configs.moe import MOE_OPS, MOE_SLICE_KEYS, check_moe_tables, moe_config_file_names  # noqa: E402

HIDDEN, INTERMEDIATE, EXPERTS, TOP_K = 2048, 768, 128, 8  # Qwen3-30B-A3B's MoE layers
GRIDS = {
    "quick": {"rank": [16, 32], "slots": [1, 4, 16], "m": [1, 4, 8, 16, 32, 64, 256, 1024]},
    "full": {"rank": [16, 32], "slots": [1, 4, 16],
             "m": [1, 2, 4, 8, 16, 24, 32, 48, 64, 128, 256, 512, 1024, 2048, 4096]},
}
# The batch sizes of vLLM's E=128,N=768 H200 file: stock is written there wherever the grid tuned nothing.
STOCK_M = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048, 3072, 4096]
BLOCK_M = [16, 32, 64, 128]  # moe_lora_align_block_size and the one-shot kernel need a power of 2, >= 16
PER_OP = {"block_n": [16, 32, 64, 128], "block_k": [16, 32, 64, 128], "num_warps": [4, 8],
          "num_stages": [2, 3, 4], "group_size_m": [1, 8, 16]}
REPS = 10


@dataclass(frozen=True)
class Shape:
    slots: int
    m: int
    rank: int

    def key(self) -> list[int]:
        return [self.slots, self.m, self.rank]


def table_form(config: dict[str, Any]) -> dict[str, Any]:
    """vLLM's config dict (``BLOCK_SIZE_M``, ``num_warps``) in the tables' lower-case names (``block_m``)."""
    out = {}
    for key, value in config.items():
        out["block_" + key[len("BLOCK_SIZE_"):].lower() if key.startswith("BLOCK_SIZE_") else key.lower()] = value
    return out


def stock_configs(shape: Shape) -> dict[str, dict[str, Any]]:
    """The four configs vLLM derives for this shape with ``use_tuned_config`` off (as ``add_lora_w13`` asks)."""
    import torch
    from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
    from vllm.model_executor.layers.fused_moe.config import _get_config_dtype_str

    dtype = _get_config_dtype_str(dtype=torch.bfloat16, use_fp8_w8a8=False, use_int8_w8a16=False,
                                  use_int4_w4a16=False)
    return {op: table_form(try_get_optimal_moe_lora_config(
        op_type=op, w1_shape=(EXPERTS, 2 * INTERMEDIATE, HIDDEN), w2_shape=(EXPERTS, HIDDEN, INTERMEDIATE),
        rank=shape.rank, top_k=TOP_K, dtype=dtype, M=shape.m)) for op in MOE_OPS}


def one_entry_tables(shape: Shape, configs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The four tables vLLM reads for one shape, as `build_tables` writes them."""
    tables = {}
    for op in MOE_OPS:
        leaf = {str(shape.m): {str(shape.rank): {str(HIDDEN): {str(INTERMEDIATE): configs[op]}}}}
        tables[op] = {str(shape.slots): {s: leaf for s in MOE_SLICE_KEYS}}
    return tables


def write_tables(folder: Path, gpu: str, tables: dict[str, dict[str, Any]], *, compact: bool = True) -> list[Path]:
    paths = []
    for op, name in zip(MOE_OPS, moe_config_file_names(gpu)):
        text = json.dumps(tables[op], sort_keys=True, separators=(",", ":")) if compact else json.dumps(tables[op])
        (folder / name).write_text(text + "\n")
        paths.append(folder / name)
    return paths


class Step:
    """One MoE layer's LoRA step (w13, then w2 on w13's alignment) for one shape, through vLLM's PunicaWrapperGPU."""

    def __init__(self, shape: Shape, folder: Path, gpu: str) -> None:
        import torch
        from vllm.config.lora import LoRAConfig
        from vllm.lora.ops.triton_ops import fused_moe_lora_op
        from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

        fused_moe_lora_op._LORA_PTR_DICT.clear()  # keyed by data_ptr: a new tensor at an old address reuses it
        self.shape, self.folder, self.gpu = shape, folder, gpu
        dev = torch.device("cuda")
        g = torch.Generator(device=dev).manual_seed(0)
        s, m, r = shape.slots, shape.m, shape.rank

        def w(*dims: int) -> torch.Tensor:
            return (torch.randn(*dims, device=dev, generator=g) * 0.05).bfloat16()

        self.w13_a = (w(s, EXPERTS, r, HIDDEN), w(s, EXPERTS, r, HIDDEN))
        self.w13_b = (w(s, EXPERTS, INTERMEDIATE, r), w(s, EXPERTS, INTERMEDIATE, r))
        self.w2_a, self.w2_b = (w(s, EXPERTS, r, INTERMEDIATE),), (w(s, EXPERTS, HIDDEN, r),)
        self.x, self.x2 = w(m, HIDDEN) * 20, w(m * TOP_K, INTERMEDIATE) * 20
        self.y13 = torch.zeros(m, TOP_K, 2 * INTERMEDIATE, device=dev, dtype=torch.bfloat16)
        self.y2 = torch.zeros(m, TOP_K, HIDDEN, device=dev, dtype=torch.bfloat16)
        scores = torch.rand(m, EXPERTS, device=dev, generator=g)
        weights, ids = scores.softmax(dim=-1).topk(TOP_K, dim=-1)
        self.topk_weights, self.topk_ids = weights.float(), ids.to(torch.int32)
        # vLLM reads only the base weights' shapes here (for stock's config): no memory behind them
        self.w1 = torch.empty(EXPERTS, 2 * INTERMEDIATE, HIDDEN, device="meta", dtype=torch.bfloat16)
        self.w2 = torch.empty(EXPERTS, HIDDEN, INTERMEDIATE, device="meta", dtype=torch.bfloat16)
        self.adapter_enabled = torch.zeros(s + 1, dtype=torch.int32, device=dev)
        self.adapter_enabled[:s] = 1  # every slot holds an adapter (vLLM's set_lora)
        self.punica = PunicaWrapperGPU(max(m, 1), max(m, 1), dev, lora_config=LoRAConfig(max_loras=s, max_lora_rank=r))
        self.mappings = {"one": torch.zeros(m, dtype=torch.int32, device=dev),
                         "spread": (torch.arange(m, device=dev) % min(s, m)).to(torch.int32)}

    def use(self, configs: dict[str, dict[str, Any]] | None) -> None:
        """Make vLLM's next lookups read ``configs`` (None: stock, vLLM's own derivation)."""
        from vllm.lora.ops.triton_ops import utils

        self.tuned = configs is not None
        if configs is not None:
            write_tables(self.folder, self.gpu, one_entry_tables(self.shape, configs))
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()

    def spread(self, label: str) -> None:
        self.punica.token_mapping_meta.prepare_tensors(self.mappings[label])

    def launch(self) -> None:
        """One layer's step, with the arguments vLLM's LoRAExpertsMixin passes (not fully sharded, no EP)."""
        p, m = self.punica, self.shape.m
        common = {"topk_weights": self.topk_weights, "w1": self.w1, "w2": self.w2, "num_tokens": m,
                  "top_k_num": TOP_K, "max_loras": self.shape.slots, "adapter_enabled": self.adapter_enabled,
                  "top_k": TOP_K, "fully_sharded": False, "use_tuned_config": self.tuned, "add_inputs": True}
        sorted_ids, expert_ids, padded, mapping = p.add_lora_w13(
            self.y13, self.x, self.w13_a, self.w13_b, topk_ids=self.topk_ids, expert_map=None,
            local_num_experts=EXPERTS, num_slices=2, **common)
        p.add_lora_w2(self.y2, self.x2, self.w2_a, self.w2_b, sorted_token_ids_lora=sorted_ids,
                      expert_ids_lora=expert_ids, num_tokens_post_padded_lora=padded, token_lora_mapping=mapping,
                      tp_rank=0, **common)

    def output(self, configs: dict[str, dict[str, Any]] | None, label: str) -> tuple[Any, Any]:
        import torch

        self.use(configs)
        self.spread(label)
        self.y13.zero_()
        self.y2.zero_()
        self.launch()
        torch.cuda.synchronize()
        return self.y13.float().clone(), self.y2.float().clone()

    def time_us(self, configs: dict[str, dict[str, Any]] | None) -> dict[str, float] | None:
        """Microseconds per layer step for both spreads, or None if the configs do not compile or launch."""
        self.use(configs)
        out = {}
        for label in self.mappings:
            self.spread(label)
            t = graph_time_us(self.launch, REPS, what=configs)
            if t is None:
                return None
            out[label] = t
        return out


def score(t: dict[str, float], base: dict[str, float]) -> float | None:
    ratios = [t[k] / base[k] for k in base]
    return None if max(ratios) > 1.02 else sum(ratios)


def candidates(best: dict[str, dict[str, Any]], space: str) -> list[dict[str, dict[str, Any]]]:
    """Configs one parameter away from ``best``: block_m in all four at once, then (full) one op's parameter."""
    out = [{op: dict(best[op], block_m=v) for op in MOE_OPS} for v in BLOCK_M]
    if space == "full":
        for op in MOE_OPS:
            for param, values in PER_OP.items():
                out += [{**best, op: dict(best[op], **{param: v})} for v in values]
    return out


def outputs_match(step: Step, stock: dict[str, dict[str, Any]], best: dict[str, dict[str, Any]]) -> bool:
    import torch

    for label in step.mappings:
        for ref, got in zip(step.output(None, label), step.output(best, label)):
            if not torch.allclose(got, ref, rtol=2e-2, atol=2e-2 * float(ref.abs().max()) + 1e-3):
                return False
    return True


def tune_shape(step: Step, stock: dict[str, dict[str, Any]], space: str, budget_s: float) -> dict[str, Any]:
    base = step.time_us(None)
    if base is None:
        raise RuntimeError(f"vLLM's stock configs failed to launch for {step.shape}")
    best, best_t, best_score = stock, base, score(base, base) or 2.0
    tried = {json.dumps(stock, sort_keys=True)}
    deadline = time.monotonic() + budget_s
    for _ in range(2 if space == "full" else 1):
        for cand in candidates(best, space):
            sig = json.dumps(cand, sort_keys=True)
            if sig in tried or time.monotonic() > deadline:
                continue
            tried.add(sig)
            t = step.time_us(cand)
            s = score(t, base) if t is not None else None
            if s is not None and s < best_score * 0.99:
                best, best_t, best_score = cand, t, s
    ok = best == stock or outputs_match(step, stock, best)
    if not ok:
        print(f"  {step.shape}: tuned outputs differ from stock's; keeping stock", flush=True)
        best, best_t = stock, base
    return {"key": step.shape.key(), "hidden": HIDDEN, "intermediate": INTERMEDIATE, "stock": stock, "tuned": best,
            "stock_us": base, "tuned_us": best_t, "tried": len(tried), "output_matches_stock": ok}


def untuned_row(shape: Shape, stock: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"key": shape.key(), "hidden": HIDDEN, "intermediate": INTERMEDIATE, "stock": stock, "tuned": stock,
            "stock_us": None, "tuned_us": None, "tried": 0, "output_matches_stock": True, "untuned": True}


def build_tables(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """vLLM's four nested tables from the results rows: a tuned row wins over an untuned one, in any order."""
    tables: dict[str, dict[str, Any]] = {op: {} for op in MOE_OPS}
    tuned_keys = {(tuple(r["key"]), r["hidden"], r["intermediate"]) for r in results if not r.get("untuned")}
    for r in results:
        if r.get("untuned") and (tuple(r["key"]), r["hidden"], r["intermediate"]) in tuned_keys:
            continue
        slots, m, rank = (str(v) for v in r["key"])
        for op in MOE_OPS:
            for s in MOE_SLICE_KEYS:
                by_k = tables[op].setdefault(slots, {}).setdefault(s, {}).setdefault(m, {}).setdefault(rank, {})
                by_k.setdefault(str(r["hidden"]), {})[str(r["intermediate"])] = r["tuned"][op]
    check_moe_tables(tables)
    return tables


def grid_shapes(grid: dict[str, list[int]]) -> list[Shape]:
    """Decode batches first (a run cut short keeps what matters most), then slots, then rank."""
    return [Shape(s, m, r) for m in grid["m"] for s in grid["slots"] for r in grid["rank"]]


def tune_grid(shapes: list[Shape], args: argparse.Namespace, gpu: str, results: list[dict[str, Any]]) -> None:
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="moe-lora-tune-") as tmp:
        os.environ["VLLM_TUNED_CONFIG_FOLDER"] = tmp  # read only where use_tuned_config is on (the candidates)
        for i, shape in enumerate(shapes):
            left = args.budget_s - (time.monotonic() - t0)
            if left <= 0:
                print(f"budget spent: {len(shapes) - i} of {len(shapes)} shapes not tuned (stock written)")
                break
            row = tune_shape(Step(shape, Path(tmp), gpu), stock_configs(shape), args.space, min(left, 60.0))
            results.append(row)
            d, t = row["stock_us"], row["tuned_us"]
            print(f"[{time.monotonic() - t0:5.0f}s] slots={shape.slots:2d} m={shape.m:5d} r={shape.rank:2d}: stock "
                  f"{d['one']:7.1f}/{d['spread']:7.1f} us (block_m {row['stock'][MOE_OPS[0]]['block_m']}) -> tuned "
                  f"{t['one']:7.1f}/{t['spread']:7.1f} us (block_m {row['tuned'][MOE_OPS[0]]['block_m']}, "
                  f"{row['tried']} tried)", flush=True)
            partial = Path(args.json) if args.json else RESULTS / f"tune_moe_lora_{gpu.lower()}.json"
            partial.parent.mkdir(parents=True, exist_ok=True)  # what a run cut short leaves (the end rewrites it)
            partial.write_text(json.dumps(payload(args, gpu, results, t0), indent=2))
        os.environ.pop("VLLM_TUNED_CONFIG_FOLDER")


def payload(args: argparse.Namespace, gpu: str, results: list[dict[str, Any]], t0: float) -> dict[str, Any]:
    return {"gpu": gpu, "grid": args.grid, "space": args.space, "reps_per_graph": REPS,
            "model": {"hidden": HIDDEN, "intermediate": INTERMEDIATE, "experts": EXPERTS, "top_k": TOP_K},
            "seconds": time.monotonic() - t0, "results": results}


def report(results: list[dict[str, Any]]) -> None:
    rows = []
    for r in results:
        if r.get("untuned"):
            continue
        d, t = r["stock_us"], r["tuned_us"]
        rows.append([*r["key"], r["stock"][MOE_OPS[0]]["block_m"], r["tuned"][MOE_OPS[0]]["block_m"], d["one"],
                     t["one"], d["spread"], t["spread"], (t["one"] + t["spread"]) / (d["one"] + d["spread"])])
    print_table(rows, ["slots", "m", "rank", "stock block_m", "tuned block_m", "stock us (1 adapter)", "tuned us (1)",
                       "stock us (spread)", "tuned us (spread)", "tuned/stock"])
    ratios = sorted(row[-1] for row in rows)
    if ratios:
        print(f"{sum(x < 0.99 for x in ratios)} of {len(ratios)} tuned shapes at least 1% faster than stock; "
              f"tuned/stock median {ratios[len(ratios) // 2]:.3f}, best {ratios[0]:.3f}")
    tuned = {tuple(r["key"]) for r in results if not r.get("untuned")}
    print(f"{len({tuple(r['key']) for r in results if r.get('untuned')} - tuned)} table entries hold stock's configs "
          f"untimed")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), default="quick")
    ap.add_argument("--space", choices=("block_m", "full"), default="block_m")
    ap.add_argument("--budget-s", type=float, default=400.0, help="stop tuning new shapes after this long")
    ap.add_argument("--out-dir", default=None, help="write vLLM's four config files here")
    ap.add_argument("--json", default=None, help="results file (default bench/results/tune_moe_lora_<gpu>.json)")
    ap.add_argument("--rebuild", nargs="*", default=None, help="write the tables from these results files (CPU)")
    args = ap.parse_args()
    t0 = time.monotonic()
    results: list[dict[str, Any]] = []
    if args.rebuild:  # every stock config the tables need is in the results: no GPU needed
        for f in args.rebuild:
            data = json.loads(Path(f).read_text())
            gpu = data["gpu"]
            results += data["results"]
    else:
        import torch

        if not torch.cuda.is_available():
            sys.exit("tune_moe_lora_kernels needs a CUDA GPU (or --rebuild)")
        gpu = file_stem(torch.cuda.get_device_name())
        grid = GRIDS[args.grid]
        tune_grid(grid_shapes(grid), args, gpu, results)
        done = {tuple(r["key"]) for r in results}
        for m in sorted(set(STOCK_M) | set(grid["m"])):
            for shape in (Shape(s, m, r) for s in grid["slots"] for r in grid["rank"]):
                if tuple(shape.key()) not in done:
                    results.append(untuned_row(shape, stock_configs(shape)))
    tables = build_tables(results)
    if args.out_dir:
        out = Path(args.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        for path in write_tables(out, gpu, tables):
            print("wrote", path)
    report(results)
    write_json(f"tune_moe_lora_{gpu.lower()}", payload(args, gpu, results, t0), args.json)


if __name__ == "__main__":
    main()
