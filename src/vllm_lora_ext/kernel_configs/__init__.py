"""Tuned configs for vLLM's multi-LoRA Triton kernels (shrink and expand), shipped per GPU.

vLLM picks the block sizes, split-K and warps of its LoRA kernels from a default that ignores the GPU
and the number of adapters in the batch, unless ``VLLM_TUNED_CONFIG_FOLDER`` names a folder holding
``{gpu}_SHRINK.json``, ``{gpu}_EXPAND_TRUE.json`` and ``{gpu}_EXPAND_FALSE.json``, where ``{gpu}`` is
``torch.cuda.get_device_name()`` with spaces and dashes turned into underscores (``NVIDIA_H200``).
Each file is a table ``[max_loras + 1][num_slices][m][k][n] -> config``: vLLM takes the nearest key at
every level except ``num_slices``, which must be present.

This folder holds such files, written by ``bench/tune_lora_kernels.py`` (which also records, per
shape, vLLM's default time and the tuned one). `point_vllm_at_configs` sets the variable to this
folder when the process's GPU has files here that pass `check_table`, unless the user set it already
or switched this off with ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``. It never imports vLLM or initialises
CUDA: the GPU's name comes from NVML.

Example:
    >>> file_stem("NVIDIA H100 80GB HBM3")
    'NVIDIA_H100_80GB_HBM3'
    >>> config_file_names("NVIDIA_H200")
    ('NVIDIA_H200_SHRINK.json', 'NVIDIA_H200_EXPAND_TRUE.json', 'NVIDIA_H200_EXPAND_FALSE.json')
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping, MutableMapping
from pathlib import Path
from typing import Any

from vllm_lora_ext.constants import kernel_configs_enabled
from vllm_lora_ext.errors import KernelConfigError

logger = logging.getLogger(__name__)

__all__ = ["FOLDER", "VLLM_ENV", "check_table", "config_file_names", "file_stem", "point_vllm_at_configs",
           "shipped_gpus", "visible_gpu_name"]

FOLDER = Path(__file__).resolve().parent
VLLM_ENV = "VLLM_TUNED_CONFIG_FOLDER"
# The keys vLLM's launchers read from a config (shrink also reads group_size_m, with a default).
_REQUIRED = {"shrink": ("block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "num_ctas"),
             "expand": ("block_m", "block_n", "block_k", "num_warps", "num_stages", "num_ctas")}
# num_slices vLLM's LoRA layers use (q/k/v, gate/up, ...): each must be a key, as vLLM matches it exactly.
SLICE_KEYS = tuple(str(s) for s in range(1, 17))


def file_stem(device_name: str) -> str:
    """Return vLLM's file-name form of a GPU name (spaces and dashes become underscores)."""
    return device_name.replace(" ", "_").replace("-", "_")


def config_file_names(stem: str) -> tuple[str, str, str]:
    """Return the three file names vLLM looks for, for a GPU given by its `file_stem`."""
    return f"{stem}_SHRINK.json", f"{stem}_EXPAND_TRUE.json", f"{stem}_EXPAND_FALSE.json"


def shipped_gpus(folder: Path = FOLDER) -> list[str]:
    """Return the GPU stems that have all three files in ``folder``."""
    stems = {p.name[: -len("_SHRINK.json")] for p in folder.glob("*_SHRINK.json")}
    return sorted(s for s in stems if all((folder / n).is_file() for n in config_file_names(s)))


def _is_int_key(key: object) -> bool:
    return isinstance(key, str) and key.isdigit()


def check_table(table: Any, op: str, *, name: str = "table") -> None:
    """Check that ``table`` is a config table vLLM can read for ``op`` (``"shrink"`` or ``"expand"``).

    Raises:
        [`KernelConfigError`]: a level is empty or keyed by something other than digits, a ``num_slices``
            level lacks one of 1..16, or a config lacks a key vLLM's launcher reads or holds a
            non-positive or non-integer value.
    """
    required = _REQUIRED[op]

    def fail(path: list[str], what: str) -> KernelConfigError:
        where = "][".join(path)
        return KernelConfigError(f"LoRA kernel config {name}[{where}]: {what}. Re-run bench/tune_lora_kernels.py "
                                 f"or set VLLM_LORA_EXT_KERNEL_CONFIGS=0 to use vLLM's defaults.")

    def level(node: Any, path: list[str], depth: int) -> None:
        if depth == 5:
            if not isinstance(node, Mapping):
                raise fail(path, "is not a config object")
            for key in required:
                value = node.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise fail(path, f"{key} is {value!r}; it must be a positive integer")
            return
        if not isinstance(node, Mapping) or not node or not all(_is_int_key(k) for k in node):
            raise fail(path, "must be a non-empty object keyed by integers")
        if depth == 1:
            missing = [s for s in SLICE_KEYS if s not in node]
            if missing:
                raise fail(path, f"has no num_slices {', '.join(missing)} (vLLM needs each exactly)")
        for key, child in node.items():
            level(child, path + [key], depth + 1)

    level(table, [], 0)


def visible_gpu_name() -> str | None:
    """Return the name of the first GPU this process would use, from NVML (no CUDA context), or None."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and not visible.strip():
        return None
    try:
        import pynvml  # type: ignore[import-untyped]  # nvidia-ml-py, a vLLM dependency
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:
        return None
    try:
        first = (visible or "0").split(",")[0].strip()
        if first.isdigit():
            handle = pynvml.nvmlDeviceGetHandleByIndex(int(first))
        else:
            handle = pynvml.nvmlDeviceGetHandleByUUID(first)
        name = pynvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def point_vllm_at_configs(environ: MutableMapping[str, str] | None = None, *, gpu_name: str | None = None,
                          folder: Path = FOLDER) -> Path | None:
    """Set ``VLLM_TUNED_CONFIG_FOLDER`` to the shipped configs when they fit this process's GPU.

    Leaves the variable alone (and returns None) when the user set it, when
    ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``, when no GPU name is known, when the folder has no files for
    that GPU, or when a file fails `check_table` (logged: vLLM then uses its defaults).

    Args:
        environ: the environment to change (``os.environ`` by default).
        gpu_name: the GPU's name as CUDA reports it (default: `visible_gpu_name`).
        folder: where the tables are (default: this package's folder).

    Returns:
        The folder vLLM now reads, or None.
    """
    env = os.environ if environ is None else environ
    if VLLM_ENV in env or not kernel_configs_enabled():
        return None
    name = gpu_name if gpu_name is not None else visible_gpu_name()
    if not name:
        return None
    stem = file_stem(name)
    files = config_file_names(stem)
    if not all((folder / f).is_file() for f in files):
        logger.debug("no tuned LoRA kernel configs for %s in %s: vLLM uses its defaults", stem, folder)
        return None
    for fname in files:
        try:
            check_table(json.loads((folder / fname).read_text()), "shrink" if "SHRINK" in fname else "expand",
                        name=fname)
        except (OSError, ValueError) as exc:
            logger.warning("not using the tuned LoRA kernel configs in %s: %s", folder, exc)
            return None
    env[VLLM_ENV] = str(folder)
    logger.info("LoRA kernels: tuned configs for %s from %s (VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's defaults)",
                stem, folder)
    return folder
