"""`bench/moe_matrix.py --effect-scale`: each group's lora_B is scaled in the adapter files both sides load (HF + PEFT
reads the scaled folder, vLLM the group adapters split from it), lora_A and the config stay as built, and the
quantized modes scale by default while the unquantized default leaves the adapter as built. CPU, HF side only."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from factories import load_bench
import torch
from safetensors.torch import load_file

ARCH = "Qwen3MoeForCausalLM"


@pytest.fixture(scope="module")
def mm() -> Iterator[Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a 2-layer model: one thread is faster, and no slower on a busy machine
    yield load_bench("moe_matrix")
    torch.set_num_threads(threads)


def _one(mm: Any, workdir: Path, monkeypatch: pytest.MonkeyPatch, *extra: str) -> dict[str, Any]:
    """What the driver runs for one architecture (``--one``), HF side only."""
    out = workdir / "result.json"
    monkeypatch.setattr(sys, "argv", ["moe_matrix.py", "--one", ARCH, "--no-vllm", "--device", "cpu",
                                      "--workdir", str(workdir), "--json", str(out), *extra])
    assert mm.main() == 0
    result: dict[str, Any] = json.loads(out.read_text())
    assert result["status"] == "built", result.get("why")
    return result


def test_a_quantized_run_scales_each_group_in_the_files_both_sides_load(
        mm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    result = _one(mm, run, monkeypatch, "--quantization", "fp8")
    assert result["effect_scale"] == "auto"
    scales = result["effect_scales"]
    assert set(scales) == set(result["groups"]) - {"all"}
    assert set(scales.values()) <= set(mm.SCALES)
    assert scales["routed experts"] > 1  # the group FP8's noise hid at scale 1

    plain = tmp_path / "plain"  # the adapter as built (same model, same seed)
    mm.build_adapter(run / "model", plain)
    built = load_file(str(plain / "adapter_model.safetensors"))
    scaled = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    assert scaled.keys() == built.keys()
    for key, t in built.items():
        factor = scales[mm.group_of(key)] if ".lora_B." in key else 1.0
        assert torch.equal(scaled[key], t * factor), key
    assert (run / "adapter" / "adapter_config.json").read_text() == (plain / "adapter_config.json").read_text()

    # vLLM's side: each group's adapter holds that group's scaled tensors and the unchanged config.
    for group in scales:
        folder = run / "groups" / group.replace(" ", "_")
        part = load_file(str(folder / "adapter_model.safetensors"))
        assert part and all(torch.equal(t, scaled[k]) for k, t in part.items())
        assert (folder / "adapter_config.json").read_text() == (plain / "adapter_config.json").read_text()

    # HF + PEFT's side reads the scaled file: the same logprobs as the built adapter with lora_B scaled in memory.
    on_disk, in_memory = mm.HfSide(run / "model", run / "adapter", "cpu"), mm.HfSide(run / "model", plain, "cpu")
    base = in_memory.logprobs(None)
    for group, s in scales.items():
        assert on_disk.logprobs(group) == in_memory.logprobs(group, s), group
        effect = mm._mean_gap(in_memory.logprobs(group, s), base)
        assert effect >= mm.EFFECT_TARGET or s == mm.SCALES[-1], group  # auto's rule: the smallest that reaches
        if s > 1:
            assert mm._mean_gap(in_memory.logprobs(group, s / 2), base) < mm.EFFECT_TARGET, group


def test_a_number_scales_every_group_and_the_unquantized_default_leaves_the_adapter_as_built(
        mm: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fixed = _one(mm, tmp_path / "fixed", monkeypatch, "--effect-scale", "3")
    assert fixed["effect_scale"] == 3.0
    assert set(fixed["effect_scales"].values()) == {3.0}

    default = _one(mm, tmp_path / "default", monkeypatch)
    assert default["effect_scale"] == 1.0 and "effect_scales" not in default
    mm.build_adapter(tmp_path / "default" / "model", tmp_path / "plain")
    built = load_file(str(tmp_path / "plain" / "adapter_model.safetensors"))
    served = load_file(str(tmp_path / "default" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(served[k], t) for k, t in built.items())
    fixed_b = load_file(str(tmp_path / "fixed" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(fixed_b[k], t * (3.0 if ".lora_B." in k else 1.0)) for k, t in built.items())


def test_effect_scale_takes_auto_or_a_positive_number(mm: Any) -> None:
    import argparse

    assert mm.parse_scale("auto") == "auto" and mm.parse_scale("2.5") == 2.5
    for bad in ("0", "-1", "big", "nan"):
        with pytest.raises(argparse.ArgumentTypeError):
            mm.parse_scale(bad)
    assert "every group" in mm.describe_scale(4.0) and "auto" in mm.describe_scale("auto")
