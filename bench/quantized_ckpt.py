"""Pre-quantized copies of a tiny bf16 MoE checkpoint, in formats vLLM loads, for ``moe_matrix.py --checkpoint``.

``quantize_checkpoint(model_dir, dest, kind)`` writes ``dest``: the same model with its attention projections and
routed experts quantized, and a ``quantization_config`` vLLM reads. It also rewrites ``model_dir``'s weights in
place with the exact dequantized values (float32), so HF + PEFT on ``model_dir`` is the reference for the quantized
base itself: what remains between the two sides is the kernels' own error, not the quantization's.

Kinds:

- ``fp8``: vLLM's ``fp8`` checkpoint format, per-tensor weight scales, dynamic activation scales (what
  ``llm-compressor``'s FP8-dynamic and many released FP8 checkpoints carry). The shards vLLM fuses share one scale
  (q/k/v of a layer; gate/up of an expert), so vLLM's requantization to the largest scale changes nothing.
- ``int4``: compressed-tensors ``pack-quantized`` W4A16 (symmetric int4, group 32) on the routed experts only.
  vLLM runs it with Marlin where the shapes allow (hidden size a multiple of 128) and with its Triton WNA16 kernel
  otherwise (``moe_matrix.py`` builds that case with ``int4-triton``: hidden size 192). Marlin pads an experts'
  intermediate size that is not a multiple of 64 and of the group to that tile (the matrix's 96 becomes 128), which
  vLLM's MoE LoRA buffers do not follow, so the plugin refuses expert LoRA there; ``int4-aligned`` is the same
  checkpoint with an intermediate size of 128, which Marlin takes as it is.

Router gates, norms, embeddings and ``lm_head`` stay bf16 (listed as ignored where the format needs it).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch

KINDS = ("fp8", "int4", "int4-aligned", "int4-triton")
FP8_MAX = 448.0
GROUP = 32
_ATTN = re.compile(r"^(.*\.self_attn)\.(q_proj|k_proj|v_proj|o_proj)\.weight$")
_EXPERT = re.compile(r"^(.*\.experts\.\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.weight$")
_FUSED = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gu", "up_proj": "gu", "w1": "gu",
          "w3": "gu"}


def _load(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    return tensors


def _fp8_groups(names: list[str]) -> dict[str, list[str]]:
    """Quantized weight names grouped by the scale they share (the shards vLLM fuses into one matrix)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        m = _ATTN.match(name) or _EXPERT.match(name)
        if m:
            groups.setdefault(f"{m.group(1)}:{_FUSED.get(m.group(2), m.group(2))}", []).append(name)
    return groups


def _write_fp8(tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor], deq: dict[str, torch.Tensor]) -> set[str]:
    done: set[str] = set()
    for names in _fp8_groups(list(tensors)).values():
        scale = max(float(tensors[n].float().abs().max()) for n in names) / FP8_MAX
        for n in names:
            q = (tensors[n].float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            out[n] = q
            out[n[: -len("weight")] + "weight_scale"] = torch.tensor(scale, dtype=torch.float32)
            deq[n] = q.float() * scale
            done.add(n)
    return done


def _write_int4(tensors: dict[str, torch.Tensor], out: dict[str, torch.Tensor], deq: dict[str, torch.Tensor]) -> set[str]:
    done: set[str] = set()
    for n, w in tensors.items():
        if not _EXPERT.match(n):
            continue
        rows, cols = w.shape
        g = w.float().reshape(rows, cols // GROUP, GROUP)
        scale = (g.abs().amax(-1, keepdim=True) / 7.0).clamp_min(1e-8).bfloat16().float()
        q = torch.round(g / scale).clamp(-8, 7)
        deq[n] = (q * scale).reshape(rows, cols)
        u = (q + 8).to(torch.int64).reshape(rows, cols // 8, 8)
        packed = sum(u[..., i] << (4 * i) for i in range(8))
        packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
        base = n[: -len("weight")]
        out[base + "weight_packed"] = packed.contiguous()
        out[base + "weight_scale"] = scale.reshape(rows, cols // GROUP).bfloat16().contiguous()
        out[base + "weight_shape"] = torch.tensor([rows, cols], dtype=torch.int64)
        done.add(n)
    return done


def _config(kind: str, ignored: list[str]) -> dict[str, object]:
    if kind == "fp8":
        return {"quant_method": "fp8", "activation_scheme": "dynamic", "ignored_layers": ignored}
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": GROUP,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None, "format": "pack-quantized"}},
            "ignore": ignored}


def quantize_checkpoint(model_dir: Path, dest: Path, kind: str) -> dict[str, object]:
    """Write the ``kind`` copy of ``model_dir`` to ``dest``; rewrite ``model_dir`` with the dequantized weights."""
    from safetensors.torch import save_file

    if kind not in KINDS:
        raise ValueError(f"unknown checkpoint kind {kind!r}: one of {', '.join(KINDS)}")
    tensors = _load(model_dir)
    out: dict[str, torch.Tensor] = {}
    deq: dict[str, torch.Tensor] = {}
    done = (_write_fp8 if kind == "fp8" else _write_int4)(tensors, out, deq)
    out.update({n: t for n, t in tensors.items() if n not in done})
    # every other linear layer (router gates, shared experts, dense MLPs, attention for int4) stays unquantized
    ignored = sorted(n[: -len(".weight")] for n, t in tensors.items()
                     if n.endswith(".weight") and t.ndim == 2 and n not in done and "embed" not in n)
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
            shutil.copy(f, dest / f.name)
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = _config(kind, ignored)
    (dest / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in out.items()}, str(dest / "model.safetensors"), metadata={"format": "pt"})
    for f in model_dir.glob("*.safetensors"):
        f.unlink()
    (model_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    reference = {n: (deq[n] if n in deq else t) for n, t in tensors.items()}
    save_file({k: v.contiguous() for k, v in reference.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
    return {"checkpoint": kind, "quantized_weights": len(done), "ignored_layers": len(ignored)}
