"""Build an adapter's tensors for a running model, as plain data: the part of a load that needs no vLLM object.

A load is: resolve the source, read its config and header, plan every key against the model
([`plan_adapter`]), read the kept bytes, check them, and pack MoE blocks into the layout vLLM's MoE
LoRA wrappers store. [`build_adapter`] does all of that from a picklable [`BuildJob`] and returns a
[`BuiltAdapter`]: dense factors by key, MoE factor lists by block. The worker then only wraps these
tensors in vLLM's objects. Because nothing here needs vLLM's objects, a build can run in a separate
process ([`to_shared`] / [`from_shared`] hand the tensors over in one shared-memory file, without a
copy on the receiving side), away from the engine thread's GIL.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import shutil
import tempfile
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from vllm_lora_ext._util import gc_paused
from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.constants import ENV_BUILD_DIR, host_arena_min_bytes, host_arenas_enabled, max_lora_rank_for
from vllm_lora_ext.diskholds import holding  # a build's revision is never evicted under it (issue 41)
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.formats import classify_key
from vllm_lora_ext.formats.moe import Alloc, ExpertsLoRA, MoESpec, read_blocks
from vllm_lora_ext.planning import KeyRouter, ModelSpec, plan_adapter
from vllm_lora_ext.reader import DictSource, ReadStats, SafetensorsReader, load_pickle_tensors
from vllm_lora_ext.resolve import confining_roots
from vllm_lora_ext.sharedfiles import claim_owner, reserve_when_tight, sweep_dead_owners
from vllm_lora_ext.sources import parse_source, resolve_source
from vllm_lora_ext.summary import load_config
from vllm_lora_ext.transport.arena import ALIGN, HostArena, aligned, bump_empty
from vllm_lora_ext.validation import check_finite

__all__ = ["ArenaSupply", "BuildJob", "BuiltAdapter", "SharedArena", "SharedTensors", "build_adapter", "from_shared",
           "pack_block", "to_shared", "trim_shared"]

Wrapper = Literal["2d", "3d"]


@dataclass(frozen=True)
class BuildJob:
    """Everything one build needs, as picklable data.

    Attributes:
        path: the adapter source (already pinned by the server).
        name: the adapter's name, for messages.
        model: the running model as [`ModelSpec`] (this rank's experts included).
        wrappers: per MoE block, the form vLLM's wrapper takes: ``"2d"`` (``[w1, w2, w3]``) or ``"3d"`` (``[w13, w2]``).
        moe_error: why the model's MoE blocks cannot take LoRA, raised only if the adapter has MoE keys.
        dtype: the dtype MoE factors are built in (``--lora-dtype``), or ``None`` for the adapter's own.
        allow_unmatched: drop (rather than refuse) keys that match no module.
    """

    path: str
    name: str
    model: ModelSpec
    wrappers: Mapping[str, Wrapper] = field(default_factory=dict)
    moe_error: str | None = None
    dtype: torch.dtype | None = None
    allow_unmatched: bool = False


@dataclass
class BuiltAdapter:
    """A built adapter: its config and the tensors the model takes, before any vLLM object wraps them.

    Attributes:
        identity: the resolved source (pinned commit or absolute path).
        config: the adapter's validated config.
        dense: dense factors by checkpoint key, in file order.
        moe: per MoE block, vLLM's factor lists ``(lora_a, lora_b)`` with scaling folded in, and their rank.
        bytes_read: weight and header bytes read from disk.
        layouts: the MoE layouts the adapter was saved in (``"2d"``, ``"3d"``, ...).
        arena: the shared file the MoE factors were built in (a build process's builds).
        host: the huge-page host arena the tensors were read into (builds in the worker), which the worker
            pins in place; closed (``host.close()``) once nothing more is allocated from it.
        turned_on_gpu: fused 3D factors transposed and scaled on the worker's GPU (``transpose_on``).
    """

    identity: str
    config: AdapterConfig
    dense: dict[str, torch.Tensor]
    moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]]
    bytes_read: int = 0
    layouts: tuple[str, ...] = ()
    arena: SharedArena | None = None
    host: HostArena | None = None
    turned_on_gpu: int = 0


def build_adapter(job: BuildJob, router: KeyRouter, *, shared: bool = False,
                  arenas: ArenaSupply | None = None, transpose_on: torch.device | None = None) -> BuiltAdapter:
    """Resolve, plan, read, check and pack ``job``'s adapter for the model it describes.

    With ``shared``, MoE factors are built straight into a [`SharedArena`] (``built.arena``, from
    ``arenas`` if given), which [`to_shared`] then hands over without copying them again. With a CUDA
    ``transpose_on`` (the worker's GPU), a fused 3D B is transposed and scaled there
    ([`SafetensorsReader.read_transposed`]): the same tensors, bit for bit.

    Raises:
        [`AdapterNotFoundError`]: the source does not exist.
        [`AdapterSourceError`], [`AdapterFormatError`], [`UnmatchedKeysError`], [`ExpertLayoutError`]:
            the adapter is malformed or does not fit the model (the message names the key and the fix).
        [`AdapterCompatibilityError`]: a rank exceeds ``max_lora_rank``, or the model's MoE blocks cannot take LoRA.
    """
    with gc_paused(), holding(parse_source(job.path), why=f"build of adapter {job.name!r}"):  # gc: ~10^5 objects
        return _build_adapter(job, router, shared=shared, arenas=arenas, transpose_on=transpose_on)


def _build_adapter(job: BuildJob, router: KeyRouter, *, shared: bool, arenas: ArenaSupply | None,
                   transpose_on: torch.device | None = None) -> BuiltAdapter:
    """See [`build_adapter`]."""
    resolved = resolve_source(job.path)
    roots = confining_roots(resolved)  # a local source inside an allowed root: held to the roots on every build
    known = resolved.config_path is not None or resolved.is_pickle
    config = load_config(resolved, name=job.name, roots=roots) if known else None
    stats = ReadStats()  # below: the header, an inferred config and every tensor from one open file (one snapshot)
    source: Any = (DictSource(load_pickle_tensors(resolved.weights_path, roots=roots)) if resolved.is_pickle
                   else SafetensorsReader(resolved.weights_path, stats=stats, roots=roots))
    with contextlib.closing(source):
        # (an inferred config: from the header the tensors are read with)
        config = config or load_config(resolved, name=job.name, header=source.header)
        if resolved.is_pickle:
            shapes, dtypes = {k: tuple(v.shape) for k, v in source.tensors.items()}, None
        else:
            shapes, dtypes = source.header.shapes, source.header.dtypes
        if job.moe_error is not None and any(classify_key(k).kind in ("moe_2d", "moe_3d") for k in shapes):
            raise AdapterCompatibilityError(job.moe_error, adapter=job.name)
        plan = plan_adapter(shapes, config, job.model, router=router, dtypes=dtypes, name=job.name,
                            identity=resolved.identity, allow_unmatched=job.allow_unmatched)
        arena = None
        host = None
        if shared and plan.moe:
            need = _stacked_bytes(plan.moe, shapes, job)
            arena = arenas.take(need) if arenas is not None else SharedArena(need)
        elif not shared and host_arenas_enabled() and not resolved.is_pickle:
            need = _dense_bytes(plan.dense_keys, source.header.nbytes) + (_stacked_bytes(plan.moe, shapes, job)
                                                                          if plan.moe else 0)
            if need >= host_arena_min_bytes():
                host = HostArena(need)
        alloc = arena.empty if arena is not None else host.empty if host is not None else None
        try:
            if host is not None:  # read straight into the arena: each tensor a view of its span there
                dense = source.read_many(plan.dense_keys, into=host.empty)
            else:
                dense = source.read_many(plan.dense_keys, copy=True)
            check_finite(dense, adapter=job.name)
            blocks = read_blocks(plan.moe, source.read, config=config, dtype=job.dtype,
                                 experts={p: job.model.local_experts.get(p) for p in plan.moe},
                                 read_many=lambda keys: source.read_many(keys, copy=False), check_finite_as=job.name,
                                 alloc=alloc, read_stacks=getattr(source, "read_stacks", None),
                                 fused_gate_up={p: job.wrappers.get(p, "2d") == "3d" for p in plan.moe},
                                 gather=getattr(source, "gather", None),
                                 read_transposed=_transposer(source, transpose_on))
            moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}
            for prefix, experts in blocks.items():
                moe[prefix] = pack_block(experts, job.model.moe[prefix], job.wrappers.get(prefix, "2d"),
                                         max_rank=job.model.max_rank, adapter=job.name, alloc=alloc)
            del blocks
            if not resolved.is_pickle:  # written over in place meanwhile: refused (replaced: never read)
                source.check_unchanged()
        except BaseException:
            if arena is not None:
                arena.discard()
            if host is not None:
                host.close()
            raise
        layouts = tuple(sorted({p.layout for p in plan.moe.values()}))
        return BuiltAdapter(resolved.identity, config, dense, moe, stats.bytes_read, layouts, arena, host,
                            stats.turned_on_gpu)


def _transposer(source: Any, device: torch.device | None) -> Any:
    """The source's ``read_transposed``, on ``device`` where that is a GPU."""
    read_transposed = getattr(source, "read_transposed", None)
    if read_transposed is None or device is None or device.type != "cuda":
        return read_transposed
    return functools.partial(read_transposed, device=device)


def _dense_bytes(keys: list[str], nbytes: Mapping[str, int]) -> int:
    """The bytes of the dense tensors read into a host arena, each span's start aligned."""
    return sum(aligned(nbytes[k]) for k in keys) + ALIGN * len(keys)


def _stacked_bytes(plans: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], job: BuildJob) -> int:
    """An upper bound on the bytes of the MoE factors kept on this rank, in the dtype they are built in (at most
    4 bytes an element); the file is sparse, so what is not written takes no memory."""
    itemsize = job.dtype.itemsize if job.dtype is not None else 4

    def size(key: str, share: float = 1.0) -> int:
        return aligned(int(math.prod(shapes[key]) * share) * itemsize) + ALIGN

    total = 0
    for prefix, plan in plans.items():
        keep = job.model.local_experts.get(prefix)
        kept = None if keep is None else set(keep)
        for k in plan.keys_2d:
            if kept is None or k.expert in kept:
                total += size(k.key_a) + size(k.key_b)
        share = 1.0 if keep is None else len(keep) / max(1, job.model.moe[prefix].num_experts)
        for k3 in plan.keys_3d:
            total += size(k3.key_a, share) + size(k3.key_b, share)
    return total


class SharedArena:
    """A bump allocator over one new shared file: tensors built in it are handed over without a copy.

    Memory past ``capacity`` is allocated as ordinary tensors (copied at hand-over). The file is sparse:
    pages are only taken as tensors are written, unless its folder is nearly full (then all are taken at once,
    or ``OSError``). Thread-safe (MoE blocks are read on several threads).
    """

    def __init__(self, capacity: int, directory: str | None = None, *, populate: bool = False) -> None:
        self.capacity = max(int(capacity), 1)
        tag = "spare-" if populate else ""
        self.path = _owned_name(directory or shared_dir(self.capacity), tag)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, self.capacity)
            if populate:  # take every page now: a write then costs a copy and a minor fault, not an allocation
                os.posix_fallocate(fd, 0, self.capacity)
            else:  # sparse, unless the folder is nearly full: then no write through the mapping can meet ENOSPC
                reserve_when_tight(fd, os.path.dirname(self.path), self.capacity)
            self.buffer: torch.Tensor | None = torch.from_file(self.path, shared=True, size=self.capacity,
                                                               dtype=torch.uint8)
        except BaseException:
            os.unlink(self.path)
            raise
        finally:
            os.close(fd)
        self.base = self.buffer.data_ptr()
        self.used = 0
        self._lock = threading.Lock()

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialized tensor in the arena (or, once it is full, an ordinary one)."""
        return bump_empty(self, shape, dtype)

    def offset_of(self, t: torch.Tensor) -> int | None:
        """The byte offset of a contiguous tensor that lies in the arena, else ``None``."""
        if self.buffer is None or not t.is_contiguous() or t.untyped_storage().data_ptr() != self.base:
            return None
        return t.data_ptr() - self.base

    def close(self) -> None:
        """Unmap the arena here (the file stays for the receiver)."""
        self.buffer = None

    def discard(self) -> None:
        """Unmap and remove the file (a failed build)."""
        self.buffer = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass


class ArenaSupply:
    """Hands out [`SharedArena`]s and keeps one spare ready, its pages already taken.

    Writing a fresh ``/dev/shm`` file allocates (and zeroes) a page per 4 KiB written: on the dev VM a
    1.2 GB write took 0.45-0.57 s that way against 0.28-0.31 s into pages taken beforehand (the speed of
    ordinary memory). A build process takes the spare instead (when it is large enough) and calls
    [`prepare`] for the next one once the build is answered, while it is idle (preparing during a build
    only competes with it). The spare is at least ``spare_bytes`` and grows to the largest arena asked
    for, up to twice ``spare_bytes``; ``spare_bytes=0`` keeps none. Its pages beyond what a build used
    are given back when [`to_shared`] cuts the file to its size.
    """

    def __init__(self, spare_bytes: int, directory: str | None = None) -> None:
        self.spare_bytes = max(0, int(spare_bytes))
        self.directory = directory
        self._lock = threading.Lock()
        self._spare: SharedArena | None = None
        self._preparing = False
        self._largest = self.spare_bytes
        self.taken = 0  # arenas handed out from a spare (tests, logs)

    def take(self, capacity: int) -> SharedArena:
        """An arena of at least ``capacity`` bytes: the spare if it is large enough, else a new sparse one."""
        with self._lock:
            self._largest = min(max(self._largest, int(capacity)), 2 * self.spare_bytes)
            spare = self._spare if self._spare is not None and self._spare.capacity >= capacity else None
            if spare is not None:
                self._spare = None
                self.taken += 1
        return spare if spare is not None else SharedArena(capacity, self.directory)

    def prepare(self, *, wait: bool = False) -> None:
        """Make the next spare on a background thread (at once with ``wait``), unless one is ready or coming."""
        with self._lock:
            if not self.spare_bytes or self._preparing or (self._spare is not None
                                                           and self._spare.capacity >= self._largest):
                return
            self._preparing = True
            size = self._largest
        if wait:
            self._make(size)
        else:
            threading.Thread(target=self._make, args=(size,), name="vllm-lora-ext-spare", daemon=True).start()

    def _make(self, size: int) -> None:
        arena: SharedArena | None = None
        try:  # a spare on disk (no room in /dev/shm, no directory set) would only add writes: keep none then
            directory = self.directory or shared_dir(size)
            if directory == "/dev/shm" or self.directory or os.environ.get(ENV_BUILD_DIR):
                arena = SharedArena(size, directory, populate=True)
        except Exception:  # no room, or anything else: builds use sparse files as before
            arena = None
        with self._lock:
            if not self.spare_bytes:  # discarded meanwhile: keep nothing
                old, arena = arena, None
            else:
                old, self._spare = self._spare, arena
            self._preparing = False
        if old is not None:
            old.discard()

    def discard(self) -> None:
        """Remove the spare (the process is ending)."""
        with self._lock:
            spare, self._spare, self.spare_bytes = self._spare, None, 0
        if spare is not None:
            spare.discard()


def pack_block(experts: ExpertsLoRA, spec: MoESpec, wrapper: Wrapper, *, max_rank: int, adapter: str,
               alloc: Alloc | None = None) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Return one MoE block in the form vLLM's wrapper stores (contiguous factor lists) and its rank.

    New tensors the form needs (a fused gate_up split for a 2D wrapper, separate gate and up fused for a 3D
    one) come from ``alloc``, if given.

    Raises:
        [`AdapterCompatibilityError`]: the block's rank exceeds ``max_rank`` (names the flag to set).
    """
    if wrapper == "3d":
        lora_a, lora_b = experts.as_3d(hidden=spec.hidden, alloc=alloc)
    else:
        lora_a, lora_b = experts.as_2d(num_experts=spec.num_experts, hidden=spec.hidden, alloc=alloc)
    need = max(int(a.shape[1]) for a in lora_a)
    if need > max_rank:
        why = (" (per-expert gate and up become one fused factor of rank r_gate + r_up for this model's 3D MoE layer)"
               if wrapper == "3d" and experts.gate_up is None else "")
        raise AdapterCompatibilityError(
            f"Adapter {adapter!r}: MoE block {spec.prefix!r} needs rank {need}{why} but max_lora_rank is {max_rank}. "
            f"Start vLLM with --max-lora-rank {max_lora_rank_for(need) or need}.", adapter=adapter)
    return [t.contiguous() for t in lora_a], [t.contiguous() for t in lora_b], need


# ------------------------------------------------------------------------------------------------ shared memory


@dataclass(frozen=True)
class SharedTensors:
    """A [`BuiltAdapter`] whose tensors lie in one file (in ``/dev/shm`` where it fits): the file and a manifest.

    ``entries`` lists ``(group, name, index, dtype, shape, offset)`` for every tensor; ``group`` is
    ``"dense"``, ``"a"`` or ``"b"``. The rest of the adapter travels as ``meta`` (picklable).
    """

    path: str
    size: int
    entries: tuple[tuple[str, str, int, str, tuple[int, ...], int], ...]
    meta: BuiltAdapter  # with empty tensor maps; ranks of MoE blocks kept in ``moe``


_SHARED_PREFIX = "vllm-lora-ext-"


def sweep_stale(directory: str) -> list[str]:
    """Remove shared files whose owner (a build process) is gone: a worker that died mid-hand-over left them.

    Owners are told apart by a lock they hold, not by pid ([`sharedfiles`]), so a live server in another PID
    namespace that shares ``/dev/shm`` keeps its files. Returns the names removed.
    """
    return sweep_dead_owners(directory, _SHARED_PREFIX, suffix=".bin")


def _owned_name(directory: str, tag: str = "") -> str:
    """A new shared file's path in ``directory``, named for this process's owner lock there."""
    owner = claim_owner(directory, _SHARED_PREFIX)
    return os.path.join(directory, f"{_SHARED_PREFIX}{owner}-{tag}{uuid.uuid4().hex}.bin")


def shared_dir(size: int) -> str:
    """Return where a ``size``-byte shared file goes: ``VLLM_LORA_EXT_BUILD_DIR``, else ``/dev/shm`` if it has room,
    else the temp dir (page cache)."""
    configured = os.environ.get(ENV_BUILD_DIR)
    if configured:
        return configured
    try:
        if shutil.disk_usage("/dev/shm").free > size + (256 << 20):
            return "/dev/shm"
    except OSError:
        pass
    return tempfile.gettempdir()


def to_shared(built: BuiltAdapter, directory: str | None = None, *, writers: int = 4,
              trim: bool = True) -> SharedTensors:
    """Put ``built``'s tensors in one shared file and describe it; the caller of [`from_shared`] removes it.

    Tensors already in ``built.arena`` stay where they are; the others are appended to its file (or to a
    new one). The file is cut to the size used; with ``trim=False`` a larger arena file is left as is, and
    the caller cuts it after the hand-over ([`trim_shared`]), so that freeing the unused pages does not
    delay it.

    Raises:
        OSError: the file cannot be created or filled (no space); nothing is left behind.
    """
    items: list[tuple[str, str, int, torch.Tensor]] = [("dense", k, 0, t) for k, t in built.dense.items()]
    for prefix, (lora_a, lora_b, _) in built.moe.items():
        items += [("a", prefix, i, t) for i, t in enumerate(lora_a)]
        items += [("b", prefix, i, t) for i, t in enumerate(lora_b)]
    arena = built.arena
    size = aligned(arena.used) if arena is not None else 0
    writes: list[tuple[int, Any]] = []
    entries = []
    for group, name, index, t in items:
        off = arena.offset_of(t) if arena is not None and t.nbytes else None
        if off is None:
            off = size
            size += aligned(t.nbytes)
            if t.nbytes:
                writes.append((off, t.contiguous().view(-1).view(torch.uint8).numpy()))
        entries.append((group, name, index, str(t.dtype).removeprefix("torch."), tuple(t.shape), off))
    if arena is not None:
        path = arena.path
        arena.close()
        fd = os.open(path, os.O_RDWR)
    else:
        path = _owned_name(directory or shared_dir(size))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        # Written with pwrite, not through a mapping: running out of space is an OSError rather than
        # SIGBUS, and threads copy in parallel.
        if trim or arena is None or size > arena.capacity:
            os.ftruncate(fd, max(size, 1))
        if writes:
            with ThreadPoolExecutor(max(1, min(writers, len(writes)))) as pool:
                for _ in pool.map(lambda job: _pwrite_all(fd, job[1], job[0]), writes):
                    pass
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    meta = BuiltAdapter(built.identity, built.config, {}, {p: ([], [], r) for p, (_, _, r) in built.moe.items()},
                        built.bytes_read, built.layouts)
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
        t = _view(buf, off, getattr(torch, dtype), shape)
        if group == "dense":
            dense[name] = t
        else:
            lora_a, lora_b, _ = moe[name]
            target = lora_a if group == "a" else lora_b
            assert len(target) == index, "manifest out of order"
            target.append(t)
    return BuiltAdapter(meta.identity, meta.config, dense, moe, meta.bytes_read, meta.layouts), buf


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return buf[offset:offset + math.prod(shape) * dtype.itemsize].view(dtype).view(shape)
