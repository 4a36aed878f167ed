"""The fused-MoE LoRA kernel tables: file names, checks (the shared block_m rule among them), loading and fit."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kernel_tables import shipped_moe_gpus
from vllm_lora_ext.errors import KernelConfigError
from vllm_lora_ext.kernel_configs.moe import (
    MOE_OPS,
    MOE_SLICE_KEYS,
    check_moe_table,
    check_moe_tables,
    load_moe_tables,
    moe_config_file_names,
    moe_tables_fit,
)

CONFIG = {"block_m": 16, "block_n": 64, "block_k": 16, "group_size_m": 1, "num_warps": 4, "num_stages": 5}


def _tables(block_m: dict[tuple[str, str, str], int] | None = None) -> dict[str, dict]:
    """Four tables over max_loras 1/16, m 1/64, rank 16/32 at hidden 2048, intermediate 768."""
    block_m = block_m or {}
    tables: dict[str, dict] = {}
    for op in MOE_OPS:
        table: dict = {}
        for loras in ("1", "16"):
            for slices in MOE_SLICE_KEYS:
                for m in ("1", "64"):
                    for k in ("16", "32"):
                        config = dict(CONFIG, block_m=block_m.get((loras, m, k), 16))
                        table.setdefault(loras, {}).setdefault(slices, {}).setdefault(m, {})[k] = \
                            {"2048": {"768": config}}
        tables[op] = table
    return tables


def _write(folder: Path, stem: str, tables: dict[str, dict]) -> None:
    for op, name in zip(MOE_OPS, moe_config_file_names(stem)):
        (folder / name).write_text(json.dumps(tables[op]))


def test_file_names_follow_vllms_op_types() -> None:
    assert moe_config_file_names("NVIDIA_H200") == (
        "NVIDIA_H200_FUSED_MOE_LORA_W13_SHRINK.json", "NVIDIA_H200_FUSED_MOE_LORA_W13_EXPAND.json",
        "NVIDIA_H200_FUSED_MOE_LORA_W2_SHRINK.json", "NVIDIA_H200_FUSED_MOE_LORA_W2_EXPAND.json")


def test_a_complete_set_with_block_m_shared_per_shape_passes() -> None:
    check_moe_tables(_tables({("16", "64", "16"): 64, ("1", "1", "32"): 32}))


@pytest.mark.parametrize(("edit", "message"), [
    (lambda t: t["1"].pop("2"), "no num_slices 2"),
    (lambda t: t["1"]["1"]["1"]["16"]["2048"]["768"].pop("group_size_m"), "group_size_m is None"),
    (lambda t: t["1"]["1"]["1"]["16"]["2048"]["768"].update(num_warps=0), "num_warps is 0"),
    (lambda t: t["1"]["1"]["1"]["16"]["2048"].update(big={}), "keyed by integers"),
    (lambda t: t["1"]["1"]["1"]["16"].update({"4096": 3}), "non-empty object"),
])
def test_a_table_vllm_would_fail_on_is_refused_by_name(edit, message) -> None:
    table = _tables()[MOE_OPS[0]]
    edit(table)
    with pytest.raises(KernelConfigError, match=message) as info:
        check_moe_table(table, name="X_FUSED_MOE_LORA_W13_SHRINK.json")
    assert "X_FUSED_MOE_LORA_W13_SHRINK.json[" in str(info.value)
    assert "tune_moe_lora_kernels.py" in str(info.value) and "VLLM_LORA_EXT_KERNEL_CONFIGS=0" in str(info.value)


def test_split_k_is_optional_as_in_vllms_launch() -> None:
    check_moe_table(_tables()[MOE_OPS[1]])
    with_split = _tables()[MOE_OPS[1]]
    with_split["1"]["1"]["1"]["16"]["2048"]["768"]["split_k"] = 1
    check_moe_table(with_split)


def test_block_m_differing_between_w13_and_w2_of_one_shape_is_refused_naming_both_files() -> None:
    tables = _tables()
    tables["fused_moe_lora_w2_expand"]["16"]["1"]["64"]["16"]["2048"]["768"]["block_m"] = 32
    with pytest.raises(KernelConfigError, match=r"block_m 32 in NVIDIA_H200_FUSED_MOE_LORA_W2_EXPAND.json and 16 in "
                                                r"NVIDIA_H200_FUSED_MOE_LORA_W13_SHRINK.json"):
        check_moe_tables(tables, stem="NVIDIA_H200")


def test_block_m_differing_between_slice_counts_or_hidden_sizes_is_refused() -> None:
    tables = _tables()
    tables[MOE_OPS[0]]["1"]["2"]["1"]["16"]["2048"]["768"]["block_m"] = 64
    with pytest.raises(KernelConfigError, match="share block_m"):
        check_moe_tables(tables)
    tables = _tables()
    tables[MOE_OPS[2]]["1"]["1"]["1"]["16"]["4096"] = {"768": dict(CONFIG, block_m=128)}
    with pytest.raises(KernelConfigError, match="block_m 128"):
        check_moe_tables(tables)


def test_tables_with_different_keys_are_refused() -> None:
    tables = _tables()
    for slices in MOE_SLICE_KEYS:
        tables[MOE_OPS[3]]["1"][slices]["8"] = copy.deepcopy(tables[MOE_OPS[3]]["1"][slices]["1"])
    with pytest.raises(KernelConfigError, match="different keys"):
        check_moe_tables(tables)
    tables = _tables()
    for op in MOE_OPS:
        tables[op]["1"]["2"]["8"] = copy.deepcopy(tables[op]["1"]["2"]["1"])
    with pytest.raises(KernelConfigError, match=r"\[1\]\[2\] and \[1\]\[1\] have different m or k keys"):
        check_moe_tables(tables)


def test_a_missing_op_type_is_refused() -> None:
    tables = _tables()
    del tables[MOE_OPS[2]]
    with pytest.raises(KernelConfigError, match="fused_moe_lora_w2_shrink"):
        check_moe_tables(tables)


def test_load_reads_four_checked_files(tmp_path: Path) -> None:
    assert load_moe_tables("NVIDIA_H200", tmp_path) is None
    assert shipped_moe_gpus(tmp_path) == []
    tables = _tables({("16", "64", "32"): 128})
    _write(tmp_path, "NVIDIA_H200", tables)
    assert load_moe_tables("NVIDIA_H200", tmp_path) == tables
    assert shipped_moe_gpus(tmp_path) == ["NVIDIA_H200"]
    (tmp_path / moe_config_file_names("NVIDIA_H200")[3]).unlink()
    assert load_moe_tables("NVIDIA_H200", tmp_path) is None and shipped_moe_gpus(tmp_path) == []
    tables[MOE_OPS[3]] = copy.deepcopy(tables[MOE_OPS[3]])
    tables[MOE_OPS[3]]["16"]["1"]["64"]["32"]["2048"]["768"]["block_m"] = 16
    _write(tmp_path, "NVIDIA_H200", tables)
    with pytest.raises(KernelConfigError, match="NVIDIA_H200_FUSED_MOE_LORA_W2_EXPAND.json"):
        load_moe_tables("NVIDIA_H200", tmp_path)
    (tmp_path / moe_config_file_names("NVIDIA_H200")[1]).write_text("{not json")
    with pytest.raises(KernelConfigError, match="cannot be read"):
        load_moe_tables("NVIDIA_H200", tmp_path)


@pytest.mark.parametrize(("layer", "fits"), [
    ({"num_slices": 2, "rank": 16, "hidden": 2048, "intermediate": 768}, True),
    ({"num_slices": 1, "rank": 32, "hidden": 2048, "intermediate": 768}, True),
    ({"num_slices": 2, "rank": 8, "hidden": 2048, "intermediate": 768}, True),  # nearest rank: 16
    ({"num_slices": 2, "rank": 64, "hidden": 2048, "intermediate": 768}, False),  # above every tuned rank
    ({"num_slices": 2, "rank": 16, "hidden": 4096, "intermediate": 768}, False),  # another model's shape
    ({"num_slices": 2, "rank": 16, "hidden": 2048, "intermediate": 1536}, False),
    ({"num_slices": 3, "rank": 16, "hidden": 2048, "intermediate": 768}, False),  # vLLM would fail on it
])
def test_the_tables_fit_a_layer_only_where_they_were_tuned_for_it(layer: dict, fits: bool) -> None:
    assert moe_tables_fit(_tables(), **layer) is fits


@pytest.mark.parametrize("stem", shipped_moe_gpus() or ["(none shipped)"])
def test_every_shipped_set_of_fused_moe_tables_loads_checked(stem: str) -> None:
    if stem == "(none shipped)":
        pytest.skip("no fused-MoE tables in the package (a GPU run of bench/tune_moe_lora_kernels.py writes them)")
    assert load_moe_tables(stem) is not None
