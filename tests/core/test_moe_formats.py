"""MoE layouts: every on-disk form normalizes to the same per-expert deltas; shapes are checked against the model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

from moe_factories import (KeyByKey, Truth, block_tensors, dense_delta, make_truth, oracle_deltas, peft_3d_delta, to_3d, write_moe_adapter)
from factories import lora_config, write_adapter
from vllm_lora_ext.config import config_from_dict
from vllm_lora_ext.errors import ExpertLayoutError
from vllm_lora_ext.formats.moe import MoESpec
from vllm_lora_ext.formats.moe_plan import plan_experts
from vllm_lora_ext.formats.moe_read import ReadOptions, read_experts
from vllm_lora_ext.reader import ReadStats, SafetensorsReader, read_header

E, H, I, R, ALPHA = 8, 32, 12, 4, 16
SCALING = ALPHA / R
SPEC0 = MoESpec("model.layers.0.mlp.experts", E, H, I)
FORMS = ["2d", "3d", "3d_t", "3d_gu+2d_down", "2d_gu+3d_down"]


def _load(folder: Path, spec: MoESpec = SPEC0, experts=None, cfg_extra=None, stats=None):  # type: ignore[no-untyped-def]
    cfg = config_from_dict({**json.loads((folder / "adapter_config.json").read_text()), **(cfg_extra or {})})
    header = read_header(folder / "adapter_model.safetensors")
    mine = {k: v.shape for k, v in header.tensors.items() if f".{spec.prefix}." in f".{k[len('base_model.model.'):]}"}
    plan = plan_experts(mine, spec, config=cfg)
    reader = SafetensorsReader(folder / "adapter_model.safetensors", header=header, stats=stats)
    return plan, read_experts(plan, KeyByKey(reader.read, reader.read_many), config=cfg, experts=experts)


@pytest.fixture(scope="module")
def truth() -> Truth:
    return make_truth(E, H, I, R, seed=0)


@pytest.mark.parametrize("form", FORMS)
def test_every_layout_gives_the_oracle_delta(tmp_path: Path, truth: Truth, form: str) -> None:
    write_moe_adapter(tmp_path, [truth], [form], rank=R, alpha=ALPHA)  # type: ignore[list-item]
    plan, ex = _load(tmp_path)
    oracle = oracle_deltas(truth, SCALING)
    for e in range(E):
        d = dense_delta(ex, e)
        for proj in ("gate", "up", "down"):
            torch.testing.assert_close(d[proj], oracle[proj][e], rtol=1e-5, atol=1e-6)
    assert plan.layout == {"2d": "2d", "3d": "3d", "3d_t": "3d"}.get(form, "2d+3d")


def test_the_same_delta_in_different_layouts_matches_exactly(tmp_path: Path, truth: Truth) -> None:
    deltas = []
    for form in FORMS:
        write_moe_adapter(tmp_path / form, [truth], [form], rank=R, alpha=ALPHA)  # type: ignore[list-item]
        _, ex = _load(tmp_path / form)
        deltas.append([dense_delta(ex, e) for e in range(E)])
    for other in deltas[1:]:
        for e in range(E):
            for proj in ("gate", "up", "down"):
                assert torch.equal(deltas[0][e][proj], other[e][proj])


def test_a_fused_b_copied_by_row_blocks_equals_the_2d_read_bitwise(tmp_path: Path) -> None:
    """A fused B taller than the copy's row block (down's B has H = 200 rows: three blocks of 64 and a rest) is
    copied block by block; its factors equal the per-expert 2D read of the same delta bit for bit."""
    from vllm_lora_ext.formats.moe_read import _ROW_BLOCK

    h = 200
    assert h > _ROW_BLOCK and h % _ROW_BLOCK
    spec = MoESpec("model.layers.0.mlp.experts", E, h, I)
    tall = make_truth(E, h, I, R, seed=5)
    got = {}
    for form in ("2d", "3d"):
        write_moe_adapter(tmp_path / form, [tall], [form], rank=R, alpha=ALPHA)  # type: ignore[list-item]
        got[form] = _load(tmp_path / form, spec)[1]
    for e in range(E):
        for proj in ("gate", "up", "down"):
            assert torch.equal(dense_delta(got["2d"], e)[proj], dense_delta(got["3d"], e)[proj]), (e, proj)
    assert torch.equal(got["2d"].down.b, got["3d"].down.b)  # the factor itself, not only the delta


def test_3d_file_matches_peft_formula(tmp_path: Path, truth: Truth) -> None:
    tensors = block_tensors("model.layers.0.mlp", truth, "3d")
    a = tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_A.weight"]
    b = tensors["base_model.model.model.layers.0.mlp.experts.base_layer.lora_B.weight"]
    write_moe_adapter(tmp_path, [truth], ["3d"], rank=R, alpha=ALPHA)
    _, ex = _load(tmp_path)
    peft = peft_3d_delta(a, b, E, SCALING)  # (E, 2I, H)
    for e in range(E):
        d = dense_delta(ex, e)
        torch.testing.assert_close(torch.cat([d["gate"], d["up"]]), peft[e], rtol=1e-5, atol=1e-6)


def test_as_2d_and_as_3d_carry_the_same_delta(tmp_path: Path, truth: Truth) -> None:
    write_moe_adapter(tmp_path, [truth], ["2d"], rank=R, alpha=ALPHA)
    _, ex = _load(tmp_path)
    a2, b2 = ex.as_2d(num_experts=E, hidden=H)
    a3, b3 = ex.as_3d(hidden=H)
    assert [t.shape for t in a2] == [(E, R, H), (E, R, I), (E, R, H)]
    assert [t.shape for t in b3] == [(E, 2 * I, R), (E, H, R)]  # gate and up share A here: no rank doubling
    for e in range(E):
        w13 = b3[0][e] @ a3[0][e]
        torch.testing.assert_close(w13, torch.cat([b2[0][e] @ a2[0][e], b2[2][e] @ a2[2][e]]), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(b3[1][e] @ a3[1][e], b2[1][e] @ a2[1][e])


def test_interleaved_gate_up_for_gpt_oss_style_models(tmp_path: Path, truth: Truth) -> None:
    write_moe_adapter(tmp_path, [truth], ["2d"], rank=R, alpha=ALPHA)
    spec = MoESpec(SPEC0.prefix, E, H, I, interleaved=True)
    _, ex = _load(tmp_path, spec)
    a3, b3 = ex.as_3d(hidden=H)
    oracle = oracle_deltas(truth, SCALING)
    w13 = b3[0][2] @ a3[0][2]
    torch.testing.assert_close(w13[0::2], oracle["gate"][2], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(w13[1::2], oracle["up"][2], rtol=1e-5, atol=1e-6)


def test_mixtral_w1_w3_w2_names(tmp_path: Path, truth: Truth) -> None:
    write_moe_adapter(tmp_path, [truth], ["2d"], rank=R, alpha=ALPHA, names=("w1", "w3", "w2"),
                      block="block_sparse_moe")
    spec = MoESpec("model.layers.0.block_sparse_moe.experts", E, H, I, gate="w1", up="w3", down="w2")
    _, ex = _load(tmp_path, spec)
    torch.testing.assert_close(dense_delta(ex, 5)["up"], oracle_deltas(truth, SCALING)["up"][5], rtol=1e-5, atol=1e-6)


def test_single_3d_parameter_is_placed_by_shape_not_by_name(tmp_path: Path, truth: Truth) -> None:
    a, b = to_3d(truth.a13, truth.b13)  # a gate_up tensor stored under the *outer* name, where vLLM assumes down
    write_adapter(tmp_path, {"base_model.model.model.layers.0.mlp.experts.lora_A.weight": a,
                             "base_model.model.model.layers.0.mlp.experts.lora_B.weight": b}, lora_config(R, ALPHA))
    plan, ex = _load(tmp_path)
    assert [k.role for k in plan.keys_3d] == ["gate_up"] and ex.down is None
    torch.testing.assert_close(dense_delta(ex, 1)["gate"], oracle_deltas(truth, SCALING)["gate"][1], rtol=1e-5, atol=1e-6)


def test_swapped_nesting_is_read_by_shape(tmp_path: Path, truth: Truth) -> None:
    ga, gb = to_3d(truth.a13, truth.b13)
    da, db = to_3d(truth.ad, truth.bd)
    p = "base_model.model.model.layers.0.mlp.experts"
    write_adapter(tmp_path, {f"{p}.lora_A.weight": ga, f"{p}.lora_B.weight": gb,
                             f"{p}.base_layer.lora_A.weight": da, f"{p}.base_layer.lora_B.weight": db},
                  lora_config(R, ALPHA))
    _, ex = _load(tmp_path)
    torch.testing.assert_close(dense_delta(ex, 0)["down"], oracle_deltas(truth, SCALING)["down"][0], rtol=1e-5, atol=1e-6)


def test_ambiguous_orientation_needs_the_config_to_settle_it(tmp_path: Path) -> None:
    h, i = 24, 12  # H == 2I: a gate_up tensor reads the same standard or transposed
    t = make_truth(E, h, i, R, seed=3)
    spec = MoESpec(SPEC0.prefix, E, h, i)
    write_moe_adapter(tmp_path, [t], ["3d_t"], rank=R, alpha=ALPHA)
    with pytest.raises(ExpertLayoutError, match="moe_3d_orientation") as e:
        _load(tmp_path, spec)
    # the shapes fit this model: the message says what is open, not "trained for another base model"
    assert "cannot be read unambiguously" in str(e.value) and "trained for this base model" not in str(e.value)
    for extra in ({"peft_version": "0.18.0"}, {"moe_3d_orientation": "transposed"}):
        _, ex = _load(tmp_path, spec, cfg_extra=extra)
        torch.testing.assert_close(dense_delta(ex, 4)["up"], oracle_deltas(t, SCALING)["up"][4], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("mutate", "fragment"), [
    (lambda ts: ts.update({"base_model.model.model.layers.0.mlp.experts.3.gate_proj.lora_A.weight": torch.zeros(R, H + 1)}),
     "expected A(r, 32)"),
    (lambda ts: ts.update({"base_model.model.model.layers.0.mlp.experts.9.gate_proj.lora_A.weight": torch.zeros(R, H),
                           "base_model.model.model.layers.0.mlp.experts.9.gate_proj.lora_B.weight": torch.zeros(I, R)}),
     "expert 9 out of range"),
    (lambda ts: ts.pop("base_model.model.model.layers.0.mlp.experts.2.up_proj.lora_B.weight"), "without its partner"),
    (lambda ts: ts.update({"base_model.model.model.layers.0.mlp.experts.1.router.lora_A.weight": torch.zeros(R, H),
                           "base_model.model.model.layers.0.mlp.experts.1.router.lora_B.weight": torch.zeros(E, R)}),
     "projection 'router'"),
])
def test_shape_and_name_problems_are_errors_naming_the_module(tmp_path: Path, truth: Truth, mutate, fragment: str) -> None:  # type: ignore[no-untyped-def]
    ts = block_tensors("model.layers.0.mlp", truth, "2d")
    mutate(ts)
    write_adapter(tmp_path, ts, lora_config(R, ALPHA))
    with pytest.raises(ExpertLayoutError, match=re.escape(fragment)):
        _load(tmp_path)


def test_3d_rows_that_do_not_divide_by_experts_are_refused(tmp_path: Path, truth: Truth) -> None:
    a, b = to_3d(truth.ad, truth.bd)
    p = "base_model.model.model.layers.0.mlp.experts"
    write_adapter(tmp_path, {f"{p}.lora_A.weight": a[:-1], f"{p}.lora_B.weight": b[:, :-1]}, lora_config(R, ALPHA))
    with pytest.raises(ExpertLayoutError, match="r·E with E=8"):
        _load(tmp_path)


def test_rslora_and_alpha_pattern_are_applied_per_projection(tmp_path: Path, truth: Truth) -> None:
    write_moe_adapter(tmp_path, [truth], ["3d_gu+2d_down"], rank=R, alpha=ALPHA, use_rslora=True,
                      alpha_pattern={"down_proj": 2.0})
    _, ex = _load(tmp_path)
    o = oracle_deltas(truth, 1.0)
    torch.testing.assert_close(dense_delta(ex, 0)["gate"], o["gate"][0] * ALPHA / R**0.5, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(dense_delta(ex, 0)["down"], o["down"][0] * 2.0 / R**0.5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("form", FORMS)
@pytest.mark.parametrize("experts", [[4, 5, 6, 7], [1, 3, 5, 7], [0], [2, 3]])
def test_reading_some_experts_equals_full_read_then_index_bitwise(tmp_path: Path, truth: Truth, form: str,
                                                                 experts: list[int]) -> None:
    write_moe_adapter(tmp_path, [truth], [form], rank=R, alpha=ALPHA)  # type: ignore[list-item]
    _, full = _load(tmp_path)
    stats = ReadStats()
    _, part = _load(tmp_path, experts=experts, stats=stats)
    fa, fb = full.as_2d(num_experts=E, hidden=H)
    pa, pb = part.as_2d(num_experts=E, hidden=H)
    for x, y in zip(fa + fb, pa + pb):
        assert torch.equal(x[experts], y)
    header = read_header(tmp_path / "adapter_model.safetensors")
    share = len(experts) / E
    assert stats.bytes_read == header.header_bytes + round(header.total_bytes * share)


@pytest.mark.parametrize(("cores", "expected"), [(2, 0), (4, 0), (6, 2), (8, 2), (10, 2), (12, 4), (16, 4), (64, 4)])
def test_scan_threads_match_the_readers_only_on_hosts_with_twice_their_number_to_spare(cores: int,
                                                                                      expected: int) -> None:
    """Four readers: up to 10 cores keep r31's rule (at most 2 scanning threads, none without a spare core); from
    12 the scan gets as many threads as the read (on the H200 host two could not keep up with four readers)."""
    from vllm_lora_ext.formats.moe_read import default_scan_workers

    assert default_scan_workers(cores, min(4, cores)) == expected


def _pools_lent(folder: Path, blocks: int, monkeypatch: pytest.MonkeyPatch, cores: int) -> list[tuple[str, int]]:
    """``(name, threads)`` of every pool `read_blocks` lends to read (and scan) an adapter of ``blocks`` MoE blocks
    on ``cores`` usable cores (`_util.usable_cores`: the process's affinity set, not the machine's)."""
    from vllm_lora_ext import _util
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe_read import read_blocks

    write_moe_adapter(folder, [make_truth(4, 8, 6, 2, seed) for seed in range(blocks)], ["2d"] * blocks, rank=2)
    monkeypatch.setattr(_util, "usable_cores", lambda: cores)
    lent: list[tuple[str, int]] = []

    class Spy(_util.FreshPools):
        @staticmethod
        def lent_pool(name: str, workers: int):  # type: ignore[no-untyped-def]
            lent.append((name, workers))
            return _util.FreshPools.lent_pool(name, workers)

        @staticmethod
        def run_in_pool(name, workers, fn, items):  # type: ignore[no-untyped-def]
            lent.append((name, workers))
            return _util.FreshPools.run_in_pool(name, workers, fn, items)

    reader = SafetensorsReader(folder / "adapter_model.safetensors")
    cfg = config_from_dict(json.loads((folder / "adapter_config.json").read_text()))
    plans = {p: plan_experts(g, MoESpec(p, 4, 8, 6), config=cfg) for p, g in group_moe_keys(reader.header.shapes).items()}
    read_blocks(plans, KeyByKey(reader.read, reader.read_many), config=cfg,
                options=ReadOptions(check_finite_as="x", pools=Spy))
    return lent


@pytest.mark.parametrize(("cores", "scanning"), [(16, 3), (8, 2), (4, 1), (3, 0)])
def test_read_blocks_sizes_its_scan_pool_by_the_rule_for_the_cores_it_may_use(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int, scanning: int) -> None:
    """Three blocks, so three readers: on 16 usable cores the scan gets three threads too (r31's rule gave 2), on 8
    two, on 4 the one core left, on 3 none (each reader scans its own block)."""
    lent = _pools_lent(tmp_path, 3, monkeypatch, cores)
    assert [w for name, w in lent if "scan" in name] == ([scanning] if scanning else [])


@pytest.mark.parametrize("cores", [2, 8, 16])
def test_the_pools_a_worker_starts_ahead_are_the_ones_a_many_block_read_lends(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cores: int) -> None:
    """``moe_read.read_pools`` (what ``transport.pools.start_pools`` starts while a worker starts) names them."""
    from vllm_lora_ext.formats.moe_read import read_pools

    assert sorted(_pools_lent(tmp_path, 6, monkeypatch, cores)) == sorted(read_pools(cores))


def test_usable_cores_are_the_affinity_set_where_there_is_one(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    from vllm_lora_ext._util import usable_cores

    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 5, 7}, raising=False)
    assert usable_cores() == 3

    def missing(pid: int) -> set[int]:
        raise AttributeError("no sched_getaffinity here")

    monkeypatch.setattr(os, "sched_getaffinity", missing, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 6)
    assert usable_cores() == 6


@pytest.mark.parametrize("form", ["2d", "3d"])
@pytest.mark.parametrize("scan_workers", [0, 1, 4])
def test_read_blocks_refuses_a_nan_in_any_block_and_otherwise_returns_the_same_tensors(
        tmp_path: Path, form: str, scan_workers: int) -> None:
    # scan_workers=1: blocks are scanned on their own pool while the next are read (hosts with spare cores);
    # 0: each reader scans its own block. Both refuse the same NaN, naming its block, and change no tensor.
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe_read import read_blocks

    truths = [make_truth(4, 8, 6, 2, seed) for seed in range(3)]
    write_moe_adapter(tmp_path / "ok", truths, [form] * 3, rank=2)
    truths[2].bd[1, 3, 0] = float("nan")
    write_moe_adapter(tmp_path / "bad", truths, [form] * 3, rank=2)

    def load(folder: Path, check: bool) -> dict:
        reader = SafetensorsReader(folder / "adapter_model.safetensors")
        cfg = config_from_dict(json.loads((folder / "adapter_config.json").read_text()))
        plans = {p: plan_experts(g, MoESpec(p, 4, 8, 6), config=cfg) for p, g in group_moe_keys(reader.header.shapes).items()}
        return read_blocks(plans, KeyByKey(reader.read, reader.read_many), config=cfg,
                           options=ReadOptions(workers=2, check_finite_as="x" if check else None,
                                               scan_workers=scan_workers))

    checked, plain = load(tmp_path / "ok", True), load(tmp_path / "ok", False)
    for p in plain:
        for role in ("gate", "up", "down", "gate_up"):
            a, b = getattr(checked[p], role), getattr(plain[p], role)
            assert (a is None) == (b is None) and (a is None or (torch.equal(a.a, b.a) and torch.equal(a.b, b.b)))
    with pytest.raises(AdapterFormatError, match="model.layers.2.mlp.experts down lora_B' holds NaN"):
        load(tmp_path / "bad", True)


def test_a_slow_moe_load_logs_progress_per_block(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  caplog: pytest.LogCaptureFixture) -> None:
    import logging

    import vllm_lora_ext._progress as progress
    from vllm_lora_ext.formats import group_moe_keys
    from vllm_lora_ext.formats.moe_read import read_blocks

    monkeypatch.setattr(progress, "AFTER_S", 0.0)
    monkeypatch.setattr(progress, "EVERY_S", 0.0)
    write_moe_adapter(tmp_path / "a", [make_truth(4, 8, 6, 2, s) for s in range(3)], ["2d"] * 3, rank=2)
    reader = SafetensorsReader(tmp_path / "a" / "adapter_model.safetensors")
    cfg = config_from_dict(json.loads((tmp_path / "a" / "adapter_config.json").read_text()))
    plans = {p: plan_experts(g, MoESpec(p, 4, 8, 6), config=cfg) for p, g in group_moe_keys(reader.header.shapes).items()}
    with caplog.at_level(logging.INFO, logger="vllm_lora_ext.progress"):
        read_blocks(plans, KeyByKey(reader.read, reader.read_many), config=cfg,
                    options=ReadOptions(workers=1, check_finite_as="x"))
    lines = [r.getMessage() for r in caplog.records if r.name == "vllm_lora_ext.progress"]
    assert len(lines) == 3 and lines[-1].startswith("loading 'x' (3 MoE blocks): ") and "(100%)" in lines[-1]


def test_fast_key_classification_reads_every_key_as_the_grammar_regexes_do() -> None:
    """classify_key parses with string operations; it must agree with the reference regexes on any key."""
    import random

    from vllm_lora_ext.formats import _classify_by_regex, classify_key

    parts = ["base_model.model.", "model.", "layers.0.", "mlp.", "experts", ".experts", "experts.", ".7", ".07",
             ".٣", ".²", ".-1", ".", "..", "gate_proj", ".up_proj", ".w1", ".base_layer", ".lora_A.weight",
             ".lora_B.weight", ".lora_embedding_A", ".lora_embedding_B", ".lora_A", ".weight", "\n", " ", "x",
             ".lora_A.weight\n", "lora_B.weight"]
    rng = random.Random(0)
    keys = {"".join(rng.choice(parts) for _ in range(rng.randrange(1, 9))) for _ in range(40000)}
    keys |= {f"base_model.model.model.layers.{i}.mlp.experts.{e}.{p}.lora_{w}.weight" for i in range(2) for e in
             range(3) for p in ("gate_proj", "down_proj") for w in "AB"}
    kinds = set()
    for key in sorted(keys):
        assert classify_key.__wrapped__(key) == _classify_by_regex(key), key  # type: ignore[attr-defined]
        kinds.add(_classify_by_regex(key).kind)
    assert kinds == {"dense", "moe_2d", "moe_3d", "other"}


@pytest.mark.parametrize("experts", [None, [5, 1, 2]], ids=["all", "some"])
@pytest.mark.parametrize("form", FORMS)
def test_a_block_read_with_the_readers_reads_into_place_equals_the_key_by_key_read_bitwise(
        tmp_path: Path, truth: Truth, form: str, experts: list[int] | None) -> None:
    write_moe_adapter(tmp_path, [truth], [form], rank=R, alpha=ALPHA)  # type: ignore[list-item]
    plan, by_key = _load(tmp_path, experts=experts)
    cfg = config_from_dict(json.loads((tmp_path / "adapter_config.json").read_text()))
    with SafetensorsReader(tmp_path / "adapter_model.safetensors") as reader:
        into_place = read_experts(plan, reader, config=cfg, experts=experts,
                                  options=ReadOptions(dtype=torch.float32))
    for role in ("gate", "up", "down", "gate_up"):
        a, b = getattr(by_key, role), getattr(into_place, role)
        assert (a is None) == (b is None), role
        if a is not None:
            assert torch.equal(a.a, b.a) and torch.equal(a.b, b.b), role
