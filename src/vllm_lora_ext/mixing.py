"""Exact weighted mixes of LoRA adapters by rank concatenation, and the mix grammar.

The math, per LoRA module (per expert for MoE)::

    A_mix = concat_rank(w_1·s_1·A_1, ..., w_k·s_k·A_k)     (Σ r_i, in)
    B_mix = concat_rank(B_1, ..., B_k)                     (out, Σ r_i)
    B_mix · A_mix = Σ w_i · s_i · B_i · A_i                 exactly: no cross terms

(the weight goes on A, whose rows are contiguous; see `concat_factors`)

with ``s_i`` each adapter's own scaling (alpha/r or rsLoRA, rank/alpha patterns). The composite has
scaling 1 and rank Σ r_i over the adapters that have the module. This is PEFT's
``add_weighted_adapter(combination_type="cat")``; ``linear``/``ties``/``dare`` merge A and B
separately and are *not* exact.

Mix grammar (the OpenAI ``model`` field, a deployment's names)::

    NAME[=WEIGHT](+NAME[=WEIGHT])*      e.g.  style=0.7+domain=0.3,  style+domain

A missing weight takes the adapter's default weight from the deployment config. A resolved mix
(names in order, weights, pinned sources) has one canonical key; equal keys share one composite,
one vLLM adapter name (vLLM's prefix cache keys on it) and one id. Weights have one canonical form
(``-0`` is ``0``), so ``domain=0`` and ``domain=-0`` are one mix.

The whole grammar is reserved: no adapter name (``--lora-modules``, ``/v1/load_lora_adapter``, a
deployment config, a Ray multiplexed id) may hold ``+`` or ``=``, or start with ``mix-``, the prefix
of the names the server gives its mixes; `vllm_lora_ext.naming` holds that rule. A served base-model
name may hold them: it is matched before any mix parsing.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm_lora_ext._util import short_repr
from vllm_lora_ext.constants import MAX_ABS_MIX_WEIGHT, MAX_MIX_COMPONENTS, MIX_NAME_PREFIX, MIX_PREFIX
from vllm_lora_ext.errors import MixError
from vllm_lora_ext.validation import check_module_ranks, largest_magnitude

if TYPE_CHECKING:  # torch is imported where a mix is built: a command line checks weights and names without it
    import torch

__all__ = ["MixComponent", "MixSpec", "MixFactor", "MixPlan", "parse_mix_expression", "resolve_mix", "concat_factors",
           "concat_many", "widest_dtype", "composite_shapes", "check_weight", "largest_magnitude", "parse_weight",
           "MIX_NAME_PREFIX", "MAX_MIX_COMPONENTS"]

_MAX_MIX_PATH = 64 * 1024
# (each digit run has one place in a match: a long run that fails to match fails in linear time, where
# [0-9]+\.?[0-9]* split it every way first, 66 s for 40,000 digits)
_DECIMAL = re.compile(r"[+-]?(?:(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|inf|infinity|nan)", re.I | re.A)
_MAX_WEIGHT_TEXT = 64  # characters: a longer weight is refused before it is parsed


def _number_text(weight: object) -> str:
    """A weight as the user gave it, bounded: ``10**30`` stays ``1000...0``, never the value it was clamped to."""
    if isinstance(weight, int) and not isinstance(weight, bool):
        if weight.bit_length() <= 256:
            return str(weight)
        return f"{'-' if weight < 0 else ''}~10^{round(weight.bit_length() * math.log10(2))}"
    if isinstance(weight, float):
        return repr(weight)
    return short_repr(weight)


def check_weight(weight: object, *, name: str = "adapter", text: str | None = None) -> float:
    """Return ``weight`` as a float if it obeys the one weight rule, else raise naming the adapter.

    The rule, applied at every entry point (server body fields and model syntax, offline helper,
    deployment config, ``vllm-lora mix``): a real number (not a bool, not a string), finite, and
    ``|w| <= 100`` (`MAX_ABS_MIX_WEIGHT`). Negative weights subtract an adapter's delta. The result is
    canonical: ``-0`` becomes ``0``, so equal weights make one mix key. An error quotes the number as
    given (``text``, when it was written as text), never a value it was converted or clamped to.

    Raises:
        [`MixError`]: the weight breaks the rule.

    Example:
        >>> check_weight(0.7), check_weight(-0.0)
        (0.7, 0.0)
        >>> check_weight(1e308)
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.MixError: Weight 1e+308 of adapter 'adapter' is outside [-100, 100]. Use a weight with |w| <= 100.
        >>> check_weight(10**30)
        Traceback (most recent call last):
        ...
        vllm_lora_ext.errors.MixError: Weight 1000000000000000000000000000000 of adapter 'adapter' is outside [-100, 100]. Use a weight with |w| <= 100.
    """
    shown = text if text is not None else _number_text(weight)
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise MixError(f"Weight {short_repr(weight)} of adapter {short_repr(name)} is not a number. "
                       f"Give a number such as 0.7.")
    if isinstance(weight, float) and not math.isfinite(weight):
        raise MixError(f"Weight {shown} of adapter {short_repr(name)} is not finite. "
                       f"Give a finite number such as 0.7.")
    if abs(weight) > MAX_ABS_MIX_WEIGHT:  # an int is compared exactly, never converted (10**400 overflows float)
        raise MixError(f"Weight {shown} of adapter {short_repr(name)} is outside [-{MAX_ABS_MIX_WEIGHT:g}, "
                       f"{MAX_ABS_MIX_WEIGHT:g}]. Use a weight with |w| <= {MAX_ABS_MIX_WEIGHT:g}.")
    return float(weight) + 0.0  # + 0.0 turns -0.0 into 0.0: one canonical form


def parse_weight(text: str, *, name: str = "adapter") -> float:
    """Parse a weight written as text (``a=0.7``, ``vllm-lora mix a=0.7``), an ASCII decimal number such as
    ``0.25``, ``-1e-2`` or ``.5``, and apply [`check_weight`]."""
    written = text.strip()
    if len(written) > _MAX_WEIGHT_TEXT:
        raise MixError(f"Weight {short_repr(text)} of adapter {short_repr(name)} is {len(written)} characters long, "
                       f"more than the {_MAX_WEIGHT_TEXT} a weight may have. Write it as NAME=0.7.")
    if not _DECIMAL.fullmatch(written):  # float() alone reads '0_5' as 5 and other scripts' digits ('ınf': re.A)
        raise MixError(f"Weight {short_repr(text)} of adapter {short_repr(name)} is not a number. "
                       f"Write it as NAME=0.7.")
    return check_weight(float(written), name=name, text=written if len(written) <= 40 else written[:37] + "...")


@dataclass(frozen=True)
class MixComponent:
    """One adapter of a mix: its deployment name, pinned source and weight."""

    name: str
    source: str
    weight: float

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or not isinstance(self.source, str) or not self.source:
            raise MixError(f"Mix component {short_repr(self.name)} needs a name and a source (non-empty strings).")
        object.__setattr__(self, "weight", check_weight(self.weight, name=self.name))


@dataclass(frozen=True)
class MixSpec:
    """A resolved mix. ``key`` is canonical; ``lora_name``, ``lora_int_id`` and ``lora_path`` derive from it."""

    components: tuple[MixComponent, ...]

    def __post_init__(self) -> None:
        if not self.components:
            raise MixError("A mix needs at least one adapter.")
        if len(self.components) > MAX_MIX_COMPONENTS:
            raise MixError(f"A mix of {len(self.components)} adapters is more than the {MAX_MIX_COMPONENTS} allowed; "
                           f"mix fewer adapters.")
        names = [c.name for c in self.components]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise MixError(f"Adapter(s) {dup} appear more than once in the mix; give each adapter once with its weight.")

    @property
    def key(self) -> str:
        """Canonical JSON: names in the given order, weights as ``repr(float)``, pinned sources."""
        return json.dumps({"v": 1, "adapters": [[c.name, c.source, float(c.weight)] for c in self.components]},
                          separators=(",", ":"))

    @property
    def digest(self) -> str:
        return hashlib.sha256(self.key.encode()).hexdigest()

    @property
    def lora_name(self) -> str:
        """A readable, unique adapter name: ``mix-<names and weights>-<digest prefix>``.

        The 96-bit digest prefix keeps names of different mixes apart (vLLM's prefix cache keys on
        the name); the server still checks that a registered name holds this very spec.
        """
        label = "+".join(f"{_short(c.name)}={c.weight:g}" for c in self.components)
        if len(label) > 80:
            label = label[:77] + "..."
        return f"{MIX_NAME_PREFIX}{label}-{self.digest[:24]}"

    @property
    def lora_path(self) -> str:
        """The spec as it travels to the workers inside ``LoRARequest.lora_path``."""
        return MIX_PREFIX + self.key

    @classmethod
    def from_path(cls, path: str) -> MixSpec:
        """Parse ``mix:{...}`` back into a spec, strictly: exactly the form [`MixSpec.lora_path`] writes.

        Raises:
            [`MixError`]: not a mix path, too long, not that JSON form, or a component breaks a rule.
        """
        if not isinstance(path, str) or not path.startswith(MIX_PREFIX):
            raise MixError(f"{short_repr(path)} is not a mix path (it must start with {MIX_PREFIX!r}).")
        if len(path) > _MAX_MIX_PATH:
            raise MixError(f"Mix path of {len(path)} characters is longer than {_MAX_MIX_PATH}.")
        try:
            raw = json.loads(path[len(MIX_PREFIX):])
        except (ValueError, RecursionError) as err:
            raise MixError(f"Malformed mix path {short_repr(path)}: not JSON ({err}).") from err
        items = raw.get("adapters") if isinstance(raw, dict) and raw.get("v") == 1 and set(raw) == {"v", "adapters"} \
            else None
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 3 for i in items):
            raise MixError(f"Malformed mix path {short_repr(path)}: expected "
                           f'{{"v":1,"adapters":[[name, source, weight], ...]}}.')
        return cls(tuple(MixComponent(n, s, w) for n, s, w in items))


def _short(name: str) -> str:
    # a path or hf: source used as a name: keep its last component (the digest keeps the name unique)
    tail = name.rstrip("/").rsplit("/", 1)[-1].rsplit(":", 1)[-1]
    return tail or name


def parse_mix_expression(expr: str) -> list[tuple[str, float | None]]:
    """Parse ``a=0.7+b=0.3`` into ``[("a", 0.7), ("b", 0.3)]`` (``None`` = the default weight).

    Raises:
        [`MixError`]: empty parts or a weight that is not a finite number.

    Example:
        >>> parse_mix_expression("style=0.7+domain")
        [('style', 0.7), ('domain', None)]
    """
    out: list[tuple[str, float | None]] = []
    for part in expr.split("+"):
        name, eq, weight = part.partition("=")
        name = name.strip()
        if not name:
            raise MixError(f"Mix {short_repr(expr)} has an empty adapter name. Write it as 'a=0.7+b=0.3'.")
        if not eq:
            out.append((name, None))
            continue
        if not weight.strip():
            raise MixError(f"Mix {short_repr(expr)} gives adapter {short_repr(name)} an empty weight after '='. Write "
                           f"NAME=0.7, or NAME alone for its default weight ('+' separates adapters, so a weight is "
                           f"written without a '+' sign).")
        out.append((name, parse_weight(weight, name=name)))
    if len(out) > MAX_MIX_COMPONENTS:
        raise MixError(f"Mix {short_repr(expr)} names {len(out)} adapters, more than the {MAX_MIX_COMPONENTS} allowed.")
    return out


def resolve_mix(adapters: Sequence[str] | None, weights: Sequence[float] | None, *, sources: Mapping[str, str],
                default_weights: Mapping[str, float], default: str | None = None) -> MixSpec | None:
    """Apply the resolution rules; return the mix, or ``None`` for the base model.

    - ``adapters`` non-empty: those names; ``weights`` if given (same length, finite), else each
      adapter's default weight;
    - no adapters and a deployment ``default``: that adapter with its default weight;
    - otherwise: the base model (``None``).

    Raises:
        [`MixError`]: an unknown name, a length mismatch, or a non-finite weight (nothing is loaded).
    """
    if weights is not None and not adapters:
        raise MixError("adapter_weights were given without adapters; name the adapters they weigh.")
    if not adapters:
        if default is None:
            return None
        adapters = [default]
    if len(adapters) > MAX_MIX_COMPONENTS:
        raise MixError(f"{len(adapters)} adapters is more than the {MAX_MIX_COMPONENTS} one mix may have.")
    unknown = [a for a in adapters if a not in sources]
    if unknown:
        known = sorted(sources)
        raise MixError(f"Unknown adapter(s) {short_repr(unknown)}; this deployment defines "
                       f"{short_repr(known[:20])}{' and more' if len(known) > 20 else ''}.")
    if weights is not None and len(weights) != len(adapters):
        raise MixError(f"{len(adapters)} adapters but {len(weights)} adapter_weights; give one weight per adapter.")
    ws = ([check_weight(w, name=a) for a, w in zip(adapters, weights)] if weights is not None
          else [default_weights.get(a, 1.0) for a in adapters])
    return MixSpec(tuple(MixComponent(a, sources[a], w) for a, w in zip(adapters, ws)))


def concat_many(jobs: Mapping[Any, tuple[Sequence[tuple[torch.Tensor, torch.Tensor, float]], int, int]], *,
                dtype: torch.dtype | None = None, workers: int | None = None,
                alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                pools: Any = None) -> dict[Any, tuple[torch.Tensor, torch.Tensor]]:
    """Run [`concat_factors`] for many modules at once, ``workers`` threads at a time (torch copies release the GIL).

    Args:
        jobs: ``{key: (parts, rank_dim_a, rank_dim_b)}``, one entry per module (or per packed slice).
        dtype: the result dtype (default: each module's [`widest_dtype`]).
        workers: threads (default: ``VLLM_LORA_EXT_MIX_THREADS``, else up to 4, at most the host's cores). A
            composite is a memory copy of every component factor; one thread does not saturate a host's memory
            bandwidth.
        alloc: gives the memory each result is written to (default: new tensors), e.g. pinned host memory.
        pools: where the threads come from (``run_in_pool(name, workers, fn, items)``; serving code passes
            ``vllm_lora_ext.transport.pools``); ``None``: a pool made for the call.

    Returns:
        ``{key: (A, B)}`` in the order of ``jobs``.
    """
    from vllm_lora_ext._util import FreshPools, usable_cores
    from vllm_lora_ext.constants import mix_threads

    if workers is None:
        workers = mix_threads()
    n = min(workers, len(jobs)) if workers is not None else max(1, min(4, usable_cores(), len(jobs)))

    def one(key: Any) -> tuple[torch.Tensor, torch.Tensor]:
        parts, dim_a, dim_b = jobs[key]
        return concat_factors(parts, rank_dim_a=dim_a, rank_dim_b=dim_b, dtype=dtype, alloc=alloc)

    if n <= 1:
        return {k: one(k) for k in jobs}
    return dict(zip(jobs, (pools or FreshPools).run_in_pool("vllm-lora-ext-mix", n, one, list(jobs))))


def _concat_shape(parts: Sequence[tuple[torch.Tensor, torch.Tensor, float]], rank_dim_a: int, rank_dim_b: int,
                  dtype: torch.dtype | None) -> tuple[list[int], list[int], torch.dtype]:
    if not parts:
        raise MixError("Nothing to concatenate.")
    rank = sum(int(p[0].shape[rank_dim_a]) for p in parts)
    a_shape, b_shape = list(parts[0][0].shape), list(parts[0][1].shape)
    a_shape[rank_dim_a] = rank
    b_shape[rank_dim_b] = rank
    return a_shape, b_shape, dtype or widest_dtype(parts)


def widest_dtype(parts: Sequence[tuple[torch.Tensor, torch.Tensor, Any]]) -> torch.dtype:
    """The dtype all factors of ``parts`` fit unrounded (``torch.promote_types``): float32 for float32 with
    bfloat16 in either order, and for float16 with bfloat16."""
    import torch

    return functools.reduce(torch.promote_types, (t.dtype for a, b, *_ in parts for t in (a, b)))


def composite_shapes(jobs: Mapping[Any, tuple[Sequence[tuple[torch.Tensor, torch.Tensor, float]], int, int]], *,
                     dtype: torch.dtype | None = None) -> dict[Any, tuple[list[int], list[int], torch.dtype]]:
    """The ``(A shape, B shape, dtype)`` [`concat_many`] gives each of ``jobs``, without building anything.

    Example:
        >>> import torch
        >>> composite_shapes({"m": ([(torch.ones(2, 5), torch.ones(3, 2), 1.0), (torch.ones(4, 5), torch.ones(3, 4), 1.0)], 0, 1)})
        {'m': ([6, 5], [3, 6], torch.float32)}
    """
    return {key: _concat_shape(parts, dim_a, dim_b, dtype) for key, (parts, dim_a, dim_b) in jobs.items()}


def concat_factors(parts: Sequence[tuple[torch.Tensor, torch.Tensor, float]], *, rank_dim_a: int = 0,
                   rank_dim_b: int = 1, dtype: torch.dtype | None = None,
                   alloc: Callable[[tuple[int, ...], torch.dtype], torch.Tensor] | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate ``(A_i, B_i, c_i)`` along rank: ``A = cat(c_i · A_i)``, ``B = cat(B_i)`` (``c_i = w_i·s_i``).

    ``B·A = Σ c_i·B_i·A_i`` exactly up to one rounding of ``c_i·A_i`` to ``dtype``. The weight goes on ``A``
    because each ``A_i`` lands in whole rows of the result, so scaling it is a contiguous pass, while ``B_i``
    lands in a few columns of every row: scaling a (11008, 16) bfloat16 ``B_i`` into such columns costs about
    three plain ``torch.cat`` calls of all four ``B_i``, and about four times scaling the four ``A_i`` into their
    rows (``bench/probe_mix_copy.py``). ``alloc(shape, dtype)`` gives the memory A and B are written to (default: new
    tensors). Dense factors are ``A (r, in)``, ``B (out, r)``; per-expert ones ``A (E, r, in)``, ``B (E, out, r)``
    (``rank_dim_a=1, rank_dim_b=2``).

    Example:
        >>> import torch
        >>> a, b = concat_factors([(torch.ones(1, 2), torch.ones(3, 1), 0.5), (torch.ones(2, 2), torch.ones(3, 2), 2.0)])
        >>> (b @ a)[0, 0].item()
        4.5
    """
    import torch

    a_shape, b_shape, out_dtype = _concat_shape(parts, rank_dim_a, rank_dim_b, dtype)
    ranks = [int(p[0].shape[rank_dim_a]) for p in parts]
    a = alloc(tuple(a_shape), out_dtype) if alloc is not None else torch.empty(a_shape, dtype=out_dtype)
    b = alloc(tuple(b_shape), out_dtype) if alloc is not None else torch.empty(b_shape, dtype=out_dtype)
    off = 0
    for (pa, _, c), r in zip(parts, ranks):  # one pass per part, written straight into the result
        dst = a.narrow(rank_dim_a, off, r)
        if pa.dtype == out_dtype:
            torch.mul(pa, c, out=dst)  # computed in float32 (torch's opmath), rounded once
        else:
            dst.copy_(pa).mul_(c)
        off += r
    if all(pb.dtype == out_dtype for _, pb, _ in parts):
        torch.cat([pb for _, pb, _ in parts], dim=rank_dim_b, out=b)
    else:
        off = 0
        for (_, pb, _), r in zip(parts, ranks):
            b.narrow(rank_dim_b, off, r).copy_(pb)
            off += r
    return a, b


@dataclass(frozen=True)
class MixFactor:
    """One component's factors of one concatenation job, as plain data.

    ``A`` is ``(r, in)`` (``rank_dim=0``) or per expert ``(E, r, in)`` (``rank_dim=1``); ``B`` has its rank on the
    next dimension. ``scaling`` is the component's own (1 where it is folded in already). ``max_abs`` is the
    largest magnitude in ``A`` (NaN if it holds a NaN; ``None``: not known), from [`largest_magnitude`].
    """

    a: torch.Tensor
    b: torch.Tensor
    scaling: float = 1.0
    rank_dim: int = 0
    max_abs: float | None = None

    @property
    def rank(self) -> int:
        return int(self.a.shape[self.rank_dim])


# A component as a mix takes it: per module, its factor (one job), or the slices of a packed block (a job each).
ComponentFactors = Mapping[Any, "MixFactor | Sequence[MixFactor]"]
Part = tuple["torch.Tensor", "torch.Tensor", float]


@dataclass(frozen=True)
class MixPlan:
    """What a mix builds, computed from its components' factors: the concatenation jobs, the rank budget, and
    whether the weighted factors can overflow.

    Attributes:
        name: the mix's adapter name, for messages.
        jobs: ``{key: (parts, rank_dim_a, rank_dim_b)}`` for [`concat_many`]: a module's name, or ``(name, j)`` for
            slice ``j`` of a packed block; ``parts`` are ``(A_i, B_i, w_i·s_i)`` in the mix's order.
        modules: per module, its job keys.
        ranks: per module, ``(component name, rank)`` of each component that has it.
        bounds: per job, ``|w_i·s_i|·max|A_i|`` of each part (infinite where ``max|A_i|`` is not known).
    """

    name: str
    jobs: dict[Any, tuple[list[Part], int, int]]
    modules: dict[Any, list[Any]]
    ranks: dict[Any, list[tuple[str, int]]]
    bounds: dict[Any, list[float]]

    @classmethod
    def from_components(cls, name: str, components: Sequence[tuple[str, float, ComponentFactors]]) -> MixPlan:
        """Plan the mix of ``(component name, weight, factors)``; modules in order of first appearance.

        A module's form (one factor, or the slices of a packed block) is its first component's.

        Example:
            >>> import torch
            >>> one = {"m": MixFactor(torch.ones(2, 5), torch.ones(3, 2), scaling=0.5, max_abs=1.0)}
            >>> plan = MixPlan.from_components("mix", [("a", 2.0, one), ("b", 1.0, one)])
            >>> plan.rank("m"), plan.bounds["m"], plan.stays_finite(torch.float16)
            (4, [1.0, 0.5], True)
        """
        jobs: dict[Any, tuple[list[Part], int, int]] = {}
        modules: dict[Any, list[Any]] = {}
        ranks: dict[Any, list[tuple[str, int]]] = {}
        bounds: dict[Any, list[float]] = {}
        order = list(dict.fromkeys(m for _, _, factors in components for m in factors))
        for module in order:
            present = [(n, w, factors[module]) for n, w, factors in components if module in factors]
            packed = not isinstance(present[0][2], MixFactor)
            width = len(present[0][2]) if packed else 1  # type: ignore[arg-type]
            modules[module] = [(module, j) for j in range(width)] if packed else [module]
            ranks[module] = [(n, max(f.rank for f in _slices(fs))) for n, _, fs in present]
            for j, key in enumerate(modules[module]):
                parts = [(w, _slices(fs)[j]) for _, w, fs in present]
                dim = parts[0][1].rank_dim
                jobs[key] = ([(f.a, f.b, w * f.scaling) for w, f in parts], dim, dim + 1)
                bounds[key] = [abs(w * f.scaling) * (f.max_abs if f.max_abs is not None else math.inf)
                               for w, f in parts]
        return cls(name, jobs, modules, ranks, bounds)

    def rank(self, module: Any) -> int:
        """The composite's rank of ``module``: its components' ranks summed (the largest over a block's slices)."""
        return max(sum(int(a.shape[dim]) for a, _, _ in parts)
                   for parts, dim, _ in (self.jobs[key] for key in self.modules[module]))

    def check_rank_budget(self, max_rank: int) -> None:
        """Refuse the mix if a module's summed rank exceeds ``max_rank`` ([`check_module_ranks`]).

        Raises:
            [`AdapterCompatibilityError`]: names the first such module and its components' ranks, with
                ``rank`` (the largest summed rank) and ``max_rank``.
        """
        if all(self.rank(m) <= max_rank for m in self.modules):
            return
        parts: dict[str, dict[Any, list[int]]] = {}
        for module, keys in self.modules.items():
            for i, (n, _) in enumerate(self.ranks[module]):
                parts.setdefault(n, {})[module] = [int(self.jobs[k][0][i][0].shape[self.jobs[k][1]]) for k in keys]
        check_module_ranks(self.name, list(parts.items()), max_rank)

    def stays_finite(self, dtype: torch.dtype | None) -> bool:
        """Whether no ``w_i·s_i·A_i`` can round to infinity in the result dtype (``None``: each job's [`widest_dtype`]).

        If every ``|w_i·s_i|·max|A_i|`` is at most half the dtype's largest finite value, every product, rounded
        once, is finite, so the composite needs no scan. Otherwise (an unknown or NaN bound too) this says
        ``False`` and the caller scans ``A``. ``B`` is a copy of finite components and needs no check either way.
        """
        import torch

        for key, (parts, _, _) in self.jobs.items():
            limit = torch.finfo(dtype or widest_dtype(parts)).max / 2
            if not all(bound <= limit for bound in self.bounds[key]):  # NaN-safe
                return False
        return True


def _slices(factors: MixFactor | Sequence[MixFactor]) -> Sequence[MixFactor]:
    return [factors] if isinstance(factors, MixFactor) else factors
