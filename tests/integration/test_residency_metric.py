"""The residency gauge on vLLM's own ``/metrics`` route, moved by vLLM's own LRU caches through the plugin's
``add_adapter`` (PATCHES.md #3): a CPU cache of 4 and 2 GPU slots, 30 adapters passing through.

The managers are made with ``object.__new__`` as in test_apply_adapters.py; the load from disk is the outer
boundary (a bare ``LoRAModel``), everything else (registration, LRU eviction, slot activation) is vLLM's code.
"""

from __future__ import annotations

from typing import Any

import pytest

from factories import scrape
from vllm_lora_ext.integration import plugin
from vllm_lora_ext.resident_metric import RESIDENT_METRIC, clear_resident

pytestmark = pytest.mark.vllm

SLOTS, CPU = 2, 4


def _worker() -> Any:
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    config = LoRAConfig(max_lora_rank=16, max_loras=SLOTS, max_cpu_loras=CPU, lora_dtype=torch.float32)
    mgr = object.__new__(LRUCacheLoRAModelManager)
    mgr.lora_config = config
    mgr.modules = {}  # no layers: registering an adapter checks nothing, activating it only takes a slot
    mgr._enable_mixed_moe_lora_format, mgr._classification_head = False, None  # vLLM 0.33's post-load checks
    mgr.packed_modules = {}
    mgr.lora_index_to_id = [None] * SLOTS
    mgr._registered_adapters = AdapterLRUCache(config.max_cpu_loras, mgr.deactivate_adapter)
    mgr._active_adapters = AdapterLRUCache(SLOTS, mgr._deactivate_adapter)
    worker = object.__new__(LRUCacheWorkerLoRAManager)
    worker._adapter_manager = mgr
    worker.lora_config = config
    worker._load_adapter = lambda request: LoRAModel(request.lora_int_id, 2, {"m": _weights()})  # the disk read
    return worker


def _weights() -> Any:
    import torch
    from vllm.lora.lora_weights import LoRALayerWeights

    return LoRALayerWeights("m", 2, 2, torch.zeros(2, 4), torch.zeros(4, 2))


def _metrics_client() -> Any:
    """The plugin registered, no adapter marked resident, and a test client of vLLM's own ``/metrics`` route."""
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    plugin.register()
    clear_resident()
    app = FastAPI()
    attach_router(app)
    return TestClient(app)


def _resident(client: Any) -> dict[str, str]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    out = {}
    for (name, labels), value in scrape(resp.text).items():
        if name == RESIDENT_METRIC:
            assert value == 1
            out[dict(labels)["adapter_name"]] = dict(labels)["level"]
    return out


def test_each_engine_shows_what_it_holds_now_on_vllms_metrics_route_and_no_more(fresh_metrics: str,
                                                                                 no_pin_memory: None) -> None:
    from vllm.lora.request import LoRARequest

    client = _metrics_client()
    worker = _worker()
    names = [f"tenant-{i}" if i % 3 else f"mix-t{i}=1-{i:024x}" for i in range(30)]
    try:
        for i, name in enumerate(names, start=1):  # each request's adapter registered and activated by vLLM
            worker.add_adapter(LoRARequest(name, i, f"/adapters/{i}"))
            held = _resident(client)
            mgr = worker._adapter_manager
            cpu = {names[j - 1] for j in mgr._registered_adapters.order}
            gpu = {names[j - 1] for j in mgr.lora_index_to_id if j is not None}
            assert set(held) == cpu and len(held) <= CPU  # bounded by the cache, evicted names gone
            assert {n for n, level in held.items() if level == "gpu"} == gpu and len(gpu) <= SLOTS
        assert set(held) == set(names[-CPU:])
        worker.add_adapter(LoRARequest(names[-CPU], 30 - CPU + 1, f"/adapters/{30 - CPU + 1}"))  # used again
        assert _resident(client)[names[-CPU]] == "gpu"
    finally:
        clear_resident()


def test_a_background_build_shows_as_building_until_the_engine_takes_it(
        fresh_metrics: str, no_pin_memory: None, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.request import LoRARequest

    import vllm_lora_ext.integration.loader as loader
    from vllm_lora_ext.integration.prebuild import probe_for, table

    monkeypatch.setenv("VLLM_LORA_EXT_BUILD_PROCESS", "0")
    release = threading.Event()

    def slow_read(manager: Any, request: Any, **kwargs: Any) -> Any:  # the read from disk, held open by the test
        release.wait(30)
        return LoRAModel(request.lora_int_id, 2, {"m": _weights()})

    monkeypatch.setattr(loader, "load_lora_model", slow_read)
    client = _metrics_client()
    worker = _worker()
    del worker._load_adapter  # the plugin's _load_adapter: it takes the background build
    request = LoRARequest("style", 1, "/adapters/style")
    try:
        assert worker.add_adapter(probe_for(request)) is False  # the build starts in the background
        assert _resident(client) == {"style": "building"}
        release.set()
        for _ in range(2000):
            if worker.add_adapter(probe_for(request)):
                break
            threading.Event().wait(0.005)
        assert _resident(client) == {"style": "building"}  # built, not yet taken by the engine
        worker.add_adapter(request)  # the engine takes the build: in the CPU cache and a GPU slot
        assert table(worker).pending() == [] and _resident(client) == {"style": "gpu"}
    finally:
        release.set()
        clear_resident()


def test_the_upstream_metric_wins_when_the_installed_vllm_has_it(fresh_metrics: str, no_pin_memory: None,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration import _compat

    assert _compat.has_upstream_residency_metric() is False  # no vLLM release has vllm:lora_adapter_loaded yet
    monkeypatch.setattr(_compat, "_UPSTREAM_RESIDENCY", [True])  # a vLLM with PR #54830
    client = _metrics_client()
    worker = _worker()
    worker.add_adapter(LoRARequest("style", 1, "/adapters/1"))
    assert _resident(client) == {}
