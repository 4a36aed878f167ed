"""Host arenas pinned in place (a real CUDA device, real vLLM LoRA objects): torch and vLLM see pinned tensors and
copy nothing, copies to the GPU are exact, and the registration is undone when the memory is returned."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _filled_arena(n: int, seed: int) -> tuple[object, list[torch.Tensor]]:
    from vllm_lora_ext.transport.arena import HostArena

    arena = HostArena(n)
    g = torch.Generator().manual_seed(seed)
    tensors = []
    for shape in ((8, 4096), (4, 1024, 16), (3, 5)):
        t = arena.empty(shape, torch.bfloat16)
        t.copy_(torch.randn(*shape, generator=g))
        tensors.append(t)
    return arena, tensors


def test_an_arena_pinned_in_place_is_pinned_for_torch_and_vllm_and_copies_exactly() -> None:
    from vllm.lora.lora_weights import LoRALayerWeights

    from vllm_lora_ext.integration._compat import pin_in_place

    torch.zeros(1, device="cuda")  # this thread has the context, as a worker's does
    arena, (a, b, small) = _filled_arena(16 << 20, 0)
    before = [a.clone(), b.clone(), small.clone()]
    assert not a.is_pinned()
    assert pin_in_place(arena)
    arena.close()  # type: ignore[attr-defined]
    assert a.is_pinned() and b.is_pinned() and small.is_pinned()
    assert a.pin_memory().data_ptr() == a.data_ptr()  # vLLM's pin_memory() copies nothing
    weights = LoRALayerWeights("m", 8, 16, a, b[0], scaling=1.0)
    weights.lora_a = weights.lora_a.pin_memory()
    assert weights.lora_a.data_ptr() == a.data_ptr()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_gpu = [t.to("cuda", non_blocking=True) for t in (a, b, small)]
    stream.synchronize()
    for got, want in zip(on_gpu, before):
        assert torch.equal(got.cpu(), want)


def test_the_registration_is_undone_when_the_last_tensor_is_gone() -> None:
    from vllm_lora_ext.integration._compat import pin_in_place

    torch.zeros(1, device="cuda")
    for seed in range(4):  # the same size again and again: the kernel hands back the same addresses, which the
        # driver refuses to register twice unless the last registration was undone
        arena, tensors = _filled_arena(64 << 20, seed)
        released: list[int] = []
        assert pin_in_place(arena)
        arena.on_release(lambda: released.append(1))  # type: ignore[attr-defined]
        arena.close()  # type: ignore[attr-defined]
        view = tensors[1][2:]
        del tensors, arena
        gc.collect()
        assert view.is_pinned() and released == []
        del view
        gc.collect()
        assert released == [1]


def test_nothing_is_pinned_in_a_thread_without_a_cuda_context() -> None:
    import threading

    from vllm_lora_ext.integration._compat import pin_in_place

    arena, tensors = _filled_arena(8 << 20, 1)
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(pin_in_place(arena)))
    thread.start()
    thread.join()
    assert result == [False] and not tensors[0].is_pinned()


def test_kept_memory_stays_pinned_is_widened_when_used_further_and_unregistered_when_dropped(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import time

    from vllm_lora_ext.transport import arena as hostmem
    from vllm_lora_ext.constants import ENV_HOST_SPARE
    from vllm_lora_ext.transport.arena import HostArena, clear_spare, prepare_spare
    from vllm_lora_ext.integration._compat import pin_in_place
    from vllm_lora_ext.transport.cuda import cuda_context

    monkeypatch.setenv(ENV_HOST_SPARE, str(256 << 20))
    clear_spare()
    torch.zeros(1, device="cuda")
    context = cuda_context()
    # A spare prepared on a helper thread, pinned there with the worker's context.
    assert prepare_spare(64 << 20, ready=lambda arena: pin_in_place(arena, context=context))
    for _ in range(1000):
        if not hostmem._SPARE._preparing:
            break
        time.sleep(0.01)
    arena = HostArena(64 << 20, reuse=True)
    assert arena.reused and arena.memory is not None and arena.memory.registered == 64 << 20
    t = arena.empty((1024, 1024), torch.bfloat16)
    assert t.is_pinned()  # pinned before this arena asked
    assert pin_in_place(arena)  # nothing to register
    released: list[int] = []
    arena.on_release(lambda: released.append(1))
    arena.close()
    del t
    gc.collect()
    assert released == []  # kept as the spare, still registered
    clear_spare()
    assert released == [1]
    # Kept memory registered over less than the next arena uses is registered again over all of it.
    first = HostArena(16 << 20, reuse=True)
    x = first.empty((1 << 20,), torch.uint8)
    assert pin_in_place(first) and first.memory is not None and first.memory.registered == 1 << 20
    first.close()
    del x
    gc.collect()
    second = HostArena(16 << 20, reuse=True)
    assert second.reused
    head = second.empty((2 << 20,), torch.uint8)
    tail = second.empty((4 << 20,), torch.uint8)
    tail.copy_(torch.arange(4 << 20, dtype=torch.int64).remainder_(251).to(torch.uint8))
    assert head.is_pinned() and second.memory is not None and second.memory.registered == 1 << 20
    # (The driver reported ``tail`` pinned already on an H100, past the 1 MiB registered: not asserted either way.)
    assert pin_in_place(second) and second.memory.registered == 6 << 20 and tail.is_pinned()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        on_gpu = tail.to("cuda", non_blocking=True)
    stream.synchronize()
    assert torch.equal(on_gpu.cpu(), tail)
    second.close()
    del head, tail
    gc.collect()
    clear_spare()


@pytest.mark.parametrize("wait", [True, False])
def test_kept_memory_is_written_only_after_a_copy_still_reading_it_has_run(monkeypatch: pytest.MonkeyPatch,
                                                                           wait: bool) -> None:
    """An evicted adapter's slot copy may still be queued when its memory is taken again: writing it at once puts
    the new bytes into that copy (the control, ``wait=False``, shows it happens), waiting first does not."""
    from vllm_lora_ext.constants import ENV_HOST_SPARE
    from vllm_lora_ext.transport.arena import HostArena, clear_spare
    from vllm_lora_ext.integration._compat import pin_in_place
    from vllm_lora_ext.transport.cuda import await_gpu_reads

    monkeypatch.setenv(ENV_HOST_SPARE, str(512 << 20))
    clear_spare()
    torch.zeros(1, device="cuda")
    n = 128 << 20
    old = HostArena(n, reuse=True)
    x = old.empty((n,), torch.uint8)
    x.fill_(1)
    assert pin_in_place(old)
    old.close()
    on_gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    torch.cuda._sleep(2_000_000_000)  # about a second of GPU time queued before the copy
    on_gpu.copy_(x, non_blocking=True)  # as vLLM's slot copy: queued, the CPU goes on
    del x  # the adapter is evicted: its memory is kept as the spare
    gc.collect()
    new = HostArena(n, reuse=True)
    assert new.reused
    if wait:
        await_gpu_reads()
    new.empty((n,), torch.uint8).fill_(2)  # the next mix's bytes
    torch.cuda.synchronize()
    ones = int((on_gpu == 1).sum())
    if wait:
        assert ones == n  # the copy read the evicted adapter's bytes only
    else:
        assert ones < n  # the control: without the wait, the copy read the next mix's bytes
    new.close()
    clear_spare()


def test_a_helper_thread_pins_in_place_once_bound_to_the_worker_gpu() -> None:
    """A fresh thread (a mix's component load, a background build) has no CUDA context, so `pin_in_place` leaves
    an arena pageable there, and vLLM would copy every factor into pinned memory of its own (the control). Bound
    to the worker's GPU first (`bind_worker_gpu`, as `load_lora_model` does), it pins the arena in place."""
    import threading

    from vllm_lora_ext.integration._compat import pin_in_place
    from vllm_lora_ext.transport.cuda import bind_worker_gpu

    torch.zeros(1, device="cuda:0")  # the worker's own thread has used CUDA
    seen: dict[object, object] = {}

    def load(bind: bool) -> None:
        arena, (a, _, _) = _filled_arena(8 << 20, 3)
        if bind:
            seen["bound"] = bind_worker_gpu(torch.device("cuda:0"))
        seen[bind] = pin_in_place(arena)
        arena.close()  # type: ignore[attr-defined]
        seen[(bind, "pinned")] = a.is_pinned()
        seen[(bind, "no copy")] = a.pin_memory().data_ptr() == a.data_ptr()

    for bind in (False, True):
        thread = threading.Thread(target=load, args=(bind,))
        thread.start()
        thread.join()
    assert seen[False] is False and seen[(False, "pinned")] is False and seen[(False, "no copy")] is False
    assert seen["bound"] is True and seen[True] is True
    assert seen[(True, "pinned")] is True and seen[(True, "no copy")] is True
    assert bind_worker_gpu("cpu") is False and bind_worker_gpu(None) is False
