"""AdapterSummary: what an adapter holds (modules, ranks, scaling, dtypes, bytes, layout), from headers only.

Also the header rules every offline tool applies (``inspect`` lists their failures as ``problem:`` lines,
``convert`` and ``mix`` refuse to write): the loader's own checks from ``validation.py`` (dtypes, factor
pairs, ranks, 2-D shapes) and [`check_declared_ranks`] (the config's rank against the tensors'). A new
rule is one more entry of [`adapter_rules`]; [`collect_problems`] turns rule results into lines.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_lora_ext._util import open_confined
from vllm_lora_ext.config import AdapterConfig, alpha_missing, config_from_dict, infer_config, read_config
from vllm_lora_ext.constants import VLLM_MAX_LORA_RANK_CHOICES
from vllm_lora_ext.errors import AdapterFormatError, VllmLoraExtError
from vllm_lora_ext.formats import classify_key, detect_layout, group_modules, layout_by_layer
from vllm_lora_ext.headers import FileHeader, read_header
from vllm_lora_ext.sources import ResolvedAdapter
from vllm_lora_ext.validation import (check_declared_ranks, check_dense_factors, check_factor_dtypes, check_has_factors,
                                      check_ranks, not_lora_reason)

__all__ = ["ModuleSummary", "AdapterSummary", "summarize_adapter", "load_config", "check_declared_ranks",
           "adapter_rules", "finite_rule", "run_rules", "collect_problems", "check_adapter_rules"]

Rule = Callable[[], object]


@dataclass(frozen=True)
class ModuleSummary:
    """One LoRA module: name, layout kind, rank, alpha, scaling, shapes, dtype, bytes."""

    module: str
    kind: str
    rank: int
    alpha: float
    scaling: float
    shape_a: tuple[int, ...]
    shape_b: tuple[int, ...]
    dtype: str
    nbytes: int


@dataclass(frozen=True)
class AdapterSummary:
    """An adapter's summary as shown by ``vllm-lora inspect``."""

    source: str
    weights_path: str
    config_path: str | None
    config_rule: str
    commit: str | None
    layout: str
    layers: dict[str, str]
    r: int
    lora_alpha: float
    use_rslora: bool
    total_bytes: int
    num_tensors: int
    modules: list[ModuleSummary] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    config_note: str | None = None  # a hub adapter's inferred config: what the Hub or the cache said of its files

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready dict."""
        return asdict(self)


def load_config(resolved: ResolvedAdapter, *, name: str = "adapter", header: FileHeader | None = None,
                roots: Sequence[str] | None = None) -> AdapterConfig:
    """Read the adapter's config file, or infer one from the weight file's header when there is none.

    ``header``: the weight file's header as the load reads it (the config is then inferred from the very file
    whose tensors are read). ``roots``: the config file must lie in one of them (`open_confined`).
    """
    if resolved.config_path is not None:
        return read_config(resolved.config_path, name=name, roots=roots)
    if resolved.is_pickle:
        raise AdapterFormatError(f"Adapter {name!r}: pickle weights need an adapter_config.json beside them.",
                                 adapter=name)
    if header is None:  # (with ``roots``: the weight file too must lie in one)
        fd = open_confined(resolved.weights_path, roots)
        try:
            header = read_header(resolved.weights_path, fd=fd)
        finally:
            os.close(fd)
    return infer_config(header.shapes, header.metadata, name=name)


def adapter_rules(header: FileHeader, config: AdapterConfig, *, name: str = "adapter") -> list[Rule]:
    """The header rules of the loader, as calls that raise (see the module docstring); no tensor data is read."""
    dense = [k for k in header.shapes if classify_key(k).kind == "dense"]
    return [lambda: check_has_factors(header.shapes, adapter=name),
            lambda: check_factor_dtypes(header.dtypes, adapter=name),
            lambda: check_dense_factors(header.shapes, dense, adapter=name),
            lambda: check_declared_ranks(header.shapes, config, adapter=name),
            # (the rank the server's --max-lora-rank must fit is checked at load; none fits past vLLM's largest)
            lambda: check_ranks(header.shapes, [config.r, *config.rank_pattern.values()],
                                VLLM_MAX_LORA_RANK_CHOICES[-1], adapter=name)]


def finite_rule(resolved: ResolvedAdapter, *, name: str = "adapter") -> Rule:
    """A rule that reads every LoRA factor (256 MiB at a time) and refuses NaN or infinity, as the loader
    does while it reads, and a dense B whose scaling takes it past its dtype's range (``lora_alpha: 1e300``), as
    the loader refuses it (there in the LoRA dtype; here in the factor's own)."""
    def rule() -> None:
        from vllm_lora_ext.reader import SafetensorsReader
        from vllm_lora_ext.validation import LORA_FACTOR_DTYPES, check_finite, check_fits_dtype, dense_multipliers

        config = load_config(resolved, name=name)
        reader = SafetensorsReader(resolved.weights_path)
        keys = [k for k in reader.header.shapes if classify_key(k).kind != "other"]
        batch: list[str] = []
        size = 0
        for key in [*keys, None]:
            if key is not None:
                batch.append(key)
                size += reader.header.nbytes[key]
            if batch and (key is None or size >= 256 << 20):
                tensors = reader.read_many(batch)
                check_finite(tensors, adapter=name)
                served = {k: t for k, t in tensors.items() if reader.header.dtypes[k] in LORA_FACTOR_DTYPES}
                check_fits_dtype(dense_multipliers(served, config), None, adapter=name)  # (others: the dtype rule)
                batch, size = [], 0

    return rule


def run_rules(rules: Iterable[Rule]) -> list[VllmLoraExtError | None]:
    """Run every rule; each result is the error it raised, or ``None`` where it passed."""
    results: list[VllmLoraExtError | None] = []
    for rule in rules:
        try:
            rule()
        except VllmLoraExtError as err:
            results.append(err)
        else:
            results.append(None)
    return results


def collect_problems(results: Iterable[BaseException | str | None]) -> list[str]:
    """Turn rule results (an error, a message, or ``None`` for a rule that passed) into ``inspect``'s problem lines."""
    return [" ".join(str(r).split()) for r in results if r is not None]


def check_adapter_rules(header: FileHeader, config: AdapterConfig, *, name: str = "adapter") -> None:
    """Raise the first failing rule of [`adapter_rules`] (what ``convert`` and ``mix`` refuse)."""
    for err in run_rules(adapter_rules(header, config, name=name)):
        if err is not None:
            raise err


# Config fields the loader refuses to serve (config._REJECT, init_lora_weights) and their neutral values.
_REFUSED_FIELDS = {"use_dora": False, "bias": "none", "lora_bias": False, "modules_to_save": None,
                   "fan_in_fan_out": False, "init_lora_weights": True, "peft_type": "LORA"}


def _config_without_refused_features(resolved: ResolvedAdapter, name: str) -> AdapterConfig | None:
    """The adapter's config with the features the loader refuses set to neutral values, or ``None`` if it still
    fails (so ``inspect`` lists the refusal as a problem and still shows the tensors)."""
    from vllm_lora_ext._util import read_json_capped
    from vllm_lora_ext.constants import MAX_CONFIG_BYTES

    if resolved.config_path is None:
        return None
    try:
        raw = read_json_capped(resolved.config_path, MAX_CONFIG_BYTES, f"Adapter {name!r}: config",
                               fix="Fix or replace it.")
        if alpha_missing(raw):  # no scaling to show
            return None
        return config_from_dict({**raw, **{k: v for k, v in _REFUSED_FIELDS.items() if k in raw}}, name=name)
    except (OSError, ValueError, RecursionError):
        return None


def _patterned_name(config: AdapterConfig, module: str,
                    fused: Mapping[str, tuple[tuple[int, ...], tuple[int, ...]]]) -> str:
    """The name whose rank and alpha the config gives fused 3D pair ``module``: the fused parameter's
    (``<experts>.gate_up_proj`` or ``.down_proj``, as PEFT's ``target_parameters`` patterns name it) where a
    pattern names it, else ``module``. Which parameter it is, the block's other fused pair tells: gate_up's B has
    2·I rows where down's A has I columns (`formats.moe_plan.declared_3d_ranks` takes either name)."""
    prefix = module.removesuffix(".base_layer")
    other = next((m for m in (prefix, f"{prefix}.base_layer") if m != module and m in fused), None)
    if other is None:
        return module
    (a, b), (other_a, other_b) = fused[module], fused[other]
    role = None
    if len(b) == 2 and len(other_a) == 2 and b[0] == 2 * other_a[1]:
        role = f"{prefix}.gate_up_proj"
    elif len(a) == 2 and len(other_b) == 2 and other_b[0] == 2 * a[1]:
        role = f"{prefix}.down_proj"
    if role is None or (config.rank_for(role), config.alpha_for(role)) == (config.r, config.lora_alpha):
        return module
    return role


def summarize_adapter(resolved: ResolvedAdapter, *, name: str = "adapter",
                      extra_rules: Iterable[Rule] = ()) -> AdapterSummary:
    """Summarize an adapter from its config and safetensors header, reading no tensor data.

    ``problems`` holds every failure of [`adapter_rules`] and ``extra_rules`` (what the loader would refuse).
    """
    try:
        config, refused = load_config(resolved, name=name), None
    except AdapterFormatError as err:  # a config the loader refuses (DoRA, bias, ...): still show the tensors
        config, refused = _config_without_refused_features(resolved, name), err
        if config is None:
            raise
    header = read_header(resolved.weights_path)
    problems = collect_problems([refused, *run_rules([*adapter_rules(header, config, name=name), *extra_rules])])
    modules: list[ModuleSummary] = []
    grouped = group_modules(header.tensors)
    fused = {m: (header.tensors[p["A"]].shape, header.tensors[p["B"]].shape) for m, p in grouped.items()
             if "A" in p and "B" in p and classify_key(p["A"]).kind == "moe_3d"}
    for module, pair in grouped.items():
        if "A" not in pair or "B" not in pair:
            if classify_key(pair.get("A") or pair["B"]).kind != "dense":  # dense pairs: a rule says so
                problems.append(f"{module}: has lora_{'A' if 'A' in pair else 'B'} but no "
                                f"lora_{'B' if 'A' in pair else 'A'}")
            continue
        a, b = header.tensors[pair["A"]], header.tensors[pair["B"]]
        kind = classify_key(pair["A"]).kind
        # 3D fused tensors are (r·E, in) / (out, r·E): their rank is not readable without the model, but the
        # config's, which PEFT's patterns may give by the fused parameter's name
        named = _patterned_name(config, module, fused) if kind == "moe_3d" else module
        rank = (a.shape[0] if a.shape else 0) if kind != "moe_3d" else config.rank_for(named)
        if not rank:  # validation's problems name it (a LoRA with no rank, a 0-d factor); no scaling to show
            continue
        modules.append(ModuleSummary(
            module=module, kind=kind, rank=rank, alpha=config.alpha_for(named),
            scaling=config.scaling_for(named), shape_a=a.shape, shape_b=b.shape,
            dtype=a.dtype if a.dtype == b.dtype else f"{a.dtype}/{b.dtype}", nbytes=a.nbytes + b.nbytes,
        ))
    others = [k for k in header.tensors if classify_key(k).kind == "other"]
    if others:
        what = "1 tensor is not a LoRA weight" if len(others) == 1 else f"{len(others)} tensors are not LoRA weights"
        problems.append(f"{what} (first: {others[0]!r}): {not_lora_reason(others[0])}")
    return AdapterSummary(
        source=resolved.source.canonical(), weights_path=str(resolved.weights_path),
        config_path=str(resolved.config_path) if resolved.config_path else None, config_rule=resolved.config_rule,
        commit=resolved.commit, layout=detect_layout(header.tensors), layers=dict(layout_by_layer(header.tensors)),
        r=config.r, lora_alpha=config.lora_alpha, use_rslora=config.use_rslora, total_bytes=header.total_bytes,
        num_tensors=len(header.tensors), modules=modules, problems=problems, config_note=resolved.config_note,
    )
