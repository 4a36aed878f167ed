"""Which GPUs the package ships tuned kernel tables for (the tests parametrize over them), and the dense fp32
reference of a fused-MoE LoRA layer step (the GPU tests of the fused-MoE tables and of the pair path)."""

from __future__ import annotations

import functools
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

from vllm_lora_ext.kernel_configs import FOLDER, config_file_names
from vllm_lora_ext.kernel_configs.moe import MOE_OPS, moe_config_file_names


def shipped_gpus(folder: Path = FOLDER) -> list[str]:
    """Return the GPU stems that have all three shrink/expand files in ``folder``."""
    stems = {p.name[: -len("_SHRINK.json")] for p in folder.glob("*_SHRINK.json")}
    return sorted(s for s in stems if all((folder / n).is_file() for n in config_file_names(s)))


def shipped_moe_gpus(folder: Path = FOLDER) -> list[str]:
    """Return the GPU stems that have all four fused-MoE files in ``folder``."""
    suffix = f"_{MOE_OPS[0].upper()}.json"
    stems = {p.name[: -len(suffix)] for p in folder.glob(f"*{suffix}")}
    return sorted(s for s in stems if all((folder / n).is_file() for n in moe_config_file_names(s)))


@functools.lru_cache(maxsize=1)
def moe_tuner() -> ModuleType:
    """``bench/tune_moe_lora_kernels.py``, loaded once: its ``Shape`` and ``Step`` launch one MoE layer's LoRA step
    through vLLM's ``PunicaWrapperGPU``."""
    from factories import load_bench

    return load_bench("tune_moe_lora_kernels", as_name="tune_moe_lora_kernels_under_test")


def moe_lora_reference(step: Any, label: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The LoRA deltas of ``step`` (a [`moe_tuner`] ``Step``) computed densely in fp32 from the same factors,
    routing and token-to-slot map ``label``."""
    tune = moe_tuner()
    ids = step.topk_ids.long()
    slot = step.mappings[label].long()[:, None].expand_as(ids)
    y13 = []
    for a, b in zip(step.w13_a, step.w13_b):
        inner = torch.einsum("mh,mkrh->mkr", step.x.float(), a[slot, ids].float())
        y13.append(torch.einsum("mkr,mkir->mki", inner, b[slot, ids].float()))
    x2 = step.x2.float().view(step.shape.m, tune.TOP_K, tune.INTERMEDIATE)
    inner = torch.einsum("mki,mkri->mkr", x2, step.w2_a[0][slot, ids].float())
    y2 = torch.einsum("mkr,mkhr->mkh", inner, step.w2_b[0][slot, ids].float()) * step.topk_weights[..., None]
    return torch.cat(y13, dim=-1), y2
