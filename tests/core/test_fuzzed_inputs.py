"""Inputs a coverage-guided fuzzer of the parsers found (header bytes, adapter configs, key spellings): each gets
its typed error naming what is wrong, or is read as PEFT and vLLM read it; none raises a raw exception."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

import pytest

from vllm_lora_ext.cli import main
from vllm_lora_ext.errors import AdapterFormatError, ExpertLayoutError
from vllm_lora_ext.headers import read_header
from vllm_lora_ext.offline_ops import load_adapter_files
from vllm_lora_ext.sources import resolve_source
from vllm_lora_ext.summary import finite_rule, summarize_adapter

P = "base_model.model.model.layers.0.self_attn.q_proj"


def _entry(shape: list[int], start: int, end: int, dtype: str = "F32") -> dict[str, Any]:
    return {"dtype": dtype, "shape": shape, "data_offsets": [start, end]}


def _adapter(folder: Path, header: dict[str, Any], data: bytes = b"", config: dict[str, Any] | None = None) -> Path:
    folder.mkdir()
    blob = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + data)
    (folder / "adapter_config.json").write_text(json.dumps(config or {"peft_type": "LORA", "r": 1, "lora_alpha": 16}))
    return folder


@pytest.mark.parametrize(("shape", "end"), [([10**100] * 4, 4), ([0, 2**64 + 5], 0), ([0, 2**63], 0)],
                         ids=["numel-past-float", "zero-beside-past-uint64", "zero-beside-2^63"])
def test_a_shape_no_torch_tensor_can_have_is_refused_by_the_header_parse(tmp_path: Path, shape: list[int],
                                                                      end: int) -> None:
    folder = _adapter(tmp_path / "a", {"x": _entry(shape, 0, end)}, b"\0" * end)
    with pytest.raises(AdapterFormatError, match="'x' has an invalid shape or offsets"):
        read_header(folder / "adapter_model.safetensors")


def test_a_wrong_span_of_a_huge_shape_is_worded_in_whole_bytes(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "a", {"x": _entry([2**40, 2**20], 0, 4)}, b"\0" * 4)
    with pytest.raises(AdapterFormatError, match=r"\(4611686018427387904 bytes\) but spans 4 bytes"):
        read_header(folder / "adapter_model.safetensors")


def test_a_float8_factor_is_checked_for_nan_not_a_torch_error(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "a", {f"{P}.lora_A.weight": _entry([1, 1], 0, 4),
                                       f"{P}.lora_B.weight": _entry([1, 1], 4, 5, "F8_E4M3")}, b"\0" * 5)
    r = resolve_source(str(folder))
    summary = summarize_adapter(r, extra_rules=[finite_rule(r)])
    assert any("F8_E4M3" in p for p in summary.problems), summary.problems  # the dtype rule names it


def test_a_0d_factor_is_a_problem_for_inspect(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _adapter(tmp_path / "a", {f"{P}.lora_embedding_A": _entry([], 0, 4),
                                       f"{P}.lora_embedding_B": _entry([1, 1], 4, 8)}, b"\0" * 8)
    assert main(["inspect", str(folder), "--strict"]) == 1
    out = capsys.readouterr()
    assert "unexpected" not in out.err and "must be 2-D" in out.out + out.err


def test_factors_with_and_without_peft_prefix_pair_by_module_and_a_factor_given_twice_is_refused(
        tmp_path: Path) -> None:
    short = P.removeprefix("base_model.model.")
    one = _adapter(tmp_path / "one", {f"{short}.lora_A.weight": _entry([1, 2], 0, 8),
                                      f"{P}.lora_B.weight": _entry([2, 1], 8, 16)}, b"\0" * 16)
    assert list(load_adapter_files(resolve_source(str(one))).dense) == [short]
    two = _adapter(tmp_path / "two", {f"{short}.lora_A.weight": _entry([1, 2], 0, 8),
                                      f"{P}.lora_A.weight": _entry([1, 2], 8, 16),
                                      f"{P}.lora_B.weight": _entry([2, 1], 16, 24)}, b"\0" * 24)
    with pytest.raises(AdapterFormatError, match=r"two keys hold its lora_A, .*keep one"):
        load_adapter_files(resolve_source(str(two)))


def test_a_fused_block_of_0_rows_settles_no_expert_count(tmp_path: Path) -> None:
    folder = _adapter(tmp_path / "a", {"model.layers.0.mlp.experts.base_layer.lora_A.weight": _entry([0, 1], 0, 0),
                                       "model.layers.0.mlp.experts.base_layer.lora_B.weight": _entry([1, 0], 0, 0)},
                      config={"peft_type": "LORA", "r": 8, "lora_alpha": 16})
    with pytest.raises(ExpertLayoutError, match="does not settle E"):
        load_adapter_files(resolve_source(str(folder)))


@pytest.mark.parametrize(("source", "fragment"), [
    ("~nosuchuser-x9/adapter", "no home folder for '~nosuchuser-x9'"),
    ("hf:org/repo\n:x.safetensors", "repo id 'org/repo\\n' has an invalid name"),
    ("hf:org/repo@main\n:x", "revision"),
    ("x/" * 3000, "is 6000 bytes long, and a path is at most 4095 bytes"),
])
def test_sources_that_reached_an_untyped_error_are_source_errors(source: str, fragment: str) -> None:
    from vllm_lora_ext.errors import AdapterSourceError
    from vllm_lora_ext.sources import parse_source

    with pytest.raises(AdapterSourceError) as info:
        resolve_source(parse_source(source))
    assert fragment in str(info.value)


def test_a_deeply_nested_mix_path_is_a_mix_error() -> None:
    from vllm_lora_ext.errors import MixError
    from vllm_lora_ext.mixing import MixSpec

    with pytest.raises(MixError, match="not JSON"):
        MixSpec.from_path("mix:" + "[" * 50000)


def test_a_header_key_with_a_lone_surrogate_is_refused_by_the_header_parse(tmp_path: Path) -> None:
    folder = tmp_path / "a"
    folder.mkdir()
    blob = b'{"m\\ud800.lora_A.weight": {"dtype": "F32", "shape": [1, 1], "data_offsets": [0, 4]}}'
    (folder / "adapter_model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + b"\0" * 4)
    with pytest.raises(AdapterFormatError, match=r"header name 'm\?.lora_A.weight' holds an unpaired surrogate"):
        read_header(folder / "adapter_model.safetensors")


def test_inspect_json_strict_says_on_stderr_why_it_exits_1(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _adapter(tmp_path / "a", {f"{P}.lora_A.weight": _entry([2, 1], 0, 8),
                                       f"{P}.lora_B.weight": _entry([1, 2], 8, 16)}, b"\0" * 16)
    assert main(["inspect", str(folder), "--json", "--strict"]) == 1
    out = capsys.readouterr()
    assert json.loads(out.out)["problems"] and 'error: 1 problem (--strict; see "problems")' in out.err


def test_an_expert_index_alone_does_not_size_a_converted_block(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A 6 KB file naming expert 65535 only: E from the key names would make convert write 65,536 experts."""
    header: dict[str, Any] = {}
    off = 0
    for proj, (a, b) in {"gate_proj": ([1, 64], [64, 1]), "up_proj": ([1, 64], [64, 1]),
                         "down_proj": ([1, 64], [64, 1])}.items():
        for w, shape in (("A", a), ("B", b)):
            header[f"model.layers.0.mlp.experts.65535.{proj}.lora_{w}.weight"] = _entry(shape, off, off + 256)
            off += 256
    folder = _adapter(tmp_path / "a", header, b"\0" * off, config={"r": 1, "lora_alpha": 1})
    assert main(["convert", str(folder), "--to", "3d", "-o", str(tmp_path / "out")]) == 1
    assert "holds 2D keys for 1 of its experts, yet E = 65536" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_tilde_of_no_user_in_a_cli_path_is_read_as_written_as_a_shell_does(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    folder = _adapter(tmp_path / "a", {f"{P}.lora_A.weight": _entry([1, 2], 0, 8),
                                       f"{P}.lora_B.weight": _entry([2, 1], 8, 16)}, b"\0" * 16)
    assert main(["inspect", str(folder), "--base-config", "~nosuchuser-x9/c.json"]) == 1
    err = capsys.readouterr().err
    assert "unexpected" not in err and "'~nosuchuser-x9/c.json' does not exist" in err


def test_inspect_strict_refuses_a_rank_no_vllm_serves_and_a_corrupt_expert_index(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What the loader refuses in every server, ``inspect --strict`` refuses too (exit 1, said as a problem): a rank
    above 512, vLLM's largest ``--max-lora-rank``, and an expert index past the 65,536 experts supported (which
    only an ambiguity note named before, with exit 0)."""
    wide = _adapter(tmp_path / "r600", {f"{P}.lora_A.weight": _entry([600, 1], 0, 2400),
                                        f"{P}.lora_B.weight": _entry([1, 600], 2400, 4800)}, b"\0" * 4800,
                    config={"peft_type": "LORA", "r": 600, "lora_alpha": 600})
    assert main(["inspect", str(wide)]) == 0
    assert main(["inspect", str(wide), "--strict"]) == 1
    assert "has rank 600" in capsys.readouterr().out
    e = "base_model.model.model.layers.0.mlp.experts.99999999"
    corrupt = _adapter(tmp_path / "index", {f"{e}.gate_proj.lora_A.weight": _entry([1, 8], 0, 32),
                                            f"{e}.gate_proj.lora_B.weight": _entry([6, 1], 32, 56)}, b"\0" * 56)
    assert main(["inspect", str(corrupt), "--strict"]) == 1
    assert "names expert 99999999; at most 65536" in capsys.readouterr().out
