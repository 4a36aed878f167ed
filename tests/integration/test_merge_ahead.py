"""vLLM's merge of a new adapter's packed modules runs on the background build's thread, not in the engine step
(PATCHES.md: ``LoRAModelManager._create_merged_loras_inplace``; ``integration.prebuild.merge_ahead``).

vLLM's own ``LRUCacheLoRAModelManager`` is made with ``object.__new__`` and the fields its merge reads filled in
(its constructor needs a model on a GPU): the packed modules of a two-layer MoE model (per-expert sub-modules and
q/k/v), and an adapter with an MoE block (packed already, as the plugin builds it) and q, k and v factors (packed by
the merge). Everything the merge and the registration run is vLLM's code.
"""

from __future__ import annotations

from typing import Any

import pytest

from moe_factories import merge_manager

pytestmark = pytest.mark.vllm

LAYERS, EXPERTS = 2, 4


def _manager() -> Any:
    from vllm.lora.model_manager import AdapterLRUCache

    mgr = merge_manager(LAYERS, EXPERTS)
    mgr._registered_adapters = AdapterLRUCache(4, lambda _id: None)
    worker = type("Worker", (), {})()
    worker._adapter_manager = mgr
    return worker


def _adapter(lora_id: int) -> Any:
    import torch
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    loras: dict[str, Any] = {}
    for layer in range(LAYERS):
        name = f"model.layers.{layer}.mlp.experts"
        loras[name] = PackedLoRALayerWeights(name, 4, [1] * 3, [torch.ones(EXPERTS, 4, 8) for _ in range(3)],
                                             [torch.ones(EXPERTS, 8, 4) for _ in range(3)], scaling=[1.0] * 3)
        for w in "qkv":
            sub = f"model.layers.{layer}.self_attn.{w}_proj"
            loras[sub] = LoRALayerWeights(sub, 4, 8, torch.full((4, 16), float(layer)), torch.ones(16, 4))
    return LoRAModel(lora_id, 4, loras)


def _shape(model: Any) -> dict[str, tuple[str, list[int]]]:
    """Each module's weights class and its factors' identities (the merge keeps the tensors, it only packs them)."""
    out = {}
    for name, weights in model.loras.items():
        factors = weights.lora_a if isinstance(weights.lora_a, list) else [weights.lora_a]
        out[name] = (type(weights).__name__, [id(t) for t in factors])
    return out


@pytest.fixture
def patched() -> None:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    from vllm.lora.model_manager import LoRAModelManager

    assert getattr(LoRAModelManager._create_merged_loras_inplace, plugin.PATCH_MARK, False)


def test_a_model_merged_ahead_is_registered_without_a_second_pass_and_as_vllm_would_merge_it(
        patched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.patching import MERGED_ATTR
    from vllm_lora_ext.integration.prebuild import merge_ahead

    monkeypatch.setattr("vllm.lora.model_manager.PIN_MEMORY", False)  # no GPU here: nothing to pin into
    worker = _manager()
    mgr = worker._adapter_manager
    reference = _adapter(1)
    mgr._add_adapter(reference)  # vLLM's registration, merging in the step
    assert not getattr(reference, MERGED_ATTR, False)
    assert "model.layers.1.self_attn.qkv_proj" in reference.loras  # q, k, v packed by vLLM's merge

    ahead = _adapter(2)
    merge_ahead(worker, ahead)  # the background build's thread
    assert getattr(ahead, MERGED_ATTR) is True
    packed = _shape(ahead)
    lookups: list[str] = []
    original = type(mgr)._get_lora_layer_weights
    monkeypatch.setattr(type(mgr), "_get_lora_layer_weights",
                        lambda self, model, name: lookups.append(name) or original(self, model, name))
    mgr._add_adapter(ahead)  # the registration in the step: no pass over the sub-module names
    assert lookups == []
    assert mgr._registered_adapters.get(2) is ahead and _shape(ahead) == packed
    assert {k: v[0] for k, v in packed.items()} == {k: v[0] for k, v in _shape(reference).items()}

    merge_ahead(worker, ahead)  # merged once: a second call leaves it as it is
    assert _shape(ahead) == packed


def test_merge_ahead_leaves_a_model_alone_without_a_manager_to_merge_with() -> None:
    from vllm_lora_ext.integration.patching import MERGED_ATTR
    from vllm_lora_ext.integration.prebuild import merge_ahead

    model = _adapter(3)
    before = _shape(model)
    merge_ahead(type("Bare", (), {})(), model)
    assert _shape(model) == before and not getattr(model, MERGED_ATTR, False)
