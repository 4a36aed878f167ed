"""Host arenas pinned in place (a real CUDA device, real vLLM LoRA objects): torch and vLLM see pinned tensors and
copy nothing, copies to the GPU are exact, and the registration is undone when the memory is returned."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _filled_arena(n: int, seed: int) -> tuple[object, list[torch.Tensor]]:
    from vllm_lora_ext.hostmem import HostArena

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
