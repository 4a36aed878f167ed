"""Ray Serve LLM replicas that serve the plugin's adapters: deployment-config names, ``hf:`` sources and mixes.

Ray Serve LLM multiplexes LoRA by ``model="<base>:<adapter>"`` and fetches ``<adapter>`` itself, from
``dynamic_lora_loading_path`` (S3, GCS or Azure), before vLLM sees it. A name from the plugin's
deployment config, a mix such as ``style=0.7+domain=0.3`` or an ``hf:`` source would be looked up as a
bucket folder there and fail. `LoraExtLLMServer` is Ray's ``LLMServer`` with one change: before Ray's
downloader runs, the adapter part of the id is planned by `vllm_lora_ext.multiplex.plan_model_id`, and
everything the plugin serves goes to the plugin (the table is in that module). Ids the plugin does not
know still go to Ray's downloader when one is configured.

Requests naming the base model with the body fields ``adapters`` / ``adapter_weights`` need nothing from
this class: Ray passes the fields through to vLLM, where the plugin routes them in every replica.

Use it as the server class of an ``LLMConfig``; the plugin itself loads in each replica through vLLM's
plugin system, and the deployment config reaches it through ``runtime_env``::

    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app
    from vllm_lora_ext.integration.ray import LoraExtLLMServer

    config = LLMConfig(
        model_loading_config={"model_id": "qwen", "model_source": "Qwen/Qwen3-8B"},
        server_cls=LoraExtLLMServer,
        engine_kwargs={"enable_lora": True, "max_lora_rank": 16, "max_loras": 4},
        runtime_env={"env_vars": {"VLLM_LORA_EXT_CONFIG": "/etc/loras.yaml"}},
    )
    serve.run(build_openai_app({"llm_configs": [config]}))
    # then: model="qwen:style", model="qwen:style=0.7+domain=0.3", or model="qwen" with extra_body adapters

Routing by residency: every id the plugin serves also enters Ray's ``@serve.multiplexed`` loader
(`vllm_lora_ext.integration.ray_report`, no download), so the replica reports it to Serve's router and the next
request for it comes here; this needs a ``lora_config`` in the ``LLMConfig`` (Ray makes no multiplexed loader
without one). `vllm_lora_ext.integration.ray_routing.ResidencyRequestRouter` adds a home replica for ids nobody reports
yet (a hash of the id) and mixes routed by their components.

Importing `vllm_lora_ext` never imports this module or Ray. What it relies on from Ray 2.58 (the release
whose image ships vLLM 0.26): ``LLMServer._run_request`` and ``_maybe_resolve_lora_from_multiplex``, and
``VLLMEngine._oai_models`` (vLLM's ``OpenAIServingModels`` of the replica). A Ray without them is refused
at the first request that needs them, with a message naming what is missing.
"""

from __future__ import annotations

import contextvars
import functools
from collections.abc import AsyncGenerator
from typing import Any

try:
    from ray import serve
    from ray.llm._internal.serve.core.configs.openai_api_models import ErrorInfo, ErrorResponse
    from ray.serve.llm.deployment import LLMServer
except ImportError as err:  # pragma: no cover - only without Ray
    raise ImportError(
        "vllm_lora_ext.integration.ray needs Ray Serve LLM, which is not importable here "
        f"({err}). Install it with: pip install 'vllm-lora-ext[ray]' (Ray Serve and pyarrow; Ray's own [llm] "
        "extra would also pin its vLLM); README 'Ray: residency routing' lists the Ray and vLLM pairs tested.") from err

from vllm_lora_ext.constants import client_sources, max_client_sources
from vllm_lora_ext.integration._compat import load_adapter_request_cls, unload_adapter_request_cls
from vllm_lora_ext.integration.ray_report import _ReportOrDownload, report_held
from vllm_lora_ext.integration.server import _known_adapters, http_error
from vllm_lora_ext.multiplex import ModelIdPlan, Plan, plan_model_id, split_model_id
from vllm_lora_ext.prebuild import RecentlyUsed
from vllm_lora_ext.residency import adapter_id

__all__ = ["LoraExtLLMServer"]

# Set while a request the plugin planned runs through Ray's LLMServer, so Ray's downloader is skipped for it.
_PLANNED: contextvars.ContextVar[ModelIdPlan | None] = contextvars.ContextVar("vllm_lora_ext_ray_plan", default=None)


class LoraExtLLMServer(LLMServer):
    """Ray Serve LLM's ``LLMServer`` whose multiplexed ids may name the plugin's adapters, sources and mixes."""

    def _init_shared(self, llm_config: Any, engine_cls: Any = None, model_downloader: Any = None) -> None:
        # Ray builds the engine config in a remote task, so vLLM's plugin loading never runs in the replica
        # process itself, where vLLM's OpenAI serving objects live: register here, before the engine starts
        # (idempotent), or the deployment config, body-field mixes and source pinning are missing there.
        from vllm_lora_ext.integration.plugin import register

        register()
        # Ray's multiplexed loader (@serve.multiplexed around the downloader) is what reports a replica's ids to
        # Serve's router; the plugin's ids go through it too, answered without a download (_ReportOrDownload).
        super()._init_shared(llm_config, engine_cls, functools.partial(_ReportOrDownload, model_downloader))

    async def _run_request(self, request: Any, *, engine_method: str, batch_output_stream: bool = False,
                           raw_request_info: Any = None) -> AsyncGenerator[Any, None]:
        model_id = serve.get_multiplexed_model_id()
        plan = None
        if model_id:
            try:
                plan = self._vllm_lora_ext_plan(model_id)
                if plan.plan is Plan.SOURCE:
                    error = await self._vllm_lora_ext_register(plan)
                    if error is not None:
                        return _one(error)
                elif plan.plan is not Plan.RAY:
                    request.model = plan.adapter  # the plugin's routing in vLLM resolves the name or the mix
            except Exception as err:  # a clean 4xx for the client, never a replica error
                return _one(_ray_error(http_error(err)))
        token = _PLANNED.set(plan if plan is not None and plan.plan is not Plan.RAY else None)
        try:
            return await super()._run_request(request, engine_method=engine_method,
                                              batch_output_stream=batch_output_stream,
                                              raw_request_info=raw_request_info)
        finally:
            _PLANNED.reset(token)

    async def _maybe_resolve_lora_from_multiplex(self) -> None:
        plan = _PLANNED.get()
        if plan is None:
            await super()._maybe_resolve_lora_from_multiplex()
            return
        # The plugin serves this id (Ray's downloader would look it up as a bucket folder). Still enter it in
        # Ray's multiplexed loader, which reports this replica's ids to Serve's router: the id now routes here.
        if self._vllm_lora_ext_servable(plan):
            await report_held(self, plan.model_id)

    # ----------------------------------------------------------------------------------------------- helpers

    def _vllm_lora_ext_models(self) -> Any:
        models = getattr(self.engine, "_oai_models", None)
        if models is None or not hasattr(models, "lora_requests"):
            raise RuntimeError(
                "LoraExtLLMServer needs Ray's vLLM engine with its vLLM OpenAIServingModels (engine._oai_models); "
                f"this replica's engine {type(self.engine).__name__} has none. Use Ray Serve LLM's vLLM engine "
                "(Ray 2.58 is the tested release).")
        return models

    def _vllm_lora_ext_plan(self, model_id: str) -> ModelIdPlan:
        names, _, _ = _known_adapters(self._vllm_lora_ext_models())  # registered adapters + deployment names
        lora_config = getattr(self._llm_config, "lora_config", None)
        ray_downloads = bool(getattr(lora_config, "dynamic_lora_loading_path", None))
        return plan_model_id(model_id, names=names, client_sources=client_sources(), ray_downloads=ray_downloads)

    def _vllm_lora_ext_servable(self, plan: ModelIdPlan) -> bool:
        """Whether a planned id is worth reporting: a mix only if it parses and names registered adapters (the
        plugin's routing refuses the others with a 4xx, and a refused id must not attract its next request)."""
        if plan.plan is not Plan.MIX:
            return True
        base = split_model_id(plan.model_id)[0]
        parts = adapter_id(plan.model_id).components
        names, _, _ = _known_adapters(self._vllm_lora_ext_models())
        return bool(parts) and all(part[len(base) + 1:] in names for part in parts)

    async def _vllm_lora_ext_register(self, plan: ModelIdPlan) -> Any:
        """Register a client-named source under the whole model id (resolved and pinned by the plugin's
        ``load_lora_adapter``); return Ray's ``ErrorResponse`` on failure, else ``None``.

        At most ``VLLM_LORA_EXT_MAX_CLIENT_SOURCES`` (default 64) such names stay registered: beyond that the
        least recently used one is unregistered (its next request registers it again), so clients naming
        ever new sources under an admitted prefix cannot grow the replica's adapter table without bound.
        """
        models = self._vllm_lora_ext_models()
        recent = self.__dict__.get("_vllm_lora_ext_client_sources")
        if recent is None:
            recent = self.__dict__["_vllm_lora_ext_client_sources"] = RecentlyUsed(max_client_sources())
        if plan.model_id in models.lora_requests:
            if plan.model_id in recent:
                recent.touch(plan.model_id)
            return None
        result = await models.load_lora_adapter(load_adapter_request_cls()(lora_name=plan.model_id,
                                                                           lora_path=plan.adapter))
        if not isinstance(result, str) and plan.model_id not in models.lora_requests:
            return _ray_error(result)
        # registered (by this request, or by a concurrent one that won the race)
        for name in recent.add(plan.model_id):
            await self._vllm_lora_ext_unregister(models, name)
        return None

    async def _vllm_lora_ext_unregister(self, models: Any, name: Any) -> None:
        await models.unload_lora_adapter(unload_adapter_request_cls()(lora_name=name))  # frees the name's lock too


def _ray_error(vllm_error: Any) -> Any:
    """vLLM's ``ErrorResponse`` as Ray's (Ray's router answers it with the status code it carries)."""
    return ErrorResponse(error=ErrorInfo(**vllm_error.error.model_dump()))


async def _one(item: Any) -> AsyncGenerator[Any, None]:
    yield item
