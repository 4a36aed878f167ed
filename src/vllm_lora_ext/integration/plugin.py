"""The ``vllm.general_plugins`` entry point: ``register()``, and the table of every patch it applies.

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker, model
registry subprocesses), possibly more than once per process. It is therefore re-entrant, cheap, and
touches no device. It imports no heavy vLLM module: each patch in `PATCHES` is applied when vLLM
itself imports the module that holds its target (a post-import hook), so the API server never pays
for vLLM's LoRA layers. Each patch goes through `patching.apply_patch`, which checks the target and
its parameters first; `unregister()` restores vLLM's originals. ``PATCHES.md`` beside this file is the
same table for readers; a test keeps the two in step.
"""

from __future__ import annotations

import collections
import functools
import logging
import os
from collections.abc import AsyncIterator, Callable
from types import ModuleType
from typing import Any

from vllm_lora_ext import __version__, metrics
from vllm_lora_ext._logging import attach_handler_once
from vllm_lora_ext.constants import check_settings, plugin_disabled, stall_trace_seconds
from vllm_lora_ext.errors import MixIdCollisionError
from vllm_lora_ext.integration._compat import (
    ASYNC_LLM_MODULE,
    BASE_SERVING_MODULE,
    BEAM_SEARCH_MODULE,
    GENERATE_SERVING_MODULE,
    GPU_WORKER_MODULE,
    LLM_ENGINE_MODULE,
    LORA_EXPAND_OP_MODULE,
    LORA_SHRINK_OP_MODULE,
    POOLING_SERVING_MODULE,
    SERVING_MODELS_MODULE,
    WORKER_MANAGER_MODULE,
    check_vllm_version,
)
from vllm_lora_ext.integration.kernels import make_get_lora_op_configs
from vllm_lora_ext.integration.patching import (
    IDENTITY_ATTR,
    PATCH_MARK,
    STAGED_ATTR,
    Patch,
    apply_patch,
    applied,
    cancel_hooks,
    undo_all,
    when_imported,
)
from vllm_lora_ext.integration.prebuild import is_probe
from vllm_lora_ext.integration.warmup import make_compile_or_warm_up_model

logger = logging.getLogger(__name__)

_REGISTERED = False
_MAX_OFFLINE_IDS = 65536

__all__ = ["PATCHES", "register", "unregister", "is_registered", "worker_state", "PATCH_MARK"]


# ------------------------------------------------------------------------------------------------ replacements


def _make_load_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    def _load_adapter(self: Any, lora_request: Any) -> Any:
        from vllm_lora_ext.integration.loader import load_lora_model
        from vllm_lora_ext.integration.prebuild import take_built

        built = take_built(self, lora_request)  # built in the background: the step only registers it
        return built if built is not None else load_lora_model(self, lora_request)

    return _load_adapter


def _from_other_source(held: Any, lora_request: Any) -> bool:
    """Whether the model held under ``lora_request``'s id was built by the plugin from another source (serving it
    would hand this request another adapter's tensors)."""
    identity = getattr(held, IDENTITY_ATTR, None)
    return identity is not None and identity != lora_request.lora_path


def _make_add_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_adapter(self: Any, lora_request: Any) -> Any:
        from vllm_lora_ext.integration.prebuild import answer_probe
        from vllm_lora_ext.integration.resident import note_name, record_residency

        if is_probe(lora_request):  # the server asks for a background build; nothing is registered
            try:
                return answer_probe(self, lora_request)
            finally:
                record_residency(self)  # the residency gauge: a build in flight
        # vLLM skips loading an id it already holds. If the held model was built from another
        # source, serving it would hand this request another adapter's tensors: reload instead.
        manager: Any = getattr(self, "_adapter_manager", None)
        get = getattr(manager, "get_adapter", None)
        held = get(lora_request.lora_int_id) if get is not None else None
        if _from_other_source(held, lora_request):
            logger.warning("adapter id %d holds %r but %r was asked for under that id: reloading",
                           lora_request.lora_int_id, getattr(held, IDENTITY_ATTR)[:200],
                           str(lora_request.lora_path)[:200])
            manager.remove_adapter(lora_request.lora_int_id)
        try:
            return original(self, lora_request)
        finally:  # a model staged on the GPU by a background build is in its slot now: back to its CPU tensors
            if get is not None:
                from vllm_lora_ext.integration.staging import unstage

                registered = get(lora_request.lora_int_id)
                if registered is not None:
                    unstage(registered)
            note_name(self, lora_request)
            record_residency(self)  # the residency gauge: registered, activated or evicted

    return add_adapter


def _make_apply_adapters(original: Callable[..., Any]) -> Callable[..., Any]:
    def _apply_adapters(self: Any, lora_requests: Any) -> Any:
        """Every step, vLLM calls ``add_adapter`` for each distinct adapter of the batch, which for an adapter
        already active only touches the two LRU caches, through five calls and a copy of the registered set
        (about 20 µs each on a 2-core VM: 0.68 ms a step for 32 adapters, ``bench/bench_step_adapters.py``).
        When every adapter of the batch is registered, active, built from the source it is asked for, not
        staged, not a probe and not to be reloaded in place, this touches both caches as that would, in the
        same order, in time independent of how many adapters are registered; anything else goes to vLLM's own
        path (and the plugin's ``add_adapter``)."""
        manager: Any = getattr(self, "_adapter_manager", None)
        registered = getattr(manager, "_registered_adapters", None)
        active = getattr(manager, "_active_adapters", None)
        if registered is None or active is None:
            return original(self, lora_requests)
        wanted = {r.lora_int_id: r for r in lora_requests if r}
        for lora_id, request in wanted.items():
            if lora_id not in active or getattr(request, "load_inplace", False) or is_probe(request):
                return original(self, lora_requests)
            # add_adapter's lookup, which touches the registered cache. If vLLM's path runs after all, it
            # touches the same adapters again in the same order first, so the order it acts on is the same.
            model = registered.get(lora_id)
            if model is None or getattr(model, STAGED_ATTR, None) is not None or _from_other_source(model, request):
                return original(self, lora_requests)
        for lora_id in wanted:  # activate_adapter for an active adapter: a touch
            active.touch(lora_id)
        return None

    return _apply_adapters


def _make_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    def add_request(self: Any, request_id: str, prompt: Any, params: Any, arrival_time: Any = None,
                    lora_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        if lora_request is not None:
            preload_offline(self, lora_request)
        return original(self, request_id, prompt, params, arrival_time, lora_request, *args, **kwargs)

    return add_request


def offline_loaded(engine: Any) -> collections.OrderedDict[int, str]:
    """The adapters an offline engine was given through `preload_offline`: ``{lora_int_id: pinned path}``."""
    loaded: collections.OrderedDict[int, str] = engine.__dict__.setdefault("_vllm_lora_ext_loaded",
                                                                            collections.OrderedDict())
    return loaded


def preload_offline(engine: Any, lora_request: Any) -> None:
    """Pin, check and load a request's adapter through ``add_lora`` before the request is queued.

    vLLM loads a request's adapter lazily inside the engine step, where any error kills the
    engine; loading it here raises in the caller instead. The source is pinned to the resolved
    commit so the worker (and any reload after eviction) reads exactly these bytes.

    Raises:
        [`MixIdCollisionError`]: the request's ``lora_int_id`` already names another adapter in this engine.
        [`AdapterSourceError`], [`AdapterNotFoundError`], [`AdapterFormatError`], ...: the adapter is bad.
    """
    from vllm_lora_ext.resolve import pin_path

    loaded = offline_loaded(engine)
    lora_id = int(lora_request.lora_int_id)
    if loaded.get(lora_id) == lora_request.lora_path:
        loaded.move_to_end(lora_id)
        return
    pinned = pin_path(lora_request.lora_path, name=lora_request.lora_name)
    held = loaded.get(lora_id)
    if held is not None and held != pinned and not getattr(lora_request, "load_inplace", False):
        raise MixIdCollisionError(
            f"lora_int_id {lora_id} already names another adapter in this engine ({held[:200]!r}), so adapter "
            f"{lora_request.lora_name!r} ({pinned[:200]!r}) would be served its tensors. Give each adapter its own "
            f"lora_int_id (or set load_inplace=True to replace it).")
    lora_request.lora_path = pinned
    if held != pinned:
        engine.add_lora(lora_request)
    loaded[lora_id] = pinned
    loaded.move_to_end(lora_id)
    while len(loaded) > _MAX_OFFLINE_IDS:
        loaded.popitem(last=False)


def _make_load_lora_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    async def load_lora_adapter(self: Any, request: Any, base_model_name: str | None = None) -> Any:
        from vllm.lora.request import LoRARequest

        from vllm_lora_ext.integration.server import build_failure, ensure_built, http_error, pre_resolve, recently_used

        await _sync_disk_holds(self)  # issue 41: unloaded adapters' revisions may go before this load downloads
        request_or_error = await pre_resolve(request)
        if not hasattr(request_or_error, "lora_path"):
            return request_or_error  # an ErrorResponse
        name, path = request_or_error.lora_name, request_or_error.lora_path
        if name not in self.lora_requests and path:  # a new adapter: build it off the engine loop first
            try:
                await ensure_built(self.engine_client, LoRARequest(lora_name=name, lora_int_id=1, lora_path=path))
            except Exception as err:
                return http_error(build_failure(err, name=name, source=path))
        result = await original(self, request_or_error, base_model_name)
        if isinstance(result, str) and path:
            recently_used(self.engine_client).touch(path)
            await _sync_disk_holds(self)  # its revision is in use while it stays registered
        return result

    return load_lora_adapter


async def _sync_disk_holds(models: Any) -> None:
    """Hold, in the shared disk cache, the hub revisions of every registered adapter and live mix (issue 41)."""
    import asyncio

    from vllm_lora_ext.diskholds import HeldSources
    from vllm_lora_ext.diskuse import sync_server_holds
    from vllm_lora_ext.integration.server import STARTUP

    held = models.__dict__.setdefault("vllm_lora_ext_disk_holds", HeldSources())
    pinned = models.__dict__.setdefault("vllm_lora_ext_pinned_names", set())
    paths = {name: str(req.lora_path) for name, req in list(models.lora_requests.items())}
    if STARTUP.get():
        pinned.update(paths)
    await asyncio.to_thread(sync_server_holds, held, paths, pinned=frozenset(pinned))


def _make_init_static_loras(original: Callable[..., Any]) -> Callable[..., Any]:
    async def init_static_loras(self: Any) -> None:
        from vllm_lora_ext.integration.server import STARTUP, load_deployment_adapters

        token = STARTUP.set(True)
        try:
            await original(self)
            await load_deployment_adapters(self)
        finally:
            STARTUP.reset(token)

    return init_static_loras


def _make_check_model(original: Callable[..., Any]) -> Callable[..., Any]:
    async def _check_model(self: Any, request: Any) -> Any:
        from vllm_lora_ext.integration.server import route_adapters

        error = await route_adapters(self, request)
        if error is not None:
            return error
        return await original(self, request)

    return _check_model


def _make_maybe_get_adapters(original: Callable[..., Any]) -> Callable[..., Any]:
    def _maybe_get_adapters(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_lora_ext.integration.server import routed_lora

        routed = routed_lora(request)
        return routed if routed is not None else original(self, request, *args, **kwargs)

    return _maybe_get_adapters


def _make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    def generate(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Hold the request's mix from this call (generation admitted) until its outputs end (``leases.leased``)."""
        from vllm_lora_ext.integration.leases import leased
        from vllm_lora_ext.integration.server import claim_lease

        return leased(original(self, *args, **kwargs), claim_lease(kwargs.get("lora_request")))

    return generate


def _make_request_scope(original: Callable[..., Any]) -> Callable[..., Any]:
    async def _with_kv_transfer_rejection_cleanup(self: Any, awaitable: Any, *args: Any, **kwargs: Any) -> Any:
        from vllm_lora_ext.integration.leases import request_scope

        with request_scope():  # what the request's routing holds is released when its handler returns
            return await original(self, awaitable, *args, **kwargs)

    return _with_kv_transfer_rejection_cleanup


def _make_pooling_check_model(original: Callable[..., Any]) -> Callable[..., Any]:
    async def _check_model(self: Any, request: Any) -> Any:
        from vllm_lora_ext.integration.leases import refuse_mix

        refuse_mix(self, request)
        return await original(self, request)

    return _check_model


_KERNEL_CONFIG_PARAMS = ("op_type", "max_loras", "batch", "hidden_size", "rank", "num_slices", "add_inputs")

PATCHES: tuple[Patch, ...] = (
    Patch(WORKER_MANAGER_MODULE, "WorkerLoRAManager._load_adapter", ("lora_request",), _make_load_adapter,
          why="the single place a worker turns a LoRA path into tensors: hf: sources, MoE layouts, EP reads, mixes, "
              "and every check before vLLM sees a tensor",
          delete_when="never as a whole; parts go as vLLM adds hf: revisions (lora/utils.py), checked MoE layouts and "
                      "per-request mixes (RFC #51940)"),
    Patch(WORKER_MANAGER_MODULE, "WorkerLoRAManager.add_adapter", ("adapter_request",), _make_add_adapter,
          why="vLLM skips loading an id it holds; an id reused for another source would serve the old tensors. Also "
              "answers the server's build-ahead probes (background loading) without registering them, and after the "
              "slot copy points a GPU-staged model back at its CPU tensors. Writes the residency gauge "
              "(vllm_lora_ext_adapter_resident) after each registration, activation or eviction",
          delete_when="vLLM keys its worker cache on (id, path) or rejects id reuse, and loads adapters off the "
                      "engine loop (vLLM issue #31941)"),
    Patch(WORKER_MANAGER_MODULE, "LRUCacheWorkerLoRAManager.add_adapter", ("lora_request",), _make_add_adapter,
          why="as WorkerLoRAManager.add_adapter, for the LRU worker manager every engine uses",
          delete_when="as WorkerLoRAManager.add_adapter"),
    Patch(WORKER_MANAGER_MODULE, "LRUCacheWorkerLoRAManager._apply_adapters", ("lora_requests",),
          _make_apply_adapters,
          why="host time per decode step grows with the batch's distinct adapters (issue 12 P4): for a batch whose "
              "adapters are all active, touch vLLM's two LRU caches as add_adapter would, without calling it per "
              "adapter; anything else goes through vLLM's path",
          delete_when="vLLM skips re-activating the adapters of a batch that are already active"),
    Patch(LLM_ENGINE_MODULE, "LLMEngine.add_request", ("request_id", "prompt", "params", "arrival_time",
                                                       "lora_request"), _make_add_request,
          why="offline LLM.generate loads an adapter inside the engine step, where a bad adapter kills the engine; "
              "preloading raises at the call, pins the source and refuses a reused id",
          delete_when="vLLM validates/preloads LoRA in LLM.generate (InputProcessor) before queueing"),
    Patch(SERVING_MODELS_MODULE, "OpenAIServingModels.load_lora_adapter", ("request", "base_model_name"),
          _make_load_lora_adapter,
          why="resolve (download) a source in a thread and pin it before the engine sees it; refuse names the mix "
              "grammar reserves (+, =, mix-), client mix: paths and paths outside VLLM_LORA_EXT_ALLOWED_ROOTS",
          delete_when="vLLM resolves sources with revisions off the engine loop and has a path allow-list"),
    Patch(SERVING_MODELS_MODULE, "OpenAIServingModels.init_static_loras", (), _make_init_static_loras,
          why="register the deployment config (VLLM_LORA_EXT_CONFIG) at start-up; mark start-up loads as the "
              "operator's (the allowed-roots rule is for runtime loads)",
          delete_when="vLLM reads a named-adapter config at start-up"),
    Patch(BASE_SERVING_MODULE, "BaseServing._check_model", ("request",), _make_check_model,
          why="route body fields (adapters, adapter_weights), the model syntax a=0.7+b=0.3 and the deployment "
              "default to one registered mix; vLLM's LoRAResolver sees neither body fields nor weights",
          delete_when="vLLM supports per-request adapter sets with weights (RFC #51940, PR #52757 for one scale)"),
    Patch(BASE_SERVING_MODULE, "BaseServing._maybe_get_adapters", ("request",), _make_maybe_get_adapters,
          why="serve a routed request the exact mix it was routed to, even if the mix left the registry before "
              "generation; vLLM's lookup by name would then fall back to the base model",
          delete_when="as BaseServing._check_model"),
    Patch(ASYNC_LLM_MODULE, "AsyncLLM.generate", ("prompt", "sampling_params", "request_id"), _make_generate,
          why="hold a request's mix in the bounded registry from the call (generation admitted) until its outputs "
              "end, so it is never evicted (or its id reused) while in flight",
          delete_when="mixes are native vLLM adapters with their own lifetime"),
    *(Patch(module, "get_lora_op_configs", _KERNEL_CONFIG_PARAMS, make_get_lora_op_configs,
            why=f"{op}: vLLM's default config launches far more blocks than a batch over many adapters needs; read the "
                "tuned tables shipped for this GPU. Setting VLLM_TUNED_CONFIG_FOLDER instead would also switch the "
                "fused-MoE LoRA kernels away from vLLM's own config choice",
            delete_when="vLLM ships tuned shrink/expand configs for these GPUs, or reads a tuned folder per op type")
      for module, op in ((LORA_SHRINK_OP_MODULE, "shrink"), (LORA_EXPAND_OP_MODULE, "expand"))),
    Patch(GENERATE_SERVING_MODULE, "GenerateBaseServing._with_kv_transfer_rejection_cleanup",
          ("awaitable", "request", "raw_request"), _make_request_scope,
          why="the one wrapper around the completions, chat and responses handlers: the mix a request's routing "
              "holds is released when its handler returns, so a request that fails before generating (a too-long "
              "prompt, a render error) frees its slot at once",
          delete_when="as BaseServing._check_model"),
    Patch(BEAM_SEARCH_MODULE, "BeamSearchOnlineMixin.beam_search", ("prompt", "request_id", "params", "lora_request"),
          _make_generate,
          why="online beam search calls generate once per step; one lease for the whole request keeps its mix "
              "from being evicted between steps",
          delete_when="as AsyncLLM.generate"),
    Patch(POOLING_SERVING_MODULE, "PoolingBaseServing._check_model", ("request",), _make_pooling_check_model,
          why="pooling routes (embeddings, score, classify) never route adapter fields: a mix named there would be "
              "answered by the base model; refuse it with a 400 instead",
          delete_when="as BaseServing._check_model"),
    Patch(GPU_WORKER_MODULE, "Worker.compile_or_warm_up_model", (), make_compile_or_warm_up_model,
          why="vLLM's warm-up runs with no active LoRA, so the fused-MoE LoRA Triton kernels compile inside the first "
              "step with an MoE adapter (seconds, pausing every request in flight; issue 39 item 3): run dummy LoRA "
              "batches first (integration/warmup.py; VLLM_LORA_EXT_MOE_WARMUP=0 skips them)",
          delete_when="vLLM's warm-up runs its dummy LoRAs through the MoE LoRA kernels for eager batch sizes"),
)


def is_registered() -> bool:
    """Return whether ``register()`` has run in this process."""
    return _REGISTERED


def register() -> None:
    """Install the plugin in this vLLM process (idempotent; safe to call many times).

    Raises:
        [`SettingsError`]: a ``VLLM_LORA_EXT_*`` setting is malformed (each one is named).
        [`UnsupportedVLLMError`]: the installed vLLM is outside the tested range (set
            ``VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM=1`` to try anyway), or a patched name is missing
            or has another signature in it.
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
    check_settings()  # every VLLM_LORA_EXT_* setting, strictly, with one error naming the bad ones
    metrics.setup()
    stall_threshold = stall_trace_seconds()
    if stall_threshold:
        from vllm_lora_ext import stall_trace

        stall_trace.start(stall_threshold)
    for patch in PATCHES:
        when_imported(patch.module, functools.partial(_apply, patch))
    _REGISTERED = True
    logger.info("vllm_lora_ext %s active in process %d (vLLM %s)", __version__, os.getpid(), vllm_version)


def _apply(patch: Patch, module: ModuleType) -> None:
    apply_patch(module, patch)


def unregister() -> None:
    """Undo ``register()``: restore every patched vLLM attribute and drop hooks not yet run (tests)."""
    global _REGISTERED
    cancel_hooks()
    undo_all()
    _REGISTERED = False


def worker_state(worker: Any = None) -> dict[str, Any]:
    """Report the plugin's state in this process; use ``llm.collective_rpc(worker_state)`` to ask every worker.

    ``rank`` is the worker's global rank (``None`` outside a worker); ``adapter_reads`` counts the adapters
    this process built and the weight bytes it read for them.
    """
    import sys

    wm = sys.modules.get(WORKER_MANAGER_MODULE)
    patched = bool(wm is not None and getattr(wm.WorkerLoRAManager._load_adapter, PATCH_MARK, False))
    loader = sys.modules.get("vllm_lora_ext.integration.loader")
    reads = dict(loader.LOCAL_READS) if loader is not None else {"adapters": 0, "bytes": 0}
    return {"pid": os.getpid(), "rank": getattr(worker, "rank", None), "registered": _REGISTERED,
            "version": __version__, "load_adapter_patched": patched, "patches": applied(), "adapter_reads": reads}
