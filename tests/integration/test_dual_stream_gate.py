"""Under vLLM's dual-stream LoRA, one stream for a batch without an adapter (`integration.dual_stream`), on vLLM's
own classes: its ``TritonExperts.apply``, ``BaseLinearLayerWithLoRA._apply_async_impl`` and
``Worker.determine_available_memory`` as patched by the registered plugin, its ``MoELoRAContext`` and its
``LoRAKernelMeta`` fed a batch's mapping. This machine has no CUDA, so the kernels themselves run in
``tests/gpu/test_dual_stream.py`` (HF + PEFT in fp32); here the path a forward takes is what is checked, with the
second stream a stand-in object that ``apply`` only passes on."""

from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm


def _context(stream: Any, meta: Any) -> Any:
    from types import SimpleNamespace

    from vllm.model_executor.layers.fused_moe.experts.lora_context import MoELoRAContext

    empty = (torch.zeros(1),)
    return MoELoRAContext(w13_lora_a_stacked=empty, w13_lora_b_stacked=empty, w2_lora_a_stacked=empty,
                          w2_lora_b_stacked=empty, adapter_enabled=torch.zeros(3, dtype=torch.int32), max_loras=2,
                          top_k=2, w13_num_slices=2, fully_sharded=False, tp_rank=0, tp_size=1, local_num_experts=4,
                          punica_wrapper=SimpleNamespace(token_mapping_meta=meta), use_tuned_config=False,
                          aux_stream=stream, events=None)


def _meta(mapping: list[int]) -> Any:
    from vllm.lora.ops.triton_ops.lora_kernel_metadata import LoRAKernelMeta

    meta = LoRAKernelMeta.make(2, 64, device="cpu")
    meta.prepare_tensors(torch.tensor(mapping))
    return meta


@pytest.fixture
def experts() -> Any:
    """vLLM's TritonExperts with the plugin registered, its ``apply`` original replaced by a recorder of the stream
    its context names when called (the original needs CUDA)."""
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.dual_stream import make_experts_apply
    from vllm_lora_ext.integration.patching import PATCH_MARK

    plugin.register()
    assert getattr(TritonExperts.apply, PATCH_MARK, False)
    seen: list[Any] = []

    def original(self: Any, *args: Any, **kwargs: Any) -> str:
        seen.append(self._lora_context.aux_stream)
        if kwargs.get("fail"):
            raise RuntimeError("kernel failed")
        return "out"

    instance = TritonExperts.__new__(TritonExperts)
    instance.seen = seen
    instance.apply = make_experts_apply(original).__get__(instance)
    return instance


@pytest.mark.parametrize("mapping", [[-1, -1, -1], [-1]])
def test_a_batch_without_an_adapter_runs_on_one_stream_and_the_context_keeps_its_second(experts: Any,
                                                                                       mapping: list[int]) -> None:
    stream = object()
    experts._lora_context = _context(stream, _meta(mapping))
    assert experts.apply(1, 2) == "out"
    assert experts.seen == [None]  # vLLM's one-stream schedule for this batch
    assert experts._lora_context.aux_stream is stream  # the next batch may have adapters


@pytest.mark.parametrize("mapping", [[-1, 0, -1], [1, 1], [0]])
def test_a_batch_with_any_adapter_keeps_the_second_stream(experts: Any, mapping: list[int]) -> None:
    stream = object()
    experts._lora_context = _context(stream, _meta(mapping))
    experts.apply()
    assert experts.seen == [stream]


def test_a_failing_apply_still_gives_the_context_its_stream_back(experts: Any) -> None:
    stream = object()
    experts._lora_context = _context(stream, _meta([-1, -1]))
    with pytest.raises(RuntimeError, match="kernel failed"):
        experts.apply(fail=True)
    assert experts.seen == [None] and experts._lora_context.aux_stream is stream


def test_without_a_second_stream_or_a_context_apply_is_vllms(experts: Any) -> None:
    experts._lora_context = _context(None, _meta([-1]))
    experts.apply()
    experts._lora_context = None
    with pytest.raises(AttributeError):  # the recorder reads the context: vLLM's apply was called as is
        experts.apply()
    assert experts.seen == [None]


def test_a_dense_layers_batch_without_an_adapter_takes_its_one_stream_path() -> None:
    from types import SimpleNamespace

    from vllm.lora.layers.base_linear import BaseLinearLayerWithLoRA

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.dual_stream import make_apply_async_impl
    from vllm_lora_ext.integration.patching import PATCH_MARK

    plugin.register()
    assert getattr(BaseLinearLayerWithLoRA._apply_async_impl, PATCH_MARK, False)
    calls: list[tuple[str, Any, Any]] = []
    layer = BaseLinearLayerWithLoRA.__new__(BaseLinearLayerWithLoRA)
    torch.nn.Module.__init__(layer)
    layer._apply_sync = lambda x, bias=None: calls.append(("one stream", x, bias)) or "sync"
    impl = make_apply_async_impl(lambda self, x, bias=None: calls.append(("two streams", x, bias)) or "async")
    for mapping, expected in (([-1, -1], "sync"), ([-1, 1], "async"), ([0], "async"), ([-1], "sync")):
        layer.punica_wrapper = SimpleNamespace(token_mapping_meta=_meta(mapping))
        assert impl(layer, "x", "b") == expected
    layer.punica_wrapper = None  # no mapping known: vLLM's
    assert impl(layer, "x") == "async"
    assert [c[0] for c in calls] == ["one stream", "two streams", "two streams", "one stream", "two streams"]
    assert calls[0][1:] == ("x", "b") and calls[-1][1:] == ("x", None)


def test_the_memory_profile_run_keeps_vllms_two_stream_path() -> None:
    """vLLM's profile run has no adapter: on one stream it would leave the second stream's delta buffers out of the
    peak the KV cache is sized from."""
    from types import SimpleNamespace

    from vllm.v1.worker.gpu_worker import Worker

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.dual_stream import make_apply_async_impl, make_determine_available_memory
    from vllm_lora_ext.integration.patching import PATCH_MARK

    plugin.register()
    assert getattr(Worker.determine_available_memory, PATCH_MARK, False)
    layer = SimpleNamespace(punica_wrapper=SimpleNamespace(token_mapping_meta=_meta([-1, -1])),
                            _apply_sync=lambda x, bias=None: "sync")
    impl = make_apply_async_impl(lambda self, x, bias=None: "async")
    seen: list[str] = []

    def profile(self: Any) -> int:
        seen.append(impl(layer, "x"))
        raise MemoryError("profile failed")

    with pytest.raises(MemoryError):
        make_determine_available_memory(profile)(object())
    assert seen == ["async"]
    assert impl(layer, "x") == "sync"  # after the profile, failed or not: one stream again
