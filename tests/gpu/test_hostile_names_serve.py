"""`vllm serve` refuses an adapter loaded under a mix's spelling, and the real mix still serves (issue 35, item 2).

One small server: a tiny dense model, two adapters from a deployment config (``style`` 0.7, ``domain`` 0.3),
runtime loading on. A client tries to take the mix ``style=0.7+domain=0.3`` over by loading ``style`` under that
name (and under ``style+domain`` and the mix's own ``mix-`` name) through ``/v1/load_lora_adapter``. Each load gets
a 400 naming the fix, ``/v1/models`` never lists the squatter, and the mix, asked for before and after through the real
``openai`` client, is served under its own name with the same tokens. A load under a plain name still works.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from serving import dense_deployment, post_json, vllm_serve
from tiny import prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

MIX = "style=0.7+domain=0.3"


def test_a_mix_squatted_through_the_load_route_is_refused_and_the_real_mix_still_serves(gpu_workdir: Path,
                                                                                        record: Any) -> None:
    import openai

    model, roots, deploy = dense_deployment(gpu_workdir, "names", {"style": 0.7, "domain": 0.3},
                                            seed=40, targets=["q_proj", "v_proj"])
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_LORA_EXT_CONFIG=str(deploy),
               VLLM_LORA_EXT_ALLOWED_ROOTS=str(roots))
    args = ["--enable-lora", "--max-lora-rank", "16", "--max-loras", "2", "--max-cpu-loras", "4", "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--max-model-len", "256", "--dtype", "bfloat16", "--seed", "0"]
    with vllm_serve(model, args, env=env, log_path=gpu_workdir / "names-serve.log",
                    keep_log_as="names-serve.log") as srv:
        base = srv["base"]
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=300)
        p = prompts(n=1, seed=13)[0]

        def complete(name: str) -> tuple[str, list[str]]:
            r = client.completions.create(model=name, prompt=p, max_tokens=8, temperature=0.0, logprobs=1,
                                          extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
            return r.model, list(r.choices[0].logprobs.tokens)

        mix_name, before = complete(MIX)
        style_name, style_tokens = complete("style")
        squats = {name: post_json(base, "load_lora_adapter", {"lora_name": name, "lora_path": str(roots / "style")})
                  for name in (MIX, "style+domain", mix_name)}
        listed = {m.id: m.root for m in client.models.list().data}
        after_name, after = complete(MIX)
        default_name, default_tokens = complete("style+domain")  # the config's default weights: the same mix
        plain = post_json(base, "load_lora_adapter", {"lora_name": "style-copy", "lora_path": str(roots / "style")})
        _, copy_tokens = complete("style-copy")
    record("hostile_names_squat", {"mix_name": mix_name, "squat_status": {k: v[0] for k, v in squats.items()},
                                   "squat_messages": {k: v[1][:300] for k, v in squats.items()},
                                   "mix_tokens_before": before, "mix_tokens_after": after,
                                   "mix_differs_from_style": before != style_tokens, "plain_load": plain[0]})
    assert mix_name.startswith("mix-style=0.7+domain=0.3-") and style_name == "style"
    for name, (status, body) in squats.items():
        assert status == 400, (name, status, body)
        assert "Choose a name" in body and ("contains '+'" in body or "starts with 'mix-'" in body), body
    assert MIX not in listed and "style+domain" not in listed and {"style", "domain"} <= set(listed)
    assert listed[mix_name].startswith("mix:")  # the mix's own name lists the mix, not the squatter's folder
    assert (after_name, after) == (mix_name, before)  # the real mix, under its own name, the same tokens
    assert (default_name, default_tokens) == (mix_name, before)
    assert plain[0] == 200 and copy_tokens == style_tokens  # a plain name still loads and serves
