"""MoE LoRA decode throughput against base, stock vLLM beside the plugin (issue 39 item 1; GPU).

Model: the Qwen3-30B-A3B shape (``load_format=dummy``: vLLM's seeded uniform weights, the same in every engine),
``--layers K`` of its 48 decoder layers (``hf_overrides`` num_hidden_layers; the default 48 is the real shape).
Adapters: 16 of r16 on the experts (gate, up, down of all 128 experts, 2D per-expert keys, which stock vLLM
reads) and on q/k/v/o. Engines: ``max_loras`` 16, full CUDA graphs for batches up to 64 tokens (no
torch.compile), ``max_lora_rank`` 32 when the mixes case runs (a mix of two r16 adapters has rank 32; every
engine then runs at 32, so every case compares like with like) else 16. Cases, each 32 requests of 64 prompt
tokens and ``--tokens`` output tokens (greedy, ``ignore_eos``), timed from submit to the last token:

- ``base``: no adapter (on the LoRA-enabled engine);   - ``one``: all 32 on one adapter;
- ``distinct``: 16 adapters, two requests each;
- ``mixes``: 16 distinct mixes of two of the 16 adapters, two requests each. The plugin builds each mix from
  its cached components (``lora_request(..., llm=llm)``); stock, which has no mixes, serves the same mixes
  saved as PEFT adapters by ``vllm-lora mix``'s writer (``--composites`` of them, in turn over the 32 requests).

Each timed run comes right after a one-token run of the same requests (``activate``, timed apart as
``activate:<case>``): the cases use 32 LoRAs (stock: 20) over 16 slots, so without it each timed run would
also copy its LoRAs into the slots (16 rank-32 mixes: about 13 GB at 12 layers) and time that. Runs before
round 26 had no such pass: their distinct and mixes numbers include those copies.

Goals (the plugin): one >= 0.90x base, distinct >= 0.85x base, mixes >= 0.98x distinct. Stock's numbers are
printed beside each, from the same run.

Engines and GPU memory. An engine needs about 1.25 GB of bf16 weights per layer plus 1.25 GB (embeddings and
head: 61 GB at 48 layers), ``max_loras`` x layers x rank x 2.2 MB of LoRA slots (16 x 48 x 32: 54 GB), and about
6 GB for the KV cache, activations and graphs; the plugin may also stage up to 8 GiB of built adapters on the GPU
outside vLLM's budget. When two such engines and that fit in 95% of the card, stock and plugin are
alive at once (each with ``gpu_memory_utilization`` = its need / the card) and driven in turn, rep by rep, case
by case, who goes first alternating. When they do not (48 layers on an H200: 2 x 121 GB), they run one after the
other in the same call, in alternating blocks of ``--block-reps`` reps (stock, plugin, stock, plugin, ...), each
engine started afresh per block; the JSON says which (``schedule``). ``--layers 24`` fits two engines on an H200
(2 x 64 GB), ``--layers 12`` on an H100 (2 x 35 GB at rank 32). Host memory: each engine's CPU cache holds
every adapter and composite (0.83 GB per r16 adapter at 24 layers).

Parity. Teacher-forced prompt logprobs of every case, stock and plugin, each case minus the same engine's
base: the adapter's effect on each logprob, which dummy weights make small (logits of order 1e-5) but which
bf16 resolves. Reported: the plugin's effect against stock's, relative L2 error, per case (mixes: the requests
whose mix stock serves as a composite); the control is stock's effect of another adapter (or mix) on the same
prompts, which must be far off. Pass: error <= 0.25 with a control >= 0.75 (else
"uninformative"). The base case's logprobs, plugin against stock, are reported as their largest difference.
The long prompts' prefill is too large a batch for the plugin's fused-MoE pair kernels, so both engines run vLLM's
kernels there; a second pass (``parity_pair_kernels``) takes each prompt's first 16 tokens, two prompts a step (32
tokens, the batch a decode step makes), where the plugin runs its pair kernels and stock vLLM's one-shot kernel.

Partial results are written to ``--out`` (default ``bench/results/moe_decode.json``) after every rep (engines
together) or block (in turn). Writing the adapters takes minutes at 24-48 layers: ``--prepare-only --workdir W``
writes them in one call and a later call with ``--workdir W`` reuses them. At 48 layers the plugin engine holds
16 adapters and 16 rank-32 mixes in host memory (about 80 GB), and the alternating blocks with fresh engines take
longer than ten minutes: run it in the background (``nohup ... &``) and read the partial JSON.

``--variants`` may add ``plugin_k0``, the plugin with ``VLLM_LORA_EXT_KERNEL_CONFIGS=0`` (vLLM's kernels and
configs: the effect of the plugin's own kernel choices, plugin against plugin; no parity pass of its own), and
``plugin_nopdl`` (the pair kernels without programmatic dependent launch), ``stock_ds`` / ``plugin_ds``, either
with vLLM's ``VLLM_LORA_ENABLE_DUAL_STREAM=1`` (each layer's LoRA on a second
CUDA stream beside the base GEMM, dense layers included; off by default in vLLM 0.26-0.33 and with the plugin, which
runs batches without an adapter on one stream under it, `integration.dual_stream`), and ``plugin_nods``, the plugin
with it set to 0.

Usage: python bench/bench_moe_decode.py [--layers 24] [--reps 5] [--tokens 128] [--cases base,one,distinct,mixes]
       [--variants stock,plugin[,plugin_k0,plugin_nopdl,stock_ds,plugin_ds,plugin_nods]] [--block-reps 2] [--composites 4]
       [--workdir W [--prepare-only]]
       [--out FILE]
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
from _common import answer_engine_command, env_info, median, print_table, write_json  # noqa: E402
from bench_moe_load import E, H, I, QWEN3_30B_A3B  # noqa: E402

N_REQ, PROMPT_LEN, RANK, N_ADAPTERS, SLOTS = 32, 64, 16, 16, 16
ATTN = {"q_proj": (H, 4096), "k_proj": (H, 512), "v_proj": (H, 512), "o_proj": (4096, H)}
GOALS = {"one": ("base", 0.90), "distinct": ("base", 0.85), "mixes": ("distinct", 0.98)}
# plugin_k0: the plugin with its kernel choices off (VLLM_LORA_EXT_KERNEL_CONFIGS=0: no shipped tables, no pair path);
# *_ds: vLLM's own dual-stream LoRA (VLLM_LORA_ENABLE_DUAL_STREAM=1, vLLM 0.26+: each layer's LoRA on a second CUDA
# stream beside its base GEMM, fused-MoE and dense alike, and PDL in the dense shrink/expand kernels; off by default
# in vLLM and with the plugin); plugin_nods: the plugin with it set to 0
_DS_SWITCH = "VLLM_LORA_ENABLE_DUAL_STREAM"
_DS = {_DS_SWITCH: "1"}
# plugin_nopdl: the plugin's pair kernels without programmatic dependent launch (vLLM's VLLM_LORA_DISABLE_PDL=1,
# which also turns it off in vLLM's own fused-MoE LoRA kernels, which decode batches here do not run)
_PDL_OFF = "VLLM_LORA_DISABLE_PDL"
ENV_OF = {"stock": {"VLLM_PLUGINS": "none"}, "plugin": {}, "plugin_k0": {"VLLM_LORA_EXT_KERNEL_CONFIGS": "0"},
          "stock_ds": {"VLLM_PLUGINS": "none", **_DS}, "plugin_ds": _DS,
          "plugin_nods": {_DS_SWITCH: "0"}, "plugin_nopdl": {_PDL_OFF: "1"}}


def memory_plan(layers: int, rank: int, total_gb: float, n_engines: int, staging_gb: float) -> dict[str, Any]:
    """Each engine's GPU need (GB) and whether ``n_engines`` fit at once, with ``staging_gb`` beside them (the
    plugin's GPU staging of built adapters, outside vLLM's budget), in 95% of ``total_gb``."""
    weights = 1.246 * layers + 1.245
    slots = SLOTS * layers * rank * 2.2e-3
    need = weights + slots + 6.0
    together = n_engines * need + staging_gb <= 0.95 * total_gb
    util = min(0.92, need / total_gb + 0.01) if not together else need / total_gb + 0.01
    return {"weights_gb": round(weights, 1), "lora_slots_gb": round(slots, 1), "need_gb": round(need, 1),
            "card_gb": round(total_gb, 1), "staging_gb": staging_gb, "together": together,
            "gpu_memory_utilization": round(util, 3)}


def write_adapters(root: Path, layers: int) -> list[str]:
    """16 r16 adapters on experts (2D per-expert keys) and attention; each a signed, rolled view of one pool."""
    import torch
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    pool = {"a13": torch.randn(E, RANK, H, generator=g) * 0.01,
            "b13": torch.randn(E, 2 * I, RANK, generator=g) * 0.01,
            "ad": torch.randn(E, RANK, I, generator=g) * 0.01, "bd": torch.randn(E, H, RANK, generator=g) * 0.01}
    attn = {m: (torch.randn(RANK, i, generator=g) / i ** 0.5, torch.randn(o, RANK, generator=g) * 0.02)
            for m, (i, o) in ATTN.items()}
    paths = []
    for n in range(N_ADAPTERS):
        sign = torch.where(torch.randn(E, 1, 1, generator=g) > 0, 1.0, -1.0)
        d = root / f"a{n:02d}"
        if (d / "adapter_config.json").exists():  # a --workdir written before, with the same --layers
            paths.append(str(d))
            continue
        signed = {k: (x * sign if k.startswith("b") else x).bfloat16() for k, x in pool.items()}
        t: dict[str, Any] = {}
        for layer in range(layers):
            shift = 7 * n + layer
            v = {k: x.roll(shift, 0) for k, x in signed.items()}
            p = f"base_model.model.model.layers.{layer}"
            for e in range(E):
                q = f"{p}.mlp.experts.{e}"
                t[f"{q}.gate_proj.lora_A.weight"] = v["a13"][e].clone()
                t[f"{q}.gate_proj.lora_B.weight"] = v["b13"][e, :I].clone()
                t[f"{q}.up_proj.lora_A.weight"] = v["a13"][e].clone()
                t[f"{q}.up_proj.lora_B.weight"] = v["b13"][e, I:].clone()
                t[f"{q}.down_proj.lora_A.weight"] = v["ad"][e].clone()
                t[f"{q}.down_proj.lora_B.weight"] = v["bd"][e].clone()
            for m, (a, b) in attn.items():
                t[f"{p}.self_attn.{m}.lora_A.weight"] = a.roll(shift, 1).bfloat16().contiguous()
                t[f"{p}.self_attn.{m}.lora_B.weight"] = (b * (-1) ** n).bfloat16().contiguous()
        d.mkdir(parents=True, exist_ok=True)
        save_file(t, str(d / "adapter_model.safetensors"))
        (d / "adapter_config.json").write_text(json.dumps({
            "peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "bias": "none",
            "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]}))
        paths.append(str(d))
    return paths


def mix_weights(n: int) -> dict[int, float]:
    """Mix ``n`` of the 16: adapters n and n+1 (mod 16), weights that no other mix uses."""
    return {n: round(0.3 + 0.02 * n, 4), (n + 1) % N_ADAPTERS: round(0.7 - 0.015 * n, 4)}


def write_composites(root: Path, adapters: list[str], count: int, model_cfg: dict[str, Any]) -> list[str]:
    from vllm_lora_ext.offline_writes import mix_adapter_files
    from vllm_lora_ext.sources import resolve_source

    out = []
    for n in range(count):
        if (root / f"mix{n:02d}" / "adapter_config.json").exists():
            out.append(str(root / f"mix{n:02d}"))
            continue
        parts = [(resolve_source(adapters[i]), w) for i, w in mix_weights(n).items()]
        out.append(str(mix_adapter_files(parts, root / f"mix{n:02d}", base_config=model_cfg, num_experts=E)))
    return out


def prompt_ids() -> list[list[int]]:
    return [[(7 * i + 13 * j) % 150000 + 3 for j in range(PROMPT_LEN)] for i in range(N_REQ)]


def _requests(llm: Any, variant: str, adapters: list[str], composites: list[str], cases: list[str]) -> dict[str, Any]:
    from vllm.lora.request import LoRARequest

    reqs = [LoRARequest(f"a{i:02d}", i + 1, p) for i, p in enumerate(adapters)]
    out: dict[str, Any] = {"base": [None] * N_REQ, "one": [reqs[0]] * N_REQ,
                           "distinct": [reqs[i % N_ADAPTERS] for i in range(N_REQ)]}
    if "mixes" in cases and variant.startswith("stock"):
        comp = [LoRARequest(f"mix{i:02d}", 100 + i, p) for i, p in enumerate(composites)]
        out["mixes"] = [comp[(i % N_ADAPTERS) % len(comp)] for i in range(N_REQ)]
    elif "mixes" in cases:
        from vllm_lora_ext.integration.offline import lora_request

        mixes = [lora_request({adapters[i]: w for i, w in mix_weights(n).items()}, llm=llm)
                 for n in range(N_ADAPTERS)]
        out["mixes"] = [mixes[i % N_ADAPTERS] for i in range(N_REQ)]
    picked = {c: out[c] for c in cases}
    for c in cases:  # the parity control: each request on another adapter (or mix), the same prompt
        if c != "base":
            picked[f"_other_{c}"] = [reqs[1]] * N_REQ if c == "one" else out[c][1:] + out[c][:1]
    return picked


def write_model(work: Path, layers: int) -> Path:
    """The model folder (its config only: the weights are dummy) for ``layers`` of the 48, under ``work``."""
    model = work / "qwen3-30b-a3b"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps({**QWEN3_30B_A3B, "num_hidden_layers": layers}))
    return model


def start_engine(model: str, *, max_lora_rank: int, layers: int, util: float, eager: bool = False,
                 **kwargs: Any) -> Any:
    """This bench's engine (``profile_decode.py --shape moe`` starts the same): full CUDA graphs unless ``eager``."""
    from vllm import LLM

    graphs = {"mode": 0, "cudagraph_mode": "FULL", "cudagraph_capture_sizes": [1, 2, 4, 8, 16, 24, 32, 40, 48, 64]}
    return LLM(model=model, load_format="dummy", skip_tokenizer_init=True, enable_lora=True,
               max_lora_rank=max_lora_rank, max_loras=SLOTS, max_cpu_loras=40, max_num_seqs=64,
               max_num_batched_tokens=2048, max_model_len=512, gpu_memory_utilization=util, seed=0,
               hf_overrides={"num_hidden_layers": layers}, enforce_eager=eager,
               compilation_config=None if eager else graphs, **kwargs)


def engine_main(conn: Any, variant: str, spec: dict[str, Any]) -> None:
    """One engine: answers ("run" or "activate", case) with seconds and ("logprobs", case) with per-request lists."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    os.setsid()  # a group of its own with vLLM's engine-core process, so that a kill takes both (_kill_group)
    t0 = time.perf_counter()
    llm = start_engine(spec["model"], max_lora_rank=spec["max_lora_rank"], layers=spec["layers"], util=spec["util"])
    start_s = time.perf_counter() - t0
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in prompt_ids()]
    params = SamplingParams(max_tokens=spec["tokens"], temperature=0.0, ignore_eos=True, detokenize=False)
    plp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    try:
        cases = _requests(llm, variant, spec["adapters"], spec["composites"], spec["cases"])
    except Exception as e:  # a refused adapter or mix: said to the parent, which stops this engine
        conn.send({"error": f"{type(e).__name__}: {e}"})
        raise
    conn.send({"ready": True, "start_s": start_s, "pid": os.getpid()})
    while True:
        cmd, case = conn.recv()
        if cmd == "stop":
            break
        answer_engine_command(conn, llm, cmd, cases[case], prompts, params, plp)


class Engines:
    """Engine processes by variant, each started in its own environment and stopped on request."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec, self.procs, self.starts = spec, {}, {}  # type: ignore[var-annotated]

    def start(self, variant: str, timeout: float = 540) -> None:
        base_env = dict(os.environ)
        os.environ.pop(_DS_SWITCH, None)  # each variant's own (a plugin registered in this process sets it)
        os.environ.pop(_PDL_OFF, None)
        os.environ.update(ENV_OF[variant])
        try:
            parent, child = mp.get_context("spawn").Pipe()
            p = mp.get_context("spawn").Process(target=engine_main, args=(child, variant, self.spec))
            p.start()
            child.close()  # the child's end lives in the child only: its death reads as end of file here
        finally:
            os.environ.clear()
            os.environ.update(base_env)
        self.procs[variant] = (p, parent)
        info = self._answer(variant, timeout, "start")
        self.starts.setdefault(variant, []).append(info["start_s"])
        print(f"{variant}: engine up in {info['start_s']:.0f} s", flush=True)

    def _answer(self, variant: str, timeout: float, what: str) -> Any:
        """The engine's next answer; a dead or hung engine is killed (it must not hold the GPU until the limit)."""
        p, conn = self.procs[variant]
        deadline = time.perf_counter() + timeout
        while time.perf_counter() < deadline:
            if conn.poll(5):
                try:
                    got = conn.recv()
                except EOFError:
                    break
                if not (isinstance(got, dict) and "error" in got):
                    return got
                print(f"{variant}: {what} failed: {got['error']}", flush=True)
                p.join(60)  # it exits on its own, and its exit stops vLLM's engine-core process
                break
            if not p.is_alive():
                break
        _kill_group(p)
        self.procs.pop(variant)
        raise SystemExit(f"{variant}: no answer to {what} (engine exit code {p.exitcode}); see its log above")

    def ask(self, variant: str, cmd: str, case: str) -> Any:
        self.procs[variant][1].send((cmd, case))
        return self._answer(variant, 560, f"{cmd} {case}")

    def stop(self, variant: str) -> None:
        p, conn = self.procs.pop(variant)
        conn.send(("stop", ""))
        p.join(timeout=90)
        if p.is_alive():
            _kill_group(p)


def _kill_group(p: Any) -> None:
    """Kill an engine process and its group: vLLM's engine-core process too, which would otherwise outlive it,
    holding the GPU and the bench's output pipe (r39: a failed start then hung the call until its time limit)."""
    import signal

    try:
        os.killpg(p.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        p.kill()
    p.join(10)


def run_block(eng: Engines, variants: list[str], cases: list[str], reps: int, secs: dict[str, Any],
              first_rep: int, on_rep: Any = None) -> None:
    """Warm every case once, then ``reps`` reps, interleaved over the engines alive (who goes first alternates);
    ``on_rep()`` after each rep."""
    for case in cases:
        for v in variants:
            eng.ask(v, "run", case)
    for rep in range(first_rep, first_rep + reps):
        for case in cases:
            for v in variants[rep % len(variants):] + variants[:rep % len(variants)]:
                # the case's adapters into the slots first (module docstring), then the decode is timed
                secs[v].setdefault(f"activate:{case}", []).append(eng.ask(v, "activate", case))
                secs[v][case].append(eng.ask(v, "run", case))
        if on_rep is not None:
            on_rep()


def parity(logprobs: dict[str, dict[str, list[list[float]]]], cases: list[str], composites: int,
           pass_: str = "", variant: str = "plugin") -> dict[str, Any]:
    """The plugin's effect of each case on the prompt logprobs (case minus base) against stock's, relative L2;
    ``pass_="small:"``: on the short prompts taken two a step, whose fused-MoE LoRA runs the plugin's pair
    kernels against vLLM's one-shot kernel (the long prompts' prefill runs vLLM's kernels in both engines)."""
    def effect(v: str, case: str, rows: list[int]) -> list[float]:
        return [a - b for i in rows for a, b in zip(logprobs[v][pass_ + case][i], logprobs[v][pass_ + "base"][i])]

    def rel(x: list[float], ref: list[float]) -> float:
        num = sum((a - b) ** 2 for a, b in zip(x, ref)) ** 0.5
        return num / max(sum(b * b for b in ref) ** 0.5, 1e-30)

    out: dict[str, Any] = {}
    if not {"stock", variant} <= set(logprobs) or "base" not in cases or pass_ + "base" not in logprobs["stock"]:
        return out
    base_diffs = [abs(a - b) for p, q in zip(logprobs[variant][pass_ + "base"], logprobs["stock"][pass_ + "base"])
                  for a, b in zip(p, q)]
    out["base"] = {"max_abs_diff_vs_stock": max(base_diffs, default=0.0)}  # no adapter: the plugin changes nothing
    for case in [c for c in cases if c != "base"]:
        rows = [i for i in range(N_REQ) if case != "mixes" or i % N_ADAPTERS < composites]
        ref = effect("stock", case, rows)
        err = rel(effect(variant, case, rows), ref)
        other = [a - b for i in rows for a, b in zip(logprobs["stock"][f"{pass_}_other_{case}"][i],
                                                     logprobs["stock"][pass_ + "base"][i])]
        control = rel(other, ref)
        verdict = "pass" if err <= 0.25 and control >= 0.75 else ("uninformative" if control < 0.75 else "FAIL")
        out[case] = {"rel_l2_error_vs_stock": err, "control_rel_l2": control, "verdict": verdict,
                     "effect_rms": (sum(x * x for x in ref) / max(len(ref), 1)) ** 0.5}
    return out


def collect_logprobs(eng: Engines, variant: str, cases: list[str]) -> dict[str, Any]:
    names = list(cases) + ([f"_other_{c}" for c in cases if c != "base"] if variant == "stock" else [])
    got = {c: eng.ask(variant, "logprobs", c) for c in names}
    return {**got, **{f"small:{c}": eng.ask(variant, "small_logprobs", c) for c in names}}


def summarize(secs: dict[str, dict[str, list[float]]], tokens: int) -> tuple[dict[str, Any], list[list[Any]]]:
    """Tokens/s per variant and case, each case against base and against stock, and the goals."""
    summary: dict[str, Any] = {}
    rows = []
    for v, by_case in secs.items():
        tps = {c: N_REQ * tokens / median(ts) for c, ts in by_case.items() if ts and ":" not in c}
        summary[v] = {"tok_s": tps, "vs_base": {c: t / tps["base"] for c, t in tps.items() if "base" in tps}}
    for v, s in summary.items():
        for c, t in s["tok_s"].items():
            stock = summary.get("stock", {}).get("tok_s", {}).get(c)
            goal = ""
            if v != "stock" and c in GOALS and GOALS[c][0] in s["tok_s"]:
                ref, bound = GOALS[c]
                ratio = t / s["tok_s"][ref]
                s.setdefault("goals", {})[c] = {"ratio": ratio, "against": ref, "goal": bound, "met": ratio >= bound}
                goal = f">= {bound} x {ref}: {ratio:.3f} {'met' if ratio >= bound else 'NOT met'}"
            rows.append([v, c, median(secs[v][c]), t, s["vs_base"].get(c, float("nan")),
                         t / stock if stock else "-", goal])
    return summary, rows


def _payload(args: argparse.Namespace, plan: dict[str, Any], eng: Engines, secs: dict[str, Any],
             logprobs: dict[str, Any], cases: list[str], partial: bool) -> dict[str, Any]:
    summary, rows = summarize(secs, args.tokens) if all(secs[v].get("base") for v in secs) else ({}, [])
    return {"partial": partial, "model": f"Qwen3-30B-A3B shape, {args.layers} of 48 layers, load_format=dummy",
            "adapters": f"{N_ADAPTERS} x r{RANK}: 128 experts (2D per-expert keys) + q/k/v/o", "slots": SLOTS,
            "max_lora_rank": plan["max_lora_rank"], "requests": N_REQ, "prompt_tokens": PROMPT_LEN,
            "output_tokens": args.tokens, "reps": args.reps, "cases": cases, "memory_plan": plan,
            "schedule": "together, interleaved rep by rep" if plan["together"] else
            f"one engine at a time, alternating blocks of {args.block_reps} reps, a fresh engine per block",
            "engine_start_s": eng.starts, "seconds": secs, "summary": summary, "table": rows,
            "parity": parity(logprobs, cases, args.composites) if not partial else {},
            "parity_pair_kernels": parity(logprobs, cases, args.composites, "small:") if not partial else {},
            **({f"parity_{v}": {"long": parity(logprobs, cases, args.composites, "", v),  # (against stock)
                                "pair_kernels": parity(logprobs, cases, args.composites, "small:", v)}
                for v in logprobs if v not in ("stock", "plugin", "plugin_k0")} if not partial else {}),
            "composites": args.composites}


def run(args: argparse.Namespace, spec: dict[str, Any], plan: dict[str, Any], variants: list[str],
        cases: list[str]) -> dict[str, Any]:
    eng = Engines(spec)
    secs: dict[str, dict[str, list[float]]] = {v: {c: [] for c in cases} for v in variants}
    logprobs: dict[str, Any] = {}
    out = args.out or str(Path(__file__).resolve().parent / "results" / "moe_decode.json")
    try:
        if plan["together"]:
            for v in variants:  # one at a time: vLLM checks free memory when an engine starts
                eng.start(v)
            run_block(eng, variants, cases, args.reps, secs, 0, on_rep=lambda: write_json(
                "moe_decode", _payload(args, plan, eng, secs, logprobs, cases, True), out))
            logprobs = {v: collect_logprobs(eng, v, cases) for v in variants}
        else:
            done = 0
            while done < args.reps:
                n = min(args.block_reps, args.reps - done)
                for v in variants[(done // args.block_reps) % 2:] + variants[:(done // args.block_reps) % 2]:
                    eng.start(v)
                    run_block(eng, [v], cases, n, secs, 0)
                    if v not in logprobs:
                        logprobs[v] = collect_logprobs(eng, v, cases)
                    eng.stop(v)
                    write_json("moe_decode", _payload(args, plan, eng, secs, logprobs, cases, True), out)
                done += n
    finally:
        for v in list(eng.procs):
            eng.stop(v)
    return _payload(args, plan, eng, secs, logprobs, cases, False)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=48, help="decoder layers of the 48 (hf_overrides)")
    ap.add_argument("--variants", default="stock,plugin")
    ap.add_argument("--cases", default="base,one,distinct,mixes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--block-reps", type=int, default=2, help="reps per engine start when engines run in turn")
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--composites", type=int, default=4, help="mixes saved as PEFT adapters for stock (1-16)")
    ap.add_argument("--max-lora-rank", type=int, default=None, help="default: 32 with the mixes case, else 16")
    ap.add_argument("--workdir", default=None, help="reuse the adapters written there by a run with the same --layers")
    ap.add_argument("--prepare-only", action="store_true",
                    help="write the adapters and composites into --workdir and stop (a later call reuses them)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    variants, cases = args.variants.split(","), args.cases.split(",")
    if "base" not in cases:
        raise SystemExit("--cases must include base (every ratio is against it)")
    rank = args.max_lora_rank or (2 * RANK if "mixes" in cases else RANK)
    if "mixes" in cases and rank < 2 * RANK:  # (r35's run lost its call to a refused mix)
        raise SystemExit(f"--max-lora-rank {rank}: a mix of two r{RANK} adapters has rank {2 * RANK}; give "
                         f"--max-lora-rank {2 * RANK} (the default with the mixes case) or drop mixes from --cases")
    work = Path(args.workdir or tempfile.mkdtemp(prefix="bench-moe-decode-"))
    model = write_model(work, args.layers)
    cfg = json.loads((model / "config.json").read_text())
    t0 = time.perf_counter()
    adapters = write_adapters(work / "adapters", args.layers)
    composites = (write_composites(work / "composites", adapters, args.composites, cfg)
                  if "mixes" in cases and "stock" in variants else [])
    print(f"{N_ADAPTERS} adapters and {len(composites)} composites in {work} in {time.perf_counter() - t0:.0f} s",
          flush=True)
    if args.prepare_only:
        return
    import torch

    total_gb = torch.cuda.get_device_properties(0).total_memory / 1e9
    staging = 8 * 2**30 / 1e9 if any(v.startswith("plugin") for v in variants) else 0.0  # VLLM_LORA_EXT_STAGE_GPU_BYTES' default
    plan = {**memory_plan(args.layers, rank, total_gb, len(variants), staging), "max_lora_rank": rank,
            "card": torch.cuda.get_device_name(0)}
    print(f"memory plan: {plan}", flush=True)
    if plan["need_gb"] > 0.92 * total_gb:
        raise SystemExit(f"one engine needs about {plan['need_gb']} GB of this {plan['card_gb']} GB card: "
                         f"give fewer --layers (each is about {1.246 + SLOTS * rank * 2.2e-3:.1f} GB)")
    spec = {"model": str(model), "layers": args.layers, "max_lora_rank": rank, "util": plan["gpu_memory_utilization"],
            "tokens": args.tokens, "adapters": adapters, "composites": composites, "cases": cases}
    payload = run(args, spec, plan, variants, cases)
    print_table(payload["table"], ["variant", "case (32 requests)", "seconds (median)", "tok/s", "x base (same engine)",
                                   "x stock", "goal"])
    for what, key in (("", "parity"), (" (short prompts: the pair kernels)", "parity_pair_kernels")):
        for case, p in payload[key].items():
            if case == "base":
                print(f"parity{what} base (no adapter): plugin vs stock, max |diff| {p['max_abs_diff_vs_stock']:.3g}")
                continue
            print(f"parity{what} {case}: plugin's effect vs stock's, relative L2 {p['rel_l2_error_vs_stock']:.3f} "
                  f"(control {p['control_rel_l2']:.3f}): {p['verdict']}")
    print(f"env: {env_info().get('gpu')}, vLLM {env_info().get('vllm')}")
    write_json("moe_decode", payload, args.out)


if __name__ == "__main__":
    main()
