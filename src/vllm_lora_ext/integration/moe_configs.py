"""Tile configs for vLLM's Triton WNA16 MoE kernel when LoRA is on (int4/int8 weight-only MoE bases).

With LoRA enabled, vLLM runs a compressed-tensors int4/int8 weight-only MoE block whose shapes Marlin cannot take
with ``TritonWNA16Experts`` (``select_gemm_impl``), which always calls the Triton ``fused_moe_kernel_gptq_awq``.
Its tile config comes from ``try_get_optimal_moe_config``, whose default for small batches of 4-bit weights
(``should_moe_wna16_use_cuda``) is the CUDA kernel's config: no ``GROUP_SIZE_M``, and ``BLOCK_SIZE_M`` below 16.
The Triton launch then fails (``missing 1 required positional argument: 'GROUP_SIZE_M'``) and the engine dies at
start-up or at its first small batch (vLLM 0.26–0.33). The replacement gives those configs the Triton defaults
vLLM itself uses for the same dtype when the CUDA kernel is not chosen. Configs that already carry
``GROUP_SIZE_M`` (every other dtype, tuned files) pass through unchanged.

The engine then runs; an adapter with expert weights on such a base is still refused (``unapplied``: the kernel
never reads the LoRA context), while attention-only adapters are served.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

__all__ = ["make_try_get_optimal_moe_config", "triton_wna16_config"]

_WNA16 = ("int4_w4a16", "int8_w8a16")


def triton_wna16_config(config: dict[str, Any], m: int) -> dict[str, Any]:
    """``config`` completed for the Triton WNA16 kernel: ``BLOCK_SIZE_M`` by batch size as vLLM's Triton default
    (16 up to 20 tokens, 32 up to 40, else 64) and ``GROUP_SIZE_M`` 1; a config that has ``GROUP_SIZE_M`` is
    returned as it is."""
    if "GROUP_SIZE_M" in config:
        return config
    block_m = 16 if m <= 20 else 32 if m <= 40 else 64
    return {**config, "BLOCK_SIZE_M": block_m, "GROUP_SIZE_M": 1, "SPLIT_K": config.get("SPLIT_K", 1)}


def make_try_get_optimal_moe_config(original: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    """Called for every MoE layer of every eager step: the dtype is read from where vLLM passes it (positional
    ``(w1_shape, w2_shape, top_k, dtype, M, ...)`` or by keyword) without binding the signature, and the
    config of any other dtype is returned as it is."""
    names = list(inspect.signature(original).parameters)
    at_dtype, at_m = names.index("dtype"), names.index("M")

    @functools.wraps(original)
    def try_get_optimal_moe_config(*args: Any, **kwargs: Any) -> dict[str, Any]:
        config = original(*args, **kwargs)
        dtype = args[at_dtype] if len(args) > at_dtype else kwargs.get("dtype")
        if dtype not in _WNA16:
            return config
        return triton_wna16_config(config, int(args[at_m] if len(args) > at_m else kwargs["M"]))

    return try_get_optimal_moe_config
