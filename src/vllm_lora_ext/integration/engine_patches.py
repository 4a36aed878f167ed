"""The replacements ``plugin.PATCHES`` installs on vLLM's engine clients, in the process that calls them:
``LLMEngine`` (offline ``LLM``, the caller's process) and ``AsyncLLM`` (the API server process).

Each ``make_*`` takes vLLM's original and returns the replacement; `patching.apply_patch` installs it.
"""

from __future__ import annotations

import collections
from collections.abc import AsyncIterator, Callable
from typing import Any

from vllm_lora_ext._util import clip
from vllm_lora_ext.errors import MixIdCollisionError, error_from_text
from vllm_lora_ext.integration._compat import warm_logits_processor_lookup
from vllm_lora_ext.integration.patching import OFFLINE_LOADED_ATTR

_MAX_OFFLINE_IDS = 65536


def make_add_request(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``LLMEngine.add_request``: preload a request's adapter (`preload_offline`) before queueing it.

    Made when vLLM's ``llm_engine`` module is imported (an offline ``LLM`` is being built): `preload_offline`'s
    source resolution is imported now, not in the first request with an adapter."""
    import vllm_lora_ext.resolve  # noqa: F401

    def add_request(self: Any, request_id: str, prompt: Any, params: Any, arrival_time: Any = None,
                    lora_request: Any = None, *args: Any, **kwargs: Any) -> Any:
        if lora_request is not None:
            preload_offline(self, lora_request)
        return original(self, request_id, prompt, params, arrival_time, lora_request, *args, **kwargs)

    return add_request


def make_input_processor_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``InputProcessor.__init__``: vLLM's, then its logits-processor lookup done ahead of the first request
    ([`_compat.warm_logits_processor_lookup`])."""

    def __init__(self: Any, vllm_config: Any, *args: Any, **kwargs: Any) -> None:
        original(self, vllm_config, *args, **kwargs)
        warm_logits_processor_lookup(self)

    return __init__


def offline_loaded(engine: Any) -> collections.OrderedDict[int, str]:
    """The adapters an offline engine was given through `preload_offline`: ``{lora_int_id: pinned path}``."""
    loaded: collections.OrderedDict[int, str] = engine.__dict__.setdefault(OFFLINE_LOADED_ATTR,
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
            f"lora_int_id {lora_id} already names another adapter in this engine ({clip(held)!r}), so adapter "
            f"{lora_request.lora_name!r} ({clip(pinned)!r}) would be served its tensors. Give each adapter its own "
            f"lora_int_id (or set load_inplace=True to replace it).")
    lora_request.lora_path = pinned
    if held != pinned:
        add_lora_typed(engine, lora_request)
    loaded[lora_id] = pinned
    loaded.move_to_end(lora_id)
    while len(loaded) > _MAX_OFFLINE_IDS:
        loaded.popitem(last=False)


def make_generate(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``generate`` (``AsyncLLM``, online beam search): hold the request's mix while its outputs run."""

    def generate(self: Any, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        """Hold the request's mix from this call (generation admitted) until its outputs end (``leases.leased``)."""
        from vllm_lora_ext.integration.leases import leased
        from vllm_lora_ext.integration.server import claim_lease

        return leased(original(self, *args, **kwargs), claim_lease(kwargs.get("lora_request")))

    return generate


def add_lora_typed(engine: Any, lora_request: Any) -> Any:
    """``engine.add_lora``; a failure that carries the worker's record (`errors.with_record`) raises that error,
    of its own type with its own message, not vLLM's text with the record in it."""
    try:
        return engine.add_lora(lora_request)
    except Exception as err:
        crossed = error_from_text(str(err))
        if crossed is None:
            raise
        raise crossed from err


def make_collector_init(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``RequestOutputCollector.__init__`` (`leases.make_collector_init`; made when vLLM imports it)."""
    from vllm_lora_ext.integration.leases import make_collector_init as make

    return make(original)


def make_collector_put(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``RequestOutputCollector.put`` (`leases.make_collector_put`): the finished output releases the lease."""
    from vllm_lora_ext.integration.leases import make_collector_put as make

    return make(original)
