"""The planned slot writes on the GPU (``integration.activation``): ``tests/integration/test_activation_ahead.py``'s
comparison with vLLM's own ``activate_adapter``, bit for bit, with every slot and factor tensor on CUDA, so the
batched ``torch._foreach_zero_`` / ``torch._foreach_copy_`` calls run CUDA's kernels."""

from __future__ import annotations

import os
import sys
from typing import Any

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "integration"))
import test_activation_ahead as cpu  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@pytest.fixture(autouse=True)
def on_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cpu, "DEVICE", "cuda")


patched = cpu.patched


@pytest.mark.parametrize(("active", "taken"), [([7, None, 9, None], False), ([7, None, 9, None], True),
                                               ([None, 8, None, 5], True)])
def test_planned_activation_on_cuda_writes_every_slot_as_vllms_own(patched: None, active: list[int | None],
                                                                   taken: bool, monkeypatch: pytest.MonkeyPatch,
                                                                   record: Any) -> None:
    cpu.test_planned_activation_writes_every_slot_as_vllms_own(patched, list(active), taken, monkeypatch)
    torch.cuda.synchronize()
    record(f"activation_ahead_{active.index(None)}_{taken}", {"equal_to_vllm": True})
