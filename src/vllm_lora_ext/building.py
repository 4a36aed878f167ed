"""Build an adapter's tensors for a running model, as plain data: the part of a load that needs no vLLM object.

A load is: resolve the source, read its config and header, plan every key against the model
([`plan_adapter`]), read the kept bytes, check them, and pack MoE blocks into the layout vLLM's MoE
LoRA wrappers store. [`build_adapter`] does all of that from a picklable [`BuildJob`] and returns a
[`BuiltAdapter`]: dense factors by key, MoE factor lists by block. The worker then only wraps these
tensors in vLLM's objects. Because nothing here needs vLLM's objects, a build can run in a separate
process, away from the engine thread's GIL; where its tensors go then, and how they reach the worker, is
``transport``'s (its docstring tells an adapter's whole life).
"""

from __future__ import annotations

import contextlib
import math
import operator
import os
import threading
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal

import torch

from vllm_lora_ext._util import file_stamp, gc_paused
from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.constants import host_arena_min_bytes, host_arenas_enabled
from vllm_lora_ext.diskholds import holding  # a build's revision is never evicted under it
from vllm_lora_ext.errors import AdapterCompatibilityError
from vllm_lora_ext.formats import classify_key
from vllm_lora_ext.formats.moe import Alloc, ExpertsLoRA, MoESpec
from vllm_lora_ext.formats.moe_read import ReadOptions, read_blocks
from vllm_lora_ext.planning import AdapterPlan, KeyRouter, ModelSpec, plan_adapter
from vllm_lora_ext.headers import safetensors_names
from vllm_lora_ext.reader import DictSource, ReadStats, SafetensorsReader, load_pickle_tensors
from vllm_lora_ext.resolve import confining_roots
from vllm_lora_ext.sources import parse_source, resolve_source
from vllm_lora_ext.summary import load_config
from vllm_lora_ext.transport import pools
from vllm_lora_ext.transport.arena import ALIGN, Arena, ArenaSupply, aligned
from vllm_lora_ext.validation import check_finite, check_fits_dtype, check_rank_budget, dense_multipliers

__all__ = ["BuildJob", "BuiltAdapter", "MappedAdapter", "ModuleKeys", "build_adapter", "pack_block", "plan_ahead"]

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
        scan_moe: scan the MoE factors for NaN/inf while they are read. ``False`` leaves that to the caller, which
            must scan them before the model is served (``BuiltAdapter.moe_scanned``): a background build scans
            them on the GPU once staged (``integration.prebuild``), where it takes about a millisecond instead of
            a CPU pass over every byte on the build's path.
        defer_turn: leave a fused 3D B as stored, for the caller to transpose and scale on its GPU once staged
            (``BuiltAdapter.unturned``; [`ReadOptions.defer_turn`]). Only with ``scan_moe=False``: the caller scans
            the turned factors.
    """

    path: str
    name: str
    model: ModelSpec
    wrappers: Mapping[str, Wrapper] = field(default_factory=dict)
    moe_error: str | None = None
    dtype: torch.dtype | None = None
    allow_unmatched: bool = False
    scan_moe: bool = True
    defer_turn: bool = False


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
        files: a local source's files the build read (weights, config), each with its [`file_stamp`] then: a
            cached build of it is stale once one differs (``_util.files_unchanged``); none for a hub snapshot.
        moe_scanned: whether the MoE factors were scanned for NaN/inf (``False`` only for a job with
            ``scan_moe=False`` and MoE blocks: the caller must scan them before serving).
        unturned: per MoE block, the factors of ``lora_b`` still as stored (``BuildJob.defer_turn``), as
            ``(index, rows, cols, scale)``: that tensor's bytes are the row-major ``(rows, cols)`` matrix whose
            transpose times ``scale`` it must hold (``formats.moe.turn_in_place``) before it is served.
        plan_kept: the build took the kept plan of an earlier adapter with the same header bytes, config and model
            (and so its kept header) instead of parsing and planning anew ([`plan_ahead`]).
    """

    identity: str
    config: AdapterConfig
    dense: dict[str, torch.Tensor]
    moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]]
    bytes_read: int = 0
    layouts: tuple[str, ...] = ()
    arena: Arena | None = None
    host: Arena | None = None
    turned_on_gpu: int = 0
    files: tuple[tuple[str, tuple[int, int, int, int]], ...] = ()
    moe_scanned: bool = True
    unturned: dict[str, tuple[tuple[int, int, int, float], ...]] = field(default_factory=dict)
    plan_kept: bool = False


@dataclass(frozen=True)
class ModuleKeys:
    """Where one dense LoRA module of the running model lies in a [`BuiltAdapter`]: the keys of its ``A (r, in)``
    and ``B (out, r)`` in ``dense``, and the module's scaling."""

    key_a: str
    key_b: str
    scaling: float


@dataclass(frozen=True)
class MappedAdapter:
    """A [`BuiltAdapter`] with the running model's name for each of its dense modules: a mix component as the
    worker keeps it.

    Attributes:
        built: the adapter, its dense factors as the model takes them (in the LoRA dtype), only those ``modules``
            names.
        modules: per dense module (the model's name), its [`ModuleKeys`], in the model's order. MoE blocks are
            ``built.moe``'s, already by the model's names.
    """

    built: BuiltAdapter
    modules: dict[str, ModuleKeys]


def build_adapter(job: BuildJob, router: KeyRouter, *, shared: bool = False,
                  arenas: ArenaSupply | None = None, transpose_on: torch.device | None = None) -> BuiltAdapter:
    """Resolve, plan, read, check and pack ``job``'s adapter for the model it describes.

    With ``shared``, MoE factors are built straight into a shared-file [`Arena`] (``built.arena``, from
    ``arenas`` if given), which ``transport.handover.to_shared`` then hands over without copying them again. With a CUDA
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


def plan_ahead(job: BuildJob, router: KeyRouter) -> bool:
    """Read ``job``'s header and plan it as a build would, reading no tensor, and keep both: the next build of an
    adapter with the same header bytes, config and model (one trained the same way) skips that work, 0.1-0.2 s for
    a 48-layer MoE adapter. A build process is told of the adapters its worker built while it started
    (``integration.build_process``). Returns whether the plan was kept already.

    Raises:
        What [`build_adapter`] raises for a source, header, config or plan it refuses.
    """
    with gc_paused(), holding(parse_source(job.path), why=f"plan of adapter {job.name!r}"):
        return _build_adapter(job, router, shared=False, arenas=None, plan_only=True).plan_kept


def _build_adapter(job: BuildJob, router: KeyRouter, *, shared: bool, arenas: ArenaSupply | None,
                   transpose_on: torch.device | None = None, plan_only: bool = False) -> BuiltAdapter:
    """See [`build_adapter`]; with ``plan_only`` ([`plan_ahead`]), stop once planned (an adapter with no tensor)."""
    resolved = resolve_source(job.path, local_files_only=True if plan_only else None)  # (a plan ahead: never fetch)
    roots = confining_roots(resolved)  # a local source inside an allowed root: held to the roots on every build
    config_stamp = _stamp_of(resolved.config_path)  # before it is read: an edit meanwhile makes the build stale
    known = resolved.config_path is not None or resolved.is_pickle
    config = load_config(resolved, name=job.name, roots=roots) if known else None
    if plan_only and resolved.is_pickle and config is not None:  # read whole, with no header to keep: no plan ahead
        return BuiltAdapter(resolved.identity, config, {}, {})
    stats = ReadStats()  # below: the header, an inferred config and every tensor from one open file (one snapshot)
    source: Any = (DictSource(load_pickle_tensors(resolved.weights_path, roots=roots)) if resolved.is_pickle
                   else SafetensorsReader(resolved.weights_path, stats=stats, roots=roots))
    with contextlib.closing(source):
        # (an inferred config: from the header the tensors are read with)
        config = config or load_config(resolved, name=job.name, header=source.header)
        if resolved.is_pickle:  # dtypes by safetensors name where it has one: every path refuses non-float factors
            shapes = {k: tuple(v.shape) for k, v in source.tensors.items()}
            dtypes = {k: safetensors_names().get(v.dtype, str(v.dtype)) for k, v in source.tensors.items()}
        else:
            shapes, dtypes = source.header.shapes, source.header.dtypes
        if job.moe_error is not None and any(classify_key(k).kind in ("moe_2d", "moe_3d") for k in shapes):
            raise AdapterCompatibilityError(job.moe_error, adapter=job.name)
        token = None if resolved.is_pickle else source.header.token
        plan, kept = _planned(token, shapes, dtypes, config, job, router, resolved.identity)
        if plan_only:
            return BuiltAdapter(resolved.identity, config, {}, {}, plan_kept=kept)
        arena = None
        host = None
        if shared and plan.moe:
            need = _stacked_bytes(plan.moe, shapes, job)
            arena = arenas.take(need) if arenas is not None else Arena.in_file(need)
        elif not shared and host_arenas_enabled() and not resolved.is_pickle:
            need = _dense_bytes(plan.dense_keys, source.header.nbytes) + (_stacked_bytes(plan.moe, shapes, job)
                                                                          if plan.moe else 0)
            if need >= host_arena_min_bytes():
                host = Arena.anonymous(need)
        alloc = arena.empty if arena is not None else host.empty if host is not None else None
        try:
            if host is not None:  # read straight into the arena: each tensor a view of its span there
                dense = source.read_many(plan.dense_keys, into=host.empty)
            else:
                dense = source.read_many(plan.dense_keys, copy=True)
            check_finite(dense, adapter=job.name)
            check_fits_dtype(dense_multipliers(dense, config), job.dtype, adapter=job.name)
            fused = frozenset(p for p in plan.moe if job.wrappers.get(p, "2d") == "3d")
            options = ReadOptions(dtype=job.dtype, check_finite_as=job.name if job.scan_moe else None, alloc=alloc,
                                  transpose_on=transpose_on, defer_turn=job.defer_turn, fused_gate_up=fused,
                                  pools=pools)
            blocks = read_blocks(plan.moe, source, config=config,
                                 experts={p: job.model.local_experts.get(p) for p in plan.moe}, options=options)
            moe: dict[str, tuple[list[torch.Tensor], list[torch.Tensor], int]] = {}
            unturned: dict[str, tuple[tuple[int, int, int, float], ...]] = {}
            for prefix, experts in blocks.items():
                moe[prefix] = pack_block(experts, job.model.moe[prefix], job.wrappers.get(prefix, "2d"),
                                         max_rank=job.model.max_rank, adapter=job.name, alloc=alloc)
                lying = _lying(experts, moe[prefix][1], job.name)
                if lying:
                    unturned[prefix] = lying
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
                            stats.turned_on_gpu, _stamps(resolved, source, config_stamp),
                            moe_scanned=job.scan_moe or not moe, unturned=unturned, plan_kept=kept)


def _lying(experts: ExpertsLoRA, lora_b: list[torch.Tensor],
           adapter: str) -> tuple[tuple[int, int, int, float], ...]:
    """Where a block's B left as stored (``ExpertFactors.lying``) lies in its packed ``lora_b``, as ``(index, rows,
    cols, scale)``: a fused gate_up kept fused, or its two halves (views) as the split's gate and up.

    Raises:
        RuntimeError: the packing copied such a B (it would be served as stored); no layout does.
    """
    def at(t: torch.Tensor) -> int | None:
        return next((i for i, b in enumerate(lora_b)
                     if b.data_ptr() == t.data_ptr() and b.nbytes == t.nbytes and b.dtype == t.dtype), None)

    parts = []
    fused = experts.gate_up
    if fused is not None and fused.lying is not None:
        parts += [fused] if at(fused.b) is not None else [f for f in experts._split_gate_up() if f is not None]
    if experts.down is not None and experts.down.lying is not None:
        parts.append(experts.down)
    found = []
    for f in parts:
        i = at(f.b)
        if i is None or f.lying is None:
            raise RuntimeError(f"Adapter {adapter!r}, MoE block {experts.prefix!r}: a fused 3D B left as stored "
                               f"was packed by a copy (a bug). Set VLLM_LORA_EXT_TRANSPOSE_ON_GPU=0 to build it "
                               f"turned.")
        found.append((i, *f.lying))
    return tuple(found)


# The last plan made from a kept header (``FileHeader.token``, 64 KiB to 8 MiB of header): a server's new adapter
# usually has the same header bytes, config and model as the one before it, and planning the 36,864 keys of a
# 48-layer expert adapter takes 0.03-0.05 s. A plan is only read once made, and depends on nothing but these (the
# name and source appear only in the messages of a refusal, and a refusal is never kept). A plan that dropped keys
# is not kept: it warned about them, and each adapter that drops keys warns anew. Its key holds the header's bytes
# (at most 8 MiB) as long as the plan is kept. Plans are read-only once made: the one kept is shared by builds.
_KEPT_PLAN: list[tuple[tuple[Any, ...], AdapterPlan]] = []
_KEPT_PLAN_LOCK = threading.Lock()


def _planned(token: tuple[bytes, int] | None, shapes: Mapping[str, tuple[int, ...]], dtypes: Mapping[str, str],
             config: AdapterConfig, job: BuildJob, router: KeyRouter, identity: str) -> tuple[AdapterPlan, bool]:
    """`plan_adapter` for ``job``'s adapter, or the kept plan of the same header, config, model and router; and
    whether it was the kept one."""
    model = replace(job.model, allow_unmatched=job.allow_unmatched)
    # (the patterns' order too: PEFT's first matching key gives a module's rank, and dicts compare without order)
    # (its fields read as they are: a config's own checks, which compile every pattern, are not run again)
    config_key = (*(getattr(config, f.name) for f in fields(config) if f.name != "name"),
                  tuple(config.rank_pattern), tuple(config.alpha_pattern))
    key = (token, config_key, model, router) if token is not None else None
    with _KEPT_PLAN_LOCK:
        kept = _KEPT_PLAN[0] if _KEPT_PLAN else None
    if key is not None and kept is not None and kept[0] == key:  # (token first: the bytes, compared in full)
        return kept[1], True
    plan = plan_adapter(shapes, config, model, router=router, dtypes=dtypes, name=job.name, identity=identity)
    if key is not None and not plan.dropped:
        with _KEPT_PLAN_LOCK:
            _KEPT_PLAN[:] = [(key, plan)]
    return plan, False


_NEVER = (-1, -1, -1, -1)  # a stamp no file has


def _stamp_of(path: Any) -> tuple[int, int, int, int] | None:
    if path is None:
        return None
    try:
        return file_stamp(os.stat(path))
    except OSError:
        return _NEVER


def _stamps(resolved: Any, source: Any, config_stamp: tuple[int, int, int, int] | None
            ) -> tuple[tuple[str, tuple[int, int, int, int]], ...]:
    """A local source's files, each with its stamp when the build read it (the weight file's as its header was
    read): a cached build of it is stale once one differs. A hub source is a pinned snapshot: none."""
    if resolved.source.kind != "local":
        return ()
    weights = (source.header.stamp if not resolved.is_pickle and source.header.stamp is not None
               else _stamp_of(resolved.weights_path))
    out = [(str(resolved.weights_path), weights or _NEVER)]
    if resolved.config_path is not None:
        out.append((str(resolved.config_path), config_stamp or _NEVER))
    return tuple(out)


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
        pairs = plan.keys_2d if kept is None else [k for k in plan.keys_2d if k.expert in kept]
        # A 2D block's pairs of one role and rank have one shape each (the plan checked every one against the
        # model's dims): counted, each sized once, by the last pair of its kind
        last_of = dict(zip(map(_ROLE_RANK, pairs), pairs))
        for kind, n in Counter(map(_ROLE_RANK, pairs)).items():
            total += n * (size(last_of[kind].key_a) + size(last_of[kind].key_b))
        share = 1.0 if keep is None else len(keep) / max(1, job.model.moe[prefix].num_experts)
        for k3 in plan.keys_3d:
            total += size(k3.key_a, share) + size(k3.key_b, share)
    return total


_ROLE_RANK = operator.attrgetter("role", "rank")


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
    why = (" (per-expert gate and up become one fused factor of rank r_gate + r_up for this model's 3D MoE layer)"
           if wrapper == "3d" and experts.gate_up is None else "")
    check_rank_budget(need, max_rank, adapter=adapter,
                      what=f"Adapter {adapter!r}: MoE block {spec.prefix!r} needs rank {need}{why}")
    return [t.contiguous() for t in lora_a], [t.contiguous() for t in lora_b], need
