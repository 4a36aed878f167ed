"""The pre-quantized checkpoints `bench/moe_matrix.py --checkpoint` serves: what vLLM reads, and the exact
reference HF + PEFT runs on (CPU; the parity itself runs on a GPU)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from factories import load_bench
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.vllm


def _bench(name: str) -> Any:
    return load_bench(name)


@pytest.fixture(scope="module")
def tiny_qwen3_moe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("qwen3-moe") / "model"
    _bench("moe_matrix").build_model("Qwen3MoeForCausalLM", folder)
    return folder


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True)
    for f in src.iterdir():
        (dest / f.name).write_bytes(f.read_bytes())
    return dest


def test_the_fp8_checkpoint_is_what_vllm_reads_and_its_reference_is_exactly_its_dequantized_weights(
        tiny_qwen3_moe: Path, tmp_path: Path) -> None:
    from vllm.model_executor.layers.quantization.fp8 import Fp8Config

    model = _copy(tiny_qwen3_moe, tmp_path / "model")
    info = _bench("quantized_ckpt").quantize_checkpoint(model, tmp_path / "fp8", "fp8")
    q, ref = load_file(str(tmp_path / "fp8" / "model.safetensors")), load_file(str(model / "model.safetensors"))
    config = json.loads((tmp_path / "fp8" / "config.json").read_text())["quantization_config"]
    vllm_config = Fp8Config.from_config(config)
    assert vllm_config.is_checkpoint_fp8_serialized and "model.layers.0.mlp.gate" in vllm_config.ignored_layers
    assert info["quantized_weights"] == 2 * (4 + 8 * 3)  # attention q/k/v/o and 8 experts' gate/up/down per layer
    for name, w in q.items():
        if w.dtype == torch.float8_e4m3fn:
            scale = q[name[: -len("weight")] + "weight_scale"]
            assert torch.equal(w.float() * scale, ref[name])  # the reference is the served weight, bit for bit
    layer = "model.layers.1"
    scales = {p: float(q[f"{layer}.self_attn.{p}.weight_scale"]) for p in ("q_proj", "k_proj", "v_proj")}
    assert len(set(scales.values())) == 1  # the shards vLLM fuses share one scale: its requantization is exact
    assert float(q[f"{layer}.mlp.experts.3.gate_proj.weight_scale"]) == float(
        q[f"{layer}.mlp.experts.3.up_proj.weight_scale"])
    assert q[f"{layer}.mlp.gate.weight"].dtype == torch.bfloat16  # the router stays unquantized


@pytest.mark.parametrize("kind", ["int4", "int4-triton"])  # (the same format; moe_matrix makes the model smaller)
def test_the_int4_checkpoint_packs_what_its_reference_holds(tiny_qwen3_moe: Path, tmp_path: Path, kind: str) -> None:
    from vllm.model_executor.layers.quantization.compressed_tensors.compressed_tensors import (
        CompressedTensorsConfig)

    model = _copy(tiny_qwen3_moe, tmp_path / "model")
    _bench("quantized_ckpt").quantize_checkpoint(model, tmp_path / kind, kind)
    q, ref = load_file(str(tmp_path / kind / "model.safetensors")), load_file(str(model / "model.safetensors"))
    config = json.loads((tmp_path / kind / "config.json").read_text())["quantization_config"]
    CompressedTensorsConfig.from_config(config)  # vLLM parses it
    assert "lm_head" in config["ignore"] and "model.layers.0.self_attn.q_proj" in config["ignore"]
    name = "model.layers.0.mlp.experts.5.down_proj."
    packed = q[name + "weight_packed"].to(torch.int64) & 0xFFFFFFFF
    nibbles = torch.stack([(packed >> (4 * i)) & 15 for i in range(8)], -1).reshape(packed.shape[0], -1)
    scale = q[name + "weight_scale"].float().repeat_interleave(32, 1)
    assert torch.equal((nibbles - 8) * scale, ref[name + "weight"])  # signed int4 offset by 8, 8 to an int32
    assert q[name + "weight_shape"].tolist() == list(ref[name + "weight"].shape) == [256, 96]
