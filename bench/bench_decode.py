"""Decode throughput with many adapters, and base requests, against stock vLLM in the same run (GPU).

Each variant is its own engine, in its own process started with its own environment, all alive at once
on one GPU and driven in turn (rep by rep, case by case, variant by variant), so that the comparison
is interleaved on the same card:

- ``stock``: vLLM without the plugin (``VLLM_PLUGINS=none``): vLLM's default LoRA kernel configs.
- ``plugin``: the plugin as installed, whose shrink/expand launchers read the tuned kernel configs
  shipped for this GPU (or vLLM reads ``--configs DIR`` through ``VLLM_TUNED_CONFIG_FOLDER``).
- ``plugin_untuned`` (optional): the plugin with ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``.

The model is a 1B-shaped Llama with random weights (std 0.02, written here), so that logprobs mean
something. Adapters: r=8 on all seven projections (q, k, v, o, gate, up, down). Engines: max_lora_rank
16, 64 slots (every adapter and mix stays in one), CUDA graphs on. Cases, each 32 requests of 64 prompt tokens and ``--tokens`` output tokens:

- ``one``: every request on one adapter;      - ``distinct``: 32 requests on 32 adapters;
- ``mixes``: 32 distinct two-adapter mixes (plugin variants only; rank 8 + 8 = 16);
- ``base``: no adapter (the base model on the LoRA-enabled engine);
- ``base_prefill``: no adapter, 32 prompts of 960 tokens and one output token each, new prompts every run
  (the same for every variant), so that no prefix is cached: meant to be bound by the GPU rather than by the
  engine's Python, to show a 1% difference between base requests with and without the plugin (on an H100 in
  round 9 its reps still spread ±15%, so it did not).

Parity: teacher-forced prompt logprobs of the 32 distinct-adapter requests, each variant against a
float32 reference (transformers + PEFT on the same weights and adapters, run after the engines stop).
Other kernel configs round differently, so "the same within bf16 noise" is stated as: no further from
the reference than stock's default kernels are, within 25% (max and mean). The control compares stock
with the reference of the next adapter, which must be far off.

Usage: python bench/bench_decode.py [--variants stock,plugin] [--reps 5] [--configs DIR] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import answer_engine_command, median, print_table, write_json  # noqa: E402
from bench_mix import LLAMA_1B  # noqa: E402

N_REQ, PROMPT_LEN, RANK, SLOTS = 32, 64, 8, 64  # 64 slots: the 32 adapters and 32 mixes all stay loaded
MODULES = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_model(root: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    cfg = LLAMA_1B
    H, I, L, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["vocab_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    g = torch.Generator().manual_seed(0)

    def rnd(*shape: int) -> Any:
        return (torch.randn(*shape, generator=g) * 0.02).bfloat16()

    t = {"model.embed_tokens.weight": rnd(V, H), "model.norm.weight": torch.ones(H).bfloat16(),
         "lm_head.weight": rnd(V, H)}
    for i in range(L):
        p = f"model.layers.{i}"
        t.update({f"{p}.self_attn.q_proj.weight": rnd(H, H), f"{p}.self_attn.k_proj.weight": rnd(kv, H),
                  f"{p}.self_attn.v_proj.weight": rnd(kv, H), f"{p}.self_attn.o_proj.weight": rnd(H, H),
                  f"{p}.mlp.gate_proj.weight": rnd(I, H), f"{p}.mlp.up_proj.weight": rnd(I, H),
                  f"{p}.mlp.down_proj.weight": rnd(H, I), f"{p}.input_layernorm.weight": torch.ones(H).bfloat16(),
                  f"{p}.post_attention_layernorm.weight": torch.ones(H).bfloat16()})
    model = root / "llama-1b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(cfg))
    save_file(t, str(model / "model.safetensors"))
    return model


def write_adapters(root: Path, n: int) -> list[str]:
    import torch
    from safetensors.torch import save_file

    cfg = LLAMA_1B
    H, I = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * cfg["head_dim"]
    dims = {"q_proj": (H, H), "k_proj": (H, kv), "v_proj": (H, kv), "o_proj": (H, H), "gate_proj": (H, I),
            "up_proj": (H, I), "down_proj": (I, H)}
    g = torch.Generator().manual_seed(1)
    paths = []
    for a in range(n):
        t = {}
        for layer in range(cfg["num_hidden_layers"]):
            for m, (d_in, d_out) in dims.items():
                p = f"base_model.model.model.layers.{layer}.{MODULES[m]}.{m}"
                t[f"{p}.lora_A.weight"] = (torch.randn(RANK, d_in, generator=g) / d_in ** 0.5).bfloat16()
                t[f"{p}.lora_B.weight"] = (torch.randn(d_out, RANK, generator=g) * 0.02).bfloat16()
        d = root / f"a{a:02d}"
        d.mkdir()
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK,
                                                           "target_modules": list(dims)}))
        paths.append(str(d))
    return paths


def prompt_ids() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 31000 + 3 for j in range(PROMPT_LEN)] for i in range(N_REQ)]


LONG_PROMPT = 960


def long_prompt_ids(run: int) -> list[list[int]]:
    """The ``run``-th set of long prompts: every run's differ from every other's from their first token."""
    return [[(7919 * run + 7 * i + 13 * j) % 31000 + 3 for j in range(LONG_PROMPT)] for i in range(N_REQ)]


def reference_logprobs(model: str, adapters: list[str]) -> list[list[float]]:
    """Teacher-forced logprobs of each prompt under its adapter, from transformers + PEFT in float32 (GPU)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    try:
        base = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    except TypeError:  # transformers < 4.56
        base = AutoModelForCausalLM.from_pretrained(model, torch_dtype=torch.float32)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    peft_model = PeftModel.from_pretrained(base.to(dev), adapters[0], adapter_name="a0")
    for i, path in enumerate(adapters[1:N_REQ], 1):
        peft_model.load_adapter(path, adapter_name=f"a{i}")
    peft_model.eval()
    out = []
    with torch.no_grad():
        for i, ids in enumerate(prompt_ids()):
            peft_model.set_adapter(f"a{i}")
            x = torch.tensor([ids], device=dev)
            logits = peft_model(input_ids=x).logits[0, :-1].float()
            out.append(torch.log_softmax(logits, -1).gather(1, x[0, 1:, None])[:, 0].tolist())
    del peft_model, base
    torch.cuda.empty_cache()
    return out


def _errors(got: list[list[float]], ref: list[list[float]]) -> dict[str, float]:
    diffs = [abs(a - b) for r, o in zip(ref, got) for a, b in zip(r, o)]
    return {"max": max(diffs), "mean": sum(diffs) / len(diffs)}


def engine_main(conn: Any, model: str, adapters: list[str], util: float, tokens: int, mixes: bool) -> None:
    """One variant's engine: answers ("run", case) with seconds and ("logprobs", case) with per-request lists."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    t0 = time.perf_counter()
    llm = LLM(model=model, skip_tokenizer_init=True, enable_lora=True, max_lora_rank=16, max_loras=SLOTS,
              max_cpu_loras=SLOTS + 8, max_num_seqs=64, max_model_len=1024, gpu_memory_utilization=util, seed=0)
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids()]
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True, detokenize=False)
    plp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    reqs = [LoRARequest(f"a{i:02d}", i + 1, p) for i, p in enumerate(adapters)]
    cases: dict[str, list[Any]] = {"one": [reqs[0]] * N_REQ, "distinct": reqs[:N_REQ], "base": [None] * N_REQ,
                                   "base_prefill": [None] * N_REQ}
    prefill_runs = 0
    one_token = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    if mixes:
        from vllm_lora_ext.integration.offline import lora_request

        cases["mixes"] = [lora_request({adapters[i]: round(0.2 + 0.6 * i / N_REQ, 4),
                                        adapters[(i + 1) % N_REQ]: round(0.8 - 0.6 * i / N_REQ, 4)}, llm=llm)
                          for i in range(N_REQ)]
    conn.send({"ready": True, "start_s": start_s, "pid": os.getpid(),
               "tuned_folder": os.environ.get("VLLM_TUNED_CONFIG_FOLDER"),
               "kernel_configs": os.environ.get("VLLM_LORA_EXT_KERNEL_CONFIGS", "shipped"), "cases": sorted(cases)})
    while True:
        cmd, case = conn.recv()
        if cmd == "stop":
            break
        if case not in cases:
            conn.send(None)
            continue
        if cmd == "run" and case == "base_prefill":
            batch = [TokensPrompt(prompt_token_ids=ids) for ids in long_prompt_ids(prefill_runs)]
            prefill_runs += 1
            t = time.perf_counter()
            llm.generate(batch, one_token, use_tqdm=False)
            conn.send(time.perf_counter() - t)
        else:
            answer_engine_command(conn, llm, cmd, cases[case], prompts, params, plp)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--variants", default="stock,plugin")
    ap.add_argument("--cases", default="one,distinct,mixes,base,base_prefill")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--configs", default=None, help="the plugin variants' VLLM_TUNED_CONFIG_FOLDER")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-reference", action="store_true", help="skip the float32 transformers + PEFT reference")
    args = ap.parse_args()
    variants = [v for v in args.variants.split(",") if v]
    case_names = [c for c in args.cases.split(",") if c]
    env_of = {"stock": {"VLLM_PLUGINS": "none"}, "plugin": {}, "plugin_untuned": {"VLLM_LORA_EXT_KERNEL_CONFIGS": "0"}}
    root = Path(tempfile.mkdtemp(prefix="bench-decode-"))
    t0 = time.perf_counter()
    model = write_model(root)
    adapters = write_adapters(root, N_REQ)
    print(f"model and {N_REQ} adapters written in {time.perf_counter() - t0:.1f} s", flush=True)
    ctx = mp.get_context("spawn")
    util = min(0.25, 0.8 / len(variants))
    procs: dict[str, tuple[Any, Any]] = {}
    info: dict[str, Any] = {}
    base_env = dict(os.environ)
    for v in variants:  # one at a time: vLLM checks free memory when an engine starts
        os.environ.clear()
        os.environ.update(base_env)
        os.environ.update(env_of[v])
        if v != "stock" and args.configs and "VLLM_LORA_EXT_KERNEL_CONFIGS" not in env_of[v]:
            os.environ["VLLM_TUNED_CONFIG_FOLDER"] = str(Path(args.configs).resolve())
        parent, child = ctx.Pipe()
        p = ctx.Process(target=engine_main, args=(child, str(model), adapters, util, args.tokens, v != "stock"))
        p.start()
        procs[v] = (p, parent)
        if not parent.poll(480):  # a child that died (or hangs) must not hold the GPU machine until its limit
            p.kill()
            raise SystemExit(f"{v}: engine not up in 480 s (exit code {p.exitcode})")
        info[v] = parent.recv()
        print(f"{v}: engine up in {info[v]['start_s']:.0f} s, VLLM_TUNED_CONFIG_FOLDER {info[v]['tuned_folder']}, "
              f"shipped configs {info[v]['kernel_configs']}", flush=True)
    os.environ.clear()
    os.environ.update(base_env)

    def ask(v: str, cmd: str, case: str) -> Any:
        procs[v][1].send((cmd, case))
        return procs[v][1].recv()

    for case in case_names:  # warm every slot, kernel shape and graph once
        for v in variants:
            ask(v, "run", case)
    secs: dict[str, dict[str, list[float]]] = {v: {c: [] for c in case_names} for v in variants}
    for rep in range(args.reps):
        for case in case_names:
            for v in variants[rep % 2:] + variants[:rep % 2]:  # alternate who goes first
                t = ask(v, "run", case)
                if t is not None:
                    secs[v][case].append(t)
    logprobs = {v: ask(v, "logprobs", "distinct") for v in variants}
    for v in variants:
        procs[v][1].send(("stop", ""))
        procs[v][0].join(timeout=60)

    rows, summary = [], {}
    for v in variants:  # output tokens/s; for base_prefill, prompt tokens/s
        tps = {c: (N_REQ * (LONG_PROMPT if c == "base_prefill" else args.tokens)) / median(ts)
               for c, ts in secs[v].items() if ts}
        summary[v] = {"tok_s": tps, "distinct_vs_one": tps.get("distinct", 0) / tps["one"] if "one" in tps else None,
                      "mixes_vs_one": tps["mixes"] / tps["one"] if "mixes" in tps and "one" in tps else None}
        rows += [[v, c, median(ts), tps[c]] for c, ts in secs[v].items() if ts]
    print_table(rows, ["variant", "case (32 requests)", "seconds (median)", "tok/s (base_prefill: prompt)"])
    parity: dict[str, Any] = {}
    ref = None
    if not args.no_reference:
        t = time.perf_counter()
        try:
            ref = reference_logprobs(str(model), adapters)
            print(f"float32 reference (transformers + PEFT) in {time.perf_counter() - t:.0f} s")
        except Exception as exc:  # keep the timings if the reference cannot run here
            print(f"float32 reference failed: {type(exc).__name__}: {exc}")
            parity["reference_error"] = f"{type(exc).__name__}: {exc}"
    if ref is not None:
        parity["reference"] = "transformers + PEFT, float32, same weights and adapters"
        shifted = ref[1:] + ref[:1]
        parity["control_stock_vs_next_adapters_reference"] = _errors(logprobs[variants[0]], shifted)
    for v in variants:
        entry: dict[str, Any] = {}
        if ref is not None:
            entry["vs_fp32_reference"] = _errors(logprobs[v], ref)
        if "stock" in logprobs and v != "stock":
            entry["vs_stock"] = _errors(logprobs[v], logprobs["stock"])
        parity[v] = entry
    if ref is not None and "stock" in logprobs:
        s_err = parity["stock"]["vs_fp32_reference"]
        for v in variants:
            e = parity[v]["vs_fp32_reference"]
            # "Within bf16 noise": no further from the float32 reference than stock's default kernels (+25%).
            parity[v]["within_bf16_noise_of_stock"] = (e["max"] <= 1.25 * s_err["max"]
                                                       and e["mean"] <= 1.25 * s_err["mean"])
            print(f"{v}: prompt logprobs vs float32 reference: max |diff| {e['max']:.4f}, mean {e['mean']:.5f} "
                  f"(stock {s_err['max']:.4f} / {s_err['mean']:.5f}); within stock's bf16 noise +25%: "
                  f"{parity[v]['within_bf16_noise_of_stock']}")
        c = parity["control_stock_vs_next_adapters_reference"]
        print(f"control: stock against the next adapter's reference, max |diff| {c['max']:.3f}, mean {c['mean']:.4f} "
              f"(must be far above the errors above)")
    for v in variants:
        if "vs_stock" in parity[v]:
            print(f"{v}: prompt logprobs vs stock, max |diff| {parity[v]['vs_stock']['max']:.4f}")
    for v, s in summary.items():
        print(f"{v}: distinct / one = {s['distinct_vs_one']}, mixes / one = {s['mixes_vs_one']}")
    for case in ("base", "base_prefill"):
        if "stock" in summary and "plugin" in summary and case in summary["stock"]["tok_s"]:
            ratio = summary["plugin"]["tok_s"][case] / summary["stock"]["tok_s"][case]
            # rep by rep (the two engines ran back to back): stock seconds / plugin seconds, median
            paired = median([s / p for s, p in zip(secs["stock"][case], secs["plugin"][case])])
            summary[f"{case}_plugin_vs_stock"] = ratio
            summary[f"{case}_plugin_vs_stock_paired"] = paired
            print(f"{case} requests, plugin / stock tok/s = {ratio:.4f} (medians), {paired:.4f} (median of per-rep "
                  f"ratios)")
    write_json("decode_gpu", {"model": "Llama 1B-shaped, random weights (std 0.02)", "adapter_rank": RANK,
                              "modules": list(MODULES), "max_lora_rank": 16, "slots": SLOTS, "requests": N_REQ,
                              "prompt_tokens": PROMPT_LEN, "output_tokens": args.tokens, "reps": args.reps,
                              "base_prefill_prompt_tokens": LONG_PROMPT,
                              "engines": info, "seconds": secs, "summary": summary, "parity": parity}, args.out)


if __name__ == "__main__":
    main()
