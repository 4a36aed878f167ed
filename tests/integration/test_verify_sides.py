"""``vllm-lora verify``'s HF side on the CPU: the truncated and the random checkpoints it writes for both sides, and
its teacher-forced scoring of the base model, the adapter and each ablation with real transformers + PEFT."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "gpu"))
from factories import lora_config, write_adapter  # noqa: E402
from tiny import build_peft_adapter, build_qwen3_moe, build_tokenizer  # noqa: E402
from vllm_lora_ext.errors import VerifyError  # noqa: E402
from vllm_lora_ext.integration.verify_run import run_hf, write_random_checkpoint, write_truncated_checkpoint  # noqa: E402
from vllm_lora_ext.verification import BASE, FULL, ablation_name, adapter_groups, truncate_config, without_group  # noqa: E402

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")


def _tiny_moe(folder: Path, layers: int, *, shard: str | None = None) -> Path:
    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=512, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=1,
                                      head_dim=16, num_experts=4, num_experts_per_tok=2, initializer_range=0.2,
                                      tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    model = transformers.Qwen3MoeForCausalLM(cfg)
    model.save_pretrained(str(folder), max_shard_size=shard or "50GB")
    build_tokenizer(folder)
    return folder


def _job(model: Path, tmp: Path, **over: Any) -> dict[str, Any]:
    raw = json.loads((model / "config.json").read_text())
    job = {"model": str(model), "model_config": raw, "overrides": {}, "layers": None, "load_format": "auto",
           "checkpoint_dir": str(tmp / "checkpoint"), "revision": None, "prompts": ["lora adapter expert", "mixture gate"],
           "tokens": 4, "seed": 0, "trust_remote_code": False, "vllm": {"dtype": "auto"}}
    job.update(over)
    return job


def _state(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _late(key: str) -> bool:
    return any(f".layers.{i}." in key for i in range(2, 6))


def test_truncated_checkpoint_holds_the_first_layers_exactly_and_never_reads_the_other_shards(tmp_path: Path) -> None:
    src = _tiny_moe(tmp_path / "src", 6, shard="60KB")
    full = _state(src)
    index = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    late_only = {s for s in set(index.values()) if all(_late(k) for k, v in index.items() if v == s)}
    assert late_only  # the test is only meaningful with shards that hold later layers alone
    for s in late_only:
        (src / s).unlink()  # a read of these would fail
    raw = json.loads((src / "config.json").read_text())
    job = _job(src, tmp_path, overrides=truncate_config(raw, 2), layers=2)
    out = tmp_path / "cut"
    write_truncated_checkpoint(job, out)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    assert len(model.model.layers) == 2 and json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    cut = _state(out)
    assert set(cut) == {k for k in full if not _late(k)}
    assert all(torch.equal(cut[k], full[k]) for k in cut)
    assert (out / "tokenizer.json").is_file()


def test_random_checkpoint_is_seeded_truncated_and_in_the_served_dtype(tmp_path: Path) -> None:
    src = _tiny_moe(tmp_path / "src", 4)
    raw = json.loads((src / "config.json").read_text())
    job = _job(src, tmp_path, overrides=truncate_config(raw, 1), layers=1, load_format="dummy",
               vllm={"dtype": "bfloat16"})
    write_random_checkpoint(job, tmp_path / "a")
    write_random_checkpoint(job, tmp_path / "b")
    a, b = _state(tmp_path / "a"), _state(tmp_path / "b")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert {v.dtype for v in a.values()} == {torch.bfloat16}
    assert not any(".layers.1." in k for k in a) and any(".layers.0.mlp.experts" in k for k in a)
    assert (tmp_path / "a" / "tokenizer.json").is_file()


def _runs(adapter: Path, out: Path) -> tuple[dict[str, str], list[str]]:
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    config = json.loads((adapter / "adapter_config.json").read_text())
    groups = list(adapter_groups(list(tensors)))
    runs = {FULL: str(adapter)}
    for g in groups:
        write_adapter(out / g, without_group(tensors, g), config)
        runs[ablation_name(g)] = str(out / g)
    return runs, groups


def test_hf_side_scores_the_base_the_adapter_and_each_ablation_teacher_forced(tmp_path: Path) -> None:
    model = build_qwen3_moe(tmp_path / "model")
    adapter = build_peft_adapter(model, tmp_path / "adapter", seed=3, rank=4, targets=["q_proj", "v_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    runs, groups = _runs(adapter, tmp_path / "runs")
    assert groups == ["attention", "routed_experts"]
    out = run_hf(_job(model, tmp_path, hf_adapters=runs))
    tok = transformers.AutoTokenizer.from_pretrained(str(model))
    prompts = [tok(p)["input_ids"] for p in ["lora adapter expert", "mixture gate"]]
    assert [s[:len(p)] for s, p in zip(out["sequences"], prompts)] == prompts
    assert [len(s) - len(p) for s, p in zip(out["sequences"], prompts)] == [4, 4]
    # the base run is the plain model's own teacher-forced logprobs (no PEFT in this oracle)
    plain = transformers.AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    for seq, got in zip(out["sequences"], out["logprobs"][BASE]):
        with torch.no_grad():
            lp = torch.log_softmax(plain(input_ids=torch.tensor([seq])).logits[0].float(), -1)
        assert got == pytest.approx([float(lp[i - 1, t]) for i, t in enumerate(seq) if i > 0], abs=1e-4)

    def gap(a: str, b: str) -> float:
        xs = [abs(x - y) for p, q in zip(out["logprobs"][a], out["logprobs"][b]) for x, y in zip(p, q)]
        return sum(xs) / len(xs)

    assert gap(FULL, BASE) > 0.1
    for g in groups:
        assert gap(FULL, ablation_name(g)) > 0.01 and gap(ablation_name(g), BASE) > 0.01


def test_hf_side_refuses_an_adapter_with_keys_peft_would_leave_out(tmp_path: Path) -> None:
    model = _tiny_moe(tmp_path / "model", 2)
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.randn(2, 32),
               "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight": torch.randn(32, 2),
               "base_model.model.model.layers.0.self_attn.x_proj.lora_A.weight": torch.randn(2, 32),
               "base_model.model.model.layers.0.self_attn.x_proj.lora_B.weight": torch.randn(32, 2)}
    write_adapter(tmp_path / "a", tensors, lora_config(2, 4, ["q_proj"]))
    with pytest.raises(VerifyError, match=r"2 keys of the adapter match no module PEFT built \(first: '.*x_proj"):
        run_hf(_job(model, tmp_path, hf_adapters={FULL: str(tmp_path / "a")}))


def test_a_bare_config_folder_runs_on_random_weights_with_random_prompt_ids(tmp_path: Path) -> None:
    # what the benchmarks keep: config.json alone, no weights, no tokenizer
    src = _tiny_moe(tmp_path / "full", 3)
    (tmp_path / "bare").mkdir()
    (tmp_path / "bare" / "config.json").write_text((src / "config.json").read_text())
    adapter = build_peft_adapter(src, tmp_path / "adapter", seed=1, rank=4, targets=["q_proj"],
                                 target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    write_adapter(tmp_path / "cut", {k: v for k, v in tensors.items() if ".layers.2." not in k},
                  json.loads((adapter / "adapter_config.json").read_text()))
    raw = json.loads((src / "config.json").read_text())
    job = _job(tmp_path / "bare", tmp_path, overrides=truncate_config(raw, 2), layers=2, load_format="dummy",
               hf_adapters={FULL: str(tmp_path / "cut")})
    out = run_hf(job)
    assert out["tokenizer"] is False and [len(s) for s in out["sequences"]] == [24 + 4] * 4
    assert all(3 <= t < 512 for s in out["sequences"] for t in s[:24])
    assert out["model_dir"] == job["checkpoint_dir"] and not (Path(job["checkpoint_dir"]) / "tokenizer.json").exists()
    with pytest.raises(VerifyError, match="has no tokenizer, so the --prompt texts cannot be tokenized"):
        run_hf({**job, "prompts_given": True})
