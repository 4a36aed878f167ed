"""The CLI never writes a wrong adapter (issue 37, items 1-4 and 11): inputs are checked with the loader's own rules
before anything is written, inspect shows every such problem, and convert round-trips its own output bit for bit."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from factories import lora_config, write_adapter
from moe_factories import make_truth, write_moe_adapter
from vllm_lora_ext.cli import main, strict_warnings

Q = "model.layers.0.self_attn.q_proj"
QA, QB = f"base_model.model.{Q}.lora_A.weight", f"base_model.model.{Q}.lora_B.weight"
E, H, I, R = 8, 32, 12, 4


def _q_adapter(folder: Path, d_in: int, d_out: int, *, rank: int = 8, rank_b: int | None = None, r: int | None = None,
               dtype: torch.dtype = torch.float32, seed: int = 0) -> Path:
    g = torch.Generator().manual_seed(seed)
    tensors = {QA: torch.randn(rank, d_in, generator=g).to(dtype),
               QB: torch.randn(d_out, rank_b or rank, generator=g).to(dtype)}
    write_adapter(folder, tensors, lora_config(r or rank, 16, ["q_proj"]))
    return folder


def _error_line(err: str) -> str:
    lines = [ln for ln in err.splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, err
    assert not re.search(r"[^.]\.\.(\s|$)", lines[0]), lines[0]  # no doubled period
    return lines[0]


def _left_beside(folder: Path) -> list[str]:
    """What a refused write left next to its target: nothing (no lock file, no temporary folder)."""
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


@pytest.mark.parametrize(("first", "second"), [((256, 64), (512, 64)), ((512, 64), (256, 64)),
                                               ((256, 64), (256, 128))],
                         ids=["wider-second", "wider-first", "other-output"])
def test_mix_of_adapters_with_different_module_sizes_is_refused_naming_module_adapters_and_shapes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        first: tuple[int, int], second: tuple[int, int]) -> None:
    monkeypatch.chdir(tmp_path)
    _q_adapter(tmp_path / "a", *first, seed=1)
    _q_adapter(tmp_path / "b", *second, seed=2)
    assert main(["mix", "a=0.5", "b=0.5", "-o", "out"]) == 1
    shape = lambda d_in, d_out: f"A (8, {d_in}), B ({d_out}, 8)"  # noqa: E731
    assert _error_line(capsys.readouterr().err) == (
        f"error: Cannot mix these adapters: module '{Q}' is {shape(*second)} in 'b' but {shape(*first)} in 'a'. Their "
        f"factors must fit the same base model: mix adapters trained for one base model. Nothing was written.")
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path / "out") == []


def test_a_torch_warning_raised_in_the_packages_code_is_an_error_in_the_cli() -> None:
    from vllm_lora_ext.mixing import concat_factors

    parts = [(torch.ones(2, 4), torch.ones(3, 2), 1.0), (torch.ones(2, 8), torch.ones(3, 2), 1.0)]
    with strict_warnings(), pytest.raises(UserWarning, match="resized"):
        concat_factors(parts)  # the second A does not fit the first's width: torch would resize and truncate


@pytest.mark.parametrize(("make", "problem"), [
    (lambda f: _q_adapter(f, 64, 64, rank=8, r=4),
     f"Adapter 'x': {Q}: lora_A has rank 8 but the config gives it r 4, so vLLM would scale it by lora_alpha/4 and PEFT "
     f"refuses it. Set \"r\" (or a rank_pattern entry) to the tensors' rank in adapter_config.json."),
    (lambda f: _q_adapter(f, 64, 64, rank=8, rank_b=4),
     f"Adapter 'x' has malformed LoRA factors: {Q}: lora_A has rank 8 but lora_B has rank 4 (A (8, 64), B (64, 4)). "
     f"Re-save the adapter: lora_A must be (r, in) and lora_B (out, r) of the same module."),
    (lambda f: _q_adapter(f, 64, 64, dtype=torch.int32),
     f"Adapter 'x' has malformed LoRA factors: {QA} is I32, not a float type vLLM's LoRA kernels take; {QB} is I32, "
     f"not a float type vLLM's LoRA kernels take. Re-save the adapter in bfloat16, float16 or float32."),
], ids=["config-rank-4-tensors-rank-8", "a-and-b-ranks-differ", "int32-factors"])
def test_inspect_shows_what_the_loader_would_refuse_or_misscale_as_a_problem_line_and_strict_exits_1(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], make: object,
        problem: str) -> None:
    monkeypatch.chdir(tmp_path)
    make(tmp_path / "x")  # type: ignore[operator]
    assert main(["inspect", "x"]) == 0
    assert f"problem: {problem}" in capsys.readouterr().out.splitlines()
    assert main(["inspect", "x", "--strict"]) == 1
    captured = capsys.readouterr()
    assert f"problem: {problem}" in captured.out.splitlines() and _error_line(captured.err) == "error: 1 problem (--strict)"
    # one rule: mix refuses the adapter with the very message inspect shows, and writes nothing
    assert main(["mix", "x=1", "-o", "out"]) == 1
    assert _error_line(capsys.readouterr().err) == f"error: {problem}"
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path / "out") == []


def test_inspect_shows_the_tensors_of_an_adapter_whose_config_the_loader_refuses_with_the_refusal_as_a_problem(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    g = torch.Generator().manual_seed(0)
    write_adapter(tmp_path / "x", {QA: torch.randn(8, 64, generator=g), QB: torch.randn(64, 8, generator=g)},
                  lora_config(8, 16, ["q_proj"], use_dora=True))
    assert main(["inspect", "x", "--strict"]) == 1
    out = capsys.readouterr().out.splitlines()
    assert any(line.startswith(Q) for line in out)
    assert ("problem: Adapter 'x' cannot be served: DoRA (use_dora=true) is not supported by vLLM's LoRA kernels: "
            "merge the magnitude vector into the base model, or retrain without DoRA.") in out


def test_convert_and_mix_refuse_factors_holding_nan_and_write_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_moe_adapter(tmp_path / "src", [make_truth(E, H, I, R, 0)], ["2d"], rank=R)
    path = tmp_path / "src" / "adapter_model.safetensors"
    tensors = load_file(str(path))
    key = "base_model.model.model.layers.0.mlp.experts.3.down_proj.lora_B.weight"
    tensors[key][0, 0] = float("nan")
    write_adapter(tmp_path / "src", tensors, None)
    for argv in (["convert", "src", "--to", "3d", "-o", "out"], ["mix", "src=0.5", "-o", "out"]):
        assert main(argv) == 1
        line = _error_line(capsys.readouterr().err)
        assert line.startswith("error: Adapter 'src': ") and "holds NaN or infinite values" in line, line
        assert not (tmp_path / "out").exists() and _left_beside(tmp_path / "out") == []
    assert main(["inspect", "src", "--values", "--strict"]) == 1  # inspect reads the values only when asked
    assert (f"problem: Adapter 'src': tensor '{key}' holds NaN or infinite values (after scaling). Re-train or re-save "
            f"the adapter; check lora_alpha (and, for a mix, its weights).") in capsys.readouterr().out.splitlines()
    assert main(["inspect", "src", "--strict"]) == 0


def _tensors(folder: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    path = str(folder / "adapter_model.safetensors")
    with safe_open(path, "pt") as f:
        metadata = f.metadata() or {}
    return load_file(path), metadata


def _bitwise_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return list(a) == list(b) and all(x.dtype == y.dtype and x.shape == y.shape and torch.equal(
        x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y) for x, y in
        zip(a.values(), b.values()))


def test_convert_output_with_rank_patterns_converts_back_without_a_base_config_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from moe_factories import block_tensors

    monkeypatch.chdir(tmp_path)
    ts = block_tensors("model.layers.0.mlp", make_truth(E, H, I, R, 5), "2d")
    g = torch.Generator().manual_seed(9)
    for e in range(E):  # up gets its own A: the fused gate_up has rank 2r, so scaling is folded and patterns written
        ts[f"base_model.model.model.layers.0.mlp.experts.{e}.up_proj.lora_A.weight"] = torch.randn(R, H, generator=g)
    write_adapter(tmp_path / "x", ts, lora_config(R, 16, use_rslora=True))
    assert main(["convert", "x", "--to", "3d", "-o", "y"]) == 0
    assert json.loads((tmp_path / "y" / "adapter_config.json").read_text())["rank_pattern"]  # as the issue saw
    assert main(["convert", "y", "--to", "2d", "-o", "z"]) == 0  # no --base-config: E, H, I were recorded
    assert main(["convert", "z", "--to", "3d", "-o", "w"]) == 0
    (y, y_meta), (w, w_meta) = _tensors(tmp_path / "y"), _tensors(tmp_path / "w")
    assert _bitwise_equal(y, w) and y_meta == w_meta


@pytest.mark.parametrize("names", [("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2")], ids=["qwen", "mixtral"])
def test_convert_2d_to_3d_and_back_gives_the_source_file_bit_for_bit_and_keeps_its_projection_names(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, names: tuple[str, str, str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_moe_adapter(tmp_path / "x", [make_truth(E, H, I, R, 1), make_truth(E, H, I, R, 2)], ["2d", "2d"], rank=R,
                      names=names)
    assert main(["convert", "x", "--to", "3d", "-o", "y"]) == 0
    assert main(["convert", "y", "--to", "2d", "-o", "z"]) == 0
    assert _bitwise_equal(_tensors(tmp_path / "x")[0], _tensors(tmp_path / "z")[0])
    assert main(["convert", "y", "--to", "2d", "-o", "renamed", "--rename"]) == 0
    renamed = _tensors(tmp_path / "renamed")[0]
    assert {k.split(".")[-3] for k in renamed} == {"gate_proj", "up_proj", "down_proj"}
    standard = dict(zip(names, ("gate_proj", "up_proj", "down_proj")))
    source = _tensors(tmp_path / "x")[0]
    assert all(torch.equal(renamed[re.sub(r"\.(\w+)\.lora_", lambda m: f".{standard[m.group(1)]}.lora_", k)], t)
               for k, t in source.items())


def test_convert_of_a_dense_adapter_is_refused_as_nothing_to_convert(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _q_adapter(tmp_path / "src", 64, 64)
    assert main(["convert", "src", "--to", "3d", "-o", "out"]) == 1
    assert _error_line(capsys.readouterr().err) == (
        "error: Adapter 'src' is already dense (it has no MoE expert weights), nothing to convert. 'vllm-lora convert' "
        "rewrites MoE blocks only; use the adapter as it is.")
    write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, 0)], ["2d"], rank=R)
    for extra in ([], ["--rename"]):  # its names are gate_proj/up_proj/down_proj already: no --rename hint
        assert main(["convert", "moe", "--to", "2d", "-o", "out", *extra]) == 1
        assert _error_line(capsys.readouterr().err) == (
            "error: Adapter 'moe' is already 2D in every MoE block, nothing to convert. Use the adapter as it is.")
    write_moe_adapter(tmp_path / "w", [make_truth(E, H, I, R, 0)], ["2d"], rank=R, names=("w1", "w3", "w2"))
    assert main(["convert", "w", "--to", "2d", "-o", "out"]) == 1  # w1/w3/w2: --rename would rename them
    assert _error_line(capsys.readouterr().err) == (
        "error: Adapter 'w' is already 2D in every MoE block, nothing to convert. Use the adapter as it is, or pass "
        "--rename to name its projections gate_proj/up_proj/down_proj.")
    assert not (tmp_path / "out").exists() and _left_beside(tmp_path / "out") == []


def test_messages_count_in_the_singular_and_name_the_adapter_as_given(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, 0)], ["2d"], rank=R)
    assert main(["inspect", "moe"]) == 0
    assert "layout      moe_2d  (1 MoE block: 2d)" in capsys.readouterr().out.splitlines()
    assert main(["mix", "moe=0.5", "-o", "out"]) == 0
    assert capsys.readouterr().out.strip() == f"wrote {tmp_path / 'out'} (rank-concatenated mix of 1 adapter)"


def test_a_fifo_or_device_named_as_weights_is_not_a_regular_file_not_a_missing_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import os

    monkeypatch.chdir(tmp_path)
    os.mkfifo(tmp_path / "f.safetensors")
    assert main(["inspect", "f.safetensors"]) == 1
    assert "f.safetensors' is not a regular file (source 'f.safetensors')" in _error_line(capsys.readouterr().err)
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "d" / "adapter_model.safetensors")
    assert main(["inspect", "d"]) == 1
    line = _error_line(capsys.readouterr().err)  # and no advice to name the FIFO itself
    assert "has a weight file that is not a regular file: adapter_model.safetensors" in line and "name one" not in line
    _q_adapter(tmp_path / "c", 64, 64)
    (tmp_path / "c" / "adapter_config.json").unlink()
    os.mkfifo(tmp_path / "c" / "adapter_config.json")  # never skipped for a config inferred from the header
    assert main(["inspect", "c"]) == 1
    assert "adapter_config.json' is not a regular file" in _error_line(capsys.readouterr().err)
    os.mkfifo(tmp_path / "base.json")
    _q_adapter(tmp_path / "q", 64, 64)
    assert main(["inspect", "q", "--base-config", "base.json"]) == 1
    assert "base.json' is not a regular file" in _error_line(capsys.readouterr().err)


def test_a_mix_of_dense_adapters_given_the_dense_base_config_reports_the_real_mismatch(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _q_adapter(tmp_path / "a", 256, 64, seed=1)
    _q_adapter(tmp_path / "b", 512, 64, seed=2)
    (tmp_path / "base.json").write_text(json.dumps({"hidden_size": 256, "intermediate_size": 512}))  # no experts
    assert main(["mix", "a=0.5", "b=0.5", "-o", "out", "--base-config", "base.json"]) == 1
    assert _error_line(capsys.readouterr().err).startswith(f"error: Cannot mix these adapters: module '{Q}'")
    _q_adapter(tmp_path / "c", 256, 64, seed=3)
    assert main(["mix", "a=0.5", "c=0.5", "-o", "out", "--base-config", "base.json"]) == 0  # a dense base is fine


def test_inspect_values_of_a_shape_torch_cannot_count_is_a_clear_error(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    import struct

    monkeypatch.chdir(tmp_path)
    header = json.dumps({"k.lora_A.weight": {"dtype": "F32", "shape": [2**63 - 1] * 7 + [0],
                                             "data_offsets": [0, 0]}}).encode()
    (tmp_path / "w").mkdir()
    (tmp_path / "w" / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    (tmp_path / "w" / "adapter_config.json").write_text(json.dumps(lora_config(4, 8, ["q_proj"])))
    assert main(["inspect", "w", "--values", "--strict"]) == 1
    out = capsys.readouterr()
    assert "tensor 'k.lora_A.weight' has shape" in out.out and "torch cannot hold" in out.out  # a problem line
    assert "unexpected" not in out.out + out.err


def test_inspect_values_strict_names_a_scaling_that_takes_b_past_its_dtype_as_the_loader_refuses_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """`lora_alpha: 1e300` (finite factors, a scaling of 1.25e299): `inspect --values --strict` said every factor was
    read and none holds NaN or infinity, exit 0, while the loader and `mix` refuse it (r43 newcomer)."""
    monkeypatch.chdir(tmp_path)
    folder = _q_adapter(tmp_path / "huge", 64, 64)
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "lora_alpha": 1e300}))
    assert main(["inspect", "huge", "--values", "--strict"]) == 1
    out = capsys.readouterr()
    assert f"tensor '{QB}' reaches" in out.out and "would be served as infinity" in out.out, out.out
    assert "none holds NaN or infinity" not in out.err
    _q_adapter(tmp_path / "fine", 64, 64)
    assert main(["inspect", "fine", "--values", "--strict"]) == 0


def test_an_output_written_with_dot_dot_is_the_folder_above_not_a_folder_inside_itself(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.chdir(tmp_path)
    _q_adapter(tmp_path / "a", 64, 64)
    (tmp_path / "t" / "e" / "x").mkdir(parents=True)
    assert main(["mix", "a=0.5", "-o", "t/e/x/..", "--force"]) == 0
    assert (tmp_path / "t" / "e" / "adapter_model.safetensors").is_file() and (tmp_path / "t" / "e" / "x").is_dir()
    assert sorted(p.name for p in (tmp_path / "t" / "e").iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors", "vllm_lora_ext_mix.json", "x"]
