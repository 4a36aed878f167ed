"""End to end on a GPU: vLLM + plugin against HF transformers + PEFT, offline and through `vllm serve`.

Parity is judged as vLLM's own model tests do: teacher-forced per-position logprobs of the HF
reference continuation (vLLM ``prompt_logprobs``) must agree within ``TOL`` (vLLM runs bf16, the
reference fp32), and the first greedy token must agree. Each comparison has a control that must
*fail* the same tolerance (the adapter not applied), so the tolerance proves something.
"""

from __future__ import annotations

import json
import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from serving import vllm_serve
from tiny import HFReference, build_dense, build_peft_adapter, build_qwen3_moe, prompts, vllm_greedy, vllm_token_logprobs

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]

N_TOKENS = 8
TOL = 0.2  # max |logprob difference| per position, bf16 vLLM vs fp32 HF (measured 0.05-0.10 on H200)
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
DENSE_TARGETS = ATTN + ["gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="session")
def dense(gpu_workdir: Path) -> dict[str, Path]:
    model = build_dense(gpu_workdir / "dense")
    adapter = build_peft_adapter(model, gpu_workdir / "dense-lora", seed=1, rank=8, alpha=16, targets=DENSE_TARGETS)
    second = build_peft_adapter(model, gpu_workdir / "dense-lora-2", seed=3, rank=4, alpha=8,
                                targets=["q_proj", "v_proj", "down_proj"])
    return {"model": model, "adapter": adapter, "adapter2": second}


@pytest.fixture(scope="session")
def moe(gpu_workdir: Path) -> dict[str, Path]:
    model = build_qwen3_moe(gpu_workdir / "moe")
    adapter = build_peft_adapter(model, gpu_workdir / "moe-attn-lora", seed=2, rank=8, alpha=16, targets=ATTN)
    return {"model": model, "adapter": adapter}


def _llm(model: Path, **kw: Any) -> Any:
    from vllm import LLM

    return LLM(model=str(model), enable_lora=True, max_lora_rank=16, max_loras=4, max_cpu_loras=8, enforce_eager=True,
               gpu_memory_utilization=0.2, max_model_len=256, dtype="bfloat16", seed=0, **kw)


@pytest.fixture(scope="session")
def llm_dense(dense: dict[str, Path]) -> Any:
    return _llm(dense["model"])


@pytest.fixture(scope="session")
def llm_moe(moe: dict[str, Path]) -> Any:
    return _llm(moe["model"])


def _req(name: str, lora_id: int, path: str) -> Any:
    from vllm.lora.request import LoRARequest

    return LoRARequest(lora_name=name, lora_int_id=lora_id, lora_path=path)


def _worst_diff(llm: Any, ref: HFReference, lora_request: Any) -> tuple[float, bool]:
    worst, first_ok = 0.0, True
    for p in prompts():
        cont = ref.greedy(p, N_TOKENS)
        a = ref.token_logprobs(p, cont)
        b = vllm_token_logprobs(llm, p, cont, lora_request)
        worst = max(worst, max(abs(x - y) for x, y in zip(a, b)))
        first_ok &= vllm_greedy(llm, [p], 1, lora_request)[0][0] == cont[0]
    return worst, first_ok


def test_plugin_is_active_inside_the_engine_worker(llm_dense: Any, record: Any) -> None:
    from vllm_lora_ext.integration.plugin import worker_state

    states = llm_dense.collective_rpc(worker_state)
    record("worker_plugin_state", states)
    assert states and all(s["registered"] and s["load_adapter_patched"] and s["pid"] != os.getpid() for s in states)


def test_dense_adapter_matches_hf_peft(llm_dense: Any, dense: dict[str, Path], record: Any) -> None:
    ref = HFReference(dense["model"], dense["adapter"])
    worst, first_ok = _worst_diff(llm_dense, ref, _req("dense", 1, str(dense["adapter"])))
    control, _ = _worst_diff(llm_dense, ref, None)  # the adapter not applied must fail the tolerance
    record("dense_adapter", {"max_abs_logprob_diff": worst, "first_token_equal": first_ok, "control_no_adapter": control})
    assert worst < TOL and first_ok
    assert control > 10 * TOL


def test_dense_base_model_matches_hf(llm_dense: Any, dense: dict[str, Path], record: Any) -> None:
    worst, first_ok = _worst_diff(llm_dense, HFReference(dense["model"]), None)
    record("dense_base", {"max_abs_logprob_diff": worst, "first_token_equal": first_ok})
    assert worst < TOL and first_ok


def test_moe_model_with_attention_adapter_matches_hf_peft(llm_moe: Any, moe: dict[str, Path], record: Any) -> None:
    ref = HFReference(moe["model"], moe["adapter"])
    worst, first_ok = _worst_diff(llm_moe, ref, _req("moe-attn", 1, str(moe["adapter"])))
    control, _ = _worst_diff(llm_moe, ref, None)
    base, base_first = _worst_diff(llm_moe, HFReference(moe["model"]), None)
    record("moe_attention_adapter", {"max_abs_logprob_diff": worst, "first_token_equal": first_ok,
                                     "control_no_adapter": control, "base_diff": base, "base_first_equal": base_first})
    # MoE routing ties (bf16 vs fp32) can move single positions for the base model too: the adapter
    # path may not add error beyond the base model's own gap.
    assert worst < max(TOL, base + 0.05) and first_ok
    assert control > 10 * TOL


def _publish_dense_adapter(hub: Any, dense: dict[str, Path]) -> str:
    repo = hub.repo("acme/tiny-loras")
    return repo.commit({
        "dense/weights.safetensors": (dense["adapter"] / "adapter_model.safetensors").read_bytes(),
        "dense/weights_config.json": (dense["adapter"] / "adapter_config.json").read_bytes(),
        "README.md": b"several adapters",
    })


def test_hf_source_in_lora_request_generates_like_the_local_path(llm_dense: Any, dense: dict[str, Path], hub: Any,
                                                                record: Any) -> None:
    _publish_dense_adapter(hub, dense)
    ps = prompts()
    local = vllm_greedy(llm_dense, ps, N_TOKENS, _req("dense-local", 3, str(dense["adapter"])))
    req = _req("dense-hub", 4, "hf:acme/tiny-loras:dense/weights.safetensors")
    remote = vllm_greedy(llm_dense, ps, N_TOKENS, req)
    record("hf_source_offline", {"same_tokens": local == remote, "pinned_path": req.lora_path})
    assert local == remote
    assert req.lora_path.startswith("hf:acme/tiny-loras@") and req.lora_path.endswith(":dense/weights.safetensors")


def test_bad_source_raises_at_the_call_and_the_engine_keeps_serving(llm_dense: Any, dense: dict[str, Path],
                                                                  hub: Any, record: Any) -> None:
    from vllm_lora_ext.errors import AdapterNotFoundError, AdapterSourceError

    with pytest.raises(AdapterNotFoundError):
        vllm_greedy(llm_dense, prompts()[:1], 2, _req("nope", 5, "hf:acme/does-not-exist"))
    with pytest.raises(AdapterSourceError):
        vllm_greedy(llm_dense, prompts()[:1], 2, _req("evil", 6, "hf:acme/x:../../etc/passwd"))
    out = vllm_greedy(llm_dense, prompts()[:1], 2, _req("dense", 1, str(dense["adapter"])))
    record("bad_source_engine_alive", True)
    assert len(out[0]) == 2


def test_offline_mix_matches_peft_cat_combination(llm_dense: Any, dense: dict[str, Path], record: Any) -> None:
    from vllm_lora_ext.integration.offline import lora_request

    req = lora_request({str(dense["adapter"]): 0.7, str(dense["adapter2"]): 0.3}, llm=llm_dense)
    ref = HFReference(dense["model"], mix={dense["adapter"]: 0.7, dense["adapter2"]: 0.3})
    worst, first_ok = _worst_diff(llm_dense, ref, req)
    control, _ = _worst_diff(llm_dense, ref, _req("dense", 1, str(dense["adapter"])))  # one adapter is not the mix
    record("offline_mix", {"max_abs_logprob_diff": worst, "first_token_equal": first_ok,
                           "control_single_adapter": control, "lora_name": req.lora_name})
    assert worst < TOL and first_ok
    assert control > 3 * TOL


def test_one_batch_of_base_single_and_several_mixes_equals_each_alone(llm_dense: Any, dense: dict[str, Path],
                                                                       record: Any) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_lora_ext.integration.offline import lora_request

    a, b = str(dense["adapter"]), str(dense["adapter2"])
    reqs = [None, _req("dense", 1, a), lora_request({a: 0.7, b: 0.3}, llm=llm_dense),
            lora_request({a: 0.2, b: 0.8}, llm=llm_dense), lora_request({a: -0.5, b: 1.0}, llm=llm_dense)]
    ps = prompts(n=len(reqs), seed=7)
    alone = [vllm_greedy(llm_dense, [p], N_TOKENS, r)[0] for p, r in zip(ps, reqs)]
    outs = llm_dense.generate([TokensPrompt(prompt_token_ids=p) for p in ps],
                              SamplingParams(max_tokens=N_TOKENS, temperature=0.0, ignore_eos=True),
                              lora_request=reqs, use_tqdm=False)
    batched = [list(o.outputs[0].token_ids) for o in outs]
    record("mixed_batch", {"equal_to_alone": batched == alone, "distinct_outputs": len({tuple(x) for x in batched})})
    assert batched == alone
    assert len({tuple(x) for x in batched}) == len(reqs)  # every request really got its own adapter set


def test_bad_mix_raises_at_the_call(llm_dense: Any, dense: dict[str, Path]) -> None:
    from vllm_lora_ext.errors import MixError
    from vllm_lora_ext.integration.offline import lora_request

    with pytest.raises(MixError):
        lora_request({str(dense["adapter"]): float("nan")}, llm=llm_dense)
    with pytest.raises(Exception, match="max_lora_rank"):  # 8 + 4 + 8 > 16, refused by the worker, engine alive
        lora_request({str(dense["adapter"]): 0.5, str(dense["adapter2"]): 0.5, str(dense["adapter"]) + "/": 0.5},
                     llm=llm_dense)
    assert len(vllm_greedy(llm_dense, prompts()[:1], 2, None)[0]) == 2


def _post(url: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            raw = r.read() or b"{}"
            try:
                return r.status, json.loads(raw)
            except json.JSONDecodeError:  # /v1/load_lora_adapter answers plain text
                return r.status, {"raw": raw.decode(errors="replace")}
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except json.JSONDecodeError:
            return e.code, {"raw": raw.decode(errors="replace")}


def _completion_ids(base: str, model: str, prompt: list[int], **extra: Any) -> list[int]:
    status, body = _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": N_TOKENS,
                                                    "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                                                    "return_tokens_as_token_ids": True, **extra})
    assert status == 200, body
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_vllm_serve_with_lora_modules_local_and_hf_answers_like_offline(llm_dense: Any, dense: dict[str, Path],
                                                                        hub: Any, gpu_workdir: Path,
                                                                        record: Any) -> None:
    _publish_dense_adapter(hub, dense)
    deploy = gpu_workdir / "deployment.yaml"
    deploy.write_text("adapters:\n  cfg-hub:\n    source: 'hf:acme/tiny-loras:dense/weights.safetensors'\n"
                      f"    weight: 0.7\n  cfg-b:\n    source: '{dense['adapter2']}'\n    weight: 0.3\n"
                      "default: cfg-hub\n")
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", HF_HUB_OFFLINE="0", VLLM_LORA_EXT_CONFIG=str(deploy))
    args = ["--enable-lora", "--lora-modules", f"dense-local={dense['adapter']}",
            "dense-hub=hf:acme/tiny-loras:dense/weights.safetensors", "--max-lora-rank", "16", "--max-loras", "4",
            "--enforce-eager", "--gpu-memory-utilization", "0.2", "--max-model-len", "256", "--dtype", "bfloat16",
            "--seed", "0"]
    with vllm_serve(dense["model"], args, env=env, log_path=gpu_workdir / "serve.log") as srv:
        base = srv["base"]
        ps = prompts()
        offline = vllm_greedy(llm_dense, ps, N_TOKENS, _req("dense", 1, str(dense["adapter"])))
        local = [_completion_ids(base, "dense-local", p) for p in ps]
        remote = [_completion_ids(base, "dense-hub", p) for p in ps]
        from_config = [_completion_ids(base, "cfg-hub", p) for p in ps]
        # runtime loading with an hf: path, then a bad one (4xx with our message; server stays up)
        status, body = _post(f"{base}/v1/load_lora_adapter",
                             {"lora_name": "dense-rt", "lora_path": "hf:acme/tiny-loras:dense/weights.safetensors"})
        runtime = [_completion_ids(base, "dense-rt", p) for p in ps[:1]]
        bad_status, bad_body = _post(f"{base}/v1/load_lora_adapter",
                                     {"lora_name": "bad", "lora_path": "hf:acme/tiny-loras:missing.safetensors"})
        trav_status, trav_body = _post(f"{base}/v1/load_lora_adapter",
                                       {"lora_name": "trav", "lora_path": "hf:acme/tiny-loras:../x.safetensors"})
        after = _completion_ids(base, "dense-local", ps[0])
        # weighted mixes: body fields, the model syntax, and the deployment default
        from vllm_lora_ext.integration.offline import lora_request

        mix_req = lora_request({"cfg-hub": 0.7, "cfg-b": 0.3}, deployment=str(deploy), llm=llm_dense)
        offline_mix = vllm_greedy(llm_dense, ps, N_TOKENS, mix_req)
        body_mix = [_completion_ids(base, str(dense["model"]), p, adapters=["cfg-hub", "cfg-b"],
                                    adapter_weights=[0.7, 0.3]) for p in ps]
        syntax_mix = [_completion_ids(base, "cfg-hub=0.7+cfg-b=0.3", p) for p in ps]
        default_mix = [_completion_ids(base, "cfg-hub+cfg-b", p) for p in ps]  # configured default weights
        default_adapter = vllm_greedy(llm_dense, ps, N_TOKENS,
                                      lora_request(["cfg-hub"], weights=[0.7], deployment=str(deploy), llm=llm_dense))
        base_named = [_completion_ids(base, str(dense["model"]), p) for p in ps]  # -> deployment default cfg-hub @0.7
        bad_mix_status, bad_mix = _post(f"{base}/v1/completions", {"model": "x", "prompt": ps[0], "max_tokens": 2,
                                                                   "adapters": ["cfg-hub", "nope"]})
        record("serve_mix", {"body_equals_offline": body_mix == offline_mix,
                             "model_syntax_equals_offline": syntax_mix == offline_mix,
                             "default_weights_equal_offline": default_mix == offline_mix,
                             "base_request_gets_default_adapter": base_named == default_adapter,
                             "unknown_adapter_status": bad_mix_status, "unknown_adapter_message": str(bad_mix)[:300]})
        assert body_mix == offline_mix and syntax_mix == offline_mix and default_mix == offline_mix
        assert base_named == default_adapter
        assert bad_mix_status == 400 and "nope" in str(bad_mix)
        record("serve", {"local_equals_offline": local == offline, "hub_equals_offline": remote == offline,
                         "deployment_config_equals_offline": from_config == offline,
                         "runtime_load_status": status, "runtime_equals_offline": runtime == offline[:1],
                         "missing_status": bad_status, "missing_message": str(bad_body)[:400],
                         "traversal_status": trav_status, "traversal_message": str(trav_body)[:400],
                         "alive_after_errors": after == offline[0]})
        assert local == offline and remote == offline and from_config == offline
        assert status == 200 and runtime == offline[:1]
        assert bad_status == 404 and "missing.safetensors" in str(bad_body)
        assert trav_status == 400 and "'..' in path" in str(trav_body)
        assert after == offline[0]

