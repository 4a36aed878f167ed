"""`bench/moe_matrix.py` records the experts kernels the engine's MoE LoRA layers ran (``moe_kernels``), read through
``llm.collective_rpc`` as vLLM's in-process executor runs it; a worker it cannot read them from gives null with the
reason instead of failing the run. CPU: vLLM's own executor, worker wrapper, LoRA manager and experts classes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from factories import load_bench
import torch

pytestmark = pytest.mark.vllm


def _matrix() -> Any:
    return load_bench("moe_matrix")


def _in_process_llm(worker: Any) -> Any:
    """What ``LLM.collective_rpc`` reaches with VLLM_ENABLE_V1_MULTIPROCESSING=0: the uni-process executor's
    ``collective_rpc`` on its driver worker (a ``WorkerWrapperBase`` that hands attributes on to the worker)."""
    from vllm.v1.executor.uniproc_executor import UniProcExecutor
    from vllm.v1.worker.worker_base import WorkerWrapperBase

    wrapper = object.__new__(WorkerWrapperBase)
    wrapper.worker = worker
    executor = SimpleNamespace(driver_worker=wrapper)
    return SimpleNamespace(collective_rpc=lambda method: UniProcExecutor.collective_rpc(executor, method))


def _moe_wrapper(kernel: type) -> Any:
    """vLLM's FusedMoEWithLoRA whose modular kernel runs ``kernel`` (the field its ``__init__`` sets on a GPU)."""
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA

    wrapper = FusedMoEWithLoRA.__new__(FusedMoEWithLoRA)
    torch.nn.Module.__init__(wrapper)
    wrapper._moe_kernel = SimpleNamespace(fused_experts=kernel.__new__(kernel))
    return wrapper


def test_the_kernels_of_the_workers_moe_lora_layers_are_recorded(worker_manager: Any) -> None:
    from vllm.model_executor.layers.fused_moe.experts.triton_moe import TritonExperts

    modules = worker_manager._adapter_manager.modules
    modules["model.layers.0.mlp.experts"] = _moe_wrapper(TritonExperts)
    modules["model.layers.1.mlp.experts"] = _moe_wrapper(TritonExperts)
    worker = SimpleNamespace(model_runner=SimpleNamespace(lora_manager=worker_manager))

    found = _matrix().engine_moe_kernels(_in_process_llm(worker))

    assert found == {"moe_kernels": ["TritonExperts"]}  # one name per kernel; the dense layers have none


def test_a_worker_without_a_lora_manager_records_null_with_the_reason() -> None:
    worker = SimpleNamespace(model_runner=SimpleNamespace())  # vLLM's runner sets lora_manager only with LoRA on

    found = _matrix().engine_moe_kernels(_in_process_llm(worker))

    assert found["moe_kernels"] is None
    assert found["moe_kernels_why"].startswith("AttributeError") and "lora_manager" in found["moe_kernels_why"]
