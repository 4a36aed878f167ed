"""Compile the fused-MoE LoRA Triton kernels while the engine starts, so no request pays for it.

vLLM (0.26-0.33) warms a model up in ``Worker.compile_or_warm_up_model``: dummy forward passes for the
compile sizes, then (without ``enforce_eager``) CUDA graph capture. Those warm-up passes run with
``num_active_loras=0``, and the punica wrapper's ``add_lora_fused_moe`` returns before launching anything when
no token has a LoRA (``no_lora_flag``). So the fused-MoE LoRA kernels (``_fused_moe_lora_*_kernel`` in
``vllm/lora/ops/triton_ops/fused_moe_lora_op.py``) are compiled only where graph capture runs them with dummy
LoRAs, for the capture sizes; an eager engine, and every eager (uncaptured) batch of a graph engine, compiles
them inside the first step that carries an MoE adapter, pausing every request in flight for seconds.

Which compiled variant a launch needs depends on the batch's token count N: the small-batch, naive and sorted
paths, the block size ``BLOCK_M`` picked for it, and Triton's specialisation of integer arguments on being 1 or
divisible by 16. vLLM 0.26-0.33's one-shot kernel specialises three counts that move with N: ``N·top_k``, the
padded sorted length ``N·top_k + E·(BLOCK_M-1)`` and that over ``BLOCK_M``. The last is divisible by 16 only in
narrow windows (N from 2·BLOCK_M·j + 17 - BLOCK_M/8 to 2·BLOCK_M·j + 16), which 2^k-like counts miss (N = 2,050
needs a variant that 2,048 and 2,049 do not compile). The adapter count changes no kernel key unless
``LoRAConfig.specialize_active_lora`` is on (otherwise the kernels see the constant ``max_loras + 1``). The LoRA rank the kernels see is the stacked ``max_lora_rank`` and the slot count
``max_loras``, both fixed at start-up; so dummy forward passes with dummy LoRAs, run through vLLM's own
``_dummy_run``, compile exactly what requests will launch. This runs them, before
vLLM's own warm-up (the KV cache exists, nothing is captured or locked yet), for:

- every token count from 1 to ``max_num_seqs`` or 64, whichever is less: the common decode batches;
- 2^k and 3·2^(k-1) above that, each plus 0, 1, 15, 16 and 17, then ``max_num_seqs`` and ``max_num_batched_tokens``:
  larger decode and prefill batches, one in and around each divisibility window of each block size (a replay of
  vLLM 0.26's launch arithmetic for the Qwen3-30B-A3B shape finds every kernel key of every N up to 16,384 in
  these, for 1-16 slots and ranks 16-64; ``tests/integration/test_moe_warmup.py`` keeps that replay);
- one count for each kernel variant of this model's shape that those miss ([`shape_token_counts`],
  `integration.warmup_sweep`): the windows move with the expert count and top-k (for 8 experts and top-2, batches of
  36, 60, 84, 140 and 148 tokens compiled in the step on an H200 after the fixed sweep, r43). Counts named in
  ``VLLM_LORA_EXT_MOE_WARMUP_TOKENS`` replace all of these;
- with ``max_loras`` dummy adapters (at most one per token), or, with ``specialize_active_lora``, with 1, 2 and
  ``max_loras`` (the kernels then key on the count, rounded up to the captured counts). Known limit: vLLM rounds
  to its captured counts (powers of two and ``max_loras + 1``), so a batch of 3-4 adapters, or of every slot plus
  base-model tokens, can still compile a variant of its own in its step; the replay does not model those counts.
  With data parallelism the fixed sweep runs alone (the kernels see tokens gathered over the ranks).

Each dummy batch also computes its logits while its dummy LoRAs are active, when the model's logits processor is
wrapped for LoRA (``LogitsProcessorWithLoRA``: every LoRA model's is). vLLM computes logits in no warm-up pass with
a LoRA active (dummy runs stop at the hidden states; the sampler warm-up runs without LoRA), and the LoRA logits
path launches the dense ``_lora_shrink_kernel`` and ``_lora_expand_kernel`` over the vocabulary with a block config
of its own, so without this they would compile in the first step that carries an adapter. Only with one tensor- and
one pipeline-parallel rank: there the logits involve no collective, so a failure is logged once and leaves the rest
of the warm-up running (with several ranks the logits are gathered onto rank 0 and the LoRA part runs there alone; a
failure on one rank would leave the others in a gather it never joins).

``VLLM_LORA_EXT_MOE_WARMUP=0`` turns it off; ``VLLM_LORA_EXT_MOE_WARMUP_TOKENS=1,2,48`` names the token counts
instead. It runs only with LoRA enabled and a model with fused-MoE LoRA layers; anything else is untouched.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

from vllm_lora_ext.constants import moe_warmup_enabled, moe_warmup_tokens
from vllm_lora_ext.integration._compat import moe_lora_block_m, runner_dummy_runs_with_loras
from vllm_lora_ext.integration.warmup_sweep import MoEOpShape, MoESweepShape, token_counts_for_keys

logger = logging.getLogger(__name__)

MOE_LORA_LAYER_CLASSES = ("FusedMoEWithLoRA", "FusedMoE3DWithLoRA")
MOE_LORA_OP_MODULE = "vllm.lora.ops.triton_ops.fused_moe_lora_op"
# every LoRA Triton kernel module a serving step launches from: the fused-MoE ones, then punica's dense shrink/expand
LORA_OP_MODULES = (MOE_LORA_OP_MODULE, "vllm.lora.ops.triton_ops.lora_shrink_op",
                   "vllm.lora.ops.triton_ops.lora_expand_op")
LOGITS_LORA_CLASS = "LogitsProcessorWithLoRA"
_MAX_DECODE_SWEEP = 64
_OFFSETS = (0, 1, 15, 16, 17)  # around each divisibility-by-16 window of the one-shot kernel (module docstring)


def warmup_token_counts(max_num_seqs: int, max_num_tokens: int) -> list[int]:
    """Return the batch token counts the warm-up runs, ascending and at most ``max_num_tokens``.

    Example:
        >>> warmup_token_counts(4, 40)
        [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 16, 17, 19, 20, 21, 22, 23, 24, 25, 27, 28, 29, 31, 32, 33, 39, 40]
    """
    top = max(1, max_num_tokens)
    counts = set(range(1, min(max_num_seqs, _MAX_DECODE_SWEEP, top) + 1)) | {min(max(1, max_num_seqs), top)}
    k = 2
    while 2**k <= top:
        for n in (2**k, 3 * 2 ** (k - 1)):
            counts.update(n + d for d in _OFFSETS if n + d <= top)
        k += 1
    counts.add(top)
    return sorted(counts)


def warmup_lora_counts(max_loras: int, specialize_active_lora: bool = False) -> list[int]:
    """Return the distinct-adapter counts the warm-up runs each token count with.

    Example:
        >>> warmup_lora_counts(16), warmup_lora_counts(16, True), warmup_lora_counts(1, True)
        ([16], [1, 2, 16], [1])
    """
    if not specialize_active_lora:
        return [max(1, max_loras)]
    return sorted({n for n in (1, 2, max_loras) if 1 <= n <= max_loras})


def has_moe_lora_layers(model: Any) -> bool:
    """Return whether ``model`` holds a fused-MoE layer wrapped for LoRA."""
    modules = getattr(model, "modules", None)
    if modules is None:
        return False
    return any(cls.__name__ in MOE_LORA_LAYER_CLASSES for m in modules() for cls in type(m).__mro__)


def warm_up_moe_lora(runner: Any) -> int:
    """Run the dummy LoRA batches that compile the fused-MoE LoRA kernels; return how many ran (0: nothing to do).

    ``runner`` is vLLM's GPU model runner after the KV cache is allocated. Does nothing without LoRA, without
    fused-MoE LoRA layers, or with ``VLLM_LORA_EXT_MOE_WARMUP=0``.
    """
    lora_config = getattr(runner, "lora_config", None)
    if lora_config is None or not moe_warmup_enabled():
        return 0
    if not has_moe_lora_layers(runner.get_model()):
        return 0
    if not runner_dummy_runs_with_loras(runner):
        logger.warning("not warming up the fused-MoE LoRA kernels: %s._dummy_run does not take dummy LoRAs here; "
                       "the first MoE adapter request compiles them in its step", type(runner).__name__)
        return 0
    from vllm.config import CUDAGraphMode

    max_tokens = int(runner.max_num_tokens)
    named = moe_warmup_tokens()
    tokens = named or warmup_token_counts(int(runner.max_num_reqs), max_tokens)
    tokens = [n for n in tokens if 1 <= n <= max_tokens]
    specialize = bool(getattr(lora_config, "specialize_active_lora", False))
    loras = warmup_lora_counts(int(lora_config.max_loras), specialize)
    if not named:  # and one batch for each kernel variant of this model's shape the sweep above does not reach
        grids = loras if specialize else [int(lora_config.max_loras) + 1]
        tokens = sorted(set(tokens) | set(shape_token_counts(runner, tokens, grids, max_tokens)))
    before = sum(lora_kernel_variants().values())
    logits = _LogitsWarmUp(runner)
    t0 = time.perf_counter()
    runs = 0
    try:
        for n_tokens in tokens:
            for n_loras in sorted({min(n, n_tokens) for n in loras}):  # a batch of n tokens holds <= n adapters
                out = runner._dummy_run(n_tokens, cudagraph_runtime_mode=CUDAGraphMode.NONE, skip_eplb=True,
                                        remove_lora=False, num_active_loras=n_loras)
                logits.run(out)
                runs += 1
    finally:
        runner.maybe_remove_all_loras(lora_config)
    compiled = sum(lora_kernel_variants().values()) - before
    logger.info("LoRA kernels warmed up: %d dummy batches (%d token counts x up to %d adapters, logits %s), "
                "%d kernel variants compiled, %.1f s (VLLM_LORA_EXT_MOE_WARMUP=0 skips this)", runs, len(tokens),
                len(loras), logits.state, compiled, time.perf_counter() - t0)
    return runs


def shape_token_counts(runner: Any, covered: Sequence[int], grid_loras: Sequence[int], max_tokens: int) -> list[int]:
    """The token counts, up to ``max_tokens``, of the fused-MoE LoRA kernel variants of this model's shape that the
    counts in ``covered`` do not reach (`integration.warmup_sweep`); none where the first MoE LoRA layer cannot
    be read (logged: the fixed sweep still runs)."""
    data_parallel = getattr(getattr(runner, "parallel_config", None), "data_parallel_size", 1)
    if isinstance(data_parallel, int) and data_parallel > 1:  # the kernels then see tokens gathered over ranks
        logger.info("fused-MoE LoRA warm-up: the fixed sweep alone with data parallelism (%d ranks)", data_parallel)
        return []
    try:
        shape, block_m = _sweep_shape(runner)
        found = token_counts_for_keys(shape, max_tokens, functools.lru_cache(maxsize=None)(block_m), grid_loras,
                                      covered=covered)
    except Exception as exc:  # a warm-up never stops the engine from starting
        logger.warning("fused-MoE LoRA warm-up: this model's kernel variants not worked out (%s: %s); the fixed "
                       "sweep runs alone", type(exc).__name__, str(exc)[:200])
        return []
    if found:
        logger.info("fused-MoE LoRA warm-up: %d more token counts for kernel variants of this model's shape: %s",
                    len(found), found)
    return found


def _sweep_shape(runner: Any) -> tuple[MoESweepShape, Callable[[int, int], int]]:
    """The first fused-MoE LoRA layer of ``runner``'s model as the kernels see it, and its block-size lookup."""
    import torch

    from vllm_lora_ext.constants import kernel_configs_enabled
    from vllm_lora_ext.integration.kernels import PAIRS_MAX_RANK

    layer = next(m for m in runner.get_model().modules()
                 if any(cls.__name__ in MOE_LORA_LAYER_CLASSES for cls in type(m).__mro__))
    context = layer._build_lora_context()  # as set_mapping builds it (the plugin's tuned-table choice included)
    a13, b13 = context.w13_lora_a_stacked[0], context.w13_lora_b_stacked[0]
    a2, b2 = context.w2_lora_a_stacked[0], context.w2_lora_b_stacked[0]
    experts = int(context.local_num_experts)  # a shared A (one expert) is expanded to these before the kernel
    ops = (MoEOpShape(int(a13.shape[3]), int(b13.shape[2]), int(context.w13_num_slices), experts, False),
           MoEOpShape(int(a2.shape[3]), int(b2.shape[2]), 1, experts, True))
    ep = bool(getattr(layer, "use_ep", False))
    shape = MoESweepShape(ops, top_k=int(context.top_k), local_experts=int(context.local_num_experts),
                          kernel_experts=int(layer.global_num_experts if ep else context.local_num_experts),
                          expert_map=ep, fully_sharded=bool(context.fully_sharded), max_loras=int(a13.shape[0]),
                          rank=int(a13.shape[2]), sms=torch.cuda.get_device_properties(a13.device).multi_processor_count,
                          pairs_max_rank=PAIRS_MAX_RANK if kernel_configs_enabled() else 0)
    return shape, moe_lora_block_m(context, layer, runner.model_config.dtype)


class _LogitsWarmUp:
    """Compute each dummy batch's logits while its dummy LoRAs are active (see the module docstring)."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        model = runner.get_model()
        wrapped = any(cls.__name__ == LOGITS_LORA_CLASS for m in model.modules() for cls in type(m).__mro__)
        parallel = getattr(runner, "parallel_config", None)
        ranks = (getattr(parallel, "tensor_parallel_size", 1), getattr(parallel, "pipeline_parallel_size", 1))
        self.state = ("not wrapped for LoRA" if not wrapped else "not with tensor or pipeline parallelism"
                      if ranks != (1, 1) else "included")

    def run(self, out: Any) -> None:
        if self.state != "included" or not isinstance(out, tuple) or len(out) != 2:
            return
        import torch

        if not isinstance(out[1], torch.Tensor):
            return
        try:  # the last token of each dummy request, as a step samples it; values are irrelevant to what compiles
            with torch.inference_mode():
                self.runner.model.compute_logits(out[1])
        except Exception as err:  # a warm-up never stops the engine from starting
            self.state = f"skipped ({type(err).__name__}: {str(err)[:200]})"
            logger.warning("not warming up the LoRA logits kernels (%s); the first adapter request compiles them "
                           "in its step", self.state)


# The modules a worker's first adapter load imports (the loader and what it reads with, staging, the activation
# plan, the build process's client, the residency gauge): about 0.1 s on the dev VM, paid by the first add_lora.
LOAD_PATH_MODULES = ("vllm_lora_ext.integration.loader", "vllm_lora_ext.integration.prebuild",
                     "vllm_lora_ext.integration.staging", "vllm_lora_ext.integration.activation",
                     "vllm_lora_ext.integration.build_process", "vllm_lora_ext.integration.resident",
                     "vllm_lora_ext.integration.composite", "vllm_lora_ext.resolve")


def import_load_path(runner: Any) -> float:
    """Import the adapter load path in a LoRA worker while it starts (not in its first ``add_lora``), start the
    threads its first read lends (``transport.pools.start_pools``), index its LoRA manager's packed parts for
    the merge (``worker_patches.index_packed_parts``) and work out the model's traits (``loader.model_traits``);
    return the seconds it took (0 without LoRA)."""
    if getattr(runner, "lora_config", None) is None:
        return 0.0
    import importlib

    from vllm_lora_ext.integration._compat import runner_adapter_manager

    from vllm_lora_ext._util import usable_cores
    from vllm_lora_ext.formats.moe_read import read_pools
    from vllm_lora_ext.transport.pools import start_pools

    t0 = time.perf_counter()
    for name in LOAD_PATH_MODULES:
        importlib.import_module(name)
    start_pools(read_pools(usable_cores()))  # the first build's read and scan threads, ready
    manager = runner_adapter_manager(runner)
    if manager is not None:
        from vllm_lora_ext.integration.loader import model_traits
        from vllm_lora_ext.integration.worker_patches import index_packed_parts

        index_packed_parts(manager)
        try:  # worked out once per model: here rather than in the first adapter's load (5 ms profiled there, r40)
            model_traits(runner.lora_manager)
        except Exception as exc:  # the first load works them out, and says what is wrong, instead
            logger.debug("model traits left to the first load: %s", exc)
    return time.perf_counter() - t0


def make_compile_or_warm_up_model(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        runner = getattr(self, "model_runner", None)
        if runner is not None:
            seconds = import_load_path(runner)
            if seconds:
                logger.info("adapter load path imported in %.3f s", seconds)
            warm_up_moe_lora(runner)
        return original(self, *args, **kwargs)

    return compile_or_warm_up_model


def _jit_function(obj: Any) -> Any:
    """The ``triton.JITFunction`` under autotuner/heuristics wrappers (each keeps the wrapped one as ``.fn``)."""
    for _ in range(8):
        if hasattr(obj, "device_caches") or hasattr(obj, "cache") and isinstance(getattr(obj, "cache"), dict):
            return obj
        obj = getattr(obj, "fn", None)
        if obj is None:
            return None
    return None


def _variants(jit: Any) -> int:
    # Triton >= 3.2 keeps (kernel_cache, ...) per device in device_caches; older Triton keeps cache[device].
    caches = getattr(jit, "device_caches", None)
    if isinstance(caches, dict):
        return sum(len(entry[0]) for entry in caches.values() if isinstance(entry, Sequence) and entry
                   and isinstance(entry[0], dict))
    return sum(len(c) for c in getattr(jit, "cache", {}).values() if isinstance(c, dict))


def lora_kernel_variants(worker: Any = None, modules: Sequence[str] = LORA_OP_MODULES) -> dict[str, int]:
    """Count the compiled variants of each LoRA Triton kernel (fused-MoE, dense shrink and expand) in this process.

    Use ``llm.collective_rpc(lora_kernel_variants)`` to ask every worker; a count that grows while a request runs
    means that request compiled a kernel in the engine step. Empty before vLLM imports the kernels' modules.
    """
    out = {}
    for module_name in modules:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in sorted(vars(module)):
            if "kernel" not in name:
                continue
            jit = _jit_function(getattr(module, name))
            if jit is not None:
                out[name] = _variants(jit)
    return out
