"""``vllm-lora verify`` end to end, run as the user runs it (a subprocess), on tiny random models: it passes an
adapter vLLM applies, and fails naming the module group when the served adapter silently lacks one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from tiny import _save, build_peft_adapter, build_qwen3_moe

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from factories import write_adapter  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _verify(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "vllm_lora_ext.cli", "verify", *args, "--tokens", "8", "--gpu-memory-utilization",
           "0.12"]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})})


@pytest.fixture(scope="module")
def qwen3_moe(gpu_workdir: Path) -> tuple[Path, Path]:
    model = build_qwen3_moe(gpu_workdir / "verify-qwen3-moe")
    adapter = build_peft_adapter(model, gpu_workdir / "verify-qwen3-moe-adapter", seed=5, rank=8, alpha=16,
                                 targets=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS)
    return model, adapter


def test_verify_passes_an_adapter_vllm_applies_and_writes_the_numbers(qwen3_moe: tuple[Path, Path], gpu_workdir: Path,
                                                                       record: Any) -> None:
    model, adapter = qwen3_moe
    out_json = gpu_workdir / "verify-pass.json"
    out = _verify(str(model), str(adapter), "--layers", "1", "--json", str(out_json))
    assert out.returncode == 0, out.stdout + out.stderr
    assert out.stdout.strip().splitlines()[-1].startswith("verdict: PASS"), out.stdout
    data = json.loads(out_json.read_text())
    record("verify_pass_qwen3_moe_layers1", data)
    assert data["verdict"] == "PASS" and data["layers"] == 1
    assert {g: c["status"] for g, c in data["groups"].items()} == {"attention": "ok", "routed_experts": "ok"}
    assert data["gap"]["mean"] <= data["tolerance"] < data["control"]["mean"] / 2


def test_verify_fails_naming_the_module_group_a_served_adapter_silently_lacks(qwen3_moe: tuple[Path, Path],
                                                                                gpu_workdir: Path, record: Any) -> None:
    # What a loader that accepts 3D expert keys and ignores them serves: the same adapter without its experts.
    model, adapter = qwen3_moe
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    served = gpu_workdir / "verify-qwen3-moe-no-experts"
    config.pop("target_parameters", None)
    write_adapter(served, {k: v for k, v in tensors.items() if ".mlp.experts." not in k}, config)
    out_json = gpu_workdir / "verify-dropped.json"
    out = _verify(str(model), str(adapter), "--served", str(served), "--json", str(out_json))
    assert out.returncode == 1, out.stdout + out.stderr
    verdict = out.stdout.strip().splitlines()[-1]
    assert verdict.startswith("verdict: FAIL vLLM does not apply routed_experts"), out.stdout
    data = json.loads(out_json.read_text())
    record("verify_dropped_group_qwen3_moe", data)
    assert data["groups"]["routed_experts"]["status"] == "not applied"
    assert data["groups"]["attention"]["status"] == "ok"


def _build_deepseek_v2(folder: Path, seed: int = 0) -> Path:
    import transformers

    torch.manual_seed(seed)
    cfg = transformers.DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=16, num_key_value_heads=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2,
        first_k_dense_replace=0, kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, n_group=1, topk_group=1, max_position_embeddings=512, initializer_range=0.1, bos_token_id=1,
        eos_token_id=2, tie_word_embeddings=False, torch_dtype="bfloat16",
    )
    return _save(transformers.DeepseekV2ForCausalLM(cfg), folder)


def _drop_opt_in_exists() -> bool:
    from vllm_lora_ext import constants

    return "VLLM_LORA_EXT_DROP_UNAPPLIED" in Path(constants.__file__).read_text()


@pytest.mark.skipif(not _drop_opt_in_exists(), reason="needs the MLA kv_b_proj refusal and its opt-in drop")
def test_verify_names_mla_kv_b_proj_when_the_opt_in_drops_it(gpu_workdir: Path, record: Any) -> None:
    model = _build_deepseek_v2(gpu_workdir / "verify-deepseek-v2")
    adapter = build_peft_adapter(model, gpu_workdir / "verify-deepseek-v2-adapter", seed=7, rank=8, alpha=16,
                                 targets=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"],
                                 target_parameters=EXPERTS)
    out_json = gpu_workdir / "verify-mla.json"
    out = _verify(str(model), str(adapter), "--json", str(out_json), env={"VLLM_LORA_EXT_DROP_UNAPPLIED": "kv_b_proj"})
    assert out.returncode == 1, out.stdout + out.stderr
    assert "vLLM does not apply attention.kv_b_proj" in out.stdout.strip().splitlines()[-1], out.stdout
    data = json.loads(out_json.read_text())
    record("verify_mla_kv_b_proj_dropped", data)
    statuses = {g: c["status"] for g, c in data["groups"].items()}
    assert statuses.pop("attention.kv_b_proj") == "not applied"
    assert set(statuses.values()) <= {"ok", "no effect"}, statuses
