"""The replacements ``plugin.PATCHES`` installs in each worker process: the worker LoRA manager's load and
registration (hf: sources, background builds, id reuse) and its per-step activation.

Each ``make_*`` takes vLLM's original and returns the replacement; `patching.apply_patch` installs it. The
kernel-config, MoE tile-config and warm-up replacements, also worker-side, live with their code (`kernels`,
`moe_configs`, `warmup`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from vllm_lora_ext._util import clip
from vllm_lora_ext.integration.patching import IDENTITY_ATTR, MERGED_ATTR, PART_OWNERS_ATTR, STAGED_ATTR
from vllm_lora_ext.integration.prebuild import is_probe
from vllm_lora_ext.stall_trace import profiled

logger = logging.getLogger(__name__)


def make_load_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``WorkerLoRAManager._load_adapter``: take a model built in the background, else build it here."""

    def _load_adapter(self: Any, lora_request: Any) -> Any:
        from vllm_lora_ext.errors import VllmLoraExtError, has_record, with_record
        from vllm_lora_ext.integration.loader import load_lora_model
        from vllm_lora_ext.integration.prebuild import take_built

        try:
            built = take_built(self, lora_request)  # built in the background: the step only registers it
            return built if built is not None else load_lora_model(self, lora_request)
        except VllmLoraExtError as err:  # built in the step: its type and client text cross to the server too
            if has_record(err):  # (vLLM hands the server only the text of a failed engine call)
                raise
            raise with_record(err) from err

    return _load_adapter


def _from_other_source(held: Any, lora_request: Any) -> bool:
    """Whether the model held under ``lora_request``'s id was built by the plugin from another source (serving it
    would hand this request another adapter's tensors)."""
    identity = getattr(held, IDENTITY_ATTR, None)
    return identity is not None and identity != lora_request.lora_path


def make_add_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``add_adapter``: answer probes, reload an id held for another source, unstage, record residency."""

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
                           lora_request.lora_int_id, clip(getattr(held, IDENTITY_ATTR)),
                           clip(str(lora_request.lora_path)))
            manager.remove_adapter(lora_request.lora_int_id)
        start = time.perf_counter()
        try:
            return profiled(lambda: original(self, lora_request),
                            lambda: f"add_adapter of {clip(str(lora_request.lora_name))!r}")
        finally:  # a model staged on the GPU by a background build is in its slot now: back to its CPU tensors
            if get is not None:
                _unstage_registered(get(lora_request.lora_int_id), lora_request, start)
            note_name(self, lora_request)
            record_residency(self)  # the residency gauge: registered, activated or evicted

    return add_adapter


def _unstage_registered(registered: Any, lora_request: Any, start: float) -> None:
    """Point a model ``add_adapter`` just registered back at its CPU tensors if it was staged on the GPU, and log
    what the engine thread spent on it (its registration and slot copy, then the unstage)."""
    if registered is None or getattr(registered, STAGED_ATTR, None) is None:
        return
    from vllm_lora_ext.integration.staging import unstage

    added = time.perf_counter()
    copied = unstage(registered)
    logger.info("adapter %r (id %d): registered and copied into its slot in %.4f s, unstaged in %.4f s "
                "(%d bytes copied back)", clip(str(lora_request.lora_name)), lora_request.lora_int_id, added - start,
                time.perf_counter() - added, copied)


def make_create_merged_loras(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``LoRAModelManager._create_merged_loras_inplace``: skip a model a background build merged already, and
    run vLLM's merge over the packed modules the model has parts of, not over every one ([`_parts_only`])."""

    def _create_merged_loras_inplace(self: Any, lora_model: Any) -> Any:
        if getattr(lora_model, MERGED_ATTR, False):  # merged on the table's thread (integration.prebuild)
            return None
        return original(_parts_only(self, lora_model), lora_model)

    return _create_merged_loras_inplace


class _Narrowed:
    """The manager as vLLM's merge reads it, with only some of its packed modules (reads go to the manager)."""

    def __init__(self, manager: Any, packed_modules: dict[str, list[str]]) -> None:
        self.__dict__.update(_manager=manager, packed_modules=packed_modules)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["_manager"], name)

    def __setattr__(self, name: str, value: Any) -> None:  # (vLLM's merge writes nothing to it today)
        setattr(self.__dict__["_manager"], name, value)


def _parts_only(manager: Any, lora_model: Any) -> Any:
    """``manager``, or a [`_Narrowed`] view of it with only the packed modules ``lora_model`` has a part of.

    vLLM's merge looks every part of every packed module up in the model: 18,576 calls for 48 layers of 128 experts
    and q/k/v, nearly all for per-expert names a prepacked MoE block never has (3.7-6.6 ms on the dev VM, several
    times that on the build's thread beside a busy engine thread). A packed module none of whose parts the model has
    is one the merge skips, so leaving it out changes nothing, where the merge finds a part by its name alone
    (``_compat.merge_finds_parts_by_name``) and every part is a name of one packed module only, not itself one
    ([`_owners`]); otherwise the whole manager is used.
    """
    from vllm_lora_ext.integration._compat import merge_finds_parts_by_name

    owner = _owners(manager) if merge_finds_parts_by_name(manager) else None
    if owner is None:
        return manager
    hit = {owner[name] for name in lora_model.loras if name in owner}
    return _Narrowed(manager, {m: parts for m, parts in manager.packed_modules.items() if m in hit})


def index_packed_parts(manager: Any) -> None:
    """Make ``manager``'s index of packed parts now (a worker's start), not in its first adapter's merge."""
    _owners(manager)


def _owners(manager: Any) -> dict[str, str] | None:
    """Each part's packed module, cached on the manager while its ``packed_modules`` is the same; ``None`` without
    them, or if a part belongs to two packed modules, is a packed module itself or is not a name. vLLM fills
    ``packed_modules`` once, as it makes the manager's LoRA modules; the cache key (the dict, its size and its parts'
    count) would miss an edit in place after that."""
    packed = getattr(manager, "packed_modules", None)
    if not isinstance(packed, dict):
        return None
    cached = manager.__dict__.get(PART_OWNERS_ATTR)
    key = (id(packed), len(packed), sum(map(len, packed.values())))
    if cached is None or cached[0] != key:
        cached = manager.__dict__[PART_OWNERS_ATTR] = (key, _index_parts(packed))
    return cached[1]  # type: ignore[no-any-return]


def _index_parts(packed: dict[str, list[str]]) -> dict[str, str] | None:
    owner: dict[str, str] = {}
    for module, parts in packed.items():
        for part in parts:
            if not isinstance(part, str) or part in owner or part in packed:
                return None
            owner[part] = module
    return owner


def make_activate_adapter(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``LoRAModelManager.activate_adapter``: a model whose slot writes were planned ahead gets them in a
    few batched calls (``integration.activation``); every other one vLLM's own activation. Either way its slot's
    live rank is noted for the fused-MoE pair kernels (`integration.slot_ranks`)."""

    def activate_adapter(self: Any, lora_id: int) -> Any:
        from vllm_lora_ext.integration import slot_ranks
        from vllm_lora_ext.integration.activation import activate_planned

        slot_ranks.before_activation(self, lora_id)  # the slot it will fill reads every row until step 3
        done = activate_planned(self, lora_id)
        result = original(self, lora_id) if done is None else done
        if result:  # put in a slot now (False: it was active already)
            slot_ranks.after_activation(self, lora_id)  # the slot's live rank, for the fused-MoE pair kernels
        return result

    return activate_adapter


def make_apply_adapters(original: Callable[..., Any]) -> Callable[..., Any]:
    """Return ``_apply_adapters``: touch the LRU caches for a batch whose adapters are all active."""

    def _apply_adapters(self: Any, lora_requests: Any) -> Any:
        """Every step, vLLM calls ``add_adapter`` for each distinct adapter of the batch, which for an adapter
        already active only touches the two LRU caches, through five calls and a copy of the registered set
        (about 20 µs of host time each: 0.68 ms a step for 32 adapters, ``bench/bench_step_adapters.py``).
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
