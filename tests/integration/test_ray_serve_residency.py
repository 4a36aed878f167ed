"""Residency routing end to end in a real Ray Serve app on a local CPU-only Ray: 2 ``LoraExtLLMServer`` replicas
behind ``ResidencyRequestRouter``; each replica's report travels through Serve's controller to the router.

The replicas' engine is test_ray.py's stand-in (vLLM's real ``OpenAIServingModels`` with the plugin, no
generation) that also says which process served the request. Needs Ray Serve LLM importable next to vLLM
(Ray 2.60 with vLLM 0.33 here, Ray 2.58 with vLLM 0.26); skipped otherwise.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from factories import make_dense_adapter

sys.path.insert(0, str(Path(__file__).resolve().parent))  # test_ray's engine stand-in; the replicas import it too
try:
    from ray.serve.llm import LLMConfig

    from test_ray import _Engine
    from vllm_lora_ext.integration.ray import LoraExtLLMServer
    WHY = ""
except Exception as err:  # Ray missing, or Ray's LLM module not importable with this vLLM
    _Engine = object  # type: ignore[assignment,misc]
    WHY = f"{type(err).__name__}: {str(err)[:160]}"

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(bool(WHY), reason=f"Ray Serve LLM not importable: {WHY}")]
ROOT = Path(__file__).resolve().parents[2]


class PidEngine(_Engine):  # type: ignore[misc,valid-type]
    async def completions(self, request: Any, raw_request_info: Any = None) -> Any:
        async for item in super().completions(request, raw_request_info):
            yield {**item, "pid": os.getpid()}


@pytest.mark.parametrize("residency", [True, False])
def test_each_adapter_id_stays_on_the_replica_that_holds_it_in_a_real_serve_app(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, residency: bool) -> None:
    """With residency every id stays on the replica that first built it, and a new mix goes to a replica holding a
    component; without (no multiplexed loader, Serve's default router) ids spread over both replicas, each building
    them."""
    import ray
    from ray import serve
    from ray.serve.config import RequestRouterConfig
    from ray.llm._internal.serve.core.configs.openai_api_models import CompletionRequest

    a, b = make_dense_adapter(tmp_path / "a", seed=1), make_dense_adapter(tmp_path / "b", seed=2)
    cfg = tmp_path / "deploy.yaml"
    cfg.write_text(f"adapters:\n  style: {{source: '{a}'}}\n  domain: {{source: '{b}'}}\n")
    paths = [str(ROOT / "src"), str(ROOT / "tests"), str(ROOT / "tests" / "integration")]
    env = {"VLLM_LORA_EXT_CONFIG": str(cfg), "PYTHONPATH": os.pathsep.join(paths), "RAY_USAGE_STATS_ENABLED": "0"}
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    if ray.is_initialized():  # a Ray another test connected to (Serve's clients connect on first use)
        ray.shutdown()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False, runtime_env={"env_vars": env})
    try:
        lora = {"max_num_adapters_per_replica": 8} if residency else None
        config = LLMConfig(model_loading_config={"model_id": "base", "model_source": "/m"},
                           server_cls=LoraExtLLMServer, lora_config=lora)
        options: dict[str, Any] = {"name": "llm", "num_replicas": 2, "ray_actor_options": {"num_cpus": 1},
                                   "max_ongoing_requests": 8}
        if residency:
            options["request_router_config"] = RequestRouterConfig(
                request_router_class="vllm_lora_ext.integration.ray_routing:ResidencyRequestRouter")
        app = serve.deployment(LoraExtLLMServer).options(**options).bind(config, engine_cls=PidEngine)
        handle = serve.run(app, name="residency")

        def ask(model_id: str) -> int:
            stream = handle.options(multiplexed_model_id=model_id, stream=True).completions.remote(
                CompletionRequest(model=model_id, prompt="hi"))
            items = list(stream)
            assert len(items) == 1 and items[0]["lora"] is not None, items
            return int(items[0]["pid"])

        ids = ["base:style", "base:domain", "base:style=0.7+domain=0.3"]
        first = {}
        for model_id in ids:
            first[model_id] = ask(model_id)
            time.sleep(1.0)  # the replica pushes its ids every 0.1 s; the controller broadcasts them
        served = {model_id: {ask(model_id) for _ in range(10)} for model_id in ids}
        pids = {p for s in served.values() for p in s} | set(first.values())
    finally:
        serve.shutdown()
        ray.shutdown()
    if residency:  # (new ids go to their hash home, so all three may share a replica)
        assert all(served[m] == {first[m]} for m in ids), (first, served)  # every id stays where it was built
        assert first["base:style=0.7+domain=0.3"] in (first["base:style"], first["base:domain"])  # with a component
    else:  # 11 requests per id at random over 2 replicas: all 3 ids on one replica each: probability 2 ** -30
        assert len(pids) == 2
        assert any(len(served[m] | {first[m]}) == 2 for m in ids), (first, served)
