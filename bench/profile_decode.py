"""Where a multi-adapter decode step's time goes (GPU, torch profiler): P4's profile.

``bench_decode.py`` measures 32 requests on 32 distinct adapters at about 0.7x the tokens/s of 32 requests on one
adapter, for stock vLLM as for the plugin. This probe runs the same model, adapters and engine settings (1B-shaped
Llama, r8 adapters on seven projections, max_lora_rank 16, 64 slots, 32 requests, CUDA graphs on unless
``--eager``) with the engine core in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that the torch
profiler sees its CUDA kernels, including those replayed from CUDA graphs. For each variant and case it reports,
per decode step:

- wall time (median over ``--reps`` unprofiled runs, divided by the output tokens);
- GPU busy time (the sum of kernel times in one profiled run), split into LoRA shrink, LoRA expand, other LoRA
  kernels, GEMMs, attention and the rest;
- the host time of the LoRA worker manager's ``set_active_adapters`` per step (making the batch's adapters active and
  mapping its tokens onto slots), timed by a wrapper. (Round 11's run wrapped the model runner mixin's
  ``set_active_loras`` instead, which vLLM 0.26's GPU model runner does not call: its column reads 0 there.)

So the extra cost of 32 adapters over one splits into GPU kernel time (and which kernels) and host time.

``--shape moe`` profiles the MoE decode of ``bench_moe_decode.py`` instead (issue 39 item 2): the Qwen3-30B-A3B
shape (``--layers`` of its 48, ``load_format=dummy``), its 16 r16 adapters on the experts (2D per-expert keys) and
q/k/v/o, 16 slots, ``max_lora_rank`` from ``--max-lora-rank`` (16 by default), full CUDA graphs without
torch.compile as that bench runs them; ``distinct`` is the 16 adapters over the 32 requests. Its kernels are
split further: the fused-MoE LoRA kernels (``moe_lora``) and the base experts (``moe``).

Variants, each its own process, one after another: ``stock`` (``VLLM_PLUGINS=none``), ``plugin`` (shipped tuned
kernel configs), ``stock_specialize`` (stock with ``specialize_active_lora=True``: CUDA graphs captured per
active-LoRA count, so a launch's grid spans the active adapters instead of all 65 slots).

Usage: python bench/profile_decode.py [--variants stock,plugin,stock_specialize] [--tokens 64] [--reps 3]
       [--eager] [--shape dense|moe] [--layers 12] [--max-lora-rank 16] [--out FILE]
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402
from bench_decode import N_REQ, SLOTS, prompt_ids, write_adapters, write_model  # noqa: E402

GROUPS = ("lora_shrink", "lora_expand", "moe_lora", "lora_other", "moe", "gemm", "attention", "other")


def kernel_group(name: str) -> str:
    """The group of one CUDA kernel, by its name."""
    n = name.lower()
    if "fused_moe_lora" in n or ("moe" in n and "lora" in n):
        return "moe_lora"
    if "lora_shrink" in n:
        return "lora_shrink"
    if "lora_expand" in n:
        return "lora_expand"
    if "lora" in n:
        return "lora_other"
    if "moe" in n or "gating" in n:  # fused_moe_kernel, moe_align_block_size, topkGatingSoftmax
        return "moe"
    if any(s in n for s in ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90_", "sm80_", "ampere_", "matmul")):
        return "gemm"
    if any(s in n for s in ("flash", "attn", "attention", "paged")):
        return "attention"
    return "other"


def engine_main(conn: Any, model: str, adapters: list[str], tokens: int, reps: int, eager: bool,
                specialize: bool, cases_wanted: list[str], moe: dict[str, int] | None = None) -> None:
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    host = {"calls": 0, "s": 0.0}
    original = WorkerLoRAManager.set_active_adapters  # every step, from either GPU model runner

    def timed_set_active_loras(self: Any, *a: Any, **k: Any) -> Any:
        t = time.perf_counter()
        try:
            return original(self, *a, **k)
        finally:
            host["calls"] += 1
            host["s"] += time.perf_counter() - t

    WorkerLoRAManager.set_active_adapters = timed_set_active_loras  # type: ignore[method-assign]
    kwargs: dict[str, Any] = {"specialize_active_lora": True} if specialize else {}
    t0 = time.perf_counter()
    if moe is not None:
        from bench_moe_decode import prompt_ids as moe_prompt_ids, start_engine

        llm = start_engine(model, max_lora_rank=moe["max_lora_rank"], layers=moe["layers"], util=0.4, eager=eager,
                           **kwargs)
        ids = moe_prompt_ids()
    else:
        llm = LLM(model=model, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16, max_loras=SLOTS,
                  max_cpu_loras=SLOTS + 8, max_num_seqs=64, max_model_len=1024, gpu_memory_utilization=0.5, seed=0,
                  enforce_eager=eager, **kwargs)
        ids = prompt_ids()
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=i) for i in ids]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    reqs = [LoRARequest(f"a{i:02d}", i + 1, p) for i, p in enumerate(adapters)]
    cases: dict[str, list[Any]] = {"one": [reqs[0]] * N_REQ, "distinct": [reqs[i % len(reqs)] for i in range(N_REQ)],
                                   "base": [None] * N_REQ}
    cases = {c: v for c, v in cases.items() if c in cases_wanted}

    def run(case: str) -> float:
        t = time.perf_counter()
        llm.generate(prompts, params, lora_request=cases[case], use_tqdm=False)
        return time.perf_counter() - t

    for case in cases:  # load every adapter, warm every graph
        run(case)
        run(case)
    wall: dict[str, list[float]] = {c: [] for c in cases}
    host_s: dict[str, list[float]] = {c: [] for c in cases}
    for _ in range(reps):
        for case in cases:
            host["calls"], host["s"] = 0, 0.0
            wall[case].append(run(case))
            host_s[case].append(host["s"] / max(host["calls"], 1))
    out: dict[str, Any] = {"start_s": start_s, "gpu": torch.cuda.get_device_name(0), "cases": {}}
    for case in cases:
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            prof_wall = run(case)
        by_group: dict[str, float] = defaultdict(float)
        by_kernel: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
        graph_launches = 0
        for ev in prof.events():
            if ev.name == "cudaGraphLaunch":
                graph_launches += 1
            if ev.device_type.name != "CUDA":
                continue
            us = ev.time_range.elapsed_us()
            by_group[kernel_group(ev.name)] += us
            by_kernel[ev.name][0] += us
            by_kernel[ev.name][1] += 1
        top = sorted(by_kernel.items(), key=lambda kv: -kv[1][0])[:25]
        out["cases"][case] = {
            "wall_s": wall[case], "profiled_wall_s": prof_wall, "graph_launches": graph_launches,
            "set_active_loras_ms_per_call": [s * 1e3 for s in host_s[case]],
            "gpu_us_by_group": dict(by_group),
            "top_kernels": [{"name": k[:160], "us": v[0], "count": v[1]} for k, v in top],
        }
    conn.send(out)


def _moe_model(root: Path, layers: int) -> tuple[Path, list[str]]:
    """bench_moe_decode.py's model folder and its 16 adapters, under ``root``."""
    from bench_moe_decode import write_adapters as moe_adapters, write_model as moe_model

    return moe_model(root, layers), moe_adapters(root / "adapters", layers)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="stock,plugin,stock_specialize")
    ap.add_argument("--cases", default="one,distinct,base")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="enforce_eager (no CUDA graphs)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds per variant")
    ap.add_argument("--shape", choices=("dense", "moe"), default="dense",
                    help="moe: bench_moe_decode.py's Qwen3-30B-A3B shape, adapters and engine settings")
    ap.add_argument("--layers", type=int, default=12, help="--shape moe: decoder layers of the 48")
    ap.add_argument("--max-lora-rank", type=int, default=16, help="--shape moe: the engine's max_lora_rank")
    ap.add_argument("--workdir", default=None, help="--shape moe: reuse bench_moe_decode.py's --workdir (same --layers)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    case_names = [c for c in args.cases.split(",") if c]
    root = Path(args.workdir or tempfile.mkdtemp(prefix="profile-decode-"))
    moe = None
    if args.shape == "moe":
        model, adapters = _moe_model(root, args.layers)
        moe = {"max_lora_rank": args.max_lora_rank, "layers": args.layers}
    else:
        model = write_model(root)
        adapters = write_adapters(root, N_REQ)
    ctx = mp.get_context("spawn")
    base_env = dict(os.environ)
    results: dict[str, Any] = {}
    for v in variants:
        os.environ.clear()
        os.environ.update(base_env)
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        if v.startswith("stock"):
            os.environ["VLLM_PLUGINS"] = "none"
        parent, child = ctx.Pipe()
        p = ctx.Process(target=engine_main, args=(child, str(model), adapters, args.tokens, args.reps, args.eager,
                                                  v.endswith("specialize"), case_names, moe))
        t = time.perf_counter()
        p.start()
        if parent.poll(args.timeout):
            results[v] = parent.recv()
        else:
            results[v] = {"error": f"no answer in {args.timeout:.0f} s"}
            p.kill()
        p.join(timeout=60)
        print(f"{v}: done in {time.perf_counter() - t:.0f} s", flush=True)
    os.environ.clear()
    os.environ.update(base_env)

    steps = args.tokens  # one decode step per output token (the first comes from the prefill step)
    rows, summary = [], {}
    for v, r in results.items():
        if "cases" not in r:
            continue
        summary[v] = {}
        for case, c in r["cases"].items():
            g = c["gpu_us_by_group"]
            per = {k: g.get(k, 0.0) / steps / 1e3 for k in GROUPS}
            entry = {"wall_ms_per_step": median(c["wall_s"]) / steps * 1e3,
                     "gpu_ms_per_step": sum(g.values()) / steps / 1e3,
                     "set_active_loras_ms": median(c["set_active_loras_ms_per_call"]),
                     **{f"{k}_ms_per_step": x for k, x in per.items()}}
            summary[v][case] = entry
            rows.append([v, case, entry["wall_ms_per_step"], entry["gpu_ms_per_step"], per["lora_shrink"],
                         per["lora_expand"], per["moe_lora"], per["lora_other"], per["moe"], per["gemm"],
                         per["attention"], per["other"], entry["set_active_loras_ms"]])
        if "one" in summary[v] and "distinct" in summary[v]:
            o, d = summary[v]["one"], summary[v]["distinct"]
            summary[v]["distinct_minus_one_ms_per_step"] = {k: d[k] - o[k] for k in o}
            summary[v]["distinct_vs_one_tok_s"] = o["wall_ms_per_step"] / d["wall_ms_per_step"]
    print_table(rows, ["variant", "case", "wall ms/step", "GPU ms/step", "shrink", "expand", "moe lora",
                       "lora other", "moe", "gemm", "attn", "other", "set_active_loras ms"])
    for v, s in summary.items():
        if "base" in s:
            for case in ("one", "distinct"):
                if case in s:
                    s[f"{case}_vs_base_tok_s"] = s["base"]["wall_ms_per_step"] / s[case]["wall_ms_per_step"]
                    print(f"{v}: {case} / base tok/s {s[case + '_vs_base_tok_s']:.3f}")
    for v, s in summary.items():
        if "distinct_minus_one_ms_per_step" in s:
            d = s["distinct_minus_one_ms_per_step"]
            print(f"{v}: distinct/one tok/s {s['distinct_vs_one_tok_s']:.3f}; distinct - one per step: wall "
                  f"{d['wall_ms_per_step']:+.3f} ms, GPU {d['gpu_ms_per_step']:+.3f} ms (shrink "
                  f"{d['lora_shrink_ms_per_step']:+.3f}, expand {d['lora_expand_ms_per_step']:+.3f}), "
                  f"set_active_loras {d['set_active_loras_ms']:+.3f} ms")
    if moe is not None:
        from bench_moe_decode import RANK as MOE_RANK, SLOTS as MOE_SLOTS

        shape = {"model": f"Qwen3-30B-A3B shape, {args.layers} of 48 layers, load_format=dummy",
                 "slots": MOE_SLOTS, "max_lora_rank": args.max_lora_rank, "adapter_rank": MOE_RANK,
                 "adapters": "16 x r16: 128 experts (2D per-expert keys) + q/k/v/o; distinct: the 16 over 32 requests"}
    else:
        shape = {"model": "Llama 1B-shaped, random weights", "slots": SLOTS, "max_lora_rank": 16, "adapter_rank": 8}
    write_json("profile_decode", {**shape, "requests": N_REQ, "output_tokens": args.tokens,
                                  "cuda_graphs": not args.eager, "reps": args.reps, "variants": results,
                                  "summary": summary}, args.out)


if __name__ == "__main__":
    main()
