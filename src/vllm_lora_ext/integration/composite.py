"""Worker side of weighted mixes: components as core data -> one composite ``LoRAModel`` (exact, rank-concatenated).

The loader builds the components (`loader.load_component`: every source form and MoE layout) as core data, each a
[`building.MappedAdapter`]: the built adapter and the model's name for each of its modules. This module keeps them
in a small per-process LRU keyed by pinned source, so several mixes of the same adapters read each adapter once
and a composite costs no disk writes. What the composite is made of (the concatenation jobs, the rank budget,
whether a scan for overflow is needed) is planned in the core, on the components' factors as plain data
([`MixPlan`]); only the composite becomes vLLM objects, here.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vllm_lora_ext._util import files_unchanged
from vllm_lora_ext.building import MappedAdapter
from vllm_lora_ext.constants import component_cache_size, host_arena_min_bytes, host_arenas_enabled
from vllm_lora_ext.integration._compat import lora_host_memory_pinned, pin_in_place
from vllm_lora_ext.integration.moe import packed_layer
from vllm_lora_ext.mixing import (MixComponent, MixFactor, MixPlan, MixSpec, composite_shapes, concat_many,
                                  largest_magnitude)
from vllm_lora_ext.transport import pools
from vllm_lora_ext.transport.arena import prepare_spare
from vllm_lora_ext.transport.cuda import cuda_context, kept_host_arena, register_in_place
from vllm_lora_ext.validation import check_finite, check_module_ranks

logger = logging.getLogger(__name__)

_CACHE: OrderedDict[tuple[int, str], MappedAdapter] = OrderedDict()
_LOCK = threading.Lock()

# Builds one component: ``load(name, source)`` -> its [`MappedAdapter`].
LoadComponent = Callable[[str, str], MappedAdapter]


def _cache_size() -> int:
    return component_cache_size()


def _cached(key: tuple[int, str]) -> MappedAdapter | None:
    """The cached component, unless a file it was built from has changed since (a local folder written over):
    a new mix then reads the bytes there now, as a plain load does."""
    with _LOCK:
        hit = _CACHE.get(key)
    if hit is None or files_unchanged(hit.built.files):
        if hit is not None:
            with _LOCK:
                if key in _CACHE:
                    _CACHE.move_to_end(key)
        return hit
    with _LOCK:
        if _CACHE.get(key) is hit:
            del _CACHE[key]
    return None


def _component(manager: Any, c: MixComponent, load: LoadComponent) -> MappedAdapter:
    key = (id(manager), c.source)
    hit = _cached(key)
    if hit is not None:
        return hit
    model = load(c.name, c.source)
    size = _cache_size()
    if size:
        with _LOCK:
            _CACHE[key] = model
            while len(_CACHE) > size:
                _CACHE.popitem(last=False)
    return model


# Each built component's ranks, {module: (rank of each slice)}, by (manager, source), with the files' stamps they
# were read from: after one build of an adapter, a mix whose known components alone pass the rank budget is refused
# before any component is read again (a client's new weights are a new mix, so its refusal is not shared).
_RANKS: OrderedDict[tuple[int, str], tuple[Any, dict[str, tuple[int, ...]]]] = OrderedDict()
_RANKS_KEPT = 4096


def _ranks_of(component: MappedAdapter) -> dict[str, tuple[int, ...]]:
    """A component's rank in each module, slice by slice (``A`` is ``(r, in)``, or ``(E, r, in)`` per MoE slice)."""
    dense = component.built.dense
    ranks = {name: (int(dense[keys.key_a].shape[0]),) for name, keys in component.modules.items()}
    ranks.update({prefix: tuple(int(a.shape[1]) for a in lora_a)
                  for prefix, (lora_a, _, _) in component.built.moe.items()})
    return ranks


def _remember_ranks(manager: Any, source: str, component: MappedAdapter) -> None:
    with _LOCK:
        _RANKS[(id(manager), source)] = (component.built.files, _ranks_of(component))
        _RANKS.move_to_end((id(manager), source))
        while len(_RANKS) > _RANKS_KEPT:
            _RANKS.popitem(last=False)


def _refuse_known_over_budget(manager: Any, spec: MixSpec) -> None:
    """Refuse the mix if the components whose ranks are known (files unchanged) already pass ``max_lora_rank``."""
    with _LOCK:
        known = [(c.name, _RANKS.get((id(manager), c.source))) for c in spec.components]
    parts = [(name, got[1]) for name, got in known if got is not None and files_unchanged(got[0])]
    if parts:
        check_module_ranks(spec.lora_name, parts, int(manager.lora_config.max_lora_rank))


def components(manager: Any, spec: MixSpec, load: LoadComponent) -> list[MappedAdapter]:
    """Each component, in the mix's order; those not cached are built at the same time, unless the ranks of the
    components built before already pass the rank budget (refused then, reading nothing).

    A component load is mostly reading and copying (which release the GIL) or waiting for the build process,
    which runs them side by side.
    """
    built: dict[str, MappedAdapter] = {}  # by source: one cache check (its files' stamps) and one load per source
    missing: dict[str, MixComponent] = {}
    for c in spec.components:
        if c.source in built or c.source in missing:
            continue
        hit = _cached((id(manager), c.source))
        if hit is not None:
            built[c.source] = hit
        else:
            missing[c.source] = c
    if missing:
        _refuse_known_over_budget(manager, spec)
    if len(missing) > 1:
        with ThreadPoolExecutor(len(missing), thread_name_prefix="vllm-lora-ext-component") as pool:
            built.update(zip(missing, pool.map(lambda c: _component(manager, c, load), missing.values())))
    else:
        built.update((source, _component(manager, c, load)) for source, c in missing.items())
    for source in missing:  # (a cached one's were remembered when it was built)
        _remember_ranks(manager, source, built[source])
    return [built[c.source] for c in spec.components]


def mix_factors(component: MappedAdapter) -> dict[str, MixFactor | list[MixFactor]]:
    """A component's factors as plain data for [`MixPlan`], each ``A``'s largest magnitude included.

    A dense module is ``A (r, in)``, ``B (out, r)`` with its scaling; an MoE block is its slices
    ``A (E, r, in)``, ``B (E, out, r)``, scaling folded in already. Dense modules come first, in the model's order.
    """
    dense = component.built.dense
    out: dict[str, MixFactor | list[MixFactor]] = {}
    for name, keys in component.modules.items():
        a = dense[keys.key_a]
        out[name] = MixFactor(a, dense[keys.key_b], keys.scaling, 0, _max_abs(a))
    for prefix, (lora_a, lora_b, _) in component.built.moe.items():
        out[prefix] = [MixFactor(a, b, 1.0, 1, _max_abs(a)) for a, b in zip(lora_a, lora_b)]
    return out


def compose_mix(manager: Any, lora_request: Any, *, load: LoadComponent, device: Any = None) -> Any:
    """Concatenate the components of the mix in ``lora_request.lora_path`` along rank, into one ``LoRAModel``.

    Components come from the cache, the others from ``load`` (at the same time). With a CUDA ``device``
    (background builds, and the step unless ``VLLM_LORA_EXT_MIX_ON_GPU=0``), the concatenation runs on the GPU
    into a staged buffer (`staging.concat_staged`) when it fits, and the CPU copy vLLM keeps is copied back from
    it afterwards, off the request's path (`staging.twins_from_gpu`, one DMA into a pinned host arena; a CPU
    concatenation where that cannot be had); otherwise on the CPU.

    Raises:
        [`MixError`]: a malformed mix path.
        [`AdapterCompatibilityError`]: a module's summed rank exceeds ``max_lora_rank`` (names the ranks).
        [`AdapterFormatError`]: a weighted factor overflows to infinity (names the module).
    """
    t0 = time.perf_counter()
    spec = MixSpec.from_path(lora_request.lora_path)
    models = components(manager, spec, load)
    t1 = time.perf_counter()
    dtype = manager.lora_config.lora_dtype if isinstance(manager.lora_config.lora_dtype, torch.dtype) else None
    plan = MixPlan.from_components(spec.lora_name, [(c.name, c.weight, mix_factors(m))
                                                    for c, m in zip(spec.components, models)])
    plan.check_rank_budget(int(manager.lora_config.max_lora_rank))
    on_gpu = device is not None and torch.device(device).type == "cuda"
    jobs = plan.jobs
    if on_gpu:
        from vllm_lora_ext.integration.staging import concat_staged
        from vllm_lora_ext.transport.staging import in_source_order

        jobs = in_source_order(jobs)  # the GPU layout follows the components' own: far fewer copies (_place)
    t2 = time.perf_counter()  # planning ends; "copies" below is the GPU build or the host copy
    staged = concat_staged(jobs, dtype=dtype, device=device) if on_gpu else None
    phases: dict[str, float] = {}
    done = staged[0] if staged is not None else host_concat(jobs, dtype=dtype, timings=phases)
    t3 = time.perf_counter()
    loras = _layers(plan, done)
    if not plan.stays_finite(dtype):  # only w·s·A can overflow; B is a copy of finite components
        _scan(loras, spec.lora_name, device if staged is not None else None)
    composite = manager._lora_model_cls(lora_request.lora_int_id, max((_rank(w) for w in loras.values()), default=1),
                                        loras)
    composite.is_3d_lora_weight = lora_request.is_3d_lora_weight
    if staged is not None:
        _attach_twins(composite, staged[1], jobs, dtype)
    kept = phases.pop("kept", 0.0)
    detail = "".join(f", {k} {v * 1000:.0f} ms" for k, v in phases.items()) + (" into kept memory" if kept else "")
    where = " on the GPU" if staged is not None else ""
    logger.info("built mix %r from %d adapters: %d modules, %.2f s (components %.2f s, concatenation %.2f s%s: "
                "planning %.0f ms, copies %.0f ms%s, the rest %.0f ms)", spec.lora_name, len(models), len(loras),
                time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1, where, (t2 - t1) * 1000,
                (t3 - t2) * 1000, detail, (time.perf_counter() - t3) * 1000)
    return composite


def _layers(plan: MixPlan, done: dict[Any, tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """The composite's layer weights: one per dense module, one packed weight per MoE block (rank ≥ every slice's)."""
    from vllm.lora.lora_weights import LoRALayerWeights

    loras: dict[str, Any] = {}
    for name, keys in plan.modules.items():
        if keys == [name]:
            a, b = done[name]
            loras[name] = LoRALayerWeights(name, int(a.shape[0]), 1, a, b, scaling=1.0)
        else:
            a_list, b_list = [done[k][0] for k in keys], [done[k][1] for k in keys]
            loras[name] = packed_layer(name, a_list, b_list, max(int(a.shape[1]) for a in a_list))
    return loras


def _scan(loras: dict[str, Any], name: str, device: Any) -> None:
    """Refuse a composite whose ``A`` holds an infinity (scanned on a side stream of ``device``, where it lies)."""
    finite_a = {f"{n} lora_A[{i}]": t for n, lw in loras.items()
                for i, t in enumerate(lw.lora_a if isinstance(lw.lora_a, list) else [lw.lora_a]) if t is not None}
    scan: Any = contextlib.nullcontext()
    if device is not None:
        from vllm_lora_ext.transport.cuda import side_stream

        scan = side_stream(device)  # off the engine's stream
    with scan:
        check_finite(finite_a, adapter=name)


def _attach_twins(composite: Any, staged: Any, jobs: Any, dtype: torch.dtype | None) -> None:
    """Attach the staged GPU buffer and the function that builds the CPU copy vLLM keeps (`staging.attach_staged`)."""
    from vllm_lora_ext.integration.staging import attach_staged, twins_from_gpu

    context = cuda_context()  # the twins are built on a helper thread, and pinned for this worker's GPU
    shapes = composite_shapes(jobs, dtype=dtype)

    def twins() -> list[torch.Tensor]:  # region by region (each key's A, then B)
        regions = [(t, tuple(shape)) for a, b, t in shapes.values() for shape in (a, b)]
        back = twins_from_gpu(staged, regions, context=context)
        if back is not None:
            return back
        cpu = host_concat(jobs, dtype=dtype, context=context)
        return [t for key in jobs for t in cpu[key]]

    attach_staged(composite, staged, twins)


def host_concat(jobs: Any, *, dtype: torch.dtype | None, context: int | None = None,
                timings: dict[str, float] | None = None) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """[`concat_many`] into one huge-page host arena, pinned in place where vLLM pins LoRA memory: the copy
    runs at the speed of touched memory (about half the time of a copy into fresh memory), vLLM copies
    nothing into pinned memory again, and the slot copy is a DMA. ``timings`` receives the seconds of the
    arena's mapping, the copy and the pinning, and ``kept``: 1.0 where the arena's memory was kept from an earlier
    one (touched, and pinned where it was).

    After the copy a spare arena of this size is made in the background, touched and pinned
    ([`transport.arena.prepare_spare`]), so the next mix of these components copies into memory that costs no
    page faults and no registration (``bench/probe_mix_copy.py``, ``bench/probe_host_memory.py``).
    """
    shapes = composite_shapes(jobs, dtype=dtype)
    need = sum(math.prod(a) * t.itemsize + math.prod(b) * t.itemsize + 128 for a, b, t in shapes.values())
    if not host_arenas_enabled() or need < host_arena_min_bytes():
        return concat_many(jobs, dtype=dtype, pools=pools)
    t0 = time.perf_counter()
    arena = kept_host_arena(need)  # concat_many writes every byte of its tensors
    reused = arena.reused
    try:
        t1 = time.perf_counter()
        done = concat_many(jobs, dtype=dtype, alloc=arena.empty, pools=pools)
        t2 = time.perf_counter()
        pin_in_place(arena, context=context)
        if timings is not None:
            timings.update(mapping=t1 - t0, copy=t2 - t1, pinning=time.perf_counter() - t2)
    finally:
        arena.close()
    # The next mix of these components has this size: have its memory touched and pinned by then, off its path.
    # vLLM's pinning rule is asked here; the transport layer's background thread only registers (no callback up).
    ctx = context if context is not None else cuda_context()
    prepare_spare(need, ready=functools.partial(register_in_place, context=ctx) if lora_host_memory_pinned() else None)
    if timings is not None:
        timings["kept"] = float(reused)
    return done


# id(component factor) -> its largest magnitude, while the factor lives. No lock: single dict operations are
# atomic, and a factor freed while a lock is held (a component evicted from the cache) must not wait for one.
_MAX_ABS: dict[int, float] = {}


def _max_abs(t: torch.Tensor) -> float:
    """The largest magnitude in a component's factor (NaN if it holds one), computed once per cached tensor."""
    key = id(t)
    found = _MAX_ABS.get(key)
    if found is not None:
        return found
    value = largest_magnitude(t)
    if t.numel():
        _MAX_ABS[key] = value
        weakref.finalize(t, _MAX_ABS.pop, key, None)
    return value


def _rank(w: Any) -> int:
    a = w.lora_a
    return int(max(t.shape[1] for t in a)) if isinstance(a, list) else int(a.shape[0])


def clear_component_cache() -> None:
    """Forget every cached component (tests; memory pressure). The known ranks stay: a few integers each, checked
    against their files' stamps before use."""
    with _LOCK:
        _CACHE.clear()
