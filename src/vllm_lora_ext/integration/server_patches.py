"""The replacements ``plugin.PATCHES`` installs in the API server process: vLLM's OpenAI serving objects
(adapter loading, start-up adapters, request routing, lease scopes, pooling routes).

Each ``make_*`` takes vLLM's original and returns the replacement; `patching.apply_patch` installs it. The
work itself is in `integration.server` and `integration.leases`, imported when a replacement first runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm_lora_ext._util import clip

logger = logging.getLogger(__name__)


def make_load_lora_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``load_lora_adapter``: pin the source, build a new adapter in the background, hold its revision."""

    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        try:
            return await _load(self, request, base_model_name)
        finally:  # a failed load of a made-up name leaves no lock behind (vLLM makes one per name asked for)
            if getattr(request, "lora_name", None) not in self.lora_requests:
                _drop_idle_lock(self, getattr(request, "lora_name", None))

    async def _load(self: Any, request: Any, base_model_name: str | None) -> Any:
        from vllm.lora.request import LoRARequest

        from vllm_lora_ext.errors import AdapterSourceError
        from vllm_lora_ext.integration.build_errors import typed_load_answer
        from vllm_lora_ext.integration.leases import retire_mixes_of
        from vllm_lora_ext.integration.server import (build_failure, ensure_built, http_error, live_registry,
                                                      pre_resolve, recently_used, refuse_operator_name, sync_disk_holds)
        from vllm_lora_ext.naming import check_not_base_model

        refused = refuse_operator_name(self, request.lora_name, "load over")
        try:  # (vLLM 0.26 registered it, and served it for the base model)
            check_not_base_model(request.lora_name, self.is_base_model)
        except AdapterSourceError as err:
            refused = refused or http_error(err)
        if refused is None:  # vLLM's own cheap refusals (no name or path, a base model's name, loaded already
            refused = await self._check_load_lora_adapter_request(request)  # without load_inplace): no download
        if refused is not None:
            return refused
        await sync_disk_holds(self)  # unloaded adapters' revisions may go before this load downloads
        request_or_error = await pre_resolve(request)
        if not hasattr(request_or_error, "lora_path"):
            return request_or_error  # an ErrorResponse
        name, path = request_or_error.lora_name, request_or_error.lora_path
        replace = getattr(request_or_error, "load_inplace", False)
        built = None
        if (name not in self.lora_requests or replace) and path:  # new, or replaced: build off the engine loop first
            try:
                await ensure_built(self.engine_client, LoRARequest(lora_name=name, lora_int_id=1, lora_path=path))
            except Exception as err:
                return http_error(build_failure(err, name=name, source=path))
            built = time.perf_counter()
        result = await original(self, request_or_error, base_model_name)
        registered = self.lora_requests.get(name) if isinstance(result, str) else None
        if getattr(registered, "load_inplace", False):  # vLLM 0.26 kept the flag on the request it serves: every
            registered.load_inplace = False  # step with the adapter reloaded it from disk (0.33 resets it too)
        if isinstance(result, str) and path:
            if built is not None:  # the engine's part: registering the built adapter and its slot copy
                logger.info("adapter %r: registered by the engine %.3f s after its build was answered",
                            clip(str(name)), time.perf_counter() - built)
            recently_used(self.engine_client).touch(path)
            await sync_disk_holds(self)  # its revision is in use while it stays registered
            if replace:  # the mixes made with it were built from its old weights: made anew when next asked for
                await retire_mixes_of(self, live_registry(), name)
        typed = typed_load_answer(result, name=name, source=path or "") if not isinstance(result, str) else None
        return http_error(typed) if typed is not None else result  # the engine's build failed: 4xx, client text

    return load_lora_adapter


def _drop_idle_lock(serving: Any, name: Any) -> None:
    """Drop vLLM's lock for adapter ``name`` if nothing holds or waits for it: it keeps one per name ever asked
    for, so a client's made-up names would pile up."""
    locks = getattr(serving, "lora_resolver_lock", None)
    lock = locks.get(name) if isinstance(locks, dict) else None
    if lock is not None and not lock.locked() and not getattr(lock, "_waiters", None):
        del locks[name]


def make_unload_lora_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``unload_lora_adapter``: refuse the operator's names and the server's mixes; once an adapter is
    unloaded, retire the mixes made with it; drop the name's lock once it is free."""

    async def unload_lora_adapter(self: Any, request: Any) -> Any:
        from vllm_lora_ext.integration import server
        from vllm_lora_ext.integration.leases import refuse_mix_unload, retire_mixes_of

        refused = server.refuse_operator_name(self, request.lora_name, "unload")
        if refused is not None:
            return refused
        mix = refuse_mix_unload(self, request.lora_name)
        if mix is not None:
            return server.http_error(mix)
        try:
            answer = await original(self, request)
            if isinstance(answer, str):  # (vLLM's success; a refusal is its ErrorResponse)
                await retire_mixes_of(self, server.live_registry(), request.lora_name)
            return answer
        finally:
            _drop_idle_lock(self, request.lora_name)

    return unload_lora_adapter


def make_init_static_loras(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``init_static_loras``: register the deployment config's adapters after vLLM's own."""

    async def init_static_loras(self: Any) -> None:
        from vllm_lora_ext.integration.server import STARTUP, sync_disk_holds
        from vllm_lora_ext.integration.startup import load_deployment_adapters

        token = STARTUP.set(True)
        try:
            await original(self)
            await load_deployment_adapters(self)
            await sync_disk_holds(self)  # adapters registered unbuilt keep their revisions on disk too
        finally:
            STARTUP.reset(token)

    return init_static_loras


def make_check_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``BaseServing._check_model``: route the request's adapter choice (`server.route_adapters`) first."""

    async def _check_model(self: Any, request: Any) -> Any:
        from vllm_lora_ext.integration.server import route_adapters

        error = await route_adapters(self, request)
        if error is not None:
            return error
        return await original(self, request)

    return _check_model


def make_maybe_get_adapters(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``_maybe_get_adapters``: the ``LoRARequest`` routing attached, else vLLM's lookup."""

    def _maybe_get_adapters(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_lora_ext.integration.server import routed_lora

        routed = routed_lora(request)
        return routed if routed is not None else original(self, request, *args, **kwargs)

    return _maybe_get_adapters

def make_request_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return the handlers' wrapper: run the request in a lease scope (`leases.request_scope`)."""

    async def _with_kv_transfer_rejection_cleanup(self: Any, awaitable: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_lora_ext.integration.leases import request_scope

        with request_scope():  # what the request's routing holds is released when its handler returns
            return await original(self, awaitable, *args, **kwargs)

    return _with_kv_transfer_rejection_cleanup


def make_batch_request_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``create_batch_chat_completion``: run the batch request in a lease scope, as `make_request_scope`
    does for the other generation handlers."""

    async def create_batch_chat_completion(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_lora_ext.integration.leases import request_scope

        with request_scope():  # the mix its routing holds stays registered until the batch's answer is made
            return await original(self, request, *args, **kwargs)

    return create_batch_chat_completion


def make_pooling_check_model(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``PoolingBaseServing._check_model``: refuse a mix on a pooling route (400); build a named adapter
    that may not be in the workers' cache first, off the engine loop (`server.build_if_evicted`)."""

    async def _check_model(self: Any, request: Any) -> Any:
        from vllm_lora_ext.integration.leases import refuse_mix
        from vllm_lora_ext.integration.server import build_if_evicted, http_error

        refuse_mix(self, request)
        try:
            await build_if_evicted(self.models, getattr(request, "model", None))
        except Exception as err:
            return http_error(err)
        return await original(self, request)

    return _check_model


def make_dropped_mix_fields_guard(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``create_messages`` (``/v1/messages``), ``serve_tokens`` (``/inference/v1/generate``) or
    ``create_chat_v2`` (``/cohere/v2/chat``): their request types drop the body fields ``adapters`` and
    ``adapter_weights`` before any handler sees them, so a request sending them would run without its mix and
    without an error. Refuse it (400), naming the fields and the ``model`` syntax these routes do read, from the
    body as vLLM's route parsed it (`_parsed_body`)."""

    async def handler(self: Any, request: Any, raw_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        from vllm_lora_ext.errors import MixError
        from vllm_lora_ext.integration.server import http_error
        from vllm_lora_ext.naming import mix_body_fields

        fields = mix_body_fields(await _parsed_body(raw_request))
        if fields:
            path = getattr(getattr(raw_request, "url", None), "path", "this route")
            return http_error(MixError(
                f"{path} does not read the body field(s) {', '.join(fields)}: vLLM's request type for it drops them, "
                f"so the mix would not be served. Write the mix in 'model' instead (\"model\": \"a=0.7+b=0.3\"), "
                f"or send the request to /v1/chat/completions or /v1/completions, which read the fields."))
        return await original(self, request, raw_request, *args, **kwargs)

    return handler


def make_pooling_init_ctx(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``PoolingServing._init_ctx``: ``/v2/embed``'s request type drops the mix body fields, which the other
    pooling routes keep and refuse (`make_pooling_check_model`), so such a request was embedded without an error:
    refuse the fields read from the body vLLM's route parsed, with the same 400."""

    async def _init_ctx(self: Any, io_processor: Any, request: Any, raw_request: Any = None, *args: Any,
                        **kwargs: Any) -> Any:
        from types import SimpleNamespace

        from vllm_lora_ext.integration.leases import refuse_mix
        from vllm_lora_ext.naming import mix_body_fields

        body = await _parsed_body(raw_request)
        fields = mix_body_fields(body)
        if fields and isinstance(body, dict):
            refuse_mix(self, SimpleNamespace(model=getattr(request, "model", None), **{f: body[f] for f in fields}))
        return await original(self, io_processor, request, raw_request, *args, **kwargs)

    return _init_ctx


async def _parsed_body(raw_request: Any) -> object:
    """The request's body as vLLM's route parsed it (FastAPI parses a JSON body with Starlette's ``Request.json``,
    which keeps the result: no second parse, and the same reading pydantic validated, escaped keys and UTF-16/32
    included); None where there is no request or it cannot be read again (the route then runs as vLLM has it,
    never failing over the guard)."""
    if raw_request is None:
        return None
    try:
        return await raw_request.json()
    except Exception:  # e.g. a stream consumed without being kept
        logger.debug("vllm_lora_ext: the body of %s could not be read again", getattr(raw_request, "url", "?"))
        return None
