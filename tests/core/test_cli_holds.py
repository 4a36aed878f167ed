"""The offline tools (``vllm-lora mix``, ``inspect``, ``convert``) hold their ``hf:`` sources in the disk tier
while they run: an eviction by another process (or by the tool's own next download) never removes a source it is
about to read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save

from factories import dense_tensors, llama_shapes, lora_config
from vllm_lora_ext.cli import _args
from vllm_lora_ext.constants import ENV_DISK_CACHE_BYTES
from vllm_lora_ext.diskcache import list_cache


def test_a_source_read_by_a_command_survives_another_process_pruning_the_cache_to_zero(
        hub: Any, isolated_hf_cache: Path, monkeypatch: pytest.MonkeyPatch, released: None) -> None:
    import vllm_lora_ext

    for i in range(2):
        hub.repo(f"acme/m{i}").commit({"adapter_model.safetensors": save(dense_tensors(llama_shapes(), rank=4, seed=i)),
                                       "adapter_config.json": json.dumps(lora_config(r=4)).encode()})
    monkeypatch.setenv(ENV_DISK_CACHE_BYTES, "1GiB")
    kept = _args.resolve_offline("hf:acme/m0")  # as `vllm-lora mix hf:acme/m0 ...` resolves it, then reads it
    other = _args.resolve_offline("hf:acme/m1")
    _args._HELD.pop().release()  # type: ignore[attr-defined]  # m1's command ended
    assert [r.held_by for r in list_cache() if r.repo_id == "acme/m0"] == [(f"pid {os.getpid()}: read by a vllm-lora "
                                                                            f"command",)]
    env = dict(os.environ, PYTHONPATH=str(Path(vllm_lora_ext.__file__).parents[1]))
    done = subprocess.run([sys.executable, "-m", "vllm_lora_ext.cli", "cache", "prune", "--max-bytes", "0"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 1 and "stay in use (held by a live process" in done.stderr, done.stderr
    assert Path(kept.weights_path).is_file()  # still readable by the command that holds it
    assert not Path(other.weights_path).exists()  # what no command holds was pruned
