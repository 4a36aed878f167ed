"""Activation ahead: a staged adapter's slot writes, worked out on the build's thread, done in a few batched calls
in the step.

vLLM's ``activate_adapter`` runs in the engine step and calls ``set_lora`` (or ``reset_lora``) of every LoRA
module: for 48 layers of a Qwen3-30B-A3B-shaped model, 192 modules and about 1,400 tensor writes (each slot zeroed,
then the factors copied in), one Python call and one kernel launch each. On an H200 that took 0.016 s on an idle
engine and 0.033-0.041 s while 32 requests decoded: the longest pause those requests saw when a new adapter arrived
(``bench/bench_no_stall.py``, round 29).

For a model a background build staged on the GPU and merged ahead (``integration.prebuild``), [`plan_activation`]
runs vLLM's own ``set_lora``/``reset_lora`` of each module on the build's thread, under a recorder that writes
nothing: it notes each write's destination (a view of slot ``s``, and the slot dimension's stride), its value or
source. [`activate_planned`], in the step, moves every destination to the slot vLLM would pick (the first free one)
and does the writes in that order's classes: the zero fills in one ``torch._foreach_zero_`` per dtype, the other
fills one by one, then the copies in ``torch._foreach_copy_`` calls. The recorder refuses (and vLLM's own path
runs) whatever that could change: a write other than a fill or copy (any ``torch.ops`` operator included), a
destination that is not a view of one slot of a whole slot tensor, two writes to overlapping memory whose order the
classes would swap, or a source that is not one of the model's staged tensors (one set_lora made would be held on
the GPU outside the staging budget). Modules of classes whose ``set_lora`` is not vLLM's own linear or fused-MoE
one are left to vLLM; a model with a classification head (vLLM 0.33 sets its full module there too), and every
model not staged, takes vLLM's path whole.

The plan holds the staged tensors; it is used once, at the model's first activation, and dropped when the model is
unstaged (``integration.staging.unstage``), so a later activation (after an eviction) is vLLM's, from CPU memory.
"""

from __future__ import annotations

import logging
import math
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from vllm_lora_ext.integration.patching import ACTIVATION_ATTR, STAGED_ATTR
from vllm_lora_ext.integration.staging import factor_tensors

logger = logging.getLogger(__name__)

__all__ = ["ActivationPlan", "activate_planned", "plan_activation"]

# The vLLM classes whose set_lora / reset_lora only write tensors (no other state): a module whose class takes
# either from anywhere else is left to vLLM's own call.
_KNOWN_SET_LORA = frozenset({"BaseLinearLayerWithLoRA", "MergedColumnParallelLinearWithLoRA",
                             "MergedColumnParallelLinearVariableSliceWithLoRA", "FusedMoEWithLoRA",
                             "FusedMoE3DWithLoRA"})
_KNOWN_RESET_LORA = frozenset({"BaseLinearLayerWithLoRA", "FusedMoEWithLoRA"})
_ZERO, _FILL, _COPY = 0, 1, 2


class _Refused(Exception):
    """A write the plan cannot reorder or move to another slot: the model goes through vLLM's own path."""


@dataclass
class _Write:
    kind: int
    dst: torch.Tensor  # a view of the recorded slot
    stride: int  # elements from one slot to the next in dst's tensor
    value: Any = None  # a fill's number
    src: torch.Tensor | None = None
    non_blocking: bool = False
    module: int = -1  # which of the plan's modules wrote it


@dataclass(frozen=True)
class _Source:
    """Where a copy's source lies in its module's factors: a view of one factor tensor, at ``delta`` elements."""

    path: tuple[str, int | None]  # ("lora_a" or "lora_b", list index or None)
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    delta: int


@dataclass
class ActivationPlan:
    """One model's slot writes, recorded for slot ``slot`` of ``manager``'s modules."""

    manager: Callable[[], Any]  # a weak reference
    slot: int
    writes: list[_Write] = field(default_factory=list)
    live: tuple[str, ...] = ()  # modules left to vLLM's set_lora / reset_lora


def _defined_by(cls: type, method: str) -> str:
    fn = getattr(cls, method, None)
    owner = getattr(fn, "__qualname__", "").partition(".")[0]
    return owner if getattr(fn, "__module__", "").startswith("vllm.lora.layers") else ""


def plannable(module: Any) -> bool:
    """Whether ``module``'s set_lora and reset_lora are vLLM's own linear or fused-MoE ones (tensor writes only)."""
    cls = type(module)
    return _defined_by(cls, "set_lora") in _KNOWN_SET_LORA and _defined_by(cls, "reset_lora") in _KNOWN_RESET_LORA


def _slot_index(idx: Any, slot: int) -> bool:
    first = idx[0] if isinstance(idx, tuple) and idx else idx
    return type(first) is int and first == slot


class _Recorder(TorchFunctionMode):
    """Notes fills and copies into views of slot ``slot`` instead of doing them; refuses any other write."""

    def __init__(self, slot: int, slots: int) -> None:
        super().__init__()
        self.slot = slot
        self.sizes = (slots, slots + 1)  # a slot tensor's first dimension (vLLM's adapter_enabled has one more)
        self.writes: list[_Write] = []
        self.module = -1  # the module whose set_lora / reset_lora runs now
        self._views: dict[int, tuple[torch.Tensor, int]] = {}  # id(view of the slot) -> (view, slot stride)

    def _slot_tensor(self, t: Any) -> bool:
        """A tensor whose dimension 0 is the slot: vLLM allocates its slot tensors whole (a view, such as one slot
        of them, would have another dimension first)."""
        return isinstance(t, torch.Tensor) and t._base is None and t.dim() > 0 and t.shape[0] in self.sizes

    def _dst(self, t: Any) -> tuple[torch.Tensor, int]:
        found = self._views.get(id(t)) if isinstance(t, torch.Tensor) else None
        if found is None or found[0] is not t:
            raise _Refused("a write into a tensor that is not a view of one slot")
        return found

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if isinstance(func, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
            raise _Refused(f"the operator {func!r}")  # (its name does not say whether it writes)
        name = getattr(func, "__name__", "")
        if name == "__getitem__":
            out = func(*args, **kwargs)
            if isinstance(out, torch.Tensor) and _slot_index(args[1], self.slot) and self._slot_tensor(args[0]):
                self._views[id(out)] = (out, args[0].stride(0))
            return out
        if name == "__setitem__":
            t, idx, value = args
            if not (_slot_index(idx, self.slot) and self._slot_tensor(t) and _number(value)):
                raise _Refused("an indexed write other than a number into one slot")
            self._fill(t[idx], t.stride(0), value)
            return None
        if name in ("fill_", "zero_"):
            view, stride = self._dst(args[0])
            value = 0 if name == "zero_" else args[1]
            if not _number(value):
                raise _Refused("a fill with a tensor")
            self._fill(view, stride, value)
            return args[0]
        if name == "copy_":
            view, stride = self._dst(args[0])
            src = args[1]
            if not isinstance(src, torch.Tensor):
                raise _Refused("a copy from a non-tensor")
            non_blocking = bool(kwargs.get("non_blocking", args[2] if len(args) > 2 else False))
            self.writes.append(_Write(_COPY, view, stride, src=src, non_blocking=non_blocking, module=self.module))
            return args[0]
        if "out" in kwargs or name == "__set__" or (name.endswith("_") and not name.endswith("__")) \
                or name.startswith("__i"):
            raise _Refused(f"the write {name!r}")
        return func(*args, **kwargs)

    def _fill(self, view: torch.Tensor, stride: int, value: Any) -> None:
        zero = value == 0 and not (isinstance(value, float) and math.copysign(1.0, value) < 0)
        self.writes.append(_Write(_ZERO if zero else _FILL, view, stride, value=value, module=self.module))


def _number(value: Any) -> bool:
    return isinstance(value, (bool, int, float)) and not (isinstance(value, float) and math.isnan(value))


def _extent(t: torch.Tensor) -> tuple[int, int, int] | None:
    """(storage address, first byte, one past the last byte) a view can touch; ``None`` if it is empty."""
    if t.numel() == 0:
        return None
    if any(s < 0 for s in t.stride()):
        raise _Refused("a negative stride")
    size = t.element_size()
    return t.untyped_storage().data_ptr(), t.storage_offset() * size, (_last(t) + 1) * size


def _check_order(writes: list[_Write]) -> list[_Write]:
    """The non-empty writes, after checking that doing them as zeros, fills, then copies (each class in order)
    leaves every byte as the recorded order would, in every slot (one stride per storage).

    A storage whose writes come in that order already, with at most one copy, needs no more (vLLM's slot
    tensors: a zero, then a copy or a fill); only another storage's writes are compared byte range by range."""
    by_storage: dict[int, list[_Write]] = {}
    kept = []
    for w in writes:
        if w.dst.numel() == 0:
            continue
        group = by_storage.setdefault(w.dst.untyped_storage().data_ptr(), [])
        if group and group[0].stride != w.stride:
            raise _Refused("one storage indexed by slot with two strides")
        group.append(w)
        kept.append(w)
    for group in by_storage.values():
        kinds = [w.kind for w in group]
        if kinds != sorted(kinds) or kinds.count(_COPY) > 1:
            _check_overlaps(group)
    return kept


def _check_overlaps(group: list[_Write]) -> None:
    seen: list[tuple[int, int, int]] = []
    for w in group:
        ext = _extent(w.dst)
        assert ext is not None
        _, lo, hi = ext
        for kind, a, b in seen:
            if a < hi and lo < b and (kind > w.kind or kind == w.kind == _COPY):
                raise _Refused("overlapping writes whose order the batches would change")
        seen.append((w.kind, lo, hi))


def plan_activation(adapters: Any, lora: Any, name: str = "adapter") -> ActivationPlan | None:
    """Record ``lora``'s slot writes on ``adapters`` (a vLLM ``LoRAModelManager``) and keep the plan on ``lora``.

    Call it on the build's thread, after vLLM's merge ran on ``lora`` and with its staged tensors complete or queued
    on the current stream. Returns the plan, or ``None`` (nothing kept: a model not staged, or a write the plan
    cannot take; vLLM's own activation then runs). An adapter whose factors have the shapes, strides and dtypes of
    one planned before on this manager takes that plan's writes with its own tensors as the sources
    ([`_from_template`]): vLLM's set_lora derives its sources from those alone. A kept plan serves any slot: its
    writes are moved here from the slot they were recorded for to this plan's, so that the step has nothing to
    move unless that slot is taken meanwhile ([`replay`])."""
    slots = getattr(adapters, "lora_index_to_id", None)
    modules = getattr(adapters, "modules", None)
    get = getattr(adapters, "_get_lora_layer_weights", None)
    staging = getattr(lora, STAGED_ATTR, None)
    if not slots or modules is None or get is None or staging is None \
            or any(hasattr(m, "set_module_to_save") for m in list(modules.values())):
        return None  # (vLLM 0.33 also gives a classification head its full module in activate_adapter)
    start = time.perf_counter()
    # the slot the step will most likely fill (vLLM's first free one now), so that its writes need no moving
    free = [i for i, held in enumerate(list(slots)) if held is None]
    plan = ActivationPlan(weakref.ref(adapters), free[0] if free else len(slots) - 1)
    live, entries = [], []
    for module_name, module in list(modules.items()):
        if plannable(module):
            entries.append((module, get(lora, module_name)))
        else:
            live.append(module_name)
    key = tuple(_signature(w) for _, w in entries)
    kept = _templates(adapters).get(key)
    template = None
    if kept is not None:  # recorded for its own slot: moved here to this plan's, off the engine thread
        recorded_slot, template = kept
    try:
        plan.writes = (_from_template(template, entries, plan.slot - recorded_slot) if template is not None
                       else _record(plan.slot, len(slots), entries))
    except _Refused as why:
        logger.info("adapter %r: its slot writes are left to vLLM's activation (%s)", name, why)
        return None
    except Exception:  # vLLM's set_lora refused it here: its own path in the step says so as it would have
        logger.debug("adapter %r: recording its slot writes failed", name, exc_info=True)
        return None
    plan.live = tuple(live)
    base = staging.buffer.untyped_storage().data_ptr()
    if any(w.src is not None and w.src.untyped_storage().data_ptr() != base for w in plan.writes):
        logger.info("adapter %r: its slot writes are left to vLLM's activation (set_lora made a source of its own)",
                    name)
        return None  # (such a tensor, e.g. a tensor-parallel slice vLLM concatenates, would be held outside the
        # staging budget until the model is taken)
    if template is None:
        _keep_template(adapters, key, plan.slot, plan.writes, entries)
    setattr(lora, ACTIVATION_ATTR, plan)
    logger.info("adapter %r: %d slot writes planned in %.4f s (%d modules left to vLLM%s)", name,
                len(plan.writes), time.perf_counter() - start, len(live),
                "; as an earlier adapter of its shapes" if template is not None else "")
    return plan


def _put_in_slot(module: Any, slot: int, weights: Any) -> None:
    """What vLLM's activate_adapter does for one module: its weights into the slot, or the slot cleared."""
    if weights:
        module.set_lora(slot, weights.lora_a, weights.lora_b)
    else:
        module.reset_lora(slot)


def _record(slot: int, slots: int, entries: list[tuple[Any, Any]]) -> list[_Write]:
    recorder = _Recorder(slot, slots)
    with recorder:  # (once around the loop)
        for i, (module, weights) in enumerate(entries):
            recorder.module = i
            _put_in_slot(module, slot, weights)
    return _check_order(recorder.writes)


# ----------------------------------------------------------------- plans kept by shape, for the next adapter
_Template = tuple[int, list[tuple[_Write, _Source | None]]]  # the slot its writes are for, and the writes
_TEMPLATES: weakref.WeakKeyDictionary[Any, dict[Any, _Template]] = weakref.WeakKeyDictionary()
_TEMPLATES_LOCK = threading.Lock()
_MAX_TEMPLATES = 16  # per manager: adapter shapes (any slot: a kept plan's writes are moved to the plan's)


def _templates(adapters: Any) -> dict[Any, _Template]:
    with _TEMPLATES_LOCK:
        return _TEMPLATES.setdefault(adapters, {})


def _tensor_signature(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.stride(), value.dtype, value.device
    if isinstance(value, (list, tuple)):
        return type(value).__name__, tuple(_tensor_signature(v) for v in value)
    return None if value is None else ("other", type(value).__name__)


def _signature(weights: Any) -> Any:
    """What a module's set_lora sees of an adapter's weights, values aside (``None``: reset_lora runs)."""
    if not weights:
        return None
    return _tensor_signature(weights.lora_a), _tensor_signature(weights.lora_b)


def _last(t: torch.Tensor) -> int:
    return t.storage_offset() + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))


def _source_of(src: torch.Tensor, weights: Any) -> _Source | None:
    """``src`` as a view of exactly one of ``weights``' factors (same storage and dtype, inside its elements), or
    ``None``: none, or several (factors that share memory here need not in the next adapter)."""
    ptr, lo = src.untyped_storage().data_ptr(), src.storage_offset()
    if min(src.stride(), default=0) < 0:
        return None
    found = [((attr, i), f) for attr, i, f in (factor_tensors(weights, ("lora_a", "lora_b")) if weights else ())
             if f.untyped_storage().data_ptr() == ptr and f.dtype == src.dtype and f.storage_offset() <= lo
             and _last(src) <= _last(f)]
    if len(found) != 1:
        return None
    path, f = found[0]
    return _Source(path, tuple(src.shape), tuple(src.stride()), lo - f.storage_offset())


def _keep_template(adapters: Any, key: Any, slot: int, writes: list[_Write], entries: list[tuple[Any, Any]]) -> None:
    """Keep ``writes`` without their sources (which would hold this adapter's GPU tensors), each copy's source
    described by where it lies in its module's factors; nothing is kept if one lies elsewhere."""
    template: list[tuple[_Write, _Source | None]] = []
    for w in writes:
        spec = None
        if w.src is not None:
            spec = _source_of(w.src, entries[w.module][1])
            if spec is None:
                return
        template.append((_Write(w.kind, w.dst, w.stride, w.value, None, w.non_blocking, w.module), spec))
    kept = _templates(adapters)
    with _TEMPLATES_LOCK:
        while len(kept) >= _MAX_TEMPLATES:
            kept.pop(next(iter(kept)))
        kept[key] = (slot, template)


def _factor_at(weights: Any, path: tuple[str, int | None]) -> torch.Tensor:
    value = getattr(weights, path[0])
    return value if path[1] is None else value[path[1]]


def _from_template(template: list[tuple[_Write, _Source | None]], entries: list[tuple[Any, Any]],
                   shift: int) -> list[_Write]:
    """The template's writes moved ``shift`` slots (to the slot this plan is for), with this adapter's tensors as
    the copies' sources (factors of the same signature)."""
    writes = []
    for w, spec in template:
        src = None
        if spec is not None:
            f = _factor_at(entries[w.module][1], spec.path)
            src = f.as_strided(spec.shape, spec.stride, f.storage_offset() + spec.delta)
        writes.append(_Write(w.kind, _moved(w, shift), w.stride, w.value, src, w.non_blocking, w.module))
    return writes


def _moved(w: _Write, shift: int) -> torch.Tensor:
    d = w.dst
    return d if shift == 0 else d.as_strided(d.shape, d.stride(), d.storage_offset() + shift * w.stride)


def replay(plan: ActivationPlan, index: int) -> None:
    """Do ``plan``'s writes into slot ``index``: zeros, fills, then copies, batched where the kinds allow."""
    shift = index - plan.slot
    zeros: dict[tuple[Any, Any], list[torch.Tensor]] = {}
    copies: dict[tuple[bool, bool], tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    fills = []
    for w in plan.writes:
        dst = _moved(w, shift)
        if w.kind == _ZERO:
            zeros.setdefault((dst.device, dst.dtype), []).append(dst)
        elif w.kind == _FILL:
            fills.append((dst, w.value))
        else:
            assert w.src is not None
            dense = (w.src.device == dst.device and w.src.dtype == dst.dtype and w.src.shape == dst.shape
                     and dst.is_contiguous() and w.src.is_contiguous())
            pair = copies.setdefault((dense, w.non_blocking), ([], []))
            pair[0].append(dst)
            pair[1].append(w.src)
    for group in zeros.values():
        torch._foreach_zero_(group)
    for dst, value in fills:
        dst.fill_(value)
    for (_, non_blocking), (dsts, srcs) in copies.items():
        torch._foreach_copy_(dsts, srcs, non_blocking=non_blocking)


def activate_planned(adapters: Any, lora_id: int) -> bool | None:
    """vLLM's ``LoRAModelManager.activate_adapter`` for a model with a plan: the same slot (the first free one),
    the same bookkeeping, the planned writes replayed and the other modules' set_lora/reset_lora called as vLLM
    calls them. Returns ``True``, or ``None`` when vLLM's own path should run (no plan for this model and manager,
    the adapter already active, or no free slot, which vLLM then reports)."""
    if lora_id in adapters._active_adapters:
        return None
    try:
        lora = adapters._registered_adapters[lora_id]
    except KeyError:
        return None
    plan: ActivationPlan | None = lora.__dict__.pop(ACTIVATION_ATTR, None)
    if plan is None or plan.manager() is not adapters or getattr(lora, STAGED_ATTR, None) is None \
            or None not in adapters.lora_index_to_id:
        return None
    index = adapters.lora_index_to_id.index(None)
    replay(plan, index)
    for name in plan.live:
        _put_in_slot(adapters.modules[name], index, adapters._get_lora_layer_weights(lora, name))
    adapters._active_adapters[lora_id] = None
    adapters.lora_index_to_id[index] = lora.id
    return True
