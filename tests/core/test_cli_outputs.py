"""`convert`/`mix` outputs are written whole or not at all (issue 35, item 6): a temporary folder swapped in by one
rename, under an exclusive lock on the target; an interrupted or killed write leaves the old adapter as it was."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from factories import make_dense_adapter
from vllm_lora_ext.cli import main
from vllm_lora_ext.errors import OutputPathError
from vllm_lora_ext.outputs import claim_output, write_atomically

SRC = str(Path(__file__).resolve().parents[2] / "src")
TESTS = str(Path(__file__).resolve().parents[1])


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _beside(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.parent.iterdir() if p.name.startswith(f".{folder.name}."))


def test_a_folder_another_command_is_writing_is_refused_and_nothing_is_written(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    make_dense_adapter(tmp_path / "a")
    with claim_output(tmp_path / "out"):
        assert main(["mix", f"{tmp_path / 'a'}=0.5", "-o", str(tmp_path / "out")]) == 1
        assert capsys.readouterr().err.strip() == (
            f"error: Output folder '{tmp_path / 'out'}' is being written by another vllm-lora command (it holds "
            f"'{tmp_path / '.out.lock'}'). Wait for it to finish, or choose another folder.")
        assert not (tmp_path / "out").exists()
    assert _beside(tmp_path / "out") == []  # the lock file goes with the lock


def test_two_mixes_started_together_into_one_new_folder_do_not_both_succeed(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "a", seed=1)
    make_dense_adapter(tmp_path / "b", seed=2)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": SRC}
    runs = [subprocess.Popen([sys.executable, "-m", "vllm_lora_ext.cli", "mix", f"{tmp_path / w}=0.5", "-o",
                              str(tmp_path / "out")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
            for w in ("a", "b")]
    results = [(p.wait(timeout=300), p.stderr.read()) for p in runs if p.stderr is not None]
    assert sorted(code for code, _ in results) == [0, 1], results
    err = next(e for code, e in results if code == 1)
    assert "is being written by another vllm-lora command" in err or "is not empty" in err, err
    provenance = json.loads((tmp_path / "out" / "vllm_lora_ext_mix.json").read_text())
    winner = "a" if provenance["adapters"][0][0].endswith("/a") else "b"
    assert _beside(tmp_path / "out") == [] and provenance["adapters"] == [[str(tmp_path / winner), 0.5]]


def test_mix_force_over_an_adapter_replaces_weights_and_config_together_and_keeps_other_files(
        tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "a", seed=1, rank=4)
    make_dense_adapter(tmp_path / "out", seed=2, rank=8)
    (tmp_path / "out" / "README.md").write_text("notes")
    assert main(["mix", f"{tmp_path / 'a'}=0.5", "-o", str(tmp_path / "out"), "--force"]) == 0
    assert sorted(_files(tmp_path / "out")) == ["README.md", "adapter_config.json", "adapter_model.safetensors",
                                                "vllm_lora_ext_mix.json"]
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 4
    assert (tmp_path / "out" / "README.md").read_text() == "notes" and _beside(tmp_path / "out") == []


def test_a_write_interrupted_before_the_swap_leaves_the_old_adapter_whole(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "out", seed=2)
    before = _files(tmp_path / "out")

    def write(tmp: Path) -> None:
        (tmp / "adapter_model.safetensors").write_bytes(b"new weights")
        raise KeyboardInterrupt  # Ctrl-C between the weights and the config

    with pytest.raises(KeyboardInterrupt):
        write_atomically(tmp_path / "out", write)
    assert _files(tmp_path / "out") == before and _beside(tmp_path / "out") == []


def test_a_killed_write_leaves_the_old_adapter_whole_and_the_next_write_removes_its_leftovers(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "out", seed=2)
    before = _files(tmp_path / "out")
    script = textwrap.dedent(f"""
        import time
        from pathlib import Path
        from vllm_lora_ext.outputs import write_atomically

        def write(tmp):
            (tmp / "adapter_model.safetensors").write_bytes(b"new weights")
            Path({str(tmp_path / 'ready')!r}).touch()
            time.sleep(600)

        write_atomically(Path({str(tmp_path / 'out')!r}), write)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], env={**os.environ, "PYTHONPATH": f"{SRC}:{TESTS}"})
    try:
        deadline = time.monotonic() + 120
        while not (tmp_path / "ready").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        assert (tmp_path / "ready").exists()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=60)
    assert _files(tmp_path / "out") == before
    assert [n for n in _beside(tmp_path / "out") if ".tmp-" in n]  # a SIGKILL leaves its temporary folder...
    write_atomically(tmp_path / "out", lambda tmp: (tmp / "adapter_config.json").write_text("{}"))
    assert _beside(tmp_path / "out") == []  # ...which the next write to that folder removes under the lock
    assert (tmp_path / "out" / "adapter_config.json").read_text() == "{}"


def test_an_old_adapter_left_aside_by_a_killed_fallback_swap_is_put_back_by_the_next_claim(tmp_path: Path) -> None:
    make_dense_adapter(tmp_path / "aside" / "old", seed=2)  # where the fallback swap keeps it between its renames
    before = _files(tmp_path / "aside" / "old")
    (tmp_path / "aside").rename(tmp_path / ".out.old-x1")  # ...killed before the new folder was renamed in
    with claim_output(tmp_path / "out", force=True):
        assert _files(tmp_path / "out") == before
    assert _beside(tmp_path / "out") == []


def test_without_rename_exchange_the_fallback_swap_replaces_the_folder_whole(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from vllm_lora_ext import outputs

    monkeypatch.setattr(outputs, "_exchange", lambda a, b: False)  # a file system without RENAME_EXCHANGE
    make_dense_adapter(tmp_path / "a", seed=1, rank=4)
    make_dense_adapter(tmp_path / "out", seed=2, rank=8)
    (tmp_path / "out" / "README.md").write_text("notes")
    assert main(["mix", f"{tmp_path / 'a'}=0.5", "-o", str(tmp_path / "out"), "--force"]) == 0
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["r"] == 4
    assert (tmp_path / "out" / "README.md").read_text() == "notes" and _beside(tmp_path / "out") == []


def test_written_files_and_folder_follow_the_umask_so_a_server_of_another_user_can_read_them(tmp_path: Path) -> None:
    # safetensors' save_file writes 0600; a mix is meant to serve anywhere, as any file the user writes would
    def write(folder: Path) -> None:
        (folder / "adapter_model.safetensors").write_bytes(b"x")
        os.chmod(folder / "adapter_model.safetensors", 0o600)
        (folder / "adapter_config.json").write_text("{}")

    old = os.umask(0o022)
    try:
        out = write_atomically(tmp_path / "mix", write)
    finally:
        os.umask(old)
    assert (out.stat().st_mode & 0o777) == 0o755
    assert {p.name: p.stat().st_mode & 0o777 for p in out.iterdir()} == {"adapter_model.safetensors": 0o644,
                                                                          "adapter_config.json": 0o644}


def test_an_empty_output_or_one_that_holds_the_working_folder_is_refused(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``-o "$OUT"`` with ``OUT`` unset wrote into the current folder, and a write into the current folder (or one
    that holds it) swapped it out, leaving the shell in a deleted folder."""
    make_dense_adapter(tmp_path / "a")
    work = tmp_path / "work" / "here"
    work.mkdir(parents=True)
    (work / "notes.txt").write_text("keep")
    monkeypatch.chdir(work)
    assert main(["mix", f"{tmp_path / 'a'}=1", "-o", "", "--force"]) == 1
    assert "The output folder is empty ('')" in capsys.readouterr().err
    for out in (".", "..", str(work)):
        assert main(["mix", f"{tmp_path / 'a'}=1", "-o", out, "--force"]) == 1
        assert "is the current folder or holds it" in capsys.readouterr().err
    assert os.path.samefile(os.getcwd(), work) and sorted(os.listdir(work)) == ["notes.txt"]
    assert main(["mix", f"{tmp_path / 'a'}=1", "-o", "./adapter"]) == 0  # a folder inside it
    assert (work / "adapter" / "adapter_model.safetensors").is_file()


def test_force_keeps_the_folders_mode_so_files_it_kept_private_stay_private(tmp_path: Path) -> None:
    """The swapped-in folder took the umask's mode: a 0700 folder became 0755 around the files it kept private."""
    make_dense_adapter(tmp_path / "a")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    (out / "notes.txt").write_text("private")
    os.chmod(out / "sub", 0o700)
    os.chmod(out, 0o700)
    assert main(["mix", f"{tmp_path / 'a'}=1", "-o", str(out), "--force"]) == 0
    assert (out.stat().st_mode & 0o777) == 0o700 and ((out / "sub").stat().st_mode & 0o777) == 0o700
    assert (out / "notes.txt").read_text() == "private" and (out / "adapter_model.safetensors").is_file()


def test_an_output_folder_holding_a_mount_is_refused_and_the_mount_untouched(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """--force copied a mounted file system into the new folder, then removed every file on it with the old one."""
    make_dense_adapter(tmp_path / "a")
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    try:
        mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(out / "data")],
                                 capture_output=True, text=True)
    except OSError as err:  # no mount command
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        (out / "data" / "important.txt").write_text("keep")
        for target in (out, out / "data"):
            assert main(["mix", f"{tmp_path / 'a'}=1", "-o", str(target), "--force"]) == 1
            err = capsys.readouterr().err
            assert ("holds a mount point at" if target == out else "is a mount point") in err, err
        assert (out / "data" / "important.txt").read_text() == "keep" and _beside(out) == []
    finally:  # wherever a write may have moved it (before the fix: into the old folder, renamed aside)
        for line in Path("/proc/self/mounts").read_text().splitlines():
            point = line.split()[1]
            if point.startswith(str(tmp_path)):
                subprocess.run(["umount", point], check=False)


def test_a_link_to_a_folder_is_locked_beside_the_folder_it_names(tmp_path: Path) -> None:
    """The lock went beside the link and the write beside the folder: ``-o link`` and ``-o folder`` took two locks."""
    (tmp_path / "real").mkdir()
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with claim_output(tmp_path / "link") as claim:
        assert claim.path == tmp_path / "real" and claim.lock_path == tmp_path / ".real.lock"


def test_a_bind_mount_of_the_same_file_system_is_refused_and_its_files_kept(tmp_path: Path) -> None:
    """Device numbers do not change at a bind mount of one file system: --force copied it, then emptied its source."""
    make_dense_adapter(tmp_path / "a")
    (tmp_path / "precious").mkdir()
    (tmp_path / "precious" / "important.txt").write_text("keep")
    out = tmp_path / "out"
    (out / "data").mkdir(parents=True)
    try:
        bound = subprocess.run(["mount", "--bind", str(tmp_path / "precious"), str(out / "data")],
                               capture_output=True, text=True)
    except OSError as err:
        pytest.skip(f"cannot bind-mount here: {err}")
    if bound.returncode != 0:
        pytest.skip(f"cannot bind-mount here: {bound.stderr.strip()}")
    try:
        with pytest.raises(OutputPathError, match="holds a mount point at"):
            write_atomically(out, lambda folder: (folder / "adapter_config.json").write_text("{}"))  # a library call
        assert main(["mix", f"{tmp_path / 'a'}=1", "-o", str(out), "--force"]) == 1
        assert os.listdir(tmp_path / "precious") == ["important.txt"]
    finally:
        for line in Path("/proc/self/mounts").read_text().splitlines():
            if line.split()[1].startswith(str(tmp_path)):
                subprocess.run(["umount", line.split()[1]], check=False)


def test_force_keeps_the_folders_owner_and_group_and_its_subfolders(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a folder another owner needs root")
    make_dense_adapter(tmp_path / "a")
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for folder in (out, out / "sub"):
        os.chown(folder, 65534, 65534)
    assert main(["mix", f"{tmp_path / 'a'}=1", "-o", str(out), "--force"]) == 0
    assert {(p.stat().st_uid, p.stat().st_gid) for p in (out, out / "sub")} == {(65534, 65534)}
    assert out.stat().st_mtime > (tmp_path / "a").stat().st_mtime - 60  # the write's own time, not the old folder's


def test_a_dangling_link_whose_target_folder_is_missing_is_refused(tmp_path: Path) -> None:
    """A write made the missing folders of the link's target (an unmounted disk: the root file system instead)."""
    (tmp_path / "link").symlink_to(tmp_path / "gone" / "deep" / "out")
    with pytest.raises(OutputPathError, match="whose folder does not exist"):
        claim_output(tmp_path / "link")
    assert not (tmp_path / "gone").exists()
