"""vLLM's dual-stream LoRA turned on where the user left it unset, and one stream for a batch without an adapter
(`integration.dual_stream`), on vLLM's own classes: its ``TritonExperts.apply`` and
``BaseLinearLayerWithLoRA._apply_async_impl`` as patched by the registered plugin, its ``MoELoRAContext`` and its
``LoRAKernelMeta`` fed a batch's mapping. This machine has no CUDA, so the kernels themselves run in
``tests/gpu/test_dual_stream.py`` (HF + PEFT in fp32, both switch settings); here the path a forward takes is what
is checked, with the second stream a stand-in object that ``apply`` only passes on."""

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


@pytest.mark.parametrize(("env", "imported", "cuda", "switch"), [
    ({}, False, True, "1"),  # the default on a GPU: turned on
    ({"VLLM_LORA_ENABLE_DUAL_STREAM": "0"}, False, True, "0"),  # the user's word wins
    ({"VLLM_LORA_ENABLE_DUAL_STREAM": "1"}, False, True, "1"),
    ({"VLLM_LORA_EXT_DUAL_STREAM": "0"}, False, True, None),  # the plugin's switch off: vLLM's default
    ({}, True, True, None),  # dense LoRA layers imported already: a layer made now would lack the op
    ({}, False, False, None),  # no CUDA: vLLM's LoRAConfig would refuse the switch
])
def test_vllms_switch_is_turned_on_only_where_unset_and_safe(monkeypatch: pytest.MonkeyPatch, env: dict[str, str],
                                                            imported: bool, cuda: bool, switch: str | None) -> None:
    from vllm_lora_ext.integration._compat import BASE_LINEAR_LORA_MODULE
    from vllm_lora_ext.integration.dual_stream import turn_on_vllm_dual_stream

    import os

    for name in ("VLLM_LORA_EXT_DUAL_STREAM", "VLLM_LORA_ENABLE_DUAL_STREAM"):
        monkeypatch.setenv(name, "")  # so that monkeypatch puts back what was there after the code under test sets it
        monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    modules = {BASE_LINEAR_LORA_MODULE: object()} if imported else {}
    set_here = turn_on_vllm_dual_stream(modules, BASE_LINEAR_LORA_MODULE, lambda: cuda)
    assert os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM") == switch
    assert set_here == (not env and not imported and cuda)


def test_this_machines_platform_is_not_cuda_so_register_leaves_the_switch_unset() -> None:
    """The plugin registered on this CPU machine (every test above): vLLM's LoRAConfig would refuse the switch."""
    import os

    from vllm.config.lora import LoRAConfig

    from vllm_lora_ext.integration import plugin
    from vllm_lora_ext.integration.dual_stream import cuda_alike_platform

    plugin.register()
    assert not cuda_alike_platform()
    assert "VLLM_LORA_ENABLE_DUAL_STREAM" not in os.environ
    LoRAConfig(max_lora_rank=16, max_loras=2)  # accepted
