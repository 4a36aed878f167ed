"""The deployment config's adapters at start-up (issue 40), through vLLM's real ``OpenAIServingModels`` and its
``init_static_loras`` wrapped by the plugin: built at start by default; with ``VLLM_LORA_EXT_BUILD_AT_START=0``
pinned, checked and registered with no build, so that a replica of a fleet builds only what is routed to it, and
built by the first request instead.

The engine client is the outer boundary (a stand-in that records ``add_lora``); the Hub is tests/hubserver.py.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config, serving_models, write_adapter
from vllm_lora_ext.constants import ENV_BUILD_AT_START, ENV_CONFIG
from vllm_lora_ext.diskcache import list_cache
from vllm_lora_ext.integration import server

pytestmark = pytest.mark.vllm


@pytest.fixture(autouse=True)
def plugin_server(monkeypatch: pytest.MonkeyPatch) -> Any:
    """vLLM's serving class with the plugin's two start-up replacements installed, as ``plugin.PATCHES`` does."""
    from vllm.entrypoints.openai.models.serving import OpenAIServingModels

    from vllm_lora_ext.integration.server_patches import make_init_static_loras, make_load_lora_adapter

    def vllms(name: str) -> Any:  # vLLM's own, also where an earlier test left the plugin's patches applied
        fn = getattr(OpenAIServingModels, name)
        while hasattr(fn, "__wrapped__"):
            fn = fn.__wrapped__
        return fn

    monkeypatch.setattr(OpenAIServingModels, "load_lora_adapter", make_load_lora_adapter(vllms("load_lora_adapter")))
    monkeypatch.setattr(OpenAIServingModels, "init_static_loras", make_init_static_loras(vllms("init_static_loras")))
    server.reset_registry()
    yield
    server.reset_registry()


def _config(tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch, *, broken: bool = False) -> None:
    for i in range(2):
        write_adapter(tmp_path / f"local{i}", dense_tensors(llama_shapes(), seed=i), lora_config(r=4))
    weights = save(dense_tensors(llama_shapes(), seed=7))
    hub.repo("acme/style").commit({"adapter_model.safetensors": weights,
                                   "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    if broken:  # a tensor that is no LoRA weight: the loader would refuse it
        tensors = dense_tensors(llama_shapes(), seed=3)
        tensors["base_model.model.lm_head.weight"] = next(iter(tensors.values())).clone()
        write_adapter(tmp_path / "local1", tensors, lora_config(r=4))
    (tmp_path / "deploy.yaml").write_text(
        "adapters:\n"
        f"  a0: {{source: '{tmp_path / 'local0'}'}}\n"
        f"  a1: {{source: '{tmp_path / 'local1'}'}}\n"
        "  style: {source: 'hf:acme/style'}\n")
    monkeypatch.setenv(ENV_CONFIG, str(tmp_path / "deploy.yaml"))


def _started_unbuilt(tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """A server started with the config's adapters registered unbuilt."""
    monkeypatch.setenv(ENV_BUILD_AT_START, "0")
    _config(tmp_path, hub, monkeypatch)
    models = serving_models()
    asyncio.run(models.init_static_loras())
    return models


def test_by_default_every_adapter_is_built_at_start(tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_BUILD_AT_START, raising=False)
    _config(tmp_path, hub, monkeypatch)
    models = serving_models()
    asyncio.run(models.init_static_loras())
    assert sorted(models.lora_requests) == ["a0", "a1", "style"]
    assert {"a0", "a1", "style"} <= set(models.engine_client.asked)  # vLLM's add_lora for each


def test_off_every_adapter_is_pinned_checked_and_registered_without_a_build(
        tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    models = _started_unbuilt(tmp_path, hub, monkeypatch)
    reqs = models.lora_requests
    assert sorted(reqs) == ["a0", "a1", "style"] and models.engine_client.asked == []  # nothing built
    assert len({r.lora_int_id for r in reqs.values()}) == 3  # vLLM's own counter: no id shared
    assert reqs["style"].lora_path.startswith("hf:acme/style@") and "@main" not in reqs["style"].lora_path
    held = {r.repo_id: r.held_by for r in list_cache()}
    assert held["acme/style"] and "pinned at start-up" in held["acme/style"][0]  # its revision stays on disk

    # The first request on a name builds it off the engine loop (a probe to the workers), once.
    asyncio.run(server.build_if_evicted(models, "a1"))
    assert models.engine_client.asked and set(models.engine_client.asked) <= {"a1", str(reqs["a1"].lora_name)}
    asked = len(models.engine_client.asked)
    asyncio.run(server.build_if_evicted(models, "a1"))
    assert len(models.engine_client.asked) == asked  # recently used: no second build


@pytest.mark.parametrize("at_start", ["0", "1"])
def test_a_bad_adapter_stops_the_start_either_way_naming_it(
        tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch, at_start: str) -> None:
    monkeypatch.setenv(ENV_BUILD_AT_START, at_start)
    _config(tmp_path, hub, monkeypatch, broken=True)
    models = serving_models()
    if at_start == "1":  # the build is the worker's: the stand-in engine refuses as a worker would
        async def refuse(req: Any) -> bool:
            if "local1" in str(req.lora_path):
                raise ValueError("1 tensors are not LoRA weights (first: 'base_model.model.lm_head.weight')")
            return True
        models.engine_client.add_lora = refuse
    with pytest.raises(ValueError) as err:
        asyncio.run(models.init_static_loras())
    assert "'a1'" in str(err.value) and "lm_head" in str(err.value)


def test_off_a_model_check_that_fails_at_the_first_build_answers_that_request_with_a_400(
        tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Shapes against the model are the worker's check: unbuilt at start, the first request's build finds the
    mismatch and the request gets the worker's reason as a 400 naming the adapter; the next request tries again."""
    from vllm_lora_ext.errors import AdapterFormatError

    models = _started_unbuilt(tmp_path, hub, monkeypatch)

    async def refuse(req: Any) -> bool:
        raise AdapterFormatError("q_proj: lora_B has 64 rows, the model's q_proj has 4096 outputs")
    models.engine_client.add_lora = refuse
    with pytest.raises(AdapterFormatError) as err:
        asyncio.run(server.build_if_evicted(models, "a0"))
    assert "'a0'" in str(err.value) and "4096 outputs" in str(err.value)
    assert server.http_error(err.value).error.code == 400
    with pytest.raises(AdapterFormatError):  # not remembered as built
        asyncio.run(server.build_if_evicted(models, "a0"))


@pytest.mark.parametrize("fails", [True, False])
def test_requests_that_come_while_the_first_build_runs_wait_for_it(
        tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    """Two first requests at once on an unbuilt adapter: the second waits for the first one's build (one build),
    and neither goes on to the engine before it answered; a failed build is a 400 for both, never the step's."""
    from vllm_lora_ext.errors import AdapterFormatError

    models = _started_unbuilt(tmp_path, hub, monkeypatch)
    events: list[str] = []

    async def slow_build(req: Any) -> bool:
        events.append("probe")
        await asyncio.sleep(0.2)
        events.append("answered")
        if fails:
            raise AdapterFormatError("q_proj: lora_B has 64 rows, the model's q_proj has 4096 outputs")
        return True
    models.engine_client.add_lora = slow_build

    async def one(tag: str) -> str:
        try:
            await server.build_if_evicted(models, "a0")
        except AdapterFormatError:
            return f"{tag}-400"
        events.append(f"{tag}-to-engine")
        return f"{tag}-ok"

    async def both() -> list[str]:
        first = asyncio.ensure_future(one("A"))
        await asyncio.sleep(0.05)  # A's build is under way
        second = asyncio.ensure_future(one("B"))
        return [await first, await second]

    got = asyncio.run(both())
    assert events.count("probe") == 1  # one build for both
    assert got == (["A-400", "B-400"] if fails else ["A-ok", "B-ok"])
    assert all(e in ("probe", "answered") for e in events[:2])  # nothing reached the engine before the answer


def test_off_an_adapter_named_like_the_base_model_stops_the_start(
        tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_BUILD_AT_START, "0")
    write_adapter(tmp_path / "x", dense_tensors(llama_shapes(), seed=1), lora_config(r=4))
    (tmp_path / "deploy.yaml").write_text(f"adapters:\n  base-model: {{source: '{tmp_path / 'x'}'}}\n")
    monkeypatch.setenv(ENV_CONFIG, str(tmp_path / "deploy.yaml"))
    with pytest.raises(ValueError, match="name of a served base model"):
        asyncio.run(serving_models().init_static_loras())


def test_off_without_background_builds_is_refused_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.constants import ENV_PREBUILD, check_settings
    from vllm_lora_ext.errors import SettingsError

    monkeypatch.setenv(ENV_BUILD_AT_START, "0")
    monkeypatch.setenv(ENV_PREBUILD, "0")
    with pytest.raises(SettingsError, match=f"{ENV_BUILD_AT_START}=0 needs background builds"):
        check_settings()
    monkeypatch.delenv(ENV_PREBUILD)
    check_settings()


def test_a_pooling_request_builds_an_unbuilt_adapter_first_and_a_failure_is_its_400(
        tmp_path: Path, hub: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.integration.server_patches import make_pooling_check_model

    models = _started_unbuilt(tmp_path, hub, monkeypatch)
    reached: list[str] = []

    async def vllms_check(self: Any, request: Any) -> None:
        reached.append(request.model)

    check = make_pooling_check_model(vllms_check)
    serving = SimpleNamespace(models=models)
    asyncio.run(check(serving, SimpleNamespace(model="a0")))
    assert models.engine_client.asked == ["a0"] and reached == ["a0"]  # built first, then vLLM's check

    async def refuse(req: Any) -> bool:
        raise AdapterFormatError("q_proj: lora_B has 64 rows, the model's q_proj has 4096 outputs")
    models.engine_client.add_lora = refuse
    answer = asyncio.run(check(serving, SimpleNamespace(model="a1")))
    assert answer.error.code == 400 and "'a1'" in answer.error.message and reached == ["a0"]
