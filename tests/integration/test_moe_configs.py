"""The Triton WNA16 MoE kernel gets a complete tile config with LoRA on (int4 weight-only MoE bases)."""

from __future__ import annotations

from typing import Any

import pytest

fused_moe = pytest.importorskip("vllm.model_executor.layers.fused_moe.fused_moe")

from vllm_lora_ext.integration.moe_configs import make_try_get_optimal_moe_config, triton_wna16_config  # noqa: E402

# 8 experts, hidden 192, intermediate 96, int4 in groups of 32 (the case vLLM runs with TritonWNA16Experts)
SHAPES: dict[str, Any] = {"w1_shape": (8, 192, 96), "w2_shape": (8, 192, 48), "top_k": 2, "dtype": "int4_w4a16",
                          "block_shape": [0, 32]}


@pytest.fixture
def on_a_cuda_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM picks the CUDA WNA16 config for small 4-bit batches only on CUDA: answer as a GPU machine without a
    tuned file for these shapes does."""
    monkeypatch.setattr(fused_moe, "should_moe_wna16_use_cuda", lambda *a, **k: True)
    monkeypatch.setattr(fused_moe, "get_moe_configs", lambda *a, **k: None)


@pytest.mark.parametrize("m", [1, 8, 16, 33, 200])
def test_every_int4_config_the_triton_kernel_gets_carries_a_group_size(on_a_cuda_platform: None, m: int) -> None:
    """vLLM 0.26's default for small 4-bit batches is the CUDA kernel's config, without GROUP_SIZE_M (the Triton
    launch then fails); later vLLM adds it. Either way the kernel gets a complete config."""
    patched = make_try_get_optimal_moe_config(fused_moe.try_get_optimal_moe_config)
    original = fused_moe.try_get_optimal_moe_config(M=m, **SHAPES)
    config = patched(SHAPES["w1_shape"], SHAPES["w2_shape"], SHAPES["top_k"], SHAPES["dtype"], m, SHAPES["block_shape"])
    assert "GROUP_SIZE_M" in config and "BLOCK_SIZE_M" in config
    if "GROUP_SIZE_M" in original:
        assert config == original  # complete already: kept as vLLM made it


@pytest.mark.parametrize("m, block_m", [(1, 16), (8, 16), (20, 16), (33, 32), (200, 64)])
def test_an_incomplete_config_is_completed_as_vllms_own_triton_default(m: int, block_m: int) -> None:
    cuda_config = {"BLOCK_SIZE_M": min(16, m), "SPLIT_K": 1}  # vLLM 0.26's CUDA-kernel config
    assert triton_wna16_config(cuda_config, m) == {"BLOCK_SIZE_M": block_m, "GROUP_SIZE_M": 1, "SPLIT_K": 1}


def test_configs_that_are_complete_or_of_other_dtypes_pass_through_unchanged(on_a_cuda_platform: None) -> None:
    patched = make_try_get_optimal_moe_config(fused_moe.try_get_optimal_moe_config)
    for dtype in (None, "fp8_w8a8"):
        shapes = {**SHAPES, "dtype": dtype, "block_shape": None}
        assert patched(M=4, **shapes) == fused_moe.try_get_optimal_moe_config(M=4, **shapes)
    tuned = {"BLOCK_SIZE_M": 32, "GROUP_SIZE_M": 8, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64}
    assert triton_wna16_config(tuned, 4) is tuned
