"""Staging a built adapter on the GPU (real vLLM LoRA weight objects, a real CUDA device): the slot copy reads
GPU tensors equal to the CPU ones, and unstaging gives back CPU tensors equal to them and frees the buffer."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model() -> tuple[object, dict[str, list[torch.Tensor]]]:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    dense = LoRALayerWeights("model.layers.0.self_attn.q_proj", 8, 16, torch.randn(8, 64, generator=g).to(bf),
                             torch.randn(64, 8, generator=g).to(bf), scaling=2.0)
    a = [torch.randn(4, 8, 64, generator=g).to(bf) for _ in range(3)]
    b = [torch.randn(4, 32, 8, generator=g).to(bf) for _ in range(3)]
    moe = PackedLoRALayerWeights("model.layers.0.mlp.experts", 8, [1, 1, 1], list(a), list(b), scaling=[1.0] * 3)
    model = LoRAModel(1, 8, {dense.module_name: dense, moe.module_name: moe})
    expected = {"dense_a": [dense.lora_a.clone()], "dense_b": [(dense.lora_b * 2.0).to(bf)],  # scaling folded
                "moe_a": [t.clone() for t in a], "moe_b": [t.clone() for t in b]}
    return model, expected


def test_stage_then_unstage_round_trips_bitwise_and_frees_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.staging import stage, staged_bytes, unstage

    model, expected = _model()
    dense, moe = model.loras["model.layers.0.self_attn.q_proj"], model.loras["model.layers.0.mlp.experts"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert stage(model, "cuda:0")
    assert staged_bytes() > 0
    assert dense.scaling == 1.0 and dense.lora_a.is_cuda and all(t.is_cuda for t in moe.lora_a + moe.lora_b)
    assert torch.equal(dense.lora_b.cpu(), expected["dense_b"][0])
    for got, want in zip(moe.lora_a + moe.lora_b, expected["moe_a"] + expected["moe_b"]):
        assert torch.equal(got.cpu(), want)
    # What vLLM does between staging and unstaging: the slot copy, a slice (EP), a new tensor.
    slot = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16, device="cuda:0")
    slot[1].copy_(moe.lora_a[0], non_blocking=True)
    moe.lora_a[1] = moe.lora_a[1][1:3]
    moe.lora_b[2] = moe.lora_b[2] * 1
    copied_back = unstage(model)
    assert copied_back == expected["moe_b"][2].nbytes  # only the tensor vLLM made itself is copied back
    assert staged_bytes() == 0
    assert not dense.lora_a.is_cuda and all(not t.is_cuda for t in moe.lora_a + moe.lora_b)
    assert torch.equal(moe.lora_a[1], expected["moe_a"][1][1:3])
    assert torch.equal(dense.lora_b, expected["dense_b"][0])
    for got, want in zip([moe.lora_a[0], moe.lora_a[2]] + moe.lora_b, [expected["moe_a"][0], expected["moe_a"][2]]
                         + expected["moe_b"]):
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert torch.equal(slot[1].cpu(), expected["moe_a"][0])
    gc.collect()
    assert torch.cuda.memory_allocated() <= before + slot.nbytes


def test_nothing_is_staged_past_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.staging import stage, staged_bytes

    monkeypatch.setenv("VLLM_LORA_EXT_STAGE_GPU_BYTES", "1024")
    model, _ = _model()
    assert not stage(model, "cuda:0")
    assert staged_bytes() == 0
    assert not any(t.is_cuda for w in model.loras.values()
                   for t in (w.lora_a if isinstance(w.lora_a, list) else [w.lora_a]))
