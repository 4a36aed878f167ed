"""The staging copy's chunking (runs without a GPU): the chunks rebuild the GPU buffer's image exactly; the NaN/inf
scan of a model left unstaged."""

from __future__ import annotations

import random

import pytest
import torch

from vllm_lora_ext.transport.staging import _pieces


def test_chunks_cover_every_region_byte_at_its_offset_and_stay_within_a_chunk() -> None:
    rng = random.Random(0)
    for chunk in (7, 64, 1000):
        regions, offset = [], 0
        for _ in range(40):
            n = rng.choice([0, 1, 5, 63, 64, 65, 300, 2500])
            if n:
                regions.append((offset, torch.randint(0, 255, (n,), dtype=torch.uint8)))
            offset += -(-n // 16) * 16 + rng.choice([0, 16])
        want = torch.zeros(offset + 1, dtype=torch.uint8)
        data = torch.zeros(offset + 1, dtype=torch.bool)  # the padding between regions is free to hold anything
        for off, src in regions:
            want[off:off + src.numel()] = src
            data[off:off + src.numel()] = True
        got = torch.zeros_like(want)
        covered = 0
        for start, batch in _pieces(regions, chunk):
            span = batch[-1][0] + batch[-1][1].numel()
            assert span <= chunk
            window = torch.zeros(chunk, dtype=torch.uint8)
            for rel, piece in batch:
                window[rel:rel + piece.numel()] = piece
                covered += piece.numel()
            mask = data[start:start + span]
            got[start:start + span][mask] = window[:span][mask]
        assert covered == sum(src.numel() for _, src in regions)
        assert torch.equal(got, want)


def test_tensors_holding_the_same_bytes_share_one_region_and_are_sized_once() -> None:
    from vllm_lora_ext.transport.staging import STAGE_ALIGN as _ALIGN, _layout

    memory = torch.arange(4 * 8 * 16, dtype=torch.bfloat16).reshape(4, 8, 16)
    as_gate, as_up = memory.view(4, 8, 16), memory.view(4, 8, 16)  # a fused A serving gate and up: two objects
    other = memory.clone()  # equal values, other memory: its own region
    strided = memory.transpose(1, 2)  # not contiguous: copied into a region of its own
    total, regions, places = _layout([as_gate, other, as_up, strided, as_gate])
    region = -(-memory.nbytes // _ALIGN) * _ALIGN
    assert total == 3 * region and len(regions) == 3
    assert places == [0, region, 0, 2 * region, 0]
    assert regions[0][1] is as_gate and regions[1][1] is other and regions[2][1] is strided


def _arena_jobs() -> tuple[dict, list[torch.Tensor]]:
    """A mix's jobs whose components each live in one storage (as in a host arena), plus a float32 component
    and a strided part: dense modules and two slices of a packed MoE block."""
    g = torch.Generator().manual_seed(3)
    bf = torch.bfloat16
    arenas: list[torch.Tensor] = []

    def arena_parts(shapes: list[tuple[int, ...]], dtype: torch.dtype) -> list[torch.Tensor]:
        sizes = [int(torch.Size(s).numel()) for s in shapes]
        flat = torch.randn(sum(sizes) + 7 * len(sizes), generator=g).to(dtype)  # gaps between the parts
        arenas.append(flat)
        out, at = [], 3
        for s, n in zip(shapes, sizes):
            out.append(flat[at:at + n].view(s))
            at += n + 7
        return out

    jobs: dict = {}
    comps = [(8, 0.7, bf), (4, 1.3, bf), (16, -0.25, torch.float32)]
    parts = [arena_parts([(r, 64), (48, r), (r, 48), (64, r), (4, r, 64), (4, 32, r)], dt) for r, _, dt in comps]
    jobs["q_proj"] = ([(p[0], p[1], c) for p, (_, c, _) in zip(parts, comps)], 0, 1)
    jobs["o_proj"] = ([(p[2], p[3], c) for p, (_, c, _) in zip(parts, comps)], 0, 1)
    jobs[("experts", 0)] = ([(p[4], p[5], c) for p, (_, c, _) in zip(parts, comps)], 1, 2)
    strided = torch.randn(64, 8, generator=g).to(bf).t()  # a part that is not contiguous
    jobs[("experts", 1)] = ([(torch.randn(4, 8, 64, generator=g).to(bf), torch.randn(4, 32, 8, generator=g).to(bf),
                              0.5)], 1, 2)
    jobs["k_proj"] = ([(strided, torch.randn(48, 8, generator=g).to(bf), 2.0)], 0, 1)
    return jobs, arenas


def _host_copy(scratch: torch.Tensor, direct: list, bounced: list, stream: object) -> None:
    """The upload into a host scratch (no GPU here): each part's bytes at its offset, pinned or not."""
    for off, src in direct + bounced:
        scratch[off:off + src.numel()].copy_(src)


def test_upload_plan_places_every_part_as_the_cpu_concatenation_does_bit_for_bit() -> None:
    """The GPU build's plan (components' shared storages uploaded as spans, parts placed and scaled in
    fused calls), run with a CPU scratch, equals `concat_many` bitwise: with spans, with every part on its
    own, and with a scratch that holds only the largest part (spans then go part by part)."""
    from vllm_lora_ext.transport.staging import _Place, _units, _upload_and_place
    from vllm_lora_ext.mixing import composite_shapes, concat_many

    jobs, arenas = _arena_jobs()
    reference = concat_many(jobs, dtype=torch.bfloat16)
    shapes = composite_shapes(jobs, dtype=torch.bfloat16)
    arena_ptrs = {a.untyped_storage().data_ptr() for a in arenas}

    def in_arena(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in arena_ptrs

    srcs = [p[i] for parts, _, _ in jobs.values() for p in parts for i in (0, 1)]
    units = _units([t.contiguous() for t in srcs], in_arena)
    assert sum(u.span for u in units) == 3  # one span per component storage
    assert sorted(i for u in units for i in u.parts) == list(range(len(srcs)))
    smallest = max(-(-t.nbytes // 256) * 256 for t in srcs)  # the scratch holds the largest part (concat_staged)
    for pinned, room in ((in_arena, 1 << 30), (lambda t: False, 1 << 30), (in_arena, smallest)):
        out = {k: (torch.full(a, float("nan"), dtype=t), torch.full(b, float("nan"), dtype=t))
               for k, (a, b, t) in shapes.items()}
        moves = []
        for key, (parts, dim_a, dim_b) in jobs.items():
            off = 0
            for pa, pb, c in parts:
                r = int(pa.shape[dim_a])
                moves.append((pa, _Place.of(out[key][0].narrow(dim_a, off, r)), float(c)))
                moves.append((pb, _Place.of(out[key][1].narrow(dim_b, off, r)), None))
                off += r
        _upload_and_place(moves, torch.empty(room, dtype=torch.uint8), None, pinned=pinned, copy_up=_host_copy)
        for key in jobs:
            assert torch.equal(out[key][0], reference[key][0]), (key, room)
            assert torch.equal(out[key][1], reference[key][1]), (key, room)


def _layered_jobs(layers: int, comps: list | None = None) -> tuple[dict, list]:
    """A mix of three components (``comps``: their rank, weight and dtype) over ``layers`` layers, each component
    in one host arena filled in file order (layers sorted as names: 0, 1, 10, 11, ..., 2, ...), with k_proj and
    v_proj of equal shapes."""
    from vllm_lora_ext.transport.arena import HostArena

    g = torch.Generator().manual_seed(5)
    bf = torch.bfloat16
    mods = {"k_proj": (64, 16), "o_proj": (32, 64), "q_proj": (64, 32), "v_proj": (64, 16)}  # (in, out)
    names = sorted(str(n) for n in range(layers))
    comps = comps or [(8, 0.7, bf), (4, 1.3, bf), (16, -0.25, torch.float32)]
    arenas = []
    jobs: dict = {}
    for r, c, dt in comps:
        arena = HostArena(1 << 20)
        arenas.append(arena)
        for layer in names:
            for m, (d_in, d_out) in mods.items():
                a, b = arena.empty((r, d_in), dt), arena.empty((d_out, r), dt)
                a.copy_(torch.randn(r, d_in, generator=g))
                b.copy_(torch.randn(d_out, r, generator=g))
                jobs.setdefault(f"layers.{layer}.{m}", ([], 0, 1))[0].append((a, b, c))
    return jobs, arenas


def test_parts_repeated_layer_by_layer_are_placed_in_a_few_stacked_calls_bit_for_bit() -> None:
    """A composite laid out in its components' order (as `concat_staged` lays out `in_source_order` jobs):
    each component's part of one module in every layer is one strided copy (k_proj and v_proj, alike,
    interleave), and the result equals `concat_many` bitwise. A layout out of step gives more calls, same bytes;
    moving a part off its step (the control) breaks a run there."""
    from vllm_lora_ext.transport.staging import (_composite_layout, _composite_moves, _Place, _stacked,
                                                 _upload_and_place, in_source_order)
    from vllm_lora_ext.mixing import composite_shapes, concat_many

    jobs, arenas = _layered_jobs(12)
    reference = concat_many(jobs, dtype=torch.bfloat16)
    stores = {a.base for a in arenas}

    def in_arena(t: torch.Tensor) -> bool:
        return t.untyped_storage().data_ptr() in stores

    def place(ordered: dict) -> int:
        shapes = composite_shapes(ordered, dtype=torch.bfloat16)
        offsets, _, total = _composite_layout(shapes)
        # bfloat16 NaNs wherever nothing is written; buffer and scratch start past their storages' starts
        memory = torch.full((total + 512,), 255, dtype=torch.uint8)
        buffer = memory[256:256 + total]
        out, moves = _composite_moves(ordered, shapes, offsets, buffer)
        _upload_and_place(moves, torch.empty((1 << 22) + 64, dtype=torch.uint8)[64:], None, pinned=in_arena,
                          copy_up=_host_copy)
        assert memory[:256].eq(255).all() and memory[256 + total:].eq(255).all()  # nothing outside the buffer
        for key in ordered:
            assert torch.equal(out[key][0], reference[key][0]), key
            assert torch.equal(out[key][1], reference[key][1]), key
        # the calls the same moves make from the components themselves (the upload keeps their relative offsets)
        return len(_stacked([m[1] for m in moves], [_Place.of(m[0]) for m in moves], [m[2] for m in moves]))

    numeric = {k: jobs[k] for k in sorted(jobs, key=lambda k: (int(k.split(".")[1]), k))}  # out of the file's order
    assert list(in_source_order(numeric)) == list(jobs)
    calls = place(in_source_order(numeric))
    assert calls == 3 * 4 * 2  # per component: each module's A and B in all 12 layers at once
    assert place(numeric) > calls  # same bytes, more calls
    a, b, c = jobs["layers.3.q_proj"][0][0]
    jobs["layers.3.q_proj"][0][0] = (a.clone(), b, c)  # the control: one part no longer at its step
    assert place(jobs) > calls
    for arena in arenas:
        arena.close()


def test_components_uploaded_into_one_scratch_are_stacked_one_component_at_a_time(monkeypatch) -> None:
    """In the scratch, all components' parts share one storage, so the B's of components of one rank and dtype
    (alike, unscaled) fall in one group: grouped by upload unit as well, each component's part of a module in
    every layer is still one copy. The control groups the same places without units and breaks into runs where
    one component's parts end."""
    from vllm_lora_ext.transport import staging
    from vllm_lora_ext.mixing import composite_shapes, concat_many

    jobs, arenas = _layered_jobs(12, [(8, 0.7, torch.bfloat16), (8, 1.3, torch.bfloat16), (8, -0.4, torch.bfloat16)])
    reference = concat_many(jobs, dtype=torch.bfloat16)
    stores = {a.base for a in arenas}
    calls: list[tuple[int, int]] = []
    real = staging._stacked

    def counting(dsts, srcs, scales, units=None):
        out = real(dsts, srcs, scales, units)
        calls.append((len(out), len(real(dsts, srcs, scales))))
        return out

    monkeypatch.setattr(staging, "_stacked", counting)
    ordered = staging.in_source_order(jobs)
    shapes = composite_shapes(ordered, dtype=torch.bfloat16)
    offsets, _, total = staging._composite_layout(shapes)
    buffer = torch.full((total,), 255, dtype=torch.uint8)
    out, moves = staging._composite_moves(ordered, shapes, offsets, buffer)
    staging._upload_and_place(moves, torch.empty(1 << 22, dtype=torch.uint8), None,
                              pinned=lambda t: t.untyped_storage().data_ptr() in stores, copy_up=_host_copy)
    for key in ordered:
        assert torch.equal(out[key][0], reference[key][0]) and torch.equal(out[key][1], reference[key][1]), key
    assert len(calls) == 1  # one batch: the three spans fit the scratch
    with_units, without = calls[0]
    assert with_units == 3 * 4 * 2
    assert without > with_units
    for arena in arenas:
        arena.close()


@pytest.mark.parametrize("cores", [1, 2, 8, 16])
def test_an_unstaged_models_scan_on_threads_names_the_first_nonfinite_factor_in_order(
        cores: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where staging declined (budget, free memory), ``refuse_nonfinite`` scans the CPU factors on up to 4 threads;
    the factor it names is the first in the model's order, as one thread's scan would name it."""
    import vllm_lora_ext._util as util
    from vllm_lora_ext.integration.staging import _first_nonfinite_on_cpu

    monkeypatch.setattr(util, "usable_cores", lambda: cores)
    named = {f"m{i}.lora_b": torch.ones(64, 32, dtype=torch.bfloat16) for i in range(11)}
    assert _first_nonfinite_on_cpu(named) is None
    for bad in ("m9.lora_b", "m2.lora_b", "m5.lora_b"):
        named[bad][7, 3] = float("nan") if bad != "m5.lora_b" else float("-inf")
    assert _first_nonfinite_on_cpu(named) == "m2.lora_b"


def _one_storage(sizes: list[int], gap: int = 64) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """bfloat16 tensors of ``sizes`` elements in one flat storage, each at a 64-byte boundary, ``gap`` bytes apart."""
    at, spans = 0, []
    for n in sizes:
        spans.append((at, n))
        at += -(-(2 * n + gap) // 64) * 64
    flat = torch.randint(0, 256, (at,), dtype=torch.uint8)
    return flat, [flat[a:a + 2 * n].view(torch.bfloat16) for a, n in spans]


def _mirror(tensors: list[torch.Tensor]) -> tuple[list[int], torch.Tensor, list[int]]:
    """Lay ``tensors`` out as ``integration.staging.stage`` does, fill a buffer with its copies and return the
    regions' new starts, the buffer and each tensor's place."""
    from vllm_lora_ext.transport.staging import _as_stored, _layout

    total, regions, places = _layout(tensors)
    stored = _as_stored([(off, t.contiguous()) for off, t in regions])
    assert stored is not None
    total, starts, copies = stored
    moved = dict(zip((off for off, _ in regions), starts))
    buffer = torch.zeros(total, dtype=torch.uint8)
    for at, src in copies:
        buffer[at:at + src.numel()] = src
    return starts, buffer, [moved[p] for p in places]


def test_tensors_of_one_storage_are_laid_out_as_stored_and_its_span_fills_the_buffer_exactly() -> None:
    from vllm_lora_ext.transport.staging import STAGE_ALIGN

    flat, tensors = _one_storage([300, 64, 1000, 7, 4096])
    given = [tensors[2], tensors[0], tensors[4], tensors[0], tensors[1], tensors[3]]  # one given twice
    starts, buffer, places = _mirror(given)
    base = flat.data_ptr()
    assert starts == [t.data_ptr() - base for t in (tensors[2], tensors[0], tensors[4], tensors[1], tensors[3])]
    assert buffer.numel() % STAGE_ALIGN == 0 and buffer.numel() - (flat.numel() - 64) < STAGE_ALIGN
    for t, at in zip(given, places):
        assert at % 64 == 0 and torch.equal(buffer[at:at + t.nbytes], t.view(torch.uint8))  # (bytes: NaNs)


def test_tensors_of_other_storages_go_after_the_span_of_the_one_holding_most() -> None:
    """A hand-over's MoE factors lie in its file; vLLM pins its dense factors into memory of their own."""
    from vllm_lora_ext.transport.staging import STAGE_ALIGN

    flat, tensors = _one_storage([300, 1000, 4096])
    loose = [torch.randn(8, 16).to(torch.bfloat16), torch.randn(16, 8).t()]  # the second strided
    given = [loose[0], tensors[1], loose[1], tensors[0], tensors[2]]
    starts, buffer, places = _mirror(given)
    span = -(-(tensors[2].data_ptr() + tensors[2].nbytes - flat.data_ptr()) // STAGE_ALIGN) * STAGE_ALIGN
    assert starts[1] == tensors[1].data_ptr() - flat.data_ptr() and starts[0] >= span and starts[2] > starts[0]
    for t, at in zip(given, places):
        assert at % STAGE_ALIGN == 0 or at < span
        assert torch.equal(buffer[at:at + t.nbytes], t.contiguous().view(-1).view(torch.uint8))


@pytest.mark.parametrize("case", ["one each", "overlapping", "unaligned", "sparse"])
def test_tensors_not_in_one_storage_compactly_and_apart_keep_a_region_each(case: str) -> None:
    from vllm_lora_ext.transport.staging import _as_stored, _layout

    flat, tensors = _one_storage([256, 256, 256])
    if case == "one each":  # no storage holds two: nothing to gain
        tensors = [t.clone() for t in tensors]
    elif case == "overlapping":  # a part of another, which staging gives a region of its own
        tensors[1] = tensors[0][64:192]
    elif case == "unaligned":
        tensors[1] = flat[6:6 + 512].view(torch.bfloat16)
    elif case == "sparse":  # the span would be far larger than what is staged
        big = torch.zeros(1 << 20, dtype=torch.uint8)
        tensors = [big[:512].view(torch.bfloat16), big[-512:].view(torch.bfloat16)]
    assert _as_stored([(off, t.contiguous()) for off, t in _layout(tensors)[1]]) is None


def test_two_storages_over_the_same_memory_are_two_and_a_span_past_its_storage_is_refused() -> None:
    """Storages are told apart by address and size (two ``frombuffer`` over one buffer share an address): a span
    laid out over the smaller one would reach past its end (r34's review)."""
    import numpy as np

    from vllm_lora_ext.transport.staging import _as_stored

    memory = np.zeros(4096, dtype=np.uint8)
    small, large = torch.frombuffer(memory[:1024], dtype=torch.uint8), torch.frombuffer(memory, dtype=torch.uint8)
    assert small.untyped_storage().data_ptr() == large.untyped_storage().data_ptr()
    regions = [(0, small[0:512]), (512, large[1024:2048]), (1536, large[2048:3072]), (2560, small[512:1024])]
    starts_size, starts, copies = _as_stored(regions)
    assert starts[1:3] == [0, 1024] and [at for at, _ in copies] == [0, 2048, 2560]  # the larger's span, then the rest
    assert copies[0][1].numel() == 2048
