"""The process's CUDA state and the driver calls around it: side streams, the GPU-room check, host pinning.

One pool of CUDA streams serves every copy or transpose that must stay off the engine's stream ([`side_stream`]):
the staging copies share one stream per GPU, reads turning factors on the GPU use a few, one per reading thread
([`stream_for`] with ``per_thread``). [`gpu_free_bytes`] is the one check of a GPU's free memory before a buffer
is taken there. [`register_in_place`] page-locks a host arena where it lies (the driver's ``cuMemHostRegister``);
whether vLLM wants LoRA memory pinned at all is a vLLM setting, asked in ``integration._compat.pin_in_place``.
See the package docstring for where each of these runs in an adapter's life.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from typing import Any

import torch

from vllm_lora_ext.transport.arena import HostArena

__all__ = ["await_gpu_reads", "bind_worker_gpu", "cuda_context", "cuda_device_in_use", "gpu_free_bytes",
           "kept_host_arena", "register_in_place", "side_stream", "stream_for", "turn_on_gpu"]

_LOCK = threading.Lock()
_STREAMS: dict[tuple[str, int], list[Any]] = {}  # (use, device index) -> the streams of that use there
_THREAD_STREAM = threading.local()  # per thread: {(use, device index): its stream}
_NEXT = itertools.count()


def stream_for(device: torch.device, use: str, *, count: int = 1, per_thread: bool = False) -> Any:
    """A CUDA stream of this process for ``use`` on ``device``, one of at most ``count`` kept for that use.

    With ``per_thread``, a thread keeps the stream it was given first (streams are dealt round robin): reading
    threads then queue apart from each other. Without, every caller shares the use's first stream.
    """
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (use, index)
    mine: dict[tuple[str, int], Any] | None = None
    if per_thread:
        mine = getattr(_THREAD_STREAM, "by_use", None)
        if mine is None:
            mine = _THREAD_STREAM.by_use = {}
        if key in mine:
            return mine[key]
    with _LOCK:
        pool = _STREAMS.setdefault(key, [])
        if not pool or (per_thread and len(pool) < count):
            pool.append(torch.cuda.Stream(device=index))
        stream = pool[next(_NEXT) % len(pool)] if per_thread else pool[0]
    if mine is not None:
        mine[key] = stream
    return stream


def side_stream(device: Any) -> Any:
    """A context that runs torch's CUDA work on this process's staging stream for ``device``, off the engine's."""
    return torch.cuda.stream(stream_for(torch.device(device), "staging"))


def gpu_free_bytes(device: torch.device, *, reuse_cached: bool) -> int:
    """The bytes free on ``device`` for a new buffer (0 where it is no CUDA device in use here): the driver's free
    memory, plus with ``reuse_cached`` the blocks torch's allocator holds unused (they serve an allocation on the
    stream that freed them, so only a caller allocating on any stream counts them)."""
    try:
        free, _ = torch.cuda.mem_get_info(device)
        if reuse_cached:
            free += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
    except (RuntimeError, AssertionError, ValueError):  # not a CUDA device, or CUDA not in use here
        return 0
    return int(free)


def turn_on_gpu(device: torch.device, raw: torch.Tensor, out: torch.Tensor, rows: int, cols: int,
                scale: float | None) -> bool:
    """Write ``raw`` (the host bytes of a ``(rows, cols)`` tensor) transposed, times ``scale`` if given, into
    ``out`` ``(cols, rows)`` by way of ``device``, on this thread's turning stream; ``False`` on a GPU out of
    memory (``out`` unspecified)."""
    stream = stream_for(device, "turning", count=_TURNING_STREAMS, per_thread=True)
    try:
        with torch.cuda.device(device), torch.cuda.stream(stream):
            lying = torch.empty((rows, cols), dtype=out.dtype, device=device)
            lying.view(-1).view(torch.uint8).copy_(raw)
            turned = torch.empty((cols, rows), dtype=out.dtype, device=device)
            if scale is None:
                turned.copy_(lying.t())
            else:
                torch.mul(lying.t(), scale, out=turned)
            del lying  # (its block goes back to this stream's pool, behind the work queued on it)
            # Synchronous: ``out`` is host memory (pageable or pinned), so torch waits for this stream's work
            # before it returns, and ``turned``'s block is free to go back then.
            out.copy_(turned)
            del turned
    except torch.cuda.OutOfMemoryError:
        stream.synchronize()
        return False
    return True


# The streams `turn_on_gpu` works on, per GPU. A transpose's two temporaries come from its stream, and torch's
# allocator keeps their blocks cached for that stream: with 8 streams, at most 8 x 2 x the largest tensor turned
# stay cached, whichever threads ran them (mix components load on new threads). On one shared stream each copy
# back waits for the others' queued work, which leaves a 4-thread 3D build barely faster than on the CPU; on
# streams of their own it takes about half the CPU's time (``bench/probe_read_threads.py``).
_TURNING_STREAMS = 8


def cuda_context() -> int | None:
    """The CUDA context bound to this thread (a worker's), to hand to [`register_in_place`] on a helper thread."""
    cuda = _libcuda()
    ctx = ctypes.c_void_p()
    if cuda is None or cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0:
        return None
    return ctx.value or None


def bind_worker_gpu(device: Any) -> bool:
    """Make the worker's GPU ``device`` current on this thread, as it is on the worker's own; return whether it is.

    A helper thread (a mix's component loads, background builds) starts with no CUDA context, and
    [`register_in_place`] then leaves an adapter's host arena pageable. vLLM's ``from_lora_tensors`` next copies
    every factor into pinned memory of its own, one tensor at a time: a 70 MiB 7B component takes 0.65 s to wrap
    this way against 0.01 s on the worker's thread, and a mix built on the GPU then goes up in 1,792 copies
    instead of one per component. Setting the device binds its primary
    context, the one torch made for the worker already. No-op (``False``) off CUDA, before the worker used CUDA,
    or for a CUDA device without an index.
    """
    where = cuda_device_in_use(device)
    if where is None or where.index is None:
        return False
    torch.cuda.set_device(where)
    return True


def cuda_device_in_use(device: Any) -> Any:
    """``device`` (a manager's: a ``torch.device``, a string, ``None``) as a CUDA ``torch.device``, where it is one and
    this process has used CUDA; else ``None`` (a CPU manager, something that is no device)."""
    if device is None:
        return None
    try:
        where = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        return None
    return where if where.type == "cuda" and torch.cuda.is_initialized() else None


def await_gpu_reads(device: Any = None) -> None:
    """Wait until every copy queued on this process's GPU has run, before host memory kept for reuse is written.

    vLLM queues an adapter's slot copy from its CPU tensors without waiting for it, and with async scheduling the
    step that evicts the adapter can start while that copy still reads. Pinned memory from torch's caching host
    allocator is not handed out again until such copies are done (it records an event); a kept host arena (the
    arena spare) has no such guard, so its user waits here first: a wrong byte would put another adapter's
    weights into the slot. No-op where CUDA is not in use.
    """
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize(device)


def kept_host_arena(nbytes: int, *, device: Any = None) -> HostArena:
    """A ``HostArena(nbytes, reuse=True)``, ready to write: where it was given kept memory, the GPU's queued
    copies (one may still read that memory) have run first ([`await_gpu_reads`] on ``device``).

    Only for callers that write every byte they read (kept memory holds an earlier arena's bytes).
    """
    arena = HostArena(nbytes, reuse=True)
    if arena.reused:
        await_gpu_reads(device)
    return arena


def register_in_place(arena: Any, *, context: int | None = None) -> bool:
    """Page-lock the used part of a host arena for the GPUs, in place; return whether it did.

    From pageable memory a host-to-GPU copy goes through the driver's bounce buffers (0.24 s for 1.6 GB,
    against 0.03 s from pinned memory), and ``pin_memory()`` copies (0.30 s for 1.6 GB). Registering
    the arena (``cuMemHostRegister``: 0.04 s for 1.6 GB of huge pages) makes its tensors pinned where they are:
    ``pin_memory()`` returns them as they are, and a copy from them is a DMA. The registration is undone when the
    arena's memory is returned (its last tensor is gone, and it is not kept as the spare), before the unmap.
    Memory kept from an earlier arena stays registered, so an arena over it costs no call unless it uses more.

    Nothing happens in a thread without a CUDA context unless ``context`` ([`cuda_context`] of the worker's
    thread) is given, or when the driver refuses; the tensors then stay in ordinary memory. The driver API is
    used so that a refusal leaves no error behind for torch's next kernel-launch check.
    """
    memory = getattr(arena, "memory", None)
    if arena.buffer is None or arena.used == 0 or memory is None:
        return False
    size = min(arena.capacity, -(-arena.used // 4096) * 4096)
    if memory.registered >= size:  # memory kept from an earlier arena, pinned already
        return True
    cuda = _libcuda()
    if cuda is None:
        return False
    ctx = ctypes.c_void_p()
    if (cuda.cuCtxGetCurrent(ctypes.byref(ctx)) != 0 or not ctx.value) and context:
        cuda.cuCtxSetCurrent(ctypes.c_void_p(context))  # a helper thread of the worker: bind the worker's context
        cuda.cuCtxGetCurrent(ctypes.byref(ctx))
    if not ctx.value:
        return False  # no context bound to this thread: leave the memory pageable rather than create one
    base = ctypes.c_void_p(arena.base)
    first = memory.registered == 0
    if not first:  # a kept mapping pinned over less than this arena uses: register the wider range instead
        cuda.cuMemHostUnregister(base)
        memory.registered = 0
    if cuda.cuMemHostRegister_v2(base, ctypes.c_size_t(size), ctypes.c_uint(1)) != 0:  # 1: PORTABLE
        return False
    memory.registered = size
    if not first:
        return True  # the hook below is in place already
    owner = ctx.value

    # Any thread may drop the last tensor: bind the context first. The hook holds nothing of the memory it is
    # a hook of (a reference cycle would leave the memory pinned and mapped until the cyclic GC ran).
    def unregister() -> None:
        current = ctypes.c_void_p()
        cuda.cuCtxGetCurrent(ctypes.byref(current))
        if current.value != owner:
            cuda.cuCtxSetCurrent(ctypes.c_void_p(owner))
        cuda.cuMemHostUnregister(base)  # an error if a widening failed and left nothing registered: harmless
        if current.value != owner:
            cuda.cuCtxSetCurrent(current)

    arena.on_release(unregister)
    return True


_LIBCUDA: list[Any] = []


def _libcuda() -> Any:
    """The CUDA driver library, or None without one (loaded once)."""
    if not _LIBCUDA:
        try:
            lib: Any = ctypes.CDLL("libcuda.so.1")
            for name in ("cuCtxGetCurrent", "cuCtxSetCurrent", "cuMemHostRegister_v2", "cuMemHostUnregister"):
                getattr(lib, name).restype = ctypes.c_int
        except (OSError, AttributeError):
            lib = None
        _LIBCUDA.append(lib)
    return _LIBCUDA[0]
