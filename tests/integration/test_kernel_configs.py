"""The shipped LoRA kernel tables through vLLM: the plugin's lookup equals vLLM's own, and only shrink/expand use it."""

from __future__ import annotations

import itertools
import json

import pytest

from kernel_tables import shipped_gpus
from vllm_lora_ext.kernel_configs import FOLDER, config_file_names, lookup_config

pytestmark = pytest.mark.vllm

SHAPES = list(itertools.product((1, 4, 16, 32, 64, 128), range(1, 17), (1, 3, 32, 100, 512, 8192, 65536),
                                (256, 896, 2048, 5120, 14336, 29568), (8, 16, 64, 256)))


@pytest.fixture
def vllm_lookup(monkeypatch: pytest.MonkeyPatch):
    from vllm.lora.ops.triton_ops import utils

    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()
    yield utils.get_lora_op_configs  # the plugin patches only the launchers' imported names, never this one
    utils.load_lora_op_config.cache_clear()
    utils.get_lora_op_configs.cache_clear()


@pytest.mark.parametrize("stem", shipped_gpus() or ["(none shipped)"])
def test_the_plugins_lookup_equals_vllms_on_every_shipped_table(stem: str, monkeypatch: pytest.MonkeyPatch,
                                                                 vllm_lookup) -> None:
    """vLLM reading the folder through VLLM_TUNED_CONFIG_FOLDER and `lookup_config` agree on every shape; with the
    hidden size named, one below every tuned size gets None (the launcher then asks vLLM, which has no folder)."""
    if stem == "(none shipped)":
        pytest.skip("no tuned configs in the package")
    import torch

    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(FOLDER))
    # vLLM names the file after torch.cuda.get_device_name(); the stem is already in that form.
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: stem)
    tables = [json.loads((FOLDER / name).read_text()) for name in config_file_names(stem)]
    for op, add_inputs, table in (("shrink", None, tables[0]), ("expand", True, tables[1]),
                                  ("expand", False, tables[2])):
        for slots, slices, m, hidden, rank in SHAPES:
            theirs = vllm_lookup(op, slots + 1, m, hidden, rank, slices, add_inputs=add_inputs)
            k, n = (hidden, rank) if op == "shrink" else (rank, hidden)
            ours = lookup_config(table, max_loras=slots + 1, num_slices=slices, m=m, k=k, n=n)
            assert ours == theirs, (op, slots, slices, m, hidden, rank)
            named = lookup_config(table, max_loras=slots + 1, num_slices=slices, m=m, k=k, n=n,
                                  hidden="k" if op == "shrink" else "n")
            assert named == (None if hidden < 2048 else theirs), (op, slots, slices, m, hidden, rank)


@pytest.mark.parametrize("stem", shipped_gpus()[:1] or ["(none shipped)"])
def test_only_shrink_and_expand_read_the_shipped_tables(stem: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if stem == "(none shipped)":
        pytest.skip("no tuned configs in the package")
    import vllm.lora.ops.triton_ops.lora_expand_op as expand_op
    import vllm.lora.ops.triton_ops.lora_shrink_op as shrink_op
    from vllm.lora.ops.triton_ops import utils

    from vllm_lora_ext.integration import kernels, plugin

    plugin.register()
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER", raising=False)
    monkeypatch.setattr(kernels, "cuda_device_name", lambda: stem)  # this machine has no GPU to name
    kernels._tables.cache_clear()
    shrink, expand = shrink_op.get_lora_op_configs, expand_op.get_lora_op_configs
    assert getattr(shrink, plugin.PATCH_MARK) and getattr(expand, plugin.PATCH_MARK)
    assert utils.get_lora_op_configs is shrink.__wrapped__  # vLLM's own name elsewhere is untouched
    table = json.loads((FOLDER / config_file_names(stem)[0]).read_text())
    try:
        got = shrink("shrink", 65, 32, 2048, 16, 3)
        assert got == lookup_config(table, max_loras=65, num_slices=3, m=32, k=2048, n=16)
        # a row narrower than any tuned one: vLLM's default (one split does all of a row of 256)
        narrow = shrink("shrink", 65, 32, 256, 16, 3)
        assert narrow == utils.get_lora_op_configs("shrink", 65, 32, 256, 16, 3) and narrow["block_k"] == 256
        # fused-MoE ops go to vLLM (no table for them ships): its default for this shape
        moe = shrink("fused_moe_lora_w13_shrink", 65, 32, 2048, 16, 2, None, 768)
        assert moe == utils.get_lora_op_configs("fused_moe_lora_w13_shrink", 65, 32, 2048, 16, 2, None, 768)
        # a user's folder wins: vLLM reads it (here: it has nothing, so vLLM's default)
        import torch

        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a, **k: stem)
        shrink.cache_clear()
        monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", "/nonexistent")
        utils.load_lora_op_config.cache_clear()
        assert shrink("shrink", 65, 32, 2048, 16, 3)["split_k"] == 64  # vLLM's default below 128 tokens
        shrink.cache_clear()
        monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER")
        utils.load_lora_op_config.cache_clear()
        monkeypatch.setenv("VLLM_LORA_EXT_KERNEL_CONFIGS", "0")
        assert shrink("shrink", 65, 32, 2048, 16, 3)["split_k"] == 64
        monkeypatch.delenv("VLLM_LORA_EXT_KERNEL_CONFIGS")
        # a slice count the table lacks goes to vLLM's lookup instead of failing the launch
        shrink.cache_clear()
        kernels._tables.cache_clear()
        one_slice = {k: {"65": {"1": t["65"]["1"]}} for k, t in kernels.load_tables(stem).items()}
        monkeypatch.setattr(kernels, "load_tables", lambda s: one_slice)
        assert shrink("shrink", 65, 32, 2048, 16, 3)["split_k"] == 64
        assert shrink("shrink", 65, 32, 2048, 16, 1) == lookup_config(table, max_loras=65, num_slices=1, m=32,
                                                                       k=2048, n=16)
    finally:
        shrink.cache_clear()
        kernels._tables.cache_clear()
        utils.load_lora_op_config.cache_clear()
        utils.get_lora_op_configs.cache_clear()


def test_the_shipped_tables_are_rebuilt_byte_for_byte_from_the_recorded_tuning_results(tmp_path) -> None:
    """`bench/tune_lora_kernels.py --rebuild` turns bench/results/tune_lora_*.json into exactly the shipped files
    (a GPU's full-grid runs, then its decode-grid run where there is one: its tuned shapes win)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    results = root / "bench" / "results"
    checked = 0
    for gpu in ("h200", "h100"):
        inputs = [results / f"tune_lora_{gpu}_{op}.json" for op in ("shrink", "expand")]
        if not all(p.is_file() for p in inputs):
            continue
        inputs += [p for p in [results / f"tune_lora_{gpu}_decode.json"] if p.is_file()]
        out = tmp_path / gpu
        run = subprocess.run([sys.executable, str(root / "bench" / "tune_lora_kernels.py"), "--grid", "full",
                              "--rebuild", *map(str, inputs), "--out-dir", str(out), "--json", str(tmp_path / "r.json")],
                             capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        for written in sorted(out.glob("*.json")):
            assert written.read_bytes() == (FOLDER / written.name).read_bytes(), written.name
            checked += 1
    if not checked:
        pytest.skip("no recorded tuning results")


def test_a_rebuild_keeps_a_tuned_config_over_another_runs_default_whatever_the_order() -> None:
    """A full-grid run that stopped early records vLLM's default for the shapes it did not reach; a later run
    that tuned them must win in the merged table, whichever results file comes first."""
    from factories import load_bench

    tune = load_bench("tune_lora_kernels", as_name="tune_lora_kernels_under_test")
    default = {"block_m": 64, "block_n": 16, "block_k": 256, "split_k": 64, "num_warps": 4, "num_stages": 2,
               "group_size_m": 8, "num_ctas": 1, "max_nreg": None}
    tuned = dict(default, block_k=32, split_k=16)
    untuned_row = {"op": "shrink", "key": [65, 3, 32, 2048, 16], "tuned": default, "untuned": True}
    tuned_row = {"op": "shrink", "key": [65, 3, 32, 2048, 16], "tuned": tuned}
    for rows in ([untuned_row, tuned_row], [tuned_row, untuned_row]):
        table = tune.build_tables(rows)["shrink"]
        assert table["65"]["3"]["32"]["2048"]["16"] == tuned
        assert table["65"]["1"]["32"]["2048"]["16"] == tuned  # slice counts filled from the nearest tuned one
