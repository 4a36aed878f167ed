"""Shared fixtures: an isolated, offline-by-default HF cache per test, and the local Hub server."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

# Build processes the tests start keep a small spare shared file, not the 2 GiB default.
os.environ.setdefault("VLLM_LORA_EXT_BUILD_SPARE_BYTES", str(8 << 20))

HAS_VLLM = importlib.util.find_spec("vllm") is not None


def _has_gpu() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except Exception:  # pragma: no cover
        return False


def pytest_configure(config: pytest.Config) -> None:
    """Refuse to test another tree's package: a venv whose editable install points at one checkout imports that
    checkout's code in every other clone that uses it, and its tests would pass or fail for code not under test."""
    spec = importlib.util.find_spec("vllm_lora_ext")
    origin = Path(spec.origin).resolve() if spec is not None and spec.origin else None
    root = Path(config.rootpath).resolve()
    if origin is not None and not origin.is_relative_to(root):
        raise pytest.UsageError(f"these tests would import vllm_lora_ext from {origin.parent}, not from this tree "
                                f"({root}): run them with PYTHONPATH=src, or install this tree (pip install -e .)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    gpu = _has_gpu()
    for item in items:  # markers, not keywords: a folder named hub or gpu in the clone's path is a keyword too
        if item.get_closest_marker("vllm") and not HAS_VLLM:
            item.add_marker(pytest.mark.skip(reason="vLLM is not installed"))
        if item.get_closest_marker("gpu") and not gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
        if item.get_closest_marker("hub"):
            item.add_marker(pytest.mark.skip(reason="real-Hub tests are opt-in"))


@pytest.fixture
def released() -> Iterator[None]:
    """End, after the test, the disk-tier holds a `vllm-lora` command's resolves took (a command ends them by
    exiting; this test process lives on)."""
    yield
    from vllm_lora_ext.cli import _args

    while _args._HELD:
        _args._HELD.pop().release()  # type: ignore[attr-defined]


@pytest.fixture(autouse=True)
def isolated_hf_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Give every test its own HF cache and start it offline (HF_HUB_OFFLINE=1)."""
    import huggingface_hub.constants as hc

    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setattr(hc, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for var in ("VLLM_LORA_EXT_ALLOW_PICKLE", "VLLM_LORA_EXT_ALLOW_UNSUPPORTED_VLLM", "VLLM_LORA_EXT_DISABLE",
                "VLLM_LORA_EXT_ALLOW_UNMATCHED_KEYS"):
        monkeypatch.delenv(var, raising=False)
    return cache


@pytest.fixture(autouse=True)
def package_logs_reach_caplog(monkeypatch: pytest.MonkeyPatch) -> None:
    """Let the package logger's records reach ``caplog``, whatever ran before.

    ``_logging.attach_handler_once`` gives the logger its own handler and stops propagation the first time it
    runs; whether that first time fell inside a CLI call (which restores propagation after) depended on test
    order. Attached here first, with propagation on for the test, a later attach leaves it as it is.
    """
    from vllm_lora_ext._logging import attach_handler_once

    monkeypatch.setattr(attach_handler_once(), "propagate", True)


@pytest.fixture
def hub(monkeypatch: pytest.MonkeyPatch) -> Iterator[object]:
    """The local Hub server, online (HF_HUB_OFFLINE=0), with a clean request log and no repos."""
    from hubserver import SERVER as HUB

    assert HUB is not None

    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    HUB.repos.clear()
    HUB.requests.clear()
    HUB.drop_once.clear()
    HUB.lies.clear()
    HUB.seen.clear()
    HUB.script.clear()
    HUB.routes.clear()
    HUB.slow_headers.clear()
    yield HUB
    HUB.repos.clear()
    HUB.lies.clear()
    for _, _, stop in HUB.slow_headers.values():
        stop.set()
    HUB.slow_headers.clear()


@pytest.fixture
def fresh_metrics(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A new, empty metrics directory owned by this process (as the API server's would be)."""
    from vllm_lora_ext import metrics
    from vllm_lora_ext.constants import ENV_METRICS_DIR

    metrics.teardown()
    monkeypatch.delenv("PROMETHEUS_MULTIPROC_DIR", raising=False)
    monkeypatch.delenv(ENV_METRICS_DIR, raising=False)
    path = metrics.setup()
    assert path is not None
    yield path
    metrics.teardown()


@pytest.fixture
def build_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty folder build processes hand their shared files over in (``VLLM_LORA_EXT_BUILD_DIR``)."""
    folder = tmp_path / "shared"
    folder.mkdir()
    monkeypatch.setenv("VLLM_LORA_EXT_BUILD_DIR", str(folder))
    return folder
