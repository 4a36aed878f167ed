"""Which batch token counts need a fused-MoE LoRA kernel variant of their own, for one model's shape: a replay of
vLLM 0.26-0.33's launch arithmetic, so the warm-up (`integration.warmup`) can run one batch per variant.

A Triton kernel compiles once per key: its constexpr arguments, launch options, and each integer argument's
class (1, divisible by 16, other). For the fused-MoE LoRA kernels the integers that move with the batch's token
count N are the pair count ``N·top_k``, the padded sorted length (``sorted_token_ids``' row stride) and its block
count (``expert_ids``' row stride), and the constexprs that move are the path (pairs assigned one by one or
sorted), the block size ``BLOCK_M`` (the base MoE config's for N tokens, or the tuned table's), the N-axis
program factor and ``BLOCK_K``. Which N fall in which class depends on the model: with 128 experts and top-8 the
padded length ``8N + 128·(BLOCK_M-1)`` is divisible by 16 for every even N, with 8 experts and top-2 only for N = 4
mod 8 (a tiny Qwen3-MoE on an H200 compiled two variants in its first requests that the fixed sweep missed, r43).
So this replays, for every N up to the engine's ``max_num_batched_tokens``, the key each kernel launch would have,
and [`token_counts_for_keys`] returns the smallest N of each key. The arithmetic is transcribed from
``vllm/lora/ops/triton_ops/fused_moe_lora_op.py`` (``_fused_moe_lora``, ``_run_fused_moe_lora_one_shot``,
``_run_fused_moe_lora_small_batch``, ``_pick_small_batch_chunk``) and ``vllm/lora/punica_wrapper/punica_gpu.py``
(``add_lora_w13``'s naive rule, ``moe_lora_align_block_size``'s padded length), the same in 0.26 and 0.33; and
from the plugin's own pair kernels (`integration.moe_pairs`). A replay that drifts from vLLM only costs warm-up
batches or misses a variant (the fixed sweep still runs); it changes no output.

No vLLM, torch or Triton import: the caller passes the shape and the block-size lookup (`integration.warmup`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable

__all__ = ["MoEOpShape", "MoESweepShape", "token_counts_for_keys", "variant_keys"]

SPARSITY_FACTOR = 8  # punica_gpu.add_lora_w13: pairs assigned one by one when N·top_k·8 <= experts x max_loras
SMALL_BATCH_MAX = 1024  # _fused_moe_lora: the small-batch kernel takes pairs x rank up to this, rank up to 64
SMALL_BATCH_MAX_RANK = 64
ONE_SHOT_BLOCK_N = 128
ONE_SHOT_MAX_RANK = 128  # above it vLLM 0.26 asserts and 0.33 takes its older two-kernel path: not replayed
PAIRS_SHRINK_BLOCK_K = 256  # moe_pairs.default_tiles' shrink block of K (both rank tiers)


@dataclasses.dataclass(frozen=True)
class MoEOpShape:
    """One of a layer's two fused-MoE LoRA launches: ``k`` the shrink's input width (A's last axis), ``n`` the
    expand's width per slice (B's axis 2), ``slices`` how many slices, ``a_experts`` A's expert axis as the kernel
    sees it (a shared A is expanded to the local experts first), ``mul_routed_weight`` (w2)."""

    k: int
    n: int
    slices: int
    a_experts: int
    mul_routed_weight: bool


@dataclasses.dataclass(frozen=True)
class MoESweepShape:
    """A fused-MoE LoRA layer as its kernels see it: ``ops`` (w13, w2); ``top_k``; ``local_experts`` (the naive
    rule's); ``kernel_experts`` (the padded length's: all experts with an expert map); ``expert_map`` (expert
    parallelism: never naive); ``fully_sharded`` (another path: nothing to replay); ``max_loras`` (the slot
    tensors' first axis); ``rank`` (the stacked rank); ``sms`` (the GPU's multiprocessors); ``pairs_max_rank``:
    the plugin's pair path takes ranks up to this (0: not in use)."""

    ops: tuple[MoEOpShape, MoEOpShape]
    top_k: int
    local_experts: int
    kernel_experts: int
    expert_map: bool
    fully_sharded: bool
    max_loras: int
    rank: int
    sms: int
    pairs_max_rank: int = 0


def _spec(value: int) -> str:
    """Triton's class of an integer argument."""
    return "1" if value == 1 else "D" if value % 16 == 0 else ""


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _one_shot_key(op: MoEOpShape, shape: MoESweepShape, pairs: int, sorted_len: int | None, block_m: int,
                  grid_loras: int) -> tuple[object, ...]:
    """``_run_fused_moe_lora_one_shot``'s key; ``sorted_len`` None for the naive path, else
    ``(padded length, its block count)`` folded in by the caller."""
    naive = sorted_len is None
    bm = 16 if naive else block_m
    rows = pairs if naive else sorted_len
    blocks = rows if naive else _cdiv(rows, bm)
    programs = max(blocks * op.slices * (1 if naive else grid_loras), 1)
    budget = max(1, int(1.5 / max(op.k / max(op.k + op.n, 1), 1e-3)) + 1)
    if programs >= int(1.5 * shape.sms):
        npid = 1
    else:
        npid = min(max(1, min(16, (2 * shape.sms + programs - 1) // programs)), budget)
    npid = max(1, min(npid, max(1, op.n // ONE_SHOT_BLOCK_N)))
    block_k = 128 if op.k >= 256 or pairs / max(op.a_experts, 1) >= 16 else 64
    return ("one_shot", op.mul_routed_weight, naive, bm, npid, block_k, _spec(pairs))


def _small_batch_key(op: MoEOpShape, shape: MoESweepShape, pairs: int) -> tuple[object, ...]:
    tiles = _cdiv(op.n, 128)
    pair_slices = pairs * op.slices
    target = max(1, 2 * shape.sms)
    per = 1 if pair_slices * tiles <= target else min(_cdiv(pair_slices * tiles, target), tiles)
    chunks = _cdiv(tiles, per)
    return ("small_batch", op.mul_routed_weight, _spec(pair_slices * chunks), _spec(pair_slices), _spec(per),
            _spec(chunks))


def _pairs_key(op: MoEOpShape, shape: MoESweepShape, pairs: int) -> tuple[object, ...]:
    splits = _cdiv(op.k, PAIRS_SHRINK_BLOCK_K)
    return ("pairs", op.mul_routed_weight, _spec(pairs * shape.rank), _spec(splits * pairs * shape.rank))


def variant_keys(n_tokens: int, shape: MoESweepShape, block_m: Callable[[int, int], int],
                 grid_loras: Iterable[int]) -> set[tuple[object, ...]]:
    """The kernel keys a batch of ``n_tokens`` tokens launches in one fused-MoE LoRA layer.

    ``block_m(op_index, n_tokens)``: the shrink config's ``BLOCK_SIZE_M`` for that op (0 w13, 1 w2), as punica
    reads it. ``grid_loras``: the ``num_active_loras`` values the kernels may see (``max_loras + 1``, or the
    counts ``specialize_active_lora`` rounds to).
    """
    if shape.fully_sharded or shape.rank > ONE_SHOT_MAX_RANK or n_tokens < 1:
        return set()
    pairs = n_tokens * shape.top_k
    naive = not shape.expert_map and pairs * SPARSITY_FACTOR <= shape.local_experts * shape.max_loras
    align_m = block_m(0, n_tokens)  # the sorted ids are aligned once, with w13's block size, and w2 reuses them
    padded = pairs * align_m if pairs < shape.kernel_experts else pairs + shape.kernel_experts * (align_m - 1)
    keys: set[tuple[object, ...]] = set()
    for index, op in enumerate(shape.ops):
        if naive:
            if shape.rank <= SMALL_BATCH_MAX_RANK and pairs * shape.rank <= SMALL_BATCH_MAX:
                keys.add(_small_batch_key(op, shape, pairs))
                continue
            if shape.rank <= shape.pairs_max_rank:
                keys.add(_pairs_key(op, shape, pairs))
            keys.add(_one_shot_key(op, shape, pairs, None, 16, 1))
            continue
        strides = ("sorted", _spec(padded), _spec(_cdiv(padded, align_m)))
        for grid in grid_loras:
            keys.add(_one_shot_key(op, shape, pairs, padded, block_m(index, n_tokens), grid) + strides)
    return keys


def token_counts_for_keys(shape: MoESweepShape, max_tokens: int, block_m: Callable[[int, int], int],
                          grid_loras: Iterable[int], *, covered: Iterable[int] = ()) -> list[int]:
    """The smallest token count of each kernel key up to ``max_tokens`` that the counts in ``covered`` do not
    already reach, ascending.

    Example (``tests/gpu/test_moe_warmup.py``'s tiny Qwen3-MoE: 8 experts, top-2, hidden 256, intermediate 96, 2
    slots of rank 16, an H200's 132 SMs, the base config's block size 16 up to 32 tokens, 32 up to 96, then 64,
    beside the fixed sweep of 16 sequences and 256 tokens; its first requests on an H200 compiled N = 36, 60, 84,
    140 and 148's variants in the step):
        >>> from vllm_lora_ext.integration.warmup import warmup_token_counts
        >>> ops = (MoEOpShape(256, 96, 2, 8, False), MoEOpShape(96, 256, 1, 8, True))
        >>> tiny = MoESweepShape(ops, 2, 8, 8, False, False, 2, 16, 132, pairs_max_rank=32)
        >>> bm = lambda op, n: 16 if n <= 32 else 32 if n <= 96 else 64
        >>> token_counts_for_keys(tiny, 256, bm, [3], covered=warmup_token_counts(16, 256))
        [36, 68, 100, 229, 236]
    """
    grids = sorted(set(grid_loras))
    reached: set[tuple[object, ...]] = set()
    for n in covered:
        if 1 <= n <= max_tokens:
            reached |= variant_keys(n, shape, block_m, grids)
    found = []
    for n in range(1, max_tokens + 1):
        new = variant_keys(n, shape, block_m, grids) - reached
        if new:
            found.append(n)
            reached |= new
    return found
