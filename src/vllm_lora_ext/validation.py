"""Checks on an adapter's factors before any tensor reaches vLLM: pairs, ranks, ndim, dtypes, dims, finiteness.

vLLM trusts what it is given: a ``lora_B`` whose rank differs from its ``lora_A``, an input size the
module does not have, or a 1-D tensor reach its kernels (or crash its step). Each check here
collects every problem in one pass and raises once, naming the adapter, the keys and the fix.
Pure core: shapes and dtypes come from the safetensors header; module dims from a plain mapping.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_lora_ext.constants import VLLM_MAX_LORA_RANK_CHOICES, max_lora_rank_for
from vllm_lora_ext.errors import AdapterCompatibilityError, AdapterFormatError
from vllm_lora_ext.formats import classify_key

if TYPE_CHECKING:
    import torch

    from vllm_lora_ext.config import AdapterConfig

__all__ = ["ModuleDims", "LORA_FACTOR_DTYPES", "check_factor_dtypes", "check_dense_factors", "check_ranks",
           "check_declared_ranks",
           "check_rank_budget", "check_module_ranks", "check_finite", "check_fits_dtype", "dense_multipliers",
           "first_nonfinite", "largest_magnitude",
           "nonfinite_error"]

# The safetensors dtypes a LoRA factor may have (vLLM computes in the model's float dtype).
LORA_FACTOR_DTYPES = frozenset({"F16", "BF16", "F32", "F64"})


@dataclass(frozen=True)
class ModuleDims:
    """A base-model module's full (unsharded) input and output sizes."""

    d_in: int
    d_out: int


def _raise(adapter: str, problems: list[str], fix: str, *, key: str | None = None) -> None:
    more = f" (+{len(problems) - 5} more)" if len(problems) > 5 else ""
    raise AdapterFormatError(f"Adapter {adapter!r} has malformed LoRA factors: " + "; ".join(problems[:5]) + more
                             + f". {fix}", adapter=adapter, key=key)


def check_factor_dtypes(dtypes: Mapping[str, str], *, adapter: str = "adapter") -> None:
    """Refuse LoRA tensors that are not floating point (``F16``, ``BF16``, ``F32``, ``F64``).

    Raises:
        [`AdapterFormatError`]: names every such key and its dtype.

    Example:
        >>> check_factor_dtypes({"m.lora_A.weight": "F8_E4M3"}, adapter="x")
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterFormatError: Adapter 'x' has malformed LoRA factors: m.lora_A.weight is F8_E4M3, not a float type vLLM's LoRA kernels take. Re-save the adapter in bfloat16, float16 or float32.
    """
    if LORA_FACTOR_DTYPES.issuperset(dtypes.values()):  # the usual case, decided without a look at any key
        return
    bad = [f"{k} is {d}, not a float type vLLM's LoRA kernels take" for k, d in dtypes.items()
           if d not in LORA_FACTOR_DTYPES and classify_key(k).kind != "other"]
    if bad:
        _raise(adapter, bad, "Re-save the adapter in bfloat16, float16 or float32.", key=bad[0].split(" ")[0])


# A factor saved with PEFT's adapter name in its key (``model.state_dict()`` of a PeftModel, not save_pretrained):
# ``...q_proj.lora_A.default.weight``, ``...embed_tokens.lora_embedding_A.default``.
_NAMED_FACTOR = re.compile(r"\.lora_([AB])\.([^.]+)\.weight$|\.lora_embedding_([AB])\.([^.]+)$")


def _named_factor_reason(key: str, subject: str = "it carries") -> str | None:
    """``subject`` PEFT's adapter name, and the fix, where ``key`` is a factor saved under it; else ``None``."""
    found = _NAMED_FACTOR.search(key)
    if found is None:
        return None
    name = found.group(2) or found.group(4)
    return (f"{subject} PEFT's adapter name {name!r} after lora_{found.group(1) or found.group(3)}, as a PeftModel's "
            f"state_dict() names them: save the adapter with PeftModel.save_pretrained(folder), or drop '.{name}' from "
            f"every key")


def not_lora_reason(key: str) -> str:
    """Why a tensor that is no LoRA factor cannot be served, and the fix (for a message about ``key``)."""
    named = _named_factor_reason(key)
    if named is not None:
        return named
    if ".modules_to_save." in key or ".original_module." in key:
        return ("it is a fully trained copy of a module (PEFT modules_to_save), which LoRA serving cannot apply; "
                "retrain without modules_to_save, or merge the adapter into the base model and serve that")
    if "lora_magnitude_vector" in key:
        return "it is DoRA's magnitude vector, which vLLM does not apply; merge the adapter into the base model"
    return "only lora_A/lora_B factors are served; remove it from the weight file"


def check_has_factors(keys: Iterable[str], *, adapter: str = "adapter") -> None:
    """Refuse an adapter with no LoRA factor at all (``keys``: its tensors' keys): served, it changes nothing.

    Raises:
        [`AdapterFormatError`]: naming how many tensors the file holds and what to check; where some are factors
            under PEFT's adapter name, how many, the first of them, that name and the fix.
    """
    count, named, first = 0, 0, ""
    for key in keys:  # stops at the first factor: the keys of a 2D MoE adapter are classified later, in bulk
        if classify_key(key).kind != "other":
            return
        count += 1
        if _NAMED_FACTOR.search(key):
            named, first = named + 1, first or key
    if named:  # a PeftModel's state_dict(): the factors under its adapter name, perhaps the whole model beside them
        others = (f" The other {count - named} tensors are no LoRA factors (the base model's weights?): "
                  f"save_pretrained leaves them out." if named < count else "")
        raise AdapterFormatError(f"Adapter {adapter!r} holds no LoRA factor under the names vLLM and PEFT load: "
                                 f"{named} of its {count} tensors are factors whose keys (first: {first!r}) "
                                 f"{_named_factor_reason(first, 'carry')}.{others}", adapter=adapter, key=first)
    raise AdapterFormatError(
        f"Adapter {adapter!r} holds no LoRA weights (its weight file has {count} tensors, none a lora_A/"
        f"lora_B factor), so serving or mixing it would change nothing. Save the trained adapter with PEFT's "
        f"save_pretrained, not an empty file or the base model's weights.", adapter=adapter)


def check_dense_factors(shapes: Mapping[str, tuple[int, ...]], keys: Iterable[str],
                        dims: Mapping[str, ModuleDims] | None = None, *, module_of: Mapping[str, str] | None = None,
                        adapter: str = "adapter", packed: Mapping[str, Sequence[str]] | None = None) -> None:
    """Check dense (non-MoE) LoRA pairs: both factors present, 2-D, ranks agree, dims fit the module.

    ``A`` must be ``(r, in)`` and ``B`` ``(out, r)`` with ``r >= 1``; where ``dims`` knows the module
    (``module_of`` maps a key to the module name the model uses), ``in``/``out`` must equal its sizes.
    Embedding factors (``lora_embedding_A (r, vocab)``, ``lora_embedding_B (dim, r)``) are checked for
    ndim and rank agreement.

    Raises:
        [`AdapterFormatError`]: every problem, named by key, in one message.

    Example:
        >>> check_dense_factors({"q.lora_A.weight": (8, 16), "q.lora_B.weight": (16, 4)}, ["q.lora_A.weight",
        ...                     "q.lora_B.weight"], adapter="x")
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterFormatError: Adapter 'x' has malformed LoRA factors: q: lora_A has rank 8 but lora_B has rank 4 (A (8, 16), B (16, 4)). Re-save the adapter: lora_A must be (r, in) and lora_B (out, r) of the same module.
    """
    pairs: dict[str, dict[str, str]] = {}
    problems: list[str] = []
    for k in keys:
        info = classify_key(k)
        module = (module_of or {}).get(k, info.module)  # as the model names it: two spellings of one are one
        other = pairs.setdefault(module, {}).setdefault(info.which, k)
        if other != k:  # e.g. one spelled with PEFT's prefix and one without (or twice): neither may be dropped
            problems.append(f"{module}: two keys hold its lora_{info.which}, {other!r} and {k!r}; keep one")
    for whole, parts in (packed or {}).items():  # vLLM packs the parts over the whole's own factors: one is lost
        given = [p for p in parts if p in pairs and p != whole]  # (Phi-3 packs qkv_proj as itself)
        if whole in pairs and given:
            problems.append(f"{whole}: given both as the packed module and as its parts {given}; vLLM would pack "
                            f"the parts over it and drop its own factors: keep one")
    for module, pair in pairs.items():
        if set(pair) != {"A", "B"}:
            have = "A" if "A" in pair else "B"
            problems.append(f"{module}: lora_{have} without lora_{'B' if have == 'A' else 'A'}")
            continue
        sa, sb = tuple(shapes[pair["A"]]), tuple(shapes[pair["B"]])
        if len(sa) != 2 or len(sb) != 2:
            problems.append(f"{module}: factors must be 2-D, got A {sa} and B {sb}")
            continue
        r = sa[0]
        if r < 1:
            problems.append(f"{module}: rank {r}: lora_A is {sa} and lora_B {sb}, a LoRA with no rank (it changes "
                            f"nothing); drop the module or re-save it with rank 1 or more")
            continue
        if sb[1] != r:
            problems.append(f"{module}: lora_A has rank {r} but lora_B has rank {sb[1]} (A {sa}, B {sb})")
            continue
        if min(sa[1], sb[0]) < 1:
            problems.append(f"{module}: empty factor (A {sa}, B {sb})")
            continue
        target = (module_of or {}).get(pair["A"], module)
        want = (dims or {}).get(target)
        if want is not None and not pair["A"].endswith("lora_embedding_A") and (sa[1], sb[0]) != (want.d_in,
                                                                                                   want.d_out):
            problems.append(f"{module}: factors map {sa[1]} -> {sb[0]} but the model's {target} maps "
                            f"{want.d_in} -> {want.d_out}")
    if problems:
        _raise(adapter, problems, "Re-save the adapter: lora_A must be (r, in) and lora_B (out, r) of the same module."
               if all("rank" in p or "2-D" in p or "without" in p or "empty" in p or "keep one" in p for p in problems)
               else "Check that the adapter was trained for this base model.", key=None)


def check_ranks(shapes: Mapping[str, tuple[int, ...]], declared: Iterable[int], max_rank: int, *,
                adapter: str = "adapter") -> None:
    """Refuse an adapter whose rank (from its 2D ``lora_A`` shapes, or its config) exceeds ``max_rank``.

    Raises:
        [`AdapterCompatibilityError`]: names the module, the rank and the ``--max-lora-rank`` that fits.
    """
    worst: tuple[int, str] | None = None
    # Only a 2-D factor whose first dim is over the limit can be named (mostly B factors: their first dim is
    # the output size), and only if its key ends as an A factor's does (by the key grammar).
    big = [k for k, s in shapes.items() if len(s) == 2 and s[0] > max_rank]
    over = any(k.endswith(("_A.weight", "_A")) for k in big)
    for key, shape in shapes.items() if over else ():
        info = classify_key(key)
        if info.which != "A" or info.kind == "moe_3d" or len(shape) != 2:
            continue
        r = int(shape[0])
        if r > max_rank and (worst is None or r > worst[0]):
            worst = (r, info.module)
    top = max(declared, default=0)
    if worst is None and top > max_rank:
        worst = (top, "(config r / rank_pattern)")
    if worst is not None:
        check_rank_budget(worst[0], max_rank, adapter=adapter,
                          what=f"Adapter {adapter!r} has rank {worst[0]} (module {worst[1]!r})")


def check_declared_ranks(shapes: Mapping[str, tuple[int, ...]], config: AdapterConfig, *,
                         adapter: str = "adapter") -> None:
    """Refuse 2D factors whose rank differs from the rank the config gives their module (``r``/``rank_pattern``).

    PEFT refuses to load such an adapter, and vLLM would scale it by ``alpha / r`` of the config, not of the
    tensors (``r: 4`` over rank-8 tensors doubles the delta).

    Raises:
        [`AdapterFormatError`]: names every such module, both ranks and the fix.

    Example:
        >>> from vllm_lora_ext.config import config_from_dict
        >>> check_declared_ranks({"m.q.lora_A.weight": (8, 16)}, config_from_dict({"r": 4}), adapter="x")
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterFormatError: Adapter 'x': m.q: lora_A has rank 8 but the config gives it r 4, so vLLM would scale it by lora_alpha/4 and PEFT refuses it. Set "r" (or a rank_pattern entry) to the tensors' rank in adapter_config.json.
    """
    bad = []
    for key, shape in shapes.items():
        info = classify_key(key)
        if info.which != "A" or info.kind not in ("dense", "moe_2d") or len(shape) != 2:
            continue
        declared = config.rank_for(info.module)
        if shape[0] != declared:
            bad.append(f"{info.module}: lora_A has rank {shape[0]} but the config gives it r {declared}")
    if bad:
        more = f" (+{len(bad) - 3} more)" if len(bad) > 3 else ""
        first = bad[0].rsplit(" r ", 1)[-1]
        raise AdapterFormatError(
            f"Adapter {adapter!r}: " + "; ".join(bad[:3]) + more + f", so vLLM would scale it by lora_alpha/{first} and "
            f"PEFT refuses it. Set \"r\" (or a rank_pattern entry) to the tensors' rank in adapter_config.json.",
            adapter=adapter, key="r")


def check_rank_budget(rank: int, max_rank: int, *, adapter: str, what: str, detail: str = "",
                      mix: bool = False) -> None:
    """Refuse ``rank`` above ``max_rank``: the one rank-budget rule of adapters, MoE blocks and mixes.

    The message reads ``{what} but max_lora_rank is {max_rank}{detail}. {fix}.``, the fix naming the smallest
    ``--max-lora-rank`` vLLM accepts that fits (for a ``mix``: or mixing fewer adapters).

    Raises:
        [`AdapterCompatibilityError`]: with ``rank`` and ``max_rank`` set.

    Example:
        >>> check_rank_budget(20, 16, adapter="m", what="Mix 'm' needs rank 20", mix=True)
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterCompatibilityError: Mix 'm' needs rank 20 but max_lora_rank is 16. Start vLLM with --max-lora-rank 32 or mix fewer adapters.
    """
    if rank <= max_rank:
        return
    fit = max_lora_rank_for(rank)
    if fit is not None:
        fix = f"Start vLLM with --max-lora-rank {fit}" + (" or mix fewer adapters" if mix else "")
    else:
        fix = "Mix fewer adapters" if mix else f"Use an adapter of rank <= {VLLM_MAX_LORA_RANK_CHOICES[-1]}"
    raise AdapterCompatibilityError(f"{what} but max_lora_rank is {max_rank}{detail}. {fix}.", adapter=adapter,
                                    rank=rank, max_rank=max_rank)


def check_module_ranks(name: str, parts: Sequence[tuple[str, Mapping[Any, Sequence[int]]]], max_rank: int) -> None:
    """Refuse the mix ``name`` if, in some module, its components' ranks (slice by slice) sum past ``max_rank``
    ([`check_rank_budget`]). ``parts``: each component's name and its ranks, ``{module: (rank of each slice)}`` (one
    slice for a dense module). The message names the first such module and each component's rank there.

    Example:
        >>> check_module_ranks("m", [("a", {"q": (8,)}), ("b", {"q": (8,), "v": (8,)}), ("c", {"v": (4,)})], 16)
        >>> check_module_ranks("m", [("a", {"q": (8,)}), ("b", {"q": (16,)})], 16)
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.AdapterCompatibilityError: Mix 'm' needs rank 24 (the sum of its adapters' ranks) but max_lora_rank is 16: q needs 24 (a r=8, b r=16). Start vLLM with --max-lora-rank 32 or mix fewer adapters.
    """
    sums: dict[Any, list[int]] = {}
    for _, ranks in parts:
        for module, slices in ranks.items():
            acc = sums.setdefault(module, [0] * len(slices))
            for j, r in enumerate(slices[:len(acc)]):
                acc[j] += int(r)
    over = [(m, max(s)) for m, s in sums.items() if s and max(s) > max_rank]
    if not over:
        return
    need = max(r for _, r in over)
    module, rank = over[0]
    each = ", ".join(f"{n} r={max(ranks[module])}" for n, ranks in parts if ranks.get(module))
    check_rank_budget(need, max_rank, adapter=name, mix=True,
                      what=f"Mix {name!r} needs rank {need} (the sum of its adapters' ranks)",
                      detail=f": {module} needs {rank} ({each})")


def first_nonfinite(tensors: Mapping[str, torch.Tensor]) -> str | None:
    """Return the first key whose tensor holds a NaN or an infinity, else ``None``.

    On the CPU, one pass per tensor: a sum, which is NaN or infinite whenever an element is, and finite otherwise
    unless it overflows (an overflowing sum of finite values is re-checked element-wise, so a finite tensor is never
    refused). bfloat16/float32/float64 sum in their own dtype (torch accumulates in at least float32, and the result
    has float32's range), about 5x faster than converting to float32 first; float16 (range 65504) accumulates into
    float32 so that the re-check stays rare. Tensors all on one GPU take [`_gpu_nonfinite`]: one kernel launch per
    dtype and one device sync for all of them (or, where torch's fused norm fails its check, their sums stacked and
    synced once, then summed one by one only if one is not finite).
    """
    # 8-bit floats have no sum, norm or isfinite in torch: they are checked as float32
    import torch

    items = [(k, t.float() if t.element_size() == 1 else t) for k, t in tensors.items()
             if t.numel() and t.is_floating_point()]
    devices = {t.device for _, t in items}
    if len(devices) == 1 and next(iter(devices)).type != "cpu":
        if _norms_propagate(next(iter(devices))):
            return _gpu_nonfinite(items)
        if bool(torch.isfinite(torch.stack([_total(t).float() for _, t in items])).all()):  # one sync for all
            return None
    for key, t in items:
        if torch.isfinite(_total(t)):
            continue
        if not bool(torch.isfinite(t).all()):
            return key
    return None


_NORMS_PROPAGATE: dict[str, bool] = {}  # per device type (one kernel per type): whether torch's fused inf-norm passes
# NaN and inf on


def _total(t: torch.Tensor) -> torch.Tensor:
    """``t``'s sum: in its own dtype, float16's in float32 (see [`first_nonfinite`])."""
    import torch

    return t.sum(dtype=torch.float32) if t.dtype == torch.float16 else t.sum()


def _gpu_nonfinite(items: Sequence[tuple[str, torch.Tensor]]) -> str | None:
    """[`first_nonfinite`] of tensors on one accelerator whose fused norm passes NaN and infinity on
    ([`_norms_propagate`]; elsewhere the tensors are summed): each tensor's largest magnitude (``torch._foreach_norm``
    with ``ord=inf``: fused kernels, a few launches for hundreds of tensors), which is NaN or infinite exactly when an
    element is (a maximum cannot overflow), stacked and brought to the host once."""
    import torch

    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, t) in enumerate(items):
        by_dtype.setdefault(t.dtype, []).append(i)
    maxima: list[torch.Tensor | None] = [None] * len(items)
    for idx in by_dtype.values():
        for i, m in zip(idx, torch._foreach_norm([items[i][1] for i in idx], math.inf)):
            maxima[i] = m.float()
    finite = torch.isfinite(torch.stack(maxima)).tolist()  # type: ignore[arg-type]
    return next((k for (k, _), ok in zip(items, finite) if not ok), None)


def _norms_propagate(device: torch.device) -> bool:
    found = _NORMS_PROPAGATE.get(device.type)
    if found is None:
        import torch

        # each dtype a factor can have, each value, in a short tensor (a kernel's scalar tail) and in a long one,
        # where the value lies past the first 65,536 elements (a vectorised loop, another chunk of the launch)
        cases = [(dtype, v, n) for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64)
                 for v in (math.nan, math.inf, -math.inf, -3.0) for n in (3, 70_001)]
        probes = []
        for dtype, v, n in cases:
            t = torch.ones(n, dtype=dtype, device=device)
            t[n - 2] = v
            probes.append(t)
        got = torch.stack([m.float() for m in torch._foreach_norm(probes, math.inf)]).tolist()
        found = all(math.isnan(g) if math.isnan(v) else g == abs(v) for g, (_, v, _) in zip(got, cases))
        _NORMS_PROPAGATE[device.type] = found
    return found


def nonfinite_error(key: str, *, adapter: str = "adapter") -> AdapterFormatError:
    """Return the error for a factor ``key`` that holds NaN or infinity."""
    return AdapterFormatError(f"Adapter {adapter!r}: tensor {key!r} holds NaN or infinite values (after scaling). "
                              f"Re-train or re-save the adapter; check lora_alpha (and, for a mix, its weights).",
                              adapter=adapter, key=key)


def check_finite(tensors: Mapping[str, torch.Tensor], *, adapter: str = "adapter") -> None:
    """Refuse factors that hold NaN or infinity (they would turn every output of the request into NaN).

    Raises:
        [`AdapterFormatError`]: names the first such key.
    """
    bad = first_nonfinite(tensors)
    if bad is not None:
        raise nonfinite_error(bad, adapter=adapter)


def dense_multipliers(dense: Mapping[str, torch.Tensor], config: AdapterConfig) -> Iterator[tuple[str, Any, float]]:
    """Each dense factor with what serving multiplies it by: a B by its module's scaling (vLLM folds it into B in
    the LoRA dtype), an A by 1 (for [`check_fits_dtype`])."""
    for key, t in dense.items():
        info = classify_key(key)
        if info.which == "B" and t.dim() == 2 and t.shape[1]:
            yield key, t, config.scaling_for(info.module, int(t.shape[1]))
        else:
            yield key, t, 1.0


def check_fits_dtype(factors: Iterable[tuple[str, torch.Tensor, float]], dtype: torch.dtype | None, *,
                     adapter: str = "adapter") -> None:
    """Refuse a factor that is finite as stored but would not be once served: cast to ``dtype`` (the LoRA dtype;
    ``None``: its own) and multiplied by its ``(key, tensor, multiplier)`` multiplier (a dense B by its module's
    scaling, which vLLM folds into B in that dtype; an A by 1). A float64 factor of 1e300, a float32 one of 1e5 in
    float16, or ``lora_alpha: 1e300`` would otherwise turn every output of the request into inf or NaN.

    Only factors whose dtype's range, times the multiplier, exceeds the target's are scanned (one pass each).

    Raises:
        [`AdapterFormatError`]: names the key, its largest magnitude, the multiplier and the dtype's limit.
    """
    import torch

    for key, t, multiplier in factors:
        if not t.numel() or not t.is_floating_point():
            continue
        limit = torch.finfo(dtype or t.dtype).max
        if torch.finfo(t.dtype).max * abs(multiplier) <= limit:  # nothing it can hold goes past the limit
            continue
        largest = largest_magnitude(t)
        if largest * abs(multiplier) > limit:
            scaled = f" × scaling {multiplier:.3g}" if multiplier != 1 else ""
            raise AdapterFormatError(
                f"Adapter {adapter!r}: tensor {key!r} reaches {largest:.3g}{scaled}, past {dtype or t.dtype}'s "
                f"largest value {limit:.3g}: it would be served as infinity. Re-save the adapter with smaller "
                f"values; check lora_alpha.", adapter=adapter, key=key)


def largest_magnitude(t: torch.Tensor) -> float:
    """The largest magnitude in ``t`` (NaN if it holds a NaN; 0 for an empty tensor): one pass.

    Example:
        >>> import torch
        >>> largest_magnitude(torch.tensor([1.0, -3.0]))
        3.0
    """
    import torch

    if not t.numel():
        return 0.0
    lo, hi = torch.aminmax(t)
    return max(-float(lo), float(hi)) if not (torch.isnan(lo) or torch.isnan(hi)) else float("nan")
