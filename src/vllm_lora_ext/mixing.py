"""Exact weighted mixes of LoRA adapters by rank concatenation, and the mix grammar.

The math, per LoRA module (per expert for MoE)::

    A_mix = concat_rank(A_1, ..., A_k)                     (Σ r_i, in)
    B_mix = concat_rank(w_1·s_1·B_1, ..., w_k·s_k·B_k)     (out, Σ r_i)
    B_mix · A_mix = Σ w_i · s_i · B_i · A_i                 exactly: no cross terms

with ``s_i`` each adapter's own scaling (alpha/r or rsLoRA, rank/alpha patterns). The composite has
scaling 1 and rank Σ r_i over the adapters that have the module. This is PEFT's
``add_weighted_adapter(combination_type="cat")``; ``linear``/``ties``/``dare`` merge A and B
separately and are *not* exact.

Mix grammar (the OpenAI ``model`` field, a deployment's names)::

    NAME[=WEIGHT](+NAME[=WEIGHT])*      e.g.  style=0.7+domain=0.3,  style+domain

A missing weight takes the adapter's default weight from the deployment config. A resolved mix
(names in order, weights, pinned sources) has one canonical key; equal keys share one composite,
one vLLM adapter name (vLLM's prefix cache keys on it) and one id.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from vllm_lora_ext.constants import MIX_PREFIX
from vllm_lora_ext.errors import MixError

__all__ = ["MixComponent", "MixSpec", "parse_mix_expression", "resolve_mix", "concat_factors", "MIX_NAME_PREFIX"]

MIX_NAME_PREFIX = "mix-"


@dataclass(frozen=True)
class MixComponent:
    """One adapter of a mix: its deployment name, pinned source and weight."""

    name: str
    source: str
    weight: float

    def __post_init__(self) -> None:
        if isinstance(self.weight, bool) or not isinstance(self.weight, (int, float)) or not math.isfinite(self.weight):
            raise MixError(f"Mix weight for adapter {self.name!r} is {self.weight!r}; weights must be finite numbers.")


@dataclass(frozen=True)
class MixSpec:
    """A resolved mix. ``key`` is canonical; ``lora_name``, ``lora_int_id`` and ``lora_path`` derive from it."""

    components: tuple[MixComponent, ...]

    def __post_init__(self) -> None:
        if not self.components:
            raise MixError("A mix needs at least one adapter.")
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
        """A readable, unique adapter name: ``mix-<names and weights>-<digest prefix>``."""
        label = "+".join(f"{_short(c.name)}={c.weight:g}" for c in self.components)
        if len(label) > 80:
            label = label[:77] + "..."
        return f"{MIX_NAME_PREFIX}{label}-{self.digest[:12]}"

    @property
    def lora_int_id(self) -> int:
        """A deterministic id in [2^30, 2^31): stable across processes, clear of vLLM's small counter ids."""
        return (1 << 30) + int(self.digest[:8], 16) % (1 << 30)

    @property
    def lora_path(self) -> str:
        """The spec as it travels to the workers inside ``LoRARequest.lora_path``."""
        return MIX_PREFIX + self.key

    @classmethod
    def from_path(cls, path: str) -> MixSpec:
        """Parse ``mix:{...}`` back into a spec."""
        if not path.startswith(MIX_PREFIX):
            raise MixError(f"{path!r} is not a mix path (it must start with {MIX_PREFIX!r}).")
        try:
            raw = json.loads(path[len(MIX_PREFIX):])
            comps = tuple(MixComponent(str(n), str(s), float(w)) for n, s, w in raw["adapters"])
        except (ValueError, KeyError, TypeError) as err:
            raise MixError(f"Malformed mix path {path[:200]!r}: {err}.") from err
        return cls(comps)


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
    parts = expr.split("+")
    out: list[tuple[str, float | None]] = []
    for part in parts:
        name, eq, weight = part.partition("=")
        name = name.strip()
        if not name:
            raise MixError(f"Mix {expr!r} has an empty adapter name. Write it as 'a=0.7+b=0.3'.")
        if not eq:
            out.append((name, None))
            continue
        try:
            w = float(weight)
        except ValueError:
            raise MixError(f"Mix {expr!r}: weight {weight!r} of adapter {name!r} is not a number.") from None
        if not math.isfinite(w):
            raise MixError(f"Mix {expr!r}: weight of adapter {name!r} is {weight!r}; weights must be finite.")
        out.append((name, w))
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
    unknown = [a for a in adapters if a not in sources]
    if unknown:
        raise MixError(f"Unknown adapter(s) {unknown}; this deployment defines {sorted(sources)}.")
    if weights is not None and len(weights) != len(adapters):
        raise MixError(f"{len(adapters)} adapters but {len(weights)} adapter_weights; give one weight per adapter.")
    ws = list(weights) if weights is not None else [default_weights.get(a, 1.0) for a in adapters]
    return MixSpec(tuple(MixComponent(a, sources[a], w) for a, w in zip(adapters, ws)))


def concat_factors(parts: Sequence[tuple[torch.Tensor, torch.Tensor, float]], *, rank_dim_a: int = 0,
                   rank_dim_b: int = 1, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenate ``(A_i, B_i, c_i)`` along rank: ``A = cat(A_i)``, ``B = cat(c_i · B_i)`` (``c_i = w_i·s_i``).

    ``B·A = Σ c_i·B_i·A_i`` exactly up to one rounding of ``c_i·B_i`` to ``dtype`` (as vLLM itself folds
    scaling into B).
    Dense factors are ``A (r, in)``, ``B (out, r)``; per-expert ones ``A (E, r, in)``, ``B (E, out, r)``
    (``rank_dim_a=1, rank_dim_b=2``).

    Example:
        >>> a, b = concat_factors([(torch.ones(1, 2), torch.ones(3, 1), 0.5), (torch.ones(2, 2), torch.ones(3, 2), 2.0)])
        >>> (b @ a)[0, 0].item()
        4.5
    """
    if not parts:
        raise MixError("Nothing to concatenate.")
    out_dtype = dtype or parts[0][0].dtype
    a0, b0 = parts[0][0], parts[0][1]
    ranks = [int(p[0].shape[rank_dim_a]) for p in parts]
    a_shape = list(a0.shape)
    a_shape[rank_dim_a] = sum(ranks)
    b_shape = list(b0.shape)
    b_shape[rank_dim_b] = sum(ranks)
    a = torch.empty(a_shape, dtype=out_dtype)
    b = torch.empty(b_shape, dtype=out_dtype)
    off = 0
    for (pa, pb, c), r in zip(parts, ranks):  # one pass per part, written straight into the result
        a.narrow(rank_dim_a, off, r).copy_(pa)
        dst = b.narrow(rank_dim_b, off, r)
        if pb.dtype == out_dtype:
            torch.mul(pb, c, out=dst)
        else:
            dst.copy_(pb).mul_(c)
        off += r
    return a, b
