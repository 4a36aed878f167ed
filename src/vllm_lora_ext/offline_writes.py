"""The offline tools that write adapters: ``convert`` (MoE layout 2D <-> 3D) and ``mix`` (exact weighted mixes).

Both check everything before they write anything: every input passes the loader's own rules
(`offline_ops.load_adapter_files`), a mix's inputs must agree with each other on every module's input and output
sizes (and every MoE block's E, H and I), and the result must be finite. Writes go through
[`write_atomically`](outputs.py): a temporary folder swapped in whole, under a lock on the target.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from vllm_lora_ext.constants import VLLM_MAX_LORA_RANK_CHOICES
from vllm_lora_ext.errors import AdapterFormatError, MixError
from vllm_lora_ext.formats import PEFT_PREFIX, classify_key, group_moe_keys
from vllm_lora_ext.formats.moe import ExpertFactors, ExpertsLoRA, MoESpec
from vllm_lora_ext.formats.moe_plan import plan_experts
from vllm_lora_ext.mixing import MixFactor, MixPlan, concat_many
from vllm_lora_ext.offline_ops import MOE_SIZES_KEY, LoadedAdapter, load_adapter_files, require_safetensors
from vllm_lora_ext.outputs import write_atomically
from vllm_lora_ext.reader import read_header
from vllm_lora_ext.sources import ResolvedAdapter
from vllm_lora_ext.validation import check_rank_budget, first_nonfinite

__all__ = ["convert_adapter", "mix_adapter_files", "check_mixable", "MIX_PROVENANCE_NAME"]

MIX_PROVENANCE_NAME = "vllm_lora_ext_mix.json"  # beside a mix: its inputs' pinned sources and weights
_STANDARD_NAMES = ("gate_proj", "up_proj", "down_proj")


def _write(out_dir: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
           extra: Mapping[str, str] | None = None, metadata: Mapping[str, str] | None = None) -> Path:
    def write(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"),
                  metadata=dict(metadata) if metadata else None)
        (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    return write_atomically(out_dir, write)


def _dense_keys(module: str, embedding: bool) -> tuple[str, str]:
    """A dense module's two keys as PEFT writes them: an embedding's as ``lora_embedding_A``/``_B``, the names PEFT
    reads for an embedding layer (it skips ``lora_A.weight`` there, with only a warning of missing keys)."""
    if embedding:
        return f"{PEFT_PREFIX}{module}.lora_embedding_A", f"{PEFT_PREFIX}{module}.lora_embedding_B"
    return f"{PEFT_PREFIX}{module}.lora_A.weight", f"{PEFT_PREFIX}{module}.lora_B.weight"


def _moe_tensors(prefix: str, ex: ExpertsLoRA, spec: MoESpec, to: Literal["2d", "3d"]) -> dict[str, torch.Tensor]:
    p = PEFT_PREFIX + prefix
    out: dict[str, torch.Tensor] = {}
    if to == "2d":
        gate, up = ex._split_gate_up()
        for role, f, proj in (("gate", gate, spec.gate), ("up", up, spec.up), ("down", ex.down, spec.down)):
            if f is None:
                continue
            for j, e in enumerate(ex.experts):
                out[f"{p}.{e}.{proj}.lora_A.weight"] = f.a[j].clone()
                out[f"{p}.{e}.{proj}.lora_B.weight"] = f.b[j].clone()
        return out
    (w13_a, w2_a), (w13_b, w2_b) = ex.as_3d(hidden=spec.hidden)
    for key, a, b, present in ((f"{p}.base_layer", w13_a, w13_b, ex.gate_up or ex.gate or ex.up),
                               (p, w2_a, w2_b, ex.down)):
        if present is None:
            continue
        e, r, d_in = a.shape
        out[f"{key}.lora_A.weight"] = a.reshape(e * r, d_in)
        out[f"{key}.lora_B.weight"] = b.permute(1, 2, 0).reshape(b.shape[1], r * e)
    return out


def _record(specs: Mapping[str, MoESpec]) -> dict[str, str]:
    """The weight file metadata that lets convert's output read back alone (`offline_ops.recorded_moe_sizes`)."""
    if not specs:
        return {}
    return {MOE_SIZES_KEY: json.dumps({p: {"num_experts": s.num_experts, "hidden_size": s.hidden,
                                           "intermediate_size": s.intermediate, "names": [s.gate, s.up, s.down]}
                                       for p, s in specs.items()}, sort_keys=True)}


def _check_not_a_no_op(src: LoadedAdapter, resolved: ResolvedAdapter, to: str, rename: bool, name: str) -> None:
    """Refuse a convert that would change nothing: no MoE block, or every block already in the asked layout (3D:
    in the standard orientation)."""
    shapes = read_header(resolved.weights_path).shapes
    kinds = {classify_key(k).kind for k in shapes}
    if not kinds & {"moe_2d", "moe_3d"}:
        raise AdapterFormatError(f"Adapter {name!r} is already dense (it has no MoE expert weights), nothing to "
                                 f"convert. 'vllm-lora convert' rewrites MoE blocks only; use the adapter as it is.",
                                 adapter=name)
    if ("moe_3d" if to == "2d" else "moe_2d") in kinds:
        return
    if to == "3d":
        groups = group_moe_keys(shapes)
        plans = [plan_experts(groups[p], spec, config=src.config, adapter=name) for p, spec in src.specs.items()]
        if any(k.orientation != "standard" for plan in plans for k in plan.keys_3d):
            return  # transposed (PEFT 0.17-0.18) 3D becomes standard 3D
    renamable = to == "2d" and any(classify_key(k).proj not in (None, *_STANDARD_NAMES) for k in shapes)
    if renamable and rename:
        return
    raise AdapterFormatError(f"Adapter {name!r} is already {to.upper()} in every MoE block, nothing to convert. Use "
                             f"the adapter as it is" + (", or pass --rename to name its projections gate_proj/up_proj/"
                                                        "down_proj." if renamable else "."), adapter=name)


def convert_adapter(resolved: ResolvedAdapter, out_dir: str | os.PathLike[str], *, to: Literal["2d", "3d"],
                    base_config: Mapping[str, Any] | None = None, num_experts: int | None = None,
                    rename: bool = False, name: str = "adapter") -> Path:
    """Rewrite an adapter's MoE blocks as 2D per-expert keys or PEFT 3D fused keys (dense modules unchanged).

    The delta is preserved exactly. When every MoE factor keeps its rank and the config has no
    rank/alpha patterns, tensors are written unscaled under the original config (so 3D -> 2D -> 3D
    gives back the same tensors). Otherwise (a 2D gate/up pair with different A becomes one fused
    factor of rank ``2r``; per-module patterns) the MoE scaling is folded into B and the MoE modules
    get ``rank_pattern``/``alpha_pattern`` entries giving them scaling 1 (and converting that output
    back and forth gives it back bit for bit). Each block's E, H, I and 2D projection names are recorded in
    the weight file's metadata, so the output converts back without ``base_config`` and keeps ``w1/w2/w3``
    names; ``rename`` writes 2D projections as ``gate_proj/up_proj/down_proj`` instead.

    Raises:
        [`AdapterFormatError`]: the conversion would change nothing (a dense adapter, or already in that
            layout), or the adapter breaks a loader rule (see `offline_ops.load_adapter_files`).
        [`ExpertLayoutError`]: an MoE block's sizes cannot be settled without ``base_config``.
    """
    require_safetensors(resolved, name=name)
    src = load_adapter_files(resolved, base_config=base_config, num_experts=num_experts, scaled=False, name=name)
    _check_not_a_no_op(src, resolved, to, rename, name)
    rank_change = to == "3d" and any(int(ex.as_3d(hidden=src.specs[p].hidden)[0][0].shape[1]) != src.config.r
                                     for p, ex in src.moe.items())
    fold = bool(src.moe) and (src.config.has_patterns or rank_change)
    if fold:
        src = load_adapter_files(resolved, base_config=base_config, num_experts=num_experts, scaled=True, name=name)
    specs = {p: (MoESpec(p, s.num_experts, s.hidden, s.intermediate, interleaved=s.interleaved) if rename else s)
             for p, s in src.specs.items()}
    cfg = dict(src.config.raw)
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in src.dense.items():
        key_a, key_b = _dense_keys(module, module in src.embeddings)
        tensors[key_a], tensors[key_b] = a, b
    rank_pattern: dict[str, Any] = {}  # the folded blocks' exact patterns: first, so that PEFT (and this package)
    alpha_pattern: dict[str, Any] = {}  # match them before any inherited one that also names their modules
    unit = (lambda r: float(r) ** 0.5) if src.config.use_rslora else (lambda r: float(r))
    for prefix, ex in src.moe.items():
        spec = specs[prefix]
        written = _moe_tensors(prefix, ex, spec, to)
        tensors.update(written)
        for key, t in written.items() if fold else ():
            if key.endswith("lora_A.weight"):
                info = classify_key(key)
                r = int(t.shape[0]) if info.kind == "moe_2d" else int(t.shape[0]) // spec.num_experts
                if info.kind == "moe_2d":
                    pattern = f"{re.escape(prefix)}\\.\\d+\\.{info.proj}"
                else:
                    pattern = re.escape(prefix) + ("\\.gate_up_proj" if info.nesting else "\\.down_proj")
                rank_pattern[pattern], alpha_pattern[pattern] = r, unit(r)
    for mine, inherited in ((rank_pattern, cfg.get("rank_pattern")), (alpha_pattern, cfg.get("alpha_pattern"))):
        mine.update({k: v for k, v in dict(inherited or {}).items() if k not in mine})
    _convert_targets(cfg, src, specs, to, rename)
    if rank_pattern:
        cfg["rank_pattern"], cfg["alpha_pattern"] = rank_pattern, alpha_pattern
    cfg["peft_version"] = "0.21.0"  # tensors are written in the standard (PEFT >= 0.19.1) orientation
    cfg.pop("moe_3d_orientation", None)
    return _write(out_dir, tensors, cfg, metadata=_record(specs))


def _convert_targets(cfg: dict[str, Any], src: LoadedAdapter, specs: Mapping[str, MoESpec], to: str,
                     rename: bool) -> None:
    """``target_modules`` (and ``target_parameters``) of a converted adapter's config, in place: for ``--to 3d``
    the fused parameters, and no expert projection left as a module name (PEFT would look for it in the fused
    experts); for ``--to 2d`` the per-expert projections' names. A pattern (or ``"all-linear"``, which PEFT
    resolves against the experts too) gives way to the names of the dense modules the adapter has."""
    dense_names = {m.rsplit(".", 1)[-1] for m in src.dense}  # the modules PEFT must still find by name
    listed = cfg.get("target_modules")
    tm = set(listed) if isinstance(listed, list) else set(dense_names)
    if to == "3d" and src.moe:
        blocks = sorted({p.split(".layers.")[-1].split(".", 1)[-1] for p in src.moe})
        cfg["target_parameters"] = [f"{b}.{n}" for b in blocks for n in ("gate_up_proj", "down_proj")]
        experts = {n for s in src.specs.values() for n in (s.gate, s.up, s.down)}
        cfg["target_modules"] = sorted(tm - (experts - dense_names))
    elif to == "2d":
        cfg.pop("target_parameters", None)
        if rename:
            tm -= {"w1", "w2", "w3"} - dense_names
        cfg["target_modules"] = sorted(tm | {n for s in specs.values() for n in (s.gate, s.up, s.down)})


def check_mixable(loaded: Sequence[LoadedAdapter], names: Sequence[str]) -> None:
    """Refuse adapters that cannot be mixed: a module whose input or output size differs between two of them, or
    an MoE block whose E, H or I differs (rank concatenation needs equal sizes; they were trained for different
    base models).

    Raises:
        [`MixError`]: names every such module, both adapters and both shapes.
    """
    problems: list[str] = []
    first: dict[str, tuple[str, tuple[int, ...], tuple[int, ...]]] = {}
    for la, name in zip(loaded, names):
        for module, (a, b) in la.dense.items():
            sa, sb = tuple(a.shape), tuple(b.shape)
            ref = first.setdefault(module, (name, sa, sb))
            if (sa[1:], sb[:1]) != (ref[1][1:], ref[2][:1]):
                problems.append(f"module {module!r} is A {sa}, B {sb} in {name!r} but A {ref[1]}, B {ref[2]} in "
                                f"{ref[0]!r}")
        for prefix, spec in la.specs.items():
            sizes = (spec.num_experts, spec.hidden, spec.intermediate)
            ref_moe = first.setdefault(prefix, (name, sizes, ()))
            if sizes != ref_moe[1]:
                problems.append(f"MoE block {prefix!r} has (E, H, I) {sizes} in {name!r} but {ref_moe[1]} in "
                                f"{ref_moe[0]!r}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise MixError("Cannot mix these adapters: " + "; ".join(problems[:3]) + more + ". Their factors must fit "
                       "the same base model: mix adapters trained for one base model. Nothing was written.")


def _mix_factors(la: LoadedAdapter) -> dict[Any, MixFactor]:
    """An adapter's factors as [`MixPlan`] takes them: dense modules with their scaling, and each MoE block's gate,
    up and down factors ``A (E, r, in)``, ``B (E, out, r)`` (scaling folded in when read)."""
    out: dict[Any, MixFactor] = {m: MixFactor(a, b, la.config.scaling_for(m, int(a.shape[0])))
                                 for m, (a, b) in la.dense.items()}
    for prefix, ex in la.moe.items():
        gate, up = ex._split_gate_up()
        for role, f in (("gate", gate), ("up", up), ("down", ex.down)):
            if f is not None:
                out[(prefix, role)] = MixFactor(f.a, f.b, 1.0, rank_dim=1)
    return out


def _check_mix_finite(tensors: Mapping[str, torch.Tensor], inputs: Sequence[tuple[str, float]],
                      out_dir: str | os.PathLike[str]) -> None:
    """Refuse a mix whose factors overflow their dtype (|w| <= 100 of finite factors can still pass a 16-bit
    dtype's range), naming the inputs and weights as given and the output folder, not an internal name."""
    key = first_nonfinite(tensors)
    if key is None:
        return
    dtype = str(tensors[key].dtype).removeprefix("torch.")
    given = " ".join(f"{n}={w:g}" for n, w in inputs)
    out = os.fspath(out_dir)
    raise AdapterFormatError(f"The mix {given} into {out!r} overflows {dtype}: tensor {key!r} holds infinite or NaN "
                             f"values once each input's weight and scaling are folded into its A. Nothing was "
                             f"written. Lower the weights, so that every w·s·A stays within {dtype}'s range "
                             f"(±{torch.finfo(tensors[key].dtype).max:.6g}).", adapter=out, key=key)


def mix_adapter_files(adapters: Sequence[tuple[ResolvedAdapter, float]], out_dir: str | os.PathLike[str], *,
                      base_config: Mapping[str, Any] | None = None, num_experts: int | None = None,
                      names: Sequence[str] | None = None) -> Path:
    """Write the exact rank-concatenated mix Σ wᵢ·sᵢ·BᵢAᵢ as a standard PEFT adapter (scaling 1 per module).

    Every module gets ``rank_pattern = alpha_pattern = its rank`` so PEFT (and vLLM with this plugin)
    apply scaling 1; MoE blocks are written as 2D per-expert keys (3D inputs too). ``vllm_lora_ext_mix.json``
    beside it records the inputs' pinned sources and weights. ``names`` name the inputs in messages.

    Raises:
        [`MixError`]: the inputs do not fit each other ([`check_mixable`]).
        [`AdapterFormatError`]: an input breaks a loader rule, or the mix overflows its dtype.
    """
    labels = list(names) if names is not None else [r.source.raw for r, _ in adapters]
    loaded = [(load_adapter_files(r, base_config=base_config, num_experts=num_experts, name=n), w)
              for n, (r, w) in zip(labels, adapters)]
    check_mixable([la for la, _ in loaded], labels)
    plan = MixPlan.from_components("mix", [(n, w, _mix_factors(la)) for n, (la, w) in zip(labels, loaded)])
    done = concat_many(plan.jobs, workers=1)
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    for m in dict.fromkeys(m for la, _ in loaded for m in la.dense):
        a, b = done[m]
        key_a, key_b = _dense_keys(m, any(m in la.embeddings for la, _ in loaded))
        tensors[key_a], tensors[key_b] = a, b
        ranks[m] = int(a.shape[0])
    for prefix in dict.fromkeys(p for la, _ in loaded for p in la.moe):
        first = next(la for la, _ in loaded if prefix in la.moe)
        spec = first.specs[prefix]
        mixed = ExpertsLoRA(prefix, first.moe[prefix].experts, spec.intermediate, interleaved=spec.interleaved)
        for role, proj in (("gate", spec.gate), ("up", spec.up), ("down", spec.down)):
            if (prefix, role) in done:
                a, b = done[(prefix, role)]
                setattr(mixed, role, ExpertFactors(a, b))
                ranks[f"{re.escape(prefix)}\\.\\d+\\.{proj}"] = int(a.shape[1])  # a regex: every expert
        tensors.update(_moe_tensors(prefix, mixed, spec, "2d"))
    r = max(ranks.values())
    check_rank_budget(r, VLLM_MAX_LORA_RANK_CHOICES[-1], adapter="mix", mix=True,  # no vLLM could serve it
                      what=f"The mix has rank {r}", detail=" at most in vLLM. Nothing was written")
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": float(r), "use_rslora": False, "bias": "none",
           "target_modules": sorted({m.rsplit(".", 1)[-1] for m in ranks}),  # informational
           "rank_pattern": {m: k for m, k in ranks.items()}, "alpha_pattern": {m: float(k) for m, k in ranks.items()},
           "peft_version": "0.21.0"}
    _check_mix_finite(tensors, [(n, w) for n, (_, w) in zip(labels, adapters)], out_dir)
    provenance = json.dumps({"adapters": [[ra.source.canonical(), w] for ra, w in adapters]}, indent=2)
    return _write(out_dir, tensors, cfg, {MIX_PROVENANCE_NAME: provenance})
