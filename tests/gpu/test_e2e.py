"""End to end on a GPU: vLLM + plugin against HF transformers + PEFT, offline and through `vllm serve`.

Parity is judged as vLLM's own model tests do: teacher-forced per-position logprobs of the HF
reference continuation (vLLM ``prompt_logprobs``) must agree within ``TOL`` (vLLM runs bf16, the
reference fp32), and the first greedy token must agree. Each comparison has a control that must
*fail* the same tolerance (the adapter not applied), so the tolerance proves something.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

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
    return {"model": model, "adapter": adapter}


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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


def _completion_ids(base: str, model: str, prompt: list[int]) -> list[int]:
    status, body = _post(f"{base}/v1/completions", {"model": model, "prompt": prompt, "max_tokens": N_TOKENS,
                                                    "temperature": 0.0, "ignore_eos": True, "logprobs": 0,
                                                    "return_tokens_as_token_ids": True})
    assert status == 200, body
    return [int(t.split(":")[1]) for t in body["choices"][0]["logprobs"]["tokens"]]


def test_vllm_serve_with_lora_modules_local_and_hf_answers_like_offline(llm_dense: Any, dense: dict[str, Path],
                                                                        hub: Any, gpu_workdir: Path,
                                                                        record: Any) -> None:
    _publish_dense_adapter(hub, dense)
    port = _free_port()
    deploy = gpu_workdir / "deployment.yaml"
    deploy.write_text("adapters:\n  cfg-hub:\n    source: 'hf:acme/tiny-loras:dense/weights.safetensors'\n"
                      "    weight: 1.0\ndefault: cfg-hub\n")
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", HF_HUB_OFFLINE="0", VLLM_LORA_EXT_CONFIG=str(deploy))
    log = (gpu_workdir / "serve.log").open("w")
    cmd = [sys.executable, "-m", "vllm.entrypoints.cli.main", "serve", str(dense["model"]), "--enable-lora",
           "--lora-modules", f"dense-local={dense['adapter']}", "dense-hub=hf:acme/tiny-loras:dense/weights.safetensors",
           "--max-lora-rank", "16", "--max-loras", "4", "--enforce-eager", "--gpu-memory-utilization", "0.2",
           "--max-model-len", "256", "--dtype", "bfloat16", "--port", str(port), "--seed", "0"]
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 400
        while time.time() < deadline:
            if proc.poll() is not None:
                raise AssertionError("vllm serve exited:\n" + (gpu_workdir / "serve.log").read_text()[-4000:])
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(2)
        else:
            raise AssertionError("vllm serve did not become healthy")
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
    finally:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
        out = os.environ.get("VLLM_LORA_EXT_SERVE_LOG")
        if out:
            Path(out).write_text((gpu_workdir / "serve.log").read_text()[-200000:])
