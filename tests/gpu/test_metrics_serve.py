"""`vllm serve`'s own /metrics shows the plugin's counters, moved by loads, a failed load and mixes.

Adapter loads happen in the engine's worker process and mixes in the API server; both reach the API
server's /metrics through prometheus_client's multi-process files. Every count below is exact for
what this test did (the server is fresh), and vLLM's own ``vllm:`` metrics are still served.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from factories import scrape
from serving import dense_deployment, post_json, vllm_serve
from tiny import build_peft_adapter, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm]


def _metrics(base: str) -> str:
    with urllib.request.urlopen(f"{base}/metrics", timeout=60) as r:
        return str(r.read().decode())


def test_metrics_route_counts_loads_failures_and_mixes(gpu_workdir: Path, record: Any) -> None:
    model, roots, deploy = dense_deployment(gpu_workdir, "metrics", {"a": None, "b": None}, seed=30,
                                            targets=["q_proj", "v_proj"])
    build_peft_adapter(model, roots / "c", seed=32, rank=8, alpha=16, targets=["q_proj", "v_proj"])  # loaded later
    bad = roots / "corrupt"
    bad.mkdir()
    (bad / "adapter_config.json").write_text((roots / "a" / "adapter_config.json").read_text())
    (bad / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{\"x\": 1}        ")
    env = dict(os.environ, VLLM_ALLOW_RUNTIME_LORA_UPDATING="1", VLLM_LORA_EXT_CONFIG=str(deploy),
               VLLM_LORA_EXT_MAX_MIXES="2", VLLM_LORA_EXT_ALLOWED_ROOTS=str(roots))
    args = ["--enable-lora", "--max-lora-rank", "32", "--max-loras", "2", "--max-cpu-loras", "4", "--enforce-eager",
            "--gpu-memory-utilization", "0.3", "--max-model-len", "256", "--dtype", "bfloat16", "--seed", "0"]
    with vllm_serve(model, args, env=env, log_path=gpu_workdir / "metrics-serve.log",
                    keep_log_as="metrics-serve.log") as srv:
        base = srv["base"]
        before = scrape(_metrics(base))
        statuses = {
            "load_c": post_json(base, "load_lora_adapter", {"lora_name": "c", "lora_path": str(roots / "c")})[0],
            "load_missing": post_json(base, "load_lora_adapter", {"lora_name": "m", "lora_path": str(roots / "nope")})[0],
            "load_corrupt": post_json(base, "load_lora_adapter", {"lora_name": "k", "lora_path": str(bad)})[0],
        }
        p = prompts(n=1, seed=3)[0]
        for i, (names, weights) in enumerate(((["a", "b"], [0.5, 0.5]), (["a", "c"], [0.7, 0.3]),
                                              (["b", "c"], [0.2, 0.8]), (["a", "b"], [1.0, float("nan")]))):
            body = {"model": str(model), "prompt": p, "max_tokens": 4, "adapters": names, "adapter_weights": weights}
            # the last one sends the literal NaN (json.dumps writes it), as a hostile client would
            statuses["mix_nan" if i == 3 else f"mix_{i}"] = post_json(base, "completions", body)[0]
        text = _metrics(base)
    after = scrape(text)
    record("metrics_serve", {"statuses": statuses, "before": {str(k): v for k, v in before.items()},
                             "after": {str(k): v for k, v in after.items()}})

    # the corrupt file fails its background build in the worker: 400 with the worker's message
    assert statuses == {"load_c": 200, "load_missing": 404, "load_corrupt": 400, "mix_0": 200, "mix_1": 200,
                        "mix_2": 200, "mix_nan": 400}, statuses
    loads = ("vllm_lora_ext_adapter_loads_total",)

    def count(name: str, **labels: str) -> float:
        return after.get((name, tuple(sorted(labels.items()))), 0.0) - before.get(
            (name, tuple(sorted(labels.items()))), 0.0)

    # start-up: the deployment's two adapters were loaded by the worker before the first scrape
    assert before[(loads[0], (("kind", "adapter"), ("outcome", "ok")))] == 2
    # c, then the mixes' components a, b, c (each read once into the worker's component cache)
    assert count(loads[0], kind="adapter", outcome="ok") == 4
    assert count(loads[0], kind="adapter", outcome="rejected") == 1  # the corrupt file, refused by the worker
    assert count(loads[0], kind="mix", outcome="ok") == 3
    assert count("vllm_lora_ext_adapter_load_seconds_count", kind="mix") == 3
    assert count("vllm_lora_ext_adapter_bytes_read_total") > 0
    assert count("vllm_lora_ext_errors_total", where="worker", type="AdapterFormatError") == 1
    assert count("vllm_lora_ext_errors_total", where="server", type="AdapterNotFoundError") == 1
    assert count("vllm_lora_ext_errors_total", where="server", type="MixError") == 1
    assert count("vllm_lora_ext_mixes_registered_total") == 3
    assert count("vllm_lora_ext_mixes_evicted_total") == 1  # the registry holds 2
    assert after[("vllm_lora_ext_mixes_active", ())] == 2
    assert count("vllm_lora_ext_sources_resolved_total", cache="local") >= 4
    assert "vllm:num_requests_running" in text  # vLLM's own metrics are untouched
