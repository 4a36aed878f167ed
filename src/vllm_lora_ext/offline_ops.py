"""Model-free operations on adapter files: MoE specs without a model, layout conversion, mixes, EP read plans.

Without a running model the MoE sizes come from the adapter itself (2D keys carry E, H and I) or
from the base model's ``config.json`` (``num_experts``/``num_local_experts``, ``hidden_size``,
``moe_intermediate_size`` or ``intermediate_size``), which fused 3D adapters need.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext._util import read_json_capped, short_repr
from vllm_lora_ext.constants import MAX_CONFIG_BYTES, MAX_EXPERTS
from vllm_lora_ext.errors import (AdapterFormatError, AdapterNotFoundError, ExpertCountError, ExpertLayoutError,
                                  offline_pickle_error)
from vllm_lora_ext.formats import classify_key, group_modules, group_moe_keys
from vllm_lora_ext.formats.moe import ExpertsLoRA, MoESpec
from vllm_lora_ext.formats.moe_plan import declared_3d_ranks, plan_experts
from vllm_lora_ext.sources import ResolvedAdapter
from vllm_lora_ext.summary import check_adapter_rules, load_config
from vllm_lora_ext.validation import check_finite, not_lora_reason

if TYPE_CHECKING:
    import torch

__all__ = ["LoadedAdapter", "load_adapter_files", "load_base_config", "moe_specs", "infer_moe_specs", "ep_read_plan",
           "MOE_SIZES_KEY", "recorded_moe_sizes", "require_safetensors", "is_moe_config"]

# The safetensors ``__metadata__`` key under which ``vllm-lora convert`` records each MoE block's sizes and 2D
# projection names, so that its own output reads back without ``--base-config`` and keeps ``w1/w2/w3`` names. It is
# in the weight file's metadata, not in adapter_config.json: PEFT warns about unknown config keys as if its own
# version were too old, while neither PEFT nor vLLM reads a safetensors file's metadata.
MOE_SIZES_KEY = "vllm_lora_ext.moe_sizes"
_PROJ_NAMES = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}


_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")  # a config's expert count, by model family


def _text_config(base_config: Mapping[str, Any]) -> dict[str, Any]:
    text = base_config.get("text_config")
    return dict(text if isinstance(text, Mapping) else base_config)


def is_moe_config(base_config: Mapping[str, Any]) -> bool:
    """Whether a base model's config names an expert count (an MoE model's does; ERNIE-4.5's ``moe_num_experts``
    and DBRX's ``ffn_config`` count too, though only ``_EXPERT_KEYS`` give sizes here)."""
    cfg = _text_config(base_config)
    ffn = cfg.get("ffn_config")
    return any(cfg.get(k) for k in (*_EXPERT_KEYS, "moe_num_experts")) or (
        isinstance(ffn, Mapping) and bool(ffn.get("moe_num_experts")))


def _base_dims(base_config: Mapping[str, Any]) -> tuple[int, int, int]:
    cfg = _text_config(base_config)
    e = next((cfg[k] for k in _EXPERT_KEYS if cfg.get(k)), None)
    h = cfg.get("hidden_size")
    i = cfg.get("moe_intermediate_size") or cfg.get("intermediate_size")
    if not (e and h and i):
        missing = [what for what, v in (("/".join(_EXPERT_KEYS), e), ("hidden_size", h),
                                        ("moe_intermediate_size/intermediate_size", i)) if not v]
        kind = " (not an MoE model's config)" if not e else ""
        raise ExpertLayoutError(f"The base config has no {' or '.join(missing)}{kind}; pass the MoE model's "
                                f"config.json.")
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
        from vllm_lora_ext.sources import AdapterSource
        from vllm_lora_ext.hub_client import HubClient
        from vllm_lora_ext.constants import hf_offline

        client = HubClient(AdapterSource(value, "hf", repo_id=repo_id, revision=revision or None), cache_dir=None,
                            token=None, local_files_only=hf_offline(), label="base model")
        # (required: a config.json recorded missing is asked for again, as the command cannot go on without it)
        found = (client.first_found(["config.json"], revision or None, required=True) or (None, ""))[0]
        if found is None:
            raise AdapterNotFoundError(f"Base model {value!r} has no config.json. Name the base model's repo.",
                                       source=value)
        path = found
    else:
        path = Path(os.path.expanduser(value))
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "does not exist"
            raise AdapterNotFoundError(f"Base config {str(path)!r} {what}. Pass the base model's config.json, "
                                       f"its folder, or hf:org/model.", source=value)
    return read_json_capped(path, MAX_CONFIG_BYTES, "Base config", fix="pass the model's config.json.")


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
                    num_experts: int | None = None, config: AdapterConfig | None = None,
                    recorded: Mapping[str, tuple[int, int, int, tuple[str, str, str]]] | None = None,
                    base_from: str = "the base config") -> tuple[dict[str, MoESpec], dict[str, str]]:
    """Return a [`MoESpec`] per experts block, and per block a note on what was inferred or is ambiguous.

    Sizes come from the base config when given; else from what ``vllm-lora convert`` recorded in the weight
    file's metadata (``recorded``, see [`recorded_moe_sizes`]); otherwise from the adapter itself: 2D keys
    carry H and I and the highest expert index; fused 3D tensors give ``E = rows / r`` (``r`` from the
    adapter config) and H and I wherever their shapes allow only one reading (both tensors present, or an
    orientation known from ``moe_3d_orientation``/``peft_version``). Recorded 2D projection names
    (``w1/w3/w2``) are kept.

    Whatever settles E, the adapter's own shapes must agree with it: no expert index at or past E, and fused
    tensors of ``r·E`` rows for the config's ``r`` (``base_from`` names where a base config came from).

    Raises:
        [`ExpertLayoutError`]: a block's sizes cannot be settled from the adapter (the message says what is
            ambiguous and that ``--base-config`` settles it), or they contradict its shapes.
    """
    blocks = group_moe_keys(shapes)
    dims = _base_dims(base_config) if base_config is not None and blocks else None  # (a dense base: no MoE block)
    out: dict[str, MoESpec] = {}
    notes: dict[str, str] = {}
    for prefix, keys in blocks.items():
        names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
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
            raise ExpertCountError(f"MoE block {prefix!r} names expert {max(experts)}; at most {MAX_EXPERTS} experts "
                                   f"are supported. The adapter is corrupt or not an MoE LoRA.", key=prefix)
        mark = (recorded or {}).get(prefix)
        if mark is not None and not experts:
            names = mark[3]
        if dims is not None:
            (e, h, i), notes[prefix] = dims, f"from {base_from}"
        elif mark is not None:
            (e, h, i), notes[prefix] = mark[:3], "recorded in the weight file's metadata by vllm-lora convert"
        else:
            e, h, i, notes[prefix] = _infer_sizes(prefix, fused, experts, h, i, num_experts, config)
        how = f"--num-experts {num_experts}" if num_experts is not None and dims is None and mark is None else notes[prefix]
        if dims is None and num_experts is None and experts and len(experts) < e:  # E from key names or metadata
            raise ExpertLayoutError(  # would size every expert's output: expert 65535 named in a 13 KB file
                f"MoE block {prefix!r} holds 2D keys for {len(experts)} of its experts, yet E = {e} "
                f"({notes[prefix]}): the adapter does not settle E. Pass the base model's config (--base-config) "
                f"or --num-experts.", key=prefix)
        _check_experts_fit(prefix, e, experts, fused, config, how)
        out[prefix] = MoESpec(prefix, e, h, i, gate=names[0], up=names[1], down=names[2])
    return out, notes


def _check_experts_fit(prefix: str, e: int, experts: set[int], fused: Mapping[str, Mapping[str, tuple[int, ...]]],
                       config: AdapterConfig | None, how: str) -> None:
    """Refuse an E (from a base config, ``--num-experts`` or metadata) that the block's own shapes contradict:
    read by it, a converted or inspected adapter would be another adapter, with no error."""
    fix = ("Give the base model the adapter was trained for (--base-config; 'vllm-lora convert' also takes the right "
           "--num-experts).")
    if experts and max(experts) >= e:
        raise ExpertCountError(f"MoE block {prefix!r} names expert {max(experts)}, but E = {e} ({how}). {fix}",
                               key=prefix)
    for module, ab in fused.items():
        rows = ab["A"][0] if "A" in ab and len(ab["A"]) == 2 else None
        # the config may name the fused tensor by its module or its parameter (gate_up_proj, down_proj)
        ranks = declared_3d_ranks(config, module, prefix) if config is not None else set()
        if rows is None or (rows % e == 0 and (not ranks or rows // e in ranks)):
            continue
        per = f"{rows / e:g}" if rows % e else str(rows // e)
        r = min(ranks) if ranks else None
        told = f"; its config's r {r} makes E = {rows / r:g}" if r else ""
        raise ExpertCountError(
            f"MoE block {prefix!r}: fused {module!r} has lora_A of {rows} rows (r × E), which is "
            f"{per} per expert with E = {e} ({how}){told}. {fix}", key=prefix)


def _infer_sizes(prefix: str, fused: Mapping[str, Mapping[str, tuple[int, ...]]], experts: set[int], h: int | None,
                 i: int | None, e: int | None, config: AdapterConfig | None) -> tuple[int, int, int, str]:
    """E, H and I of one block from its own shapes (see [`infer_moe_specs`]), and a note saying how."""
    from vllm_lora_ext.formats.moe_plan import _orientation_hint

    pairs = [(ab["A"][1], ab["B"][0]) for ab in fused.values()
             if set(ab) == {"A", "B"} and len(ab["A"]) == 2 and len(ab["B"]) == 2]
    inferred: list[str] = []
    if fused and e is None and config is not None:
        rows = {ab["A"][0] for ab in fused.values() if "A" in ab and len(ab["A"]) == 2}
        if rows and 0 not in rows:  # 0 rows settle no E; nor do ranks that several E fit (then: --base-config)
            e = _one_expert_count(prefix, fused, config)
            if e is not None:
                inferred.append(f"E={e} (rows {'/'.join(map(str, sorted(rows)))} / the config's rank)")
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
    return e, h, i, ("inferred: " + "; ".join(inferred) if inferred else "from the 2D keys")


def _one_expert_count(prefix: str, fused: Mapping[str, Mapping[str, tuple[int, ...]]],
                      config: AdapterConfig) -> int | None:
    """The one E that every fused factor's rows give with one of the ranks the config may give it (by its module
    or its parameter's name: `formats.moe_plan.declared_3d_ranks`), e.g. gate_up at rank 2r and down at r over
    the same E; ``None`` where none fits, or several (r 4 with both parameters at 8 by a pattern, 32 rows each:
    E 8 or 4), which only the base model's config settles."""
    options: set[int] | None = None
    for module, ab in fused.items():
        if "A" not in ab or len(ab["A"]) != 2:
            continue
        rows = ab["A"][0]
        ranks = declared_3d_ranks(config, module, prefix) | {config.rank_for(prefix)}
        fits = {rows // r for r in ranks if r > 0 and rows % r == 0}
        options = fits if options is None else options & fits
    return next(iter(options)) if options is not None and len(options) == 1 else None


def recorded_moe_sizes(metadata: Mapping[str, str]) -> dict[str, tuple[int, int, int, tuple[str, str, str]]]:
    """Read the MoE sizes ``vllm-lora convert`` recorded under [`MOE_SIZES_KEY`]: ``{block: (E, H, I, names)}``.

    Raises:
        [`ExpertLayoutError`]: the entry is there but malformed (names the key and what is wrong).
    """
    text = metadata.get(MOE_SIZES_KEY)
    if text is None:
        return {}
    try:
        raw = json.loads(text) if len(text) <= MAX_CONFIG_BYTES else None
    except (ValueError, RecursionError):
        raw = None
    out: dict[str, tuple[int, int, int, tuple[str, str, str]]] = {}
    for prefix, entry in (raw.items() if isinstance(raw, dict) else [(None, None)]):
        sizes = [entry.get(k) for k in ("num_experts", "hidden_size", "intermediate_size")] if isinstance(
            entry, dict) else []
        names = entry.get("names") if isinstance(entry, dict) else None
        if (not isinstance(prefix, str) or len(sizes) != 3 or any(type(v) is not int or not 1 <= v <= MAX_EXPERTS
                                                                   << 4 for v in sizes)
                or not isinstance(names, list) or len(names) != 3 or not _PROJ_NAMES.issuperset(names)):
            raise ExpertLayoutError(f"The weight file's metadata entry {MOE_SIZES_KEY!r} is malformed "
                                    f"({short_repr(text)}); remove it, or pass --base-config.", key=MOE_SIZES_KEY)
        out[prefix] = (sizes[0], sizes[1], sizes[2], (names[0], names[1], names[2]))
    return out


def moe_specs(shapes: Mapping[str, tuple[int, ...]], *, base_config: Mapping[str, Any] | None = None,
              num_experts: int | None = None, config: AdapterConfig | None = None,
              recorded: Mapping[str, tuple[int, int, int, tuple[str, str, str]]] | None = None) -> dict[str, MoESpec]:
    """Return a [`MoESpec`] per experts block of the adapter (see [`infer_moe_specs`]).

    Raises:
        [`ExpertLayoutError`]: a block's sizes cannot be settled without the base config.
    """
    return infer_moe_specs(shapes, base_config=base_config, num_experts=num_experts, config=config,
                           recorded=recorded)[0]


@dataclass
class LoadedAdapter:
    """An adapter read into memory: dense modules ``{module: (A, B)}`` (unscaled) and normalized MoE blocks;
    ``embeddings`` names the dense modules stored as PEFT stores an embedding's factors (``lora_embedding_A``/``_B``,
    which PEFT reads for an embedding in place of ``lora_A.weight``/``lora_B.weight``)."""

    config: AdapterConfig
    dense: dict[str, tuple[torch.Tensor, torch.Tensor]]
    moe: dict[str, ExpertsLoRA]
    specs: dict[str, MoESpec]
    embeddings: frozenset[str] = frozenset()


def require_safetensors(resolved: ResolvedAdapter, *, name: str = "adapter") -> None:
    """Refuse a pickle weight file before anything reads it: offline tools read ``.safetensors`` only.

    Raises:
        [`AdapterFormatError`]: the weight file is ``.bin``/``.pt`` (even with ``VLLM_LORA_EXT_ALLOW_PICKLE=1``).
    """
    if resolved.is_pickle:
        raise offline_pickle_error(name, resolved.weights_path.name)


def load_adapter_files(resolved: ResolvedAdapter, *, base_config: Mapping[str, Any] | None = None,
                       num_experts: int | None = None, scaled: bool = True, name: str = "adapter") -> LoadedAdapter:
    """Read an adapter: dense pairs as stored, MoE blocks normalized (scaling folded if ``scaled``).

    Everything is checked with the loader's own rules before a tensor is used: factor dtypes, pairs, ranks
    and 2-D shapes, the config's ranks against the tensors', and NaN/infinity in every factor.

    Raises:
        [`AdapterFormatError`]: a pickle file, a key that is no LoRA weight, or factors the loader would refuse.
        [`ExpertLayoutError`]: an MoE block's sizes cannot be settled (pass ``base_config``).
    """
    from vllm_lora_ext.formats.moe_read import ReadOptions, read_experts  # they read tensors: torch, when used
    from vllm_lora_ext.reader import SafetensorsReader

    require_safetensors(resolved, name=name)
    config = load_config(resolved, name=name)
    reader = SafetensorsReader(resolved.weights_path)
    shapes = reader.header.shapes
    check_adapter_rules(reader.header, config, name=name)
    specs = moe_specs(shapes, base_config=base_config, num_experts=num_experts, config=config,
                      recorded=recorded_moe_sizes(reader.header.metadata))
    groups = group_moe_keys(shapes)
    dense_keys: list[str] = []
    for k in shapes:
        kind = classify_key(k).kind
        if kind == "dense":
            dense_keys.append(k)
        elif kind == "other":
            raise AdapterFormatError(f"Adapter {name!r}: key {k!r} is not a LoRA weight: {not_lora_reason(k)}.",
                                     adapter=name, key=k)
    tensors = reader.read_many(dense_keys)
    check_finite(tensors, adapter=name)
    # paired by module, not by spelling: PEFT's prefix may sit on one factor's key and not on the other's
    pairs = group_modules(dense_keys)
    dense = {m: (tensors[pair["A"]], tensors[pair["B"]]) for m, pair in pairs.items()}
    embeddings = frozenset(m for m, pair in pairs.items() if pair["A"].endswith(".lora_embedding_A"))
    options = ReadOptions(scaled=scaled, check_finite_as=name)
    moe = {p: read_experts(plan_experts(g, specs[p], config=config, adapter=name), reader, config=config,
                           options=options) for p, g in groups.items()}
    return LoadedAdapter(config, dense, moe, specs, embeddings)


def ep_read_plan(shapes: Mapping[str, tuple[int, ...]], header_bytes: int, sizes: Mapping[str, int],
                 specs: Mapping[str, MoESpec], ep_size: int) -> list[dict[str, Any]]:
    """Per EP rank (vLLM's linear placement): the experts it owns and the bytes it would read. Experts that do not
    divide evenly go one more to each of the first ranks, as vLLM's ``determine_expert_map`` places them."""
    out = []
    dense = sum(sizes[k] for k in shapes if classify_key(k).kind == "dense")
    for rank in range(ep_size):
        total = header_bytes + dense
        owned: dict[str, str] = {}
        for prefix, spec in specs.items():
            if ep_size > spec.num_experts:
                raise ExpertLayoutError(f"EP size {ep_size} is more than the {spec.num_experts} experts of "
                                        f"{prefix!r}: give an EP size of at most {spec.num_experts}.")
            base, extra = divmod(spec.num_experts, ep_size)
            local = base + (rank < extra)
            lo = rank * base + min(rank, extra)
            hi = lo + local
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
