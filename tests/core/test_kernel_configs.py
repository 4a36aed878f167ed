"""The shipped LoRA kernel configs: table checks, loading, and vLLM's nearest-key lookup."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel_tables import shipped_gpus
from vllm_lora_ext.errors import KernelConfigError
from vllm_lora_ext.kernel_configs import (
    FOLDER,
    SLICE_KEYS,
    check_table,
    config_file_names,
    file_stem,
    load_tables,
    lookup_config,
)

SHRINK = {"block_m": 16, "block_n": 16, "block_k": 256, "split_k": 8, "num_warps": 4, "num_stages": 2, "num_ctas": 1,
          "group_size_m": 8, "max_nreg": None}
EXPAND = {"block_m": 16, "block_n": 128, "block_k": 16, "num_warps": 4, "num_stages": 2, "num_ctas": 1,
          "max_nreg": None}


def _table(config: dict) -> dict:
    return {"33": {s: {"1": {"2048": {"16": dict(config)}}, "64": {"4096": {"16": dict(config)}}} for s in SLICE_KEYS}}


def _write(folder: Path, stem: str, shrink: dict | None = None, expand: dict | None = None) -> None:
    names = config_file_names(stem)
    (folder / names[0]).write_text(json.dumps(shrink or _table(SHRINK)))
    for name in names[1:]:
        (folder / name).write_text(json.dumps(expand or _table(EXPAND)))


def test_file_names_follow_vllm() -> None:
    assert file_stem("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert file_stem("NVIDIA A100-SXM4-80GB") == "NVIDIA_A100_SXM4_80GB"
    assert config_file_names("NVIDIA_H200")[1] == "NVIDIA_H200_EXPAND_TRUE.json"


def test_a_complete_table_passes() -> None:
    check_table(_table(SHRINK), "shrink")
    check_table(_table(EXPAND), "expand")


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t["33"].pop("7"), "no num_slices 7"),
    (lambda t: t["33"]["1"]["1"]["2048"]["16"].pop("split_k"), "split_k is None"),
    (lambda t: t["33"]["1"]["1"]["2048"]["16"].update(block_m=True), "block_m is True"),
    (lambda t: t["33"]["1"]["1"]["2048"]["16"].update(num_warps=0), "num_warps is 0"),
    (lambda t: t["33"]["1"]["1"]["2048"]["16"].update(block_k=16.0), "block_k is 16.0"),
    (lambda t: t["33"]["1"].update(big={}), "keyed by integers"),
    (lambda t: t["33"]["1"].update({"8": {}}), "non-empty"),
    (lambda t: t.update({"65": []}), "non-empty"),
])
def test_a_table_vllm_would_fail_on_is_refused_by_name(edit, message) -> None:
    table = _table(SHRINK)
    edit(table)
    with pytest.raises(KernelConfigError, match=message) as info:
        check_table(table, "shrink", name="X_SHRINK.json")
    assert "X_SHRINK.json[" in str(info.value) and "VLLM_LORA_EXT_KERNEL_CONFIGS=0" in str(info.value)


def test_expand_does_not_need_split_k() -> None:
    config = {k: v for k, v in EXPAND.items() if k != "split_k"}
    check_table(_table(config), "expand")
    with pytest.raises(KernelConfigError, match="split_k"):
        check_table(_table(config), "shrink")


def test_lookup_takes_the_nearest_key_except_for_slices() -> None:
    table = {"5": {"1": {"1": {"2048": {"16": {"block_m": 1}}}, "64": {"2048": {"16": {"block_m": 2}, "64": {"block_m": 3}},
                                                                 "8192": {"16": {"block_m": 4}}}}},
             "65": {"1": {"1": {"2048": {"16": {"block_m": 5}}}}, "3": {"32": {"2048": {"16": {"block_m": 6}}}}}}
    assert lookup_config(table, max_loras=2, num_slices=1, m=1, k=2048, n=16) == {"block_m": 1}
    assert lookup_config(table, max_loras=9, num_slices=1, m=40, k=2048, n=16) == {"block_m": 2}
    assert lookup_config(table, max_loras=9, num_slices=1, m=40, k=2048, n=48) == {"block_m": 3}
    assert lookup_config(table, max_loras=9, num_slices=1, m=40, k=7000, n=8) == {"block_m": 4}
    assert lookup_config(table, max_loras=33, num_slices=1, m=1, k=2048, n=16) == {"block_m": 1}  # a tie: the first
    assert lookup_config(table, max_loras=65, num_slices=3, m=1, k=1, n=1) == {"block_m": 6}
    assert lookup_config(table, max_loras=65, num_slices=2, m=1, k=1, n=1) is None  # vLLM would raise KeyError


def test_a_hidden_size_below_every_tuned_one_gets_vllms_default() -> None:
    table = {"5": {"1": {"64": {"2048": {"16": {"block_m": 2}}, "8192": {"16": {"block_m": 4}, "64": {"block_m": 5}}}}}}
    # shrink: k is the hidden size
    assert lookup_config(table, max_loras=5, num_slices=1, m=64, k=256, n=16) == {"block_m": 2}  # vLLM's nearest rule
    assert lookup_config(table, max_loras=5, num_slices=1, m=64, k=256, n=16, hidden="k") is None
    assert lookup_config(table, max_loras=5, num_slices=1, m=64, k=2048, n=16, hidden="k") == {"block_m": 2}
    assert lookup_config(table, max_loras=5, num_slices=1, m=64, k=16384, n=16, hidden="k") == {"block_m": 4}
    # expand: n is the hidden size (here the level under k = 8192 holds n = 16 and 64)
    assert lookup_config(table, max_loras=5, num_slices=1, m=64, k=8192, n=8, hidden="n") is None
    assert lookup_config(table, max_loras=5, num_slices=1, m=64, k=8192, n=50, hidden="n") == {"block_m": 5}


def test_load_tables_reads_three_checked_files(tmp_path: Path) -> None:
    assert load_tables("NVIDIA_H200", tmp_path) is None
    _write(tmp_path, "NVIDIA_H200")
    tables = load_tables("NVIDIA_H200", tmp_path)
    assert tables is not None and sorted(tables) == ["expand_false", "expand_true", "shrink"]
    broken = _table(EXPAND)
    del broken["33"]["16"]
    _write(tmp_path, "NVIDIA_H200", expand=broken)
    with pytest.raises(KernelConfigError, match="no num_slices 16"):
        load_tables("NVIDIA_H200", tmp_path)
    (tmp_path / config_file_names("NVIDIA_H200")[0]).write_text("{not json")
    with pytest.raises(KernelConfigError, match="cannot be read"):
        load_tables("NVIDIA_H200", tmp_path)


@pytest.mark.parametrize("stem", shipped_gpus() or ["(none shipped)"])
def test_every_shipped_table_is_complete(stem: str) -> None:
    if stem == "(none shipped)":
        pytest.skip("no tuned configs in the package")
    for name in config_file_names(stem):
        check_table(json.loads((FOLDER / name).read_text()), "shrink" if "SHRINK" in name else "expand", name=name)
