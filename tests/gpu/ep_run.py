"""Subprocess for the EP and Ray-executor tests: one engine, prints JSON results.

    python ep_run.py MODEL TP ADAPTERS_JSON PROMPTS_JSON [BACKEND [EP]]

BACKEND: ``mp`` (vLLM's default for TP > 1), ``ray`` (vLLM's Ray executor) or ``uni`` (one process);
EP: 1 for expert parallelism (default: on when TP > 1). The result carries each worker's ``worker_state``.
"""

from __future__ import annotations

import json
import sys


def main() -> None:
    model, tp, adapters_json, prompts_json = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4]
    backend = sys.argv[5] if len(sys.argv) > 5 else None
    ep = bool(int(sys.argv[6])) if len(sys.argv) > 6 else tp > 1
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    from vllm_lora_ext.integration.plugin import worker_state

    adapters = json.loads(adapters_json)
    prompts = json.loads(prompts_json)
    extra = {"distributed_executor_backend": backend} if backend else {}
    llm = LLM(model=model, tensor_parallel_size=tp, enable_expert_parallel=ep, enable_lora=True, max_lora_rank=16,
              max_loras=2, max_cpu_loras=4, enforce_eager=True, gpu_memory_utilization=0.3, max_model_len=256,
              dtype="bfloat16", seed=0, **extra)
    out: dict = {}
    for i, (name, path) in enumerate(adapters.items()):
        req = LoRARequest(lora_name=name, lora_int_id=i + 1, lora_path=path)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts],
                            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, prompt_logprobs=1),
                            lora_request=req, use_tqdm=False)
        out[name] = {"tokens": [list(o.outputs[0].token_ids) for o in outs],
                     "prompt_logprobs": [[None if d is None else float(d[p[j]].logprob) for j, d in
                                          enumerate(o.prompt_logprobs)] for o, p in zip(outs, prompts)]}
    out["_workers"] = llm.collective_rpc(worker_state)
    print("EPRESULT " + json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
