"""GPU: every MoE architecture vLLM serves with LoRA, each module group against HF + PEFT (issue 36).

The matrix is made from the installed vLLM itself: every text-generation class in its registry that has routed
experts (its module uses vLLM's fused MoE layer) and supports LoRA. For each one transformers can build:

1. a tiny random model (2 layers, 8 experts; the first layer dense where the family has ``first_k_dense_replace``),
   saved in bf16 with a small tokenizer;
2. a PEFT adapter (``init_lora_weights=False``) on every ``nn.Linear`` but ``lm_head`` (what ``all-linear`` takes,
   plus the dense and shared-expert MLPs PEFT 0.21 leaves out on DeepSeek-V2), and the fused 3D expert parameters
   through ``target_parameters``;
3. the adapter split into module groups (each attention projection, routed experts, shared experts, dense MLP,
   anything else), each group written as its own adapter;
4. teacher-forced logprobs of 4 random sequences: HF + PEFT in float32 (the other groups' ``lora_B`` zeroed), and
   vLLM with the plugin (bf16, eager) loading each group's adapter.

Per group: ``gap`` = mean |vLLM − HF| with the group, ``noise`` = mean |vLLM base − HF base|, ``control`` = mean
|vLLM base − HF with the group| (the gap if vLLM did not apply the group at all). A cell is

- ``verified``: the load succeeded and ``gap <= tol`` while ``control > tol`` (tol = max(0.1, 3 · noise));
- ``refused``: the plugin refused the adapter (the message is kept);
- ``no effect``: ``control <= tol``, so this check cannot tell applied from ignored;
- ``WRONG``: accepted and served with ``gap > tol`` — accepted but not applied as trained.

Where the base's own noise hides a group (``control <= tol``: FP8's activation quantization, near-tie routing),
the group's *effect* decides: ``effect_err`` = ||(vLLM with − vLLM base) − (HF with − HF base)|| / ||HF with − HF
base|| (relative L2 over every position; both sides' base noise cancels). A group vLLM ignored has ``effect_err``
1.0. ``effect_err <= 0.25`` is ``verified`` (``by: effect``), ``>= 0.75`` ``WRONG``, in between ``no effect``;
an effect too small to measure (mean |HF with − HF base| < 0.01) stays ``no effect``.

On a quantized base (``--quantization``, ``--checkpoint``) the base's own noise (FP8: 0.2–0.36) is near a random
routed-experts adapter's whole effect (0.4–0.5), so there each group's ``lora_B`` is scaled up in the adapter file
both sides load (``--effect-scale``: ``auto`` there, 1 otherwise; ``lora_A`` and ``lora_alpha`` unchanged).
``auto`` takes each group's smallest of 1, 2, 4, 8, 16 whose HF effect reaches 1.2; a number scales every group.
The logits do not blow up: the final norm bounds what ``lm_head`` sees, so a larger delta moves the output
toward an unrelated random model's (mean |Δ logprob| about 2 at most), where a delta off by 2x shows less;
hence the smallest scale that clears the noise. The scales are in the results (``effect_scales``), with the
experts kernels vLLM's MoE LoRA layers ran (``moe_kernels``; null with ``moe_kernels_why`` if unreadable).

An architecture transformers or vLLM cannot build is listed with the reason. Stock vLLM has no column: it has no
refusal to compare, and on DeepSeek-V2 it stops the engine for any adapter (issue 36).

    python bench/moe_matrix.py --out bench/results/moe_matrix.json [--archs A,B] [--parallel 4]
    python bench/moe_matrix.py --archs A,B --quantization fp8 --out ...  # the base quantized online by vLLM
    python bench/moe_matrix.py --archs A --checkpoint fp8|int4|int4-aligned|int4-triton --out ...  # pre-quantized
                                                    # (quantized_ckpt.py; HF + PEFT runs on its dequantized weights)
    python bench/moe_matrix.py ... --effect-scale auto|S           # scale each group's lora_B (see above)
    python bench/moe_matrix.py --one ARCH --workdir W --json OUT   # one architecture (what the driver runs)
    python bench/moe_matrix.py --one ARCH --no-vllm --device cpu   # HF + PEFT side only (no GPU)
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import importlib
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "gpu"))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _matrix_adapters import (EFFECT_TARGET, RANK, SCALES, build_adapter, group_of,  # noqa: E402
                              modules_as_named, parse_scale, scale_adapter, write_group_adapters)

VOCAB = 512
SEQS, SEQ_LEN, PROMPT_LEN = 4, 24, 4
TINY = {  # applied only where the family's config has the field; MLA keeps DeepSeek's head sizes (its kernels want them)
    "vocab_size": VOCAB, "hidden_size": 256, "intermediate_size": 256, "moe_intermediate_size": 96,
    "shared_expert_intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
    "num_key_value_heads": 2, "head_dim": 64, "num_experts": 8, "num_local_experts": 8, "n_routed_experts": 8,
    "num_experts_per_tok": 2, "moe_topk": 2, "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 1,
    "topk_group": 1, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 512, "initializer_range": 0.1,
    "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "use_cache": False,
}
ROUTER_SCALE = 8.0


# ---- which architectures -------------------------------------------------------------------------------------

def candidates() -> list[tuple[str, str]]:
    """(architecture, status) for every registry class with fused MoE experts; status 'lora' or why not."""
    import transformers
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.model_executor.models.registry import _TEXT_GENERATION_MODELS

    out = []
    for arch, (mod, cls) in sorted(_TEXT_GENERATION_MODELS.items()):
        try:
            module = importlib.import_module(f"vllm.model_executor.models.{mod}")
            model_cls = getattr(module, cls)
        except Exception as err:  # a model whose optional dependency is not installed
            out.append((arch, f"not importable in vLLM: {type(err).__name__}: {err}"[:200]))
            continue
        if not any("FusedMoE" in k or "MoERunner" in k for k in vars(module)):
            continue
        if not supports_lora(model_cls):
            out.append((arch, "vLLM does not support LoRA on it"))
        elif not hasattr(transformers, arch):
            out.append((arch, f"transformers {transformers.__version__} has no {arch}"))
        else:
            out.append((arch, "lora"))
    return out


# ---- the tiny model and its adapter ----------------------------------------------------------------------------

def tiny_config(arch: str) -> Any:
    import transformers

    cfg_cls = getattr(transformers, arch).config_class
    fields = cfg_cls().to_dict()
    kwargs = {k: v for k, v in TINY.items() if k in fields}
    if fields.get("q_lora_rank") is not None:
        kwargs["q_lora_rank"] = 96
    if "kv_lora_rank" in fields and "num_key_value_heads" in fields:  # MLA: one latent per head
        kwargs["num_key_value_heads"] = kwargs["num_attention_heads"]
    if isinstance(fields.get("layer_types"), list):
        kwargs["layer_types"] = fields["layer_types"][:1] * TINY["num_hidden_layers"]
    if "rope_scaling" in fields:
        kwargs["rope_scaling"] = None
    cfg = cfg_cls(**kwargs)
    if "head_dim" not in fields:  # vLLM reads it from some families' configs (GLM-4-MoE) where transformers has none
        cfg.head_dim = TINY["hidden_size"] // TINY["num_attention_heads"]
    return cfg


def build_model(arch: str, folder: Path) -> Any:
    import transformers
    from tiny import build_tokenizer

    torch.manual_seed(0)
    model = getattr(transformers, arch)(tiny_config(arch)).float()
    with torch.no_grad():  # decisive routers: bf16 vs fp32 then pick the same experts (see tests/gpu/tiny.py)
        for name, p in model.named_parameters():
            if name.endswith((".gate.weight", ".router.weight")) and p.ndim == 2:
                p.mul_(ROUTER_SCALE)
    if any(n.endswith("e_score_correction_bias") for n, _ in model.named_buffers()):
        # transformers' DeepSeek-V3-style routers always carry the bias; vLLM makes the parameter only for
        # topk_method 'noaux_tc' (the released checkpoints' value), which transformers' config leaves out
        model.config.topk_method = "noaux_tc"
    model.to(torch.bfloat16).save_pretrained(str(folder), safe_serialization=True)
    build_tokenizer(folder)
    return model


# ---- both sides' logprobs --------------------------------------------------------------------------------------

def sequences() -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 400, (SEQ_LEN - 1,), generator=g).tolist() for _ in range(SEQS)]


class HfSide:
    """HF + PEFT in float32 on one adapter folder: teacher-forced logprobs of the base, or of one group alone (the
    other groups' ``lora_B`` zeroed), that group's ``lora_B`` optionally times a scale."""

    def __init__(self, model_dir: Path, adapter: Path, device: str) -> None:
        import peft
        import transformers

        base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
        with modules_as_named():
            self.model = peft.PeftModel.from_pretrained(base, str(adapter)).to(device).eval()
        self.device = device
        self.b_params = {n: p for n, p in self.model.named_parameters() if ".lora_B." in n}
        self.saved = {n: p.detach().clone() for n, p in self.b_params.items()}

    @torch.no_grad()
    def logprobs(self, group: str | None, scale: float = 1.0) -> list[list[float]]:
        """The base's (``group`` None), or the group's; ``all`` is every group at once."""
        if group is None:
            with self.model.disable_adapter():
                return self._run()
        for n, p in self.b_params.items():
            p.copy_(self.saved[n] * scale if group == "all" or group_of(n) == group else torch.zeros_like(p))
        return self._run()

    def _run(self) -> list[list[float]]:
        rows = []
        for ids in sequences():
            logits = self.model(input_ids=torch.tensor([ids], device=self.device)).logits[0].float()
            lp = torch.log_softmax(logits, dim=-1)
            rows.append([float(lp[i - 1, ids[i]]) for i in range(PROMPT_LEN, len(ids))])
        return rows


def hf_logprobs(model_dir: Path, adapter: Path, groups: list[str], device: str) -> dict[str, list[list[float]]]:
    """Teacher-forced logprobs: the base, then each group alone (other groups' lora_B zeroed), fp32."""
    side = HfSide(model_dir, adapter, device)
    return {"base": side.logprobs(None), **{g: side.logprobs(g) for g in groups}}


def choose_scales(model_dir: Path, adapter: Path, device: str, scale: str | float) -> dict[str, float]:
    """Each group's ``lora_B`` scale for ``--effect-scale``: the number for every group, or (``auto``) the smallest
    of ``SCALES`` whose HF effect (mean |HF with − HF base|) reaches ``EFFECT_TARGET``, the largest where none does."""
    side = HfSide(model_dir, adapter, device)
    groups = sorted({group_of(n) for n in side.b_params})
    if scale != "auto":
        return {g: float(scale) for g in groups}
    base, out = side.logprobs(None), {}
    for g in groups:
        out[g] = next((s for s in SCALES if _mean_gap(side.logprobs(g, s), base) >= EFFECT_TARGET), SCALES[-1])
    return out


def worker_moe_kernels(worker: Any) -> list[str]:
    """The experts kernels of the MoE LoRA wrappers in this worker's LoRA manager (for ``collective_rpc``)."""
    from vllm_lora_ext.integration._compat import moe_experts_kernel

    modules = worker.model_runner.lora_manager._adapter_manager.modules
    return sorted({k for m in modules.values() if (k := moe_experts_kernel(m)) is not None})


def engine_moe_kernels(llm: Any) -> dict[str, Any]:
    """``moe_kernels``: every worker's experts kernels; None, with ``moe_kernels_why``, where they cannot be read."""
    try:
        per_worker = llm.collective_rpc(worker_moe_kernels)
    except Exception as err:  # a vLLM whose worker keeps its LoRA manager elsewhere: recorded, the run goes on
        return {"moe_kernels": None, "moe_kernels_why": f"{type(err).__name__}: {err}"[:300]}
    return {"moe_kernels": sorted({k for kernels in per_worker for k in kernels})}


def vllm_logprobs(model_dir: Path, adapters: dict[str, Path],
                  quantization: str | None) -> tuple[dict[str, Any], dict[str, Any]]:
    """vLLM with the plugin: the base, then each group's adapter; a refused load keeps its message. Also the experts
    kernels the engine's MoE LoRA layers ran (``engine_moe_kernels``, read after the base's forward)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    llm = LLM(str(model_dir), enable_lora=True, max_lora_rank=RANK, max_loras=1, max_cpu_loras=2,
              enforce_eager=True, gpu_memory_utilization=0.08, max_model_len=256, dtype="bfloat16", seed=0,
              quantization=quantization)
    params = SamplingParams(max_tokens=1, prompt_logprobs=1)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in sequences()]

    def run(req: Any) -> list[list[float]]:
        outs = llm.generate(prompts, params, lora_request=req, use_tqdm=False)
        return [[float(o.prompt_logprobs[i][ids[i]].logprob) for i in range(PROMPT_LEN, len(ids))]
                for o, ids in zip(outs, sequences())]

    out: dict[str, Any] = {"base": run(None)}
    kernels = engine_moe_kernels(llm)
    for i, (g, path) in enumerate(adapters.items(), 1):
        try:
            out[g] = run(LoRARequest(f"m{i}", i, str(path)))
        except Exception as err:
            out[g] = {"refused": f"{type(err).__name__}: {err}"[:600]}
    return out, kernels


def _mean_gap(a: list[list[float]], b: list[list[float]]) -> float:
    x, y = torch.tensor(a), torch.tensor(b)
    return float((x - y).abs().mean())


def judge(hf: dict[str, Any], vl: dict[str, Any]) -> dict[str, Any]:
    noise = _mean_gap(vl["base"], hf["base"])
    tol = max(0.1, 3 * noise)
    cells = {}
    for g in hf:
        if g == "base":
            continue
        control = _mean_gap(vl["base"], hf[g])
        if isinstance(vl.get(g), dict):
            cells[g] = {"verdict": "refused", "why": vl[g]["refused"], "control": control}
            continue
        gap = _mean_gap(vl[g], hf[g])
        effect, effect_err, by_effect = effect_check(hf["base"], hf[g], vl["base"], vl[g])
        cell = {"verdict": "verified" if gap <= tol else "WRONG", "gap": gap, "control": control,
                "effect": effect, "effect_err": effect_err}
        if control <= tol:  # the base's noise hides the group: its effect decides
            cell.update(verdict=by_effect, by="effect")
        cells[g] = cell
    return {"noise": noise, "tol": tol, "groups": cells}


def effect_check(hf_base: list[list[float]], hf_g: list[list[float]], vl_base: list[list[float]],
                 vl_g: list[list[float]]) -> tuple[float, float, str]:
    """The group's effect (mean |HF with − HF base|), vLLM's relative L2 error on it (1.0 when vLLM ignores the
    group), and the verdict those give."""
    d_hf = torch.tensor(hf_g) - torch.tensor(hf_base)
    d_vl = torch.tensor(vl_g) - torch.tensor(vl_base)
    size = float(d_hf.abs().mean())
    err = float((d_vl - d_hf).norm() / d_hf.norm()) if size > 0 else float("inf")
    verdict = "no effect" if size < 0.01 else "verified" if err <= 0.25 else "WRONG" if err >= 0.75 else "no effect"
    return size, err, verdict


def run_one(arch: str, workdir: Path, *, use_vllm: bool, device: str, quantization: str | None = None,
            checkpoint: str | None = None, effect_scale: str | float = 1.0) -> dict[str, Any]:
    workdir.mkdir(parents=True, exist_ok=True)
    served, info_q = workdir / "model", {}
    try:
        model_dir = workdir / "model"
        if checkpoint == "int4-triton":  # hidden size not a multiple of 128: vLLM picks Triton WNA16, not Marlin
            TINY["hidden_size"] = 192
        if checkpoint == "int4-aligned":  # Marlin pads 96 (not a multiple of 64) to 128, the plugin refuses: not 128
            TINY["moe_intermediate_size"] = 128
        model = build_model(arch, model_dir)
        del model
        if checkpoint:
            from quantized_ckpt import quantize_checkpoint

            served = workdir / "quantized"
            info_q = quantize_checkpoint(model_dir, served, checkpoint)
        info = build_adapter(model_dir, workdir / "adapter")
        scales = {}
        if effect_scale != 1.0:  # both sides then load the scaled file
            scales = choose_scales(model_dir, workdir / "adapter", device, effect_scale)
            scale_adapter(workdir / "adapter", scales)
        adapters = write_group_adapters(workdir / "adapter", workdir / "groups")
        hf = hf_logprobs(model_dir, workdir / "adapter", list(adapters), device)
    except Exception as err:
        return {"arch": arch, "status": "not buildable",
                "why": f"transformers: {type(err).__name__}: {err}"[:400], "trace": traceback.format_exc()[-2000:]}
    kind = quantization or (f"{checkpoint} checkpoint" if checkpoint else None)
    name = f"{arch} ({kind})" if kind else arch
    result: dict[str, Any] = {"arch": name, "status": "built", **info, **info_q, "groups": sorted(adapters),
                              "effect_scale": effect_scale, **({"effect_scales": scales} if scales else {})}
    if not use_vllm:
        return result
    try:
        vl, kernels = vllm_logprobs(served, adapters, quantization)
    except Exception as err:
        return {**result, "status": "not buildable", "why": f"vLLM: {type(err).__name__}: {err}"[:400],
                "trace": traceback.format_exc()[-2000:]}
    return {**result, "status": "ran", **kernels, **judge(hf, vl)}


# ---- the driver ---------------------------------------------------------------------------------------------

def _one_in_subprocess(arch: str, workdir: Path, timeout: float, quantization: str | None,
                       checkpoint: str | None = None, effect_scale: str | float = 1.0) -> dict[str, Any]:
    js = workdir / arch / "result.json"
    cmd = [sys.executable, __file__, "--one", arch, "--workdir", str(workdir / arch), "--json", str(js),
           "--effect-scale", str(effect_scale)]
    if quantization:
        cmd += ["--quantization", quantization]
    if checkpoint:
        cmd += ["--checkpoint", checkpoint]
    log = workdir / f"{arch}.log"
    t0 = time.time()
    try:
        with log.open("w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout).returncode
    except subprocess.TimeoutExpired:
        return {"arch": arch, "status": "not buildable", "why": f"timed out after {timeout:.0f} s"}
    if js.exists():
        return {**json.loads(js.read_text()), "seconds": round(time.time() - t0, 1)}
    return {"arch": arch, "status": "not buildable", "why": f"exit {rc}: {log.read_text()[-400:]}"}


def describe_scale(scale: str | float) -> str:
    """The ``lora_B`` scale in words, for the table's header."""
    if scale == "auto":
        return (f"auto: each group's smallest of {', '.join(f'{x:g}' for x in SCALES)} with an HF effect >= "
                f"{EFFECT_TARGET} nats (column 'scale')")
    return "none (the adapter as built)" if scale == 1.0 else f"{scale:g} on every group"


def _kernels(r: dict[str, Any]) -> str:
    if "moe_kernels" not in r:
        return "-"
    if r["moe_kernels"] is None:
        return f"unknown ({r.get('moe_kernels_why', '')[:80]})"
    return ", ".join(r["moe_kernels"]) or "none"


def print_table(results: list[dict[str, Any]], scale: str | float = 1.0) -> None:
    print(f"lora_B scale: {describe_scale(scale)}")
    print(f"{'architecture':34} {'group':22} {'verdict':10} {'gap':>7} {'noise':>7} {'control':>8} {'scale':>6}")
    for r in results:
        if r["status"] != "ran":
            print(f"{r['arch']:34} {'-':22} {r['status']:10}  {r.get('why', '')[:90]}")
            continue
        scales = r.get("effect_scales", {})
        for g, c in r["groups"].items():
            gap = f"{c['gap']:.3f}" if "gap" in c else "-"
            s = "each" if g == "all" and scales else f"{scales.get(g, 1.0):g}"
            print(f"{r['arch']:34} {g:22} {c['verdict']:10} {gap:>7} {r['noise']:7.3f} {c['control']:8.3f} {s:>6}"
                  + (f"  {c['why'][:80]}" if "why" in c else ""))
        print(f"{r['arch']:34} noise {r['noise']:.3f}, tol {r['tol']:.3f}, MoE experts kernels: {_kernels(r)}")


COLUMNS = ("attention", "routed experts", "shared experts", "dense mlp", "other")
# vLLM's words when engines started side by side on one card took each other's memory: not a finding.
_COLLISIONS = ("Error in memory profiling", "No available memory for the cache blocks")


def _column(group: str) -> str:
    if group.startswith("attn."):
        return "attention"
    return group if group in COLUMNS else "other"


def _cell(cells: dict[str, dict[str, Any]], column: str) -> str:
    if not cells:
        return "—"
    verdicts = {c["verdict"] for c in cells.values()}
    if len(verdicts) == 1 and (column != "other" or len(cells) > 1):
        return next(iter(verdicts))
    return ", ".join(f"{g.split('.', 1)[-1]} {c['verdict']}" for g, c in sorted(cells.items()))


def render_table(doc: dict[str, Any]) -> str:
    """The README's table: one row per architecture, one column per module group, from a results file."""
    lines = ["| architecture | " + " | ".join(COLUMNS) + " |", "|---" * (len(COLUMNS) + 1) + "|"]
    for r in sorted(doc["results"], key=lambda r: r["arch"]):
        if r["status"] != "ran":
            why = (r.get("why") or "").splitlines()[0] if r.get("why") else ""
            if any(m in why for m in _COLLISIONS):
                text = "not run: an engine beside it took the memory (run it alone)"
            else:
                text = f"not buildable: {why[:90]}"
            lines.append(f"| {r['arch']} | {text} |" + " |" * (len(COLUMNS) - 1))
            continue
        by_col: dict[str, dict[str, Any]] = {c: {} for c in COLUMNS}
        for g, c in r["groups"].items():
            if g != "all":
                by_col[_column(g)][g] = c
        lines.append(f"| {r['arch']} | " + " | ".join(_cell(by_col[c], c) for c in COLUMNS) + " |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench/results/moe_matrix.json"))
    ap.add_argument("--archs", default="", help="comma-separated architectures (default: the registry's)")
    ap.add_argument("--skip", default="", help="comma-separated architectures not to run (e.g. run in another call)")
    ap.add_argument("--parallel", type=int, default=4)
    ap.add_argument("--timeout", type=float, default=300)
    ap.add_argument("--workdir", type=Path, default=None,
                    help="default: a new folder under /tmp per run, so runs side by side never share files")
    ap.add_argument("--one", default="")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--no-vllm", action="store_true")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quantization", default=None, help="vLLM's online quantization of the base, e.g. fp8")
    ap.add_argument("--checkpoint", default=None, choices=("fp8", "int4", "int4-aligned", "int4-triton"),
                    help="serve a pre-quantized copy of the base (quantized_ckpt.py)")
    ap.add_argument("--effect-scale", type=parse_scale, default=None,
                    help="multiply each group's lora_B (in the adapter both sides load) by this, or 'auto' "
                         "(default with --quantization or --checkpoint; 1 otherwise)")
    ap.add_argument("--render", type=Path, help="print the README table of a results file and exit")
    args = ap.parse_args()
    scale = args.effect_scale or ("auto" if args.quantization or args.checkpoint else 1.0)
    if args.render:
        print(render_table(json.loads(args.render.read_text())))
        return 0
    if args.workdir is None:  # two runs on one machine once shared /tmp/moe-matrix and served each other's base
        args.workdir = Path(tempfile.mkdtemp(prefix="moe-matrix-"))
    if args.one:
        res = run_one(args.one, args.workdir, use_vllm=not args.no_vllm, device=args.device,
                      quantization=args.quantization, checkpoint=args.checkpoint, effect_scale=scale)
        text = json.dumps(res, indent=1)
        args.json.write_text(text) if args.json else print(text)
        return 0
    found = candidates()
    wanted = set(filter(None, args.archs.split(",")))
    skip = set(filter(None, args.skip.split(",")))
    todo = [a for a, s in found if s == "lora" and (not wanted or a in wanted) and a not in skip]
    skipped = [{"arch": a, "status": "not buildable", "why": s} for a, s in found if s != "lora"]
    args.workdir.mkdir(parents=True, exist_ok=True)
    def one(arch: str) -> dict[str, Any]:
        return _one_in_subprocess(arch, args.workdir, args.timeout, args.quantization, args.checkpoint, scale)

    with cf.ThreadPoolExecutor(args.parallel) as pool:
        ran = list(pool.map(one, todo))
    # Engines started side by side can trip vLLM's memory profiling (another process freed or took memory
    # meanwhile): those run again, one at a time.
    ran = [one(r["arch"].split(" ")[0]) if r["status"] != "ran" and any(m in r.get("why", "") for m in _COLLISIONS)
           else r for r in ran]
    results = ran + ([] if wanted else skipped)
    import transformers
    import vllm

    card = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    doc = {"card": card, "vllm": vllm.__version__, "transformers": transformers.__version__,
           "quantization": args.quantization, "checkpoint": args.checkpoint, "effect_scale": scale,
           **({"effect_target": EFFECT_TARGET} if scale == "auto" else {}), "rank": RANK, "sequences": SEQS,
           "positions_per_sequence": SEQ_LEN - PROMPT_LEN, "results": results}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(doc, indent=1))
    print_table(results, scale)
    wrong = [(r["arch"], g) for r in results if r["status"] == "ran" for g, c in r["groups"].items()
             if c["verdict"] == "WRONG"]
    print(f"wrote {args.out}; {len(ran)} architectures run, WRONG cells: {wrong or 'none'}")
    return 1 if wrong else 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    sys.exit(main())
