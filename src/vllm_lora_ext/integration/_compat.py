"""vLLM version gate and version differences: the module paths, classes and signatures that moved between releases.

[`check_vllm_version`] holds the supported range (0.26 to 0.33). The paths of the modules the plugin patches
(``*_MODULE``), and the lookups of names that moved or appeared between those releases, are here. This is not
the only module that imports vLLM: the other ``integration/`` modules import, inside their functions, the vLLM
names that are the same in every supported release (``LoRARequest``, ``LoRAAdapterNotFoundError``,
``PEFTHelper``, the LoRA layer and weight classes, the key parser, ``LLM`` in ``verify_run``).
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import importlib.util
import logging
import sys
from collections.abc import Mapping
from typing import Any

from packaging.version import InvalidVersion, Version

from vllm_lora_ext.constants import ENV_ALLOW_UNSUPPORTED_VLLM, SUPPORTED_VLLM_MAX_EXCLUSIVE, SUPPORTED_VLLM_MIN
from vllm_lora_ext.constants import allow_unsupported_vllm
from vllm_lora_ext.errors import UnsupportedVLLMError

logger = logging.getLogger(__name__)

# The loggers of vLLM's check of VLLM_* variables (validate_environ): envs (0.26-0.30), platforms (0.31-0.33).
ENV_CHECK_LOGGERS = ("vllm.envs", "vllm.platforms.interface")

# Modules the plugin patches once they are imported (imports stay lazy in every process).
WORKER_MANAGER_MODULE = "vllm.lora.worker_manager"
MODEL_MANAGER_MODULE = "vllm.lora.model_manager"  # LoRAModelManager._create_merged_loras_inplace (0.26-0.33)
LLM_ENGINE_MODULE = "vllm.v1.engine.llm_engine"
SERVING_MODELS_MODULE = "vllm.entrypoints.openai.models.serving"
BASE_SERVING_MODULE = "vllm.entrypoints.serve.engine.serving"
ASYNC_LLM_MODULE = "vllm.v1.engine.async_llm"
OUTPUT_PROCESSOR_MODULE = "vllm.v1.engine.output_processor"  # RequestOutputCollector (0.26-0.33)
# The bf16 multi-LoRA kernels' launchers; each imports utils.get_lora_op_configs into its own namespace.
LORA_SHRINK_OP_MODULE = "vllm.lora.ops.triton_ops.lora_shrink_op"
LORA_EXPAND_OP_MODULE = "vllm.lora.ops.triton_ops.lora_expand_op"
LORA_OP_UTILS_MODULE = "vllm.lora.ops.triton_ops.utils"  # get_lora_op_configs reads load_lora_op_config from here
FUSED_MOE_LORA_MODULE = "vllm.lora.layers.fused_moe"  # FusedMoEWithLoRA._build_lora_context (0.26-0.33)
BASE_LINEAR_LORA_MODULE = "vllm.lora.layers.base_linear"  # BaseLinearLayerWithLoRA._apply_async_impl (0.26-0.33)
GENERATE_SERVING_MODULE = "vllm.entrypoints.generate.base.serving"  # completions, chat and responses (0.26-0.33)
BEAM_SEARCH_MODULE = "vllm.entrypoints.generate.beam_search.online"
BATCH_CHAT_MODULE = "vllm.entrypoints.openai.chat_completion.batch_serving"  # /v1/chat/completions/batch (0.26-0.33)
POOLING_SERVING_MODULE = "vllm.entrypoints.pooling.base.serving"
ANTHROPIC_SERVING_MODULE = "vllm.entrypoints.anthropic.serving"  # AnthropicServingMessages (0.26-0.33)
TOKENS_SERVING_MODULE = "vllm.entrypoints.scale_out.token_in_token_out.serving"  # ServingTokens (0.26-0.33)
COHERE_SERVING_MODULE = "vllm.entrypoints.cohere.serving"  # CohereServingChatV2 (0.33; its cohere SDK and
# VLLM_ENABLE_COHERE_API=1 import it; absent in 0.26, so never patched there)
GPU_WORKER_MODULE = "vllm.v1.worker.gpu_worker"  # Worker.compile_or_warm_up_model (0.26-0.33)
INPUT_PROCESSOR_MODULE = "vllm.v1.engine.input_processor"  # InputProcessor.__init__ (0.26-0.33)
TRITON_MOE_MODULE = "vllm.model_executor.layers.fused_moe.experts.triton_moe"  # TritonExperts (0.26-0.33)
PUNICA_GPU_MODULE = "vllm.lora.punica_wrapper.punica_gpu"  # PunicaWrapperGPU.add_lora_fused_moe (0.26-0.33)
# Serving classes and request types that never generate (0.26-0.33): a mix named there is checked, never built.
_NON_GENERATING = (("vllm.entrypoints.serve.tokenize.serving", "ServingTokenization"),
                   ("vllm.entrypoints.scale_out.render.serving", "ServingRender"),
                   ("vllm.entrypoints.scale_out.derender.serving", "ServingDerender"),
                   ("vllm.entrypoints.serve.tokenize.protocol", "TokenizeCompletionRequest"),
                   ("vllm.entrypoints.serve.tokenize.protocol", "TokenizeChatRequest"),
                   ("vllm.entrypoints.serve.tokenize.protocol", "DetokenizeRequest"))


def never_generates(*objects: Any) -> bool:
    """Whether any of ``objects`` (a serving object, a request) is one of vLLM's tokenize or render kinds."""
    kinds = tuple(getattr(sys.modules.get(module), name, None) for module, name in _NON_GENERATING)
    return any(isinstance(obj, k) for k in kinds if isinstance(k, type) for obj in objects)


# Where vLLM keeps create_error_response, newest first (found by feature, not by version string).
_ERROR_RESPONSE_MODULES = (
    "vllm.entrypoints.serve.exception_handling.error_response",  # 0.33
    "vllm.entrypoints.serve.utils.error_response",  # 0.26
)


def is_base_model(serving: Any, model: str) -> bool:
    """Whether ``model`` is a served model name of ``serving`` (an OpenAI serving object).

    vLLM's ``_is_model_supported`` says yes to every name under ``VLLM_SKIP_MODEL_NAME_VALIDATION``, so the
    served names themselves are asked where vLLM has ``OpenAIServingModels.is_base_model``."""
    is_base = getattr(getattr(serving, "models", None), "is_base_model", None)
    return bool(is_base(model)) if callable(is_base) else bool(serving._is_model_supported(model))


def error_response(message: str, *, err_type: str, status: int) -> Any:
    """Build vLLM's ``ErrorResponse`` for an HTTP client (the module that builds it moved between releases).

    Raises:
        [`UnsupportedVLLMError`]: no known module provides ``create_error_response``.
    """
    import importlib
    from http import HTTPStatus

    for name in _ERROR_RESPONSE_MODULES:
        try:
            create = importlib.import_module(name).create_error_response
        except (ImportError, AttributeError):
            continue
        return create(message, err_type=err_type, status_code=HTTPStatus(status))
    raise UnsupportedVLLMError(f"vllm_lora_ext cannot find vLLM's create_error_response (looked in "
                               f"{list(_ERROR_RESPONSE_MODULES)}); this vLLM release is not supported yet.")


def unstacked_mapper(mapper: Any) -> Any:
    """Return the renames-only view of a model's ``hf_to_vllm_mapper`` that vLLM's own LoRA loader uses.

    0.26 calls it ``get_unstacked_mapper()``; 0.33 ``get_rename_mapper()`` (same purpose: keep constituent
    names such as ``q_proj`` rather than the stacked ``qkv_proj``).
    """
    for name in ("get_rename_mapper", "get_unstacked_mapper"):
        method = getattr(mapper, name, None)
        if method is not None:
            return method()
    raise UnsupportedVLLMError("vllm_lora_ext cannot find the model's renames-only weights mapper "
                               "(get_rename_mapper / get_unstacked_mapper); this vLLM release is not supported yet.")


# WeightsMapper fields that rename by literal text (0.26-0.33: substring, prefix, suffix; stacked names too).
_LITERAL_MAPPER_RULES = ("orig_to_new_substr", "orig_to_new_prefix", "orig_to_new_suffix", "orig_to_new_stacked")


def mapper_ignores_expert_numbers(mapper: Any) -> bool:
    """Whether ``mapper`` (a ``WeightsMapper`` or ``None``) maps keys that differ only in an expert number alike.

    True when every rule it has matches literal text without a digit. Such a rule matches two keys
    ``...experts.3.up_proj...`` and ``...experts.12.up_proj...`` at the same places (an occurrence cannot
    reach into the number, which dots surround), so both are kept or both dropped, and renamed alike. A
    regex or a renaming rule, a rule with a digit, or a field this list does not know makes it False: the
    loader then asks vLLM's parser about every key.
    """
    if mapper is None:
        return True
    if not dataclasses.is_dataclass(mapper):
        return False
    for f in dataclasses.fields(mapper):
        rules = getattr(mapper, f.name, None)
        if not rules:
            continue
        if f.name not in _LITERAL_MAPPER_RULES or not isinstance(rules, Mapping):
            return False
        if any(not isinstance(text, str) or any(c.isdigit() for c in text) for text in rules):
            return False
    return True


# Modules a build job's pickled key mapper (vLLM's ``WeightsMapper``) needs: a build process imports them while it
# starts, not while it unpickles its first job. On 0.26 the key parser does not import this one, and importing
# it inside the first job takes 0.5-0.6 s; on 0.33 the parser imports it already.
BUILD_JOB_MODULES = ("vllm.model_executor.models.utils",)


def preload_build_job_modules() -> None:
    """Import [`BUILD_JOB_MODULES`] (those this vLLM has), so the first job a build process reads unpickles at once."""
    import importlib

    for name in BUILD_JOB_MODULES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass  # moved in this vLLM: its first job imports whatever the pickle names


# Checks vLLM's own loader runs on a loaded LoRAModel (where this vLLM has them): 0.32 validates the MoE
# format, modules_to_save and token-classification heads; 0.33 the MoE format and classification heads.
POST_LOAD_VALIDATORS = ("_validate_moe_lora_format", "_validate_modules_to_save",
                        "_validate_token_classification_lora", "_validate_classification_head_lora")


def validate_loaded(adapter_manager: Any, lora: Any) -> None:
    """Run the post-load checks of vLLM's own loader that this vLLM has, on ``lora``."""
    for name in POST_LOAD_VALIDATORS:
        check = getattr(adapter_manager, name, None)
        if check is not None:
            check(lora)


def moe_intermediate_per_partition(module: Any) -> int:
    """Return a MoE LoRA wrapper's per-rank expert intermediate size as adapters see it (unpadded).

    0.33 may pad ``intermediate_size_per_partition`` for its kernels and keeps the adapter's stride in
    ``_tp_shard_size``; 0.26 has no padding and no such property.
    """
    unpadded = getattr(module, "_tp_shard_size", None)
    return int(unpadded if unpadded is not None else module.intermediate_size_per_partition)


def load_adapter_request_cls() -> Any:
    """Return vLLM's ``LoadLoRAAdapterRequest`` class."""
    from vllm.entrypoints.serve.lora.protocol import LoadLoRAAdapterRequest

    return LoadLoRAAdapterRequest


def next_lora_id(serving_models: Any) -> int:
    """A new adapter id from ``OpenAIServingModels``' own counter (``lora_id_counter``, 0.26-0.33), for an adapter
    registered without ``load_lora_adapter``."""
    return int(serving_models.lora_id_counter.inc(1))


def unload_adapter_request_cls() -> Any:
    """Return vLLM's ``UnloadLoRAAdapterRequest`` class."""
    from vllm.entrypoints.serve.lora.protocol import UnloadLoRAAdapterRequest

    return UnloadLoRAAdapterRequest


def lora_config_of(engine_client: Any) -> Any:
    """Return the engine's ``LoRAConfig`` seen from the API server (``None`` if LoRA is off or unknown)."""
    cfg = getattr(engine_client, "vllm_config", None)
    return getattr(cfg, "lora_config", None)


def is_first_model_rank() -> bool:
    """Return whether this worker is its engine's first tensor- and pipeline-parallel rank (``True`` without parallelism).

    Engine-wide counts (adapter loads) are recorded by this rank only, so TP=N does not count a load N times.
    """
    try:
        from vllm.distributed import parallel_state as ps

        if not ps.model_parallel_is_initialized():
            return True
        return bool(ps.get_tensor_model_parallel_rank() == 0 and ps.get_pp_group().is_first_rank)
    except Exception:  # no distributed state (tests, offline tools): a single process
        return True


def installed_vllm_version() -> str | None:
    """Return the installed vLLM version string, read from package metadata (no import of vLLM)."""
    try:
        return importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        return None


def check_vllm_version(version: str | None = None) -> str:
    """Refuse a vLLM outside the tested range, unless the user opted in.

    Raises:
        [`UnsupportedVLLMError`]: vLLM is missing, unparsable, or outside the tested range.
    """
    have = installed_vllm_version() if version is None else version
    supported = f">={SUPPORTED_VLLM_MIN},<{SUPPORTED_VLLM_MAX_EXCLUSIVE}"
    if have is None:
        raise UnsupportedVLLMError(f"vllm_lora_ext needs vLLM ({supported}), but vLLM is not installed. "
                                   f"Install it with: pip install 'vllm-lora-ext[vllm]'.")
    try:
        v = Version(have)
    except InvalidVersion as err:
        raise UnsupportedVLLMError(f"vllm_lora_ext cannot parse the installed vLLM version {have!r}.") from err
    # Local/dev builds of a supported release (0.26.0+cu130, 0.26.1.dev3) count as that release.
    base = Version(v.base_version)
    if Version(SUPPORTED_VLLM_MIN) <= base < Version(SUPPORTED_VLLM_MAX_EXCLUSIVE):
        return have
    if allow_unsupported_vllm():
        logger.warning("vLLM %s is outside the tested range %s; running anyway because %s is set.",
                       have, supported, ENV_ALLOW_UNSUPPORTED_VLLM)
        return have
    raise UnsupportedVLLMError(
        f"vllm_lora_ext supports vLLM {supported} (GPU-tested: {SUPPORTED_VLLM_MIN}), but vLLM {have} is installed. "
        f"Install a supported vLLM (pip install 'vllm>={SUPPORTED_VLLM_MIN},<{SUPPORTED_VLLM_MAX_EXCLUSIVE}'), uninstall vllm-lora-ext, or set "
        f"{ENV_ALLOW_UNSUPPORTED_VLLM}=1 to try this version anyway."
    )


def lora_kernels_batch_invariant() -> bool:
    """Return whether vLLM runs its LoRA kernels batch-invariant (it then never uses tuned configs)."""
    import sys

    utils = sys.modules.get(LORA_OP_UTILS_MODULE)
    return bool(getattr(utils, "is_batch_invariant", False))


@dataclasses.dataclass(frozen=True)
class MoELoRALayerShape:
    """What a fused-MoE LoRA layer's context says about its kernel launches (vLLM's ``MoELoRAContext``).

    Attributes:
        w13_slices: the w13 launch's ``num_slices`` (2 gated, 1 for the 3D-fused layer or a non-gated MoE).
        rank: the stacked rank (``max_lora_rank``, divided by TP when fully sharded).
        hidden: the hidden size; ``intermediate``: the per-partition expert intermediate size w2 reads.
        fully_sharded: vLLM's fully sharded LoRA (another kernel path, with a collective between shrink and expand).
        tuned: vLLM's ``use_tuned_config`` (its tables in ``VLLM_TUNED_CONFIG_FOLDER`` answer).
    """

    w13_slices: int
    rank: int
    hidden: int
    intermediate: int
    fully_sharded: bool
    tuned: bool


def moe_lora_layer_shape(context: Any) -> MoELoRALayerShape | None:
    """Read a ``MoELoRAContext`` (0.26-0.33: ``vllm/model_executor/layers/fused_moe/experts/lora_context.py``);
    None if it lacks a field read here."""
    try:
        a13, a2 = context.w13_lora_a_stacked[0], context.w2_lora_a_stacked[0]
        return MoELoRALayerShape(w13_slices=int(context.w13_num_slices), rank=int(a13.shape[-2]),
                                 hidden=int(a13.shape[-1]), intermediate=int(a2.shape[-1]),
                                 fully_sharded=bool(context.fully_sharded), tuned=bool(context.use_tuned_config))
    except (AttributeError, IndexError, TypeError):
        return None


def with_tuned_moe_configs(context: Any) -> Any:
    """A copy of a ``MoELoRAContext`` whose punica calls read vLLM's tuned tables (``use_tuned_config``, which
    vLLM's ``FusedMoEWithLoRA._build_lora_context`` sets from ``VLLM_TUNED_CONFIG_FOLDER``; 0.26-0.33)."""
    return dataclasses.replace(context, use_tuned_config=True)


def cuda_device_name() -> str | None:
    """Return ``torch.cuda.get_device_name()`` (the name vLLM's config files use), or None without CUDA."""
    import torch

    try:
        return torch.cuda.get_device_name() if torch.cuda.is_available() else None
    except Exception:
        return None


def lora_host_memory_pinned() -> bool:
    """Whether vLLM pins a LoRA model's CPU tensors when it registers one (``PIN_MEMORY``, 0.26-0.33).

    vLLM's model manager copies every factor of a new adapter into pinned memory after the load
    (``tensor.pin_memory()``), unless it is pinned already.
    """
    try:
        from vllm.utils.torch_utils import PIN_MEMORY
    except ImportError:
        return False
    return bool(PIN_MEMORY)


def pin_in_place(arena: Any, *, context: int | None = None) -> bool:
    """Page-lock the used part of a host arena for the GPUs, in place, where vLLM pins LoRA memory; return whether
    it did.

    vLLM copies an adapter into its GPU slot from CPU memory when it activates it, and for dense modules first
    copies every factor into pinned memory itself (``pin_memory()``). An arena registered in place
    ([`transport.cuda.register_in_place`]) makes both unnecessary: ``pin_memory()`` returns its tensors as they
    are, and the slot copy is a DMA. Nothing happens where vLLM does not pin LoRA memory (no CUDA,
    ``PIN_MEMORY`` off): the tensors then stay in ordinary memory, as vLLM would leave them.
    """
    from vllm_lora_ext.transport.cuda import register_in_place

    return lora_host_memory_pinned() and register_in_place(arena, context=context)


def mla_attention_cls() -> type | None:
    """vLLM's MLA attention layer (0.26–0.33: ``model_executor.layers.attention.mla_attention.MLAAttention``),
    built where ``model_config.use_mla`` holds; ``None`` if this vLLM has none there."""
    try:
        from vllm.model_executor.layers.attention.mla_attention import MLAAttention
    except ImportError:
        return None
    return MLAAttention  # type: ignore[no-any-return]


def _fused_experts(module: Any) -> Any:
    """The experts kernel an MoE LoRA wrapper runs (0.26–0.33: ``_moe_kernel.fused_experts``), or None."""
    return getattr(getattr(module, "_moe_kernel", None), "fused_experts", None)


def moe_experts_kernel(module: Any) -> str | None:
    """The class name of the experts kernel an MoE LoRA wrapper runs, or None where it has none."""
    experts = _fused_experts(module)
    return None if experts is None else type(experts).__name__


def moe_kernel_padding(module: Any) -> tuple[str, int, int | None] | None:
    """Where an MoE LoRA wrapper's Marlin experts kernel runs the experts at another intermediate size than vLLM's
    MoE LoRA buffers have: ``(kernel, the buffers' size, the kernel's)``, else None (0.26–0.33).

    Marlin pads a quantized base's intermediate size to its thread tile when it prepares the weights (a multiple
    of 64 and of the group size); the LoRA layer keeps ``intermediate_size_per_partition``, the unpadded size. The
    kernel's size is what ``fused_marlin_moe`` computes from the weights (``marlin_moe_intermediate_size``), which
    the wrapper's ``base_layer`` (a ``MoERunner``) holds on its ``routed_experts`` layer. Where it cannot be read, the kernel's size is None: the caller refuses rather than serve an unchecked layout.
    """
    name = moe_experts_kernel(module)
    if name is None or "Marlin" not in name:
        return None
    try:
        from vllm.model_executor.layers.quantization.utils.marlin_utils import marlin_moe_intermediate_size

        lora_n = int(module.intermediate_size_per_partition)
        experts = getattr(module.base_layer, "routed_experts", module.base_layer)  # 0.26-0.33: a MoERunner's
        kernel_n = int(marlin_moe_intermediate_size(experts.w13_weight, experts.w2_weight))
    except (ImportError, AttributeError, TypeError, IndexError):
        return name, int(getattr(module, "intermediate_size_per_partition", 0) or 0), None
    return None if kernel_n == lora_n else (name, lora_n, kernel_n)


def runner_dummy_runs_with_loras(runner: Any) -> bool:
    """Whether ``runner._dummy_run`` takes what the MoE LoRA warm-up passes (0.26-0.33's GPU model runner)."""
    import inspect

    try:
        params = inspect.signature(runner._dummy_run).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    wanted = ("cudagraph_runtime_mode", "skip_eplb", "remove_lora", "num_active_loras")
    return all(p in params for p in wanted) and hasattr(runner, "maybe_remove_all_loras")


def moe_lora_block_m(context: Any, layer: Any, dtype: Any) -> Any:
    """A function ``(op_index, n_tokens) -> BLOCK_SIZE_M`` of a fused-MoE LoRA layer's shrink launches (0: w13, 1:
    w2), looked up as ``PunicaWrapperGPU.add_lora_w13``/``add_lora_w2`` do (0.26-0.33): the tuned tables where
    the layer's context says ``use_tuned_config``, else the base MoE config's, through
    ``try_get_optimal_moe_lora_config`` of the expert weights (on the ``MoERunner``'s ``routed_experts`` layer).
    ``layer``: the ``FusedMoEWithLoRA``; ``dtype``: the model's (the activations')."""
    from vllm.lora.layers.utils import try_get_optimal_moe_lora_config
    from vllm.lora.ops.triton_ops.utils import _normalize_lora_config_keys, get_lora_op_configs
    from vllm.model_executor.layers.fused_moe.config import _get_config_dtype_str

    a13, b13, a2 = context.w13_lora_a_stacked[0], context.w13_lora_b_stacked[0], context.w2_lora_a_stacked[0]
    rank, config_dtype = int(a13.shape[-2]), _get_config_dtype_str(dtype=dtype)
    experts = getattr(layer.base_layer, "routed_experts", layer.base_layer)
    w1, w2 = tuple(experts.w13_weight.shape), tuple(experts.w2_weight.shape)
    tuned = ((int(a13.shape[-1]), int(context.w13_num_slices), int(b13.shape[-2])),  # hidden, slices, N (w13)
             (int(context.w2_lora_b_stacked[0].shape[-2]), 1, int(a2.shape[-1])))  # hidden, 1, intermediate (w2)

    def block_m(op: int, n_tokens: int) -> int:
        op_type = f"fused_moe_lora_{'w13' if op == 0 else 'w2'}_shrink"
        if context.use_tuned_config:
            hidden, slices, inter = tuned[op]
            config = get_lora_op_configs(op_type=op_type, max_loras=int(context.max_loras), batch=n_tokens,
                                         hidden_size=hidden, rank=rank, num_slices=slices, moe_intermediate_size=inter)
        else:
            config = try_get_optimal_moe_lora_config(op_type, w1_shape=w1, w2_shape=w2, rank=rank,
                                                     top_k=int(context.top_k), dtype=config_dtype, M=n_tokens)
        return int(_normalize_lora_config_keys(config).get("BLOCK_SIZE_M") or 64)

    return block_m


_UPSTREAM_RESIDENCY: list[bool] = []


def has_upstream_residency_metric() -> bool:
    """Whether vLLM exports its own ``vllm:lora_adapter_loaded`` (PR #54830); then the plugin's gauge stays off."""
    if not _UPSTREAM_RESIDENCY:
        spec = importlib.util.find_spec("vllm.v1.metrics.loggers")
        try:
            found = bool(spec and spec.origin and "lora_adapter_loaded" in open(spec.origin, encoding="utf-8").read())
        except OSError:
            found = False
        _UPSTREAM_RESIDENCY.append(found)
    return _UPSTREAM_RESIDENCY[0]


def merge_finds_parts_by_name(adapter_manager: Any) -> bool:
    """Whether vLLM's merge of packed modules finds each part of one in a ``LoRAModel`` by the part's own name alone
    (``_get_lora_layer_weights``: ``loras.get(name)``), as for a text model on 0.26-0.33. Not for a pooling model
    (every version also tries the name without ``model.``), nor for a multimodal one (0.33 also tries the text-only
    names of its language model; on 0.26-0.32, where it does not, such models are left to the whole merge too)."""
    return not getattr(adapter_manager, "is_pooling_model", True) and not getattr(adapter_manager, "supports_mm", False)


def runner_adapter_manager(runner: Any) -> Any:
    """A model runner's ``LoRAModelManager`` (``runner.lora_manager._adapter_manager``, 0.26-0.33), or ``None``."""
    return getattr(getattr(runner, "lora_manager", None), "_adapter_manager", None)


def warm_logits_processor_lookup(input_processor: Any) -> bool:
    """Fill vLLM's cache of custom logits-processor classes (``cached_load_custom_logitsprocs``) for the key its first
    request would look up, where vLLM leaves that lookup to the first request; return whether it did.

    The lookup scans every installed distribution's entry points (``importlib.metadata.entry_points``: 31 ms
    profiled over 247 distributions on the H200 host, r32), once, inside the first request's processing. On 0.26-0.32
    it runs from ``SamplingParams.verify``; on 0.33 from the V1 runner's ``validate_logits_processors_params``, a
    ``partial`` of ``validate_logits_processors_parameters``. 0.33's V2 runner loads its processors in
    ``InputProcessor.__init__`` through its own builder, so nothing is left to warm there; a pooling model's requests
    never look (vLLM refuses sampling parameters for them first). A lookup that fails (a processor named by a path
    that does not import) is left to the first request, which raises as before (vLLM's cache keeps no failures;
    vLLM's own log line about it then also appears at start).
    """
    try:
        from vllm.v1.sample import logits_processor as procs
    except ImportError:
        return False
    cached = getattr(procs, "cached_load_custom_logitsprocs", None)
    validate = getattr(procs, "validate_logits_processors_parameters", None)
    validator = getattr(input_processor, "validate_logits_processors_params", None)
    if cached is None or (validator is not None and getattr(validator, "func", None) is not validate):
        return False
    model_config = getattr(input_processor, "model_config", None)
    if getattr(model_config, "runner_type", None) == "pooling":
        return False
    custom = getattr(model_config, "logits_processors", None)
    try:
        cached(tuple(custom) if custom is not None else None)
    except Exception as err:  # the first request raises it, as it would have
        logger.debug("logits-processor lookup not warmed: %s", err)
        return False
    return True
