"""Each LoRA slot's live rank, for the fused-MoE pair kernels (`integration.moe_pairs`, issue 39 item 1).

An engine's slots have ``max_lora_rank`` rows; an adapter of a smaller rank fills the first of them, and vLLM's
``set_lora`` zeroes the slot before it writes, so the rows past the adapter's rank are zeros. An engine at
``max_lora_rank`` 32, for two-adapter mixes, then makes every r16 adapter pay for 32 rows in every kernel. The
pair kernels read a table of each slot's live rank instead and skip the zero rows.

The table lives on each punica wrapper (``SLOT_RANKS_ATTR``), one int32 per slot on the wrapper's device, made
the first time it is needed outside a CUDA graph capture, with every entry `ALL_ROWS`. It is never replaced: a
graph captured with its address reads the entries the activations write.

Its lifecycle, once, for the patch of ``LoRAModelManager.activate_adapter`` (`worker_patches`):

1. [`before_activation`]: the slot vLLM is about to fill (its first free one) gets `ALL_ROWS`, so that whatever
   fails from here on leaves an entry that over-states the rank, never one that under-states it.
2. vLLM's activation (or the plugin's planned one) writes the slot.
3. [`after_activation`]: the slot gets the adapter's largest factor rank ([`live_rank`]); a model whose rank cannot
   be read keeps `ALL_ROWS`.

An entry too large costs time only; an entry too small would drop rows of an adapter, so every path errs large.
"""

from __future__ import annotations

import logging
from typing import Any

from vllm_lora_ext.integration.patching import LIVE_RANK_ATTR, SLOT_RANKS_ATTR

logger = logging.getLogger(__name__)

ALL_ROWS = 1 << 30  # a slot's entry when its rank is not known: every row is read
_UNKNOWN = -1  # cached on a model whose rank cannot be read


def live_rank(lora_model: Any) -> int | None:
    """The largest rank of ``lora_model``'s factors: the last dimension of each B (vLLM's ``(out, r)``, the fused
    MoE's ``(experts, N, r)``) and the second-to-last of each A (``(r, in)``, ``(experts, r, K)``), cached on the
    model; None where a factor is not a tensor of two or more dimensions. Both dimensions count, so a factor laid
    out otherwise can only make the number larger, never smaller."""
    found = lora_model.__dict__.get(LIVE_RANK_ATTR)
    if found is not None:
        return None if found == _UNKNOWN else found  # type: ignore[no-any-return]
    ranks = []
    for weights in list(getattr(lora_model, "loras", {}).values()):
        for factor, dim in ((getattr(weights, "lora_a", None), -2), (getattr(weights, "lora_b", None), -1)):
            for t in factor if isinstance(factor, (list, tuple)) else (factor,):
                if t is None:
                    continue
                if getattr(t, "dim", lambda: 0)() < 2:
                    lora_model.__dict__[LIVE_RANK_ATTR] = _UNKNOWN
                    return None
                ranks.append(int(t.shape[dim]))
    best = max(ranks, default=0)
    lora_model.__dict__[LIVE_RANK_ATTR] = best or _UNKNOWN
    return best or None


def rank_table(wrapper: Any, slots: int, device: Any) -> Any:
    """``wrapper``'s table (``slots`` int32 entries on ``device``), made now if it has none and this is not a CUDA
    graph capture; None inside such a capture (the kernels then read every row), or where the table made has
    another size."""
    import torch

    table = wrapper.__dict__.get(SLOT_RANKS_ATTR)
    if table is None:
        if torch.device(device).type == "cuda" and torch.cuda.is_current_stream_capturing():
            return None
        table = wrapper.__dict__[SLOT_RANKS_ATTR] = torch.full((slots,), ALL_ROWS, dtype=torch.int32, device=device)
    return table if table.numel() == slots else None


def _write(manager: Any, index: int, rank: int) -> None:
    """Write ``rank`` into slot ``index`` of the table of each of ``manager``'s punica wrappers (the language
    model's, and a multimodal model's tower and connector ones, which share the slots), each once."""
    import torch

    slots = len(getattr(manager, "lora_index_to_id", ()))
    seen: set[int] = set()
    for wrapper in list(dict(getattr(manager, "punica_wrapper_mapping", None) or {}).values()):
        device = getattr(wrapper, "device", None)
        if id(wrapper) in seen or device is None:
            continue
        seen.add(id(wrapper))
        table = rank_table(wrapper, slots, device)
        if table is None:
            continue
        if table.is_cuda and torch.cuda.is_current_stream_capturing():  # the fill would be captured, not done
            raise RuntimeError("vllm_lora_ext: a LoRA adapter was activated inside a CUDA graph capture; its slot's "
                               "rank cannot be recorded there. Set VLLM_LORA_EXT_KERNEL_CONFIGS=0 and report it.")
        # a table made in the model's forward is an inference tensor, which only inference mode may write (vLLM
        # activates adapters outside it); writing a normal one there is allowed too
        with torch.inference_mode():
            table[index:index + 1].fill_(rank)


def before_activation(manager: Any, lora_id: int) -> None:
    """Before ``manager`` (a ``LoRAModelManager``) activates ``lora_id``: `ALL_ROWS` for the slot it will fill,
    its first free one (an LRU manager evicted before it gets here), if ``lora_id`` is not active already."""
    slots = list(getattr(manager, "lora_index_to_id", ()))
    if lora_id in slots or None not in slots:
        return
    _write(manager, slots.index(None), ALL_ROWS)


def after_activation(manager: Any, lora_id: int) -> None:
    """After ``manager`` put ``lora_id`` in a slot: the model's live rank there (`ALL_ROWS` where it cannot be
    read, logged)."""
    slots = list(getattr(manager, "lora_index_to_id", ()))
    if lora_id not in slots:
        return
    lora_model = manager._registered_adapters.get(lora_id)
    try:
        rank = live_rank(lora_model) if lora_model is not None else None
    except Exception as exc:  # a model whose factors cannot be read: every row of its slot is read
        logger.warning("adapter id %d: its rank could not be read (%s); the fused-MoE pair kernels read every row "
                       "of its slot", lora_id, exc)
        rank = None
    _write(manager, slots.index(lora_id), rank or ALL_ROWS)
