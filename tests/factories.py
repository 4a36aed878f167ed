"""Tiny adapters and models, built in code (seeded) for tests. Nothing is downloaded."""

from __future__ import annotations

import contextlib
import json
import subprocess
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

PREFIX = "base_model.model."


def write_adapter(folder: Path, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any] | None, *,
                  weights_name: str = "adapter_model.safetensors", config_name: str = "adapter_config.json",
                  metadata: Mapping[str, str] | None = None) -> Path:
    """Write a weight file (and a config unless ``config`` is None); return the weight file's path."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / weights_name
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(path), metadata=dict(metadata) if metadata else None)
    if config is not None:
        (folder / config_name).write_text(json.dumps(dict(config)))
    return path


def lora_config(r: int = 4, alpha: float = 8, targets: Sequence[str] = ("q_proj", "v_proj"), **extra: Any) -> dict[str, Any]:
    cfg: dict[str, Any] = {"peft_type": "LORA", "r": r, "lora_alpha": alpha, "target_modules": list(targets),
                           "bias": "none", "use_rslora": False, "use_dora": False, "modules_to_save": None}
    cfg.update(extra)
    return cfg


def dense_tensors(shapes: Mapping[str, tuple[int, int]], *, rank: int = 4, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """``{module: (in, out)}`` -> PEFT keys with random A ``(r, in)`` and B ``(out, r)``."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for module, (d_in, d_out) in shapes.items():
        out[f"{PREFIX}{module}.lora_A.weight"] = torch.randn(rank, d_in, generator=g).to(dtype)
        out[f"{PREFIX}{module}.lora_B.weight"] = torch.randn(d_out, rank, generator=g).to(dtype)
    return out


def llama_shapes(num_layers: int = 2, hidden: int = 16, kv: int = 8, inter: int = 32,
                 targets: Sequence[str] = ("q_proj", "v_proj")) -> dict[str, tuple[int, int]]:
    dims = {"q_proj": (hidden, hidden), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (hidden, hidden),
            "gate_proj": (hidden, inter), "up_proj": (hidden, inter), "down_proj": (inter, hidden)}
    out = {}
    for i in range(num_layers):
        for t in targets:
            block = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out[f"model.layers.{i}.{block}.{t}"] = dims[t]
    return out


def hub_adapter_files(seed: int = 0) -> dict[str, bytes]:
    """The files of a tiny dense adapter as a Hub repo holds them (for ``HubServer.repo(...).commit``)."""
    from safetensors.torch import save

    return {"adapter_model.safetensors": save(dense_tensors(llama_shapes(), rank=4, seed=seed)),
            "adapter_config.json": json.dumps(lora_config(r=4)).encode()}


def make_dense_adapter(folder: Path, *, rank: int = 4, alpha: float = 8, seed: int = 0,
                       targets: Sequence[str] = ("q_proj", "v_proj"), **cfg: Any) -> Path:
    tensors = dense_tensors(llama_shapes(targets=targets), rank=rank, seed=seed)
    write_adapter(folder, tensors, lora_config(rank, alpha, targets, **cfg))
    return folder


def tiny_llama(seed: int = 0, *, hidden: int = 64, layers: int = 2, vocab: int = 256) -> Any:
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return transformers.LlamaForCausalLM(config)


def make_peft_adapter(model: Any, folder: Path, *, targets: Sequence[str], rank: int = 8, alpha: float = 16,
                      seed: int = 0, **kwargs: Any) -> Path:
    """Train nothing: wrap ``model`` with real PEFT (non-zero init) and save the adapter."""
    import peft

    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets), init_lora_weights=False, **kwargs)
    pm = peft.get_peft_model(model, cfg)
    pm.save_pretrained(str(folder))
    return folder


def scrape(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every ``vllm_lora_ext_*`` sample of a Prometheus text scrape, keyed by (name, sorted labels)."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith("vllm_lora_ext_"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@contextlib.contextmanager
def tiny_tmpfs(size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` (``"2m"``) under /dev/shm for a full-disk test, and unmount it after; skip the
    test where it cannot be mounted (not root, no mount permission in a container)."""
    import pytest

    disk = Path("/dev/shm") / f"vllm-lora-ext-test-{uuid.uuid4().hex[:8]}"  # outside tmp_path's disk
    disk.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk)],
                              capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        disk.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {err}")
    if done.returncode != 0:
        disk.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()[:200]}")
    try:
        yield disk
    finally:
        subprocess.run(["umount", str(disk)], check=False, timeout=60)
        disk.rmdir()


def load_bench(name: str, *, as_name: str | None = None) -> Any:
    """Import ``bench/<name>.py`` by path (``bench/`` is no package), with ``bench/`` and ``tests/gpu/`` on the path
    for its own imports, registered in ``sys.modules`` as ``as_name`` (default ``name``: its dataclasses look their
    module up there). A fresh module each call."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    for folder in (root / "tests" / "gpu", root / "bench"):
        if str(folder) not in sys.path:
            sys.path.insert(0, str(folder))
    spec = importlib.util.spec_from_file_location(as_name or name, root / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class RecordingEngine:
    """The engine client an API server's ``OpenAIServingModels`` talks to, as a stand-in at that outer boundary:
    the LoRA settings the plugin reads, and ``add_lora`` answering yes and recording the names it was asked for."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.vllm_config = SimpleNamespace(lora_config=SimpleNamespace(max_cpu_loras=8, max_loras=4))
        self.asked: list[str] = []

    async def add_lora(self, req: Any) -> bool:
        self.asked.append(str(req.lora_name))
        return True


def serving_models(engine: Any = None) -> Any:
    """vLLM's real ``OpenAIServingModels`` with the state its LoRA methods use (no model loaded): no adapters, vLLM's
    own id counter, ``base-model`` the served base model, and ``engine`` (default a `RecordingEngine`)."""
    import asyncio
    from collections import defaultdict
    from types import SimpleNamespace

    from vllm.entrypoints.openai.models.serving import OpenAIServingModels
    from vllm.utils.counter import AtomicCounter

    models = OpenAIServingModels.__new__(OpenAIServingModels)
    models.lora_requests = {}
    models.lora_resolver_lock = defaultdict(asyncio.Lock)
    models.lora_id_counter = AtomicCounter(0)
    models.engine_client = engine if engine is not None else RecordingEngine()
    models.static_lora_modules = None
    models.registry = SimpleNamespace(is_base_model=lambda name: name == "base-model")
    return models


# The vLLM modules that decide pinning (0.26: a PIN_MEMORY constant; 0.32: is_pin_memory_available where imported).
PIN_MEMORY_MODULES = ("vllm.lora.lora_model", "vllm.lora.lora_weights", "vllm.lora.model_manager",
                      "vllm.utils.torch_utils", "vllm.lora.punica_wrapper.utils")


def unpin_vllm(set_attr: Callable[[Any, str, Any], None] = setattr) -> None:
    """vLLM believes it can pin memory on a machine without a driver; tell it the truth, through ``set_attr``
    (``setattr``, or a pytest monkeypatch's, undone after the test).

    0.26 reads a PIN_MEMORY constant; 0.32's punica mapping asks is_pin_memory_available() where it imported it.
    """
    import importlib

    for name in PIN_MEMORY_MODULES:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        set_attr(mod, "PIN_MEMORY", False)
        if hasattr(mod, "is_pin_memory_available"):
            set_attr(mod, "is_pin_memory_available", lambda: False)
