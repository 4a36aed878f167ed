"""GPU test session: tiny models built once, a shared HF cache (engine processes inherit it), results to JSON."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))
# Set for a GPU run's engines only: collected beside the CPU tests, this file leaves their environment alone.
if os.path.exists("/dev/nvidiactl") or shutil.which("nvidia-smi"):
    # The test process touches CUDA (reference models) before engines start: engines must spawn, not fork.
    os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "spawn"
    # Every build gets a huge-page host arena, pinned in place in the worker (the tiny test adapters are far below
    # the default 4 MiB), so the parity tests below run on that memory.
    os.environ.setdefault("VLLM_LORA_EXT_HOST_ARENA_MIN_BYTES", "0")

RESULTS: dict[str, Any] = {}


@pytest.fixture(scope="session")
def gpu_workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("gpu")


@pytest.fixture(autouse=True)
def isolated_hf_cache(gpu_workdir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Override: one cache for the session, online against the local hub (engine processes inherit it)."""
    import huggingface_hub.constants as hc

    cache = gpu_workdir / "hf-cache"
    cache.mkdir(exist_ok=True)
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    return cache


@pytest.fixture(scope="session", autouse=True)
def gpu_session_env(gpu_workdir: Path) -> Iterator[None]:
    os.environ["HF_HUB_CACHE"] = str(gpu_workdir / "hf-cache")
    os.environ["HF_HUB_OFFLINE"] = "0"
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function
    yield
    out = os.environ.get("LORA_EXT_GPU_RESULTS")
    if out:
        import torch

        RESULTS["_device"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
        RESULTS["_time"] = time.strftime("%Y-%m-%d %H:%M:%S")
        Path(out).write_text(json.dumps(RESULTS, indent=2, default=str))


@pytest.fixture
def record() -> Any:
    def _record(key: str, value: Any) -> None:
        RESULTS[key] = value
    return _record
