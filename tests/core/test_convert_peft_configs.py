"""`vllm-lora convert` writes configs that real PEFT loads onto a real transformers MoE model, with the delta it
had: the expert projections leave ``target_modules`` when they become ``target_parameters`` (--to 3d), and a
``target_modules`` pattern does not lose the attention modules it named (--to 2d). `vllm-lora inspect` reads a
real PEFT adapter's rank pattern for a fused expert parameter as PEFT does."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from factories import make_peft_adapter
from vllm_lora_ext.cli import main

EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _model() -> Any:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.Qwen3MoeConfig(vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                                      tie_word_embeddings=False)
    return transformers.Qwen3MoeForCausalLM(cfg).eval()


def _deltas(folder: Path) -> dict[str, torch.Tensor]:
    """Every parameter's change when PEFT loads ``folder`` onto the model and merges it."""
    import peft

    base = _model()
    before = {k: v.clone() for k, v in base.state_dict().items()}
    merged = peft.PeftModel.from_pretrained(_model(), str(folder)).merge_and_unload()
    return {k: v - before[k] for k, v in merged.state_dict().items() if not torch.equal(v, before[k])}


def _assert_same_deltas(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=1e-4, atol=1e-6)


@pytest.fixture()
def peft_moe(tmp_path: Path) -> tuple[Path, list[str]]:
    """A PEFT adapter on q_proj and the fused experts, and the --base-config arguments for its model."""
    model = _model()
    model.config.save_pretrained(str(tmp_path / "base"))
    make_peft_adapter(model, tmp_path / "peft", targets=["q_proj"], rank=4, alpha=8, seed=3,
                      target_parameters=EXPERTS)
    return tmp_path / "peft", ["--base-config", str(tmp_path / "base" / "config.json")]


def test_convert_to_3d_leaves_no_expert_projection_in_target_modules(tmp_path: Path,
                                                                     peft_moe: tuple[Path, list[str]]) -> None:
    src, base = peft_moe
    want = _deltas(src)
    assert any("experts" in k for k in want) and any("q_proj" in k for k in want)
    assert main(["convert", str(src), "--to", "2d", "-o", str(tmp_path / "as2d"), *base]) == 0
    assert main(["convert", str(tmp_path / "as2d"), "--to", "3d", "-o", str(tmp_path / "back"), *base]) == 0
    cfg = json.loads((tmp_path / "back" / "adapter_config.json").read_text())
    assert cfg["target_modules"] == ["q_proj"] and cfg["target_parameters"]
    _assert_same_deltas(_deltas(tmp_path / "back"), want)  # PEFT refused it while gate/up/down_proj stayed


def test_convert_to_2d_keeps_the_modules_a_target_modules_pattern_named(tmp_path: Path,
                                                                        peft_moe: tuple[Path, list[str]]) -> None:
    src, base = peft_moe
    want = _deltas(src)
    cfg = json.loads((src / "adapter_config.json").read_text())
    cfg["target_modules"] = r".*\.q_proj"  # a pattern, as PEFT also takes
    (src / "adapter_config.json").write_text(json.dumps(cfg))
    _assert_same_deltas(_deltas(src), want)
    assert main(["convert", str(src), "--to", "2d", "-o", str(tmp_path / "as2d"), *base]) == 0
    written = json.loads((tmp_path / "as2d" / "adapter_config.json").read_text())
    assert written["target_modules"] == ["down_proj", "gate_proj", "q_proj", "up_proj"]
    _assert_same_deltas(_deltas(tmp_path / "as2d"), want)  # q_proj's delta was dropped silently before


def test_inspect_gives_a_fused_parameter_the_rank_and_scaling_its_pattern_names(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """PEFT's rank_pattern names a fused expert parameter (``gate_up_proj``); inspect showed that pair with the
    config's r and alpha/r, although PEFT (and mix) scale it by alpha / its own rank."""
    model = _model()
    make_peft_adapter(model, tmp_path / "peft", targets=[], rank=4, alpha=16, seed=5, target_parameters=EXPERTS,
                      rank_pattern={"gate_up_proj": 8})
    assert main(["inspect", str(tmp_path / "peft"), "--json"]) == 0
    rows = {m["module"]: m for m in json.loads(capsys.readouterr().out)["modules"]}
    by_in = {m["shape_a"][1]: m for m in rows.values()}  # A's columns: H = 32 for gate_up, I = 16 for down
    assert by_in[32]["shape_a"][0] == 8 * 4 and by_in[16]["shape_a"][0] == 4 * 4  # PEFT's own ranks, r x E rows
    assert len(rows) == 4 and (by_in[32]["rank"], by_in[32]["scaling"]) == (8, 2.0)
    assert (by_in[16]["rank"], by_in[16]["scaling"]) == (4, 4.0)


def test_gate_up_at_its_own_rank_settles_the_expert_count_without_a_base_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """PEFT may give the fused gate_up a rank of its own (``rank_pattern``), so the block's two fused factors have
    different row counts (8 x E and 4 x E): one E fits both. inspect, convert and mix asked for --base-config."""
    model = _model()
    model.config.save_pretrained(str(tmp_path / "base"))
    make_peft_adapter(model, tmp_path / "peft", targets=[], rank=4, alpha=16, seed=6, target_parameters=EXPERTS,
                      rank_pattern={"gate_up_proj": 8})
    assert main(["inspect", str(tmp_path / "peft"), "--strict"]) == 0
    assert "E=4 (rows 16/32 / the config's rank)" in capsys.readouterr().out
    base = ["--base-config", str(tmp_path / "base" / "config.json")]
    assert main(["convert", str(tmp_path / "peft"), "--to", "2d", "-o", str(tmp_path / "alone")]) == 0
    assert main(["convert", str(tmp_path / "peft"), "--to", "2d", "-o", str(tmp_path / "given"), *base]) == 0
    from safetensors.torch import load_file

    alone = load_file(str(tmp_path / "alone" / "adapter_model.safetensors"))
    given = load_file(str(tmp_path / "given" / "adapter_model.safetensors"))
    assert sorted(alone) == sorted(given) and all(torch.equal(alone[k], given[k]) for k in given)


@pytest.mark.parametrize("made", ["patterns", "projections"])
def test_a_round_trip_keeps_the_delta_when_the_config_already_has_patterns(tmp_path: Path, made: str) -> None:
    """The folded blocks' exact patterns came after the config's own, which PEFT (first match) took instead: the
    delta was scaled twice. ``patterns``: the adapter's own rank and alpha patterns for down_proj;
    ``projections``: PEFT itself turns gate/up/down_proj into the fused parameters, with a gate_up pattern."""
    model = _model()
    model.config.save_pretrained(str(tmp_path / "base"))
    base = ["--base-config", str(tmp_path / "base" / "config.json")]
    if made == "patterns":
        make_peft_adapter(model, tmp_path / "peft", targets=["q_proj"], rank=4, alpha=8, seed=7,
                          target_parameters=EXPERTS, rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 8})
    else:
        make_peft_adapter(model, tmp_path / "peft", targets=["q_proj", "gate_proj", "up_proj", "down_proj"], rank=4,
                          alpha=8, seed=8)
    want = _deltas(tmp_path / "peft")
    assert any("experts" in k for k in want)
    assert main(["convert", str(tmp_path / "peft"), "--to", "2d", "-o", str(tmp_path / "as2d"), *base]) == 0
    assert main(["convert", str(tmp_path / "as2d"), "--to", "3d", "-o", str(tmp_path / "back"), *base]) == 0
    _assert_same_deltas(_deltas(tmp_path / "back"), want)


def test_fused_ranks_that_several_expert_counts_fit_ask_for_the_base_config(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """r 4 with both fused parameters at 8 by a pattern: 32 rows each read as 8 experts at r 4 or 4 at r 8. The
    single-rank rule took 8 experts and convert wrote twice the experts, at the wrong rank."""
    model = _model()
    model.config.save_pretrained(str(tmp_path / "base"))
    make_peft_adapter(model, tmp_path / "peft", targets=[], rank=4, alpha=16, seed=9, target_parameters=EXPERTS,
                      rank_pattern={"gate_up_proj": 8, "down_proj": 8})
    assert main(["convert", str(tmp_path / "peft"), "--to", "2d", "-o", str(tmp_path / "alone")]) == 1
    assert "does not settle E" in capsys.readouterr().err and not (tmp_path / "alone").exists()
    assert main(["convert", str(tmp_path / "peft"), "--to", "2d", "-o", str(tmp_path / "given"), "--base-config",
                 str(tmp_path / "base" / "config.json")]) == 0
