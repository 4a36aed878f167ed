"""outputs._unwritable: the reason an output folder cannot be written, as a user can act on it."""

from __future__ import annotations

import subprocess
import uuid
from pathlib import Path

import pytest

from factories import make_dense_adapter
from vllm_lora_ext.cli import main


def test_an_unbounded_tmpfs_out_of_inodes_is_named_full_not_virtual(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A tmpfs mounted size=0 (no block bound, as ramfs) reports f_blocks == 0 like /proc: its ENOSPC (inodes used
    up) was reported as "a virtual file system with no disk behind it (as /proc and /sys are)"."""
    disk = Path("/dev/shm") / f"r44-{uuid.uuid4().hex[:8]}"
    disk.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=0,nr_inodes=3", "tmpfs", str(disk)],
                          capture_output=True, text=True, timeout=30)
    if done.returncode != 0:
        disk.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        (disk / "x").mkdir()
        (disk / "y").mkdir()  # the last inode
        a = make_dense_adapter(tmp_path / "a")
        assert main(["mix", f"{a}=1", "-o", str(disk / "x" / "out")]) == 1
        err = capsys.readouterr().err
        assert "virtual file system" not in err and "no space left on the device" in err, err
    finally:
        subprocess.run(["umount", str(disk)], timeout=30)
        disk.rmdir()
