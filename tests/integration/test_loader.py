"""The hooked _load_adapter against vLLM's own loader, on real PEFT adapters and real vLLM modules."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import make_peft_adapter, tiny_llama
from vllm_lora_ext.errors import AdapterCompatibilityError, AdapterFormatError, UnmatchedKeysError

pytestmark = pytest.mark.vllm


def _request(path: str, name: str = "a", lora_id: int = 1) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def _stock_and_plugin() -> tuple[Any, Any]:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    import vllm.lora.worker_manager as wm

    patched = wm.WorkerLoRAManager._load_adapter
    return patched.__wrapped__, patched


def _assert_same_lora_model(a: Any, b: Any) -> None:
    assert a.id == b.id and a.rank == b.rank
    assert sorted(a.loras) == sorted(b.loras)
    for name in a.loras:
        la, lb = a.loras[name], b.loras[name]
        assert la.module_name == lb.module_name and la.rank == lb.rank and la.scaling == lb.scaling
        assert torch.equal(la.lora_a, lb.lora_a) and torch.equal(la.lora_b, lb.lora_b)
        assert la.lora_a.dtype == lb.lora_a.dtype


@pytest.fixture(scope="module")
def peft_adapter(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("peft") / "adapter"
    return make_peft_adapter(tiny_llama(), folder, targets=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                             "up_proj", "down_proj"], rank=8, alpha=16)


def test_hooked_loader_returns_the_same_lora_model_as_vllms_own(worker_manager: Any, peft_adapter: Path) -> None:
    stock, plugin_load = _stock_and_plugin()
    req = _request(str(peft_adapter))
    _assert_same_lora_model(stock(worker_manager, req), plugin_load(worker_manager, req))


def test_hooked_loader_matches_vllm_for_rslora(worker_manager: Any, tmp_path: Path) -> None:
    folder = make_peft_adapter(tiny_llama(), tmp_path / "rs", targets=["q_proj", "v_proj"], rank=4, alpha=8,
                               use_rslora=True)
    stock, plugin_load = _stock_and_plugin()
    a, b = stock(worker_manager, _request(str(folder))), plugin_load(worker_manager, _request(str(folder)))
    _assert_same_lora_model(a, b)
    assert abs(next(iter(b.loras.values())).scaling - 8 / 4**0.5) < 1e-9


def test_single_weight_file_with_sibling_config_equals_the_folder(worker_manager: Any, peft_adapter: Path,
                                                                  tmp_path: Path) -> None:
    (tmp_path / "mine.safetensors").write_bytes((peft_adapter / "adapter_model.safetensors").read_bytes())
    (tmp_path / "mine_config.json").write_text((peft_adapter / "adapter_config.json").read_text())
    stock, plugin_load = _stock_and_plugin()
    _assert_same_lora_model(stock(worker_manager, _request(str(peft_adapter))),
                            plugin_load(worker_manager, _request(str(tmp_path / "mine.safetensors"))))


def test_hf_source_loads_the_same_tensors_as_the_local_folder(worker_manager: Any, peft_adapter: Path, hub: Any) -> None:
    hub.repo("acme/llama-lora").commit({
        "adapters/x.safetensors": (peft_adapter / "adapter_model.safetensors").read_bytes(),
        "adapters/x_config.json": (peft_adapter / "adapter_config.json").read_bytes(),
    })
    stock, plugin_load = _stock_and_plugin()
    _assert_same_lora_model(stock(worker_manager, _request(str(peft_adapter))),
                            plugin_load(worker_manager, _request("hf:acme/llama-lora:adapters/x.safetensors")))


def test_keys_that_match_no_module_are_an_error_listing_them(worker_manager: Any, peft_adapter: Path,
                                                             tmp_path: Path) -> None:
    tensors = load_file(str(peft_adapter / "adapter_model.safetensors"))
    extra = {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(8, 64),
             "base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight": torch.zeros(64, 8),
             "base_model.model.model.vision.proj.lora_A.weight": torch.zeros(8, 64),
             "base_model.model.model.vision.proj.lora_B.weight": torch.zeros(64, 8)}
    save_file({**tensors, **extra}, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text((peft_adapter / "adapter_config.json").read_text())
    _, plugin_load = _stock_and_plugin()
    with pytest.raises(UnmatchedKeysError) as e:
        plugin_load(worker_manager, _request(str(tmp_path)))
    assert sorted(e.value.keys) == sorted(extra)
    assert "4 keys that match no LoRA module" in str(e.value)


def test_unmatched_keys_can_be_downgraded_to_a_warning(worker_manager: Any, peft_adapter: Path, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    tensors = load_file(str(peft_adapter / "adapter_model.safetensors"))
    tensors["base_model.model.model.layers.9.mlp.up_proj.lora_A.weight"] = torch.zeros(8, 64)
    tensors["base_model.model.model.layers.9.mlp.up_proj.lora_B.weight"] = torch.zeros(128, 8)
    save_file(tensors, str(tmp_path / "adapter_model.safetensors"))
    (tmp_path / "adapter_config.json").write_text((peft_adapter / "adapter_config.json").read_text())
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS", "1")
    stock, plugin_load = _stock_and_plugin()
    _assert_same_lora_model(stock(worker_manager, _request(str(peft_adapter))),
                            plugin_load(worker_manager, _request(str(tmp_path))))


def test_rank_above_max_lora_rank_names_the_setting(worker_manager: Any, tmp_path: Path) -> None:
    folder = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)
    _, plugin_load = _stock_and_plugin()
    with pytest.raises(AdapterCompatibilityError, match="rank 32 .* max_lora_rank is 16. Start vLLM with --max-lora-rank 32"):
        plugin_load(worker_manager, _request(str(folder)))


def test_dora_adapter_is_refused_with_the_reason(worker_manager: Any, peft_adapter: Path, tmp_path: Path) -> None:
    cfg = json.loads((peft_adapter / "adapter_config.json").read_text())
    cfg["use_dora"] = True
    (tmp_path / "adapter_config.json").write_text(json.dumps(cfg))
    (tmp_path / "adapter_model.safetensors").write_bytes((peft_adapter / "adapter_model.safetensors").read_bytes())
    _, plugin_load = _stock_and_plugin()
    with pytest.raises(AdapterFormatError, match="DoRA"):
        plugin_load(worker_manager, _request(str(tmp_path)))


def test_missing_source_raises_vllms_not_found_error_with_our_hint(worker_manager: Any, tmp_path: Path) -> None:
    from vllm.exceptions import LoRAAdapterNotFoundError

    _, plugin_load = _stock_and_plugin()
    with pytest.raises(LoRAAdapterNotFoundError) as e:
        plugin_load(worker_manager, _request(str(tmp_path / "missing"), name="gone"))
    msg = str(e.value)
    assert "Loading lora gone failed: No adapter found for" in msg and "does not exist" in msg


def test_worker_state_reports_the_adapters_and_bytes_this_process_read(worker_manager: Any, peft_adapter: Path) -> None:
    from vllm_lora_ext.integration.plugin import worker_state

    _, plugin_load = _stock_and_plugin()
    before = worker_state()["adapter_reads"]
    plugin_load(worker_manager, _request(str(peft_adapter)))
    after = worker_state(worker_manager)
    weights = (peft_adapter / "adapter_model.safetensors").stat().st_size
    assert after["adapter_reads"]["adapters"] == before["adapters"] + 1
    assert after["adapter_reads"]["bytes"] - before["bytes"] == weights  # every tensor is kept: the whole file
    assert after["registered"] and after["load_adapter_patched"] and after["rank"] is None


def test_a_host_arena_left_pageable_where_vllm_pins_lora_memory_is_said_once(monkeypatch: pytest.MonkeyPatch,
                                                                           caplog: pytest.LogCaptureFixture) -> None:
    """Where vLLM pins LoRA memory but the arena cannot be page-locked in place (a thread with no CUDA context, or
    the driver refuses), vLLM copies the factors into pinned memory itself, or its slot copy reads pageable memory:
    one warning a process says so, naming the size; the arena is closed either way."""
    from types import SimpleNamespace

    from vllm_lora_ext.integration import loader
    from vllm_lora_ext.transport.arena import HostArena

    monkeypatch.setattr(loader, "pin_in_place", lambda arena: False)
    monkeypatch.setattr(loader, "lora_host_memory_pinned", lambda: True)
    monkeypatch.setattr(loader, "_UNPINNED", [])
    arenas = [HostArena(1 << 20) for _ in range(2)]
    for arena in arenas:
        arena.empty((1024,), torch.bfloat16)
        with caplog.at_level("WARNING", logger=loader.__name__):
            loader._pin_host(SimpleNamespace(host=arena))
        assert arena.buffer is None  # closed
    said = [r for r in caplog.records if "could not be page-locked" in r.getMessage()]
    assert len(said) == 1 and "2.0 KiB" in said[0].getMessage()
