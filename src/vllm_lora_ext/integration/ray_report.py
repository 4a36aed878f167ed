"""Replica side of residency routing in Ray Serve LLM: the plugin's ids enter Serve's multiplexed loader.

Serve's router learns what a replica holds from one place: the ids in the replica's ``@serve.multiplexed``
loader (loaded or loading), pushed to the controller every 0.1 s. Ray Serve LLM's ``LLMServer`` wraps its LoRA
downloader in that loader (``self._load_model``), so on its own it reports only ids Ray downloaded; the
plugin's ids (deployment names, mixes, admitted client sources) would be served without it, and a fleet would
build each of them on whichever replica a request happened to reach.

`LoraExtLLMServer` therefore passes every id the plugin serves through Ray's loader as well. The downloader Ray wraps
is `_ReportOrDownload`: for an id the plugin serves it answers at once with a `_Held` marker (the adapter itself
is built by the plugin inside vLLM, on the request's first use), for any other id it is Ray's downloader. So
the replica reports the id as soon as its first request arrives (while the build runs, "building"), Ray's LRU
(``lora_config.max_num_adapters_per_replica``) bounds what it reports, and Serve's router, or
`vllm_lora_ext.integration.ray_routing.ResidencyRequestRouter`, sends the next request for the id here.

Ray PR #61304 (open) replaces the ``@serve.multiplexed`` loader in ``LLMServer`` with a private LRU cache that
reports nothing. Against such a Ray, `report_held` finds no Serve-multiplexed loader, logs one warning, and the
request is still served (routing falls back to Serve's default); ``tests/integration/test_ray.py`` fails on it
(``test_the_plugins_ids_are_reported_through_serves_multiplexed_loader``).
"""

from __future__ import annotations

import contextvars
import logging
from typing import Any

from vllm_lora_ext._util import clip

logger = logging.getLogger(__name__)

try:  # the attribute ``@serve.multiplexed`` sets on the function it returns (Ray 2.58, 2.60)
    from ray.serve._private.utils import MULTIPLEXED_FUNCTION_MARKER_ATTR as _MARKER
except ImportError:  # pragma: no cover - a Ray that moved it: is_serve_multiplexed then says False
    _MARKER = "_serve_multiplexed_function"

_REPORTING: contextvars.ContextVar[str | None] = contextvars.ContextVar("vllm_lora_ext_ray_report", default=None)
_WARNED: set[str] = set()


class _Held:
    """What Ray's multiplexed loader keeps for an id the plugin serves: the id only (the adapter lives in vLLM)."""

    __slots__ = ("model_id",)

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id

    def __repr__(self) -> str:
        return f"_Held({self.model_id!r})"


class _ReportOrDownload:
    """The downloader Ray's multiplexed loader wraps: ids being reported come back as `_Held`, without any
    download; everything else goes to Ray's downloader (``model_downloader``, default Ray's own)."""

    def __init__(self, model_downloader: Any = None, **kwargs: Any) -> None:
        if model_downloader is None:
            from ray.llm._internal.serve.core.server import llm_server

            model_downloader = llm_server.LoraModelLoader
        self._inner = model_downloader(**kwargs)

    async def load_model_from_config(self, lora_model_id: str, llm_config: Any) -> Any:
        if _REPORTING.get() == lora_model_id:
            return _Held(lora_model_id)
        return await self._inner.load_model_from_config(lora_model_id=lora_model_id, llm_config=llm_config)


def is_serve_multiplexed(loader: Any) -> bool:
    """Return whether ``loader`` is a function ``@serve.multiplexed`` made (Serve reports what it holds)."""
    return bool(getattr(loader, _MARKER, False))


async def report_held(server: Any, model_id: str) -> None:
    """Enter ``model_id`` in the replica's Serve-multiplexed loader, so Serve routes the id here; never raises."""
    loader = getattr(server, "_load_model", None)
    if not is_serve_multiplexed(loader):
        _warn_once("unreported", "Ray Serve LLM replicas report the plugin's adapter ids to Serve's router only "
                   "through Ray's @serve.multiplexed LoRA loader, and this replica has none (LLMConfig.lora_config "
                   "is unset, or this Ray replaced the loader, as Ray PR #61304 does): requests for one adapter "
                   "spread over replicas, each building it. Set lora_config={'max_num_adapters_per_replica': N}.")
        return
    token = _REPORTING.set(model_id)
    try:
        await loader(model_id)
    except Exception as err:  # reporting is an optimisation: the request is served either way
        _warn_once("failed", f"could not report adapter id {clip(model_id)!r} to Serve's router "
                             f"({type(err).__name__}: {err}); it is served, but not routed by residency")
    finally:
        _REPORTING.reset(token)


def _warn_once(key: str, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        logger.warning("%s", message)
