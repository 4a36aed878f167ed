"""vLLM's dual-stream LoRA, on by default, and one stream for a batch without an adapter (issue 39 item 1).

vLLM 0.26-0.33 can run each LoRA layer's kernels on a second CUDA stream beside its base GEMM
(``VLLM_LORA_ENABLE_DUAL_STREAM=1``, off by default there): a dense layer's shrink and expand, with programmatic
dependent launch, and a fused-MoE layer's w13 and w2 LoRA, each into a zeroed delta buffer that is added after the
join. It also zeroes, forks, joins and adds in batches where no token has an adapter, which launch no LoRA kernel:
3-8% slower no-adapter batches in r42. On the 30B-A3B shape with 32 requests decoding (one H200,
``bench_moe_decode.py``), with those batches on one stream as below, it shortened one adapter's decode step by
1.3-1.5% in r44's two runs (r42: 6%) and cost the no-adapter batches nothing measurable; a second stream for the
fused-MoE layers alone gained nothing (r44's trial, not shipped).

Here:
- [`turn_on_vllm_dual_stream`] (from ``register()``) sets ``VLLM_LORA_ENABLE_DUAL_STREAM=1`` where the user left it
  unset, unless ``VLLM_LORA_EXT_DUAL_STREAM=0`` or the platform is not CUDA-alike (vLLM's ``LoRAConfig`` refuses the
  switch there). A process that has already imported vLLM's dense LoRA layers is left as it is: they register the
  dual-stream op at import, and a layer made with the switch on needs it. Engine processes start after the API
  server or ``LLM`` process has set it, and inherit it. With ``fully_sharded_loras`` vLLM logs that the two do not
  go together and turns the switch off in the process that builds the config; its fully sharded layers never fork.
- [`make_apply_async_impl`] (dense) and [`make_experts_apply`] (fused MoE) run a batch where no token has an adapter
  on one stream, by vLLM's host-side flag for it (``no_lora_flag_cpu``, set from the batch's mapping before the
  forward), the flag its own dense LoRA kernels return on without launching. Under CUDA graphs the flag is read at
  capture: vLLM captures batches with and without adapters as different graphs (``BatchDescriptor.has_lora``), and a
  graph captured without them already lacks the dense LoRA kernels, so this adds no new assumption. Such a batch's
  output is the one-stream path's, which is vLLM's path with the switch off.

``tests/gpu/test_dual_stream.py`` compares an engine under it (torch.compile, CUDA graphs) with HF + PEFT.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Mapping
from typing import Any

from vllm_lora_ext.constants import VLLM_DUAL_STREAM_ENV, dual_stream, export_vllm_dual_stream, vllm_dual_stream_set

__all__ = ["cuda_alike_platform", "make_apply_async_impl", "make_experts_apply", "turn_on_vllm_dual_stream"]

logger = logging.getLogger(__name__)


def cuda_alike_platform() -> bool:
    """Whether vLLM's platform in this process is CUDA or ROCm (resolved without touching a device)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike())


def turn_on_vllm_dual_stream(modules: Mapping[str, Any], base_linear_module: str,
                             cuda_alike: Callable[[], bool] = cuda_alike_platform) -> bool:
    """Set vLLM's switch where the module docstring says (``modules``: this process's imported modules); return
    whether it was set here."""
    if not dual_stream() or vllm_dual_stream_set() or not cuda_alike():
        return False
    if base_linear_module in modules:
        logger.info("vLLM's dense LoRA layers were imported before the plugin registered: %s left unset here",
                    VLLM_DUAL_STREAM_ENV)
        return False
    export_vllm_dual_stream()
    return True


def _no_adapter_in_batch(punica_wrapper: Any) -> bool:
    """Whether vLLM's mapping of the batch being run has no token with an adapter (its ``no_lora_flag_cpu``);
    ``False`` where the flag is not there."""
    meta = getattr(punica_wrapper, "token_mapping_meta", None)
    flag = getattr(meta, "no_lora_flag_cpu", None)
    return bool(flag is not None and flag[0])


def make_apply_async_impl(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch ``BaseLinearLayerWithLoRA._apply_async_impl`` (the dense layer's two-stream forward, run inside vLLM's
    ``lora_linear_async`` op): a batch without an adapter takes the layer's one-stream ``_apply_sync``."""

    @functools.wraps(original)
    def _apply_async_impl(self: Any, x: Any, bias: Any = None) -> Any:
        if _no_adapter_in_batch(getattr(self, "punica_wrapper", None)):
            return self._apply_sync(x, bias)
        return original(self, x, bias)

    return _apply_async_impl


def make_experts_apply(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch ``TritonExperts.apply``: a batch without an adapter runs with its layer's context on one stream (the
    rest of the context, which vLLM's modular kernel sets for the forward, is the layer's own object)."""

    @functools.wraps(original)
    def apply(self: Any, *args: Any, **kwargs: Any) -> Any:
        context = getattr(self, "_lora_context", None)
        stream = getattr(context, "aux_stream", None)
        if stream is None or not _no_adapter_in_batch(context.punica_wrapper):
            return original(self, *args, **kwargs)
        context.aux_stream = None
        try:
            return original(self, *args, **kwargs)
        finally:
            context.aux_stream = stream

    return apply
