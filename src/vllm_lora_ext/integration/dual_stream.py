"""Under vLLM's dual-stream LoRA, a batch without an adapter on one stream (issue 39 item 1).

vLLM 0.26-0.33 can run each LoRA layer's kernels on a second CUDA stream beside its base GEMM
(``VLLM_LORA_ENABLE_DUAL_STREAM=1``, off by default there, and the plugin leaves it to the user): a dense layer's
shrink and expand, with programmatic dependent launch, and a fused-MoE layer's w13 and w2 LoRA, each into a zeroed
delta buffer that is added after the join. It also zeroes, forks, joins and adds in batches where no token has an
adapter, which launch no LoRA kernel: 3-8% slower no-adapter batches in r42 (one H200, ``bench_moe_decode.py``).

[`make_apply_async_impl`] (dense) and [`make_experts_apply`] (fused MoE) run such a batch on one stream, by vLLM's
host-side flag for it (``no_lora_flag_cpu``, set from the batch's mapping before the forward), the flag its own LoRA
kernels return on without launching; its output is the one-stream path's, vLLM's with the switch off. Under CUDA
graphs the flag is read at capture. With ``cudagraph_specialize_lora`` (vLLM's default) batches with and without
adapters are different graphs (``BatchDescriptor.has_lora``), and a graph captured without them already lacks vLLM's
own LoRA kernels; without it, vLLM captures only graphs with adapters, and batches without one run eagerly. So this
adds no new assumption. [`make_determine_available_memory`] keeps vLLM's memory profile run (which has no adapter)
on the two-stream path, so that the delta buffers of batches with adapters still count in the peak the KV cache is
sized from.

In r44 (same bench, with this) the switch cost the no-adapter batches nothing measurable and shortened one
adapter's step by 1.3-1.5% in the medians of two runs, inside the spread of their reps (about ±3%); a second stream
for the fused-MoE layers alone gained nothing. Dense models and prefill were not measured, so the switch stays the
user's.
``tests/gpu/test_dual_stream.py`` compares an engine under it (torch.compile, CUDA graphs) with HF (+ PEFT).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

__all__ = ["make_apply_async_impl", "make_determine_available_memory", "make_experts_apply"]

_PROFILING: list[bool] = []  # non-empty while vLLM's worker profiles its memory (its profile run has no adapter)


def make_determine_available_memory(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch ``Worker.determine_available_memory``: its profile run takes vLLM's two-stream path (above)."""

    @functools.wraps(original)
    def determine_available_memory(self: Any, *args: Any, **kwargs: Any) -> Any:
        _PROFILING.append(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _PROFILING.pop()

    return determine_available_memory


def _no_adapter_in_batch(punica_wrapper: Any) -> bool:
    """Whether vLLM's mapping of the batch being run has no token with an adapter (its ``no_lora_flag_cpu``);
    ``False`` where the flag is not there, and while the worker profiles its memory."""
    if _PROFILING:
        return False
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
    """Patch ``TritonExperts.apply`` (run inside vLLM's ``moe_forward`` op): a batch without an adapter runs with its
    layer's context on one stream (the rest of the context, which vLLM's modular kernel sets for the forward, is the
    layer's own object)."""

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
