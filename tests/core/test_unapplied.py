"""The refusal table: modules vLLM accepts a LoRA for and never applies are refused, or dropped only on opt-in."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from factories import PREFIX, write_adapter
from vllm_lora_ext.cli import main
from vllm_lora_ext.config import config_from_dict
from vllm_lora_ext.constants import drop_unapplied
from vllm_lora_ext.errors import AdapterCompatibilityError, UnmatchedKeysError
from vllm_lora_ext.formats.moe import MoESpec
from vllm_lora_ext.planning import AdapterPlan, ModelSpec, PeftKeyRouter, plan_adapter
from vllm_lora_ext.unapplied import RULES, kernel_traits, padding_traits, traits_from_config, unapplied_problems
from vllm_lora_ext.validation import ModuleDims

ATTN = "model.layers.0.self_attn"
MOE = "model.layers.1.mlp.experts"
# A DeepSeek-V2 layer as vLLM names it (q_lora_rank None): hidden 64, 4 heads, kv_lora_rank 16, rope 8, nope/v 16.
DIMS = {f"{ATTN}.q_proj": ModuleDims(64, 4 * 24), f"{ATTN}.kv_a_proj_with_mqa": ModuleDims(64, 16 + 8),
        f"{ATTN}.kv_b_proj": ModuleDims(16, 4 * 32), f"{ATTN}.o_proj": ModuleDims(64, 64)}
MLA = {"mla": "DeepseekV2ForCausalLM"}


def _spec(traits: dict[str, str] | None = None, drop: frozenset[str] = frozenset()) -> ModelSpec:
    return ModelSpec(accepted=frozenset({*DIMS, MOE}), dims=DIMS, moe={MOE: MoESpec(MOE, 4, 64, 32)},
                     traits=traits or {}, drop_unapplied=drop)


def _shapes(*modules: str, experts: bool = False) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for m in modules:
        d = DIMS[f"{ATTN}.{m}"]
        out[f"{PREFIX}{ATTN}.{m}.lora_A.weight"] = (4, d.d_in)
        out[f"{PREFIX}{ATTN}.{m}.lora_B.weight"] = (d.d_out, 4)
    if experts:
        for e in range(4):
            for proj, (d_in, d_out) in (("gate_proj", (64, 32)), ("up_proj", (64, 32)), ("down_proj", (32, 64))):
                out[f"{PREFIX}{MOE}.{e}.{proj}.lora_A.weight"] = (4, d_in)
                out[f"{PREFIX}{MOE}.{e}.{proj}.lora_B.weight"] = (d_out, 4)
    return out


def _plan(shapes: dict[str, tuple[int, ...]], spec: ModelSpec, **kw: object) -> AdapterPlan:
    return plan_adapter(shapes, config_from_dict({"r": 4, "lora_alpha": 8}), spec, router=PeftKeyRouter(),
                        name="ds-lora", **kw)  # type: ignore[arg-type]


ALL_LINEAR = ("q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")
MARLIN = "MarlinExperts kernel (intermediate size 96 padded to 128)"  # the worker's trait on a padded int4 base


@pytest.mark.parametrize(("traits", "modules", "experts", "refused"), [
    (MLA, ALL_LINEAR, True, "kv_b_proj"),  # PEFT's all-linear on an MLA model
    (MLA, ("kv_b_proj",), False, "kv_b_proj"),
    (MLA, ("q_proj", "kv_a_proj_with_mqa", "o_proj"), True, None),  # everything vLLM applies under MLA
    ({}, ALL_LINEAR, True, None),  # no MLA (VLLM_MLA_DISABLE=1, MiniCPM3): kv_b_proj is a plain layer
    ({"moe_kernel_drops_lora": "TritonWNA16Experts"}, ("q_proj", "o_proj"), True, "experts"),
    ({"moe_kernel_drops_lora": "TritonWNA16Experts"}, ALL_LINEAR, False, None),  # dense LoRA is applied
    ({**MLA, "moe_kernel_drops_lora": "TritonWNA16Experts"}, ALL_LINEAR, True, "kv_b_proj,experts"),
    ({"moe_kernel_misapplies_lora": MARLIN}, ("q_proj", "o_proj"), True, "experts"),
    ({"moe_kernel_misapplies_lora": MARLIN}, ALL_LINEAR[:1], False, None),
    ({"moe_kernel_drops_lora": "TritonWNA16Experts", "moe_kernel_misapplies_lora": MARLIN}, ("q_proj",), True,
     "experts"),  # two rules on the experts: one reason, one group to drop
])
def test_the_refusal_table_refuses_exactly_the_modules_vllm_would_not_apply(
        traits: dict[str, str], modules: tuple[str, ...], experts: bool, refused: str | None) -> None:
    shapes = _shapes(*modules, experts=experts)
    if refused is None:
        plan = _plan(shapes, _spec(traits))
        assert plan.dropped == [] and len(plan.dense_keys) == 2 * len(modules)
        assert (MOE in plan.moe) == experts
        return
    with pytest.raises(AdapterCompatibilityError) as e:
        _plan(shapes, _spec(traits))
    msg = str(e.value)
    assert e.value.adapter == "ds-lora" and f"VLLM_LORA_EXT_DROP_UNAPPLIED={refused}" in msg
    for group in refused.split(","):
        rule = next(r for r in RULES if r.group == group and r.trait in traits)
        assert rule.fix in msg
    if "kv_b_proj" in refused:
        assert "MLA folds kv_b_proj into its attention weights" in msg
        assert f"{ATTN}.kv_b_proj" in msg and f"{PREFIX}{ATTN}.kv_b_proj.lora_A.weight" in msg  # module, first keys
        assert "target_modules" in msg
    if "experts" in refused:
        kernel = traits.get("moe_kernel_drops_lora") or traits["moe_kernel_misapplies_lora"]
        assert kernel in msg and MOE in msg
    if "moe_kernel_misapplies_lora" in traits and "moe_kernel_drops_lora" not in traits:
        assert "padded to 128" in msg and "up_proj" in msg and "multiple of 64" in msg
    assert msg.count("(first keys:") == len(refused.split(","))  # each group named once


@pytest.mark.parametrize(("kernels", "traits"), [
    (["TritonExperts"], {}),  # bf16 and FP8 (Hopper) experts
    (["MarlinExperts", "TritonExperts"], {}),  # Marlin is judged by its padding (below), not by name
    (["TritonWNA16Experts"], {"moe_kernel_drops_lora": "TritonWNA16Experts"}),
    (["Mxfp8NativeTritonExperts", "TritonWNA16Experts"],
     {"moe_kernel_drops_lora": "Mxfp8NativeTritonExperts, TritonWNA16Experts"}),
])
def test_the_experts_kernels_a_model_runs_give_its_moe_traits(kernels: list[str], traits: dict[str, str]) -> None:
    assert kernel_traits(kernels) == traits


@pytest.mark.parametrize(("paddings", "traits"), [
    ([], {}),
    ([("MarlinExperts", 96, 128)] * 2, {"moe_kernel_misapplies_lora": MARLIN}),
    ([("MarlinExperts", 96, None)], {"moe_kernel_misapplies_lora":
                                     "MarlinExperts kernel (whose intermediate size could not be read to check it "
                                     "against 96)"}),  # unreadable: refused, not served unchecked
])
def test_a_marlin_kernel_padding_the_experts_gives_the_misapply_trait(paddings: list, traits: dict[str, str]) -> None:
    assert padding_traits(paddings) == traits


def test_dropping_experts_serves_an_int4_marlin_base_without_them_with_a_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    traits = {"moe_kernel_misapplies_lora": MARLIN}
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        plan = _plan(_shapes("q_proj", experts=True), _spec(traits, frozenset({"experts"})))
    assert MOE not in plan.moe and len(plan.dense_keys) == 2 and len(plan.dropped) == 24
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert MOE in warning and "padded to 128" in warning


def test_the_opt_in_drops_only_the_named_group_with_a_warning_naming_the_modules(
        caplog: pytest.LogCaptureFixture) -> None:
    shapes = _shapes(*ALL_LINEAR, experts=True)
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        plan = _plan(shapes, _spec(MLA, frozenset({"kv_b_proj"})))
    kv_b = [k for k in shapes if ".kv_b_proj." in k]
    assert plan.dropped == kv_b and not any(".kv_b_proj." in k for k in plan.dense_keys)
    assert len(plan.dense_keys) == 6 and MOE in plan.moe  # everything else is kept
    warning = "\n".join(r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert f"{ATTN}.kv_b_proj" in warning and "VLLM_LORA_EXT_DROP_UNAPPLIED=kv_b_proj" in warning
    assert "WITHOUT them" in warning


def test_dropping_one_group_still_refuses_another() -> None:
    traits = {**MLA, "moe_kernel_drops_lora": "TritonWNA16Experts"}
    with pytest.raises(AdapterCompatibilityError, match="DROP_UNAPPLIED=experts") as e:
        _plan(_shapes(*ALL_LINEAR, experts=True), _spec(traits, frozenset({"kv_b_proj"})))
    assert "MLA folds" not in str(e.value)


def test_the_opt_in_naming_no_known_group_is_an_error_naming_the_setting() -> None:
    with pytest.raises(AdapterCompatibilityError, match=r"VLLM_LORA_EXT_DROP_UNAPPLIED names \['kv_proj'\]"):
        _plan(_shapes("q_proj"), _spec({}, frozenset({"kv_proj"})))


def test_refusal_is_the_default_and_the_opt_in_is_a_comma_separated_list(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_LORA_EXT_DROP_UNAPPLIED", raising=False)
    assert drop_unapplied() == frozenset() and ModelSpec(frozenset()).drop_unapplied == frozenset()
    monkeypatch.setenv("VLLM_LORA_EXT_DROP_UNAPPLIED", " kv_b_proj , experts,")
    assert drop_unapplied() == {"kv_b_proj", "experts"}


def test_keys_that_match_no_module_are_still_refused_as_unmatched_when_unapplied_ones_are_dropped() -> None:
    shapes = {**_shapes("kv_b_proj"), f"{PREFIX}{ATTN}.x_proj.lora_A.weight": (4, 64),
              f"{PREFIX}{ATTN}.x_proj.lora_B.weight": (64, 4)}
    with pytest.raises(UnmatchedKeysError) as e:
        _plan(shapes, _spec(MLA, frozenset({"kv_b_proj"})))
    assert all("x_proj" in k for k in e.value.keys)


INT4_CT = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {"group_0": {
    "targets": ["Linear"], "weights": {"type": "int", "num_bits": 4, "group_size": 32}, "input_activations": None}}}


@pytest.mark.parametrize(("config", "traits"), [
    ({"model_type": "deepseek_v2", "kv_lora_rank": 512}, {"mla": "deepseek_v2"}),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "q_lora_rank": 1536}, {"mla": "deepseek_v3"}),
    ({"model_type": "kimi_k2", "kv_lora_rank": 512}, {"mla": "kimi_k2"}),
    ({"model_type": "glm_moe_dsa", "kv_lora_rank": 512}, {"mla": "glm_moe_dsa"}),
    ({"model_type": "kimi_vl", "text_config": {"model_type": "deepseek_v3", "kv_lora_rank": 512}},
     {"mla": "deepseek_v3"}),
    ({"model_type": "deepseek_v2", "kv_lora_rank": None}, {}),  # DeepSeek without MLA
    ({"model_type": "deepseek_v2", "kv_lora_rank": 512, "is_causal": False}, {}),  # vLLM runs it without MLA
    ({"model_type": "minicpm3", "kv_lora_rank": 256}, {}),  # has kv_b_proj, runs it as a plain layer
    ({"model_type": "qwen3_moe"}, {}),
    ({"model_type": "qwen3_moe", "num_experts": 128, "moe_intermediate_size": 768,  # Qwen3-30B-A3B: no padding
      "quantization_config": {"quant_method": "gptq", "bits": 4, "group_size": 128}}, {}),
    ({"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 96, "quantization_config": INT4_CT},
     {"moe_kernel_misapplies_lora": "Marlin kernel (intermediate size 96 padded to 128 at tensor-parallel size 1; "
                                    "compressed-tensors int4 weight-only)"}),
    ({"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 96, "compression_config": INT4_CT},
     {"moe_kernel_misapplies_lora": "Marlin kernel (intermediate size 96 padded to 128 at tensor-parallel size 1; "
                                    "compressed-tensors int4 weight-only)"}),
    ({"model_type": "deepseek_v3", "kv_lora_rank": 512, "n_routed_experts": 256, "moe_intermediate_size": 2048,
      "quantization_config": INT4_CT}, {"mla": "deepseek_v3"}),
    ({"model_type": "mixtral", "num_local_experts": 8, "intermediate_size": 14336 + 32,
      "quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128}},
     {"moe_kernel_misapplies_lora": "Marlin kernel (intermediate size 14368 padded to 14464 at tensor-parallel "
                                    "size 1; awq int4)"}),
    ({"model_type": "llama", "quantization_config": INT4_CT}, {}),  # dense int4: LoRA on linear layers applies
    ({"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 96,
      "quantization_config": {"quant_method": "fp8"}}, {}),
    ({"model_type": "qwen3_moe", "num_experts": 8, "moe_intermediate_size": 96, "quantization_config": {  # W4A8
        "quant_method": "compressed-tensors", "config_groups": {"g": {
            "weights": {"type": "int", "num_bits": 4}, "input_activations": {"type": "int", "num_bits": 8}}}}}, {}),
])
def test_a_base_config_gives_the_mla_trait_as_vllm_decides_use_mla(config: dict, traits: dict[str, str]) -> None:
    assert traits_from_config(config) == traits


def test_inspect_problem_lines_name_the_module_reason_and_fix() -> None:
    lines = unapplied_problems([f"{ATTN}.q_proj", f"{ATTN}.kv_b_proj", f"{MOE}.0.gate_proj"], MLA)
    assert len(lines) == 1 and f"{ATTN}.kv_b_proj" in lines[0] and "MLA folds kv_b_proj" in lines[0]
    assert "target_modules" in lines[0] and "VLLM_LORA_EXT_DROP_UNAPPLIED=kv_b_proj" in lines[0]
    assert unapplied_problems([f"{ATTN}.kv_b_proj"], {}) == []
    moe = unapplied_problems([f"{MOE}.0.gate_proj", f"{MOE}.1.gate_proj"], {"moe_kernel_drops_lora": "X"})
    assert len(moe) == 1 and f"['{MOE}']" in moe[0]


def _kv_b_adapter(folder: Path) -> Path:
    import torch

    tensors = {k: torch.zeros(s) for k, s in _shapes("q_proj", "kv_b_proj").items()}
    write_adapter(folder, tensors, {"peft_type": "LORA", "r": 4, "lora_alpha": 8,
                                    "target_modules": ["q_proj", "kv_b_proj"]})
    return folder


def test_inspect_with_an_mla_base_config_prints_a_problem_line(tmp_path: Path,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    adapter = _kv_b_adapter(tmp_path / "a")
    base = tmp_path / "config.json"
    base.write_text(json.dumps({"model_type": "deepseek_v2", "kv_lora_rank": 16, "hidden_size": 64}))
    assert main(["inspect", str(adapter), "--base-config", str(base)]) == 0
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]
    assert len(problems) == 1 and "MLA folds kv_b_proj into its attention weights" in problems[0]
    assert main(["inspect", str(adapter), "--base-config", str(base), "--json"]) == 0
    assert any("kv_b_proj" in p for p in json.loads(capsys.readouterr().out)["problems"])
    base.write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["inspect", str(adapter), "--base-config", str(base)]) == 0
    assert "problem:" not in capsys.readouterr().out


def test_inspect_under_the_drop_setting_notes_what_a_load_drops_and_strict_passes(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    adapter = _kv_b_adapter(tmp_path / "a")
    base = tmp_path / "config.json"
    base.write_text(json.dumps({"model_type": "deepseek_v2", "kv_lora_rank": 16, "hidden_size": 64}))
    monkeypatch.setenv("VLLM_LORA_EXT_DROP_UNAPPLIED", "kv_b_proj")
    assert main(["inspect", str(adapter), "--base-config", str(base), "--strict"]) == 0
    out = capsys.readouterr()
    assert "problem:" not in out.out and "kv_b_proj" in out.err
    assert "VLLM_LORA_EXT_DROP_UNAPPLIED=kv_b_proj is set: a load drops them with a warning" in out.err


def test_the_settings_check_knows_every_group_the_refusal_table_has() -> None:
    from vllm_lora_ext import constants
    from vllm_lora_ext.unapplied import RULES

    assert constants._DROP_GROUPS == {r.group for r in RULES}


def test_a_drop_setting_naming_no_group_stops_start_up_naming_it(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.constants import check_settings
    from vllm_lora_ext.errors import SettingsError

    monkeypatch.setenv("VLLM_LORA_EXT_DROP_UNAPPLIED", "kv_b_proj,bogus")
    with pytest.raises(SettingsError, match="VLLM_LORA_EXT_DROP_UNAPPLIED=.*'bogus'"):
        check_settings()
