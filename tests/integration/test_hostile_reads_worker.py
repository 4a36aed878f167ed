"""Reads are one snapshot, through vLLM's real worker loader on the CPU (issue 35, items 3 and 4).

The worker's ``WorkerLoRAManager`` (hooked by the plugin), vLLM's ``LoRAModel`` and ``LoRARequest``, the
load route's ``pre_resolve`` and real safetensors files; the only stand-in is the GPU side's adapter slots, where
an eviction is a ``remove_adapter``. File moves are real ``os.replace``/symlink swaps, made by another thread at
the moment the load has read the header (`hostile_files`).
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import make_peft_adapter, tiny_llama
from hostile_files import deploy_between_header_and_data, swap_for_link
from vllm_lora_ext.errors import AdapterAccessError
from vllm_lora_ext.integration import server

pytestmark = pytest.mark.vllm
TARGETS = ["q_proj", "v_proj", "o_proj", "down_proj"]


def _request(path: str | Path, name: str = "a", lora_id: int = 1) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path))


def _load(manager: Any, req: Any) -> Any:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    import vllm.lora.worker_manager as wm

    return wm.WorkerLoRAManager._load_adapter(manager, req)


def _same(a: Any, b: Any) -> None:
    assert sorted(a.loras) == sorted(b.loras) and a.loras
    for name in a.loras:
        la, lb = a.loras[name], b.loras[name]
        assert la.scaling == lb.scaling and torch.equal(la.lora_a, lb.lora_a) and torch.equal(la.lora_b, lb.lora_b)
        assert torch.isfinite(la.lora_a).all() and torch.isfinite(la.lora_b).all()


@pytest.fixture
def adapter(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A PEFT adapter folder, its twin (the same bytes, untouched) and a newer weight file with a longer header."""
    folder = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=TARGETS, rank=4, alpha=8, seed=1)
    twin = tmp_path / "twin"
    shutil.copytree(folder, twin)
    newer = make_peft_adapter(tiny_llama(), tmp_path / "new", targets=TARGETS, rank=4, alpha=8, seed=2)
    staged = tmp_path / "staged.safetensors"
    save_file(load_file(str(newer / "adapter_model.safetensors")), str(staged), metadata={"padding": "x" * 1001})
    return folder, twin, staged


def test_the_worker_loads_the_old_adapter_exactly_when_a_deploy_replaces_it_between_header_and_data(
        worker_manager: Any, adapter: tuple[Path, Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    folder, twin, staged = adapter
    want = _load(worker_manager, _request(twin))
    with deploy_between_header_and_data(monkeypatch, folder / "adapter_model.safetensors", staged):
        got = _load(worker_manager, _request(folder))
    _same(got, want)
    newer = _load(worker_manager, _request(folder, lora_id=2))  # the next load reads the deployed file, whole
    assert any(not torch.equal(newer.loras[n].lora_b, want.loras[n].lora_b) for n in want.loras)


def test_a_mix_component_replaced_between_header_and_data_mixes_the_old_component(
        worker_manager: Any, adapter: tuple[Path, Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.composite import clear_component_cache
    from vllm_lora_ext.mixing import MixComponent, MixSpec

    folder, twin, staged = adapter
    other = make_peft_adapter(tiny_llama(), tmp_path / "b", targets=["q_proj"], rank=2, alpha=4, seed=3)

    def mix(first: Path) -> Any:
        clear_component_cache()
        spec = MixSpec((MixComponent("a", str(first), 0.7), MixComponent("b", str(other), 0.3)))
        return _load(worker_manager, _request(spec.lora_path, name=spec.lora_name, lora_id=1 << 30))

    want = mix(twin)
    with deploy_between_header_and_data(monkeypatch, folder / "adapter_model.safetensors", staged):
        got = mix(folder)
    _same(got, want)


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """``VLLM_LORA_EXT_ALLOWED_ROOTS=tmp/roots`` holding ``team/a``; ``tmp/outside/team/a`` is another adapter."""
    inside, outside = (tmp_path / "roots").resolve(), (tmp_path / "outside").resolve()
    make_peft_adapter(tiny_llama(), inside / "team" / "a", targets=TARGETS, rank=4, alpha=8, seed=1)
    make_peft_adapter(tiny_llama(), outside / "team" / "a", targets=TARGETS, rank=4, alpha=8, seed=7)
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", str(inside))
    return inside, outside


def _runtime_load(path: Path) -> str:
    """The load route's pre-check (``/v1/load_lora_adapter``): the path it registers."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    server.reset_registry()
    req = asyncio.run(server.pre_resolve(LoadLoRAAdapterRequest(lora_name="team-a", lora_path=str(path))))
    assert not hasattr(req, "error"), req
    return str(req.lora_path)


class _Slots:
    """The outer boundary: vLLM's GPU-side adapter slots (an eviction is ``remove_adapter``)."""

    def __init__(self, manager: Any) -> None:
        self.held: dict[int, Any] = {}
        self.model = manager._adapter_manager.model
        for attr in ("modules", "packed_modules", "supported_lora_modules", "packed_modules_mapping",
                     "is_pooling_model"):
            setattr(self, attr, getattr(manager._adapter_manager, attr))

    def get_adapter(self, i: int) -> Any:
        return self.held.get(i)

    def remove_adapter(self, i: int) -> bool:
        return self.held.pop(i, None) is not None

    def list_adapters(self) -> dict[int, Any]:
        return dict(self.held)

    def add_adapter(self, lora: Any) -> bool:
        self.held[lora.id] = lora
        return True

    def activate_adapter(self, i: int) -> bool:
        return True


@pytest.mark.parametrize("what", ["folder", "team folder", "weight file", "config file"])
def test_a_link_swapped_to_leave_the_root_is_refused_when_the_worker_rebuilds_after_an_eviction(
        worker_manager: Any, roots: tuple[Path, Path], what: str) -> None:
    import vllm.lora.worker_manager as wm

    from vllm_lora_ext.integration import plugin

    inside, outside = roots
    plugin.register()
    slots = worker_manager._adapter_manager = _Slots(worker_manager)
    path = _runtime_load(inside / "team" / "a")
    req = _request(path, name="team-a", lora_id=3)
    wm.WorkerLoRAManager.add_adapter(worker_manager, req)  # loaded: inside the root
    assert 3 in slots.held
    assert wm.WorkerLoRAManager.remove_adapter(worker_manager, 3)  # evicted
    assert 3 not in slots.held
    place = {"folder": inside / "team" / "a", "team folder": inside / "team",
             "weight file": inside / "team" / "a" / "adapter_model.safetensors",
             "config file": inside / "team" / "a" / "adapter_config.json"}[what]
    swap_for_link(place, outside / place.relative_to(inside))
    with pytest.raises(AdapterAccessError, match="outside the folders this server may read") as info:
        wm.WorkerLoRAManager.add_adapter(worker_manager, req)  # the rebuild
    assert f"VLLM_LORA_EXT_ALLOWED_ROOTS={inside}" in info.value.client_message()
    assert 3 not in slots.held  # nothing from outside reached a slot


def test_the_load_route_registers_a_link_inside_the_root_by_its_real_path_so_rebuilds_hold_it_there(
        worker_manager: Any, roots: tuple[Path, Path]) -> None:
    inside, outside = roots
    (inside / "alias").symlink_to(inside / "team" / "a")
    path = _runtime_load(inside / "alias")
    assert path == str(inside / "team" / "a")  # no link left in what the worker is asked to read
    first = _load(worker_manager, _request(path))
    (inside / "alias").unlink()
    (inside / "alias").symlink_to(outside / "team" / "a")  # re-pointing the alias changes nothing registered
    _same(_load(worker_manager, _request(path, lora_id=2)), first)


def test_an_adapter_the_operator_named_outside_the_roots_at_start_up_still_rebuilds(
        worker_manager: Any, roots: tuple[Path, Path]) -> None:
    _, outside = roots
    token = server.STARTUP.set(True)
    try:
        path = _runtime_load(outside / "team" / "a")
    finally:
        server.STARTUP.reset(token)
    first = _load(worker_manager, _request(path))
    _same(_load(worker_manager, _request(path, lora_id=2)), first)
