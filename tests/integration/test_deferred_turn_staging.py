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
    from vllm_lora_ext.integration.staging import _alone

    flat = torch.arange(64, dtype=torch.float32)
    own, part, whole = flat[:16], flat[32:40], flat[32:48]
    items = [(own, 4, 4, 2.0), (part, 2, 4, 2.0)]
    assert _alone(items, [own, own, whole, flat[16:32]]) == ([items[0]], [items[1]])  # (a slot given twice: one)
    assert torch.equal(flat, torch.arange(64, dtype=torch.float32))  # it turns nothing itself


def test_a_b_that_is_part_of_a_slot_is_turned_once_when_the_model_is_then_not_staged(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A factor turned on the CPU because it is only part of a slot, in a model that then finds no room on the GPU,
    is not turned a second time (a transpose of its transpose, scaled twice, would be served: finite, so no scan
    would refuse it). A reviewer's case."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    from vllm_lora_ext.formats.moe import turn_in_place
    from vllm_lora_ext.integration import staging
    from vllm_lora_ext.integration.patching import UNTURNED_ATTR

    whole = torch.arange(64, dtype=torch.float32).view(8, 8)
    part = whole.view(-1)[:16]
    want = part.clone()
    turn_in_place(want, 2, 8, 2.0)
    module = LoRALayerWeights("model.layers.0.self_attn.q_proj", 8, 16, torch.ones(8, 8), whole, scaling=1.0)
    model = LoRAModel(1, 8, {module.module_name: module})
    setattr(model, UNTURNED_ATTR, [(part, 2, 8, 2.0)])
    monkeypatch.setattr(staging.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(staging, "_room", lambda *a: False)
    assert not staging.stage(model, "cuda:0")
    assert torch.equal(part, want)


def test_the_loader_leaves_b_for_the_gpu_only_in_a_background_build_through_a_build_process_and_marks_the_model(
        worker_manager: object, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``BuildJob.defer_turn`` is asked for only where the caller scans and stages the model (``scan_moe=False``), the
    build goes to a build process, the GPU turns factors (``VLLM_LORA_EXT_TRANSPOSE_ON_GPU``), and never for a mix's
    component; the model of a build that left factors as stored is marked with them (the tensors themselves)."""
    from dataclasses import replace

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.request import LoRARequest

    from factories import make_peft_adapter, tiny_llama
    from vllm_lora_ext.building import build_adapter
    from vllm_lora_ext.integration import build_process, loader
    from vllm_lora_ext.integration.patching import UNTURNED_ATTR

    adapter = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj"], rank=4, alpha=8)
    lying = torch.arange(16, dtype=torch.bfloat16).view(2, 4, 2)
    jobs: list[object] = []

    def elsewhere(job: object, router: object, **kwargs: object) -> object:
        jobs.append(job)
        built = build_adapter(job, router)  # type: ignore[arg-type]
        if not getattr(job, "defer_turn"):
            return built, None
        return replace(built, moe={"m.experts": ([torch.zeros(2, 2, 4)], [lying], 2)},
                       unturned={"m.experts": ((0, 8, 2, 1.5),)}), None

    monkeypatch.setattr(build_process, "build_elsewhere", elsewhere)
    monkeypatch.setattr(loader, "assemble", lambda *a: LoRAModel(1, 8, {}))
    monkeypatch.setattr(loader, "map_component", lambda manager, req, built, router: loader.MappedAdapter(built, {}))
    req = LoRARequest(lora_name="a", lora_int_id=3, lora_path=str(adapter))
    lora = loader._load_adapter_model(worker_manager, req, separate_process=True, scan_moe=False)
    assert getattr(jobs[-1], "defer_turn") is True
    marked = getattr(lora, UNTURNED_ATTR)
    assert len(marked) == 1 and marked[0][0] is lying and marked[0][1:] == (8, 2, 1.5)
    for kwargs in ({"scan_moe": True}, {"scan_moe": False, "component": True}):
        loader._load_adapter_model(worker_manager, req, separate_process=True, **kwargs)  # type: ignore[arg-type]
        assert getattr(jobs[-1], "defer_turn") is False
    monkeypatch.setenv("VLLM_LORA_EXT_TRANSPOSE_ON_GPU", "0")
    lora = loader._load_adapter_model(worker_manager, req, separate_process=True, scan_moe=False)
    assert getattr(jobs[-1], "defer_turn") is False and not hasattr(lora, UNTURNED_ATTR)


def test_an_error_while_turning_fails_the_staging_and_turns_nothing_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """An error while a model's factors are turned fails its load (the caller never serves it): nothing is turned
    again on the way out. A second reviewer's case (the second of two CPU turns raising)."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    from vllm_lora_ext.formats.moe import turn_in_place
    from vllm_lora_ext.integration import staging
    from vllm_lora_ext.integration.patching import UNTURNED_ATTR

    whole = torch.arange(64, dtype=torch.float32).view(8, 8)
    first, second = whole.view(-1)[:16], whole.view(-1)[16:32]
    want = first.clone()
    turn_in_place(want, 2, 8, 2.0)
    module = LoRALayerWeights("model.layers.0.self_attn.q_proj", 8, 16, torch.ones(8, 8), whole, scaling=1.0)
    model = LoRAModel(1, 8, {module.module_name: module})
    setattr(model, UNTURNED_ATTR, [(first, 2, 8, 2.0), (second, 2, 8, 2.0)])
    calls: list[int] = []

    def turn(t: torch.Tensor, *a: object) -> None:
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("no memory")
        turn_in_place(t, *a)  # type: ignore[arg-type]

    monkeypatch.setattr(staging, "turn_in_place", turn)
    monkeypatch.setattr(staging.torch.cuda, "is_available", lambda: True)
    with pytest.raises(RuntimeError, match="no memory"):
        staging.stage(model, "cuda:0")
    assert torch.equal(first, want) and len(calls) == 2
