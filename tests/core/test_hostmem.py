"""Huge-page host arenas (no vLLM): views, the release hook's timing, and builds bitwise equal with and without them."""

from __future__ import annotations

import gc
import time
from pathlib import Path

import pytest
import torch

from factories import lora_config, write_adapter
from moe_factories import (BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, spy_gpu_transposes,
                           write_moe_adapter)
from vllm_lora_ext import building
from vllm_lora_ext.building import BuildJob, build_adapter
from vllm_lora_ext.transport import arena as hostmem
from vllm_lora_ext.constants import ENV_HOST_ARENA_MIN, ENV_HOST_ARENAS, ENV_HOST_SPARE
from vllm_lora_ext.transport.arena import HUGE_PAGE, HostArena, clear_spare, prepare_spare
from vllm_lora_ext.mixing import concat_many
from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter
from vllm_lora_ext.reader import SafetensorsReader

E, H, I, R = BUILD_E, BUILD_H, BUILD_I, BUILD_R


def test_tensors_are_aligned_views_and_an_arena_past_its_capacity_gives_ordinary_memory() -> None:
    arena = HostArena(1)
    assert arena.capacity == HUGE_PAGE  # whole huge pages
    a = arena.empty((3,), torch.uint8)
    b = arena.empty((5, 7), torch.float32)
    assert arena.holds(a) and arena.holds(b)
    assert b.data_ptr() - a.data_ptr() == 64 and b.data_ptr() % 64 == 0
    b.fill_(2.5)
    assert float(b.sum()) == 2.5 * 35
    big = arena.empty((HUGE_PAGE,), torch.uint8)  # does not fit what is left
    assert not arena.holds(big) and big.numel() == HUGE_PAGE
    arena.close()
    assert not arena.holds(arena.empty((4,), torch.uint8))  # closed: ordinary memory
    with pytest.raises(RuntimeError, match="closed"):
        arena.on_release(lambda: None)


@pytest.mark.parametrize("reuse", [False, True])
def test_the_release_hook_runs_once_when_the_last_view_is_gone_not_before(monkeypatch: pytest.MonkeyPatch,
                                                                           reuse: bool) -> None:
    monkeypatch.setenv(ENV_HOST_SPARE, "0")  # nothing kept: a reuse arena's memory is returned as well
    arena = HostArena(4 << 20, reuse=reuse)
    calls: list[int] = []
    arena.on_release(lambda: calls.append(1))
    t = arena.empty((16, 16), torch.bfloat16)
    view = t[2:4].view(torch.int16)
    arena.close()
    del t
    gc.collect()
    assert calls == []  # a view still holds the memory
    view.fill_(7)
    del view
    gc.collect()
    assert calls == [1]


def test_a_failing_release_hook_is_logged_and_the_memory_still_returned(caplog: pytest.LogCaptureFixture) -> None:
    arena = HostArena(1)
    after: list[int] = []

    def boom() -> None:
        raise RuntimeError("driver gone")

    arena.on_release(boom)
    arena.on_release(lambda: after.append(1))
    t = arena.empty((8,), torch.uint8)
    arena.close()
    del t
    gc.collect()
    assert after == [1] and "release hook failed" in caplog.text


def test_read_many_into_an_arena_equals_read_many_copying(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    tensors = {f"t{i}": torch.randn(5, 3 + i, generator=g).to(torch.bfloat16 if i % 2 else torch.float32)
               for i in range(6)}
    tensors["odd"] = torch.arange(3, dtype=torch.uint8)  # leaves the next tensor unaligned in its span
    tensors["after"] = torch.randn(4, generator=g)
    path = write_adapter(tmp_path, tensors, None)
    reader = SafetensorsReader(path)
    keys = ["t5", "t0", "odd", "after", "t2"]
    arena = HostArena(1 << 20)
    got = reader.read_many(keys, into=arena.empty)
    want = reader.read_many(keys, copy=True)
    assert list(got) == keys
    for k in keys:
        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k])
    assert arena.holds(got["t5"]) and arena.holds(got["odd"])


def _moe_tensors(built: building.BuiltAdapter) -> list[torch.Tensor]:
    return [t for p in sorted(built.moe) for t in (*built.moe[p][0], *built.moe[p][1])]


@pytest.mark.parametrize(("forms", "wrapper", "experts"), [
    (["2d", "2d"], "2d", None), (["2d", "3d"], "2d", (1, 3)), (["3d", "3d"], "2d", None), (["3d", "3d_t"], "3d", None),
    (["3d", "2d"], "3d", None),
])
def test_a_build_into_a_host_arena_is_bitwise_the_build_without_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, forms: list[str], wrapper: str,
        experts: tuple[int, ...] | None) -> None:
    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, s) for s in (0, 1)], forms, rank=R)
    job = moe_build_job(folder, wrapper=wrapper, experts=experts)
    monkeypatch.setenv(ENV_HOST_ARENAS, "0")
    reference = build_adapter(job, PeftKeyRouter())
    assert reference.host is None
    monkeypatch.setenv(ENV_HOST_ARENAS, "1")
    monkeypatch.setenv(ENV_HOST_ARENA_MIN, "0")  # the test adapter is far below the default threshold
    built = build_adapter(job, PeftKeyRouter())
    assert built.host is not None
    got, want = _moe_tensors(built), _moe_tensors(reference)
    assert len(got) == len(want)
    for x, y in zip(got, want):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
    if wrapper == "3d" or forms == ["2d", "2d"]:  # nothing is split after the read: every factor lies in the arena
        assert all(built.host.holds(t) for t in got)
    assert built.host.used <= built.host.capacity


def test_dense_factors_are_read_into_the_arena_and_equal_a_copying_read(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for layer in range(2):
        for m, (d_in, d_out) in {"q_proj": (16, 16), "v_proj": (16, 8)}.items():
            p = f"base_model.model.model.layers.{layer}.self_attn.{m}"
            tensors[f"{p}.lora_A.weight"] = torch.randn(4, d_in, generator=g).bfloat16()
            tensors[f"{p}.lora_B.weight"] = torch.randn(d_out, 4, generator=g).bfloat16()
    write_adapter(tmp_path, tensors, lora_config(4, 8))
    accepted = frozenset(f"model.layers.{i}.self_attn.{m}" for i in range(2) for m in ("q_proj", "v_proj"))
    job = BuildJob(path=str(tmp_path), name="dense", model=ModelSpec(accepted))
    monkeypatch.setenv(ENV_HOST_ARENA_MIN, "0")
    built = build_adapter(job, PeftKeyRouter())
    assert built.host is not None and list(built.dense) == list(tensors)
    for k, t in built.dense.items():
        assert built.host.holds(t) and torch.equal(t, tensors[k])


def _release(arena: HostArena, *views: torch.Tensor) -> None:
    arena.close()
    del views
    gc.collect()


@pytest.fixture()
def spare(monkeypatch: pytest.MonkeyPatch) -> object:
    monkeypatch.setenv(ENV_HOST_SPARE, str(64 << 20))
    clear_spare()
    yield hostmem._SPARE
    clear_spare()


def test_a_reuse_arena_is_given_a_released_reuse_arenas_memory_of_about_its_size(spare: object) -> None:
    first = HostArena(4 << 20, reuse=True)
    t = first.empty((1024,), torch.float32)
    t.fill_(1.5)
    base = first.base
    _release(first, t)
    del t
    gc.collect()
    other = HostArena(4 << 20)
    assert other.base != base  # an arena that did not ask is never given used memory
    larger = HostArena(32 << 20, reuse=True)
    assert larger.base != base  # too small for it (and this arena's memory, once released, takes its place)
    second = HostArena(3 << 20, reuse=True)  # 4 MiB of pages for 3 MiB asked: close enough
    assert second.base == base and second.reused and second.capacity == 4 << 20
    # Kept memory holds the earlier arena's bytes (which is why only writers of every byte ask for it).
    assert float(second.empty((1024,), torch.float32)[0]) == 1.5


def test_kept_memory_is_returned_when_displaced_or_cleared_and_not_kept_past_the_budget(
        spare: object, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[str] = []
    a = HostArena(4 << 20, reuse=True)
    a.on_release(lambda: calls.append("a"))
    _release(a)
    assert calls == []  # kept as the spare
    b = HostArena(8 << 20, reuse=True)  # does not fit the kept 4 MiB: new memory
    b.on_release(lambda: calls.append("b"))
    _release(b)
    assert calls == ["a"]  # b's memory took a's place
    clear_spare()
    assert calls == ["a", "b"]
    monkeypatch.setenv(ENV_HOST_SPARE, str(2 << 20))
    c = HostArena(4 << 20, reuse=True)
    c.on_release(lambda: calls.append("c"))
    _release(c)
    assert calls == ["a", "b", "c"]  # over the budget: returned at once


def _wait_prepared(spare: object) -> None:
    for _ in range(500):
        if not spare._preparing:  # type: ignore[attr-defined]
            return
        time.sleep(0.01)
    raise AssertionError("the spare was not prepared in 5 s")


def test_a_prepared_spare_is_touched_readied_and_given_to_the_next_arena_of_its_size(spare: object) -> None:
    readied: list[tuple[int, int]] = []
    assert prepare_spare(5 << 20, ready=lambda arena: readied.append((arena.used, arena.capacity)))
    _wait_prepared(spare)
    assert readied == [(6 << 20, 6 << 20)]  # every page (whole huge pages) touched, then readied (pinned)
    assert not prepare_spare(5 << 20)  # one that fits is kept already
    assert not prepare_spare(128 << 20)  # past the budget
    arena = HostArena(5 << 20, reuse=True)
    assert arena.reused and arena.capacity == 6 << 20
    assert not HostArena(5 << 20, reuse=True).reused  # the one spare is taken


def test_a_mix_concatenated_into_kept_memory_is_bitwise_one_into_fresh_memory(spare: object) -> None:
    g = torch.Generator().manual_seed(5)
    jobs = {f"m{i}": ([(torch.randn(r, 96, generator=g).bfloat16(), torch.randn(80, r, generator=g).bfloat16(), c)
                       for r, c in ((4, 0.3), (8, -1.7), (2, 2.0))], 0, 1) for i in range(6)}
    want = concat_many(jobs)
    dirty = HostArena(2 << 20, reuse=True)
    assert dirty.buffer is not None
    dirty.buffer.fill_(0xFF)  # NaN in bfloat16: any byte left unwritten would show
    _release(dirty)
    arena = HostArena(2 << 20, reuse=True)
    assert arena.reused
    got = concat_many(jobs, alloc=arena.empty)
    for key in jobs:
        for x, y in zip(got[key], want[key]):
            assert arena.holds(x) and torch.equal(x, y)


def test_a_forked_child_starts_with_no_spare_and_can_prepare_one(spare: object) -> None:
    import os

    kept = HostArena(4 << 20, reuse=True)
    calls: list[int] = []
    kept.on_release(lambda: calls.append(1))
    _release(kept)
    spare._preparing = True  # type: ignore[attr-defined]  # as if the parent's helper thread were at work
    pid = os.fork()
    if pid == 0:  # the child: nothing kept, nothing in preparation, and a spare of its own can be made
        fresh = HostArena(4 << 20, reuse=True)
        ok = (spare._memory is None and not spare._preparing  # type: ignore[attr-defined]
              and not fresh.reused and prepare_spare(4 << 20))
        os._exit(0 if ok else 1)
    _, status = os.waitpid(pid, 0)
    spare._preparing = False  # type: ignore[attr-defined]
    assert os.waitstatus_to_exitcode(status) == 0
    assert spare._memory is not None and calls == []  # the parent keeps its spare
    clear_spare()
    assert calls == [1]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the fallback where the GPU cannot be used")
@pytest.mark.parametrize("wrapper", ["2d", "3d"])
def test_a_build_asked_to_transpose_on_a_gpu_it_cannot_use_transposes_on_the_cpu_bitwise_alike(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, wrapper: str) -> None:
    truths = [make_truth(E, H, I, R, s, dtype=torch.bfloat16) for s in (0, 1)]  # the job's dtype: read transposed
    folder = write_moe_adapter(tmp_path / "a", truths, ["3d", "3d"], rank=R, alpha=24)
    job = moe_build_job(folder, wrapper=wrapper)
    monkeypatch.setenv(ENV_HOST_ARENA_MIN, "0")
    want = _moe_tensors(build_adapter(job, PeftKeyRouter()))
    tried = spy_gpu_transposes(monkeypatch)
    built = build_adapter(job, PeftKeyRouter(), transpose_on=torch.device("cuda", 0))
    assert tried == [False] * 4 and built.turned_on_gpu == 0  # every B offered to the GPU, and done here instead
    got = _moe_tensors(built)
    assert len(got) == len(want) and all(torch.equal(x, y) for x, y in zip(got, want))
