"""The loader's MoE output, fed through vLLM's own PunicaWrapperCPU, equals the dense per-expert reference.

vLLM's CPU punica wrapper has no fused-MoE path, so each kept expert's factors, exactly as the plugin
hands them to vLLM (a ``PackedLoRALayerWeights`` of ``[w1, w2, w3]`` for the 2D wrapper or ``[w13, w2]``
for the 3D one), go through ``add_lora_linear`` as one linear layer each, and the result is compared
with ``x @ ΔWᵀ`` computed straight from the truth. Every on-disk layout, both wrappers, and EP subsets.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from moe_factories import KeyByKey, make_truth, oracle_deltas, write_moe_adapter

pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("no_pin_memory")]

E, H, I, R, ALPHA = 4, 16, 6, 2, 4  # H != 2I and H != I: every layout reads one way


def _through_punica(a: torch.Tensor, b: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    from vllm.lora.layers.utils import LoRAMapping
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    max_rank = 16
    a_stacked = torch.zeros(2, 1, max_rank, a.shape[1])
    b_stacked = torch.zeros(2, 1, b.shape[0], max_rank)
    a_stacked[0, 0, : a.shape[0]] = a.float()
    b_stacked[0, 0, :, : b.shape[1]] = b.float()
    punica = PunicaWrapperCPU(64, 4, device="cpu")
    punica.update_metadata(LoRAMapping((7,) * x.shape[0], (7,) * x.shape[0], is_prefill=True), [7, None], 3, 256)
    y = torch.zeros(x.shape[0], b.shape[0])
    punica.add_lora_linear(y, x, (a_stacked,), (b_stacked,), 1.0, (b.shape[0],))
    return y


@pytest.mark.parametrize("experts", [None, (1, 3), (2, 3)], ids=["all", "ep-round-robin", "ep-contiguous"])
@pytest.mark.parametrize("wrapper", ["2d", "3d"])
@pytest.mark.parametrize("form", ["2d", "3d", "3d_t", "2d_gu+3d_down", "3d_gu+2d_down"])
def test_loader_moe_output_through_vllms_punica_cpu_equals_the_dense_reference(
        tmp_path: Path, form: str, wrapper: str, experts: tuple[int, ...] | None) -> None:
    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_plan import plan_experts
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks
    from vllm_lora_ext.integration.moe import MoETarget, packed_weights
    from vllm_lora_ext.reader import SafetensorsReader

    truth = make_truth(E, H, I, R, seed=3)
    extra: dict[str, Any] = {"peft_version": "0.17.0"} if form == "3d_t" else {}
    folder = write_moe_adapter(tmp_path / "a", [truth], [form], rank=R, alpha=ALPHA, **extra)
    reader = SafetensorsReader(folder / "adapter_model.safetensors")
    import json

    cfg = config_from_dict(json.loads((folder / "adapter_config.json").read_text()))
    prefix = "model.layers.0.mlp.experts"
    spec = MoESpec(prefix, E, H, I)
    plans = {prefix: plan_experts(group_moe_keys(reader.header.shapes)[prefix], spec, config=cfg)}
    keep = tuple(range(E)) if experts is None else experts
    blocks = read_blocks(plans, KeyByKey(reader.read, reader.read_many), config=cfg, experts={prefix: keep},
                         options=ReadOptions(check_finite_as="a"))
    packed = packed_weights(blocks[prefix], MoETarget(spec, wrapper, keep), max_rank=16, adapter="a")
    oracle = oracle_deltas(truth, ALPHA / R)
    g = torch.Generator().manual_seed(0)
    for j, e in enumerate(keep):
        if wrapper == "2d":  # [w1, w2, w3] = gate, down, up
            projections = {"gate": (0, None), "down": (1, None), "up": (2, None)}
        else:  # [w13, w2]: gate rows then up rows of w13
            projections = {"gate": (0, slice(0, I)), "up": (0, slice(I, 2 * I)), "down": (1, None)}
        for proj, (k, rows) in projections.items():
            a, b = packed.lora_a[k][j], packed.lora_b[k][j]
            x = torch.randn(5, a.shape[1], generator=g)
            y = _through_punica(a, b, x)
            want = x @ oracle[proj][e].T
            got = y[:, rows] if rows is not None else y
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=f"{form} {wrapper} expert {e} {proj}")


@pytest.mark.parametrize("ep_rank", [0, 1])
def test_vllms_native_ep_load_spec_and_the_plugin_read_identical_local_expert_tensors(tmp_path: Path,
                                                                                     ep_rank: int) -> None:
    # vLLM >= 0.22 has its own EP load spec (MoEEPLoadSpec: skip 2D keys of remote experts, contiguous placement
    # only, 3D tensors read whole). The plugin's loader replaces that path (it follows the layer's real expert
    # map and slices 3D tensors); for what both can do, a contiguous 2D split, they give the same tensors.
    import json

    from vllm.lora.lora_model import LoRAModel, MoEEPLoadSpec
    from vllm.lora.peft_helper import PEFTHelper

    from vllm_lora_ext.config import config_from_dict
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.formats.moe_plan import plan_experts
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks
    from vllm_lora_ext.reader import SafetensorsReader

    truth = make_truth(E, H, I, R, seed=4)
    folder = write_moe_adapter(tmp_path / "a", [truth], ["2d"], rank=R, alpha=ALPHA)
    local = E // 2
    keep = tuple(range(ep_rank * local, (ep_rank + 1) * local))
    expected = {"experts", "gate_proj", "up_proj", "down_proj"} | {
        f"experts.{e}.{p}" for e in range(E) for p in ("gate_proj", "up_proj", "down_proj")}
    helper = PEFTHelper.from_local_dir(str(folder), 256)
    stock = LoRAModel.from_local_checkpoint(str(folder), expected, helper, lora_model_id=1, device="cpu",
                                            dtype=torch.float32, moe_ep_spec=MoEEPLoadSpec(ep_rank, local, E))
    prefix = "model.layers.0.mlp.experts"
    assert sorted({int(n.split(".experts.")[1].split(".")[0]) for n in stock.loras if ".experts." in n}) == list(keep)
    cfg = config_from_dict(json.loads((folder / "adapter_config.json").read_text()))
    reader = SafetensorsReader(folder / "adapter_model.safetensors")
    plans = {prefix: plan_experts(group_moe_keys(reader.header.shapes)[prefix], MoESpec(prefix, E, H, I), config=cfg)}
    ours = read_blocks(plans, KeyByKey(reader.read, reader.read_many), config=cfg, experts={prefix: keep},
                       options=ReadOptions(dtype=torch.float32))[prefix]
    for j, e in enumerate(keep):
        for role in ("gate", "up", "down"):
            w = stock.loras[f"{prefix}.{e}.{role}_proj"]
            w.optimize()  # vLLM folds scaling into B, as the plugin does while reading
            mine = getattr(ours, role)
            assert torch.equal(mine.a[j], w.lora_a) and torch.equal(mine.b[j], w.lora_b), (e, role)
