"""The plugin's counters on vLLM's own ``/metrics`` route, moved by real loads, failed loads and mixes.

The route is vLLM's (``attach_router``, served by starlette's test client); loads go through the
patched ``WorkerLoRAManager._load_adapter`` on real vLLM objects; mixes and bad requests go through
the server routes with the recording engine client of test_hostile_server.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from factories import make_dense_adapter, make_peft_adapter, scrape, tiny_llama
from vllm_lora_ext.constants import ENV_MAX_MIXES
from vllm_lora_ext.integration import plugin, server

pytestmark = pytest.mark.vllm


def _metrics_client() -> Any:
    from fastapi import FastAPI
    from starlette.testclient import TestClient
    from vllm.entrypoints.serve.instrumentator.metrics import attach_router

    app = FastAPI()
    attach_router(app)
    return TestClient(app)


def _scrape(client: Any) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    return scrape(resp.text)


def test_loads_failures_and_mixes_show_on_vllms_metrics_route(fresh_metrics: str, worker_manager: Any,
                                                               tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.request import LoRARequest
    from vllm.lora.worker_manager import WorkerLoRAManager

    from vllm_lora_ext.errors import AdapterCompatibilityError

    plugin.register()
    client = _metrics_client()
    assert not any(k[0].startswith("vllm_lora_ext_adapter_loads") for k in _scrape(client))

    good = make_peft_adapter(tiny_llama(), tmp_path / "good", targets=["q_proj", "v_proj"], rank=8, alpha=16)
    too_big = make_dense_adapter(tmp_path / "big", rank=32)  # max_lora_rank is 16
    load = WorkerLoRAManager._load_adapter
    for i in (1, 2):
        load(worker_manager, LoRARequest(f"good{i}", i, str(good)))
    with pytest.raises(AdapterCompatibilityError):
        load(worker_manager, LoRARequest("big", 3, str(too_big)))
    with pytest.raises(LoRAAdapterNotFoundError):
        load(worker_manager, LoRARequest("gone", 4, str(tmp_path / "nothing-here")))
    other = make_peft_adapter(tiny_llama(), tmp_path / "other", targets=["q_proj"], rank=4, alpha=8)
    load(worker_manager, LoRARequest("mix", 5, server_mix_path(good, other)))

    got = _scrape(client)
    assert got[("vllm_lora_ext_adapter_loads_total", (("kind", "adapter"), ("outcome", "ok")))] == 4  # 2 + 2 parts
    assert got[("vllm_lora_ext_adapter_loads_total", (("kind", "adapter"), ("outcome", "rejected")))] == 1
    assert got[("vllm_lora_ext_adapter_loads_total", (("kind", "adapter"), ("outcome", "not_found")))] == 1
    assert got[("vllm_lora_ext_adapter_loads_total", (("kind", "mix"), ("outcome", "ok")))] == 1
    assert got[("vllm_lora_ext_adapter_load_seconds_count", (("kind", "adapter"),))] == 4
    assert got[("vllm_lora_ext_adapter_load_seconds_count", (("kind", "mix"),))] == 1
    weight_bytes = (good / "adapter_model.safetensors").stat().st_size
    # each successful read covers the tensors plus the header; the rejected one stops after its header
    assert got[("vllm_lora_ext_adapter_bytes_read_total", ())] >= 3 * (weight_bytes - 4096)
    assert got[("vllm_lora_ext_errors_total", (("type", "AdapterCompatibilityError"), ("where", "worker")))] == 1
    assert got[("vllm_lora_ext_errors_total", (("type", "LoRAAdapterNotFoundError"), ("where", "worker")))] == 1
    assert got[("vllm_lora_ext_sources_resolved_total", (("cache", "local"),))] >= 4
    assert "http_requests_total" in client.get("/metrics").text  # vLLM's own instrumentation is still served


def server_mix_path(a: Path, b: Path) -> str:
    from vllm_lora_ext.mixing import MixComponent, MixSpec

    return MixSpec((MixComponent("a", str(a), 0.5), MixComponent("b", str(b), 0.25))).lora_path


class _Engine:
    def __init__(self) -> None:
        from types import SimpleNamespace

        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))

    async def add_lora(self, req: Any) -> bool:
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True


def mix_serving(work: Path) -> Any:
    """A serving object whose models hold two real dense adapters, 'style' and 'domain', over `_Engine`."""
    from collections import defaultdict
    from types import SimpleNamespace

    from vllm.lora.request import LoRARequest

    a, b = make_dense_adapter(work / "a", seed=1), make_dense_adapter(work / "b", seed=2)
    models = SimpleNamespace(
        lora_requests={"style": LoRARequest("style", 1, str(a)), "domain": LoRARequest("domain", 2, str(b))},
        lora_resolver_lock=defaultdict(asyncio.Lock), engine_client=_Engine())
    return SimpleNamespace(models=models, _is_model_supported=lambda m: not m or m == "base")


def test_mix_registrations_evictions_and_refusals_show_on_the_metrics_route(
        fresh_metrics: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from types import SimpleNamespace

    from vllm.entrypoints.openai.completion.protocol import CompletionRequest

    monkeypatch.setenv(ENV_MAX_MIXES, "1")
    server.reset_registry()
    plugin.register()
    client = _metrics_client()
    serving = mix_serving(tmp_path)

    async def scenario() -> list[Any]:
        out = []
        for weights in ([0.5, 0.5], [0.7, 0.3], [1.0, float("nan")]):
            req = CompletionRequest(prompt="hi", model="base", adapters=["style", "domain"], adapter_weights=weights)
            out.append(await server.route_adapters(serving, req))
            lora = server.routed_lora(req)
            if lora is not None:
                server.claim_lease(lora).release()  # generation ran and ended
        return out

    try:
        results = asyncio.run(scenario())
        assert results[:2] == [None, None] and results[2].error.code == 400
        missing = asyncio.run(server.pre_resolve(SimpleNamespace(lora_name="x", lora_path=str(tmp_path / "no"))))
        assert missing.error.code == 404
        got = _scrape(client)
    finally:
        server.reset_registry()
    assert got[("vllm_lora_ext_mixes_registered_total", ())] == 2
    assert got[("vllm_lora_ext_mixes_evicted_total", ())] == 1  # the bound is 1
    assert got[("vllm_lora_ext_mixes_active", ())] == 1
    assert got[("vllm_lora_ext_errors_total", (("type", "MixError"), ("where", "server")))] == 1
    assert got[("vllm_lora_ext_errors_total", (("type", "AdapterNotFoundError"), ("where", "server")))] == 1
    assert json.dumps(sorted(k[0] for k in got))  # every sample parsed
