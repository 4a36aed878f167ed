"""The fused-MoE LoRA of a small batch, one (token, expert) pair at a time, in two Triton kernels: shrink, then
expand (issue 39 item 1), for the patch of ``PunicaWrapperGPU.add_lora_fused_moe``
(``integration.kernels.make_add_lora_fused_moe``).

vLLM 0.26-0.33 assigns the pairs of a small batch one by one ("naive block assignment": when ``tokens x top_k x
8 <= experts x max_loras``, e.g. 32 decode tokens, top-8 of 128 experts, 16 slots) and gives each pair a whole
program of its one-shot kernel: a 16-row tensor-core tile holding one row, the rank-r shrink over all of K, then
the expand over all of N, in sequence. Here the shrink is one program per (pair, slice, block of K), each writing
an fp32 partial, and the expand one per (pair, slice, block of N), which sums the partials, rounds them to the
output's dtype (as the one-shot rounds its shrink), applies the routed weight where vLLM does and adds the
rounded delta to the output. Both stop at the slot's live rank where a table of them is given
(`integration.slot_ranks`): the shrink has a program per 16 rank rows, and those past the live rank return at once;
the expand takes the rows in one pass masked past the live rank where the slots' rank fits its pass
([`default_tiles`]), else in passes up to the live rank (smaller passes are a tile the probe can try). An r16
adapter in r32 slots, as in an engine at ``max_lora_rank`` 32 for two-adapter mixes, skips the zero rows. On SM90
and later both launch with programmatic dependent launch ([`Launch`]): the expand's programs start beside the
shrink and read their B before they wait for its partials, which took one layer's step at rank 16 from 30.0 to 24.5
µs with one adapter and from 39.1 to 32.0 µs with 16 (an H200, ``bench/results/probe_moe_pairs_h200_r45b.json``;
against vLLM's kernel, with the same largest error against an fp32 reference: ``probe_moe_pairs_h200_r39.json``,
``bench/probe_moe_pairs.py``).

Which batches take it is `integration.kernels.make_add_lora_fused_moe`'s rule; this module is imported on their
first call (it needs Triton), never by ``register()``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

__all__ = ["Launch", "PairRouting", "default_tiles", "moe_lora_pairs", "pointers_ready"]


@triton.jit
def _pair_lora(token_lora_ptr, enabled_ptr, expert_ptr, pair, top_k, max_loras):
    """The pair's LoRA slot and expert; a slot of -1 where the pair has none (no adapter, a disabled slot, no
    expert)."""
    lora = tl.load(token_lora_ptr + pair // top_k).to(tl.int64)
    expert = tl.load(expert_ptr + pair).to(tl.int64)
    ok = (lora >= 0) & (lora < max_loras) & (expert >= 0)
    if ok:
        ok = tl.load(enabled_ptr + lora) != 0
    return tl.where(ok, lora, -1), expert


@triton.jit
def _live_rank(ranks_ptr, lora, RANK: tl.constexpr, HAS_RANKS: tl.constexpr):
    """How many rank rows of slot ``lora`` to read: its entry of ``ranks_ptr`` (at most ``RANK``) where
    ``HAS_RANKS``, else ``RANK``. The rows past a slot's live rank are zeros."""
    if HAS_RANKS:
        return tl.minimum(tl.load(ranks_ptr + lora), RANK)
    return RANK


@triton.jit
def _shrink_kernel(x_ptr, a_ptrs, part_ptr, token_lora_ptr, enabled_ptr, expert_ptr, ranks_ptr,
                   K, top_k, max_loras, x_row_div,
                   stride_xm, stride_al, stride_ae, stride_ar, stride_ps, stride_pk, stride_pp,
                   RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, HAS_RANKS: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """One (pair, slice and ``BLOCK_R`` rank rows, block of K): the block's share of those rows of the pair's
    shrink, in fp32; nothing where the rows start at or past the slot's live rank. Under ``USE_PDL`` it first waits
    for the kernels before it, then lets the expand start (see [`moe_lora_pairs`])."""
    if USE_PDL:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pair = tl.program_id(0)
    s = tl.program_id(1) // tl.cdiv(RANK, BLOCK_R)
    r0 = (tl.program_id(1) % tl.cdiv(RANK, BLOCK_R)) * BLOCK_R
    kb = tl.program_id(2)
    lora, expert = _pair_lora(token_lora_ptr, enabled_ptr, expert_ptr, pair, top_k, max_loras)
    if lora < 0:
        return
    live = _live_rank(ranks_ptr, lora, RANK, HAS_RANKS)
    if r0 >= live:
        return
    a_base = tl.load(a_ptrs + s).to(tl.pointer_type(x_ptr.dtype.element_ty))
    a_base += lora * stride_al + expert * stride_ae
    offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
    k_mask = offs_k < K
    offs_r = r0 + tl.arange(0, BLOCK_R)
    r_mask = offs_r < live
    xk = tl.load(x_ptr + (pair // x_row_div).to(tl.int64) * stride_xm + offs_k, mask=k_mask, other=0.0)
    ak = tl.load(a_base + offs_r[:, None] * stride_ar + offs_k[None, :], mask=r_mask[:, None] & k_mask[None, :],
                 other=0.0)
    part = tl.sum(ak.to(tl.float32) * xk.to(tl.float32)[None, :], axis=1)
    tl.store(part_ptr + s * stride_ps + kb * stride_pk + pair * stride_pp + offs_r, part, mask=r_mask)


@triton.jit
def _b_rows(b_base, offs_n, n_mask, r0, live, stride_bn, stride_br, BLOCK_R: tl.constexpr):
    """Rank rows ``r0`` to ``r0 + BLOCK_R`` (those below ``live``) of B over a block of N, in fp32."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    return tl.load(b_base + offs_n[:, None] * stride_bn + offs_r[None, :] * stride_br,
                   mask=n_mask[:, None] & (offs_r < live)[None, :], other=0.0).to(tl.float32)


@triton.jit
def _expand_rows(part_base, b, offs_kb, r0, live, out_ty: tl.constexpr, BLOCK_R: tl.constexpr,
                 K_SPLITS: tl.constexpr):
    """Rank rows ``r0`` to ``r0 + BLOCK_R`` (those below ``live``) of a pair's expand over a block of N: the shrink
    of those rows (its K blocks summed, then rounded to ``out_ty`` as vLLM's one-shot rounds it) times ``b``
    (`_b_rows`), in fp32."""
    offs_r = r0 + tl.arange(0, BLOCK_R)
    parts = tl.load(part_base + offs_r[None, :], mask=(offs_kb < K_SPLITS)[:, None] & (offs_r < live)[None, :],
                    other=0.0)
    u = tl.sum(parts, axis=0).to(out_ty).to(tl.float32)
    return tl.sum(b * u[None, :], axis=1)


@triton.jit
def _expand_kernel(part_ptr, b_ptrs, out_ptr, weights_ptr, token_lora_ptr, enabled_ptr, expert_ptr, ranks_ptr,
                   N, top_k, max_loras,
                   stride_bl, stride_be, stride_bn, stride_br, stride_ps, stride_pk, stride_pp, stride_om,
                   RANK: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, K_SPLITS: tl.constexpr,
                   BLOCK_KS: tl.constexpr,
                   MUL_ROUTED_WEIGHT: tl.constexpr, ADD_INPUTS: tl.constexpr, HAS_RANKS: tl.constexpr,
                   USE_PDL: tl.constexpr):
    """One (pair, slice, block of N): the pair's shrink (its K blocks summed), times B, into the output,
    ``BLOCK_R`` rank rows at a time up to the slot's live rank. Under ``USE_PDL`` a one-pass program reads its B
    before it waits for the shrink."""
    pair = tl.program_id(0)
    s = tl.program_id(1)
    nb = tl.program_id(2)
    lora, expert = _pair_lora(token_lora_ptr, enabled_ptr, expert_ptr, pair, top_k, max_loras)
    if lora < 0:
        return
    live = _live_rank(ranks_ptr, lora, RANK, HAS_RANKS)
    b_base = tl.load(b_ptrs + s).to(tl.pointer_type(out_ptr.dtype.element_ty))
    b_base += lora * stride_bl + expert * stride_be
    offs_kb = tl.arange(0, BLOCK_KS)
    part_base = part_ptr + s * stride_ps + offs_kb[:, None] * stride_pk + pair * stride_pp
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    if RANK <= BLOCK_R:  # one pass, its rows past the live rank masked
        b = _b_rows(b_base, offs_n, n_mask, 0, live, stride_bn, stride_br, BLOCK_R)
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        d = _expand_rows(part_base, b, offs_kb, 0, live, out_ptr.dtype.element_ty, BLOCK_R, K_SPLITS)
    else:
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
        d = tl.zeros([BLOCK_N], dtype=tl.float32)
        for r0 in range(0, live, BLOCK_R):
            b = _b_rows(b_base, offs_n, n_mask, r0, live, stride_bn, stride_br, BLOCK_R)
            d += _expand_rows(part_base, b, offs_kb, r0, live, out_ptr.dtype.element_ty, BLOCK_R, K_SPLITS)
    if MUL_ROUTED_WEIGHT:
        d = d * tl.load(weights_ptr + pair).to(tl.float32)
    out = out_ptr + pair.to(tl.int64) * stride_om + s * N + offs_n
    if ADD_INPUTS:
        prev = tl.load(out, mask=n_mask, other=0.0).to(tl.float32)  # the delta rounded, then added (as vLLM)
        d = d.to(out_ptr.dtype.element_ty).to(tl.float32)
        tl.store(out, (prev + d).to(out_ptr.dtype.element_ty), mask=n_mask)
    else:
        tl.store(out, d.to(out_ptr.dtype.element_ty), mask=n_mask)


_PTRS: dict[tuple[int, ...], torch.Tensor] = {}


def _addresses(stacked: Sequence[torch.Tensor]) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in stacked)


def _pointers(stacked: Sequence[torch.Tensor]) -> torch.Tensor:
    """The slices' base addresses as one int64 tensor on their device, made once per set of slot tensors (they
    live as long as the LoRA manager; CUDA graphs replay the same addresses)."""
    key = _addresses(stacked)
    found = _PTRS.get(key)
    if found is None:
        found = _PTRS[key] = torch.tensor(key, dtype=torch.int64, device=stacked[0].device)
    return found


class PairRouting(NamedTuple):
    """Where a batch's (token, expert) pairs go: ``topk_weights`` ``(tokens, top_k)``; ``expert_ids``
    ``(tokens x top_k,)``; ``token_lora_mapping`` ``(tokens,)``, a slot or -1; ``adapter_enabled``, per slot, 0
    where the slot's adapter has no experts; ``slot_ranks``, int32 per slot, each slot's live rank, past which its
    rows are zeros (`integration.slot_ranks`), so an r16 adapter in r32 slots reads 16 of them (None:
    every row is read)."""

    topk_weights: torch.Tensor
    expert_ids: torch.Tensor
    token_lora_mapping: torch.Tensor
    adapter_enabled: torch.Tensor
    slot_ranks: torch.Tensor | None = None


class Launch(NamedTuple):
    """How [`moe_lora_pairs`] launches: ``tiles`` instead of [`default_tiles`]; ``pdl``: both kernels with
    programmatic dependent launch (SM90 and later; the caller decides, as vLLM's ``supports_pdl`` does for its own
    LoRA kernels). The shrink waits for the kernels before it, then lets the expand's programs start, which read
    their B beside the shrink and wait for it before they read its partials."""

    tiles: tuple[int, int, int, int] | None = None
    pdl: bool = False


def default_tiles(rank: int) -> tuple[int, int, int, int]:
    """``(block_k, block_n, warps, expand_rows)`` for slots of rank ``rank``: the shrink's block of K, the expand's
    block of N, the warps a program and the rank rows an expand pass takes (the shrink's are always 16)."""
    return (256, 128, 1, 16) if rank <= 16 else (256, 64, 1, 32)


def moe_lora_pairs(output: torch.Tensor, x: torch.Tensor,
                   factors: tuple[Sequence[torch.Tensor], Sequence[torch.Tensor]], routing: PairRouting, *,
                   mul_routed_weight: bool, add_inputs: bool = True, launch: Launch = Launch()) -> None:
    """Add each (token, expert) pair's LoRA delta to ``output``, as vLLM's ``_fused_moe_lora`` does for a batch
    whose pairs it assigns one by one (``sorted_token_ids`` None).

    ``output``: ``(tokens, top_k, slices x N)``, contiguous. ``x``: ``(tokens, K)`` for w13, or ``(tokens x top_k,
    K)`` where ``mul_routed_weight`` (w2), as vLLM couples them. ``factors``: ``(lora_a, lora_b)``, per slice
    ``(max_loras, experts, r, K)`` and ``(max_loras, experts, N, r)``. ``launch``: see [`Launch`].
    """
    lora_a, lora_b = factors
    topk_weights, expert_ids, token_lora_mapping, adapter_enabled, slot_ranks = routing
    tokens, top_k = topk_weights.shape
    pairs = tokens * top_k
    slices = len(lora_a)
    a0, b0 = lora_a[0], lora_b[0]
    max_loras, _, rank, k = a0.shape
    n = b0.shape[2]
    if pairs == 0 or slices == 0:
        return
    assert output.is_contiguous() and output.shape[-1] == slices * n, "output must be (tokens, top_k, slices x N)"
    assert x.stride(1) == 1 and a0.stride(3) == 1, "x and lora_a must be contiguous along K"
    block_k, block_n, warps, expand_rows = launch.tiles or default_tiles(rank)
    pdl = launch.pdl
    splits = triton.cdiv(k, block_k)
    part = torch.empty((slices, splits, pairs, rank), dtype=torch.float32, device=x.device)
    if rank <= 16:  # one pass of 16 rows whatever the live rank: the table would only cost its read
        slot_ranks = None
    ranks = token_lora_mapping if slot_ranks is None else slot_ranks  # (any int tensor where no table is read)
    _shrink_kernel[(pairs, slices * triton.cdiv(rank, 16), splits)](
        x, _pointers(lora_a), part, token_lora_mapping, adapter_enabled, expert_ids, ranks,
        k, top_k, max_loras, 1 if mul_routed_weight else top_k,
        x.stride(0), a0.stride(0), a0.stride(1), a0.stride(2), part.stride(0), part.stride(1), part.stride(2),
        RANK=rank, BLOCK_R=16, BLOCK_K=block_k, HAS_RANKS=slot_ranks is not None, USE_PDL=pdl, num_warps=warps,
        launch_pdl=pdl)
    _expand_kernel[(pairs, slices, triton.cdiv(n, block_n))](
        part, _pointers(lora_b), output, topk_weights, token_lora_mapping, adapter_enabled, expert_ids, ranks,
        n, top_k, max_loras,
        b0.stride(0), b0.stride(1), b0.stride(2), b0.stride(3), part.stride(0), part.stride(1), part.stride(2),
        output.stride(1),
        RANK=rank, BLOCK_R=expand_rows, BLOCK_N=block_n, K_SPLITS=splits,
        BLOCK_KS=max(triton.next_power_of_2(splits), 2),
        MUL_ROUTED_WEIGHT=mul_routed_weight, ADD_INPUTS=add_inputs, HAS_RANKS=slot_ranks is not None,
        USE_PDL=pdl, num_warps=warps, launch_pdl=pdl)


def pointers_ready(*stacked: Sequence[torch.Tensor]) -> bool:
    """Whether the address tables of ``stacked`` exist, or may be made now (not inside a CUDA graph capture, where
    copying a host table to the GPU would be captured from memory that is gone on replay)."""
    if not torch.cuda.is_current_stream_capturing():
        return True
    return all(_addresses(s) in _PTRS for s in stacked)
