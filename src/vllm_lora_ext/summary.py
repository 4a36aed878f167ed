"""AdapterSummary: what an adapter holds (modules, ranks, scaling, dtypes, bytes, layout), from headers only."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from vllm_lora_ext.config import AdapterConfig, infer_config, read_config
from vllm_lora_ext.errors import AdapterFormatError
from vllm_lora_ext.formats import classify_key, detect_layout, group_modules, layout_by_layer
from vllm_lora_ext.reader import FileHeader, read_header
from vllm_lora_ext.sources import ResolvedAdapter

__all__ = ["ModuleSummary", "AdapterSummary", "summarize_adapter", "load_config"]


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
    header = header or read_header(resolved.weights_path)
    return infer_config(header.shapes, header.metadata, name=name)


def summarize_adapter(resolved: ResolvedAdapter, *, name: str = "adapter") -> AdapterSummary:
    """Summarize an adapter from its config and safetensors header, reading no tensor data."""
    config = load_config(resolved, name=name)
    header = read_header(resolved.weights_path)
    problems: list[str] = []
    modules: list[ModuleSummary] = []
    for module, pair in group_modules(header.tensors).items():
        if "A" not in pair or "B" not in pair:
            problems.append(f"{module}: has lora_{'A' if 'A' in pair else 'B'} but no lora_{'B' if 'A' in pair else 'A'}")
            continue
        a, b = header.tensors[pair["A"]], header.tensors[pair["B"]]
        kind = classify_key(pair["A"]).kind
        # 3D fused tensors are (r·E, in) / (out, r·E): their rank is not readable without the model.
        rank = a.shape[0] if kind != "moe_3d" else config.rank_for(module)
        modules.append(ModuleSummary(
            module=module, kind=kind, rank=rank, alpha=config.alpha_for(module),
            scaling=config.scaling_for(module, rank), shape_a=a.shape, shape_b=b.shape,
            dtype=a.dtype if a.dtype == b.dtype else f"{a.dtype}/{b.dtype}", nbytes=a.nbytes + b.nbytes,
        ))
    others = [k for k in header.tensors if classify_key(k).kind == "other"]
    if others:
        problems.append(f"{len(others)} tensors are not LoRA weights (first: {others[0]!r})")
    return AdapterSummary(
        source=resolved.source.canonical(), weights_path=str(resolved.weights_path),
        config_path=str(resolved.config_path) if resolved.config_path else None, config_rule=resolved.config_rule,
        commit=resolved.commit, layout=detect_layout(header.tensors), layers=dict(layout_by_layer(header.tensors)),
        r=config.r, lora_alpha=config.lora_alpha, use_rslora=config.use_rslora, total_bytes=header.total_bytes,
        num_tensors=len(header.tensors), modules=modules, problems=problems,
    )
