"""The deployment config's adapters at server start-up: registered, and built now or by their first request.

`load_deployment_adapters` runs inside vLLM's ``init_static_loras`` (after ``--lora-modules``). By default each
adapter goes through ``load_lora_adapter`` as a ``--lora-modules`` entry does: pinned, built in the worker
(off the engine loop) and registered, and a bad one stops the start.

With ``VLLM_LORA_EXT_BUILD_AT_START=0`` (what Ray Serve LLM replicas routed by residency use) each
adapter is pinned and checked from its config and safetensors header in the API server, the same rules
``vllm-lora inspect`` applies, and a bad one still stops the start; but it is registered without a build.
Its first request builds it in the background (`server.build_if_evicted`), so a replica of a fleet builds,
and holds in memory, only the adapters routed to it, not every adapter of the config. What needs the model
(shapes against its modules, keys it has no module for, parts it would not apply) is checked by that build:
a failure there answers the request with the error (a 4xx naming the adapter), and the server keeps serving.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from vllm_lora_ext.constants import build_at_start, deployment_config_path
from vllm_lora_ext.integration._compat import load_adapter_request_cls, next_lora_id
from vllm_lora_ext.integration.patching import DEPLOYMENT_ATTR

logger = logging.getLogger(__name__)


async def load_deployment_adapters(serving_models: Any) -> None:
    """Register every adapter of the deployment config (``VLLM_LORA_EXT_CONFIG``) at server start-up.

    Raises:
        ValueError: an adapter fails to load (or, not built at start, its check); the server does not start
            (as with ``--lora-modules``).
    """
    from vllm_lora_ext.deployment import read_deployment_config

    path = deployment_config_path()
    if path is None:
        return
    config = read_deployment_config(path)
    setattr(serving_models, DEPLOYMENT_ATTR, config)
    request_cls = load_adapter_request_cls()
    built = build_at_start()
    for name, adapter in config.adapters.items():
        if name in serving_models.lora_requests:
            raise ValueError(f"Adapter {name!r} is defined both by --lora-modules and by the deployment config "
                             f"{path!r}. Keep one.")
        request = request_cls(lora_name=name, lora_path=adapter.source.canonical())
        if built:
            result = await serving_models.load_lora_adapter(request)
        else:
            result = await register_unbuilt(serving_models, request)
        if not isinstance(result, str):
            raise ValueError(f"Deployment config {path!r}: adapter {name!r} failed to load: {result.error.message}")
    logger.info("deployment config %s: registered %d adapters%s%s", path, len(config.adapters),
                f", default {config.default!r}" if config.default else "",
                "" if built else " (checked; each is built by its first request)")


async def register_unbuilt(serving_models: Any, request: Any) -> Any:
    """Pin and check one adapter, then register it under its name without building it; return vLLM's success
    text or an ``ErrorResponse`` naming what is wrong (its source, a rule of `summary.summarize_adapter`)."""
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.errors import AdapterFormatError, AdapterSourceError
    from vllm_lora_ext.integration.server import http_error, pre_resolve, sync_disk_holds
    from vllm_lora_ext.naming import check_not_base_model
    from vllm_lora_ext.sources import resolve_source
    from vllm_lora_ext.summary import summarize_adapter

    try:  # (as load_lora_adapter refuses it)
        check_not_base_model(request.lora_name, serving_models.is_base_model)
    except AdapterSourceError as err:
        return http_error(err)
    pinned = await pre_resolve(request)
    if not hasattr(pinned, "lora_path"):
        return pinned  # an ErrorResponse
    name, path = pinned.lora_name, pinned.lora_path
    try:
        summary = await asyncio.to_thread(summarize_adapter, resolve_source(path), name=name)
        if summary.problems:
            raise AdapterFormatError(f"Adapter {name!r} ({path}): " + "; ".join(summary.problems), adapter=name)
    except Exception as err:
        return http_error(err)
    serving_models.lora_requests[name] = LoRARequest(lora_name=name, lora_int_id=next_lora_id(serving_models),
                                                     lora_path=path)
    await sync_disk_holds(serving_models)  # its revision held (pinned) before the next adapter downloads
    logger.info("adapter %r registered from %s; built by its first request", name, path)
    return f"Success: LoRA adapter '{name}' registered (built by its first request)."
