"""The disk tier's ledger as read back: what it may hold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vllm_lora_ext.diskledger import LEDGER, read_ledger


def _entry(last_use: object) -> dict[str, object]:
    return {"repo_id": "acme/a", "commit": "a" * 40, "files": ["adapter_model.safetensors"], "last_use": last_use}


@pytest.mark.parametrize(("last_use", "read"), [("NaN", 0.0), ("-1", 0.0), ("Infinity", "now"), ("1e300", "now")])
def test_a_last_use_that_is_no_time_is_read_as_the_oldest_or_as_now(tmp_path: Path, last_use: str,
                                                                     read: object) -> None:
    """``float()`` took NaN, infinity and 1e300: `cache ls` then failed with a bare ValueError or OverflowError, its
    --json printed NaN, and a far-future time kept the revision from ever being evicted. The other entries, and the
    ledger, stay (a host whose clock runs ahead writes honest times of the future)."""
    good = _entry(time.time() - 5)
    text = json.dumps({"version": 1, "revisions": {"acme/a@x": _entry("LAST"), "acme/b@y": good}})
    (tmp_path / LEDGER).write_text(text.replace('"LAST"', last_use))  # as json.dumps writes NaN and Infinity
    before = time.time()
    entries = read_ledger(tmp_path)
    used = entries["acme/a@x"]["last_use"]
    assert used == 0.0 if read == 0.0 else before <= used <= time.time()
    assert entries["acme/b@y"] == good and not (tmp_path / f"{LEDGER}.unreadable").exists()


def test_a_ledger_of_times_in_use_is_read_as_written(tmp_path: Path) -> None:
    entries = {"acme/a@x": _entry(time.time() - 5)}
    (tmp_path / LEDGER).write_text(json.dumps({"version": 1, "revisions": entries}))
    assert read_ledger(tmp_path) == entries


def test_snapshot_blobs_counts_only_the_repos_own_blobs_of_a_sha_commit(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """A ledger a user edited cannot make the disk tier count (and so keep for good) files outside the repo: a
    commit that is no sha names no snapshot, and a file name that leads out of the repo's blobs is not counted."""
    from vllm_lora_ext.diskledger import snapshot_blobs

    repo = tmp_path / "models--acme--a"
    sha = "a" * 40
    (repo / "blobs").mkdir(parents=True)
    (repo / "snapshots" / sha).mkdir(parents=True)
    (repo / "blobs" / "b1").write_bytes(b"x" * 10)
    (repo / "snapshots" / sha / "w.safetensors").symlink_to(repo / "blobs" / "b1")
    (tmp_path / "outside").write_bytes(b"y" * 1000)
    (repo / "snapshots" / sha / "out.safetensors").symlink_to(tmp_path / "outside")
    files = ["w.safetensors", "out.safetensors", "../../../outside", str(tmp_path / "outside")]
    assert snapshot_blobs(tmp_path, {"repo_id": "acme/a", "commit": "../..", "files": files}) is None
    got = snapshot_blobs(tmp_path, {"repo_id": "acme/a", "commit": sha, "files": files})
    assert got == {"w.safetensors": (str((repo / "blobs" / "b1").resolve()), 10)}
