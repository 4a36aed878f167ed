"""What ``vllm-lora verify`` decides, as pure functions over plain data (no vLLM, no GPU).

``verify`` scores the same token sequences on two sides, vLLM with the plugin and HF transformers + PEFT in
float32, and compares per-position logprobs. This module owns everything in that check that is not running a
model:

- **Truncation** (``--layers K``): [`truncate_config`] gives the config overrides that keep the first K decoder
  layers (``num_hidden_layers`` and every per-layer list), and [`keep_layers`] keeps the checkpoint or adapter keys
  of those layers. A key's decoder layer is the ``N`` of its first ``.layers.N.`` (or ``.h.N.``); a key with no
  such part (embeddings, final norm, ``lm_head``) belongs to every truncation.
- **Module groups**: [`group_of`] names the group a LoRA module belongs to (``attention``, ``attention.<name>`` for
  any attention projection other than q/k/v/o, such as MLA's ``kv_b_proj``, ``routed_experts``,
  ``shared_experts``, ``router``, ``dense_mlp``, ``embeddings``, ``lm_head``, else ``<block>.<name>``).
  [`without_group`] is the adapter with one group's deltas set to zero (its ``lora_B`` tensors zeroed, every key
  kept, so both sides load it exactly as they load the full adapter).
- **Statistics and verdict**: [`measure_gap`] is the mean and max ``|Δ logprob|`` of two runs; [`judge`] reads
  the runs of both sides (base, adapter, and the adapter without each group) and decides.

Judging, with ``tol = max(factor · noise, floor)`` where ``noise`` is the mean gap of the base model alone
(vLLM vs HF, no adapter):

- the **control** (vLLM's base model against HF + adapter) must differ by more than ``2 · tol``: otherwise the
  adapter changes too little for this check to tell an applied adapter from an ignored one (FAIL, inconclusive);
- the adapter's mean gap must be at most ``tol``; the max is reported, not judged (MoE routing that ties to bf16
  precision moves single positions whatever LoRA does);
- a group is **not applied** where removing it changes HF's logprobs by more than ``tol`` but vLLM's by at most
  ``min(tol, effect_hf / 4)``; it **differs** where removing it alone brings a failing gap within ``tol``, or where
  it changes vLLM's logprobs beyond ``tol`` and HF's not. Either fails the check and is named.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from vllm_lora_ext.errors import AdapterCompatibilityError, VerifyError
from vllm_lora_ext.formats import classify_key

if TYPE_CHECKING:
    import torch

__all__ = ["BASE", "FULL", "GapStats", "GroupCheck", "Thresholds", "VerifyReport", "ablation_name", "adapter_groups",
           "apply_overrides", "check_layers_cover", "group_of", "judge", "keep_layers", "layer_of", "layers_needed",
           "measure_gap", "truncate_config", "without_group"]

BASE = "base"
FULL = "adapter"

_LAYER = re.compile(r"(?:^|\.)(?:layers|h)\.(\d+)\.")
_ATTENTION_BLOCKS = frozenset({"self_attn", "attn", "attention", "self_attention"})
_ATTENTION_QKVO = frozenset({"q_proj", "k_proj", "v_proj", "o_proj", "qkv_proj", "query_key_value", "c_attn",
                             "c_proj", "dense", "wq", "wk", "wv", "wo", "wqkv", "out_proj", "query", "key", "value"})
_MLP_BLOCKS = frozenset({"mlp", "feed_forward", "ffn", "block_sparse_moe", "moe"})
_ROUTERS = frozenset({"gate", "router"})
_SHARED = ("shared_expert", "shared_experts", "shared_mlp")
# Per-layer config lists that are indices of layers (kept where < K), not one entry per layer.
_INDEX_LISTS = frozenset({"mlp_only_layers"})

Status = Literal["ok", "not applied", "differs", "no effect"]


def layer_of(key: str) -> int | None:
    """Return the decoder layer a checkpoint or adapter key belongs to, or ``None`` for keys outside the layers.

    Example:
        >>> layer_of("base_model.model.model.layers.12.mlp.experts.lora_A.weight"), layer_of("lm_head.weight")
        (12, None)
    """
    m = _LAYER.search(key)
    return int(m.group(1)) if m else None


def keep_layers(keys: Sequence[str], num_layers: int) -> list[str]:
    """Return the keys of ``keys`` that a model truncated to its first ``num_layers`` decoder layers has, in order.

    Example:
        >>> keep_layers(["model.layers.0.q.lora_A.weight", "model.layers.2.q.lora_A.weight", "lm_head.weight"], 2)
        ['model.layers.0.q.lora_A.weight', 'lm_head.weight']
    """
    out = []
    for k in keys:
        layer = layer_of(k)
        if layer is None or layer < num_layers:
            out.append(k)
    return out


def _layer_holder(config: Mapping[str, Any]) -> tuple[str | None, Mapping[str, Any]]:
    """The (sub-)config that holds ``num_hidden_layers``: the config itself, else its one nested text config."""
    if isinstance(config.get("num_hidden_layers"), int):
        return None, config
    nested = [(k, v) for k, v in config.items()
              if isinstance(v, Mapping) and isinstance(v.get("num_hidden_layers"), int)]
    text = [(k, v) for k, v in nested if "text" in k or "language" in k or "llm" in k]
    found = text or nested
    if len(found) != 1:
        where = ", ".join(k for k, _ in nested) or "nowhere"
        raise VerifyError(f"Cannot truncate the model: its config has no num_hidden_layers at the top level and "
                          f"{len(nested)} nested configs with one ({where}). Run verify without --layers.")
    return found[0]


def truncate_config(config: Mapping[str, Any], num_layers: int) -> dict[str, Any]:
    """Return the config overrides that keep a model's first ``num_layers`` decoder layers.

    ``num_hidden_layers`` becomes ``num_layers``; every list with one entry per layer (``layer_types``, ...) is cut
    to its first ``num_layers`` entries, and index lists (``mlp_only_layers``) keep the indices below it. A config
    whose layers live in a nested text config (``text_config``) gets a nested override. The overrides go to vLLM
    as ``hf_overrides`` and are merged into the ``config.json`` of a truncated checkpoint ([`apply_overrides`]).
    ``num_layers`` at or above the model's count changes nothing (``{}``).

    Raises:
        [`VerifyError`]: ``num_layers`` is below 1, or the config has no (or several) ``num_hidden_layers``.

    Example:
        >>> truncate_config({"num_hidden_layers": 4, "layer_types": ["a", "b", "a", "b"], "mlp_only_layers": [0, 3]}, 2)
        {'num_hidden_layers': 2, 'layer_types': ['a', 'b'], 'mlp_only_layers': [0]}
    """
    if type(num_layers) is not int or num_layers < 1:
        raise VerifyError(f"--layers {num_layers!r}: give a number of decoder layers from 1 up.")
    holder_key, holder = _layer_holder(config)
    total = int(holder["num_hidden_layers"])
    if num_layers >= total:
        return {}
    over: dict[str, Any] = {"num_hidden_layers": num_layers}
    for k, v in holder.items():
        if not isinstance(v, list):
            continue
        if k in _INDEX_LISTS:
            if all(type(i) is int for i in v):
                over[k] = [i for i in v if i < num_layers]
        elif len(v) == total:
            over[k] = list(v[:num_layers])
    return {holder_key: over} if holder_key is not None else over


def apply_overrides(config: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Return ``config`` with ``overrides`` merged in (nested mappings merged key by key), as vLLM applies them.

    Example:
        >>> apply_overrides({"a": 1, "text_config": {"n": 4, "m": 1}}, {"text_config": {"n": 2}})
        {'a': 1, 'text_config': {'n': 2, 'm': 1}}
    """
    out = dict(config)
    for k, v in overrides.items():
        if isinstance(v, Mapping) and isinstance(out.get(k), Mapping):
            out[k] = apply_overrides(out[k], v)
        else:
            out[k] = v
    return out


def group_of(module: str) -> str:
    """Name the module group of a LoRA module path (``model.layers.3.self_attn.kv_b_proj``, no PEFT prefix).

    Example:
        >>> [group_of(m) for m in ("model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.kv_b_proj",
        ...                        "model.layers.1.mlp.experts.base_layer", "model.layers.1.mlp.shared_experts.up_proj",
        ...                        "model.layers.0.mlp.down_proj", "lm_head")]
        ['attention', 'attention.kv_b_proj', 'routed_experts', 'shared_experts', 'dense_mlp', 'lm_head']
    """
    m = _LAYER.search(module)
    rel = module[m.end():] if m else module
    parts = rel.split(".")
    leaf = parts[-1]
    if any(p in _SHARED or p.startswith("shared_expert") for p in parts):
        return "shared_experts"
    if "experts" in parts:
        return "routed_experts"
    parent = parts[-2] if len(parts) > 1 else ""
    if parent in _ATTENTION_BLOCKS:
        return "attention" if leaf in _ATTENTION_QKVO else f"attention.{leaf}"
    if parent in _MLP_BLOCKS:
        return "router" if leaf in _ROUTERS else "dense_mlp"
    if leaf in ("embed_tokens", "wte", "word_embeddings", "embed_in"):
        return "embeddings"
    if leaf in ("lm_head", "embed_out"):
        return "lm_head"
    return f"{parent}.{leaf}" if parent else leaf


def adapter_groups(keys: Sequence[str]) -> dict[str, list[str]]:
    """Return ``{group: [keys]}`` for an adapter's LoRA keys (``lora_A``/``lora_B``, embeddings too), groups sorted
    by name, keys in order; keys that are not LoRA factors (``modules_to_save`` weights, DoRA magnitudes) are left out.
    """
    out: dict[str, list[str]] = {}
    for k in keys:
        info = classify_key(k)
        if info.which:
            out.setdefault(group_of(info.module), []).append(k)
    return dict(sorted(out.items()))


def layers_needed(keys: Sequence[str]) -> dict[str, int]:
    """Return, per module group, the fewest leading decoder layers that still hold one of its keys."""
    out: dict[str, int] = {}
    for group, ks in adapter_groups(keys).items():
        layers = [layer_of(k) for k in ks]
        out[group] = 0 if None in layers else min(int(x) for x in layers if x is not None) + 1
    return out


def check_layers_cover(keys: Sequence[str], num_layers: int, *, adapter: str = "adapter") -> None:
    """Refuse a truncation that leaves a module group of the adapter with no key (it would go unchecked).

    Raises:
        [`AdapterCompatibilityError`]: names every group lost and the ``--layers`` that keeps them all.
    """
    need = layers_needed(keys)
    lost = sorted(g for g, n in need.items() if n > num_layers)
    if lost:
        first = ", ".join(f"{g} (first in layer {need[g] - 1})" for g in lost)
        raise AdapterCompatibilityError(
            f"Adapter {adapter!r}: --layers {num_layers} keeps no key of {first}, so verify could not check "
            f"{'it' if len(lost) == 1 else 'them'}. Give --layers {max(need.values())} or more.", adapter=adapter)


def ablation_name(group: str) -> str:
    """The run name of the adapter without ``group``."""
    return f"without {group}"


def without_group(tensors: Mapping[str, torch.Tensor], group: str) -> dict[str, torch.Tensor]:
    """Return the adapter with ``group``'s deltas set to zero: its ``lora_B`` factors zeroed, every key kept.

    Keeping the keys keeps the adapter's structure, so PEFT builds the same modules (no factor falls back to
    its initialisation) and vLLM routes the same keys; other tensors are the same objects.
    """
    import torch

    out = dict(tensors)
    for k in adapter_groups(list(tensors)).get(group, []):
        if classify_key(k).which == "B":
            out[k] = torch.zeros_like(tensors[k])
    return out


@dataclass(frozen=True)
class GapStats:
    """Mean and max ``|Δ logprob|`` between two runs over the same positions."""

    mean: float
    max: float
    positions: int

    def as_dict(self) -> dict[str, float]:
        return {"mean": self.mean, "max": self.max, "positions": self.positions}


def measure_gap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> GapStats:
    """Return the mean and max ``|a - b|`` over every position of every sequence (a NaN or inf gap is inf).

    Raises:
        [`VerifyError`]: the runs cover different sequences or positions.

    Example:
        >>> measure_gap([[-1.0, -2.0]], [[-1.5, -2.0]])
        GapStats(mean=0.25, max=0.5, positions=2)
    """
    if len(a) != len(b) or any(len(x) != len(y) for x, y in zip(a, b)):
        raise VerifyError(f"The two runs scored different positions ({[len(x) for x in a]} vs {[len(y) for y in b]}).")
    diffs = [abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys)]
    diffs = [d if math.isfinite(d) else math.inf for d in diffs]
    if not diffs:
        raise VerifyError("No positions were scored: give prompts of at least two tokens.")
    return GapStats(sum(diffs) / len(diffs), max(diffs), len(diffs))


@dataclass(frozen=True)
class Thresholds:
    """``tol = max(factor · noise, floor)``, or ``tolerance`` when given."""

    factor: float = 3.0
    floor: float = 0.02
    tolerance: float | None = None

    def __post_init__(self) -> None:
        for name in ("factor", "floor"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise VerifyError(f"Tolerance {name} {v!r} must be a positive number.")
        if self.tolerance is not None and not (math.isfinite(self.tolerance) and self.tolerance > 0):
            raise VerifyError(f"--tolerance {self.tolerance!r} must be a positive number.")

    def tol(self, noise: GapStats) -> float:
        if self.tolerance is not None:
            return self.tolerance
        return max(self.factor * noise.mean, self.floor)


@dataclass(frozen=True)
class GroupCheck:
    """One module group: how much removing it changes each side, vLLM's gap without it, and the judgement."""

    group: str
    effect_hf: GapStats
    effect_vllm: GapStats
    gap_without: GapStats
    status: Status

    def as_dict(self) -> dict[str, Any]:
        return {"effect_hf": self.effect_hf.as_dict(), "effect_vllm": self.effect_vllm.as_dict(),
                "gap_without": self.gap_without.as_dict(), "status": self.status}


@dataclass(frozen=True)
class VerifyReport:
    """The numbers and the decision of one verify run."""

    noise: GapStats
    gap: GapStats
    control: GapStats
    tolerance: float
    groups: tuple[GroupCheck, ...]
    passed: bool
    reason: str
    extra: Mapping[str, Any] = field(default_factory=dict)

    def verdict_line(self) -> str:
        return f"verdict: {'PASS' if self.passed else 'FAIL'} {self.reason}"

    def as_dict(self) -> dict[str, Any]:
        return {"verdict": "PASS" if self.passed else "FAIL", "reason": self.reason, "tolerance": self.tolerance,
                "noise": self.noise.as_dict(), "gap": self.gap.as_dict(), "control": self.control.as_dict(),
                "groups": {g.group: g.as_dict() for g in self.groups}, **dict(self.extra)}


def _status(effect_hf: float, effect_vllm: float, without: float, gap: float, tol: float) -> Status:
    if effect_hf > tol and effect_vllm <= min(tol, effect_hf / 4):
        return "not applied"
    if gap > tol and without <= tol:
        return "differs"
    if effect_vllm > tol and effect_hf <= tol:
        return "differs"
    if effect_hf <= tol and effect_vllm <= tol:
        return "no effect"
    return "ok"


Runs = Mapping[str, Sequence[Sequence[float]]]


def judge(hf: Runs, vllm: Runs, groups: Sequence[str], *, thresholds: Thresholds | None = None) -> VerifyReport:
    """Decide whether vLLM applies the adapter as HF + PEFT does, from both sides' per-position logprobs.

    Args:
        hf, vllm (`Mapping[str, list[list[float]]]`):
            Each side's runs, keyed [`BASE`], [`FULL`] and ``ablation_name(group)`` for each of ``groups``.
        groups (`Sequence[str]`):
            The module groups that were ablated.
        thresholds ([`Thresholds`], *optional*):
            How far above the base's own noise a gap may be.

    Returns:
        [`VerifyReport`]: the numbers, each group's judgement, and the verdict with its reason.

    Raises:
        [`VerifyError`]: a run is missing or covers other positions.
    """
    th = thresholds or Thresholds()
    for side, runs in (("HF", hf), ("vLLM", vllm)):
        missing = [n for n in (BASE, FULL, *map(ablation_name, groups)) if n not in runs]
        if missing:
            raise VerifyError(f"The {side} side has no run for {', '.join(missing)}.")
    noise = measure_gap(vllm[BASE], hf[BASE])
    tol = th.tol(noise)
    gap = measure_gap(vllm[FULL], hf[FULL])
    control = measure_gap(vllm[BASE], hf[FULL])
    checks = []
    for g in groups:
        name = ablation_name(g)
        e_hf, e_v = measure_gap(hf[FULL], hf[name]), measure_gap(vllm[FULL], vllm[name])
        without = measure_gap(vllm[name], hf[name])
        checks.append(GroupCheck(g, e_hf, e_v, without, _status(e_hf.mean, e_v.mean, without.mean, gap.mean, tol)))
    passed, reason = _verdict(noise, gap, control, tol, checks)
    return VerifyReport(noise, gap, control, tol, tuple(checks), passed, reason)


def _verdict(noise: GapStats, gap: GapStats, control: GapStats, tol: float,
             checks: Sequence[GroupCheck]) -> tuple[bool, str]:
    numbers = (f"mean |Δ logprob| {gap.mean:.4f} (max {gap.max:.4f}) against HF + PEFT, base noise {noise.mean:.4f}, "
               f"tolerance {tol:.4f}, no-adapter control {control.mean:.4f}")
    if not control.mean > 2 * tol:
        return False, (f"inconclusive: without the adapter vLLM differs from HF + PEFT by only {control.mean:.4f} "
                       f"(tolerance {tol:.4f}), so this check cannot tell an applied adapter from an ignored one. "
                       f"Score prompts the adapter changes (--prompt), or check that its lora_B weights are not zero")
    problems = []
    for c in checks:
        if c.status == "not applied":
            problems.append(f"vLLM does not apply {c.group} (removing it changes HF + PEFT by "
                            f"{c.effect_hf.mean:.4f}, vLLM by {c.effect_vllm.mean:.4f})")
        elif c.status == "differs":
            problems.append(f"vLLM applies {c.group} differently from HF + PEFT (removing it changes HF by "
                            f"{c.effect_hf.mean:.4f}, vLLM by {c.effect_vllm.mean:.4f}; gap without it "
                            f"{c.gap_without.mean:.4f})")
    if gap.mean > tol and not problems:
        problems.append("the adapter's gap is above tolerance and no single module group explains it")
    if problems:
        return False, "; ".join(problems) + f"; {numbers}"
    checked = ", ".join(c.group for c in checks if c.status == "ok") or "none"
    return True, f"vLLM applies the adapter as HF + PEFT does: {numbers}; groups checked: {checked}"
