"""Benchmark a new mix to its first token (issue 12 P3), against a loaded adapter and against stock vLLM.

GPU: a 7B-shaped Llama (H=4096, I=11008, 32 layers, 8 KV heads × 128; dummy weights) and four adapters of
r=16 on all seven projections (the shapes of ``bench_mix.py``'s CPU build: a 281 MiB composite).

- Plugin engine. The four adapters are warmed as the components of one mix. Then, interleaved per rep:
  ``loaded``: one token on adapter A, already in a slot; ``new mix``: a mix of the four adapters with
  weights never used before (``lora_request(..., llm=llm)`` then one token), built from the cached
  components.
- Stock engine (plugin disabled, the next process on the same GPU): the same kind of composite saved as a
  PEFT adapter (r=64, written by ``vllm-lora mix``'s writer), ``add_lora`` under a new id, then one token.

Goals: new mix ≤ loaded + 150 ms, and ≤ 0.5× stock's load of the saved composite. Engines run eager, at
``max_lora_rank`` 64 with 4 slots. The worker's "built mix" log lines (components, concatenation) are kept.

Usage: python bench/bench_new_mix.py [--reps 7] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, print_table, write_json  # noqa: E402

LLAMA_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
            "intermediate_size": 11008, "num_hidden_layers": 32, "num_attention_heads": 32,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 32000, "max_position_embeddings": 4096,
            "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "hidden_act": "silu", "tie_word_embeddings": False,
            "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
PROJ = {"q_proj": ("self_attn", 4096, 4096), "k_proj": ("self_attn", 4096, 1024), "v_proj": ("self_attn", 4096, 1024),
        "o_proj": ("self_attn", 4096, 4096), "gate_proj": ("mlp", 4096, 11008), "up_proj": ("mlp", 4096, 11008),
        "down_proj": ("mlp", 11008, 4096)}
R = 16


def make_adapters(tmp: Path) -> list[str]:
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    paths = []
    for i in range(4):
        d = tmp / f"a{i}"
        d.mkdir(parents=True, exist_ok=True)
        t = {}
        for layer in range(LLAMA_7B["num_hidden_layers"]):
            for m, (parent, d_in, d_out) in PROJ.items():
                p = f"base_model.model.model.layers.{layer}.{parent}.{m}"
                t[f"{p}.lora_A.weight"] = (torch.randn(R, d_in, generator=g) * 0.01).bfloat16()
                t[f"{p}.lora_B.weight"] = (torch.randn(d_out, R, generator=g) * 0.01).bfloat16()
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": 32,
                                                           "target_modules": sorted(PROJ)}))
        paths.append(str(d))
    return paths


def _weights(rep: int) -> list[float]:
    return [round(0.1 + 0.01 * rep, 4), round(0.2 + 0.013 * rep, 4), round(0.3 - 0.007 * rep, 4), 0.25]


def _llm(model: str) -> object:
    from vllm import LLM

    return LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enable_lora=True, max_lora_rank=64,
               max_loras=4, max_cpu_loras=16, enforce_eager=True, max_model_len=1024, gpu_memory_utilization=0.45,
               seed=0)


def plugin_engine(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_lora_ext.integration.offline import lora_request

    paths = json.loads(args._adapters)
    llm = _llm(args._model)
    prompt = [TokensPrompt(prompt_token_ids=list(range(3, 35)))]
    one = SamplingParams(max_tokens=1, detokenize=False)
    single = lora_request([paths[0]], llm=llm)

    def gen(req: object) -> None:
        llm.generate(prompt, one, lora_request=req, use_tqdm=False)

    pauses: list[list[float]] = []  # --diagnose: collections of the cyclic GC over 20 ms, (generation, seconds)
    if args.diagnose:
        import faulthandler
        import gc

        started = [0.0]

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                started[0] = time.perf_counter()
            elif time.perf_counter() - started[0] > 0.02:
                pauses.append([info["generation"], time.perf_counter() - started[0]])

        gc.callbacks.append(on_gc)

    def timed(fn: object) -> float:
        if args.diagnose:  # a call stuck for over 0.8 s dumps every thread's stack to stderr
            faulthandler.dump_traceback_later(0.8)
        t0 = time.perf_counter()
        fn()  # type: ignore[operator]
        dt = time.perf_counter() - t0
        if args.diagnose:
            faulthandler.cancel_dump_traceback_later()
        return dt

    gen(single)
    for w in (-1, -2):  # components cached, rank-64 kernels warmed
        gen(lora_request(dict(zip(paths, _weights(w))), llm=llm))
    out: dict[str, list] = {"loaded": [], "new_mix": []}
    for rep in range(args.reps):
        out["loaded"].append(timed(lambda: gen(single)))
        out["new_mix"].append(timed(lambda: gen(lora_request(dict(zip(paths, _weights(rep))), llm=llm))))
    if args.diagnose:
        out["gc_pauses"] = pauses
    if args.profile:  # where a new mix's time goes in this (engine-core) thread: three more new mixes, profiled
        import cProfile
        import io
        import pstats

        prof = cProfile.Profile()
        for rep in range(3):
            weights = _weights(20 + rep)  # (weights no earlier rep used)
            prof.enable()
            gen(lora_request(dict(zip(paths, weights)), llm=llm))
            prof.disable()
        for key in ("cumulative", "tottime"):
            text = io.StringIO()
            pstats.Stats(prof, stream=text).sort_stats(key).print_stats(45)
            out[f"profile_{key}"] = text.getvalue().splitlines()
    return out


def stock_engine(args: argparse.Namespace) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    composites = json.loads(args._adapters)
    llm = _llm(args._model)
    prompt = [TokensPrompt(prompt_token_ids=list(range(3, 35)))]
    one = SamplingParams(max_tokens=1, detokenize=False)
    out: dict[str, list[float]] = {"composite_load": []}
    for i in range(args.reps + 2):  # the first two warm the kernels and the page cache
        req = LoRARequest(lora_name=f"c{i}", lora_int_id=i + 1, lora_path=composites[i % len(composites)])
        t0 = time.perf_counter()
        llm.llm_engine.add_lora(req)
        llm.generate(prompt, one, lora_request=req, use_tqdm=False)
        if i >= 2:
            out["composite_load"].append(time.perf_counter() - t0)
    return out


def _run(mode: str, model: Path, adapters: list[str], reps: int, diagnose: bool = False,
         mix_on_gpu: str | None = None, profile: bool = False) -> tuple[dict, list[str]]:
    env = dict(os.environ, VLLM_LORA_EXT_DISABLE="1" if mode == "stock" else "0")
    if mix_on_gpu is not None:  # where a mix loaded in the step is concatenated: 0 the CPU, 1 the GPU
        env["VLLM_LORA_EXT_MIX_ON_GPU"] = mix_on_gpu
    if diagnose or profile:  # the engine core in this process (a stall's stack can be dumped, a profile sees it)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    proc = subprocess.run([sys.executable, __file__, "--_engine", mode, "--_model", str(model), "--_adapters",
                           json.dumps(adapters), "--reps", str(reps), *(["--diagnose"] if diagnose else []),
                           *(["--profile"] if profile else [])],
                          capture_output=True, text=True, env=env)
    text = proc.stdout + proc.stderr
    line = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if not line:
        raise RuntimeError(f"{mode} engine failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}")
    logs = [ln.strip() for ln in text.splitlines()
            if any(k in ln for k in ("built mix", "loaded adapter", "built a mix on", "CPU copy of a mix"))]
    if diagnose:  # the stacks faulthandler dumped, each from its "Thread" line on
        lines = proc.stderr.splitlines()
        starts = [i for i, ln in enumerate(lines) if ln.startswith(("Thread 0x", "Current thread 0x"))]
        logs += [ln for i in starts for ln in lines[i:i + 40]][:2000]
    return json.loads(line[-1][len("RESULT "):]), logs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", default=None)
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="plugin: three more new mixes under cProfile, the engine core in process (slower)")
    ap.add_argument("--diagnose", action="store_true",
                    help="plugin only, engine core in-process: GC pauses and the stacks of any call over 0.8 s")
    ap.add_argument("--mix-on-gpu", choices=("default", "0", "1", "both"), default="default",
                    help="plugin: concatenate a mix loaded in the step on the CPU (0), the GPU (1), or both engines")
    ap.add_argument("--_engine")
    ap.add_argument("--_model")
    ap.add_argument("--_adapters")
    args = ap.parse_args()
    if args._engine:
        res = plugin_engine(args) if args._engine == "plugin" else stock_engine(args)
        print("RESULT " + json.dumps(res), flush=True)
        return
    from vllm_lora_ext.offline_writes import mix_adapter_files
    from vllm_lora_ext.sources import resolve_source

    tmp = Path(args.workdir or tempfile.mkdtemp(prefix="bench-new-mix-"))
    model = tmp / "llama-7b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_7B))
    paths = make_adapters(tmp / "adapters")
    composites = []
    for i in range(2):  # two saved composites, used in turn (the same bytes as a mix of the four)
        out_dir = tmp / f"composite{i}"
        mix_adapter_files([(resolve_source(p), w) for p, w in zip(paths, _weights(i))], out_dir)
        composites.append(str(out_dir))
    variants = {"default": [None], "0": ["0"], "1": ["1"], "both": ["0", "1"]}[args.mix_on_gpu]
    runs = {v: _run("plugin", model, paths, args.reps, args.diagnose, mix_on_gpu=v, profile=args.profile)
            for v in variants}
    plugin, plugin_logs = runs[variants[0]]
    if args.diagnose:
        write_json("new_mix_diagnose", {"plugin": plugin, "plugin_logs": plugin_logs}, args.out)
        return
    stock, _ = _run("stock", model, composites, args.reps)
    stock_load = median(stock["composite_load"])
    rows = []
    for v, (res, _) in runs.items():
        where = {None: "", "0": ", mix built on the CPU", "1": ", mix built on the GPU"}[v]
        loaded, new = median(res["loaded"]), median(res["new_mix"])
        rows += [[f"loaded adapter, one token (plugin{where})", loaded, "-"],
                 [f"new mix of 4 cached r16 adapters, one token (plugin{where})", new,
                  f"+{(new - loaded) * 1e3:.0f} ms; / stock = {new / stock_load:.2f}"]]
    rows.append(["saved composite r64: add_lora + one token (stock)", stock_load, "-"])
    size = sum(f.stat().st_size for f in Path(composites[0]).glob("*.safetensors"))
    loaded, new = median(plugin["loaded"]), median(plugin["new_mix"])
    payload = {"mode": "gpu", "model": "Llama 7B-shaped (GQA 8x128), dummy weights, eager",
               "adapters": "4 x r16, all 7 projections", "composite_bytes": size, "reps": args.reps,
               "mix_on_gpu": variants[0], "plugin": plugin, "stock": stock, "plugin_logs": plugin_logs,
               "extra_over_loaded_s": new - loaded, "ratio_new_mix_vs_stock_load": new / stock_load}
    if len(runs) > 1:  # the GPU build, same run
        res, logs = runs["1"]
        g_loaded, g_new = median(res["loaded"]), median(res["new_mix"])
        payload["gpu_build"] = {"mix_on_gpu": "1", "plugin": res, "plugin_logs": logs,
                                "extra_over_loaded_s": g_new - g_loaded,
                                "ratio_new_mix_vs_stock_load": g_new / stock_load}
    write_json("new_mix_gpu", payload, args.out)  # first: a run cut short after its last engine keeps its numbers
    print_table(rows, ["case (median)", "seconds", "against"])

if __name__ == "__main__":
    main()
