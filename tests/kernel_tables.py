"""Which GPUs the package ships tuned kernel tables for (the tests parametrize over them)."""

from __future__ import annotations

from pathlib import Path

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
