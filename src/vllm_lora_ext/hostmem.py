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
"""

from __future__ import annotations

import logging
import math
import mmap
import threading
from collections.abc import Callable
from functools import lru_cache
from typing import Any

import torch

__all__ = ["ALIGN", "HUGE_PAGE", "HostArena", "aligned", "bump_empty", "huge_pages_offered"]

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


class _Mapping(mmap.mmap):
    """An anonymous mapping that runs its release hooks before it is unmapped (``mmap``'s own dealloc unmaps)."""

    hooks: list[Callable[[], None]]

    def __del__(self) -> None:
        for hook in getattr(self, "hooks", ()):
            try:
                hook()
            except Exception:  # a hook's failure must not leak the mapping or reach an arbitrary thread's caller
                logger.exception("a host arena's release hook failed")


class HostArena:
    """A bump allocator over one anonymous mapping, advised to use transparent huge pages.

    Tensors from [`empty`] are views of the mapping; the memory is returned when the arena is closed and the
    last view is gone. Pages are only taken as tensors are written, so an upper bound is a fine capacity.
    Memory past the capacity comes from ordinary tensors. Thread-safe (MoE blocks are read on several threads).

    Example:
        >>> arena = HostArena(1 << 20)
        >>> t = arena.empty((4, 8), torch.bfloat16)
        >>> arena.holds(t), arena.used
        (True, 64)
    """

    def __init__(self, capacity: int, *, huge_pages: bool = True) -> None:
        self.capacity = max(HUGE_PAGE, -(-int(capacity) // HUGE_PAGE) * HUGE_PAGE)
        mapping = _Mapping(-1, self.capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.hooks = []
        if huge_pages and huge_pages_offered():
            try:
                mapping.madvise(mmap.MADV_HUGEPAGE)
            except OSError:  # refused (e.g. a seccomp filter): ordinary pages, still one range
                pass
        self._mapping: _Mapping | None = mapping
        self.buffer: torch.Tensor | None = torch.frombuffer(mapping, dtype=torch.uint8)
        self.base = self.buffer.data_ptr()
        self.used = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in the arena (or, once it is full or closed, an ordinary one)."""
        return bump_empty(self, shape, dtype)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this arena's memory."""
        return t.device.type == "cpu" and self.base <= t.data_ptr() < self.base + self.capacity

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when the memory is returned: after [`close`] and the last view, before the unmap."""
        if self._mapping is None:
            raise RuntimeError("the host arena is closed")
        self._mapping.hooks.append(hook)

    def close(self) -> None:
        """Give no more memory; the mapping lives on as long as any tensor from it does."""
        with self._lock:
            self.buffer = None
            self._mapping = None
