"""Reads are one snapshot: a file replaced or written over during a load, or a link swapped to leave the allowed
roots between a load and a rebuild, never yields another file's bytes; a client-source prefix cannot be left with
``..`` or a link (issue 35, items 3, 4 and 5).

Every file is a real safetensors file; every replacement is a real ``os.replace`` (what a deploy tool does),
made by another thread at the moment the load has read the header and not yet the tensors: the thread waits on
an event the reader's own ``__init__`` sets once it returns (the real reader runs, unchanged).
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from factories import dense_tensors, lora_config, llama_shapes, write_adapter
from hostile_files import deploy_between_header_and_data, swap_for_link
from moe_factories import BUILD_E, BUILD_H, BUILD_I, BUILD_R, make_truth, moe_build_job, write_moe_adapter
from vllm_lora_ext.building import BuildJob, build_adapter
from vllm_lora_ext.errors import AdapterAccessError, AdapterFormatError
from vllm_lora_ext.multiplex import Plan, plan_model_id
from vllm_lora_ext.planning import ModelSpec, PeftKeyRouter
from vllm_lora_ext.reader import SafetensorsReader, read_header, read_tensors
from vllm_lora_ext.validation import ModuleDims

pytestmark = pytest.mark.usefixtures("build_dir")
PAD = {"padding": "x" * 1001}  # a longer header: every offset of the new file moves by ~1 KB (not a multiple of 4)


def _pair(tmp_path: Path) -> tuple[Path, Path, dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``path`` (the file a load opens) and ``new`` (what a deploy puts there: other values, a longer header)."""
    def tensors(seed: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(seed)
        out = {f"s.{i}": torch.randn(4, 6, generator=g) for i in range(3)}
        out["m"] = torch.randn(8, 12, generator=g)
        return out

    old, new = tensors(0), tensors(1)
    path, staged = tmp_path / "w.safetensors", tmp_path / "staged.safetensors"
    save_file(old, str(path))
    save_file(new, str(staged), metadata=PAD)
    return path, staged, old, new


READS = {
    "read": (lambda r: r.read("m"), lambda t: t["m"]),
    "read_rows": (lambda r: r.read("m", [(0, 1, 3), (0, 5, 8)]), lambda t: torch.cat([t["m"][1:3], t["m"][5:8]])),
    "read_columns": (lambda r: r.read("m", [(1, 0, 2), (1, 7, 12)]),
                     lambda t: torch.cat([t["m"][:, 0:2], t["m"][:, 7:12]], dim=1)),
    "read_many": (lambda r: torch.cat([v.flatten() for v in r.read_many(["s.1", "m", "s.0"]).values()]),
                  lambda t: torch.cat([t[k].flatten() for k in ("s.1", "m", "s.0")])),
    "read_stacks": (lambda r: r.read_stacks([["s.2", "s.0"], ["s.1"]])[0], lambda t: torch.stack([t["s.2"], t["s.0"]])),
    "gather": (lambda r: r.gather("m", lambda x: [x[:, 2:5].t(), x[:, 9:11].t()]),
               lambda t: torch.cat([t["m"][:, 2:5].t(), t["m"][:, 9:11].t()])),
    "read_transposed": (lambda r: r.read_transposed("m", 4), lambda t: t["m"].reshape(-1, 4).t().contiguous()),
}


@pytest.mark.parametrize("how", sorted(READS))
def test_a_file_replaced_after_its_header_was_read_is_read_as_the_old_file_exactly(tmp_path: Path, how: str) -> None:
    path, staged, old, new = _pair(tmp_path)
    read, want = READS[how]
    with SafetensorsReader(path) as reader:
        os.replace(staged, path)  # a deploy tool's atomic swap, longer header
        got = read(reader)
    assert torch.equal(got, want(old)) and not torch.equal(got, want(new))
    assert torch.isfinite(got).all()


def test_a_header_read_from_the_old_file_is_not_applied_to_the_new_one(tmp_path: Path) -> None:
    path, staged, _, new = _pair(tmp_path)
    stale = read_header(path)
    os.replace(staged, path)
    got = read_tensors(path, header=stale)  # the header's file is gone: the new one is read with its own header
    assert all(torch.equal(got[k], new[k]) for k in new)


def test_reads_on_several_threads_share_the_one_descriptor_through_a_replace(tmp_path: Path) -> None:
    path, staged, old, _ = _pair(tmp_path)
    results: list[bool] = []
    with SafetensorsReader(path) as reader:
        def work() -> None:
            for _ in range(20):
                results.append(torch.equal(reader.read_stacks([["s.0", "s.1", "s.2"]])[0],
                                           torch.stack([old["s.0"], old["s.1"], old["s.2"]])))

        threads = [threading.Thread(target=work) for _ in range(4)]
        for t in threads:
            t.start()
        os.replace(staged, path)
        for t in threads:
            t.join()
    assert results == [True] * 80


def test_a_file_truncated_in_place_after_its_header_is_a_clear_error(tmp_path: Path) -> None:
    path, _, _, _ = _pair(tmp_path)
    with SafetensorsReader(path) as reader:
        os.truncate(path, os.path.getsize(path) - 100)
        with pytest.raises(AdapterFormatError, match="truncated"):
            reader.read_many(["s.0", "s.1", "s.2", "m"])


def test_a_closed_reader_reads_nothing(tmp_path: Path) -> None:
    path, _, _, _ = _pair(tmp_path)
    reader = SafetensorsReader(path)
    reader.close()
    reader.close()  # twice is fine
    with pytest.raises(ValueError, match="closed"):
        reader.read("m")


# ------------------------------------------------------------------------------------------------ whole builds


def _moe_pair(tmp_path: Path, form: str) -> tuple[Path, Path, Path]:
    """An MoE adapter folder, a twin folder (same bytes) to build a reference from, and a staged newer file."""
    truths = [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s) for s in (0, 1)]
    folder = write_moe_adapter(tmp_path / "a", truths, [form, form], rank=BUILD_R)
    twin = write_moe_adapter(tmp_path / "twin", truths, [form, form], rank=BUILD_R)
    newer = write_moe_adapter(tmp_path / "new", [make_truth(BUILD_E, BUILD_H, BUILD_I, BUILD_R, s) for s in (5, 6)],
                              [form, form], rank=BUILD_R)
    staged = tmp_path / "staged.safetensors"
    save_file(load_file(str(newer / "adapter_model.safetensors")), str(staged), metadata=PAD)
    return folder, twin, staged


def _factors(built: Any) -> list[torch.Tensor]:
    return [*(built.dense[k] for k in sorted(built.dense)),
            *(t for p in sorted(built.moe) for t in (*built.moe[p][0], *built.moe[p][1]))]


@pytest.mark.parametrize(("form", "wrapper", "experts"), [
    ("2d", "2d", None), ("2d", "3d", (1, 3)), ("3d", "2d", None), ("3d", "3d", (0, 2)), ("3d_t", "2d", (2,)),
])
def test_a_build_through_a_deploy_between_header_and_data_is_the_old_adapter_bit_for_bit(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, form: str, wrapper: str, experts: Any) -> None:
    folder, twin, staged = _moe_pair(tmp_path, form)
    want = build_adapter(moe_build_job(twin, wrapper=wrapper, experts=experts), PeftKeyRouter())
    with deploy_between_header_and_data(monkeypatch, folder / "adapter_model.safetensors", staged):
        got = build_adapter(moe_build_job(folder, wrapper=wrapper, experts=experts), PeftKeyRouter())
    assert len(_factors(got)) == len(_factors(want)) > 0
    for x, y in zip(_factors(got), _factors(want)):
        assert torch.equal(x, y) and torch.isfinite(x.float()).all()


def _dense_job(path: Path) -> BuildJob:
    dims = {m: ModuleDims(i, o) for m, (i, o) in llama_shapes().items()}
    return BuildJob(path=str(path), name="dense", model=ModelSpec(frozenset(dims), dims=dims, max_rank=16))


def test_an_inferred_config_comes_from_the_header_the_tensors_are_read_with(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    path = write_adapter(tmp_path / "a", dense_tensors(llama_shapes(), rank=4, seed=0), None,
                         metadata={"lora_alpha": "8"})
    staged = write_adapter(tmp_path / "b", dense_tensors(llama_shapes(), rank=2, seed=1), None,
                           metadata={"lora_alpha": "64", **PAD})
    with deploy_between_header_and_data(monkeypatch, path, staged):
        got = build_adapter(_dense_job(path), PeftKeyRouter())
    assert (got.config.r, got.config.lora_alpha) == (4, 8.0)  # the old file's, with the old file's tensors
    old = dense_tensors(llama_shapes(), rank=4, seed=0)
    assert got.dense.keys() == old.keys() and all(torch.equal(got.dense[k], old[k]) for k in old)


def test_a_file_written_over_in_place_during_a_build_is_refused_not_read_misaligned(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    folder, _, staged = _moe_pair(tmp_path, "2d")
    with deploy_between_header_and_data(monkeypatch, folder / "adapter_model.safetensors", staged, in_place=True):
        with pytest.raises(AdapterFormatError, match="written over while it was being read"):
            build_adapter(moe_build_job(folder), PeftKeyRouter())


# ------------------------------------------------------------------------------------------------ allowed roots


@pytest.fixture
def roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """``VLLM_LORA_EXT_ALLOWED_ROOTS`` = ``tmp/roots``; ``tmp/outside`` holds another adapter (same shapes)."""
    inside, outside = tmp_path / "roots", tmp_path / "outside"
    write_adapter(inside / "team" / "a", dense_tensors(llama_shapes(), seed=0), lora_config())
    write_adapter(outside / "team" / "a", dense_tensors(llama_shapes(), seed=9), lora_config())
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", str(inside))
    return inside.resolve(), outside.resolve()


def _refused_naming_the_root(job: BuildJob, root: Path) -> None:
    with pytest.raises(AdapterAccessError, match="outside the folders this server may read") as info:
        build_adapter(job, PeftKeyRouter())
    assert f"VLLM_LORA_EXT_ALLOWED_ROOTS={root}" in str(info.value)
    assert f"VLLM_LORA_EXT_ALLOWED_ROOTS={root}" in info.value.client_message()


@pytest.mark.parametrize("what", ["folder", "parent folder", "weight file", "config file"])
def test_a_link_swapped_to_leave_the_root_after_a_load_is_refused_on_the_rebuild(roots: tuple[Path, Path],
                                                                                 what: str) -> None:
    inside, outside = roots
    job = _dense_job(inside / "team" / "a")
    first = build_adapter(job, PeftKeyRouter())  # the load: allowed
    assert torch.equal(next(iter(first.dense.values())), next(iter(dense_tensors(llama_shapes(), seed=0).values())))
    place, target = {"folder": (inside / "team" / "a", outside / "team" / "a"),
                     "parent folder": (inside / "team", outside / "team"),
                     "weight file": (inside / "team" / "a" / "adapter_model.safetensors",
                                     outside / "team" / "a" / "adapter_model.safetensors"),
                     "config file": (inside / "team" / "a" / "adapter_config.json",
                                     outside / "team" / "a" / "adapter_config.json")}[what]
    swap_for_link(place, target)
    _refused_naming_the_root(job, inside)  # the rebuild (after an eviction): refused, nothing read from outside


def test_a_link_inside_the_root_that_stays_inside_still_loads(roots: tuple[Path, Path]) -> None:
    inside, _ = roots
    os.symlink(inside / "team" / "a", inside / "alias")
    built = build_adapter(_dense_job(inside / "alias"), PeftKeyRouter())
    assert built.dense.keys() == dense_tensors(llama_shapes(), seed=0).keys()


def test_an_operators_adapter_named_outside_every_root_is_not_held_to_them(roots: tuple[Path, Path]) -> None:
    _, outside = roots
    built = build_adapter(_dense_job(outside / "team" / "a"), PeftKeyRouter())
    assert torch.equal(next(iter(built.dense.values())), next(iter(dense_tensors(llama_shapes(), seed=9).values())))


def test_a_reader_held_to_roots_refuses_a_file_whose_real_path_leaves_them(roots: tuple[Path, Path]) -> None:
    inside, outside = roots
    os.symlink(outside / "team" / "a" / "adapter_model.safetensors", inside / "w.safetensors")
    with pytest.raises(AdapterAccessError, match=f"resolves to .*outside.*ALLOWED_ROOTS={inside}"):
        SafetensorsReader(inside / "w.safetensors", roots=[str(inside)])
    with SafetensorsReader(inside / "team" / "a" / "adapter_model.safetensors", roots=[str(inside)]) as reader:
        assert reader.header.shapes


def test_a_folder_flipping_between_inside_and_a_link_out_never_yields_the_outside_bytes(
        roots: tuple[Path, Path]) -> None:
    """The check and the open race an attacker who keeps swapping ``team`` (a real folder inside the root) for a
    link out of it and back: every build gives the inside adapter exactly, or is refused; none reads outside."""
    inside, outside = roots
    team, away = inside / "team", inside / "team.away"
    stop = threading.Event()

    def flip() -> None:
        pause = itertools.cycle([0.0, 0.0002, 0.001, 0.003])
        while not stop.is_set():
            time.sleep(next(pause))  # a real folder inside the root
            team.rename(away)
            os.symlink(outside / "team", team)
            time.sleep(next(pause))  # a link out of it
            os.unlink(team)
            away.rename(team)

    want = dense_tensors(llama_shapes(), seed=0)
    outcomes = {"inside": 0, "refused": 0, "missing": 0}
    attacker = threading.Thread(target=flip)
    attacker.start()
    try:
        for _ in range(200):
            try:
                built = build_adapter(_dense_job(team / "a"), PeftKeyRouter())
            except AdapterAccessError as err:
                assert f"ALLOWED_ROOTS={inside}" in str(err)
                outcomes["refused"] += 1
                continue
            except (FileNotFoundError, NotADirectoryError, AdapterFormatError):  # mid-swap: a file is not there
                outcomes["missing"] += 1
                continue
            assert all(torch.equal(built.dense[k], want[k]) for k in want), outcomes
            outcomes["inside"] += 1
    finally:
        stop.set()
        attacker.join()
    assert outcomes["inside"] + outcomes["refused"] + outcomes["missing"] == 200


@pytest.mark.parametrize("moment", ["after the real path is found", "after the real path is checked and stat'ed"])
def test_a_folder_swapped_for_a_link_at_the_worst_moment_is_refused_not_opened(
        roots: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, moment: str) -> None:
    """The attacker acts at exactly the moment between the check and the open (the environment's own calls run,
    the swap is made right after one of them returns): the file opened is then outside, and is refused."""
    inside, outside = roots
    weights = inside / "team" / "a" / "adapter_model.safetensors"
    swapped: list[bool] = []

    def swap_once() -> None:
        if not swapped:
            swapped.append(True)
            swap_for_link(inside / "team", outside / "team")

    if moment.startswith("after the real path is found"):
        real_realpath = os.path.realpath

        def realpath(path: Any, *args: Any, **kwargs: Any) -> Any:
            out = real_realpath(path, *args, **kwargs)
            if str(path) == str(weights):
                swap_once()
            return out

        monkeypatch.setattr(os.path, "realpath", realpath)
    else:
        real_stat = os.stat

        def stat(path: Any, *args: Any, **kwargs: Any) -> Any:
            out = real_stat(path, *args, **kwargs)
            if str(path) == str(weights):
                swap_once()
            return out

        monkeypatch.setattr(os, "stat", stat)
    with pytest.raises(AdapterAccessError, match=f"changed while it was opened.*ALLOWED_ROOTS={inside}"):
        SafetensorsReader(weights, roots=[str(inside)])
    assert swapped == [True]


# ------------------------------------------------------------------------------------------------ client sources


@pytest.fixture
def admitted(tmp_path: Path) -> Path:
    """``tmp/L`` (a prefix clients may name, holding ``a``), ``tmp/private/secret``, ``tmp/L-evil/x`` (a sibling
    whose name starts like ``L``), ``L/out`` (a link inside ``L`` to ``private``) and ``tmp/S`` (a link to ``L``)."""
    folder = (tmp_path / "L").resolve()
    write_adapter(folder / "a", dense_tensors(llama_shapes()), lora_config())
    write_adapter(tmp_path / "private" / "secret", dense_tensors(llama_shapes(), seed=3), lora_config())
    write_adapter(tmp_path / "L-evil" / "x", dense_tensors(llama_shapes(), seed=4), lora_config())
    os.symlink(tmp_path / "private", folder / "out")
    os.symlink(folder, tmp_path / "S")
    return folder


ESCAPES = [
    ("{L}/", "{L}/../private/secret"), ("{L}/", "{L}/./../private/secret"), ("{L}/", "{L}//../private/secret"),
    ("{L}/", "{L}/a/../../private/secret"), ("{L}/", "{L}/a/b/../../../private/secret"),
    ("{L}/", "{L}/./a/./../.././private/secret"), ("{L}/", "{L}/out/secret"), ("{L}/", "{L}/out/../a"), ("{L}/", "{L}/.."),
    ("{L}/", "{L}/../L-evil/x"), ("{L}", "{L}/../L-evil/x"), ("{L}/a/../", "{L}/../private/secret"),
    ("{T}/S/", "{T}/S/../private/secret"), ("{T}/S/", "{T}/S/out/secret"), ("{L}/", "{L}/a\x00/../../private"),
    ("hf:acme/", "hf:acme/../evil"), ("hf:acme/", "hf:acme/x:../../y"), ("hf:acme/", "hf:acme/x@:y"),
]


@pytest.mark.parametrize(("prefix", "source"), ESCAPES)
def test_a_client_source_that_leaves_its_prefix_is_refused(admitted: Path, prefix: str, source: str) -> None:
    fill = {"L": str(admitted), "T": str(admitted.parent)}
    source = source.format(**fill)
    with pytest.raises(AdapterAccessError, match="VLLM_LORA_EXT_CLIENT_SOURCES"):
        plan_model_id(f"qwen:{source}", names=set(), client_sources=(prefix.format(**fill),))


@pytest.mark.parametrize(("prefix", "source"), [
    ("{L}/", "{L}/a"), ("{L}/", "{L}/./a"), ("{L}/", "{L}//a"), ("{L}/", "{L}/a/../a"),
    ("{T}/S/", "{T}/S/a"), ("{L}/a/../", "{T}/S/a"), ("{T}/x/../L/", "{L}/a"),
])
def test_a_client_source_inside_its_prefix_however_spelled_is_registered_by_its_real_path(
        admitted: Path, prefix: str, source: str) -> None:
    fill = {"L": str(admitted), "T": str(admitted.parent)}
    plan = plan_model_id(f"qwen:{source.format(**fill)}", names=set(), client_sources=(prefix.format(**fill),))
    assert plan.plan is Plan.SOURCE and plan.adapter == str(admitted / "a")


def test_an_opted_in_pickle_adapter_is_held_to_the_roots_too(roots: tuple[Path, Path],
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    inside, outside = roots
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOW_PICKLE", "1")
    for place, seed in ((inside / "team" / "a", 0), (outside / "team" / "a", 9)):
        (place / "adapter_model.safetensors").unlink()
        torch.save(dense_tensors(llama_shapes(), seed=seed), place / "adapter_model.bin")
    job = _dense_job(inside / "team" / "a")
    built = build_adapter(job, PeftKeyRouter())  # read through one open file, inside the root
    want = dense_tensors(llama_shapes(), seed=0)
    assert all(torch.equal(built.dense[k], want[k]) for k in want)
    swap_for_link(inside / "team" / "a" / "adapter_model.bin", outside / "team" / "a" / "adapter_model.bin")
    _refused_naming_the_root(job, inside)


@pytest.mark.parametrize("dtype", [torch.complex64, torch.int32])
def test_an_opted_in_pickle_adapter_with_non_float_factors_is_refused_on_every_path(
        roots: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype) -> None:
    """A pickle adapter skips the safetensors header, not the factor dtype rule: a worker-thread build and a build
    process's hand-over refuse it the same way, naming the key."""
    inside, _ = roots
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOW_PICKLE", "1")
    place = inside / "team" / "a"
    (place / "adapter_model.safetensors").unlink()
    tensors = dense_tensors(llama_shapes(), seed=0)
    key = next(k for k in tensors if ".lora_A." in k)
    tensors[key] = tensors[key].to(dtype)
    torch.save(tensors, place / "adapter_model.bin")
    for shared in (False, True):
        with pytest.raises(AdapterFormatError, match="not a float type") as e:
            build_adapter(_dense_job(place), PeftKeyRouter(), shared=shared)
        assert key in str(e.value)


@pytest.mark.parametrize("what", ["config file", "weight file, no config"])
def test_the_servers_check_of_a_source_inside_the_roots_never_reads_a_file_that_leads_out(
        roots: tuple[Path, Path], what: str) -> None:
    """The API server's resolve-and-check (``/v1/load_lora_adapter``) is held to the roots as a build is: a config
    linked out of them is refused, never read, so no part of it reaches the client's error."""
    import json as _json

    from vllm_lora_ext.resolve import resolve_and_check

    inside, outside = roots
    secret = outside / "creds.json"
    secret.write_text(_json.dumps({"r": "sk-SECRET-TOKEN", "lora_alpha": 8}))
    folder = inside / "team" / "a"
    if what == "config file":
        swap_for_link(folder / "adapter_config.json", secret)
    else:
        (folder / "adapter_config.json").unlink()
        swap_for_link(folder / "adapter_model.safetensors", outside / "team" / "a" / "adapter_model.safetensors")
    with pytest.raises(AdapterAccessError, match=f"ALLOWED_ROOTS={inside}") as info:
        resolve_and_check(str(folder), name="evil")
    assert "SECRET" not in str(info.value) and "SECRET" not in info.value.client_message()
    assert resolve_and_check(str(outside / "team" / "a"), name="operator's").weights_path  # outside: not held


def test_a_relative_org_repo_that_is_no_folder_is_pinned_as_a_hub_source_so_a_folder_made_later_is_never_read(
        roots: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check saw no folder ``acme/y`` (vLLM reads it as the Hub repo), a folder (or a link out of the roots)
    made there before the load reads it must not be read as the local source: the check returns ``hf:acme/y``."""
    from vllm_lora_ext.resolve import check_allowed_root
    from vllm_lora_ext.sources import parse_source

    inside, outside = roots
    monkeypatch.chdir(tmp_path)
    assert check_allowed_root("acme/y", [str(inside)]) == "hf:acme/y"
    (tmp_path / "acme").mkdir()
    os.symlink(outside / "team" / "a", tmp_path / "acme" / "y")  # made after the check, before the read
    assert parse_source(check_allowed_root("hf:acme/y", [str(inside)])).kind == "hf"
    # named as a local path now, it lies outside every root: read as the Hub repo, never the local one (since r42 a
    # 403 no longer tells a client that something exists there)
    assert check_allowed_root("acme/y", [str(inside)]) == "hf:acme/y"


def test_a_config_candidate_is_classified_by_one_stat(tmp_path: Path) -> None:
    """`_util.path_kind`, which resolving a local source uses for each config candidate: a regular file (through a
    link) is a file; a folder, a FIFO, a dangling link and a loop of links are "other" (refused, never skipped);
    a missing name, or one under a missing folder, is absent. One stat each, so the folder of
    `test_a_folder_flipping_between_inside_and_a_link_out_never_yields_the_outside_bytes`, swapped between two
    checks, can no longer read as "not a regular file"."""
    import os

    from vllm_lora_ext._util import path_kind

    (tmp_path / "f").write_text("{}")
    (tmp_path / "d").mkdir()
    os.mkfifo(tmp_path / "p")
    os.symlink(tmp_path / "f", tmp_path / "to_f")
    os.symlink(tmp_path / "nowhere", tmp_path / "dangling")
    os.symlink(tmp_path / "loop_b", tmp_path / "loop_a")
    os.symlink(tmp_path / "loop_a", tmp_path / "loop_b")
    kinds = {n: path_kind(tmp_path / n) for n in ("f", "to_f", "d", "p", "dangling", "loop_a", "missing")}
    assert kinds == {"f": "file", "to_f": "file", "d": "other", "p": "other", "dangling": "other",
                     "loop_a": "other", "missing": "absent"}
    assert path_kind(tmp_path / "missing" / "adapter_config.json") == "absent"
    assert path_kind(tmp_path / "f" / "adapter_config.json") == "absent"  # under a file: ENOTDIR


def test_a_folder_without_an_adapter_names_its_lora_files_and_reads_nothing_outside_the_roots(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hint for a folder with no adapter_model.safetensors: its files that may hold LoRA factors are named (their
    first MiB of header searched, neither parsed nor kept), a base model's folder is said to be one, and a file
    linked from outside the allowed roots, or a FIFO, is listed unread (opened as a load opens it)."""
    from safetensors.torch import save_file

    from vllm_lora_ext.errors import AdapterNotFoundError
    from vllm_lora_ext.sources import resolve_source

    inside = tmp_path / "roots"
    base, multi = inside / "base", inside / "multi"
    base.mkdir(parents=True)
    multi.mkdir()
    monkeypatch.setenv("VLLM_LORA_EXT_ALLOWED_ROOTS", str(inside))
    save_file({"model.layers.0.mlp.up_proj.weight": torch.ones(2, 2)}, str(base / "model.safetensors"))
    with pytest.raises(AdapterNotFoundError, match="hold no lora_A/lora_B weights: it looks like a base model"):
        resolve_source(str(base))
    save_file({"base_model.model.x.q_proj.lora_A.weight": torch.ones(2, 2)}, str(multi / "chat.safetensors"))
    save_file({"model.w": torch.ones(2, 2)}, str(multi / "full.safetensors"))
    outside = tmp_path / "outside.safetensors"
    save_file({"model.w": torch.ones(2, 2)}, str(outside))  # no LoRA factor: listed only because it is not read
    os.symlink(outside, multi / "linked.safetensors")
    with pytest.raises(AdapterNotFoundError) as err:
        resolve_source(str(multi))
    assert "It holds ['chat.safetensors', 'linked.safetensors']" in str(err.value)


@pytest.mark.parametrize("path", ["~root/x", "~no-such-user-r43/x", "~/x", "~"])
def test_with_allowed_roots_a_tilde_path_gets_one_answer_whoever_it_names(
        roots: tuple[Path, Path], path: str) -> None:
    """`~name/x` was expanded before the roots were checked: a user that exists gave "outside the folders this server
    may read" (403) and one that does not gave "no home folder" (400), so a client could list the server's users."""
    from vllm_lora_ext.errors import AdapterAccessError
    from vllm_lora_ext.resolve import check_allowed_root

    inside, _ = roots
    with pytest.raises(AdapterAccessError) as e:
        check_allowed_root(path, [str(inside), str(Path.home())])
    assert str(e.value).startswith(f"Adapter path {path!r} starts with '~': a client's path is not expanded")
    assert "Give the whole path inside one of" in str(e.value) and str(Path.home()) in str(e.value)
