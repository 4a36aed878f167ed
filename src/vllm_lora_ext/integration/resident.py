"""Worker side of the ``vllm_lora_ext_adapter_resident`` gauge: read what this engine holds, write it.

Called by the plugin's ``add_adapter`` (every registration, activation, eviction and build-ahead probe passes
there), so the gauge follows the worker's two caches without a patch of its own. Reads vLLM's
``LoRAModelManager`` (``_registered_adapters``: the CPU cache; ``lora_index_to_id``: the GPU slots) and the
plugin's background builds. Only the engine's first tensor/pipeline rank writes (the others hold the same).
Off when the installed vLLM exports the upstream residency metric (``_compat.has_upstream_residency_metric``).
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_lora_ext.constants import prebuild_builds
from vllm_lora_ext.integration._compat import has_upstream_residency_metric, is_first_model_rank
from vllm_lora_ext.integration.patching import PREBUILD_ATTR, PREBUILD_NAMES_ATTR, RESIDENT_NAMES_ATTR
from vllm_lora_ext.resident_metric import write_resident
from vllm_lora_ext.residency import adapter_levels

logger = logging.getLogger(__name__)


def note_name(manager: Any, lora_request: Any) -> None:
    """Remember the name an id is registered under (vLLM's LoRAModel carries only the id)."""
    names: dict[int, str] = manager.__dict__.setdefault(RESIDENT_NAMES_ATTR, {})
    names[int(lora_request.lora_int_id)] = str(lora_request.lora_name)


def record_residency(manager: Any) -> None:
    """Write this worker's residency (gpu, cpu, building) to the gauge; never raises."""
    try:
        if has_upstream_residency_metric() or not is_first_model_rank():
            return
        adapters = getattr(manager, "_adapter_manager", None)
        registered = getattr(adapters, "_registered_adapters", None)
        if registered is None:
            return
        names: dict[int, str] = manager.__dict__.setdefault(RESIDENT_NAMES_ATTR, {})
        cpu_ids = [int(i) for i in list(registered.keys())]
        for stale in set(names) - set(cpu_ids):  # bounded by the CPU cache, like the gauge
            del names[stale]
        gpu_ids = [i for i in list(getattr(adapters, "lora_index_to_id", ())) if i is not None]
        table = manager.__dict__.get(PREBUILD_ATTR)
        build_names = manager.__dict__.get(PREBUILD_NAMES_ATTR, {})
        building = [build_names.get(p, "adapter") for p in (table.pending() if table is not None else ())]
        levels = adapter_levels(gpu=[names.get(i, f"id-{i}") for i in gpu_ids],
                                cpu=[names.get(i, f"id-{i}") for i in cpu_ids], building=building)
        write_resident(levels, max_series=int(getattr(adapters, "capacity", len(cpu_ids))) + prebuild_builds())
    except Exception:  # the gauge must never fail a step
        logger.debug("could not record adapter residency", exc_info=True)
