"""API-server side: resolve (download) adapter sources off the event loop, before the engine sees them.

``--lora-modules name=SOURCE`` and ``POST /v1/load_lora_adapter`` both end in
``OpenAIServingModels.load_lora_adapter``; the plugin runs `pre_resolve` first. It downloads in a
worker thread (the engine loop keeps serving), validates the config, and replaces the path with the
pinned source (``hf:org/repo@<commit>:file``), so every worker reads exactly that commit from the
cache with no HTTP request, also when it reloads the adapter after an LRU eviction.
"""

from __future__ import annotations

import asyncio
import logging
from http import HTTPStatus
from typing import Any

from vllm_lora_ext.constants import MIX_PREFIX
from vllm_lora_ext.errors import AdapterNotFoundError, MixError, VllmLoraExtError
from vllm_lora_ext.mixing import MixComponent, MixSpec, parse_mix_expression, resolve_mix
from vllm_lora_ext.sources import ResolvedAdapter, resolve_source
from vllm_lora_ext.summary import load_config

logger = logging.getLogger(__name__)


def resolve_and_check(path: str, *, name: str = "adapter") -> ResolvedAdapter:
    """Resolve a source and validate its config (blocking; run it in a thread on a server)."""
    resolved = resolve_source(path)
    load_config(resolved, name=name)
    return resolved


def pin_path(path: str, *, name: str = "adapter") -> str:
    """Return ``path`` with every source pinned (a plain source, or each component of a ``mix:`` path)."""
    if path.startswith(MIX_PREFIX):
        spec = MixSpec.from_path(path)
        comps = tuple(MixComponent(c.name, resolve_and_check(c.source, name=c.name).source.canonical(), c.weight)
                      for c in spec.components)
        return MixSpec(comps).lora_path
    return resolve_and_check(path, name=name).source.canonical()


async def pre_resolve(request: Any) -> Any:
    """Return ``request`` with its ``lora_path`` pinned, or an ``ErrorResponse`` (404/400) naming the fix."""
    from vllm.entrypoints.serve.utils.error_response import create_error_response

    path = getattr(request, "lora_path", None)
    if not path:
        return request
    name = getattr(request, "lora_name", None) or "adapter"
    try:
        pinned = await asyncio.to_thread(pin_path, path, name=name)
    except AdapterNotFoundError as err:
        return create_error_response(str(err), err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND)
    except VllmLoraExtError as err:
        return create_error_response(str(err), err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST)
    if pinned != path:
        logger.info("adapter %r: source %r pinned to %r", name, path, pinned)
        request = request.model_copy(update={"lora_path": pinned})
    return request


async def load_deployment_adapters(serving_models: Any) -> None:
    """Register every adapter of the deployment config (``VLLM_LORA_EXT_CONFIG``) at server start-up.

    Raises:
        ValueError: an adapter fails to load; the server does not start (as with ``--lora-modules``).
    """
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    from vllm_lora_ext.constants import deployment_config_path
    from vllm_lora_ext.deployment import read_deployment_config

    path = deployment_config_path()
    if path is None:
        return
    config = read_deployment_config(path)
    serving_models.vllm_lora_ext_deployment = config
    for name, adapter in config.adapters.items():
        if name in serving_models.lora_requests:
            raise ValueError(f"Adapter {name!r} is defined both by --lora-modules and by the deployment config "
                             f"{path!r}. Keep one.")
        result = await serving_models.load_lora_adapter(
            LoadLoRAAdapterRequest(lora_name=name, lora_path=adapter.source.canonical()))
        if not isinstance(result, str):
            raise ValueError(f"Deployment config {path!r}: adapter {name!r} failed to load: {result.error.message}")
    logger.info("deployment config %s: registered %d adapters%s", path, len(config.adapters),
                f", default {config.default!r}" if config.default else "")


def _known_adapters(models: Any) -> tuple[dict[str, str], dict[str, float], str | None]:
    """Names a request may use: registered adapters (pinned paths) plus the deployment's defaults."""
    deployment = getattr(models, "vllm_lora_ext_deployment", None)
    sources = {name: req.lora_path for name, req in models.lora_requests.items()
               if not req.lora_path.startswith(MIX_PREFIX)}
    weights: dict[str, float] = {}
    default = None
    if deployment is not None:
        for name, adapter in deployment.adapters.items():
            sources.setdefault(name, adapter.source.canonical())
            weights[name] = adapter.weight
        default = deployment.default
    return sources, weights, default


def _mix_request_fields(request: Any) -> tuple[list[str] | None, list[float] | None]:
    adapters = getattr(request, "adapters", None)
    weights = getattr(request, "adapter_weights", None)
    if adapters is not None and (not isinstance(adapters, list) or not all(isinstance(a, str) for a in adapters)):
        raise MixError(f"'adapters' must be a list of adapter names, got {adapters!r}.")
    if weights is not None:
        if not isinstance(weights, list) or not all(isinstance(w, (int, float)) and not isinstance(w, bool)
                                                    for w in weights):
            raise MixError(f"'adapter_weights' must be a list of numbers, got {weights!r}.")
        weights = [float(w) for w in weights]
    return adapters, weights


async def route_adapters(serving: Any, request: Any) -> Any:
    """Turn a request's adapter choice into a registered adapter name in ``request.model``.

    Rules: body ``adapters`` (+ ``adapter_weights``) win; else a mix written in ``model``
    (``a=0.7+b=0.3``); else, for a request naming the base model (or none), the deployment default.
    A single adapter at weight 1 is that adapter; anything else is a composite, loaded once per
    canonical mix (``engine_client.add_lora``) and then shared by every request naming it.

    Returns ``None`` (request ready) or an ``ErrorResponse`` (400) naming what is wrong.
    """
    from vllm.entrypoints.serve.utils.error_response import create_error_response
    from vllm.lora.request import LoRARequest

    models = serving.models
    try:
        adapters, weights = _mix_request_fields(request)
        model = getattr(request, "model", None)
        sources, default_weights, default = _known_adapters(models)
        if adapters is None and model and model not in models.lora_requests and ("+" in model or "=" in model):
            parsed = parse_mix_expression(model)
            adapters = [n for n, _ in parsed]
            if any(w is not None for _, w in parsed):
                weights = [default_weights.get(n, 1.0) if w is None else w for n, w in parsed]
        elif adapters is None:
            if not default or (model and not serving._is_model_supported(model)):
                return None  # a named adapter or the base model: vLLM's own handling
        spec = resolve_mix(adapters, weights, sources=sources, default_weights=default_weights, default=default)
    except MixError as err:
        return create_error_response(str(err), err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST)
    if spec is None:
        return None
    if len(spec.components) == 1 and spec.components[0].weight == 1.0 and spec.components[0].name in models.lora_requests:
        request.model = spec.components[0].name
        return None
    name = spec.lora_name
    if name not in models.lora_requests:
        async with models.lora_resolver_lock[name]:
            if name not in models.lora_requests:
                req = LoRARequest(lora_name=name, lora_int_id=spec.lora_int_id, lora_path=spec.lora_path)
                try:
                    await models.engine_client.add_lora(req)
                except Exception as err:  # the worker's message names the problem (rank, keys, ...)
                    return create_error_response(f"Mix {name!r} could not be loaded: {err}", err_type="BadRequestError",
                                                 status_code=HTTPStatus.BAD_REQUEST)
                models.lora_requests[name] = req
                logger.info("registered mix %r (%s)", name, ", ".join(f"{c.name}={c.weight:g}" for c in spec.components))
    request.model = name
    return None
