"""Staging a built adapter on the GPU (real vLLM LoRA weight objects, a real CUDA device): the slot copy reads
GPU tensors equal to the CPU ones, and unstaging gives back CPU tensors equal to them and frees the buffer."""

from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _in_one_storage(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """The tensors copied into one flat CPU storage, each at a 64-byte boundary with a gap after it (as a build
    process's hand-over file holds an adapter)."""
    sizes = [-(-t.nbytes // 64) * 64 + 64 for t in tensors]
    flat = torch.zeros(sum(sizes), dtype=torch.uint8)
    out, at = [], 0
    for t, size in zip(tensors, sizes):
        view = flat[at:at + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        out.append(view)
        at += size
    return out


def _model(one_storage: bool = False) -> tuple[object, dict[str, list[torch.Tensor]]]:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    factors = [torch.randn(8, 64, generator=g).to(bf), torch.randn(64, 8, generator=g).to(bf),
               *(torch.randn(4, 8, 64, generator=g).to(bf) for _ in range(3)),
               *(torch.randn(4, 32, 8, generator=g).to(bf) for _ in range(3))]
    if one_storage:
        factors = _in_one_storage(factors)
    dense = LoRALayerWeights("model.layers.0.self_attn.q_proj", 8, 16, factors[0], factors[1], scaling=2.0)
    a, b = factors[2:5], factors[5:]
    moe = PackedLoRALayerWeights("model.layers.0.mlp.experts", 8, [1, 1, 1], list(a), list(b), scaling=[1.0] * 3)
    model = LoRAModel(1, 8, {dense.module_name: dense, moe.module_name: moe})
    expected = {"dense_a": [dense.lora_a.clone()], "dense_b": [(dense.lora_b * 2.0).to(bf)],  # scaling folded
                "moe_a": [t.clone() for t in a], "moe_b": [t.clone() for t in b]}
    return model, expected


@pytest.mark.parametrize("one_storage", [False, True], ids=["tensors", "one_storage"])
def test_stage_then_unstage_round_trips_bitwise_and_frees_the_buffer(monkeypatch: pytest.MonkeyPatch,
                                                                      one_storage: bool) -> None:
    """Factors in tensors of their own go up region by region; factors in one storage (a hand-over) go up as that
    storage's span, mirrored in the buffer, and come back as views of it."""
    from vllm_lora_ext.integration import staging as staging_module
    from vllm_lora_ext.integration.staging import stage, staged_bytes, unstage

    copies: list[int] = []
    real = staging_module._copy_through_pinned
    monkeypatch.setattr(staging_module, "_copy_through_pinned",
                        lambda buffer, regions, stream: copies.append(len(regions)) or real(buffer, regions, stream))
    model, expected = _model(one_storage)
    storage = model.loras["model.layers.0.self_attn.q_proj"].lora_a.untyped_storage().data_ptr()
    dense, moe = model.loras["model.layers.0.self_attn.q_proj"], model.loras["model.layers.0.mlp.experts"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert stage(model, "cuda:0")
    assert staged_bytes() > 0
    assert dense.scaling == 1.0 and dense.lora_a.is_cuda and all(t.is_cuda for t in moe.lora_a + moe.lora_b)
    assert copies == ([1] if one_storage else [8])
    assert torch.equal(dense.lora_b.cpu(), expected["dense_b"][0])
    for got, want in zip(moe.lora_a + moe.lora_b, expected["moe_a"] + expected["moe_b"]):
        assert torch.equal(got.cpu(), want)
    # What vLLM does between staging and unstaging: the slot copy, a slice (EP), a new tensor.
    slot = torch.zeros(2, 4, 8, 64, dtype=torch.bfloat16, device="cuda:0")
    slot[1].copy_(moe.lora_a[0], non_blocking=True)
    moe.lora_a[1] = moe.lora_a[1][1:3]
    moe.lora_b[2] = moe.lora_b[2] * 1
    copied_back = unstage(model)
    assert copied_back == expected["moe_b"][2].nbytes  # only the tensor vLLM made itself is copied back
    assert staged_bytes() == 0
    assert not dense.lora_a.is_cuda and all(not t.is_cuda for t in moe.lora_a + moe.lora_b)
    assert torch.equal(moe.lora_a[1], expected["moe_a"][1][1:3])
    if one_storage:  # the CPU twins are the hand-over's own memory
        assert all(t.untyped_storage().data_ptr() == storage for t in [dense.lora_a, dense.lora_b, *moe.lora_a])
    assert torch.equal(dense.lora_b, expected["dense_b"][0])
    for got, want in zip([moe.lora_a[0], moe.lora_a[2]] + moe.lora_b, [expected["moe_a"][0], expected["moe_a"][2]]
                         + expected["moe_b"]):
        assert torch.equal(got, want)
    torch.cuda.synchronize()
    assert torch.equal(slot[1].cpu(), expected["moe_a"][0])
    gc.collect()
    assert torch.cuda.memory_allocated() <= before + slot.nbytes


def test_nothing_is_staged_past_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.staging import stage, staged_bytes

    monkeypatch.setenv("VLLM_LORA_EXT_STAGE_GPU_BYTES", "1024")
    model, _ = _model()
    assert not stage(model, "cuda:0")
    assert staged_bytes() == 0
    assert not any(t.is_cuda for w in model.loras.values()
                   for t in (w.lora_a if isinstance(w.lora_a, list) else [w.lora_a]))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf"), None])
def test_a_staged_model_left_unscanned_is_scanned_on_the_gpu_and_refused_and_freed_if_not_finite(
        bad: float | None) -> None:
    """A background build on a GPU skips its MoE NaN/inf scan (``scan_moe=False``) and ``refuse_nonfinite`` scans the
    staged tensors: torch's fused inf-norm on CUDA must pass NaN and infinity on (``_norms_propagate``, else the sum
    fallback), the error names the packed factor, and the refused model's staging buffer is released."""
    from vllm_lora_ext.errors import AdapterFormatError
    from vllm_lora_ext.integration.patching import STAGED_ATTR, UNSCANNED_ATTR
    from vllm_lora_ext.integration.staging import refuse_nonfinite, stage, staged_bytes
    from vllm_lora_ext.validation import _norms_propagate

    assert _norms_propagate(torch.device("cuda:0"))
    model, expected = _model()
    moe = model.loras["model.layers.0.mlp.experts"]
    if bad is not None:
        moe.lora_b[1][2, 17, 5] = bad  # deep in the middle of one packed factor
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert stage(model, "cuda:0") and staged_bytes() > 0
    setattr(model, UNSCANNED_ATTR, True)
    if bad is None:
        refuse_nonfinite(model, "good")
        assert getattr(model, STAGED_ATTR, None) is not None and not hasattr(model, UNSCANNED_ATTR)
        for got, want in zip(moe.lora_a + moe.lora_b, expected["moe_a"] + expected["moe_b"]):
            assert torch.equal(got.cpu(), want)  # the scan changed nothing
        return
    with pytest.raises(AdapterFormatError, match=r"'model.layers.0.mlp.experts.lora_b\[1\]' holds NaN or infinite"):
        refuse_nonfinite(model, "bad")
    assert model.loras == {} and staged_bytes() == 0
    gc.collect()
    torch.cuda.synchronize()
    assert torch.cuda.memory_allocated() <= before


def _mix_jobs() -> dict[object, tuple[list[tuple[torch.Tensor, torch.Tensor, float]], int, int]]:
    """A mix's concatenation jobs: a dense module and two slices of a packed MoE block, three components."""
    g = torch.Generator().manual_seed(1)
    bf = torch.bfloat16
    dense = [(torch.randn(r, 64, generator=g).to(bf), torch.randn(48, r, generator=g).to(bf), c)
             for r, c in ((8, 0.7), (4, 1.3), (16, -0.25))]
    moe = {j: [(torch.randn(4, r, 64, generator=g).to(bf), torch.randn(4, 32, r, generator=g).to(bf), c)
               for r, c in ((8, 0.5), (4, 2.0), (16, 1.0 / 3))] for j in range(2)}
    return {"q_proj": (dense, 0, 1), ("experts", 0): (moe[0], 1, 2), ("experts", 1): (moe[1], 1, 2)}


def test_a_mix_built_on_the_gpu_equals_the_cpu_build_and_gets_its_cpu_copy_after_the_slot_copy() -> None:
    """The GPU concatenation gives the CPU one bitwise; unstaging before the CPU copy exists defers to it."""
    import threading
    import time

    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    from vllm_lora_ext.integration.staging import STAGED_ATTR, attach_staged, concat_staged, staged_bytes, unstage
    from vllm_lora_ext.mixing import concat_many

    jobs = _mix_jobs()
    reference = concat_many(jobs, dtype=torch.bfloat16)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    built = concat_staged(jobs, dtype=torch.bfloat16, device="cuda:0")
    assert built is not None
    done, staging = built
    for key, pair in done.items():
        assert pair[0].is_cuda and pair[1].is_cuda
        assert torch.equal(pair[0].cpu(), reference[key][0]) and torch.equal(pair[1].cpu(), reference[key][1]), key
    del pair  # a view of the buffer: the test must not keep it alive
    dense = LoRALayerWeights("q_proj", 28, 1, *done["q_proj"], scaling=1.0)
    moe = PackedLoRALayerWeights("experts", 28, [1, 1], [done[("experts", j)][0] for j in range(2)],
                                 [done[("experts", j)][1] for j in range(2)], scaling=[1.0, 1.0])
    model = LoRAModel(1, 28, {"q_proj": dense, "experts": moe})
    release = threading.Event()

    def twins() -> list[torch.Tensor]:
        release.wait(30)
        cpu = concat_many(jobs, dtype=torch.bfloat16)
        return [t for key in jobs for t in cpu[key]]

    attach_staged(model, staging, twins)
    assert staged_bytes() == staging.nbytes
    slot = torch.zeros(4, 28, 64, dtype=torch.bfloat16, device="cuda:0")
    slot.copy_(moe.lora_a[0], non_blocking=True)  # the step's slot copy, then a tensor vLLM makes itself
    moe.lora_b[1] = moe.lora_b[1] * 1
    assert unstage(model) == 0  # no CPU copy yet: nothing waits, the model keeps its GPU tensors
    assert dense.lora_a.is_cuda and getattr(model, STAGED_ATTR, None) is not None
    release.set()
    deadline = time.monotonic() + 30
    while getattr(model, STAGED_ATTR, None) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert getattr(model, STAGED_ATTR, None) is None and staged_bytes() == 0
    assert not dense.lora_a.is_cuda and not any(t.is_cuda for t in moe.lora_a + moe.lora_b)
    assert torch.equal(dense.lora_a, reference["q_proj"][0]) and torch.equal(dense.lora_b, reference["q_proj"][1])
    for j in range(2):
        assert torch.equal(moe.lora_a[j], reference[("experts", j)][0])
        assert torch.equal(moe.lora_b[j], reference[("experts", j)][1])
    torch.cuda.synchronize()
    assert torch.equal(slot.cpu(), reference[("experts", 0)][0])
    for thread in threading.enumerate():  # the twins' thread lets go of the buffer when it returns
        if thread.name == "vllm-lora-ext-mix-twins":
            thread.join(10)
    del done, built, staging
    gc.collect()
    torch.cuda.synchronize()
    torch.empty(1, device="cuda:0")  # the allocator reclaims blocks freed behind stream events on its next call
    assert torch.cuda.memory_allocated() <= before + slot.nbytes + 512


def test_a_mix_whose_cpu_copy_is_ready_before_the_slot_copy_is_unstaged_in_the_step() -> None:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights

    from vllm_lora_ext.integration.staging import attach_staged, concat_staged, staged_bytes, unstage
    from vllm_lora_ext.mixing import concat_many

    jobs = {"q_proj": _mix_jobs()["q_proj"]}
    reference = concat_many(jobs, dtype=torch.bfloat16)
    done, staging = concat_staged(jobs, dtype=torch.bfloat16, device="cuda:0")  # type: ignore[misc]
    dense = LoRALayerWeights("q_proj", 28, 1, *done["q_proj"], scaling=1.0)
    model = LoRAModel(1, 28, {"q_proj": dense})
    attach_staged(model, staging, lambda: list(reference["q_proj"]))
    import time

    deadline = time.monotonic() + 30
    while staging.cpu is None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert unstage(model) == 0 and staged_bytes() == 0
    assert torch.equal(dense.lora_a, reference["q_proj"][0]) and not dense.lora_b.is_cuda


def test_a_mix_past_the_staging_budget_is_not_built_on_the_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.staging import concat_staged

    monkeypatch.setenv("VLLM_LORA_EXT_STAGE_GPU_BYTES", "1024")
    assert concat_staged(_mix_jobs(), dtype=torch.bfloat16, device="cuda:0") is None


def test_a_mix_of_components_in_pinned_arenas_goes_up_by_span_and_its_cpu_copy_comes_back_by_dma() -> None:
    """Components built into pinned host arenas (as the worker builds them) are uploaded a storage span at a
    time; the GPU composite equals the CPU one bitwise, and so do the CPU twins copied back from the GPU,
    which are pinned (their later slot copies are DMAs)."""
    from vllm_lora_ext.transport.arena import HostArena
    from vllm_lora_ext.integration._compat import pin_in_place
    from vllm_lora_ext.integration.staging import concat_staged, twins_from_gpu
    from vllm_lora_ext.transport.staging import _pinned_per_storage, _units
    from vllm_lora_ext.mixing import composite_shapes, concat_many

    torch.zeros(1, device="cuda")  # this thread has the context, as a worker's does
    plain = _mix_jobs()
    arenas = []
    jobs: dict = {}
    for comp in range(3):  # each component's factors in one arena, as a built adapter's are
        arena = HostArena(1 << 20)
        arenas.append(arena)
        for key, (parts, dim_a, dim_b) in plain.items():
            pa, pb, c = parts[comp]
            a, b = arena.empty(tuple(pa.shape), pa.dtype), arena.empty(tuple(pb.shape), pb.dtype)
            a.copy_(pa)
            b.copy_(pb)
            jobs.setdefault(key, ([], dim_a, dim_b))[0].append((a, b, c))
    for arena in arenas:
        assert pin_in_place(arena)
        arena.close()
    srcs = [t for parts, _, _ in jobs.values() for p in parts for t in p[:2]]
    assert sum(u.span for u in _units(srcs, _pinned_per_storage())) == 3
    reference = concat_many(plain, dtype=torch.bfloat16)
    built = concat_staged(jobs, dtype=torch.bfloat16, device="cuda:0")
    assert built is not None
    done, staging = built
    for key in jobs:
        assert torch.equal(done[key][0].cpu(), reference[key][0]), key
        assert torch.equal(done[key][1].cpu(), reference[key][1]), key
    regions = [(t, tuple(shape)) for a, b, t in composite_shapes(jobs, dtype=torch.bfloat16).values()
               for shape in (a, b)]
    twins = twins_from_gpu(staging, regions)
    assert twins is not None and len(twins) == 2 * len(jobs)
    for i, key in enumerate(jobs):
        for j in range(2):
            assert not twins[2 * i + j].is_cuda and twins[2 * i + j].is_pinned()
            assert torch.equal(twins[2 * i + j], reference[key][j]), (key, j)


@pytest.mark.parametrize("early_unstage", [False, True], ids=["written_back_first", "unstaged_first"])
def test_a_b_left_as_stored_is_turned_on_the_gpu_once_staged_and_its_cpu_copy_written_back(
        tmp_path: Path, build_dir: Path, monkeypatch: pytest.MonkeyPatch, early_unstage: bool) -> None:
    """A build process's fused 3D B, left as stored, is transposed and scaled in its staged copy: the GPU tensors
    equal the ordinary build's, and once the CPU copy is written back (before or after the step's unstage) so do
    the CPU tensors the model is pointed back at."""
    import threading
    import time

    from moe_factories import assert_served_as_built, deferred_model
    from vllm_lora_ext.integration import staging as staging_module
    from vllm_lora_ext.integration.patching import STAGED_ATTR
    from vllm_lora_ext.integration.staging import stage, staged_bytes, unstage

    go = threading.Event()
    real = staging_module._written_back
    monkeypatch.setattr(staging_module, "_written_back", lambda *a: (go.wait(30), real(*a))[1])
    cpu_turns: list[int] = []
    turn = staging_module.turn_in_place
    monkeypatch.setattr(staging_module, "turn_in_place", lambda t, *a: (cpu_turns.append(int(t.is_cpu)), turn(t, *a)))
    model, want = deferred_model(tmp_path, "2d")
    assert stage(model, "cuda:0")
    assert sum(cpu_turns) == 0 and len(cpu_turns) == 6  # 2 blocks x (gate, up, down), all on the GPU
    assert all(t.is_cuda for w in model.loras.values() for t in w.lora_b)
    assert_served_as_built(model, want)  # the GPU tensors, as the slot copy reads them
    if not early_unstage:
        go.set()
        deadline = time.monotonic() + 30
        while getattr(model, STAGED_ATTR).cpu is None and time.monotonic() < deadline:
            time.sleep(0.01)
    assert unstage(model) == 0
    go.set()
    deadline = time.monotonic() + 30
    while getattr(model, STAGED_ATTR, None) is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert getattr(model, STAGED_ATTR, None) is None and staged_bytes() == 0
    assert all(t.is_cpu for w in model.loras.values() for t in w.lora_b)
    assert_served_as_built(model, want)  # the CPU tensors, written back from the GPU
