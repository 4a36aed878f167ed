"""Tuned configs for vLLM's multi-LoRA Triton kernels (shrink and expand), shipped per GPU.

vLLM picks the block sizes, split-K and warps of its LoRA kernels from a default that ignores the GPU
and the number of adapters in the batch. Its own way to change that is ``VLLM_TUNED_CONFIG_FOLDER``,
a folder of ``{gpu}_SHRINK.json`` and ``{gpu}_EXPAND_{TRUE,FALSE}.json`` tables, ``{gpu}`` being
``torch.cuda.get_device_name()`` with spaces and dashes turned into underscores (``NVIDIA_H200``).
Each table is ``[max_loras + 1][num_slices][m][k][n] -> config``, read with the nearest key at every
level except ``num_slices``. Setting that variable has a side effect, though: vLLM's fused-MoE LoRA
layers then stop using their own shape-based config choice and look for fused-MoE tables instead.

So the plugin does not set it. This folder holds tables in vLLM's format (written by
``bench/tune_lora_kernels.py``, which also records per shape vLLM's default time and the tuned one),
and the plugin's patch of the shrink/expand launchers' config lookup reads them with `lookup_config`,
which follows vLLM's nearest-key rule (a test compares the two on every shipped table). Everything
else (fp8, a user's own ``VLLM_TUNED_CONFIG_FOLDER``, batch-invariant mode) goes to vLLM's lookup
unchanged. The fused-MoE LoRA kernels have tables of their own, described in `kernel_configs.moe`.

Example:
    >>> file_stem("NVIDIA H100 80GB HBM3")
    'NVIDIA_H100_80GB_HBM3'
    >>> config_file_names("NVIDIA_H200")
    ('NVIDIA_H200_SHRINK.json', 'NVIDIA_H200_EXPAND_TRUE.json', 'NVIDIA_H200_EXPAND_FALSE.json')
    >>> table = {"33": {"1": {"16": {"2048": {"16": {"block_m": 16}}}, "64": {"2048": {"16": {"block_m": 32}}}}}}
    >>> lookup_config(table, max_loras=65, num_slices=1, m=50, k=4096, n=8)
    {'block_m': 32}
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from vllm_lora_ext.errors import KernelConfigError

__all__ = ["FOLDER", "SLICE_KEYS", "check_levels", "check_table", "config_file_names", "file_stem", "load_tables",
           "lookup_config", "read_tables"]

FOLDER = Path(__file__).resolve().parent
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


def _is_int_key(key: object) -> bool:
    return isinstance(key, str) and key.isdigit()


def check_table(table: Any, op: str, *, name: str = "table") -> None:
    """Check that ``table`` is a config table vLLM can read for ``op`` (``"shrink"`` or ``"expand"``).

    Raises:
        [`KernelConfigError`]: a level is empty or keyed by something other than digits, a ``num_slices``
            level lacks one of 1..16, or a config lacks a key vLLM's launcher reads or holds a
            non-positive or non-integer value.
    """
    check_levels(table, depth=5, required=_REQUIRED[op], slice_keys=SLICE_KEYS, name=name,
                 tuner="bench/tune_lora_kernels.py")


def check_levels(table: Any, *, depth: int, required: Sequence[str], slice_keys: Sequence[str], name: str,
                 tuner: str) -> None:
    """Check a nested table of ``depth`` integer-keyed levels, ``num_slices`` second, configs at the bottom.

    Every level is a non-empty object keyed by digits; each ``num_slices`` level holds every key of
    ``slice_keys`` (vLLM matches that key exactly); each config holds every key of ``required`` as a positive
    integer. The error names the file (``name``), the path to the bad level and the tuner that writes the file.

    Raises:
        [`KernelConfigError`]: the first level or config that breaks one of these rules.
    """

    def fail(path: list[str], what: str) -> KernelConfigError:
        where = "][".join(path)
        return KernelConfigError(f"LoRA kernel config {name}[{where}]: {what}. Re-run {tuner} "
                                 f"or set VLLM_LORA_EXT_KERNEL_CONFIGS=0 to use vLLM's defaults.")

    def level(node: Any, path: list[str], at: int) -> None:
        if at == depth:
            if not isinstance(node, Mapping):
                raise fail(path, "is not a config object")
            for key in required:
                value = node.get(key)
                if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                    raise fail(path, f"{key} is {value!r}; it must be a positive integer")
            return
        if not isinstance(node, Mapping) or not node or not all(_is_int_key(k) for k in node):
            raise fail(path, "must be a non-empty object keyed by integers")
        if at == 1:
            missing = [s for s in slice_keys if s not in node]
            if missing:
                raise fail(path, f"has no num_slices {', '.join(missing)} (vLLM needs each exactly)")
        for key, child in node.items():
            level(child, path + [key], at + 1)

    level(table, [], 0)


def _nearest(level: Mapping[str, Any], value: int) -> Any:
    # vLLM's rule: the exact key, else the key nearest in value (the first of a tie, in the table's order).
    exact = level.get(str(value))
    return exact if exact else level[min(level.keys(), key=lambda key: abs(int(key) - value))]


def lookup_config(table: Mapping[str, Any], *, max_loras: int, num_slices: int, m: int, k: int,
                  n: int, hidden: Literal["k", "n"] | None = None) -> dict[str, Any] | None:
    """Return the config vLLM would read from ``table`` for this launch, or None if ``num_slices`` is absent.

    ``max_loras`` is what vLLM's launcher passes (slots + 1); (k, n) is (hidden, rank) for shrink and
    (rank, largest slice) for expand. vLLM would fail on a missing ``num_slices``; here the caller
    falls back to vLLM's own lookup instead.

    With ``hidden`` naming which of k and n is the model's hidden size, a hidden size smaller than every
    one the table holds also gives None, where vLLM's nearest-key rule would stretch a config tuned for
    wider rows to it. The shipped tables start at 2048. A split-K shrink config tuned there spreads a short
    row over several splits that add into the output atomically, in no fixed order. vLLM's default leaves a
    row of up to 256 to one split, so its results are bitwise reproducible, and those of the small models
    in tests stay so too.
    """
    per_slices = _nearest(table, max_loras)
    level = per_slices.get(str(num_slices))
    if not level:
        return None
    by_k = _nearest(level, m)
    if hidden == "k" and k < min(int(key) for key in by_k):
        return None
    by_n = _nearest(by_k, k)
    if hidden == "n" and n < min(int(key) for key in by_n):
        return None
    return dict(_nearest(by_n, n))


def load_tables(stem: str, folder: Path = FOLDER) -> dict[str, dict[str, Any]] | None:
    """Return this GPU's checked tables keyed ``"shrink"``, ``"expand_true"``, ``"expand_false"``, or None.

    None when the folder lacks one of the three files.

    Raises:
        [`KernelConfigError`]: a file is not JSON or fails `check_table`.
    """
    names = dict(zip(("shrink", "expand_true", "expand_false"), config_file_names(stem)))
    tables = read_tables(folder, names, what="LoRA kernel config", fallback="vLLM's defaults")
    if tables is not None:
        for key, name in names.items():
            check_table(tables[key], "shrink" if key == "shrink" else "expand", name=name)
    return tables


def read_tables(folder: Path, names: Mapping[str, str], *, what: str, fallback: str) -> dict[str, Any] | None:
    """Read the JSON file ``names[key]`` of ``folder`` for each key, unchecked; None if one of them is missing.

    Raises:
        [`KernelConfigError`]: a file cannot be read or is not JSON (names ``what`` and the file, and the switch
            that falls back to ``fallback``).
    """
    if not all((folder / name).is_file() for name in names.values()):
        return None
    tables: dict[str, Any] = {}
    for key, name in names.items():
        try:
            tables[key] = json.loads((folder / name).read_text())
        except (OSError, ValueError) as exc:
            raise KernelConfigError(f"{what} {name} cannot be read: {exc}. Reinstall vllm-lora-ext or set "
                                    f"VLLM_LORA_EXT_KERNEL_CONFIGS=0 to use {fallback}.") from exc
    return tables
