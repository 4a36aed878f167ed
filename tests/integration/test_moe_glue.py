"""The rank's experts come from the layer's real expert map (contiguous or round-robin); odd maps are refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.integration.moe import local_experts

pytestmark = pytest.mark.vllm


def _layer(expert_map: list[int] | None, *, e: int = 8, local: int = 4, ep_rank: int = 0) -> SimpleNamespace:
    """The attributes vLLM's FusedMoEWithLoRA exposes for placement (global/local counts, ep_rank, expert_map)."""
    m = None if expert_map is None else torch.tensor(expert_map)
    return SimpleNamespace(global_num_experts=e, local_num_experts=local, ep_rank=ep_rank,
                           base_layer=SimpleNamespace(expert_map=m))


@pytest.mark.parametrize(("expert_map", "expected"), [
    ([-1, -1, -1, -1, 0, 1, 2, 3], (4, 5, 6, 7)),   # contiguous, rank 1 of EP=2
    ([-1, 0, -1, 1, -1, 2, -1, 3], (1, 3, 5, 7)),   # round-robin, rank 1 of EP=2
    ([-1, 2, -1, 0, -1, 3, -1, 1], (3, 7, 1, 5)),   # any permutation: local slot order wins
])
def test_local_experts_follow_the_expert_map(expert_map: list[int], expected: tuple[int, ...]) -> None:
    assert local_experts(_layer(expert_map)) == expected


def test_without_a_map_all_experts_or_vllms_contiguous_block() -> None:
    assert local_experts(_layer(None, local=8)) == tuple(range(8))
    assert local_experts(_layer(None, local=2, ep_rank=3)) == (6, 7)


def test_redundant_expert_placement_is_refused() -> None:
    with pytest.raises(AdapterCompatibilityError, match="EPLB"):
        local_experts(_layer([0, 1, 2, 3, 0, -1, -1, -1], local=4))
