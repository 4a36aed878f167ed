"""vLLM's dual-stream LoRA (``VLLM_LORA_ENABLE_DUAL_STREAM=1``: each LoRA layer's shrink and expand on a second CUDA
stream beside its base GEMM) with the plugin's kernels, in an engine as vLLM serves by default: torch.compile and
CUDA graphs, not eager. A tiny Qwen3-MoE (128 experts) with an adapter on the experts and on q/k/v/o, so that both
of vLLM's dual-stream paths run (fused-MoE and dense). Teacher-forced prompt logprobs and the logprobs of four
sequences decoded together (graph replays) must match HF + PEFT in fp32 as ``test_moe_pairs_engine.py``'s do, and
the base model's must not. The worker must have made the second stream. The switch is set in the test's process
before the engine starts: vLLM's engine process inherits it (its dense LoRA layers read it at import).
``bench_moe_decode.py``'s ``*_ds`` variants time it (r42: README's decode rows).

With the switch on, the plugin runs batches without an adapter on one stream (`integration.dual_stream`): the
control's logprobs (no adapter) must match HF without one. r44 also ran it with the switch set by a trial build's
``register()`` (``bench/results/gpu_tests_h200_r44.json``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tiny import HFReference, build_peft_adapter, build_qwen3_moe, logprob_gap, prompts, vllm_token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

MEAN_TOL = 0.1  # test_moe_e2e.py's: vLLM (bf16) against fp32 PEFT, mean |delta logprob| over every position
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _dual_stream_state(worker: Any = None) -> tuple[str | None, bool, list[bool]]:
    """vLLM's switch in the worker, whether vLLM made its second stream, and for each fused-MoE LoRA layer whether
    its experts' context holds a second stream."""
    import os

    from vllm.lora.layers import utils
    from vllm.lora.layers.fused_moe import FusedMoEWithLoRA

    moe = [m._moe_kernel.fused_experts._lora_context.aux_stream is not None
           for m in worker.model_runner.get_model().modules() if isinstance(m, FusedMoEWithLoRA)]
    return (os.environ.get("VLLM_LORA_ENABLE_DUAL_STREAM"), getattr(utils, "_lora_aux_cuda_stream", None) is not None,
            moe)


def _decoded(llm: Any, ps: list[list[int]], n: int, req: Any) -> tuple[list[list[int]], list[list[float]]]:
    """Four sequences decoded together, greedy: their tokens and each sampled token's logprob."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                        SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0),
                        lora_request=req, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[float(step[t].logprob) for step, t in zip(o.outputs[0].logprobs, tk)] for o, tk in zip(outs, toks)]
    return toks, lps


def test_dual_stream_lora_in_a_compiled_engine_with_graphs_matches_peft(gpu_workdir: Path, record: Any,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    import gc

    monkeypatch.setenv("VLLM_LORA_ENABLE_DUAL_STREAM", "1")

    from vllm import LLM
    from vllm.lora.request import LoRARequest

    model = build_qwen3_moe(gpu_workdir / "moe128-ds", num_experts=128)  # 2 layers
    folder = build_peft_adapter(model, gpu_workdir / "experts-attn", seed=7, rank=16, alpha=128,
                                targets=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=EXPERTS)
    llm = LLM(model=str(model), enable_lora=True, max_lora_rank=16, max_loras=2, max_cpu_loras=2,
              gpu_memory_utilization=0.2, max_model_len=256, dtype="bfloat16", seed=0,
              compilation_config={"cudagraph_capture_sizes": [1, 2, 4, 8, 16, 32]})
    try:
        states = llm.collective_rpc(_dual_stream_state)
        ps = prompts(4, 12)
        ref = HFReference(model, folder)
        req = LoRARequest("experts-attn", 1, str(folder))
        toks, decoded = _decoded(llm, ps, 16, req)
        ref_decoded = [ref.token_logprobs(p, t) for p, t in zip(ps, toks)]
        conts = [ref.greedy(p, 12) for p in ps]
        ref_forced = [ref.token_logprobs(p, c) for p, c in zip(ps, conts)]
        del ref
        base_ref = HFReference(model)
        ref_base = [base_ref.token_logprobs(p, c) for p, c in zip(ps, conts)]
        del base_ref
        forced = [vllm_token_logprobs(llm, p, c, req) for p, c in zip(ps, conts)]
        control = [vllm_token_logprobs(llm, p, c, None) for p, c in zip(ps, conts)]
    finally:
        del llm
        gc.collect()
    results = {"worker_switch_and_stream": states, "decoded_vs_peft": logprob_gap(decoded, ref_decoded),
               "teacher_forced_vs_peft": logprob_gap(forced, ref_forced),
               "control_no_adapter_vs_peft": logprob_gap(control, ref_forced),
               "no_adapter_vs_hf_base": logprob_gap(control, ref_base)}
    record("dual_stream_engine", results)
    # on in the worker, which made vLLM's second stream, and every fused-MoE layer's context holds it
    assert all(tuple(s[:2]) == ("1", True) and s[2] and all(s[2]) for s in states), states
    assert results["decoded_vs_peft"]["mean"] < MEAN_TOL, results
    assert results["teacher_forced_vs_peft"]["mean"] < MEAN_TOL, results
    assert results["control_no_adapter_vs_peft"]["mean"] > 5 * MEAN_TOL, results  # the tolerance sees the LoRA
    assert results["no_adapter_vs_hf_base"]["mean"] < MEAN_TOL, results  # the one-stream path of such a batch
