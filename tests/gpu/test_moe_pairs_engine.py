"""The plugin's fused-MoE pair kernels inside a real engine, against HF + PEFT (issue 39 item 1).

`tests/gpu/test_moe_pairs.py` checks the kernels through vLLM's punica wrapper; no other test reaches them from
an engine: `test_moe_e2e.py`'s batches are too large for them, and `bench_moe_decode.py`'s dummy weights leave an
adapter's effect on a logprob at about 5e-7. Here a tiny Qwen3-MoE has 128 experts, so one 24-token sequence is a
batch that vLLM assigns pair by pair (24 tokens x top-2 x 8 <= 128 experts x 4 slots) and that the pair path
takes (48 pairs x rank-32 slots > the 1024 vLLM's small-batch kernel keeps). The adapters touch the experts only,
so every logprob they move is the fused-MoE LoRA's: a rank-16 adapter in rank-32 slots (the live-rank table: its
rows past 16 are not read) and a rank-32 one. Teacher-forced logprobs must match PEFT in fp32 as closely as
vLLM's own kernel does (``VLLM_LORA_EXT_KERNEL_CONFIGS=0`` in the worker, the same engine), and the base model's
must not. The pair path's calls are counted in the worker (``collective_rpc``: an engine core in the test's own
process would leave vLLM's settings cached for the tests after it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiny import HFReference, build_peft_adapter, build_qwen3_moe, logprob_gap, prompts, vllm_token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

PROMPT, CONTINUATION = 12, 12  # 24 tokens: a batch of pairs assigned one by one, which the pair path takes
MEAN_TOL = 0.1  # test_moe_e2e.py's: vLLM (bf16) against fp32 PEFT, mean |delta logprob| over every position
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _worker_functions() -> tuple[Any, Any, Any]:
    """Three functions for ``collective_rpc``, made here so that cloudpickle sends them by value (the worker cannot
    import this test module): count the calls of `moe_pairs.moe_lora_pairs` from now on; the calls counted since
    the last read (the count back to 0); ``VLLM_LORA_EXT_KERNEL_CONFIGS`` set to a value (None: unset), which the
    plugin reads on every call."""

    def count_from_now(worker: Any = None) -> int:
        from vllm_lora_ext.integration import moe_pairs

        real = moe_pairs.moe_lora_pairs
        if not hasattr(real, "calls"):
            def counted(*args: Any, **kwargs: Any) -> None:
                counted.calls += 1  # type: ignore[attr-defined]
                real(*args, **kwargs)

            counted.calls = 0  # type: ignore[attr-defined]
            moe_pairs.moe_lora_pairs = counted  # kernels.py imports it from the module at each call
        return 0

    def calls_since(worker: Any = None) -> int:
        from vllm_lora_ext.integration import moe_pairs

        counted: Any = moe_pairs.moe_lora_pairs
        calls, counted.calls = counted.calls, 0
        return int(calls)

    def kernel_configs(worker: Any = None, value: str | None = None) -> int:
        import os

        if value is None:
            os.environ.pop("VLLM_LORA_EXT_KERNEL_CONFIGS", None)
        else:
            os.environ["VLLM_LORA_EXT_KERNEL_CONFIGS"] = value
        return 0

    return count_from_now, calls_since, kernel_configs


def test_pair_kernels_in_an_engine_match_peft(gpu_workdir: Path, record: Any) -> None:
    import gc

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    model = build_qwen3_moe(gpu_workdir / "moe128", num_experts=128)  # 2 layers
    # alpha 16 x r: an effect of about 1.5 on the mean logprob (measured with PEFT in fp32), far above the tolerance
    adapters = {r: build_peft_adapter(model, gpu_workdir / f"experts-r{r}", seed=10 + r, rank=r, alpha=16 * r,
                                      targets=None, target_parameters=EXPERTS) for r in (16, 32)}
    llm = LLM(model=str(model), enable_lora=True, max_lora_rank=32, max_loras=4, max_cpu_loras=4, enforce_eager=True,
              gpu_memory_utilization=0.2, max_model_len=256, dtype="bfloat16", seed=0)
    count_from_now, calls_since, kernel_configs = _worker_functions()
    try:
        llm.collective_rpc(count_from_now)
        ps = prompts(4, PROMPT)
        results: dict[str, Any] = {}
        for rank, folder in adapters.items():
            ref = HFReference(model, folder)
            conts = [ref.greedy(p, CONTINUATION) for p in ps]
            ref_lp = [ref.token_logprobs(p, c) for p, c in zip(ps, conts)]
            del ref
            req = LoRARequest(f"experts-r{rank}", rank, str(folder))
            llm.collective_rpc(calls_since)
            pairs = [vllm_token_logprobs(llm, p, c, req) for p, c in zip(ps, conts)]
            taken = sum(llm.collective_rpc(calls_since))
            llm.collective_rpc(kernel_configs, args=("0",))  # vLLM's kernel, in the same engine and slots
            try:
                stock = [vllm_token_logprobs(llm, p, c, req) for p, c in zip(ps, conts)]
                untaken = sum(llm.collective_rpc(calls_since))
            finally:
                llm.collective_rpc(kernel_configs, args=(None,))
            control = [vllm_token_logprobs(llm, p, c, None) for p, c in zip(ps, conts)]
            results[f"r{rank}"] = {"pair_calls": taken, "pair_calls_vllm_kernel": untaken,
                                   "pair_kernels_vs_peft": logprob_gap(pairs, ref_lp),
                                   "vllm_kernel_vs_peft": logprob_gap(stock, ref_lp),
                                   "pair_vs_vllm_kernel": logprob_gap(pairs, stock),
                                   "control_no_adapter_vs_peft": logprob_gap(control, ref_lp)}
    finally:
        del llm
        gc.collect()
    record("moe_pairs_engine", results)
    for rank, res in results.items():
        # one step a sequence (its prefill; max_tokens 1), each of the 2 layers calling w13 and w2 once
        assert res["pair_calls"] == len(ps) * 2 * 2, (rank, res)
        assert res["pair_calls_vllm_kernel"] == 0, (rank, res)  # with KERNEL_CONFIGS=0, none
        assert res["pair_kernels_vs_peft"]["mean"] < MEAN_TOL, (rank, res)
        # the same sums as vLLM's kernel, in another order: within bf16 noise of it, and as close to PEFT
        assert res["pair_vs_vllm_kernel"]["mean"] < MEAN_TOL / 2, (rank, res)
        assert res["pair_kernels_vs_peft"]["mean"] <= res["vllm_kernel_vs_peft"]["mean"] + 0.02, (rank, res)
        assert res["control_no_adapter_vs_peft"]["mean"] > 5 * MEAN_TOL, (rank, res)  # the tolerance sees the LoRA
