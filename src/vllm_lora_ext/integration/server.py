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

from vllm_lora_ext.errors import AdapterNotFoundError, VllmLoraExtError
from vllm_lora_ext.sources import ResolvedAdapter, resolve_source
from vllm_lora_ext.summary import load_config

logger = logging.getLogger(__name__)


def resolve_and_check(path: str, *, name: str = "adapter") -> ResolvedAdapter:
    """Resolve a source and validate its config (blocking; run it in a thread on a server)."""
    resolved = resolve_source(path)
    load_config(resolved, name=name)
    return resolved


async def pre_resolve(request: Any) -> Any:
    """Return ``request`` with its ``lora_path`` pinned, or an ``ErrorResponse`` (404/400) naming the fix."""
    from vllm.entrypoints.serve.utils.error_response import create_error_response

    path = getattr(request, "lora_path", None)
    if not path:
        return request
    name = getattr(request, "lora_name", None) or "adapter"
    try:
        resolved = await asyncio.to_thread(resolve_and_check, path, name=name)
    except AdapterNotFoundError as err:
        return create_error_response(str(err), err_type="NotFoundError", status_code=HTTPStatus.NOT_FOUND)
    except VllmLoraExtError as err:
        return create_error_response(str(err), err_type="BadRequestError", status_code=HTTPStatus.BAD_REQUEST)
    pinned = resolved.source.canonical()
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
