"""Fused-MoE LoRA kernel tables through vLLM: the tuner's tables read back by vLLM's own lookup, and the plugin's two
patches (the layer's ``use_tuned_config``, and the loader answering the four op types from a shipped table), which
leave vLLM's choice alone while no table ships for the GPU."""

from __future__ import annotations

import functools
import json
import logging
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from factories import load_bench
from kernel_tables import shipped_moe_gpus
import torch

from vllm_lora_ext.kernel_configs.moe import MOE_OPS, load_moe_tables, moe_config_file_names

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
STEM, DEVICE = "NVIDIA_H200", "NVIDIA H200"
H, I, E = 2048, 768, 128


@functools.lru_cache(maxsize=1)
def _tuner() -> ModuleType:
    return load_bench("tune_moe_lora_kernels", as_name="tune_moe_lora_kernels_under_test")


def _config(block_m: int, **extra: int) -> dict[str, int]:
    # vLLM's derived config for E=128, N=768 on an H200 at 32 tokens, in the tables' names
    return {"block_m": block_m, "block_n": 16, "block_k": 128, "group_size_m": 16, "num_warps": 4, "num_stages": 2,
            **extra}


def _row(slots: int, m: int, rank: int, block_m: int, *, untuned: bool = False) -> dict[str, Any]:
    stock = {op: _config(16) for op in MOE_OPS}
    tuned = stock if untuned else {op: _config(block_m, num_warps=8 if "w2" in op else 4) for op in MOE_OPS}
    times = None if untuned else {"one": 20.0, "spread": 30.0}
    return {"key": [slots, m, rank], "hidden": H, "intermediate": I, "stock": stock, "tuned": tuned,
            "stock_us": times, "tuned_us": times, "tried": 0 if untuned else 4, "output_matches_stock": True,
            **({"untuned": True} if untuned else {})}


ROWS = [_row(s, m, r, bm) for s, m, r, bm in ((1, 1, 16, 16), (1, 64, 16, 32), (4, 64, 16, 64), (4, 64, 32, 128),
                                               (16, 1024, 16, 128), (16, 1024, 32, 64), (4, 1, 32, 16))]
ROWS += [_row(s, m, r, 0, untuned=True) for s in (1, 4, 16) for m in (1, 64, 1024) for r in (16, 32)]


@pytest.fixture
def vllm_lookup(monkeypatch: pytest.MonkeyPatch):
    """vLLM's own get_lora_op_configs, reading files named after an H200 (this machine has no GPU to name)."""
    from vllm.lora.ops.triton_ops import utils

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: DEVICE)
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    yield utils.get_lora_op_configs
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()


def _write(folder: Path, rows: list[dict[str, Any]]) -> None:
    _tuner().write_tables(folder, STEM, _tuner().build_tables(rows))


def _lookups(lookup: Any, op: str) -> dict[tuple[int, ...], Any]:
    return {(s, m, r, ns): lookup(op, s, m, H, r, ns, None, I)
            for s in (1, 2, 4, 9, 16, 64) for m in (1, 3, 33, 64, 100, 600, 1024, 8192) for r in (8, 16, 32)
            for ns in (1, 2)}


def test_the_tuners_tables_read_back_through_vllms_own_lookup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                              vllm_lookup) -> None:
    """Written by the tuner and read by vLLM through VLLM_TUNED_CONFIG_FOLDER: each tuned shape gives its tuned
    config for every op type and both slice counts (the untuned row of the same shape loses, in either order),
    shapes between take the nearest, and one step's four configs always share block_m."""
    _write(tmp_path, ROWS[::-1])
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    for row in ROWS[:7]:
        slots, m, rank = row["key"]
        for op in MOE_OPS:
            for ns in (1, 2):
                assert vllm_lookup(op, slots, m, H, rank, ns, None, I) == row["tuned"][op], (op, row["key"], ns)
    # between tuned shapes: the nearest slots (4), tokens (64), rank (32), hidden and intermediate (the only ones)
    assert vllm_lookup(MOE_OPS[0], 3, 70, 4096, 30, 2, None, 1000) == ROWS[3]["tuned"][MOE_OPS[0]]
    step = {op: _lookups(vllm_lookup, op) for op in MOE_OPS}
    for key in step[MOE_OPS[0]]:
        assert len({step[op][key]["block_m"] for op in MOE_OPS}) == 1, key


def test_untuned_shapes_hold_stock_and_the_rebuild_writes_the_same_bytes(tmp_path: Path) -> None:
    results = tmp_path / "r.json"
    results.write_text(json.dumps({"gpu": STEM, "results": ROWS}))
    run = subprocess.run([sys.executable, str(ROOT / "bench" / "tune_moe_lora_kernels.py"), "--rebuild", str(results),
                          "--out-dir", str(tmp_path / "out"), "--json", str(tmp_path / "again.json")],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    _write(tmp_path, ROWS)
    for name in moe_config_file_names(STEM):
        assert (tmp_path / "out" / name).read_bytes() == (tmp_path / name).read_bytes(), name
    tables = load_moe_tables(STEM, tmp_path / "out")
    assert tables is not None
    assert tables[MOE_OPS[0]]["16"]["2"]["64"]["16"][str(H)][str(I)] == _config(16)  # an untuned shape: stock


def test_a_stock_config_in_the_tables_form_is_the_config_vllms_launch_reads() -> None:
    from vllm.lora.ops.triton_ops.utils import _normalize_lora_config_keys

    stock = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 16, "GROUP_SIZE_M": 1, "num_warps": 4,
             "num_stages": 5, "SPLIT_K": 1}
    form = _tuner().table_form(stock)
    assert form == {"block_m": 16, "block_n": 64, "block_k": 16, "group_size_m": 1, "num_warps": 4, "num_stages": 5,
                    "split_k": 1}
    assert _normalize_lora_config_keys(form) == _normalize_lora_config_keys(stock)


def test_the_tuner_launches_vllms_punica_wrapper_with_the_parameters_it_has() -> None:
    """The step's calls bind to vLLM's PunicaWrapperGPU.add_lora_w13/add_lora_w2 signatures (the launch itself needs
    a GPU: tests/gpu/test_moe_kernel_configs.py)."""
    import inspect

    from vllm.lora.punica_wrapper.punica_gpu import PunicaWrapperGPU

    calls: list[str] = []

    def checked(name: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            inspect.signature(getattr(PunicaWrapperGPU, name)).bind(None, *args, **kwargs)
            calls.append(name)
            return None, None, None, None

        return call

    step = _tuner().Step.__new__(_tuner().Step)
    step.shape, step.tuned = _tuner().Shape(4, 8, 16), True
    for name in ("x", "x2", "y13", "y2", "w13_a", "w13_b", "w2_a", "w2_b", "topk_ids", "topk_weights", "w1", "w2",
                 "adapter_enabled"):
        setattr(step, name, torch.zeros(1))
    step.punica = SimpleNamespace(add_lora_w13=checked("add_lora_w13"), add_lora_w2=checked("add_lora_w2"))
    step.launch()
    assert calls == ["add_lora_w13", "add_lora_w2"]


# ---------------------------------------------------------------- the plugin

def _moe_layer(*, rank: int = 16, hidden: int = H, intermediate: int = I, slices: int = 2,
               fully_sharded: bool = False) -> Any:
    """vLLM's FusedMoEWithLoRA with the fields its _build_lora_context reads (its __init__ needs a GPU MoE layer)."""
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA

    layer = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(layer)
    meta = functools.partial(torch.empty, device="meta", dtype=torch.bfloat16)
    layer.w13_lora_a_stacked = tuple(meta(4, E, rank, hidden) for _ in range(slices))
    layer.w13_lora_b_stacked = tuple(meta(4, E, intermediate, rank) for _ in range(slices))
    layer.w2_lora_a_stacked, layer.w2_lora_b_stacked = (meta(4, E, rank, intermediate),), (meta(4, E, hidden, rank),)
    layer.adapter_enabled = torch.zeros(5, dtype=torch.int32)
    layer.max_loras, layer._w13_slices, layer.fully_sharded = 4, slices, fully_sharded
    layer.tp_rank, layer.tp_size, layer.enable_moe_shared_loras, layer.punica_wrapper = 0, 1, False, None
    layer._enable_aux_cuda_stream, layer._lora_stream, layer._events = False, None, None
    layer.moe_config = SimpleNamespace(experts_per_token=8, num_local_experts=E)
    return layer


@pytest.fixture
def plugin_on(monkeypatch: pytest.MonkeyPatch):
    """The registered plugin on a worker whose GPU is an H200 (named: this machine has none)."""
    import vllm.lora.layers.fused_moe  # noqa: F401
    from vllm.lora.ops.triton_ops import utils

    from vllm_lora_ext.integration import kernels, plugin

    plugin.register()
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.delenv("VLLM_LORA_EXT_KERNEL_CONFIGS", raising=False)
    monkeypatch.setattr(kernels, "cuda_device_name", lambda: DEVICE)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: DEVICE)
    kernels._moe_tables.cache_clear()
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    yield kernels
    kernels._moe_tables.cache_clear()
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()


def _fields(context: Any) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(context, f.name) for f in dataclasses.fields(context)}


def test_with_no_fused_moe_table_shipped_the_layer_and_the_lookup_are_vllms(plugin_on, tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA
    from vllm.lora.ops.triton_ops import utils

    from vllm_lora_ext.integration.patching import PATCH_MARK

    monkeypatch.setattr(plugin_on, "load_moe_tables", lambda stem: load_moe_tables(stem, tmp_path))  # none here

    assert getattr(FusedMoEWithLoRA._build_lora_context, PATCH_MARK) and getattr(utils.load_lora_op_config, PATCH_MARK)
    layer = _moe_layer()
    context = layer._build_lora_context()
    assert context.use_tuned_config is False
    assert _fields(context) == _fields(FusedMoEWithLoRA._build_lora_context.__wrapped__(layer))
    for op in MOE_OPS:
        assert utils.load_lora_op_config(op, None) is None  # vLLM's: no folder set
        ours = utils.get_lora_op_configs(op, 4, 32, H, 16, 2, None, I)
        utils.get_lora_op_configs.cache_clear()
        assert ours == utils.get_lora_op_configs.__wrapped__(op, 4, 32, H, 16, 2, None, I)


def test_a_shipped_table_turns_on_the_layers_it_fits_and_vllm_reads_it(plugin_on, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.ops.triton_ops import utils

    kernels = plugin_on
    _write(tmp_path, ROWS)
    monkeypatch.setattr(kernels, "load_moe_tables", lambda stem: load_moe_tables(stem, tmp_path))
    assert _moe_layer()._build_lora_context().use_tuned_config is True
    assert _moe_layer(slices=1, rank=32)._build_lora_context().use_tuned_config is True  # the 3D-fused layer
    for unfit in (_moe_layer(rank=64), _moe_layer(hidden=4096), _moe_layer(intermediate=1536),
                  _moe_layer(fully_sharded=True)):
        assert unfit._build_lora_context().use_tuned_config is False
    ours = {op: _lookups(utils.get_lora_op_configs, op) for op in MOE_OPS}
    assert ours[MOE_OPS[1]][(4, 64, 32, 2)] == ROWS[3]["tuned"][MOE_OPS[1]]
    assert utils.load_lora_op_config("shrink", None) is None  # the dense op types stay vLLM's
    utils.get_lora_op_configs.cache_clear()
    utils.load_lora_op_config.cache_clear()
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))  # vLLM reading the same files itself
    assert {op: _lookups(utils.get_lora_op_configs, op) for op in MOE_OPS} == ours


@pytest.mark.parametrize("setting", ["VLLM_LORA_EXT_KERNEL_CONFIGS=0", "VLLM_TUNED_CONFIG_FOLDER=/nonexistent",
                                     "a broken shipped table"])
def test_a_shipped_table_stands_aside(plugin_on, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                      caplog: pytest.LogCaptureFixture, setting: str) -> None:
    from vllm.lora.ops.triton_ops import utils

    kernels = plugin_on
    _write(tmp_path, ROWS)
    if setting == "a broken shipped table":
        (tmp_path / moe_config_file_names(STEM)[2]).write_text("{}")
    else:
        monkeypatch.setenv(*setting.split("=", 1))
    monkeypatch.setattr(kernels, "load_moe_tables", lambda stem: load_moe_tables(stem, tmp_path))
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext"):
        context = _moe_layer()._build_lora_context()
    user_folder = setting.startswith("VLLM_TUNED")
    assert context.use_tuned_config is user_folder  # vLLM's own flag: its folder is set
    for op in MOE_OPS:
        want = utils.load_lora_op_config.__wrapped__(op, None)
        assert utils.load_lora_op_config(op, None) == want and want is None
    if setting == "a broken shipped table":
        assert "not using the shipped fused-MoE LoRA kernel configs" in caplog.text


def test_the_shipped_h200_tables_turn_on_the_qwen3_30b_a3b_layer(plugin_on) -> None:
    """The tables tuned on an H200 (``bench/results/tune_moe_lora_h200_r25.json``; their outputs checked against
    vLLM's own on the GPU by ``tests/gpu/test_moe_kernel_configs.py``) ship in the package and fit the shape they
    were tuned for, ranks 16 and 32; a rank above those tuned keeps vLLM's choice."""
    assert STEM in shipped_moe_gpus()
    assert _moe_layer()._build_lora_context().use_tuned_config is True
    assert _moe_layer(rank=32)._build_lora_context().use_tuned_config is True
    assert _moe_layer(rank=64)._build_lora_context().use_tuned_config is False
