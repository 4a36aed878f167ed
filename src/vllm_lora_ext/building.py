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

import os
import shutil
import tempfile
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import torch

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.constants import ENV_BUILD_DIR, max_lora_rank_for
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.formats import classify_key
from vllm_lora_ext.formats.moe import ExpertsLoRA, MoESpec, read_blocks
from vllm_lora_ext.planning import KeyRouter, ModelSpec, plan_adapter
from vllm_lora_ext.reader import ReadStats, SafetensorsReader, load_pickle_tensors
from vllm_lora_ext.sources import resolve_source
from vllm_lora_ext.summary import load_config
from vllm_lora_ext.validation import check_finite

__all__ = ["BuildJob", "BuiltAdapter", "SharedTensors", "build_adapter", "from_shared", "pack_block", "to_shared"]

Wrapper = Literal["2d", "3d"]

_ALIGN = 64  # every tensor in a shared file starts on a 64-byte boundary (any dtype's view is aligned)


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
    """

    identity: str
    config: AdapterConfig
    dense: dict[str, torch.Tensor]
    moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]]
    bytes_read: int = 0
    layouts: tuple[str, ...] = ()

    @property
    def nbytes(self) -> int:
        """Bytes of all tensors held."""
        total = sum(t.nbytes for t in self.dense.values())
        return total + sum(t.nbytes for a, b, _ in self.moe.values() for t in (*a, *b))


class _DictSource:
    """A pickle adapter already in memory, read through the same interface as SafetensorsReader."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, key: str, ranges: Any = None) -> torch.Tensor:
        t = self.tensors[key]
        if not ranges:
            return t
        return torch.cat([t.narrow(d, s, e - s) for d, s, e in ranges], dim=ranges[0][0]).contiguous()

    def read_many(self, keys: Any, *, copy: bool = True) -> dict[str, torch.Tensor]:
        return {k: self.tensors[k] for k in keys}


def build_adapter(job: BuildJob, router: KeyRouter) -> BuiltAdapter:
    """Resolve, plan, read, check and pack ``job``'s adapter for the model it describes.

    Raises:
        [`AdapterNotFoundError`]: the source does not exist.
        [`AdapterSourceError`], [`AdapterFormatError`], [`UnmatchedKeysError`], [`ExpertLayoutError`]:
            the adapter is malformed or does not fit the model (the message names the key and the fix).
        [`AdapterCompatibilityError`]: a rank exceeds ``max_lora_rank``, or the model's MoE blocks cannot take LoRA.
    """
    resolved = resolve_source(job.path)
    config = load_config(resolved, name=job.name)
    stats = ReadStats()
    source: Any
    if resolved.is_pickle:
        source = _DictSource(load_pickle_tensors(resolved.weights_path))
        shapes = {k: tuple(v.shape) for k, v in source.tensors.items()}
        dtypes = None
    else:
        source = SafetensorsReader(resolved.weights_path, stats=stats)
        shapes, dtypes = source.header.shapes, source.header.dtypes
    if job.moe_error is not None and any(classify_key(k).kind in ("moe_2d", "moe_3d") for k in shapes):
        raise AdapterCompatibilityError(job.moe_error, adapter=job.name)
    plan = plan_adapter(shapes, config, job.model, router=router, dtypes=dtypes, name=job.name,
                        identity=resolved.identity, allow_unmatched=job.allow_unmatched)
    dense = source.read_many(plan.dense_keys, copy=True)
    check_finite(dense, adapter=job.name)
    blocks = read_blocks(plan.moe, source.read, config=config, dtype=job.dtype,
                         experts={p: job.model.local_experts.get(p) for p in plan.moe},
                         read_many=lambda keys: source.read_many(keys, copy=False), check_finite_as=job.name)
    moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}
    for prefix, experts in blocks.items():
        moe[prefix] = pack_block(experts, job.model.moe[prefix], job.wrappers.get(prefix, "2d"),
                                 max_rank=job.model.max_rank, adapter=job.name)
    del blocks
    layouts = tuple(sorted({p.layout for p in plan.moe.values()}))
    return BuiltAdapter(resolved.identity, config, dense, moe, stats.bytes_read, layouts)


def pack_block(experts: ExpertsLoRA, spec: MoESpec, wrapper: Wrapper, *, max_rank: int,
               adapter: str) -> tuple[list[torch.Tensor], list[torch.Tensor], int]:
    """Return one MoE block in the form vLLM's wrapper stores (contiguous factor lists) and its rank.

    Raises:
        [`AdapterCompatibilityError`]: the block's rank exceeds ``max_rank`` (names the flag to set).
    """
    if wrapper == "3d":
        lora_a, lora_b = experts.as_3d(hidden=spec.hidden)
    else:
        lora_a, lora_b = experts.as_2d(num_experts=spec.num_experts, hidden=spec.hidden)
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


def to_shared(built: BuiltAdapter, directory: str | None = None, *, writers: int = 4) -> SharedTensors:
    """Copy ``built``'s tensors into one new shared file and describe it; the caller of [`from_shared`] removes it.

    Raises:
        OSError: the file cannot be created or filled (no space); nothing is left behind.
    """
    items: list[tuple[str, str, int, torch.Tensor]] = [("dense", k, 0, t) for k, t in built.dense.items()]
    for prefix, (lora_a, lora_b, _) in built.moe.items():
        items += [("a", prefix, i, t) for i, t in enumerate(lora_a)]
        items += [("b", prefix, i, t) for i, t in enumerate(lora_b)]
    offsets, size = [], 0
    for _, _, _, t in items:
        offsets.append(size)
        size += -(-t.nbytes // _ALIGN) * _ALIGN
    path = os.path.join(directory or shared_dir(size), f"vllm-lora-ext-{os.getpid()}-{uuid.uuid4().hex}.bin")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    entries = []
    try:
        # Written with pwrite, not through a mapping: the kernel fills tmpfs pages without a page fault
        # per 4 KiB, running out of space is an OSError rather than SIGBUS, and threads copy in parallel.
        jobs = []
        for (group, name, index, t), off in zip(items, offsets):
            if t.nbytes:
                jobs.append((off, t.contiguous().view(-1).view(torch.uint8).numpy()))
            entries.append((group, name, index, str(t.dtype).removeprefix("torch."), tuple(t.shape), off))
        os.ftruncate(fd, max(size, 1))
        with ThreadPoolExecutor(max(1, min(writers, len(jobs)))) as pool:
            for _ in pool.map(lambda job: _pwrite_all(fd, job[1], job[0]), jobs):
                pass
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    meta = BuiltAdapter(built.identity, built.config, {}, {p: ([], [], r) for p, (_, _, r) in built.moe.items()},
                        built.bytes_read, built.layouts)
    return SharedTensors(path, size, tuple(entries), meta)


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
            target = moe[name][0 if group == "a" else 1]
            assert len(target) == index, "manifest out of order"
            target.append(t)
    return BuiltAdapter(meta.identity, meta.config, dense, moe, meta.bytes_read, meta.layouts), buf


def _view(buf: torch.Tensor, offset: int, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    n = 1
    for d in shape:
        n *= d
    itemsize = torch.empty((), dtype=dtype).element_size()
    return buf[offset:offset + n * itemsize].view(dtype).view(shape)
