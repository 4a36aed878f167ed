"""The hand-over of a built adapter from a build process to the worker: one shared file and its manifest.

[`to_shared`] (in the build process) puts a [`BuiltAdapter`]'s tensors in one file, leaving those already built
in its [`SharedArena`] where they are; [`from_shared`] (in the worker) maps the file, removes its name, and returns
the adapter whose tensors are views of the mapping, with no copy. Dtypes travel by their safetensors name
([`reader.DTYPES`]). See the package docstring for where this sits in an adapter's life.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import Any

import torch

from vllm_lora_ext.building import BuiltAdapter
from vllm_lora_ext.errors import AdapterFormatError
from vllm_lora_ext.headers import safetensors_names, torch_dtype_of
from vllm_lora_ext.transport.arena import aligned
from vllm_lora_ext.transport.files import owned_name, shared_dir

__all__ = ["SharedTensors", "from_shared", "to_shared", "trim_shared", "view_at"]



@dataclass(frozen=True)
class SharedTensors:
    """A [`BuiltAdapter`] whose tensors lie in one file (in ``/dev/shm`` where it fits): the file and a manifest.

    ``entries`` lists ``(group, name, index, dtype, shape, offset)`` for every tensor; ``group`` is
    ``"dense"``, ``"a"`` or ``"b"``, ``dtype`` its safetensors name (``"BF16"``). The rest of the adapter
    travels as ``meta`` (picklable).
    """

    path: str
    size: int
    entries: tuple[tuple[str, str, int, str, tuple[int, ...], int], ...]
    meta: BuiltAdapter  # with empty tensor maps; ranks of MoE blocks kept in ``moe``


def _dtype_name(t: torch.Tensor, built: BuiltAdapter, name: str) -> str:
    found = safetensors_names().get(t.dtype)
    if found is None:
        raise AdapterFormatError(f"Adapter {built.identity!r}: tensor {name!r} has dtype {t.dtype}, which no "
                                 f"safetensors dtype names, so it cannot be handed over. Re-save the adapter in "
                                 f"bfloat16, float16 or float32.", adapter=built.identity, key=name)
    return found


def to_shared(built: BuiltAdapter, *, trim: bool = True) -> SharedTensors:
    """Put ``built``'s tensors in one shared file and describe it; the caller of [`from_shared`] removes it.

    Tensors already in ``built.arena`` stay where they are; the others are appended to its file (or to a
    new one). The file is cut to the size used; with ``trim=False`` a larger arena file is left as is, and
    the caller cuts it after the hand-over ([`trim_shared`]), so that freeing the unused pages does not
    delay it.

    Raises:
        OSError: the file cannot be created or filled (no space); nothing is left behind.
        [`AdapterFormatError`]: a tensor's dtype has no safetensors name (checked before any file is made).
    """
    items: list[tuple[str, str, int, torch.Tensor]] = [("dense", k, 0, t) for k, t in built.dense.items()]
    for prefix, (lora_a, lora_b, _) in built.moe.items():
        items += [("a", prefix, i, t) for i, t in enumerate(lora_a)]
        items += [("b", prefix, i, t) for i, t in enumerate(lora_b)]
    names = [_dtype_name(t, built, name) for _, name, _, t in items]
    arena = built.arena
    size = aligned(arena.used) if arena is not None else 0
    writes: list[tuple[int, Any]] = []
    entries = []
    for (group, name, index, t), dtype in zip(items, names):
        off = arena.offset_of(t) if arena is not None and t.nbytes else None
        if off is None:
            off = size
            size += aligned(t.nbytes)
            if t.nbytes:
                writes.append((off, t.contiguous().view(-1).view(torch.uint8).numpy()))
        entries.append((group, name, index, dtype, tuple(t.shape), off))
    if arena is not None:
        assert arena.path is not None, "a build's hand-over arena is a shared file"
        path = arena.path
        arena.close()
        fd = os.open(path, os.O_RDWR)
    else:
        path = owned_name(shared_dir(size))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Written with pwrite, not through a mapping: running out of space is an OSError rather than
        # SIGBUS, and up to 4 threads copy in parallel.
        if trim or arena is None or size > arena.capacity:
            os.ftruncate(fd, max(size, 1))
        if writes:
            with ThreadPoolExecutor(min(4, len(writes))) as pool:
                for _ in pool.map(lambda job: _pwrite_all(fd, job[1], job[0]), writes):
                    pass
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    # (every other field travels as it is: the arenas are this process's, the tensors the manifest's)
    meta = replace(built, dense={}, moe={p: ([], [], r) for p, (_, _, r) in built.moe.items()}, arena=None, host=None)
    return SharedTensors(path, size, tuple(entries), meta)


def trim_shared(fd: int, shared: SharedTensors) -> None:
    """Cut a file handed over with ``trim=False`` to its used size (its unused pages are freed); closes ``fd``."""
    try:
        if os.fstat(fd).st_size > max(shared.size, 1):
            os.ftruncate(fd, max(shared.size, 1))
    finally:
        os.close(fd)


def _pwrite_all(fd: int, data: Any, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def from_shared(shared: SharedTensors) -> tuple[BuiltAdapter, torch.Tensor]:
    """Map a shared file, remove its name, and return the adapter whose tensors are views of it, and the mapping.

    The memory lives as long as any of the tensors (or the returned ``uint8`` mapping) does.
    """
    try:
        buf = torch.from_file(shared.path, shared=True, size=max(shared.size, 1), dtype=torch.uint8)
    finally:
        os.unlink(shared.path)
    meta = shared.meta
    dense: dict[str, torch.Tensor] = {}
    moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {
        p: ([], [], r) for p, (_, _, r) in meta.moe.items()}
    for group, name, index, dtype, shape, off in shared.entries:
        t = view_at(buf, off, torch_dtype_of(dtype), shape)
        if group == "dense":
            dense[name] = t
        else:
            lora_a, lora_b, _ = moe[name]
            target = lora_a if group == "a" else lora_b
            assert len(target) == index, "manifest out of order"
            target.append(t)
    return replace(meta, dense=dense, moe=moe), buf


def view_at(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """The ``dtype`` tensor of ``shape`` at byte ``offset`` of ``buf`` (``uint8``, contiguous), a view of it."""
    return buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
