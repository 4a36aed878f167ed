"""A build's kept plan: the next adapter with the same header bytes, config, model and router is not planned again
(``building._planned``), and nothing else is served a plan made for another (no vLLM)."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
from vllm_lora_ext import building, headers
from vllm_lora_ext.errors import AdapterCompatibilityError, UnmatchedKeysError
from vllm_lora_ext.planning import PeftKeyRouter

E, H, I, R = BUILD_E, BUILD_H, BUILD_I, BUILD_R
pytestmark = pytest.mark.usefixtures("build_dir")


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Every adapter `plan_adapter` plans, by name; headers of any size kept (the test adapters' are small)."""
    monkeypatch.setattr(headers, "_KEEP_MIN_BYTES", 0)
    headers._KEPT_HEADERS.clear()
    building._KEPT_PLAN.clear()
    seen: list[str] = []
    real = building.plan_adapter
    monkeypatch.setattr(building, "plan_adapter", lambda *a, **k: seen.append(k["name"]) or real(*a, **k))
    yield seen
    headers._KEPT_HEADERS.clear()
    building._KEPT_PLAN.clear()


def _adapter(folder: Path, seeds: tuple[int, int], **extra: torch.Tensor) -> Path:
    return write_moe_adapter(folder, [make_truth(E, H, I, R, s) for s in seeds], ["2d", "3d"], rank=R, extra=extra)


def _tensors(built: building.BuiltAdapter) -> list[torch.Tensor]:
    return [t for p in sorted(built.moe) for t in (*built.moe[p][0], *built.moe[p][1])]


def test_the_next_adapter_of_the_same_header_config_and_model_is_built_from_the_kept_plan_bitwise(
        tmp_path: Path, plans: list[str]) -> None:
    first = _adapter(tmp_path / "a", (0, 1))
    second = _adapter(tmp_path / "b", (2, 3))  # other values: the same header bytes
    building.build_adapter(replace(moe_build_job(first), name="first"), PeftKeyRouter())
    got = building.build_adapter(replace(moe_build_job(second), name="second"), PeftKeyRouter())
    assert plans == ["first"]
    building._KEPT_PLAN.clear()
    want = building.build_adapter(replace(moe_build_job(second), name="again"), PeftKeyRouter())
    assert plans == ["first", "again"]
    assert len(_tensors(got)) == len(_tensors(want)) > 0
    assert all(torch.equal(x, y) for x, y in zip(_tensors(got), _tensors(want)))
    assert [r for *_, r in got.moe.values()] == [r for *_, r in want.moe.values()]


def test_another_model_or_config_is_planned_again_and_refused_where_it_must_be(tmp_path: Path,
                                                                              plans: list[str]) -> None:
    """The kept plan's checks held for its own model: a lower ``--max-lora-rank``, other experts on this rank or
    another config each plan anew, and what that plan refuses is refused."""
    first = _adapter(tmp_path / "a", (0, 1))
    building.build_adapter(moe_build_job(first), PeftKeyRouter())
    with pytest.raises(AdapterCompatibilityError, match="rank"):
        building.build_adapter(moe_build_job(first, max_rank=R // 2), PeftKeyRouter())
    building.build_adapter(moe_build_job(first, experts=(0, 2)), PeftKeyRouter())
    assert len(plans) == 3
    other_alpha = write_moe_adapter(tmp_path / "c", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "3d"],
                                    rank=R, alpha=32)
    building.build_adapter(moe_build_job(other_alpha), PeftKeyRouter())
    assert len(plans) == 4


def test_a_plan_that_dropped_keys_is_not_kept_so_each_adapter_warns_of_its_own(
        tmp_path: Path, plans: list[str], caplog: pytest.LogCaptureFixture) -> None:
    stray = {"base_model.model.model.layers.0.mlp.nowhere.lora_A.weight": torch.ones(R, H),
             "base_model.model.model.layers.0.mlp.nowhere.lora_B.weight": torch.ones(H, R)}
    folder = _adapter(tmp_path / "a", (0, 1), **stray)
    with pytest.raises(UnmatchedKeysError):
        building.build_adapter(moe_build_job(folder), PeftKeyRouter())
    job = replace(moe_build_job(folder), allow_unmatched=True)
    with caplog.at_level(logging.WARNING, logger="vllm_lora_ext.planning"):
        for _ in range(2):
            building.build_adapter(job, PeftKeyRouter())
    assert len(plans) == 3 and not building._KEPT_PLAN
    assert sum("Dropping them" in r.getMessage() for r in caplog.records) == 2


def test_headers_of_other_bytes_or_file_sizes_get_other_tokens(tmp_path: Path, plans: list[str]) -> None:
    first = _adapter(tmp_path / "a", (0, 1)) / "adapter_model.safetensors"
    second = _adapter(tmp_path / "b", (2, 3)) / "adapter_model.safetensors"
    a, b = headers.read_header(first), headers.read_header(second)
    assert a.token is not None and a.token == b.token
    longer = tmp_path / "longer.safetensors"
    longer.write_bytes(first.read_bytes())
    with longer.open("ab") as f:
        f.write(b"\0" * 8)
    with pytest.raises(Exception):  # the same header bytes past its last span: refused, never equal to a kept one
        headers.read_header(longer)
    other = write_moe_adapter(tmp_path / "c", [make_truth(E, H, I, R + 1, s) for s in (0, 1)], ["2d", "3d"],
                              rank=R + 1) / "adapter_model.safetensors"
    assert headers.read_header(other).token != a.token


def _with_rank_pattern(folder: Path, seeds: tuple[int, int], pattern: dict[str, int]) -> Path:
    import json

    _adapter(folder, seeds)
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(r=2 * R, rank_pattern=pattern)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def test_a_config_whose_patterns_differ_only_in_order_is_planned_again_and_refused(tmp_path: Path,
                                                                                   plans: list[str]) -> None:
    """PEFT gives a module the rank of the first pattern that matches it, in the order written; configs compare
    equal whatever their dicts' order. The second config's patterns give the 3D blocks rank 2R where the file has R:
    refused fresh, and refused after the first's plan was kept (found by r34's review: it was served)."""
    from vllm_lora_ext.errors import ExpertLayoutError

    good = _with_rank_pattern(tmp_path / "a", (0, 1), {".*": R, "model.*": 2 * R})
    bad = _with_rank_pattern(tmp_path / "b", (2, 3), {"model.*": 2 * R, ".*": R})
    with pytest.raises(ExpertLayoutError):
        building.build_adapter(replace(moe_build_job(bad), name="fresh"), PeftKeyRouter())
    building.build_adapter(replace(moe_build_job(good), name="good"), PeftKeyRouter())
    with pytest.raises(ExpertLayoutError):
        building.build_adapter(replace(moe_build_job(bad), name="bad"), PeftKeyRouter())
    assert plans == ["fresh", "good", "bad"]


def test_the_key_reads_the_config_without_running_its_checks_again(tmp_path: Path, plans: list[str],
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A config's checks compile every pattern (a hostile config with 20,000 of them: seconds): a build runs them once,
    as it reads the config, not again to key its plan (r34's second review)."""
    from vllm_lora_ext.config import AdapterConfig

    folder = _adapter(tmp_path / "a", (0, 1))
    checks: list[int] = []
    real = AdapterConfig.__post_init__
    monkeypatch.setattr(AdapterConfig, "__post_init__", lambda self: checks.append(1) or real(self))
    for _ in range(2):
        checks.clear()
        building.build_adapter(moe_build_job(folder), PeftKeyRouter())
        assert len(checks) == 1
    assert len(plans) == 1


def test_a_plan_ahead_reads_no_tensor_and_the_next_adapter_of_its_shape_takes_it(
        tmp_path: Path, plans: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """``building.plan_ahead`` (what a build process does for the builds its worker made while it started) parses
    and plans only; the next build of the same header, config and model says it took the kept plan, and builds the
    same tensors as a build planned anew. A pickle source is not read for a plan ahead (it has no header to keep)."""
    from safetensors.torch import load_file

    first = _adapter(tmp_path / "a", (0, 1))
    second = _adapter(tmp_path / "b", (2, 3))
    reads: list[int] = []
    real_read = building.read_blocks
    monkeypatch.setattr(building, "read_blocks", lambda *a, **k: reads.append(1) or real_read(*a, **k))
    assert building.plan_ahead(replace(moe_build_job(first), name="ahead"), PeftKeyRouter()) is False
    assert reads == [] and plans == ["ahead"]
    assert building.plan_ahead(replace(moe_build_job(first), name="again"), PeftKeyRouter()) is True
    got = building.build_adapter(replace(moe_build_job(second), name="second"), PeftKeyRouter())
    assert got.plan_kept and plans == ["ahead"]
    building._KEPT_PLAN.clear()
    want = building.build_adapter(replace(moe_build_job(second), name="anew"), PeftKeyRouter())
    assert not want.plan_kept and plans == ["ahead", "anew"]
    assert len(_tensors(got)) == len(_tensors(want)) > 0
    assert all(torch.equal(x, y) for x, y in zip(_tensors(got), _tensors(want)))
    torch.save(load_file(str(first / "adapter_model.safetensors")), first / "adapter_model.bin")
    (first / "adapter_model.safetensors").unlink()
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOW_PICKLE", "1")
    loaded: list[int] = []
    real_load = building.load_pickle_tensors
    monkeypatch.setattr(building, "load_pickle_tensors", lambda *a, **k: loaded.append(1) or real_load(*a, **k))
    assert building.plan_ahead(moe_build_job(first), PeftKeyRouter()) is False and loaded == []
