"""``vllm-lora verify``'s pure parts: config truncation on real transformers configs, adapter keys kept by layer and
grouped by module on real safetensors adapters, ablations, the statistics and the verdict; and the CLI without a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from factories import dense_tensors, llama_shapes, lora_config, make_dense_adapter, make_peft_adapter, write_adapter
from moe_factories import block_tensors, make_truth
from vllm_lora_ext.errors import AdapterCompatibilityError, VerifyError
from vllm_lora_ext.verification import (BASE, FULL, GapStats, Thresholds, VerifyReport, ablation_name, adapter_groups,
                                        apply_overrides, check_layers_cover, group_of, judge, keep_layers, layer_of, layers_needed,
                                        measure_gap, truncate_config, without_group)

transformers = pytest.importorskip("transformers")


def _configs() -> dict[str, Any]:
    t = transformers
    return {
        "qwen3_moe": t.Qwen3MoeConfig(num_hidden_layers=6, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
                                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4,
                                      num_experts_per_tok=2, vocab_size=64, mlp_only_layers=[0, 5]),
        "deepseek_v2": t.DeepseekV2Config(num_hidden_layers=5, hidden_size=32, intermediate_size=48,
                                          moe_intermediate_size=16, num_attention_heads=2, num_key_value_heads=2,
                                          n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                                          first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, vocab_size=64,
                                          n_group=1, topk_group=1),
        "mixtral": t.MixtralConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=16, num_attention_heads=2,
                                   num_key_value_heads=1, head_dim=16, num_local_experts=4, vocab_size=64),
        "gpt_oss": t.GptOssConfig(num_hidden_layers=4, hidden_size=32, intermediate_size=16, num_attention_heads=2,
                                  num_key_value_heads=1, head_dim=16, num_local_experts=4, vocab_size=64,
                                  layer_types=["sliding_attention", "full_attention"] * 2),
    }


def _meta_model(config: Any) -> Any:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


@pytest.mark.parametrize("arch", ["qwen3_moe", "deepseek_v2", "mixtral", "gpt_oss"])
def test_truncated_config_builds_the_same_model_with_only_its_first_layers(arch: str) -> None:
    config = _configs()[arch]
    raw = config.to_dict()
    over = truncate_config(raw, 2)
    assert over["num_hidden_layers"] == 2
    short = type(config).from_dict(apply_overrides(raw, over))
    full, cut = _meta_model(config), _meta_model(short)
    assert len(cut.model.layers) == 2
    # every parameter the truncated model has is the full model's, same name and shape: only later layers go
    full_shapes = {n: tuple(p.shape) for n, p in full.named_parameters()}
    cut_shapes = {n: tuple(p.shape) for n, p in cut.named_parameters()}
    assert cut_shapes == {n: s for n, s in full_shapes.items() if n in set(keep_layers(list(full_shapes), 2))}


def test_truncation_cuts_per_layer_lists_and_keeps_layer_indices_below_k() -> None:
    cfgs = _configs()
    assert truncate_config(cfgs["qwen3_moe"].to_dict(), 2)["mlp_only_layers"] == [0]
    assert truncate_config(cfgs["gpt_oss"].to_dict(), 3)["layer_types"] == ["sliding_attention", "full_attention",
                                                                           "sliding_attention"]
    # DeepSeek's first dense layers are a count from layer 0: truncation leaves the rule as it is
    assert "first_k_dense_replace" not in truncate_config(cfgs["deepseek_v2"].to_dict(), 2)


def test_a_config_with_its_layers_in_a_nested_text_config_gets_a_nested_override() -> None:
    raw = transformers.Qwen3_5MoeConfig().to_dict()
    n = raw["text_config"]["num_hidden_layers"]
    over = truncate_config(raw, 2)
    assert set(over) == {"text_config"} and over["text_config"]["num_hidden_layers"] == 2
    assert over["text_config"]["layer_types"] == raw["text_config"]["layer_types"][:2] and n > 2
    merged = apply_overrides(raw, over)
    assert merged["text_config"]["hidden_size"] == raw["text_config"]["hidden_size"]
    assert transformers.Qwen3_5MoeConfig.from_dict(merged).text_config.num_hidden_layers == 2


def test_truncation_at_or_above_the_layer_count_changes_nothing() -> None:
    raw = _configs()["mixtral"].to_dict()
    assert truncate_config(raw, 4) == {} and truncate_config(raw, 40) == {}


@pytest.mark.parametrize(("config", "layers", "fragment"), [
    ({"num_hidden_layers": 4}, 0, "from 1 up"),
    ({"hidden_size": 8}, 2, "Run verify without --layers"),
    ({"hidden_size": 8}, 2, "0 nested configs with one"),
    ({"encoder": {"num_hidden_layers": 2}, "decoder": {"num_hidden_layers": 2}}, 1, "2 nested configs with one .encoder, decoder."),
])
def test_truncation_refuses_what_it_cannot_cut_and_says_what_to_do(config: dict[str, Any], layers: int,
                                                                   fragment: str) -> None:
    with pytest.raises(VerifyError, match=fragment):
        truncate_config(config, layers)


def _moe_adapter(folder: Path, layers: int, seed: int = 0) -> Path:
    """Attention (q, v) plus 3D experts on every layer, from one seeded truth: layer i is the same in any prefix."""
    tensors: dict[str, torch.Tensor] = dense_tensors(llama_shapes(num_layers=layers, hidden=16, kv=8), rank=4,
                                                     seed=seed)
    for i in range(layers):
        tensors.update(block_tensors(f"model.layers.{i}.mlp", make_truth(4, 16, 8, 4, seed=seed + i), "3d"))
    write_adapter(folder, tensors, lora_config(4, 8, ["q_proj", "v_proj"], target_parameters=["mlp.experts"]))
    return folder / "adapter_model.safetensors"


def _keys(path: Path) -> list[str]:
    with safe_open(str(path), framework="pt") as f:
        return list(f.keys())


def test_keep_layers_keeps_exactly_the_keys_an_adapter_of_the_first_k_layers_has(tmp_path: Path) -> None:
    four = _keys(_moe_adapter(tmp_path / "four", 4))
    two = _keys(_moe_adapter(tmp_path / "two", 2))
    kept = keep_layers(four, 2)
    assert kept == [k for k in four if k in set(two)] and sorted(kept) == sorted(two)
    assert {layer_of(k) for k in kept} == {0, 1}
    assert keep_layers(["lm_head.lora_A.weight", "model.embed_tokens.lora_embedding_A"], 1) == [
        "lm_head.lora_A.weight", "model.embed_tokens.lora_embedding_A"]
    assert layer_of("transformer.h.3.attn.c_attn.lora_A.weight") == 3 and layer_of("model.layers.x.q") is None


def test_groups_of_a_real_peft_adapter_on_a_deepseek_v2_model_split_mla_projections_from_q_and_o(tmp_path: Path) -> None:
    config = _configs()["deepseek_v2"]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    make_peft_adapter(model, tmp_path, targets=["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"], rank=2,
                      target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    groups = adapter_groups(_keys(tmp_path / "adapter_model.safetensors"))
    assert {"attention", "attention.kv_a_proj_with_mqa", "attention.kv_b_proj", "routed_experts"} <= set(groups)
    assert all(".kv_b_proj." in k for k in groups["attention.kv_b_proj"]) and len(groups["attention.kv_b_proj"]) == 10
    assert {k.split(".")[-3] for k in groups["attention"]} == {"q_proj", "o_proj"}
    assert all(".mlp.experts." in k for k in groups["routed_experts"])
    # experts start at layer 1 (first_k_dense_replace=1): --layers 1 would leave them unchecked
    assert layers_needed(list(sum(groups.values(), [])))["routed_experts"] == 2
    with pytest.raises(AdapterCompatibilityError, match=r"routed_experts \(first in layer 1\).*--layers 2 or more"):
        check_layers_cover(list(sum(groups.values(), [])), 1, adapter="ds")
    check_layers_cover(list(sum(groups.values(), [])), 2)


@pytest.mark.parametrize(("module", "group"), [
    ("model.layers.0.self_attn.qkv_proj", "attention"),
    ("model.layers.0.self_attn.q_b_proj", "attention.q_b_proj"),
    ("model.layers.3.mlp.shared_expert.up_proj", "shared_experts"),        # Qwen2-MoE
    ("model.layers.3.mlp.shared_expert_gate", "shared_experts"),           # Qwen2-MoE's gate of the shared expert
    ("model.layers.3.mlp.shared_experts.down_proj", "shared_experts"),     # DeepSeek, GLM4-MoE
    ("model.layers.3.block_sparse_moe.experts.7.w1", "routed_experts"),    # Mixtral per-expert 2D
    ("model.layers.3.mlp.experts.base_layer", "routed_experts"),           # PEFT target_parameters
    ("model.layers.3.block_sparse_moe.gate", "router"),
    ("model.layers.3.mlp.router", "router"),                               # gpt-oss
    ("model.layers.0.mlp.gate_proj", "dense_mlp"),
    ("model.layers.2.linear_attn.in_proj_qkvz", "linear_attn.in_proj_qkvz"),  # Qwen3-Next: named by block and module
    ("model.embed_tokens", "embeddings"),
    ("lm_head", "lm_head"),
])
def test_group_of_names_each_module_kind(module: str, group: str) -> None:
    assert group_of(module) == group


def test_an_ablation_zeroes_only_the_groups_lora_b_and_keeps_every_key(tmp_path: Path) -> None:
    path = _moe_adapter(tmp_path, 2)
    tensors = load_file(str(path))
    groups = adapter_groups(list(tensors))
    assert list(groups) == ["attention", "routed_experts"]
    cut = without_group(tensors, "routed_experts")
    assert list(cut) == list(tensors)
    for k, v in cut.items():
        zeroed = k in groups["routed_experts"] and ".lora_B." in k
        if zeroed:
            assert not v.any() and v.shape == tensors[k].shape and v.dtype == tensors[k].dtype
        else:
            assert torch.equal(v, tensors[k])
    assert sum(1 for k in cut if not cut[k].any()) == 4  # gate_up and down B, two layers


def _runs(seed: int, *, n: int = 4, length: int = 20) -> list[list[float]]:
    g = torch.Generator().manual_seed(seed)
    return (-torch.rand(n, length, generator=g) * 5).tolist()


def _add(*runs: list[list[float]], scale: tuple[float, ...] | None = None) -> list[list[float]]:
    scale = scale or (1.0,) * len(runs)
    return [[sum(s * r[i][j] for s, r in zip(scale, runs)) for j in range(len(runs[0][0]))] for i in range(len(runs[0]))]


def _noise(seed: int) -> list[list[float]]:
    return _add(_runs(seed), scale=(0.01,))


def _sides(vllm_applies: dict[str, float], *, effect: float = 1.0) -> tuple[dict[str, Any], dict[str, Any]]:
    """HF: base + attention + experts deltas; vLLM: base noise, and each group's delta times ``vllm_applies[g]``."""
    base = _runs(0)
    deltas = {"attention": _add(_runs(1), scale=(effect * 0.5,)), "routed_experts": _add(_runs(2), scale=(effect,))}

    def side(weights: dict[str, float], noise_seed: int) -> dict[str, Any]:
        out = {}
        for run, removed in [(BASE, set(deltas)), (FULL, set()), *[(ablation_name(g), {g}) for g in deltas]]:
            parts = [base] + [deltas[g] for g in deltas if g not in removed]
            scale = (1.0,) + tuple(weights[g] for g in deltas if g not in removed)
            out[run] = _add(_add(*parts, scale=scale), _noise(noise_seed + len(removed)))
        return out

    return side({g: 1.0 for g in deltas}, 10), side(vllm_applies, 20)


def test_the_verdict_passes_when_vllm_applies_every_group_within_the_bases_own_noise() -> None:
    hf, vl = _sides({"attention": 1.0, "routed_experts": 1.0})
    report = judge(hf, vl, ["attention", "routed_experts"])
    assert report.passed and report.verdict_line().startswith("verdict: PASS")
    assert report.gap.mean <= report.tolerance == max(3 * report.noise.mean, 0.02)
    assert [c.status for c in report.groups] == ["ok", "ok"] and report.control.mean > 1
    assert "groups checked: attention, routed_experts" in report.reason
    assert json.loads(json.dumps(report.as_dict()))["groups"]["attention"]["status"] == "ok"


def test_a_group_vllm_drops_fails_the_verdict_and_is_named() -> None:
    hf, vl = _sides({"attention": 1.0, "routed_experts": 0.0})
    report = judge(hf, vl, ["attention", "routed_experts"])
    assert not report.passed and report.verdict_line().startswith("verdict: FAIL vLLM does not apply routed_experts")
    status = {c.group: c.status for c in report.groups}
    assert status == {"attention": "ok", "routed_experts": "not applied"}
    experts = report.groups[1]
    assert experts.effect_vllm.mean < 0.05 < 1 < experts.effect_hf.mean


def test_a_group_vllm_applies_at_the_wrong_scale_fails_as_differs() -> None:
    hf, vl = _sides({"attention": 3.0, "routed_experts": 1.0})
    report = judge(hf, vl, ["attention", "routed_experts"])
    assert not report.passed and "vLLM applies attention differently from HF + PEFT" in report.reason
    assert {c.group: c.status for c in report.groups}["attention"] == "differs"


def test_an_adapter_too_weak_to_tell_from_none_is_an_inconclusive_failure() -> None:
    hf, vl = _sides({"attention": 1.0, "routed_experts": 1.0}, effect=0.005)
    report = judge(hf, vl, ["attention", "routed_experts"])
    assert not report.passed and "inconclusive" in report.reason and "--prompt" in report.reason


def test_an_explicit_tolerance_replaces_the_noise_rule() -> None:
    hf, vl = _sides({"attention": 1.0, "routed_experts": 1.0})
    assert judge(hf, vl, ["attention", "routed_experts"], thresholds=Thresholds(tolerance=0.5)).tolerance == 0.5
    with pytest.raises(VerifyError, match="positive"):
        Thresholds(tolerance=-1.0)


def test_measure_gap_refuses_runs_over_other_positions_and_counts_nan_as_infinite() -> None:
    with pytest.raises(VerifyError, match="different positions"):
        measure_gap([[0.0, 1.0]], [[0.0]])
    assert measure_gap([[0.0, float("nan")]], [[0.0, -1.0]]).max == float("inf")
    with pytest.raises(VerifyError, match="has no run for without attention"):
        judge({BASE: [[0.0]], FULL: [[0.0]]}, {BASE: [[0.0]], FULL: [[0.0]]}, ["attention"])


def test_verify_names_a_missing_adapter_first_and_without_a_gpu_says_so_and_exits_2(tmp_path: Path) -> None:
    """A mistyped adapter is named here at once (not only on the GPU machine), a usage error: exit 2, as the README
    says (1 is a FAIL verdict); a good one, without a GPU, exits 2 saying what verify needs, before reading the
    model."""
    from factories import make_dense_adapter

    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    out = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "verify", "org/model", str(tmp_path / "missing")],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2 and "missing' does not exist" in out.stderr, out.stderr
    good = make_dense_adapter(tmp_path / "good")
    out = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "verify", "org/model", str(good)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 2, out.stderr
    assert "cannot run here: it runs vLLM and HF transformers on a CUDA GPU" in out.stderr
    assert "Traceback" not in out.stderr


def test_verify_refuses_a_missing_served_adapter_or_layers_that_lose_a_group_with_exit_2_before_any_side(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """What verify refuses in its input before running a side (a mistyped ``--served``, a ``--layers`` that keeps no
    key of a module group) is a usage error, exit 2, as the README says; a FAIL verdict is 1."""
    from vllm_lora_ext.cli import _parser, verify

    config = _configs()["qwen3_moe"]  # 6 layers; experts from layer 1
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(config.to_json_string())
    torch.manual_seed(0)
    make_peft_adapter(transformers.AutoModelForCausalLM.from_config(config), tmp_path / "trained", rank=8,
                      targets=["q_proj"], target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    monkeypatch.setattr(verify, "gpu_problem", lambda: None)
    monkeypatch.setattr(verify, "_side", lambda *a: pytest.fail("a side ran"))
    base = ["verify", str(tmp_path / "model"), str(tmp_path / "trained"), "--workdir", str(tmp_path / "w")]
    assert verify.run(_parser().parse_args([*base, "--served", str(tmp_path / "nosuch")])) == 2
    assert "nosuch' does not exist" in capsys.readouterr().err
    assert verify.run(_parser().parse_args([*base, "--layers", "1"])) == 2
    assert "--layers 2 or more" in capsys.readouterr().err
    temp = tmp_path / "temp"  # without --workdir: the folder it made goes, whatever the refusal
    monkeypatch.setattr(verify.tempfile, "mkdtemp", lambda **kw: (temp.mkdir(), str(temp))[1])
    assert verify.run(_parser().parse_args([*base[:3], "--layers", "1"])) == 2 and not temp.exists()
    monkeypatch.setattr(verify, "prepare_job", lambda *a: (_ for _ in ()).throw(OSError(28, "No space left")))
    with pytest.raises(OSError, match="No space"):
        verify.run(_parser().parse_args(base[:3]))
    assert not temp.exists()


def test_verify_is_a_listed_command_with_its_options(capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_lora_ext.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["verify", "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    for option in ("--layers", "--load-format", "--json", "--served", "--prompt"):
        assert option in text


def test_the_job_holds_each_sides_adapter_cut_to_k_layers_with_one_ablation_per_group(tmp_path: Path) -> None:
    from vllm_lora_ext.cli import _parser
    from vllm_lora_ext.cli.verify import prepare_job

    config = _configs()["qwen3_moe"]  # 6 layers; layers 0 and 5 are dense, so experts start in layer 1
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(config.to_json_string())
    torch.manual_seed(0)
    make_peft_adapter(transformers.AutoModelForCausalLM.from_config(config), tmp_path / "trained", rank=8,
                      targets=["q_proj", "v_proj"], target_parameters=["mlp.experts.gate_up_proj",
                                                                         "mlp.experts.down_proj"])
    trained = load_file(str(tmp_path / "trained" / "adapter_model.safetensors"))
    peft_config = json.loads((tmp_path / "trained" / "adapter_config.json").read_text())
    write_adapter(tmp_path / "served", {k: v for k, v in trained.items() if ".experts." not in k}, peft_config)
    args = _parser().parse_args(["verify", str(tmp_path / "model"), str(tmp_path / "trained"), "--layers", "2",
                                 "--served", str(tmp_path / "served")])
    job, groups = prepare_job(args, tmp_path / "work")
    assert job["overrides"] == {"num_hidden_layers": 2, "mlp_only_layers": [0]} and job["layers"] == 2
    assert groups == ["attention", "routed_experts"] and job["vllm"]["max_lora_rank"] == 8
    kept = keep_layers(list(trained), 2)
    assert {layer_of(k) for k in kept} == {0, 1} and len(kept) < len(trained)
    hf_runs, vllm_runs = job["hf_adapters"], job["vllm_adapters"]
    assert list(hf_runs) == list(vllm_runs) == [FULL, "without attention", "without routed_experts"]
    for run, folder in hf_runs.items():
        got = load_file(str(Path(folder) / "adapter_model.safetensors"))
        assert sorted(got) == sorted(kept)
        assert json.loads((Path(folder) / "adapter_config.json").read_text()) == peft_config
        removed = run.removeprefix("without ") if run != FULL else None
        for k, v in got.items():
            module = k.split(".lora_")[0].removeprefix("base_model.model.")
            zero = removed is not None and group_of(module) == removed and ".lora_B." in k
            assert torch.equal(v, torch.zeros_like(v) if zero else trained[k]), (run, k)
    served_full = load_file(str(Path(vllm_runs[FULL]) / "adapter_model.safetensors"))
    served_cut = load_file(str(Path(vllm_runs["without routed_experts"]) / "adapter_model.safetensors"))
    assert not any(".experts." in k for k in served_full)
    assert served_full.keys() == served_cut.keys()
    assert all(torch.equal(served_full[k], served_cut[k]) for k in served_full)
    one = _parser().parse_args(["verify", str(tmp_path / "model"), str(tmp_path / "trained"), "--layers", "1"])
    with pytest.raises(AdapterCompatibilityError, match=r"routed_experts \(first in layer 1\).*--layers 2 or more"):
        prepare_job(one, tmp_path / "work1")


@pytest.mark.parametrize(("option", "value", "fragment"), [
    ("--layers", "0", "out of range"), ("--tokens", "x", "not an integer"),
    ("--gpu-memory-utilization", "1.5", "fraction in (0, 1]"), ("--tolerance", "-1", "not a positive number"),
    ("--prompt", " ", "empty prompt"), ("--load-format", "pt", "invalid choice"),
])
def test_verify_usage_errors_exit_2_naming_the_option(option: str, value: str, fragment: str,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_lora_ext.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["verify", "org/model", "adapter", option, value])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert option in err and fragment in err


def test_a_failed_side_is_reported_by_its_root_cause_not_by_the_engine_wrapper_error() -> None:
    from vllm_lora_ext.cli.verify import root_cause

    log = ("INFO 11-28 starting\n"
           "(EngineCore pid=12) ERROR Traceback (most recent call last):\n"
           "(EngineCore pid=12) ValueError: No available memory for the cache blocks. Try increasing "
           "`gpu_memory_utilization` when initializing the engine.\n"
           "RuntimeError: Engine core initialization failed. See root cause above. Failed core proc(s): {}\n")
    assert root_cause(log) == ("ValueError: No available memory for the cache blocks. Try increasing "
                               "`gpu_memory_utilization` when initializing the engine.")
    assert root_cause("RuntimeError: Engine core initialization failed. See root cause above.\n") is None
    assert root_cause("all fine\n") is None


def _pass_report() -> VerifyReport:
    g = GapStats(0.001, 0.01, 100)
    return VerifyReport(g, g, GapStats(1.0, 3.0, 100), 0.02, (), True, "vLLM applies the adapter as HF + PEFT does")


def test_a_json_path_that_cannot_be_written_is_a_usage_error_before_the_gpu_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`--json PATH` was opened only after both sides ran (minutes of GPU time on a real model) and after the
    `verdict: PASS` line is printed; a PATH whose folder does not exist (a typo, an unset $OUT) then ends the command
    with `error: ... No such file or directory` and exit 1, the code of a FAIL verdict, and the numbers are lost.
    (Before r42; found by an attacker helper.) It is checked with the other usage errors, before any side runs."""
    from vllm_lora_ext.cli import main, verify

    ran: list[str] = []
    make_dense_adapter(tmp_path / "adapter")
    monkeypatch.setattr(verify, "gpu_problem", lambda: None)
    monkeypatch.setattr(verify, "prepare_job", lambda args, work: ({}, ["attention"]))
    monkeypatch.setattr(verify, "_compare", lambda *a: (ran.append("gpu"), _pass_report())[1])
    code = main(["verify", str(tmp_path / "model"), str(tmp_path / "adapter"),
                 "--json", str(tmp_path / "no-such-folder" / "verify.json")])
    out, err = capsys.readouterr()
    assert not ran and code == 2, f"exit {code} after the GPU run ({ran}); stdout ends {out.splitlines()[-1]!r}; " \
                                  f"stderr: {err.strip()[-200:]}"


def test_a_json_path_that_is_a_folder_is_a_usage_error_before_the_gpu_run(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from vllm_lora_ext.cli import main, verify

    ran: list[str] = []
    make_dense_adapter(tmp_path / "adapter")
    monkeypatch.setattr(verify, "gpu_problem", lambda: None)
    monkeypatch.setattr(verify, "prepare_job", lambda args, work: ({}, ["attention"]))
    monkeypatch.setattr(verify, "_compare", lambda *a: (ran.append("gpu"), _pass_report())[1])
    (tmp_path / "out").mkdir()
    code = main(["verify", str(tmp_path / "model"), str(tmp_path / "adapter"), "--json", str(tmp_path / "out")])
    assert not ran and code == 2 and "it is a folder" in capsys.readouterr().err
