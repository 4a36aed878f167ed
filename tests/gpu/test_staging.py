"""Staging a built adapter on the GPU (real vLLM LoRA weight objects, a real CUDA device): the slot copy reads
GPU tensors equal to the CPU ones, and unstaging gives back CPU tensors equal to them and frees the buffer."""

from __future__ import annotations

import gc
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model() -> tuple[object, dict[str, list[torch.Tensor]]]:
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import LoRALayerWeights, PackedLoRALayerWeights

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    dense = LoRALayerWeights("model.layers.0.self_attn.q_proj", 8, 16, torch.randn(8, 64, generator=g).to(bf),
                             torch.randn(64, 8, generator=g).to(bf), scaling=2.0)
    a = [torch.randn(4, 8, 64, generator=g).to(bf) for _ in range(3)]
    b = [torch.randn(4, 32, 8, generator=g).to(bf) for _ in range(3)]
    moe = PackedLoRALayerWeights("model.layers.0.mlp.experts", 8, [1, 1, 1], list(a), list(b), scaling=[1.0] * 3)
    model = LoRAModel(1, 8, {dense.module_name: dense, moe.module_name: moe})
    expected = {"dense_a": [dense.lora_a.clone()], "dense_b": [(dense.lora_b * 2.0).to(bf)],  # scaling folded
                "moe_a": [t.clone() for t in a], "moe_b": [t.clone() for t in b]}
    return model, expected


def test_stage_then_unstage_round_trips_bitwise_and_frees_the_buffer(monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext.integration.staging import stage, staged_bytes, unstage

    model, expected = _model()
    dense, moe = model.loras["model.layers.0.self_attn.q_proj"], model.loras["model.layers.0.mlp.experts"]
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    assert stage(model, "cuda:0")
    assert staged_bytes() > 0
    assert dense.scaling == 1.0 and dense.lora_a.is_cuda and all(t.is_cuda for t in moe.lora_a + moe.lora_b)
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


def _built_model(tmp_path: Any, prestage: Any, scaling: float) -> tuple[Any, Any, dict[str, list[torch.Tensor]]]:
    """A real build process's MoE build (2D, two blocks) as vLLM's packed weights: the model, its mapping, and the
    expected factors (the second block's B scaled by ``scaling``, as vLLM's ``optimize()`` folds it)."""
    from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.lora_weights import PackedLoRALayerWeights

    from vllm_lora_ext.integration import build_process
    from vllm_lora_ext.integration.key_router import VllmKeyRouter

    folder = write_moe_adapter(tmp_path / "moe", [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s) for s in (0, 1)],
                               ["2d", "2d"], rank=BUILD_R)
    found = build_process.build_elsewhere(moe_build_job(folder), VllmKeyRouter(None, None), prestage=prestage)
    assert found is not None
    built, mapping = found
    loras, expected = {}, {}
    for k, (prefix, (lora_a, lora_b, rank)) in enumerate(sorted(built.moe.items())):
        scale = scaling if k == 1 else 1.0
        loras[prefix] = PackedLoRALayerWeights(prefix, rank, [1] * len(lora_a), list(lora_a), list(lora_b),
                                               scaling=[scale] * len(lora_a))
        expected[prefix] = [t.clone() for t in lora_a] + [(t * scale).to(t.dtype) for t in lora_b]
    return LoRAModel(1, 8, loras), mapping, expected


@pytest.mark.parametrize("forget_scaled", [False, True])
def test_a_build_copied_while_built_stages_and_unstages_bitwise_and_a_scaled_b_is_copied_again(
        tmp_path: Any, build_dir: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture,
        forget_scaled: bool) -> None:
    """The image (``transport.prestage``) takes the place of the copy after the build; a B that ``optimize()`` scales
    after its block was copied must go up again (the control, ``forget_scaled``, skips that and must differ)."""
    from vllm_lora_ext.integration import staging
    from vllm_lora_ext.integration.patching import PRESTAGE_ATTR, STAGED_ATTR
    from vllm_lora_ext.transport.prestage import prestaged_bytes

    if forget_scaled:
        real = staging._optimize
        monkeypatch.setattr(staging, "_optimize", lambda lora: (real(lora), set())[1])
    prestage = staging.prestage_for("cuda:0")
    assert prestage is not None
    model, mapping, expected = _built_model(tmp_path, prestage, 3.0)
    assert prestage.spans.total > 0 and prestage.refused is None  # the blocks went up while the build ran
    setattr(model, PRESTAGE_ATTR, (prestage, mapping))
    with caplog.at_level("INFO", logger=staging.__name__):
        assert staging.stage(model, "cuda:0")
    assert "while it was built" in caplog.text and prestaged_bytes() == 0
    image = getattr(model, STAGED_ATTR).buffer
    got = {p: [*w.lora_a, *w.lora_b] for p, w in model.loras.items()}
    assert all(t.is_cuda and t.untyped_storage().data_ptr() == image.untyped_storage().data_ptr()
               for ts in got.values() for t in ts)
    same = all(torch.equal(g.cpu(), w) for p in expected for g, w in zip(got[p], expected[p]))
    assert same != forget_scaled
    assert staging.unstage(model) == 0  # every CPU twin is a view of the hand-over's mapping: nothing copied back
    for p, weights in model.loras.items():
        for t, w in zip([*weights.lora_a, *weights.lora_b], expected[p]):
            assert t.device.type == "cpu" and t.untyped_storage().data_ptr() == mapping.untyped_storage().data_ptr()
            assert torch.equal(t, w)
    assert staging.staged_bytes() == 0


@pytest.mark.parametrize("rows", [16, 8192])
def test_a_tensor_outside_the_build_goes_in_the_images_room_or_the_whole_model_is_copied(
        tmp_path: Any, build_dir: Any, caplog: pytest.LogCaptureFixture, rows: int) -> None:
    """vLLM pins a dense factor into new memory (``from_lora_tensors``): a small one is laid out in the image after
    the build's bytes; one too large for the room left there sends the model to the copy path, the image freed."""
    from vllm.lora.lora_weights import LoRALayerWeights

    from vllm_lora_ext.integration import staging
    from vllm_lora_ext.integration.patching import PRESTAGE_ATTR
    from vllm_lora_ext.transport.prestage import prestaged_bytes

    prestage = staging.prestage_for("cuda:0")
    if rows == 16:  # the room a real build's image keeps for its dense factors (this adapter has none)
        hear = prestage.hear
        prestage.hear = lambda ev: hear(ev if ev[0] != "arena" else (*ev[:3], ev[3] + (1 << 20)))
    model, mapping, expected = _built_model(tmp_path, prestage, 1.0)
    g = torch.Generator().manual_seed(3)
    extra = LoRALayerWeights("model.layers.0.self_attn.q_proj", 8, 16, torch.randn(8, rows, generator=g).to(
        torch.bfloat16).pin_memory(), torch.randn(rows, 8, generator=g).to(torch.bfloat16).pin_memory(), scaling=2.0)
    want = {"a": extra.lora_a.clone(), "b": (extra.lora_b * 2.0).to(torch.bfloat16)}
    model.loras[extra.module_name] = extra
    setattr(model, PRESTAGE_ATTR, (prestage, mapping))
    with caplog.at_level("INFO", logger=staging.__name__):
        assert staging.stage(model, "cuda:0")
    assert ("while it was built" in caplog.text) == (rows == 16) and prestaged_bytes() == 0
    assert torch.equal(extra.lora_a.cpu(), want["a"]) and torch.equal(extra.lora_b.cpu(), want["b"])
    for p, w in expected.items():
        assert all(torch.equal(g.cpu(), x) for g, x in zip([*model.loras[p].lora_a, *model.loras[p].lora_b], w))
    assert staging.unstage(model) == 0
    assert torch.equal(extra.lora_a, want["a"]) and torch.equal(extra.lora_b, want["b"])
    assert staging.staged_bytes() == 0
