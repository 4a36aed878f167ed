"""vLLM's merge run over only the packed modules an adapter has parts of (``worker_patches._parts_only``) gives the
model vLLM's merge over every packed module gives, with a few hundred lookups instead of 18,576.

The manager is vLLM's ``LRUCacheLoRAModelManager`` made with ``object.__new__`` (its constructor needs a model on a
GPU) with the fields its merge reads: the Qwen3-30B-A3B shape's packed modules (48 layers, 128 per-expert parts of
each experts block, q/k/v). Everything the merge runs is vLLM's code; the plugin only chooses the packed modules it
is shown.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from moe_factories import merge_adapter, merge_manager

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("no_pin_memory")]

LAYERS, EXPERTS = 48, 128


def _manager(**fields: Any) -> Any:
    return merge_manager(LAYERS, EXPERTS, **fields)


def _adapter(**spec: Any) -> Any:
    return merge_adapter(LAYERS, EXPERTS, **spec)


def _state(model: Any) -> dict[str, Any]:
    """Each module's class and factors (lists of tensors, ``None`` kept), for an exact comparison."""
    out: dict[str, Any] = {}
    for name, w in model.loras.items():
        factors = []
        for attr in ("lora_a", "lora_b"):
            value = getattr(w, attr)
            factors.append([None if t is None else t.clone() for t in value] if isinstance(value, list)
                           else value.clone())
        out[name] = (type(w).__name__, factors, getattr(w, "scaling", None))
    return out


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    def eq(x: Any, y: Any) -> bool:
        if isinstance(x, list):
            return isinstance(y, list) and len(x) == len(y) and all(eq(p, q) for p, q in zip(x, y))
        if x is None or y is None:
            return x is y
        return isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)

    return list(a) == list(b) and all(a[k][0] == b[k][0] and a[k][2] == b[k][2] and eq(a[k][1], b[k][1]) for k in a)


def _merged(manager: Any, model: Any, *, narrowed: bool) -> tuple[dict[str, Any], int]:
    """The model after vLLM's merge (over every packed module, or narrowed) and the part lookups it made."""
    from vllm.lora.model_manager import LoRAModelManager

    from vllm_lora_ext.integration.worker_patches import _parts_only

    real = LoRAModelManager._create_merged_loras_inplace
    real = getattr(real, "__wrapped__", real)  # vLLM's own, whether or not the plugin's patch is installed
    calls = [0]
    lookup = manager._get_lora_layer_weights

    def counted(lora_model: Any, name: str) -> Any:
        calls[0] += 1
        return lookup(lora_model, name)

    manager._get_lora_layer_weights = counted
    try:
        real(_parts_only(manager, model) if narrowed else manager, model)
    finally:
        del manager._get_lora_layer_weights
    return _state(model), calls[0]


@pytest.mark.parametrize("case", ["prepacked", "per_expert_parts", "q_and_v_only"])
def test_the_merge_over_the_adapters_packed_modules_equals_vllms_over_all(case: str) -> None:
    spec = {"prepacked": {}, "per_expert_parts": {"per_expert_layers": (0, 47)}, "q_and_v_only": {"qkv": "qv"}}[case]
    manager = _manager()
    want, all_calls = _merged(manager, _adapter(**spec), narrowed=False)
    got, few_calls = _merged(manager, _adapter(**spec), narrowed=True)
    assert _same(got, want)
    assert all_calls == LAYERS * (3 * EXPERTS + 3)  # 18,576: every part of every packed module
    per_expert = len(spec.get("per_expert_layers", ()))
    assert few_calls == LAYERS * 3 + per_expert * 3 * EXPERTS  # the q/k/v modules and the unpacked blocks only
    assert any(k.endswith("qkv_proj") for k in got) and not any(".experts." in k for k in got)


def test_a_wrong_model_differs_so_the_comparison_can_fail() -> None:
    """The control: the comparison tells two merged models apart (one with q/k/v, one with only q/v)."""
    manager = _manager()
    a, _ = _merged(manager, _adapter(), narrowed=True)
    b, _ = _merged(manager, _adapter(qkv="qv"), narrowed=True)
    assert not _same(a, b)


@pytest.mark.parametrize("fields", [{"is_pooling_model": True}, {"supports_mm": True}])
def test_a_manager_whose_merge_looks_parts_up_by_other_names_is_used_whole(fields: dict[str, Any]) -> None:
    from vllm_lora_ext.integration.worker_patches import _parts_only

    manager = _manager(**fields)
    assert _parts_only(manager, _adapter()) is manager


def test_a_part_of_two_packed_modules_or_a_part_that_is_a_packed_module_sends_the_whole_manager() -> None:
    from vllm_lora_ext.integration.worker_patches import _parts_only

    manager = _manager()
    manager.packed_modules["model.layers.0.self_attn.qk_proj"] = ["model.layers.0.self_attn.q_proj"]
    assert _parts_only(manager, _adapter()) is manager
    manager = _manager()
    manager.packed_modules["model.layers.0.self_attn.both"] = ["model.layers.0.self_attn.qkv_proj"]
    assert _parts_only(manager, _adapter()) is manager
    manager = _manager()
    manager.packed_modules["model.layers.0.self_attn.odd"] = [("not", "a", "name")]
    assert _parts_only(manager, _adapter()) is manager
    manager = _manager()
    assert _parts_only(manager, _adapter()) is not manager  # the control: this manager is narrowed


def test_a_worker_start_indexes_the_parts_and_the_first_merge_reuses_the_index() -> None:
    """The index is made while the worker starts (``warmup.import_load_path``), not in the first adapter's merge,
    and the first read's pools are started then too (issue 39 item 3: the first run pays no more than the second)."""
    from types import SimpleNamespace

    from vllm_lora_ext.integration.loader import model_traits
    from vllm_lora_ext.integration.patching import PART_OWNERS_ATTR, TRAITS_ATTR
    from vllm_lora_ext.integration.warmup import import_load_path
    from vllm_lora_ext.integration.worker_patches import _parts_only

    from vllm_lora_ext._util import usable_cores
    from vllm_lora_ext.formats.moe_read import read_pools
    from vllm_lora_ext.transport import pools

    manager = _manager()
    runner = SimpleNamespace(lora_config=object(), lora_manager=SimpleNamespace(_adapter_manager=manager))
    for key in read_pools(usable_cores()):
        pools._IDLE.pop(key, None)
    assert import_load_path(runner) > 0
    for key in read_pools(usable_cores()):  # and the first read's pools are ready, every thread started
        assert [len(p._threads) for p in pools._IDLE[key]] == [key[1]]
    index = manager.__dict__[PART_OWNERS_ATTR]
    assert len(index[1]) == LAYERS * (3 * EXPERTS + 3)
    assert _parts_only(manager, _adapter()) is not manager
    assert manager.__dict__[PART_OWNERS_ATTR] is index  # reused, not made again
    traits = manager.__dict__[TRAITS_ATTR]  # the model's traits, worked out while it starts
    model_traits(runner.lora_manager)
    assert manager.__dict__[TRAITS_ATTR] is traits  # the first load takes them, not made again
    no_lora = _manager()
    assert import_load_path(SimpleNamespace(lora_config=None, lora_manager=SimpleNamespace(
        _adapter_manager=no_lora))) == 0.0 and PART_OWNERS_ATTR not in no_lora.__dict__
    assert TRAITS_ATTR not in no_lora.__dict__


def test_the_installed_patch_narrows_and_gives_vllms_model() -> None:
    """The wiring: vLLM's ``_create_merged_loras_inplace`` as the plugin installs it makes the narrowed merge's few
    lookups and the model vLLM's own merge over every packed module makes."""
    from vllm.lora.model_manager import LoRAModelManager

    from vllm_lora_ext.integration import plugin

    plugin.register()
    installed = LoRAModelManager._create_merged_loras_inplace
    assert getattr(installed, plugin.PATCH_MARK, False)
    manager = _manager()
    want, _ = _merged(manager, _adapter(), narrowed=False)
    model, calls = _adapter(), [0]
    lookup = manager._get_lora_layer_weights

    def counted(lora_model: Any, name: str) -> Any:
        calls[0] += 1
        return lookup(lora_model, name)

    manager._get_lora_layer_weights = counted
    manager._create_merged_loras_inplace(model)
    assert calls[0] == LAYERS * 3 and _same(_state(model), want)


def test_under_expert_parallelism_the_narrowed_merge_keeps_vllms_local_experts() -> None:
    """A 2D experts block under expert parallelism (rank 1 of 2): vLLM keeps this rank's experts of an adapter
    with per-expert parts (``_restrict_to_local_experts``, and on 0.33 ``_slice_moe_lora_ep`` after the loop); the
    narrowed merge gives the same model."""
    from vllm.lora.layers import FusedMoEWithLoRA

    class EPExperts(FusedMoEWithLoRA):  # vLLM's class, with only the fields the merge reads
        use_ep, global_num_experts, local_num_experts, ep_rank = True, 8, 4, 1

        def __getattr__(self, name: str) -> Any:
            raise AttributeError(name)

    manager = merge_manager(4, 8)
    for layer in range(4):
        manager.modules[f"model.layers.{layer}.mlp.experts"] = object.__new__(EPExperts)
    want, _ = _merged(manager, merge_adapter(4, 8, per_expert_layers=(0, 2)), narrowed=False)
    got, calls = _merged(manager, merge_adapter(4, 8, per_expert_layers=(0, 2)), narrowed=True)
    assert _same(got, want) and calls < 4 * (3 * 8 + 3) / 2  # q/k/v, the local parts of two blocks, vLLM's EP slice
