"""A fused 3D B left as stored by a build for a GPU (``BuildJob.defer_turn``): where it lies in the packed factors,
and that turning it (``formats.moe.turn_in_place``) gives the ordinary build bit for bit, across the hand-over too."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
from vllm_lora_ext.building import build_adapter
from vllm_lora_ext.formats.moe import turn_in_place
from vllm_lora_ext.formats.moe_read import ReadOptions
from vllm_lora_ext.planning import PeftKeyRouter
from vllm_lora_ext.transport.handover import from_shared, to_shared

pytestmark = pytest.mark.usefixtures("build_dir")


def _adapter(tmp_path: Path, forms: list[str]) -> Path:
    truths = [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s, dtype=torch.bfloat16) for s in (0, 1)]
    return write_moe_adapter(tmp_path / "a", truths, forms, rank=BUILD_R, alpha=24)  # scale 24 / r: not a plain copy


@pytest.mark.parametrize("shared", [False, True])
@pytest.mark.parametrize(("forms", "wrapper"), [(["3d", "3d"], "2d"), (["3d", "2d"], "3d"), (["3d_t", "3d"], "2d")])
def test_a_b_left_as_stored_turned_afterwards_is_the_build_bit_for_bit(tmp_path: Path, forms: list[str],
                                                                         wrapper: str, shared: bool) -> None:
    job = replace(moe_build_job(_adapter(tmp_path, forms), wrapper=wrapper), scan_moe=False)
    want = build_adapter(job, PeftKeyRouter())
    assert want.unturned == {}
    built = build_adapter(replace(job, defer_turn=True), PeftKeyRouter(), shared=shared)
    if shared:
        if wrapper == "2d":  # the halves of a B left fused are the split's gate and up: in the file, not copied
            assert all(built.arena.offset_of(t) is not None for p in built.moe for t in built.moe[p][1])
        built, _ = from_shared(to_shared(built))
    standard = [f"model.layers.{n}.mlp.experts" for n, form in enumerate(forms) if form == "3d"]
    assert sorted(built.unturned) == standard  # (a transposed-orientation B is read another way: turned as read)
    for prefix, parts in built.unturned.items():
        assert sorted(i for i, *_ in parts) == ([0, 1] if wrapper == "3d" else [0, 1, 2])  # every B of the block
        assert all(scale == 24 / BUILD_R and cols == BUILD_E for _, _, cols, scale in parts), parts
        for i, rows, cols, scale in parts:
            lying = built.moe[prefix][1][i]
            assert not torch.equal(lying, want.moe[prefix][1][i])  # the control: as stored, it is not B
            turn_in_place(lying, rows, cols, scale)
    for prefix in want.moe:
        for got, ref in zip(built.moe[prefix][0] + built.moe[prefix][1], want.moe[prefix][0] + want.moe[prefix][1]):
            assert got.shape == ref.shape and got.dtype == ref.dtype and torch.equal(got, ref)


def test_a_b_in_another_dtype_than_kept_is_turned_as_read_not_left() -> None:
    """A B stored in float32 built in bfloat16 is scaled and rounded once as it is read: never left as stored."""
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        truths = [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s) for s in (0, 1)]  # float32
        folder = write_moe_adapter(Path(tmp) / "a", truths, ["3d", "3d"], rank=BUILD_R)
        job = replace(moe_build_job(folder), scan_moe=False, defer_turn=True)
        assert build_adapter(job, PeftKeyRouter()).unturned == {}


def test_leaving_b_as_stored_needs_the_caller_to_scan() -> None:
    with pytest.raises(ValueError, match="scans nothing"):
        ReadOptions(defer_turn=True, check_finite_as="adapter")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_turning_in_place_is_a_transposed_read_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    from safetensors.torch import save_file

    from vllm_lora_ext.reader import SafetensorsReader

    g = torch.Generator().manual_seed(5)
    save_file({"b": (torch.randn(96, 16 * 24, generator=g) * 3).to(dtype)}, str(tmp_path / "t.safetensors"))
    reader = SafetensorsReader(tmp_path / "t.safetensors")
    for cols in (24, 16 * 24, 1):
        for scale in (None, 1.0, 1.5, 1 / 3, -7.25):
            want = reader.read_transposed("b", cols, scale=scale)
            lying = reader.read_transposed("b", cols, scale=scale, lying=True)
            assert lying is not None and want is not None and lying.shape == want.shape
            turn_in_place(lying, 96 * 16 * 24 // cols, cols, scale)
            assert torch.equal(lying, want), (cols, scale)
