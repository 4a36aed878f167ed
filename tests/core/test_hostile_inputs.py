"""A corpus of hostile inputs for the core: each gets a typed error that names the problem, and changes nothing.

Every case asserts (1) the error type, (2) a fragment of the message that names what is wrong
(and, where there is one, the fix), and (3) that nothing was written: the test's folder holds
exactly the files it held before. Server routes and the worker loader have their own corpus in
``tests/integration/test_hostile_server.py``.
"""

from __future__ import annotations

import json
import os
import resource
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from factories import lora_config, make_dense_adapter, write_adapter
from vllm_lora_ext.config import config_from_dict, infer_config, read_config
from vllm_lora_ext.errors import (
    AdapterFormatError,
    AdapterSourceError,
    DeploymentConfigError,
    ExpertCountError,
    ExpertLayoutError,
    MixError,
    UnsafeFormatError,
)
from vllm_lora_ext.formats.moe import MoESpec
from vllm_lora_ext.formats.moe_plan import plan_experts
from vllm_lora_ext.mixing import MixSpec, check_weight, parse_mix_expression, resolve_mix
from vllm_lora_ext.offline_ops import ep_read_plan, moe_specs
from vllm_lora_ext.reader import read_header
from vllm_lora_ext.sources import parse_source
from vllm_lora_ext.validation import check_dense_factors, check_factor_dtypes, check_finite, ModuleDims


def _snapshot(folder: Path) -> dict[str, int]:
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))}


def _expect(fn: Callable[[], Any], err: type[BaseException], fragment: str, folder: Path | None = None) -> None:
    before = _snapshot(folder) if folder else None
    with pytest.raises(err) as e:
        fn()
    assert fragment in str(e.value), f"{fragment!r} not in {str(e.value)!r}"
    assert len(str(e.value)) < 3000  # a hostile value is never echoed whole
    if folder is not None:
        assert _snapshot(folder) == before  # nothing written


# ------------------------------------------------------------------------------------------------ sources (32)

SOURCES = [
    ("", "Empty adapter source"),
    ("   ", "Empty adapter source"),
    (" hf:a/b", "leading or trailing whitespace"),
    ("hf:", "empty repo id"),
    ("hf:/b", "must be 'org/repo'"),
    ("hf:a/", "must be 'org/repo'"),
    ("hf:a/b/c", "must be 'org/repo'"),
    ("hf:a//b", "must be 'org/repo'"),
    ("hf:-a/b", "invalid name '-a'"),
    ("hf:a/b-", "invalid name 'b-'"),
    ("hf:a--x/b", "invalid name 'a--x'"),
    ("hf:a/b..c", "invalid name 'b..c'"),
    ("hf:a/b.git", "ends with '.git'"),
    ("hf:" + "a" * 97 + "/b", "invalid name"),
    ("hf:a/b@", "empty revision"),
    ("hf:a/b@..", "not a valid branch"),
    ("hf:a/b@/main", "not a valid branch"),
    ("hf:a/b@ma in", "not a valid branch"),
    ("hf:a/b@x" + "y" * 300, "not a valid branch"),
    ("hf:a/b:", "empty path after ':'"),
    ("hf:a/b:/etc/passwd", "absolute path"),
    ("hf:a/b:../x", "'..' in path"),
    ("hf:a/b:x/../../y", "'..' in path"),
    ("hf:a/b:x\\y", "backslash"),
    ("hf:a/b:x//y", "empty or '.' component"),
    ("hf:a/b:./x", "empty or '.' component"),
    ("hf:a/b:C:/x", "absolute path"),
    ("hf:a/b:adapter_config.json", "is a config file"),
    ("hf://a/b", "unknown scheme"),
    ("huggingface:a/b", "unknown scheme"),
    ("a\x00b", "NUL byte"),
    ("hf:a/b:x\x00y", "NUL byte"),
]


@pytest.mark.parametrize(("source", "fragment"), SOURCES, ids=[f"source{i}" for i in range(len(SOURCES))])
def test_malformed_sources_are_refused_before_any_io(source: str, fragment: str, tmp_path: Path) -> None:
    _expect(lambda: parse_source(source), AdapterSourceError, fragment, tmp_path)


@pytest.mark.parametrize("source", ["hf:a/b:weights.bin", "hf:a/b:x/model.pt", "/models/x/adapter.pth",
                                    "~/a/model.ckpt"])
def test_pickle_sources_are_refused_without_opt_in(source: str, tmp_path: Path) -> None:
    _expect(lambda: parse_source(source), UnsafeFormatError, "VLLM_LORA_EXT_ALLOW_PICKLE=1", tmp_path)


# ------------------------------------------------------------------------------------------------ files (31)


def _st(header: Any, data: bytes = b"", *, raw_header: bytes | None = None, declared: int | None = None) -> bytes:
    blob = raw_header if raw_header is not None else json.dumps(header).encode()
    return struct.pack("<Q", len(blob) if declared is None else declared) + blob + data


def _entry(dtype: str = "F32", shape: list[Any] | None = None, offsets: list[Any] | None = None) -> dict[str, Any]:
    return {"dtype": dtype, "shape": [2, 2] if shape is None else shape, "data_offsets": offsets or [0, 16]}


FILES: list[tuple[str, bytes, str]] = [
    ("empty", b"", "shorter than 8 bytes"),
    ("seven-bytes", b"\x01" * 7, "shorter than 8 bytes"),
    ("header-past-eof", _st({}, declared=1 << 20), "declares a 1048576-byte header"),
    ("header-over-100MB", _st({}, declared=200 << 20), "limit 100 MB"),
    ("header-not-json", _st(None, raw_header=b"{nope"), "not valid JSON"),
    ("header-not-utf8", _st(None, raw_header=b"\xff\xfe{}"), "not valid JSON"),
    ("header-array", _st([1, 2]), "not a JSON object"),
    ("header-nested-deep", _st(None, raw_header=b'{"a":{"x":' + b"[" * 100_000 + b"]" * 100_000 + b"}}"),
     "not valid JSON"),
    ("metadata-nested-deep", _st(None, raw_header=b'{"__metadata__":{"x":' + b'{"y":' * 100_000 + b"1"
                                                + b"}" * 100_001 + b"}"), "not valid JSON"),
    ("duplicate-key", _st(None, raw_header=b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, '
                                           b'"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}')
     + b"\0" * 4, "duplicate key 'a'"),
    ("metadata-not-dict", _st({"__metadata__": [1]}), "'__metadata__' must map strings to strings"),
    ("metadata-int-value", _st({"__metadata__": {"a": 1}}), "'__metadata__' must map strings to strings"),
    ("entry-not-dict", _st({"k": 5}), "header entry 'k' is malformed"),
    ("missing-dtype", _st({"k": {"shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "is malformed"),
    ("unknown-dtype", _st({"k": _entry("X9")}, b"\0" * 16), "unknown dtype"),
    ("shape-not-list", _st({"k": _entry(shape="22")}, b"\0" * 16), "invalid shape or offsets"),  # type: ignore[arg-type]
    ("shape-negative", _st({"k": _entry(shape=[-2, -2])}, b"\0" * 16), "invalid shape or offsets"),
    ("shape-bool", _st({"k": _entry(shape=[True, 4])}, b"\0" * 16), "invalid shape or offsets"),
    ("shape-float", _st({"k": _entry(shape=[2.0, 2])}, b"\0" * 16), "invalid shape or offsets"),
    ("ndim-9", _st({"k": _entry(shape=[1] * 9, offsets=[0, 4])}, b"\0" * 4), "invalid shape or offsets"),
    ("offsets-three", _st({"k": _entry(offsets=[0, 8, 16])}, b"\0" * 16), "is malformed"),
    ("offsets-reversed", _st({"k": _entry(offsets=[16, 0])}, b"\0" * 16), "invalid shape or offsets"),
    ("offsets-negative", _st({"k": _entry(offsets=[-16, 0])}, b"\0" * 16), "invalid shape or offsets"),
    ("offsets-bool", _st({"k": _entry(shape=[1], offsets=[False, True])}, b"\0"), "invalid shape or offsets"),
    ("span-mismatch", _st({"k": _entry(shape=[2, 3])}, b"\0" * 16), "declares shape [2, 3] of F32 (24 bytes)"),
    ("overlap", _st({"a": _entry(), "b": _entry(offsets=[8, 24])}, b"\0" * 24), "overlaps the tensor before it"),
    ("gap", _st({"a": _entry(), "b": _entry(offsets=[20, 36])}, b"\0" * 36), "leaves a gap before it"),
    ("not-from-zero", _st({"a": _entry(offsets=[4, 20])}, b"\0" * 20), "leaves a gap before it"),
    ("trailing-data", _st({"a": _entry()}, b"\0" * 32), "trailing data"),
    ("truncated-data", _st({"a": _entry()}, b"\0" * 8), "truncated"),
    ("huge-declared-span", _st({"a": _entry(shape=[3 << 30], offsets=[0, 3 << 30], dtype="U8")}, b"\0" * 8),
     "truncated"),
]


@pytest.mark.parametrize(("name", "data", "fragment"), FILES, ids=[f[0] for f in FILES])
def test_malformed_safetensors_headers_are_refused_naming_the_entry(name: str, data: bytes, fragment: str,
                                                                    tmp_path: Path) -> None:
    path = tmp_path / "x.safetensors"
    path.write_bytes(data)
    _expect(lambda: read_header(path), AdapterFormatError, fragment, tmp_path)


def test_a_sparse_file_declaring_3_gib_allocates_nothing(tmp_path: Path) -> None:
    path = tmp_path / "sparse.safetensors"
    head = _st({"a": _entry(shape=[3 << 30], offsets=[0, 3 << 30], dtype="U8")})
    with path.open("wb") as f:
        f.write(head)
        f.truncate(len(head) + (3 << 30) - 1)  # one byte short: sparse, nothing on disk
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    _expect(lambda: read_header(path), AdapterFormatError, "truncated", None)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 64 * 1024  # KiB: < 64 MiB grew


# ------------------------------------------------------------------------------------------------ configs (35)

CONFIGS: list[tuple[dict[str, Any], str]] = [
    ({"r": True, "lora_alpha": 8}, "rank r=True must be an integer"),
    ({"r": "8", "lora_alpha": 8}, "rank r='8' must be an integer"),
    ({"r": 0, "lora_alpha": 8}, "rank r=0 must be an integer from 1"),
    ({"r": -4, "lora_alpha": 8}, "rank r=-4"),
    ({"r": 1.5, "lora_alpha": 8}, "rank r=1.5"),
    ({"r": 10**9, "lora_alpha": 8}, "rank r=1000000000"),
    ({"r": None, "lora_alpha": 8}, "rank r=None"),
    ({"lora_alpha": 8}, "config has no rank 'r'"),
    ({"r": 8, "lora_alpha": "16"}, "lora_alpha='16' is not a finite number"),
    ({"r": 8, "lora_alpha": float("nan")}, "lora_alpha=nan is not a finite number"),
    ({"r": 8, "lora_alpha": float("inf")}, "lora_alpha=inf"),
    ({"r": 8, "lora_alpha": True}, "lora_alpha=True"),
    ({"r": 8, "use_rslora": "false"}, "use_rslora='false' must be true or false"),
    ({"r": 8, "use_rslora": 1}, "use_rslora=1 must be true or false"),
    ({"r": 8, "use_dora": "false"}, "use_dora='false' must be true or false"),
    ({"r": 8, "fan_in_fan_out": "no"}, "fan_in_fan_out='no'"),
    ({"r": 8, "rank_pattern": ["q_proj", 4]}, "rank_pattern must be an object"),
    ({"r": 8, "rank_pattern": {"q_proj": True}}, "rank_pattern['q_proj']=True must be an integer"),
    ({"r": 8, "rank_pattern": {"q_proj": 0}}, "rank_pattern['q_proj']=0"),
    ({"r": 8, "rank_pattern": {"q_proj": 4.5}}, "rank_pattern['q_proj']=4.5"),
    ({"r": 8, "alpha_pattern": {"q_proj": float("nan")}}, "alpha_pattern['q_proj']=nan must be a finite number"),
    ({"r": 8, "alpha_pattern": {"q_proj": "x"}}, "alpha_pattern['q_proj']='x'"),
    ({"r": 8, "target_modules": 5}, "target_modules=5 must be a string or a list of strings"),
    ({"r": 8, "target_modules": ["q", 5]}, "target_modules=['q', 5]"),
    ({"r": 8, "target_parameters": "experts"}, "target_parameters='experts' must be a list of strings"),
    ({"r": 8, "peft_version": 0.17}, "peft_version=0.17 must be a string"),
    ({"r": 8, "moe_3d_orientation": "sideways"}, "moe_3d_orientation='sideways'"),
    ({"r": 8, "peft_type": "IA3"}, "peft_type='IA3' is not LoRA"),
    ({"r": 8, "use_dora": True}, "DoRA (use_dora=true) is not supported"),
    ({"r": 8, "bias": "all"}, "bias != 'none'"),
    ({"r": 8, "modules_to_save": ["lm_head"]}, "modules_to_save holds fully trained modules"),
    ({"r": 8, "fan_in_fan_out": True}, "fan_in_fan_out=true"),
    ({"r": 8, "init_lora_weights": "pissa_niter_4"}, "changes the base weights"),
    ({"r": 8, "lora_bias": True}, "lora_bias=true"),
    ({"r": 8, "lora_alpha": 10**400}, "is not a finite number"),  # an int no float holds: not an OverflowError
    ({"r": 8, "alpha_pattern": {"q_proj": -10**400}}, "must be a finite number"),
    ({"r": 8, "rank_pattern": {"a{4294967296}": 4}}, "is not a regular expression PEFT can compile"),
    ({"r": 8, "rank_pattern": {"(" * 500 + ")" * 500: 4}}, "is not a regular expression PEFT can compile"),
    ({"r": 8, "alpha_pattern": {"q_proj(": 4}}, "alpha_pattern key 'q_proj(' is not a regular expression"),
    ({"r": 8, "rank_pattern": {"q" * 1025: 4}}, "is 1025 characters, more than 1024"),
]


@pytest.mark.parametrize(("raw", "fragment"), CONFIGS, ids=[f"config{i}" for i in range(len(CONFIGS))])
def test_config_values_of_the_wrong_type_or_meaning_are_refused(raw: dict[str, Any], fragment: str,
                                                               tmp_path: Path) -> None:
    _expect(lambda: config_from_dict(raw, name="x"), AdapterFormatError, fragment, tmp_path)


@pytest.mark.parametrize(("content", "fragment"), [
    (b"{" + b" " * (1 << 20) + b"}", "is larger than 1048576 bytes"),
    (b"{nope", "is not valid JSON"),
    (b"\xff\xfe", "is not valid JSON"),
    (b"[1, 2]", "must be a JSON object"),
    (b"[" * 100_000 + b"]" * 100_000, "is not valid JSON"),
])
def test_config_files_that_are_huge_or_not_json_objects_are_refused(content: bytes, fragment: str,
                                                                   tmp_path: Path) -> None:
    p = tmp_path / "adapter_config.json"
    p.write_bytes(content)
    _expect(lambda: read_config(p, name="x"), AdapterFormatError, fragment, tmp_path)


@pytest.mark.parametrize(("metadata", "fragment"), [
    ({"lora_alpha": "8", "r": "abc"}, "rank 'abc' in its safetensors metadata is not an integer"),
    ({"lora_alpha": "nan"}, "lora_alpha 'nan' in its safetensors metadata is not a finite number"),
    ({"lora_alpha": "sixteen"}, "lora_alpha 'sixteen'"),
    ({"lora_alpha": "8", "use_rslora": "maybe"}, "use_rslora 'maybe' in its safetensors metadata"),
    ({}, "no 'lora_alpha' in its safetensors metadata"),
])
def test_inferred_configs_refuse_malformed_metadata(metadata: dict[str, str], fragment: str) -> None:
    shapes = {"m.q_proj.lora_A.weight": (4, 8), "m.q_proj.lora_B.weight": (8, 4)}
    _expect(lambda: infer_config(shapes, metadata, name="x"), AdapterFormatError, fragment)


# ------------------------------------------------------------------------------------------------ tensors (14)

A, B = "m.q_proj.lora_A.weight", "m.q_proj.lora_B.weight"
TENSORS: list[tuple[dict[str, tuple[int, ...]], str]] = [
    ({A: (4, 16)}, "lora_A without lora_B"),
    ({B: (16, 4)}, "lora_B without lora_A"),
    ({A: (64,), B: (16, 4)}, "factors must be 2-D"),
    ({A: (4, 16), B: (16, 4, 1)}, "factors must be 2-D"),
    ({A: (), B: (16, 4)}, "factors must be 2-D"),
    ({A: (8, 16), B: (16, 4)}, "lora_A has rank 8 but lora_B has rank 4"),
    ({A: (0, 16), B: (16, 0)}, "rank 0: lora_A is (0, 16) and lora_B (16, 0), a LoRA with no rank"),
    ({A: (4, 0), B: (0, 4)}, "empty factor"),
    ({A: (4, 99), B: (16, 4)}, "factors map 99 -> 16 but the model's m.q_proj maps 16 -> 16"),
    ({A: (4, 16), B: (17, 4)}, "factors map 16 -> 17"),
]


@pytest.mark.parametrize(("shapes", "fragment"), TENSORS, ids=[f"tensors{i}" for i in range(len(TENSORS))])
def test_factors_that_do_not_fit_each_other_or_the_model_are_refused(shapes: dict[str, tuple[int, ...]],
                                                                     fragment: str) -> None:
    _expect(lambda: check_dense_factors(shapes, list(shapes), {"m.q_proj": ModuleDims(16, 16)}, adapter="x"),
            AdapterFormatError, fragment)


@pytest.mark.parametrize("dtype", ["F8_E4M3", "I32", "BOOL", "U8"])
def test_non_float_factors_are_refused_naming_the_dtype(dtype: str) -> None:
    _expect(lambda: check_factor_dtypes({A: dtype, B: "BF16"}, adapter="x"), AdapterFormatError, f"is {dtype}")


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_factors_are_refused_naming_the_key(bad: float) -> None:
    t = torch.ones(4, 16, dtype=torch.bfloat16)
    t[1, 3] = bad
    _expect(lambda: check_finite({A: torch.ones(4, 16), B: t}, adapter="x"), AdapterFormatError, f"tensor {B!r}")


def test_finite_factors_whose_sum_overflows_are_not_refused() -> None:
    check_finite({A: torch.full((1024, 1024), 3e38, dtype=torch.float32)}, adapter="x")  # the control


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_the_fused_norm_scan_of_a_staged_model_finds_what_the_sum_scan_finds(dtype: torch.dtype,
                                                                              bad: float | None) -> None:
    """``validation._gpu_nonfinite`` (what ``first_nonfinite`` runs on tensors on one GPU: torch's fused inf-norm per
    dtype, one sync) names the first non-finite tensor among many of mixed dtypes, as the CPU's sums do; a finite
    tensor of maxima near float32's range is not refused (a maximum does not overflow). Run here on the CPU, whose
    ``_foreach_norm`` is the same operation; ``tests/gpu/test_staging.py`` runs it on CUDA."""
    from vllm_lora_ext.validation import _gpu_nonfinite, _norms_propagate, first_nonfinite

    assert _norms_propagate(torch.device("cpu"))
    tensors = {f"m{i}.lora_a": torch.full((4, 16), 0.5, dtype=torch.float32 if i % 2 else torch.bfloat16)
               for i in range(6)}
    tensors["big"] = torch.full((64, 64), 3e38, dtype=torch.float32)
    t = torch.ones(4, 16).to(dtype)
    if bad is not None:
        t[2, 5] = bad
    tensors["m3.lora_b[1]"] = t
    tensors["m4.lora_b"] = torch.full((2, 2), float("nan")) if bad is not None else torch.ones(2, 2)
    want = None if bad is None else "m3.lora_b[1]"
    assert _gpu_nonfinite(list(tensors.items())) == want
    assert first_nonfinite(tensors) == want  # (the CPU's sums)


# ------------------------------------------------------------------------------------------------ MoE / EP (15)

SPEC = MoESpec("model.layers.0.mlp.experts", num_experts=4, hidden=8, intermediate=6)
P = "base_model.model.model.layers.0.mlp.experts"
MOE: list[tuple[dict[str, tuple[int, ...]], str]] = [
    ({f"{P}.7.gate_proj.lora_A.weight": (2, 8), f"{P}.7.gate_proj.lora_B.weight": (6, 2)}, "expert 7 out of range"),
    ({f"{P}.99999999.up_proj.lora_A.weight": (2, 8), f"{P}.99999999.up_proj.lora_B.weight": (6, 2)},
     "expert 99999999 out of range"),
    ({f"{P}.0.w9.lora_A.weight": (2, 8), f"{P}.0.w9.lora_B.weight": (6, 2)}, "projection 'w9' is not one of"),
    ({f"{P}.0.gate_proj.lora_A.weight": (2, 9), f"{P}.0.gate_proj.lora_B.weight": (6, 2)},
     "expected A(r, 8) B(6, r) for gate"),
    ({f"{P}.0.down_proj.lora_A.weight": (2, 6), f"{P}.0.down_proj.lora_B.weight": (8, 3)},
     "expected A(r, 6) B(8, r) for down"),
    ({f"{P}.0.gate_proj.lora_A.weight": (2, 8)}, "lora_A without its partner"),
    ({f"{P}.lora_A.weight": (8, 5), f"{P}.lora_B.weight": (12, 8)}, "fit neither gate_up"),
    ({f"{P}.lora_A.weight": (6, 8), f"{P}.lora_B.weight": (12, 6)}, "both must be r·E with E=4"),
    ({f"{P}.lora_A.weight": (8,), f"{P}.lora_B.weight": (12, 8)}, "lora tensors must be 2-D"),
    ({f"{P}.0.gate_proj.lora_A.weight": (2, 8), f"{P}.0.gate_proj.lora_B.weight": (6, 2),
      f"{P}.base_layer.lora_A.weight": (8, 8), f"{P}.base_layer.lora_B.weight": (12, 8)}, "given twice"),
]


@pytest.mark.parametrize(("shapes", "fragment"), MOE, ids=[f"moe{i}" for i in range(len(MOE))])
def test_moe_keys_that_do_not_fit_the_model_are_refused(shapes: dict[str, tuple[int, ...]], fragment: str) -> None:
    _expect(lambda: plan_experts(shapes, SPEC, adapter="x"), ExpertLayoutError, fragment)


def test_ambiguous_3d_orientation_without_a_hint_is_refused() -> None:
    spec = MoESpec("model.layers.0.mlp.experts", num_experts=2, hidden=8, intermediate=4)  # H == 2I
    shapes = {f"{P}.lora_A.weight": (4, 8), f"{P}.lora_B.weight": (8, 4)}
    _expect(lambda: plan_experts(shapes, spec, adapter="x"), ExpertLayoutError, "moe_3d_orientation")


@pytest.mark.parametrize(("base", "fragment"), [
    (None, "pass the base model's config"),
    ({"num_experts": 4, "hidden_size": True, "moe_intermediate_size": 6}, "hidden_size=True must be an integer"),
    ({"num_experts": "4", "hidden_size": 8, "moe_intermediate_size": 6}, "num_experts='4'"),
    ({"num_experts": 10**9, "hidden_size": 8, "moe_intermediate_size": 6}, "num_experts=1000000000"),
])
def test_moe_specs_without_usable_sizes_are_refused(base: dict[str, Any] | None, fragment: str) -> None:
    shapes = {f"{P}.lora_A.weight": (8, 8), f"{P}.lora_B.weight": (12, 8)}
    _expect(lambda: moe_specs(shapes, base_config=base), ExpertLayoutError, fragment)


def test_a_huge_expert_index_is_refused_before_it_sizes_any_work() -> None:
    shapes = {f"{P}.99999999.gate_proj.lora_A.weight": (2, 8), f"{P}.99999999.gate_proj.lora_B.weight": (6, 2)}
    _expect(lambda: moe_specs(shapes), ExpertCountError, "names expert 99999999; at most 65536")


def test_ep_plan_splits_unevenly_as_vllm_places_experts_and_refuses_more_ranks_than_experts() -> None:
    # vLLM's determine_expert_map (linear): 4 experts over 3 ranks are 0-1, 2, 3
    assert [r["experts"]["e"] for r in ep_read_plan({}, 8, {}, {"e": SPEC}, 3)] == ["0-1", "2-2", "3-3"]
    # a huge --ep-size sizes no loop: refused before any rank is planned
    _expect(lambda: ep_read_plan({}, 8, {}, {"e": SPEC}, 10**9), ExpertLayoutError,
            "EP size 1000000000 is more than the 4 experts of 'e': give an EP size of at most 4")


# ------------------------------------------------------------------------------------------------ deployment (22)

BOMB = ("a: &a [x,x,x,x,x,x,x,x,x]\nb: &b [*a,*a,*a,*a,*a,*a,*a,*a,*a]\nc: &c [*b,*b,*b,*b,*b,*b,*b,*b,*b]\n"
        "d: &d [*c,*c,*c,*c,*c,*c,*c,*c,*c]\ne: &e [*d,*d,*d,*d,*d,*d,*d,*d,*d]\nf: &f [*e,*e,*e,*e,*e,*e,*e,*e,*e]\n"
        "g: &g [*f,*f,*f,*f,*f,*f,*f,*f,*f]\nadapters:\n  x: {source: /x, weight: *g}\n")
DEPLOY: list[tuple[str, str, str]] = [
    ("d.yaml", "adapters:\n  a: /x\n  a: /y\n", "'a' is given twice (line 3)"),
    ("d.json", '{"adapters": {"a": "/x", "a": "/y"}}', "'a' is given twice"),
    ("d.yaml", "adapters:\n  a: {source: 5}\n", "'source' must be a string"),
    ("d.yaml", "adapters:\n  a: {source: [hf:a/b]}\n", "'source' must be a string"),
    ("d.yaml", "adapters:\n  a: {source: {x: 1}}\n", "'source' must be a string"),
    ("d.yaml", "adapters: {}\n" + BOMB.split("adapters:")[0], "has unknown keys"),
    ("d.yaml", "adapters:\n  x: {source: /x, weight: " + "[" * 50 + "1" + "]" * 50 + "}\n", "is not a number"),
    ("d.yaml", "adapters: [a, b]\n", "'adapters' must map names"),
    ("d.yaml", "adapters:\n  a: {weight: 0.5}\n", "adapter 'a' needs a 'source'"),
    ("d.yaml", "adapters:\n  a: {source: /x, wieght: 0.5}\n", "unknown keys ['wieght']"),
    ("d.yaml", "adapters:\n  a+b: /x\n", "Adapter name 'a+b' contains '+', which the mix grammar reserves"),
    ("d.yaml", "adapters:\n  -x: /x\n", "Invalid adapter name '-x'"),
    ("d.yaml", "adapters:\n  mix-style: /x\n", "Adapter name 'mix-style' starts with 'mix-', which is reserved for the server's weighted mixes"),
    ("d.yaml", "adapters:\n  " + "n" * 200 + ": /x\n", "Invalid adapter name"),
    ("d.yaml", "adapters:\n  a: {source: /x, weight: .nan}\n", "is not finite"),
    ("d.yaml", "adapters:\n  a: {source: /x, weight: 1.0e+308}\n", "outside [-100, 100]"),
    ("d.yaml", "adapters:\n  a: {source: /x, weight: 1e308}\n", "is not a number"),  # YAML 1.1: a string
    ("d.yaml", "adapters:\n  a: {source: /x, weight: true}\n", "Weight True of adapter 'a' is not a number"),
    ("d.yaml", "adapters:\n  a: {source: /x, weight: '0.5'}\n", "Weight '0.5' of adapter 'a' is not a number"),
    ("d.yaml", "adapters:\n  a: /x\ndefault: b\n", "default adapter 'b' is not among the adapters"),
    ("d.yaml", "adapters:\n  a: /x\ndefault: [a]\n", "'default' must be an adapter name"),
    ("d.yaml", "adapters:\n  a: 'hf:a/b@'\n", "empty revision after '@'"),
    ("d.yaml", "adapters: {a: /x\n", "is not valid yaml"),
    ("d.json", "{nope", "is not valid json"),
    ("d.json", " " * (1 << 20) + "{}", "is larger than 1048576 bytes"),
]


@pytest.mark.parametrize(("name", "text", "fragment"), DEPLOY, ids=[f"deploy{i}" for i in range(len(DEPLOY))])
def test_malformed_deployment_configs_are_refused_at_start_up(name: str, text: str, fragment: str,
                                                             tmp_path: Path) -> None:
    from vllm_lora_ext.deployment import read_deployment_config

    p = tmp_path / name
    p.write_text(text)
    _expect(lambda: read_deployment_config(p), DeploymentConfigError, fragment, tmp_path)


def test_a_yaml_alias_bomb_is_refused_quickly_and_never_echoed_whole(tmp_path: Path) -> None:
    import time

    from vllm_lora_ext.deployment import read_deployment_config

    p = tmp_path / "bomb.yaml"
    p.write_text(BOMB.replace("adapters:\n  x: {source: /x, weight: *g}\n", "") + "adapters:\n  x: {source: /x, weight: *g}\n")
    t0 = time.perf_counter()
    _expect(lambda: read_deployment_config(p), DeploymentConfigError, "has unknown keys", tmp_path)
    assert time.perf_counter() - t0 < 2.0


def test_a_missing_deployment_config_names_the_variable(tmp_path: Path) -> None:
    from vllm_lora_ext.deployment import read_deployment_config

    _expect(lambda: read_deployment_config(tmp_path / "none.yaml"), DeploymentConfigError, "VLLM_LORA_EXT_CONFIG")


# ------------------------------------------------------------------------------------------------ mixes (37)

WEIGHTS: list[tuple[Any, str]] = [
    (float("nan"), "is not finite"), (float("inf"), "is not finite"), (float("-inf"), "is not finite"),
    (1e308, "outside [-100, 100]"), (100.5, "outside [-100, 100]"), (-101, "outside [-100, 100]"), (10**400, "outside"),
    (True, "is not a number"), ("0.5", "is not a number"), (None, "is not a number"), ([1.0], "is not a number"),
]


@pytest.mark.parametrize(("weight", "fragment"), WEIGHTS, ids=[f"weight{i}" for i in range(len(WEIGHTS))])
def test_the_one_weight_rule_refuses_non_finite_huge_and_non_numbers(weight: Any, fragment: str) -> None:
    _expect(lambda: check_weight(weight, name="a"), MixError, fragment)


EXPRESSIONS = [
    ("", "empty adapter name"), ("a=", "empty weight after '='"), ("=0.5", "empty adapter name"), ("a=x", "is not a number"),
    ("a=nan", "is not finite"), ("a=1e400", "is not finite"), ("a=-inf", "is not finite"), ("a=1e300", "outside"),
    ("a=0.5+", "empty adapter name"), ("+".join(f"a{i}" for i in range(17)), "more than the 16 allowed"),
    ("a=0_5", "is not a number"), ("a=\u0661", "is not a number"), ("a=0x10", "is not a number"),  # never 5 or 1
    ("a=\u0131nf", "is not a number"), ("a=\u0130nf", "is not a number"),  # dotless/dotted I fold to 'i' unless ASCII
]


@pytest.mark.parametrize(("expr", "fragment"), EXPRESSIONS, ids=[f"expr{i}" for i in range(len(EXPRESSIONS))])
def test_malformed_mix_expressions_are_refused(expr: str, fragment: str) -> None:
    _expect(lambda: parse_mix_expression(expr), MixError, fragment)


PATHS = [
    ("mix:", "not JSON"), ("mix:[]", "expected"), ("mix:{}", "expected"), ('mix:{"v":2,"adapters":[]}', "expected"),
    ('mix:{"v":1,"adapters":[["a","/a"]]}', "expected"), ('mix:{"v":1,"adapters":[["a","/a",0.5]],"x":1}', "expected"),
    ('mix:{"v":1,"adapters":[["a","/a","0.5"]]}', "is not a number"),
    ('mix:{"v":1,"adapters":[["a","/a",1e308]]}', "outside"),
    ('mix:{"v":1,"adapters":[[5,"/a",0.5]]}', "needs a name and a source"),
    ('mix:{"v":1,"adapters":[["a","",0.5]]}', "needs a name and a source"),
    ('mix:{"v":1,"adapters":[]}', "at least one adapter"),
    ('mix:{"v":1,"adapters":[["a","/a",0.5],["a","/b",0.5]]}', "appear more than once"),
    ("mix:" + "x" * 70_000, "longer than"), ("/not/a/mix", "is not a mix path"),
]


@pytest.mark.parametrize(("path", "fragment"), PATHS, ids=[f"mixpath{i}" for i in range(len(PATHS))])
def test_malformed_mix_paths_are_refused(path: str, fragment: str) -> None:
    _expect(lambda: MixSpec.from_path(path), MixError, fragment)


@pytest.mark.parametrize(("adapters", "weights", "fragment"), [
    (["a", "nope"], None, "Unknown adapter(s) ['nope']"),
    (None, [1.0], "without adapters"),
    (["a"], [0.5, 0.5], "1 adapters but 2 adapter_weights"),
    ([f"a{i}" for i in range(17)], None, "more than the 16 one mix may have"),
])
def test_mix_resolution_refuses_unknown_names_and_mismatches(adapters: Any, weights: Any, fragment: str) -> None:
    _expect(lambda: resolve_mix(adapters, weights, sources={"a": "/a"}, default_weights={}), MixError, fragment)


# ------------------------------------------------------------------------------------------------ CLI (18)


def _cli(*argv: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", *argv], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=120)


def _cli_cases(tmp: Path) -> list[tuple[list[str], int, str]]:
    src = make_dense_adapter(tmp / "src")
    other = make_dense_adapter(tmp / "other", seed=3)
    (tmp / "afile").write_text("x")
    (tmp / "full").mkdir()
    (tmp / "full" / "keep.txt").write_text("keep")
    (tmp / "base-array.json").write_text("[1]")
    (tmp / "base-bad.json").write_text("{nope")
    return [
        (["inspect", str(tmp / "missing")], 1, "does not exist"),
        (["inspect", str(src), "--ep-size", "-2"], 2, "-2 is out of range"),
        (["inspect", str(src), "--ep-size", "0"], 2, "0 is out of range"),
        (["inspect", str(src), "--ep-size", "x"], 2, "'x' is not an integer"),
        (["inspect", str(src), "--ep-size", str(10**9)], 2, "out of range"),
        (["inspect", str(src), "--base-config", str(tmp / "nope.json")], 1, "does not exist"),
        (["inspect", str(src), "--base-config", str(tmp / "base-array.json")], 1, "must be a JSON object"),
        (["inspect", str(src), "--base-config", str(tmp / "base-bad.json")], 1, "is not valid JSON"),
        (["inspect", "/" + "x" * 5000], 1, "at most 255 bytes"),
        (["inspect", "hf:a/b@"], 1, "empty revision"),
        (["convert", str(src), "--to", "2d", "-o", str(tmp / "afile")], 1, "is a file"),
        (["convert", str(src), "--to", "2d", "-o", str(tmp / "full")], 1, "is not empty"),
        (["convert", str(src), "--to", "2d", "-o", str(src)], 1, "holds an input adapter"),
        (["convert", str(src), "--to", "2d", "-o", str(tmp / "new"), "--num-experts", "0"], 2, "0 is out of range"),
        (["mix", f"{src}=nan", f"{other}=0.5", "-o", str(tmp / "new")], 1, "is not finite"),
        (["mix", f"{src}=1e308", "-o", str(tmp / "new")], 1, "outside [-100, 100]"),
        (["mix", f"{src}=x", "-o", str(tmp / "new")], 1, "is not a number"),
        (["mix", f"{src}=0.5", f"{other}=0.5", "-o", str(tmp / "full")], 1, "is not empty"),
        (["mix", f"{src}=0.5", "-o", str(src)], 1, "holds an input adapter"),
        (["mix", *[f"{src}=0.1"] * 17, "-o", str(tmp / "new")], 1, "more than the 16"),
    ]


def test_cli_failures_are_one_error_line_and_write_nothing(tmp_path: Path) -> None:
    cases = _cli_cases(tmp_path)
    assert len(cases) >= 18
    for argv, code, fragment in cases:
        before = _snapshot(tmp_path)
        out = _cli(*argv, cwd=tmp_path)
        last = out.stderr.strip().splitlines()[-1] if out.stderr.strip() else ""
        assert out.returncode == code, (argv, out.returncode, out.stderr[-500:])
        assert "Traceback" not in out.stderr, (argv, out.stderr[-2000:])
        assert "error:" in last and fragment in last, (argv, last)
        assert len([ln for ln in out.stderr.splitlines() if "error:" in ln]) == 1, (argv, out.stderr)
        assert _snapshot(tmp_path) == before, argv


def test_cli_force_writes_into_a_non_empty_folder(tmp_path: Path) -> None:
    from moe_factories import make_truth, write_moe_adapter

    src = write_moe_adapter(tmp_path / "src", [make_truth(4, 8, 6, 2, 0)], ["2d"], rank=2)  # a dense one: a no-op
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("keep")
    out = _cli("convert", str(src), "--to", "3d", "-o", str(tmp_path / "full"), "--force", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert sorted(p.name for p in (tmp_path / "full").iterdir()) == ["adapter_config.json", "adapter_model.safetensors",
                                                                   "keep.txt"]


def test_a_corrupt_adapter_file_is_refused_by_the_cli_in_one_line(tmp_path: Path) -> None:
    folder = tmp_path / "bad"
    write_adapter(folder, {"base_model.model.m.q_proj.lora_A.weight": torch.ones(4, 8)}, lora_config())
    weights = folder / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-8])  # truncated
    out = _cli("inspect", str(folder), cwd=tmp_path)
    assert out.returncode == 1 and "Traceback" not in out.stderr and "truncated" in out.stderr


def test_a_pattern_key_that_backtracks_for_ever_refuses_the_adapter_in_bounded_time() -> None:
    """A rank_pattern key with nested repetition, matched against a name the adapter chose: re would take
    2^n steps (hours at n=60); the match is bounded and refuses the adapter, naming the key."""
    import time

    cfg = config_from_dict({"r": 8, "rank_pattern": {"((a|aa)+)+b": 4}}, name="x")
    start = time.monotonic()
    with pytest.raises(AdapterFormatError, match=r"rank_pattern key '\(\(a\|aa\)\+\)\+b' takes over"):
        cfg.rank_for("a" * 60)
    assert time.monotonic() - start < 5


# The slow key of r35's attack: it backtracks for about 20 ms on a module name, under the 0.05 s one key may take,
# and never matches; 200 of them made a 2-layer adapter's build take 12.6 s, a 1 MiB config's 22,055 hours.
_SLOW_KEY = r"(([a-z_.]|[a-z_.]{2})+)+[0-9](?:i)?"


def test_many_pattern_keys_each_just_under_the_limit_share_one_budget_per_module() -> None:
    import time

    keys = {_SLOW_KEY + "x" * i: 2.0 for i in range(200)}  # distinct keys, each as slow
    cfg = config_from_dict({"r": 8, "lora_alpha": 16, "alpha_pattern": keys}, name="x")
    start = time.monotonic()
    with pytest.raises(AdapterFormatError, match=r"alpha_pattern keys? .* takes? over (0.5|0.05) s to match"):
        cfg.scaling_for("base_model.model.model.layers.0.self_attn.q_proj")
    assert time.monotonic() - start < 5


def test_a_config_with_more_pattern_keys_than_the_limit_is_refused_naming_the_count() -> None:
    from vllm_lora_ext.constants import MAX_PATTERN_KEYS

    many = {f"layers.{i}.q_proj": 4 for i in range(MAX_PATTERN_KEYS + 1)}
    with pytest.raises(AdapterFormatError, match=rf"rank_pattern and alpha_pattern have {MAX_PATTERN_KEYS + 1} keys, "
                                                 rf"more than {MAX_PATTERN_KEYS}"):
        config_from_dict({"r": 8, "rank_pattern": many}, name="x")
    half = dict(list(many.items())[:MAX_PATTERN_KEYS // 2 + 1])  # the two fields count together
    with pytest.raises(AdapterFormatError, match="more than"):
        config_from_dict({"r": 8, "rank_pattern": half, "alpha_pattern": {k: 8 for k in half}}, name="x")
    assert config_from_dict({"r": 8, "rank_pattern": dict(list(many.items())[:MAX_PATTERN_KEYS])}, name="x")


def test_the_shared_pattern_budget_counts_this_threads_cpu_not_a_busy_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reviewer's find: a wall-clock budget refused a legitimate config of 100 anchored keys when other threads
    held the GIL. The budget counts the matching thread's CPU time: a lookup that waits, and spends little, passes."""
    import threading
    import time

    keys = {rf"^model\.layers\.{i}\.self_attn\.q_proj$": 4 for i in range(100)}
    cfg = config_from_dict({"r": 8, "rank_pattern": keys}, name="x")
    stop = threading.Event()

    def spin() -> None:
        while not stop.is_set():
            sum(range(1000))

    spinners = [threading.Thread(target=spin) for _ in range(4)]
    for t in spinners:
        t.start()
    try:
        for layer in range(32):
            assert cfg.rank_for(f"model.layers.{layer}.self_attn.q_proj") == 4
            assert cfg.rank_for(f"model.layers.{layer}.mlp.down_proj") == 8
    finally:
        stop.set()
        for t in spinners:
            t.join()


@pytest.mark.timeout(60)
def test_a_long_run_of_digits_in_a_mix_weight_is_refused_in_linear_time() -> None:
    """`mixing._DECIMAL` split a digit run every way before failing (66 s for 40,000 digits, reachable through the
    4,096-character 'model' field and, before it, a Ray router's multiplexed id); one split a run, and a weight of
    more than 64 characters is refused unread."""
    from vllm_lora_ext.mixing import _DECIMAL, parse_weight

    assert _DECIMAL.fullmatch("1" * 200_000 + "x") is None  # (the old pattern: about 27 minutes)
    with pytest.raises(MixError, match="200001 characters long"):
        parse_mix_expression("a=" + "1" * 200_000 + "x")
    with pytest.raises(MixError, match="70 characters long, more than the 64"):
        parse_weight("0." + "1" * 68, name="a")
    assert parse_weight("0." + "1" * 62, name="a") == pytest.approx(1 / 9)


@pytest.mark.timeout(60)
def test_a_router_ranks_an_over_long_multiplexed_id_as_its_own_key_without_parsing_or_keeping_it() -> None:
    from vllm_lora_ext.constants import MAX_MODEL_FIELD_CHARS
    from vllm_lora_ext.residency import _adapter_id, adapter_id

    long_id = "qwen:a=" + "1" * 200_000 + "x+b=0.5"
    before = _adapter_id.cache_info().currsize
    got = adapter_id(long_id)
    assert got.key == long_id and not got.components
    assert _adapter_id.cache_info().currsize == before
    edge = "qwen:a=0.5+" + "b" * (MAX_MODEL_FIELD_CHARS - 6)  # an adapter part at the limit, as a replica takes
    assert len(edge.partition(":")[2]) == MAX_MODEL_FIELD_CHARS and adapter_id(edge).components  # parsed as before
    assert not adapter_id("q" * (MAX_MODEL_FIELD_CHARS + 1) + ":a=0.5+b").components  # a base beyond it: not kept
