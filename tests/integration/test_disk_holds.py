"""The server's side of the disk tier (issue 41), through vLLM's real ``OpenAIServingModels.load_lora_adapter`` and
``unload_lora_adapter`` wrapped by the plugin: a registered adapter's revision is held in the shared cache while it
stays registered, a start-up adapter shows as pinned, and an unloaded adapter's revision may go again.

The engine client is the outer boundary (a stand-in that answers ``add_lora``); the Hub is tests/hubserver.py.
"""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config, serving_models
from vllm_lora_ext.diskcache import list_cache
from vllm_lora_ext.integration import server

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def fresh_registry() -> Any:
    server.reset_registry()
    yield
    server.reset_registry()


def _repos(hub: Any, n: int) -> int:
    """acme/a0 .. acme/a{n-1}, one commit each; returns one revision's bytes."""
    config = json.dumps(lora_config(r=4)).encode()
    for i in range(n):
        weights = save(dense_tensors(llama_shapes(), seed=i))
        hub.repo(f"acme/a{i}").commit({"adapter_model.safetensors": weights, "adapter_config.json": config})
    return len(weights) + len(config)


def _load() -> Any:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    from vllm_lora_ext.integration.server_patches import make_load_lora_adapter as _make_load_lora_adapter

    return _make_load_lora_adapter(OpenAIServingModels.load_lora_adapter)


def test_registered_adapters_hold_their_revision_and_an_unloaded_one_releases_it(hub: Any) -> None:
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    from vllm_lora_ext.integration._compat import load_adapter_request_cls, unload_adapter_request_cls

    _repos(hub, 3)
    load = _load()
    models, load_request = serving_models(), load_adapter_request_cls()

    async def scenario() -> None:
        token = server.STARTUP.set(True)  # as init_static_loras does for --lora-modules and the deployment config
        try:
            assert isinstance(await load(models, load_request(lora_name="p", lora_path="hf:acme/a0")), str)
        finally:
            server.STARTUP.reset(token)
        assert isinstance(await load(models, load_request(lora_name="a", lora_path="hf:acme/a1")), str)
        held = {r.repo_id: r.held_by for r in list_cache()}
        assert held["acme/a0"] == (f"pid {os.getpid()}: adapter 'p' (pinned at start-up)",)
        assert held["acme/a1"] == (f"pid {os.getpid()}: adapter 'a' (registered)",)
        unload = unload_adapter_request_cls()(lora_name="a")
        assert isinstance(await OpenAIServingModels.unload_lora_adapter(models, unload), str)
        assert isinstance(await load(models, load_request(lora_name="b", lora_path="hf:acme/a2")), str)
        held = {r.repo_id: r.held_by for r in list_cache()}
        assert held["acme/a1"] == () and held["acme/a2"] == (f"pid {os.getpid()}: adapter 'b' (registered)",)
        assert held["acme/a0"] == (f"pid {os.getpid()}: adapter 'p' (pinned at start-up)",)

    asyncio.run(scenario())


def test_a_load_that_the_full_disk_cache_cannot_take_is_a_503_naming_the_bound(
        hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
    from vllm_lora_ext.integration._compat import load_adapter_request_cls

    size = _repos(hub, 2)
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, str(size * 3 // 2))
    load, models, load_request = _load(), serving_models(), load_adapter_request_cls()
    assert isinstance(asyncio.run(load(models, load_request(lora_name="a", lora_path="hf:acme/a0"))), str)
    err = asyncio.run(load(models, load_request(lora_name="b", lora_path="hf:acme/a1")))
    assert err.error.code == 503 and ENV_DISK_CACHE_BYTES in err.error.message, err
    assert "Unload adapters" in err.error.message and "b" not in models.lora_requests
    assert [r.repo_id for r in list_cache()] == ["acme/a0"]
