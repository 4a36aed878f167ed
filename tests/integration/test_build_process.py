"""Builds in a separate build process: the same tensors as a build in the worker, typed errors, a dead process.

The build process is the real one (``python -m vllm_lora_ext.integration.build_child``, vLLM's key
parser inside it); the tensors come back through a real shared file.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

import pytest
import torch

from factories import make_peft_adapter, tiny_llama
from moe_factories import BUILD_BLOCKS, BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
from vllm_lora_ext.building import BuildJob, build_adapter
from vllm_lora_ext.errors import AdapterCompatibilityError, BuildProcessError, ExpertLayoutError
from vllm_lora_ext.integration import build_child, build_process
from vllm_lora_ext.integration.loader import VllmKeyRouter, load_lora_model

E, H, I, R = BUILD_E, BUILD_H, BUILD_I, BUILD_R
BLOCKS = BUILD_BLOCKS
pytestmark = [pytest.mark.vllm, pytest.mark.usefixtures("build_dir")]


@pytest.fixture
def started() -> None:
    """A build process that has finished starting, idle in the pool."""
    build_process._POOL.get()


def _request(path: Path | str, name: str = "a", lora_id: int = 3) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=str(path))


def _moe_job(path: Path, *, wrapper: str = "2d", experts: tuple[int, ...] | None = None) -> BuildJob:
    return moe_build_job(path, wrapper=wrapper, experts=experts)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("forms", "wrapper", "experts"), [
    (["2d", "2d"], "2d", None), (["3d", "3d_t"], "3d", None), (["2d", "3d"], "2d", (1, 3)),
])
def test_the_build_process_gives_the_tensors_a_build_in_the_worker_gives(
        tmp_path: Path, build_dir: Path, forms: list[str], wrapper: str, experts: tuple[int, ...] | None,
        caplog: pytest.LogCaptureFixture) -> None:
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], forms, rank=R)
    job = _moe_job(folder, wrapper=wrapper, experts=experts)
    router = VllmKeyRouter(None, None)
    here = build_adapter(job, router)
    with caplog.at_level("INFO", logger=build_process.__name__):
        there, mapping = build_process.build_elsewhere(job, router)
    assert "adapter 'moe': the build process answered" in caplog.text  # the worker's wait, for B's breakdown
    # the shared file's name is gone once mapped (the spare and the owner's lock file stay while the process lives)
    assert [n for n in os.listdir(build_dir) if "-spare-" not in n and not n.endswith(".lock")] == []
    assert sorted(there.moe) == sorted(here.moe) and there.bytes_read == here.bytes_read
    for prefix, (a, b, rank) in here.moe.items():
        a2, b2, rank2 = there.moe[prefix]
        assert rank2 == rank and len(a2) == len(a) and len(b2) == len(b)
        for x, y in zip((*a, *b), (*a2, *b2)):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            assert y.untyped_storage().data_ptr() == mapping.untyped_storage().data_ptr()  # views, no copy


@pytest.mark.parametrize("wrapper", ["2d", "3d"])
def test_a_build_process_leaves_b_as_stored_for_a_gpu_and_says_where_across_the_hand_over(
        tmp_path: Path, wrapper: str) -> None:
    """``BuildJob.defer_turn`` (a background build for a GPU): the build process's hand-over names each B it left as
    stored, and turning those gives the worker's ordinary build bit for bit."""
    from dataclasses import replace

    from vllm_lora_ext.formats.moe import turn_in_place

    truths = [make_truth(E, H, I, R, s, dtype=torch.bfloat16) for s in (0, 1)]
    folder = write_moe_adapter(tmp_path / "moe", truths, ["3d", "3d"], rank=R, alpha=24)
    job = replace(_moe_job(folder, wrapper=wrapper), scan_moe=False)
    router = VllmKeyRouter(None, None)
    here = build_adapter(job, router)
    there, _ = build_process.build_elsewhere(replace(job, defer_turn=True), router)
    assert sorted(there.unturned) == sorted(BLOCKS) and here.unturned == {}
    for prefix, parts in there.unturned.items():
        for i, rows, cols, scale in parts:
            assert not torch.equal(there.moe[prefix][1][i], here.moe[prefix][1][i])
            turn_in_place(there.moe[prefix][1][i], rows, cols, scale)
    for prefix, (a, b, _) in here.moe.items():
        for x, y in zip((*a, *b), (*there.moe[prefix][0], *there.moe[prefix][1])):
            assert torch.equal(x, y)


def test_a_worker_load_through_the_build_process_equals_vllms_own(worker_manager: Any, tmp_path: Path,
                                                                   started: None) -> None:
    from vllm.lora.worker_manager import WorkerLoRAManager

    adapter = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj", "v_proj", "down_proj"], rank=8,
                                alpha=16)
    req = _request(adapter)
    reference = WorkerLoRAManager._load_adapter(worker_manager, req)  # vLLM's own (the plugin is not registered)
    built = load_lora_model(worker_manager, req, separate_process=True)
    assert sorted(built.loras) == sorted(reference.loras)
    for name, weights in reference.loras.items():
        assert torch.equal(built.loras[name].lora_a, weights.lora_a)
        assert torch.equal(built.loras[name].lora_b, weights.lora_b)
        assert built.loras[name].scaling == weights.scaling


def test_errors_come_back_typed_and_the_process_lives_on(worker_manager: Any, tmp_path: Path, started: None) -> None:
    from vllm.exceptions import LoRAAdapterNotFoundError

    big = make_peft_adapter(tiny_llama(), tmp_path / "big", targets=["q_proj"], rank=32, alpha=32)  # max rank 16
    with pytest.raises(AdapterCompatibilityError, match="max_lora_rank") as caught:
        load_lora_model(worker_manager, _request(big, name="big"), separate_process=True)
    assert caught.value.adapter == "big"
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found"):
        load_lora_model(worker_manager, _request(tmp_path / "missing", name="gone"), separate_process=True)
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H + 1, I, R, 0)], ["2d"], rank=R)  # wrong hidden
    with pytest.raises(ExpertLayoutError):
        build_process.build_elsewhere(_moe_job(folder), VllmKeyRouter(None, None))
    ok = make_peft_adapter(tiny_llama(), tmp_path / "ok", targets=["q_proj"], rank=4, alpha=8)
    assert load_lora_model(worker_manager, _request(ok), separate_process=True).loras


def test_an_error_of_another_type_comes_back_as_that_type_with_its_text(tmp_path: Path, started: None) -> None:
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    child = build_process._POOL.get()
    with pytest.raises(Exception) as caught:
        child.run(_moe_job(folder), "not a mapper", None)  # vLLM's key parser fails on it in the build process
    assert type(caught.value).__module__ == "builtins" and str(caught.value), caught.value
    built, _ = build_process.build_elsewhere(_moe_job(folder), VllmKeyRouter(None, None))  # the process lives on
    assert sorted(built.moe) == sorted(BLOCKS) and build_process._POOL.get() is child


def test_a_dead_build_process_fails_its_build_and_the_next_build_starts_a_new_one(tmp_path: Path) -> None:
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    job, router = _moe_job(folder), VllmKeyRouter(None, None)
    build_process.build_elsewhere(job, router)
    child = build_process._POOL.get()  # the process the build above used
    os.kill(child.proc.pid, signal.SIGKILL)
    child.proc.wait()
    with pytest.raises(BuildProcessError, match="build process"):
        child.run(job, None, None)
    built, _ = build_process.build_elsewhere(job, router)  # a new process
    assert build_process._POOL.get() is not child
    assert sorted(built.moe) == sorted(BLOCKS)


def test_a_build_process_ends_when_its_worker_closes_the_pipe() -> None:
    child = build_process._POOL.get()
    pid = child.proc.pid
    child.close()  # closes its stdin
    assert child.proc.wait(timeout=120) == 0  # a clean exit (slow only on a loaded 2-core machine)
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_build_process_closed_as_soon_as_it_is_ready_exits_cleanly(monkeypatch: pytest.MonkeyPatch) -> None:
    """Its first spare is being made then; exiting while that thread was inside torch aborted the process
    ("terminate called without an active exception", code -6) in 5-6 of 6 tries with the default 2 GiB spare in a
    build folder on disk (allocated there, never written)."""
    monkeypatch.setenv("VLLM_LORA_EXT_BUILD_SPARE_BYTES", str(2 << 30))
    for _ in range(3):
        child = build_process._Child()
        child.wait_ready()
        child.close()
        assert child.proc.wait(timeout=120) == 0


def test_while_no_build_process_has_started_the_build_runs_in_the_worker_and_one_starts(
        worker_manager: Any, tmp_path: Path, jobs_sent: list[str], caplog: pytest.LogCaptureFixture) -> None:
    """... and, once started, plans the worker's build ahead (the loader's part of it)."""
    import time

    from vllm_lora_ext.integration import loader

    jobs = jobs_sent
    build_process.shutdown()
    adapter = make_peft_adapter(tiny_llama(), tmp_path / "a", targets=["q_proj"], rank=4, alpha=8)
    reads = loader.LOCAL_READS["adapters"]
    with caplog.at_level("INFO", logger=build_process.__name__):
        here = load_lora_model(worker_manager, _request(adapter), separate_process=True)  # does not wait 15 s
        assert loader.LOCAL_READS["adapters"] == reads + 1 and here.loras and jobs == []
        build_process._POOL.get()  # the one that began starting
        deadline = time.monotonic() + 60
        while "adapter 'a': the build process planned it ahead" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "adapter 'a': the build process planned it ahead" in caplog.text
    there = load_lora_model(worker_manager, _request(adapter), separate_process=True)
    assert jobs == ["a"]  # now in the build process
    for name, weights in here.loras.items():
        assert torch.equal(there.loras[name].lora_b, weights.lora_b)


def test_builds_asked_for_at_once_run_in_the_one_process_and_each_gets_its_own_answer(
        tmp_path: Path, started: None) -> None:
    from concurrent.futures import ThreadPoolExecutor

    folders = [write_moe_adapter(tmp_path / f"moe{i}", [make_truth(E, H, I, R, 10 * i + s) for s in (0, 1)],
                                 [form, form], rank=R) for i, form in enumerate(["2d", "3d", "2d", "3d_t"])]
    bad = write_moe_adapter(tmp_path / "bad", [make_truth(E, H + 1, I, R, 0)], ["2d"], rank=R)
    router = VllmKeyRouter(None, None)
    jobs = [_moe_job(f) for f in folders] + [_moe_job(bad)]
    child = build_process._POOL.get()
    futures = [child.submit(job, None, None) for job in jobs]  # all in flight together
    with pytest.raises(ExpertLayoutError):
        futures[-1].result()
    for job, future in zip(jobs, futures[:-1]):
        there, _ = build_process.from_shared(future.result())
        here = build_adapter(job, router)
        for prefix, (a, b, _) in here.moe.items():
            assert all(torch.equal(x, y) for x, y in zip((*a, *b), (*there.moe[prefix][0], *there.moe[prefix][1])))
    with ThreadPoolExecutor(4) as pool:  # the same through build_elsewhere, from worker threads
        built = list(pool.map(lambda job: build_process.build_elsewhere(job, router)[0], jobs[:-1]))
    assert [sorted(b.moe) for b in built] == [sorted(BLOCKS)] * 4
    assert build_process._POOL.get() is child  # one process did all of it


def test_a_process_that_dies_fails_every_build_it_had_in_flight(tmp_path: Path, started: None) -> None:
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    child = build_process._POOL.get()
    os.kill(child.proc.pid, signal.SIGSTOP)  # hold it so both builds are surely in flight when it dies
    futures = [child.submit(_moe_job(folder), None, None) for _ in range(2)]
    os.kill(child.proc.pid, signal.SIGKILL)
    for future in futures:
        with pytest.raises(BuildProcessError, match="exited"):
            future.result(timeout=60)


def test_the_spare_is_cut_only_after_the_worker_has_removed_its_name(tmp_path: Path, build_dir: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Cutting the file takes its inode lock while its pages are freed; the worker's map and unlink of the same
    file must not wait for that, so the build process cuts it only once the name is gone. Its own views of the
    build (unmapping a whole spare takes a tenth of a second) are dropped then too, after the answer, not before."""
    import threading
    import time

    from vllm_lora_ext.transport.arena import ArenaSupply
    from vllm_lora_ext.transport.handover import from_shared, to_shared
    from vllm_lora_ext.integration.loader import VllmKeyRouter

    monkeypatch.setattr(build_child, "_SETTLE_S", 0.0)
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    supply = ArenaSupply(1 << 20)
    supply.prepare(wait=True)
    built = build_adapter(_moe_job(folder), VllmKeyRouter(None, None), shared=True, arenas=supply)
    shared = to_shared(built, trim=False)
    held = [built]
    del built
    fd = os.open(shared.path, os.O_RDWR)
    after = threading.Thread(target=build_child._after_hand_over, args=(fd, shared, supply, held))
    after.start()
    time.sleep(0.2)
    assert os.path.getsize(shared.path) == 1 << 20  # the name is still there: not cut yet
    assert len(held) == 1  # nor unmapped here
    probe = os.open(shared.path, os.O_RDONLY)
    handed, mapping = from_shared(shared)  # maps the used part and removes the name
    after.join(10)
    assert not after.is_alive() and held == []
    try:
        assert os.fstat(probe).st_size == shared.size < 1 << 20  # cut once the name was gone
    finally:
        os.close(probe)
    assert mapping.numel() == shared.size
    for a in handed.moe.values():
        assert all(torch.isfinite(t.float()).all() for t in (*a[0], *a[1]))
    supply.discard()


def test_the_build_process_answers_before_it_drops_its_own_mapping_of_the_build(tmp_path: Path, build_dir: Path,
                                                                                monkeypatch: pytest.MonkeyPatch,
                                                                                caplog: pytest.LogCaptureFixture) -> None:
    """Unmapping a spare whose every page is mapped takes a tenth of a second on a GPU host: the answer goes first,
    and the build process drops its mapping once the worker has mapped the file (removed its name)."""
    import io
    import pickle
    import time

    from vllm_lora_ext.transport.arena import ArenaSupply

    def mapped(path: str) -> bool:
        return path in Path("/proc/self/maps").read_text()

    monkeypatch.setattr(build_child, "_SETTLE_S", 0.0)
    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    supply = ArenaSupply(1 << 20)
    supply.prepare(wait=True)
    assert supply._spare is not None
    spare = supply._spare.path
    at_answer: list[bool] = []

    class Pipe(io.BytesIO):
        def flush(self) -> None:
            at_answer.append(mapped(spare))
            super().flush()

    out = Pipe()
    try:
        with caplog.at_level("INFO", logger=build_child.__name__):
            build_child._answer(out, 7, _moe_job(folder), None, None, supply, (time.perf_counter(), 0.25))
        assert "in the pipe 0.25 s, queued" in caplog.text  # the job's time from the worker's send, logged
        kind, number, shared = pickle.loads(out.getvalue())
        assert (kind, number, shared.path) == ("ok", 7, spare) and at_answer == [True]
        assert mapped(spare)  # kept while the worker has not mapped it
        os.unlink(shared.path)  # what the worker does once it has mapped the file
        deadline = time.monotonic() + 10
        while mapped(spare) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert not mapped(spare)
    finally:
        supply.discard()


def test_a_build_process_still_starting_plans_the_workers_builds_ahead_for_the_next_adapter_of_their_shape(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """While the process starts, the worker builds in its own thread (a server's adapters named at its start); once
    started, the process plans those adapters ahead in the order built, so the next adapter of the first one's
    shape (byte-equal header: trained the same way) takes the kept header and plan there, although a small adapter
    (whose header is not kept) was built after it. A process that planned nothing ahead plans it anew (control)."""
    import time

    from vllm_lora_ext.formats.moe import MoESpec
    from vllm_lora_ext.planning import ModelSpec

    e, h, i, r = 128, 8, 4, 2  # 1,536 keys: a header large enough to be kept (64 KiB or more)
    truths = [make_truth(e, h, i, r, s) for s in (0, 1)]
    folders = [write_moe_adapter(tmp_path / n, truths, ["2d", "2d"], rank=r) for n in ("first", "next")]
    model = ModelSpec(frozenset(BLOCKS), moe={p: MoESpec(p, e, h, i) for p in BLOCKS}, max_rank=16)
    jobs = [BuildJob(path=str(f), name=f.name, model=model, dtype=torch.bfloat16) for f in folders]
    small = write_moe_adapter(tmp_path / "small", [make_truth(E, H, I, R, s) for s in (0, 1)], ["3d", "3d"], rank=R)
    router = VllmKeyRouter(None, None)
    build_process.shutdown()
    with caplog.at_level("INFO", logger=build_process.__name__):
        for job in (jobs[0], _moe_job(small)):
            assert build_process.build_elsewhere(job, router, wait_for_start=False) is None  # built here instead
            build_adapter(job, router)
            build_process.plan_ahead(job, router)  # (what the loader does after a build here)
        build_process._POOL.get()
        deadline = time.monotonic() + 60
        while caplog.text.count("the build process planned it ahead") < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert "adapter 'first': the build process planned it ahead in" in caplog.text
    assert "adapter 'moe': the build process planned it ahead in" in caplog.text
    built, _ = build_process.build_elsewhere(jobs[1], router)
    assert built.plan_kept
    build_process.shutdown()
    built, _ = build_process.build_elsewhere(jobs[1], router)  # a new process: nothing planned ahead
    assert not built.plan_kept


def test_a_job_that_cannot_be_sent_to_plan_ahead_is_dropped_and_the_process_lives_on(tmp_path: Path,
                                                                                      started: None) -> None:
    """A plan ahead is a speed-up only: a job that cannot be pickled (sent from the reader's thread once the process
    is ready) is dropped, and neither the caller nor the process fails (r37's review: it ended the process)."""
    import threading

    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    child = build_process._POOL.get()
    child.plan_ahead(_moe_job(folder), threading.Lock(), None)  # a mapper pickle refuses
    built, _ = build_process.build_elsewhere(_moe_job(folder), VllmKeyRouter(None, None))
    assert child.alive and build_process._POOL.get() is child and sorted(built.moe) == sorted(BLOCKS)
