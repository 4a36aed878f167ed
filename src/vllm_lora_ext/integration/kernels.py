"""The shrink/expand launchers' config lookup, reading the tuned tables shipped in `vllm_lora_ext.kernel_configs`.

vLLM's ``lora_shrink_op`` and ``lora_expand_op`` each call ``get_lora_op_configs`` (imported into their
own namespace) on every launch. The plugin replaces that name in those two modules only, so vLLM's
fused-MoE and fp8 LoRA kernels, which import it elsewhere, keep vLLM's own choice. The replacement
answers from the shipped table for this GPU, and hands the call to vLLM's lookup when:

- the user set ``VLLM_TUNED_CONFIG_FOLDER`` (their tables win) or ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``;
- vLLM runs batch-invariant (it never uses tuned configs then);
- no table ships for this GPU, a shipped table fails its checks (logged once), or it lacks the launch's
  ``num_slices``;
- the hidden size is smaller than any the table was tuned for (see `lookup_config`).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from vllm_lora_ext.constants import kernel_configs_enabled, vllm_tuned_config_folder_set
from vllm_lora_ext.errors import KernelConfigError
from vllm_lora_ext.integration._compat import cuda_device_name, lora_kernels_batch_invariant
from vllm_lora_ext.kernel_configs import file_stem, load_tables, lookup_config

logger = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def _tables() -> dict[str, dict[str, Any]] | None:
    name = cuda_device_name()
    if not name:
        return None
    try:
        tables = load_tables(file_stem(name))
    except KernelConfigError as exc:
        logger.warning("not using the shipped LoRA kernel configs: %s", exc)
        return None
    if tables is None:
        logger.info("no tuned LoRA kernel configs ship for %s: vLLM's defaults are used", name)
    else:
        logger.info("LoRA shrink/expand kernels use the tuned configs shipped for %s "
                    "(VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's defaults)", name)
    return tables


def tuned_config(op_type: str, max_loras: int, batch: int, hidden_size: int, rank: int, num_slices: int,
                 add_inputs: bool | None = None) -> dict[str, Any] | None:
    """Return the shipped config for one shrink/expand launch, or None where vLLM's lookup should answer."""
    if op_type not in ("shrink", "expand") or vllm_tuned_config_folder_set() or not kernel_configs_enabled():
        return None
    if lora_kernels_batch_invariant():
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
