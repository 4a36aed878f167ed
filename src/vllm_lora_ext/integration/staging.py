"""Stage a built adapter's ``LoRAModel`` on its GPU before the engine needs it, and point it back at CPU tensors after.

vLLM copies a new adapter into its LoRA slot inside the engine step, from CPU memory it pins in that step. A
background build therefore ends here: [`stage`] copies the model's factors into one GPU buffer on a side stream
and points the model at it, so the step's slot copy is GPU to GPU and vLLM pins nothing; [`unstage`], after the
slot copy, points the model back at its CPU tensors and frees the buffer, so registered adapters hold no GPU
memory beyond their slots. [`concat_staged`] builds a mix's concatenation on the GPU, staged from the start,
and [`attach_staged`] gives it CPU twins copied back in the background ([`twins_from_gpu`]). Staging is bounded
(``VLLM_LORA_EXT_STAGE_GPU_BYTES``, and the GPU's free memory); what does not fit is served from CPU memory.
The buffers, copies and streams are ``transport``'s; its docstring tells where staging sits in an adapter's life
(steps 5 to 8).
"""

from __future__ import annotations

import bisect
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import torch

from vllm_lora_ext.constants import GPU_HEADROOM_BYTES, stage_gpu_bytes
from vllm_lora_ext.formats.moe import turn_in_place
from vllm_lora_ext.integration.patching import ACTIVATION_ATTR, STAGED_ATTR, UNSCANNED_ATTR, UNTURNED_ATTR
from vllm_lora_ext.transport.arena import aligned
from vllm_lora_ext.transport.cuda import gpu_free_bytes, stream_for
from vllm_lora_ext.transport.handover import view_at
from vllm_lora_ext.transport.staging import (STAGE_ALIGN, Staging, _as_stored, _composite_layout, _composite_moves,
                                             _copy_through_pinned, _layout, _upload_and_place)
from vllm_lora_ext.validation import first_nonfinite, nonfinite_error

logger = logging.getLogger(__name__)

__all__ = ["attach_staged", "concat_staged", "factor_tensors", "on_staging_stream", "refuse_nonfinite", "stage",
           "staged_bytes", "twins_from_gpu", "unstage"]

_FACTORS = ("lora_a", "lora_b", "embeddings_tensor")
_LOCK = threading.Lock()
_STAGED: weakref.WeakSet[Any] = weakref.WeakSet()


def factor_tensors(weights: Any, attrs: tuple[str, ...] = _FACTORS) -> list[tuple[str, int | None, torch.Tensor]]:
    """Every factor tensor of one module's weights as (attribute, list index or None, tensor)."""
    out: list[tuple[str, int | None, torch.Tensor]] = []
    for attr in attrs:
        value = getattr(weights, attr, None)
        if isinstance(value, torch.Tensor):
            out.append((attr, None, value))
        elif isinstance(value, list):
            out += [(attr, i, t) for i, t in enumerate(value) if isinstance(t, torch.Tensor)]
    return out


def _slots(lora: Any) -> list[tuple[Any, str, int | None, torch.Tensor]]:
    """Every factor tensor of a LoRAModel as (owner, attribute, list index or None, tensor)."""
    return [(weights, attr, i, t)  # (a snapshot of the modules: another thread may read them meanwhile)
            for weights in list(getattr(lora, "loras", {}).values()) for attr, i, t in factor_tensors(weights)]


def _put(owner: Any, attr: str, index: int | None, tensor: torch.Tensor) -> None:
    if index is None:
        setattr(owner, attr, tensor)
    else:
        getattr(owner, attr)[index] = tensor


def staged_bytes() -> int:
    """GPU bytes this process holds in staged adapters not yet copied into a slot."""
    with _LOCK:
        return sum(getattr(m, STAGED_ATTR).nbytes for m in list(_STAGED) if getattr(m, STAGED_ATTR, None))


def _side_stream(device: torch.device) -> Any:
    return stream_for(device, "staging")


def _room(total: int, device: torch.device, what: str) -> bool:
    """Whether ``total`` more bytes may be staged on ``device`` (the budget, and the GPU's free memory)."""
    budget = stage_gpu_bytes()
    held = staged_bytes()
    if held + total > budget:
        logger.info("%s not staged on the GPU (%.0f MiB; %.0f of %.0f MiB staged already): it is built in CPU "
                    "memory and copied into its slot from there", what, total / 2**20, held / 2**20, budget / 2**20)
        return False
    free = gpu_free_bytes(device, reuse_cached=True)
    if free < total + GPU_HEADROOM_BYTES:
        logger.info("%s not staged on the GPU: %.0f MiB needed, %.0f MiB free", what, total / 2**20,
                    free / 2**20)
        return False
    return True


def stage(lora: Any, device: Any) -> bool:
    """Copy ``lora``'s CPU factors to one buffer on ``device`` and point ``lora`` at it; return whether it did.

    Folds each module's scaling into B first (vLLM's own ``optimize()``, here rather than in the step),
    so the GPU copy and the CPU tensors stay equal. Nothing is staged off CUDA, past the budget, or
    when the GPU lacks room; the adapter then goes into its slot from CPU memory, as in stock vLLM.

    Fused 3D B factors a build process left as stored (``UNTURNED_ATTR``) are transposed and scaled here: on the
    GPU after their copy, their CPU twins written back from it in the background (`unstage` waits for them),
    or on the CPU where the model is not staged.
    """
    unturned = list(lora.__dict__.pop(UNTURNED_ATTR, None) or [])
    # (an error raised here fails the load: the model is never served, and nothing more is turned)
    staged = _stage(lora, torch.device(device), unturned)  # (takes out of ``unturned`` what it turned)
    if not staged:
        _turn_on_cpu(unturned)
    # Staged: the turns are queued on the staging stream, before the scan that `refuse_nonfinite` runs there and
    # waits for (a model left unturned is always left unscanned: ``BuildJob.defer_turn`` needs ``scan_moe=False``).
    return staged


def _turn_on_cpu(unturned: list[tuple[torch.Tensor, int, int, float]]) -> None:
    t0 = time.perf_counter()
    for t, rows, cols, scale in unturned:
        turn_in_place(t, rows, cols, scale)
    if unturned:
        logger.info("turned %d fused 3D factors on the CPU in %.3f s", len(unturned), time.perf_counter() - t0)


def _alone(unturned: list[tuple[torch.Tensor, int, int, float]],
           tensors: list[torch.Tensor]) -> tuple[list[Any], list[Any]]:
    """The ``unturned`` factors that are a slot of their own among ``tensors`` (the model's CPU factors), which the
    GPU may turn once staged, and the rest (no slot of its bytes, or one with only part of them)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.nbytes) for t in tensors if t.nbytes)
    longest = max((end - start for start, end in spans), default=0)
    alone, rest = [], []
    for item in unturned:
        lo, hi = item[0].data_ptr(), item[0].data_ptr() + item[0].nbytes
        near = [sp for sp in spans[bisect.bisect_left(spans, (lo - longest, 0)):bisect.bisect_left(spans, (hi, 0))]
                if sp[1] > lo]  # every slot sharing a byte with it
        (alone if near and all(sp == (lo, hi) for sp in near) else rest).append(item)
    return alone, rest


def _stage(lora: Any, device: torch.device, unturned: list[tuple[torch.Tensor, int, int, float]]) -> bool:
    if device.type != "cuda" or not torch.cuda.is_available() or getattr(lora, STAGED_ATTR, None) is not None:
        return False
    for weights in getattr(lora, "loras", {}).values():
        weights.optimize()
    slots = [s for s in _slots(lora) if s[3].device.type == "cpu"]
    total, regions, places = _layout([t for *_, t in slots])
    if not slots or total == 0:
        return False
    alone, rest = _alone(unturned, [t for *_, t in slots])
    _turn_on_cpu(rest)
    unturned[:] = alone  # (what `stage` turns on the CPU if this returns False: each factor is turned once)
    regions = [(off, t.contiguous()) for off, t in regions]
    stored = _as_stored(regions)
    if stored is not None:  # most of it mirrors the storage it lies in, whose span goes up whole
        total, starts, copies = stored
        moved = dict(zip((off for off, _ in regions), starts))  # (a region of no bytes may share an offset: moot)
        places = [moved[p] for p in places]
        regions = sorted(zip(starts, (t for _, t in regions)), key=lambda r: r[0])
    else:  # a copy a region
        copies = [(off, t.view(-1).view(torch.uint8)) for off, t in regions if t.numel()]
    if not _room(total, device, "adapter"):
        return False
    with torch.cuda.device(device):
        stream = _side_stream(device)
        try:
            t0 = time.perf_counter()
            with torch.cuda.stream(stream):
                buffer = torch.empty(total, dtype=torch.uint8, device=device)
            t_alloc = time.perf_counter() - t0
            staging = Staging(buffer, [off for off, _ in regions], [t for _, t in regions])
            views = [(owner, attr, index, buffer[off:off + t.nbytes].view(t.dtype).view(t.shape))
                     for (owner, attr, index, t), off in zip(slots, places)]
            _copy_through_pinned(buffer, copies, stream)
            turns = _turn_on_gpu(unturned, slots, views, stream)
        except torch.cuda.OutOfMemoryError:
            logger.info("adapter not staged on the GPU: out of memory for %.0f MiB", total / 2**20)
            return False
    logger.info("staged %.0f MiB on %s in %.3f s (allocation %.3f s; %s%s)", total / 2**20, device,
                time.perf_counter() - t0, t_alloc,
                f"one span as stored, {len(copies) - 1} regions" if stored is not None else f"{len(copies)} regions",
                f"; {len(turns)} fused 3D factors turned on the GPU" if turns else "")
    for owner, attr, index, gpu in views:
        _put(owner, attr, index, gpu)
    if turns:  # their CPU twins are the bytes as stored: written back from the GPU before they are used
        twins, staging.cpu = staging.cpu, None
        turned = torch.cuda.Event()
        turned.record(stream)
        _twins_later(lora, staging, lambda: _written_back(turns, twins, turned), "staged adapter")
    setattr(lora, STAGED_ATTR, staging)
    with _LOCK:
        _STAGED.add(lora)
    return True


def _turn_on_gpu(unturned: list[tuple[torch.Tensor, int, int, float]], slots: list[Any], views: list[Any],
                 stream: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Transpose and scale each of ``unturned`` in its staged copy, on ``stream`` after the copy: ``[(CPU tensor,
    its turned GPU copy)]``."""
    gpu_of = {(t.data_ptr(), t.nbytes): gpu for (*_, t), (*_, gpu) in zip(slots, views)}
    turns = []
    with torch.cuda.stream(stream):
        for t, rows, cols, scale in unturned:
            gpu = gpu_of[(t.data_ptr(), t.nbytes)]
            turn_in_place(gpu, rows, cols, scale)
            turns.append((t, gpu))
    return turns


def _written_back(turns: list[tuple[torch.Tensor, torch.Tensor]], twins: list[torch.Tensor] | None,
                  turned: Any) -> list[torch.Tensor]:
    """``twins`` (the staged regions' CPU tensors), once each turned factor's GPU bytes are copied back over its CPU
    tensor after the event ``turned``: the GPU's bytes, so the two stay equal bit for bit. On a stream of its own:
    the staging stream's next work (the scan, the merge, other adapters) does not wait for these copies."""
    assert twins is not None
    device = turns[0][1].device
    with torch.cuda.device(device):
        side = stream_for(device, "twins")
        side.wait_event(turned)
        with torch.cuda.stream(side):
            for cpu, gpu in turns:
                cpu.copy_(gpu)
        side.synchronize()
    return twins


def on_staging_stream(lora: Any, work: Callable[[], object]) -> None:
    """Run ``work`` (vLLM's own processing of ``lora``'s tensors, off the engine thread) on the staging stream of
    ``lora``'s GPU buffer and wait for it there, so that what it makes on the GPU is complete before the engine
    takes the model; an unstaged model's ``work`` just runs."""
    staging: Staging | None = getattr(lora, STAGED_ATTR, None)
    if staging is None:
        work()
        return
    device = staging.buffer.device
    with torch.cuda.device(device):
        stream = _side_stream(device)
        done = torch.cuda.Event()
        with torch.cuda.stream(stream):
            work()
            done.record(stream)
        done.synchronize()  # this work only, not other builds' copies queued on the shared stream after it


def refuse_nonfinite(lora: Any, name: str) -> None:
    """Scan a model built without its MoE scan (``UNSCANNED_ATTR``: ``loader.load_lora_model(scan_moe=False)``) for
    NaN/inf, where its tensors are: on the GPU once staged (``validation.first_nonfinite``: a few fused launches and
    one sync on the staging stream, about a millisecond for a 1.6 GB adapter), else on the CPU. A model that holds
    one is unstaged and emptied, so that the error kept for its callers holds no GPU or shared memory.

    Raises:
        [`AdapterFormatError`]: names the module's factor (``<module>.lora_b[1]``) and the fix.
    """
    _turn_on_cpu(lora.__dict__.pop(UNTURNED_ATTR, None) or [])  # (never staged: scanned as served)
    if not lora.__dict__.pop(UNSCANNED_ATTR, False):
        return
    named = {f"{module}.{attr}" + ("" if i is None else f"[{i}]"): t
             for module, weights in list(lora.loras.items()) for attr, i, t in factor_tensors(weights)}
    found: list[str | None] = []
    t0 = time.perf_counter()
    staged = getattr(lora, STAGED_ATTR, None) is not None
    try:
        if staged:
            on_staging_stream(lora, lambda: found.append(first_nonfinite(named)))
        else:
            found.append(_first_nonfinite_on_cpu(named))
    except BaseException:  # (a CUDA error, no memory): the model is dropped; its staging buffer goes at once
        if staged:
            unstage(lora)
        raise
    logger.info("adapter %r: scanned for NaN/inf %s in %.4f s", name, "on the GPU" if staged else "on the CPU",
                time.perf_counter() - t0)
    if found[0] is None:
        return
    if staged:
        unstage(lora)
    lora.loras.clear()
    raise nonfinite_error(found[0], adapter=name)


def _first_nonfinite_on_cpu(named: dict[str, torch.Tensor]) -> str | None:
    """``first_nonfinite`` of CPU tensors on up to 4 threads (the build process scanned them so while it read them):
    the first key in order whose tensor holds NaN or infinity."""
    from vllm_lora_ext._util import usable_cores
    from vllm_lora_ext.formats.moe_read import SCAN_POOL
    from vllm_lora_ext.transport import pools

    keys = list(named)
    workers = max(1, min(4, usable_cores() // 2, len(keys)))
    if workers == 1:
        return first_nonfinite(named)
    parts = [keys[i::workers] for i in range(workers)]
    found = pools.run_in_pool(SCAN_POOL, workers, lambda part: first_nonfinite({k: named[k] for k in part}),
                              parts)  # (an error reaches the caller once no part runs)
    bad = [b for b in found if b is not None]
    return min(bad, key=keys.index) if bad else None


def unstage(lora: Any) -> int:
    """Point a staged ``lora`` back at CPU tensors equal to its GPU ones and release the GPU buffer.

    Call it after the slot copy was enqueued: the buffer is freed only when the current stream has
    run past that copy. Tensors vLLM derived from the staged ones (a slice, a view) map to the same
    elements of the CPU tensors; anything else is copied back. Returns the bytes copied back.

    A composite built on the GPU ([`concat_staged`]) may not have its CPU tensors yet (they are built
    in the background after it). Then nothing waits in the step: the model keeps its GPU tensors
    (equal to the CPU ones to come) until the CPU tensors exist, and is pointed at them from there.
    """
    lora.__dict__.pop(ACTIVATION_ATTR, None)  # its planned slot writes hold staged tensors: used once, or never
    staging: Staging | None = getattr(lora, STAGED_ATTR, None)
    if staging is None:
        return 0
    stream = torch.cuda.current_stream(staging.buffer.device)
    staging.buffer.record_stream(stream)  # freed (here or from another thread) only after this stream's copies
    with staging.lock:
        if staging.cpu is None:  # its CPU twins are still being built: finish when they are
            staging.waiting = torch.cuda.Event()
            staging.waiting.record(stream)
            return 0
    return _point_at_cpu(lora, staging, None)


def _point_at_cpu(lora: Any, staging: Staging, after: Any) -> int:
    """Swap ``lora``'s GPU tensors for their CPU twins, copying back any vLLM derived; drop the staging record.
    ``after``: an event the copies back wait for (the engine stream's, when run from another thread)."""
    assert staging.cpu is not None
    base = staging.buffer.untyped_storage().data_ptr()
    end = base + staging.nbytes
    copied = 0
    for owner, attr, index, t in _slots(lora):
        if t.device.type != "cuda":
            continue
        ptr = t.data_ptr()
        twin = None
        if t.untyped_storage().data_ptr() == base and base <= ptr < end:
            region = bisect.bisect_right(staging.starts, ptr - base) - 1
            cpu = staging.cpu[region]
            if cpu.dtype == t.dtype:
                first = (ptr - base - staging.starts[region]) // t.element_size()
                twin = cpu.as_strided(t.shape, t.stride(), cpu.storage_offset() + first)
        if twin is None:
            if after is None:
                twin = t.to("cpu")
            else:
                stream = _side_stream(t.device)
                stream.wait_event(after)
                with torch.cuda.stream(stream):
                    twin = t.to("cpu")
            copied += t.nbytes
        _put(owner, attr, index, twin)
    delattr(lora, STAGED_ATTR)
    with _LOCK:
        _STAGED.discard(lora)
    return copied


# ------------------------------------------------------------------------------------- composites on the GPU

_SCRATCH = 256 << 20  # GPU bytes a composite's components are uploaded through, a batch at a time


def concat_staged(lora_jobs: Any, *, dtype: torch.dtype | None, device: Any) -> tuple[dict[Any, Any], Staging] | None:
    """Build a mix's rank concatenation on the GPU: ``{key: (A, B)}`` as views of one staged buffer, or ``None``.

    The same result as [`concat_many`] (``A = cat(c_i·A_i)``, ``B = cat(B_i)``, the same ops in the same
    dtype), for the same ``jobs``, without the CPU copy of every component's bytes into fresh memory (more than
    a second for a 6.3 GB mix). The components go up through the pinned chunks a batch at a time
    and are concatenated on the staging stream; the engine's stream is never used. ``None`` off CUDA, past the
    staging budget, or without room on the GPU: the caller concatenates on the CPU then.

    The caller gives the model built on these views to [`attach_staged`], with a function building the CPU
    twins, which vLLM's registered adapter must hold once its slot copy is done.
    """
    from vllm_lora_ext.mixing import composite_shapes

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available() or not lora_jobs:
        return None
    shapes = composite_shapes(lora_jobs, dtype=dtype)
    offsets, starts, total = _composite_layout(shapes)
    largest = max((t.nbytes for parts, _, _ in lora_jobs.values() for p in parts for t in p[:2]), default=0)
    scratch_bytes = min(max(_SCRATCH, aligned(largest, STAGE_ALIGN)), max(aligned(largest, STAGE_ALIGN), total))
    if not _room(total + scratch_bytes, device, "mix"):
        return None
    t0 = time.perf_counter()
    stream = _side_stream(device)
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            buffer = torch.empty(total, dtype=torch.uint8, device=device)
            scratch = torch.empty(scratch_bytes, dtype=torch.uint8, device=device)
            t1 = time.perf_counter()
            done, moves = _composite_moves(lora_jobs, shapes, offsets, buffer)
            t2 = time.perf_counter()
            n_units, n_spans, n_copies = _upload_and_place(moves, scratch, stream)
            t3 = time.perf_counter()
            stream.synchronize()
            del scratch
    except torch.cuda.OutOfMemoryError:
        logger.info("mix not built on the GPU: out of memory for %.0f MiB", (total + scratch_bytes) / 2**20)
        return None
    t4 = time.perf_counter()
    logger.info("built a mix on %s: %.0f MiB in %.3f s (allocation %.1f ms, planning %.1f ms, issuing the copies "
                "%.1f ms: %d uploads, %d of them spans, %d placing copies; waiting for them %.1f ms)", device,
                total / 2**20, t4 - t0, (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3, n_units, n_spans, n_copies,
                (t4 - t3) * 1e3)
    return done, Staging(buffer, starts, None)


def attach_staged(lora: Any, staging: Staging, twins: Any) -> None:
    """Mark ``lora`` (built on [`concat_staged`]'s views) as staged and build its CPU twins in the background.

    ``twins()`` returns the CPU tensors region by region (each key's ``A`` then ``B``, in the jobs' order),
    equal to the GPU ones. When they exist, a model whose slot copy is done already is pointed at them and
    the GPU buffer is freed; one still waiting for its slot copy is unstaged by the step as usual. If they
    cannot be built, the GPU tensors are copied back instead.
    """
    setattr(lora, STAGED_ATTR, staging)
    with _LOCK:
        _STAGED.add(lora)
    _twins_later(lora, staging, twins, "mix built on the GPU")


def _twins_later(lora: Any, staging: Staging, twins: Any, what: str) -> None:
    """Build ``staging``'s CPU twins (``twins()``) on a helper thread; a model `unstage` found without them is
    pointed at them from there. If they cannot be built, the GPU tensors are copied back instead."""
    def build() -> None:
        t0 = time.perf_counter()
        try:
            cpu = list(twins())
        except Exception:  # memory, most likely: no twin matches, so each tensor is copied back from the GPU
            logger.exception("the CPU copy of a %s failed; its tensors are copied back instead", what)
            cpu = [torch.empty(0, dtype=torch.uint8)] * len(staging.starts)
        with staging.lock:
            staging.cpu = cpu
            waiting = staging.waiting
        logger.info("CPU copy of a %s ready after %.2f s%s", what, time.perf_counter() - t0,
                    "; GPU buffer released" if waiting is not None else "")
        if waiting is not None:  # the step's unstage found no twins: finish it here
            try:
                _point_at_cpu(lora, staging, waiting)
            except Exception:  # the model keeps its GPU tensors (still correct); its buffer stays counted as staged
                logger.exception("could not point a %s at its CPU copy; it keeps its GPU memory", what)

    threading.Thread(target=build, name="vllm-lora-ext-twins", daemon=True).start()


def twins_from_gpu(staging: Staging, regions: list[tuple[torch.dtype, tuple[int, ...]]], *,
                   context: int | None = None) -> list[torch.Tensor] | None:
    """The CPU twins of a composite built on the GPU, copied back from it: one DMA into a pinned host arena.

    ``regions`` gives each region's dtype and shape, in the order of ``staging.starts``. The twins are the
    GPU bytes themselves, so they equal the GPU tensors bit for bit, and building them costs the CPU no copy
    (a CPU concatenation of the same composite takes about 0.1 s, and competes with the engine for the CPU
    meanwhile). ``None`` where host arenas are off or the arena cannot be pinned (the caller then
    concatenates on the CPU). Runs on a helper thread: ``context`` is the worker's CUDA context.
    """
    from vllm_lora_ext.constants import host_arenas_enabled
    from vllm_lora_ext.integration._compat import pin_in_place
    from vllm_lora_ext.transport.cuda import kept_host_arena

    if not host_arenas_enabled() or staging.nbytes == 0:
        return None
    arena = kept_host_arena(staging.nbytes, device=staging.buffer.device)  # the DMA below writes every byte
    try:
        flat = arena.empty((staging.nbytes,), torch.uint8)
        # Fault the pages in here, on this helper thread: registering memory not yet touched makes the driver
        # fault and zero it inside the call, which may hold up the engine thread's CUDA calls meanwhile.
        flat[::4096].zero_()
        if not arena.holds(flat) or not pin_in_place(arena, context=context):
            return None
        device = staging.buffer.device
        stream = _side_stream(device)
        with torch.cuda.device(device), torch.cuda.stream(stream):
            flat.copy_(staging.buffer, non_blocking=True)
        stream.synchronize()
        return [view_at(flat, start, dtype, shape) for start, (dtype, shape) in zip(staging.starts, regions)]
    finally:
        arena.close()
