"""The ``vllm.general_plugins`` entry point: ``register()``, and the table of every patch it applies.

vLLM calls ``register()`` in every process it starts (API server, engine core, each worker, model
registry subprocesses), possibly more than once per process. It is therefore re-entrant, cheap, and
touches no device. It imports no heavy vLLM module: each patch in `PATCHES` is applied when vLLM
itself imports the module that holds its target (a post-import hook), so the API server never pays
for vLLM's LoRA layers. Each patch goes through `patching.apply_patch`, which checks the target, its
parameters and the private attributes it reads first; `unregister()` restores vLLM's originals. The
replacements live by the process they run in: `server_patches`, `engine_patches`, `worker_patches`
(and `kernels`, `moe_configs`, `warmup`). ``PATCHES.md`` beside this file is generated from `PATCHES`
(`patch_table`); a test keeps the two in step.
"""

from __future__ import annotations

import functools
import logging
import os
import sys
from typing import Any

from vllm_lora_ext import __version__, metrics
from vllm_lora_ext._logging import attach_handler_once
from vllm_lora_ext.constants import SETTING_PREFIX, check_settings, log_level, plugin_disabled, stall_trace_seconds
from vllm_lora_ext.errors import SettingsError, UnsupportedVLLMError
from vllm_lora_ext.integration import engine_patches, server_patches, worker_patches
from vllm_lora_ext.integration._compat import (
    ANTHROPIC_SERVING_MODULE,
    ASYNC_LLM_MODULE,
    ENV_CHECK_LOGGERS,
    BASE_LINEAR_LORA_MODULE,
    BASE_SERVING_MODULE,
    BATCH_CHAT_MODULE,
    BEAM_SEARCH_MODULE,
    COHERE_SERVING_MODULE,
    FUSED_MOE_LORA_MODULE,
    GENERATE_SERVING_MODULE,
    GPU_WORKER_MODULE,
    INPUT_PROCESSOR_MODULE,
    LLM_ENGINE_MODULE,
    LORA_EXPAND_OP_MODULE,
    LORA_OP_UTILS_MODULE,
    LORA_SHRINK_OP_MODULE,
    MODEL_MANAGER_MODULE,
    OUTPUT_PROCESSOR_MODULE,
    POOLING_SERVING_MODULE,
    SERVING_MODELS_MODULE,
    TOKENS_SERVING_MODULE,
    TRITON_MOE_MODULE,
    PUNICA_GPU_MODULE,
    WORKER_MANAGER_MODULE,
    check_vllm_version,
)
from vllm_lora_ext.integration.dual_stream import (
    make_apply_async_impl,
    make_determine_available_memory,
    make_experts_apply,
)
from vllm_lora_ext.integration.kernels import (
    make_add_lora_fused_moe,
    make_build_lora_context,
    make_get_lora_op_configs,
    make_load_lora_op_config,
)
from vllm_lora_ext.integration.patching import (
    DEPLOYMENT_ATTR,
    DISK_HOLDS_ATTR,
    IDENTITY_ATTR,
    LIVE_RANK_ATTR,
    MERGED_ATTR,
    OFFLINE_LOADED_ATTR,
    PATCH_MARK,
    PART_OWNERS_ATTR,
    PINNED_NAMES_ATTR,
    PREBUILD_ATTR,
    PREBUILD_NAMES_ATTR,
    RESIDENT_NAMES_ATTR,
    ROUTED_ATTR,
    SLOT_RANKS_ATTR,
    STAGED_ATTR,
    TRAITS_ATTR,
    Patch,
    apply_patch,
    applied,
    cancel_hooks,
    undo_all,
    when_imported,
)
from vllm_lora_ext.integration.moe_configs import make_try_get_optimal_moe_config

from vllm_lora_ext.integration.warmup import make_compile_or_warm_up_model

logger = logging.getLogger(__name__)

_REGISTERED = False

__all__ = ["PATCHES", "register", "unregister", "is_registered", "worker_state", "PATCH_MARK"]


_KERNEL_CONFIG_PARAMS = ("op_type", "max_loras", "batch", "hidden_size", "rank", "num_slices", "add_inputs")
_BUILT = (f"LoRAModel.{IDENTITY_ATTR}", f"LoRAModel.{STAGED_ATTR}", f"LoRAModel.{MERGED_ATTR}")
_ADD_ADAPTER_WRITES = (f"WorkerLoRAManager.{PREBUILD_ATTR}", f"WorkerLoRAManager.{PREBUILD_NAMES_ATTR}",
                       f"WorkerLoRAManager.{RESIDENT_NAMES_ATTR}", *_BUILT)


def _add_adapter_patch(cls: str, param: str, *, why: str, delete_when: str, related: str) -> Patch:
    """The row for ``cls.add_adapter``: both worker managers' ``add_adapter`` take the same replacement."""
    return Patch(WORKER_MANAGER_MODULE, f"{cls}.add_adapter", (param,), worker_patches.make_add_adapter,
                 process="worker", reads=("_adapter_manager", "_adapter_manager._registered_adapters"),
                 writes=_ADD_ADAPTER_WRITES, why=why, delete_when=delete_when, related=related)


PATCHES: tuple[Patch, ...] = (
    Patch(WORKER_MANAGER_MODULE, "WorkerLoRAManager._load_adapter", ("lora_request",),
          worker_patches.make_load_adapter, process="worker", reads=("_adapter_manager", "_lora_model_cls"),
          writes=(*_BUILT, f"LoRAModelManager.{TRAITS_ATTR}", "LoRAModel.id"),
          why="the single place a worker turns a LoRA path into tensors: hf: sources, MoE layouts, EP reads, mixes, "
              "and every check before vLLM sees a tensor; a model built in the background is taken as it is",
          delete_when="never as a whole; parts go as vLLM adds hf: revisions (lora/utils.py), checked MoE layouts and "
                      "per-request mixes",
          related="RFC #51940 (per-request mixes)"),
    _add_adapter_patch("WorkerLoRAManager", "adapter_request",
                       why="vLLM skips loading an id it holds; an id reused for another source would serve the old "
                           "tensors. Also answers the server's build-ahead probes (background loading) without "
                           "registering them, and after the slot copy points a GPU-staged model back at its CPU "
                           "tensors. Writes the residency gauge (vllm_lora_ext_adapter_resident) after each "
                           "registration, activation or eviction",
                       delete_when="vLLM keys its worker cache on (id, path) or rejects id reuse, and loads adapters "
                                   "off the engine loop",
                       related="vLLM issue #31941 (loading adapters off the engine loop)"),
    _add_adapter_patch("LRUCacheWorkerLoRAManager", "lora_request",
                       why="as WorkerLoRAManager.add_adapter, for the LRU worker manager every engine uses",
                       delete_when="as WorkerLoRAManager.add_adapter", related="as WorkerLoRAManager.add_adapter"),
    Patch(MODEL_MANAGER_MODULE, "LoRAModelManager._create_merged_loras_inplace", ("lora_model",),
          worker_patches.make_create_merged_loras, process="worker",
          reads=("packed_modules", "is_pooling_model", "supports_mm"), writes=(f"LoRAModelManager.{PART_OWNERS_ATTR}",),
          why="registering a new adapter runs this in the engine step: a Python pass over every packed sub-module "
              "name (18,432 for 48 layers of 128 experts), and on vLLM 0.26 the string of a factor tensor (a GPU "
              "sync for a staged one), 30 of the 49 ms an H200 step paused for a new MoE adapter. A background "
              "build runs vLLM's own merge on its thread (integration.prebuild); this skips the model it merged, and "
              "shows vLLM's merge only the packed modules the model has parts of (144 lookups instead of 18,576 for "
              "a prepacked MoE adapter; the same model, worker_patches._parts_only)",
          delete_when="vLLM merges packed modules when it loads an adapter, not when it registers one",
          related="vLLM issue #31941 (loading adapters off the engine loop)"),
    Patch(MODEL_MANAGER_MODULE, "LoRAModelManager.activate_adapter", ("lora_id",),
          worker_patches.make_activate_adapter, process="worker",
          reads=("_active_adapters", "_registered_adapters", "lora_index_to_id", "modules",
                 "_get_lora_layer_weights", "punica_wrapper_mapping"),
          writes=(f"PunicaWrapperGPU.{SLOT_RANKS_ATTR}", f"LoRAModel.{LIVE_RANK_ATTR}"),
          why="activating a new adapter in the engine step calls set_lora or reset_lora of every LoRA module (about "
              "1,400 tensor writes from Python for 48 MoE layers): 0.033-0.041 s an H200 step paused while 32 "
              "requests decoded. For a model a background build staged and merged, the writes were recorded on "
              "its thread (integration.activation) and are done here in a few batched calls; anything else goes "
              "through vLLM's path. Either way the slot's live rank (its adapter's largest; every row before "
              "and should it fail) goes into the punica wrappers' table, which the fused-MoE pair kernels read "
              "to skip the zero rows past it (integration.slot_ranks)",
          delete_when="vLLM copies a new adapter into its slot in batched calls, or off the engine step",
          related="vLLM issue #31941 (loading adapters off the engine loop)"),
    Patch(WORKER_MANAGER_MODULE, "LRUCacheWorkerLoRAManager._apply_adapters", ("lora_requests",),
          worker_patches.make_apply_adapters, process="worker",
          reads=("_adapter_manager", "_adapter_manager._registered_adapters", "_adapter_manager._active_adapters"),
          why="host time per decode step grows with the batch's distinct adapters: vLLM calls "
              "add_adapter per adapter every step (about 20 µs of host time each, `bench/bench_step_adapters.py`); "
              "for a batch whose adapters are all active, touch vLLM's two LRU caches as add_adapter would, without "
              "calling it per adapter; anything else goes through vLLM's path",
          delete_when="vLLM skips re-activating the adapters of a batch that are already active"),
    Patch(LLM_ENGINE_MODULE, "LLMEngine.add_request", ("request_id", "prompt", "params", "arrival_time",
                                                       "lora_request"), engine_patches.make_add_request,
          process="engine", writes=(f"LLMEngine.{OFFLINE_LOADED_ATTR}", "LoRARequest.lora_path"),
          why="offline LLM.generate loads an adapter inside the engine step, where a bad adapter kills the engine; "
              "preloading raises at the call, pins the source and refuses a reused id",
          delete_when="vLLM validates/preloads LoRA in LLM.generate (InputProcessor) before queueing"),
    Patch(SERVING_MODELS_MODULE, "OpenAIServingModels.load_lora_adapter", ("request", "base_model_name"),
          server_patches.make_load_lora_adapter, process="server", reads=("_check_load_lora_adapter_request",),
          writes=(f"OpenAIServingModels.{DISK_HOLDS_ATTR}", f"OpenAIServingModels.{PINNED_NAMES_ATTR}",
                  "LoadLoRAAdapterRequest.lora_path"),
          why="resolve (download) a source in a thread and pin it before the engine sees it; refuse names the mix "
              "grammar reserves (+, =, mix-), the operator's names, a served base model's name (vLLM 0.26 took it and "
              "served it for the base model), client mix: paths and paths outside VLLM_LORA_EXT_ALLOWED_ROOTS; run "
              "vLLM's own request checks before any download or build; build a new or replaced (load_inplace) adapter "
              "in the background before vLLM registers it, and clear the flag on the request it then serves (vLLM "
              "0.26 kept it: a reload in every step); hold the hub revisions of registered adapters in the disk cache",
          delete_when="vLLM resolves sources with revisions off the engine loop and has a path allow-list"),
    Patch(SERVING_MODELS_MODULE, "OpenAIServingModels.init_static_loras", (), server_patches.make_init_static_loras,
          process="server", writes=(f"OpenAIServingModels.{DEPLOYMENT_ATTR}",),
          why="register the deployment config (VLLM_LORA_EXT_CONFIG) at start-up; mark start-up loads as the "
              "operator's (the allowed-roots rule is for runtime loads)",
          delete_when="vLLM reads a named-adapter config at start-up"),
    Patch(BASE_SERVING_MODULE, "BaseServing._check_model", ("request",), server_patches.make_check_model,
          process="server", reads=("_is_model_supported",), writes=(f"request.{ROUTED_ATTR}", "request.model"),
          why="route body fields (adapters, adapter_weights), the model syntax a=0.7+b=0.3 and the deployment "
              "default to one registered mix; vLLM's LoRAResolver sees neither body fields nor weights",
          delete_when="vLLM supports per-request adapter sets with weights",
          related="RFC #51940 (per-request mixes), PR #52757 (one scale per request)"),
    Patch(BASE_SERVING_MODULE, "BaseServing._maybe_get_adapters", ("request",), server_patches.make_maybe_get_adapters,
          process="server",
          why="serve a routed request the exact mix it was routed to, even if the mix left the registry before "
              "generation; vLLM's lookup by name would then fall back to the base model",
          delete_when="as BaseServing._check_model"),
    Patch(ASYNC_LLM_MODULE, "AsyncLLM.generate", ("prompt", "sampling_params", "request_id"),
          engine_patches.make_generate, process="engine",
          why="hold a request's mix in the bounded registry from the call (generation admitted) until its outputs "
              "end, so it is never evicted (or its id reused) while in flight; a stream dropped before it starts "
              "releases it when collected",
          delete_when="mixes are native vLLM adapters with their own lifetime"),
    *(Patch(module, "get_lora_op_configs", _KERNEL_CONFIG_PARAMS, make_get_lora_op_configs, process="worker",
            why=f"{op}: vLLM's default config launches far more blocks than a batch over many adapters needs: "
                "answer from the tuned table shipped for this GPU (`vllm_lora_ext/kernel_configs/`), else "
                "vLLM's lookup. Only this module's name is replaced; setting VLLM_TUNED_CONFIG_FOLDER instead would "
                "also move the fused-MoE LoRA kernels off vLLM's own config choice",
            delete_when="vLLM ships tuned shrink/expand configs for these GPUs, or reads a tuned folder per op type")
      for module, op in ((LORA_SHRINK_OP_MODULE, "shrink"), (LORA_EXPAND_OP_MODULE, "expand"))),
    Patch(GENERATE_SERVING_MODULE, "GenerateBaseServing._with_kv_transfer_rejection_cleanup",
          ("awaitable", "request", "raw_request"), server_patches.make_request_scope, process="server",
          why="the one wrapper vLLM puts around the completions, chat and responses handlers: the request runs in a "
              "lease scope (`integration/leases.py`), and the mix its routing holds is released when the handler "
              "returns, so a request that fails before generating (a too-long prompt, a render error) frees its "
              "slot at once",
          delete_when="as BaseServing._check_model"),
    Patch(OUTPUT_PROCESSOR_MODULE, "RequestOutputCollector.__init__", ("output_kind", "request_id"),
          engine_patches.make_collector_init, process="engine",
          why="the collector AsyncLLM.generate makes for a request takes that generation's mix lease, so that the "
              "engine's finished output can release it (below)",
          delete_when="as AsyncLLM.generate"),
    Patch(OUTPUT_PROCESSOR_MODULE, "RequestOutputCollector.put", ("output",), engine_patches.make_collector_put,
          process="engine",
          why="a lease released only when the client drained its stream let a client that stops reading (a full "
              "TCP window) hold every mix slot after the engine had finished, at no engine cost, and every other "
              "client's new mix waited and got a 503; the finished output (or error) releases it",
          delete_when="as AsyncLLM.generate"),
    Patch(BATCH_CHAT_MODULE, "OpenAIServingChatBatch.create_batch_chat_completion", ("request", "raw_request"),
          server_patches.make_batch_request_scope, process="server",
          why="/v1/chat/completions/batch is not run inside the wrapper above: without a lease scope the mix its "
              "routing registers is released at once, and its per-conversation copies of the request look the mix "
              "up by name, so another client's new mix could evict it and the batch was answered 404",
          delete_when="as BaseServing._check_model"),
    Patch(BEAM_SEARCH_MODULE, "BeamSearchOnlineMixin.beam_search", ("prompt", "request_id", "params", "lora_request"),
          engine_patches.make_generate, process="server",
          why="online beam search calls generate once per step; one lease from the call until its output ends keeps "
              "its mix from being evicted between steps",
          delete_when="as AsyncLLM.generate"),
    *(Patch(module, target, ("request", "raw_request"), server_patches.make_dropped_mix_fields_guard,
            process="server",
            why="vLLM's request types for /v1/messages, /inference/v1/generate and (0.33) /cohere/v2/chat drop the "
                "body fields adapters and adapter_weights before any handler sees them, so such a request ran without "
                "its mix and without an error: refuse it (400), naming the fields and the 'model' mix syntax these "
                "routes do read",
            delete_when="these routes' request types keep or refuse unknown fields")
      for module, target in ((ANTHROPIC_SERVING_MODULE, "AnthropicServingMessages.create_messages"),
                             (TOKENS_SERVING_MODULE, "ServingTokens.serve_tokens"),
                             (COHERE_SERVING_MODULE, "CohereServingChatV2.create_chat_v2"))),
    Patch(POOLING_SERVING_MODULE, "PoolingServing._init_ctx", ("io_processor", "request", "raw_request"),
          server_patches.make_pooling_init_ctx, process="server",
          why="/v2/embed's request type drops the body fields adapters and adapter_weights, which the other pooling "
              "routes keep and the row below refuses, so such a request was embedded without an error: refuse them "
              "(400) from the body vLLM's route parsed",
          delete_when="/v2/embed's request type keeps or refuses unknown fields"),
    Patch(POOLING_SERVING_MODULE, "PoolingBaseServing._check_model", ("request",),
          server_patches.make_pooling_check_model, process="server", reads=("_is_model_supported",),
          why="pooling routes (embeddings, score, classify) override _check_model and never route adapter fields, so "
              "a mix named there would be answered by the base model; refuse adapters/adapter_weights and mix "
              "models with a 400 naming the generation routes; build a named adapter that may not be cached "
              "(evicted, or registered unbuilt at start) off the engine loop first, its failure a 4xx",
          delete_when="as BaseServing._check_model"),
    Patch(GPU_WORKER_MODULE, "Worker.compile_or_warm_up_model", (), make_compile_or_warm_up_model, process="worker",
          reads=("model_runner", "model_runner._dummy_run", "model_runner.lora_manager"),
          writes=(f"LoRAModelManager.{PART_OWNERS_ATTR}", f"LoRAModelManager.{TRAITS_ATTR}"),
          why="vLLM's warm-up runs with no active LoRA, so the fused-MoE LoRA Triton kernels compile only where CUDA "
              "graph capture runs them; an eager engine (and any uncaptured batch) compiles them inside the first "
              "step with an MoE adapter, seconds that pause every request in flight. Before "
              "vLLM's own warm-up, with LoRA on and fused-MoE LoRA layers present, run vLLM's _dummy_run with dummy "
              "LoRAs (`integration/warmup.py`; VLLM_LORA_EXT_MOE_WARMUP=0 skips it, "
              "VLLM_LORA_EXT_MOE_WARMUP_TOKENS names the token counts)",
          delete_when="vLLM's warm-up runs its dummy LoRAs through the MoE LoRA kernels for eager batch sizes"),
    Patch(TRITON_MOE_MODULE, "try_get_optimal_moe_config", ("w1_shape", "w2_shape", "top_k", "dtype", "M"),
          make_try_get_optimal_moe_config, process="worker",
          why="with LoRA on, an int4/int8 weight-only MoE base that Marlin cannot take runs TritonWNA16Experts, whose "
              "Triton kernel needs GROUP_SIZE_M; vLLM 0.26's default tile config for small 4-bit batches is the CUDA "
              "kernel's, without it, so the engine dies at start-up or at its first small batch. Complete such "
              "configs with vLLM's own Triton defaults (`integration/moe_configs.py`); expert adapters on such a "
              "base are then refused (`unapplied`: the kernel never reads the LoRA context), others served",
          delete_when="vLLM's small-batch WNA16 default carries GROUP_SIZE_M (it does in vLLM 0.33)"),
    Patch(FUSED_MOE_LORA_MODULE, "FusedMoEWithLoRA._build_lora_context", (), make_build_lora_context,
          process="worker", writes=("MoELoRAContext.use_tuned_config",),
          why="a fused-MoE LoRA layer reads tuned tile configs only when VLLM_TUNED_CONFIG_FOLDER is set (its "
              "context's use_tuned_config), which would also move the dense kernels off the plugin's tables; "
              "otherwise it derives them from the base MoE GEMM's config. Set the flag on the context of a layer "
              "the fused-MoE tables shipped for this GPU fit (`kernel_configs/moe.py`: hidden and intermediate "
              "size tuned, rank up to the largest tuned, not fully sharded); with none shipped, "
              "VLLM_LORA_EXT_KERNEL_CONFIGS=0, a user's folder or batch-invariant mode, the context is vLLM's",
          delete_when="vLLM ships tuned fused-MoE LoRA tables for these GPUs, or reads a tuned folder per op type"),
    Patch(LORA_OP_UTILS_MODULE, "load_lora_op_config", ("op_type", "add_inputs"), make_load_lora_op_config,
          process="worker",
          why="for a layer whose context the row above set, vLLM's get_lora_op_configs reads the four fused-MoE op "
              "types' tables through this loader, which looks only in VLLM_TUNED_CONFIG_FOLDER: answer those op "
              "types from the tables shipped for this GPU (vLLM's own lookup then picks the nearest keys); every "
              "other op type, and the cases the row above leaves to vLLM, go to vLLM's loader",
          delete_when="as FusedMoEWithLoRA._build_lora_context"),
    Patch(BASE_LINEAR_LORA_MODULE, "BaseLinearLayerWithLoRA._apply_async_impl", ("x", "bias"),
          make_apply_async_impl, process="worker", reads=("punica_wrapper", "_apply_sync"),
          why="with vLLM's dual-stream LoRA (VLLM_LORA_ENABLE_DUAL_STREAM=1, the user's switch) a dense LoRA layer "
              "zeroes a delta buffer, forks, joins and adds in every batch, also one where no token has an adapter "
              "and no LoRA kernel launches (3-8% slower no-adapter batches in r42): such a batch takes the layer's "
              "one-stream path, by vLLM's host-side flag its own LoRA kernels skip on (`integration/dual_stream.py`)",
          delete_when="vLLM's dual-stream LoRA skips its second stream in batches without an adapter"),
    Patch(TRITON_MOE_MODULE, "TritonExperts.apply",
          ("output", "hidden_states", "w1", "w2", "topk_weights", "topk_ids", "activation"),
          make_experts_apply, process="worker", reads=("_lora_context",), writes=("MoELoRAContext.aux_stream",),
          why="the same for a fused-MoE layer under vLLM's dual-stream LoRA: a batch without an adapter runs its "
              "context on one stream (two zeroed buffers, forks and adds fewer a layer)",
          delete_when="as BaseLinearLayerWithLoRA._apply_async_impl"),
    Patch(GPU_WORKER_MODULE, "Worker.determine_available_memory", (), make_determine_available_memory,
          process="worker",
          why="the two rows above would put vLLM's memory profile run (no adapter) on one stream, leaving the delta "
              "buffers a batch with adapters allocates on the second stream (up to max_num_batched_tokens x a "
              "layer's outputs, and two fused-MoE intermediate caches) out of the peak the KV cache is sized from: "
              "the profile run keeps vLLM's two-stream path",
          delete_when="as BaseLinearLayerWithLoRA._apply_async_impl"),
    Patch(SERVING_MODELS_MODULE, "OpenAIServingModels.unload_lora_adapter", ("request",),
          server_patches.make_unload_lora_adapter, process="server",
          writes=("OpenAIServingModels.lora_resolver_lock",),
          why="a client may not unload the operator's adapters (--lora-modules, the deployment config) and load "
              "its own under their names; the per-name lock vLLM keeps for every name ever asked for goes once free",
          delete_when="vLLM protects configured adapters from runtime unloads and frees its per-name locks"),
    Patch(INPUT_PROCESSOR_MODULE, "InputProcessor.__init__", ("vllm_config",),
          engine_patches.make_input_processor_init, process="engine",
          why="vLLM looks its custom logits processors up (an entry-points scan over every installed distribution, "
              "31 ms profiled) in the first request's processing, on the path of the first adapter's first token "
              "(issue 39 item 3): do that cached lookup while the engine client starts, where vLLM defers it "
              "(`_compat.warm_logits_processor_lookup`; a failing lookup is left to the first request)",
          delete_when="vLLM loads logits-processor plugins at start-up on every model runner"),
    Patch(PUNICA_GPU_MODULE, "PunicaWrapperGPU.add_lora_fused_moe",
          ("y", "x", "lora_a_stacked", "lora_b_stacked", "topk_weights", "sorted_token_ids", "expert_ids",
           "adapter_enabled", "mul_routed_weight", "fully_sharded", "offset", "token_lora_mapping", "add_inputs"),
          make_add_lora_fused_moe, process="worker", reads=("token_mapping_meta", "lora_config"),
          writes=(f"PunicaWrapperGPU.{SLOT_RANKS_ATTR}",),
          why="a small batch's fused-MoE LoRA (vLLM's pairs assigned one by one: 32 decode tokens at 16 slots) runs "
              "vLLM's one-shot kernel with a whole 16-row program per pair, shrink then expand in sequence: run "
              "those batches through two kernels that split the shrink over K and the expand over N "
              "(`integration/moe_pairs.py`; on an H200, one layer's LoRA step 34-42 us against 53-56 us at r16, 55-69 "
              "us against 88-94 us at r32). "
              "They read only each slot's live rank (an r16 adapter in r32 slots reads 16 rows), and take slot "
              "ranks up to 32. "
              "Every other batch, and all with VLLM_LORA_EXT_KERNEL_CONFIGS=0, is vLLM's",
          delete_when="vLLM's fused-MoE LoRA kernel splits a small batch's pairs over K and N"),
)


def is_registered() -> bool:
    """Return whether ``register()`` has run in this process."""
    return _REGISTERED


def register() -> None:
    """Install the plugin in this vLLM process (idempotent; safe to call many times).

    Raises:
        [`SettingsError`]: a ``VLLM_LORA_EXT_*`` setting is malformed, or misspelt (each one is named).
        [`UnsupportedVLLMError`]: the installed vLLM is outside the tested range (set
            ``VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM=1`` to try anyway), or a patched name is missing
            or has another signature in it.
    """
    global _REGISTERED
    if _REGISTERED:
        return
    attach_handler_once()
    if plugin_disabled():
        logger.info("vllm_lora_ext %s is installed but disabled (VLLM_LORA_EXT_DISABLE) in process %d",
                    __version__, os.getpid())
        _REGISTERED = True
        return
    try:
        vllm_version = check_vllm_version()
        check_settings()  # every VLLM_LORA_EXT_* setting, strictly, with one error naming the bad ones
    except (SettingsError, UnsupportedVLLMError) as refusal:
        _shown_without_traceback(refusal)
        raise
    for name in ENV_CHECK_LOGGERS:  # vLLM's word for each of them is "unknown"; checked above instead
        logging.getLogger(name).addFilter(_not_ours)  # (once: a logger keeps one of each filter)
    metrics.setup()
    stall_threshold = stall_trace_seconds()
    if stall_threshold:
        from vllm_lora_ext import stall_trace

        stall_trace.start(stall_threshold)
    for patch in PATCHES:
        when_imported(patch.module, functools.partial(apply_patch, patch=patch))
    _REGISTERED = True
    logger.info("vllm_lora_ext %s active in process %d (vLLM %s)", __version__, os.getpid(), vllm_version)


def _shown_without_traceback(refusal: BaseException) -> None:
    """Have ``refusal`` (a bad setting or an unsupported vLLM, raised from ``register()``), if it ends the program
    uncaught, printed as its message alone: ``vllm serve`` loads plugins as it builds its argument parser, so the
    message would end 15 lines of vLLM's frames. Any other uncaught exception goes to the hook there was; with
    ``VLLM_LORA_EXT_LOG_LEVEL=DEBUG`` this one does too. A caller that catches it sees the exception as raised."""
    if log_level() == "DEBUG":
        return
    previous = sys.excepthook

    def hook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
        if value is not refusal:
            previous(kind, value, tb)
            return
        sys.stderr.write(f"vllm_lora_ext: {type(value).__name__}: {value}\n(Its traceback: rerun with "
                         f"VLLM_LORA_EXT_LOG_LEVEL=DEBUG.)\n")

    sys.excepthook = hook


def _not_ours(record: logging.LogRecord) -> bool:
    """Drop vLLM's "Unknown vLLM environment variable" warning for a ``VLLM_LORA_EXT_*`` name: `check_settings` has
    refused a misspelt one and said of any other that is no setting that it has no effect."""
    return not (str(record.msg).startswith("Unknown vLLM environment variable") and bool(record.args)
                and str(record.args[0] if isinstance(record.args, tuple) else "").startswith(SETTING_PREFIX))


def unregister() -> None:
    """Undo ``register()``: restore every patched vLLM attribute and drop hooks not yet run (tests)."""
    global _REGISTERED
    cancel_hooks()
    undo_all()
    for name in ENV_CHECK_LOGGERS:
        logging.getLogger(name).removeFilter(_not_ours)
    _REGISTERED = False


def worker_state(worker: Any = None) -> dict[str, Any]:
    """Report the plugin's state in this process; use ``llm.collective_rpc(worker_state)`` to ask every worker.

    ``rank`` is the worker's global rank (``None`` outside a worker); ``adapter_reads`` counts the adapters
    this process built and the weight bytes it read for them.
    """
    import sys

    wm = sys.modules.get(WORKER_MANAGER_MODULE)
    patched = bool(wm is not None and getattr(wm.WorkerLoRAManager._load_adapter, PATCH_MARK, False))
    loader = sys.modules.get("vllm_lora_ext.integration.loader")
    reads = dict(loader.LOCAL_READS) if loader is not None else {"adapters": 0, "bytes": 0}
    return {"pid": os.getpid(), "rank": getattr(worker, "rank", None), "registered": _REGISTERED,
            "version": __version__, "load_adapter_patched": patched, "patches": applied(), "adapter_reads": reads}
