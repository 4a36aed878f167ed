"""The ``vllm.general_plugins`` entry point: ``register()``.

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker, model
registry subprocesses), possibly more than once per process. It is therefore re-entrant, cheap, and
touches no device. It imports no heavy vLLM module: the patches below are applied when vLLM itself
imports the module that holds the patched name (a post-import hook), so the API server never
pays for vLLM's LoRA layers.

Patches (each the narrowest hook the research found stable across vLLM 0.20–0.33):

- ``vllm.lora.worker_manager.WorkerLoRAManager._load_adapter`` -> `loader.load_lora_model`
  (worker processes: sources, validation, MoE layouts, EP reads, mixes).
- ``vllm.v1.engine.llm_engine.LLMEngine.add_request`` -> pre-loads a request's adapter through
  ``add_lora`` before the request is queued (offline ``LLM.generate``), so a bad adapter raises at
  the call instead of killing the engine inside its step.
- ``vllm.entrypoints.openai.models.serving.OpenAIServingModels.load_lora_adapter`` -> resolves
  (downloads) the source in a thread of the API server first and hands the engine a pinned source,
  so downloads never block the engine loop (``--lora-modules``, ``/v1/load_lora_adapter``).
"""

from __future__ import annotations

import logging
import os
from types import ModuleType
from typing import Any

from vllm_lora_ext import __version__
from vllm_lora_ext._logging import attach_handler_once
from vllm_lora_ext.constants import plugin_disabled
from vllm_lora_ext.integration._compat import (
    BASE_SERVING_MODULE,
    LLM_ENGINE_MODULE,
    SERVING_MODELS_MODULE,
    WORKER_MANAGER_MODULE,
    check_vllm_version,
    when_imported,
)

logger = logging.getLogger(__name__)

_REGISTERED = False
PATCH_MARK = "__vllm_lora_ext_patched__"


def is_registered() -> bool:
    """Return whether ``register()`` has run in this process."""
    return _REGISTERED


def register() -> None:
    """Install the plugin in this vLLM process (idempotent; safe to call many times).

    Raises:
        [`UnsupportedVLLMError`]: the installed vLLM is outside the tested range (set
            ``VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM=1`` to try anyway).
    """
    global _REGISTERED
    if _REGISTERED:
        return
    attach_handler_once()
    if plugin_disabled():
        logger.info("vllm_lora_ext %s is installed but disabled (VLLM_LORA_EXT_DISABLE) in process %d",
                    __version__, os.getpid())
        _REGISTERED = True
        return
    vllm_version = check_vllm_version()
    when_imported(WORKER_MANAGER_MODULE, _patch_worker_manager)
    when_imported(LLM_ENGINE_MODULE, _patch_llm_engine)
    when_imported(SERVING_MODELS_MODULE, _patch_serving_models)
    when_imported(BASE_SERVING_MODULE, _patch_base_serving)
    _REGISTERED = True
    logger.info("vllm_lora_ext %s active in process %d (vLLM %s)", __version__, os.getpid(), vllm_version)


def _mark(fn: Any, original: Any) -> Any:
    setattr(fn, PATCH_MARK, True)
    fn.__wrapped__ = original
    return fn


def _patch_worker_manager(module: ModuleType) -> None:
    cls = module.WorkerLoRAManager
    if getattr(cls._load_adapter, PATCH_MARK, False):
        return
    original = cls._load_adapter

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        from vllm_lora_ext.integration.loader import load_lora_model

        return load_lora_model(self, lora_request)

    cls._load_adapter = _mark(_load_adapter, original)
    logger.debug("patched %s.WorkerLoRAManager._load_adapter", module.__name__)


def _patch_llm_engine(module: ModuleType) -> None:
    cls = module.LLMEngine
    if getattr(cls.add_request, PATCH_MARK, False):
        return
    original = cls.add_request

    def add_request(self: Any, request_id: str, prompt: Any, params: Any, arrival_time: Any = None,
                    lora_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        if lora_request is not None:
            _preload_offline(self, lora_request)
        return original(self, request_id, prompt, params, arrival_time, lora_request, *args, **kwargs)

    cls.add_request = _mark(add_request, original)
    logger.debug("patched %s.LLMEngine.add_request", module.__name__)


def _preload_offline(engine: Any, lora_request: Any) -> None:
    # vLLM loads a request's adapter lazily inside the engine step, where any error kills the
    # engine. Loading it once through add_lora first raises here, in the caller, instead.
    # Source and config problems raise our typed errors right here; the source is pinned to the
    # resolved commit so that the worker (and any reload after eviction) reads exactly these bytes.
    from vllm_lora_ext.integration.server import pin_path

    loaded: dict[int, str] = engine.__dict__.setdefault("_vllm_lora_ext_loaded", {})
    if loaded.get(lora_request.lora_int_id) == lora_request.lora_path:
        return
    lora_request.lora_path = pin_path(lora_request.lora_path, name=lora_request.lora_name)
    if loaded.get(lora_request.lora_int_id) != lora_request.lora_path:
        engine.add_lora(lora_request)
    loaded[lora_request.lora_int_id] = lora_request.lora_path


def _patch_serving_models(module: ModuleType) -> None:
    cls = module.OpenAIServingModels
    if getattr(cls.load_lora_adapter, PATCH_MARK, False):
        return
    original = cls.load_lora_adapter

    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        from vllm_lora_ext.integration.server import pre_resolve

        request_or_error = await pre_resolve(request)
        if not hasattr(request_or_error, "lora_path"):
            return request_or_error  # an ErrorResponse
        return await original(self, request_or_error, base_model_name)

    cls.load_lora_adapter = _mark(load_lora_adapter, original)

    original_init = cls.init_static_loras

    async def init_static_loras(self: Any) -> None:
        from vllm_lora_ext.integration.server import load_deployment_adapters

        await original_init(self)
        await load_deployment_adapters(self)

    cls.init_static_loras = _mark(init_static_loras, original_init)
    logger.debug("patched %s.OpenAIServingModels.load_lora_adapter and init_static_loras", module.__name__)


def worker_state(worker: Any = None) -> dict[str, Any]:
    """Report the plugin's state in this process; use ``llm.collective_rpc(worker_state)`` to ask every worker."""
    import sys

    wm = sys.modules.get(WORKER_MANAGER_MODULE)
    patched = bool(wm is not None and getattr(wm.WorkerLoRAManager._load_adapter, PATCH_MARK, False))
    return {"pid": os.getpid(), "registered": _REGISTERED, "version": __version__, "load_adapter_patched": patched}


def _patch_base_serving(module: ModuleType) -> None:
    cls = module.BaseServing
    if getattr(cls._check_model, PATCH_MARK, False):
        return
    original = cls._check_model

    async def _check_model(self: Any, request: Any) -> Any:
        from vllm_lora_ext.integration.server import route_adapters

        error = await route_adapters(self, request)
        if error is not None:
            return error
        return await original(self, request)

    cls._check_model = _mark(_check_model, original)
    logger.debug("patched %s.BaseServing._check_model", module.__name__)
