"""Read planned MoE blocks ([`ExpertsPlan`]) from a [`TensorSource`] into the normalized [`ExpertsLoRA`].

A source offers whole tensors and ``(dim, start, stop)`` ranges of them (``read``) and many whole tensors at once
(``read_many``). A source may also read straight into place ([`BulkReads`], a [`SafetensorsReader`]'s methods):
groups of same-shape tensors stacked (``read_stacks``), some elements of every row (``gather``) and a tensor
transposed and scaled on its way (``read_transposed``). A read uses each of them the source has (an attribute that
is missing or ``None`` is read around) where it applies, and reads key by key where it declines (``None``).
[`ReadOptions`] says how: dtype, scaling, NaN check, target memory, threads.

What is read for a rank: the per-expert (2D) keys of its experts only; of a fused (3D) tensor, A's rows
``[e·r, (e+1)·r)`` and B's columns ``{i·E + e}`` of its experts only.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.formats.moe import Alloc, ExpertFactors, ExpertsLoRA, MoESpec, _into
from vllm_lora_ext.formats.moe_plan import ExpertsPlan, Key2D, Key3D
from vllm_lora_ext.validation import check_finite

__all__ = ["TensorSource", "BulkReads", "ReadOptions", "default_scan_workers", "read_experts", "read_blocks",
           "read_pools", "default_readers", "READ_POOL", "SCAN_POOL"]

Ranges = Sequence[tuple[int, int, int]]
"""``[(dim, start, stop), ...]``: slices of one tensor along one dim, concatenated in that order."""


class TensorSource(Protocol):
    """Where a MoE block's tensors come from: a weight file's reader, or tensors already in memory."""

    def read(self, key: str, ranges: Ranges | None = None) -> torch.Tensor:
        """The tensor ``key``, or with ``ranges`` only those slices, concatenated (no other rows or columns read)."""

    def read_many(self, keys: Sequence[str], *, copy: bool = True) -> Mapping[str, torch.Tensor]:
        """Whole tensors for ``keys``; with ``copy=False`` they may be views into shared buffers."""


class BulkReads(Protocol):
    """The reads straight into place a [`TensorSource`] may also offer, each on its own ([`SafetensorsReader`])."""

    def read_stacks(self, groups: Sequence[Sequence[str]], into: Alloc | None = None, *,
                    bundle: int = 1) -> list[torch.Tensor | None]:
        """Each group of same-shape tensors stacked (memory from ``into``), or ``None`` for a group it declines."""

    def gather(self, key: str, pieces: Callable[[torch.Tensor], Sequence[torch.Tensor]],
               into: Alloc | None = None) -> torch.Tensor:
        """``torch.cat(pieces(t))`` for the tensor ``t``, copied out a block of rows at a time."""

    def read_transposed(self, key: str, cols: int, into: Alloc | None = None, *, scale: float | None = None,
                        dtype: torch.dtype | None = None, device: torch.device | None = None,
                        lying: bool = False) -> torch.Tensor | None:
        """``t.reshape(-1, cols).t() * scale``, contiguous (with ``lying``: ``t``'s bytes as stored, under that
        shape); ``None`` where ``t`` is not in ``dtype``."""


@dataclass(frozen=True)
class ReadOptions:
    """How MoE blocks are read.

    Attributes:
        dtype: the dtype factors are kept in (``None``: as stored).
        scaled: fold the adapter's scaling (``alpha/r`` or rsLoRA, rank/alpha patterns per projection) into B, in
            float32; ``False``: B as stored.
        check_finite_as: the adapter's name: factors holding NaN or infinity are refused, naming it (``None``: not
            checked).
        alloc: memory the factors are written into (a build process's shared file, a host arena); ``None``: new
            tensors.
        fused_gate_up: the blocks (by prefix) whose fused gate_up B stays fused (the model's wrapper is 3D), so it
            too is written into ``alloc``'s memory; other blocks' fused B is split later, into new tensors.
        transpose_on: a CUDA device that transposes a fused B ([`BulkReads.read_transposed`]); ``None``
            or any other device: the CPU does.
        defer_turn: without a CUDA ``transpose_on``, leave a fused B that would be read transposed as stored, in
            ``alloc``'s memory, marked ``ExpertFactors.lying``: the caller turns it (on its GPU once staged).
            Only where nothing is scanned (``check_finite_as=None``): scaling may overflow, so the caller scans the
            turned factors.
        workers: blocks [`read_blocks`] reads at a time (``None``: [`default_readers`]).
        scan_workers: threads [`read_blocks`] scans blocks for NaN/inf on while the next are read (``None``:
            up to 2 of the cores the readers leave).
        pools: where those threads come from: an object with ``lent_pool(name, workers)`` and
            ``run_in_pool(name, workers, fn, items)`` (serving code passes ``vllm_lora_ext.transport.pools``, whose
            pools are kept between loads); ``None``: pools made for the call.
    """

    dtype: torch.dtype | None = None
    scaled: bool = True
    check_finite_as: str | None = None
    alloc: Alloc | None = None
    fused_gate_up: frozenset[str] = frozenset()
    transpose_on: torch.device | None = None
    defer_turn: bool = False
    workers: int | None = None
    scan_workers: int | None = None
    pools: Any = None

    def __post_init__(self) -> None:
        if self.defer_turn and self.check_finite_as is not None:
            raise ValueError("ReadOptions(defer_turn=True) scans nothing: the caller scans the turned factors")


@dataclass
class _Block:
    """One block's read: where from, which experts, how, and the result being filled in."""

    plan: ExpertsPlan
    source: TensorSource
    config: AdapterConfig
    options: ReadOptions
    keep: tuple[int, ...]
    out: ExpertsLoRA
    # the source's [`BulkReads`] methods, each None where it has none
    stacks: Callable[..., list[torch.Tensor | None]] | None = field(init=False)
    gather: Callable[..., torch.Tensor] | None = field(init=False)
    transposed: Callable[..., torch.Tensor | None] | None = field(init=False)

    def __post_init__(self) -> None:
        self.stacks = getattr(self.source, "read_stacks", None)
        self.gather = getattr(self.source, "gather", None)
        self.transposed = getattr(self.source, "read_transposed", None)

    @property
    def gpu(self) -> torch.device | None:
        device = self.options.transpose_on
        return device if device is not None and device.type == "cuda" else None


def read_experts(plan: ExpertsPlan, source: TensorSource, *, config: AdapterConfig,
                 experts: Sequence[int] | None = None, options: ReadOptions = ReadOptions()) -> ExpertsLoRA:
    """Read one planned MoE block for the kept ``experts`` (default: all, in this order) and normalize it.

    2D keys of other experts are never read; 3D tensors are read as row ranges of A and column ranges of B for
    the kept experts only. Scaling is folded into B in float32, then cast to ``options.dtype``. With
    ``options.check_finite_as``, factors holding NaN or infinity are refused while they are still hot in cache.
    With a source's [`BulkReads`], whole per-expert stacks and fused A are read straight into ``options.alloc``'s
    memory, a rank's columns of a fused B are copied out of the file straight into their final order, once, and
    all of a standard fused B is read transposed and scaled on its way.

    Raises:
        [`AdapterFormatError`]: a factor holds NaN or infinity (names the block and projection).
    """
    spec = plan.spec
    keep = tuple(range(spec.num_experts)) if experts is None else tuple(experts)
    out = ExpertsLoRA(prefix=spec.prefix, experts=keep, intermediate=spec.intermediate, interleaved=spec.interleaved)
    block = _Block(plan, source, config, options, keep, out)
    _read_2d(block)
    for k3 in plan.keys_3d:
        _read_3d(block, k3)
    if options.check_finite_as is not None:
        check_finite(_factors(out), adapter=options.check_finite_as)
    return out


def _read_2d(blk: _Block) -> None:
    """The per-expert keys of the kept experts, stacked per role (one copy out of the source: the reads may be
    views into its buffers), then scaled per block in float32."""
    pos = {e: j for j, e in enumerate(blk.keep)}
    by_role: dict[str, list[Key2D]] = {}
    for k in blk.plan.keys_2d:
        if k.expert in pos:
            by_role.setdefault(k.role, []).append(k)
    for role in by_role:
        by_role[role].sort(key=lambda k: pos[k.expert])
    uniform = not blk.config.has_patterns
    stacked = _read_stacked(blk, by_role) if blk.stacks is not None and uniform else {}
    wanted = [key for role, ks in by_role.items() if role not in stacked for k in ks for key in (k.key_a, k.key_b)]
    loaded = dict(blk.source.read_many(wanted, copy=False))
    n = len(blk.keep)
    for role, ks in by_role.items():
        r = max(k.rank for k in ks)
        if role in stacked or uniform and len(ks) == n and all(k.rank == r for k in ks):
            pair = stacked.pop(role) if role in stacked else _stack_loaded(loaded, ks, blk.options)
            setattr(blk.out, role, _whole_role(blk, role, r, pair))
        else:  # missing experts (no delta), mixed ranks or per-module patterns
            setattr(blk.out, role, _role_by_expert(blk, role, ks, loaded, pos))
    del loaded


def _read_stacked(blk: _Block, by_role: Mapping[str, list[Key2D]]) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """The roles that are a full set of experts of one rank, read stacked straight from the file (one copy per
    factor, no tensor per key), in ``alloc``'s memory where the dtype is the one kept."""
    n = len(blk.keep)
    whole = [role for role, ks in by_role.items() if len(ks) == n and len({k.rank for k in ks}) == 1]
    if not whole:
        return {}
    into = _memory(blk.options.alloc, blk.options.dtype)
    got = blk.stacks([[getattr(k, f) for k in by_role[role]] for role in whole for f in ("key_a", "key_b")], into,
                     bundle=2)
    stacked: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for i, role in enumerate(whole):
        a, b = got[2 * i], got[2 * i + 1]
        if a is not None and b is not None:  # both or neither (bundle=2)
            stacked[role] = (a, b)
    return stacked


def _stack_loaded(loaded: Mapping[str, torch.Tensor], ks: list[Key2D],
                  options: ReadOptions) -> tuple[torch.Tensor, torch.Tensor]:
    """A role's factors read key by key, stacked (straight into ``alloc``'s memory where the dtype is kept)."""
    source_dtype = loaded[ks[0].key_a].dtype
    direct = options.alloc if options.dtype is None or options.dtype == source_dtype else None
    return _stack([loaded[k.key_a] for k in ks], direct), _stack([loaded[k.key_b] for k in ks], direct)


def _whole_role(blk: _Block, role: str, r: int, pair: tuple[torch.Tensor, torch.Tensor]) -> ExpertFactors:
    """A role with every kept expert at rank ``r``, stacked: B scaled once (one rounding of s·B to the kept dtype,
    computed in float32 either way: torch's opmath), both in ``alloc``'s memory in the kept dtype."""
    spec, opts = blk.plan.spec, blk.options
    a, b = pair
    s = blk.config.scaling_for(f"{spec.prefix}.0.{_proj_name(spec, role)}", r) if opts.scaled else 1.0
    target = opts.dtype if opts.dtype is not None else a.dtype
    b = b.mul_(s) if b.dtype == target else b.float().mul_(s)
    if opts.alloc is None or a.dtype != target:  # not built in alloc's memory in the target dtype
        a, b = _into(a, opts.alloc, target), _into(b, opts.alloc, target)
    return ExpertFactors(a, b)


def _role_by_expert(blk: _Block, role: str, ks: list[Key2D], loaded: Mapping[str, torch.Tensor],
                    pos: Mapping[int, int]) -> ExpertFactors:
    """A role with missing experts (zeros: no delta), mixed ranks or per-module patterns, built expert by expert
    in float32 at the largest rank."""
    spec, opts = blk.plan.spec, blk.options
    n, r, name = len(blk.keep), max(k.rank for k in ks), _proj_name(spec, role)
    d_in = spec.intermediate if role == "down" else spec.hidden
    d_out = spec.hidden if role == "down" else spec.intermediate
    a = torch.zeros(n, r, d_in, dtype=torch.float32)
    b = torch.zeros(n, d_out, r, dtype=torch.float32)
    for k in ks:
        j = pos[k.expert]
        s = blk.config.scaling_for(_pattern_name(k.key_a), k.rank) if opts.scaled else 1.0
        a[j, : k.rank] = loaded[k.key_a]
        b[j, :, : k.rank] = loaded[k.key_b].float() * s
    target = opts.dtype if opts.dtype is not None else a.dtype
    return ExpertFactors(_into(a, opts.alloc, target), _into(b, opts.alloc, target))


def _read_3d(blk: _Block, k3: Key3D) -> None:
    """One fused (3D) pair, the kept experts' A rows and B columns, as ``(n, r, in)`` and ``(n, out, r)``."""
    spec, opts = blk.plan.spec, blk.options
    n, r = len(blk.keep), k3.rank
    a_file, a_in_alloc = _read_3d_a(blk, k3)  # (n·r, in): whole rows
    target = opts.dtype if opts.dtype is not None else a_file.dtype
    a3 = a_file.reshape(n, r, a_file.shape[1])
    # A fused gate_up B is put in ``alloc`` only where it is kept fused (a 3D-wrapper model): a 2D-wrapper
    # model splits it into new tensors (which are).
    b_alloc = opts.alloc if k3.role != "gate_up" or spec.prefix in opts.fused_gate_up else None
    name = "gate_up_proj" if k3.role == "gate_up" else "down_proj"
    s = blk.config.scaling_for(_pattern_name(k3.key_a, name), r) if opts.scaled else 1.0
    b3, state = _read_3d_b(blk, k3, b_alloc, s, target)
    lying = (b3.numel() // n, n, s) if state == "lying" else None
    if state not in ("done", "lying"):
        if k3.orientation == "transposed":  # stored ΔW_eᵀ = B_e A_e  ->  ΔW_e = A_eᵀ B_eᵀ
            a3, b3 = b3.transpose(1, 2), a3.transpose(1, 2)
        if b3.dtype == target:  # one copy into (n, out, r) order, then scale in place (float32 opmath)
            # (2x faster than torch.mul(b3, s, out=...) on this permuted view)
            if state != "final":
                b3 = _into_by_rows(b3, b_alloc) if k3.orientation == "standard" else _into(b3, b_alloc)
            b3 = b3.mul_(s)
        else:
            b3 = _into(b3.float() * s, b_alloc, target)
    setattr(blk.out, k3.role, ExpertFactors(a3 if a_in_alloc else _into(a3, opts.alloc, target), b3, lying))


def _read_3d_a(blk: _Block, k3: Key3D) -> tuple[torch.Tensor, bool]:
    """A fused A's rows of the kept experts, ``(n·r, in)``, and whether they already are in ``alloc``'s memory in
    the kept dtype (all of a standard A is read stacked straight there)."""
    opts, r = blk.options, k3.rank
    full = len(blk.keep) == blk.plan.spec.num_experts
    if full and blk.stacks is not None:  # whole tensors: read with preadv, A straight into alloc's memory
        a_mem = _memory(opts.alloc if k3.orientation == "standard" else None, opts.dtype)
        got = blk.stacks([[k3.key_a]], a_mem)[0]
        if got is not None:
            return got[0], a_mem is not None and opts.dtype in (None, got[0].dtype)
    rows = [(0, start * r, stop * r) for start, stop in _ranges(blk.keep)]
    return blk.source.read(k3.key_a, None if full else rows), False


def _read_3d_b(blk: _Block, k3: Key3D, b_alloc: Alloc | None, s: float,
               target: torch.dtype) -> tuple[torch.Tensor, str]:
    """A fused B's columns of the kept experts as ``(n, out, r)``, and its state: ``"done"`` (read transposed and
    scaled, in its final memory), ``"lying"`` (as stored, in ``alloc``'s memory: ``ReadOptions.defer_turn``),
    ``"final"`` (contiguous in the memory it is kept in, not scaled) or ``"view"`` (a view of what was read, to be
    copied and scaled).

    A rank's share of B (its columns sit in every row) is copied once out of the file, straight into (n, out, r)
    order, a block of rows at a time. All of a standard B is one transpose of its bytes as an (out·r, E) matrix:
    read, transposed in cache and scaled into place a block at a time.
    """
    e_all, n, r = blk.plan.spec.num_experts, len(blk.keep), k3.rank
    full, standard = n == e_all, k3.orientation == "standard"
    if blk.transposed is not None and full and standard:
        # (left lying, a fused gate_up B goes into ``alloc`` as well: its halves are then the split's gate and up)
        lying = blk.options.defer_turn and blk.gpu is None
        done = blk.transposed(k3.key_b, e_all, blk.options.alloc if lying else b_alloc, scale=s, dtype=target,
                              device=blk.gpu, lying=lying)
        if done is not None:
            return done.view(n, -1, r), "lying" if lying else "done"
    spans = _ranges(blk.keep)
    if blk.gather is not None and not full:
        b_mem = b_alloc if standard else None
        b3 = blk.gather(k3.key_b, lambda t: [t.view(t.shape[0], r, e_all)[:, :, i:j].permute(2, 0, 1)
                                             for i, j in spans], _memory(b_mem, target))
        return b3, "final" if standard and (b_mem is None or b3.dtype == target) else "view"
    b_file = None
    if full and blk.stacks is not None:
        got = blk.stacks([[k3.key_b]])[0]
        b_file = got[0] if got is not None else None
    if b_file is None:
        columns = [(1, i * e_all + start, i * e_all + stop) for i in range(r) for start, stop in spans]
        b_file = blk.source.read(k3.key_b, None if full else columns)  # (out, r·n) ordered (i, e)
    return b_file.reshape(b_file.shape[0], r, n).permute(2, 0, 1), "view"


def _ranges(ids: Sequence[int]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for e in ids:
        if out and out[-1][1] == e:
            out[-1] = (out[-1][0], e + 1)
        else:
            out.append((e, e + 1))
    return out


def _memory(alloc: Alloc | None, want: torch.dtype | None) -> Alloc | None:
    """Where a tensor read straight from the file goes (`read_stacks`, `gather`): ``alloc``'s memory if its dtype
    is the one kept (``want``; None: any), else a new tensor (converted later, by a copy into ``alloc``); None
    (new tensors) without ``alloc``."""
    if alloc is None:
        return None

    def memory(shape: tuple[int, ...], source: torch.dtype) -> torch.Tensor:
        return alloc(shape, source) if want in (None, source) else torch.empty(shape, dtype=source)

    return memory


_ROW_BLOCK = 64  # rows of a fused B copied at a time (see `_into_by_rows`)


def _into_by_rows(t: torch.Tensor, alloc: Alloc | None) -> torch.Tensor:
    """``_into(t, alloc)`` for a fused B's ``(n, out, r)`` view of its file ``(out, r·n)`` rows, copied
    ``_ROW_BLOCK`` rows at a time: a block's source rows (64 × 4 KiB at r=16, 128 experts) stay in cache while
    every expert takes its ``r`` columns from them, instead of each expert's pass reading one element of
    every cache line of the whole tensor. The same bytes as one copy."""
    out = alloc(tuple(t.shape), t.dtype) if alloc is not None else torch.empty(t.shape, dtype=t.dtype)
    for i in range(0, t.shape[1], _ROW_BLOCK):
        out[:, i:i + _ROW_BLOCK].copy_(t[:, i:i + _ROW_BLOCK])
    return out


def _stack(tensors: list[torch.Tensor], alloc: Alloc | None) -> torch.Tensor:
    if alloc is None:
        return torch.stack(tensors)
    return torch.stack(tensors, out=alloc((len(tensors), *tensors[0].shape), tensors[0].dtype))


def _factors(ex: ExpertsLoRA) -> dict[str, torch.Tensor]:
    return {f"{ex.prefix} {role} lora_{w}": getattr(f, w.lower())
            for role in ("gate_up", "gate", "up", "down") if (f := getattr(ex, role)) is not None for w in ("A", "B")}


def _pattern_name(key: str, parameter: str | None = None) -> str:
    """The name PEFT matched ``rank_pattern``/``alpha_pattern`` against for the factor ``key``: its module as the file
    names it (without ``base_model.model.``; not the running model's block, which a weights mapper or a
    transformers-v5 block name may call otherwise), and for a fused 3D factor its experts module's ``parameter``
    (``...experts.gate_up_proj``, PEFT's ``target_parameters`` key)."""
    from vllm_lora_ext.formats import classify_key

    info = classify_key(key)
    if parameter is None:
        return info.module
    module = info.module
    while module.endswith(".base_layer"):
        module = module[: -len(".base_layer")]
    return f"{module}.{parameter}"


def _proj_name(spec: MoESpec, role: str) -> str:
    return {"gate": spec.gate, "up": spec.up, "down": spec.down}[role]


def default_scan_workers(cores: int, readers: int) -> int:
    """Threads that scan read blocks for NaN/inf beside ``readers`` reading threads on a host of ``cores``: as many
    as the readers where the host has twice their number to spare (16 cores: 4), else up to 2 of the cores left.

    The scan is one ``sum()`` per factor, bound by memory bandwidth once a block has left the cache: on the H200
    host (16 cores) two scanning threads summed a 2D 48-layer adapter's 1.6 GB in 0.52 s of their time, while the
    four readers' ``preadv`` took 0.42 s of theirs and the read 0.29 s in all (``bench/results/probe_build_h200_r32.json``).
    """
    return max(min(2, cores - readers), min(readers, cores - 2 * readers))


def default_readers(cores: int, blocks: int) -> int:
    """Threads that read ``blocks`` MoE blocks on a host of ``cores``: up to 4, one per core. More contend for the
    GIL and read no faster: r35 timed 8 on the H200 host (16 cores) with nothing scanned while read, a background
    build's case. A fused 3D adapter's build (its B turned on the CPU, 4 keys a block) took 0.335 s (median of 9)
    against 0.304 s on 4, a 2D one's 0.282 s against 0.241 s (``bench/results/probe_build_h200_r35_readers.json``)."""
    return max(1, min(4, cores, blocks))


READ_POOL, SCAN_POOL = "vllm-lora-ext-read", "vllm-lora-ext-scan"  # the kept pools' names (transport.pools)


def read_pools(cores: int) -> list[tuple[str, int]]:
    """The kept pools ([`read_blocks`]'s) an adapter of many MoE blocks is read and scanned on, as
    ``(name, threads)``, on a host of ``cores``."""
    readers = default_readers(cores, cores)
    scanners = default_scan_workers(cores, readers) if readers > 1 else 0
    return [(READ_POOL, readers)] + ([(SCAN_POOL, scanners)] if scanners > 0 else [])


def read_blocks(plans: Mapping[str, ExpertsPlan], source: TensorSource, *, config: AdapterConfig,
                experts: Mapping[str, Sequence[int] | None] | None = None,
                options: ReadOptions = ReadOptions()) -> dict[str, ExpertsLoRA]:
    """Read several planned MoE blocks with [`read_experts`], ``options.workers`` at a time (torch ops release the
    GIL); ``experts`` gives each block's kept experts (default: all).

    Serving processes run torch with one intra-op thread, so blocks in parallel threads are what
    uses the host's cores. Results are in the order of ``plans``. With ``options.check_finite_as``, a host
    with cores to spare scans each block for NaN/inf on a separate pool while the next blocks are
    read; otherwise each reader scans its own block.

    Raises:
        [`AdapterFormatError`]: a factor holds NaN or infinity (the first block in ``plans`` order).
    """
    import contextlib
    import threading
    from concurrent.futures import Future, wait

    from vllm_lora_ext._progress import ProgressLog
    from vllm_lora_ext._util import FreshPools, usable_cores

    from vllm_lora_ext.validation import first_nonfinite, nonfinite_error

    items = list(plans.items())
    cores = usable_cores()
    check_finite_as = options.check_finite_as
    n = options.workers if options.workers is not None else default_readers(cores, len(items))
    scan_workers = options.scan_workers
    if scan_workers is None:
        scan_workers = default_scan_workers(cores, n) if n > 1 and len(items) > 1 else 0
    scanning = check_finite_as is not None and scan_workers > 0
    scans: dict[str, Future[str | None]] = {}
    progress = ProgressLog(f"loading {check_finite_as or 'adapter'!r} ({len(items)} MoE blocks)")
    done = {"blocks": 0, "bytes": 0}
    lock = threading.Lock()

    per_block = replace(options, check_finite_as=None) if scanning else options  # (scanned on the pool instead)
    pools = options.pools if options.pools is not None else FreshPools
    with pools.lent_pool(SCAN_POOL, scan_workers) if scanning else contextlib.nullcontext() as scan_pool:

        def one(item: tuple[str, ExpertsPlan]) -> ExpertsLoRA:
            prefix, plan = item
            ex = read_experts(plan, source, config=config, experts=(experts or {}).get(prefix), options=per_block)
            factors = _factors(ex)
            if scan_pool is not None:
                scans[prefix] = scan_pool.submit(first_nonfinite, factors)
            with lock:  # bytes so far, against the blocks' share of the total
                done["blocks"] += 1
                done["bytes"] += sum(t.numel() * t.element_size() for t in factors.values())
                progress.update(done["bytes"], total=done["bytes"] * len(items) // done["blocks"])
            return ex

        try:
            if n <= 1 or len(items) <= 1:
                out = {p: one((p, pl)) for p, pl in items}
            else:  # (a failed block: the blocks not started are dropped, the running ones finish first)
                out = dict(zip((p for p, _ in items), pools.run_in_pool(READ_POOL, n, one, items)))
            for prefix, _ in items:
                bad = scans[prefix].result() if prefix in scans else None
                if bad is not None:
                    raise nonfinite_error(bad, adapter=check_finite_as or "adapter")
            return out
        finally:  # nothing of this read is left queued or running once it returns or raises
            for scan in scans.values():
                scan.cancel()
            wait(list(scans.values()))
