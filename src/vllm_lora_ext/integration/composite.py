"""Worker side of weighted mixes: a ``mix:`` LoRA path -> one composite ``LoRAModel`` (exact, rank-concatenated).

Components are loaded through the plugin's normal loader (every source form and MoE layout) and kept
in a small per-process LRU keyed by pinned source, so several mixes of the same adapters read each
adapter once and a composite costs no disk writes. Components are never handed to vLLM (vLLM mutates
the LoRAModel it registers), only the composite built from them.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from vllm_lora_ext.constants import ENV_COMPONENT_CACHE, host_arena_min_bytes, host_arenas_enabled, max_lora_rank_for
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.integration._compat import pin_in_place
from vllm_lora_ext.integration.moe import packed_layer
from vllm_lora_ext.mixing import (MixComponent, MixSpec, composite_shapes, concat_many,
                                  weighted_parts_stay_finite)
from vllm_lora_ext.transport.arena import prepare_spare
from vllm_lora_ext.transport.cuda import cuda_context, kept_host_arena
from vllm_lora_ext.validation import check_finite

logger = logging.getLogger(__name__)

_CACHE: OrderedDict[tuple[int, str], Any] = OrderedDict()
_LOCK = threading.Lock()


def _cache_size() -> int:
    try:
        return max(0, int(os.environ.get(ENV_COMPONENT_CACHE, "8")))
    except ValueError:
        return 8


def _component(manager: Any, name: str, source: str, *, separate_process: bool = False) -> Any:
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.loader import load_lora_model

    key = (id(manager), source)
    with _LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    model = load_lora_model(manager, LoRARequest(lora_name=name, lora_int_id=1, lora_path=source),
                            separate_process=separate_process)
    size = _cache_size()
    if size:
        with _LOCK:
            _CACHE[key] = model
            while len(_CACHE) > size:
                _CACHE.popitem(last=False)
    return model


def _components(manager: Any, spec: MixSpec, *, separate_process: bool) -> list[Any]:
    """Each component's ``LoRAModel``, in the mix's order; those not cached are built at the same time.

    A component build is mostly reading and copying (which release the GIL) or, with ``separate_process``,
    waiting for the build process, which runs them side by side.
    """
    with _LOCK:
        cached = {c.source for c in spec.components if (id(manager), c.source) in _CACHE}
    missing: dict[str, MixComponent] = {}  # by source: one build for a source named twice
    for c in spec.components:
        if c.source not in cached:
            missing.setdefault(c.source, c)
    built: dict[str, Any] = {}
    if len(missing) > 1:
        with ThreadPoolExecutor(len(missing), thread_name_prefix="vllm-lora-ext-component") as pool:
            built = dict(zip(missing, pool.map(
                lambda c: _component(manager, c.name, c.source, separate_process=separate_process),
                missing.values())))
    return [built[c.source] if c.source in built
            else _component(manager, c.name, c.source, separate_process=separate_process) for c in spec.components]


def build_composite(manager: Any, lora_request: Any, *, separate_process: bool = False, device: Any = None) -> Any:
    """Load every component of the mix in ``lora_request.lora_path`` and concatenate them along rank.

    Components not cached yet are built at the same time; with ``separate_process``, by the worker's build
    process. With a CUDA ``device`` (background builds, and the step unless ``VLLM_LORA_EXT_MIX_ON_GPU=0``),
    the concatenation runs on the GPU into a staged buffer (`staging.concat_staged`) when it fits, and the CPU
    copy vLLM keeps is copied back from it afterwards, off the request's path (`staging.twins_from_gpu`, one
    DMA into a pinned host arena; a CPU concatenation where that cannot be had); otherwise on the CPU. On an
    H100 the GPU build of four 7B r16 components took 11-24 ms in the engine (one upload per component, 56
    placing copies) and the CPU build 59-79 ms, in two runs (``new_mix_both_h100_r15b.json``, ``_r15c.json``).

    Raises:
        [`MixError`]: a malformed mix path.
        [`AdapterCompatibilityError`]: a module's summed rank exceeds ``max_lora_rank`` (names the ranks).
        [`AdapterFormatError`]: a weighted factor overflows to infinity (names the module).
    """
    from vllm.lora.lora_weights import LoRALayerWeights

    t0 = time.perf_counter()
    spec = MixSpec.from_path(lora_request.lora_path)
    comps = list(zip(spec.components, _components(manager, spec, separate_process=separate_process)))
    t1 = time.perf_counter()
    dtype = manager.lora_config.lora_dtype if isinstance(manager.lora_config.lora_dtype, torch.dtype) else None
    max_rank = int(manager.lora_config.max_lora_rank)
    names: dict[str, None] = {}
    for _, model in comps:
        names.update(dict.fromkeys(model.loras))
    # One concatenation job per dense module and per slice of a packed MoE block, run on a few threads.
    jobs: dict[Any, tuple[list[tuple[torch.Tensor, torch.Tensor, float]], int, int]] = {}
    present_by_name: dict[str, list[tuple[Any, Any]]] = {}
    for name in names:
        present = [(c, m.loras[name]) for c, m in comps if name in m.loras]
        present_by_name[name] = present
        first = present[0][1]
        if isinstance(first.lora_a, list):  # a pre-packed MoE block (scaling already folded)
            for j in range(len(first.lora_a)):
                jobs[(name, j)] = ([(w.lora_a[j], w.lora_b[j], c.weight) for c, w in present], 1, 2)
        else:
            jobs[name] = ([(w.lora_a, w.lora_b, c.weight * float(w.scaling)) for c, w in present], 0, 1)
    if device is not None and torch.device(device).type == "cuda":
        from vllm_lora_ext.transport.staging import in_source_order

        jobs = in_source_order(jobs)  # the GPU layout follows the components' own: far fewer copies (_place)
    shapes = composite_shapes(jobs, dtype=dtype)
    too_big: list[str] = []
    for name, present in present_by_name.items():
        first = present[0][1]
        keys = [(name, j) for j in range(len(first.lora_a))] if isinstance(first.lora_a, list) else [name]
        rank = max(int(shapes[k][0][1 if isinstance(k, tuple) else 0]) for k in keys)
        if rank > max_rank:
            parts = ", ".join(f"{c.name} r={_rank(w)}" for c, w in present)
            too_big.append(f"{name} needs {rank} ({parts})")
    if too_big:
        need = max(int(s.split(" needs ")[1].split(" ")[0]) for s in too_big)
        raise AdapterCompatibilityError(
            f"Mix {spec.lora_name!r} needs rank {need} (the sum of its adapters' ranks) but max_lora_rank is "
            f"{max_rank}: {too_big[0]}. Start vLLM with --max-lora-rank {max_lora_rank_for(need) or need} or mix "
            f"fewer adapters.", adapter=spec.lora_name)
    t2 = time.perf_counter()  # planning ends; "copies" below is the GPU build or the host copy
    on_gpu = None
    if device is not None and torch.device(device).type == "cuda":
        from vllm_lora_ext.integration.staging import concat_staged

        on_gpu = concat_staged(jobs, dtype=dtype, device=device)
    phases: dict[str, float] = {}
    done = on_gpu[0] if on_gpu is not None else host_concat(jobs, dtype=dtype, timings=phases)
    t3 = time.perf_counter()
    loras: dict[str, Any] = {}
    for name, present in present_by_name.items():
        first = present[0][1]
        if isinstance(first.lora_a, list):
            a_list = [done[(name, j)][0] for j in range(len(first.lora_a))]
            b_list = [done[(name, j)][1] for j in range(len(first.lora_a))]
            loras[name] = packed_layer(name, a_list, b_list, max(int(a.shape[1]) for a in a_list))
        else:
            a, b = done[name]
            loras[name] = LoRALayerWeights(name, int(a.shape[0]), 1, a, b, scaling=1.0)
    # B is a copy of finite components; only w·s·A can overflow to inf, so only A is scanned, and only when the
    # components' largest magnitudes (kept per cached component) do not rule it out.
    if not weighted_parts_stay_finite(jobs, dtype=dtype, max_abs=_max_abs):
        finite_a = {f"{n} lora_A[{i}]": t for n, lw in loras.items()
                    for i, t in enumerate(lw.lora_a if isinstance(lw.lora_a, list) else [lw.lora_a]) if t is not None}
        if on_gpu is not None:
            from vllm_lora_ext.transport.cuda import side_stream

            scan: Any = side_stream(device)  # off the engine's stream
        else:
            scan = contextlib.nullcontext()
        with scan:
            check_finite(finite_a, adapter=spec.lora_name)
    model_cls = manager._lora_model_cls
    composite = model_cls(lora_request.lora_int_id, max((_rank(w) for w in loras.values()), default=1), loras)
    composite.is_3d_lora_weight = lora_request.is_3d_lora_weight
    if on_gpu is not None:
        from vllm_lora_ext.integration.staging import attach_staged, twins_from_gpu

        context = cuda_context()  # the twins are built on a helper thread, and pinned for this worker's GPU
        staged = on_gpu[1]

        def twins() -> list[torch.Tensor]:  # the CPU copy vLLM keeps, region by region (each key's A, then B)
            regions = [(t, tuple(shape)) for a, b, t in shapes.values() for shape in (a, b)]
            back = twins_from_gpu(staged, regions, context=context)
            if back is not None:
                return back
            cpu = host_concat(jobs, dtype=dtype, context=context)
            return [t for key in jobs for t in cpu[key]]

        attach_staged(composite, staged, twins)
    kept = phases.pop("kept", 0.0)
    detail = "".join(f", {k} {v * 1000:.0f} ms" for k, v in phases.items()) + (" into kept memory" if kept else "")
    logger.info("built mix %r from %d adapters: %d modules, %.2f s (components %.2f s, concatenation %.2f s%s: "
                "planning %.0f ms, copies %.0f ms%s, the rest %.0f ms)", spec.lora_name, len(comps), len(loras),
                time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1, " on the GPU" if on_gpu is not None else "",
                (t2 - t1) * 1000, (t3 - t2) * 1000, detail, (time.perf_counter() - t3) * 1000)
    return composite


def host_concat(jobs: Any, *, dtype: torch.dtype | None, context: int | None = None,
                timings: dict[str, float] | None = None) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """[`concat_many`] into one huge-page host arena, pinned in place where vLLM pins LoRA memory: the copy
    runs at the speed of touched memory (0.08 s against 0.16 s for 281 MiB on an H200 host), vLLM copies
    nothing into pinned memory again, and the slot copy is a DMA. ``timings`` receives the seconds of the
    arena's mapping, the copy and the pinning, and ``kept``: 1.0 where the arena's memory was kept from an earlier
    one (touched, and pinned where it was).

    After the copy a spare arena of this size is made in the background, touched and pinned
    ([`hostmem.prepare_spare`]), so the next mix of these components copies into memory that costs no page
    faults and no registration: on an H100 host the copy took 79-140 ms into fresh memory and the pinning
    8-36 ms (``new_mix_h100_r13.json``); one thread of the dev VM copies into touched memory at 14.7 GB/s and
    scales at 13.5 GB/s, about 20 ms for those bytes.
    """
    shapes = composite_shapes(jobs, dtype=dtype)
    need = sum(math.prod(a) * t.itemsize + math.prod(b) * t.itemsize + 128 for a, b, t in shapes.values())
    if not host_arenas_enabled() or need < host_arena_min_bytes():
        return concat_many(jobs, dtype=dtype)
    t0 = time.perf_counter()
    arena = kept_host_arena(need)  # concat_many writes every byte of its tensors
    reused = arena.reused
    try:
        t1 = time.perf_counter()
        done = concat_many(jobs, dtype=dtype, alloc=arena.empty)
        t2 = time.perf_counter()
        pin_in_place(arena, context=context)
        if timings is not None:
            timings.update(mapping=t1 - t0, copy=t2 - t1, pinning=time.perf_counter() - t2)
    finally:
        arena.close()
    # The next mix of these components has this size: have its memory touched and pinned by then, off its path.
    ctx = context if context is not None else cuda_context()
    prepare_spare(need, ready=lambda spare: pin_in_place(spare, context=ctx))
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
    if not t.numel():
        return 0.0
    lo, hi = torch.aminmax(t)
    value = max(-float(lo), float(hi)) if not (torch.isnan(lo) or torch.isnan(hi)) else float("nan")
    _MAX_ABS[key] = value
    weakref.finalize(t, _MAX_ABS.pop, key, None)
    return value


def _rank(w: Any) -> int:
    a = w.lora_a
    return int(max(t.shape[1] for t in a)) if isinstance(a, list) else int(a.shape[0])


def clear_component_cache() -> None:
    """Forget every cached component (tests; memory pressure)."""
    with _LOCK:
        _CACHE.clear()
