"""Benchmark exact weighted mixes.

CPU (default): composite build time for 4 adapters of r=16 on 7B shapes (32 layers, q/k/v/o + MLP,
H=4096, I=11008), i.e. the rank concatenation of every module, vs a dense Σ w·s·B·A (goal <= 50 ms): into new
tensors, and as the worker builds one, into a fresh huge-page host arena or into the spare arena kept ready
(touched beforehand, off the timed path; on a GPU worker it is pinned too).

GPU (``--gpu``): decode throughput on a 1B-shaped Llama (dummy weights), 32 concurrent requests
  (a) all on one adapter, (b) each on a different 2-adapter mix, (c) the same 32 mixes bucketed by
  adapter set (one group after another), all with max_lora_rank 16 so the kernels are the same.

Usage: python bench/bench_mix.py [--gpu] [--out FILE]
"""

from __future__ import annotations

import argparse
import os
import json
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402


def seven_b_adapters(n: int = 4, rank: int = 16) -> list[dict[tuple[int, str], tuple[Any, Any]]]:
    """``n`` random bfloat16 adapters of ``rank`` on every projection of a 7B Llama (32 layers, H=4096, I=11008,
    GQA 8 × 128): ``{(layer, module): (A, B)}``."""
    import torch

    H, I, L = 4096, 11008, 32
    shapes = {"q_proj": (H, H), "k_proj": (H, 1024), "v_proj": (H, 1024), "o_proj": (H, H), "gate_proj": (H, I),
              "up_proj": (H, I), "down_proj": (I, H)}
    g = torch.Generator().manual_seed(0)
    return [{(layer, m): (torch.randn(rank, d_in, generator=g).bfloat16(),
                          torch.randn(d_out, rank, generator=g).bfloat16())
             for layer in range(L) for m, (d_in, d_out) in shapes.items()} for _ in range(n)]


def cpu_bench(runs: int, workers_list: tuple[int, ...] = ()) -> dict:
    import torch

    from vllm_lora_ext.mixing import concat_many
    from vllm_lora_ext.transport import pools

    adapters = seven_b_adapters()
    weights = [0.4, 0.3, 0.2, 0.1]

    from vllm_lora_ext.transport import arena as hostmem

    jobs = {k: ([(ad[k][0], ad[k][1], w * 2.0) for ad, w in zip(adapters, weights)], 0, 1) for k in adapters[0]}
    need = sum(2 * (a.numel() + b.numel()) * len(adapters) + 128 for a, b in adapters[0].values())

    def build(workers: int | None, memory: str = "") -> dict:
        if not memory:  # new tensors
            return concat_many(jobs, dtype=torch.bfloat16, workers=workers, pools=pools)
        # The worker's way: one huge-page host arena, fresh, or the spare kept ready after the last build
        arena = hostmem.HostArena(need, reuse=memory == "kept")
        assert arena.reused == (memory == "kept")
        try:
            return concat_many(jobs, dtype=torch.bfloat16, workers=workers, alloc=arena.empty, pools=pools)
        finally:
            arena.close()

    def ready(memory: str) -> None:  # untimed: the spare is made in the background between two mixes
        if memory == "kept":
            hostmem.prepare_spare(need)
            while hostmem._SPARE._preparing:
                time.sleep(0.005)

    torch.set_num_threads(1)  # as in vLLM workers
    cases: list[tuple[str, int | None, str]] = [("one thread", 1, ""), ("threads (default)", None, "")]
    cases += [(f"{n} threads", n, "") for n in workers_list]
    cases += [("default threads, into a fresh host arena", None, "fresh"),
              ("default threads, into the kept host arena", None, "kept")]
    cases += [(f"{n} threads, into the kept host arena", n, "kept") for n in workers_list]
    for _, workers, memory in cases:
        ready(memory)
        build(workers, memory)
    times: dict[str, list[float]] = {label: [] for label, _, _ in cases}
    for _ in range(runs):  # interleaved
        for label, workers, memory in cases:
            ready(memory)
            t0 = time.perf_counter()
            out = build(workers, memory)
            times[label].append(time.perf_counter() - t0)
            del out
    out = build(None, "fresh")
    one = build(1)
    same = all(torch.equal(one[k][0], out[k][0]) and torch.equal(one[k][1], out[k][1]) for k in out)
    # correctness on one module after timing
    k = (3, "down_proj")
    a, b = out[k]
    dense = sum(w * 2.0 * ad[k][1].float() @ ad[k][0].float() for ad, w in zip(adapters, weights))
    rel = float(((b.float() @ a.float()) - dense).abs().max() / dense.abs().max())
    nbytes = sum(t.numel() * t.element_size() for ab in out.values() for t in ab)
    print_table([[f"4 x r16, 7B shapes, 224 modules, {label}", median(ts) * 1e3, nbytes / 2**20, rel]
                 for label, ts in times.items()],
                ["case", "build ms (median)", "composite MiB", "max rel err vs dense (bf16)"])
    print("threaded result bitwise equal to one thread:", same)
    return {"mode": "cpu", "cpus": os.cpu_count(), "build_ms": {k: [t * 1e3 for t in v] for k, v in times.items()},
            "composite_bytes": nbytes, "rel_err": rel, "threaded_equals_one_thread": same}


LLAMA_1B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192,
            "num_hidden_layers": 16, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64,
            "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1,
            "eos_token_id": 2}


def gpu_bench(args: argparse.Namespace) -> dict:
    import torch
    from safetensors.torch import save_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_lora_ext.integration.offline import lora_request

    tmp = Path(tempfile.mkdtemp(prefix="bench-mix-"))
    model = tmp / "llama-1b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_1B))
    H = LLAMA_1B["hidden_size"]
    kv = LLAMA_1B["num_key_value_heads"] * LLAMA_1B["head_dim"]
    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(4):
        d = tmp / f"a{i}"
        d.mkdir()
        t = {}
        for layer in range(LLAMA_1B["num_hidden_layers"]):
            for m, d_out in (("q_proj", H), ("v_proj", kv)):
                p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
                t[f"{p}.lora_A.weight"] = (torch.randn(8, H, generator=g) * 0.01).bfloat16()
                t[f"{p}.lora_B.weight"] = (torch.randn(d_out, 8, generator=g) * 0.01).bfloat16()
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                           "target_modules": ["q_proj", "v_proj"]}))
        paths.append(str(d))
    llm = LLM(model=str(model), load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16,
              max_loras=32, max_cpu_loras=64, max_num_seqs=64, max_model_len=1024, gpu_memory_utilization=0.6, seed=0)
    n, out_tokens = 32, args.tokens
    prompts = [TokensPrompt(prompt_token_ids=list(range(3 + i, 3 + i + 64))) for i in range(n)]
    params = SamplingParams(max_tokens=out_tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    single = lora_request([paths[0]], llm=llm)
    mixes = []
    for i in range(n):
        a, b = paths[i % 4], paths[(i // 4 + 1 + i % 4) % 4] if (i // 4 + 1) % 4 else paths[(i + 1) % 4]
        if a == b:
            b = paths[(paths.index(a) + 1) % 4]
        mixes.append(lora_request({a: round(0.1 + 0.8 * i / n, 4), b: round(0.9 - 0.8 * i / n, 4)}, llm=llm))
    assert len({m.lora_int_id for m in mixes}) == n

    def run(reqs: list) -> float:
        t0 = time.perf_counter()
        llm.generate(prompts, params, lora_request=reqs, use_tqdm=False)
        return time.perf_counter() - t0

    def bucketed() -> float:
        t0 = time.perf_counter()
        for p, r in zip(prompts, mixes):
            llm.generate([p], params, lora_request=r, use_tqdm=False)
        return time.perf_counter() - t0

    # warm every slot and kernel shape once
    run([single] * n)
    run(mixes)
    res = {"one_adapter": [run([single] * n) for _ in range(args.runs)],
           "distinct_mixes": [run(mixes) for _ in range(args.runs)],
           "bucketed_mixes": [bucketed() for _ in range(max(1, args.runs // 2))]}
    toks = n * out_tokens
    rows = [[k, median(v), toks / median(v)] for k, v in res.items()]
    one = toks / median(res["one_adapter"])
    mix = toks / median(res["distinct_mixes"])
    buck = toks / median(res["bucketed_mixes"])
    print_table(rows, ["case (32 requests)", "seconds", "output tok/s"])
    print(f"distinct mixes / one adapter = {mix / one:.3f}; distinct mixes / bucketed = {mix / buck:.2f}")
    return {"mode": "gpu", "model": "Llama 1B-shaped, dummy weights", "tokens_per_request": out_tokens, "requests": n,
            "seconds": res, "ratio_mix_vs_one": mix / one, "ratio_mix_vs_bucketed": mix / buck}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--out", default=None)
    ap.add_argument("--workers", default="", help="CPU mode: more thread counts to time (new tensors and the kept "
                    "arena), e.g. 2,8")
    args = ap.parse_args()
    payload = gpu_bench(args) if args.gpu else cpu_bench(args.runs, tuple(int(n) for n in args.workers.split(",") if n))
    write_json("mix_gpu" if args.gpu else "mix_cpu", payload, args.out)


if __name__ == "__main__":
    main()
