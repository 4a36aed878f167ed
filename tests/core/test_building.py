"""Builds as plain data and their hand-over through one shared file (no vLLM): bitwise equal, nothing left behind."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
from vllm_lora_ext.building import BuildJob, build_adapter
from vllm_lora_ext.transport.files import on_tmpfs, sweep_stale
from vllm_lora_ext.transport.handover import from_shared, to_shared, trim_shared
from vllm_lora_ext.errors import AdapterFormatError
from vllm_lora_ext.planning import PeftKeyRouter

E, H, I, R = BUILD_E, BUILD_H, BUILD_I, BUILD_R
pytestmark = pytest.mark.usefixtures("build_dir")



def _files(folder: Path) -> list[str]:
    """The files in a build folder, without the owners' lock files (see sharedfiles)."""
    return [n for n in os.listdir(folder) if not n.endswith(".lock")]

def _job(path: Path, wrapper: str, experts: tuple[int, ...] | None = None) -> BuildJob:
    return moe_build_job(path, wrapper=wrapper, experts=experts)  # type: ignore[no-any-return]


def _tensors(built: object) -> list[torch.Tensor]:
    return [t for p in sorted(built.moe) for t in (*built.moe[p][0], *built.moe[p][1])]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("forms", "wrapper", "experts"), [
    (["2d", "2d"], "2d", None), (["2d", "2d"], "3d", (0, 2)), (["3d", "2d"], "2d", None), (["3d_t", "3d"], "3d", None),
])
def test_a_build_handed_over_in_shared_memory_is_bitwise_the_build(tmp_path: Path, build_dir: Path, forms: list[str],
                                                                    wrapper: str, experts: tuple[int, ...] | None) -> None:
    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, s) for s in (0, 1)], forms, rank=R)
    job = _job(folder, wrapper, experts)
    reference = build_adapter(job, PeftKeyRouter())
    for shared in (False, True):  # built in new tensors, then copied; or straight into the shared file
        built = build_adapter(job, PeftKeyRouter(), shared=shared)
        assert (built.arena is not None) == shared
        if shared and wrapper == "2d":  # every factor was built in the file: the hand-over copies nothing
            assert all(built.arena.offset_of(t) is not None for t in _tensors(built))
        handed, mapping = from_shared(to_shared(built))
        assert _files(build_dir) == []  # mapped, then unlinked (the owner's lock stays while it lives)
        got, want = _tensors(handed), _tensors(reference)
        assert len(got) == len(want)
        for x, y in zip(got, want):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)
            assert x.untyped_storage().data_ptr() == mapping.untyped_storage().data_ptr()
        assert [r for *_, r in handed.moe.values()] == [r for *_, r in reference.moe.values()]


def test_a_build_failing_while_it_reads_leaves_no_shared_file(tmp_path: Path, build_dir: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = write_moe_adapter(tmp_path / "bad", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if ".layers.1." in k and k.endswith("down_proj.lora_B.weight"))
    tensors[key][0, 0] = float("nan")  # found by the scan after the arena holds the first block
    save_file(tensors, str(weights))
    with pytest.raises(AdapterFormatError, match="NaN"):
        build_adapter(_job(folder, "2d"), PeftKeyRouter(), shared=True)
    assert _files(build_dir) == []


@pytest.mark.parametrize("shared", [False, True])
def test_a_build_told_not_to_scan_leaves_a_nan_to_its_caller_and_says_so_across_the_hand_over(
        tmp_path: Path, shared: bool) -> None:
    """``BuildJob(scan_moe=False)`` (a background build on a GPU, scanned once staged) reads a NaN block as it is and
    marks the build unscanned, also after the hand-over; the default build refuses the same file."""
    from dataclasses import replace

    from safetensors.torch import load_file, save_file

    folder = write_moe_adapter(tmp_path / "bad", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    weights = folder / "adapter_model.safetensors"
    tensors = load_file(str(weights))
    key = next(k for k in tensors if ".layers.1." in k and k.endswith("down_proj.lora_B.weight"))
    tensors[key][0, 0] = float("nan")
    save_file(tensors, str(weights))
    with pytest.raises(AdapterFormatError, match="NaN"):
        build_adapter(_job(folder, "2d"), PeftKeyRouter(), shared=shared)
    built = build_adapter(replace(_job(folder, "2d"), scan_moe=False), PeftKeyRouter(), shared=shared)
    if shared:
        built, _ = from_shared(to_shared(built))
    assert built.moe_scanned is False
    assert any(not bool(torch.isfinite(t).all()) for t in _tensors(built))
    good = write_moe_adapter(tmp_path / "good", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    built = build_adapter(_job(good, "2d"), PeftKeyRouter(), shared=shared)
    assert built.moe_scanned is True
    assert from_shared(to_shared(built))[0].moe_scanned is True


def test_shared_files_of_dead_build_processes_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    import subprocess
    import sys

    folder = tmp_path / "sweep"
    folder.mkdir()
    code = ("import sys; from vllm_lora_ext.transport.arena import SharedArena; a = SharedArena(4096, sys.argv[1]); "
            "print(a.path, flush=True); sys.stdin.read()")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(folder)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for _ in range(2)]
    dead, live = (os.path.basename(p.stdout.readline().strip()) for p in procs)  # type: ignore[union-attr]
    procs[0].kill()
    procs[0].wait()
    legacy = f"vllm-lora-ext-{procs[0].pid}-abc.bin"  # the old pid naming: no lock tells its owner's fate, so kept
    (folder / legacy).write_bytes(b"x")
    (folder / "unrelated-123-x.bin").write_bytes(b"x")
    try:
        assert sweep_stale(str(folder)) == [dead]
        assert sorted(_files(folder)) == sorted([live, legacy, "unrelated-123-x.bin"])
        assert len([n for n in os.listdir(folder) if n.endswith(".lock")]) == 1  # the dead owner's lock is gone too
    finally:
        procs[1].stdin.close()  # type: ignore[union-attr]
        procs[1].wait()
    assert sweep_stale(str(folder)) == [live] and not any(n.endswith(".lock") for n in os.listdir(folder))


def test_a_build_takes_the_ready_spare_when_it_fits_and_the_file_it_hands_over_is_cut_to_its_size(
        tmp_path: Path, build_dir: Path) -> None:
    from vllm_lora_ext.transport.arena import ArenaSupply

    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "3d"], rank=R)
    job = _job(folder, "2d")
    reference = build_adapter(job, PeftKeyRouter())
    supply = ArenaSupply(1 << 20)
    supply.prepare(wait=True)
    spares = _files(build_dir)
    assert len(spares) == 1 and "-spare-" in spares[0] and os.path.getsize(build_dir / spares[0]) == 1 << 20
    built = build_adapter(job, PeftKeyRouter(), shared=True, arenas=supply)
    assert supply.taken == 1 and built.arena is not None and built.arena.path == str(build_dir / spares[0])
    shared = to_shared(built)
    del built
    assert os.path.getsize(shared.path) == shared.size < 1 << 20  # the spare's unused pages are given back
    handed, _ = from_shared(shared)
    for x, y in zip(_tensors(handed), _tensors(reference)):
        assert torch.equal(x, y)
    supply.prepare(wait=True)  # the next spare, as a build process does once a build is answered
    late = build_adapter(job, PeftKeyRouter(), shared=True, arenas=supply)
    assert supply.taken == 2
    shared = to_shared(late, trim=False)  # a build process cuts the file after the hand-over
    del late
    fd = os.open(shared.path, os.O_RDWR)
    assert os.path.getsize(shared.path) == 1 << 20
    handed, _ = from_shared(shared)  # maps the used part and removes the name
    trim_shared(fd, shared)
    for x, y in zip(_tensors(handed), _tensors(reference)):
        assert torch.equal(x, y)
    big = ArenaSupply(1 << 20)
    assert big.take(4 << 20).capacity == 4 << 20 and big.taken == 0  # too small a spare: a new sparse file
    supply.discard()
    big.discard()
    import time

    deadline = time.monotonic() + 10
    while any("-spare-" in n for n in os.listdir(build_dir)) and time.monotonic() < deadline:
        time.sleep(0.05)  # a spare a thread was still making is removed when it finishes
    assert not any("-spare-" in n for n in os.listdir(build_dir))


def _resident_kib(path: str) -> int:
    """This process's resident KiB of its mapping of ``path`` (``/proc/self/smaps``)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith(path))
    return next(int(line.split()[1]) for line in lines[at + 1:] if line.startswith("Rss:"))


def _faults_writing_each_page(buffer: torch.Tensor) -> int:
    """Minor page faults this thread takes writing one byte of each page of ``buffer`` (a zero-filled spare)."""
    import resource

    before = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    buffer[::4096].fill_(0)
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - before


SHM = os.path.isdir("/dev/shm") and on_tmpfs("/dev/shm")


@pytest.mark.skipif(not SHM, reason="no /dev/shm tmpfs")
@pytest.mark.parametrize("advice", ["madvise", "refused"])
def test_a_spare_in_dev_shm_is_mapped_for_writing_before_any_build_writes_into_it(
        advice: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build's writes into the spare take no fault per page: its pages are mapped writable when it is made (where
    the kernel refuses the advice, by writing each page's byte back), and it still holds only zeros."""
    import vllm_lora_ext.transport.files as files
    from vllm_lora_ext.transport.arena import ArenaSupply

    if advice == "refused":
        monkeypatch.setattr(files, "_MADV_POPULATE_WRITE", -1)  # EINVAL, as a kernel before 5.14 answers
    supply = ArenaSupply(8 << 20, directory="/dev/shm")
    try:
        supply.prepare(wait=True)
        spare = supply._spare
        assert spare is not None and spare.buffer is not None and spare.path.startswith("/dev/shm/")
        assert _resident_kib(spare.path) == 8 << 10
        assert not spare.buffer.any()
        assert _faults_writing_each_page(spare.buffer) < (8 << 20) // 4096 // 4  # 2,048 without the mapping
    finally:
        supply.discard()


@pytest.mark.skipif(not SHM, reason="no /dev/shm tmpfs")
def test_mapping_for_writing_keeps_every_byte_when_the_kernel_refuses_part_way(monkeypatch: pytest.MonkeyPatch) -> None:
    import vllm_lora_ext.transport.files as files

    calls: list[int] = []

    def flaky(address: int, size: int, advice: int) -> int:
        calls.append(size)
        return -1 if len(calls) == 2 else 0  # the second call refused: that chunk and the rest are written instead

    monkeypatch.setattr(files, "_POPULATE_CHUNK", 1 << 20)
    monkeypatch.setattr(files, "_madvise", lambda: flaky)
    path = f"/dev/shm/vllm-lora-ext-test-{os.getpid()}.bin"
    data = torch.arange(3 * (1 << 20) + 4096 * 5, dtype=torch.int64).to(torch.uint8)  # a ragged last chunk
    data.numpy().tofile(path)
    try:
        mapped = torch.from_file(path, shared=True, size=data.numel(), dtype=torch.uint8)
        files.map_for_writing(mapped, path)
        assert calls == [1 << 20, 1 << 20] and torch.equal(mapped, data)
        assert _resident_kib(path) == -(-data.numel() // 4096) * 4
    finally:
        os.unlink(path)


def test_a_spare_in_a_disk_folder_is_not_mapped_ahead(build_dir: Path) -> None:
    """Mapping a spare writable in a folder on disk would dirty every page for writeback: there it is left as made."""
    from vllm_lora_ext.transport.arena import ArenaSupply

    if on_tmpfs(str(build_dir)):
        pytest.skip("the temporary folder is on a tmpfs")
    supply = ArenaSupply(1 << 20)
    try:
        supply.prepare(wait=True)
        assert supply._spare is not None and supply._spare.path.startswith(str(build_dir))
        assert _resident_kib(supply._spare.path) == 0
    finally:
        supply.discard()


def test_discarding_the_supply_waits_for_a_spare_being_made(build_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A build process discards its supply as it exits; a spare thread cut off inside torch can abort the process."""
    import time

    from vllm_lora_ext.transport import arena as arena_mod

    made = arena_mod.Arena.in_file

    def slow(*a: object, **k: object) -> object:
        time.sleep(0.5)
        return made(*a, **k)  # type: ignore[arg-type]

    monkeypatch.setattr(arena_mod.Arena, "in_file", staticmethod(slow))
    supply = arena_mod.ArenaSupply(1 << 20)
    supply.prepare()
    assert supply._thread is not None and supply._thread.is_alive()
    supply.discard()
    assert not supply._thread.is_alive() and not any("-spare-" in n for n in os.listdir(build_dir))


def test_no_spare_is_kept_when_its_size_is_zero(build_dir: Path) -> None:
    from vllm_lora_ext.transport.arena import ArenaSupply

    supply = ArenaSupply(0)
    supply.prepare(wait=True)
    arena = supply.take(4096)
    assert supply.taken == 0 and _files(build_dir) == [os.path.basename(arena.path)]
    arena.discard()


def test_the_spare_grows_with_the_builds_but_never_past_twice_its_size(build_dir: Path) -> None:
    from vllm_lora_ext.transport.arena import ArenaSupply

    supply = ArenaSupply(1 << 20)
    supply.take(1536 << 10).discard()  # a build larger than the spare: the next spare is that large
    supply.prepare(wait=True)
    assert supply._spare is not None and supply._spare.capacity == 1536 << 10
    supply.take(64 << 20).discard()  # far larger: the spare stops at twice its size
    supply.prepare(wait=True)
    assert supply._spare is not None and supply._spare.capacity == 2 << 20
    supply.discard()


@pytest.mark.parametrize(("forms", "wrapper", "experts", "shared"), [
    (["2d", "2d"], "2d", None, False), (["2d", "2d"], "3d", None, True), (["2d", "3d"], "2d", (1, 3), True),
    (["2d", "2d"], "2d", (0, 2), False),
])
def test_per_expert_factors_read_stacked_equal_them_read_key_by_key(
        tmp_path: Path, build_dir: Path, monkeypatch: pytest.MonkeyPatch, forms: list[str], wrapper: str,
        experts: tuple[int, ...] | None, shared: bool) -> None:
    """The stacked read (one gather per factor) and the key-by-key read give the same tensors and read the same bytes."""
    from vllm_lora_ext.reader import SafetensorsReader

    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, s) for s in (0, 1)], forms, rank=R)
    job = _job(folder, wrapper, experts)
    calls: list[int] = []
    real = SafetensorsReader.read_stacks

    def counted(self: SafetensorsReader, groups: list[list[str]], into: object = None, **kw: object) -> list[object]:
        got = real(self, groups, into, **kw)  # type: ignore[arg-type]
        calls.append(sum(g is not None for g in got))
        return got  # type: ignore[return-value]

    monkeypatch.setattr(SafetensorsReader, "read_stacks", counted)
    stacked = build_adapter(job, PeftKeyRouter(), shared=shared)
    assert sum(calls) > 0  # a rank's share of the experts too
    monkeypatch.setattr(SafetensorsReader, "read_stacks", lambda self, groups, into=None, **kw: [None] * len(groups))
    one_by_one = build_adapter(job, PeftKeyRouter(), shared=shared)
    assert stacked.bytes_read == one_by_one.bytes_read
    for x, y in zip(_tensors(stacked), _tensors(one_by_one), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)
    for arena in (stacked.arena, one_by_one.arena):
        if arena is not None:
            arena.discard()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # read another way (None), or transposed
@pytest.mark.parametrize("alpha", [4.0, 3.0])  # a scale of 1 (r=4), and 0.75
@pytest.mark.parametrize(("forms", "wrapper", "shared"), [
    (["3d", "3d"], "2d", False), (["3d", "3d_t"], "3d", True), (["3d", "2d"], "3d", False), (["3d_t", "3d"], "2d", True),
])
def test_all_of_a_fused_b_read_transposed_equals_it_read_whole_and_reordered(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, alpha: float, forms: list[str],
        wrapper: str, shared: bool) -> None:
    """All of a standard 3D B read, reordered to (experts, out, r) and scaled in one pass
    (`SafetensorsReader.read_transposed`) is bitwise B read whole, reordered and scaled after, with the same bytes
    read; the transposed 3D layout and a B stored in float32 (kept in bfloat16) are read the other way. A control
    that reverses the rows read differs."""
    from vllm_lora_ext.reader import SafetensorsReader

    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, s, dtype) for s in (0, 1)], forms, rank=R,
                               alpha=alpha)
    job = _job(folder, wrapper, None)
    calls: list[object] = []
    real = SafetensorsReader.read_transposed

    def counted(self: SafetensorsReader, key: str, *args: object, **kw: object) -> torch.Tensor | None:
        got = real(self, key, *args, **kw)  # type: ignore[arg-type]
        calls.append(got is not None)
        return got

    monkeypatch.setattr(SafetensorsReader, "read_transposed", counted)
    transposed = build_adapter(job, PeftKeyRouter(), shared=shared)
    # gate_up and down B of each standard 3D block; B stored in float32 and kept in bfloat16 is read another way
    assert sum(calls) == (2 * forms.count("3d") if dtype == torch.bfloat16 else 0)
    assert len(calls) == 2 * forms.count("3d")
    monkeypatch.setattr(SafetensorsReader, "read_transposed", None)
    reordered = build_adapter(job, PeftKeyRouter(), shared=shared)
    assert transposed.bytes_read == reordered.bytes_read
    for x, y in zip(_tensors(transposed), _tensors(reordered), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)

    def reversed_rows(self: SafetensorsReader, key: str, *args: object, **kw: object) -> torch.Tensor | None:
        got = real(self, key, *args, **kw)  # type: ignore[arg-type]
        return None if got is None else got.flip(1).contiguous()

    monkeypatch.setattr(SafetensorsReader, "read_transposed", reversed_rows)
    control = build_adapter(job, PeftKeyRouter(), shared=False)
    assert dtype != torch.bfloat16 or not all(torch.equal(x, y) for x, y in zip(_tensors(control), _tensors(reordered)))
    for built in (transposed, reordered, control):
        if built.arena is not None:
            built.arena.discard()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])  # converted to bfloat16, or already it
@pytest.mark.parametrize(("forms", "wrapper", "experts", "shared"), [
    (["3d", "3d"], "2d", (1, 2), False), (["3d", "3d_t"], "3d", (0, 2), True), (["3d", "2d"], "3d", (3,), False),
    (["3d_t", "3d"], "2d", (0, 1, 3), True), (["3d", "3d"], "3d", (1, 2), True),
    (["3d", "3d_t"], "3d", None, False), (["3d", "3d"], "2d", None, True),  # every expert
])
def test_a_fused_b_gathered_equals_it_read_by_column_ranges(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, forms: list[str], wrapper: str,
        experts: tuple[int, ...] | None, shared: bool) -> None:
    """A rank's share of a 3D B copied once out of the file into (experts, out, r) order
    (`SafetensorsReader.gather`) is bitwise the column-range read, reordered, and reads the same bytes; a control that
    reverses the rows gathered differs. With every expert, B is read whole either way."""
    from vllm_lora_ext.reader import SafetensorsReader

    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, R, s, dtype) for s in (0, 1)], forms, rank=R)
    job = _job(folder, wrapper, experts)
    calls: list[str] = []
    real = SafetensorsReader.gather

    def counted(self: SafetensorsReader, key: str, pieces: object, into: object = None) -> torch.Tensor:
        calls.append(key)
        return real(self, key, pieces, into)  # type: ignore[arg-type]

    monkeypatch.setattr(SafetensorsReader, "gather", counted)
    gathered = build_adapter(job, PeftKeyRouter(), shared=shared)
    # gate_up and down B of each 3D block, where the rank keeps some of the experts (all of a B is read whole)
    assert len(calls) == (sum(f.startswith("3d") for f in forms) * 2 if experts is not None else 0)
    monkeypatch.setattr(SafetensorsReader, "gather", None)
    by_ranges = build_adapter(job, PeftKeyRouter(), shared=shared)
    assert gathered.bytes_read == by_ranges.bytes_read
    for x, y in zip(_tensors(gathered), _tensors(by_ranges), strict=True):
        assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y)

    def reversed_rows(self: SafetensorsReader, key: str, pieces: object, into: object = None) -> torch.Tensor:
        out = real(self, key, pieces, into)  # type: ignore[arg-type]
        return out.flip(1)  # its rows in reverse order

    monkeypatch.setattr(SafetensorsReader, "gather", reversed_rows)
    control = build_adapter(job, PeftKeyRouter(), shared=False)
    assert experts is None or not all(torch.equal(x, y) for x, y in zip(_tensors(control), _tensors(by_ranges)))
    for built in (gathered, by_ranges, control):
        if built.arena is not None:
            built.arena.discard()


def test_a_3d_adapter_made_for_fewer_experts_is_refused_not_read_at_another_rank(tmp_path: Path) -> None:
    """A 2D adapter that names experts 0-1 of this 4-expert model, converted to 3D without a base config, says
    E = 2 in its rows (r·E = 2·4). On the model's E = 4 those rows read as rank 2 against the config's r = 4:
    every expert would get another expert's factors at half the rank, with no error. Refused, naming both."""
    from vllm_lora_ext.cli import main
    from vllm_lora_ext.errors import ExpertLayoutError

    partial = write_moe_adapter(tmp_path / "partial", [make_truth(2, H, I, R, s) for s in (0, 1)], ["2d", "2d"],
                                rank=R)
    build_adapter(moe_build_job(partial), PeftKeyRouter())  # as 2D it loads: experts 2 and 3 have no delta
    assert main(["convert", str(partial), "--to", "3d", "-o", str(tmp_path / "as3d")]) == 0
    with pytest.raises(ExpertLayoutError, match=r"3D A has 8 rows, 2 per expert with the model's E=4, but the "
                                                r"adapter config's r is 4: the adapter was made for 2 experts"):
        build_adapter(moe_build_job(tmp_path / "as3d"), PeftKeyRouter())


@pytest.mark.parametrize(("case", "file_dtype", "lora_dtype", "value", "alpha"), [
    ("float64 past every serving dtype", torch.float64, torch.bfloat16, 1e300, 8.0),
    ("float32 past float16", torch.float32, torch.float16, 1e5, 8.0),
    ("lora_alpha 1e300 folded into B", torch.float32, torch.float32, 1.0, 1e300),
    ("lora_alpha 1e6 folded into a float16 B", torch.float16, torch.float16, 1.0, 1e6),
])
def test_a_dense_factor_finite_on_disk_but_infinite_once_served_is_refused(
        tmp_path: Path, case: str, file_dtype: torch.dtype, lora_dtype: torch.dtype, value: float,
        alpha: float) -> None:
    """Cast to the LoRA dtype and multiplied by its scaling (as vLLM folds it into B), each of these factors would
    be inf: every output of the request NaN or inf. Refused, naming the key; the same adapter in range loads."""
    from factories import dense_tensors, llama_shapes, lora_config, write_adapter
    from vllm_lora_ext.planning import ModelSpec
    from vllm_lora_ext.validation import ModuleDims

    tensors = dense_tensors(llama_shapes(), rank=4, seed=0, dtype=file_dtype)
    b_key = next(k for k in tensors if k.endswith("lora_B.weight"))
    dims = {m: ModuleDims(i, o) for m, (i, o) in llama_shapes().items()}
    model = ModelSpec(frozenset(dims), dims=dims, max_rank=16)
    fine = write_adapter(tmp_path / "fine", tensors, lora_config(4, 8))
    build_adapter(BuildJob(str(fine), "fine", model, dtype=lora_dtype), PeftKeyRouter())  # the control: it loads
    tensors[b_key] = torch.full_like(tensors[b_key], value)
    bad = write_adapter(tmp_path / "bad", tensors, lora_config(4, alpha))
    with pytest.raises(AdapterFormatError, match=rf"tensor '{b_key}' reaches .* it would be served as infinity"):
        build_adapter(BuildJob(str(bad), "bad", model, dtype=lora_dtype), PeftKeyRouter())


@pytest.mark.parametrize("spelling", ["01", "prefixed"])
def test_one_expert_given_twice_in_two_spellings_is_refused_not_one_dropped(tmp_path: Path, spelling: str) -> None:
    from safetensors.torch import load_file, save_file

    from vllm_lora_ext.errors import ExpertLayoutError

    folder = write_moe_adapter(tmp_path / "moe", [make_truth(E, H, I, R, s) for s in (0, 1)], ["2d", "2d"], rank=R)
    path = folder / "adapter_model.safetensors"
    tensors = load_file(str(path))
    for key in [k for k in tensors if ".layers.0.mlp.experts.1.gate_proj." in k]:
        other = (key.replace(".experts.1.", ".experts.01.") if spelling == "01"
                 else key.replace("base_model.model.", "", 1) if key.startswith("base_model.model.")
                 else "base_model.model." + key)
        tensors[other] = tensors[key] * 3
    save_file(tensors, str(path))
    with pytest.raises(ExpertLayoutError, match=r"keep one"):
        build_adapter(moe_build_job(folder), PeftKeyRouter())


@pytest.mark.parametrize("case", ["no config, alpha in the metadata", "rank_pattern on the experts module",
                                  "rank_pattern on the fused parameters", "convert's doubled gate_up rank"])
def test_fused_3d_adapters_whose_ranks_the_config_gives_in_other_ways_still_load(tmp_path: Path, case: str) -> None:
    """The check that a fused factor's rows give the config's rank must not refuse adapters that are right."""
    from safetensors.torch import load_file, save_file

    from vllm_lora_ext.cli import main

    rank, cfg = (8, {"rank_pattern": {"experts": 8}}) if case == "rank_pattern on the experts module" else \
        (8, {"rank_pattern": {"gate_up_proj": 8, "down_proj": 8}}) if "fused parameters" in case else (R, {})
    form = "2d" if "convert" in case else "3d"
    folder = write_moe_adapter(tmp_path / "a", [make_truth(E, H, I, rank, s) for s in (0, 1)], [form, form], rank=R,
                               **cfg)
    weights = folder / "adapter_model.safetensors"
    if case.startswith("no config"):
        save_file(load_file(weights), weights, metadata={"lora_alpha": "16"})
        (folder / "adapter_config.json").unlink()
    if "convert" in case:  # gate's and up's lora_A differ: one fused A of twice the rank, recorded by a pattern
        tensors = load_file(weights)
        save_file({k: t + 0.5 if ".up_proj.lora_A" in k else t for k, t in tensors.items()}, weights)
        assert main(["convert", str(folder), "--to", "3d", "-o", str(tmp_path / "as3d")]) == 0
        folder = tmp_path / "as3d"
    build_adapter(moe_build_job(folder, max_rank=16), PeftKeyRouter())
