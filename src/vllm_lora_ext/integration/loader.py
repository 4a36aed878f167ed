"""The worker-side loader: one LoRA request -> a vLLM ``LoRAModel``, through the plugin's core.

This replaces ``WorkerLoRAManager._load_adapter`` (the single place where vLLM 0.20–0.33 turns a
path into tensors). Every adapter source goes through here: the source is resolved by
`vllm_lora_ext.sources`, the config is validated by `vllm_lora_ext.config`, tensors are read by
`vllm_lora_ext.reader`, and every key must map to a LoRA module of the running model before
anything reaches vLLM (vLLM itself silently skips modules it does not find).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from vllm_lora_ext.constants import MIX_PREFIX, allow_unmatched_keys
from vllm_lora_ext import metrics
from vllm_lora_ext._util import gc_paused
from vllm_lora_ext.errors import AdapterNotFoundError, VllmLoraExtError
from vllm_lora_ext.formats import classify_key
from vllm_lora_ext.formats.moe import read_blocks
from vllm_lora_ext.integration._compat import is_first_model_rank, unstacked_mapper, validate_loaded
from vllm_lora_ext.integration.patching import IDENTITY_ATTR
from vllm_lora_ext.integration.moe import moe_targets, packed_weights
from vllm_lora_ext.planning import ModelSpec, plan_adapter
from vllm_lora_ext.reader import ReadStats, SafetensorsReader, load_pickle_tensors
from vllm_lora_ext.sources import resolve_source
from vllm_lora_ext.summary import load_config
from vllm_lora_ext.validation import ModuleDims, check_finite


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


class VllmKeyRouter:
    """vLLM's own key parsing (``parse_fine_tuned_lora_name`` with the model's mapper), as a core `KeyRouter`."""

    def __init__(self, mapper: Any, skip_prefixes: list[str] | None) -> None:
        self.mapper = mapper
        self.skip_prefixes = skip_prefixes

    def skip(self, key: str) -> bool:
        from vllm.lora.utils import is_base_embedding_weights

        if is_base_embedding_weights(key) or key.endswith(_BASE_EMBEDDING_SUFFIXES):
            return True
        return bool(self.skip_prefixes) and _skipped(key, self.skip_prefixes or [])

    def module(self, key: str) -> str | None:
        from vllm.lora.utils import parse_fine_tuned_lora_name

        try:
            return str(parse_fine_tuned_lora_name(key, self.mapper)[0])
        except ValueError:
            return None


def model_spec(manager: Any, targets: Mapping[str, Any]) -> ModelSpec:
    """Describe the worker's model as plain data for `plan_adapter` (module names, dims, MoE blocks, limits)."""
    return ModelSpec(
        accepted=frozenset(expected_module_names(manager)), dims=module_dims(manager),
        moe={p: t.spec for p, t in targets.items()}, local_experts={p: t.local_experts for p, t in targets.items()},
        max_rank=int(manager.lora_config.max_lora_rank),
        pooling=bool(getattr(manager._adapter_manager, "is_pooling_model", False)))


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


def module_dims(manager: Any) -> dict[str, ModuleDims]:
    """Return the full (unsharded) input/output sizes of every dense LoRA target the model has, by module name.

    A packed module (``qkv_proj``, ``gate_up_proj``) gives each constituent its own output size. Modules
    whose sizes vLLM does not expose (embeddings, the logits processor, MoE) are left out.
    """
    adapter_manager = manager._adapter_manager
    out: dict[str, ModuleDims] = {}
    for name, module in adapter_manager.modules.items():
        base: Any = getattr(module, "base_layer", None)
        d_in = getattr(base, "input_size", None)
        if type(d_in) is not int:
            continue
        sizes = getattr(base, "output_sizes", None)
        if hasattr(base, "total_num_kv_heads") and hasattr(base, "head_size"):  # QKV: true sizes, not TP replicas
            sizes = [base.total_num_heads * base.head_size, base.total_num_kv_heads * base.head_size,
                     base.total_num_kv_heads * getattr(base, "v_head_size", base.head_size)]
        parts = adapter_manager.packed_modules.get(name)
        if parts and isinstance(sizes, (list, tuple)) and len(sizes) == len(parts):
            for part, size in zip(parts, sizes):
                out[part] = ModuleDims(d_in, int(size))
        elif not parts and type(getattr(base, "output_size", None)) is int:
            out[name] = ModuleDims(d_in, base.output_size)
    return out


def load_lora_model(manager: Any, lora_request: Any) -> Any:
    """Build the ``LoRAModel`` for ``lora_request`` on the worker that owns ``manager``.

    Raises:
        vLLM's ``LoRAAdapterNotFoundError``: the source does not exist (the server answers 404).
        [`AdapterSourceError`], [`AdapterFormatError`], [`UnmatchedKeysError`], [`AdapterCompatibilityError`]:
            the adapter cannot be served on this model, with the reason and the fix.
    """
    kind = "mix" if lora_request.lora_path.startswith(MIX_PREFIX) else "adapter"
    t0 = time.perf_counter()
    try:
        with gc_paused():  # an MoE adapter makes ~10^5 small objects: no full-heap collections meanwhile
            if kind == "mix":
                from vllm_lora_ext.integration.composite import build_composite

                lora = build_composite(manager, lora_request)
                setattr(lora, IDENTITY_ATTR, lora_request.lora_path)
            else:
                lora = _load_adapter_model(manager, lora_request)
    except Exception as err:
        _record_load(kind, _outcome(err), t0, err)
        raise
    _record_load(kind, "ok", t0)
    return lora


def _outcome(err: BaseException) -> str:
    from vllm.exceptions import LoRAAdapterNotFoundError

    if isinstance(err, (AdapterNotFoundError, LoRAAdapterNotFoundError)):
        return "not_found"
    return "rejected" if isinstance(err, VllmLoraExtError) else "error"


# What this process's loads read (adapters built, bytes of weights read): worker_state reports it per worker,
# so an expert-parallel run shows that each rank read only its own experts' bytes.
LOCAL_READS: dict[str, int] = {"adapters": 0, "bytes": 0}


def _record_load(kind: str, outcome: str, t0: float, err: BaseException | None = None) -> None:
    if not is_first_model_rank():
        return
    metrics.ADAPTER_LOADS.inc(kind=kind, outcome=outcome)
    if outcome == "ok":
        metrics.ADAPTER_LOAD_SECONDS.observe(time.perf_counter() - t0, kind=kind)
    if err is not None:
        metrics.record_error(err, where="worker")


def _load_adapter_model(manager: Any, lora_request: Any) -> Any:
    from vllm.exceptions import LoRAAdapterNotFoundError
    from vllm.lora.peft_helper import PEFTHelper

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
        dtypes = None
    else:
        source = SafetensorsReader(resolved.weights_path, stats=stats)
        shapes, dtypes = source.header.shapes, source.header.dtypes

    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = unstacked_mapper(mapper)
    skip_prefixes = getattr(model, "lora_skip_prefixes", None)
    has_moe = any(classify_key(k).kind in ("moe_2d", "moe_3d") for k in shapes)
    targets = moe_targets(manager) if has_moe else {}
    plan = plan_adapter(shapes, config, model_spec(manager, targets), router=VllmKeyRouter(mapper, skip_prefixes),
                        dtypes=dtypes, name=name, identity=resolved.identity, allow_unmatched=allow_unmatched_keys())
    dense_keys, plans = plan.dense_keys, plan.moe
    peft_helper.validate_legal(manager.lora_config)  # after our checks, whose messages name the fix

    kept = source.read_many(dense_keys, copy=True)
    check_finite(kept, adapter=name)
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
                         read_many=lambda keys: source.read_many(keys, copy=False), check_finite_as=name)
    for prefix, experts in blocks.items():
        lora.loras[prefix] = packed_weights(experts, targets[prefix], max_rank=manager.lora_config.max_lora_rank,
                                            adapter=name)
    del blocks
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    validate_loaded(manager._adapter_manager, lora)
    setattr(lora, IDENTITY_ATTR, lora_request.lora_path)
    metrics.ADAPTER_BYTES_READ.inc(stats.bytes_read)
    LOCAL_READS["adapters"] += 1
    LOCAL_READS["bytes"] += stats.bytes_read
    logger.info("loaded adapter %r from %s: rank %d, %d modules (%d MoE blocks: %s), %.1f MiB read, %.2f s", name,
                resolved.identity, config.r, len(lora.loras), len(plans),
                ",".join(sorted({p.layout for p in plans.values()})) or "-", stats.bytes_read / 2**20,
                time.perf_counter() - t0)
    return lora


def _skipped(key: str, prefixes: list[str]) -> bool:
    bare = key.removeprefix("base_model.model.")
    return any(f".{p}" in bare or bare.startswith(p) for p in prefixes)


def _not_found(exc_type: type[Exception], lora_request: Any, err: Exception) -> Exception:
    # vLLM's server maps an error whose text contains its own not-found message to HTTP 404;
    # keep that text and add ours, which names the fix.
    base = exc_type(lora_request.lora_name, lora_request.lora_path)
    base.message = f"{base}. {err.client_message() if hasattr(err, 'client_message') else err}"  # type: ignore[attr-defined]
    return base
