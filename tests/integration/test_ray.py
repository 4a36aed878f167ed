"""LoraExtLLMServer with Ray Serve LLM's own classes (LLMConfig, LLMServer, Serve's request context).

The replica's engine is the outer boundary (it needs a GPU): a stand-in for Ray's ``LLMEngine`` whose
``_oai_models`` is vLLM's real ``OpenAIServingModels`` (patched by ``register()``) over an engine client
that records ``add_lora``, and whose ``completions`` does what vLLM's serving does before generation with
the plugin loaded: the plugin's routing (``route_adapters``), then the adapter the request would run on.
Ray's downloader is replaced through Ray's own injection point (``model_downloader``) by one that records.

These tests need Ray Serve LLM importable next to vLLM: Ray 2.58 with vLLM 0.26 (the pair Ray's image
ships; ``scripts/test-vllm-matrix.sh 0.26.0`` installs it). With a newer vLLM, Ray 2.58's LLM module
fails to import and they are skipped.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from factories import make_dense_adapter
from vllm_lora_ext.constants import MIX_PREFIX, PREBUILD_PREFIX

try:
    from ray.llm._internal.serve.core.engine.protocol import LLMEngine
    from ray.serve.llm import LLMConfig

    from vllm_lora_ext.integration.ray import LoraExtLLMServer
    WHY = ""
except Exception as err:  # Ray missing, or Ray's LLM module not importable with this vLLM
    LLMEngine = object  # type: ignore[assignment,misc]
    WHY = f"{type(err).__name__}: {str(err)[:160]}"

pytestmark = [pytest.mark.vllm, pytest.mark.filterwarnings("ignore:coroutine 'LLMServer.__del__'"),
              pytest.mark.skipif(bool(WHY), reason=f"Ray Serve LLM not importable: {WHY}")]
BASE = "base"


class _EngineClient:
    """vLLM's engine client, seen from the replica's API objects: records the adapters it is asked to add."""

    model_config = SimpleNamespace(max_model_len=256)
    renderer = None
    input_processor = None
    vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))

    def __init__(self) -> None:
        self.added: list[Any] = []

    async def add_lora(self, req: Any) -> bool:
        if not req.lora_path.startswith(PREBUILD_PREFIX):
            self.added.append(req)
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        return True


class _Engine(LLMEngine):  # type: ignore[misc]
    """Ray's replica engine up to the point where vLLM would generate."""

    def __init__(self, llm_config: Any) -> None:
        from vllm.entrypoints.openai.models.protocol import BaseModelPath
        from vllm.entrypoints.openai.models.serving import OpenAIServingModels

        self.llm_config = llm_config
        self._oai_models = OpenAIServingModels(_EngineClient(), [BaseModelPath(name=BASE, model_path="/m")])
        self.serving = SimpleNamespace(models=self._oai_models, _is_model_supported=lambda m: not m or m == BASE)

    async def start(self) -> None:
        await self._oai_models.init_static_loras()

    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        from vllm_lora_ext.integration.server import route_adapters, routed_lora

        error = await route_adapters(self.serving, request)
        if error is not None:
            yield {"error": error.error.code, "message": error.error.message}
            return
        lora = routed_lora(request) or self._oai_models.lora_requests.get(request.model)
        yield {"model": request.model, "lora": None if lora is None else (lora.lora_name, lora.lora_path)}

    async def chat(self, *a: Any, **k: Any) -> Any:  # pragma: no cover - not used
        raise NotImplementedError

    embeddings = transcriptions = chat

    async def resolve_lora(self, disk_lora_model: Any) -> None:
        self.resolved = disk_lora_model

    async def reset_prefix_cache(self) -> None:  # pragma: no cover
        pass

    def routing_stats(self) -> dict[str, Any]:  # pragma: no cover
        return {}


class _RecordingDownloader:
    """Ray's downloader, at Ray's injection point: records what it is asked to fetch from the bucket."""

    calls: list[str] = []  # stays empty: the plugin's ids never reach Ray's downloader

    def __init__(self, **kwargs: Any) -> None:
        pass

    async def load_model_from_config(self, lora_model_id: str, llm_config: Any) -> Any:
        from ray.llm._internal.serve.core.configs.llm_config import DiskMultiplexConfig

        _RecordingDownloader.calls.append(lora_model_id)
        return DiskMultiplexConfig(model_id=lora_model_id, max_total_tokens=None, local_path="/bucket/x",
                                   lora_assigned_int_id=1)


@pytest.fixture
def deployment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    from vllm_lora_ext.integration import plugin

    plugin.unregister()  # the server class registers the plugin itself (see test_the_server_registers_the_plugin)
    from vllm_lora_ext.integration.server import reset_registry

    reset_registry()
    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"adapters:\n  style: {{source: '{a}', weight: 0.7}}\n  domain: {{source: '{b}', weight: 0.3}}\n")
    monkeypatch.setenv("VLLM_LORA_EXT_CONFIG", str(cfg))
    monkeypatch.delenv("VLLM_LORA_EXT_CLIENT_SOURCES", raising=False)
    _RecordingDownloader.calls.clear()
    return cfg


def _server(*, bucket: bool = False, lora: dict[str, Any] | None = None) -> Any:
    lora = {"dynamic_lora_loading_path": "s3://bucket/loras"} if bucket else lora
    config = LLMConfig(model_loading_config={"model_id": BASE, "model_source": "/m"}, lora_config=lora or None,
                       server_cls=LoraExtLLMServer)
    assert config.server_cls is LoraExtLLMServer
    server = LoraExtLLMServer.sync_init(config, engine_cls=_Engine, model_downloader=_RecordingDownloader)
    server.engine = _Engine(config)
    asyncio.run(server.engine.start())  # vLLM's start-up registration: the deployment config's adapters
    return server


def _ask(server: Any, model: str, **fields: Any) -> dict[str, Any]:
    """One completion through Ray's LLMServer.completions, as Ray's router sends it (multiplexed id = model
    when it names an adapter)."""
    from ray.serve.context import _RequestContext, _serve_request_context
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    async def run() -> dict[str, Any]:
        token = _serve_request_context.set(_RequestContext(multiplexed_model_id=model if ":" in model else ""))
        try:
            stream = await server.completions(CompletionRequest(model=model, prompt="hi", **fields))
            items = [item async for item in stream]
        finally:
            _serve_request_context.reset(token)
        assert len(items) == 1
        item = items[0]
        if not isinstance(item, dict):  # Ray's ErrorResponse: the status code Ray's router answers with
            return {"error": item.error.code, "message": item.error.message}
        return item

    return asyncio.run(run())


def test_a_deployment_config_name_is_served_by_the_plugin_not_looked_up_in_the_bucket(deployment: Path) -> None:
    out = _ask(_server(bucket=True), f"{BASE}:style")
    assert out["model"] == "style" and out["lora"][0] == "style"
    assert _RecordingDownloader.calls == []


def test_a_mix_in_the_model_id_and_one_in_the_body_fields_share_one_composite(deployment: Path) -> None:
    server = _server(bucket=True)
    by_id = _ask(server, f"{BASE}:style=0.7+domain=0.3")
    by_body = _ask(server, BASE, adapters=["style", "domain"], adapter_weights=[0.7, 0.3])
    assert by_id["model"].startswith("mix-style=0.7+domain=0.3-") and by_id == by_body
    assert by_id["lora"][1].startswith(MIX_PREFIX)
    mixes = [r for r in server.engine._oai_models.engine_client.added if r.lora_path.startswith(MIX_PREFIX)]
    assert len(mixes) == 1 and _RecordingDownloader.calls == []


def test_an_unknown_id_still_goes_to_rays_downloader_when_a_bucket_is_configured(deployment: Path) -> None:
    # Ray's multiplexed loader (serve.multiplexed around the downloader) runs only inside a deployment; here it
    # refuses with its own error, which shows the request reached it and the plugin let it through.
    with pytest.raises(RuntimeError, match="can only be used within a deployment"):
        _ask(_server(bucket=True), f"{BASE}:folder-7")


@pytest.mark.parametrize("model, status, match", [
    (f"{BASE}:nope", 404, "not served here"),
    (f"{BASE}:hf:acme/loras", 403, "VLLM_LORA_EXT_CLIENT_SOURCES"),
    (f"{BASE}:/etc", 403, "may not be named"),
    (f"{BASE}:style=nan+domain", 400, "finite"),
    (f"{BASE}:style=0.5+ghost=0.5", 400, "ghost"),
    (f'{BASE}:mix:{{"v":1}}', 400, "only the server makes"),
    (f"{BASE}:mix-style", 404, "Ask for the mix by its adapters"),
    (f"{BASE}:mix-style=0.7+domain=0.3-{'0' * 24}", 404, "is not registered on this server"),
])
def test_bad_ids_get_a_clean_4xx_and_nothing_is_loaded(deployment: Path, model: str, status: int, match: str) -> None:
    server = _server()
    out = _ask(server, model)
    assert out["error"] == status and match in out["message"], out
    added = server.engine._oai_models.engine_client.added
    assert [r.lora_name for r in added] == ["style", "domain"]  # the deployment config's, nothing else
    assert _RecordingDownloader.calls == []


def test_a_mix_in_the_model_id_cannot_be_squatted_through_the_replicas_load_route(
        deployment: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    server = _server()
    models = server.engine._oai_models
    squat = LoadLoRAAdapterRequest(lora_name="style=0.7+domain=0.3", lora_path=str(deployment.parent / "a"))
    result = asyncio.run(models.load_lora_adapter(squat))
    assert not isinstance(result, str) and result.error.code == 400 and "contains '+' and '='" in result.error.message
    assert "style=0.7+domain=0.3" not in models.lora_requests
    monkeypatch.setenv("VLLM_LORA_EXT_CLIENT_SOURCES", "hf:acme/")
    out = _ask(server, f"{BASE}:hf:acme/a=1")  # a source id would register under a name that spells a mix
    assert out["error"] == 400 and "contains '='" in out["message"], out
    out = _ask(server, f"{BASE}:style=0.7+domain=0.3")
    assert out["model"].startswith("mix-style=0.7+domain=0.3-") and out["lora"][1].startswith(MIX_PREFIX)
    assert [r.lora_name for r in models.engine_client.added][:2] == ["style", "domain"]
    assert _RecordingDownloader.calls == []


def test_a_client_named_hf_source_under_an_admitted_prefix_is_pinned_and_served(
        deployment: Path, hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_dense_adapter(tmp_path / "hub-a", seed=3)
    sha = hub.repo("acme/loras").commit({"sql/adapter_config.json": (folder / "adapter_config.json").read_bytes(),
                                         "sql/adapter_model.safetensors":
                                             (folder / "adapter_model.safetensors").read_bytes()})
    monkeypatch.setenv("VLLM_LORA_EXT_CLIENT_SOURCES", "hf:acme/")
    server = _server()
    model = f"{BASE}:hf:acme/loras:sql"
    first, again = _ask(server, model), _ask(server, model)
    assert first == again and first["model"] == model
    assert first["lora"] == (model, f"hf:acme/loras@{sha}:sql")  # pinned to the commit it resolved
    added = [r for r in server.engine._oai_models.engine_client.added if r.lora_name == model]
    assert len(added) == 1  # registered once, then served from the registration
    monkeypatch.setenv("VLLM_LORA_EXT_CLIENT_SOURCES", "hf:other/")
    assert _ask(_server(), f"{BASE}:hf:acme/loras:sql")["error"] == 403


def test_the_server_registers_the_plugin_in_the_replica_process(deployment: Path) -> None:
    # Ray builds the engine config in a remote task, so vLLM's plugin loading never runs in the replica
    # process, where the OpenAI serving objects the plugin patches live.
    from vllm_lora_ext.integration import plugin

    plugin.unregister()
    assert not plugin.is_registered() and not plugin.applied()
    _server()
    assert plugin.is_registered()  # patches apply as their modules are imported; these two already are:
    assert {"vllm.entrypoints.openai.models.serving.OpenAIServingModels.load_lora_adapter",
            "vllm.entrypoints.openai.models.serving.OpenAIServingModels.init_static_loras"} <= set(plugin.applied())


def test_the_example_recipe_builds_rays_openai_app_with_the_plugins_server_and_config(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """examples/ray_serve_llm.py through Ray's own builder (a local CPU-only Ray: the builder reads its runtime
    context): the router's model deployment is LoraExtLLMServer, with the replica count and the plugin's
    settings in every replica's runtime_env."""
    import sys

    import ray

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import ray_serve_llm as recipe

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")  # Ray would otherwise report usage over the network
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # the driver's Hub and plugin settings reach the replicas
    monkeypatch.setenv("VLLM_LORA_EXT_DISK_CACHE_BYTES", "20GiB")
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", "loras:/srv/more")  # relative entries made absolute
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False)
    try:
        options = recipe.ServeOptions(replicas=2, client_sources="hf:acme/", engine_kwargs={"enforce_eager": True})
        app = recipe.build_app("/m", "base", str(tmp_path / "loras.yaml"), options)
        address = ray.get_runtime_context().gcs_address
    finally:
        ray.shutdown()
    servers = app._bound_deployment.init_kwargs["llm_deployments"]
    (server,) = servers.values()
    dep = server._bound_deployment
    assert issubclass(dep.func_or_class, LoraExtLLMServer) and dep.num_replicas == 2
    env = dep.ray_actor_options["runtime_env"]["env_vars"]
    assert env["VLLM_LORA_EXT_CONFIG"] == str(tmp_path / "loras.yaml")
    assert env["VLLM_LORA_EXT_CLIENT_SOURCES"] == "hf:acme/" and env["RAY_ADDRESS"] == address
    assert env["HF_HOME"] == str(tmp_path / "hf") and env["VLLM_LORA_EXT_DISK_CACHE_BYTES"] == "20GiB"
    assert env["VLLM_LORA_EXT_ALLOWED_ROOTS"] == f"{os.path.abspath('loras')}:/srv/more"
    # residency routing: Ray's multiplexed loader on (lora_config), the plugin's router in front of the replicas
    config = dep.init_kwargs["llm_config"]
    assert config.lora_config.max_num_adapters_per_replica == 16
    router = dep._deployment_config.request_router_config.get_request_router_class()
    assert router.__name__ == "ResidencyRequestRouter"
    assert env["VLLM_LORA_EXT_BUILD_AT_START"] == "0"  # each replica builds what is routed to it, not all at start
    # a replica counts as full at the engine's batch size (Ray Serve LLM's 1e9 would pin a hot id to one replica)
    assert dep._deployment_config.max_ongoing_requests == 256


def test_client_named_sources_stay_bounded_least_recently_used_first(
        deployment: Path, hub: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder = make_dense_adapter(tmp_path / "hub-b", seed=4)
    files = {f"{sub}/{f}": (folder / f).read_bytes() for sub in ("x", "y", "z")
             for f in ("adapter_config.json", "adapter_model.safetensors")}
    hub.repo("acme/many").commit(files)
    monkeypatch.setenv("VLLM_LORA_EXT_CLIENT_SOURCES", "hf:acme/")
    monkeypatch.setenv("VLLM_LORA_EXT_MAX_CLIENT_SOURCES", "2")
    server = _server()
    ids = {sub: f"{BASE}:hf:acme/many:{sub}" for sub in ("x", "y", "z")}
    registered = server.engine._oai_models.lora_requests
    for sub in ("x", "y", "x", "z"):  # x is used again before z arrives: y is the least recently used
        assert _ask(server, ids[sub])["model"] == ids[sub]
    assert ids["x"] in registered and ids["z"] in registered and ids["y"] not in registered
    assert {"style", "domain"} <= set(registered)  # the operator's adapters are never trimmed
    assert _ask(server, ids["y"])["model"] == ids["y"]  # registered again on its next request
    assert ids["x"] not in registered and len([n for n in registered if n.startswith(f"{BASE}:")]) == 2


def _held_ids(server: Any) -> list[str]:
    """The ids ``server`` reports to Serve's router: loaded or loading in its multiplexed loader (sorted)."""
    loader = getattr(server, "_load_model", None)
    state = getattr(getattr(loader, "__wrapped__", None), "__serve_multiplex_wrapper", None)
    return sorted(state._get_loading_and_loaded_model_ids()) if state is not None else []


def test_the_plugins_ids_are_reported_through_serves_multiplexed_loader(
        deployment: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Serve's router learns what a replica holds only from its ``@serve.multiplexed`` loader. Ray PR #61304
    replaces that loader in LLMServer with one that reports nothing: against it this test fails (requests are
    still served, see test_without_serves_loader_requests_are_served_and_one_warning_says_why)."""
    from ray.serve import multiplex

    from vllm_lora_ext.integration.ray_report import is_serve_multiplexed

    # the replica's runtime context, which Serve's loader reads (outside a running deployment there is none), and
    # Serve's controller, which its pushes reach (test_ray_serve_residency.py runs the real one)
    monkeypatch.setattr(multiplex, "_get_internal_replica_context",
                        lambda: SimpleNamespace(app_name="app", deployment="llm", replica_id="replica-1"))
    monkeypatch.setattr(multiplex, "_get_global_client", lambda: SimpleNamespace(record_request_routing_info=id))
    server = _server(lora={"max_num_adapters_per_replica": 2})
    assert is_serve_multiplexed(server._load_model)
    for model in (f"{BASE}:style", f"{BASE}:style=0.7+domain=0.3", f"{BASE}:nope", f"{BASE}:style=0.5+ghost=0.5",
                  f"{BASE}:style=nan+domain", f"{BASE}:style"):
        _ask(server, model)
    assert _held_ids(server) == [f"{BASE}:style", f"{BASE}:style=0.7+domain=0.3"]  # not the refused ids
    _ask(server, f"{BASE}:domain")  # Ray's LRU bounds what is reported: the least recently used mix goes
    assert _held_ids(server) == [f"{BASE}:domain", f"{BASE}:style"]
    assert _RecordingDownloader.calls == []  # nothing the plugin serves was looked up in a bucket


def test_without_serves_loader_requests_are_served_and_one_warning_says_why(
        deployment: Path, caplog: pytest.LogCaptureFixture) -> None:
    from vllm_lora_ext.integration import ray_report

    ray_report._WARNED.clear()
    server = _server()  # no lora_config: Ray makes no multiplexed loader
    assert not ray_report.is_serve_multiplexed(server._load_model)
    assert _ask(server, f"{BASE}:style")["lora"][0] == "style"
    assert _ask(server, f"{BASE}:domain")["lora"][0] == "domain"
    warned = [r for r in caplog.records if "max_num_adapters_per_replica" in r.getMessage()]
    assert len(warned) == 1 and "PR #61304" in warned[0].getMessage()
