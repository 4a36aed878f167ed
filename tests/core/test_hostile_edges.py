"""Hostile inputs found by an attack round on the CPU-reachable surfaces: each gets its typed error naming what is
wrong and the fix, never a raw exception ("unexpected", a 500) or a write to another run's files."""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from factories import make_dense_adapter
from vllm_lora_ext.cli import main
from vllm_lora_ext.deployment import read_deployment_config
from vllm_lora_ext.errors import AdapterFormatError, AdapterSourceError, DeploymentConfigError
from vllm_lora_ext.headers import read_header
from vllm_lora_ext.outputs import OutputClaim
from vllm_lora_ext.sources import parse_source
from vllm_lora_ext.validation import check_dense_factors

SRC = str(Path(__file__).resolve().parents[2] / "src")
SURROGATES = json.loads('["/srv/loras/\\ud800", "hf:acme/lora:\\ud800.safetensors", "hf:acme/lora:sub\\udfff"]')


@pytest.mark.parametrize("source", SURROGATES, ids=["local", "hf-file", "hf-folder"])
def test_a_lone_surrogate_in_a_source_is_a_source_error_naming_it(source: str) -> None:
    with pytest.raises(AdapterSourceError, match=r"unpaired surrogate U\+D[89A-F][0-9A-F]{2} .*valid UTF-8") as info:
        parse_source(source)
    info.value.client_message().encode("utf-8")  # the answer itself is valid UTF-8


def test_a_deployment_config_with_a_lone_surrogate_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "d.json"
    path.write_text('{"adapters": {"a": "/tmp/\\ud800"}}')
    with pytest.raises(DeploymentConfigError, match="adapter 'a'.*unpaired surrogate"):
        read_deployment_config(path)


def test_a_rank_0_adapter_is_a_problem_for_inspect_not_a_crash(tmp_path: Path,
                                                              capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "ad"
    folder.mkdir()
    p = "base_model.model.model.layers.0.self_attn.q_proj"
    save_file({f"{p}.lora_A.weight": torch.zeros(0, 16), f"{p}.lora_B.weight": torch.zeros(16, 0)},
              str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"],
                                                            "peft_type": "LORA"}))
    main(["inspect", str(folder)])
    out = capsys.readouterr()
    assert "unexpected" not in out.err and "ZeroDivisionError" not in out.out + out.err
    assert "rank 0: lora_A is (0, 16) and lora_B (16, 0), a LoRA with no rank" in out.out + out.err
    shapes = {f"{p}.lora_A.weight": (0, 16), f"{p}.lora_B.weight": (16, 0)}
    with pytest.raises(AdapterFormatError, match="a LoRA with no rank"):  # convert, mix and the loader's rule
        check_dense_factors(shapes, list(shapes), adapter="ad")


def test_a_full_disk_while_mix_writes_names_the_folder_and_the_fix(tmp_path: Path) -> None:
    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_FSIZE, (2048, 2048))

    out = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "mix", "-o", str(tmp_path / "out"), f"{a}=1",
                          f"{b}=1"], capture_output=True, text=True, preexec_fn=limit, timeout=120,
                         env={"PYTHONPATH": SRC, "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                              "PYTHONDONTWRITEBYTECODE": "1"})  # under the limit, a .pyc would be cut short
    assert out.returncode != 0
    assert "unexpected" not in out.stderr, out.stderr
    assert f"Could not write the adapter into {str(tmp_path / 'out')!r}: a file passed the file size limit" in out.stderr
    assert not (tmp_path / "out" / "adapter_model.safetensors").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".out")] == []


def test_claiming_a_folder_named_with_glob_characters_leaves_another_runs_work(tmp_path: Path) -> None:
    other = tmp_path / ".out1.tmp-abc123"  # another run writing 'out1'
    other.mkdir()
    (other / "adapter_model.safetensors").write_bytes(b"half written")
    parked = tmp_path / ".out1.old-abc123" / "old"
    parked.mkdir(parents=True)
    with OutputClaim(tmp_path / "out[1]"):
        pass
    assert (other / "adapter_model.safetensors").read_bytes() == b"half written"
    assert parked.is_dir() and not (tmp_path / "out[1]").exists() and not (tmp_path / "out1").exists()


def test_a_duplicate_key_hidden_behind_escaped_field_names_is_refused(tmp_path: Path) -> None:
    header = ('{"w": {"\\u0064type": "F32", "\\u0073hape": [0], "\\u0064ata_offsets": [0, 0]}, '
              '"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}').encode()
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(Exception, match="duplicate key 'w'"):
        read_header(path)


def test_an_output_folder_that_cannot_be_written_is_named_with_the_fix(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    a = make_dense_adapter(tmp_path / "a")
    assert main(["mix", str(a), "-o", "/proc/x"]) == 1
    err = capsys.readouterr().err
    assert "Cannot write into '/proc'" in err and "Choose an output folder you can write to" in err
    assert "Errno" not in err


def test_two_sparse_shared_files_that_fit_alone_but_not_together_are_refused_not_left_to_sigbus(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each arena checked the free space alone, so two stayed sparse in a /dev/shm with room for one, and
    writing the second killed the build process (SIGBUS); the holes of the files already there now count."""
    import errno
    import os
    import shutil
    from collections import namedtuple

    from vllm_lora_ext.sharedfiles import reserve_when_tight

    mb = 1 << 20
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda folder: usage(300 * mb, 0, 300 * mb))
    first = tmp_path / "vllm-lora-ext-a.bin"
    with open(first, "wb") as f:
        f.truncate(200 * mb)  # sparse: 200 MiB still to take
    fd = os.open(tmp_path / "vllm-lora-ext-b.bin", os.O_RDWR | os.O_CREAT)
    try:
        os.ftruncate(fd, 200 * mb)
        reserve_when_tight(fd, str(tmp_path), 50 * mb, prefix="vllm-lora-ext-")  # 300 - 200 >= 50 + 0: fits
        with pytest.raises(OSError) as info:
            reserve_when_tight(fd, str(tmp_path), 200 * mb, prefix="vllm-lora-ext-")
        assert info.value.errno == errno.ENOSPC and "beside the shared files already there" in str(info.value)
    finally:
        os.close(fd)


def test_shared_files_made_after_their_folder_was_cleaned_are_swept_once_their_owner_dies(tmp_path: Path) -> None:
    """The owner tag stayed cached after a cleaner removed its lock file, so the files made afterwards had no lock
    and no sweep ever removed them once the process was killed."""
    import os
    import signal

    from vllm_lora_ext.transport.files import sweep_stale

    folder = tmp_path / "shm"
    folder.mkdir()
    code = ("import os, shutil, sys, time\nfrom vllm_lora_ext.transport.files import owned_name\n"
            "d = sys.argv[1]\nopen(owned_name(d), 'wb').write(b'x')\nshutil.rmtree(d); os.mkdir(d)\n"
            "open(owned_name(d), 'wb').write(b'y' * 4096)\nprint('ready', flush=True)\ntime.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code, str(folder)], stdout=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONPATH": SRC, "PYTHONDONTWRITEBYTECODE": "1"})
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        assert any(n.endswith(".lock") for n in os.listdir(folder))  # locked again under its tag
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait()
    sweep_stale(str(folder))
    assert [n for n in os.listdir(folder) if n.endswith(".bin")] == []


def test_claiming_an_owner_tag_in_a_removed_folder_never_closes_another_files_descriptor(tmp_path: Path) -> None:
    """After the folder went, each claim closed the old lock's descriptor again: a number the process had reused
    for another file meanwhile (a config being read) was closed under it (EBADF)."""
    import os
    import shutil

    from vllm_lora_ext.sharedfiles import claim_owner

    folder = tmp_path / "shm"
    folder.mkdir()
    claim_owner(str(folder), "vllm-lora-ext-")
    shutil.rmtree(folder)
    with pytest.raises(OSError):
        claim_owner(str(folder), "vllm-lora-ext-")
    other = os.open(tmp_path / "config.json", os.O_RDWR | os.O_CREAT)  # likely the number just closed
    try:
        with pytest.raises(OSError):
            claim_owner(str(folder), "vllm-lora-ext-")
        os.fstat(other)  # still open
    finally:
        os.close(other)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "entry-by-entry"])
@pytest.mark.parametrize("first", ["{}", "{ }", '{"__x": 1}', "5", "null", '"x"', "[1, 2]"],
                         ids=["empty", "spaced", "unknown-field", "number", "null", "text", "list"])
def test_a_duplicate_key_whose_first_entry_names_no_field_is_refused(tmp_path: Path, first: str, bulk: bool,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """A first entry with none of the three fields left the field counts equal to the entries the parse kept (the
    last one wins), so the header was taken (in bulk, and entry by entry without msgspec); safetensors refuses
    it. The entry-by-entry parse names it."""
    if not bulk:
        monkeypatch.setattr("vllm_lora_ext.headers._DECODERS", None)
    header = ('{"w": ' + first + ', "w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}').encode()
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(AdapterFormatError, match="duplicate key 'w'"):
        read_header(path)


def test_braces_in_names_and_metadata_parse_in_bulk(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A brace inside a name or a metadata text (JSON-valued metadata) is counted as such: the header still takes
    the bulk parse; a duplicate beside such braces still goes to the parse that names it."""
    from vllm_lora_ext import headers

    entry = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
    header = json.dumps({"__metadata__": {"cfg{": '{"r": {"x": 1}}'}, "w{0}": entry}).encode()
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    slow = headers._check_header_one_by_one
    monkeypatch.setattr(headers, "_check_header_one_by_one", lambda *a: pytest.fail("took the slow parse"))
    got = read_header(path)
    assert list(got.tensors) == ["w{0}"] and got.metadata == {"cfg{": '{"r": {"x": 1}}'}
    monkeypatch.setattr(headers, "_check_header_one_by_one", slow)
    dup = ('{"__metadata__": {"a": "{"}, "w{": {}, "w{": ' + json.dumps(entry) + '}').encode()
    path.write_bytes(struct.pack("<Q", len(dup)) + dup + bytes(16))
    with pytest.raises(AdapterFormatError, match="duplicate key 'w{'"):
        read_header(path)


@pytest.mark.parametrize("first", ["0", "null"])
def test_a_duplicate_metadata_key_is_refused(tmp_path: Path, first: str) -> None:
    header = ('{"__metadata__": ' + first + ', "__metadata__": {"a": "b"}, '
              '"w": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}').encode()
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(4))
    with pytest.raises(AdapterFormatError, match="duplicate key '__metadata__'"):
        read_header(path)


@pytest.mark.parametrize("bulk", [True, False], ids=["bulk", "entry-by-entry"])
@pytest.mark.parametrize("text", ['\ufeff{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}',
                                  '{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], "x": NaN}}',
                                  '{"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16], "x": -Infinity}}'],
                         ids=["bom", "nan", "infinity"])
def test_what_json_reads_and_safetensors_refuses_is_refused(tmp_path: Path, text: str, bulk: bool,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Python's json reads past a byte-order mark and takes NaN and Infinity, even in a field nothing reads;
    safetensors refuses such a header, so the plugin does too (a file two readers read differently)."""
    if not bulk:
        monkeypatch.setattr("vllm_lora_ext.headers._DECODERS", None)
    header = text.encode()
    path = tmp_path / "a.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + bytes(16))
    with pytest.raises(AdapterFormatError, match="not valid JSON"):
        read_header(path)
