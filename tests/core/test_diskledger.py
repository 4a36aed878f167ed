"""The disk tier's ledger as read back: what it may hold."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from vllm_lora_ext.diskledger import LEDGER, read_ledger


def _entry(last_use: object) -> dict[str, object]:
    return {"repo_id": "acme/a", "commit": "a" * 40, "files": ["adapter_model.safetensors"], "last_use": last_use}


@pytest.mark.parametrize("last_use", ["NaN", "Infinity", "1e300", "-1"])
def test_a_ledger_whose_last_use_is_no_time_is_moved_aside(tmp_path: Path, last_use: str) -> None:
    """``float()`` took NaN, infinity and 1e300: `cache ls` then failed with a bare ValueError or OverflowError, its
    --json printed NaN, and a far-future time kept the revision from ever being evicted."""
    text = json.dumps({"version": 1, "revisions": {"acme/a@x": _entry("LAST")}}).replace('"LAST"', last_use)
    (tmp_path / LEDGER).write_text(text)  # as json.dumps writes a float that is not finite (NaN, Infinity)
    assert read_ledger(tmp_path) == {}
    assert (tmp_path / f"{LEDGER}.unreadable").exists() and not (tmp_path / LEDGER).exists()


def test_a_ledger_of_times_in_use_is_read_as_written(tmp_path: Path) -> None:
    entries = {"acme/a@x": _entry(time.time() - 5)}
    (tmp_path / LEDGER).write_text(json.dumps({"version": 1, "revisions": entries}))
    assert read_ledger(tmp_path) == entries
