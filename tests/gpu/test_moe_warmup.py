"""The LoRA kernels compile while the engine starts (issue 39 item 3): on a tiny Qwen3-MoE, the first requests with
MoE adapters after start-up add no compiled Triton kernel variant in the worker (fused-MoE LoRA kernels, and the
dense shrink/expand that attention and the LoRA logits path launch); with the warm-up
switched off (the control) the same requests do compile some, so the count does see an in-step compile."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch

from tiny import build_peft_adapter, build_qwen3_moe, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

N_TOKENS = 8
RANDOM_BATCHES = 16


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("moe-warmup")
    model = build_qwen3_moe(root / "qwen3-moe")
    out = {"model": model}
    for name, seed in (("a", 11), ("b", 12)):  # experts and attention, as the decode bench's adapters
        out[name] = build_peft_adapter(model, root / name, seed=seed, rank=8, alpha=16, targets=["q_proj", "v_proj"],
                                       target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    return out


def _llm(model: Path) -> Any:
    from vllm import LLM

    return LLM(model=str(model), enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=4, enforce_eager=True,
               gpu_memory_utilization=0.2, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=256,
               dtype="bfloat16", seed=0)


def _variants(llm: Any) -> list[dict[str, int]]:
    from vllm_lora_ext.integration.warmup import lora_kernel_variants

    # fused-MoE and dense shrink/expand: the LoRA logits path launches the dense ones in every adapter step
    return llm.collective_rpc(lora_kernel_variants)  # type: ignore[no-any-return]


def _first_adapter_requests(llm: Any, moe: dict[str, Path]) -> None:
    """One adapter on four prompts (a 48-token prefill, then 4-token decode steps), then two adapters at once, then
    seeded batches of 1-16 prompts of 2-151 tokens over a, b and no adapter: batch token counts the fixed sweep
    misses for this model's 8 experts and top-2 (r43: 36, 60, 84, 140 and 148 compiled in the step)."""
    import random

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    a, b = LoRARequest("a", 1, str(moe["a"])), LoRARequest("b", 2, str(moe["b"]))
    params = SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True)
    ps = [TokensPrompt(prompt_token_ids=p) for p in prompts()]
    llm.generate(ps, params, lora_request=a, use_tqdm=False)
    llm.generate(ps, params, lora_request=[a, b, a, b], use_tqdm=False)
    g = random.Random(2)
    for _ in range(RANDOM_BATCHES):
        n = g.randint(1, 16)
        batch = [TokensPrompt(prompt_token_ids=[1] + [g.randrange(3, 400) for _ in range(g.randint(1, 150))])
                 for _ in range(n)]
        llm.generate(batch, SamplingParams(max_tokens=g.randint(1, 12), temperature=0.0, ignore_eos=True),
                     lora_request=[g.choice((a, b, None)) for _ in range(n)], use_tqdm=False)


def _variants_around_first_requests(moe: dict[str, Path], record: Any,
                                    name: str) -> tuple[list[dict[str, int]], list[dict[str, int]]]:
    """Start an engine, count its kernel variants after start-up and after the first adapter requests, record both
    under ``name``, and free the engine."""
    llm = _llm(moe["model"])
    before = _variants(llm)
    _first_adapter_requests(llm, moe)
    after = _variants(llm)
    record(name, {"variants_after_start": before, "variants_after_first_requests": after})
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return before, after


def test_first_moe_adapter_requests_compile_no_kernel_after_start(moe: dict[str, Path], record: Any) -> None:
    before, after = _variants_around_first_requests(moe, record, "moe_warmup_on")
    assert sum(before[0].values()) > 0, before  # the warm-up compiled the kernels before the engine was ready
    assert after == before, (before, after)


def test_without_the_warm_up_the_first_moe_adapter_request_compiles_in_the_step(
        moe: dict[str, Path], monkeypatch: pytest.MonkeyPatch, record: Any) -> None:
    monkeypatch.setenv("VLLM_LORA_EXT_MOE_WARMUP", "0")  # before the engine starts: its processes read it
    before, after = _variants_around_first_requests(moe, record, "moe_warmup_off_control")
    assert sum(after[0].values()) > sum(before[0].values()), (before, after)
