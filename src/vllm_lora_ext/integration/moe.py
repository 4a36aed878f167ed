"""MoE glue: what vLLM's MoE LoRA wrappers are, and the packed tensors they consume.

vLLM 0.26 wraps each MoE block in ``FusedMoEWithLoRA`` (2D: ``set_lora`` takes ``[w1, w2, w3]``,
``A (E_local, r, in)``, ``B (E_local, out, r)``) or ``FusedMoE3DWithLoRA`` (``is_3d_moe_weight``
models: ``[w13, w2]`` with gate and up stacked in ``w13``'s output rows). The plugin hands it exactly
that, as one ``PackedLoRALayerWeights`` under the block's name with scaling already folded
(``scaling == 1``), so vLLM's own packing (``pack_moe``, which ignores rsLoRA in 0.26), 3D reshaping
and EP slicing all see nothing left to do, whatever layout the adapter was saved in and without
``enable_mixed_moe_lora_format`` / ``is_3d_lora_weight``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vllm_lora_ext.building import Wrapper, pack_block
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.formats.moe import ExpertsLoRA, MoESpec
from vllm_lora_ext.integration._compat import moe_intermediate_per_partition


@dataclass(frozen=True)
class MoETarget:
    """One MoE block of the running model: its spec, wrapper kind and the experts this rank owns."""

    spec: MoESpec
    wrapper: Wrapper
    local_experts: tuple[int, ...]  # global ids, in local-slot order


def local_experts(module: Any) -> tuple[int, ...]:
    """Return the global expert ids this rank holds, in local order, from the layer's real expert map.

    Raises:
        [`AdapterCompatibilityError`]: the placement has redundant (EPLB) experts, which the plugin does not map.
    """
    e_global, e_local = int(module.global_num_experts), int(module.local_num_experts)
    expert_map = None
    try:
        expert_map = module.base_layer.expert_map
    except AttributeError:
        expert_map = None
    if expert_map is None:
        if e_local != e_global:  # EP without a map: vLLM's own contiguous assumption
            start = int(module.ep_rank) * e_local
            return tuple(range(start, start + e_local))
        return tuple(range(e_global))
    m = expert_map.detach().to("cpu").tolist()
    owned = sorted((local, g) for g, local in enumerate(m) if local >= 0)
    if len(m) != e_global or len(owned) != e_local or [loc for loc, _ in owned] != list(range(e_local)):
        raise AdapterCompatibilityError(
            f"MoE block has an expert placement the plugin cannot map ({len(m)} map entries, {len(owned)} local, "
            f"{e_local} expected): redundant experts / EPLB are not supported for LoRA. Run without EPLB.")
    return tuple(g for _, g in owned)


def moe_targets(manager: Any) -> dict[str, MoETarget]:
    """Return ``{module name: MoETarget}`` for every MoE LoRA wrapper of the worker's model."""
    from vllm.lora.layers.fused_moe import FusedMoE3DWithLoRA, FusedMoEWithLoRA

    adapter_manager = manager._adapter_manager
    out: dict[str, MoETarget] = {}
    for name, module in adapter_manager.modules.items():
        if not isinstance(module, FusedMoEWithLoRA):
            continue
        is_3d = isinstance(module, FusedMoE3DWithLoRA)
        gate, down, up = "gate_proj", "down_proj", "up_proj"
        packed = adapter_manager.packed_modules.get(name)
        if not is_3d and packed:
            per_expert = len(packed) // int(module.global_num_experts)
            if per_expert != 3:
                raise AdapterCompatibilityError(
                    f"MoE block {name!r} is not gated ({per_expert} projections per expert); vllm_lora_ext handles gated "
                    f"experts only. Set VLLM_LORA_EXT_DISABLE=1 to use vLLM's own loader for this model.")
            gate, down, up = (p.rsplit(".", 1)[-1] for p in packed[:3])
        tp = int(getattr(module, "tp_size", 1))
        spec = MoESpec(
            prefix=name, num_experts=int(module.global_num_experts), hidden=int(module.hidden_size),
            intermediate=moe_intermediate_per_partition(module) * tp, gate=gate, up=up, down=down,
            interleaved=is_3d and getattr(module, "_base_model", None) == "GptOssForCausalLM",
        )
        out[name] = MoETarget(spec, "3d" if is_3d else "2d", local_experts(module))
    return out


def packed_weights(experts: ExpertsLoRA, target: MoETarget, *, max_rank: int, adapter: str) -> Any:
    """Build the ``PackedLoRALayerWeights`` vLLM's wrapper consumes (scaling folded, set to 1)."""
    lora_a, lora_b, need = pack_block(experts, target.spec, target.wrapper, max_rank=max_rank, adapter=adapter)
    return packed_layer(target.spec.prefix, lora_a, lora_b, need)


def packed_layer(prefix: str, lora_a: Sequence[Any], lora_b: Sequence[Any], rank: int) -> Any:
    """vLLM's ``PackedLoRALayerWeights`` for an MoE block's factor lists whose scaling is already folded into B."""
    from vllm.lora.lora_weights import PackedLoRALayerWeights

    n = len(lora_a)
    return PackedLoRALayerWeights(prefix, rank, [1] * n, list(lora_a), list(lora_b), scaling=[1.0] * n)
