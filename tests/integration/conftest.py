"""Fixtures for tests that use real vLLM modules on the CPU."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

pytestmark = pytest.mark.vllm


@pytest.fixture
def no_pin_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM believes it can pin memory on a machine without a driver; tell it the truth (`factories.unpin_vllm`)."""
    from factories import unpin_vllm

    unpin_vllm(lambda mod, name, value: monkeypatch.setattr(mod, name, value, raising=False))


# The sizes vLLM's linear layers report for factories.tiny_llama (hidden 64, 2 kv heads of 16, intermediate 128).
_SIZES = {"qkv_proj": (64, [64, 32, 32]), "o_proj": (64, 64), "gate_up_proj": (64, [128, 128]), "down_proj": (128, 64)}


def llama_adapter_manager(num_layers: int = 2) -> Any:
    """The part of vLLM's LoRAModelManager that loading reads, for a Llama model: the wrapped
    module names, their base layers' sizes, and vLLM's own packing table
    (LlamaForCausalLM.packed_modules_mapping)."""
    from vllm.model_executor.models.llama import LlamaForCausalLM

    mapping = LlamaForCausalLM.packed_modules_mapping
    modules: dict[str, object] = {}
    packed: dict[str, list[str]] = {}
    for i in range(num_layers):
        for block, names in (("self_attn", ("qkv_proj", "o_proj")), ("mlp", ("gate_up_proj", "down_proj"))):
            for n in names:
                full = f"model.layers.{i}.{block}.{n}"
                d_in, out = _SIZES[n]
                base = (SimpleNamespace(input_size=d_in, output_size=sum(out), output_sizes=out)
                        if isinstance(out, list) else SimpleNamespace(input_size=d_in, output_size=out))
                modules[full] = SimpleNamespace(base_layer=base)
                if n in mapping:
                    packed[full] = [f"model.layers.{i}.{block}.{m}" for m in mapping[n]]
    view = SimpleNamespace(
        supported_lora_modules=["qkv_proj", "o_proj", "gate_up_proj", "down_proj"],
        packed_modules_mapping=dict(mapping), modules=modules, packed_modules=packed,
        model=SimpleNamespace(), moe_ep_load_spec=None, is_pooling_model=False,
        _enable_mixed_moe_lora_format=False, _classification_head=None, _pooling_task=None,
    )
    # vLLM's own post-load checks (0.33: MoE format, classification head), bound to this view where they exist.
    import types

    from vllm.lora.model_manager import LoRAModelManager

    from vllm_lora_ext.integration._compat import POST_LOAD_VALIDATORS

    for name in (*POST_LOAD_VALIDATORS, "_get_lora_layer_weights", "_get_module_to_save_weights"):
        fn = getattr(LoRAModelManager, name, None)
        if fn is not None:
            setattr(view, name, types.MethodType(fn, view))
    return view


@pytest.fixture
def worker_manager(no_pin_memory: None) -> Any:
    """A real vLLM WorkerLoRAManager object around the adapter-manager view above (`make_worker_manager`)."""
    return make_worker_manager()


def make_worker_manager() -> Any:
    """A real vLLM WorkerLoRAManager object (its __init__ needs a full engine config, so the
    fields it sets are filled in directly) around the adapter-manager view above."""
    import torch
    from vllm.config.lora import LoRAConfig
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.worker_manager import WorkerLoRAManager

    mgr = object.__new__(WorkerLoRAManager)
    mgr._lora_model_cls = LoRAModel
    mgr.embedding_modules = {}
    mgr.vocab_size = 256
    mgr.max_position_embeddings = 256
    mgr.lora_config = LoRAConfig(max_lora_rank=16, max_loras=2, lora_dtype=torch.float32)
    mgr.device = torch.device("cpu")
    mgr._adapter_manager = llama_adapter_manager()
    return mgr


@pytest.fixture
def jobs_sent(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the jobs sent to a build process from now on (in the order sent)."""
    from vllm_lora_ext.integration import build_process

    sent: list[str] = []
    real_submit = build_process._Child.submit

    def counted(self: Any, job: Any, *args: Any) -> Any:
        sent.append(job.name)
        return real_submit(self, job, *args)

    monkeypatch.setattr(build_process._Child, "submit", counted)
    return sent
