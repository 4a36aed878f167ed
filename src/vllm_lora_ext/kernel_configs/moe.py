"""Tuned configs for vLLM's fused-MoE LoRA kernels, shipped per GPU: file names, checks, loading, and fit.

vLLM (0.26-0.33) gives its fused-MoE LoRA launch (``add_lora_w13`` / ``add_lora_w2`` of the punica wrapper)
tile configs in one of two ways. A layer whose ``use_tuned_config`` is off (vLLM sets it only when
``VLLM_TUNED_CONFIG_FOLDER`` is set) derives them from the base MoE GEMM's config for the batch. A layer whose
flag is on reads four tables, one per op type: ``{gpu}_FUSED_MOE_LORA_W13_SHRINK.json``,
``{gpu}_FUSED_MOE_LORA_W13_EXPAND.json``, ``{gpu}_FUSED_MOE_LORA_W2_SHRINK.json`` and
``{gpu}_FUSED_MOE_LORA_W2_EXPAND.json``. Each is ``table[max_loras][num_slices][m][k][n][i] -> config``:
``max_loras`` is the engine's adapter slots (the dense tables' key is slots + 1), ``num_slices`` is 2 for a
gated w13 (gate and up), 1 for w2 and for vLLM's 3D-fused layer, ``m`` the batch's tokens, ``k`` the stacked
LoRA rank (``max_lora_rank``), ``n`` the hidden size and ``i`` the expert intermediate size. vLLM matches every
key but ``num_slices`` to the nearest one. A config uses vLLM's lower-case names: ``block_m``, ``block_n``,
``block_k``, ``group_size_m``, ``num_warps``, ``num_stages`` and, optionally, ``split_k``.

The format leaves one rule implicit. The w2 launch reuses the token alignment that the w13 launch made with its
shrink ``block_m``, so the four configs a layer reads in one step must share ``block_m``. vLLM's derived configs
do. A table set here holds ``block_m`` as a function of ``(max_loras, m, k)`` only, the same in all four tables
and for every ``num_slices``, ``n`` and ``i``, over the same keys (so the nearest-key lookups of one step land on
the same ``(max_loras, m, k)``); `check_moe_tables` checks this.

``bench/tune_moe_lora_kernels.py`` writes these files; the plugin's patches in ``integration/kernels.py`` let
vLLM read them where `moe_tables_fit` says they were tuned for the layer.

Example:
    >>> moe_config_file_names("NVIDIA_H200")[0]
    'NVIDIA_H200_FUSED_MOE_LORA_W13_SHRINK.json'
    >>> leaf = {"16": {"2048": {"768": {"block_m": 32, "block_n": 16, "block_k": 64, "group_size_m": 1,
    ...                                  "num_warps": 4, "num_stages": 3}}}}
    >>> tables = {op: {"4": {s: {"64": leaf} for s in MOE_SLICE_KEYS}} for op in MOE_OPS}
    >>> check_moe_tables(tables)
    >>> moe_tables_fit(tables, num_slices=2, rank=16, hidden=2048, intermediate=768)
    True
    >>> moe_tables_fit(tables, num_slices=2, rank=64, hidden=2048, intermediate=768)
    False
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from vllm_lora_ext.errors import KernelConfigError
from vllm_lora_ext.kernel_configs import FOLDER, check_levels, read_tables

__all__ = ["MOE_OPS", "MOE_SLICE_KEYS", "check_moe_table", "check_moe_tables", "load_moe_tables",
           "moe_config_file_names", "moe_tables_fit"]

# vLLM's op types, in the order of the files' names (``get_lora_op_configs``'s ``op_type``).
MOE_OPS = ("fused_moe_lora_w13_shrink", "fused_moe_lora_w13_expand", "fused_moe_lora_w2_shrink",
           "fused_moe_lora_w2_expand")
# The num_slices vLLM's fused-MoE LoRA layers look up (vLLM matches this key exactly).
MOE_SLICE_KEYS = ("1", "2")
# The keys vLLM's fused-MoE LoRA launch reads from a config (split_k has a default there).
_REQUIRED = ("block_m", "block_n", "block_k", "group_size_m", "num_warps", "num_stages")
_TUNER = "bench/tune_moe_lora_kernels.py"


def moe_config_file_names(stem: str) -> tuple[str, ...]:
    """Return the four file names vLLM looks for, in `MOE_OPS` order, for a GPU given by its ``file_stem``."""
    return tuple(f"{stem}_{op.upper()}.json" for op in MOE_OPS)


def check_moe_table(table: Any, *, name: str = "table") -> None:
    """Check that ``table`` is one fused-MoE table vLLM can read (six integer-keyed levels, then configs).

    Raises:
        [`KernelConfigError`]: a level is empty or keyed by something other than digits, a ``num_slices`` level
            lacks 1 or 2, or a config lacks a key vLLM's launch reads or holds a non-positive or non-integer value.
    """
    check_levels(table, depth=6, required=_REQUIRED, slice_keys=MOE_SLICE_KEYS, name=name, tuner=_TUNER)


def _leaves(table: Mapping[str, Any]) -> Iterator[tuple[tuple[str, str, str, str, str, str], Mapping[str, Any]]]:
    # ((max_loras, num_slices, m, k, n, i), config) for every config of a checked table
    for loras, by_slices in table.items():
        for slices, by_m in by_slices.items():
            for m, by_k in by_m.items():
                for k, by_n in by_k.items():
                    for n, by_i in by_n.items():
                        for i, config in by_i.items():
                            yield (loras, slices, m, k, n, i), config


def check_moe_tables(tables: Mapping[str, Any], *, stem: str = "") -> None:
    """Check a set of four fused-MoE tables, keyed by op type: each one, and the ``block_m`` rule between them.

    Raises:
        [`KernelConfigError`]: an op type of `MOE_OPS` is missing, a table fails `check_moe_table`, the tables
            differ in their ``(max_loras, num_slices, m, k)`` keys (or one ``num_slices`` level differs from the
            other under a ``max_loras``), or two configs of one ``(max_loras, m, k)`` differ in ``block_m``.
    """
    names = dict(zip(MOE_OPS, moe_config_file_names(stem or "{gpu}")))
    missing = [op for op in MOE_OPS if op not in tables]
    if missing:
        raise KernelConfigError(f"Fused-MoE LoRA kernel configs lack {missing}; vLLM reads all four. Re-run {_TUNER} "
                                f"or set VLLM_LORA_EXT_KERNEL_CONFIGS=0 to use vLLM's own choice.")
    keys: dict[str, set[tuple[str, str, str, str]]] = {}
    block_m: dict[tuple[str, str, str], tuple[int, str]] = {}
    for op in MOE_OPS:
        check_moe_table(tables[op], name=names[op])
        keys[op] = set()
        for (loras, slices, m, k, _, _), config in _leaves(tables[op]):
            keys[op].add((loras, slices, m, k))
            seen = block_m.setdefault((loras, m, k), (config["block_m"], names[op]))
            if seen[0] != config["block_m"]:
                raise _rule_broken(f"[{loras}][..][{m}][{k}] holds block_m {config['block_m']} in {names[op]} and "
                                   f"{seen[0]} in {seen[1]}")
    first = keys[MOE_OPS[0]]
    for op in MOE_OPS[1:]:
        if keys[op] != first:
            raise _rule_broken(f"{names[op]} and {names[MOE_OPS[0]]} have different keys "
                               f"(first: {sorted(keys[op] ^ first)[0]})")
    by_slices: dict[tuple[str, str], set[tuple[str, str]]] = {}
    for loras, slices, m, k in first:
        by_slices.setdefault((loras, slices), set()).add((m, k))
    for (loras, slices), mk in by_slices.items():
        if mk != by_slices[(loras, MOE_SLICE_KEYS[0])]:
            raise _rule_broken(f"[{loras}][{slices}] and [{loras}][{MOE_SLICE_KEYS[0]}] have different m or k keys")


def _rule_broken(what: str) -> KernelConfigError:
    return KernelConfigError(f"Fused-MoE LoRA kernel configs: {what}. The w2 launch reuses w13's token alignment, "
                             f"so one step's four configs must share block_m. Re-run {_TUNER} or set "
                             f"VLLM_LORA_EXT_KERNEL_CONFIGS=0 to use vLLM's own choice.")


def load_moe_tables(stem: str, folder: Path = FOLDER) -> dict[str, dict[str, Any]] | None:
    """Return this GPU's checked fused-MoE tables keyed by op type (`MOE_OPS`), or None if a file is missing.

    Raises:
        [`KernelConfigError`]: a file is not JSON, or the four fail `check_moe_tables`.
    """
    tables = read_tables(folder, dict(zip(MOE_OPS, moe_config_file_names(stem))),
                         what="Fused-MoE LoRA kernel config", fallback="vLLM's own choice")
    if tables is not None:
        check_moe_tables(tables, stem=stem)
    return tables


def moe_tables_fit(tables: Mapping[str, Any], *, num_slices: int, rank: int, hidden: int, intermediate: int) -> bool:
    """Return whether checked tables were tuned for a layer: vLLM's lookups for it then read tuned configs.

    True when every ``max_loras`` level has the layer's w13 ``num_slices``, the table holds the layer's hidden
    and intermediate sizes as keys (another model's shape would get a neighbour's configs through vLLM's
    nearest-key rule), and the layer's stacked rank is at most the largest rank tuned (vLLM runs another kernel
    for large ranks). Batch sizes and slot counts between the tuned ones take the nearest, as in vLLM.
    """
    table = tables[MOE_OPS[0]]
    if not all(str(num_slices) in by_slices for by_slices in table.values()):
        return False
    keys = [key for key, _ in _leaves(table)]
    return (rank <= max(int(k) for *_, k, _, _ in keys) and hidden in {int(n) for *_, n, _ in keys}
            and intermediate in {int(i) for *_, i in keys})
