"""The PEFT adapter ``moe_matrix.py`` puts on its tiny models: building it, its module groups, one adapter per
group, and the per-group ``lora_B`` scale written into the files both sides load (``--effect-scale``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

RANK, ALPHA = 8, 16
# --effect-scale auto: each group's smallest scale in SCALES at which its HF effect reaches EFFECT_TARGET (nats of
# mean |Δ logprob|); the largest where none does. Powers of two: exact in fp32 and bf16, so the scaled file holds
# exactly what the HF side measured.
SCALES = (1.0, 2.0, 4.0, 8.0, 16.0)
EFFECT_TARGET = 1.2
ADAPTER_WEIGHTS = "adapter_model.safetensors"


def parse_scale(text: str) -> str | float:
    """``auto``, or a positive number as a float; anything else is an argparse error."""
    import argparse

    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"--effect-scale takes 'auto' or a positive number, not {text!r}")
    return value


def expert_parameters(model: Any) -> list[str]:
    """Suffixes (``experts.gate_up_proj``) of the fused 3D expert parameters, for PEFT's ``target_parameters``."""
    names = {".".join(n.split(".")[-2:]) for n, p in model.named_parameters() if p.ndim == 3 and ".experts." in n}
    return sorted(names)


@contextlib.contextmanager
def modules_as_named() -> Iterator[None]:
    """PEFT targets the named ``nn.Linear`` modules, without its transformers-v4 -> v5 MoE config conversion.

    That conversion (PEFT 0.21) maps every ``gate_proj``/``up_proj``/``down_proj`` target onto the fused experts,
    so a DeepSeek-V2 dense MLP or shared expert could not be targeted at all; the experts are targeted here
    through ``target_parameters`` explicitly instead. Used for building the adapter and for loading it back.
    """
    try:
        import peft.utils.transformers_weight_conversion as conv
    except ImportError:  # a PEFT without the conversion targets modules as named already
        yield
        return
    saved = conv.convert_peft_config_for_transformers
    conv.convert_peft_config_for_transformers = lambda *a, **k: None
    try:
        yield
    finally:
        conv.convert_peft_config_for_transformers = saved


def build_adapter(model_dir: Path, folder: Path) -> dict[str, Any]:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    params = expert_parameters(model)
    torch.manual_seed(1)
    # Every linear module by name: PEFT 0.21's "all-linear" leaves out DeepSeek-V2's dense and shared-expert MLPs.
    linears = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and not n.endswith("lm_head")})
    kwargs: dict[str, Any] = {"r": RANK, "lora_alpha": ALPHA, "init_lora_weights": False, "target_modules": linears}
    if params:
        kwargs["target_parameters"] = params
    with modules_as_named():
        peft.get_peft_model(model, peft.LoraConfig(**kwargs)).save_pretrained(str(folder))
    return {"target_modules": linears, "target_parameters": params}


def group_of(key: str) -> str:
    """The module group of an adapter key (or a PEFT parameter name)."""
    path = key.split(".lora_")[0].replace(".base_layer", "")
    leaf = path.rsplit(".", 1)[-1]
    if leaf == "shared_expert_gate":  # a gate on the shared expert's output (Qwen2-MoE), not its MLP
        return "shared expert gate"
    if "shared_expert" in path:
        return "shared experts"
    if ".experts" in path:
        return "routed experts"
    if "attn" in path or "attention" in path:
        return f"attn.{leaf}"
    if ".mlp." in path or ".feed_forward." in path or ".block_sparse_moe." in path:
        return f"mlp.{leaf}" if leaf in ("gate", "router") else "dense mlp"
    return f"other.{leaf}"


def scale_adapter(adapter: Path, scales: Mapping[str, float]) -> None:
    """Multiply each group's ``lora_B`` tensors in ``adapter``'s weights file by its scale, in place.

    ``lora_A`` and ``adapter_config.json`` (``lora_alpha``, ``r``) stay as they are; a group missing from
    ``scales`` keeps scale 1. Both sides read the result: HF + PEFT loads this folder, and the group adapters
    (``write_group_adapters``) are split from it.
    """
    from safetensors.torch import load_file, save_file

    path = adapter / ADAPTER_WEIGHTS
    tensors = load_file(str(path))
    for key, t in tensors.items():
        s = scales.get(group_of(key), 1.0)
        if ".lora_B." in key and s != 1.0:
            tensors[key] = t * s
    save_file(tensors, str(path), metadata={"format": "pt"})


def write_group_adapters(adapter: Path, dest: Path) -> dict[str, Path]:
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(adapter / ADAPTER_WEIGHTS))
    config = (adapter / "adapter_config.json").read_text()
    groups: dict[str, dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        groups.setdefault(group_of(key), {})[key] = t
    out = {"all": adapter}
    for g, part in sorted(groups.items()):
        d = dest / g.replace(" ", "_")
        d.mkdir(parents=True, exist_ok=True)
        save_file(part, str(d / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (d / "adapter_config.json").write_text(config)
        out[g] = d
    return out
