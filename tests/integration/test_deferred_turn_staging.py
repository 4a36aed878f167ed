"""A model whose fused 3D B factors a build process left as stored (``UNTURNED_ATTR``), where it is not staged on a
GPU: turned on the CPU by ``stage`` (or, never staged, by the scan before it is served), equal to the ordinary build;
and which of them the GPU may turn (a slot of their own) or not (part of a slot)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from moe_factories import assert_served_as_built, deferred_model

pytestmark = pytest.mark.usefixtures("build_dir")


@pytest.mark.parametrize("wrapper", ["2d", "3d"])
def test_a_model_not_staged_gets_its_b_turned_on_the_cpu(tmp_path: Path, wrapper: str) -> None:
    from vllm_lora_ext.integration.patching import UNTURNED_ATTR
    from vllm_lora_ext.integration.staging import stage

    model, want = deferred_model(tmp_path, wrapper)
    first = next(iter(model.loras.values())).lora_b[0].clone()
    assert not stage(model, "cpu")
    assert not hasattr(model, UNTURNED_ATTR)
    assert not torch.equal(next(iter(model.loras.values())).lora_b[0], first)  # the control: it was turned
    assert_served_as_built(model, want)


def test_a_model_never_staged_is_turned_before_its_scan(tmp_path: Path) -> None:
    from vllm_lora_ext.integration.patching import UNSCANNED_ATTR
    from vllm_lora_ext.integration.staging import refuse_nonfinite

    model, want = deferred_model(tmp_path)
    setattr(model, UNSCANNED_ATTR, True)
    refuse_nonfinite(model, "moe")
    assert_served_as_built(model, want)


def test_only_a_b_that_is_a_slot_of_its_own_is_left_for_the_gpu() -> None:
    from vllm_lora_ext.formats.moe import turn_in_place
    from vllm_lora_ext.integration.staging import _alone

    flat = torch.arange(64, dtype=torch.float32)
    own, part, whole = flat[:16], flat[32:40], flat[32:48]
    kept_own, kept_part = own.clone(), part.clone()
    items = [(own, 4, 4, 2.0), (part, 2, 4, 2.0)]
    assert _alone(items, [own, own, whole, flat[16:32]]) == [items[0]]  # (a slot given twice is one slot)
    assert torch.equal(own, kept_own)
    want = kept_part.clone()
    turn_in_place(want, 2, 4, 2.0)
    assert torch.equal(part, want)  # part of a larger slot: turned here, on the CPU
