"""Host memory for built adapters: one anonymous mapping per build, on transparent huge pages where offered.

Reading an adapter from the page cache into fresh memory costs more in page faults than in copying: a fresh
4 KiB page is faulted, zeroed and mapped before the read can fill it. On the lent H200 host a 1.6 GB read on
4 threads took 0.41 s into ``torch.empty`` memory, 0.17 s into memory advised ``MADV_HUGEPAGE`` and 0.10 s into
memory touched before; a 281 MiB copy took 0.157 s, 0.080 s and 0.059 s (``bench/probe_host_memory.py``,
``bench/results/probe_host_memory_h200.json``). A [`HostArena`] is that huge-page memory: a bump allocator
over one mapping, sized for one build, whose tensors are views that keep it alive.

An arena is also one contiguous range, which a GPU worker can pin in place in one call (``cudaHostRegister``:
0.04 s for 1.6 GB of huge pages on that host, against 0.30 s for vLLM's ``pin_memory()`` copy). Hooks given to
[`HostArena.on_release`] run when the last view is gone and before the mapping is unmapped, which is where such
a registration is undone. This module has no CUDA code; ``transport.cuda`` pins.

A mix's composite is rebuilt for every new set of weights, each time into fresh memory (faults, then a
registration). One mapping can therefore be kept ready ([`prepare_spare`]), or kept once released, for the next
arena of about its size that asks for it (``reuse``): its pages are taken and it stays pinned.
"""

from __future__ import annotations

import ctypes
import logging
import math
import mmap
import os
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

from vllm_lora_ext.constants import host_spare_bytes

__all__ = ["ALIGN", "HUGE_PAGE", "HostArena", "aligned", "bump_empty", "clear_spare", "huge_pages_offered",
           "prepare_spare"]

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 << 20  # the x86-64 and arm64 (4 KiB base pages) transparent huge page
ALIGN = 64  # every tensor in an arena (host or shared file) starts on a 64-byte boundary: any dtype's view is aligned


def aligned(n: int) -> int:
    """``n`` rounded up to [`ALIGN`].

    Example:
        >>> aligned(1), aligned(64), aligned(65)
        (64, 64, 128)
    """
    return -(-n // ALIGN) * ALIGN


@lru_cache(maxsize=1)
def huge_pages_offered() -> bool:
    """Whether the kernel gives transparent huge pages to a mapping that asks (``madvise`` or ``always`` mode).

    Example:
        >>> isinstance(huge_pages_offered(), bool)
        True
    """
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            mode = f.read()
    except OSError:
        return False
    return "[never]" not in mode


def bump_empty(arena: Any, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """Take ``shape`` × ``dtype`` from an arena's ``buffer`` (``uint8``) at ``used``, 64-byte aligned; an ordinary
    tensor once it is full or its ``buffer`` is ``None``. The arena has ``buffer``, ``capacity``, ``used``, ``_lock``."""
    n = math.prod(shape) * dtype.itemsize
    with arena._lock:
        offset = arena.used
        buffer = arena.buffer
        if buffer is None or offset + n > arena.capacity:
            return torch.empty(shape, dtype=dtype)
        arena.used = offset + aligned(n)
    return buffer[offset:offset + n].view(dtype).view(shape)


class _Memory:
    """One anonymous mapping and what holds it: arenas are carved from it, and it outlives them as the spare.

    ``hooks`` run when the mapping is finally unmapped, not when an arena over it is released (its memory may
    be kept as the spare and serve another arena first). ``registered``: bytes from the base page-locked by
    ``integration`` (0: none), which a reuse keeps.
    """

    def __init__(self, capacity: int, huge_pages: bool) -> None:
        self.capacity = capacity
        self.mapping = mmap.mmap(-1, capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge_pages and huge_pages_offered():
            try:
                self.mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # refused (e.g. a seccomp filter): ordinary pages, still one range
                pass
        # The export keeps the mapping from being closed while this object lives.
        self._export = ctypes.c_char.from_buffer(self.mapping)
        self.base = ctypes.addressof(self._export)
        self.hooks: list[Callable[[], None]] = []
        self.registered = 0

    def __del__(self) -> None:
        for hook in getattr(self, "hooks", ()):
            try:
                hook()
            except Exception:  # a hook's failure must not leak the mapping or reach an arbitrary thread's caller
                logger.exception("a host arena's release hook failed")


@lru_cache(maxsize=64)
def _lease_type(n: int) -> Any:
    """A ctypes byte array of ``n`` whose instances hand their memory back when they die: the object torch's
    tensors over an arena keep alive, so its ``__del__`` runs exactly when the last view is gone."""
    return type("_Lease", (ctypes.c_uint8 * n,), {"__del__": _lease_ended, "__slots__": ()})


def _lease_ended(lease: Any) -> None:
    memory = lease.__dict__.pop("memory", None)
    if memory is not None and lease.__dict__.get("keep"):
        try:
            _SPARE.returned(memory)
        except Exception:  # the interpreter is ending, say: the memory is simply returned
            pass


class _Spare:
    """The one released (or prepared) mapping kept for the next arena: its pages taken, and pinned if they were.

    A mapping touched and pinned before costs an arena neither page faults (about half a fresh arena's fill
    time) nor a registration. Released arenas' memory is kept up to ``VLLM_LORA_EXT_HOST_SPARE_BYTES``; one
    mapping at a time, the latest, which is dropped (hooks, then the unmap) when another takes its place.
    """

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a lease may end (the GC) while this thread holds it
        self._memory: _Memory | None = None
        self._preparing = False
        self.reused = 0  # arenas given a kept mapping (tests, logs)

    def take(self, capacity: int) -> _Memory | None:
        """The kept mapping, if it [`_fits`] ``capacity``."""
        with self._lock:
            memory = self._memory
            if memory is None or not _fits(capacity, memory):
                return None
            self._memory = None
            self.reused += 1
            return memory

    def returned(self, memory: _Memory) -> None:
        """Keep ``memory`` (an arena's, whose last view is gone) as the spare if it fits the budget.

        No tensor views it any more, but a GPU copy queued from it may still be reading it (vLLM's slot copy of
        an adapter it has just evicted). On a GPU worker kept memory is taken through
        ``transport.cuda.kept_host_arena``, which waits for the GPU's queued copies first."""
        dropped: _Memory | None = memory
        if memory.capacity <= host_spare_bytes():
            with self._lock:
                dropped, self._memory = self._memory, memory
        del dropped  # outside the lock: its hooks run and it is unmapped, unless something still holds it

    def prepare(self, capacity: int, *, ready: Callable[[HostArena], object] | None = None) -> bool:
        """Make a spare of ``capacity`` bytes on a background thread, its pages touched and ``ready(arena)`` run
        over it (pinning, where a GPU worker asks), unless one that fits is kept or being made, or it would
        exceed the budget. Returns whether it started one."""
        capacity = _pages(capacity)
        with self._lock:
            kept = self._memory
            if self._preparing or capacity > host_spare_bytes() or (kept is not None and _fits(capacity, kept)):
                return False
            self._preparing = True
        threading.Thread(target=self._make, args=(capacity, ready), name="vllm-lora-ext-host-spare",
                         daemon=True).start()
        return True

    def _make(self, capacity: int, ready: Callable[[HostArena], object] | None) -> None:
        try:
            arena = HostArena(capacity, reuse=True, _take=False)
            assert arena.buffer is not None
            arena.buffer[::4096].zero_()  # fault every page in here, off the path of the arena that takes it
            arena.used = arena.capacity
            if ready is not None:
                ready(arena)
            arena.close()  # its lease ends here: the mapping becomes the spare
        except Exception:  # no memory, most likely: arenas are made as they come, as without a spare
            logger.exception("could not prepare a spare host arena of %d bytes", capacity)
        finally:
            with self._lock:
                self._preparing = False

    def clear(self) -> None:
        """Drop the kept mapping (tests; memory pressure)."""
        with self._lock:
            dropped, self._memory = self._memory, None
        del dropped


_SPARE = _Spare()


def _forget_spare_in_child() -> None:
    """After a fork: the child starts with no spare and no preparation under way (the parent's thread making one
    does not exist here), and never undoes the parent's registration of a kept mapping (its hooks are dropped)."""
    memory, _SPARE._memory = _SPARE._memory, None
    if memory is not None:
        memory.hooks.clear()
    _SPARE._preparing = False
    _SPARE._lock = threading.RLock()


os.register_at_fork(after_in_child=_forget_spare_in_child)


def prepare_spare(capacity: int, *, ready: Callable[[HostArena], object] | None = None) -> bool:
    """Have a host arena of ``capacity`` bytes ready for the next build of that size (see [`_Spare.prepare`])."""
    return _SPARE.prepare(capacity, ready=ready)


def clear_spare() -> None:
    """Drop the kept spare mapping: its memory is returned (after its release hooks)."""
    _SPARE.clear()


def _fits(capacity: int, memory: _Memory) -> bool:
    """Whether kept ``memory`` may serve an arena of ``capacity``: it holds it, and not much more (at most half
    again, or one huge page), so a small build does not hold on to a large mapping."""
    return capacity <= memory.capacity <= capacity + max(capacity // 2, HUGE_PAGE)


def _pages(capacity: int) -> int:
    return max(HUGE_PAGE, -(-int(capacity) // HUGE_PAGE) * HUGE_PAGE)


class HostArena:
    """A bump allocator over one anonymous mapping, advised to use transparent huge pages.

    Tensors from [`empty`] are views of the mapping; the memory is released when the arena is closed and the
    last view is gone. Pages are only taken as tensors are written, so an upper bound is a fine capacity.
    Memory past the capacity comes from ordinary tensors. Thread-safe (MoE blocks are read on several threads).

    With ``reuse``, the arena may be given the kept spare mapping ([`prepare_spare`], or an earlier ``reuse``
    arena's memory), pages already taken and still pinned, and its own memory is kept as the spare once
    released (up to ``VLLM_LORA_EXT_HOST_SPARE_BYTES``). Such memory holds an earlier arena's bytes, not
    zeros: only a caller that writes every byte it reads may ask for it (a mix's concatenation does). On a GPU
    worker a copy queued from the earlier arena may still be reading it: ``transport.cuda.kept_host_arena``
    takes such arenas and, whenever ``reused`` is true, waits for the GPU's queued copies before handing it out.

    Example:
        >>> arena = HostArena(1 << 20)
        >>> t = arena.empty((4, 8), torch.bfloat16)
        >>> arena.holds(t), arena.used
        (True, 64)
    """

    def __init__(self, capacity: int, *, huge_pages: bool = True, reuse: bool = False, _take: bool = True) -> None:
        wanted = _pages(capacity)
        memory = _SPARE.take(wanted) if reuse and _take else None
        self.reused = memory is not None  # kept from an earlier arena (its pages taken, pinned if they were)
        if memory is None:
            memory = _Memory(wanted, huge_pages)
        self.memory: _Memory | None = memory
        self.capacity = memory.capacity
        lease = _lease_type(memory.capacity).from_address(memory.base)
        lease.memory, lease.keep = memory, reuse
        self.buffer: torch.Tensor | None = torch.frombuffer(lease, dtype=torch.uint8)
        self.base = memory.base
        self.used = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in the arena (or, once it is full or closed, an ordinary one)."""
        return bump_empty(self, shape, dtype)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this arena's memory."""
        return t.device.type == "cpu" and self.base <= t.data_ptr() < self.base + self.capacity

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the memory is returned: after [`close`] and the last view, before the unmap (later,
        if the memory is kept as the spare first)."""
        if self.memory is None:
            raise RuntimeError("the host arena is closed")
        self.memory.hooks.append(hook)

    def close(self) -> None:
        """Give no more memory; the mapping lives on as long as any tensor from it does."""
        with self._lock:
            self.buffer = None
            self.memory = None
