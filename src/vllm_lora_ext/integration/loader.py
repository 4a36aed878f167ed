"""The worker-side loader: one LoRA request -> a vLLM ``LoRAModel``, through the plugin's core.

[`load_lora_model`] is what the patched ``WorkerLoRAManager._load_adapter`` (`worker_patches`; the single place
where vLLM 0.26–0.33 turns a path into tensors) and background builds (`integration.prebuild`) run. Every adapter
source goes through here: [`build_job`] describes the running model as plain data, `building.build_adapter` (in
the build process, [`build_process`], or in this thread) resolves the source, reads, plans and checks it, so that
every key maps to a LoRA module of the running model before anything reaches vLLM (vLLM itself silently skips
modules it does not find), and [`assemble`] wraps the result in vLLM's objects. A mix's components are loaded
here too and concatenated by [`composite.compose_mix`].
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any, TypeVar

import torch

from vllm_lora_ext.constants import MIX_PREFIX, allow_unmatched_keys, drop_unapplied, mix_on_gpu, transpose_on_gpu
from vllm_lora_ext import metrics
from vllm_lora_ext._util import fmt_bytes, gc_paused
from vllm_lora_ext.errors import AdapterNotFoundError, RemoteError, VllmLoraExtError
from vllm_lora_ext.building import BuildJob, BuiltAdapter, MappedAdapter, ModuleKeys, build_adapter
from vllm_lora_ext.integration._compat import (is_first_model_rank, lora_host_memory_pinned, mla_attention_cls,
                                                moe_experts_kernel, moe_kernel_padding, pin_in_place, unstacked_mapper,
                                                validate_loaded)
from vllm_lora_ext.integration.composite import compose_mix
from vllm_lora_ext.integration.key_router import VllmKeyRouter
from vllm_lora_ext.integration.patching import IDENTITY_ATTR, TRAITS_ATTR, UNSCANNED_ATTR, UNTURNED_ATTR
from vllm_lora_ext.integration.moe import moe_targets, packed_layer
from vllm_lora_ext.planning import ModelSpec
from vllm_lora_ext.transport.cuda import bind_worker_gpu, cuda_device_in_use
from vllm_lora_ext.unapplied import TRAIT_ALIASED, TRAIT_MLA, kernel_traits, padding_traits
from vllm_lora_ext.validation import ModuleDims


logger = logging.getLogger(__name__)

_T = TypeVar("_T")


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


def model_spec(manager: Any, targets: Mapping[str, Any]) -> ModelSpec:
    """Describe the worker's model as plain data for `plan_adapter` (module names, dims, MoE blocks, limits)."""
    return ModelSpec(
        accepted=frozenset(expected_module_names(manager)), dims=module_dims(manager),
        moe={p: t.spec for p, t in targets.items()}, local_experts={p: t.local_experts for p, t in targets.items()},
        max_rank=int(manager.lora_config.max_lora_rank),
        pooling=bool(getattr(manager._adapter_manager, "is_pooling_model", False)),
        traits=model_traits(manager), drop_unapplied=drop_unapplied(),
        packed={name: tuple(parts) for name, parts in manager._adapter_manager.packed_modules.items()
                if name not in targets})  # (an MoE block's "parts" are its experts: planned as a block)


def model_traits(manager: Any) -> dict[str, str]:
    """Return the traits of the worker's model that decide whether vLLM applies a LoRA (see `unapplied`).

    ``mla``: the model holds vLLM's MLA attention layers (what ``model_config.use_mla`` builds; they fold
    ``kv_b_proj`` into ``W_UK``/``W_UV``). ``moe_kernel_drops_lora`` / ``moe_kernel_misapplies_lora``: an MoE block
    runs an experts kernel that accepts LoRA and never applies it (`unapplied.kernel_traits`), or one that
    runs the experts at a padded intermediate size the LoRA buffers do not have (`unapplied.padding_traits`).
    Worked out once per model (the model does not change).
    """
    adapter_manager = manager._adapter_manager
    found: dict[str, str] | None = adapter_manager.__dict__.get(TRAITS_ATTR)
    if found is not None:
        return found
    found = {}
    mla, model = mla_attention_cls(), getattr(adapter_manager, "model", None)
    if mla is not None and isinstance(model, torch.nn.Module) and any(isinstance(m, mla) for m in model.modules()):
        found[TRAIT_MLA] = type(model).__name__
    aliased = bypassed_wrappers(model, adapter_manager.modules) if isinstance(model, torch.nn.Module) else []
    if aliased:
        found[TRAIT_ALIASED] = f"{type(model).__name__} (e.g. {aliased[0]})"
    modules = adapter_manager.modules.values()
    found.update(kernel_traits(k for m in modules if (k := moe_experts_kernel(m)) is not None))
    found.update(padding_traits(p for m in modules if (p := moe_kernel_padding(m)) is not None))
    adapter_manager.__dict__[TRAITS_ATTR] = found
    return found


def bypassed_wrappers(model: torch.nn.Module, wrapped: Mapping[str, Any]) -> list[str]:
    """Return ``"<alias> is <name>"`` for every LoRA-wrapped module whose base layer the model still holds under
    another attribute: vLLM swaps the wrapper in under one name only, so a forward that goes through the other
    (Qwen2-MoE's ``shared_expert.expert_gate``) calls the base layer and never applies the LoRA."""
    base_of = {id(m.base_layer): name for name, m in wrapped.items() if isinstance(getattr(m, "base_layer", None),
                                                                                      torch.nn.Module)}
    wrappers = {id(m) for m in wrapped.values()}
    found = []
    for parent_name, parent in model.named_modules(remove_duplicate=False):
        if id(parent) in wrappers:
            continue  # the wrapper's own base_layer
        for attr, child in parent._modules.items():
            name = base_of.get(id(child)) if child is not None else None
            if name is not None:
                found.append(f"{parent_name}.{attr} is {name}".lstrip("."))
    return sorted(found)


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


def load_lora_model(manager: Any, lora_request: Any, *, separate_process: bool = False, device: Any = None,
                    scan_moe: bool = True, finish: Callable[[Any], None] | None = None) -> Any:
    """Build the ``LoRAModel`` for ``lora_request`` on the worker that owns ``manager``.

    With ``separate_process``, an adapter (or each component of a mix not cached yet) is read and packed
    by a build process ([`build_process`]), and only wrapped in vLLM's objects here. With a CUDA ``device``
    (background builds; in the step the manager's, unless ``VLLM_LORA_EXT_MIX_ON_GPU=0``), a mix is
    concatenated on that GPU, staged for its slot copy. With ``scan_moe=False``, an adapter's MoE factors are not
    scanned for NaN/inf while read; the model then carries ``UNSCANNED_ATTR``, and the caller must scan it
    (``integration.staging.refuse_nonfinite``) before it is served, in ``finish`` (run on the model inside the
    load's count and time: a refusal there is a rejected load). A mix's components are always scanned.

    Raises:
        vLLM's ``LoRAAdapterNotFoundError``: the source does not exist (the server answers 404).
        [`AdapterSourceError`], [`AdapterFormatError`], [`UnmatchedKeysError`], [`AdapterCompatibilityError`]:
            the adapter cannot be served on this model, with the reason and the fix.
    """
    if not scan_moe and finish is None:
        raise ValueError("load_lora_model(scan_moe=False) needs the finish= that scans the model before it is served")

    def load_mix() -> Any:
        nonlocal device
        if device is None and mix_on_gpu():  # loaded in the step: the GPU too, unless turned off
            device = getattr(manager, "device", None)
        lora = build_composite(manager, lora_request, separate_process=separate_process, device=device)
        setattr(lora, IDENTITY_ATTR, lora_request.lora_path)
        return lora

    def load_adapter() -> Any:
        return _load_adapter_model(manager, lora_request, separate_process=separate_process, scan_moe=scan_moe)

    mix = lora_request.lora_path.startswith(MIX_PREFIX)
    load = load_mix if mix else load_adapter

    def load_finished() -> Any:
        lora = load()
        if finish is not None:
            finish(lora)
        return lora

    return _counted(manager, "mix" if mix else "adapter", load_finished)


def load_component(manager: Any, name: str, source: str, *, separate_process: bool = False) -> MappedAdapter:
    """Build the adapter at ``source`` as one component of a mix: as core data, never wrapped in a ``LoRAModel``.

    The same build, checks and counts as [`load_lora_model`]'s for an adapter; see [`map_component`].
    """
    from vllm.lora.request import LoRARequest

    request = LoRARequest(lora_name=name, lora_int_id=1, lora_path=source)
    return _counted(manager, "adapter", lambda: _load_adapter_model(manager, request, separate_process=separate_process,
                                                                    component=True))


def _counted(manager: Any, kind: str, load: Callable[[], _T]) -> _T:
    """Run ``load`` with the worker's GPU bound and the collector paused, and count it in the load metrics."""
    t0 = time.perf_counter()
    try:
        bind_worker_gpu(getattr(manager, "device", None))  # a helper thread's host memory is pinned for this GPU too
        with gc_paused():  # an MoE adapter makes ~10^5 small objects: no full-heap collections meanwhile
            result = load()
    except Exception as err:
        _record_load(kind, _outcome(err), t0, err)
        raise
    _record_load(kind, "ok", t0)
    return result


def build_composite(manager: Any, lora_request: Any, *, separate_process: bool = False, device: Any = None) -> Any:
    """Load every component of the mix in ``lora_request.lora_path`` and concatenate them along rank.

    Components not cached yet are built through [`load_component`] at the same time; with ``separate_process``,
    by the worker's build process. The composite is built by [`composite.compose_mix`] (on ``device``
    where it is a GPU).

    Raises:
        [`MixError`]: a malformed mix path.
        [`AdapterCompatibilityError`]: a module's summed rank exceeds ``max_lora_rank`` (names the ranks).
        [`AdapterFormatError`]: a weighted factor overflows to infinity (names the module).
    """

    def load(name: str, source: str) -> MappedAdapter:
        return load_component(manager, name, source, separate_process=separate_process)

    return compose_mix(manager, lora_request, load=load, device=device)


def _outcome(err: BaseException) -> str:
    from vllm.exceptions import LoRAAdapterNotFoundError

    if isinstance(err, (AdapterNotFoundError, LoRAAdapterNotFoundError)):
        return "not_found"
    return "rejected" if isinstance(err, VllmLoraExtError) and not isinstance(err, RemoteError) else "error"


# What this process's loads read (adapters built, bytes of weights read): worker_state reports it per worker,
# so an expert-parallel run shows that each rank read only its own experts' bytes.
LOCAL_READS: dict[str, int] = {"adapters": 0, "bytes": 0}
_READS_LOCK = threading.Lock()


def _record_load(kind: str, outcome: str, t0: float, err: BaseException | None = None) -> None:
    if not is_first_model_rank():
        return
    metrics.ADAPTER_LOADS.inc(kind=kind, outcome=outcome)
    if outcome == "ok":
        metrics.ADAPTER_LOAD_SECONDS.observe(time.perf_counter() - t0, kind=kind)
    if err is not None:
        metrics.record_error(err, where="worker")


def build_job(manager: Any, lora_request: Any) -> tuple[BuildJob, VllmKeyRouter]:
    """Describe ``lora_request``'s build on this worker as plain data, and the key router vLLM's parser gives."""
    model = manager._adapter_manager.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    if mapper is not None:
        mapper = unstacked_mapper(mapper)
    moe_error = None
    try:
        targets = moe_targets(manager)
    except VllmLoraExtError as err:  # only an error if the adapter has MoE keys
        targets, moe_error = {}, str(err)
    dtype = manager.lora_config.lora_dtype
    job = BuildJob(path=str(lora_request.lora_path), name=str(lora_request.lora_name),
                   model=model_spec(manager, targets), wrappers={p: t.wrapper for p, t in targets.items()},
                   moe_error=moe_error, dtype=dtype if isinstance(dtype, torch.dtype) else None,
                   allow_unmatched=allow_unmatched_keys())
    return job, VllmKeyRouter(mapper, getattr(model, "lora_skip_prefixes", None))


def assemble(manager: Any, lora_request: Any, built: BuiltAdapter, router: VllmKeyRouter) -> Any:
    """Wrap a built adapter's tensors in vLLM's ``LoRAModel`` (dense modules through vLLM's own
    ``from_lora_tensors``, with the mapper and skipped prefixes ``router`` parsed the keys with; MoE
    blocks as the packed weights vLLM's wrappers take, scaling folded)."""
    _pin_host(built)
    lora = _wrap(manager, lora_request, built, router, built.dense, device="cpu")
    setattr(lora, IDENTITY_ATTR, lora_request.lora_path)
    _count_read(built)
    return lora


def map_component(manager: Any, lora_request: Any, built: BuiltAdapter, router: VllmKeyRouter) -> MappedAdapter:
    """Name a built adapter's dense modules as the model does, for a mix: [`assemble`]'s work, kept as core data.

    vLLM's ``from_lora_tensors`` runs, as in [`assemble`], on shape-only stand-ins of the dense factors: its key
    parsing, skipped keys, scaling and checks say which keys make which module (each stand-in is found again by
    identity), and the factors are converted as it converts them ([`_lora_cpu_tensor`]).
    """
    _pin_host(built)
    stand_ins = {k: torch.empty(t.shape, dtype=t.dtype, device="meta") for k, t in built.dense.items()}
    lora = _wrap(manager, lora_request, built, router, stand_ins, device="meta")
    key_of = {id(t): k for k, t in stand_ins.items()}
    modules = {name: ModuleKeys(key_of[id(w.lora_a)], key_of[id(w.lora_b)], float(w.scaling))
               for name, w in lora.loras.items() if name not in built.moe}
    used = {k for m in modules.values() for k in (m.key_a, m.key_b)}
    dtype = manager.lora_config.lora_dtype
    dense = {k: _lora_cpu_tensor(t, dtype) for k, t in built.dense.items() if k in used}
    _count_read(built)
    return MappedAdapter(replace(built, dense=dense), modules)


def _lora_cpu_tensor(t: torch.Tensor, dtype: Any) -> torch.Tensor:
    """``t`` as ``from_lora_tensors`` keeps a factor on ``"cpu"`` (0.26-0.33): in ``dtype``, then pinned where vLLM
    pins LoRA memory ([`lora_host_memory_pinned`]; memory pinned already stays where it is)."""
    out = t.to(device="cpu", dtype=dtype)
    return out.pin_memory() if lora_host_memory_pinned() else out


def _pin_host(built: BuiltAdapter) -> None:
    if built.host is not None:  # pinned where it lies, before vLLM looks (it copies what is not pinned)
        if not pin_in_place(built.host) and lora_host_memory_pinned() and not _UNPINNED:
            _UNPINNED.append(True)  # once a process
            logger.warning("an adapter's host memory (%s) could not be page-locked in place (no CUDA context on "
                           "this thread, or the driver refused): vLLM copies its factors into pinned memory when it "
                           "adds the adapter, or its slot copy reads pageable memory", fmt_bytes(built.host.used))
        built.host.close()


_UNPINNED: list[bool] = []


def _wrap(manager: Any, lora_request: Any, built: BuiltAdapter, router: VllmKeyRouter,
          tensors: dict[str, torch.Tensor], *, device: str) -> Any:
    """vLLM's ``LoRAModel`` of ``tensors`` (``built.dense`` or stand-ins of it on ``"meta"``) and ``built``'s MoE
    blocks, with vLLM's checks."""
    from vllm.lora.peft_helper import PEFTHelper

    raw = dict(built.config.raw)
    raw["vllm_max_position_embeddings"] = manager.max_position_embeddings
    peft_helper = PEFTHelper.from_dict(raw)
    peft_helper.validate_legal(manager.lora_config)  # after our checks, whose messages name the fix
    lora = manager._lora_model_cls.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id,
        tensors=tensors,
        peft_helper=peft_helper,
        device=device,
        dtype=manager.lora_config.lora_dtype if device == "cpu" else None,  # stand-ins stay themselves
        model_vocab_size=manager.vocab_size,
        weights_mapper=router.mapper,
        skip_prefixes=router.skip_prefixes,
    )
    config = built.config
    if config.has_patterns:  # vLLM 0.26 gives every module the global r/alpha: apply PEFT's per-module rules
        peft_names = peft_module_names(tensors, router)
        for module_name, weights in lora.loras.items():
            rank = int(weights.lora_a.shape[0])
            weights.rank, weights.scaling = rank, config.scaling_for(peft_names.get(module_name, module_name), rank)
    for prefix, (lora_a, lora_b, need) in built.moe.items():
        lora.loras[prefix] = packed_layer(prefix, lora_a, lora_b, need)
    lora.is_3d_lora_weight = lora_request.is_3d_lora_weight
    validate_loaded(manager._adapter_manager, lora)
    return lora


def peft_module_names(keys: Any, router: VllmKeyRouter) -> dict[str, str]:
    """The name PEFT matched ``rank_pattern``/``alpha_pattern`` against, by the module name vLLM gives each key.

    PEFT matches the patterns against the trained model's module names: the key's, without ``base_model.model.``,
    before the model's ``hf_to_vllm_mapper`` renames it (``model.language_model.layers.0...`` of a vision-language
    model is vLLM's ``language_model.model.layers.0...``; vLLM 0.33 matches the same names). Empty without a mapper.
    """
    from vllm.lora.utils import parse_fine_tuned_lora_name

    if router.mapper is None:
        return {}
    out: dict[str, str] = {}
    for key in keys:
        module = router.module(key)
        if module is None or module in out:
            continue
        try:
            out[module] = str(parse_fine_tuned_lora_name(key)[0])
        except ValueError:
            continue
    return out


def _count_read(built: BuiltAdapter) -> None:
    metrics.ADAPTER_BYTES_READ.inc(built.bytes_read)
    with _READS_LOCK:  # a mix's components are built on several threads
        LOCAL_READS["adapters"] += 1
        LOCAL_READS["bytes"] += built.bytes_read


def _load_adapter_model(manager: Any, lora_request: Any, *, separate_process: bool = False,
                        component: bool = False, scan_moe: bool = True) -> Any:
    """Build ``lora_request``'s adapter, then wrap it ([`assemble`]), or map it ([`map_component`]) for a mix."""
    from vllm.exceptions import LoRAAdapterNotFoundError

    t0 = time.perf_counter()
    job, router = build_job(manager, lora_request)
    if not scan_moe and not component:  # (a build process then leaves a fused 3D B for the GPU to turn once staged)
        job = replace(job, scan_moe=False, defer_turn=separate_process and transpose_on_gpu())
    t_job = time.perf_counter()
    try:
        found = None
        if separate_process:
            from vllm_lora_ext.integration.build_process import build_elsewhere

            found = build_elsewhere(job, router, wait_for_start=False)  # the tensors keep the shared mapping alive
            if found is None:
                logger.info("adapter %r: no build process has finished starting; building in this thread",
                            lora_request.lora_name)
        built = found[0] if found is not None else build_adapter(job, router, transpose_on=_gpu_of(manager))
        if separate_process and found is None:  # a build process still starting plans it ahead, for the next
            from vllm_lora_ext.integration.build_process import plan_ahead

            plan_ahead(job, router)
    except AdapterNotFoundError as err:  # vLLM's not-found error, with our message: the server answers 404
        raise _not_found(LoRAAdapterNotFoundError, lora_request, err) from err
    t_built = time.perf_counter()
    lora = (map_component if component else assemble)(manager, lora_request, built, router)
    if not built.moe_scanned:
        setattr(lora, UNSCANNED_ATTR, True)
    if built.unturned:  # ([] when they were turned where they were built)
        setattr(lora, UNTURNED_ATTR, [(built.moe[prefix][1][i], rows, cols, scale)
                                      for prefix, parts in built.unturned.items() for i, rows, cols, scale in parts])
    now = time.perf_counter()
    modules = len(lora.modules) + len(built.moe) if component else len(lora.loras)
    _log_loaded(built, modules, lora_request, now - t0,
                f"describing the model {t_job - t0:.2f} s, building {t_built - t_job:.2f} s"
                f"{' (build process)' if found is not None else ''}"
                f"{', its header and plan kept from an earlier adapter' if built.plan_kept else ''}, wrapping "
                f"{now - t_built:.2f} s")
    return lora


def _gpu_of(manager: Any) -> torch.device | None:
    """The worker's GPU, for a build in this process to transpose 3D factors on (unless turned off)."""
    return cuda_device_in_use(getattr(manager, "device", None)) if transpose_on_gpu() else None


def _log_loaded(built: BuiltAdapter, modules: int, lora_request: Any, seconds: float, phases: str) -> None:
    turned = f", {built.turned_on_gpu} 3D factors transposed on the GPU" if built.turned_on_gpu else ""
    logger.info("loaded adapter %r from %s: rank %d, %d modules (%d MoE blocks: %s), %.1f MiB read%s, %.2f s (%s)",
                lora_request.lora_name, built.identity, built.config.r, modules, len(built.moe),
                ",".join(built.layouts) or "-", built.bytes_read / 2**20, turned, seconds, phases)


def _not_found(exc_type: type[Exception], lora_request: Any, err: Exception) -> Exception:
    # vLLM's server maps an error whose text contains its own not-found message to HTTP 404;
    # keep that text and add ours, which names the fix.
    base = exc_type(lora_request.lora_name, lora_request.lora_path)
    base.message = f"{base}. {err.client_message() if hasattr(err, 'client_message') else err}"  # type: ignore[attr-defined]
    return base
