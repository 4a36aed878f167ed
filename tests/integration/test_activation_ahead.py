"""A staged model's slot writes, planned on the build's thread and done in batches in the step, leave every slot
exactly as vLLM's own ``activate_adapter`` does (PATCHES.md: ``LoRAModelManager.activate_adapter``;
``integration.activation``).

The modules are vLLM's own classes (``FusedMoEWithLoRA``, ``FusedMoE3DWithLoRA``, ``MergedQKVParallelLinearWithLoRA``,
``RowParallelLinearWithLoRA``, ``ReplicatedLinearWithLoRA``), made with ``__new__`` and given the slot tensors their
constructors would allocate (building them needs a GPU layer), on the CPU; their ``set_lora`` and ``reset_lora`` are
vLLM's code. The manager is vLLM's ``LRUCacheLoRAModelManager`` with the fields activation reads. Two copies of one
model are activated, one through the plan and one through vLLM's path, and every slot tensor compared bit for bit.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.vllm

SLOTS, RANK, E, H, I = 4, 8, 4, 16, 12  # max_loras, max rank, experts, hidden, intermediate


def _module(cls_name: str, tensors: dict[str, Any], **attrs: Any) -> Any:
    import vllm.lora.layers as layers

    cls = getattr(layers, cls_name)
    module = cls.__new__(cls)
    torch.nn.Module.__init__(module)
    for name, value in {**tensors, **attrs}.items():
        object.__setattr__(module, name, value)
    return module


DEVICE = "cpu"  # tests/gpu/test_activation_gpu.py runs these on "cuda"


def _stale(*shape: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """A slot tensor holding an earlier adapter's values (every slot not zero)."""
    g = torch.Generator().manual_seed(sum(shape))
    return (torch.randn(shape, generator=g).to(dtype) + 3).to(DEVICE)


class _Live:
    """A module of a class the plan does not know: vLLM's set_lora/reset_lora are called on it in the step."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, int]] = []

    def set_lora(self, index: int, a: Any, b: Any) -> None:
        self.calls.append(("set", index))

    def reset_lora(self, index: int) -> None:
        self.calls.append(("reset", index))


def _modules() -> dict[str, Any]:
    moe2d = _module("FusedMoEWithLoRA", {
        "w13_lora_a_stacked": (_stale(SLOTS, E, RANK, H), _stale(SLOTS, E, RANK, H)),
        "w13_lora_b_stacked": (_stale(SLOTS, E, I, RANK), _stale(SLOTS, E, I, RANK)),
        "w2_lora_a_stacked": (_stale(SLOTS, E, RANK, I),), "w2_lora_b_stacked": (_stale(SLOTS, E, H, RANK),),
        "adapter_enabled": torch.ones(SLOTS + 1, dtype=torch.int32, device=DEVICE)},
        _w13_slices=2, tp_size=1, tp_rank=0, fully_sharded=False)
    moe3d = _module("FusedMoE3DWithLoRA", {
        "w13_lora_a_stacked": (_stale(SLOTS, E, RANK, H),), "w13_lora_b_stacked": (_stale(SLOTS, E, 2 * I, RANK),),
        "w2_lora_a_stacked": (_stale(SLOTS, E, RANK, I),), "w2_lora_b_stacked": (_stale(SLOTS, E, H, RANK),),
        "adapter_enabled": torch.ones(SLOTS + 1, dtype=torch.int32, device=DEVICE)},
        _w13_slices=1, tp_size=1, tp_rank=0, fully_sharded=False)
    qkv = _module("MergedQKVParallelLinearWithLoRA", {
        "lora_a_stacked": tuple(_stale(SLOTS, 1, RANK, H) for _ in range(3)),
        "lora_b_stacked": (_stale(SLOTS, 1, H, RANK), _stale(SLOTS, 1, 4, RANK), _stale(SLOTS, 1, 4, RANK))},
        n_slices=3, tp_size=1)
    o = _module("RowParallelLinearWithLoRA", {"lora_a_stacked": (_stale(SLOTS, 1, RANK, H),),
                                              "lora_b_stacked": (_stale(SLOTS, 1, H, RANK),)}, n_slices=1, tp_size=1)
    gate = _module("ReplicatedLinearWithLoRA", {"lora_a_stacked": (_stale(SLOTS, 1, RANK, H),),
                                                "lora_b_stacked": (_stale(SLOTS, 1, E, RANK),)}, n_slices=1, tp_size=1)
    return {"layers.0.mlp.experts": moe2d, "layers.1.mlp.experts": moe3d, "layers.0.self_attn.qkv_proj": qkv,
            "layers.0.self_attn.o_proj": o, "layers.0.mlp.gate": gate, "layers.0.custom": _Live()}


def _manager(active: list[int | None]) -> Any:
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager

    mgr = object.__new__(LRUCacheLoRAModelManager)
    mgr.is_pooling_model = False
    mgr.supports_mm = False
    mgr.modules = _modules()
    mgr.lora_config = SimpleNamespace(max_loras=SLOTS)
    mgr.lora_index_to_id = list(active)
    mgr._active_adapters = AdapterLRUCache(SLOTS, lambda _id: None)
    for lora_id in active:
        if lora_id is not None:
            mgr._active_adapters[lora_id] = None
    mgr._registered_adapters = AdapterLRUCache(8, lambda _id: None)
    return mgr


def _model(lora_id: int, rank: int) -> Any:
    """Rank ``rank`` (below the slots' 8, so the rest of each slot must end zero) on every module but the gate."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    g = torch.Generator().manual_seed(lora_id)

    def t(*shape: int) -> torch.Tensor:
        return torch.randn(shape, generator=g).to(torch.bfloat16).to(DEVICE)

    loras: dict[str, Any] = {
        "layers.0.mlp.experts": PackedLoRALayerWeights(
            "layers.0.mlp.experts", rank, [1] * 3, [t(E, rank, H), t(E, rank, I), t(E, rank, H)],
            [t(E, I, rank), t(E, H, rank), t(E, I, rank)], scaling=[1.0] * 3),
        "layers.1.mlp.experts": PackedLoRALayerWeights(
            "layers.1.mlp.experts", rank, [1] * 2, [t(E, rank, H), t(E, rank, I)], [t(E, 2 * I, rank), t(E, H, rank)],
            scaling=[1.0] * 2),
        "layers.0.self_attn.qkv_proj": PackedLoRALayerWeights(
            "layers.0.self_attn.qkv_proj", rank, [1] * 3, [t(rank, H), None, t(rank, H)], [t(H, rank), None, t(4, rank)],
            scaling=[1.0] * 3),
        "layers.0.self_attn.o_proj": LoRALayerWeights("layers.0.self_attn.o_proj", rank, 1, t(rank, H), t(H, rank)),
        "layers.0.custom": LoRALayerWeights("layers.0.custom", rank, 1, t(rank, H), t(H, rank)),
    }
    return LoRAModel(lora_id, rank, loras)


def _staged(model: Any) -> Any:
    """Staged as ``integration.staging.stage`` stages a model: every factor a view of one buffer, the model marked
    (the buffer on ``DEVICE``)."""
    from vllm_lora_ext.integration.patching import STAGED_ATTR
    from vllm_lora_ext.transport.staging import Staging

    factors = []
    for weights in model.loras.values():
        for attr in ("lora_a", "lora_b"):
            value = getattr(weights, attr)
            for i, t in enumerate(value if isinstance(value, list) else [value]):
                if t is not None:
                    factors.append((weights, attr, i if isinstance(value, list) else None, t))
    places: dict[int, int] = {}  # one region for a tensor given twice (as transport.staging._layout does)
    at = 0
    for *_, t in factors:
        if id(t) not in places:
            places[id(t)] = at
            at += t.nbytes
    buffer = torch.empty(at, dtype=torch.uint8, device=DEVICE)
    for weights, attr, i, t in factors:
        view = buffer[places[id(t)]:places[id(t)] + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        if i is None:
            setattr(weights, attr, view)
        else:
            getattr(weights, attr)[i] = view
    setattr(model, STAGED_ATTR, Staging(buffer))
    return model


def _slot_tensors(mgr: Any) -> dict[str, torch.Tensor]:
    out = {}
    for name, module in mgr.modules.items():
        for attr, value in vars(module).items():
            for i, t in enumerate(value if isinstance(value, tuple) else (value,)):
                if isinstance(t, torch.Tensor):
                    out[f"{name}.{attr}[{i}]"] = t
    return out


@pytest.fixture
def patched() -> None:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    from vllm.lora.model_manager import LoRAModelManager

    assert getattr(LoRAModelManager.activate_adapter, plugin.PATCH_MARK, False)


@pytest.mark.parametrize(("active", "taken"), [([7, None, 9, None], False), ([7, None, 9, None], True),
                                               ([None, None, 9, 5], True), ([None, 8, None, 5], True),
                                               ([None, 8, 9, 5], False)],
                         ids=["slot-1", "slot-1-to-3", "slot-0-to-1", "slot-0-to-2", "slot-0"])
def test_planned_activation_writes_every_slot_as_vllms_own(patched: None, active: list[int | None], taken: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration import activation
    from vllm_lora_ext.integration.activation import plan_activation

    replayed: list[int] = []
    real_replay = activation.replay
    monkeypatch.setattr(activation, "replay", lambda plan, index: replayed.append(index) or real_replay(plan, index))

    planned, plain = _manager(active), _manager(active)
    lora = _staged(_model(3, rank=5))
    plan = plan_activation(planned, lora)
    assert plan is not None and plan.slot == active.index(None) and plan.live == ("layers.0.custom",)
    if taken:  # by another adapter after the plan: the writes move to the next free slot
        active[plan.slot] = 11
        planned.lora_index_to_id[plan.slot] = plain.lora_index_to_id[plan.slot] = 11
    before = {k: v.clone() for k, v in _slot_tensors(planned).items()}
    planned._registered_adapters[3] = lora
    plain._registered_adapters[3] = _model(3, rank=5)  # no plan: vLLM's own activation
    assert planned.activate_adapter(3) is True and plain.activate_adapter(3) is True

    index = active.index(None)
    assert replayed == [index]  # the planned model went through the plan, the other through vLLM's path
    assert planned.lora_index_to_id == plain.lora_index_to_id and planned.lora_index_to_id[index] == 3
    assert list(planned._active_adapters.keys()) == list(plain._active_adapters.keys())
    got, want = _slot_tensors(planned), _slot_tensors(plain)
    for name in want:
        assert torch.equal(got[name], want[name]), name
        for slot in range(got[name].shape[0]):  # every other slot kept its earlier adapter's values
            if slot != index:
                assert torch.equal(got[name][slot], before[name][slot]), (name, slot)
    assert planned.modules["layers.0.custom"].calls == [("set", index)]
    assert not hasattr(lora, "_vllm_lora_ext_activation")  # used once


def test_a_plan_is_for_its_manager_and_a_staged_model_only(patched: None) -> None:
    from vllm_lora_ext.integration.activation import activate_planned, plan_activation

    assert plan_activation(_manager([None] * SLOTS), _model(3, rank=5)) is None  # not staged: vLLM's path
    mgr, other = _manager([None] * SLOTS), _manager([None] * SLOTS)
    lora = _staged(_model(3, rank=5))
    assert plan_activation(mgr, lora) is not None
    other._registered_adapters[3] = lora
    assert activate_planned(other, 3) is None  # planned for another manager: vLLM's path, plan dropped
    assert not hasattr(lora, "_vllm_lora_ext_activation")


def test_no_free_slot_is_vllms_error(patched: None) -> None:
    from vllm_lora_ext.integration.activation import activate_planned, plan_activation

    mgr = _manager([1, 2, 4, 5])
    lora = _staged(_model(3, rank=5))
    plan_activation(mgr, lora)
    mgr._registered_adapters[3] = lora
    assert activate_planned(mgr, 3) is None


def test_writes_the_batches_would_reorder_are_refused() -> None:
    from vllm_lora_ext.integration.activation import _check_order, _Recorder, _Refused

    slots = torch.zeros(SLOTS, 6)
    recorder = _Recorder(SLOTS - 1, SLOTS)
    with recorder:
        slots[SLOTS - 1, :4].copy_(torch.ones(4))
        slots[SLOTS - 1] = 0  # a zero after a copy into the same slot: the batches would zero last
    with pytest.raises(_Refused, match="order"):
        _check_order(recorder.writes)
    assert torch.equal(slots, torch.zeros(SLOTS, 6))  # the recorder wrote nothing

    for write in (lambda: slots[SLOTS - 1].add_(1), lambda: slots[0].copy_(torch.ones(6)),
                  lambda: slots.__setitem__(SLOTS - 1, torch.ones(6)),
                  lambda: torch.ops.aten.copy_.default(slots[SLOTS - 1], torch.ones(6)),
                  lambda: torch.ops.aten.fill_.Scalar(slots[SLOTS - 1], 5.0)):
        with pytest.raises(_Refused), _Recorder(SLOTS - 1, SLOTS):
            write()
    assert torch.equal(slots, torch.zeros(SLOTS, 6))


def test_a_module_class_with_its_own_set_lora_is_left_to_vllm() -> None:
    from vllm.lora.layers import RowParallelLinearWithLoRA

    from vllm_lora_ext.integration.activation import plannable

    class Own(RowParallelLinearWithLoRA):
        def set_lora(self, index: int, lora_a: Any, lora_b: Any) -> None:  # pragma: no cover - never called
            raise AssertionError

    assert plannable(RowParallelLinearWithLoRA.__new__(RowParallelLinearWithLoRA))
    assert not plannable(Own.__new__(Own))


def test_the_plan_is_logged_under_the_adapters_name(patched: None, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    from vllm_lora_ext.integration.activation import plan_activation

    with caplog.at_level(logging.INFO, logger="vllm_lora_ext.integration.activation"):
        plan = plan_activation(_manager([None] * SLOTS), _staged(_model(3, rank=5)), "B2d")
    assert plan is not None
    assert f"adapter 'B2d': {len(plan.writes)} slot writes planned in" in caplog.text
    assert "(1 modules left to vLLM)" in caplog.text


def test_a_second_index_equal_to_the_slot_is_not_taken_for_the_slot() -> None:
    """With as many experts as slots (Mixtral's 8 and max_loras 8), ``t[slot][e]`` with ``e == slot`` indexes the
    experts of one slot: its view must not be moved by the expert stride as if it were a slot."""
    from vllm_lora_ext.integration.activation import _Recorder, _Refused

    slots = torch.zeros(SLOTS, SLOTS, 6)
    with pytest.raises(_Refused), _Recorder(SLOTS - 1, SLOTS):
        slots[SLOTS - 1][SLOTS - 1].copy_(torch.ones(6))
    recorder = _Recorder(SLOTS - 1, SLOTS)
    with recorder:
        slots[SLOTS - 1, SLOTS - 1].copy_(torch.ones(6))
    assert [w.stride for w in recorder.writes] == [SLOTS * 6]
    assert torch.equal(slots, torch.zeros(SLOTS, SLOTS, 6))


def test_a_source_set_lora_made_itself_or_a_full_module_head_leaves_the_model_to_vllm(patched: None) -> None:
    """A source that is not one of the staged tensors (vLLM concatenating a tensor-parallel slice) would be held on
    the GPU outside the staging budget; a classification head (vLLM 0.33) gets its full module in vLLM's
    activate_adapter, which the plan does not do."""
    from vllm_lora_ext.integration.activation import plan_activation

    lora = _staged(_model(3, rank=5))
    o = lora.loras["layers.0.self_attn.o_proj"]
    o.lora_a = o.lora_a.clone()  # no longer a view of the staging buffer
    assert plan_activation(_manager([None] * SLOTS), lora) is None
    headed = _manager([None] * SLOTS)
    headed.modules["layers.0.custom"].set_module_to_save = lambda *a: None
    assert plan_activation(headed, _staged(_model(3, rank=5))) is None


def test_an_adapter_of_planned_shapes_takes_that_plans_writes_with_its_own_tensors(
        patched: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second adapter of one shape is not recorded again: the first plan's writes, kept without its tensors,
    get the second adapter's tensors as sources; the slot then equals vLLM's own activation of the second. Another
    rank (another signature) is recorded anew."""
    from vllm_lora_ext.integration import activation
    from vllm_lora_ext.integration.patching import STAGED_ATTR

    recorded: list[int] = []
    real_record = activation._record
    monkeypatch.setattr(activation, "_record", lambda *a: recorded.append(1) or real_record(*a))
    planned, plain = _manager([7, None, 9, None]), _manager([7, None, 9, None])
    first = _staged(_model(3, rank=5))
    assert activation.plan_activation(planned, first) is not None and recorded == [1]
    second = _staged(_model(4, rank=5))
    plan = activation.plan_activation(planned, second)
    assert plan is not None and recorded == [1]  # from the kept writes
    ours = getattr(second, STAGED_ATTR).buffer.untyped_storage().data_ptr()
    sources = [w.src for w in plan.writes if w.src is not None]
    assert sources and all(t.untyped_storage().data_ptr() == ours for t in sources)
    planned._registered_adapters[4] = second
    plain._registered_adapters[4] = _model(4, rank=5)
    assert planned.activate_adapter(4) is True and plain.activate_adapter(4) is True
    got, want = _slot_tensors(planned), _slot_tensors(plain)
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert activation.plan_activation(planned, _staged(_model(5, rank=6))) is not None and recorded == [1, 1]


@pytest.mark.parametrize(("active", "then"), [([7, None, 9, None], [7, 11, 9, None]), ([None, 8, 9, 5], [12, 8, None, 5]),
                                              ([7, 8, 9, None], [None, 8, 9, 5])],
                         ids=["slot-1-then-3", "slot-0-then-2", "slot-3-then-0"])
def test_an_adapter_of_planned_shapes_takes_that_plan_when_another_slot_is_free(
        patched: None, monkeypatch: pytest.MonkeyPatch, active: list[int | None], then: list[int | None]) -> None:
    """Plans kept by shape serve any slot: in a full server the first free slot moves as adapters come and go (r33's
    no-stall run recorded every 2D adapter anew: 0.033 s against 0.002 s from a kept plan). The second adapter's plan
    has the kept writes moved to the slot free now, on the planning thread (the step moves nothing); every slot
    equals vLLM's own activation."""
    from vllm_lora_ext.integration import activation

    recorded: list[int] = []
    real_record = activation._record
    monkeypatch.setattr(activation, "_record", lambda *a: recorded.append(1) or real_record(*a))
    planned, plain = _manager(active), _manager(active)
    assert activation.plan_activation(planned, _staged(_model(3, rank=5))) is not None and recorded == [1]
    planned.lora_index_to_id[:] = plain.lora_index_to_id[:] = then  # other adapters came and went
    second = _staged(_model(4, rank=5))
    plan = activation.plan_activation(planned, second)
    assert plan is not None and recorded == [1] and plan.slot == then.index(None)  # kept writes, moved here
    before = {k: v.clone() for k, v in _slot_tensors(planned).items()}
    planned._registered_adapters[4] = second
    plain._registered_adapters[4] = _model(4, rank=5)
    moves: list[int] = []
    real_moved = activation._moved
    monkeypatch.setattr(activation, "_moved", lambda w, shift: moves.append(shift) or real_moved(w, shift))
    assert planned.activate_adapter(4) is True and plain.activate_adapter(4) is True
    assert set(moves) == {0}  # the step had nothing to move
    index = then.index(None)
    assert planned.lora_index_to_id[index] == 4 == plain.lora_index_to_id[index]
    got, want = _slot_tensors(planned), _slot_tensors(plain)
    for name in want:
        assert torch.equal(got[name], want[name]), name
        for slot in range(got[name].shape[0]):
            if slot != index:
                assert torch.equal(got[name][slot], before[name][slot]), (name, slot)


def test_a_plan_whose_sources_share_a_factors_memory_is_not_kept_for_an_adapter_whose_factors_do_not(
        patched: None) -> None:
    """Gate and up sharing one A (vLLM 0.33's conversion of a mixed-format 3D adapter, the plugin's fused gate_up
    read as 2D) are one staged region: its w3 copy lies in two factors. The next adapter of the same shapes with its
    own up A must get that A in the w3 slot (a reviewer's case: it got gate's)."""
    from vllm_lora_ext.integration.activation import plan_activation

    planned, plain = _manager([7, None, 9, None]), _manager([7, None, 9, None])
    first = _model(3, rank=5)
    a = first.loras["layers.0.mlp.experts"].lora_a
    a[2] = a[0]
    assert plan_activation(planned, _staged(first)) is not None
    second = _staged(_model(4, rank=5))
    assert plan_activation(planned, second) is not None
    planned._registered_adapters[4] = second
    plain._registered_adapters[4] = _model(4, rank=5)
    assert planned.activate_adapter(4) is True and plain.activate_adapter(4) is True
    got, want = _slot_tensors(planned), _slot_tensors(plain)
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


def test_activation_notes_each_slots_live_rank_for_the_pair_kernels(patched: None) -> None:
    """Through the plan and through vLLM's path alike, the slot an adapter is put in gets its rank in the punica
    wrapper's live-rank table (``integration.slot_ranks``); an adapter already active writes nothing,
    and the next adapter in a freed slot overwrites its entry."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from vllm_lora_ext.integration import slot_ranks
    from vllm_lora_ext.integration.activation import plan_activation
    from vllm_lora_ext.integration.patching import SLOT_RANKS_ATTR

    mgr = _manager([7, None, 9, None])
    mgr.punica_wrapper_mapping = {"language_model": PunicaWrapperCPU(64, SLOTS, device="cpu"),
                                  "tower": PunicaWrapperCPU(64, SLOTS, device="cpu")}  # a multimodal model's two
    staged = _staged(_model(3, rank=5))
    assert plan_activation(mgr, staged) is not None
    mgr._registered_adapters[3] = staged  # through the plan
    mgr._registered_adapters[4] = _model(4, rank=3)  # through vLLM's path
    assert mgr.activate_adapter(3) is True and mgr.activate_adapter(4) is True
    tables = [w.__dict__[SLOT_RANKS_ATTR] for w in mgr.punica_wrapper_mapping.values()]
    every = slot_ranks.ALL_ROWS
    for table in tables:  # slots 0 and 2 were filled before the table: every row read
        assert table.tolist() == [every, 5, every, 3]
    assert mgr.activate_adapter(3) is False and tables[0].tolist() == [every, 5, every, 3]
    mgr.deactivate_adapter(3)
    mgr._registered_adapters[6] = _model(6, rank=7)
    assert mgr.activate_adapter(6) is True and mgr.lora_index_to_id[1] == 6
    assert [t.tolist() for t in tables] == [[every, 7, every, 3]] * 2


def test_an_activation_that_fails_leaves_its_slot_reading_every_row(patched: None) -> None:
    """The slot vLLM is about to fill reads every row before its writes begin, so a failure half-way (a factor
    larger than the slot) leaves no smaller rank of the slot's last adapter behind."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from vllm_lora_ext.integration import slot_ranks

    mgr = _manager([7, None, 9, None])
    wrapper = PunicaWrapperCPU(64, SLOTS, device="cpu")
    mgr.punica_wrapper_mapping = {"language_model": wrapper, "tower": wrapper}  # one wrapper under two prefixes
    mgr._registered_adapters[4] = _model(4, rank=3)
    assert mgr.activate_adapter(4) is True and mgr.lora_index_to_id[1] == 4
    table = wrapper.__dict__["_vllm_lora_ext_slot_ranks"]
    assert table.tolist()[1] == 3
    mgr.deactivate_adapter(4)
    mgr._registered_adapters[5] = _model(5, rank=RANK + 1)  # larger than the slots: vLLM's set_lora raises
    with pytest.raises(RuntimeError):
        mgr.activate_adapter(5)
    assert table.tolist()[1] == slot_ranks.ALL_ROWS


def test_a_table_the_forward_made_in_inference_mode_takes_activations_outside_it(patched: None) -> None:
    """The pair path makes the table in the model's forward, under ``torch.inference_mode``, when no activation
    made it first (vLLM's warm-up and capture); vLLM activates adapters outside inference mode, where an in-place
    write to an inference tensor raises. r39's first engine on the GPU failed its start on that."""
    from vllm.lora.punica_wrapper.punica_cpu import PunicaWrapperCPU

    from vllm_lora_ext.integration import slot_ranks
    from vllm_lora_ext.integration.patching import SLOT_RANKS_ATTR

    mgr = _manager([None] * SLOTS)
    wrapper = PunicaWrapperCPU(64, SLOTS, device="cpu")
    mgr.punica_wrapper_mapping = {"language_model": wrapper}
    with torch.inference_mode():
        made = slot_ranks.rank_table(wrapper, SLOTS, "cpu")  # as the forward makes it
    assert made.is_inference() and wrapper.__dict__[SLOT_RANKS_ATTR] is made
    mgr._registered_adapters[4] = _model(4, rank=3)
    assert mgr.activate_adapter(4) is True  # outside inference mode, as vLLM's add_adapter activates
    assert made.tolist()[0] == 3
    with torch.inference_mode():  # and inside it
        mgr.deactivate_adapter(4)
        mgr._registered_adapters[5] = _model(5, rank=6)
        assert mgr.activate_adapter(5) is True
    assert made.tolist()[0] == 6


def test_the_live_rank_is_the_largest_factor_rank_and_unknown_for_a_factor_it_cannot_read() -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    from vllm_lora_ext.integration import slot_ranks

    model = _model(3, rank=5)
    model.loras["layers.0.self_attn.o_proj"] = LoRALayerWeights("layers.0.self_attn.o_proj", 6, 1,
                                                                torch.zeros(6, H), torch.zeros(H, 6))
    assert slot_ranks.live_rank(model) == 6  # the largest module's, whatever the model's declared rank
    flat = LoRAModel(5, 4, {"m": LoRALayerWeights("m", 4, 1, torch.zeros(4 * H), torch.zeros(H, 4))})
    assert slot_ranks.live_rank(flat) is None  # a 1-D factor: every row of the slot is read
