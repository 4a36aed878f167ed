"""The worker-side loader: one LoRA request -> a vLLM ``LoRAModel``, through the plugin's core.

This replaces ``WorkerLoRAManager._load_adapter`` (the single place where vLLM 0.20–0.33 turns a
path into tensors). Every adapter source goes through here: the source is resolved by
`vllm_lora_ext.sources`, the config is validated by `vllm_lora_ext.config`, tensors are read by
`vllm_lora_ext.reader`, and every key must map to a LoRA module of the running model before
anything reaches vLLM (vLLM itself silently skips modules it does not find).
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from vllm_lora_ext.config import AdapterConfig
from vllm_lora_ext.constants import MIX_PREFIX, allow_unmatched_keys, max_lora_rank_for
from vllm_lora_ext.errors import (
    AdapterCompatibilityError,
    AdapterNotFoundError,
    UnmatchedKeysError,
)
from vllm_lora_ext.formats import classify_key
from vllm_lora_ext.integration.moe import moe_targets, packed_weights
from vllm_lora_ext.formats.moe import plan_experts, read_blocks
from vllm_lora_ext.reader import ReadStats, SafetensorsReader, load_pickle_tensors
from vllm_lora_ext.sources import resolve_source
from vllm_lora_ext.summary import load_config

logger = logging.getLogger(__name__)

# Tensors vLLM itself drops on purpose (the base embedding copies PEFT saves with trainable tokens).
_BASE_EMBEDDING_SUFFIXES = (".embed_tokens.base_layer.weight", ".lm_head.base_layer.weight")


def expected_module_names(manager: Any) -> set[str]:
    """Return every full module name the running model accepts LoRA weights for.

    That is each LoRA-wrapped module, each constituent of a packed module (``q_proj`` of
    ``qkv_proj``, ``experts.3.gate_proj`` of ``experts``), and the ``experts.base_layer`` name of a
    fused 3D MoE module.
    """
    adapter_manager = manager._adapter_manager
    names: set[str] = set(adapter_manager.modules)
    for parts in adapter_manager.packed_modules.values():
        names.update(parts)
    for name in list(adapter_manager.modules):
        if name.endswith(".experts"):
            names.add(name + ".base_layer")
    return names


def find_unmatched(module_names: Iterable[str], accepted: set[str], *, pooling: bool = False) -> list[str]:
    """Return the module names that match no accepted module, in order."""
    out = []
    for m in module_names:
        if m in accepted:
            continue
        if pooling and ("model." + m) in accepted:
            continue
        out.append(m)
    return out


class _DictSource:
    """A pickle adapter already in memory, read through the same interface as SafetensorsReader."""

    def __init__(self, tensors: Mapping[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def read(self, key: str, ranges: Sequence[tuple[int, int, int]] | None = None) -> torch.Tensor:
        t = self.tensors[key]
        if not ranges:
            return t
        return torch.cat([t.narrow(d, s, e - s) for d, s, e in ranges], dim=ranges[0][0]).contiguous()

    def read_many(self, keys: Sequence[str], *, copy: bool = True) -> dict[str, torch.Tensor]:
        return {k: self.tensors[k] for k in keys}


def _check_ranks(config: AdapterConfig, shapes: Mapping[str, tuple[int, ...]], max_rank: int, name: str) -> None:
    worst: tuple[int, str] | None = None
    for key, shape in shapes.items():
        info = classify_key(key)
        if info.which != "A" or info.kind == "moe_3d" or len(shape) != 2:
            continue
        r = int(shape[0])
        if r > max_rank and (worst is None or r > worst[0]):
            worst = (r, info.module)
    declared = max([config.r, *config.rank_pattern.values()])
    if worst is None and declared > max_rank:
        worst = (declared, "(config r / rank_pattern)")
    if worst is not None:
        fit = max_lora_rank_for(worst[0])
        fix = f"Start vLLM with --max-lora-rank {fit}" if fit else "Use an adapter of rank <= 512"
        raise AdapterCompatibilityError(
            f"Adapter {name!r} has rank {worst[0]} (module {worst[1]!r}) but max_lora_rank is {max_rank}. {fix}.",
            adapter=name)


def load_lora_model(manager: Any, lora_request: Any) -> Any:
    """Build the ``LoRAModel`` for ``lora_request`` on the worker that owns ``manager``.

    Raises:
        vLLM's ``LoRAAdapterNotFoundError``: the source does not exist (the server answers 404).
        [`AdapterSourceError`], [`AdapterFormatError`], [`UnmatchedKeysError`], [`AdapterCompatibilityError`]:
            the adapter cannot be served on this model, with the reason and the fix.
    """
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.peft_helper import PEFTHelper
    from vllm.lora.utils import is_base_embedding_weights, parse_fine_tuned_lora_name

    if lora_request.lora_path.startswith(MIX_PREFIX):
        from vllm_lora_ext.integration.composite import build_composite

        return build_composite(manager, lora_request)
    t0 = time.perf_counter()
    name = lora_request.lora_name
    try:
        resolved = resolve_source(lora_request.lora_path)
    except AdapterNotFoundError as err:
        raise _not_found(LoRAAdapterNotFoundError, lora_request, err) from err

    config = load_config(resolved, name=name)
    raw = dict(config.raw)
    raw["vllm_max_position_embeddings"] = manager.max_position_embeddings
    peft_helper = PEFTHelper.from_dict(raw)

    stats = ReadStats()
    source: Any
    if resolved.is_pickle:
        source = _DictSource(load_pickle_tensors(resolved.weights_path))
        shapes = {k: tuple(v.shape) for k, v in source.tensors.items()}
    else:
        source = SafetensorsReader(resolved.weights_path, stats=stats)
        shapes = source.header.shapes
    _check_ranks(config, shapes, manager.lora_config.max_lora_rank, name)
    peft_helper.validate_legal(manager.lora_config)

    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = mapper.get_unstacked_mapper()
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)

    # Map every key to the module vLLM will look it up under; MoE keys go to their experts block.
    accepted = expected_module_names(manager)
    has_moe = any(classify_key(k).kind in ("moe_2d", "moe_3d") for k in shapes)
    targets = moe_targets(manager) if has_moe else {}
    dense_keys: list[str] = []
    modules: dict[str, list[str]] = {}
    moe_groups: dict[str, dict[str, tuple[int, ...]]] = {}
    not_lora: list[str] = []
    moe_unmatched: list[str] = []
    for key in shapes:
        if is_base_embedding_weights(key) or key.endswith(_BASE_EMBEDDING_SUFFIXES):
            continue
        if skip_prefixes and _skipped(key, skip_prefixes):
            continue
        try:
            module, _ = parse_fine_tuned_lora_name(key, mapper)
        except ValueError:
            not_lora.append(key)
            continue
        info = classify_key(key)
        if info.kind in ("moe_2d", "moe_3d") and info.experts_prefix is not None:
            prefix, _ = parse_fine_tuned_lora_name(f"{info.experts_prefix}.lora_A.weight", mapper)
            prefix = same_layer_block(prefix, targets)
            if prefix in targets:
                moe_groups.setdefault(prefix, {})[key] = tuple(shapes[key])
            else:
                moe_unmatched.append(key)
            continue
        modules.setdefault(module, []).append(key)
        dense_keys.append(key)
    unmatched_modules = find_unmatched(modules, accepted, pooling=bool(getattr(manager._adapter_manager,
                                                                               "is_pooling_model", False)))
    unmatched = not_lora + moe_unmatched + [k for m in unmatched_modules for k in modules[m]]
    if unmatched:
        msg = (f"Adapter {name!r} ({resolved.identity}) has {len(unmatched)} keys that match no LoRA module of the "
               f"base model (first: {unmatched[:3]}). Check that the adapter was trained for this base model and that "
               f"vLLM wraps those modules (--lora-target-modules, --enable-lora for MoE); run 'vllm-lora inspect' on it.")
        if not allow_unmatched_keys():
            raise UnmatchedKeysError(msg, adapter=name, keys=unmatched)
        logger.warning("%s Dropping them because VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS is set.", msg)
        bad = set(unmatched)
        dense_keys = [k for k in dense_keys if k not in bad]

    # Plan every MoE block before reading anything big: shape errors surface first.
    plans = {prefix: plan_experts(group, targets[prefix].spec, config=config, adapter=name)
             for prefix, group in moe_groups.items()}

    kept = source.read_many(dense_keys, copy=True)
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors=kept,
        peft_helper=peft_helper,
        device="cpu",
        dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper,
        skip_prefixes=skip_prefixes,
    )
    if config.has_patterns:  # vLLM 0.26 gives every module the global r/alpha: apply PEFT's per-module rules
        for module_name, weights in lora.loras.items():
            rank = int(weights.lora_a.shape[0])
            weights.rank, weights.scaling = rank, config.scaling_for(module_name, rank)
    dtype = manager.lora_config.lora_dtype
    dtype = dtype if isinstance(dtype, torch.dtype) else None
    blocks = read_blocks(plans, source.read, config=config, dtype=dtype,
                         experts={p: targets[p].local_experts for p in plans},
                         read_many=lambda keys: source.read_many(keys, copy=False))
    for prefix, experts in blocks.items():
        lora.loras[prefix] = packed_weights(experts, targets[prefix], max_rank=manager.lora_config.max_lora_rank,
                                            adapter=name)
    del blocks
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    logger.info("loaded adapter %r from %s: rank %d, %d modules (%d MoE blocks: %s), %.1f MiB read, %.2f s", name,
                resolved.identity, config.r, len(lora.loras), len(plans),
                ",".join(sorted({p.layout for p in plans.values()})) or "-", stats.bytes_read / 2**20,
                time.perf_counter() - t0)
    return lora


_LAYER = re.compile(r"^(.*\.layers\.\d+)\.")


def same_layer_block(prefix: str, blocks: Iterable[str]) -> str:
    """Map an experts block the model does not have to the model's only MoE block in the same layer.

    transformers v5 renamed some MoE blocks (Mixtral ``block_sparse_moe`` -> ``mlp``), so PEFT adapters
    trained on v5 name ``model.layers.N.mlp.experts`` where vLLM has ``...block_sparse_moe.experts``.
    Shapes are still checked against that block, so a wrong match fails loudly.
    """
    blocks = list(blocks)
    if prefix in blocks:
        return prefix
    m = _LAYER.match(prefix)
    if not m:
        return prefix
    same = [b for b in blocks if b.startswith(m.group(1) + ".")]
    if len(same) == 1:
        logger.debug("experts block %r mapped to the model's %r", prefix, same[0])
        return same[0]
    return prefix


def _skipped(key: str, prefixes: list[str]) -> bool:
    bare = key.removeprefix("base_model.model.")
    return any(f".{p}" in bare or bare.startswith(p) for p in prefixes)


def _not_found(exc_type: type[Exception], lora_request: Any, err: Exception) -> Exception:
    # vLLM's server maps an error whose text contains its own not-found message to HTTP 404;
    # keep that text and add ours, which names the fix.
    base = exc_type(lora_request.lora_name, lora_request.lora_path)
    base.message = f"{base}. {err}"  # type: ignore[attr-defined]
    return base
