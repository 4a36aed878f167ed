"""GPU staging as tensors and memory: one GPU buffer per staged adapter, the pinned copies that fill it, and a mix's
rank concatenation planned and placed on the GPU.

[`_layout`] lays a model's CPU factors out in one buffer; [`_copy_through_pinned`] fills it through two pinned
bounce chunks, so that every host-to-device copy is a true asynchronous DMA. A composite (a mix's rank
concatenation) is laid out by [`_composite_layout`] and filled by [`_upload_and_place`]: components' pinned host
arenas go up as spans, and parts are placed and scaled in few stacked calls. Which vLLM object points at these
buffers, and when, is ``integration.staging``'s; the package docstring tells where staging sits in an adapter's
life.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from vllm_lora_ext._util import usable_cores
from vllm_lora_ext.transport.arena import ALIGN, aligned
from vllm_lora_ext.transport.pools import copy_threads, intra_op_threads

__all__ = ["STAGE_ALIGN", "Staging", "in_source_order"]

STAGE_ALIGN = 256  # a staged region starts on a 256-byte boundary (64 in a span kept as stored: `_as_stored`)
# Copies a batch's host bytes into the scratch: (scratch, direct [(offset, pinned bytes)], bounced, stream).
CopyUp = Callable[[torch.Tensor, list[tuple[int, torch.Tensor]], list[tuple[int, torch.Tensor]], Any], None]


@dataclass
class Staging:
    """One staged GPU buffer: its regions' offsets, their CPU twins, and what an early unstage left to finish."""

    buffer: torch.Tensor  # uint8, on the GPU
    starts: list[int] = field(default_factory=list)  # byte offset of each region, ascending
    # The region's CPU tensor (contiguous); ``None`` until a composite built on the GPU, or an adapter whose fused
    # 3D B was turned on the GPU, has its CPU twins (written back meanwhile).
    cpu: list[torch.Tensor] | None = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    waiting: Any = None  # the engine stream's event, once unstage is called before the CPU twins exist

    @property
    def nbytes(self) -> int:
        return int(self.buffer.numel())


def _layout(tensors: list[torch.Tensor]) -> tuple[int, list[tuple[int, torch.Tensor]], list[int]]:
    """Lay CPU tensors out in one buffer: its size, its regions ``(offset, first tensor holding them)`` in order,
    and each tensor's offset.

    Tensors holding the same bytes (the same object, or views of the same memory with the same size and
    dtype, as a fused gate_up A serving both gate and up) share one region, so they are sized and copied once.
    """
    regions: list[tuple[int, torch.Tensor]] = []
    places: list[int] = []
    seen: dict[Any, int] = {}
    offset = 0
    for t in tensors:
        key = (t.data_ptr(), t.nbytes, t.dtype) if t.is_contiguous() else id(t)
        at = seen.get(key)
        if at is None:
            at = seen[key] = offset
            regions.append((offset, t))
            offset += aligned(t.nbytes, STAGE_ALIGN)
        places.append(at)
    return offset, regions, places


def _as_stored(regions: list[tuple[int, torch.Tensor]]) -> tuple[int, list[int], list[tuple[int, torch.Tensor]]] | None:
    """Lay `_layout`'s regions (contiguous) out with those of the CPU storage holding most of their bytes (a hand-over
    file, a host arena) as they lie there, at the start, the rest after: the size, each region's offset, and the
    copies (that storage's span whole, then the rest). ``None`` where that storage's regions are not 64-byte
    aligned and apart, within an eighth more bytes. A 2D expert adapter's 1,584 MiB then go up in about 50
    chunk-sized copies over torch's intra-op threads, not one per region (1,152), each waiting for all of them."""
    groups: dict[tuple[int, int], list[int]] = {}  # (two storages over the same memory: two groups)
    for i, (_, t) in enumerate(regions):
        if t.device.type == "cpu" and t.nbytes:
            groups.setdefault((t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()), []).append(i)
    if not groups:
        return None
    (base, size), group = max(groups.items(), key=lambda g: sum(regions[i][1].nbytes for i in g[1]))
    spans = {i: (regions[i][1].data_ptr() - base, regions[i][1].data_ptr() - base + regions[i][1].nbytes)
             for i in group}
    ordered = sorted(spans.values())
    used = sum(end - start for start, end in ordered)
    if (len(group) < 2 or ordered[-1][1] > size or any(start < 0 or start % ALIGN for start, _ in ordered)
            or any(end > start for (_, end), (start, _) in zip(ordered, ordered[1:]))  # a region each, for unstaging
            or ordered[-1][1] - ordered[0][0] > used + used // 8 + STAGE_ALIGN * len(group)):
        return None
    lo, hi = ordered[0][0] // STAGE_ALIGN * STAGE_ALIGN, ordered[-1][1]
    whole = torch.empty(0, dtype=torch.uint8).set_(regions[group[0]][1].untyped_storage(), lo, (hi - lo,))
    starts = [spans[i][0] - lo if i in spans else -1 for i in range(len(regions))]
    copies, at = [(0, whole)], aligned(hi - lo, STAGE_ALIGN)
    for i, (_, t) in enumerate(regions):
        if starts[i] < 0:
            starts[i] = at
            if t.numel():
                copies.append((at, t.view(-1).view(torch.uint8)))
            at += aligned(t.nbytes, STAGE_ALIGN)
    return at, starts, copies


_CHUNK = 32 << 20
_BOUNCE: list[torch.Tensor] = []  # two pinned chunks per process, allocated once
_COPY_LOCK = threading.Lock()


def _pieces(regions: list[tuple[int, torch.Tensor]], chunk: int) -> Any:
    """Group consecutive (GPU offset, CPU bytes) regions into chunk-sized windows of the GPU buffer:
    yields ``(window start, [(offset in window, bytes), ...])``; a large region is split across windows."""
    batch: list[tuple[int, torch.Tensor]] = []
    start: int | None = None
    for off, src in regions:
        n, i = src.numel(), 0
        while i < n:
            if start is None:
                start = off + i
            room = start + chunk - (off + i)
            if room <= 0:
                yield start, batch
                batch, start, room = [], off + i, chunk
            take = min(room, n - i)
            batch.append((off + i - start, src[i:i + take]))
            i += take
    if batch and start is not None:
        yield start, batch


def _copy_through_pinned(buffer: torch.Tensor, regions: list[tuple[int, torch.Tensor]], stream: Any) -> None:
    """Copy CPU regions into the GPU ``buffer`` through two small pinned chunks, on ``stream``.

    A copy from pageable memory goes through the driver's own staging, which holds up the engine thread's
    launches for the whole copy (0.4 s for 1.6 GB). Here the CPU fills one pinned chunk while the other is in
    flight (on at most `copy_threads` OpenMP threads), and every host-to-device copy is a true asynchronous DMA.
    """
    with _COPY_LOCK, intra_op_threads(copy_threads(usable_cores())):  # (one copy at a time: the chunks are shared)
        if not _BOUNCE:
            _BOUNCE.extend(torch.empty(_CHUNK, dtype=torch.uint8, pin_memory=True) for _ in range(2))
        _copy_chunks(buffer, regions, stream)


def _copy_chunks(buffer: torch.Tensor, regions: list[tuple[int, torch.Tensor]], stream: Any) -> None:
    events = [torch.cuda.Event(), torch.cuda.Event()]
    used = [False, False]
    k = 0
    for start, batch in _pieces(regions, _CHUNK):
        if used[k]:
            events[k].synchronize()  # the DMA out of this chunk is done: it can be refilled
        pinned = _BOUNCE[k]
        for rel, piece in batch:
            pinned[rel:rel + piece.numel()].copy_(piece)
        span = batch[-1][0] + batch[-1][1].numel()
        with torch.cuda.stream(stream):
            buffer[start:start + span].copy_(pinned[:span], non_blocking=True)
            events[k].record(stream)
        used[k] = True
        k ^= 1
    stream.synchronize()


def _composite_layout(shapes: Any) -> tuple[dict[Any, tuple[int, int]], list[int], int]:
    """Where each key's ``A`` and ``B`` go in a composite's buffer (byte offsets, in the keys' order, aligned):
    ``({key: (A offset, B offset)}, every region's start in order, total bytes)``."""
    offsets: dict[Any, tuple[int, int]] = {}
    starts: list[int] = []
    total = 0
    for key, (a_shape, b_shape, out_dtype) in shapes.items():
        a_off = total
        total += aligned(math.prod(a_shape) * out_dtype.itemsize, STAGE_ALIGN)
        b_off = total
        total += aligned(math.prod(b_shape) * out_dtype.itemsize, STAGE_ALIGN)
        offsets[key] = (a_off, b_off)
        starts += [a_off, b_off]
    return offsets, starts, total


class _Place(NamedTuple):
    """Where a part's elements are: ``as_strided`` arguments over ``base``, a tensor of the part's dtype on the
    storage holding them. Placement is planned in these integers; tensors are made only for the stacked runs
    (building a view per part costs about twice the DMA of a whole GPU build)."""

    base: torch.Tensor
    offset: int  # in elements of base's dtype, from the storage's start
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @classmethod
    def of(cls, t: torch.Tensor) -> _Place:
        """The place of tensor ``t``'s own elements."""
        return cls(t, int(t.storage_offset()), tuple(t.shape), t.stride())

    def tensor(self) -> torch.Tensor:
        return self.base.as_strided(self.shape, self.stride, self.offset)


@functools.lru_cache(maxsize=4096)
def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The strides torch gives a contiguous tensor of ``shape`` (a dim of size 0 counts as 1)."""
    out: list[int] = []
    step = 1
    for n in reversed(shape):
        out.append(step)
        step *= max(n, 1)
    return tuple(reversed(out))


def _typed(buffer: torch.Tensor, dtype: torch.dtype, cache: dict[torch.dtype, torch.Tensor]) -> torch.Tensor:
    """``buffer`` (``uint8``, its size and offset multiples of 16) seen as ``dtype``, one view per dtype. Places
    over it count from its storage's start, so they add its ``storage_offset()``."""
    found = cache.get(dtype)
    if found is None:
        found = cache[dtype] = buffer.view(dtype)
    return found


def _composite_moves(lora_jobs: Any, shapes: Any, offsets: Mapping[Any, tuple[int, int]], buffer: torch.Tensor,
                     ) -> tuple[dict[Any, tuple[torch.Tensor, torch.Tensor]],
                                list[tuple[torch.Tensor, _Place, float | None]]]:
    """Each key's ``(A, B)`` as views of ``buffer`` (``uint8``, laid out by [`_composite_layout`]) and the moves
    that fill them: ``(CPU part, its place in the composite, c)``, ``A_i`` times ``c_i`` into its rank rows,
    ``B_i`` as it is."""
    done: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}
    moves: list[tuple[torch.Tensor, _Place, float | None]] = []
    typed: dict[torch.dtype, torch.Tensor] = {}
    for key, (parts, dim_a, dim_b) in lora_jobs.items():
        a_shape, b_shape, out_dtype = shapes[key]
        a_shape, b_shape = tuple(a_shape), tuple(b_shape)
        base = _typed(buffer, out_dtype, typed)
        a_at, b_at = (int(base.storage_offset()) + off // out_dtype.itemsize for off in offsets[key])
        a_stride, b_stride = _contiguous_strides(a_shape), _contiguous_strides(b_shape)
        done[key] = (base.as_strided(a_shape, a_stride, a_at), base.as_strided(b_shape, b_stride, b_at))
        off = 0
        for pa, pb, c in parts:
            r = int(pa.shape[dim_a])
            moves.append((pa, _Place(base, a_at + off * a_stride[dim_a], (*a_shape[:dim_a], r, *a_shape[dim_a + 1:]),
                                     a_stride), float(c)))
            moves.append((pb, _Place(base, b_at + off * b_stride[dim_b], (*b_shape[:dim_b], r, *b_shape[dim_b + 1:]),
                                     b_stride), None))
            off += r
    return done, moves


def in_source_order(jobs: Any) -> Any:
    """``jobs`` (as for [`concat_staged`]) reordered by the address of their first part's ``A``.

    A composite laid out in this order on the GPU holds each module's parts at the same step from layer to layer
    as its components do in their host arenas, so [`_place`] moves each component's part of a module in every
    layer with one call. Ties keep their order.
    """
    return dict(sorted(jobs.items(), key=lambda item: item[1][0][0][0].data_ptr() if item[1][0] else 0))


def _upload_and_place(moves: list[tuple[torch.Tensor, _Place, float | None]], scratch: torch.Tensor,
                      stream: Any, *, pinned: Callable[[torch.Tensor], bool] | None = None,
                      copy_up: CopyUp | None = None) -> tuple[int, int, int]:
    """Upload CPU parts into ``scratch`` a batch at a time and put each in its place (``c``: times ``c``).

    Parts that are views of one pinned host storage (a component built into a pinned host arena) go up as
    one DMA of the span they share, rather than one per part; the rest one by one (pageable ones through
    the pinned bounce chunks). Each batch is then placed with one ``_foreach_copy_`` and each ``A_i`` scaled
    with one ``mul_``, so a composite of 1,800 parts costs one call per ``A_i`` rather than about ten per part
    (per-part calls cost about 0.1 s for 224 modules). ``copy`` then ``mul_``
    in the destination's dtype is [`concat_factors`]' ``torch.mul(A_i, c, out=...)`` (the product in
    float32, rounded once). The copies into the destinations are queued on ``stream`` after the batch's
    upload and before the next one's, so the scratch is reused in stream order.
    ``pinned`` says whether a CPU part is page-locked (default: asked of torch, once per storage); ``copy_up``
    copies a batch's bytes into ``scratch`` (default [`_copy_up`], into a GPU scratch).
    Returns the upload units, how many of them are spans, and the copies placing the parts.
    """
    srcs = [m[0].contiguous() for m in moves]
    room = scratch.numel()
    units: list[_Unit] = []
    for unit in _units(srcs, pinned or _pinned_per_storage()):
        if unit.span and aligned(unit.nbytes, STAGE_ALIGN) > room:  # a span wider than the scratch goes part by part
            units += [_Unit(0, srcs[i].nbytes, [i], False, True) for i in unit.parts]
        else:
            units.append(unit)
    typed: dict[torch.dtype, torch.Tensor] = {}
    copies = 0
    for batch in _batches(units, room):
        where = _upload(batch, srcs, scratch, stream, copy_up or _copy_up)
        order = [i for unit in batch for i in unit.parts]
        places = []
        for i in order:
            t = srcs[i]
            shape = tuple(t.shape)
            base = _typed(scratch, t.dtype, typed)
            places.append(_Place(base, int(base.storage_offset()) + where[i] // t.itemsize, shape,
                                 _contiguous_strides(shape)))
        with torch.cuda.stream(stream):  # (a no-op without a stream)
            copies += _place([moves[i][1] for i in order], places, [moves[i][2] for i in order],
                             [u if unit.span else -1 for u, unit in enumerate(batch) for _ in unit.parts])
    return len(units), sum(u.span for u in units), copies


def _place(dsts: list[_Place], srcs: list[_Place], scales: list[float | None], units: list[int] | None = None,
           ) -> int:
    """``dst.copy_(src)`` for every pair, then ``dst.mul_(c)`` where ``c`` is given, in few calls.

    Pairs that repeat one shape at a fixed step in both memories (one module's part in every layer) are
    stacked into one strided view each side ([`_stacked`]): a 7B mix's 1,792 parts become 56 copies.
    The rest go in one fused ``_foreach_copy_``. The scaling stays a ``mul_`` per (stacked) part: ``copy_``
    then ``mul_`` is ``torch.mul(src, c, out=dst)`` bit for bit, element by element, while ``_foreach_mul_``
    is not everywhere (on the CPU it rounds differently for bfloat16). ``units``: each pair's upload unit.
    Returns the number of copies."""
    runs = _stacked(dsts, srcs, scales, units)
    if runs:
        torch._foreach_copy_([d for d, _, _ in runs], [s for _, s, _ in runs])
    for d, _, c in runs:
        if c is not None:
            d.mul_(float(c))
    return len(runs)


def _stacked(dsts: list[_Place], srcs: list[_Place], scales: list[float | None], units: list[int] | None = None,
             ) -> list[tuple[torch.Tensor, torch.Tensor, float | None]]:
    """The non-empty ``(dst, src, c)`` of [`_place`] as tensors, with runs of like pairs stacked into one view
    each side.

    Pairs are alike when their sources share a storage, shape, strides and dtype, their destinations do too,
    their scales are equal and (given ``units``) their sources came up in one upload unit, as one component's
    parts do (``-1``: parts uploaded one by one, which group as one). Alike pairs sorted by source offset, or up
    to 16 interleaved sequences of them (a 7B layer holds six A's of one shape, in the same order in every
    layer), whose offsets advance by a fixed positive step on both sides are one pair of ``as_strided`` views:
    element ``[k]`` of each is exactly the ``k``-th pair's tensor, so the copy and the scaling touch the same
    elements as the pairs one by one. The destinations must not overlap (they are distinct parts of a
    composite); sources may. It is all planned on integers: a tensor is made per run, not per pair. Without
    ``units``, the B's of several components (alike, unscaled) share a group, sorted one component after
    another, and break into runs where one component ends: a 7B mix of four gets about 400 runs without them
    (how many depends on how the arenas lay the components out) where it gets 56 with them."""
    bases: dict[int, tuple[int, torch.dtype, torch.device]] = {}

    def memory(t: torch.Tensor) -> tuple[int, torch.dtype, torch.device]:
        found = bases.get(id(t))  # (the tensors stay alive for the whole call)
        if found is None:
            found = bases[id(t)] = (t.untyped_storage().data_ptr(), t.dtype, t.device)
        return found

    groups: dict[tuple, list[int]] = {}
    for i, (d, s) in enumerate(zip(dsts, srcs)):
        if 0 not in d.shape:
            key = (memory(d.base), memory(s.base), d.shape, d.stride, s.shape, s.stride, scales[i],
                   units[i] if units is not None else None)
            groups.setdefault(key, []).append(i)
    d_at = [d.offset for d in dsts]
    s_at = [s.offset for s in srcs]
    out: list[tuple[torch.Tensor, torch.Tensor, float | None]] = []
    for idx in groups.values():
        idx.sort(key=s_at.__getitem__)
        for seq in _progressions(idx, d_at, s_at):
            d0, s0 = dsts[seq[0]], srcs[seq[0]]
            if len(seq) == 1:
                out.append((d0.tensor(), s0.tensor(), scales[seq[0]]))
                continue
            n = len(seq)
            dd, ds = d_at[seq[1]] - d0.offset, s_at[seq[1]] - s0.offset
            out.append((d0.base.as_strided((n, *d0.shape), (dd, *d0.stride), d0.offset),
                        s0.base.as_strided((n, *s0.shape), (ds, *s0.stride), s0.offset), scales[seq[0]]))
    return out


_INTERLEAVED = 16  # the most alike modules a layer holds that _progressions takes apart (7B: 6 A's of one shape)


def _progressions(idx: list[int], d_at: list[int], s_at: list[int]) -> list[list[int]]:
    """Split alike pairs (sorted by source offset) into sequences whose offsets advance by one fixed positive step
    on each side: all of them, else 2 to 16 interleaved sequences (every m-th pair), else runs of consecutive pairs.
    ``d_at``, ``s_at``: every pair's destination and source offset."""

    def step(a: int, b: int) -> tuple[int, int] | None:
        dd, ds = d_at[b] - d_at[a], s_at[b] - s_at[a]
        return (dd, ds) if dd > 0 and ds > 0 else None

    def steady(seq: list[int]) -> bool:
        if len(seq) < 2:
            return True
        first = step(seq[0], seq[1])
        return first is not None and all(step(a, b) == first for a, b in zip(seq[1:], seq[2:]))

    for m in range(1, min(_INTERLEAVED, len(idx)) + 1):
        seqs = [idx[j::m] for j in range(m)]
        if all(steady(seq) for seq in seqs):
            return seqs
    runs: list[list[int]] = [[idx[0]]]
    for i in idx[1:]:
        run = runs[-1]
        here = step(run[-1], i)
        if here is not None and (len(run) == 1 or here == step(run[0], run[1])):
            run.append(i)
        else:
            runs.append([i])
    return runs


_SPAN_ALIGN = 16  # bytes: the largest element a factor has (complex128 aside)


@dataclass
class _Unit:
    """Bytes uploaded as one copy: a pinned storage's span ``[lo, hi)`` holding ``parts``, or one part."""

    lo: int
    hi: int
    parts: list[int]
    span: bool
    pinned: bool

    @property
    def nbytes(self) -> int:
        return self.hi - self.lo


def _pinned_per_storage() -> Callable[[torch.Tensor], bool]:
    seen: dict[int, bool] = {}

    def pinned(t: torch.Tensor) -> bool:
        key = t.untyped_storage().data_ptr()
        found = seen.get(key)
        if found is None:
            found = seen[key] = bool(t.is_pinned())
        return found

    return pinned


def _units(srcs: list[torch.Tensor], pinned: Callable[[torch.Tensor], bool]) -> list[_Unit]:
    """Group contiguous CPU parts into upload units: one per pinned storage whose parts fill at least half the
    span they cover (a component's host arena), one per part otherwise."""
    by_storage: dict[int, list[int]] = {}
    units: list[_Unit] = []
    for i, t in enumerate(srcs):
        if t.numel() and pinned(t):
            by_storage.setdefault(t.untyped_storage().data_ptr(), []).append(i)
        else:
            units.append(_Unit(0, t.nbytes, [i], False, False))
    for base, idx in by_storage.items():
        lo = min(srcs[i].data_ptr() for i in idx)
        lo -= (lo - base) % _SPAN_ALIGN  # every part keeps its alignment in the scratch (whose offsets are aligned)
        hi = max(srcs[i].data_ptr() + srcs[i].nbytes for i in idx)
        if len(idx) > 1 and base % _SPAN_ALIGN == 0 and 2 * sum(srcs[i].nbytes for i in idx) >= hi - lo:
            units.append(_Unit(lo, hi, idx, True, True))
        else:
            units += [_Unit(0, srcs[i].nbytes, [i], False, True) for i in idx]
    return units


def _batches(units: list[_Unit], room: int) -> Any:
    """Consecutive units whose uploads fit ``room`` bytes of scratch together (a larger unit goes alone)."""
    batch: list[_Unit] = []
    used = 0
    for unit in units:
        n = aligned(unit.nbytes, STAGE_ALIGN)
        if batch and used + n > room:
            yield batch
            batch, used = [], 0
        batch.append(unit)
        used += n
    if batch:
        yield batch


def _upload(batch: list[_Unit], srcs: list[torch.Tensor], scratch: torch.Tensor, stream: Any,
            copy_up: CopyUp) -> dict[int, int]:
    """Copy one batch's units into ``scratch`` on ``stream`` with ``copy_up``; return each part's byte offset there."""
    where: dict[int, int] = {}
    direct: list[tuple[int, torch.Tensor]] = []  # (scratch offset, pinned bytes): DMA as they are
    bounced: list[tuple[int, torch.Tensor]] = []  # pageable: through the pinned chunks
    used = 0
    for unit in batch:
        if unit.span:
            first = srcs[unit.parts[0]]
            storage = torch.empty(0, dtype=torch.uint8).set_(first.untyped_storage())
            start = unit.lo - first.untyped_storage().data_ptr()
            direct.append((used, storage[start:start + unit.nbytes]))
            shift = used - unit.lo
            for i in unit.parts:
                where[i] = shift + srcs[i].data_ptr()
        else:
            t = srcs[unit.parts[0]]
            if t.numel():
                (direct if unit.pinned else bounced).append((used, t.reshape(-1).view(torch.uint8)))
            where[unit.parts[0]] = used
        used += aligned(unit.nbytes, STAGE_ALIGN)
    copy_up(scratch, direct, bounced, stream)
    return where


def _copy_up(scratch: torch.Tensor, direct: list[tuple[int, torch.Tensor]], bounced: list[tuple[int, torch.Tensor]],
             stream: Any) -> None:
    """Copy host bytes into the GPU ``scratch`` at their offsets, on ``stream``: pinned ones as one DMA each,
    pageable ones through the pinned bounce chunks ([`_copy_through_pinned`])."""
    if bounced:
        _copy_through_pinned(scratch, bounced, stream)
    with torch.cuda.stream(stream):
        for off, src in direct:
            scratch[off:off + src.numel()].copy_(src, non_blocking=True)
