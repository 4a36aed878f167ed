"""The LoRA kernels' config lookups, reading the tuned tables shipped in `vllm_lora_ext.kernel_configs`.

Shrink/expand: vLLM's ``lora_shrink_op`` and ``lora_expand_op`` each call ``get_lora_op_configs`` (imported
into their own namespace) on every launch. The plugin replaces that name in those two modules only, so vLLM's
fused-MoE and fp8 LoRA kernels, which import it elsewhere, do not go through it. The replacement answers from
the shipped table for this GPU, and hands the call to vLLM's lookup when:

- the user set ``VLLM_TUNED_CONFIG_FOLDER`` (their tables win) or ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``;
- vLLM runs batch-invariant (it never uses tuned configs then);
- no table ships for this GPU, a shipped table fails its checks (logged once), or it lacks the launch's
  ``num_slices``;
- the hidden size is smaller than any the table was tuned for (see `lookup_config`).

Fused MoE: a fused-MoE LoRA layer reads tuned tables only when its context's ``use_tuned_config`` is set, which
vLLM derives from ``VLLM_TUNED_CONFIG_FOLDER`` when the layer builds the context (``_build_lora_context``);
otherwise it derives its tile configs from the base MoE GEMM's. Where the four fused-MoE tables ship for this
GPU (`kernel_configs.moe`) and fit the layer (`moe_tables_fit`: its hidden and intermediate sizes tuned, its
rank at most the largest tuned, w13's ``num_slices`` present) and the layer is not fully sharded, the context
gets ``use_tuned_config`` set, and vLLM's ``load_lora_op_config`` answers the four fused-MoE op types from the
shipped tables: vLLM's own ``get_lora_op_configs`` then reads them with its nearest-key rule. Under the same
conditions as above (a user's folder, ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``, batch-invariant mode, no valid
table), both leave vLLM's behaviour as it is.

Fused-MoE LoRA of small batches: ``PunicaWrapperGPU.add_lora_fused_moe`` runs a batch whose pairs vLLM assigns
one by one through the plugin's two kernels (`integration.moe_pairs`, [`make_add_lora_fused_moe`]) where
[`_pairs_take`] says so: no sorted token ids, not fully sharded, no offset, a CUDA tensor of bf16 or fp16, the
slots' rank at most `PAIRS_MAX_RANK`, more pairs x rank than vLLM's own small-batch kernel takes (1,024), and not
batch-invariant mode. ``VLLM_LORA_EXT_KERNEL_CONFIGS=0`` leaves every batch to vLLM, as it does the configs. In a
CUDA graph capture the path runs only where the slots' address tables exist already (made by the warm-up's
batches, outside capture); else the batch is vLLM's. The kernels read only each slot's live rank rows: every
activation writes the adapter's largest rank into its punica wrappers' table (`integration.slot_ranks`), so an r16
adapter in an engine whose ``max_lora_rank`` is 32 (for two-adapter mixes) reads 16 rows of each factor, not 32;
the rows past it are zeros, so the outputs are the same bit for bit. Where vLLM's ``supports_pdl`` allows it for its
own LoRA kernels, the two launch with programmatic dependent launch: the expand's programs start beside the
shrink and read their B before they wait for its partials (the same outputs, bit for bit).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from vllm_lora_ext.constants import kernel_configs_enabled, vllm_tuned_config_folder_set
from vllm_lora_ext.errors import KernelConfigError
from vllm_lora_ext.integration._compat import (
    LORA_OP_UTILS_MODULE,
    cuda_device_name,
    lora_kernels_batch_invariant,
    moe_lora_layer_shape,
    with_tuned_moe_configs,
)
from vllm_lora_ext.kernel_configs import file_stem, load_tables, lookup_config
from vllm_lora_ext.kernel_configs.moe import MOE_OPS, load_moe_tables, moe_tables_fit

logger = logging.getLogger(__name__)


def _shipped(load: Callable[[str], Any], what: str, *, used: str, none: str | None) -> Any:
    """This GPU's tables from ``load`` (given its file stem), or None without a GPU, without tables or where they fail
    their checks (a warning naming ``what``); logs ``used`` (or ``none``) with the GPU's name."""
    name = cuda_device_name()
    if not name:
        return None
    try:
        tables = load(file_stem(name))
    except KernelConfigError as exc:
        logger.warning("not using the shipped %s: %s", what, exc)
        return None
    if tables is not None or none is not None:
        logger.info(used if tables is not None else none, name)
    return tables


@functools.lru_cache(maxsize=1)
def _tables() -> dict[str, dict[str, Any]] | None:
    return _shipped(load_tables, "LoRA kernel configs", none="no tuned LoRA kernel configs ship for %s: vLLM's "
                    "defaults are used", used="LoRA shrink/expand kernels use the tuned configs shipped for %s "
                    "(VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's defaults)")


def _left_to_vllm() -> bool:
    """Whether vLLM's own kernel configs stand whatever ships: the user's ``VLLM_TUNED_CONFIG_FOLDER``,
    ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``, or batch-invariant mode (where vLLM never reads tuned configs)."""
    return vllm_tuned_config_folder_set() or not kernel_configs_enabled() or lora_kernels_batch_invariant()


def tuned_config(op_type: str, max_loras: int, batch: int, hidden_size: int, rank: int, num_slices: int,
                 add_inputs: bool | None = None) -> dict[str, Any] | None:
    """Return the shipped config for one shrink/expand launch, or None where vLLM's lookup should answer."""
    if op_type not in ("shrink", "expand") or _left_to_vllm():
        return None
    tables = _tables()
    if tables is None:
        return None
    if op_type == "shrink":
        return lookup_config(tables["shrink"], max_loras=max_loras, num_slices=num_slices, m=batch, k=hidden_size,
                             n=rank, hidden="k")
    return lookup_config(tables["expand_true" if add_inputs else "expand_false"], max_loras=max_loras,
                         num_slices=num_slices, m=batch, k=rank, n=hidden_size, hidden="n")


def make_get_lora_op_configs(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.lru_cache(maxsize=4096)
    def get_lora_op_configs(op_type: str, max_loras: int, batch: int, hidden_size: int, rank: int,
                            num_slices: int, add_inputs: bool | None = None,
                            moe_intermediate_size: int | None = None) -> Any:
        config = tuned_config(op_type, max_loras, batch, hidden_size, rank, num_slices, add_inputs)
        if config is not None:
            return config
        return original(op_type, max_loras, batch, hidden_size, rank, num_slices, add_inputs, moe_intermediate_size)

    return get_lora_op_configs


@functools.lru_cache(maxsize=1)
def _moe_tables() -> dict[str, dict[str, Any]] | None:
    return _shipped(load_moe_tables, "fused-MoE LoRA kernel configs", none=None,
                    used="fused-MoE LoRA kernels use the tuned configs shipped for %s where they fit the layer "
                         "(VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's own choice)")


def _shipped_moe_tables() -> dict[str, dict[str, Any]] | None:
    """The shipped fused-MoE tables, or None where vLLM's own choice should stand."""
    return None if _left_to_vllm() else _moe_tables()


def tuned_moe_context(context: Any) -> Any:
    """Return ``context`` (a fused-MoE layer's ``MoELoRAContext``) set to read tuned tables where the shipped
    ones fit its layer, else ``context`` itself."""
    shape = moe_lora_layer_shape(context)
    if shape is None or shape.tuned or shape.fully_sharded:
        return context
    tables = _shipped_moe_tables()
    if tables is None or not moe_tables_fit(tables, num_slices=shape.w13_slices, rank=shape.rank,
                                            hidden=shape.hidden, intermediate=shape.intermediate):
        return context
    return with_tuned_moe_configs(context)


def make_build_lora_context(original: Callable[..., Any]) -> Callable[..., Any]:
    def _build_lora_context(self: Any) -> Any:
        return tuned_moe_context(original(self))

    return _build_lora_context


def make_load_lora_op_config(original: Callable[..., Any]) -> Callable[..., Any]:
    """vLLM's ``get_lora_op_configs`` calls ``load_lora_op_config`` by its module name on every cache miss: the
    four fused-MoE op types get the shipped table, every other op type (and any case `_shipped_moe_tables` turns
    down) vLLM's loader, whose cache ``cache_clear`` still clears."""

    def load_lora_op_config(op_type: str, add_inputs: bool | None) -> Any:
        if op_type in MOE_OPS:
            tables = _shipped_moe_tables()
            if tables is not None:
                return tables[op_type]
        return original(op_type, add_inputs)

    load_lora_op_config.cache_clear = original.cache_clear  # type: ignore[attr-defined]
    return load_lora_op_config


PAIRS_MAX_RANK = 32  # the largest slot rank the pair path takes: at 64, vLLM's kernel was faster (r39, H200)
_VLLM_SMALL_BATCH = 1024  # vLLM runs pairs x rank up to this through its own small-batch kernel: left to it
_PAIRS_LOGGED: list[bool] = []  # the pair path's first use in this process was logged


def _pairs_fit(named: dict[str, Any]) -> bool:
    """Whether an ``add_lora_fused_moe`` call's arguments suit the pair path: vLLM's pairs assigned one by one and
    more of them than its small-batch kernel takes, not fully sharded, no offset, bf16 or fp16, rank at most
    `PAIRS_MAX_RANK`, ``x`` and A contiguous along K, and the output contiguous, as wide as the slices' N."""
    import torch  # (not at import: the CLI imports this package without torch where it can)

    x, lora_a, lora_b, y = named["x"], named["lora_a_stacked"], named["lora_b_stacked"], named["y"]
    if named["sorted_token_ids"] is not None or named.get("fully_sharded") or named.get("offset", 0):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16) or lora_a[0].dtype != x.dtype or lora_b[0].dtype != x.dtype:
        return False
    rank = lora_a[0].shape[2]
    if rank > PAIRS_MAX_RANK or named["topk_weights"].numel() * rank <= _VLLM_SMALL_BATCH:
        return False
    if x.stride(1) != 1 or lora_a[0].stride(3) != 1 or not y.is_contiguous():
        return False
    return y.shape[-1] == len(lora_a) * lora_b[0].shape[2]


def _pairs_take(named: dict[str, Any]) -> bool:
    """Whether the pair path serves this ``add_lora_fused_moe`` call: arguments that suit it ([`_pairs_fit`]) on a
    CUDA device, not batch-invariant mode, and not a CUDA graph capture that would have to make the slots' address
    tables (see the module docstring)."""
    if not named["x"].is_cuda or not _pairs_fit(named) or lora_kernels_batch_invariant():
        return False
    from vllm_lora_ext.integration.moe_pairs import pointers_ready

    return pointers_ready(named["lora_a_stacked"], named["lora_b_stacked"])


@functools.cache
def _vllm_supports_pdl() -> Callable[[], bool] | None:
    return getattr(importlib.import_module(LORA_OP_UTILS_MODULE), "supports_pdl", None)


def _pdl() -> bool:
    """Whether the pair kernels launch with programmatic dependent launch: where vLLM's own ``supports_pdl`` lets its
    fused-MoE LoRA kernels (SM90 and later, not ``VLLM_LORA_DISABLE_PDL``; vLLM caches its answer per process);
    never on a vLLM without it."""
    check = _vllm_supports_pdl()
    return bool(check is not None and check())


def make_add_lora_fused_moe(original: Callable[..., Any]) -> Callable[..., Any]:
    """Patch ``PunicaWrapperGPU.add_lora_fused_moe``: a batch the pair path takes ([`_pairs_take`]) runs
    ``moe_pairs.moe_lora_pairs``; every other call, and every call with ``VLLM_LORA_EXT_KERNEL_CONFIGS=0``, is
    vLLM's."""
    params = inspect.signature(original).parameters
    names = list(params)[1:]  # after self
    defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}

    @functools.wraps(original)
    def add_lora_fused_moe(self: Any, *args: Any, **kwargs: Any) -> Any:
        if not kernel_configs_enabled():
            return original(self, *args, **kwargs)
        named = {**defaults, **dict(zip(names, args)), **kwargs}
        if not _pairs_take(named):
            return original(self, *args, **kwargs)
        from vllm_lora_ext.integration.moe_pairs import Launch, PairRouting, moe_lora_pairs
        from vllm_lora_ext.integration.slot_ranks import rank_table

        x = named["x"]
        meta = self.token_mapping_meta.meta_args(x.size(0), self.lora_config.specialize_active_lora)
        if meta[5].item():  # no token of the batch has a LoRA (vLLM's own early return)
            return None
        if not _PAIRS_LOGGED:
            _PAIRS_LOGGED.append(True)
            logger.info("fused-MoE LoRA: small batches through the plugin's pair kernels "
                        "(VLLM_LORA_EXT_KERNEL_CONFIGS=0 for vLLM's)")
        mapping = named.get("token_lora_mapping")
        lora_a = named["lora_a_stacked"]
        routing = PairRouting(named["topk_weights"], named["expert_ids"], meta[0] if mapping is None else mapping,
                              named["adapter_enabled"], rank_table(self, lora_a[0].shape[0], x.device))
        moe_lora_pairs(named["y"], x, (lora_a, named["lora_b_stacked"]), routing,
                       mul_routed_weight=bool(named.get("mul_routed_weight")),
                       add_inputs=bool(named.get("add_inputs", True)), launch=Launch(pdl=_pdl()))
        return None

    return add_lora_fused_moe
