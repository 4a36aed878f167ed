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
a registration is undone. This module has no CUDA code; ``integration`` pins.

A mix's composite is rebuilt for every new set of weights, each time into fresh memory (faults, then a
registration). One mapping can therefore be kept ready ([`prepare_spare`]), or kept once released, for the next
arena of about its size that asks for it (``reuse``): its pages are taken and it stays pinned.

An adapter read from a file must not be given memory another adapter used (kept memory holds its bytes). One
mapping that no arena has used yet can be made ready for it instead ([`prepare_ready`]): touched in the background
(zeros, as fresh memory is), and given only to the next arena that asks for ``ready`` memory of about its size.
It is never kept again once that arena is released.
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

from vllm_lora_ext.constants import host_ready_bytes, host_spare_bytes

__all__ = ["ALIGN", "HUGE_PAGE", "HostArena", "aligned", "bump_empty", "clear_spare", "huge_pages_offered",
           "prepare_ready", "prepare_spare"]

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
    keep_in = lease.__dict__.pop("keep_in", None)
    if memory is not None and keep_in is not None:
        try:
            keep_in.returned(memory)
        except Exception:  # the interpreter is ending, say: the memory is simply returned
            pass


class _Spare:
    """The one released (or prepared) mapping kept for the next arena: its pages taken, and pinned if they were.

    A mapping touched and pinned before costs an arena neither page faults (about half a fresh arena's fill
    time) nor a registration. Memory is kept up to ``budget()`` bytes; one mapping at a time, the latest, which
    is dropped (hooks, then the unmap) when another takes its place.

    There are two: ``_SPARE`` keeps released ``reuse`` arenas' memory (``VLLM_LORA_EXT_HOST_SPARE_BYTES``) and
    prepares spares for them; ``_READY`` only ever holds a mapping it prepared, which no arena has used
    (``VLLM_LORA_EXT_HOST_READY_BYTES``), for arenas that ask for ``ready`` memory.
    """

    def __init__(self, budget: Callable[[], int], name: str) -> None:
        self.budget = budget
        self.name = name
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
        ``integration._compat.kept_host_arena``, which waits for the GPU's queued copies first."""
        dropped: _Memory | None = memory
        if memory.capacity <= self.budget():
            with self._lock:
                dropped, self._memory = self._memory, memory
        del dropped  # outside the lock: its hooks run and it is unmapped, unless something still holds it

    def prepare(self, capacity: int, *, ready: Callable[[HostArena], object] | None = None) -> bool:
        """Make a spare of ``capacity`` bytes on a background thread, its pages touched and ``ready(arena)`` run
        over it (pinning, where a GPU worker asks), unless one that fits is kept or being made, it would exceed
        the budget, or the host has less than four times that much memory available. Returns whether it started
        one."""
        capacity = _pages(capacity)
        with self._lock:
            kept = self._memory
            if self._preparing or capacity > self.budget() or (kept is not None and _fits(capacity, kept)):
                return False
            if _available_bytes() < 4 * capacity:  # memory is short: hold none idle
                return False
            self._preparing = True
        threading.Thread(target=self._make, args=(capacity, ready), name=f"vllm-lora-ext-host-{self.name}",
                         daemon=True).start()
        return True

    def _make(self, capacity: int, ready: Callable[[HostArena], object] | None) -> None:
        try:
            arena = HostArena(capacity, _keep_in=self)
            assert arena.buffer is not None
            arena.used = arena.capacity
            # Every page is faulted in here, off the path of the arena that takes it: by the registration, where
            # ``ready`` pins the memory (the driver takes each page as it locks it), else by a write.
            if ready is None or ready(arena) is not True:
                arena.buffer[::4096].zero_()
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


_SPARE = _Spare(host_spare_bytes, "spare")
_READY = _Spare(host_ready_bytes, "ready")


def _forget_spare_in_child() -> None:
    """After a fork: the child starts with no spare and no preparation under way (the parent's thread making one
    does not exist here), and never undoes the parent's registration of a kept mapping (its hooks are dropped)."""
    for spare in (_SPARE, _READY):
        memory, spare._memory = spare._memory, None
        if memory is not None:
            memory.hooks.clear()
        spare._preparing = False
        spare._lock = threading.RLock()


os.register_at_fork(after_in_child=_forget_spare_in_child)


def _available_bytes() -> int:
    """The host memory available without swapping (``MemAvailable``), or a very large number where unknown."""
    try:
        with open("/proc/meminfo", "rb") as f:
            for line in f:
                if line.startswith(b"MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 1 << 62


def prepare_spare(capacity: int, *, ready: Callable[[HostArena], object] | None = None) -> bool:
    """Have a host arena of ``capacity`` bytes ready for the next ``reuse`` build of that size (see
    [`_Spare.prepare`])."""
    return _SPARE.prepare(capacity, ready=ready)


def prepare_ready(capacity: int, *, ready: Callable[[HostArena], object] | None = None) -> bool:
    """Have a never-used host arena of ``capacity`` bytes, touched (or readied by ``ready(arena)``, which faults
    every page in where it returns ``True``), for the next build of about that size that asks for ``ready``
    memory: an adapter read from a file.

    Its pages are zeros, as fresh memory's are; once an arena has used it, it is returned, never kept. At most
    ``VLLM_LORA_EXT_HOST_READY_BYTES`` (default 2 GiB), one mapping per process, and none while the host has less
    than four times its size available. Returns whether it started making one.

    Example:
        >>> prepare_ready(1 << 20) in (True, False)
        True
    """
    return _READY.prepare(capacity, ready=ready)


def clear_spare() -> None:
    """Drop the kept spare mapping and the ready one: their memory is returned (after its release hooks)."""
    _SPARE.clear()
    _READY.clear()


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
    worker a copy queued from the earlier arena may still be reading it: ``integration._compat.kept_host_arena``
    takes such arenas and, whenever ``reused`` is true, waits for the GPU's queued copies before handing it out.

    With ``ready``, the arena may be given the mapping [`prepare_ready`] made: never used, its pages touched
    (zeros), pinned only if its preparer pinned it, so it is as clean as fresh memory and any build may take
    it (``prepared`` is then true). Its memory is returned, not kept, once released.

    Example:
        >>> arena = HostArena(1 << 20)
        >>> t = arena.empty((4, 8), torch.bfloat16)
        >>> arena.holds(t), arena.used
        (True, 64)
    """

    def __init__(self, capacity: int, *, huge_pages: bool = True, reuse: bool = False, ready: bool = False,
                 _keep_in: _Spare | None = None) -> None:
        wanted = _pages(capacity)
        memory = None
        if _keep_in is None and reuse:
            memory = _SPARE.take(wanted)
        self.reused = memory is not None  # kept from an earlier arena (its pages taken, pinned if they were)
        if _keep_in is None and ready and not reuse:
            memory = _READY.take(wanted)
        self.prepared = memory is not None and not self.reused  # made ready, never used (zeros; pinned if it was)
        if memory is None:
            memory = _Memory(wanted, huge_pages)
        self.memory: _Memory | None = memory
        self.wanted = wanted  # the capacity asked for, in whole huge pages (what a like build will ask for)
        self.capacity = memory.capacity
        lease = _lease_type(memory.capacity).from_address(memory.base)
        lease.memory, lease.keep_in = memory, (_keep_in or (_SPARE if reuse else None))
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
