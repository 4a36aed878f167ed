"""Arenas: the memory a build's tensors are made in, as views of one mapping, 64-byte aligned.

One [`Arena`] type, two backings chosen at construction. [`HostArena`] (``Arena.anonymous``): an anonymous
mapping on transparent huge pages, for builds in the worker; its memory is returned when the last view is gone.
[`SharedArena`] (``Arena.in_file``): a new file (in ``/dev/shm`` where it fits), for builds in a build process,
whose tensors are then handed over without a copy (``transport.handover``). Each keeps one spare for the next
arena, by the one spare policy below ([`Spare`]): the process's anonymous mapping ([`prepare_spare`], and memory
kept once released), and per build process a file with its pages taken (on a tmpfs, mapped too: [`ArenaSupply`]).

Reading an adapter from the page cache into fresh memory costs more in page faults than in copying (a page is
faulted, zeroed and mapped before the read fills it): a 1.6 GB read on 4 threads takes about four times as long
into ``torch.empty`` memory as into memory touched before, and twice as long into memory advised
``MADV_HUGEPAGE`` (``bench/probe_host_memory.py``), which a [`HostArena`] is. An arena is also one contiguous
range, which a GPU worker pins in place in one call (``cudaHostRegister``: for 1.6 GB of huge pages, a seventh of
vLLM's ``pin_memory()`` copy); hooks given to [`Arena.on_release`] run when the last view is gone and before the
unmap, where it is undone (``transport.cuda`` pins; this module has no CUDA code). A mix's composite, rebuilt for
every new set of weights, may take a mapping kept ready ([`prepare_spare`]) or kept once released (``reuse``).
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
from typing import Any, Generic, Protocol, TypeVar

import torch

from vllm_lora_ext.constants import build_dir, host_spare_bytes
from vllm_lora_ext.sharedfiles import reserve_when_tight
from vllm_lora_ext.transport.files import SHARED_PREFIX, map_for_writing, owned_name, shared_dir

__all__ = ["ALIGN", "HUGE_PAGE", "Arena", "ArenaSupply", "HostArena", "SharedArena", "Spare", "aligned", "clear_spare",
           "huge_pages_offered", "prepare_spare"]

logger = logging.getLogger(__name__)


# ------------------------------------------------------------------------------------------------ the spare policy
# At most one piece of memory kept ready for the next arena that fits it: fresh memory costs an arena page faults
# (a page allocated and zeroed per 4 KiB written) and, on a GPU worker, a registration; kept memory neither. Both
# kinds of arena keep one spare this way: the process's anonymous mapping, and a build process's shared file.

class _Sized(Protocol):
    @property
    def capacity(self) -> int: ...


K = TypeVar("K", bound=_Sized)


class Spare(Generic[K]):
    """At most one piece of memory (``K``, with a ``capacity``) kept for the next arena that fits it.

    It is made ahead, its pages taken, on a background thread ([`start`]), or kept once an arena is done with
    it ([`keep`]). It is handed out once ([`take`]), to an arena that needs at most its capacity and, given
    ``slack``, at least its capacity less ``slack(needed)`` (a small arena then does not hold on to a large
    spare). A newer one replaces it, and the older is let go (``let_go``); [`clear`] lets it go, and with
    ``close`` nothing is kept afterwards (one still being made is let go when it is done). ``taken`` counts the
    arenas it served. Thread-safe.
    """

    def __init__(self, *, slack: Callable[[int], int] | None, let_go: Callable[[K], object]) -> None:
        self._slack = slack
        self._let_go = let_go
        self._lock = threading.RLock()  # re-entrant: a host arena's memory may come back (the GC) under it
        self._kept: K | None = None
        self._preparing = False
        self._closed = False
        self._thread: threading.Thread | None = None
        self.taken = 0

    def fits(self, needed: int, kept: _Sized) -> bool:
        """Whether ``kept`` may serve an arena of ``needed`` bytes."""
        return needed <= kept.capacity and (self._slack is None or kept.capacity <= needed + self._slack(needed))

    def take(self, needed: int) -> K | None:
        """The kept spare, if it [`fits`] ``needed`` (it is no longer kept then)."""
        with self._lock:
            kept = self._kept
            if kept is None or not self.fits(needed, kept):
                return None
            self._kept = None
            self.taken += 1
            return kept

    def keep(self, item: K) -> None:
        """Keep ``item`` as the spare, letting the one kept before go (or ``item`` itself, once closed)."""
        with self._lock:
            if self._closed:
                old: K | None = item
            else:
                old, self._kept = self._kept, item
        if old is not None:
            self._let_go(old)  # outside the lock

    def start(self, size: int, make: Callable[[int], K | None], *, wait: bool = False, name: str) -> bool:
        """Run ``make(size)`` on a thread named ``name`` (here with ``wait``) and keep what it returns, unless a spare
        that fits ``size`` is kept or one is being made, or the spare is closed. Returns whether it started."""
        with self._lock:
            kept = self._kept
            if self._closed or self._preparing or (kept is not None and self.fits(size, kept)):
                return False
            self._preparing = True
        if wait:
            self._make(size, make)
        else:
            self._thread = threading.Thread(target=self._make, args=(size, make), name=name, daemon=True)
            self._thread.start()
        return True

    def join(self, timeout: float) -> None:
        """Wait at most ``timeout`` s for a spare being made: a process that exits while the thread is inside torch
        can abort (``terminate called without an active exception``)."""
        thread = self._thread
        if thread is not None:
            thread.join(timeout)

    def _make(self, size: int, make: Callable[[int], K | None]) -> None:
        try:
            item = make(size)
            if item is not None:
                self.keep(item)
        finally:
            with self._lock:
                self._preparing = False

    def clear(self, *, close: bool = False) -> None:
        """Let the kept spare go; with ``close``, keep none from now on."""
        with self._lock:
            old, self._kept = self._kept, None
            self._closed = self._closed or close
        if old is not None:
            self._let_go(old)

    def forget(self) -> K | None:
        """After a fork, in the child: keep nothing and make nothing (the parent's thread making one does not exist
        here), and return what was kept, unreleased, for the caller to disown."""
        kept, self._kept = self._kept, None
        self._preparing = False
        self._lock = threading.RLock()
        return kept

HUGE_PAGE = 2 << 20  # the x86-64 and arm64 (4 KiB base pages) transparent huge page
ALIGN = 64  # every tensor in an arena (host or shared file) starts on a 64-byte boundary: any dtype's view is aligned


def aligned(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to`` ([`ALIGN`] unless given).

    Example:
        >>> aligned(1), aligned(64), aligned(65), aligned(65, 256)
        (64, 64, 128, 256)
    """
    return -(-n // to) * to


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


class _HostSpare(Spare[_Memory]):
    """The process's spare anonymous mapping: released (or prepared) memory kept for the next ``reuse`` arena of
    about its size (at most half again, or one huge page, larger), its pages taken and pinned if they were, which
    spares an arena page faults (about half a fresh arena's fill time) and a registration. Released arenas' memory
    is kept up to ``VLLM_LORA_EXT_HOST_SPARE_BYTES``; one mapping at a time, the latest (the one it replaces is
    dropped: hooks, then the unmap)."""

    def __init__(self) -> None:
        super().__init__(slack=lambda needed: max(needed // 2, HUGE_PAGE), let_go=lambda memory: None)

    @property
    def _memory(self) -> _Memory | None:  # the kept mapping
        return self._kept

    @property
    def reused(self) -> int:  # arenas given a kept mapping (tests, logs)
        return self.taken

    def returned(self, memory: _Memory) -> None:
        """Keep ``memory`` (an arena's, whose last view is gone) as the spare if it fits the budget; dropped (its
        hooks run and it is unmapped, unless something still holds it) otherwise, or when displaced.

        No tensor views it any more, but a GPU copy queued from it may still be reading it (vLLM's slot copy of
        an adapter it has just evicted). On a GPU worker kept memory is taken through
        ``transport.cuda.kept_host_arena``, which waits for the GPU's queued copies first."""
        if memory.capacity <= host_spare_bytes():
            self.keep(memory)

    def prepare(self, capacity: int, ready: Callable[[Arena], object] | None) -> bool:
        """Make a spare of ``capacity`` bytes on a background thread, its pages touched and ``ready(arena)`` run
        over it (pinning, where a GPU worker asks), unless one that fits is kept or being made, or it would
        exceed the budget. Returns whether it started one."""
        capacity = _pages(capacity)
        if capacity > host_spare_bytes():
            return False
        return self.start(capacity, lambda size: _touched_spare(size, ready), name="vllm-lora-ext-host-spare")


def _touched_spare(capacity: int, ready: Callable[[Arena], object] | None) -> None:
    """An arena's mapping with every page touched and ``ready`` run over it, left to become the spare."""
    try:
        arena = Arena.anonymous(capacity, reuse=True, _take=False)
        assert arena.buffer is not None
        arena.buffer[::4096].zero_()  # fault every page in here, off the path of the arena that takes it
        arena.used = arena.capacity
        if ready is not None:
            ready(arena)
        arena.close()  # its lease ends here: the mapping becomes the spare ([`_HostSpare.returned`])
    except Exception:  # no memory, most likely: arenas are made as they come, as without a spare
        logger.exception("could not prepare a spare host arena of %d bytes", capacity)


_SPARE = _HostSpare()


def _forget_spare_in_child() -> None:
    """After a fork: the child starts with no spare and no preparation under way, and never undoes the parent's
    registration of a kept mapping (its hooks are dropped)."""
    memory = _SPARE.forget()
    if memory is not None:
        memory.hooks.clear()


os.register_at_fork(after_in_child=_forget_spare_in_child)


def prepare_spare(capacity: int, *, ready: Callable[[Arena], object] | None = None) -> bool:
    """Have a host arena of ``capacity`` bytes ready for the next build of that size (see [`_HostSpare.prepare`])."""
    return _SPARE.prepare(capacity, ready)


def clear_spare() -> None:
    """Drop the kept spare mapping: its memory is returned (after its release hooks)."""
    _SPARE.clear()


def _pages(capacity: int) -> int:
    return max(HUGE_PAGE, -(-int(capacity) // HUGE_PAGE) * HUGE_PAGE)


class Arena:
    """A bump allocator over one mapping: [`empty`] gives views of it, each 64-byte aligned, and ordinary tensors
    once it is full or closed. Pages are only taken as tensors are written, so an upper bound is a fine capacity.
    Thread-safe (MoE blocks are read on several threads). Made by [`anonymous`] (alias [`HostArena`]) or
    [`in_file`] (alias [`SharedArena`]).

    Example:
        >>> arena = HostArena(1 << 20)
        >>> t = arena.empty((4, 8), torch.bfloat16)
        >>> arena.holds(t), arena.used
        (True, 64)
    """

    def __init__(self, buffer: torch.Tensor, *, path: str | None = None, memory: _Memory | None = None,
                 reused: bool = False) -> None:
        self.buffer: torch.Tensor | None = buffer
        self.capacity = int(buffer.numel())
        self.base = buffer.data_ptr()
        self.path = path  # the shared file (``in_file``), else None
        self.memory = memory  # the anonymous mapping (``anonymous``), until closed
        self.reused = reused  # kept from an earlier arena (its pages taken, pinned if they were)
        self.used = 0
        self._lock = threading.Lock()

    @classmethod
    def anonymous(cls, capacity: int, *, huge_pages: bool = True, reuse: bool = False, _take: bool = True) -> Arena:
        """An arena over one anonymous mapping of whole huge pages, advised to use transparent huge pages; its
        memory is released when the arena is closed and the last view is gone.

        With ``reuse``, the arena may be given the kept spare mapping ([`prepare_spare`], or an earlier ``reuse``
        arena's memory), pages already taken and still pinned, and its own memory is kept as the spare once
        released (up to ``VLLM_LORA_EXT_HOST_SPARE_BYTES``). Such memory holds an earlier arena's bytes, not
        zeros: only a caller that writes every byte it reads may ask for it (a mix's concatenation does). On a GPU
        worker a copy queued from the earlier arena may still be reading it: ``transport.cuda.kept_host_arena``
        takes such arenas and, whenever ``reused`` is true, waits for the GPU's queued copies before handing it out.
        """
        wanted = _pages(capacity)
        memory = _SPARE.take(wanted) if reuse and _take else None
        reused = memory is not None
        if memory is None:
            memory = _Memory(wanted, huge_pages)
        lease = _lease_type(memory.capacity).from_address(memory.base)
        lease.memory, lease.keep = memory, reuse
        return cls(torch.frombuffer(lease, dtype=torch.uint8), memory=memory, reused=reused)

    @classmethod
    def in_file(cls, capacity: int, directory: str | None = None, *, populate: bool = False) -> Arena:
        """An arena over one new shared file in ``directory`` (default [`shared_dir`]), named for this process's
        owner lock there: tensors built in it are handed over without a copy.

        The file is sparse: pages are only taken as tensors are written, unless its folder is nearly full (then
        all are taken at once, or ``OSError``) or ``populate`` asks for them now (a spare).
        """
        capacity = max(int(capacity), 1)
        path = owned_name(directory or shared_dir(capacity), "spare-" if populate else "")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, capacity)
            if populate:  # take every page now: a write then costs a copy, not an allocation and zeroing
                os.posix_fallocate(fd, 0, capacity)
            else:  # sparse, unless the folder is nearly full: then no write through the mapping can meet ENOSPC
                reserve_when_tight(fd, os.path.dirname(path), capacity, prefix=SHARED_PREFIX)
            buffer = torch.from_file(path, shared=True, size=capacity, dtype=torch.uint8)
            if populate:
                map_for_writing(buffer, path)
        except BaseException:
            os.unlink(path)
            raise
        finally:
            os.close(fd)
        return cls(buffer, path=path)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in the arena (or, once it is full or closed, an ordinary one)."""
        n = math.prod(shape) * dtype.itemsize
        with self._lock:
            offset = self.used
            buffer = self.buffer
            if buffer is None or offset + n > self.capacity:
                return torch.empty(shape, dtype=dtype)
            self.used = offset + aligned(n)
        return buffer[offset:offset + n].view(dtype).view(shape)

    def holds(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a view of this arena's memory."""
        return t.device.type == "cpu" and self.base <= t.data_ptr() < self.base + self.capacity

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of a contiguous tensor that lies in the (open) arena, else ``None``."""
        if self.buffer is None or not t.is_contiguous() or t.untyped_storage().data_ptr() != self.base:
            return None
        return t.data_ptr() - self.base

    def on_release(self, hook: Callable[[], None]) -> None:
        """Run ``hook`` when an anonymous arena's memory is returned: after [`close`] and the last view, before the
        unmap (later, if the memory is kept as the spare first)."""
        if self.memory is None:
            raise RuntimeError("the host arena is closed" if self.path is None else "a shared-file arena has no hooks")
        self.memory.hooks.append(hook)

    def close(self) -> None:
        """Give no more memory; the mapping lives on as long as any tensor from it does (a shared file stays for
        its receiver)."""
        with self._lock:
            self.buffer = None
            self.memory = None

    def discard(self) -> None:
        """Close, and remove a shared arena's file (a failed build)."""
        self.close()
        if self.path is not None:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass


HostArena = Arena.anonymous
SharedArena = Arena.in_file


class ArenaSupply(Spare[Arena]):
    """Hands out shared-file arenas ([`SharedArena`]) and keeps one spare ready, its pages taken and mapped.

    Writing a fresh ``/dev/shm`` file allocates, zeroes and maps a page per 4 KiB written; into the spare (pages
    allocated, and in ``/dev/shm`` mapped for writing) a build's reads run at the speed of touched memory. A build
    process takes the spare (when it is large enough) and calls [`prepare`] for the next once the build is
    answered, while it is idle. The spare is at least ``spare_bytes`` and grows to the largest arena asked for, up to
    twice ``spare_bytes``; ``spare_bytes=0`` keeps none. ``to_shared`` gives back the pages a build did not use.
    """

    def __init__(self, spare_bytes: int, directory: str | None = None) -> None:
        super().__init__(slack=None, let_go=Arena.discard)
        self.spare_bytes = max(0, int(spare_bytes))
        self.directory = directory
        self._largest = self.spare_bytes

    @property
    def _spare(self) -> Arena | None:  # the spare file's arena
        return self._kept

    def take(self, needed: int) -> Arena:
        """An arena of at least ``needed`` bytes: the spare if it is large enough, else a new sparse one."""
        with self._lock:
            self._largest = min(max(self._largest, int(needed)), 2 * self.spare_bytes)
        spare = super().take(needed)
        return spare if spare is not None else Arena.in_file(needed, self.directory)

    def prepare(self, *, wait: bool = False) -> None:
        """Make the next spare on a background thread (at once with ``wait``), unless one is ready or coming."""
        with self._lock:
            size = self._largest
        if self.spare_bytes:
            self.start(size, self._make_file, wait=wait, name="vllm-lora-ext-spare")

    def _make_file(self, size: int) -> Arena | None:
        try:  # a spare on disk (no room in /dev/shm, no directory set) would only add writes: keep none then
            directory = self.directory or shared_dir(size)
            if directory == "/dev/shm" or self.directory or build_dir():
                return Arena.in_file(size, directory, populate=True)
        except Exception:  # no room, or anything else: builds use sparse files as before
            pass
        return None

    def discard(self) -> None:
        """Remove the spare (the process is ending) once any being made is done; none is kept from now on."""
        self.spare_bytes = 0
        self.clear(close=True)
        self.join(60.0)
