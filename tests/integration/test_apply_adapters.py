"""The per-step fast path of ``LRUCacheWorkerLoRAManager._apply_adapters`` (PATCHES.md #4), on vLLM's own classes.

vLLM's managers are made with ``object.__new__`` and their fields filled in (their constructors need a model on a
GPU); everything the step runs on them is vLLM's code: its LRU caches, ``activate_adapter`` with slot eviction, and
``_apply_adapters``/``add_adapter`` as the plugin had them before this patch (the original, calling the plugin's
``add_adapter``).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytestmark = pytest.mark.vllm

SLOTS, REGISTERED = 6, 10


def _worker(*, identities: bool = True) -> Any:
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.model_manager import AdapterLRUCache, LRUCacheLoRAModelManager
    from vllm.lora.worker_manager import LRUCacheWorkerLoRAManager

    from vllm_lora_ext.integration.patching import IDENTITY_ATTR

    config = LoRAConfig(max_lora_rank=16, max_loras=SLOTS, max_cpu_loras=REGISTERED + 2, lora_dtype=torch.float32)
    mgr = object.__new__(LRUCacheLoRAModelManager)
    mgr.lora_config = config
    mgr.modules = {}  # no layers: activating an adapter only takes a slot
    mgr.lora_index_to_id = [None] * SLOTS
    mgr._registered_adapters = AdapterLRUCache(config.max_cpu_loras, mgr.deactivate_adapter)
    mgr._active_adapters = AdapterLRUCache(SLOTS, mgr._deactivate_adapter)
    for lora_id in range(1, REGISTERED + 1):
        model = LoRAModel(lora_id, 8, {})
        if identities:
            setattr(model, IDENTITY_ATTR, _path(lora_id))
        mgr._registered_adapters[lora_id] = model
    for lora_id in range(1, SLOTS + 1):
        mgr.activate_adapter(lora_id)
    worker = object.__new__(LRUCacheWorkerLoRAManager)
    worker._adapter_manager = mgr
    worker.lora_config = config
    return worker


def _path(lora_id: int) -> str:
    return f"/adapters/a{lora_id}"


def _request(lora_id: int, **kw: Any) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(f"a{lora_id}", lora_id, kw.pop("path", _path(lora_id)), **kw)


def _state(worker: Any) -> tuple[Any, ...]:
    """What a step changes that vLLM reads: both LRU orders (which adapter goes first) and the slots. (The caches'
    hit counts are read by nothing in vLLM; the plugin's add_adapter adds lookups of its own to them.)"""
    mgr = worker._adapter_manager
    reg, act = mgr._registered_adapters, mgr._active_adapters
    return (list(reg.order), list(act.order), list(mgr.lora_index_to_id))


@pytest.fixture
def patched() -> Any:
    from vllm_lora_ext.integration import plugin

    plugin.register()
    import vllm.lora.worker_manager as wm

    fast = wm.LRUCacheWorkerLoRAManager._apply_adapters
    assert getattr(fast, plugin.PATCH_MARK, False)
    return fast


@pytest.mark.parametrize("identities", [True, False])  # built by the plugin, or registered by vLLM itself
def test_the_fast_path_leaves_vllms_caches_and_slots_as_vllms_path_does(patched: Any, identities: bool) -> None:
    import vllm.lora.worker_manager as wm

    fast_worker, slow_worker = _worker(identities=identities), _worker(identities=identities)
    original = patched.__wrapped__
    calls = {"n": 0}
    real_add = wm.LRUCacheWorkerLoRAManager.add_adapter

    def counted(self: Any, request: Any) -> Any:
        if self is fast_worker:
            calls["n"] += 1
        return real_add(self, request)

    wm.LRUCacheWorkerLoRAManager.add_adapter = counted  # type: ignore[method-assign]
    try:
        rng = random.Random(0)
        fast_steps = 0
        for step in range(300):
            # mostly batches of active adapters (the steady state), now and then one that evicts a slot
            pool = list(fast_worker._adapter_manager._active_adapters.order)
            if step % 7 == 3:
                pool = list(range(1, REGISTERED + 1))
            batch = {_request(i) for i in rng.sample(pool, rng.randint(1, min(SLOTS, len(pool))))}
            if step % 11 == 5:
                batch.add(None)  # a request without an adapter in the batch
            before = calls["n"]
            patched(fast_worker, batch)
            original(slow_worker, batch)
            fast_steps += calls["n"] == before
            assert _state(fast_worker) == _state(slow_worker), f"step {step}"
    finally:
        wm.LRUCacheWorkerLoRAManager.add_adapter = real_add  # type: ignore[method-assign]
    assert 200 < fast_steps < 300  # both paths ran
    # control: the state compared above records the order of touches (the same batches in another order differ)
    a, b = _worker(identities=identities), _worker(identities=identities)
    original(a, {_request(1)})
    original(a, {_request(2)})
    original(b, {_request(2)})
    original(b, {_request(1)})
    assert _state(a) != _state(b)


@pytest.mark.parametrize("case", ["inactive", "other_source", "load_inplace", "probe", "staged", "unregistered"])
def test_a_batch_the_fast_path_cannot_answer_goes_through_add_adapter(patched: Any, case: str) -> None:
    import vllm.lora.worker_manager as wm

    from vllm_lora_ext.constants import PREBUILD_PREFIX
    from vllm_lora_ext.integration.patching import STAGED_ATTR

    worker = _worker()
    mgr = worker._adapter_manager
    odd = {"inactive": _request(SLOTS + 1), "other_source": _request(2, path="/adapters/another"),
           "load_inplace": _request(2, load_inplace=True), "probe": _request(2, path=PREBUILD_PREFIX + _path(2)),
           "staged": _request(2), "unregistered": _request(REGISTERED + 1)}[case]
    if case == "staged":
        setattr(mgr._registered_adapters.get(2), STAGED_ATTR, object())
    asked: list[int] = []

    def spy(self: Any, request: Any) -> bool:
        asked.append(request.lora_int_id)
        return True

    real_add = wm.LRUCacheWorkerLoRAManager.add_adapter
    wm.LRUCacheWorkerLoRAManager.add_adapter = spy  # type: ignore[method-assign]
    try:
        patched(worker, {_request(1), odd})
        assert sorted(asked) == sorted({1, odd.lora_int_id})  # vLLM's path, for the whole batch
        asked.clear()
        patched(worker, {_request(1), _request(3)})
        assert asked == []  # control: a batch of active adapters from their sources takes the fast path
    finally:
        wm.LRUCacheWorkerLoRAManager.add_adapter = real_add  # type: ignore[method-assign]
