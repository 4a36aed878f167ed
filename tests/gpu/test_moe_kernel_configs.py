"""vLLM's fused-MoE LoRA launch (``PunicaWrapperGPU.add_lora_w13`` then ``add_lora_w2``, Qwen3-30B-A3B's MoE shape)
with tuned tables gives stock's outputs (vLLM's own configs, ``use_tuned_config`` off), and both equal a dense fp32
reference: every block_m the tuner tries, and the tables shipped for this GPU read through the plugin (or, where
none ships, tables written as the tuner writes them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kernel_tables import moe_lora_reference, moe_tuner, shipped_moe_gpus
import torch

from vllm_lora_ext.kernel_configs import file_stem
from vllm_lora_ext.kernel_configs.moe import MOE_OPS, load_moe_tables

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _shapes() -> list[Any]:
    shape = moe_tuner().Shape
    # naive small-batch, naive one-shot, sorted one-shot at decode and prefill sizes, one slot to sixteen
    return [shape(1, 1, 16), shape(4, 8, 16), shape(4, 64, 32), shape(16, 64, 16), shape(1, 256, 32),
            shape(16, 512, 16)]


def _assert_close(got: tuple[torch.Tensor, ...], want: tuple[torch.Tensor, ...], what: str) -> None:
    for name, g, w in zip(("w13", "w2"), got, want):
        torch.testing.assert_close(g, w, rtol=2e-2, atol=2e-2 * float(w.abs().max()) + 1e-3, msg=f"{what} {name}")


@pytest.mark.parametrize("index", range(6))
def test_every_block_m_the_tuner_tries_gives_stocks_outputs(index: int, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    tune = moe_tuner()
    shape = _shapes()[index]
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))  # read only where use_tuned_config is on
    step = tune.Step(shape, tmp_path, file_stem(torch.cuda.get_device_name()))
    stock = tune.stock_configs(shape)
    for label in step.mappings:
        ref = step.output(None, label)
        if shape.m <= 64:
            _assert_close(ref, moe_lora_reference(step, label), f"{shape} {label} stock against fp32")
        for block_m in tune.BLOCK_M:
            got = step.output({op: dict(stock[op], block_m=block_m) for op in MOE_OPS}, label)
            _assert_close(got, ref, f"{shape} {label} block_m={block_m} against stock")


def _tables_as_the_tuner_writes(folder: Path, stem: str) -> Path:
    """Tables for this GPU written as the tuner writes them, with block_m away from stock's (128 up to 128 tokens,
    16 above), for a GPU no table ships for."""
    tune = moe_tuner()
    rows = []
    for shape in _shapes():
        stock = tune.stock_configs(shape)
        tuned = {op: dict(stock[op], block_m=128 if shape.m <= 128 else 16) for op in MOE_OPS}
        rows.append({**tune.untuned_row(shape, stock), "tuned": tuned, "untuned": False})
    folder.mkdir(parents=True, exist_ok=True)
    tune.write_tables(folder, stem, tune.build_tables(rows))
    return folder


def test_tables_read_through_the_plugin_give_stocks_outputs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.ops.triton_ops import utils

    from vllm_lora_ext.integration import kernels, plugin

    tune = moe_tuner()
    stem = file_stem(torch.cuda.get_device_name())
    # the package's tables where they ship for this GPU, else tables written as the tuner writes them
    folder = None if stem in shipped_moe_gpus() else _tables_as_the_tuner_writes(tmp_path / "tables", stem)
    plugin.register()
    import vllm.lora.layers.fused_moe  # noqa: F401  (the patches apply as vLLM imports these)

    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.delenv("VLLM_LORA_EXT_KERNEL_CONFIGS", raising=False)
    if folder is not None:
        monkeypatch.setattr(kernels, "load_moe_tables", lambda s: load_moe_tables(s, folder))
    kernels._moe_tables.cache_clear()
    try:
        assert kernels._shipped_moe_tables() is not None
        for shape in _shapes():
            step = tune.Step(shape, tmp_path, stem)
            for label in step.mappings:
                ref = step.output(None, label)
                step.use(None)
                step.tuned = True  # as the plugin sets it on a layer the tables fit: vLLM reads them
                step.spread(label)
                step.y13.zero_()
                step.y2.zero_()
                step.launch()
                torch.cuda.synchronize()
                got = step.y13.float().clone(), step.y2.float().clone()
                used = utils.get_lora_op_configs(MOE_OPS[0], shape.slots, shape.m, tune.HIDDEN, shape.rank, 2, None,
                                                 tune.INTERMEDIATE)
                _assert_close(got, ref, f"{shape} {label} block_m={used['block_m']} against stock")
    finally:
        kernels._moe_tables.cache_clear()
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()
