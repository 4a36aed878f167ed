"""The plugin under Ray, on 2 GPUs (issue: beyond one machine).

1. vLLM's Ray executor (``distributed_executor_backend="ray"``), TP=2 and TP=2 with expert parallelism, on a
   tiny Qwen3-MoE with a 2D and a 3D expert adapter carrying the same delta (plus a control adapter):
   - the logprobs equal vLLM's multiprocessing executor at the same TP/EP exactly, and the one-process (TP=1)
     run within the EP test's tolerance, while the control adapter is far outside it;
   - ``worker_state`` from every Ray worker: the plugin registered and patched there, and under EP each rank
     read fewer adapter bytes than the one-process run (its own experts only).
2. Ray Serve LLM: an app with 2 replicas (1 GPU each, ``LoraExtLLMServer``) behind Ray's OpenAI router, a
   deployment config of 6 adapters (2 of them ``hf:`` sources on the local Hub) passed through
   ``runtime_env``; 200 concurrent requests over 10 adapters and mixes (names, mixes in ``model``, mixes in
   the body fields) through the real ``openai`` client, each output equal to the same request on a single
   ``vllm serve`` engine (a difference allowed only where the reference's top-2 logprobs tie exactly);
   ``worker_state`` from the workers of both replicas.

Ray is not on the GPU machine: ``scripts/gpu/run.sh`` installs the carried wheels (see scripts/gpu/README.md).
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from serving import free_port, vllm_serve
from test_ep_e2e import _gpus
from tiny import build_adapters, build_dense, build_peft_adapter, build_qwen3_moe, prompts

pytestmark = [pytest.mark.gpu, pytest.mark.vllm,
              pytest.mark.skipif(importlib.util.find_spec("ray") is None,
                                 reason="Ray is not installed (scripts/gpu/run.sh installs the carried wheels)"),
              pytest.mark.skipif(_gpus() < 2, reason="needs 2 GPUs")]

MEAN_TOL = 0.1  # as the EP test: MoE routing ties (bf16 vs the one-GPU run) move single positions
N_TOKENS = 8


def _engine(model: Path, tp: int, adapters: dict[str, str], ps: list[list[int]], log: Path, backend: str,
            ep: bool) -> dict[str, Any]:
    env = dict(os.environ, VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_ALLOW_INSECURE_SERIALIZATION="1",
               RAY_USAGE_STATS_ENABLED="0", RAY_DEDUP_LOGS="0")
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, str(Path(__file__).with_name("ep_run.py")), str(model), str(tp),
                          json.dumps(adapters), json.dumps(ps), backend, str(int(ep))],
                         capture_output=True, text=True, env=env, timeout=900)
    log.write_text(out.stdout[-200000:] + "\n---\n" + out.stderr[-400000:])
    line = [ln for ln in out.stdout.splitlines() if ln.startswith("EPRESULT ")]
    outd = os.environ.get("OUT")
    if outd and not line:  # a failed run's log comes back (the device returns at most 8 files)
        (Path(outd) / log.name).write_text(log.read_text()[-2_000_000:])
    assert line, out.stderr[-5000:]
    result = json.loads(line[-1][len("EPRESULT "):])
    result["_seconds"] = time.perf_counter() - t0
    return result


def _gaps(a: dict[str, Any], b: dict[str, Any], name_a: str, name_b: str | None = None) -> list[float]:
    gaps = []
    for x, y in zip(a[name_a]["prompt_logprobs"], b[name_b or name_a]["prompt_logprobs"]):
        gaps += [abs(p - q) for p, q in zip(x[1:], y[1:])]
    return gaps


def test_ray_executor_tp2_and_ep_give_the_single_process_logprobs(gpu_workdir: Path, record: Any) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from test_moe_e2e import _truths_from_peft, _write_forms

    model = build_qwen3_moe(gpu_workdir / "ray-moe")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    peft_dir = build_peft_adapter(model, gpu_workdir / "ray-3d", seed=9, rank=8, alpha=16, targets=["q_proj"],
                                  target_parameters=experts)
    control = build_peft_adapter(model, gpu_workdir / "ray-ctl", seed=10, rank=8, alpha=16, targets=["q_proj"],
                                 target_parameters=experts)
    truths, rest = _truths_from_peft(peft_dir, 2, 8, "mlp")
    forms = _write_forms(peft_dir, gpu_workdir / "ray-forms", truths, rest, "mlp", ("gate_proj", "up_proj", "down_proj"))
    adapters = {"r2d": str(forms["2d"]), "r3d": str(forms["3d"]), "ctl": str(control)}
    ps = prompts()
    runs = {
        "tp1": _engine(model, 1, adapters, ps, gpu_workdir / "ray-tp1.log", "uni", False),
        "mp_ep2": _engine(model, 2, adapters, ps, gpu_workdir / "ray-mp-ep2.log", "mp", True),
        "ray_tp2": _engine(model, 2, adapters, ps, gpu_workdir / "ray-tp2.log", "ray", False),
        "ray_ep2": _engine(model, 2, adapters, ps, gpu_workdir / "ray-ep2.log", "ray", True),
    }
    ref = runs["tp1"]
    summary: dict[str, Any] = {}
    for key in ("mp_ep2", "ray_tp2", "ray_ep2"):
        run = runs[key]
        gaps = _gaps(ref, run, "r2d") + _gaps(ref, run, "r3d")
        summary[key] = {
            "mean_gap_vs_tp1": sum(gaps) / len(gaps), "max_gap_vs_tp1": max(gaps),
            "first_tokens_equal_tp1": all(x[0] == y[0] for n in ("r2d", "r3d")
                                          for x, y in zip(ref[n]["tokens"], run[n]["tokens"])),
            "tokens_equal_tp1": all(ref[n]["tokens"] == run[n]["tokens"] for n in ("r2d", "r3d")),
            "2d_equals_3d": run["r2d"] == run["r3d"],
            "seconds": run["_seconds"],
            "workers": run["_workers"],
        }
    control_gaps = _gaps(ref, runs["ray_ep2"], "ctl", "r2d")
    summary["control_mean_gap"] = sum(control_gaps) / len(control_gaps)
    summary["ray_ep2_equals_mp_ep2"] = all(runs["ray_ep2"][n] == runs["mp_ep2"][n] for n in adapters)
    summary["tp1_workers"] = ref["_workers"]
    one_bytes = ref["_workers"][0]["adapter_reads"]["bytes"]
    summary["ep2_rank_bytes_over_tp1"] = [w["adapter_reads"]["bytes"] / one_bytes for w in runs["ray_ep2"]["_workers"]]
    record("ray_executor_2gpu", summary)

    for key in ("ray_tp2", "ray_ep2"):
        workers = runs[key]["_workers"]
        assert len(workers) == 2 and len({w["pid"] for w in workers}) == 2
        assert all(w["registered"] and w["load_adapter_patched"] for w in workers), workers
        assert summary[key]["first_tokens_equal_tp1"] and summary[key]["mean_gap_vs_tp1"] < MEAN_TOL
        assert summary[key]["2d_equals_3d"]
    assert summary["ray_ep2_equals_mp_ep2"]
    assert summary["control_mean_gap"] > 10 * summary["ray_ep2"]["mean_gap_vs_tp1"]
    assert all(r < 0.9 for r in summary["ep2_rank_bytes_over_tp1"]), summary["ep2_rank_bytes_over_tp1"]


# ---------------------------------------------------------------------------------------------- Ray Serve LLM

NAMES = ("a", "b", "c", "d")
HUB_NAMES = ("e", "f")


def _models() -> list[tuple[str, dict[str, Any]]]:
    """Ten adapter choices: (adapter part of ``model``, body fields)."""
    return [("a", {}), ("b", {}), ("d", {}), ("e", {}), ("f", {}),
            ("a=0.7+b=0.3", {}), ("c+e", {}), ("c=0.5+f=-0.5", {}),
            ("", {"adapters": ["b", "d"], "adapter_weights": [0.5, 0.5]}),
            ("", {"adapters": ["a", "f"], "adapter_weights": [0.9, -0.4]})]


def _client(base: str) -> Any:
    import openai

    return openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0, timeout=600)


async def _complete(client: Any, model: str, prompt: list[int], body: dict[str, Any]) -> tuple[list[int], list[Any]]:
    r = await client.completions.create(model=model, prompt=prompt, max_tokens=N_TOKENS, temperature=0.0, logprobs=2,
                                        extra_body={**body, "ignore_eos": True, "return_tokens_as_token_ids": True})
    lp = r.choices[0].logprobs
    return [int(t.split(":")[1]) for t in lp.tokens], [dict(d) for d in lp.top_logprobs]


def _requests(ps: list[list[int]]) -> list[tuple[int, int]]:
    return [(m, p) for m in range(len(_models())) for p in range(len(ps))]


def _keep_ray_logs() -> None:
    """The tail of every Ray Serve log (controller, proxy, replicas) in one file under $OUT."""
    outd = os.environ.get("OUT")
    logs = Path("/tmp/ray/session_latest/logs")
    if not outd or not logs.is_dir():
        return
    parts = []
    for f in sorted([*logs.glob("serve/*.log"), *logs.glob("worker-*.err"), *logs.glob("raylet.err")]):
        text = f.read_text(errors="replace")
        if text.strip():
            parts.append(f"===== {f.name}\n{text[-20000:]}")
    (Path(outd) / "ray-logs.txt").write_text("\n".join(parts)[-8_000_000:])


def test_ray_serve_llm_two_replicas_serve_names_sources_and_mixes_like_one_engine(
        gpu_workdir: Path, hub: Any, record: Any) -> None:
    model = build_dense(gpu_workdir / "ray-dense")
    folder = gpu_workdir / "ray-adapters"
    build_adapters(model, folder, NAMES + HUB_NAMES, seed=30, targets=["q_proj", "v_proj", "down_proj"])
    files = {f"{n}/{f}": (folder / n / f).read_bytes() for n in HUB_NAMES
             for f in ("adapter_config.json", "adapter_model.safetensors")}
    sha = hub.repo("acme/ray-loras").commit(files)
    deploy = gpu_workdir / "ray-deploy.yaml"
    deploy.write_text("adapters:\n" + "".join(f"  {n}: {{source: '{folder / n}'}}\n" for n in NAMES)
                      + "".join(f"  {n}: {{source: 'hf:acme/ray-loras:{n}'}}\n" for n in HUB_NAMES))
    env_vars = {"VLLM_LORA_EXT_CONFIG": str(deploy), "HF_HUB_CACHE": os.environ["HF_HUB_CACHE"],
                "HF_ENDPOINT": os.environ["HF_ENDPOINT"], "HF_HUB_OFFLINE": "0",
                "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}
    ps = prompts(n=20, seed=21)
    reqs = _requests(ps)
    models = _models()

    # The reference: one `vllm serve` engine, each request alone.
    args = ["--served-model-name", "tiny", "--enable-lora", "--max-lora-rank", "16", "--max-loras", "4",
            "--max-cpu-loras", "8", "--enforce-eager", "--gpu-memory-utilization", "0.3", "--max-model-len", "256",
            "--dtype", "bfloat16", "--seed", "0"]
    with vllm_serve(model, args, env=dict(os.environ, **env_vars), log_path=gpu_workdir / "ray-ref-serve.log",
                    keep_log_as="ray-ref-serve.log") as srv:
        async def reference() -> dict[tuple[int, int], Any]:
            client = _client(srv["base"])
            return {(m, p): await _complete(client, models[m][0] or "tiny", ps[p], models[m][1]) for m, p in reqs}
        alone = asyncio.run(reference())

    # Ray Serve LLM: 2 replicas behind Ray's OpenAI router.
    import ray
    from ray import serve
    from ray.serve.llm import LLMConfig, build_openai_app

    from vllm_lora_ext.integration.plugin import worker_state
    from vllm_lora_ext.integration.ray import LoraExtLLMServer

    port = free_port()
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    ray.init(num_gpus=2, include_dashboard=False, object_store_memory=2 * 2**30, log_to_driver=True)
    # vLLM's engine process in each replica calls ray.init() itself: without RAY_ADDRESS (or a cluster started
    # with `ray start`) it starts a cluster of its own, where the replica's placement group does not exist.
    env_vars["RAY_ADDRESS"] = ray.get_runtime_context().gcs_address
    t0 = time.perf_counter()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        config = LLMConfig(
            model_loading_config={"model_id": "tiny", "model_source": str(model)},
            server_cls=LoraExtLLMServer,
            deployment_config={"num_replicas": 2},
            engine_kwargs={"enable_lora": True, "max_lora_rank": 16, "max_loras": 4, "max_cpu_loras": 8,
                           "enforce_eager": True, "gpu_memory_utilization": 0.3, "max_model_len": 256,
                           "dtype": "bfloat16", "seed": 0},
            runtime_env={"env_vars": env_vars},
        )
        serve.run(build_openai_app({"llm_configs": [config]}), blocking=False)
        started = time.perf_counter() - t0
        base = f"http://127.0.0.1:{port}"

        async def concurrent() -> list[Any]:
            client = _client(base)
            return await asyncio.gather(*[_complete(client, f"tiny:{models[m][0]}" if models[m][0] else "tiny",
                                                    ps[p], models[m][1]) for m, p in reqs], return_exceptions=True)
        t1 = time.perf_counter()
        got = asyncio.run(concurrent())
        wall = time.perf_counter() - t1

        status = serve.status().applications
        app = next(iter(status))
        server_name = next(n for n in status[app].deployments if n.startswith("LoraExtLLMServer"))
        handle = serve.get_deployment_handle(server_name, app_name=app)
        states: dict[int, Any] = {}
        for _ in range(60):
            for s in handle.collective_rpc.remote(method=worker_state).result():
                states[s["pid"]] = s
            if len(states) >= 2:
                break
    finally:
        _keep_ray_logs()
        serve.shutdown()
        ray.shutdown()

    errors = [repr(g)[:400] for g in got if isinstance(g, BaseException)]
    ties, mismatches = [], []
    for (m, p), g in zip(reqs, got):
        if isinstance(g, BaseException):
            continue
        want, top = alone[(m, p)]
        if g[0] != want:
            i = next(k for k, (x, y) in enumerate(zip(g[0], want)) if x != y)
            vals = sorted(top[i].values(), reverse=True)
            entry = {"model": models[m], "prompt": p, "position": i, "alone": want, "got": g[0], "alone_top2": top[i]}
            (ties if len(vals) >= 2 and vals[0] == vals[1] else mismatches).append(entry)
    record("ray_serve_llm_2_replicas", {
        "requests": len(reqs), "distinct_models": len(models), "errors": errors[:10], "error_count": len(errors),
        "exact_top2_ties": ties, "mismatches": mismatches[:20], "mismatch_count": len(mismatches),
        "serve_start_s": started, "wall_s": wall, "hub_commit": sha, "worker_states": list(states.values()),
        "distinct_outputs": len({tuple(v[0]) for v in alone.values()})})
    assert not errors, errors[:3]
    assert not mismatches, mismatches[:3]
    assert len(reqs) == 200
    assert len(states) >= 2 and all(s["registered"] and s["load_adapter_patched"] for s in states.values())
    assert len({tuple(v[0]) for v in alone.values()}) > len(ps)  # the adapters and mixes really differ
