"""Model-free operations on adapter files: MoE specs without a model, layout conversion, mixes, EP read plans.

Without a running model the MoE sizes come from the adapter itself (2D keys carry E, H and I) or
from the base model's ``config.json`` (``num_experts``/``num_local_experts``, ``hidden_size``,
``moe_intermediate_size`` or ``intermediate_size``), which fused 3D adapters need.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from safetensors.torch import save_file

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext._util import read_capped, short_repr
from vllm_lora_ext.constants import MAX_CONFIG_BYTES, MAX_EXPERTS
from vllm_lora_ext.errors import AdapterFormatError, AdapterNotFoundError, ExpertLayoutError
from vllm_lora_ext.outputs import write_atomically
from vllm_lora_ext.formats import PEFT_PREFIX, classify_key, group_moe_keys
from vllm_lora_ext.formats.moe import ExpertFactors, ExpertsLoRA, MoESpec, plan_experts, read_experts
from vllm_lora_ext.mixing import concat_factors
from vllm_lora_ext.reader import SafetensorsReader
from vllm_lora_ext.sources import ResolvedAdapter
from vllm_lora_ext.summary import load_config
from vllm_lora_ext.validation import check_finite

__all__ = ["LoadedAdapter", "load_adapter_files", "load_base_config", "moe_specs", "infer_moe_specs", "convert_adapter",
           "mix_adapter_files", "ep_read_plan"]


def _base_dims(base_config: Mapping[str, Any]) -> tuple[int, int, int]:
    text = base_config.get("text_config")
    cfg = dict(text if isinstance(text, Mapping) else base_config)
    e = cfg.get("num_experts") or cfg.get("num_local_experts") or cfg.get("n_routed_experts")
    h = cfg.get("hidden_size")
    i = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if not (e and h and i):
        raise ExpertLayoutError("The base config has no num_experts/num_local_experts, hidden_size and "
                                "moe_intermediate_size/intermediate_size; pass the MoE model's config.json.")
    for name, v, top in (("num_experts", e, MAX_EXPERTS), ("hidden_size", h, 1 << 20), ("intermediate_size", i, 1 << 20)):
        if type(v) is not int or not 1 <= v <= top:
            raise ExpertLayoutError(f"The base config's {name}={short_repr(v)} must be an integer from 1 to {top}; "
                                    f"pass the MoE model's own config.json.")
    return e, h, i


def load_base_config(value: str) -> dict[str, Any]:
    """Load a base model's ``config.json`` from a file, a model folder, or ``hf:org/model[@rev]``.

    From the Hub only ``config.json`` is downloaded (offline: read from the cache). This is the one
    loader behind every ``--base-config``.

    Raises:
        [`AdapterSourceError`]: a malformed ``hf:`` id.
        [`AdapterNotFoundError`]: no such file, folder, repo or revision.
        [`AdapterFormatError`]: the file is too large or not a JSON object.
    """
    if value.startswith("hf:"):
        from vllm_lora_ext.sources import _check_repo_id, _check_revision

        repo_id, at, revision = value[3:].partition("@")
        _check_repo_id(value, repo_id)
        if at:
            _check_revision(value, revision)
        from vllm_lora_ext.sources import AdapterSource, _HubClient
        from vllm_lora_ext.constants import hf_offline

        client = _HubClient(AdapterSource(value, "hf", repo_id=repo_id, revision=revision or None), cache_dir=None,
                            token=None, local_files_only=hf_offline())
        found = client.fetch("config.json", revision or None)
        if found is None:
            raise AdapterNotFoundError(f"Base model {value!r} has no config.json. Name the base model's repo.",
                                       source=value)
        path = found
    else:
        path = Path(value).expanduser()
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise AdapterNotFoundError(f"Base config {str(path)!r} does not exist. Pass the base model's config.json, "
                                       f"its folder, or hf:org/model.", source=value)
    data, too_big = read_capped(path, MAX_CONFIG_BYTES)
    if too_big:
        raise AdapterFormatError(f"Base config {str(path)!r} is larger than {MAX_CONFIG_BYTES} bytes; pass the "
                                 f"model's config.json.")
    try:
        raw = json.loads(data.decode("utf-8"))
    except (ValueError, UnicodeDecodeError, RecursionError) as err:
        raise AdapterFormatError(f"Base config {str(path)!r} is not valid JSON ({str(err)[:200]}).") from None
    if not isinstance(raw, dict):
        raise AdapterFormatError(f"Base config {str(path)!r} must be a JSON object (a model's config.json).")
    return raw


def base_config_for(config: AdapterConfig, explicit: str | None) -> tuple[dict[str, Any] | None, str | None]:
    """Return the base model config to use and where it came from (for the CLI to say so).

    ``explicit`` (``--base-config``) wins. Otherwise, if the adapter's ``base_model_name_or_path`` is a Hub id
    whose ``config.json`` is already in the local Hugging Face cache, that one is used (no network).
    """
    if explicit:
        return load_base_config(explicit), f"--base-config {explicit}"
    ref = config.base_model_name_or_path
    if not ref:
        return None, None
    from huggingface_hub import try_to_load_from_cache

    from vllm_lora_ext.sources import _looks_like_repo_id

    if not _looks_like_repo_id(ref):
        return None, None
    hit = try_to_load_from_cache(ref, "config.json")
    if not isinstance(hit, str):
        return None, None
    return load_base_config(hit), f"{ref} (config.json from the local Hugging Face cache)"


def _solve_3d(pairs: list[tuple[int, int]], orientation: str | None) -> set[tuple[int, int, str]]:
    """Every ``(H, I, orientation)`` under which the fused pairs ``(in, out)`` are one gate_up and/or one down.

    gate_up is ``in=H, out=2I`` (standard) or ``in=2I, out=H`` (transposed); down is ``in=I, out=H`` or
    ``in=H, out=I``. With two pairs each must take a different role; one pair may be either role.
    """
    found: set[tuple[int, int, str]] = set()
    for orient in ([orientation] if orientation else ["standard", "transposed"]):
        def readings(pair: tuple[int, int]) -> list[tuple[str, int, int]]:
            d_in, d_out = pair
            out: list[tuple[str, int, int]] = []
            if orient == "standard":
                if d_out % 2 == 0:
                    out.append(("gate_up", d_in, d_out // 2))
                out.append(("down", d_out, d_in))
            else:
                if d_in % 2 == 0:
                    out.append(("gate_up", d_out, d_in // 2))
                out.append(("down", d_in, d_out))
            return out

        if len(pairs) == 1:
            found.update((h, i, orient) for _, h, i in readings(pairs[0]))
        elif len(pairs) == 2:
            for r1, h1, i1 in readings(pairs[0]):
                for r2, h2, i2 in readings(pairs[1]):
                    if r1 != r2 and (h1, i1) == (h2, i2):
                        found.add((h1, i1, orient))
    return found


def infer_moe_specs(shapes: Mapping[str, tuple[int, ...]], *, base_config: Mapping[str, Any] | None = None,
                    num_experts: int | None = None, config: AdapterConfig | None = None
                    ) -> tuple[dict[str, MoESpec], dict[str, str]]:
    """Return a [`MoESpec`] per experts block, and per block a note on what was inferred or is ambiguous.

    Sizes come from the base config when given; otherwise from the adapter itself: 2D keys carry H and I
    and the highest expert index; fused 3D tensors give ``E = rows / r`` (``r`` from the adapter config)
    and H and I wherever their shapes allow only one reading (both tensors present, or an orientation
    known from ``moe_3d_orientation``/``peft_version``).

    Raises:
        [`ExpertLayoutError`]: a block's sizes cannot be settled from the adapter; the message says what is
            ambiguous and that ``--base-config`` settles it.
    """
    from vllm_lora_ext.formats.moe import _orientation_hint

    blocks = group_moe_keys(shapes)
    dims = _base_dims(base_config) if base_config is not None else None
    out: dict[str, MoESpec] = {}
    notes: dict[str, str] = {}
    for prefix, keys in blocks.items():
        names = ("gate_proj", "up_proj", "down_proj")
        experts: set[int] = set()
        h: int | None = None
        i: int | None = None
        fused: dict[str, dict[str, tuple[int, ...]]] = {}
        for k in keys:
            info = classify_key(k)
            if info.kind == "moe_3d":
                fused.setdefault(info.module, {})[info.which] = shapes[k]
            if info.kind != "moe_2d" or info.which != "A":
                continue
            experts.add(int(info.expert or 0))
            b = shapes.get(k.replace("lora_A", "lora_B"))
            if b is None or len(b) != 2 or len(shapes[k]) != 2:
                continue
            if info.proj in ("gate_proj", "w1", "up_proj", "w3"):
                h, i = shapes[k][1], b[0]
            elif info.proj in ("down_proj", "w2"):
                i, h = shapes[k][1], b[0]
            if info.proj in ("w1", "w2", "w3"):
                names = ("w1", "w3", "w2")
        if experts and max(experts) >= MAX_EXPERTS:
            raise ExpertLayoutError(f"MoE block {prefix!r} names expert {max(experts)}; at most {MAX_EXPERTS} experts "
                                    f"are supported. The adapter is corrupt or not an MoE LoRA.", key=prefix)
        pairs = [(ab["A"][1], ab["B"][0]) for ab in fused.values()
                 if set(ab) == {"A", "B"} and len(ab["A"]) == 2 and len(ab["B"]) == 2]
        e = num_experts
        if dims is not None:
            e, h, i = dims
            notes[prefix] = "from --base-config"
        else:
            inferred: list[str] = []
            if fused and e is None:
                rows = {ab["A"][0] for ab in fused.values() if "A" in ab and len(ab["A"]) == 2}
                r = config.rank_for(prefix) if config is not None else None
                if r and len(rows) == 1 and next(iter(rows)) % r == 0:
                    e = next(iter(rows)) // r
                    inferred.append(f"E={e} (rows {next(iter(rows))} / r {r})")
            if e is None and experts:
                e = max(experts) + 1
                inferred.append(f"E={e} (highest expert index + 1)")
            if (h is None or i is None) and pairs:
                solutions = {(hh, ii) for hh, ii, _ in _solve_3d(pairs, _orientation_hint(config))}
                if len(solutions) == 1:
                    (h, i), = solutions
                    inferred.append(f"H={h}, I={i} (from the fused shapes)")
                elif solutions:
                    raise ExpertLayoutError(
                        f"MoE block {prefix!r} holds fused 3D tensors whose shapes {pairs} read as several models "
                        f"(H, I in {sorted(solutions)}); pass the base model's config (--base-config), or set "
                        f"\"moe_3d_orientation\" in the adapter config.", key=prefix)
            if e is None or h is None or i is None:
                missing = ", ".join(n for n, v in (("E", e), ("H", h), ("I", i)) if v is None)
                raise ExpertLayoutError(
                    f"MoE block {prefix!r}: the adapter does not settle {missing} (fused 3D tensors"
                    f"{'' if config is not None else ' and no adapter config'}). Pass the base model's config.json, "
                    f"its folder or hf:org/model (--base-config).", key=prefix)
            notes[prefix] = "inferred: " + "; ".join(inferred) if inferred else "from the 2D keys"
        assert e is not None and h is not None and i is not None
        out[prefix] = MoESpec(prefix, e, h, i, gate=names[0], up=names[1], down=names[2])
    return out, notes


def moe_specs(shapes: Mapping[str, tuple[int, ...]], *, base_config: Mapping[str, Any] | None = None,
              num_experts: int | None = None, config: AdapterConfig | None = None) -> dict[str, MoESpec]:
    """Return a [`MoESpec`] per experts block of the adapter (see [`infer_moe_specs`]).

    Raises:
        [`ExpertLayoutError`]: a block's sizes cannot be settled without the base config.
    """
    return infer_moe_specs(shapes, base_config=base_config, num_experts=num_experts, config=config)[0]


@dataclass
class LoadedAdapter:
    """An adapter read into memory: dense modules ``{module: (A, B)}`` (unscaled) and normalized MoE blocks."""

    config: AdapterConfig
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]]
    moe: dict[str, ExpertsLoRA]
    specs: dict[str, MoESpec]


def load_adapter_files(resolved: ResolvedAdapter, *, base_config: Mapping[str, Any] | None = None,
                       num_experts: int | None = None, scaled: bool = True, name: str = "adapter") -> LoadedAdapter:
    """Read an adapter: dense pairs as stored, MoE blocks normalized (scaling folded if ``scaled``)."""
    config = load_config(resolved, name=name)
    if resolved.is_pickle:
        raise AdapterFormatError("Offline tools read .safetensors adapters only; convert the pickle file first.")
    reader = SafetensorsReader(resolved.weights_path)
    shapes = reader.header.shapes
    specs = moe_specs(shapes, base_config=base_config, num_experts=num_experts, config=config)
    groups = group_moe_keys(shapes)
    dense_keys: list[str] = []
    for k in shapes:
        kind = classify_key(k).kind
        if kind == "dense":
            dense_keys.append(k)
        elif kind == "other":
            raise AdapterFormatError(f"Adapter {name!r}: key {k!r} is not a LoRA weight.", adapter=name, key=k)
    tensors = reader.read_many(dense_keys)
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for k in dense_keys:
        info = classify_key(k)
        if info.which == "A":
            dense[info.module] = (tensors[k], tensors[k.replace("lora_A", "lora_B").replace("lora_embedding_A",
                                                                                          "lora_embedding_B")])
    moe = {p: read_experts(plan_experts(g, specs[p], config=config, adapter=name), reader.read, config=config,
                           read_many=reader.read_many, scaled=scaled) for p, g in groups.items()}
    return LoadedAdapter(config, dense, moe, specs)


# ------------------------------------------------------------------------------------------------ writing


def _write(out_dir: str | os.PathLike[str], tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any],
           extra: Mapping[str, str] | None = None) -> Path:
    def write(tmp: Path) -> None:
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
        (tmp / "adapter_config.json").write_text(json.dumps(dict(config), indent=2))
        for name, text in (extra or {}).items():
            (tmp / name).write_text(text)

    return write_atomically(Path(out_dir), write)


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


def convert_adapter(resolved: ResolvedAdapter, out_dir: str | os.PathLike[str], *, to: Literal["2d", "3d"],
                    base_config: Mapping[str, Any] | None = None, num_experts: int | None = None) -> Path:
    """Rewrite an adapter's MoE blocks as 2D per-expert keys or PEFT 3D fused keys (dense modules unchanged).

    The delta is preserved exactly. When every MoE factor keeps its rank and the config has no
    rank/alpha patterns, tensors are written unscaled under the original config (so 3D -> 2D -> 3D
    gives back the same tensors). Otherwise (a 2D gate/up pair with different A becomes one fused
    factor of rank ``2r``; per-module patterns) the MoE scaling is folded into B and the MoE modules
    get ``rank_pattern``/``alpha_pattern`` entries giving them scaling 1.
    """
    src = load_adapter_files(resolved, base_config=base_config, num_experts=num_experts, scaled=False)
    rank_change = to == "3d" and any(int(ex.as_3d(hidden=src.specs[p].hidden)[0][0].shape[1]) != src.config.r
                                     for p, ex in src.moe.items())
    fold = bool(src.moe) and (src.config.has_patterns or rank_change)
    if fold:
        src = load_adapter_files(resolved, base_config=base_config, num_experts=num_experts, scaled=True)
    cfg = dict(src.config.raw)
    tensors: dict[str, torch.Tensor] = {}
    for module, (a, b) in src.dense.items():
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b
    rank_pattern = dict(cfg.get("rank_pattern") or {})
    alpha_pattern = dict(cfg.get("alpha_pattern") or {})
    unit = (lambda r: float(r) ** 0.5) if src.config.use_rslora else (lambda r: float(r))
    for prefix, ex in src.moe.items():
        spec = src.specs[prefix]
        written = _moe_tensors(prefix, ex, spec, to)
        tensors.update(written)
        if fold:
            for key, t in written.items():
                if key.endswith("lora_A.weight"):
                    module = key[len(PEFT_PREFIX):-len(".lora_A.weight")]
                    info = classify_key(key)
                    r = int(t.shape[0]) if info.kind == "moe_2d" else int(t.shape[0]) // spec.num_experts
                    if info.kind == "moe_2d":
                        pattern = f"{re.escape(prefix)}\\.\\d+\\.{info.proj}"
                    else:
                        pattern = re.escape(prefix) + ("\\.gate_up_proj" if info.nesting else "\\.down_proj")
                    del module
                    rank_pattern[pattern], alpha_pattern[pattern] = r, unit(r)
    if to == "3d" and src.moe:
        blocks = sorted({p.split(".layers.")[-1].split(".", 1)[-1] for p in src.moe})
        cfg["target_parameters"] = [f"{b}.{n}" for b in blocks for n in ("gate_up_proj", "down_proj")]
    elif to == "2d":
        cfg.pop("target_parameters", None)
        tm = set(cfg.get("target_modules") or []) if isinstance(cfg.get("target_modules"), list) else set()
        cfg["target_modules"] = sorted(tm | {s.gate for s in src.specs.values()} | {s.up for s in src.specs.values()}
                                       | {s.down for s in src.specs.values()})
    if rank_pattern:
        cfg["rank_pattern"], cfg["alpha_pattern"] = rank_pattern, alpha_pattern
    cfg["peft_version"] = "0.21.0"  # tensors are written in the standard (PEFT >= 0.19.1) orientation
    cfg.pop("moe_3d_orientation", None)
    return _write(out_dir, tensors, cfg)


def mix_adapter_files(adapters: Sequence[tuple[ResolvedAdapter, float]], out_dir: str | os.PathLike[str], *,
                      base_config: Mapping[str, Any] | None = None, num_experts: int | None = None) -> Path:
    """Write the exact rank-concatenated mix Σ wᵢ·sᵢ·BᵢAᵢ as a standard PEFT adapter (scaling 1 per module).

    Every module gets ``rank_pattern = alpha_pattern = its rank`` so PEFT (and vLLM with this plugin)
    apply scaling 1; MoE blocks are written as 2D per-expert keys.
    """
    loaded = [(load_adapter_files(r, base_config=base_config, num_experts=num_experts, name=f"adapter{i}"), w)
              for i, (r, w) in enumerate(adapters)]
    tensors: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    modules: dict[str, None] = {}
    for la, _ in loaded:
        modules.update(dict.fromkeys(la.dense))
    for m in modules:
        parts = [(la.dense[m][0], la.dense[m][1], w * la.config.scaling_for(m, int(la.dense[m][0].shape[0])))
                 for la, w in loaded if m in la.dense]
        a, b = concat_factors(parts)
        tensors[f"{PEFT_PREFIX}{m}.lora_A.weight"], tensors[f"{PEFT_PREFIX}{m}.lora_B.weight"] = a, b
        ranks[m] = int(a.shape[0])
    blocks: dict[str, None] = {}
    for la, _ in loaded:
        blocks.update(dict.fromkeys(la.moe))
    for prefix in blocks:
        present = [(la.moe[prefix], la.specs[prefix], w) for la, w in loaded if prefix in la.moe]
        spec = present[0][1]
        mixed = ExpertsLoRA(prefix, present[0][0].experts, spec.intermediate, interleaved=spec.interleaved)
        for role in ("gate", "up", "down"):
            parts = []
            for ex, _, w in present:
                g, u = ex._split_gate_up()
                f = {"gate": g, "up": u, "down": ex.down}[role]
                if f is not None:
                    parts.append((f.a, f.b, w))
            if parts:
                a, b = concat_factors(parts, rank_dim_a=1, rank_dim_b=2)
                setattr(mixed, role, ExpertFactors(a, b))
                proj = {"gate": spec.gate, "up": spec.up, "down": spec.down}[role]
                ranks[f"{re.escape(prefix)}\\.\\d+\\.{proj}"] = int(a.shape[1])  # a regex: every expert
        tensors.update(_moe_tensors(prefix, mixed, spec, "2d"))
    r = max(ranks.values())
    cfg = {"peft_type": "LORA", "r": r, "lora_alpha": float(r), "use_rslora": False, "bias": "none",
           "target_modules": sorted({m.rsplit(".", 1)[-1] for m in ranks}),  # informational
           "rank_pattern": {m: k for m, k in ranks.items()}, "alpha_pattern": {m: float(k) for m, k in ranks.items()},
           "peft_version": "0.21.0"}
    check_finite(tensors, adapter="mix")  # |w| <= 100 of finite factors can still overflow a 16-bit dtype
    provenance = json.dumps({"adapters": [[ra.source.canonical(), w] for ra, w in adapters]}, indent=2)
    return _write(out_dir, tensors, cfg, {"vllm_lora_ext_mix.json": provenance})


def ep_read_plan(shapes: Mapping[str, tuple[int, ...]], header_bytes: int, sizes: Mapping[str, int],
                 specs: Mapping[str, MoESpec], ep_size: int) -> list[dict[str, Any]]:
    """Per EP rank (contiguous placement): the experts it owns and the bytes it would read."""
    out = []
    dense = sum(sizes[k] for k in shapes if classify_key(k).kind == "dense")
    for rank in range(ep_size):
        total = header_bytes + dense
        owned: dict[str, str] = {}
        for prefix, spec in specs.items():
            if spec.num_experts % ep_size:
                raise ExpertLayoutError(f"{spec.num_experts} experts do not split over EP size {ep_size}.")
            local = spec.num_experts // ep_size
            lo, hi = rank * local, (rank + 1) * local
            owned[prefix] = f"{lo}-{hi - 1}"
            for k in shapes:
                info = classify_key(k)
                if info.experts_prefix != prefix:
                    continue
                if info.kind == "moe_2d":
                    total += sizes[k] if lo <= (info.expert or 0) < hi else 0
                elif info.kind == "moe_3d":
                    total += sizes[k] * local // spec.num_experts
        out.append({"rank": rank, "experts": owned, "bytes": total})
    return out
