"""The LoRA kernels' config lookups, reading the tuned tables shipped in `vllm_lora_ext.kernel_configs`.

Shrink/expand: vLLM's ``lora_shrink_op`` and ``lora_expand_op`` each call ``get_lora_op_configs`` (imported
into their own namespace) on every launch. The plugin replaces that name in those two modules only, so vLLM's
fused-MoE and fp8 LoRA kernels, which import it elsewhere, do not go through it. The replacement answers from
the shipped table for this GPU, and hands the call to vLLM's lookup when:

- the user set ``VLLM_TUNED_CONFIG_FOLDER`` (their tables win) or ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``;
- vLLM runs batch-invariant (it never uses tuned configs then);
- no table ships for this GPU, a shipped table fails its checks (logged once), or it lacks the launch's
  ``num_slices``;
- the hidden size is smaller than any the table was tuned for (see `lookup_config`).

Fused MoE: a fused-MoE LoRA layer reads tuned tables only when its context's ``use_tuned_config`` is set, which
vLLM derives from ``VLLM_TUNED_CONFIG_FOLDER`` when the layer builds the context (``_build_lora_context``);
otherwise it derives its tile configs from the base MoE GEMM's. Where the four fused-MoE tables ship for this
GPU (`kernel_configs.moe`) and fit the layer (`moe_tables_fit`: its hidden and intermediate sizes tuned, its
rank at most the largest tuned, w13's ``num_slices`` present) and the layer is not fully sharded, the context
gets ``use_tuned_config`` set, and vLLM's ``load_lora_op_config`` answers the four fused-MoE op types from the
shipped tables: vLLM's own ``get_lora_op_configs`` then reads them with its nearest-key rule. Under the same
conditions as above (a user's folder, ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``, batch-invariant mode, no valid
table), both leave vLLM's behaviour as it is.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm_lora_ext.constants import kernel_configs_enabled, vllm_tuned_config_folder_set
from vllm_lora_ext.errors import KernelConfigError
from vllm_lora_ext.integration._compat import (
    cuda_device_name,
    lora_kernels_batch_invariant,
    moe_lora_layer_shape,
    with_tuned_moe_configs,
)
from vllm_lora_ext.kernel_configs import file_stem, load_tables, lookup_config
from vllm_lora_ext.kernel_configs.moe import MOE_OPS, load_moe_tables, moe_tables_fit

logger = logging.getLogger(__name__)


def _shipped(load: Callable[[str], Any], what: str, *, used: str, none: str | None) -> Any:
    """This GPU's tables from ``load`` (given its file stem), or None without a GPU, without tables or where they fail
    their checks (a warning naming ``what``); logs ``used`` (or ``none``) with the GPU's name."""
    name = cuda_device_name()
    if not name:
        return None
    try:
        tables = load(file_stem(name))
    except KernelConfigError as exc:
        logger.warning("not using the shipped %s: %s", what, exc)
        return None
    if tables is not None or none is not None:
        logger.info(used if tables is not None else none, name)
    return tables


@functools.lru_cache(maxsize=1)
def _tables() -> dict[str, dict[str, Any]] | None:
    return _shipped(load_tables, "LoRA kernel configs", none="no tuned LoRA kernel configs ship for %s: vLLM's "
                    "defaults are used", used="LoRA shrink/expand kernels use the tuned configs shipped for %s "
                    "(VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's defaults)")


def _left_to_vllm() -> bool:
    """Whether vLLM's own kernel configs stand whatever ships: the user's ``VLLM_TUNED_CONFIG_FOLDER``,
    ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``, or batch-invariant mode (where vLLM never reads tuned configs)."""
    return vllm_tuned_config_folder_set() or not kernel_configs_enabled() or lora_kernels_batch_invariant()


def tuned_config(op_type: str, max_loras: int, batch: int, hidden_size: int, rank: int, num_slices: int,
                 add_inputs: bool | None = None) -> dict[str, Any] | None:
    """Return the shipped config for one shrink/expand launch, or None where vLLM's lookup should answer."""
    if op_type not in ("shrink", "expand") or _left_to_vllm():
        return None
    tables = _tables()
    if tables is None:
        return None
    if op_type == "shrink":
        return lookup_config(tables["shrink"], max_loras=max_loras, num_slices=num_slices, m=batch, k=hidden_size,
                             n=rank, hidden="k")
    return lookup_config(tables["expand_true" if add_inputs else "expand_false"], max_loras=max_loras,
                         num_slices=num_slices, m=batch, k=rank, n=hidden_size, hidden="n")


def make_get_lora_op_configs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.lru_cache(maxsize=4096)
    def get_lora_op_configs(op_type: str, max_loras: int, batch: int, hidden_size: int, rank: int,
                            num_slices: int, add_inputs: bool | None = None,
                            moe_intermediate_size: int | None = None) -> Any:
        config = tuned_config(op_type, max_loras, batch, hidden_size, rank, num_slices, add_inputs)
        if config is not None:
            return config
        return original(op_type, max_loras, batch, hidden_size, rank, num_slices, add_inputs, moe_intermediate_size)

    return get_lora_op_configs


@functools.lru_cache(maxsize=1)
def _moe_tables() -> dict[str, dict[str, Any]] | None:
    return _shipped(load_moe_tables, "fused-MoE LoRA kernel configs", none=None,
                    used="fused-MoE LoRA kernels use the tuned configs shipped for %s where they fit the layer "
                         "(VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's own choice)")


def _shipped_moe_tables() -> dict[str, dict[str, Any]] | None:
    """The shipped fused-MoE tables, or None where vLLM's own choice should stand."""
    return None if _left_to_vllm() else _moe_tables()


def tuned_moe_context(context: Any) -> Any:
    """Return ``context`` (a fused-MoE layer's ``MoELoRAContext``) set to read tuned tables where the shipped
    ones fit its layer, else ``context`` itself."""
    shape = moe_lora_layer_shape(context)
    if shape is None or shape.tuned or shape.fully_sharded:
        return context
    tables = _shipped_moe_tables()
    if tables is None or not moe_tables_fit(tables, num_slices=shape.w13_slices, rank=shape.rank,
                                            hidden=shape.hidden, intermediate=shape.intermediate):
        return context
    return with_tuned_moe_configs(context)


def make_build_lora_context(original: Callable[..., Any]) -> Callable[..., Any]:
    def _build_lora_context(self: Any) -> Any:
        return tuned_moe_context(original(self))

    return _build_lora_context


def make_load_lora_op_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``get_lora_op_configs`` calls ``load_lora_op_config`` by its module name on every cache miss: the
    four fused-MoE op types get the shipped table, every other op type (and any case `_shipped_moe_tables` turns
    down) vLLM's loader, whose cache ``cache_clear`` still clears."""

    def load_lora_op_config(op_type: str, add_inputs: bool | None) -> Any:
        if op_type in MOE_OPS:
            tables = _shipped_moe_tables()
            if tables is not None:
                return tables[op_type]
        return original(op_type, add_inputs)

    load_lora_op_config.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    return load_lora_op_config
