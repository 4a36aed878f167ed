"""A fused 3D B transposed and scaled on the worker's GPU (``read_transposed(device=...)``) is the CPU's result bit
for bit, read straight or into a host arena, and a whole build with it equals the build without."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from moe_factories import (BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job,  # noqa: E402
                           spy_gpu_transposes, write_moe_adapter)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_transpose_on_the_gpu_is_the_cpus_bit_for_bit(tmp_path: Path, dtype: torch.dtype) -> None:
    from vllm_lora_ext.transport.arena import HostArena
    from vllm_lora_ext.reader import SafetensorsReader

    g = torch.Generator().manual_seed(3)
    tensors = {"b": (torch.randn(96, 16 * 24, generator=g) * 3).to(dtype),
               "odd": torch.randn(37, 5 * 7, generator=g).to(dtype), "one": torch.randn(1, 8, generator=g).to(dtype)}
    save_file(tensors, str(tmp_path / "t.safetensors"))
    reader = SafetensorsReader(tmp_path / "t.safetensors")
    gpu = torch.device("cuda", torch.cuda.current_device())
    for key, cols in (("b", 24), ("b", 16 * 24), ("odd", 7), ("one", 8)):
        for scale in (None, 1.0, 2.0, 0.3, 1 / 3, -7.25):
            want = reader.read_transposed(key, cols, scale=scale, dtype=dtype)
            got = reader.read_transposed(key, cols, scale=scale, dtype=dtype, device=gpu)
            assert got is not None and want is not None and got.device.type == "cpu"
            assert got.shape == want.shape and torch.equal(got, want), (key, cols, scale)
            arena = HostArena(1 << 20)
            into = reader.read_transposed(key, cols, arena.empty, scale=scale, dtype=dtype, device=gpu)
            assert into is not None and arena.holds(into) and torch.equal(into, want)
    ref = tensors["b"].reshape(-1, 24).t() * 2.0
    assert torch.equal(reader.read_transposed("b", 24, scale=2.0, device=gpu), ref.to(dtype))


def test_a_tensor_past_the_limit_or_the_gpus_free_memory_is_transposed_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext import reader as reader_module
    from vllm_lora_ext.reader import SafetensorsReader

    save_file({"b": torch.randn(64, 48).bfloat16()}, str(tmp_path / "t.safetensors"))
    reader = SafetensorsReader(tmp_path / "t.safetensors")
    gpu = torch.device("cuda", torch.cuda.current_device())
    want = reader.read_transposed("b", 12, scale=0.5)
    calls = spy_gpu_transposes(monkeypatch)
    assert torch.equal(reader.read_transposed("b", 12, scale=0.5, device=gpu), want) and calls == [True]
    monkeypatch.setattr(reader_module, "_GPU_TRANSPOSE_MAX", 16)
    assert torch.equal(reader.read_transposed("b", 12, scale=0.5, device=gpu), want) and calls[-1] is False
    monkeypatch.setattr(reader_module, "_GPU_TRANSPOSE_MAX", 64 << 20)
    monkeypatch.setattr(reader_module, "_GPU_HEADROOM", 1 << 50)
    assert torch.equal(reader.read_transposed("b", 12, scale=0.5, device=gpu), want) and calls[-1] is False


@pytest.mark.parametrize(("forms", "wrapper", "experts"), [
    (["3d", "3d"], "2d", None), (["3d", "3d"], "3d", None), (["3d", "3d_t"], "3d", None), (["3d", "2d"], "2d", (1, 3)),
])
def test_a_build_transposing_on_the_gpu_equals_the_build_on_the_cpu(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forms: list[str], wrapper: str,
        experts: tuple[int, ...] | None) -> None:
    from vllm_lora_ext.building import build_adapter
    from vllm_lora_ext.constants import ENV_HOST_ARENA_MIN
    from vllm_lora_ext.planning import PeftKeyRouter

    monkeypatch.setenv(ENV_HOST_ARENA_MIN, "0")
    # bfloat16, the dtype the job builds in: a factor stored in another is read another way (never rounded twice)
    truths = [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s, dtype=torch.bfloat16) for s in (0, 1)]
    folder = write_moe_adapter(tmp_path / "a", truths, forms, rank=BUILD_R, alpha=24)
    job = moe_build_job(folder, wrapper=wrapper, experts=experts)
    want = build_adapter(job, PeftKeyRouter())
    got = build_adapter(job, PeftKeyRouter(), transpose_on=torch.device("cuda", torch.cuda.current_device()))
    # A whole standard 3D block's B's (gate_up, down) are turned on the GPU; a rank's share is gathered on the CPU.
    assert want.turned_on_gpu == 0 and got.turned_on_gpu == (experts is None) * sum(f == "3d" for f in forms) * 2
    for prefix in want.moe:
        for x, y in zip((*got.moe[prefix][0], *got.moe[prefix][1]), (*want.moe[prefix][0], *want.moe[prefix][1])):
            assert x.device.type == "cpu" and x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)


def test_a_file_replaced_after_its_header_is_transposed_on_the_gpu_from_the_old_file(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vllm_lora_ext.reader import SafetensorsReader

    g = torch.Generator().manual_seed(4)
    old, new = (torch.randn(64, 48, generator=g).bfloat16() for _ in range(2))
    save_file({"b": old}, str(tmp_path / "t.safetensors"))
    save_file({"b": new}, str(tmp_path / "staged.safetensors"), metadata={"padding": "x" * 1001})
    gpu = torch.device("cuda", torch.cuda.current_device())
    calls = spy_gpu_transposes(monkeypatch)
    with SafetensorsReader(tmp_path / "t.safetensors") as reader:
        os.replace(tmp_path / "staged.safetensors", tmp_path / "t.safetensors")  # a deploy, longer header
        got = reader.read_transposed("b", 12, scale=0.5, device=gpu)
    assert calls == [True] and torch.equal(got, (old.reshape(-1, 12).t() * 0.5).bfloat16())
